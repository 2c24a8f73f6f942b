//! The proposer a server starts with, from `speculative.method`, and why
//! (for the start-up log). `draft` loads the named draft, which must fit
//! the target: one that does not fails the start with a message naming the
//! fixes. `auto` (the default of `specgate serve` without `--config`,
//! `--draft` and `--speculative-method`) loads the draft only where it
//! fits, else speculates by n-gram prompt lookup (and the suffix pool), so
//! `--model` alone serves a model of any family.
//!
//! A draft fits when its tokenizer is the target's (every id the same
//! bytes and the same kind: vocabulary and special tokens, see
//! [`TextTokenizer::difference`]) and its output head has as many rows as
//! the target's: the engine hands token ids between the two models as
//! they are, so any other draft proposes tokens the target reads as
//! something else.

use super::draft_head;
use crate::config::{Config, SpeculativeMethod};
use crate::engine::ProposerKind;
use crate::tokenizer::TextTokenizer;
use anyhow::{Context, Result};
use specgate_verify::model::load_model;
use specgate_verify::Model;
use std::path::Path;

/// The proposer chosen at start.
pub(super) struct Choice {
    pub proposer: ProposerKind,
    /// The method in force: `draft`, `ngram` or `off` (never `auto`).
    pub method: SpeculativeMethod,
    /// Why this method, in words, for the start-up log.
    pub reason: String,
}

/// How a draft compares with the target, before its weights are loaded.
enum Fit {
    /// Its tokenizer is the target's.
    Same,
    /// Its tokenizer differs: how.
    Differs(String),
    /// Its tokenizer could not be read: why.
    Unknown(String),
}

/// Compares the tokenizer of the draft at `path` with the target's.
fn tokenizer_fit(path: &Path, target: &TextTokenizer) -> Fit {
    match crate::generate::load_tokenizer(path) {
        Ok(draft) => match target.difference(&draft) {
            None => Fit::Same,
            Some(d) => Fit::Differs(format!("the tokenizers differ (target against draft): {d}")),
        },
        Err(e) => Fit::Unknown(format!("{e:#}")),
    }
}

/// Why the loaded `draft` cannot serve `target`, if it cannot: an output
/// head of another width (a tokenizer can agree while the embedding rows,
/// padded differently, do not).
fn head_misfit(draft: &Model, target: &Model) -> Option<String> {
    let (d, t) = (draft.config().vocab_size, target.config().vocab_size);
    (d != t).then(|| format!("the draft's output head has {d} rows, the target's {t}"))
}

/// The error of a draft that was asked for and does not fit: what differs
/// and the ways out.
fn misfit_error(draft: &Path, why: &str) -> anyhow::Error {
    anyhow::anyhow!(
        "draft model {} does not fit the target: {why}. A draft must use the target's \
         tokenizer (the same vocabulary and special tokens). Fixes: a draft with the \
         target's tokenizer (--draft PATH or [draft] path), or speculation without a \
         draft model: --speculative-method ngram (prompt lookup) or --speculative-method off",
        draft.display()
    )
}

/// Loads the draft at `path` with its reduced head (`[draft] head_tokens`)
/// and warms it up.
fn load_draft(cfg: &Config, path: &Path) -> Result<Model> {
    tracing::info!(draft = %path.display(), "loading the draft model");
    let mut d =
        load_model(path).with_context(|| format!("loading draft model {}", path.display()))?;
    if let Some((list, ids)) = draft_head(cfg.draft.head_tokens.as_deref(), path)? {
        tracing::info!(list = %list.display(), tokens = ids.len(), "draft head reduced");
        d.restrict_head(&ids)?;
    }
    d.warm_up()?;
    Ok(d)
}

/// The proposer `cfg` asks for, against the loaded `target` and its
/// `tokenizer`.
///
/// Errors: method `draft` without `[draft] path`; a draft (method `draft`,
/// or `auto` once it fits by tokenizer) that cannot be loaded; method
/// `draft` with a draft that does not fit (the message names the fixes).
pub(super) fn choose(cfg: &Config, target: &Model, tokenizer: &TextTokenizer) -> Result<Choice> {
    let sp = &cfg.speculative;
    let ngram = |reason: String| {
        let pool = if sp.suffix.enabled {
            ", with the suffix pool"
        } else {
            ""
        };
        Choice {
            proposer: ProposerKind::Ngram {
                min_n: sp.ngram_min,
                max_n: sp.ngram_max,
            },
            method: SpeculativeMethod::Ngram,
            reason: format!("{reason}; speculating by n-gram prompt lookup{pool}"),
        }
    };
    let draft = |model: Model, reason: String| Choice {
        proposer: ProposerKind::Draft(model),
        method: SpeculativeMethod::Draft,
        reason,
    };
    match sp.method {
        SpeculativeMethod::Off => Ok(Choice {
            proposer: ProposerKind::None,
            method: SpeculativeMethod::Off,
            reason: "speculative.method = \"off\"".into(),
        }),
        SpeculativeMethod::Ngram => Ok(ngram("speculative.method = \"ngram\"".into())),
        SpeculativeMethod::Draft => {
            let path = cfg
                .draft
                .path
                .as_deref()
                .context("speculative.method = \"draft\" needs draft.path")?;
            match tokenizer_fit(path, tokenizer) {
                Fit::Same => {}
                Fit::Differs(why) => return Err(misfit_error(path, &why)),
                // A draft file without a tokenizer of its own can still
                // be right; only its head's width can be checked.
                Fit::Unknown(why) => tracing::warn!(
                    draft = %path.display(),
                    error = %why,
                    "cannot read the draft's tokenizer to compare it with the target's"
                ),
            }
            let d = load_draft(cfg, path)?;
            if let Some(why) = head_misfit(&d, target) {
                return Err(misfit_error(path, &why));
            }
            Ok(draft(d, "speculative.method = \"draft\"".into()))
        }
        SpeculativeMethod::Auto => {
            let Some(path) = cfg.draft.path.as_deref() else {
                return Ok(ngram("method auto and no draft model set".into()));
            };
            let named = format!("method auto: the draft {}", path.display());
            if !path.exists() {
                return Ok(ngram(format!("{named} is not there")));
            }
            match tokenizer_fit(path, tokenizer) {
                Fit::Same => {}
                Fit::Differs(why) => {
                    return Ok(ngram(format!("{named} does not fit the target, {why}")))
                }
                Fit::Unknown(why) => {
                    return Ok(ngram(format!(
                        "{named} has no tokenizer to compare with the target's ({why})"
                    )))
                }
            }
            let d = load_draft(cfg, path)?;
            match head_misfit(&d, target) {
                Some(why) => Ok(ngram(format!("{named} does not fit the target, {why}"))),
                None => Ok(draft(d, format!("{named} has the target's tokenizer"))),
            }
        }
    }
}

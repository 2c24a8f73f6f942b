//! One compiled grammar ([`LlgSource`]) and one request's position in it
//! ([`LlgConstraint`]): the [`TokenConstraint`] over an llguidance `Matcher`.
//!
//! The matcher holds the committed tokens followed by a tentative path (the
//! `pending` tokens of the last question). A new question keeps the common
//! prefix of the path and rolls back the rest, so walking a draft position
//! by position costs one token each. Masks are computed only when asked for
//! and cached per path position, so the masks computed while drafting serve
//! again for cutting the draft and for verification.
//!
//! llguidance puts a matcher into a terminal error state on any failed call,
//! so nothing forbidden is ever consumed: a token is checked first (against
//! the mask, or with llguidance's side-effect-free validation), and an
//! end-of-sequence id is never consumed, only recorded (the grammar is
//! complete there). A failed check leaves the state as it was; only an
//! internal llguidance failure breaks a constraint, and then every later
//! call fails too (`allowed`/`commit` with an error, `valid_prefix` 0,
//! `forced` nothing).

use std::sync::{Arc, Mutex};

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use specgate_verify::{ConstraintError, ConstraintSource, TokenConstraint, TokenMask};

use super::GrammarError;

/// A compiled grammar: a matcher in its start state, cloned per request.
pub(super) struct LlgSource {
    template: Mutex<Matcher>,
    label: String,
    vocab_size: usize,
    eos: Arc<[u32]>,
    jump_forward: bool,
}

impl std::fmt::Debug for LlgSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LlgSource")
            .field("grammar", &self.label)
            .field("vocab_size", &self.vocab_size)
            .finish_non_exhaustive()
    }
}

impl LlgSource {
    /// Compiles `grammar` for the factory's tokenizer and computes its first
    /// mask (which also warms the matcher's caches for every clone).
    ///
    /// Errors: [`GrammarError::Invalid`] naming `label` when llguidance
    /// rejects the grammar or nothing can start it.
    pub(super) fn new(
        factory: &ParserFactory,
        grammar: TopLevelGrammar,
        label: String,
        vocab_size: usize,
        eos: Arc<[u32]>,
        jump_forward: bool,
    ) -> Result<Self, GrammarError> {
        // llguidance may append a listing of the grammar ("  4 | rule: ..."):
        // clients get the reason only.
        let invalid = |e: String| {
            let reason: Vec<&str> = e.lines().filter(|l| !is_listing_line(l)).collect();
            GrammarError::Invalid(format!("{label}: {}", reason.join("\n")))
        };
        let mut matcher = Matcher::new(factory.create_parser(grammar));
        if let Some(e) = matcher.get_error() {
            return Err(invalid(e));
        }
        matcher.compute_mask().map_err(|e| invalid(e.to_string()))?;
        Ok(Self {
            template: Mutex::new(matcher),
            label,
            vocab_size,
            eos,
            jump_forward,
        })
    }
}

/// Whether `line` is of a grammar listing: a line number, then `|`.
fn is_listing_line(line: &str) -> bool {
    let rest = line.trim_start();
    let digits = rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
    digits > 0 && rest[digits..].trim_start().starts_with('|')
}

impl ConstraintSource for LlgSource {
    fn start(&self) -> Result<Box<dyn TokenConstraint>, ConstraintError> {
        let matcher = self
            .template
            .lock()
            .map_err(|_| ConstraintError("grammar template lock poisoned".into()))?
            .deep_clone();
        if let Some(e) = matcher.get_error() {
            return Err(ConstraintError(e));
        }
        let mut c = LlgConstraint::new(matcher, self.vocab_size, self.eos.clone());
        c.jump_forward = self.jump_forward;
        Ok(Box::new(c))
    }
}

/// A token on the tentative path.
#[derive(Debug, Clone, Copy)]
struct Step {
    token: u32,
    /// `false` for an end-of-sequence id that completed the grammar (the
    /// matcher never sees those).
    consumed: bool,
}

/// How a token is checked before it joins the path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Check {
    /// Against the mask at its position (what masked sampling can emit).
    Mask,
    /// Against the grammar's bytes (also accepts a non-canonical spelling of
    /// forced text, which the mask does not offer).
    Grammar,
}

/// One request's state in a compiled grammar.
///
/// Invariants: the matcher has consumed the committed tokens and the
/// consumed steps of `path`, nothing else; `masks.len() == path.len() + 1`
/// and `masks[i]`, when present, is the mask after the committed tokens and
/// `path[..i]`; once a step is an unconsumed end-of-sequence id, every later
/// step is too.
pub(super) struct LlgConstraint {
    matcher: Matcher,
    vocab_size: usize,
    eos: Arc<[u32]>,
    /// The committed tokens completed the grammar (an end-of-sequence id).
    done: bool,
    path: Vec<Step>,
    masks: Vec<Option<TokenMask>>,
    broken: Option<String>,
    /// Whether [`TokenConstraint::forced`] answers (see
    /// [`super::Grammars::with_jump_forward`]).
    jump_forward: bool,
}

impl LlgConstraint {
    fn new(matcher: Matcher, vocab_size: usize, eos: Arc<[u32]>) -> Self {
        Self {
            matcher,
            vocab_size,
            eos,
            done: false,
            path: Vec::new(),
            masks: vec![None],
            broken: None,
            jump_forward: true,
        }
    }

    fn is_eos(&self, t: u32) -> bool {
        self.eos.contains(&t)
    }

    /// Whether the grammar is complete at the end of the path.
    fn complete_at_cursor(&self) -> bool {
        self.done || self.path.last().is_some_and(|s| !s.consumed)
    }

    fn eos_mask(&self) -> TokenMask {
        let mut m = TokenMask::none(self.vocab_size);
        self.eos.iter().for_each(|&t| m.allow(t));
        m
    }

    /// Records an llguidance failure: the constraint is unusable from now on.
    fn fail(&mut self, what: &str, e: impl std::fmt::Display) -> ConstraintError {
        let msg = format!("{what}: {e}");
        self.broken = Some(msg.clone());
        ConstraintError(msg)
    }

    fn check_usable(&self) -> Result<(), ConstraintError> {
        match &self.broken {
            Some(msg) => Err(ConstraintError(msg.clone())),
            None => Ok(()),
        }
    }

    /// The mask at the end of the path (computed now or cached).
    fn cursor_mask(&mut self) -> Result<&TokenMask, ConstraintError> {
        let at = self.path.len();
        if self.masks[at].is_none() {
            let mask = if self.complete_at_cursor() || self.matcher.is_stopped() {
                self.eos_mask()
            } else {
                // Allows the end-of-sequence ids exactly where the grammar
                // can be complete (the trie holds all of them).
                match self.matcher.compute_mask() {
                    Ok(v) => TokenMask::from_words(v.as_slice().to_vec(), self.vocab_size),
                    Err(e) => return Err(self.fail("computing the token mask", e)),
                }
            };
            self.masks[at] = Some(mask);
        }
        Ok(self.masks[at].as_ref().expect("mask set above"))
    }

    /// Appends `t` to the path if `check` allows it there; `Ok(false)` and no
    /// change otherwise.
    fn step(&mut self, t: u32, check: Check) -> Result<bool, ConstraintError> {
        if t as usize >= self.vocab_size {
            return Ok(false);
        }
        if check == Check::Mask && !self.cursor_mask()?.is_allowed(t) {
            return Ok(false);
        }
        let consumed = if self.complete_at_cursor() || self.is_eos(t) {
            if !self.is_eos(t) {
                return Ok(false);
            }
            let complete = self.complete_at_cursor() || self.matcher.is_stopped() || {
                match self.matcher.is_accepting() {
                    Ok(a) => a,
                    Err(e) => return Err(self.fail("checking for the grammar's end", e)),
                }
            };
            if !complete {
                return Ok(false);
            }
            false
        } else {
            if self.matcher.is_stopped() {
                return Ok(false);
            }
            // Validates before consuming: a forbidden token changes nothing.
            match self.matcher.try_consume_tokens(&[t]) {
                Ok(1) => true,
                Ok(_) => return Ok(false),
                Err(e) => return Err(self.fail("consuming a token", e)),
            }
        };
        self.path.push(Step { token: t, consumed });
        self.masks.push(None);
        Ok(true)
    }

    /// Shortens the path to `keep` steps, rolling the matcher back.
    fn truncate(&mut self, keep: usize) -> Result<(), ConstraintError> {
        let n = self.path[keep..].iter().filter(|s| s.consumed).count();
        if n > 0 {
            if let Err(e) = self.matcher.rollback(n) {
                return Err(self.fail("rolling back", e));
            }
        }
        self.path.truncate(keep);
        self.masks.truncate(keep + 1);
        Ok(())
    }

    /// Moves the path to the longest prefix of `tokens` that `check` allows,
    /// reusing what the path already holds; returns that prefix's length.
    fn seek(&mut self, tokens: &[u32], check: Check) -> Result<usize, ConstraintError> {
        self.check_usable()?;
        let mut keep = self
            .path
            .iter()
            .zip(tokens)
            .take_while(|(s, &t)| s.token == t)
            .count();
        if check == Check::Mask {
            // A step may have joined by the grammar check: recheck by mask,
            // from the first position whose mask is not at hand.
            let checked = self.masks[..keep]
                .iter()
                .zip(tokens)
                .position(|(m, &t)| !m.as_ref().is_some_and(|m| m.is_allowed(t)));
            if let Some(i) = checked {
                if self.masks[i].is_some() {
                    // Its mask forbids tokens[i].
                    self.truncate(i)?;
                    return Ok(i);
                }
                keep = i;
            }
        }
        self.truncate(keep)?;
        for (i, &t) in tokens.iter().enumerate().skip(keep) {
            if !self.step(t, check)? {
                return Ok(i);
            }
        }
        Ok(tokens.len())
    }
}

impl TokenConstraint for LlgConstraint {
    /// Errors: a `pending` token the grammar forbids (a caller bug), or an
    /// llguidance failure (the constraint is unusable from then on).
    fn allowed(&mut self, pending: &[u32]) -> Result<TokenMask, ConstraintError> {
        let n = self.seek(pending, Check::Grammar)?;
        if n < pending.len() {
            return Err(ConstraintError(format!(
                "pending token {} (position {n}) is not allowed by the grammar",
                pending[n]
            )));
        }
        self.cursor_mask().cloned()
    }

    /// Each token must be in the mask at its position (so a draft cut here
    /// never holds a token that masked sampling could not produce);
    /// end-of-sequence ids count where the grammar is complete. 0 when the
    /// constraint is broken.
    fn valid_prefix(&mut self, tokens: &[u32]) -> usize {
        self.seek(tokens, Check::Mask).unwrap_or(0)
    }

    /// The canonical tokens of the text the grammar forces next (llguidance's
    /// jump-forward; the last forced token is left out when a longer token
    /// could also start there). Empty when the grammar is complete, when
    /// `pending` is not allowed, or when the constraint is broken.
    fn forced(&mut self, pending: &[u32]) -> Vec<u32> {
        if !self.jump_forward {
            return Vec::new();
        }
        match self.seek(pending, Check::Grammar) {
            Ok(n) if n == pending.len() => {}
            _ => return Vec::new(),
        }
        if self.complete_at_cursor() || self.matcher.is_stopped() {
            return Vec::new();
        }
        let ff = self.matcher.compute_ff_tokens();
        if let Some(e) = self.matcher.get_error() {
            self.fail("computing forced tokens", e);
            return Vec::new();
        }
        ff
    }

    /// Checks every token against the grammar's bytes before consuming it,
    /// so a forbidden token is an error that leaves the committed state as
    /// it was and later calls work. Tokens spelling forced text in another
    /// way than the mask offers are accepted.
    fn commit(&mut self, tokens: &[u32]) -> Result<(), ConstraintError> {
        let n = self.seek(tokens, Check::Grammar)?;
        if n < tokens.len() {
            return Err(ConstraintError(format!(
                "token {} (position {n} of {}) is not allowed by the grammar",
                tokens[n],
                tokens.len()
            )));
        }
        self.done = self.complete_at_cursor();
        self.path.clear();
        let last = self.masks.pop().flatten();
        self.masks.clear();
        self.masks.push(last);
        Ok(())
    }
}

//! Hugging Face model directories: builds a [`TextTokenizer`] from `tokenizer.json` plus
//! the files next to it that say how the model is prompted and when it stops.
//!
//! Owns the parsing of `tokenizer_config.json` (`chat_template` as a string or as a list
//! of `{name, template}` of which `"default"` is used, `bos_token`/`eos_token` as strings
//! or `{"content": ...}` objects, `add_bos_token`, the `added_tokens_decoder` special
//! tokens), of `chat_template.jinja` (newer transformers save the template there; it wins
//! over the config's, as in transformers), and of `generation_config.json`
//! (`eos_token_id` as an int or a list, `bos_token_id`). Every file but `tokenizer.json`
//! is optional; a file that is present but malformed is a
//! [`TokenizerError::HfFile`] naming it.
//!
//! A directory without `tokenizer.json` but with `tiktoken.model` (Kimi K2/K3) gets its
//! vocabulary from [`super::tiktoken`] instead (and `config.json`'s `vocab_size` and
//! `eos_token_id`); everything else above applies unchanged.

use std::path::Path;

use serde_json::Value;
use tokenizers::{AddedToken, Tokenizer};

use super::tiktoken::{self, TIKTOKEN_MODEL};
use super::{TemplateState, TextTokenizer, TokenizerError, END_OF_GENERATION_TEXTS};

/// The vocabulary file (required).
pub const TOKENIZER_JSON: &str = "tokenizer.json";
/// Chat template, BOS/EOS texts and special tokens (optional).
pub const TOKENIZER_CONFIG: &str = "tokenizer_config.json";
/// The chat template as its own file (optional; wins over `tokenizer_config.json`'s).
pub const CHAT_TEMPLATE_JINJA: &str = "chat_template.jinja";
/// Generation defaults; its `eos_token_id`s stop generation (optional).
pub const GENERATION_CONFIG: &str = "generation_config.json";

/// `chat_template` of `tokenizer_config.json` as written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum TemplateField {
    /// A single template (the usual form).
    Source(String),
    /// A list of named templates without a `"default"` one: the names found.
    NoDefault(Vec<String>),
}

/// One `added_tokens_decoder` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AddedEntry {
    pub(crate) id: u32,
    pub(crate) content: String,
    pub(crate) special: bool,
}

/// What `tokenizer_config.json` says, before it is checked against the vocabulary.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct TokenizerConfig {
    pub(crate) chat_template: Option<TemplateField>,
    pub(crate) bos_token: Option<String>,
    pub(crate) eos_token: Option<String>,
    pub(crate) add_bos_token: Option<bool>,
    /// Sorted by id.
    pub(crate) added_tokens: Vec<AddedEntry>,
}

/// What `generation_config.json` says about token ids.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct GenerationConfig {
    pub(crate) eos_token_ids: Vec<u32>,
    pub(crate) bos_token_id: Option<u32>,
}

/// Parses `tokenizer_config.json` text. Keys other than the ones this module reads are
/// ignored (the file holds many that only matter to Python). Errors: the reason, for the
/// caller to put next to the file name.
pub(crate) fn parse_tokenizer_config(text: &str) -> Result<TokenizerConfig, String> {
    let v: Value = serde_json::from_str(text).map_err(|e| format!("not valid JSON: {e}"))?;
    let obj = v.as_object().ok_or("not a JSON object")?;
    let chat_template = match obj.get("chat_template") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(TemplateField::Source(s.clone())),
        Some(Value::Array(list)) => Some(named_templates(list)?),
        Some(_) => return Err("`chat_template` is neither a string nor a list".into()),
    };
    let add_bos_token = match obj.get("add_bos_token") {
        None | Some(Value::Null) => None,
        Some(Value::Bool(b)) => Some(*b),
        Some(_) => return Err("`add_bos_token` is not a bool".into()),
    };
    let mut added_tokens = Vec::new();
    match obj.get("added_tokens_decoder") {
        None | Some(Value::Null) => {}
        Some(Value::Object(map)) => {
            for (id, entry) in map {
                let id: u32 = id
                    .parse()
                    .map_err(|_| format!("`added_tokens_decoder` key {id:?} is not a token id"))?;
                let content = entry
                    .get("content")
                    .and_then(Value::as_str)
                    .ok_or_else(|| {
                        format!("`added_tokens_decoder` entry {id} has no string `content`")
                    })?;
                let special = match entry.get("special") {
                    None => false,
                    Some(Value::Bool(b)) => *b,
                    Some(_) => {
                        return Err(format!(
                            "`added_tokens_decoder` entry {id}: `special` is not a bool"
                        ))
                    }
                };
                added_tokens.push(AddedEntry {
                    id,
                    content: content.to_owned(),
                    special,
                });
            }
        }
        Some(_) => return Err("`added_tokens_decoder` is not an object".into()),
    }
    added_tokens.sort_by_key(|t| t.id);
    Ok(TokenizerConfig {
        chat_template,
        bos_token: token_text(obj.get("bos_token"), "bos_token")?,
        eos_token: token_text(obj.get("eos_token"), "eos_token")?,
        add_bos_token,
        added_tokens,
    })
}

/// A list of `{"name": .., "template": ..}`: the `"default"` one, as transformers picks
/// when the caller names none.
fn named_templates(list: &[Value]) -> Result<TemplateField, String> {
    let mut names = Vec::with_capacity(list.len());
    for (i, item) in list.iter().enumerate() {
        let field = |key: &str| {
            item.get(key)
                .and_then(Value::as_str)
                .ok_or_else(|| format!("`chat_template` entry {i} has no string `{key}`"))
        };
        let (name, template) = (field("name")?, field("template")?);
        if name == "default" {
            return Ok(TemplateField::Source(template.to_owned()));
        }
        names.push(name.to_owned());
    }
    Ok(TemplateField::NoDefault(names))
}

/// `bos_token`/`eos_token`: a string, an AddedToken object (`{"content": ..}`) or null.
fn token_text(v: Option<&Value>, key: &str) -> Result<Option<String>, String> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Object(o)) => match o.get("content") {
            Some(Value::String(s)) => Ok(Some(s.clone())),
            _ => Err(format!("`{key}` object has no string `content`")),
        },
        Some(_) => Err(format!("`{key}` is neither a string nor an object")),
    }
}

/// Parses `generation_config.json` text (`eos_token_id`: int, list of ints or null;
/// `bos_token_id`: int or null). Errors: the reason.
pub(crate) fn parse_generation_config(text: &str) -> Result<GenerationConfig, String> {
    let v: Value = serde_json::from_str(text).map_err(|e| format!("not valid JSON: {e}"))?;
    let obj = v.as_object().ok_or("not a JSON object")?;
    let id = |x: &Value, key: &str| {
        x.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| format!("`{key}` holds {x}, not a token id"))
    };
    let eos_token_ids = match obj.get("eos_token_id") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(list)) => list
            .iter()
            .map(|x| id(x, "eos_token_id"))
            .collect::<Result<_, _>>()?,
        Some(x) => vec![id(x, "eos_token_id")?],
    };
    let bos_token_id = match obj.get("bos_token_id") {
        None | Some(Value::Null) => None,
        Some(x) => Some(id(x, "bos_token_id")?),
    };
    Ok(GenerationConfig {
        eos_token_ids,
        bos_token_id,
    })
}

/// The text of an optional file: `None` when it does not exist.
fn read_optional(path: &Path) -> Result<Option<String>, TokenizerError> {
    match std::fs::read_to_string(path) {
        Ok(s) => Ok(Some(s)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TokenizerError::Io {
            path: path.to_owned(),
            source,
        }),
    }
}

fn hf_file(path: &Path, reason: impl Into<String>) -> TokenizerError {
    TokenizerError::HfFile {
        path: path.to_owned(),
        reason: reason.into(),
    }
}

/// Reads and parses an optional file with `parse`; absent gives the default.
fn parsed<T: Default>(
    path: &Path,
    parse: impl FnOnce(&str) -> Result<T, String>,
) -> Result<T, TokenizerError> {
    match read_optional(path)? {
        None => Ok(T::default()),
        Some(text) => parse(&text).map_err(|reason| hf_file(path, reason)),
    }
}

/// Makes every `added_tokens_decoder` entry an added token of `inner` with its declared
/// id and specialness. `tokenizer.json` normally lists them already (then nothing
/// changes); an entry it lacks is appended, which only keeps its id when that id is the
/// next free one. Errors: an entry whose text has another id in `tokenizer.json`, or
/// whose id cannot be given to it.
fn register_added(
    inner: &mut Tokenizer,
    entries: &[AddedEntry],
    path: &Path,
) -> Result<(), TokenizerError> {
    for e in entries {
        let known = inner.get_added_tokens_decoder().get(&e.id).cloned();
        match (inner.token_to_id(&e.content), known) {
            (Some(id), Some(t)) if id == e.id && t.special == e.special => continue,
            (Some(id), _) if id != e.id => {
                return Err(hf_file(
                    path,
                    format!(
                        "added token {:?} is id {} here but {id} in {TOKENIZER_JSON}",
                        e.content, e.id
                    ),
                ))
            }
            (None, _) if e.id != next_free_id(inner) => {
                let next = next_free_id(inner);
                return Err(hf_file(
                    path,
                    format!(
                        "added token {:?} (id {}) is not in {TOKENIZER_JSON} (next free id {next})",
                        e.content, e.id
                    ),
                ));
            }
            _ => {}
        }
        let token = AddedToken::from(e.content.clone(), e.special);
        let added = if e.special {
            inner.add_special_tokens([token])
        } else {
            inner.add_tokens([token])
        };
        added.map_err(|err| hf_file(path, format!("adding token {:?}: {err}", e.content)))?;
        if inner.token_to_id(&e.content) != Some(e.id) {
            return Err(hf_file(
                path,
                format!("added token {:?} did not get id {}", e.content, e.id),
            ));
        }
    }
    Ok(())
}

/// One past the largest id of `inner`, added tokens included: the id the `tokenizers`
/// library gives the next new token.
fn next_free_id(inner: &Tokenizer) -> u32 {
    inner.get_vocab(true).values().max().map_or(0, |&m| m + 1)
}

/// Whether `tokenizer.json`'s post-processor starts every single sequence with `bos`
/// (a `TemplateProcessing`, alone or in a `Sequence`, as Llama 3 files have): what
/// transformers adds when `tokenizer_config.json` does not say `add_bos_token`.
fn post_processor_adds(inner: &Tokenizer, bos: &str) -> bool {
    let Some(pp) = inner.get_post_processor() else {
        return false;
    };
    let Ok(v) = serde_json::to_value(pp) else {
        return false;
    };
    let starts_with_bos = |p: &Value| {
        p.get("type").and_then(Value::as_str) == Some("TemplateProcessing")
            && p.pointer("/single/0/SpecialToken/id")
                .and_then(Value::as_str)
                == Some(bos)
    };
    starts_with_bos(&v)
        || v.get("processors")
            .and_then(Value::as_array)
            .is_some_and(|ps| ps.iter().any(starts_with_bos))
}

impl TextTokenizer {
    /// Builds the tokenizer of a Hugging Face model directory: `tokenizer.json` (required),
    /// `tokenizer_config.json`, `chat_template.jinja` and `generation_config.json` (each
    /// optional).
    ///
    /// - Chat template: `chat_template.jinja`, else the config's `chat_template` (the
    ///   `"default"` entry of a list; a list without one makes
    ///   [`apply_chat_template`](Self::apply_chat_template) fail naming the list's
    ///   entries). None at all: [`TokenizerError::NoChatTemplate`] when used.
    /// - BOS: the config's `bos_token`, else `generation_config.json`'s `bos_token_id`.
    ///   It is prepended by `encode(.., true)` when the config's `add_bos_token` says so,
    ///   or, without that key, when `tokenizer.json`'s post-processor starts sequences
    ///   with it.
    /// - EOS: the config's `eos_token`, else the first `eos_token_id`. The end-of-generation
    ///   ids are that EOS, every `eos_token_id`, and the special added tokens named like a
    ///   turn end (`<|im_end|>`, `<|eot_id|>`, ...), without duplicates.
    /// - `added_tokens_decoder` entries become added tokens with their ids and specialness.
    ///
    /// Kimi directories (no `tokenizer.json`, a `tiktoken.model`): the vocabulary is the
    /// tiktoken ranks, 258 special (control) ids after them named by
    /// `added_tokens_decoder` (else `<|reserved_token_{id}|>`) and unused `[PAD{id}]` rows
    /// up to `config.json`'s `vocab_size`, exactly as llama.cpp's GGUF conversion lists
    /// them, so both encode alike (and as tiktoken does). `config.json`'s
    /// `eos_token_id` (K3: `<|end_of_msg|>`, the turn end) is then the declared EOS, as
    /// the converter writes it, and the config's `eos_token` stops generation too.
    ///
    /// Errors: [`TokenizerError::Json`] if `tokenizer.json` is missing or unreadable (and
    /// there is no `tiktoken.model`); [`TokenizerError::Tiktoken`] naming the file and
    /// line for a malformed `tiktoken.model`;
    /// [`TokenizerError::Io`] if another file exists but cannot be read;
    /// [`TokenizerError::HfFile`] naming the file if it is malformed, names a token that
    /// is not in the vocabulary, or gives an id outside it.
    pub fn from_hf_dir(dir: &Path) -> Result<Self, TokenizerError> {
        let json_path = dir.join(TOKENIZER_JSON);
        let tc_path = dir.join(TOKENIZER_CONFIG);
        let gc_path = dir.join(GENERATION_CONFIG);
        let tiktoken_dir = !json_path.exists() && dir.join(TIKTOKEN_MODEL).is_file();
        let (inner, tc, missing_bytes, unused, model_eos) = if tiktoken_dir {
            let tc = parsed(&tc_path, parse_tokenizer_config)?;
            let v = tiktoken::load_kimi_dir(dir, &tc)?;
            (v.inner, tc, v.missing_bytes, v.unused, v.eos_token_ids)
        } else {
            let mut inner = Tokenizer::from_file(&json_path).map_err(|e| TokenizerError::Json {
                path: json_path.clone(),
                message: e.to_string(),
            })?;
            let tc = parsed(&tc_path, parse_tokenizer_config)?;
            register_added(&mut inner, &tc.added_tokens, &tc_path)?;
            (inner, tc, Vec::new(), Vec::new(), Vec::new())
        };
        let gc = parsed(&gc_path, parse_generation_config)?;

        let vocab_size = next_free_id(&inner) as usize;
        let by_text = |text: &Option<String>, key: &str| -> Result<Option<u32>, TokenizerError> {
            text.as_deref()
                .map(|t| {
                    inner.token_to_id(t).ok_or_else(|| {
                        hf_file(&tc_path, format!("`{key}` {t:?} is not in the vocabulary"))
                    })
                })
                .transpose()
        };
        let check_id = |id: u32, key: &str| {
            if (id as usize) < vocab_size {
                Ok(id)
            } else {
                Err(hf_file(
                    &gc_path,
                    format!("`{key}` {id} is outside the {vocab_size}-token vocabulary"),
                ))
            }
        };
        let bos = match by_text(&tc.bos_token, "bos_token")? {
            Some(id) => Some(id),
            None => gc
                .bos_token_id
                .map(|id| check_id(id, "bos_token_id"))
                .transpose()?,
        };
        let gen_eos = gc
            .eos_token_ids
            .iter()
            .map(|&id| check_id(id, "eos_token_id"))
            .collect::<Result<Vec<u32>, _>>()?;
        let tc_eos = by_text(&tc.eos_token, "eos_token")?;
        let eos = model_eos
            .first()
            .copied()
            .or(tc_eos)
            .or(gen_eos.first().copied());
        let mut eos_ids: Vec<u32> = Vec::new();
        for id in eos
            .into_iter()
            .chain(model_eos)
            .chain(tc_eos)
            .chain(gen_eos)
        {
            if !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        }
        extend_turn_ends(&inner, &mut eos_ids);
        let add_bos = match (tc.add_bos_token, bos.and_then(|id| inner.id_to_token(id))) {
            (Some(flag), _) => flag,
            (None, Some(text)) => post_processor_adds(&inner, &text),
            (None, None) => false,
        };

        let jinja_path = dir.join(CHAT_TEMPLATE_JINJA);
        let (template_source, template) = match (read_optional(&jinja_path)?, tc.chat_template) {
            (Some(src), _) | (None, Some(TemplateField::Source(src))) => {
                (Some(src.clone()), TemplateState::new(Some(src)))
            }
            (None, Some(TemplateField::NoDefault(names))) => (
                None,
                TemplateState::Invalid(format!(
                    "{} lists chat templates {names:?} but none named \"default\"",
                    tc_path.display()
                )),
            ),
            (None, None) => (None, TemplateState::Missing),
        };
        Ok(Self {
            piece_bytes: super::pieces::default_piece_bytes(&inner),
            inner,
            vocab_size,
            bos,
            eos,
            pad: None,
            add_bos,
            eos_ids,
            missing_bytes,
            unused,
            template,
            template_source,
        })
    }
}

/// Appends (sorted, without duplicates) the special added tokens named like a turn end.
pub(crate) fn extend_turn_ends(inner: &Tokenizer, eos_ids: &mut Vec<u32>) {
    let mut extra: Vec<u32> = inner
        .get_added_tokens_decoder()
        .into_iter()
        .filter(|(_, t)| t.special && END_OF_GENERATION_TEXTS.contains(&t.content.as_str()))
        .map(|(id, _)| id)
        .collect();
    extra.sort_unstable();
    for id in extra {
        if !eos_ids.contains(&id) {
            eos_ids.push(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::tests::tiny;
    use crate::tokenizer::ChatMessage;
    use std::path::PathBuf;

    #[test]
    fn chat_template_string_list_and_missing_default() {
        let c = parse_tokenizer_config(r#"{"chat_template": "{{ x }}", "model_max_length": 9}"#)
            .unwrap();
        assert_eq!(
            c.chat_template,
            Some(TemplateField::Source("{{ x }}".into()))
        );
        let c = parse_tokenizer_config(
            r#"{"chat_template": [{"name": "tool_use", "template": "T"},
                                  {"name": "default", "template": "D"}]}"#,
        )
        .unwrap();
        assert_eq!(c.chat_template, Some(TemplateField::Source("D".into())));
        let c = parse_tokenizer_config(r#"{"chat_template": [{"name": "rag", "template": "R"}]}"#)
            .unwrap();
        assert_eq!(
            c.chat_template,
            Some(TemplateField::NoDefault(vec!["rag".into()]))
        );
        assert_eq!(
            parse_tokenizer_config("{}").unwrap(),
            TokenizerConfig::default()
        );
        for bad in [
            r#"{"chat_template": 3}"#,
            r#"{"chat_template": [{"name": "default"}]}"#,
            r#"{"add_bos_token": "yes"}"#,
            r#"[1]"#,
            "{",
        ] {
            assert!(parse_tokenizer_config(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn special_tokens_as_strings_or_objects() {
        let c = parse_tokenizer_config(
            r#"{"bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": false},
                "eos_token": "</s>", "add_bos_token": true,
                "added_tokens_decoder": {
                  "7": {"content": "<b>", "special": false},
                  "3": {"content": "<a>", "special": true}}}"#,
        )
        .unwrap();
        assert_eq!(c.bos_token.as_deref(), Some("<s>"));
        assert_eq!(c.eos_token.as_deref(), Some("</s>"));
        assert_eq!(c.add_bos_token, Some(true));
        let ids: Vec<(u32, &str, bool)> = c
            .added_tokens
            .iter()
            .map(|t| (t.id, t.content.as_str(), t.special))
            .collect();
        assert_eq!(ids, [(3, "<a>", true), (7, "<b>", false)]);
        let c = parse_tokenizer_config(r#"{"bos_token": null, "eos_token": null}"#).unwrap();
        assert_eq!((c.bos_token, c.eos_token), (None, None));
        for bad in [
            r#"{"eos_token": {"text": "</s>"}}"#,
            r#"{"eos_token": 2}"#,
            r#"{"added_tokens_decoder": {"x": {"content": "a"}}}"#,
            r#"{"added_tokens_decoder": {"1": {"special": true}}}"#,
        ] {
            assert!(parse_tokenizer_config(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn generation_config_eos_int_or_list() {
        let g = parse_generation_config(r#"{"eos_token_id": 5, "bos_token_id": 1}"#).unwrap();
        assert_eq!((g.eos_token_ids, g.bos_token_id), (vec![5], Some(1)));
        let g = parse_generation_config(r#"{"eos_token_id": [9, 4], "temperature": 0.6}"#).unwrap();
        assert_eq!((g.eos_token_ids, g.bos_token_id), (vec![9, 4], None));
        assert_eq!(
            parse_generation_config("{}").unwrap(),
            GenerationConfig::default()
        );
        for bad in [
            r#"{"eos_token_id": -1}"#,
            r#"{"eos_token_id": ["a"]}"#,
            "nope",
        ] {
            assert!(parse_generation_config(bad).is_err(), "{bad}");
        }
    }

    /// A directory holding the tiny vocabulary's tokenizer.json and the given files.
    fn dir_with(name: &str, files: &[(&str, &str)]) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("specgate-hfdir-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        tiny()
            .save_tokenizer_json(&dir.join(TOKENIZER_JSON))
            .unwrap();
        for (file, text) in files {
            std::fs::write(dir.join(file), text).unwrap();
        }
        dir
    }

    #[test]
    fn directory_reads_template_bos_eos_and_generation_eos() {
        let t = tiny();
        let id = |s: &str| t.token_to_id(s).unwrap();
        let config = serde_json::json!({
            "chat_template": [{"name": "default", "template": "[{{ bos_token }}|{% for m in messages %}{{ m.content }}{% endfor %}|{{ eos_token }}]"}],
            "bos_token": {"content": "<|endoftext|>"},
            "eos_token": "<|im_end|>",
            "add_bos_token": true,
        });
        let dir = dir_with(
            "full",
            &[
                (TOKENIZER_CONFIG, &config.to_string()),
                (GENERATION_CONFIG, r#"{"eos_token_id": [258, 265]}"#),
            ],
        );
        let d = TextTokenizer::from_hf_dir(&dir).unwrap();
        assert_eq!(d.bos_token_id(), Some(id("<|endoftext|>")));
        assert!(d.add_bos_token());
        assert_eq!(
            d.encode("hello", true).unwrap(),
            [id("<|endoftext|>"), id("hello")]
        );
        assert_eq!(d.eos_token_id(), Some(id("<|im_end|>")));
        // Declared EOS, then generation_config's ids, then turn-end specials.
        assert_eq!(
            d.eos_token_ids(),
            [id("<|im_end|>"), 258, id("<|endoftext|>")]
        );
        let msgs = [ChatMessage::new("user", "hi")];
        assert_eq!(
            d.apply_chat_template(&msgs, true).unwrap(),
            "[<|endoftext|>|hi|<|im_end|>]"
        );
        // chat_template.jinja wins over the config's template.
        std::fs::write(dir.join(CHAT_TEMPLATE_JINJA), "J{{ messages[0].content }}").unwrap();
        let d = TextTokenizer::from_hf_dir(&dir).unwrap();
        assert_eq!(d.apply_chat_template(&msgs, true).unwrap(), "Jhi");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn missing_optional_files_are_fine_and_bad_ones_name_the_file() {
        let dir = dir_with("bare", &[]);
        let d = TextTokenizer::from_hf_dir(&dir).unwrap();
        assert!(matches!(
            d.apply_chat_template(&[], true),
            Err(TokenizerError::NoChatTemplate)
        ));
        assert_eq!(d.bos_token_id(), None);
        // Only the turn-end specials of tokenizer.json stop generation.
        let t = tiny();
        let id = |s: &str| t.token_to_id(s).unwrap();
        assert_eq!(d.eos_token_ids(), [id("<|endoftext|>"), id("<|im_end|>")]);
        std::fs::remove_dir_all(&dir).ok();

        let cases: [(&str, &str, &str); 5] = [
            (TOKENIZER_CONFIG, "{not json", "not valid JSON"),
            (TOKENIZER_CONFIG, r#"{"eos_token": "<nope>"}"#, "<nope>"),
            (
                TOKENIZER_CONFIG,
                r#"{"added_tokens_decoder": {"5": {"content": "<|im_end|>", "special": true}}}"#,
                "<|im_end|>",
            ),
            (GENERATION_CONFIG, r#"{"eos_token_id": 100000}"#, "100000"),
            (
                GENERATION_CONFIG,
                r#"{"eos_token_id": "x"}"#,
                "eos_token_id",
            ),
        ];
        for (i, (file, text, needle)) in cases.into_iter().enumerate() {
            let dir = dir_with(&format!("bad{i}"), &[(file, text)]);
            let err = TextTokenizer::from_hf_dir(&dir).unwrap_err();
            let msg = err.to_string();
            assert!(matches!(err, TokenizerError::HfFile { .. }), "{msg}");
            assert!(msg.contains(file) && msg.contains(needle), "{msg}");
            std::fs::remove_dir_all(&dir).ok();
        }
        let nowhere = std::env::temp_dir().join("specgate-hfdir-none-here");
        assert!(matches!(
            TextTokenizer::from_hf_dir(&nowhere),
            Err(TokenizerError::Json { .. })
        ));
    }

    #[test]
    fn without_add_bos_token_the_post_processor_decides() {
        use tokenizers::processors::template::TemplateProcessing;
        let mut t = tiny();
        let bos = t.token_to_id("<|endoftext|>").unwrap();
        let config = r#"{"bos_token": "<|endoftext|>"}"#;
        // No post-processor: nothing prepended.
        let dir = dir_with("pp-none", &[(TOKENIZER_CONFIG, config)]);
        assert!(!TextTokenizer::from_hf_dir(&dir).unwrap().add_bos_token());
        std::fs::remove_dir_all(&dir).ok();
        // A Llama-3-style template that starts every sequence with BOS.
        let template = TemplateProcessing::builder()
            .try_single("<|endoftext|> $A")
            .unwrap()
            .special_tokens(vec![("<|endoftext|>", bos)])
            .build()
            .unwrap();
        t.inner.with_post_processor(Some(template));
        let dir = dir_with("pp-bos", &[(TOKENIZER_CONFIG, config)]);
        t.save_tokenizer_json(&dir.join(TOKENIZER_JSON)).unwrap();
        let d = TextTokenizer::from_hf_dir(&dir).unwrap();
        assert!(d.add_bos_token());
        assert_eq!(d.encode("hello", true).unwrap()[0], bos);
        // An explicit add_bos_token wins over the post-processor.
        std::fs::write(
            dir.join(TOKENIZER_CONFIG),
            r#"{"bos_token": "<|endoftext|>", "add_bos_token": false}"#,
        )
        .unwrap();
        assert!(!TextTokenizer::from_hf_dir(&dir).unwrap().add_bos_token());
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn list_without_default_fails_when_used_naming_the_entries() {
        let dir = dir_with(
            "nodefault",
            &[(
                TOKENIZER_CONFIG,
                r#"{"chat_template": [{"name": "rag", "template": "R"}]}"#,
            )],
        );
        let d = TextTokenizer::from_hf_dir(&dir).unwrap();
        let err = d.apply_chat_template(&[], true).unwrap_err().to_string();
        assert!(err.contains("rag") && err.contains("default"), "{err}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn added_tokens_decoder_entries_join_the_vocabulary() {
        let t = tiny();
        let next = t.vocab_size();
        let config = serde_json::json!({"added_tokens_decoder": {
            next.to_string(): {"content": "<|think|>", "special": true},
            t.token_to_id("<|im_start|>").unwrap().to_string(): {"content": "<|im_start|>", "special": true},
        }});
        let dir = dir_with("added", &[(TOKENIZER_CONFIG, &config.to_string())]);
        let d = TextTokenizer::from_hf_dir(&dir).unwrap();
        assert_eq!(d.vocab_size(), next + 1);
        let think = next as u32;
        assert_eq!(d.encode("<|think|>hello", false).unwrap()[0], think);
        assert_eq!(d.decode(&[think], true).unwrap(), "");
        std::fs::remove_dir_all(&dir).ok();
        // An id past the next free one cannot be honoured.
        let config = serde_json::json!({"added_tokens_decoder": {
            (next + 5).to_string(): {"content": "<|far|>", "special": true}}});
        let dir = dir_with("added-far", &[(TOKENIZER_CONFIG, &config.to_string())]);
        let err = TextTokenizer::from_hf_dir(&dir).unwrap_err().to_string();
        assert!(
            err.contains("<|far|>") && err.contains(TOKENIZER_CONFIG),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).ok();
    }
}

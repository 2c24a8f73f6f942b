//! Text tokenization for the gateway.
//!
//! Owns everything between request text and token ids: [`TextTokenizer`] builds a
//! byte-level BPE tokenizer (on the `tokenizers` crate) from GGUF metadata
//! (`tokenizer.ggml.*`), from a Hugging Face `tokenizer.json`, or from a whole Hugging
//! Face model directory ([`hf_dir`]: template, BOS/EOS, stop ids; or, for Kimi, a
//! tiktoken `tiktoken.model` in place of `tokenizer.json`: [`tiktoken`]), encodes and decodes,
//! knows the model's BOS and end-of-generation ids, and renders the model's chat
//! template ([`chat`], minijinja) and encodes chat prompts so that client text cannot
//! forge control tokens ([`chat_encode`]). [`IncrementalDecoder`] turns a stream of
//! generated ids into text deltas that never split a UTF-8 character.
//!
//! GGUF pre-tokenizer regexes are those of llama.cpp's `llama-vocab.cpp`, so ids match
//! llama.cpp for the same file (checked against committed vectors in
//! `tests/fixtures/tokenizer-vectors.json`), except Kimi's `kimi-k2`, which matches
//! tiktoken (`tests/fixtures/kimi_k3/tokenizer-vectors.json`). Nothing here panics on bad input: malformed
//! metadata, unknown ids and template failures come back as [`TokenizerError`].

mod chat;
mod chat_encode;
pub mod hf_dir;
mod incremental;
mod pieces;
mod template_override;
pub mod testing;
pub mod tiktoken;

pub use chat::{name_tool_results, ChatFunctionCall, ChatMessage, ChatToolCall};
pub use chat_encode::ReasoningShown;
pub use incremental::IncrementalDecoder;

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer};

use chat::ChatTemplate;

/// Errors from loading a tokenizer, encoding, decoding or rendering a chat template.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A file could not be opened or read.
    #[error("reading {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The GGUF header or metadata could not be parsed.
    #[error("reading GGUF metadata from {path}: {message}")]
    Gguf {
        /// The file.
        path: PathBuf,
        /// What the GGUF reader reported.
        message: String,
    },
    /// A required metadata key is absent.
    #[error("GGUF metadata has no `{0}`")]
    MissingMetadata(&'static str),
    /// A metadata key is present but has the wrong type or an impossible value.
    #[error("GGUF metadata `{key}` is invalid: {reason}")]
    InvalidMetadata {
        /// The key.
        key: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// `tokenizer.ggml.model` names a tokenizer family this module does not build.
    #[error("unsupported tokenizer model `{0}` (supported: \"gpt2\" byte-level BPE)")]
    UnsupportedModel(String),
    /// `tokenizer.ggml.pre` names a pre-tokenizer this module does not know.
    #[error(
        "unknown pre-tokenizer `{0}` (known: qwen2, smollm, gpt2, llama3, kimi-k2, default and aliases)"
    )]
    UnknownPreTokenizer(String),
    /// The `tokenizers` library rejected the vocabulary, merges or regexes.
    #[error("building tokenizer: {0}")]
    Build(String),
    /// A `tokenizer.json` could not be loaded or written.
    #[error("tokenizer.json {path}: {message}")]
    Json {
        /// The file.
        path: PathBuf,
        /// What the `tokenizers` library reported.
        message: String,
    },
    /// A file of a Hugging Face model directory (`tokenizer_config.json`,
    /// `generation_config.json`) is malformed or contradicts the vocabulary.
    #[error("{path}: {reason}")]
    HfFile {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A line of a tiktoken BPE file (`tiktoken.model`: `base64(token bytes) rank` per
    /// line) is malformed, or its ranks are not the ids `0..n` each used once.
    #[error("{path}:{line}: {reason}")]
    Tiktoken {
        /// The file.
        path: PathBuf,
        /// The 1-based line number.
        line: usize,
        /// What is wrong with the line.
        reason: String,
    },
    /// A token string given by the caller is not in the vocabulary.
    #[error("token {0:?} is not in the vocabulary")]
    UnknownToken(String),
    /// The text holds a byte that no token of this vocabulary represents.
    #[error("text contains byte 0x{0:02x}, which this vocabulary cannot represent")]
    UnencodableByte(u8),
    /// A token id is outside the vocabulary.
    #[error("token id {id} is out of range (vocabulary size {vocab_size})")]
    TokenIdOutOfRange {
        /// The offending id.
        id: u32,
        /// The vocabulary size.
        vocab_size: usize,
    },
    /// The `tokenizers` library failed to encode.
    #[error("encoding failed: {0}")]
    Encode(String),
    /// The `tokenizers` library failed to decode.
    #[error("decoding failed: {0}")]
    Decode(String),
    /// The model ships no chat template.
    #[error("the model has no chat template (tokenizer.chat_template)")]
    NoChatTemplate,
    /// The chat template failed to compile or to render (includes `raise_exception`).
    #[error("chat template: {0}")]
    ChatTemplate(String),
}

/// GGUF metadata as `candle_core` reads it.
pub type GgufMetadata = HashMap<String, gguf_file::Value>;

const KEY_MODEL: &str = "tokenizer.ggml.model";
const KEY_PRE: &str = "tokenizer.ggml.pre";
const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
const KEY_TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
const KEY_MERGES: &str = "tokenizer.ggml.merges";
const KEY_BOS: &str = "tokenizer.ggml.bos_token_id";
const KEY_EOS: &str = "tokenizer.ggml.eos_token_id";
const KEY_EOT: &str = "tokenizer.ggml.eot_token_id";
const KEY_EOM: &str = "tokenizer.ggml.eom_token_id";
const KEY_PAD: &str = "tokenizer.ggml.padding_token_id";
const KEY_ADD_BOS: &str = "tokenizer.ggml.add_bos_token";
const KEY_CHAT_TEMPLATE: &str = "tokenizer.chat_template";

/// GGUF token types (llama.cpp `llama_token_type`).
const TOKEN_TYPE_NORMAL: i64 = 1;
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;
const TOKEN_TYPE_UNUSED: i64 = 5;

/// Token texts that end generation besides the declared EOS (llama.cpp's EOG list).
const END_OF_GENERATION_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
    // Kimi K2/K3 (llama.cpp lists the first two; `<|end_of_msg|>` ends a K3 turn).
    "[EOT]",
    "[EOS]",
    "<|end_of_msg|>",
];

// Pre-tokenizer regexes, verbatim from llama.cpp `llama-vocab.cpp` (llm_tokenizer_bpe).
const RE_GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
const RE_QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const RE_LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const PRE_DEFAULT: &[&str] = &[
    r"[\p{P}\$\+<=>\^~\|]+",
    RE_GPT2,
    r"\p{N}+",
    "[0-9][0-9][0-9]",
];
const PRE_GPT2: &[&str] = &[RE_GPT2];
const PRE_SMOLLM: &[&str] = &[r"\p{N}", RE_GPT2];
const PRE_QWEN2: &[&str] = &[RE_QWEN2];
const PRE_LLAMA3: &[&str] = &[RE_LLAMA3];
const PRE_KIMI_K2: &[&str] = &[tiktoken::KIMI_PATTERN];
/// Every regex list [`pre_tokenizer_for`] answers ([`pieces`] cuts text only for these).
const PRE_TOKENIZER_LISTS: &[&[&str]] = &[
    PRE_DEFAULT,
    PRE_GPT2,
    PRE_SMOLLM,
    PRE_QWEN2,
    PRE_LLAMA3,
    PRE_KIMI_K2,
];

/// Maps a `tokenizer.ggml.pre` name to its split regexes (applied in order, each
/// keeping matches and the text between them as separate pieces) and whether whole
/// words found in the vocabulary skip BPE merges (llama.cpp `ignore_merges`).
fn pre_tokenizer_for(name: &str) -> Result<(&'static [&'static str], bool), TokenizerError> {
    Ok(match name {
        "default" => (PRE_DEFAULT, false),
        "gpt2" | "gpt-2" | "phi-2" | "mpt" | "olmo" | "jais" | "roberta-bpe" => (PRE_GPT2, false),
        "qwen2" | "deepseek-r1-qwen" | "stablelm2" => (PRE_QWEN2, false),
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" => {
            (PRE_SMOLLM, false)
        }
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" => (PRE_LLAMA3, true),
        "dbrx" | "smaug-bpe" => (PRE_LLAMA3, false),
        // Kimi's tiktoken vocabulary: tiktoken looks a whole piece up before merging.
        "kimi-k2" => (PRE_KIMI_K2, true),
        other => return Err(TokenizerError::UnknownPreTokenizer(other.to_owned())),
    })
}

/// GPT-2's reversible byte -> printable char table used by byte-level BPE vocabularies.
pub(crate) fn byte_level_char(byte: u8) -> char {
    let b = u32::from(byte);
    let printable = (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || b >= 0xae;
    if printable {
        return char::from(byte);
    }
    // Non-printable bytes map, in byte order, to U+0100 onwards.
    let rank = (0..b)
        .filter(|&x| !((0x21..=0x7e).contains(&x) || (0xa1..=0xac).contains(&x) || x >= 0xae))
        .count() as u32;
    char::from_u32(0x100 + rank).unwrap_or(char::REPLACEMENT_CHARACTER)
}

/// The inverse of [`byte_level_char`]: the byte a byte-level character stands for, or
/// `None` for a character outside the table.
fn byte_level_byte(c: char) -> Option<u8> {
    let u = u32::from(c);
    let printable =
        (0x21..=0x7e).contains(&u) || (0xa1..=0xac).contains(&u) || (0xae..=0xff).contains(&u);
    match u {
        _ if printable => Some(u as u8),
        // Non-printable bytes in order: 0x00..=0x20, 0x7f..=0xa0, 0xad.
        0x100..=0x120 => Some((u - 0x100) as u8),
        0x121..=0x142 => Some((u - 0x121 + 0x7f) as u8),
        0x143 => Some(0xad),
        _ => None,
    }
}

/// Whether a chat template compiled, and if not, why.
enum TemplateState {
    Missing,
    Invalid(String),
    Ready(Box<ChatTemplate>),
}

impl TemplateState {
    fn new(source: Option<String>) -> Self {
        match source {
            None => Self::Missing,
            Some(src) => match ChatTemplate::compile(src) {
                Ok(t) => Self::Ready(Box::new(t)),
                Err(e) => Self::Invalid(e.to_string()),
            },
        }
    }
}

/// A model's tokenizer: byte-level BPE with special tokens, plus its chat template.
///
/// Invariants: every id below [`vocab_size`](Self::vocab_size) decodes; for text made of
/// bytes the vocabulary covers (all of them for real byte-level vocabularies),
/// `decode(encode(text, false), false) == text`. Strings of control and user-defined
/// tokens (e.g. `<|im_start|>`) in input text become those single tokens, except in
/// message text given to [`encode_chat`](Self::encode_chat), where control-token text
/// stays text. The type is `Send + Sync` and cheap to share behind an `Arc`.
pub struct TextTokenizer {
    inner: Tokenizer,
    vocab_size: usize,
    bos: Option<u32>,
    eos: Option<u32>,
    pad: Option<u32>,
    add_bos: bool,
    eos_ids: Vec<u32>,
    /// Bytes with no token in the vocabulary (empty for complete byte-level vocabularies).
    missing_bytes: Vec<u8>,
    /// Ids the GGUF marks unused (padding such as Qwen's `[PAD151665]`),
    /// ascending; empty for tokenizers that do not say.
    unused: Vec<u32>,
    template_source: Option<String>,
    template: TemplateState,
    /// Encode text in pieces of at least this many bytes, cut where no id changes
    /// ([`pieces`]); `None` where this tokenizer's pipeline cannot be cut.
    piece_bytes: Option<usize>,
}

impl fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("pad", &self.pad)
            .field("add_bos", &self.add_bos)
            .field("eos_ids", &self.eos_ids)
            .field("has_chat_template", &self.template_source.is_some())
            .finish_non_exhaustive()
    }
}

impl TextTokenizer {
    /// Builds the tokenizer from GGUF metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`).
    ///
    /// Supports `tokenizer.ggml.model = "gpt2"` (byte-level BPE) with pre-tokenizers
    /// `qwen2`, `smollm`, `gpt2`, `llama3`, `kimi-k2` ([`tiktoken::KIMI_PATTERN`], whole
    /// pieces found in the vocabulary skip merges as in tiktoken), `default` and their
    /// llama.cpp aliases; a
    /// missing `tokenizer.ggml.pre` means `default`. Control (type 3) and user-defined
    /// (type 4) tokens are matched as whole tokens in input text; control tokens are the
    /// "special" ones that `decode(.., skip_special = true)` drops.
    ///
    /// Errors: [`TokenizerError::UnsupportedModel`], [`TokenizerError::UnknownPreTokenizer`],
    /// [`TokenizerError::MissingMetadata`] / [`TokenizerError::InvalidMetadata`] for absent
    /// or malformed keys or out-of-range special ids, [`TokenizerError::Build`] when a merge
    /// names a token that is not in the vocabulary. A chat template that fails to compile
    /// does not fail loading: [`apply_chat_template`](Self::apply_chat_template) reports it.
    pub fn from_gguf_metadata(md: &GgufMetadata) -> Result<Self, TokenizerError> {
        let model = md_str(md, KEY_MODEL)?.ok_or(TokenizerError::MissingMetadata(KEY_MODEL))?;
        if model != "gpt2" {
            return Err(TokenizerError::UnsupportedModel(model.to_owned()));
        }
        let (regexes, ignore_merges) =
            pre_tokenizer_for(md_str(md, KEY_PRE)?.unwrap_or("default"))?;
        let tokens =
            md_array(md, KEY_TOKENS)?.ok_or(TokenizerError::MissingMetadata(KEY_TOKENS))?;
        let tokens = tokens
            .iter()
            .enumerate()
            .map(|(i, v)| match v {
                gguf_file::Value::String(s) => Ok(s.as_str()),
                _ => Err(invalid(KEY_TOKENS, format!("entry {i} is not a string"))),
            })
            .collect::<Result<Vec<&str>, _>>()?;
        let n = tokens.len();
        if n == 0 || u32::try_from(n).is_err() {
            return Err(invalid(KEY_TOKENS, format!("{n} tokens")));
        }
        let types = match md_array(md, KEY_TOKEN_TYPE)? {
            None => vec![TOKEN_TYPE_NORMAL; n],
            Some(vals) if vals.len() == n => vals
                .iter()
                .map(|v| value_i64(v).ok_or_else(|| invalid(KEY_TOKEN_TYPE, "non-integer entry")))
                .collect::<Result<Vec<_>, _>>()?,
            Some(vals) => {
                return Err(invalid(
                    KEY_TOKEN_TYPE,
                    format!("{} entries for {n} tokens", vals.len()),
                ))
            }
        };
        let merges = md_array(md, KEY_MERGES)?
            .ok_or(TokenizerError::MissingMetadata(KEY_MERGES))?
            .iter()
            .enumerate()
            .map(|(i, v)| match v {
                gguf_file::Value::String(s) => split_merge(s).ok_or_else(|| {
                    invalid(KEY_MERGES, format!("entry {i} ({s:?}) is not \"a b\""))
                }),
                _ => Err(invalid(KEY_MERGES, format!("entry {i} is not a string"))),
            })
            .collect::<Result<Vec<_>, _>>()?;

        let (inner, missing_bytes) =
            build_byte_level(&tokens, &types, merges, regexes, ignore_merges)?;

        let id_key = |key: &'static str| -> Result<Option<u32>, TokenizerError> {
            match md_u32(md, key)? {
                Some(id) if id as usize >= n => Err(invalid(
                    key,
                    format!("id {id} is outside the {n}-token vocabulary"),
                )),
                other => Ok(other),
            }
        };
        let (bos, eos, pad) = (id_key(KEY_BOS)?, id_key(KEY_EOS)?, id_key(KEY_PAD)?);
        let mut eos_ids: Vec<u32> = [eos, id_key(KEY_EOT)?, id_key(KEY_EOM)?]
            .into_iter()
            .flatten()
            .collect();
        let mut extra: Vec<u32> = tokens
            .iter()
            .zip(&types)
            .enumerate()
            .filter(|(_, (tok, ty))| {
                matches!(**ty, TOKEN_TYPE_CONTROL | TOKEN_TYPE_USER_DEFINED)
                    && END_OF_GENERATION_TEXTS.contains(tok)
            })
            .map(|(id, _)| id as u32)
            .collect();
        extra.sort_unstable();
        for id in extra {
            if !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        }
        let template_source = md_str(md, KEY_CHAT_TEMPLATE)?.map(str::to_owned);
        Ok(Self {
            piece_bytes: pieces::default_piece_bytes(&inner),
            inner,
            vocab_size: n,
            bos,
            eos,
            pad,
            add_bos: md_bool(md, KEY_ADD_BOS)?.unwrap_or(false),
            eos_ids,
            missing_bytes,
            unused: types
                .iter()
                .enumerate()
                .filter(|(_, &ty)| ty == TOKEN_TYPE_UNUSED)
                .map(|(id, _)| id as u32)
                .collect(),
            template: TemplateState::new(template_source.clone()),
            template_source,
        })
    }

    /// Reads a GGUF file's metadata with the model runtime's own GGUF reader
    /// (candle's rejects tensor types it does not know, e.g. MXFP4, which a
    /// tokenizer never needs) and builds the tokenizer.
    ///
    /// Errors: [`TokenizerError::Io`] if the file cannot be opened, [`TokenizerError::Gguf`]
    /// if it is not valid GGUF, then as [`from_gguf_metadata`](Self::from_gguf_metadata).
    pub fn from_gguf_file(path: &Path) -> Result<Self, TokenizerError> {
        std::fs::File::open(path).map_err(|source| TokenizerError::Io {
            path: path.to_owned(),
            source,
        })?;
        let md = specgate_verify::gguf::Gguf::open(path)
            .map_err(|e| TokenizerError::Gguf {
                path: path.to_owned(),
                message: e.to_string(),
            })?
            .metadata;
        Self::from_gguf_metadata(&md)
    }

    /// Loads a Hugging Face `tokenizer.json`.
    ///
    /// `chat_template` is the Jinja source (from `tokenizer_config.json`), `eos_token` the
    /// text of the end-of-sequence token. End-of-generation ids are `eos_token` plus any
    /// special added token named like a turn end (`<|im_end|>`, `<|eot_id|>`, ...). Such
    /// files carry no BOS policy here: [`bos_token_id`](Self::bos_token_id) is `None` and
    /// `encode` never adds one; the file's post-processor is not applied.
    ///
    /// Errors: [`TokenizerError::Json`] if the file cannot be loaded,
    /// [`TokenizerError::UnknownToken`] if `eos_token` is not in the vocabulary.
    pub fn from_tokenizer_json(
        path: &Path,
        chat_template: Option<String>,
        eos_token: Option<&str>,
    ) -> Result<Self, TokenizerError> {
        let inner = Tokenizer::from_file(path).map_err(|e| TokenizerError::Json {
            path: path.to_owned(),
            message: e.to_string(),
        })?;
        let vocab_size = inner
            .get_vocab(true)
            .values()
            .max()
            .map_or(0, |&max| max as usize + 1);
        let eos = eos_token
            .map(|t| {
                inner
                    .token_to_id(t)
                    .ok_or_else(|| TokenizerError::UnknownToken(t.to_owned()))
            })
            .transpose()?;
        let mut eos_ids: Vec<u32> = eos.into_iter().collect();
        hf_dir::extend_turn_ends(&inner, &mut eos_ids);
        Ok(Self {
            piece_bytes: pieces::default_piece_bytes(&inner),
            inner,
            vocab_size,
            bos: None,
            eos,
            pad: None,
            add_bos: false,
            eos_ids,
            missing_bytes: Vec::new(),
            unused: Vec::new(),
            template: TemplateState::new(chat_template.clone()),
            template_source: chat_template,
        })
    }

    /// Writes this tokenizer as a Hugging Face `tokenizer.json` (e.g. to export a GGUF
    /// vocabulary). Loading it back with [`from_tokenizer_json`](Self::from_tokenizer_json)
    /// encodes identically. Errors: [`TokenizerError::Json`].
    pub fn save_tokenizer_json(&self, path: &Path) -> Result<(), TokenizerError> {
        self.inner
            .save(path, false)
            .map_err(|e| TokenizerError::Json {
                path: path.to_owned(),
                message: e.to_string(),
            })
    }

    /// Encodes `text` into ids. Control/user-defined token strings in `text` become those
    /// tokens. With `add_bos`, the BOS id is prepended only if the model asks for it
    /// (`tokenizer.ggml.add_bos_token`) and has one. No EOS is ever added.
    ///
    /// Errors: [`TokenizerError::UnencodableByte`] if the vocabulary lacks a byte of `text`
    /// (never for complete byte-level vocabularies), [`TokenizerError::Encode`].
    pub fn encode(&self, text: &str, add_bos: bool) -> Result<Vec<u32>, TokenizerError> {
        self.check_encodable(text)?;
        let mut ids = Vec::new();
        if add_bos && self.add_bos {
            ids.extend(self.bos);
        }
        for (_, piece) in self.pieces(text) {
            let enc = self
                .inner
                .encode_fast(piece, false)
                .map_err(|e| TokenizerError::Encode(e.to_string()))?;
            ids.extend_from_slice(enc.get_ids());
        }
        Ok(ids)
    }

    /// `text` in the pieces this tokenizer encodes one at a time ([`pieces`]): the ids
    /// of the pieces, concatenated, are the ids of the whole.
    fn pieces<'a>(&self, text: &'a str) -> pieces::Pieces<'a> {
        pieces::pieces(text, self.piece_bytes)
    }

    /// Whether long text is encoded in pieces (see [`set_piece_bytes`](Self::set_piece_bytes)).
    pub fn encodes_in_pieces(&self) -> bool {
        self.piece_bytes.is_some()
    }

    /// Sets the size of the pieces long text is encoded in, for a tokenizer that
    /// [encodes in pieces](Self::encodes_in_pieces) (no effect on one that does not):
    /// `usize::MAX` encodes whole. Ids never depend on it; memory while encoding
    /// does (~100x a piece). For tests and benchmarks.
    pub fn set_piece_bytes(&mut self, bytes: usize) {
        if self.piece_bytes.is_some() {
            self.piece_bytes = Some(bytes.max(1));
        }
    }

    /// Decodes ids into text; with `skip_special`, control tokens produce no text.
    /// Byte sequences that are not valid UTF-8 (e.g. a cut multi-byte character) decode
    /// to U+FFFD. Errors: [`TokenizerError::TokenIdOutOfRange`], [`TokenizerError::Decode`].
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            return Err(self.out_of_range(id));
        }
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| TokenizerError::Decode(e.to_string()))
    }

    /// Ids that end generation: the declared EOS first, then the EOT/EOM ids and any
    /// control token named like a turn end (llama.cpp's list: `<|im_end|>`,
    /// `<|endoftext|>`, `<|eot_id|>`, ...). No duplicates; may be empty only for a
    /// `tokenizer.json` loaded without an EOS and without such tokens.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// Whether `id` ends generation (is in [`eos_token_ids`](Self::eos_token_ids)).
    pub fn is_eos(&self, id: u32) -> bool {
        self.eos_ids.contains(&id)
    }

    /// The declared EOS id (`tokenizer.ggml.eos_token_id`), if any.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos
    }

    /// The BOS id (`tokenizer.ggml.bos_token_id`), if any; whether `encode` adds it is
    /// [`add_bos_token`](Self::add_bos_token).
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos
    }

    /// Whether the model asks for BOS at the start of a prompt.
    pub fn add_bos_token(&self) -> bool {
        self.add_bos && self.bos.is_some()
    }

    /// The padding id (`tokenizer.ggml.padding_token_id`), if any.
    pub fn pad_token_id(&self) -> Option<u32> {
        self.pad
    }

    /// Number of ids (one more than the largest valid id); for GGUF the length of
    /// `tokenizer.ggml.tokens`, which matches the model's embedding rows.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Whether the vocabulary marks `id` unused (GGUF token type 5: padding
    /// rows such as Qwen's `[PAD151665]`, never trained). A grammar never
    /// allows them, so constrained output cannot contain their text.
    pub fn is_unused(&self, id: u32) -> bool {
        self.unused.binary_search(&id).is_ok()
    }

    /// The vocabulary string of `id` (byte-level form, e.g. `"Ġworld"`), or `None`.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The exact bytes token `id` stands for, or `None` for an id outside the vocabulary.
    ///
    /// A vocabulary token's byte-level string is mapped back through GPT-2's byte table
    /// (so a token holding part of a UTF-8 character gives those raw bytes, and
    /// concatenating the bytes of a sequence gives exactly what it decodes to before
    /// UTF-8 repair); an added token (control, e.g. `<|im_end|>`, or user-defined, e.g.
    /// `<tool_call>`) gives its text. A character outside the byte table (only in a
    /// vocabulary that is not byte-level) is kept as its UTF-8 bytes.
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        if id as usize >= self.vocab_size {
            return None;
        }
        let added = self.inner.get_added_vocabulary().get_added_tokens_decoder();
        if let Some(token) = added.get(&id) {
            return Some(token.content.as_bytes().to_vec());
        }
        let text = self.inner.id_to_token(id)?;
        let mut bytes = Vec::with_capacity(text.len());
        for c in text.chars() {
            match byte_level_byte(c) {
                Some(b) => bytes.push(b),
                None => bytes.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
            }
        }
        Some(bytes)
    }

    /// How `other` gives token ids another meaning than `self` does, or
    /// `None` when the two agree on every id: the same number of ids, each
    /// id the same bytes, and the same kind (ordinary, added, or special:
    /// the control tokens chat markup is made of). Models that pass token
    /// ids to each other as they are (a draft and its target) must agree.
    /// The answer names the first id that differs, `self`'s side first.
    pub fn difference(&self, other: &TextTokenizer) -> Option<String> {
        if self.vocab_size != other.vocab_size {
            return Some(format!(
                "a vocabulary of {} tokens against {}",
                self.vocab_size, other.vocab_size
            ));
        }
        let ours = self.inner.get_added_vocabulary().get_added_tokens_decoder();
        let theirs = other
            .inner
            .get_added_vocabulary()
            .get_added_tokens_decoder();
        let kind = |t: Option<&AddedToken>| match t {
            None => "ordinary",
            Some(t) if t.special => "special",
            Some(_) => "added",
        };
        let shown = |b: Option<Vec<u8>>| b.map(|b| String::from_utf8_lossy(&b).into_owned());
        for id in 0..self.vocab_size as u32 {
            let (a, b) = (self.token_bytes(id), other.token_bytes(id));
            if a != b {
                return Some(format!(
                    "token {id} is {:?} against {:?}",
                    shown(a),
                    shown(b)
                ));
            }
            let (ka, kb) = (kind(ours.get(&id)), kind(theirs.get(&id)));
            if ka != kb {
                return Some(format!(
                    "token {id} ({:?}) is {ka} against {kb}",
                    shown(a).unwrap_or_default()
                ));
            }
        }
        None
    }

    /// The id of a vocabulary string (byte-level form), or `None`.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The chat template's Jinja source, if the model has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.template_source.as_deref()
    }

    /// Renders the chat template over `messages` (Hugging Face semantics: trim_blocks,
    /// lstrip_blocks, `bos_token`/`eos_token` variables, `raise_exception`, Python-style
    /// `tojson` and string methods, `strftime_now`). With `add_generation_prompt` the
    /// output ends with the assistant turn header. To build a prompt from client
    /// messages use [`encode_chat`](Self::encode_chat) instead of encoding this text:
    /// `encode` would turn control-token text typed by a client into control tokens.
    ///
    /// Errors: [`TokenizerError::NoChatTemplate`]; [`TokenizerError::ChatTemplate`] if the
    /// template does not compile, fails to render, or calls `raise_exception`.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        let template = match &self.template {
            TemplateState::Missing => return Err(TokenizerError::NoChatTemplate),
            TemplateState::Invalid(e) => return Err(TokenizerError::ChatTemplate(e.clone())),
            TemplateState::Ready(t) => t,
        };
        let text = |id: Option<u32>| id.and_then(|i| self.inner.id_to_token(i));
        template.render(
            messages,
            add_generation_prompt,
            text(self.bos),
            text(self.eos),
        )
    }

    /// Errors with [`TokenizerError::UnencodableByte`] if the vocabulary lacks a byte of
    /// `text` (never for complete byte-level vocabularies).
    fn check_encodable(&self, text: &str) -> Result<(), TokenizerError> {
        if !self.missing_bytes.is_empty() {
            if let Some(&b) = text
                .as_bytes()
                .iter()
                .find(|b| self.missing_bytes.contains(b))
            {
                return Err(TokenizerError::UnencodableByte(b));
            }
        }
        Ok(())
    }

    pub(crate) fn check_id(&self, id: u32) -> Result<(), TokenizerError> {
        if id as usize >= self.vocab_size {
            return Err(self.out_of_range(id));
        }
        Ok(())
    }

    fn out_of_range(&self, id: u32) -> TokenizerError {
        TokenizerError::TokenIdOutOfRange {
            id,
            vocab_size: self.vocab_size,
        }
    }
}

/// The byte-level BPE of a GGUF-style vocabulary: `tokens[id]` in GPT-2 byte-to-unicode
/// form, `types[id]` the llama.cpp token type, `merges` in priority order, the
/// pre-tokenizer `regexes` applied in order. Control tokens (type 3) become special added
/// tokens, user-defined ones (type 4) plain added tokens; both keep their ids because
/// they are in the BPE vocabulary too. Returns the tokenizer and the bytes no token
/// stands for.
///
/// Errors: [`TokenizerError::Build`] when a merge names a token that is not in the
/// vocabulary, a regex does not compile, or the special tokens cannot be added.
pub(crate) fn build_byte_level(
    tokens: &[&str],
    types: &[i64],
    merges: Vec<(String, String)>,
    regexes: &[&str],
    ignore_merges: bool,
) -> Result<(Tokenizer, Vec<u8>), TokenizerError> {
    // Later duplicates win, as in llama.cpp's token_to_id map.
    let mut vocab = Vocab::with_capacity(tokens.len());
    for (id, tok) in tokens.iter().enumerate() {
        vocab.insert((*tok).to_owned(), id as u32);
    }
    let missing_bytes: Vec<u8> = (0..=255u8)
        .filter(|&b| !vocab.contains_key(byte_level_char(b).to_string().as_str()))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(ignore_merges)
        .build()
        .map_err(|e| TokenizerError::Build(e.to_string()))?;
    let mut inner = Tokenizer::new(bpe);
    inner.with_pre_tokenizer(Some(byte_level_pre_tokenizer(regexes)?));
    inner.with_decoder(Some(ByteLevel::default()));
    let (mut control, mut user) = (Vec::new(), Vec::new());
    for (tok, ty) in tokens.iter().zip(types) {
        match *ty {
            TOKEN_TYPE_CONTROL => control.push(AddedToken::from(*tok, true)),
            TOKEN_TYPE_USER_DEFINED => user.push(AddedToken::from(*tok, false)),
            _ => {}
        }
    }
    inner
        .add_special_tokens(control)
        .and_then(|_| inner.add_tokens(user))
        .map_err(|e| TokenizerError::Build(format!("adding special tokens: {e}")))?;
    Ok((inner, missing_bytes))
}

/// `Split` (isolated) for each regex in order, then the byte-to-char mapping.
pub(crate) fn byte_level_pre_tokenizer(
    regexes: &[&str],
) -> Result<PreTokenizerWrapper, TokenizerError> {
    let mut steps: Vec<PreTokenizerWrapper> = Vec::with_capacity(regexes.len() + 1);
    for re in regexes {
        let split = Split::new(
            SplitPattern::Regex((*re).to_owned()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| TokenizerError::Build(format!("pre-tokenizer regex {re:?}: {e}")))?;
        steps.push(split.into());
    }
    steps.push(ByteLevel::new(false, false, false).into());
    Ok(Sequence::new(steps).into())
}

/// Splits a GGUF merge "a b" at the first space after the first character (llama.cpp).
fn split_merge(s: &str) -> Option<(String, String)> {
    let first_len = s.chars().next()?.len_utf8();
    let pos = first_len + s[first_len..].find(' ')?;
    let (a, b) = (&s[..pos], &s[pos + 1..]);
    (!b.is_empty()).then(|| (a.to_owned(), b.to_owned()))
}

fn invalid(key: &'static str, reason: impl Into<String>) -> TokenizerError {
    TokenizerError::InvalidMetadata {
        key,
        reason: reason.into(),
    }
}

fn value_i64(v: &gguf_file::Value) -> Option<i64> {
    use gguf_file::Value as V;
    Some(match v {
        V::U8(x) => i64::from(*x),
        V::I8(x) => i64::from(*x),
        V::U16(x) => i64::from(*x),
        V::I16(x) => i64::from(*x),
        V::U32(x) => i64::from(*x),
        V::I32(x) => i64::from(*x),
        V::U64(x) => i64::try_from(*x).ok()?,
        V::I64(x) => *x,
        _ => return None,
    })
}

fn md_str<'a>(md: &'a GgufMetadata, key: &'static str) -> Result<Option<&'a str>, TokenizerError> {
    match md.get(key) {
        None => Ok(None),
        Some(gguf_file::Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(invalid(key, "not a string")),
    }
}

fn md_array<'a>(
    md: &'a GgufMetadata,
    key: &'static str,
) -> Result<Option<&'a [gguf_file::Value]>, TokenizerError> {
    match md.get(key) {
        None => Ok(None),
        Some(gguf_file::Value::Array(a)) => Ok(Some(a)),
        Some(_) => Err(invalid(key, "not an array")),
    }
}

fn md_u32(md: &GgufMetadata, key: &'static str) -> Result<Option<u32>, TokenizerError> {
    md.get(key)
        .map(|v| {
            value_i64(v)
                .and_then(|x| u32::try_from(x).ok())
                .ok_or_else(|| invalid(key, "not an integer in u32 range"))
        })
        .transpose()
}

fn md_bool(md: &GgufMetadata, key: &'static str) -> Result<Option<bool>, TokenizerError> {
    match md.get(key) {
        None => Ok(None),
        Some(gguf_file::Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(invalid(key, "not a bool")),
    }
}

#[cfg(test)]
pub(crate) mod tests;

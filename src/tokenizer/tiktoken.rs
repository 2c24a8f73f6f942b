//! Kimi's tiktoken vocabulary: owns reading `tiktoken.model` (one `base64(token bytes)
//! rank` per line, the format of PyPI `tiktoken`'s `load_tiktoken_bpe`), deriving
//! byte-level BPE merges from its ranks, Kimi's pre-tokenizer regex
//! ([`KIMI_PATTERN`]), and the vocabulary of a Kimi (K2/K3) Hugging Face directory that
//! ships `tiktoken.model` instead of `tokenizer.json`.
//!
//! The vocabulary is built exactly as llama.cpp's converter (`convert_hf_to_gguf.py`,
//! `kimi-k2` pre-tokenizer) writes it into a GGUF, and then goes through the same builder
//! as a GGUF vocabulary ([`super::build_byte_level`]), so a directory and its GGUF
//! conversion tokenize identically:
//!
//! - ids `0..n` are the ranks, each token in GPT-2 byte-to-unicode form;
//! - merges: for every token of two or more bytes, in rank order, the BPE of its bytes
//!   using only ranks below its own; when that ends in exactly two parts, the pair is a
//!   merge (a token that cannot be reached by merging gets none and is only produced
//!   as a whole piece);
//! - ids `n..n + 258` are special (control) tokens: the `added_tokens_decoder` entry of
//!   `tokenizer_config.json` for that id, else `<|reserved_token_{id}|>` (as Kimi's
//!   `tokenization_kimi.py` names them);
//! - ids up to `config.json`'s `vocab_size` beyond those are unused `[PAD{id}]` rows;
//!   a `vocab_size` below `n + 258` drops the special ids past it.
//!
//! Encoding then equals tiktoken's: the pre-tokenizer splits with [`KIMI_PATTERN`], a
//! piece that is a whole token is that token (tiktoken's lookup before merging, BPE
//! `ignore_merges`), and otherwise merges are applied lowest rank first.

use std::collections::HashMap;
use std::path::Path;

use serde_json::Value;
use tokenizers::Tokenizer;

use super::hf_dir::TokenizerConfig;
use super::{
    build_byte_level, byte_level_char, TokenizerError, TOKEN_TYPE_CONTROL, TOKEN_TYPE_NORMAL,
    TOKEN_TYPE_UNUSED,
};

/// The tiktoken BPE file of a Kimi model directory.
pub const TIKTOKEN_MODEL: &str = "tiktoken.model";
/// The model configuration; its `vocab_size` and `eos_token_id` (at the top level or
/// under `text_config`, which wins) are read.
pub const MODEL_CONFIG: &str = "config.json";
/// Special-token ids after the ranks (`num_reserved_special_tokens + 2` in
/// `tokenization_kimi.py`).
pub const SPECIAL_SLOTS: u32 = 258;

/// Kimi's split regex (`tokenization_kimi.py` `pat_str`, the one llama.cpp's `kimi-k2`
/// handler implements), in Oniguruma syntax: `&&` intersects character classes there as
/// in the Rust `regex` crate that tiktoken uses, so the text is unchanged. Han runs are
/// their own pieces; other letters (including kana, which are `\p{Lo}` but not Han)
/// follow cl100k's case-split words.
pub const KIMI_PATTERN: &str = concat!(
    r"[\p{Han}]+",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"|\s*[\r\n]+",
    r"|\s+(?!\S)",
    r"|\s+",
);

/// Parses a `tiktoken.model` file's bytes: returns `tokens` with `tokens[rank]` the bytes
/// of that rank. Blank lines are skipped; every other line is a standard base64 string
/// and a decimal rank separated by whitespace.
///
/// Invariants of the result: non-empty, every entry non-empty, no two entries equal, and
/// the ranks are exactly `0..len`.
///
/// Errors: [`TokenizerError::Tiktoken`] naming `path` and the 1-based line for a line
/// without exactly two fields, bad base64, an empty token, a rank that is not a number,
/// is not below the number of tokens, or repeats, and a token that repeats; line 0 for a
/// file without tokens.
pub fn parse_tiktoken(text: &[u8], path: &Path) -> Result<Vec<Vec<u8>>, TokenizerError> {
    let err = |line: usize, reason: String| TokenizerError::Tiktoken {
        path: path.to_owned(),
        line,
        reason,
    };
    let mut entries: Vec<(usize, Vec<u8>, u64)> = Vec::new();
    for (i, raw) in text.split(|&b| b == b'\n').enumerate() {
        let line = i + 1;
        let raw = raw.strip_suffix(b"\r").unwrap_or(raw);
        let fields: Vec<&[u8]> = raw
            .split(|b| b.is_ascii_whitespace())
            .filter(|f| !f.is_empty())
            .collect();
        match fields.as_slice() {
            [] => continue,
            [token, rank] => {
                let bytes = decode_base64(token).map_err(|r| err(line, r))?;
                if bytes.is_empty() {
                    return Err(err(line, "the token is empty".into()));
                }
                let rank = std::str::from_utf8(rank)
                    .ok()
                    .and_then(|r| r.parse::<u64>().ok())
                    .ok_or_else(|| {
                        err(
                            line,
                            format!(
                                "rank {:?} is not a non-negative integer",
                                String::from_utf8_lossy(rank)
                            ),
                        )
                    })?;
                entries.push((line, bytes, rank));
            }
            other => {
                return Err(err(
                    line,
                    format!(
                        "expected `base64(token) rank`, found {} fields",
                        other.len()
                    ),
                ))
            }
        }
    }
    if entries.is_empty() {
        return Err(err(0, "the file holds no tokens".into()));
    }
    let n = entries.len();
    if u32::try_from(n).is_err() {
        return Err(err(0, format!("{n} tokens do not fit u32 ids")));
    }
    let mut tokens: Vec<Option<Vec<u8>>> = vec![None; n];
    let mut seen: HashMap<Vec<u8>, usize> = HashMap::with_capacity(n);
    for (line, bytes, rank) in entries {
        let slot = usize::try_from(rank)
            .ok()
            .filter(|&r| r < n)
            .ok_or_else(|| {
                err(
                    line,
                    format!("rank {rank} is not below the token count {n} (ranks must be 0..{n})"),
                )
            })?;
        if tokens[slot].is_some() {
            return Err(err(line, format!("rank {rank} appears twice")));
        }
        if let Some(first) = seen.insert(bytes.clone(), line) {
            return Err(err(
                line,
                format!("token {bytes:?} already has a rank (line {first})"),
            ));
        }
        tokens[slot] = Some(bytes);
    }
    // n distinct ranks below n: every slot is filled.
    Ok(tokens.into_iter().flatten().collect())
}

/// Decodes standard base64 (`A-Z a-z 0-9 + /`, `=` padding optional). Errors: the reason.
fn decode_base64(s: &[u8]) -> Result<Vec<u8>, String> {
    let shown = || String::from_utf8_lossy(s).into_owned();
    let body = s
        .strip_suffix(b"==")
        .or_else(|| s.strip_suffix(b"="))
        .unwrap_or(s);
    if body.len() % 4 == 1 || (body.len() < s.len() && !s.len().is_multiple_of(4)) {
        return Err(format!("{:?} is not valid base64 (bad length)", shown()));
    }
    let mut out = Vec::with_capacity(body.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0u32);
    for &c in body {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => {
                return Err(format!(
                    "{:?} is not valid base64 (character {:?})",
                    shown(),
                    char::from(c)
                ))
            }
        };
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    if acc != 0 {
        return Err(format!("{:?} is not valid base64 (trailing bits)", shown()));
    }
    Ok(out)
}

/// A token's bytes in GPT-2 byte-to-unicode form (the vocabulary strings of byte-level
/// BPE, and of `tokenizer.ggml.tokens`).
pub fn byte_level_string(bytes: &[u8]) -> String {
    bytes.iter().map(|&b| byte_level_char(b)).collect()
}

/// tiktoken's byte-pair merge of `token` restricted to ranks below `max_rank`: start from
/// single bytes and repeatedly join the adjacent pair whose concatenation has the lowest
/// rank (leftmost on ties) until no pair below `max_rank` is left. Returns the parts.
fn bpe_parts<'a>(ranks: &HashMap<&[u8], u32>, token: &'a [u8], max_rank: u32) -> Vec<&'a [u8]> {
    let mut bounds: Vec<usize> = (0..=token.len()).collect();
    loop {
        let mut best: Option<(u32, usize)> = None;
        for i in 0..bounds.len().saturating_sub(2) {
            if let Some(&r) = ranks.get(&token[bounds[i]..bounds[i + 2]]) {
                if r < max_rank && best.is_none_or(|(b, _)| r < b) {
                    best = Some((r, i));
                }
            }
        }
        match best {
            Some((_, i)) => {
                bounds.remove(i + 1);
            }
            None => break,
        }
    }
    bounds.windows(2).map(|w| &token[w[0]..w[1]]).collect()
}

/// The merges that reproduce tiktoken's ranks with a pair-merging BPE, in priority
/// (rank) order, as byte-level strings: for each token of two or more bytes, its
/// [`bpe_parts`] below its own rank, when those are exactly two.
pub fn derive_merges(tokens: &[Vec<u8>]) -> Vec<(String, String)> {
    let ranks: HashMap<&[u8], u32> = tokens
        .iter()
        .enumerate()
        .map(|(r, t)| (t.as_slice(), r as u32))
        .collect();
    let mut merges = Vec::new();
    for (rank, token) in tokens.iter().enumerate() {
        if token.len() < 2 {
            continue;
        }
        if let [a, b] = bpe_parts(&ranks, token, rank as u32)[..] {
            merges.push((byte_level_string(a), byte_level_string(b)));
        }
    }
    merges
}

/// What `config.json` says about the vocabulary.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct ModelConfig {
    /// Embedding rows (`vocab_size`).
    pub(crate) vocab_size: Option<u32>,
    /// `eos_token_id`, an int or a list.
    pub(crate) eos_token_ids: Vec<u32>,
}

/// Parses `config.json` text: `vocab_size` and `eos_token_id`, each from `text_config`
/// when there, else from the top level. Errors: the reason.
pub(crate) fn parse_model_config(text: &str) -> Result<ModelConfig, String> {
    let v: Value = serde_json::from_str(text).map_err(|e| format!("not valid JSON: {e}"))?;
    let top = v.as_object().ok_or("not a JSON object")?;
    let text_config = top.get("text_config").and_then(Value::as_object);
    let get = |key: &str| {
        text_config
            .and_then(|t| t.get(key))
            .filter(|x| !x.is_null())
            .or_else(|| top.get(key).filter(|x| !x.is_null()))
    };
    let id = |x: &Value, key: &str| {
        x.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| format!("`{key}` holds {x}, not a token id"))
    };
    let vocab_size = get("vocab_size").map(|x| id(x, "vocab_size")).transpose()?;
    let eos_token_ids = match get("eos_token_id") {
        None => Vec::new(),
        Some(Value::Array(list)) => list
            .iter()
            .map(|x| id(x, "eos_token_id"))
            .collect::<Result<_, _>>()?,
        Some(x) => vec![id(x, "eos_token_id")?],
    };
    Ok(ModelConfig {
        vocab_size,
        eos_token_ids,
    })
}

/// The vocabulary of a Kimi directory, built as llama.cpp's converter writes it.
pub(crate) struct KimiVocab {
    pub(crate) inner: Tokenizer,
    /// Bytes no token stands for (empty for a complete byte-level vocabulary).
    pub(crate) missing_bytes: Vec<u8>,
    /// The `[PAD{id}]` rows, ascending.
    pub(crate) unused: Vec<u32>,
    /// `config.json`'s `eos_token_id`s, checked to be in the vocabulary.
    pub(crate) eos_token_ids: Vec<u32>,
}

/// The GGUF-style token list of a tiktoken vocabulary: byte-level strings for the ranks,
/// control tokens for the special slots (named by `special_names`, else
/// `<|reserved_token_{id}|>`), unused `[PAD{id}]` up to `total` ids. Returns the tokens
/// and their llama.cpp token types.
pub(crate) fn kimi_token_list(
    ranks: &[Vec<u8>],
    special_names: &HashMap<u32, String>,
    total: u32,
) -> (Vec<String>, Vec<i64>) {
    let n = ranks.len() as u32;
    let mut tokens: Vec<String> = Vec::with_capacity(total.max(n) as usize);
    let mut types: Vec<i64> = Vec::with_capacity(tokens.capacity());
    tokens.extend(ranks.iter().map(|t| byte_level_string(t)));
    types.resize(tokens.len(), TOKEN_TYPE_NORMAL);
    for id in n..total {
        if id < n + SPECIAL_SLOTS {
            let name = special_names
                .get(&id)
                .cloned()
                .unwrap_or_else(|| format!("<|reserved_token_{id}|>"));
            tokens.push(name);
            types.push(TOKEN_TYPE_CONTROL);
        } else {
            tokens.push(format!("[PAD{id}]"));
            types.push(TOKEN_TYPE_UNUSED);
        }
    }
    (tokens, types)
}

/// Builds the vocabulary of a Kimi Hugging Face directory from `dir/tiktoken.model`, the
/// already parsed `tokenizer_config.json` (`tc`: its `added_tokens_decoder` names the
/// special slots; entries outside them are ignored, as `tokenization_kimi.py` does) and
/// `dir/config.json` (optional: `vocab_size`, default ranks + 258; `eos_token_id`).
///
/// Errors: [`TokenizerError::Io`] if `tiktoken.model` or an existing `config.json`
/// cannot be read; [`TokenizerError::Tiktoken`] for a malformed `tiktoken.model` line;
/// [`TokenizerError::HfFile`] naming `config.json` if it is malformed, its `vocab_size`
/// is below the rank count, or an `eos_token_id` is outside the vocabulary;
/// [`TokenizerError::Build`] if the `tokenizers` library rejects the result.
pub(crate) fn load_kimi_dir(dir: &Path, tc: &TokenizerConfig) -> Result<KimiVocab, TokenizerError> {
    let tik_path = dir.join(TIKTOKEN_MODEL);
    let bytes = std::fs::read(&tik_path).map_err(|source| TokenizerError::Io {
        path: tik_path.clone(),
        source,
    })?;
    let ranks = parse_tiktoken(&bytes, &tik_path)?;
    let n = ranks.len() as u32;
    let cfg_path = dir.join(MODEL_CONFIG);
    let hf_err = |reason: String| TokenizerError::HfFile {
        path: cfg_path.clone(),
        reason,
    };
    let cfg = match std::fs::read_to_string(&cfg_path) {
        Ok(text) => parse_model_config(&text).map_err(hf_err)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => ModelConfig::default(),
        Err(source) => {
            return Err(TokenizerError::Io {
                path: cfg_path.clone(),
                source,
            })
        }
    };
    let total = match cfg.vocab_size {
        None => n + SPECIAL_SLOTS,
        Some(v) if v < n => {
            return Err(hf_err(format!(
                "`vocab_size` {v} is below the {n} ranks of {TIKTOKEN_MODEL}"
            )))
        }
        Some(v) => v,
    };
    for &id in &cfg.eos_token_ids {
        if id >= total {
            return Err(hf_err(format!(
                "`eos_token_id` {id} is outside the {total}-token vocabulary"
            )));
        }
    }
    let special_names: HashMap<u32, String> = tc
        .added_tokens
        .iter()
        .filter(|e| (n..n + SPECIAL_SLOTS).contains(&e.id))
        .map(|e| (e.id, e.content.clone()))
        .collect();
    let (tokens, types) = kimi_token_list(&ranks, &special_names, total);
    let merges = derive_merges(&ranks);
    let token_refs: Vec<&str> = tokens.iter().map(String::as_str).collect();
    let (inner, missing_bytes) =
        build_byte_level(&token_refs, &types, merges, &[KIMI_PATTERN], true)?;
    let unused = types
        .iter()
        .enumerate()
        .filter(|(_, &ty)| ty == TOKEN_TYPE_UNUSED)
        .map(|(id, _)| id as u32)
        .collect();
    Ok(KimiVocab {
        inner,
        missing_bytes,
        unused,
        eos_token_ids: cfg.eos_token_ids,
    })
}

#[cfg(test)]
mod tests;

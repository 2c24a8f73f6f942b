//! The model's tokenizer as llguidance sees it (`toktrie::TokenizerEnv`): the
//! token trie holds each id's exact bytes ([`TextTokenizer::token_bytes`]);
//! control tokens and a chat format's marker tokens get toktrie's special
//! marker (`0xFF` + name) so no grammar text can produce them; ids past the tokenizer's vocabulary (padded logits)
//! get unique special names so nothing allows them. Forced text is tokenized
//! with the real tokenizer, so jump-forward feeds the model canonical tokens.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use super::GrammarError;
use crate::tokenizer::TextTokenizer;

/// llguidance's view of a [`TextTokenizer`].
struct TextTokEnv {
    trie: TokTrie,
    tok: Arc<TextTokenizer>,
}

impl TokenizerEnv for TextTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// The tokenizer's own ids for valid UTF-8 runs, the trie's greedy
    /// tokenization for other bytes and for text the tokenizer would turn
    /// into a control token (`<|im_end|>` typed as text stays text here).
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie
            .tokenize_with_greedy_fallback(s, |text| match self.tok.encode(text, false) {
                Ok(ids) if ids.iter().all(|&t| !self.trie.is_special_token(t)) => ids,
                _ => self.trie.greedy_tokenize(text.as_bytes()),
            })
    }
}

/// The token environment for `tok` with `vocab_size` ids (the logits width);
/// `encoder` (`tok` itself or a copy of it) tokenizes forced text. The
/// `markers` (a chat format's marker tokens) are special like control
/// tokens: a grammar reaches them only by id.
///
/// Errors: [`GrammarError::Setup`] when `vocab_size` is below the
/// tokenizer's vocabulary, there is no end-of-sequence id, or an id has no
/// bytes.
pub(super) fn token_env(
    tok: &TextTokenizer,
    encoder: Arc<TextTokenizer>,
    vocab_size: usize,
    markers: &[u32],
) -> Result<TokEnv, GrammarError> {
    let n = tok.vocab_size();
    if vocab_size < n {
        return Err(GrammarError::Setup(format!(
            "the model's {vocab_size} logits are fewer than the tokenizer's {n} ids"
        )));
    }
    let eos = tok.eos_token_ids().to_vec();
    let Some(&first_eos) = eos.first() else {
        return Err(GrammarError::Setup(
            "the tokenizer has no end-of-sequence id, so no grammar could end".into(),
        ));
    };
    let mut words = Vec::with_capacity(vocab_size);
    for id in 0..n as u32 {
        let bytes = tok
            .token_bytes(id)
            .ok_or_else(|| GrammarError::Setup(format!("token {id} has no bytes")))?;
        // Control tokens decode to nothing when specials are skipped.
        // Unused (padding) ids are marked special too: their text
        // (`[PAD151665]`) must never be a way to spell JSON.
        let control = tok.decode(&[id], true).is_ok_and(|text| text.is_empty());
        words.push(if control || tok.is_unused(id) || markers.contains(&id) {
            special(&bytes)
        } else {
            bytes
        });
    }
    for id in n..vocab_size {
        words.push(special(format!("<|specgate:pad:{id}|>").as_bytes()));
    }
    let info = TokRxInfo::new(vocab_size as u32, first_eos);
    // toktrie asserts on malformed input; report it rather than unwind.
    let trie = std::panic::catch_unwind(|| TokTrie::from(&info, &words).with_eos_tokens(&eos))
        .map_err(|_| GrammarError::Setup("building the token trie failed".into()))?;
    Ok(Arc::new(TextTokEnv { trie, tok: encoder }))
}

/// toktrie's form of a special token: the marker byte, then its name.
fn special(name: &[u8]) -> Vec<u8> {
    let mut w = Vec::with_capacity(name.len() + 1);
    w.push(TokTrie::SPECIAL_TOKEN_MARKER);
    w.extend_from_slice(name);
    w
}

/// A private copy of `tok` (through a temporary `tokenizer.json`, which
/// encodes identically), for [`Grammars::new`](super::Grammars::new).
///
/// Errors: [`GrammarError::Setup`] when the file cannot be written or read.
pub(super) fn copy_tokenizer(tok: &TextTokenizer) -> Result<TextTokenizer, GrammarError> {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let path = std::env::temp_dir().join(format!(
        "specgate-grammar-{}-{}.tokenizer.json",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    let copy = tok
        .save_tokenizer_json(&path)
        .and_then(|()| TextTokenizer::from_tokenizer_json(&path, None, None));
    let _ = std::fs::remove_file(&path);
    copy.map_err(|e| GrammarError::Setup(format!("copying the tokenizer: {e}")))
}

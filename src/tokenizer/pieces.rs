//! Where long text may be cut so that its pieces encode to exactly the ids of the whole.
//!
//! The `tokenizers` pipeline holds ~100 bytes of working memory per byte of text it
//! encodes (per-byte alignments in every `NormalizedString`, a `String` per token), so
//! a 1 MB prompt costs ~100 MB while it encodes. Encoding it in pieces of
//! [`PIECE_BYTES`] bounds that to the piece, if no piece boundary changes an id.
//!
//! The cut: after an ASCII letter and before a space that an ASCII letter follows
//! (`word| word`). It changes nothing when
//! - there is no normalizer (nothing can join or reorder across the cut);
//! - the pre-tokenizer is one that [`super::byte_level_pre_tokenizer`] builds from one of
//!   the regex lists of `pre_tokenizer_for` (GPT-2, Qwen2, Llama 3, SmolLM, llama.cpp's
//!   default, Kimi). In each regex no alternative matches a letter followed by a
//!   space (letters appear in runs, contractions and the optional *leading* character of
//!   a word; spaces only as that leading character or in whitespace runs), so every match
//!   ends at or before the cut and the next one starts at it; the only lookahead,
//!   `\s+(?!\S)`, ends in whitespace, so it never ends at the cut, where a letter
//!   precedes; digit and punctuation regexes touch neither side. `ByteLevel` without
//!   its regex maps bytes one by one;
//! - no added token contains a space or strips whitespace around it, so no added-token
//!   match spans the cut and the leftmost-longest matching on each side is the same;
//! - no truncation or padding is set.
//!
//! Anything else (a `tokenizer.json` with another normalizer or pre-tokenizer) is
//! encoded whole, as before. `tests.rs` checks pieces against the whole on every
//! pre-tokenizer here, and `tests/tokenizer.rs` on the real vocabularies.

use tokenizers::Tokenizer;

use super::{byte_level_pre_tokenizer, PRE_TOKENIZER_LISTS};

/// Bytes of text encoded at once, at least (a piece ends at the first cut after this).
pub(crate) const PIECE_BYTES: usize = 4 << 10;

/// Whether `inner` encodes text cut at word gaps ([`pieces`]) to the ids of the whole.
pub(crate) fn cuts_at_word_gaps(inner: &Tokenizer) -> bool {
    if inner.get_normalizer().is_some()
        || inner.get_truncation().is_some()
        || inner.get_padding().is_some()
    {
        return false;
    }
    let added_ok = inner
        .get_added_tokens_decoder()
        .values()
        .all(|t| !t.content.contains(' ') && !t.lstrip && !t.rstrip && !t.single_word);
    let Some(pre) = inner.get_pre_tokenizer() else {
        return false;
    };
    let Ok(pre) = serde_json::to_string(pre) else {
        return false;
    };
    added_ok
        && PRE_TOKENIZER_LISTS.iter().any(|regexes| {
            byte_level_pre_tokenizer(regexes)
                .ok()
                .and_then(|known| serde_json::to_string(&known).ok())
                .is_some_and(|known| known == pre)
        })
}

/// [`PIECE_BYTES`] where `inner` cuts at word gaps, else `None` (encode whole).
pub(crate) fn default_piece_bytes(inner: &Tokenizer) -> Option<usize> {
    cuts_at_word_gaps(inner).then_some(PIECE_BYTES)
}

/// `text` as consecutive `(offset, piece)`s, each at least `every` bytes but the last,
/// every cut after an ASCII letter and before a space and an ASCII letter. `None`
/// yields the whole text as one piece. The pieces concatenate to `text`.
pub(crate) fn pieces(text: &str, every: Option<usize>) -> Pieces<'_> {
    Pieces {
        text,
        at: 0,
        every: every.unwrap_or(usize::MAX).max(1),
    }
}

/// The iterator of [`pieces`].
pub(crate) struct Pieces<'a> {
    text: &'a str,
    at: usize,
    every: usize,
}

impl<'a> Iterator for Pieces<'a> {
    type Item = (usize, &'a str);

    fn next(&mut self) -> Option<Self::Item> {
        let (start, bytes) = (self.at, self.text.as_bytes());
        if start >= bytes.len() && !(start == 0 && bytes.is_empty()) {
            return None;
        }
        let from = start.saturating_add(self.every);
        let end = if from >= bytes.len() {
            bytes.len()
        } else {
            // ASCII bytes are char boundaries, so every cut is one.
            (from..bytes.len() - 1)
                .find(|&i| {
                    bytes[i] == b' '
                        && bytes[i - 1].is_ascii_alphabetic()
                        && bytes[i + 1].is_ascii_alphabetic()
                })
                .unwrap_or(bytes.len())
        };
        self.at = end.max(start + 1);
        Some((start, &self.text[start..end]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cut(text: &str, every: usize) -> Vec<&str> {
        pieces(text, Some(every)).map(|(_, p)| p).collect()
    }

    #[test]
    fn pieces_cut_only_between_a_letter_and_a_spaced_letter() {
        assert_eq!(cut("ab cd ef", 1), ["ab", " cd", " ef"]);
        assert_eq!(cut("ab cd ef", 3), ["ab cd", " ef"]);
        assert_eq!(cut("a1 b, c\n d  e é f", 1), ["a1 b, c\n d  e é f"]);
        assert_eq!(cut("", 4), [""]);
        assert_eq!(pieces("ab cd", None).count(), 1);
        let text = "lorem ipsum dolor ".repeat(1000);
        let got = cut(&text, 100);
        assert_eq!(got.concat(), text);
        assert!(got.len() > 100);
        let mut offset = 0;
        for (at, p) in pieces(&text, Some(100)) {
            assert_eq!(at, offset);
            offset += p.len();
        }
    }
}

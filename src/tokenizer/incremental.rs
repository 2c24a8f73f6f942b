//! Streaming detokenization: turns generated ids, one at a time, into text deltas
//! (the prefix-offset / read-offset scheme of text-generation-inference).
//!
//! Each push decodes a short window twice — `ids[prefix..read]` (text already emitted)
//! and `ids[prefix..]` — and emits the difference, unless the window's text ends in
//! U+FFFD, i.e. a multi-byte character cut between byte-level tokens; then it holds the
//! text back until a later token completes the character (or [`IncrementalDecoder::finish`]
//! flushes it). Decoding a window rather than single tokens keeps decoders that depend on
//! neighbours (e.g. SentencePiece leading spaces) correct.
//!
//! The held-back part is bounded: once [`IncrementalDecoder::MAX_PENDING`] ids have
//! gone by without completing text (control tokens skipped as special, or a run of stray
//! UTF-8 bytes), whatever they decode to is emitted as it is, broken bytes as U+FFFD.
//! Without the bound every push would re-decode a window that grows with the run:
//! quadratic work, without limit, for a model stuck emitting such tokens.

use super::{TextTokenizer, TokenizerError};

/// Incremental detokenizer for one sequence.
///
/// Invariants: after every push, [`pending_len`](Self::pending_len) is below
/// [`MAX_PENDING`](Self::MAX_PENDING), so a push decodes at most about twice that many
/// ids (the last emitted chunk plus the pending ones; more only right after a long
/// `with_context`). For byte-level tokenizers, the concatenation of every
/// [`push`](Self::push) output followed by [`finish`](Self::finish) equals
/// `tok.decode(all pushed ids, skip_special)` unless `MAX_PENDING` or more ids come
/// between the bytes of one character (its pieces then come out as U+FFFD), and no
/// output ends in a character cut in half unless that bound forced it out.
#[derive(Debug, Clone, Default)]
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    /// Start of the decode window (context for the text before `read_offset`).
    prefix_offset: usize,
    /// End of the text already emitted.
    read_offset: usize,
    skip_special: bool,
    /// Text decoded past `read_offset` but held back.
    pending: String,
    /// Control tokens decoded as their text even with `skip_special`: a
    /// chat format's markers, which its parser must see.
    shown: Vec<u32>,
}

impl IncrementalDecoder {
    /// Most ids held back without emitting: a push that leaves this many ids unemitted
    /// emits their text as it stands. A UTF-8 character spans at most 4 byte tokens, so
    /// well-formed output never reaches the bound unless several ids that decode to
    /// nothing land inside one character.
    pub const MAX_PENDING: usize = 8;

    /// A decoder for a fresh sequence; with `skip_special`, control tokens emit nothing.
    pub fn new(skip_special: bool) -> Self {
        Self {
            skip_special,
            ..Self::default()
        }
    }

    /// A decoder whose first window starts with `context` (e.g. the last few prompt ids),
    /// which is never emitted. Only decoders that strip or merge across token boundaries
    /// (SentencePiece-style leading spaces) need it; byte-level BPE does not.
    pub fn with_context(skip_special: bool, context: &[u32]) -> Self {
        Self {
            ids: context.to_vec(),
            prefix_offset: 0,
            read_offset: context.len(),
            skip_special,
            pending: String::new(),
            shown: Vec::new(),
        }
    }

    /// The same decoder, decoding the control tokens `ids` as their text
    /// (each one whole, after what was held back before it) even when
    /// special tokens are skipped.
    pub fn showing(mut self, ids: Vec<u32>) -> Self {
        self.shown = ids;
        self
    }

    /// Adds one generated id and returns the newly completed text (often empty while a
    /// multi-byte character is incomplete).
    ///
    /// Errors: [`TokenizerError::TokenIdOutOfRange`] (the id is not added) or a decode
    /// failure from the tokenizer.
    pub fn push(&mut self, tok: &TextTokenizer, id: u32) -> Result<String, TokenizerError> {
        self.push_marked(tok, id).map(|(text, _)| text)
    }

    /// [`push`](Self::push), also saying where in the returned text the
    /// token's own text starts when it is one of the shown control tokens
    /// (it ends the text: what was held back comes first). A chat format
    /// counts a marker only there; the same characters spelled by other
    /// tokens are text.
    ///
    /// Errors: as [`push`](Self::push).
    pub fn push_marked(
        &mut self,
        tok: &TextTokenizer,
        id: u32,
    ) -> Result<(String, Option<usize>), TokenizerError> {
        tok.check_id(id)?;
        if self.shown.contains(&id) {
            let marker = tok.decode(&[id], false)?;
            let mut out = self.finish();
            self.ids.push(id);
            // The next window starts after the marker: no decoder merges
            // text across a control token.
            self.prefix_offset = self.ids.len();
            self.read_offset = self.ids.len();
            let at = out.len();
            out.push_str(&marker);
            return Ok((out, Some(at)));
        }
        self.ids.push(id);
        let decoded = tok
            .decode(
                &self.ids[self.prefix_offset..self.read_offset],
                self.skip_special,
            )
            .and_then(|prefix| {
                let full = tok.decode(&self.ids[self.prefix_offset..], self.skip_special)?;
                Ok((prefix, full))
            });
        let (prefix_text, new_text) = match decoded {
            Ok(texts) => texts,
            Err(e) => {
                self.ids.pop();
                return Err(e);
            }
        };
        let delta = text_after(&prefix_text, &new_text);
        let complete = !delta.is_empty() && !new_text.ends_with(char::REPLACEMENT_CHARACTER);
        // Past the bound, give up waiting for a completion: emit the text as it stands
        // (possibly empty or ending in U+FFFD) so the window starts afresh.
        if complete || self.ids.len() - self.read_offset >= Self::MAX_PENDING {
            let out = delta.to_owned();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            self.pending.clear();
            Ok((out, None))
        } else {
            self.pending = delta.to_owned();
            Ok((String::new(), None))
        }
    }

    /// Returns the text held back so far (an incomplete character decodes to U+FFFD) and
    /// marks it emitted. Call once the sequence ends.
    pub fn finish(&mut self) -> String {
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        std::mem::take(&mut self.pending)
    }

    /// Ids pushed but not yet emitted as text (held back because they do not complete
    /// a character or decode to nothing). Below [`MAX_PENDING`](Self::MAX_PENDING) after
    /// every push; 0 after [`finish`](Self::finish).
    pub fn pending_len(&self) -> usize {
        self.ids.len() - self.read_offset
    }

    /// Every id pushed so far (after any context).
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }
}

/// The part of `full` after `prefix`. When `full` does not start with `prefix` (a decoder
/// that rewrites earlier text), the part after their longest common prefix.
fn text_after<'a>(prefix: &str, full: &'a str) -> &'a str {
    if let Some(rest) = full.strip_prefix(prefix) {
        return rest;
    }
    let common = prefix
        .char_indices()
        .zip(full.chars())
        .find(|((_, a), b)| a != b)
        .map_or(prefix.len().min(full.len()), |((i, _), _)| i);
    full.get(common..).unwrap_or("")
}

#[cfg(test)]
mod tests {
    use super::super::byte_level_char;
    use super::super::tests::tiny;
    use super::*;

    /// Pushes ids one at a time; returns the chunks (finish() output last).
    fn stream(tok: &TextTokenizer, ids: &[u32], skip_special: bool) -> Vec<String> {
        let mut dec = IncrementalDecoder::new(skip_special);
        let mut chunks: Vec<String> = ids.iter().map(|&id| dec.push(tok, id).unwrap()).collect();
        chunks.push(dec.finish());
        chunks
    }

    #[test]
    fn multibyte_characters_are_held_back_until_complete() {
        let t = tiny();
        // The tiny vocabulary has no merges for these: one token per byte.
        let ids = t.encode("🦀", false).unwrap();
        assert_eq!(ids.len(), 4);
        assert_eq!(stream(&t, &ids, false), ["", "", "", "🦀", ""]);

        let text = "hello 中文 world 🚀!\n∑∫√ café";
        let ids = t.encode(text, false).unwrap();
        let chunks = stream(&t, &ids, false);
        assert_eq!(chunks.concat(), text);
        assert!(chunks.iter().all(|c| !c.contains('\u{FFFD}')));
        // "中" is 3 bytes: two pushes emit nothing, the third emits the character.
        let zh = t.encode(" 中", false).unwrap();
        assert_eq!(stream(&t, &zh, false), [" ", "", "", "中", ""]);
    }

    #[test]
    fn special_tokens_and_finish() {
        let t = tiny();
        let ids = t
            .encode("<|im_start|>hello world<|im_end|>", false)
            .unwrap();
        assert_eq!(stream(&t, &ids, true).concat(), "hello world");
        assert_eq!(
            stream(&t, &ids, false).concat(),
            "<|im_start|>hello world<|im_end|>"
        );

        // A cut character at the end is flushed by finish() as U+FFFD, like decode().
        let mut ids = t.encode("a", false).unwrap();
        ids.extend(&t.encode("🦀", false).unwrap()[..2]);
        let chunks = stream(&t, &ids, false);
        assert_eq!(chunks.concat(), t.decode(&ids, false).unwrap());
        assert_eq!(chunks.last().unwrap(), "\u{FFFD}");
    }

    #[test]
    fn bad_id_leaves_state_untouched() {
        let t = tiny();
        let mut dec = IncrementalDecoder::new(false);
        let h = t.token_to_id("hello").unwrap();
        assert_eq!(dec.push(&t, h).unwrap(), "hello");
        assert!(dec.push(&t, u32::MAX).is_err());
        assert_eq!(dec.ids(), &[h]);
        let w = t.token_to_id("Ġworld").unwrap();
        assert_eq!(dec.push(&t, w).unwrap(), " world");
        assert_eq!(dec.finish(), "");
    }

    #[test]
    fn context_is_not_emitted() {
        let t = tiny();
        let ctx = t.encode("hello", false).unwrap();
        let mut dec = IncrementalDecoder::with_context(false, &ctx);
        let w = t.token_to_id("Ġworld").unwrap();
        assert_eq!(dec.push(&t, w).unwrap(), " world");
    }

    #[test]
    fn pending_window_stays_bounded() {
        let t = tiny();
        let max = IncrementalDecoder::MAX_PENDING;
        let (hello, world) = (
            t.token_to_id("hello").unwrap(),
            t.token_to_id("Ġworld").unwrap(),
        );
        // Control tokens skipped as special decode to nothing.
        let end = t.token_to_id("<|im_end|>").unwrap();
        let mut ids = vec![hello];
        ids.extend(std::iter::repeat_n(end, 1000));
        ids.push(world);
        let mut dec = IncrementalDecoder::new(true);
        let mut out = String::new();
        for &id in &ids {
            out.push_str(&dec.push(&t, id).unwrap());
            assert!(dec.pending_len() < max, "pending {}", dec.pending_len());
        }
        out.push_str(&dec.finish());
        assert_eq!(out, "hello world");

        // Stray UTF-8 continuation bytes never complete a character: they come out as
        // U+FFFD in bounded batches instead of piling up.
        let stray = t.token_to_id(&byte_level_char(0x80).to_string()).unwrap();
        let ids = vec![stray; 1000];
        let mut dec = IncrementalDecoder::new(false);
        let mut out = String::new();
        for &id in &ids {
            out.push_str(&dec.push(&t, id).unwrap());
            assert!(dec.pending_len() < max, "pending {}", dec.pending_len());
        }
        out.push_str(&dec.finish());
        assert_eq!(out, t.decode(&ids, false).unwrap());
        assert_eq!(out.chars().count(), 1000);
    }

    #[test]
    fn a_few_empty_ids_inside_a_character_do_not_break_it() {
        let t = tiny();
        let end = t.token_to_id("<|im_end|>").unwrap();
        let crab = t.encode("🦀", false).unwrap();
        let mut ids = vec![crab[0], end, crab[1], end, end, crab[2], crab[3]];
        ids.extend(t.encode(" hello", false).unwrap());
        assert_eq!(
            stream(&t, &ids, true),
            ["", "", "", "", "", "", "🦀", " ", "hello", ""]
        );
    }

    #[test]
    fn text_after_handles_rewrites() {
        assert_eq!(text_after("ab", "abc"), "c");
        assert_eq!(text_after("ab", "axyz"), "xyz");
        assert_eq!(text_after("héllo", "hé"), "");
        assert_eq!(text_after("", "x"), "x");
    }
}

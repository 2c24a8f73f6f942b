//! The seam between sampling and a grammar: [`TokenConstraint`] says which
//! tokens may come next, so the SAME mask can be applied to the draft's q,
//! to every verified row of the target, and to plain decoding. The grammar
//! engine itself (llguidance) lives in the gateway crate; this crate only
//! knows the trait and the [`TokenMask`] bit set.
//!
//! Speculation asks about positions past the committed tokens: "which
//! tokens are allowed after the committed ones followed by `pending`". An
//! implementation advances a tentative cursor for `pending` and undoes it;
//! only [`TokenConstraint::commit`] moves the committed state, and only with
//! tokens the target accepted.

/// A set of token ids, one bit each (bit `t % 32` of word `t / 32`).
///
/// Invariant: ids at or past `len()` are never allowed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenMask {
    words: Vec<u32>,
    len: usize,
}

impl TokenMask {
    /// A mask over `len` ids with none allowed.
    pub fn none(len: usize) -> Self {
        Self {
            words: vec![0; len.div_ceil(32)],
            len,
        }
    }

    /// A mask over `len` ids with every one allowed.
    pub fn all(len: usize) -> Self {
        let mut m = Self::none(len);
        (0..len as u32).for_each(|t| m.allow(t));
        m
    }

    /// A mask from words in the layout above (llguidance's `SimpleVob`
    /// uses the same one); bits at or past `len` are cleared.
    pub fn from_words(mut words: Vec<u32>, len: usize) -> Self {
        words.resize(len.div_ceil(32), 0);
        if !len.is_multiple_of(32) {
            if let Some(last) = words.last_mut() {
                *last &= (1u32 << (len % 32)) - 1;
            }
        }
        Self { words, len }
    }

    /// Ids the mask covers.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the mask covers no ids.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn allow(&mut self, t: u32) {
        if (t as usize) < self.len {
            self.words[t as usize / 32] |= 1 << (t % 32);
        }
    }

    pub fn is_allowed(&self, t: u32) -> bool {
        (t as usize) < self.len && self.words[t as usize / 32] & (1 << (t % 32)) != 0
    }

    /// How many ids are allowed.
    pub fn count(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// Sets every logit whose id is not allowed to -inf (logits past the
    /// mask's length too: a model's output row may be padded wider than its
    /// tokenizer's vocabulary).
    pub fn apply(&self, logits: &mut [f32]) {
        for (t, l) in logits.iter_mut().enumerate() {
            if !self.is_allowed(t as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
    }
}

/// Why a constraint could not answer. A failed constraint ends its request
/// (the engine reports the message); it never yields an unconstrained token.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("grammar: {0}")]
pub struct ConstraintError(pub String);

/// A grammar over token sequences, as decoding needs it.
///
/// All methods take `pending`: tokens after the committed ones that are
/// being asked about but are not accepted (drafts). Implementations may
/// keep a tentative cursor and reuse it across calls with a common prefix.
/// `pending` given to `allowed`/`forced` must itself be allowed (callers cut
/// drafts with [`valid_prefix`](Self::valid_prefix) first).
pub trait TokenConstraint: Send {
    /// The ids allowed after the committed tokens and `pending`. When the
    /// grammar is complete only end-of-sequence ids are allowed.
    fn allowed(&mut self, pending: &[u32]) -> Result<TokenMask, ConstraintError>;

    /// How many leading tokens of `tokens` (after the committed ones) the
    /// grammar allows, in order.
    fn valid_prefix(&mut self, tokens: &[u32]) -> usize;

    /// Tokens the grammar forces after the committed tokens and `pending`
    /// (jump-forward); empty when the next token is a real choice.
    fn forced(&mut self, pending: &[u32]) -> Vec<u32>;

    /// Makes `tokens` part of the committed state for good (the tokens the
    /// target accepted). An end-of-sequence id completes the grammar.
    ///
    /// Errors: a token the grammar forbids (a caller bug: every emitted
    /// token was drawn from a masked distribution).
    fn commit(&mut self, tokens: &[u32]) -> Result<(), ConstraintError>;
}

/// Makes a fresh [`TokenConstraint`] at the start of a request's output:
/// the compiled grammar a request carries (cheap to clone, shared).
pub trait ConstraintSource: Send + Sync + std::fmt::Debug {
    /// A constraint in its start state.
    ///
    /// Errors: the grammar cannot start (reported as the request's error).
    fn start(&self) -> Result<Box<dyn TokenConstraint>, ConstraintError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_allow_what_they_hold_and_nothing_past_their_length() {
        let mut m = TokenMask::none(40);
        m.allow(3);
        m.allow(33);
        m.allow(41);
        assert!(m.is_allowed(3) && m.is_allowed(33) && !m.is_allowed(4));
        assert!(!m.is_allowed(41));
        assert_eq!(m.count(), 2);
        let mut logits = vec![0.0f32; 45];
        m.apply(&mut logits);
        assert_eq!(logits[3], 0.0);
        assert!(logits[44].is_infinite() && logits[0].is_infinite());
        assert_eq!(TokenMask::all(40).count(), 40);
        let w = TokenMask::from_words(vec![u32::MAX, u32::MAX], 40);
        assert_eq!(w.count(), 40);
    }
}

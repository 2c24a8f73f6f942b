//! Per-request logits processing that depends on what was generated:
//! presence / frequency / repetition penalties, `logit_bias`, `min_tokens`
//! and a grammar mask. It runs BEFORE [`crate::SamplingParams::warp`]
//! (temperature, top-k, top-p, min-p), identically on the draft's q rows and
//! on every verified target row, each row seeing the history as if the
//! drafts before it had been emitted.
//!
//! Log-probabilities reported to clients ([`TokenLogprob`]) are
//! log-softmax of the processed logits (penalties, bias, min_tokens and
//! grammar applied; temperature, top-k, top-p and min-p not), vLLM's
//! "processed logits" before sampling parameters.

/// What a request asks of the processing. Defaults: all off.
///
/// Invariants (checked by the API layer): penalties finite,
/// `repetition_penalty > 0`, biases finite.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Controls {
    /// OpenAI's: subtracted once from every token already generated.
    pub presence_penalty: f32,
    /// OpenAI's: subtracted per occurrence in the generated tokens.
    pub frequency_penalty: f32,
    /// vLLM's (CTRL's): logits of tokens in prompt or output are divided by
    /// it when positive, multiplied when negative; 1 (or 0 = unset) is off.
    pub repetition_penalty: f32,
    /// Added to the logit of each id (-100 effectively bans it).
    pub logit_bias: Vec<(u32, f32)>,
    /// No end of sequence before this many output tokens: the ids in
    /// `min_tokens_ban` are masked until then.
    pub min_tokens: usize,
    /// EOS and stop token ids (filled in by the engine).
    pub min_tokens_ban: Vec<u32>,
}

/// One emitted token's log-probability and the most likely alternatives
/// at its position (most likely first).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

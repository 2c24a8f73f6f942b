//! Per-request logits processing that depends on what was generated:
//! presence / frequency / repetition penalties, `logit_bias`, `min_tokens`
//! and a grammar mask. It runs BEFORE [`crate::SamplingParams::warp`]
//! (temperature, min-p, top-k, top-p), identically on the draft's q rows and
//! on every verified target row, each row seeing the history as if the
//! drafts before it had been emitted (the `pending` tokens).
//!
//! Log-probabilities reported to clients ([`TokenLogprob`]) are
//! log-softmax of the processed logits (penalties, bias, min_tokens and
//! grammar applied; temperature, top-k, top-p and min-p not), vLLM's
//! "processed logits" before sampling parameters.

use crate::constraint::{ConstraintError, TokenConstraint};
use std::collections::{HashMap, HashSet};

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
    /// EOS and stop token ids (filled in by the engine). Under a grammar
    /// they are also the ids a proposal is cut before (see
    /// [`LogitsProcessor::shape_proposal`]).
    pub min_tokens_ban: Vec<u32>,
}

/// One emitted token's log-probability and the most likely alternatives
/// at its position (most likely first). Computed from the processed logits
/// (penalties, bias, min_tokens and grammar applied; temperature, top-k,
/// top-p and min-p not). Always finite: `-inf` is reported as
/// [`LOGPROB_FLOOR`].
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// What a log-probability of a token that cannot occur (`-inf`) is
/// reported as: OpenAI's floor, so no client ever sees a non-finite number.
pub const LOGPROB_FLOOR: f32 = -9999.0;

/// The [`TokenLogprob`] of `token` in a row of processed logits, with the
/// `top` most likely ids (ties by lower id). Log-softmax in f64; values
/// below [`LOGPROB_FLOOR`] (and `-inf`) become the floor. `top` is capped
/// at the row's length.
pub fn token_logprob(processed: &[f32], token: u32, top: usize) -> TokenLogprob {
    let max = processed.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = if max.is_finite() {
        let s: f64 = processed
            .iter()
            .map(|&l| ((l - max) as f64).exp())
            .sum::<f64>();
        max as f64 + s.ln()
    } else {
        f64::INFINITY
    };
    let lp = |l: f32| -> f32 {
        let v = (l as f64 - lse) as f32;
        if v.is_nan() {
            LOGPROB_FLOOR
        } else {
            v.max(LOGPROB_FLOOR)
        }
    };
    let n = top.min(processed.len());
    let mut ids: Vec<u32> = Vec::new();
    if n > 0 {
        ids = (0..processed.len() as u32).collect();
        let by = |a: &u32, b: &u32| {
            processed[*b as usize]
                .total_cmp(&processed[*a as usize])
                .then(a.cmp(b))
        };
        if n < ids.len() {
            ids.select_nth_unstable_by(n - 1, by);
            ids.truncate(n);
        }
        ids.sort_unstable_by(by);
    }
    TokenLogprob {
        token,
        logprob: processed
            .get(token as usize)
            .map_or(LOGPROB_FLOOR, |&l| lp(l)),
        top: ids
            .into_iter()
            .map(|t| (t, lp(processed[t as usize])))
            .collect(),
    }
}

/// [`token_logprob`] of each row of `rows` (row-major, `vocab` floats a
/// row): row `r` scores `targets[r]` with `top` alternatives. Rows run in
/// parallel on the forward's helper threads ([`crate::team`]), next to
/// where the logits were produced, so a long echoed prompt costs the
/// engine thread a share of one parallel loop, and only these small
/// results travel on; the numbers are exactly [`token_logprob`]'s.
///
/// Panics if `rows` holds fewer than `targets.len() * vocab` floats.
pub fn rows_logprobs(rows: &[f32], vocab: usize, targets: &[u32], top: usize) -> Vec<TokenLogprob> {
    assert!(
        rows.len() >= targets.len() * vocab,
        "fewer rows than targets"
    );
    let mut out = vec![
        TokenLogprob {
            token: 0,
            logprob: LOGPROB_FLOOR,
            top: Vec::new(),
        };
        targets.len()
    ];
    crate::team::for_each_chunk(&mut out, 1, |r, slot| {
        slot[0] = token_logprob(&rows[r * vocab..(r + 1) * vocab], targets[r], top);
    });
    out
}

/// One sequence's processing state: its [`Controls`], the output so far
/// (counts for the penalties, how many for `min_tokens`), the prompt's ids
/// (only kept when the repetition penalty is on) and an optional grammar
/// constraint. The default processes nothing.
///
/// Invariant: the committed state reflects exactly the tokens passed to
/// [`commit`](Self::commit), i.e. the tokens the target emitted; drafts are
/// only ever seen as `pending`.
#[derive(Default)]
pub struct LogitsProcessor {
    controls: Controls,
    /// Prompt and output ids (repetition penalty on only).
    seen: HashSet<u32>,
    /// Occurrences of each output id.
    counts: HashMap<u32, u32>,
    generated: usize,
    constraint: Option<Box<dyn TokenConstraint>>,
}

impl std::fmt::Debug for LogitsProcessor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogitsProcessor")
            .field("controls", &self.controls)
            .field("generated", &self.generated)
            .field("constraint", &self.constraint.is_some())
            .finish()
    }
}

impl LogitsProcessor {
    /// Processing for a request with `controls`, whose prompt is `prompt`
    /// (read only for the repetition penalty), optionally constrained by a
    /// grammar in its start state.
    pub fn new(
        controls: Controls,
        prompt: &[u32],
        constraint: Option<Box<dyn TokenConstraint>>,
    ) -> Self {
        let mut p = Self {
            controls,
            constraint,
            ..Self::default()
        };
        if p.repetition_on() {
            p.seen.extend(prompt.iter().copied());
        }
        p
    }

    fn repetition_on(&self) -> bool {
        let rp = self.controls.repetition_penalty;
        rp > 0.0 && rp != 1.0
    }

    /// The controls this processes with.
    pub fn controls(&self) -> &Controls {
        &self.controls
    }

    /// Whether a grammar constrains the output.
    pub fn has_constraint(&self) -> bool {
        self.constraint.is_some()
    }

    /// Output tokens committed so far.
    pub fn generated(&self) -> usize {
        self.generated
    }

    /// Processes one row of logits in place for the position after the
    /// committed tokens and `pending` (drafts not yet accepted), in this
    /// order: grammar mask (-inf for what it forbids), `min_tokens` (the
    /// ban ids masked while output + pending < min_tokens, unless that
    /// would leave no token: a complete grammar allowing only EOS wins),
    /// `logit_bias`, repetition penalty (ids in prompt, output or pending),
    /// frequency and presence penalties (output and pending only).
    ///
    /// Cost: O(vocab) for a mask or an active min_tokens, else
    /// O(distinct ids seen + pending).
    ///
    /// Errors: the constraint fails, or under a constraint no id of the
    /// row is left (the request cannot go on).
    pub fn process(&mut self, logits: &mut [f32], pending: &[u32]) -> Result<(), ConstraintError> {
        if let Some(c) = self.constraint.as_mut() {
            c.allowed(pending)?.apply(logits);
        }
        let c = &self.controls;
        if self.generated + pending.len() < c.min_tokens && !c.min_tokens_ban.is_empty() {
            let mut saved = Vec::with_capacity(c.min_tokens_ban.len());
            for &t in &c.min_tokens_ban {
                if let Some(l) = logits.get_mut(t as usize) {
                    saved.push((t, *l));
                    *l = f32::NEG_INFINITY;
                }
            }
            if !logits.iter().any(|l| l.is_finite()) {
                for (t, l) in saved {
                    logits[t as usize] = l;
                }
            }
        }
        for &(t, b) in &c.logit_bias {
            if let Some(l) = logits.get_mut(t as usize) {
                *l += b;
            }
        }
        if self.repetition_on() {
            let rp = c.repetition_penalty;
            let penalize = |l: &mut f32| *l = if *l > 0.0 { *l / rp } else { *l * rp };
            for &t in &self.seen {
                if let Some(l) = logits.get_mut(t as usize) {
                    penalize(l);
                }
            }
            for (i, &t) in pending.iter().enumerate() {
                if !self.seen.contains(&t) && !pending[..i].contains(&t) {
                    if let Some(l) = logits.get_mut(t as usize) {
                        penalize(l);
                    }
                }
            }
        }
        let (freq, pres) = (c.frequency_penalty, c.presence_penalty);
        if freq != 0.0 || pres != 0.0 {
            let in_pending = |t: u32| pending.iter().filter(|&&p| p == t).count() as f32;
            let apply = |l: &mut f32, n: f32| *l -= freq * n + pres * f32::from(n > 0.0);
            for (&t, &n) in &self.counts {
                if let Some(l) = logits.get_mut(t as usize) {
                    apply(l, n as f32 + in_pending(t));
                }
            }
            for (i, &t) in pending.iter().enumerate() {
                if !self.counts.contains_key(&t) && !pending[..i].contains(&t) {
                    if let Some(l) = logits.get_mut(t as usize) {
                        apply(l, in_pending(t));
                    }
                }
            }
        }
        if self.constraint.is_some() && !logits.iter().any(|l| l.is_finite()) {
            return Err(ConstraintError(
                "no token of the vocabulary is allowed here".into(),
            ));
        }
        Ok(())
    }

    /// Makes `tokens` (emitted by the target, in order) part of the
    /// committed history: penalty counts, the `min_tokens` count and the
    /// constraint's state.
    ///
    /// Errors: the constraint refuses a token (the request must end).
    pub fn commit(&mut self, tokens: &[u32]) -> Result<(), ConstraintError> {
        if let Some(c) = self.constraint.as_mut() {
            c.commit(tokens)?;
        }
        let rep = self.repetition_on();
        for &t in tokens {
            *self.counts.entry(t).or_insert(0) += 1;
            if rep {
                self.seen.insert(t);
            }
        }
        self.generated += tokens.len();
        Ok(())
    }

    /// Whether a drafted path (tokens after the committed ones, in order)
    /// may be verified under the grammar: none of it is a stop id (a draft
    /// past the end is never output, and the grammar must not be asked to
    /// go past its end) and the grammar allows all of it. True without a
    /// grammar. What [`LogitsProcessor::shape_proposal`] checks of a chain,
    /// for one path of a tree.
    pub fn admits(&mut self, path: &[u32]) -> bool {
        let Some(c) = self.constraint.as_mut() else {
            return true;
        };
        let ban = &self.controls.min_tokens_ban;
        !path.iter().any(|t| ban.contains(t)) && c.valid_prefix(path) == path.len()
    }

    /// Fits a proposal to the grammar before verification (a no-op without
    /// one): cuts it before its first stop id (`min_tokens_ban`: a draft
    /// past the end is never output, and the grammar must not be asked to
    /// go past its end), then at its first token the grammar forbids, then
    /// extends it up to `k` tokens with what the grammar forces
    /// (jump-forward; a forced stop id ends the extension). `q`, when
    /// given, is cut alike and extended with one-hot rows for the forced
    /// tokens (a one-hot q is what proposing a token for sure means, so
    /// acceptance stays lossless); a q left without rows becomes `None`.
    /// Returns how many forced tokens were added.
    ///
    /// Invariant kept: `q`, when `Some`, has one row per token.
    pub fn shape_proposal(
        &mut self,
        tokens: &mut Vec<u32>,
        q: &mut Option<Vec<Vec<f32>>>,
        k: usize,
    ) -> usize {
        let Some(c) = self.constraint.as_mut() else {
            return 0;
        };
        let ban = &self.controls.min_tokens_ban;
        let width = q.as_ref().and_then(|q| q.first()).map(Vec::len);
        if let Some(stop) = tokens.iter().position(|t| ban.contains(t)) {
            tokens.truncate(stop);
        }
        let valid = c.valid_prefix(tokens);
        tokens.truncate(valid);
        if let Some(rows) = q.as_mut() {
            rows.truncate(tokens.len());
            if rows.is_empty() {
                *q = None;
            }
        }
        let mut forced = 0;
        if tokens.len() < k {
            for t in c.forced(tokens).into_iter().take(k - tokens.len()) {
                if ban.contains(&t) {
                    break;
                }
                tokens.push(t);
                if let (Some(rows), Some(w)) = (q.as_mut(), width) {
                    let mut row = vec![0f32; w];
                    if let Some(x) = row.get_mut(t as usize) {
                        *x = 1.0;
                    }
                    rows.push(row);
                }
                forced += 1;
            }
        }
        forced
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::constraint::TokenMask;

    fn controls() -> Controls {
        Controls::default()
    }

    fn run(p: &mut LogitsProcessor, logits: &[f32], pending: &[u32]) -> Vec<f32> {
        let mut l = logits.to_vec();
        p.process(&mut l, pending).unwrap();
        l
    }

    #[test]
    fn rows_logprobs_are_token_logprob_per_row() {
        let vocab = 37;
        let rows: Vec<f32> = (0..5 * vocab)
            .map(|i| ((i * 7919 % 101) as f32 - 50.0) / 9.0)
            .collect();
        let targets = [3u32, 0, 36, 12];
        let got = rows_logprobs(&rows, vocab, &targets, 4);
        assert_eq!(got.len(), targets.len());
        for (r, (g, &t)) in got.iter().zip(&targets).enumerate() {
            let want = token_logprob(&rows[r * vocab..(r + 1) * vocab], t, 4);
            assert_eq!(*g, want, "row {r}");
        }
        assert!(rows_logprobs(&rows, vocab, &[], 4).is_empty());
    }

    #[test]
    fn presence_and_frequency_count_output_and_pending_only() {
        let c = Controls {
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            ..controls()
        };
        // Token 0 is in the prompt only: no penalty from the prompt.
        let mut p = LogitsProcessor::new(c, &[0, 0], None);
        p.commit(&[1, 1, 2]).unwrap();
        let l = run(&mut p, &[1.0; 5], &[2, 3]);
        assert_eq!(l[0], 1.0);
        assert_eq!(l[1], 1.0 - 0.25 * 2.0 - 0.5);
        assert_eq!(l[2], 1.0 - 0.25 * 2.0 - 0.5, "one committed + one pending");
        assert_eq!(l[3], 1.0 - 0.25 - 0.5, "pending only");
        assert_eq!(l[4], 1.0);
        // Processing does not move the committed state.
        let l = run(&mut p, &[1.0; 5], &[]);
        assert_eq!((l[2], l[3]), (1.0 - 0.25 - 0.5, 1.0));
    }

    #[test]
    fn repetition_divides_positive_and_multiplies_negative_once_per_id() {
        let c = Controls {
            repetition_penalty: 2.0,
            ..controls()
        };
        let mut p = LogitsProcessor::new(c, &[0, 1, 1], None);
        p.commit(&[2]).unwrap();
        let l = run(&mut p, &[3.0, -3.0, 4.0, 5.0, 6.0], &[3, 3]);
        assert_eq!(l, vec![1.5, -6.0, 2.0, 2.5, 6.0]);
        // 1.0 and 0 are off.
        for rp in [1.0, 0.0] {
            let c = Controls {
                repetition_penalty: rp,
                ..controls()
            };
            let mut p = LogitsProcessor::new(c, &[0], None);
            assert_eq!(run(&mut p, &[3.0, 1.0], &[1]), vec![3.0, 1.0]);
        }
    }

    #[test]
    fn bias_comes_before_the_repetition_penalty() {
        // bias then penalty: (1 + 3) / 2 = 2; the other order would be 3.5.
        let c = Controls {
            repetition_penalty: 2.0,
            logit_bias: vec![(0, 3.0), (9, 1.0)],
            ..controls()
        };
        let mut p = LogitsProcessor::new(c, &[0], None);
        assert_eq!(run(&mut p, &[1.0, 1.0], &[]), vec![2.0, 1.0]);
    }

    #[test]
    fn min_tokens_bans_until_output_plus_pending_reach_it() {
        let c = Controls {
            min_tokens: 3,
            min_tokens_ban: vec![1, 4],
            ..controls()
        };
        let mut p = LogitsProcessor::new(c, &[], None);
        p.commit(&[0]).unwrap();
        let l = run(&mut p, &[1.0; 5], &[2]);
        assert!(l[1] == f32::NEG_INFINITY && l[4] == f32::NEG_INFINITY && l[0] == 1.0);
        assert_eq!(run(&mut p, &[1.0; 5], &[2, 3]), vec![1.0; 5]);
        p.commit(&[2, 2]).unwrap();
        assert_eq!(run(&mut p, &[1.0; 5], &[]), vec![1.0; 5]);
    }

    /// Allows only ids in a fixed set, and records commits.
    struct Only(Vec<u32>, Vec<u32>);

    impl TokenConstraint for Only {
        fn allowed(&mut self, _pending: &[u32]) -> Result<TokenMask, ConstraintError> {
            let mut m = TokenMask::none(5);
            self.0.iter().for_each(|&t| m.allow(t));
            Ok(m)
        }
        fn valid_prefix(&mut self, tokens: &[u32]) -> usize {
            tokens.iter().take_while(|t| self.0.contains(t)).count()
        }
        fn forced(&mut self, _pending: &[u32]) -> Vec<u32> {
            match self.0.as_slice() {
                [one] => vec![*one; 3],
                _ => vec![],
            }
        }
        fn commit(&mut self, tokens: &[u32]) -> Result<(), ConstraintError> {
            self.1.extend_from_slice(tokens);
            Ok(())
        }
    }

    #[test]
    fn the_mask_comes_first_and_min_tokens_yields_to_it() {
        let c = Controls {
            min_tokens: 5,
            min_tokens_ban: vec![4],
            logit_bias: vec![(2, 100.0)],
            ..controls()
        };
        // The grammar allows only the banned id: the ban is lifted.
        let mut p = LogitsProcessor::new(c.clone(), &[], Some(Box::new(Only(vec![4], vec![]))));
        let l = run(&mut p, &[1.0; 5], &[]);
        assert_eq!(l[4], 1.0);
        assert!(
            l[..4].iter().all(|x| *x == f32::NEG_INFINITY),
            "bias cannot undo the mask"
        );
        // Nothing allowed at all is an error, never an unconstrained row.
        let mut p = LogitsProcessor::new(c, &[], Some(Box::new(Only(vec![], vec![]))));
        assert!(p.process(&mut [1.0; 5], &[]).is_err());
    }

    #[test]
    fn proposals_are_cut_at_stops_and_forbidden_ids_and_extended_by_forced_ones() {
        let c = Controls {
            min_tokens_ban: vec![0],
            ..controls()
        };
        let mut p = LogitsProcessor::new(c.clone(), &[], Some(Box::new(Only(vec![1, 2], vec![]))));
        let mut toks = vec![1, 2, 3, 1];
        let mut q = Some(vec![vec![0.5f32; 5]; 4]);
        assert_eq!(p.shape_proposal(&mut toks, &mut q, 4), 0);
        assert_eq!((toks, q.map(|q| q.len())), (vec![1, 2], Some(2)));
        let mut toks = vec![1, 0, 1];
        let mut q = None;
        p.shape_proposal(&mut toks, &mut q, 3);
        assert_eq!(toks, vec![1]);
        // Forced tokens fill up to k, with one-hot q rows.
        let mut p = LogitsProcessor::new(c, &[], Some(Box::new(Only(vec![3], vec![]))));
        let mut toks = vec![3];
        let mut q = Some(vec![vec![0.2f32; 5]]);
        assert_eq!(p.shape_proposal(&mut toks, &mut q, 3), 2);
        let q = q.unwrap();
        assert_eq!(toks, vec![3, 3, 3]);
        assert_eq!(q[2], vec![0.0, 0.0, 0.0, 1.0, 0.0]);
        // Without a grammar nothing changes.
        let mut p = LogitsProcessor::default();
        let mut toks = vec![0, 9];
        assert_eq!(p.shape_proposal(&mut toks, &mut None, 5), 0);
        assert_eq!(toks, vec![0, 9]);
    }

    #[test]
    fn logprobs_are_log_softmax_with_a_finite_floor_and_sorted_top() {
        let l = [0.0f32, (2.0f32).ln(), f32::NEG_INFINITY, (2.0f32).ln()];
        let lp = token_logprob(&l, 1, 3);
        assert!((lp.logprob - 0.4f32.ln()).abs() < 1e-6);
        assert_eq!(
            lp.top.iter().map(|x| x.0).collect::<Vec<_>>(),
            vec![1, 3, 0]
        );
        assert!((lp.top[2].1 - 0.2f32.ln()).abs() < 1e-6);
        let lp = token_logprob(&l, 2, 10);
        assert_eq!(lp.logprob, LOGPROB_FLOOR);
        assert_eq!(lp.top.len(), 4);
        assert_eq!(lp.top[3], (2, LOGPROB_FLOOR));
        assert!(token_logprob(&l, 0, 0).top.is_empty());
    }
}

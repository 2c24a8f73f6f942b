//! Deciding which draft tokens the target keeps.
//!
//! Given the target's k+1 logit rows for `[last, d_1..d_k]` (row i scores the
//! position of d_{i+1}; row k is the bonus position), each row is first
//! processed by the sequence's [`Sampler`] (penalties, bias, min_tokens,
//! grammar) with the drafts before it as pending history, then:
//! - greedy: keep the longest prefix of drafts equal to the target's argmax,
//!   then emit the target's own argmax at the first mismatch (or the bonus);
//! - sampled: the rule of Leviathan et al. / Chen et al. (2023): keep d_i with
//!   probability min(1, p(d_i) / q(d_i)); at the first rejection draw from
//!   normalize(max(0, p - q)); if all k are kept, draw the bonus from p. p and
//!   q are both processed and warped the same way, so the output is
//!   distributed exactly as the target's processed, warped distribution.
//!
//! The emitted tokens are then committed to the sampler's processing state;
//! rows after the first rejection are never processed.

use crate::constraint::ConstraintError;
use crate::process::{token_logprob, TokenLogprob};
use crate::sample::{argmax, Sampler};

/// The outcome of verifying one sequence's drafts.
///
/// Invariants: `tokens.len() == accepted + 1` (the accepted drafts, then the
/// target's correction or bonus token); `logprobs` is empty, or (when the
/// sampler asks for logprobs) holds one entry per token.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    pub accepted: usize,
    pub tokens: Vec<u32>,
    pub logprobs: Vec<TokenLogprob>,
}

/// Greedy acceptance. `rows` holds `draft.len() + 1` logit rows, processed
/// in place (rows after the first mismatch are left as they were).
///
/// Errors: the sampler's processing fails (a grammar error); nothing is
/// committed then.
pub fn accept_greedy(
    rows: &mut [Vec<f32>],
    draft: &[u32],
    sampler: &mut Sampler,
) -> Result<Verdict, ConstraintError> {
    decide(rows, draft, None, sampler, true)
}

/// Lossless speculative sampling. `rows` holds `draft.len() + 1` target logit
/// rows (processed in place); `q` the draft's processed, warped distribution
/// per draft token, or `None` when the proposer is deterministic (q one-hot
/// on its token). Greedy params fall back to [`accept_greedy`].
///
/// Errors: the sampler's processing fails (a grammar error, or a token the
/// grammar refuses at commit); the request cannot go on.
pub fn accept_sampled(
    rows: &mut [Vec<f32>],
    draft: &[u32],
    q: Option<&[Vec<f32>]>,
    sampler: &mut Sampler,
) -> Result<Verdict, ConstraintError> {
    let greedy = sampler.params().is_greedy();
    decide(rows, draft, q, sampler, greedy)
}

fn decide(
    rows: &mut [Vec<f32>],
    draft: &[u32],
    q: Option<&[Vec<f32>]>,
    sampler: &mut Sampler,
    greedy: bool,
) -> Result<Verdict, ConstraintError> {
    debug_assert_eq!(rows.len(), draft.len() + 1);
    let params = *sampler.params();
    let mut tokens = Vec::with_capacity(draft.len() + 1);
    let mut logprobs = Vec::new();
    for (i, row) in rows.iter_mut().enumerate().take(draft.len() + 1) {
        sampler.process(row, &draft[..i])?;
        let (token, kept) = match draft.get(i) {
            None if greedy => (argmax(row), false),
            None => (sampler.draw(&params.warp(row)), false),
            Some(&d) if greedy => {
                let best = argmax(row);
                (best, best == d)
            }
            Some(&d) => sample_one(row, d, q.map(|q| q[i].as_slice()), sampler),
        };
        if let Some(top) = sampler.logprobs() {
            logprobs.push(token_logprob(row, token, top));
        }
        tokens.push(token);
        if !kept {
            break;
        }
    }
    sampler.commit(&tokens)?;
    Ok(Verdict {
        accepted: tokens.len() - 1,
        tokens,
        logprobs,
    })
}

/// One draft position at temperature > 0: `(d, true)` when d is kept, else
/// the correction drawn from the residual and `false`.
fn sample_one(row: &[f32], d: u32, qi: Option<&[f32]>, sampler: &mut Sampler) -> (u32, bool) {
    let params = *sampler.params();
    let p = params.warp(row);
    let q_d = qi.map_or(1.0, |q| q[d as usize]);
    let p_d = p[d as usize];
    // q_d == 0 cannot happen for a token the draft sampled; treat it as
    // a rejection rather than divide by zero.
    if q_d > 0.0 && sampler.uniform() < (p_d / q_d).min(1.0) {
        return (d, true);
    }
    let mut residual = p;
    match qi {
        Some(q) => residual
            .iter_mut()
            .zip(q)
            .for_each(|(r, &qv)| *r = (*r - qv).max(0.0)),
        None => residual[d as usize] = 0.0,
    }
    let token = if residual.iter().any(|&r| r > 0.0) {
        sampler.draw(&residual)
    } else {
        // p <= q everywhere means p == q: nothing to correct, draw from p.
        sampler.draw(&params.warp(row))
    };
    (token, false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::process::{Controls, LogitsProcessor};
    use crate::sample::SamplingParams;

    fn onehot_row(n: usize, hot: usize) -> Vec<f32> {
        (0..n).map(|i| if i == hot { 5.0 } else { 0.0 }).collect()
    }

    #[test]
    fn greedy_keeps_matching_prefix_then_corrects() {
        let rows = vec![
            onehot_row(6, 2),
            onehot_row(6, 3),
            onehot_row(6, 1),
            onehot_row(6, 4),
        ];
        let mut s = Sampler::new(SamplingParams::default());
        let v = accept_greedy(&mut rows.clone(), &[2, 3, 5], &mut s).unwrap();
        assert_eq!((v.accepted, v.tokens), (2, vec![2, 3, 1]));
        let v = accept_greedy(&mut rows.clone(), &[2, 3, 1], &mut s).unwrap();
        assert_eq!((v.accepted, v.tokens), (3, vec![2, 3, 1, 4]));
        let v = accept_greedy(&mut rows[..1].to_vec(), &[], &mut s).unwrap();
        assert_eq!((v.accepted, v.tokens), (0, vec![2]));
        assert!(v.logprobs.is_empty());
    }

    #[test]
    fn sampled_never_keeps_a_token_the_target_excludes() {
        // Target puts all mass (after top-k 1) on token 2; a draft of 4 must
        // be rejected and replaced by 2, every time.
        let params = SamplingParams {
            temperature: 1.0,
            top_k: 1,
            top_p: 1.0,
            seed: Some(3),
            min_p: 0.0,
        };
        let mut s = Sampler::new(params);
        let rows = vec![onehot_row(6, 2), onehot_row(6, 0)];
        for _ in 0..100 {
            let v = accept_sampled(&mut rows.clone(), &[4], None, &mut s).unwrap();
            assert_eq!((v.accepted, v.tokens), (0, vec![2]));
        }
    }

    #[test]
    fn each_row_sees_the_drafts_before_it_and_only_emitted_tokens_commit() {
        // Every row prefers token 1 (logit 5); a presence penalty of 10
        // makes a repeated 1 lose to token 0. Row 1 must see draft 0 = 1.
        let rows = vec![onehot_row(6, 1); 3];
        let c = Controls {
            presence_penalty: 10.0,
            ..Controls::default()
        };
        let mut s = Sampler::new(SamplingParams::default())
            .with_processor(LogitsProcessor::new(c, &[], None))
            .with_logprobs(Some(2));
        let v = accept_greedy(&mut rows.clone(), &[1, 1], &mut s).unwrap();
        assert_eq!((v.accepted, v.tokens.clone()), (1, vec![1, 0]));
        assert_eq!(v.logprobs.len(), 2);
        assert_eq!(v.logprobs[1].token, 0);
        assert_eq!(
            v.logprobs[1].top[0].0, 0,
            "the penalized 1 is no longer first"
        );
        // Committed: 1 and 0, so both are penalized now.
        assert_eq!(s.processor().generated(), 2);
        let mut row = onehot_row(6, 1);
        s.process(&mut row, &[]).unwrap();
        assert_eq!((row[0], row[1], row[2]), (-10.0, -5.0, 0.0));
    }
}

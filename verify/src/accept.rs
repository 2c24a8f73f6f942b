//! Deciding which draft tokens the target keeps.
//!
//! Given the target's k+1 logit rows for `[last, d_1..d_k]` (row i scores the
//! position of d_{i+1}; row k is the bonus position):
//! - greedy: keep the longest prefix of drafts equal to the target's argmax,
//!   then emit the target's own argmax at the first mismatch (or the bonus);
//! - sampled: the rule of Leviathan et al. / Chen et al. (2023): keep d_i with
//!   probability min(1, p(d_i) / q(d_i)); at the first rejection draw from
//!   normalize(max(0, p - q)); if all k are kept, draw the bonus from p. p and
//!   q are both warped by the same [`SamplingParams`], so the output is
//!   distributed exactly as the target's warped distribution.

use crate::sample::{argmax, Sampler};

/// The outcome of verifying one sequence's drafts.
///
/// Invariant: `tokens.len() == accepted + 1` (the accepted drafts, then the
/// target's correction or bonus token).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub accepted: usize,
    pub tokens: Vec<u32>,
}

/// Greedy acceptance. `rows` holds `draft.len() + 1` logit rows.
pub fn accept_greedy(rows: &[Vec<f32>], draft: &[u32]) -> Verdict {
    debug_assert_eq!(rows.len(), draft.len() + 1);
    let mut tokens = Vec::with_capacity(draft.len() + 1);
    for (row, &d) in rows.iter().zip(draft) {
        let best = argmax(row);
        tokens.push(best);
        if best != d {
            return Verdict {
                accepted: tokens.len() - 1,
                tokens,
            };
        }
    }
    tokens.push(argmax(&rows[draft.len()]));
    Verdict {
        accepted: draft.len(),
        tokens,
    }
}

/// Lossless speculative sampling. `rows` holds `draft.len() + 1` target logit
/// rows; `q` the draft's warped distribution per draft token, or `None` when
/// the proposer is deterministic (q one-hot on its token). Greedy params
/// fall back to [`accept_greedy`].
pub fn accept_sampled(
    rows: &[Vec<f32>],
    draft: &[u32],
    q: Option<&[Vec<f32>]>,
    sampler: &mut Sampler,
) -> Verdict {
    let params = *sampler.params();
    if params.is_greedy() {
        return accept_greedy(rows, draft);
    }
    let mut tokens = Vec::with_capacity(draft.len() + 1);
    for (i, &d) in draft.iter().enumerate() {
        let p = params.warp(&rows[i]);
        let qi = q.map(|q| q[i].as_slice());
        let q_d = qi.map_or(1.0, |q| q[d as usize]);
        let p_d = p[d as usize];
        // q_d == 0 cannot happen for a token the draft sampled; treat it as
        // a rejection rather than divide by zero.
        if q_d > 0.0 && sampler.uniform() < (p_d / q_d).min(1.0) {
            tokens.push(d);
            continue;
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
            sampler.draw(&params.warp(&rows[i]))
        };
        tokens.push(token);
        return Verdict {
            accepted: i,
            tokens,
        };
    }
    let bonus = sampler.draw(&params.warp(&rows[draft.len()]));
    tokens.push(bonus);
    Verdict {
        accepted: draft.len(),
        tokens,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
        let v = accept_greedy(&rows, &[2, 3, 5]);
        assert_eq!(
            v,
            Verdict {
                accepted: 2,
                tokens: vec![2, 3, 1]
            }
        );
        let v = accept_greedy(&rows, &[2, 3, 1]);
        assert_eq!(
            v,
            Verdict {
                accepted: 3,
                tokens: vec![2, 3, 1, 4]
            }
        );
        let v = accept_greedy(&rows[..1], &[]);
        assert_eq!(
            v,
            Verdict {
                accepted: 0,
                tokens: vec![2]
            }
        );
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
        };
        let mut s = Sampler::new(params);
        let rows = vec![onehot_row(6, 2), onehot_row(6, 0)];
        for _ in 0..100 {
            let v = accept_sampled(&rows, &[4], None, &mut s);
            assert_eq!(
                v,
                Verdict {
                    accepted: 0,
                    tokens: vec![2]
                }
            );
        }
    }
}

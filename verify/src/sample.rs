//! Logits -> warped probabilities -> a token. Temperature, min-p, top-k and
//! top-p are applied in one place so that the target's p and the draft's q
//! are warped the same way (lossless acceptance depends on it). The
//! per-sequence [`Sampler`] also owns the sequence's logits processing
//! ([`LogitsProcessor`]: penalties, bias, min_tokens, grammar), which runs
//! before the warp on every row, the draft's and the target's alike.

use crate::constraint::ConstraintError;
use crate::process::LogitsProcessor;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Temperatures below this choose greedily: dividing by a smaller (or
/// subnormal) one overflows f32, and `0 * inf` would turn the warp to NaN.
pub const GREEDY_TEMPERATURE: f32 = 1e-5;

/// How a request wants tokens chosen.
///
/// Invariants: `temperature >= 0` (below [`GREEDY_TEMPERATURE`], 0
/// included, means greedy), `0 < top_p <= 1`,
/// `top_k == 0` means no top-k cut, `0 <= min_p <= 1` (0 means no min-p
/// cut).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub seed: Option<u64>,
    /// Keeps only tokens whose probability (after temperature) is at least
    /// `min_p` times the most likely token's.
    pub min_p: f32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
            min_p: 0.0,
        }
    }
}

impl SamplingParams {
    /// Whether tokens are chosen by argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature < GREEDY_TEMPERATURE
    }

    /// The warped distribution over the vocabulary: softmax(logits / T)
    /// restricted to tokens with probability >= min_p * the largest, then
    /// to the top-k tokens, then to the smallest set whose mass reaches
    /// top-p, renormalized. Greedy params give the one-hot argmax (which
    /// min-p and top-k never change). `-inf` logits get probability 0; a
    /// row with no finite logit gives all zeros.
    pub fn warp(&self, logits: &[f32]) -> Vec<f32> {
        let mut p = vec![0f32; logits.len()];
        if logits.is_empty() {
            return p;
        }
        if self.is_greedy() {
            p[argmax(logits) as usize] = 1.0;
            return p;
        }
        let inv_t = 1.0 / self.temperature;
        let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        if !max.is_finite() {
            return p;
        }
        // Unnormalized: the most likely token has weight exactly 1, so the
        // min-p threshold is min_p itself.
        let mut sum = 0f64;
        for (pi, &l) in p.iter_mut().zip(logits) {
            *pi = ((l - max) * inv_t).exp();
            if *pi < self.min_p {
                *pi = 0.0;
            }
            sum += *pi as f64;
        }
        let top_k = if self.top_k == 0 {
            logits.len()
        } else {
            self.top_k.min(logits.len())
        };
        if top_k < logits.len() || self.top_p < 1.0 {
            let mut order: Vec<u32> = (0..logits.len() as u32).collect();
            // Ties broken by token id so the kept set is deterministic.
            let by_prob =
                |a: &u32, b: &u32| p[*b as usize].total_cmp(&p[*a as usize]).then(a.cmp(b));
            if top_k < order.len() {
                order.select_nth_unstable_by(top_k - 1, by_prob);
                order.truncate(top_k);
            }
            order.sort_unstable_by(by_prob);
            let mut keep = order.len();
            if self.top_p < 1.0 {
                let total: f64 = order.iter().map(|&i| p[i as usize] as f64).sum();
                let mut cum = 0f64;
                for (n, &i) in order.iter().enumerate() {
                    cum += p[i as usize] as f64;
                    if cum >= self.top_p as f64 * total {
                        keep = n + 1;
                        break;
                    }
                }
            }
            let mut kept = vec![0f32; logits.len()];
            sum = 0.0;
            for &i in &order[..keep] {
                kept[i as usize] = p[i as usize];
                sum += p[i as usize] as f64;
            }
            p = kept;
        }
        let inv = (1.0 / sum) as f32;
        p.iter_mut().for_each(|x| *x *= inv);
        p
    }
}

/// Index of the largest logit; the lowest index among equals.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// A seeded random source plus the params it samples with, the
/// sequence's logits processing and whether it reports logprobs. One per
/// sequence, so a seeded request is reproducible whatever else is in the
/// batch; the proposer and acceptance both use it, so the draft's q and the
/// target's p are processed by the same state.
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    processor: LogitsProcessor,
    logprobs: Option<usize>,
}

impl Sampler {
    /// A sampler without processing and without logprobs.
    pub fn new(params: SamplingParams) -> Self {
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        Self {
            params,
            rng,
            processor: LogitsProcessor::default(),
            logprobs: None,
        }
    }

    /// This sampler processing every row with `processor` first.
    pub fn with_processor(mut self, processor: LogitsProcessor) -> Self {
        self.processor = processor;
        self
    }

    /// This sampler reporting a [`crate::TokenLogprob`] per emitted token,
    /// with `top` alternatives (`None`: no logprobs).
    pub fn with_logprobs(mut self, top: Option<usize>) -> Self {
        self.logprobs = top;
        self
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// How many alternatives each emitted token's logprob carries, if
    /// logprobs are wanted.
    pub fn logprobs(&self) -> Option<usize> {
        self.logprobs
    }

    /// The sequence's processing state.
    pub fn processor(&self) -> &LogitsProcessor {
        &self.processor
    }

    /// The sequence's processing state, mutably (to shape proposals).
    pub fn processor_mut(&mut self) -> &mut LogitsProcessor {
        &mut self.processor
    }

    /// [`LogitsProcessor::process`] on this sequence's state.
    ///
    /// Errors: as there (a grammar failure, or nothing allowed).
    pub fn process(&mut self, logits: &mut [f32], pending: &[u32]) -> Result<(), ConstraintError> {
        self.processor.process(logits, pending)
    }

    /// [`LogitsProcessor::commit`] on this sequence's state.
    ///
    /// Errors: the grammar refuses a token.
    pub fn commit(&mut self, tokens: &[u32]) -> Result<(), ConstraintError> {
        self.processor.commit(tokens)
    }

    /// A uniform draw in [0, 1), from this sequence's stream.
    pub fn uniform(&mut self) -> f32 {
        self.rng.random::<f32>()
    }

    /// Draws an index from a probability vector (which need not be exactly
    /// normalized); falls back to the last non-zero entry on rounding.
    pub fn draw(&mut self, probs: &[f32]) -> u32 {
        let total: f32 = probs.iter().sum();
        let mut u = self.uniform() * total;
        let mut last = 0;
        for (i, &p) in probs.iter().enumerate() {
            if p > 0.0 {
                last = i;
                if u < p {
                    return i as u32;
                }
                u -= p;
            }
        }
        last as u32
    }

    /// Picks the next token from one row of logits that is already
    /// processed (see [`process`](Self::process)).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.is_greedy() {
            return argmax(logits);
        }
        let p = self.params.warp(logits);
        self.draw(&p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(t: f32, k: usize, p: f32) -> SamplingParams {
        SamplingParams {
            temperature: t,
            top_k: k,
            top_p: p,
            seed: Some(7),
            min_p: 0.0,
        }
    }

    #[test]
    fn greedy_is_one_hot_argmax() {
        let p = params(0.0, 0, 1.0).warp(&[0.1, 3.0, 3.0, -1.0]);
        assert_eq!(p, vec![0.0, 1.0, 0.0, 0.0]);
    }

    #[test]
    fn a_temperature_too_small_to_divide_by_is_greedy() {
        let logits = [0.1, 3.0, 2.9, -1.0];
        for t in [1e-39f32, 1e-30, 9e-6] {
            let mut s = Sampler::new(params(t, 0, 1.0));
            assert_eq!(params(t, 0, 1.0).warp(&logits), vec![0.0, 1.0, 0.0, 0.0]);
            assert_eq!(s.sample(&logits), 1, "{t}");
        }
        let p = params(GREEDY_TEMPERATURE, 0, 1.0).warp(&logits);
        assert!(p.iter().all(|x| x.is_finite()) && p[1] > 0.99, "{p:?}");
    }

    #[test]
    fn temperature_softmax_sums_to_one() {
        let p = params(2.0, 0, 1.0).warp(&[0.0, (2.0f32).ln() * 2.0]);
        assert!((p[0] - 1.0 / 3.0).abs() < 1e-6 && (p[1] - 2.0 / 3.0).abs() < 1e-6);
    }

    #[test]
    fn top_k_and_top_p_cut_the_tail() {
        let logits = [4.0f32.ln(), 3.0f32.ln(), 2.0f32.ln(), 1.0f32.ln()];
        let p = params(1.0, 2, 1.0).warp(&logits);
        assert!((p[0] - 4.0 / 7.0).abs() < 1e-6 && p[2] == 0.0 && p[3] == 0.0);
        // mass 0.4, 0.3, 0.2, 0.1: top-p 0.65 keeps the first two.
        let p = params(1.0, 0, 0.65).warp(&logits);
        assert!((p[1] - 3.0 / 7.0).abs() < 1e-6 && p[2] == 0.0);
    }

    #[test]
    fn min_p_cuts_relative_to_the_most_likely_after_temperature() {
        // probs 0.5, 0.3, 0.15, 0.05: min_p 0.25 keeps >= 0.125.
        let logits = [0.5f32.ln(), 0.3f32.ln(), 0.15f32.ln(), 0.05f32.ln()];
        let w = SamplingParams {
            min_p: 0.25,
            ..params(1.0, 0, 1.0)
        };
        let p = w.warp(&logits);
        assert!((p[0] - 0.5 / 0.95).abs() < 1e-6 && p[3] == 0.0 && p[2] > 0.0);
        // At temperature 0.5 probs become 25:9:2.25:0.25 (of 36.5), so the
        // 0.25 * 25 threshold also cuts token 2.
        let w = SamplingParams {
            min_p: 0.25,
            ..params(0.5, 0, 1.0)
        };
        let p = w.warp(&logits);
        assert!(p[2] == 0.0 && (p[1] - 9.0 / 34.0).abs() < 1e-5);
        // min-p then top-k: top-2 of what min-p kept.
        let w = SamplingParams {
            min_p: 0.01,
            ..params(1.0, 2, 1.0)
        };
        assert_eq!(w.warp(&logits).iter().filter(|&&x| x > 0.0).count(), 2);
        // Greedy ignores it; a row with no finite logit gives zeros.
        assert_eq!(params(0.0, 0, 1.0).warp(&logits)[0], 1.0);
        assert!(w.warp(&[f32::NEG_INFINITY; 3]).iter().all(|&x| x == 0.0));
    }

    #[test]
    fn seeded_samplers_repeat() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.3).sin()).collect();
        let mut a = Sampler::new(params(0.8, 0, 0.9));
        let mut b = Sampler::new(params(0.8, 0, 0.9));
        let xs: Vec<u32> = (0..20).map(|_| a.sample(&logits)).collect();
        let ys: Vec<u32> = (0..20).map(|_| b.sample(&logits)).collect();
        assert_eq!(xs, ys);
    }

    #[test]
    fn draws_follow_the_distribution() {
        let mut s = Sampler::new(params(1.0, 0, 1.0));
        let probs = [0.5f32, 0.25, 0.25, 0.0];
        let mut counts = [0usize; 4];
        for _ in 0..20_000 {
            counts[s.draw(&probs) as usize] += 1;
        }
        assert_eq!(counts[3], 0);
        assert!((counts[0] as f32 / 20_000.0 - 0.5).abs() < 0.02);
    }
}

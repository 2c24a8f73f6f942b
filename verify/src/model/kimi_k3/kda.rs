//! Kimi Delta Attention (KDA): the per-sequence recurrence of K3's linear
//! attention layers, and their short causal convolutions. Pure functions
//! over f32 slices; the layer around them lives in `mod.rs`.
//!
//! Per head, with a state `S` of `[dk, dv]` (key index first), one token
//! with l2-normalized `q`, `k`, value `v`, per-key-channel log decay `g`
//! and scalar `beta` does, in this order (llama.cpp's `gated_delta_net`
//! CPU op and fla-core's naive recurrence agree on it):
//!
//! ```text
//! S[i][:] *= exp(g[i])                         channel-wise decay
//! u[j]     = beta * (v[j] - sum_i S[i][j] k[i]) delta rule
//! S[i][j] += k[i] * u[j]
//! o[j]     = (1 / sqrt(dk)) * sum_i S[i][j] q[i]
//! ```
//!
//! The state after a token depends only on the state before it and the
//! token, and every sum runs in one fixed order, so a token's output is
//! bit-identical whether its prompt was fed whole, in chunks or token by
//! token.

use crate::kernels::vector::{axpy, dot};

/// One token of one head: updates `s` (`[dk, dv]`, row-major) in place and
/// writes `o` (`dv`). `scratch` holds `dk` floats.
#[allow(clippy::too_many_arguments)]
pub(crate) fn step(
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: f32,
    o: &mut [f32],
    scratch: &mut Vec<f32>,
) {
    let (dk, dv) = (k.len(), v.len());
    debug_assert_eq!(s.len(), dk * dv);
    for (i, row) in s.chunks_exact_mut(dv).enumerate() {
        let d = g[i].exp();
        row.iter_mut().for_each(|x| *x *= d);
    }
    // u = beta * (v - S^T k), summed over i in ascending order.
    scratch.clear();
    scratch.resize(dv, 0.0);
    for (i, row) in s.chunks_exact(dv).enumerate() {
        axpy(k[i], row, scratch);
    }
    for (u, &vj) in scratch.iter_mut().zip(v) {
        *u = beta * (vj - *u);
    }
    for (i, row) in s.chunks_exact_mut(dv).enumerate() {
        axpy(k[i], scratch, row);
    }
    o.fill(0.0);
    for (i, row) in s.chunks_exact(dv).enumerate() {
        axpy(q[i], row, o);
    }
    let scale = 1.0 / (dk as f32).sqrt();
    o.iter_mut().for_each(|x| *x *= scale);
}

/// `x / sqrt(sum(x^2) + eps)` in place: llama.cpp's l2 norm for KDA's q
/// and k (its `eps` is the model's rms-norm epsilon, inside the root).
pub(crate) fn l2_normalize(x: &mut [f32], eps: f32) {
    let inv = 1.0 / (dot(x, x) + eps).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

/// Causal depthwise convolution of `n` new rows `x` (`[n, c]`) for one
/// sequence, continuing from `state` (`[kernel - 1, c]`, oldest row first:
/// the inputs just before `x`), then SiLU. Returns `[n, c]` and leaves in
/// `state` the last `kernel - 1` inputs. `w` is `[c, kernel]` as stored
/// (`conv1d.weight` `[c, 1, kernel]`), tap `kernel - 1` on the newest input.
pub(crate) fn conv_silu(x: &[f32], state: &mut [f32], w: &[f32], kernel: usize) -> Vec<f32> {
    let c = w.len() / kernel;
    let hist = kernel - 1;
    debug_assert_eq!(state.len(), hist * c);
    let n = x.len() / c;
    // The window: old inputs, then the new ones.
    let mut win = Vec::with_capacity((hist + n) * c);
    win.extend_from_slice(state);
    win.extend_from_slice(x);
    let mut out = vec![0f32; n * c];
    for t in 0..n {
        for ch in 0..c {
            let taps = &w[ch * kernel..(ch + 1) * kernel];
            let mut acc = 0f32;
            for (j, &tap) in taps.iter().enumerate() {
                acc += tap * win[(t + j) * c + ch];
            }
            out[t * c + ch] = acc / (1.0 + (-acc).exp());
        }
    }
    state.copy_from_slice(&win[n * c..]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conv_continues_across_calls_exactly() {
        let (c, kernel) = (3, 4);
        let w: Vec<f32> = (0..c * kernel).map(|i| (i as f32 * 0.37).sin()).collect();
        let x: Vec<f32> = (0..7 * c).map(|i| (i as f32 * 0.11).cos()).collect();
        let mut s_whole = vec![0f32; (kernel - 1) * c];
        let whole = conv_silu(&x, &mut s_whole, &w, kernel);
        let mut s = vec![0f32; (kernel - 1) * c];
        let mut parts = conv_silu(&x[..2 * c], &mut s, &w, kernel);
        parts.extend(conv_silu(&x[2 * c..3 * c], &mut s, &w, kernel));
        parts.extend(conv_silu(&x[3 * c..], &mut s, &w, kernel));
        assert_eq!(whole, parts);
        assert_eq!(s_whole, s);
        // Row 0 sees only its own input through the newest tap.
        let a = w[kernel - 1] * x[0];
        assert!((whole[0] - a / (1.0 + (-a).exp())).abs() < 1e-7);
    }

    #[test]
    fn step_is_the_delta_rule() {
        // dk = dv = 1: S' = S e^g; u = b (v - S' k); S'' = S' + k u; o = S'' q.
        let mut s = vec![0.5f32];
        let mut o = vec![0f32];
        let mut scratch = Vec::new();
        step(
            &mut s,
            &[2.0],
            &[0.6],
            &[1.5],
            &[-0.2],
            0.7,
            &mut o,
            &mut scratch,
        );
        let s1 = 0.5 * (-0.2f32).exp();
        let u = 0.7 * (1.5 - s1 * 0.6);
        let s2 = s1 + 0.6 * u;
        assert!((s[0] - s2).abs() < 1e-6);
        assert!((o[0] - s2 * 2.0).abs() < 1e-6);
    }
}

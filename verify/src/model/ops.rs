//! The small per-row operations of a transformer step on plain `f32`
//! slices, shared by both architecture families: RMSNorm, SiLU and the
//! gated product, residual adds. Each writes into a buffer the caller
//! reuses across layers, so a step allocates nothing per layer.
//!
//! Invariant (batch invariance): every operation works row by row (or
//! element by element), so a row's result never depends on other rows.

/// `out = x / rms(x) * w` for each row of `w.len()` values.
///
/// Panics if `out` is shorter than `x`.
pub(crate) fn rms_norm_into(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    for (row, o) in x.chunks_exact(w.len()).zip(out.chunks_exact_mut(w.len())) {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / w.len() as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for ((o, v), g) in o.iter_mut().zip(row).zip(w) {
            *o = g * (v * inv);
        }
    }
}

/// [`rms_norm_into`] into a new vector.
pub(crate) fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let mut y = vec![0f32; x.len()];
    rms_norm_into(x, w, eps, &mut y);
    y
}

/// `x / (1 + e^-x)`, with the exponential that vectorizes.
pub(crate) use crate::kernels::vector::silu;

/// `gate = silu(gate) * up`, element by element, in place.
pub(crate) fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = silu(*g) * u;
    }
}

/// `x += y`, element by element.
pub(crate) fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_matches_candle() {
        let x: Vec<f32> = (0..24).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let w: Vec<f32> = (0..8).map(|i| 0.5 + i as f32 * 0.1).collect();
        let xt = candle_core::Tensor::from_slice(&x, (3, 8), &candle_core::Device::Cpu).unwrap();
        let wt = candle_core::Tensor::from_slice(&w, 8, &candle_core::Device::Cpu).unwrap();
        let want: Vec<f32> = candle_nn::ops::rms_norm(&xt, &wt, 1e-6)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        for (a, b) in rms_norm(&x, &w, 1e-6).iter().zip(&want) {
            assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "{a} vs {b}");
        }
    }

    #[test]
    fn silu_mul_and_add() {
        let mut g = vec![-2.0f32, 0.0, 3.0];
        silu_mul(&mut g, &[1.0, 5.0, 2.0]);
        assert!((g[0] - (-2.0 / (1.0 + 2f32.exp()))).abs() < 1e-6);
        assert_eq!(g[1], 0.0);
        assert!((g[2] - 2.0 * 3.0 / (1.0 + (-3f32).exp())).abs() < 1e-6);
        let mut x = vec![1.0f32, 2.0];
        add_in_place(&mut x, &[0.5, -2.0]);
        assert_eq!(x, vec![1.5, 0.0]);
    }
}

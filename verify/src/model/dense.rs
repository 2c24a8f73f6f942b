//! [`Dense`]: a plain f32 matrix applied row-wise, for families whose
//! weights are dense (safetensors) and whose products must stay
//! batch-invariant however rows are grouped (routed experts see a different
//! set of rows in every batch). Family-neutral.

use crate::kernels::vector::dot;
use rayon::prelude::*;

/// A dense f32 matrix `[out, inp]` (row-major, as stored) applied row-wise.
///
/// Invariant: `w.len() == out * inp` (checked by [`Dense::new`]).
pub(crate) struct Dense {
    pub(crate) w: Vec<f32>,
    pub(crate) out: usize,
    pub(crate) inp: usize,
}

impl Dense {
    /// The matrix `w` of `out` rows of `inp` values.
    ///
    /// Panics: `w` does not hold `out * inp` values (a loader bug: loaders
    /// read tensors of a checked shape).
    pub(crate) fn new(w: Vec<f32>, out: usize, inp: usize) -> Self {
        assert_eq!(w.len(), out * inp, "a [{out}, {inp}] matrix");
        Self { w, out, inp }
    }

    /// `x` is `[n, inp]`; returns `[n, out]`. Each output element is one
    /// `dot` of an input row with a weight row: batch-invariant.
    pub(crate) fn forward(&self, x: &[f32]) -> Vec<f32> {
        let (out, inp) = (self.out, self.inp);
        (0..x.len() / inp * out)
            .into_par_iter()
            .with_min_len(64)
            .map(|i| {
                let (r, o) = (i / out, i % out);
                dot(&x[r * inp..(r + 1) * inp], &self.w[o * inp..(o + 1) * inp])
            })
            .collect()
    }

    /// Weight row `o` (output feature `o`'s `inp` weights).
    pub(crate) fn row(&self, o: usize) -> &[f32] {
        &self.w[o * self.inp..(o + 1) * self.inp]
    }
}

//! How a latent cache's rows are stored ([`CacheDtype`]) and read in
//! place ([`LatentRow`]): f32 as computed, or bf16 rounded once when
//! written and widened exactly when read.

use half::bf16;

/// How a latent cache stores its values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CacheDtype {
    /// 4 bytes a value, exactly as computed.
    #[default]
    F32,
    /// 2 bytes a value, rounded to nearest-even when written.
    Bf16,
}

impl CacheDtype {
    /// Bytes one value takes.
    pub fn bytes(self) -> usize {
        match self {
            CacheDtype::F32 => 4,
            CacheDtype::Bf16 => 2,
        }
    }

    /// The name configs use: `f32` or `bf16`.
    pub fn name(self) -> &'static str {
        match self {
            CacheDtype::F32 => "f32",
            CacheDtype::Bf16 => "bf16",
        }
    }
}

/// A cached latent row as stored (see [`CacheDtype`]).
#[derive(Clone, Copy)]
pub(crate) enum LatentRow<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
}

/// A bf16 value widened to f32 (exact): its bits are f32's top half.
#[inline(always)]
fn widen(v: bf16) -> f32 {
    f32::from_bits((v.to_bits() as u32) << 16)
}

impl LatentRow<'_> {
    /// Value `i` of the row, widened to f32 (exact).
    pub(crate) fn get(&self, i: usize) -> f32 {
        match self {
            LatentRow::F32(r) => r[i],
            LatentRow::Bf16(r) => widen(r[i]),
        }
    }

    /// The first `dst.len()` values of the row, widened to f32 (exact).
    /// Attention widens each cached row once for all the queries that
    /// read it and then runs the f32 kernels.
    pub(crate) fn widen_into(&self, dst: &mut [f32]) {
        match self {
            LatentRow::F32(r) => dst.copy_from_slice(&r[..dst.len()]),
            LatentRow::Bf16(r) => {
                for (o, &v) in dst.iter_mut().zip(r.iter()) {
                    *o = widen(v);
                }
            }
        }
    }
}

//! Quantized matrix products for the GGUF formats our models use (Q4_K,
//! Q6_K, Q8_0, Q5_0, Q4_1), for 1 to a few dozen activation rows.
//!
//! Owns: the weight view ([`QWeight`], the GGUF block bytes read in place
//! from candle's `QTensor`), the once-per-call quantization of activations
//! to 8 bits ([`act`]), the choice of instruction set made once per process
//! at run time ([`Isa`]), and the split of output columns over rayon's
//! global pool (no per-call thread spawning).
//!
//! Why our own: candle's k-quant kernels re-unpack every weight block for
//! every activation row and its Q8_0/Q5_0/Q4_1 path is per row, so extra
//! rows cost nearly as much as the first. Here the loop over weight blocks
//! is outermost and the rows innermost: each weight block is loaded and
//! unpacked once, then dotted with up to [`MAX_ROWS`] rows while it sits in
//! registers.
//!
//! Invariant (batch invariance): row r of the output depends only on row r
//! of the input, bit for bit, whatever the number of rows. Each activation
//! row is quantized alone, and each (output column, row) dot product runs
//! the same instructions in the same order whatever rows sit beside it.
//! Speculative verification (k+1 rows) then scores tokens exactly as plain
//! decoding (1 row) does.

pub mod act;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod scalar;

use candle_core::quantized::{GgmlDType, QTensor};
use rayon::prelude::*;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, OnceLock};

/// Rows dotted with one weight block while it is in registers; more rows
/// are processed in groups of this many (same per-row arithmetic).
pub const MAX_ROWS: usize = 16;

/// A weight format these kernels implement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Q4K,
    Q6K,
    Q8_0,
    Q5_0,
    Q4_1,
}

impl Format {
    /// The format of a GGUF dtype, if these kernels implement it.
    pub fn of(dtype: GgmlDType) -> Option<Format> {
        Some(match dtype {
            GgmlDType::Q4K => Format::Q4K,
            GgmlDType::Q6K => Format::Q6K,
            GgmlDType::Q8_0 => Format::Q8_0,
            GgmlDType::Q5_0 => Format::Q5_0,
            GgmlDType::Q4_1 => Format::Q4_1,
            _ => return None,
        })
    }

    /// Weights per block.
    pub fn block_len(self) -> usize {
        match self {
            Format::Q4K | Format::Q6K => 256,
            Format::Q8_0 | Format::Q5_0 | Format::Q4_1 => 32,
        }
    }

    /// Bytes per block in the GGUF layout.
    pub fn block_bytes(self) -> usize {
        match self {
            Format::Q4K => 144,
            Format::Q6K => 210,
            Format::Q8_0 => 34,
            Format::Q5_0 => 22,
            Format::Q4_1 => 20,
        }
    }

    /// K-quants pair with Q8_K activations (256 per block), the rest with
    /// Q8_0 activations (32 per block).
    fn k_quant(self) -> bool {
        matches!(self, Format::Q4K | Format::Q6K)
    }
}

/// Instruction set the kernels run with, chosen once per process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// Plain Rust, any CPU.
    Scalar,
    /// AVX-512 F/BW/VL with VNNI (Zen 4, Ice Lake and later).
    Avx512Vnni,
}

impl Isa {
    /// The best instruction set this CPU supports (run-time detection, so a
    /// portable build still uses AVX-512 VNNI where present).
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vnni")
                && is_x86_feature_detected!("fma")
            {
                return Isa::Avx512Vnni;
            }
        }
        Isa::Scalar
    }

    /// The instruction set used by [`QWeight::matmul`]: the detected one,
    /// unless `SPECGATE_KERNEL_ISA=scalar` asks for the portable path.
    pub fn current() -> Isa {
        static ISA: OnceLock<Isa> = OnceLock::new();
        *ISA.get_or_init(|| match std::env::var("SPECGATE_KERNEL_ISA").as_deref() {
            Ok("scalar") => Isa::Scalar,
            _ => Isa::detect(),
        })
    }
}

/// Which matmul implementation model loading picks for quantized weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// These kernels (formats they implement; others fall back to candle).
    Native,
    /// candle's `QMatMul` for everything (for side-by-side benchmarks).
    Candle,
}

/// 0 = unset (read `SPECGATE_KERNELS`), 1 = native, 2 = candle.
static BACKEND: AtomicU8 = AtomicU8::new(0);

/// Sets the backend for models loaded from now on (already loaded models
/// keep theirs).
pub fn set_backend(b: Backend) {
    BACKEND.store(
        match b {
            Backend::Native => 1,
            Backend::Candle => 2,
        },
        Ordering::Relaxed,
    );
}

/// The backend model loading uses: [`set_backend`]'s choice, else
/// `SPECGATE_KERNELS=candle` selects candle, else native.
pub fn backend() -> Backend {
    match BACKEND.load(Ordering::Relaxed) {
        1 => Backend::Native,
        2 => Backend::Candle,
        _ => match std::env::var("SPECGATE_KERNELS").as_deref() {
            Ok("candle") => Backend::Candle,
            _ => Backend::Native,
        },
    }
}

/// A quantized weight matrix of `n` output rows by `k` inputs, read in
/// place from a CPU `QTensor`'s GGUF block bytes.
pub struct QWeight {
    q: Arc<QTensor>,
    format: Format,
    n: usize,
    k: usize,
}

impl QWeight {
    /// Wraps a 2-D CPU `QTensor` of `(n, k)`; `None` when the format is not
    /// one of ours or the tensor is not a plain CPU matrix.
    pub fn new(q: Arc<QTensor>) -> Option<QWeight> {
        let format = Format::of(q.dtype())?;
        let &[n, k] = q.shape().dims() else {
            return None;
        };
        if !k.is_multiple_of(format.block_len()) || !q.device().is_cpu() {
            return None;
        }
        let w = QWeight { q, format, n, k };
        (w.bytes().len() == n * k / format.block_len() * format.block_bytes()).then_some(w)
    }

    /// Output features.
    pub fn n(&self) -> usize {
        self.n
    }

    /// Input features.
    pub fn k(&self) -> usize {
        self.k
    }

    /// The tensor the bytes are read from.
    pub fn qtensor(&self) -> &Arc<QTensor> {
        &self.q
    }

    pub fn format(&self) -> Format {
        self.format
    }

    fn bytes(&self) -> &[u8] {
        match self.q.data() {
            Ok(std::borrow::Cow::Borrowed(b)) => b,
            // CPU storage always lends its bytes; `new` checked the device.
            _ => &[],
        }
    }

    /// `out[r * n + c] = sum_i w[c][i] * x[r * k + i]` for `rows` rows, with
    /// activations quantized to 8 bits per row; uses [`Isa::current`].
    ///
    /// Panics if `x` or `out` are shorter than `rows * k` / `rows * n`.
    pub fn matmul(&self, x: &[f32], rows: usize, out: &mut [f32]) {
        self.matmul_with(Isa::current(), x, rows, out)
    }

    /// [`QWeight::matmul`] with an explicit instruction set (tests compare
    /// the paths; `isa` must be supported by this CPU, which
    /// [`Isa::detect`] guarantees for its answer and below).
    pub fn matmul_with(&self, isa: Isa, x: &[f32], rows: usize, out: &mut [f32]) {
        let (n, k) = (self.n, self.k);
        assert!(x.len() >= rows * k && out.len() >= rows * n);
        if rows == 0 || n == 0 {
            return;
        }
        let acts = if self.format.k_quant() {
            act::Acts::q8k(&x[..rows * k], rows, k)
        } else {
            act::Acts::q8_0(&x[..rows * k], rows, k)
        };
        let row_bytes = k / self.format.block_len() * self.format.block_bytes();
        let w = self.bytes();
        let threads = rayon::current_num_threads().max(1);
        // Several chunks per thread so a slow core does not hold up the call.
        let chunk = n.div_ceil(threads * 4).max(8);
        let out_ptr = SendPtr(out.as_mut_ptr());
        (0..n.div_ceil(chunk)).into_par_iter().for_each(|ci| {
            let cols = ci * chunk..((ci + 1) * chunk).min(n);
            let mut res = [0f32; MAX_ROWS];
            for c in cols {
                let wrow = &w[c * row_bytes..(c + 1) * row_bytes];
                for r0 in (0..rows).step_by(MAX_ROWS) {
                    let rr = (rows - r0).min(MAX_ROWS);
                    dot_rows(isa, self.format, wrow, &acts, r0, rr, &mut res);
                    for (i, v) in res[..rr].iter().enumerate() {
                        // SAFETY: each task writes only its own columns `c`
                        // of rows below `rows`; `out` holds `rows * n`.
                        unsafe { *out_ptr.get().add((r0 + i) * n + c) = *v };
                    }
                }
            }
        });
    }
}

/// A raw pointer that rayon tasks may share; they write disjoint elements.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}
impl SendPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// One weight row (all its blocks) dotted with activation rows
/// `r0..r0 + rows` into `out[..rows]`.
fn dot_rows(
    isa: Isa,
    format: Format,
    w: &[u8],
    a: &act::Acts,
    r0: usize,
    rows: usize,
    out: &mut [f32; MAX_ROWS],
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx512Vnni` is only chosen when detected.
        Isa::Avx512Vnni => unsafe { avx512::dot_rows(format, w, a, r0, rows, out) },
        _ => scalar::dot_rows(format, w, a, r0, rows, out),
    }
}

/// Reads a little-endian f16 at `p` as f32.
#[inline(always)]
fn f16_at(b: &[u8], p: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[p], b[p + 1]])).to_f32()
}

/// Q4_K's 6-bit (scale, min) pairs of its 8 sub-blocks, from 12 bytes.
#[inline(always)]
fn q4k_scales(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let (mut sc, mut mn) = ([0u8; 8], [0u8; 8]);
    for j in 0..4 {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0xF) | ((s[j] >> 6) << 4);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
    (sc, mn)
}

#[cfg(test)]
mod tests;

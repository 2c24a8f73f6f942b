//! Quantized matrix products for the GGUF formats our models use (Q4_K,
//! Q6_K, Q8_0, Q5_0, Q4_1), for 1 to a few hundred activation rows.
//!
//! Owns: the weight store ([`QWeight`], GGUF blocks repacked at load into
//! [`layout`]'s tiles of 16 interleaved output columns, same size), the
//! once-per-call quantization of activations to 8 bits ([`act`]), the
//! choice of instruction set made once per process at run time ([`Isa`]),
//! and the split of tiles over the forward's thread team ([`crate::team`]).
//!
//! Why our own: with weights in GGUF order every output column ends in a
//! horizontal sum and unpacks its block scales again, and every extra
//! activation row repeats that work. With tiles, one `vpdpbusd` advances 16
//! columns with 4 broadcast activation codes, scales are built once per
//! tile block for all rows, and a group of up to [`GROUP`] rows shares each
//! weight load, so extra rows (speculative verification, batching,
//! prefill) cost only their multiply-adds.
//!
//! Invariant (batch invariance): row r of the output depends only on row r
//! of the input, bit for bit, whatever the number of rows. Each activation
//! row is quantized alone, and each (output column, row) dot product runs
//! the same instructions in the same order whatever rows sit beside it.
//! Speculative verification (k+1 rows) then scores tokens exactly as plain
//! decoding (1 row) does.

/// `by_rows!(f, rows, args..)` calls the SIMD kernel `f::<R>(args..)` with
/// the row group size `R` (1..=[`GROUP`]) as a constant, so the kernel's
/// per-row accumulators are arrays of known length the compiler keeps in
/// registers.
#[cfg(target_arch = "x86_64")]
macro_rules! by_rows {
    ($f:ident, $rows:expr, $($arg:expr),*) => {
        match $rows {
            1 => $f::<1>($($arg),*),
            2 => $f::<2>($($arg),*),
            3 => $f::<3>($($arg),*),
            4 => $f::<4>($($arg),*),
            5 => $f::<5>($($arg),*),
            6 => $f::<6>($($arg),*),
            7 => $f::<7>($($arg),*),
            _ => $f::<8>($($arg),*),
        }
    };
}

pub mod act;
pub(crate) mod amx;
pub mod attn;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
pub mod bf16;
pub mod bytes;
pub mod f32;
mod layout;
pub mod mxfp4;
mod scalar;
pub mod vector;

use crate::team::SharedMut;
use candle_core::quantized::{GgmlDType, QTensor};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, OnceLock};

pub use layout::TILE;

/// Activation rows dotted with one tile block while it is in registers;
/// more rows are processed in groups of this many (same per-row
/// arithmetic, so results do not depend on the grouping).
pub const GROUP: usize = 8;
const _: () = assert!(GROUP == 8, "by_rows! dispatches groups of 1..=8 rows");

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
    /// Every format, in a fixed order (logs, per-format tables).
    pub const ALL: [Format; 5] = [
        Format::Q4K,
        Format::Q6K,
        Format::Q8_0,
        Format::Q5_0,
        Format::Q4_1,
    ];

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

    /// The GGUF dtype of this format.
    pub fn dtype(self) -> GgmlDType {
        match self {
            Format::Q4K => GgmlDType::Q4K,
            Format::Q6K => GgmlDType::Q6K,
            Format::Q8_0 => GgmlDType::Q8_0,
            Format::Q5_0 => GgmlDType::Q5_0,
            Format::Q4_1 => GgmlDType::Q4_1,
        }
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
    pub fn k_quant(self) -> bool {
        matches!(self, Format::Q4K | Format::Q6K)
    }
}

/// Instruction set the kernels run with, chosen once per process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// Plain Rust, any CPU.
    Scalar,
    /// AVX2 + FMA + F16C (Haswell, Zen 1 and later).
    Avx2,
    /// AVX-512 F/BW/VL with VNNI (Zen 4, Ice Lake and later).
    Avx512Vnni,
    /// [`Isa::Avx512Vnni`] plus Intel AMX (TILE, INT8, BF16; Sapphire
    /// Rapids and later), with Linux's permission for the tile state. The
    /// int8 products with rows enough use tiles ([`amx`]), everything else
    /// the AVX-512 path, with the same bits.
    Amx,
}

impl Isa {
    /// Whether this CPU supports `self` (run-time detection, so a portable
    /// build still uses AVX2 or AVX-512 VNNI where present).
    pub fn available(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => {
                is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
                    && is_x86_feature_detected!("fma")
                    // The AVX-512 kernels are also compiled with these.
                    && is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Amx => amx::tile::hardware_ready(),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// A short stable name for logs: `scalar`, `avx2`, `avx512-vnni` or
    /// `amx` (`SPECGATE_KERNEL_ISA` takes them, `avx512` for the third).
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512Vnni => "avx512-vnni",
            Isa::Amx => "amx",
        }
    }

    /// The vector instruction set under `self`: [`Isa::Amx`]'s is
    /// AVX-512 VNNI, which runs every product without tiles.
    pub fn vector(self) -> Isa {
        match self {
            Isa::Amx => Isa::Avx512Vnni,
            isa => isa,
        }
    }

    /// The best instruction set this CPU supports.
    pub fn detect() -> Isa {
        [Isa::Amx, Isa::Avx512Vnni, Isa::Avx2]
            .into_iter()
            .find(|isa| isa.available())
            .unwrap_or(Isa::Scalar)
    }

    /// The instruction set used by [`QWeight::matmul`]: the detected one,
    /// unless `SPECGATE_KERNEL_ISA` asks for `scalar` (the portable path),
    /// `avx2`, `avx512` or `amx` (each when available; otherwise the
    /// detected one, which is then the best this CPU has).
    pub fn current() -> Isa {
        static ISA: OnceLock<Isa> = OnceLock::new();
        *ISA.get_or_init(|| {
            let asked = match std::env::var("SPECGATE_KERNEL_ISA").as_deref() {
                Ok("scalar") => Isa::Scalar,
                Ok("avx2") => Isa::Avx2,
                Ok("avx512" | "avx512-vnni") => Isa::Avx512Vnni,
                Ok("amx") => Isa::Amx,
                _ => return Isa::detect(),
            };
            if asked.available() {
                asked
            } else {
                Isa::detect()
            }
        })
    }

    /// Why this process runs without AMX tiles, or `None` when it uses
    /// them or never could ask (for the start-up log: a CPU without AMX, a
    /// kernel that refused the tile state).
    pub fn amx_refusal() -> Option<&'static str> {
        amx::tile::refusal()
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

/// A quantized weight matrix of `n` output rows by `k` inputs, repacked
/// from GGUF blocks into [`layout`]'s tiles (same bytes, interleaved by 16
/// output rows). The GGUF tensor is not kept.
pub struct QWeight {
    tiles: Vec<u8>,
    format: Format,
    n: usize,
    k: usize,
}

impl QWeight {
    /// Repacks a 2-D CPU `QTensor` of `(n, k)`; `None` when the format is
    /// not one of ours or the tensor is not a plain CPU matrix.
    pub fn new(q: Arc<QTensor>) -> Option<QWeight> {
        let format = Format::of(q.dtype())?;
        let &[n, k] = q.shape().dims() else {
            return None;
        };
        if !k.is_multiple_of(format.block_len()) || !q.device().is_cpu() {
            return None;
        }
        let data = q.data().ok()?;
        let nb = k / format.block_len();
        if data.len() != n * nb * format.block_bytes() {
            return None;
        }
        Some(QWeight {
            tiles: layout::repack(format, &data, n, nb),
            format,
            n,
            k,
        })
    }

    /// Repacks `n` rows of `k` values of GGUF block data in `format`.
    ///
    /// Errors (as a message): `k` not whole blocks, or a length that is not
    /// `n` rows of them.
    pub fn from_gguf(format: Format, data: &[u8], n: usize, k: usize) -> Result<QWeight, String> {
        let nb = k / format.block_len();
        if !k.is_multiple_of(format.block_len()) || data.len() != n * nb * format.block_bytes() {
            return Err(format!(
                "{format:?} [{n}, {k}] needs whole blocks and {} bytes, got {}",
                n * nb * format.block_bytes(),
                data.len()
            ));
        }
        Ok(QWeight {
            tiles: layout::repack(format, data, n, nb),
            format,
            n,
            k,
        })
    }

    /// Output features.
    pub fn n(&self) -> usize {
        self.n
    }

    /// Input features.
    pub fn k(&self) -> usize {
        self.k
    }

    pub fn format(&self) -> Format {
        self.format
    }

    /// Bytes the weights occupy: their GGUF size rounded up to whole tiles
    /// (Q4_K: 148 bytes per block instead of 144, see [`layout`]).
    pub fn bytes(&self) -> usize {
        self.tiles.len()
    }

    fn blocks_per_row(&self) -> usize {
        self.k / self.format.block_len()
    }

    /// The GGUF bytes of output rows `rows`, in that order (the tiles read
    /// back bit for bit). Errors name a row outside the matrix.
    pub fn gguf_rows(&self, rows: &[u32]) -> Result<Vec<u8>, String> {
        let nb = self.blocks_per_row();
        let mut out = Vec::with_capacity(rows.len() * nb * self.format.block_bytes());
        for &r in rows {
            if r as usize >= self.n {
                return Err(format!("row {r} outside a matrix of {} rows", self.n));
            }
            layout::column_gguf(self.format, &self.tiles, nb, r as usize, &mut out);
        }
        Ok(out)
    }

    /// `out[r * n + c] = sum_i w[c][i] * x[r * k + i]` for `rows` rows, with
    /// activations quantized to 8 bits per row; uses [`Isa::current`].
    ///
    /// Panics if `x` or `out` are shorter than `rows * k` / `rows * n`.
    pub fn matmul(&self, x: &[f32], rows: usize, out: &mut [f32]) {
        self.matmul_with(Isa::current(), x, rows, out)
    }

    /// [`QWeight::matmul`] with an explicit instruction set (tests and
    /// benchmarks compare the paths).
    ///
    /// Panics if this CPU lacks `isa` ([`Isa::available`]).
    pub fn matmul_with(&self, isa: Isa, x: &[f32], rows: usize, out: &mut [f32]) {
        matmul_many_with(isa, x, rows, &mut [Product { w: self, out }])
    }
}

/// One product of [`matmul_many`]: a weight and where its `rows x n`
/// outputs go (row-major).
pub struct Product<'a> {
    pub w: &'a QWeight,
    pub out: &'a mut [f32],
}

/// Several weights applied to the same input `x` (`rows x k`), as one
/// parallel pass: the input is quantized once per block length, and the
/// tiles of all weights are split over the threads together, so the pool
/// wakes once instead of once per weight. Each output equals
/// [`QWeight::matmul`]'s bit for bit. Uses [`Isa::current`].
///
/// Panics if the weights' input sizes differ, or `x` or an output is too
/// short.
pub fn matmul_many(x: &[f32], rows: usize, products: &mut [Product]) {
    matmul_many_with(Isa::current(), x, rows, products)
}

/// [`matmul_many`] with an explicit instruction set (see
/// [`QWeight::matmul_with`]). With [`Isa::Amx`], each product whose row
/// count reaches [`amx_min_rows`] for its format runs on tiles, the
/// others on AVX-512 (the same bits either way).
pub fn matmul_many_with(isa: Isa, x: &[f32], rows: usize, products: &mut [Product]) {
    assert!(isa.available(), "{isa:?} is not available on this CPU");
    let pick = |f: Format| {
        if isa == Isa::Amx && rows >= amx_min_rows(f) {
            Path::Tiles
        } else {
            Path::Vector(isa.vector())
        }
    };
    run(x, rows, products, pick)
}

/// [`matmul_many`] with every product on the portable model of the AMX
/// tile instructions (tests check the tile driver with it on any host).
#[cfg(test)]
pub(crate) fn matmul_many_tile_model(x: &[f32], rows: usize, products: &mut [Product]) {
    run(x, rows, products, |_| Path::TileModel)
}

/// [`matmul_many`] with every product on AMX tiles, whatever its rows.
///
/// Panics if [`Isa::Amx`] is not available.
#[cfg(test)]
pub(crate) fn matmul_many_tiles(x: &[f32], rows: usize, products: &mut [Product]) {
    assert!(Isa::Amx.available());
    run(x, rows, products, |_| Path::Tiles)
}

/// How one product's tiles (or MXFP4 slabs) are computed.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Path {
    /// [`GROUP`] rows at a time on this (available) vector set.
    Vector(Isa),
    /// All rows on AMX tiles ([`amx::tile::Hardware`]; only picked when
    /// [`Isa::Amx`] is available).
    Tiles,
    /// All rows on [`amx::tile::Model`].
    #[cfg(test)]
    TileModel,
}

fn run(x: &[f32], rows: usize, products: &mut [Product], pick: impl Fn(Format) -> Path + Sync) {
    let Some(k) = products.first().map(|p| p.w.k) else {
        return;
    };
    assert!(x.len() >= rows * k);
    for p in products.iter() {
        assert!(p.w.k == k && p.out.len() >= rows * p.w.n);
    }
    if rows == 0 {
        return;
    }
    let x = &x[..rows * k];
    let quantize = |long: bool| {
        products
            .iter()
            .find(|p| p.w.format.k_quant() == long)
            .map(|p| act::Acts::new(p.w.format, x, rows, k))
    };
    let (acts256, acts32) = (quantize(true), quantize(false));
    // Every weight's tiles, numbered one after another.
    struct Job<'a> {
        w: &'a QWeight,
        acts: &'a act::Acts,
        out: SharedMut<f32>,
        first_tile: usize,
        path: Path,
    }
    let mut jobs = Vec::with_capacity(products.len());
    let mut ntiles = 0;
    for p in products.iter_mut() {
        let acts = if p.w.format.k_quant() {
            &acts256
        } else {
            &acts32
        };
        jobs.push(Job {
            w: p.w,
            acts: acts
                .as_ref()
                .expect("quantized above for this block length"),
            out: SharedMut::new(p.out),
            first_tile: ntiles,
            path: pick(p.w.format),
        });
        ntiles += p.w.n.div_ceil(TILE);
    }
    let threads = crate::team::threads();
    // Several chunks per thread so a slow core does not hold up the call.
    let chunk = ntiles.div_ceil(threads * 4).max(1);
    crate::team::for_each(ntiles.div_ceil(chunk), |ci| {
        let mut res = [[0f32; TILE]; GROUP];
        // Tile paths: all rows' results of one weight tile, and scratch.
        let mut all: Vec<[f32; TILE]> = Vec::new();
        let mut scratch: Option<amx::Scratch> = None;
        let tiles = ci * chunk..((ci + 1) * chunk).min(ntiles);
        for job in jobs.iter() {
            let (w, n) = (job.w, job.w.n);
            let own = job.first_tile..job.first_tile + n.div_ceil(TILE);
            let tile_bytes = w.blocks_per_row() * layout::tile_block_bytes(w.format);
            for t in tiles.start.max(own.start)..tiles.end.min(own.end) {
                let t = t - job.first_tile;
                let tile = &w.tiles[t * tile_bytes..(t + 1) * tile_bytes];
                let cols = TILE.min(n - t * TILE);
                // SAFETY (both writes below): each task writes only its own
                // tiles' columns of rows below `rows`; the output holds
                // `rows * n` (asserted above).
                let write = |r: usize, v: &[f32; TILE]| unsafe {
                    let dst = job.out.at(r * n + t * TILE);
                    std::ptr::copy_nonoverlapping(v.as_ptr(), dst, cols);
                };
                if let Path::Vector(isa) = job.path {
                    for r0 in (0..rows).step_by(GROUP) {
                        let rr = (rows - r0).min(GROUP);
                        tile_rows(isa, w.format, tile, job.acts, r0, rr, cols, &mut res);
                        for (i, v) in res[..rr].iter().enumerate() {
                            write(r0 + i, v);
                        }
                    }
                    continue;
                }
                all.resize(rows, [0.0; TILE]);
                let s = scratch.get_or_insert_with(Default::default);
                tile_path(job.path, w.format, tile, job.acts, rows, &mut all, s);
                for (r, v) in all.iter().enumerate() {
                    write(r, v);
                }
            }
        }
    });
}

/// One weight tile times all `rows` on a tile path ([`Path::Tiles`] or
/// [`Path::TileModel`]).
fn tile_path(
    path: Path,
    format: Format,
    tile: &[u8],
    a: &act::Acts,
    rows: usize,
    out: &mut [[f32; TILE]],
    s: &mut amx::Scratch,
) {
    // Which arms exist depends on the target and on cfg(test).
    #[allow(unreachable_patterns)]
    match path {
        #[cfg(target_arch = "x86_64")]
        Path::Tiles => {
            let mut hw = amx::tile::Hardware::new().expect("Isa::Amx is available");
            // SAFETY: AMX is available, which includes the AVX-512 set
            // (`amx::tile::refusal`).
            unsafe { amx::tile_product_hw(&mut hw, format, tile, a, rows, out, s) }
        }
        #[cfg(test)]
        Path::TileModel => {
            let mut model = amx::tile::Model::default();
            amx::tile_product(&mut model, format, tile, a, rows, out, s)
        }
        _ => unreachable!("tile_path takes a tile path this target has"),
    }
}

/// What the start-up log says of AMX: `on, tiles from N rows (Q4_K) ...`
/// with each format's measured threshold (measuring it now), or `off:`
/// and why (the CPU, the kernel's refusal, or `SPECGATE_KERNEL_ISA`).
pub fn amx_status() -> String {
    if Isa::current() == Isa::Amx {
        let each: Vec<String> = Format::ALL
            .iter()
            .map(|&f| match amx_min_rows(f) {
                usize::MAX => format!("{f:?} never"),
                n => format!("{f:?} {n}"),
            })
            .collect();
        let mx = match amx_min_rows_mxfp4() {
            usize::MAX => "never".to_string(),
            n => n.to_string(),
        };
        format!("on, tiles from rows: {}, MXFP4 {mx}", each.join(", "))
    } else if let Some(why) = Isa::amx_refusal() {
        format!("off: {why}")
    } else {
        "off: SPECGATE_KERNEL_ISA".to_string()
    }
}

/// Rows from which an MXFP4 product runs on AMX tiles under [`Isa::Amx`]:
/// as [`amx_min_rows`], measured for MXFP4.
pub fn amx_min_rows_mxfp4() -> usize {
    amx_min_rows_fixed().unwrap_or_else(amx::calibrate::min_rows_mxfp4)
}

/// `SPECGATE_AMX_MIN_ROWS`, read once.
fn amx_min_rows_fixed() -> Option<usize> {
    static FIXED: OnceLock<Option<usize>> = OnceLock::new();
    *FIXED.get_or_init(|| {
        std::env::var("SPECGATE_AMX_MIN_ROWS")
            .ok()
            .and_then(|v| v.trim().parse().ok())
    })
}

/// Rows from which a product of `format` runs on AMX tiles under
/// [`Isa::Amx`]: `SPECGATE_AMX_MIN_ROWS` if set, else measured once per
/// process and format on this CPU ([`amx::calibrate`]). Results do not
/// depend on it, only speed.
pub fn amx_min_rows(format: Format) -> usize {
    amx_min_rows_fixed().unwrap_or_else(|| amx::calibrate::min_rows(format))
}

/// One tile's first `cols` columns dotted with activation rows
/// `r0..r0 + rows` into `out[..rows]`.
#[allow(clippy::too_many_arguments)]
fn tile_rows(
    isa: Isa,
    format: Format,
    tile: &[u8],
    a: &act::Acts,
    r0: usize,
    rows: usize,
    cols: usize,
    out: &mut [[f32; TILE]; GROUP],
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `matmul_with` checked `Isa::available`.
        Isa::Avx512Vnni => unsafe { avx512::tile_rows(format, tile, a, r0, rows, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { avx2::tile_rows(format, tile, a, r0, rows, out) },
        _ => scalar::tile_rows(format, tile, a, r0, rows, cols, out),
    }
}

/// Bytes ahead of the tile block in use that the SIMD kernels prefetch
/// (tiles a task walks are contiguous). Without it the hardware prefetcher
/// keeps too few lines in flight once several rows make each block take
/// longer, and extra rows cost memory time instead of hiding under it.
#[cfg(target_arch = "x86_64")]
const AHEAD: usize = 4096;

/// How far ahead [`prefetch_step`] fetches: two Q4_K tile blocks or a
/// little under three Q6_K ones. Its prefetches are spread over a block's
/// work, so they must start further ahead than [`AHEAD`]'s to be early.
#[cfg(target_arch = "x86_64")]
const FAR: usize = 8192;

/// Starts loading the cache line `AHEAD + off` bytes past `p` into L2.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch(p: *const u8, off: usize) {
    prefetch_l2(p, AHEAD + off)
}

/// Starts loading the cache line `off` bytes past `p` into L2 (any
/// address: a prefetch never faults, and the pointer is never read).
///
/// Into L2, not L1 (`T1`, not `T0`): a prefetch into L1 holds one of the
/// core's few L1 miss buffers until its line arrives from memory, which
/// caps the lines in flight; L2 tracks many more, and the kernel's own
/// load then finds the line a few cycles away. Measured on a Zen 4
/// (`cargo bench --bench kernel_stream`, one row): the AVX-512 path
/// streamed Q4_K at 22-25 GB/s against 18-19 into L1, and the AVX2 path
/// at 27-31 against 20-22.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_l2(p: *const u8, off: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
    // SAFETY: a prefetch has no architectural effect and cannot fault.
    unsafe { _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(off).cast()) }
}

/// Prefetches step `step` of `STEPS` of the tile block of `TB` bytes that
/// starts [`FAR`] bytes past `p`: lines `step`, `step + STEPS`, ... of
/// it. Spread over the block's work this way, the prefetches keep a
/// steady number of lines in flight. Issued all at once, they measured
/// slower once several rows make a block take longer: the arithmetic
/// seemed to wait for memory instead of overlapping it. The K-quant
/// kernels, whose blocks take longest, prefetch this way (on a Zen 4 the
/// AVX-512 path's Q6_K streamed 10-20% faster than with a prefetch per
/// line just ahead of its use).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_step<const TB: usize, const STEPS: usize>(p: *const u8, step: usize) {
    let mut l = step;
    while l < TB.div_ceil(64) {
        prefetch_l2(p, FAR + 64 * l);
        l += STEPS;
    }
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

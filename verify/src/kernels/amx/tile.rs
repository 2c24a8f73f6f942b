//! The AMX tile instructions the kernels use, behind one small safe-ish
//! API ([`TileUnit`]) with two implementations:
//!
//! - [`Hardware`]: the instructions themselves through `asm!` (stable
//!   Rust's `core::arch` AMX intrinsics are still unstable). Only
//!   constructible after [`hardware_ready`] said yes, which also asked
//!   Linux for the tile state once per process.
//! - `Model` (tests): a portable model of the same instructions over eight
//!   16 x 64-byte arrays, so the tiling, unpacking and epilogue code that
//!   drives them runs and is tested on any host (AMD, AVX2-only CI). It
//!   checks each instruction's shape rules as the hardware would (a
//!   mismatch is a `#UD` there and a panic here).
//!
//! Semantics modelled (Intel SDM, "Intel AMX Instruction Set Reference"):
//! `ldtilecfg` sets each tile's rows and bytes per row and zeroes every
//! tile; `tileloadd` reads `rows` rows of `colsb` bytes at `base + r *
//! stride` and zeroes the rest; `tdpbsud`/`tdpbssd` add to each i32
//! `C[m][n]` the products of A's signed bytes `A[m][4k + i]` and B's
//! unsigned/signed bytes `B[k][4n + i]` (exact: no saturation in the
//! products or the i32 sums this code can reach); `tilestored` writes the
//! configured rows and bytes.
//!
//! Tile registers are named by const generics (`T`, `C`, `A`, `B`), since
//! `asm!` needs them in the instruction text.

/// A tile configuration (the 64-byte memory operand of `ldtilecfg`,
/// palette 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C, align(64))]
pub(crate) struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

impl TileConfig {
    /// Palette 1 with every tile unused.
    pub(crate) const fn new() -> TileConfig {
        TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        }
    }

    /// Tile `t` (0..8) holds `rows` rows (at most 16) of `colsb` bytes (at
    /// most 64, a multiple of 4).
    pub(crate) const fn with(mut self, t: usize, rows: usize, colsb: usize) -> TileConfig {
        assert!(t < 8 && rows <= 16 && colsb <= 64 && colsb.is_multiple_of(4));
        self.rows[t] = rows as u8;
        self.colsb[t] = colsb as u16;
        self
    }
}

/// The tile instructions the kernels use. Pointers passed to `load` and
/// `store` must cover the configured rows of that tile at the given
/// stride (`rows - 1) * stride + colsb` bytes).
pub(crate) trait TileUnit {
    /// `ldtilecfg`: configures every tile and zeroes them.
    fn configure(&mut self, cfg: &TileConfig);

    /// `tilezero tmmT`.
    fn zero<const T: u8>(&mut self);

    /// `tileloadd tmmT, [p + stride]`.
    ///
    /// # Safety
    /// `p` is readable for the configured rows of tile `T` at `stride`.
    unsafe fn load<const T: u8>(&mut self, p: *const u8, stride: usize);

    /// `tilestored [p + stride], tmmT`.
    ///
    /// # Safety
    /// `p` is writable for the configured rows of tile `T` at `stride`.
    unsafe fn store<const T: u8>(&mut self, p: *mut u8, stride: usize);

    /// `tdpbsud tmmC, tmmA, tmmB`: signed A bytes times unsigned B bytes.
    fn dp_su<const C: u8, const A: u8, const B: u8>(&mut self);

    /// `tdpbssd tmmC, tmmA, tmmB`: signed A bytes times signed B bytes.
    fn dp_ss<const C: u8, const A: u8, const B: u8>(&mut self);

    /// `tilerelease`: back to the initial state (no tile data to save on
    /// a context switch).
    fn release(&mut self);
}

/// The portable model: tiles as arrays, checked as the hardware checks.
#[cfg(test)]
pub(crate) struct Model {
    cfg: TileConfig,
    tiles: Box<[[[u8; 64]; 16]; 8]>,
}

#[cfg(test)]
impl Default for Model {
    fn default() -> Model {
        Model {
            cfg: TileConfig::new(),
            tiles: Box::new([[[0; 64]; 16]; 8]),
        }
    }
}

#[cfg(test)]
impl Model {
    fn shape(&self, t: u8) -> (usize, usize) {
        let t = t as usize;
        (self.cfg.rows[t] as usize, self.cfg.colsb[t] as usize)
    }

    /// `C[m][n] += sum A[m][4k+i] * B[k][4n+i]`, the byte conversions given.
    fn dp(&mut self, c: u8, a: u8, b: u8, wa: fn(u8) -> i32, wb: fn(u8) -> i32) {
        let ((mc, nc), (ma, ka), (kb, nb)) = (self.shape(c), self.shape(a), self.shape(b));
        // The hardware's #UD conditions for these shapes.
        assert!(
            mc == ma && nc == nb && ka / 4 == kb && mc > 0 && ka > 0 && nc > 0,
            "tile shapes C {mc}x{nc}, A {ma}x{ka}, B {kb}x{nb} do not multiply"
        );
        assert!(
            c != a && c != b && a != b,
            "tdp* needs three distinct tiles"
        );
        let (ta, tb) = (self.tiles[a as usize], self.tiles[b as usize]);
        let tc = &mut self.tiles[c as usize];
        for m in 0..mc {
            for n in 0..nc / 4 {
                let at = 4 * n;
                let mut acc = i32::from_le_bytes(tc[m][at..at + 4].try_into().unwrap());
                for k in 0..ka / 4 {
                    for i in 0..4 {
                        acc = acc.wrapping_add(wa(ta[m][4 * k + i]) * wb(tb[k][4 * n + i]));
                    }
                }
                tc[m][at..at + 4].copy_from_slice(&acc.to_le_bytes());
            }
        }
    }
}

#[cfg(test)]
fn signed(v: u8) -> i32 {
    v as i8 as i32
}

#[cfg(test)]
fn unsigned(v: u8) -> i32 {
    v as i32
}

#[cfg(test)]
impl TileUnit for Model {
    fn configure(&mut self, cfg: &TileConfig) {
        assert_eq!(cfg.palette, 1, "palette 1 only");
        self.cfg = *cfg;
        *self.tiles = [[[0; 64]; 16]; 8];
    }

    fn zero<const T: u8>(&mut self) {
        self.tiles[T as usize] = [[0; 64]; 16];
    }

    unsafe fn load<const T: u8>(&mut self, p: *const u8, stride: usize) {
        let (rows, colsb) = self.shape(T);
        assert!(rows > 0, "tileloadd of an unconfigured tile");
        let t = &mut self.tiles[T as usize];
        *t = [[0; 64]; 16];
        for (r, row) in t.iter_mut().enumerate().take(rows) {
            // SAFETY: the caller guarantees the configured rows are readable.
            let src = unsafe { std::slice::from_raw_parts(p.add(r * stride), colsb) };
            row[..colsb].copy_from_slice(src);
        }
    }

    unsafe fn store<const T: u8>(&mut self, p: *mut u8, stride: usize) {
        let (rows, colsb) = self.shape(T);
        assert!(rows > 0, "tilestored of an unconfigured tile");
        for (r, row) in self.tiles[T as usize].iter().enumerate().take(rows) {
            // SAFETY: the caller guarantees the configured rows are writable.
            let dst = unsafe { std::slice::from_raw_parts_mut(p.add(r * stride), colsb) };
            dst.copy_from_slice(&row[..colsb]);
        }
    }

    fn dp_su<const C: u8, const A: u8, const B: u8>(&mut self) {
        self.dp(C, A, B, signed, unsigned)
    }

    fn dp_ss<const C: u8, const A: u8, const B: u8>(&mut self) {
        self.dp(C, A, B, signed, signed)
    }

    fn release(&mut self) {
        self.cfg = TileConfig::new();
        *self.tiles = [[[0; 64]; 16]; 8];
    }
}

/// Why this process cannot use AMX tiles, or `None` when it can: the CPU
/// lacks AMX-TILE/INT8/BF16 or the AVX-512 set the epilogues use, or Linux
/// refused the tile state (`arch_prctl(ARCH_REQ_XCOMP_PERM,
/// XFEATURE_XTILEDATA)`, asked once per process; threads started after it
/// inherit the permission, and so do those started before: it is the
/// process's).
pub(crate) fn refusal() -> Option<&'static str> {
    static REFUSAL: std::sync::OnceLock<Option<&'static str>> = std::sync::OnceLock::new();
    *REFUSAL.get_or_init(ask)
}

/// Whether [`Hardware`] may be used (see [`refusal`]).
pub(crate) fn hardware_ready() -> bool {
    refusal().is_none()
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn ask() -> Option<&'static str> {
    Some("AMX tiles need x86-64 Linux")
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn ask() -> Option<&'static str> {
    use std::arch::x86_64::__cpuid_count;
    if !super::super::Isa::Avx512Vnni.available() {
        return Some("the CPU lacks the AVX-512 VNNI set AMX kernels build on");
    }
    // CPUID leaf 7 exists on every x86-64 CPU with AVX-512.
    let edx = __cpuid_count(7, 0).edx;
    let (bf16, tile, int8) = (edx >> 22 & 1, edx >> 24 & 1, edx >> 25 & 1);
    if bf16 & tile & int8 == 0 {
        return Some("the CPU lacks AMX-TILE, AMX-INT8 or AMX-BF16");
    }
    const ARCH_GET_XCOMP_PERM: libc::c_long = 0x1022;
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with these codes only reads/sets the process's
    // permission bits; the out-pointer is a valid u64.
    unsafe {
        if libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) != 0
        {
            return Some("Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)");
        }
        let mut mask: u64 = 0;
        if libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_GET_XCOMP_PERM,
            &mut mask as *mut u64,
        ) != 0
            || mask >> XFEATURE_XTILEDATA & 1 == 0
        {
            return Some("Linux did not grant the AMX tile state (ARCH_GET_XCOMP_PERM)");
        }
    }
    None
}

/// The tile instructions themselves. Holding one proves [`hardware_ready`]
/// said yes in this process.
#[cfg(target_arch = "x86_64")]
pub(crate) struct Hardware(());

#[cfg(target_arch = "x86_64")]
impl Hardware {
    /// `Some` when this CPU and OS let the process use AMX tiles.
    pub(crate) fn new() -> Option<Hardware> {
        hardware_ready().then_some(Hardware(()))
    }
}

#[cfg(target_arch = "x86_64")]
impl TileUnit for Hardware {
    #[inline(always)]
    fn configure(&mut self, cfg: &TileConfig) {
        // SAFETY: AMX is usable (a `Hardware` exists); `cfg` is a valid
        // palette-1 configuration of 64 bytes (TileConfig's checks).
        unsafe {
            std::arch::asm!("ldtilecfg [{}]", in(reg) cfg as *const TileConfig, options(nostack, readonly))
        }
    }

    #[inline(always)]
    fn zero<const T: u8>(&mut self) {
        // SAFETY: AMX is usable; tilezero touches only tile T.
        unsafe { std::arch::asm!("tilezero tmm{t}", t = const T, options(nostack, nomem)) }
    }

    #[inline(always)]
    unsafe fn load<const T: u8>(&mut self, p: *const u8, stride: usize) {
        // SAFETY: the caller guarantees the configured rows are readable.
        unsafe {
            std::arch::asm!(
                "tileloadd tmm{t}, [{p} + {s} * 1]",
                t = const T, p = in(reg) p, s = in(reg) stride,
                options(nostack, readonly)
            )
        }
    }

    #[inline(always)]
    unsafe fn store<const T: u8>(&mut self, p: *mut u8, stride: usize) {
        // SAFETY: the caller guarantees the configured rows are writable.
        unsafe {
            std::arch::asm!(
                "tilestored [{p} + {s} * 1], tmm{t}",
                t = const T, p = in(reg) p, s = in(reg) stride,
                options(nostack)
            )
        }
    }

    #[inline(always)]
    fn dp_su<const C: u8, const A: u8, const B: u8>(&mut self) {
        // SAFETY: AMX is usable; shapes are the caller's configuration
        // (a mismatch would be #UD, which the model's tests rule out).
        unsafe {
            std::arch::asm!(
                "tdpbsud tmm{c}, tmm{a}, tmm{b}",
                c = const C, a = const A, b = const B,
                options(nostack, nomem)
            )
        }
    }

    #[inline(always)]
    fn dp_ss<const C: u8, const A: u8, const B: u8>(&mut self) {
        // SAFETY: as for `dp_su`.
        unsafe {
            std::arch::asm!(
                "tdpbssd tmm{c}, tmm{a}, tmm{b}",
                c = const C, a = const A, b = const B,
                options(nostack, nomem)
            )
        }
    }

    #[inline(always)]
    fn release(&mut self) {
        // SAFETY: AMX is usable; tilerelease only resets tile state.
        unsafe { std::arch::asm!("tilerelease", options(nostack, nomem)) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The model's `tdpbsud`/`tdpbssd` against the definition, with the
    /// load/store round trip and a partial last row block.
    #[test]
    fn model_dot_products_follow_the_definition() {
        let (m, k, n) = (5usize, 32usize, 16usize);
        let a: Vec<u8> = (0..m * 64).map(|i| (i * 37 + 11) as u8).collect();
        let b: Vec<u8> = (0..(k / 4) * 64).map(|i| (i * 101 + 3) as u8).collect();
        let cfg = TileConfig::new()
            .with(0, m, 4 * n)
            .with(1, m, k)
            .with(2, k / 4, 4 * n);
        for signed_b in [false, true] {
            let mut u = Model::default();
            u.configure(&cfg);
            let mut c = vec![0i32; m * n];
            unsafe {
                u.load::<0>(c.as_ptr().cast(), 64); // zeros
                u.load::<1>(a.as_ptr(), 64);
                u.load::<2>(b.as_ptr(), 64);
            }
            if signed_b {
                u.dp_ss::<0, 1, 2>();
                u.dp_ss::<0, 1, 2>();
            } else {
                u.dp_su::<0, 1, 2>();
                u.dp_su::<0, 1, 2>();
            }
            unsafe { u.store::<0>(c.as_mut_ptr().cast(), 64) };
            for mm in 0..m {
                for nn in 0..n {
                    let want: i32 = (0..k)
                        .map(|kk| {
                            let bv = b[(kk / 4) * 64 + 4 * nn + kk % 4];
                            let bv = if signed_b { bv as i8 as i32 } else { bv as i32 };
                            a[mm * 64 + kk] as i8 as i32 * bv
                        })
                        .sum();
                    assert_eq!(c[mm * n + nn], 2 * want, "({mm},{nn}) signed_b {signed_b}");
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "do not multiply")]
    fn model_rejects_mismatched_shapes() {
        let mut u = Model::default();
        u.configure(
            &TileConfig::new()
                .with(0, 4, 64)
                .with(1, 4, 32)
                .with(2, 4, 64),
        );
        u.dp_su::<0, 1, 2>();
    }

    /// The asm path against the model where the CPU has AMX; elsewhere
    /// says why it is skipped.
    #[test]
    fn hardware_matches_the_model_or_says_why_not() {
        #[cfg(target_arch = "x86_64")]
        {
            let Some(mut hw) = Hardware::new() else {
                println!("AMX hardware test skipped: {}", refusal().unwrap_or("?"));
                return;
            };
            let a: Vec<u8> = (0..16 * 64).map(|i| (i * 73 + 5) as u8).collect();
            let b: Vec<u8> = (0..16 * 64).map(|i| (i * 29 + 7) as u8).collect();
            let cfg = TileConfig::new()
                .with(0, 16, 64)
                .with(1, 16, 64)
                .with(2, 16, 64)
                .with(3, 16, 64);
            let run = |u: &mut dyn FnMut(&mut [i32], &mut [i32])| {
                let (mut c1, mut c2) = (vec![0i32; 256], vec![0i32; 256]);
                u(&mut c1, &mut c2);
                (c1, c2)
            };
            let mut model = Model::default();
            let got = run(&mut |c1, c2| unsafe {
                hw.configure(&cfg);
                hw.zero::<0>();
                hw.zero::<3>();
                hw.load::<1>(a.as_ptr(), 64);
                hw.load::<2>(b.as_ptr(), 64);
                hw.dp_su::<0, 1, 2>();
                hw.dp_ss::<3, 1, 2>();
                hw.store::<0>(c1.as_mut_ptr().cast(), 64);
                hw.store::<3>(c2.as_mut_ptr().cast(), 64);
                hw.release();
            });
            let want = run(&mut |c1, c2| unsafe {
                model.configure(&cfg);
                model.zero::<0>();
                model.zero::<3>();
                model.load::<1>(a.as_ptr(), 64);
                model.load::<2>(b.as_ptr(), 64);
                model.dp_su::<0, 1, 2>();
                model.dp_ss::<3, 1, 2>();
                model.store::<0>(c1.as_mut_ptr().cast(), 64);
                model.store::<3>(c2.as_mut_ptr().cast(), 64);
            });
            assert_eq!(got, want);
        }
    }
}

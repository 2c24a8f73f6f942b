//! MXFP4 slabs on AMX tiles (or their portable model): a slab's 16 weight
//! rows are a B tile's 16 columns. Per 32-value block, the rows' nibbles
//! become their doubled E2M1 codes as signed bytes (in [-12, 12], exact)
//! in the 4-byte-group order a B tile wants, the activation rows' Q8_0
//! codes are A tiles read in place, and `tdpbssd` gives each (activation
//! row, weight row) the exact integer dot `I_b` that the vector kernels
//! form with their biased codes and correction. The epilogue is the
//! module's definition, `y = fma(I_b, e8m0_half(e_b) * d_b, y)` over the
//! blocks in order, so tiles give the vector paths' bits.

use super::super::amx::tile::TileUnit;
use super::super::amx::{config, row_groups, ARows, Scratch};
use super::{Q8Acts, BLOCK_BYTES, E8M0_HALF, KVALUES, SLAB};

/// The slab `p` (rows of `a.nb()` blocks) times activation rows
/// `0..rows` of `a`, into `out[row][slab row]`. Unit `u` must be in its
/// initial state; it is configured here and released at the end.
///
/// Panics if `out` holds fewer than `rows` rows or a slab row fewer than
/// `a.nb()` blocks.
#[inline(always)]
pub(crate) fn slab_product<U: TileUnit>(
    u: &mut U,
    p: &[&[u8]; SLAB],
    a: &Q8Acts,
    rows: usize,
    out: &mut [[f32; SLAB]],
    s: &mut Scratch,
) {
    let nb = a.nb();
    assert!(out.len() >= rows && rows <= a.rows);
    assert!(p.iter().all(|r| r.len() >= nb * BLOCK_BYTES));
    let out = &mut out[..rows];
    out.iter_mut().for_each(|o| *o = [0.0; SLAB]);
    if rows == 0 {
        return;
    }
    u.configure(&config(32));
    for b in 0..nb {
        let mut ws = [0f32; SLAB];
        for (o, row) in p.iter().enumerate() {
            let blk = &row[b * BLOCK_BYTES..(b + 1) * BLOCK_BYTES];
            ws[o] = E8M0_HALF[blk[0] as usize];
            // Element e (low nibbles 0..16, high 16..32) goes to B row
            // e / 4, byte 4 * o + e % 4.
            for j in 0..16 {
                for (e, nib) in [(j, blk[1 + j] & 15), (j + 16, blk[1 + j] >> 4)] {
                    s.b.0[(e / 4) * 64 + 4 * o + e % 4] = KVALUES[nib as usize] as u8;
                }
            }
        }
        // SAFETY: the B scratch holds 8 rows of 64 bytes.
        unsafe { u.load::<4>(s.b.0.as_ptr(), 64) };
        let rows_a = ARows {
            q: &a.q,
            first: 32 * b,
            stride: a.inp,
            k: 32,
        };
        row_groups::<U, true>(u, rows_a, rows, s, |r0, n, c| {
            for (i, ci) in c.iter().enumerate().take(n) {
                let dx = a.d[(r0 + i) * nb + b];
                let y = &mut out[r0 + i];
                for o in 0..SLAB {
                    y[o] = (ci[o] as f32).mul_add(ws[o] * dx, y[o]);
                }
            }
        });
    }
    u.release();
}

/// [`slab_product`] on the tile instructions, the epilogue compiled for
/// AVX-512.
///
/// # Safety
/// The CPU must support the features [`super::Isa::Avx512Vnni`] detects.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn slab_product_hw(
    u: &mut super::super::amx::tile::Hardware,
    p: &[&[u8]; SLAB],
    a: &Q8Acts,
    rows: usize,
    out: &mut [[f32; SLAB]],
    s: &mut Scratch,
) {
    slab_product(u, p, a, rows, out, s)
}

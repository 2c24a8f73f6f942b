//! Portable kernels (any CPU) over the tiled layout: the same integer
//! dot products as the SIMD paths, one (column, activation row) pair at a
//! time, each column's block read back into plain codes once for all rows.
//!
//! The float work is the AVX-512 kernel's, operation for operation and in
//! its order (see [`super::amx`]'s module doc), with `f32::mul_add` for
//! its fused multiply-adds: so this path gives the SIMD and AMX paths'
//! bits, and is the reference the tests hold them to.

use super::act::Acts;
use super::layout::{from_tile, tile_block_bytes, TILE};
use super::{Format, GROUP};

fn f16(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

/// Dots the first `cols` columns of one tile (its `a.nb` tile blocks) with
/// activation rows `r0..r0 + rows` into `out[row][col]`.
pub(super) fn tile_rows(
    format: Format,
    tile: &[u8],
    a: &Acts,
    r0: usize,
    rows: usize,
    cols: usize,
    out: &mut [[f32; TILE]; GROUP],
) {
    let tb = tile_block_bytes(format);
    let len = a.block;
    for o in out[..rows].iter_mut() {
        o.fill(0.0);
    }
    for col in 0..cols {
        for b in 0..a.nb {
            let blk = from_tile(format, &tile[b * tb..(b + 1) * tb], col);
            let (d, m) = (f16(blk.d), f16(blk.m));
            for (i, o) in out[..rows].iter_mut().enumerate() {
                let ab = (r0 + i) * a.nb + b;
                let x = &a.q[ab * len..(ab + 1) * len];
                let dot = |lo: usize, hi: usize| -> i32 {
                    (lo..hi).map(|v| blk.q[v] as i32 * x[v] as i32).sum()
                };
                let dx = a.d[ab];
                let acc = &mut o[col];
                match format {
                    Format::Q4K => {
                        let mut s = 0f32;
                        for j in 0..8 {
                            let isum = dot(32 * j, 32 * j + 32) as f32;
                            s = isum.mul_add(blk.sc[j] as f32 * d, s);
                            s = (blk.mn[j] as f32 * m).mul_add(a.fsum[ab * 8 + j], s);
                        }
                        *acc = s.mul_add(dx, *acc);
                    }
                    Format::Q6K => {
                        let mut s = 0f32;
                        for sb in 0..16 {
                            let isum = dot(16 * sb, 16 * sb + 16) + a.off[ab * 16 + sb];
                            s = (isum as f32).mul_add(blk.sc[sb] as i8 as f32 * d, s);
                        }
                        *acc = s.mul_add(dx, *acc);
                    }
                    Format::Q8_0 => {
                        let dot: i32 = (0..32).map(|v| blk.q[v] as i8 as i32 * x[v] as i32).sum();
                        *acc = (dot as f32).mul_add(d * dx, *acc);
                    }
                    Format::Q5_0 => {
                        let isum = dot(0, 32) - 16 * a.off[ab];
                        *acc = (isum as f32).mul_add(d * dx, *acc);
                    }
                    Format::Q4_1 => {
                        *acc = (dot(0, 32) as f32).mul_add(d * dx, *acc);
                        *acc = m.mul_add(a.fsum[ab], *acc);
                    }
                }
            }
        }
    }
}

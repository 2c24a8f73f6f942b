//! Portable kernels (any CPU) over the tiled layout: the same integer
//! dot products as the SIMD paths, one (column, activation row) pair at a
//! time, each column's block read back into plain codes once for all rows.

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
                let v = match format {
                    Format::Q4K => {
                        let isum: i32 = (0..8)
                            .map(|j| blk.sc[j] as i32 * dot(32 * j, 32 * j + 32))
                            .sum();
                        let msum: f32 = (0..8).map(|j| blk.mn[j] as f32 * a.fsum[ab * 8 + j]).sum();
                        (d * isum as f32 + m * msum) * dx
                    }
                    Format::Q6K => {
                        let isum: i32 = (0..16)
                            .map(|s| {
                                let sc = blk.sc[s] as i8 as i32;
                                sc * (dot(16 * s, 16 * s + 16) + a.off[ab * 16 + s])
                            })
                            .sum();
                        d * isum as f32 * dx
                    }
                    Format::Q8_0 => {
                        let dot: i32 = (0..32).map(|v| blk.q[v] as i8 as i32 * x[v] as i32).sum();
                        d * dot as f32 * dx
                    }
                    Format::Q5_0 => d * (dot(0, 32) - 16 * a.off[ab]) as f32 * dx,
                    Format::Q4_1 => d * dot(0, 32) as f32 * dx + m * a.fsum[ab],
                };
                o[col] += v;
            }
        }
    }
}

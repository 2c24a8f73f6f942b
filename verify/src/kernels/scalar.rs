//! Portable kernels (any CPU): the same integer dot products as the SIMD
//! paths, one (weight row, activation row) pair at a time. Also the
//! readable statement of each format's block layout.

use super::act::Acts;
use super::{f16_at, q4k_scales, Format, MAX_ROWS};

pub(super) fn dot_rows(
    format: Format,
    w: &[u8],
    a: &Acts,
    r0: usize,
    rows: usize,
    out: &mut [f32; MAX_ROWS],
) {
    for (i, o) in out[..rows].iter_mut().enumerate() {
        let r = r0 + i;
        *o = match format {
            Format::Q4K => q4k(w, a, r),
            Format::Q6K => q6k(w, a, r),
            Format::Q8_0 | Format::Q5_0 | Format::Q4_1 => q32(format, w, a, r),
        };
    }
}

/// Q4_K block (144 bytes): d f16, dmin f16, 12 bytes of 6-bit sub-block
/// scales and mins, 128 bytes of nibbles. Sub-block j (32 values) uses the
/// low nibbles of bytes 32*(j/2).. when j is even, the high ones when odd;
/// value = d * sc_j * q - dmin * m_j.
fn q4k(w: &[u8], a: &Acts, r: usize) -> f32 {
    let mut acc = 0f32;
    for (b, blk) in w.chunks_exact(144).enumerate() {
        let ab = r * a.nb + b;
        let x = &a.q[ab * 256..(ab + 1) * 256];
        let bs = &a.bsums[ab * 16..(ab + 1) * 16];
        let (sc, mn) = q4k_scales(&blk[4..16]);
        let qs = &blk[16..144];
        let (mut isum, mut msum) = (0i32, 0i32);
        for j in 0..8 {
            let bytes = &qs[32 * (j / 2)..32 * (j / 2) + 32];
            let shift = 4 * (j % 2);
            let dot: i32 = bytes
                .iter()
                .zip(&x[32 * j..32 * j + 32])
                .map(|(&q, &v)| ((q >> shift) & 0xF) as i32 * v as i32)
                .sum();
            isum += sc[j] as i32 * dot;
            msum += mn[j] as i32 * (bs[2 * j] as i32 + bs[2 * j + 1] as i32);
        }
        let dx = a.d[ab];
        acc += f16_at(blk, 0) * dx * isum as f32 - f16_at(blk, 2) * dx * msum as f32;
    }
    acc
}

/// Q6_K block (210 bytes): 128 bytes of low nibbles, 64 bytes of high
/// 2-bit pairs, 16 signed 8-bit sub-block scales, d f16. Each half of 128
/// values takes 64 low-nibble bytes and 32 high bytes; value = d * sc * (q - 32).
fn q6k(w: &[u8], a: &Acts, r: usize) -> f32 {
    let mut acc = 0f32;
    let mut u = [0u8; 256];
    for (b, blk) in w.chunks_exact(210).enumerate() {
        let ab = r * a.nb + b;
        let x = &a.q[ab * 256..(ab + 1) * 256];
        let bs = &a.bsums[ab * 16..(ab + 1) * 16];
        for h in 0..2 {
            let ql = &blk[64 * h..64 * h + 64];
            let qh = &blk[128 + 32 * h..128 + 32 * h + 32];
            let y = &mut u[128 * h..128 * h + 128];
            for l in 0..32 {
                y[l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
                y[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
                y[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                y[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
            }
        }
        let mut isum = 0i32;
        for s in 0..16 {
            let dot: i32 = u[16 * s..16 * s + 16]
                .iter()
                .zip(&x[16 * s..16 * s + 16])
                .map(|(&q, &v)| q as i32 * v as i32)
                .sum();
            let sc = blk[192 + s] as i8 as i32;
            isum += sc * (dot - 32 * bs[s] as i32);
        }
        acc += f16_at(blk, 208) * a.d[ab] * isum as f32;
    }
    acc
}

/// The 32-value formats. Q8_0 (34 bytes): d f16, 32 signed bytes. Q5_0
/// (22 bytes): d f16, 32 high bits, 16 bytes of nibbles (low nibbles are
/// values 0..16, high ones 16..32); value = d * (q - 16). Q4_1 (20 bytes):
/// d f16, m f16, 16 bytes of nibbles; value = d * q + m.
fn q32(format: Format, w: &[u8], a: &Acts, r: usize) -> f32 {
    let mut acc = 0f32;
    let mut u = [0i32; 32];
    for (b, blk) in w.chunks_exact(format.block_bytes()).enumerate() {
        let ab = r * a.nb + b;
        let x = &a.q[ab * 32..(ab + 1) * 32];
        let nibbles = |u: &mut [i32; 32], qs: &[u8]| {
            for j in 0..16 {
                u[j] = (qs[j] & 0xF) as i32;
                u[j + 16] = (qs[j] >> 4) as i32;
            }
        };
        let mut extra = 0f32;
        match format {
            Format::Q8_0 => {
                for (o, &q) in u.iter_mut().zip(&blk[2..34]) {
                    *o = q as i8 as i32;
                }
            }
            Format::Q5_0 => {
                nibbles(&mut u, &blk[6..22]);
                let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
                for (j, o) in u.iter_mut().enumerate() {
                    *o += (((qh >> j) & 1) << 4) as i32 - 16;
                }
            }
            _ => {
                nibbles(&mut u, &blk[4..20]);
                extra = f16_at(blk, 2) * a.dsum[ab];
            }
        }
        let dot: i32 = u.iter().zip(x).map(|(&q, &v)| q * v as i32).sum();
        acc += f16_at(blk, 0) * a.d[ab] * dot as f32 + extra;
    }
    acc
}

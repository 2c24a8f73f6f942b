//! The tiled weight layout the kernels read, and its conversion from and
//! back to GGUF blocks.
//!
//! Why tiles: in GGUF each output column's blocks lie one after another,
//! so a dot product must finish every column with a horizontal sum and
//! unpack each block's scales once per column. Here [`TILE`] output columns
//! are interleaved: for each run of 4 inputs the tile holds 4 bytes per
//! column, 64 bytes in all, so one `vpdpbusd` with the 4 activation bytes
//! broadcast advances all 16 columns at once, and per-block scales are
//! 16-lane vectors that every activation row reuses. No horizontal sums.
//!
//! Invariant: a tile block holds exactly the codes and scales of its 16
//! GGUF blocks, no dequantization, so the weights stream from memory at
//! their GGUF size (Q4_K's 6-bit scales and mins are stored as bytes:
//! 148 instead of 144 bytes per block, so the kernels need no bit
//! shuffling per block); [`Block`] round-trips both ways bit for bit.
//!
//! Tile-block layouts (per block position of `block_len` inputs, 16
//! columns; `col` is the column within the tile; "nibble group" g holds
//! inputs 8g..8g+8 as 4 bytes per column, byte j = q[8g+j] | q[8g+4+j] << 4):
//! - Q4_K (2368 bytes): d f16 x16, dmin f16 x16, scales u8 [8][16],
//!   mins u8 [8][16], 32 nibble groups.
//! - Q6_K (3360 bytes): d f16 x16, scales i8 [16][16], 32 nibble groups
//!   of the low 4 bits, then per 16 inputs h (16 of them) 4 bytes per
//!   column of high 2-bit pairs: byte j = hi(16h+j) | hi(16h+4+j) << 2 |
//!   hi(16h+8+j) << 4 | hi(16h+12+j) << 6.
//! - Q8_0 (544 bytes): d f16 x16, then per 4 inputs g (8 of them) the 4
//!   signed bytes of each column.
//! - Q5_0 (352 bytes): d f16 x16, the fifth bits as 4 bytes per column
//!   (byte j: bit 2g = hi(8g+j), bit 2g+1 = hi(8g+4+j)), 4 nibble groups.
//! - Q4_1 (320 bytes): d f16 x16, m f16 x16, 4 nibble groups.

use super::Format;

/// Output columns per tile.
pub const TILE: usize = 16;

/// One GGUF block's fields as plain integers, the form both layouts are
/// written from and read into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Block {
    /// Quantized codes as stored: unsigned 4/5/6-bit codes, or Q8_0's
    /// signed bytes as their bits. Only the first `block_len` are used.
    pub q: [u8; 256],
    /// f16 bits of the scale.
    pub d: u16,
    /// f16 bits of Q4_K's dmin or Q4_1's m.
    pub m: u16,
    /// Q4_K: 8 six-bit scales; Q6_K: 16 signed scales (their bits).
    pub sc: [u8; 16],
    /// Q4_K: 8 six-bit mins.
    pub mn: [u8; 8],
}

impl Block {
    const ZERO: Block = Block {
        q: [0; 256],
        d: 0,
        m: 0,
        sc: [0; 16],
        mn: [0; 8],
    };
}

/// Bytes of one tile block (16 columns at one block position).
pub(super) fn tile_block_bytes(f: Format) -> usize {
    match f {
        // Scales and mins unpacked from 12 to 16 bytes per column.
        Format::Q4K => 2368,
        _ => f.block_bytes() * TILE,
    }
}

fn u16_at(b: &[u8], p: usize) -> u16 {
    u16::from_le_bytes([b[p], b[p + 1]])
}

fn put_u16(b: &mut [u8], p: usize, v: u16) {
    b[p..p + 2].copy_from_slice(&v.to_le_bytes());
}

/// Reads one GGUF block of `f`.
pub(super) fn from_gguf(f: Format, b: &[u8]) -> Block {
    let mut o = Block::ZERO;
    o.d = u16_at(b, 0);
    match f {
        Format::Q4K => {
            o.m = u16_at(b, 2);
            let (sc, mn) = super::q4k_scales(&b[4..16]);
            o.sc[..8].copy_from_slice(&sc);
            o.mn = mn;
            for c in 0..4 {
                for l in 0..32 {
                    let byte = b[16 + 32 * c + l];
                    o.q[64 * c + l] = byte & 0xF;
                    o.q[64 * c + 32 + l] = byte >> 4;
                }
            }
        }
        Format::Q6K => {
            o.d = u16_at(b, 208);
            o.sc.copy_from_slice(&b[192..208]);
            for h in 0..2 {
                let (ql, qh) = (&b[64 * h..64 * h + 64], &b[128 + 32 * h..128 + 32 * h + 32]);
                let y = &mut o.q[128 * h..128 * h + 128];
                for l in 0..32 {
                    y[l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
                    y[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
                    y[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                    y[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
                }
            }
        }
        Format::Q8_0 => o.q[..32].copy_from_slice(&b[2..34]),
        Format::Q5_0 => {
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            for l in 0..16 {
                o.q[l] = (b[6 + l] & 0xF) | (((qh >> l) & 1) << 4) as u8;
                o.q[l + 16] = (b[6 + l] >> 4) | (((qh >> (l + 16)) & 1) << 4) as u8;
            }
        }
        Format::Q4_1 => {
            o.m = u16_at(b, 2);
            for l in 0..16 {
                o.q[l] = b[4 + l] & 0xF;
                o.q[l + 16] = b[4 + l] >> 4;
            }
        }
    }
    o
}

/// Writes one GGUF block of `f` (the inverse of [`from_gguf`]).
pub(super) fn to_gguf(f: Format, o: &Block, b: &mut [u8]) {
    put_u16(b, 0, o.d);
    match f {
        Format::Q4K => {
            put_u16(b, 2, o.m);
            let (sc, mn) = (&o.sc, &o.mn);
            for j in 0..4 {
                b[4 + j] = sc[j] | ((sc[j + 4] >> 4) << 6);
                b[8 + j] = mn[j] | ((mn[j + 4] >> 4) << 6);
                b[12 + j] = (sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4);
            }
            for c in 0..4 {
                for l in 0..32 {
                    b[16 + 32 * c + l] = o.q[64 * c + l] | (o.q[64 * c + 32 + l] << 4);
                }
            }
        }
        Format::Q6K => {
            put_u16(b, 208, o.d);
            b[192..208].copy_from_slice(&o.sc);
            for h in 0..2 {
                let y = &o.q[128 * h..128 * h + 128];
                for l in 0..32 {
                    b[64 * h + l] = (y[l] & 0xF) | ((y[l + 64] & 0xF) << 4);
                    b[64 * h + l + 32] = (y[l + 32] & 0xF) | ((y[l + 96] & 0xF) << 4);
                    b[128 + 32 * h + l] = (y[l] >> 4)
                        | ((y[l + 32] >> 4) << 2)
                        | ((y[l + 64] >> 4) << 4)
                        | ((y[l + 96] >> 4) << 6);
                }
            }
        }
        Format::Q8_0 => b[2..34].copy_from_slice(&o.q[..32]),
        Format::Q5_0 => {
            let mut qh = 0u32;
            for l in 0..16 {
                b[6 + l] = (o.q[l] & 0xF) | ((o.q[l + 16] & 0xF) << 4);
            }
            for (l, &q) in o.q[..32].iter().enumerate() {
                qh |= ((q >> 4) as u32 & 1) << l;
            }
            b[2..6].copy_from_slice(&qh.to_le_bytes());
        }
        Format::Q4_1 => {
            put_u16(b, 2, o.m);
            for l in 0..16 {
                b[4 + l] = o.q[l] | (o.q[l + 16] << 4);
            }
        }
    }
}

/// Byte offset of nibble group g's 4 bytes for column `col` in a tile
/// block whose groups start at `base`.
#[inline(always)]
fn group_at(base: usize, g: usize, col: usize) -> usize {
    base + (g * TILE + col) * 4
}

fn put_nibble_groups(t: &mut [u8], base: usize, groups: usize, col: usize, q: &[u8]) {
    for g in 0..groups {
        let p = group_at(base, g, col);
        for j in 0..4 {
            t[p + j] = (q[8 * g + j] & 0xF) | ((q[8 * g + 4 + j] & 0xF) << 4);
        }
    }
}

fn get_nibble_groups(t: &[u8], base: usize, groups: usize, col: usize, q: &mut [u8]) {
    for g in 0..groups {
        let p = group_at(base, g, col);
        for j in 0..4 {
            q[8 * g + j] = t[p + j] & 0xF;
            q[8 * g + 4 + j] = t[p + j] >> 4;
        }
    }
}

/// Writes column `col`'s block into tile block `t` of format `f`.
pub(super) fn to_tile(f: Format, o: &Block, t: &mut [u8], col: usize) {
    put_u16(t, 2 * col, o.d);
    match f {
        Format::Q4K => {
            put_u16(t, 32 + 2 * col, o.m);
            for j in 0..8 {
                t[64 + TILE * j + col] = o.sc[j];
                t[192 + TILE * j + col] = o.mn[j];
            }
            put_nibble_groups(t, 320, 32, col, &o.q);
        }
        Format::Q6K => {
            for s in 0..16 {
                t[32 + TILE * s + col] = o.sc[s];
            }
            put_nibble_groups(t, 288, 32, col, &o.q);
            for h in 0..16 {
                let p = group_at(288 + 2048, h, col);
                for j in 0..4 {
                    let hi = |v: usize| o.q[16 * h + v + j] >> 4;
                    t[p + j] = hi(0) | (hi(4) << 2) | (hi(8) << 4) | (hi(12) << 6);
                }
            }
        }
        Format::Q8_0 => {
            for g in 0..8 {
                let p = group_at(32, g, col);
                t[p..p + 4].copy_from_slice(&o.q[4 * g..4 * g + 4]);
            }
        }
        Format::Q5_0 => {
            for j in 0..4 {
                let mut byte = 0u8;
                for g in 0..4 {
                    byte |= ((o.q[8 * g + j] >> 4) & 1) << (2 * g);
                    byte |= ((o.q[8 * g + 4 + j] >> 4) & 1) << (2 * g + 1);
                }
                t[32 + 4 * col + j] = byte;
            }
            put_nibble_groups(t, 96, 4, col, &o.q);
        }
        Format::Q4_1 => {
            put_u16(t, 32 + 2 * col, o.m);
            put_nibble_groups(t, 64, 4, col, &o.q);
        }
    }
}

/// Reads column `col`'s block from tile block `t` (the inverse of
/// [`to_tile`]).
pub(super) fn from_tile(f: Format, t: &[u8], col: usize) -> Block {
    let mut o = Block::ZERO;
    o.d = u16_at(t, 2 * col);
    match f {
        Format::Q4K => {
            o.m = u16_at(t, 32 + 2 * col);
            for j in 0..8 {
                o.sc[j] = t[64 + TILE * j + col];
                o.mn[j] = t[192 + TILE * j + col];
            }
            get_nibble_groups(t, 320, 32, col, &mut o.q);
        }
        Format::Q6K => {
            for s in 0..16 {
                o.sc[s] = t[32 + TILE * s + col];
            }
            get_nibble_groups(t, 288, 32, col, &mut o.q);
            for h in 0..16 {
                let p = group_at(288 + 2048, h, col);
                for j in 0..4 {
                    for (i, v) in [0, 4, 8, 12].into_iter().enumerate() {
                        o.q[16 * h + v + j] |= ((t[p + j] >> (2 * i)) & 3) << 4;
                    }
                }
            }
        }
        Format::Q8_0 => {
            for g in 0..8 {
                let p = group_at(32, g, col);
                o.q[4 * g..4 * g + 4].copy_from_slice(&t[p..p + 4]);
            }
        }
        Format::Q5_0 => {
            get_nibble_groups(t, 96, 4, col, &mut o.q);
            for j in 0..4 {
                let byte = t[32 + 4 * col + j];
                for g in 0..4 {
                    o.q[8 * g + j] |= ((byte >> (2 * g)) & 1) << 4;
                    o.q[8 * g + 4 + j] |= ((byte >> (2 * g + 1)) & 1) << 4;
                }
            }
        }
        Format::Q4_1 => {
            o.m = u16_at(t, 32 + 2 * col);
            get_nibble_groups(t, 64, 4, col, &mut o.q);
        }
    }
    o
}

/// Repacks `n` GGUF rows (output columns) of `nb` blocks each into tiles:
/// tile t holds its `nb` tile blocks one after another. Columns past `n`
/// in the last tile are zero (they produce zeros and are never stored).
pub(super) fn repack(f: Format, gguf: &[u8], n: usize, nb: usize) -> Vec<u8> {
    use rayon::prelude::*;
    let (bb, tb) = (f.block_bytes(), tile_block_bytes(f));
    let mut tiles = vec![0u8; n.div_ceil(TILE) * nb * tb];
    tiles
        .par_chunks_mut((nb * tb).max(1))
        .enumerate()
        .for_each(|(ti, tile)| {
            for col in 0..TILE.min(n - ti * TILE) {
                let c = ti * TILE + col;
                for b in 0..nb {
                    let blk = from_gguf(f, &gguf[(c * nb + b) * bb..][..bb]);
                    to_tile(f, &blk, &mut tile[b * tb..(b + 1) * tb], col);
                }
            }
        });
    tiles
}

/// Column `c`'s GGUF bytes (its `nb` blocks) read back from `tiles`.
pub(super) fn column_gguf(f: Format, tiles: &[u8], nb: usize, c: usize, out: &mut Vec<u8>) {
    let (bb, tb) = (f.block_bytes(), tile_block_bytes(f));
    let tile = &tiles[(c / TILE) * nb * tb..];
    for b in 0..nb {
        let blk = from_tile(f, &tile[b * tb..(b + 1) * tb], c % TILE);
        let at = out.len();
        out.resize(at + bb, 0);
        to_gguf(f, &blk, &mut out[at..]);
    }
}

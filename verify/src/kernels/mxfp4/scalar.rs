//! The portable kernel (any CPU), and the definition the SIMD kernels
//! reproduce bit for bit: per (weight row, activation row), the exact
//! integer dot of each block, then `y = fma(I_b, e8m0_half(e_b) * d_b, y)`
//! over the blocks in order.

use super::{Q8Acts, BLOCK_BYTES, E8M0_HALF, GROUP, KVALUES_BIASED, SLAB};

/// The slab `p` (rows of `a.nb()` blocks) dotted with activation rows
/// `r0..r0 + rows` into `out[row][slab row]`. Each weight block is decoded
/// once for all the rows.
pub(super) fn slab(
    p: &[&[u8]; SLAB],
    a: &Q8Acts,
    r0: usize,
    rows: usize,
    out: &mut [[f32; SLAB]; GROUP],
) {
    let nb = a.nb();
    for (i, row) in p.iter().enumerate() {
        let mut acc = [0f32; GROUP];
        for (b, blk) in row[..nb * BLOCK_BYTES]
            .chunks_exact(BLOCK_BYTES)
            .enumerate()
        {
            let mut codes = [0i32; 32];
            for j in 0..16 {
                codes[j] = KVALUES_BIASED[(blk[1 + j] & 15) as usize] as i32;
                codes[j + 16] = KVALUES_BIASED[(blk[1 + j] >> 4) as usize] as i32;
            }
            let ws = E8M0_HALF[blk[0] as usize];
            for (r, acc) in acc[..rows].iter_mut().enumerate() {
                let ab = (r0 + r) * nb + b;
                let x = &a.q[ab * 32..(ab + 1) * 32];
                // The biased codes' excess is cancelled by `corr`, so this
                // is the exact dot of the doubled E2M1 codes.
                let dot: i32 = codes.iter().zip(x).map(|(&c, &v)| c * v as i32).sum();
                *acc = ((a.corr[ab] + dot) as f32).mul_add(ws * a.d[ab], *acc);
            }
        }
        for (o, v) in out[..rows].iter_mut().zip(acc) {
            o[i] = v;
        }
    }
}

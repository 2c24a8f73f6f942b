//! Deterministic pseudo-random floats for the kernel benchmarks.

/// `n` floats in [-1, 1] from an xorshift seeded by `seed`: a cheap
/// deterministic generator, since benchmarks need data, not statistics.
pub fn random(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2654435761).max(1);
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s as f32 / u32::MAX as f32) * 2.0 - 1.0
        })
        .collect()
}

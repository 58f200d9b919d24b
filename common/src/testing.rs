//! Deterministic synthetic data for benchmarks, examples and tests: values that look like gradients or trained
//! weights (dense, incompressible, zero-mean) without a random-number crate. Not for production paths.

/// `n` pseudo-random values uniform in (−scale, scale) from an xorshift64 stream seeded by `seed`.
pub fn noise(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 * scale
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn noise_is_deterministic_bounded_and_centred() {
        let a = super::noise(10_000, 7, 0.5);
        assert_eq!(a, super::noise(10_000, 7, 0.5));
        assert_ne!(a, super::noise(10_000, 8, 0.5));
        assert!(a.iter().all(|v| v.abs() <= 0.5));
        let mean = a.iter().sum::<f32>() / a.len() as f32;
        assert!(mean.abs() < 0.02, "mean {mean}");
    }
}

//! Deterministic synthetic data for benchmarks, examples and tests: [`TestRng`], the one seeded generator they all
//! draw from (the [`SplitMix64`] stream, so a seed names one reproducible sequence on every platform), and [`noise`],
//! values that look like gradients or trained weights (dense, incompressible, zero-mean). No random-number crate.
//! Also the small fixtures the shard and protocol tests share: [`flat_layout`] and [`sgd`]. Not for production paths.

use crate::config::{OptimizerConfig, OptimizerKind};
use crate::layout::{Init, Layout, TensorSpec};
use crate::splitmix::SplitMix64;

/// A small seeded generator for tests, benchmarks and examples: the [`SplitMix64`] stream and the draws built on it.
#[derive(Debug, Clone)]
pub struct TestRng(SplitMix64);

impl TestRng {
    /// The generator whose sequence is the SplitMix64 stream seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Self(SplitMix64::new(seed))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// In `0..n` by reduction modulo `n` (`n` = 0 is taken as 1): bias below 2⁻⁴⁴ for `n` < 2²⁰, which no test
    /// sees, and the same draws as the simulators' generators it replaced (their schedules are unchanged).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// True with probability `per_mille` / 1000.
    pub fn chance(&mut self, per_mille: u64) -> bool {
        self.below(1000) < per_mille
    }

    /// Uniform in [0, 1) on the 2⁻²⁴ grid (exact in f32), from the top 24 bits.
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform in [0, 1) on the 2⁻⁵³ grid (exact in f64), from the top 53 bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in [−bound, bound) (f32 grid as [`next_f32`](Self::next_f32)).
    pub fn symmetric(&mut self, bound: f32) -> f32 {
        (2.0 * self.next_f32() - 1.0) * bound
    }

    /// A standard normal draw (Box–Muller on two [`next_f64`](Self::next_f64) draws; the first is kept above 0).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.next_f64().max(1e-300);
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// Fills `buf` with random bytes (one draw per byte).
    pub fn fill(&mut self, buf: &mut [u8]) {
        for b in buf {
            *b = self.next_u64() as u8;
        }
    }
}

/// `n` pseudo-random values uniform in [−scale, scale) from the [`TestRng`] seeded with `seed`.
pub fn noise(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut rng = TestRng::new(seed);
    (0..n).map(|_| rng.symmetric(scale)).collect()
}

/// One zero-initialised tensor `w` of `n` values: the layout of the shard and protocol tests, whose updates are easy
/// to read back from the weights.
pub fn flat_layout(n: usize) -> Layout {
    Layout::new(vec![TensorSpec::new("w", &[n], Init::Zeros)])
}

/// Plain SGD at learning rate `lr`, nothing else (with lr 1 a gradient of −1 reads as +1 in the weights).
pub fn sgd(lr: f32) -> OptimizerConfig {
    OptimizerConfig {
        kind: OptimizerKind::Sgd,
        lr,
        ..OptimizerConfig::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn noise_is_deterministic_bounded_and_centred() {
        let a = noise(10_000, 7, 0.5);
        assert_eq!(a, noise(10_000, 7, 0.5));
        assert_ne!(a, noise(10_000, 8, 0.5));
        assert!(a.iter().all(|v| v.abs() <= 0.5));
        let mean = a.iter().sum::<f32>() / a.len() as f32;
        assert!(mean.abs() < 0.02, "mean {mean}");
    }

    #[test]
    fn the_generator_is_the_splitmix64_stream() {
        let mut rng = TestRng::new(9);
        let mut stream = SplitMix64::new(9);
        for _ in 0..100 {
            assert_eq!(rng.next_u64(), stream.next_u64());
        }
    }

    #[test]
    fn uniform_draws_stay_in_their_intervals() {
        let mut rng = TestRng::new(1);
        for _ in 0..10_000 {
            let (f, d, s) = (rng.next_f32(), rng.next_f64(), rng.symmetric(2.0));
            assert!((0.0..1.0).contains(&f), "{f}");
            assert!((0.0..1.0).contains(&d), "{d}");
            assert!(s.abs() <= 2.0, "{s}");
            assert!(rng.below(10) < 10);
        }
        assert!(!rng.chance(0));
        assert!(rng.chance(1000));
    }

    #[test]
    fn normal_draws_have_unit_moments() {
        let mut rng = TestRng::new(3);
        let n = 100_000;
        let xs: Vec<f64> = (0..n).map(|_| rng.normal()).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
        // Standard errors: 1/√n ≈ 0.003 for the mean, √(2/n) ≈ 0.0045 for the variance; bounds are ~5σ.
        assert!(mean.abs() < 0.016, "mean {mean}");
        assert!((var - 1.0).abs() < 0.025, "variance {var}");
    }
}

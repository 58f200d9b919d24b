//! SplitMix64, the project's one source of deterministic pseudo-randomness: the 64-bit finaliser [`mix64`], the
//! one-step hash [`splitmix64`] built on it, and the [`SplitMix64`] stream. The layout's initial values, the codec's
//! rounding seeds, the data shuffles, the lineage tags and every seeded test generator are defined in terms of these,
//! so their outputs are part of the reproducibility contract: they must never change. Pure functions, no state
//! beyond a stream's one word.

/// Golden-ratio increment of the SplitMix64 stream (Steele, Lea & Flood 2014).
pub const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// The SplitMix64 finaliser alone: a bijective, well-mixed 64-bit hash (the stream's output function).
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// One SplitMix64 step: [`mix64`] of `x + GAMMA`, the output of a stream whose state was `x`.
#[inline]
pub fn splitmix64(x: u64) -> u64 {
    mix64(x.wrapping_add(GAMMA))
}

/// The SplitMix64 stream: the state advances by [`GAMMA`] and each output is [`mix64`] of the new state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// The stream whose first output is `splitmix64(seed)`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// The next 64 pseudo-random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GAMMA);
        mix64(self.state)
    }

    /// Uniform in `0..bound` (a `bound` of 0 is taken as 1), by multiply-high with rejection of the biased low zone.
    pub fn below(&mut self, bound: u64) -> u64 {
        let bound = bound.max(1);
        let threshold = bound.wrapping_neg() % bound;
        loop {
            let m = u128::from(self.next_u64()) * u128::from(bound);
            if (m as u64) >= threshold {
                return (m >> 64) as u64;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_reference_stream() {
        // The first outputs of the reference SplitMix64 stream seeded with 0 (Vigna's splitmix64.c).
        let mut s = SplitMix64::new(0);
        assert_eq!(s.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(s.next_u64(), 0x6E78_9E6A_A1B9_65F4);
        assert_eq!(s.next_u64(), 0x06C4_5D18_8009_454F);
        assert_eq!(splitmix64(0), 0xE220_A839_7B1D_CDAF);
        assert_eq!(splitmix64(GAMMA), 0x6E78_9E6A_A1B9_65F4);
        assert_eq!(mix64(GAMMA), splitmix64(0));
    }

    #[test]
    fn below_stays_in_range_and_reaches_every_value() {
        let mut s = SplitMix64::new(42);
        let mut seen = [false; 7];
        for _ in 0..1_000 {
            let v = s.below(7);
            assert!(v < 7);
            seen[v as usize] = true;
        }
        assert!(seen.iter().all(|&b| b));
        assert_eq!(s.below(0), 0);
        assert_eq!(s.below(1), 0);
    }
}

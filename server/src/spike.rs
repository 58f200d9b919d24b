//! `SpikeDetector`: decides from one training-loss value per completed round when the loss has spiked. A round is
//! suspect when its value is non-finite or above `factor` × the running median of the last `window` good rounds;
//! `rounds` consecutive suspect rounds raise an alarm naming the first of them (the onset). No spike is called before
//! `window` good rounds were seen (non-finite values count from the start).
//!
//! Pure and deterministic: the same series gives the same verdicts. Every worker reports the same loss to every
//! shard, so every shard sees the same series and raises the same alarm at the same round, which is what lets the
//! shards roll back together without talking to each other. Losses are assumed non-negative (cross-entropy): a
//! median of 0 calls no spike by ratio.

use crate::median::{lower_median, RunningMedian};

/// The value of one completed round: the lower median of the workers' losses, a non-finite loss counting as +∞
/// (so one bad worker out of two or more does not make the round non-finite, a majority does). `None` without losses.
pub fn round_value(losses: &mut [f32]) -> Option<f32> {
    for l in losses.iter_mut() {
        if !l.is_finite() {
            *l = f32::INFINITY;
        }
    }
    lower_median(losses)
}

/// What one round's value means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// A good round: it joins the running window.
    Good,
    /// A suspect round, the `streak`-th in a row (fewer than the rounds that raise an alarm).
    Suspect {
        /// Consecutive suspect rounds so far.
        streak: u32,
    },
    /// Enough consecutive suspect rounds: roll back to before `onset`, the first of them.
    Alarm {
        /// The first suspect round of the streak.
        onset: u64,
    },
}

/// The loss-spike detector of one shard.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct SpikeDetector {
    factor: f32,
    rounds: u32,
    /// The last `window` good rounds.
    good: RunningMedian,
    streak: u32,
    onset: u64,
}

impl SpikeDetector {
    /// Checks a decoded detector (a peer's state image).
    pub(crate) fn check(&self) -> Result<(), String> {
        self.good.check()
    }

    /// A detector calling `rounds` consecutive rounds above `factor` × the median of the last `window` good rounds
    /// (or non-finite) a spike.
    pub fn new(factor: f32, rounds: u32, window: usize) -> Self {
        Self {
            factor,
            rounds: rounds.max(1),
            good: RunningMedian::new(window),
            streak: 0,
            onset: 0,
        }
    }

    /// The running (lower) median of the good rounds, once `window` of them were seen.
    pub fn median(&mut self) -> Option<f32> {
        if !self.good.is_full() {
            return None;
        }
        self.good.lower()
    }

    /// Feeds the value of completed round `round` (rounds come in increasing order; rounds without a value are
    /// simply not fed and do not break a streak).
    pub fn observe(&mut self, round: u64, value: f32) -> Verdict {
        let suspect = !value.is_finite()
            || self
                .median()
                .is_some_and(|m| m > 0.0 && value > self.factor * m);
        if !suspect {
            self.streak = 0;
            self.good.push(value);
            return Verdict::Good;
        }
        if self.streak == 0 {
            self.onset = round;
        }
        self.streak += 1;
        if self.streak >= self.rounds {
            self.streak = 0;
            return Verdict::Alarm { onset: self.onset };
        }
        Verdict::Suspect {
            streak: self.streak,
        }
    }

    /// Whether the last rounds fed were suspect (a streak is in progress).
    pub fn suspect(&self) -> bool {
        self.streak > 0
    }

    /// Forgets a streak in progress (after a rollback its rounds are gone).
    pub fn clear_streak(&mut self) {
        self.streak = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tether_common::testing::TestRng;

    #[test]
    fn round_value_is_the_lower_median_and_survives_one_bad_worker() {
        assert_eq!(round_value(&mut []), None);
        assert_eq!(round_value(&mut [2.0]), Some(2.0));
        assert_eq!(round_value(&mut [3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(round_value(&mut [1.0, f32::NAN]), Some(1.0));
        assert_eq!(round_value(&mut [1.0, 9.0, f32::NAN]), Some(9.0));
        assert_eq!(
            round_value(&mut [f32::NAN, f32::NAN, 1.0]),
            Some(f32::INFINITY)
        );
        assert_eq!(round_value(&mut [f32::NEG_INFINITY]), Some(f32::INFINITY));
    }

    #[test]
    fn a_decreasing_noisy_loss_never_alarms() {
        // 5,000 rounds of a loss decaying from 2.3 to ~0.05 with ±60% multiplicative noise, k = 3, m = 2.
        let mut d = SpikeDetector::new(3.0, 2, 16);
        let mut rng = TestRng::new(0);
        for r in 0..5_000u64 {
            let trend = 0.05 + 2.25 * (-(r as f32) / 300.0).exp();
            let v = trend * (0.4 + 1.2 * rng.next_f32());
            assert!(
                !matches!(d.observe(r, v), Verdict::Alarm { .. }),
                "false alarm at round {r} (value {v})"
            );
        }
    }

    #[test]
    fn a_spike_of_m_rounds_alarms_at_its_onset_and_a_shorter_one_does_not() {
        let mut d = SpikeDetector::new(3.0, 2, 8);
        for r in 0..20 {
            assert_eq!(d.observe(r, 1.0 + 0.01 * (r % 3) as f32), Verdict::Good);
        }
        // One suspect round, then a normal one: no alarm, the streak restarts.
        assert_eq!(d.observe(20, 50.0), Verdict::Suspect { streak: 1 });
        assert!(d.suspect());
        assert_eq!(d.observe(21, 1.0), Verdict::Good);
        assert!(!d.suspect());
        assert_eq!(d.observe(22, 50.0), Verdict::Suspect { streak: 1 });
        assert_eq!(d.observe(23, 40.0), Verdict::Alarm { onset: 22 });
        // Suspect rounds never entered the window: the median is still ~1.
        assert!((d.median().unwrap() - 1.0).abs() < 0.05);
        // Just below the threshold is good.
        assert_eq!(d.observe(24, 2.9), Verdict::Good);
    }

    #[test]
    fn non_finite_losses_alarm_even_while_warming_up() {
        let mut d = SpikeDetector::new(3.0, 3, 16);
        assert_eq!(d.observe(0, 2.0), Verdict::Good);
        assert_eq!(d.observe(1, f32::NAN), Verdict::Suspect { streak: 1 });
        assert_eq!(d.observe(2, f32::INFINITY), Verdict::Suspect { streak: 2 });
        assert_eq!(d.observe(3, f32::NAN), Verdict::Alarm { onset: 1 });
        // A large finite value while warming up is not a spike: there is no median yet.
        assert_eq!(d.observe(4, 1e6), Verdict::Good);
    }

    #[test]
    fn clearing_the_streak_forgets_the_suspect_rounds() {
        let mut d = SpikeDetector::new(2.0, 2, 4);
        for r in 0..4 {
            d.observe(r, 1.0);
        }
        assert_eq!(d.observe(4, 9.0), Verdict::Suspect { streak: 1 });
        d.clear_streak();
        assert_eq!(d.observe(5, 9.0), Verdict::Suspect { streak: 1 });
    }
}

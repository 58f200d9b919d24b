//! Link-aware local steps: how many inner steps (H) a worker runs per round when `train.local_steps_max` lets it
//! choose. Pure: it is given each round's measured compute and communication time and returns the next H with the
//! reason; the training loop does the timing.
//!
//! A round is H inner steps of compute, then the push and the pull. Communication is what the links take, not the
//! wait for other workers at the shards' gate: the slowest push round trip of the round (upload and apply) plus the
//! slowest reply transfer of the pull (from its first bytes to its last), as the driver measures them. The policy
//! keeps exponentially weighted means of the time per inner step `t` and the communication per round `c` (which does
//! not depend on H: a round pushes one pseudo-gradient and pulls one delta whatever H is) and picks the smallest H for which communication is at most
//! [`COMM_SHARE`] of the round, `c ≤ share · (c + H·t)`, i.e. `H = ceil(c·(1 − share) / (share·t))`, clamped to
//! `[local_steps, local_steps_max]` and to at most twice the current H per round. The first round (connection set-up,
//! the first pull, whole unless the worker computed the shard's initial cut) is not counted.

use std::time::Duration;

/// The largest share of a round that communication may take before H grows.
pub const COMM_SHARE: f64 = 0.2;

/// Weight of the newest round in the running means.
const ALPHA: f64 = 0.3;

/// Chooses H round by round within `[base, max]`.
#[derive(Debug, Clone)]
pub struct LocalStepsPolicy {
    base: u32,
    max: u32,
    h: u32,
    rounds: u64,
    step_secs: Option<f64>,
    comm_secs: Option<f64>,
}

impl LocalStepsPolicy {
    /// A policy starting at `base` inner steps that may grow to `max` (`max ≤ base` pins H at `base`).
    pub fn new(base: u32, max: u32) -> Self {
        let base = base.max(1);
        LocalStepsPolicy {
            base,
            max: max.max(base),
            h: base,
            rounds: 0,
            step_secs: None,
            comm_secs: None,
        }
    }

    /// Whether H can change at all.
    pub fn adaptive(&self) -> bool {
        self.max > self.base
    }

    /// The H of the next round.
    pub fn current(&self) -> u32 {
        self.h
    }

    /// Records one round of `steps` inner steps that computed for `compute` and communicated (push, gate, pull) for
    /// `comm`, and returns the H of the next round.
    pub fn observe(&mut self, steps: u64, compute: Duration, comm: Duration) -> u32 {
        self.rounds += 1;
        if !self.adaptive() || self.rounds == 1 || steps == 0 {
            return self.h;
        }
        let mix = |old: Option<f64>, new: f64| Some(old.map_or(new, |o| o + ALPHA * (new - o)));
        self.step_secs = mix(self.step_secs, compute.as_secs_f64() / steps as f64);
        self.comm_secs = mix(self.comm_secs, comm.as_secs_f64());
        let (t, c) = (self.step_secs.unwrap_or(0.0), self.comm_secs.unwrap_or(0.0));
        let want = if t > 0.0 {
            (c * (1.0 - COMM_SHARE) / (COMM_SHARE * t)).ceil()
        } else {
            f64::from(self.max)
        };
        let want = want.clamp(f64::from(self.base), f64::from(self.max)) as u32;
        self.h = want.min(self.h.saturating_mul(2)).max(self.base);
        self.h
    }

    /// Why H is what it is, in one sentence (for the log, the report and the summary).
    pub fn reason(&self) -> String {
        if !self.adaptive() {
            return format!("H = {} pinned (train.local_steps_max not above it)", self.h);
        }
        match (self.step_secs, self.comm_secs) {
            (Some(t), Some(c)) => {
                let share = c / (c + f64::from(self.h) * t);
                format!(
                    "H = {} (range {}..={}): communication {:.1} ms per round against {:.2} ms per inner step is \
                     {:.0} % of a round (target ≤ {:.0} %)",
                    self.h,
                    self.base,
                    self.max,
                    c * 1e3,
                    t * 1e3,
                    100.0 * share,
                    100.0 * COMM_SHARE
                )
            }
            _ => format!(
                "H = {} (range {}..={}): not measured yet (the first round is not counted)",
                self.h, self.base, self.max
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: f64) -> Duration {
        Duration::from_secs_f64(v / 1e3)
    }

    #[test]
    fn pinned_never_moves() {
        let mut p = LocalStepsPolicy::new(16, 0);
        for _ in 0..10 {
            assert_eq!(p.observe(16, ms(16.0), ms(1000.0)), 16);
        }
        assert!(!p.adaptive());
        assert!(p.reason().contains("pinned"));
    }

    #[test]
    fn a_slow_link_grows_h_until_communication_is_a_fifth_of_the_round() {
        // 1 ms per inner step, 100 ms of communication per round: H = 100·0.8/0.2 = 400, capped at 256.
        let mut p = LocalStepsPolicy::new(16, 256);
        let mut seen = vec![];
        for _ in 0..12 {
            let h = p.current();
            seen.push(p.observe(u64::from(h), ms(f64::from(h)), ms(100.0)));
        }
        // The first round is not counted; then at most doubling per round, up to the cap.
        assert_eq!(&seen[..6], &[16, 32, 64, 128, 256, 256]);
        assert_eq!(p.current(), 256);
        // 40 ms per round: H = 160 exactly hides it at 20 %.
        let mut p = LocalStepsPolicy::new(16, 1024);
        for _ in 0..40 {
            let h = p.current();
            p.observe(u64::from(h), ms(f64::from(h)), ms(40.0));
        }
        // (160 up to the rounding of the measured times.)
        assert!((160..=161).contains(&p.current()), "{}", p.current());
        let share = 40.0 / (40.0 + f64::from(p.current()));
        assert!(share <= COMM_SHARE + 1e-9 && share > COMM_SHARE - 0.01);
        assert!(p.reason().contains("H = 16"), "{}", p.reason());
    }

    #[test]
    fn a_fast_link_stays_at_the_configured_h_and_h_comes_back_down() {
        let mut p = LocalStepsPolicy::new(16, 128);
        for _ in 0..10 {
            let h = p.current();
            p.observe(u64::from(h), ms(f64::from(h) * 5.0), ms(2.0));
        }
        assert_eq!(p.current(), 16);
        // The link slows down, then recovers: H follows within its bounds.
        for _ in 0..30 {
            let h = p.current();
            p.observe(u64::from(h), ms(f64::from(h) * 5.0), ms(200.0));
        }
        assert_eq!(p.current(), 128);
        for _ in 0..30 {
            let h = p.current();
            p.observe(u64::from(h), ms(f64::from(h) * 5.0), ms(2.0));
        }
        assert_eq!(p.current(), 16);
    }
}

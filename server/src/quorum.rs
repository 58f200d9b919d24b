//! Quorum rounds: when the SSP gate of one shard's clock table moves past a round without waiting for every live
//! worker. Pure: the clock table hands in its live clocks and `now_ms`, and gets back where its gate stands.
//!
//! Round `c` is *open* while the gate stands at `c` (the pulls it holds are for clocks above `c + s`). It closes:
//! - at once when no live worker that is *punctual* (clock `≥ c`: it took every earlier round on time) still owes
//!   it, and at least the quorum has pushed it (`clock > c`); with the quorum at "every live worker" this is the
//!   plain SSP minimum, bit for bit;
//! - otherwise once the quorum has pushed it and the **grace window** has passed since the quorum was reached. The
//!   window is `grace_factor ×` the median of the last [`HISTORY`] round times, within [`GRACE_MIN_MS`] and
//!   `grace_max_ms` (the eviction timeout); before any round closed it is `grace_max_ms`, the old behaviour.
//!
//! A punctual worker that had not pushed when its round closed becomes a *laggard*: later rounds never wait for it,
//! its pulls pass the gate at once, and its late pushes are applied when they arrive, into the open round, at the
//! same weight as an on-time push (every push carries the same number of samples or inner steps). The gate never
//! moves backwards while a worker is live.

/// Round times remembered for the adaptive grace window.
pub const HISTORY: usize = 8;

/// The shortest grace window, whatever the round times.
pub const GRACE_MIN_MS: u64 = 5;

/// How rounds close: the quorum and the grace window (from `[cluster]`).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct QuorumSettings {
    /// Pushes that close a round (`cluster.quorum`); 0 = every live worker (plain SSP). Capped at the live count.
    pub quorum: u32,
    /// The grace window as a multiple of the median round time (`cluster.grace_factor`).
    pub grace_factor: f32,
    /// The longest grace window (the eviction timeout): a worker silent for longer is evicted anyway.
    pub grace_max_ms: u64,
}

impl QuorumSettings {
    /// Every live worker closes a round: the plain SSP gate.
    pub fn all(grace_max_ms: u64) -> Self {
        Self {
            quorum: 0,
            grace_factor: 1.0,
            grace_max_ms,
        }
    }
}

/// What one [`RoundCloser::settle`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Settled {
    /// Rounds closed by this call.
    pub closed: u64,
    /// Punctual workers those rounds left behind (they became laggards).
    pub left_behind: u64,
}

/// The quorum state of one clock table: the rounds closed so far, when the open round reached its quorum, and the
/// recent round times.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct RoundCloser {
    settings: QuorumSettings,
    /// Rounds below this are closed: the gate stands at `max(m, closed)`.
    closed: u64,
    /// When the open round reached its quorum while punctual workers still owed it.
    reached_at: Option<u64>,
    /// When the last round closed.
    last_close_ms: Option<u64>,
    /// Recent round times (ms), a ring of `len` entries.
    times: [u64; HISTORY],
    len: usize,
    next: usize,
    /// Rounds closed with a punctual worker left behind, and how many were left behind in all.
    quorum_closes: u64,
    left_behind: u64,
}

impl RoundCloser {
    /// Checks a decoded closer (a peer's state image): its ring of round times is in bounds.
    pub(crate) fn check(&self) -> Result<(), String> {
        if self.len > HISTORY || self.next >= HISTORY {
            return Err("the ring of round times is out of bounds".into());
        }
        Ok(())
    }

    /// A closer at round 0 with `settings`.
    pub fn new(settings: QuorumSettings) -> Self {
        Self {
            settings,
            closed: 0,
            reached_at: None,
            last_close_ms: None,
            times: [0; HISTORY],
            len: 0,
            next: 0,
            quorum_closes: 0,
            left_behind: 0,
        }
    }

    /// The settings.
    pub fn settings(&self) -> QuorumSettings {
        self.settings
    }

    /// Replaces the settings (the round state stays).
    pub fn set_settings(&mut self, settings: QuorumSettings) {
        self.settings = settings;
        self.reached_at = None;
    }

    /// Whether a round may close before every live worker pushed it.
    pub fn is_partial(&self) -> bool {
        self.settings.quorum != 0
    }

    /// Where the gate stands given the minimum live clock `min`: `max(min, closed)`.
    pub fn gate(&self, min: u64) -> u64 {
        min.max(self.closed)
    }

    /// Starts again at round `at` (a restore): the round times are kept, the open round's quorum is forgotten.
    pub fn reset(&mut self, at: u64) {
        self.closed = at;
        self.reached_at = None;
    }

    /// The grace window now: `grace_factor ×` the median recent round time within
    /// [`GRACE_MIN_MS`]`..=grace_max_ms`; `grace_max_ms` before any round time is known.
    pub fn grace_ms(&self) -> u64 {
        let max = self.settings.grace_max_ms.max(GRACE_MIN_MS);
        if self.len == 0 {
            return max;
        }
        let mut sorted = self.times;
        let recent = &mut sorted[..self.len];
        recent.sort_unstable();
        let median = recent[self.len / 2] as f64;
        let grace = (f64::from(self.settings.grace_factor) * median).ceil();
        // A non-finite or negative factor is refused by config validation; the clamp keeps any value in range.
        (grace.max(0.0).min(max as f64) as u64).clamp(GRACE_MIN_MS, max)
    }

    /// When the open round closes unless something else moves it first; `None` when it is not waiting on a grace
    /// window.
    pub fn deadline(&self) -> Option<u64> {
        self.reached_at.map(|at| at.saturating_add(self.grace_ms()))
    }

    /// Rounds closed with a punctual worker left behind.
    pub fn quorum_closes(&self) -> u64 {
        self.quorum_closes
    }

    /// Punctual workers left behind by those closes, in all.
    pub fn left_behind_total(&self) -> u64 {
        self.left_behind
    }

    /// Closes every round that may close now, given the live workers' clocks and their minimum `min`.
    pub fn settle<I>(&mut self, live: I, min: u64, now_ms: u64) -> Settled
    where
        I: Iterator<Item = u64> + Clone,
    {
        let start = self.closed;
        let mut out = Settled::default();
        let count = live.clone().count();
        if count == 0 {
            self.reached_at = None;
            return out;
        }
        self.closed = self.closed.max(min);
        let quorum = match self.settings.quorum {
            0 => count,
            q => (q as usize).min(count),
        };
        loop {
            let open = self.closed;
            let pushed = live.clone().filter(|c| *c > open).count();
            let owing = live.clone().filter(|c| *c == open).count();
            if pushed < quorum {
                self.reached_at = None;
                break;
            }
            if owing > 0 {
                let at = *self.reached_at.get_or_insert(now_ms);
                if now_ms < at.saturating_add(self.grace_ms()) {
                    break;
                }
                self.quorum_closes += 1;
                self.left_behind += owing as u64;
                out.left_behind += owing as u64;
            }
            self.reached_at = None;
            self.closed = open + 1;
        }
        out.closed = self.closed - start;
        if let Some(per_round) = now_ms
            .checked_sub(self.last_close_ms.unwrap_or(now_ms))
            .and_then(|t| t.checked_div(out.closed))
        {
            if self.last_close_ms.is_some() {
                self.times[self.next] = per_round;
                self.next = (self.next + 1) % HISTORY;
                self.len = (self.len + 1).min(HISTORY);
            }
        }
        if out.closed > 0 {
            self.last_close_ms = Some(now_ms);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn closer(quorum: u32) -> RoundCloser {
        RoundCloser::new(QuorumSettings {
            quorum,
            grace_factor: 1.0,
            grace_max_ms: 1000,
        })
    }

    #[test]
    fn every_live_worker_is_the_plain_minimum() {
        let mut c = closer(0);
        assert_eq!(c.settle([3, 2, 2].into_iter(), 2, 10).closed, 2);
        assert_eq!(c.gate(2), 2);
        // No grace ever applies: the round waits for the last worker however long it takes.
        assert_eq!(c.settle([3, 3, 2].into_iter(), 2, 1_000_000).closed, 0);
        assert_eq!(c.deadline(), None);
        assert_eq!(c.settle([3, 3, 3].into_iter(), 3, 1_000_001).closed, 1);
        assert_eq!(c.gate(3), 3);
    }

    #[test]
    fn a_round_closes_after_the_grace_window_once_the_quorum_pushed() {
        let mut c = closer(2);
        // One of three pushed round 0: below the quorum, nothing waits on a deadline.
        c.settle([1, 0, 0].into_iter(), 0, 0);
        assert_eq!((c.gate(0), c.deadline()), (0, None));
        // The quorum pushed at 100 ms; before any round time is known the window is the maximum (1000 ms).
        c.settle([1, 1, 0].into_iter(), 0, 100);
        assert_eq!(c.deadline(), Some(1100));
        assert_eq!(c.settle([1, 1, 0].into_iter(), 0, 1099).closed, 0);
        let s = c.settle([1, 1, 0].into_iter(), 0, 1100);
        assert_eq!((s.closed, s.left_behind), (1, 1));
        assert_eq!(c.gate(0), 1);
        // Worker 2 is a laggard now: round 1 closes as soon as the two punctual workers pushed it.
        assert_eq!(c.settle([2, 2, 0].into_iter(), 0, 1200).closed, 1);
        assert_eq!(c.gate(0), 2);
        // Its late push moves it on without moving the gate back.
        assert_eq!(c.settle([2, 2, 1].into_iter(), 1, 1250).closed, 0);
        assert_eq!(c.gate(1), 2);
        assert_eq!((c.quorum_closes(), c.left_behind_total()), (1, 1));
    }

    #[test]
    fn the_grace_window_follows_the_median_round_time_within_its_bounds() {
        let mut c = closer(2);
        let mut now = 0;
        for round in 1..=9u64 {
            now += 40;
            c.settle([round, round].into_iter(), round, now);
        }
        assert_eq!(c.grace_ms(), 40);
        // An outlier does not move the median.
        c.settle([10, 10].into_iter(), 10, now + 900);
        assert_eq!(c.grace_ms(), 40);
        let mut fast = RoundCloser::new(QuorumSettings {
            quorum: 1,
            grace_factor: 0.01,
            grace_max_ms: 1000,
        });
        fast.settle([1].into_iter(), 1, 0);
        fast.settle([2].into_iter(), 2, 10);
        assert_eq!(fast.grace_ms(), GRACE_MIN_MS);
    }

    #[test]
    fn the_quorum_is_capped_at_the_live_count() {
        let mut c = closer(5);
        assert_eq!(c.settle([1, 1].into_iter(), 1, 0).closed, 1);
        assert_eq!(c.settle([].into_iter(), 1, 5).closed, 0);
        assert_eq!(c.deadline(), None);
    }
}

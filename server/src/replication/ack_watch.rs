//! When a primary gives up on a standby that does not acknowledge its log: the decision alone, fed each tick with
//! what the standby acknowledged, what was written to it and how many bytes the connection delivered (sent less
//! lost) since the last tick. A standby is dropped after one lease with entries outstanding and no progress.
//! Progress is an acknowledgement that moved, or the connection still carrying the log at a useful rate: on a slow
//! or saturated link the entries are still in flight, and a standby dropped then is seeded again with a whole image,
//! which costs the link more than the entries it was waiting for.
//!
//! What still gets a standby dropped after one lease: a dead host, a cut link or a stopped process (SIGSTOP) sends
//! no QUIC acknowledgements, so the primary sends only loss probes, far under the rate. A standby whose process
//! runs but no longer reads the log keeps acknowledging packets until its stream window is full (at most the
//! window over the link's rate), then the flow stops. Bytes flowing never keep a standby past
//! [`MAX_STALL_LEASES`] leases without an acknowledgement that moved.

use std::time::{Duration, Instant};

/// Bytes per second the connection must still deliver, while entries are outstanding, to count as progress:
/// 64 KiB/s, far above loss probes, keep-alives and acknowledgements, far below any link a shard serves over.
pub const FLOWING_BYTES_PER_S: f64 = 64.0 * 1024.0;

/// The most leases an acknowledgement may stand still, entries outstanding, however many bytes flow.
pub const MAX_STALL_LEASES: u32 = 10;

/// The watch over one replication link.
#[derive(Debug, Clone)]
pub struct AckWatch {
    lease: Duration,
    last_acked: u64,
    last_tick: Option<Instant>,
    /// Since when the acknowledgement stood still with entries outstanding.
    acked_still_since: Option<Instant>,
    /// Since when, in addition, the bytes stopped flowing.
    stalled_since: Option<Instant>,
}

impl AckWatch {
    /// A watch that drops a standby after one `lease` without progress.
    pub fn new(lease: Duration) -> Self {
        AckWatch {
            lease,
            last_acked: 0,
            last_tick: None,
            acked_still_since: None,
            stalled_since: None,
        }
    }

    /// One tick at `now`: `acked` is the standby's newest acknowledgement (at most `written`), `written` the
    /// entries written to it, `delivered_bytes` what the connection sent less what it declared lost since the last
    /// tick (the rate is taken over the time that really passed). Returns whether the standby is to be dropped.
    pub fn tick(&mut self, now: Instant, acked: u64, written: u64, delivered_bytes: u64) -> bool {
        let elapsed = self
            .last_tick
            .map_or(Duration::ZERO, |t| now.saturating_duration_since(t));
        self.last_tick = Some(now);
        let flowing = elapsed > Duration::ZERO
            && delivered_bytes as f64 >= FLOWING_BYTES_PER_S * elapsed.as_secs_f64();
        let moved = acked != self.last_acked;
        self.last_acked = acked;
        if acked >= written || moved {
            self.acked_still_since = None;
            self.stalled_since = None;
            return false;
        }
        let still = *self.acked_still_since.get_or_insert(now);
        if now.duration_since(still) > self.lease * MAX_STALL_LEASES {
            return true;
        }
        if flowing {
            self.stalled_since = None;
            return false;
        }
        let stalled = *self.stalled_since.get_or_insert(now);
        now.duration_since(stalled) > self.lease
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TICK: Duration = Duration::from_millis(250);

    /// Ticks every 250 ms for `secs` seconds with the given per-tick figures (acked, written, delivered bytes);
    /// returns the first tick that drops.
    fn run(secs: u64, mut each: impl FnMut(u32) -> (u64, u64, u64)) -> Option<u32> {
        let mut w = AckWatch::new(Duration::from_secs(1));
        let t0 = Instant::now();
        (1..=(secs * 4) as u32).find(|&i| {
            let (acked, written, sent) = each(i);
            w.tick(t0 + TICK * i, acked, written, sent)
        })
    }

    #[test]
    fn a_standby_with_nothing_outstanding_is_never_dropped() {
        assert_eq!(run(20, |_| (7, 7, 0)), None);
    }

    #[test]
    fn a_standby_that_stops_acknowledging_and_reading_is_dropped_after_one_lease() {
        // Entries outstanding, no acknowledgement moves, only loss probes go out: a few hundred bytes a tick.
        let dropped = run(10, |_| (3, 9, 200));
        assert!(
            matches!(dropped, Some(6..=7)),
            "dropped at tick {dropped:?}"
        );
    }

    #[test]
    fn a_standby_behind_a_slow_link_that_still_carries_the_log_is_kept() {
        // At 10 Mbit/s shared with pulls, one entry may take seconds: acknowledgements stall, bytes still flow
        // (40 KB a tick, 160 KB/s).
        assert_eq!(run(20, |i| (u64::from(i / 12), 50, 40_000)), None);
    }

    #[test]
    fn acknowledgements_that_move_are_progress_without_bytes() {
        assert_eq!(run(20, |i| (u64::from(i), 1_000, 0)), None);
    }

    #[test]
    fn a_stall_after_progress_counts_from_its_own_start() {
        // Five seconds flowing with acknowledgements moving, then both stop: dropped one lease after, not at once.
        let dropped = run(10, |i| {
            if i <= 20 {
                (u64::from(i), 90, 40_000)
            } else {
                (20, 90, 0)
            }
        });
        assert!(
            matches!(dropped, Some(25..=27)),
            "dropped at tick {dropped:?}"
        );
    }

    #[test]
    fn flowing_bytes_never_keep_a_standby_past_the_cap() {
        // A process that takes packets but never acknowledges an entry: dropped after MAX_STALL_LEASES leases.
        let dropped = run(30, |_| (3, 9, 1_000_000));
        let cap = MAX_STALL_LEASES * 4;
        assert!(
            matches!(dropped, Some(t) if (cap + 2..=cap + 3).contains(&t)),
            "dropped at tick {dropped:?}"
        );
    }

    #[test]
    fn the_rate_is_taken_over_the_time_that_passed() {
        // A late tick (1 s instead of 250 ms) with 20 KB: 20 KB/s, not flowing, although 20 KB in 250 ms would be.
        let mut w = AckWatch::new(Duration::from_secs(1));
        let t0 = Instant::now();
        assert!(!w.tick(t0, 0, 5, 0));
        assert!(!w.tick(t0 + Duration::from_secs(1), 0, 5, 20_000));
        assert!(w.tick(t0 + Duration::from_millis(2100), 0, 5, 20_000));
    }
}

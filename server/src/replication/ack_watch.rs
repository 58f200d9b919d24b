//! When a primary gives up on a standby that does not acknowledge its log: the decision alone, fed each tick with
//! what the standby acknowledged, what was written to it and how many bytes the connection sent since the last
//! tick. A standby is dropped after one lease with entries outstanding and no progress. Progress is an
//! acknowledgement that moved, or the connection still carrying the log at a useful rate: on a slow or saturated
//! link the entries are still in flight, and a standby dropped then is seeded again with a whole image, which costs
//! the link more than the entries it was waiting for. A standby whose process no longer reads stops the flow (QUIC
//! flow control holds the primary's stream), so it is still dropped after one lease.

use std::time::{Duration, Instant};

/// Bytes per second the connection must still send, while entries are outstanding, to count as progress:
/// 64 KiB/s, far above keep-alives and acknowledgements, far below any link a shard serves over.
pub const FLOWING_BYTES_PER_S: u64 = 64 * 1024;

/// The watch over one replication link.
#[derive(Debug, Clone)]
pub struct AckWatch {
    deadline: Duration,
    last_acked: u64,
    stalled_since: Option<Instant>,
}

impl AckWatch {
    /// A watch that drops a standby after `deadline` (one lease) without progress.
    pub fn new(deadline: Duration) -> Self {
        AckWatch {
            deadline,
            last_acked: 0,
            stalled_since: None,
        }
    }

    /// One tick at `now`: `acked` is the standby's newest acknowledgement (at most `written`), `written` the entries
    /// written to it, `sent_bytes` what the connection sent over the `tick` since the last call. Returns whether
    /// the standby is to be dropped.
    pub fn tick(
        &mut self,
        now: Instant,
        acked: u64,
        written: u64,
        sent_bytes: u64,
        tick: Duration,
    ) -> bool {
        let behind = acked < written;
        let flowing =
            sent_bytes as f64 >= FLOWING_BYTES_PER_S as f64 * tick.as_secs_f64().max(1e-3);
        let progress = acked != self.last_acked || flowing;
        self.last_acked = acked;
        if !behind || progress {
            self.stalled_since = None;
            return false;
        }
        let since = *self.stalled_since.get_or_insert(now);
        now.duration_since(since) > self.deadline
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TICK: Duration = Duration::from_millis(250);

    /// Ticks every 250 ms for `secs` seconds with the given per-tick figures; returns the first tick that drops.
    fn run(secs: u64, mut each: impl FnMut(u32) -> (u64, u64, u64)) -> Option<u32> {
        let mut w = AckWatch::new(Duration::from_secs(1));
        let t0 = Instant::now();
        (1..=(secs * 4) as u32).find(|&i| {
            let (acked, written, sent) = each(i);
            w.tick(t0 + TICK * i, acked, written, sent, TICK)
        })
    }

    #[test]
    fn a_standby_with_nothing_outstanding_is_never_dropped() {
        assert_eq!(run(10, |_| (7, 7, 0)), None);
    }

    #[test]
    fn a_standby_that_stops_acknowledging_and_reading_is_dropped_after_one_lease() {
        // Entries outstanding, no acknowledgement moves, the stream held by flow control: a few bytes a tick.
        let dropped = run(10, |_| (3, 9, 200)).expect("dropped");
        assert!((6..=7).contains(&dropped), "dropped at tick {dropped}");
    }

    #[test]
    fn a_standby_behind_a_slow_link_that_still_carries_the_log_is_kept() {
        // At 10 Mbit/s shared with pulls, one entry may take seconds: acknowledgements stall, bytes still flow
        // (40 KB a tick, 160 KB/s).
        assert_eq!(run(10, |i| (u64::from(i / 12), 50, 40_000)), None);
    }

    #[test]
    fn acknowledgements_that_move_are_progress_without_bytes() {
        assert_eq!(run(10, |i| (u64::from(i), 1_000, 0)), None);
    }

    #[test]
    fn a_stall_after_progress_counts_from_its_own_start() {
        // Five seconds flowing, then the flow stops: dropped one lease after it stopped, not at once.
        let dropped = run(10, |i| (2, 9, if i <= 20 { 40_000 } else { 0 })).expect("dropped");
        assert!((24..=26).contains(&dropped), "dropped at tick {dropped}");
    }
}

//! Loss-spike rollback on one shard, as plain bookkeeping that `ShardCore` drives: the losses workers report per
//! round, the series of completed rounds fed to the `SpikeDetector`, the ring of in-memory snapshots taken at round
//! boundaries, and the choice of the snapshot to restore on an alarm. No I/O, no clocks.
//!
//! Invariants (what makes every shard roll back to the same round without talking to the others):
//! - a round `r` is complete when the minimum clock passes it (every live worker pushed or skip-marked it here); its
//!   value is the median of the losses the workers reported for it, which are the same on every shard;
//! - snapshots are labelled with the multiples of `every` the minimum clock reaches or jumps over (an eviction may
//!   move it by several rounds; the label is then the largest multiple crossed), so every shard holds snapshots of
//!   the same rounds; a snapshot labelled `b` holds every update of rounds below `b` (and, under a staleness bound
//!   `s`, maybe some of the next `s` rounds of faster workers, or after a jump the rounds up to the new minimum);
//! - on an alarm with onset `r0` the target is a pure function of `r0`: the largest multiple of `every` that is at
//!   most `r0 − 1 − margin` (margin 2s), so it holds nothing of the round whose update caused the spike. A shard
//!   whose ring lacks that round (never taken, evicted, or the shard was restored from disk since) does not roll
//!   back to another one: it counts the alarm as missed and logs it.

use std::collections::{BTreeMap, VecDeque};

use tether_common::config::RollbackConfig;

use crate::spike::{round_value, SpikeDetector, Verdict};

/// Losses are remembered for rounds at most this far past the minimum clock (an asynchronous worker far ahead of
/// the slowest one reports nothing further out; its rounds count with the other workers' losses only).
pub const MAX_ROUNDS_AHEAD: u64 = 4096;

/// A shard's state at a round boundary, kept in memory to roll back to.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RollbackPoint {
    /// The boundary: a multiple of `every`.
    pub round: u64,
    /// The minimum clock when it was taken (`round`, unless the minimum jumped over the boundary).
    pub taken_at: u64,
    /// Shard version then.
    pub version: u64,
    /// Optimizer update count then.
    pub opt_steps: u64,
    /// The weights.
    pub weights: Vec<f32>,
    /// The optimizer state slots.
    pub slots: Vec<Vec<f32>>,
}

/// One rollback a shard carried out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RollbackRecord {
    /// The shard.
    pub shard: u32,
    /// The completed round whose value raised the alarm.
    pub at_round: u64,
    /// The first suspect round.
    pub onset: u64,
    /// The round of the snapshot restored.
    pub to_round: u64,
    /// The shard version before the rollback.
    pub from_version: u64,
    /// The version the snapshot was taken at.
    pub snapshot_version: u64,
    /// The shard version after the rollback (versions keep counting: a rollback is itself a new version).
    pub version: u64,
    /// Rounds discarded: from the snapshot's round to the minimum clock at the alarm.
    pub rounds_lost: u64,
}

/// An alarm: the shard must roll back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Alarm {
    /// The completed round that raised it.
    pub round: u64,
    /// The first suspect round.
    pub onset: u64,
    /// The minimum clock when it was raised.
    pub min_clock: u64,
}

/// The run-report view of shards' rollbacks. Every shard rolls back together, so the counts are the most any shard
/// did (the missed alarms are summed); the log lists each shard's rollbacks as `[shard, alarm round, round restored]`.
pub fn report_fields<'a>(
    shards: impl IntoIterator<Item = (&'a [RollbackRecord], u64)>,
) -> tether_common::report::Rollbacks {
    let (mut rollbacks, mut lost, mut missed, mut log) = (0, 0, 0, Vec::new());
    for (records, m) in shards {
        rollbacks = rollbacks.max(records.len() as u64);
        lost = lost.max(records.iter().map(|r| r.rounds_lost).sum());
        missed += m;
        log.extend(records.iter().map(|r| (r.shard, r.at_round, r.to_round)));
    }
    tether_common::report::Rollbacks {
        rollbacks,
        rounds_lost: lost,
        missed,
        log,
    }
}

/// Rollback bookkeeping of one shard.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct RollbackState {
    cfg: RollbackConfig,
    margin: u64,
    detector: SpikeDetector,
    ring: VecDeque<RollbackPoint>,
    losses: BTreeMap<u64, Vec<(u32, f32)>>,
    next_round: u64,
    /// The minimum clock at creation: no boundary below it is snapshotted (this state holds later rounds).
    start: u64,
    lr_until: u64,
    stale_before: u64,
    epoch: u64,
}

impl RollbackState {
    /// Checks a decoded state (a peer's state image) against a range of `len` parameters whose optimizer keeps
    /// `slots` state slots: every snapshot has that shape.
    pub(crate) fn check(&self, len: usize, slots: usize) -> Result<(), String> {
        self.detector.check()?;
        let bad = self.ring.iter().any(|p| {
            p.weights.len() != len
                || p.slots.len() != slots
                || p.slots.iter().any(|s| s.len() != len)
        });
        if bad {
            return Err("a rollback snapshot does not fit the range".into());
        }
        Ok(())
    }

    /// Bookkeeping for `cfg` with snapshot margin `margin` (see [`RollbackConfig::margin`]); rounds below
    /// `min_clock` are taken as complete already.
    pub fn new(cfg: &RollbackConfig, margin: u64, min_clock: u64) -> Self {
        Self {
            cfg: *cfg,
            margin,
            detector: SpikeDetector::new(cfg.factor, cfg.rounds, cfg.window as usize),
            ring: VecDeque::with_capacity(cfg.keep.max(1)),
            losses: BTreeMap::new(),
            next_round: min_clock,
            start: min_clock,
            lr_until: 0,
            stale_before: 0,
            epoch: 0,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &RollbackConfig {
        &self.cfg
    }

    /// The snapshot margin in rounds.
    pub fn margin(&self) -> u64 {
        self.margin
    }

    /// Rollbacks carried out (the trajectory epoch pull replies carry).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Pushes read at a version below this were computed from parameters a rollback discarded.
    pub fn stale_before(&self) -> u64 {
        self.stale_before
    }

    /// The learning-rate factor for a push of round `clock` (`lr_scale` for `lr_rounds` rounds after a rollback).
    pub fn lr_factor(&self, clock: u64) -> f32 {
        if clock < self.lr_until {
            self.cfg.lr_scale
        } else {
            1.0
        }
    }

    /// Whether the last completed rounds were suspect (a spike may be under way): the shard then holds off its disk
    /// checkpoints, so that `--resume` does not bring the spike back.
    pub fn suspect(&self) -> bool {
        self.detector.suspect()
    }

    /// Rounds of the snapshots held, oldest first.
    pub fn snapshot_rounds(&self) -> Vec<u64> {
        self.ring.iter().map(|p| p.round).collect()
    }

    /// `worker` reported `loss` for round `clock`, computed from parameters of version `read_version`. Ignored for
    /// rounds already complete or too far ahead, and for losses of parameters a rollback discarded; a second report
    /// for the same round replaces the first.
    pub fn note_loss(&mut self, worker: u32, clock: u64, read_version: u64, loss: f32) {
        if clock < self.next_round
            || clock >= self.next_round.saturating_add(MAX_ROUNDS_AHEAD)
            || read_version < self.stale_before
        {
            return;
        }
        let book = self.losses.entry(clock).or_default();
        match book.iter_mut().find(|(w, _)| *w == worker) {
            Some(entry) => entry.1 = loss,
            None => book.push((worker, loss)),
        }
    }

    /// The minimum clock is now `min_clock`: feeds the rounds completed since the last call to the detector, in
    /// order. Returns the alarm if one of them raised it (the rounds after it in the same call are dropped: a
    /// rollback discards them).
    pub fn settle(&mut self, min_clock: u64) -> Option<Alarm> {
        if min_clock <= self.next_round {
            return None;
        }
        let later = self.losses.split_off(&min_clock);
        let done = std::mem::replace(&mut self.losses, later);
        self.next_round = min_clock;
        for (round, book) in done {
            let mut values: Vec<f32> = book.iter().map(|(_, l)| *l).collect();
            let Some(v) = round_value(&mut values) else {
                continue;
            };
            if let Verdict::Alarm { onset } = self.detector.observe(round, v) {
                return Some(Alarm {
                    round,
                    onset,
                    min_clock,
                });
            }
        }
        None
    }

    /// The boundary a snapshot is due for at minimum clock `min_clock`: the largest multiple of `every` reached or
    /// jumped over since the newest snapshot (and not below the clock this bookkeeping started at).
    pub fn due_snapshot(&self, min_clock: u64) -> Option<u64> {
        let b = min_clock / self.cfg.every * self.cfg.every;
        let fresh = self.ring.back().is_none_or(|p| p.round < b);
        (b >= self.start && fresh).then_some(b)
    }

    /// Keeps `point`, dropping the oldest beyond `keep`.
    pub fn keep_snapshot(&mut self, point: RollbackPoint) {
        if self.ring.len() >= self.cfg.keep.max(1) {
            self.ring.pop_front();
        }
        self.ring.push_back(point);
    }

    /// The round to roll back to for a spike with onset `onset`: the largest multiple of `every` at most
    /// `onset − 1 − margin`; `None` when the spike starts too early for any.
    pub fn target(&self, onset: u64) -> Option<u64> {
        let limit = onset.checked_sub(1 + self.margin)?;
        Some(limit / self.cfg.every * self.cfg.every)
    }

    /// The snapshot of round `round`, if held.
    pub fn point(&self, round: u64) -> Option<&RollbackPoint> {
        self.ring.iter().find(|p| p.round == round)
    }

    /// The shard restored the snapshot of `record.to_round`: snapshots after it (they hold the discarded rounds)
    /// and the losses reported so far (computed from the discarded parameters) are dropped, pushes read before
    /// `record.version` become stale, the learning-rate factor applies for the next `lr_rounds` rounds, and the
    /// epoch advances.
    pub fn rolled_back(&mut self, record: &RollbackRecord, min_clock: u64) {
        self.ring.retain(|p| p.round <= record.to_round);
        self.losses.clear();
        self.detector.clear_streak();
        self.next_round = self.next_round.max(min_clock);
        self.stale_before = record.version;
        self.lr_until = min_clock.saturating_add(self.cfg.lr_rounds);
        self.epoch += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(every: u64, keep: usize) -> RollbackConfig {
        RollbackConfig {
            enabled: true,
            factor: 3.0,
            rounds: 2,
            window: 4,
            every,
            keep,
            lr_scale: 0.5,
            lr_rounds: 5,
        }
    }

    fn point(round: u64) -> RollbackPoint {
        RollbackPoint {
            round,
            taken_at: round,
            version: round * 2,
            opt_steps: round * 2,
            weights: vec![round as f32],
            slots: Vec::new(),
        }
    }

    #[test]
    fn the_target_is_the_newest_boundary_clear_of_the_onset_and_the_margin() {
        let s = RollbackState::new(&cfg(10, 3), 0, 0);
        assert_eq!(
            s.target(31),
            Some(30),
            "a snapshot at 30 holds rounds < 30: clean"
        );
        assert_eq!(s.target(30), Some(20), "round 29's update may be the cause");
        assert_eq!(s.target(1), Some(0));
        assert_eq!(s.target(0), None);
        let ssp = RollbackState::new(&cfg(10, 3), 6, 0);
        assert_eq!(ssp.target(37), Some(30));
        assert_eq!(ssp.target(36), Some(20));
        assert_eq!(ssp.target(6), None);
    }

    #[test]
    fn snapshots_are_due_at_multiples_once_and_the_ring_keeps_the_newest() {
        let mut s = RollbackState::new(&cfg(5, 2), 0, 0);
        assert_eq!(s.due_snapshot(0), Some(0));
        s.keep_snapshot(point(0));
        assert_eq!(s.due_snapshot(0), None);
        assert_eq!(s.due_snapshot(3), None);
        for r in [5, 10, 15] {
            assert_eq!(s.due_snapshot(r), Some(r));
            s.keep_snapshot(point(r));
        }
        assert_eq!(s.snapshot_rounds(), vec![10, 15]);
        assert!(s.point(5).is_none(), "evicted");
        assert_eq!(s.point(10).map(|p| p.version), Some(20));
        // A jump of the minimum clock over two boundaries (an eviction): the largest one crossed is due.
        assert_eq!(s.due_snapshot(19), None);
        assert_eq!(s.due_snapshot(27), Some(25));
        // Bookkeeping started at clock 57 (a shard restored from disk) snapshots from 60 on, never as round 55.
        let late = RollbackState::new(&cfg(5, 2), 0, 57);
        assert_eq!(late.due_snapshot(57), None);
        assert_eq!(late.due_snapshot(61), Some(60));
    }

    #[test]
    fn completed_rounds_feed_their_median_and_a_spike_alarms_once() {
        let mut s = RollbackState::new(&cfg(10, 3), 0, 0);
        for r in 0..8u64 {
            for w in 0..3u32 {
                // Worker 2 is always far off: the median ignores it.
                s.note_loss(w, r, 0, if w == 2 { 100.0 } else { 1.0 });
            }
            assert_eq!(s.settle(r + 1), None);
        }
        // A report for a round already complete is ignored.
        s.note_loss(0, 3, 0, f32::NAN);
        for r in 8..10u64 {
            for w in 0..3u32 {
                s.note_loss(w, r, 0, 9.0);
            }
        }
        // Both rounds complete at once (an eviction moved the minimum by two): the alarm names the second.
        assert_eq!(
            s.settle(10),
            Some(Alarm {
                round: 9,
                onset: 8,
                min_clock: 10
            })
        );
        assert_eq!(s.settle(10), None);
    }

    #[test]
    fn after_a_rollback_stale_losses_and_later_snapshots_are_dropped() {
        let mut s = RollbackState::new(&cfg(10, 3), 0, 0);
        for r in [0, 10, 20] {
            s.keep_snapshot(point(r));
        }
        s.note_loss(0, 23, 40, 5.0);
        let record = RollbackRecord {
            shard: 0,
            at_round: 22,
            onset: 21,
            to_round: 10,
            from_version: 46,
            snapshot_version: 20,
            version: 47,
            rounds_lost: 13,
        };
        s.rolled_back(&record, 23);
        assert_eq!(s.epoch(), 1);
        assert_eq!(s.snapshot_rounds(), vec![0, 10]);
        assert_eq!(s.stale_before(), 47);
        assert_eq!(s.lr_factor(27), 0.5);
        assert_eq!(s.lr_factor(28), 1.0);
        // The pre-rollback report of round 23 was dropped, and a late one read before the rollback is ignored.
        s.note_loss(1, 23, 46, 7.0);
        s.note_loss(2, 23, 47, 1.0);
        assert!(s.losses.get(&23).is_some_and(|b| b == &vec![(2, 1.0)]));
    }
}

//! The SSP clock table of one shard: which workers are live, the clock of each (its completed push rounds), the
//! minimum clock `m`, the staleness gate for pulls, and the staleness histogram the shard reports. Pulls waiting on
//! the gate are parked by `protocol::ShardProtocol`, which asks [`ClockTable::can_answer`].
//!
//! Deterministic core: no actors, sockets, threads or clocks. Time comes in as `now_ms` arguments and the caller
//! decides when to sweep for silent workers. Invariants:
//! - a live worker's clock only moves forward, by exactly one per [`ClockTable::advance`];
//! - `m` (the minimum over live workers) never decreases: workers (re)join at `max(own clock, m)` and eviction or
//!   leaving can only raise the minimum;
//! - a pull for clock `c` passes [`ClockTable::can_answer`] only when the table is empty or `m ≥ c − s`, so the
//!   clock lead `c − m` of an answered pull never exceeds `s`;
//! - an evicted (silent) worker blocks nobody; it keeps its last clock so that a rejoin never moves it backwards,
//!   also across a checkpoint and restore ([`ClockTable::evicted`], [`ClockTable::restore_evicted`]).

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};
use tether_common::config::Staleness;

/// Why a clock-table operation was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClockError {
    /// The worker never joined (or left).
    #[error("worker {worker} is not in the clock table")]
    UnknownWorker {
        /// The worker.
        worker: u32,
    },
    /// The worker was evicted for silence and must rejoin before it may advance.
    #[error("worker {worker} was evicted and must rejoin")]
    Evicted {
        /// The worker.
        worker: u32,
    },
    /// Clocks move forward by exactly one: the worker claimed a clock other than its current one plus one.
    #[error("worker {worker} advanced to clock {got}, expected {expected}")]
    NotNext {
        /// The worker.
        worker: u32,
        /// Its current clock plus one.
        expected: u64,
        /// The clock it claimed.
        got: u64,
    },
}

/// One worker's row in the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Row {
    /// Completed push rounds.
    clock: u64,
    /// Last time (ms) the worker was heard from.
    last_seen: u64,
    /// False once evicted for silence; the row is kept so a rejoin never moves the clock backwards.
    live: bool,
}

/// Clocks of the workers known to one shard and the SSP gate over them.
#[derive(Debug, Clone)]
pub struct ClockTable {
    staleness: Staleness,
    timeout_ms: u64,
    rows: BTreeMap<u32, Row>,
    live: usize,
    /// The minimum clock over live workers; when none is live, the last such minimum (the low-water mark).
    min: u64,
}

impl ClockTable {
    /// An empty table with staleness bound `staleness`; workers silent for `timeout_ms` are evicted by
    /// [`evict_silent`](Self::evict_silent).
    pub fn new(staleness: Staleness, timeout_ms: u64) -> Self {
        Self {
            staleness,
            timeout_ms,
            rows: BTreeMap::new(),
            live: 0,
            min: 0,
        }
    }

    /// The staleness bound this table enforces.
    pub fn staleness(&self) -> Staleness {
        self.staleness
    }

    /// The silence after which a worker is evicted, in milliseconds.
    pub fn timeout_ms(&self) -> u64 {
        self.timeout_ms
    }

    /// (Re)joins `worker` and returns its starting clock: `max(own clock, m)`, so a new or returning worker starts at
    /// the current minimum and a worker that is ahead (live, or evicted while ahead) never moves backwards.
    pub fn join(&mut self, worker: u32, now_ms: u64) -> u64 {
        let m = self.min;
        let row = self.rows.entry(worker).or_insert(Row {
            clock: m,
            last_seen: now_ms,
            live: false,
        });
        row.clock = row.clock.max(m);
        row.last_seen = row.last_seen.max(now_ms);
        let clock = row.clock;
        if !row.live {
            row.live = true;
            self.live += 1;
        }
        self.recompute_min();
        clock
    }

    /// Records that `worker` is alive at `now_ms`; ignored for workers that are not live (they must [`join`](Self::join)).
    pub fn heartbeat(&mut self, worker: u32, now_ms: u64) {
        if let Some(row) = self.rows.get_mut(&worker) {
            if row.live {
                row.last_seen = row.last_seen.max(now_ms);
            }
        }
    }

    /// `worker` finished round `clock − 1` (its push is applied) and is now at `clock`, which must be its current
    /// clock plus one. Also counts as a heartbeat.
    pub fn advance(&mut self, worker: u32, clock: u64, now_ms: u64) -> Result<(), ClockError> {
        let row = self
            .rows
            .get_mut(&worker)
            .ok_or(ClockError::UnknownWorker { worker })?;
        if !row.live {
            return Err(ClockError::Evicted { worker });
        }
        let expected = row.clock.saturating_add(1);
        if clock != expected {
            return Err(ClockError::NotNext {
                worker,
                expected,
                got: clock,
            });
        }
        let was_min = row.clock == self.min;
        row.clock = clock;
        row.last_seen = row.last_seen.max(now_ms);
        if was_min {
            self.recompute_min();
        }
        Ok(())
    }

    /// Removes `worker` entirely (graceful leave); a later [`join`](Self::join) starts it at the current `m`.
    pub fn leave(&mut self, worker: u32) {
        if let Some(row) = self.rows.remove(&worker) {
            if row.live {
                self.live -= 1;
                self.recompute_min();
            }
        }
    }

    /// Evicts every live worker silent for at least `timeout_ms` (`now_ms − last_seen ≥ timeout_ms`) and returns
    /// them in ascending order. Evicted workers block nobody until they rejoin.
    pub fn evict_silent(&mut self, now_ms: u64) -> Vec<u32> {
        let mut evicted = Vec::new();
        for (&worker, row) in &mut self.rows {
            if row.live && now_ms.saturating_sub(row.last_seen) >= self.timeout_ms {
                row.live = false;
                evicted.push(worker);
            }
        }
        if !evicted.is_empty() {
            self.live -= evicted.len();
            self.recompute_min();
        }
        evicted
    }

    /// `m`, the minimum clock over live workers. With no live worker it is the low-water mark: the last minimum
    /// while some worker was live (0 for a fresh table), which is also the clock a newcomer would join at. It is
    /// never `u64::MAX`; use [`can_answer`](Self::can_answer), which treats an empty table as never blocking.
    pub fn min_clock(&self) -> u64 {
        self.min
    }

    /// The clock of `worker` if it is live.
    pub fn clock_of(&self, worker: u32) -> Option<u64> {
        self.rows
            .get(&worker)
            .filter(|row| row.live)
            .map(|row| row.clock)
    }

    /// Whether `worker` is live (joined and not evicted).
    pub fn is_live(&self, worker: u32) -> bool {
        self.rows.get(&worker).is_some_and(|row| row.live)
    }

    /// Whether `worker` is known but evicted for silence.
    pub fn is_evicted(&self, worker: u32) -> bool {
        self.rows.get(&worker).is_some_and(|row| !row.live)
    }

    /// Number of live workers.
    pub fn live(&self) -> usize {
        self.live
    }

    /// `(worker, clock)` of every live worker, in ascending worker order (for checkpoints and reports).
    pub fn clocks(&self) -> impl Iterator<Item = (u32, u64)> + '_ {
        self.rows
            .iter()
            .filter(|(_, row)| row.live)
            .map(|(&w, row)| (w, row.clock))
    }

    /// `(worker, clock)` of every worker evicted for silence, in ascending worker order (checkpoints keep them, so
    /// that a rejoin after a restore never moves one backwards).
    pub fn evicted(&self) -> impl Iterator<Item = (u32, u64)> + '_ {
        self.rows
            .iter()
            .filter(|(_, row)| !row.live)
            .map(|(&w, row)| (w, row.clock))
    }

    /// The SSP gate: a pull for clock `pull_clock` may be answered now (`m ≥ pull_clock − s`; always with an
    /// unbounded bound or when no worker is live).
    pub fn can_answer(&self, pull_clock: u64) -> bool {
        match self.staleness {
            Staleness::Unbounded => true,
            Staleness::Bounded(s) => {
                self.live == 0 || self.min >= pull_clock.saturating_sub(u64::from(s))
            }
        }
    }

    /// The clock lead `worker_clock − m` (saturating at 0); 0 when no worker is live (there is nobody to lead).
    pub fn lead(&self, worker_clock: u64) -> u64 {
        if self.live == 0 {
            0
        } else {
            worker_clock.saturating_sub(self.min)
        }
    }

    /// Raises a live worker's clock to `clock` (never lowers it): a worker announcing its clock after a server
    /// restart, or after refusing to push a round. Unknown or evicted workers are joined first.
    pub fn raise(&mut self, worker: u32, clock: u64, now_ms: u64) {
        self.join(worker, now_ms);
        if let Some(row) = self.rows.get_mut(&worker) {
            row.clock = row.clock.max(clock);
        }
        self.recompute_min();
    }

    /// Restores a worker's clock from a checkpoint manifest: the worker is live as of `now_ms` at `clock`, so a
    /// restarted shard waits for it (up to the timeout) exactly as before the crash.
    pub fn restore(&mut self, worker: u32, clock: u64, now_ms: u64) {
        let row = self.rows.entry(worker).or_insert(Row {
            clock,
            last_seen: now_ms,
            live: false,
        });
        row.clock = clock;
        row.last_seen = now_ms;
        if !row.live {
            row.live = true;
            self.live += 1;
        }
        self.recompute_min();
    }

    /// Restores the row of a worker that was evicted when the checkpoint was taken: it stays evicted (it blocks
    /// nobody) and keeps `clock`, so that its rejoin never moves it below rounds the checkpoint's weights hold. A
    /// worker already in the table keeps its row.
    pub fn restore_evicted(&mut self, worker: u32, clock: u64, now_ms: u64) {
        self.rows.entry(worker).or_insert(Row {
            clock,
            last_seen: now_ms,
            live: false,
        });
    }

    fn recompute_min(&mut self) {
        if let Some(m) = self
            .rows
            .values()
            .filter(|row| row.live)
            .map(|row| row.clock)
            .min()
        {
            self.min = m;
        }
        // With nobody live the low-water mark stays where it was.
    }
}

/// Inclusive upper bounds of the histogram buckets: 0, 1, 2, 3, 4, 5–7, 8–15, 16–31, 32–63, 64+.
const UPPER: [u64; 10] = [0, 1, 2, 3, 4, 7, 15, 31, 63, u64::MAX];

/// One histogram bucket: values in `lower..=upper` (`upper == u64::MAX` for the open last bucket).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bucket {
    /// Smallest value counted here.
    pub lower: u64,
    /// Largest value counted here (`u64::MAX` for the last bucket).
    pub upper: u64,
    /// Values recorded in this bucket.
    pub count: u64,
}

impl Bucket {
    /// A human label: `"3"`, `"5-7"`, `"64+"`.
    pub fn label(&self) -> String {
        self.to_string()
    }
}

impl fmt::Display for Bucket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.upper == u64::MAX {
            write!(f, "{}+", self.lower)
        } else if self.lower == self.upper {
            write!(f, "{}", self.lower)
        } else {
            write!(f, "{}-{}", self.lower, self.upper)
        }
    }
}

/// Histogram of gradient staleness (in updates) with fixed buckets 0, 1, 2, 3, 4, 5–7, 8–15, 16–31, 32–63, 64+.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StalenessHistogram {
    buckets: [Bucket; 10],
    count: u64,
    sum: u64,
    max: u64,
}

impl Default for StalenessHistogram {
    fn default() -> Self {
        Self::new()
    }
}

impl StalenessHistogram {
    /// An empty histogram.
    pub fn new() -> Self {
        let mut buckets = [Bucket {
            lower: 0,
            upper: 0,
            count: 0,
        }; 10];
        let mut lower = 0;
        for (b, &upper) in buckets.iter_mut().zip(UPPER.iter()) {
            b.lower = lower;
            b.upper = upper;
            lower = upper.saturating_add(1);
        }
        Self {
            buckets,
            count: 0,
            sum: 0,
            max: 0,
        }
    }

    /// The buckets in run-report form (`hi = None` for the open last bucket).
    pub fn report_buckets(&self) -> Vec<tether_common::report::HistogramBucket> {
        self.buckets
            .iter()
            .map(|b| tether_common::report::HistogramBucket {
                lo: b.lower,
                hi: (b.upper != u64::MAX).then_some(b.upper),
                count: b.count,
            })
            .collect()
    }

    /// Counts one observation.
    pub fn record(&mut self, staleness: u64) {
        let i = UPPER.partition_point(|&u| u < staleness);
        // partition_point ≤ 9 because the last bound is u64::MAX ≥ every value.
        self.buckets[i].count += 1;
        self.count += 1;
        self.sum = self.sum.saturating_add(staleness);
        self.max = self.max.max(staleness);
    }

    /// Largest value recorded (0 when empty).
    pub fn max(&self) -> u64 {
        self.max
    }

    /// Number of values recorded.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Sum of values recorded (saturating).
    pub fn sum(&self) -> u64 {
        self.sum
    }

    /// Mean of values recorded (0 when empty).
    pub fn mean(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.sum as f64 / self.count as f64
        }
    }

    /// The buckets in ascending order.
    pub fn buckets(&self) -> &[Bucket] {
        &self.buckets
    }

    /// Adds every observation of `other` (e.g. to combine shards).
    pub fn merge(&mut self, other: &StalenessHistogram) {
        for (a, b) in self.buckets.iter_mut().zip(other.buckets.iter()) {
            a.count += b.count;
        }
        self.count += other.count;
        self.sum = self.sum.saturating_add(other.sum);
        self.max = self.max.max(other.max);
    }
}

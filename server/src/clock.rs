//! The SSP clock table of one shard: which workers are live, the clock of each (its completed push rounds), the
//! minimum clock `m`, the staleness gate for pulls, and the staleness histogram the shard reports. Pulls waiting on
//! the gate are parked by `protocol::ShardProtocol`, which asks [`ClockTable::can_answer`].
//!
//! Deterministic core: no actors, sockets, threads or clocks. Time comes in as `now_ms` arguments and the caller
//! decides when to sweep for silent workers. Invariants:
//! - a live worker's clock only moves forward, by exactly one per [`ClockTable::advance`];
//! - a newcomer joins at the **join value**: `m` while some worker is live, otherwise the **floor**. A returning
//!   worker joins at `max(own row, join value)`, so it never moves backwards;
//! - the floor is the last minimum that held over at least two live workers (0 for a fresh table, the restored
//!   minimum after a restore): one worker alone, whatever it claims, pushes or skips, never moves it, so the clock
//!   of a departed (goodbye) or evicted worker never becomes the value newcomers join at;
//! - a hello's clock claim is taken only up to [`ClockTable::claim_bound`]: the highest clock of the *other* live
//!   workers (or the floor when none is live) plus `s + 1` (plus 1 when unbounded); a larger claim rejoins at `max(own row, join value)`
//!   (the worker fills the gap with skip markers). A lone live member is the whole membership and may advance by
//!   its own rounds; its clock is the join value only while it is live;
//! - a round (push or skip) at clock `c` is taken only when `c ≤ m + s + 1` ([`ClockTable::may_take`]); an honest
//!   worker pulls at `c` (gated by `m ≥ c − s`) before it pushes `c`, and the worker at `m` is never refused, so
//!   catching up always progresses;
//! - while some worker is live, `m` never decreases (joins are at `≥ m`, eviction and leaving only raise it); with
//!   nobody live it falls back to the floor;
//! - a pull for clock `c` passes [`ClockTable::can_answer`] only when the table is empty or `m ≥ c − s`, so the
//!   clock lead `c − m` of an answered pull never exceeds `s`;
//! - an evicted (silent or stalled) worker blocks nobody; it keeps its last clock so that a rejoin never moves it
//!   backwards, also across a checkpoint and restore ([`ClockTable::evicted`], [`ClockTable::restore_evicted`]);
//! - every clock in the table is at most [`MAX_CLOCK`]; a restore beyond it is refused ([`ClockError::Unbounded`]);
//! - with quorum rounds ([`crate::quorum`], `cluster.quorum` > 0) the pull gate, the round bound and the clock lead
//!   use the **gate** ([`ClockTable::gate`]: `m`, or the first round not yet closed when that is higher) instead of
//!   `m`; the gate never moves back while a worker is live, and the join value stays `m`. With the default quorum
//!   the gate is `m`, and every rule above reads as written.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};
use tether_common::config::Staleness;

use crate::quorum::{QuorumSettings, RoundCloser, Settled};
use crate::serde_adapters::staleness;

/// The largest clock the table holds or a peer may claim. Far beyond any real run (2^48 rounds), it keeps every
/// `clock + 1` and `clock + s + 1` on peer-supplied values inside u64.
pub const MAX_CLOCK: u64 = 1 << 48;

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
    /// A restored clock beyond [`MAX_CLOCK`] (a checkpoint no honest run can have written).
    #[error("restored clock {clock} of worker {worker} exceeds the maximum {MAX_CLOCK}")]
    Unbounded {
        /// The worker.
        worker: u32,
        /// The clock in the snapshot.
        clock: u64,
    },
}

/// One worker's row in the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct Row {
    /// Completed push rounds.
    clock: u64,
    /// Last time (ms) the worker was heard from.
    last_seen: u64,
    /// False once evicted for silence; the row is kept so a rejoin never moves the clock backwards.
    live: bool,
    /// Last time (ms) the clock moved or the worker (re)joined: the progress deadline counts from here.
    progressed: u64,
}

/// Clocks of the workers known to one shard and the SSP gate over them.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ClockTable {
    #[serde(with = "staleness")]
    staleness: Staleness,
    timeout_ms: u64,
    rows: BTreeMap<u32, Row>,
    live: usize,
    /// The minimum clock over live workers; when none is live, the floor.
    min: u64,
    /// The join value with nobody live: the last minimum over at least two live workers (see the invariants).
    floor: u64,
    /// Which rounds are closed (quorum rounds); with the default quorum the gate is `min` itself.
    rounds: RoundCloser,
    /// The latest `now_ms` seen, for changes that carry no time (a leave).
    now_ms: u64,
}

impl ClockTable {
    /// Checks a decoded table (a peer's state image): the live count matches the rows and the quorum state is
    /// well formed.
    pub(crate) fn check(&self) -> Result<(), String> {
        let live = self.rows.values().filter(|r| r.live).count();
        if live != self.live {
            return Err(format!("{} live rows counted as {}", live, self.live));
        }
        self.rounds.check()
    }

    /// An empty table with staleness bound `staleness`; workers silent for `timeout_ms` are evicted by
    /// [`evict_silent`](Self::evict_silent).
    pub fn new(staleness: Staleness, timeout_ms: u64) -> Self {
        Self {
            staleness,
            timeout_ms,
            rows: BTreeMap::new(),
            live: 0,
            min: 0,
            floor: 0,
            rounds: RoundCloser::new(QuorumSettings::all(timeout_ms)),
            now_ms: 0,
        }
    }

    /// Sets how rounds close (`cluster.quorum`, `cluster.grace_factor`; see [`crate::quorum`]).
    pub fn set_quorum(&mut self, settings: QuorumSettings) {
        self.rounds.set_settings(settings);
        self.settle(self.now_ms);
    }

    /// The quorum state: settings, grace window, quorum closes.
    pub fn rounds(&self) -> &RoundCloser {
        &self.rounds
    }

    /// Where the SSP gate stands: `m`, or with quorum rounds the first round not yet closed, which may be above `m`
    /// (the workers below it are laggards nobody waits for). The floor when nobody is live.
    pub fn gate(&self) -> u64 {
        if self.live == 0 {
            self.floor
        } else if self.rounds.is_partial() {
            self.rounds.gate(self.min)
        } else {
            self.min
        }
    }

    /// When the open round's grace window ends (call [`settle`](Self::settle) then); `None` when no round waits on
    /// one.
    pub fn deadline(&self) -> Option<u64> {
        self.rounds.deadline()
    }

    /// Closes the rounds that may close at `now_ms` (a no-op with the default quorum beyond following `m`). Every
    /// change that carries a time calls it; the shell calls it again at [`deadline`](Self::deadline).
    pub fn settle(&mut self, now_ms: u64) -> Settled {
        self.now_ms = self.now_ms.max(now_ms);
        if self.live == 0 {
            // Nobody is live: the next member joins at the floor, and rounds close again from there.
            self.rounds.reset(self.floor);
            return Settled::default();
        }
        let live = self
            .rows
            .values()
            .filter(|row| row.live)
            .map(|row| row.clock);
        self.rounds.settle(live, self.min, self.now_ms)
    }

    /// The staleness bound this table enforces.
    pub fn staleness(&self) -> Staleness {
        self.staleness
    }

    /// The silence after which a worker is evicted, in milliseconds.
    pub fn timeout_ms(&self) -> u64 {
        self.timeout_ms
    }

    /// The clock a newcomer joins at now: `m` while some worker is live, the floor otherwise. Not the gate: with
    /// quorum rounds one member (a quorum of 1) could run the gate up alone, and newcomers would jump over rounds.
    pub fn join_value(&self) -> u64 {
        if self.live == 0 {
            self.floor
        } else {
            self.min
        }
    }

    /// The floor: the clock newcomers join at when nobody is live (see the module's invariants).
    pub fn floor(&self) -> u64 {
        self.floor
    }

    /// The largest clock a hello of `worker` may claim: the highest clock of the *other* live workers, or the floor
    /// when none is live, plus `s + 1` (plus 1 when staleness is unbounded: nothing gates a worker there, so
    /// nothing lets one be ahead of every other; capped at [`MAX_CLOCK`]). The claimant's own row never raises it,
    /// so repeated hellos cannot climb.
    pub fn claim_bound(&self, worker: u32) -> u64 {
        let ahead = match self.staleness {
            Staleness::Bounded(s) => u64::from(s) + 1,
            Staleness::Unbounded => 1,
        };
        let base = self
            .rows
            .iter()
            .filter(|(w, row)| **w != worker && row.live)
            .map(|(_, row)| row.clock)
            .max()
            .unwrap_or(self.floor);
        base.saturating_add(ahead).min(MAX_CLOCK)
    }

    /// Whether a round (push or skip) at `clock` may be taken now: `clock ≤ m + s + 1` (always when unbounded or
    /// nobody is live). The worker at `m` is never refused.
    pub fn may_take(&self, clock: u64) -> bool {
        match self.staleness {
            Staleness::Unbounded => true,
            Staleness::Bounded(s) => {
                self.live == 0 || clock <= self.gate().saturating_add(u64::from(s) + 1)
            }
        }
    }

    /// (Re)joins `worker` and returns its starting clock: `max(own clock, join value)`, so a new or returning worker
    /// starts at the current minimum (the floor when nobody is live) and a worker that is ahead (live, or evicted
    /// while ahead) never moves backwards.
    pub fn join(&mut self, worker: u32, now_ms: u64) -> u64 {
        let j = self.join_value();
        let row = self.rows.entry(worker).or_insert(Row {
            clock: j,
            last_seen: now_ms,
            live: false,
            progressed: now_ms,
        });
        row.clock = row.clock.max(j);
        row.last_seen = row.last_seen.max(now_ms);
        row.progressed = row.progressed.max(now_ms);
        let clock = row.clock;
        if !row.live {
            row.live = true;
            self.live += 1;
        }
        self.recompute_min();
        self.settle(now_ms);
        clock
    }

    /// (Re)joins `worker` claiming clock `claim` (a hello): the claim is taken when it is at most
    /// [`claim_bound`](Self::claim_bound), otherwise the worker rejoins at `max(own clock, join value)` (it then
    /// fills the rounds up to its claim with skip markers). Returns its clock.
    pub fn join_claiming(&mut self, worker: u32, claim: u64, now_ms: u64) -> u64 {
        let bound = self.claim_bound(worker);
        let joined = self.join(worker, now_ms);
        if claim > joined && claim <= bound {
            if let Some(row) = self.rows.get_mut(&worker) {
                row.clock = claim;
            }
            self.recompute_min();
            self.settle(now_ms);
            return claim;
        }
        joined
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
        row.progressed = row.progressed.max(now_ms);
        if was_min {
            self.recompute_min();
        }
        self.settle(now_ms);
        Ok(())
    }

    /// Removes `worker` entirely (graceful leave); a later [`join`](Self::join) starts it at the current `m`.
    pub fn leave(&mut self, worker: u32) {
        if let Some(row) = self.rows.remove(&worker) {
            if row.live {
                self.live -= 1;
                self.recompute_min();
                self.settle(self.now_ms);
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
            self.settle(now_ms);
        }
        evicted
    }

    /// Evicts every live worker that holds the gate (its clock is [`gate`](Self::gate): `m`, or the open quorum
    /// round) and has not moved for `progress_timeout_ms` (`now_ms − progressed ≥ progress_timeout_ms`) while some
    /// other live worker is ahead of it, and returns them in ascending order. The caller decides when this applies
    /// (a pull waiting on the gate): a member that only heartbeats cannot hold the gate for ever. Evicted workers
    /// keep their rows, like silent ones.
    pub fn evict_stalled(&mut self, now_ms: u64, progress_timeout_ms: u64) -> Vec<u32> {
        let m = self.gate();
        let ahead = self.rows.values().any(|row| row.live && row.clock > m);
        if self.live == 0 || !ahead {
            return Vec::new();
        }
        let mut evicted = Vec::new();
        for (&worker, row) in &mut self.rows {
            if row.live
                && row.clock == m
                && now_ms.saturating_sub(row.progressed) >= progress_timeout_ms
            {
                row.live = false;
                evicted.push(worker);
            }
        }
        if !evicted.is_empty() {
            self.live -= evicted.len();
            self.recompute_min();
            self.settle(now_ms);
        }
        evicted
    }

    /// `m`, the minimum clock over live workers. With no live worker it is the floor, the clock a newcomer would
    /// join at (see the module's invariants). It is never `u64::MAX`; use [`can_answer`](Self::can_answer), which
    /// treats an empty table as never blocking.
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
                self.live == 0 || self.gate() >= pull_clock.saturating_sub(u64::from(s))
            }
        }
    }

    /// The clock lead `worker_clock − m` (saturating at 0); 0 when no worker is live (there is nobody to lead).
    pub fn lead(&self, worker_clock: u64) -> u64 {
        if self.live == 0 {
            0
        } else {
            worker_clock.saturating_sub(self.gate())
        }
    }

    /// Restores a worker's clock from a checkpoint manifest: the worker is live as of `now_ms` at `clock`, so a
    /// restarted shard waits for it (up to the timeout) exactly as before the crash. A clock beyond [`MAX_CLOCK`]
    /// is refused and changes nothing. The floor becomes the restored minimum once two workers are restored.
    pub fn restore(&mut self, worker: u32, clock: u64, now_ms: u64) -> Result<(), ClockError> {
        if clock > MAX_CLOCK {
            return Err(ClockError::Unbounded { worker, clock });
        }
        let row = self.rows.entry(worker).or_insert(Row {
            clock,
            last_seen: now_ms,
            live: false,
            progressed: now_ms,
        });
        row.clock = clock;
        row.last_seen = now_ms;
        row.progressed = now_ms;
        if !row.live {
            row.live = true;
            self.live += 1;
        }
        self.recompute_min();
        self.now_ms = self.now_ms.max(now_ms);
        self.rounds.reset(self.min);
        Ok(())
    }

    /// Restores the row of a worker that was evicted when the checkpoint was taken: it stays evicted (it blocks
    /// nobody) and keeps `clock`, so that its rejoin never moves it below rounds the checkpoint's weights hold. A
    /// worker already in the table keeps its row; a clock beyond [`MAX_CLOCK`] is refused and changes nothing.
    pub fn restore_evicted(
        &mut self,
        worker: u32,
        clock: u64,
        now_ms: u64,
    ) -> Result<(), ClockError> {
        if clock > MAX_CLOCK {
            return Err(ClockError::Unbounded { worker, clock });
        }
        self.rows.entry(worker).or_insert(Row {
            clock,
            last_seen: now_ms,
            live: false,
            progressed: now_ms,
        });
        Ok(())
    }

    fn recompute_min(&mut self) {
        let mut live = self
            .rows
            .values()
            .filter(|row| row.live)
            .map(|row| row.clock);
        match live.next() {
            Some(first) => {
                self.min = live.fold(first, u64::min);
                // One worker alone never moves the floor: only a minimum over two or more is evidence.
                if self.live >= 2 {
                    self.floor = self.floor.max(self.min);
                }
            }
            None => self.min = self.floor,
        }
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

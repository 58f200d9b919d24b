//! `ShardCore`: the deterministic state machine of one parameter shard — its weights, optimizer state, version and
//! SSP clock table. It validates and applies pushes, gates pulls, and snapshots for checkpoints. No actors, sockets or
//! clocks: time comes in as `now_ms`. A rejected push leaves every bit of state untouched (validation and decoding
//! happen into scratch space before the optimizer runs). The `ShardActor` is a thin shell around this.
//!
//! Decoding, the norm, the optimizer step and the public copy's cuts run in chunks on the shard's threads
//! ([`ShardCore::set_pool`]): chunk boundaries come from the frame and the range, never from the thread count, and
//! reductions add chunk results in chunk order, so the state is the same bits at any count.
//!
//! In local-step rounds with `optimizer.outer.at_close` ([`ShardCore::set_outer_at_close`]) a push is not stepped
//! when it comes: its scaled pseudo-gradient is added to its round's sum, and the optimizer takes one step on that
//! sum when the round closes (the gate passes it, or nobody is left live to close it), as DiLoCo steps once per round
//! on the mean. A push whose round already closed (a laggard's) joins the lowest open round of the same fragment. The
//! sums are state: they go into checkpoints and state images, and a restore brings them back.
//!
//! With loss-spike rollback on ([`ShardCore::set_rollback`]), every clock move settles the rounds the minimum clock
//! passed: their reported losses go to the spike detector, a snapshot is kept at each boundary, and an alarm restores
//! weights and optimizer state from the snapshot of the same round on every shard (see [`crate::rollback`]).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ops::Range;
use std::sync::Arc;

use tether_common::chunk_pool::{ChunkPool, CHUNK_VALUES};
use tether_common::codec::{CodecConfig, CodecError, Decoder, Rounding, Scheme};
use tether_common::config::{OptimizerConfig, RollbackConfig, Staleness};
use tether_common::layout::{fragment_part, Layout};
use tether_common::protocol::{ErrorCode, InitialCut, PublicRef};

use crate::checkpoint::ShardSnapshot;
use crate::clock::{ClockError, ClockTable, StalenessHistogram};
use crate::decode::decode_and_square;
use crate::norm_guard::{GuardRefusal, GuardSettings, NormGuard};
use crate::optim::{OptimError, Optimizer};
use crate::public::{Answer, PublicCopy};
use crate::rollback::{Alarm, RollbackPoint, RollbackRecord, RollbackState};

/// Bytes of delta log a shard keeps per parameter (older cuts are dropped; a worker behind them gets the whole copy).
pub const DELTA_LOG_BYTES_PER_PARAM: usize = 2;

/// The default codec of pull deltas: q4 with deterministic rounding and zstd.
pub fn default_pull_codec() -> CodecConfig {
    CodecConfig {
        scheme: Scheme::Q4,
        bucket: 512,
        rounding: Rounding::Deterministic,
        zstd: true,
        keep: tether_common::codec::DEFAULT_KEEP,
    }
}

/// A delta pull's answer: the newest cut, the shard version it was taken at, and what to send.
#[derive(Debug, Clone)]
pub struct PublicAnswer {
    /// The cut the worker will hold.
    pub newest: PublicRef,
    /// Shard version at that cut.
    pub version: u64,
    /// What to send.
    pub answer: Answer,
}

/// Why a push or pull was refused. Each maps to a stable wire error code.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum ShardError {
    /// The frame names another shard.
    #[error("push for shard {found}, this is shard {expected}")]
    WrongShard {
        /// This shard.
        expected: u32,
        /// The shard named in the frame.
        found: u32,
    },
    /// The frame's range is not this shard's range.
    #[error("push range {found:?} does not match shard range {expected:?}")]
    BadRange {
        /// This shard's range.
        expected: Range<u64>,
        /// The frame's range.
        found: Range<u64>,
    },
    /// The codec frame is malformed, of the wrong length, or carries non-finite values.
    #[error("bad gradient frame: {0}")]
    Codec(String),
    /// The decoded gradient holds NaN or ±Inf.
    #[error("non-finite gradient value at index {0}")]
    NonFinite(usize),
    /// A push, pull or rejoin names a clock the worker cannot have reached.
    #[error("clock {found} from worker {worker} is ahead of what its clock {expected} allows")]
    ClockFromFuture {
        /// The worker.
        worker: u32,
        /// The clock the shard expects.
        expected: u64,
        /// The clock in the frame.
        found: u64,
    },
    /// A push or pull names a clock the worker has already passed.
    #[error("clock {found} from worker {worker} is behind its clock {expected} (a replay)")]
    Replay {
        /// The worker.
        worker: u32,
        /// The clock the shard expects.
        expected: u64,
        /// The clock in the frame.
        found: u64,
    },
    /// The push's read version is newer than this shard's version.
    #[error("read version {found} is ahead of shard version {current}")]
    VersionFromFuture {
        /// Shard version.
        current: u64,
        /// Version claimed by the worker.
        found: u64,
    },
    /// The worker has not joined (or was evicted and has not rejoined).
    #[error("worker {0} is not a live member of this shard")]
    NotMember(u32),
    /// The gradient norm is far beyond the workers' recent medians (numerical guard, relative limit).
    #[error("gradient norm {norm:.3e} exceeds {limit:.3e} (spike guard)")]
    NormSpike {
        /// Norm of the rejected gradient.
        norm: f32,
        /// The limit it broke.
        limit: f32,
    },
    /// The gradient norm is above what an honest push can have (numerical guard, absolute bound).
    #[error("gradient norm {norm:.3e} exceeds the bound {bound:.3e}")]
    NormBound {
        /// Norm of the rejected gradient.
        norm: f32,
        /// The bound.
        bound: f32,
    },
    /// Applying the push would leave a weight or an optimizer state value NaN or ±∞; nothing was changed.
    #[error("the update would leave the shard's state non-finite")]
    NonFiniteState,
    /// Too many pulls are parked already.
    #[error("too many parked pulls")]
    Overloaded,
    /// The push was computed from parameters a loss-spike rollback discarded.
    #[error("read version {found} predates the rollback at version {since}")]
    RolledBack {
        /// The version the rollback produced.
        since: u64,
        /// Version the worker read.
        found: u64,
    },
    /// The message came on a connection a newer hello of the same worker replaced.
    #[error("worker {0} spoke on a connection its newer session superseded")]
    Superseded(u32),
    /// This process is a standby that follows its primary: it serves nobody until it takes over.
    #[error("this is a standby following its primary: try the shard's other address")]
    NotPrimary,
    /// The rank is not one of the configured workers (`0..workers`, or `0..max_workers` with elastic membership).
    #[error("rank {worker} is not a configured worker (ranks 0..{workers} may join: cluster.workers, or cluster.max_workers)")]
    UnknownRank {
        /// The rank in the hello.
        worker: u32,
        /// The configured number of workers.
        workers: u32,
    },
}

impl From<GuardRefusal> for ShardError {
    fn from(r: GuardRefusal) -> Self {
        match r {
            GuardRefusal::Bound { norm, bound } => ShardError::NormBound { norm, bound },
            GuardRefusal::Spike { norm, limit } => ShardError::NormSpike { norm, limit },
        }
    }
}

/// Why a checkpoint's snapshot could not be restored (a local failure: nothing changed).
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    /// A clock beyond [`MAX_CLOCK`].
    #[error(transparent)]
    Clock(#[from] ClockError),
    /// Optimizer state of the wrong shape.
    #[error(transparent)]
    Optim(#[from] OptimError),
    /// Open rounds' sums that do not fit the shard (see [`crate::checkpoint::pending_problem`]).
    #[error("open rounds' sums: {0}")]
    Pending(String),
}

impl From<ClockError> for ShardError {
    fn from(e: ClockError) -> Self {
        match e {
            ClockError::UnknownWorker { worker } | ClockError::Evicted { worker } => {
                ShardError::NotMember(worker)
            }
            // Only restores produce it; a peer's clock beyond the maximum is a clock from the future.
            ClockError::Unbounded { worker, clock } => ShardError::ClockFromFuture {
                worker,
                expected: MAX_CLOCK,
                found: clock,
            },
            ClockError::NotNext {
                worker,
                expected,
                got,
            } => {
                if got < expected {
                    ShardError::Replay {
                        worker,
                        expected: expected.saturating_sub(1),
                        found: got.saturating_sub(1),
                    }
                } else {
                    ShardError::ClockFromFuture {
                        worker,
                        expected: expected.saturating_sub(1),
                        found: got.saturating_sub(1),
                    }
                }
            }
        }
    }
}

impl ShardError {
    /// The stable wire code that carries this refusal (the numeric guard's spike counts as non-finite input, a read
    /// version from the future as a clock from the future, a non-member as evicted).
    pub fn code(&self) -> ErrorCode {
        match self {
            ShardError::WrongShard { .. } => ErrorCode::WrongShard,
            ShardError::BadRange { .. } => ErrorCode::BadRange,
            ShardError::Codec(_) => ErrorCode::BadFrame,
            ShardError::NonFinite(_)
            | ShardError::NormSpike { .. }
            | ShardError::NormBound { .. }
            | ShardError::NonFiniteState => ErrorCode::NonFinite,
            ShardError::ClockFromFuture { .. } | ShardError::VersionFromFuture { .. } => {
                ErrorCode::ClockFromFuture
            }
            ShardError::Replay { .. } => ErrorCode::Replay,
            ShardError::NotMember(_) => ErrorCode::Evicted,
            ShardError::Overloaded => ErrorCode::Overloaded,
            ShardError::RolledBack { .. } => ErrorCode::RolledBack,
            ShardError::Superseded(_) => ErrorCode::Superseded,
            ShardError::NotPrimary => ErrorCode::NotPrimary,
            ShardError::UnknownRank { .. } => ErrorCode::Unauthorized,
        }
    }
}

/// Every label [`reject_reason`] returns (the metric's series are created at start, at 0, so that rates and alerts
/// see them before the first rejection).
pub const REJECT_REASONS: [&str; 16] = [
    "wrong_shard",
    "bad_range",
    "bad_frame",
    "non_finite",
    "clock_from_future",
    "replay",
    "version_from_future",
    "not_member",
    "norm_spike",
    "norm_bound",
    "non_finite_state",
    "overloaded",
    "rolled_back",
    "superseded",
    "unknown_rank",
    "not_primary",
];

/// The labels of the numerical guard's refusals (norm bound, norm spike, non-finite state).
pub const GUARD_REASONS: [&str; 3] = ["norm_bound", "norm_spike", "non_finite_state"];

/// Why a push was rejected, as a metric label.
pub fn reject_reason(e: &ShardError) -> &'static str {
    match e {
        ShardError::WrongShard { .. } => "wrong_shard",
        ShardError::BadRange { .. } => "bad_range",
        ShardError::Codec(_) => "bad_frame",
        ShardError::NonFinite(_) => "non_finite",
        ShardError::ClockFromFuture { .. } => "clock_from_future",
        ShardError::Replay { .. } => "replay",
        ShardError::VersionFromFuture { .. } => "version_from_future",
        ShardError::NotMember(_) => "not_member",
        ShardError::NormSpike { .. } => "norm_spike",
        ShardError::NormBound { .. } => "norm_bound",
        ShardError::NonFiniteState => "non_finite_state",
        ShardError::Overloaded => "overloaded",
        ShardError::RolledBack { .. } => "rolled_back",
        ShardError::Superseded(_) => "superseded",
        ShardError::UnknownRank { .. } => "unknown_rank",
        ShardError::NotPrimary => "not_primary",
    }
}

pub use crate::clock::MAX_CLOCK;

/// `clock + 1` for a peer-supplied clock, as a typed error instead of an overflow.
fn next_clock(worker: u32, clock: u64) -> Result<u64, ShardError> {
    clock
        .checked_add(1)
        .filter(|c| *c <= MAX_CLOCK)
        .ok_or(ShardError::ClockFromFuture {
            worker,
            expected: MAX_CLOCK,
            found: clock,
        })
}

/// One gradient push, as the shard sees it (already framed and authenticated by the connection task).
#[derive(Debug, Clone, Copy)]
pub struct Push<'a> {
    /// Pushing worker (from its certificate).
    pub worker: u32,
    /// The worker's clock for this round.
    pub clock: u64,
    /// Target shard.
    pub shard: u32,
    /// Target range in the flat layout.
    pub range: (u64, u64),
    /// Shard version the worker computed its gradient against.
    pub read_version: u64,
    /// The codec frame.
    pub payload: &'a [u8],
}

/// What applying a push did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Applied {
    /// Shard version after the update.
    pub version: u64,
    /// Staleness of the gradient in updates.
    pub staleness: u64,
    /// The worker's clock after the push.
    pub clock: u64,
}

/// Counters a shard keeps for reports and metrics.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct ShardStats {
    /// Updates applied.
    pub updates_applied: u64,
    /// Rejections by reason label.
    #[serde(with = "reasons")]
    pub rejected: HashMap<&'static str, u64>,
    /// Encoded bytes received in accepted and rejected pushes.
    pub wire_bytes: u64,
    /// fp32 bytes those pushes represent.
    pub fp32_bytes: u64,
    /// Bytes of parameter replies sent.
    pub pulled_bytes: u64,
    /// Staleness of applied gradients.
    pub staleness: StalenessHistogram,
    /// Largest clock lead at a pull answer.
    pub max_lead: u64,
    /// Goodbyes taken: workers that finished and left (a rank that leaves twice counts twice).
    pub left: u64,
    /// The distinct ranks that finished and left (what `--exit-after-workers` counts).
    pub finished: BTreeSet<u32>,
    /// Workers evicted for holding the gate without progress (see [`ClockTable::evict_stalled`]).
    pub stalled_evictions: u64,
    /// Loss-spike rollbacks carried out, oldest first.
    pub rollbacks: Vec<RollbackRecord>,
    /// Alarms with no snapshot of the target round to restore.
    pub rollbacks_missed: u64,
    /// Largest gradient norm the guard admitted.
    pub max_push_norm: f32,
    /// Rounds stepped at their close (`optimizer.outer.at_close`).
    pub rounds_stepped: u64,
}

impl ShardStats {
    /// Total rejected updates.
    pub fn rejected_total(&self) -> u64 {
        self.rejected.values().sum()
    }

    /// Updates the numerical guard refused ([`GUARD_REASONS`]).
    pub fn guard_refused(&self) -> u64 {
        GUARD_REASONS
            .iter()
            .filter_map(|r| self.rejected.get(r))
            .sum()
    }

    /// The counters a run report sums over shards.
    pub fn counters(&self) -> tether_common::report::ShardCounters {
        tether_common::report::ShardCounters {
            updates_applied: self.updates_applied,
            updates_rejected: self.rejected_total(),
            guard_refused: self.guard_refused(),
            max_push_norm: self.max_push_norm,
            max_clock_lead: self.max_lead,
        }
    }

    /// The bytes this shard received (pushes) and sent (pull replies); it does not count an f32 reference for
    /// pulls.
    pub fn traffic(&self) -> tether_common::report::Traffic {
        tether_common::report::Traffic {
            wire_bytes_pushed: self.wire_bytes,
            fp32_bytes_pushed: self.fp32_bytes,
            wire_bytes_pulled: self.pulled_bytes,
            fp32_bytes_pulled: 0,
        }
    }
}

/// One shard's state: weights, optimizer, version, clock table.
#[derive(serde::Serialize, serde::Deserialize)]
pub struct ShardCore {
    shard: u32,
    range: Range<u64>,
    layout_hash: u64,
    weights: Vec<f32>,
    optimizer: Optimizer,
    staleness_aware: bool,
    version: u64,
    clocks: ClockTable,
    // Scratch, rebuilt locally after a state image (see `ShardCore::adopt_local`).
    #[serde(skip)]
    decoder: Decoder,
    #[serde(skip)]
    scratch: Vec<f32>,
    /// The threads that decode and apply pushes and cut the public copy, in chunks (local: never in an image).
    #[serde(skip)]
    pool: Arc<ChunkPool>,
    /// The gradient-norm guard, one per streamed fragment (each part's norms have their own scale).
    guards: Vec<NormGuard>,
    /// Streamed fragments (`train.fragments`): push `c` carries part `c mod fragments` of the range.
    fragments: u32,
    /// The hull of the values changed since the public copy's last cut (relative to the range; empty: none).
    dirty: Range<usize>,
    stats: ShardStats,
    /// Restored from a checkpoint: versions of the lost lineage may come back in resent pushes.
    restored: bool,
    /// The public copy answering delta pulls (created at the first one).
    public: Option<PublicCopy>,
    /// Codec of pull deltas.
    pull_codec: CodecConfig,
    /// This incarnation's public-copy lineage.
    lineage: u64,
    /// Every push's step is multiplied by this (1/workers in local-step rounds).
    push_scale: f32,
    /// Scale each push by `min(push_scale, 1/live)` instead of `push_scale`.
    push_scale_per_live: bool,
    /// Step once per round, on the sum of its pushes, when it closes (`optimizer.outer.at_close`).
    at_close: bool,
    /// The sums of the rounds not stepped yet, each over its round's part (see [`ShardCore::set_outer_at_close`]).
    pending: BTreeMap<u64, Vec<f32>>,
    /// The seed of the initial weights while they came from it (`None` once restored from a checkpoint).
    init_seed: Option<u64>,
    /// The initial cut offered in welcomes (see [`ShardCore::initial_cut`]): a promise that cut 0 of its lineage
    /// is the initial weights.
    initial: Option<InitialCut>,
    /// Loss-spike rollback, when enabled.
    rollback: Option<RollbackState>,
    /// Who may join and how long a member may hold the gate without progress.
    membership: Membership,
}

/// Who may join a shard and how long a member may hold the SSP gate without progress (from `[cluster]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Membership {
    /// Ranks `0..workers` may join (`None`: any rank, for tests and benches that build a bare core).
    pub workers: Option<u32>,
    /// A live worker at the minimum clock that has not moved for this long while a pull waits on the gate is
    /// evicted (`cluster.progress_timeout_ms`; `u64::MAX`: never).
    pub progress_timeout_ms: u64,
}

impl Default for Membership {
    fn default() -> Self {
        Self {
            workers: None,
            progress_timeout_ms: u64::MAX,
        }
    }
}

/// Parameters to build a shard.
#[derive(Debug, Clone)]
pub struct ShardSpec {
    /// Shard index.
    pub shard: u32,
    /// Number of shards.
    pub shards: u32,
    /// Seed of the initial weights.
    pub seed: u64,
    /// The optimizer.
    pub optimizer: OptimizerConfig,
    /// SSP bound.
    pub staleness: Staleness,
    /// Eviction timeout.
    pub worker_timeout_ms: u64,
    /// Relative factor of the gradient-norm guard (0 = off); the rest of the guard (bound, floor) comes from
    /// [`ShardCore::set_guard`].
    pub spike_factor: f32,
}

impl ShardCore {
    /// A fresh shard with deterministic initial weights for its range of `layout`.
    pub fn new(layout: &Layout, spec: &ShardSpec) -> Self {
        let r = layout.shard_range(spec.shard as usize, spec.shards as usize);
        let mut weights = vec![0.0; r.len()];
        layout.init_range(spec.seed, r.clone(), &mut weights);
        Self {
            shard: spec.shard,
            range: r.start as u64..r.end as u64,
            layout_hash: layout.hash(),
            optimizer: Optimizer::new(&spec.optimizer, r.len())
                .with_decay_exempt(layout.decay_exempt(r.clone(), spec.optimizer.decay)),
            staleness_aware: spec.optimizer.staleness_aware,
            version: 0,
            clocks: ClockTable::new(spec.staleness, spec.worker_timeout_ms),
            decoder: Decoder::new(r.len()),
            scratch: vec![0.0; r.len()],
            pool: Arc::default(),
            guards: vec![NormGuard::new(GuardSettings::relative(spec.spike_factor))],
            fragments: 1,
            dirty: 0..r.len(),
            stats: ShardStats::default(),
            restored: false,
            public: None,
            pull_codec: default_pull_codec(),
            lineage: layout.hash() ^ u64::from(spec.shard),
            push_scale: 1.0,
            push_scale_per_live: false,
            at_close: false,
            pending: BTreeMap::new(),
            init_seed: Some(spec.seed),
            initial: None,
            rollback: None,
            membership: Membership::default(),
            weights,
        }
    }

    /// Turns loss-spike rollback on (or off: `cfg.enabled = false`). The rounds below the current minimum clock count
    /// as complete; a snapshot is taken now if the minimum clock is a boundary (round 0 for a fresh shard).
    pub fn set_rollback(&mut self, cfg: &RollbackConfig) {
        self.rollback = cfg.enabled.then(|| {
            RollbackState::new(
                cfg,
                RollbackConfig::margin(self.clocks.staleness()),
                self.clocks.min_clock(),
            )
        });
        self.settle_rounds();
    }

    /// Sets who may join and the progress deadline (the node sets them from `[cluster]`).
    pub fn set_membership(&mut self, membership: Membership) {
        self.membership = membership;
    }

    /// Runs the chunked kernels (decode and optimizer step of a push, the public copy's cuts) on `pool` (the node
    /// sets it from `shard.threads`; a bare core runs them inline). The results do not depend on it.
    pub fn set_pool(&mut self, pool: Arc<ChunkPool>) {
        if let Some(p) = self.public.as_mut() {
            p.set_pool(pool.clone());
        }
        self.pool = pool;
    }

    /// The threads the chunked kernels run on.
    pub fn pool(&self) -> &Arc<ChunkPool> {
        &self.pool
    }

    /// Who may join and the progress deadline.
    pub fn membership(&self) -> Membership {
        self.membership
    }

    /// The rollback bookkeeping, when enabled.
    pub fn rollback(&self) -> Option<&RollbackState> {
        self.rollback.as_ref()
    }

    /// Loss-spike rollbacks this shard made: the trajectory epoch pull replies carry.
    pub fn epoch(&self) -> u64 {
        self.rollback.as_ref().map_or(0, RollbackState::epoch)
    }

    /// `worker` reported `loss` for round `clock`, computed from parameters of version `read_version` (every push
    /// and skip marker carries one). Only a live member's report for its current round counts; it is fed to the
    /// spike detector once the round is complete. A no-op without rollback.
    pub fn note_loss(&mut self, worker: u32, clock: u64, read_version: u64, loss: f32) {
        if self.clocks.clock_of(worker) != Some(clock) {
            return;
        }
        if let Some(rb) = self.rollback.as_mut() {
            rb.note_loss(worker, clock, read_version, loss);
        }
    }

    /// Settles the rounds the minimum clock passed since the last call: feeds them to the spike detector, rolls back
    /// on an alarm, and otherwise snapshots at a boundary.
    fn settle_rounds(&mut self) {
        self.step_closed_rounds();
        let m = self.clocks.min_clock();
        let Some(rb) = self.rollback.as_mut() else {
            return;
        };
        if let Some(alarm) = rb.settle(m) {
            self.roll_back(alarm);
        } else if let Some(round) = rb.due_snapshot(m) {
            rb.keep_snapshot(RollbackPoint {
                round,
                taken_at: m,
                version: self.version,
                opt_steps: self.optimizer.steps(),
                weights: self.weights.clone(),
                slots: self.optimizer.slots().to_vec(),
            });
        }
    }

    /// Restores the snapshot the alarm's onset calls for, or counts the alarm as missed when it is not held.
    fn roll_back(&mut self, alarm: Alarm) {
        let Some(rb) = self.rollback.as_mut() else {
            return;
        };
        let target = rb.target(alarm.onset);
        let Some(point) = target.and_then(|t| rb.point(t)) else {
            self.stats.rollbacks_missed += 1;
            tracing::warn!(
                shard = self.shard,
                round = alarm.round,
                onset = alarm.onset,
                ?target,
                held = ?rb.snapshot_rounds(),
                "loss spike, but no snapshot of the target round: not rolled back"
            );
            return;
        };
        if let Err(e) = self.optimizer.restore(point.opt_steps, point.slots.clone()) {
            // Our own snapshot of our own optimizer: only a bug can get here. Nothing was changed.
            self.stats.rollbacks_missed += 1;
            tracing::error!(shard = self.shard, error = %e, "cannot restore the rollback snapshot");
            return;
        }
        if point.taken_at > point.round {
            tracing::warn!(
                shard = self.shard,
                round = point.round,
                taken_at = point.taken_at,
                "restoring a snapshot taken after its boundary (the minimum clock jumped over it)"
            );
        }
        self.weights.copy_from_slice(&point.weights);
        self.dirty = 0..self.weights.len();
        // The open rounds' sums were pushed from the parameters rolled back.
        self.pending.clear();
        let record = RollbackRecord {
            shard: self.shard,
            at_round: alarm.round,
            onset: alarm.onset,
            to_round: point.round,
            from_version: self.version,
            snapshot_version: point.version,
            version: self.version + 1,
            rounds_lost: alarm.min_clock.saturating_sub(point.round),
        };
        self.version = record.version;
        rb.rolled_back(&record, alarm.min_clock);
        // Workers holding the old public copy must not apply deltas to it: a new lineage makes them fetch the whole
        // (restored) copy.
        self.lineage = tether_common::splitmix::splitmix64(self.lineage ^ rb.epoch());
        self.public = None;
        tracing::warn!(
            shard = self.shard,
            round = alarm.round,
            onset = alarm.onset,
            to_round = record.to_round,
            rounds_lost = record.rounds_lost,
            version = record.version,
            "loss spike: rolled back to the snapshot"
        );
        self.stats.rollbacks.push(record);
    }

    /// Sets the codec of pull deltas and starts public-copy lineage `lineage` (a restarted shard must pick one its
    /// previous life did not use, e.g. at random, so that no worker applies a delta to a copy of another life).
    pub fn set_public(&mut self, codec: CodecConfig, lineage: u64) {
        self.set_public_inner(codec, lineage);
    }

    /// This incarnation's public-copy lineage (a standby takes over its primary's).
    pub fn lineage(&self) -> u64 {
        self.lineage
    }

    /// The codec of pull deltas.
    pub fn pull_codec(&self) -> CodecConfig {
        self.pull_codec
    }

    fn set_public_inner(&mut self, codec: CodecConfig, lineage: u64) {
        self.pull_codec = codec;
        self.lineage = lineage;
        self.public = None;
    }

    /// Replaces the gradient-norm guard (forgetting the norms seen): see [`crate::norm_guard`] and
    /// [`GuardSettings::derive`].
    pub fn set_guard(&mut self, settings: GuardSettings) {
        self.guards = vec![NormGuard::new(settings); self.fragments as usize];
    }

    /// The gradient-norm guard's settings.
    pub fn guard(&self) -> GuardSettings {
        self.guards[0].settings()
    }

    /// The guard's relative limit now, the largest over the fragments' guards (`None` while it is off or no worker
    /// is warm).
    pub fn guard_limit(&mut self) -> Option<f32> {
        self.guards
            .iter_mut()
            .filter_map(NormGuard::limit)
            .max_by(f32::total_cmp)
    }

    /// Streams the range in `fragments` parts (`train.fragments`, at least 1): push `c` then carries part
    /// `c mod fragments` ([`tether_common::layout::fragment_part`]) and the outer step applies to that part alone.
    /// Each part gets a guard of its own with the current settings (forgetting the norms seen).
    pub fn set_fragments(&mut self, fragments: u32) {
        // The open rounds' sums are cut again to the new parts (they are restored whole-range).
        let pending = self.pending_whole();
        self.fragments = fragments.max(1);
        let settings = self.guard();
        self.guards = vec![NormGuard::new(settings); self.fragments as usize];
        self.pending = self.cut_pending(pending);
    }

    /// Steps once per round instead of once per push (local-step rounds, `optimizer.outer.at_close`): a push adds
    /// its scaled pseudo-gradient to its round's sum, and the optimizer steps on the sum when the round closes.
    /// Turned off, the sums held (from a restore) are stepped now.
    pub fn set_outer_at_close(&mut self, at_close: bool) {
        self.at_close = at_close;
        self.step_closed_rounds();
    }

    /// Whether the shard steps once per round (see [`set_outer_at_close`](Self::set_outer_at_close)).
    pub fn outer_at_close(&self) -> bool {
        self.at_close
    }

    /// The rounds whose sums wait for their close, lowest first.
    pub fn pending_rounds(&self) -> impl Iterator<Item = u64> + '_ {
        self.pending.keys().copied()
    }

    /// The open rounds' sums over the whole range (zero outside each round's part), lowest round first.
    fn pending_whole(&self) -> Vec<(u64, Vec<f32>)> {
        self.pending
            .iter()
            .map(|(&round, sum)| {
                let mut whole = vec![0.0; self.weights.len()];
                whole[self.part(round)].copy_from_slice(sum);
                (round, whole)
            })
            .collect()
    }

    /// Whole-range sums cut to their rounds' parts (each is as long as the range: checked by the callers).
    fn cut_pending(&self, whole: Vec<(u64, Vec<f32>)>) -> BTreeMap<u64, Vec<f32>> {
        whole
            .into_iter()
            .map(|(round, w)| (round, w[self.part(round)].to_vec()))
            .collect()
    }

    /// The round a push of `clock` joins at close: its own while it is open, otherwise (a laggard's push) the lowest
    /// open round of the same fragment, so that it adds to the same part.
    fn open_round_for(&self, clock: u64) -> u64 {
        let gate = self.clocks.gate();
        if clock >= gate {
            return clock;
        }
        let f = u64::from(self.fragments);
        gate + (clock % f + f - gate % f) % f
    }

    /// Steps the sums of the rounds the gate passed, lowest first (all of them when nobody is live to close them,
    /// or when stepping at close is off); each step is one version. A step the optimizer refuses (it would leave
    /// the state non-finite) changes nothing and is counted as a refused update.
    fn step_closed_rounds(&mut self) {
        let everything = !self.at_close || self.clocks.live() == 0;
        let gate = self.clocks.gate();
        while let Some(entry) = self.pending.first_entry() {
            if !everything && *entry.key() >= gate {
                break;
            }
            let (round, sum) = entry.remove_entry();
            let part = self.part(round);
            match self.optimizer.try_step_part_on(
                &self.pool,
                CHUNK_VALUES,
                part.clone(),
                &mut self.weights,
                &sum,
                1.0,
            ) {
                Ok(()) => {
                    self.mark_dirty(part);
                    self.version += 1;
                    self.stats.rounds_stepped += 1;
                }
                Err(_) => {
                    tracing::warn!(
                        shard = self.shard,
                        round,
                        "the round's outer step would leave the state non-finite: not taken"
                    );
                    *self
                        .stats
                        .rejected
                        .entry(reject_reason(&ShardError::NonFiniteState))
                        .or_default() += 1;
                }
            }
        }
    }

    /// Widens the hull of values changed since the public copy's last cut by `part`.
    fn mark_dirty(&mut self, part: Range<usize>) {
        self.dirty = if self.dirty.is_empty() {
            part
        } else {
            self.dirty.start.min(part.start)..self.dirty.end.max(part.end)
        };
    }

    /// Streamed fragments (1: whole-range pushes).
    pub fn fragments(&self) -> u32 {
        self.fragments
    }

    /// The part of the range (relative to its start) that a push of `clock` carries.
    pub fn part(&self, clock: u64) -> Range<usize> {
        fragment_part(self.weights.len(), clock, self.fragments)
    }

    /// Multiplies every push's step by `scale` (local-step rounds: 1/workers, so that a round of pushes adds up to
    /// the outer step on the mean pseudo-gradient).
    pub fn set_push_scale(&mut self, scale: f32) {
        self.push_scale = scale;
    }

    /// Multiplies every push's step by `min(fixed scale, 1/live)` (local-step rounds with elastic membership: with
    /// joiners beyond `cluster.workers` live, a round's pushes still add up to the outer step on the mean
    /// pseudo-gradient; with fewer live, as at the end of a run, a push keeps its configured share instead of
    /// growing to the whole step: measured, one worker alone at 1/1 took the MLP from 0.89 to 0.82).
    pub fn set_push_scale_per_live(&mut self, per_live: bool) {
        self.push_scale_per_live = per_live;
    }

    /// The public copy, once a delta pull created it.
    pub fn public(&self) -> Option<&PublicCopy> {
        self.public.as_ref()
    }

    /// The initial cut a welcome offers, while one holds: the shard started fresh (not restored) and cut 0 of its
    /// public copy's lineage is the initial weights (the copy not created yet at version 0, or created then). A
    /// promise made here is kept: a public copy created later from other weights takes a new lineage
    /// ([`answer_public`](Self::answer_public)), so a worker claiming the promised cut gets the whole copy.
    pub fn initial_cut(&mut self) -> Option<InitialCut> {
        let seed = self.init_seed?;
        let holds = match &self.public {
            Some(p) => self
                .initial
                .is_some_and(|i| i.lineage == p.newest().lineage),
            None => self.version == 0 && self.initial.is_none_or(|i| i.lineage == self.lineage),
        };
        if !holds {
            return None;
        }
        let lineage = self.lineage;
        let weights = &self.weights;
        Some(*self.initial.get_or_insert_with(|| InitialCut {
            lineage,
            seed,
            crc32: InitialCut::checksum(weights),
        }))
    }

    /// Answers a delta pull from a worker holding `have`: takes a cut first when the policy wants one (see
    /// [`PublicCopy`]), then returns the newest cut and what to send. Call it only for a pull the SSP gate released.
    pub fn answer_public(&mut self, have: Option<PublicRef>) -> Result<PublicAnswer, CodecError> {
        // The gate, not `m`: with quorum rounds a laggard must not keep the copy from being cut each round.
        let min_clock = self.clocks.gate();
        let live = self.clocks.live();
        if self.public.is_none()
            && (self.version != 0 || self.init_seed.is_none())
            && self.initial.is_some_and(|i| i.lineage == self.lineage)
        {
            // A welcome promised that cut 0 of this lineage is the initial weights, and these are not: the copy
            // made now starts a lineage of its own.
            self.lineage = tether_common::splitmix::splitmix64(self.lineage);
        }
        let public = match &mut self.public {
            Some(p) => p,
            None => self.public.insert(
                PublicCopy::new(
                    &self.weights,
                    self.lineage,
                    self.version,
                    min_clock,
                    self.pull_codec,
                    DELTA_LOG_BYTES_PER_PARAM * self.weights.len(),
                )?
                .with_pool(self.pool.clone()),
            ),
        };
        if public.wants_cut(self.version, min_clock, live) {
            public.cut_dirty(&self.weights, self.dirty.clone(), self.version, min_clock)?;
            self.dirty = 0..0;
        }
        Ok(PublicAnswer {
            newest: public.newest(),
            version: public.cut_version(),
            answer: public.answer(have),
        })
    }

    /// Shard index.
    pub fn shard(&self) -> u32 {
        self.shard
    }

    /// The flat range this shard owns.
    pub fn range(&self) -> Range<u64> {
        self.range.clone()
    }

    /// Layout fingerprint.
    pub fn layout_hash(&self) -> u64 {
        self.layout_hash
    }

    /// Updates applied so far.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Current weights.
    pub fn weights(&self) -> &[f32] {
        &self.weights
    }

    /// The clock table.
    pub fn clocks(&self) -> &ClockTable {
        &self.clocks
    }

    /// Counters.
    pub fn stats(&self) -> &ShardStats {
        &self.stats
    }

    /// A worker joins or rejoins; returns its starting clock.
    pub fn join(&mut self, worker: u32, now_ms: u64) -> u64 {
        self.clocks.join(worker, now_ms)
    }

    /// A worker (re)joins claiming it is at `clock` (after a server restart it may be ahead of the restored table).
    /// A rank outside the configured workers, or a claim past [`MAX_CLOCK`], is refused and changes nothing. A claim
    /// up to [`ClockTable::claim_bound`] is taken; a larger one rejoins at `max(own row, join value)` and the worker
    /// fills the gap with skip markers. This explicit rejoin is the only way a clock moves without a push or a skip.
    /// Returns its clock.
    pub fn join_at(&mut self, worker: u32, clock: u64, now_ms: u64) -> Result<u64, ShardError> {
        if let Some(workers) = self.membership.workers.filter(|n| worker >= *n) {
            return Err(ShardError::UnknownRank { worker, workers });
        }
        if clock > MAX_CLOCK {
            return Err(ShardError::ClockFromFuture {
                worker,
                expected: self.clocks.claim_bound(worker),
                found: clock,
            });
        }
        let joined = self.clocks.join_claiming(worker, clock, now_ms);
        if joined < clock {
            tracing::info!(
                shard = self.shard,
                worker,
                claimed = clock,
                joined,
                "clock claim beyond the bound: rejoined at the shard's value"
            );
        }
        self.settle_rounds();
        Ok(joined)
    }

    /// A worker leaves cleanly (it finished): nobody waits on it any more.
    pub fn leave(&mut self, worker: u32) {
        self.clocks.leave(worker);
        self.stats.left += 1;
        self.stats.finished.insert(worker);
        self.settle_rounds();
    }

    /// A worker is alive.
    pub fn heartbeat(&mut self, worker: u32, now_ms: u64) {
        self.clocks.heartbeat(worker, now_ms);
    }

    /// Evicts workers silent for longer than the timeout.
    pub fn evict_silent(&mut self, now_ms: u64) -> Vec<u32> {
        let evicted = self.clocks.evict_silent(now_ms);
        if !evicted.is_empty() {
            self.settle_rounds();
        }
        evicted
    }

    /// Sets how rounds close: the quorum and the grace window (the node sets them from `[cluster]`; see
    /// [`crate::quorum`]).
    pub fn set_quorum(&mut self, settings: crate::quorum::QuorumSettings) {
        self.clocks.set_quorum(settings);
    }

    /// Closes the rounds whose grace window ended by `now_ms` (the shell calls it at
    /// [`ClockTable::deadline`]); returns how many closed.
    pub fn settle(&mut self, now_ms: u64) -> u64 {
        let closed = self.clocks.settle(now_ms).closed;
        self.step_closed_rounds();
        closed
    }

    /// Evicts the workers at the minimum clock that made no progress for the progress deadline (call it while a
    /// pull waits on the gate): a member that heartbeats but never pushes cannot hold the gate for ever.
    pub fn evict_stalled(&mut self, now_ms: u64) -> Vec<u32> {
        let evicted = self
            .clocks
            .evict_stalled(now_ms, self.membership.progress_timeout_ms);
        if !evicted.is_empty() {
            self.stats.stalled_evictions += evicted.len() as u64;
            self.settle_rounds();
        }
        evicted
    }

    /// The worker finished round `clock` without pushing (e.g. it refused a non-finite gradient): advance only.
    pub fn skip(&mut self, worker: u32, clock: u64, now_ms: u64) -> Result<u64, ShardError> {
        self.check_clock(worker, clock)?;
        let next = next_clock(worker, clock)?;
        self.clocks.advance(worker, next, now_ms)?;
        self.settle_rounds();
        Ok(next)
    }

    fn check_clock(&self, worker: u32, clock: u64) -> Result<(), ShardError> {
        let current = self
            .clocks
            .clock_of(worker)
            .ok_or(ShardError::NotMember(worker))?;
        if clock < current {
            return Err(ShardError::Replay {
                worker,
                expected: current,
                found: clock,
            });
        }
        if clock > current || !self.clocks.may_take(clock) {
            return Err(ShardError::ClockFromFuture {
                worker,
                expected: current,
                found: clock,
            });
        }
        Ok(())
    }

    /// Validates, decodes and applies one push. On error the weights, optimizer state and version are untouched;
    /// only for a well-addressed push whose values are refused by the numerical guard (non-finite, norm bound or
    /// spike, a step that would leave the state non-finite), or
    /// that was read before a loss-spike rollback, does the worker's clock still advance, so a worker is never stuck
    /// behind its own refused round. With rollback on, the rounds this push completes are then settled, which may
    /// roll the shard back (the returned version is the update's own).
    pub fn apply(&mut self, push: &Push<'_>, now_ms: u64) -> Result<Applied, ShardError> {
        self.stats.wire_bytes += push.payload.len() as u64;
        self.stats.fp32_bytes += 4 * self.part(push.clock).len() as u64;
        let r = self.validate_and_decode(push);
        let applied = match r {
            Ok(()) => self.commit(push, now_ms),
            Err(
                e @ (ShardError::NonFinite(_)
                | ShardError::NormSpike { .. }
                | ShardError::NormBound { .. }
                | ShardError::RolledBack { .. }),
            ) => {
                // The clock was validated (and its successor checked) before decoding, so this advance cannot fail.
                let _ = self
                    .clocks
                    .advance(push.worker, push.clock.saturating_add(1), now_ms);
                Err(e)
            }
            Err(e) => Err(e),
        };
        self.settle_rounds();
        if let Err(e) = &applied {
            *self.stats.rejected.entry(reject_reason(e)).or_default() += 1;
        }
        applied
    }

    fn validate_and_decode(&mut self, push: &Push<'_>) -> Result<(), ShardError> {
        if push.shard != self.shard {
            return Err(ShardError::WrongShard {
                expected: self.shard,
                found: push.shard,
            });
        }
        if push.range.0 != self.range.start || push.range.1 != self.range.end {
            return Err(ShardError::BadRange {
                expected: self.range.clone(),
                found: push.range.0..push.range.1,
            });
        }
        self.check_clock(push.worker, push.clock)?;
        next_clock(push.worker, push.clock)?;
        // After a restore the version went back; a push resent byte for byte may name a version of the lost
        // lineage. It is accepted (its staleness counts as 0); otherwise a version from the future is refused.
        if push.read_version > self.version && !self.restored {
            return Err(ShardError::VersionFromFuture {
                current: self.version,
                found: push.read_version,
            });
        }
        // A push read before a rollback was computed from parameters that no longer exist.
        if let Some(since) = self
            .rollback
            .as_ref()
            .map(RollbackState::stale_before)
            .filter(|since| push.read_version < *since)
        {
            return Err(ShardError::RolledBack {
                since,
                found: push.read_version,
            });
        }
        let part = self.part(push.clock);
        let scratch = &mut self.scratch[..part.len()];
        let codec = |e: CodecError| match e {
            CodecError::NonFinite { index } => ShardError::NonFinite(index),
            other => ShardError::Codec(other.to_string()),
        };
        let raw = self.decoder.open(push.payload, part.len()).map_err(codec)?;
        let sq = decode_and_square(&self.pool, &raw, scratch).map_err(codec)?;
        // f32² summed in f64 cannot overflow for any realistic length, so a non-finite sum means a non-finite value.
        if !sq.is_finite() {
            let i = scratch.iter().position(|g| !g.is_finite()).unwrap_or(0);
            return Err(ShardError::NonFinite(part.start + i));
        }
        let norm = sq.sqrt() as f32;
        // `part` lies in the range, so its fragment index is below `fragments`, the guards' count.
        let fragment = (push.clock % u64::from(self.fragments)) as usize;
        self.guards[fragment].judge(push.worker, norm)?;
        self.stats.max_push_norm = self.stats.max_push_norm.max(norm);
        Ok(())
    }

    fn commit(&mut self, push: &Push<'_>, now_ms: u64) -> Result<Applied, ShardError> {
        // Clock first: it is the last check that can fail, and it must not fail after the weights changed. The
        // round a sum joins is read before: the advance may close the push's own round.
        let next = next_clock(push.worker, push.clock)?;
        let round = self.open_round_for(push.clock);
        self.clocks.advance(push.worker, next, now_ms)?;
        let staleness = self.version.saturating_sub(push.read_version);
        let scale = if self.staleness_aware {
            1.0 / (staleness.max(1) as f32)
        } else {
            1.0
        } * if self.push_scale_per_live {
            self.push_scale.min(1.0 / self.clocks.live().max(1) as f32)
        } else {
            self.push_scale
        } * self
            .rollback
            .as_ref()
            .map_or(1.0, |rb| rb.lr_factor(push.clock));
        let part = self.part(push.clock);
        if self.at_close {
            let grad = &self.scratch[..part.len()];
            // `round` has the push's fragment, so its part is the push's: the sum and the gradient have one length.
            let sum = self
                .pending
                .entry(round)
                .or_insert_with(|| vec![0.0; part.len()]);
            // Per element, in chunks on the shard's threads: the same bits at any thread count.
            let jobs: Vec<(&mut [f32], &[f32])> = sum
                .chunks_mut(CHUNK_VALUES)
                .zip(grad.chunks(CHUNK_VALUES))
                .collect();
            self.pool.map(jobs, |(s, g)| {
                for (s, g) in s.iter_mut().zip(g) {
                    *s += scale * g;
                }
            });
            self.stats.updates_applied += 1;
            self.stats.staleness.record(staleness);
            return Ok(Applied {
                version: self.version,
                staleness,
                clock: next,
            });
        }
        // A refused step changed nothing but the clock, which advances as for any push refused for its values.
        self.mark_dirty(part.clone());
        let grad = &self.scratch[..part.len()];
        self.optimizer
            .try_step_part_on(
                &self.pool,
                CHUNK_VALUES,
                part,
                &mut self.weights,
                grad,
                scale,
            )
            // `try_step` refuses for nothing else (lengths are fixed at construction and checked at restore).
            .map_err(|_: OptimError| ShardError::NonFiniteState)?;
        self.version += 1;
        self.stats.updates_applied += 1;
        self.stats.staleness.record(staleness);
        Ok(Applied {
            version: self.version,
            staleness,
            clock: next,
        })
    }

    /// Whether a pull for `clock` may be answered now (the SSP gate).
    pub fn can_answer(&self, clock: u64) -> bool {
        self.clocks.can_answer(clock)
    }

    /// Records that a pull by a worker at `clock` is answered now; returns the clock lead.
    pub fn answered(&mut self, clock: u64, bytes: u64) -> u64 {
        let lead = self.clocks.lead(clock);
        self.stats.max_lead = self.stats.max_lead.max(lead);
        self.stats.pulled_bytes += bytes;
        lead
    }

    /// Completes a decoded core (a peer's state image, see [`crate::replication::image`]) with `local`'s settings and scratch,
    /// after checking that it is the same shard of the same layout and that every part has the range's shape.
    /// Changes only `self`.
    pub(crate) fn adopt_local(&mut self, local: &ShardCore) -> Result<(), String> {
        if self.shard != local.shard
            || self.range != local.range
            || self.layout_hash != local.layout_hash
            || self.fragments != local.fragments
        {
            return Err(format!(
                "an image of shard {} over {:?} where shard {} over {:?} of this layout is due",
                self.shard, self.range, local.shard, local.range
            ));
        }
        let n = local.weights.len();
        if self.weights.len() != n {
            return Err(format!("{} weights for a range of {n}", self.weights.len()));
        }
        if self.guards.len() != local.guards.len() {
            return Err("a guard per fragment is due".into());
        }
        if self.pending.len() > crate::checkpoint::MAX_PENDING_ROUNDS {
            return Err(format!("{} open rounds' sums", self.pending.len()));
        }
        if let Some((round, sum)) = self.pending.iter().find(|(&round, sum)| {
            round > MAX_CLOCK || sum.len() != fragment_part(n, round, self.fragments).len()
        }) {
            return Err(format!(
                "the sum of open round {round} has {} values",
                sum.len()
            ));
        }
        self.guards.iter().try_for_each(NormGuard::check)?;
        if self.dirty.start > self.dirty.end || self.dirty.end > n {
            return Err("the changed hull lies outside the range".into());
        }
        self.clocks.check()?;
        let slots = local.optimizer.slots().len();
        if let Some(r) = &self.rollback {
            r.check(n, slots)?;
        }
        if let Some(p) = &mut self.public {
            p.adopt_local(n, local.pull_codec)?;
            p.set_pool(local.pool.clone());
        }
        self.optimizer.adopt_settings(&local.optimizer)?;
        // Values as well as shapes: an image is refused like a forged checkpoint (non-finite weights, a negative
        // second moment, counters past their bounds), before anything is adopted.
        crate::checkpoint::check_values(&self.snapshot()).map_err(|e| e.to_string())?;
        self.optimizer.check_state()?;
        self.pull_codec = local.pull_codec;
        self.decoder = Decoder::new(n);
        self.scratch = vec![0.0; n];
        self.pool = local.pool.clone();
        Ok(())
    }

    /// A consistent copy of everything a checkpoint holds.
    pub fn snapshot(&self) -> ShardSnapshot {
        ShardSnapshot {
            layout_hash: self.layout_hash,
            shard: self.shard,
            range: (self.range.start, self.range.end),
            version: self.version,
            opt_steps: self.optimizer.steps(),
            clocks: self.clocks.clocks().collect(),
            evicted: self.clocks.evicted().collect(),
            weights: self.weights.clone(),
            slots: self.optimizer.slots().to_vec(),
            pending: self.pending_whole(),
        }
    }

    /// Restores weights, optimizer state and version from a verified snapshot of this shard. A snapshot whose clock
    /// table holds a clock beyond [`MAX_CLOCK`] is refused before anything changes.
    pub fn restore(&mut self, snap: ShardSnapshot, now_ms: u64) -> Result<(), RestoreError> {
        if let Some(&(worker, clock)) = snap
            .clocks
            .iter()
            .chain(snap.evicted.iter())
            .find(|(_, c)| *c > MAX_CLOCK)
        {
            return Err(ClockError::Unbounded { worker, clock }.into());
        }
        let n = self.weights.len();
        if let Some(why) = crate::checkpoint::pending_problem(&snap.pending, n) {
            return Err(RestoreError::Pending(why));
        }
        self.optimizer.restore(snap.opt_steps, snap.slots)?;
        self.pending = self.cut_pending(snap.pending);
        self.weights = snap.weights;
        self.version = snap.version;
        self.restored = true;
        self.init_seed = None;
        self.public = None;
        self.dirty = 0..self.weights.len();
        // Every clock was checked against MAX_CLOCK above, so these restores cannot fail.
        for (w, c) in snap.clocks {
            self.clocks.restore(w, c, now_ms)?;
        }
        // An evicted worker's clock covers rounds these weights hold: forgetting it would let its rejoin go back to
        // the minimum clock and a resend of such a round apply twice.
        for (w, c) in snap.evicted {
            self.clocks.restore_evicted(w, c, now_ms)?;
        }
        // In-memory snapshots and reported losses belong to the trajectory before the restore.
        if let Some(rb) = self.rollback.as_mut() {
            *rb = RollbackState::new(rb.config(), rb.margin(), self.clocks.min_clock());
        }
        Ok(())
    }
}

/// Rejection counters by reason label: labels travel as strings and come back as the shard's own labels (an
/// unknown one is refused).
pub(crate) mod reasons {
    use std::collections::HashMap;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use crate::shard::REJECT_REASONS;

    pub fn serialize<S: Serializer>(
        map: &HashMap<&'static str, u64>,
        ser: S,
    ) -> Result<S::Ok, S::Error> {
        let mut pairs: Vec<(&str, u64)> = map.iter().map(|(k, v)| (*k, *v)).collect();
        pairs.sort_unstable();
        pairs.serialize(ser)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<HashMap<&'static str, u64>, D::Error> {
        // Borrowed from the input: a claimed length is checked against the bytes there, never allocated up front.
        let pairs = Vec::<(&'de str, u64)>::deserialize(d)?;
        let mut map = HashMap::with_capacity(pairs.len().min(REJECT_REASONS.len()));
        for (label, n) in pairs {
            let Some(known) = REJECT_REASONS.iter().find(|r| **r == label) else {
                return Err(serde::de::Error::custom(format!(
                    "unknown rejection reason {label:?}"
                )));
            };
            if map.insert(*known, n).is_some() {
                return Err(serde::de::Error::custom("a reason appears twice"));
            }
        }
        Ok(map)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rejection_label_is_listed() {
        let errors = [
            ShardError::WrongShard {
                expected: 0,
                found: 1,
            },
            ShardError::BadRange {
                expected: 0..1,
                found: 0..2,
            },
            ShardError::Codec(String::new()),
            ShardError::NonFinite(0),
            ShardError::ClockFromFuture {
                worker: 0,
                expected: 0,
                found: 1,
            },
            ShardError::Replay {
                worker: 0,
                expected: 1,
                found: 0,
            },
            ShardError::VersionFromFuture {
                current: 0,
                found: 1,
            },
            ShardError::NotMember(0),
            ShardError::NormSpike {
                norm: 1.0,
                limit: 0.5,
            },
            ShardError::NormBound {
                norm: 1.0,
                bound: 0.5,
            },
            ShardError::NonFiniteState,
            ShardError::Overloaded,
            ShardError::RolledBack { since: 2, found: 1 },
            ShardError::Superseded(0),
            ShardError::UnknownRank {
                worker: 9,
                workers: 2,
            },
            ShardError::NotPrimary,
        ];
        let labels: Vec<&str> = errors.iter().map(reject_reason).collect();
        assert_eq!(labels, REJECT_REASONS);
    }
}

//! `ShardActor`: the actix shell that owns one `ShardCore` on its own Arbiter. Its mailbox is bounded (senders wait
//! when it is full: backpressure reaches the QUIC streams), pulls the SSP gate holds back are parked and answered when
//! the clock table allows, silent workers are evicted on a timer, and checkpoints are snapshotted inside the actor but
//! written on a blocking thread so training does not stop.

use std::sync::Arc;
use std::time::Instant;

use actix::prelude::*;
use tokio::sync::oneshot;
use tracing::{debug, info, warn};

use tether_common::metrics::ServerMetrics;
use tether_common::protocol::Precision;

use crate::checkpoint::CheckpointStore;
use crate::shard::{reject_reason, Applied, Push, ShardCore, ShardError, ShardStats};

/// Mailbox capacity of a shard actor: at most this many messages queue before senders wait.
pub const MAILBOX: usize = 64;
/// At most this many pulls are parked at once; beyond it a pull is refused as overloaded.
pub const MAX_PARKED_PULLS: usize = 4096;

/// Replaces the contents of `out` with `weights` as little-endian values in `precision`: the body of a pull reply.
/// Sized once (only growth is zero-filled, so a reused buffer is written in one pass) and filled through fixed-width
/// chunks, so the loop compiles to straight copies (f32) or conversions (bf16) with no per-value capacity checks.
pub fn encode_values(weights: &[f32], precision: Precision, out: &mut Vec<u8>) {
    let len = weights.len() * precision.width();
    out.truncate(len);
    out.resize(len, 0);
    match precision {
        Precision::F32 => {
            for (dst, v) in out.chunks_exact_mut(4).zip(weights) {
                dst.copy_from_slice(&v.to_le_bytes());
            }
        }
        Precision::Bf16 => {
            for (dst, v) in out.chunks_exact_mut(2).zip(weights) {
                dst.copy_from_slice(&half::bf16::from_f32(*v).to_le_bytes());
            }
        }
    }
}

/// What a worker learns when it joins a shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JoinInfo {
    /// The worker's clock at this shard (its own if it was live, else the current minimum clock).
    pub clock: u64,
    /// Current shard version.
    pub version: u64,
    /// Shard range.
    pub range: (u64, u64),
}

/// Parameters returned to a pull.
#[derive(Debug, Clone)]
pub struct PullReply {
    /// Shard version of the values.
    pub version: u64,
    /// Minimum clock when answered.
    pub min_clock: u64,
    /// The pull's clock.
    pub clock: u64,
    /// Values, little-endian, in the requested precision.
    pub values: Vec<u8>,
}

/// A worker (re)joins.
#[derive(Message)]
#[rtype(result = "JoinInfo")]
pub struct Join {
    /// Worker rank.
    pub worker: u32,
    /// The clock the worker believes it is at (raised to, never lowered; after a server restart the worker is ahead).
    pub clock: u64,
}

/// A worker is alive.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Heartbeat {
    /// Worker rank.
    pub worker: u32,
}

/// A worker finished and leaves: nobody waits on it.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Leave {
    /// Worker rank.
    pub worker: u32,
}

/// A gradient push (already framed and authenticated).
#[derive(Message)]
#[rtype(result = "Result<Applied, ShardError>")]
pub struct ApplyPush {
    /// Worker rank.
    pub worker: u32,
    /// Worker clock of this round.
    pub clock: u64,
    /// Target shard.
    pub shard: u32,
    /// Target range.
    pub range: (u64, u64),
    /// Version the gradient was computed against.
    pub read_version: u64,
    /// Codec frame.
    pub payload: Vec<u8>,
}

/// The worker finished round `clock` without a push.
#[derive(Message)]
#[rtype(result = "Result<u64, ShardError>")]
pub struct Skip {
    /// Worker rank.
    pub worker: u32,
    /// The round skipped.
    pub clock: u64,
}

/// A pull for the worker's clock `clock`; the receiver resolves when the SSP gate allows.
#[derive(Message)]
#[rtype(result = "oneshot::Receiver<Result<PullReply, ShardError>>")]
pub struct Pull {
    /// Worker rank.
    pub worker: u32,
    /// The worker's clock.
    pub clock: u64,
    /// Value precision.
    pub precision: Precision,
}

/// Current counters and version.
#[derive(Message)]
#[rtype(result = "(u64, ShardStats, usize)")]
pub struct GetStats;

/// Snapshot now and write a checkpoint; resolves when the write finished.
#[derive(Message)]
#[rtype(result = "Result<Option<u64>, String>")]
pub struct CheckpointNow;

/// Copy of the current weights (for evaluation and tests).
#[derive(Message)]
#[rtype(result = "(u64, Vec<f32>)")]
pub struct GetWeights;

struct ParkedPull {
    clock: u64,
    precision: Precision,
    since: Instant,
    tx: oneshot::Sender<Result<PullReply, ShardError>>,
}

/// One shard of the parameter server.
pub struct ShardActor {
    core: ShardCore,
    started: Instant,
    parked: Vec<ParkedPull>,
    store: Option<Arc<CheckpointStore>>,
    every_updates: u64,
    last_checkpoint_version: u64,
    writing: bool,
    metrics: Option<ServerMetrics>,
    tick_ms: u64,
}

impl ShardActor {
    /// Wraps a core; `store` enables checkpoints every `every_updates` applied updates (0 = only on request).
    pub fn new(
        core: ShardCore,
        store: Option<CheckpointStore>,
        every_updates: u64,
        worker_timeout_ms: u64,
        metrics: Option<ServerMetrics>,
    ) -> Self {
        let last = core.version();
        Self {
            core,
            started: Instant::now(),
            parked: Vec::new(),
            store: store.map(Arc::new),
            every_updates,
            last_checkpoint_version: last,
            writing: false,
            metrics,
            tick_ms: (worker_timeout_ms / 4).clamp(10, 1000),
        }
    }

    /// Starts the actor on a new Arbiter (its own thread) with a bounded mailbox.
    pub fn start_on_own_arbiter(self) -> (Addr<Self>, Arbiter) {
        let arbiter = Arbiter::new();
        let addr = ShardActor::start_in_arbiter(&arbiter.handle(), move |ctx| {
            ctx.set_mailbox_capacity(MAILBOX);
            self
        });
        (addr, arbiter)
    }

    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    fn answer(&mut self, clock: u64, precision: Precision) -> PullReply {
        let mut values = Vec::new();
        encode_values(self.core.weights(), precision, &mut values);
        self.core.answered(clock, values.len() as u64);
        PullReply {
            version: self.core.version(),
            min_clock: self.core.clocks().min_clock(),
            clock,
            values,
        }
    }

    fn release_ready(&mut self) {
        if self.parked.is_empty() {
            return;
        }
        let parked = std::mem::take(&mut self.parked);
        for p in parked {
            if p.tx.is_closed() {
                continue;
            }
            if self.core.can_answer(p.clock) {
                if let Some(m) = &self.metrics {
                    m.pull_wait.observe(p.since.elapsed().as_secs_f64());
                }
                let reply = self.answer(p.clock, p.precision);
                let _ = p.tx.send(Ok(reply));
            } else {
                self.parked.push(p);
            }
        }
    }

    fn update_live(&self) {
        if let Some(m) = &self.metrics {
            m.workers_live.set(self.core.clocks().live() as i64);
        }
    }

    fn maybe_checkpoint(&mut self, ctx: &mut Context<Self>) {
        if self.every_updates == 0 || self.writing || self.store.is_none() {
            return;
        }
        if self.core.version() >= self.last_checkpoint_version + self.every_updates {
            let fut = self.spawn_checkpoint();
            ctx.spawn(fut.into_actor(self).map(|_, act, _| act.writing = false));
        }
    }

    /// Snapshots now and returns a future that writes it off the actor thread.
    fn spawn_checkpoint(
        &mut self,
    ) -> impl std::future::Future<Output = Result<Option<u64>, String>> + 'static {
        let store = self.store.clone();
        let snap = store.as_ref().map(|_| self.core.snapshot());
        let version = self.core.version();
        let metrics = self.metrics.clone();
        if snap.is_some() {
            self.writing = true;
            self.last_checkpoint_version = version;
        }
        let shard = self.core.shard();
        async move {
            let (Some(store), Some(snap)) = (store, snap) else {
                return Ok(None);
            };
            let t0 = Instant::now();
            let res = tokio::task::spawn_blocking(move || store.write(&snap)).await;
            let secs = t0.elapsed().as_secs_f64();
            match res {
                Ok(Ok(path)) => {
                    info!(shard, version, secs, path = %path.display(), "checkpoint written");
                    if let Some(m) = metrics {
                        m.checkpoint_seconds.set(secs);
                        m.checkpoint_last_version.set(version as i64);
                    }
                    Ok(Some(version))
                }
                Ok(Err(e)) => {
                    warn!(shard, version, error = %e, "checkpoint failed");
                    Err(e.to_string())
                }
                Err(e) => Err(format!("checkpoint task failed: {e}")),
            }
        }
    }
}

/// Clears the in-flight flag after a checkpoint write finished.
#[derive(Message)]
#[rtype(result = "()")]
struct CheckpointDone;

impl Handler<CheckpointDone> for ShardActor {
    type Result = ();
    fn handle(&mut self, _: CheckpointDone, _: &mut Context<Self>) {
        self.writing = false;
    }
}

impl Actor for ShardActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        let tick = std::time::Duration::from_millis(self.tick_ms);
        ctx.run_interval(tick, |act, _| {
            let now = act.now_ms();
            let evicted = act.core.evict_silent(now);
            if !evicted.is_empty() {
                warn!(shard = act.core.shard(), ?evicted, "evicted silent workers");
                act.update_live();
                act.release_ready();
            }
        });
    }
}

impl Handler<Join> for ShardActor {
    type Result = MessageResult<Join>;
    fn handle(&mut self, msg: Join, _: &mut Context<Self>) -> Self::Result {
        let now = self.now_ms();
        let clock = self.core.join_at(msg.worker, msg.clock, now);
        debug!(
            shard = self.core.shard(),
            worker = msg.worker,
            clock,
            "worker joined"
        );
        self.update_live();
        self.release_ready();
        let r = self.core.range();
        MessageResult(JoinInfo {
            clock,
            version: self.core.version(),
            range: (r.start, r.end),
        })
    }
}

impl Handler<Heartbeat> for ShardActor {
    type Result = ();
    fn handle(&mut self, msg: Heartbeat, _: &mut Context<Self>) {
        let now = self.now_ms();
        self.core.heartbeat(msg.worker, now);
    }
}

impl Handler<Leave> for ShardActor {
    type Result = ();
    fn handle(&mut self, msg: Leave, _: &mut Context<Self>) {
        self.core.leave(msg.worker);
        self.update_live();
        self.release_ready();
    }
}

impl Handler<ApplyPush> for ShardActor {
    type Result = Result<Applied, ShardError>;
    fn handle(&mut self, msg: ApplyPush, ctx: &mut Context<Self>) -> Self::Result {
        let now = self.now_ms();
        let push = Push {
            worker: msg.worker,
            clock: msg.clock,
            shard: msg.shard,
            range: msg.range,
            read_version: msg.read_version,
            payload: &msg.payload,
        };
        let res = self.core.apply(&push, now);
        if let Some(m) = &self.metrics {
            let fp32 = 4 * (msg.range.1.saturating_sub(msg.range.0));
            m.bytes_received
                .get_or_create(&vec![("kind", "wire")])
                .inc_by(msg.payload.len() as u64);
            m.bytes_received
                .get_or_create(&vec![("kind", "fp32")])
                .inc_by(fp32);
            match &res {
                Ok(a) => {
                    m.updates_applied.inc();
                    m.staleness.observe(a.staleness as f64);
                }
                Err(e) => {
                    m.updates_rejected
                        .get_or_create(&vec![("reason", reject_reason(e))])
                        .inc();
                }
            }
        }
        if res.is_ok() {
            self.release_ready();
            self.maybe_checkpoint(ctx);
        }
        res
    }
}

impl Handler<Skip> for ShardActor {
    type Result = Result<u64, ShardError>;
    fn handle(&mut self, msg: Skip, _: &mut Context<Self>) -> Self::Result {
        let now = self.now_ms();
        let r = self.core.skip(msg.worker, msg.clock, now);
        if r.is_ok() {
            self.release_ready();
        }
        r
    }
}

impl Handler<Pull> for ShardActor {
    type Result = MessageResult<Pull>;
    fn handle(&mut self, msg: Pull, _: &mut Context<Self>) -> Self::Result {
        let (tx, rx) = oneshot::channel();
        let now = self.now_ms();
        self.core.heartbeat(msg.worker, now);
        if self.core.can_answer(msg.clock) {
            if let Some(m) = &self.metrics {
                m.pull_wait.observe(0.0);
            }
            let reply = self.answer(msg.clock, msg.precision);
            let _ = tx.send(Ok(reply));
        } else {
            if self.parked.len() >= MAX_PARKED_PULLS {
                // Pulls whose requester went away still hold a slot until swept; sweep before refusing anyone.
                self.parked.retain(|p| !p.tx.is_closed());
            }
            if self.parked.len() >= MAX_PARKED_PULLS {
                let _ = tx.send(Err(ShardError::Overloaded));
            } else {
                self.parked.push(ParkedPull {
                    clock: msg.clock,
                    precision: msg.precision,
                    since: Instant::now(),
                    tx,
                });
            }
        }
        MessageResult(rx)
    }
}

impl Handler<GetStats> for ShardActor {
    type Result = MessageResult<GetStats>;
    fn handle(&mut self, _: GetStats, _: &mut Context<Self>) -> Self::Result {
        MessageResult((
            self.core.version(),
            self.core.stats().clone(),
            self.core.clocks().live(),
        ))
    }
}

impl Handler<GetWeights> for ShardActor {
    type Result = MessageResult<GetWeights>;
    fn handle(&mut self, _: GetWeights, _: &mut Context<Self>) -> Self::Result {
        MessageResult((self.core.version(), self.core.weights().to_vec()))
    }
}

impl Handler<CheckpointNow> for ShardActor {
    type Result = ResponseFuture<Result<Option<u64>, String>>;
    fn handle(&mut self, _: CheckpointNow, ctx: &mut Context<Self>) -> Self::Result {
        let fut = self.spawn_checkpoint();
        let me = ctx.address();
        Box::pin(async move {
            let r = fut.await;
            let _ = me.send(CheckpointDone).await;
            r
        })
    }
}

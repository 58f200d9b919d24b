//! `ShardActor`: the actix shell that owns one shard's [`ShardProtocol`] (and through it the `ShardCore`) on its own
//! Arbiter. It turns messages from the connection tasks into protocol calls and moves the protocol's actions to
//! their connections: finished pull replies (built by the protocol, byte for byte what goes on the wire) go through
//! oneshot channels when the protocol releases them, connections are closed
//! through their kick channel, silent workers are evicted on a timer. Its mailbox is bounded (senders wait when it is
//! full: backpressure reaches the QUIC streams); checkpoints are snapshotted inside the actor but written on a
//! blocking thread so training does not stop.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use actix::prelude::*;
use tokio::sync::{mpsc, oneshot, watch};
use tracing::{debug, info, warn};

use rkyv::util::AlignedVec;
use tether_common::metrics::ServerMetrics;
use tether_common::protocol::{
    access_push, ErrorCode, Outcome, ProtocolError, PublicRef, PullMode, Welcome,
};

use crate::checkpoint::CheckpointStore;
use crate::fence_link::Fence;
use crate::protocol::{Action, ConnId, FrameBody, Handled, Input, ShardProtocol, WireReply};
use crate::remote::RemoteStore;
use crate::replication::{image, Entry, Primary, ReplicaError, Role, RoleKind, Standby};
use crate::shard::{reject_reason, ShardCore, ShardError, ShardStats, REJECT_REASONS};

/// The partition checker's mutation (feature `mutation-unfenced`): the node ignores its lease. Never enabled in a
/// real build.
const UNFENCED: bool = cfg!(feature = "mutation-unfenced");

/// Mailbox capacity of a shard actor: at most this many messages queue before senders wait.
pub const MAILBOX: usize = 64;

/// A worker's hello on connection `conn` (the explicit rejoin at `clock`). `kick` is fired with a close code when
/// the shard wants this connection closed (the worker was evicted, or a newer session superseded it).
#[derive(Message)]
#[rtype(result = "Result<Welcome, ShardError>")]
pub struct Hello {
    /// The connection.
    pub conn: ConnId,
    /// Worker rank (from its certificate).
    pub worker: u32,
    /// The clock the worker rejoins at.
    pub clock: u64,
    /// Fired when the shard closes this connection (`None`: the orderly end after a goodbye).
    pub kick: oneshot::Sender<Option<ErrorCode>>,
}

/// A worker is alive.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Heartbeat {
    /// The connection it spoke on.
    pub conn: ConnId,
    /// Worker rank.
    pub worker: u32,
}

/// A worker finished and leaves (once its rounds below `clock` are taken): nobody waits on it.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Goodbye {
    /// The connection it spoke on.
    pub conn: ConnId,
    /// Worker rank.
    pub worker: u32,
    /// The worker's clock at goodbye.
    pub clock: u64,
}

/// A connection ended.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Closed {
    /// The connection.
    pub conn: ConnId,
}

/// A push or skip marker: a validated push frame body (16-byte aligned) whose worker the connection task checked
/// against the certificate.
#[derive(Message)]
#[rtype(result = "Result<PushAnswer, ProtocolError>")]
pub struct ApplyPush {
    /// The connection it came on (a superseded one is refused).
    pub conn: ConnId,
    /// The frame body, validated with `access_push` by the connection task (it is accessed again here, in place).
    pub body: AlignedVec,
}

/// What became of a push, and the fence term of the node that decided it (0: unfenced); the worker takes the
/// outcome only in its connection's term.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PushAnswer {
    /// Applied, already applied, or refused.
    pub outcome: Outcome,
    /// The term it was decided in.
    pub term: u64,
}

/// A pull request; on success the receiver resolves with the finished reply when the SSP gate allows (or with the
/// refusal).
#[derive(Message)]
#[rtype(result = "Result<oneshot::Receiver<Result<WireReply, ShardError>>, ShardError>")]
pub struct Pull {
    /// The connection.
    pub conn: ConnId,
    /// Worker rank.
    pub worker: u32,
    /// The worker's request id.
    pub request: u64,
    /// The worker's clock.
    pub clock: u64,
    /// How to answer.
    pub mode: PullMode,
}

/// Current counters and version.
#[derive(Message)]
#[rtype(result = "(u64, ShardStats, usize)")]
pub struct GetStats;

/// What this node's standby must acknowledge to hold every input the node took: the acknowledgement watch and the
/// newest log position (`None`: this node does not serve, or no standby follows it).
#[derive(Message)]
#[rtype(result = "Option<(watch::Receiver<u64>, u64)>")]
pub struct StandbyHolds;

/// Snapshot now and write a checkpoint; resolves when the write finished.
#[derive(Message)]
#[rtype(result = "Result<Option<u64>, String>")]
pub struct CheckpointNow;

/// Copy of the current weights (for evaluation and tests).
#[derive(Message)]
#[rtype(result = "(u64, Vec<f32>)")]
pub struct GetWeights;

/// The newest cut of the public copy and its values, once a delta pull created one (for tests and checks).
#[derive(Message)]
#[rtype(result = "Option<(PublicRef, Vec<f32>)>")]
pub struct GetPublic;

/// A standby asks to follow this shard (see [`crate::replication`]): granted only by a primary (not a node that follows
/// or is still finding its role) that has no standby, whose configuration and layout match the standby's. On success
/// the standby gets the shard's state image as of now (see [`crate::replication::image`]), then the encoded log entries after
/// it out of the receiver, and the shard holds every reply back until the standby acknowledged, through the watch,
/// the entry that produced it.
#[derive(Message)]
#[rtype(result = "Result<Subscription, ReplicaError>")]
pub struct Subscribe {
    /// The standby's configuration fingerprint ([`crate::replication::config_digest`]).
    pub config_digest: u64,
    /// The standby's layout fingerprint.
    pub layout_hash: u64,
}

/// What a granted [`Subscribe`] hands the replication link.
pub struct Subscription {
    /// The public-copy lineage the standby takes over.
    pub lineage: u64,
    /// The shard's state image, which the log continues.
    pub image: Vec<u8>,
    /// The log position of the image: entries continue at `seq + 1`.
    pub seq: u64,
    /// Encoded log entries, in order (bounded by [`crate::replication::LOG_QUEUE`]).
    pub log: mpsc::Receiver<Vec<u8>>,
    /// Where the link reports the newest entry the standby applied.
    pub acked: Arc<watch::Sender<u64>>,
    /// Names this link in [`ReplicaLost`].
    pub link: u64,
}

/// The replication link `0` to the standby ended. Held replies wait until the fence recorded that this node serves
/// alone, or a new standby acknowledged them.
#[derive(Message)]
#[rtype(result = "()")]
pub struct ReplicaLost(pub u64);

/// The standby of link `link`, incarnation `incarnation`, adopted the image and acknowledges the log: the fence may
/// name it as the node that holds every acknowledged update.
#[derive(Message)]
#[rtype(result = "()")]
pub struct StandbySynced {
    /// The link.
    pub link: u64,
    /// The standby process's incarnation.
    pub incarnation: u64,
}

/// The fence recorded that this node serves alone: release what waits for a standby.
#[derive(Message)]
#[rtype(result = "()")]
pub struct SoloRecorded;

/// The node lost its lease: stop serving, close every worker connection (`NotPrimary`), drop the standby, and
/// follow again (the state stays until a primary's image replaces it).
#[derive(Message)]
#[rtype(result = "()")]
pub struct StepDown;

/// This shard's layout fingerprint, which a node asking to be seeded sends (its configuration's is its own).
#[derive(Message)]
#[rtype(result = "u64")]
pub struct GetLayoutHash;

/// A node finding its role: adopt the primary's state image and follow its log from there (refused, changing
/// nothing, when the image does not fit this shard or this node serves already).
#[derive(Message)]
#[rtype(result = "Result<(), ReplicaError>")]
pub struct Follow {
    /// The primary's state image ([`crate::replication::image`]).
    pub image: Vec<u8>,
    /// Its log position: the first entry due is `seq + 1`.
    pub seq: u64,
}

/// Standby: apply one entry of the primary's log; returns its number.
#[derive(Message)]
#[rtype(result = "Result<u64, ReplicaError>")]
pub struct Replicate(pub Entry);

/// A node that followed (or was finding its role): serve as shard K from the state it holds (the image and log it
/// followed; its own, for a designated primary that found no primary). Returns the version taken over, the number of
/// entries applied and the highest connection id the state names (new connections take ids above it).
#[derive(Message)]
#[rtype(result = "(u64, u64, ConnId)")]
pub struct TakeOver;

/// One shard of the parameter server.
pub struct ShardActor {
    proto: ShardProtocol,
    started: Instant,
    waiting: HashMap<u64, (Instant, oneshot::Sender<Result<WireReply, ShardError>>)>,
    kicks: HashMap<ConnId, oneshot::Sender<Option<ErrorCode>>>,
    store: Option<Arc<CheckpointStore>>,
    /// Object storage the checkpoints are uploaded to after each local write, and whether local copies are kept.
    remote: Option<(Arc<RemoteStore>, bool)>,
    /// One upload at a time, in version order.
    uploading: Arc<tokio::sync::Mutex<()>>,
    every_updates: u64,
    last_checkpoint_version: u64,
    writing: bool,
    metrics: Option<ServerMetrics>,
    tick_ms: u64,
    /// The grace-window deadline a one-shot timer is armed for (quorum rounds).
    grace_armed: Option<u64>,
    /// The core's rollback epoch when last looked at (for the rollback counter).
    epoch: u64,
    /// Milliseconds added to the time since `started` (a standby that took over continues its primary's clock).
    clock_base: u64,
    /// What this node is: a primary (with its side of the log) or a standby (with its side); held here only.
    role: Role,
    /// Where the role is published (connection tasks turn workers away unless it is [`RoleKind::Primary`]).
    role_tx: watch::Sender<RoleKind>,
    /// The newest log position of the node's last term as primary: a new term's log continues above it, so that
    /// the acknowledgement watch only moves up.
    seq_floor: u64,
    /// Fingerprint of the configuration this shard runs under ([`crate::replication::config_digest`]).
    config_digest: u64,
    /// A replicated shard's fence: this node serves only while it holds the lease.
    fence: Option<Arc<Fence>>,
    /// The newest position a standby acknowledged (`u64::MAX`: nothing needs to wait).
    acked: Arc<watch::Sender<u64>>,
    /// Where applied pushes are recorded, and this node's name in the records.
    history: Option<(std::fs::File, &'static str)>,
}

/// One applied push as the history file records it (a JSON line).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct HistoryLine {
    /// Wall-clock time, microseconds since the Unix epoch (comparable across the processes of one machine), taken
    /// when the node decided it served the push, before applying it.
    pub t_us: u64,
    /// `primary` or `standby` (which node of the shard applied it).
    pub node: String,
    /// The fence term the node held (0: unreplicated).
    pub term: u64,
    /// The pushing worker.
    pub worker: u32,
    /// The push round.
    pub clock: u64,
    /// The shard version after it.
    pub version: u64,
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
        if let Some(m) = &metrics {
            // Every labelled series exists from the start, at 0 (rates and alerts need a first sample).
            for reason in REJECT_REASONS {
                m.updates_rejected
                    .get_or_create(&vec![("reason", reason)])
                    .inc_by(0);
            }
            for kind in ["wire", "fp32"] {
                m.bytes_received
                    .get_or_create(&vec![("kind", kind)])
                    .inc_by(0);
            }
            m.version.set(last as i64);
            m.rollbacks.inc_by(0);
        }
        Self {
            proto: ShardProtocol::new(core),
            started: Instant::now(),
            waiting: HashMap::new(),
            kicks: HashMap::new(),
            store: store.map(Arc::new),
            remote: None,
            uploading: Arc::new(tokio::sync::Mutex::new(())),
            every_updates,
            last_checkpoint_version: last,
            writing: false,
            metrics,
            tick_ms: (worker_timeout_ms / 4).clamp(10, 1000),
            grace_armed: None,
            epoch: 0,
            clock_base: 0,
            role: Role::Primary(Primary::new(false, 0)),
            role_tx: watch::channel(RoleKind::Primary).0,
            seq_floor: 0,
            config_digest: 0,
            fence: None,
            acked: Arc::new(watch::channel(u64::MAX).0),
            history: None,
        }
    }

    /// Records every applied push into `file` (one JSON line each, written at once), naming this node `node`.
    pub fn with_history(mut self, file: std::fs::File, node: &'static str) -> Self {
        self.history = Some((file, node));
        self
    }

    /// Fences this node: it serves only while `fence` holds the lease, and holds replies until its standby
    /// acknowledged them or the fence recorded that it serves alone.
    pub fn with_fence(mut self, fence: Arc<Fence>) -> Self {
        self.fence = Some(fence);
        self.acked.send_replace(0);
        if let Role::Primary(p) = &mut self.role {
            *p = Primary::new(true, p.seq());
        }
        self
    }

    /// Where this node's role is published (it changes when the node takes over, steps down or is seeded).
    pub fn role_watch(&self) -> watch::Receiver<RoleKind> {
        self.role_tx.subscribe()
    }

    /// Changes the role and publishes it.
    fn set_role(&mut self, role: Role) {
        self.role = role;
        self.role_tx.send_replace(self.role.kind());
    }

    /// Whether this node serves now: it leads, and (fenced) holds the lease.
    fn serves(&self) -> bool {
        self.role.is_primary() && (UNFENCED || self.fence.as_ref().is_none_or(|f| f.serving()))
    }

    /// Whether this node serves now; if so, what the protocol builds next carries the term it serves in.
    fn serve_now(&mut self) -> bool {
        // The term is read before the lease: a term read after a lost-and-regained lease would be newer than the
        // one checked, never older.
        let term = self.fence.as_ref().map_or(0, |f| f.term());
        if !self.serves() {
            return false;
        }
        self.proto.set_term(term);
        true
    }

    /// Stamps the fence's current term on what the protocol builds next (inputs that release pulls without being
    /// refused when the node does not serve: heartbeats, goodbyes, closed connections). A reply stamped in a term
    /// the node no longer holds never leaves ([`still_serving`]).
    fn sync_term(&mut self) {
        if let Some(f) = &self.fence {
            self.proto.set_term(f.term());
        }
    }

    /// Records the configuration fingerprint a standby must match ([`crate::replication::config_digest`]).
    pub fn with_config_digest(mut self, digest: u64) -> Self {
        self.config_digest = digest;
        self
    }

    /// A node of a replicated shard finding its role: it serves nobody until [`TakeOver`]; after [`Follow`] it
    /// applies its primary's log ([`Replicate`]).
    pub fn following(mut self) -> Self {
        self.set_role(Role::Standby(Standby::new()));
        self
    }

    /// Uploads every checkpoint to `remote` in the background once it is written locally; without `keep_local` the
    /// local copy is removed after its upload.
    pub fn with_remote(mut self, remote: Option<Arc<RemoteStore>>, keep_local: bool) -> Self {
        self.remote = remote.map(|r| (r, keep_local));
        self
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
        self.clock_base + self.started.elapsed().as_millis() as u64
    }

    /// Feeds one input to the protocol, numbered and queued for the standby first ([`Primary::record`]). The
    /// actor's only way into its protocol, so no input skips the log; `None` (nothing fed) unless this node is the
    /// primary.
    fn step(&mut self, input: &Input) -> Option<Handled> {
        let Role::Primary(p) = &mut self.role else {
            return None;
        };
        if let Err(why) = p.record(input) {
            warn!(shard = self.proto.shard(), %why, "serving without a standby once the fence records it");
            self.standby_gone();
        }
        Some(self.proto.handle(input))
    }

    /// The standby is gone: replies wait until the fence recorded that this node serves alone.
    fn standby_gone(&mut self) {
        if let Role::Primary(p) = &mut self.role {
            p.detach(None);
        }
        if let Some(m) = &self.metrics {
            m.replica_connected.set(0);
        }
        match &self.fence {
            Some(f) => {
                f.set_successor(tether_common::fence::Successor::Nobody);
                if UNFENCED || f.solo() {
                    self.acked.send_replace(u64::MAX);
                }
            }
            // Unfenced (an in-process standby without voters): nothing waits for a standby that is gone.
            None => {
                self.acked.send_replace(u64::MAX);
            }
        }
    }

    /// What a reply produced now must wait for before it leaves: the standby's acknowledgement of the newest entry
    /// (or a recorded solo), then the lease.
    fn ack_gate(&self) -> Option<(watch::Receiver<u64>, u64, Option<Arc<Fence>>)> {
        match &self.role {
            Role::Primary(p) if p.gates() => {
                Some((self.acked.subscribe(), p.seq(), self.fence.clone()))
            }
            _ => None,
        }
    }

    /// Carries out what the protocol asks for: sends finished replies, refuses dropped pulls, closes connections.
    fn run_actions(&mut self) {
        let epoch = self.proto.epoch();
        if epoch > self.epoch {
            if let Some(m) = &self.metrics {
                m.rollbacks.inc_by(epoch - self.epoch);
                m.version.set(self.proto.version() as i64);
            }
        }
        self.epoch = epoch;
        if let Some(m) = &self.metrics {
            let rounds = self.proto.core().clocks().rounds();
            let (closes, behind) = (rounds.quorum_closes(), rounds.left_behind_total());
            m.quorum_closes
                .inc_by(closes.saturating_sub(m.quorum_closes.get()));
            m.left_behind
                .inc_by(behind.saturating_sub(m.left_behind.get()));
        }
        while let Some(action) = self.proto.poll_action() {
            match action {
                Action::Answer { pull, reply } => {
                    let Some((since, tx)) = self.waiting.remove(&pull.token) else {
                        continue;
                    };
                    if let Some(m) = &self.metrics {
                        m.pull_wait.observe(since.elapsed().as_secs_f64());
                    }
                    match self.ack_gate() {
                        // The reply may reflect updates only once the standby holds them too, and leaves only
                        // while this node holds the lease of the term the reply carries.
                        Some((acked, seq, fence)) => {
                            let term = reply.header.term;
                            actix::spawn(async move {
                                wait_acked(acked, seq).await;
                                let _ = tx.send(if fence.is_none_or(|f| still_serving(&f, term)) {
                                    Ok(reply)
                                } else {
                                    Err(ShardError::NotPrimary)
                                });
                            });
                        }
                        None => {
                            let _ = tx.send(Ok(reply));
                        }
                    }
                }
                Action::Refuse { token, error, .. } => {
                    if let Some((_, tx)) = self.waiting.remove(&token) {
                        let _ = tx.send(Err(error));
                    }
                }
                Action::Close { conn, code } => {
                    if let Some(kick) = self.kicks.remove(&conn) {
                        let _ = kick.send(code);
                    }
                }
            }
        }
    }

    fn update_live(&self) {
        if let Some(m) = &self.metrics {
            m.workers_live.set(self.proto.live() as i64);
        }
    }

    fn maybe_checkpoint(&mut self, ctx: &mut Context<Self>) {
        if self.every_updates == 0 || self.writing || self.store.is_none() {
            return;
        }
        // While the loss looks like a spike, a checkpoint could capture it; the next one after the verdict is taken.
        if self.proto.spike_suspected() {
            return;
        }
        if self.proto.version() >= self.last_checkpoint_version + self.every_updates {
            let fut = self.spawn_checkpoint(false);
            ctx.spawn(fut.into_actor(self).map(|_, act, _| act.writing = false));
        }
    }

    /// Snapshots now and returns a future that writes it off the actor thread.
    fn spawn_checkpoint(
        &mut self,
        wait_upload: bool,
    ) -> impl std::future::Future<Output = Result<Option<u64>, String>> + 'static {
        let store = self.store.clone();
        let remote = self.remote.clone();
        let uploading = self.uploading.clone();
        let snap = store.as_ref().map(|_| self.proto.snapshot());
        let version = self.proto.version();
        let metrics = self.metrics.clone();
        if snap.is_some() {
            self.writing = true;
            self.last_checkpoint_version = version;
        }
        let shard = self.proto.shard();
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
                    if let Some((remote, keep_local)) = remote {
                        // Training never waits for the upload; a final checkpoint (wait_upload) does.
                        let upload = tokio::spawn(upload(
                            remote, uploading, path, version, keep_local, shard,
                        ));
                        if wait_upload {
                            let _ = upload.await;
                        }
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
        ctx.run_interval(tick, |act, ctx| act.on_tick(ctx));
    }
}

impl ShardActor {
    /// The periodic sweep (and the grace-window timer): evictions, rounds whose grace ended, requesters gone.
    fn on_tick(&mut self, ctx: &mut Context<Self>) {
        if !self.serve_now() {
            return;
        }
        let now = self.now_ms();
        let evicted = match self.step(&Input::Tick { now_ms: now }) {
            Some(Handled::Evicted(e)) => e,
            _ => Vec::new(),
        };
        self.run_actions();
        if !evicted.is_empty() {
            warn!(
                shard = self.proto.shard(),
                ?evicted,
                "evicted silent workers"
            );
            self.update_live();
        }
        // Requesters that went away free their slots.
        let gone: Vec<u64> = self
            .waiting
            .iter()
            .filter(|(_, (_, tx))| tx.is_closed())
            .map(|(t, _)| *t)
            .collect();
        for t in gone {
            self.waiting.remove(&t);
            self.step(&Input::Cancel { token: t });
            self.run_actions();
        }
        self.run_actions();
        self.arm_grace(ctx);
    }

    /// Arms a one-shot timer for the open round's grace window (quorum rounds) unless one at or before it is armed.
    fn arm_grace(&mut self, ctx: &mut Context<Self>) {
        let Some(deadline) = self.proto.poll_timeout() else {
            return;
        };
        if self.grace_armed.is_some_and(|armed| armed <= deadline) {
            return;
        }
        self.grace_armed = Some(deadline);
        let wait = deadline.saturating_sub(self.now_ms());
        ctx.run_later(std::time::Duration::from_millis(wait), move |act, ctx| {
            if act.grace_armed == Some(deadline) {
                act.grace_armed = None;
            }
            act.on_tick(ctx);
        });
    }
}

impl Handler<Hello> for ShardActor {
    type Result = Result<Welcome, ShardError>;
    fn handle(&mut self, msg: Hello, ctx: &mut Context<Self>) -> Self::Result {
        if !self.serve_now() {
            return Err(ShardError::NotPrimary);
        }
        let now = self.now_ms();
        let joined = match self.step(&Input::Hello {
            conn: msg.conn,
            worker: msg.worker,
            clock: msg.clock,
            now_ms: now,
        }) {
            Some(Handled::Welcome(w)) => w,
            _ => Err(ShardError::NotPrimary),
        };
        if joined.is_ok() {
            self.kicks.insert(msg.conn, msg.kick);
            debug!(
                shard = self.proto.shard(),
                worker = msg.worker,
                ?joined,
                "worker joined"
            );
            self.update_live();
        }
        self.run_actions();
        self.arm_grace(ctx);
        joined
    }
}

impl Handler<Heartbeat> for ShardActor {
    type Result = ();
    fn handle(&mut self, msg: Heartbeat, _: &mut Context<Self>) {
        self.sync_term();
        let now = self.now_ms();
        if self
            .step(&Input::Heartbeat {
                conn: msg.conn,
                worker: msg.worker,
                now_ms: now,
            })
            .is_some()
        {
            self.run_actions();
        }
    }
}

impl Handler<Goodbye> for ShardActor {
    type Result = ();
    fn handle(&mut self, msg: Goodbye, ctx: &mut Context<Self>) {
        self.sync_term();
        let now = self.now_ms();
        let fed = self.step(&Input::Goodbye {
            conn: msg.conn,
            worker: msg.worker,
            clock: msg.clock,
            now_ms: now,
        });
        if fed.is_none() {
            return;
        }
        self.update_live();
        self.run_actions();
        self.arm_grace(ctx);
    }
}

impl Handler<Closed> for ShardActor {
    type Result = ();
    fn handle(&mut self, msg: Closed, _: &mut Context<Self>) {
        self.sync_term();
        if self.step(&Input::Closed { conn: msg.conn }).is_none() {
            return;
        }
        self.kicks.remove(&msg.conn);
        self.run_actions();
    }
}

impl Handler<ApplyPush> for ShardActor {
    type Result = ResponseFuture<Result<PushAnswer, ProtocolError>>;
    fn handle(&mut self, msg: ApplyPush, ctx: &mut Context<Self>) -> Self::Result {
        let result = self.apply_push(msg, ctx);
        let term = self.proto.term();
        let gate = self.ack_gate();
        Box::pin(async move {
            // The worker learns the outcome (and drops its copy of the push) only once the standby holds it too,
            // and only from a node that still holds the lease of the term it was applied in.
            if let Some((acked, seq, fence)) = gate {
                wait_acked(acked, seq).await;
                // Applied here, but this node lost the lease before the outcome could leave: the worker reconnects
                // to the shard's primary and sends the push again (applied once, or answered as already applied).
                if fence.is_some_and(|f| !still_serving(&f, term)) {
                    return Err(not_primary());
                }
            }
            result.map(|outcome| PushAnswer { outcome, term })
        })
    }
}

impl ShardActor {
    fn apply_push(
        &mut self,
        msg: ApplyPush,
        ctx: &mut Context<Self>,
    ) -> Result<Outcome, ProtocolError> {
        // The history records when this node decided it served the push: a process paused between that decision
        // and the write (SIGSTOP) would otherwise stamp a push it took while serving with a time after its lease.
        let decided = self.history.as_ref().map(|_| {
            let t_us = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_micros() as u64);
            (t_us, self.fence.as_ref().map_or(0, |f| f.term()))
        });
        if !self.serve_now() {
            return Err(not_primary());
        }
        let now = self.now_ms();
        // Validated by the connection task already; checked again so that the log never holds a body the standby
        // would refuse.
        let frame = access_push(&msg.body)?;
        let (meta, wire_bytes) = (frame.meta(), frame.payload().len() as u64);
        let input = Input::Push {
            conn: msg.conn,
            now_ms: now,
            body: FrameBody(msg.body),
        };
        let (outcome, applied) = match self.step(&input) {
            Some(Handled::Round(outcome, applied)) => (outcome, applied),
            Some(Handled::BadFrame(e)) => return Err(e),
            _ => return Err(not_primary()),
        };
        if let Some(m) = &self.metrics {
            if !meta.skip {
                let fp32 = 4 * meta.range_end.saturating_sub(meta.range_start);
                m.bytes_received
                    .get_or_create(&vec![("kind", "wire")])
                    .inc_by(wire_bytes);
                m.bytes_received
                    .get_or_create(&vec![("kind", "fp32")])
                    .inc_by(fp32);
            }
            match &applied {
                Ok(Some(a)) => {
                    m.updates_applied.inc();
                    m.version.set(a.version as i64);
                    m.staleness.observe(a.staleness as f64);
                }
                Err(e) => {
                    m.updates_rejected
                        .get_or_create(&vec![("reason", reject_reason(e))])
                        .inc();
                }
                Ok(None) => {}
            }
        }
        if let Err(e) = &applied {
            debug!(shard = self.proto.shard(), worker = meta.worker, clock = meta.clock, error = %e, "push refused");
        }
        if let (Ok(Some(a)), Some((file, node))) = (&applied, self.history.as_mut()) {
            use std::io::Write;
            let line = HistoryLine {
                t_us: decided.map_or(0, |d| d.0),
                node: (*node).to_string(),
                term: decided.map_or(0, |d| d.1),
                worker: meta.worker,
                clock: meta.clock,
                version: a.version,
            };
            let mut bytes = serde_json::to_vec(&line).unwrap_or_default();
            bytes.push(b'\n');
            if let Err(e) = file.write_all(&bytes) {
                warn!(shard = self.proto.shard(), error = %e, "cannot write the history; no longer recording");
                self.history = None;
            }
        }
        self.run_actions();
        self.arm_grace(ctx);
        if matches!(applied, Ok(Some(_))) {
            self.maybe_checkpoint(ctx);
        }
        Ok(outcome)
    }
}

impl Handler<Pull> for ShardActor {
    type Result = Result<oneshot::Receiver<Result<WireReply, ShardError>>, ShardError>;
    fn handle(&mut self, msg: Pull, _: &mut Context<Self>) -> Self::Result {
        if !self.serve_now() {
            return Err(ShardError::NotPrimary);
        }
        let now = self.now_ms();
        let token = match self.step(&Input::Pull {
            conn: msg.conn,
            worker: msg.worker,
            request: msg.request,
            clock: msg.clock,
            mode: msg.mode,
            now_ms: now,
        }) {
            Some(Handled::Pull(t)) => t,
            _ => Err(ShardError::NotPrimary),
        };
        // Drained after every input, refused or not, as a standby does (see `crate::replication::standby`).
        let token = match token {
            Ok(t) => t,
            Err(e) => {
                self.run_actions();
                return Err(e);
            }
        };
        let (tx, rx) = oneshot::channel();
        self.waiting.insert(token, (Instant::now(), tx));
        self.run_actions();
        Ok(rx)
    }
}

impl Handler<GetStats> for ShardActor {
    type Result = MessageResult<GetStats>;
    fn handle(&mut self, _: GetStats, _: &mut Context<Self>) -> Self::Result {
        let p = &self.proto;
        MessageResult((p.version(), p.stats().clone(), p.live()))
    }
}

impl Handler<GetPublic> for ShardActor {
    type Result = MessageResult<GetPublic>;
    fn handle(&mut self, _: GetPublic, _: &mut Context<Self>) -> Self::Result {
        MessageResult(self.proto.public().map(|(cut, v)| (cut, v.to_vec())))
    }
}

impl Handler<GetWeights> for ShardActor {
    type Result = MessageResult<GetWeights>;
    fn handle(&mut self, _: GetWeights, _: &mut Context<Self>) -> Self::Result {
        MessageResult((self.proto.version(), self.proto.weights().to_vec()))
    }
}

impl Handler<CheckpointNow> for ShardActor {
    type Result = ResponseFuture<Result<Option<u64>, String>>;
    fn handle(&mut self, _: CheckpointNow, ctx: &mut Context<Self>) -> Self::Result {
        let fut = self.spawn_checkpoint(true);
        let me = ctx.address();
        Box::pin(async move {
            let r = fut.await;
            let _ = me.send(CheckpointDone).await;
            r
        })
    }
}

/// Whether `fence` still holds the lease of `term` (a reply built in an older term never leaves, even if the node
/// serves again in a newer one).
fn still_serving(fence: &Fence, term: u64) -> bool {
    UNFENCED || (fence.term() == term && fence.serving())
}

/// The answer to a push at a node that does not hold the lease: the connection closes with `NotPrimary`, and the
/// worker sends the push again to the shard's primary (an outcome would make it drop the push).
fn not_primary() -> ProtocolError {
    ProtocolError::Rejected {
        code: ErrorCode::NotPrimary,
        message: "not the shard's primary (it does not hold the lease)".into(),
    }
}

impl Handler<StandbyHolds> for ShardActor {
    type Result = Option<(watch::Receiver<u64>, u64)>;
    fn handle(&mut self, _: StandbyHolds, _: &mut Context<Self>) -> Self::Result {
        match &self.role {
            Role::Primary(p) if p.standby().is_some() => Some((self.acked.subscribe(), p.seq())),
            _ => None,
        }
    }
}

/// Waits until the standby acknowledged entry `seq` (or is gone: the link then reports `u64::MAX`, or drops).
async fn wait_acked(mut acked: watch::Receiver<u64>, seq: u64) {
    let _ = acked.wait_for(|a| *a >= seq).await;
}

impl Handler<Subscribe> for ShardActor {
    type Result = Result<Subscription, ReplicaError>;
    fn handle(&mut self, msg: Subscribe, _: &mut Context<Self>) -> Self::Result {
        let Role::Primary(p) = &self.role else {
            return Err(ReplicaError::NotLeading {
                seeded: self.role.kind() == RoleKind::Standby,
            });
        };
        if p.standby().is_some() {
            return Err(ReplicaError::Taken);
        }
        let core = self.proto.core();
        if msg.layout_hash != core.layout_hash() {
            return Err(ReplicaError::Mismatch("parameter layouts differ".into()));
        }
        if msg.config_digest != self.config_digest {
            return Err(ReplicaError::Mismatch(
                "configurations differ (compare cluster.toml of both)".into(),
            ));
        }
        let lineage = core.lineage();
        // The actions were drained after the last input, so the image is the state every reply so far reflects.
        let image = image::encode(&self.proto, self.now_ms())?;
        let Role::Primary(p) = &mut self.role else {
            return Err(ReplicaError::NotLeading { seeded: false });
        };
        let (link, log_rx) = p.attach();
        let seq = p.seq();
        // Released already (this node served alone): nothing waits at or below the image, so from here on replies
        // wait for this standby's acknowledgements.
        if *self.acked.borrow() == u64::MAX {
            self.acked.send_replace(seq);
        }
        if let Some(m) = &self.metrics {
            m.replica_connected.set(1);
        }
        info!(
            shard = self.proto.shard(),
            version = self.proto.version(),
            image_bytes = image.len(),
            "standby following from a state image"
        );
        Ok(Subscription {
            lineage,
            image,
            seq,
            log: log_rx,
            acked: self.acked.clone(),
            link,
        })
    }
}

impl Handler<ReplicaLost> for ShardActor {
    type Result = ();
    fn handle(&mut self, msg: ReplicaLost, _: &mut Context<Self>) {
        let dropped = match &mut self.role {
            Role::Primary(p) => p.detach(Some(msg.0)),
            Role::Standby(_) => false,
        };
        if dropped {
            warn!(
                shard = self.proto.shard(),
                "standby lost; serving without one once the fence records it"
            );
            self.standby_gone();
        }
    }
}

impl Handler<StandbySynced> for ShardActor {
    type Result = ();
    fn handle(&mut self, msg: StandbySynced, _: &mut Context<Self>) {
        if let (Role::Primary(p), Some(f)) = (&self.role, &self.fence) {
            if p.standby() == Some(msg.link) {
                f.set_successor(tether_common::fence::Successor::Node(msg.incarnation));
                info!(
                    shard = self.proto.shard(),
                    "standby holds the log: it may take over"
                );
            }
        }
    }
}

impl Handler<SoloRecorded> for ShardActor {
    type Result = ();
    fn handle(&mut self, _: SoloRecorded, _: &mut Context<Self>) {
        let alone = matches!(&self.role, Role::Primary(p) if p.standby().is_none());
        if alone && self.fence.as_ref().is_some_and(|f| f.solo()) {
            debug!(
                shard = self.proto.shard(),
                "the fence recorded that this node serves alone"
            );
            self.acked.send_replace(u64::MAX);
        }
    }
}

impl Handler<StepDown> for ShardActor {
    type Result = ();
    fn handle(&mut self, _: StepDown, _: &mut Context<Self>) {
        let Role::Primary(p) = &self.role else {
            return;
        };
        if UNFENCED {
            return;
        }
        self.seq_floor = p.seq();
        if let Some(f) = &self.fence {
            f.depose();
        }
        warn!(
            shard = self.proto.shard(),
            version = self.proto.version(),
            "lost the lease: no longer serving"
        );
        for (_, kick) in self.kicks.drain() {
            let _ = kick.send(Some(ErrorCode::NotPrimary));
        }
        for (_, (_, tx)) in self.waiting.drain() {
            let _ = tx.send(Err(ShardError::NotPrimary));
        }
        if let Some(m) = &self.metrics {
            m.replica_connected.set(0);
        }
        // Held outcomes wake and see the lease gone: they answer NotPrimary.
        self.acked.send_replace(u64::MAX);
        // The standby's link drops with the primary's side of the log.
        let standby = Standby::seeded(self.now_ms(), self.proto.max_conn(), 0);
        self.set_role(Role::Standby(standby));
    }
}

impl Handler<GetLayoutHash> for ShardActor {
    type Result = u64;
    fn handle(&mut self, _: GetLayoutHash, _: &mut Context<Self>) -> u64 {
        self.proto.core().layout_hash()
    }
}

impl Handler<Follow> for ShardActor {
    type Result = Result<(), ReplicaError>;
    fn handle(&mut self, msg: Follow, _: &mut Context<Self>) -> Self::Result {
        if self.role.is_primary() {
            return Err(ReplicaError::Mismatch("this node serves already".into()));
        }
        let now_ms = image::restore(&msg.image, &mut self.proto)?;
        let standby = Standby::seeded(now_ms, self.proto.max_conn(), msg.seq);
        self.set_role(Role::Standby(standby));
        if let Some(m) = &self.metrics {
            m.version.set(self.proto.version() as i64);
        }
        Ok(())
    }
}

impl Handler<Replicate> for ShardActor {
    type Result = Result<u64, ReplicaError>;
    fn handle(&mut self, msg: Replicate, _: &mut Context<Self>) -> Self::Result {
        let Role::Standby(standby) = &mut self.role else {
            return Err(ReplicaError::Mismatch(
                "this shard took over already".into(),
            ));
        };
        let seq = standby.accept(&mut self.proto, &msg.0)?;
        if let Some(m) = &self.metrics {
            m.version.set(self.proto.version() as i64);
        }
        Ok(seq)
    }
}

impl Handler<TakeOver> for ShardActor {
    type Result = MessageResult<TakeOver>;
    fn handle(&mut self, _: TakeOver, ctx: &mut Context<Self>) -> Self::Result {
        if self.role.is_primary() {
            return MessageResult((self.proto.version(), 0, self.proto.max_conn()));
        }
        let primary = Role::Primary(Primary::new(self.fence.is_some(), self.seq_floor));
        let Role::Standby(standby) = std::mem::replace(&mut self.role, primary) else {
            // Checked just above: the role was a standby's.
            unreachable!("a primary taking over");
        };
        self.role_tx.send_replace(RoleKind::Primary);
        // The shard's clock continues from the newest time of the image and the log.
        self.clock_base = standby.last_now_ms();
        self.started = Instant::now();
        // Nothing of this node's own waits; replies from here on wait for a standby, or not at all once the fence
        // recorded that this node serves alone (it won its term declaring no successor).
        if let Some(f) = &self.fence {
            self.acked
                .send_replace(if f.solo() { u64::MAX } else { self.seq_floor });
        }
        let version = self.proto.version();
        if standby.is_seeded() {
            info!(
                shard = self.proto.shard(),
                version,
                entries = standby.applied(),
                "standby took over"
            );
        } else {
            info!(
                shard = self.proto.shard(),
                version, "no primary to follow: serving as the shard's primary"
            );
        }
        if let Some(m) = &self.metrics {
            m.version.set(version as i64);
            if standby.is_seeded() {
                m.takeovers.inc();
            }
        }
        self.update_live();
        self.arm_grace(ctx);
        MessageResult((version, standby.applied(), self.proto.max_conn()))
    }
}

/// Uploads the checkpoint at `path` (one upload at a time); without `keep_local`, removes the local copy afterwards,
/// and any older one an earlier failed upload left behind (the store now holds a newer checkpoint).
async fn upload(
    remote: Arc<RemoteStore>,
    lock: Arc<tokio::sync::Mutex<()>>,
    path: std::path::PathBuf,
    version: u64,
    keep_local: bool,
    shard: u32,
) {
    let _one_at_a_time = lock.lock().await;
    let t0 = Instant::now();
    match remote.upload(&path, version).await {
        Ok(()) => {
            info!(
                shard,
                version,
                secs = t0.elapsed().as_secs_f64(),
                "checkpoint uploaded"
            );
            if !keep_local {
                let older = path
                    .parent()
                    .and_then(|dir| std::fs::read_dir(dir).ok())
                    .into_iter()
                    .flatten()
                    .filter_map(Result::ok)
                    .filter(|e| {
                        e.file_name()
                            .to_str()
                            .and_then(crate::checkpoint::parse_version_dir)
                            .is_some_and(|v| v < version)
                    })
                    .map(|e| e.path());
                for p in std::iter::once(path.clone()).chain(older) {
                    if let Err(e) = std::fs::remove_dir_all(&p) {
                        warn!(shard, version, path = %p.display(), error = %e, "cannot remove a local copy after an upload");
                    }
                }
            }
        }
        // The local copy stays; the next checkpoint is uploaded as usual.
        Err(e) => warn!(shard, version, error = %e, "checkpoint upload failed"),
    }
}

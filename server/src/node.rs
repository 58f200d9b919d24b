//! A running shard server: builds the `ShardCore` from the configuration (resuming from the newest verified
//! checkpoint when asked), starts its `ShardActor` on an Arbiter, binds the mutual-TLS QUIC endpoint and spawns one
//! connection task (the private `connection` shell) per QUIC connection that [`crate::admission`] lets in: each
//! attempt is accepted, sent a stateless retry or refused before any TLS work, so no peer can queue the others
//! behind its own. Used by the `tether-server` binary and by `tether::LocalCluster`.
//! Must be called inside an actix `System` running on a multi-threaded tokio runtime.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix::{Addr, Arbiter};
use tracing::{debug, info, warn};

use tether_common::chunk_pool::ChunkPool;
use tether_common::config::Config;
use tether_common::layout::{model_layout, Layout};
use tether_common::metrics::ServerMetrics;
use tether_common::net::{server_endpoint, NetError, TlsFiles, TransportTuning};
use tether_common::pki::{CheckpointKey, PkiError, CHECKPOINT_KEY_FILE};
use tether_common::protocol::{ErrorCode, FrameKind, FrameLimits};
use tether_common::report::RunReport;

use crate::actor::{
    CheckpointNow, Follow, GetLayoutHash, GetStats, Replicate, ShardActor, SoloRecorded,
    StandbyHolds, StepDown, TakeOver,
};
use crate::admission::{Admission, AdmissionLimits, HandshakeVerdict, MAX_HANDSHAKE_WAIT};
use crate::checkpoint::CheckpointStore;
use crate::connection::{serve_connection, ConnectionContext};
use crate::error::Error;
use crate::fence_link::{self, Fence, RemoteVoter, WITNESS_VOTER};
use crate::norm_guard::GuardSettings;
use crate::quorum::QuorumSettings;
use crate::remote::RemoteStore;
use crate::replication::{self, RoleKind};
use crate::shard::{Membership, ShardCore, ShardSpec, ShardStats};
use crate::update_rule;

/// How to start one shard.
#[derive(Clone, Default)]
pub struct ShardOptions {
    /// Shard index K (listens on `cluster.servers[K]` unless `listen` is set).
    pub shard: u32,
    /// Listen address override.
    pub listen: Option<SocketAddr>,
    /// Load the newest verified checkpoint before serving.
    pub resume: bool,
    /// TLS material override (default: `cluster.tls_dir`, stem `server`).
    pub tls: Option<TlsFiles>,
    /// Metrics to record into.
    pub metrics: Option<ServerMetrics>,
    /// Relative factor of the gradient-norm guard, overriding `guard.factor` (0 = off; `None`: the configured one).
    pub spike_factor: Option<f32>,
    /// The parameter layout, when it is not the one `[model]` describes (a user model embedded as a library).
    pub layout: Option<Layout>,
    /// The checkpoint key, overriding `checkpoint.key_file` and the bundle's `checkpoint.key` (in-process clusters
    /// and tests that hold their own).
    pub checkpoint_key: Option<CheckpointKey>,
    /// Run as shard K's standby: listen on `cluster.standbys[K]` (unless `listen` is set) with the `standby-K`
    /// bundle, follow the primary's log and take over when it dies.
    pub standby: bool,
    /// Append every applied push to this file as a JSON line ([`crate::actor::HistoryLine`]).
    pub history: Option<std::path::PathBuf>,
}

/// A shard that is serving.
pub struct RunningShard {
    /// The shard actor.
    pub actor: Addr<ShardActor>,
    /// The bound UDP address.
    pub local_addr: SocketAddr,
    /// Version restored from a checkpoint, if resumed.
    pub resumed_from: Option<u64>,
    shard: u32,
    endpoint: quinn::Endpoint,
    arbiter: Arbiter,
    accept: tokio::task::JoinHandle<()>,
    /// A standby's link to its primary.
    standby_task: Option<tokio::task::JoinHandle<()>>,
    /// The fence's rounds (replicated shards).
    fence_task: Option<tokio::task::JoinHandle<()>>,
    /// The node's role, as its actor publishes it.
    role: tokio::sync::watch::Receiver<RoleKind>,
    /// A standby's replication task reports here why it cannot follow (a refusal by the primary, a bad log).
    standby_failed: Option<tokio::sync::watch::Receiver<Option<String>>>,
}

use crate::address::host_of;
pub use crate::address::resolve;

/// The shard's checkpoint key: `opts`' own, else `checkpoint.key_file`, else `checkpoint.key` beside the TLS key.
/// A missing key is an error, never a fresh one: a new key would silently orphan every checkpoint written before.
fn checkpoint_key(
    cfg: &Config,
    own: Option<CheckpointKey>,
    tls: &TlsFiles,
) -> Result<CheckpointKey, Error> {
    if let Some(key) = own {
        return Ok(key);
    }
    let path = match &cfg.checkpoint.key_file {
        Some(p) => p.clone(),
        None => tls
            .paths
            .key
            .parent()
            .unwrap_or(std::path::Path::new("."))
            .join(CHECKPOINT_KEY_FILE),
    };
    if !path.exists() {
        return Err(Error::CheckpointKey(PkiError::CheckpointKey {
            reason: "does not exist: this shard authenticates its checkpoints with it. Bundles from \
                     `tether-server keygen` hold one; for an older bundle run \
                     `tether-server keygen checkpoint-key --bundle <its folder>` (or set checkpoint.key_file)"
                .into(),
            path,
        }));
    }
    CheckpointKey::load(&path).map_err(Error::CheckpointKey)
}

/// Starts shard `opts.shard` of `cfg`.
pub async fn start_shard(cfg: &Config, opts: ShardOptions) -> Result<RunningShard, Error> {
    let shards = cfg.cluster.servers.len() as u32;
    if opts.shard >= shards {
        return Err(Error::Address(format!(
            "--shard {} but cluster.servers lists {shards} server(s)",
            opts.shard
        )));
    }
    if opts.standby && !cfg.cluster.replicated() {
        return Err(Error::Address(
            "--standby but cluster.standbys lists no standby addresses".into(),
        ));
    }
    let listen = match opts.listen {
        Some(a) => a,
        None if opts.standby => resolve(&cfg.cluster.standbys[opts.shard as usize])?,
        None => resolve(&cfg.cluster.servers[opts.shard as usize])?,
    };
    let layout = match opts.layout {
        Some(l) => l,
        None => model_layout(cfg)?,
    };
    let spec = ShardSpec {
        shard: opts.shard,
        shards,
        seed: cfg.model.seed,
        optimizer: update_rule::shard_optimizer(cfg),
        staleness: cfg.cluster.staleness,
        worker_timeout_ms: cfg.cluster.worker_timeout_ms,
        spike_factor: 0.0,
    };
    let mut core = ShardCore::new(&layout, &spec);
    let threads = tether_common::chunk_pool::resolve_threads(cfg.shard.threads);
    let pool = ChunkPool::new(threads, &format!("tether-shard-{}", opts.shard)).map_err(|e| {
        Error::Threads {
            threads,
            reason: e.to_string(),
        }
    })?;
    info!(shard = opts.shard, threads, "shard threads");
    core.set_pool(Arc::new(pool));
    let tls = match opts.tls {
        Some(t) => t,
        None if opts.standby => TlsFiles::for_standby(&cfg.cluster.tls_dir, opts.shard)?,
        None => TlsFiles::for_server(&cfg.cluster.tls_dir, opts.shard)?,
    }
    .with_revoked(&cfg.cluster.revoked_serials());
    let mut guard = GuardSettings::derive(
        cfg,
        core.range().end.saturating_sub(core.range().start) as usize,
    );
    if let Some(factor) = opts.spike_factor {
        guard.factor = factor;
    }
    info!(
        shard = opts.shard,
        bound = guard.bound,
        floor = guard.floor,
        factor = guard.factor,
        "gradient-norm guard"
    );
    core.set_guard(guard);
    let store = CheckpointStore::new(
        cfg.checkpoint.dir.join(format!("shard-{}", opts.shard)),
        cfg.checkpoint.keep,
        checkpoint_key(cfg, opts.checkpoint_key, &tls)?,
    );
    let remote = match &cfg.checkpoint.url {
        Some(url) => Some(Arc::new(RemoteStore::from_url(
            url,
            opts.shard,
            cfg.checkpoint.keep,
        )?)),
        None => None,
    };
    let mut resumed_from = None;
    if opts.resume {
        let r = core.range();
        if let Some(remote) = &remote {
            // The newest remote checkpoint that verifies joins the local ones; the newest of all is then used.
            match remote
                .restore_into(&store, layout.hash(), opts.shard, (r.start, r.end))
                .await
            {
                Ok(Some((v, skipped))) => {
                    for (version, why) in &skipped {
                        warn!(shard = opts.shard, version, reason = %why, "skipped unusable remote checkpoint");
                    }
                    info!(shard = opts.shard, version = v, "fetched remote checkpoint");
                }
                Ok(None) => info!(shard = opts.shard, "no remote checkpoint"),
                // A store that is unreachable or holds only bad checkpoints must not hide good local ones.
                Err(e) => {
                    warn!(shard = opts.shard, error = %e, "cannot restore from the object store")
                }
            }
        }
        match store.load_latest(layout.hash(), opts.shard, (r.start, r.end))? {
            Some((snap, skipped)) => {
                for (path, why) in &skipped {
                    warn!(shard = opts.shard, path = %path.display(), reason = %why, "skipped unusable checkpoint");
                }
                let v = snap.version;
                core.restore(snap, 0)?;
                info!(shard = opts.shard, version = v, "resumed from checkpoint");
                resumed_from = Some(v);
            }
            None => info!(
                shard = opts.shard,
                "no checkpoint to resume from; starting fresh"
            ),
        }
    }
    // A lineage no earlier life of this shard used (RandomState is seeded from the OS per process), so that no worker
    // applies this life's deltas to a copy of another's.
    let lineage = std::hash::BuildHasher::hash_one(
        &std::collections::hash_map::RandomState::new(),
        (opts.shard, core.version()),
    );
    core.set_public(cfg.compression.pull_codec(), lineage);
    core.set_push_scale(update_rule::push_scale(cfg));
    core.set_push_scale_per_live(update_rule::push_scale_per_live(cfg));
    core.set_fragments(cfg.train.fragments);
    core.set_outer_at_close(update_rule::outer_at_close(cfg));
    core.set_rollback(&cfg.rollback);
    core.set_membership(Membership {
        workers: Some(cfg.cluster.rank_limit()),
        progress_timeout_ms: cfg.cluster.progress_timeout_ms,
    });
    core.set_quorum(QuorumSettings {
        quorum: cfg.cluster.quorum,
        grace_factor: cfg.cluster.grace_factor,
        grace_max_ms: cfg.cluster.worker_timeout_ms,
    });
    let range = core.range();
    let limits =
        FrameLimits::for_codec(&cfg.compression.codec(), (range.end - range.start) as usize);
    let tuning = TransportTuning::default().sized_for(&limits);
    let endpoint = server_endpoint(listen, &tls, &tuning)?;
    let local_addr = endpoint.local_addr().map_err(|source| NetError::Bind {
        addr: listen,
        source,
    })?;
    let layout_hash = core.layout_hash();
    let mut actor = ShardActor::new(
        core,
        Some(store),
        cfg.checkpoint.every_updates,
        cfg.cluster.worker_timeout_ms,
        opts.metrics.clone(),
    )
    .with_remote(remote, cfg.checkpoint.local)
    .with_config_digest(replication::config_digest(cfg));
    // Both nodes of a replicated shard start by finding their role: each asks the other to seed it. Each serves
    // only while the fence grants it the lease.
    let replicated = opts.standby || cfg.cluster.replicated();
    let node_index = u64::from(opts.standby);
    let incarnation = std::hash::BuildHasher::hash_one(
        &std::collections::hash_map::RandomState::new(),
        (opts.shard, std::process::id(), node_index),
    );
    let fence = replicated.then(|| {
        let role = if opts.standby { "standby" } else { "primary" };
        Fence::new(
            opts.shard,
            node_index,
            incarnation,
            cfg.cluster.failover_ms,
            Some(
                cfg.checkpoint
                    .dir
                    .join(format!("shard-{}", opts.shard))
                    .join(format!("fence-{role}.json")),
            ),
        )
    });
    if replicated {
        actor = actor.following();
    }
    if let Some(f) = &fence {
        actor = actor.with_fence(f.clone());
    }
    if let Some(path) = &opts.history {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| {
                Error::Address(format!("cannot open the history {}: {e}", path.display()))
            })?;
        actor = actor.with_history(file, if opts.standby { "standby" } else { "primary" });
    }
    let role = actor.role_watch();
    let (addr, arbiter) = actor.start_on_own_arbiter();
    let fence_task = match (&fence, cfg.cluster.witness.as_deref()) {
        (Some(f), Some(witness)) => {
            let solo_actor = addr.clone();
            f.on_solo(Box::new(move || solo_actor.do_send(SoloRecorded)));
            let addresses = cfg.cluster.shard_addresses(opts.shard as usize);
            let other = addresses
                .get(1 - node_index as usize)
                .cloned()
                .unwrap_or_default();
            let voters = vec![
                RemoteVoter {
                    index: 1 - node_index as u8,
                    addr: other,
                },
                RemoteVoter {
                    index: WITNESS_VOTER,
                    addr: witness.to_string(),
                },
            ];
            Some(tokio::spawn(fence_link::run(
                f.clone(),
                voters,
                tls.clone(),
            )))
        }
        (Some(_), None) => {
            return Err(Error::Address(
                "replicated shards need cluster.witness (the third vote of the fence)".into(),
            ))
        }
        _ => None,
    };
    let ctx = Arc::new(ConnectionContext {
        shard_actor: addr.clone(),
        shard: opts.shard,
        layout_hash,
        limits,
        next_conn: AtomicU64::new(0),
        admission: Admission::new(AdmissionLimits::for_workers(cfg.cluster.rank_limit())),
        role: role.clone(),
        fence: fence.clone(),
    });
    let accept = tokio::spawn(accept_loop(endpoint.clone(), ctx.clone()));
    let (standby_task, standby_failed) = if replicated {
        let (failed_tx, failed_rx) = tokio::sync::watch::channel(None);
        let addresses = cfg.cluster.shard_addresses(opts.shard as usize);
        let peer = if opts.standby {
            addresses.first()
        } else {
            addresses.get(1)
        }
        .cloned()
        .ok_or(Error::Replica(replication::ReplicaError::Mismatch(
            format!(
                "shard {} has no standby address in cluster.standbys",
                opts.shard
            ),
        )))?;
        let link = FollowLink {
            peer,
            designated_primary: !opts.standby,
            tls: tls.clone(),
            tuning: TransportTuning::for_failover(cfg.cluster.failover_ms).sized_for(&limits),
            actor: addr.clone(),
            ctx,
            shard: opts.shard,
            config_digest: replication::config_digest(cfg),
            limits,
            fence: fence.clone(),
            incarnation,
        };
        (
            Some(tokio::spawn(async move {
                if let Err(why) = link.run().await {
                    tracing::error!(shard = link_shard(&why), error = %why, "standby cannot follow its primary");
                    let _ = failed_tx.send(Some(why.to_string()));
                }
            })),
            Some(failed_rx),
        )
    } else {
        (None, None)
    };
    info!(shard = opts.shard, %local_addr, range = ?(range.start, range.end), standby = opts.standby, "shard serving");
    Ok(RunningShard {
        actor: addr,
        local_addr,
        resumed_from,
        shard: opts.shard,
        endpoint,
        arbiter,
        accept,
        standby_task,
        fence_task,
        standby_failed,
        role,
    })
}

/// How long a node of a replicated shard that holds no state keeps asking its peer to seed it before it gives up
/// (a standby whose primary never answers, or whose peer keeps saying it follows someone else); a node that holds
/// the shard's state keeps asking, and asking for the lease.
pub const FOLLOW_DEADLINE: Duration = Duration::from_secs(60);

/// How one node of a replicated shard finds its role and then follows. It dials the shard's other node and asks to
/// be its standby:
/// - the peer leads: it sends its state image and then its log; this node applies both and acknowledges each entry,
///   and asks the fence for the lease when the link is silent for `cluster.failover_ms`;
/// - the peer holds no state either (`Unseeded`: both nodes are starting) or does not answer: the designated
///   primary (`cluster.servers[K]`), or a node that holds the shard's state, asks for the lease; a standby without
///   state asks again (and for the lease too, once the peer has held nothing for three failover periods);
/// - the peer follows, holding the shard's state (`NotPrimary`: its primary has just died and it has not taken
///   over yet): ask again; while that lasts past a stagger (one failover period for the designated primary, two for
///   the other node), a node that holds the shard's state asks for the lease, so that two followers (a primary that
///   lost its lease and a standby whose campaign found no majority) do not wait for each other forever;
/// - the peer has a standby already: ask again.
///
/// A node leads only while the fence ([`crate::fence_link`]) grants it the lease: with the lease it takes over,
/// and when it loses the lease it steps down and asks to be seeded again. Without a majority within two leases it
/// goes back to asking. So a primary that restarts after its standby took over comes back as that node's standby,
/// seeded from its image, and a node cut off from the others never serves beside the one that took over.
struct FollowLink {
    peer: String,
    designated_primary: bool,
    tls: TlsFiles,
    tuning: TransportTuning,
    actor: Addr<ShardActor>,
    ctx: Arc<ConnectionContext>,
    shard: u32,
    config_digest: u64,
    limits: FrameLimits,
    fence: Option<Arc<Fence>>,
    incarnation: u64,
}

/// Why a node stopped following without taking over.
#[derive(Debug, thiserror::Error)]
enum FollowError {
    #[error("shard {shard}: the shard's other node at {peer} refused this one: {message}")]
    Refused {
        shard: u32,
        peer: String,
        message: String,
    },
    #[error("shard {shard}: the shard's other node at {peer} did not seed this one for {waited:?}: {last}")]
    Unreachable {
        shard: u32,
        peer: String,
        waited: Duration,
        last: String,
    },
    #[error("shard {shard}: the shard actor is gone")]
    ActorGone { shard: u32 },
}

fn link_shard(e: &FollowError) -> u32 {
    match e {
        FollowError::Refused { shard, .. }
        | FollowError::Unreachable { shard, .. }
        | FollowError::ActorGone { shard } => *shard,
    }
}

/// How a session with the shard's other node ended.
enum Session {
    /// It did not answer (not up yet, or dead).
    NotStarted(String),
    /// It holds no state either.
    Unseeded(String),
    /// It has a standby already, or is busy: ask again.
    Wait(String),
    /// It follows too (`NotPrimary`): nobody leads the shard.
    PeerFollows(String),
    /// This node was seeded and followed, and the link is gone: take over.
    Lost(String),
}

impl Session {
    /// The outcome's kind, and what the peer said.
    fn split(self) -> (SessionKind, String) {
        match self {
            Session::NotStarted(w) => (SessionKind::NotStarted, w),
            Session::Unseeded(w) => (SessionKind::Unseeded, w),
            Session::Wait(w) => (SessionKind::Wait, w),
            Session::PeerFollows(w) => (SessionKind::PeerFollows, w),
            Session::Lost(w) => (SessionKind::Lost, w),
        }
    }
}

/// How a session with the shard's other node ended, without the peer's words: the input of [`follow_step`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SessionKind {
    /// It did not answer.
    NotStarted,
    /// It holds no state either.
    Unseeded,
    /// It has a standby already, or is busy.
    Wait,
    /// It follows too: nobody leads the shard.
    PeerFollows,
    /// This node followed it and the link is gone.
    Lost,
}

/// When the conditions [`follow_step`] waits on began.
#[derive(Debug, Clone, Copy)]
struct FollowTimers {
    /// Since this node last asked for the lease (or started): the [`FOLLOW_DEADLINE`] of a node without state.
    started: std::time::Instant,
    /// Since the peer first said it holds nothing, in a row.
    unseeded_since: Option<std::time::Instant>,
    /// Since the peer first said it follows too, in a row.
    both_follow_since: Option<std::time::Instant>,
}

impl FollowTimers {
    fn new(now: std::time::Instant) -> FollowTimers {
        FollowTimers {
            started: now,
            unseeded_since: None,
            both_follow_since: None,
        }
    }
}

/// What a following node does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FollowStep {
    /// Ask the voters for the lease (the reason, for the log).
    Campaign(&'static str),
    /// Ask the peer to seed this node again.
    AskAgain,
    /// Stop: a node without state was not seeded within [`FOLLOW_DEADLINE`].
    GiveUp,
}

/// The follower's rule, pure (the session's outcome, this node's standing, when each condition began, `now`, one
/// failover period `failover`):
/// - the followed primary is lost: campaign;
/// - the peer does not answer or holds nothing, and this node is the designated primary or holds the shard's
///   state: campaign;
/// - the peer has held nothing for three failover periods: campaign (both nodes restarted);
/// - the peer follows too and this node is the designated primary or holds the shard's state, for one failover
///   period (designated) or two (the other node): campaign, so that two followers do not wait for each other
///   forever (a primary that lost its lease, a standby whose campaign found no majority);
/// - otherwise ask again, and give up once a node without state has asked for [`FOLLOW_DEADLINE`].
///
/// The caller resets `timers.started` after a campaign. The fence decides who serves; campaigning is always safe.
fn follow_step(
    kind: SessionKind,
    designated: bool,
    seeded: bool,
    timers: &mut FollowTimers,
    now: std::time::Instant,
    failover: Duration,
) -> FollowStep {
    let holds = designated || seeded;
    let since =
        |t: &mut Option<std::time::Instant>| now.saturating_duration_since(*t.get_or_insert(now));
    match kind {
        SessionKind::Lost => return FollowStep::Campaign("primary lost"),
        SessionKind::NotStarted | SessionKind::Unseeded if holds => {
            return FollowStep::Campaign("no primary to follow")
        }
        SessionKind::Unseeded => {
            timers.both_follow_since = None;
            if since(&mut timers.unseeded_since) > 3 * failover {
                timers.unseeded_since = None;
                return FollowStep::Campaign("nobody holds the shard's state");
            }
        }
        SessionKind::PeerFollows => {
            timers.unseeded_since = None;
            let stagger = failover * if designated { 1 } else { 2 };
            if holds && since(&mut timers.both_follow_since) > stagger {
                timers.both_follow_since = None;
                return FollowStep::Campaign("both nodes follow");
            }
        }
        SessionKind::NotStarted | SessionKind::Wait => {
            timers.unseeded_since = None;
            timers.both_follow_since = None;
        }
    }
    if !seeded && now.saturating_duration_since(timers.started) > FOLLOW_DEADLINE {
        FollowStep::GiveUp
    } else {
        FollowStep::AskAgain
    }
}

impl FollowLink {
    async fn run(&self) -> Result<(), FollowError> {
        use tether_common::net::client_endpoint;
        let endpoint =
            client_endpoint(&self.tls, &self.tuning).map_err(|e| FollowError::Unreachable {
                shard: self.shard,
                peer: self.peer.clone(),
                waited: Duration::ZERO,
                last: e.to_string(),
            })?;
        let mut timers = FollowTimers::new(std::time::Instant::now());
        let mut seeded = false;
        loop {
            let session = self.session(&endpoint, &mut seeded).await?;
            let (kind, last) = session.split();
            match follow_step(
                kind,
                self.designated_primary,
                seeded,
                &mut timers,
                std::time::Instant::now(),
                self.tuning.idle_timeout,
            ) {
                FollowStep::Campaign(why) => {
                    warn!(shard = self.shard, peer = %self.peer, reason = %last, "{why}: asking for the lease");
                    self.campaign().await?;
                    timers.started = std::time::Instant::now();
                    continue;
                }
                FollowStep::GiveUp => {
                    return Err(FollowError::Unreachable {
                        shard: self.shard,
                        peer: self.peer.clone(),
                        waited: FOLLOW_DEADLINE,
                        last,
                    });
                }
                FollowStep::AskAgain => {}
            }
            debug!(shard = self.shard, peer = %self.peer, reason = %last, "not seeded yet; asking again");
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Asks the voters for the lease; with a majority, leads until the lease is lost, then steps down (and the
    /// caller asks to be seeded again). Without one within two leases, returns to asking to be seeded.
    async fn campaign(&self) -> Result<(), FollowError> {
        let Some(fence) = &self.fence else {
            return self.lead().await;
        };
        fence.want(true);
        let deadline = std::time::Instant::now() + Duration::from_millis(2 * fence.lease_ms());
        while !fence.serving() {
            if std::time::Instant::now() > deadline {
                fence.want(false);
                debug!(
                    shard = self.shard,
                    "no majority for the lease; asking to be seeded again"
                );
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // Register for the loss before serving, so that no loss is missed.
        let lost = fence.deposed();
        tokio::pin!(lost);
        lost.as_mut().enable();
        self.lead().await?;
        info!(shard = self.shard, term = fence.term(), "holding the lease");
        lost.await;
        fence.want(false);
        self.actor
            .send(StepDown)
            .await
            .map_err(|_| FollowError::ActorGone { shard: self.shard })?;
        Ok(())
    }

    /// Serves as the shard's primary from the state this node holds.
    async fn lead(&self) -> Result<(), FollowError> {
        let (version, entries, max_conn) = self
            .actor
            .send(TakeOver)
            .await
            .map_err(|_| FollowError::ActorGone { shard: self.shard })?;
        // New connections take ids above every id the state names, before any worker is let in.
        self.ctx
            .next_conn
            .fetch_max(max_conn.saturating_add(1), Ordering::AcqRel);
        info!(
            shard = self.shard,
            version, entries, "serving as the shard's primary"
        );
        Ok(())
    }

    async fn session(
        &self,
        endpoint: &quinn::Endpoint,
        seeded: &mut bool,
    ) -> Result<Session, FollowError> {
        use tether_common::net::{connect_shard, ControlChannel};
        use tether_common::protocol::{read_frame, Control};
        let shard = self.shard;
        let refused = |message: String| FollowError::Refused {
            shard,
            peer: self.peer.clone(),
            message,
        };
        let gone = || FollowError::ActorGone { shard };
        let Ok(addr) = resolve(&self.peer) else {
            return Ok(Session::NotStarted(format!("cannot resolve {}", self.peer)));
        };
        let host = host_of(&self.peer);
        let conn = match connect_shard(endpoint, addr, &host, shard).await {
            Ok(c) => c,
            Err(e) if e.is_permanent() => return Err(refused(e.to_string())),
            // It answered (it is alive, but busy): never a reason for a designated primary to lead.
            Err(e) if e.remote_close_code().is_some() => return Ok(Session::Wait(e.to_string())),
            Err(e) => return Ok(Session::NotStarted(e.to_string())),
        };
        let layout_hash = self.actor.send(GetLayoutHash).await.map_err(|_| gone())?;
        let start = async {
            let mut control = ControlChannel::open(&conn).await?;
            control
                .send(&Control::ReplicaHello {
                    shard,
                    layout_hash,
                    config_digest: self.config_digest,
                    incarnation: self.incarnation,
                })
                .await?;
            let answer = control.recv().await?;
            Ok::<_, NetError>((control, answer))
        };
        let (control, answer) = match start.await {
            Ok(x) => x,
            Err(e) if e.is_unseeded() => return Ok(Session::Unseeded(e.to_string())),
            Err(e) if e.is_not_primary() => return Ok(Session::PeerFollows(e.to_string())),
            Err(e) if e.is_permanent() => return Err(refused(e.to_string())),
            Err(e) if e.remote_close_code().is_some() => return Ok(Session::Wait(e.to_string())),
            Err(e) => return Ok(Session::NotStarted(e.to_string())),
        };
        let image_seq = match answer {
            Control::ReplicaWelcome { seq, .. } => seq,
            Control::Error { code, message } => {
                let why = format!("{code}: {message}");
                return match code {
                    ErrorCode::Unseeded => Ok(Session::Unseeded(why)),
                    ErrorCode::NotPrimary => Ok(Session::PeerFollows(why)),
                    ErrorCode::Overloaded => Ok(Session::Wait(why)),
                    _ => Err(refused(why)),
                };
            }
            other => return Err(refused(format!("{} instead of a welcome", other.name()))),
        };
        let (mut sender, _receiver) = control.split();
        let mut stream = match conn.accept_uni().await {
            Ok(s) => s,
            Err(e) => return Ok(Session::NotStarted(e.to_string())),
        };
        let mut buf = rkyv::util::AlignedVec::new();
        // The state image first: until it is adopted this node holds nothing it could take over with.
        match read_frame(
            &mut stream,
            &self.limits,
            &[FrameKind::ReplicaImage],
            &mut buf,
        )
        .await
        {
            Ok(Some(_)) => {}
            Ok(None) => {
                return Ok(Session::NotStarted(
                    "the peer ended before its image".into(),
                ))
            }
            Err(tether_common::protocol::ReadFrameError::Protocol(p)) => {
                return Err(refused(format!("bad image frame: {p}")))
            }
            Err(e) => return Ok(Session::NotStarted(e.to_string())),
        }
        let image_bytes = buf.len();
        let adopted = self
            .actor
            .send(Follow {
                image: buf.to_vec(),
                seq: image_seq,
            })
            .await
            .map_err(|_| gone())?;
        if let Err(e) = adopted {
            // A bad image changes nothing here: this node keeps what it holds and asks again (or leads, if the
            // voters let it), instead of stopping.
            warn!(shard, peer = %self.peer, error = %e, "refused the peer's state image");
            return Ok(Session::NotStarted(format!("refused its image: {e}")));
        }
        *seeded = true;
        info!(shard, peer = %self.peer, image_bytes, "seeded from the primary's image; following its log");
        if let Err(e) = sender.send(&Control::ReplicaAck { seq: image_seq }).await {
            return Ok(Session::Lost(e.to_string()));
        }
        loop {
            match read_frame(&mut stream, &self.limits, &[FrameKind::Replica], &mut buf).await {
                Ok(Some(_)) => {}
                Ok(None) => return Ok(Session::Lost("the primary ended the log".into())),
                Err(tether_common::protocol::ReadFrameError::Protocol(p)) => {
                    return Ok(Session::Lost(format!("bad replication frame: {p}")))
                }
                Err(e) => return Ok(Session::Lost(e.to_string())),
            }
            // A bad entry changes nothing here; the standby stops following (it acknowledges nothing more, so the
            // primary drops it and serves on once the fence records that) and asks again.
            let entry = match replication::decode(&buf) {
                Ok(e) => e,
                Err(e) => return Ok(Session::Lost(format!("bad replication entry: {e}"))),
            };
            let seq = match self
                .actor
                .send(Replicate(entry))
                .await
                .map_err(|_| gone())?
            {
                Ok(seq) => seq,
                Err(e) => return Ok(Session::Lost(format!("refused replication entry: {e}"))),
            };
            if let Err(e) = sender.send(&Control::ReplicaAck { seq }).await {
                return Ok(Session::Lost(e.to_string()));
            }
        }
    }
}

/// Decides on each incoming connection attempt at once (the accept loop never waits) and spawns a task for those
/// queued: it waits for a handshake slot of the peer's address (bounded by [`MAX_HANDSHAKE_WAIT`]), then serves
/// the connection.
async fn accept_loop(endpoint: quinn::Endpoint, ctx: Arc<ConnectionContext>) {
    while let Some(incoming) = endpoint.accept().await {
        let peer = incoming.remote_address();
        match ctx
            .admission
            .handshake(peer.ip(), incoming.remote_address_validated())
        {
            HandshakeVerdict::Queue(turn) => {
                let ctx = ctx.clone();
                tokio::spawn(async move {
                    match tokio::time::timeout(MAX_HANDSHAKE_WAIT, turn.admitted()).await {
                        Ok(Ok(ticket)) => serve_connection(incoming, ticket, ctx).await,
                        Ok(Err(why)) => {
                            debug!(shard = ctx.shard, %peer, ?why, "connection attempt refused: handshake budget");
                            incoming.refuse();
                        }
                        Err(_) => {
                            debug!(shard = ctx.shard, %peer, "connection attempt refused: waited too long for a handshake slot");
                            incoming.refuse();
                        }
                    }
                });
            }
            HandshakeVerdict::Retry => {
                if let Err(e) = incoming.retry() {
                    // Only an attempt that already carries a retry token cannot be retried; it is validated, so
                    // this does not happen, and refusing is the safe answer if it did.
                    e.into_incoming().refuse();
                }
            }
            HandshakeVerdict::Refuse(why) => {
                debug!(shard = ctx.shard, %peer, ?why, "connection attempt refused: handshake budget");
                incoming.refuse();
            }
        }
    }
}

impl RunningShard {
    /// Version, counters and live workers of the shard.
    pub async fn stats(&self) -> Result<(u64, ShardStats, usize), Error> {
        self.actor
            .send(GetStats)
            .await
            .map_err(|_| Error::ActorGone)
    }

    /// Waits, at most `limit`, until the standby that follows this node acknowledged every input the node took so
    /// far; true once it has, or when none follows (or this node does not serve). A primary about to exit after
    /// its last worker's goodbye calls it, so that its standby holds that goodbye and exits as well instead of
    /// taking over and waiting for a worker that already left.
    pub async fn standby_caught_up(&self, limit: Duration) -> bool {
        let Ok(Some((mut acked, seq))) = self.actor.send(StandbyHolds).await else {
            return true;
        };
        // A standby that is dropped meanwhile reports u64::MAX (nothing to wait for) or its watch closes.
        let caught_up = tokio::time::timeout(limit, acked.wait_for(|a| *a >= seq))
            .await
            .is_ok_and(|r| r.is_ok());
        caught_up
    }

    /// Whether this process is a standby that still follows its primary (it has not taken over).
    pub fn is_following(&self) -> bool {
        *self.role.borrow() != RoleKind::Primary
    }

    /// Resolves with the reason when this standby cannot follow its primary (refused, or a bad log); never for a
    /// primary, or a standby that follows or took over.
    pub async fn standby_failed(&self) -> String {
        let Some(mut rx) = self.standby_failed.clone() else {
            return std::future::pending().await;
        };
        loop {
            if let Some(why) = rx.borrow_and_update().clone() {
                return why;
            }
            if rx.changed().await.is_err() {
                return std::future::pending().await;
            }
        }
    }

    /// Stops accepting, closes every connection, optionally writes a final checkpoint, and stops the actor.
    /// Returns the final version and counters.
    pub async fn shutdown(self, final_checkpoint: bool) -> Result<(u64, ShardStats), Error> {
        self.accept.abort();
        if let Some(f) = &self.standby_task {
            f.abort();
        }
        if let Some(f) = &self.fence_task {
            f.abort();
        }
        self.endpoint
            .close(ErrorCode::Shutdown.close_code(), b"server shutting down");
        if final_checkpoint {
            match self.actor.send(CheckpointNow).await {
                Ok(Ok(Some(v))) => {
                    info!(shard = self.shard, version = v, "final checkpoint written")
                }
                Ok(Ok(None)) => {}
                Ok(Err(e)) => warn!(shard = self.shard, error = %e, "final checkpoint failed"),
                Err(_) => return Err(Error::ActorGone),
            }
        }
        let (version, stats, _) = self
            .actor
            .send(GetStats)
            .await
            .map_err(|_| Error::ActorGone)?;
        self.arbiter.stop();
        Ok((version, stats))
    }

    /// Closes every connection abruptly without a checkpoint (tests of crash recovery).
    pub fn kill(self) {
        self.accept.abort();
        if let Some(f) = &self.standby_task {
            f.abort();
        }
        if let Some(f) = &self.fence_task {
            f.abort();
        }
        self.endpoint
            .close(ErrorCode::Shutdown.close_code(), b"killed");
        self.arbiter.stop();
    }
}

/// The shard's part of a run report.
pub fn shard_report(cfg: &Config, stats: &ShardStats) -> RunReport {
    let mut report = RunReport::for_config(cfg);
    report.set_rollbacks(crate::rollback::report_fields([(
        stats.rollbacks.as_slice(),
        stats.rollbacks_missed,
    )]));
    report.add_shard(&stats.counters());
    report.add_traffic(&stats.traffic());
    report.set_staleness(stats.staleness.max(), stats.staleness.report_buckets());
    report
}

#[cfg(test)]
mod follow_step_tests {
    use super::*;
    use std::time::Instant;

    const FAILOVER: Duration = Duration::from_millis(1000);

    /// Feeds `kind` every 250 ms from `t0` until the rule campaigns or gives up; returns the step and when.
    fn run_until_decided(
        kind: SessionKind,
        designated: bool,
        seeded: bool,
    ) -> (FollowStep, Duration) {
        let t0 = Instant::now();
        let mut timers = FollowTimers::new(t0);
        let mut t = t0;
        for _ in 0..1_000 {
            let step = follow_step(kind, designated, seeded, &mut timers, t, FAILOVER);
            if step != FollowStep::AskAgain {
                return (step, t - t0);
            }
            t += Duration::from_millis(250);
        }
        (FollowStep::AskAgain, t - t0)
    }

    #[test]
    fn two_followers_that_hold_state_ask_for_the_lease_after_a_stagger_the_designated_primary_first(
    ) {
        // Found at 64 workers × 8 shards: a primary that lost its lease and a standby whose campaign found no
        // majority answered each other `NotPrimary` until the primary gave up 60 s later.
        let (step, at) = run_until_decided(SessionKind::PeerFollows, true, false);
        assert_eq!(step, FollowStep::Campaign("both nodes follow"));
        assert!(
            at > FAILOVER && at <= FAILOVER + Duration::from_millis(250),
            "{at:?}"
        );
        let (step, at) = run_until_decided(SessionKind::PeerFollows, false, true);
        assert_eq!(step, FollowStep::Campaign("both nodes follow"));
        assert!(
            at > 2 * FAILOVER && at <= 2 * FAILOVER + Duration::from_millis(250),
            "{at:?}"
        );
    }

    #[test]
    fn a_follower_without_state_waits_for_the_peer_and_gives_up_at_the_deadline() {
        let (step, at) = run_until_decided(SessionKind::PeerFollows, false, false);
        assert_eq!(step, FollowStep::GiveUp);
        assert!(at > FOLLOW_DEADLINE, "{at:?}");
        // A peer with a standby already never makes this node campaign.
        let (step, _) = run_until_decided(SessionKind::Wait, false, true);
        assert_eq!(step, FollowStep::AskAgain);
    }

    #[test]
    fn a_lost_primary_or_an_absent_peer_makes_a_node_with_state_campaign_at_once() {
        let now = Instant::now();
        let mut timers = FollowTimers::new(now);
        for (kind, designated, seeded) in [
            (SessionKind::Lost, false, true),
            (SessionKind::NotStarted, true, false),
            (SessionKind::Unseeded, false, true),
        ] {
            assert!(matches!(
                follow_step(kind, designated, seeded, &mut timers, now, FAILOVER),
                FollowStep::Campaign(_)
            ));
        }
        // Both restarted with nothing: the other node asks after three failover periods.
        let (step, at) = run_until_decided(SessionKind::Unseeded, false, false);
        assert_eq!(step, FollowStep::Campaign("nobody holds the shard's state"));
        assert!(at > 3 * FAILOVER, "{at:?}");
    }

    #[test]
    fn another_answer_between_two_follows_restarts_the_stagger() {
        let t0 = Instant::now();
        let mut timers = FollowTimers::new(t0);
        let step = |timers: &mut FollowTimers, kind, ms| {
            follow_step(
                kind,
                false,
                true,
                timers,
                t0 + Duration::from_millis(ms),
                FAILOVER,
            )
        };
        assert_eq!(
            step(&mut timers, SessionKind::PeerFollows, 0),
            FollowStep::AskAgain
        );
        assert_eq!(
            step(&mut timers, SessionKind::Wait, 1500),
            FollowStep::AskAgain
        );
        assert_eq!(
            step(&mut timers, SessionKind::PeerFollows, 2500),
            FollowStep::AskAgain
        );
        assert_eq!(
            step(&mut timers, SessionKind::PeerFollows, 4600),
            FollowStep::Campaign("both nodes follow")
        );
    }
}

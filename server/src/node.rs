//! A running shard server: builds the `ShardCore` from the configuration (resuming from the newest verified
//! checkpoint when asked), starts its `ShardActor` on an Arbiter, binds the mutual-TLS QUIC endpoint and spawns one
//! connection task (the private `connection` shell) per QUIC connection that [`crate::admission`] lets in: each
//! attempt is accepted, sent a stateless retry or refused before any TLS work, so no peer can queue the others
//! behind its own. Used by the `tether-server` binary and by `tether::LocalCluster`.
//! Must be called inside an actix `System` running on a multi-threaded tokio runtime.

use std::net::SocketAddr;
use std::sync::Arc;

use actix::{Addr, Arbiter};
use tracing::{debug, info, warn};

use tether_common::config::Config;
use tether_common::layout::{model_layout, Layout};
use tether_common::metrics::ServerMetrics;
use tether_common::net::{server_endpoint, NetError, TlsFiles, TransportTuning};
use tether_common::pki::{CheckpointKey, PkiError, CHECKPOINT_KEY_FILE};
use tether_common::protocol::{ErrorCode, FrameLimits};
use tether_common::report::RunReport;

use crate::actor::{CheckpointNow, GetStats, ShardActor};
use crate::admission::{Admission, AdmissionLimits, HandshakeVerdict, MAX_HANDSHAKE_WAIT};
use crate::checkpoint::CheckpointStore;
use crate::connection::{serve_connection, ConnectionContext};
use crate::error::Error;
use crate::norm_guard::GuardSettings;
use crate::quorum::QuorumSettings;
use crate::remote::RemoteStore;
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
}

/// Parses `host:port` (resolving names) into a socket address.
pub fn resolve(addr: &str) -> Result<SocketAddr, Error> {
    use std::net::ToSocketAddrs;
    addr.to_socket_addrs()
        .map_err(|e| Error::Address(format!("cannot resolve {addr:?}: {e}")))?
        .next()
        .ok_or_else(|| Error::Address(format!("{addr:?} resolves to no address")))
}

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
    let listen = match opts.listen {
        Some(a) => a,
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
    let tls = match opts.tls {
        Some(t) => t,
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
    let actor = ShardActor::new(
        core,
        Some(store),
        cfg.checkpoint.every_updates,
        cfg.cluster.worker_timeout_ms,
        opts.metrics.clone(),
    )
    .with_remote(remote, cfg.checkpoint.local);
    let (addr, arbiter) = actor.start_on_own_arbiter();
    let ctx = Arc::new(ConnectionContext {
        shard_actor: addr.clone(),
        shard: opts.shard,
        layout_hash,
        limits,
        next_conn: Default::default(),
        admission: Admission::new(AdmissionLimits::for_workers(cfg.cluster.rank_limit())),
    });
    let accept = tokio::spawn(accept_loop(endpoint.clone(), ctx));
    info!(shard = opts.shard, %local_addr, range = ?(range.start, range.end), "shard serving");
    Ok(RunningShard {
        actor: addr,
        local_addr,
        resumed_from,
        shard: opts.shard,
        endpoint,
        arbiter,
        accept,
    })
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

    /// Stops accepting, closes every connection, optionally writes a final checkpoint, and stops the actor.
    /// Returns the final version and counters.
    pub async fn shutdown(self, final_checkpoint: bool) -> Result<(u64, ShardStats), Error> {
        self.accept.abort();
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

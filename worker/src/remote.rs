//! [`RemoteWorker`]: a worker whose gradients are computed outside Tether — a PyTorch module through the Python
//! package, or any host program. It owns the QUIC driver and the worker's protocol state machine on a private tokio
//! runtime (one I/O thread), and offers blocking calls: [`RemoteWorker::pull`] writes the shards' parameters
//! straight into the caller's buffer, [`RemoteWorker::push`] clips, applies error feedback, encodes, frames and
//! queues an update, [`RemoteWorker::settle`] and [`RemoteWorker::close`] finish the session with a goodbye.
//!
//! A call drives the driver on the caller's thread (one lock), so the caller's buffer is written without a copy and
//! without unsafe code; each call also services the protocol's due timers. When no call has come for half a
//! heartbeat period, a keep-alive task takes the session and answers the protocol (heartbeats, outcomes,
//! reconnects), so a caller may compute for as long as it likes without being evicted; the next call takes the
//! session back (the lock is handed over in FIFO order). A caller that calls often never waits for that hand-over.
//! Nothing here touches process-wide state: the runtime is private and stops with the worker.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::sync::Notify;
use tracing::{debug, warn};

use tether_common::config::Config;
use tether_common::layout::Layout;
use tether_common::net::{client_endpoint, TlsFiles, TransportTuning};
use tether_common::numeric::sum_of_squares;
use tether_common::protocol::{ErrorCode, Outcome};

use crate::driver::{shard_ranges, Driver, DriverConfig};
use crate::error::WorkerError;
use crate::step::PushEncoder;

/// Everything a [`RemoteWorker`] needs.
#[derive(Clone)]
pub struct RemoteOptions {
    /// Rank (0-based, below `cluster.workers`).
    pub rank: u32,
    /// Cluster configuration.
    pub config: Config,
    /// The parameter layout the shards hold (a model file's, or a built-in model's).
    pub layout: Layout,
    /// Shard addresses (`host:port`), index = shard.
    pub servers: Vec<String>,
    /// TLS server name per shard.
    pub server_names: Vec<String>,
    /// This worker's certificate and the cluster CA.
    pub tls: TlsFiles,
    /// Give up when a shard stays unreachable this long.
    pub reconnect_deadline: Duration,
}

impl RemoteOptions {
    /// Options for `rank` of `config` over `layout`: shard addresses and TLS names from `cluster.servers`, the
    /// bundle from `tls_dir` (keygen's output folder holding `worker-R/`, or one bundle).
    pub fn new(
        config: Config,
        layout: Layout,
        rank: u32,
        tls_dir: &std::path::Path,
        reconnect_deadline: Duration,
    ) -> Result<Self, WorkerError> {
        if rank >= config.cluster.rank_limit() {
            return Err(WorkerError::Config(
                tether_common::config::ConfigError::Invalid {
                    key: "cluster.workers",
                    reason: format!(
                        "rank {rank} but ranks 0..{} may join (cluster.workers, cluster.max_workers)",
                        config.cluster.rank_limit()
                    ),
                },
            ));
        }
        let tls = TlsFiles::for_worker(tls_dir, rank)
            .map_err(WorkerError::Endpoint)?
            .with_revoked(&config.cluster.revoked_serials());
        let servers = config.cluster.servers.clone();
        let server_names = servers.iter().map(|s| server_name(s)).collect();
        Ok(Self {
            rank,
            config,
            layout,
            servers,
            server_names,
            tls,
            reconnect_deadline,
        })
    }
}

/// The TLS name of a `host:port` address: its host, without IPv6 brackets.
pub fn server_name(addr: &str) -> String {
    addr.rsplit_once(':')
        .map_or(addr, |(h, _)| h)
        .trim_matches(['[', ']'])
        .to_string()
}

/// What a pushed update is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpdateKind {
    /// A gradient: clipped to `train.clip_norm`, then encoded.
    Gradient,
    /// A local-step round's pseudo-gradient θ_start − θ_end (DiLoCo): encoded as it is.
    Delta,
}

/// What a pull returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pulled {
    /// The clock the parameters answer (rounds this worker pushed).
    pub clock: u64,
    /// Whether a shard rolled back since the last pull (what was built on the old trajectory should be reset).
    pub rolled_back: bool,
}

/// Counters of a remote worker's session.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RemoteReport {
    /// Rank.
    pub rank: u32,
    /// Rounds pushed or skipped (the worker's clock).
    pub clock: u64,
    /// Updates pushed.
    pub pushes: u64,
    /// Rounds finished with a skip marker (non-finite update, or [`RemoteWorker::skip`]).
    pub skips: u64,
    /// Pushes a shard refused or a rejoin dropped.
    pub pushes_refused: u64,
    /// Pull replies dropped because they answered a superseded request.
    pub stale_replies_dropped: u64,
    /// Rollbacks seen (one per shard per rollback).
    pub rollbacks_seen: u64,
    /// Reconnections after a link broke.
    pub reconnects: u64,
    /// Largest clock lead a used pull reply reported.
    pub max_clock_lead: u64,
    /// Bytes of the encoded push frames.
    pub wire_bytes_pushed: u64,
    /// Bytes of every pull reply received.
    pub wire_bytes_pulled: u64,
    /// The per-step fp32 reference: 4 bytes per parameter per training step an update covers.
    pub fp32_bytes_pushed: u64,
    /// The per-step fp32 reference: 4 bytes per parameter per pull, and per extra step a local-step round covers.
    pub fp32_bytes_pulled: u64,
    /// Seconds spent in pulls (waiting for the SSP bound and the replies).
    pub pull_wait_seconds: f64,
    /// Seconds spent in pushes (clip, error feedback, encode, frame, queue).
    pub push_seconds: f64,
}

/// The state a call or the keep-alive task works on, behind one lock.
struct Session {
    driver: Driver,
    coder: PushEncoder,
    update: Vec<f32>,
    frames: Vec<Vec<u8>>,
    report: RemoteReport,
    /// The error that ended the session (reported once as itself, then as [`WorkerError::Ended`]).
    failed: Option<WorkerError>,
    failure: Option<String>,
}

struct Shared {
    session: tokio::sync::Mutex<Session>,
    /// Callers waiting for the session: the keep-alive task steps aside while any are.
    waiting: AtomicUsize,
    wake: Notify,
    stopping: AtomicBool,
    /// When a call last released the session (ms since `epoch`).
    released_ms: AtomicU64,
    epoch: Instant,
    /// How long the session stays with the caller after a call before the keep-alive task takes it.
    idle: Duration,
}

impl Shared {
    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// How long ago a call released the session.
    fn since_release(&self) -> Duration {
        Duration::from_millis(
            self.now_ms()
                .saturating_sub(self.released_ms.load(Ordering::SeqCst)),
        )
    }
}

/// The session held by a call; records the release time when dropped.
struct Held<'a> {
    guard: tokio::sync::MutexGuard<'a, Session>,
    shared: &'a Shared,
}

impl std::ops::Deref for Held<'_> {
    type Target = Session;
    fn deref(&self) -> &Session {
        &self.guard
    }
}

impl std::ops::DerefMut for Held<'_> {
    fn deref_mut(&mut self) -> &mut Session {
        &mut self.guard
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.shared
            .released_ms
            .store(self.shared.now_ms(), Ordering::SeqCst);
    }
}

/// A worker session driven by blocking calls from the host program (see the module docs).
pub struct RemoteWorker {
    shared: Arc<Shared>,
    runtime: Option<tokio::runtime::Runtime>,
    layout: Layout,
    rank: u32,
    closed: Option<RemoteReport>,
}

impl RemoteWorker {
    /// Starts the session's runtime and binds the QUIC endpoint; the first pull connects to the shards.
    pub fn start(opts: RemoteOptions) -> Result<Self, WorkerError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name(format!("tether-worker-{}", opts.rank))
            .enable_all()
            .build()
            .map_err(WorkerError::Runtime)?;
        let cfg = &opts.config;
        let layout = opts.layout.clone();
        let shards = opts.servers.len();
        if shards == 0 {
            return Err(WorkerError::Config(
                tether_common::config::ConfigError::Invalid {
                    key: "cluster.servers",
                    reason: "no shard address".into(),
                },
            ));
        }
        if cfg.train.fragments > 1 {
            // The session pushes what its caller computed, whole shards at a time; fragments are the built-in loop's.
            return Err(WorkerError::Config(
                tether_common::config::ConfigError::Invalid {
                    key: "train.fragments",
                    reason: "streamed fragments run in tether-worker's own loop, not in a remote session; use 1"
                        .into(),
                },
            ));
        }
        let ranges = shard_ranges(&layout, shards);
        let coder = PushEncoder::new(
            opts.rank,
            ranges.iter().map(|r| r.0 as usize..r.1 as usize).collect(),
            cfg.compression.codec(),
            cfg.compression.error_feedback,
            cfg.train.clip_norm,
        )?;
        let idle = DriverConfig::heartbeat_period(cfg) / 2;
        let driver = {
            // Binding the endpoint's UDP socket needs the runtime's reactor.
            let _enter = runtime.enter();
            let endpoint = client_endpoint(&opts.tls, &TransportTuning::for_cluster(cfg))
                .map_err(WorkerError::Endpoint)?;
            Driver::new(DriverConfig::for_config(
                cfg,
                opts.rank,
                endpoint,
                opts.servers.clone(),
                opts.server_names.clone(),
                ranges,
                layout.hash(),
                opts.reconnect_deadline,
                opts.tls.paths.clone(),
            ))
        };
        let shared = Arc::new(Shared {
            session: tokio::sync::Mutex::new(Session {
                driver,
                coder,
                update: vec![0.0; layout.len()],
                frames: vec![Vec::new(); shards],
                report: RemoteReport {
                    rank: opts.rank,
                    ..RemoteReport::default()
                },
                failed: None,
                failure: None,
            }),
            waiting: AtomicUsize::new(0),
            wake: Notify::new(),
            stopping: AtomicBool::new(false),
            released_ms: AtomicU64::new(0),
            epoch: Instant::now(),
            idle,
        });
        runtime.spawn(keep_alive(shared.clone()));
        Ok(Self {
            shared,
            runtime: Some(runtime),
            layout,
            rank: opts.rank,
            closed: None,
        })
    }

    /// The layout the session pushes and pulls.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Pulls every shard's parameters for the current clock into `out` (SSP-gated by the shards), connecting or
    /// reconnecting as needed. Blocks the calling thread; `out.len()` must be the layout's length.
    pub fn pull(&self, out: &mut [f32]) -> Result<Pulled, WorkerError> {
        self.check_len(out.len())?;
        let rt = self.runtime()?;
        let mut s = self.session()?;
        let t0 = Instant::now();
        let result = rt.block_on(s.driver.pull(out));
        let s = &mut *s;
        if let Err(e) = result {
            return Err(s.fail(e));
        }
        let rolled = std::mem::take(&mut s.driver.rolled_back);
        if !rolled.is_empty() {
            s.coder.reset(&rolled);
        }
        credit_refused(s);
        s.report.pull_wait_seconds += t0.elapsed().as_secs_f64();
        s.report.fp32_bytes_pulled += 4 * self.layout.len() as u64;
        Ok(Pulled {
            clock: s.driver.protocol.clock(),
            rolled_back: !rolled.is_empty(),
        })
    }

    /// Pushes one round's update to every shard (clipped when it is a gradient, with error feedback, encoded,
    /// framed and queued; outcomes settle in the background) and advances the clock. `loss` is the round's loss
    /// for the shards' spike detector (`None`: none known). `steps` is how many training steps the update covers
    /// (H for a local-step round), for the per-step fp32 reference of the report. A non-finite update is not
    /// pushed: the round ends with a skip marker and this returns `false`.
    pub fn push(
        &self,
        update: &[f32],
        loss: Option<f32>,
        kind: UpdateKind,
        steps: u64,
    ) -> Result<bool, WorkerError> {
        self.check_len(update.len())?;
        let rt = self.runtime()?;
        let mut s = self.session()?;
        let t0 = Instant::now();
        let s = &mut *s;
        s.update.copy_from_slice(update);
        let finite = match kind {
            UpdateKind::Gradient => s.coder.clip(loss.unwrap_or(0.0), &mut s.update).1,
            UpdateKind::Delta => {
                sum_of_squares(&s.update).is_finite() && loss.is_none_or(f32::is_finite)
            }
        };
        let clock = s.driver.protocol.clock();
        // Without a known loss the spike detector gets none: 0 never looks like a spike.
        let loss = loss.unwrap_or(0.0);
        let result = if finite {
            let mut wire = 0u64;
            for (k, out) in s.frames.iter_mut().enumerate() {
                s.coder.encode_shard(k, clock, &s.update, out)?;
                wire += out.len() as u64;
            }
            s.driver.protocol.push(&mut s.frames, loss).map(|()| {
                // The per-step reference pushes and pulls the whole model in f32 at every step; this round's
                // pull was counted by `pull`.
                let fp32 = 4 * self.layout.len() as u64;
                let steps = steps.max(1);
                s.report.pushes += 1;
                s.report.wire_bytes_pushed += wire;
                s.report.fp32_bytes_pushed += fp32 * steps;
                s.report.fp32_bytes_pulled += fp32 * (steps - 1);
            })
        } else {
            warn!(
                rank = self.rank,
                clock, "non-finite update: not pushed (skip marker)"
            );
            s.driver.protocol.skip(loss).map(|()| s.report.skips += 1)
        };
        result.map_err(WorkerError::ProtocolState)?;
        let sent = {
            let _enter = rt.enter();
            s.driver.flush()
        };
        if let Err(e) = sent {
            return Err(s.fail(e));
        }
        credit_refused(s);
        s.report.push_seconds += t0.elapsed().as_secs_f64();
        Ok(finite)
    }

    /// Ends this round without an update (a skip marker to every shard), reporting `loss` if known.
    pub fn skip(&self, loss: Option<f32>) -> Result<(), WorkerError> {
        let rt = self.runtime()?;
        let mut s = self.session()?;
        let s = &mut *s;
        s.driver
            .protocol
            .skip(loss.unwrap_or(0.0))
            .map_err(WorkerError::ProtocolState)?;
        s.report.skips += 1;
        let _enter = rt.enter();
        s.driver.flush().map(|_| ()).map_err(|e| s.fail(e))
    }

    /// Waits until every push has its outcome and every link is up (or `limit` passes); returns whether it got
    /// there.
    pub fn settle(&self, limit: Duration) -> Result<bool, WorkerError> {
        let rt = self.runtime()?;
        let mut s = self.session()?;
        let s = &mut *s;
        match rt.block_on(s.driver.settle(limit)) {
            Ok(done) => {
                credit_refused(s);
                Ok(done)
            }
            Err(e) => Err(s.fail(e)),
        }
    }

    /// The session's counters so far.
    pub fn report(&self) -> RemoteReport {
        if let Some(r) = &self.closed {
            return r.clone();
        }
        let s = self.hold();
        snapshot(&s)
    }

    /// Settles (up to `limit`), says goodbye to every shard, stops the runtime and returns the final report.
    /// Calling it again returns the same report.
    pub fn close(&mut self, limit: Duration) -> Result<RemoteReport, WorkerError> {
        if let Some(r) = &self.closed {
            return Ok(r.clone());
        }
        let rt = self.runtime()?;
        let report = {
            let mut s = self.hold();
            let s = &mut *s;
            if s.failed.is_none() && s.failure.is_none() {
                match rt.block_on(s.driver.settle(limit)) {
                    Ok(true) => {}
                    Ok(false) => warn!(rank = self.rank, "pushes still unsettled at goodbye"),
                    Err(e) => warn!(rank = self.rank, error = %e, "settling failed"),
                }
                credit_refused(s);
                rt.block_on(s.driver.goodbye());
            }
            snapshot(s)
        };
        self.stop();
        self.closed = Some(report.clone());
        Ok(report)
    }

    fn stop(&mut self) {
        self.shared.stopping.store(true, Ordering::SeqCst);
        self.shared.wake.notify_one();
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_timeout(Duration::from_secs(1));
        }
    }

    fn runtime(&self) -> Result<&tokio::runtime::Runtime, WorkerError> {
        self.runtime.as_ref().ok_or(WorkerError::Closed)
    }

    fn check_len(&self, got: usize) -> Result<(), WorkerError> {
        if got == self.layout.len() {
            Ok(())
        } else {
            Err(WorkerError::UpdateLength {
                expected: self.layout.len(),
                got,
            })
        }
    }

    /// Takes the session from the keep-alive task (blocking), or returns the error that ended it.
    fn session(&self) -> Result<Held<'_>, WorkerError> {
        let mut s = self.hold();
        if let Some(e) = s.failed.take() {
            return Err(e);
        }
        if let Some(why) = &s.failure {
            return Err(WorkerError::Ended(why.clone()));
        }
        if let Some(rt) = self.runtime.as_ref() {
            let _enter = rt.enter();
            if let Err(e) = s.driver.service_timers() {
                return Err(s.fail(e));
            }
        }
        Ok(s)
    }

    /// Takes the session: at once when it is free, else from the keep-alive task (which steps aside).
    fn hold(&self) -> Held<'_> {
        let guard = match self.shared.session.try_lock() {
            Ok(g) => g,
            Err(_) => {
                self.shared.waiting.fetch_add(1, Ordering::SeqCst);
                self.shared.wake.notify_one();
                let g = self.shared.session.blocking_lock();
                self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
                g
            }
        };
        Held {
            guard,
            shared: &self.shared,
        }
    }
}

impl Drop for RemoteWorker {
    fn drop(&mut self) {
        // Without close(): no goodbye (the shards evict this rank after their timeout); the runtime stops here.
        self.stop();
    }
}

impl Session {
    /// Records `e` as the end of the session and returns it.
    fn fail(&mut self, e: WorkerError) -> WorkerError {
        self.failure = Some(e.to_string());
        e
    }
}

fn snapshot(s: &Session) -> RemoteReport {
    let stats = s.driver.protocol.stats();
    RemoteReport {
        clock: s.driver.protocol.clock(),
        pushes_refused: stats.pushes_refused,
        stale_replies_dropped: stats.stale_replies,
        rollbacks_seen: stats.rollbacks_seen,
        max_clock_lead: stats.max_clock_lead,
        reconnects: s.driver.reconnects,
        wire_bytes_pulled: s.driver.bytes_pulled,
        ..s.report.clone()
    }
}

/// The residual policy for pushes the shards did not apply (as the built-in worker's): good updates go back into
/// the residual; those refused for their values, or built on a trajectory a rollback discarded, are dropped.
fn credit_refused(s: &mut Session) {
    for r in s.driver.refused.drain(..) {
        debug!(shard = r.shard, clock = r.clock, outcome = ?r.outcome, "push not applied");
        if !matches!(
            r.outcome,
            Outcome::Refused(ErrorCode::NonFinite | ErrorCode::RolledBack)
        ) {
            if let Err(e) = s.coder.credit_undelivered(r.shard, &r.frame) {
                warn!(shard = r.shard, error = %e, "cannot credit an undelivered push");
            }
        }
    }
}

/// Holds the session between calls and keeps the protocol alive (heartbeats, outcomes, reconnects) once no call has
/// come for `idle`; steps aside whenever a caller waits for it.
async fn keep_alive(shared: Arc<Shared>) {
    loop {
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        let since = shared.since_release();
        if since < shared.idle || shared.waiting.load(Ordering::SeqCst) > 0 {
            // The caller calls often: leave the session with it (its calls service the timers).
            let nap = shared
                .idle
                .saturating_sub(since)
                .max(Duration::from_millis(1));
            tokio::select! {
                _ = tokio::time::sleep(nap) => {}
                _ = shared.wake.notified() => tokio::task::yield_now().await,
            }
            continue;
        }
        let mut s = shared.session.lock().await;
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        if shared.since_release() < shared.idle || shared.waiting.load(Ordering::SeqCst) > 0 {
            continue;
        }
        if s.failed.is_some() || s.failure.is_some() {
            drop(s);
            shared.wake.notified().await;
            continue;
        }
        let s = &mut *s;
        let woken = shared.wake.notified();
        match s.driver.while_running(woken).await {
            Ok(()) => credit_refused(s),
            Err(e) => {
                warn!(error = %e, "worker session ended while idle");
                s.failure = Some(e.to_string());
                s.failed = Some(e);
            }
        }
    }
}

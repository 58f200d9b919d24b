//! The worker's transport shell around [`WorkerProtocol`]: one QUIC connection per shard with a writer task (control
//! messages in order, push frames on uni streams opened in clock order) and two reader tasks (control messages,
//! pull replies), all feeding one inbox; reconnects with exponential backoff; and the event loop that drives the
//! protocol's timers while the trainer waits for a pull or for the compute actor. No protocol rule lives here: every
//! decision (which reply to use, what to resend, when to heartbeat, when to rejoin) is the protocol's, and so is
//! reading reply bodies into the model ([`WorkerProtocol::handle_reply`]); this shell hands it the bytes.

use std::future::Future;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rkyv::util::AlignedVec;
use tether_common::config::Staleness;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use tether_common::config::Config;
use tether_common::net::{
    client_handshake, connect_shard, recv_bulk_any, ControlChannel, ControlReceiver, ControlSender,
    NetError, RefusedBy, TlsPaths,
};
use tether_common::protocol::{
    Control, ErrorCode, FrameHeader, FrameKind, FrameLimits, Outcome, Precision, ProtocolError,
    PullMode, Welcome,
};

use crate::error::WorkerError;
use crate::protocol::{Event, Settled, Transmit, Verdict, WorkerProtocol};

/// What the per-link tasks and connect attempts report to the driver.
enum Inbound {
    Control {
        shard: usize,
        gen: u64,
        msg: Control,
    },
    Reply {
        shard: usize,
        gen: u64,
        kind: FrameKind,
        body: AlignedVec,
        /// From the reply stream's first bytes to its last: the transfer, without the wait at the shard's gate.
        transfer: Duration,
    },
    Lost {
        shard: usize,
        gen: u64,
        error: NetError,
    },
    Connected {
        shard: usize,
        attempt: u64,
        /// The attempt dialled the shard's standby.
        standby: bool,
        result: Result<Connection, NetError>,
    },
}

struct Connection {
    conn: quinn::Connection,
    control: ControlChannel,
    welcome: Welcome,
}

enum Outgoing {
    Control(Control),
    Push(Bytes),
}

/// The I/O of one live link.
struct LinkIo {
    gen: u64,
    conn: quinn::Connection,
    out: mpsc::UnboundedSender<Outgoing>,
    tasks: Vec<JoinHandle<()>>,
}

impl LinkIo {
    fn close(self, reason: &[u8]) {
        self.conn.close(0u32.into(), reason);
        for t in self.tasks {
            t.abort();
        }
    }
}

/// Times in a row a worker asks a node again that turned it away as not (yet) primary, before dialling the other
/// address: 2 s at [`NOT_PRIMARY_BACKOFF`], two default failover periods. A standby takes over once the fence grants
/// it the lease, a few hundred milliseconds after the primary's link went silent; dialling the dead primary in the
/// meantime costs a handshake timeout, long enough for the new primary to evict this worker.
const NOT_PRIMARY_RETRIES: u32 = 20;

/// The delay before asking a replicated shard again after a node answered `NotPrimary`.
const NOT_PRIMARY_BACKOFF: Duration = Duration::from_millis(100);

/// Reconnect state of one shard.
#[derive(Default)]
struct Outage {
    since: Option<Instant>,
    attempt: u64,
    backoff: Duration,
    connecting: bool,
    /// Why the last attempt failed.
    last_error: Option<String>,
    /// The next attempt dials the other address than the one that served last (replicated shards alternate).
    alternate: bool,
    /// Attempts in a row a standby turned away as not (yet) primary.
    not_primary: u32,
}

/// The flat index range of each of `shards` shards of `layout`, as the wire carries them.
pub(crate) fn shard_ranges(
    layout: &tether_common::layout::Layout,
    shards: usize,
) -> Vec<(u64, u64)> {
    (0..shards)
        .map(|k| {
            let r = layout.shard_range(k, shards);
            (r.start as u64, r.end as u64)
        })
        .collect()
}

/// Latency samples a report keeps (the first ones; 4 MiB at most per vector).
pub const LATENCY_SAMPLES: usize = 1 << 20;

/// The network side of one worker.
pub struct Driver {
    /// The protocol state.
    pub protocol: WorkerProtocol,
    rank: u32,
    endpoint: quinn::Endpoint,
    servers: Vec<String>,
    server_names: Vec<String>,
    /// Each shard's standby (address, TLS name), when shards are replicated.
    standbys: Vec<Option<(String, String)>>,
    /// Which address of each shard served the current (or last) link: `true` for the standby.
    on_standby: Vec<bool>,
    limits: Vec<FrameLimits>,
    links: Vec<Option<LinkIo>>,
    outages: Vec<Outage>,
    inbox_tx: mpsc::UnboundedSender<Inbound>,
    inbox: mpsc::UnboundedReceiver<Inbound>,
    next_gen: u64,
    epoch: Instant,
    deadline: Duration,
    tls_paths: TlsPaths,
    /// Pushes refused (or dropped by a rejoin), for the residual policy; drained by the trainer.
    pub refused: Vec<Settled>,
    /// Reconnections after a link broke.
    pub reconnects: u64,
    /// Shards that rolled back since the trainer last looked (it resets what it built on their old trajectory).
    pub rolled_back: Vec<usize>,
    /// Bytes of every pull reply received (frame bodies, used or not).
    pub bytes_pulled: u64,
    /// Push → outcome round trips (send to `PushOutcome`, µs), one per settled push that was sent on a live link
    /// (the first [`LATENCY_SAMPLES`]).
    pub push_latency_us: Vec<u32>,
    /// Pushes written to a link and not yet settled: (shard, clock, when).
    in_flight: std::collections::VecDeque<(usize, u64, Instant)>,
    /// The newest settled push round and its slowest shard's round trip (send to outcome).
    push_rtt: (u64, Duration),
    /// The slowest reply transfer of the last pull.
    pull_transfer: Duration,
    /// Where settled pushes and used reads are recorded (JSON lines), when asked.
    history: Option<std::fs::File>,
}

/// One record of a worker's history (a JSON line): a push's outcome, or a read it used, with the fence term of the
/// link that answered. The partition checker reads these beside the shards' own histories.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct WorkerHistoryLine {
    /// Wall-clock time, microseconds since the Unix epoch.
    pub t_us: u64,
    /// `push` or `read`.
    pub kind: String,
    /// The shard.
    pub shard: u32,
    /// A push's round, or the clock a read was pulled at.
    pub clock: u64,
    /// A read's answer: the shard's minimum clock when it answered (SSP: `clock - min_clock` is at most the
    /// bound); 0 for a push.
    pub min_clock: u64,
    /// A push's outcome (`applied`, `duplicate`, `refused`, or `skipped` for a skip marker taken); empty for a read.
    pub outcome: String,
    /// The shard version a read reflected; 0 for a push.
    pub version: u64,
    /// The fence term of the link it came on (0: unreplicated).
    pub term: u64,
}

/// Everything [`Driver::new`] needs.
pub struct DriverConfig {
    /// Worker rank.
    pub rank: u32,
    /// The client endpoint (mutual TLS).
    pub endpoint: quinn::Endpoint,
    /// Shard addresses, resolved at every connect.
    pub servers: Vec<String>,
    /// TLS names per shard.
    pub server_names: Vec<String>,
    /// Shard ranges.
    pub ranges: Vec<(u64, u64)>,
    /// Each shard's standby (address, TLS name), tried in turn with its server when a link fails (empty: none).
    pub standbys: Vec<Option<(String, String)>>,
    /// Frame limits per shard.
    pub limits: Vec<FrameLimits>,
    /// Layout fingerprint.
    pub layout_hash: u64,
    /// The SSP bound this worker runs under (a shard announcing another is refused).
    pub staleness: Staleness,
    /// How to pull.
    pub mode: PullMode,
    /// Streamed fragments (`train.fragments`; a shard announcing another count is refused).
    pub fragments: u32,
    /// Heartbeat period.
    pub heartbeat: Duration,
    /// Give up when a shard stays unreachable this long (transient failures; a permanent refusal, such as a TLS
    /// alert, gives up at once).
    pub reconnect_deadline: Duration,
    /// The files of this worker's TLS identity, named when a shard refuses the handshake.
    pub tls_paths: TlsPaths,
    /// The model's layout, to compute a fresh shard's initial weights instead of pulling them whole
    /// ([`WorkerProtocol::with_initial`]); `None` pulls them.
    pub initial: Option<std::sync::Arc<tether_common::layout::Layout>>,
    /// Where to record settled pushes and used reads ([`WorkerHistoryLine`]); `None`: nowhere.
    pub history: Option<std::fs::File>,
}

impl DriverConfig {
    /// The heartbeat period under `cfg`: at least three heartbeats per eviction timeout, whatever `heartbeat_ms`
    /// says, so that one late heartbeat is never silence.
    pub fn heartbeat_period(cfg: &Config) -> Duration {
        Duration::from_millis(
            cfg.cluster
                .heartbeat_ms
                .min(cfg.cluster.worker_timeout_ms / 3)
                .max(10),
        )
    }

    /// The driver of `rank` under `cfg`: staleness, pull mode and heartbeat from the configuration.
    #[allow(clippy::too_many_arguments)]
    pub fn for_config(
        cfg: &Config,
        rank: u32,
        endpoint: quinn::Endpoint,
        servers: Vec<String>,
        server_names: Vec<String>,
        ranges: Vec<(u64, u64)>,
        layout_hash: u64,
        reconnect_deadline: Duration,
        tls_paths: TlsPaths,
    ) -> DriverConfig {
        let limits = ranges
            .iter()
            .map(|r| FrameLimits::for_codec(&cfg.compression.codec(), (r.1 - r.0) as usize))
            .collect();
        let standbys = (0..servers.len())
            .map(|k| {
                cfg.cluster
                    .standbys
                    .get(k)
                    .map(|s| (s.clone(), crate::remote::server_name(s)))
            })
            .collect();
        DriverConfig {
            rank,
            endpoint,
            servers,
            server_names,
            standbys,
            ranges,
            limits,
            layout_hash,
            staleness: cfg.cluster.staleness,
            mode: if cfg.compression.delta_pulls() {
                PullMode::Delta { have: None }
            } else if cfg.compression.pull_bf16 {
                PullMode::Full(Precision::Bf16)
            } else {
                PullMode::Full(Precision::F32)
            },
            fragments: cfg.train.fragments,
            heartbeat: Self::heartbeat_period(cfg),
            reconnect_deadline,
            tls_paths,
            initial: None,
            history: None,
        }
    }
}

impl Driver {
    /// A driver with every link down; the first wait connects them.
    pub fn new(cfg: DriverConfig) -> Driver {
        let (inbox_tx, inbox) = mpsc::unbounded_channel();
        let n = cfg.servers.len();
        Driver {
            protocol: WorkerProtocol::new(
                cfg.rank,
                cfg.layout_hash,
                cfg.ranges,
                cfg.staleness,
                cfg.mode,
                cfg.heartbeat.as_millis() as u64,
            )
            .with_fragments(cfg.fragments)
            .with_initial_opt(cfg.initial),
            rank: cfg.rank,
            endpoint: cfg.endpoint,
            on_standby: vec![false; n],
            standbys: (0..n)
                .map(|k| cfg.standbys.get(k).cloned().flatten())
                .collect(),
            servers: cfg.servers,
            server_names: cfg.server_names,
            limits: cfg.limits,
            links: (0..n).map(|_| None).collect(),
            outages: (0..n).map(|_| Outage::default()).collect(),
            inbox_tx,
            inbox,
            next_gen: 0,
            epoch: Instant::now(),
            deadline: cfg.reconnect_deadline,
            tls_paths: cfg.tls_paths,
            refused: Vec::new(),
            reconnects: 0,
            rolled_back: Vec::new(),
            bytes_pulled: 0,
            push_latency_us: Vec::new(),
            in_flight: std::collections::VecDeque::new(),
            push_rtt: (0, Duration::ZERO),
            pull_transfer: Duration::ZERO,
            history: cfg.history,
        }
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Pulls every shard's values for the current clock into `params` (SSP-gated by the shards), reconnecting as
    /// needed. Returns when the protocol has a complete, current answer from every shard.
    pub async fn pull(&mut self, params: &mut [f32]) -> Result<(), WorkerError> {
        self.pull_transfer = Duration::ZERO;
        let now = self.now_ms();
        self.protocol.start_pull(now);
        let clock = loop {
            if let Some(clock) = self.flush()? {
                break clock;
            }
            self.step_io(Some(&mut *params)).await?;
        };
        debug!(rank = self.rank, clock, "pull complete");
        Ok(())
    }

    /// [`Driver::pull`] while `fut` runs (streamed fragments: the pull overlaps the next round's inner steps). Returns
    /// `fut`'s output once both are done, and how long the pull kept the caller waiting after `fut` finished.
    pub async fn pull_while<F: Future>(
        &mut self,
        params: &mut [f32],
        fut: F,
    ) -> Result<(F::Output, Duration), WorkerError> {
        self.pull_transfer = Duration::ZERO;
        let now = self.now_ms();
        self.protocol.start_pull(now);
        tokio::pin!(fut);
        let mut out: Option<(F::Output, std::time::Instant)> = None;
        let mut pulled = false;
        loop {
            if self.flush()?.is_some() {
                pulled = true;
            }
            if pulled {
                if let Some((o, at)) = out.take() {
                    debug!(rank = self.rank, "overlapped pull complete");
                    return Ok((o, at.elapsed()));
                }
            }
            let timeout = self.timer();
            let running = out.is_none();
            tokio::select! {
                o = &mut fut, if running => out = Some((o, std::time::Instant::now())),
                msg = self.inbox.recv() => {
                    // The driver holds a sender itself, so the inbox never closes.
                    if let Some(msg) = msg {
                        self.handle(msg, (!pulled).then_some(&mut *params))?;
                    }
                }
                _ = tokio::time::sleep_until(timeout) => {
                    let now = self.now_ms();
                    self.protocol.handle_timeout(now);
                }
            }
        }
    }

    /// The time a round spends on the links, without waiting for other workers: the newest settled push round's
    /// slowest round trip (upload and apply) plus the last pull's slowest reply transfer.
    pub fn link_time(&self) -> Duration {
        self.push_rtt.1 + self.pull_transfer
    }

    /// Runs `fut` (a compute step, a sleep) while keeping the protocol alive: heartbeats, outcomes, reconnects.
    pub async fn while_running<F: Future>(&mut self, fut: F) -> Result<F::Output, WorkerError> {
        tokio::pin!(fut);
        loop {
            self.flush()?;
            let timeout = self.timer();
            tokio::select! {
                out = &mut fut => return Ok(out),
                msg = self.inbox.recv() => {
                    // The driver holds a sender itself, so the inbox never closes.
                    if let Some(msg) = msg {
                        self.handle(msg, None)?;
                    }
                }
                _ = tokio::time::sleep_until(timeout) => {
                    let now = self.now_ms();
                    self.protocol.handle_timeout(now);
                }
            }
        }
    }

    /// Waits until every push has its outcome and every link is up, so that the goodbye reaches every shard (or
    /// until `limit` passes); returns whether it got there.
    pub async fn settle(&mut self, limit: Duration) -> Result<bool, WorkerError> {
        let end = tokio::time::Instant::now() + limit;
        while !(self.protocol.settled() && self.protocol.connected_to_all()) {
            if tokio::time::Instant::now() >= end {
                return Ok(false);
            }
            let _ = tokio::time::timeout_at(end, self.step_io(None)).await;
            self.flush()?;
        }
        Ok(true)
    }

    /// Says goodbye on every link, gives it a moment to be delivered, and closes.
    pub async fn goodbye(&mut self) {
        let now = self.now_ms();
        self.protocol.goodbye(now);
        let _ = self.flush();
        for link in self.links.iter_mut() {
            if let Some(io) = link.take() {
                drop(io.out);
                let _ = tokio::time::timeout(Duration::from_millis(500), io.conn.closed()).await;
                io.conn.close(0u32.into(), b"done");
                for t in io.tasks {
                    t.abort();
                }
            }
        }
        self.endpoint.wait_idle().await;
    }

    fn timer(&self) -> tokio::time::Instant {
        let base = tokio::time::Instant::from_std(self.epoch);
        match self.protocol.poll_timeout() {
            Some(ms) => base + Duration::from_millis(ms),
            None => tokio::time::Instant::now() + Duration::from_secs(3600),
        }
    }

    /// Waits for one inbound message or timer and hands it to the protocol.
    async fn step_io(&mut self, params: Option<&mut [f32]>) -> Result<(), WorkerError> {
        let timeout = self.timer();
        tokio::select! {
            msg = self.inbox.recv() => {
                if let Some(msg) = msg {
                    self.handle(msg, params)?;
                }
            }
            _ = tokio::time::sleep_until(timeout) => {
                let now = self.now_ms();
                self.protocol.handle_timeout(now);
            }
        }
        Ok(())
    }

    /// Hands the protocol its due timers (heartbeats, resends) and sends what they produce; for callers that drive
    /// the driver in short calls instead of waiting in it.
    pub(crate) fn service_timers(&mut self) -> Result<(), WorkerError> {
        let now = self.now_ms();
        if self.protocol.poll_timeout().is_some_and(|t| t <= now) {
            self.protocol.handle_timeout(now);
        }
        self.flush().map(|_| ())
    }

    /// Moves the protocol's transmits to the links and acts on its events. Returns the clock of a completed pull.
    pub(crate) fn flush(&mut self) -> Result<Option<u64>, WorkerError> {
        let mut done = None;
        loop {
            let mut progressed = false;
            while let Some(t) = self.protocol.poll_transmit() {
                progressed = true;
                let (shard, out) = match t {
                    Transmit::Control { shard, msg } => (shard, Outgoing::Control(msg)),
                    Transmit::Push {
                        shard,
                        clock,
                        bytes,
                    } => {
                        // A resend keeps the first send time (the round trip then includes the reconnect).
                        let known = self
                            .in_flight
                            .iter()
                            .any(|&(s, c, _)| s == shard && c == clock);
                        if self.links[shard].is_some() && !known {
                            if self.in_flight.len() >= 4096 {
                                self.in_flight.pop_front();
                            }
                            self.in_flight.push_back((shard, clock, Instant::now()));
                        }
                        (shard, Outgoing::Push(bytes))
                    }
                };
                // A link that is down drops the message; the protocol resends what matters after the reconnect.
                if let Some(io) = &self.links[shard] {
                    let _ = io.out.send(out);
                }
            }
            while let Some(e) = self.protocol.poll_event() {
                progressed = true;
                match e {
                    Event::PullDone { clock } => done = Some(clock),
                    Event::Settled(settled) => {
                        let (shard, clock) = (settled.shard, settled.clock);
                        let outcome = match (settled.verdict(), settled.outcome) {
                            (Verdict::Skipped, _) => "skipped",
                            (_, Outcome::Applied) => "applied",
                            (_, Outcome::Duplicate) => "duplicate",
                            (_, Outcome::Refused(_)) => "refused",
                        };
                        self.record("push", shard, (clock, 0), outcome, 0, settled.term);
                        if let Some(i) = self
                            .in_flight
                            .iter()
                            .position(|&(s, c, _)| s == shard && c == clock)
                        {
                            // `position` found it, so `remove` returns it.
                            if let Some((_, _, sent)) = self.in_flight.remove(i) {
                                let rtt = sent.elapsed();
                                self.push_rtt = match self.push_rtt {
                                    (c, d) if c == clock => (c, d.max(rtt)),
                                    (c, _) if clock > c => (clock, rtt),
                                    old => old,
                                };
                                if self.push_latency_us.len() < LATENCY_SAMPLES {
                                    self.push_latency_us
                                        .push(sent.elapsed().as_micros().min(u128::from(u32::MAX))
                                            as u32);
                                }
                            }
                        }
                        if settled.verdict() == Verdict::Refused {
                            warn!(rank = self.rank, shard, clock, outcome = ?settled.outcome, "push refused");
                            self.refused.push(settled);
                        }
                    }
                    Event::Reconnect { shard } => self.reconnect(shard)?,
                    Event::RolledBack { shard, epoch } => {
                        info!(
                            rank = self.rank,
                            shard, epoch, "shard rolled back after a loss spike"
                        );
                        self.rolled_back.push(shard);
                    }
                }
            }
            if !progressed {
                return Ok(done);
            }
        }
    }

    fn reconnect(&mut self, shard: usize) -> Result<(), WorkerError> {
        if let Some(io) = self.links[shard].take() {
            io.close(b"reconnect");
            self.reconnects += 1;
        }
        let outage = &mut self.outages[shard];
        if outage.connecting {
            return Ok(());
        }
        let now = Instant::now();
        let since = *outage.since.get_or_insert(now);
        if now.duration_since(since) > self.deadline {
            return Err(WorkerError::Net {
                shard,
                source: NetError::Unreachable {
                    server: self.servers[shard].clone(),
                    waited: self.deadline,
                    last: outage
                        .last_error
                        .clone()
                        .unwrap_or_else(|| "the link was lost".into()),
                },
            });
        }
        let delay = outage.backoff;
        outage.backoff =
            (outage.backoff * 2).clamp(Duration::from_millis(100), Duration::from_secs(2));
        outage.attempt += 1;
        outage.connecting = true;
        let attempt = outage.attempt;
        let hello = self.protocol.hello(shard);
        // A replicated shard is dialled at its two addresses in turn, starting with the one that did not serve last.
        let standby = self.standbys[shard]
            .as_ref()
            .filter(|_| outage.alternate != self.on_standby[shard]);
        outage.alternate = !outage.alternate;
        let (name, server_name) = match standby {
            Some((addr, tls_name)) => (addr.clone(), tls_name.clone()),
            None => (
                self.servers[shard].clone(),
                self.server_names[shard].clone(),
            ),
        };
        let dialled_standby = standby.is_some();
        let endpoint = self.endpoint.clone();
        let tx = self.inbox_tx.clone();
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let result = async {
                let addr = tokio::net::lookup_host(name.as_str())
                    .await
                    .ok()
                    .and_then(|mut a| a.next())
                    .ok_or_else(|| NetError::Resolve(name.clone()))?;
                let conn = connect_shard(&endpoint, addr, &server_name, shard as u32).await?;
                let mut control = ControlChannel::open(&conn).await?;
                let welcome = client_handshake(&mut control, hello).await?;
                Ok(Connection {
                    conn,
                    control,
                    welcome,
                })
            }
            .await;
            let _ = tx.send(Inbound::Connected {
                shard,
                attempt,
                standby: dialled_standby,
                result,
            });
        });
        Ok(())
    }

    /// The error that ends the worker when connecting to `shard` failed for good: a TLS refusal names the file to
    /// fix (our CA when we refused the shard's certificate, our certificate when the shard refused it).
    fn permanent_failure(&self, shard: usize, error: NetError) -> WorkerError {
        let NetError::Refused(refusal) = error else {
            return WorkerError::Net {
                shard,
                source: error,
            };
        };
        let check = match refusal.by {
            RefusedBy::Us => self.tls_paths.ca.clone(),
            RefusedBy::Peer => self.tls_paths.cert.clone(),
        };
        WorkerError::Refused {
            shard,
            server: self.servers[shard].clone(),
            refusal,
            check,
            paths: Box::new(self.tls_paths.clone()),
        }
    }

    fn handle(&mut self, msg: Inbound, params: Option<&mut [f32]>) -> Result<(), WorkerError> {
        let current = |links: &Vec<Option<LinkIo>>, shard: usize, gen: u64| {
            links[shard].as_ref().is_some_and(|io| io.gen == gen)
        };
        match msg {
            Inbound::Connected {
                shard,
                attempt,
                standby,
                result,
            } => {
                if self.outages[shard].attempt != attempt {
                    return Ok(());
                }
                self.outages[shard].connecting = false;
                match result {
                    Ok(c) => {
                        if standby != self.on_standby[shard] {
                            info!(
                                rank = self.rank,
                                shard, standby, "failed over to the shard's other address"
                            );
                        }
                        self.on_standby[shard] = standby;
                        self.install(shard, c)?
                    }
                    Err(e) => {
                        debug!(rank = self.rank, shard, standby, error = %e, "connect failed");
                        let outage = &mut self.outages[shard];
                        if e.is_not_primary() {
                            // An answer, not a silence: the shard's nodes are settling who leads (a takeover, or
                            // both starting), which takes about one failover period; ask again soon, not later.
                            outage.backoff = NOT_PRIMARY_BACKOFF;
                        }
                        if e.is_not_primary() && outage.not_primary < NOT_PRIMARY_RETRIES {
                            // A standby that is about to take over (its primary's link times out as ours did): ask
                            // it again before dialling the primary, which costs a handshake timeout if it is dead.
                            outage.not_primary += 1;
                            outage.alternate = !outage.alternate;
                        }
                        if e.is_permanent() {
                            return Err(self.permanent_failure(shard, e));
                        }
                        self.outages[shard].last_error = Some(e.to_string());
                        self.reconnect(shard)?;
                    }
                }
            }
            Inbound::Lost { shard, gen, error } => {
                let superseded =
                    error.remote_close_code() == Some(u64::from(ErrorCode::Superseded.code()));
                if superseded && current(&self.links, shard, gen) {
                    // A newer session of our rank took over at this shard (another process holds our identity):
                    // reconnecting would fight it, so this is a permanent refusal.
                    return Err(WorkerError::Net {
                        shard,
                        source: error,
                    });
                }
                if current(&self.links, shard, gen) {
                    warn!(rank = self.rank, shard, error = %error, "link lost; reconnecting");
                    if matches!(
                        error,
                        NetError::Connection(quinn::ConnectionError::TimedOut)
                    ) {
                        // The address that served went silent: a replicated shard's other one is dialled first.
                        self.outages[shard].alternate = true;
                    }
                    if let Some(io) = self.links[shard].take() {
                        io.close(b"lost");
                    }
                    self.reconnects += 1;
                    self.protocol.disconnected(shard);
                }
            }
            Inbound::Control { shard, gen, msg } => {
                if !current(&self.links, shard, gen) {
                    return Ok(());
                }
                match msg {
                    Control::PushOutcome {
                        clock,
                        outcome,
                        term,
                    } => {
                        if let Err(e) = self.protocol.outcome(shard, clock, outcome, term) {
                            // The protocol reset the link; the connection goes with it.
                            warn!(rank = self.rank, shard, error = %e, "outcome from a deposed node; reconnecting");
                            if let Some(io) = self.links[shard].take() {
                                io.close(b"stale term");
                            }
                        }
                    }
                    Control::PullRefused { request, code } => {
                        self.protocol.pull_refused(shard, request, code)
                    }
                    Control::Error { code, message } => {
                        warn!(rank = self.rank, shard, ?code, %message, "shard reported an error");
                    }
                    other => {
                        warn!(
                            rank = self.rank,
                            shard,
                            msg = other.name(),
                            "unexpected message; reconnecting"
                        );
                        if let Some(io) = self.links[shard].take() {
                            io.close(b"unexpected message");
                        }
                        self.protocol.disconnected(shard);
                    }
                }
            }
            Inbound::Reply {
                shard,
                gen,
                kind,
                body,
                transfer,
            } => {
                if !current(&self.links, shard, gen) {
                    return Ok(());
                }
                self.pull_transfer = self.pull_transfer.max(transfer);
                self.bytes_pulled += body.len() as u64;
                match self.protocol.handle_reply(shard, kind, &body, params) {
                    Ok(true) => {
                        let (term, version, clock, min_clock) = self.protocol.read_of(shard);
                        self.record("read", shard, (clock, min_clock), "", version, term);
                    }
                    Ok(false) => {}
                    Err(e) => {
                        // The protocol forgot the shard's copy and reset the link; the connection goes with it.
                        warn!(rank = self.rank, shard, error = %e, "bad pull reply; reconnecting");
                        if let Some(io) = self.links[shard].take() {
                            io.close(b"bad reply");
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Appends one line to the history, if one is kept (a write error stops the recording, not the training).
    fn record(
        &mut self,
        kind: &str,
        shard: usize,
        (clock, min_clock): (u64, u64),
        outcome: &str,
        version: u64,
        term: u64,
    ) {
        let Some(file) = self.history.as_mut() else {
            return;
        };
        let line = WorkerHistoryLine {
            t_us: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_micros() as u64),
            kind: kind.to_string(),
            shard: shard as u32,
            clock,
            min_clock,
            outcome: outcome.to_string(),
            version,
            term,
        };
        let mut bytes = serde_json::to_vec(&line).unwrap_or_default();
        bytes.push(b'\n');
        if let Err(e) = std::io::Write::write_all(file, &bytes) {
            warn!(rank = self.rank, error = %e, "cannot write the history; no longer recording");
            self.history = None;
        }
    }

    fn install(&mut self, shard: usize, c: Connection) -> Result<(), WorkerError> {
        let gen = self.next_gen;
        self.next_gen += 1;
        let now = self.now_ms();
        if let Err(e) = self.protocol.connected(shard, &c.welcome, now) {
            c.conn.close(0u32.into(), b"bad welcome");
            if matches!(e, ProtocolError::StaleTerm { .. }) {
                // A deposed node welcomed us (we have seen a newer term at this shard): ask again soon, at the
                // shard's other address first, as after a `NotPrimary`.
                warn!(rank = self.rank, shard, error = %e, "welcomed by a deposed node; asking again");
                self.outages[shard].backoff = NOT_PRIMARY_BACKOFF;
                self.outages[shard].last_error = Some(e.to_string());
                return self.reconnect(shard);
            }
            return Err(WorkerError::Protocol { shard, source: e });
        }
        let outage = &mut self.outages[shard];
        if outage.since.is_some() {
            info!(
                rank = self.rank,
                shard,
                clock = c.welcome.clock,
                "reconnected"
            );
        }
        *outage = Outage::default();
        let (sender, receiver) = c.control.split();
        let (out_tx, out_rx) = mpsc::unbounded_channel();
        let tx = self.inbox_tx.clone();
        let tasks = vec![
            tokio::spawn(writer(
                shard,
                gen,
                c.conn.clone(),
                sender,
                out_rx,
                tx.clone(),
            )),
            tokio::spawn(control_reader(shard, gen, receiver, tx.clone())),
            tokio::spawn(reply_reader(
                shard,
                gen,
                c.conn.clone(),
                self.limits[shard],
                tx,
            )),
        ];
        self.links[shard] = Some(LinkIo {
            gen,
            conn: c.conn,
            out: out_tx,
            tasks,
        });
        Ok(())
    }
}

/// Writes one link's control messages in order and opens one uni stream per push in clock order (the body is
/// written by its own task so a large frame does not hold up control messages).
async fn writer(
    shard: usize,
    gen: u64,
    conn: quinn::Connection,
    mut control: ControlSender,
    mut queue: mpsc::UnboundedReceiver<Outgoing>,
    inbox: mpsc::UnboundedSender<Inbound>,
) {
    while let Some(out) = queue.recv().await {
        let sent = match out {
            Outgoing::Control(msg) => control.send(&msg).await,
            Outgoing::Push(bytes) => match conn.open_uni().await {
                Ok(mut stream) => {
                    let inbox = inbox.clone();
                    tokio::spawn(async move {
                        let header = match FrameHeader::encode(FrameKind::Push, bytes.len()) {
                            Ok(h) => h,
                            Err(e) => {
                                let _ = inbox.send(Inbound::Lost {
                                    shard,
                                    gen,
                                    error: e.into(),
                                });
                                return;
                            }
                        };
                        if stream.write_all(&header).await.is_ok()
                            && stream.write_chunk(bytes).await.is_ok()
                        {
                            let _ = stream.finish();
                        }
                    });
                    Ok(())
                }
                Err(e) => Err(NetError::from(e)),
            },
        };
        if let Err(error) = sent {
            let _ = inbox.send(Inbound::Lost { shard, gen, error });
            return;
        }
    }
}

async fn control_reader(
    shard: usize,
    gen: u64,
    mut control: ControlReceiver,
    inbox: mpsc::UnboundedSender<Inbound>,
) {
    loop {
        match control.recv().await {
            Ok(msg) => {
                if inbox.send(Inbound::Control { shard, gen, msg }).is_err() {
                    return;
                }
            }
            Err(error) => {
                let _ = inbox.send(Inbound::Lost { shard, gen, error });
                return;
            }
        }
    }
}

async fn reply_reader(
    shard: usize,
    gen: u64,
    conn: quinn::Connection,
    limits: FrameLimits,
    inbox: mpsc::UnboundedSender<Inbound>,
) {
    loop {
        let result = match conn.accept_uni().await {
            Ok(stream) => {
                let first = Instant::now();
                recv_bulk_any(stream, &limits, &[FrameKind::Params, FrameKind::Delta])
                    .await
                    .map(|f| (f, first.elapsed()))
            }
            Err(e) => Err(NetError::from(e)),
        };
        match result {
            Ok((frame, transfer)) => {
                let msg = Inbound::Reply {
                    shard,
                    gen,
                    kind: frame.kind,
                    body: frame.body,
                    transfer,
                };
                if inbox.send(msg).is_err() {
                    return;
                }
            }
            Err(error) => {
                let _ = inbox.send(Inbound::Lost { shard, gen, error });
                return;
            }
        }
    }
}

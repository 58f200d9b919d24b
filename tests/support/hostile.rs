//! A hostile peer for the multi-process tests: a test-only client that speaks Tether's real wire format (QUIC with
//! mutual TLS, bincode control messages, rkyv push frames, the q4 codec) against a real `tether-server`, with a
//! valid worker certificate, and does what an honest worker never does:
//! - [`HostilePeer::hello`] at any rank and clock (2^48, a rank the cluster does not configure), and
//!   [`HostilePeer::goodbye`] at will, as often as it likes;
//! - [`HostilePeer::push`] gradients that are zero, honest-looking or scaled by any factor ([`Gradient`]), and skip
//!   markers, at any clock, without ever pulling, on any of its connections (a superseded one too);
//! - [`HostilePeer::heartbeat`]: stay a live member that never pushes;
//! - [`HostilePeer::hold`]: open many connections of one identity and keep them;
//! - [`half_open_handshakes`]: leave QUIC handshakes half-open (bare Initial packets built with the sans-IO
//!   `quinn-proto` endpoint, without a client certificate, never followed up);
//! - [`IdleTcp`]: hold idle TCP connections to a metrics endpoint, replacing those the server closes;
//! - [`forge_nan_checkpoint`]: write a checkpoint with NaN weights whose CRCs are recomputed (no key).
//!
//! It owns a tokio runtime, so tests call it synchronously. Every wait is bounded ([`WAIT`]); what the shard does
//! with a move (a refusal, a closed connection, no answer) is a value the test asserts on, never a panic here.

use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tether::common::codec::{CodecConfig, Encoder};
use tether::common::config::Config;
use tether::common::layout::model_layout;
use tether::common::net::{
    client_endpoint, client_handshake, connect, ControlChannel, NetError, TlsFiles, TransportTuning,
};
use tether::common::protocol::{
    encode_push, Control, ErrorCode, FrameKind, Hello, Outcome, PushFrame, Welcome,
};

/// The longest the hostile peer waits for any one answer.
pub const WAIT: Duration = Duration::from_secs(10);

/// What the hostile peer attacks: one shard's address and what a hello and a push must match there.
#[derive(Debug, Clone, Copy)]
pub struct Target {
    /// The shard's QUIC address.
    pub addr: SocketAddr,
    /// The model layout hash a hello must carry.
    pub layout_hash: u64,
    /// Parameters in the shard's range (the length of a push's gradient).
    pub range_len: usize,
}

impl Target {
    /// Shard `shard` of `shards` at `addr`, for the model described by the config file `config`.
    pub fn shard(config: &Path, addr: SocketAddr, shard: usize, shards: usize) -> Target {
        let cfg = Config::load(config).expect("the test's own cluster.toml loads");
        let layout = model_layout(&cfg).expect("the test's own model has a layout");
        Target {
            addr,
            layout_hash: layout.hash(),
            range_len: layout.shard_range(shard, shards).len(),
        }
    }
}

/// How the shard answered a hostile move that it did not accept.
#[derive(Debug)]
pub enum Refusal {
    /// The transport or the protocol said no (a typed refusal, a closed connection, a TLS alert).
    Net(NetError),
    /// No answer within [`WAIT`].
    TimedOut,
}

impl Refusal {
    /// The typed code the shard refused with, if it gave one (in a `Control::Error` or as the close code).
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            Refusal::Net(e) => e
                .code()
                .or_else(|| e.remote_close_code().and_then(ErrorCode::from_code)),
            Refusal::TimedOut => None,
        }
    }
}

/// The gradient a hostile push carries.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Gradient {
    /// All zeros (norm 0).
    Zero,
    /// A small, plausible gradient (entries of about 1e-3).
    Plausible,
    /// The plausible gradient times this factor (finite for any finite factor up to ~1e35).
    Scaled(f32),
}

impl Gradient {
    /// The gradient's values for a range of `n` parameters.
    pub fn values(self, n: usize) -> Vec<f32> {
        let plausible = |i: usize| ((i % 7) as f32 - 3.0) * 1e-3;
        (0..n)
            .map(|i| match self {
                Gradient::Zero => 0.0,
                Gradient::Plausible => plausible(i),
                Gradient::Scaled(k) => plausible(i) * k,
            })
            .collect()
    }
}

/// One connection that said hello and was welcomed.
#[derive(Debug)]
pub struct Session {
    /// The QUIC connection.
    pub conn: quinn::Connection,
    /// Its control stream.
    pub control: ControlChannel,
    /// The shard's welcome (range, min clock, the clock this rank's next push must carry).
    pub welcome: Welcome,
    /// The rank it said hello as.
    pub rank: u32,
}

impl Session {
    /// Whether the shard (or anyone) closed this connection.
    pub fn is_closed(&self) -> bool {
        self.conn.close_reason().is_some()
    }
}

/// A framed push (or skip marker) as the worker sends it on a unidirectional stream: `[u32 LE len][kind][rkyv]`.
pub fn push_frame(w: &Welcome, worker: u32, clock: u64, skip: bool, payload: Vec<u8>) -> Vec<u8> {
    let body = encode_push(&PushFrame {
        worker,
        clock,
        shard: w.shard,
        range_start: w.range_start,
        range_end: w.range_end,
        read_version: 0,
        loss: 1.0,
        skip,
        payload,
    })
    .expect("a push frame of a test-sized range encodes")
    .to_vec();
    let mut frame = (body.len() as u32).to_le_bytes().to_vec();
    frame.push(FrameKind::Push as u8);
    frame.extend_from_slice(&body);
    frame
}

/// The q4 encoding (the cluster's default codec) of `grad`.
pub fn encode_gradient(grad: &[f32]) -> Vec<u8> {
    let mut payload = Vec::new();
    Encoder::new(CodecConfig::default())
        .expect("the default codec config is valid")
        .encode(grad, 1, &mut payload)
        .expect("a finite gradient encodes");
    payload
}

/// Background heartbeats of one session: a member that is alive and never pushes.
pub struct Heartbeats {
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicU64>,
    task: Option<tokio::task::JoinHandle<Session>>,
}

impl Heartbeats {
    /// Heartbeats sent so far.
    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }
}

/// Many connections of one identity, held open until dropped.
pub struct Held {
    /// Connections welcomed (each said hello).
    pub sessions: Vec<Session>,
    /// Connections that completed the TLS handshake and never said hello.
    pub bare: Vec<quinn::Connection>,
    /// Connection attempts the shard refused, closed or did not answer in time.
    pub refused: usize,
    /// How long opening them took.
    pub elapsed: Duration,
}

impl Held {
    /// Held connections the shard has closed since.
    pub fn closed(&self) -> usize {
        self.connections()
            .filter(|c| c.close_reason().is_some())
            .count()
    }

    fn connections(&self) -> impl Iterator<Item = &quinn::Connection> {
        self.sessions.iter().map(|s| &s.conn).chain(&self.bare)
    }

    /// Why the closed ones were closed, with how many of each reason.
    pub fn close_reasons(&self) -> std::collections::BTreeMap<String, usize> {
        let mut reasons = std::collections::BTreeMap::new();
        for r in self.connections().filter_map(|c| c.close_reason()) {
            *reasons.entry(r.to_string()).or_default() += 1;
        }
        reasons
    }
}

/// The hostile client: one QUIC endpoint presenting one certificate, on its own runtime.
pub struct HostilePeer {
    rt: tokio::runtime::Runtime,
    ep: quinn::Endpoint,
    target: Target,
}

impl HostilePeer {
    /// A peer presenting `tls`'s certificate to `target`.
    pub fn new(tls: &TlsFiles, target: Target) -> HostilePeer {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("a test runtime builds");
        let ep = {
            let _in_runtime = rt.enter();
            client_endpoint(tls, &TransportTuning::default()).expect("a client endpoint binds")
        };
        HostilePeer { rt, ep, target }
    }

    /// The target shard.
    pub fn target(&self) -> Target {
        self.target
    }

    /// Connects and says hello as `rank` at `clock`.
    pub fn hello(&self, rank: u32, clock: u64) -> Result<Session, Refusal> {
        self.rt.block_on(self.hello_async(rank, clock))
    }

    async fn hello_async(&self, rank: u32, clock: u64) -> Result<Session, Refusal> {
        let (ep, t) = (&self.ep, self.target);
        let attempt = async {
            let conn = connect(ep, t.addr, "127.0.0.1").await?;
            let mut control = ControlChannel::open(&conn).await?;
            let welcome =
                client_handshake(&mut control, Hello::rejoin(rank, t.layout_hash, clock)).await?;
            Ok::<_, NetError>(Session {
                conn,
                control,
                welcome,
                rank,
            })
        };
        match tokio::time::timeout(WAIT, attempt).await {
            Ok(Ok(s)) => Ok(s),
            Ok(Err(e)) => Err(Refusal::Net(e)),
            Err(_) => Err(Refusal::TimedOut),
        }
    }

    /// Says goodbye at `clock` on `s`; returns whether the shard then closed the connection (bounded wait).
    pub fn goodbye(&self, mut s: Session, clock: u64) -> bool {
        self.rt.block_on(async {
            if s.control.send(&Control::Goodbye { clock }).await.is_err() {
                return s.is_closed();
            }
            tokio::time::timeout(WAIT, s.conn.closed()).await.is_ok()
        })
    }

    /// Pushes `grad` (q4-encoded) as round `clock` on `s` and waits for the shard's outcome. `None`: the
    /// connection closed or no outcome came within [`WAIT`].
    pub fn push(&self, s: &mut Session, clock: u64, grad: Gradient) -> Option<Outcome> {
        let payload = encode_gradient(&grad.values(self.target.range_len));
        let frame = push_frame(&s.welcome, s.rank, clock, false, payload);
        self.rt.block_on(send_and_settle(s, clock, &frame))
    }

    /// Sends a skip marker for round `clock` on `s` and waits for the outcome (as [`push`](Self::push)).
    pub fn skip(&self, s: &mut Session, clock: u64) -> Option<Outcome> {
        let frame = push_frame(&s.welcome, s.rank, clock, true, Vec::new());
        self.rt.block_on(send_and_settle(s, clock, &frame))
    }

    /// Keeps `s` a live member in the background: a heartbeat every 200 ms, never a push, until [`Self::stop`] or
    /// `limit`.
    pub fn heartbeat(&self, s: Session, limit: Duration) -> Heartbeats {
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicU64::new(0));
        let (stop2, sent2) = (stop.clone(), sent.clone());
        let task = self.rt.spawn(async move {
            let mut s = s;
            let deadline = Instant::now() + limit;
            while !stop2.load(Ordering::Relaxed) && Instant::now() < deadline {
                let clock = s.welcome.clock;
                if s.control.send(&Control::Heartbeat { clock }).await.is_err() {
                    break;
                }
                sent2.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            s
        });
        Heartbeats {
            stop,
            sent,
            task: Some(task),
        }
    }

    /// Stops heartbeats; returns the session and whether the shard had closed it.
    pub fn stop(&self, mut hb: Heartbeats) -> Option<(Session, bool)> {
        hb.stop.store(true, Ordering::Relaxed);
        let task = hb.task.take()?;
        let s = self
            .rt
            .block_on(async { tokio::time::timeout(WAIT, task).await })
            .ok()?
            .ok()?;
        let closed = s.is_closed();
        Some((s, closed))
    }

    /// Opens `n` connections as `rank` (each says hello at clock 0), at most 32 handshakes at a time, for at most
    /// `limit`; keeps those the shard welcomed.
    pub fn hold(&self, rank: u32, n: usize, limit: Duration) -> Held {
        let started = Instant::now();
        let (ep, t) = (self.ep.clone(), self.target);
        let (sessions, refused) = self.rt.block_on(async move {
            let gate = Arc::new(tokio::sync::Semaphore::new(32));
            let mut tasks = tokio::task::JoinSet::new();
            for _ in 0..n {
                let (ep, gate) = (ep.clone(), gate.clone());
                tasks.spawn(async move {
                    let _slot = gate.acquire_owned().await.ok()?;
                    let attempt = async {
                        let conn = connect(&ep, t.addr, "127.0.0.1").await?;
                        let mut control = ControlChannel::open(&conn).await?;
                        let welcome =
                            client_handshake(&mut control, Hello::new(rank, t.layout_hash)).await?;
                        Ok::<_, NetError>(Session {
                            conn,
                            control,
                            welcome,
                            rank,
                        })
                    };
                    tokio::time::timeout(WAIT, attempt).await.ok()?.ok()
                });
            }
            established(tasks, limit).await
        });
        Held {
            sessions,
            bare: Vec::new(),
            refused,
            elapsed: started.elapsed(),
        }
    }

    /// Opens `n` connections (TLS handshake only: no control stream, no hello), at most 32 at a time, for at most
    /// `limit`; keeps those that were established.
    pub fn hold_bare(&self, n: usize, limit: Duration) -> Held {
        let started = Instant::now();
        let (ep, t) = (self.ep.clone(), self.target);
        let (bare, refused) = self.rt.block_on(async move {
            let gate = Arc::new(tokio::sync::Semaphore::new(32));
            let mut tasks = tokio::task::JoinSet::new();
            for _ in 0..n {
                let (ep, gate) = (ep.clone(), gate.clone());
                tasks.spawn(async move {
                    let _slot = gate.acquire_owned().await.ok()?;
                    let attempt = connect(&ep, t.addr, "127.0.0.1");
                    tokio::time::timeout(WAIT, attempt).await.ok()?.ok()
                });
            }
            established(tasks, limit).await
        });
        Held {
            sessions: Vec::new(),
            bare,
            refused,
            elapsed: started.elapsed(),
        }
    }

    /// Says goodbye (at clock 0: nothing left to drain) on every held connection, without waiting for answers: the
    /// one the shard counts as current leaves the table, the superseded ones stay open unless the shard closes them.
    pub fn leave_all(&self, held: &mut Held) {
        self.rt.block_on(async {
            for s in &mut held.sessions {
                let bye = s.control.send(&Control::Goodbye { clock: 0 });
                let _ = tokio::time::timeout(Duration::from_millis(100), bye).await;
            }
        });
    }

    /// Closes the connections of `held` now (the shard sees them go).
    pub fn release(&self, held: Held) {
        for c in held.connections() {
            c.close(0u32.into(), b"released");
        }
        drop(held);
    }
}

/// Sends one framed push on a fresh unidirectional stream of `s`, then reads the control stream until the outcome of
/// round `clock` (bounded).
async fn send_and_settle(s: &mut Session, clock: u64, frame: &[u8]) -> Option<Outcome> {
    let mut stream = s.conn.open_uni().await.ok()?;
    stream.write_all(frame).await.ok()?;
    stream.finish().ok()?;
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        match tokio::time::timeout_at(deadline, s.control.recv()).await {
            Ok(Ok(Control::PushOutcome {
                clock: c, outcome, ..
            })) if c == clock => return Some(outcome),
            Ok(Ok(_)) => {}
            Ok(Err(_)) | Err(_) => return None,
        }
    }
}

/// A QUIC client configuration that trusts `ca`'s cluster CA and presents no certificate at all.
pub fn no_certificate_client(ca: &TlsFiles) -> quinn::ClientConfig {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.ca.clone()).expect("the cluster CA parses");
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("TLS 1.3 is supported")
        .with_root_certificates(roots)
        .with_no_client_auth();
    tls.alpn_protocols = vec![tether::common::protocol::ALPN.to_vec()];
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls)
        .expect("a TLS 1.3 config makes a QUIC config");
    quinn::ClientConfig::new(Arc::new(crypto))
}

/// Half-open QUIC handshakes: `n` client Initial packets (fresh connection ids, no client certificate offered),
/// built by the sans-IO `quinn-proto` endpoint and sent to `addr` from one UDP socket that never reads the answers.
/// The socket is returned so the handshakes stay half-open (not refused by ICMP) while the caller holds it.
pub fn half_open_handshakes(ca: &TlsFiles, addr: SocketAddr, n: usize) -> UdpSocket {
    let config = no_certificate_client(ca);
    let mut endpoint = quinn_proto::Endpoint::new(
        Arc::new(quinn_proto::EndpointConfig::default()),
        None,
        false,
        None,
    );
    let socket = UdpSocket::bind("127.0.0.1:0").expect("a loopback UDP socket binds");
    let mut buf = Vec::new();
    for _ in 0..n {
        let now = Instant::now();
        let Ok((_, mut conn)) = endpoint.connect(now, config.clone(), addr, "127.0.0.1") else {
            break;
        };
        buf.clear();
        if let Some(t) = conn.poll_transmit(now, 1, &mut buf) {
            let _ = socket.send_to(&buf[..t.size], addr);
        }
    }
    socket
}

/// Idle TCP connections to `addr` (e.g. a /metrics endpoint): `n` kept open by a background thread, which replaces
/// every connection the server closes, until dropped or `limit` passed.
pub struct IdleTcp {
    stop: Arc<AtomicBool>,
    /// Connections opened so far (replacements included).
    pub opened: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl IdleTcp {
    /// Starts holding `n` idle connections to `addr`.
    pub fn hold(addr: SocketAddr, n: usize, limit: Duration) -> IdleTcp {
        let stop = Arc::new(AtomicBool::new(false));
        let opened = Arc::new(AtomicU64::new(0));
        let (stop2, opened2) = (stop.clone(), opened.clone());
        let thread = std::thread::spawn(move || {
            let deadline = Instant::now() + limit;
            let mut conns: Vec<TcpStream> = Vec::new();
            while !stop2.load(Ordering::Relaxed) && Instant::now() < deadline {
                // Keep those the server has not closed (a read of 0 bytes, or an error, means it did).
                conns.retain(|c| {
                    let mut b = [0u8; 1];
                    matches!(c.peek(&mut b), Err(ref e) if e.kind() == std::io::ErrorKind::WouldBlock)
                });
                while conns.len() < n && Instant::now() < deadline {
                    match TcpStream::connect_timeout(&addr, Duration::from_millis(500)) {
                        Ok(c) => {
                            let _ = c.set_nonblocking(true);
                            conns.push(c);
                            opened2.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(_) => break,
                    }
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        });
        IdleTcp {
            stop,
            opened,
            thread: Some(thread),
        }
    }
}

impl Drop for IdleTcp {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Forges a checkpoint in the shard checkpoint root `root`: a copy of the newest one, as version newest + 1, whose
/// weights are all NaN, with every CRC (the data file's and the manifest's) recomputed as the format describes and
/// nothing else (no key). Returns the forged directory.
pub fn forge_nan_checkpoint(root: &Path) -> PathBuf {
    let mut versions: Vec<(u64, PathBuf)> = std::fs::read_dir(root)
        .expect("the shard has a checkpoint root")
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let v = e.file_name().to_str()?.strip_prefix('v')?.parse().ok()?;
            Some((v, e.path()))
        })
        .collect();
    versions.sort();
    let (newest, src) = versions.pop().expect("at least one checkpoint to copy");
    let forged_version = newest + 1;
    let dst = root.join(format!("v{forged_version:020}"));
    std::fs::create_dir(&dst).unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
    let manifest_path = dst.join("manifest.json");
    let mut envelope: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&manifest_path).unwrap()).unwrap();
    let body = &mut envelope["body"];
    body["version"] = forged_version.into();
    let files = body["files"]
        .as_array_mut()
        .expect("a manifest lists its files");
    let weights = files
        .iter_mut()
        .find(|f| f["name"] == "weights.f32.zst")
        .expect("a manifest lists the weights");
    let n = weights["elements"].as_u64().unwrap() as usize;
    let raw: Vec<u8> = std::iter::repeat_n(f32::NAN.to_le_bytes(), n)
        .flatten()
        .collect();
    let mut enc = zstd::stream::Encoder::new(Vec::new(), 1).unwrap();
    enc.include_checksum(true).unwrap();
    std::io::Write::write_all(&mut enc, &raw).unwrap();
    let stored = enc.finish().unwrap();
    std::fs::write(dst.join("weights.f32.zst"), &stored).unwrap();
    weights["bytes"] = (stored.len() as u64).into();
    weights["checksum"] = crc32fast::hash(&stored).into();
    let crc = crc32fast::hash(&serde_json::to_vec(&envelope["body"]).unwrap());
    envelope["crc32"] = crc.into();
    std::fs::write(
        &manifest_path,
        serde_json::to_vec_pretty(&envelope).unwrap(),
    )
    .unwrap();
    dst
}

/// Waits (until `limit`) for the connection attempts in `tasks`: the ones established, and how many were refused,
/// failed or still pending at the deadline (those are aborted).
async fn established<T: 'static>(
    mut tasks: tokio::task::JoinSet<Option<T>>,
    limit: Duration,
) -> (Vec<T>, usize) {
    let (mut done, mut refused) = (Vec::new(), 0);
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        match tokio::time::timeout_at(deadline, tasks.join_next()).await {
            Ok(Some(Ok(Some(c)))) => done.push(c),
            Ok(Some(_)) => refused += 1,
            Ok(None) => break,
            Err(_) => {
                refused += tasks.len();
                tasks.abort_all();
                break;
            }
        }
    }
    (done, refused)
}

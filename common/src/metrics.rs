//! Prometheus metrics (names fixed in docs/design.md §6): the server's and the worker's metric sets, registered in a
//! `prometheus-client` registry, and a minimal HTTP exporter serving the text format at `/metrics`. Recording is a
//! few atomic operations and never blocks; the exporter runs on its own task and only reads, with a bounded number of
//! connections (idle ones make room for new ones, oldest first) and a backing-off accept loop, so that it never
//! competes with the process it reports on and idle connections cannot lock a scraper out.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, Semaphore};

/// Label set `{reason="..."}` / `{kind="..."}`.
pub type Labels = Vec<(&'static str, &'static str)>;

/// A float gauge.
pub type FloatGauge = Gauge<f64, std::sync::atomic::AtomicU64>;

/// Metrics a shard server exports.
#[derive(Clone)]
pub struct ServerMetrics {
    /// `tether_updates_applied_total`.
    pub updates_applied: Counter,
    /// `tether_updates_rejected_total{reason}`.
    pub updates_rejected: Family<Labels, Counter>,
    /// `tether_bytes_received_total{kind="wire"|"fp32"}`.
    pub bytes_received: Family<Labels, Counter>,
    /// `tether_staleness` (updates).
    pub staleness: Histogram,
    /// `tether_pull_wait_seconds`: time a pull was parked by the SSP gate.
    pub pull_wait: Histogram,
    /// `tether_workers_live`.
    pub workers_live: Gauge,
    /// `tether_checkpoint_seconds`: time to write the last checkpoint.
    pub checkpoint_seconds: FloatGauge,
    /// `tether_checkpoint_last_version`.
    pub checkpoint_last_version: Gauge,
    /// `tether_shard_version`: the shard's current version (its checkpoint age is this minus the last version).
    pub version: Gauge,
    /// `tether_rollbacks_total`: loss-spike rollbacks this shard carried out.
    pub rollbacks: Counter,
    /// `tether_quorum_closes_total`: rounds closed by the quorum with a punctual worker left behind.
    pub quorum_closes: Counter,
    /// `tether_workers_left_behind_total`: punctual workers those closes left behind.
    pub left_behind: Counter,
    /// `tether_replica_connected`: 1 while a standby follows this shard.
    pub replica_connected: Gauge,
    /// `tether_takeovers_total`: times this process took over as its shard's primary (a standby's).
    pub takeovers: Counter,
}

impl ServerMetrics {
    /// Creates the metrics and registers them in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self {
            updates_applied: Counter::default(),
            updates_rejected: Family::default(),
            bytes_received: Family::default(),
            staleness: Histogram::new([0.0, 1.0, 2.0, 3.0, 4.0, 7.0, 15.0, 31.0, 63.0, 127.0]),
            pull_wait: Histogram::new(exponential_buckets(1e-4, 4.0, 10)),
            workers_live: Gauge::default(),
            checkpoint_seconds: FloatGauge::default(),
            checkpoint_last_version: Gauge::default(),
            version: Gauge::default(),
            rollbacks: Counter::default(),
            quorum_closes: Counter::default(),
            left_behind: Counter::default(),
            replica_connected: Gauge::default(),
            takeovers: Counter::default(),
        };
        registry.register(
            "tether_replica_connected",
            "1 while a standby follows this shard (replies wait for its acknowledgement)",
            m.replica_connected.clone(),
        );
        registry.register(
            "tether_takeovers",
            "Times this standby took over as its shard's primary",
            m.takeovers.clone(),
        );
        registry.register(
            "tether_updates_applied",
            "Gradient updates applied",
            m.updates_applied.clone(),
        );
        registry.register(
            "tether_updates_rejected",
            "Pushes rejected, by reason",
            m.updates_rejected.clone(),
        );
        registry.register(
            "tether_bytes_received",
            "Push bytes received (wire) and their fp32 size",
            m.bytes_received.clone(),
        );
        registry.register(
            "tether_staleness",
            "Staleness of applied gradients in updates",
            m.staleness.clone(),
        );
        registry.register(
            "tether_pull_wait_seconds",
            "Time pulls waited at the SSP gate",
            m.pull_wait.clone(),
        );
        registry.register(
            "tether_workers_live",
            "Workers in the clock table",
            m.workers_live.clone(),
        );
        registry.register(
            "tether_checkpoint_seconds",
            "Duration of the last checkpoint write",
            m.checkpoint_seconds.clone(),
        );
        registry.register(
            "tether_checkpoint_last_version",
            "Version of the last checkpoint",
            m.checkpoint_last_version.clone(),
        );
        registry.register(
            "tether_shard_version",
            "Current shard version (updates applied over the shard's life, restored ones included)",
            m.version.clone(),
        );
        registry.register(
            "tether_rollbacks",
            "Loss-spike rollbacks to an in-memory snapshot",
            m.rollbacks.clone(),
        );
        registry.register(
            "tether_quorum_closes",
            "Rounds closed by the quorum after the grace window, with a worker left behind",
            m.quorum_closes.clone(),
        );
        registry.register(
            "tether_workers_left_behind",
            "Workers left behind by quorum closes (their pushes are merged late)",
            m.left_behind.clone(),
        );
        m
    }
}

/// Metrics a worker exports.
#[derive(Clone)]
pub struct WorkerMetrics {
    /// `tether_worker_step_seconds`: one pull-compute-push step.
    pub step_seconds: Histogram,
    /// `tether_worker_loss`: the last training loss.
    pub loss: FloatGauge,
    /// `tether_worker_steps_total`.
    pub steps: Counter,
    /// `tether_worker_bytes_pushed_total{kind="wire"|"fp32"}`.
    pub bytes_pushed: Family<Labels, Counter>,
    /// `tether_worker_nonfinite_total`: gradients refused because they were not finite.
    pub nonfinite: Counter,
}

impl WorkerMetrics {
    /// Creates the metrics and registers them in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self {
            step_seconds: Histogram::new(exponential_buckets(1e-3, 2.0, 14)),
            loss: FloatGauge::default(),
            steps: Counter::default(),
            bytes_pushed: Family::default(),
            nonfinite: Counter::default(),
        };
        registry.register(
            "tether_worker_step_seconds",
            "Duration of one training step",
            m.step_seconds.clone(),
        );
        registry.register("tether_worker_loss", "Last training loss", m.loss.clone());
        registry.register(
            "tether_worker_steps",
            "Training steps completed",
            m.steps.clone(),
        );
        registry.register(
            "tether_worker_bytes_pushed",
            "Bytes pushed (wire) and their fp32 size",
            m.bytes_pushed.clone(),
        );
        registry.register(
            "tether_worker_nonfinite",
            "Non-finite gradients refused",
            m.nonfinite.clone(),
        );
        m
    }
}

/// Largest request head the exporter reads.
const MAX_REQUEST: usize = 8192;
/// Connections still sending their request head, at most; one accepted beyond them closes the oldest of them.
pub const MAX_SCRAPE_CONNECTIONS: usize = 16;
/// Connections being answered (request read, response being written), at most; one beyond them is closed at once.
pub const MAX_ANSWERING: usize = 16;
/// A scraper must send its request head within this time of connecting, and read the answer within as long again.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(5);
/// The first pause of the accept loop after an error that is not about one connection.
pub const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(5);
/// The longest pause of the accept loop while such errors go on.
pub const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// Renders the registry in the Prometheus text format.
pub fn render(registry: &Registry) -> String {
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = encode(&mut out, registry);
    out
}

/// How long the accept loop pauses after `err`, given its pause after the previous error in a row (`None` after an
/// accepted connection): nothing for an error about one connection (reset or aborted before it was accepted); else
/// twice the previous pause, from [`ACCEPT_BACKOFF_MIN`] up to [`ACCEPT_BACKOFF_MAX`]. Running out of descriptors
/// (EMFILE, ENFILE) or memory fails every accept until something is closed: retrying at once only burns the CPU
/// the rest of the process needs to close something.
pub fn accept_backoff(err: &std::io::Error, previous: Option<Duration>) -> Option<Duration> {
    use std::io::ErrorKind;
    if matches!(
        err.kind(),
        ErrorKind::ConnectionAborted
            | ErrorKind::ConnectionReset
            | ErrorKind::ConnectionRefused
            | ErrorKind::Interrupted
    ) {
        return None;
    }
    Some(match previous {
        None => ACCEPT_BACKOFF_MIN,
        Some(p) => (p * 2).clamp(ACCEPT_BACKOFF_MIN, ACCEPT_BACKOFF_MAX),
    })
}

/// The connections still sending their request head, oldest first, each with what the caller keeps for it (the
/// exporter: the sender that closes it): the admission rule, without I/O. At most [`MAX_SCRAPE_CONNECTIONS`] wait;
/// admitting one more evicts the oldest. An idle connection therefore holds its place only until that many newer
/// ones arrive, and a scraper, which sends its request at once, is never locked out by connections that send
/// nothing.
#[derive(Debug)]
pub struct WaitingRoom<T> {
    next: u64,
    queue: VecDeque<(u64, T)>,
}

impl<T> Default for WaitingRoom<T> {
    fn default() -> Self {
        Self {
            next: 0,
            queue: VecDeque::new(),
        }
    }
}

impl<T> WaitingRoom<T> {
    /// Admits a new connection holding `value`: returns its ticket and the oldest waiter it evicts, if any.
    pub fn admit(&mut self, value: T) -> (u64, Option<(u64, T)>) {
        let evicted = if self.queue.len() >= MAX_SCRAPE_CONNECTIONS {
            self.queue.pop_front()
        } else {
            None
        };
        let ticket = self.next;
        self.next += 1;
        self.queue.push_back((ticket, value));
        (ticket, evicted)
    }

    /// `ticket` is done waiting (its request arrived, or it failed): returns its value, or `None` if it was already
    /// evicted.
    pub fn leave(&mut self, ticket: u64) -> Option<T> {
        let i = self.queue.iter().position(|(t, _)| *t == ticket)?;
        self.queue.remove(i).map(|(_, v)| v)
    }

    /// Connections waiting now.
    pub fn len(&self) -> usize {
        self.queue.len()
    }

    /// True when nobody waits.
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }
}

/// Locks the waiting room; a poisoned lock (a panicking connection task) still holds consistent bookkeeping, since
/// every critical section below is one queue operation that cannot panic half-way.
fn lock<T>(room: &Mutex<WaitingRoom<T>>) -> std::sync::MutexGuard<'_, WaitingRoom<T>> {
    room.lock().unwrap_or_else(|p| p.into_inner())
}

/// Serves `GET /metrics` on `addr` until the task is dropped; returns the bound address. At most
/// [`MAX_SCRAPE_CONNECTIONS`] connections wait for their request head (a new one evicts the oldest:
/// [`WaitingRoom`]), each within [`REQUEST_DEADLINE`]; at most [`MAX_ANSWERING`] are answered at once, each
/// within [`REQUEST_DEADLINE`]; accept errors back off ([`accept_backoff`]). So neither idle connections nor a
/// process out of descriptors make the exporter take more than a few dozen descriptors or any CPU from the shard
/// it reports on, and a scraper is answered while idle connections come and go.
pub async fn serve(
    addr: SocketAddr,
    registry: Arc<Registry>,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let answering = Arc::new(Semaphore::new(MAX_ANSWERING));
    // Each waiter's sender: dropping it (on eviction) wakes the waiter's task, which closes its connection.
    let room = Arc::new(Mutex::new(WaitingRoom::<oneshot::Sender<()>>::default()));
    let task = tokio::spawn(async move {
        let mut backoff = None;
        loop {
            let sock = match listener.accept().await {
                Ok((sock, _)) => {
                    backoff = None;
                    sock
                }
                Err(e) => {
                    if let Some(pause) = accept_backoff(&e, backoff) {
                        if backoff.is_none() {
                            tracing::warn!(%local, error = %e, "metrics exporter cannot accept; backing off");
                        }
                        backoff = Some(pause);
                        tokio::time::sleep(pause).await;
                    }
                    continue;
                }
            };
            let (tx, rx) = oneshot::channel();
            let (ticket, evicted) = lock(&room).admit(tx);
            drop(evicted);
            let (registry, room, answering) = (registry.clone(), room.clone(), answering.clone());
            tokio::spawn(async move {
                let mut sock = sock;
                let mut buf = [0u8; MAX_REQUEST];
                let mut n = 0;
                let deadline = tokio::time::Instant::now() + REQUEST_DEADLINE;
                let evicted = tokio::select! {
                    biased;
                    _ = read_head(&mut sock, &mut buf, &mut n, deadline) => false,
                    _ = rx => true,
                };
                drop(lock(&room).leave(ticket));
                // Answering holds a slot from here on; a connection that cannot get one is closed.
                let Ok(_slot) = answering.try_acquire() else {
                    return;
                };
                if evicted {
                    // A waiter whose request has arrived (but was not read yet, because newer connections were
                    // accepted first) is not idle: it is answered like the others. Only a silent one is closed.
                    let Some(s) = with_pending_bytes(sock, n) else {
                        return;
                    };
                    sock = s;
                    read_head(&mut sock, &mut buf, &mut n, deadline).await;
                }
                if n == 0 {
                    return;
                }
                let request = String::from_utf8_lossy(&buf[..n]);
                let _ =
                    tokio::time::timeout(REQUEST_DEADLINE, respond(&mut sock, &request, &registry))
                        .await;
            });
        }
    });
    Ok((local, task))
}

/// Reads one request head into `buf[*n..]`, bounded by `buf`'s size and by `deadline`, counting what it read in
/// `n` (so that a read interrupted by eviction keeps its bytes). Reads the whole head: closing a socket with unread
/// request bytes makes the kernel answer with a reset, which the client sees instead of the response.
async fn read_head(
    sock: &mut TcpStream,
    buf: &mut [u8],
    n: &mut usize,
    deadline: tokio::time::Instant,
) {
    while *n < buf.len() && !buf[..*n].windows(4).any(|w| w == b"\r\n\r\n") {
        match tokio::time::timeout_at(deadline, sock.read(&mut buf[*n..])).await {
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => break,
            Ok(Ok(k)) => *n += k,
        }
    }
}

/// `sock` back if its peer has sent something: `read` bytes already, or bytes waiting in the kernel (one
/// non-blocking peek, made directly on the socket: the reactor may not have seen them yet).
fn with_pending_bytes(sock: TcpStream, read: usize) -> Option<TcpStream> {
    if read > 0 {
        return Some(sock);
    }
    // `into_std` keeps the socket non-blocking, so the peek returns at once.
    let std = sock.into_std().ok()?;
    let mut b = [0u8; 1];
    match std.peek(&mut b) {
        Ok(k) if k > 0 => TcpStream::from_std(std).ok(),
        _ => None,
    }
}

/// Answers `request` (a request head) on `sock`: the metrics for `GET /metrics`, 404 for anything else.
async fn respond(sock: &mut TcpStream, request: &str, registry: &Registry) {
    let (status, body) = if request.starts_with("GET /metrics") {
        ("200 OK", render(registry))
    } else {
        ("404 Not Found", "not found\n".to_string())
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let _ = sock.write_all(head.as_bytes()).await;
    let _ = sock.write_all(body.as_bytes()).await;
    let _ = sock.shutdown().await;
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_metrics_render_with_contract_names() {
        let mut reg = Registry::default();
        let m = ServerMetrics::register(&mut reg);
        m.updates_applied.inc();
        m.updates_rejected
            .get_or_create(&vec![("reason", "replay")])
            .inc();
        m.bytes_received
            .get_or_create(&vec![("kind", "wire")])
            .inc_by(10);
        m.staleness.observe(2.0);
        m.workers_live.set(3);
        let text = render(&reg);
        for name in [
            "tether_updates_applied_total 1",
            "tether_updates_rejected_total{reason=\"replay\"} 1",
            "tether_bytes_received_total{kind=\"wire\"} 10",
            "tether_staleness_bucket",
            "tether_pull_wait_seconds_bucket",
            "tether_workers_live 3",
            "tether_checkpoint_seconds",
            "tether_checkpoint_last_version",
        ] {
            assert!(text.contains(name), "missing {name} in\n{text}");
        }
    }

    #[test]
    fn accept_errors_back_off_unless_they_concern_one_connection() {
        use std::io::{Error, ErrorKind};
        let emfile = Error::from_raw_os_error(libc::EMFILE);
        let mut pause = None;
        let mut pauses = Vec::new();
        for _ in 0..12 {
            pause = accept_backoff(&emfile, pause);
            pauses.push(pause.unwrap());
        }
        assert_eq!(pauses[0], ACCEPT_BACKOFF_MIN);
        assert_eq!(pauses[1], 2 * ACCEPT_BACKOFF_MIN);
        assert!(pauses.windows(2).all(|w| w[0] <= w[1]), "{pauses:?}");
        assert_eq!(*pauses.last().unwrap(), ACCEPT_BACKOFF_MAX);
        // Descriptors across the system, memory: the same.
        for errno in [libc::ENFILE, libc::ENOBUFS, libc::ENOMEM] {
            assert!(accept_backoff(&Error::from_raw_os_error(errno), None).is_some());
        }
        // A connection reset before it was accepted says nothing about the next one.
        for kind in [ErrorKind::ConnectionAborted, ErrorKind::ConnectionReset] {
            assert_eq!(
                accept_backoff(&Error::from(kind), Some(ACCEPT_BACKOFF_MAX)),
                None
            );
        }
    }

    /// Reads one byte from each socket at once (bounded by `wait`); true for each the server closed. The sockets
    /// come back, so that none is closed (freeing its slot) before the caller is done.
    async fn closed_by_server(
        socks: Vec<tokio::net::TcpStream>,
        wait: Duration,
    ) -> (Vec<bool>, Vec<tokio::net::TcpStream>) {
        let mut reads = tokio::task::JoinSet::new();
        for (i, mut s) in socks.into_iter().enumerate() {
            reads.spawn(async move {
                let mut b = [0u8; 1];
                let closed = matches!(
                    tokio::time::timeout(wait, s.read(&mut b)).await,
                    Ok(Ok(0)) | Ok(Err(_))
                );
                (i, closed, s)
            });
        }
        let mut done = Vec::new();
        while let Some(r) = reads.join_next().await {
            done.push(r.unwrap());
        }
        done.sort_by_key(|(i, _, _)| *i);
        done.into_iter().map(|(_, c, s)| (c, s)).unzip()
    }

    async fn scrape(addr: SocketAddr) -> Option<String> {
        let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .ok()?;
        let mut body = String::new();
        tokio::time::timeout(Duration::from_secs(2), s.read_to_string(&mut body))
            .await
            .ok()?
            .ok()?;
        body.starts_with("HTTP/1.1 200 OK").then_some(body)
    }

    #[test]
    fn the_waiting_room_evicts_the_oldest_waiter_and_forgets_those_that_left() {
        let mut room = WaitingRoom::default();
        let first: Vec<u64> = (0..MAX_SCRAPE_CONNECTIONS)
            .map(|k| {
                let (t, evicted) = room.admit(k);
                assert_eq!(evicted, None);
                t
            })
            .collect();
        // One that sent its request leaves with its value; the next one takes its place without evicting anybody.
        assert_eq!(room.leave(first[3]), Some(3));
        assert_eq!(room.leave(first[3]), None, "left twice");
        assert_eq!(room.admit(100).1, None);
        // The room is full again: each newcomer evicts the oldest waiter still there, skipping the one that left.
        assert_eq!(room.admit(101).1, Some((first[0], 0)));
        assert_eq!(room.admit(102).1, Some((first[1], 1)));
        assert_eq!(room.admit(103).1, Some((first[2], 2)));
        assert_eq!(room.admit(104).1, Some((first[4], 4)));
        assert_eq!(
            room.leave(first[0]),
            None,
            "an evicted waiter cannot leave again"
        );
        assert_eq!(room.len(), MAX_SCRAPE_CONNECTIONS);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn idle_connections_make_room_oldest_first_and_a_scrape_is_answered_at_once() {
        let mut reg = Registry::default();
        ServerMetrics::register(&mut reg);
        let (addr, task) = serve("127.0.0.1:0".parse().unwrap(), Arc::new(reg))
            .await
            .unwrap();
        let extra = 8;
        let mut idle = Vec::new();
        for _ in 0..MAX_SCRAPE_CONNECTIONS + extra {
            idle.push(tokio::net::TcpStream::connect(addr).await.unwrap());
        }
        let (closed, mut held) = closed_by_server(idle, Duration::from_millis(500)).await;
        assert_eq!(
            closed.iter().filter(|&&c| c).count(),
            extra,
            "only as many as came beyond the cap are closed: {closed:?}"
        );
        assert!(
            closed[..extra].iter().all(|&c| c) && closed[extra..].iter().all(|&c| !c),
            "the oldest are closed, the newest kept: {closed:?}"
        );
        // With the room full of idle connections (held open here), a scrape is answered well before their deadline.
        let asked = tokio::time::Instant::now();
        let body = scrape(addr)
            .await
            .expect("a scrape behind a full room of idle connections is answered");
        assert!(
            asked.elapsed() < REQUEST_DEADLINE / 2,
            "{:?}",
            asked.elapsed()
        );
        assert!(body.contains("tether_updates_applied_total"), "{body}");
        // And it evicted the oldest idle connection still held.
        let (closed, _held) =
            closed_by_server(held.split_off(extra), Duration::from_millis(500)).await;
        assert_eq!(closed.iter().filter(|&&c| c).count(), 1, "{closed:?}");
        assert!(closed[0], "{closed:?}");
        task.abort();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_scrape_followed_at_once_by_a_burst_of_idle_connections_is_answered() {
        let mut reg = Registry::default();
        ServerMetrics::register(&mut reg);
        let (addr, task) = serve("127.0.0.1:0".parse().unwrap(), Arc::new(reg))
            .await
            .unwrap();
        let mut idle = Vec::new();
        for round in 0..20 {
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                .await
                .unwrap();
            // Enough newcomers to evict the scrape from the waiting room, however fast it was accepted.
            for _ in 0..2 * MAX_SCRAPE_CONNECTIONS {
                idle.push(tokio::net::TcpStream::connect(addr).await.unwrap());
            }
            let mut body = String::new();
            tokio::time::timeout(Duration::from_secs(2), s.read_to_string(&mut body))
                .await
                .unwrap_or_else(|_| panic!("round {round}: no answer in 2 s"))
                .unwrap();
            assert!(body.starts_with("HTTP/1.1 200 OK"), "round {round}: {body}");
            idle.drain(..);
        }
        task.abort();
    }

    #[tokio::test]
    async fn exporter_serves_metrics_over_http() {
        let mut reg = Registry::default();
        let m = WorkerMetrics::register(&mut reg);
        m.loss.set(0.25);
        let (addr, task) = serve("127.0.0.1:0".parse().unwrap(), Arc::new(reg))
            .await
            .unwrap();
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut body = String::new();
        tokio::time::timeout(
            std::time::Duration::from_secs(5),
            s.read_to_string(&mut body),
        )
        .await
        .unwrap()
        .unwrap();
        task.abort();
        assert!(body.starts_with("HTTP/1.1 200 OK"), "{body}");
        assert!(body.contains("tether_worker_loss 0.25"), "{body}");
        assert!(body.contains("tether_worker_step_seconds_bucket"), "{body}");
    }
}

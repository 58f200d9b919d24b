//! The shard's connection budgets against a real shard on loopback (in-process `start_shard`, real QUIC and TLS):
//! one certificate opening more connections than its share gets `Overloaded` for the surplus while an honest worker
//! still joins, and a flood of half-open handshakes from one address does not delay an honest handshake.

use std::collections::HashSet;
use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use tether_common::config::{Config, Staleness};
use tether_common::layout::model_layout;
use tether_common::net::{
    client_endpoint, client_endpoint_on, client_handshake, connect, ControlChannel, TlsFiles,
    TransportTuning,
};
use tether_common::protocol::{ErrorCode, Hello};
use tether_server::admission::MAX_CONNECTIONS_PER_IDENTITY;
use tether_server::node::{start_shard, RunningShard, ShardOptions};

/// Bound on every wait of these tests.
const WAIT: Duration = Duration::from_secs(10);

fn config(dir: &Path) -> Config {
    tether_common::pki::generate_dev(&dir.join("certs"), &[], 1, 2).unwrap();
    let mut cfg = Config::with_servers(vec!["127.0.0.1:0".into()]);
    cfg.model.features = Some(32);
    cfg.model.hidden = vec![16];
    cfg.model.classes = Some(4);
    cfg.cluster.workers = 2;
    cfg.cluster.staleness = Staleness::Bounded(1);
    cfg.cluster.tls_dir = dir.join("certs");
    cfg.checkpoint.dir = dir.join("ckpt");
    cfg
}

/// Runs `test` against a fresh shard inside an actix system on a multi-threaded runtime.
fn with_shard<F, Fut>(test: F)
where
    F: FnOnce(Config, RunningShard) -> Fut,
    Fut: Future<Output = ()>,
{
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config(tmp.path());
    let sys = actix_rt::System::with_tokio_rt(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
    });
    sys.block_on(async move {
        let shard = start_shard(&cfg, ShardOptions::default()).await.unwrap();
        test(cfg, shard).await;
    });
}

fn worker_tls(cfg: &Config, rank: u32) -> TlsFiles {
    TlsFiles::for_worker(&cfg.cluster.tls_dir, rank).unwrap()
}

/// Connects as `rank` and completes the hello/welcome handshake; returns how long it took.
async fn honest_join(cfg: &Config, addr: SocketAddr, rank: u32) -> Duration {
    let start = Instant::now();
    let endpoint = client_endpoint(&worker_tls(cfg, rank), &TransportTuning::default()).unwrap();
    let layout = model_layout(cfg).unwrap().hash();
    let joined = tokio::time::timeout(WAIT, async {
        let conn = connect(&endpoint, addr, "127.0.0.1").await?;
        let mut control = ControlChannel::open(&conn).await?;
        client_handshake(&mut control, Hello::new(rank, layout)).await
    })
    .await;
    match joined {
        Ok(Ok(welcome)) => assert_eq!(welcome.shard, 0),
        Ok(Err(e)) => panic!("honest worker {rank} refused: {e}"),
        Err(_) => panic!("honest worker {rank} not welcomed within {WAIT:?}"),
    }
    start.elapsed()
}

#[test]
fn one_certificate_gets_its_share_of_connections_and_an_honest_worker_still_joins() {
    with_shard(|cfg, shard| async move {
        let attacker = client_endpoint(&worker_tls(&cfg, 1), &TransportTuning::default()).unwrap();
        let opened = 3 * MAX_CONNECTIONS_PER_IDENTITY;
        let mut conns = Vec::new();
        for _ in 0..opened {
            // TLS completes for each: the certificate is valid. None sends a hello; each just holds on.
            let conn =
                tokio::time::timeout(WAIT, connect(&attacker, shard.local_addr, "127.0.0.1"))
                    .await
                    .expect("TLS handshake timed out")
                    .expect("a valid certificate completes TLS");
            conns.push(conn);
        }
        let mut waits = tokio::task::JoinSet::new();
        for conn in &conns {
            let conn = conn.clone();
            waits.spawn(async move {
                tokio::time::timeout(Duration::from_secs(2), conn.closed())
                    .await
                    .ok()
            });
        }
        let (mut overloaded, mut open) = (0, 0);
        while let Some(r) = waits.join_next().await {
            match r.unwrap() {
                None => open += 1,
                Some(quinn::ConnectionError::ApplicationClosed(c))
                    if c.error_code == ErrorCode::Overloaded.close_code() =>
                {
                    overloaded += 1
                }
                Some(other) => panic!("closed otherwise than Overloaded: {other}"),
            }
        }
        assert_eq!(
            (open, overloaded),
            (
                MAX_CONNECTIONS_PER_IDENTITY,
                opened - MAX_CONNECTIONS_PER_IDENTITY
            ),
            "one certificate keeps exactly its share; the surplus is refused at once"
        );
        // Worker 0 joins while worker 1's certificate holds its whole share.
        honest_join(&cfg, shard.local_addr, 0).await;
        drop(conns);
        shard.kill();
    });
}

/// Long-header QUIC Initial: the destination connection ID (which tells handshakes apart), if the datagram is one.
fn initial_dcid(datagram: &[u8]) -> Option<&[u8]> {
    let first = *datagram.first()?;
    // Long header, fixed bit, packet type Initial (0b00).
    if first & 0xf0 != 0xc0 {
        return None;
    }
    let len = *datagram.get(5)? as usize;
    datagram.get(6..6 + len)
}

/// `count` distinct client Initial datagrams, as real quinn clients send them, captured before any reached a server.
async fn captured_initials(cfg: &Config, count: usize) -> Vec<Vec<u8>> {
    let capture = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let target = capture.local_addr().unwrap();
    let clients = client_endpoint_on(
        "127.0.0.2:0".parse().unwrap(),
        &worker_tls(cfg, 1),
        &TransportTuning::default(),
    )
    .unwrap();
    let mut seen = HashSet::new();
    let mut initials = Vec::new();
    let mut pending = Vec::new();
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut buf = vec![0u8; 65_536];
    while initials.len() < count {
        // A few connection attempts at a time, so that the capture socket's buffer never overflows.
        if pending.len() < initials.len() + 32 && pending.len() < count {
            pending.push(clients.connect(target, "127.0.0.1").unwrap());
            continue;
        }
        let Ok(got) = tokio::time::timeout_at(deadline, capture.recv(&mut buf)).await else {
            panic!("captured only {} of {count} initials", initials.len());
        };
        let n = got.unwrap();
        if let Some(dcid) = initial_dcid(&buf[..n]) {
            if seen.insert(dcid.to_vec()) {
                initials.push(buf[..n].to_vec());
            }
        }
    }
    clients.close(0u32.into(), b"captured");
    drop(pending);
    initials
}

#[test]
fn half_open_handshakes_from_one_address_do_not_delay_an_honest_handshake() {
    with_shard(|cfg, shard| async move {
        // More than the shard ever had connection slots: each attempt is a real client hello that is never
        // followed up, from an address other than the honest worker's.
        let initials = captured_initials(&cfg, 1100).await;
        let flood = tokio::net::UdpSocket::bind("127.0.0.2:0").await.unwrap();
        for batch in initials.chunks(50) {
            for datagram in batch {
                flood.send_to(datagram, shard.local_addr).await.unwrap();
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let took = honest_join(&cfg, shard.local_addr, 0).await;
        assert!(
            took < Duration::from_secs(3),
            "the honest handshake took {took:?} behind half-open ones"
        );
        drop(flood);
        shard.kill();
    });
}

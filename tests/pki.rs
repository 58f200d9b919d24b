//! The cluster PKI against real `tether-server` / `tether-worker` processes: a worker's key cannot act as another
//! rank (neither in its Hello nor in a push), a revoked worker is refused at the handshake by a shard that lists it
//! in `cluster.revoked` while the others train, and a rank issued later with `keygen issue` from the kept CA joins
//! a running cluster. Transport-level cases (expired certificates, a shard certificate presented as another shard)
//! are in `common/tests/net.rs`. Every wait is bounded.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use support::hostile::{encode_gradient, push_frame, Gradient};
use support::{free_tcp_addr, http_get, metric, num, serial, Cluster, Spec};
use tether::common::config::Config;
use tether::common::layout::model_layout;
use tether::common::net::{
    certificate_serial, client_endpoint, client_handshake, connect, connect_shard, ControlChannel,
    TlsFiles, TransportTuning,
};
use tether::common::protocol::{ErrorCode, Hello, Welcome};

const WAIT: Duration = Duration::from_secs(10);

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// How the server ended `conn` (bounded wait): its application close code, if it closed it with one.
async fn close_code(conn: &quinn::Connection) -> Option<u64> {
    match tokio::time::timeout(WAIT, conn.closed()).await {
        Ok(quinn::ConnectionError::ApplicationClosed(c)) => Some(c.error_code.into_inner()),
        _ => None,
    }
}

/// One encoded push frame (length-prefixed, as the worker sends it) for the shard range in `w`.
fn push(w: &Welcome, worker: u32, clock: u64, grad_len: usize) -> Vec<u8> {
    let grad = Gradient::Plausible.values(grad_len);
    push_frame(w, worker, clock, false, encode_gradient(&grad))
}

async fn send(conn: &quinn::Connection, frame: &[u8]) {
    let mut s = conn.open_uni().await.unwrap();
    s.write_all(frame).await.unwrap();
    s.finish().unwrap();
}

fn applied(metrics: SocketAddr) -> f64 {
    let text = http_get(metrics, "/metrics").unwrap();
    metric(&text, "tether_updates_applied_total").unwrap_or(0.0)
}

#[test]
fn a_worker_key_cannot_act_as_another_rank() {
    let _serial = serial();
    let c = Cluster::new(Spec {
        shards: 1,
        workers: 2,
        ..Spec::default()
    });
    let cfg = Config::load(&c.path("cluster.toml")).unwrap();
    let layout = model_layout(&cfg).unwrap();
    let (layout_hash, shard_len) = (layout.hash(), layout.shard_range(0, 1).len());
    let maddr = free_tcp_addr();
    let m = maddr.to_string();
    let mut server = c.server(0, &["--metrics", &m]);
    let rank1 = TlsFiles::for_worker(&c.path("certs"), 1).unwrap();
    let rt = runtime();
    let (hello_code, push_code, applied_before, applied_after) = rt.block_on(async {
        let ep = client_endpoint(&rank1, &TransportTuning::default()).unwrap();
        // 1. Rank 1's key claiming rank 0 in its Hello: refused with Unauthorized, no welcome.
        let conn = connect_shard(&ep, c.servers[0], "127.0.0.1", 0)
            .await
            .unwrap();
        let mut control = ControlChannel::open(&conn).await.unwrap();
        let res = tokio::time::timeout(
            WAIT,
            client_handshake(&mut control, Hello::new(0, layout_hash)),
        )
        .await
        .unwrap();
        assert!(
            res.is_err(),
            "rank 1's certificate was welcomed as rank 0: {res:?}"
        );
        let hello_code = close_code(&conn).await;

        // 2. Welcomed honestly as rank 1: its own push is applied, a push naming rank 0 closes the connection.
        let conn = connect(&ep, c.servers[0], "127.0.0.1").await.unwrap();
        let mut control = ControlChannel::open(&conn).await.unwrap();
        let w = tokio::time::timeout(
            WAIT,
            client_handshake(&mut control, Hello::new(1, layout_hash)),
        )
        .await
        .unwrap()
        .unwrap();
        send(&conn, &push(&w, 1, w.min_clock, shard_len)).await;
        let mut applied_before = 0.0;
        for _ in 0..100 {
            applied_before = applied(maddr);
            if applied_before >= 1.0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        send(&conn, &push(&w, 0, w.min_clock + 1, shard_len)).await;
        let push_code = close_code(&conn).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        (hello_code, push_code, applied_before, applied(maddr))
    });
    let unauthorized = Some(u64::from(ErrorCode::Unauthorized.code()));
    assert_eq!(hello_code, unauthorized, "Hello claiming another rank");
    assert_eq!(push_code, unauthorized, "push naming another rank");
    assert_eq!(applied_before, 1.0, "the honest push was not applied");
    assert_eq!(
        applied_after, 1.0,
        "a push naming another rank changed the weights"
    );
    assert!(server.alive(), "{}", server.log_tail(2000));
    server.terminate();
    server.wait_success(Duration::from_secs(30));
}

#[test]
fn a_revoked_worker_is_refused_and_a_rank_issued_later_joins_the_running_cluster() {
    let _serial = serial();
    let c = Cluster::new(Spec {
        shards: 2,
        workers: 3,
        epochs: 8,
        ..Spec::default()
    });
    // Rank 2 has no bundle yet: it is issued from the kept CA while the cluster runs.
    std::fs::remove_dir_all(c.path("certs/worker-2")).unwrap();
    // A fourth identity, revoked in cluster.toml: the shards refuse it at the handshake.
    let out = std::process::Command::new(&support::bins().server)
        .args(["keygen", "issue", "--ca"])
        .arg(c.path("certs/ca"))
        .arg("--out")
        .arg(c.path("revoked"))
        .args(["--worker", "1"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let revoked = TlsFiles::for_worker(&c.path("revoked"), 1).unwrap();
    let revoked_serial =
        tether::common::pki::format_serial(&certificate_serial(&revoked.cert[0]).unwrap());
    assert!(
        String::from_utf8_lossy(&out.stdout).contains(&revoked_serial),
        "keygen issue does not print the serial"
    );
    let mut toml = std::fs::read_to_string(c.path("cluster.toml")).unwrap();
    toml = toml.replacen(
        "[cluster]\n",
        &format!("[cluster]\nrevoked = [\"{revoked_serial}\"]\n"),
        1,
    );
    std::fs::write(c.path("cluster.toml"), toml).unwrap();

    let mut servers = c.servers(&[]);
    let mut w0 = c.worker(0, &["--report", "w0.json"]);
    let mut w1 = c.worker(1, &["--report", "w1.json"]);
    // Without a bundle, rank 2 cannot start; it says why.
    let mut early = c.worker(2, &[]);
    early.wait_failure(WAIT);
    assert!(
        early.log_text().contains("no bundle for worker 2"),
        "{}",
        early.log_tail(1000)
    );

    // The revoked certificate (rank 1's, newer serial) gets no connection, before any frame.
    let rt = runtime();
    let cfg = Config::load(&c.path("cluster.toml")).unwrap();
    let layout_hash = model_layout(&cfg).unwrap().hash();
    let refused = rt.block_on(async {
        let ep = client_endpoint(&revoked, &TransportTuning::default()).unwrap();
        let attempt = async {
            let conn = connect(&ep, c.servers[0], "127.0.0.1").await?;
            let mut control = ControlChannel::open(&conn).await?;
            client_handshake(&mut control, Hello::new(1, layout_hash)).await
        };
        !matches!(tokio::time::timeout(WAIT, attempt).await, Ok(Ok(_)))
    });
    assert!(refused, "a revoked certificate was welcomed");

    let out = std::process::Command::new(&support::bins().server)
        .args(["keygen", "issue", "--ca"])
        .arg(c.path("certs/ca"))
        .arg("--out")
        .arg(c.path("certs"))
        .args(["--worker", "2", "--days", "2"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut w2 = c.worker(2, &["--report", "w2.json"]);
    for w in [&mut w0, &mut w1, &mut w2] {
        w.wait_success(Duration::from_secs(120));
    }
    for s in &mut servers {
        s.wait_success(Duration::from_secs(30));
    }
    let steps = c.steps_per_worker() as f64;
    let r2 = c.report("w2.json");
    assert_eq!(
        num(&r2, "steps"),
        steps,
        "the late rank did not train to the end"
    );
    let applied: f64 = (0..2)
        .map(|k| num(&c.report(&format!("server-{k}.json")), "updates_applied"))
        .sum();
    println!(
        "pki: late rank 2 ran {} steps; shards applied {applied} (3 workers x {steps} steps x 2 shards = {})",
        num(&r2, "steps"),
        steps * 6.0
    );
    assert_eq!(
        applied,
        steps * 6.0,
        "every step of every rank reaches both shards"
    );
    let log = servers[0].log_text();
    assert!(!log.contains("panicked"), "{log}");
}

//! Hostile input against a real `tether-server` process: random UDP datagrams at its port, TLS clients with a
//! foreign CA's certificate and with no certificate, a valid client sending malformed, oversized, replayed,
//! wrong-shard, wrong-worker, future-clock and garbage-codec push frames, and slow-loris clients holding streams
//! open. The server must stay up, its memory must stay bounded (VmHWM), only the valid pushes may change the
//! weights (applied-update count equals valid pushes sent), and well-behaved workers must then train to completion
//! while the slow-loris connections are still held.

mod support;

use std::net::{SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use support::{free_tcp_addr, http_get, metric, Cluster, Spec};
use tether::common::codec::{CodecConfig, Encoder};
use tether::common::config::Config;
use tether::common::layout::model_layout;
use tether::common::net::{
    client_endpoint, client_handshake, connect, ControlChannel, TlsFiles, TransportTuning,
};
use tether::common::protocol::{encode_push, Control, FrameKind, Hello, PushFrame, Welcome};
use tether::common::testing::TestRng;

/// The hostile client's rank (the shared client certificate may claim any rank; the real workers are 0 and 1).
const RANK: u32 = 2;

struct Target {
    addr: SocketAddr,
    layout_hash: u64,
    shard_len: usize,
}

async fn handshake(
    ep: &quinn::Endpoint,
    t: &Target,
) -> (quinn::Connection, ControlChannel, Welcome) {
    let conn = connect(ep, t.addr, "127.0.0.1")
        .await
        .expect("valid client must connect");
    let mut control = ControlChannel::open(&conn).await.unwrap();
    let welcome = client_handshake(&mut control, Hello::new(RANK, t.layout_hash))
        .await
        .expect("welcome");
    (conn, control, welcome)
}

fn push_bytes(w: &Welcome, clock: u64, shard: u32, worker: u32, payload: Vec<u8>) -> Vec<u8> {
    encode_push(&PushFrame {
        worker,
        clock,
        shard,
        range_start: w.range_start,
        range_end: w.range_end,
        read_version: 0,
        loss: 1.0,
        skip: false,
        payload,
    })
    .unwrap()
    .to_vec()
}

async fn send_raw(conn: &quinn::Connection, header_len: u32, body: &[u8]) {
    let Ok(mut s) = conn.open_uni().await else {
        return;
    };
    let mut frame = header_len.to_le_bytes().to_vec();
    frame.push(FrameKind::Push as u8);
    frame.extend_from_slice(body);
    let _ = s.write_all(&frame).await;
    let _ = s.finish();
}

/// Waits (bounded) until the server closes `conn`; returns whether it did.
async fn closed_by_server(conn: &quinn::Connection) -> bool {
    tokio::time::timeout(Duration::from_secs(5), conn.closed())
        .await
        .is_ok()
}

/// Sends every kind of bad push from a valid client; returns how many valid pushes were sent.
async fn bad_pushes(ep: &quinn::Endpoint, t: &Target, rng: &mut TestRng) -> u64 {
    let mut enc = Encoder::new(CodecConfig::default()).unwrap();
    let grad: Vec<f32> = (0..t.shard_len)
        .map(|i| ((i % 7) as f32 - 3.0) * 1e-3)
        .collect();
    let mut payload = Vec::new();
    enc.encode(&grad, 1, &mut payload).unwrap();
    let mut valid = 0u64;

    // A valid push, then the same push replayed (refused, connection goes on), then a push from a future clock.
    let (conn, _control, w) = handshake(ep, t).await;
    let clock = w.min_clock;
    let good = push_bytes(&w, clock, 0, RANK, payload.clone());
    send_raw(&conn, good.len() as u32, &good).await;
    valid += 1;
    tokio::time::sleep(Duration::from_millis(100)).await;
    send_raw(&conn, good.len() as u32, &good).await;
    let future = push_bytes(&w, clock + 50, 0, RANK, payload.clone());
    send_raw(&conn, future.len() as u32, &future).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Still open after refused-but-well-formed pushes: another valid push at the next clock is applied.
    let next = push_bytes(&w, clock + 1, 0, RANK, payload.clone());
    send_raw(&conn, next.len() as u32, &next).await;
    valid += 1;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        conn.close_reason().is_none(),
        "refused pushes must not close the connection: {:?}",
        conn.close_reason()
    );

    // Each of these is a protocol violation: the server closes this connection (and nothing is applied).
    let wrong_shard = push_bytes(&w, clock + 2, 1, RANK, payload.clone());
    let other_worker = push_bytes(&w, clock + 2, 0, RANK + 1, payload.clone());
    let mut garbage_codec = payload.clone();
    rng.fill(&mut garbage_codec[..]);
    let garbage_codec = push_bytes(&w, clock + 2, 0, RANK, garbage_codec);
    let mut truncated_codec = payload.clone();
    truncated_codec.truncate(payload.len() / 2);
    let truncated_codec = push_bytes(&w, clock + 2, 0, RANK, truncated_codec);
    let mut random_body = vec![0u8; good.len()];
    rng.fill(&mut random_body);
    let mut flipped = good.clone();
    for _ in 0..8 {
        let i = rng.below(flipped.len() as u64) as usize;
        flipped[i] ^= 0x5a;
    }
    let cases: Vec<(&str, u32, Vec<u8>)> = vec![
        ("wrong shard", wrong_shard.len() as u32, wrong_shard),
        (
            "another worker's rank",
            other_worker.len() as u32,
            other_worker,
        ),
        (
            "garbage codec payload",
            garbage_codec.len() as u32,
            garbage_codec,
        ),
        (
            "truncated codec payload",
            truncated_codec.len() as u32,
            truncated_codec,
        ),
        ("random rkyv body", random_body.len() as u32, random_body),
        ("oversized length (1 GiB)", 1 << 30, vec![0u8; 64]),
        (
            "length past the body",
            good.len() as u32 + 100,
            good.clone(),
        ),
    ];
    drop(conn);
    for (what, len, body) in cases {
        let (conn, _control, _w) = handshake(ep, t).await;
        send_raw(&conn, len, &body).await;
        if what != "length past the body" && what != "random rkyv body" {
            assert!(
                closed_by_server(&conn).await,
                "server kept the connection open after: {what}"
            );
        } else {
            // These may also be detected only when the stream ends (truncated) — either way nothing is applied.
            let _ = closed_by_server(&conn).await;
        }
        conn.close(0u32.into(), b"");
    }
    // One bit-flipped frame: it may happen to stay valid rkyv; it must never crash the server.
    let (conn, _control, _w) = handshake(ep, t).await;
    send_raw(&conn, flipped.len() as u32, &flipped).await;
    let _ = closed_by_server(&conn).await;
    conn.close(0u32.into(), b"");
    // The bit-flipped frame might have been a legal push for the current clock: count it if the shard applied it.
    valid
}

/// A client endpoint presenting no certificate at all (it trusts the real CA).
fn no_cert_endpoint(ca: &TlsFiles) -> quinn::Endpoint {
    let mut ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    ep.set_default_client_config(support::hostile::no_certificate_client(ca));
    ep
}

/// A client that cannot authenticate must never get a welcome (bounded).
async fn must_be_refused(ep: &quinn::Endpoint, t: &Target, what: &str) {
    let attempt = async {
        let conn = connect(ep, t.addr, "127.0.0.1").await?;
        let mut control = ControlChannel::open(&conn).await?;
        client_handshake(&mut control, Hello::new(RANK, t.layout_hash)).await
    };
    // A refusal or no answer at all are both fine; a welcome is not.
    if let Ok(Ok(w)) = tokio::time::timeout(Duration::from_secs(5), attempt).await {
        panic!("{what}: server welcomed an unauthenticated client: {w:?}");
    }
}

#[test]
fn server_survives_hostile_input_and_still_trains() {
    let c = Cluster::new(Spec {
        workers: 3,
        per_worker_certs: false,
        ..Spec::default()
    });
    let cfg = Config::load(&c.path("cluster.toml")).unwrap();
    let layout = model_layout(&cfg).unwrap();
    let range = layout.shard_range(0, 2);
    let t = Target {
        addr: c.servers[0],
        layout_hash: layout.hash(),
        shard_len: range.len(),
    };
    let maddr = free_tcp_addr();
    let m = maddr.to_string();
    // Shard 0 runs until SIGTERM (its memory is read after the workers finished); shard 1 exits after them.
    let mut servers = vec![
        c.server(0, &["--report", "server-0.json", "--metrics", &m]),
        c.server(
            1,
            &["--exit-after-workers", "2", "--report", "server-1.json"],
        ),
    ];
    std::thread::sleep(Duration::from_millis(300));
    let (hwm_before, rss_before) = servers[0].memory_kib();
    let mut rng = TestRng::new(0x7e7e);

    // 1. Random UDP datagrams, including ones shaped like QUIC long headers.
    let udp = UdpSocket::bind("127.0.0.1:0").unwrap();
    for i in 0..5000 {
        let len = 1 + rng.below(1400) as usize;
        let mut d = vec![0u8; len];
        rng.fill(&mut d);
        if i % 2 == 0 {
            d[0] |= 0xc0;
            if len > 5 {
                d[1..5].copy_from_slice(&1u32.to_be_bytes());
            }
        }
        let _ = udp.send_to(&d, t.addr);
    }

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let tls_dir = c.path("certs");
    let valid_tls = TlsFiles::load(&tls_dir.join("client"), "client").unwrap();
    let foreign_dir = c.path("foreign");
    tether::common::pki::generate_dev(&foreign_dir, &[], 1, 0).unwrap();
    let foreign_tls = TlsFiles::from_paths(
        &tls_dir.join("client/ca.pem"),
        &foreign_dir.join("client/client.pem"),
        &foreign_dir.join("client/client.key"),
    )
    .unwrap();
    // A server certificate of the foreign cluster is also no client identity of ours.
    let foreign_server_cert = TlsFiles::from_paths(
        &tls_dir.join("client/ca.pem"),
        &foreign_dir.join("server-0/server.pem"),
        &foreign_dir.join("server-0/server.key"),
    )
    .unwrap();
    let (valid_pushes, loris) = rt.block_on(async {
        // 2. Foreign CA and no certificate: refused before any frame.
        let foreign = client_endpoint(&foreign_tls, &TransportTuning::default()).unwrap();
        let foreign_srv =
            client_endpoint(&foreign_server_cert, &TransportTuning::default()).unwrap();
        let none = no_cert_endpoint(&valid_tls);
        for _ in 0..10 {
            must_be_refused(&foreign, &t, "foreign-CA client certificate").await;
            must_be_refused(&foreign_srv, &t, "foreign server certificate as client").await;
            must_be_refused(&none, &t, "no client certificate").await;
        }
        // 3. A valid client sending bad frames.
        let ep = client_endpoint(&valid_tls, &TransportTuning::default()).unwrap();
        let valid = bad_pushes(&ep, &t, &mut rng).await;
        // Leave the table so the real workers are not held back by this rank.
        let (conn, mut control, _) = handshake(&ep, &t).await;
        control.send(&Control::Goodbye { clock: 0 }).await.unwrap();
        let _ = tokio::time::timeout(Duration::from_secs(2), conn.closed()).await;
        // 4. Slow loris: connections that stall mid-handshake and mid-frame, held while the real workers train.
        let mut loris = Vec::new();
        for i in 0..40 {
            let conn = connect(&ep, t.addr, "127.0.0.1").await.unwrap();
            if i % 2 == 0 {
                // Control stream opened with 3 of the 5 header bytes, then nothing.
                let (mut s, r) = conn.open_bi().await.unwrap();
                let _ = s.write_all(&[0x10, 0, 0]).await;
                loris.push((conn, Some(s), Some(r), None));
            } else {
                // A push stream announcing a 100 KB frame and delivering 10 bytes.
                let mut u = conn.open_uni().await.unwrap();
                let mut h = 100_000u32.to_le_bytes().to_vec();
                h.push(FrameKind::Push as u8);
                h.extend_from_slice(&[0u8; 10]);
                let _ = u.write_all(&h).await;
                loris.push((conn, None, None, Some(u)));
            }
        }
        (valid, loris)
    });
    assert!(
        servers[0].alive(),
        "server died under hostile input:\n{}",
        servers[0].log_tail(3000)
    );
    let text = http_get(maddr, "/metrics").unwrap();
    let applied = metric(&text, "tether_updates_applied_total").unwrap_or(0.0);
    println!(
        "hostile: {valid_pushes} valid pushes sent, shard applied {applied}; metrics:\n{}",
        text.lines()
            .filter(|l| l.starts_with("tether_updates"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    // The bit-flipped frame is the only hostile frame that could be legal; everything else must not apply.
    assert!(
        applied == valid_pushes as f64 || applied == valid_pushes as f64 + 1.0,
        "applied {applied}"
    );

    // 5. Well-behaved workers train to completion while the slow-loris connections are held open.
    let mut w0 = c.worker(0, &["--report", "w0.json"]);
    let mut w1 = c.worker(1, &["--report", "w1.json"]);
    let started = Instant::now();
    w0.wait_success(Duration::from_secs(90));
    w1.wait_success(Duration::from_secs(90));
    let train_s = started.elapsed().as_secs_f64();
    let (hwm_after, rss_after) = servers[0].memory_kib();
    drop(loris);
    drop(rt);
    servers[0].terminate();
    for s in &mut servers {
        s.wait_success(Duration::from_secs(30));
    }
    let acc = support::num(&c.report("w0.json"), "final_test_accuracy");
    let steps = c.steps_per_worker() as f64;
    let s0 = c.report("server-0.json");
    println!(
        "hostile: server VmHWM {hwm_before} -> {hwm_after} KiB, VmRSS {rss_before} -> {rss_after} KiB; workers \
         trained in {train_s:.1} s to accuracy {acc:.4}; shard 0 applied {} in total",
        support::num(&s0, "updates_applied")
    );
    assert!(acc > 0.85, "accuracy {acc} after the hostile phase");
    assert_eq!(support::num(&c.report("w1.json"), "steps"), steps);
    // Peak memory grew by less than 64 MiB over the whole hostile phase and the training run.
    assert!(
        hwm_after.saturating_sub(hwm_before) < 64 * 1024,
        "VmHWM grew {hwm_before} -> {hwm_after} KiB"
    );
}

/// Regression (protocol cores): pulls were answered without membership or clock checks, each spawned an unbounded
/// task, the 4096 parked slots were shared by everyone, and `clock + 1` on a peer's value overflowed. Now a rejoin at
/// `u64::MAX`, pulls at absurd clocks and a flood of pulls get typed errors, while honest workers keep training.
#[test]
fn absurd_clocks_and_a_pull_flood_get_typed_errors_while_workers_train() {
    use tether::common::net::NetError;
    use tether::common::protocol::{ErrorCode, ProtocolError};
    let c = Cluster::new(Spec {
        workers: 3,
        per_worker_certs: false,
        epochs: 10,
        ..Spec::default()
    });
    let cfg = Config::load(&c.path("cluster.toml")).unwrap();
    let layout = model_layout(&cfg).unwrap();
    let t = Target {
        addr: c.servers[0],
        layout_hash: layout.hash(),
        shard_len: layout.shard_range(0, 2).len(),
    };
    // Shard 0 sees the hostile rank too (three goodbyes), shard 1 only the two honest workers.
    let mut servers = vec![
        c.server(
            0,
            &["--exit-after-workers", "3", "--report", "server-0.json"],
        ),
        c.server(
            1,
            &["--exit-after-workers", "2", "--report", "server-1.json"],
        ),
    ];
    let mut w0 = c.worker(0, &["--report", "w0.json"]);
    let mut w1 = c.worker(1, &["--report", "w1.json"]);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let tls = TlsFiles::load(&c.path("certs/client"), "client").unwrap();
    let (rejoin_code, refusals, flood) = rt.block_on(async {
        let ep = client_endpoint(&tls, &TransportTuning::default()).unwrap();
        // A rejoin at u64::MAX: refused before anything changes, with the connection closed on a typed code.
        let conn = connect(&ep, t.addr, "127.0.0.1").await.unwrap();
        let mut control = ControlChannel::open(&conn).await.unwrap();
        let answer =
            client_handshake(&mut control, Hello::rejoin(RANK, t.layout_hash, u64::MAX)).await;
        let rejoin_code = match answer {
            Err(NetError::Protocol(ProtocolError::Remote { code, .. })) => Some(code),
            Err(e) => e.remote_close_code().and_then(ErrorCode::from_code),
            Ok(_) => None,
        };
        // A member flooding pulls: at absurd clocks, then many at once.
        let (conn, mut control, welcome) = handshake(&ep, &t).await;
        let mut sent = 0u64;
        for request in 0..2 {
            let clock = [u64::MAX, u64::MAX / 2][request as usize];
            // Absurd clocks, and an absurd public copy claimed for the delta path.
            let msg = Control::PullRequest {
                request,
                clock,
                mode: tether::common::protocol::PullMode::Delta {
                    have: Some(tether::common::protocol::PublicRef {
                        lineage: u64::MAX,
                        seq: u64::MAX,
                    }),
                },
            };
            control.send(&msg).await.unwrap();
            sent += 1;
        }
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(3) && sent < 20_000 {
            // Pulls at its clock + 3: allowed for rank 2 (s = 2), but the gate holds them while rank 2 itself keeps m
            // at or below its clock (it joined at m, or above it when the honest workers were faster); two park,
            // every other one is refused.
            let msg = Control::PullRequest {
                request: sent,
                clock: welcome.clock + 3,
                mode: tether::common::protocol::PullMode::Full(
                    tether::common::protocol::Precision::F32,
                ),
            };
            if control.send(&msg).await.is_err() {
                break;
            }
            sent += 1;
        }
        let mut refusals: std::collections::BTreeMap<String, u64> = Default::default();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            match tokio::time::timeout(Duration::from_millis(500), control.recv()).await {
                Ok(Ok(Control::PullRefused { code, .. })) => {
                    *refusals.entry(format!("{code:?}")).or_default() += 1
                }
                Ok(Ok(_)) => {}
                Ok(Err(_)) | Err(_) => break,
            }
        }
        assert!(
            conn.close_reason().is_none(),
            "the flood closed the connection: {:?}",
            conn.close_reason()
        );
        // Leave, so the honest workers are not held back by this rank.
        control.send(&Control::Goodbye { clock: 0 }).await.unwrap();
        let _ = tokio::time::timeout(Duration::from_secs(2), conn.closed()).await;
        (rejoin_code, refusals, sent)
    });
    println!("absurd clocks: rejoin at u64::MAX -> {rejoin_code:?}; {flood} pulls sent, refused {refusals:?}");
    assert_eq!(rejoin_code, Some(ErrorCode::ClockFromFuture));
    assert!(
        refusals.get("ClockFromFuture").copied().unwrap_or(0) >= 2,
        "{refusals:?}"
    );
    let overloaded = refusals.get("Overloaded").copied().unwrap_or(0);
    assert!(
        overloaded + 8 >= flood - 2,
        "{flood} pulls, refusals {refusals:?}"
    );
    w0.wait_success(Duration::from_secs(120));
    w1.wait_success(Duration::from_secs(120));
    // The shards stayed up through it all and ended cleanly after the last goodbye.
    for s in &mut servers {
        s.wait_success(Duration::from_secs(30));
    }
    let acc = support::num(&c.report("w0.json"), "final_test_accuracy");
    println!("absurd clocks: honest workers trained to {acc:.4}");
    assert_eq!(support::num(&c.report("w0.json"), "pushes_refused"), 0.0);
    assert!(acc > 0.85, "accuracy {acc}");
    drop(rt);
}

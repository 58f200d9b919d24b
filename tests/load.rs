//! Load against one real `tether-server` process: 256 concurrent mutual-TLS QUIC connections (the shared client
//! certificate claiming ranks 0..255 of a 256-worker asynchronous cluster, logistic regression on digits: 650
//! parameters), each pushing small q4 frames as fast as it can. Every push must be applied with no error, and the
//! server's peak memory (VmHWM) must stay bounded: the bounded shard mailbox pushes back on the streams instead of
//! queueing.

mod support;

use std::time::{Duration, Instant};

use support::{free_tcp_addr, http_get, metric, Cluster, Spec};
use tether::common::codec::{CodecConfig, Encoder};
use tether::common::config::Config;
use tether::common::layout::model_layout;
use tether::common::net::{
    client_endpoint, client_handshake, connect, send_bulk, ControlChannel, TlsFiles,
    TransportTuning,
};
use tether::common::protocol::{encode_push, Control, FrameKind, Hello, PushFrame};

const CONNECTIONS: u32 = 256;
const PUSHES: u64 = 20;

#[test]
fn many_concurrent_pushers_are_all_served_with_bounded_memory() {
    let c = Cluster::new(Spec {
        shards: 1,
        workers: CONNECTIONS,
        model: "logreg".into(),
        // Asynchronous: the ranks push without pulling, which a bounded shard refuses more than s + 1 rounds ahead
        // of the minimum clock (docs/protocol.md); this test is about ingest under load, not the SSP bound.
        staleness: "inf".into(),
        per_worker_certs: false,
        checkpoint_every: 1000,
        ..Spec::default()
    });
    let cfg = Config::load(&c.path("cluster.toml")).unwrap();
    let layout = model_layout(&cfg).unwrap();
    assert_eq!(layout.len(), 650);
    let maddr = free_tcp_addr();
    let m = maddr.to_string();
    let mut server = c.server(0, &["--metrics", &m]);
    let (hwm_before, _) = server.memory_kib();
    let tls = TlsFiles::load(&c.path("certs/client"), "client").unwrap();
    let addr = c.servers[0];
    let hash = layout.hash();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let started = Instant::now();
    let errors: Vec<String> = rt.block_on(async move {
        let ep = client_endpoint(&tls, &TransportTuning::default()).unwrap();
        let mut tasks = Vec::new();
        for rank in 0..CONNECTIONS {
            let ep = ep.clone();
            tasks.push(tokio::spawn(async move {
                let run = async {
                    let conn = connect(&ep, addr, "127.0.0.1")
                        .await
                        .map_err(|e| e.to_string())?;
                    let mut control = ControlChannel::open(&conn)
                        .await
                        .map_err(|e| e.to_string())?;
                    let w = client_handshake(&mut control, Hello::new(rank, hash))
                        .await
                        .map_err(|e| e.to_string())?;
                    let mut enc = Encoder::new(CodecConfig::default()).unwrap();
                    let grad: Vec<f32> = (0..650)
                        .map(|i| ((i + rank as usize) % 9) as f32 * 1e-4 - 4e-4)
                        .collect();
                    let mut payload = Vec::new();
                    for i in 0..PUSHES {
                        enc.encode(&grad, u64::from(rank) * 1000 + i, &mut payload)
                            .unwrap();
                        let frame = PushFrame {
                            worker: rank,
                            clock: w.clock + i,
                            shard: 0,
                            range_start: w.range_start,
                            range_end: w.range_end,
                            read_version: 0,
                            loss: 1.0,
                            skip: false,
                            payload: payload.clone(),
                        };
                        let bytes = encode_push(&frame).unwrap();
                        send_bulk(&conn, FrameKind::Push, &bytes)
                            .await
                            .map_err(|e| e.to_string())?;
                    }
                    // The goodbye names the clock whose pushes the shard takes before this rank leaves.
                    control
                        .send(&Control::Goodbye {
                            clock: w.clock + PUSHES,
                        })
                        .await
                        .map_err(|e| e.to_string())?;
                    let _ = tokio::time::timeout(Duration::from_secs(20), conn.closed()).await;
                    Ok::<_, String>(())
                };
                tokio::time::timeout(Duration::from_secs(60), run)
                    .await
                    .unwrap_or_else(|_| Err("timed out".into()))
            }));
        }
        let mut errors = Vec::new();
        for (rank, t) in tasks.into_iter().enumerate() {
            if let Err(e) = t.await.unwrap() {
                errors.push(format!("rank {rank}: {e}"));
            }
        }
        errors
    });
    let secs = started.elapsed().as_secs_f64();
    // The goodbyes drained every push: the counters are final once all ranks left.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut text = http_get(maddr, "/metrics").unwrap();
    while metric(&text, "tether_updates_applied_total").unwrap_or(0.0)
        < (u64::from(CONNECTIONS) * PUSHES) as f64
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(100));
        text = http_get(maddr, "/metrics").unwrap();
    }
    let applied = metric(&text, "tether_updates_applied_total").unwrap_or(0.0);
    let rejected: f64 = text
        .lines()
        .filter(|l| l.starts_with("tether_updates_rejected_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    let (hwm_after, rss_after) = server.memory_kib();
    println!(
        "load: {CONNECTIONS} connections x {PUSHES} pushes in {secs:.2} s: applied {applied}, rejected {rejected}, \
         client errors {}; server VmHWM {hwm_before} -> {hwm_after} KiB (VmRSS now {rss_after} KiB)",
        errors.len()
    );
    assert!(
        server.alive(),
        "server died under load:\n{}",
        server.log_tail(3000)
    );
    assert!(
        errors.is_empty(),
        "{} connections failed: {:?}",
        errors.len(),
        &errors[..errors.len().min(10)]
    );
    assert_eq!(
        applied,
        (u64::from(CONNECTIONS) * PUSHES) as f64,
        "not every push was applied"
    );
    assert_eq!(rejected, 0.0);
    assert!(
        hwm_after < 256 * 1024,
        "server peak RSS {hwm_after} KiB under load"
    );
}

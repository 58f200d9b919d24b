//! Push goodput vs raw QUIC throughput over one loopback connection, for several transport tunings.
//!
//! `cargo run --release -p tether-common --example wire_bench -- [FRAMES] [ROUNDS]`
//!
//! For each tuning: FRAMES push frames of 1 MiB payload (a q4 frame of ~2 Mi parameters), one uni stream each,
//! the server reading each with `recv_bulk` and validating it with `access_push`; then the same number of bytes
//! as one raw uni stream with the same endpoints. Prints MB/s (10^6 bytes of payload per second) and the ratio.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tether_common::net::*;
use tether_common::pki;
use tether_common::protocol::*;

const PAYLOAD: usize = 1 << 20;
const RANGE: (u64, u64) = (0, 2 * PAYLOAD as u64);

fn limits() -> FrameLimits {
    FrameLimits::for_shard(RANGE.1 - RANGE.0, PAYLOAD + 4096)
}

async fn serve_pushes(
    conn: quinn::Connection,
    done: Arc<tokio::sync::Notify>,
    target: u64,
    got: Arc<AtomicU64>,
) {
    let limits = limits();
    while let Ok(stream) = conn.accept_uni().await {
        let (done, got) = (done.clone(), got.clone());
        tokio::spawn(async move {
            let frame = recv_bulk(stream, &limits, FrameKind::Push)
                .await
                .expect("push frame");
            let push = access_push(&frame.body).expect("valid push");
            push.check_target(0, RANGE.0, RANGE.1)
                .expect("right target");
            if got.fetch_add(push.payload().len() as u64, Ordering::AcqRel)
                + push.payload().len() as u64
                >= target
            {
                done.notify_one();
            }
        });
    }
}

async fn serve_raw(conn: quinn::Connection) -> u64 {
    let mut stream = conn.accept_uni().await.expect("raw stream");
    let mut total = 0u64;
    while let Some(chunk) = stream.read_chunk(usize::MAX, true).await.expect("raw read") {
        total += chunk.bytes.len() as u64;
    }
    total
}

async fn run(tuning: &TransportTuning, dir: &std::path::Path, frames: usize) -> (f64, f64, u64) {
    let server_tls = TlsFiles::for_server(dir, 0).unwrap();
    let server = server_endpoint("127.0.0.1:0".parse().unwrap(), &server_tls, tuning).unwrap();
    let addr: SocketAddr = server.local_addr().unwrap();
    let client = client_endpoint(
        &TlsFiles::load(&dir.join("client"), "client").unwrap(),
        tuning,
    )
    .unwrap();

    // Push goodput.
    let accept = tokio::spawn({
        let server = server.clone();
        async move { server.accept().await.unwrap().await.unwrap() }
    });
    let conn = connect(&client, addr, "127.0.0.1").await.unwrap();
    let server_conn = accept.await.unwrap();
    let target = (frames * PAYLOAD) as u64;
    let done = Arc::new(tokio::sync::Notify::new());
    let got = Arc::new(AtomicU64::new(0));
    tokio::spawn(serve_pushes(server_conn, done.clone(), target, got.clone()));
    let payload: Vec<u8> = (0..PAYLOAD)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let mut frame = PushFrame {
        worker: 0,
        clock: 0,
        shard: 0,
        range_start: RANGE.0,
        range_end: RANGE.1,
        read_version: 0,
        loss: 0.5,
        skip: false,
        payload,
    };
    let mut body = rkyv::util::AlignedVec::new();
    let start = Instant::now();
    for clock in 0..frames as u64 {
        frame.clock = clock;
        encode_push_into(&frame, &mut body).unwrap();
        send_bulk(&conn, FrameKind::Push, &body).await.unwrap();
    }
    tokio::time::timeout(Duration::from_secs(120), done.notified())
        .await
        .expect("pushes did not arrive");
    let push_mbs = target as f64 / start.elapsed().as_secs_f64() / 1e6;
    let mut lost = conn.stats().path.lost_packets;
    conn.close(0u32.into(), b"");

    // Raw bulk throughput, same endpoints and config.
    let accept = tokio::spawn({
        let server = server.clone();
        async move { server.accept().await.unwrap().await.unwrap() }
    });
    let conn = connect(&client, addr, "127.0.0.1").await.unwrap();
    let server_conn = accept.await.unwrap();
    let reader = tokio::spawn(serve_raw(server_conn));
    let chunk = vec![0x5au8; PAYLOAD];
    let start = Instant::now();
    let mut stream = conn.open_uni().await.unwrap();
    for _ in 0..frames {
        stream.write_all(&chunk).await.unwrap();
    }
    stream.finish().unwrap();
    let total = tokio::time::timeout(Duration::from_secs(120), reader)
        .await
        .expect("raw stream stalled")
        .unwrap();
    let raw_mbs = total as f64 / start.elapsed().as_secs_f64() / 1e6;
    assert_eq!(total, target);
    lost += conn.stats().path.lost_packets;
    conn.close(0u32.into(), b"");
    server.close(0u32.into(), b"");
    client.close(0u32.into(), b"");
    (push_mbs, raw_mbs, lost)
}

fn main() {
    let frames: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(128);
    let rounds: usize = std::env::args()
        .nth(2)
        .and_then(|a| a.parse().ok())
        .unwrap_or(3);
    let dir = tempfile::tempdir().unwrap();
    pki::generate_dev(dir.path(), &[], 1, 0).unwrap();

    let quinn_defaults = TransportTuning {
        stream_receive_window: 1_250_000,
        receive_window: u32::MAX as u64,
        send_window: 10_000_000,
        initial_mtu: 1200,
        mtu_discovery_upper_bound: Some(1452),
        max_udp_payload_size: 1472,
        segmentation_offload: true,
        socket_buffer_bytes: None,
        ..TransportTuning::default()
    };
    let wide_1452 = TransportTuning {
        mtu_discovery_upper_bound: Some(1452),
        max_udp_payload_size: 1472,
        segmentation_offload: true,
        ..TransportTuning::default()
    };
    let pmtud_jumbo = TransportTuning {
        mtu_discovery_upper_bound: Some(8952),
        max_udp_payload_size: 8952,
        segmentation_offload: true,
        ..TransportTuning::default()
    };
    let jumbo_no_gso = TransportTuning {
        initial_mtu: 8952,
        max_udp_payload_size: 8952,
        mtu_discovery_upper_bound: None,
        segmentation_offload: false,
        ..TransportTuning::default()
    };
    let variants = [
        ("quinn defaults", quinn_defaults),
        (
            "default (wide, 1452 B, 4 MiB sockets)",
            TransportTuning::default(),
        ),
        (
            "wide, 1452 B, kernel socket buffers",
            TransportTuning {
                socket_buffer_bytes: None,
                ..wide_1452
            },
        ),
        ("wide, PMTUD to 8952", pmtud_jumbo.clone()),
        ("wide, 8952 B fixed, GSO off", jumbo_no_gso),
        (
            "wide, PMTUD to 8952, GSO off",
            TransportTuning {
                segmentation_offload: false,
                ..pmtud_jumbo
            },
        ),
    ];

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    println!(
        "{frames} frames x {} KiB payload, best of {rounds} interleaved rounds, one loopback connection each",
        PAYLOAD >> 10
    );
    // Interleave variants round by round so load from other processes hits them alike; keep each one's best.
    let mut best = vec![(0.0f64, 0.0f64, 0u64); variants.len()];
    for _ in 0..rounds {
        for (i, (_, tuning)) in variants.iter().enumerate() {
            let (push, raw, lost) = rt.block_on(run(tuning, dir.path(), frames));
            best[i] = (best[i].0.max(push), best[i].1.max(raw), best[i].2 + lost);
        }
    }
    println!(
        "{:<32} {:>10} {:>10} {:>6} {:>12}",
        "tuning", "push MB/s", "raw MB/s", "ratio", "lost packets"
    );
    for ((name, _), (push, raw, lost)) in variants.iter().zip(best) {
        println!(
            "{name:<32} {push:>10.0} {raw:>10.0} {:>6.2} {lost:>12}",
            push / raw
        );
    }
}

//! Peak memory of one shard owning ~16M parameters with Adam under push/pull load.
//!
//! Starts a full shard with `node::start_shard` (QUIC endpoint, mutual TLS, shard actor on its own Arbiter) inside an
//! actix System, then drives it with simulated workers that talk to the shard actor directly (Join, Pull at their
//! clock, ApplyPush of a q4 frame) — the same messages the QUIC connection tasks send. Prints VmRSS/VmHWM from
//! /proc/self/status after start-up, after the load, and after a checkpoint, with bytes per parameter.
//!
//! `cargo run --release -p tether-server --example server_rss -- [ROUNDS] [WORKERS]` (defaults: 50 rounds, 4 workers)

use std::time::Instant;

use tether_common::codec::{CodecConfig, Encoder};
use tether_common::config::{Config, Staleness};
use tether_common::layout::model_layout;
use tether_common::protocol::{encode_push, Outcome, Precision, PullMode, PushFrame};
use tether_common::testing::noise;
use tether_server::actor::{ApplyPush, CheckpointNow, GetStats, Hello, Pull};
use tether_server::node::{start_shard, ShardOptions};

/// One line of /proc/self/status in kB (Linux only; 0 elsewhere).
fn status_kb(key: &str) -> u64 {
    let text = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    text.lines()
        .find_map(|l| {
            l.strip_prefix(key)
                .and_then(|r| r.trim_start_matches(':').trim().strip_suffix("kB"))
        })
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

fn report(stage: &str, params: usize) {
    let (rss, hwm) = (status_kb("VmRSS"), status_kb("VmHWM"));
    println!(
        "{stage:<22} VmRSS {:>8.1} MiB ({:>5.1} B/param)   VmHWM {:>8.1} MiB ({:>5.1} B/param)",
        rss as f64 / 1024.0,
        rss as f64 * 1024.0 / params as f64,
        hwm as f64 / 1024.0,
        hwm as f64 * 1024.0 / params as f64,
    );
}

fn main() {
    let mut args = std::env::args().skip(1);
    let rounds: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(50);
    let workers: u32 = args.next().and_then(|a| a.parse().ok()).unwrap_or(4);
    // Pull mode: "delta" (the public copy and its q4 delta log, the default) or "f32" (a full copy per reply).
    let delta = args.next().is_none_or(|m| m != "f32");
    let dir = tempfile::tempdir().expect("temporary directory");
    tether_common::pki::generate_dev(&dir.path().join("certs"), &[], 1, workers)
        .expect("certificates");

    let mut cfg = Config::with_servers(vec!["127.0.0.1:0".into()]);
    // 4096 · 4092 + 4092 + 4092 · 4 + 4 = 16,781,296 parameters, all on one shard.
    cfg.model.features = Some(4096);
    cfg.model.hidden = vec![4092];
    cfg.model.classes = Some(4);
    cfg.cluster.workers = workers;
    cfg.cluster.staleness = Staleness::Bounded(2);
    cfg.cluster.worker_timeout_ms = 600_000;
    cfg.cluster.tls_dir = dir.path().join("certs");
    cfg.checkpoint.dir = dir.path().join("ckpt");
    cfg.checkpoint.every_updates = 0;
    let params = model_layout(&cfg).expect("layout").len();
    report("process start", params);

    // One q4 frame per worker, encoded before the shard exists so the encoder's temporaries do not count.
    let frames: Vec<Vec<u8>> = (0..workers)
        .map(|w| {
            let mut f = Vec::new();
            let g = noise(params, 0x9e37_79b9 + u64::from(w), 1e-3);
            Encoder::new(CodecConfig::default())
                .expect("encoder")
                .encode(&g, u64::from(w), &mut f)
                .expect("encode");
            f
        })
        .collect();
    let frame_bytes = frames[0].len();
    report("frames encoded", params);

    let sys = actix_rt::System::with_tokio_rt(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .enable_all()
            .build()
            .expect("tokio runtime")
    });
    sys.block_on(async move {
        let rss_before = status_kb("VmRSS");
        let shard = start_shard(&cfg, ShardOptions { shard: 0, ..ShardOptions::default() }).await.expect("start shard");
        report("shard started", params);

        let t0 = Instant::now();
        let mut tasks = Vec::new();
        for w in 0..workers {
            let addr = shard.actor.clone();
            let frame = frames[w as usize].clone();
            tasks.push(tokio::spawn(async move {
                let (kick, _kicked) = tokio::sync::oneshot::channel();
                let hello = Hello { conn: u64::from(w), worker: w, clock: 0, kick };
                let mut clock = addr.send(hello).await.expect("hello").expect("joined").clock;
                let mut have = None;
                for _ in 0..rounds {
                    let mode = if delta { PullMode::Delta { have } } else { PullMode::Full(Precision::F32) };
                    let pull = Pull { conn: u64::from(w), worker: w, request: clock, clock, mode };
                    let rx = addr.send(pull).await.expect("pull").expect("pull accepted");
                    let reply = rx.await.expect("pull answered").expect("pull ok");
                    let read_version = reply.header.version;
                    if reply.public.is_some() {
                        have = reply.public;
                    }
                    drop(reply);
                    let body = encode_push(&PushFrame {
                        worker: w,
                        clock,
                        shard: 0,
                        range_start: 0,
                        range_end: params as u64,
                        read_version,
                        loss: 0.0,
                        skip: false,
                        payload: frame.clone(),
                    })
                    .expect("encode push");
                    let outcome = addr.send(ApplyPush { conn: u64::from(w), body }).await.expect("push").expect("push valid");
                    assert_eq!(outcome.outcome, Outcome::Applied);
                    clock += 1;
                }
            }));
        }
        for t in tasks {
            t.await.expect("worker task");
        }
        let secs = t0.elapsed().as_secs_f64();
        let (version, stats, _) = shard.actor.send(GetStats).await.expect("stats");
        println!(
            "{} frames of {:.1} MB (q4) from {workers} workers in {secs:.1} s: {:.1} frames/s, {:.2} Gparam/s applied",
            stats.updates_applied,
            frame_bytes as f64 / 1e6,
            version as f64 / secs,
            version as f64 * params as f64 / secs / 1e9,
        );
        report("after push/pull load", params);
        let frames_kb = (frames.iter().map(Vec::len).sum::<usize>() / 1024) as u64;
        println!(
            "  peak above the pre-start RSS: {:.1} B/param (shard state, pull replies and push payloads in flight; the \
             workers' {:.1} B/param of encoded frames are in the pre-start RSS)",
            (status_kb("VmHWM").saturating_sub(rss_before)) as f64 * 1024.0 / params as f64,
            frames_kb as f64 * 1024.0 / params as f64,
        );
        let v = shard.actor.send(CheckpointNow).await.expect("checkpoint").expect("checkpoint written");
        println!("checkpoint of version {v:?} written");
        report("after a checkpoint", params);
        shard.kill();
    });
    println!(
        "parameters: {params}; pulls: {}; steady-state shard state = weights + Adam m, v + decode scratch (16 B/param){}",
        if delta { "q4 deltas of the public copy" } else { "full f32" },
        if delta { " + the public copy (4 B/param) + the delta log (at most 2 B/param)" } else { "" }
    );
}

//! `tether-bench floors`: what each ingest figure sits against, measured in the same process — memcpy of the
//! shard's fp32 bytes, the optimizer's memory kernel (`Optimizer::step` over the shard), the shard's whole apply
//! path (`ShardCore::apply`: validate, decode, finiteness and norm, optimizer), the codec alone, the delta cut of
//! a pull reply (`PublicCopy::cut`; its figure includes adding a step to the weights, a memory pass), and raw quinn on
//! the endpoint configuration the shards use (uni streams of one push frame each, mutual TLS, loopback).

use std::hint::black_box;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde::Serialize;

use tether_common::codec::{CodecConfig, Decoder, Encoder, Scheme};
use tether_common::config::{OptimizerConfig, OptimizerKind, Staleness};
use tether_common::layout::{Init, Layout, TensorSpec};
use tether_common::net::{client_endpoint, connect, server_endpoint, TlsFiles, TransportTuning};
use tether_common::protocol::FrameLimits;
use tether_common::testing::noise;
use tether_server::optim::Optimizer;
use tether_server::shard::{Push, ShardCore, ShardSpec};

use crate::cluster::{certificates, cpu_seconds};

/// What to measure.
#[derive(Debug, Clone, clap::Args, Serialize)]
pub struct FloorArgs {
    /// Parameters per shard.
    #[arg(long, default_value_t = 4_000_000)]
    pub shard_params: usize,
    /// Push scheme for the apply path and the raw-quinn frame size.
    #[arg(long, default_value = "q4")]
    pub scheme: String,
    /// Optimizer of the kernel and apply floors.
    #[arg(long, default_value = "adam")]
    pub optimizer: String,
    /// Seconds per figure.
    #[arg(long, default_value_t = 1.0)]
    pub seconds: f64,
}

/// One floor.
#[derive(Debug, Clone, Serialize)]
pub struct Floor {
    /// What.
    pub name: String,
    /// fp32-equivalent GB/s (4 bytes per shard parameter per iteration).
    pub fp32_gbps: f64,
    /// Bytes actually moved per second (wire bytes for quinn), GB/s.
    pub bytes_gbps: f64,
    /// CPU-seconds per fp32-equivalent GB.
    pub cpu_s_per_gb: f64,
}

fn timed(name: &str, fp32_bytes: f64, bytes: f64, seconds: f64, mut f: impl FnMut()) -> Floor {
    f();
    let cpu0 = cpu_seconds(libc::RUSAGE_SELF);
    let t0 = Instant::now();
    let mut n = 0u64;
    while t0.elapsed().as_secs_f64() < seconds || n < 3 {
        f();
        n += 1;
    }
    let wall = t0.elapsed().as_secs_f64();
    let cpu = cpu_seconds(libc::RUSAGE_SELF) - cpu0;
    let gb = fp32_bytes * n as f64 / 1e9;
    Floor {
        name: name.into(),
        fp32_gbps: gb / wall,
        bytes_gbps: bytes * n as f64 / 1e9 / wall,
        cpu_s_per_gb: cpu / gb,
    }
}

fn optimizer_config(kind: &str) -> Result<OptimizerConfig> {
    let kind: OptimizerKind = serde_json::from_value(serde_json::Value::String(kind.into()))
        .with_context(|| format!("optimizer {kind}"))?;
    Ok(OptimizerConfig {
        kind,
        ..OptimizerConfig::default()
    })
}

/// The push frame of `scheme` for `n` values (and its codec configuration).
pub fn frame_for(scheme: &str, n: usize) -> Result<(CodecConfig, Vec<u8>)> {
    let scheme: Scheme = serde_json::from_value(serde_json::Value::String(scheme.into()))
        .with_context(|| format!("scheme {scheme}"))?;
    let codec = CodecConfig {
        scheme,
        ..CodecConfig::default()
    };
    let mut enc = Encoder::new(codec)?;
    let mut frame = Vec::new();
    enc.encode(&noise(n, 0x9e37_79b9, 1e-2), 1, &mut frame)?;
    Ok((codec, frame))
}

/// Measures every floor.
pub fn run(a: &FloorArgs) -> Result<Vec<Floor>> {
    let n = a.shard_params;
    let fp32 = 4.0 * n as f64;
    let mut out = Vec::new();
    let src = noise(n, 3, 1.0);
    let mut dst = vec![0.0f32; n];
    out.push(timed("memcpy (shard fp32)", fp32, fp32, a.seconds, || {
        dst.copy_from_slice(black_box(&src))
    }));
    let ocfg = optimizer_config(&a.optimizer)?;
    let g = noise(n, 7, 1e-2);
    let mut w = noise(n, 11, 0.1);
    let mut opt = Optimizer::new(&ocfg, n);
    out.push(timed(
        &format!("{} kernel (Optimizer::step)", a.optimizer),
        fp32,
        fp32,
        a.seconds,
        || opt.step(black_box(&mut w), black_box(&g), 1.0),
    ));
    let (codec, frame) = frame_for(&a.scheme, n)?;
    let mut dec = Decoder::new(n);
    let mut grad = vec![0.0f32; n];
    out.push(timed(
        &format!("{} decode", a.scheme),
        fp32,
        frame.len() as f64,
        a.seconds,
        || {
            black_box(dec.decode(black_box(&frame), &mut grad).ok());
        },
    ));
    let layout = Layout::new(vec![TensorSpec::new(
        "w",
        &[n],
        Init::Uniform { bound: 0.1 },
    )]);
    let mut core = ShardCore::new(
        &layout,
        &ShardSpec {
            shard: 0,
            shards: 1,
            seed: 1,
            optimizer: ocfg,
            staleness: Staleness::Unbounded,
            worker_timeout_ms: u64::MAX,
            spike_factor: 0.0,
        },
    );
    core.join(0, 0);
    let mut clock = 0u64;
    out.push(timed(
        &format!("shard apply ({} + {})", a.scheme, a.optimizer),
        fp32,
        frame.len() as f64,
        a.seconds,
        || {
            let push = Push {
                worker: 0,
                clock,
                shard: 0,
                range: (0, n as u64),
                read_version: core.version(),
                payload: &frame,
            };
            clock += 1;
            black_box(core.apply(&push, 0).ok());
        },
    ));
    // The delta cut a pull reply needs (encode w − public, decode it back, add): once per shard version moved.
    let mut weights = noise(n, 21, 0.1);
    let mut public = tether_server::public::PublicCopy::new(&weights, 1, 0, 0, codec, 1 << 30)?;
    let mut version = 0u64;
    let step = noise(n, 23, 1e-3);
    out.push(timed(
        "delta cut (PublicCopy::cut, q4)",
        fp32,
        fp32,
        a.seconds,
        || {
            version += 1;
            for (w, d) in weights.iter_mut().zip(&step) {
                *w += d;
            }
            black_box(public.cut(&weights, version, version).ok());
        },
    ));
    out.push(raw_quinn(&codec, frame.len(), fp32, a.seconds)?);
    Ok(out)
}

/// Raw quinn: one mutual-TLS connection over loopback with the shards' transport tuning, 8 uni streams in flight,
/// each carrying one push frame's bytes.
fn raw_quinn(
    codec: &CodecConfig,
    frame_len: usize,
    fp32_per_frame: f64,
    seconds: f64,
) -> Result<Floor> {
    let dir = tempfile::tempdir()?;
    certificates(dir.path(), &[], 1, 1)?;
    let certs = dir.path().join("certs");
    let limits = FrameLimits::for_codec(codec, fp32_per_frame as usize / 4);
    let tuning = TransportTuning::default().sized_for(&limits);
    let server_tls = TlsFiles::for_server(&certs, 0)?;
    let client_tls = TlsFiles::for_worker(&certs, 0)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let server = server_endpoint("127.0.0.1:0".parse()?, &server_tls, &tuning)?;
        let addr = server.local_addr()?;
        let sink = tokio::spawn(async move {
            let Some(incoming) = server.accept().await else {
                return 0u64;
            };
            let Ok(conn) = incoming.await else {
                return 0;
            };
            let mut total = 0u64;
            while let Ok(mut s) = conn.accept_uni().await {
                if let Ok(b) = s.read_to_end(frame_len + 64).await {
                    total += b.len() as u64;
                }
            }
            total
        });
        let client = client_endpoint(&client_tls, &tuning)?;
        let conn = connect(&client, addr, "127.0.0.1").await?;
        let body = bytes::Bytes::from(vec![0x5au8; frame_len]);
        let send = |conn: quinn::Connection, body: bytes::Bytes| async move {
            let mut s = conn.open_uni().await?;
            s.write_chunk(body).await?;
            s.finish()?;
            s.stopped().await?;
            anyhow::Ok(())
        };
        for _ in 0..8 {
            send(conn.clone(), body.clone()).await?;
        }
        let cpu0 = cpu_seconds(libc::RUSAGE_SELF);
        let t0 = Instant::now();
        let mut n = 0u64;
        let mut inflight = tokio::task::JoinSet::new();
        while t0.elapsed().as_secs_f64() < seconds || n < 8 {
            while inflight.len() < 8 {
                inflight.spawn(send(conn.clone(), body.clone()));
                n += 1;
            }
            if let Some(r) = inflight.join_next().await {
                r??;
            }
        }
        while let Some(r) = inflight.join_next().await {
            r??;
        }
        let wall = t0.elapsed().as_secs_f64();
        let cpu = cpu_seconds(libc::RUSAGE_SELF) - cpu0;
        conn.close(0u32.into(), b"done");
        let _ = tokio::time::timeout(Duration::from_secs(2), sink).await;
        let gb = fp32_per_frame * n as f64 / 1e9;
        Ok(Floor {
            name: "raw quinn (mTLS, loopback, 8 streams)".into(),
            fp32_gbps: gb / wall,
            bytes_gbps: frame_len as f64 * n as f64 / 1e9 / wall,
            cpu_s_per_gb: cpu / gb,
        })
    })
}

/// Prints the floors as a table.
pub fn print(floors: &[Floor]) {
    println!(
        "{:<40} {:>14} {:>12} {:>14}",
        "floor", "fp32-eq GB/s", "bytes GB/s", "CPU-s/fp32 GB"
    );
    for f in floors {
        println!(
            "{:<40} {:>14.3} {:>12.3} {:>14.3}",
            f.name, f.fp32_gbps, f.bytes_gbps, f.cpu_s_per_gb
        );
    }
}

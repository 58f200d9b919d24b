//! `tether-bench ingest`: real shards (`tether-server` child processes) on loopback QUIC, fed by synthetic workers in
//! this process that run the real trainer (pull, clip, error feedback, encode, push) on a model whose gradient is a
//! memcpy. Reports push ingest in fp32-equivalent GB/s with the optimizer applied, pull GB/s, CPU-seconds per GB on
//! each side (`getrusage`) and p50/p99 push-to-outcome and pull latencies.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::Serialize;

use tether_bench::stats::quantile;
use tether_common::config::Config;
use tether_common::layout::model_layout;
use tether_common::net::TlsFiles;
use tether_worker::{prepare_worker, WorkerOptions, WorkerReport};

use crate::cluster::{
    certificates, cpu_seconds, free_port, hidden_for, pull_lines, sibling, Proc, RunConfig,
    Synthetic,
};

/// What to run.
#[derive(Debug, Clone, clap::Args, Serialize)]
pub struct IngestArgs {
    /// Synthetic workers (pushers and pullers).
    #[arg(long, default_value_t = 2)]
    pub workers: u32,
    /// Shards.
    #[arg(long, default_value_t = 1)]
    pub shards: u32,
    /// Model parameters (an MLP [64, H, 10] layout of about this size).
    #[arg(long, default_value_t = 4_000_000)]
    pub params: u64,
    /// Push scheme: none | fp16 | bf16 | q8 | q4 | q2 | topk2.
    #[arg(long, default_value = "q4")]
    pub scheme: String,
    /// Codec bucket (values per scale): the frame granularity of the quantized schemes.
    #[arg(long, default_value_t = 512)]
    pub bucket: u32,
    /// Shard optimizer: sgd | momentum | nesterov | adam | adamw | adagrad (with --local-steps: the workers' inner
    /// optimizer).
    #[arg(long, default_value = "adam")]
    pub optimizer: String,
    /// Local-step rounds: each push is a pseudo-gradient after H inner steps, and the shards apply the outer
    /// Nesterov step (`[optimizer.outer]`; 0: a gradient push every step, `--optimizer` on the shards).
    #[arg(long, default_value_t = 0)]
    pub local_steps: u32,
    /// With --local-steps: the shards sum a round's pushes and step once when it closes
    /// (`optimizer.outer.at_close`; needs a bounded --staleness).
    #[arg(long)]
    pub at_close: bool,
    /// Threads of each shard (`tether-server --threads`; 0: every core).
    #[arg(long, default_value_t = 0)]
    pub threads: u32,
    /// Pull mode: delta | bf16 | f32.
    #[arg(long, default_value = "delta")]
    pub pull: String,
    /// Staleness bound (`inf`: the pushers never wait for each other).
    #[arg(long, default_value = "inf")]
    pub staleness: String,
    /// Push rounds per worker.
    #[arg(long, default_value_t = 60)]
    pub rounds: u64,
    /// zstd on push frames.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub zstd: bool,
}

/// What one ingest run measured.
#[derive(Debug, Clone, Serialize)]
pub struct IngestReport {
    /// The arguments.
    pub args: IngestArgs,
    /// Parameters of the layout.
    pub params: u64,
    /// First push to last worker done, seconds.
    pub wall_s: f64,
    /// Pushes applied, all shards.
    pub updates_applied: u64,
    /// fp32-equivalent GB/s of gradients applied (4 bytes × parameters × applies / wall).
    pub ingest_fp32_gbps: f64,
    /// Wire GB/s of pushes.
    pub push_wire_gbps: f64,
    /// Wire GB/s of pull replies.
    pub pull_wire_gbps: f64,
    /// fp32-equivalent GB/s of pulls.
    pub pull_fp32_gbps: f64,
    /// Shard CPU seconds (all shard processes).
    pub server_cpu_s: f64,
    /// Worker-side CPU seconds (this process during the run).
    pub worker_cpu_s: f64,
    /// Shard CPU-seconds per fp32-equivalent GB ingested.
    pub server_cpu_s_per_gb: f64,
    /// Worker CPU-seconds per fp32-equivalent GB pushed.
    pub worker_cpu_s_per_gb: f64,
    /// Push → outcome round trip, p50 / p99, ms.
    pub push_ms: (f64, f64),
    /// Pull wait, p50 / p99, ms.
    pub pull_ms: (f64, f64),
}

fn compression_lines(a: &IngestArgs) -> String {
    format!(
        "scheme = \"{}\"\nbucket = {}\nerror_feedback = true\nzstd = {}\n{}",
        a.scheme,
        a.bucket,
        a.zstd,
        pull_lines(&a.pull, "q4")
    )
}

/// Runs one ingest measurement in a fresh temp directory.
pub fn run(a: &IngestArgs) -> Result<IngestReport> {
    if !["delta", "bf16", "f32"].contains(&a.pull.as_str()) {
        bail!("--pull {}: expected delta | bf16 | f32", a.pull);
    }
    let dir = tempfile::tempdir()?;
    let hidden = hidden_for(a.params);
    let partition = 1437 / a.workers.max(1) as u64;
    // `rounds` counts pushes: with local steps a push takes H steps.
    let steps = a.rounds.max(1) * u64::from(a.local_steps.max(1));
    let batch = (partition / steps).max(1);
    let servers: Vec<String> = (0..a.shards)
        .map(|_| free_port("127.0.0.1").map(|p| format!("127.0.0.1:{p}")))
        .collect::<Result<_>>()?;
    let rc = RunConfig {
        servers: servers.clone(),
        workers: a.workers,
        staleness: a.staleness.clone(),
        model: format!("kind = \"mlp\"\nhidden = [{hidden}]\nseed = 1"),
        data: "dataset = \"digits\"".into(),
        train: format!(
            "epochs = 1\nbatch = {batch}\neval_every = 0\nlocal_steps = {}",
            a.local_steps
        ),
        optimizer: format!(
            "kind = \"{}\"\nlr = 0.001{}",
            a.optimizer,
            if a.at_close {
                "\n[optimizer.outer]\nat_close = true"
            } else {
                ""
            }
        ),
        compression: compression_lines(a),
    };
    let cfg_path = dir.path().join("cluster.toml");
    std::fs::write(&cfg_path, rc.text())?;
    certificates(dir.path(), &[], a.shards, a.workers)?;
    let cfg = Config::load(&cfg_path)?;
    let layout = model_layout(&cfg)?;
    let server_bin = sibling("tether-server")?;
    let mut shards = Vec::new();
    // TETHER_BENCH_PERF=FILE profiles shard 0 with `perf record` (flat, 999 Hz) into FILE.
    let perf = std::env::var_os("TETHER_BENCH_PERF");
    for k in 0..a.shards {
        let mut cmd = match (&perf, k) {
            (Some(out), 0) => {
                let mut c = Command::new("perf");
                c.args(["record", "-q", "-F", "999", "-o"])
                    .arg(out)
                    .arg("--")
                    .arg(&server_bin);
                c
            }
            _ => Command::new(&server_bin),
        };
        cmd.current_dir(dir.path()).args([
            "--config",
            "cluster.toml",
            "--shard",
            &k.to_string(),
            "--exit-after-workers",
            &a.workers.to_string(),
            "--threads",
            &a.threads.to_string(),
            "--report",
            &format!("server-{k}.json"),
        ]);
        let mut p = Proc::spawn(cmd, dir.path().join(format!("server-{k}.log")))?;
        p.wait_for("listening on", Duration::from_secs(30))?;
        shards.push(p);
    }
    let (train, _) = tether_worker::data::digits()?;
    let train = Arc::new(train);
    let factory = Synthetic::factory(layout.clone(), 64, 10);
    let cpu0 = cpu_seconds(libc::RUSAGE_SELF);
    let started = Instant::now();
    let reports = run_workers(
        &cfg,
        &dir.path().join("certs"),
        &servers,
        train,
        factory,
        a.workers,
    )?;
    let wall = started.elapsed().as_secs_f64();
    let worker_cpu = cpu_seconds(libc::RUSAGE_SELF) - cpu0;
    let child0 = cpu_seconds(libc::RUSAGE_CHILDREN);
    for p in &mut shards {
        if !p.wait_exit(Duration::from_secs(30))? {
            bail!("a shard did not end cleanly:\n{}", p.log_tail(2000));
        }
    }
    let server_cpu = cpu_seconds(libc::RUSAGE_CHILDREN) - child0;
    let mut applied_fp32 = 0.0;
    let mut applied = 0u64;
    for k in 0..a.shards as usize {
        let text = std::fs::read_to_string(dir.path().join(format!("server-{k}.json")))
            .with_context(|| format!("server-{k}.json"))?;
        let v: serde_json::Value = serde_json::from_str(&text)?;
        let n = v["updates_applied"].as_u64().unwrap_or(0);
        let r = layout.shard_range(k, a.shards as usize);
        applied += n;
        applied_fp32 += 4.0 * r.len() as f64 * n as f64;
    }
    let sum = |f: fn(&WorkerReport) -> u64| reports.iter().map(f).sum::<u64>() as f64;
    let lat = |f: fn(&WorkerReport) -> &Vec<u32>| {
        let xs: Vec<f64> = reports
            .iter()
            .flat_map(|r| f(r).iter().map(|&u| u as f64 / 1e3))
            .collect();
        (quantile(&xs, 0.5), quantile(&xs, 0.99))
    };
    let gb = 1e9;
    Ok(IngestReport {
        args: a.clone(),
        params: layout.len() as u64,
        wall_s: wall,
        updates_applied: applied,
        ingest_fp32_gbps: applied_fp32 / wall / gb,
        push_wire_gbps: sum(|r| r.wire_bytes_pushed) / wall / gb,
        pull_wire_gbps: sum(|r| r.wire_bytes_pulled) / wall / gb,
        pull_fp32_gbps: sum(|r| r.fp32_bytes_pulled) / wall / gb,
        server_cpu_s: server_cpu,
        worker_cpu_s: worker_cpu,
        server_cpu_s_per_gb: server_cpu / (applied_fp32 / gb),
        worker_cpu_s_per_gb: worker_cpu / (sum(|r| r.fp32_bytes_pushed) / gb),
        push_ms: lat(|r| &r.push_latency_us),
        pull_ms: lat(|r| &r.pull_latency_us),
    })
}

/// Runs `workers` trainers of `factory`'s model to completion in an actix System in this process.
pub fn run_workers(
    cfg: &Config,
    certs: &Path,
    servers: &[String],
    train: Arc<tether_worker::data::Dataset>,
    factory: tether_worker::ModelFactory,
    workers: u32,
) -> Result<Vec<WorkerReport>> {
    tether::block_on_system(async {
        let mut tasks = Vec::new();
        for rank in 0..workers {
            let opts = WorkerOptions {
                rank,
                config: cfg.clone(),
                servers: servers.to_vec(),
                server_names: servers
                    .iter()
                    .map(|s| {
                        s.rsplit_once(':')
                            .map_or(s.as_str(), |(h, _)| h)
                            .to_string()
                    })
                    .collect(),
                tls: TlsFiles::for_worker(certs, rank)?,
                train: train.clone(),
                share: None,
                test: None,
                progress: None,
                faults: Vec::new(),
                metrics: None,
                reconnect_deadline: Duration::from_secs(30),
                step_delay: Duration::ZERO,
                straggle: None,
                model: Some(factory.clone()),
                colocated: workers,
                history: None,
            };
            let prepared = prepare_worker(opts)?;
            tasks.push(tokio::spawn(prepared.run()));
        }
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.context("worker task")??);
        }
        Ok(out)
    })
}

/// Prints the report as a table.
pub fn print(r: &IngestReport) {
    let a = &r.args;
    println!(
        "ingest: {} workers × {} shards ({} threads each), {:.2}M params, push {}{}, pull {}, {}, s = {}, {} rounds",
        a.workers,
        a.shards,
        a.threads,
        r.params as f64 / 1e6,
        a.scheme,
        if a.zstd { "+zstd" } else { "" },
        a.pull,
        if a.local_steps > 0 {
            format!(
                "outer nesterov (H = {}{})",
                a.local_steps,
                if a.at_close { ", at close" } else { "" }
            )
        } else {
            a.optimizer.clone()
        },
        a.staleness,
        a.rounds
    );
    println!("{:<34} {:>12}", "figure", "value");
    let rows = [
        (
            "push ingest, fp32-equiv GB/s (applied)",
            format!("{:.3}", r.ingest_fp32_gbps),
        ),
        ("push wire GB/s", format!("{:.3}", r.push_wire_gbps)),
        ("pull fp32-equiv GB/s", format!("{:.3}", r.pull_fp32_gbps)),
        ("pull wire GB/s", format!("{:.3}", r.pull_wire_gbps)),
        (
            "shard CPU-s per fp32 GB",
            format!("{:.2}", r.server_cpu_s_per_gb),
        ),
        (
            "worker CPU-s per fp32 GB",
            format!("{:.2}", r.worker_cpu_s_per_gb),
        ),
        (
            "push→outcome p50 / p99 ms",
            format!("{:.2} / {:.2}", r.push_ms.0, r.push_ms.1),
        ),
        (
            "pull wait p50 / p99 ms",
            format!("{:.2} / {:.2}", r.pull_ms.0, r.pull_ms.1),
        ),
        ("updates applied", r.updates_applied.to_string()),
        ("wall s", format!("{:.2}", r.wall_s)),
    ];
    for (k, v) in rows {
        println!("{k:<34} {v:>12}");
    }
}

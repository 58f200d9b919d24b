//! `tether-worker`: one training worker of a Tether cluster. Reads `cluster.toml`, loads its partition of the data,
//! connects to every shard over mutual-TLS QUIC and trains; rank 0 evaluates on the test set. Exit code 0 on success,
//! non-zero with a one-line cause on stderr otherwise.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Parser;
use prometheus_client::registry::Registry;
use tracing::info;

use tether_common::config::Config;
use tether_common::error_chain::ErrorChain;
use tether_common::metrics::{self, WorkerMetrics};
use tether_common::net::TlsFiles;
use tether_common::report::RunReport;
use tether_worker::backend::{self, Device};
use tether_worker::data::load_configured_share;
use tether_worker::step::GradientFault;
use tether_worker::{prepare_worker, Straggle, WorkerOptions};

/// Run one Tether training worker.
#[derive(Parser, Debug)]
#[command(name = "tether-worker", version)]
struct Cli {
    /// Cluster configuration file (cluster.toml).
    #[arg(long)]
    config: PathBuf,
    /// This worker's rank, 0..cluster.workers.
    #[arg(long)]
    rank: u32,
    /// Compute device: cpu | cuda:N (cuda needs a build with `--features cuda`, the NVIDIA driver and a GPU).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Write this worker's JSON run report here.
    #[arg(long)]
    report: Option<PathBuf>,
    /// Serve Prometheus metrics at http://ADDR/metrics.
    #[arg(long)]
    metrics: Option<SocketAddr>,
    /// Evaluate on the test set (default: only rank 0 does).
    #[arg(long)]
    eval: Option<bool>,
    /// Give up when a shard stays unreachable this many seconds.
    #[arg(long, default_value_t = 60)]
    reconnect_deadline_s: u64,
    /// Sleep this many milliseconds after each step (simulate a straggler).
    #[arg(long, default_value_t = 0)]
    step_delay_ms: u64,
    /// Straggler emulation `P:F`: with probability P a round takes F × its compute time (`1:2` = always 2× slow).
    #[arg(long, value_parser = parse_straggle)]
    straggle: Option<Straggle>,
    /// Fault injection for tests: `nan@STEP`, `scale@STEP:FACTOR` (the gradient, before clipping) or
    /// `push@STEP:FACTOR` (the pushed update, after clipping) (repeatable).
    #[arg(long)]
    inject: Vec<String>,
    /// Record every settled push and every pull reply used (with the fence term that answered) to this file, one
    /// JSON line each: the history the partition checker reads.
    #[arg(long)]
    history: Option<std::path::PathBuf>,
}

fn main() {
    tether_common::logging::init("info");
    if let Err(e) = run() {
        eprintln!("tether-worker: {}", ErrorChain(e.as_ref()));
        std::process::exit(1);
    }
}

fn parse_straggle(s: &str) -> Result<Straggle, String> {
    Straggle::parse(s)
        .ok_or_else(|| format!("`{s}`: expected P:F with P in [0, 1] and F ≥ 1 (e.g. 0.1:3)"))
}

fn parse_fault(s: &str) -> Result<GradientFault> {
    if let Some(step) = s.strip_prefix("nan@") {
        return Ok(GradientFault::NanAt(step.parse().context("nan@STEP")?));
    }
    if let Some(rest) = s.strip_prefix("scale@") {
        let (step, k) = rest.split_once(':').context("scale@STEP:FACTOR")?;
        return Ok(GradientFault::ScaleAt(step.parse()?, k.parse()?));
    }
    if let Some(rest) = s.strip_prefix("push@") {
        let (step, k) = rest.split_once(':').context("push@STEP:FACTOR")?;
        return Ok(GradientFault::PushScaleAt(step.parse()?, k.parse()?));
    }
    bail!("unknown fault {s:?} (nan@STEP | scale@STEP:FACTOR | push@STEP:FACTOR)")
}

fn run() -> Result<()> {
    let cli = Cli::parse();
    let device: Device = cli.device.parse()?;
    if let Device::Cuda(_) = device {
        // Fail before reading config or data: no driver, no GPU or no CUDA build is a one-line cause.
        let info = backend::probe(&cli.device).with_context(|| format!("device {device}"))?;
        info!(%info, "CUDA device");
    }
    let mut cfg = Config::load(&cli.config)?;
    for w in cfg.warnings() {
        tracing::warn!("{w}");
    }
    if cli.rank >= cfg.cluster.rank_limit() {
        bail!(
            "--rank {} but ranks 0..{} may join (cluster.workers is {}, cluster.max_workers {})",
            cli.rank,
            cfg.cluster.rank_limit(),
            cfg.cluster.workers,
            cfg.cluster.max_workers
        );
    }
    let faults = cli
        .inject
        .iter()
        .map(|s| parse_fault(s))
        .collect::<Result<Vec<_>>>()?;
    let evaluate = cli.eval.unwrap_or(cli.rank == 0);
    // Only this rank's share of an IDX training set, and the test set only where it is evaluated.
    let data = load_configured_share(&mut cfg, cli.rank, evaluate)?;
    let note = data.note;
    let model = match device {
        Device::Cpu => None,
        Device::Cuda(ordinal) => {
            let (features, classes) = tether_common::layout::model_io(&cfg)?;
            let (info, factory) =
                backend::cuda::model_factory(ordinal, &cfg.model, features, classes)
                    .with_context(|| format!("device {device}"))?;
            eprintln!("tether-worker rank {}: training on {info}", cli.rank);
            Some(factory)
        }
    };
    if let Some(n) = &note {
        eprintln!("note: {n}");
    }
    let servers = cfg.cluster.servers.clone();
    let mut names = Vec::new();
    for (k, s) in servers.iter().enumerate() {
        // Fail early on an address that does not resolve at all; the driver resolves again at every reconnect. A
        // replicated shard's primary may be dead, and its name gone with it (a container or pod that is not
        // running): the worker starts, and finds the standby.
        let has_port = s
            .rsplit_once(':')
            .is_some_and(|(_, p)| p.parse::<u16>().is_ok());
        match (resolve(s), cfg.cluster.standbys.get(k)) {
            (Ok(_), _) => {}
            (Err(e), Some(standby)) if has_port => {
                tracing::warn!(shard = k, error = %e, standby = %standby,
                    "the primary's address does not resolve now; starting with its standby")
            }
            // No standby, or an address that is malformed rather than momentarily unknown.
            (Err(e), _) => return Err(e),
        }
        names.push(
            s.rsplit_once(':')
                .map_or(s.as_str(), |(h, _)| h)
                .trim_matches(['[', ']'])
                .to_string(),
        );
    }
    let tls = TlsFiles::for_worker(&cfg.cluster.tls_dir, cli.rank)?
        .with_revoked(&cfg.cluster.revoked_serials());
    let runtime = || {
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .expect("cannot build the tokio runtime") // startup: no runtime, nothing to do
    };
    let report_path = cli.report.clone();
    let metrics_addr = cli.metrics;
    actix_rt::System::with_tokio_rt(runtime).block_on(async move {
        let mut registry = Registry::default();
        let worker_metrics = WorkerMetrics::register(&mut registry);
        if let Some(addr) = metrics_addr {
            let (bound, _task) = metrics::serve(addr, Arc::new(registry))
                .await
                .with_context(|| format!("cannot serve metrics on {addr}"))?;
            info!(%bound, "metrics at http://{bound}/metrics");
        }
        let opts = WorkerOptions {
            rank: cli.rank,
            config: cfg.clone(),
            servers,
            server_names: names,
            tls,
            train: Arc::new(data.train),
            share: data.share,
            test: data.test,
            progress: None,
            faults,
            metrics: Some(worker_metrics),
            reconnect_deadline: Duration::from_secs(cli.reconnect_deadline_s),
            step_delay: Duration::from_millis(cli.step_delay_ms),
            straggle: cli.straggle,
            model,
            colocated: tether_worker::threads::colocated_workers(&cfg),
            history: cli.history.clone(),
        };
        let prepared = prepare_worker(opts)?;
        let r = tokio::spawn(prepared.run())
            .await
            .context("worker task panicked")??;
        let final_acc = r.accuracy_curve.last().map_or(f64::NAN, |a| a.2);
        println!(
            "tether-worker rank {}: {} steps in {:.1} s, last loss {:.4}, test accuracy {}",
            r.rank,
            r.steps,
            r.wall_seconds,
            r.loss_curve.last().map_or(f64::NAN, |l| l.2),
            if final_acc.is_nan() {
                "-".to_string()
            } else {
                format!("{final_acc:.4}")
            }
        );
        if let Some(path) = report_path {
            let mut report: RunReport = r.run_report(&cfg);
            if let Some(n) = note {
                report.notes.push(n);
            }
            report
                .write_json(&path)
                .with_context(|| format!("cannot write {}", path.display()))?;
        }
        Ok(())
    })
}

fn resolve(addr: &str) -> Result<SocketAddr> {
    use std::net::ToSocketAddrs;
    addr.to_socket_addrs()
        .with_context(|| format!("cannot resolve server address {addr:?}"))?
        .next()
        .with_context(|| format!("{addr:?} resolves to no address"))
}

//! `tether-server`: serves one parameter shard of a Tether cluster over mutual-TLS QUIC, or (`keygen`) writes the
//! cluster's certificates. Exit code 0 on success, non-zero with a one-line cause on stderr otherwise.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use prometheus_client::registry::Registry;
use tracing::info;

use tether_common::config::Config;
use tether_common::metrics::{self, ServerMetrics};
use tether_server::node::{shard_report, start_shard, ShardOptions};

/// Serve one parameter shard of a Tether cluster.
#[derive(Parser, Debug)]
#[command(
    name = "tether-server",
    version,
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// Cluster configuration file (cluster.toml).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Shard index K; listens on cluster.servers[K].
    #[arg(long)]
    shard: Option<u32>,
    /// Listen address (overrides cluster.servers[K]).
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Resume from the newest verified checkpoint in checkpoint.dir/shard-K.
    #[arg(long)]
    resume: bool,
    /// Serve Prometheus metrics at http://ADDR/metrics.
    #[arg(long)]
    metrics: Option<SocketAddr>,
    /// Write this shard's JSON run report here on shutdown.
    #[arg(long)]
    report: Option<PathBuf>,
    /// Reject gradients whose norm exceeds this multiple of the running median (0 = off).
    #[arg(long, default_value_t = 0.0)]
    spike_factor: f32,
    /// Exit (with a final checkpoint) once this many workers have finished and left (0 = run until SIGTERM).
    #[arg(long, default_value_t = 0)]
    exit_after_workers: u32,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Write a cluster CA, a server certificate and client certificate(s) to DIR.
    Keygen {
        /// Output directory.
        #[arg(long)]
        out: PathBuf,
        /// Host names / IPs the server certificate is valid for (comma-separated; localhost and 127.0.0.1 always).
        #[arg(long, value_delimiter = ',')]
        hosts: Vec<String>,
        /// Also write per-worker certificates worker-R.pem for R in 0..N (binding each worker to its rank).
        #[arg(long)]
        workers: Option<u32>,
    },
}

fn main() {
    tether_common::logging::init("info");
    if let Err(e) = run() {
        eprintln!("tether-server: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let cli = Cli::parse();
    if let Some(Command::Keygen {
        out,
        hosts,
        workers,
    }) = &cli.command
    {
        tether_common::pki::generate(out, hosts, *workers)
            .with_context(|| format!("keygen into {}", out.display()))?;
        println!("wrote cluster certificates to {}", out.display());
        return Ok(());
    }
    let config_path = cli
        .config
        .clone()
        .context("--config is required (or use `keygen`)")?;
    let shard = cli.shard.context("--shard is required")?;
    let cfg = Config::load(&config_path)?;
    let runtime = || {
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .expect("cannot build the tokio runtime") // startup: no runtime, nothing to do
    };
    actix_rt::System::with_tokio_rt(runtime).block_on(serve(cli, cfg, shard))
}

async fn serve(cli: Cli, cfg: Config, shard: u32) -> Result<()> {
    let mut registry = Registry::default();
    let server_metrics = ServerMetrics::register(&mut registry);
    let registry = Arc::new(registry);
    if let Some(addr) = cli.metrics {
        let (bound, _task) = metrics::serve(addr, registry.clone())
            .await
            .with_context(|| format!("cannot serve metrics on {addr}"))?;
        info!(%bound, "metrics at http://{bound}/metrics");
    }
    let running = start_shard(
        &cfg,
        ShardOptions {
            shard,
            listen: cli.listen,
            resume: cli.resume,
            tls: None,
            metrics: Some(server_metrics),
            spike_factor: cli.spike_factor,
            layout: None,
        },
    )
    .await?;
    println!(
        "tether-server shard {shard} listening on {}",
        running.local_addr
    );
    wait_for_end(&running, cli.exit_after_workers).await;
    let (_, stats) = running.shutdown(true).await?;
    if let Some(path) = &cli.report {
        shard_report(&cfg, &stats)
            .write_json(path)
            .with_context(|| format!("cannot write report {}", path.display()))?;
    }
    info!(updates = stats.updates_applied, "shard stopped");
    Ok(())
}

async fn wait_for_end(running: &tether_server::node::RunningShard, exit_after_workers: u32) {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    let sigterm = async {
        match term.as_mut() {
            Some(t) => {
                t.recv().await;
            }
            None => std::future::pending::<()>().await,
        }
    };
    let done = async {
        if exit_after_workers == 0 {
            return std::future::pending::<()>().await;
        }
        loop {
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            match running.stats().await {
                Ok((_, stats, _)) if stats.left >= u64::from(exit_after_workers) => return,
                Ok(_) => {}
                Err(_) => return,
            }
        }
    };
    tokio::select! {
        _ = sigterm => info!("SIGTERM: shutting down"),
        _ = tokio::signal::ctrl_c() => info!("interrupted: shutting down"),
        _ = done => info!("all workers finished: shutting down"),
    }
}

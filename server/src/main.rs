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
use tether_common::error_chain::ErrorChain;
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
    /// Run as shard K's standby: listen on cluster.standbys[K] with the standby-K bundle, follow the primary's log
    /// and take over, with every applied update, when the primary dies.
    #[arg(long)]
    standby: bool,
    /// Serve Prometheus metrics at http://ADDR/metrics.
    #[arg(long)]
    metrics: Option<SocketAddr>,
    /// Write this shard's JSON run report here on shutdown.
    #[arg(long)]
    report: Option<PathBuf>,
    /// Refuse gradients whose norm exceeds this multiple of the workers' running medians (0 = off; default:
    /// guard.factor of the config).
    #[arg(long)]
    spike_factor: Option<f32>,
    /// Threads this shard decodes and applies pushes and cuts pull deltas on, in chunks (default: shard.threads of
    /// the config; 0 = every core). The results are the same bits at any count.
    #[arg(long)]
    threads: Option<u32>,
    /// Exit (with a final checkpoint) once this many distinct configured ranks have finished and left (0 = run until
    /// SIGTERM).
    #[arg(long, default_value_t = 0)]
    exit_after_workers: u32,
    /// Append one JSON line per applied push (wall time, node, term, worker, clock, version) to this file: the
    /// history the partition checker reads.
    #[arg(long)]
    history: Option<PathBuf>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Write a cluster CA to its own folder and one bundle per node (`server-K/`, `worker-R/`: the CA certificate
    /// plus that node's own certificate and key; a shard's also its checkpoint key) to DIR. Deploy each node with
    /// only its bundle; keep the CA folder off the cluster. Refuses a DIR that already holds one of the bundles.
    #[command(args_conflicts_with_subcommands = true)]
    Keygen {
        #[command(subcommand)]
        command: Option<KeygenCommand>,
        /// Output directory for the node bundles.
        #[arg(long)]
        out: Option<PathBuf>,
        /// Where the CA (ca.pem, ca.key, issued.txt) goes (default OUT/ca).
        #[arg(long)]
        ca_dir: Option<PathBuf>,
        /// Shard host names / IPs: one per shard (shard K gets the K-th), or one for all (comma-separated;
        /// localhost and 127.0.0.1 always).
        #[arg(long, value_delimiter = ',')]
        hosts: Vec<String>,
        /// Shards to write bundles for (default: the number of hosts, at least 1).
        #[arg(long)]
        servers: Option<u32>,
        /// Workers to write bundles for (worker-R, bound to rank R).
        #[arg(long, default_value_t = 0)]
        workers: u32,
        /// Validity of every certificate, in days.
        #[arg(long, default_value_t = tether_common::pki::DEFAULT_DAYS)]
        days: u32,
        /// Also write one standby bundle per shard (`standby-K`, with shard K's hosts and checkpoint key).
        #[arg(long)]
        standbys: bool,
        /// Also write `client/`, one certificate that may claim ANY rank. Development only: whoever holds it can
        /// push as every worker.
        #[arg(long)]
        dev_shared_client: bool,
        /// Give the written files to UID:GID (when keygen runs as root for nodes that do not).
        #[arg(long)]
        owner: Option<String>,
    },
    /// Run the witness: the third vote that fences every replicated shard (one per cluster, at cluster.witness,
    /// with the `witness` bundle). It keeps what it granted in its state file; keep that file across restarts.
    Witness {
        /// Cluster configuration file (cluster.toml).
        #[arg(long)]
        config: PathBuf,
        /// Listen address (overrides cluster.witness).
        #[arg(long)]
        listen: Option<SocketAddr>,
        /// Where the witness keeps its votes (default: checkpoint.dir/witness.json).
        #[arg(long)]
        state: Option<PathBuf>,
    },
}

#[derive(Subcommand, Debug)]
enum KeygenCommand {
    /// Issue one more node's bundle from an existing CA (elastic scaling): `--worker R`, `--server K --host H`,
    /// `--standby K --host H` or `--witness --host H`.
    /// Refuses to replace an existing bundle unless `--force`; then prints the replaced certificate's serial, which
    /// stays valid until it is listed in cluster.revoked.
    Issue {
        /// The CA folder (ca.pem, ca.key).
        #[arg(long)]
        ca: PathBuf,
        /// Output directory; the bundle goes to OUT/worker-R or OUT/server-K.
        #[arg(long)]
        out: PathBuf,
        /// Issue worker rank R's bundle.
        #[arg(long, conflicts_with_all = ["server", "standby", "witness"],
              required_unless_present_any = ["server", "standby", "witness"])]
        worker: Option<u32>,
        /// Issue shard K's bundle.
        #[arg(long, conflicts_with_all = ["standby", "witness"])]
        server: Option<u32>,
        /// Issue shard K's standby bundle (OUT/standby-K; it copies OUT/server-K's checkpoint key).
        #[arg(long, conflicts_with = "witness")]
        standby: Option<u32>,
        /// Issue the witness's bundle (OUT/witness), for the host it runs on.
        #[arg(long)]
        witness: bool,
        /// The node's host names / IPs (comma-separated; localhost and 127.0.0.1 always).
        #[arg(long, value_delimiter = ',')]
        host: Vec<String>,
        /// Validity in days.
        #[arg(long, default_value_t = tether_common::pki::DEFAULT_DAYS)]
        days: u32,
        /// Give the written files to UID:GID.
        #[arg(long)]
        owner: Option<String>,
        /// Replace an existing bundle (a shard's checkpoint key is kept).
        #[arg(long)]
        force: bool,
    },
    /// Write a new checkpoint key (`checkpoint.key`, 0600) into a shard's bundle folder that has none (bundles
    /// written before checkpoints were authenticated). Refuses to replace a key unless `--force`: checkpoints written
    /// with the old key can no longer be loaded.
    CheckpointKey {
        /// The shard's bundle folder (e.g. certs/server-0).
        #[arg(long)]
        bundle: PathBuf,
        /// Replace an existing key.
        #[arg(long)]
        force: bool,
    },
}

fn parse_owner(owner: &str) -> Result<(u32, u32)> {
    let (u, g) = owner.split_once(':').context("--owner takes UID:GID")?;
    Ok((
        u.parse().context("--owner: UID is not a number")?,
        g.parse().context("--owner: GID is not a number")?,
    ))
}

fn print_issued(issued: &[tether_common::pki::Issued]) {
    for i in issued {
        println!("  {:<20} serial {}", i.node.bundle_name(), i.serial);
    }
}

fn keygen(command: &Command) -> Result<()> {
    use tether_common::pki::{self, Node, Plan, Validity};
    let Command::Keygen {
        command,
        out,
        ca_dir,
        hosts,
        servers,
        workers,
        days,
        standbys,
        dev_shared_client,
        owner,
    } = command
    else {
        anyhow::bail!("not a keygen command");
    };
    if let Some(KeygenCommand::CheckpointKey { bundle, force }) = command {
        let path = pki::write_checkpoint_key(bundle, *force)?;
        println!("wrote a new checkpoint key to {}", path.display());
        return Ok(());
    }
    if let Some(KeygenCommand::Issue {
        ca,
        out,
        worker,
        server,
        standby,
        witness,
        host,
        days,
        owner,
        force,
    }) = command
    {
        let node = match (worker, server, standby, witness) {
            (Some(rank), _, _, _) => Node::Worker { rank: *rank },
            (None, Some(shard), _, _) => Node::Server {
                shard: *shard,
                hosts: host.clone(),
            },
            (None, None, Some(shard), _) => Node::Standby {
                shard: *shard,
                hosts: host.clone(),
            },
            (None, None, None, true) => Node::Witness {
                hosts: host.clone(),
            },
            (None, None, None, false) => {
                anyhow::bail!("give --worker R, --server K, --standby K or --witness")
            }
        };
        if *days == 0 {
            anyhow::bail!("--days must be at least 1");
        }
        let validity = Validity::days(*days);
        let (issued, replaced) = if *force {
            pki::reissue(ca, out, &node, &validity)
        } else {
            pki::issue(ca, out, &node, &validity).map(|i| (i, None))
        }
        .with_context(|| format!("keygen issue from {}", ca.display()))?;
        if let Some(owner) = owner {
            let (uid, gid) = parse_owner(owner)?;
            pki::chown_tree(&out.join(node.bundle_name()), uid, gid)?;
        }
        println!("issued into {}:", out.display());
        print_issued(std::slice::from_ref(&issued));
        if let Some(old) = replaced {
            println!(
                "  replaced {} serial {old}: it stays valid until you add it to cluster.revoked:",
                node.bundle_name()
            );
            println!("  revoked = [\"{old}\"]");
        }
        return Ok(());
    }
    let out = out.as_ref().context("keygen needs --out DIR")?;
    let ca_dir = ca_dir.clone().unwrap_or_else(|| out.join("ca"));
    let plan = Plan {
        hosts: hosts.clone(),
        servers: servers.unwrap_or(hosts.len().max(1) as u32),
        workers: *workers,
        shared_client: *dev_shared_client,
        standbys: *standbys,
        days: *days,
    };
    let issued = pki::generate(out, &ca_dir, &plan)
        .with_context(|| format!("keygen into {}", out.display()))?;
    if let Some(owner) = owner {
        let (uid, gid) = parse_owner(owner)?;
        for i in &issued {
            pki::chown_tree(&out.join(i.node.bundle_name()), uid, gid)?;
        }
        pki::chown_tree(&ca_dir, uid, gid)?;
    }
    println!(
        "wrote the cluster CA to {} (keep it off the cluster) and node bundles to {}:",
        ca_dir.display(),
        out.display()
    );
    print_issued(&issued);
    if *dev_shared_client {
        eprintln!("warning: client/ may claim any rank; use it for development only");
    }
    Ok(())
}

fn main() {
    tether_common::logging::init("info");
    if let Err(e) = run() {
        eprintln!("tether-server: {}", ErrorChain(e.as_ref()));
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let cli = Cli::parse();
    match &cli.command {
        Some(Command::Witness {
            config,
            listen,
            state,
        }) => return witness(config, *listen, state.clone()),
        Some(command) => return keygen(command),
        None => {}
    }
    let config_path = cli
        .config
        .clone()
        .context("--config is required (or use `keygen`)")?;
    let shard = cli.shard.context("--shard is required")?;
    let mut cfg = Config::load(&config_path)?;
    if let Some(threads) = cli.threads {
        cfg.shard.threads = threads;
        // The flag overrides the key; the key's range applies to it.
        cfg.validate()?;
    }
    for w in cfg.warnings() {
        tracing::warn!("{w}");
    }
    let runtime = || {
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .expect("cannot build the tokio runtime") // startup: no runtime, nothing to do
    };
    actix_rt::System::with_tokio_rt(runtime).block_on(serve(cli, cfg, shard))
}

/// Runs the witness until SIGINT or SIGTERM.
fn witness(
    config: &std::path::Path,
    listen: Option<SocketAddr>,
    state: Option<PathBuf>,
) -> Result<()> {
    let cfg = Config::load(config)?;
    let state = state.unwrap_or_else(|| cfg.checkpoint.dir.join("witness.json"));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot build the tokio runtime")?;
    runtime.block_on(async {
        let running = tether_server::witness::start_witness(&cfg, listen, None, state).await?;
        println!("witness listening on {}", running.local_addr);
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        running.shutdown();
        Ok(())
    })
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
            checkpoint_key: None,
            standby: cli.standby,
            history: cli.history.clone(),
        },
    )
    .await?;
    println!(
        "tether-server shard {shard}{} listening on {}",
        if cli.standby { " (standby)" } else { "" },
        running.local_addr
    );
    let end = tokio::select! {
        end = wait_for_end(&running, cli.exit_after_workers) => end,
        why = running.standby_failed() => anyhow::bail!("standby of shard {shard}: {why}"),
    };
    // The last goodbye must reach the standby before this primary goes: a standby that loses its primary first
    // takes over and waits for workers that already left.
    if end == End::WorkersFinished
        && !running.is_following()
        && !running.standby_caught_up(STANDBY_CATCH_UP_LIMIT).await
    {
        tracing::warn!(
            shard,
            "the standby did not acknowledge the last inputs within {} s; exiting anyway",
            STANDBY_CATCH_UP_LIMIT.as_secs()
        );
    }
    // A standby that never took over writes no checkpoint: its primary's are the shard's.
    let final_checkpoint = !running.is_following();
    let (_, stats) = running.shutdown(final_checkpoint).await?;
    if let Some(path) = &cli.report {
        shard_report(&cfg, &stats)
            .write_json(path)
            .with_context(|| format!("cannot write report {}", path.display()))?;
    }
    info!(updates = stats.updates_applied, "shard stopped");
    Ok(())
}

/// How long a primary that saw its last worker leave waits for its standby to acknowledge that before it exits.
const STANDBY_CATCH_UP_LIMIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Why a shard process ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// SIGTERM or Ctrl-C.
    Signal,
    /// `--exit-after-workers` distinct ranks finished (or the actor is gone).
    WorkersFinished,
}

async fn wait_for_end(running: &tether_server::node::RunningShard, exit_after_workers: u32) -> End {
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
                // Distinct ranks that finished, not goodbyes: one identity saying goodbye twice counts once.
                Ok((_, stats, _)) if stats.finished.len() >= exit_after_workers as usize => return,
                Ok(_) => {}
                Err(_) => return,
            }
        }
    };
    tokio::select! {
        _ = sigterm => {
            info!("SIGTERM: shutting down");
            End::Signal
        }
        _ = tokio::signal::ctrl_c() => {
            info!("interrupted: shutting down");
            End::Signal
        }
        _ = done => {
            info!("all workers finished: shutting down");
            End::WorkersFinished
        }
    }
}

//! `tether-bench`: the evidence for Tether's claims (quinn's `perf` is the model).
//!
//! - `ingest`: real shards over real QUIC with synthetic pushers and pullers — ingest GB/s with the optimizer
//!   applied, pull GB/s, CPU-seconds per GB per side, p50/p99 latencies; table and `--json`.
//! - `floors`: memcpy, the optimizer kernel, the shard apply path, the codec and raw quinn, in the same process.
//! - `simulate`: the discrete-event simulator, one configuration or the 64–1,024-worker prediction grid.
//! - `scale`: a many-worker run of real processes on network namespaces, with a nemesis ([`tether_bench::scale`]).
//! - `study`: the link and straggler study on network namespaces; writes `BENCHMARKS.md` and its plots.

mod cluster;
mod floors;
mod ingest;
mod plot;
mod study;

use anyhow::Result;
use clap::{Parser, Subcommand};

use tether_bench::sim::{simulate, SimConfig};

/// Tether's bench tool.
#[derive(Parser, Debug)]
#[command(name = "tether-bench", version)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Push/pull throughput of real shards over QUIC.
    Ingest {
        #[command(flatten)]
        args: ingest::IngestArgs,
        /// Also run the floors for the same shard size.
        #[arg(long)]
        floors: bool,
        /// Write the figures as JSON here.
        #[arg(long)]
        json: Option<std::path::PathBuf>,
    },
    /// The floors the ingest figures sit against.
    Floors {
        #[command(flatten)]
        args: floors::FloorArgs,
        /// Write the figures as JSON here.
        #[arg(long)]
        json: Option<std::path::PathBuf>,
    },
    /// The discrete-event simulator.
    Simulate {
        #[command(flatten)]
        args: SimArgs,
    },
    /// Plots run reports' curves against wall time (e.g. rank 0's accuracy in each run of scripts/goodput.sh).
    Curves {
        /// `LABEL=REPORT.json`, one per series.
        #[arg(required = true)]
        runs: Vec<String>,
        /// The curve: `accuracy_curve`, `val_loss_curve` or `loss_curve`.
        #[arg(long, default_value = "accuracy_curve")]
        curve: String,
        /// The plot's title.
        #[arg(long, default_value = "")]
        title: String,
        /// Write the PNG here.
        #[arg(long)]
        out: std::path::PathBuf,
    },
    /// A many-worker run on network namespaces (root): workers, shards with standbys, shaped host links, a nemesis.
    Scale {
        #[command(flatten)]
        args: ScaleArgs,
    },
    /// Holds a star of shaped namespace hosts (root) while a command places its own processes on them with
    /// `ip netns exec` (hosts in `TETHER_HOSTS_NETNS` / `TETHER_HOSTS_ADDRS`); reports bytes and bursts per link.
    Hosts {
        /// Namespace hosts.
        #[arg(long)]
        hosts: usize,
        /// Every host's link, Mbit/s both ways (default: unshaped).
        #[arg(long)]
        rate_mbit: Option<u64>,
        /// Milliseconds between reads of the link counters.
        #[arg(long, default_value_t = 100)]
        sample_ms: u64,
        /// Kill the command after this many seconds.
        #[arg(long, default_value_t = 3600.0)]
        limit: f64,
        /// Append the report as one JSON line here.
        #[arg(long)]
        json: Option<std::path::PathBuf>,
        /// The command and its arguments (after `--`).
        #[arg(required = true, last = true)]
        command: Vec<String>,
    },
    /// The study: emulated links, stragglers, scaling, simulator validation and prediction → BENCHMARKS.md.
    Study {
        #[command(flatten)]
        args: study::StudyArgs,
    },
}

/// Simulator parameters (defaults: a 100M-parameter model, 0.5 s rounds, q4 both ways, costs measured here).
#[derive(clap::Args, Debug)]
struct SimArgs {
    /// A JSON `SimConfig` to start from (flags below override it).
    #[arg(long)]
    config: Option<std::path::PathBuf>,
    /// Workers.
    #[arg(long)]
    workers: Option<u32>,
    /// Shards.
    #[arg(long)]
    shards: Option<u32>,
    /// Parameters.
    #[arg(long)]
    params: Option<u64>,
    /// Staleness bound (`inf` = async).
    #[arg(long)]
    staleness: Option<String>,
    /// Rounds per worker.
    #[arg(long)]
    rounds: Option<u64>,
    /// Mean compute seconds per round.
    #[arg(long)]
    compute_s: Option<f64>,
    /// Link rate, Gbit/s.
    #[arg(long)]
    link_gbit: Option<f64>,
    /// Transient stragglers `P:F`.
    #[arg(long)]
    straggle: Option<String>,
    /// The prediction grid: 64–1,024 workers × 8–64 shards on 10 and 100 Gbit/s; writes a PNG here.
    #[arg(long)]
    predict: Option<std::path::PathBuf>,
    /// Simulate the default sync (`tether_bench::predict::default_sync`: local-step rounds, topk2 both ways, quorum
    /// 3/4, standbys, threaded shards; defaults 1,024 workers × 64 shards at 10 Gbit/s) and name what limits it.
    #[arg(long)]
    default_sync: bool,
    /// The default sync's prediction (64–1,024 workers × 8–64 shards × 1, 10, 100 Gbit/s per host): Markdown on
    /// stdout; writes the rows here as JSON (`.json`) or a PNG plot (anything else).
    #[arg(long)]
    predict_default: Option<std::path::PathBuf>,
    /// What it takes to reach 0.9: the default sync (at --workers × --shards, default 1,024 × 64) under every
    /// combination of staleness 1, the outer step at round close, steady compute and H = 32, at 1, 10, 100 Gbit/s.
    #[arg(long)]
    what_it_takes: bool,
    /// With --default-sync: `cluster.quorum` (0: every live worker).
    #[arg(long)]
    quorum: Option<u32>,
    /// With --default-sync: threads per shard.
    #[arg(long)]
    shard_threads: Option<u32>,
    /// With --default-sync: no standbys.
    #[arg(long)]
    no_standbys: bool,
    /// With --default-sync: hosts the nodes share, placed as `tether-bench scale` places them (default: one each).
    #[arg(long)]
    hosts: Option<u32>,
    /// Calibrate on the first completed undisturbed run of this `tether-bench scale --json` file and validate on
    /// the other completed undisturbed ones: measured against simulated round time and stall.
    #[arg(long)]
    calibrate: Option<std::path::PathBuf>,
}

/// A many-worker run (defaults: the quickstart's sync, standbys, a quorum of 3/4, global batch 512).
#[derive(clap::Args, Debug)]
struct ScaleArgs {
    /// Namespace hosts.
    #[arg(long, default_value_t = 8)]
    hosts: usize,
    /// Worker processes.
    #[arg(long, default_value_t = 64)]
    workers: u32,
    /// Shards.
    #[arg(long, default_value_t = 8)]
    shards: u32,
    /// No standbys (and no witness).
    #[arg(long)]
    no_standbys: bool,
    /// Every host's link, Mbit/s both ways (default: unshaped).
    #[arg(long)]
    rate_mbit: Option<u64>,
    /// SIGKILL a random worker or shard node every this many seconds (started again 1 s later).
    #[arg(long)]
    kill_every: Option<f64>,
    /// Cut this host off from every other one (`--cut-at`, `--cut-for`).
    #[arg(long)]
    cut_host: Option<usize>,
    /// When the cut starts, seconds after the workers start.
    #[arg(long, default_value_t = 10.0)]
    cut_at: f64,
    /// How long the cut lasts, seconds.
    #[arg(long, default_value_t = 10.0)]
    cut_for: f64,
    /// Epochs.
    #[arg(long, default_value_t = 5)]
    epochs: u32,
    /// Per-worker batch (default 512 / workers, at least 8).
    #[arg(long)]
    batch: Option<usize>,
    /// `cluster.quorum` (default 3/4 of the workers; 0: every live worker).
    #[arg(long)]
    quorum: Option<u32>,
    /// Inner steps per round.
    #[arg(long, default_value_t = 16)]
    local_steps: u32,
    /// The inner Adam learning rate.
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    /// Push and pull codec: `topk2` (bucket 4096, keep 16) or `q4`.
    #[arg(long, default_value = "topk2", value_parser = ["topk2", "q4"])]
    scheme: String,
    /// The pull codec, `topk2` or `q4` (default: --scheme's).
    #[arg(long, value_parser = ["topk2", "q4"])]
    pull_scheme: Option<String>,
    /// `cluster.staleness` (0: BSP rounds, the quickstart's).
    #[arg(long, default_value_t = 0)]
    staleness: u32,
    /// topk2's kept values per 4,096-value bucket (`compression.keep`).
    #[arg(long, default_value_t = 16)]
    keep: u32,
    /// The inner optimizer (`optimizer.kind`).
    #[arg(long, default_value = "adam", value_parser = ["adam", "sgd", "momentum", "nesterov"])]
    inner: String,
    /// Adam's β2 (`optimizer.beta2`).
    #[arg(long, default_value_t = 0.999)]
    beta2: f64,
    /// Adam's ε (`optimizer.eps`).
    #[arg(long, default_value_t = 1e-8)]
    eps: f64,
    /// The outer Nesterov learning rate (`optimizer.outer.lr`).
    #[arg(long, default_value_t = 1.4)]
    outer_lr: f64,
    /// The outer Nesterov momentum (`optimizer.outer.momentum`).
    #[arg(long, default_value_t = 0.5)]
    outer_momentum: f64,
    /// Step the outer optimizer once per round, when it closes (`optimizer.outer.at_close`).
    #[arg(long)]
    at_close: bool,
    /// `fashion-mnist` or `digits`.
    #[arg(long, default_value = "fashion-mnist")]
    dataset: String,
    /// `cluster.failover_ms` (lease and silent-link timeout).
    #[arg(long, default_value_t = 1000)]
    failover_ms: u64,
    /// Seed of the nemesis's choices.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// `model.seed`: the initial weights.
    #[arg(long, default_value_t = 42)]
    model_seed: u64,
    /// `train.seed`: data shuffling and stochastic rounding.
    #[arg(long, default_value_t = 7)]
    train_seed: u64,
    /// Stop after this many seconds.
    #[arg(long, default_value_t = 600.0)]
    limit: f64,
    /// Where tether-server and tether-worker are (default: beside this binary).
    #[arg(long)]
    bin_dir: Option<std::path::PathBuf>,
    /// Keep the run's folder (logs, reports, histories) here (default: a temporary folder, removed).
    #[arg(long)]
    dir: Option<std::path::PathBuf>,
    /// Append the report as one JSON line here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

fn scale(a: &ScaleArgs) -> Result<()> {
    use tether_bench::scale::{Nemesis, ScaleSpec};
    let mut spec = ScaleSpec::quickstart(a.hosts, a.workers, a.shards);
    spec.standbys = !a.no_standbys;
    spec.rate_bps = a.rate_mbit.map(|m| m * 1_000_000);
    spec.nemesis = match (a.kill_every, a.cut_host) {
        (Some(_), Some(_)) => anyhow::bail!("--kill-every or --cut-host, not both"),
        (Some(every_s), None) => Nemesis::Kill { every_s },
        (None, Some(host)) => Nemesis::Cut {
            host,
            at_s: a.cut_at,
            for_s: a.cut_for,
        },
        (None, None) => Nemesis::None,
    };
    spec.epochs = a.epochs;
    if let Some(b) = a.batch {
        spec.batch = b;
    }
    if let Some(q) = a.quorum {
        spec.quorum = q;
    }
    spec.local_steps = a.local_steps;
    spec.lr = a.lr;
    spec.scheme = a.scheme.clone();
    spec.pull_scheme = a.pull_scheme.clone();
    spec.staleness = a.staleness;
    spec.keep = a.keep;
    spec.inner = a.inner.clone();
    spec.beta2 = a.beta2;
    spec.eps = a.eps;
    spec.outer_lr = a.outer_lr;
    spec.outer_momentum = a.outer_momentum;
    spec.at_close = a.at_close;
    spec.dataset = a.dataset.clone();
    spec.failover_ms = a.failover_ms;
    spec.seed = a.seed;
    spec.model_seed = a.model_seed;
    spec.train_seed = a.train_seed;
    spec.limit_s = a.limit;
    let bins = match &a.bin_dir {
        Some(d) => d.clone(),
        None => std::env::current_exe()?
            .parent()
            .ok_or_else(|| anyhow::anyhow!("no folder above tether-bench"))?
            .to_path_buf(),
    };
    let temp = tempfile::tempdir()?;
    let dir = a.dir.clone().unwrap_or_else(|| temp.path().to_path_buf());
    let report = tether_bench::scale::run(&spec, &bins, &dir)?;
    print!("{}", report.text());
    if let Some(p) = &a.json {
        tether_bench::hosts::append_json(p, &report)?;
    }
    Ok(())
}

/// `simulate --calibrate`: the simulator against the undisturbed runs of a scale results file.
fn calibrate(path: &std::path::Path) -> Result<()> {
    use tether_bench::predict::ScaleMeasurement;
    use tether_bench::scale::{Nemesis, ScaleReport};
    let mut runs = Vec::new();
    let mut shared_runs = Vec::new();
    let mut quantile_runs = Vec::new();
    for line in std::fs::read_to_string(path)?
        .lines()
        .filter(|l| !l.trim().is_empty())
    {
        // A failed run reports nulls, and reports before `compute_per_round_s` lack it: neither can calibrate.
        let r: ScaleReport = match serde_json::from_str(line) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("skipped a line that is not a completed run's report: {e}");
                continue;
            }
        };
        if !r.completed || r.spec.nemesis != Nemesis::None || r.compute_per_round_s <= 0.0 {
            continue;
        }
        let mut m = ScaleMeasurement::new(
            r.spec.workers,
            r.spec.shards,
            r.spec.hosts as u32,
            r.spec.rate_bps.map(|b| b as f64 / 1e9),
            r.round_s[0],
            r.stall_s,
            r.compute_per_round_s,
        );
        m.standbys = r.spec.standbys;
        m.quorum = r.spec.quorum;
        m.compute_cv = (r.compute_cv > 0.0).then_some(r.compute_cv);
        m.wire_bytes_per_param = r
            .wire_bytes_per_param
            .iter()
            .all(|&b| b > 0.0)
            .then_some(r.wire_bytes_per_param);
        runs.push(m);
        if r.compute_quantiles_s.len() >= 2 {
            let mut q = runs[runs.len() - 1].clone();
            q.compute_quantiles_s = Some(r.compute_quantiles_s.clone());
            quantile_runs.push(q);
        }
        if r.cores > 0 && r.worker_cpu_per_round_s > 0.0 {
            let mut shared = runs[runs.len() - 1].clone();
            shared.shared_cores = Some((r.cores, r.worker_cpu_per_round_s));
            shared_runs.push(shared);
        }
    }
    print_calibration(
        "each node on cores of its own, the measured wall time as compute",
        &runs,
    )?;
    let measured = tether_bench::predict::validate_measured(&runs)?;
    if !measured.is_empty() {
        println!();
        println!("each run with its own measured compute spread and wire bytes, nothing fitted:");
        print_checks(&measured, false);
    }
    let measured = tether_bench::predict::validate_measured(&quantile_runs)?;
    if !measured.is_empty() {
        println!();
        println!("each run with its own measured distribution of compute and wire bytes, nothing fitted:");
        print_checks(&measured, false);
    }
    if !shared_runs.is_empty() {
        println!();
        print_calibration(
            "every process on the machine's cores, the workers' CPU time as compute",
            &shared_runs,
        )?;
    }
    Ok(())
}

/// `simulate --what-it-takes`: the default sync at `workers` × `shards` under every combination of levers, and the
/// minimal sets that reach the efficiency goal.
fn what_it_takes(workers: u32, shards: u32) -> Result<()> {
    use tether_bench::predict;
    let t = std::time::Instant::now();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let rows = predict::what_it_takes(workers, shards, threads)?;
    println!(
        "{workers} workers × {shards} shards, the default sync and each combination of levers:\n"
    );
    print!("{}", predict::levers_markdown(&rows));
    println!(
        "\nThe minimal sets of levers reaching {} (none of their subsets does):",
        predict::EFFICIENCY_GOAL
    );
    for r in predict::minimal_lever_sets(&rows, predict::EFFICIENCY_GOAL) {
        let names: Vec<&str> = r.levers.iter().map(|l| l.name()).collect();
        println!(
            "- {} Gbit/s: {} ({:.2}, {})",
            r.link_gbit,
            names.join(" + "),
            r.efficiency,
            r.limit
        );
    }
    eprintln!(
        "{} points simulated in {:.1} s",
        rows.len(),
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Calibrates on the first of `runs`, validates on the others, and prints the table.
fn print_calibration(model: &str, runs: &[tether_bench::predict::ScaleMeasurement]) -> Result<()> {
    use tether_bench::predict::calibrate_runs;
    println!("{model}:");
    let (cv, checked) = calibrate_runs(runs)?;
    println!("compute spread fitted on the first run: cv {cv:.2}");
    print_checks(&checked, true);
    Ok(())
}

/// The calibration table: the first row is the calibration run when `first_fits`, every row a validation otherwise.
fn print_checks(checked: &[tether_bench::predict::CalibratedRun], first_fits: bool) {
    println!("| run | workers × shards | link | compute cv | round p50 measured / simulated | error | stall measured / simulated | error |");
    println!("|---|---|---|---|---|---|---|---|");
    for (i, c) in checked.iter().enumerate() {
        let m = &c.measured;
        println!(
            "| {} | {} × {} | {} | {} | {:.3} / {:.3} s | {:.0} % | {:.3} / {:.3} s | {:.0} % |",
            if i == 0 && first_fits {
                "calibration"
            } else {
                "validation"
            },
            m.workers,
            m.shards,
            m.link_gbit
                .map_or("unshaped".into(), |g| format!("{g} Gbit/s")),
            match (&m.compute_quantiles_s, m.compute_cv) {
                _ if first_fits => "fitted".into(),
                (Some(_), _) => "measured quantiles".into(),
                (None, Some(cv)) => format!("{cv:.2}"),
                (None, None) => "0.10".into(),
            },
            c.check.measured_round_s,
            c.check.sim_round_s,
            c.check.round_error * 100.0,
            c.check.measured_stall_s,
            c.check.sim_stall_s,
            c.check.stall_error * 100.0
        );
    }
}

fn sim_config(a: &SimArgs) -> Result<SimConfig> {
    let mut c = match &a.config {
        Some(p) => serde_json::from_str(&std::fs::read_to_string(p)?)?,
        None => study::prediction_base(),
    };
    if let Some(v) = a.workers {
        c.workers = v;
    }
    if let Some(v) = a.shards {
        c.shards = v;
    }
    if let Some(v) = a.params {
        c.params = v;
    }
    if let Some(v) = &a.staleness {
        c.staleness = if v == "inf" { None } else { Some(v.parse()?) };
    }
    if let Some(v) = a.rounds {
        c.rounds = v;
    }
    if let Some(v) = a.compute_s {
        c.compute_s = v;
    }
    if let Some(v) = a.link_gbit {
        c.link_bps = v * 1e9;
    }
    if let Some(s) = &a.straggle {
        let (p, f) = s
            .split_once(':')
            .ok_or_else(|| anyhow::anyhow!("--straggle P:F"))?;
        c.straggle = Some((p.parse()?, f.parse()?));
    }
    Ok(c)
}

fn main() {
    if let Err(e) = run() {
        eprintln!(
            "tether-bench: {}",
            tether_common::error_chain::ErrorChain(e.as_ref())
        );
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    tether_common::logging::init("warn");
    match Cli::parse().cmd {
        Cmd::Ingest { args, floors, json } => {
            let r = ingest::run(&args)?;
            ingest::print(&r);
            let f = if floors {
                let shard = (r.params / u64::from(args.shards)) as usize;
                let fl = floors::run(&floors::FloorArgs {
                    shard_params: shard,
                    scheme: args.scheme.clone(),
                    optimizer: args.optimizer.clone(),
                    seconds: 1.0,
                })?;
                println!();
                floors::print(&fl);
                fl
            } else {
                Vec::new()
            };
            if let Some(p) = json {
                std::fs::write(
                    p,
                    serde_json::to_string_pretty(&serde_json::json!({"ingest": r, "floors": f}))?,
                )?;
            }
        }
        Cmd::Floors { args, json } => {
            let f = floors::run(&args)?;
            floors::print(&f);
            if let Some(p) = json {
                std::fs::write(p, serde_json::to_string_pretty(&f)?)?;
            }
        }
        Cmd::Simulate { args } => {
            use tether_bench::predict;
            if let Some(path) = &args.calibrate {
                return calibrate(path);
            }
            if args.what_it_takes {
                return what_it_takes(args.workers.unwrap_or(1024), args.shards.unwrap_or(64));
            }
            if let Some(out) = &args.predict_default {
                let t = std::time::Instant::now();
                let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
                let rows = predict::predict_default(threads)?;
                print!("{}", predict::matrix(&rows));
                println!();
                print!(
                    "{}",
                    predict::flattening_markdown(&predict::flattening(&rows))
                );
                println!();
                print!("{}", predict::markdown(&rows));
                eprintln!(
                    "{} points simulated in {:.1} s",
                    rows.len(),
                    t.elapsed().as_secs_f64()
                );
                if out.extension().is_some_and(|e| e == "json") {
                    std::fs::write(out, serde_json::to_string_pretty(&rows)?)?;
                } else {
                    let plotted: Vec<plot::PredictionRow> = rows
                        .iter()
                        .map(|r| plot::PredictionRow {
                            workers: r.workers,
                            shards: r.shards,
                            link_gbit: r.link_gbit,
                            samples_per_s: r.samples_per_s,
                            rounds_per_s: r.samples_per_s
                                / (f64::from(predict::INNER_STEPS) * predict::BATCH as f64),
                            shard_cpu_util: r.shard_cpu_util,
                            shard_link_util: r.shard_link_util,
                            stall: 1.0 - r.efficiency,
                            limit: r.limit.clone(),
                        })
                        .collect();
                    plot::prediction(out, &plotted)?;
                }
                println!("wrote {}", out.display());
                return Ok(());
            }
            if args.default_sync {
                let (mut c, mut s) = predict::default_sync(
                    args.workers.unwrap_or(1024),
                    args.shards.unwrap_or(64),
                    args.link_gbit.unwrap_or(10.0),
                );
                if let Some(v) = args.params {
                    c.params = v;
                }
                if let Some(v) = args.rounds {
                    c.rounds = v;
                }
                if let Some(v) = args.compute_s {
                    c.compute_s = v;
                }
                if let Some(v) = args.quorum {
                    s.quorum = v;
                }
                if let Some(v) = args.shard_threads {
                    s.shard_threads = v;
                }
                if let Some(v) = args.hosts {
                    s.hosts = Some(v);
                }
                s.standbys = !args.no_standbys;
                let t = std::time::Instant::now();
                let row = predict::predict_point(&c, &s)?;
                println!("{}", serde_json::to_string_pretty(&row)?);
                eprintln!("simulated in {:.2} s", t.elapsed().as_secs_f64());
                return Ok(());
            }
            let c = sim_config(&args)?;
            if let Some(png) = &args.predict {
                let rows = study::predict(&c)?;
                study::print_prediction(&rows);
                plot::prediction(png, &rows)?;
                println!("plot: {}", png.display());
            } else {
                let t = std::time::Instant::now();
                let r = simulate(&c)?;
                println!("{}", serde_json::to_string_pretty(&r)?);
                eprintln!("simulated in {:.2} s", t.elapsed().as_secs_f64());
            }
        }
        Cmd::Study { args } => study::run(&args)?,
        Cmd::Scale { args } => scale(&args)?,
        Cmd::Hosts {
            hosts,
            rate_mbit,
            sample_ms,
            limit,
            json,
            command,
        } => {
            let spec = tether_bench::hosts::HostsSpec {
                hosts,
                rate_bps: rate_mbit.map(|m| m * 1_000_000),
                sample: std::time::Duration::from_millis(sample_ms.max(10)),
                command,
                limit: std::time::Duration::from_secs_f64(limit.max(1.0)),
            };
            let report = tether_bench::hosts::run(&spec)?;
            eprint!("{}", report.text());
            if let Some(p) = &json {
                tether_bench::hosts::append_json(p, &report)?;
            }
            if report.exit != Some(0) {
                anyhow::bail!("the command did not exit 0");
            }
        }
        Cmd::Curves {
            runs,
            curve,
            title,
            out,
        } => {
            let mut series = Vec::with_capacity(runs.len());
            for run in &runs {
                let (label, path) = run
                    .split_once('=')
                    .ok_or_else(|| anyhow::anyhow!("{run:?}: give LABEL=REPORT.json"))?;
                let report: serde_json::Value = serde_json::from_str(
                    &std::fs::read_to_string(path)
                        .map_err(|e| anyhow::anyhow!("cannot read report {path}: {e}"))?,
                )?;
                // Each point is [step, seconds, value].
                let points: Vec<(f64, f64)> = report
                    .get(&curve)
                    .and_then(|c| c.as_array())
                    .ok_or_else(|| anyhow::anyhow!("{path} has no {curve}"))?
                    .iter()
                    .filter_map(|p| Some((p.get(1)?.as_f64()?, p.get(2)?.as_f64()?)))
                    .collect();
                series.push((label.to_string(), points));
            }
            let y = curve.trim_end_matches("_curve").replace('_', " ");
            plot::lines(&out, &title, "wall time (s)", &y, &series, (false, false))?;
            println!("plot: {}", out.display());
        }
    }
    Ok(())
}

//! `tether-bench`: the evidence for Tether's claims (quinn's `perf` is the model).
//!
//! - `ingest`: real shards over real QUIC with synthetic pushers and pullers — ingest GB/s with the optimizer
//!   applied, pull GB/s, CPU-seconds per GB per side, p50/p99 latencies; table and `--json`.
//! - `floors`: memcpy, the optimizer kernel, the shard apply path, the codec and raw quinn, in the same process.
//! - `simulate`: the discrete-event simulator, one configuration or the 64–1,024-worker prediction grid.
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

//! The GPT on a Tether cluster against the same model trained in one plain process, on this machine: wall time to
//! the same validation loss. The single process takes `--batch` windows per step; the cluster's workers take
//! `--cluster-batch` each (default 4 × 4 workers = the single process's 16). Both use Adam with a warm-up–cosine
//! schedule over their own steps and evaluate the same validation windows equally often (every `--eval-windows`
//! training windows, all trainers together), so evaluation costs both the same. The single process is the model's own training loop (`Model::loss_and_grad` + Tether's Adam
//! kernel, both threads); the cluster is `LocalCluster` (loopback QUIC + mTLS, `--workers` × `--shards`, local-step
//! rounds with q4 pseudo-gradients and q4 delta pulls, the quickstart's mode), optionally for more passes
//! (`--cluster-epochs`). The target is the worse of the two final validation losses; the figure is cluster time /
//! single time to reach it. Prints a table and one JSON line.
//!
//! `cargo run --release --example gpt_cluster_vs_single -- --dataset kjv-excerpt`

use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;

use tether::common::config::{Config, DatasetKind, ModelKind, OptimizerKind, Schedule, Staleness};
use tether::common::optim::Optimizer;
use tether::worker::data::load_configured;
use tether::worker::model;
use tether::{loopback_servers, LocalCluster};

/// Cluster against single process, GPT, time to the same validation loss.
#[derive(Parser, Debug)]
struct Args {
    /// Workers of the cluster.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
    workers: u32,
    /// Shards of the cluster.
    #[arg(long, default_value_t = 2, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    shards: usize,
    /// Inner steps per round of the cluster (0: a q4 push every step under SSP s = 1).
    #[arg(long, default_value_t = 16)]
    local_steps: u32,
    /// Windows per step of each trainer (a worker, or the single process).
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Passes over the corpus of the single process.
    #[arg(long, default_value_t = 1)]
    epochs: u32,
    /// Windows per step of each worker (default 4: four workers then take the single process's 16 windows per
    /// step together; 16 each measured 1.60×, docs/transformer.md).
    #[arg(long, default_value_t = 4)]
    cluster_batch: usize,
    /// Passes over the corpus of the cluster.
    #[arg(long, default_value_t = 2)]
    cluster_epochs: u32,
    /// Corpus: kjv (falls back to the excerpt) | kjv-excerpt.
    #[arg(long, default_value = "kjv-excerpt")]
    dataset: DatasetKind,
    /// Evaluate after every this many training windows (all trainers together).
    #[arg(long, default_value_t = 8192)]
    eval_windows: usize,
    /// Peak learning rate of Adam (the cluster's inner optimizer).
    #[arg(long, default_value_t = 2e-3)]
    lr: f32,
}

/// `(seconds, validation loss)` points.
type Curve = Vec<(f64, f64)>;

/// First time the curve is at or below `target` (linear between points), if ever.
fn time_to(curve: &Curve, target: f64) -> Option<f64> {
    let mut prev: Option<(f64, f64)> = None;
    for &(t, l) in curve {
        if l <= target {
            return Some(match prev {
                Some((t0, l0)) if l0 > l => t0 + (t - t0) * (l0 - target) / (l0 - l),
                _ => t,
            });
        }
        prev = Some((t, l));
    }
    None
}

fn config(args: &Args) -> Config {
    let mut cfg = Config::with_servers(loopback_servers(args.shards));
    cfg.cluster.workers = args.workers;
    cfg.model.kind = ModelKind::Gpt;
    cfg.data.dataset = args.dataset;
    cfg.train.batch = args.batch;
    cfg.train.epochs = args.epochs;
    cfg.train.local_steps = args.local_steps;
    cfg.cluster.staleness = Staleness::Bounded(if args.local_steps > 0 { 0 } else { 1 });
    cfg.optimizer.kind = OptimizerKind::Adam;
    cfg.optimizer.lr = args.lr;
    cfg.optimizer.outer.momentum = 0.5;
    cfg.optimizer.schedule = Schedule::WarmupCosine {
        warmup: 100,
        total: 0,
        min_ratio: 0.01,
    };
    cfg.checkpoint.every_updates = 0;
    cfg
}

fn single(args: &Args, cfg: &mut Config) -> Result<Curve> {
    let (train, val, note) = load_configured(cfg)?;
    if let Some(n) = note {
        println!("note: {n}");
    }
    let mut m = model::build_for(cfg)?;
    let t = m.features();
    let mut p = m.layout().init_all(cfg.model.seed);
    let mut g = vec![0.0; p.len()];
    let b = args.batch;
    let steps = (train.len() / b) as u64 * u64::from(args.epochs);
    let mut ocfg = cfg.optimizer.clone();
    ocfg.schedule = Schedule::WarmupCosine {
        warmup: 100,
        total: steps,
        min_ratio: 0.01,
    };
    let mut opt = Optimizer::new(&ocfg, p.len());
    // The same shuffled order a one-worker partition would visit.
    let part = tether::worker::data::Partition::new(train.len(), 0, 1, cfg.train.seed)?;
    let eval_every = (args.eval_windows / b).max(1) as u64;
    let started = Instant::now();
    let mut curve = Vec::new();
    let mut order = Vec::new();
    let per_epoch = (train.len() / b) as u64;
    for s in 0..steps {
        let within = (s % per_epoch) as usize;
        if within == 0 {
            order = part.epoch_order(s / per_epoch);
        }
        let (mut x, mut y) = (Vec::with_capacity(b * t), Vec::with_capacity(b));
        for &i in &order[within * b..(within + 1) * b] {
            x.extend_from_slice(train.row(i));
            y.push(train.y[i]);
        }
        let loss = m.loss_and_grad(&p, &x, &y, &mut g);
        if loss.is_finite() {
            opt.step(&mut p, &g, 1.0);
        }
        if (s + 1) % eval_every == 0 || s + 1 == steps {
            let v = model::mean_loss(m.as_mut(), &p, &val.x, &val.y, 256);
            curve.push((started.elapsed().as_secs_f64(), f64::from(v)));
        }
    }
    Ok(curve)
}

fn main() {
    if let Err(e) = run() {
        eprintln!(
            "gpt_cluster_vs_single: {}",
            tether::common::error_chain::ErrorChain(e.as_ref())
        );
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    tether::common::logging::init("warn");
    let args = Args::parse();
    let mut cfg = config(&args);
    cfg.validate()?;
    let mut single_cfg = cfg.clone();
    single_cfg.cluster.workers = 1;
    println!(
        "single process: the GPT's own loop, batch {}, Adam",
        args.batch
    );
    let s = single(&args, &mut single_cfg).context("single-process run")?;
    println!(
        "cluster: {} workers x {} shards, local steps {}, q4",
        cfg.cluster.workers,
        cfg.cluster.servers.len(),
        args.local_steps
    );
    cfg.train.epochs = args.cluster_epochs;
    cfg.train.batch = args.cluster_batch;
    // Evaluation cadence in windows of all trainers together: worker 0 evaluates every eval_every of its steps.
    cfg.train.eval_every =
        (args.eval_windows / (cfg.train.batch * cfg.cluster.workers as usize)).max(1) as u64;
    let dir = tempfile::tempdir()?;
    let report = LocalCluster::new(cfg, dir.path().to_path_buf()).run()?;
    let c: Curve = report.val_loss_curve.iter().map(|p| (p.1, p.2)).collect();
    let (sf, cf) = (
        s.last().map_or(f64::NAN, |p| p.1),
        c.last().map_or(f64::NAN, |p| p.1),
    );
    // The single process's final loss when the cluster gets there, else the cluster's (the worse of the two).
    let target = sf.max(cf);
    let (ts, tc) = (time_to(&s, target), time_to(&c, target));
    println!("\n| run | final val loss | wall s | s to {target:.4} |\n|---|---|---|---|");
    println!(
        "| single process | {sf:.4} | {:.1} | {:.1} |",
        s.last().map_or(0.0, |p| p.0),
        ts.unwrap_or(f64::NAN)
    );
    println!(
        "| {}x{} cluster | {cf:.4} | {:.1} | {:.1} |",
        args.workers,
        args.shards,
        report.wall_seconds,
        tc.unwrap_or(f64::NAN)
    );
    let ratio = match (ts, tc) {
        (Some(a), Some(b)) if a > 0.0 => b / a,
        _ => f64::NAN,
    };
    println!("cluster / single, time to the same validation loss: {ratio:.2}x");
    println!(
        "{}",
        serde_json::json!({
            "target_val_loss": target,
            "single_final": sf, "cluster_final": cf,
            "single_seconds_to_target": ts, "cluster_seconds_to_target": tc,
            "ratio": ratio,
            "single_curve": s, "cluster_curve": c,
            "workers": args.workers, "shards": args.shards, "local_steps": args.local_steps,
            "dataset": report.dataset,
        })
    );
    Ok(())
}

//! The main job: train an MLP on Fashion-MNIST (or the embedded digits set when it is not installed) — or, with
//! `--model gpt`, a byte-level GPT on the King James Bible (or its embedded excerpt) — with M shards and N workers in
//! one process, talking over loopback QUIC with mutual TLS, 4-bit gradients with error feedback and
//! bounded staleness. Shows progress, ends with a summary table, optionally writes the JSON report and a PNG plot.
//!
//! `cargo run --release --example quickstart -- --help`

use std::collections::HashMap;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use tokio::sync::mpsc;

use tether::common::codec::Scheme;
use tether::common::config::{Config, DatasetKind, ModelKind, OptimizerKind, Schedule, Staleness};
use tether::common::report::RunReport;
use tether::{loopback_servers, LocalCluster};

/// Train on a local Tether cluster (M shards, N workers, loopback QUIC + mTLS).
#[derive(Parser, Debug)]
#[command(name = "quickstart")]
struct Args {
    /// Number of workers.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
    workers: u32,
    /// Number of parameter shards.
    #[arg(long, default_value_t = 2, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    shards: usize,
    /// Staleness bound in push rounds: 0 = BSP, N = SSP, inf = fully asynchronous (default: 0 with local steps, whose
    /// round is 16 steps long; 3 with a push every step).
    #[arg(long)]
    staleness: Option<Staleness>,
    /// Gradient compression: none | fp16 | bf16 | q8 | q4 | q2 | topk2 (block top-k, 2-bit values; the default,
    /// or q4 with --model gpt).
    #[arg(long)]
    compression: Option<Scheme>,
    /// Values per codec bucket (default 4096 with topk2, else 512; topk2's top-k block, at most 65536).
    #[arg(long)]
    bucket: Option<usize>,
    /// topk2 keeps one value in KEEP per bucket (a power of two, 2..=32768).
    #[arg(long, default_value_t = 16)]
    keep: u32,
    /// Disable error feedback.
    #[arg(long)]
    no_error_feedback: bool,
    /// Turn off zstd over the packed gradients.
    #[arg(long)]
    no_zstd: bool,
    /// How to pull: delta (compressed deltas of the shards' public copies, error feedback on the shards), bf16 or
    /// f32 (the whole model every step).
    #[arg(long, default_value = "delta")]
    pull: String,
    /// Codec of pull deltas: q8 | q4 | none | topk2 (default: topk2 when pushes are topk2, else q4).
    #[arg(long)]
    pull_scheme: Option<Scheme>,
    /// Local-step rounds (DiLoCo): inner steps per push round (0: push a gradient every step). The default, 16, is
    /// what one 100 Mbit/s link shared by the whole run needs to stay compute-bound (docs/pulls-and-local-steps.md).
    #[arg(long, default_value_t = 16)]
    local_steps: u32,
    /// Link-aware local steps: each worker may grow H from --local-steps up to this bound until communication is at
    /// most a fifth of a round (0: H pinned).
    #[arg(long, default_value_t = 0)]
    local_steps_max: u32,
    /// Streamed fragments (Streaming DiLoCo): each round pushes 1/F of every shard after H/F inner steps, and its
    /// pull overlaps the next inner steps (1: the whole model every H steps).
    #[arg(long, default_value_t = 1)]
    fragments: u32,
    /// Outer (Nesterov) learning rate of local-step rounds (default 1.4 with topk2, else 0.7: sparse pushes deliver
    /// their mass late, docs/links.md).
    #[arg(long)]
    outer_lr: Option<f32>,
    /// Outer (Nesterov) momentum of local-step rounds (DiLoCo's 0.9 is worse here: docs/pulls-and-local-steps.md).
    #[arg(long, default_value_t = 0.5)]
    outer_momentum: f32,
    /// Epochs (passes over each worker's partition; default 30, or 1 with --model gpt).
    #[arg(long)]
    epochs: Option<u32>,
    /// Model: mlp | logreg | gpt (a byte-level transformer; see --layers --heads --dim --context --precision).
    #[arg(long, default_value = "mlp")]
    model: String,
    /// GPT: transformer blocks.
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// GPT: attention heads.
    #[arg(long, default_value_t = 4)]
    heads: usize,
    /// GPT: embedding width.
    #[arg(long, default_value_t = 128)]
    dim: usize,
    /// GPT: context in bytes.
    #[arg(long, default_value_t = 64)]
    context: usize,
    /// Workers' compute precision: f32 | bf16 | f16 (bf16/f16 with dynamic loss scaling; GPT only).
    #[arg(long, default_value = "f32")]
    precision: tether::common::config::ComputePrecision,
    /// Dataset: fashion-mnist | digits | idx | csv | libsvm | kjv | kjv-excerpt | text (default: fashion-mnist, or
    /// kjv with --model gpt).
    #[arg(long)]
    dataset: Option<DatasetKind>,
    /// Dataset directory or file (default: /usr/share/datasets/fashion-mnist).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Most steps per worker (0: no cap; `--epochs` passes).
    #[arg(long, default_value_t = 0)]
    max_steps: u64,
    /// Optimizer: sgd | momentum | nesterov | adam | adamw | adagrad (default adam, or adamw with --model gpt:
    /// nanoGPT's recipe, betas 0.9/0.99, weight decay 0.1 on matrices only, clip 1.0, cosine to lr/10).
    #[arg(long)]
    optimizer: Option<String>,
    /// Learning rate (default 1e-3, or 2e-3 with --model gpt).
    #[arg(long)]
    lr: Option<f32>,
    /// Weight decay (L2 for adam/sgd-family, decoupled for adamw; default 0, or 0.1 with --model gpt).
    #[arg(long)]
    weight_decay: Option<f32>,
    /// Compute threads per worker (default 0: the cores shared equally among the workers).
    #[arg(long, default_value_t = 0)]
    threads: u32,
    /// Learning-rate schedule: cosine (linear warmup, then cosine decay over the run) or constant.
    #[arg(long, default_value = "cosine")]
    schedule: String,
    /// Per-worker batch size (default 128, or 4 windows with --model gpt: 4 workers then take 16 together).
    #[arg(long)]
    batch: Option<usize>,
    /// Hidden layer widths, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "256,128")]
    hidden: Vec<usize>,
    /// Evaluate every this many steps of worker 0 (default 100, or 512 with --model gpt).
    #[arg(long)]
    eval_every: Option<u64>,
    /// Seed of the initial weights.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Write the JSON run report here.
    #[arg(long)]
    report: Option<PathBuf>,
    /// Write a PNG of loss and accuracy over time here.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Working directory for certificates and checkpoints (default: a temporary directory).
    #[arg(long)]
    work_dir: Option<PathBuf>,
    /// Loss-spike rollback (`[rollback]` with its defaults): the shards roll back together to a snapshot from before
    /// a spike (docs/rollback.md).
    #[arg(long)]
    rollback: bool,
}

fn main() {
    cap_malloc_arenas();
    if let Err(e) = run() {
        eprintln!(
            "quickstart: {}",
            tether::common::error_chain::ErrorChain(e.as_ref())
        );
        std::process::exit(1);
    }
}

/// Caps glibc's malloc arenas at 2 for this process (a choice of this program, not of the library it embeds): the
/// quickstart runs every worker's compute pool, the shards and the transport on a dozen threads of one process, and
/// per-thread arenas held 75 MB more at the peak (457 against 383 MB, `--model gpt --max-steps 300`).
fn cap_malloc_arenas() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets a malloc tunable; it is called before any other thread exists, and M_ARENA_MAX
    // takes any positive count. Its result (0 on failure) only means the default stays.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
}

fn run() -> Result<()> {
    tether::common::logging::init("warn");
    let args = Args::parse();
    let kind = match args.model.as_str() {
        "mlp" => ModelKind::Mlp,
        "logreg" => ModelKind::Logreg,
        "gpt" => ModelKind::Gpt,
        o => anyhow::bail!("unknown model {o:?} (mlp|logreg|gpt)"),
    };
    let gpt = kind == ModelKind::Gpt;
    let mut cfg = Config::with_servers(loopback_servers(args.shards));
    cfg.cluster.workers = args.workers;
    cfg.cluster.staleness = args.staleness.unwrap_or(if args.local_steps > 0 {
        Staleness::Bounded(0)
    } else {
        Staleness::Bounded(3)
    });
    let scheme = args
        .compression
        .unwrap_or(if gpt { Scheme::Q4 } else { Scheme::Topk2 });
    cfg.compression.scheme = scheme;
    cfg.compression.error_feedback = !args.no_error_feedback;
    cfg.compression.zstd = !args.no_zstd;
    match args.pull.as_str() {
        "delta" => cfg.compression.pull = tether::common::config::PullKind::Delta,
        "bf16" => {
            cfg.compression.pull = tether::common::config::PullKind::Full;
            cfg.compression.pull_bf16 = true;
        }
        "f32" => cfg.compression.pull = tether::common::config::PullKind::Full,
        o => anyhow::bail!("unknown pull mode {o:?} (delta|bf16|f32)"),
    }
    cfg.compression.pull_scheme = args.pull_scheme.unwrap_or(if scheme.is_sparse() {
        Scheme::Topk2
    } else {
        Scheme::Q4
    });
    let sparse = scheme.is_sparse() || cfg.compression.pull_scheme.is_sparse();
    cfg.compression.bucket = args.bucket.unwrap_or(if sparse { 4096 } else { 512 });
    cfg.compression.keep = args.keep;
    cfg.train.epochs = args.epochs.unwrap_or(if gpt { 1 } else { 30 });
    cfg.train.local_steps = args.local_steps;
    cfg.train.local_steps_max = args.local_steps_max;
    cfg.train.fragments = args.fragments;
    cfg.train.max_steps = args.max_steps;
    cfg.optimizer.outer.lr = args
        .outer_lr
        .unwrap_or(if scheme.is_sparse() { 1.4 } else { 0.7 });
    cfg.optimizer.outer.momentum = args.outer_momentum;
    cfg.train.batch = args.batch.unwrap_or(if gpt { 4 } else { 128 });
    cfg.train.eval_every = args.eval_every.unwrap_or(if gpt { 512 } else { 100 });
    cfg.train.precision = args.precision;
    cfg.model.kind = kind;
    cfg.model.layers = args.layers;
    cfg.model.heads = args.heads;
    cfg.model.dim = args.dim;
    cfg.model.context = args.context;
    cfg.model.hidden = args.hidden.clone();
    cfg.rollback.enabled = args.rollback;
    cfg.model.seed = args.seed;
    let dataset = args.dataset.unwrap_or(if gpt {
        DatasetKind::Kjv
    } else {
        DatasetKind::FashionMnist
    });
    cfg.data.dataset = dataset;
    if let Some(d) = &args.data_dir {
        cfg.data.path = d.clone();
    } else if dataset == DatasetKind::Digits || dataset.is_text() {
        cfg.data.path = PathBuf::new();
    }
    let optimizer = args
        .optimizer
        .as_deref()
        .unwrap_or(if gpt { "adamw" } else { "adam" });
    cfg.optimizer.kind = parse_optimizer(optimizer)?;
    cfg.optimizer.lr = args.lr.unwrap_or(if gpt { 2e-3 } else { 1e-3 });
    cfg.optimizer.weight_decay = args.weight_decay.unwrap_or(if gpt { 0.1 } else { 0.0 });
    cfg.train.threads = args.threads;
    if gpt {
        // nanoGPT's CPU recipe for the inner optimizer (docs/transformer.md#the-recipe).
        cfg.optimizer.beta2 = 0.99;
        cfg.optimizer.decay = tether::common::config::DecayScope::Matrices;
        cfg.train.clip_norm = 1.0;
    }
    cfg.optimizer.schedule = match args.schedule.as_str() {
        "constant" => Schedule::Constant,
        // total = 0: LocalCluster stretches the cosine over the whole run.
        "cosine" => Schedule::WarmupCosine {
            warmup: 100,
            total: 0,
            min_ratio: if gpt { 0.1 } else { 0.01 },
        },
        o => anyhow::bail!("unknown schedule {o:?} (cosine|constant)"),
    };
    cfg.checkpoint.every_updates = 0;
    cfg.validate()?;

    let tmp = tempfile::tempdir().context("cannot create a temporary directory")?;
    let work_dir = args
        .work_dir
        .clone()
        .unwrap_or_else(|| tmp.path().to_path_buf());
    std::fs::create_dir_all(&work_dir)
        .with_context(|| format!("cannot create {}", work_dir.display()))?;

    let sync = if cfg.train.local_steps > 0 {
        format!(
            "local steps: {} inner steps per round (DiLoCo{}{}), outer nesterov lr {} momentum {}",
            cfg.train.local_steps,
            if cfg.train.local_steps_max > cfg.train.local_steps {
                format!(", link-aware up to {}", cfg.train.local_steps_max)
            } else {
                String::new()
            },
            if cfg.train.fragments > 1 {
                format!(", streamed in {} fragments", cfg.train.fragments)
            } else {
                String::new()
            },
            cfg.optimizer.outer.lr,
            cfg.optimizer.outer.momentum
        )
    } else {
        "a gradient push every step".to_string()
    };
    println!(
        "Tether quickstart: {} workers, {} shards, staleness {}, {sync}, compression {}{}{}, {} pulls, {} epochs",
        cfg.cluster.workers,
        cfg.cluster.servers.len(),
        cfg.cluster.staleness,
        if cfg.compression.scheme.is_sparse() {
            format!("{} (1 in {} per {})", cfg.compression.scheme, cfg.compression.keep, cfg.compression.bucket)
        } else {
            cfg.compression.scheme.to_string()
        },
        if cfg.compression.error_feedback {
            " + error feedback"
        } else {
            ""
        },
        if cfg.compression.zstd { " + zstd" } else { "" },
        RunReport::for_config(&cfg).pull,
        cfg.train.epochs
    );
    for w in cfg.warnings() {
        println!("warning: {w}");
    }
    let (tx, rx) = mpsc::unbounded_channel();
    let mut cluster = LocalCluster::new(cfg.clone(), work_dir);
    cluster.progress = Some(tx);
    let ui = std::thread::spawn(move || show_progress(rx));
    let report = cluster.run();
    let _ = ui.join();
    let report = report?;
    for n in &report.notes {
        println!("note: {n}");
    }
    print_summary(&report);
    if let Some(p) = &args.report {
        report
            .write_json(p)
            .with_context(|| format!("cannot write {}", p.display()))?;
        println!("report: {}", p.display());
    }
    if let Some(p) = &args.plot {
        plot(&report, p).with_context(|| format!("cannot write {}", p.display()))?;
        println!("plot: {}", p.display());
    }
    Ok(())
}

fn parse_optimizer(s: &str) -> Result<OptimizerKind> {
    Ok(match s {
        "sgd" => OptimizerKind::Sgd,
        "momentum" => OptimizerKind::Momentum,
        "nesterov" => OptimizerKind::Nesterov,
        "adam" => OptimizerKind::Adam,
        "adamw" => OptimizerKind::Adamw,
        "adagrad" => OptimizerKind::Adagrad,
        o => anyhow::bail!("unknown optimizer {o:?} (sgd|momentum|nesterov|adam|adamw|adagrad)"),
    })
}

fn show_progress(mut rx: mpsc::UnboundedReceiver<tether::worker::Progress>) {
    let tty = std::io::stderr().is_terminal();
    let mut tally = StepTally::default();
    let (mut wire, mut fp32) = (0u64, 0u64);
    let mut loss_ema: Option<f32> = None;
    let mut acc: Option<f32> = None;
    let started = Instant::now();
    let mut last_line = Instant::now();
    let bar = tty.then(|| {
        let b = ProgressBar::new(0);
        b.set_style(
            // Inner steps in local-step rounds, where one event reports a whole round.
            ProgressStyle::with_template("{bar:30} {pos}/{len} steps {per_sec} eta {eta} {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        b
    });
    while let Some(p) = rx.blocking_recv() {
        if tally.record(p.rank, p.step, p.total) {
            if let Some(b) = &bar {
                b.set_length(tally.total());
            }
        }
        let done = tally.done();
        wire += p.wire_bytes;
        fp32 += p.fp32_bytes;
        if p.loss.is_finite() {
            loss_ema = Some(loss_ema.map_or(p.loss, |l| 0.95 * l + 0.05 * p.loss));
        }
        if p.accuracy.is_some() {
            acc = p.accuracy;
        }
        let ratio = if wire > 0 {
            fp32 as f64 / wire as f64
        } else {
            0.0
        };
        let msg = format!(
            "loss {:.4}  acc {}  compression {:.1}x",
            loss_ema.unwrap_or(f32::NAN),
            acc.map_or("-".to_string(), |a| format!("{a:.4}")),
            ratio
        );
        match &bar {
            Some(b) => {
                b.set_position(done);
                b.set_message(msg);
            }
            None if last_line.elapsed().as_secs() >= 5 => {
                last_line = Instant::now();
                let total = tally.total();
                eprintln!(
                    "[{:6.1}s] step {done}/{total} ({:.0} steps/s)  {msg}",
                    started.elapsed().as_secs_f64(),
                    done as f64 / started.elapsed().as_secs_f64()
                );
            }
            None => {}
        }
    }
    if let Some(b) = bar {
        b.finish_and_clear();
    }
}

/// Steps done and to do, summed over the workers, in one unit: steps (inner steps in local-step rounds). A progress
/// event reports a worker's steps so far, which a local-step round advances by all its inner steps at once.
#[derive(Debug, Default)]
struct StepTally {
    /// Per rank: (steps done, steps it will run).
    ranks: HashMap<u32, (u64, u64)>,
}

impl StepTally {
    /// Records that `rank` has done `step` of its `total` steps; returns whether the overall total changed.
    fn record(&mut self, rank: u32, step: u64, total: u64) -> bool {
        let before = self.total();
        let entry = self.ranks.entry(rank).or_default();
        *entry = (entry.0.max(step), total);
        self.total() != before
    }

    /// Steps done by all workers.
    fn done(&self) -> u64 {
        self.ranks.values().map(|r| r.0).sum()
    }

    /// Steps all workers will run.
    fn total(&self) -> u64 {
        self.ranks.values().map(|r| r.1).sum()
    }
}

fn print_summary(r: &RunReport) {
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    let rows = [
        ("dataset", r.dataset.clone()),
        ("model", format!("{} ({} params)", r.model, r.params)),
        ("workers x shards", format!("{} x {}", r.workers, r.shards)),
        ("staleness bound", r.staleness_bound.clone()),
        (
            "sync",
            if r.local_steps > 0 {
                format!("local steps, {} inner steps per push round", r.local_steps)
            } else {
                "a push every step".into()
            },
        ),
        ("compression", r.compression.clone()),
        ("steps (all workers)", r.steps.to_string()),
        ("wall time", format!("{:.1} s", r.wall_seconds)),
        ("final train loss", format!("{:.4}", r.final_train_loss)),
        (
            if r.final_bits_per_char.is_some() {
                "final next-byte accuracy"
            } else {
                "final test accuracy"
            },
            format!("{:.4}", r.final_test_accuracy),
        ),
        (
            "final validation loss",
            match (r.final_val_loss, r.final_bits_per_char) {
                (Some(l), Some(b)) => format!("{l:.4} nats/byte = {b:.3} bits per character"),
                (Some(l), None) => format!("{l:.4}"),
                _ => "-".into(),
            },
        ),
        (
            "precision",
            if r.precision == "f32" || r.precision.is_empty() {
                "f32".to_string()
            } else {
                format!(
                    "{} (loss scale {}, {} overflow skips, {} growths)",
                    r.precision,
                    r.final_loss_scale.unwrap_or(f64::NAN),
                    r.loss_scale_overflows,
                    r.loss_scale_growths
                )
            },
        ),
        (
            "pushed only: wire vs fp32",
            format!(
                "{:.1} MiB vs {:.1} MiB ({:.1}x fewer)",
                mib(r.wire_bytes_pushed),
                mib(r.fp32_bytes_pushed),
                1.0 / r.push_ratio().max(1e-12)
            ),
        ),
        (
            "pulled: wire vs fp32",
            format!(
                "{:.1} MiB vs {:.1} MiB ({})",
                mib(r.wire_bytes_pulled),
                mib(r.fp32_bytes_pulled),
                r.pull
            ),
        ),
        (
            "both directions vs fp32 sync",
            format!(
                "{:.1} MiB vs {:.1} MiB ({:.1}x fewer)",
                mib(r.wire_bytes_total()),
                mib(r.fp32_bytes_total()),
                r.total_reduction()
            ),
        ),
        (
            "updates applied / rejected",
            format!("{} / {}", r.updates_applied, r.updates_rejected),
        ),
        (
            "max clock lead (bound)",
            format!("{} ({})", r.max_clock_lead_observed, r.staleness_bound),
        ),
        (
            "max staleness (updates)",
            r.max_staleness_observed.to_string(),
        ),
        (
            "loss-spike rollbacks (rounds lost)",
            format!("{} ({})", r.rollbacks, r.rounds_lost),
        ),
    ];
    let w = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    println!("\n{:-<1$}", "", w + 40);
    for (k, v) in rows {
        println!("{k:<w$}  {v}");
    }
    println!("{:-<1$}", "", w + 40);
}

fn plot(r: &RunReport, path: &Path) -> Result<()> {
    use plotters::prelude::*;
    let font = ["/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"]
        .iter()
        .find_map(|p| std::fs::read(p).ok());
    let has_font = match font {
        Some(bytes) => {
            let leaked: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            plotters::style::register_font("sans-serif", FontStyle::Normal, leaked).is_ok()
        }
        None => false,
    };
    let root = BitMapBackend::new(path, (1000, 420)).into_drawing_area();
    root.fill(&WHITE)?;
    let (left, right) = root.split_horizontally(500);
    let tmax = r
        .loss_curve
        .iter()
        .map(|p| p.1)
        .chain(r.accuracy_curve.iter().map(|p| p.1))
        .fold(1e-3, f64::max);
    let lmax = r
        .loss_curve
        .iter()
        .map(|p| p.2)
        .filter(|l| l.is_finite())
        .fold(0.1, f64::max);
    let mut loss = ChartBuilder::on(&left);
    loss.margin(15);
    if has_font {
        loss.caption(
            "loss: training (blue), validation (red)",
            ("sans-serif", 18),
        )
        .x_label_area_size(30)
        .y_label_area_size(45);
    }
    let mut loss = loss.build_cartesian_2d(0.0..tmax, 0.0..lmax)?;
    if has_font {
        loss.configure_mesh().x_desc("seconds").draw()?;
    }
    loss.draw_series(LineSeries::new(
        r.loss_curve.iter().map(|p| (p.1, p.2)),
        &BLUE,
    ))?;
    // Validation loss (red): the evaluating worker's points and the final model.
    let val = r.val_loss_curve.iter().filter(|p| p.2.is_finite());
    loss.draw_series(LineSeries::new(
        val.clone().map(|p| (p.1, p.2.min(lmax))),
        &RED,
    ))?;
    loss.draw_series(val.map(|p| Circle::new((p.1, p.2.min(lmax)), 3, RED.filled())))?;
    if r.final_bits_per_char.is_some() {
        // Text: bits per character of the validation split.
        let bpc: Vec<(f64, f64)> = r
            .val_loss_curve
            .iter()
            .filter(|p| p.2.is_finite())
            .map(|p| (p.1, p.2 / std::f64::consts::LN_2))
            .collect();
        let bmax = bpc.iter().map(|p| p.1).fold(1.0, f64::max);
        let mut b = ChartBuilder::on(&right);
        b.margin(15);
        if has_font {
            b.caption("validation bits per character", ("sans-serif", 18))
                .x_label_area_size(30)
                .y_label_area_size(45);
        }
        let mut b = b.build_cartesian_2d(0.0..tmax, 0.0..bmax)?;
        if has_font {
            b.configure_mesh().x_desc("seconds").draw()?;
        }
        b.draw_series(LineSeries::new(bpc.iter().copied(), &RED))?;
        b.draw_series(bpc.iter().map(|&p| Circle::new(p, 3, RED.filled())))?;
        root.present()?;
        return Ok(());
    }
    let mut acc = ChartBuilder::on(&right);
    acc.margin(15);
    if has_font {
        acc.caption("test accuracy", ("sans-serif", 18))
            .x_label_area_size(30)
            .y_label_area_size(45);
    }
    let amin = r
        .accuracy_curve
        .iter()
        .map(|p| p.2)
        .fold(1.0, f64::min)
        .min(0.5);
    let mut acc = acc.build_cartesian_2d(0.0..tmax, amin..1.0)?;
    if has_font {
        acc.configure_mesh().x_desc("seconds").draw()?;
    }
    acc.draw_series(LineSeries::new(
        r.accuracy_curve.iter().map(|p| (p.1, p.2)),
        &RED,
    ))?;
    acc.draw_series(
        r.accuracy_curve
            .iter()
            .map(|p| Circle::new((p.1, p.2), 3, RED.filled())),
    )?;
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::{Args, StepTally};

    #[test]
    fn zero_workers_or_shards_are_refused_not_rounded_up() {
        for flag in ["--workers", "--shards"] {
            let err = Args::try_parse_from(["quickstart", flag, "0"]).unwrap_err();
            let text = err.to_string();
            assert!(text.contains(flag) && text.contains("'0'"), "{text}");
        }
        let args = Args::try_parse_from(["quickstart", "--workers", "1", "--shards", "1"]).unwrap();
        assert_eq!((args.workers, args.shards), (1, 1));
    }

    #[test]
    fn local_step_rounds_count_inner_steps_and_the_run_ends_at_its_total() {
        // 2 workers, 40 inner steps each, rounds of 16: events at steps 16, 32 and 40 (the short last round).
        let mut tally = StepTally::default();
        assert!(tally.record(0, 16, 40));
        assert!(tally.record(1, 16, 40));
        assert_eq!((tally.done(), tally.total()), (32, 80));
        assert!(!tally.record(0, 32, 40));
        assert_eq!(tally.done(), 48);
        for rank in 0..2 {
            tally.record(rank, 40, 40);
        }
        assert_eq!(tally.done(), tally.total());
        // A push every step: one event per step.
        let mut every = StepTally::default();
        for step in 1..=5 {
            every.record(7, step, 5);
        }
        assert_eq!((every.done(), every.total()), (5, 5));
    }
}

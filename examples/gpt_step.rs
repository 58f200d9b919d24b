//! CPU step time of the built-in GPT (candle through Tether's `Model` trait), for the side-by-side comparison with
//! PyTorch in `scripts/gpt_cpu_bench.sh`: forward + backward of one batch of byte windows (what a worker computes),
//! and the same plus an Adam update of the flat parameters (what a single process does per step). Prints one JSON
//! line with the same keys as `scripts/gpt_torch.py`.
//!
//! `cargo run --release --example gpt_step -- --batch 12 --threads 2 --steps 30 --json`

use std::time::Instant;

use anyhow::Result;
use clap::Parser;

use tether::common::config::{ComputePrecision, OptimizerConfig, OptimizerKind, Schedule};
use tether::common::layout::GptShape;
use tether::common::optim::Optimizer;
use tether::worker::data::{kjv_excerpt, windows};
use tether::worker::model::{gpt_model, Model};

/// Time the GPT's CPU step.
#[derive(Parser, Debug)]
struct Args {
    /// Windows per batch.
    #[arg(long, default_value_t = 12)]
    batch: usize,
    /// Compute threads (candle's matmuls read RAYON_NUM_THREADS).
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Timed steps.
    #[arg(long, default_value_t = 30)]
    steps: usize,
    /// Untimed warm-up steps.
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Context in bytes.
    #[arg(long, default_value_t = 64)]
    context: usize,
    /// Compute precision: f32 | bf16 | f16.
    #[arg(long, default_value = "f32")]
    dtype: ComputePrecision,
    /// Print one JSON line instead of a sentence.
    #[arg(long)]
    json: bool,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn pct(v: &[f64], q: f64) -> f64 {
    // `v` is sorted by `median`.
    v[((v.len() - 1) as f64 * q).round() as usize]
}

fn main() {
    if let Err(e) = run() {
        eprintln!(
            "gpt_step: {}",
            tether::common::error_chain::ErrorChain(e.as_ref())
        );
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let args = Args::parse();
    // Before the first candle op: candle sizes its matmul thread pool from this variable.
    std::env::set_var("RAYON_NUM_THREADS", args.threads.max(1).to_string());
    let shape = GptShape {
        vocab: 256,
        context: args.context,
        layers: 4,
        heads: 4,
        dim: 128,
    };
    let mut model = gpt_model(shape, args.dtype)?;
    let n = model.layout().len();
    let mut params = model.layout().init_all(42);
    let mut grad = vec![0.0f32; n];
    let text = kjv_excerpt()?;
    let data = windows(&text, args.context);
    let t = args.context;
    let b = args.batch.clamp(1, data.len());
    let mut opt = Optimizer::new(
        &OptimizerConfig {
            kind: OptimizerKind::Adam,
            lr: 1e-3,
            schedule: Schedule::Constant,
            ..OptimizerConfig::default()
        },
        n,
    );
    let (mut fwd_bwd, mut step) = (Vec::new(), Vec::new());
    let mut loss = f32::NAN;
    for s in 0..args.warmup + args.steps {
        let first = (s * b) % (data.len() - b);
        let x = &data.x[first * t..(first + b) * t];
        let y = &data.y[first..first + b];
        let t0 = Instant::now();
        loss = model.loss_and_grad(&params, x, y, &mut grad);
        let t1 = Instant::now();
        opt.step(&mut params, &grad, 1.0);
        let t2 = Instant::now();
        if s >= args.warmup {
            fwd_bwd.push((t1 - t0).as_secs_f64() * 1e3);
            step.push((t2 - t0).as_secs_f64() * 1e3);
        }
    }
    let fb = median(&mut fwd_bwd);
    let st = median(&mut step);
    let tokens_per_s = (b * t) as f64 / (st / 1e3);
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "impl": "tether-candle",
                "threads": args.threads,
                "batch": b,
                "context": t,
                "params": n,
                "ms_fwd_bwd": fb,
                "ms_step": st,
                "ms_fwd_bwd_p10": pct(&fwd_bwd, 0.1),
                "ms_fwd_bwd_p90": pct(&fwd_bwd, 0.9),
                "tokens_per_s": tokens_per_s,
                "dtype": args.dtype.to_string(),
                "final_loss": loss,
            })
        );
    } else {
        println!(
            "GPT {n} params, batch {b} x {t}, {} threads, {}: forward+backward {fb:.1} ms, with Adam {st:.1} ms \
             ({tokens_per_s:.0} tokens/s), loss {loss:.3}",
            args.threads, args.dtype
        );
    }
    Ok(())
}

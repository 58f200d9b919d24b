//! Baseline: the same model, data and optimizer as the quickstart, trained in one thread without the parameter
//! server (no network, no compression, no staleness). Used to check what the distributed run should reach and to
//! time Tether against scikit-learn (`scripts/compare_sklearn.sh`).
//!
//! `cargo run --release --example single_process -- --epochs 20`

use std::time::Instant;

use anyhow::Result;
use clap::Parser;

use tether::common::config::{Config, OptimizerConfig};
use tether::common::layout::model_io;
use tether::server::optim::Optimizer;
use tether::worker::data::load_configured;
use tether::worker::data::Partition;
use tether::worker::model;

/// Single-process baseline trainer.
#[derive(Parser, Debug)]
struct Args {
    /// Epochs.
    #[arg(long, default_value_t = 10)]
    epochs: u32,
    /// Batch size.
    #[arg(long, default_value_t = 128)]
    batch: usize,
    /// Adam learning rate.
    #[arg(long, default_value_t = 1e-3)]
    lr: f32,
    /// Stop once test accuracy reaches this (checked every epoch).
    #[arg(long)]
    target: Option<f32>,
}

fn main() {
    if let Err(e) = run() {
        eprintln!(
            "single_process: {}",
            tether::common::error_chain::ErrorChain(e.as_ref())
        );
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let args = Args::parse();
    let mut cfg = Config::with_servers(vec!["127.0.0.1:0".into()]);
    let (train, test, note) = load_configured(&mut cfg)?;
    if let Some(n) = note {
        println!("note: {n}");
    }
    let (features, classes) = model_io(&cfg)?;
    let mut m = model::build(&cfg.model, features, classes)?;
    let mut params = m.layout().init_all(cfg.model.seed);
    let mut grad = vec![0.0; params.len()];
    let opt_cfg = OptimizerConfig {
        lr: args.lr,
        ..OptimizerConfig::default()
    };
    let mut opt = Optimizer::new(&opt_cfg, params.len());
    let part = Partition::new(train.len(), 0, 1, cfg.train.seed)?;
    let (mut xb, mut yb) = (vec![0.0; args.batch * features], vec![0u32; args.batch]);
    let started = Instant::now();
    for epoch in 0..args.epochs {
        let order = part.epoch_order(u64::from(epoch));
        let mut loss_sum = 0.0;
        let steps = order.len() / args.batch;
        for s in 0..steps {
            for (r, &i) in order[s * args.batch..(s + 1) * args.batch]
                .iter()
                .enumerate()
            {
                xb[r * features..(r + 1) * features].copy_from_slice(train.row(i));
                yb[r] = train.y[i];
            }
            loss_sum += m.loss_and_grad(&params, &xb, &yb, &mut grad);
            opt.step(&mut params, &grad, 1.0);
        }
        let acc = model::accuracy(m.as_mut(), &params, &test.x, &test.y, 1000);
        println!(
            "epoch {:>2}  {:6.1}s  train loss {:.4}  test accuracy {acc:.4}",
            epoch + 1,
            started.elapsed().as_secs_f64(),
            loss_sum / steps as f32
        );
        if args.target.is_some_and(|t| acc >= t) {
            println!(
                "reached {:.3} after {:.1} s",
                acc,
                started.elapsed().as_secs_f64()
            );
            break;
        }
    }
    Ok(())
}

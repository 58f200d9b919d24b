//! Embedding Tether with an ordinary candle module: write the module with candle-nn as usual (here a small
//! convolution-free residual MLP with layer norm and GELU), implement `CandleModule` (the batch's loss and a
//! prediction per row) and wrap it in `CandleModel`. The adapter records every tensor the module asks its
//! `VarBuilder` for as Tether's flat layout (names, shapes, inits translated from candle's), so the shards hold it,
//! apply the optimizer and enforce the staleness bound, while candle's autograd computes the workers' gradients. No
//! backward pass is written by hand.
//!
//! `cargo run --release --example embed_candle_model`

use std::sync::Arc;

use anyhow::Result;
use candle_core::{Device, Module, Tensor};
use candle_nn::{layer_norm, linear, LayerNorm, LayerNormConfig, Linear, VarBuilder};

use tether::common::config::{ComputePrecision, Config, DatasetKind, Staleness};
use tether::worker::model::{CandleModel, CandleModule};
use tether::{loopback_servers, LocalCluster, Model};

/// features → linear → (x + gelu(linear(norm(x)))) → linear → classes.
struct ResidualMlp {
    features: usize,
    input: Linear,
    norm: LayerNorm,
    inner: Linear,
    head: Linear,
}

impl ResidualMlp {
    fn new(
        vb: VarBuilder<'_>,
        features: usize,
        hidden: usize,
        classes: usize,
    ) -> candle_core::Result<Self> {
        // candle-nn's fused layer norm has no backward; `affine` + the unfused path (remove_mean) trains.
        let cfg = LayerNormConfig {
            affine: true,
            ..LayerNormConfig::default()
        };
        Ok(Self {
            features,
            input: linear(features, hidden, vb.pp("input"))?,
            norm: layer_norm(hidden, cfg, vb.pp("norm"))?,
            inner: linear(hidden, hidden, vb.pp("inner"))?,
            head: linear(hidden, classes, vb.pp("head"))?,
        })
    }

    fn logits(&self, x: &[f32], rows: usize) -> candle_core::Result<Tensor> {
        let x = Tensor::from_slice(x, (rows, self.features), &Device::Cpu)?;
        let h = self.input.forward(&x)?;
        let n = unfused_norm(&self.norm, &h)?;
        let h = (&h + self.inner.forward(&n)?.gelu()?)?;
        self.head.forward(&h)
    }
}

/// Layer norm from differentiable primitives, with the module's own gain and bias.
fn unfused_norm(norm: &LayerNorm, x: &Tensor) -> candle_core::Result<Tensor> {
    let mean = x.mean_keepdim(1)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(1)?;
    let xn = xc.broadcast_div(&(var + 1e-5)?.sqrt()?)?;
    let xn = xn.broadcast_mul(norm.weight())?;
    match norm.bias() {
        Some(b) => xn.broadcast_add(b),
        None => Ok(xn),
    }
}

impl CandleModule for ResidualMlp {
    fn loss(&self, x: &[f32], y: &[u32], rows: usize) -> candle_core::Result<Tensor> {
        let labels = Tensor::from_slice(y, rows, &Device::Cpu)?;
        candle_nn::loss::cross_entropy(&self.logits(x, rows)?, &labels)
    }

    fn predict(&self, x: &[f32], rows: usize, out: &mut [u32]) -> candle_core::Result<()> {
        let p = self.logits(x, rows)?.argmax(1)?.to_vec1::<u32>()?;
        out.copy_from_slice(&p);
        Ok(())
    }
}

fn model() -> Box<dyn Model> {
    // Building cannot fail: the module asks only for tensors with shapes and candle-nn's standard inits.
    let m = CandleModel::new(64, 10, ComputePrecision::F32, |vb| {
        ResidualMlp::new(vb, 64, 48, 10)
    })
    .expect("the module builds");
    Box::new(m)
}

fn main() {
    if let Err(e) = run() {
        eprintln!(
            "embed_candle_model: {}",
            tether::common::error_chain::ErrorChain(e.as_ref())
        );
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let mut cfg = Config::with_servers(loopback_servers(2));
    cfg.cluster.workers = 3;
    cfg.cluster.staleness = Staleness::Bounded(2);
    cfg.data.dataset = DatasetKind::Digits;
    cfg.train.epochs = 15;
    cfg.train.batch = 32;
    cfg.optimizer.lr = 3e-3;
    cfg.checkpoint.every_updates = 0;
    let dir = tempfile::tempdir()?;
    let layout = model().layout().clone();
    println!(
        "candle module as a Tether layout ({} params):",
        layout.len()
    );
    for t in layout.tensors() {
        println!("  {:<14} {:?} {:?}", t.name, t.shape, t.init);
    }
    let mut cluster = LocalCluster::new(cfg, dir.path().to_path_buf());
    cluster.model = Some(Arc::new(model));
    let report = cluster.run()?;
    println!(
        "candle module on {}: test accuracy {:.4} after {} steps in {:.1} s, {:.1}x fewer bytes pushed than fp32",
        report.dataset,
        report.final_test_accuracy,
        report.steps,
        report.wall_seconds,
        1.0 / report.push_ratio().max(1e-12)
    );
    anyhow::ensure!(
        report.final_test_accuracy > 0.9,
        "the candle module did not learn"
    );
    Ok(())
}

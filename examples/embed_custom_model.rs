//! Embedding Tether as a library with your own model: implement `tether::Model` (parameters in, loss and gradient
//! out, over a flat layout you describe) and hand a factory to `LocalCluster`. The shards hold your layout, apply
//! the optimizer and enforce the staleness bound; the workers call your code.
//!
//! Here the user model is a small network with a tanh hidden layer, written with plain loops, trained on the digits
//! set embedded in Tether.
//!
//! `cargo run --release --example embed_custom_model`

use std::sync::Arc;

use anyhow::Result;

use tether::common::config::{Config, DatasetKind, Staleness};
use tether::common::layout::{Init, Layout, TensorSpec};
use tether::{loopback_servers, LocalCluster, Model};

/// features → tanh(hidden) → softmax(classes), parameters `w1 [f, h]`, `b1 [h]`, `w2 [h, c]`, `b2 [c]`.
struct TanhNet {
    layout: Layout,
    features: usize,
    hidden: usize,
    classes: usize,
}

impl TanhNet {
    fn new(features: usize, hidden: usize, classes: usize) -> Self {
        let layout = Layout::new(vec![
            TensorSpec::new(
                "w1",
                &[features, hidden],
                Init::Uniform {
                    bound: (1.0 / features as f32).sqrt(),
                },
            ),
            TensorSpec::new("b1", &[hidden], Init::Zeros),
            TensorSpec::new(
                "w2",
                &[hidden, classes],
                Init::Uniform {
                    bound: (1.0 / hidden as f32).sqrt(),
                },
            ),
            TensorSpec::new("b2", &[classes], Init::Zeros),
        ]);
        Self {
            layout,
            features,
            hidden,
            classes,
        }
    }

    /// Hidden activations and class probabilities of one row.
    fn forward(&self, p: &[f32], x: &[f32], h: &mut [f32], probs: &mut [f32]) {
        let (f, hd, c) = (self.features, self.hidden, self.classes);
        let (w1, rest) = p.split_at(f * hd);
        let (b1, rest) = rest.split_at(hd);
        let (w2, b2) = rest.split_at(hd * c);
        for j in 0..hd {
            let mut a = b1[j];
            for i in 0..f {
                a += x[i] * w1[i * hd + j];
            }
            h[j] = a.tanh();
        }
        let mut max = f32::NEG_INFINITY;
        for k in 0..c {
            let mut z = b2[k];
            for j in 0..hd {
                z += h[j] * w2[j * c + k];
            }
            probs[k] = z;
            max = max.max(z);
        }
        let sum: f32 = probs
            .iter_mut()
            .map(|z| {
                *z = (*z - max).exp();
                *z
            })
            .sum();
        probs.iter_mut().for_each(|z| *z /= sum);
    }
}

impl Model for TanhNet {
    fn layout(&self) -> &Layout {
        &self.layout
    }
    fn classes(&self) -> usize {
        self.classes
    }
    fn features(&self) -> usize {
        self.features
    }

    fn loss_and_grad(&mut self, p: &[f32], x: &[f32], y: &[u32], grad: &mut [f32]) -> f32 {
        let (f, hd, c) = (self.features, self.hidden, self.classes);
        let rows = y.len();
        grad.fill(0.0);
        let (mut h, mut probs, mut dh) = (vec![0.0; hd], vec![0.0; c], vec![0.0; hd]);
        let mut loss = 0.0;
        let scale = 1.0 / rows as f32;
        for (r, &label) in y.iter().enumerate() {
            let xr = &x[r * f..(r + 1) * f];
            self.forward(p, xr, &mut h, &mut probs);
            loss -= probs[label as usize].max(1e-12).ln();
            let (gw1, rest) = grad.split_at_mut(f * hd);
            let (gb1, rest) = rest.split_at_mut(hd);
            let (gw2, gb2) = rest.split_at_mut(hd * c);
            let w2 = &p[f * hd + hd..f * hd + hd + hd * c];
            dh.fill(0.0);
            for k in 0..c {
                let dz = (probs[k] - f32::from(k == label as usize)) * scale;
                gb2[k] += dz;
                for j in 0..hd {
                    gw2[j * c + k] += h[j] * dz;
                    dh[j] += w2[j * c + k] * dz;
                }
            }
            for j in 0..hd {
                let da = dh[j] * (1.0 - h[j] * h[j]);
                gb1[j] += da;
                for i in 0..f {
                    gw1[i * hd + j] += xr[i] * da;
                }
            }
        }
        loss * scale
    }

    fn predict(&mut self, p: &[f32], x: &[f32], out: &mut [u32]) {
        let (mut h, mut probs) = (vec![0.0; self.hidden], vec![0.0; self.classes]);
        for (r, o) in out.iter_mut().enumerate() {
            self.forward(
                p,
                &x[r * self.features..(r + 1) * self.features],
                &mut h,
                &mut probs,
            );
            *o = (0..self.classes)
                .max_by(|&a, &b| probs[a].total_cmp(&probs[b]))
                .unwrap_or(0) as u32;
        }
    }
}

fn main() {
    if let Err(e) = run() {
        eprintln!(
            "embed_custom_model: {}",
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
    let mut cluster = LocalCluster::new(cfg, dir.path().to_path_buf());
    cluster.model = Some(Arc::new(|| {
        Box::new(TanhNet::new(64, 32, 10)) as Box<dyn Model>
    }));
    let report = cluster.run()?;
    println!(
        "user model ({} params) on {}: test accuracy {:.4} after {} steps in {:.1} s, {:.1}x fewer bytes pushed than fp32",
        report.params,
        report.dataset,
        report.final_test_accuracy,
        report.steps,
        report.wall_seconds,
        1.0 / report.push_ratio().max(1e-12)
    );
    anyhow::ensure!(
        report.final_test_accuracy > 0.9,
        "the user model did not learn"
    );
    Ok(())
}

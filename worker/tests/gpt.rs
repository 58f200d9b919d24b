//! The candle adapter and the built-in GPT: gradients against central finite differences, a candle MLP against the
//! hand-written one (same layout, same loss and gradient), the GPT's layout against the one the shards build,
//! mixed precision against f32, and dynamic loss scaling on a real f16 overflow.

use candle_core::{Module, Tensor};
use candle_nn::VarBuilder;

use tether_common::config::{ComputePrecision, Config, DatasetKind, ModelKind};
use tether_common::layout::{gpt_layout, mlp_layout, model_io, model_layout, GptShape};
use tether_worker::data::{kjv_excerpt, windows};
use tether_worker::model::{self, gpt_model, CandleModel, CandleModule, Mlp, Model};

/// A GPT small enough for finite differences.
fn tiny() -> GptShape {
    GptShape {
        vocab: 256,
        context: 8,
        layers: 2,
        heads: 2,
        dim: 16,
    }
}

/// `rows` windows of real text for a GPT of context `t`.
fn batch(t: usize, rows: usize, offset: usize) -> (Vec<f32>, Vec<u32>) {
    let text = kjv_excerpt().unwrap();
    let d = windows(&text[offset..offset + rows * t + 1], t);
    assert_eq!(d.len(), rows);
    (d.x, d.y)
}

fn loss_and_grad(m: &mut dyn Model, p: &[f32], x: &[f32], y: &[u32]) -> (f32, Vec<f32>) {
    let mut g = vec![0.0; p.len()];
    let l = m.loss_and_grad(p, x, y, &mut g);
    (l, g)
}

#[test]
fn gpt_gradient_matches_central_finite_differences() {
    let shape = tiny();
    let mut m = gpt_model(shape, ComputePrecision::F32).unwrap();
    let mut p = m.layout().init_all(7);
    // Perturb the zero-initialised tensors (biases, norms) so that every path carries gradient.
    for (i, v) in p.iter_mut().enumerate() {
        *v += 0.05 * (((i * 7919) % 101) as f32 / 101.0 - 0.5);
    }
    let (x, y) = batch(shape.context, 3, 1000);
    let (loss, g) = loss_and_grad(&mut m, &p, &x, &y);
    assert!(
        (loss - 256f32.ln()).abs() < 0.5,
        "initial loss {loss} near ln 256"
    );
    // Check a spread of coordinates in every tensor: the largest-gradient one and a few others.
    let layout = m.layout().clone();
    let h = 1e-2f32;
    let mut checked = 0;
    for (ti, t) in layout.tensors().iter().enumerate() {
        let r = layout.tensor_range(ti);
        let top = r
            .clone()
            .max_by(|&a, &b| g[a].abs().total_cmp(&g[b].abs()))
            .unwrap();
        for i in [top, r.start + (r.len() * 3) / 7, r.end - 1] {
            let mut q = p.clone();
            q[i] = p[i] + h;
            let up = f64::from(m.loss(&q, &x, &y));
            q[i] = p[i] - h;
            let down = f64::from(m.loss(&q, &x, &y));
            let fd = (up - down) / (2.0 * f64::from(h));
            let an = f64::from(g[i]);
            let tol = 2e-3 + 0.03 * an.abs().max(fd.abs());
            assert!(
                (fd - an).abs() <= tol,
                "{}[{}]: finite difference {fd:.6} vs autograd {an:.6}",
                t.name,
                i - r.start
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 3 * layout.tensors().len());
    // The gradient is not trivially zero.
    assert!(g.iter().map(|v| v.abs()).fold(0.0, f32::max) > 1e-2);
}

/// The hand-written MLP's architecture as an ordinary candle module, with its layout's names and `[in, out]` weights.
struct CandleMlp {
    layers: Vec<(Tensor, Tensor)>,
}

impl CandleMlp {
    fn new(vb: VarBuilder<'_>, dims: &[usize]) -> candle_core::Result<Self> {
        let layers = dims
            .windows(2)
            .enumerate()
            .map(|(k, w)| {
                let v = vb.pp(format!("fc{}", k + 1));
                Ok((v.get((w[0], w[1]), "weight")?, v.get(w[1], "bias")?))
            })
            .collect::<candle_core::Result<_>>()?;
        Ok(Self { layers })
    }

    fn logits(&self, x: &[f32], rows: usize) -> candle_core::Result<Tensor> {
        let f = self.layers[0].0.dims()[0];
        let mut h = Tensor::from_slice(x, (rows, f), &candle_core::Device::Cpu)?;
        for (k, (w, b)) in self.layers.iter().enumerate() {
            h = h.matmul(w)?.broadcast_add(b)?;
            if k + 1 < self.layers.len() {
                h = h.relu()?;
            }
        }
        Ok(h)
    }
}

impl CandleModule for CandleMlp {
    fn loss(&self, x: &[f32], y: &[u32], rows: usize) -> candle_core::Result<Tensor> {
        let t = Tensor::from_slice(y, rows, &candle_core::Device::Cpu)?;
        candle_nn::loss::cross_entropy(&self.logits(x, rows)?, &t)
    }

    fn predict(&self, x: &[f32], rows: usize, out: &mut [u32]) -> candle_core::Result<()> {
        let p = self.logits(x, rows)?.argmax(1)?.to_vec1::<u32>()?;
        out.copy_from_slice(&p);
        Ok(())
    }
}

#[test]
fn a_candle_mlp_computes_the_builtin_mlps_loss_and_gradient() {
    let dims = [12, 10, 7, 4];
    let layout = mlp_layout(&dims);
    let mut candle = CandleModel::with_layout(layout.clone(), 12, 4, ComputePrecision::F32, |vb| {
        CandleMlp::new(vb, &dims)
    })
    .unwrap();
    let mut builtin = Mlp::new(12, &[10, 7], 4);
    assert_eq!(builtin.layout(), &layout);
    let p = layout.init_all(3);
    let rows = 9;
    let x: Vec<f32> = (0..rows * 12)
        .map(|i| ((i * 37) % 19) as f32 / 19.0 - 0.4)
        .collect();
    let y: Vec<u32> = (0..rows as u32).map(|i| i % 4).collect();
    let (lc, gc) = loss_and_grad(&mut candle, &p, &x, &y);
    let (lb, gb) = loss_and_grad(&mut builtin, &p, &x, &y);
    assert!(
        (lc - lb).abs() < 1e-5 * lb.abs().max(1.0),
        "loss {lc} vs {lb}"
    );
    let scale = gb.iter().map(|v| v.abs()).fold(0.0, f32::max);
    for (i, (a, b)) in gc.iter().zip(&gb).enumerate() {
        assert!((a - b).abs() <= 1e-5 * scale + 1e-7, "grad[{i}] {a} vs {b}");
    }
    let (mut pc, mut pb) = (vec![0; rows], vec![0; rows]);
    candle.predict(&p, &x, &mut pc);
    builtin.predict(&p, &x, &mut pb);
    assert_eq!(pc, pb);
    // The adapter derives the same layout from candle's own requests when none is prescribed (here: inits differ,
    // names and shapes are the module's).
    let derived =
        CandleModel::new(12, 4, ComputePrecision::F32, |vb| CandleMlp::new(vb, &dims)).unwrap();
    let names: Vec<_> = derived
        .layout()
        .tensors()
        .iter()
        .map(|t| (&t.name, &t.shape))
        .collect();
    let want: Vec<_> = layout
        .tensors()
        .iter()
        .map(|t| (&t.name, &t.shape))
        .collect();
    assert_eq!(names, want);
}

#[test]
fn a_module_that_strays_from_the_prescribed_layout_is_refused() {
    let dims = [12, 10, 4];
    let err = CandleModel::with_layout(
        mlp_layout(&[12, 9, 4]),
        12,
        4,
        ComputePrecision::F32,
        |vb| CandleMlp::new(vb, &dims),
    );
    assert!(err.is_err());
    // A user module with linear layers from candle-nn (Kaiming init) maps to a reproducible layout init.
    let m = CandleModel::new(12, 4, ComputePrecision::F32, |vb| {
        let l = candle_nn::linear(12, 4, vb.pp("head"))?;
        Ok(Lin(l))
    })
    .unwrap();
    assert_eq!(m.layout().len(), 12 * 4 + 4);
    assert_ne!(m.layout().init_all(1), vec![0.0; 52]);
}

struct Lin(candle_nn::Linear);

impl CandleModule for Lin {
    fn loss(&self, x: &[f32], y: &[u32], rows: usize) -> candle_core::Result<Tensor> {
        let dev = candle_core::Device::Cpu;
        let logits = self.0.forward(&Tensor::from_slice(x, (rows, 12), &dev)?)?;
        candle_nn::loss::cross_entropy(&logits, &Tensor::from_slice(y, rows, &dev)?)
    }
    fn predict(&self, _: &[f32], _: usize, out: &mut [u32]) -> candle_core::Result<()> {
        out.fill(0);
        Ok(())
    }
}

#[test]
fn the_workers_gpt_has_the_layout_the_shards_build() {
    let mut cfg = Config::with_servers(vec!["127.0.0.1:1".into()]);
    cfg.model.kind = ModelKind::Gpt;
    cfg.data.dataset = DatasetKind::KjvExcerpt;
    cfg.validate().unwrap();
    let shards = model_layout(&cfg).unwrap();
    assert_eq!(shards.len(), GptShape::from_model(&cfg.model).params());
    assert_eq!(
        shards.len(),
        4 * (12 * 128 * 128 + 13 * 128) + (256 + 64 + 2) * 128
    );
    for precision in [ComputePrecision::F32, ComputePrecision::Bf16] {
        cfg.train.precision = precision;
        let m = model::build_for(&cfg).unwrap();
        assert_eq!(m.layout().hash(), shards.hash());
        assert_eq!((m.features(), m.classes()), (64, 256));
    }
    // Init: GPT-2's normal(0, 0.02), gains one, biases zero.
    let p = shards.init_all(42);
    let wte = &p[shards.range_of("wte").unwrap()];
    let sd = (wte.iter().map(|v| v * v).sum::<f32>() / wte.len() as f32).sqrt();
    assert!((sd - 0.02).abs() < 0.001, "wte std {sd}");
    assert!(p[shards.range_of("h.0.ln_1.weight").unwrap()]
        .iter()
        .all(|&v| v == 1.0));
    assert!(p[shards.range_of("h.3.mlp.fc.bias").unwrap()]
        .iter()
        .all(|&v| v == 0.0));
    // Text data needs the GPT; the GPT needs text data.
    cfg.model.kind = ModelKind::Mlp;
    assert!(model_io(&cfg).is_err());
    cfg.model.kind = ModelKind::Gpt;
    cfg.data.dataset = DatasetKind::Digits;
    assert!(cfg.validate().is_err());
    assert_eq!(gpt_layout(&tiny()).len(), tiny().params());
}

#[test]
fn bf16_gradients_follow_f32_and_f16_overflow_is_caught_by_the_loss_scaler() {
    let shape = tiny();
    let mut f32m = gpt_model(shape, ComputePrecision::F32).unwrap();
    let p = f32m.layout().init_all(11);
    let (x, y) = batch(shape.context, 8, 5000);
    let (l32, g32) = loss_and_grad(&mut f32m, &p, &x, &y);
    let cosine = |a: &[f32], b: &[f32]| {
        let dot: f64 = a
            .iter()
            .zip(b)
            .map(|(x, y)| f64::from(*x) * f64::from(*y))
            .sum();
        let n = |v: &[f32]| v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
        dot / (n(a) * n(b))
    };
    let mut bf = gpt_model(shape, ComputePrecision::Bf16)
        .unwrap()
        .with_loss_scaling(1024.0, 100);
    let (lbf, gbf) = loss_and_grad(&mut bf, &p, &x, &y);
    assert!(
        (lbf - l32).abs() < 0.02 * l32,
        "bf16 loss {lbf} vs f32 {l32}"
    );
    assert!(gbf.iter().all(|v| v.is_finite()));
    let c = cosine(&g32, &gbf);
    assert!(c > 0.98, "bf16 gradient cosine {c}");

    // f16 at the largest scale: the scaled logit gradients (2^24 / 64 predictions ≈ 2.6e5) exceed f16's 65504.
    let mut h = gpt_model(shape, ComputePrecision::F16)
        .unwrap()
        .with_loss_scaling(16_777_216.0, 1000);
    let mut finite_at = None;
    for attempt in 0..20i32 {
        let (_, g) = loss_and_grad(&mut h, &p, &x, &y);
        if g.iter().all(|v| v.is_finite()) {
            finite_at = Some((attempt, g));
            break;
        }
    }
    let (attempt, g16) = finite_at.expect("the scaler brings f16 back into range");
    let stats = h.precision_stats().unwrap();
    assert!(attempt >= 1, "the first f16 step must overflow");
    assert_eq!(stats.overflows, attempt as u64);
    assert_eq!(stats.loss_scale, 16_777_216.0 / 2f32.powi(attempt));
    let c = cosine(&g32, &g16);
    assert!(c > 0.98, "f16 gradient cosine {c}");
}

/// Trains a small GPT (1 layer, 2 heads, 32 wide, 16-byte context) for `steps` Adam steps of 32 windows on the
/// excerpt in one process, deterministically (the same batches for every precision), and returns the validation loss
/// and the precision statistics. Small and long enough to be near its capacity: shorter runs of larger models are in
/// their steep phase, where f32 runs from three seeds differed by ±12 % at 400 steps; these differ by ±1 %
/// (1.72–1.76 at 1,500 steps).
fn train_small(precision: ComputePrecision, steps: usize) -> (f32, Option<model::PrecisionStats>) {
    use tether_common::config::{OptimizerConfig, OptimizerKind, Schedule};
    use tether_common::optim::Optimizer;
    let shape = GptShape {
        vocab: 256,
        context: 16,
        layers: 1,
        heads: 2,
        dim: 32,
    };
    let mut m = gpt_model(shape, precision).unwrap();
    if precision != ComputePrecision::F32 {
        m = m.with_loss_scaling(65536.0, 50);
    }
    let text = kjv_excerpt().unwrap();
    let (train, val) =
        tether_worker::data::split_windows(&text, shape.context, std::path::Path::new("kjv"))
            .unwrap();
    let mut p = m.layout().init_all(42);
    let mut g = vec![0.0; p.len()];
    let mut opt = Optimizer::new(
        &OptimizerConfig {
            kind: OptimizerKind::Adam,
            lr: 3e-3,
            schedule: Schedule::WarmupCosine {
                warmup: 30,
                total: steps as u64,
                min_ratio: 0.1,
            },
            ..OptimizerConfig::default()
        },
        p.len(),
    );
    let (b, t) = (32, shape.context);
    for s in 0..steps {
        // A fixed stride through the training windows: the same batches for every precision.
        let first = (s * 7919 * b) % (train.len() - b);
        let loss = m.loss_and_grad(
            &p,
            &train.x[first * t..(first + b) * t],
            &train.y[first..first + b],
            &mut g,
        );
        // An overflowed step is skipped, as the worker's step engine skips any non-finite gradient.
        if loss.is_finite() && g.iter().all(|v| v.is_finite()) {
            opt.step(&mut p, &g, 1.0);
        }
    }
    let n = 512.min(val.len());
    let vloss = model::mean_loss(&mut m, &p, &val.x[..n * t], &val.y[..n], 128);
    (vloss, m.precision_stats())
}

#[test]
fn mixed_precision_training_reaches_the_f32_validation_loss_within_two_percent() {
    let steps = 1500;
    let (l32, none) = train_small(ComputePrecision::F32, steps);
    assert!(none.is_none());
    assert!(l32 < 2.0, "f32 validation loss {l32}");
    for precision in [ComputePrecision::F16, ComputePrecision::Bf16] {
        let (l, stats) = train_small(precision, steps);
        let stats = stats.expect("loss-scaler statistics");
        eprintln!("{precision}: validation loss {l:.4} vs f32 {l32:.4}, {stats:?}");
        // Measured: f32 1.757, f16 1.730 (23 overflows skipped), bf16 1.705.
        assert!(
            l <= 1.02 * l32,
            "{precision} validation loss {l} vs f32 {l32}: more than 2 % worse"
        );
        assert!(
            l > 0.9 * l32,
            "{precision} validation loss {l} implausibly far below f32's {l32}"
        );
        assert!(
            stats.growths >= 1,
            "{precision}: the scale grew after clean windows"
        );
        if precision == ComputePrecision::F16 {
            // Real f16 overflows at 2^16 and above, each skipped and halving the scale.
            assert!(stats.overflows >= 1, "f16 never overflowed");
        }
    }
}

#[test]
fn evaluation_in_bounded_passes_matches_row_by_row_results() {
    // A batch several times larger than one evaluation pass: the loss is the row-weighted mean of the passes and
    // every prediction is the one a pass of that row alone gives.
    let shape = tiny();
    let mut m = gpt_model(shape, ComputePrecision::F32).unwrap();
    let p = m.layout().init_all(3);
    let rows = 3 * model::EVAL_VALUES / shape.context + 5;
    let (x, y) = batch(shape.context, rows, 0);
    let whole = m.loss(&p, &x, &y);
    let mut sum = 0.0f64;
    let mut one = [0u32; 1];
    let mut preds = vec![0u32; rows];
    m.predict(&p, &x, &mut preds);
    for r in 0..rows {
        let xs = &x[r * shape.context..(r + 1) * shape.context];
        sum += f64::from(m.loss(&p, xs, &y[r..r + 1]));
        m.predict(&p, xs, &mut one);
        assert_eq!(one[0], preds[r], "row {r}");
    }
    let mean = (sum / rows as f64) as f32;
    assert!(
        (whole - mean).abs() < 1e-4 * mean.abs(),
        "chunked loss {whole} vs row by row {mean}"
    );
}

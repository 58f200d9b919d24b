//! Model tests: gradients against central finite differences of an independent f64 reference, loss at init, learning
//! on a separable problem, prediction = argmax of logits, determinism and batch-size changes.

use tether_common::config::{ModelConfig, ModelKind};
use tether_common::layout::Init;
use tether_common::testing::TestRng;
use tether_worker::model::{accuracy, build, mean_loss, LogReg, Mlp, Model};

/// f64 reference forward pass straight from the layout names: logits of every row.
fn reference_logits(model: &Mlp, params: &[f64], x: &[f32]) -> Vec<Vec<f64>> {
    let dims = model.dims();
    let layers = dims.len() - 1;
    let rows = x.len() / dims[0];
    let mut out = Vec::with_capacity(rows);
    for r in 0..rows {
        let mut a: Vec<f64> = x[r * dims[0]..(r + 1) * dims[0]]
            .iter()
            .map(|v| f64::from(*v))
            .collect();
        for k in 0..layers {
            let w = &params[model
                .layout()
                .range_of(&format!("fc{}.weight", k + 1))
                .unwrap()];
            let b = &params[model
                .layout()
                .range_of(&format!("fc{}.bias", k + 1))
                .unwrap()];
            let (din, dout) = (dims[k], dims[k + 1]);
            let mut z = b.to_vec();
            for i in 0..din {
                for j in 0..dout {
                    z[j] += a[i] * w[i * dout + j];
                }
            }
            if k + 1 < layers {
                z.iter_mut().for_each(|v| *v = v.max(0.0));
            }
            a = z;
        }
        out.push(a);
    }
    out
}

fn reference_loss(model: &Mlp, params: &[f64], x: &[f32], y: &[u32]) -> f64 {
    let logits = reference_logits(model, params, x);
    let mut total = 0.0;
    for (z, &label) in logits.iter().zip(y) {
        let m = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + z.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
        total += lse - z[label as usize];
    }
    total / y.len() as f64
}

/// Initial params plus random biases (so the bias path matters in the forward pass too).
fn test_params(model: &Mlp, seed: u64) -> Vec<f32> {
    let mut p = model.layout().init_all(seed);
    let mut rng = TestRng::new(seed ^ 0xb1a5);
    for (i, t) in model.layout().tensors().iter().enumerate() {
        if t.init == Init::Zeros {
            for v in &mut p[model.layout().tensor_range(i)] {
                *v = rng.symmetric(0.3);
            }
        }
    }
    p
}

fn batch(features: usize, classes: u32, rows: usize, seed: u64) -> (Vec<f32>, Vec<u32>) {
    let mut rng = TestRng::new(seed);
    let x = (0..rows * features).map(|_| rng.symmetric(1.5)).collect();
    let y = (0..rows)
        .map(|_| rng.below(u64::from(classes)) as u32)
        .collect();
    (x, y)
}

/// Compares the model's gradient with central differences of the f64 reference loss, coordinate by coordinate.
fn check_gradient(model: &mut Mlp, seed: u64, rows: usize) {
    let params = test_params(model, seed);
    let (x, y) = batch(model.features(), model.classes() as u32, rows, seed + 1);
    let mut grad = vec![f32::NAN; params.len()];
    let loss = model.loss_and_grad(&params, &x, &y, &mut grad);
    let p64: Vec<f64> = params.iter().map(|v| f64::from(*v)).collect();
    let ref_loss = reference_loss(model, &p64, &x, &y);
    assert!(
        (f64::from(loss) - ref_loss).abs() < 1e-5 * (1.0 + ref_loss),
        "loss {loss} vs reference {ref_loss}"
    );
    let eps = 1e-5;
    let mut worst = 0.0f64;
    for i in 0..params.len() {
        let mut plus = p64.clone();
        plus[i] += eps;
        let mut minus = p64.clone();
        minus[i] -= eps;
        let fd = (reference_loss(model, &plus, &x, &y) - reference_loss(model, &minus, &x, &y))
            / (2.0 * eps);
        let g = f64::from(grad[i]);
        let err = (g - fd).abs();
        worst = worst.max(err);
        assert!(
            err <= 1e-4 + 2e-3 * fd.abs(),
            "coordinate {i} ({}): analytic {g} vs finite difference {fd}",
            model.layout().tensors()[model
                .layout()
                .tensors()
                .iter()
                .position(|t| {
                    let r = model.layout().range_of(&t.name).unwrap();
                    r.contains(&i)
                })
                .unwrap()]
            .name
        );
    }
    assert!(worst < 1e-4, "worst abs error {worst}");
}

#[test]
fn mlp_gradient_matches_finite_differences() {
    let mut m = Mlp::new(6, &[5, 4], 3);
    check_gradient(&mut m, 11, 7);
    check_gradient(&mut m, 12, 1);
}

#[test]
fn logreg_gradient_matches_finite_differences() {
    let mut m = Mlp::new(5, &[], 4);
    check_gradient(&mut m, 21, 7);
    // LogReg is the same function: same layout and bit-identical gradient.
    let mut lr = LogReg::new(5, 4);
    assert_eq!(lr.layout(), m.layout());
    let params = test_params(&m, 3);
    let (x, y) = batch(5, 4, 9, 4);
    let (mut g1, mut g2) = (vec![0.0; params.len()], vec![0.0; params.len()]);
    let l1 = m.loss_and_grad(&params, &x, &y, &mut g1);
    let l2 = lr.loss_and_grad(&params, &x, &y, &mut g2);
    assert_eq!(l1.to_bits(), l2.to_bits());
    assert_eq!(g1, g2);
}

#[test]
fn layout_names_shapes_and_init() {
    let m = Mlp::new(784, &[256, 128], 10);
    let names: Vec<_> = m
        .layout()
        .tensors()
        .iter()
        .map(|t| t.name.as_str())
        .collect();
    assert_eq!(
        names,
        [
            "fc1.weight",
            "fc1.bias",
            "fc2.weight",
            "fc2.bias",
            "fc3.weight",
            "fc3.bias"
        ]
    );
    assert_eq!(
        m.layout().len(),
        784 * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10
    );
    let t = m.layout().tensors();
    assert_eq!(t[0].shape, [784, 256]);
    assert_eq!(
        t[0].init,
        Init::Uniform {
            bound: (6.0f32 / 784.0).sqrt()
        }
    );
    assert_eq!(t[3].init, Init::Zeros);
    assert_eq!(
        t[4].init,
        Init::Uniform {
            bound: (6.0f32 / 128.0).sqrt()
        }
    );

    let cfg = ModelConfig {
        kind: ModelKind::Logreg,
        ..ModelConfig::default()
    };
    let b = build(&cfg, 64, 10).unwrap();
    assert_eq!((b.features(), b.classes(), b.layout().len()), (64, 10, 650));
    let b = build(&ModelConfig::default(), 64, 10).unwrap();
    let file = ModelConfig {
        kind: ModelKind::File,
        ..ModelConfig::default()
    };
    assert!(
        build(&file, 64, 10).is_err(),
        "a model file's model is not built by tether-worker"
    );
    assert_eq!(
        b.layout().tensors().len(),
        2 * (ModelConfig::default().hidden.len() + 1)
    );
}

#[test]
fn logits_match_reference_and_predict_is_their_argmax() {
    let mut m = Mlp::new(6, &[5, 4], 3);
    let mut params = test_params(&m, 5);
    let last_bias = m.layout().range_of("fc3.bias").unwrap();
    params[last_bias].fill(0.0);
    let (x, _) = batch(6, 3, 40, 6);
    let mut logits = vec![0.0; 40 * 3];
    m.logits(&params, &x, &mut logits);
    let p64: Vec<f64> = params.iter().map(|v| f64::from(*v)).collect();
    let reference = reference_logits(&m, &p64, &x);
    let mut pred = vec![u32::MAX; 40];
    m.predict(&params, &x, &mut pred);
    let mut classes_seen = [false; 3];
    for r in 0..40 {
        let row = &logits[r * 3..r * 3 + 3];
        for j in 0..3 {
            assert!(
                (f64::from(row[j]) - reference[r][j]).abs() < 1e-5,
                "row {r} logit {j}"
            );
        }
        let argmax = (0..3).fold(0, |b, j| if row[j] > row[b] { j } else { b });
        assert_eq!(pred[r] as usize, argmax, "row {r}");
        classes_seen[argmax] = true;
    }
    assert!(
        classes_seen.iter().filter(|s| **s).count() >= 2,
        "test batch should exercise several classes"
    );
}

#[test]
fn loss_at_small_init_is_ln_classes() {
    for classes in [3usize, 10] {
        let mut m = Mlp::new(20, &[16], classes);
        let small: Vec<f32> = m.layout().init_all(1).iter().map(|v| v * 1e-2).collect();
        let (x, y) = batch(20, classes as u32, 64, 2);
        let mut grad = vec![0.0; small.len()];
        let loss = m.loss_and_grad(&small, &x, &y, &mut grad);
        let ln_c = (classes as f32).ln();
        assert!(
            (loss - ln_c).abs() < 1e-3,
            "classes {classes}: loss {loss} vs ln C {ln_c}"
        );
        assert_eq!(m.loss(&small, &x, &y).to_bits(), loss.to_bits());
        // Default He init: still a sane starting loss.
        let init = m.layout().init_all(1);
        let l0 = m.loss(&init, &x, &y);
        assert!(
            l0.is_finite() && l0 > 0.5 * ln_c && l0 < 3.0 * ln_c,
            "He-init loss {l0}"
        );
    }
}

#[test]
fn loss_is_stable_for_huge_logits() {
    let mut m = Mlp::new(2, &[], 2);
    // Weights 1e4 → logits ~1e4: a naive exp would overflow to inf.
    let params = vec![1e4, -1e4, -1e4, 1e4, 0.0, 0.0];
    let x = vec![1.0, 0.0, 0.0, 1.0];
    let mut grad = vec![0.0; 6];
    let right = m.loss_and_grad(&params, &x, &[0, 1], &mut grad);
    assert!(right.abs() < 1e-6, "confident and right: {right}");
    let wrong = m.loss_and_grad(&params, &x, &[1, 0], &mut grad);
    assert!((wrong - 2e4).abs() < 1.0, "confident and wrong: {wrong}");
    assert!(grad.iter().all(|g| g.is_finite()));
}

/// Gaussian-ish blobs around well-separated class centres.
fn blobs(features: usize, classes: u32, rows: usize, seed: u64) -> (Vec<f32>, Vec<u32>) {
    let mut rng = TestRng::new(seed);
    let centres: Vec<f32> = (0..classes as usize * features)
        .map(|_| rng.symmetric(2.0))
        .collect();
    let mut x = Vec::with_capacity(rows * features);
    let mut y = Vec::with_capacity(rows);
    for _ in 0..rows {
        let c = rng.below(u64::from(classes)) as usize;
        y.push(c as u32);
        for f in 0..features {
            let noise = (rng.symmetric(1.0) + rng.symmetric(1.0) + rng.symmetric(1.0)) * 0.4;
            x.push(centres[c * features + f] + noise);
        }
    }
    (x, y)
}

#[test]
fn sgd_learns_separable_blobs() {
    let (features, classes, batch_rows) = (8, 4u32, 32);
    let (x, y) = blobs(features, classes, 512, 7);
    let mut m = Mlp::new(features, &[16], classes as usize);
    let mut params = m.layout().init_all(3);
    let mut grad = vec![0.0; params.len()];
    let acc0 = accuracy(&mut m, &params, &x, &y, 100);
    let loss0 = mean_loss(&mut m, &params, &x, &y, 100);
    for step in 0..300 {
        let start = (step * batch_rows) % 512;
        let xs = &x[start * features..(start + batch_rows) * features];
        let ys = &y[start..start + batch_rows];
        let l = m.loss_and_grad(&params, xs, ys, &mut grad);
        assert!(l.is_finite());
        for (p, g) in params.iter_mut().zip(&grad) {
            *p -= 0.1 * g;
        }
    }
    let acc = accuracy(&mut m, &params, &x, &y, 100);
    let loss = mean_loss(&mut m, &params, &x, &y, 100);
    assert!(acc > 0.95, "accuracy {acc0} -> {acc}");
    assert!(loss < 0.5 * loss0, "loss {loss0} -> {loss}");
}

#[test]
fn gradients_are_bit_identical_across_calls_and_batch_sizes() {
    let mut m = Mlp::new(6, &[5, 4], 3);
    let params = test_params(&m, 8);
    let (x7, y7) = batch(6, 3, 7, 9);
    let (x3, y3) = batch(6, 3, 3, 10);
    let (x50, y50) = batch(6, 3, 50, 11);
    let run = |m: &mut Mlp, x: &[f32], y: &[u32]| {
        let mut g = vec![f32::NAN; params.len()];
        let l = m.loss_and_grad(&params, x, y, &mut g);
        (
            l.to_bits(),
            g.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        )
    };
    let a = run(&mut m, &x7, &y7);
    assert_eq!(run(&mut m, &x7, &y7), a);
    // A larger then a smaller batch in between (buffers grow, then are only partly used) must not leak into results.
    let big = run(&mut m, &x50, &y50);
    let small = run(&mut m, &x3, &y3);
    assert_eq!(run(&mut m, &x7, &y7), a);
    assert_eq!(run(&mut Mlp::new(6, &[5, 4], 3), &x3, &y3), small);
    assert_eq!(run(&mut Mlp::new(6, &[5, 4], 3), &x50, &y50), big);
    // predict between gradient calls at another size leaves gradients unchanged.
    let mut pred = vec![0; 50];
    m.predict(&params, &x50, &mut pred);
    assert_eq!(run(&mut m, &x7, &y7), a);
    // A smaller batch's gradient is the mean over its rows: the 7-row gradient is the row-weighted mean of 3 + 4.
    let (x4, y4) = (&x7[3 * 6..], &y7[3..]);
    let first3 = run(&mut m, &x7[..3 * 6], &y7[..3]);
    let last4 = run(&mut m, x4, y4);
    for (i, ((w, f), l)) in a.1.iter().zip(&first3.1).zip(&last4.1).enumerate() {
        let (w, f, l) = (f32::from_bits(*w), f32::from_bits(*f), f32::from_bits(*l));
        let mix = (3.0 * f + 4.0 * l) / 7.0;
        assert!((mix - w).abs() < 1e-5, "coordinate {i}: {mix} vs {w}");
    }
}

#[test]
fn chunked_evaluation_does_not_depend_on_chunk_size() {
    let mut m = Mlp::new(8, &[16], 4);
    let params = m.layout().init_all(2);
    let (x, y) = blobs(8, 4, 101, 3);
    let acc = accuracy(&mut m, &params, &x, &y, 101);
    let loss = mean_loss(&mut m, &params, &x, &y, 101);
    for chunk in [1, 7, 50, 1000] {
        assert_eq!(accuracy(&mut m, &params, &x, &y, chunk), acc);
        assert!((mean_loss(&mut m, &params, &x, &y, chunk) - loss).abs() < 1e-5);
    }
    assert_eq!(accuracy(&mut m, &params, &[], &[], 10), 0.0);
}

/// A user model through the trait's default `loss`: a constant-logit classifier over 1 bias per class.
struct Prior(tether_common::layout::Layout);

impl Model for Prior {
    fn layout(&self) -> &tether_common::layout::Layout {
        &self.0
    }
    fn classes(&self) -> usize {
        2
    }
    fn features(&self) -> usize {
        1
    }
    fn loss_and_grad(&mut self, params: &[f32], _x: &[f32], y: &[u32], grad: &mut [f32]) -> f32 {
        let m = params[0].max(params[1]);
        let lse = m + ((params[0] - m).exp() + (params[1] - m).exp()).ln();
        grad.fill(0.0);
        let mut loss = 0.0;
        for &l in y {
            loss += lse - params[l as usize];
            for c in 0..2 {
                grad[c] += ((params[c] - lse).exp() - f32::from(c == l as usize)) / y.len() as f32;
            }
        }
        loss / y.len() as f32
    }
    fn predict(&mut self, params: &[f32], _x: &[f32], out: &mut [u32]) {
        out.fill(u32::from(params[1] > params[0]));
    }
}

#[test]
fn user_models_plug_in_through_the_trait() {
    use tether_common::layout::{Layout, TensorSpec};
    let mut m: Box<dyn Model> = Box::new(Prior(Layout::new(vec![TensorSpec::new(
        "prior",
        &[2],
        Init::Zeros,
    )])));
    let x = vec![0.0; 4];
    let y = vec![1, 1, 1, 0];
    let params = vec![0.0, 1.0];
    assert_eq!(accuracy(m.as_mut(), &params, &x, &y, 3), 0.75);
    let expected = (0.0f32.exp() + 1.0f32.exp()).ln() - 0.75;
    assert!((mean_loss(m.as_mut(), &params, &x, &y, 3) - expected).abs() < 1e-6);
}

/// Synthetic "images": 10 random prototypes in [0, 1]^784 plus per-pixel noise, clipped to [0, 1].
fn synthetic_images(rows: usize, seed: u64) -> (Vec<f32>, Vec<u32>) {
    let mut rng = TestRng::new(seed);
    let protos: Vec<f32> = (0..10 * 784).map(|_| rng.next_f32()).collect();
    let mut x = Vec::with_capacity(rows * 784);
    let mut y = Vec::with_capacity(rows);
    for _ in 0..rows {
        let c = rng.below(10) as usize;
        y.push(c as u32);
        for p in &protos[c * 784..(c + 1) * 784] {
            x.push((p + rng.symmetric(0.6)).clamp(0.0, 1.0));
        }
    }
    (x, y)
}

#[test]
fn adam_trains_the_784_256_128_10_mlp() {
    let (x, y) = synthetic_images(1024 + 512, 99);
    let (train_x, test_x) = x.split_at(1024 * 784);
    let (train_y, test_y) = y.split_at(1024);
    let mut m = Mlp::new(784, &[256, 128], 10);
    let mut params = m.layout().init_all(42);
    let n = params.len();
    let (mut grad, mut m1, mut m2) = (vec![0.0; n], vec![0.0f32; n], vec![0.0f32; n]);
    let (lr, b1, b2, eps) = (1e-3f32, 0.9f32, 0.999f32, 1e-8f32);
    let mut first = None;
    let mut last = 0.0;
    for t in 1..=40 {
        let start = ((t - 1) * 128) % 1024;
        let loss = m.loss_and_grad(
            &params,
            &train_x[start * 784..(start + 128) * 784],
            &train_y[start..start + 128],
            &mut grad,
        );
        first.get_or_insert(loss);
        last = loss;
        let (c1, c2) = (1.0 - b1.powi(t as i32), 1.0 - b2.powi(t as i32));
        for i in 0..n {
            m1[i] = b1 * m1[i] + (1.0 - b1) * grad[i];
            m2[i] = b2 * m2[i] + (1.0 - b2) * grad[i] * grad[i];
            params[i] -= lr * (m1[i] / c1) / ((m2[i] / c2).sqrt() + eps);
        }
    }
    let acc = accuracy(&mut m, &params, test_x, test_y, 1000);
    assert!(
        acc > 0.9,
        "held-out accuracy {acc}, loss {first:?} -> {last}"
    );
    assert!(last < 0.5 * first.unwrap());
}

#[test]
fn gradient_matches_finite_differences_of_the_model_itself() {
    // Central differences of the model's own f32 loss (no reference implementation involved).
    let mut m = Mlp::new(6, &[5, 4], 3);
    let params = test_params(&m, 31);
    let (x, y) = batch(6, 3, 7, 32);
    let mut grad = vec![0.0; params.len()];
    m.loss_and_grad(&params, &x, &y, &mut grad);
    let eps = 2e-3f32;
    for i in 0..params.len() {
        let mut p = params.clone();
        p[i] = params[i] + eps;
        let up = m.loss(&p, &x, &y);
        p[i] = params[i] - eps;
        let down = m.loss(&p, &x, &y);
        let fd = (up - down) / (2.0 * eps);
        assert!(
            (grad[i] - fd).abs() <= 1e-3 + 2e-2 * fd.abs(),
            "coordinate {i}: analytic {} vs finite difference {fd}",
            grad[i]
        );
    }
}

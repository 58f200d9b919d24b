//! The multi-layer perceptron: dense layers `fc{k}` with ReLU between them and softmax cross-entropy on top. Layer k
//! holds `fc{k}.weight` as a row-major `[in, out]` matrix (so the forward pass is `X · W`) and `fc{k}.bias` as `[out]`;
//! weights start He-uniform (bound `sqrt(6 / fan_in)`), biases at zero, both declared in the [`Layout`] so the server
//! initialises identically. Every product is one batched sgemm (`general_mat_mul`, matrixmultiply's SIMD kernels)
//! over ndarray views of the caller's parameter and gradient slices; the activation and error buffers grow to the
//! largest batch seen and are then reused, so the steady state allocates nothing of ours.

use ndarray::linalg::general_mat_mul;
use ndarray::{ArrayView2, ArrayViewMut2};
use std::ops::Range;
use tether_common::layout::{mlp_layout, Layout};

use super::Model;

/// A ReLU multi-layer perceptron with a softmax cross-entropy loss.
#[derive(Debug, Clone)]
pub struct Mlp {
    layout: Layout,
    /// Layer widths: `dims[0]` = features, `dims[last]` = classes.
    dims: Vec<usize>,
    weight: Vec<Range<usize>>,
    bias: Vec<Range<usize>>,
    /// `acts[k]`: output of layer k (after ReLU for hidden layers; the logits for the last), ≥ rows × dims[k + 1].
    acts: Vec<Vec<f32>>,
    /// `deltas[k]`: d loss / d (pre-activation of layer k), ≥ rows × dims[k + 1].
    deltas: Vec<Vec<f32>>,
}

impl Mlp {
    /// An MLP `features → hidden[0] → … → classes`; with no hidden layers it is multinomial logistic regression.
    ///
    /// # Panics
    /// If any width is zero.
    pub fn new(features: usize, hidden: &[usize], classes: usize) -> Self {
        let mut dims = Vec::with_capacity(hidden.len() + 2);
        dims.push(features);
        dims.extend_from_slice(hidden);
        dims.push(classes);
        assert!(
            dims.iter().all(|d| *d > 0),
            "Mlp::new: every layer width must be positive, got {dims:?}"
        );
        let layers = dims.len() - 1;
        // The same layout the shards build from the config: names, shapes and He-uniform bounds.
        let layout = mlp_layout(&dims);
        let weight = (0..layers).map(|k| layout.tensor_range(2 * k)).collect();
        let bias = (0..layers)
            .map(|k| layout.tensor_range(2 * k + 1))
            .collect();
        Self {
            layout,
            dims,
            weight,
            bias,
            acts: vec![Vec::new(); layers],
            deltas: vec![Vec::new(); layers],
        }
    }

    /// Layer widths, input first and classes last.
    pub fn dims(&self) -> &[usize] {
        &self.dims
    }

    /// Writes the logits (`rows × classes`, row-major) of the batch `x` into `out`.
    pub fn logits(&mut self, params: &[f32], x: &[f32], out: &mut [f32]) {
        let rows = self.check_batch(params, x);
        assert_eq!(
            out.len(),
            rows * self.classes(),
            "Mlp::logits: out must hold rows × classes values"
        );
        self.forward(params, x, rows);
        out.copy_from_slice(&self.acts[self.dims.len() - 2][..out.len()]);
    }

    fn layers(&self) -> usize {
        self.dims.len() - 1
    }

    /// Checks the slice lengths and returns the number of rows.
    fn check_batch(&self, params: &[f32], x: &[f32]) -> usize {
        assert_eq!(
            params.len(),
            self.layout.len(),
            "Mlp: params must hold layout().len() values"
        );
        let f = self.dims[0];
        assert_eq!(
            x.len() % f,
            0,
            "Mlp: x must hold whole rows of {f} features"
        );
        x.len() / f
    }

    /// Grows `bufs[k]` to at least `rows × dims[k + 1]` values; never shrinks.
    fn reserve(bufs: &mut [Vec<f32>], dims: &[usize], rows: usize) {
        for (k, buf) in bufs.iter_mut().enumerate() {
            let need = rows * dims[k + 1];
            if buf.len() < need {
                buf.resize(need, 0.0);
            }
        }
    }

    /// Fills `acts` for a batch of `rows` rows; afterwards `acts[last][..rows × classes]` holds the logits.
    fn forward(&mut self, params: &[f32], x: &[f32], rows: usize) {
        Self::reserve(&mut self.acts, &self.dims, rows);
        let layers = self.layers();
        for k in 0..layers {
            let (din, dout) = (self.dims[k], self.dims[k + 1]);
            // The layout gives tensor k exactly din × dout values, so the shape always fits.
            let w = ArrayView2::from_shape((din, dout), &params[self.weight[k].clone()])
                .expect("weight shape fits");
            let b = &params[self.bias[k].clone()];
            let (before, from_k) = self.acts.split_at_mut(k);
            let input: &[f32] = if k == 0 {
                x
            } else {
                &before[k - 1][..rows * din]
            };
            let out = &mut from_k[0][..rows * dout];
            {
                // Both buffers were sized to rows × width above.
                let xin = ArrayView2::from_shape((rows, din), input).expect("input shape fits");
                let mut z =
                    ArrayViewMut2::from_shape((rows, dout), &mut *out).expect("output shape fits");
                general_mat_mul(1.0, &xin, &w, 0.0, &mut z);
            }
            if k + 1 < layers {
                for row in out.chunks_exact_mut(dout) {
                    for (v, bj) in row.iter_mut().zip(b) {
                        *v = (*v + bj).max(0.0);
                    }
                }
            } else {
                for row in out.chunks_exact_mut(dout) {
                    for (v, bj) in row.iter_mut().zip(b) {
                        *v += bj;
                    }
                }
            }
        }
    }
}

/// Mean softmax cross-entropy of row-major `logits` (rows × classes) against `y`, via a max-shifted log-sum-exp.
/// With `dlogits`, also writes d mean-loss / d logits = (softmax − onehot) / rows.
pub(crate) fn softmax_xent(
    logits: &[f32],
    y: &[u32],
    classes: usize,
    mut dlogits: Option<&mut [f32]>,
) -> f32 {
    let rows = y.len();
    let inv_rows = 1.0 / rows as f32;
    let mut total = 0.0f64;
    for (i, (z, &label)) in logits.chunks_exact(classes).zip(y).enumerate() {
        let label = label as usize;
        assert!(
            label < classes,
            "softmax_xent: label {label} out of range for {classes} classes"
        );
        let m = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let s: f32 = z.iter().map(|v| (v - m).exp()).sum();
        let lse = m + s.ln();
        total += f64::from(lse - z[label]);
        if let Some(d) = dlogits.as_deref_mut() {
            let scale = inv_rows / s;
            let drow = &mut d[i * classes..(i + 1) * classes];
            for (dv, v) in drow.iter_mut().zip(z) {
                *dv = (v - m).exp() * scale;
            }
            drow[label] -= inv_rows;
        }
    }
    (total / rows as f64) as f32
}

/// Index of the largest value in each row (the first one on ties).
pub(crate) fn argmax_rows(values: &[f32], cols: usize, out: &mut [u32]) {
    for (row, o) in values.chunks_exact(cols).zip(out.iter_mut()) {
        let mut best = 0usize;
        for (j, v) in row.iter().enumerate().skip(1) {
            if *v > row[best] {
                best = j;
            }
        }
        *o = best as u32;
    }
}

impl Model for Mlp {
    fn layout(&self) -> &Layout {
        &self.layout
    }

    fn classes(&self) -> usize {
        self.dims[self.dims.len() - 1]
    }

    fn features(&self) -> usize {
        self.dims[0]
    }

    fn loss_and_grad(&mut self, params: &[f32], x: &[f32], y: &[u32], grad: &mut [f32]) -> f32 {
        let rows = self.check_batch(params, x);
        assert_eq!(y.len(), rows, "Mlp::loss_and_grad: one label per row");
        assert_eq!(
            grad.len(),
            self.layout.len(),
            "Mlp::loss_and_grad: grad must hold layout().len() values"
        );
        if rows == 0 {
            grad.fill(0.0);
            return 0.0;
        }
        self.forward(params, x, rows);
        Self::reserve(&mut self.deltas, &self.dims, rows);
        let layers = self.layers();
        let classes = self.classes();
        let loss = softmax_xent(
            &self.acts[layers - 1][..rows * classes],
            y,
            classes,
            Some(&mut self.deltas[layers - 1][..rows * classes]),
        );
        for k in (0..layers).rev() {
            let (din, dout) = (self.dims[k], self.dims[k + 1]);
            let (below, from_k) = self.deltas.split_at_mut(k);
            let delta_buf = &from_k[0][..rows * dout];
            // All views below cover buffers or layout ranges sized exactly to their shapes.
            let delta = ArrayView2::from_shape((rows, dout), delta_buf).expect("delta shape fits");
            let input: &[f32] = if k == 0 {
                x
            } else {
                &self.acts[k - 1][..rows * din]
            };
            let xin = ArrayView2::from_shape((rows, din), input).expect("input shape fits");
            {
                let mut gw =
                    ArrayViewMut2::from_shape((din, dout), &mut grad[self.weight[k].clone()])
                        .expect("weight grad shape fits");
                general_mat_mul(1.0, &xin.t(), &delta, 0.0, &mut gw);
            }
            let gb = &mut grad[self.bias[k].clone()];
            gb.fill(0.0);
            for row in delta_buf.chunks_exact(dout) {
                for (g, d) in gb.iter_mut().zip(row) {
                    *g += d;
                }
            }
            if k > 0 {
                let w = ArrayView2::from_shape((din, dout), &params[self.weight[k].clone()])
                    .expect("weight shape fits");
                let prev = &mut below[k - 1][..rows * din];
                {
                    let mut dprev = ArrayViewMut2::from_shape((rows, din), &mut *prev)
                        .expect("delta shape fits");
                    general_mat_mul(1.0, &delta, &w.t(), 0.0, &mut dprev);
                }
                // ReLU'(z) = [z > 0] = [relu(z) > 0].
                for (d, a) in prev.iter_mut().zip(&self.acts[k - 1][..rows * din]) {
                    if *a <= 0.0 {
                        *d = 0.0;
                    }
                }
            }
        }
        loss
    }

    fn predict(&mut self, params: &[f32], x: &[f32], out: &mut [u32]) {
        let rows = self.check_batch(params, x);
        assert_eq!(
            out.len(),
            rows,
            "Mlp::predict: out must hold one class per row"
        );
        if rows == 0 {
            return;
        }
        self.forward(params, x, rows);
        let classes = self.classes();
        argmax_rows(
            &self.acts[self.layers() - 1][..rows * classes],
            classes,
            out,
        );
    }

    fn loss(&mut self, params: &[f32], x: &[f32], y: &[u32]) -> f32 {
        let rows = self.check_batch(params, x);
        assert_eq!(y.len(), rows, "Mlp::loss: one label per row");
        if rows == 0 {
            return 0.0;
        }
        self.forward(params, x, rows);
        let classes = self.classes();
        softmax_xent(
            &self.acts[self.layers() - 1][..rows * classes],
            y,
            classes,
            None,
        )
    }
}

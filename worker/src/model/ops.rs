//! Fused CPU kernels for candle models, each with its backward: the tanh-approximated GELU, the row bias add, layer
//! norm, the scaled causal softmax and softmax cross-entropy. Candle builds these from elementwise primitives whose
//! backward passes reduce over broadcast dimensions with a generic strided loop; in a GPT step (perf,
//! `examples/gpt_step`) GELU's `tanh`/`powf` took 23 % and the broadcast reductions 15 %. Each kernel here is one
//! row-major pass forward and one or two backward, recomputing what it needs (row statistics, probabilities) rather
//! than storing it. GELU and the bias add work in every storage dtype (math in f32); the norm, softmax and loss take
//! f32, as the mixed-precision policy keeps them.
//!
//! Every row-wise pass runs on the current rayon pool (the worker's compute pool, [`crate::threads::ComputePool`])
//! once a tensor holds [`PAR_MIN`] values: rows are independent, so the split changes no result bit.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Shape, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;

/// Values from which a row-wise pass is split across the pool's threads (below it a split costs more than it saves).
pub const PAR_MIN: usize = 1 << 14;

/// A new `len`-value buffer filled row by row: `f(r, row)` writes row `r` (`cols` values; the last row may be
/// shorter). On the current rayon pool when `len ≥ PAR_MIN`, in blocks of at least `PAR_MIN / 4` values.
fn rows_into<U: Copy + Default + Send>(
    len: usize,
    cols: usize,
    f: impl Fn(usize, &mut [U]) + Sync,
) -> Vec<U> {
    let cols = cols.max(1);
    let mut out = vec![U::default(); len];
    if len >= PAR_MIN {
        out.par_chunks_mut(cols)
            .enumerate()
            .with_min_len((PAR_MIN / 4 / cols).max(1))
            .for_each(|(r, o)| f(r, o));
    } else {
        out.chunks_mut(cols).enumerate().for_each(|(r, o)| f(r, o));
    }
    out
}

/// Chunk of a flat elementwise map.
const MAP_COLS: usize = 1024;

/// √(2/π).
const SQRT_2_OVER_PI: f32 = 0.797_884_6;
/// GELU's cubic coefficient.
const GELU_C: f32 = 0.044_715;

/// A storage element whose arithmetic is done in f32.
trait Elem: Copy + Send + Sync + 'static {
    fn get(self) -> f32;
    fn put(v: f32) -> Self;
}

impl Elem for f32 {
    fn get(self) -> f32 {
        self
    }
    fn put(v: f32) -> Self {
        v
    }
}

impl Elem for bf16 {
    fn get(self) -> f32 {
        self.to_f32()
    }
    fn put(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

impl Elem for f16 {
    fn get(self) -> f32 {
        self.to_f32()
    }
    fn put(v: f32) -> Self {
        f16::from_f32(v)
    }
}

/// One float storage (f32, bf16, f16), contiguous, through a body generic in its element type; keeps the dtype.
macro_rules! per_float {
    ($s:expr, $l:expr, $op:expr, |$v:ident| $body:expr) => {
        match $s {
            CpuStorage::F32(v) => {
                let $v = contiguous(v, $l, $op)?;
                CpuStorage::F32($body)
            }
            CpuStorage::BF16(v) => {
                let $v = contiguous(v, $l, $op)?;
                CpuStorage::BF16($body)
            }
            CpuStorage::F16(v) => {
                let $v = contiguous(v, $l, $op)?;
                CpuStorage::F16($body)
            }
            _ => candle_core::bail!("{}: unsupported dtype", $op),
        }
    };
}

/// Two float storages of the same dtype, contiguous, through a body generic in their element type.
macro_rules! per_float2 {
    ($s1:expr, $l1:expr, $s2:expr, $l2:expr, $op:expr, |$a:ident, $b:ident| $body:expr) => {
        match ($s1, $s2) {
            (CpuStorage::F32(x), CpuStorage::F32(y)) => {
                let ($a, $b) = (contiguous(x, $l1, $op)?, contiguous(y, $l2, $op)?);
                CpuStorage::F32($body)
            }
            (CpuStorage::BF16(x), CpuStorage::BF16(y)) => {
                let ($a, $b) = (contiguous(x, $l1, $op)?, contiguous(y, $l2, $op)?);
                CpuStorage::BF16($body)
            }
            (CpuStorage::F16(x), CpuStorage::F16(y)) => {
                let ($a, $b) = (contiguous(x, $l1, $op)?, contiguous(y, $l2, $op)?);
                CpuStorage::F16($body)
            }
            _ => candle_core::bail!("{}: mismatched or unsupported dtypes", $op),
        }
    };
}

/// `tanh(u)` from one exponential, saturating cleanly for large |u|.
#[inline]
fn tanh(u: f32) -> f32 {
    let u = u.clamp(-15.0, 15.0);
    let e = (2.0 * u).exp();
    (e - 1.0) / (e + 1.0)
}

#[inline]
fn gelu(x: f32) -> f32 {
    let t = tanh(SQRT_2_OVER_PI * x * (1.0 + GELU_C * x * x));
    0.5 * x * (1.0 + t)
}

#[inline]
fn gelu_grad(x: f32) -> f32 {
    let x2 = x * x;
    let t = tanh(SQRT_2_OVER_PI * x * (1.0 + GELU_C * x2));
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_C * x2)
}

/// The contiguous elements of `layout` in `v`.
fn contiguous<'a, T>(v: &'a [T], layout: &Layout, op: &str) -> candle_core::Result<&'a [T]> {
    match layout.contiguous_offsets() {
        Some((a, b)) => Ok(&v[a..b]),
        None => candle_core::bail!("{op}: needs a contiguous input"),
    }
}

fn map1<T: Elem + Default>(x: &[T], f: impl Fn(f32) -> f32 + Sync) -> Vec<T> {
    rows_into(x.len(), MAP_COLS, |r, o| {
        let xs = &x[r * MAP_COLS..];
        for (d, &v) in o.iter_mut().zip(xs) {
            *d = T::put(f(v.get()));
        }
    })
}

fn map2<T: Elem + Default>(x: &[T], g: &[T], f: impl Fn(f32, f32) -> f32 + Sync) -> Vec<T> {
    let n = x.len().min(g.len());
    rows_into(n, MAP_COLS, |r, o| {
        let (xs, gs) = (&x[r * MAP_COLS..], &g[r * MAP_COLS..]);
        for ((d, &a), &b) in o.iter_mut().zip(xs).zip(gs) {
            *d = T::put(f(a.get(), b.get()));
        }
    })
}

/// GELU (tanh approximation), forward.
struct Gelu;

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "tether-gelu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let out = per_float!(s, l, "gelu", |v| map1(v, gelu));
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _: &Tensor, dy: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let dy = dy.contiguous()?;
        Ok(Some(x.apply_op2_no_bwd(&dy, &GeluBackward)?))
    }
}

/// `dy · gelu'(x)`.
struct GeluBackward;

impl CustomOp2 for GeluBackward {
    fn name(&self) -> &'static str {
        "tether-gelu-backward"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let f = |x: f32, g: f32| g * gelu_grad(x);
        let out = per_float2!(s1, l1, s2, l2, "gelu backward", |x, g| map2(x, g, f));
        Ok((out, l1.shape().clone()))
    }
}

/// GELU (tanh approximation) of `x`, differentiable, fused forward and backward.
pub fn fused_gelu(x: &Tensor) -> candle_core::Result<Tensor> {
    let x = x.contiguous()?;
    x.apply_op1(Gelu)
}

/// Row-major `[rows, cols]` view of a contiguous f32 tensor storage.
fn f32s<'a>(s: &'a CpuStorage, l: &Layout, op: &str) -> candle_core::Result<&'a [f32]> {
    match s {
        CpuStorage::F32(v) => contiguous(v, l, op),
        _ => candle_core::bail!("{op}: needs f32"),
    }
}

/// `(rows, cols)` of a tensor whose last dimension is `cols`.
fn rows_cols(l: &Layout) -> (usize, usize) {
    let cols = l.dims().last().copied().unwrap_or(1).max(1);
    (l.shape().elem_count() / cols, cols)
}

/// `x + b` with `b` broadcast over the rows of `x` (`b.len()` = the last dimension).
struct BiasAdd;

impl CustomOp2 for BiasAdd {
    fn name(&self) -> &'static str {
        "tether-bias-add"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        fn add<T: Elem + Default>(x: &[T], b: &[T]) -> Vec<T> {
            let c = b.len();
            rows_into(x.len(), c, |r, o| {
                for ((d, &a), &bk) in o.iter_mut().zip(&x[r * c..]).zip(b) {
                    *d = T::put(a.get() + bk.get());
                }
            })
        }
        let (_, cols) = rows_cols(l1);
        if l2.shape().elem_count() != cols {
            candle_core::bail!(
                "bias add: bias of {} for rows of {cols}",
                l2.shape().elem_count()
            )
        }
        let out = per_float2!(s1, l1, s2, l2, "bias add", |x, b| add(x, b));
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        _: &Tensor,
        b: &Tensor,
        _: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let db = dy
            .contiguous()?
            .apply_op1_no_bwd(&ColumnSum)?
            .reshape(b.shape())?;
        Ok((Some(dy.clone()), Some(db)))
    }
}

/// Sums a `[rows, cols]` tensor over its rows (f32 accumulation), into the same dtype.
struct ColumnSum;

impl CustomOp1 for ColumnSum {
    fn name(&self) -> &'static str {
        "tether-column-sum"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        fn sum<T: Elem>(x: &[T], cols: usize) -> Vec<T> {
            let mut acc = vec![0f32; cols];
            for row in x.chunks_exact(cols) {
                for (a, &v) in acc.iter_mut().zip(row) {
                    *a += v.get();
                }
            }
            acc.into_iter().map(T::put).collect()
        }
        let (_, cols) = rows_cols(l);
        let out = per_float!(s, l, "column sum", |v| sum(v, cols));
        Ok((out, Shape::from(cols)))
    }
}

/// `x + b` over rows, differentiable (the bias gradient is a column sum).
pub fn bias_add(x: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    x.contiguous()?.apply_op2(&b.contiguous()?, BiasAdd)
}

/// Layer norm over the last dimension of an f32 tensor: `(x − mean) / √(var + eps) · w + b`.
struct LayerNorm {
    eps: f32,
}

/// Mean and 1/√(var + eps) of one row.
#[inline]
fn row_stats(row: &[f32], eps: f32) -> (f32, f32) {
    let n = row.len() as f32;
    let mean = row.iter().sum::<f32>() / n;
    let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
    (mean, 1.0 / (var + eps).sqrt())
}

impl candle_core::CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "tether-layer-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (x, w, b) = (
            f32s(s1, l1, "layer norm")?,
            f32s(s2, l2, "layer norm")?,
            f32s(s3, l3, "layer norm")?,
        );
        let (_, c) = rows_cols(l1);
        if w.len() != c || b.len() != c {
            candle_core::bail!(
                "layer norm: gain/bias of {}/{} for rows of {c}",
                w.len(),
                b.len()
            )
        }
        let eps = self.eps;
        let out = rows_into(x.len(), c, |r, o| {
            let row = &x[r * c..(r + 1) * c];
            let (mean, rstd) = row_stats(row, eps);
            for (((d, &v), &g), &bk) in o.iter_mut().zip(row).zip(w).zip(b) {
                *d = (v - mean) * rstd * g + bk;
            }
        });
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _: &Tensor,
        _: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dy = dy.contiguous()?;
        let dx = x.apply_op3_no_bwd(w, &dy, &LayerNormDx { eps: self.eps })?;
        let dwb = x.apply_op2_no_bwd(&dy, &LayerNormDwDb { eps: self.eps })?;
        let c = w.dims1()?;
        Ok((
            Some(dx),
            Some(dwb.narrow(0, 0, c)?),
            Some(dwb.narrow(0, c, c)?),
        ))
    }
}

/// The input gradient of [`LayerNorm`]: `rstd · (dx̂ − mean(dx̂) − x̂ · mean(dx̂ · x̂))` with `dx̂ = dy · w`.
struct LayerNormDx {
    eps: f32,
}

impl candle_core::CustomOp3 for LayerNormDx {
    fn name(&self) -> &'static str {
        "tether-layer-norm-dx"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (x, w, dy) = (
            f32s(s1, l1, "layer norm")?,
            f32s(s2, l2, "layer norm")?,
            f32s(s3, l3, "layer norm")?,
        );
        let (_, c) = rows_cols(l1);
        let n = c as f32;
        let eps = self.eps;
        let out = rows_into(x.len(), c, |r, o| {
            let (row, g) = (&x[r * c..(r + 1) * c], &dy[r * c..(r + 1) * c]);
            let (mean, rstd) = row_stats(row, eps);
            let (mut m1, mut m2) = (0f32, 0f32);
            for ((&v, &gy), &wk) in row.iter().zip(g).zip(w) {
                let dxh = gy * wk;
                m1 += dxh;
                m2 += dxh * (v - mean) * rstd;
            }
            let (m1, m2) = (m1 / n, m2 / n);
            for (((d, &v), &gy), &wk) in o.iter_mut().zip(row).zip(g).zip(w) {
                *d = rstd * (gy * wk - m1 - (v - mean) * rstd * m2);
            }
        });
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}

/// The gain and bias gradients of [`LayerNorm`], packed `[dw; db]` (`2·cols`).
struct LayerNormDwDb {
    eps: f32,
}

impl CustomOp2 for LayerNormDwDb {
    fn name(&self) -> &'static str {
        "tether-layer-norm-dwdb"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (x, dy) = (f32s(s1, l1, "layer norm")?, f32s(s2, l2, "layer norm")?);
        let (_, c) = rows_cols(l1);
        let mut out = vec![0f32; 2 * c];
        let (dw, db) = out.split_at_mut(c);
        for (row, g) in x.chunks_exact(c).zip(dy.chunks_exact(c)) {
            let (mean, rstd) = row_stats(row, self.eps);
            for k in 0..c {
                dw[k] += g[k] * (row[k] - mean) * rstd;
                db[k] += g[k];
            }
        }
        Ok((CpuStorage::F32(out), Shape::from(2 * c)))
    }
}

/// Layer norm of the last dimension of f32 `x` with gain `w` and bias `b` (`[cols]`), differentiable.
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f32) -> candle_core::Result<Tensor> {
    x.contiguous()?.apply_op3(w, b, LayerNorm { eps })
}

/// `softmax(scale · s + causal mask)` over the last dimension of f32 scores `[.., T, T]`: row `i` sees columns `≤ i`.
struct CausalSoftmax {
    scale: f32,
}

impl CustomOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "tether-causal-softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = f32s(s, l, "causal softmax")?;
        let (_, t) = rows_cols(l);
        let scale = self.scale;
        let out = rows_into(x.len(), t, |r, o| {
            let i = r % t;
            let seen = &x[r * t..r * t + i + 1];
            let max = seen.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) * scale;
            let mut sum = 0f32;
            for (d, &v) in o[..=i].iter_mut().zip(seen) {
                *d = (v * scale - max).exp();
                sum += *d;
            }
            let inv = 1.0 / sum;
            o[..=i].iter_mut().for_each(|d| *d *= inv);
        });
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }

    fn bwd(&self, _: &Tensor, y: &Tensor, dy: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let dy = dy.contiguous()?;
        Ok(Some(y.apply_op2_no_bwd(
            &dy,
            &SoftmaxBackward { scale: self.scale },
        )?))
    }
}

/// `scale · y ⊙ (dy − Σ dy ⊙ y)` per row.
struct SoftmaxBackward {
    scale: f32,
}

impl CustomOp2 for SoftmaxBackward {
    fn name(&self) -> &'static str {
        "tether-softmax-backward"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (y, dy) = (f32s(s1, l1, "softmax")?, f32s(s2, l2, "softmax")?);
        let (_, t) = rows_cols(l1);
        let scale = self.scale;
        let out = rows_into(y.len(), t, |r, o| {
            let (yr, gr) = (&y[r * t..(r + 1) * t], &dy[r * t..(r + 1) * t]);
            let dot: f32 = yr.iter().zip(gr).map(|(a, b)| a * b).sum();
            for ((d, &a), &b) in o.iter_mut().zip(yr).zip(gr) {
                *d = scale * a * (b - dot);
            }
        });
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}

/// Causal softmax of f32 attention scores `[.., T, T]` scaled by `scale`, differentiable.
pub fn causal_softmax(scores: &Tensor, scale: f32) -> candle_core::Result<Tensor> {
    scores.contiguous()?.apply_op1(CausalSoftmax { scale })
}

/// Mean softmax cross-entropy of f32 logits `[n, classes]` against u32 targets `[n]` (a scalar).
struct CrossEntropy;

/// `(log Σ exp, max)` of one row.
#[inline]
fn log_sum_exp(row: &[f32]) -> f32 {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    max + row.iter().map(|v| (v - max).exp()).sum::<f32>().ln()
}

fn targets<'a>(s: &'a CpuStorage, l: &Layout) -> candle_core::Result<&'a [u32]> {
    match s {
        CpuStorage::U32(v) => contiguous(v, l, "cross entropy"),
        _ => candle_core::bail!("cross entropy: targets must be u32"),
    }
}

impl CustomOp2 for CrossEntropy {
    fn name(&self) -> &'static str {
        "tether-cross-entropy"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (z, y) = (f32s(s1, l1, "cross entropy")?, targets(s2, l2)?);
        let (n, c) = rows_cols(l1);
        if y.len() != n || y.iter().any(|&t| t as usize >= c) {
            candle_core::bail!("cross entropy: {} targets below {c} for {n} rows", y.len())
        }
        let row_loss = |(row, &t): (&[f32], &u32)| f64::from(log_sum_exp(row) - row[t as usize]);
        // Summed in row order in both cases (rayon's sum of a collected Vec would reorder the f64 additions).
        let total: f64 = if z.len() >= PAR_MIN {
            let losses: Vec<f64> = z.par_chunks_exact(c).zip(y).map(row_loss).collect();
            losses.iter().sum()
        } else {
            z.chunks_exact(c).zip(y).map(row_loss).sum()
        };
        Ok((
            CpuStorage::F32(vec![(total / n.max(1) as f64) as f32]),
            Shape::from(()),
        ))
    }

    fn bwd(
        &self,
        z: &Tensor,
        y: &Tensor,
        _: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let scale = g.to_dtype(candle_core::DType::F32)?.to_scalar::<f32>()?;
        let dz = z.apply_op2_no_bwd(y, &CrossEntropyBackward { scale })?;
        Ok((Some(dz), None))
    }
}

/// `scale · (softmax(z) − onehot(y)) / n`.
struct CrossEntropyBackward {
    scale: f32,
}

impl CustomOp2 for CrossEntropyBackward {
    fn name(&self) -> &'static str {
        "tether-cross-entropy-backward"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (z, y) = (f32s(s1, l1, "cross entropy")?, targets(s2, l2)?);
        let (n, c) = rows_cols(l1);
        let k = self.scale / n.max(1) as f32;
        let out = rows_into(z.len(), c, |r, o| {
            let row = &z[r * c..(r + 1) * c];
            let lse = log_sum_exp(row);
            for (d, &v) in o.iter_mut().zip(row) {
                *d = (v - lse).exp() * k;
            }
            o[y[r] as usize] -= k;
        });
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}

/// Mean softmax cross-entropy of f32 `logits` `[n, classes]` against u32 `targets` `[n]`, differentiable in the
/// logits.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
    logits
        .contiguous()?
        .apply_op2(&targets.contiguous()?, CrossEntropy)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn fused_gelu_matches_candles_and_so_does_its_gradient() {
        let v: Vec<f32> = (0..401).map(|i| (i as f32 - 200.0) / 25.0).collect();
        let x = Var::from_vec(v, 401, &Device::Cpu).unwrap();
        let ours = fused_gelu(x.as_tensor()).unwrap();
        let theirs = x.as_tensor().gelu().unwrap();
        let d = (&ours - &theirs).unwrap().abs().unwrap().max(0).unwrap();
        assert!(d.to_scalar::<f32>().unwrap() < 1e-5);
        let w = Tensor::arange(0f32, 401., &Device::Cpu).unwrap();
        let g1 = ours.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
        let g2 = theirs
            .mul(&w)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let (a, b) = (g1.get(&x).unwrap(), g2.get(&x).unwrap());
        let rel = ((a - b)
            .unwrap()
            .abs()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap())
            / 400.0;
        assert!(
            rel < 1e-5,
            "gradient differs by {rel} (relative to the largest weight)"
        );
    }

    /// Gradients of `Σ w ⊙ f(x)` through our op and through candle's primitives agree.
    fn same_grads(
        ours: impl Fn(&Tensor) -> Tensor,
        theirs: impl Fn(&Tensor) -> Tensor,
        shape: (usize, usize),
    ) {
        let n = shape.0 * shape.1;
        let v: Vec<f32> = (0..n)
            .map(|i| ((i * 7919) % 113) as f32 / 30.0 - 1.8)
            .collect();
        let x = Var::from_vec(v, shape, &Device::Cpu).unwrap();
        let w = Tensor::from_vec(
            (0..n)
                .map(|i| ((i * 31) % 17) as f32 / 17.0 - 0.5)
                .collect::<Vec<_>>(),
            shape,
            &Device::Cpu,
        )
        .unwrap();
        let (a, b) = (ours(x.as_tensor()), theirs(x.as_tensor()));
        let fwd = (&a - &b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(fwd < 1e-5, "forward differs by {fwd}");
        let ga = a
            .broadcast_mul(&w)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let gb = b
            .broadcast_mul(&w)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let (ga, gb) = (
            ga.get(&x).expect("our op's gradient"),
            gb.get(&x).expect("candle's gradient"),
        );
        let d = (ga - gb)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(d < 1e-5, "gradient differs by {d}");
    }

    #[test]
    fn fused_layer_norm_softmax_bias_and_loss_match_candles_primitives() {
        let dev = Device::Cpu;
        let c = 12;
        let gain = Var::from_vec(
            (0..c).map(|i| 0.5 + i as f32 / 10.0).collect::<Vec<_>>(),
            c,
            &dev,
        )
        .unwrap();
        let bias = Var::from_vec(
            (0..c).map(|i| i as f32 / 20.0 - 0.3).collect::<Vec<_>>(),
            c,
            &dev,
        )
        .unwrap();
        same_grads(
            |x| layer_norm(x, &gain, &bias, 1e-5).unwrap(),
            |x| {
                let mean = x.mean_keepdim(1).unwrap();
                let xc = x.broadcast_sub(&mean).unwrap();
                let var = xc.sqr().unwrap().mean_keepdim(1).unwrap();
                xc.broadcast_div(&(var + 1e-5).unwrap().sqrt().unwrap())
                    .unwrap()
                    .broadcast_mul(&gain)
                    .unwrap()
                    .broadcast_add(&bias)
                    .unwrap()
            },
            (7, c),
        );
        same_grads(
            |x| bias_add(x, &bias).unwrap(),
            |x| x.broadcast_add(&bias).unwrap(),
            (5, c),
        );
        // Causal softmax: rows of [T, T] blocks, T = 6, two blocks.
        let t = 6;
        let mask: Vec<f32> = (0..t * t)
            .map(|k| {
                if k % t > k / t {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let mask = Tensor::from_vec(mask, (t, t), &dev).unwrap();
        same_grads(
            |x| {
                causal_softmax(&x.reshape((2, t, t)).unwrap(), 0.5)
                    .unwrap()
                    .reshape((2 * t, t))
                    .unwrap()
            },
            |x| {
                let s = (x.reshape((2, t, t)).unwrap() * 0.5)
                    .unwrap()
                    .broadcast_add(&mask)
                    .unwrap();
                // Candle's fused softmax has no backward: the primitives.
                let max = s.max_keepdim(2).unwrap().detach();
                let e = s.broadcast_sub(&max).unwrap().exp().unwrap();
                let sum = e.sum_keepdim(2).unwrap();
                e.broadcast_div(&sum).unwrap().reshape((2 * t, t)).unwrap()
            },
            (2 * t, t),
        );
        // Gain and bias gradients of the layer norm, and the loss and its gradient, against candle's.
        let x = Var::from_vec(
            (0..7 * c)
                .map(|i| ((i * 13) % 29) as f32 / 9.0 - 1.5)
                .collect::<Vec<_>>(),
            (7, c),
            &dev,
        )
        .unwrap();
        let y = Tensor::from_vec(vec![0u32, 3, 11, 5, 5, 2, 9], 7, &dev).unwrap();
        let ours =
            cross_entropy(&layer_norm(x.as_tensor(), &gain, &bias, 1e-5).unwrap(), &y).unwrap();
        let ln = {
            let mean = x.mean_keepdim(1).unwrap();
            let xc = x.broadcast_sub(&mean).unwrap();
            let var = xc.sqr().unwrap().mean_keepdim(1).unwrap();
            xc.broadcast_div(&(var + 1e-5).unwrap().sqrt().unwrap())
                .unwrap()
                .broadcast_mul(&gain)
                .unwrap()
                .broadcast_add(&bias)
                .unwrap()
        };
        let theirs = candle_nn::loss::cross_entropy(&ln, &y).unwrap();
        let (lo, lt) = (
            ours.to_scalar::<f32>().unwrap(),
            theirs.to_scalar::<f32>().unwrap(),
        );
        assert!((lo - lt).abs() < 1e-5, "loss {lo} vs {lt}");
        let (go, gt) = (
            (ours * 3.0).unwrap().backward().unwrap(),
            (theirs * 3.0).unwrap().backward().unwrap(),
        );
        for v in [&x, &gain, &bias] {
            let d = (go.get(v).unwrap() - gt.get(v).unwrap())
                .unwrap()
                .abs()
                .unwrap()
                .flatten_all()
                .unwrap()
                .max(0)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(d < 1e-5, "gradient differs by {d}");
        }
    }

    /// Every fused kernel forward and backward on a tensor large enough to be split, as f32 bits.
    fn kernels_bits() -> Vec<Vec<u32>> {
        let (rows, c) = (4 * PAR_MIN / 64, 64);
        let vals: Vec<f32> = (0..rows * c)
            .map(|i| ((i * 7919 % 1009) as f32 / 1009.0 - 0.5) * 3.0)
            .collect();
        let x = Var::from_vec(vals, (rows / 64, 64, c), &Device::Cpu).unwrap();
        let w = Var::from_vec(
            (0..c).map(|i| 1.0 + i as f32 * 0.01).collect(),
            c,
            &Device::Cpu,
        )
        .unwrap();
        let b = Var::from_vec((0..c).map(|i| i as f32 * -0.02).collect(), c, &Device::Cpu).unwrap();
        let targets = Tensor::from_vec(
            (0..rows as u32)
                .map(|i| i * 31 % c as u32)
                .collect::<Vec<_>>(),
            rows,
            &Device::Cpu,
        )
        .unwrap();
        let h = layer_norm(x.as_tensor(), w.as_tensor(), b.as_tensor(), 1e-5).unwrap();
        let h =
            fused_gelu(&bias_add(&h.reshape((rows, c)).unwrap(), b.as_tensor()).unwrap()).unwrap();
        let a = causal_softmax(&h.reshape((rows / 64, 64, c)).unwrap(), 0.3).unwrap();
        let loss = cross_entropy(&a.reshape((rows, c)).unwrap(), &targets).unwrap();
        let grads = loss.backward().unwrap();
        let bits = |t: &Tensor| -> Vec<u32> {
            t.flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .into_iter()
                .map(f32::to_bits)
                .collect()
        };
        let mut out = vec![bits(&a), bits(&loss)];
        for v in [&x, &w, &b] {
            out.push(bits(grads.get(v.as_tensor()).unwrap()));
        }
        out
    }

    #[test]
    fn splitting_the_rows_across_threads_changes_no_bit() {
        let pool = |n| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(n)
                .build()
                .unwrap()
        };
        let one = pool(1).install(kernels_bits);
        let three = pool(3).install(kernels_bits);
        assert!(one.len() == 5 && one[0].len() >= PAR_MIN && one[2].len() >= PAR_MIN);
        assert_eq!(one, three);
    }
}

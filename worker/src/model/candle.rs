//! Candle models behind the [`Model`] trait. [`CandleModel`] builds a user's ordinary candle module through a
//! recording `VarBuilder`: every tensor the module asks for becomes a candle `Var` and a [`TensorSpec`] of Tether's
//! flat layout (its name, shape, and the init translated from candle's), in the order asked. On every step the
//! caller's flat parameters are written into the vars in place (one copy, converting to the compute dtype; no
//! staging tensor), the module's loss is back-propagated by candle's autograd, and each var's gradient is copied
//! once into the caller's flat gradient (converting back to f32 and undoing the loss scale). With bf16/f16 compute a
//! [`LossScaler`] implements dynamic loss scaling: an overflowed gradient is handed on non-finite (so the step is
//! skipped, as any non-finite gradient is) and halves the scale; `window` clean steps double it. The scaler is pure
//! logic with its own tests.

use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Device, InplaceOp1, Layout as CLayout, Shape, Tensor, Var};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;
use half::{bf16, f16};

use tether_common::config::ComputePrecision;
use tether_common::layout::{Init, Layout, TensorSpec};

use super::Model;

/// Errors building a candle model.
#[derive(Debug, thiserror::Error)]
pub enum CandleError {
    /// Candle itself failed.
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    /// The module asked for a tensor the prescribed layout does not have (or with another shape).
    #[error("tensor {name:?} {shape:?} does not match the layout: {reason}")]
    Layout {
        /// The tensor's name.
        name: String,
        /// Its shape as asked.
        shape: Vec<usize>,
        /// What differs.
        reason: String,
    },
    /// The configuration cannot build this model (e.g. bf16 for a hand-written model).
    #[error(transparent)]
    Config(#[from] tether_common::config::ConfigError),
    /// The module asked for an init Tether cannot reproduce deterministically on the shards.
    #[error("tensor {name:?}: unsupported init {init}")]
    Init {
        /// The tensor's name.
        name: String,
        /// The init, as candle describes it.
        init: String,
    },
}

/// A candle module trained through Tether: the loss of a batch and a prediction per row. Inputs are Tether's
/// row-major batches (`rows × features` f32 values, one label per row); the module builds its own input tensors.
pub trait CandleModule: Send {
    /// The mean loss over the batch as a scalar tensor (any float dtype); it is back-propagated.
    fn loss(&self, x: &[f32], y: &[u32], rows: usize) -> candle_core::Result<Tensor>;
    /// The predicted class of every row, into `out` (`out.len() == rows`).
    fn predict(&self, x: &[f32], rows: usize, out: &mut [u32]) -> candle_core::Result<()>;
}

/// Loss-scaler statistics, reported by models that compute in bf16/f16.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrecisionStats {
    /// The compute precision.
    pub precision: ComputePrecision,
    /// The loss scale now.
    pub loss_scale: f32,
    /// Steps skipped because the scaled gradient overflowed (each halved the scale).
    pub overflows: u64,
    /// Times the scale doubled after a clean window.
    pub growths: u64,
}

/// Dynamic loss scaling (pure): halve on overflow, double after `window` clean steps, within `[1, 2^24]`.
#[derive(Debug, Clone, PartialEq)]
pub struct LossScaler {
    scale: f32,
    window: u32,
    clean: u32,
    overflows: u64,
    growths: u64,
}

/// Largest loss scale (2^24).
pub const MAX_LOSS_SCALE: f32 = 16_777_216.0;

impl LossScaler {
    /// A scaler starting at `scale` (clamped to `[1, 2^24]`) that doubles after `window` clean steps.
    pub fn new(scale: f32, window: u32) -> Self {
        Self {
            scale: scale.clamp(1.0, MAX_LOSS_SCALE),
            window: window.max(1),
            clean: 0,
            overflows: 0,
            growths: 0,
        }
    }

    /// The current scale.
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// Records a step whose unscaled gradient was `finite` (or not); returns whether the step may be applied.
    pub fn update(&mut self, finite: bool) -> bool {
        if !finite {
            self.scale = (self.scale * 0.5).max(1.0);
            self.clean = 0;
            self.overflows += 1;
            return false;
        }
        self.clean += 1;
        if self.clean >= self.window {
            self.clean = 0;
            if self.scale < MAX_LOSS_SCALE {
                self.scale = (self.scale * 2.0).min(MAX_LOSS_SCALE);
                self.growths += 1;
            }
        }
        true
    }

    /// Overflows and growths so far.
    pub fn counts(&self) -> (u64, u64) {
        (self.overflows, self.growths)
    }
}

/// The candle dtype of a compute precision.
pub fn dtype_of(p: ComputePrecision) -> DType {
    match p {
        ComputePrecision::F32 => DType::F32,
        ComputePrecision::Bf16 => DType::BF16,
        ComputePrecision::F16 => DType::F16,
    }
}

/// A tensor a module asked for, recorded by [`Recorder`].
struct Recorded {
    spec: TensorSpec,
    var: Var,
}

/// The `VarBuilder` backend that records every tensor asked for (and, with a prescribed layout, checks it).
struct Recorder {
    vars: Arc<Mutex<Vec<Recorded>>>,
    prescribed: Option<Layout>,
    errors: Arc<Mutex<Vec<CandleError>>>,
}

impl Recorder {
    fn fail(&self, e: CandleError) -> candle_core::Error {
        let msg = e.to_string();
        if let Ok(mut errs) = self.errors.lock() {
            errs.push(e);
        }
        candle_core::Error::Msg(msg)
    }
}

/// Tether's init for candle's, for a tensor of `shape`.
fn tether_init(name: &str, shape: &Shape, init: candle_nn::Init) -> Result<Init, CandleError> {
    use candle_nn::init::NormalOrUniform;
    let unsupported = || CandleError::Init {
        name: name.to_string(),
        init: format!("{init:?}"),
    };
    Ok(match init {
        candle_nn::Init::Const(0.0) => Init::Zeros,
        candle_nn::Init::Const(v) => Init::Const { value: v as f32 },
        candle_nn::Init::Randn { mean, stdev } if mean == 0.0 && stdev >= 0.0 => {
            Init::Normal { std: stdev as f32 }
        }
        candle_nn::Init::Uniform { lo, up } if lo == -up && up >= 0.0 => {
            Init::Uniform { bound: up as f32 }
        }
        candle_nn::Init::Kaiming {
            dist,
            fan,
            non_linearity,
        } => {
            let std = non_linearity.gain() / (fan.for_shape(shape).max(1) as f64).sqrt();
            match dist {
                NormalOrUniform::Uniform => Init::Uniform {
                    bound: (3f64.sqrt() * std) as f32,
                },
                NormalOrUniform::Normal => Init::Normal { std: std as f32 },
            }
        }
        _ => return Err(unsupported()),
    })
}

impl SimpleBackend for Recorder {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: candle_nn::Init,
        _compute: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let mut vars = self
            .vars
            .lock()
            .map_err(|_| candle_core::Error::Msg("recorder poisoned".into()))?;
        // A tensor asked for twice (weight tying) is the same var.
        if let Some(r) = vars.iter().find(|r| r.spec.name == name) {
            if r.spec.shape != s.dims() {
                return Err(self.fail(CandleError::Layout {
                    name: name.into(),
                    shape: s.dims().to_vec(),
                    reason: format!(
                        "asked for again with another shape (first {:?})",
                        r.spec.shape
                    ),
                }));
            }
            return Ok(r.var.as_tensor().clone());
        }
        let spec = match &self.prescribed {
            Some(layout) => {
                let i = vars.len();
                let want = layout.tensors().get(i);
                match want {
                    Some(t) if t.name == name && t.shape == s.dims() => t.clone(),
                    _ => {
                        return Err(self.fail(CandleError::Layout {
                            name: name.into(),
                            shape: s.dims().to_vec(),
                            reason: format!(
                                "the layout's tensor {i} is {:?}",
                                want.map(|t| (&t.name, &t.shape))
                            ),
                        }))
                    }
                }
            }
            None => match tether_init(name, &s, h) {
                Ok(init) => TensorSpec::new(name, s.dims(), init),
                Err(e) => return Err(self.fail(e)),
            },
        };
        // Vars are f32 master copies whatever the builder's dtype (the compute dtype, `vb.dtype()`), so gradients
        // accumulate in f32; modules cast weights at use, as autocast does.
        let var = Var::zeros(s, DType::F32, dev)?;
        let t = var.as_tensor().clone();
        vars.push(Recorded { spec, var });
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        Err(candle_core::Error::Msg(format!(
            "{name}: Tether needs every tensor's shape (use VarBuilder::get with a shape)"
        )))
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.vars
            .lock()
            .map(|v| v.iter().any(|r| r.spec.name == name))
            .unwrap_or(false)
    }
}

/// Writes f32 values into a var's storage in place, converting to its dtype.
struct Load<'a>(&'a [f32]);

impl InplaceOp1 for Load<'_> {
    fn name(&self) -> &'static str {
        "tether-load"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &CLayout) -> candle_core::Result<()> {
        let (start, n) = (layout.start_offset(), self.0.len());
        if !layout.is_contiguous() || layout.shape().elem_count() != n {
            candle_core::bail!("tether-load: {n} values for a var of layout {layout:?}")
        }
        match storage {
            CpuStorage::F32(v) => v[start..start + n].copy_from_slice(self.0),
            CpuStorage::BF16(v) => {
                for (d, &s) in v[start..start + n].iter_mut().zip(self.0) {
                    *d = bf16::from_f32(s);
                }
            }
            CpuStorage::F16(v) => {
                for (d, &s) in v[start..start + n].iter_mut().zip(self.0) {
                    *d = f16::from_f32(s);
                }
            }
            other => candle_core::bail!("tether-load: unsupported dtype {:?}", other.dtype()),
        }
        Ok(())
    }
}

/// Copies a gradient tensor into `out` as f32, multiplied by `k`; returns whether every value is finite.
fn store_grad(g: &Tensor, k: f32, out: &mut [f32]) -> candle_core::Result<bool> {
    let g = if g.is_contiguous() {
        g.clone()
    } else {
        g.contiguous()?
    };
    let (storage, layout) = g.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*storage else {
        candle_core::bail!("tether: gradients must be on the CPU")
    };
    let (start, n) = (layout.start_offset(), out.len());
    let mut finite = true;
    match cpu {
        CpuStorage::F32(v) => {
            for (d, &s) in out.iter_mut().zip(&v[start..start + n]) {
                *d = s * k;
                finite &= d.is_finite();
            }
        }
        CpuStorage::BF16(v) => {
            for (d, &s) in out.iter_mut().zip(&v[start..start + n]) {
                *d = s.to_f32() * k;
                finite &= d.is_finite();
            }
        }
        CpuStorage::F16(v) => {
            for (d, &s) in out.iter_mut().zip(&v[start..start + n]) {
                *d = s.to_f32() * k;
                finite &= d.is_finite();
            }
        }
        other => candle_core::bail!("tether: unsupported gradient dtype {:?}", other.dtype()),
    }
    Ok(finite)
}

/// Input values per forward pass in [`Model::loss`] and [`Model::predict`] (the GPT: 32 windows of 64 bytes, about
/// 60 MB of activations at its default shape), whatever the batch the caller evaluates.
pub const EVAL_VALUES: usize = 2048;

/// A candle module as a Tether [`Model`] (CPU device).
pub struct CandleModel<M> {
    module: M,
    vars: Vec<Var>,
    layout: Layout,
    features: usize,
    classes: usize,
    precision: ComputePrecision,
    scaler: Option<LossScaler>,
}

impl<M: CandleModule> CandleModel<M> {
    /// Builds the module with `build` on a recording `VarBuilder`; the layout is every tensor it asked for, in that
    /// order, with candle's inits translated (zeros, constants, symmetric uniform, zero-mean normal, Kaiming). The
    /// tensors are f32 (the master copy); the builder's `dtype()` is `precision`'s, the dtype the module should
    /// compute in (casting weights where it uses them, as autocast does).
    pub fn new(
        features: usize,
        classes: usize,
        precision: ComputePrecision,
        build: impl FnOnce(VarBuilder<'_>) -> candle_core::Result<M>,
    ) -> Result<Self, CandleError> {
        Self::build(None, features, classes, precision, build)
    }

    /// Like [`CandleModel::new`], but every tensor must be the next one of `layout` (name and shape), whose inits
    /// are used (for built-in models whose layout the shards build without candle).
    pub fn with_layout(
        layout: Layout,
        features: usize,
        classes: usize,
        precision: ComputePrecision,
        build: impl FnOnce(VarBuilder<'_>) -> candle_core::Result<M>,
    ) -> Result<Self, CandleError> {
        Self::build(Some(layout), features, classes, precision, build)
    }

    fn build(
        prescribed: Option<Layout>,
        features: usize,
        classes: usize,
        precision: ComputePrecision,
        build: impl FnOnce(VarBuilder<'_>) -> candle_core::Result<M>,
    ) -> Result<Self, CandleError> {
        let vars = Arc::new(Mutex::new(Vec::new()));
        let errors = Arc::new(Mutex::new(Vec::new()));
        let recorder = Recorder {
            vars: vars.clone(),
            prescribed: prescribed.clone(),
            errors: errors.clone(),
        };
        let vb = VarBuilder::from_backend(Box::new(recorder), dtype_of(precision), Device::Cpu);
        let built = build(vb);
        // The recorder's own errors say more than candle's message.
        if let Some(e) = errors.lock().ok().and_then(|mut e| e.drain(..).next()) {
            return Err(e);
        }
        let module = built?;
        let recorded = std::mem::take(&mut *vars.lock().map_err(|_| {
            CandleError::Candle(candle_core::Error::Msg("recorder poisoned".into()))
        })?);
        let specs: Vec<TensorSpec> = recorded.iter().map(|r| r.spec.clone()).collect();
        let layout = Layout::new(specs);
        if let Some(want) = &prescribed {
            if want.tensors().len() != layout.tensors().len() {
                let missing = &want.tensors()[layout.tensors().len()];
                return Err(CandleError::Layout {
                    name: missing.name.clone(),
                    shape: missing.shape.clone(),
                    reason: "the module never asked for it".into(),
                });
            }
        }
        let layout = prescribed.unwrap_or(layout);
        Ok(Self {
            module,
            vars: recorded.into_iter().map(|r| r.var).collect(),
            layout,
            features,
            classes,
            precision,
            scaler: None,
        })
    }

    /// Enables dynamic loss scaling from `scale`, doubling after `window` clean steps (for bf16/f16 compute).
    pub fn with_loss_scaling(mut self, scale: f32, window: u32) -> Self {
        self.scaler = Some(LossScaler::new(scale, window));
        self
    }

    /// The wrapped module.
    pub fn module(&self) -> &M {
        &self.module
    }

    /// Rows per forward pass when evaluating: candle keeps every activation of a pass alive until its result is
    /// dropped (the vars track gradients), so evaluation runs in passes of at most [`EVAL_VALUES`] input values.
    fn eval_rows(&self) -> usize {
        (EVAL_VALUES / self.features.max(1)).max(1)
    }

    /// Writes the flat `params` into the vars.
    fn load(&self, params: &[f32]) -> candle_core::Result<()> {
        for (i, var) in self.vars.iter().enumerate() {
            var.inplace_op1(&Load(&params[self.layout.tensor_range(i)]))?;
        }
        Ok(())
    }

    fn try_loss_and_grad(
        &mut self,
        params: &[f32],
        x: &[f32],
        y: &[u32],
        grad: &mut [f32],
    ) -> candle_core::Result<f32> {
        self.load(params)?;
        let loss = self.module.loss(x, y, y.len())?.to_dtype(DType::F32)?;
        let value = loss.to_scalar::<f32>()?;
        let scale = self.scaler.as_ref().map_or(1.0, LossScaler::scale);
        let grads = if scale == 1.0 {
            loss.backward()?
        } else {
            loss.affine(f64::from(scale), 0.0)?.backward()?
        };
        let mut finite = true;
        for (i, var) in self.vars.iter().enumerate() {
            let out = &mut grad[self.layout.tensor_range(i)];
            match grads.get(var.as_tensor()) {
                Some(g) => finite &= store_grad(g, 1.0 / scale, out)?,
                None => out.fill(0.0),
            }
        }
        // An overflowed step leaves the gradient non-finite: the step engine skips it like any non-finite one.
        if let Some(s) = &mut self.scaler {
            s.update(finite);
        }
        Ok(value)
    }
}

/// Candle errors on a step are bugs (shapes are fixed when the model is built, slice lengths are the caller's
/// contract, as for every [`Model`]), so they panic with the message.
fn fatal<T>(what: &str, r: candle_core::Result<T>) -> T {
    r.unwrap_or_else(|e| panic!("candle model, {what}: {e}"))
}

impl<M: CandleModule> Model for CandleModel<M> {
    fn layout(&self) -> &Layout {
        &self.layout
    }

    fn classes(&self) -> usize {
        self.classes
    }

    fn features(&self) -> usize {
        self.features
    }

    fn loss_and_grad(&mut self, params: &[f32], x: &[f32], y: &[u32], grad: &mut [f32]) -> f32 {
        assert_eq!(params.len(), self.layout.len(), "params length");
        assert_eq!(grad.len(), self.layout.len(), "grad length");
        assert_eq!(x.len(), y.len() * self.features, "x must hold y.len() rows");
        let r = self.try_loss_and_grad(params, x, y, grad);
        fatal("loss and gradient", r)
    }

    fn predict(&mut self, params: &[f32], x: &[f32], out: &mut [u32]) {
        assert_eq!(
            x.len(),
            out.len() * self.features,
            "x must hold out.len() rows"
        );
        let rows = self.eval_rows();
        let f = self.features;
        let r = self.load(params).and_then(|()| {
            for (xs, os) in x.chunks(rows * f).zip(out.chunks_mut(rows)) {
                self.module.predict(xs, os.len(), os)?;
            }
            Ok(())
        });
        fatal("predict", r);
    }

    fn loss(&mut self, params: &[f32], x: &[f32], y: &[u32]) -> f32 {
        assert_eq!(x.len(), y.len() * self.features, "x must hold y.len() rows");
        let rows = self.eval_rows();
        let f = self.features;
        let r = self.load(params).and_then(|()| {
            let mut total = 0.0f64;
            for (xs, ys) in x.chunks(rows * f).zip(y.chunks(rows)) {
                let l = self
                    .module
                    .loss(xs, ys, ys.len())?
                    .to_dtype(DType::F32)?
                    .to_scalar::<f32>()?;
                total += f64::from(l) * ys.len() as f64;
            }
            Ok((total / y.len().max(1) as f64) as f32)
        });
        fatal("loss", r)
    }

    fn precision_stats(&self) -> Option<PrecisionStats> {
        let s = self.scaler.as_ref()?;
        let (overflows, growths) = s.counts();
        Some(PrecisionStats {
            precision: self.precision,
            loss_scale: s.scale(),
            overflows,
            growths,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scaler_halves_on_overflow_and_doubles_after_a_clean_window() {
        let mut s = LossScaler::new(1024.0, 3);
        assert!(!s.update(false));
        assert_eq!(s.scale(), 512.0);
        assert!(s.update(true) && s.update(true));
        assert_eq!(s.scale(), 512.0);
        // An overflow resets the clean count.
        assert!(!s.update(false));
        assert_eq!(s.scale(), 256.0);
        for _ in 0..3 {
            assert!(s.update(true));
        }
        assert_eq!(s.scale(), 512.0);
        assert_eq!(s.counts(), (2, 1));
        // Bounded on both sides.
        let mut lo = LossScaler::new(2.0, 1);
        for _ in 0..5 {
            lo.update(false);
        }
        assert_eq!(lo.scale(), 1.0);
        let mut hi = LossScaler::new(MAX_LOSS_SCALE, 1);
        hi.update(true);
        assert_eq!((hi.scale(), hi.counts().1), (MAX_LOSS_SCALE, 0));
    }
}

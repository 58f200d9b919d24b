//! Models: the differentiable functions a worker trains, each over one flat f32 parameter vector described by a
//! [`Layout`]. A model owns only scratch buffers (activations, back-propagated errors), never the parameters: the
//! caller passes the current parameters in and gets the mean loss and the gradient back, written in place into a
//! caller-owned slice of `layout().len()` values. Results are a deterministic function of (params, x, y): repeated
//! calls give bit-identical gradients. Users plug in their own gradient computation by implementing [`Model`].

pub mod candle;
mod gpt;
mod logreg;
mod mlp;
mod ops;

pub use self::candle::{
    CandleError, CandleModel, CandleModule, LossScaler, PrecisionStats, EVAL_VALUES,
};
pub use gpt::{gpt_model, Gpt};
pub use logreg::LogReg;
pub use mlp::Mlp;

use std::sync::Arc;

use tether_common::config::{ComputePrecision, Config, ModelConfig, ModelKind};
use tether_common::layout::{model_io, GptShape, Layout};

/// Builds a fresh instance of a user's model (one per worker, plus one for evaluation).
pub type ModelFactory = Arc<dyn Fn() -> Box<dyn Model> + Send + Sync>;

/// A differentiable model over a flat parameter vector.
///
/// Inputs are row-major `rows × features()` f32 batches; labels are class indices `< classes()`. Implementations
/// panic on mismatched slice lengths or out-of-range labels: those are caller bugs, checked once by data loaders.
pub trait Model: Send {
    /// The parameter layout (names, shapes, initialisation) this model reads.
    fn layout(&self) -> &Layout;

    /// Output width: the number of classes.
    fn classes(&self) -> usize;

    /// Input width: the number of features per row.
    fn features(&self) -> usize;

    /// Mean loss over the batch and its gradient w.r.t. params, written into `grad` (len == layout.len()).
    /// x: row-major batch×features.
    fn loss_and_grad(&mut self, params: &[f32], x: &[f32], y: &[u32], grad: &mut [f32]) -> f32;

    /// Predicted class per row (for test accuracy); `out.len() == rows`.
    fn predict(&mut self, params: &[f32], x: &[f32], out: &mut [u32]);

    /// Mean loss over the batch without the gradient.
    ///
    /// The default computes the gradient into a scratch vector (one allocation per call); built-in models override it
    /// with a forward-only pass.
    fn loss(&mut self, params: &[f32], x: &[f32], y: &[u32]) -> f32 {
        let mut scratch = vec![0.0; self.layout().len()];
        self.loss_and_grad(params, x, y, &mut scratch)
    }

    /// Mixed-precision statistics (loss scale, overflows), for models that compute in bf16/f16.
    fn precision_stats(&self) -> Option<PrecisionStats> {
        None
    }
}

/// Fraction of rows whose predicted class equals the label, evaluated `chunk` rows at a time (0 when there are no rows).
pub fn accuracy(model: &mut dyn Model, params: &[f32], x: &[f32], y: &[u32], chunk: usize) -> f32 {
    let f = model.features();
    assert_eq!(
        x.len(),
        y.len() * f,
        "accuracy: x must hold y.len() rows of features"
    );
    if y.is_empty() {
        return 0.0;
    }
    let chunk = chunk.clamp(1, y.len());
    let mut pred = vec![0u32; chunk];
    let mut correct = 0usize;
    for (xs, ys) in x.chunks(chunk * f).zip(y.chunks(chunk)) {
        let out = &mut pred[..ys.len()];
        model.predict(params, xs, out);
        correct += out.iter().zip(ys).filter(|(p, l)| p == l).count();
    }
    correct as f32 / y.len() as f32
}

/// Mean loss over all rows, evaluated `chunk` rows at a time (0 when there are no rows).
pub fn mean_loss(model: &mut dyn Model, params: &[f32], x: &[f32], y: &[u32], chunk: usize) -> f32 {
    let f = model.features();
    assert_eq!(
        x.len(),
        y.len() * f,
        "mean_loss: x must hold y.len() rows of features"
    );
    if y.is_empty() {
        return 0.0;
    }
    let chunk = chunk.clamp(1, y.len());
    let mut total = 0.0f64;
    for (xs, ys) in x.chunks(chunk * f).zip(y.chunks(chunk)) {
        total += f64::from(model.loss(params, xs, ys)) * ys.len() as f64;
    }
    (total / y.len() as f64) as f32
}

/// The built-in model named by the `[model]` config section, for `features` inputs and `classes` outputs.
///
/// The initial parameters are `model.layout().init_all(cfg.seed)`.
/// For the GPT, `features` is the context and `classes` the vocabulary, computing in f32. A model file's model
/// (`kind = "file"`) is computed by its owner, not here: a configuration error.
pub fn build(
    cfg: &ModelConfig,
    features: usize,
    classes: usize,
) -> Result<Box<dyn Model>, CandleError> {
    Ok(match cfg.kind {
        ModelKind::Mlp => Box::new(Mlp::new(features, &cfg.hidden, classes)),
        ModelKind::Logreg => Box::new(LogReg::new(features, classes)),
        ModelKind::Gpt => {
            let shape = tether_common::layout::GptShape {
                vocab: classes,
                context: features,
                layers: cfg.layers,
                heads: cfg.heads,
                dim: cfg.dim,
            };
            // The module asks for exactly gpt_layout's tensors (a unit test builds every shape kind), so this
            // cannot fail for a validated config.
            Box::new(
                gpt_model(shape, ComputePrecision::F32).expect("the GPT matches its own layout"),
            )
        }
        ModelKind::File => {
            return Err(tether_common::config::ConfigError::Invalid {
                key: "model.kind",
                reason: "a model file's model is computed by its owner (the Python package's workers), not by \
                         tether-worker"
                    .into(),
            }
            .into())
        }
    })
}

/// The model a worker of `cfg` trains: [`build`], with the GPT in `train.precision` and, below f32, dynamic loss
/// scaling from `train.loss_scale` doubling every `train.loss_scale_window` clean steps.
pub fn build_for(cfg: &Config) -> Result<Box<dyn Model>, CandleError> {
    let precision = cfg.train.precision;
    if cfg.model.kind != ModelKind::Gpt {
        if precision != ComputePrecision::F32 {
            return Err(tether_common::config::ConfigError::Invalid {
                key: "train.precision",
                reason: format!(
                    "{precision} needs a candle model (model.kind = \"gpt\"); {:?} computes in f32",
                    cfg.model.kind
                ),
            }
            .into());
        }
        let (features, classes) = model_io(cfg)?;
        return build(&cfg.model, features, classes);
    }
    let model = gpt_model(GptShape::from_model(&cfg.model), precision)?;
    Ok(match precision {
        ComputePrecision::F32 => Box::new(model),
        _ => Box::new(model.with_loss_scaling(cfg.train.loss_scale, cfg.train.loss_scale_window)),
    })
}

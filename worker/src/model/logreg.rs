//! Multinomial logistic regression: one dense layer (`fc1.weight` `[features, classes]`, `fc1.bias` `[classes]`) and
//! softmax cross-entropy, i.e. an [`Mlp`] with no hidden layers, sharing its batched sgemm forward/backward.

use tether_common::layout::Layout;

use super::{Mlp, Model};

/// Multinomial logistic regression (a linear layer under softmax cross-entropy).
#[derive(Debug, Clone)]
pub struct LogReg(Mlp);

impl LogReg {
    /// A linear classifier from `features` inputs to `classes` outputs.
    pub fn new(features: usize, classes: usize) -> Self {
        Self(Mlp::new(features, &[], classes))
    }

    /// Writes the logits (`rows × classes`, row-major) of the batch `x` into `out`.
    pub fn logits(&mut self, params: &[f32], x: &[f32], out: &mut [f32]) {
        self.0.logits(params, x, out)
    }
}

impl Model for LogReg {
    fn layout(&self) -> &Layout {
        self.0.layout()
    }

    fn classes(&self) -> usize {
        self.0.classes()
    }

    fn features(&self) -> usize {
        self.0.features()
    }

    fn loss_and_grad(&mut self, params: &[f32], x: &[f32], y: &[u32], grad: &mut [f32]) -> f32 {
        self.0.loss_and_grad(params, x, y, grad)
    }

    fn predict(&mut self, params: &[f32], x: &[f32], out: &mut [u32]) {
        self.0.predict(params, x, out)
    }

    fn loss(&mut self, params: &[f32], x: &[f32], y: &[u32]) -> f32 {
        self.0.loss(params, x, y)
    }
}

//! `[optimizer]` and `[optimizer.outer]`: the update rule the shards apply (family, learning rate and its schedule,
//! momentum and Adam coefficients, weight decay, staleness-aware steps), and the outer optimizer of local-step rounds.

use serde::{Deserialize, Serialize};

/// Optimizer families applied by the server shards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    /// Plain SGD.
    Sgd,
    /// SGD with heavy-ball momentum.
    Momentum,
    /// SGD with Nesterov momentum.
    Nesterov,
    /// Adam (L2 weight decay added to the gradient).
    #[default]
    Adam,
    /// AdamW (decoupled weight decay).
    Adamw,
    /// Adagrad.
    Adagrad,
}

/// Learning-rate schedule, a function of the shard's update count.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case", tag = "kind", deny_unknown_fields)]
pub enum Schedule {
    /// lr stays constant.
    #[default]
    Constant,
    /// Linear warmup from 0 over `warmup` updates, then cosine decay to `min_ratio`·lr at `total` updates.
    WarmupCosine {
        /// Warmup length in updates.
        warmup: u64,
        /// Updates at which the cosine reaches its floor.
        total: u64,
        /// Floor as a fraction of lr (default 0).
        #[serde(default)]
        min_ratio: f32,
    },
    /// lr · gamma^(floor(t / every)).
    Step {
        /// Decay period in updates.
        every: u64,
        /// Factor per period.
        gamma: f32,
    },
}

/// Which tensors weight decay applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum DecayScope {
    /// Every tensor.
    #[default]
    All,
    /// Tensors of rank 2 or more (weight matrices and embeddings); biases and norms are not decayed (nanoGPT).
    Matrices,
}

/// `[optimizer]`: the update rule the shards apply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OptimizerConfig {
    /// Optimizer family (default adam).
    pub kind: OptimizerKind,
    /// Base learning rate (default 1e-3).
    pub lr: f32,
    /// Momentum coefficient for momentum/nesterov (default 0.9).
    pub momentum: f32,
    /// Adam β1 (default 0.9).
    pub beta1: f32,
    /// Adam β2 (default 0.999).
    pub beta2: f32,
    /// Denominator epsilon (default 1e-8).
    pub eps: f32,
    /// Weight decay (L2 for sgd/momentum/nesterov/adam/adagrad, decoupled for adamw; default 0).
    pub weight_decay: f32,
    /// Which tensors `weight_decay` applies to: `all` (default) or `matrices` (not biases and norms, as nanoGPT).
    pub decay: DecayScope,
    /// Learning-rate schedule (default constant).
    pub schedule: Schedule,
    /// Divide the step by max(1, staleness) of the applied gradient (default false).
    pub staleness_aware: bool,
    /// The outer optimizer the shards apply to pseudo-gradients in local-step rounds (`train.local_steps > 0`).
    pub outer: OuterOptimizerConfig,
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        Self {
            kind: OptimizerKind::Adam,
            lr: 1e-3,
            momentum: 0.9,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            decay: DecayScope::All,
            schedule: Schedule::Constant,
            staleness_aware: false,
            outer: OuterOptimizerConfig::default(),
        }
    }
}

/// `[optimizer.outer]`: the shards' optimizer in local-step rounds (DiLoCo's outer step).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OuterOptimizerConfig {
    /// Optimizer family (default nesterov, as DiLoCo).
    pub kind: OptimizerKind,
    /// Outer learning rate (default 0.7, as DiLoCo).
    pub lr: f32,
    /// Outer momentum (default 0.5, the quickstart's: DiLoCo's 0.9 overshoots at H ≤ 64 and diverged with s = 3,
    /// docs/pulls-and-local-steps.md).
    pub momentum: f32,
    /// Step once per round, on the sum of its pushes, when the round closes (as DiLoCo does), instead of on every
    /// push as it comes (default false). Needs a bounded `cluster.staleness` of at most
    /// [`MAX_OPEN_ROUNDS`](super::MAX_OPEN_ROUNDS) − 2: the shards hold a sum per open round.
    pub at_close: bool,
}

impl Default for OuterOptimizerConfig {
    fn default() -> Self {
        Self {
            kind: OptimizerKind::Nesterov,
            lr: 0.7,
            momentum: 0.5,
            at_close: false,
        }
    }
}

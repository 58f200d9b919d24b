//! `[train]`: the training loop each worker runs: batch, epochs or a step cap, evaluation cadence, clipping, the data
//! seed, local-step rounds, and the arithmetic of the forward/backward pass with its loss scaling.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Arithmetic of a worker's forward and backward pass (`train.precision`); the shards always keep fp32 weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ComputePrecision {
    /// fp32 throughout.
    #[default]
    F32,
    /// bfloat16 matmuls and activations; layer norms, softmax statistics and the loss in fp32; dynamic loss scaling.
    Bf16,
    /// IEEE half precision, same policy as bf16 (loss scaling matters here: f16 overflows at 65504).
    F16,
}

impl FromStr for ComputePrecision {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "f32" | "fp32" => Ok(Self::F32),
            "bf16" => Ok(Self::Bf16),
            "f16" | "fp16" => Ok(Self::F16),
            o => Err(format!("unknown precision {o:?} (f32|bf16|f16)")),
        }
    }
}

impl fmt::Display for ComputePrecision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::F16 => "f16",
        })
    }
}

/// `[train]`: the training loop run by each worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainConfig {
    /// Per-worker mini-batch size (default 128).
    pub batch: usize,
    /// Passes over each worker's data partition (default 5).
    pub epochs: u32,
    /// Evaluate on the test set every this many steps (default 200; 0 = only at the end).
    pub eval_every: u64,
    /// Clip gradients to this global L2 norm (default 5.0; 0 = off).
    pub clip_norm: f32,
    /// Seed of data shuffling and stochastic rounding (default 7).
    pub seed: u64,
    /// Local-step rounds (DiLoCo): each worker runs this many inner steps with `[optimizer]` on its own copy, then
    /// pushes the pseudo-gradient θ_start − θ_end, and the shards apply `[optimizer.outer]`; one SSP clock is one
    /// round (default 0: a gradient push every step, `[optimizer]` on the shards).
    pub local_steps: u32,
    /// Link-aware local steps (default 0: H pinned at `local_steps`). Above `local_steps`, each worker measures its
    /// communication per round against its compute per inner step and grows H up to this bound until communication
    /// is at most a fifth of a round (`tether_worker::local_steps`).
    pub local_steps_max: u32,
    /// Streamed fragments (Streaming DiLoCo; default 1: the whole model each round). Above 1, needs `local_steps`:
    /// every shard's range is split into this many contiguous parts, and round `c` (one SSP clock) pushes only part
    /// `c mod fragments` of every shard, after `local_steps / fragments` inner steps; the shards apply the outer step
    /// to that part alone. Each fragment is still synchronized once per `local_steps` inner steps, the largest burst
    /// is about `1/fragments` of a whole-model push, and each round's pull overlaps the next round's inner steps.
    pub fragments: u32,
    /// Most steps each worker runs (default 0: no cap, `epochs` passes); for corpora where a pass is long.
    pub max_steps: u64,
    /// Arithmetic of the workers' forward/backward (default f32; bf16 and f16 for candle models, the GPT).
    pub precision: ComputePrecision,
    /// Initial dynamic loss scale for bf16/f16 (default 65536 = 2^16).
    pub loss_scale: f32,
    /// Clean steps after which the loss scale doubles (default 200).
    pub loss_scale_window: u32,
    /// Compute threads per worker (default 0: an equal share of the host's cores among the workers on it).
    pub threads: u32,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            batch: 128,
            epochs: 5,
            eval_every: 200,
            clip_norm: 5.0,
            seed: 7,
            local_steps: 0,
            local_steps_max: 0,
            fragments: 1,
            max_steps: 0,
            precision: ComputePrecision::F32,
            loss_scale: 65536.0,
            loss_scale_window: 200,
            threads: 0,
        }
    }
}

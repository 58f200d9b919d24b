//! `[compression]`: how workers encode gradient pushes (codec scheme, bucket, rounding, error feedback, zstd) and how
//! they pull the weights (compressed deltas or whole shards, f32 or bf16), with the codec configurations they imply.

use serde::{Deserialize, Serialize};

use crate::codec::{CodecConfig, Rounding, Scheme};

/// How workers pull the weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum PullKind {
    /// Compressed deltas of each shard's public copy.
    #[default]
    Delta,
    /// The whole shard every pull.
    Full,
}

/// `[compression]`: how workers encode gradient pushes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CompressionConfig {
    /// Codec scheme (default q4).
    pub scheme: Scheme,
    /// Values per scaling bucket (default 512).
    pub bucket: usize,
    /// Worker-side error feedback (default true).
    pub error_feedback: bool,
    /// zstd (level 1) over the packed body when it makes it smaller (default true: q4 codes of real gradients are
    /// mostly small, so it roughly doubles the ratio for a little CPU; turn it off when the CPU is the limit).
    pub zstd: bool,
    /// Rounding (default stochastic).
    pub rounding: Rounding,
    /// Pull parameters as bf16 instead of f32: half the pull bytes, weights rounded to 8 mantissa bits for the
    /// gradient computation only (the shards keep f32). Implies `pull = "full"`. Default false.
    pub pull_bf16: bool,
    /// How workers pull (default "delta"): `delta` (compressed deltas of each shard's public copy, with the error
    /// feedback on the server side) or `full` (the whole shard every time, f32 or, with `pull_bf16`, bf16).
    pub pull: PullKind,
    /// Codec scheme of pull deltas (default q4; q8 halves the rounding error for twice the bytes; topk2 sends the
    /// largest changes only, with the public copy's error feedback carrying the rest).
    pub pull_scheme: Scheme,
    /// topk2 keeps one value in `keep` per bucket, pushes and pulls alike: a power of two from 2 to 32768 (default
    /// 64, about 1.6 %).
    pub keep: u32,
}

impl Default for CompressionConfig {
    fn default() -> Self {
        Self {
            scheme: Scheme::Q4,
            bucket: 512,
            error_feedback: true,
            zstd: true,
            rounding: Rounding::Stochastic,
            pull_bf16: false,
            pull: PullKind::Delta,
            pull_scheme: Scheme::Q4,
            keep: crate::codec::DEFAULT_KEEP,
        }
    }
}

impl CompressionConfig {
    /// The codec configuration this section describes.
    pub fn codec(&self) -> CodecConfig {
        CodecConfig {
            scheme: self.scheme,
            bucket: self.bucket,
            rounding: self.rounding,
            zstd: self.zstd,
            keep: self.keep,
        }
    }

    /// Whether workers pull compressed deltas (`pull = "delta"` and not `pull_bf16`).
    pub fn delta_pulls(&self) -> bool {
        self.pull == PullKind::Delta && !self.pull_bf16
    }

    /// The codec of pull deltas: `pull_scheme`, the push bucket size, deterministic rounding, zstd as configured.
    pub fn pull_codec(&self) -> CodecConfig {
        CodecConfig {
            scheme: self.pull_scheme,
            bucket: self.bucket,
            rounding: Rounding::Deterministic,
            zstd: self.zstd,
            keep: self.keep,
        }
    }
}

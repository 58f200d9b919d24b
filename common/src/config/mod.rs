//! `cluster.toml`: the typed cluster configuration shared by servers, workers and the embedded cluster. One file per
//! section holds its schema and its defaults, stated once in the section's `Default` (serde fills missing keys from
//! it); [`validate`](Config::validate) checks ranges and consistency. Every key but `cluster.servers` has a default,
//! unknown keys are an error naming the key, and relative paths resolve against the directory of the file itself.
//! Parsing is pure; [`Config::load`] is the only function touching disk. This is plain data: the model shapes and
//! layouts derived from it live in [`crate::layout::model`].

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

mod checkpoint;
mod cluster;
mod compression;
mod data;
mod guard;
mod model;
mod optimizer;
mod rollback;
mod shard;
mod train;
mod validate;

#[cfg(test)]
mod tests;

pub use checkpoint::CheckpointConfig;
pub use cluster::{ClusterConfig, Staleness};
pub use compression::{CompressionConfig, PullKind};
pub use data::{default_data_dir, DataConfig, DatasetKind, DATA_DIR_ENV};
pub use guard::{GuardConfig, MAX_GUARD_WINDOW};
pub use model::{ModelConfig, ModelKind};
pub use optimizer::{DecayScope, OptimizerConfig, OptimizerKind, OuterOptimizerConfig, Schedule};
pub use rollback::RollbackConfig;
pub use shard::ShardConfig;
pub use train::{ComputePrecision, TrainConfig};
pub use validate::{MAX_FRAGMENTS, MAX_OPEN_ROUNDS, MAX_THREADS};

/// Errors loading or validating a configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The TOML is malformed, has an unknown key or a value of the wrong type.
    #[error("invalid config{}: {message}", .path.as_ref().map(|p| format!(" {}", p.display())).unwrap_or_default())]
    Parse {
        /// The file, when parsed from one.
        path: Option<PathBuf>,
        /// The parser's message (names the offending key).
        message: String,
    },
    /// A value parsed but is out of range or inconsistent.
    #[error("invalid config value `{key}`: {reason}")]
    Invalid {
        /// The dotted key.
        key: &'static str,
        /// Why it is rejected.
        reason: String,
    },
    /// The model file (`model.file`) cannot be read, written or is not a valid model file.
    #[error("model file {path}: {reason}")]
    ModelFile {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
}

/// The whole `cluster.toml`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// `[cluster]` (required: `servers`).
    pub cluster: ClusterConfig,
    /// `[model]`.
    #[serde(default)]
    pub model: ModelConfig,
    /// `[data]`.
    #[serde(default)]
    pub data: DataConfig,
    /// `[train]`.
    #[serde(default)]
    pub train: TrainConfig,
    /// `[optimizer]`.
    #[serde(default)]
    pub optimizer: OptimizerConfig,
    /// `[compression]`.
    #[serde(default)]
    pub compression: CompressionConfig,
    /// `[checkpoint]`.
    #[serde(default)]
    pub checkpoint: CheckpointConfig,
    /// `[rollback]`: loss-spike rollback (off by default).
    #[serde(default)]
    pub rollback: RollbackConfig,
    /// `[guard]`: the shards' gradient-norm guard (on by default).
    #[serde(default)]
    pub guard: GuardConfig,
    /// `[shard]`: how each shard process runs its kernels (threads).
    #[serde(default)]
    pub shard: ShardConfig,
}

impl Config {
    /// Reads, parses and validates `path`; relative paths inside resolve against the file's directory.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
        Self::parse(&text, &base).map_err(|e| match e {
            ConfigError::Parse { message, .. } => ConfigError::Parse {
                path: Some(path.to_path_buf()),
                message,
            },
            other => other,
        })
    }

    /// Parses and validates TOML text; relative paths resolve against `base`.
    pub fn parse(text: &str, base: &Path) -> Result<Self, ConfigError> {
        let mut cfg: Config = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: None,
            message: e.to_string(),
        })?;
        cfg.resolve_paths(base);
        cfg.validate()?;
        Ok(cfg)
    }

    /// Makes relative paths absolute against `base`.
    pub fn resolve_paths(&mut self, base: &Path) {
        for p in [
            &mut self.cluster.tls_dir,
            &mut self.data.path,
            &mut self.checkpoint.dir,
        ] {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        }
        if let Some(p) = self.checkpoint.key_file.as_mut() {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        }
        if let Some(p) = self.data.test_path.as_mut() {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        }
        if let Some(p) = self.model.file.as_mut() {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        }
    }

    /// Steps a worker with `steps_per_epoch` steps per pass runs: `epochs` passes, capped by `train.max_steps`.
    pub fn worker_steps(&self, steps_per_epoch: u64) -> u64 {
        let steps = steps_per_epoch.max(1) * u64::from(self.train.epochs);
        match self.train.max_steps {
            0 => steps,
            cap => steps.min(cap),
        }
    }

    /// A default configuration for the given server addresses: every section at its `Default`.
    pub fn with_servers(servers: Vec<String>) -> Self {
        Self {
            cluster: ClusterConfig::with_servers(servers),
            model: ModelConfig::default(),
            data: DataConfig::default(),
            train: TrainConfig::default(),
            optimizer: OptimizerConfig::default(),
            compression: CompressionConfig::default(),
            checkpoint: CheckpointConfig::default(),
            rollback: RollbackConfig::default(),
            guard: GuardConfig::default(),
            shard: ShardConfig::default(),
        }
    }
}

//! `cluster.toml`: the typed cluster configuration shared by servers, workers and the embedded cluster. Every key but
//! `cluster.servers` has a documented default, unknown keys are an error naming the key, and relative paths resolve
//! against the directory of the file itself. Parsing is pure; [`Config::load`] is the only function touching disk.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

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
}

/// The staleness bound `s` of SSP: a worker may run at most `s` clocks ahead of the slowest live worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Staleness {
    /// At most this many clocks ahead (`0` is BSP).
    Bounded(u32),
    /// Fully asynchronous: pulls never wait.
    #[default]
    Unbounded,
}

impl Staleness {
    /// The bound as an option (`None` = unbounded).
    pub fn bound(self) -> Option<u32> {
        match self {
            Staleness::Bounded(s) => Some(s),
            Staleness::Unbounded => None,
        }
    }

    /// From an option (`None` = unbounded).
    pub fn from_bound(b: Option<u32>) -> Self {
        b.map_or(Staleness::Unbounded, Staleness::Bounded)
    }
}

impl fmt::Display for Staleness {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Staleness::Bounded(s) => write!(f, "{s}"),
            Staleness::Unbounded => f.write_str("inf"),
        }
    }
}

impl FromStr for Staleness {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "inf" | "async" | "unbounded" => Ok(Staleness::Unbounded),
            n => n.parse::<u32>().map(Staleness::Bounded).map_err(|_| {
                format!("staleness must be a non-negative integer or \"inf\", got {n:?}")
            }),
        }
    }
}

impl Serialize for Staleness {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Staleness::Bounded(b) => s.serialize_u32(*b),
            Staleness::Unbounded => s.serialize_str("inf"),
        }
    }
}

impl<'de> Deserialize<'de> for Staleness {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            N(i64),
            S(String),
        }
        match Raw::deserialize(d)? {
            Raw::N(n) => u32::try_from(n).map(Staleness::Bounded).map_err(|_| {
                serde::de::Error::custom(format!(
                    "staleness must be 0..=4294967295 or \"inf\", got {n}"
                ))
            }),
            Raw::S(s) => s.parse().map_err(serde::de::Error::custom),
        }
    }
}

/// `[cluster]`: who is in the cluster and how it synchronises.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterConfig {
    /// Shard K listens on `servers[K]` (required).
    pub servers: Vec<String>,
    /// Number of workers (default 4).
    #[serde(default = "d_workers")]
    pub workers: u32,
    /// SSP bound (default 3; `0` = BSP, `"inf"` = async).
    #[serde(default = "d_staleness")]
    pub staleness: Staleness,
    /// A worker silent this long is evicted from the clock table (default 5000).
    #[serde(default = "d_worker_timeout_ms")]
    pub worker_timeout_ms: u64,
    /// Workers send a heartbeat this often when otherwise idle (default 500).
    #[serde(default = "d_heartbeat_ms")]
    pub heartbeat_ms: u64,
    /// Directory with ca.pem, server.pem/key, client.pem/key (default "certs").
    #[serde(default = "d_tls_dir")]
    pub tls_dir: PathBuf,
}

/// Built-in model families.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ModelKind {
    /// Multi-layer perceptron with ReLU hidden layers and softmax cross-entropy.
    #[default]
    Mlp,
    /// Multinomial logistic regression.
    Logreg,
}

/// `[model]`: what is trained.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// Model family (default mlp).
    #[serde(default)]
    pub kind: ModelKind,
    /// Hidden layer widths for the MLP (default [256, 128]).
    #[serde(default = "d_hidden")]
    pub hidden: Vec<usize>,
    /// Seed of the initial weights (default 42).
    #[serde(default = "d_seed")]
    pub seed: u64,
}

/// Supported dataset sources.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum DatasetKind {
    /// Fashion-MNIST in IDX format (gz or raw), e.g. Debian's `dataset-fashion-mnist`.
    #[default]
    #[serde(rename = "fashion-mnist")]
    FashionMnist,
    /// The scikit-learn copy of UCI optical digits, embedded in the binary.
    #[serde(rename = "digits")]
    Digits,
    /// Any MNIST-style IDX directory.
    #[serde(rename = "idx")]
    Idx,
    /// CSV with the label in the first column.
    #[serde(rename = "csv")]
    Csv,
    /// libsvm / svmlight sparse text.
    #[serde(rename = "libsvm")]
    Libsvm,
}

impl FromStr for DatasetKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "fashion-mnist" => Ok(Self::FashionMnist),
            "digits" => Ok(Self::Digits),
            "idx" => Ok(Self::Idx),
            "csv" => Ok(Self::Csv),
            "libsvm" => Ok(Self::Libsvm),
            o => Err(format!(
                "unknown dataset {o:?} (fashion-mnist|digits|idx|csv|libsvm)"
            )),
        }
    }
}

impl fmt::Display for DatasetKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::FashionMnist => "fashion-mnist",
            Self::Digits => "digits",
            Self::Idx => "idx",
            Self::Csv => "csv",
            Self::Libsvm => "libsvm",
        })
    }
}

/// `[data]`: where the training and test sets come from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    /// Dataset kind (default fashion-mnist).
    #[serde(default)]
    pub dataset: DatasetKind,
    /// Directory (IDX) or training file (csv/libsvm) (default /usr/share/datasets/fashion-mnist).
    #[serde(default = "d_data_path")]
    pub path: PathBuf,
    /// Test file for csv/libsvm (default: none; a held-out split of `path` is used).
    #[serde(default)]
    pub test_path: Option<PathBuf>,
}

/// `[train]`: the training loop run by each worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    /// Per-worker mini-batch size (default 128).
    #[serde(default = "d_batch")]
    pub batch: usize,
    /// Passes over each worker's data partition (default 5).
    #[serde(default = "d_epochs")]
    pub epochs: u32,
    /// Evaluate on the test set every this many steps (default 200; 0 = only at the end).
    #[serde(default = "d_eval_every")]
    pub eval_every: u64,
    /// Clip gradients to this global L2 norm (default 5.0; 0 = off).
    #[serde(default = "d_clip_norm")]
    pub clip_norm: f32,
    /// Seed of data shuffling and stochastic rounding (default 7).
    #[serde(default = "d_data_seed")]
    pub seed: u64,
}

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

/// `[optimizer]`: the update rule the shards apply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimizerConfig {
    /// Optimizer family (default adam).
    #[serde(default)]
    pub kind: OptimizerKind,
    /// Base learning rate (default 1e-3).
    #[serde(default = "d_lr")]
    pub lr: f32,
    /// Momentum coefficient for momentum/nesterov (default 0.9).
    #[serde(default = "d_momentum")]
    pub momentum: f32,
    /// Adam β1 (default 0.9).
    #[serde(default = "d_beta1")]
    pub beta1: f32,
    /// Adam β2 (default 0.999).
    #[serde(default = "d_beta2")]
    pub beta2: f32,
    /// Denominator epsilon (default 1e-8).
    #[serde(default = "d_eps")]
    pub eps: f32,
    /// Weight decay (L2 for sgd/momentum/nesterov/adam/adagrad, decoupled for adamw; default 0).
    #[serde(default)]
    pub weight_decay: f32,
    /// Learning-rate schedule (default constant).
    #[serde(default)]
    pub schedule: Schedule,
    /// Divide the step by max(1, staleness) of the applied gradient (default false).
    #[serde(default)]
    pub staleness_aware: bool,
}

/// `[checkpoint]`: where and how often shards checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointConfig {
    /// Root directory; shard K writes under `dir/shard-K` (default "ckpt").
    #[serde(default = "d_ckpt_dir")]
    pub dir: PathBuf,
    /// Checkpoint every this many applied updates (default 500; 0 = only on shutdown).
    #[serde(default = "d_every_updates")]
    pub every_updates: u64,
    /// Checkpoints kept per shard (default 3).
    #[serde(default = "d_keep")]
    pub keep: usize,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            kind: ModelKind::default(),
            hidden: d_hidden(),
            seed: d_seed(),
        }
    }
}
impl Default for DataConfig {
    fn default() -> Self {
        Self {
            dataset: DatasetKind::default(),
            path: d_data_path(),
            test_path: None,
        }
    }
}
impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            batch: d_batch(),
            epochs: d_epochs(),
            eval_every: d_eval_every(),
            clip_norm: d_clip_norm(),
            seed: d_data_seed(),
        }
    }
}
impl Default for OptimizerConfig {
    fn default() -> Self {
        Self {
            kind: OptimizerKind::default(),
            lr: d_lr(),
            momentum: d_momentum(),
            beta1: d_beta1(),
            beta2: d_beta2(),
            eps: d_eps(),
            weight_decay: 0.0,
            schedule: Schedule::default(),
            staleness_aware: false,
        }
    }
}
impl Default for CheckpointConfig {
    fn default() -> Self {
        Self {
            dir: d_ckpt_dir(),
            every_updates: d_every_updates(),
            keep: d_keep(),
        }
    }
}
impl ClusterConfig {
    /// A cluster section with the given server addresses and every other key at its default.
    pub fn with_servers(servers: Vec<String>) -> Self {
        Self {
            servers,
            workers: d_workers(),
            staleness: d_staleness(),
            worker_timeout_ms: d_worker_timeout_ms(),
            heartbeat_ms: d_heartbeat_ms(),
            tls_dir: d_tls_dir(),
        }
    }
}

fn d_workers() -> u32 {
    4
}
fn d_staleness() -> Staleness {
    Staleness::Bounded(3)
}
fn d_worker_timeout_ms() -> u64 {
    5000
}
fn d_heartbeat_ms() -> u64 {
    500
}
fn d_tls_dir() -> PathBuf {
    PathBuf::from("certs")
}
fn d_hidden() -> Vec<usize> {
    vec![256, 128]
}
fn d_seed() -> u64 {
    42
}
fn d_data_path() -> PathBuf {
    PathBuf::from("/usr/share/datasets/fashion-mnist")
}
fn d_batch() -> usize {
    128
}
fn d_epochs() -> u32 {
    5
}
fn d_eval_every() -> u64 {
    200
}
fn d_clip_norm() -> f32 {
    5.0
}
fn d_data_seed() -> u64 {
    7
}
fn d_lr() -> f32 {
    1e-3
}
fn d_momentum() -> f32 {
    0.9
}
fn d_beta1() -> f32 {
    0.9
}
fn d_beta2() -> f32 {
    0.999
}
fn d_eps() -> f32 {
    1e-8
}
fn d_ckpt_dir() -> PathBuf {
    PathBuf::from("ckpt")
}
fn d_every_updates() -> u64 {
    500
}
fn d_keep() -> usize {
    3
}

//! `cluster.toml`: the typed cluster configuration shared by servers, workers and the embedded cluster. Every key but
//! `cluster.servers` has a documented default, unknown keys are an error naming the key, and relative paths resolve
//! against the directory of the file itself. Parsing is pure; [`Config::load`] is the only function touching disk.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::codec::{CodecConfig, Rounding, Scheme};

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
    /// Directory of the node's TLS bundle (default "certs"): keygen's output folder holding `server-K/` and
    /// `worker-R/` bundles, or one node's own bundle mounted alone.
    #[serde(default = "d_tls_dir")]
    pub tls_dir: PathBuf,
    /// Serials of revoked node certificates (hex, as keygen prints them and `ca/issued.txt` lists them): refused
    /// at the TLS handshake, by shards and workers alike (default none).
    #[serde(default)]
    pub revoked: Vec<String>,
}

impl ClusterConfig {
    /// The revoked serials as bytes (validated by [`Config::validate`]; an unparsable entry is skipped here).
    pub fn revoked_serials(&self) -> Vec<Vec<u8>> {
        self.revoked
            .iter()
            .filter_map(|s| crate::pki::parse_serial(s))
            .collect()
    }
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
    /// Decoder-only byte-level transformer (candle; `[model] layers heads dim context`), trained on a text dataset.
    Gpt,
}

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
    /// Input width (default: from the dataset kind — 784 for fashion-mnist/idx, 64 for digits; required for
    /// csv/libsvm so servers need not read the data).
    #[serde(default)]
    pub features: Option<usize>,
    /// Number of classes (default 10 for the built-in datasets; required for csv/libsvm).
    #[serde(default)]
    pub classes: Option<usize>,
    /// GPT: transformer blocks (default 4).
    #[serde(default = "d_gpt_layers")]
    pub layers: usize,
    /// GPT: attention heads per block (default 4; must divide `dim`).
    #[serde(default = "d_gpt_heads")]
    pub heads: usize,
    /// GPT: embedding width (default 128).
    #[serde(default = "d_gpt_dim")]
    pub dim: usize,
    /// GPT: context length in bytes (default 64).
    #[serde(default = "d_gpt_context")]
    pub context: usize,
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
    /// The King James Bible (public domain) from Debian's `bible-kjv-text`, decoded by its `bible` program; the
    /// embedded excerpt when the package is not installed. Byte-level language modelling (GPT).
    #[serde(rename = "kjv")]
    Kjv,
    /// Always the embedded KJV excerpt (the Pentateuch, ~0.9 MB), identical on every machine (tests).
    #[serde(rename = "kjv-excerpt")]
    KjvExcerpt,
    /// Any text file at `data.path`, byte-level (GPT).
    #[serde(rename = "text")]
    Text,
}

impl DatasetKind {
    /// Whether this is a byte-level text corpus (for language models) rather than labelled rows.
    pub fn is_text(self) -> bool {
        matches!(self, Self::Kjv | Self::KjvExcerpt | Self::Text)
    }
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
            "kjv" => Ok(Self::Kjv),
            "kjv-excerpt" => Ok(Self::KjvExcerpt),
            "text" => Ok(Self::Text),
            o => Err(format!(
                "unknown dataset {o:?} (fashion-mnist|digits|idx|csv|libsvm|kjv|kjv-excerpt|text)"
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
            Self::Kjv => "kjv",
            Self::KjvExcerpt => "kjv-excerpt",
            Self::Text => "text",
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
    /// Local-step rounds (DiLoCo): each worker runs this many inner steps with `[optimizer]` on its own copy, then
    /// pushes the pseudo-gradient θ_start − θ_end, and the shards apply `[optimizer.outer]`; one SSP clock is one
    /// round (default 0: a gradient push every step, `[optimizer]` on the shards).
    #[serde(default)]
    pub local_steps: u32,
    /// Most steps each worker runs (default 0: no cap, `epochs` passes); for corpora where a pass is long.
    #[serde(default)]
    pub max_steps: u64,
    /// Arithmetic of the workers' forward/backward (default f32; bf16 and f16 for candle models, the GPT).
    #[serde(default)]
    pub precision: ComputePrecision,
    /// Initial dynamic loss scale for bf16/f16 (default 65536 = 2^16).
    #[serde(default = "d_loss_scale")]
    pub loss_scale: f32,
    /// Clean steps after which the loss scale doubles (default 200).
    #[serde(default = "d_loss_scale_window")]
    pub loss_scale_window: u32,
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
    /// The outer optimizer the shards apply to pseudo-gradients in local-step rounds (`train.local_steps > 0`).
    #[serde(default)]
    pub outer: OuterOptimizerConfig,
}

/// `[optimizer.outer]`: the shards' optimizer in local-step rounds (DiLoCo's outer step).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OuterOptimizerConfig {
    /// Optimizer family (default nesterov, as DiLoCo).
    #[serde(default = "d_outer_kind")]
    pub kind: OptimizerKind,
    /// Outer learning rate (default 0.7, as DiLoCo).
    #[serde(default = "d_outer_lr")]
    pub lr: f32,
    /// Outer momentum (default 0.9, as DiLoCo).
    #[serde(default = "d_momentum")]
    pub momentum: f32,
}

impl Default for OuterOptimizerConfig {
    fn default() -> Self {
        OuterOptimizerConfig {
            kind: d_outer_kind(),
            lr: d_outer_lr(),
            momentum: d_momentum(),
        }
    }
}

fn d_outer_kind() -> OptimizerKind {
    OptimizerKind::Nesterov
}
fn d_outer_lr() -> f32 {
    0.7
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
    /// Checkpoints kept per shard (default 3), locally and in the object store.
    #[serde(default = "d_keep")]
    pub keep: usize,
    /// Object storage for checkpoints, `s3://bucket/prefix` (default none). Endpoint, region and credentials come
    /// from the `AWS_*` environment variables. Uploads run in the background after each local write.
    #[serde(default)]
    pub url: Option<String>,
    /// Keep the local copy of checkpoints when `url` is set (default true: restoring from it is fast).
    #[serde(default = "d_true")]
    pub local: bool,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            kind: ModelKind::default(),
            hidden: d_hidden(),
            seed: d_seed(),
            features: None,
            classes: None,
            layers: d_gpt_layers(),
            heads: d_gpt_heads(),
            dim: d_gpt_dim(),
            context: d_gpt_context(),
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
            local_steps: 0,
            max_steps: 0,
            precision: ComputePrecision::default(),
            loss_scale: d_loss_scale(),
            loss_scale_window: d_loss_scale_window(),
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
            outer: OuterOptimizerConfig::default(),
        }
    }
}
impl Default for CheckpointConfig {
    fn default() -> Self {
        Self {
            dir: d_ckpt_dir(),
            every_updates: d_every_updates(),
            keep: d_keep(),
            url: None,
            local: true,
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
            revoked: Vec::new(),
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
fn d_gpt_layers() -> usize {
    4
}
fn d_gpt_heads() -> usize {
    4
}
fn d_gpt_dim() -> usize {
    128
}
fn d_gpt_context() -> usize {
    64
}
fn d_loss_scale() -> f32 {
    65536.0
}
fn d_loss_scale_window() -> u32 {
    200
}
fn d_data_path() -> PathBuf {
    default_data_dir()
}

/// Environment variable that overrides the default data directory (CI points it at an empty folder to run the tests
/// as on a machine without Fashion-MNIST).
pub const DATA_DIR_ENV: &str = "TETHER_DATA_DIR";

/// The default `data.path`: `$TETHER_DATA_DIR` when set, else Debian's `/usr/share/datasets/fashion-mnist`.
pub fn default_data_dir() -> PathBuf {
    std::env::var_os(DATA_DIR_ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/share/datasets/fashion-mnist"))
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

/// `[compression]`: how workers encode gradient pushes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompressionConfig {
    /// Codec scheme (default q4).
    #[serde(default)]
    pub scheme: Scheme,
    /// Values per scaling bucket (default 512).
    #[serde(default = "d_bucket")]
    pub bucket: usize,
    /// Worker-side error feedback (default true).
    #[serde(default = "d_true")]
    pub error_feedback: bool,
    /// zstd (level 1) over the packed body when it makes it smaller (default true: q4 codes of real gradients are
    /// mostly small, so it roughly doubles the ratio for a little CPU; turn it off when the CPU is the limit).
    #[serde(default = "d_true")]
    pub zstd: bool,
    /// Rounding (default stochastic).
    #[serde(default)]
    pub rounding: Rounding,
    /// Pull parameters as bf16 instead of f32: half the pull bytes, weights rounded to 8 mantissa bits for the
    /// gradient computation only (the shards keep f32). Implies `pull = "full"`. Default false.
    #[serde(default)]
    pub pull_bf16: bool,
    /// How workers pull (default "delta"): `delta` (compressed deltas of each shard's public copy, with the error
    /// feedback on the server side) or `full` (the whole shard every time, f32 or, with `pull_bf16`, bf16).
    #[serde(default)]
    pub pull: PullKind,
    /// Codec scheme of pull deltas (default q4; q8 halves the rounding error for twice the bytes).
    #[serde(default)]
    pub pull_scheme: Scheme,
}

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

impl Default for CompressionConfig {
    fn default() -> Self {
        Self {
            scheme: Scheme::default(),
            bucket: d_bucket(),
            error_feedback: true,
            zstd: true,
            rounding: Rounding::default(),
            pull_bf16: false,
            pull: PullKind::default(),
            pull_scheme: Scheme::default(),
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
        }
    }
}

fn d_bucket() -> usize {
    512
}
fn d_true() -> bool {
    true
}

/// `[rollback]`: loss-spike rollback. When the training loss of a completed round exceeds `factor` × the running
/// median of the last `window` good rounds for `rounds` consecutive rounds (or is non-finite that long), every shard
/// restores its in-memory snapshot of the same earlier round (taken every `every` rounds, the last `keep` kept) and
/// the workers resume from it; for `lr_rounds` rounds afterwards the shards scale their learning rate by `lr_scale`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RollbackConfig {
    /// Detect spikes and roll back (default false).
    #[serde(default)]
    pub enabled: bool,
    /// Spike threshold k: a round's loss above k × the running median is suspect (default 3.0).
    #[serde(default = "d_rb_factor")]
    pub factor: f32,
    /// Consecutive suspect (or non-finite) rounds that trigger a rollback, m (default 2).
    #[serde(default = "d_rb_rounds")]
    pub rounds: u32,
    /// Good rounds the running median is taken over, W; no spike is called before W good rounds (default 16).
    #[serde(default = "d_rb_window")]
    pub window: u32,
    /// Snapshot period in rounds: shards snapshot when the minimum clock reaches a multiple of it (default 10).
    #[serde(default = "d_rb_every")]
    pub every: u64,
    /// Snapshots kept per shard, in memory (default 3).
    #[serde(default = "d_rb_keep")]
    pub keep: usize,
    /// Learning-rate factor applied by the shards after a rollback (default 1.0: off).
    #[serde(default = "d_rb_lr_scale")]
    pub lr_scale: f32,
    /// Rounds after a rollback during which `lr_scale` applies (default 0).
    #[serde(default)]
    pub lr_rounds: u64,
}

impl Default for RollbackConfig {
    fn default() -> Self {
        RollbackConfig {
            enabled: false,
            factor: d_rb_factor(),
            rounds: d_rb_rounds(),
            window: d_rb_window(),
            every: d_rb_every(),
            keep: d_rb_keep(),
            lr_scale: d_rb_lr_scale(),
            lr_rounds: 0,
        }
    }
}

impl RollbackConfig {
    /// Checks ranges, and that `keep` snapshots reach back far enough for an alarm `rounds` rounds after the onset
    /// under staleness bound `staleness` (see [`RollbackConfig::margin`]).
    pub fn validate(&self, staleness: Staleness) -> Result<(), ConfigError> {
        let bad = |key: &'static str, reason: String| Err(ConfigError::Invalid { key, reason });
        if !(self.factor > 1.0 && self.factor.is_finite()) {
            return bad("rollback.factor", "must be a finite number above 1".into());
        }
        if self.rounds == 0 || self.window == 0 || self.every == 0 {
            return bad("rollback.rounds/window/every", "must be at least 1".into());
        }
        if !(self.lr_scale > 0.0 && self.lr_scale <= 1.0) {
            return bad("rollback.lr_scale", "must be in (0, 1]".into());
        }
        let reach = u64::from(self.rounds) + Self::margin(staleness) + 1;
        let needed = 2 + reach / self.every;
        if self.enabled && (self.keep as u64) < needed {
            return bad(
                "rollback.keep",
                format!(
                    "{needed} snapshots needed to reach before a spike seen {reach} rounds late"
                ),
            );
        }
        Ok(())
    }

    /// Rounds a clean snapshot must precede a spike's onset by: 2s under a staleness bound s (a round's loss may be
    /// computed up to s rounds late, and a snapshot may hold up to s rounds past its boundary); 0 for BSP and, with
    /// no guarantee, for asynchronous runs.
    pub fn margin(staleness: Staleness) -> u64 {
        2 * u64::from(staleness.bound().unwrap_or(0))
    }
}

fn d_rb_factor() -> f32 {
    3.0
}
fn d_rb_rounds() -> u32 {
    2
}
fn d_rb_window() -> u32 {
    16
}
fn d_rb_every() -> u64 {
    10
}
fn d_rb_keep() -> usize {
    3
}
fn d_rb_lr_scale() -> f32 {
    1.0
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
        if let Some(p) = self.data.test_path.as_mut() {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        }
    }

    /// Checks ranges and consistency.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |key: &'static str, reason: &str| {
            Err(ConfigError::Invalid {
                key,
                reason: reason.to_string(),
            })
        };
        if self.cluster.servers.is_empty() {
            return bad("cluster.servers", "at least one server address is required");
        }
        if self.cluster.workers == 0 {
            return bad("cluster.workers", "must be at least 1");
        }
        if self.cluster.worker_timeout_ms == 0 {
            return bad("cluster.worker_timeout_ms", "must be positive");
        }
        if let Some(s) = self
            .cluster
            .revoked
            .iter()
            .find(|s| crate::pki::parse_serial(s).is_none())
        {
            return bad(
                "cluster.revoked",
                &format!("{s:?} is not a certificate serial (hex, at most 20 bytes)"),
            );
        }
        if self.train.batch == 0 {
            return bad("train.batch", "must be at least 1");
        }
        if !(self.train.clip_norm >= 0.0 && self.train.clip_norm.is_finite()) {
            return bad("train.clip_norm", "must be a finite non-negative number");
        }
        if !(self.optimizer.lr > 0.0 && self.optimizer.lr.is_finite()) {
            return bad("optimizer.lr", "must be a finite positive number");
        }
        if !(0.0..1.0).contains(&self.optimizer.beta1)
            || !(0.0..1.0).contains(&self.optimizer.beta2)
        {
            return bad("optimizer.beta1/beta2", "must be in [0, 1)");
        }
        if self.compression.bucket == 0 || self.compression.bucket > (1 << 20) {
            return bad("compression.bucket", "must be in 1..=1048576");
        }
        if !(self.optimizer.outer.lr > 0.0 && self.optimizer.outer.lr.is_finite()) {
            return bad("optimizer.outer.lr", "must be a finite positive number");
        }
        if !(0.0..1.0).contains(&self.optimizer.outer.momentum) {
            return bad("optimizer.outer.momentum", "must be in [0, 1)");
        }
        if let Some(url) = &self.checkpoint.url {
            let ok = url
                .strip_prefix("s3://")
                .is_some_and(|rest| !rest.is_empty() && !rest.starts_with('/'));
            if !ok {
                return bad("checkpoint.url", "must be s3://bucket[/prefix]");
            }
        }
        if self.checkpoint.keep == 0 {
            return bad("checkpoint.keep", "must be at least 1");
        }
        self.rollback.validate(self.cluster.staleness)?;
        if self.model.kind == ModelKind::Mlp && self.model.hidden.contains(&0) {
            return bad("model.hidden", "layer widths must be positive");
        }
        if self.model.kind == ModelKind::Gpt {
            let m = &self.model;
            if m.layers == 0 || m.layers > 64 || m.context == 0 || m.context > 4096 {
                return bad(
                    "model.layers/context",
                    "need 1..=64 layers and a context of 1..=4096",
                );
            }
            if m.heads == 0 || m.dim == 0 || !m.dim.is_multiple_of(m.heads) || m.dim > 8192 {
                return bad(
                    "model.heads/dim",
                    "dim must be a positive multiple of heads, at most 8192",
                );
            }
            if !self.data.dataset.is_text() {
                return bad(
                    "data.dataset",
                    "a GPT trains on a text dataset (kjv, kjv-excerpt, text)",
                );
            }
        }
        if !(self.train.loss_scale >= 1.0 && self.train.loss_scale <= 1.0e30) {
            return bad("train.loss_scale", "must be in [1, 1e30]");
        }
        if self.train.loss_scale_window == 0 {
            return bad("train.loss_scale_window", "must be at least 1");
        }
        if self.model.features == Some(0) || self.model.classes.is_some_and(|c| c < 2) {
            return bad(
                "model.features/classes",
                "need at least one feature and two classes",
            );
        }
        Ok(())
    }

    /// The optimizer the shards apply: `[optimizer]`, or in local-step rounds `[optimizer.outer]` at a constant
    /// learning rate with no weight decay.
    pub fn shard_optimizer(&self) -> OptimizerConfig {
        if self.train.local_steps == 0 {
            return self.optimizer.clone();
        }
        let o = self.optimizer.outer;
        OptimizerConfig {
            kind: o.kind,
            lr: o.lr,
            momentum: o.momentum,
            weight_decay: 0.0,
            schedule: Schedule::Constant,
            staleness_aware: false,
            ..OptimizerConfig::default()
        }
    }

    /// The factor a shard applies to each push: 1, or in local-step rounds 1/workers, so that one round's pushes add
    /// up to the step on the workers' mean pseudo-gradient (DiLoCo averages them before its outer step).
    pub fn push_scale(&self) -> f32 {
        if self.train.local_steps == 0 {
            1.0
        } else {
            1.0 / self.cluster.workers.max(1) as f32
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

    /// Input width and class count of the model: from `[model]` when given, else from the dataset kind.
    pub fn model_io(&self) -> Result<(usize, usize), ConfigError> {
        if self.model.kind == ModelKind::Gpt {
            // A GPT reads `context` byte tokens and predicts one of 256 bytes.
            return Ok((self.model.context, 256));
        }
        let (f, c) = match self.data.dataset {
            DatasetKind::FashionMnist | DatasetKind::Idx => (Some(784), Some(10)),
            DatasetKind::Digits => (Some(64), Some(10)),
            DatasetKind::Csv | DatasetKind::Libsvm => (None, None),
            DatasetKind::Kjv | DatasetKind::KjvExcerpt | DatasetKind::Text => {
                return Err(ConfigError::Invalid {
                    key: "model.kind",
                    reason: format!(
                        "dataset {} is text: it needs model.kind = \"gpt\"",
                        self.data.dataset
                    ),
                })
            }
        };
        let features = self.model.features.or(f).ok_or(ConfigError::Invalid {
            key: "model.features",
            reason: format!("required for dataset {}", self.data.dataset),
        })?;
        let classes = self.model.classes.or(c).ok_or(ConfigError::Invalid {
            key: "model.classes",
            reason: format!("required for dataset {}", self.data.dataset),
        })?;
        Ok((features, classes))
    }

    /// Layer widths of the configured model, input first and classes last.
    pub fn model_dims(&self) -> Result<Vec<usize>, ConfigError> {
        let (features, classes) = self.model_io()?;
        let mut dims = vec![features];
        if self.model.kind == ModelKind::Mlp {
            dims.extend_from_slice(&self.model.hidden);
        }
        dims.push(classes);
        Ok(dims)
    }

    /// The parameter layout of the configured model (servers and workers must agree on it).
    pub fn layout(&self) -> Result<crate::layout::Layout, ConfigError> {
        if self.model.kind == ModelKind::Gpt {
            return Ok(crate::layout::gpt_layout(&self.gpt_shape()));
        }
        Ok(crate::layout::mlp_layout(&self.model_dims()?))
    }

    /// The GPT's shape from `[model]` (byte vocabulary).
    pub fn gpt_shape(&self) -> crate::layout::GptShape {
        crate::layout::GptShape {
            vocab: 256,
            context: self.model.context,
            layers: self.model.layers,
            heads: self.model.heads,
            dim: self.model.dim,
        }
    }

    /// A default configuration for the given server addresses.
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
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minimal_file_gets_defaults_and_resolves_paths() {
        let cfg = Config::parse(
            "[cluster]\nservers = [\"127.0.0.1:7000\"]\n",
            Path::new("/etc/tether"),
        )
        .unwrap();
        assert_eq!(cfg.cluster.workers, 4);
        assert_eq!(cfg.cluster.staleness, Staleness::Bounded(3));
        assert_eq!(cfg.cluster.tls_dir, PathBuf::from("/etc/tether/certs"));
        assert_eq!(cfg.checkpoint.dir, PathBuf::from("/etc/tether/ckpt"));
        assert_eq!(cfg.data.path, default_data_dir());
        assert_eq!(cfg.compression.scheme, Scheme::Q4);
        assert_eq!(cfg.optimizer.kind, OptimizerKind::Adam);
        assert_eq!(cfg.model.hidden, vec![256, 128]);
    }

    #[test]
    fn design_doc_example_parses() {
        let text = r#"
[cluster]
servers = ["127.0.0.1:7000", "127.0.0.1:7001"]
workers = 4
staleness = 3
worker_timeout_ms = 5000
tls_dir = "certs"
[model]
kind = "mlp"
hidden = [256, 128]
seed = 42
[data]
dataset = "fashion-mnist"
path = "/usr/share/datasets/fashion-mnist"
[train]
batch = 128
epochs = 5
eval_every = 200
[optimizer]
kind = "adam"
lr = 1e-3
[compression]
scheme = "q4"
bucket = 512
error_feedback = true
zstd = true
[checkpoint]
dir = "ckpt"
every_updates = 500
keep = 3
"#;
        let cfg = Config::parse(text, Path::new("/x")).unwrap();
        assert_eq!(cfg.cluster.servers.len(), 2);
        assert!(cfg.compression.zstd);
    }

    #[test]
    fn staleness_accepts_inf_and_numbers_only() {
        let p = |s: &str| {
            Config::parse(
                &format!("[cluster]\nservers=[\"a:1\"]\nstaleness={s}\n"),
                Path::new("/"),
            )
        };
        assert_eq!(
            p("\"inf\"").unwrap().cluster.staleness,
            Staleness::Unbounded
        );
        assert_eq!(p("0").unwrap().cluster.staleness, Staleness::Bounded(0));
        assert!(p("-1").is_err());
        assert!(p("\"soon\"").is_err());
    }

    #[test]
    fn unknown_keys_are_errors_naming_the_key() {
        let e = Config::parse(
            "[cluster]\nservers=[\"a:1\"]\nworkerz = 3\n",
            Path::new("/"),
        )
        .unwrap_err();
        assert!(e.to_string().contains("workerz"), "{e}");
        let e = Config::parse(
            "[cluster]\nservers=[\"a:1\"]\n[optimiser]\nlr=1\n",
            Path::new("/"),
        )
        .unwrap_err();
        assert!(e.to_string().contains("optimiser"), "{e}");
    }

    #[test]
    fn missing_servers_and_bad_values_are_rejected() {
        assert!(Config::parse("[cluster]\nworkers = 2\n", Path::new("/")).is_err());
        let e = Config::parse(
            "[cluster]\nservers=[\"a:1\"]\n[optimizer]\nlr = -1.0\n",
            Path::new("/"),
        )
        .unwrap_err();
        assert!(e.to_string().contains("optimizer.lr"), "{e}");
        assert!(Config::parse(
            "[cluster]\nservers=[\"a:1\"]\n[compression]\nscheme=\"q3\"\n",
            Path::new("/")
        )
        .is_err());
    }
}

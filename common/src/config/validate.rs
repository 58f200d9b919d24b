//! Validation of a parsed `cluster.toml`: every range and cross-section consistency rule, each failure an
//! [`ConfigError::Invalid`] naming the offending key. Pure: it reads the configuration and changes nothing.

use super::{Config, ConfigError, ModelKind};

/// Most compute threads a worker (`train.threads`) or a shard (`shard.threads`) may be given.
pub const MAX_THREADS: u32 = 1024;
/// Most streamed fragments (`train.fragments`).
pub const MAX_FRAGMENTS: u32 = 64;
/// Most rounds whose sums a shard stepping at round close (`optimizer.outer.at_close`) holds at once:
/// `max(staleness + 2, fragments)`.
pub const MAX_OPEN_ROUNDS: u32 = 64;

impl Config {
    /// Settings that are valid but were measured to train badly, each as one sentence citing the measurement; the
    /// binaries log them as warnings and the quickstart prints them under its banner. Pure.
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        let outer = &self.optimizer.outer;
        let momentum_kind = matches!(
            outer.kind,
            super::OptimizerKind::Nesterov | super::OptimizerKind::Momentum
        );
        let stale = !matches!(self.cluster.staleness, super::Staleness::Bounded(0));
        if self.train.local_steps > 0 && momentum_kind && outer.momentum >= 0.9 && stale {
            out.push(format!(
                "optimizer.outer.momentum = {} with train.local_steps = {} and cluster.staleness = {} is known to \
                 diverge: the MLP on Fashion-MNIST at H = 16, s = 3 ended at 0.15 accuracy against 0.88 with \
                 momentum 0.5 (docs/pulls-and-local-steps.md); use 0.5, or staleness 0",
                outer.momentum, self.train.local_steps, self.cluster.staleness
            ));
        }
        if self.train.local_steps > 0 && momentum_kind && outer.lr > 1.0 && stale {
            out.push(format!(
                "optimizer.outer.lr = {} with train.local_steps = {} and cluster.staleness = {} trains badly: the \
                 quickstart's BSP sync (top-k 2-bit, outer lr 1.4, momentum 0.5) run at s = 3 (4 workers, the \
                 MLP on Fashion-MNIST, 15 epochs) ended at 0.67 accuracy, swinging between 0.42 and 0.73, against 0.88 \
                 for a push every step (docs/links.md); use staleness 0 (BSP rounds) or an outer lr of at most 1",
                outer.lr, self.train.local_steps, self.cluster.staleness
            ));
        }
        out
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
        if self.cluster.progress_timeout_ms < self.cluster.worker_timeout_ms {
            return bad(
                "cluster.progress_timeout_ms",
                "must be at least cluster.worker_timeout_ms (honest rounds may be slow)",
            );
        }
        let m = self.cluster.max_workers;
        if m != 0 && !(self.cluster.workers..=4096).contains(&m) {
            return bad(
                "cluster.max_workers",
                &format!(
                    "{m} must be 0 (no elastic ranks) or between cluster.workers ({}) and 4096",
                    self.cluster.workers
                ),
            );
        }
        if self.cluster.quorum > self.cluster.workers {
            return bad(
                "cluster.quorum",
                &format!(
                    "{} is more than cluster.workers ({}): no round could ever close",
                    self.cluster.quorum, self.cluster.workers
                ),
            );
        }
        let standbys = &self.cluster.standbys;
        if !standbys.is_empty() && standbys.len() != self.cluster.servers.len() {
            return bad(
                "cluster.standbys",
                &format!(
                    "{} standby address(es) for {} server(s): give one per shard, or none",
                    standbys.len(),
                    self.cluster.servers.len()
                ),
            );
        }
        if !standbys.is_empty()
            && self
                .cluster
                .witness
                .as_deref()
                .is_none_or(|w| w.trim().is_empty())
        {
            return bad(
                "cluster.witness",
                "replicated shards need a witness address (run `tether-server witness`): without a third vote a \
                 partition between a shard's two nodes would let both serve",
            );
        }
        for (k, addr) in standbys.iter().enumerate() {
            let clash = self
                .cluster
                .servers
                .iter()
                .position(|s| s.trim() == addr.trim());
            if let Some(j) = clash {
                return bad(
                    "cluster.standbys",
                    &format!(
                        "standby {k} ({addr}) is the address of server {j}: a replica must be another process"
                    ),
                );
            }
            if standbys[..k].iter().any(|s| s.trim() == addr.trim()) {
                return bad(
                    "cluster.standbys",
                    &format!("{addr} is listed twice: each shard needs its own standby"),
                );
            }
        }
        if !(200..=self.cluster.worker_timeout_ms.max(200)).contains(&self.cluster.failover_ms) {
            return bad(
                "cluster.failover_ms",
                "must be between 200 and cluster.worker_timeout_ms",
            );
        }
        let g = self.cluster.grace_factor;
        if !(g.is_finite() && g > 0.0 && g <= 100.0) {
            return bad("cluster.grace_factor", "must be in (0, 100]");
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
        // The codec's own rules, for the codecs pushes and pulls use: one copy of each rule, in the codec.
        let c = &self.compression;
        if !(c.keep.is_power_of_two() && (2..=1 << 15).contains(&c.keep)) {
            return bad("compression.keep", "must be a power of two from 2 to 32768");
        }
        for codec in [c.codec(), c.pull_codec()] {
            if let Err(e) = codec.validate() {
                let key = match e {
                    crate::codec::CodecError::InvalidKeep => "compression.keep",
                    _ => "compression.bucket",
                };
                return bad(key, &codec.rules(&e));
            }
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
        self.guard.validate()?;
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
        if self.model.kind == ModelKind::File && self.model.file.is_none() {
            return bad(
                "model.file",
                "required for model.kind = \"file\" (the model file with layout and initial weights)",
            );
        }
        if !(self.train.loss_scale >= 1.0 && self.train.loss_scale <= 1.0e30) {
            return bad("train.loss_scale", "must be in [1, 1e30]");
        }
        if self.train.loss_scale_window == 0 {
            return bad("train.loss_scale_window", "must be at least 1");
        }
        if self.train.local_steps_max > 0
            && (self.train.local_steps == 0 || self.train.local_steps_max < self.train.local_steps)
        {
            return bad(
                "train.local_steps_max",
                "needs train.local_steps > 0 and must be at least train.local_steps (0: H pinned)",
            );
        }
        if self.train.fragments == 0 || self.train.fragments > MAX_FRAGMENTS {
            return bad(
                "train.fragments",
                "must be in [1, 64] (1: the whole model each round)",
            );
        }
        if self.optimizer.outer.at_close {
            if self.train.local_steps == 0 {
                return bad(
                    "optimizer.outer.at_close",
                    "needs local-step rounds (train.local_steps > 0): a push every step has no round to close",
                );
            }
            let open = match self.cluster.staleness {
                super::Staleness::Bounded(s) => u64::from(s) + 2,
                super::Staleness::Unbounded => u64::MAX,
            };
            if open > u64::from(MAX_OPEN_ROUNDS) {
                return bad(
                    "optimizer.outer.at_close",
                    "needs cluster.staleness of at most 62: the shards hold a sum for each round still open",
                );
            }
        }
        if self.train.fragments > 1 && self.train.local_steps == 0 {
            return bad(
                "train.fragments",
                "above 1 needs local-step rounds (train.local_steps > 0): a fragment is part of a pseudo-gradient",
            );
        }
        if self.train.threads > MAX_THREADS {
            return bad(
                "train.threads",
                "must be at most 1024 (0: a share of the cores)",
            );
        }
        if self.shard.threads > MAX_THREADS {
            return bad(
                "shard.threads",
                "must be at most 1024 (0: every core this process may use)",
            );
        }
        if self.model.features == Some(0) || self.model.classes.is_some_and(|c| c < 2) {
            return bad(
                "model.features/classes",
                "need at least one feature and two classes",
            );
        }
        // The model's size, when the configuration alone determines it (a model that does not fit the dataset is
        // refused where its layout is built).
        if self.model.kind == ModelKind::Gpt || crate::layout::model_io(self).is_ok() {
            crate::layout::model_params(self)?;
        }
        Ok(())
    }
}

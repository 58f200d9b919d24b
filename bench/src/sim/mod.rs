//! The discrete-event simulator of a Tether cluster: plain Rust, parameters in, a [`SimReport`] out.
//!
//! What it models is what the worker's training loop (`tether_worker::PreparedWorker::run`) and the shard actor do.
//! Each worker loops: pull at clock `c` (one request per shard), wait until every shard answered, compute the round
//! (a lognormal time, optionally stretched by a straggler model, plus the worker's codec work), push one frame to
//! every shard without waiting for the outcome, and pull again at `c + 1`. Each shard is one serial CPU (its actor)
//! that serves applies and pull replies in arrival order, and answers a pull for clock `c` only once its gate stands
//! at `c − s` or above (`ClockTable::can_answer`); a push moves its worker's clock when it is applied. Every host has
//! one NIC: a FIFO per direction at the link rate, and a message holds the sender's egress and the receiver's
//! ingress at once (cut-through), then arrives a one-way latency later. QUIC's CPU per byte is charged to the
//! sending and receiving CPUs.
//!
//! [`SimConfig`] alone is the per-step model (a push every step, the SSP minimum as the gate, one host per node, one
//! thread per shard): [`simulate`]. A [`SyncModel`] adds what the default sync does ([`simulate_sync`]):
//! - **local-step rounds**: `compute_s` is a round of H inner steps; the shard cuts its public copy once per round
//!   (when the gate moves) and every reply of the round carries that cut;
//! - **quorum rounds**: the gate is `server/src/quorum.rs`'s [`RoundCloser`](tether_server::quorum::RoundCloser)
//!   itself, driven with the simulated clock in ms: a round closes once the quorum pushed it and the grace window
//!   passed, and late pushes land in the open round;
//! - **standbys**: every input is logged to the shard's standby (a push's bytes over the primary's NIC), which
//!   applies it on its own CPU and acknowledges; a reply leaves only once the newest entry was acknowledged;
//! - **threads**: per-parameter and per-byte shard CPU is divided by the kernels' speedup at `shard_threads`, a
//!   fixed serial part per message is not;
//! - **hosts**: nodes may share hosts, and so their NICs, as `tether-bench scale` places them.
//!
//! [`simulate_free`] reruns a configuration with resources made free ([`Free`]), which is how the prediction
//! ([`crate::predict`]) names what limits a run.

mod engine;
mod resources;
mod sync;
#[cfg(test)]
mod tests;

pub use sync::{Free, OuterStep, SyncModel};

/// Everything the simulator needs; [`SimConfig::validate`] refuses nonsense.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SimConfig {
    /// Workers.
    pub workers: u32,
    /// Shards (parameters split evenly).
    pub shards: u32,
    /// Model parameters.
    pub params: u64,
    /// Staleness bound (`None`: asynchronous).
    pub staleness: Option<u64>,
    /// Push rounds per worker.
    pub rounds: u64,
    /// Mean compute time of a round, seconds.
    pub compute_s: f64,
    /// Coefficient of variation of the compute time (lognormal).
    pub compute_cv: f64,
    /// Transient stragglers on every worker: `(probability, factor)` per round.
    pub straggle: Option<(f64, f64)>,
    /// A persistent straggler: worker 0 is this many times slower.
    pub slow_worker: Option<f64>,
    /// Wire bytes per parameter of a push.
    pub push_bytes_per_param: f64,
    /// Wire bytes per parameter of a pull reply.
    pub pull_bytes_per_param: f64,
    /// Worker CPU per model parameter per round (encode the push, decode the pull), ns.
    pub worker_ns_per_param: f64,
    /// Shard CPU per pushed parameter (validate, decode, optimizer step), ns.
    pub apply_ns_per_param: f64,
    /// Shard CPU per pulled parameter (the reply: cut, encode, copy), ns.
    pub serve_ns_per_param: f64,
    /// Transport CPU per wire byte, each side, ns.
    pub cpu_ns_per_byte: f64,
    /// Link rate per NIC direction, bits/s (`f64::INFINITY`: unshaped).
    pub link_bps: f64,
    /// One-way latency, seconds.
    pub latency_s: f64,
    /// Seed of the compute-time draws.
    pub seed: u64,
    /// Cores shared by every worker's and shard's CPU work (one machine, as the study's runs); `None`: each node
    /// has its own (a real cluster).
    #[serde(default)]
    pub cores: Option<u32>,
    /// Fixed cost of a pull reply beyond bytes and CPU (request handling, wake-ups), seconds.
    #[serde(default)]
    pub pull_overhead_s: f64,
    /// Worker CPU per round off the critical path (transport threads), seconds: it takes a core from the shared
    /// pool (with `cores`) but nothing waits for it.
    #[serde(default)]
    pub worker_io_s: f64,
    /// Shard CPU per pushed parameter off the actor's critical path (its transport threads), ns: it takes a core
    /// from the shared pool but nothing waits for it.
    #[serde(default)]
    pub shard_io_ns_per_param: f64,
    /// A measured distribution of a round's compute, as equally spaced quantiles from the smallest to the largest
    /// (seconds, at least 2, ascending): when given, each round's compute is drawn from it (the inverse of its
    /// distribution function, linear between the points) instead of the lognormal of `compute_s` and `compute_cv`.
    #[serde(default)]
    pub compute_quantiles_s: Vec<f64>,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            workers: 4,
            shards: 2,
            params: 1 << 20,
            staleness: Some(3),
            rounds: 100,
            compute_s: 0.01,
            compute_cv: 0.1,
            straggle: None,
            slow_worker: None,
            push_bytes_per_param: 0.5,
            pull_bytes_per_param: 0.5,
            worker_ns_per_param: 2.0,
            apply_ns_per_param: 3.0,
            serve_ns_per_param: 1.0,
            cpu_ns_per_byte: 1.0,
            link_bps: 1e9,
            latency_s: 50e-6,
            seed: 1,
            cores: None,
            pull_overhead_s: 0.0,
            worker_io_s: 0.0,
            shard_io_ns_per_param: 0.0,
            compute_quantiles_s: Vec::new(),
        }
    }
}

/// A refused configuration.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SimError {
    /// A field is out of range.
    #[error("simulator parameter {field} = {value}: {why}")]
    Parameter {
        /// The field.
        field: &'static str,
        /// Its value.
        value: String,
        /// What is wrong.
        why: &'static str,
    },
}

impl SimConfig {
    /// Checks every field (sizes bounded so that a run stays within seconds and memory).
    pub fn validate(&self) -> Result<(), SimError> {
        let bad = |field, value: String, why| Err(SimError::Parameter { field, value, why });
        if self.workers == 0 || self.workers > 65_536 {
            return bad("workers", self.workers.to_string(), "must be 1..=65536");
        }
        if self.shards == 0 || self.shards > 4096 || u64::from(self.shards) > self.params {
            return bad(
                "shards",
                self.shards.to_string(),
                "must be 1..=4096 and ≤ params",
            );
        }
        if self.rounds == 0
            || self
                .rounds
                .saturating_mul(u64::from(self.workers) * u64::from(self.shards))
                > 1 << 28
        {
            return bad(
                "rounds",
                self.rounds.to_string(),
                "rounds × workers × shards must be 1..=2^28",
            );
        }
        let nonneg = [
            ("compute_s", self.compute_s),
            ("compute_cv", self.compute_cv),
            ("push_bytes_per_param", self.push_bytes_per_param),
            ("pull_bytes_per_param", self.pull_bytes_per_param),
            ("worker_ns_per_param", self.worker_ns_per_param),
            ("apply_ns_per_param", self.apply_ns_per_param),
            ("serve_ns_per_param", self.serve_ns_per_param),
            ("cpu_ns_per_byte", self.cpu_ns_per_byte),
            ("latency_s", self.latency_s),
            ("pull_overhead_s", self.pull_overhead_s),
            ("worker_io_s", self.worker_io_s),
            ("shard_io_ns_per_param", self.shard_io_ns_per_param),
        ];
        for (field, v) in nonneg {
            if !(v.is_finite() && v >= 0.0) {
                return bad(field, v.to_string(), "must be finite and ≥ 0");
            }
        }
        if self.link_bps.is_nan() || self.link_bps <= 0.0 {
            return bad("link_bps", self.link_bps.to_string(), "must be > 0");
        }
        if let Some((p, f)) = self.straggle {
            if !((0.0..=1.0).contains(&p) && f.is_finite() && f >= 1.0) {
                return bad(
                    "straggle",
                    format!("{p}:{f}"),
                    "needs P in [0, 1] and F ≥ 1",
                );
            }
        }
        let q = &self.compute_quantiles_s;
        if !q.is_empty()
            && (q.len() < 2
                || q.len() > 1001
                || q.iter().any(|v| !(v.is_finite() && *v >= 0.0))
                || q.windows(2).any(|w| w[1] < w[0]))
        {
            return bad(
                "compute_quantiles_s",
                format!("{} points", q.len()),
                "must be 2..=1001 finite, non-negative, ascending seconds",
            );
        }
        if let Some(c) = self.cores {
            if c == 0 || c > 4096 {
                return bad("cores", c.to_string(), "must be 1..=4096");
            }
        }
        if let Some(f) = self.slow_worker {
            if !(f.is_finite() && f >= 1.0) {
                return bad("slow_worker", f.to_string(), "must be ≥ 1");
            }
        }
        Ok(())
    }
}

/// What a simulated run measured.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SimReport {
    /// Until the last worker finished, seconds.
    pub wall_s: f64,
    /// Push rounds per second, all workers together.
    pub rounds_per_s: f64,
    /// Mean over workers of (time waiting for pulls) / (that worker's run time).
    pub stall_fraction: f64,
    /// Busiest shard CPU, fraction of the wall time.
    pub shard_cpu_util: f64,
    /// Busiest shard NIC direction, fraction of the wall time.
    pub shard_link_util: f64,
    /// Busiest worker NIC direction, fraction of the wall time.
    pub worker_link_util: f64,
    /// Mean worker compute (rounds' own time), fraction of the wall time.
    pub compute_util: f64,
    /// What bounds throughput: `shard cpu`, `shard link`, `worker link`, `staleness gate` or `compute`.
    pub limit: String,
    /// Clock lead (`c − m`) of each answered pull: count per lead value (index = lead, capped at the last bucket).
    pub lead_histogram: Vec<u64>,
    /// Round time: median gap between a worker's consecutive pushes applied on shard 0, seconds (as `tether-bench
    /// scale` reads it from the workers' histories).
    #[serde(default)]
    pub round_p50_s: f64,
    /// Stall: pull wait per round, median over workers, seconds.
    #[serde(default)]
    pub stall_per_round_s: f64,
    /// Rounds shard 0 closed with a punctual worker left behind (quorum rounds).
    #[serde(default)]
    pub quorum_closes: u64,
    /// Workers shard 0's quorum closes left behind, in all.
    #[serde(default)]
    pub left_behind: u64,
}

/// Runs the per-step model to the end (every worker ran `rounds` rounds).
pub fn simulate(cfg: &SimConfig) -> Result<SimReport, SimError> {
    simulate_sync(cfg, &SyncModel::per_step())
}

/// Runs `cfg` under the synchronisation `sync` to the end.
pub fn simulate_sync(cfg: &SimConfig, sync: &SyncModel) -> Result<SimReport, SimError> {
    simulate_free(cfg, sync, Free::NONE)
}

/// Runs `cfg` under `sync` with the resources in `free` costing nothing (a counterfactual).
pub fn simulate_free(cfg: &SimConfig, sync: &SyncModel, free: Free) -> Result<SimReport, SimError> {
    cfg.validate()?;
    sync.validate(cfg.workers)?;
    Ok(engine::Engine::new(cfg, sync, free).run())
}

//! How the cluster synchronises, beyond the per-step SSP loop of [`SimConfig`](super::SimConfig): local-step rounds,
//! quorum rounds with a grace window, standbys, multi-threaded shards and where nodes sit on hosts ([`SyncModel`]),
//! plus the counterfactuals the prediction uses to name what limits a run ([`Free`]). Plain data with its own checks;
//! [`SyncModel::per_step`] is the model the simulator had before these existed, bit for bit.

use super::SimError;

/// Values per chunk of a shard's parallel kernels (the shard's own constant, 256 KiB of f32): a range of fewer
/// values runs on one thread.
const CHUNK_VALUES: usize = 1 << 16;

/// When a shard runs the outer optimizer of local-step rounds.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum OuterStep {
    /// On every push, over the shard's whole range, scaled by 1/workers: what `ShardCore::apply` does today
    /// (decode, norm, then the optimizer step over the part), costing `apply_ns_per_param` per push.
    EveryPush,
    /// Each push is opened, decoded, judged and added to its round's sum (`push_ns_per_param`), and one dense outer
    /// step (`step_ns_per_param`) runs when the round closes: `optimizer.outer.at_close`.
    AtClose {
        /// Shard CPU per shard parameter of one push (open, decode, norm, add into the sum), ns (one thread).
        push_ns_per_param: f64,
        /// Shard CPU per shard parameter of the outer step at close, ns (one thread).
        step_ns_per_param: f64,
    },
}

/// The synchronisation being simulated (see the module docs of [`super`] for what each field changes).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct SyncModel {
    /// Inner steps per round (DiLoCo `train.local_steps`); 0: a gradient push every step. Above 0 the shards cut the
    /// public copy once per round (when the gate moves) instead of once per pull; `compute_s` is the whole round.
    pub local_steps: u32,
    /// `cluster.quorum`: pushes that close a round (0: every live worker, the plain SSP minimum).
    pub quorum: u32,
    /// `cluster.grace_factor`: the grace window after the quorum, as a multiple of the median recent round time.
    pub grace_factor: f64,
    /// The longest grace window (the eviction timeout, `cluster.worker_timeout_ms`), seconds; also the window before
    /// any round closed.
    pub grace_max_s: f64,
    /// Every shard has a standby: every input is logged to it, and a reply leaves only once the standby has applied
    /// and acknowledged the newest entry.
    pub standbys: bool,
    /// `shard.threads`: threads each shard (and standby) runs its chunked kernels and transport on.
    pub shard_threads: u32,
    /// Measured speedup of the shard's kernels at 2 threads over 1 (`apply_threads` example); `speedup(T) = 1 +
    /// (T − 1)(speedup_at_2 − 1)`, over at most one thread per chunk of the shard's range.
    pub speedup_at_2: f64,
    /// Serial shard CPU per message (request handling, mailbox, wake-ups), seconds, at any thread count.
    pub shard_msg_s: f64,
    /// When the outer step runs (local-step rounds only).
    pub outer_step: OuterStep,
    /// Hosts the nodes share (`None`: every worker, primary and standby on its own host). With `Some(h)`, as
    /// `tether-bench scale` places them: worker `r` on host `r mod h`, primary `k` on `k mod h`, its standby on the
    /// next host; each host has one NIC at `link_bps`, and traffic between nodes of one host skips it.
    pub hosts: Option<u32>,
}

impl Default for SyncModel {
    fn default() -> Self {
        SyncModel::per_step()
    }
}

impl SyncModel {
    /// The model before local-step rounds: per-step pushes, the SSP minimum, no standbys, one shard thread, one host
    /// per node, no per-message cost.
    pub fn per_step() -> SyncModel {
        SyncModel {
            local_steps: 0,
            quorum: 0,
            grace_factor: 0.5,
            grace_max_s: 5.0,
            standbys: false,
            shard_threads: 1,
            speedup_at_2: 2.0,
            shard_msg_s: 0.0,
            outer_step: OuterStep::EveryPush,
            hosts: None,
        }
    }

    /// Whether rounds are local-step rounds (one public-copy cut per round; the limit's name for waiting on a
    /// round is `quorum wait`).
    pub fn rounds(&self) -> bool {
        self.local_steps > 0 || self.quorum > 0
    }

    /// The kernels' speedup on a range of `range` parameters: `1 + (t − 1)(speedup_at_2 − 1)` with `t` the threads,
    /// at most one per chunk of the range (`ChunkPool` runs one job per chunk).
    pub fn speedup(&self, range: f64) -> f64 {
        let chunks = (range / CHUNK_VALUES as f64).ceil().max(1.0);
        let t = f64::from(self.shard_threads.max(1)).min(chunks);
        1.0 + (t - 1.0) * (self.speedup_at_2 - 1.0)
    }

    /// Checks every field against the workers it will run with.
    pub fn validate(&self, workers: u32) -> Result<(), SimError> {
        let bad = |field, value: String, why| Err(SimError::Parameter { field, value, why });
        if self.quorum > workers {
            return bad("quorum", self.quorum.to_string(), "must be ≤ workers");
        }
        if !(self.grace_factor.is_finite() && self.grace_factor >= 0.0) {
            return bad(
                "grace_factor",
                self.grace_factor.to_string(),
                "must be finite and ≥ 0",
            );
        }
        if !(self.grace_max_s.is_finite() && self.grace_max_s > 0.0 && self.grace_max_s <= 1e6) {
            return bad(
                "grace_max_s",
                self.grace_max_s.to_string(),
                "must be in (0, 1e6]",
            );
        }
        if self.shard_threads == 0 || self.shard_threads > 1024 {
            return bad(
                "shard_threads",
                self.shard_threads.to_string(),
                "must be 1..=1024",
            );
        }
        if !(1.0..=2.0).contains(&self.speedup_at_2) {
            return bad(
                "speedup_at_2",
                self.speedup_at_2.to_string(),
                "must be in [1, 2]",
            );
        }
        if !(self.shard_msg_s.is_finite() && self.shard_msg_s >= 0.0) {
            return bad(
                "shard_msg_s",
                self.shard_msg_s.to_string(),
                "must be finite and ≥ 0",
            );
        }
        if let OuterStep::AtClose {
            push_ns_per_param: a,
            step_ns_per_param: b,
        } = self.outer_step
        {
            for (name, v) in [("push_ns_per_param", a), ("step_ns_per_param", b)] {
                if !(v.is_finite() && v >= 0.0) {
                    return bad(name, v.to_string(), "must be finite and ≥ 0");
                }
            }
        }
        if let Some(h) = self.hosts {
            if h == 0 || h > 65_536 {
                return bad("hosts", h.to_string(), "must be 1..=65536");
            }
        }
        Ok(())
    }
}

/// Resources made free for a counterfactual run: what the prediction removes one at a time to see what limits.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Free {
    /// Shard and standby CPU costs nothing.
    pub shard_cpu: bool,
    /// The shard side of every transfer (the primary's and the standby's NIC) takes no time.
    pub shard_link: bool,
    /// The worker side of every transfer takes no time.
    pub worker_link: bool,
}

impl Free {
    /// Nothing free: the run as configured.
    pub const NONE: Free = Free {
        shard_cpu: false,
        shard_link: false,
        worker_link: false,
    };
    /// Infinite network and free shards: the ideal the efficiency is compared with.
    pub const ALL: Free = Free {
        shard_cpu: true,
        shard_link: true,
        worker_link: true,
    };
}

//! The JSON run report (docs/design.md §6) written by workers, servers and the embedded cluster, the staleness
//! histogram shape it carries, and the one way to build it: [`RunReport::for_config`] fills the run description,
//! then each role adds what it measured through typed parts ([`WorkerCounters`], [`ShardCounters`], [`Traffic`],
//! [`Rollbacks`], the curves), so no caller restates the struct. Plain data: nothing here measures anything.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// One bucket of a staleness histogram: values in `lo..=hi` were seen `count` times (`hi = None` is open-ended).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HistogramBucket {
    /// Smallest value in the bucket.
    pub lo: u64,
    /// Largest value in the bucket (`None`: no upper end).
    pub hi: Option<u64>,
    /// Number of observations.
    pub count: u64,
}

/// The run report; the required keys of docs/design.md §6 plus the extensions listed there.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct RunReport {
    /// Dataset name (`fashion-mnist`, `digits`, ...).
    pub dataset: String,
    /// Model description (e.g. `mlp 784-256-128-10`).
    pub model: String,
    /// Number of parameters.
    pub params: u64,
    /// Number of workers.
    pub workers: u32,
    /// Number of shards.
    pub shards: u32,
    /// Staleness bound (`"inf"` or a number).
    pub staleness_bound: String,
    /// Compression scheme (`q4`, `none`, ...).
    pub compression: String,
    /// Push rounds completed, summed over workers.
    pub steps: u64,
    /// Epochs requested per worker.
    pub epochs: u32,
    /// Wall time of the run in seconds.
    pub wall_seconds: f64,
    /// Mean training loss over the last steps.
    pub final_train_loss: f64,
    /// Test accuracy of the final model.
    pub final_test_accuracy: f64,
    /// Bytes of encoded gradient frames pushed (what crossed the wire, before QUIC/TLS overhead).
    pub wire_bytes_pushed: u64,
    /// Bytes the same pushes would have taken as raw fp32.
    pub fp32_bytes_pushed: u64,
    /// Bytes of parameter replies pulled.
    pub wire_bytes_pulled: u64,
    /// Updates applied by the shards (summed over shards).
    pub updates_applied: u64,
    /// Updates rejected by the shards (summed over shards).
    pub updates_rejected: u64,
    /// Largest clock lead (worker clock − min clock) seen when a pull was answered.
    pub max_clock_lead_observed: u64,
    /// Largest staleness (in updates) of an applied gradient.
    pub max_staleness_observed: u64,
    /// Histogram of applied-gradient staleness (summed over shards).
    pub staleness_histogram: Vec<HistogramBucket>,
    /// Training loss over time: `[step, seconds, loss]`.
    pub loss_curve: Vec<(u64, f64, f64)>,
    /// Test accuracy over time: `[step, seconds, accuracy]`.
    pub accuracy_curve: Vec<(u64, f64, f64)>,
    /// Extension: pushes a worker refused to send because the gradient was not finite.
    #[serde(default)]
    pub nonfinite_skipped: u64,
    /// Extension: pushes (and skip markers) the shards refused or a rejoin dropped, as the workers learned them.
    #[serde(default)]
    pub pushes_refused: u64,
    /// Extension: updates the shards' numerical guard refused (norm bound, norm spike, non-finite state), summed over
    /// shards; part of `updates_rejected`.
    #[serde(default)]
    pub guard_refused: u64,
    /// Extension: the largest gradient norm the shards' guard admitted (the most of any shard).
    #[serde(default)]
    pub max_push_norm: f64,
    /// Extension: pull replies the workers dropped because they answered a superseded request.
    #[serde(default)]
    pub stale_replies_dropped: u64,
    /// Extension: reconnections of workers to shards.
    #[serde(default)]
    pub reconnects: u64,
    /// Extension: what the used pull replies would have weighed as f32 values (the fp32 counterpart of
    /// `wire_bytes_pulled`).
    #[serde(default)]
    pub fp32_bytes_pulled: u64,
    /// Extension: how workers pulled (`delta q4`, `full bf16`, ...).
    #[serde(default)]
    pub pull: String,
    /// Extension: inner steps per outer round (0: a push every step).
    #[serde(default)]
    pub local_steps: u32,
    /// Extension: seconds the workers spent waiting for pulls, summed over workers (stall time).
    #[serde(default)]
    pub pull_wait_seconds: f64,
    /// Extension: seconds the workers spent computing rounds, summed over workers.
    #[serde(default)]
    pub compute_seconds: f64,
    /// Extension: threads of each worker's compute pool (the largest, if they differ).
    #[serde(default)]
    pub compute_threads: u32,
    /// Extension: inner steps per round at the end of the run (the largest over workers; `local_steps` unless
    /// `train.local_steps_max` let the workers pick it from the measured link).
    #[serde(default)]
    pub local_steps_picked: u32,
    /// Extension: the largest round of pushes one worker sent, bytes on the wire over all shards (the largest burst
    /// on a worker's uplink).
    #[serde(default)]
    pub max_push_bytes: u64,
    /// Extension: the largest pull one worker received, bytes on the wire over all shards (the largest burst on a
    /// worker's downlink; the first pull, the whole model, included).
    #[serde(default)]
    pub max_pull_bytes: u64,
    /// Extension: streamed fragments (`train.fragments`; 1: the whole model each round).
    #[serde(default)]
    pub fragments: u32,
    /// Extension: CPU seconds the workers' compute threads used (forward, backward, inner optimizer, encoding,
    /// evaluation), summed over workers.
    #[serde(default)]
    pub compute_cpu_seconds: f64,
    /// Extension: CPU seconds of the whole process where one process ran the cluster (`LocalCluster`; 0 when the
    /// roles ran as separate processes): minus `compute_cpu_seconds`, what the shards and the transport used.
    #[serde(default)]
    pub process_cpu_seconds: f64,
    /// Extension: mean loss on the test/validation set over time: `[step, seconds, loss]` (nats per prediction).
    #[serde(default)]
    pub val_loss_curve: Vec<(u64, f64, f64)>,
    /// Extension: validation loss of the final model (nats per prediction).
    #[serde(default)]
    pub final_val_loss: Option<f64>,
    /// Extension: text models: the final validation loss in bits per character (byte), `final_val_loss / ln 2`.
    #[serde(default)]
    pub final_bits_per_char: Option<f64>,
    /// Extension: the workers' compute precision (`f32`, `bf16`, `f16`).
    #[serde(default)]
    pub precision: String,
    /// Extension: steps skipped because the loss-scaled gradient overflowed (each halved the scale), summed over
    /// workers.
    #[serde(default)]
    pub loss_scale_overflows: u64,
    /// Extension: times a worker's loss scale doubled after a clean window, summed over workers.
    #[serde(default)]
    pub loss_scale_growths: u64,
    /// Extension: the loss scale at the end (the smallest over workers).
    #[serde(default)]
    pub final_loss_scale: Option<f64>,
    /// Extension: free-form notes (e.g. "fashion-mnist not found, trained on digits").
    #[serde(default)]
    pub notes: Vec<String>,
    /// Extension: loss-spike rollbacks of the cluster (every shard rolls back together; the most any shard did).
    #[serde(default)]
    pub rollbacks: u64,
    /// Extension: rounds the rollbacks discarded (from the snapshot's round to the alarm's; the most of any shard).
    #[serde(default)]
    pub rounds_lost: u64,
    /// Extension: alarms with no snapshot to roll back to (summed over shards).
    #[serde(default)]
    pub rollbacks_missed: u64,
    /// Extension: every shard's rollbacks as `[shard, alarm round, round restored]`, so consistency can be checked.
    #[serde(default)]
    pub rollback_log: Vec<(u32, u64, u64)>,
}

impl RunReport {
    /// A report whose run-description fields (dataset, model, params, workers, shards, staleness bound,
    /// compression, epochs) come from `cfg`; the measured fields start empty.
    pub fn for_config(cfg: &crate::config::Config) -> RunReport {
        let dims: Vec<String> = crate::layout::model_dims(cfg)
            .unwrap_or_default()
            .iter()
            .map(|d| d.to_string())
            .collect();
        let model = if cfg.model.kind == crate::config::ModelKind::File {
            let file = cfg
                .model
                .file
                .as_deref()
                .unwrap_or(std::path::Path::new("?"));
            format!("file {}", file.display())
        } else if cfg.model.kind == crate::config::ModelKind::Gpt {
            let m = &cfg.model;
            format!(
                "gpt {}L {}H {}d ctx{} (bytes)",
                m.layers, m.heads, m.dim, m.context
            )
        } else {
            format!("{:?} {}", cfg.model.kind, dims.join("-")).to_lowercase()
        };
        RunReport {
            dataset: cfg.data.dataset.to_string(),
            model,
            precision: cfg.train.precision.to_string(),
            params: crate::layout::model_layout(cfg)
                .map(|l| l.len() as u64)
                .unwrap_or(0),
            workers: cfg.cluster.workers,
            shards: cfg.cluster.servers.len() as u32,
            staleness_bound: cfg.cluster.staleness.to_string(),
            compression: cfg.compression.scheme.to_string(),
            pull: if cfg.compression.delta_pulls() {
                format!("delta {}", cfg.compression.pull_scheme)
            } else if cfg.compression.pull_bf16 {
                "full bf16".into()
            } else {
                "full f32".into()
            },
            local_steps: cfg.train.local_steps,
            fragments: cfg.train.fragments,
            epochs: cfg.train.epochs,
            final_train_loss: f64::NAN,
            final_test_accuracy: f64::NAN,
            ..RunReport::default()
        }
    }

    /// Adds one worker's counters: sums, except the clock lead (the largest) and the loss scale (the smallest).
    pub fn add_worker(&mut self, w: &WorkerCounters) {
        self.steps += w.steps;
        self.add_traffic(&w.traffic);
        self.max_clock_lead_observed = self.max_clock_lead_observed.max(w.max_clock_lead);
        self.nonfinite_skipped += w.nonfinite_skipped;
        self.pushes_refused += w.pushes_refused;
        self.stale_replies_dropped += w.stale_replies_dropped;
        self.reconnects += w.reconnects;
        self.pull_wait_seconds += w.pull_wait_seconds;
        self.compute_seconds += w.compute_seconds;
        self.compute_threads = self.compute_threads.max(w.compute_threads);
        self.local_steps_picked = self.local_steps_picked.max(w.local_steps_picked);
        self.max_push_bytes = self.max_push_bytes.max(w.max_push_bytes);
        self.max_pull_bytes = self.max_pull_bytes.max(w.max_pull_bytes);
        self.compute_cpu_seconds += w.compute_cpu_seconds;
        if let Some(l) = w.loss_scale {
            self.loss_scale_overflows += l.overflows;
            self.loss_scale_growths += l.growths;
            self.final_loss_scale = Some(self.final_loss_scale.map_or(l.scale, |s| s.min(l.scale)));
        }
    }

    /// Adds one shard's counters: the updates are summed, the clock lead is the largest.
    pub fn add_shard(&mut self, s: &ShardCounters) {
        self.updates_applied += s.updates_applied;
        self.updates_rejected += s.updates_rejected;
        self.guard_refused += s.guard_refused;
        self.max_push_norm = self.max_push_norm.max(f64::from(s.max_push_norm));
        self.max_clock_lead_observed = self.max_clock_lead_observed.max(s.max_clock_lead);
    }

    /// Adds bytes moved (a worker's, or what a shard received and sent).
    pub fn add_traffic(&mut self, t: &Traffic) {
        self.wire_bytes_pushed += t.wire_bytes_pushed;
        self.fp32_bytes_pushed += t.fp32_bytes_pushed;
        self.wire_bytes_pulled += t.wire_bytes_pulled;
        self.fp32_bytes_pulled += t.fp32_bytes_pulled;
    }

    /// Sets the staleness of applied gradients: the largest seen and the histogram.
    pub fn set_staleness(&mut self, max: u64, histogram: Vec<HistogramBucket>) {
        self.max_staleness_observed = max;
        self.staleness_histogram = histogram;
    }

    /// Sets the shards' loss-spike rollbacks.
    pub fn set_rollbacks(&mut self, r: Rollbacks) {
        self.rollbacks = r.rollbacks;
        self.rounds_lost = r.rounds_lost;
        self.rollbacks_missed = r.missed;
        self.rollback_log = r.log;
    }

    /// Sets the curves, `[step, seconds, value]` each, and the final training loss from the loss curve
    /// ([`final_loss`]).
    pub fn set_curves(
        &mut self,
        loss: Vec<(u64, f64, f64)>,
        accuracy: Vec<(u64, f64, f64)>,
        val_loss: Vec<(u64, f64, f64)>,
    ) {
        self.final_train_loss = final_loss(&loss);
        self.loss_curve = loss;
        self.accuracy_curve = accuracy;
        self.val_loss_curve = val_loss;
    }

    /// Sets `final_val_loss` and, for text corpora, `final_bits_per_char` from the last point of `val_loss_curve`.
    pub fn finish_val_loss(&mut self, text: bool) {
        self.final_val_loss = self.val_loss_curve.last().map(|v| v.2);
        self.final_bits_per_char = self
            .final_val_loss
            .filter(|_| text)
            .map(|l| l / std::f64::consts::LN_2);
    }

    /// Wire bytes pushed as a fraction of fp32 (0 when nothing was pushed).
    pub fn push_ratio(&self) -> f64 {
        if self.fp32_bytes_pushed == 0 {
            0.0
        } else {
            self.wire_bytes_pushed as f64 / self.fp32_bytes_pushed as f64
        }
    }

    /// Bytes on the wire in both directions (pushes plus pulls).
    pub fn wire_bytes_total(&self) -> u64 {
        self.wire_bytes_pushed + self.wire_bytes_pulled
    }

    /// fp32 bytes of both directions (what the same pushes and pulls would weigh as raw f32).
    pub fn fp32_bytes_total(&self) -> u64 {
        self.fp32_bytes_pushed + self.fp32_bytes_pulled
    }

    /// Both directions: how many times fewer bytes than fp32 crossed the wire (0 when nothing moved).
    pub fn total_reduction(&self) -> f64 {
        if self.wire_bytes_total() == 0 {
            0.0
        } else {
            self.fp32_bytes_total() as f64 / self.wire_bytes_total() as f64
        }
    }

    /// Writes the report as pretty JSON to `path` (via a temporary file and rename).
    pub fn write_json(&self, path: &Path) -> std::io::Result<()> {
        let text = serde_json::to_string_pretty(self).map_err(std::io::Error::other)?;
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, text)?;
        std::fs::rename(tmp, path)
    }
}

/// Bytes moved in both directions, and what per-step f32 synchronization would have moved for the same steps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Encoded push bytes.
    pub wire_bytes_pushed: u64,
    /// The same pushes as raw f32.
    pub fp32_bytes_pushed: u64,
    /// Bytes of pull replies.
    pub wire_bytes_pulled: u64,
    /// The same pulls as raw f32.
    pub fp32_bytes_pulled: u64,
}

/// A mixed-precision worker's dynamic loss scaling.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossScale {
    /// Steps skipped because the scaled gradient overflowed.
    pub overflows: u64,
    /// Times the scale doubled after a clean window.
    pub growths: u64,
    /// The scale at the end.
    pub scale: f64,
}

/// What one worker measured, as a run report counts it ([`RunReport::add_worker`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct WorkerCounters {
    /// Push rounds completed.
    pub steps: u64,
    /// Bytes pushed and pulled.
    pub traffic: Traffic,
    /// Largest clock lead seen in a pull answer.
    pub max_clock_lead: u64,
    /// Gradients not pushed because they were not finite.
    pub nonfinite_skipped: u64,
    /// Pushes (or skip markers) refused by a shard or dropped by a rejoin.
    pub pushes_refused: u64,
    /// Pull replies dropped because they answered a superseded request.
    pub stale_replies_dropped: u64,
    /// Reconnections after a shard went away.
    pub reconnects: u64,
    /// Seconds waiting for pulls.
    pub pull_wait_seconds: f64,
    /// Seconds computing rounds.
    pub compute_seconds: f64,
    /// Threads of the worker's compute pool.
    pub compute_threads: u32,
    /// Inner steps per round the worker last ran or picked (local-step rounds).
    pub local_steps_picked: u32,
    /// Largest round of pushes in bytes (all shards).
    pub max_push_bytes: u64,
    /// Largest pull in bytes (all shards).
    pub max_pull_bytes: u64,
    /// CPU seconds of the worker's compute threads.
    pub compute_cpu_seconds: f64,
    /// Loss scaling, for a model computing below f32.
    pub loss_scale: Option<LossScale>,
}

/// What one shard counted, as a run report sums it ([`RunReport::add_shard`]); its traffic and staleness are added
/// separately, since a cluster's report counts the workers' traffic and merges the shards' histograms.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ShardCounters {
    /// Updates applied.
    pub updates_applied: u64,
    /// Updates rejected.
    pub updates_rejected: u64,
    /// Of those, updates the numerical guard refused (norm bound, norm spike, non-finite state).
    pub guard_refused: u64,
    /// Largest gradient norm the guard admitted.
    pub max_push_norm: f32,
    /// Largest clock lead seen when answering a pull.
    pub max_clock_lead: u64,
}

/// The shards' loss-spike rollbacks as a run report carries them ([`RunReport::set_rollbacks`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rollbacks {
    /// Rollbacks (the most any shard did: every shard rolls back together).
    pub rollbacks: u64,
    /// Rounds discarded (the most of any shard).
    pub rounds_lost: u64,
    /// Alarms with no snapshot to roll back to, summed over shards.
    pub missed: u64,
    /// `[shard, alarm round, round restored]` for every shard's rollbacks.
    pub log: Vec<(u32, u64, u64)>,
}

/// The final training loss of a loss curve: the mean over its last 20 points (NaN for an empty curve), so one
/// noisy mini-batch does not decide it.
pub fn final_loss(curve: &[(u64, f64, f64)]) -> f64 {
    let tail = &curve[curve.len().saturating_sub(20)..];
    if tail.is_empty() {
        f64::NAN
    } else {
        tail.iter().map(|p| p.2).sum::<f64>() / tail.len() as f64
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn final_loss_averages_the_tail() {
        assert!(super::final_loss(&[]).is_nan());
        let curve: Vec<(u64, f64, f64)> = (0..30)
            .map(|i| (i, i as f64, if i < 10 { 100.0 } else { 1.0 }))
            .collect();
        assert_eq!(super::final_loss(&curve), 1.0);
        assert_eq!(super::final_loss(&curve[..2]), 100.0);
    }

    use super::*;

    #[test]
    fn report_has_every_required_key() {
        let v = serde_json::to_value(RunReport::default()).unwrap();
        for key in [
            "dataset",
            "model",
            "params",
            "workers",
            "shards",
            "staleness_bound",
            "compression",
            "steps",
            "epochs",
            "wall_seconds",
            "final_train_loss",
            "final_test_accuracy",
            "wire_bytes_pushed",
            "fp32_bytes_pushed",
            "wire_bytes_pulled",
            "updates_applied",
            "updates_rejected",
            "max_clock_lead_observed",
            "max_staleness_observed",
            "staleness_histogram",
            "loss_curve",
            "accuracy_curve",
        ] {
            assert!(v.get(key).is_some(), "missing {key}");
        }
    }

    #[test]
    fn parts_merge_as_sums_with_the_extremes_where_they_belong() {
        let mut r = RunReport::default();
        let w = |steps, lead, scale| WorkerCounters {
            steps,
            traffic: Traffic {
                wire_bytes_pushed: 10,
                fp32_bytes_pushed: 80,
                wire_bytes_pulled: 20,
                fp32_bytes_pulled: 160,
            },
            max_clock_lead: lead,
            nonfinite_skipped: 1,
            pushes_refused: 2,
            stale_replies_dropped: 3,
            reconnects: 4,
            pull_wait_seconds: 0.5,
            compute_seconds: 1.5,
            compute_threads: steps as u32,
            local_steps_picked: 2 * steps as u32,
            max_push_bytes: 100 * steps,
            max_pull_bytes: 50 * steps,
            compute_cpu_seconds: 2.0,
            loss_scale: Some(LossScale {
                overflows: 1,
                growths: 2,
                scale,
            }),
        };
        r.add_worker(&w(5, 3, 1024.0));
        r.add_worker(&w(7, 2, 256.0));
        r.add_worker(&WorkerCounters::default());
        r.add_shard(&ShardCounters {
            updates_applied: 9,
            updates_rejected: 1,
            guard_refused: 1,
            max_push_norm: 2.5,
            max_clock_lead: 4,
        });
        r.add_shard(&ShardCounters {
            updates_applied: 3,
            updates_rejected: 0,
            guard_refused: 0,
            max_push_norm: 1.0,
            max_clock_lead: 1,
        });
        assert_eq!(r.steps, 12);
        assert_eq!(
            (
                r.wire_bytes_pushed,
                r.fp32_bytes_pushed,
                r.wire_bytes_pulled,
                r.fp32_bytes_pulled
            ),
            (20, 160, 40, 320)
        );
        assert_eq!(r.max_clock_lead_observed, 4);
        assert_eq!(
            (
                r.nonfinite_skipped,
                r.pushes_refused,
                r.stale_replies_dropped,
                r.reconnects
            ),
            (2, 4, 6, 8)
        );
        assert_eq!((r.pull_wait_seconds, r.compute_seconds), (1.0, 3.0));
        // Threads: the widest worker's pool; CPU seconds: summed.
        assert_eq!(r.compute_cpu_seconds, 4.0);
        assert_eq!(r.compute_threads, 7);
        // The largest H picked and the largest burst of any worker.
        assert_eq!((r.local_steps_picked, r.max_push_bytes), (14, 700));
        assert_eq!((r.loss_scale_overflows, r.loss_scale_growths), (2, 4));
        assert_eq!(r.final_loss_scale, Some(256.0));
        assert_eq!((r.updates_applied, r.updates_rejected), (12, 1));
        assert_eq!((r.guard_refused, r.max_push_norm), (1, 2.5));
        r.set_curves(vec![(1, 0.1, 2.0), (2, 0.2, 4.0)], vec![], vec![]);
        assert_eq!(r.final_train_loss, 3.0);
        assert_eq!(r.loss_curve.len(), 2);
    }
}

//! What a worker tells the world: a [`Progress`] event after every step, the [`WorkerReport`] at the end, and that
//! report's share of a run report ([`WorkerReport::run_report`]). Plain data filled in by the training loop.

use tether_common::config::Config;
use tether_common::report::{LossScale, RunReport, Traffic, WorkerCounters};

use crate::model::PrecisionStats;

/// Progress published after every step.
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    /// Worker rank.
    pub rank: u32,
    /// Steps completed by this worker (inner steps: a local-step round advances it by all of its inner steps).
    pub step: u64,
    /// Steps this worker will run (in the same unit as `step`).
    pub total: u64,
    /// Loss of the step.
    pub loss: f32,
    /// Encoded bytes pushed in this step.
    pub wire_bytes: u64,
    /// fp32 bytes the push represents.
    pub fp32_bytes: u64,
    /// Test accuracy, when this step evaluated.
    pub accuracy: Option<f32>,
}

/// What a worker reports at the end.
#[derive(Debug, Clone, Default)]
pub struct WorkerReport {
    /// Rank.
    pub rank: u32,
    /// Steps (push rounds) completed.
    pub steps: u64,
    /// `(step, seconds, loss)` for every step.
    pub loss_curve: Vec<(u64, f64, f64)>,
    /// `(step, seconds, accuracy)` for every evaluation.
    pub accuracy_curve: Vec<(u64, f64, f64)>,
    /// `(step, seconds, mean loss on the test/validation set)` for every evaluation.
    pub val_loss_curve: Vec<(u64, f64, f64)>,
    /// Mixed-precision statistics of the model (bf16/f16 candle models).
    pub precision: Option<PrecisionStats>,
    /// Encoded push bytes.
    pub wire_bytes_pushed: u64,
    /// What per-step f32 synchronization would have pushed for the same steps.
    pub fp32_bytes_pushed: u64,
    /// Bytes of pull replies received.
    pub wire_bytes_pulled: u64,
    /// What per-step f32 synchronization would have pulled for the same steps.
    pub fp32_bytes_pulled: u64,
    /// Largest clock lead seen in a pull answer.
    pub max_clock_lead: u64,
    /// Gradients refused because they were not finite.
    pub nonfinite_skipped: u64,
    /// Reconnections after a shard went away.
    pub reconnects: u64,
    /// Pushes (or skip markers) a shard refused or a rejoin dropped (the residual policy applied to them).
    pub pushes_refused: u64,
    /// Pull replies dropped because they answered a superseded request.
    pub stale_replies_dropped: u64,
    /// Shard rollbacks this worker saw (one per shard per loss-spike rollback).
    pub rollbacks_seen: u64,
    /// Wall time.
    pub wall_seconds: f64,
    /// Time spent waiting for pulls (the SSP gate, the network and the replies' decoding).
    pub pull_wait_seconds: f64,
    /// Time spent computing rounds (straggler waits included).
    pub compute_seconds: f64,
    /// Threads of this worker's compute pool.
    pub compute_threads: u32,
    /// Largest round of pushes, bytes on the wire over all shards (the largest burst on the worker's uplink).
    pub max_push_bytes: u64,
    /// Largest pull, bytes on the wire over all shards (the largest burst on the worker's downlink).
    pub max_pull_bytes: u64,
    /// Inner steps of the next round as the link-aware policy last picked them (local-step rounds; else 0).
    pub local_steps_picked: u32,
    /// Why (`tether_worker::local_steps`), when `train.local_steps_max` lets the worker choose; else empty.
    pub local_steps_reason: String,
    /// CPU seconds this worker's compute threads used (steps, rounds, evaluations).
    pub compute_cpu_seconds: f64,
    /// Each pull's wait, µs (request to a complete answer from every shard; the first `driver::LATENCY_SAMPLES`).
    pub pull_latency_us: Vec<u32>,
    /// Each settled push's round trip, µs (sent to its outcome; the first `driver::LATENCY_SAMPLES`).
    pub push_latency_us: Vec<u32>,
    /// The last parameters pulled.
    pub final_params: Vec<f32>,
    /// Per shard, the public copy the worker held at the end (delta pulls).
    pub final_public: Vec<Option<tether_common::protocol::PublicRef>>,
}

impl WorkerReport {
    /// Records one evaluation of the model at `step`, `secs` into the run.
    pub fn record_eval(&mut self, step: u64, secs: f64, accuracy: f32, loss: f32) {
        self.accuracy_curve.push((step, secs, f64::from(accuracy)));
        self.val_loss_curve.push((step, secs, f64::from(loss)));
    }

    /// The counters a run report sums over workers.
    pub fn counters(&self) -> WorkerCounters {
        WorkerCounters {
            steps: self.steps,
            traffic: Traffic {
                wire_bytes_pushed: self.wire_bytes_pushed,
                fp32_bytes_pushed: self.fp32_bytes_pushed,
                wire_bytes_pulled: self.wire_bytes_pulled,
                fp32_bytes_pulled: self.fp32_bytes_pulled,
            },
            max_clock_lead: self.max_clock_lead,
            nonfinite_skipped: self.nonfinite_skipped,
            pushes_refused: self.pushes_refused,
            stale_replies_dropped: self.stale_replies_dropped,
            reconnects: self.reconnects,
            pull_wait_seconds: self.pull_wait_seconds,
            compute_seconds: self.compute_seconds,
            compute_threads: self.compute_threads,
            local_steps_picked: self.local_steps_picked,
            max_push_bytes: self.max_push_bytes,
            max_pull_bytes: self.max_pull_bytes,
            compute_cpu_seconds: self.compute_cpu_seconds,
            loss_scale: self.precision.map(|p| LossScale {
                overflows: p.overflows,
                growths: p.growths,
                scale: f64::from(p.loss_scale),
            }),
        }
    }

    /// A run report holding this worker's view (shard-side counters are in the servers' reports).
    pub fn run_report(&self, cfg: &Config) -> RunReport {
        let mut report = RunReport::for_config(cfg);
        report.add_worker(&self.counters());
        report.wall_seconds = self.wall_seconds;
        report.final_test_accuracy = self.accuracy_curve.last().map_or(f64::NAN, |a| a.2);
        report.set_curves(
            self.loss_curve.clone(),
            self.accuracy_curve.clone(),
            self.val_loss_curve.clone(),
        );
        report.finish_val_loss(cfg.data.dataset.is_text());
        report
    }
}

//! The worker: a `WorkerActor` (actix, on its own Arbiter) that owns the model, the data partition, the error
//! feedback residuals and the encoders, and a driver task that talks to every shard over mutual-TLS QUIC — pull
//! (SSP-gated by the shards) → compute (actor) → push one uni stream per shard. The push of step t is written by
//! spawned tasks while the pull and compute of step t+1 proceed, so with s ≥ 1 communication overlaps compute. When
//! a shard goes away the driver reconnects with exponential backoff, re-announces its clock and redoes the step.

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use tokio::sync::mpsc;
use tracing::{info, warn};

use tether_common::codec::CodecError;
use tether_common::config::Config;
use tether_common::metrics::WorkerMetrics;
use tether_common::net::{client_endpoint, NetError, TlsFiles, TransportTuning};
use tether_common::protocol::{ErrorCode, FrameLimits, Outcome, Precision, PullMode};

use crate::data::{Dataset, Partition};
use crate::driver::{Driver, DriverConfig};
use crate::model::{self, Model};
use crate::step::{GradientFault, StepEngine, StepOutcome};

/// Errors that end a worker.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// Configuration problem.
    #[error(transparent)]
    Config(#[from] tether_common::config::ConfigError),
    /// Codec setup or encode failure.
    #[error(transparent)]
    Codec(#[from] CodecError),
    /// A shard stayed unreachable past the reconnect deadline, or refused us.
    #[error("shard {shard}: {source}")]
    Net {
        /// The shard.
        shard: usize,
        /// The cause.
        source: NetError,
    },
    /// A shard answered with something inconsistent with the layout.
    #[error("shard {shard}: {reason}")]
    Protocol {
        /// The shard.
        shard: usize,
        /// What was wrong.
        reason: String,
    },
    /// The data set does not fit the model.
    #[error("data: {0}")]
    Data(String),
    /// The worker actor stopped.
    #[error("worker actor is gone")]
    ActorGone,
}

/// Progress published after every step.
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    /// Worker rank.
    pub rank: u32,
    /// Steps completed by this worker.
    pub step: u64,
    /// Steps this worker will run.
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
    pub precision: Option<model::PrecisionStats>,
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
    /// Each pull's wait, µs (request to a complete answer from every shard; the first `driver::LATENCY_SAMPLES`).
    pub pull_latency_us: Vec<u32>,
    /// Each settled push's round trip, µs (sent to its outcome; the first `driver::LATENCY_SAMPLES`).
    pub push_latency_us: Vec<u32>,
    /// The last parameters pulled.
    pub final_params: Vec<f32>,
    /// Per shard, the public copy the worker held at the end (delta pulls).
    pub final_public: Vec<Option<tether_common::protocol::PublicRef>>,
}

/// Everything a worker needs to run.
#[derive(Clone)]
pub struct WorkerOptions {
    /// Rank (0-based).
    pub rank: u32,
    /// Cluster configuration.
    pub config: Config,
    /// Shard addresses (`host:port`), index = shard; resolved again at every (re)connect, so a restarted server
    /// may come back at another address under the same name.
    pub servers: Vec<String>,
    /// TLS server name per shard (a SAN of its certificate).
    pub server_names: Vec<String>,
    /// This worker's certificate and the cluster CA.
    pub tls: TlsFiles,
    /// Training set (the worker uses its partition).
    pub train: Arc<Dataset>,
    /// Test set; when set, this worker evaluates every `train.eval_every` steps.
    pub test: Option<Arc<Dataset>>,
    /// Progress events.
    pub progress: Option<mpsc::UnboundedSender<Progress>>,
    /// Injected gradient faults.
    pub faults: Vec<GradientFault>,
    /// Metrics to record into.
    pub metrics: Option<WorkerMetrics>,
    /// Give up when a shard stays unreachable this long.
    pub reconnect_deadline: Duration,
    /// Sleep this long after each compute (simulates a straggler).
    pub step_delay: Duration,
    /// Transient or persistent stragglers: some steps take `factor` × their compute time.
    pub straggle: Option<Straggle>,
    /// A user model to train instead of the one `[model]` describes (the shards must use its layout).
    pub model: Option<ModelFactory>,
}

/// Straggler emulation: with `probability`, a round is stretched to `factor` × its compute time (the worker waits
/// the difference, keeping the protocol alive). `probability = 1` is a persistently slow worker.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Straggle {
    /// Chance that a round is slow, in [0, 1].
    pub probability: f64,
    /// How much slower a slow round is (≥ 1).
    pub factor: f64,
}

impl Straggle {
    /// Parses `P:F` (e.g. `0.1:3`, `1:2`).
    pub fn parse(s: &str) -> Option<Straggle> {
        let (p, f) = s.split_once(':')?;
        let (probability, factor) = (p.trim().parse::<f64>().ok()?, f.trim().parse::<f64>().ok()?);
        ((0.0..=1.0).contains(&probability) && factor.is_finite() && factor >= 1.0).then_some(
            Straggle {
                probability,
                factor,
            },
        )
    }

    /// The extra wait after a round of `compute` at `round` for `rank` (deterministic per rank and round).
    pub fn extra(&self, rank: u32, round: u64, compute: Duration) -> Duration {
        let z = tether_common::layout::splitmix64(u64::from(rank) << 40 ^ round);
        let u = (z >> 11) as f64 / (1u64 << 53) as f64;
        if u < self.probability {
            compute.mul_f64(self.factor - 1.0)
        } else {
            Duration::ZERO
        }
    }
}

/// Builds a fresh instance of a user's model (one per worker, plus one for evaluation).
pub type ModelFactory = Arc<dyn Fn() -> Box<dyn Model> + Send + Sync>;

struct Compute {
    step: u64,
    params: Vec<f32>,
    frames: Vec<Vec<u8>>,
}

struct Computed {
    outcome: StepOutcome,
    params: Vec<f32>,
    frames: Vec<Vec<u8>>,
}

impl Message for Compute {
    type Result = Result<Computed, CodecError>;
}

/// A local-step round: `steps` inner steps from `params` (θ_start, returned unchanged), then the pseudo-gradient
/// θ_start − θ_end encoded into `frames`.
struct LocalRound {
    first_step: u64,
    steps: u64,
    params: Vec<f32>,
    frames: Vec<Vec<u8>>,
}

impl Message for LocalRound {
    type Result = Result<Computed, CodecError>;
}

struct Evaluate {
    params: Vec<f32>,
}

/// Shards that rolled back after a loss spike: the engine resets what it built on their old trajectory.
#[derive(Message)]
#[rtype(result = "()")]
struct RolledBack {
    shards: Vec<usize>,
}

impl Handler<RolledBack> for WorkerActor {
    type Result = ();
    fn handle(&mut self, msg: RolledBack, _: &mut Context<Self>) {
        self.engine.reset_trajectory(&msg.shards);
    }
}

/// A push shard `shard` did not apply although its gradient was good: the residual policy credits it back.
struct Credit {
    shard: usize,
    frame: bytes::Bytes,
}

impl Message for Credit {
    type Result = ();
}

impl Handler<Credit> for WorkerActor {
    type Result = ();
    fn handle(&mut self, msg: Credit, _: &mut Context<Self>) {
        // The frame was built by this worker, so it validates; a failure here is logged, never fatal.
        let payload =
            tether_common::protocol::access_push(&msg.frame).map(|f| f.payload().to_vec());
        match payload {
            Ok(p) if !p.is_empty() => {
                if let Err(e) = self.engine.credit_undelivered(msg.shard, &p) {
                    warn!(shard = msg.shard, error = %e, "cannot credit an undelivered push");
                }
            }
            Ok(_) => {}
            Err(e) => warn!(shard = msg.shard, error = %e, "cannot read an undelivered push"),
        }
    }
}

impl Message for Evaluate {
    type Result = Evaluated;
}

/// What an evaluation measured, and the parameter buffer back.
struct Evaluated {
    accuracy: f32,
    loss: f32,
    params: Vec<f32>,
}

/// The model's mixed-precision statistics.
struct PrecisionQuery;

impl Message for PrecisionQuery {
    type Result = Option<model::PrecisionStats>;
}

impl Handler<PrecisionQuery> for WorkerActor {
    type Result = Option<model::PrecisionStats>;
    fn handle(&mut self, _: PrecisionQuery, _: &mut Context<Self>) -> Self::Result {
        self.engine.model_mut().precision_stats()
    }
}

/// The compute side of a worker, on its own Arbiter: model, data partition, error feedback, encoders.
pub struct WorkerActor {
    engine: StepEngine,
    train: Arc<Dataset>,
    test: Option<Arc<Dataset>>,
    order: Vec<usize>,
    partition: Partition,
    batch: usize,
    steps_per_epoch: u64,
    xb: Vec<f32>,
    yb: Vec<u32>,
    /// θ of the local-step round in progress.
    theta: Vec<f32>,
}

impl Actor for WorkerActor {
    type Context = Context<Self>;
}

impl WorkerActor {
    fn load_batch(&mut self, step: u64) {
        let epoch = step / self.steps_per_epoch;
        let within = (step % self.steps_per_epoch) as usize;
        if within == 0 || self.order.is_empty() {
            self.order = self.partition.epoch_order(epoch);
        }
        let f = self.train.features;
        let idx = &self.order[within * self.batch..(within + 1) * self.batch];
        for (row, &i) in idx.iter().enumerate() {
            self.xb[row * f..(row + 1) * f].copy_from_slice(&self.train.x[i * f..(i + 1) * f]);
            self.yb[row] = self.train.y[i];
        }
    }
}

impl Handler<Compute> for WorkerActor {
    type Result = Result<Computed, CodecError>;
    fn handle(&mut self, mut msg: Compute, _: &mut Context<Self>) -> Self::Result {
        self.load_batch(msg.step);
        let outcome = self
            .engine
            .compute(msg.step, &msg.params, &self.xb, &self.yb);
        if outcome.finite {
            self.engine.fault_push(msg.step..msg.step + 1);
            for (k, out) in msg.frames.iter_mut().enumerate() {
                self.engine.encode_shard(k, msg.step, out)?;
            }
        }
        Ok(Computed {
            outcome,
            params: msg.params,
            frames: msg.frames,
        })
    }
}

impl Handler<LocalRound> for WorkerActor {
    type Result = Result<Computed, CodecError>;
    fn handle(&mut self, mut msg: LocalRound, _: &mut Context<Self>) -> Self::Result {
        self.theta.resize(msg.params.len(), 0.0);
        self.theta.copy_from_slice(&msg.params);
        let (mut loss, mut good) = (0.0f64, 0u64);
        for step in msg.first_step..msg.first_step + msg.steps {
            self.load_batch(step);
            let o = self.engine.compute(step, &self.theta, &self.xb, &self.yb);
            // A non-finite inner gradient is dropped: that inner step does not happen.
            if o.finite {
                self.engine.inner_step(&mut self.theta);
                loss += f64::from(o.loss);
                good += 1;
            }
        }
        let finite = good > 0 && self.engine.set_pseudo_gradient(&msg.params, &self.theta);
        if finite {
            self.engine
                .fault_push(msg.first_step..msg.first_step + msg.steps);
            for (k, out) in msg.frames.iter_mut().enumerate() {
                self.engine.encode_shard(k, msg.first_step, out)?;
            }
        }
        Ok(Computed {
            outcome: StepOutcome {
                loss: if good > 0 {
                    (loss / good as f64) as f32
                } else {
                    f32::NAN
                },
                grad_norm: 0.0,
                finite,
            },
            params: msg.params,
            frames: msg.frames,
        })
    }
}

impl Handler<Evaluate> for WorkerActor {
    type Result = MessageResult<Evaluate>;
    fn handle(&mut self, msg: Evaluate, _: &mut Context<Self>) -> Self::Result {
        let (accuracy, loss) = match &self.test {
            Some(t) => {
                // Chunks of 256 rows bound the activations (a GPT's are rows × context × vocabulary wide).
                let chunk = 256;
                let m = self.engine.model_mut();
                (
                    model::accuracy(m, &msg.params, &t.x, &t.y, chunk),
                    model::mean_loss(m, &msg.params, &t.x, &t.y, chunk),
                )
            }
            None => (f32::NAN, f32::NAN),
        };
        MessageResult(Evaluated {
            accuracy,
            loss,
            params: msg.params,
        })
    }
}

/// A worker whose actor is started and whose endpoint is bound, ready to [`PreparedWorker::run`].
pub struct PreparedWorker {
    driver: Driver,
    opts: WorkerOptions,
    report: WorkerReport,
    actor: Addr<WorkerActor>,
    arbiter: Arbiter,
    total_steps: u64,
    n_params: usize,
}

/// Builds the model, partitions the data and starts the worker actor on its own Arbiter. Call it on a thread that
/// runs an actix `System` (Arbiters need one); the returned worker's `run` future may then be spawned anywhere.
pub fn prepare_worker(opts: WorkerOptions) -> Result<PreparedWorker, WorkerError> {
    let cfg = &opts.config;
    let model: Box<dyn Model> = match &opts.model {
        Some(factory) => factory(),
        None => model::build_for(cfg).map_err(|e| WorkerError::Data(format!("model: {e}")))?,
    };
    let (features, classes) = (model.features(), model.classes());
    if opts.train.features != features || opts.train.classes > classes {
        return Err(WorkerError::Data(format!(
            "dataset has {} features / {} classes, model expects {features} / {classes}",
            opts.train.features, opts.train.classes
        )));
    }
    let layout = model.layout().clone();
    let shards = opts.servers.len();
    let ranges: Vec<(u64, u64)> = (0..shards)
        .map(|k| {
            let r = layout.shard_range(k, shards);
            (r.start as u64, r.end as u64)
        })
        .collect();
    let engine = StepEngine::new(
        model,
        opts.rank,
        ranges.iter().map(|r| r.0 as usize..r.1 as usize).collect(),
        cfg.compression.codec(),
        cfg.compression.error_feedback,
        cfg.train.clip_norm,
    )?
    .with_faults(opts.faults.clone());
    let partition = Partition::new(
        opts.train.len(),
        opts.rank,
        cfg.cluster.workers,
        cfg.train.seed,
    )
    .map_err(|e| WorkerError::Data(e.to_string()))?;
    let batch = cfg.train.batch.min(partition.len().max(1));
    let steps_per_epoch = (partition.len() / batch).max(1) as u64;
    let total_steps = cfg.worker_steps(steps_per_epoch);
    let engine = if cfg.train.local_steps > 0 {
        engine.with_inner(&inner_optimizer(cfg, total_steps))
    } else {
        engine
    };
    let actor = WorkerActor {
        engine,
        train: opts.train.clone(),
        test: opts.test.clone(),
        order: Vec::new(),
        partition,
        batch,
        steps_per_epoch,
        xb: vec![0.0; batch * features],
        yb: vec![0; batch],
        theta: Vec::new(),
    };
    let arbiter = Arbiter::new();
    let addr = WorkerActor::start_in_arbiter(&arbiter.handle(), move |_| actor);
    let endpoint =
        client_endpoint(&opts.tls, &TransportTuning::default()).map_err(|e| WorkerError::Net {
            shard: 0,
            source: e,
        })?;
    let limits = ranges
        .iter()
        .map(|r| FrameLimits::for_codec(&cfg.compression.codec(), (r.1 - r.0) as usize))
        .collect();
    let driver = Driver::new(DriverConfig {
        rank: opts.rank,
        endpoint,
        servers: opts.servers.clone(),
        server_names: opts.server_names.clone(),
        ranges,
        limits,
        layout_hash: layout.hash(),
        staleness: cfg.cluster.staleness,
        mode: if cfg.compression.delta_pulls() {
            PullMode::Delta { have: None }
        } else if cfg.compression.pull_bf16 {
            PullMode::Full(Precision::Bf16)
        } else {
            PullMode::Full(Precision::F32)
        },
        // At least three heartbeats per eviction timeout, whatever `heartbeat_ms` says, so that one late heartbeat
        // is never silence.
        heartbeat: Duration::from_millis(
            cfg.cluster
                .heartbeat_ms
                .min(cfg.cluster.worker_timeout_ms / 3)
                .max(10),
        ),
        reconnect_deadline: opts.reconnect_deadline,
    });
    let report = WorkerReport {
        rank: opts.rank,
        ..WorkerReport::default()
    };
    Ok(PreparedWorker {
        driver,
        opts,
        report,
        actor: addr,
        arbiter,
        total_steps,
        n_params: layout.len(),
    })
}

impl PreparedWorker {
    /// Steps this worker will run.
    pub fn total_steps(&self) -> u64 {
        self.total_steps
    }

    /// Trains to completion, says goodbye to every shard and returns the report.
    pub async fn run(mut self) -> Result<WorkerReport, WorkerError> {
        let result = train_loop(
            &mut self.driver,
            &self.opts,
            &mut self.report,
            &self.actor,
            self.total_steps,
            self.n_params,
        )
        .await;
        if result.is_ok() {
            // Goodbye only once every push has its outcome: then nothing of ours is still in flight.
            let limit = self.opts.reconnect_deadline;
            match self.driver.settle(limit).await {
                Ok(true) => {}
                Ok(false) => warn!(rank = self.opts.rank, "pushes still unsettled at goodbye"),
                Err(e) => warn!(rank = self.opts.rank, error = %e, "settling failed"),
            }
            credit_refused(&mut self.driver, &self.actor);
        }
        self.arbiter.stop();
        result?;
        self.driver.goodbye().await;
        let stats = self.driver.session.stats();
        self.report.pushes_refused = stats.pushes_refused;
        self.report.stale_replies_dropped = stats.stale_replies;
        self.report.rollbacks_seen = stats.rollbacks_seen;
        self.report.max_clock_lead = stats.max_clock_lead;
        self.report.reconnects = self.driver.reconnects;
        self.report.final_public = (0..self.driver.session.shards())
            .map(|k| self.driver.session.public(k))
            .collect();
        self.report.wire_bytes_pulled = self.driver.bytes_pulled;
        self.report.push_latency_us = std::mem::take(&mut self.driver.push_latency_us);
        // (fp32_bytes_pulled is counted per step by the training loop: the per-step f32 reference.)
        Ok(self.report)
    }
}

/// The inner optimizer of local-step rounds: `[optimizer]`, with a warmup-cosine schedule stretched over this
/// worker's own inner steps (the schedule's `total` counts shard updates in per-step mode).
fn inner_optimizer(cfg: &Config, total_steps: u64) -> tether_common::config::OptimizerConfig {
    let mut inner = cfg.optimizer.clone();
    if let tether_common::config::Schedule::WarmupCosine { total, .. } = &mut inner.schedule {
        *total = total_steps;
    }
    inner
}

/// Applies the residual policy to the pushes the shards refused since the last call: good gradients that were not
/// applied are credited back into the residual; those refused for their values are dropped.
fn credit_refused(d: &mut Driver, addr: &Addr<WorkerActor>) {
    for r in d.refused.drain(..) {
        // Refused for its values, or computed on parameters a rollback discarded: not credited.
        if !matches!(
            r.outcome,
            Outcome::Refused(ErrorCode::NonFinite | ErrorCode::RolledBack)
        ) {
            addr.do_send(Credit {
                shard: r.shard,
                frame: r.frame,
            });
        }
    }
}

/// Evaluates `params` on the actor (the protocol keeps running meanwhile); returns the accuracy and the buffer.
async fn evaluate(
    d: &mut Driver,
    addr: &Addr<WorkerActor>,
    params: Vec<f32>,
) -> Result<Evaluated, WorkerError> {
    d.while_running(addr.send(Evaluate { params }))
        .await?
        .map_err(|_| WorkerError::ActorGone)
}

async fn train_loop(
    d: &mut Driver,
    opts: &WorkerOptions,
    report: &mut WorkerReport,
    addr: &Addr<WorkerActor>,
    total_steps: u64,
    n_params: usize,
) -> Result<(), WorkerError> {
    let started = Instant::now();
    let rank = opts.rank;
    let eval_every = opts.config.train.eval_every;
    let shards = d.session.shards();
    let mut params = vec![0.0f32; n_params];
    let mut frames: Vec<Vec<u8>> = vec![Vec::new(); shards];
    let mut step = 0u64;
    let mut last_log = Instant::now();
    let local = u64::from(opts.config.train.local_steps);
    while step < total_steps {
        let t0 = Instant::now();
        d.pull(&mut params).await?;
        if !d.rolled_back.is_empty() {
            // Delivered before the compute below (one mailbox, in order).
            addr.do_send(RolledBack {
                shards: std::mem::take(&mut d.rolled_back),
            });
        }
        let pulled = Instant::now();
        let wait = pulled - t0;
        report.pull_wait_seconds += wait.as_secs_f64();
        if report.pull_latency_us.len() < crate::driver::LATENCY_SAMPLES {
            report
                .pull_latency_us
                .push(wait.as_micros().min(u128::from(u32::MAX)) as u32);
        }
        // One push round: one step, or in local-step rounds up to `local` inner steps.
        let n = if local > 0 {
            local.min(total_steps - step)
        } else {
            1
        };
        let computed = if local > 0 {
            d.while_running(addr.send(LocalRound {
                first_step: step,
                steps: n,
                params,
                frames,
            }))
            .await?
        } else {
            d.while_running(addr.send(Compute {
                step,
                params,
                frames,
            }))
            .await?
        }
        .map_err(|_| WorkerError::ActorGone)??;
        params = computed.params;
        frames = computed.frames;
        let outcome = computed.outcome;
        if let Some(s) = opts.straggle {
            let extra = s.extra(rank, step, pulled.elapsed());
            if !extra.is_zero() {
                d.while_running(tokio::time::sleep(extra)).await?;
            }
        }
        if !opts.step_delay.is_zero() {
            d.while_running(tokio::time::sleep(opts.step_delay)).await?;
        }
        report.compute_seconds += pulled.elapsed().as_secs_f64();
        let wire: u64 = frames.iter().map(|f| f.len() as u64).sum();
        // The fp32 reference is per-step synchronization: every step pushes and pulls the whole model in f32.
        let fp32: u64 = 4 * n_params as u64 * n;
        report.fp32_bytes_pulled += fp32;
        if outcome.finite {
            d.session
                .push(&mut frames, outcome.loss)
                .map_err(|e| WorkerError::Protocol {
                    shard: 0,
                    reason: e.to_string(),
                })?;
            report.wire_bytes_pushed += wire;
            report.fp32_bytes_pushed += fp32;
        } else {
            warn!(rank, step, "non-finite gradient: not pushed (skip marker)");
            report.nonfinite_skipped += 1;
            if let Some(m) = &opts.metrics {
                m.nonfinite.inc();
            }
            d.session
                .skip(outcome.loss)
                .map_err(|e| WorkerError::Protocol {
                    shard: 0,
                    reason: e.to_string(),
                })?;
        }
        credit_refused(d, addr);
        step += n;
        let secs = started.elapsed().as_secs_f64();
        if outcome.finite {
            report
                .loss_curve
                .push((step, secs, f64::from(outcome.loss)));
        }
        let mut accuracy = None;
        if opts.test.is_some()
            && eval_every > 0
            && step / eval_every > (step - n) / eval_every
            && step < total_steps
        {
            let e = evaluate(d, addr, params).await?;
            params = e.params;
            let secs = started.elapsed().as_secs_f64();
            report
                .accuracy_curve
                .push((step, secs, f64::from(e.accuracy)));
            report.val_loss_curve.push((step, secs, f64::from(e.loss)));
            accuracy = Some(e.accuracy);
        }
        let (wire, fp32) = if outcome.finite { (wire, fp32) } else { (0, 0) };
        if let Some(m) = &opts.metrics {
            m.step_seconds.observe(t0.elapsed().as_secs_f64());
            m.loss.set(f64::from(outcome.loss));
            m.steps.inc();
            m.bytes_pushed
                .get_or_create(&vec![("kind", "wire")])
                .inc_by(wire);
            m.bytes_pushed
                .get_or_create(&vec![("kind", "fp32")])
                .inc_by(fp32);
        }
        if let Some(tx) = &opts.progress {
            let _ = tx.send(Progress {
                rank,
                step,
                total: total_steps,
                loss: outcome.loss,
                wire_bytes: wire,
                fp32_bytes: fp32,
                accuracy,
            });
        } else if last_log.elapsed() > Duration::from_secs(5) || step == total_steps {
            last_log = Instant::now();
            info!(
                rank,
                step,
                total_steps,
                loss = outcome.loss,
                ?accuracy,
                clock = d.session.clock(),
                "progress"
            );
        }
    }
    if opts.test.is_some() {
        // The final model: one more pull (it waits, as any pull, until the others are within the bound).
        d.pull(&mut params).await?;
        report.fp32_bytes_pulled += 4 * n_params as u64;
        let e = evaluate(d, addr, params).await?;
        params = e.params;
        let secs = started.elapsed().as_secs_f64();
        report
            .accuracy_curve
            .push((step, secs, f64::from(e.accuracy)));
        report.val_loss_curve.push((step, secs, f64::from(e.loss)));
        info!(
            rank,
            step,
            accuracy = e.accuracy,
            val_loss = e.loss,
            "final evaluation"
        );
    }
    report.precision = d
        .while_running(addr.send(PrecisionQuery))
        .await?
        .map_err(|_| WorkerError::ActorGone)?;
    report.steps = step;
    report.wall_seconds = started.elapsed().as_secs_f64();
    report.final_params = params;
    Ok(())
}

/// Loads the configured training and test sets. When the configured Fashion-MNIST directory is missing, falls back
/// to the embedded digits set, switches `cfg.data.dataset` accordingly (the model's input width changes with it)
/// and returns a note saying so.
pub fn load_data(
    cfg: &mut Config,
) -> Result<(Dataset, Dataset, Option<String>), crate::data::DataError> {
    if cfg.data.dataset.is_text() {
        return match crate::data::load_text(&cfg.data, cfg.model.context) {
            Ok((train, val, _)) => Ok((train, val, None)),
            Err(crate::data::DataError::NotFound { path, .. })
                if cfg.data.dataset == tether_common::config::DatasetKind::Kjv =>
            {
                let note = format!(
                    "the KJV is not installed ({} missing; apt-get install bible-kjv bible-kjv-text); training on \
                     the embedded excerpt (Genesis–Deuteronomy, 0.8 MB) instead",
                    path.display()
                );
                cfg.data.dataset = tether_common::config::DatasetKind::KjvExcerpt;
                let (train, val, _) = crate::data::load_text(&cfg.data, cfg.model.context)?;
                Ok((train, val, Some(note)))
            }
            Err(e) => Err(e),
        };
    }
    match crate::data::load(&cfg.data) {
        Ok((train, test, _)) => Ok((train, test, None)),
        Err(crate::data::DataError::NotFound { .. })
            if cfg.data.dataset == tether_common::config::DatasetKind::FashionMnist =>
        {
            let note = format!(
                "Fashion-MNIST not found at {} (apt-get install dataset-fashion-mnist); training on the embedded \
                 scikit-learn digits set (1,797 samples) instead",
                cfg.data.path.display()
            );
            cfg.data.dataset = tether_common::config::DatasetKind::Digits;
            cfg.model.features = None;
            let (train, test) = crate::data::digits()?;
            Ok((train, test, Some(note)))
        }
        Err(e) => Err(e),
    }
}

/// A run report holding one worker's view (shard-side counters are in the servers' reports).
pub fn worker_run_report(cfg: &Config, r: &WorkerReport) -> tether_common::report::RunReport {
    let final_train_loss = tether_common::report::final_loss(&r.loss_curve);
    let mut report = tether_common::report::RunReport {
        steps: r.steps,
        wall_seconds: r.wall_seconds,
        final_train_loss,
        final_test_accuracy: r.accuracy_curve.last().map_or(f64::NAN, |a| a.2),
        wire_bytes_pushed: r.wire_bytes_pushed,
        fp32_bytes_pushed: r.fp32_bytes_pushed,
        wire_bytes_pulled: r.wire_bytes_pulled,
        fp32_bytes_pulled: r.fp32_bytes_pulled,
        max_clock_lead_observed: r.max_clock_lead,
        loss_curve: r.loss_curve.clone(),
        accuracy_curve: r.accuracy_curve.clone(),
        val_loss_curve: r.val_loss_curve.clone(),
        loss_scale_overflows: r.precision.map_or(0, |p| p.overflows),
        loss_scale_growths: r.precision.map_or(0, |p| p.growths),
        final_loss_scale: r.precision.map(|p| f64::from(p.loss_scale)),
        nonfinite_skipped: r.nonfinite_skipped,
        pushes_refused: r.pushes_refused,
        stale_replies_dropped: r.stale_replies_dropped,
        reconnects: r.reconnects,
        pull_wait_seconds: r.pull_wait_seconds,
        compute_seconds: r.compute_seconds,
        ..tether_common::report::RunReport::for_config(cfg)
    };
    report.finish_val_loss(cfg.data.dataset.is_text());
    report
}

#[cfg(test)]
mod tests {
    use super::Straggle;
    use std::time::Duration;

    #[test]
    fn straggle_parses_and_stretches_the_asked_share_of_rounds() {
        assert_eq!(
            Straggle::parse("0.1:3"),
            Some(Straggle {
                probability: 0.1,
                factor: 3.0
            })
        );
        for bad in ["", "0.1", "1.5:3", "0.1:0.5", "x:2", "0.1:inf", "-0.1:2"] {
            assert_eq!(Straggle::parse(bad), None, "{bad}");
        }
        let s = Straggle::parse("0.1:3").unwrap();
        let step = Duration::from_millis(10);
        let slow = (0..10_000)
            .filter(|&r| s.extra(1, r, step) == Duration::from_millis(20))
            .count();
        assert!((800..1200).contains(&slow), "{slow} of 10,000 rounds slow");
        // Deterministic per (rank, round), and different across ranks.
        assert_eq!(s.extra(1, 7, step), s.extra(1, 7, step));
        let a: Vec<_> = (0..200).map(|r| s.extra(0, r, step)).collect();
        let b: Vec<_> = (0..200).map(|r| s.extra(1, r, step)).collect();
        assert_ne!(a, b);
        let always = Straggle::parse("1:2").unwrap();
        assert!((0..100).all(|r| always.extra(0, r, step) == step));
    }
}

//! A worker's training run: [`prepare_worker`] builds the model, partitions the data, starts the [`WorkerActor`] on
//! its own Arbiter and binds the QUIC endpoint; [`PreparedWorker::run`] drives the rounds — pull (SSP-gated by the
//! shards) → compute (actor) → push one uni stream per shard — then settles, says goodbye and returns the
//! [`WorkerReport`]. The push of step t is written by spawned tasks while the pull and compute of step t+1 proceed,
//! so with s ≥ 1 communication overlaps compute. When a shard goes away the driver reconnects with exponential
//! backoff, re-announces its clock and redoes the step.

use std::time::{Duration, Instant};

use actix::prelude::*;
use tracing::{debug, info, warn};

use tether_common::config::{Config, OptimizerConfig, Schedule};
use tether_common::net::{client_endpoint, TransportTuning};
use tether_common::protocol::{ErrorCode, Outcome};

use super::actor::{
    Compute, CpuQuery, Credit, Evaluate, Evaluated, LocalRound, PrecisionQuery, RolledBack,
    WorkerActor,
};
use super::options::WorkerOptions;
use super::report::{Progress, WorkerReport};
use crate::data::Partition;
use crate::driver::{shard_ranges, Driver, DriverConfig, LATENCY_SAMPLES};
use crate::error::WorkerError;
use crate::model::{self, Model};
use crate::step::StepEngine;
use crate::threads::{compute_threads, ComputePool};

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
        None => model::build_for(cfg)?,
    };
    let (features, classes) = (model.features(), model.classes());
    if opts.train.features != features || opts.train.classes > classes {
        return Err(WorkerError::DataShape {
            features: opts.train.features,
            classes: opts.train.classes,
            model_features: features,
            model_classes: classes,
        });
    }
    let layout = model.layout().clone();
    let shards = opts.servers.len();
    let ranges = shard_ranges(&layout, shards);
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
    )?;
    let batch = cfg.train.batch.min(partition.len().max(1));
    let steps_per_epoch = (partition.len() / batch).max(1) as u64;
    let total_steps = cfg.worker_steps(steps_per_epoch);
    let engine = if cfg.train.local_steps > 0 {
        engine.with_inner(&inner_optimizer(cfg, total_steps))
    } else {
        engine
    };
    let pool = ComputePool::new(compute_threads(cfg, opts.colocated), opts.rank)?;
    let actor = WorkerActor::new(
        engine,
        opts.train.clone(),
        opts.test.clone(),
        partition,
        batch,
        steps_per_epoch,
        pool,
    );
    let arbiter = Arbiter::new();
    let addr = WorkerActor::start_in_arbiter(&arbiter.handle(), move |_| actor);
    let endpoint =
        client_endpoint(&opts.tls, &TransportTuning::default()).map_err(WorkerError::Endpoint)?;
    let driver = Driver::new(DriverConfig::for_config(
        cfg,
        opts.rank,
        endpoint,
        opts.servers.clone(),
        opts.server_names.clone(),
        ranges,
        layout.hash(),
        opts.reconnect_deadline,
        opts.tls.paths.clone(),
    ));
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
        let stats = self.driver.protocol.stats();
        self.report.pushes_refused = stats.pushes_refused;
        self.report.stale_replies_dropped = stats.stale_replies;
        self.report.rollbacks_seen = stats.rollbacks_seen;
        self.report.max_clock_lead = stats.max_clock_lead;
        self.report.reconnects = self.driver.reconnects;
        self.report.final_public = (0..self.driver.protocol.shards())
            .map(|k| self.driver.protocol.public(k))
            .collect();
        self.report.wire_bytes_pulled = self.driver.bytes_pulled;
        self.report.push_latency_us = std::mem::take(&mut self.driver.push_latency_us);
        // (fp32_bytes_pulled is counted per step by the training loop: the per-step f32 reference.)
        Ok(self.report)
    }
}

/// The inner optimizer of local-step rounds: `[optimizer]`, with a warmup-cosine schedule stretched over this
/// worker's own inner steps (the schedule's `total` counts shard updates in per-step mode).
fn inner_optimizer(cfg: &Config, total_steps: u64) -> OptimizerConfig {
    let mut inner = cfg.optimizer.clone();
    if let Schedule::WarmupCosine { total, .. } = &mut inner.schedule {
        *total = total_steps;
    }
    inner
}

/// Applies the residual policy to the pushes the shards refused since the last call: good gradients that were not
/// applied are credited back into the residual; those refused for their values are dropped.
fn credit_refused(d: &mut Driver, addr: &Addr<WorkerActor>) {
    for r in d.refused.drain(..) {
        debug!(shard = r.shard, clock = r.clock, outcome = ?r.outcome, "push not applied");
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

/// The rounds: pull, compute on the actor, push (or a skip marker), credit refused pushes, evaluate on schedule, and
/// publish progress; then the final pull and evaluation. Fills `report` as it goes.
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
    let shards = d.protocol.shards();
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
        if report.pull_latency_us.len() < LATENCY_SAMPLES {
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
            d.protocol
                .push(&mut frames, outcome.loss)
                .map_err(WorkerError::ProtocolState)?;
            report.wire_bytes_pushed += wire;
            report.fp32_bytes_pushed += fp32;
        } else {
            warn!(rank, step, "non-finite gradient: not pushed (skip marker)");
            report.nonfinite_skipped += 1;
            if let Some(m) = &opts.metrics {
                m.nonfinite.inc();
            }
            d.protocol
                .skip(outcome.loss)
                .map_err(WorkerError::ProtocolState)?;
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
            report.record_eval(step, started.elapsed().as_secs_f64(), e.accuracy, e.loss);
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
                clock = d.protocol.clock(),
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
        report.record_eval(step, started.elapsed().as_secs_f64(), e.accuracy, e.loss);
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
    let (threads, cpu) = d
        .while_running(addr.send(CpuQuery))
        .await?
        .map_err(|_| WorkerError::ActorGone)?;
    report.compute_threads = threads as u32;
    report.compute_cpu_seconds = cpu;
    report.steps = step;
    report.wall_seconds = started.elapsed().as_secs_f64();
    report.final_params = params;
    Ok(())
}

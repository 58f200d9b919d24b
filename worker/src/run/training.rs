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
    Compute, CpuQuery, Credit, Evaluate, Evaluated, FragmentSync, Inner, LocalRound,
    PrecisionQuery, RolledBack, WorkerActor,
};
use super::options::WorkerOptions;
use super::report::{Progress, WorkerReport};
use crate::data::Partition;
use crate::driver::{shard_ranges, Driver, DriverConfig, LATENCY_SAMPLES};
use crate::error::WorkerError;
use crate::fragments::FragmentStream;
use crate::local_steps::LocalStepsPolicy;
use crate::model::{self, Model};
use crate::step::{StepEngine, StepOutcome};
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
    let partition = match &opts.share {
        Some(share) if share.len() != opts.train.len() => {
            return Err(crate::data::DataError::Partition {
                reason: format!(
                    "a share of {} samples over a training set of {}",
                    share.len(),
                    opts.train.len()
                ),
            }
            .into())
        }
        Some(share) => share.clone(),
        None => Partition::elastic(
            opts.train.len(),
            opts.rank,
            cfg.cluster.workers,
            cfg.train.seed,
        )?,
    };
    let batch = cfg.train.batch.min(partition.len().max(1));
    let steps_per_epoch = (partition.len() / batch).max(1) as u64;
    let total_steps = cfg.worker_steps(steps_per_epoch);
    let engine = if cfg.train.local_steps > 0 {
        engine.with_inner(&inner_optimizer(cfg, total_steps))
    } else {
        engine
    };
    let streamed = cfg.train.fragments > 1 && cfg.train.local_steps > 0;
    let (engine, stream) = if streamed {
        let parts = ranges.iter().map(|r| r.0 as usize..r.1 as usize).collect();
        (
            engine.with_fragments(cfg.train.fragments),
            Some(FragmentStream::new(parts, cfg.train.fragments)),
        )
    } else {
        (engine, None)
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
    )
    .with_stream(stream);
    let arbiter = Arbiter::new();
    let addr = WorkerActor::start_in_arbiter(&arbiter.handle(), move |_| actor);
    let endpoint = client_endpoint(&opts.tls, &TransportTuning::for_cluster(cfg))
        .map_err(WorkerError::Endpoint)?;
    let history = match &opts.history {
        Some(path) => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|source| WorkerError::History {
                    path: path.clone(),
                    source,
                })?,
        ),
        None => None,
    };
    let driver = Driver::new(DriverConfig {
        // A fresh shard's initial weights are computed here from the layout instead of pulled whole.
        initial: Some(std::sync::Arc::new(layout.clone())),
        history,
        ..DriverConfig::for_config(
            cfg,
            opts.rank,
            endpoint,
            opts.servers.clone(),
            opts.server_names.clone(),
            ranges,
            layout.hash(),
            opts.reconnect_deadline,
            opts.tls.paths.clone(),
        )
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

/// The bookkeeping every round ends with, whichever loop ran it: the clock of the run, when the last progress line
/// was logged, and the run's constants.
struct Book<'a> {
    opts: &'a WorkerOptions,
    started: Instant,
    last_log: Instant,
    total_steps: u64,
    n_params: usize,
}

/// What a round produced, for [`Book::push`] and [`Book::end_round`].
struct RoundOutcome {
    /// Steps the round covered.
    n: u64,
    outcome: StepOutcome,
}

impl<'a> Book<'a> {
    fn new(opts: &'a WorkerOptions, total_steps: u64, n_params: usize) -> Self {
        Self {
            opts,
            started: Instant::now(),
            last_log: Instant::now(),
            total_steps,
            n_params,
        }
    }

    /// Records a pull that kept the round waiting for `wait` and brought `bytes` on the wire.
    fn pull_waited(report: &mut WorkerReport, wait: Duration, bytes: u64) {
        report.max_pull_bytes = report.max_pull_bytes.max(bytes);
        report.pull_wait_seconds += wait.as_secs_f64();
        if report.pull_latency_us.len() < LATENCY_SAMPLES {
            report
                .pull_latency_us
                .push(wait.as_micros().min(u128::from(u32::MAX)) as u32);
        }
    }

    /// The straggler fault and the step delay (tests and demos) after a round's compute of `compute`.
    async fn delay(&self, d: &mut Driver, step: u64, compute: Duration) -> Result<(), WorkerError> {
        if let Some(s) = self.opts.straggle {
            let extra = s.extra(self.opts.rank, step, compute);
            if !extra.is_zero() {
                d.while_running(tokio::time::sleep(extra)).await?;
            }
        }
        if !self.opts.step_delay.is_zero() {
            d.while_running(tokio::time::sleep(self.opts.step_delay))
                .await?;
        }
        Ok(())
    }

    /// Hands the round's frames to the protocol (or a skip marker when its update is not finite) and counts the
    /// bytes; returns (wire, fp32) bytes pushed.
    fn push(
        &self,
        d: &mut Driver,
        report: &mut WorkerReport,
        frames: &mut [Vec<u8>],
        r: &RoundOutcome,
        step: u64,
    ) -> Result<(u64, u64), WorkerError> {
        let wire: u64 = frames.iter().map(|f| f.len() as u64).sum();
        // The fp32 reference is per-step synchronization: every step pushes and pulls the whole model in f32.
        let fp32: u64 = 4 * self.n_params as u64 * r.n;
        report.fp32_bytes_pulled += fp32;
        if r.outcome.finite {
            d.protocol
                .push(frames, r.outcome.loss)
                .map_err(WorkerError::ProtocolState)?;
            report.wire_bytes_pushed += wire;
            report.max_push_bytes = report.max_push_bytes.max(wire);
            report.fp32_bytes_pushed += fp32;
            Ok((wire, fp32))
        } else {
            warn!(
                rank = self.opts.rank,
                step, "non-finite update: not pushed (skip marker)"
            );
            report.nonfinite_skipped += 1;
            if let Some(m) = &self.opts.metrics {
                m.nonfinite.inc();
            }
            d.protocol
                .skip(r.outcome.loss)
                .map_err(WorkerError::ProtocolState)?;
            Ok((0, 0))
        }
    }

    /// After the push: credits refused pushes, records the loss, evaluates `params` on schedule, and publishes
    /// progress. `step` is the step count after the round. Returns `params` back.
    #[allow(clippy::too_many_arguments)]
    async fn end_round(
        &mut self,
        d: &mut Driver,
        report: &mut WorkerReport,
        addr: &Addr<WorkerActor>,
        r: &RoundOutcome,
        (wire, fp32): (u64, u64),
        step: u64,
        t0: Instant,
        mut params: Vec<f32>,
    ) -> Result<Vec<f32>, WorkerError> {
        let (opts, n, outcome) = (self.opts, r.n, r.outcome);
        credit_refused(d, addr);
        let secs = self.started.elapsed().as_secs_f64();
        if outcome.finite {
            report
                .loss_curve
                .push((step, secs, f64::from(outcome.loss)));
        }
        let eval_every = opts.config.train.eval_every;
        let mut accuracy = None;
        if opts.test.is_some()
            && eval_every > 0
            && step / eval_every > (step - n) / eval_every
            && step < self.total_steps
        {
            let e = evaluate(d, addr, params).await?;
            params = e.params;
            report.record_eval(
                step,
                self.started.elapsed().as_secs_f64(),
                e.accuracy,
                e.loss,
            );
            accuracy = Some(e.accuracy);
        }
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
                rank: opts.rank,
                step,
                total: self.total_steps,
                loss: outcome.loss,
                wire_bytes: wire,
                fp32_bytes: fp32,
                accuracy,
            });
        } else if self.last_log.elapsed() > Duration::from_secs(5) || step == self.total_steps {
            self.last_log = Instant::now();
            info!(
                rank = opts.rank,
                step,
                total_steps = self.total_steps,
                loss = outcome.loss,
                ?accuracy,
                clock = d.protocol.clock(),
                "progress"
            );
        }
        Ok(params)
    }

    /// The end of the run: the final pull into `params` and evaluation, the actor's statistics, and the report's
    /// totals.
    async fn finish(
        &self,
        d: &mut Driver,
        report: &mut WorkerReport,
        addr: &Addr<WorkerActor>,
        step: u64,
        mut params: Vec<f32>,
        policy: &LocalStepsPolicy,
    ) -> Result<(), WorkerError> {
        let rank = self.opts.rank;
        if self.opts.test.is_some() {
            // The final model: one more pull (it waits, as any pull, until the others are within the bound).
            d.pull(&mut params).await?;
            report.fp32_bytes_pulled += 4 * self.n_params as u64;
            let e = evaluate(d, addr, params).await?;
            params = e.params;
            report.record_eval(
                step,
                self.started.elapsed().as_secs_f64(),
                e.accuracy,
                e.loss,
            );
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
        if policy.adaptive() {
            report.local_steps_reason = policy.reason();
        }
        report.compute_cpu_seconds = cpu;
        report.steps = step;
        report.wall_seconds = self.started.elapsed().as_secs_f64();
        report.final_params = params;
        Ok(())
    }

    /// Feeds the link-aware policy a round of `n` inner steps that computed for `compute`, its links measured by the
    /// driver; `rounds` such rounds make one H (streamed fragments: F), so each measure is scaled by it. Records
    /// what the policy picked.
    fn pick(
        &self,
        d: &Driver,
        report: &mut WorkerReport,
        policy: &mut LocalStepsPolicy,
        (n, rounds): (u64, u32),
        compute: Duration,
        step: u64,
    ) {
        let before = policy.current();
        let after = policy.observe(
            n * u64::from(rounds),
            compute * rounds,
            d.link_time() * rounds,
        );
        if after != before {
            info!(rank = self.opts.rank, step, reason = %policy.reason(), "local steps changed");
        }
        report.local_steps_picked = after;
    }
}

/// The rounds: pull, compute on the actor, push (or a skip marker), credit refused pushes, evaluate on schedule, and
/// publish progress; then the final pull and evaluation. Fills `report` as it goes. With streamed fragments the
/// rounds are [`stream_loop`]'s.
async fn train_loop(
    d: &mut Driver,
    opts: &WorkerOptions,
    report: &mut WorkerReport,
    addr: &Addr<WorkerActor>,
    total_steps: u64,
    n_params: usize,
) -> Result<(), WorkerError> {
    let train = &opts.config.train;
    if train.fragments > 1 && train.local_steps > 0 {
        return stream_loop(d, opts, report, addr, total_steps, n_params).await;
    }
    let mut book = Book::new(opts, total_steps, n_params);
    let shards = d.protocol.shards();
    let mut params = vec![0.0f32; n_params];
    let mut frames: Vec<Vec<u8>> = vec![Vec::new(); shards];
    let mut step = 0u64;
    let mut policy = LocalStepsPolicy::new(train.local_steps, train.local_steps_max);
    while step < total_steps {
        let local = if train.local_steps > 0 {
            u64::from(policy.current())
        } else {
            0
        };
        let t0 = Instant::now();
        let before = d.bytes_pulled;
        d.pull(&mut params).await?;
        if !d.rolled_back.is_empty() {
            // Delivered before the compute below (one mailbox, in order).
            addr.do_send(RolledBack {
                shards: std::mem::take(&mut d.rolled_back),
            });
        }
        let pulled = Instant::now();
        Book::pull_waited(report, pulled - t0, d.bytes_pulled - before);
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
        book.delay(d, step, pulled.elapsed()).await?;
        report.compute_seconds += pulled.elapsed().as_secs_f64();
        if local > 0 {
            book.pick(d, report, &mut policy, (n, 1), pulled.elapsed(), step);
        }
        let round = RoundOutcome {
            n,
            outcome: computed.outcome,
        };
        let bytes = book.push(d, report, &mut frames, &round, step)?;
        step += n;
        params = book
            .end_round(d, report, addr, &round, bytes, step, t0, params)
            .await?;
    }
    book.finish(d, report, addr, step, params, &policy).await
}

/// Streamed fragments (`train.fragments` > 1): after the first pull, each round runs `H / fragments` inner steps on
/// the worker's own model while the pull that followed the previous push is in flight, then merges that pull into
/// the part it answered, pushes round `c`'s part (`c mod fragments` of every shard) and starts the next pull. The
/// protocol sees the same push, pull, push order as in [`train_loop`]; only the model reads a pull one round later.
async fn stream_loop(
    d: &mut Driver,
    opts: &WorkerOptions,
    report: &mut WorkerReport,
    addr: &Addr<WorkerActor>,
    total_steps: u64,
    n_params: usize,
) -> Result<(), WorkerError> {
    let train = &opts.config.train;
    let fragments = u64::from(train.fragments);
    let mut book = Book::new(opts, total_steps, n_params);
    let mut global = vec![0.0f32; n_params];
    let mut frames: Vec<Vec<u8>> = vec![Vec::new(); d.protocol.shards()];
    let mut policy = LocalStepsPolicy::new(train.local_steps, train.local_steps_max);
    let t0 = Instant::now();
    d.pull(&mut global).await?;
    Book::pull_waited(report, t0.elapsed(), d.bytes_pulled);
    d.rolled_back.clear();
    let started = d
        .while_running(addr.send(FragmentSync {
            params: global,
            start: true,
            reload: Vec::new(),
            merge: None,
            push: None,
            steps: 0..0,
            loss: 0.0,
            frames,
        }))
        .await?
        .map_err(|_| WorkerError::ActorGone)??;
    (global, frames) = (started.params, started.frames);
    let mut merge: Option<u64> = None;
    let mut step = 0u64;
    while step < total_steps {
        let n = (u64::from(policy.current()) / fragments)
            .max(1)
            .min(total_steps - step);
        let t0 = Instant::now();
        let inner = addr.send(Inner {
            first_step: step,
            steps: n,
        });
        let before = d.bytes_pulled;
        let (done, wait) = if merge.is_some() {
            d.pull_while(&mut global, inner).await?
        } else {
            (d.while_running(inner).await?, Duration::ZERO)
        };
        let done = done.map_err(|_| WorkerError::ActorGone)?;
        let computed_for = t0.elapsed().saturating_sub(wait);
        if merge.is_some() {
            Book::pull_waited(report, wait, d.bytes_pulled - before);
        }
        book.delay(d, step, computed_for).await?;
        report.compute_seconds += computed_for.as_secs_f64();
        book.pick(
            d,
            report,
            &mut policy,
            (n, train.fragments),
            computed_for,
            step,
        );
        let reload = std::mem::take(&mut d.rolled_back);
        if !reload.is_empty() {
            // Delivered before the sync below (one mailbox, in order): residuals and inner optimizer start afresh.
            addr.do_send(RolledBack {
                shards: reload.clone(),
            });
        }
        let clock = d.protocol.clock();
        let loss = if done.good > 0 {
            done.loss as f32
        } else {
            f32::NAN
        };
        let synced = d
            .while_running(addr.send(FragmentSync {
                params: global,
                start: false,
                reload,
                merge,
                push: Some(clock),
                steps: step..step + n,
                loss,
                frames,
            }))
            .await?
            .map_err(|_| WorkerError::ActorGone)??;
        (global, frames) = (synced.params, synced.frames);
        let round = RoundOutcome {
            n,
            outcome: synced.outcome,
        };
        let bytes = book.push(d, report, &mut frames, &round, step)?;
        merge = Some(clock);
        step += n;
        // Evaluations read the shards' model as last pulled.
        global = book
            .end_round(d, report, addr, &round, bytes, step, t0, global)
            .await?;
    }
    book.finish(d, report, addr, step, global, &policy).await
}

//! The worker: a `WorkerActor` (actix, on its own Arbiter) that owns the model, the data partition, the error
//! feedback residuals and the encoders, and a driver task that talks to every shard over mutual-TLS QUIC — pull
//! (SSP-gated by the shards) → compute (actor) → push one uni stream per shard. The push of step t is written by
//! spawned tasks while the pull and compute of step t+1 proceed, so with s ≥ 1 communication overlaps compute. When
//! a shard goes away the driver reconnects with exponential backoff, re-announces its clock and redoes the step.

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use tether_common::codec::CodecError;
use tether_common::config::Config;
use tether_common::metrics::WorkerMetrics;
use tether_common::net::TransportTuning;
use tether_common::net::{
    client_endpoint, client_handshake, connect, recv_bulk, ControlChannel, NetError, TlsFiles,
};
use tether_common::protocol::{
    access_params, encode_push, Control, FrameKind, FrameLimits, Hello, Precision, PushFrame,
};

use crate::data::{Dataset, Partition};
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
    /// Encoded push bytes.
    pub wire_bytes_pushed: u64,
    /// fp32 size of the same pushes.
    pub fp32_bytes_pushed: u64,
    /// Parameter bytes pulled.
    pub wire_bytes_pulled: u64,
    /// Largest clock lead seen in a pull answer.
    pub max_clock_lead: u64,
    /// Gradients refused because they were not finite.
    pub nonfinite_skipped: u64,
    /// Reconnections after a shard went away.
    pub reconnects: u64,
    /// Wall time.
    pub wall_seconds: f64,
    /// The last parameters pulled.
    pub final_params: Vec<f32>,
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
    /// A user model to train instead of the one `[model]` describes (the shards must use its layout).
    pub model: Option<ModelFactory>,
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

struct Evaluate {
    params: Vec<f32>,
}

impl Message for Evaluate {
    type Result = (f32, Vec<f32>);
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

impl Handler<Evaluate> for WorkerActor {
    type Result = MessageResult<Evaluate>;
    fn handle(&mut self, msg: Evaluate, _: &mut Context<Self>) -> Self::Result {
        let acc = match &self.test {
            Some(t) => model::accuracy(self.engine.model_mut(), &msg.params, &t.x, &t.y, 1000),
            None => f32::NAN,
        };
        MessageResult((acc, msg.params))
    }
}

/// One connection to one shard.
struct ShardLink {
    conn: quinn::Connection,
    control: ControlChannel,
    range: (u64, u64),
    limits: FrameLimits,
}

struct Driver {
    opts: WorkerOptions,
    endpoint: quinn::Endpoint,
    links: Vec<Option<ShardLink>>,
    ranges: Vec<(u64, u64)>,
    layout_hash: u64,
    clock: u64,
    versions: Vec<u64>,
    report: WorkerReport,
    pushes: Vec<tokio::task::JoinHandle<()>>,
    precision: Precision,
}

impl Driver {
    async fn connect_shard(&mut self, k: usize) -> Result<(), NetError> {
        let name = &self.opts.servers[k];
        let addr = tokio::net::lookup_host(name.as_str())
            .await
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| NetError::Resolve(name.clone()))?;
        let conn = connect(&self.endpoint, addr, &self.opts.server_names[k]).await?;
        let mut control = ControlChannel::open(&conn).await?;
        let welcome =
            client_handshake(&mut control, Hello::new(self.opts.rank, self.layout_hash)).await?;
        let range = (welcome.range_start, welcome.range_end);
        if range != self.ranges[k] {
            conn.close(0u32.into(), b"unexpected range");
            return Err(NetError::Identity(format!(
                "shard {k} serves range {range:?}, the layout puts it at {:?}",
                self.ranges[k]
            )));
        }
        // A rejoining worker may have been evicted: continue from the shard's minimum clock if that is ahead.
        self.clock = self.clock.max(welcome.min_clock);
        let limits = FrameLimits::for_codec(
            &self.opts.config.compression.codec(),
            (range.1 - range.0) as usize,
        );
        self.links[k] = Some(ShardLink {
            conn,
            control,
            range,
            limits,
        });
        Ok(())
    }

    /// (Re)connects every missing link, retrying with exponential backoff until the deadline.
    async fn ensure_connected(&mut self) -> Result<(), WorkerError> {
        let deadline = Instant::now() + self.opts.reconnect_deadline;
        let mut backoff = Duration::from_millis(100);
        let mut reconnected = false;
        loop {
            let mut last_err = None;
            for k in 0..self.links.len() {
                if self.links[k].is_none() {
                    if let Err(e) = self.connect_shard(k).await {
                        debug!(rank = self.opts.rank, shard = k, error = %e, "connect failed");
                        if e.remote_close_code().is_some() || matches!(e, NetError::Protocol(_)) {
                            return Err(WorkerError::Net {
                                shard: k,
                                source: e,
                            });
                        }
                        last_err = Some((k, e));
                    } else {
                        reconnected = true;
                    }
                }
            }
            match last_err {
                None => break,
                Some((k, e)) if Instant::now() + backoff > deadline => {
                    return Err(WorkerError::Net {
                        shard: k,
                        source: e,
                    })
                }
                Some(_) => {
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
            }
        }
        if reconnected {
            // Every shard learns our clock (it may restart behind us, or have moved on after evicting us).
            let clock = self.clock;
            for link in self.links.iter_mut().flatten() {
                if link.control.send(&Control::Clock { clock }).await.is_err() {
                    // The next step's pull notices the broken link and reconnects.
                    continue;
                }
            }
        }
        Ok(())
    }

    /// Pulls every shard's values for the current clock into `params`; returns the largest lead seen.
    async fn pull(&mut self, params: &mut [f32]) -> Result<(), (usize, NetError)> {
        let clock = self.clock;
        for (k, link) in self.links.iter_mut().enumerate() {
            let link = link.as_mut().ok_or((k, NetError::ControlClosed))?;
            link.control
                .send(&Control::PullRequest {
                    clock,
                    precision: self.precision,
                })
                .await
                .map_err(|e| (k, e))?;
        }
        let heartbeat = Duration::from_millis(self.opts.config.cluster.heartbeat_ms.max(10));
        for k in 0..self.links.len() {
            let conn = self.links[k]
                .as_ref()
                .ok_or((k, NetError::ControlClosed))?
                .conn
                .clone();
            // While the SSP gate holds the pull, heartbeats keep this worker from being evicted as silent.
            let accept = conn.accept_uni();
            tokio::pin!(accept);
            let stream = loop {
                tokio::select! {
                    s = &mut accept => break s.map_err(|e| (k, NetError::from(e)))?,
                    _ = tokio::time::sleep(heartbeat) => {
                        for (j, l) in self.links.iter_mut().enumerate() {
                            let l = l.as_mut().ok_or((j, NetError::ControlClosed))?;
                            l.control.send(&Control::Heartbeat { clock }).await.map_err(|e| (j, e))?;
                        }
                    }
                }
            };
            let link = self.links[k].as_ref().ok_or((k, NetError::ControlClosed))?;
            let frame = recv_bulk(stream, &link.limits, FrameKind::Params)
                .await
                .map_err(|e| (k, e))?;
            // Validated in place: no copy of the values besides the conversion into `params`.
            let reply = access_params(&frame.body).map_err(|e| (k, NetError::from(e)))?;
            reply
                .check_shape(link.range.0, link.range.1)
                .map_err(|e| (k, NetError::from(e)))?;
            let dst = &mut params[link.range.0 as usize..link.range.1 as usize];
            match reply.precision() {
                Precision::F32 => {
                    for (d, b) in dst.iter_mut().zip(reply.values().chunks_exact(4)) {
                        *d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                    }
                }
                Precision::Bf16 => {
                    for (d, b) in dst.iter_mut().zip(reply.values().chunks_exact(2)) {
                        *d = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
                    }
                }
            }
            let (version, min_clock) = (reply.version.to_native(), reply.min_clock.to_native());
            self.report.wire_bytes_pulled += reply.values().len() as u64;
            self.versions[k] = version;
            self.report.max_clock_lead = self
                .report
                .max_clock_lead
                .max(clock.saturating_sub(min_clock));
        }
        Ok(())
    }
    /// Starts the pushes of this step; each runs as its own task so the next step's pull and compute overlap it.
    async fn push(&mut self, frames: &mut [Vec<u8>], loss: f32) -> Result<(), (usize, NetError)> {
        self.pushes.retain(|h| !h.is_finished());
        for (k, slot) in frames.iter_mut().enumerate() {
            let link = self.links[k].as_ref().ok_or((k, NetError::ControlClosed))?;
            // The codec frame moves into the push frame and back: its buffer is reused next step, never copied.
            let payload = std::mem::take(slot);
            let frame = PushFrame {
                worker: self.opts.rank,
                clock: self.clock,
                shard: k as u32,
                range_start: link.range.0,
                range_end: link.range.1,
                read_version: self.versions[k],
                loss,
                payload,
            };
            let bytes = encode_push(&frame);
            *slot = frame.payload;
            let bytes = bytes.map_err(|e| (k, NetError::from(e)))?;
            // Opening the stream here (not in the task) keeps stream order equal to clock order.
            let mut stream = link
                .conn
                .open_uni()
                .await
                .map_err(|e| (k, NetError::from(e)))?;
            self.report.wire_bytes_pushed += slot.len() as u64;
            self.report.fp32_bytes_pushed += 4 * (link.range.1 - link.range.0);
            self.pushes.push(tokio::spawn(async move {
                let header = match tether_common::protocol::FrameHeader::encode(
                    FrameKind::Push,
                    bytes.len(),
                ) {
                    Ok(h) => h,
                    Err(_) => return,
                };
                if stream.write_all(&header).await.is_ok() && stream.write_all(&bytes).await.is_ok()
                {
                    let _ = stream.finish();
                }
            }));
        }
        Ok(())
    }

    async fn announce_skip(&mut self) -> Result<(), (usize, NetError)> {
        let clock = self.clock + 1;
        for (k, link) in self.links.iter_mut().enumerate() {
            let link = link.as_mut().ok_or((k, NetError::ControlClosed))?;
            link.control
                .send(&Control::Clock { clock })
                .await
                .map_err(|e| (k, e))?;
        }
        Ok(())
    }

    async fn goodbye(&mut self) {
        for h in self.pushes.drain(..) {
            let _ = h.await;
        }
        let clock = self.clock;
        for link in self.links.iter_mut().flatten() {
            // The heartbeat tells the shard which pushes to wait for before it lets us leave.
            let _ = link.control.send(&Control::Heartbeat { clock }).await;
            let _ = link.control.send(&Control::Goodbye).await;
        }
        for link in self.links.iter().flatten() {
            // Give the goodbye a moment to be delivered before closing.
            let _ = tokio::time::timeout(Duration::from_millis(200), link.conn.closed()).await;
            link.conn.close(0u32.into(), b"done");
        }
        self.endpoint.wait_idle().await;
    }
}

/// A worker whose actor is started and whose endpoint is bound, ready to [`PreparedWorker::run`].
pub struct PreparedWorker {
    driver: Driver,
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
        None => {
            let (features, classes) = cfg.model_io()?;
            model::build(&cfg.model, features, classes)
        }
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
    let total_steps = steps_per_epoch * u64::from(cfg.train.epochs);
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
    };
    let arbiter = Arbiter::new();
    let addr = WorkerActor::start_in_arbiter(&arbiter.handle(), move |_| actor);
    let endpoint =
        client_endpoint(&opts.tls, &TransportTuning::default()).map_err(|e| WorkerError::Net {
            shard: 0,
            source: e,
        })?;
    let driver = Driver {
        links: (0..shards).map(|_| None).collect(),
        versions: vec![0; shards],
        ranges,
        layout_hash: layout.hash(),
        clock: 0,
        report: WorkerReport {
            rank: opts.rank,
            ..WorkerReport::default()
        },
        pushes: Vec::new(),
        precision: if cfg.compression.pull_bf16 {
            Precision::Bf16
        } else {
            Precision::F32
        },
        endpoint,
        opts,
    };
    Ok(PreparedWorker {
        driver,
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
            &self.actor,
            self.total_steps,
            self.n_params,
        )
        .await;
        self.arbiter.stop();
        result?;
        self.driver.goodbye().await;
        Ok(self.driver.report)
    }
}

async fn train_loop(
    d: &mut Driver,
    addr: &Addr<WorkerActor>,
    total_steps: u64,
    n_params: usize,
) -> Result<(), WorkerError> {
    let started = Instant::now();
    let rank = d.opts.rank;
    let eval_every = d.opts.config.train.eval_every;
    let shards = d.links.len();
    let mut params = vec![0.0f32; n_params];
    let mut frames: Vec<Vec<u8>> = vec![Vec::new(); shards];
    let mut step = 0u64;
    let mut last_log = Instant::now();
    d.ensure_connected().await?;
    while step < total_steps {
        let t0 = Instant::now();
        if let Err((k, e)) = d.pull(&mut params).await {
            warn!(rank, shard = k, error = %e, "pull failed; reconnecting");
            d.links[k] = None;
            d.report.reconnects += 1;
            d.ensure_connected().await?;
            continue;
        }
        let computed = addr
            .send(Compute {
                step,
                params,
                frames,
            })
            .await
            .map_err(|_| WorkerError::ActorGone)??;
        params = computed.params;
        frames = computed.frames;
        let outcome = computed.outcome;
        if !d.opts.step_delay.is_zero() {
            tokio::time::sleep(d.opts.step_delay).await;
        }
        let (wire0, fp0) = (d.report.wire_bytes_pushed, d.report.fp32_bytes_pushed);
        let sent = if outcome.finite {
            d.push(&mut frames, outcome.loss).await
        } else {
            warn!(rank, step, "non-finite gradient: not pushed");
            d.report.nonfinite_skipped += 1;
            if let Some(m) = &d.opts.metrics {
                m.nonfinite.inc();
            }
            d.announce_skip().await
        };
        if let Err((k, e)) = sent {
            warn!(rank, shard = k, error = %e, "push failed; reconnecting and redoing the step");
            d.links[k] = None;
            d.report.reconnects += 1;
            d.ensure_connected().await?;
            continue;
        }
        d.clock += 1;
        step += 1;
        let secs = started.elapsed().as_secs_f64();
        if outcome.finite {
            d.report
                .loss_curve
                .push((step, secs, f64::from(outcome.loss)));
        }
        let mut accuracy = None;
        if d.opts.test.is_some()
            && eval_every > 0
            && step.is_multiple_of(eval_every)
            && step < total_steps
        {
            let (acc, p) = addr
                .send(Evaluate { params })
                .await
                .map_err(|_| WorkerError::ActorGone)?;
            params = p;
            d.report
                .accuracy_curve
                .push((step, started.elapsed().as_secs_f64(), f64::from(acc)));
            accuracy = Some(acc);
        }
        let wire = d.report.wire_bytes_pushed - wire0;
        let fp32 = d.report.fp32_bytes_pushed - fp0;
        if let Some(m) = &d.opts.metrics {
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
        if let Some(tx) = &d.opts.progress {
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
                clock = d.clock,
                "progress"
            );
        }
    }
    if d.opts.test.is_some() {
        // The final model: one more pull (it waits, as any pull, until the others are within the bound).
        match d.pull(&mut params).await {
            Ok(()) => {
                let (acc, p) = addr
                    .send(Evaluate { params })
                    .await
                    .map_err(|_| WorkerError::ActorGone)?;
                params = p;
                d.report.accuracy_curve.push((
                    step,
                    started.elapsed().as_secs_f64(),
                    f64::from(acc),
                ));
                info!(rank, step, accuracy = acc, "final evaluation");
            }
            Err((k, e)) => {
                warn!(rank, shard = k, error = %e, "final pull failed; no final evaluation")
            }
        }
    }
    d.report.steps = step;
    d.report.wall_seconds = started.elapsed().as_secs_f64();
    d.report.final_params = params;
    Ok(())
}

/// Loads the configured training and test sets. When the configured Fashion-MNIST directory is missing, falls back
/// to the embedded digits set, switches `cfg.data.dataset` accordingly (the model's input width changes with it)
/// and returns a note saying so.
pub fn load_data(
    cfg: &mut Config,
) -> Result<(Dataset, Dataset, Option<String>), crate::data::DataError> {
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
    tether_common::report::RunReport {
        steps: r.steps,
        wall_seconds: r.wall_seconds,
        final_train_loss,
        final_test_accuracy: r.accuracy_curve.last().map_or(f64::NAN, |a| a.2),
        wire_bytes_pushed: r.wire_bytes_pushed,
        fp32_bytes_pushed: r.fp32_bytes_pushed,
        wire_bytes_pulled: r.wire_bytes_pulled,
        max_clock_lead_observed: r.max_clock_lead,
        loss_curve: r.loss_curve.clone(),
        accuracy_curve: r.accuracy_curve.clone(),
        nonfinite_skipped: r.nonfinite_skipped,
        ..tether_common::report::RunReport::for_config(cfg)
    }
}

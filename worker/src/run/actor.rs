//! The compute side of a worker: [`WorkerActor`] (actix, on its own Arbiter) owns the model, the data partition,
//! the error-feedback residuals and the encoders, and answers the training loop's messages — compute a step or a
//! local-step round into push frames, evaluate, credit back a push a shard did not apply, reset after a rollback,
//! report mixed-precision statistics. Buffers travel with the messages and come back in the answers, so a step
//! allocates nothing.

use std::sync::Arc;

use actix::prelude::*;
use tracing::warn;

use tether_common::codec::CodecError;

use crate::data::{Dataset, Partition, TestSet};
use crate::fragments::FragmentStream;
use crate::model;
use crate::step::{StepEngine, StepOutcome};
use crate::threads::ComputePool;

/// One step: compute the gradient at `params` on this step's batch and encode it into `frames` (one per shard).
pub(super) struct Compute {
    pub(super) step: u64,
    pub(super) params: Vec<f32>,
    pub(super) frames: Vec<Vec<u8>>,
}

/// What a round computed, and the parameter and frame buffers back.
pub(super) struct Computed {
    pub(super) outcome: StepOutcome,
    pub(super) params: Vec<f32>,
    pub(super) frames: Vec<Vec<u8>>,
}

impl Message for Compute {
    type Result = Result<Computed, CodecError>;
}

/// A local-step round: `steps` inner steps from `params` (θ_start, returned unchanged), then the pseudo-gradient
/// θ_start − θ_end encoded into `frames`.
pub(super) struct LocalRound {
    pub(super) first_step: u64,
    pub(super) steps: u64,
    pub(super) params: Vec<f32>,
    pub(super) frames: Vec<Vec<u8>>,
}

impl Message for LocalRound {
    type Result = Result<Computed, CodecError>;
}

/// Streamed fragments: `steps` inner steps on the worker's own model θ (no push; the round's pull is in flight).
pub(super) struct Inner {
    pub(super) first_step: u64,
    pub(super) steps: u64,
}

/// What a round of inner steps measured: the mean loss of its finite steps and how many there were.
pub(super) struct InnerDone {
    pub(super) loss: f64,
    pub(super) good: u64,
}

impl Message for Inner {
    type Result = InnerDone;
}

/// Streamed fragments: bring the pulled model `params` in, then encode round `push`'s part into `frames`. `start`:
/// θ and every anchor become `params` (the first pull); `reload`: shards that rolled back; `merge`: the round whose
/// push this pull followed. `steps` are the inner steps the round covered (for push faults and the seed).
pub(super) struct FragmentSync {
    pub(super) params: Vec<f32>,
    pub(super) start: bool,
    pub(super) reload: Vec<usize>,
    pub(super) merge: Option<u64>,
    pub(super) push: Option<u64>,
    pub(super) steps: std::ops::Range<u64>,
    pub(super) loss: f32,
    pub(super) frames: Vec<Vec<u8>>,
}

impl Message for FragmentSync {
    type Result = Result<Computed, CodecError>;
}

/// Evaluate `params` on the test set.
pub(super) struct Evaluate {
    pub(super) params: Vec<f32>,
}

/// Shards that rolled back after a loss spike: the engine resets what it built on their old trajectory.
#[derive(Message)]
#[rtype(result = "()")]
pub(super) struct RolledBack {
    pub(super) shards: Vec<usize>,
}

impl Handler<RolledBack> for WorkerActor {
    type Result = ();
    fn handle(&mut self, msg: RolledBack, _: &mut Context<Self>) {
        self.engine.reset_trajectory(&msg.shards);
    }
}

/// A push shard `shard` did not apply although its gradient was good: the residual policy credits it back.
pub(super) struct Credit {
    pub(super) shard: usize,
    pub(super) frame: bytes::Bytes,
}

impl Message for Credit {
    type Result = ();
}

impl Handler<Credit> for WorkerActor {
    type Result = ();
    fn handle(&mut self, msg: Credit, _: &mut Context<Self>) {
        // The frame was built by this worker, so it validates; a failure here is logged, never fatal.
        let payload = tether_common::protocol::access_push(&msg.frame)
            .map(|f| (f.meta().clock, f.payload().to_vec()));
        match payload {
            Ok((clock, p)) if !p.is_empty() => {
                if let Err(e) = self.engine.credit_undelivered_part(msg.shard, clock, &p) {
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
pub(super) struct Evaluated {
    pub(super) accuracy: f32,
    pub(super) loss: f32,
    pub(super) params: Vec<f32>,
}

/// The model's mixed-precision statistics.
pub(super) struct PrecisionQuery;

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
pub(super) struct WorkerActor {
    engine: StepEngine,
    train: Arc<Dataset>,
    test: Option<TestSet>,
    /// This epoch's sample order (indices into `train`), drawn at the epoch's first step.
    order: Vec<usize>,
    partition: Partition,
    batch: usize,
    steps_per_epoch: u64,
    /// The batch's features and labels (reused every step).
    xb: Vec<f32>,
    yb: Vec<u32>,
    /// θ of the local-step round in progress.
    theta: Vec<f32>,
    /// θ and anchors of streamed fragments (`train.fragments` > 1).
    stream: Option<FragmentStream>,
    /// The threads every step, round and evaluation runs on.
    pool: Arc<ComputePool>,
}

impl WorkerActor {
    /// An actor training `engine` on `partition` of `train`, `batch` rows a step, evaluating on `test`.
    pub(super) fn new(
        engine: StepEngine,
        train: Arc<Dataset>,
        test: Option<TestSet>,
        partition: Partition,
        batch: usize,
        steps_per_epoch: u64,
        pool: ComputePool,
    ) -> WorkerActor {
        let features = train.features;
        WorkerActor {
            engine,
            train,
            test,
            order: Vec::new(),
            partition,
            batch,
            steps_per_epoch,
            xb: vec![0.0; batch * features],
            yb: vec![0; batch],
            theta: Vec::new(),
            stream: None,
            pool: Arc::new(pool),
        }
    }
}

impl WorkerActor {
    /// Streamed fragments (`train.fragments` > 1): rounds are [`Inner`] and [`FragmentSync`] on this stream.
    pub(super) fn with_stream(mut self, stream: Option<FragmentStream>) -> Self {
        self.stream = stream;
        self
    }
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
    fn handle(&mut self, msg: Compute, _: &mut Context<Self>) -> Self::Result {
        let pool = Arc::clone(&self.pool);
        pool.install(|| self.compute(msg))
    }
}

impl Handler<LocalRound> for WorkerActor {
    type Result = Result<Computed, CodecError>;
    fn handle(&mut self, msg: LocalRound, _: &mut Context<Self>) -> Self::Result {
        let pool = Arc::clone(&self.pool);
        pool.install(|| self.local_round(msg))
    }
}

impl WorkerActor {
    /// One step (on the compute pool).
    fn compute(&mut self, mut msg: Compute) -> Result<Computed, CodecError> {
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

    /// One local-step round (on the compute pool).
    fn local_round(&mut self, mut msg: LocalRound) -> Result<Computed, CodecError> {
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

impl Handler<Inner> for WorkerActor {
    type Result = MessageResult<Inner>;
    fn handle(&mut self, msg: Inner, _: &mut Context<Self>) -> Self::Result {
        let pool = Arc::clone(&self.pool);
        MessageResult(pool.install(|| self.inner(msg)))
    }
}

impl Handler<FragmentSync> for WorkerActor {
    type Result = Result<Computed, CodecError>;
    fn handle(&mut self, msg: FragmentSync, _: &mut Context<Self>) -> Self::Result {
        let pool = Arc::clone(&self.pool);
        pool.install(|| self.fragment_sync(msg))
    }
}

impl WorkerActor {
    /// Streamed fragments: inner steps on θ (on the compute pool). Without a started stream nothing runs.
    fn inner(&mut self, msg: Inner) -> InnerDone {
        let (mut loss, mut good) = (0.0f64, 0u64);
        let mut stream = match self.stream.take() {
            Some(s) if s.started() => s,
            other => {
                self.stream = other;
                return InnerDone { loss, good };
            }
        };
        for step in msg.first_step..msg.first_step + msg.steps {
            self.load_batch(step);
            let o = self
                .engine
                .compute(step, stream.theta(), &self.xb, &self.yb);
            // A non-finite inner gradient is dropped: that inner step does not happen.
            if o.finite {
                self.engine.inner_step(stream.theta_mut());
                loss += f64::from(o.loss);
                good += 1;
            }
        }
        self.stream = Some(stream);
        InnerDone {
            loss: if good > 0 { loss / good as f64 } else { 0.0 },
            good,
        }
    }

    /// Streamed fragments: merge the pull, then encode the round's part (on the compute pool).
    fn fragment_sync(&mut self, mut msg: FragmentSync) -> Result<Computed, CodecError> {
        let Some(stream) = self.stream.as_mut() else {
            return Err(CodecError::LengthMismatch {
                expected: 0,
                found: msg.params.len() as u64,
            });
        };
        if msg.start || !stream.started() {
            stream.start(&msg.params);
        }
        stream.reload(&msg.params, &msg.reload);
        if let Some(c) = msg.merge {
            stream.merge(&msg.params, c);
        }
        let mut finite = false;
        if let Some(clock) = msg.push {
            finite = msg.loss.is_finite() && stream.pseudo_gradient(clock, self.engine.grad_mut());
            if finite {
                self.engine.fault_push(msg.steps.clone());
                for (k, out) in msg.frames.iter_mut().enumerate() {
                    self.engine.encode_part(k, clock, msg.steps.start, out)?;
                }
                stream.pushed(clock);
            } else if !stream.theta().iter().all(|t| t.is_finite()) {
                stream.discard();
            }
        }
        Ok(Computed {
            outcome: StepOutcome {
                loss: msg.loss,
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
        let pool = Arc::clone(&self.pool);
        MessageResult(pool.install(|| self.evaluate(msg)))
    }
}

/// The compute threads and the CPU seconds they have used so far.
pub(super) struct CpuQuery;

impl Message for CpuQuery {
    type Result = (usize, f64);
}

impl Handler<CpuQuery> for WorkerActor {
    type Result = MessageResult<CpuQuery>;
    fn handle(&mut self, _: CpuQuery, _: &mut Context<Self>) -> Self::Result {
        MessageResult((self.pool.threads(), self.pool.cpu_seconds()))
    }
}

impl WorkerActor {
    /// Evaluates on the test set (on the compute pool).
    fn evaluate(&mut self, msg: Evaluate) -> Evaluated {
        let (accuracy, loss) = match &self.test {
            Some(t) if !t.is_empty() => {
                // Chunks of 256 rows bound the activations (a GPT's are rows × context × vocabulary wide), and
                // turn a test set held as pixel bytes into f32 one chunk at a time. The counts and sums are
                // those of `model::accuracy` and `model::mean_loss` over the same chunks.
                let m = self.engine.model_mut();
                let (mut correct, mut total_loss) = (0usize, 0.0f64);
                let mut pred = vec![0u32; 256];
                t.for_each_chunk(256, |xs, ys| {
                    let out = &mut pred[..ys.len()];
                    m.predict(&msg.params, xs, out);
                    correct += out.iter().zip(ys).filter(|(p, l)| p == l).count();
                    total_loss += f64::from(m.loss(&msg.params, xs, ys)) * ys.len() as f64;
                });
                let n = t.len();
                (correct as f32 / n as f32, (total_loss / n as f64) as f32)
            }
            Some(_) => (0.0, 0.0),
            None => (f32::NAN, f32::NAN),
        };
        Evaluated {
            accuracy,
            loss,
            params: msg.params,
        }
    }
}

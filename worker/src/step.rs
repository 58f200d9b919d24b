//! `StepEngine`: one worker's training step as plain computation — gradient from the model, a finiteness check,
//! clipping by global norm, then per-shard error feedback and encoding into codec frames (the encode half is
//! [`PushEncoder`], which also serves gradients computed outside Rust). No I/O, no clocks: the
//! seed of stochastic rounding is derived from (worker, step, shard), so a run is reproducible. Steady state is
//! allocation-free: gradient, residuals and frame buffers are owned and reused.

use std::ops::Range;

use tether_common::codec::{seed_for, CodecConfig, CodecError, Decoder, Encoder, ErrorFeedback};
use tether_common::config::OptimizerConfig;
use tether_common::layout::fragment_part;
use tether_common::numeric::sum_of_squares;
use tether_common::optim::Optimizer;

use crate::model::Model;

/// A fault injected into computed gradients (fault-tolerance tests and demos).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum GradientFault {
    /// Replace one gradient value with NaN at this step.
    NanAt(u64),
    /// Multiply the gradient by this factor at this step.
    ScaleAt(u64, f32),
    /// Multiply the update pushed at this step by this factor after clipping (in local-step rounds, the
    /// pseudo-gradient of the round holding this step): a loss spike that clipping cannot neutralise.
    PushScaleAt(u64, f32),
}

/// What one computed step produced.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepOutcome {
    /// Mean loss over the batch.
    pub loss: f32,
    /// Global gradient L2 norm before clipping.
    pub grad_norm: f32,
    /// Whether the gradient was finite (a non-finite one must not be pushed).
    pub finite: bool,
}

/// The encode half of a worker, for gradients computed anywhere (the built-in models through [`StepEngine`], a
/// PyTorch module through the Python package): clipping by global norm, per-shard error feedback and encoding into
/// codec frames, and the residual policy for pushes the shards did not apply. Allocation-free in steady state.
pub struct PushEncoder {
    rank: u32,
    shards: Vec<Range<usize>>,
    /// Streamed fragments (`train.fragments`; 1: whole shards).
    fragments: u32,
    /// One residual per (shard, fragment), at `shard * fragments + fragment`.
    feedback: Option<Vec<ErrorFeedback>>,
    encoder: Encoder,
    clip_norm: f32,
    /// Decodes undelivered frames for [`PushEncoder::credit_undelivered`] (sized on first use).
    decoder: Option<(Decoder, Vec<f32>)>,
}

impl PushEncoder {
    /// An encoder for `rank`'s updates of a model split into `shards` ranges; `clip_norm` 0 disables clipping.
    pub fn new(
        rank: u32,
        shards: Vec<Range<usize>>,
        codec: CodecConfig,
        error_feedback: bool,
        clip_norm: f32,
    ) -> Result<Self, CodecError> {
        let feedback =
            error_feedback.then(|| shards.iter().map(|r| ErrorFeedback::new(r.len())).collect());
        Ok(Self {
            rank,
            shards,
            fragments: 1,
            feedback,
            encoder: Encoder::new(codec)?,
            clip_norm,
            decoder: None,
        })
    }

    /// Streams the model in `fragments` parts per shard (`train.fragments`): each (shard, fragment) keeps a residual
    /// of its own, and [`PushEncoder::encode_part_in_place`] encodes one part. Clears every residual.
    pub fn with_fragments(mut self, fragments: u32) -> Self {
        let f = fragments.max(1);
        self.fragments = f;
        if self.feedback.is_some() {
            self.feedback = Some(
                self.shards
                    .iter()
                    .flat_map(|r| {
                        (0..f).map(move |c| {
                            ErrorFeedback::new(fragment_part(r.len(), u64::from(c), f).len())
                        })
                    })
                    .collect(),
            );
        }
        self
    }

    /// The absolute range of the model that push round `clock` carries for shard `k` (the whole shard with one
    /// fragment).
    pub fn part(&self, k: usize, clock: u64) -> Range<usize> {
        let r = &self.shards[k];
        let p = fragment_part(r.len(), clock, self.fragments);
        r.start + p.start..r.start + p.end
    }

    /// The index of `(shard k, round clock)`'s residual.
    fn slot(&self, k: usize, clock: u64) -> usize {
        k * self.fragments as usize + (clock % u64::from(self.fragments)) as usize
    }

    /// Checks that `loss` and `grad` are finite and clips `grad` in place to the configured global norm; returns
    /// the norm before clipping and whether the gradient may be pushed.
    pub fn clip(&self, loss: f32, grad: &mut [f32]) -> (f32, bool) {
        let norm = sum_of_squares(grad).sqrt() as f32;
        let finite = loss.is_finite() && norm.is_finite();
        if finite && self.clip_norm > 0.0 && norm > self.clip_norm {
            let k = self.clip_norm / norm;
            grad.iter_mut().for_each(|g| *g *= k);
        }
        (norm, finite)
    }

    /// Encodes `update`'s part for shard `k` (with error feedback when enabled) into `out`; `step` seeds the
    /// stochastic rounding.
    pub fn encode_shard(
        &mut self,
        k: usize,
        step: u64,
        update: &[f32],
        out: &mut Vec<u8>,
    ) -> Result<(), CodecError> {
        let r = self.part(k, 0);
        let seed = seed_for(self.rank, step, k as u32);
        match self.feedback.as_mut() {
            Some(fb) => {
                fb[k * self.fragments as usize].encode(&mut self.encoder, &update[r], seed, out)
            }
            None => self.encoder.encode(&update[r], seed, out),
        }
    }

    /// [`PushEncoder::encode_shard`] with `update` as scratch (no buffer of the shard's size is kept): on return
    /// shard `k`'s part of `update` holds what was encoded (the update plus the residual, with error feedback).
    pub fn encode_shard_in_place(
        &mut self,
        k: usize,
        step: u64,
        update: &mut [f32],
        out: &mut Vec<u8>,
    ) -> Result<(), CodecError> {
        self.encode_part_in_place(k, 0, step, update, out)
    }

    /// [`PushEncoder::encode_shard_in_place`] for streamed fragments: encodes only the part of shard `k` that push
    /// round `clock` carries ([`PushEncoder::part`]), with that part's residual.
    pub fn encode_part_in_place(
        &mut self,
        k: usize,
        clock: u64,
        step: u64,
        update: &mut [f32],
        out: &mut Vec<u8>,
    ) -> Result<(), CodecError> {
        let r = self.part(k, clock);
        let slot = self.slot(k, clock);
        let seed = seed_for(self.rank, step, k as u32);
        match self.feedback.as_mut() {
            Some(fb) => fb[slot].encode_in_place(&mut self.encoder, &mut update[r], seed, out),
            None => self.encoder.encode(&update[r], seed, out),
        }
    }

    /// The residual policy for a push that shard `k` did not apply although its gradient was good (the round was
    /// jumped over by a rejoin, or refused for a reason other than its values): the frame's decoded values go back
    /// into shard k's residual, so the next push carries them. Without error feedback the update is dropped. A push
    /// refused for its values (non-finite, norm spike) is not credited: that gradient is discarded.
    pub fn credit_undelivered(&mut self, k: usize, frame: &[u8]) -> Result<(), CodecError> {
        self.credit_undelivered_part(k, 0, frame)
    }

    /// [`PushEncoder::credit_undelivered`] for the push of round `clock` (with streamed fragments, its part's
    /// residual is credited).
    pub fn credit_undelivered_part(
        &mut self,
        k: usize,
        clock: u64,
        frame: &[u8],
    ) -> Result<(), CodecError> {
        let len = self.part(k, clock).len();
        let slot = self.slot(k, clock);
        let Some(fb) = self.feedback.as_mut() else {
            return Ok(());
        };
        let max = self.shards.iter().map(|r| r.len()).max().unwrap_or(0);
        let (decoder, out) = self
            .decoder
            .get_or_insert_with(|| (Decoder::new(max), vec![0.0; max]));
        decoder.decode(frame, &mut out[..len])?;
        fb[slot].credit(&out[..len])
    }

    /// Clears the error-feedback residuals of the listed shards (they rolled back: what they held was built on a
    /// discarded trajectory).
    pub fn reset(&mut self, shards: &[usize]) {
        let f = self.fragments as usize;
        if let Some(fb) = self.feedback.as_mut() {
            for &k in shards {
                for r in fb.iter_mut().skip(k * f).take(f) {
                    r.reset();
                }
            }
        }
    }

    /// The error-feedback residual of shard `k` (of its first fragment with streamed fragments; empty without error
    /// feedback).
    pub fn residual(&self, k: usize) -> &[f32] {
        let slot = self.slot(k, 0);
        self.feedback.as_ref().map_or(&[], |fb| fb[slot].residual())
    }

    /// Number of shards.
    pub fn shards(&self) -> usize {
        self.shards.len()
    }
}

/// The compute-and-encode half of a worker.
pub struct StepEngine {
    model: Box<dyn Model>,
    grad: Vec<f32>,
    coder: PushEncoder,
    faults: Vec<GradientFault>,
    /// The inner optimizer of local-step rounds (its state persists across rounds, as in DiLoCo).
    inner: Option<Optimizer>,
}

impl StepEngine {
    /// An engine for `model` whose parameters are split into `shards` ranges.
    pub fn new(
        model: Box<dyn Model>,
        rank: u32,
        shards: Vec<Range<usize>>,
        codec: CodecConfig,
        error_feedback: bool,
        clip_norm: f32,
    ) -> Result<Self, CodecError> {
        let len = model.layout().len();
        Ok(Self {
            model,
            grad: vec![0.0; len],
            coder: PushEncoder::new(rank, shards, codec, error_feedback, clip_norm)?,
            faults: Vec::new(),
            inner: None,
        })
    }

    /// Local-step rounds: inner steps apply `cfg` to the worker's own copy of the parameters.
    pub fn with_inner(mut self, cfg: &OptimizerConfig) -> Self {
        let exempt = self
            .model
            .layout()
            .decay_exempt(0..self.grad.len(), cfg.decay);
        self.inner = Some(Optimizer::new(cfg, self.grad.len()).with_decay_exempt(exempt));
        self
    }

    /// One inner step: the inner optimizer applies the last computed gradient to `params` (a no-op without one).
    pub fn inner_step(&mut self, params: &mut [f32]) {
        if let Some(opt) = self.inner.as_mut() {
            opt.step(params, &self.grad, 1.0);
        }
    }

    /// Makes the pseudo-gradient `start − end` of a local-step round the gradient that [`StepEngine::encode_shard`]
    /// encodes; returns whether it is finite.
    pub fn set_pseudo_gradient(&mut self, start: &[f32], end: &[f32]) -> bool {
        for ((g, s), e) in self.grad.iter_mut().zip(start).zip(end) {
            *g = s - e;
        }
        sum_of_squares(&self.grad).is_finite()
    }

    /// Streams the model in `fragments` parts per shard (`train.fragments`; see [`PushEncoder::with_fragments`]).
    pub fn with_fragments(mut self, fragments: u32) -> Self {
        self.coder = self.coder.with_fragments(fragments);
        self
    }

    /// The gradient buffer, for a caller that writes the update to encode itself (a streamed fragment's
    /// pseudo-gradient, [`crate::fragments::FragmentStream::pseudo_gradient`]).
    pub fn grad_mut(&mut self) -> &mut [f32] {
        &mut self.grad
    }

    /// Encodes shard `k`'s part of push round `clock` from the gradient buffer ([`PushEncoder::encode_part_in_place`]).
    pub fn encode_part(
        &mut self,
        k: usize,
        clock: u64,
        step: u64,
        out: &mut Vec<u8>,
    ) -> Result<(), CodecError> {
        self.coder
            .encode_part_in_place(k, clock, step, &mut self.grad, out)
    }

    /// [`PushEncoder::credit_undelivered_part`] for this engine's pushes.
    pub fn credit_undelivered_part(
        &mut self,
        k: usize,
        clock: u64,
        frame: &[u8],
    ) -> Result<(), CodecError> {
        self.coder.credit_undelivered_part(k, clock, frame)
    }

    /// Applies the [`GradientFault::PushScaleAt`] faults of `steps` to the update about to be encoded.
    pub fn fault_push(&mut self, steps: std::ops::Range<u64>) {
        for f in &self.faults {
            if let GradientFault::PushScaleAt(s, k) = *f {
                if steps.contains(&s) {
                    self.grad.iter_mut().for_each(|g| *g *= k);
                }
            }
        }
    }

    /// The listed shards rolled back after a loss spike: what was built on the discarded trajectory goes. Their
    /// error-feedback residuals are cleared, and the inner optimizer of local-step rounds starts afresh (zero
    /// moments, update count 0, so Adam's bias correction holds and its warm-up runs again).
    pub fn reset_trajectory(&mut self, shards: &[usize]) {
        self.coder.reset(shards);
        if let Some(opt) = self.inner.as_mut() {
            let zeros = opt.slots().iter().map(|s| vec![0.0; s.len()]).collect();
            // The same slot count and lengths as the optimizer's own: restore cannot refuse them.
            let _ = opt.restore(0, zeros);
        }
    }

    /// Injects faults at given steps.
    pub fn with_faults(mut self, faults: Vec<GradientFault>) -> Self {
        self.faults = faults;
        self
    }

    /// The model.
    pub fn model_mut(&mut self) -> &mut dyn Model {
        self.model.as_mut()
    }

    /// The last computed (clipped) gradient, until [`StepEngine::encode_shard`] adds a shard's residual to its part.
    pub fn grad(&self) -> &[f32] {
        &self.grad
    }

    /// Computes loss and gradient at `params` on the batch, checks it is finite and clips it.
    pub fn compute(&mut self, step: u64, params: &[f32], x: &[f32], y: &[u32]) -> StepOutcome {
        let loss = self.model.loss_and_grad(params, x, y, &mut self.grad);
        for f in &self.faults {
            match *f {
                GradientFault::NanAt(s) if s == step => self.grad[0] = f32::NAN,
                GradientFault::ScaleAt(s, k) if s == step => {
                    self.grad.iter_mut().for_each(|g| *g *= k)
                }
                _ => {}
            }
        }
        let (norm, finite) = self.coder.clip(loss, &mut self.grad);
        StepOutcome {
            loss,
            grad_norm: norm,
            finite,
        }
    }

    /// Encodes the computed gradient's part for shard `k` (with error feedback when enabled) into `out`. The
    /// engine's gradient buffer is the encoder's scratch: afterwards shard `k`'s part of [`StepEngine::grad`] holds
    /// the values encoded (gradient plus residual).
    pub fn encode_shard(
        &mut self,
        k: usize,
        step: u64,
        out: &mut Vec<u8>,
    ) -> Result<(), CodecError> {
        self.coder
            .encode_shard_in_place(k, step, &mut self.grad, out)
    }

    /// [`PushEncoder::credit_undelivered`] for this engine's pushes.
    pub fn credit_undelivered(&mut self, k: usize, frame: &[u8]) -> Result<(), CodecError> {
        self.coder.credit_undelivered(k, frame)
    }

    /// The error-feedback residual of shard `k` (empty without error feedback).
    pub fn residual(&self, k: usize) -> &[f32] {
        self.coder.residual(k)
    }

    /// Number of shards.
    pub fn shards(&self) -> usize {
        self.coder.shards()
    }
}

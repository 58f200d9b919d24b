//! The optimizer math applied to a parameter range (by a shard, or by a worker between local-step rounds): update rules, their state slots and the learning-rate
//! schedule. Pure and deterministic: no allocation, no I/O, no clocks; the same inputs give the same bits on a given
//! build (the kernels use plain IEEE mul/add/div/sqrt with no fused multiply-add, so the AVX2 path and the portable
//! path produce identical results).
//!
//! # Update rules
//! With `t` the 1-based number of the update being applied (`steps() + 1`), `lr = lr_at(t) · lr_scale`, `wd` the
//! weight decay, `μ` the momentum and `g' = g + wd·w` (L2 decay folded into the gradient):
//! - **SGD:** `w ← w − lr·g'`.
//! - **Momentum** (PyTorch convention, no dampening): `b ← μ·b + g'`; `w ← w − lr·b`.
//! - **Nesterov:** `b ← μ·b + g'`; `w ← w − lr·(g' + μ·b)`.
//! - **Adam:** `m ← β1·m + (1−β1)·g'`; `v ← β2·v + (1−β2)·g'²`;
//!   `w ← w − (lr / (1−β1ᵗ)) · m / (√v / √(1−β2ᵗ) + eps)` (bias-corrected, eps outside the root as in PyTorch).
//! - **AdamW** (decoupled): `w ← w·(1 − lr·wd)`, then Adam on the raw `g` (no L2 term).
//! - **Adagrad:** `s ← s + g'²`; `w ← w − lr·g' / (√s + eps)`.
//!
//! # Schedule
//! [`Optimizer::lr_at`] maps the 1-based update number `t` to a learning rate (computed in f64, returned as f32):
//! - `Constant`: `lr`.
//! - `WarmupCosine { warmup, total, min_ratio }`: `lr·t/warmup` for `t < warmup` (so `lr_at(0) = 0` and update
//!   `warmup` is the first at full lr); `min_ratio·lr` for `t ≥ total`; in between
//!   `lr·(min_ratio + (1 − min_ratio)·(1 + cos(π·(t − warmup)/(total − warmup)))/2)`.
//! - `Step { every, gamma }`: `lr·gamma^⌊t/every⌋` (`every = 0` means constant), so update `every` is the first
//!   decayed one.
//!
//! # State slots
//! SGD has none; momentum and Nesterov one (the buffer `b`); Adam and AdamW two (`m`, `v`); Adagrad one (the sum
//! `s`). [`Optimizer::slots`] exposes them for checkpoints and [`Optimizer::restore`] puts them back.
//!
//! # Finite state
//! [`Optimizer::try_step`] applies an update only if every new weight and slot value is finite, and otherwise
//! changes nothing (check, then commit); the shards step with it, so one push cannot leave NaN or ∞ in the state.
//!
//! # Chunks
//! [`Optimizer::try_step_part_on`] runs both passes in chunks on a [`ChunkPool`] (a shard's threads). Every rule is
//! per element and the check is an AND, so no result depends on the chunks or on which thread ran them.

use std::f64::consts::PI;

use std::ops::Range;

use crate::chunk_pool::ChunkPool;
use crate::config::{OptimizerConfig, OptimizerKind, Schedule};

/// Errors restoring optimizer state.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OptimError {
    /// The restored state has the wrong number of slots for this optimizer kind.
    #[error("optimizer state has {found} slots, expected {expected}")]
    SlotCount {
        /// Slots this optimizer kind keeps.
        expected: usize,
        /// Slots offered.
        found: usize,
    },
    /// A restored slot does not cover exactly the optimizer's range.
    #[error("optimizer slot {slot} has {found} values, expected {expected}")]
    SlotLength {
        /// Index of the offending slot.
        slot: usize,
        /// The range length.
        expected: usize,
        /// Values offered.
        found: usize,
    },
    /// The update would leave a weight or a state slot NaN or ±∞; nothing was changed.
    #[error("the update would leave the weights or the optimizer state non-finite")]
    NonFiniteState,
}

/// The optimizer of one shard's range: its hyper-parameters, its step count and its state slots.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Optimizer {
    /// Settings come from the local configuration, never from a transferred state (see [`Optimizer::adopt_settings`]).
    #[serde(skip)]
    cfg: OptimizerConfig,
    len: usize,
    steps: u64,
    slots: Vec<Vec<f32>>,
    /// Which kernels this process runs: a property of the machine, never of a transferred state.
    #[serde(skip)]
    simd: bool,
    /// Sub-ranges (relative to the range, sorted, disjoint) where weight decay is not applied.
    #[serde(skip)]
    exempt: Vec<Range<usize>>,
}

/// Number of state slots kept by an optimizer kind.
pub fn slot_count(kind: OptimizerKind) -> usize {
    match kind {
        OptimizerKind::Sgd => 0,
        OptimizerKind::Momentum | OptimizerKind::Nesterov | OptimizerKind::Adagrad => 1,
        OptimizerKind::Adam | OptimizerKind::Adamw => 2,
    }
}

impl Optimizer {
    /// An optimizer for a range of `len` parameters with zeroed state and step count 0.
    pub fn new(cfg: &OptimizerConfig, len: usize) -> Self {
        Self {
            cfg: cfg.clone(),
            len,
            steps: 0,
            slots: vec![vec![0.0; len]; slot_count(cfg.kind)],
            simd: simd_available(),
            exempt: Vec::new(),
        }
    }

    /// Exempts `ranges` (relative to the range; clipped to it, then sorted and merged) from weight decay: nanoGPT's
    /// grouping, where norms and biases are not decayed ([`crate::layout::Layout::decay_exempt`]).
    pub fn with_decay_exempt(mut self, ranges: Vec<Range<usize>>) -> Self {
        let mut r: Vec<Range<usize>> = ranges
            .into_iter()
            .map(|x| x.start.min(self.len)..x.end.min(self.len))
            .filter(|x| !x.is_empty())
            .collect();
        r.sort_by_key(|x| x.start);
        let mut merged: Vec<Range<usize>> = Vec::with_capacity(r.len());
        for x in r {
            match merged.last_mut() {
                Some(last) if x.start <= last.end => last.end = last.end.max(x.end),
                _ => merged.push(x),
            }
        }
        self.exempt = merged;
        self
    }

    /// The sub-ranges exempt from weight decay.
    pub fn decay_exempt(&self) -> &[Range<usize>] {
        &self.exempt
    }

    /// Completes a decoded optimizer (a peer's state image carries only the step count and the state slots) with
    /// `local`'s settings, decay exemptions and kernels, after checking that the slots fit them: as many as the
    /// kind keeps, each of `local`'s length. On an error nothing changes.
    pub fn adopt_settings(&mut self, local: &Optimizer) -> Result<(), String> {
        if self.len != local.len
            || self.slots.len() != slot_count(local.cfg.kind)
            || self.slots.iter().any(|s| s.len() != local.len)
        {
            return Err(format!(
                "optimizer state of {} slots over {} parameters where {} over {} are due",
                self.slots.len(),
                self.len,
                slot_count(local.cfg.kind),
                local.len
            ));
        }
        self.cfg = local.cfg.clone();
        self.exempt = local.exempt.clone();
        self.simd = local.simd;
        Ok(())
    }

    /// Forces the portable kernels (no runtime-detected AVX2); results are identical, only speed differs.
    pub fn with_portable_kernels(mut self) -> Self {
        self.simd = false;
        self
    }

    /// The configuration this optimizer applies.
    pub fn config(&self) -> &OptimizerConfig {
        &self.cfg
    }

    /// Number of parameters covered.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the range is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// One update: `w ← step(w, g)` with the scheduled lr multiplied by `lr_scale` (1.0 unless staleness-aware).
    /// Advances the step count. Allocation-free.
    ///
    /// # Panics
    /// When `weights` or `grad` is not exactly [`Optimizer::len`] long (a caller bug: frames are length-checked
    /// before they reach the optimizer).
    pub fn step(&mut self, weights: &mut [f32], grad: &[f32], lr_scale: f32) {
        self.run(0..self.len, weights, grad, lr_scale, Pass::Apply);
        self.steps = self.steps.saturating_add(1);
    }

    /// [`Optimizer::step`], unless it would leave a weight or a state slot NaN or ±∞: then it refuses with
    /// [`OptimError::NonFiniteState`] and changes nothing (weights, slots, step count). Check then commit: a first
    /// pass computes every element's new values and only tests them, the second is [`Optimizer::step`]'s own pass;
    /// both run the same arithmetic in the same order, so what the first pass saw finite is what the second writes.
    /// No copy of the state is made. Allocation-free.
    ///
    /// # Panics
    /// As [`Optimizer::step`].
    pub fn try_step(
        &mut self,
        weights: &mut [f32],
        grad: &[f32],
        lr_scale: f32,
    ) -> Result<(), OptimError> {
        if !self.run(0..self.len, weights, grad, lr_scale, Pass::Check) {
            return Err(OptimError::NonFiniteState);
        }
        self.step(weights, grad, lr_scale);
        Ok(())
    }

    /// [`Optimizer::try_step`] on `part` of the range alone (a streamed fragment, `train.fragments`): `weights` is the
    /// whole range, `grad` holds `part`'s values; weights and state outside `part` are untouched. The step count
    /// advances as for a whole step (it counts pushes applied). Refuses with [`OptimError::NonFiniteState`] and
    /// changes nothing as `try_step` does. Allocation-free.
    ///
    /// # Panics
    /// When `weights` is not [`Optimizer::len`] long, `part` does not lie in it, or `grad` is not `part` long (caller
    /// bugs: the shard derives `part` from its own length and length-checks the frame).
    pub fn try_step_part(
        &mut self,
        part: Range<usize>,
        weights: &mut [f32],
        grad: &[f32],
        lr_scale: f32,
    ) -> Result<(), OptimError> {
        if !self.run(part.clone(), weights, grad, lr_scale, Pass::Check) {
            return Err(OptimError::NonFiniteState);
        }
        self.run(part, weights, grad, lr_scale, Pass::Apply);
        self.steps = self.steps.saturating_add(1);
        Ok(())
    }

    /// [`Optimizer::try_step_part`] with `part` cut into chunks of `chunk` values that run as jobs on `pool`. Every
    /// element's arithmetic is the one `try_step_part` does, and the check is an AND over the chunks, so the result
    /// is bit for bit `try_step_part`'s whatever the pool's threads and the chunk size. Allocates one small list of
    /// chunks per pass.
    ///
    /// # Panics
    /// As [`Optimizer::try_step_part`].
    pub fn try_step_part_on(
        &mut self,
        pool: &ChunkPool,
        chunk: usize,
        part: Range<usize>,
        weights: &mut [f32],
        grad: &[f32],
        lr_scale: f32,
    ) -> Result<(), OptimError> {
        if !self.run_chunked(
            pool,
            chunk,
            part.clone(),
            weights,
            grad,
            lr_scale,
            Pass::Check,
        ) {
            return Err(OptimError::NonFiniteState);
        }
        self.run_chunked(pool, chunk, part, weights, grad, lr_scale, Pass::Apply);
        self.steps = self.steps.saturating_add(1);
        Ok(())
    }

    /// One pass of update `steps() + 1` over `part` of the range (`grad` holds `part`'s values): [`Pass::Apply`]
    /// writes it (and returns true), [`Pass::Check`] writes nothing and returns whether every new weight and slot
    /// value would be finite.
    fn run(
        &mut self,
        part: Range<usize>,
        weights: &mut [f32],
        grad: &[f32],
        lr_scale: f32,
        pass: Pass,
    ) -> bool {
        assert_eq!(weights.len(), self.len, "weights length != optimizer range");
        assert!(part.end <= self.len, "part outside the optimizer range");
        assert_eq!(grad.len(), part.len(), "gradient length != part");
        let t = self.steps.saturating_add(1);
        let rule = Rule {
            cfg: &self.cfg,
            simd: self.simd,
            exempt: &self.exempt,
            lr: self.lr_at(t) * lr_scale,
            t,
        };
        let slots = slot_parts(&mut self.slots, part.clone());
        rule.run_range(part.clone(), &mut weights[part], grad, slots, pass)
    }

    /// [`Optimizer::run`] over `part` in chunks of `chunk` values, one job each on `pool`.
    #[allow(clippy::too_many_arguments)]
    fn run_chunked(
        &mut self,
        pool: &ChunkPool,
        chunk: usize,
        part: Range<usize>,
        weights: &mut [f32],
        grad: &[f32],
        lr_scale: f32,
        pass: Pass,
    ) -> bool {
        assert_eq!(weights.len(), self.len, "weights length != optimizer range");
        assert!(part.end <= self.len, "part outside the optimizer range");
        assert_eq!(grad.len(), part.len(), "gradient length != part");
        let chunk = chunk.max(1);
        let t = self.steps.saturating_add(1);
        let rule = Rule {
            cfg: &self.cfg,
            simd: self.simd,
            exempt: &self.exempt,
            lr: self.lr_at(t) * lr_scale,
            t,
        };
        let [s0, s1] = slot_parts(&mut self.slots, part.clone());
        let mut s0 = s0.chunks_mut(chunk);
        let mut s1 = s1.chunks_mut(chunk);
        let jobs: Vec<StepChunk<'_>> = weights[part.clone()]
            .chunks_mut(chunk)
            .zip(grad.chunks(chunk))
            .enumerate()
            .map(|(i, (w, g))| StepChunk {
                start: part.start + i * chunk,
                w,
                g,
                // An empty slot yields no chunk: it stays empty for every chunk.
                slots: [s0.next().unwrap_or_default(), s1.next().unwrap_or_default()],
            })
            .collect();
        pool.map(jobs, |c| {
            let range = c.start..c.start + c.w.len();
            rule.run_range(range, c.w, c.g, c.slots, pass)
        })
        .into_iter()
        .all(|ok| ok)
    }

    /// Updates applied so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The scheduled learning rate of update number `step` (1-based; see the module doc).
    pub fn lr_at(&self, step: u64) -> f32 {
        scheduled_lr(self.cfg.lr, &self.cfg.schedule, step) as f32
    }

    /// The state slots (momentum buffer / m, v / accumulator), empty for SGD.
    pub fn slots(&self) -> &[Vec<f32>] {
        &self.slots
    }

    /// Replaces the step count and state (e.g. from a checkpoint) after checking slot count and lengths.
    pub fn restore(&mut self, steps: u64, slots: Vec<Vec<f32>>) -> Result<(), OptimError> {
        let expected = slot_count(self.cfg.kind);
        if slots.len() != expected {
            return Err(OptimError::SlotCount {
                expected,
                found: slots.len(),
            });
        }
        if let Some((slot, s)) = slots.iter().enumerate().find(|(_, s)| s.len() != self.len) {
            return Err(OptimError::SlotLength {
                slot,
                expected: self.len,
                found: s.len(),
            });
        }
        self.steps = steps;
        self.slots = slots;
        Ok(())
    }

    /// Checks the state's values as a peer or a file could have forged them: every slot value finite, and the
    /// slots that accumulate squares (Adam's and AdamW's `v`, Adagrad's `s`) never negative (a negative one makes
    /// every later step non-finite).
    pub fn check_state(&self) -> Result<(), String> {
        let squares = match self.cfg.kind {
            OptimizerKind::Adam | OptimizerKind::Adamw => Some(1),
            OptimizerKind::Adagrad => Some(0),
            _ => None,
        };
        for (k, slot) in self.slots.iter().enumerate() {
            let bad = if squares == Some(k) {
                slot.iter().position(|x| !(x.is_finite() && *x >= 0.0))
            } else {
                slot.iter().position(|x| !x.is_finite())
            };
            if let Some(i) = bad {
                return Err(format!("optimizer slot {k}[{i}] is {}", slot[i]));
            }
        }
        Ok(())
    }

    /// State footprint in bytes per parameter (0 for SGD, 4 for momentum/Nesterov/Adagrad, 8 for Adam/AdamW).
    pub fn bytes_per_param(&self) -> usize {
        slot_count(self.cfg.kind) * std::mem::size_of::<f32>()
    }
}

/// The state slots' values over `part` as two slices (an absent slot is empty).
fn slot_parts(slots: &mut [Vec<f32>], part: Range<usize>) -> [&mut [f32]; 2] {
    match slots {
        [] => [&mut [], &mut []],
        [a] => [&mut a[part], &mut []],
        [a, b, ..] => [&mut a[part.clone()], &mut b[part]],
    }
}

/// One chunk of a chunked pass: its first index in the range, its weights, gradient and slot values.
struct StepChunk<'a> {
    start: usize,
    w: &'a mut [f32],
    g: &'a [f32],
    slots: [&'a mut [f32]; 2],
}

/// Update `t` of an optimizer: its settings, kernels, decay exemptions and learning rate, applied to any sub-range.
#[derive(Clone, Copy)]
struct Rule<'a> {
    cfg: &'a OptimizerConfig,
    simd: bool,
    exempt: &'a [Range<usize>],
    lr: f32,
    t: u64,
}

impl Rule<'_> {
    /// One pass over `range` of the optimizer's range: `w`, `g` and the slots hold exactly `range`'s values. Decayed
    /// and exempt segments alternate in order; each is one pass of the same kernels.
    fn run_range(
        &self,
        range: Range<usize>,
        w: &mut [f32],
        g: &[f32],
        slots: [&mut [f32]; 2],
        pass: Pass,
    ) -> bool {
        let wd = self.cfg.weight_decay;
        let [s0, s1] = slots;
        if self.exempt.is_empty() || wd == 0.0 {
            return self.run_segment(w, g, s0, s1, wd, pass);
        }
        let base = range.start;
        let mut ok = true;
        let mut at = range.start;
        let mut seg = |from: usize, to: usize, wd: f32, s0: &mut [f32], s1: &mut [f32]| {
            let r = from - base..to - base;
            let (s0, s1) = (sub(s0, r.clone()), sub(s1, r.clone()));
            self.run_segment(&mut w[r.clone()], &g[r], s0, s1, wd, pass)
        };
        for e in self.exempt {
            let e = e.start.max(range.start)..e.end.min(range.end);
            if e.start >= e.end {
                continue;
            }
            if at < e.start {
                ok &= seg(at, e.start, wd, s0, s1);
            }
            ok &= seg(e.start, e.end, 0.0, s0, s1);
            at = e.end;
        }
        if at < range.end {
            ok &= seg(at, range.end, wd, s0, s1);
        }
        ok
    }

    /// One pass of the kernels over equal-length slices with weight decay `wd`.
    fn run_segment(
        &self,
        weights: &mut [f32],
        grad: &[f32],
        s0: &mut [f32],
        s1: &mut [f32],
        wd: f32,
        pass: Pass,
    ) -> bool {
        let c = self.cfg;
        let (simd, lr) = (self.simd, self.lr);
        let check = pass == Pass::Check;
        match c.kind {
            OptimizerKind::Sgd if check => dispatch(simd, || sgd_finite(weights, grad, lr, wd)),
            OptimizerKind::Sgd => {
                dispatch(simd, || sgd(weights, grad, lr, wd));
                true
            }
            OptimizerKind::Momentum | OptimizerKind::Nesterov => {
                let nesterov = c.kind == OptimizerKind::Nesterov;
                let (mu, buf) = (c.momentum, s0);
                if check {
                    dispatch(simd, || {
                        momentum_finite(weights, grad, buf, lr, mu, wd, nesterov)
                    })
                } else {
                    dispatch(simd, || momentum(weights, grad, buf, lr, mu, wd, nesterov));
                    true
                }
            }
            OptimizerKind::Adam | OptimizerKind::Adamw => {
                let k = AdamConsts::new(c, lr, self.t, wd);
                let (m, v) = (s0, s1);
                if check {
                    dispatch(simd, || adam_finite(weights, grad, m, v, &k))
                } else {
                    dispatch(simd, || adam(weights, grad, m, v, &k));
                    true
                }
            }
            OptimizerKind::Adagrad => {
                let (eps, s) = (c.eps, s0);
                if check {
                    dispatch(simd, || adagrad_finite(weights, grad, s, lr, wd, eps))
                } else {
                    dispatch(simd, || adagrad(weights, grad, s, lr, wd, eps));
                    true
                }
            }
        }
    }
}

/// `s[r]`, or `s` itself when it is an absent (empty) slot.
fn sub(s: &mut [f32], r: Range<usize>) -> &mut [f32] {
    if s.is_empty() {
        s
    } else {
        &mut s[r]
    }
}

/// What a pass over the range does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pass {
    /// Compute the new values and only test that they are finite.
    Check,
    /// Write the new values.
    Apply,
}

/// The learning-rate schedule as a pure function of the base lr and the 1-based update number (see the module doc).
pub fn scheduled_lr(lr: f32, schedule: &Schedule, t: u64) -> f64 {
    let lr = f64::from(lr);
    match *schedule {
        Schedule::Constant => lr,
        Schedule::WarmupCosine {
            warmup,
            total,
            min_ratio,
        } => {
            let floor = f64::from(min_ratio);
            if t < warmup {
                lr * t as f64 / warmup as f64
            } else if t >= total {
                lr * floor
            } else {
                // Here warmup <= t < total, so the span is positive.
                let p = (t - warmup) as f64 / (total - warmup) as f64;
                lr * (floor + (1.0 - floor) * 0.5 * (1.0 + (PI * p).cos()))
            }
        }
        Schedule::Step { every, gamma } => match t.checked_div(every) {
            Some(periods) => lr * powu(f64::from(gamma), periods),
            None => lr,
        },
    }
}

/// `x^n` by binary exponentiation: plain IEEE multiplies, so it does not depend on the platform's `pow`.
fn powu(mut x: f64, mut n: u64) -> f64 {
    let mut acc = 1.0;
    while n > 0 {
        if n & 1 == 1 {
            acc *= x;
        }
        x *= x;
        n >>= 1;
    }
    acc
}

/// Adam's per-update scalars, hoisted out of the element loop.
#[derive(Debug, Clone, Copy)]
struct AdamConsts {
    /// L2 decay folded into the gradient (Adam) or 0 (AdamW).
    l2: f32,
    /// Multiplier applied to w before the step: `1 − lr·wd` (AdamW) or 1 (Adam).
    decay: f32,
    b1: f32,
    one_minus_b1: f32,
    b2: f32,
    one_minus_b2: f32,
    /// `lr / (1 − β1ᵗ)`.
    step_size: f32,
    /// `1 / √(1 − β2ᵗ)`.
    inv_sqrt_bc2: f32,
    eps: f32,
}

impl AdamConsts {
    fn new(c: &OptimizerConfig, lr: f32, t: u64, wd: f32) -> Self {
        let bc1 = 1.0 - powu(f64::from(c.beta1), t);
        let bc2 = 1.0 - powu(f64::from(c.beta2), t);
        let (l2, decay) = if c.kind == OptimizerKind::Adamw {
            (0.0, 1.0 - lr * wd)
        } else {
            (wd, 1.0)
        };
        Self {
            l2,
            decay,
            b1: c.beta1,
            one_minus_b1: 1.0 - c.beta1,
            b2: c.beta2,
            one_minus_b2: 1.0 - c.beta2,
            step_size: (f64::from(lr) / bc1) as f32,
            inv_sqrt_bc2: (1.0 / bc2.sqrt()) as f32,
            eps: c.eps,
        }
    }
}

/// Whether the AVX2 kernels can run on this CPU.
fn simd_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Runs `f` compiled for AVX2 when `simd` (checked at construction) or as built otherwise. AVX2 here only widens the
/// vectors: no FMA is enabled, so both paths round identically.
#[inline(always)]
fn dispatch<R, F: FnOnce() -> R>(simd: bool, f: F) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2")]
        fn with_avx2<R, F: FnOnce() -> R>(f: F) -> R {
            f()
        }
        if simd {
            // SAFETY: `simd` is true only when `is_x86_feature_detected!("avx2")` said so for this CPU.
            return unsafe { with_avx2(f) };
        }
    }
    let _ = simd;
    f()
}

/// Walks equal-length slices element by element, binding each `mut` name to `&mut f32` and each `ref` name to
/// `f32`. A single zipped loop over `&mut` slices (which cannot alias) is what LLVM's loop vectorizer handles best:
/// it emits full-width vector code with a scalar tail. (Fixed 8-lane chunks with an inner loop were measured to get
/// vectorized across chunks instead, with strided shuffles, at half the speed.) All slices must have the same length;
/// the callers re-slice them to the weights' length first.
macro_rules! zip_lanes {
    (mut ($m0:ident $(, $m:ident)*) ref ($r0:ident $(, $r:ident)*) $body:block) => {{
        let it = $m0.iter_mut()$(.zip($m.iter_mut()))*.zip($r0.iter()$(.zip($r.iter()))*);
        for (zip_lanes!(@pat $m0 $(, $m)*), zip_lanes!(@rpat $r0 $(, $r)*)) in it {
            $(let $r = *$r;)*
            let $r0 = *$r0;
            $body
        }
    }};
    (@pat $a:ident) => { $a };
    (@pat $a:ident, $b:ident) => { ($a, $b) };
    (@pat $a:ident, $b:ident, $c:ident) => { (($a, $b), $c) };
    (@rpat $a:ident) => { $a };
}

/// Non-zero exactly when `x` is NaN or ±∞ (all exponent bits set): the exponent field plus one carries into the top
/// bit only then. An OR of these over a slice is an integer reduction, which vectorizes where a float or `bool`
/// reduction may not.
#[inline(always)]
fn non_finite_bit(x: f32) -> u32 {
    ((x.to_bits() & 0x7f80_0000) + 0x0080_0000) & 0x8000_0000
}

/// Every kernel below is one per-element function (the update rule of one parameter) walked twice: to write, and
/// to test finiteness without writing (`*_finite`: an OR of [`non_finite_bit`] over the new values). Sharing the
/// function keeps both passes' arithmetic identical.
#[inline(always)]
fn sgd_elem(w: f32, g: f32, lr: f32, wd: f32) -> f32 {
    w - lr * (g + wd * w)
}

#[inline(always)]
fn sgd(w: &mut [f32], g: &[f32], lr: f32, wd: f32) {
    let g = &g[..w.len()];
    zip_lanes!(mut (w) ref (g) {
        *w = sgd_elem(*w, g, lr, wd);
    });
}

#[inline(always)]
fn sgd_finite(w: &[f32], g: &[f32], lr: f32, wd: f32) -> bool {
    let g = &g[..w.len()];
    let mut bad = 0;
    for (&w, &g) in w.iter().zip(g) {
        bad |= non_finite_bit(sgd_elem(w, g, lr, wd));
    }
    bad == 0
}

/// One parameter's momentum (or Nesterov) update: the new `(w, b)`.
#[inline(always)]
fn momentum_elem(w: f32, g: f32, b: f32, lr: f32, mu: f32, wd: f32, nesterov: bool) -> (f32, f32) {
    let gd = g + wd * w;
    let b = mu * b + gd;
    if nesterov {
        (w - lr * (gd + mu * b), b)
    } else {
        (w - lr * b, b)
    }
}

#[inline(always)]
fn momentum(w: &mut [f32], g: &[f32], b: &mut [f32], lr: f32, mu: f32, wd: f32, nesterov: bool) {
    let (g, b) = (&g[..w.len()], &mut b[..w.len()]);
    if nesterov {
        zip_lanes!(mut (w, b) ref (g) {
            (*w, *b) = momentum_elem(*w, g, *b, lr, mu, wd, true);
        });
    } else {
        zip_lanes!(mut (w, b) ref (g) {
            (*w, *b) = momentum_elem(*w, g, *b, lr, mu, wd, false);
        });
    }
}

#[inline(always)]
fn momentum_finite(
    w: &[f32],
    g: &[f32],
    b: &[f32],
    lr: f32,
    mu: f32,
    wd: f32,
    nesterov: bool,
) -> bool {
    let (g, b) = (&g[..w.len()], &b[..w.len()]);
    let mut bad = 0;
    for ((&w, &g), &b) in w.iter().zip(g).zip(b) {
        let (w, b) = momentum_elem(w, g, b, lr, mu, wd, nesterov);
        bad |= non_finite_bit(w) | non_finite_bit(b);
    }
    bad == 0
}

/// One parameter's Adam/AdamW update: the new `(w, m, v)`.
#[inline(always)]
fn adam_elem(w: f32, g: f32, m: f32, v: f32, k: &AdamConsts) -> (f32, f32, f32) {
    let gd = g + k.l2 * w;
    let m = k.b1 * m + k.one_minus_b1 * gd;
    let v = k.b2 * v + k.one_minus_b2 * (gd * gd);
    let denom = v.sqrt() * k.inv_sqrt_bc2 + k.eps;
    (w * k.decay - k.step_size * m / denom, m, v)
}

#[inline(always)]
fn adam(w: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], k: &AdamConsts) {
    let (g, m, v) = (&g[..w.len()], &mut m[..w.len()], &mut v[..w.len()]);
    let k = *k;
    zip_lanes!(mut (w, m, v) ref (g) {
        (*w, *m, *v) = adam_elem(*w, g, *m, *v, &k);
    });
}

#[inline(always)]
fn adam_finite(w: &[f32], g: &[f32], m: &[f32], v: &[f32], k: &AdamConsts) -> bool {
    let (g, m, v) = (&g[..w.len()], &m[..w.len()], &v[..w.len()]);
    let k = *k;
    let mut bad = 0;
    for (((&w, &g), &m), &v) in w.iter().zip(g).zip(m).zip(v) {
        let (w, m, v) = adam_elem(w, g, m, v, &k);
        bad |= non_finite_bit(w) | non_finite_bit(m) | non_finite_bit(v);
    }
    bad == 0
}

/// One parameter's Adagrad update: the new `(w, s)`.
#[inline(always)]
fn adagrad_elem(w: f32, g: f32, s: f32, lr: f32, wd: f32, eps: f32) -> (f32, f32) {
    let gd = g + wd * w;
    let s = s + gd * gd;
    (w - lr * gd / (s.sqrt() + eps), s)
}

#[inline(always)]
fn adagrad(w: &mut [f32], g: &[f32], s: &mut [f32], lr: f32, wd: f32, eps: f32) {
    let (g, s) = (&g[..w.len()], &mut s[..w.len()]);
    zip_lanes!(mut (w, s) ref (g) {
        (*w, *s) = adagrad_elem(*w, g, *s, lr, wd, eps);
    });
}

#[inline(always)]
fn adagrad_finite(w: &[f32], g: &[f32], s: &[f32], lr: f32, wd: f32, eps: f32) -> bool {
    let (g, s) = (&g[..w.len()], &s[..w.len()]);
    let mut bad = 0;
    for ((&w, &g), &s) in w.iter().zip(g).zip(s) {
        let (w, s) = adagrad_elem(w, g, s, lr, wd, eps);
        bad |= non_finite_bit(w) | non_finite_bit(s);
    }
    bad == 0
}

#[cfg(test)]
mod state_tests {
    use super::*;

    #[test]
    fn forged_state_is_refused() {
        let cfg = OptimizerConfig {
            kind: OptimizerKind::Adam,
            ..OptimizerConfig::default()
        };
        let mut opt = Optimizer::new(&cfg, 3);
        opt.restore(0, vec![vec![0.0; 3], vec![0.0, 1.0, 2.0]])
            .unwrap();
        assert!(opt.check_state().is_ok());
        // Adam's second moment at -1 (the hostile seeder's image): every later step would be non-finite.
        opt.restore(0, vec![vec![0.0; 3], vec![0.0, -1.0, 2.0]])
            .unwrap();
        assert!(opt.check_state().unwrap_err().contains("slot 1[1]"));
        opt.restore(0, vec![vec![f32::NAN, 0.0, 0.0], vec![0.0; 3]])
            .unwrap();
        assert!(opt.check_state().unwrap_err().contains("slot 0[0]"));
    }
}

#[cfg(test)]
mod chunk_tests {
    use super::*;
    use crate::testing::noise;

    #[test]
    fn chunked_steps_are_the_whole_steps_bits_at_any_chunk_size_and_thread_count() {
        let n = 1000;
        let part = 100..900;
        let kinds = [
            OptimizerKind::Sgd,
            OptimizerKind::Momentum,
            OptimizerKind::Nesterov,
            OptimizerKind::Adam,
            OptimizerKind::Adamw,
            OptimizerKind::Adagrad,
        ];
        let pools = [
            ChunkPool::serial(),
            ChunkPool::new(2, "tether-test").unwrap(),
            ChunkPool::new(3, "tether-test").unwrap(),
        ];
        for kind in kinds {
            let cfg = OptimizerConfig {
                kind,
                weight_decay: 0.01,
                ..OptimizerConfig::default()
            };
            // Decay-exempt ranges across chunk boundaries and the part's ends.
            let fresh =
                || Optimizer::new(&cfg, n).with_decay_exempt(vec![50..130, 400..433, 880..990]);
            let mut want = fresh();
            let mut w0 = noise(n, 1, 0.1);
            for k in 0..3 {
                want.try_step_part(part.clone(), &mut w0, &noise(800, 10 + k, 1e-2), 0.5)
                    .unwrap();
            }
            for pool in &pools {
                for chunk in [1, 7, 64, 800, 5000] {
                    let mut got = fresh();
                    let mut w = noise(n, 1, 0.1);
                    for k in 0..3 {
                        got.try_step_part_on(
                            pool,
                            chunk,
                            part.clone(),
                            &mut w,
                            &noise(800, 10 + k, 1e-2),
                            0.5,
                        )
                        .unwrap();
                    }
                    let same = |a: &[f32], b: &[f32]| {
                        a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
                    };
                    assert!(same(&w, &w0), "{kind:?}, chunk {chunk}: weights");
                    assert!(
                        got.slots()
                            .iter()
                            .zip(want.slots())
                            .all(|(a, b)| same(a, b)),
                        "{kind:?}, chunk {chunk}: state"
                    );
                    assert_eq!(got.steps(), 3);
                }
            }
        }
    }

    #[test]
    fn a_chunked_step_that_would_go_non_finite_changes_nothing() {
        let cfg = OptimizerConfig::default();
        let mut opt = Optimizer::new(&cfg, 300);
        let mut w = vec![0.5f32; 300];
        let mut g = vec![1e-3f32; 300];
        g[250] = f32::MAX;
        let pool = ChunkPool::new(2, "tether-test").unwrap();
        assert_eq!(
            opt.try_step_part_on(&pool, 64, 0..300, &mut w, &g, 1.0),
            Err(OptimError::NonFiniteState)
        );
        assert!(w.iter().all(|x| *x == 0.5));
        assert!(opt.slots().iter().all(|s| s.iter().all(|x| *x == 0.0)));
        assert_eq!(opt.steps(), 0);
    }
}

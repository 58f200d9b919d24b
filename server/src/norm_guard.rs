//! `NormGuard`: the shard's gradient-norm guard. It judges the norm of every decoded push in two steps:
//! 1. **Bound.** A norm above the absolute bound is refused (`norm_bound`) and never recorded. The bound defaults to
//!    [`GuardSettings::derive`]'s `margin` × [`honest_norm`]: the largest norm an honest push of this configuration
//!    can have before quantization error and error feedback (`docs/security.md` has the derivation).
//! 2. **Relative limit.** Each worker's recent norms sit in its own window; once a window holds `warmup` norms its
//!    (upper) median counts, and the limit is `factor` × the upper median across workers of those medians, never
//!    below the floor. A norm above it is refused (`norm_spike`). A worker is judged against it only once its own
//!    window is warm, so a newcomer is never refused by a limit it had no vote in.
//!
//! One worker cannot poison the limit others are judged by: its pushes move only its own median, which is one vote
//! among the workers' (the upper median of two votes is the larger, so a flood of zero norms changes nothing; a flood
//! of large ones is capped by the bound), and the floor keeps the limit above 0 whatever the votes. Norms refused by
//! the relative limit do enter the pushing worker's window: a lasting change of scale (a new learning-rate phase, a
//! rollback) becomes that worker's normal after half a window instead of locking it out for ever, and it moves no
//! other worker's median. Pure and deterministic; memory is bounded by [`MAX_TRACKED_WORKERS`] windows.

use std::collections::HashMap;

use tether_common::config::{Config, OptimizerKind, Schedule};

use crate::median::RunningMedian;
use crate::serde_adapters::sorted_map;

/// Why the guard refused a gradient (the shard reports it as [`crate::shard::ShardError::NormBound`] or
/// [`crate::shard::ShardError::NormSpike`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum GuardRefusal {
    /// The norm is above what an honest push can have (the absolute bound).
    Bound {
        /// Norm of the refused gradient.
        norm: f32,
        /// The bound.
        bound: f32,
    },
    /// The norm is far beyond the workers' recent medians (the relative limit).
    Spike {
        /// Norm of the refused gradient.
        norm: f32,
        /// The limit it broke.
        limit: f32,
    },
}

/// Workers with a window of their own; a worker beyond them is judged but not recorded.
pub const MAX_TRACKED_WORKERS: usize = 4096;

/// The floor of the relative limit when nothing bounds an honest push (no clip, an SGD-family rule).
pub const FALLBACK_FLOOR: f32 = 1e-3;

/// Steps over which Adam's per-element ratio bound is taken exactly; beyond them a closed-form bound covers the
/// rest (see [`adam_ratio_bound`]).
const ADAM_EXACT_STEPS: u32 = 10_000;

/// What the guard enforces.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GuardSettings {
    /// Relative factor (0 = no relative check).
    pub factor: f32,
    /// Norms kept per worker.
    pub window: usize,
    /// Norms a worker's window needs before its median counts.
    pub warmup: usize,
    /// The relative limit never goes below this.
    pub floor: f32,
    /// Absolute bound on a push's norm (`f32::INFINITY`: none).
    pub bound: f32,
}

impl GuardSettings {
    /// A relative check with `factor` (0: off), the `[guard]` window and warm-up, [`FALLBACK_FLOOR`], and no bound:
    /// what a shard built from a bare [`crate::shard::ShardSpec`] gets until [`crate::shard::ShardCore::set_guard`].
    pub fn relative(factor: f32) -> Self {
        let d = tether_common::config::GuardConfig::default();
        Self {
            factor,
            window: d.window as usize,
            warmup: d.warmup as usize,
            floor: FALLBACK_FLOOR,
            bound: f32::INFINITY,
        }
    }

    /// The settings `[guard]` of `cfg` gives a shard of `shard_len` parameters: the configured `max_norm` and
    /// `floor`, or else the bound `margin` × [`honest_norm`] and the floor [`honest_norm`] (no bound and
    /// [`FALLBACK_FLOOR`] when nothing bounds an honest push).
    pub fn derive(cfg: &Config, shard_len: usize) -> Self {
        let g = &cfg.guard;
        let honest = honest_norm(cfg, shard_len);
        Self {
            factor: g.factor,
            window: g.window as usize,
            warmup: g.warmup as usize,
            floor: g.floor.or(honest).unwrap_or(FALLBACK_FLOOR),
            bound: g
                .max_norm
                .or(honest.map(|h| h * g.margin))
                .unwrap_or(f32::INFINITY),
        }
    }
}

/// The largest norm an honest push to a shard of `shard_len` parameters can have, before quantization error and the
/// error-feedback residual (which the bound's margin covers); `None` when nothing in `cfg` bounds it.
/// - A gradient push every step: the gradient is clipped to global norm `C = train.clip_norm`, so its part for any
///   shard is at most `C` (`None` without a clip).
/// - Local-step rounds: the pseudo-gradient is the sum of `H = train.local_steps` inner steps of `[optimizer]`, each
///   at most `lr` times: `C/(1−μ)` for SGD (μ = 0), momentum and Nesterov (`None` without a clip); `R·√n` for Adam and
///   AdamW, where `R` bounds `|m̂|/√v̂` per element ([`adam_ratio_bound`]); `√n` for Adagrad (`|g|/√s ≤ 1`). `lr` is
///   the schedule's peak; a step schedule with `gamma > 1` has none (`None`).
///
/// The worker count enters the shard's step, not the push: in local-step rounds each push is applied scaled by
/// 1/workers, and the norm judged is the push's own. Weight-decay terms (`wd·w`) are left to the margin.
pub fn honest_norm(cfg: &Config, shard_len: usize) -> Option<f32> {
    let clip = (cfg.train.clip_norm > 0.0).then_some(f64::from(cfg.train.clip_norm));
    if cfg.train.local_steps == 0 {
        return clip.map(|c| c as f32);
    }
    let o = &cfg.optimizer;
    let peak = match o.schedule {
        Schedule::Constant => 1.0,
        Schedule::WarmupCosine { min_ratio, .. } => f64::from(min_ratio).max(1.0),
        Schedule::Step { gamma, .. } if gamma <= 1.0 => 1.0,
        Schedule::Step { .. } => return None,
    } * f64::from(o.lr);
    let root_n = (shard_len as f64).sqrt();
    let per_step = match o.kind {
        OptimizerKind::Sgd => clip?,
        OptimizerKind::Momentum | OptimizerKind::Nesterov => {
            clip? / (1.0 - f64::from(o.momentum)).max(f64::EPSILON)
        }
        OptimizerKind::Adam | OptimizerKind::Adamw => {
            adam_ratio_bound(f64::from(o.beta1), f64::from(o.beta2))? * root_n
        }
        OptimizerKind::Adagrad => root_n,
    } * peak;
    let h = per_step * f64::from(cfg.train.local_steps);
    (h.is_finite() && h > 0.0).then_some(h as f32)
}

/// An upper bound on Adam's bias-corrected `|m̂_t| / √v̂_t` for one element, over every step t and every gradient
/// sequence: by Cauchy–Schwarz, with `γ = β1²/β2` and `S_t = Σ_{j<t} γʲ`,
/// `|m̂_t|/√v̂_t ≤ f(t) = (1−β1)/(1−β1ᵗ) · √(S_t · (1−β2ᵗ)/(1−β2))` (1 at t = 1). The maximum of f over the first
/// [`ADAM_EXACT_STEPS`] steps is taken exactly, and every later step is at most
/// `(1−β1)/(1−β1ᵀ) · √(1/((1−γ)(1−β2)))`. `None` when `γ ≥ 1` (no bound) or the betas are out of range.
pub fn adam_ratio_bound(beta1: f64, beta2: f64) -> Option<f64> {
    if !((0.0..1.0).contains(&beta1) && (0.0..1.0).contains(&beta2)) || beta2 == 0.0 {
        return None;
    }
    let gamma = beta1 * beta1 / beta2;
    if gamma >= 1.0 {
        return None;
    }
    let (mut b1t, mut b2t, mut gt) = (1.0f64, 1.0f64, 1.0f64);
    let mut best = 0.0f64;
    for _ in 0..ADAM_EXACT_STEPS {
        b1t *= beta1;
        b2t *= beta2;
        gt *= gamma;
        let s = (1.0 - gt) / (1.0 - gamma);
        let f = (1.0 - beta1) / (1.0 - b1t) * (s * (1.0 - b2t) / (1.0 - beta2)).sqrt();
        best = best.max(f);
    }
    let tail = (1.0 - beta1) / (1.0 - b1t) * (1.0 / ((1.0 - gamma) * (1.0 - beta2))).sqrt();
    Some(best.max(tail))
}

/// One worker's recent norms and, once warm, their cached upper median.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct WorkerNorms {
    recent: RunningMedian,
    median: Option<f32>,
}

/// The guard of one shard: settings plus one window of norms per worker.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct NormGuard {
    settings: GuardSettings,
    #[serde(with = "sorted_map")]
    workers: HashMap<u32, WorkerNorms>,
    /// Scratch for the median across workers (keeps [`NormGuard::judge`] free of allocation once warm).
    #[serde(skip)]
    votes: Vec<f32>,
}

impl NormGuard {
    /// Checks a decoded guard (a peer's state image): every worker's window is well formed.
    pub(crate) fn check(&self) -> Result<(), String> {
        self.workers.values().try_for_each(|w| w.recent.check())
    }

    /// A guard with no norms seen.
    pub fn new(settings: GuardSettings) -> Self {
        Self {
            settings,
            workers: HashMap::new(),
            votes: Vec::new(),
        }
    }

    /// What it enforces.
    pub fn settings(&self) -> GuardSettings {
        self.settings
    }

    /// The relative limit now: `factor` × the upper median across warm workers of their medians, at least the floor;
    /// `None` while the check is off or no worker is warm.
    pub fn limit(&mut self) -> Option<f32> {
        if self.settings.factor <= 0.0 {
            return None;
        }
        self.votes.clear();
        self.votes
            .extend(self.workers.values().filter_map(|w| w.median));
        // The upper median: the higher of the two middle votes for an even count.
        self.votes.sort_by(f32::total_cmp);
        let median = *self.votes.get(self.votes.len() / 2)?;
        Some((median * self.settings.factor).max(self.settings.floor))
    }

    /// Judges `norm` (finite, non-negative) pushed by `worker`: refused above the bound (not recorded) or, once the
    /// worker is warm, above the relative limit (recorded, see the module doc); recorded and accepted otherwise.
    pub fn judge(&mut self, worker: u32, norm: f32) -> Result<(), GuardRefusal> {
        let bound = self.settings.bound;
        if norm > bound {
            return Err(GuardRefusal::Bound { norm, bound });
        }
        let warm = self
            .workers
            .get(&worker)
            .is_some_and(|w| w.median.is_some());
        let verdict = match self.limit().filter(|_| warm) {
            Some(limit) if norm > limit => Err(GuardRefusal::Spike { norm, limit }),
            _ => Ok(()),
        };
        self.record(worker, norm);
        verdict
    }

    fn record(&mut self, worker: u32, norm: f32) {
        if !self.workers.contains_key(&worker) && self.workers.len() >= MAX_TRACKED_WORKERS {
            return;
        }
        let (window, warmup) = (self.settings.window, self.settings.warmup);
        let w = self.workers.entry(worker).or_insert_with(|| WorkerNorms {
            recent: RunningMedian::new(window),
            median: None,
        });
        w.recent.push(norm);
        if w.recent.len() >= warmup {
            w.median = w.recent.upper();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(factor: f32, floor: f32, bound: f32) -> GuardSettings {
        GuardSettings {
            factor,
            window: 8,
            warmup: 4,
            floor,
            bound,
        }
    }

    #[test]
    fn no_limit_before_a_worker_is_warm_then_factor_times_its_median() {
        let mut g = NormGuard::new(settings(3.0, 0.0, f32::INFINITY));
        for _ in 0..3 {
            g.judge(0, 1.0).unwrap();
            assert_eq!(g.limit(), None);
        }
        g.judge(0, 1.0).unwrap();
        assert_eq!(g.limit(), Some(3.0));
        assert!(matches!(
            g.judge(0, 3.5),
            Err(GuardRefusal::Spike { limit, .. }) if limit == 3.0
        ));
        g.judge(0, 2.9).unwrap();
    }

    #[test]
    fn the_floor_holds_the_limit_up_and_the_bound_refuses_without_recording() {
        let mut g = NormGuard::new(settings(3.0, 0.5, 100.0));
        for _ in 0..8 {
            g.judge(0, 0.0).unwrap();
        }
        assert_eq!(g.limit(), Some(0.5));
        // Worker 1 is not warm: not judged relatively, whatever the limit.
        g.judge(1, 0.6).unwrap();
        assert!(matches!(
            g.judge(1, 1e30),
            Err(GuardRefusal::Bound { bound, .. }) if bound == 100.0
        ));
        // Bound refusals are not recorded: worker 2 pushing 101 forever never gets a window.
        for _ in 0..8 {
            assert!(g.judge(2, 101.0).is_err());
        }
        assert_eq!(g.limit(), Some(0.5));
    }

    #[test]
    fn a_lasting_change_of_scale_becomes_the_workers_normal() {
        let mut g = NormGuard::new(settings(3.0, 0.0, f32::INFINITY));
        for _ in 0..8 {
            g.judge(0, 1.0).unwrap();
        }
        let refused = (0..8).filter(|_| g.judge(0, 10.0).is_err()).count();
        assert!((1..8).contains(&refused), "{refused}");
        g.judge(0, 10.0).unwrap();
    }

    #[test]
    fn the_untracked_worker_beyond_the_cap_is_judged_but_not_recorded() {
        let mut g = NormGuard::new(settings(2.0, 0.0, f32::INFINITY));
        for w in 0..MAX_TRACKED_WORKERS as u32 {
            g.judge(w, 1.0).unwrap();
        }
        let extra = MAX_TRACKED_WORKERS as u32;
        for _ in 0..8 {
            g.judge(extra, 1.0).unwrap();
        }
        // No tracked worker is warm (one norm each) and the extra one was not recorded: still no limit.
        assert_eq!(g.limit(), None);
        assert_eq!(g.workers.len(), MAX_TRACKED_WORKERS);
    }

    #[test]
    fn adam_ratio_bound_meets_its_closed_forms_and_is_nearly_reached() {
        // β1 = 0 (RMSprop with bias correction): after zeros, one gradient gives |m̂|/√v̂ = √((1−β2ᵗ)/(1−β2)).
        assert!((adam_ratio_bound(0.0, 0.999).unwrap() - 1.0 / 0.001f64.sqrt()).abs() < 1e-6);
        let r = adam_ratio_bound(0.9, 0.999).unwrap();
        // (1−β1)/√((1−γ)(1−β2)) with γ = 0.81/0.999.
        let limit = 0.1 / ((1.0 - 0.81 / 0.999) * 0.001f64).sqrt();
        assert!(r >= limit - 1e-9 && r < 8.0, "{r} vs {limit}");
        assert_eq!(adam_ratio_bound(0.99, 0.9), None);
        // Cauchy–Schwarz is tight for gradients growing by β2/β1 a step: Adam's ratio then nears the bound and
        // never passes it.
        let (b1, b2) = (0.9f64, 0.999f64);
        let (mut m, mut v, mut g, mut worst) = (0.0f64, 0.0f64, 1.0f64, 0.0f64);
        for t in 1..=2_000i32 {
            g *= b2 / b1;
            m = b1 * m + (1.0 - b1) * g;
            v = b2 * v + (1.0 - b2) * g * g;
            let ratio = (m / (1.0 - b1.powi(t))).abs() / (v / (1.0 - b2.powi(t))).sqrt();
            worst = worst.max(ratio);
        }
        assert!(worst > 0.8 * r, "{worst} vs {r}");
        assert!(worst <= r, "{worst} > {r}");
    }
}

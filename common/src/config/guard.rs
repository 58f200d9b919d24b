//! `[guard]`: the shards' gradient-norm guard (on by default): an absolute bound on a push's norm, derived from the
//! clip, the training mode and the optimizer unless set, and a relative check against the median of the workers'
//! recent norms, with a floor under it. The derivation itself lives with the guard (`tether_server::norm_guard`);
//! this section is plain data and its range checks.

use serde::{Deserialize, Serialize};

use super::ConfigError;

/// Most norms a worker's window may hold (the guard keeps one window per worker).
pub const MAX_GUARD_WINDOW: u32 = 4096;

/// `[guard]`: the shards' gradient-norm guard. A push whose norm exceeds the bound is refused (`norm_bound`); once
/// workers have `warmup` norms in their windows, a push above `factor` × the median across workers of each worker's
/// median (never below the floor) is refused too (`norm_spike`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GuardConfig {
    /// Relative limit: refuse a norm above `factor` × the median across workers (default 10; 0 = no relative check;
    /// otherwise above 1). `tether-server --spike-factor` overrides it.
    pub factor: f32,
    /// Norms kept per worker (default 64, at most 4096).
    pub window: u32,
    /// Norms a worker's window needs before its median counts (default 16, at most `window`).
    pub warmup: u32,
    /// Safety margin of the derived bound: the bound is `margin` × the largest norm an honest push can have before
    /// quantization error and error feedback (default 8, at least 1).
    pub margin: f32,
    /// Absolute bound on a push's norm (default: derived from `train.clip_norm`, the mode and the optimizer; `inf`
    /// turns it off). Positive.
    pub max_norm: Option<f32>,
    /// Floor of the relative limit (default: derived, the honest norm scale the bound is a margin over). Finite,
    /// non-negative.
    pub floor: Option<f32>,
}

impl Default for GuardConfig {
    fn default() -> Self {
        Self {
            factor: 10.0,
            window: 64,
            warmup: 16,
            margin: 8.0,
            max_norm: None,
            floor: None,
        }
    }
}

impl GuardConfig {
    /// Checks ranges.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |key: &'static str, reason: &str| {
            Err(ConfigError::Invalid {
                key,
                reason: reason.to_string(),
            })
        };
        if !(self.factor == 0.0 || (self.factor > 1.0 && self.factor.is_finite())) {
            return bad("guard.factor", "must be 0 (off) or a finite number above 1");
        }
        if self.window == 0 || self.window > MAX_GUARD_WINDOW {
            return bad("guard.window", "must be in 1..=4096");
        }
        if self.warmup == 0 || self.warmup > self.window {
            return bad("guard.warmup", "must be in 1..=window");
        }
        if !(self.margin >= 1.0 && self.margin.is_finite()) {
            return bad("guard.margin", "must be a finite number of at least 1");
        }
        if self.max_norm.is_some_and(|b| b.is_nan() || b <= 0.0) {
            return bad("guard.max_norm", "must be positive (inf: no bound)");
        }
        if self.floor.is_some_and(|f| !(f >= 0.0 && f.is_finite())) {
            return bad("guard.floor", "must be a finite non-negative number");
        }
        Ok(())
    }
}

//! `[rollback]`: loss-spike rollback (off by default): the spike detector's thresholds, the shards' in-memory
//! snapshot period and count, and the learning-rate damping after a rollback; with the check that the kept snapshots
//! reach back far enough under the cluster's staleness bound.

use serde::{Deserialize, Serialize};

use super::{ConfigError, Staleness};

/// `[rollback]`: loss-spike rollback. When the training loss of a completed round exceeds `factor` × the running
/// median of the last `window` good rounds for `rounds` consecutive rounds (or is non-finite that long), every shard
/// restores its in-memory snapshot of the same earlier round (taken every `every` rounds, the last `keep` kept) and
/// the workers resume from it; for `lr_rounds` rounds afterwards the shards scale their learning rate by `lr_scale`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RollbackConfig {
    /// Detect spikes and roll back (default false).
    pub enabled: bool,
    /// Spike threshold k: a round's loss above k × the running median is suspect (default 3.0).
    pub factor: f32,
    /// Consecutive suspect (or non-finite) rounds that trigger a rollback, m (default 2).
    pub rounds: u32,
    /// Good rounds the running median is taken over, W; no spike is called before W good rounds (default 16).
    pub window: u32,
    /// Snapshot period in rounds: shards snapshot when the minimum clock reaches a multiple of it (default 10).
    pub every: u64,
    /// Snapshots kept per shard, in memory (default 3).
    pub keep: usize,
    /// Learning-rate factor applied by the shards after a rollback (default 1.0: off).
    pub lr_scale: f32,
    /// Rounds after a rollback during which `lr_scale` applies (default 0).
    pub lr_rounds: u64,
}

impl Default for RollbackConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            factor: 3.0,
            rounds: 2,
            window: 16,
            every: 10,
            keep: 3,
            lr_scale: 1.0,
            lr_rounds: 0,
        }
    }
}

impl RollbackConfig {
    /// Checks ranges, and that `keep` snapshots reach back far enough for an alarm `rounds` rounds after the onset
    /// under staleness bound `staleness` (see [`RollbackConfig::margin`]).
    pub fn validate(&self, staleness: Staleness) -> Result<(), ConfigError> {
        let bad = |key: &'static str, reason: String| Err(ConfigError::Invalid { key, reason });
        if !(self.factor > 1.0 && self.factor.is_finite()) {
            return bad("rollback.factor", "must be a finite number above 1".into());
        }
        if self.rounds == 0 || self.window == 0 || self.every == 0 {
            return bad("rollback.rounds/window/every", "must be at least 1".into());
        }
        if !(self.lr_scale > 0.0 && self.lr_scale <= 1.0) {
            return bad("rollback.lr_scale", "must be in (0, 1]".into());
        }
        let reach = u64::from(self.rounds) + Self::margin(staleness) + 1;
        let needed = 2 + reach / self.every;
        if self.enabled && (self.keep as u64) < needed {
            return bad(
                "rollback.keep",
                format!(
                    "{needed} snapshots needed to reach before a spike seen {reach} rounds late"
                ),
            );
        }
        Ok(())
    }

    /// Rounds a clean snapshot must precede a spike's onset by: 2s under a staleness bound s (a round's loss may be
    /// computed up to s rounds late, and a snapshot may hold up to s rounds past its boundary); 0 for BSP and, with
    /// no guarantee, for asynchronous runs.
    pub fn margin(staleness: Staleness) -> u64 {
        2 * u64::from(staleness.bound().unwrap_or(0))
    }
}

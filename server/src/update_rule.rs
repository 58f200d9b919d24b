//! The shards' update rule as the training mode makes it. With a gradient push every step the shards apply
//! `[optimizer]` to each push as it comes; in local-step rounds (DiLoCo, `train.local_steps > 0`) they apply
//! `[optimizer.outer]` at a constant learning rate without weight decay, to each push scaled by
//! `1 / max(workers, live)`, so that one round's pushes add up to the step on the workers' mean pseudo-gradient, also
//! while joiners beyond `cluster.workers` are in; with fewer live (an eviction, the end of a run) a push keeps its
//! `1/workers` share. Pure functions of the configuration.

use tether_common::config::{Config, OptimizerConfig, Schedule};

/// The optimizer the shards apply: `[optimizer]`, or in local-step rounds `[optimizer.outer]` at a constant
/// learning rate with no weight decay.
pub fn shard_optimizer(cfg: &Config) -> OptimizerConfig {
    if cfg.train.local_steps == 0 {
        return cfg.optimizer.clone();
    }
    let o = cfg.optimizer.outer;
    OptimizerConfig {
        kind: o.kind,
        lr: o.lr,
        momentum: o.momentum,
        weight_decay: 0.0,
        schedule: Schedule::Constant,
        staleness_aware: false,
        ..OptimizerConfig::default()
    }
}

/// The factor a shard applies to each push: 1, or in local-step rounds 1/workers, so that one round's pushes add up
/// to the step on the workers' mean pseudo-gradient (DiLoCo averages them before its outer step).
pub fn push_scale(cfg: &Config) -> f32 {
    if cfg.train.local_steps == 0 {
        1.0
    } else {
        1.0 / cfg.cluster.workers.max(1) as f32
    }
}

/// Whether the shards step once per round, on the sum of its pushes, when it closes (`optimizer.outer.at_close`,
/// local-step rounds only).
pub fn outer_at_close(cfg: &Config) -> bool {
    cfg.train.local_steps > 0 && cfg.optimizer.outer.at_close
}

/// Whether the shards scale each push by `min(push_scale, 1/live)` instead of [`push_scale`] (local-step rounds).
pub fn push_scale_per_live(cfg: &Config) -> bool {
    cfg.train.local_steps > 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use tether_common::config::OptimizerKind;

    #[test]
    fn gradient_pushes_get_the_configured_optimizer_unscaled() {
        let mut cfg = Config::with_servers(vec!["127.0.0.1:1".into()]);
        cfg.optimizer.kind = OptimizerKind::Adamw;
        cfg.optimizer.weight_decay = 0.1;
        assert_eq!(shard_optimizer(&cfg), cfg.optimizer);
        assert_eq!(push_scale(&cfg), 1.0);
        assert!(!push_scale_per_live(&cfg));
    }

    #[test]
    fn local_step_rounds_get_the_outer_optimizer_over_the_workers() {
        let mut cfg = Config::with_servers(vec!["127.0.0.1:1".into()]);
        cfg.train.local_steps = 8;
        cfg.cluster.workers = 4;
        cfg.optimizer.weight_decay = 0.1;
        cfg.optimizer.schedule = Schedule::Step {
            every: 10,
            gamma: 0.5,
        };
        let o = shard_optimizer(&cfg);
        assert_eq!(
            (o.kind, o.lr, o.momentum),
            (OptimizerKind::Nesterov, 0.7, 0.5)
        );
        assert_eq!((o.weight_decay, o.schedule), (0.0, Schedule::Constant));
        assert_eq!(push_scale(&cfg), 0.25);
        assert!(push_scale_per_live(&cfg));
    }
}

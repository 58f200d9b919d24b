//! The shards' gradient-norm guard on real training (`LocalCluster`: real QUIC with mutual TLS on loopback, real
//! shard actors and workers, the embedded digits set): with the default `[guard]` (a bound derived from the clip, the
//! mode and the optimizer; a relative check at factor 10 with its floor), honest pushes are never refused, in a
//! gradient push every step and in local-step rounds; each run prints the largest norm admitted against the bound.

use std::time::Instant;

use tether::common::config::{Config, DatasetKind, OptimizerKind, Staleness};
use tether::common::report::RunReport;
use tether::server::norm_guard::GuardSettings;
use tether::{loopback_servers, LocalCluster};

/// The quickstart's shape on the digits set: 2 shards, 2 workers, the default optimizer (Adam), q4 with error
/// feedback, clip 5; `local_steps` 0 (SSP 3, a push every step) or H (BSP rounds of H inner steps).
fn config(local_steps: u32) -> Config {
    let mut cfg = Config::with_servers(loopback_servers(2));
    cfg.cluster.workers = 2;
    cfg.cluster.staleness = if local_steps > 0 {
        Staleness::Bounded(0)
    } else {
        Staleness::Bounded(3)
    };
    cfg.data.dataset = DatasetKind::Digits;
    cfg.model.hidden = vec![64];
    cfg.train.batch = 32;
    cfg.train.epochs = 20;
    cfg.train.eval_every = 0;
    cfg.train.local_steps = local_steps;
    cfg.checkpoint.every_updates = 0;
    cfg.validate().expect("valid config");
    cfg
}

fn run(cfg: Config) -> RunReport {
    let dir = tempfile::tempdir().unwrap();
    let mut cluster = LocalCluster::new(cfg, dir.path().to_path_buf());
    cluster.eval_during_training = false;
    cluster.run().unwrap()
}

#[test]
fn the_default_guard_admits_every_honest_push_in_both_modes() {
    let started = Instant::now();
    for (local_steps, kind) in [
        (0, OptimizerKind::Adam),
        (0, OptimizerKind::Momentum),
        (8, OptimizerKind::Adam),
        (8, OptimizerKind::Momentum),
    ] {
        let mut cfg = config(local_steps);
        cfg.optimizer.kind = kind;
        if kind == OptimizerKind::Momentum {
            cfg.optimizer.lr = 0.05;
        }
        // The larger of the two shards' ranges gives the looser bound; the smaller one's is what must hold.
        let layout = tether::common::layout::model_layout(&cfg).unwrap();
        let len = layout
            .shard_range(1, 2)
            .len()
            .min(layout.shard_range(0, 2).len());
        let guard = GuardSettings::derive(&cfg, len);
        let r = run(cfg);
        eprintln!(
            "H={local_steps} {kind:?}: max push norm {:.4}, bound {:.4} (ratio {:.3}), floor {:.4}, accuracy {:.4}, \
             applied {}, refused {}, {:.1}s",
            r.max_push_norm,
            guard.bound,
            r.max_push_norm / f64::from(guard.bound),
            guard.floor,
            r.final_test_accuracy,
            r.updates_applied,
            r.guard_refused,
            r.wall_seconds
        );
        assert!(
            guard.bound.is_finite(),
            "the default configuration has a bound"
        );
        assert_eq!(
            r.guard_refused, 0,
            "H={local_steps} {kind:?}: honest pushes refused"
        );
        assert_eq!(r.updates_rejected, 0, "H={local_steps} {kind:?}");
        assert!(r.max_push_norm > 0.0 && r.max_push_norm < f64::from(guard.bound));
        // A sanity floor for the default optimizer only: what this test checks is that nothing honest was refused
        // (inner momentum under Nesterov outer steps varies from run to run here, between 0.5 and 0.8).
        if kind == OptimizerKind::Adam {
            assert!(
                r.final_test_accuracy > 0.8,
                "H={local_steps} {kind:?}: accuracy {}",
                r.final_test_accuracy
            );
        }
    }
    assert!(started.elapsed().as_secs() < 300, "bounded in time");
}

#[test]
fn the_default_guard_admits_every_honest_push_of_the_quickstart_on_fashion_mnist() {
    let installed = tether::common::config::default_data_dir()
        .join("train-images-idx3-ubyte.gz")
        .exists();
    if !installed {
        eprintln!("Fashion-MNIST not installed: skipped (the digits test covers the guard)");
        return;
    }
    // The quickstart's MLP and cluster (4 workers, 2 shards, 784-256-128-10, batch 128, Adam), one epoch, in both
    // modes: a push every step (SSP 3) and its default local-step rounds (H = 16, BSP).
    for local_steps in [0, 16] {
        let mut cfg = config(local_steps);
        cfg.cluster.workers = 4;
        cfg.data.dataset = tether::common::config::DatasetKind::FashionMnist;
        cfg.model.hidden = vec![256, 128];
        cfg.train.batch = 128;
        cfg.train.epochs = 1;
        cfg.validate().expect("valid config");
        let layout = tether::common::layout::model_layout(&cfg).unwrap();
        let len = layout
            .shard_range(1, 2)
            .len()
            .min(layout.shard_range(0, 2).len());
        let guard = GuardSettings::derive(&cfg, len);
        let r = run(cfg);
        eprintln!(
            "fashion H={local_steps}: max push norm {:.4}, bound {:.4} (ratio {:.3}), accuracy {:.4}, applied {}, \
             refused {}, {:.1}s",
            r.max_push_norm,
            guard.bound,
            r.max_push_norm / f64::from(guard.bound),
            r.final_test_accuracy,
            r.updates_applied,
            r.guard_refused,
            r.wall_seconds
        );
        assert_eq!(
            r.guard_refused, 0,
            "fashion H={local_steps}: honest pushes refused"
        );
        assert!(r.max_push_norm > 0.0 && r.max_push_norm < f64::from(guard.bound));
    }
}

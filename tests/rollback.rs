//! Loss-spike rollback end to end (`LocalCluster`: real QUIC with mutual TLS on loopback, two shard actors, a real
//! worker): a push scaled 1000× past the clip (`push@STEP:FACTOR`) wrecks the model; with `[rollback]` on, both
//! shards detect the spike at the same round, restore the snapshot of the same round from before the faulty update,
//! the worker resets its residuals and skips the batches of the discarded rounds, and the run ends within half a
//! point of an undisturbed one; with rollback off the same spike costs far more.
//!
//! One worker, BSP, on the embedded digits set: every bit of such a run is a function of its seeds (the shards see
//! one push per round, in order), so the comparisons below are deterministic, not statistical, and the test cannot
//! flake on a loaded machine. Each run takes a few seconds; the whole test is bounded at 60 s.

use std::time::{Duration, Instant};

use tether::common::config::{
    Config, DatasetKind, OptimizerKind, RollbackConfig, Schedule, Staleness,
};
use tether::common::report::RunReport;
use tether::worker::step::GradientFault;
use tether::worker::WorkerReport;
use tether::{loopback_servers, LocalCluster};

/// The faulty step (one worker, no skips: in per-step mode it is also the round, in local-step rounds of H steps the
/// round is `SPIKE_AT / H`).
const SPIKE_AT: u64 = 200;

/// `local_steps`: 0 for a push every step (momentum SGD on the shards), H for DiLoCo rounds of H inner steps (the
/// same optimizer on the worker, Nesterov outer steps on the shards).
fn config(rollback: bool, local_steps: u32) -> Config {
    let mut cfg = Config::with_servers(loopback_servers(2));
    cfg.cluster.workers = 1;
    cfg.cluster.staleness = Staleness::Bounded(0);
    cfg.data.dataset = DatasetKind::Digits;
    cfg.model.hidden = vec![64];
    cfg.train.batch = 32;
    // 1,437 training samples: 44 steps per epoch, 440 rounds.
    cfg.train.epochs = 10;
    cfg.train.eval_every = 0;
    cfg.optimizer.kind = OptimizerKind::Momentum;
    cfg.optimizer.lr = 0.05;
    cfg.optimizer.momentum = 0.9;
    cfg.optimizer.schedule = Schedule::Constant;
    cfg.train.local_steps = local_steps;
    cfg.optimizer.outer.momentum = 0.5;
    cfg.checkpoint.every_updates = 0;
    // The injected push is far beyond the gradient-norm guard's bound, which would refuse it: off, so that the spike
    // reaches the weights and the rollback is what is tested.
    cfg.guard.factor = 0.0;
    cfg.guard.max_norm = Some(f32::INFINITY);
    cfg.rollback = RollbackConfig {
        enabled: rollback,
        factor: 10.0,
        ..RollbackConfig::default()
    };
    cfg.validate().expect("valid config");
    cfg
}

fn run(local_steps: u32, rollback: bool, spike: bool) -> (RunReport, WorkerReport) {
    run_config(config(rollback, local_steps), spike)
}

fn run_config(cfg: Config, spike: bool) -> (RunReport, WorkerReport) {
    let (local_steps, rollback) = (cfg.train.local_steps, cfg.rollback.enabled);
    let dir = tempfile::tempdir().unwrap();
    let mut cluster = LocalCluster::new(cfg, dir.path().to_path_buf());
    cluster.eval_during_training = false;
    if spike {
        cluster.faults = vec![(0, GradientFault::PushScaleAt(SPIKE_AT, 1000.0))];
    }
    let (report, mut workers, _) = cluster.run_with_workers().unwrap();
    eprintln!(
        "H={local_steps} rollback {rollback} spike {spike}: accuracy {:.4}, loss {:.4}, steps {}, applied {}, rejected {}, \
         rollbacks {}, rounds lost {}, missed {}, log {:?}, {:.1}s",
        report.final_test_accuracy,
        report.final_train_loss,
        report.steps,
        report.updates_applied,
        report.updates_rejected,
        report.rollbacks,
        report.rounds_lost,
        report.rollbacks_missed,
        report.rollback_log,
        report.wall_seconds
    );
    (report, workers.remove(0))
}

/// The worker's loss in round `round` (recorded once the round's H steps are done, at step `(round + 1)·H`).
fn loss_of_round(w: &WorkerReport, round: u64, h: u64) -> f64 {
    w.loss_curve
        .iter()
        .find(|p| p.0 == (round + 1) * h)
        .map_or(f64::NAN, |p| p.2)
}

#[test]
fn a_loss_spike_rolls_every_shard_back_to_the_same_round_and_the_run_recovers() {
    spike_and_recover(0);
}

#[test]
fn local_step_rounds_recover_from_a_spike_too() {
    spike_and_recover(4);
}

fn spike_and_recover(local_steps: u32) {
    let t0 = Instant::now();
    let h = u64::from(local_steps.max(1));
    let spike_round = SPIKE_AT / h;
    let (clean, _) = run(local_steps, true, false);
    // The detector saw a whole run of an ordinary noisy loss and raised nothing.
    assert_eq!((clean.rollbacks, clean.rollbacks_missed), (0, 0));
    assert!(
        clean.final_test_accuracy > 0.9,
        "undisturbed run did not train"
    );

    let (off, off_w) = run(local_steps, false, true);
    // The spike is real: the loss of the round after the faulty update is far above the loss before it.
    let (before, after) = (
        loss_of_round(&off_w, spike_round, h),
        loss_of_round(&off_w, spike_round + 1, h),
    );
    assert!(
        after.is_nan() || after >= 10.0 * before,
        "no spike: loss {before} before, {after} after"
    );
    assert_eq!(off.rollbacks, 0);

    let (on, on_w) = run(local_steps, true, true);
    assert_eq!(on.rollbacks, 1);
    assert_eq!(on.rollbacks_missed, 0);
    // Both shards rolled back once, at the same alarm round, to the same snapshot round, and that snapshot predates
    // the faulty round (a snapshot at round b holds rounds < b) while the alarm follows it.
    let mut log = on.rollback_log.clone();
    log.sort();
    assert_eq!(log.len(), 2, "{log:?}");
    assert_eq!((log[0].0, log[1].0), (0, 1));
    assert_eq!(
        (log[0].1, log[0].2),
        (log[1].1, log[1].2),
        "shards disagree"
    );
    let (alarm, restored) = (log[0].1, log[0].2);
    assert!(restored <= spike_round && alarm > spike_round, "{log:?}");
    assert_eq!(on.rounds_lost, alarm + 1 - restored);
    // The worker saw both shards' new epoch, and its loss right after the rollback is back to the pre-spike level.
    assert_eq!(on_w.rollbacks_seen, 2);
    let resumed = loss_of_round(&on_w, alarm + 1, h);
    assert!(
        resumed < 3.0 * before.max(0.05),
        "loss {resumed} after the rollback"
    );
    // Clocks stay monotone: the worker ran all its steps; the discarded rounds' batches are not replayed.
    assert_eq!(on.steps, clean.steps);

    let gap = (on.final_test_accuracy - clean.final_test_accuracy).abs();
    assert!(
        gap <= 0.005,
        "with rollback {:.4} vs undisturbed {:.4}: gap {gap:.4} over half a point",
        on.final_test_accuracy,
        clean.final_test_accuracy
    );
    let damage = clean.final_test_accuracy - off.final_test_accuracy;
    assert!(
        damage >= 0.05,
        "without rollback {:.4} vs undisturbed {:.4}: the spike did no real damage",
        off.final_test_accuracy,
        clean.final_test_accuracy
    );
    assert!(
        t0.elapsed() < Duration::from_secs(60),
        "took {:?}",
        t0.elapsed()
    );
}

#[test]
fn under_ssp_the_snapshot_clears_the_staleness_margin_and_stale_pushes_are_refused() {
    let t0 = Instant::now();
    let mut cfg = config(true, 0);
    cfg.cluster.staleness = Staleness::Bounded(2);
    cfg.validate().expect("valid config");
    let (on, on_w) = run_config(cfg, true);
    assert_eq!((on.rollbacks, on.rollbacks_missed), (1, 0));
    let mut log = on.rollback_log.clone();
    log.sort();
    assert_eq!(log.len(), 2, "{log:?}");
    assert_eq!(
        (log[0].1, log[0].2),
        (log[1].1, log[1].2),
        "shards disagree"
    );
    let (alarm, restored) = (log[0].1, log[0].2);
    // With s = 2 the faulty round 200 may show in the loss of round 201 at the earliest and 203 at the latest, and a
    // snapshot may hold 2 rounds past its boundary: the target keeps 2s = 4 rounds of margin below the onset.
    assert!(restored + 4 < SPIKE_AT + 1 && alarm > SPIKE_AT, "{log:?}");
    assert_eq!(restored % 10, 0);
    assert_eq!(on_w.rollbacks_seen, 2);
    // Pushes read before the rollback are refused, never applied: each of the 440 rounds was applied or refused
    // on each shard, and the refusals are exactly the worker's refused pushes.
    assert_eq!(on.updates_applied + on.updates_rejected, 2 * on.steps);
    assert_eq!(on.updates_rejected, on.pushes_refused);
    assert!(
        on.final_test_accuracy > 0.9,
        "accuracy {}",
        on.final_test_accuracy
    );
    assert!(
        t0.elapsed() < Duration::from_secs(60),
        "took {:?}",
        t0.elapsed()
    );
}

/// The GPT variant: a small byte-level GPT (1 layer, 2 heads, 32 wide, 16-byte context) on the embedded KJV excerpt,
/// one worker, local-step rounds of 4 (inner Adam, Nesterov outer steps); the spike is a round's pseudo-gradient
/// scaled 1000×. With rollback the run ends within 2 % of the undisturbed validation loss; without, far above it.
fn gpt_config(rollback: bool) -> Config {
    let mut cfg = config(rollback, 4);
    cfg.model.kind = tether::common::config::ModelKind::Gpt;
    cfg.model.layers = 1;
    cfg.model.heads = 2;
    cfg.model.dim = 32;
    cfg.model.context = 16;
    cfg.data.dataset = DatasetKind::KjvExcerpt;
    cfg.train.batch = 32;
    cfg.train.epochs = 1;
    cfg.train.max_steps = 800;
    cfg.optimizer.kind = OptimizerKind::Adam;
    cfg.optimizer.lr = 3e-3;
    cfg.optimizer.schedule = Schedule::WarmupCosine {
        warmup: 30,
        total: 0,
        min_ratio: 0.1,
    };
    cfg.validate().expect("valid config");
    cfg
}

#[test]
fn a_gpt_recovers_from_a_loss_spike_within_two_percent_of_its_validation_loss() {
    let t0 = Instant::now();
    let val = |r: &RunReport| r.final_val_loss.expect("validation loss");
    let (clean, _) = run_config(gpt_config(true), false);
    assert_eq!((clean.rollbacks, clean.rollbacks_missed), (0, 0));
    let (off, _) = run_config(gpt_config(false), true);
    let (on, on_w) = run_config(gpt_config(true), true);
    eprintln!(
        "GPT validation loss: undisturbed {:.4}, spike without rollback {:.4}, with rollback {:.4} ({} rounds lost)",
        val(&clean),
        val(&off),
        val(&on),
        on.rounds_lost
    );
    assert_eq!((on.rollbacks, on.rollbacks_missed), (1, 0));
    assert_eq!(on_w.rollbacks_seen, 2);
    let mut log = on.rollback_log.clone();
    log.sort();
    assert_eq!(
        (log[0].1, log[0].2),
        (log[1].1, log[1].2),
        "shards disagree: {log:?}"
    );
    assert!(
        val(&on) <= 1.02 * val(&clean),
        "with rollback {:.4} vs undisturbed {:.4}: more than 2 % worse",
        val(&on),
        val(&clean)
    );
    assert!(
        val(&off).is_nan() || val(&off) > 1.1 * val(&clean),
        "without rollback {:.4} vs undisturbed {:.4}: the spike did no real damage",
        val(&off),
        val(&clean)
    );
    assert!(
        t0.elapsed() < Duration::from_secs(90),
        "took {:?}",
        t0.elapsed()
    );
}

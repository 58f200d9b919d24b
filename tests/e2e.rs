//! End-to-end runs of a whole cluster in one process (`LocalCluster`: real QUIC with mutual TLS on loopback, real
//! shard actors and workers): accuracy, the three consistency models, the staleness bound, and q4 against fp32.
//! They train on Fashion-MNIST when it is installed (CI installs it) and on the embedded digits set otherwise.

use tether::common::codec::Scheme;
use tether::common::config::{Config, DatasetKind, Schedule, Staleness};
use tether::common::report::RunReport;
use tether::{loopback_servers, LocalCluster};

fn fashion_installed() -> bool {
    tether::common::config::default_data_dir()
        .join("train-images-idx3-ubyte.gz")
        .exists()
}

/// A small but real configuration: 2 shards, 3 workers, the MLP, a short schedule.
fn config(staleness: Staleness, scheme: Scheme) -> Config {
    let mut cfg = Config::with_servers(loopback_servers(2));
    cfg.cluster.workers = 3;
    cfg.cluster.staleness = staleness;
    cfg.compression.scheme = scheme;
    // Without zstd the push ratios are exact functions of the scheme, which the tests check.
    cfg.compression.zstd = false;
    cfg.model.hidden = vec![64];
    cfg.train.batch = 64;
    cfg.train.eval_every = 0;
    cfg.optimizer.schedule = Schedule::WarmupCosine {
        warmup: 50,
        total: 0,
        min_ratio: 0.05,
    };
    cfg.checkpoint.every_updates = 0;
    if fashion_installed() {
        cfg.train.epochs = 2;
    } else {
        eprintln!(
            "Fashion-MNIST not installed: these end-to-end tests train on the embedded digits set"
        );
        cfg.data.dataset = DatasetKind::Digits;
        cfg.train.epochs = digits_epochs(&cfg);
    }
    cfg
}

/// Updates each digits run applies per shard (all workers together). Sized by updates, not epochs: the digits set is
/// small (1,437 training samples, so 7 steps per worker and epoch at batch 64 over 3 workers), and with 50 warm-up
/// updates a run of 252 updates had not converged (0.8806 against the floor).
const DIGITS_UPDATES: u64 = 840;

/// Epochs that give at least [`DIGITS_UPDATES`] updates with this configuration's workers and batch.
fn digits_epochs(cfg: &Config) -> u32 {
    let (train, _) = tether::worker::data::digits().expect("embedded digits set");
    let workers = u64::from(cfg.cluster.workers);
    let per_worker = train.len() as u64 / workers;
    let steps_per_epoch = (per_worker / cfg.train.batch as u64).max(1);
    DIGITS_UPDATES.div_ceil(workers * steps_per_epoch) as u32
}

fn run(cfg: Config) -> RunReport {
    let dir = tempfile::tempdir().unwrap();
    let report = LocalCluster::new(cfg, dir.path().to_path_buf())
        .run()
        .unwrap();
    eprintln!(
        "{} s={} {}: accuracy {:.4}, steps {}, applied {}, rejected {}, lead {}, staleness {}, wire/fp32 {:.3}, {:.1}s",
        report.dataset,
        report.staleness_bound,
        report.compression,
        report.final_test_accuracy,
        report.steps,
        report.updates_applied,
        report.updates_rejected,
        report.max_clock_lead_observed,
        report.max_staleness_observed,
        report.push_ratio(),
        report.wall_seconds
    );
    report
}

/// The floor each run must reach, below the minimum of measured runs: Fashion-MNIST (2 epochs) 0.838–0.845 in
/// earlier sessions; digits (840 updates) 0.9500–0.9611 over 10 runs of each of the five configurations here.
fn accuracy_floor(r: &RunReport) -> f64 {
    if r.dataset == "fashion-mnist" {
        0.82
    } else {
        0.93
    }
}

fn check_common(r: &RunReport, bound: Option<u64>) {
    assert_eq!(r.workers, 3);
    assert_eq!(r.shards, 2);
    // Every push of every worker reached both shards and was applied; nothing was refused.
    assert_eq!(r.updates_rejected, 0);
    assert_eq!(
        r.updates_applied,
        2 * r.steps,
        "each step pushes one frame per shard"
    );
    if let Some(s) = bound {
        assert!(
            r.max_clock_lead_observed <= s,
            "clock lead {} beyond bound {s}",
            r.max_clock_lead_observed
        );
    }
    let hist_total: u64 = r.staleness_histogram.iter().map(|b| b.count).sum();
    assert_eq!(hist_total, r.updates_applied);
    assert!(
        r.final_test_accuracy >= accuracy_floor(r),
        "accuracy {} too low",
        r.final_test_accuracy
    );
    assert!(r.final_train_loss.is_finite());
    assert!(!r.loss_curve.is_empty());
}

#[test]
fn ssp_q4_cluster_trains_to_accuracy_within_the_bound() {
    let r = run(config(Staleness::Bounded(2), Scheme::Q4));
    check_common(&r, Some(2));
    // 4-bit codes plus one f32 scale per 512 values.
    assert!(r.push_ratio() < 0.13, "q4 push ratio {}", r.push_ratio());
}

#[test]
fn bsp_never_lets_a_worker_lead() {
    let r = run(config(Staleness::Bounded(0), Scheme::Q4));
    check_common(&r, Some(0));
    // BSP: a pull for clock c waits for every push of clock c-1, so a gradient is at most (workers - 1) updates
    // stale: the other workers' pushes of the same round.
    assert!(
        r.max_staleness_observed <= 2,
        "staleness {} under BSP with 3 workers",
        r.max_staleness_observed
    );
}

#[test]
fn async_run_completes_and_trains() {
    let r = run(config(Staleness::Unbounded, Scheme::Q4));
    check_common(&r, None);
}

/// Runs per scheme in the q4-against-fp32 comparison: one on Fashion-MNIST (10,000 test samples), five on the digits
/// set, whose 360 test samples make one run's accuracy move by about a point from run to run (0.9500–0.9611 over 10
/// runs of one configuration; one CI run measured q4 0.9528 against fp32 0.9639), so single runs cannot resolve one.
fn comparison_runs() -> usize {
    if fashion_installed() {
        1
    } else {
        5
    }
}

#[test]
fn q4_with_error_feedback_matches_fp32_within_one_point() {
    let runs = comparison_runs();
    let mean = |scheme: Scheme| -> (f64, f64) {
        let mut acc = 0.0;
        let mut ratio = 0.0;
        for _ in 0..runs {
            let r = run(config(Staleness::Bounded(0), scheme));
            acc += r.final_test_accuracy;
            ratio = r.push_ratio();
        }
        (acc / runs as f64, ratio)
    };
    let (q4, _) = mean(Scheme::Q4);
    let (fp32, fp32_ratio) = mean(Scheme::None);
    assert!((fp32_ratio - 1.0).abs() < 0.01);
    let gap = (q4 - fp32).abs();
    eprintln!("q4 {q4:.4} vs fp32 {fp32:.4} (mean of {runs}): gap {gap:.4}");
    assert!(
        gap <= 0.01,
        "q4 {q4:.4} vs fp32 {fp32:.4} (mean of {runs} runs): gap {gap:.4} over one point"
    );
}

#[test]
fn delta_pulls_rebuild_the_shards_public_copy_bit_for_bit() {
    // Cuts happen only while a pull is answered, so the last worker answered by a shard holds that shard's newest
    // cut. Every worker holding it (at least that one) must have rebuilt it, from its own history of deltas and full
    // copies, to the shard's exact bits. The byte counts must show that the pulls were compressed.
    let mut cfg = config(Staleness::Bounded(0), Scheme::Q4);
    cfg.compression.pull = tether::common::config::PullKind::Delta;
    cfg.compression.zstd = true;
    let dir = tempfile::tempdir().unwrap();
    let mut cluster = LocalCluster::new(cfg, dir.path().to_path_buf());
    cluster.eval_during_training = false;
    let (r, workers, publics) = cluster.run_with_workers().unwrap();
    check_common(&r, Some(0));
    assert_eq!(r.pull, "delta q4");
    assert_publics_rebuilt(&workers, &publics);
    // q4 deltas with zstd: well under a quarter of the f32 pull bytes (headers and full first pulls included).
    let pull_ratio = r.wire_bytes_pulled as f64 / r.fp32_bytes_pulled as f64;
    assert!(pull_ratio < 0.25, "pull ratio {pull_ratio:.3}");
    eprintln!(
        "delta pulls: pull ratio {pull_ratio:.3}, both directions {:.1}x fewer than fp32",
        r.total_reduction()
    );
}

/// Every worker that holds a shard's newest cut rebuilt it, from its own history of deltas and full copies, to the
/// shard's exact bits.
fn assert_publics_rebuilt(
    workers: &[tether::worker::WorkerReport],
    publics: &[tether::cluster::ShardPublic],
) {
    let layout_len = workers[0].final_params.len();
    let ranges: Vec<(usize, usize)> = (0..2)
        .map(|k| {
            let rr = tether::common::layout::shard_range(layout_len, k, 2);
            (rr.start, rr.end)
        })
        .collect();
    for (k, public) in publics.iter().enumerate() {
        let (newest, values) = public
            .as_ref()
            .expect("delta pulls created the public copy");
        let (start, end) = ranges[k];
        assert_eq!(values.len(), end - start);
        let holders: Vec<&tether::worker::WorkerReport> = workers
            .iter()
            .filter(|w| w.final_public.get(k).copied().flatten() == Some(*newest))
            .collect();
        assert!(
            !holders.is_empty(),
            "shard {k}: no worker holds the newest cut {newest:?}"
        );
        for w in holders {
            let differ = w.final_params[start..end]
                .iter()
                .zip(values)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            assert_eq!(
                differ, 0,
                "worker {} rebuilt shard {k}'s cut {newest:?} with {differ} other values",
                w.rank
            );
        }
    }
}

#[test]
fn topk2_rounds_train_and_sparse_pulls_rebuild_the_public_copy_bit_for_bit() {
    // The slow-link setting: local-step rounds whose pseudo-gradients are block top-k (1 in 16 per 4096) at 2 bits
    // with error feedback, and pull deltas sparsified the same way with the public copy's error feedback.
    let mut cfg = config(Staleness::Bounded(0), Scheme::Topk2);
    let h = 8u32;
    cfg.train.local_steps = h;
    cfg.optimizer.outer.lr = 1.4;
    cfg.compression.zstd = true;
    cfg.compression.pull_scheme = Scheme::Topk2;
    cfg.compression.bucket = 4096;
    cfg.compression.keep = 16;
    let dir = tempfile::tempdir().unwrap();
    let mut cluster = LocalCluster::new(cfg, dir.path().to_path_buf());
    cluster.eval_during_training = false;
    let (r, workers, publics) = cluster.run_with_workers().unwrap();
    eprintln!(
        "{} topk2 rounds: accuracy {:.4}, {:.0}x fewer bytes both ways than fp32 sync, {:.1} s",
        r.dataset,
        r.final_test_accuracy,
        r.total_reduction(),
        r.wall_seconds
    );
    assert_eq!(
        (r.compression.as_str(), r.pull.as_str()),
        ("topk2", "delta topk2")
    );
    assert_eq!(r.updates_rejected, 0);
    let rounds = (r.steps / 3).div_ceil(u64::from(h));
    assert_eq!(r.updates_applied, 2 * 3 * rounds, "{} steps", r.steps);
    assert_publics_rebuilt(&workers, &publics);
    let floor = if r.dataset == "fashion-mnist" {
        0.80
    } else {
        0.88
    };
    assert!(
        r.final_test_accuracy >= floor,
        "accuracy {} below {floor}",
        r.final_test_accuracy
    );
    // q4 both ways with the same rounds gives under 8·h; sparse both ways measured 20·h (digits) and 37·h
    // (Fashion-MNIST): the first pull of each worker is a whole f32 copy, which bounds the ratio of a run this short.
    assert!(
        r.total_reduction() > 12.0 * f64::from(h),
        "only {:.1}x fewer bytes than fp32",
        r.total_reduction()
    );
}

#[test]
fn local_step_rounds_train_with_one_push_per_round() {
    let mut cfg = config(Staleness::Bounded(0), Scheme::Q4);
    let h = 8u32;
    cfg.train.local_steps = h;
    cfg.optimizer.outer.momentum = 0.5;
    cfg.compression.zstd = true;
    let r = run(cfg);
    assert_eq!(r.updates_rejected, 0);
    assert_eq!(r.local_steps, h);
    // One push per shard per round of up to h inner steps.
    let per_worker = r.steps / 3;
    let rounds = per_worker.div_ceil(u64::from(h));
    assert_eq!(r.updates_applied, 2 * 3 * rounds, "{} steps", r.steps);
    // 840 digits steps are only 105 rounds of 8: measured 0.9222-0.9278 over 6 runs (0.93 is the per-step floor).
    let floor = if r.dataset == "fashion-mnist" {
        0.82
    } else {
        0.90
    };
    assert!(
        r.final_test_accuracy >= floor,
        "accuracy {} below {floor}",
        r.final_test_accuracy
    );
    // Against per-step f32 sync of the same steps: h rounds fewer, and q4 both ways.
    assert!(
        r.total_reduction() > 4.0 * f64::from(h),
        "only {:.1}x fewer bytes than fp32",
        r.total_reduction()
    );
}

#[test]
fn streamed_fragments_train_with_a_quarter_of_the_burst_and_rebuild_the_public_copy() {
    // Streaming DiLoCo: H = 8 inner steps per fragment, F = 4, so a round is 2 inner steps and pushes a quarter of
    // every shard; its pull overlaps the next round's inner steps.
    let mut cfg = config(Staleness::Bounded(1), Scheme::Q4);
    let (h, f) = (8u32, 4u32);
    cfg.train.local_steps = h;
    cfg.train.fragments = f;
    cfg.optimizer.outer.momentum = 0.5;
    let n_params = tether::common::layout::model_layout(&cfg).unwrap().len();
    let whole: usize = {
        let layout = tether::common::layout::model_layout(&cfg).unwrap();
        (0..2)
            .map(|k| {
                let n = tether::common::layout::shard_range(layout.len(), k, 2).len();
                tether::common::codec::max_encoded_len(&cfg.compression.codec(), n)
            })
            .sum()
    };
    let dir = tempfile::tempdir().unwrap();
    let mut cluster = LocalCluster::new(cfg, dir.path().to_path_buf());
    cluster.eval_during_training = false;
    let (r, workers, publics) = cluster.run_with_workers().unwrap();
    eprintln!(
        "{} streamed q4, F = {f}: accuracy {:.4}, largest push {} B of a whole {whole} B ({:.3}), largest pull {} B, \
         {:.0}x fewer bytes, {:.1} s",
        r.dataset,
        r.final_test_accuracy,
        r.max_push_bytes,
        r.max_push_bytes as f64 / whole as f64,
        r.max_pull_bytes,
        r.total_reduction(),
        r.wall_seconds
    );
    assert_eq!((r.fragments, r.updates_rejected), (f, 0));
    // One push per shard per round of H/F inner steps.
    let rounds = (r.steps / 3).div_ceil(u64::from(h / f));
    assert_eq!(r.updates_applied, 2 * 3 * rounds, "{} steps", r.steps);
    // The goal of the design: the largest burst at most 1.2/F of a whole-model push.
    assert!(
        r.max_push_bytes as f64 <= 1.2 / f64::from(f) * whole as f64,
        "largest push {} B against a whole-model push of {whole} B",
        r.max_push_bytes
    );
    // Fresh shards offer their initial weights, which workers compute: no pull carries the whole model in f32 (4
    // bytes per parameter: before, every worker's first pull, and the largest downlink burst), since a shard sends
    // deltas only while they are smaller than that.
    assert!(
        r.max_pull_bytes < n_params as u64 * 4,
        "largest pull {} B against the whole model's {} B in f32",
        r.max_pull_bytes,
        n_params * 4
    );
    assert_publics_rebuilt(&workers, &publics);
    // Measured: Fashion-MNIST 0.8166-0.8331 over 4 runs here (whole-model rounds of 8: 0.839), and 0.7989 once in CI
    // (staleness 1: which stale copy a push is computed on depends on the scheduler), so the floor sits below that;
    // a run whose fragments did not train stays near 0.1. Digits 0.9167-0.9250 over 3 (0.9278).
    let floor = if r.dataset == "fashion-mnist" {
        0.77
    } else {
        0.90
    };
    assert!(
        r.final_test_accuracy >= floor,
        "accuracy {} below {floor}",
        r.final_test_accuracy
    );
}

/// `cluster.standbys` gives every shard of a `LocalCluster` a standby (and the cluster a witness). With shard 0's
/// primary killed mid-run, its standby takes over and every step's push is applied exactly once on each shard (BSP:
/// `updates_applied` counts the serving nodes' applications, the standby's including those it replayed from the log).
#[test]
fn local_cluster_standbys_take_over_from_a_killed_primary_without_losing_an_update() {
    let mut cfg = config(Staleness::Bounded(0), Scheme::Q4);
    // Any addresses: the local cluster binds free loopback ports for the standbys and the witness.
    cfg.cluster.standbys = vec!["127.0.0.1:1".into(), "127.0.0.1:2".into()];
    cfg.cluster.witness = Some("127.0.0.1:3".into());
    let dir = tempfile::tempdir().unwrap();
    let mut cluster = LocalCluster::new(cfg, dir.path().to_path_buf());
    // Stretch the run (5 ms per step, about 1.4 s on digits) so that the kill lands mid-run.
    cluster.delays = (0..3)
        .map(|r| (r, std::time::Duration::from_millis(5)))
        .collect();
    cluster.kill_primaries = vec![(0, std::time::Duration::from_millis(400))];
    let r = cluster.run().unwrap();
    eprintln!(
        "standbys, primary 0 killed at 0.4 s: accuracy {:.4}, steps {}, applied {}, {:.1} s, notes {:?}",
        r.final_test_accuracy, r.steps, r.updates_applied, r.wall_seconds, r.notes
    );
    assert!(
        !r.notes
            .iter()
            .any(|n| n.contains("killed after every worker")),
        "the kill landed after the run: {:?}",
        r.notes
    );
    assert!(
        r.notes
            .iter()
            .any(|n| n.starts_with("shard 0: its standby took over")),
        "shard 0's standby did not serve at the end: {:?}",
        r.notes
    );
    assert!(
        !r.notes
            .iter()
            .any(|n| n.starts_with("shard 1: its standby")),
        "shard 1's primary was not killed, yet its standby served: {:?}",
        r.notes
    );
    check_common(&r, Some(0));
    assert!(r.final_test_accuracy >= accuracy_floor(&r));
}

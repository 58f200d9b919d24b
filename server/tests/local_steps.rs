//! The outer step of local-step rounds (DiLoCo) on a real `ShardCore`, configured from a cluster config the way
//! `tether-server` configures it: against a reference written from the paper's formula, and the model-averaging
//! identity (outer lr 1, no momentum: one round of pushes lands exactly on the mean of the workers' θ_end).

use tether_common::codec::{CodecConfig, Encoder, Scheme};
use tether_common::config::{Config, Staleness};
use tether_common::layout::Layout;
use tether_common::testing::flat_layout;
use tether_server::shard::{Push, ShardCore, ShardSpec};
use tether_server::update_rule::{push_scale, shard_optimizer};

const N: usize = 100;
const WORKERS: u32 = 3;

fn cfg(lr: f32, momentum: f32) -> Config {
    let mut cfg = Config::with_servers(vec!["127.0.0.1:1".into()]);
    cfg.cluster.workers = WORKERS;
    cfg.cluster.staleness = Staleness::Bounded(0);
    cfg.train.local_steps = 16;
    cfg.optimizer.outer.lr = lr;
    cfg.optimizer.outer.momentum = momentum;
    cfg
}

fn layout() -> Layout {
    flat_layout(N)
}

fn core(cfg: &Config) -> ShardCore {
    let spec = ShardSpec {
        shard: 0,
        shards: 1,
        seed: 1,
        optimizer: shard_optimizer(cfg),
        staleness: cfg.cluster.staleness,
        worker_timeout_ms: 60_000,
        spike_factor: 0.0,
    };
    let mut c = ShardCore::new(&layout(), &spec);
    c.set_push_scale(push_scale(cfg));
    for w in 0..WORKERS {
        c.join(w, 0);
    }
    c
}

/// θ_end of worker `w` in round `r`, started from `start`: a deterministic walk.
fn theta_end(start: &[f32], w: u32, r: u64) -> Vec<f32> {
    start
        .iter()
        .enumerate()
        .map(|(i, s)| s + (((i as u64 * 7 + u64::from(w) * 13 + r * 5) % 11) as f32 - 5.0) * 1e-2)
        .collect()
}

/// Pushes every worker's pseudo-gradient θ_start − θ_end of round `r` (lossless frames).
fn round(c: &mut ShardCore, r: u64) -> Vec<Vec<f32>> {
    let start = c.weights().to_vec();
    let mut enc = Encoder::new(CodecConfig {
        scheme: Scheme::None,
        zstd: false,
        ..CodecConfig::default()
    })
    .unwrap();
    let mut pseudo = Vec::new();
    for w in 0..WORKERS {
        let end = theta_end(&start, w, r);
        let g: Vec<f32> = start.iter().zip(&end).map(|(s, e)| s - e).collect();
        let mut frame = Vec::new();
        enc.encode(&g, 0, &mut frame).unwrap();
        c.apply(
            &Push {
                worker: w,
                clock: r,
                shard: 0,
                range: (0, N as u64),
                read_version: c.version(),
                payload: &frame,
            },
            r,
        )
        .unwrap();
        pseudo.push(g);
    }
    pseudo
}

#[test]
fn the_outer_step_is_nesterov_on_each_push_scaled_by_one_over_workers() {
    let cfg = cfg(0.7, 0.9);
    let o = shard_optimizer(&cfg);
    assert_eq!(
        (o.kind, o.lr, o.momentum),
        (cfg.optimizer.outer.kind, 0.7, 0.9)
    );
    let mut c = core(&cfg);
    // Reference: for each push g (in arrival order), b ← μ·b + g; w ← w − (lr/M)·(g + μ·b).
    let (lr, mu, m) = (0.7f32, 0.9f32, WORKERS as f32);
    let mut w_ref = c.weights().to_vec();
    let mut b = vec![0.0f32; N];
    for r in 0..4 {
        for g in round(&mut c, r) {
            for i in 0..N {
                b[i] = mu * b[i] + g[i];
                w_ref[i] -= lr / m * (g[i] + mu * b[i]);
            }
        }
        let err = c
            .weights()
            .iter()
            .zip(&w_ref)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(err <= 1e-5, "round {r}: off the reference by {err}");
    }
}

#[test]
fn outer_lr_one_without_momentum_averages_the_workers() {
    let mut c = core(&cfg(1.0, 0.0));
    for r in 0..3 {
        let start = c.weights().to_vec();
        round(&mut c, r);
        for i in 0..N {
            let mean: f32 = (0..WORKERS)
                .map(|w| theta_end(&start, w, r)[i])
                .sum::<f32>()
                / WORKERS as f32;
            assert!(
                (c.weights()[i] - mean).abs() <= 1e-5,
                "round {r}, value {i}"
            );
        }
    }
}

/// Streamed fragments (`train.fragments` = 3): push `c` carries part `c mod 3` of the range; the outer step applies
/// to that part alone (the momentum of the other parts neither moves nor decays), and a frame of any other length
/// is refused with the weights, the version and the clock untouched.
#[test]
fn a_streamed_fragment_moves_its_part_only_and_a_whole_range_frame_is_refused() {
    let mut cfg = cfg(0.7, 0.9);
    cfg.cluster.workers = 1;
    cfg.train.fragments = 3;
    let mut c = core(&cfg);
    // One worker: the others leave, so that worker 0's clock may advance alone under s = 0.
    for w in 1..WORKERS {
        c.leave(w);
    }
    c.set_push_scale(1.0);
    c.set_fragments(3);
    let mut enc = Encoder::new(CodecConfig {
        scheme: Scheme::None,
        zstd: false,
        ..CodecConfig::default()
    })
    .unwrap();
    let (lr, mu) = (0.7f32, 0.9f32);
    let mut w_ref = c.weights().to_vec();
    let mut b = vec![0.0f32; N];
    for clock in 0..7u64 {
        let part = tether_common::layout::fragment_part(N, clock, 3);
        assert_eq!(part, c.part(clock));
        // A frame of the whole range at this clock: refused, nothing moves.
        let (before, version) = (c.weights().to_vec(), c.version());
        let mut whole = Vec::new();
        enc.encode(&vec![0.5f32; N], 0, &mut whole).unwrap();
        let push = |payload| Push {
            worker: 0,
            clock,
            shard: 0,
            range: (0, N as u64),
            read_version: version,
            payload,
        };
        assert!(c.apply(&push(&whole), clock).is_err());
        assert_eq!((c.weights(), c.version()), (&before[..], version));
        // The part's pseudo-gradient is applied to the part alone.
        let g: Vec<f32> = part
            .clone()
            .map(|i| ((i as u64 * 3 + clock) % 7) as f32 * 0.01 - 0.03)
            .collect();
        let mut frame = Vec::new();
        enc.encode(&g, 0, &mut frame).unwrap();
        c.apply(&push(&frame), clock).unwrap();
        for (j, i) in part.clone().enumerate() {
            b[i] = mu * b[i] + g[j];
            w_ref[i] -= lr * (g[j] + mu * b[i]);
        }
        let err = c
            .weights()
            .iter()
            .zip(&w_ref)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(
            err <= 1e-6,
            "clock {clock}: off the per-part reference by {err}"
        );
        assert_eq!(c.version(), version + 1);
    }
}

/// A core stepping at round close (`optimizer.outer.at_close`), configured as `tether-server` configures it.
fn core_at_close(lr: f32, momentum: f32) -> (Config, ShardCore) {
    let mut cfg = cfg(lr, momentum);
    cfg.optimizer.outer.at_close = true;
    cfg.validate().unwrap();
    let mut c = core(&cfg);
    c.set_outer_at_close(tether_server::update_rule::outer_at_close(&cfg));
    assert!(c.outer_at_close());
    (cfg, c)
}

/// One lossless push of `g` by `worker` at `clock`.
fn push(c: &mut ShardCore, worker: u32, clock: u64, g: &[f32], now_ms: u64) {
    let mut enc = Encoder::new(CodecConfig {
        scheme: Scheme::None,
        zstd: false,
        ..CodecConfig::default()
    })
    .unwrap();
    let mut frame = Vec::new();
    enc.encode(g, 0, &mut frame).unwrap();
    let read_version = c.version();
    c.apply(
        &Push {
            worker,
            clock,
            shard: 0,
            range: (0, N as u64),
            read_version,
            payload: &frame,
        },
        now_ms,
    )
    .unwrap();
}

/// The largest difference between two weight vectors.
fn off(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max)
}

/// DiLoCo's outer step: once per round, on the workers' mean pseudo-gradient, b ← μ·b + ḡ; w ← w − lr·(ḡ + μ·b).
/// The weights and the version do not move until the round's last push; then by one step and one version.
#[test]
fn at_close_the_outer_step_is_one_nesterov_step_per_round_on_the_mean() {
    let (lr, mu) = (0.7f32, 0.9f32);
    let (_, mut c) = core_at_close(lr, mu);
    let mut w_ref = c.weights().to_vec();
    let mut b = vec![0.0f32; N];
    for r in 0..4u64 {
        let start = c.weights().to_vec();
        let version = c.version();
        let mut mean = vec![0.0f32; N];
        for w in 0..WORKERS {
            let end = theta_end(&start, w, r);
            let g: Vec<f32> = start.iter().zip(&end).map(|(s, e)| s - e).collect();
            for (m, gi) in mean.iter_mut().zip(&g) {
                *m += gi / WORKERS as f32;
            }
            push(&mut c, w, r, &g, r);
            if w + 1 < WORKERS {
                assert_eq!(c.weights(), &start[..], "round {r}: moved before its close");
                assert_eq!(c.version(), version);
                assert_eq!(c.pending_rounds().collect::<Vec<_>>(), vec![r]);
            }
        }
        assert_eq!(c.version(), version + 1, "round {r}: one step per round");
        assert_eq!(c.pending_rounds().count(), 0);
        for i in 0..N {
            b[i] = mu * b[i] + mean[i];
            w_ref[i] -= lr * (mean[i] + mu * b[i]);
        }
        let err = off(c.weights(), &w_ref);
        assert!(err <= 1e-5, "round {r}: off the reference by {err}");
    }
    assert_eq!(c.stats().rounds_stepped, 4);
    assert_eq!(c.stats().updates_applied, 4 * u64::from(WORKERS));
}

/// A round that closes because its last owing worker left is stepped on the pushes it has; the last worker's
/// goodbye steps what is left, since nobody is live to close it.
#[test]
fn at_close_a_goodbye_closes_the_round_and_the_last_goodbye_steps_what_is_left() {
    let (_, mut c) = core_at_close(1.0, 0.0);
    let start = c.weights().to_vec();
    let g: Vec<f32> = (0..N).map(|i| (i % 5) as f32 * 0.1).collect();
    push(&mut c, 0, 0, &g, 1);
    push(&mut c, 1, 0, &g, 2);
    assert_eq!(c.weights(), &start[..]);
    c.leave(2);
    // Two pushes of the three workers' round, each at 1/3: the step is 2/3 of g (lr 1, no momentum).
    let want: Vec<f32> = start
        .iter()
        .zip(&g)
        .map(|(s, x)| s - x * 2.0 / 3.0)
        .collect();
    assert!(off(c.weights(), &want) <= 1e-6);
    push(&mut c, 0, 1, &g, 3);
    assert_eq!(c.pending_rounds().collect::<Vec<_>>(), vec![1]);
    c.leave(0);
    assert_eq!(
        c.pending_rounds().collect::<Vec<_>>(),
        vec![1],
        "worker 1 is live and owes round 1"
    );
    c.leave(1);
    assert_eq!(c.pending_rounds().count(), 0, "nobody is live to close it");
    let want: Vec<f32> = want.iter().zip(&g).map(|(s, x)| s - x / 3.0).collect();
    assert!(off(c.weights(), &want) <= 1e-6);
}

/// With a quorum of 2 of 3, round 0 closes on two pushes after the grace window; the third worker's push of round 0
/// then comes late and joins round 1's sum, at the same weight.
#[test]
fn at_close_a_laggards_late_push_joins_the_open_round() {
    let (_, mut c) = core_at_close(1.0, 0.0);
    c.set_quorum(tether_server::quorum::QuorumSettings {
        quorum: 2,
        grace_factor: 1.0,
        grace_max_ms: 100,
    });
    let start = c.weights().to_vec();
    let g0: Vec<f32> = (0..N).map(|i| (i % 3) as f32 * 0.1).collect();
    let g1: Vec<f32> = (0..N).map(|i| (i % 7) as f32 * 0.01).collect();
    push(&mut c, 0, 0, &g0, 0);
    push(&mut c, 1, 0, &g0, 0);
    assert_eq!(c.weights(), &start[..], "the grace window is still open");
    assert!(c.settle(200) > 0, "the grace window ended");
    let after0: Vec<f32> = start
        .iter()
        .zip(&g0)
        .map(|(s, x)| s - x * 2.0 / 3.0)
        .collect();
    assert!(off(c.weights(), &after0) <= 1e-6);
    // Worker 2's round 0 comes after the close: it waits in round 1's sum.
    let late: Vec<f32> = (0..N).map(|i| (i % 4) as f32 * 0.05).collect();
    push(&mut c, 2, 0, &late, 250);
    assert_eq!(c.pending_rounds().collect::<Vec<_>>(), vec![1]);
    assert!(off(c.weights(), &after0) <= 1e-6);
    for w in 0..WORKERS {
        push(&mut c, w, 1, &g1, 300);
    }
    let want: Vec<f32> = after0
        .iter()
        .zip(g1.iter().zip(&late))
        .map(|(s, (a, l))| s - (3.0 * a + l) / 3.0)
        .collect();
    assert!(off(c.weights(), &want) <= 1e-6);
}

/// The open rounds' sums are state: a snapshot taken mid-round and restored into a fresh shard ends the round on the
/// same bits as the shard it came from, also when the restored shard streams fragments set after the restore.
#[test]
fn at_close_a_snapshot_mid_round_carries_the_open_sum() {
    let (cfg, mut c) = core_at_close(0.7, 0.5);
    let g: Vec<f32> = (0..N).map(|i| (i % 9) as f32 * 0.02 - 0.08).collect();
    push(&mut c, 0, 0, &g, 1);
    push(&mut c, 1, 0, &g, 1);
    let snap = c.snapshot();
    assert_eq!(snap.pending.len(), 1);
    let mut d = core(&cfg);
    d.restore(snap, 1).unwrap();
    d.set_fragments(1);
    d.set_outer_at_close(true);
    assert_eq!(d.pending_rounds().collect::<Vec<_>>(), vec![0]);
    push(&mut c, 2, 0, &g, 2);
    push(&mut d, 2, 0, &g, 2);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(c.weights()), bits(d.weights()));
    assert_eq!(c.version(), d.version());
    // A sum of the wrong length is refused before anything changes.
    let mut bad = c.snapshot();
    bad.pending = vec![(5, vec![0.0; N - 1])];
    let before = bits(d.weights());
    assert!(d.restore(bad, 3).is_err());
    assert_eq!(bits(d.weights()), before);
}

/// Stepping at close needs local-step rounds and a bounded staleness.
#[test]
fn at_close_is_refused_without_rounds_or_with_unbounded_staleness() {
    let mut cfg = cfg(0.7, 0.5);
    cfg.optimizer.outer.at_close = true;
    cfg.validate().unwrap();
    cfg.cluster.staleness = Staleness::Unbounded;
    assert!(cfg.validate().is_err());
    cfg.cluster.staleness = Staleness::Bounded(62);
    cfg.validate().unwrap();
    cfg.cluster.staleness = Staleness::Bounded(63);
    assert!(cfg.validate().is_err());
    cfg.cluster.staleness = Staleness::Bounded(0);
    cfg.train.local_steps = 0;
    assert!(cfg.validate().is_err());
}

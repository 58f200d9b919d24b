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

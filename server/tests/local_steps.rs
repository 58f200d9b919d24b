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

//! Optimizer apply throughput on 16M parameters, next to a memory-only kernel with Adam's traffic (read w, m, v, g;
//! write w, m, v) so the ratio to the memory bound is visible, plus the checkpoint write time of a 16M-param shard.
//!
//! `cargo bench -p tether-server --bench optim -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;
use std::time::Instant;

use criterion::{criterion_main, Criterion, Throughput};
use tether_common::config::{OptimizerConfig, OptimizerKind};
use tether_common::testing::noise;
use tether_server::checkpoint::{CheckpointStore, ShardSnapshot};
use tether_server::optim::Optimizer;

const N: usize = 16 << 20;

fn grad(n: usize) -> Vec<f32> {
    noise(n, 0x9e37_79b9_7f4a_7c15, 1e-2)
}

fn weights(n: usize) -> Vec<f32> {
    noise(n, 0x2545_f491_4f6c_dd1d, 0.1)
}

/// Same loads and stores as Adam, trivially cheap arithmetic: the memory bound.
#[inline(never)]
fn memory_kernel(w: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], c: [f32; 3]) {
    let n = w.len();
    let (m, v, g) = (&mut m[..n], &mut v[..n], &g[..n]);
    for i in 0..n {
        w[i] += g[i] * c[0];
        m[i] += c[1];
        v[i] += c[2];
    }
}

fn bench_optim(c: &mut Criterion) {
    let g = grad(N);
    let mut group = c.benchmark_group("optim_16M");
    group.throughput(Throughput::Elements(N as u64));
    group.sample_size(10);

    for (name, kind, wd, portable) in [
        ("adam", OptimizerKind::Adam, 0.0, false),
        ("adamw", OptimizerKind::Adamw, 0.01, false),
        ("adam_portable", OptimizerKind::Adam, 0.0, true),
        ("sgd", OptimizerKind::Sgd, 0.0, false),
        ("momentum", OptimizerKind::Momentum, 0.0, false),
    ] {
        let cfg = OptimizerConfig {
            kind,
            weight_decay: wd,
            ..OptimizerConfig::default()
        };
        let mut opt = Optimizer::new(&cfg, N);
        if portable {
            opt = opt.with_portable_kernels();
        }
        let mut w = weights(N);
        group.bench_function(name, |b| {
            b.iter(|| opt.step(black_box(&mut w), black_box(&g), 1.0))
        });
    }

    let (mut w, mut m, mut v) = (weights(N), vec![0.0f32; N], vec![0.0f32; N]);
    group.bench_function("memory_kernel", |b| {
        b.iter(|| {
            memory_kernel(
                black_box(&mut w),
                &mut m,
                &mut v,
                black_box(&g),
                [1e-3, 1e-7, 1e-9],
            )
        })
    });
    group.finish();
}

/// One timed checkpoint write of 16M weights plus two Adam slots (printed, not a criterion sample: it hits disk).
fn bench_checkpoint(_c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = CheckpointStore::new(
        dir.path().to_path_buf(),
        3,
        tether_common::pki::CheckpointKey::from_bytes([1; 32]),
    );
    let mut opt = Optimizer::new(&OptimizerConfig::default(), N);
    let mut w = weights(N);
    let g = grad(N);
    for _ in 0..3 {
        opt.step(&mut w, &g, 1.0);
    }
    let snap = ShardSnapshot {
        layout_hash: 0x7e7e,
        shard: 0,
        range: (0, N as u64),
        version: 3,
        opt_steps: opt.steps(),
        clocks: vec![(0, 3), (1, 3)],
        evicted: Vec::new(),
        weights: w,
        slots: opt.slots().to_vec(),
        pending: Vec::new(),
    };
    for round in 0..2 {
        let snap = ShardSnapshot {
            version: snap.version + round,
            ..snap.clone()
        };
        let t0 = Instant::now();
        let path = store.write(&snap).expect("checkpoint write");
        let secs = t0.elapsed().as_secs_f64();
        let stored: u64 = std::fs::read_dir(&path)
            .expect("read checkpoint dir")
            .map(|e| e.expect("dir entry").metadata().expect("metadata").len())
            .sum();
        let t1 = Instant::now();
        let loaded = store
            .load_latest(snap.layout_hash, 0, snap.range)
            .expect("checkpoint load")
            .expect("a checkpoint");
        let load_secs = t1.elapsed().as_secs_f64();
        assert_eq!(loaded.0.version, snap.version);
        println!(
            "checkpoint_16M_adam: write {secs:.3} s, load {load_secs:.3} s, raw {:.1} MB -> stored {:.1} MB",
            (3 * N * 4) as f64 / 1e6,
            stored as f64 / 1e6
        );
    }
}

/// Criterion's generated entry point lives in a private module so it needs no public docs.
mod groups {
    criterion::criterion_group!(benches, super::bench_optim, super::bench_checkpoint);
}
criterion_main!(groups::benches);

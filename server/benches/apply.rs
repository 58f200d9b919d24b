//! The shard's hot paths: a q4 push through `ShardCore::apply` (validate, decode into scratch, finiteness and norm,
//! Adam step) at 1M and 8M parameters per shard, next to the bare Adam step on the same size so the cost of
//! validation and decoding is visible; and the pull path (`protocol::encode_values`, f32 → little-endian bytes) at 8M
//! parameters next to a plain memcpy of the same bytes. Criterion reports elements/s = parameters/s; frames/s is
//! that divided by the shard size.
//!
//! `cargo bench -p tether-server --bench apply -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;

use criterion::{criterion_main, Criterion, Throughput};
use tether_common::codec::{CodecConfig, Encoder};
use tether_common::config::{OptimizerConfig, OptimizerKind, Staleness};
use tether_common::layout::{Init, Layout, TensorSpec};
use tether_common::protocol::encode_values;
use tether_common::protocol::Precision;
use tether_common::testing::noise;
use tether_server::optim::Optimizer;
use tether_server::shard::{Push, ShardCore, ShardSpec};

fn shard_of(n: usize) -> ShardCore {
    let layout = Layout::new(vec![TensorSpec::new(
        "w",
        &[n],
        Init::Uniform { bound: 0.1 },
    )]);
    let spec = ShardSpec {
        shard: 0,
        shards: 1,
        seed: 1,
        optimizer: OptimizerConfig {
            kind: OptimizerKind::Adam,
            ..OptimizerConfig::default()
        },
        staleness: Staleness::Unbounded,
        worker_timeout_ms: u64::MAX,
        spike_factor: 10.0,
    };
    ShardCore::new(&layout, &spec)
}

fn bench_apply(c: &mut Criterion) {
    for (label, n) in [("1M", 1usize << 20), ("8M", 8 << 20)] {
        let mut group = c.benchmark_group(format!("shard_{label}"));
        group.throughput(Throughput::Elements(n as u64));
        group.sample_size(10);

        // Eight distinct frames so the spike guard sees realistic, varying norms.
        let mut enc = Encoder::new(CodecConfig::default()).unwrap();
        let frames: Vec<Vec<u8>> = (0..8)
            .map(|k| {
                let mut f = Vec::new();
                enc.encode(&noise(n, 0x9e37_79b9 + k, 1e-2), k, &mut f)
                    .unwrap();
                f
            })
            .collect();
        let mut core = shard_of(n);
        core.join(0, 0);
        let mut clock = 0u64;
        group.bench_function("apply_q4_adam", |b| {
            b.iter(|| {
                let push = Push {
                    worker: 0,
                    clock,
                    shard: 0,
                    range: (0, n as u64),
                    read_version: core.version(),
                    payload: &frames[(clock % 8) as usize],
                };
                clock += 1;
                black_box(core.apply(&push, 0).unwrap());
            })
        });
        drop(core);

        let g = noise(n, 7, 1e-2);
        let mut w = noise(n, 11, 0.1);
        let mut opt = Optimizer::new(&OptimizerConfig::default(), n);
        group.bench_function("adam_step", |b| {
            b.iter(|| opt.step(black_box(&mut w), black_box(&g), 1.0))
        });
        group.finish();
    }

    let n = 8usize << 20;
    let w = noise(n, 13, 0.1);
    let mut group = c.benchmark_group("pull_8M");
    group.throughput(Throughput::Bytes(4 * n as u64));
    group.sample_size(20);
    let mut out = Vec::with_capacity(4 * n);
    group.bench_function("encode_values_f32", |b| {
        b.iter(|| encode_values(black_box(&w), Precision::F32, &mut out))
    });
    group.bench_function("encode_values_bf16", |b| {
        b.iter(|| encode_values(black_box(&w), Precision::Bf16, &mut out))
    });
    let src: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut dst = vec![0u8; src.len()];
    group.bench_function("memcpy", |b| {
        b.iter(|| dst.copy_from_slice(black_box(&src)))
    });
    group.bench_function("fresh_vec_f32", |b| {
        b.iter(|| {
            let mut v = Vec::new();
            encode_values(black_box(&w), Precision::F32, &mut v);
            v
        })
    });
    group.finish();
}

fn benches() {
    let mut c = Criterion::default().configure_from_args();
    bench_apply(&mut c);
}

criterion_main!(benches);

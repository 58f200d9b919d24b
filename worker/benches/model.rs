//! Model throughput: MLP 784-256-128-10 `loss_and_grad` at batch 128 (the training step's compute) and `predict` at
//! batch 1000 (evaluation), reported in samples per second.
//!
//! `cargo bench -p tether-worker --bench model -- --warm-up-time 1 --measurement-time 3`

// criterion_group! generates an undocumented `pub fn`.
#![allow(missing_docs)]

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use tether_common::testing::TestRng;
use tether_worker::model::{LogReg, Mlp, Model};

fn synthetic(rows: usize, features: usize, classes: u32) -> (Vec<f32>, Vec<u32>) {
    let mut rng = TestRng::new(7);
    let x = (0..rows * features).map(|_| rng.next_f32()).collect();
    let y = (0..rows)
        .map(|_| rng.below(u64::from(classes)) as u32)
        .collect();
    (x, y)
}

fn bench_model(c: &mut Criterion, name: &str, mut model: Box<dyn Model>) {
    let params = model.layout().init_all(42);
    let mut grad = vec![0.0; params.len()];
    let mut group = c.benchmark_group(name);

    let (x, y) = synthetic(128, model.features(), model.classes() as u32);
    group.throughput(Throughput::Elements(128));
    group.bench_function("loss_and_grad/batch128", |b| {
        b.iter(|| black_box(model.loss_and_grad(black_box(&params), &x, &y, &mut grad)))
    });

    let (x, _) = synthetic(1000, model.features(), model.classes() as u32);
    let mut out = vec![0u32; 1000];
    group.throughput(Throughput::Elements(1000));
    group.bench_function("predict/batch1000", |b| {
        b.iter(|| {
            model.predict(black_box(&params), &x, &mut out);
            black_box(out[0])
        })
    });
    group.finish();
}

fn models(c: &mut Criterion) {
    bench_model(
        c,
        "mlp_784_256_128_10",
        Box::new(Mlp::new(784, &[256, 128], 10)),
    );
    bench_model(c, "logreg_784_10", Box::new(LogReg::new(784, 10)));
}

criterion_group!(benches, models);
criterion_main!(benches);

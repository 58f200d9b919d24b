//! Codec throughput in GB/s of fp32 input: encode/decode per scheme and kernel, error feedback, zstd on/off, against
//! memcpy of the same bytes in the same group. Run: `cargo bench -p tether-common --bench codec`.

#![allow(missing_docs)] // criterion_group! generates an undocumented pub fn.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use tether_common::codec::*;
use tether_common::testing::TestRng;

fn gradient(n: usize) -> Vec<f32> {
    let mut rng = TestRng::new(0x1234_5678_9ABC_DEF0);
    (0..n)
        .map(|_| {
            let s = rng.next_u64();
            // Sum of uniforms: roughly gaussian, cheap to generate.
            let a = (s & 0xFFFF) as f32 + ((s >> 16) & 0xFFFF) as f32 + ((s >> 32) & 0xFFFF) as f32;
            (a / 98304.0 - 1.0) * 1e-2
        })
        .collect()
}

fn cfg(scheme: Scheme, zstd: bool) -> CodecConfig {
    CodecConfig {
        scheme,
        zstd,
        ..CodecConfig::default()
    }
}

fn bench_size(c: &mut Criterion, label: &str, n: usize, schemes: &[Scheme], extras: bool) {
    let x = gradient(n);
    let mut g = c.benchmark_group(label);
    g.throughput(Throughput::Bytes(4 * n as u64));
    let mut dst = vec![0f32; n];
    g.bench_function("memcpy", |b| {
        b.iter(|| {
            dst.copy_from_slice(black_box(&x));
            black_box(&dst);
        })
    });
    let mut frame = Vec::with_capacity(max_encoded_len(&cfg(Scheme::None, false), n));
    let mut out = vec![0f32; n];
    let mut kernels = vec![Kernel::detect()];
    if extras && Kernel::detect() != Kernel::Scalar {
        kernels.push(Kernel::Scalar);
    }
    for &scheme in schemes {
        for &kernel in &kernels {
            if kernel == Kernel::Scalar && kernels.len() > 1 && !scheme.is_quantized() {
                continue;
            }
            let id = |op: &str| BenchmarkId::new(format!("{op}/{kernel:?}"), scheme);
            let mut enc = Encoder::with_kernel(cfg(scheme, false), kernel).unwrap();
            g.bench_function(id("encode"), |b| {
                b.iter(|| enc.encode(black_box(&x), 7, &mut frame).unwrap())
            });
            enc.encode(&x, 7, &mut frame).unwrap();
            let mut dec = Decoder::with_kernel(n, kernel).unwrap();
            g.bench_function(id("decode"), |b| {
                b.iter(|| dec.decode(black_box(&frame), &mut out).unwrap())
            });
        }
    }
    if extras {
        let mut enc = Encoder::new(cfg(Scheme::Q4, false)).unwrap();
        let mut ef = ErrorFeedback::new(n);
        g.bench_function("ef_encode/q4", |b| {
            b.iter(|| ef.encode(&mut enc, black_box(&x), 7, &mut frame).unwrap())
        });
        let mut zenc = Encoder::new(cfg(Scheme::Q4, true)).unwrap();
        g.bench_function("encode_zstd/q4", |b| {
            b.iter(|| zenc.encode(black_box(&x), 7, &mut frame).unwrap())
        });
        zenc.encode(&x, 7, &mut frame).unwrap();
        let mut dec = Decoder::new(n);
        g.bench_function("decode_zstd/q4", |b| {
            b.iter(|| dec.decode(black_box(&frame), &mut out).unwrap())
        });
    }
    g.finish();
}

/// Best-of-N wall time per operation, printed as GB/s of fp32 input: on a shared, oversubscribed machine the minimum
/// is the figure least distorted by preemption (criterion's estimates include descheduled time).
fn best_of(n: usize, reps: usize) {
    let x = gradient(n);
    let mut dst = vec![0f32; n];
    let mut frame = Vec::new();
    let mut out = vec![0f32; n];
    let gbs = |mut f: Box<dyn FnMut() + '_>| {
        let mut best = f64::MAX;
        for _ in 0..reps {
            let t = std::time::Instant::now();
            f();
            best = best.min(t.elapsed().as_secs_f64());
        }
        (4 * n) as f64 / best / 1e9
    };
    let memcpy = gbs(Box::new(|| {
        dst.copy_from_slice(black_box(&x));
        black_box(&dst);
    }));
    println!("best-of-{reps} n={n}: memcpy {memcpy:.2} GB/s");
    for scheme in Scheme::ALL {
        let mut enc = Encoder::new(cfg(scheme, false)).unwrap();
        let e = gbs(Box::new(|| {
            enc.encode(black_box(&x), 7, &mut frame).unwrap()
        }));
        enc.encode(&x, 7, &mut frame).unwrap();
        let mut dec = Decoder::new(n);
        let d = gbs(Box::new(|| {
            dec.decode(black_box(&frame), &mut out).unwrap();
        }));
        println!(
            "best-of-{reps} n={n}: {scheme:<4} encode {e:6.2} GB/s ({:.2}x memcpy)  decode {d:6.2} GB/s ({:.2}x memcpy)",
            e / memcpy,
            d / memcpy
        );
    }
}

fn codec(c: &mut Criterion) {
    best_of(1 << 20, 60);
    best_of(1 << 24, 8);
    bench_size(c, "codec_1M", 1 << 20, &Scheme::ALL, true);
    bench_size(
        c,
        "codec_16M",
        1 << 24,
        &[Scheme::Q4, Scheme::Q8, Scheme::Q2],
        false,
    );
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = codec
}
criterion_main!(benches);

//! The shard's chunked kernels alone, at 1 and at 2 threads (or any counts): `ShardCore::apply` (open and
//! decompress, decode and norm in chunks, the optimizer's check and apply passes in chunks) for q4 and topk2 pushes
//! with Adam and with the outer Nesterov step of local-step rounds (on every push, and at round close with 8 pushes a
//! round, `optimizer.outer.at_close`), the public copy's q4 delta cut, and the phases
//! of a q4 + Adam apply alone (open: zstd on one thread; decode and norm; the optimizer's passes). Frames and
//! settings are `tether-bench ingest`'s defaults (bucket 512, keep 64, stochastic rounding, zstd). Each repeat
//! measures every thread count back to back, so a neighbour's load shows in both; figures are fp32-equivalent GB/s
//! (4 bytes per shard parameter per push or cut), the mean and the best single push or cut (the one no neighbour's
//! load slowed: on a shared machine the fairer ratio).
//!
//! `cargo run --release -p tether-server --example apply_threads -- [PARAMS] [SECONDS] [REPEATS] [THREADS,...]`
//! (defaults: 4000000 parameters, 1.5 s per figure, 3 repeats, threads 1,2)

use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use tether_common::chunk_pool::{ChunkPool, CHUNK_VALUES};
use tether_common::codec::{seed_for, Decoder, Encoder, Scheme};
use tether_common::config::{Config, Staleness};
use tether_common::layout::{Init, Layout, TensorSpec};
use tether_common::testing::noise;
use tether_server::decode::decode_and_square;
use tether_server::optim::Optimizer;
use tether_server::public::PublicCopy;
use tether_server::shard::{Push, ShardCore, ShardSpec};
use tether_server::update_rule::{outer_at_close, push_scale, shard_optimizer};

/// GB/s of fp32 (4 bytes × `n` per call of `f`) over at least `seconds`: the mean, and the best single call (the
/// one no neighbour's load slowed).
fn gbps(n: usize, seconds: f64, mut f: impl FnMut()) -> (f64, f64) {
    f();
    let t0 = Instant::now();
    let mut k = 0u64;
    let mut best = f64::INFINITY;
    while t0.elapsed().as_secs_f64() < seconds || k < 3 {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
        k += 1;
    }
    let gb = 4.0 * n as f64 / 1e9;
    (gb * k as f64 / t0.elapsed().as_secs_f64(), gb / best)
}

fn config(scheme: Scheme, outer: bool) -> Config {
    let mut cfg = Config::with_servers(vec!["127.0.0.1:1".into()]);
    cfg.cluster.workers = 2;
    cfg.compression.scheme = scheme;
    if outer {
        cfg.train.local_steps = 1;
    }
    cfg
}

/// `ShardCore::apply` of 8 distinct frames in turn, at `threads` threads.
fn apply(cfg: &Config, n: usize, threads: usize, seconds: f64) -> (f64, f64) {
    apply_rounds(cfg, n, threads, seconds, 1)
}

/// `ShardCore::apply` of 8 distinct frames in turn by `workers` workers, round by round (each worker pushes clock c,
/// then clock c + 1), at `threads` threads. Stepping at close (`optimizer.outer.at_close`), each push adds to the
/// round's sum and the round's last push also runs the outer step: the figure is per push, the step shared out.
fn apply_rounds(cfg: &Config, n: usize, threads: usize, seconds: f64, workers: u32) -> (f64, f64) {
    let layout = Layout::new(vec![TensorSpec::new(
        "w",
        &[n],
        Init::Uniform { bound: 0.1 },
    )]);
    let spec = ShardSpec {
        shard: 0,
        shards: 1,
        seed: 1,
        optimizer: shard_optimizer(cfg),
        staleness: if workers > 1 {
            Staleness::Bounded(0)
        } else {
            Staleness::Unbounded
        },
        worker_timeout_ms: u64::MAX,
        spike_factor: 0.0,
    };
    let mut core = ShardCore::new(&layout, &spec);
    core.set_pool(Arc::new(
        ChunkPool::new(threads, "apply-threads").expect("threads"),
    ));
    core.set_push_scale(push_scale(cfg));
    core.set_outer_at_close(outer_at_close(cfg));
    for w in 0..workers {
        core.join(w, 0);
    }
    let mut enc = Encoder::new(cfg.compression.codec()).expect("codec");
    let frames: Vec<Vec<u8>> = (0..8)
        .map(|k| {
            let mut f = Vec::new();
            enc.encode(&noise(n, 0x9e37 + k, 1e-2), seed_for(0, k, 0), &mut f)
                .expect("encode");
            f
        })
        .collect();
    let mut k = 0u64;
    let w = u64::from(workers);
    gbps(n, seconds, || {
        let push = Push {
            worker: (k % w) as u32,
            clock: k / w,
            shard: 0,
            range: (0, n as u64),
            read_version: core.version(),
            payload: &frames[(k % 8) as usize],
        };
        k += 1;
        black_box(core.apply(&push, 0).expect("apply"));
    })
}

/// `PublicCopy::cut` (q4 pull deltas, zstd) of weights that move by a step each time (two weight vectors in turn,
/// so that nothing but the cut is timed), at `threads` threads.
fn cut(n: usize, threads: usize, seconds: f64) -> (f64, f64) {
    let codec = Config::with_servers(vec![]).compression.pull_codec();
    let a = noise(n, 21, 0.1);
    let b: Vec<f32> = a
        .iter()
        .zip(noise(n, 23, 1e-3))
        .map(|(w, d)| w + d)
        .collect();
    let pool = Arc::new(ChunkPool::new(threads, "apply-threads").expect("threads"));
    let mut public = PublicCopy::new(&a, 1, 0, 0, codec, 1 << 30)
        .expect("codec")
        .with_pool(pool);
    let mut version = 0u64;
    gbps(n, seconds, || {
        version += 1;
        let weights = if version.is_multiple_of(2) { &a } else { &b };
        public
            .cut(black_box(weights), version, version)
            .expect("cut");
        black_box(public.values());
    })
}

/// The phases of a q4 + Adam apply alone: opening the frame (zstd, one thread), decode and norm in chunks, and the
/// optimizer's two passes in chunks over a decoded gradient.
fn phase(which: &str, n: usize, threads: usize, seconds: f64) -> (f64, f64) {
    let cfg = config(Scheme::Q4, false);
    let mut frame = Vec::new();
    Encoder::new(cfg.compression.codec())
        .expect("codec")
        .encode(&noise(n, 0x9e37, 1e-2), 1, &mut frame)
        .expect("encode");
    let pool = ChunkPool::new(threads, "apply-threads").expect("threads");
    let mut dec = Decoder::new(n);
    let mut g = vec![0.0f32; n];
    match which {
        "open" => gbps(n, seconds, || {
            black_box(dec.open(black_box(&frame), n).expect("open"));
        }),
        "decode" => {
            let raw = dec.open(&frame, n).expect("open");
            gbps(n, seconds, || {
                black_box(decode_and_square(&pool, &raw, &mut g).expect("decode"));
            })
        }
        _ => {
            dec.decode(&frame, &mut g).expect("decode");
            let mut w = noise(n, 11, 0.1);
            // "outer": the outer Nesterov step of local-step rounds over a decoded pseudo-gradient.
            let opt_cfg = if which == "outer" {
                shard_optimizer(&config(Scheme::Topk2, true))
            } else {
                shard_optimizer(&cfg)
            };
            let mut opt = Optimizer::new(&opt_cfg, n);
            gbps(n, seconds, || {
                opt.try_step_part_on(&pool, CHUNK_VALUES, 0..n, &mut w, &g, 1.0)
                    .expect("step");
            })
        }
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let n: usize = args
        .next()
        .and_then(|a| a.parse().ok())
        .unwrap_or(4_000_000);
    let seconds: f64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(1.5);
    let repeats: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(3);
    let threads: Vec<usize> = args
        .next()
        .map(|a| a.split(',').filter_map(|t| t.parse().ok()).collect())
        .unwrap_or_else(|| vec![1, 2]);
    println!(
        "{n} parameters, {seconds} s per figure; fp32-equivalent GB/s at threads {threads:?}, each repeat in turn: \
         mean (best single push or cut)"
    );
    type Case = Box<dyn Fn(usize) -> (f64, f64)>;
    let applies = [
        ("apply q4 + adam", Scheme::Q4, false),
        ("apply topk2 + adam", Scheme::Topk2, false),
        ("apply q4 + outer nesterov", Scheme::Q4, true),
        ("apply topk2 + outer nesterov", Scheme::Topk2, true),
    ];
    let mut cases: Vec<(&str, Case)> = applies
        .into_iter()
        .map(|(name, scheme, outer)| {
            let f: Case = Box::new(move |t| apply(&config(scheme, outer), n, t, seconds));
            (name, f)
        })
        .collect();
    for (name, at_close) in [
        ("topk2 + outer, 8 a round", false),
        ("topk2 + outer at close, 8", true),
    ] {
        let mut cfg = config(Scheme::Topk2, true);
        cfg.cluster.workers = 8;
        cfg.optimizer.outer.at_close = at_close;
        cases.push((
            name,
            Box::new(move |t| apply_rounds(&cfg, n, t, seconds, 8)),
        ));
    }
    cases.push((
        "delta cut (q4 pulls)",
        Box::new(move |t| cut(n, t, seconds)),
    ));
    for (name, which) in [
        ("  q4 + adam: open (zstd)", "open"),
        ("  q4 + adam: decode + norm", "decode"),
        ("  q4 + adam: optimizer passes", "step"),
        ("  outer nesterov passes", "outer"),
    ] {
        cases.push((name, Box::new(move |t| phase(which, n, t, seconds))));
    }
    for (name, case) in &cases {
        let mut rows: Vec<Vec<(f64, f64)>> = vec![Vec::new(); threads.len()];
        for _ in 0..repeats {
            for (row, &t) in rows.iter_mut().zip(&threads) {
                row.push(case(t));
            }
        }
        for (row, t) in rows.iter().zip(&threads) {
            let list: Vec<String> = row
                .iter()
                .map(|(g, b)| format!("{g:.3} ({b:.3})"))
                .collect();
            let ratio: Vec<String> = row
                .iter()
                .zip(&rows[0])
                .map(|(g, one)| format!("{:.2} ({:.2})", g.0 / one.0, g.1 / one.1))
                .collect();
            println!(
                "{name:<30} {t} threads: {}   (× 1 thread: {})",
                list.join(" "),
                ratio.join(" ")
            );
        }
    }
}

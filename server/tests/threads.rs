//! A shard on more threads computes the same bits: the same q4 and topk2 pushes, applied with Adam (weight decay
//! with an exempt bias that straddles a chunk boundary) and with the outer Nesterov step of local-step rounds
//! (streamed in two fragments), give bit-identical weights, optimizer state, push norms and pull bytes at 1, 2 and 3
//! threads. The range is 3.5 chunks long, so every pass has several chunks and a short last one.

use std::sync::Arc;

use tether_common::chunk_pool::ChunkPool;
use tether_common::codec::{seed_for, Encoder, Scheme};
use tether_common::config::{Config, DecayScope, OptimizerKind, Staleness};
use tether_common::layout::{Init, Layout, TensorSpec};
use tether_common::protocol::PublicRef;
use tether_common::testing::noise;
use tether_server::public::Answer;
use tether_server::shard::{Push, ShardCore, ShardSpec};
use tether_server::update_rule::{push_scale, shard_optimizer};

const WORKERS: u32 = 2;
const ROUNDS: u64 = 6;

/// 228,000 values: a matrix, a bias over the chunk boundary at 131,072, another matrix.
fn layout() -> Layout {
    let u = Init::Uniform { bound: 0.1 };
    Layout::new(vec![
        TensorSpec::new("a", &[300, 400], u),
        TensorSpec::new("bias", &[20_000], u),
        TensorSpec::new("b", &[220, 400], u),
    ])
}

/// The cluster settings of one case: push scheme, and Adam per step or the outer Nesterov step of local steps.
fn config(scheme: Scheme, outer: bool) -> Config {
    let mut cfg = Config::with_servers(vec!["127.0.0.1:1".into()]);
    cfg.cluster.workers = WORKERS;
    cfg.cluster.staleness = Staleness::Bounded(1);
    let z = &mut cfg.compression;
    z.scheme = scheme;
    z.pull_scheme = scheme;
    if scheme == Scheme::Topk2 {
        z.bucket = 4096;
        z.keep = 16;
    }
    if outer {
        cfg.train.local_steps = 8;
        cfg.train.fragments = 2;
    } else {
        cfg.optimizer.kind = OptimizerKind::Adam;
        cfg.optimizer.weight_decay = 0.01;
        cfg.optimizer.decay = DecayScope::Matrices;
    }
    cfg
}

/// Everything a run leaves that must not depend on the thread count, as bits.
#[derive(Debug, PartialEq, Eq)]
struct Trace {
    /// The weights after each round.
    weights: Vec<Vec<u32>>,
    /// The shard's largest push norm after each push.
    norms: Vec<u32>,
    /// Every pull answer's bytes, in order.
    pulls: Vec<Vec<u8>>,
    /// The optimizer's state and the public copy at the end.
    slots: Vec<Vec<u32>>,
    public: Vec<u32>,
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn run(cfg: &Config, threads: usize) -> Trace {
    let layout = layout();
    let spec = ShardSpec {
        shard: 0,
        shards: 1,
        seed: 3,
        optimizer: shard_optimizer(cfg),
        staleness: cfg.cluster.staleness,
        worker_timeout_ms: 60_000,
        spike_factor: 0.0,
    };
    let mut core = ShardCore::new(&layout, &spec);
    core.set_pool(Arc::new(ChunkPool::new(threads, "tether-test").unwrap()));
    core.set_push_scale(push_scale(cfg));
    core.set_fragments(cfg.train.fragments);
    core.set_public(cfg.compression.pull_codec(), 7);
    for w in 0..WORKERS {
        core.join(w, 0);
    }
    let mut enc = Encoder::new(cfg.compression.codec()).unwrap();
    let mut trace = Trace {
        weights: Vec::new(),
        norms: Vec::new(),
        pulls: Vec::new(),
        slots: Vec::new(),
        public: Vec::new(),
    };
    let mut held: Option<PublicRef> = None;
    let mut frame = Vec::new();
    for r in 0..ROUNDS {
        let read = core.version();
        for w in 0..WORKERS {
            let part = core.part(r);
            let g = noise(part.len(), 1 + r * 7 + u64::from(w), 1e-2);
            enc.encode(&g, seed_for(w, r, 0), &mut frame).unwrap();
            let push = Push {
                worker: w,
                clock: r,
                shard: 0,
                range: (0, layout.len() as u64),
                read_version: read,
                payload: &frame,
            };
            core.apply(&push, r).unwrap();
            trace.norms.push(core.stats().max_push_norm.to_bits());
        }
        trace.weights.push(bits(core.weights()));
        let a = core.answer_public(held).unwrap();
        held = Some(a.newest);
        trace.pulls.push(match a.answer {
            Answer::NotModified => Vec::new(),
            Answer::Full(b) => b.to_vec(),
            Answer::Deltas { cuts, lens, .. } => {
                let mut out: Vec<u8> = lens.iter().flat_map(|l| l.to_le_bytes()).collect();
                cuts.iter().for_each(|c| out.extend_from_slice(c));
                out
            }
        });
    }
    let snap = core.snapshot();
    trace.slots = snap.slots.iter().map(|s| bits(s)).collect();
    trace.public = bits(core.public().unwrap().values());
    trace
}

#[test]
fn weights_state_norms_and_pull_bytes_are_the_same_bits_at_1_2_and_3_threads() {
    for scheme in [Scheme::Q4, Scheme::Topk2] {
        for outer in [false, true] {
            let cfg = config(scheme, outer);
            let one = run(&cfg, 1);
            // The run is not trivial: the weights moved every round and deltas were sent after the first pull.
            assert!(one.weights.windows(2).all(|w| w[0] != w[1]));
            assert!(one.pulls.iter().skip(1).all(|p| !p.is_empty()));
            assert!(!one.slots.is_empty());
            for threads in [2, 3] {
                let many = run(&cfg, threads);
                let case = format!("{scheme:?}, outer {outer}, {threads} threads");
                assert_eq!(one.weights, many.weights, "{case}: weights");
                assert_eq!(one.norms, many.norms, "{case}: push norms");
                assert_eq!(one.pulls, many.pulls, "{case}: pull bytes");
                assert_eq!(one.slots, many.slots, "{case}: optimizer state");
                assert_eq!(one.public, many.public, "{case}: public copy");
            }
        }
    }
}

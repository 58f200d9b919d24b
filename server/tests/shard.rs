//! `ShardCore` under hostile and adversarial pushes (every rejection leaves weights, optimizer state and version
//! bit-identical), the gradient-norm guard (bound, per-worker windows, floor) and the finite-state check, checkpoint round trips through `snapshot`/`restore` (including a
//! corrupted newest checkpoint), and BSP interleavings against a sequential run.

use std::fs;

use tether_common::codec::{CodecConfig, Encoder, Rounding, Scheme, HEADER_LEN};
use tether_common::config::{Config, OptimizerConfig, OptimizerKind, Schedule, Staleness};
use tether_common::layout::{mlp_layout, Layout};
use tether_common::pki::CheckpointKey;
use tether_server::checkpoint::{CheckpointStore, ShardSnapshot, WEIGHTS_FILE};
use tether_server::norm_guard::GuardSettings;
use tether_server::shard::{Push, ShardCore, ShardError, ShardSpec};

const SHARDS: u32 = 2;
const TIMEOUT_MS: u64 = 1_000;

/// 64·32 + 32 + 32·10 + 10 = 2410 parameters, 1205 per shard.
fn layout() -> Layout {
    mlp_layout(&[64, 32, 10])
}

fn spec(shard: u32, kind: OptimizerKind, staleness: Staleness, spike_factor: f32) -> ShardSpec {
    ShardSpec {
        shard,
        shards: SHARDS,
        seed: 7,
        optimizer: OptimizerConfig {
            kind,
            lr: 1e-2,
            schedule: Schedule::WarmupCosine {
                warmup: 3,
                total: 50,
                min_ratio: 0.1,
            },
            ..OptimizerConfig::default()
        },
        staleness,
        worker_timeout_ms: TIMEOUT_MS,
        spike_factor,
    }
}

fn adam_core(spike_factor: f32) -> ShardCore {
    ShardCore::new(
        &layout(),
        &spec(1, OptimizerKind::Adam, Staleness::Bounded(2), spike_factor),
    )
}

/// Deterministic gradient of magnitude about `scale`, different per (worker, clock).
fn gradient(n: usize, worker: u32, clock: u64, scale: f32) -> Vec<f32> {
    let seed = tether_common::splitmix::splitmix64(u64::from(worker) << 32 ^ clock);
    tether_common::testing::noise(n, seed, scale)
}

fn encode(scheme: Scheme, values: &[f32], seed: u64) -> Vec<u8> {
    let cfg = CodecConfig {
        scheme,
        bucket: 512,
        rounding: Rounding::Stochastic,
        zstd: false,
        keep: tether_common::codec::DEFAULT_KEEP,
    };
    let mut out = Vec::new();
    Encoder::new(cfg)
        .unwrap()
        .encode(values, seed, &mut out)
        .unwrap();
    out
}

fn q4(core: &ShardCore, worker: u32, clock: u64) -> Vec<u8> {
    let n = core.weights().len();
    encode(
        Scheme::Q4,
        &gradient(n, worker, clock, 1e-2),
        u64::from(worker) << 32 | clock,
    )
}

fn push<'a>(core: &ShardCore, worker: u32, clock: u64, payload: &'a [u8]) -> Push<'a> {
    let r = core.range();
    Push {
        worker,
        clock,
        shard: core.shard(),
        range: (r.start, r.end),
        read_version: core.version(),
        payload,
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Everything a rejected push must not change, as bit patterns.
#[derive(Debug, PartialEq)]
struct State {
    version: u64,
    opt_steps: u64,
    weights: Vec<u32>,
    slots: Vec<Vec<u32>>,
}

fn state(core: &ShardCore) -> State {
    let snap = core.snapshot();
    State {
        version: snap.version,
        opt_steps: snap.opt_steps,
        weights: bits(&snap.weights),
        slots: snap.slots.iter().map(|s| bits(s)).collect(),
    }
}

/// A core with workers 0 and 1 joined and three accepted rounds (so the optimizer state is non-zero).
fn warmed_core() -> ShardCore {
    let mut core = adam_core(0.0);
    core.join(0, 0);
    core.join(1, 0);
    for clock in 0..3 {
        for w in 0..2 {
            let f = q4(&core, w, clock);
            core.apply(&push(&core, w, clock, &f), 1).unwrap();
        }
    }
    assert_eq!(core.version(), 6);
    assert!(
        core.snapshot().slots[1].iter().any(|v| *v != 0.0),
        "Adam state must be non-zero"
    );
    core
}

/// Applies `p` expecting a rejection; checks it matched and that no state changed.
fn rejected(p: &Push<'_>, core: &mut ShardCore, check: impl Fn(&ShardError) -> bool) -> ShardError {
    let before = state(core);
    let clock_before = core.clocks().clock_of(p.worker);
    let applied_before = core.stats().updates_applied;
    let e = core.apply(p, 2).expect_err("hostile push was applied");
    assert!(check(&e), "unexpected error {e:?}");
    assert_eq!(state(core), before, "state changed on {e:?}");
    assert_eq!(core.stats().updates_applied, applied_before);
    if !matches!(
        e,
        ShardError::NonFinite(_)
            | ShardError::NormSpike { .. }
            | ShardError::NormBound { .. }
            | ShardError::NonFiniteState
    ) {
        assert_eq!(
            core.clocks().clock_of(p.worker),
            clock_before,
            "clock moved on {e:?}"
        );
    }
    e
}

#[test]
fn wrong_shard_and_range_are_rejected_without_effect() {
    let mut core = warmed_core();
    let f = q4(&core, 0, 3);
    let mut p = push(&core, 0, 3, &f);
    p.shard = 0;
    let e = rejected(&p, &mut core, |e| {
        matches!(e, ShardError::WrongShard { .. })
    });
    assert_eq!(
        e,
        ShardError::WrongShard {
            expected: 1,
            found: 0
        }
    );

    let r = core.range();
    for range in [
        (r.start - 1, r.end - 1),
        (r.start, r.end + 1),
        (0, r.end - r.start),
        (r.end, r.start),
    ] {
        let mut p = push(&core, 0, 3, &f);
        p.range = range;
        let e = rejected(&p, &mut core, |e| matches!(e, ShardError::BadRange { .. }));
        assert_eq!(
            e,
            ShardError::BadRange {
                expected: r.clone(),
                found: range.0..range.1
            }
        );
    }
    // The same frame, well addressed, is still accepted afterwards: nothing was half-consumed.
    core.apply(&push(&core, 0, 3, &f), 3).unwrap();
    assert_eq!(core.stats().rejected_total(), 5);
    assert_eq!(core.stats().rejected.get("bad_range"), Some(&4));
}

#[test]
fn frames_of_the_wrong_length_are_rejected_without_effect() {
    let mut core = warmed_core();
    let n = core.weights().len();
    for len in [0, 1, n - 1, n + 1, 2 * n] {
        let f = encode(Scheme::Q4, &gradient(len, 0, 3, 1e-2), 1);
        let e = rejected(&push(&core, 0, 3, &f), &mut core, |e| {
            matches!(e, ShardError::Codec(_))
        });
        assert!(e.to_string().contains("element count mismatch"), "{e}");
    }
    for scheme in [Scheme::None, Scheme::Fp16, Scheme::Q8, Scheme::Q2] {
        let f = encode(scheme, &gradient(n - 16, 0, 3, 1e-2), 1);
        rejected(&push(&core, 0, 3, &f), &mut core, |e| {
            matches!(e, ShardError::Codec(_))
        });
    }
}

#[test]
fn corrupted_codec_bytes_are_rejected_without_effect() {
    let mut core = warmed_core();
    let good = q4(&core, 0, 3);
    let n = core.weights().len();
    let buckets = n.div_ceil(512);
    let codes = HEADER_LEN + 4 * buckets;
    let mut cases: Vec<(&str, Vec<u8>)> = Vec::new();
    let mut f = good.clone();
    f[0] ^= 0xff;
    cases.push(("magic", f));
    let mut f = good.clone();
    f[4] = 9;
    cases.push(("version", f));
    let mut f = good.clone();
    f[5] = 200;
    cases.push(("scheme tag", f));
    let mut f = good.clone();
    f[6] |= 0x80;
    cases.push(("flags", f));
    let mut f = good.clone();
    f[8..12].copy_from_slice(&17u32.to_le_bytes());
    cases.push(("bucket", f));
    let mut f = good.clone();
    f[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
    cases.push(("body length", f));
    let mut f = good.clone();
    f[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    cases.push(("element count", f));
    cases.push(("truncated", good[..good.len() - 1].to_vec()));
    cases.push(("header only", good[..HEADER_LEN].to_vec()));
    cases.push(("empty", Vec::new()));
    let mut f = good.clone();
    f.push(0);
    cases.push(("trailing byte", f));
    let mut f = good.clone();
    f[HEADER_LEN..HEADER_LEN + 4].copy_from_slice(&(-1.0f32).to_le_bytes());
    cases.push(("negative scale", f));
    let mut f = good.clone();
    f[HEADER_LEN + 4..HEADER_LEN + 8].copy_from_slice(&f32::NAN.to_le_bytes());
    cases.push(("NaN scale", f));
    let mut f = good.clone();
    f[HEADER_LEN + 8..HEADER_LEN + 12].copy_from_slice(&f32::INFINITY.to_le_bytes());
    cases.push(("infinite scale", f));
    // Code −8 is outside −7..=7; put it in the last bucket so the earlier buckets decode fine first.
    let mut f = good.clone();
    let last = f.len() - 1;
    f[last] = (f[last] & 0xf0) | 0x08;
    cases.push(("code -8", f));
    let mut f = good.clone();
    f[codes] = 0x88;
    cases.push(("code -8 first bucket", f));
    for (what, frame) in &cases {
        let e = rejected(&push(&core, 0, 3, frame), &mut core, |e| {
            matches!(e, ShardError::Codec(_))
        });
        assert!(!e.to_string().is_empty(), "{what}");
    }
    assert_eq!(
        core.stats().rejected.get("bad_frame"),
        Some(&(cases.len() as u64))
    );
    core.apply(&push(&core, 0, 3, &good), 3).unwrap();
}

#[test]
fn non_finite_values_are_rejected_without_touching_weights() {
    let mut core = warmed_core();
    let n = core.weights().len();
    // The encoder refuses NaN, so write the values into a valid fp32 frame by hand.
    let mut clock = 3;
    for (index, bad) in [
        (0, f32::NAN),
        (n / 2, f32::INFINITY),
        (n - 1, f32::NEG_INFINITY),
        (7, f32::from_bits(0xffc0_0001)),
    ] {
        // Worker 1 keeps pace (skip markers), so worker 0's rounds stay within m + s + 1.
        core.skip(1, clock, 2).unwrap();
        let mut f = encode(Scheme::None, &gradient(n, 0, clock, 1e-2), 0);
        let at = HEADER_LEN + 4 * index;
        f[at..at + 4].copy_from_slice(&bad.to_le_bytes());
        let e = rejected(&push(&core, 0, clock, &f), &mut core, |e| {
            matches!(e, ShardError::NonFinite(_))
        });
        assert_eq!(e, ShardError::NonFinite(index));
        // A refused round still counts for the clock, so the worker is not stuck behind it.
        clock += 1;
        assert_eq!(core.clocks().clock_of(0), Some(clock));
    }
    // fp16 frame with an infinity (0x7c00) in it.
    let mut f = encode(Scheme::Fp16, &gradient(n, 0, clock, 1e-2), 0);
    f[HEADER_LEN + 2 * 5..HEADER_LEN + 2 * 6].copy_from_slice(&0x7c00u16.to_le_bytes());
    let e = rejected(&push(&core, 0, clock, &f), &mut core, |e| {
        matches!(e, ShardError::NonFinite(_))
    });
    assert_eq!(e, ShardError::NonFinite(5));
    assert_eq!(core.stats().rejected.get("non_finite"), Some(&5));
    let f = q4(&core, 0, clock + 1);
    core.apply(&push(&core, 0, clock + 1, &f), 3).unwrap();
}

#[test]
fn clock_version_and_membership_violations_are_rejected_without_effect() {
    let mut core = warmed_core();
    let f = q4(&core, 0, 3);
    // Worker 0 is at clock 3.
    let e = rejected(&push(&core, 0, 4, &f), &mut core, |e| {
        matches!(e, ShardError::ClockFromFuture { .. })
    });
    assert_eq!(
        e,
        ShardError::ClockFromFuture {
            worker: 0,
            expected: 3,
            found: 4
        }
    );
    rejected(&push(&core, 0, u64::MAX, &f), &mut core, |e| {
        matches!(e, ShardError::ClockFromFuture { .. })
    });
    let e = rejected(&push(&core, 0, 2, &f), &mut core, |e| {
        matches!(e, ShardError::Replay { .. })
    });
    assert_eq!(
        e,
        ShardError::Replay {
            worker: 0,
            expected: 3,
            found: 2
        }
    );
    rejected(&push(&core, 0, 0, &f), &mut core, |e| {
        matches!(e, ShardError::Replay { .. })
    });

    // Replay of an accepted push: the very same frame at the same clock, twice.
    core.apply(&push(&core, 0, 3, &f), 3).unwrap();
    let e = rejected(&push(&core, 0, 3, &f), &mut core, |e| {
        matches!(e, ShardError::Replay { .. })
    });
    assert_eq!(
        e,
        ShardError::Replay {
            worker: 0,
            expected: 4,
            found: 3
        }
    );

    // A read version the shard has not reached.
    let v = core.version();
    let f = q4(&core, 0, 4);
    for read_version in [v + 1, u64::MAX] {
        let mut p = push(&core, 0, 4, &f);
        p.read_version = read_version;
        let e = rejected(&p, &mut core, |e| {
            matches!(e, ShardError::VersionFromFuture { .. })
        });
        assert_eq!(
            e,
            ShardError::VersionFromFuture {
                current: v,
                found: read_version
            }
        );
    }

    // Never joined, left, evicted.
    let e = rejected(&push(&core, 9, 0, &f), &mut core, |e| {
        matches!(e, ShardError::NotMember(_))
    });
    assert_eq!(e, ShardError::NotMember(9));
    core.leave(1);
    rejected(&push(&core, 1, 3, &f), &mut core, |e| {
        *e == ShardError::NotMember(1)
    });
    core.join(2, 10);
    core.heartbeat(0, 10 + TIMEOUT_MS);
    assert_eq!(core.evict_silent(10 + TIMEOUT_MS), vec![2]);
    rejected(&push(&core, 2, 3, &f), &mut core, |e| {
        *e == ShardError::NotMember(2)
    });

    // Through all that, the honest push is still accepted at the right clock.
    core.apply(&push(&core, 0, 4, &f), 3).unwrap();
    let reasons = &core.stats().rejected;
    assert_eq!(reasons.get("clock_from_future"), Some(&2));
    assert_eq!(reasons.get("replay"), Some(&3));
    assert_eq!(reasons.get("version_from_future"), Some(&2));
    assert_eq!(reasons.get("not_member"), Some(&3));
}

#[test]
fn spike_guard_rejects_a_1000x_gradient_and_the_worker_moves_on() {
    let mut core = adam_core(10.0);
    core.join(0, 0);
    let n = core.weights().len();
    // Warm-up: the guard needs 16 norms before it judges anything.
    let mut clock = 0;
    for _ in 0..20 {
        let f = q4(&core, 0, clock);
        core.apply(&push(&core, 0, clock, &f), 0).unwrap();
        clock += 1;
    }
    let g = gradient(n, 0, clock, 1e-2 * 1000.0);
    let f = encode(Scheme::Q4, &g, 1);
    let e = rejected(&push(&core, 0, clock, &f), &mut core, |e| {
        matches!(e, ShardError::NormSpike { .. })
    });
    let ShardError::NormSpike { norm, limit } = e else {
        unreachable!()
    };
    assert!(norm > 50.0 * limit, "norm {norm} limit {limit}");
    assert_eq!(
        core.clocks().clock_of(0),
        Some(clock + 1),
        "the refused round must still advance the clock"
    );
    assert_eq!(core.stats().rejected.get("norm_spike"), Some(&1));
    // 3x is within the 10x factor.
    let f = encode(Scheme::Q4, &gradient(n, 0, clock + 1, 3e-2), 2);
    core.apply(&push(&core, 0, clock + 1, &f), 0).unwrap();
    assert_eq!(core.version(), 21);
}

#[test]
fn spike_guard_is_inactive_during_warmup_and_when_off() {
    for factor in [0.0, 10.0] {
        let mut core = adam_core(factor);
        core.join(0, 0);
        let n = core.weights().len();
        for clock in 0..3u64 {
            let f = q4(&core, 0, clock);
            core.apply(&push(&core, 0, clock, &f), 0).unwrap();
        }
        let f = encode(Scheme::Q4, &gradient(n, 0, 3, 10.0), 1);
        core.apply(&push(&core, 0, 3, &f), 0).unwrap();
    }
}

fn assert_same(a: &ShardCore, b: &ShardCore) {
    assert_eq!(state(a), state(b));
    assert_eq!(
        a.clocks().clocks().collect::<Vec<_>>(),
        b.clocks().clocks().collect::<Vec<_>>()
    );
}

/// Applies rounds `rounds` from workers 0 and 1 (worker order alternating per round) to every core.
fn run_rounds(cores: &mut [&mut ShardCore], rounds: std::ops::Range<u64>) {
    for clock in rounds {
        let order = if clock % 2 == 0 { [0, 1] } else { [1, 0] };
        for w in order {
            for core in cores.iter_mut() {
                let f = q4(core, w, clock);
                let mut p = push(core, w, clock, &f);
                p.read_version = core.version().saturating_sub(1);
                core.apply(&p, 5).unwrap();
            }
        }
    }
}

fn fresh_joined() -> ShardCore {
    let mut core = adam_core(0.0);
    core.join(0, 0);
    core.join(1, 0);
    core
}

#[test]
fn checkpoint_restore_is_bit_exact_and_training_continues_identically() {
    let dir = tempfile::tempdir().unwrap();
    let store = CheckpointStore::new(
        dir.path().join("shard-1"),
        3,
        CheckpointKey::from_bytes([1; 32]),
    );
    let mut a = fresh_joined();
    let mut reference = fresh_joined();
    run_rounds(&mut [&mut a, &mut reference], 0..5);
    let snap = a.snapshot();
    store.write(&snap).unwrap();
    drop(a); // a crash: no shutdown, no final checkpoint

    let mut b = adam_core(0.0);
    let r = b.range();
    let (loaded, skipped) = store
        .load_latest(b.layout_hash(), 1, (r.start, r.end))
        .unwrap()
        .unwrap();
    assert!(skipped.is_empty());
    assert_eq!(loaded.clocks, vec![(0, 5), (1, 5)]);
    b.restore(loaded, 0).unwrap();
    assert_same(&b, &reference);
    assert_eq!(b.version(), 10);
    assert_eq!(b.snapshot().opt_steps, 10);

    run_rounds(&mut [&mut b, &mut reference], 5..12);
    assert_same(&b, &reference);
    assert_eq!(b.version(), 24);
}

/// Overwrites one byte in the middle of a file.
fn flip_byte(path: &std::path::Path) {
    let mut bytes = fs::read(path).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    fs::write(path, bytes).unwrap();
}

#[test]
fn corrupted_newest_checkpoint_falls_back_to_the_previous_one_through_restore() {
    for corrupt in ["truncate", "flip"] {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(
            dir.path().join("shard-1"),
            3,
            CheckpointKey::from_bytes([1; 32]),
        );
        let mut a = fresh_joined();
        let mut reference = fresh_joined();
        run_rounds(&mut [&mut a, &mut reference], 0..3);
        store.write(&a.snapshot()).unwrap();
        run_rounds(&mut [&mut a], 3..6);
        let newest = store.write(&a.snapshot()).unwrap();
        drop(a);

        let weights = newest.join(WEIGHTS_FILE);
        match corrupt {
            "truncate" => {
                let len = fs::metadata(&weights).unwrap().len();
                fs::OpenOptions::new()
                    .write(true)
                    .open(&weights)
                    .unwrap()
                    .set_len(len / 2)
                    .unwrap();
            }
            _ => flip_byte(&weights),
        }
        let mut b = adam_core(0.0);
        let r = b.range();
        let (loaded, skipped) = store
            .load_latest(b.layout_hash(), 1, (r.start, r.end))
            .unwrap()
            .unwrap();
        assert_eq!(skipped.len(), 1, "{corrupt}");
        assert_eq!(skipped[0].0, newest);
        assert_eq!(loaded.version, 6, "{corrupt}");
        b.restore(loaded, 0).unwrap();
        assert_same(&b, &reference);
        // Training resumes from round 3, as after the older checkpoint.
        run_rounds(&mut [&mut b, &mut reference], 3..6);
        assert_same(&b, &reference);
    }
}

#[test]
fn restore_refuses_optimizer_state_of_the_wrong_shape() {
    let mut core = warmed_core();
    let before = state(&core);
    let mut snap: ShardSnapshot = core.snapshot();
    snap.slots.pop();
    assert!(core.restore(snap, 0).is_err());
    let mut snap = core.snapshot();
    snap.slots[0].pop();
    assert!(core.restore(snap, 0).is_err());
    assert_eq!(state(&core), before);
}

// ---- BSP -------------------------------------------------------------------------------------------------------

const ROUNDS: u64 = 4;

/// A BSP SGD shard whose weights are dyadic rationals (k/64), so that with lr = 1/2 and gradients that are
/// multiples of 1/64 every update is exact in f32 and the order of additions cannot matter.
fn bsp_core(exact: bool) -> ShardCore {
    let mut s = spec(0, OptimizerKind::Sgd, Staleness::Bounded(0), 0.0);
    s.optimizer.lr = 0.5;
    s.optimizer.schedule = Schedule::Constant;
    let mut core = ShardCore::new(&layout(), &s);
    if exact {
        let mut snap = core.snapshot();
        for (i, w) in snap.weights.iter_mut().enumerate() {
            *w = ((i % 97) as f32 - 48.0) / 64.0;
        }
        core.restore(snap, 0).unwrap();
    }
    core.join(0, 0);
    core.join(1, 0);
    core
}

/// Worker `w`'s fp32 gradient frame for round `c`.
fn bsp_frame(n: usize, w: u32, c: u64, exact: bool) -> Vec<u8> {
    let g: Vec<f32> = if exact {
        (0..n)
            .map(|i| ((i as u64 * 31 + u64::from(w) * 17 + c * 5) % 41) as f32 / 64.0 - 20.0 / 64.0)
            .collect()
    } else {
        gradient(n, w, c, 1e-1)
    };
    encode(Scheme::None, &g, 0)
}

/// Runs BSP rounds where `first[c]` is the worker whose round-c push lands first. Each worker pulls before computing
/// its round-c gradient; the test asserts the SSP gate admits that pull (and refuses it one step earlier).
fn bsp_run(first: &[u32], exact: bool) -> ShardCore {
    let mut core = bsp_core(exact);
    let n = core.weights().len();
    let mut read = [0u64; 2];
    for c in 0..ROUNDS {
        // Both pulls for clock c are answerable only after every round c−1 push landed.
        assert!(core.can_answer(c));
        for r in read.iter_mut() {
            *r = core.version();
            core.answered(c, 0);
        }
        let order = [first[c as usize], 1 - first[c as usize]];
        for (k, w) in order.into_iter().enumerate() {
            let f = bsp_frame(n, w, c, exact);
            let mut p = push(&core, w, c, &f);
            p.read_version = read[w as usize];
            let a = core.apply(&p, 0).unwrap();
            assert_eq!(
                a.staleness, k as u64,
                "with two workers BSP sees staleness 0 or 1"
            );
            if k == 0 {
                assert!(
                    !core.can_answer(c + 1),
                    "BSP must hold the next round until both pushes landed"
                );
            }
        }
    }
    assert_eq!(core.version(), 2 * ROUNDS);
    assert_eq!(core.stats().max_lead, 0);
    core
}

#[test]
fn bsp_interleavings_with_exact_sgd_equal_the_sequential_run_bit_for_bit() {
    let canonical = bits(bsp_run(&[0; ROUNDS as usize], true).weights());
    // Sequential reference computed outside the shard: w − ½·Σ g, in canonical order.
    let mut seq = bsp_core(true).weights().to_vec();
    let n = seq.len();
    for c in 0..ROUNDS {
        for w in 0..2 {
            let f = bsp_frame(n, w, c, true);
            for (i, x) in seq.iter_mut().enumerate() {
                let at = HEADER_LEN + 4 * i;
                *x -= 0.5 * f32::from_le_bytes(f[at..at + 4].try_into().unwrap());
            }
        }
    }
    assert_eq!(canonical, bits(&seq));
    for mask in 1..(1u32 << ROUNDS) {
        let first: Vec<u32> = (0..ROUNDS).map(|c| (mask >> c) & 1).collect();
        assert_eq!(
            bits(bsp_run(&first, true).weights()),
            canonical,
            "order {first:?}"
        );
    }
}

#[test]
fn bsp_interleavings_with_inexact_sgd_differ_only_by_rounding() {
    // With arbitrary f32 values, (w − a) − b and (w − b) − a may differ in the last bit: each of the 2·ROUNDS
    // updates rounds once, so interleavings agree within 2·ROUNDS ulps of the largest intermediate magnitude.
    let canonical = bsp_run(&[0; ROUNDS as usize], false).weights().to_vec();
    let reversed = bsp_run(&[1; ROUNDS as usize], false).weights().to_vec();
    let mut differing = 0;
    for (a, b) in canonical.iter().zip(&reversed) {
        let ulp = f32::EPSILON * a.abs().max(b.abs()).max(1.0);
        assert!((a - b).abs() <= 2.0 * ROUNDS as f32 * ulp, "{a} vs {b}");
        differing += usize::from(a.to_bits() != b.to_bits());
    }
    assert!(differing < canonical.len());
}

#[test]
fn bsp_gate_refuses_to_run_ahead() {
    let mut core = bsp_core(false);
    let n = core.weights().len();
    assert!(core.can_answer(0));
    let f = bsp_frame(n, 0, 0, false);
    core.apply(&push(&core, 0, 0, &f), 0).unwrap();
    assert!(
        !core.can_answer(1),
        "worker 0 may not pull clock 1 before worker 1's round-0 push"
    );
    let f = bsp_frame(n, 1, 0, false);
    core.apply(&push(&core, 1, 0, &f), 0).unwrap();
    assert!(core.can_answer(1));
    assert!(!core.can_answer(2));
}

#[test]
fn every_shard_error_has_one_wire_code_everywhere() {
    use tether_common::protocol::ErrorCode;
    use tether_server::clock::ClockError;
    let all = [
        (
            ShardError::WrongShard {
                expected: 1,
                found: 0,
            },
            ErrorCode::WrongShard,
        ),
        (
            ShardError::BadRange {
                expected: 0..1,
                found: 0..2,
            },
            ErrorCode::BadRange,
        ),
        (ShardError::Codec("x".into()), ErrorCode::BadFrame),
        (ShardError::NonFinite(3), ErrorCode::NonFinite),
        (
            ShardError::ClockFromFuture {
                worker: 0,
                expected: 1,
                found: 2,
            },
            ErrorCode::ClockFromFuture,
        ),
        (
            ShardError::Replay {
                worker: 0,
                expected: 2,
                found: 1,
            },
            ErrorCode::Replay,
        ),
        (
            ShardError::VersionFromFuture {
                current: 1,
                found: 2,
            },
            ErrorCode::ClockFromFuture,
        ),
        (ShardError::NotMember(4), ErrorCode::Evicted),
        (
            ShardError::NormSpike {
                norm: 1e3,
                limit: 1.0,
            },
            ErrorCode::NonFinite,
        ),
        (
            ShardError::NormBound {
                norm: 1e30,
                bound: 40.0,
            },
            ErrorCode::NonFinite,
        ),
        (ShardError::NonFiniteState, ErrorCode::NonFinite),
        (ShardError::Overloaded, ErrorCode::Overloaded),
    ];
    for (e, code) in all {
        assert_eq!(e.code(), code, "{e:?}");
        let crate_error = tether_server::Error::from(e.clone());
        assert_eq!(crate_error.code(), Some(code));
        assert_eq!(crate_error.to_string(), e.to_string());
    }
    // Clock-table refusals carry the same codes as the shard errors they become.
    for ce in [
        ClockError::UnknownWorker { worker: 1 },
        ClockError::Evicted { worker: 1 },
        ClockError::NotNext {
            worker: 1,
            expected: 3,
            got: 2,
        },
        ClockError::NotNext {
            worker: 1,
            expected: 3,
            got: 5,
        },
    ] {
        let via_shard = ShardError::from(ce.clone()).code();
        assert_eq!(tether_server::Error::from(ce).code(), Some(via_shard));
    }
    let gone = tether_server::Error::ActorGone;
    assert_eq!(gone.code(), Some(ErrorCode::Shutdown));
    let local = tether_server::Error::Address("nowhere".into());
    assert_eq!(local.code(), None);
}

/// The guard `tether-server` derives from the default configuration (a gradient push every step, clip 5) for `core`,
/// with the relative factor `factor`.
fn default_guard(core: &ShardCore, factor: f32) -> GuardSettings {
    let cfg = Config::with_servers(vec!["127.0.0.1:1".into(); SHARDS as usize]);
    let r = core.range();
    let mut g = GuardSettings::derive(&cfg, (r.end - r.start) as usize);
    g.factor = factor;
    g
}

/// An Adam core (asynchronous, so that a flood is not held back by the SSP gate) with `guard`, workers `0..workers`
/// joined.
fn guarded_core(guard: GuardSettings, workers: u32) -> ShardCore {
    let mut core = ShardCore::new(
        &layout(),
        &spec(1, OptimizerKind::Adam, Staleness::Unbounded, 0.0),
    );
    core.set_guard(guard);
    for w in 0..workers {
        core.join(w, 0);
    }
    core
}

/// Pushes `worker`'s honest q4 gradient at its current clock; panics unless applied.
fn honest_push(core: &mut ShardCore, worker: u32) {
    let clock = core.clocks().clock_of(worker).unwrap();
    let f = q4(core, worker, clock);
    if let Err(e) = core.apply(&push(core, worker, clock, &f), 0) {
        panic!("honest push of worker {worker} at clock {clock} refused: {e}");
    }
}

/// Pushes `values` as worker `worker`'s next round; returns the outcome.
fn push_values(core: &mut ShardCore, worker: u32, values: &[f32]) -> Result<(), ShardError> {
    let clock = core.clocks().clock_of(worker).unwrap();
    let f = encode(Scheme::None, values, 1);
    core.apply(&push(core, worker, clock, &f), 0).map(|_| ())
}

#[test]
fn a_zero_norm_flood_cannot_make_honest_pushes_refused() {
    // The attack as measured: spike factor 3, a flood of zero-norm pushes, then honest pushes. Both with the guard
    // the default configuration gives and with its floor at 0 (the per-worker windows alone must hold).
    let probe = adam_core(0.0);
    for guard in [
        default_guard(&probe, 3.0),
        GuardSettings {
            floor: 0.0,
            ..default_guard(&probe, 3.0)
        },
    ] {
        for honest_first in [true, false] {
            let mut core = guarded_core(guard, 2);
            let zeros = vec![0.0; core.weights().len()];
            if honest_first {
                for _ in 0..20 {
                    honest_push(&mut core, 0);
                }
            }
            for _ in 0..64 {
                push_values(&mut core, 1, &zeros).unwrap();
            }
            for _ in 0..40 {
                honest_push(&mut core, 0);
            }
            assert_eq!(core.stats().guard_refused(), 0, "{guard:?}");
            let limit = core.guard_limit().unwrap();
            assert!(limit >= guard.floor && limit > 0.0, "{limit}");
        }
    }
}

#[test]
fn one_workers_flood_does_not_move_the_limit_others_are_judged_by() {
    let probe = adam_core(0.0);
    let guard = GuardSettings {
        floor: 0.0,
        ..default_guard(&probe, 3.0)
    };
    let mut core = guarded_core(guard, 3);
    for _ in 0..20 {
        honest_push(&mut core, 0);
        honest_push(&mut core, 1);
    }
    // The honest workers' norms are alike (within a few percent): whatever worker 2 pushes, the limit must stay
    // within a quarter of where they put it.
    let before = core.guard_limit().unwrap();
    let (lo, hi) = (0.75 * before, 1.25 * before);
    let n = core.weights().len();
    // Zero norms, then norms just under the bound, 64 of each (once worker 2 is warm, the relative limit refuses the
    // large ones; they still enter its own window).
    let zeros = vec![0.0; n];
    let high = vec![0.99 * guard.bound / (n as f32).sqrt(); n];
    for flood in [&zeros, &high] {
        for _ in 0..64 {
            let _ = push_values(&mut core, 2, flood);
            let limit = core.guard_limit().unwrap();
            assert!(
                (lo..=hi).contains(&limit),
                "limit {limit} outside [{lo}, {hi}]"
            );
        }
        for _ in 0..10 {
            honest_push(&mut core, 0);
            honest_push(&mut core, 1);
        }
    }
    // Each honest worker's spike is still caught, at a limit the flood did not move.
    let spike = gradient(n, 0, 99, 1e-2 * 10.0);
    let e = push_values(&mut core, 0, &spike).unwrap_err();
    assert!(
        matches!(e, ShardError::NormSpike { limit, .. } if (lo..=hi).contains(&limit)),
        "{e:?}"
    );
}

#[test]
fn a_1e30_scaled_push_is_refused_by_default_and_adams_state_stays_finite_and_unchanged() {
    let probe = adam_core(0.0);
    let guard = default_guard(&probe, 10.0);
    assert_eq!(
        guard.bound,
        8.0 * 5.0,
        "the default bound: margin 8 × clip 5"
    );
    let mut core = guarded_core(guard, 1);
    for _ in 0..5 {
        honest_push(&mut core, 0);
    }
    let n = core.weights().len();
    let clock = core.clocks().clock_of(0).unwrap();
    let hostile: Vec<f32> = gradient(n, 0, clock, 1e-2)
        .iter()
        .map(|g| g * 1e30)
        .collect();
    assert!(hostile.iter().all(|g| g.is_finite()));
    let f = encode(Scheme::None, &hostile, 1);
    rejected(
        &push(&core, 0, clock, &f),
        &mut core,
        |e| matches!(e, ShardError::NormBound { bound, .. } if *bound == 40.0),
    );
    assert_eq!(core.stats().rejected.get("norm_bound"), Some(&1));
    assert_eq!(core.stats().guard_refused(), 1);
    // Training goes on, and the state stays finite.
    for _ in 0..5 {
        honest_push(&mut core, 0);
    }
    let snap = core.snapshot();
    assert!(snap
        .weights
        .iter()
        .chain(snap.slots.iter().flatten())
        .all(|x| x.is_finite()));
    assert!(core.stats().max_push_norm < guard.bound);

    // With the bound and the relative check off, the finite-state check still refuses it: v = g² overflows.
    let off = GuardSettings {
        factor: 0.0,
        bound: f32::INFINITY,
        ..guard
    };
    let mut core = guarded_core(off, 1);
    for _ in 0..5 {
        honest_push(&mut core, 0);
    }
    let clock = core.clocks().clock_of(0).unwrap();
    let f = encode(Scheme::None, &hostile, 1);
    rejected(&push(&core, 0, clock, &f), &mut core, |e| {
        matches!(e, ShardError::NonFiniteState)
    });
    assert_eq!(
        core.clocks().clock_of(0),
        Some(clock + 1),
        "a refused round still advances the clock"
    );
    assert_eq!(core.stats().rejected.get("non_finite_state"), Some(&1));
    honest_push(&mut core, 0);
    assert_eq!(core.version(), 6);
}

#[test]
fn a_step_that_would_make_state_non_finite_is_refused_with_state_untouched() {
    // Every optimizer kind, the guard off: a finite gradient large enough that the update overflows.
    for kind in [
        OptimizerKind::Sgd,
        OptimizerKind::Momentum,
        OptimizerKind::Nesterov,
        OptimizerKind::Adam,
        OptimizerKind::Adamw,
        OptimizerKind::Adagrad,
    ] {
        let mut core = ShardCore::new(&layout(), &spec(1, kind, Staleness::Bounded(2), 0.0));
        core.set_guard(GuardSettings {
            factor: 0.0,
            bound: f32::INFINITY,
            ..GuardSettings::relative(0.0)
        });
        core.join(0, 0);
        for _ in 0..4 {
            honest_push(&mut core, 0);
        }
        // One value at f32::MAX, pushed until the update overflows: at once for Adam and Adagrad (g² = ∞), at the
        // second push for momentum and Nesterov (b = μ·b + g), after some hundreds for SGD (w − lr·g walks to −∞).
        let n = core.weights().len();
        let mut refused = None;
        for _ in 0..2_000 {
            let clock = core.clocks().clock_of(0).unwrap();
            let mut g = gradient(n, 0, clock, 1e-2);
            g[7] = f32::MAX;
            let f = encode(Scheme::None, &g, 1);
            let p = push(&core, 0, clock, &f);
            let before = core.snapshot();
            match core.apply(&p, 0) {
                Ok(_) => {
                    let after = core.snapshot();
                    assert!(
                        after
                            .weights
                            .iter()
                            .chain(after.slots.iter().flatten())
                            .all(|x| x.is_finite()),
                        "{kind:?} applied a step that left the state non-finite"
                    );
                }
                Err(e) => {
                    assert_eq!(e, ShardError::NonFiniteState, "{kind:?}");
                    let after = core.snapshot();
                    assert_eq!(
                        (bits(&after.weights), after.opt_steps, after.version),
                        (bits(&before.weights), before.opt_steps, before.version),
                        "{kind:?}"
                    );
                    let slot_bits =
                        |s: &ShardSnapshot| s.slots.iter().map(|x| bits(x)).collect::<Vec<_>>();
                    assert_eq!(slot_bits(&after), slot_bits(&before), "{kind:?}");
                    assert_eq!(core.clocks().clock_of(0), Some(clock + 1));
                    refused = Some(before.opt_steps);
                    break;
                }
            }
        }
        let refused =
            refused.unwrap_or_else(|| panic!("{kind:?}: the overflowing update was never refused"));
        assert_eq!(
            core.stats().rejected.get("non_finite_state"),
            Some(&1),
            "{kind:?}"
        );
        eprintln!("{kind:?}: refused at optimizer step {}", refused + 1);
        // Honest training continues.
        honest_push(&mut core, 0);
    }
}

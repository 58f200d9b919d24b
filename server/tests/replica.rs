//! The replication log against what it must guarantee: a standby that applies a primary's log (encoded, sent,
//! decoded) holds the primary's state bit for bit (weights, optimizer state, clocks, counters, the public copy the
//! delta pulls are cut from), over random mixes of hellos, pushes, skips, pulls, heartbeats, ticks, goodbyes and
//! closed connections; and a log entry that is out of order, runs time backwards or carries a bad push is refused
//! with a typed error before anything changes.

use tether_common::codec::{CodecConfig, Encoder, Scheme};
use tether_common::config::Staleness;
use tether_common::protocol::{encode_push, Precision, PullMode, PushFrame};
use tether_common::testing::{flat_layout, sgd, TestRng};
use tether_server::protocol::{FrameBody, Input, ShardProtocol};
use tether_server::quorum::QuorumSettings;
use tether_server::replication::{self as replica, image, Entry, EntryRef, ReplicaError, Standby};
use tether_server::shard::{ShardCore, ShardSpec};

const N: usize = 64;
const WORKERS: u32 = 3;

fn lossless() -> CodecConfig {
    CodecConfig {
        scheme: Scheme::None,
        zstd: false,
        ..CodecConfig::default()
    }
}

/// A shard as both sides build it from the same configuration; `quorum` 0 is plain SSP.
fn shard(quorum: u32) -> ShardProtocol {
    shard_of(N, quorum)
}

/// A shard of `n` parameters.
fn shard_of(n: usize, quorum: u32) -> ShardProtocol {
    shard_with(n, quorum, false)
}

/// A shard of `n` parameters, stepping at round close (`optimizer.outer.at_close`) or on every push.
fn shard_with(n: usize, quorum: u32, at_close: bool) -> ShardProtocol {
    let spec = ShardSpec {
        shard: 0,
        shards: 1,
        seed: 1,
        optimizer: sgd(0.5),
        staleness: Staleness::Bounded(1),
        worker_timeout_ms: 1_000,
        spike_factor: 0.0,
    };
    let mut core = ShardCore::new(&flat_layout(n), &spec);
    core.set_public(lossless(), 0xfeed);
    core.set_quorum(QuorumSettings {
        quorum,
        grace_factor: 0.5,
        grace_max_ms: 1_000,
    });
    core.set_outer_at_close(at_close);
    ShardProtocol::new(core)
}

fn push_body(rng: &mut TestRng, worker: u32, clock: u64, skip: bool) -> Vec<u8> {
    let mut payload = Vec::new();
    if !skip {
        let g: Vec<f32> = (0..N).map(|_| rng.next_f32() - 0.5).collect();
        Encoder::new(lossless())
            .unwrap()
            .encode(&g, 0, &mut payload)
            .unwrap();
    }
    encode_push(&PushFrame {
        worker,
        clock,
        shard: 0,
        range_start: 0,
        range_end: N as u64,
        read_version: 0,
        loss: 1.0,
        skip,
        payload,
    })
    .unwrap()
    .to_vec()
}

/// Feeds `input` to the primary as the actor does (through the protocol's one entry, then a full drain); returns
/// the entry it logs.
fn primary_takes(p: &mut ShardProtocol, seq: u64, input: Input) -> Entry {
    p.handle(&input);
    while p.poll_action().is_some() {}
    Entry { seq, input }
}

/// Encodes `entry` as the primary's side of the log does.
fn to_wire(entry: &Entry, wire: &mut Vec<u8>) {
    replica::encode(
        &EntryRef {
            seq: entry.seq,
            input: &entry.input,
        },
        wire,
    )
    .unwrap();
}

/// A random schedule of inputs, as a primary's shell would produce them over `steps` steps.
fn schedule(seed: u64, steps: usize) -> Vec<Input> {
    let mut rng = TestRng::new(seed);
    let mut now = 0u64;
    let mut conn = [0u64; WORKERS as usize];
    let mut clock = [0u64; WORKERS as usize];
    let mut next_conn = 1u64;
    let mut out = Vec::new();
    for w in 0..WORKERS {
        conn[w as usize] = next_conn;
        next_conn += 1;
        out.push(Input::Hello {
            conn: conn[w as usize],
            worker: w,
            clock: 0,
            now_ms: now,
        });
    }
    for _ in 0..steps {
        now += rng.below(40);
        // Honest workers: the laggard pushes more often, so clocks stay within the bound most of the time.
        let low = (0..WORKERS as usize).min_by_key(|&j| clock[j]).unwrap_or(0);
        let w = if rng.chance(400) {
            low as u32
        } else {
            rng.below(u64::from(WORKERS)) as u32
        };
        let i = w as usize;
        let c = conn[i];
        let input = match rng.below(100) {
            0..=44 if clock[i] > clock[low] + 1 => Input::Heartbeat {
                conn: c,
                worker: w,
                now_ms: now,
            },
            0..=44 => {
                let skip = rng.chance(100);
                let input = Input::Push {
                    conn: c,
                    now_ms: now,
                    body: FrameBody::copy_from(&push_body(&mut rng, w, clock[i], skip)),
                };
                clock[i] += 1;
                input
            }
            45..=69 => Input::Pull {
                conn: c,
                worker: w,
                request: rng.next_u64(),
                clock: clock[i],
                mode: if rng.chance(500) {
                    PullMode::Delta { have: None }
                } else {
                    PullMode::Full(Precision::F32)
                },
                now_ms: now,
            },
            70..=79 => Input::Heartbeat {
                conn: c,
                worker: w,
                now_ms: now,
            },
            80..=91 => Input::Tick { now_ms: now },
            92..=95 => Input::Cancel {
                token: rng.below(50),
            },
            96..=97 => {
                // A reconnect: the old connection closes, a hello rejoins at the worker's clock.
                let old = c;
                conn[i] = next_conn;
                next_conn += 1;
                out.push(Input::Closed { conn: old });
                Input::Hello {
                    conn: conn[i],
                    worker: w,
                    clock: clock[i],
                    now_ms: now,
                }
            }
            _ if clock[i] < 40 => Input::Tick { now_ms: now },
            _ => Input::Goodbye {
                conn: c,
                worker: w,
                clock: clock[i],
                now_ms: now,
            },
        };
        out.push(input);
    }
    out
}

/// What a standby must hold exactly as its primary: version, state fingerprint, weight bits, updates applied, and
/// the public copy (its cut and value bits).
type State = (u64, u64, Vec<u32>, u64, Option<(u64, Vec<u32>)>);

fn state(p: &ShardProtocol) -> State {
    let public = p.public().map(|(cut, v)| {
        (
            cut.seq ^ cut.lineage.rotate_left(17),
            v.iter().map(|x| x.to_bits()).collect(),
        )
    });
    (
        p.version(),
        replica::state_digest(&p.snapshot()),
        p.weights().iter().map(|x| x.to_bits()).collect(),
        p.stats().updates_applied,
        public,
    )
}

#[test]
fn a_standby_that_applies_the_log_holds_the_primarys_state_bit_for_bit() {
    for seed in 0..40u64 {
        let quorum = (seed % 3) as u32;
        // Every other triple of seeds steps at round close, so that the open rounds' sums replicate too.
        let at_close = (seed / 3) % 2 == 1;
        let mut primary = shard_with(N, quorum, at_close);
        let mut standby = shard_with(N, quorum, at_close);
        let mut follower = Standby::new();
        let mut wire = Vec::new();
        let inputs = schedule(seed, 400);
        for (i, input) in inputs.into_iter().enumerate() {
            let entry = primary_takes(&mut primary, i as u64 + 1, input);
            // Through the wire format, as the replication link carries it.
            to_wire(&entry, &mut wire);
            let got = replica::decode(&wire).unwrap();
            assert_eq!(got, entry);
            follower.accept(&mut standby, &got).unwrap();
            if i % 50 == 0 {
                assert_eq!(state(&standby), state(&primary), "seed {seed}, entry {i}");
            }
        }
        assert!(
            primary.stats().updates_applied > 50,
            "seed {seed}: the schedule applied too little to mean anything"
        );
        assert_eq!(state(&standby), state(&primary), "seed {seed}: final state");
        assert_eq!(
            standby.core().clocks().clocks().collect::<Vec<_>>(),
            primary.core().clocks().clocks().collect::<Vec<_>>(),
            "seed {seed}: clock tables"
        );
        // Everything else too: members, outcome windows, parked pulls, guard and quorum state, counters.
        assert!(
            image::encode(&standby, 0).unwrap() == image::encode(&primary, 0).unwrap(),
            "seed {seed}: full state images differ"
        );
    }
}

#[test]
fn a_standby_seeded_from_an_image_mid_run_then_following_the_log_holds_the_primarys_state() {
    for seed in 0..30u64 {
        let quorum = (seed % 3) as u32;
        // Every other triple of seeds steps at round close, so that the open rounds' sums replicate too.
        let at_close = (seed / 3) % 2 == 1;
        let mut rng = TestRng::new(seed ^ 0x5eed);
        let inputs = schedule(seed, 400);
        let cut = 20 + rng.below(inputs.len() as u64 - 40) as usize;
        let mut primary = shard_with(N, quorum, at_close);
        let mut standby = shard_with(N, quorum, at_close);
        let mut follower = None;
        let mut seq = 0;
        let mut wire = Vec::new();
        for (i, input) in inputs.into_iter().enumerate() {
            if i == cut {
                // The primary has served workers for a while: the standby starts from its image instead.
                let now = input.now_ms().unwrap_or(0);
                let bytes = image::encode(&primary, now).unwrap();
                assert_eq!(image::restore(&bytes, &mut standby).unwrap(), now);
                assert_eq!(
                    state(&standby),
                    state(&primary),
                    "seed {seed}: restored state"
                );
                follower = Some(Standby::seeded(now, standby.max_conn(), 0));
                seq = 0;
            }
            seq += 1;
            let entry = primary_takes(&mut primary, seq, input);
            if let Some(f) = follower.as_mut() {
                to_wire(&entry, &mut wire);
                f.accept(&mut standby, &replica::decode(&wire).unwrap())
                    .unwrap();
            }
        }
        assert!(primary.stats().updates_applied > 50, "seed {seed}");
        assert_eq!(state(&standby), state(&primary), "seed {seed}: final state");
        assert!(
            image::encode(&standby, 0).unwrap() == image::encode(&primary, 0).unwrap(),
            "seed {seed}: full state images differ"
        );
    }
}

#[test]
fn images_that_do_not_fit_or_do_not_decode_are_refused_and_change_nothing() {
    let mut primary = shard(0);
    for input in schedule(3, 200) {
        primary_takes(&mut primary, 0, input);
    }
    let good = image::encode(&primary, 77).unwrap();
    let fresh = image::encode(&shard(0), 0).unwrap();
    // Another shard's layout: a range of a different length.
    let mut other = shard_of(N + 1, 0);
    let other_before = image::encode(&other, 0).unwrap();
    assert!(matches!(
        image::restore(&good, &mut other),
        Err(ReplicaError::Image(_))
    ));
    assert!(image::encode(&other, 0).unwrap() == other_before);
    let mut trailing = good.clone();
    trailing.push(0);
    let mut format = good.clone();
    format[0] = 9;
    for bytes in [
        &good[..good.len() - 1],
        &good[..good.len() / 2],
        &trailing[..],
        &format[..],
        &[][..],
        &[0xff; 64][..],
    ] {
        let mut local = shard(0);
        assert!(
            matches!(
                image::restore(bytes, &mut local),
                Err(ReplicaError::Image(_))
            ),
            "{} bytes",
            bytes.len()
        );
        assert!(image::encode(&local, 0).unwrap() == fresh);
    }
    // Found by the image_loader fuzz target: 85 bytes whose rejection-reason label claimed 4 GiB, which the
    // decoder allocated before it found the input too short. Labels and cut bytes are now borrowed from the input.
    let claims_4_gib: &[u8] = &[
        0xd1, 0xfc, 0xbc, 0xfc, 0xfc, 0xfc, 0xfc, 0xfc, 0xfc, 0xfc, 0xfc, 0xfc, 0xfc, 0xfc, 0xfc,
        0xfc, 0xfc, 0xfc, 0xfc, 0xfc, 0xfc, 0xfc, 0xfc, 0xfc, 0xfc, 0xfc, 0, 0, 0, 0, 0, 0, 0, 0,
        0, 0, 0, 0, 0, 0, 0x33, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x02, 0, 0, 0, 0, 0, 0, 0, 0,
        0, 0, 0, 0xfc, 0xfc, 0xfc, 0xfc, 0xfe, 0xfc, 0xfc, 0xfc, 0xfc, 0xfc, 0xfc, 0xfc, 0xfc,
        0xfc, 0xfc, 0xfc, 0xfc, 0xfc, 0xfc, 0xfc, 0xfc, 0x0a,
    ];
    let mut local = shard(0);
    assert!(matches!(
        image::restore(claims_4_gib, &mut local),
        Err(ReplicaError::Image(_))
    ));
    assert!(image::encode(&local, 0).unwrap() == fresh);
    let mut local = shard(0);
    assert_eq!(image::restore(&good, &mut local).unwrap(), 77);
    assert_eq!(state(&local), state(&primary));
}

#[test]
fn out_of_order_backwards_or_bad_entries_are_refused_and_change_nothing() {
    let mut rng = TestRng::new(7);
    let mut standby = shard(0);
    let mut follower = Standby::new();
    let hello = Entry {
        seq: 1,
        input: Input::Hello {
            conn: 1,
            worker: 0,
            clock: 0,
            now_ms: 100,
        },
    };
    follower.accept(&mut standby, &hello).unwrap();
    let before = state(&standby);
    let push = |seq: u64, now_ms: u64, body: Vec<u8>| Entry {
        seq,
        input: Input::Push {
            conn: 1,
            now_ms,
            body: FrameBody::copy_from(&body),
        },
    };
    let good = push_body(&mut rng, 0, 0, false);
    // A gap, a repeat, time running backwards, a push frame that does not validate.
    let cases = [
        (
            push(3, 200, good.clone()),
            ReplicaError::OutOfOrder {
                expected: 2,
                got: 3,
            },
        ),
        (
            push(1, 200, good.clone()),
            ReplicaError::OutOfOrder {
                expected: 2,
                got: 1,
            },
        ),
        (
            push(2, 50, good.clone()),
            ReplicaError::TimeBackwards { last: 100, got: 50 },
        ),
    ];
    for (entry, want) in cases {
        assert_eq!(follower.accept(&mut standby, &entry), Err(want));
        assert_eq!(state(&standby), before);
        assert_eq!(follower.applied(), 1);
    }
    let mut bad = good.clone();
    let len = bad.len();
    bad.truncate(len / 2);
    assert!(matches!(
        follower.accept(&mut standby, &push(2, 200, bad)),
        Err(ReplicaError::BadPush(_))
    ));
    assert_eq!(state(&standby), before);
    // The next entry in order is still taken.
    follower.accept(&mut standby, &push(2, 200, good)).unwrap();
    assert_eq!(standby.stats().updates_applied, 1);
}

#[test]
fn undecodable_entries_are_typed_errors() {
    let entry = Entry {
        seq: 9,
        input: Input::Tick { now_ms: 5 },
    };
    let mut wire = Vec::new();
    to_wire(&entry, &mut wire);
    let mut trailing = wire.clone();
    trailing.push(0);
    for bytes in [
        &wire[..wire.len() - 1],
        &trailing[..],
        &[][..],
        &[0xff; 16][..],
        // A push claiming a body of 2^40 bytes: refused by the size limit, nothing allocated for it.
        &[1, 4, 1, 0, 253, 0, 0, 0, 0, 0, 1, 0, 0][..],
    ] {
        assert!(
            matches!(replica::decode(bytes), Err(ReplicaError::Decode(_))),
            "{bytes:?}"
        );
    }
    assert_eq!(replica::decode(&wire).unwrap(), entry);
}

#[test]
fn images_with_non_finite_values_are_refused_like_forged_checkpoints() {
    let mut primary = shard(0);
    for input in schedule(5, 100) {
        primary_takes(&mut primary, 0, input);
    }
    let mut snap = primary.core().snapshot();
    snap.weights[3] = f32::NAN;
    primary.core_mut().restore(snap, 0).unwrap();
    let poisoned = image::encode(&primary, 10).unwrap();
    let fresh = image::encode(&shard(0), 0).unwrap();
    let mut local = shard(0);
    let r = image::restore(&poisoned, &mut local);
    assert!(
        matches!(&r, Err(ReplicaError::Image(m)) if m.contains("weights[3]")),
        "{r:?}"
    );
    assert!(image::encode(&local, 0).unwrap() == fresh);
}

#[test]
fn the_primary_numbers_every_input_and_queues_it_for_its_standby_until_it_falls_a_whole_queue_behind(
) {
    use tether_server::replication::{Dropped, Primary, LOG_QUEUE};
    // Unfenced and without a standby, nothing waits on the log: inputs are not numbered.
    let mut solo = Primary::new(false, 0);
    solo.record(&Input::Tick { now_ms: 1 }).unwrap();
    assert_eq!(solo.seq(), 0);
    assert!(!solo.gates());
    // Fenced: every input is numbered, standby or not.
    let mut p = Primary::new(true, 5);
    p.record(&Input::Tick { now_ms: 1 }).unwrap();
    assert_eq!(p.seq(), 6);
    let (link, mut rx) = p.attach();
    assert_eq!(p.standby(), Some(link));
    let inputs = schedule(3, 50);
    for input in &inputs {
        p.record(input).unwrap();
    }
    // The standby gets every input after its image, in order, numbered without gaps, byte for byte.
    for (i, input) in inputs.iter().enumerate() {
        let e = replica::decode(&rx.try_recv().unwrap()).unwrap();
        assert_eq!(e.seq, 7 + i as u64);
        assert_eq!(&e.input, input);
    }
    assert!(rx.try_recv().is_err());
    // A standby that takes nothing more is dropped once a whole queue waits; the input is numbered all the same.
    for _ in 0..LOG_QUEUE {
        p.record(&Input::Tick { now_ms: 2 }).unwrap();
    }
    let seq = p.seq();
    assert_eq!(p.record(&Input::Tick { now_ms: 3 }), Err(Dropped::Behind));
    assert_eq!((p.seq(), p.standby()), (seq + 1, None));
    // A link whose other end is gone is dropped at the next input.
    let (_, rx) = p.attach();
    drop(rx);
    assert_eq!(p.record(&Input::Tick { now_ms: 4 }), Err(Dropped::Gone));
    assert_eq!(p.standby(), None);
    // Another link's loss does not drop the current standby.
    let (link, _rx) = p.attach();
    assert!(!p.detach(Some(link + 1)));
    assert!(p.detach(Some(link)));
}

/// Why a worker of the old split brain blew up (issue 36): a standby takes over its primary's public-copy lineage
/// with the image, so two copies that both kept serving after a cut cut their public copies in one numbering. The
/// same (lineage, seq) then names different weights on each, and a delta from one applied to a base read from the
/// other lands on the wrong weights. The fence keeps the two from serving at once (a cut the primary released is
/// one its standby acknowledged, so it holds the same values), and a worker does not build on a copy read from a
/// node of another term (`a_copy_read_from_a_node_of_one_term_is_not_built_on_after_a_failover` in the worker's
/// protocol tests).
#[test]
fn two_diverged_copies_name_different_weights_by_the_same_public_cut() {
    let mut rng = TestRng::new(11);
    let mut primary = shard(0);
    primary.hello(1, 0, 0, 0).unwrap();
    let first = push_body(&mut rng, 0, 0, false);
    primary.push_frame(1, &first, 1).unwrap().1.unwrap();
    primary
        .pull(1, 0, 1, 1, PullMode::Delta { have: None }, 2)
        .unwrap();
    while primary.poll_action().is_some() {}
    let (base, _) = primary.public().unwrap();
    // The standby adopts the primary's state, lineage included.
    let mut standby = shard(0);
    image::restore(&image::encode(&primary, 2).unwrap(), &mut standby).unwrap();
    assert_eq!(standby.public().unwrap().0, base);
    // A cut between them: each applies another push for round 1 (the split brain), then answers a delta pull.
    for (p, seed) in [(&mut primary, 1u64), (&mut standby, 2)] {
        let body = push_body(&mut TestRng::new(seed), 0, 1, false);
        p.push_frame(1, &body, 3).unwrap().1.unwrap();
        p.pull(1, 0, 2, 2, PullMode::Delta { have: Some(base) }, 4)
            .unwrap();
        while p.poll_action().is_some() {}
    }
    let (a, va) = primary.public().unwrap();
    let (b, vb) = standby.public().unwrap();
    assert_eq!(a, b, "both copies name their new cut alike");
    assert_ne!(
        va.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        vb.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        "the same cut holds different weights on each copy"
    );
}

//! `ShardProtocol` rules, each against the defect it fixes: pulls check membership, connection and clock, with
//! checked arithmetic on every peer-supplied number; parked pulls are bounded per worker; a rejoin is the only way
//! to move a clock without a round; a round from the future is refused; eviction refuses the evicted worker's pulls
//! and closes its connection, and a restart from a checkpoint keeps an evicted worker's clock. State stays untouched
//! on every refusal. Rules that need both sides (resends taken once, parked pulls released by the min clock, drain on
//! goodbye, eviction and rejoin) are scenarios over the real worker protocol in the root package's
//! tests/protocol_scenarios.rs.

use tether_common::codec::{CodecConfig, Encoder, Scheme};
use tether_common::config::Staleness;
use tether_common::protocol::{encode_push, ErrorCode, Outcome, Precision, PullMode, PushFrame};
use tether_common::testing::{flat_layout, sgd};

const F32: PullMode = PullMode::Full(Precision::F32);
use tether_server::protocol::{Action, ShardProtocol, MAX_PARKED_PER_WORKER};
use tether_server::shard::{Membership, ShardCore, ShardError, ShardSpec, MAX_CLOCK};

const N: usize = 8;
const TIMEOUT: u64 = 1_000;

fn proto(staleness: Staleness) -> ShardProtocol {
    ShardProtocol::new(core(staleness))
}

fn core(staleness: Staleness) -> ShardCore {
    let layout = flat_layout(N);
    let spec = ShardSpec {
        shard: 0,
        shards: 1,
        seed: 1,
        optimizer: sgd(1.0),
        staleness,
        worker_timeout_ms: TIMEOUT,
        spike_factor: 0.0,
    };
    ShardCore::new(&layout, &spec)
}

#[test]
fn the_welcome_is_built_by_the_protocol_and_announces_the_shards_bound_and_range() {
    for (staleness, bound) in [
        (Staleness::Bounded(2), Some(2)),
        (Staleness::Unbounded, None),
    ] {
        let mut p = proto(staleness);
        let w = p.hello(7, 0, 0, 0).unwrap();
        assert_eq!((w.shard, w.range_start, w.range_end), (0, 0, N as u64));
        assert_eq!(
            w.staleness, bound,
            "the bound workers check against their own"
        );
        assert_eq!((w.clock, w.min_clock, w.version), (0, 0, 0));
    }
}

fn frame(worker: u32, clock: u64) -> Vec<u8> {
    let mut g = vec![0.0f32; N];
    g[(worker as usize + clock as usize) % N] = -1.0;
    let mut out = Vec::new();
    Encoder::new(CodecConfig {
        scheme: Scheme::None,
        ..CodecConfig::default()
    })
    .unwrap()
    .encode(&g, 0, &mut out)
    .unwrap();
    out
}

/// A push of `worker` on connection `conn` at `now_ms`.
fn push_on(
    p: &mut ShardProtocol,
    conn: u64,
    worker: u32,
    clock: u64,
    payload: &[u8],
    now_ms: u64,
) -> Outcome {
    p.push_frame(conn, &round_body(worker, clock, payload, false), now_ms)
        .unwrap()
        .0
}

/// A push frame body (a skip marker when `skip`), as the wire carries it.
fn round_body(worker: u32, clock: u64, payload: &[u8], skip: bool) -> Vec<u8> {
    encode_push(&PushFrame {
        worker,
        clock,
        shard: 0,
        range_start: 0,
        range_end: N as u64,
        read_version: 0,
        loss: 1.0,
        skip,
        payload: if skip { Vec::new() } else { payload.to_vec() },
    })
    .unwrap()
    .to_vec()
}

/// A push of `worker` on connection `conn`.
fn push(p: &mut ShardProtocol, conn: u64, worker: u32, clock: u64, payload: &[u8]) -> Outcome {
    push_on(p, conn, worker, clock, payload, 0)
}

/// A skip marker of `worker` on connection `conn`.
fn skip(p: &mut ShardProtocol, conn: u64, worker: u32, clock: u64) -> Outcome {
    p.push_frame(conn, &round_body(worker, clock, &[], true), 0)
        .unwrap()
        .0
}

fn actions(p: &mut ShardProtocol) -> Vec<Action> {
    std::iter::from_fn(|| p.poll_action()).collect()
}

fn bits(p: &ShardProtocol) -> Vec<u32> {
    p.core().weights().iter().map(|w| w.to_bits()).collect()
}

#[test]
fn pulls_check_membership_connection_and_clock() {
    let mut p = proto(Staleness::Bounded(1));
    assert_eq!(
        p.pull(7, 0, 1, 0, F32, 0),
        Err(ShardError::NotMember(0)),
        "never said hello"
    );
    p.hello(7, 0, 0, 0).unwrap();
    assert_eq!(
        p.pull(8, 0, 1, 0, F32, 0),
        Err(ShardError::Superseded(0)),
        "not the worker's connection"
    );
    // Own clock 0, s = 1: pulls for clocks 0..=2 are possible, 3 is not, u64::MAX overflows nothing.
    for bad in [3, 1 << 40, u64::MAX] {
        assert!(matches!(
            p.pull(7, 0, 1, bad, F32, 0),
            Err(ShardError::ClockFromFuture { .. })
        ));
    }
    assert_eq!(p.parked(), 0, "refused pulls hold nothing");
    assert!(p.pull(7, 0, 1, 0, F32, 0).is_ok());
    assert!(
        matches!(actions(&mut p).as_slice(), [Action::Answer { pull: a, .. }] if a.request == 1)
    );
    let f = frame(0, 0);
    assert_eq!(push(&mut p, 7, 0, 0, &f), Outcome::Applied);
    assert!(matches!(
        p.pull(7, 0, 2, 0, F32, 0),
        Err(ShardError::Replay { .. })
    ));
}

#[test]
fn parked_pulls_are_bounded_per_worker() {
    let mut p = proto(Staleness::Bounded(0));
    for w in 0..3 {
        p.hello(u64::from(w), w, 0, 0).unwrap();
    }
    for i in 0..MAX_PARKED_PER_WORKER as u64 {
        p.pull(0, 0, i, 1, F32, 0).unwrap();
    }
    assert_eq!(p.pull(0, 0, 99, 1, F32, 0), Err(ShardError::Overloaded));
    // Worker 0's flood leaves worker 1 its own slots.
    p.pull(1, 1, 0, 1, F32, 0).unwrap();
    assert_eq!(p.parked(), MAX_PARKED_PER_WORKER + 1);
}

#[test]
fn a_rejoin_past_max_clock_is_refused_and_changes_nothing() {
    let mut p = proto(Staleness::Bounded(3));
    p.hello(0, 0, 0, 0).unwrap();
    p.hello(1, 1, 0, 0).unwrap();
    for bad in [MAX_CLOCK + 1, u64::MAX] {
        assert!(matches!(
            p.hello(2, 1, bad, 0),
            Err(ShardError::ClockFromFuture { .. })
        ));
    }
    assert_eq!(p.core().clocks().clock_of(1), Some(0));
    assert_eq!(p.core().clocks().min_clock(), 0);
    // A push at the largest clock fails with a typed error (no overflow, in debug builds too).
    let f = frame(0, 0);
    assert!(matches!(
        push(&mut p, 0, 0, u64::MAX, &f),
        Outcome::Refused(ErrorCode::ClockFromFuture)
    ));
    assert!(matches!(
        skip(&mut p, 0, 0, u64::MAX),
        Outcome::Refused(ErrorCode::ClockFromFuture)
    ));
    assert_eq!(p.core().version(), 0);
}

#[test]
fn a_round_from_the_future_is_refused_and_changes_nothing() {
    // Resends of a taken round (pushes and skips, duplicated or after a broken link) are two-sided scenarios in the
    // root package's tests/protocol_scenarios.rs; what stays here is the check of a single frame's clock.
    let mut p = proto(Staleness::Bounded(1));
    p.hello(0, 0, 0, 0).unwrap();
    let f0 = frame(0, 0);
    assert_eq!(push(&mut p, 0, 0, 0, &f0), Outcome::Applied);
    let after = bits(&p);
    let f5 = frame(0, 5);
    assert_eq!(
        push(&mut p, 0, 0, 5, &f5),
        Outcome::Refused(ErrorCode::ClockFromFuture)
    );
    assert_eq!(bits(&p), after);
    assert_eq!(p.core().version(), 1);
    assert_eq!(p.core().clocks().clock_of(0), Some(1));
}

#[test]
fn a_rejoin_that_jumps_over_rounds_refuses_them_later() {
    let mut p = proto(Staleness::Bounded(1));
    p.hello(0, 0, 0, 0).unwrap();
    p.hello(5, 1, 0, 0).unwrap();
    assert_eq!(skip(&mut p, 5, 1, 0), Outcome::Applied);
    // Worker 0 rejoins at clock 3 (explicit, within worker 1's clock + s + 1): rounds 0..3 were never applied, a
    // late copy is refused.
    assert_eq!(p.hello(1, 0, 3, 0).unwrap().clock, 3);
    let f = frame(0, 1);
    assert_eq!(
        push(&mut p, 1, 0, 1, &f),
        Outcome::Refused(ErrorCode::Replay)
    );
    assert_eq!(p.core().version(), 0);
}

#[test]
fn a_restart_from_a_checkpoint_keeps_an_evicted_workers_clock() {
    // Found by the protocol harness (seed 2122289005): a checkpoint that forgot evicted workers let one rejoin below
    // a round the checkpoint's weights hold, and its resend of that round was applied a second time.
    let mut p = proto(Staleness::Bounded(1));
    p.hello(10, 0, 0, 0).unwrap();
    p.hello(11, 1, 0, 0).unwrap();
    // Worker 1's round 0 is applied; its outcome is lost with the link, so the round stays pending at the worker.
    let f = frame(1, 0);
    assert_eq!(push(&mut p, 11, 1, 0, &f), Outcome::Applied);
    let applied = bits(&p);
    // Worker 1 falls silent past the timeout and is evicted; worker 0 heartbeats.
    for now in (100..=TIMEOUT).step_by(100) {
        p.heartbeat(10, 0, now);
        p.tick(now);
    }
    assert!(!p.core().clocks().is_live(1));
    // The shard checkpoints, crashes and restarts from that checkpoint.
    let snap = p.snapshot();
    let mut restored = core(Staleness::Bounded(1));
    restored.restore(snap, 2 * TIMEOUT).unwrap();
    let mut p = ShardProtocol::new(restored);
    // Still evicted: it blocks nobody, as before the crash.
    assert!(!p.core().clocks().is_live(1));
    assert!(p.core().can_answer(1));
    // Worker 1 rejoins at its oldest unsettled round and resends it: the rejoin lands past the round the weights
    // hold, and the resend changes nothing.
    assert_eq!(p.hello(20, 1, 0, 2 * TIMEOUT).unwrap().clock, 1);
    assert_ne!(push(&mut p, 20, 1, 0, &f), Outcome::Applied);
    assert_eq!(bits(&p), applied);
    assert_eq!(p.core().version(), 1);
}

#[test]
fn eviction_refuses_the_evicted_pulls_and_closes_the_connection() {
    let mut p = proto(Staleness::Bounded(0));
    p.hello(10, 0, 0, 0).unwrap();
    p.hello(11, 1, 0, 0).unwrap();
    let f = frame(0, 0);
    assert_eq!(push(&mut p, 10, 0, 0, &f), Outcome::Applied);
    p.pull(10, 0, 5, 1, F32, 0).unwrap();
    p.pull(11, 1, 6, 0, F32, 0).unwrap();
    actions(&mut p); // worker 1's pull at 0 is answered at once
                     // Worker 0 heartbeats; worker 1 is silent past the timeout.
    for now in (100..=TIMEOUT).step_by(100) {
        p.heartbeat(10, 0, now);
        p.tick(now);
    }
    let acts = actions(&mut p);
    assert!(acts.contains(&Action::Close {
        conn: 11,
        code: Some(ErrorCode::Evicted)
    }));
    // Worker 0's pull at 1 is released by the eviction.
    assert!(acts
        .iter()
        .any(|a| matches!(a, Action::Answer { pull: r, .. } if r.worker == 0 && r.request == 5)));
    assert!(!p.core().clocks().is_live(1));
    // Heartbeats on a superseded connection do not keep a worker alive.
    p.hello(12, 0, 1, TIMEOUT).unwrap();
    p.heartbeat(10, 0, 3 * TIMEOUT);
    assert_eq!(p.tick(3 * TIMEOUT), vec![0]);
}

/// The body of a finished reply, as the worker receives it (one aligned buffer).
fn body(reply: &tether_server::protocol::WireReply) -> rkyv::util::AlignedVec {
    let mut b = rkyv::util::AlignedVec::new();
    for c in &reply.chunks {
        b.extend_from_slice(c);
    }
    b
}

#[test]
fn answers_come_out_as_finished_wire_replies_in_the_pulled_precision_and_mode() {
    use tether_common::protocol::{
        access_delta, access_params, decode_values, DeltaKind, FrameKind,
    };
    let mut p = proto(Staleness::Bounded(0));
    p.core_mut().set_public(
        CodecConfig {
            scheme: Scheme::None,
            zstd: false,
            ..CodecConfig::default()
        },
        9,
    );
    p.hello(1, 0, 0, 0).unwrap();
    let f = frame(0, 0);
    assert_eq!(push(&mut p, 1, 0, 0, &f), Outcome::Applied);
    let weights = p.core().weights().to_vec();
    assert!(weights.iter().any(|w| *w != 0.0));
    for (request, precision) in [(10, Precision::F32), (11, Precision::Bf16)] {
        p.pull(1, 0, request, 1, PullMode::Full(precision), 0)
            .unwrap();
        let answered: [Action; 1] = actions(&mut p).try_into().unwrap();
        let [Action::Answer { pull, reply }] = answered else {
            panic!("the open gate answers at once");
        };
        assert_eq!((pull.request, reply.kind), (request, FrameKind::Params));
        let b = body(&reply);
        let r = access_params(&b).unwrap();
        r.check_shape(0, N as u64).unwrap();
        let h = r.header.get();
        assert_eq!(h, reply.header);
        assert_eq!(
            (h.shard, h.request, h.clock, h.version, h.min_clock, h.epoch),
            (0, request, 1, 1, 1, 0)
        );
        let mut got = vec![0.0f32; N];
        decode_values(r.values(), precision, &mut got);
        let want: Vec<f32> = match precision {
            Precision::F32 => weights.clone(),
            Precision::Bf16 => weights
                .iter()
                .map(|w| half::bf16::from_f32(*w).to_f32())
                .collect(),
        };
        assert_eq!(got, want);
    }
    // A delta pull from nothing held: the whole public copy, whose cut the header names.
    p.pull(1, 0, 12, 1, PullMode::Delta { have: None }, 0)
        .unwrap();
    let answered: [Action; 1] = actions(&mut p).try_into().unwrap();
    let [Action::Answer { reply, .. }] = answered else {
        panic!("the open gate answers at once");
    };
    assert_eq!(reply.kind, FrameKind::Delta);
    let b = body(&reply);
    let view = access_delta(&b, 0, N as u64).unwrap();
    assert_eq!(view.kind(), DeltaKind::Full);
    assert_eq!(view.header.header.get(), reply.header);
    assert_eq!(reply.header.request, 12);
    let (cut, public) = p.public().unwrap();
    assert_eq!(reply.public, Some(cut));
    let mut got = vec![0.0f32; N];
    decode_values(view.payload, Precision::F32, &mut got);
    assert_eq!(got, public);
    assert_eq!(
        p.stats().pulled_bytes,
        (4 + 2 + 4) * N as u64,
        "values counted, headers not"
    );
}

// Issue 22: one compromised or broken node cannot stop the cluster. Each test below fails on the code before it.

fn with_membership(staleness: Staleness, workers: u32, progress_timeout_ms: u64) -> ShardProtocol {
    let mut c = core(staleness);
    c.set_membership(Membership {
        workers: Some(workers),
        progress_timeout_ms,
    });
    ShardProtocol::new(c)
}

#[test]
fn a_hello_claim_beyond_the_bound_rejoins_at_the_shards_value() {
    let mut p = proto(Staleness::Bounded(2));
    p.hello(10, 0, 0, 0).unwrap();
    p.hello(11, 1, 0, 0).unwrap();
    // Worker 1 claims 2^40: beyond worker 0's clock + s + 1, so it rejoins at its own row.
    let w = p.hello(12, 1, 1 << 40, 0).unwrap();
    assert_eq!(w.clock, 0);
    assert_eq!(p.core().clocks().clock_of(1), Some(0));
    // Up to worker 0's clock + s + 1 a claim is taken (an honest rejoin ahead after a shard restart).
    assert_eq!(p.hello(13, 1, 3, 0).unwrap().clock, 3);
    assert_eq!(
        p.hello(14, 1, 4, 0).unwrap().clock,
        3,
        "its own row never raises the bound"
    );
    // Alone, a claim is bounded by the floor: nobody live to measure against.
    let mut alone = proto(Staleness::Bounded(2));
    assert_eq!(alone.hello(1, 5, 1 << 48, 0).unwrap().clock, 0);
}

#[test]
fn a_departed_or_evicted_workers_clock_never_becomes_the_join_value() {
    // The attack of the issue: one identity, alone on the shard, runs its clock up and leaves; every later
    // newcomer would join there and every honest push would be refused for the shard's life.
    for leave_by_goodbye in [true, false] {
        let mut p = proto(Staleness::Bounded(2));
        p.hello(1, 5, 0, 0).unwrap();
        for c in 0..50 {
            assert_eq!(
                skip(&mut p, 1, 5, c),
                Outcome::Applied,
                "a lone member may advance"
            );
        }
        if leave_by_goodbye {
            p.goodbye(1, 5, 50, 0);
        } else {
            p.tick(TIMEOUT);
        }
        assert_eq!(p.live(), 0);
        assert_eq!(
            p.core().clocks().min_clock(),
            0,
            "the floor, not the departed clock"
        );
        let w = p.hello(2, 0, 0, TIMEOUT).unwrap();
        assert_eq!(w.clock, 0);
        let f = frame(0, 0);
        assert_eq!(push(&mut p, 2, 0, 0, &f), Outcome::Applied);
        assert_eq!(p.core().version(), 1);
    }
    // A minimum held over two live workers is evidence: it stays the join value after both leave.
    let mut p = proto(Staleness::Bounded(2));
    p.hello(1, 0, 0, 0).unwrap();
    p.hello(2, 1, 0, 0).unwrap();
    for c in 0..3 {
        skip(&mut p, 1, 0, c);
        skip(&mut p, 2, 1, c);
    }
    p.goodbye(1, 0, 3, 0);
    p.goodbye(2, 1, 3, 0);
    assert_eq!(p.live(), 0);
    assert_eq!(p.hello(3, 2, 0, 0).unwrap().clock, 3);
}

#[test]
fn rounds_more_than_s_plus_one_ahead_of_the_minimum_are_refused_and_change_nothing() {
    let mut p = proto(Staleness::Bounded(1));
    p.hello(10, 0, 0, 0).unwrap();
    p.hello(11, 1, 0, 0).unwrap();
    // Worker 0 floods pushes without pulling: rounds 0, 1 and 2 (m + s + 1 with m = 0) are taken, round 3 is not.
    for c in 0..3 {
        let f = frame(0, c);
        assert_eq!(push(&mut p, 10, 0, c, &f), Outcome::Applied);
    }
    let before = bits(&p);
    let f = frame(0, 3);
    assert_eq!(
        push(&mut p, 10, 0, 3, &f),
        Outcome::Refused(ErrorCode::ClockFromFuture)
    );
    assert_eq!(
        skip(&mut p, 10, 0, 3),
        Outcome::Refused(ErrorCode::ClockFromFuture)
    );
    assert_eq!(bits(&p), before);
    assert_eq!(p.core().version(), 3);
    assert_eq!(p.core().clocks().clock_of(0), Some(3), "clock not advanced");
    // The worker at the minimum is never refused; once it moves, the held-back round is taken.
    assert_eq!(skip(&mut p, 11, 1, 0), Outcome::Applied);
    assert_eq!(push(&mut p, 10, 0, 3, &f), Outcome::Applied);
}

#[test]
fn a_new_hello_closes_the_superseded_connection_and_nothing_sent_on_it_is_taken() {
    let mut p = proto(Staleness::Bounded(2));
    p.hello(1, 0, 0, 0).unwrap();
    p.pull(1, 0, 7, 0, F32, 0).unwrap();
    actions(&mut p);
    p.hello(2, 0, 0, 0).unwrap();
    assert!(actions(&mut p).contains(&Action::Close {
        conn: 1,
        code: Some(ErrorCode::Superseded)
    }));
    let before = bits(&p);
    let f = frame(0, 0);
    assert_eq!(
        push(&mut p, 1, 0, 0, &f),
        Outcome::Refused(ErrorCode::Superseded)
    );
    assert_eq!(
        skip(&mut p, 1, 0, 0),
        Outcome::Refused(ErrorCode::Superseded)
    );
    assert_eq!(p.pull(1, 0, 8, 0, F32, 0), Err(ShardError::Superseded(0)));
    assert_eq!(bits(&p), before);
    assert_eq!(p.core().clocks().clock_of(0), Some(0));
    assert_eq!(p.core().version(), 0);
    // The newer session is heard.
    assert_eq!(push(&mut p, 2, 0, 0, &f), Outcome::Applied);
}

#[test]
fn ranks_beyond_the_configured_workers_are_refused_at_hello() {
    let mut p = with_membership(Staleness::Bounded(2), 2, u64::MAX);
    p.hello(1, 1, 0, 0).unwrap();
    let e = p.hello(2, 999, 0, 0).unwrap_err();
    assert_eq!(
        e,
        ShardError::UnknownRank {
            worker: 999,
            workers: 2
        }
    );
    assert_eq!(e.code(), ErrorCode::Unauthorized);
    assert!(e.to_string().contains("999") && e.to_string().contains("ranks 0..2 may join"));
    assert_eq!(p.live(), 1);
    assert!(p.hello(3, 2, 0, 0).is_err(), "ranks are 0..workers");
}

#[test]
fn finished_workers_are_counted_by_distinct_rank_not_by_goodbye() {
    let mut p = with_membership(Staleness::Bounded(2), 2, u64::MAX);
    for conn in [1, 2] {
        p.hello(conn, 0, 0, 0).unwrap();
        p.goodbye(conn, 0, 0, 0);
    }
    assert_eq!(p.stats().left, 2);
    assert_eq!(
        p.stats().finished.len(),
        1,
        "one identity finishing twice is one rank"
    );
    p.hello(3, 1, 0, 0).unwrap();
    p.goodbye(3, 1, 0, 0);
    assert_eq!(
        p.stats().finished.iter().copied().collect::<Vec<_>>(),
        vec![0, 1]
    );
}

#[test]
fn a_member_that_heartbeats_but_never_pushes_is_evicted_at_the_progress_deadline() {
    const PROGRESS: u64 = 10 * TIMEOUT;
    let mut p = with_membership(Staleness::Bounded(0), 2, PROGRESS);
    p.hello(10, 0, 0, 0).unwrap();
    p.hello(11, 1, 0, 0).unwrap();
    let f = frame(0, 0);
    assert_eq!(push(&mut p, 10, 0, 0, &f), Outcome::Applied);
    // Worker 1 heartbeats but never pushes; nobody waits on it yet: a slow round is not a stall.
    for now in (100..=2 * PROGRESS).step_by(100) {
        p.heartbeat(10, 0, now);
        p.heartbeat(11, 1, now);
        assert!(p.tick(now).is_empty(), "nobody waits: no eviction at {now}");
    }
    // Worker 0's pull at 1 now waits on worker 1, which has not moved for the deadline: it is evicted.
    let t0 = 2 * PROGRESS;
    p.pull(10, 0, 5, 1, F32, t0).unwrap();
    assert_eq!(p.parked(), 1);
    let evicted = p.tick(t0 + 100);
    assert_eq!(evicted, vec![1]);
    let acts = actions(&mut p);
    assert!(acts.contains(&Action::Close {
        conn: 11,
        code: Some(ErrorCode::Evicted)
    }));
    assert!(acts
        .iter()
        .any(|a| matches!(a, Action::Answer { pull: r, .. } if r.request == 5)));
    assert_eq!(p.stats().stalled_evictions, 1);
    // A member that makes progress is never stalled out, however long the run.
    let mut q = with_membership(Staleness::Bounded(0), 2, PROGRESS);
    q.hello(10, 0, 0, 0).unwrap();
    q.hello(11, 1, 0, 0).unwrap();
    for c in 0..30u64 {
        let now = c * (PROGRESS / 2);
        q.heartbeat(10, 0, now);
        q.heartbeat(11, 1, now);
        let f = frame(0, c);
        assert_eq!(push_on(&mut q, 10, 0, c, &f, now), Outcome::Applied);
        q.pull(10, 0, c, c + 1, F32, now).unwrap();
        assert!(q.tick(now).is_empty());
        assert_eq!(
            q.push_frame(11, &round_body(1, c, &[], true), now)
                .unwrap()
                .0,
            Outcome::Applied
        );
        actions(&mut q);
    }
}

#[test]
fn a_snapshot_with_a_clock_beyond_the_maximum_is_refused_and_changes_nothing() {
    let p = proto(Staleness::Bounded(2));
    for (live, evicted) in [
        (vec![(0, MAX_CLOCK + 1)], vec![]),
        (vec![(0, 1)], vec![(1, u64::MAX)]),
    ] {
        let mut snap = p.snapshot();
        snap.version = 9;
        snap.clocks = live;
        snap.evicted = evicted;
        let mut fresh = core(Staleness::Bounded(2));
        let before: Vec<u32> = fresh.weights().iter().map(|w| w.to_bits()).collect();
        assert!(fresh.restore(snap, 0).is_err());
        assert_eq!(fresh.version(), 0);
        assert_eq!(fresh.clocks().live(), 0);
        assert_eq!(
            fresh
                .weights()
                .iter()
                .map(|w| w.to_bits())
                .collect::<Vec<_>>(),
            before
        );
    }
}

/// The delta reply `p` answers a pull of worker 0 on connection 1 with, holding `have` at `clock`.
fn delta_pull(
    p: &mut ShardProtocol,
    request: u64,
    clock: u64,
    have: Option<tether_common::protocol::PublicRef>,
) -> tether_server::protocol::WireReply {
    p.pull(1, 0, request, clock, PullMode::Delta { have }, 0)
        .unwrap();
    let answered: [Action; 1] = actions(p).try_into().unwrap();
    let [Action::Answer { reply, .. }] = answered else {
        panic!("the open gate answers at once");
    };
    reply
}

#[test]
fn a_fresh_shard_offers_its_initial_cut_and_keeps_the_promise_once_its_weights_moved() {
    use tether_common::protocol::{access_delta, DeltaKind, InitialCut, PublicRef};
    let layout = flat_layout(N);
    let mut init = vec![0.0f32; N];
    layout.init_range(1, 0..N, &mut init);
    // Fresh: the welcome names cut 0 of the public lineage, the seed and the CRC of the layout's initial values; a
    // worker claiming that cut is told it holds the newest one.
    let mut p = proto(Staleness::Bounded(0));
    let offer = p
        .hello(1, 0, 0, 0)
        .unwrap()
        .initial
        .expect("a fresh shard offers its initial cut");
    assert_eq!((offer.seed, offer.crc32), (1, InitialCut::checksum(&init)));
    let claim = PublicRef {
        lineage: offer.lineage,
        seq: 0,
    };
    let r = delta_pull(&mut p, 1, 0, Some(claim));
    assert_eq!(
        access_delta(&body(&r), 0, N as u64).unwrap().kind(),
        DeltaKind::NotModified
    );
    assert_eq!(r.public, Some(claim));
    assert_eq!(p.public().unwrap().1, init, "cut 0 is the initial weights");
    // The offer stays while cut 0 of that lineage is the initial weights.
    assert_eq!(p.hello(1, 0, 0, 0).unwrap().initial, Some(offer));

    // A push lands before any public copy exists: later welcomes offer nothing, and a worker claiming the promised
    // cut gets the whole copy under another lineage (the copy is made from the moved weights).
    let mut p = proto(Staleness::Bounded(0));
    let offer = p.hello(1, 0, 0, 0).unwrap().initial.unwrap();
    assert_eq!(push(&mut p, 1, 0, 0, &frame(0, 0)), Outcome::Applied);
    assert_ne!(p.core().weights(), &init[..]);
    assert_eq!(p.hello(1, 0, 1, 0).unwrap().initial, None);
    let claim = PublicRef {
        lineage: offer.lineage,
        seq: 0,
    };
    let r = delta_pull(&mut p, 2, 1, Some(claim));
    assert_eq!(
        access_delta(&body(&r), 0, N as u64).unwrap().kind(),
        DeltaKind::Full
    );
    assert_ne!(r.public.unwrap().lineage, offer.lineage);

    // A shard resumed from a checkpoint (even one of version 0) offers nothing.
    let snap = proto(Staleness::Bounded(0)).core().snapshot();
    let mut c = core(Staleness::Bounded(0));
    c.restore(snap, 0).unwrap();
    assert_eq!(
        ShardProtocol::new(c).hello(1, 0, 0, 0).unwrap().initial,
        None
    );
}

/// A BSP shard of three workers (connection = rank + 1, all joined at 0) whose rounds close at `quorum` with a grace
/// window of `grace_factor` × the median round time.
fn three_members(quorum: u32, grace_factor: f32) -> ShardProtocol {
    let mut c = core(Staleness::Bounded(0));
    c.set_quorum(tether_server::quorum::QuorumSettings {
        quorum,
        grace_factor,
        grace_max_ms: TIMEOUT,
    });
    let mut p = ShardProtocol::new(c);
    for w in 0..3u32 {
        p.hello(u64::from(w) + 1, w, 0, 0).unwrap();
    }
    p
}

/// Every worker heartbeats at `now_ms` (they are alive, only slow).
fn heartbeat_all(p: &mut ShardProtocol, now_ms: u64) {
    for w in 0..3u32 {
        p.heartbeat(u64::from(w) + 1, w, now_ms);
    }
}

/// A push of `worker` (connection = rank + 1) at `now_ms`.
fn push_at(p: &mut ShardProtocol, worker: u32, clock: u64, now_ms: u64) -> Outcome {
    let payload = frame(worker, clock);
    push_on(p, u64::from(worker) + 1, worker, clock, &payload, now_ms)
}

fn answered(p: &mut ShardProtocol) -> Vec<(u32, u64)> {
    actions(p)
        .into_iter()
        .filter_map(|a| match a {
            Action::Answer { pull, .. } => Some((pull.worker, pull.clock)),
            _ => None,
        })
        .collect()
}

#[test]
fn a_quorum_round_closes_after_its_grace_window_and_the_late_push_is_applied_in_the_next() {
    // BSP, three workers, a quorum of two. Worker 2 is slow in round 0.
    let mut p = three_members(2, 1.0);
    assert_eq!(push_at(&mut p, 0, 0, 10), Outcome::Applied);
    p.pull(1, 0, 1, 1, F32, 10).unwrap();
    assert_eq!(push_at(&mut p, 1, 0, 20), Outcome::Applied);
    p.pull(2, 1, 1, 1, F32, 20).unwrap();
    // The quorum pushed at 20 ms; with no round time known the window is the eviction timeout.
    let early = answered(&mut p);
    assert!(
        early.is_empty(),
        "the round waits out its grace: {early:?} gate {}",
        p.core().clocks().gate()
    );
    assert_eq!(p.poll_timeout(), Some(20 + TIMEOUT));
    // Everyone is alive; worker 2 is only slow.
    heartbeat_all(&mut p, 900);
    p.tick(20 + TIMEOUT - 1);
    assert!(answered(&mut p).is_empty());
    let before = bits(&p);
    assert!(p.tick(20 + TIMEOUT).is_empty(), "nobody is evicted");
    assert_eq!(answered(&mut p), vec![(0, 1), (1, 1)]);
    assert_eq!(p.core().clocks().gate(), 1);
    assert_eq!(bits(&p), before, "closing a round changes no weight");
    // Worker 2's late push of round 0 is applied, not dropped, and its pull passes at once.
    let version = p.version();
    assert_eq!(push_at(&mut p, 2, 0, 1100), Outcome::Applied);
    assert_eq!(p.version(), version + 1);
    p.pull(3, 2, 1, 1, F32, 1100).unwrap();
    assert_eq!(answered(&mut p), vec![(2, 1)]);
    // Worker 2 is back at the open round (1): round 1 waits for it again, within the grace window.
    push_at(&mut p, 0, 1, 1200);
    p.pull(1, 0, 2, 2, F32, 1200).unwrap();
    push_at(&mut p, 1, 1, 1300);
    assert!(answered(&mut p).is_empty());
    assert!(p.poll_timeout().is_some());
    push_at(&mut p, 2, 1, 1400);
    assert_eq!(answered(&mut p), vec![(0, 2)]);
    assert_eq!(p.poll_timeout(), None);
    assert_eq!(p.core().clocks().rounds().left_behind_total(), 1);
}

#[test]
fn a_worker_behind_the_open_round_holds_no_round() {
    // Worker 2 dies in round 0. After the first grace window it is behind the open round, so round 1 closes as soon
    // as the two others pushed it, with no grace window at all.
    let mut p = three_members(2, 1.0);
    push_at(&mut p, 0, 0, 10);
    push_at(&mut p, 1, 0, 20);
    heartbeat_all(&mut p, 900);
    p.tick(20 + TIMEOUT);
    assert_eq!(p.core().clocks().gate(), 1);
    push_at(&mut p, 0, 1, 1100);
    p.pull(1, 0, 2, 2, F32, 1100).unwrap();
    push_at(&mut p, 1, 1, 1150);
    assert_eq!(answered(&mut p), vec![(0, 2)]);
    assert_eq!(p.poll_timeout(), None);
    assert_eq!(p.core().clocks().clock_of(2), Some(0));
}

#[test]
fn with_the_default_quorum_a_silent_worker_holds_the_round_until_it_is_evicted() {
    let mut p = three_members(0, 1.0);
    push_at(&mut p, 0, 0, 10);
    push_at(&mut p, 1, 0, 20);
    p.pull(1, 0, 1, 1, F32, 20).unwrap();
    assert_eq!(
        p.poll_timeout(),
        None,
        "no grace window with every worker as the quorum"
    );
    p.heartbeat(1, 0, TIMEOUT - 10);
    p.heartbeat(2, 1, TIMEOUT - 10);
    p.tick(TIMEOUT - 1);
    assert!(answered(&mut p).is_empty());
    assert_eq!(p.tick(TIMEOUT), vec![2]);
    assert_eq!(answered(&mut p), vec![(0, 1)]);
}

#[test]
fn the_grace_window_learns_the_round_time() {
    // Rounds of 100 ms with everyone on time, then worker 2 goes silent: its round closes 50 ms (0.5 × 100) after
    // the quorum, long before the eviction timeout.
    let mut p = three_members(2, 0.5);
    let mut now = 0;
    for round in 0..5u64 {
        now += 100;
        for w in 0..3u32 {
            assert_eq!(push_at(&mut p, w, round, now), Outcome::Applied);
        }
    }
    assert_eq!(p.core().clocks().gate(), 5);
    assert_eq!(p.core().clocks().rounds().grace_ms(), 50);
    now += 100;
    push_at(&mut p, 0, 5, now);
    push_at(&mut p, 1, 5, now);
    p.pull(1, 0, 6, 6, F32, now).unwrap();
    assert_eq!(p.poll_timeout(), Some(now + 50));
    p.tick(now + 50);
    assert_eq!(answered(&mut p), vec![(0, 6)]);
}

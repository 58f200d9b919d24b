//! `WorkerProtocol` rules, each against the defect it fixes: replies matched to their own request (a superseded or
//! partial pull leaves nothing stale behind), skip markers on the push path, pushes kept byte for byte until their
//! shard settles them, refusals reported, heartbeats on a timer whatever the step, and rejoins after a clock jump.
//! Each is a rule of the session alone, fed messages no transport or shard produces on cue (a late reply of a dead
//! link, a refusal, a skipped welcome clock); the rules that need both sides (spare replies dropped, a lost push resent
//! byte for byte and taken once, a long step kept live by heartbeats) are scenarios over the real shard protocols in
//! the root package's tests/protocol_scenarios.rs.

use tether_common::codec::{CodecConfig, Encoder, Rounding, Scheme};
use tether_common::config::Staleness;
use tether_common::protocol::{
    access_push, encode_delta_preamble, encode_params, encode_values, Control, DeltaHeader,
    DeltaKind, ErrorCode, FrameKind, Outcome, ParamReply, Precision, ProtocolError, PublicRef,
    PullMode, ReplyHeader, Welcome,
};
use tether_worker::protocol::{
    Event, PullReply, Settled, Transmit, WorkerProtocol, MAX_GAP_ROUNDS,
};

const RANGES: [(u64, u64); 2] = [(0, 10), (10, 20)];
const HB: u64 = 100;

fn protocol() -> WorkerProtocol {
    WorkerProtocol::new(
        3,
        0xabc,
        RANGES.to_vec(),
        Staleness::Bounded(2),
        PullMode::Full(Precision::F32),
        HB,
    )
}

fn welcome(shard: usize, clock: u64) -> Welcome {
    Welcome {
        shard: shard as u32,
        range_start: RANGES[shard].0,
        range_end: RANGES[shard].1,
        staleness: Some(2),
        fragments: 1,
        min_clock: clock,
        version: 0,
        clock,
        initial: None,
        term: 0,
    }
}

/// The reply to `request` for a pull at `clock`, reporting `version`, `min_clock` and the rollback `epoch`, and
/// for a delta reply the cut it leaves the worker holding.
fn answer(
    request: u64,
    clock: u64,
    version: u64,
    min_clock: u64,
    epoch: u64,
    public: Option<PublicRef>,
) -> PullReply {
    PullReply {
        header: ReplyHeader {
            shard: 0,
            request,
            clock,
            version,
            min_clock,
            epoch,
            range_start: 0,
            range_end: 0,
            term: 0,
        },
        public,
    }
}

fn drain(s: &mut WorkerProtocol) -> (Vec<Transmit>, Vec<Event>) {
    let mut t = Vec::new();
    while let Some(x) = s.poll_transmit() {
        t.push(x);
    }
    let mut e = Vec::new();
    while let Some(x) = s.poll_event() {
        e.push(x);
    }
    (t, e)
}

/// Connects every shard at `clock` and empties the queues.
fn connected(clock: u64) -> WorkerProtocol {
    let mut s = protocol();
    for k in 0..2 {
        assert_eq!(s.hello(k).clock, 0);
        s.connected(k, &welcome(k, clock), 0).unwrap();
    }
    drain(&mut s);
    s
}

fn requests(t: &[Transmit]) -> Vec<(usize, u64, u64)> {
    t.iter()
        .filter_map(|x| match x {
            Transmit::Control {
                shard,
                msg: Control::PullRequest { request, clock, .. },
            } => Some((*shard, *request, *clock)),
            _ => None,
        })
        .collect()
}

fn pushes(t: &[Transmit]) -> Vec<(usize, u64, bytes::Bytes)> {
    t.iter()
        .filter_map(|x| match x {
            Transmit::Push {
                shard,
                clock,
                bytes,
            } => Some((*shard, *clock, bytes.clone())),
            _ => None,
        })
        .collect()
}

#[test]
fn a_reply_to_a_superseded_request_is_never_used() {
    let mut s = connected(0);
    s.start_pull(0);
    let (t, _) = drain(&mut s);
    let first = requests(&t);
    assert_eq!(first.len(), 2);
    let (_, old0, _) = first[0];
    // Shard 1 answers; shard 0's link breaks before it does.
    assert!(s.reply(1, answer(first[1].1, 0, 5, 0, 0, None)));
    s.disconnected(0);
    let (_, e) = drain(&mut s);
    assert_eq!(e, vec![Event::Reconnect { shard: 0 }]);
    s.hello(0);
    s.connected(0, &welcome(0, 0), 1).unwrap();
    let (t, _) = drain(&mut s);
    let again = requests(&t);
    assert_eq!(
        again.len(),
        1,
        "only the shard that has not answered is asked again"
    );
    let (k, new0, c) = again[0];
    assert_eq!((k, c), (0, 0));
    assert_ne!(new0, old0);
    // The reply to the superseded request turns up late: dropped.
    assert!(!s.reply(0, answer(old0, 0, 4, 0, 0, None)));
    assert!(s.pulling());
    assert!(s.reply(0, answer(new0, 0, 4, 0, 0, None)));
    let (_, e) = drain(&mut s);
    assert_eq!(e, vec![Event::PullDone { clock: 0 }]);
    assert_eq!(s.stats().stale_replies, 1);
}

#[test]
fn a_reply_from_an_earlier_round_is_not_read_into_the_next() {
    // The defect: replies still queued on the other links were read by the next pull, one behind from then on.
    let mut s = connected(0);
    s.start_pull(0);
    let (t, _) = drain(&mut s);
    let r0 = requests(&t);
    assert!(s.reply(0, answer(r0[0].1, 0, 1, 0, 0, None)));
    // Round 0 is abandoned (a new pull supersedes it) before shard 1's answer arrives.
    s.start_pull(0);
    let (t, _) = drain(&mut s);
    let r1 = requests(&t);
    assert!(
        !s.reply(1, answer(r0[1].1, 0, 1, 0, 0, None)),
        "answer to the old round"
    );
    assert!(
        !s.reply(0, answer(r1[0].1, 1, 1, 0, 0, None)),
        "right request, wrong clock"
    );
    assert!(s.reply(0, answer(r1[0].1, 0, 1, 0, 0, None)));
    assert!(s.reply(1, answer(r1[1].1, 0, 1, 0, 0, None)));
}

#[test]
fn a_skip_is_a_marker_on_the_push_path() {
    let mut s = connected(0);
    s.skip(0.0).unwrap();
    let (t, _) = drain(&mut s);
    assert!(
        t.iter().all(|x| matches!(x, Transmit::Push { .. })),
        "no control message moves the clock: {t:?}"
    );
    let p = pushes(&t);
    assert_eq!(p.len(), 2);
    for (k, clock, bytes) in p {
        let meta = access_push(&bytes).unwrap().meta();
        assert!(meta.skip);
        assert_eq!((meta.shard as usize, meta.clock, clock), (k, 0, 0));
    }
    assert_eq!(s.clock(), 1);
}

#[test]
fn an_unsettled_push_is_resent_byte_for_byte_after_a_reconnect() {
    let mut s = connected(0);
    let mut frames = vec![vec![1u8, 2, 3], vec![4u8, 5]];
    s.push(&mut frames, 0.5).unwrap();
    assert_eq!(
        frames,
        vec![vec![1u8, 2, 3], vec![4u8, 5]],
        "buffers come back"
    );
    let (t, _) = drain(&mut s);
    let sent = pushes(&t);
    s.outcome(1, 0, Outcome::Applied, 0).unwrap();
    s.disconnected(0);
    drain(&mut s);
    // The rejoin starts at the unsettled round, and the same bytes go out again.
    assert_eq!(s.hello(0).clock, 0);
    assert_eq!(s.hello(1).clock, 1, "shard 1 settled round 0");
    s.connected(0, &welcome(0, 0), 5).unwrap();
    let (t, _) = drain(&mut s);
    let resent = pushes(&t);
    assert_eq!(resent.len(), 1);
    assert_eq!(resent[0].2, sent[0].2, "byte for byte");
    assert!(!s.settled());
    s.outcome(0, 0, Outcome::Duplicate, 0).unwrap();
    assert!(s.settled());
    assert_eq!(s.stats().duplicates, 1);
}

#[test]
fn a_refused_push_reaches_the_trainer_and_the_report() {
    let mut s = connected(0);
    let mut frames = vec![vec![1u8], vec![2u8]];
    s.push(&mut frames, 0.5).unwrap();
    drain(&mut s);
    s.outcome(0, 0, Outcome::Refused(ErrorCode::NonFinite), 0)
        .unwrap();
    s.outcome(0, 0, Outcome::Applied, 0).unwrap(); // a second answer for the same round is ignored
    let (_, e) = drain(&mut s);
    assert!(matches!(
        e.as_slice(),
        [Event::Settled(Settled {
            shard: 0,
            clock: 0,
            outcome: Outcome::Refused(ErrorCode::NonFinite),
            ..
        })]
    ));
    assert_eq!(s.stats().pushes_refused, 1);
}

#[test]
fn heartbeats_run_on_a_timer_whatever_the_step_does() {
    let mut s = connected(0);
    // No pull, no push: the worker is computing a long step.
    assert_eq!(s.poll_timeout(), Some(HB));
    for i in 1..=20u64 {
        s.handle_timeout(i * HB);
        let (t, _) = drain(&mut s);
        let beats = t
            .iter()
            .filter(|x| {
                matches!(
                    x,
                    Transmit::Control {
                        msg: Control::Heartbeat { .. },
                        ..
                    }
                )
            })
            .count();
        assert_eq!(beats, 2, "one heartbeat per shard every period (tick {i})");
    }
}

#[test]
fn a_clock_jump_at_one_shard_rejoins_the_others_once_settled() {
    let mut s = connected(0);
    let mut frames = vec![vec![1u8], vec![2u8]];
    s.push(&mut frames, 0.5).unwrap();
    drain(&mut s);
    // Shard 1 lost us (evicted) and the others moved on: it welcomes us back at clock 5.
    s.disconnected(1);
    drain(&mut s);
    s.hello(1);
    s.connected(1, &welcome(1, 5), 10).unwrap();
    let (_, e) = drain(&mut s);
    // Round 0 at shard 1 was jumped over: dropped and reported, so the residual policy can credit it back.
    assert!(e.iter().any(|x| matches!(
        x,
        Event::Settled(Settled {
            shard: 1,
            clock: 0,
            outcome: Outcome::Refused(ErrorCode::Evicted),
            ..
        })
    )));
    assert_eq!(s.clock(), 5);
    // Shard 0 still owes the outcome of round 0; only then does it rejoin at 5.
    assert!(!e.contains(&Event::Reconnect { shard: 0 }));
    s.outcome(0, 0, Outcome::Applied, 0).unwrap();
    let (_, e) = drain(&mut s);
    assert_eq!(e.last(), Some(&Event::Reconnect { shard: 0 }));
    assert_eq!(s.hello(0).clock, 5);
}

/// The `have` each pull request of `t` names, per shard.
fn haves(t: &[Transmit]) -> Vec<(usize, Option<PublicRef>)> {
    t.iter()
        .filter_map(|x| match x {
            Transmit::Control {
                shard,
                msg:
                    Control::PullRequest {
                        mode: PullMode::Delta { have },
                        ..
                    },
            } => Some((*shard, *have)),
            _ => None,
        })
        .collect()
}

#[test]
fn delta_pulls_ask_from_the_copy_held_and_only_a_used_reply_changes_it() {
    let mut s = WorkerProtocol::new(
        3,
        0xabc,
        RANGES.to_vec(),
        Staleness::Bounded(2),
        PullMode::Delta { have: None },
        HB,
    );
    for k in 0..2 {
        s.hello(k);
        s.connected(k, &welcome(k, 0), 0).unwrap();
    }
    drain(&mut s);
    let cut = |seq| Some(PublicRef { lineage: 7, seq });
    s.start_pull(0);
    let (t, _) = drain(&mut s);
    assert_eq!(
        haves(&t),
        vec![(0, None), (1, None)],
        "a fresh worker holds nothing"
    );
    let r = requests(&t);
    assert!(s.reply(0, answer(r[0].1, 0, 1, 0, 0, cut(4))));
    // A reply to a request that is not the current one is dropped, and does not change what the worker holds.
    assert!(!s.reply(1, answer(r[1].1 + 100, 0, 1, 0, 0, cut(9))));
    assert_eq!(s.public(1), None);
    assert!(s.reply(1, answer(r[1].1, 0, 1, 0, 0, cut(2))));
    assert_eq!((s.public(0), s.public(1)), (cut(4), cut(2)));
    s.push(&mut [vec![1], vec![2]], 0.5).unwrap();
    s.start_pull(1);
    let (t, _) = drain(&mut s);
    assert_eq!(
        haves(&t),
        vec![(0, cut(4)), (1, cut(2))],
        "the next pull asks from the held copies"
    );
    // A copy that failed to apply is forgotten: the next request asks for the whole copy.
    s.forget_public(0);
    s.disconnected(0);
    s.hello(0);
    s.connected(0, &welcome(0, 1), 10).unwrap();
    let (t, _) = drain(&mut s);
    assert_eq!(haves(&t), vec![(0, None)]);
}

#[test]
fn a_new_rollback_epoch_is_an_event_before_the_pull_completes_and_skips_carry_their_loss() {
    let mut s = connected(0);
    s.start_pull(0);
    let (t, _) = drain(&mut s);
    let r = requests(&t);
    assert!(s.reply(0, answer(r[0].1, 0, 1, 0, 0, None)));
    assert!(s.reply(1, answer(r[1].1, 0, 1, 0, 0, None)));
    let (_, e) = drain(&mut s);
    assert_eq!(
        e,
        vec![Event::PullDone { clock: 0 }],
        "epoch 0: nothing rolled back"
    );
    s.skip(f32::NAN).unwrap();
    let (t, _) = drain(&mut s);
    for (_, _, bytes) in pushes(&t) {
        assert!(access_push(&bytes).unwrap().meta().loss.is_nan());
    }
    // Shard 1 rolled back: its epoch-1 reply raises the event ahead of PullDone; shard 0 still at epoch 0 does not.
    s.start_pull(1);
    let (t, _) = drain(&mut s);
    let r = requests(&t);
    assert!(s.reply(0, answer(r[0].1, 1, 2, 1, 0, None)));
    assert!(s.reply(1, answer(r[1].1, 1, 3, 1, 1, None)));
    let (_, e) = drain(&mut s);
    assert_eq!(
        e,
        vec![
            Event::RolledBack { shard: 1, epoch: 1 },
            Event::PullDone { clock: 1 }
        ]
    );
    // A stale reply of another epoch is dropped before it can raise anything.
    assert!(!s.reply(0, answer(r[0].1, 1, 2, 1, 5, None)));
    // The same epoch again is nothing new.
    s.skip(1.0).unwrap();
    s.start_pull(2);
    let (t, _) = drain(&mut s);
    let r = requests(&t);
    assert!(s.reply(0, answer(r[0].1, 2, 2, 2, 0, None)));
    assert!(s.reply(1, answer(r[1].1, 2, 3, 2, 1, None)));
    let (_, e) = drain(&mut s);
    assert_eq!(e, vec![Event::PullDone { clock: 2 }]);
    assert_eq!(s.stats().rollbacks_seen, 1);
}

#[test]
fn a_shard_with_another_staleness_bound_is_refused_and_changes_nothing() {
    let mut s = protocol();
    s.hello(0);
    let mut asynchronous = welcome(0, 0);
    asynchronous.staleness = None;
    let err = s.connected(0, &asynchronous, 0).unwrap_err();
    assert_eq!(
        err,
        ProtocolError::StalenessMismatch {
            shard: 0,
            shard_bound: None,
            ours: Some(2),
        }
    );
    assert_eq!(err.code(), ErrorCode::ConfigMismatch);
    let text = err.to_string();
    assert!(
        text.contains("inf") && text.contains('2'),
        "the error names both bounds: {text}"
    );
    let mut looser = welcome(0, 0);
    looser.staleness = Some(3);
    assert!(matches!(
        s.connected(0, &looser, 0),
        Err(ProtocolError::StalenessMismatch {
            shard_bound: Some(3),
            ours: Some(2),
            ..
        })
    ));
    // Refused welcomes leave the link down: nothing is sent, a pull asks nobody.
    assert!(!s.connected_to_all());
    s.start_pull(0);
    let (t, _) = drain(&mut s);
    assert!(t.is_empty(), "sent {t:?} to a refused shard");
    // The matching bound is accepted.
    s.connected(0, &welcome(0, 0), 0).unwrap();
}

#[test]
fn a_shard_streaming_another_number_of_fragments_is_refused_until_they_match() {
    let mut s = protocol().with_fragments(4);
    s.hello(0);
    // A shard that takes whole-range pushes would refuse every quarter this worker sends: refused at the welcome.
    let err = s.connected(0, &welcome(0, 0), 0).unwrap_err();
    assert_eq!(
        err,
        ProtocolError::FragmentsMismatch {
            shard: 0,
            shard_fragments: 1,
            ours: 4,
        }
    );
    assert_eq!(err.code(), ErrorCode::ConfigMismatch);
    assert!(err.to_string().contains("train.fragments"), "{err}");
    assert!(!s.connected_to_all());
    s.start_pull(0);
    let (t, _) = drain(&mut s);
    assert!(t.is_empty(), "sent {t:?} to a refused shard");
    let mut same = welcome(0, 0);
    same.fragments = 4;
    s.connected(0, &same, 0).unwrap();
}

/// A full reply body from shard `shard` to `request` at clock 0, with `values` in `precision`, from a node of an
/// unreplicated shard (term 0).
fn full_reply(
    shard: usize,
    request: u64,
    values: &[f32],
    precision: Precision,
) -> rkyv::util::AlignedVec {
    full_reply_in(shard, request, values, precision, 0)
}

/// [`full_reply`] from a node serving in fence term `term`.
fn full_reply_in(
    shard: usize,
    request: u64,
    values: &[f32],
    precision: Precision,
    term: u64,
) -> rkyv::util::AlignedVec {
    let mut bytes = Vec::new();
    encode_values(values, precision, &mut bytes);
    encode_params(&ParamReply {
        header: ReplyHeader {
            shard: shard as u32,
            request,
            clock: 0,
            version: 1,
            min_clock: 0,
            epoch: 0,
            range_start: RANGES[shard].0,
            range_end: RANGES[shard].1,
            term,
        },
        precision,
        values: bytes,
    })
    .unwrap()
}

#[test]
fn reply_bodies_are_read_into_the_model_and_a_bad_one_changes_nothing() {
    let mut s = connected(0);
    s.start_pull(0);
    let (t, _) = drain(&mut s);
    let r = requests(&t);
    let v0: Vec<f32> = (0..10).map(|i| i as f32 * 0.5 - 2.0).collect();
    let v1: Vec<f32> = (0..10).map(|i| 1.0 + i as f32 / 3.0).collect();
    let mut params = vec![9.0f32; 20];
    // Not waiting for a pull: a valid reply is counted and dropped, the model untouched.
    let stray = full_reply(0, r[0].1, &v0, Precision::F32);
    assert_eq!(
        s.handle_reply(0, FrameKind::Params, &stray, None),
        Ok(false)
    );
    assert_eq!(s.stats().stale_replies, 1);
    // A body that does not validate (garbage, or another shard's range): an error, the model untouched, the link
    // reset.
    let mut garbage = rkyv::util::AlignedVec::<16>::new();
    garbage.extend_from_slice(&[0xff; 40]);
    assert!(s
        .handle_reply(0, FrameKind::Params, &garbage, Some(&mut params))
        .is_err());
    let other_range = full_reply(1, r[0].1, &v0, Precision::F32);
    assert!(matches!(
        s.handle_reply(0, FrameKind::Params, &other_range, Some(&mut params)),
        Err(ProtocolError::BadRange { .. })
    ));
    assert_eq!(params, vec![9.0f32; 20]);
    let (_, e) = drain(&mut s);
    assert_eq!(e, vec![Event::Reconnect { shard: 0 }]);
    assert_eq!(s.stats().stale_replies, 1, "bad replies are not stale ones");
    // Shard 1 answers in bf16: its range of the model holds the rounded values, shard 0's range is untouched.
    let b1 = full_reply(1, r[1].1, &v1, Precision::Bf16);
    assert_eq!(
        s.handle_reply(1, FrameKind::Params, &b1, Some(&mut params)),
        Ok(true)
    );
    let rounded: Vec<f32> = v1
        .iter()
        .map(|v| half::bf16::from_f32(*v).to_f32())
        .collect();
    assert_eq!(&params[10..], &rounded[..]);
    assert_eq!(&params[..10], &[9.0f32; 10]);
    // After the reconnect shard 0 is asked again; its f32 reply is read exactly and completes the pull.
    s.hello(0);
    s.connected(0, &welcome(0, 0), 1).unwrap();
    let (t, _) = drain(&mut s);
    let again = requests(&t);
    assert_eq!(again.len(), 1);
    let b0 = full_reply(0, again[0].1, &v0, Precision::F32);
    assert_eq!(
        s.handle_reply(0, FrameKind::Params, &b0, Some(&mut params)),
        Ok(true)
    );
    assert_eq!(&params[..10], &v0[..]);
    let (_, e) = drain(&mut s);
    assert_eq!(e, vec![Event::PullDone { clock: 0 }]);
}

/// The (clock, skip) of every push frame `t` sends to `shard`.
fn rounds_to(t: &[Transmit], shard: usize) -> Vec<(u64, bool)> {
    pushes(t)
        .into_iter()
        .filter(|(k, _, _)| *k == shard)
        .map(|(_, c, b)| (c, access_push(&b).unwrap().meta().skip))
        .collect()
}

#[test]
fn a_welcome_below_the_hello_fills_the_gap_with_skip_markers_then_resends() {
    // A shard resumed from an older checkpoint bounds our claim: it welcomes us at 2 while we say hello at 5 (our
    // pending round). Rounds 2..5 are finished there with skip markers, then round 5 is resent at its clock.
    let mut s = connected(0);
    for _ in 0..5 {
        s.skip(0.25).unwrap();
        drain(&mut s);
        for k in 0..2 {
            s.outcome(k, s.clock() - 1, Outcome::Applied, 0).unwrap();
        }
    }
    let mut frames = vec![vec![1u8], vec![2u8]];
    s.push(&mut frames, 0.5).unwrap();
    drain(&mut s);
    s.disconnected(0);
    drain(&mut s);
    assert_eq!(s.hello(0).clock, 5);
    s.connected(0, &welcome(0, 2), 10).unwrap();
    let (t, _) = drain(&mut s);
    assert_eq!(
        rounds_to(&t, 0),
        vec![(2, true), (3, true), (4, true), (5, false)]
    );
    assert_eq!(s.stats().gap_skips, 3);
    // The gap skips report the latest loss, not a made-up one.
    let gap = pushes(&t);
    assert_eq!(access_push(&gap[0].2).unwrap().meta().loss, 0.5);
    // No pull goes out before the shard can take it (clock 6 > oldest pending 2 + s + 1).
    s.start_pull(11);
    let (t, _) = drain(&mut s);
    assert!(requests(&t).iter().all(|(k, _, _)| *k != 0));
    for c in 2..=5 {
        s.outcome(0, c, Outcome::Applied, 0).unwrap();
    }
    let (t, _) = drain(&mut s);
    assert_eq!(
        requests(&t).iter().filter(|(k, _, _)| *k == 0).count(),
        1,
        "asked once the gap settled"
    );
    s.outcome(1, 5, Outcome::Applied, 0).unwrap();
    assert!(s.settled());
    // A shard that claims an absurd gap is refused instead of costing a skip marker per round.
    let mut far = connected(0);
    let mut w = welcome(0, 0);
    for _ in 0..(MAX_GAP_ROUNDS + 1) {
        far.skip(0.0).unwrap();
    }
    drain(&mut far);
    far.outcome(0, 0, Outcome::Applied, 0).unwrap();
    for c in 0..=MAX_GAP_ROUNDS {
        far.outcome(0, c, Outcome::Applied, 0).unwrap();
    }
    far.disconnected(0);
    drain(&mut far);
    assert_eq!(far.hello(0).clock, MAX_GAP_ROUNDS + 1);
    w.clock = 0;
    assert!(matches!(
        far.connected(0, &w, 0),
        Err(ProtocolError::UnexpectedMessage(_))
    ));
    assert_eq!(far.stats().gap_skips, 0);
}

#[test]
fn a_round_refused_as_too_far_ahead_stays_pending_and_is_resent_at_the_next_tick() {
    let mut s = connected(0);
    let mut frames = vec![vec![1u8], vec![2u8]];
    s.push(&mut frames, 0.5).unwrap();
    let (t, _) = drain(&mut s);
    let sent = pushes(&t);
    s.outcome(0, 0, Outcome::Refused(ErrorCode::ClockFromFuture), 0)
        .unwrap();
    let (_, e) = drain(&mut s);
    assert!(e.is_empty(), "not settled: {e:?}");
    assert!(!s.settled());
    assert_eq!(s.stats().held_back, 1);
    assert_eq!(s.stats().pushes_refused, 0);
    s.handle_timeout(HB);
    let (t, _) = drain(&mut s);
    let again = pushes(&t);
    assert_eq!(again.len(), 1);
    assert_eq!((again[0].0, again[0].1), (0, 0));
    assert_eq!(again[0].2, sent[0].2, "byte for byte");
    s.outcome(0, 0, Outcome::Applied, 0).unwrap();
    s.outcome(1, 0, Outcome::Applied, 0).unwrap();
    assert!(s.settled());
}

// Hostile shard replies (the findings of fuzz/fuzz_targets/reply_decoder.rs): each is refused with a typed error
// before anything is written, the copy held is forgotten and the link reset.

/// A worker in delta mode, connected to both shards at clock 0 and waiting for the pull of clock 0; the request ids.
fn delta_pulling() -> (WorkerProtocol, Vec<(usize, u64, u64)>) {
    let mut s = WorkerProtocol::new(
        3,
        0xabc,
        RANGES.to_vec(),
        Staleness::Bounded(2),
        PullMode::Delta { have: None },
        HB,
    );
    for k in 0..2 {
        s.hello(k);
        s.connected(k, &welcome(k, 0), 0).unwrap();
    }
    drain(&mut s);
    s.start_pull(0);
    let (t, _) = drain(&mut s);
    (s, requests(&t))
}

/// A delta reply body from shard 0 to `request` at clock 0 (lineage 7): `kind` from cut `base` to `seq`, with
/// `frames` as its payload, in chunks of the whole range.
fn delta_reply(
    request: u64,
    kind: DeltaKind,
    base: u64,
    seq: u64,
    frames: &[Vec<u8>],
) -> rkyv::util::AlignedVec {
    let delta = DeltaHeader {
        header: ReplyHeader {
            shard: 0,
            request,
            clock: 0,
            version: 1,
            min_clock: 0,
            epoch: 0,
            range_start: RANGES[0].0,
            range_end: RANGES[0].1,
            term: 0,
        },
        lineage: 7,
        base,
        seq,
        kind,
        chunk: 10,
        frames: frames.iter().map(|f| f.len() as u32).collect(),
    };
    let mut body = rkyv::util::AlignedVec::new();
    body.extend_from_slice(&encode_delta_preamble(&delta).unwrap());
    for f in frames {
        body.extend_from_slice(f);
    }
    body
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    let mut bytes = Vec::new();
    encode_values(values, Precision::F32, &mut bytes);
    bytes
}

#[test]
fn a_full_reply_with_a_non_finite_value_is_refused_in_either_precision() {
    for precision in [Precision::F32, Precision::Bf16] {
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut s = connected(0);
            s.start_pull(0);
            let (t, _) = drain(&mut s);
            let r = requests(&t);
            let mut values = vec![1.5f32; 10];
            values[7] = bad;
            let mut params = vec![9.0f32; 20];
            let body = full_reply(0, r[0].1, &values, precision);
            let e = s
                .handle_reply(0, FrameKind::Params, &body, Some(&mut params))
                .unwrap_err();
            assert_eq!(
                e.code(),
                ErrorCode::NonFinite,
                "{bad} in {precision:?}: {e}"
            );
            assert_eq!(params, vec![9.0f32; 20], "{bad} in {precision:?}");
            let (_, e) = drain(&mut s);
            assert_eq!(e, vec![Event::Reconnect { shard: 0 }]);
            assert!(s.pulling());
        }
    }
}

#[test]
fn a_reply_naming_another_shard_is_refused() {
    let mut s = connected(0);
    s.start_pull(0);
    let (t, _) = drain(&mut s);
    let r = requests(&t);
    let mut body = full_reply(0, r[0].1, &[1.0; 10], Precision::F32);
    // Shard 1's number on shard 0's range and request: well formed, but not from the shard on this link.
    let mut reply = tether_common::protocol::decode_params(&body).unwrap();
    reply.header.shard = 1;
    body = encode_params(&reply).unwrap();
    let mut params = vec![9.0f32; 20];
    assert_eq!(
        s.handle_reply(0, FrameKind::Params, &body, Some(&mut params)),
        Err(ProtocolError::WrongShard {
            expected: 0,
            got: 1
        })
    );
    assert_eq!(params, vec![9.0f32; 20]);
}

#[test]
fn a_whole_public_copy_with_a_nan_is_refused_and_nothing_is_held() {
    let (mut s, r) = delta_pulling();
    let mut values = vec![0.5f32; 10];
    values[3] = f32::NAN;
    let body = delta_reply(r[0].1, DeltaKind::Full, 4, 4, &[f32_bytes(&values)]);
    let mut params = vec![9.0f32; 20];
    let e = s
        .handle_reply(0, FrameKind::Delta, &body, Some(&mut params))
        .unwrap_err();
    assert_eq!(e.code(), ErrorCode::NonFinite, "{e}");
    assert_eq!(params, vec![9.0f32; 20]);
    assert_eq!(s.public(0), None);
    assert!(s.public_values().iter().all(|v| *v == 0.0));
}

#[test]
fn deltas_that_overflow_the_copy_held_are_refused_and_the_copy_is_kept() {
    let (mut s, r) = delta_pulling();
    let mut params = vec![9.0f32; 20];
    // The worker holds cut 4 of shard 0: finite, near the top of f32.
    let held = vec![3.0e38f32; 10];
    let body = delta_reply(r[0].1, DeltaKind::Full, 4, 4, &[f32_bytes(&held)]);
    assert_eq!(
        s.handle_reply(0, FrameKind::Delta, &body, Some(&mut params)),
        Ok(true)
    );
    assert_eq!(s.public(0), Some(PublicRef { lineage: 7, seq: 4 }));
    // A new pull asks from cut 4; the shard answers with finite deltas whose sum with the copy overflows.
    s.start_pull(0);
    let (t, _) = drain(&mut s);
    assert_eq!(haves(&t)[0], (0, Some(PublicRef { lineage: 7, seq: 4 })));
    let r = requests(&t);
    let mut enc = Encoder::new(CodecConfig {
        scheme: Scheme::None,
        bucket: 16,
        rounding: Rounding::Deterministic,
        zstd: false,
        keep: tether_common::codec::DEFAULT_KEEP,
    })
    .unwrap();
    let mut frame = Vec::new();
    enc.encode(&[1.0e38; 10], 0, &mut frame).unwrap();
    let body = delta_reply(r[0].1, DeltaKind::Deltas, 4, 5, &[frame]);
    let before = params.clone();
    let e = s
        .handle_reply(0, FrameKind::Delta, &body, Some(&mut params))
        .unwrap_err();
    assert_eq!(e.code(), ErrorCode::NonFinite, "{e}");
    assert_eq!(params, before, "the model keeps the last good copy");
    assert_eq!(
        &s.public_values()[..10],
        &held[..],
        "the copy is not touched"
    );
    assert_eq!(
        s.public(0),
        None,
        "but no longer trusted: the next pull asks for all of it"
    );
}

#[test]
fn a_welcomes_initial_cut_is_computed_here_and_claimed_only_when_its_crc_matches() {
    use std::sync::Arc;
    use tether_common::layout::{Init, Layout, TensorSpec};
    use tether_common::protocol::InitialCut;
    let layout = Arc::new(Layout::new(vec![TensorSpec::new(
        "w",
        &[20],
        Init::Uniform { bound: 0.5 },
    )]));
    let mut init = vec![0.0f32; 20];
    layout.init_range(3, 0..20, &mut init);
    let offer = |shard: usize, crc32: u32| Welcome {
        initial: Some(InitialCut {
            lineage: 7,
            seed: 3,
            crc32,
        }),
        ..welcome(shard, 0)
    };
    let good = InitialCut::checksum(&init[0..10]);
    // Shard 1's CRC is not that of the values computed here (another libm, say): that copy is pulled whole.
    let bad = InitialCut::checksum(&init[10..20]) ^ 1;
    let mut s = WorkerProtocol::new(
        3,
        0xabc,
        RANGES.to_vec(),
        Staleness::Bounded(2),
        PullMode::Delta { have: None },
        HB,
    )
    .with_initial(layout.clone());
    s.hello(0);
    s.connected(0, &offer(0, good), 0).unwrap();
    s.hello(1);
    s.connected(1, &offer(1, bad), 0).unwrap();
    drain(&mut s);
    s.start_pull(0);
    let (t, _) = drain(&mut s);
    let cut0 = Some(PublicRef { lineage: 7, seq: 0 });
    assert_eq!(haves(&t), vec![(0, cut0), (1, None)]);
    // "Not modified" from cut 0: the parameters are the initial weights, and nothing crossed the link for them.
    let r = requests(&t);
    let body = delta_reply(r[0].1, DeltaKind::NotModified, 0, 0, &[]);
    let mut params = vec![9.0f32; 20];
    assert_eq!(
        s.handle_reply(0, FrameKind::Delta, &body, Some(&mut params)),
        Ok(true)
    );
    assert_eq!(params[..10], init[..10]);
    assert_eq!(s.public(0), cut0);
    assert_eq!(s.stats().initial_cuts, 1);
    // A link that already holds a copy keeps it; a worker pulling whole values, or without the layout, claims nothing.
    s.disconnected(0);
    s.hello(0);
    s.connected(
        0,
        &Welcome {
            initial: Some(InitialCut {
                lineage: 8,
                seed: 3,
                crc32: good,
            }),
            ..welcome(0, 1)
        },
        5,
    )
    .unwrap();
    assert_eq!(s.public(0), cut0);
    for mut other in [
        WorkerProtocol::new(
            3,
            0xabc,
            RANGES.to_vec(),
            Staleness::Bounded(2),
            PullMode::Full(Precision::F32),
            HB,
        )
        .with_initial(layout.clone()),
        WorkerProtocol::new(
            3,
            0xabc,
            RANGES.to_vec(),
            Staleness::Bounded(2),
            PullMode::Delta { have: None },
            HB,
        ),
    ] {
        other.hello(0);
        other.connected(0, &offer(0, good), 0).unwrap();
        assert_eq!(other.public(0), None);
    }
}

/// A welcome from a node of a replicated shard serving in fence term `term`.
fn welcome_in(shard: usize, clock: u64, term: u64) -> Welcome {
    Welcome {
        term,
        ..welcome(shard, clock)
    }
}

#[test]
fn a_node_welcoming_in_a_term_older_than_one_seen_is_refused() {
    let mut s = protocol();
    s.hello(0);
    s.connected(0, &welcome_in(0, 0, 4), 0).unwrap();
    s.disconnected(0);
    drain(&mut s);
    s.hello(0);
    // The old primary (term 2) still answers a dial: it was deposed, so it is refused and nothing changes.
    assert_eq!(
        s.connected(0, &welcome_in(0, 0, 2), 0),
        Err(ProtocolError::StaleTerm {
            shard: 0,
            got: 2,
            expected: 4
        })
    );
    // The same term again (a reconnect to the node that serves) and a newer one are taken.
    s.connected(0, &welcome_in(0, 0, 4), 0).unwrap();
    s.disconnected(0);
    drain(&mut s);
    s.hello(0);
    s.connected(0, &welcome_in(0, 0, 5), 0).unwrap();
}

#[test]
fn a_reply_in_another_term_than_the_welcome_is_never_read() {
    let v: Vec<f32> = (0..10).map(|i| i as f32).collect();
    // A deposed node's reply (term 2) and a reply claiming a term the link was not welcomed in (4) are refused
    // before any value is read, and the link is reset; the reply in the link's term (3) is read.
    for (term, used) in [(2, false), (4, false), (3, true)] {
        let mut s = protocol();
        for k in 0..2 {
            s.hello(k);
            s.connected(k, &welcome_in(k, 0, 3), 0).unwrap();
        }
        drain(&mut s);
        s.start_pull(0);
        let (t, _) = drain(&mut s);
        let r = requests(&t);
        let mut params = vec![9.0f32; 20];
        let got = s.handle_reply(
            0,
            FrameKind::Params,
            &full_reply_in(0, r[0].1, &v, Precision::F32, term),
            Some(&mut params),
        );
        let (_, e) = drain(&mut s);
        if used {
            assert_eq!(got, Ok(true));
            assert_eq!(&params[..10], &v[..]);
            assert!(e.is_empty(), "{e:?}");
        } else {
            assert_eq!(
                got,
                Err(ProtocolError::StaleTerm {
                    shard: 0,
                    got: term,
                    expected: 3
                })
            );
            assert_eq!(params, vec![9.0f32; 20]);
            assert_eq!(e, vec![Event::Reconnect { shard: 0 }]);
        }
    }
}

#[test]
fn an_outcome_in_another_term_settles_nothing_and_the_push_goes_to_whoever_serves() {
    let mut s = protocol();
    for k in 0..2 {
        s.hello(k);
        s.connected(k, &welcome_in(k, 0, 3), 0).unwrap();
    }
    drain(&mut s);
    let mut frames = vec![vec![1u8, 2, 3], vec![4u8, 5]];
    s.push(&mut frames, 0.5).unwrap();
    let (t, _) = drain(&mut s);
    let sent = pushes(&t);
    s.outcome(1, 0, Outcome::Applied, 3).unwrap();
    // Shard 0's outcome comes from a node in term 2: not an acknowledgement.
    assert_eq!(
        s.outcome(0, 0, Outcome::Applied, 2),
        Err(ProtocolError::StaleTerm {
            shard: 0,
            got: 2,
            expected: 3
        })
    );
    assert!(!s.settled());
    let (_, e) = drain(&mut s);
    assert!(e.contains(&Event::Reconnect { shard: 0 }), "{e:?}");
    assert!(
        !e.iter()
            .any(|x| matches!(x, Event::Settled(st) if st.shard == 0)),
        "{e:?}"
    );
    // The node that serves now (term 5) gets the same bytes, and its outcome settles the round.
    assert_eq!(s.hello(0).clock, 0);
    s.connected(0, &welcome_in(0, 0, 5), 1).unwrap();
    let (t, _) = drain(&mut s);
    let resent = pushes(&t);
    assert_eq!(resent.len(), 1);
    assert_eq!(resent[0].2, sent[0].2);
    s.outcome(0, 0, Outcome::Applied, 5).unwrap();
    assert!(s.settled());
}

#[test]
fn a_copy_read_from_a_node_of_one_term_is_not_built_on_after_a_failover() {
    let mut s = WorkerProtocol::new(
        3,
        0xabc,
        RANGES.to_vec(),
        Staleness::Bounded(2),
        PullMode::Delta { have: None },
        HB,
    );
    for k in 0..2 {
        s.hello(k);
        s.connected(k, &welcome_in(k, 0, 2), 0).unwrap();
    }
    drain(&mut s);
    let cut = |seq| Some(PublicRef { lineage: 7, seq });
    s.start_pull(0);
    let (t, _) = drain(&mut s);
    let r = requests(&t);
    assert!(s.reply(0, answer(r[0].1, 0, 1, 0, 0, cut(4))));
    assert!(s.reply(1, answer(r[1].1, 0, 1, 0, 0, cut(2))));
    // A reconnect to the node of the same term keeps the copy.
    s.disconnected(0);
    drain(&mut s);
    s.hello(0);
    s.connected(0, &welcome_in(0, 0, 2), 5).unwrap();
    assert_eq!(s.public(0), cut(4));
    // Shard 0's standby took over (term 3): the copy from the term-2 node is given up, shard 1's is kept.
    s.disconnected(0);
    drain(&mut s);
    s.hello(0);
    s.connected(0, &welcome_in(0, 0, 3), 10).unwrap();
    assert_eq!((s.public(0), s.public(1)), (None, cut(2)));
    assert_eq!(s.stats().bases_dropped, 1);
    drain(&mut s);
    s.push(&mut [vec![1], vec![2]], 0.5).unwrap();
    s.start_pull(1);
    let (t, _) = drain(&mut s);
    assert_eq!(
        haves(&t),
        vec![(0, None), (1, cut(2))],
        "the next pull of shard 0 is whole"
    );
}

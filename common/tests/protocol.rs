//! Protocol round-trips and hostile-byte properties (no sockets).

use proptest::prelude::*;
use rkyv::util::AlignedVec;
use tether_common::protocol::framing::expect_end;
use tether_common::protocol::*;

fn all_controls() -> Vec<Control> {
    vec![
        Control::Hello(Hello {
            rank: 3,
            protocol_version: PROTOCOL_VERSION,
            layout_hash: 0xdead_beef_0123_4567,
            clock: 12,
        }),
        Control::Welcome(Welcome {
            shard: 1,
            range_start: 100,
            range_end: 2_000_000,
            staleness: Some(3),
            fragments: 4,
            min_clock: 17,
            version: 99,
            clock: 18,
            initial: Some(InitialCut {
                lineage: u64::MAX,
                seed: 7,
                crc32: 0xdead_beef,
            }),
            term: 5,
        }),
        Control::Welcome(Welcome {
            shard: 0,
            range_start: 0,
            range_end: 1,
            staleness: None,
            fragments: 1,
            min_clock: 0,
            version: 0,
            clock: 0,
            initial: None,
            term: 0,
        }),
        Control::Heartbeat { clock: u64::MAX },
        Control::PullRequest {
            request: 1,
            clock: 7,
            mode: PullMode::Full(Precision::F32),
        },
        Control::PullRequest {
            request: u64::MAX,
            clock: 8,
            mode: PullMode::Full(Precision::Bf16),
        },
        Control::PullRequest {
            request: 2,
            clock: 9,
            mode: PullMode::Delta { have: None },
        },
        Control::PullRequest {
            request: 3,
            clock: 9,
            mode: PullMode::Delta {
                have: Some(PublicRef {
                    lineage: u64::MAX,
                    seq: 5,
                }),
            },
        },
        Control::PullRefused {
            request: 3,
            code: ErrorCode::Overloaded,
        },
        Control::PushOutcome {
            clock: 4,
            outcome: Outcome::Applied,
            term: 0,
        },
        Control::PushOutcome {
            clock: 5,
            outcome: Outcome::Duplicate,
            term: u64::MAX,
        },
        Control::PushOutcome {
            clock: 6,
            outcome: Outcome::Refused(ErrorCode::NonFinite),
            term: 3,
        },
        Control::Error {
            code: ErrorCode::Replay,
            message: "clock 4 already pushed".into(),
        },
        Control::Goodbye { clock: 9 },
    ]
}

fn push() -> PushFrame {
    PushFrame {
        worker: 2,
        clock: 11,
        shard: 1,
        range_start: 10,
        range_end: 1034,
        read_version: 55,
        loss: 0.75,
        skip: false,
        payload: (0..600u32).map(|i| (i * 7) as u8).collect(),
    }
}

fn reply() -> ParamReply {
    ParamReply {
        header: ReplyHeader {
            shard: 1,
            request: 77,
            clock: 11,
            version: 56,
            min_clock: 9,
            epoch: 2,
            range_start: 10,
            range_end: 14,
            term: 4,
        },
        precision: Precision::F32,
        values: [1.0f32, -2.5, 0.0, 3.25]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
    }
}

#[test]
fn every_control_message_round_trips() {
    for msg in all_controls() {
        let bytes = encode_control(&msg).unwrap();
        assert!(bytes.len() <= MAX_CONTROL_BYTES);
        assert_eq!(decode_control(&bytes).unwrap(), msg);
    }
}

#[test]
fn control_rejects_trailing_bytes_and_unknown_error_codes() {
    let mut bytes = encode_control(&Control::Goodbye { clock: 1 }).unwrap();
    bytes.push(0);
    assert_eq!(
        decode_control(&bytes).unwrap_err().code(),
        ErrorCode::BadFrame
    );
    // An Error message whose code is not assigned does not decode.
    let good = encode_control(&Control::Error {
        code: ErrorCode::BadFrame,
        message: String::new(),
    })
    .unwrap();
    let mut bad = good.clone();
    let code_pos = good.iter().position(|&b| b == 1).unwrap();
    bad[code_pos] = 200;
    assert!(decode_control(&bad).is_err());
}

#[test]
fn long_error_messages_are_cut_to_fit() {
    let msg = Control::Error {
        code: ErrorCode::Internal,
        message: "é".repeat(5000),
    };
    let bytes = encode_control(&msg).unwrap();
    let Control::Error { message, .. } = decode_control(&bytes).unwrap() else {
        panic!("not an Error")
    };
    assert!(message.len() <= tether_common::protocol::control::MAX_ERROR_MESSAGE_BYTES);
    assert!(message.chars().all(|c| c == 'é'));
}

#[test]
fn error_codes_are_stable() {
    let table: Vec<(ErrorCode, u16)> = ErrorCode::ALL.iter().map(|c| (*c, c.code())).collect();
    let expected = [
        (ErrorCode::BadFrame, 1),
        (ErrorCode::Oversized, 2),
        (ErrorCode::Truncated, 3),
        (ErrorCode::ValidationFailed, 4),
        (ErrorCode::BadVersion, 5),
        (ErrorCode::BadLayoutHash, 6),
        (ErrorCode::Unauthorized, 7),
        (ErrorCode::WrongShard, 8),
        (ErrorCode::BadRange, 9),
        (ErrorCode::NonFinite, 10),
        (ErrorCode::ClockFromFuture, 11),
        (ErrorCode::Replay, 12),
        (ErrorCode::Overloaded, 13),
        (ErrorCode::Internal, 14),
        (ErrorCode::Evicted, 15),
        (ErrorCode::Shutdown, 16),
        (ErrorCode::UnexpectedMessage, 17),
        (ErrorCode::RolledBack, 18),
        (ErrorCode::ConfigMismatch, 19),
        (ErrorCode::Superseded, 20),
        (ErrorCode::NotPrimary, 21),
        (ErrorCode::Unseeded, 22),
    ];
    assert_eq!(table, expected);
    for (code, n) in expected {
        assert_eq!(ErrorCode::from_code(n.into()), Some(code));
        assert_eq!(code.close_code().into_inner(), u64::from(n));
    }
    assert_eq!(ErrorCode::from_code(0), None);
    assert_eq!(ErrorCode::from_code(23), None);
}

#[test]
fn bulk_frames_round_trip_owned_and_archived() {
    let p = push();
    let bytes = encode_push(&p).unwrap();
    assert_eq!(decode_push(&bytes).unwrap(), p);
    let archived = access_push(&bytes).unwrap();
    assert_eq!(archived.meta().worker, 2);
    assert_eq!(archived.meta().loss, 0.75);
    assert_eq!(archived.payload(), &p.payload[..]);
    archived.check_target(1, 10, 1034).unwrap();
    assert_eq!(
        archived.check_target(0, 10, 1034).unwrap_err().code(),
        ErrorCode::WrongShard
    );
    assert_eq!(
        archived.check_target(1, 10, 1035).unwrap_err().code(),
        ErrorCode::BadRange
    );

    let r = reply();
    let bytes = encode_params(&r).unwrap();
    assert_eq!(decode_params(&bytes).unwrap(), r);
    let archived = access_params(&bytes).unwrap();
    assert_eq!(archived.precision(), Precision::F32);
    archived.check_shape(10, 14).unwrap();
    let mut short = r.clone();
    short.values.pop();
    let bytes = encode_params(&short).unwrap();
    assert_eq!(
        access_params(&bytes)
            .unwrap()
            .check_shape(10, 14)
            .unwrap_err()
            .code(),
        ErrorCode::ValidationFailed
    );
}

#[test]
fn encode_into_reuses_the_buffer() {
    let mut buf = AlignedVec::new();
    encode_push_into(&push(), &mut buf).unwrap();
    let first = buf.to_vec();
    encode_push_into(&push(), &mut buf).unwrap();
    assert_eq!(buf.as_slice(), &first[..]);
}

#[test]
fn corrupted_bulk_frames_fail_validation() {
    let bytes = encode_push(&push()).unwrap();
    // Point the payload's relative pointer far outside the buffer: the archived Vec's offset sits just
    // before its length in the root, which rkyv places at the end.
    let mut bad = AlignedVec::<16>::new();
    bad.extend_from_slice(&bytes);
    let n = bad.len();
    for b in &mut bad[n - 16..n - 4] {
        *b = 0x7f;
    }
    let err = access_push(&bad).unwrap_err();
    assert_eq!(err.code(), ErrorCode::ValidationFailed);
    // Too short to hold the root.
    assert_eq!(
        access_push(&bytes[..8]).unwrap_err().code(),
        ErrorCode::ValidationFailed
    );
    // Misaligned input is refused, not read.
    let mut shifted = AlignedVec::<16>::new();
    shifted.push(0);
    shifted.extend_from_slice(&bytes);
    assert!(access_push(&shifted[1..]).is_err());
}

#[test]
fn limits_follow_the_shard_and_codec() {
    let l = FrameLimits::for_shard(1000, 700);
    assert_eq!(l.control, MAX_CONTROL_BYTES);
    assert!(l.push >= 700 && l.push < 700 + 1024);
    assert!(l.params >= 4000 && l.params < 4000 + 1024);
    // Real frames of the maximal size fit their limits.
    let mut p = push();
    p.payload = vec![1; 700];
    assert!(encode_push(&p).unwrap().len() <= l.push);
    let mut r = reply();
    r.values = vec![0; 4000];
    assert!(encode_params(&r).unwrap().len() <= l.params);
    // Huge ranges saturate at the u32 length field.
    let huge = FrameLimits::for_shard(u64::MAX, usize::MAX);
    assert_eq!(huge.push as u64, u32::MAX as u64);
    assert_eq!(huge.params as u64, u32::MAX as u64);
}

fn limits() -> FrameLimits {
    FrameLimits {
        control: 64,
        push: 1024,
        params: 512,
    }
}

#[test]
fn framing_checks_kind_length_and_truncation() {
    let all = [FrameKind::Control, FrameKind::Push, FrameKind::Params];
    let frame = encode_frame(FrameKind::Push, &[9; 100]).unwrap();
    let (kind, body, rest) = split_frame(&frame, &limits(), &all).unwrap();
    assert_eq!((kind, body.len(), rest.len()), (FrameKind::Push, 100, 0));

    let e = split_frame(&frame[..50], &limits(), &all).unwrap_err();
    assert_eq!(
        e,
        ProtocolError::Truncated {
            expected: 100,
            got: 45
        }
    );
    assert_eq!(
        split_frame(&frame[..3], &limits(), &all)
            .unwrap_err()
            .code(),
        ErrorCode::Truncated
    );

    let big = encode_frame(FrameKind::Control, &[0; 65]).unwrap();
    assert_eq!(
        split_frame(&big, &limits(), &all).unwrap_err().code(),
        ErrorCode::Oversized
    );

    let mut unknown = frame.clone();
    unknown[4] = 9;
    assert_eq!(
        split_frame(&unknown, &limits(), &all).unwrap_err().code(),
        ErrorCode::BadFrame
    );
    assert_eq!(
        split_frame(&frame, &limits(), &[FrameKind::Control])
            .unwrap_err()
            .code(),
        ErrorCode::UnexpectedMessage
    );
}

#[tokio::test]
async fn async_reader_checks_before_allocating() {
    let all = [FrameKind::Control, FrameKind::Push, FrameKind::Params];
    let mut body = AlignedVec::new();
    // A header claiming 4 GiB - 1 is refused without reserving anything.
    let mut claim = FrameHeader::encode(FrameKind::Push, u32::MAX as usize)
        .unwrap()
        .to_vec();
    claim.extend_from_slice(&[0; 10]);
    let err = read_frame(&mut &claim[..], &limits(), &all, &mut body)
        .await
        .unwrap_err();
    assert!(matches!(
        err,
        ReadFrameError::Protocol(ProtocolError::Oversized { .. })
    ));
    assert!(body.capacity() < 1024);

    let frame = encode_frame(FrameKind::Params, &[5; 200]).unwrap();
    let mut reader = &frame[..];
    assert_eq!(
        read_frame(&mut reader, &limits(), &all, &mut body)
            .await
            .unwrap(),
        Some(FrameKind::Params)
    );
    assert_eq!(body.as_slice(), &[5; 200][..]);
    expect_end(&mut reader).await.unwrap();
    assert_eq!(
        read_frame(&mut reader, &limits(), &all, &mut body)
            .await
            .unwrap(),
        None
    );

    let err = read_frame(&mut &frame[..150], &limits(), &all, &mut body)
        .await
        .unwrap_err();
    assert!(matches!(
        err,
        ReadFrameError::Protocol(ProtocolError::Truncated {
            expected: 200,
            got: 145
        })
    ));
    let mut two = frame.clone();
    two.push(1);
    let mut reader = &two[..];
    read_frame(&mut reader, &limits(), &all, &mut body)
        .await
        .unwrap();
    assert!(expect_end(&mut reader).await.is_err());
}

#[tokio::test]
async fn frame_buffers_hold_what_frames_need_and_give_back_a_large_one() {
    let all = [FrameKind::Params];
    let big = FRAME_KEEP * 3 + 1000;
    let limits = FrameLimits {
        control: 64,
        push: 64,
        params: big,
    };
    let mut body = AlignedVec::new();
    let frame = encode_frame(FrameKind::Params, &vec![7; big]).unwrap();
    read_frame(&mut &frame[..], &limits, &all, &mut body)
        .await
        .unwrap();
    // Exactly what the frame needs (a growing buffer would have rounded 3 MiB up to 4).
    assert!(
        body.capacity() < big + 4096,
        "{} for {big}",
        body.capacity()
    );
    // A small frame after it: the large buffer is given back.
    let small = encode_frame(FrameKind::Params, &[3; 100]).unwrap();
    read_frame(&mut &small[..], &limits, &all, &mut body)
        .await
        .unwrap();
    assert_eq!(body.as_slice(), &[3; 100][..]);
    assert!(body.capacity() <= FRAME_KEEP, "{}", body.capacity());
}

fn block_on_ready<F: std::future::Future>(fut: F) -> F::Output {
    // Readers over slices never return Pending, so one poll completes the future.
    let mut fut = std::pin::pin!(fut);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match fut.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(v) => v,
        std::task::Poll::Pending => panic!("slice reader returned Pending"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn control_decoder_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        if let Err(e) = decode_control(&bytes) {
            prop_assert!(ErrorCode::ALL.contains(&e.code()));
        }
    }

    #[test]
    fn bulk_decoders_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let mut aligned = AlignedVec::<16>::new();
        aligned.extend_from_slice(&bytes);
        if let Err(e) = access_push(&aligned) { prop_assert_eq!(e.code(), ErrorCode::ValidationFailed); }
        if let Err(e) = access_params(&aligned) { prop_assert_eq!(e.code(), ErrorCode::ValidationFailed); }
        let _ = decode_push(&bytes);
        let _ = decode_params(&bytes);
    }

    #[test]
    fn mutated_bulk_frames_never_panic(flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8)) {
        let mut bytes = encode_push(&push()).unwrap();
        for (i, v) in flips {
            let i = i.index(bytes.len());
            bytes[i] ^= v;
        }
        if let Ok(view) = access_push(&bytes) {
            // A frame that still validates must be fully readable.
            let _ = view.meta();
            prop_assert!(view.payload().len() <= bytes.len());
        }
    }

    #[test]
    fn framing_readers_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        let all = [FrameKind::Control, FrameKind::Push, FrameKind::Params];
        let sync = split_frame(&bytes, &limits(), &all).map(|(k, b, _)| (k, b.to_vec()));
        let mut body = AlignedVec::new();
        let asynch = block_on_ready(read_frame(&mut &bytes[..], &limits(), &all, &mut body));
        match (sync, asynch) {
            (Ok((k, b)), Ok(Some(k2))) => { prop_assert_eq!(k, k2); prop_assert_eq!(&b[..], body.as_slice()); }
            (Err(e), Err(ReadFrameError::Protocol(e2))) => prop_assert_eq!(e.code(), e2.code()),
            (Err(ProtocolError::Truncated { .. }), Ok(None)) => prop_assert!(bytes.is_empty()),
            (s, a) => prop_assert!(false, "readers disagree: {:?} vs {:?}", s, a),
        }
        prop_assert!(body.len() <= limits().push.max(limits().params));
    }
}

//! Feeds arbitrary bytes to every wire decoder: the framing reader (slice and async), bincode control
//! messages, validated rkyv bulk frames and delta replies (header, frame list, and the codec frames they carry), and
//! replication log entries.
//! Any panic is a finding; errors must carry a wire code.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rkyv::util::AlignedVec;
use tether_common::protocol::*;

const ALL: [FrameKind; 6] = [
    FrameKind::Control,
    FrameKind::Push,
    FrameKind::Params,
    FrameKind::Delta,
    FrameKind::Replica,
    FrameKind::ReplicaImage,
];

fn decode_body(kind: FrameKind, body: &[u8]) {
    match kind {
        FrameKind::Control => {
            if let Ok(msg) = decode_control(body) {
                // What decodes must survive its own round trip.
                let again = encode_control(&msg).expect("re-encode");
                assert_eq!(decode_control(&again).expect("decode re-encoded"), msg);
            }
        }
        FrameKind::Push => {
            let mut aligned = AlignedVec::<16>::with_capacity(body.len());
            aligned.extend_from_slice(body);
            if let Ok(view) = access_push(&aligned) {
                let _ = view.meta();
                assert!(view.payload().len() <= body.len());
                let _ = view.check_target(0, 0, 1000);
                decode_push(body).expect("validated push must deserialize");
            }
        }
        FrameKind::Params => {
            let mut aligned = AlignedVec::<16>::with_capacity(body.len());
            aligned.extend_from_slice(body);
            if let Ok(view) = access_params(&aligned) {
                let _ = view.precision();
                let _ = view.check_shape(0, 1000);
                decode_params(body).expect("validated reply must deserialize");
            }
        }
        FrameKind::Replica => {
            use tether_server::replication::{decode, encode, EntryRef};
            if let Ok(entry) = decode(body) {
                // What decodes must survive its own round trip.
                let mut again = Vec::new();
                encode(&EntryRef { seq: entry.seq, input: &entry.input }, &mut again).expect("re-encode");
                assert_eq!(decode(&again).expect("decode re-encoded"), entry);
            }
        }
        FrameKind::ReplicaImage => {
            let spec = tether_server::shard::ShardSpec {
                shard: 0,
                shards: 1,
                seed: 1,
                optimizer: tether_common::testing::sgd(0.1),
                staleness: tether_common::config::Staleness::Bounded(1),
                worker_timeout_ms: 1_000,
                spike_factor: 0.0,
            };
            let mut proto = tether_server::protocol::ShardProtocol::new(tether_server::shard::ShardCore::new(
                &tether_common::testing::flat_layout(16),
                &spec,
            ));
            let _ = tether_server::replication::image::restore(body, &mut proto);
        }
        FrameKind::Delta => {
            let mut aligned = AlignedVec::<16>::with_capacity(body.len());
            aligned.extend_from_slice(body);
            if let Ok(view) = access_delta(&aligned, 0, 1000) {
                let total: usize = view.frames().map(<[u8]>::len).sum();
                assert_eq!(total, view.payload.len());
                if view.kind() == DeltaKind::Deltas {
                    let chunk = (view.header.chunk.to_native() as usize).min(1000);
                    let mut dec = tether_common::codec::Decoder::new(chunk);
                    let mut out = vec![0.0f32; chunk];
                    for (i, f) in view.frames().enumerate() {
                        let per_cut = 1000usize.div_ceil(chunk);
                        let at = (i % per_cut) * chunk;
                        let _ = dec.decode(f, &mut out[..(at + chunk).min(1000) - at]);
                    }
                }
            }
        }
    }
}

fn poll_once<F: std::future::Future>(fut: F) -> F::Output {
    // Slice readers never return Pending, so one poll completes the future.
    let mut fut = std::pin::pin!(fut);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match fut.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(v) => v,
        std::task::Poll::Pending => panic!("slice reader returned Pending"),
    }
}

fuzz_target!(|data: &[u8]| {
    let limits = FrameLimits {
        control: MAX_CONTROL_BYTES,
        push: 1 << 16,
        params: 1 << 16,
    };

    // A stream of frames, as the slice splitter and the async reader see it.
    let mut rest = data;
    let mut reader = data;
    let mut body = AlignedVec::new();
    for _ in 0..64 {
        let split = split_frame(rest, &limits, &ALL);
        let read = poll_once(read_frame(&mut reader, &limits, &ALL, &mut body));
        match (split, read) {
            (Ok((kind, frame, next)), Ok(Some(kind2))) => {
                assert_eq!(kind, kind2);
                assert_eq!(frame, body.as_slice());
                assert!(frame.len() <= limits.limit(kind));
                decode_body(kind, frame);
                rest = next;
            }
            (Err(e), Err(ReadFrameError::Protocol(e2))) => {
                assert_eq!(e.code(), e2.code());
                break;
            }
            (Err(ProtocolError::Truncated { got: 0, .. }), Ok(None)) => break,
            (a, b) => panic!("framing readers disagree: {a:?} / {b:?}"),
        }
    }

    // The whole input as each body kind.
    for kind in ALL {
        decode_body(kind, data);
    }
});

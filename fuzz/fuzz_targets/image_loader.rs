//! Feeds arbitrary bytes to a standby's image loader (a primary's state image, see the server's `image` module),
//! then drives what it adopted through the protocol (hellos, pushes, pulls, ticks, a goodbye, a new image of it).
//! Any panic is a finding; a refused image must leave the standby's state unchanged.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tether_common::codec::{CodecConfig, Encoder, Scheme};
use tether_common::config::Staleness;
use tether_common::protocol::{encode_push, Precision, PullMode, PushFrame};
use tether_common::testing::{flat_layout, sgd};
use tether_server::replication::image;
use tether_server::protocol::ShardProtocol;
use tether_server::shard::{ShardCore, ShardSpec};

const N: usize = 16;

fn shard() -> ShardProtocol {
    let spec = ShardSpec {
        shard: 0,
        shards: 1,
        seed: 1,
        optimizer: sgd(0.1),
        staleness: Staleness::Bounded(1),
        worker_timeout_ms: 1_000,
        spike_factor: 0.0,
    };
    let mut core = ShardCore::new(&flat_layout(N), &spec);
    core.set_public(
        CodecConfig {
            scheme: Scheme::None,
            zstd: false,
            ..CodecConfig::default()
        },
        1,
    );
    ShardProtocol::new(core)
}

fuzz_target!(|data: &[u8]| {
    let mut proto = shard();
    let before = image::encode(&proto, 0).expect("a fresh shard encodes");
    let Ok(now) = image::restore(data, &mut proto) else {
        assert!(image::encode(&proto, 0).expect("encodes") == before, "a refused image changed the state");
        return;
    };
    let now = now.min(u64::MAX / 4);
    let g = vec![0.25f32; N];
    let mut payload = Vec::new();
    let raw = CodecConfig {
        scheme: Scheme::None,
        zstd: false,
        ..CodecConfig::default()
    };
    Encoder::new(raw).expect("raw codec").encode(&g, 0, &mut payload).expect("encode");
    let conn = proto.max_conn().saturating_add(1);
    for w in 0..3u32 {
        let Ok(welcome) = proto.hello(conn + u64::from(w), w, 0, now) else {
            continue;
        };
        let body = encode_push(&PushFrame {
            worker: w,
            clock: welcome.clock,
            shard: 0,
            range_start: 0,
            range_end: N as u64,
            read_version: welcome.version,
            loss: 1.0,
            skip: false,
            payload: payload.clone(),
        })
        .expect("encode push");
        let _ = proto.push_frame(conn + u64::from(w), &body, now + 1);
        for mode in [PullMode::Full(Precision::F32), PullMode::Delta { have: None }] {
            let _ = proto.pull(conn + u64::from(w), w, 1, welcome.clock, mode, now + 2);
        }
        while proto.poll_action().is_some() {}
    }
    let _ = proto.tick(now + 5_000);
    proto.goodbye(conn, 0, 1, now + 5_001);
    let _ = proto.tick(now + 20_000);
    while proto.poll_action().is_some() {}
    let _ = image::encode(&proto, now);
});

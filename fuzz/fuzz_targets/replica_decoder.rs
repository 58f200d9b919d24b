//! Feeds arbitrary bytes to a standby's side of the replication log: the entry decoder, then the standby that
//! applies what decodes to a real shard protocol. Any panic is a finding; a refused entry must leave the standby's
//! state unchanged.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tether_common::config::Staleness;
use tether_common::testing::{flat_layout, sgd};
use tether_server::protocol::ShardProtocol;
use tether_server::replication::{self as replica, Standby};
use tether_server::shard::{ShardCore, ShardSpec};

fuzz_target!(|data: &[u8]| {
    let spec = ShardSpec {
        shard: 0,
        shards: 1,
        seed: 1,
        optimizer: sgd(0.1),
        staleness: Staleness::Bounded(1),
        worker_timeout_ms: 1_000,
        spike_factor: 0.0,
    };
    let mut proto = ShardProtocol::new(ShardCore::new(&flat_layout(16), &spec));
    let mut follower = Standby::new();
    // A log of up to 8 entries, each prefixed by its length (one byte).
    let mut rest = data;
    while let Some((&len, tail)) = rest.split_first() {
        let len = (len as usize).min(tail.len());
        let (bytes, next) = tail.split_at(len);
        rest = next;
        let Ok(entry) = replica::decode(bytes) else {
            continue;
        };
        let before = replica::state_digest(&proto.snapshot());
        if follower.accept(&mut proto, &entry).is_err() {
            assert_eq!(before, replica::state_digest(&proto.snapshot()), "a refused entry changed the state");
        }
    }
});

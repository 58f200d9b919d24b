//! State images of one shard: the whole state of a [`ShardProtocol`] (weights, optimizer step and slots, clock
//! table and quorum state, members with their outcome windows and parked pulls, the public copy and its delta log,
//! the guard's and the spike detector's windows, rollback snapshots and counters) as one bincode body, so that a
//! standby can start following a primary that has served workers for a while: it restores the image and then
//! applies the log entries that follow it (see [`super::log`]). This module owns the image format and the checks
//! that make a peer's image safe to adopt: bounded size, typed
//! errors, and shapes checked against the local shard (same shard, range and layout; every vector of the range's
//! length) before anything local changes. Settings and scratch never travel: they come from the local shard.

use serde::{Deserialize, Serialize};

use super::log::ReplicaError;
use crate::protocol::ShardProtocol;

/// The image format's version; an image of another version is refused.
pub const IMAGE_FORMAT: u32 = 1;

/// Largest image a standby decodes (the frame it arrives in is bounded by the shard's size first).
pub const MAX_IMAGE_BYTES: usize = u32::MAX as usize;

#[derive(Serialize)]
struct ImageRef<'a> {
    format: u32,
    now_ms: u64,
    proto: &'a ShardProtocol,
}

#[derive(Deserialize)]
struct ImageOwned {
    format: u32,
    now_ms: u64,
    proto: ShardProtocol,
}

fn bincode_config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<MAX_IMAGE_BYTES>()
}

/// Encodes `proto`'s state as taken at `now_ms` (the shard's clock; the standby continues from it). The protocol's
/// action queue must be drained (the shell drains it after every input).
pub fn encode(proto: &ShardProtocol, now_ms: u64) -> Result<Vec<u8>, ReplicaError> {
    if proto.has_pending_actions() {
        return Err(ReplicaError::Image(
            "actions are pending: drain poll_action before taking an image".into(),
        ));
    }
    let image = ImageRef {
        format: IMAGE_FORMAT,
        now_ms,
        proto,
    };
    bincode::serde::encode_to_vec(&image, bincode_config())
        .map_err(|e| ReplicaError::Image(e.to_string()))
}

/// Decodes a peer's image and checks it against `local` (this process's shard, built from the same configuration):
/// on success `local` holds the image's state, with its own settings and scratch, and the image's clock is
/// returned; on an error `local` is untouched.
pub fn restore(bytes: &[u8], local: &mut ShardProtocol) -> Result<u64, ReplicaError> {
    let (image, used): (ImageOwned, usize) =
        bincode::serde::decode_from_slice(bytes, bincode_config())
            .map_err(|e| ReplicaError::Image(e.to_string()))?;
    if used != bytes.len() {
        return Err(ReplicaError::Image(format!(
            "{} trailing bytes",
            bytes.len() - used
        )));
    }
    if image.format != IMAGE_FORMAT {
        return Err(ReplicaError::Image(format!(
            "image format {} where {IMAGE_FORMAT} is due",
            image.format
        )));
    }
    let mut proto = image.proto;
    proto.adopt_local(local).map_err(ReplicaError::Image)?;
    *local = proto;
    Ok(image.now_ms)
}

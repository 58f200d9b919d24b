//! State images of one shard: the whole state of a [`ShardProtocol`] (weights, optimizer step and slots, clock
//! table and quorum state, members with their outcome windows and parked pulls, the public copy and its delta log,
//! the guard's and the spike detector's windows, rollback snapshots and counters) as one bincode body, so that a
//! standby can start following a primary that has served workers for a while: it restores the image and then
//! applies the log entries that follow it (see [`crate::replica`]). This module owns the image format, the serde
//! adapters the state types use for it, and the checks that make a peer's image safe to adopt: bounded size, typed
//! errors, and shapes checked against the local shard (same shard, range and layout; every vector of the range's
//! length) before anything local changes. Settings and scratch never travel: they come from the local shard.

use serde::{Deserialize, Serialize};

use crate::protocol::ShardProtocol;
use crate::replica::ReplicaError;

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

/// [`tether_common::config::Staleness`] as an optional bound (its configuration form needs a self-describing
/// format).
pub(crate) mod staleness {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    use tether_common::config::Staleness;

    pub fn serialize<S: Serializer>(s: &Staleness, ser: S) -> Result<S::Ok, S::Error> {
        s.bound().serialize(ser)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Staleness, D::Error> {
        Ok(Staleness::from_bound(Option::<u32>::deserialize(d)?))
    }
}

/// A hash map as a list sorted by key, so that equal states encode to equal bytes.
pub(crate) mod sorted_map {
    use std::collections::HashMap;
    use std::hash::Hash;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<K, V, S>(map: &HashMap<K, V>, ser: S) -> Result<S::Ok, S::Error>
    where
        K: Serialize + Ord + Eq + Hash,
        V: Serialize,
        S: Serializer,
    {
        let mut pairs: Vec<(&K, &V)> = map.iter().collect();
        pairs.sort_by(|a, b| a.0.cmp(b.0));
        pairs.serialize(ser)
    }

    pub fn deserialize<'de, K, V, D>(d: D) -> Result<HashMap<K, V>, D::Error>
    where
        K: Deserialize<'de> + Eq + Hash,
        V: Deserialize<'de>,
        D: Deserializer<'de>,
    {
        let pairs = Vec::<(K, V)>::deserialize(d)?;
        let n = pairs.len();
        let map: HashMap<K, V> = pairs.into_iter().collect();
        if map.len() != n {
            return Err(serde::de::Error::custom("a key appears twice"));
        }
        Ok(map)
    }
}

/// Rejection counters by reason label: labels travel as strings and come back as the shard's own labels (an
/// unknown one is refused).
pub(crate) mod reasons {
    use std::collections::HashMap;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use crate::shard::REJECT_REASONS;

    pub fn serialize<S: Serializer>(
        map: &HashMap<&'static str, u64>,
        ser: S,
    ) -> Result<S::Ok, S::Error> {
        let mut pairs: Vec<(&str, u64)> = map.iter().map(|(k, v)| (*k, *v)).collect();
        pairs.sort_unstable();
        pairs.serialize(ser)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<HashMap<&'static str, u64>, D::Error> {
        // Borrowed from the input: a claimed length is checked against the bytes there, never allocated up front.
        let pairs = Vec::<(&'de str, u64)>::deserialize(d)?;
        let mut map = HashMap::with_capacity(pairs.len().min(REJECT_REASONS.len()));
        for (label, n) in pairs {
            let Some(known) = REJECT_REASONS.iter().find(|r| **r == label) else {
                return Err(serde::de::Error::custom(format!(
                    "unknown rejection reason {label:?}"
                )));
            };
            if map.insert(*known, n).is_some() {
                return Err(serde::de::Error::custom("a reason appears twice"));
            }
        }
        Ok(map)
    }
}

/// Shared bytes as a byte string.
pub(crate) mod bytes {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(b: &::bytes::Bytes, ser: S) -> Result<S::Ok, S::Error> {
        ser.serialize_bytes(b)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<::bytes::Bytes, D::Error> {
        // Borrowed from the input, then copied: a claimed length is checked against the bytes there, never
        // allocated up front.
        Ok(::bytes::Bytes::copy_from_slice(<&'de [u8]>::deserialize(
            d,
        )?))
    }
}

/// Values shared with replies in flight, as a plain vector.
pub(crate) mod shared_values {
    use std::sync::Arc;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(v: &Arc<Vec<f32>>, ser: S) -> Result<S::Ok, S::Error> {
        v.as_slice().serialize(ser)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Arc<Vec<f32>>, D::Error> {
        Ok(Arc::new(Vec::<f32>::deserialize(d)?))
    }
}

/// A raw-f32 encoder standing in for the public copy's until [`restore`] builds the configured one.
pub(crate) fn placeholder_encoder() -> tether_common::codec::Encoder {
    let raw = tether_common::codec::CodecConfig {
        scheme: tether_common::codec::Scheme::None,
        zstd: false,
        ..Default::default()
    };
    // The raw scheme without zstd has no setting that can be out of range.
    tether_common::codec::Encoder::new(raw).expect("the raw f32 codec is always valid")
}

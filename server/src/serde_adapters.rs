//! Serde adapters for the state types that travel in state images ([`crate::replication::image`]): shapes that make equal states
//! encode to equal bytes (maps as sorted lists), configuration types in a compact form, and shared buffers as plain
//! values. A leaf module: the cores that use them import them with a `use`, and it imports nothing of the crate.

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

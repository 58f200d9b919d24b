//! The replication log of one shard, pure: every [`Input`] the primary's [`ShardProtocol`] takes becomes one
//! numbered [`Entry`]; a standby that starts from the same state and feeds the same entries to the same
//! [`ShardProtocol::handle`] in the same order holds the same weights, optimizer state, clocks, members, outcome
//! windows and public copy, bit for bit, because the protocol is a deterministic function of its inputs. This
//! module owns the entry format (its encoding, with bounded sizes and typed errors for a peer's bytes), the
//! replication error type, and the fingerprints a standby and its primary compare before the log starts.
//!
//! Both sides drain [`ShardProtocol::poll_action`] after every input, so that replies (which cut the public copy)
//! are built at the same points of the log.

use serde::{Deserialize, Serialize};

use tether_common::config::Config;

use crate::checkpoint::ShardSnapshot;
use crate::protocol::Input;
#[cfg(doc)]
use crate::protocol::ShardProtocol;

/// Largest encoded entry a standby accepts (a push frame of the largest shard, plus a few fields); the transport's
/// frame limit is tighter for a given shard.
pub const MAX_ENTRY_BYTES: usize = 1 << 30;

/// One numbered entry of the log (numbers start at 1 and have no gaps).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    /// Its place in the log.
    pub seq: u64,
    /// The input.
    pub input: Input,
}

/// An entry borrowing its input, encoded exactly as an [`Entry`] (the primary encodes without copying the input).
#[derive(Serialize)]
pub struct EntryRef<'a> {
    /// Its place in the log.
    pub seq: u64,
    /// The input.
    pub input: &'a Input,
}

/// Why a log, a peer's entry or a standby's start was refused.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ReplicaError {
    /// The bytes are not an entry (or longer than [`MAX_ENTRY_BYTES`]).
    #[error("undecodable replication entry: {0}")]
    Decode(String),
    /// A state image is undecodable or does not fit this shard (see [`super::image`]).
    #[error("unusable state image: {0}")]
    Image(String),
    /// An entry came out of order: the log has a gap or a repeat.
    #[error("replication entry {got} where {expected} was due")]
    OutOfOrder {
        /// The next number due.
        expected: u64,
        /// The number that came.
        got: u64,
    },
    /// A push entry's frame does not validate.
    #[error("replicated push frame is invalid: {0}")]
    BadPush(String),
    /// An entry's time runs backwards.
    #[error("replication entry at {got} ms after one at {last} ms")]
    TimeBackwards {
        /// The newest time applied.
        last: u64,
        /// The entry's time.
        got: u64,
    },
    /// The standby and its primary disagree on something that must be equal before the log starts.
    #[error("standby and primary differ: {0}")]
    Mismatch(String),
    /// The node asked is not its shard's primary: it follows another node, or holds no state yet (`seeded` false:
    /// it has just started and is finding its role).
    #[error("not the shard's primary ({})", if *seeded { "it follows, holding the shard's state" } else { "it holds no state yet" })]
    NotLeading {
        /// Whether it holds the shard's state (it follows a primary, or was seeded by one).
        seeded: bool,
    },
    /// The shard has a standby already.
    #[error("the shard already has a standby")]
    Taken,
}

impl ReplicaError {
    /// The wire code a standby is told when its start or its log is refused.
    pub fn code(&self) -> tether_common::protocol::ErrorCode {
        use tether_common::protocol::ErrorCode;
        match self {
            ReplicaError::Decode(_)
            | ReplicaError::Image(_)
            | ReplicaError::OutOfOrder { .. }
            | ReplicaError::BadPush(_)
            | ReplicaError::TimeBackwards { .. } => ErrorCode::BadFrame,
            ReplicaError::Mismatch(_) => ErrorCode::ConfigMismatch,
            ReplicaError::NotLeading { seeded: true } => ErrorCode::NotPrimary,
            ReplicaError::NotLeading { seeded: false } => ErrorCode::Unseeded,
            ReplicaError::Taken => ErrorCode::Overloaded,
        }
    }
}

fn bincode_config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<MAX_ENTRY_BYTES>()
}

/// Encodes one entry into `out` (cleared first, so that a buffer can be reused).
pub fn encode(entry: &EntryRef<'_>, out: &mut Vec<u8>) -> Result<(), ReplicaError> {
    out.clear();
    bincode::serde::encode_into_std_write(entry, out, bincode_config())
        .map(|_| ())
        .map_err(|e| ReplicaError::Decode(e.to_string()))
}

/// Decodes one entry from a whole frame body; trailing bytes are refused.
pub fn decode(bytes: &[u8]) -> Result<Entry, ReplicaError> {
    let (entry, used): (Entry, usize) = bincode::serde::decode_from_slice(bytes, bincode_config())
        .map_err(|e| ReplicaError::Decode(e.to_string()))?;
    if used != bytes.len() {
        return Err(ReplicaError::Decode(format!(
            "{} trailing bytes",
            bytes.len() - used
        )));
    }
    Ok(entry)
}

fn digest(parts: &[&[u8]]) -> u64 {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    for p in parts {
        ctx.update(&(p.len() as u64).to_le_bytes());
        ctx.update(p);
    }
    let out = ctx.finish();
    let mut first = [0u8; 8];
    first.copy_from_slice(&out.as_ref()[..8]);
    u64::from_le_bytes(first)
}

/// Fingerprint of a shard's state (version, optimizer steps and slots, clocks, weights), which a standby and its
/// primary compare before the log starts.
pub fn state_digest(snap: &ShardSnapshot) -> u64 {
    let f32s = |v: &[f32]| {
        v.iter()
            .flat_map(|x| x.to_bits().to_le_bytes())
            .collect::<Vec<u8>>()
    };
    let pairs = |v: &[(u32, u64)]| {
        v.iter()
            .flat_map(|(w, c)| w.to_le_bytes().into_iter().chain(c.to_le_bytes()))
            .collect::<Vec<u8>>()
    };
    let mut parts: Vec<Vec<u8>> = vec![
        snap.layout_hash.to_le_bytes().to_vec(),
        snap.shard.to_le_bytes().to_vec(),
        snap.version.to_le_bytes().to_vec(),
        snap.opt_steps.to_le_bytes().to_vec(),
        pairs(&snap.clocks),
        pairs(&snap.evicted),
        f32s(&snap.weights),
    ];
    parts.extend(snap.slots.iter().map(|s| f32s(s)));
    let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
    digest(&refs)
}

/// Fingerprint of what in a configuration shapes a shard's state machine: everything but node-local paths and
/// addresses (the TLS folder, the deny list, checkpoint storage, data location) and the shard's threads (`[shard]`,
/// which never change a result), which may differ between a standby and its primary.
pub fn config_digest(cfg: &Config) -> u64 {
    let mut c = cfg.clone();
    c.shard = Default::default();
    c.cluster.tls_dir = Default::default();
    c.cluster.revoked.clear();
    c.checkpoint = Default::default();
    c.data.path = Default::default();
    c.data.test_path = None;
    let json = serde_json::to_vec(&c).unwrap_or_default();
    digest(&[&json])
}

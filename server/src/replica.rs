//! The replication log of one shard, pure: every input the primary's [`ShardProtocol`] takes (with the `now_ms` it
//! took it at) becomes one numbered [`Entry`]; a standby that starts from the same state and applies the same entries
//! in the same order holds the same weights, optimizer state, clocks, members, outcome windows and public copy, bit
//! for bit, because the protocol is a deterministic function of its inputs. This module owns the entry format (its
//! encoding, with bounded sizes and typed errors for a peer's bytes), the [`Follower`] that applies a log in order
//! and refuses gaps, and the fingerprints a standby and its primary compare before the log starts. No sockets or
//! timers: the actor and the replication tasks move the entries.
//!
//! Both sides drain [`ShardProtocol::poll_action`] after every input, so that replies (which cut the public copy)
//! are built at the same points of the log.

use serde::{Deserialize, Serialize};

use tether_common::config::Config;
use tether_common::protocol::{access_push, PullMode};

use crate::checkpoint::ShardSnapshot;
use crate::protocol::{ConnId, ShardProtocol};

/// Largest encoded entry a standby accepts (a push frame of the largest shard, plus a few fields); the transport's
/// frame limit is tighter for a given shard.
pub const MAX_ENTRY_BYTES: usize = 1 << 30;

/// One input of the shard protocol, as the primary took it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Input {
    /// [`ShardProtocol::hello`].
    Hello {
        /// The connection.
        conn: ConnId,
        /// The worker.
        worker: u32,
        /// The clock it rejoins at.
        clock: u64,
        /// When.
        now_ms: u64,
    },
    /// [`ShardProtocol::heartbeat`].
    Heartbeat {
        /// The connection.
        conn: ConnId,
        /// The worker.
        worker: u32,
        /// When.
        now_ms: u64,
    },
    /// [`ShardProtocol::goodbye`].
    Goodbye {
        /// The connection.
        conn: ConnId,
        /// The worker.
        worker: u32,
        /// Its clock at goodbye.
        clock: u64,
        /// When.
        now_ms: u64,
    },
    /// [`ShardProtocol::closed`].
    Closed {
        /// The connection.
        conn: ConnId,
    },
    /// [`ShardProtocol::push_frame`] of a push frame body that passed validation at the primary.
    Push {
        /// The connection.
        conn: ConnId,
        /// When.
        now_ms: u64,
        /// The frame body, as it came off the wire.
        body: Vec<u8>,
    },
    /// [`ShardProtocol::pull`].
    Pull {
        /// The connection.
        conn: ConnId,
        /// The worker.
        worker: u32,
        /// The worker's request id.
        request: u64,
        /// The pull's clock.
        clock: u64,
        /// How the worker wants its answer.
        mode: PullMode,
        /// When.
        now_ms: u64,
    },
    /// [`ShardProtocol::cancel`].
    Cancel {
        /// The pull's token.
        token: u64,
    },
    /// [`ShardProtocol::tick`].
    Tick {
        /// When.
        now_ms: u64,
    },
}

impl Input {
    /// The time this input carries, if any.
    pub fn now_ms(&self) -> Option<u64> {
        match self {
            Input::Hello { now_ms, .. }
            | Input::Heartbeat { now_ms, .. }
            | Input::Goodbye { now_ms, .. }
            | Input::Push { now_ms, .. }
            | Input::Pull { now_ms, .. }
            | Input::Tick { now_ms } => Some(*now_ms),
            Input::Closed { .. } | Input::Cancel { .. } => None,
        }
    }

    /// The connection this input names, if any.
    pub fn conn(&self) -> Option<ConnId> {
        match self {
            Input::Hello { conn, .. }
            | Input::Heartbeat { conn, .. }
            | Input::Goodbye { conn, .. }
            | Input::Closed { conn }
            | Input::Push { conn, .. }
            | Input::Pull { conn, .. } => Some(*conn),
            Input::Cancel { .. } | Input::Tick { .. } => None,
        }
    }
}

/// One numbered entry of the log (numbers start at 1 and have no gaps).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    /// Its place in the log.
    pub seq: u64,
    /// The input.
    pub input: Input,
}

/// Why a log, a peer's entry or a standby's start was refused.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ReplicaError {
    /// The bytes are not an entry (or longer than [`MAX_ENTRY_BYTES`]).
    #[error("undecodable replication entry: {0}")]
    Decode(String),
    /// A state image is undecodable or does not fit this shard (see [`crate::image`]).
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

/// Encodes one entry (appended to `out`, which is cleared first, so that a buffer can be reused).
pub fn encode(entry: &Entry, out: &mut Vec<u8>) -> Result<(), ReplicaError> {
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

/// Applies one input to `proto` exactly as the primary's shell did, then drains its actions (a standby sends no
/// replies; draining builds them at the same point of the log, which cuts the public copy as the primary did).
/// `scratch` holds the push body aligned for in-place validation, reused between entries.
pub fn apply(
    proto: &mut ShardProtocol,
    input: &Input,
    scratch: &mut rkyv::util::AlignedVec,
) -> Result<(), ReplicaError> {
    match input {
        Input::Hello {
            conn,
            worker,
            clock,
            now_ms,
        } => {
            // A refused hello changes nothing, at the primary as here.
            let _ = proto.hello(*conn, *worker, *clock, *now_ms);
        }
        Input::Heartbeat {
            conn,
            worker,
            now_ms,
        } => proto.heartbeat(*conn, *worker, *now_ms),
        Input::Goodbye {
            conn,
            worker,
            clock,
            now_ms,
        } => proto.goodbye(*conn, *worker, *clock, *now_ms),
        Input::Closed { conn } => proto.closed(*conn),
        Input::Push { conn, now_ms, body } => {
            scratch.clear();
            scratch.extend_from_slice(body);
            let frame = access_push(scratch).map_err(|e| ReplicaError::BadPush(e.to_string()))?;
            let _ = proto.push_frame(*conn, frame, *now_ms);
        }
        Input::Pull {
            conn,
            worker,
            request,
            clock,
            mode,
            now_ms,
        } => {
            let _ = proto.pull(*conn, *worker, *request, *clock, *mode, *now_ms);
        }
        Input::Cancel { token } => proto.cancel(*token),
        Input::Tick { now_ms } => {
            let _ = proto.tick(*now_ms);
        }
    }
    while proto.poll_action().is_some() {}
    Ok(())
}

/// A standby's side of the log: applies entries in order, refusing gaps, repeats and time running backwards before
/// anything changes.
#[derive(Debug, Default)]
pub struct Follower {
    seeded: bool,
    applied: u64,
    last_now_ms: u64,
    max_conn: ConnId,
    scratch: rkyv::util::AlignedVec,
}

impl Follower {
    /// A follower that has applied nothing.
    pub fn new() -> Follower {
        Follower::default()
    }

    /// A follower of a log that continues a state image taken at `now_ms` at log position `seq` (see
    /// [`crate::image`]): the first entry due is `seq + 1`, and time may not run back before the image's.
    pub fn seeded(now_ms: u64, max_conn: ConnId, seq: u64) -> Follower {
        Follower {
            seeded: true,
            applied: seq,
            last_now_ms: now_ms,
            max_conn,
            ..Follower::default()
        }
    }

    /// Whether it holds its shard's state: seeded from an image, or some entries applied.
    pub fn is_seeded(&self) -> bool {
        self.seeded || self.applied > 0
    }

    /// The newest entry applied (0: none).
    pub fn applied(&self) -> u64 {
        self.applied
    }

    /// The newest time an applied entry carried: a standby that takes over continues its clock from here.
    pub fn last_now_ms(&self) -> u64 {
        self.last_now_ms
    }

    /// The highest connection id an applied entry named.
    pub fn max_conn(&self) -> ConnId {
        self.max_conn
    }

    /// Applies `entry` to `proto` if it is the next one; returns its number.
    pub fn accept(
        &mut self,
        proto: &mut ShardProtocol,
        entry: &Entry,
    ) -> Result<u64, ReplicaError> {
        let expected = self.applied + 1;
        if entry.seq != expected {
            return Err(ReplicaError::OutOfOrder {
                expected,
                got: entry.seq,
            });
        }
        if let Some(now) = entry.input.now_ms() {
            if now < self.last_now_ms {
                return Err(ReplicaError::TimeBackwards {
                    last: self.last_now_ms,
                    got: now,
                });
            }
        }
        // `apply` validates a push frame before the protocol sees it, so a bad one changes nothing.
        apply(proto, &entry.input, &mut self.scratch)?;
        self.applied = entry.seq;
        if let Some(now) = entry.input.now_ms() {
            self.last_now_ms = now;
        }
        if let Some(conn) = entry.input.conn() {
            self.max_conn = self.max_conn.max(conn);
        }
        Ok(entry.seq)
    }
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
/// addresses (the TLS folder, the deny list, checkpoint storage, data location), which may differ between a standby
/// and its primary.
pub fn config_digest(cfg: &Config) -> u64 {
    let mut c = cfg.clone();
    c.cluster.tls_dir = Default::default();
    c.cluster.revoked.clear();
    c.checkpoint = Default::default();
    c.data.path = Default::default();
    c.data.test_path = None;
    let json = serde_json::to_vec(&c).unwrap_or_default();
    digest(&[&json])
}

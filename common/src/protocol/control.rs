//! Control messages: the small, infrequent messages of a connection, encoded with bincode 2.0.1.
//!
//! This is the only module that touches bincode. Encoding uses `bincode::config::standard()` with a byte limit
//! of [`MAX_CONTROL_BYTES`]; decoding rejects trailing bytes, so one frame body is exactly one message.
//! Decoding never panics on arbitrary input; every failure is a [`ProtocolError`].

use serde::{Deserialize, Serialize};

use super::{ErrorCode, Precision, ProtocolError};

/// A public copy of a shard's weights a worker holds: which lineage (one per shard incarnation) and which cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PublicRef {
    /// The shard incarnation that cut it (a restarted shard starts a new lineage).
    pub lineage: u64,
    /// The cut's sequence number within the lineage.
    pub seq: u64,
}

/// How a pull wants its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PullMode {
    /// The current weights in full, at this precision (a `Params` frame).
    Full(Precision),
    /// The shard's public copy, as compressed deltas from the one the worker holds (`None`: it holds none yet), or
    /// "not modified" (a `Delta` frame).
    Delta {
        /// The public copy the worker holds.
        have: Option<PublicRef>,
    },
}

/// Largest encoded control message, in bytes (also the control frame limit).
pub const MAX_CONTROL_BYTES: usize = 4096;

/// Longest `Control::Error` message, in bytes; longer messages are cut at a character boundary on encode.
pub const MAX_ERROR_MESSAGE_BYTES: usize = 1024;

/// A control message on the connection's long-lived bidirectional stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Control {
    /// Worker → server, first message: who I am and what model I train.
    Hello(Hello),
    /// Server → worker, answer to `Hello`: the shard's identity and the SSP state to join at.
    Welcome(Welcome),
    /// Worker → server liveness signal, sent on a timer for the whole connection (a long step is not silence).
    Heartbeat {
        /// The worker's current clock (informational).
        clock: u64,
    },
    /// Worker → server: send parameters once the SSP gate for `clock` opens.
    PullRequest {
        /// Names this request; the reply carries it back, and a reply to another request is never used.
        request: u64,
        /// The worker's clock for this pull.
        clock: u64,
        /// What to answer with.
        mode: PullMode,
    },
    /// Server → worker: a pull request was refused (the reply will never come).
    PullRefused {
        /// The refused request.
        request: u64,
        /// Why.
        code: ErrorCode,
    },
    /// Server → worker: what became of the push (or skip marker) of round `clock`.
    PushOutcome {
        /// The push round.
        clock: u64,
        /// Applied, already applied, or refused.
        outcome: Outcome,
        /// The fence term of the node that answered (0: an unreplicated shard); a worker takes the outcome only
        /// in its connection's term.
        term: u64,
    },
    /// Either side: a protocol error; the sender closes the connection with the same code.
    Error {
        /// Stable error code.
        code: ErrorCode,
        /// Human-readable cause.
        message: String,
    },
    /// Worker → server: orderly end. `clock` is the worker's clock: its rounds below it were all sent (on the push
    /// path, which this message may overtake), so the shard lets it leave once it has taken them, or after a drain
    /// timeout.
    Goodbye {
        /// The worker's clock when it said goodbye.
        clock: u64,
    },
    /// A node of shard `shard` asks the shard's other node to be its standby (the first message on its control
    /// stream): a primary answers with a welcome, anything else with an error (`NotPrimary`: wait; `Unseeded`: it
    /// holds no state either).
    ReplicaHello {
        /// The shard it follows.
        shard: u32,
        /// Its parameter layout's fingerprint.
        layout_hash: u64,
        /// Fingerprint of its configuration, which must be the primary's.
        config_digest: u64,
        /// The asking process's incarnation (random per start), which the fence records once it holds the log.
        incarnation: u64,
    },
    /// The primary accepts a standby: one unidirectional stream carries the shard's state image (a `ReplicaImage`
    /// frame), then the log that continues it.
    ReplicaWelcome {
        /// The lineage of the primary's public copy (delta pulls), which the standby takes over.
        lineage: u64,
        /// The log position the image stands at: the first entry that follows is `seq + 1`, and the standby
        /// acknowledges `seq` once it adopted the image.
        seq: u64,
    },
    /// The standby applied the primary's log up to entry `seq` (the primary releases what waited on it).
    ReplicaAck {
        /// The newest entry applied.
        seq: u64,
    },
    /// A node of shard `shard` asks a voter (the shard's other node, or the witness) to grant or renew a term (see
    /// [`crate::fence`]); the node index comes from the asker's certificate, never from this message.
    LeaseRequest {
        /// The shard.
        shard: u32,
        /// The term, incarnation, round and successor claimed.
        request: crate::fence::Request,
    },
    /// The voter's answer to a [`Control::LeaseRequest`], in request order, naming the request's `round`: a vote
    /// for any other round than the oldest unanswered one (a voter answering twice, or out of order) ends the link
    /// and counts for nothing.
    LeaseVote {
        /// The `round` of the request it answers.
        round: u64,
        /// Granted, or refused with the voter's newest term.
        vote: crate::fence::Vote,
    },
}

impl Control {
    /// An `Error` message for a protocol error, with the message cut to [`MAX_ERROR_MESSAGE_BYTES`].
    pub fn error(err: &ProtocolError) -> Control {
        Control::Error {
            code: err.code(),
            message: truncate_message(err.to_string()),
        }
    }

    /// The variant name, for logs and `UnexpectedMessage` errors.
    pub fn name(&self) -> &'static str {
        match self {
            Control::Hello(_) => "Hello",
            Control::Welcome(_) => "Welcome",
            Control::Heartbeat { .. } => "Heartbeat",
            Control::PullRequest { .. } => "PullRequest",
            Control::PullRefused { .. } => "PullRefused",
            Control::PushOutcome { .. } => "PushOutcome",
            Control::Error { .. } => "Error",
            Control::Goodbye { .. } => "Goodbye",
            Control::ReplicaHello { .. } => "ReplicaHello",
            Control::ReplicaWelcome { .. } => "ReplicaWelcome",
            Control::ReplicaAck { .. } => "ReplicaAck",
            Control::LeaseRequest { .. } => "LeaseRequest",
            Control::LeaseVote { .. } => "LeaseVote",
        }
    }
}

/// What a shard did with one push or skip marker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    /// Applied now (or, for a skip marker, the clock advanced).
    Applied,
    /// This (worker, clock) was applied before: a resend, acknowledged without applying it again.
    Duplicate,
    /// Refused; the update is not in the weights. For a numerically refused push the clock still advanced.
    Refused(ErrorCode),
}

fn config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<MAX_CONTROL_BYTES>()
}

fn truncate_message(mut message: String) -> String {
    if message.len() > MAX_ERROR_MESSAGE_BYTES {
        let mut cut = MAX_ERROR_MESSAGE_BYTES;
        while !message.is_char_boundary(cut) {
            cut -= 1;
        }
        message.truncate(cut);
    }
    message
}

/// Encodes a control message (an `Error` message longer than the cap is cut first).
pub fn encode_control(msg: &Control) -> Result<Vec<u8>, ProtocolError> {
    let owned;
    let msg = match msg {
        Control::Error { code, message } if message.len() > MAX_ERROR_MESSAGE_BYTES => {
            owned = Control::Error {
                code: *code,
                message: truncate_message(message.clone()),
            };
            &owned
        }
        other => other,
    };
    bincode::serde::encode_to_vec(msg, config()).map_err(|e| ProtocolError::Rejected {
        code: ErrorCode::Internal,
        message: format!("encode control: {e}"),
    })
}

/// Decodes exactly one control message from `bytes` (trailing bytes are an error).
pub fn decode_control(bytes: &[u8]) -> Result<Control, ProtocolError> {
    if bytes.len() > MAX_CONTROL_BYTES {
        return Err(ProtocolError::Oversized {
            kind: super::FrameKind::Control as u8,
            len: bytes.len() as u64,
            limit: MAX_CONTROL_BYTES as u64,
        });
    }
    let (msg, used): (Control, usize) = bincode::serde::decode_from_slice(bytes, config())
        .map_err(|e| ProtocolError::ControlDecode(e.to_string()))?;
    if used != bytes.len() {
        return Err(ProtocolError::BadFrame(format!(
            "{} trailing bytes after control message",
            bytes.len() - used
        )));
    }
    Ok(msg)
}

/// Worker → server, first message on a connection: who I am and what model I train (`Control::Hello`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// The worker's rank (must match its certificate unless it uses the shared client certificate).
    pub rank: u32,
    /// The worker's [`super::PROTOCOL_VERSION`].
    pub protocol_version: u32,
    /// Hash of the model layout; must equal the server's.
    pub layout_hash: u64,
    /// The clock the worker (re)joins at: its first push round this shard has not acknowledged. This is the only
    /// way a worker moves its clock without a push or a skip (an explicit rejoin).
    pub clock: u64,
}

/// Server → worker, answer to a [`Hello`]: the shard's identity and the SSP state to join at (`Control::Welcome`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Welcome {
    /// Shard index.
    pub shard: u32,
    /// First global parameter index owned by the shard.
    pub range_start: u64,
    /// One past the last global parameter index owned by the shard.
    pub range_end: u64,
    /// Staleness bound; `None` means unbounded (asynchronous). A worker configured for another bound refuses the
    /// shard.
    pub staleness: Option<u32>,
    /// Streamed fragments (`train.fragments`): a push of clock `c` carries part `c mod fragments` of the range. A
    /// worker configured otherwise refuses the shard.
    pub fragments: u32,
    /// Where the shard's SSP gate stands: the minimum clock over live workers, or with quorum rounds the first round
    /// not yet closed.
    pub min_clock: u64,
    /// Shard parameter version.
    pub version: u64,
    /// The worker's clock at this shard: the round its next push or skip must carry (≥ the hello's clock).
    pub clock: u64,
    /// Set by a shard that started fresh (not resumed): cut 0 of its public copy is the layout's deterministic
    /// initial weights, which a worker can compute instead of pulling them whole.
    pub initial: Option<InitialCut>,
    /// The fence term the node serves in (0: an unreplicated shard). Every outcome and reply on this connection
    /// carries it; a worker that has seen a newer term at this shard refuses the node.
    pub term: u64,
}

/// Cut 0 of a shard's public copy when it is the layout's initial weights (`Layout::init_range` with `seed` over
/// the shard's range). A worker that computes those values and finds `crc32` of their little-endian bytes may claim
/// to hold cut 0 of `lineage`; any other worker (or one whose values differ, say under another libm) pulls whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct InitialCut {
    /// The public copy's lineage whose cut 0 these values are.
    pub lineage: u64,
    /// The seed of the initial weights.
    pub seed: u64,
    /// CRC-32 (IEEE) of the values as little-endian f32.
    pub crc32: u32,
}

impl InitialCut {
    /// CRC-32 (IEEE) of `values` as little-endian f32, as [`InitialCut::crc32`] holds it.
    pub fn checksum(values: &[f32]) -> u32 {
        let mut h = crc32fast::Hasher::new();
        for v in values {
            h.update(&v.to_le_bytes());
        }
        h.finalize()
    }
}

impl From<Hello> for Control {
    fn from(h: Hello) -> Control {
        Control::Hello(h)
    }
}

impl From<Welcome> for Control {
    fn from(w: Welcome) -> Control {
        Control::Welcome(w)
    }
}

impl Hello {
    /// A hello for a fresh `rank` (clock 0) at this build's protocol version.
    pub fn new(rank: u32, layout_hash: u64) -> Hello {
        Hello::rejoin(rank, layout_hash, 0)
    }

    /// A hello that rejoins at `clock`.
    pub fn rejoin(rank: u32, layout_hash: u64, clock: u64) -> Hello {
        Hello {
            rank,
            protocol_version: super::PROTOCOL_VERSION,
            layout_hash,
            clock,
        }
    }

    /// Checks the version, the layout hash and that `allowed(rank)` holds (the certificate binding).
    pub fn check(
        &self,
        expected_layout_hash: u64,
        allowed: impl FnOnce(u32) -> bool,
        identity: &str,
    ) -> Result<(), ProtocolError> {
        if self.protocol_version != super::PROTOCOL_VERSION {
            return Err(ProtocolError::BadVersion {
                expected: super::PROTOCOL_VERSION,
                got: self.protocol_version,
            });
        }
        if self.layout_hash != expected_layout_hash {
            return Err(ProtocolError::BadLayoutHash {
                expected: expected_layout_hash,
                got: self.layout_hash,
            });
        }
        if !allowed(self.rank) {
            return Err(ProtocolError::Unauthorized {
                claimed: self.rank,
                identity: identity.to_string(),
            });
        }
        Ok(())
    }
}

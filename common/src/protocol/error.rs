//! Wire error codes and the protocol error type.
//!
//! [`ErrorCode`] values are part of the external contract: they travel inside `Control::Error` and as QUIC
//! application close codes, so a number, once assigned, never changes meaning. New codes are appended.
//!
//! | code | name              | meaning                                                          |
//! |-----:|-------------------|------------------------------------------------------------------|
//! |    1 | BadFrame          | malformed framing: unknown kind, trailing bytes, bad encoding     |
//! |    2 | Oversized         | declared frame length exceeds the limit for its kind              |
//! |    3 | Truncated         | stream ended before the declared length was read                  |
//! |    4 | ValidationFailed  | rkyv bulk frame failed validation                                 |
//! |    5 | BadVersion        | peer speaks a different `PROTOCOL_VERSION`                        |
//! |    6 | BadLayoutHash     | peer's model layout hash differs from the server's                |
//! |    7 | Unauthorized      | claimed rank does not match the client certificate                |
//! |    8 | WrongShard        | frame addressed to another shard                                  |
//! |    9 | BadRange          | frame's parameter range is not this shard's range                 |
//! |   10 | NonFinite         | payload decodes to NaN or infinity                                |
//! |   11 | ClockFromFuture   | clock ahead of what the protocol allows                           |
//! |   12 | Replay            | clock already pushed by this worker                               |
//! |   13 | Overloaded        | server cannot accept more work now                                |
//! |   14 | Internal          | server-side failure unrelated to the peer's bytes                 |
//! |   15 | Evicted           | worker was evicted from the clock table                           |
//! |   16 | Shutdown          | server is shutting down                                           |
//! |   17 | UnexpectedMessage | a valid message not allowed at this point of the connection       |
//! |   18 | RolledBack        | push computed from parameters a loss-spike rollback discarded     |
//! |   19 | ConfigMismatch    | peer runs under another cluster setting (e.g. the SSP bound)      |
//! |   20 | Superseded        | a newer session of the same worker replaced this connection      |

use serde::{Deserialize, Serialize};

/// Stable numeric error code shared by `Control::Error` and QUIC application close codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(into = "u16", try_from = "u16")]
#[repr(u16)]
pub enum ErrorCode {
    /// Malformed framing (unknown kind, trailing bytes, undecodable control message).
    BadFrame = 1,
    /// Declared frame length exceeds the limit for its kind.
    Oversized = 2,
    /// Stream ended before the declared length was read.
    Truncated = 3,
    /// An rkyv bulk frame failed validation.
    ValidationFailed = 4,
    /// Peer speaks a different protocol version.
    BadVersion = 5,
    /// Peer's model layout hash differs.
    BadLayoutHash = 6,
    /// Claimed rank does not match the client certificate.
    Unauthorized = 7,
    /// Frame addressed to another shard.
    WrongShard = 8,
    /// Frame's parameter range is not the shard's range.
    BadRange = 9,
    /// Payload contains NaN or infinity.
    NonFinite = 10,
    /// Clock ahead of what the protocol allows.
    ClockFromFuture = 11,
    /// Clock already pushed by this worker.
    Replay = 12,
    /// Server cannot accept more work now.
    Overloaded = 13,
    /// Failure unrelated to the peer's bytes.
    Internal = 14,
    /// Worker was evicted from the clock table.
    Evicted = 15,
    /// Server is shutting down.
    Shutdown = 16,
    /// Valid message not allowed at this point of the connection.
    UnexpectedMessage = 17,
    /// Push computed from parameters that a loss-spike rollback discarded (its read version predates the rollback).
    RolledBack = 18,
    /// Peer runs under another cluster setting than ours (e.g. the staleness bound).
    ConfigMismatch = 19,
    /// A newer session (hello) of the same worker replaced this connection: nothing sent on it is taken any more.
    Superseded = 20,
    /// This address is a standby that follows its primary: the worker tries the shard's other address.
    NotPrimary = 21,
    /// This node of a replicated shard holds no state of it yet (it has just started and is finding its role): the
    /// shard's designated primary serves, and a standby waits.
    Unseeded = 22,
}

impl ErrorCode {
    /// Every code, in numeric order.
    pub const ALL: [ErrorCode; 22] = [
        ErrorCode::BadFrame,
        ErrorCode::Oversized,
        ErrorCode::Truncated,
        ErrorCode::ValidationFailed,
        ErrorCode::BadVersion,
        ErrorCode::BadLayoutHash,
        ErrorCode::Unauthorized,
        ErrorCode::WrongShard,
        ErrorCode::BadRange,
        ErrorCode::NonFinite,
        ErrorCode::ClockFromFuture,
        ErrorCode::Replay,
        ErrorCode::Overloaded,
        ErrorCode::Internal,
        ErrorCode::Evicted,
        ErrorCode::Shutdown,
        ErrorCode::UnexpectedMessage,
        ErrorCode::RolledBack,
        ErrorCode::ConfigMismatch,
        ErrorCode::Superseded,
        ErrorCode::NotPrimary,
        ErrorCode::Unseeded,
    ];

    /// The stable numeric value.
    pub fn code(self) -> u16 {
        self as u16
    }

    /// The code for a numeric value, if it is assigned.
    pub fn from_code(code: u64) -> Option<ErrorCode> {
        ErrorCode::ALL
            .iter()
            .copied()
            .find(|c| u64::from(c.code()) == code)
    }

    /// The QUIC application close code carrying this error.
    pub fn close_code(self) -> quinn::VarInt {
        quinn::VarInt::from_u32(u32::from(self.code()))
    }
}

impl From<ErrorCode> for u16 {
    fn from(code: ErrorCode) -> u16 {
        code.code()
    }
}

impl TryFrom<u16> for ErrorCode {
    type Error = UnknownErrorCode;
    fn try_from(value: u16) -> Result<Self, Self::Error> {
        ErrorCode::from_code(u64::from(value)).ok_or(UnknownErrorCode(value))
    }
}

/// A numeric error code that no [`ErrorCode`] has (yet).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("unknown error code {0}")]
pub struct UnknownErrorCode(pub u16);

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self:?}({})", self.code())
    }
}

/// Everything that can be wrong with bytes received from a peer, or with a connection's message order.
///
/// Each variant maps to one [`ErrorCode`] through [`ProtocolError::code`]; the transport closes the offending
/// connection with that code.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ProtocolError {
    /// Framing is malformed (unknown kind byte, kind not allowed on this stream, trailing bytes).
    #[error("bad frame: {0}")]
    BadFrame(String),
    /// A frame declared more bytes than its kind allows.
    #[error("{kind:?} frame of {len} bytes exceeds the limit of {limit}")]
    Oversized {
        /// The frame kind byte as received.
        kind: u8,
        /// The declared length.
        len: u64,
        /// The limit for that kind.
        limit: u64,
    },
    /// The stream or buffer ended before the declared length.
    #[error("truncated frame: expected {expected} bytes, got {got}")]
    Truncated {
        /// Bytes the header promised (header included when reading a header).
        expected: u64,
        /// Bytes actually available.
        got: u64,
    },
    /// A bincode control message did not decode.
    #[error("control message does not decode: {0}")]
    ControlDecode(String),
    /// An rkyv bulk frame failed validation.
    #[error("bulk frame failed validation: {0}")]
    ValidationFailed(String),
    /// The peer speaks another protocol version.
    #[error("protocol version {got} is not supported (expected {expected})")]
    BadVersion {
        /// Our version.
        expected: u32,
        /// The peer's version.
        got: u32,
    },
    /// The peer's layout hash differs from ours.
    #[error("layout hash {got:#018x} does not match {expected:#018x}")]
    BadLayoutHash {
        /// Our layout hash.
        expected: u64,
        /// The peer's layout hash.
        got: u64,
    },
    /// The claimed rank is not the one bound by the peer's certificate.
    #[error("rank {claimed} is not allowed for this certificate ({identity})")]
    Unauthorized {
        /// The rank in the hello.
        claimed: u32,
        /// The certificate's identity, as text.
        identity: String,
    },
    /// A frame addressed to another shard.
    #[error("frame for shard {got} arrived at shard {expected}")]
    WrongShard {
        /// This shard.
        expected: u32,
        /// The frame's shard.
        got: u32,
    },
    /// A frame whose range is not this shard's range.
    #[error("range {got_start}..{got_end} is not this shard's range {start}..{end}")]
    BadRange {
        /// Shard range start.
        start: u64,
        /// Shard range end.
        end: u64,
        /// Frame range start.
        got_start: u64,
        /// Frame range end.
        got_end: u64,
    },
    /// A valid message that may not appear at this point (e.g. a second Hello).
    #[error("unexpected message: {0}")]
    UnexpectedMessage(String),
    /// The peer reported an error and is closing.
    #[error("peer reported {code}: {message}")]
    Remote {
        /// The peer's code.
        code: ErrorCode,
        /// The peer's message.
        message: String,
    },
    /// The shard announces another staleness bound than the worker is configured for (`None`: unbounded).
    #[error(
        "shard {shard} runs with staleness bound {}, this worker is configured for {}",
        bound_name(*shard_bound),
        bound_name(*ours)
    )]
    StalenessMismatch {
        /// The shard.
        shard: u32,
        /// The bound the shard's welcome announced.
        shard_bound: Option<u32>,
        /// The worker's own bound.
        ours: Option<u32>,
    },
    /// The shard streams its range in another number of fragments than the worker (`train.fragments` differs).
    #[error("shard {shard} streams {shard_fragments} fragments, this worker {ours}: train.fragments must match")]
    FragmentsMismatch {
        /// The shard.
        shard: u32,
        /// The shard's count.
        shard_fragments: u32,
        /// The worker's own count.
        ours: u32,
    },
    /// An answer from a node in another fence term than the connection's, or a welcome in a term older than one
    /// this worker has seen at the shard: the node was deposed (the worker reconnects and asks again).
    #[error("shard {shard} answered in term {got}, where term {expected} or newer serves")]
    StaleTerm {
        /// The shard.
        shard: u32,
        /// The term the answer carried.
        got: u64,
        /// The connection's term (or the newest seen, for a welcome).
        expected: u64,
    },
    /// A violation detected by a higher layer (shard validation, clock checks), carried with its code.
    #[error("{code}: {message}")]
    Rejected {
        /// The code sent to the peer.
        code: ErrorCode,
        /// Human-readable cause.
        message: String,
    },
}

impl ProtocolError {
    /// The stable wire code for this error.
    pub fn code(&self) -> ErrorCode {
        match self {
            ProtocolError::BadFrame(_) | ProtocolError::ControlDecode(_) => ErrorCode::BadFrame,
            ProtocolError::Oversized { .. } => ErrorCode::Oversized,
            ProtocolError::Truncated { .. } => ErrorCode::Truncated,
            ProtocolError::ValidationFailed(_) => ErrorCode::ValidationFailed,
            ProtocolError::BadVersion { .. } => ErrorCode::BadVersion,
            ProtocolError::BadLayoutHash { .. } => ErrorCode::BadLayoutHash,
            ProtocolError::Unauthorized { .. } => ErrorCode::Unauthorized,
            ProtocolError::WrongShard { .. } => ErrorCode::WrongShard,
            ProtocolError::BadRange { .. } => ErrorCode::BadRange,
            ProtocolError::UnexpectedMessage(_) => ErrorCode::UnexpectedMessage,
            ProtocolError::StalenessMismatch { .. } | ProtocolError::FragmentsMismatch { .. } => {
                ErrorCode::ConfigMismatch
            }
            ProtocolError::StaleTerm { .. } => ErrorCode::NotPrimary,
            ProtocolError::Remote { code, .. } | ProtocolError::Rejected { code, .. } => *code,
        }
    }
}

/// A staleness bound as configured: its number, or `inf` for unbounded.
fn bound_name(bound: Option<u32>) -> String {
    bound.map_or_else(|| "inf".to_string(), |s| s.to_string())
}

//! The wire protocol: message schemas, their encodings and stream framing, with no sockets.
//!
//! Control messages ([`Control`]) are bincode 2.0.1; bulk frames ([`PushFrame`], [`ParamReply`], the
//! [`DeltaHeader`] of a delta reply, both opening with the one [`ReplyHeader`]) are rkyv 0.8 read back with
//! validation; every frame on a stream is `[u32 LE length][u8 kind][body]` with a per-kind size
//! limit ([`FrameLimits`]). Every decoder accepts arbitrary bytes without panicking and fails with a
//! [`ProtocolError`], which carries a stable [`ErrorCode`] for the wire.

pub mod bulk;
pub mod control;
pub mod delta;
pub mod error;
pub mod framing;
pub mod reply;
pub mod values;

pub use bulk::{
    access_params, access_push, decode_params, decode_push, encode_params, encode_params_into,
    encode_push, encode_push_into, ArchivedParamReply, ArchivedPushFrame, ParamReply, PushFrame,
    PushMeta,
};
pub use control::{
    decode_control, encode_control, Control, Hello, InitialCut, Outcome, PublicRef, PullMode,
    Welcome, MAX_CONTROL_BYTES,
};
pub use delta::{
    access_delta, encode_delta_preamble, ArchivedDeltaHeader, DeltaHeader, DeltaKind, DeltaView,
};
pub use error::{ErrorCode, ProtocolError};
pub use framing::{
    encode_frame, read_frame, split_frame, FrameHeader, FrameKind, FrameLimits, ReadFrameError,
    FRAME_KEEP, HEADER_LEN,
};
pub use reply::{ArchivedReplyHeader, ReplyHeader};
pub use values::{check_finite_values, decode_values, encode_values};

/// Version of this protocol; a `Hello` with another version is refused with [`ErrorCode::BadVersion`]. Version 4
/// added the rollback `epoch` to pull replies and the `RolledBack` refusal; version 5 opens full and delta replies
/// with the one [`ReplyHeader`] and adds [`ErrorCode::ConfigMismatch`]; version 6 adds `Welcome::fragments`;
/// version 7 adds `Welcome::initial`; version 8 adds the fence term to the welcome, to push outcomes and to every
/// pull reply's header; version 9 names the request's round in every lease vote.
pub const PROTOCOL_VERSION: u32 = 9;

/// TLS ALPN protocol identifier.
pub const ALPN: &[u8] = b"tether/1";

/// Wire precision of parameter values in a pull.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    serde::Serialize,
    serde::Deserialize,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
#[rkyv(derive(Debug, Clone, Copy, PartialEq, Eq))]
pub enum Precision {
    /// Little-endian IEEE f32.
    F32,
    /// Little-endian bfloat16.
    Bf16,
}

impl Precision {
    /// Bytes per value.
    pub fn width(self) -> usize {
        match self {
            Precision::F32 => 4,
            Precision::Bf16 => 2,
        }
    }
}

impl From<&ArchivedPrecision> for Precision {
    fn from(p: &ArchivedPrecision) -> Precision {
        match p {
            ArchivedPrecision::F32 => Precision::F32,
            ArchivedPrecision::Bf16 => Precision::Bf16,
        }
    }
}

//! The one typed input of [`ShardProtocol`](super::ShardProtocol): every message, timer and connection event the
//! shard reacts to is an [`Input`] (with the `now_ms` it was taken at), fed through
//! [`ShardProtocol::handle`](super::ShardProtocol::handle), which answers with a [`Handled`]. Inputs are what the
//! replication log carries (see [`crate::replication`]), so an input the log does not know cannot reach the protocol.

use serde::{Deserialize, Serialize};

use rkyv::util::AlignedVec;
use tether_common::protocol::{Outcome, ProtocolError, PullMode, Welcome};

use crate::shard::{Applied, ShardError};

use super::ConnId;

/// A push frame body, 16-byte aligned so that it is validated and read in place (it travels as plain bytes).
#[derive(Debug, Clone, Default)]
pub struct FrameBody(pub AlignedVec);

impl PartialEq for FrameBody {
    fn eq(&self, other: &FrameBody) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl FrameBody {
    /// Copies `bytes` into an aligned body.
    pub fn copy_from(bytes: &[u8]) -> FrameBody {
        let mut v = AlignedVec::with_capacity(bytes.len());
        v.extend_from_slice(bytes);
        FrameBody(v)
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        self.0.as_slice()
    }
}

impl Serialize for FrameBody {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.as_slice().serialize(s)
    }
}

impl<'de> Deserialize<'de> for FrameBody {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<FrameBody, D::Error> {
        let bytes = Vec::<u8>::deserialize(d)?;
        Ok(FrameBody::copy_from(&bytes))
    }
}

/// One input of the shard protocol.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Input {
    /// A worker's hello (the explicit rejoin at `clock`).
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
    /// A worker is alive.
    Heartbeat {
        /// The connection.
        conn: ConnId,
        /// The worker.
        worker: u32,
        /// When.
        now_ms: u64,
    },
    /// A worker leaves once its rounds below `clock` are taken.
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
    /// A connection ended.
    Closed {
        /// The connection.
        conn: ConnId,
    },
    /// A push frame or skip marker (validated in place before anything changes).
    Push {
        /// The connection.
        conn: ConnId,
        /// When.
        now_ms: u64,
        /// The frame body, as it came off the wire.
        body: FrameBody,
    },
    /// A pull request.
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
    /// A parked pull's requester went away.
    Cancel {
        /// The pull's token.
        token: u64,
    },
    /// The periodic sweep (evictions, grace windows, goodbye drains).
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

/// What [`ShardProtocol::handle`](super::ShardProtocol::handle) made of an input (finished replies, refusals and
/// closes come out of `poll_action`).
#[derive(Debug)]
pub enum Handled {
    /// A hello: the welcome the shell sends back, or the refusal (nothing changed).
    Welcome(Result<Welcome, ShardError>),
    /// A push or skip marker: the outcome the worker is told, and what the shard did now (the application details,
    /// nothing for a duplicate or skip, or the refusal in full).
    Round(Outcome, Result<Option<Applied>, ShardError>),
    /// A push body that is not a valid frame: refused before anything changed.
    BadFrame(ProtocolError),
    /// A pull: its token (the answer comes out of `poll_action`), or the refusal.
    Pull(Result<u64, ShardError>),
    /// A tick: the workers it evicted.
    Evicted(Vec<u32>),
    /// A heartbeat, goodbye, closed connection or cancel: nothing to answer.
    Done,
}

//! The crate-level error of tether-server: one enum grouping the errors of its modules by theme (membership and
//! clocks, gradient validation, optimizer state, checkpoints, configuration and transport, the actor shell), so that
//! callers of the crate handle one type. Module functions keep returning their own precise errors; `?` converts them.
//! Errors that reach a peer carry a stable wire [`ErrorCode`] through [`Error::code`].

use tether_common::config::ConfigError;
use tether_common::net::NetError;
use tether_common::protocol::{ErrorCode, ProtocolError};

use crate::checkpoint::CheckpointError;
use crate::clock::ClockError;
use crate::optim::OptimError;
use crate::shard::{RestoreError, ShardError};

/// Everything that can fail in a tether-server shard.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A clock-table operation was refused (unknown or evicted worker, a clock that is not the next one).
    #[error(transparent)]
    Clock(#[from] ClockError),
    /// A push or pull was refused by the shard (addressing, codec, numerical guard, clocks, membership, overload).
    #[error(transparent)]
    Shard(#[from] ShardError),
    /// Optimizer state of the wrong shape was offered (e.g. by a checkpoint).
    #[error(transparent)]
    Optim(#[from] OptimError),
    /// A checkpoint's snapshot could not be restored.
    #[error(transparent)]
    Restore(#[from] RestoreError),
    /// Writing or loading a checkpoint failed.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// The shard's checkpoint key is missing or unreadable.
    #[error(transparent)]
    CheckpointKey(tether_common::pki::PkiError),
    /// The object store of remote checkpoints failed.
    #[error(transparent)]
    Remote(#[from] crate::remote::RemoteError),
    /// A peer's bytes or message order violated the protocol.
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Certificates, the endpoint or a connection failed.
    #[error(transparent)]
    Net(#[from] NetError),
    /// The shard index is not in `cluster.servers`, or an address does not resolve.
    #[error("{0}")]
    Address(String),
    /// A replication log, a standby's start or a replicated entry was refused.
    #[error(transparent)]
    Replica(#[from] crate::replication::ReplicaError),
    /// The shard actor stopped.
    #[error("shard actor is gone")]
    ActorGone,
    /// The shard's threads (`shard.threads`) could not be started.
    #[error("cannot start the shard's {threads} threads: {reason}")]
    Threads {
        /// Threads asked for.
        threads: usize,
        /// Why the pool could not be built.
        reason: String,
    },
}

impl Error {
    /// The wire code a peer is told when this error ends its request or connection; `None` for local failures
    /// (configuration, checkpoints, optimizer state) that never cross the wire on their own.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            Error::Clock(ClockError::UnknownWorker { .. } | ClockError::Evicted { .. }) => {
                Some(ErrorCode::Evicted)
            }
            Error::Clock(ClockError::NotNext { expected, got, .. }) => Some(if got < expected {
                ErrorCode::Replay
            } else {
                ErrorCode::ClockFromFuture
            }),
            Error::Shard(e) => Some(e.code()),
            Error::Protocol(e) => Some(e.code()),
            Error::Net(e) => e.code(),
            Error::ActorGone => Some(ErrorCode::Shutdown),
            Error::Replica(e) => Some(e.code()),
            // A restored clock beyond the maximum is a bad checkpoint, a local failure.
            Error::Clock(ClockError::Unbounded { .. })
            | Error::Optim(_)
            | Error::Restore(_)
            | Error::Checkpoint(_)
            | Error::CheckpointKey(_)
            | Error::Remote(_)
            | Error::Config(_)
            | Error::Threads { .. }
            | Error::Address(_) => None,
        }
    }
}

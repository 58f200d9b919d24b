//! Replication of one shard from its primary to its standby, in the shape of raft-rs and openraft: the
//! [`log`] (entries: the protocol's own [`Input`](crate::protocol::Input)s, numbered), the state [`image`] a standby
//! starts from, the [`primary`]'s side (numbering and queueing entries) and the [`standby`]'s side (feeding them to
//! the same [`ShardProtocol::handle`](crate::protocol::ShardProtocol::handle)). A node's [`Role`] is one enum,
//! held once by its actor and published as a [`RoleKind`] to the connection tasks and the node. One vocabulary:
//! a shard has a primary, which serves, and a standby, which follows the primary's log and takes over when the
//! fence lets it. Everything here is pure: the actor and the node's replication sessions move the bytes.

pub mod ack_watch;
pub mod image;
pub mod log;
pub mod primary;
pub mod standby;

pub use log::{config_digest, decode, encode, state_digest, Entry, EntryRef, ReplicaError};
pub use primary::{Dropped, Primary, LOG_QUEUE};
pub use standby::Standby;

/// What a shard node is now.
#[derive(Debug)]
pub enum Role {
    /// It follows a primary's log (or, not yet seeded, is finding its role): it serves nobody.
    Standby(Standby),
    /// It serves (a fenced one only while it holds the lease), logging every input.
    Primary(Primary),
}

/// A [`Role`] as published to whoever needs to know it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoleKind {
    /// Finding its role: no state of a primary yet.
    Finding,
    /// Following a primary's log.
    Standby,
    /// Serving.
    Primary,
}

impl Role {
    /// The published form.
    pub fn kind(&self) -> RoleKind {
        match self {
            Role::Standby(s) if s.is_seeded() => RoleKind::Standby,
            Role::Standby(_) => RoleKind::Finding,
            Role::Primary(_) => RoleKind::Primary,
        }
    }

    /// Whether it serves workers (the fence's lease aside).
    pub fn is_primary(&self) -> bool {
        matches!(self, Role::Primary(_))
    }
}

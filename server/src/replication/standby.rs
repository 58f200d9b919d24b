//! The standby's side of the log, pure: a [`Standby`] feeds its primary's entries, in order, to the same
//! [`ShardProtocol::handle`] the primary fed, refusing gaps, repeats, time running backwards and push bodies that
//! are not valid frames before anything changes. No sockets: the node's replication session reads the entries off
//! the stream and hands them to the actor, which holds the standby as its [`Role`](super::Role).

use crate::protocol::{ConnId, Handled, ShardProtocol};

use super::log::{Entry, ReplicaError};

/// A standby: the log applied so far (or none, while the node is finding its role).
#[derive(Debug, Default)]
pub struct Standby {
    seeded: bool,
    applied: u64,
    last_now_ms: u64,
    max_conn: ConnId,
}

impl Standby {
    /// A node that holds no primary's state yet (finding its role).
    pub fn new() -> Standby {
        Standby::default()
    }

    /// A standby of a log that continues a state image taken at `now_ms` at log position `seq` (see
    /// [`super::image`]): the first entry due is `seq + 1`, and time may not run back before the image's.
    pub fn seeded(now_ms: u64, max_conn: ConnId, seq: u64) -> Standby {
        Standby {
            seeded: true,
            applied: seq,
            last_now_ms: now_ms,
            max_conn,
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

    /// Feeds `entry` to `proto` if it is the next one, then drains its actions (a standby sends no replies;
    /// draining builds them at the same point of the log, which cuts the public copy as the primary did). Returns
    /// the entry's number.
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
        // A push body is validated before the protocol changes anything, so a bad one changes nothing.
        if let Handled::BadFrame(e) = proto.handle(&entry.input) {
            return Err(ReplicaError::BadPush(e.to_string()));
        }
        while proto.poll_action().is_some() {}
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

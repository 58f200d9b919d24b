//! The primary's side of the log: a [`Primary`] numbers every input before the protocol takes it (a fenced shard
//! numbers every input, so that a reply never waits for less than the input that made it) and, while a standby
//! follows, queues each encoded entry on its bounded link. A standby that falls a whole queue behind, or whose
//! link is gone, is dropped: the primary serves on without it (once the fence records that it serves alone). No
//! sockets: the connection task of the standby's link takes the entries off the queue.

use tokio::sync::mpsc;

use crate::protocol::Input;

use super::log::{encode, EntryRef, ReplicaError};

/// The log bound: a standby this many entries behind is dropped (the primary serves on without it, fenced).
pub const LOG_QUEUE: usize = 4096;

/// The queue to the standby while one follows.
#[derive(Debug)]
struct Link {
    log: mpsc::Sender<Vec<u8>>,
    id: u64,
}

/// Why the standby was dropped while an input was recorded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Dropped {
    /// The entry could not be encoded.
    #[error("cannot encode a replication entry: {0}")]
    Encode(String),
    /// The standby is a whole [`LOG_QUEUE`] behind.
    #[error("the standby fell a whole log queue behind")]
    Behind,
    /// The link's other end is gone.
    #[error("replication link gone")]
    Gone,
}

/// A serving node's side of the replication log.
#[derive(Debug, Default)]
pub struct Primary {
    /// Whether every input is numbered (a fenced shard), or only while a standby follows.
    numbered: bool,
    seq: u64,
    standby: Option<Link>,
    links: u64,
}

impl Primary {
    /// A primary whose log continues at `seq + 1`; `fenced` numbers every input, standby or not.
    pub fn new(fenced: bool, seq: u64) -> Primary {
        Primary {
            numbered: fenced,
            seq,
            ..Primary::default()
        }
    }

    /// The newest log position.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// Whether replies wait for something (a standby's acknowledgement or the fence).
    pub fn gates(&self) -> bool {
        self.numbered || self.standby.is_some()
    }

    /// The link id of the standby that follows, if one does.
    pub fn standby(&self) -> Option<u64> {
        self.standby.as_ref().map(|l| l.id)
    }

    /// A standby starts following from an image at [`seq`](Self::seq): entries from here go to the returned queue.
    pub fn attach(&mut self) -> (u64, mpsc::Receiver<Vec<u8>>) {
        let (tx, rx) = mpsc::channel(LOG_QUEUE);
        self.links += 1;
        self.standby = Some(Link {
            log: tx,
            id: self.links,
        });
        (self.links, rx)
    }

    /// Drops the standby of link `id` (any link: `None`); whether one was dropped.
    pub fn detach(&mut self, id: Option<u64>) -> bool {
        if self
            .standby
            .as_ref()
            .is_some_and(|l| id.is_none_or(|id| l.id == id))
        {
            self.standby = None;
            return true;
        }
        false
    }

    /// Numbers `input` and queues it for the standby, if one follows. On `Err` the standby was dropped (the input
    /// is numbered all the same).
    pub fn record(&mut self, input: &Input) -> Result<(), Dropped> {
        if !self.gates() {
            return Ok(());
        }
        self.seq += 1;
        let Some(link) = self.standby.as_ref() else {
            return Ok(());
        };
        // The queue owns each encoded entry: one buffer per entry, written once.
        let mut encoded = Vec::new();
        let entry = EntryRef {
            seq: self.seq,
            input,
        };
        let sent = match encode(&entry, &mut encoded) {
            Err(ReplicaError::Decode(e)) => Err(Dropped::Encode(e)),
            Err(e) => Err(Dropped::Encode(e.to_string())),
            Ok(()) => link.log.try_send(encoded).map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => Dropped::Behind,
                mpsc::error::TrySendError::Closed(_) => Dropped::Gone,
            }),
        };
        if sent.is_err() {
            self.standby = None;
        }
        sent
    }
}

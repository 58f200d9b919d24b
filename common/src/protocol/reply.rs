//! The header every pull reply carries, full ([`super::ParamReply`]) or delta ([`super::DeltaHeader`]): which pull it
//! answers and what the shard reports with it. One type for both, so the worker's state machine judges every reply
//! by the same fields.
//!
//! A received header is only read through its archived form inside a validated frame; [`ArchivedReplyHeader::get`]
//! copies it out as native values.

use super::ProtocolError;

/// Which pull a reply answers and the shard state it reports (the fields full and delta replies share).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Default, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize,
)]
#[rkyv(derive(Debug))]
pub struct ReplyHeader {
    /// Answering shard.
    pub shard: u32,
    /// The request this answers (`Control::PullRequest::request`).
    pub request: u64,
    /// The clock of the pull this answers.
    pub clock: u64,
    /// Shard version of the values (for a delta reply: the version its cut was taken at, the read version of
    /// gradients computed from it).
    pub version: u64,
    /// Where the shard's SSP gate stood when answered: the minimum clock over live workers, or with quorum rounds
    /// the first round not yet closed.
    pub min_clock: u64,
    /// Loss-spike rollbacks this shard made (its trajectory epoch): a change tells the worker to drop what it built
    /// on the old trajectory (error-feedback residual, inner optimizer state).
    pub epoch: u64,
    /// First global index covered.
    pub range_start: u64,
    /// One past the last global index covered.
    pub range_end: u64,
    /// The fence term of the node that answered (0: an unreplicated shard). A worker uses a reply only when this is
    /// the term its connection was welcomed in, so a deposed node's answer is never taken.
    pub term: u64,
}

impl ArchivedReplyHeader {
    /// The header as native values.
    pub fn get(&self) -> ReplyHeader {
        ReplyHeader {
            shard: self.shard.to_native(),
            request: self.request.to_native(),
            clock: self.clock.to_native(),
            version: self.version.to_native(),
            min_clock: self.min_clock.to_native(),
            epoch: self.epoch.to_native(),
            range_start: self.range_start.to_native(),
            range_end: self.range_end.to_native(),
            term: self.term.to_native(),
        }
    }

    /// The covered range `(start, end)`.
    pub fn range(&self) -> (u64, u64) {
        (self.range_start.to_native(), self.range_end.to_native())
    }

    /// Checks that the reply covers exactly `start..end` (the range the worker expects from this shard).
    pub fn check_range(&self, start: u64, end: u64) -> Result<(), ProtocolError> {
        let (got_start, got_end) = self.range();
        if got_start != start || got_end != end {
            return Err(ProtocolError::BadRange {
                start,
                end,
                got_start,
                got_end,
            });
        }
        Ok(())
    }
}

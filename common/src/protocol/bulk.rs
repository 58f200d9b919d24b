//! Bulk frames: gradient pushes and parameter replies, encoded with rkyv 0.8 and read back with validation.
//!
//! A received body is only ever looked at through [`access_push`] / [`access_params`], which run rkyv's
//! bytecheck validation over an aligned buffer (a misaligned or malformed buffer is a
//! [`ProtocolError::ValidationFailed`], never undefined behaviour or a panic). The codec frame inside a push is
//! opaque bytes here; the codec crate decodes it against the shard range.

use rkyv::rancor;
use rkyv::util::AlignedVec;

use super::{Precision, ProtocolError, ReplyHeader};

/// One worker's encoded gradient for one shard's range at one clock.
#[derive(Debug, Clone, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
#[rkyv(derive(Debug))]
pub struct PushFrame {
    /// The pushing worker's rank.
    pub worker: u32,
    /// The push round (the worker's clock when it computed this gradient).
    pub clock: u64,
    /// Target shard.
    pub shard: u32,
    /// First global index covered (must equal the shard's range start).
    pub range_start: u64,
    /// One past the last global index covered (must equal the shard's range end).
    pub range_end: u64,
    /// Shard version of the parameters the gradient was computed from (for staleness).
    pub read_version: u64,
    /// The worker's training loss for this step (reporting only).
    pub loss: f32,
    /// A skip marker: the worker finished round `clock` without an update (`payload` is empty). It travels on the
    /// push path so that it stays ordered with the pushes.
    pub skip: bool,
    /// The codec frame (opaque here).
    pub payload: Vec<u8>,
}

/// A shard's parameters sent in answer to a pull.
#[derive(Debug, Clone, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
#[rkyv(derive(Debug))]
pub struct ParamReply {
    /// Which pull this answers and what the shard reports with it (shared with delta replies).
    pub header: ReplyHeader,
    /// Encoding of `values`.
    pub precision: Precision,
    /// Little-endian f32 or bf16 values, `(range_end - range_start) * precision.width()` bytes.
    pub values: Vec<u8>,
}

/// The scalar fields of a validated push, copied out of the archive.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PushMeta {
    /// The pushing worker's rank.
    pub worker: u32,
    /// The push round.
    pub clock: u64,
    /// Target shard.
    pub shard: u32,
    /// Range start.
    pub range_start: u64,
    /// Range end.
    pub range_end: u64,
    /// Version the gradient was computed from.
    pub read_version: u64,
    /// Reported loss.
    pub loss: f32,
    /// A skip marker.
    pub skip: bool,
}

impl ArchivedPushFrame {
    /// The scalar fields as native values.
    pub fn meta(&self) -> PushMeta {
        PushMeta {
            worker: self.worker.to_native(),
            clock: self.clock.to_native(),
            shard: self.shard.to_native(),
            range_start: self.range_start.to_native(),
            range_end: self.range_end.to_native(),
            read_version: self.read_version.to_native(),
            loss: self.loss.to_native(),
            skip: self.skip,
        }
    }

    /// The codec frame bytes.
    pub fn payload(&self) -> &[u8] {
        self.payload.as_slice()
    }

    /// Checks that the push targets `shard` and exactly the range `start..end`.
    pub fn check_target(&self, shard: u32, start: u64, end: u64) -> Result<(), ProtocolError> {
        let meta = self.meta();
        if meta.shard != shard {
            return Err(ProtocolError::WrongShard {
                expected: shard,
                got: meta.shard,
            });
        }
        if meta.range_start != start || meta.range_end != end {
            return Err(ProtocolError::BadRange {
                start,
                end,
                got_start: meta.range_start,
                got_end: meta.range_end,
            });
        }
        Ok(())
    }
}

impl ArchivedParamReply {
    /// The wire precision of the values.
    pub fn precision(&self) -> Precision {
        Precision::from(&self.precision)
    }

    /// The raw little-endian value bytes.
    pub fn values(&self) -> &[u8] {
        self.values.as_slice()
    }

    /// Checks that the reply covers `start..end` with exactly as many value bytes as its precision needs.
    pub fn check_shape(&self, start: u64, end: u64) -> Result<(), ProtocolError> {
        self.header.check_range(start, end)?;
        let expected = end
            .saturating_sub(start)
            .saturating_mul(self.precision().width() as u64);
        if self.values.len() as u64 != expected {
            return Err(ProtocolError::ValidationFailed(format!(
                "{} value bytes for {} parameters at {:?}",
                self.values.len(),
                end.saturating_sub(start),
                self.precision()
            )));
        }
        Ok(())
    }
}

fn encode_into<T>(value: &T, buf: &mut AlignedVec) -> Result<(), ProtocolError>
where
    T: for<'a> rkyv::Serialize<
        rkyv::api::high::HighSerializer<
            AlignedVec,
            rkyv::ser::allocator::ArenaHandle<'a>,
            rancor::Error,
        >,
    >,
{
    let mut out = std::mem::take(buf);
    out.clear();
    *buf = rkyv::api::high::to_bytes_in::<_, rancor::Error>(value, out).map_err(|e| {
        ProtocolError::Rejected {
            code: super::ErrorCode::Internal,
            message: format!("rkyv encode: {e}"),
        }
    })?;
    Ok(())
}

/// Encodes a push frame body.
pub fn encode_push(frame: &PushFrame) -> Result<AlignedVec, ProtocolError> {
    let mut buf = AlignedVec::with_capacity(frame.payload.len() + 128);
    encode_into(frame, &mut buf)?;
    Ok(buf)
}

/// Encodes a push frame body into `buf` (cleared first), reusing its allocation.
pub fn encode_push_into(frame: &PushFrame, buf: &mut AlignedVec) -> Result<(), ProtocolError> {
    encode_into(frame, buf)
}

/// Encodes a parameter reply body.
pub fn encode_params(reply: &ParamReply) -> Result<AlignedVec, ProtocolError> {
    let mut buf = AlignedVec::with_capacity(reply.values.len() + 128);
    encode_into(reply, &mut buf)?;
    Ok(buf)
}

/// Encodes a parameter reply body into `buf` (cleared first), reusing its allocation.
pub fn encode_params_into(reply: &ParamReply, buf: &mut AlignedVec) -> Result<(), ProtocolError> {
    encode_into(reply, buf)
}

fn validation(e: rancor::Error) -> ProtocolError {
    ProtocolError::ValidationFailed(e.to_string())
}

/// Validates a push body in place (the slice must start 16-byte aligned, as an [`AlignedVec`] does).
pub fn access_push(bytes: &[u8]) -> Result<&ArchivedPushFrame, ProtocolError> {
    rkyv::access::<ArchivedPushFrame, rancor::Error>(bytes).map_err(validation)
}

/// Validates a parameter reply body in place (the slice must start 16-byte aligned).
pub fn access_params(bytes: &[u8]) -> Result<&ArchivedParamReply, ProtocolError> {
    rkyv::access::<ArchivedParamReply, rancor::Error>(bytes).map_err(validation)
}

/// Validates and copies a push body from any slice (copies into an aligned buffer first).
pub fn decode_push(bytes: &[u8]) -> Result<PushFrame, ProtocolError> {
    let mut aligned = AlignedVec::<16>::with_capacity(bytes.len());
    aligned.extend_from_slice(bytes);
    let archived = access_push(&aligned)?;
    rkyv::deserialize::<PushFrame, rancor::Error>(archived).map_err(validation)
}

/// Validates and copies a parameter reply body from any slice (copies into an aligned buffer first).
pub fn decode_params(bytes: &[u8]) -> Result<ParamReply, ProtocolError> {
    let mut aligned = AlignedVec::<16>::with_capacity(bytes.len());
    aligned.extend_from_slice(bytes);
    let archived = access_params(&aligned)?;
    rkyv::deserialize::<ParamReply, rancor::Error>(archived).map_err(validation)
}

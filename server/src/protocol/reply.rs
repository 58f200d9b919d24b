//! Finished pull replies: the frame bodies [`super::ShardProtocol`] hands its shell, byte for byte what goes on the
//! wire after the frame header. A full reply is one rkyv [`ParamReply`] of the weights at the pull's precision; a
//! delta reply is its per-reply preamble and [`DeltaHeader`] followed by the shared bytes of the public copy's cuts
//! (no copy per worker). Pure functions of their inputs: no sockets, no clocks.

use bytes::Bytes;
use tether_common::protocol::{
    encode_delta_preamble, encode_params_into, encode_values, DeltaHeader, DeltaKind, FrameKind,
    ParamReply, Precision, ProtocolError, PublicRef, ReplyHeader,
};

use crate::public::{Answer, DELTA_CHUNK};
use crate::shard::PublicAnswer;

/// A finished pull reply: the frame kind and the frame body as chunks (their concatenation is the body).
#[derive(Debug, Clone, PartialEq)]
pub struct WireReply {
    /// `Params` (full values) or `Delta` (the public copy).
    pub kind: FrameKind,
    /// The frame body, in order.
    pub chunks: Vec<Bytes>,
    /// Bytes of values or deltas in it (the body less its headers), for the shard's pulled-bytes counter.
    pub payload_bytes: u64,
    /// The header the body carries, as native values (for the shell's logs and for tests; the worker reads the
    /// bytes).
    pub header: ReplyHeader,
    /// For a delta reply, the public cut it leaves the worker holding.
    pub public: Option<PublicRef>,
}

impl WireReply {
    /// Length of the frame body.
    pub fn len(&self) -> usize {
        self.chunks.iter().map(Bytes::len).sum()
    }

    /// Whether the body is empty (never, for a reply built here).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The full reply to the pull `header` names: `weights` as little-endian values in `precision`. `scratch` holds
/// the converted values between calls, so its allocation is reused.
pub fn full_reply(
    header: ReplyHeader,
    weights: &[f32],
    precision: Precision,
    scratch: &mut Vec<u8>,
) -> Result<WireReply, ProtocolError> {
    let mut reply = ParamReply {
        header,
        precision,
        values: std::mem::take(scratch),
    };
    encode_values(weights, precision, &mut reply.values);
    let payload_bytes = reply.values.len() as u64;
    let mut body = rkyv::util::AlignedVec::with_capacity(reply.values.len() + 128);
    let encoded = encode_params_into(&reply, &mut body);
    *scratch = reply.values;
    encoded?;
    Ok(WireReply {
        kind: FrameKind::Params,
        chunks: vec![Bytes::from_owner(body)],
        payload_bytes,
        header,
        public: None,
    })
}

/// The delta reply to the pull `header` names from the public copy's `answer` (its `version` replaces the
/// header's: a delta carries the version its cut was taken at). The preamble is per reply; the chunks after it are
/// the shared bytes of the cuts (or of the whole copy).
pub fn delta_reply(
    mut header: ReplyHeader,
    answer: PublicAnswer,
) -> Result<WireReply, ProtocolError> {
    header.version = answer.version;
    let newest = answer.newest;
    let (kind, base, frames, cuts) = match answer.answer {
        Answer::NotModified => (DeltaKind::NotModified, newest.seq, Vec::new(), Vec::new()),
        Answer::Full(b) => (DeltaKind::Full, newest.seq, vec![b.len() as u32], vec![b]),
        Answer::Deltas { base, cuts, lens } => (DeltaKind::Deltas, base, lens, cuts),
    };
    let len = header.range_end.saturating_sub(header.range_start).max(1);
    let delta = DeltaHeader {
        header,
        lineage: newest.lineage,
        base,
        seq: newest.seq,
        kind,
        chunk: DELTA_CHUNK.min(usize::try_from(len).unwrap_or(usize::MAX)) as u32,
        frames,
    };
    let payload_bytes = cuts.iter().map(|c| c.len() as u64).sum();
    let mut chunks = Vec::with_capacity(cuts.len() + 1);
    chunks.push(encode_delta_preamble(&delta)?);
    chunks.extend(cuts);
    Ok(WireReply {
        kind: FrameKind::Delta,
        chunks,
        payload_bytes,
        header,
        public: Some(newest),
    })
}

//! Stream framing: every frame is `[u32 LE body length][u8 kind][body]`.
//!
//! Invariants: a header is checked against the limit for its kind before any buffer is sized from it, and the
//! reader then reads exactly that many bytes, so no allocation is ever sized by an unchecked field. A stream that
//! ends early is [`ProtocolError::Truncated`]. The only I/O here is through a generic `AsyncRead`; the same checks
//! are available over an in-memory slice ([`split_frame`]).

use rkyv::util::AlignedVec;
use tokio::io::{AsyncRead, AsyncReadExt};

use super::control::MAX_CONTROL_BYTES;
use super::ProtocolError;

/// Bytes in a frame header.
pub const HEADER_LEN: usize = 5;

/// Room for rkyv's fixed fields, alignment padding and root pointer around a bulk frame's byte vector.
pub const BULK_FRAME_SLACK: usize = 256;

/// What a frame's body is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameKind {
    /// A bincode [`super::Control`] message.
    Control = 1,
    /// An rkyv [`super::PushFrame`].
    Push = 2,
    /// An rkyv [`super::ParamReply`].
    Params = 3,
    /// A delta reply: an rkyv [`super::DeltaHeader`] and the codec frames it lists ([`super::delta`]).
    Delta = 4,
    /// One entry of a shard's replication log, primary to standby (bincode; see the server's `replica` module).
    Replica = 5,
    /// A state image of a shard, primary to standby, once before its log (bincode; the server's `image` module).
    ReplicaImage = 6,
}

impl FrameKind {
    /// The kind for a header byte, if assigned.
    pub fn from_u8(byte: u8) -> Option<FrameKind> {
        match byte {
            1 => Some(FrameKind::Control),
            2 => Some(FrameKind::Push),
            3 => Some(FrameKind::Params),
            4 => Some(FrameKind::Delta),
            5 => Some(FrameKind::Replica),
            6 => Some(FrameKind::ReplicaImage),
            _ => None,
        }
    }
}

/// A state image holds at most this many f32 copies of the range (see [`FrameKind::ReplicaImage`]).
const IMAGE_COPIES: usize = 64;

/// Room in a state image for what is not a copy of the range (members, windows, counters).
const IMAGE_SLACK: usize = 64 << 20;

/// Largest body accepted per frame kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameLimits {
    /// Largest control body.
    pub control: usize,
    /// Largest push body.
    pub push: usize,
    /// Largest parameter-reply body.
    pub params: usize,
}

impl FrameLimits {
    /// Limits for a shard of `range_len` parameters whose codec frames are at most `max_push_payload` bytes
    /// (`codec::max_encoded_len` for the range). Replies are sized for f32 values; all limits fit a u32.
    pub fn for_shard(range_len: u64, max_push_payload: usize) -> FrameLimits {
        let cap = u32::MAX as u64;
        let push = (max_push_payload as u64)
            .saturating_add(BULK_FRAME_SLACK as u64)
            .min(cap);
        let params = range_len
            .saturating_mul(4)
            .saturating_add(BULK_FRAME_SLACK as u64)
            .min(cap);
        FrameLimits {
            control: MAX_CONTROL_BYTES,
            push: usize::try_from(push).unwrap_or(usize::MAX),
            params: usize::try_from(params).unwrap_or(usize::MAX),
        }
    }

    /// Limits for a shard of `range_len` parameters whose pushes are encoded with `codec`.
    pub fn for_codec(codec: &crate::codec::CodecConfig, range_len: usize) -> FrameLimits {
        FrameLimits::for_shard(
            range_len as u64,
            crate::codec::max_encoded_len(codec, range_len),
        )
    }

    /// The limit for one kind.
    pub fn limit(&self, kind: FrameKind) -> usize {
        match kind {
            FrameKind::Control => self.control,
            FrameKind::Push => self.push,
            FrameKind::Params => self.params,
            // A delta reply never carries more payload than a full f32 reply (the shard sends the full copy
            // instead); its header lists at most MAX_DELTA_FRAMES frame lengths.
            FrameKind::Delta => self
                .params
                .saturating_add(super::delta::MAX_DELTA_HEADER_BYTES),
            // A log entry carries at most one push frame besides its few control fields.
            FrameKind::Replica => self.push.saturating_add(self.control),
            // Weights, optimizer slots, the public copy and its delta log, rollback snapshots: a few dozen f32
            // copies of the range at most, plus the members' windows.
            FrameKind::ReplicaImage => self
                .params
                .saturating_mul(IMAGE_COPIES)
                .saturating_add(IMAGE_SLACK)
                .min(u32::MAX as usize),
        }
    }
}

/// A checked frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// The body's kind.
    pub kind: FrameKind,
    /// The body's length (within the kind's limit).
    pub len: usize,
}

impl FrameHeader {
    /// Encodes a header for a body of `len` bytes.
    pub fn encode(kind: FrameKind, len: usize) -> Result<[u8; HEADER_LEN], ProtocolError> {
        let len32 = u32::try_from(len).map_err(|_| ProtocolError::Oversized {
            kind: kind as u8,
            len: len as u64,
            limit: u32::MAX as u64,
        })?;
        let mut out = [0u8; HEADER_LEN];
        out[..4].copy_from_slice(&len32.to_le_bytes());
        out[4] = kind as u8;
        Ok(out)
    }

    /// Decodes a header, checking the kind is known and allowed here and the length is within its limit.
    pub fn decode(
        bytes: [u8; HEADER_LEN],
        limits: &FrameLimits,
        allowed: &[FrameKind],
    ) -> Result<FrameHeader, ProtocolError> {
        let len = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
        let kind = FrameKind::from_u8(bytes[4])
            .ok_or_else(|| ProtocolError::BadFrame(format!("unknown frame kind {}", bytes[4])))?;
        if !allowed.contains(&kind) {
            return Err(ProtocolError::UnexpectedMessage(format!(
                "{kind:?} frame on a stream for {allowed:?}"
            )));
        }
        let limit = limits.limit(kind);
        if len as u64 > limit as u64 {
            return Err(ProtocolError::Oversized {
                kind: kind as u8,
                len: len as u64,
                limit: limit as u64,
            });
        }
        Ok(FrameHeader {
            kind,
            len: len as usize,
        })
    }
}

/// Header plus body as one buffer (for tests, tools and small control frames).
pub fn encode_frame(kind: FrameKind, body: &[u8]) -> Result<Vec<u8>, ProtocolError> {
    let header = FrameHeader::encode(kind, body.len())?;
    let mut out = Vec::with_capacity(HEADER_LEN + body.len());
    out.extend_from_slice(&header);
    out.extend_from_slice(body);
    Ok(out)
}

/// Splits one frame off the front of `bytes`: `(kind, body, rest)`.
pub fn split_frame<'a>(
    bytes: &'a [u8],
    limits: &FrameLimits,
    allowed: &[FrameKind],
) -> Result<(FrameKind, &'a [u8], &'a [u8]), ProtocolError> {
    let Some((head, rest)) = bytes.split_first_chunk::<HEADER_LEN>() else {
        return Err(ProtocolError::Truncated {
            expected: HEADER_LEN as u64,
            got: bytes.len() as u64,
        });
    };
    let header = FrameHeader::decode(*head, limits, allowed)?;
    if rest.len() < header.len {
        return Err(ProtocolError::Truncated {
            expected: header.len as u64,
            got: rest.len() as u64,
        });
    }
    let (body, rest) = rest.split_at(header.len);
    Ok((header.kind, body, rest))
}

/// Why [`read_frame`] failed: the peer's bytes, or the stream underneath.
#[derive(Debug, thiserror::Error)]
pub enum ReadFrameError {
    /// The bytes violate the protocol.
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    /// The stream failed (reset, connection lost).
    #[error("stream read failed: {0}")]
    Io(#[from] std::io::Error),
}

/// Reads up to `buf.len()` bytes; returns how many were read before the stream ended.
async fn read_full<R: AsyncRead + Unpin>(reader: &mut R, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        let n = reader.read(&mut buf[filled..]).await?;
        if n == 0 {
            break;
        }
        filled += n;
    }
    Ok(filled)
}

/// Capacity a frame buffer keeps whatever the frames it reads (larger buffers are freed when a frame needs less
/// than a quarter of them).
pub const FRAME_KEEP: usize = 1 << 20;

/// Reads one frame into `body` (cleared, then sized to the checked length). Returns `None` when the stream
/// ends cleanly before a header starts.
pub async fn read_frame<R: AsyncRead + Unpin>(
    reader: &mut R,
    limits: &FrameLimits,
    allowed: &[FrameKind],
    body: &mut AlignedVec,
) -> Result<Option<FrameKind>, ReadFrameError> {
    let mut head = [0u8; HEADER_LEN];
    let got = read_full(reader, &mut head).await?;
    if got == 0 {
        return Ok(None);
    }
    if got < HEADER_LEN {
        return Err(ProtocolError::Truncated {
            expected: HEADER_LEN as u64,
            got: got as u64,
        }
        .into());
    }
    let header = FrameHeader::decode(head, limits, allowed)?;
    body.clear();
    // Exactly the frame's length (a growing AlignedVec rounds up to a power of two), and a buffer left large by an
    // earlier frame (a worker's first, whole-model pull reply) is given back once frames are much smaller.
    if body.capacity() > FRAME_KEEP.max(header.len.saturating_mul(4)) {
        *body = AlignedVec::new();
    }
    body.reserve_exact(header.len);
    body.resize(header.len, 0);
    let got = read_full(reader, &mut body[..]).await?;
    if got < header.len {
        body.clear();
        return Err(ProtocolError::Truncated {
            expected: header.len as u64,
            got: got as u64,
        }
        .into());
    }
    Ok(Some(header.kind))
}

/// Checks that `reader` has no bytes left (one-frame streams); trailing bytes are [`ProtocolError::BadFrame`].
pub async fn expect_end<R: AsyncRead + Unpin>(reader: &mut R) -> Result<(), ReadFrameError> {
    let mut probe = [0u8; 1];
    match reader.read(&mut probe).await? {
        0 => Ok(()),
        _ => Err(ProtocolError::BadFrame("trailing bytes after the frame".into()).into()),
    }
}

//! Delta replies: a shard answers a pull with its *public copy* — the weights every worker holds — as the codec
//! frames that take the worker's copy to the newest cut, as the whole copy in f32 when the worker holds none (or
//! one too old), or as "not modified".
//!
//! Body layout: `[u32 LE header length H][12 zero bytes][rkyv DeltaHeader: H bytes][payload]`. The header starts
//! 16-byte aligned inside an aligned body, so it is validated in place; the payload is the concatenation of the
//! frames the header lists. A shard encodes each cut once and sends the same bytes to every worker (the preamble is
//! per reply, the payload chunks are shared). [`access_delta`] checks everything against the worker's shard range
//! before any value is read.

use bytes::Bytes;
use rkyv::rancor;
use rkyv::util::AlignedVec;

use super::{ProtocolError, ReplyHeader};

/// Most frame lengths one header may list (cuts × chunks per cut).
pub const MAX_DELTA_FRAMES: usize = 4096;

/// Bound on a delta reply's preamble and header, beyond its payload.
pub const MAX_DELTA_HEADER_BYTES: usize = 16 + 256 + 4 * MAX_DELTA_FRAMES;

const PREAMBLE: usize = 16;

/// What a delta reply carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
#[rkyv(derive(Debug, Clone, Copy, PartialEq, Eq))]
#[repr(u8)]
pub enum DeltaKind {
    /// The worker's copy is the newest cut: nothing follows.
    NotModified,
    /// Codec frames taking cut `base` to cut `seq`: for each cut in order, one frame per chunk of `chunk` values.
    Deltas,
    /// The whole public copy at `seq` as little-endian f32.
    Full,
}

/// The header of a delta reply.
#[derive(Debug, Clone, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
#[rkyv(derive(Debug))]
pub struct DeltaHeader {
    /// Which pull this answers and what the shard reports with it (shared with full replies; `version` is the
    /// version the cut `seq` was taken at).
    pub header: ReplyHeader,
    /// The shard incarnation the cuts belong to.
    pub lineage: u64,
    /// The cut the deltas start from (the worker's copy); unused for `Full`.
    pub base: u64,
    /// The cut the worker holds after applying this reply.
    pub seq: u64,
    /// What follows.
    pub kind: DeltaKind,
    /// Values per delta frame (the last frame of a cut may be shorter).
    pub chunk: u32,
    /// Byte length of each payload frame, in order.
    pub frames: Vec<u32>,
}

/// Encodes the per-reply part of a delta reply body: preamble and header. The payload chunks follow it on the
/// stream.
pub fn encode_delta_preamble(header: &DeltaHeader) -> Result<Bytes, ProtocolError> {
    if header.frames.len() > MAX_DELTA_FRAMES {
        return Err(ProtocolError::Rejected {
            code: super::ErrorCode::Internal,
            message: format!("{} delta frames in one reply", header.frames.len()),
        });
    }
    let archived =
        rkyv::to_bytes::<rancor::Error>(header).map_err(|e| ProtocolError::Rejected {
            code: super::ErrorCode::Internal,
            message: format!("rkyv encode: {e}"),
        })?;
    let mut out = Vec::with_capacity(PREAMBLE + archived.len());
    // Bounded by MAX_DELTA_FRAMES above, so the length fits a u32.
    out.extend_from_slice(&(archived.len() as u32).to_le_bytes());
    out.extend_from_slice(&[0u8; PREAMBLE - 4]);
    out.extend_from_slice(&archived);
    Ok(Bytes::from(out))
}

/// A validated delta reply.
#[derive(Debug)]
pub struct DeltaView<'a> {
    /// The header.
    pub header: &'a ArchivedDeltaHeader,
    /// The payload frames, concatenated.
    pub payload: &'a [u8],
}

impl DeltaView<'_> {
    /// What the reply carries.
    pub fn kind(&self) -> DeltaKind {
        match self.header.kind {
            ArchivedDeltaKind::NotModified => DeltaKind::NotModified,
            ArchivedDeltaKind::Deltas => DeltaKind::Deltas,
            ArchivedDeltaKind::Full => DeltaKind::Full,
        }
    }

    /// The payload frames in order.
    pub fn frames(&self) -> impl Iterator<Item = &[u8]> + '_ {
        let mut at = 0usize;
        self.header.frames.iter().map(move |len| {
            let len = len.to_native() as usize;
            // `access_delta` checked that the lengths sum to the payload length.
            let f = &self.payload[at..at + len];
            at += len;
            f
        })
    }
}

fn invalid(why: String) -> ProtocolError {
    ProtocolError::ValidationFailed(why)
}

/// Validates a delta reply body in place (16-byte aligned, as an [`AlignedVec`] is) against the worker's shard
/// range `start..end`: header, kind, frame count and lengths. Never panics.
pub fn access_delta(
    body: &AlignedVec,
    start: u64,
    end: u64,
) -> Result<DeltaView<'_>, ProtocolError> {
    if body.len() < PREAMBLE {
        return Err(invalid(format!("delta reply of {} bytes", body.len())));
    }
    let hlen = u32::from_le_bytes([body[0], body[1], body[2], body[3]]) as usize;
    if body[4..PREAMBLE].iter().any(|b| *b != 0) {
        return Err(invalid("delta preamble padding is not zero".into()));
    }
    if hlen > body.len() - PREAMBLE || hlen > MAX_DELTA_HEADER_BYTES {
        return Err(invalid(format!(
            "delta header length {hlen} in a {}-byte body",
            body.len()
        )));
    }
    let header =
        rkyv::access::<ArchivedDeltaHeader, rancor::Error>(&body[PREAMBLE..PREAMBLE + hlen])
            .map_err(|e| invalid(e.to_string()))?;
    let payload = &body[PREAMBLE + hlen..];
    header.header.check_range(start, end)?;
    let len = end.saturating_sub(start);
    let frames = header.frames.len();
    if frames > MAX_DELTA_FRAMES {
        return Err(invalid(format!("{frames} delta frames")));
    }
    let total: u64 = header.frames.iter().map(|l| u64::from(l.to_native())).sum();
    if total != payload.len() as u64 {
        return Err(invalid(format!(
            "delta frames of {total} bytes in a {}-byte payload",
            payload.len()
        )));
    }
    let (base, seq) = (header.base.to_native(), header.seq.to_native());
    let view = DeltaView { header, payload };
    match view.kind() {
        DeltaKind::NotModified => {
            if frames != 0 || base != seq {
                return Err(invalid(
                    "a not-modified reply with frames or a new cut".into(),
                ));
            }
        }
        DeltaKind::Full => {
            if frames != 1 || total != len.saturating_mul(4) {
                return Err(invalid(format!(
                    "a full reply of {total} bytes for {len} values"
                )));
            }
        }
        DeltaKind::Deltas => {
            let chunk = u64::from(header.chunk.to_native());
            if chunk == 0 || seq <= base {
                return Err(invalid(format!(
                    "deltas {base} -> {seq} in chunks of {chunk}"
                )));
            }
            let per_cut = len.div_ceil(chunk).max(1);
            let expected = (seq - base).checked_mul(per_cut);
            if expected != Some(frames as u64) {
                return Err(invalid(format!(
                    "{frames} delta frames for cuts {base} -> {seq} of {per_cut} chunks"
                )));
            }
        }
    }
    Ok(view)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(kind: DeltaKind, base: u64, seq: u64, frames: Vec<u32>) -> DeltaHeader {
        DeltaHeader {
            header: ReplyHeader {
                shard: 0,
                request: 1,
                clock: 2,
                version: 3,
                min_clock: 1,
                epoch: 0,
                range_start: 10,
                range_end: 110,
                term: 6,
            },
            lineage: 7,
            base,
            seq,
            kind,
            chunk: 64,
            frames,
        }
    }

    fn body(h: &DeltaHeader, payload: &[u8]) -> AlignedVec {
        let mut b = AlignedVec::new();
        b.extend_from_slice(&encode_delta_preamble(h).unwrap());
        b.extend_from_slice(payload);
        b
    }

    #[test]
    fn well_formed_replies_validate_and_list_their_frames() {
        let h = header(DeltaKind::Deltas, 4, 6, vec![3, 1, 2, 2]);
        let b = body(&h, &[1, 2, 3, 4, 5, 6, 7, 8]);
        let v = access_delta(&b, 10, 110).unwrap();
        assert_eq!(v.kind(), DeltaKind::Deltas);
        let frames: Vec<&[u8]> = v.frames().collect();
        assert_eq!(frames, vec![&[1, 2, 3][..], &[4], &[5, 6], &[7, 8]]);
        let full = header(DeltaKind::Full, 0, 6, vec![400]);
        assert!(access_delta(&body(&full, &[0; 400]), 10, 110).is_ok());
        let nm = header(DeltaKind::NotModified, 6, 6, vec![]);
        assert!(access_delta(&body(&nm, &[]), 10, 110).is_ok());
    }

    #[test]
    fn inconsistent_replies_are_refused() {
        // Wrong range, frame count, frame lengths, full size, not-modified with a new cut, cut order.
        let ok = header(DeltaKind::Deltas, 4, 6, vec![3, 1, 2, 2]);
        assert!(access_delta(&body(&ok, &[0; 8]), 10, 111).is_err());
        assert!(access_delta(&body(&ok, &[0; 9]), 10, 110).is_err());
        let few = header(DeltaKind::Deltas, 4, 6, vec![3, 1, 4]);
        assert!(access_delta(&body(&few, &[0; 8]), 10, 110).is_err());
        let back = header(DeltaKind::Deltas, 6, 4, vec![3, 1, 2, 2]);
        assert!(access_delta(&body(&back, &[0; 8]), 10, 110).is_err());
        let full = header(DeltaKind::Full, 0, 6, vec![399]);
        assert!(access_delta(&body(&full, &[0; 399]), 10, 110).is_err());
        let nm = header(DeltaKind::NotModified, 5, 6, vec![]);
        assert!(access_delta(&body(&nm, &[]), 10, 110).is_err());
        // Truncated or garbage bodies.
        let b = body(&ok, &[0; 8]);
        for cut in [0, 3, 15, 16, 40] {
            let mut t = AlignedVec::new();
            t.extend_from_slice(&b[..cut.min(b.len())]);
            assert!(access_delta(&t, 10, 110).is_err(), "cut at {cut}");
        }
        let mut g = b.clone();
        g[0] = 0xff;
        g[1] = 0xff;
        assert!(access_delta(&g, 10, 110).is_err());
    }
}

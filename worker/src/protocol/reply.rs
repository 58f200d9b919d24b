//! Reading pull replies: the frame bodies a shard sends in answer to a pull, validated in place and turned into
//! parameter values. A full reply ([`ParamReply`](tether_common::protocol::ParamReply)) carries the shard's weights
//! in f32 or bf16; a delta reply carries what takes the worker's copy of the shard's public weights to the newest
//! cut. The [`Replica`] holds those public copies; a delta reply is checked whole (decoded chunk by chunk into a
//! scratch of one chunk, every rebuilt value tested) before it is decoded a second time into the copy, so a reply
//! that does not decode changes nothing and no second copy of the model is kept. Pure: bytes in, values out; whether a reply is used at all is the protocol's decision
//! ([`super::WorkerProtocol::handle_reply`]).
//!
//! The shard is not trusted: a reply must name the shard whose link it came on and cover exactly its range, and
//! the values it leaves (a full reply's, or a rebuilt public copy) must be finite, or it is refused with a typed
//! [`ProtocolError`] before anything is written (fuzzed by `fuzz/fuzz_targets/reply_decoder.rs`).

use rkyv::util::AlignedVec;
use tether_common::codec::Decoder;
use tether_common::protocol::{
    access_delta, access_params, check_finite_values, decode_values, DeltaKind, DeltaView,
    ErrorCode, InitialCut, ProtocolError, PublicRef, ReplyHeader,
};

/// A pull reply as the protocol judges it: its header and, for a delta reply, the public cut it leaves the worker
/// holding. The one typed event of the pull path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PullReply {
    /// Which pull it answers and what the shard reports (shared by full and delta replies).
    pub header: ReplyHeader,
    /// For a delta reply, the cut the worker holds once it uses it.
    pub public: Option<PublicRef>,
}

/// The worker's copies of the shards' public weights (delta pulls) and the scratch a reply is checked in.
#[derive(Debug, Default)]
pub struct Replica {
    /// The public copies, indexed like the model (empty before the first delta reply).
    public: Vec<f32>,
    decoder: DeltaDecoder,
}

impl Replica {
    /// The public copies this worker holds, indexed like the model (empty before the first delta reply).
    pub fn values(&self) -> &[f32] {
        &self.public
    }

    /// Writes the initial weights of `layout` with `initial`'s seed over `range` into the copy and returns whether
    /// they are the shard's cut 0 (their CRC is the one the shard announced). On false the values written are not
    /// held by anyone: the caller must not claim them, and the next whole reply overwrites them.
    pub fn adopt_initial(
        &mut self,
        layout: &tether_common::layout::Layout,
        initial: &InitialCut,
        range: (usize, usize),
    ) -> bool {
        let (start, end) = range;
        if end > layout.len() || start > end {
            return false;
        }
        if self.public.len() < end {
            self.public.resize(end, 0.0);
        }
        let copy = &mut self.public[start..end];
        layout.init_range(initial.seed, start..end, copy);
        InitialCut::checksum(copy) == initial.crc32
    }

    /// Checks that a delta reply rebuilds the public copy of `range` (the copy held, named `held`, plus the reply's
    /// deltas, or the reply's whole copy) into finite values, without writing the copy.
    fn check_delta(
        &mut self,
        view: &DeltaView<'_>,
        held: Option<PublicRef>,
        range: (usize, usize),
    ) -> Result<(), ProtocolError> {
        let (start, end) = range;
        if self.public.len() < end {
            self.public.resize(end, 0.0);
        }
        check_base(view, held)?;
        let copy = &mut self.public[start..end];
        rebuild_in_place(view, copy, &mut self.decoder, Pass::Check)
    }

    /// Rebuilds the copy of `range` from a reply [`check_delta`](Self::check_delta) accepted (decoding it again,
    /// into the copy) and copies it into `params`. Decoding is deterministic, so this cannot fail where the check
    /// passed; if it does (a bug), the copy of `range` is no longer known and the error says so.
    fn commit(
        &mut self,
        view: &DeltaView<'_>,
        range: (usize, usize),
        params: &mut [f32],
    ) -> Result<(), ProtocolError> {
        let (start, end) = range;
        let copy = &mut self.public[start..end];
        rebuild_in_place(view, copy, &mut self.decoder, Pass::Apply)?;
        params[start..end].copy_from_slice(copy);
        Ok(())
    }
}

/// What [`rebuild_in_place`] does with the rebuilt values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pass {
    /// Only test that every rebuilt value would be finite.
    Check,
    /// Write them into the copy.
    Apply,
}

/// Refuses deltas that do not start from `held_ref`, the copy the worker holds.
fn check_base(view: &DeltaView<'_>, held_ref: Option<PublicRef>) -> Result<(), ProtocolError> {
    if view.kind() == DeltaKind::Full {
        return Ok(());
    }
    let h = view.header;
    let base = PublicRef {
        lineage: h.lineage.to_native(),
        seq: h.base.to_native(),
    };
    if held_ref != Some(base) {
        return Err(ProtocolError::ValidationFailed(format!(
            "a delta from {base:?} for a worker holding {held_ref:?}"
        )));
    }
    Ok(())
}

/// The public copy `copy` rebuilt by a validated delta reply, chunk by chunk: each chunk of the copy plus, cut
/// after cut, that chunk's frame, in the same order [`rebuild_public`] adds them (so the same bits). With
/// [`Pass::Check`] the sums are built in a one-chunk scratch and only tested for finiteness; with [`Pass::Apply`]
/// they are written into `copy`.
fn rebuild_in_place(
    view: &DeltaView<'_>,
    copy: &mut [f32],
    dec: &mut DeltaDecoder,
    pass: Pass,
) -> Result<(), ProtocolError> {
    let len = copy.len();
    let not_finite = |i: usize| ProtocolError::Rejected {
        code: ErrorCode::NonFinite,
        message: format!("the rebuilt public copy is not finite at {i}"),
    };
    match view.kind() {
        DeltaKind::NotModified => Ok(()),
        DeltaKind::Full => {
            // access_delta checked: one frame of exactly 4 bytes per value.
            let values = view
                .payload
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            match pass {
                Pass::Check => match values.enumerate().find(|(_, v)| !v.is_finite()) {
                    Some((i, _)) => Err(not_finite(i)),
                    None => Ok(()),
                },
                Pass::Apply => {
                    copy.iter_mut().zip(values).for_each(|(d, v)| *d = v);
                    Ok(())
                }
            }
        }
        DeltaKind::Deltas => {
            let chunk = (view.header.chunk.to_native() as usize).min(len.max(1));
            let per_cut = len.div_ceil(chunk).max(1);
            if dec.out.len() < chunk || dec.decoder.is_none() {
                dec.decoder = Some(Decoder::new(chunk));
                dec.out = vec![0.0; chunk];
            }
            if pass == Pass::Check && dec.acc.len() < chunk {
                dec.acc = vec![0.0; chunk];
            }
            // Frame i is cut i / per_cut's delta for chunk i % per_cut.
            dec.frames.clear();
            let mut offset = 0;
            for f in view.frames() {
                dec.frames.push((offset, f.len()));
                offset += f.len();
            }
            let Some(decoder) = dec.decoder.as_mut() else {
                return Ok(()); // unreachable: set just above
            };
            for j in 0..per_cut {
                let at = j * chunk;
                let to = (at + chunk).min(len);
                let acc: &mut [f32] = match pass {
                    Pass::Check => {
                        dec.acc[..to - at].copy_from_slice(&copy[at..to]);
                        &mut dec.acc[..to - at]
                    }
                    Pass::Apply => &mut copy[at..to],
                };
                for (i, &(o, n)) in dec.frames.iter().enumerate().skip(j).step_by(per_cut) {
                    let frame = &view.payload[o..o + n];
                    let d = &mut dec.out[..to - at];
                    decoder.decode(frame, d).map_err(|e| {
                        ProtocolError::ValidationFailed(format!("delta frame {i}: {e}"))
                    })?;
                    for (p, d) in acc.iter_mut().zip(d.iter()) {
                        *p += d;
                    }
                }
                // The codec refuses non-finite deltas, but finite ones can still overflow the copy they add to.
                if let Some(i) = acc.iter().position(|v| !v.is_finite()) {
                    return Err(not_finite(at + i));
                }
            }
            Ok(())
        }
    }
}

/// A reply body read far enough to judge it: its header, and what using it takes.
pub(super) enum Read<'a> {
    /// A full reply: little-endian values in a precision, already checked against the shard range.
    Full {
        /// The header.
        reply: PullReply,
        /// The values, `range × precision.width()` bytes.
        values: &'a [u8],
        /// Their precision.
        precision: tether_common::protocol::Precision,
    },
    /// A delta reply, checked against the replica's copy.
    Delta {
        /// The header and the cut it leaves the worker holding.
        reply: PullReply,
        /// The reply, rebuilt into the copy when used.
        view: DeltaView<'a>,
    },
}

impl Read<'_> {
    /// The reply as the protocol judges it.
    pub(super) fn reply(&self) -> PullReply {
        match self {
            Read::Full { reply, .. } | Read::Delta { reply, .. } => *reply,
        }
    }
}

/// Refuses a reply whose header names another shard than the one whose link it came on.
fn check_shard(header: &ReplyHeader, shard: usize) -> Result<(), ProtocolError> {
    if usize::try_from(header.shard).ok() != Some(shard) {
        return Err(ProtocolError::WrongShard {
            expected: u32::try_from(shard).unwrap_or(u32::MAX),
            got: header.shard,
        });
    }
    Ok(())
}

/// Validates a full reply body in place against `shard` and its range `range`; every value must be finite.
pub(super) fn read_full(
    body: &AlignedVec,
    shard: usize,
    range: (u64, u64),
) -> Result<Read<'_>, ProtocolError> {
    let reply = access_params(body)?;
    reply.check_shape(range.0, range.1)?;
    check_shard(&reply.header.get(), shard)?;
    check_finite_values(reply.values(), reply.precision())?;
    Ok(Read::Full {
        reply: PullReply {
            header: reply.header.get(),
            public: None,
        },
        values: reply.values(),
        precision: reply.precision(),
    })
}

/// Validates a delta reply body in place against `shard` and its range `range` and checks the copy it rebuilds
/// from the replica's (deltas must start from `held`, the copy this worker holds).
pub(super) fn read_delta<'a>(
    body: &'a AlignedVec,
    shard: usize,
    range: (u64, u64),
    held: Option<PublicRef>,
    replica: &mut Replica,
) -> Result<Read<'a>, ProtocolError> {
    let view = access_delta(body, range.0, range.1)?;
    let h = view.header;
    check_shard(&h.header.get(), shard)?;
    let newest = PublicRef {
        lineage: h.lineage.to_native(),
        seq: h.seq.to_native(),
    };
    replica.check_delta(&view, held, (range.0 as usize, range.1 as usize))?;
    Ok(Read::Delta {
        reply: PullReply {
            header: h.header.get(),
            public: Some(newest),
        },
        view,
    })
}

/// Writes a used reply's values into `params` (the shard's `range` of it); a delta reply is rebuilt into the
/// replica's copy first (an error there is a bug, see [`Replica`]'s commit).
pub(super) fn apply(
    read: Read<'_>,
    range: (u64, u64),
    replica: &mut Replica,
    params: &mut [f32],
) -> Result<(), ProtocolError> {
    let range = (range.0 as usize, range.1 as usize);
    match read {
        Read::Full {
            values, precision, ..
        } => {
            decode_values(values, precision, &mut params[range.0..range.1]);
            Ok(())
        }
        Read::Delta { view, .. } => replica.commit(&view, range, params),
    }
}

/// Decoder state for delta replies, sized on first use: one chunk of decoded values, one of rebuilt values (for
/// the check), and the reply's frames.
#[derive(Debug, Default)]
pub struct DeltaDecoder {
    decoder: Option<Decoder>,
    out: Vec<f32>,
    acc: Vec<f32>,
    /// Each frame's (offset, length) in the payload.
    frames: Vec<(usize, usize)>,
}

/// Builds a shard's new public copy from a validated delta reply into `out` (same length as the shard range):
/// `held` (the copy the worker holds, `held_ref` naming it) plus the reply's deltas, or the reply's whole copy.
/// Deltas must start from `held_ref`, and the copy built must be finite (a whole copy with a NaN, or deltas that
/// overflow the copy held, are refused with [`ErrorCode::NonFinite`]). Pure and deterministic: every worker that
/// applies the same reply to the same copy gets the same bits, which are the shard's own. On an error `out` is
/// garbage and `held` is untouched.
pub fn rebuild_public(
    view: &DeltaView<'_>,
    held_ref: Option<PublicRef>,
    held: &[f32],
    out: &mut [f32],
    dec: &mut DeltaDecoder,
) -> Result<(), ProtocolError> {
    check_base(view, held_ref)?;
    out.copy_from_slice(held);
    // The replica's two passes: check every rebuilt value, then write them.
    rebuild_in_place(view, out, dec, Pass::Check)?;
    rebuild_in_place(view, out, dec, Pass::Apply)
}

//! `PublicCopy`: the shard's *public* weights — exactly what every worker holds — and the log of compressed deltas
//! that take one public cut to the next. Plain Rust: it is given the true weights, the version and the minimum clock
//! and returns what to answer a pull with; no sockets, no clocks.
//!
//! Error feedback lives here, on the server side: a cut encodes `w − public` (q4 or q8, in chunks), decodes its own
//! frames and adds the decoded values to `public`, exactly as a worker will. So the next cut carries whatever the
//! last one rounded away, and no separate residual is kept. Decoding is deterministic, so a worker that applies the
//! same frames to the same copy holds the same bits.
//!
//! Cuts are taken sparingly, when a pull is answered and the weights moved since the last cut, and either the
//! minimum clock advanced or a round's worth of updates (one per live worker) arrived — about one delta per step
//! per worker. A cut taken when the minimum clock is `m` holds every update from clocks below `m`, so answering
//! pulls from the newest cut keeps the SSP read guarantee. Each cut is encoded once; its bytes are shared by every
//! reply that needs it (`Bytes`, no copy per worker).
//!
//! A cut runs its chunks as jobs on the shard's [`ChunkPool`]: every chunk is its own frame with its own seed (its
//! index), so the bytes and the public values are the same whatever the thread count.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use bytes::Bytes;

use tether_common::chunk_pool::ChunkPool;
use tether_common::codec::{seed_for, CodecConfig, CodecError, Decoder, Encoder, Scheme};
use tether_common::protocol::PublicRef;

use crate::serde_adapters::{bytes as bytes_serde, shared_values};

/// Values per delta frame.
pub const DELTA_CHUNK: usize = 1 << 16;

/// Most cuts the log keeps.
pub const MAX_LOG_CUTS: usize = 32;

/// One cut in the log.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Cut {
    seq: u64,
    /// The cut's frames, concatenated.
    #[serde(with = "bytes_serde")]
    bytes: Bytes,
    /// Each frame's length.
    lens: Vec<u32>,
}

/// What to answer a delta pull with.
#[derive(Debug, Clone)]
pub enum Answer {
    /// The worker holds the newest cut.
    NotModified,
    /// Frames from the worker's cut `base` to the newest: one `Bytes` per cut, and every frame length in order.
    Deltas {
        /// The worker's cut.
        base: u64,
        /// The cuts' bytes, oldest first (shared with every other reply that sends them).
        cuts: Vec<Bytes>,
        /// Frame lengths, in payload order.
        lens: Vec<u32>,
    },
    /// The whole public copy as little-endian f32 (shared while it stays the newest).
    Full(Bytes),
}

/// The public copy of one shard and its delta log.
#[derive(serde::Serialize, serde::Deserialize)]
pub struct PublicCopy {
    /// Shared with the full-copy replies in flight; a cut copies it only while one is (copy on write).
    #[serde(with = "shared_values")]
    values: Arc<Vec<f32>>,
    lineage: u64,
    seq: u64,
    cut_version: u64,
    cut_min_clock: u64,
    log: VecDeque<Cut>,
    log_bytes: usize,
    log_budget: usize,
    // Local settings and scratch, rebuilt after a state image (see `PublicCopy::adopt_local`).
    /// The codec of the deltas.
    #[serde(skip, default = "placeholder_codec")]
    codec: CodecConfig,
    /// The threads a cut's chunks run on.
    #[serde(skip)]
    pool: Arc<ChunkPool>,
    /// One encoder and delta buffer per thread (made at first use: making an encoder can fail).
    #[serde(skip)]
    encoders: Vec<Mutex<Option<CutEncoder>>>,
    /// One decoder and output buffer per thread.
    #[serde(skip)]
    decoders: Vec<Mutex<CutDecoder>>,
    /// The frames of the cut being taken, one per chunk.
    #[serde(skip)]
    frames: Vec<Vec<u8>>,
}

/// A thread's scratch for encoding a cut's chunks.
struct CutEncoder {
    encoder: Encoder,
    delta: Vec<f32>,
}

/// A thread's scratch for decoding a cut's chunks back.
struct CutDecoder {
    decoder: Decoder,
    decoded: Vec<f32>,
}

impl std::fmt::Debug for PublicCopy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PublicCopy")
            .field("lineage", &self.lineage)
            .field("seq", &self.seq)
            .field("cuts", &self.log.len())
            .field("log_bytes", &self.log_bytes)
            .finish_non_exhaustive()
    }
}

impl PublicCopy {
    /// A public copy equal to `weights` (cut 0 of `lineage`, at `version` and `min_clock`), whose deltas are encoded
    /// with `codec` and whose log holds at most `log_budget` bytes.
    pub fn new(
        weights: &[f32],
        lineage: u64,
        version: u64,
        min_clock: u64,
        codec: CodecConfig,
        log_budget: usize,
    ) -> Result<PublicCopy, CodecError> {
        // The codec is checked here, so that making the cuts' encoders later cannot fail on it.
        Encoder::new(codec)?;
        Ok(PublicCopy {
            values: Arc::new(weights.to_vec()),
            lineage,
            seq: 0,
            cut_version: version,
            cut_min_clock: min_clock,
            log: VecDeque::new(),
            log_bytes: 0,
            log_budget,
            codec,
            pool: Arc::default(),
            encoders: Vec::new(),
            decoders: Vec::new(),
            frames: Vec::new(),
        })
    }

    /// Runs the cuts' chunks on `pool` (by default inline on the caller); the bytes and values do not depend on it.
    pub fn with_pool(mut self, pool: Arc<ChunkPool>) -> Self {
        self.set_pool(pool);
        self
    }

    /// Runs the cuts' chunks on `pool` from now on.
    pub fn set_pool(&mut self, pool: Arc<ChunkPool>) {
        self.pool = pool;
    }

    /// Values per delta frame for a copy of `len` values.
    fn chunk_len(len: usize) -> usize {
        DELTA_CHUNK.min(len.max(1))
    }

    /// Checks a decoded copy (a peer's state image) against a range of `len` parameters and rebuilds its scratch
    /// for `codec`: the values have the range's length and every cut's frame lengths add up to its bytes.
    pub(crate) fn adopt_local(&mut self, len: usize, codec: CodecConfig) -> Result<(), String> {
        if self.values.len() != len {
            return Err(format!(
                "a public copy of {} values for a range of {len}",
                self.values.len()
            ));
        }
        let mut total = 0usize;
        for cut in &self.log {
            let sum = cut
                .lens
                .iter()
                .try_fold(0usize, |a, l| a.checked_add(*l as usize));
            if sum != Some(cut.bytes.len()) {
                return Err("a cut's frame lengths do not add up to its bytes".into());
            }
            total = total.saturating_add(cut.bytes.len());
        }
        if total != self.log_bytes {
            return Err("the delta log's byte count does not match its cuts".into());
        }
        Encoder::new(codec).map_err(|e| e.to_string())?;
        self.codec = codec;
        self.encoders.clear();
        self.decoders.clear();
        self.frames.clear();
        Ok(())
    }

    /// The public values.
    pub fn values(&self) -> &[f32] {
        &self.values
    }

    /// The newest cut.
    pub fn newest(&self) -> PublicRef {
        PublicRef {
            lineage: self.lineage,
            seq: self.seq,
        }
    }

    /// Shard version at the newest cut.
    pub fn cut_version(&self) -> u64 {
        self.cut_version
    }

    /// Bytes the delta log holds.
    pub fn held_bytes(&self) -> usize {
        self.log_bytes
    }

    /// Whether the policy wants a new cut before answering: the weights moved, and the minimum clock advanced or
    /// `live` updates arrived since the last cut.
    pub fn wants_cut(&self, version: u64, min_clock: u64, live: usize) -> bool {
        version > self.cut_version
            && (min_clock > self.cut_min_clock || version - self.cut_version >= live.max(1) as u64)
    }

    /// Takes a cut of `weights` (at `version`, `min_clock`): encodes `weights − public` chunk by chunk, adds the
    /// decoded delta to `public` and logs the frames. On a codec error (non-finite weights) nothing changes.
    pub fn cut(&mut self, weights: &[f32], version: u64, min_clock: u64) -> Result<(), CodecError> {
        self.cut_dirty(weights, 0..weights.len(), version, min_clock)
    }

    /// [`PublicCopy::cut`] of the values in `dirty` alone (the weights changed nowhere else since the last cut:
    /// streamed fragments push one part per round): outside it the delta encoded is zero, which the codecs carry in
    /// a few bytes, and what earlier cuts rounded away there stays in `weights − public` for the next cut that
    /// covers it.
    pub fn cut_dirty(
        &mut self,
        weights: &[f32],
        dirty: std::ops::Range<usize>,
        version: u64,
        min_clock: u64,
    ) -> Result<(), CodecError> {
        debug_assert_eq!(weights.len(), self.values.len());
        let chunk = Self::chunk_len(weights.len());
        let seq = self.seq + 1;
        let codec = self.codec;
        self.frames
            .resize_with(weights.len().div_ceil(chunk), Vec::new);
        // Encode every chunk first: a failure leaves the public copy untouched.
        let public = &self.values;
        let jobs: Vec<(usize, &[f32], &mut Vec<u8>)> = weights
            .chunks(chunk)
            .zip(self.frames.iter_mut())
            .enumerate()
            .map(|(i, (w, f))| (i, w, f))
            .collect();
        let encoded = self.pool.map_with(
            &mut self.encoders,
            || None,
            jobs,
            |scratch, (i, w, frame)| {
                let s = match scratch {
                    Some(s) => s,
                    None => scratch.insert(CutEncoder {
                        encoder: Encoder::new(codec)?,
                        delta: Vec::new(),
                    }),
                };
                let start = i * chunk;
                s.delta.resize(w.len(), 0.0);
                for (j, ((d, w), p)) in s
                    .delta
                    .iter_mut()
                    .zip(w)
                    .zip(&public[start..start + w.len()])
                    .enumerate()
                {
                    *d = if dirty.contains(&(start + j)) {
                        w - p
                    } else {
                        0.0
                    };
                }
                s.encoder
                    .encode(&s.delta, seed_for(u32::MAX, seq, i as u32), frame)
            },
        );
        encoded.into_iter().collect::<Result<(), CodecError>>()?;
        let frames = &self.frames;
        let mut bytes = Vec::with_capacity(frames.iter().map(Vec::len).sum());
        let mut lens = Vec::with_capacity(frames.len());
        for f in frames {
            bytes.extend_from_slice(f);
            lens.push(f.len() as u32);
        }
        // Then apply exactly what a worker will decode, with the decoder workers use.
        let values = Arc::make_mut(&mut self.values);
        let jobs: Vec<(&mut [f32], &[u8])> = values
            .chunks_mut(chunk)
            .zip(frames.iter().map(Vec::as_slice))
            .collect();
        let make = || CutDecoder {
            decoder: Decoder::new(chunk),
            decoded: vec![0.0; chunk],
        };
        let applied = self
            .pool
            .map_with(&mut self.decoders, make, jobs, |s, (p, frame)| {
                let out = &mut s.decoded[..p.len()];
                s.decoder.decode(frame, out)?;
                for (p, d) in p.iter_mut().zip(out.iter()) {
                    *p += d;
                }
                Ok(())
            });
        if let Err(e) = applied.into_iter().collect::<Result<(), CodecError>>() {
            // Our own frame did not decode (a codec bug): the copy is now partly updated, so start a new
            // lineage; every worker then fetches the whole copy, and everyone agrees again.
            self.lineage = self.lineage.wrapping_add(1);
            self.log.clear();
            self.log_bytes = 0;
            return Err(e);
        }
        self.seq = seq;
        self.cut_version = version;
        self.cut_min_clock = min_clock;
        self.log_bytes += bytes.len();
        self.log.push_back(Cut {
            seq,
            bytes: Bytes::from(bytes),
            lens,
        });
        while self.log.len() > MAX_LOG_CUTS
            || (self.log.len() > 1 && self.log_bytes > self.log_budget)
        {
            if let Some(old) = self.log.pop_front() {
                self.log_bytes -= old.bytes.len();
            }
        }
        Ok(())
    }

    /// What to send a worker holding `have`: nothing, the deltas from its cut (while the log has them and they are
    /// smaller than the whole copy), or the whole copy.
    pub fn answer(&mut self, have: Option<PublicRef>) -> Answer {
        if let Some(h) = have.filter(|h| h.lineage == self.lineage && h.seq <= self.seq) {
            if h.seq == self.seq {
                return Answer::NotModified;
            }
            // The log holds cuts oldest..=seq; the worker needs h.seq+1..=seq.
            let first = self.log.front().map_or(u64::MAX, |c| c.seq);
            if h.seq + 1 >= first {
                let skip = (h.seq + 1 - first) as usize;
                let needed: usize = self.log.iter().skip(skip).map(|c| c.bytes.len()).sum();
                let frames: usize = self.log.iter().skip(skip).map(|c| c.lens.len()).sum();
                if needed < 4 * self.values.len()
                    && frames <= tether_common::protocol::delta::MAX_DELTA_FRAMES
                {
                    let mut cuts = Vec::with_capacity(self.log.len() - skip);
                    let mut lens = Vec::with_capacity(frames);
                    for c in self.log.iter().skip(skip) {
                        cuts.push(c.bytes.clone());
                        lens.extend_from_slice(&c.lens);
                    }
                    return Answer::Deltas {
                        base: h.seq,
                        cuts,
                        lens,
                    };
                }
            }
        }
        Answer::Full(full_bytes(&self.values))
    }
}

/// The public values as little-endian f32 bytes without a copy: the reply shares the `Arc` (a cut taken while it is
/// in flight copies the values instead, `Arc::make_mut`).
#[cfg(target_endian = "little")]
fn full_bytes(values: &Arc<Vec<f32>>) -> Bytes {
    struct F32Le(Arc<Vec<f32>>);
    impl AsRef<[u8]> for F32Le {
        fn as_ref(&self) -> &[u8] {
            let v = self.0.as_slice();
            // SAFETY: f32 has no padding and no invalid bit patterns as bytes, u8 needs no alignment, and the slice
            // covers exactly the vector's initialised elements, borrowed for as long as `self` (which owns the Arc).
            // On a little-endian target these are the little-endian bytes the wire wants.
            unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
        }
    }
    Bytes::from_owner(F32Le(Arc::clone(values)))
}

/// The public values as little-endian f32 bytes (a copy: this target is big-endian).
#[cfg(not(target_endian = "little"))]
fn full_bytes(values: &Arc<Vec<f32>>) -> Bytes {
    let mut out = Vec::with_capacity(4 * values.len());
    for v in values.iter() {
        out.extend_from_slice(&v.to_le_bytes());
    }
    Bytes::from(out)
}

/// A raw-f32 codec standing in for the public copy's until [`crate::replication::image::restore`] sets the configured
/// one.
fn placeholder_codec() -> CodecConfig {
    CodecConfig {
        scheme: Scheme::None,
        zstd: false,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tether_common::codec::{Decoder, Rounding, Scheme};

    fn codec(scheme: Scheme) -> CodecConfig {
        CodecConfig {
            scheme,
            bucket: 128,
            rounding: Rounding::Deterministic,
            zstd: true,
            keep: tether_common::codec::DEFAULT_KEEP,
        }
    }

    /// Applies an answer to a worker's copy the way a worker does, with a fresh decoder.
    fn apply(copy: &mut [f32], answer: &Answer) {
        match answer {
            Answer::NotModified => {}
            Answer::Full(b) => {
                for (v, c) in copy.iter_mut().zip(b.chunks_exact(4)) {
                    *v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            Answer::Deltas { cuts, lens, .. } => {
                let all: Vec<u8> = cuts.iter().flat_map(|c| c.iter().copied()).collect();
                let chunk = DELTA_CHUNK.min(copy.len());
                let per_cut = copy.len().div_ceil(chunk);
                let mut dec = Decoder::new(chunk);
                let mut out = vec![0.0; chunk];
                let mut at = 0;
                for (i, len) in lens.iter().enumerate() {
                    let start = (i % per_cut) * chunk;
                    let end = (start + chunk).min(copy.len());
                    dec.decode(&all[at..at + *len as usize], &mut out[..end - start])
                        .unwrap();
                    at += *len as usize;
                    for (p, d) in copy[start..end].iter_mut().zip(&out) {
                        *p += d;
                    }
                }
            }
        }
    }

    #[test]
    fn a_cut_of_one_dirty_part_moves_only_that_part_costs_less_and_catches_up_later() {
        for scheme in [Scheme::Q4, Scheme::Topk2] {
            let n = 40_000;
            let mut w: Vec<f32> = (0..n).map(|i| ((i % 89) as f32 - 44.0) * 1e-3).collect();
            let mut p = PublicCopy::new(&w, 3, 0, 0, codec(scheme), 1 << 30).unwrap();
            let mut held = vec![0.0; n];
            apply(&mut held, &p.answer(None));
            // Every value moves; a whole cut, then a cut of one quarter marked dirty.
            let step = |w: &mut [f32], k: u64| {
                for (i, v) in w.iter_mut().enumerate() {
                    // Pseudo-random steps, so that zstd finds no pattern in a dense delta.
                    let z = tether_common::splitmix::splitmix64((i as u64) << 20 ^ k);
                    *v += ((z >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 1e-3;
                }
            };
            step(&mut w, 1);
            p.cut(&w, 1, 1).unwrap();
            let whole = p.log.back().unwrap().bytes.len();
            step(&mut w, 2);
            let before = p.values().to_vec();
            let dirty = 10_000..20_000;
            p.cut_dirty(&w, dirty.clone(), 2, 2).unwrap();
            let part = p.log.back().unwrap().bytes.len();
            let moved: Vec<usize> = (0..n)
                .filter(|&i| p.values()[i].to_bits() != before[i].to_bits())
                .collect();
            assert!(
                !moved.is_empty() && moved.iter().all(|i| dirty.contains(i)),
                "{scheme:?}"
            );
            assert!(
                part * 2 < whole,
                "{scheme:?}: a quarter cut is {part} B against {whole} B"
            );
            // Workers still rebuild it bit for bit, and a later whole cut carries what the partial one left.
            apply(&mut held, &p.answer(Some(PublicRef { lineage: 3, seq: 0 })));
            assert!(held
                .iter()
                .zip(p.values())
                .all(|(a, b)| a.to_bits() == b.to_bits()));
            for k in 3..40 {
                p.cut(&w, k, k).unwrap();
            }
            let err = w
                .iter()
                .zip(p.values())
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            assert!(err < 2e-3, "{scheme:?}: the public copy stayed {err} away");
        }
    }

    #[test]
    fn workers_rebuild_the_public_copy_bit_for_bit_and_it_tracks_the_weights() {
        // 150k values: three chunks, the last one short.
        let n = 150_000;
        let mut w: Vec<f32> = (0..n).map(|i| ((i % 97) as f32 - 48.0) * 1e-3).collect();
        let mut p = PublicCopy::new(&w, 9, 0, 0, codec(Scheme::Q4), 1 << 30).unwrap();
        let mut early = vec![0.0; n];
        apply(&mut early, &p.answer(None));
        let mut every = early.clone();
        for step in 1..=30u64 {
            for (i, v) in w.iter_mut().enumerate() {
                *v += (((i as u64 * 31 + step * 7) % 13) as f32 - 6.0) * 1e-4;
            }
            p.cut(&w, step, step).unwrap();
            let have = PublicRef {
                lineage: 9,
                seq: step - 1,
            };
            apply(&mut every, &p.answer(Some(have)));
            assert!(every
                .iter()
                .zip(p.values())
                .all(|(a, b)| a.to_bits() == b.to_bits()));
        }
        // A worker that skipped 29 cuts catches up from the log to the same bits.
        apply(
            &mut early,
            &p.answer(Some(PublicRef { lineage: 9, seq: 0 })),
        );
        assert!(early
            .iter()
            .zip(p.values())
            .all(|(a, b)| a.to_bits() == b.to_bits()));
        // Server-side error feedback: the public copy stays within one quantization step of the weights instead of
        // drifting by 30 steps' rounding.
        let err = w
            .iter()
            .zip(p.values())
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(err < 2e-4, "public copy drifted {err}");
        assert!(matches!(p.answer(Some(p.newest())), Answer::NotModified));
    }

    #[test]
    fn laggards_past_the_log_and_other_lineages_get_the_whole_copy() {
        let n = 1000;
        let mut w = vec![0.5f32; n];
        // Budget for about two q8 cuts.
        let raw = CodecConfig {
            zstd: false,
            ..codec(Scheme::Q8)
        };
        let mut p = PublicCopy::new(&w, 1, 0, 0, raw, 2 * n + 200).unwrap();
        for step in 1..=6u64 {
            w.iter_mut()
                .enumerate()
                .for_each(|(i, v)| *v += (i % 7) as f32 * 1e-3);
            p.cut(&w, step, step).unwrap();
        }
        assert!(matches!(
            p.answer(Some(PublicRef { lineage: 1, seq: 0 })),
            Answer::Full(_)
        ));
        assert!(matches!(
            p.answer(Some(PublicRef { lineage: 2, seq: 6 })),
            Answer::Full(_)
        ));
        assert!(matches!(
            p.answer(Some(PublicRef { lineage: 1, seq: 5 })),
            Answer::Deltas { base: 5, .. }
        ));
        assert!(p.held_bytes() <= 2 * n + 200 + 4 * n);
        // A cut that cannot be encoded changes nothing.
        let before = p.values().to_vec();
        let mut bad = w.clone();
        bad[3] = f32::NAN;
        assert!(p.cut(&bad, 7, 7).is_err());
        assert_eq!(p.newest().seq, 6);
        assert!(before
            .iter()
            .zip(p.values())
            .all(|(a, b)| a.to_bits() == b.to_bits()));
    }

    #[test]
    fn cuts_follow_the_minimum_clock_or_a_round_of_updates() {
        let p = PublicCopy::new(&[0.0; 8], 1, 10, 3, codec(Scheme::Q4), 1 << 20).unwrap();
        assert!(!p.wants_cut(10, 5, 4), "no update since the cut");
        assert!(p.wants_cut(11, 4, 4), "the minimum clock advanced");
        assert!(!p.wants_cut(12, 3, 4), "two updates of a round of four");
        assert!(p.wants_cut(14, 3, 4), "a round's worth of updates");
    }
}

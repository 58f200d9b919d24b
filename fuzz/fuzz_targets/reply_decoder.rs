//! Plays a hostile shard against the worker's real pull path: a [`WorkerProtocol`] over one or two small shards, in
//! full (f32 or bf16) or delta mode, connected and waiting for a pull, is fed reply bodies built from the input —
//! full replies and delta replies (whole copies, "not modified", codec frames against the copy the worker holds or
//! one it does not), with every header field right or arbitrary, values that may be NaN, infinite or huge, bodies
//! truncated, extended or flipped, raw bytes — interleaved with what the worker's driver does (reconnects, new
//! rounds, stray replies). The first input byte picks the setup, the rest a sequence of steps, so the stateful delta
//! path (a copy held, then deltas from it) is reached.
//!
//! Checked after every reply: nothing panics; an error changes neither the model nor the public copy and forgets
//! the copy; a dropped reply changes nothing; a used one writes only its shard's range, with finite values, exactly
//! the values sent when the reply was well formed, and leaves the worker holding the cut it names.
#![no_main]

use std::cell::RefCell;

use libfuzzer_sys::fuzz_target;
use rkyv::util::AlignedVec;
use tether_common::codec::{CodecConfig, Encoder, Rounding, Scheme};
use tether_common::config::Staleness;
use tether_common::protocol::{
    encode_delta_preamble, encode_params, encode_values, Control, DeltaHeader, DeltaKind,
    FrameKind, Outcome, ParamReply, Precision, PullMode, ReplyHeader, Welcome,
};
use tether_worker::protocol::{Event, Transmit, WorkerProtocol};

/// Shard sizes a setup picks from: small (fast), around a q4 bucket, and empty-ish edge cases.
const SIZES: [u64; 8] = [1, 3, 16, 17, 31, 48, 64, 100];
/// Steps per input, and frames one built delta reply may carry.
const MAX_STEPS: usize = 24;
const MAX_FRAMES: u64 = 24;
const STALENESS: u32 = 2;

/// Reads the input front to back; past its end every read is zero.
struct Input<'a>(&'a [u8]);

impl<'a> Input<'a> {
    fn u8(&mut self) -> u8 {
        match self.0.split_first() {
            Some((b, rest)) => {
                self.0 = rest;
                *b
            }
            None => 0,
        }
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }
    fn u64(&mut self) -> u64 {
        u64::from(self.u32()) | (u64::from(self.u32()) << 32)
    }
    fn bytes(&mut self, n: usize) -> &'a [u8] {
        let n = n.min(self.0.len());
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        a
    }
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    /// A value a shard might send: ordinary, tiny, huge (to overflow sums), or not finite.
    fn value(&mut self) -> f32 {
        match self.u8() % 8 {
            0 => f32::NAN,
            1 => f32::INFINITY,
            2 => -f32::MAX,
            3 => 3.0e38,
            4 => f32::from_bits(self.u32()),
            _ => (self.u8() as i8) as f32 / 16.0,
        }
    }
    /// A finite value (what the codec accepts), possibly huge.
    fn finite(&mut self) -> f32 {
        let v = self.value();
        if v.is_finite() {
            v
        } else {
            1.0e38
        }
    }
}

thread_local! {
    /// Encoders for delta frames (the zstd one owns a compressor worth keeping between runs).
    static ENCODERS: RefCell<Vec<Encoder>> = RefCell::new(
        [
            (Scheme::Q4, false),
            (Scheme::Q4, true),
            (Scheme::Q8, false),
            (Scheme::None, false),
            (Scheme::Bf16, true),
            (Scheme::Q2, false),
            (Scheme::Topk2, true),
        ]
        .into_iter()
        .map(|(scheme, zstd)| {
            Encoder::new(CodecConfig {
                scheme,
                bucket: 16,
                rounding: Rounding::Deterministic,
                zstd,
                keep: 4,
            })
            .expect("bucket 16 and keep 4 are valid")
        })
        .collect()
    );
}

/// What the target knows of the worker: the shards' ranges and the pull requests it sent.
struct World {
    s: WorkerProtocol,
    ranges: Vec<(u64, u64)>,
    precision: Precision,
    /// The outstanding request per shard and the clock it asks for.
    asked: Vec<Option<(u64, u64)>>,
    /// Request ids sent earlier (superseded), newest last.
    old: Vec<u64>,
    params: Vec<f32>,
    now: u64,
}

impl World {
    fn new(setup: u8, sizes: u8) -> World {
        let mode = match setup % 3 {
            0 => PullMode::Full(Precision::F32),
            1 => PullMode::Full(Precision::Bf16),
            _ => PullMode::Delta { have: None },
        };
        let precision = match mode {
            PullMode::Full(p) => p,
            PullMode::Delta { .. } => Precision::F32,
        };
        let shards = 1 + usize::from(setup / 3 % 2);
        let mut ranges = Vec::new();
        let mut at = 0;
        for k in 0..shards {
            let len = SIZES[usize::from(sizes >> (4 * k)) % SIZES.len()];
            ranges.push((at, at + len));
            at += len;
        }
        let s = WorkerProtocol::new(
            1,
            0x5eed,
            ranges.clone(),
            Staleness::Bounded(STALENESS),
            mode,
            100,
        );
        let mut w = World {
            s,
            params: vec![0.25; at as usize],
            asked: vec![None; shards],
            old: Vec::new(),
            ranges,
            precision,
            now: 0,
        };
        w.settle();
        w.s.start_pull(w.now);
        w.settle();
        w
    }

    /// Does what the driver does with the protocol's output: sends (here: records the pull requests), reconnects
    /// every link it is told to (the shard welcomes at the hello's clock), settles every push at once, and starts the
    /// next round when a pull completes.
    fn settle(&mut self) {
        for _ in 0..64 {
            let mut quiet = true;
            while let Some(t) = self.s.poll_transmit() {
                quiet = false;
                match t {
                    Transmit::Control {
                        shard,
                        msg: Control::PullRequest { request, clock, .. },
                    } => {
                        if let Some((prev, _)) = self.asked[shard].replace((request, clock)) {
                            self.old.push(prev);
                        }
                    }
                    Transmit::Push { shard, clock, .. } => {
                        // Every link is welcomed in term 0 (an unreplicated shard), so the outcome is in its term.
                        self.s
                            .outcome(shard, clock, Outcome::Applied, 0)
                            .expect("an outcome in the link's term")
                    }
                    Transmit::Control { .. } => {}
                }
            }
            while let Some(e) = self.s.poll_event() {
                quiet = false;
                match e {
                    Event::Reconnect { shard } => {
                        let (start, end) = self.ranges[shard];
                        let hello = self.s.hello(shard);
                        let welcome = Welcome {
                            shard: shard as u32,
                            range_start: start,
                            range_end: end,
                            staleness: Some(STALENESS),
                            fragments: 1,
                            min_clock: hello.clock,
                            version: 0,
                            clock: hello.clock,
                            initial: None,
                            term: 0,
                        };
                        self.s
                            .connected(shard, &welcome, self.now)
                            .expect("a welcome that matches the worker's settings");
                    }
                    Event::PullDone { .. } => {
                        self.asked.iter_mut().for_each(|a| *a = None);
                        self.s.skip(0.5).expect("a skip marker encodes");
                        self.s.start_pull(self.now);
                    }
                    Event::Settled(_) | Event::RolledBack { .. } => {}
                }
            }
            if quiet {
                return;
            }
        }
    }

    /// A header for `shard` with each field right (answering its current request) or taken from the input.
    fn header(&self, shard: usize, inp: &mut Input<'_>) -> ReplyHeader {
        let wrong = inp.u8();
        let (start, end) = self.ranges[shard];
        let (request, clock) = self.asked[shard].unwrap_or((0, self.s.clock()));
        let mut h = ReplyHeader {
            shard: shard as u32,
            request,
            clock,
            version: u64::from(inp.u8()),
            min_clock: clock.saturating_sub(u64::from(inp.u8() % 4)),
            epoch: u64::from(inp.u8() % 3 == 0),
            range_start: start,
            range_end: end,
            term: 0,
        };
        if wrong & 0x80 == 0 {
            return h;
        }
        if wrong & 1 != 0 {
            h.shard = inp.u32();
        }
        if wrong & 2 != 0 {
            h.request = match (inp.u8(), self.old.last()) {
                (b, Some(old)) if b % 2 == 0 => *old,
                _ => inp.u64(),
            };
        }
        if wrong & 4 != 0 {
            h.clock = inp.u64();
        }
        if wrong & 8 != 0 {
            h.version = inp.u64();
            h.min_clock = inp.u64();
            h.epoch = inp.u64();
        }
        if wrong & 16 != 0 {
            h.range_start = start.wrapping_add(u64::from(inp.u8() % 3)).wrapping_sub(1);
        }
        if wrong & 32 != 0 {
            h.range_end = match inp.u8() % 3 {
                0 => end + 1,
                1 => end.saturating_sub(1),
                _ => inp.u64(),
            };
        }
        if wrong & 64 != 0 {
            // A term the link was not welcomed in: a deposed node's answer.
            h.term = inp.u64().max(1);
        }
        h
    }

    /// A full reply body; with its values when it is well formed (to check what the worker reads).
    fn full_reply(&self, shard: usize, inp: &mut Input<'_>) -> (AlignedVec, Option<Vec<f32>>) {
        let header = self.header(shard, inp);
        let (start, end) = self.ranges[shard];
        let shape = inp.u8();
        let precision = if shape & 1 == 0 {
            self.precision
        } else {
            Precision::Bf16
        };
        let len = match shape >> 6 {
            0 => (end - start) as usize + 1,
            1 => (end - start).saturating_sub(1) as usize,
            _ => (end - start) as usize,
        };
        let finite_only = shape & 2 != 0;
        let values: Vec<f32> = (0..len)
            .map(|_| {
                if finite_only {
                    inp.finite()
                } else {
                    inp.value()
                }
            })
            .collect();
        let mut bytes = Vec::new();
        encode_values(&values, precision, &mut bytes);
        let body = encode_params(&ParamReply {
            header,
            precision,
            values: bytes.clone(),
        })
        .expect("a reply of at most a few hundred values encodes");
        let mut read = vec![0.0f32; values.len()];
        tether_common::protocol::decode_values(&bytes, precision, &mut read);
        (body, Some(read))
    }

    /// A delta reply body for `shard`: from the cut the worker holds (or another), as a whole copy, "not modified"
    /// or codec frames; with the copy it must produce when it is well formed and a whole copy.
    fn delta_reply(&self, shard: usize, inp: &mut Input<'_>) -> (AlignedVec, Option<Vec<f32>>) {
        let header = self.header(shard, inp);
        let (start, end) = self.ranges[shard];
        let len = end - start;
        let held = self.s.public(shard);
        let shape = inp.u8();
        let lineage = match (shape & 3, held) {
            (0, _) | (_, None) => inp.u64(),
            (_, Some(h)) => h.lineage,
        };
        let base = match ((shape >> 2) & 3, held) {
            (0, _) | (_, None) => u64::from(inp.u8()),
            (_, Some(h)) => h.seq,
        };
        let mut delta = DeltaHeader {
            header,
            lineage,
            base,
            seq: base,
            kind: DeltaKind::NotModified,
            chunk: 0,
            frames: Vec::new(),
        };
        let mut payload = Vec::new();
        let mut expect = None;
        match inp.u8() % 3 {
            0 => {
                // Not modified: a used one leaves the copy held as it is.
                let public = self.s.public_values();
                expect = public
                    .get(start as usize..end as usize)
                    .map(<[f32]>::to_vec);
            }
            1 => {
                delta.kind = DeltaKind::Full;
                delta.seq = base.wrapping_add(u64::from(inp.u8()));
                let finite_only = shape & 16 != 0;
                let values: Vec<f32> = (0..len)
                    .map(|_| {
                        if finite_only {
                            inp.finite()
                        } else {
                            inp.value()
                        }
                    })
                    .collect();
                encode_values(&values, Precision::F32, &mut payload);
                delta.frames.push(payload.len() as u32);
                expect = Some(values);
            }
            _ => {
                delta.kind = DeltaKind::Deltas;
                delta.chunk = match inp.u8() % 4 {
                    0 => len as u32,
                    1 => 16,
                    2 => 1 + u32::from(inp.u8()),
                    _ => inp.u32(),
                };
                let cuts = 1 + u64::from(inp.u8() % 3);
                delta.seq = base.wrapping_add(cuts);
                let chunk = u64::from(delta.chunk).clamp(1, len.max(1));
                let per_cut = len.div_ceil(chunk).max(1);
                let frames = (cuts * per_cut).min(MAX_FRAMES);
                ENCODERS.with(|encoders| {
                    let mut encoders = encoders.borrow_mut();
                    for i in 0..frames {
                        let at = (i % per_cut) * chunk;
                        let n = ((at + chunk).min(len) - at) as usize;
                        let mut frame = Vec::new();
                        match inp.u8() % 8 {
                            // Raw bytes as a frame.
                            0 => {
                                let n = usize::from(inp.u8());
                                frame.extend_from_slice(inp.bytes(n));
                            }
                            // A frame of another length than its chunk.
                            1 => {
                                let values: Vec<f32> = (0..n + 1).map(|_| inp.finite()).collect();
                                let _ = encoders[0].encode(&values, 0, &mut frame);
                            }
                            pick => {
                                let e = usize::from(pick) % encoders.len();
                                let values: Vec<f32> = (0..n).map(|_| inp.finite()).collect();
                                let _ = encoders[e].encode(&values, u64::from(pick), &mut frame);
                            }
                        }
                        delta.frames.push(frame.len() as u32);
                        payload.extend_from_slice(&frame);
                    }
                });
            }
        }
        if shape & 32 != 0 {
            // Frame lengths that do not add up to the payload.
            if let Some(f) = delta.frames.first_mut() {
                *f = f.wrapping_add(u32::from(inp.u8())).wrapping_sub(128);
            }
        }
        let mut body = AlignedVec::new();
        if let Ok(preamble) = encode_delta_preamble(&delta) {
            body.extend_from_slice(&preamble);
        }
        body.extend_from_slice(&payload);
        (body, expect)
    }

    /// Feeds `body` as a reply of `kind` from `shard` (with the model while a pull is waited for, as the driver
    /// does, unless `stray`) and checks what the worker did with it.
    fn feed(
        &mut self,
        shard: usize,
        kind: FrameKind,
        body: &AlignedVec,
        sent: Option<Vec<f32>>,
        stray: bool,
    ) {
        let before = self.params.clone();
        let public_before = self.s.public_values().to_vec();
        let held_before = self.s.public(shard);
        let params = (self.s.pulling() && !stray).then_some(&mut self.params[..]);
        let result = self.s.handle_reply(shard, kind, body, params);
        let (start, end) = self.ranges[shard];
        let (start, end) = (start as usize, end as usize);
        let public = self.s.public_values();
        let same_public = public.len() >= public_before.len()
            && bits(&public[..public_before.len()]) == bits(&public_before)
            && public[public_before.len()..].iter().all(|v| *v == 0.0);
        match result {
            Err(_) => {
                assert_eq!(
                    bits(&self.params),
                    bits(&before),
                    "a refused reply wrote the model"
                );
                assert!(same_public, "a refused reply changed the public copy");
                assert_eq!(
                    self.s.public(shard),
                    None,
                    "a refused reply left the copy trusted"
                );
            }
            Ok(false) => {
                assert_eq!(
                    bits(&self.params),
                    bits(&before),
                    "a dropped reply wrote the model"
                );
                assert!(same_public, "a dropped reply changed the public copy");
                assert_eq!(self.s.public(shard), held_before);
            }
            Ok(true) => {
                let got = &self.params[start..end];
                assert!(
                    got.iter().all(|v| v.is_finite()),
                    "a used reply wrote non-finite values: {got:?}"
                );
                assert_eq!(bits(&self.params[..start]), bits(&before[..start]));
                assert_eq!(bits(&self.params[end..]), bits(&before[end..]));
                if let Some(sent) = sent {
                    assert_eq!(bits(got), bits(&sent), "a used reply is not what was sent");
                }
                if kind == FrameKind::Delta {
                    assert_eq!(bits(&public[start..end]), bits(got));
                    assert!(self.s.public(shard).is_some());
                }
            }
        }
        self.settle();
    }

    fn step(&mut self, inp: &mut Input<'_>) {
        let op = inp.u8();
        let shard = usize::from(op >> 4) % self.ranges.len();
        match op % 8 {
            0..=2 => {
                let (body, sent) = self.full_reply(shard, inp);
                self.feed(shard, FrameKind::Params, &body, sent, false);
            }
            3..=5 => {
                let (body, sent) = self.delta_reply(shard, inp);
                self.feed(shard, FrameKind::Delta, &body, sent, false);
            }
            6 => {
                // A built reply, cut, extended or with a flipped byte; or raw bytes.
                let kind = if op & 8 == 0 {
                    FrameKind::Params
                } else {
                    FrameKind::Delta
                };
                let (mut body, _) = match kind {
                    FrameKind::Params => self.full_reply(shard, inp),
                    _ => self.delta_reply(shard, inp),
                };
                let at = usize::from(inp.u8()) * body.len() / 256;
                match inp.u8() % 4 {
                    0 => body.resize(at, 0),
                    1 => {
                        let n = usize::from(inp.u8());
                        body.extend_from_slice(inp.bytes(n));
                    }
                    2 => {
                        if let Some(b) = body.get_mut(at) {
                            *b ^= inp.u8() | 1;
                        }
                    }
                    _ => {
                        let n = usize::from(inp.u8()) * 4;
                        body.clear();
                        body.extend_from_slice(inp.bytes(n));
                    }
                }
                self.feed(shard, kind, &body, None, op & 64 != 0);
            }
            _ => {
                // The driver's side: a new round, a dropped link, or a forgotten copy.
                self.now += 1;
                match (op >> 3) % 4 {
                    0 => self.s.start_pull(self.now),
                    1 => {
                        self.asked[shard] = None;
                        self.s.disconnected(shard);
                    }
                    2 => self.s.forget_public(shard),
                    _ => {
                        self.s.skip(f32::NAN).expect("a skip marker encodes");
                        self.s.start_pull(self.now);
                    }
                }
                self.settle();
            }
        }
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fuzz_target!(|data: &[u8]| {
    let mut inp = Input(data);
    let setup = inp.u8();
    let sizes = inp.u8();
    let mut world = World::new(setup, sizes);
    for _ in 0..MAX_STEPS {
        if inp.is_empty() {
            break;
        }
        world.step(&mut inp);
    }
});

//! The gradient codec: bucketed stochastic quantization (q8/q4/q2), block top-k with 2-bit values (topk2),
//! fp16/bf16/fp32 passthrough, optional zstd, and worker-side error feedback.
//!
//! Deterministic core: a frame is a pure function of (input, [`CodecConfig`], seed); the same seed gives the same
//! bytes whichever kernel (scalar or AVX2) runs. The encoder and decoder own their scratch buffers so that steady-state
//! encoding and decoding never allocate. Decoding treats its input as hostile: every header field, length, scale and
//! code is checked, sizes are computed with checked arithmetic against the caller's expected element count before
//! anything is allocated, zstd output is bounded by the expected raw size, and every failure is a [`CodecError`].

mod float;
mod header;
mod quant;
mod rng;
mod sparse;

#[cfg(target_arch = "x86_64")]
mod avx2;
mod feedback;

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

pub use feedback::ErrorFeedback;
pub use header::{FrameHeader, HEADER_LEN, MAGIC, MAX_BUCKET, MIN_BUCKET, VERSION};
pub use rng::seed_for;
pub use sparse::MAX_SPARSE_BLOCK;

/// Default keep ratio of `topk2`: one value in 64 per block (SparseLoCo keeps 1–3 %).
pub const DEFAULT_KEEP: u32 = 64;

/// zstd level used for bodies (fast; see docs/design.md §4 for its cost).
pub const ZSTD_LEVEL: i32 = 1;

/// How gradient values are represented on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scheme {
    /// Raw f32.
    None,
    /// IEEE half precision.
    Fp16,
    /// bfloat16.
    Bf16,
    /// 8-bit bucketed quantization, levels −127..=127.
    Q8,
    /// 4-bit bucketed quantization, levels −7..=7, two per byte (low nibble first).
    #[default]
    Q4,
    /// Ternary bucketed quantization, levels −1..=1, four per byte.
    Q2,
    /// Block top-k: one value in `keep` per block, each as 2 bits (sign, and one of the block's two scales).
    Topk2,
}

impl Scheme {
    /// All schemes, in tag order.
    pub const ALL: [Scheme; 7] = [
        Scheme::None,
        Scheme::Fp16,
        Scheme::Bf16,
        Scheme::Q8,
        Scheme::Q4,
        Scheme::Q2,
        Scheme::Topk2,
    ];

    /// The scheme's lowercase name (as in config files).
    pub fn name(self) -> &'static str {
        match self {
            Scheme::None => "none",
            Scheme::Fp16 => "fp16",
            Scheme::Bf16 => "bf16",
            Scheme::Q8 => "q8",
            Scheme::Q4 => "q4",
            Scheme::Q2 => "q2",
            Scheme::Topk2 => "topk2",
        }
    }

    /// Whether the scheme is bucketed quantization (q8/q4/q2).
    pub fn is_quantized(self) -> bool {
        matches!(self, Scheme::Q8 | Scheme::Q4 | Scheme::Q2)
    }

    /// Whether the scheme keeps only some values (topk2).
    pub fn is_sparse(self) -> bool {
        self == Scheme::Topk2
    }

    /// Whether rounding and a bucket (block) size apply: the quantized schemes and topk2.
    pub fn is_bucketed(self) -> bool {
        self.is_quantized() || self.is_sparse()
    }

    /// Bits per element on the wire (before scales and compression); per kept value for topk2.
    pub fn bits(self) -> u32 {
        match self {
            Scheme::None => 32,
            Scheme::Fp16 | Scheme::Bf16 => 16,
            Scheme::Q8 => 8,
            Scheme::Q4 => 4,
            Scheme::Q2 | Scheme::Topk2 => 2,
        }
    }

    /// Largest quantization level `L` (x̂ = scale·q/L), or `None` for unquantized schemes.
    pub fn levels(self) -> Option<i32> {
        self.is_quantized().then(|| quant::level(self.bits()))
    }

    fn tag(self) -> u8 {
        self as u8
    }

    fn from_tag(t: u8) -> Option<Scheme> {
        Scheme::ALL.get(usize::from(t)).copied()
    }
}

impl fmt::Display for Scheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Scheme {
    type Err = CodecError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Scheme::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| CodecError::UnknownScheme(s.to_owned()))
    }
}

/// How values are rounded to quantization levels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Rounding {
    /// Unbiased stochastic rounding between adjacent levels, seeded per frame.
    #[default]
    Stochastic,
    /// Round to nearest (biased, lower variance, seed ignored).
    Deterministic,
}

/// Codec settings for one run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct CodecConfig {
    /// Wire representation.
    pub scheme: Scheme,
    /// Bucket size for quantized schemes: a multiple of 16 in [`MIN_BUCKET`, `MAX_BUCKET`] (at most
    /// [`MAX_SPARSE_BLOCK`] for topk2, where it is the block of the top-k selection).
    pub bucket: usize,
    /// Rounding mode for quantized and sparse schemes.
    pub rounding: Rounding,
    /// Compress bodies with zstd (level 1) when that makes them smaller.
    pub zstd: bool,
    /// topk2 keeps one value in `keep` per block: a power of two in 2..=32768 (ignored by the other schemes).
    pub keep: u32,
}

impl Default for CodecConfig {
    fn default() -> Self {
        CodecConfig {
            scheme: Scheme::Q4,
            bucket: 512,
            rounding: Rounding::Stochastic,
            zstd: false,
            keep: DEFAULT_KEEP,
        }
    }
}

impl CodecConfig {
    /// Checks the configuration (bucket size; for topk2 also the block limit and `keep`).
    pub fn validate(&self) -> Result<(), CodecError> {
        if self.scheme.is_sparse() {
            header::check_sparse(self.bucket, self.keep_shift())
        } else {
            header::check_bucket(self.bucket)
        }
    }

    /// What `validate` requires, in words, for the setting that `err` (from `validate`) names.
    pub fn rules(&self, err: &CodecError) -> String {
        match err {
            CodecError::InvalidKeep => "must be a power of two from 2 to 32768".into(),
            _ if self.scheme.is_sparse() => format!(
                "must be a multiple of 16 from {MIN_BUCKET} to {MAX_SPARSE_BLOCK} with {}",
                self.scheme.name()
            ),
            _ => format!("must be a multiple of 16 from {MIN_BUCKET} to {MAX_BUCKET}"),
        }
    }

    /// `log2(keep)` as the header carries it for topk2 (0 for other schemes; 0 also flags a `keep` that is not a
    /// power of two in range, which `validate` refuses).
    pub fn keep_shift(&self) -> u8 {
        if !self.scheme.is_sparse() {
            return 0;
        }
        if self.keep.is_power_of_two() && (2..=1 << 15).contains(&self.keep) {
            self.keep.trailing_zeros() as u8
        } else {
            0
        }
    }
}

/// Codec failures; decoding failures mean the frame must be dropped and nothing applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    /// A NaN or ±Inf at this element index (encoder input, or a decoded none/fp16/bf16 value).
    #[error("non-finite value at element {index}")]
    NonFinite {
        /// Index of the first offending element.
        index: usize,
    },
    /// The frame does not start with the codec magic.
    #[error("bad frame magic")]
    BadMagic,
    /// The frame's format version is not supported.
    #[error("unsupported frame version")]
    UnsupportedVersion,
    /// Unknown scheme tag in the header.
    #[error("unknown scheme tag")]
    BadScheme,
    /// Unknown flag bits or a non-zero reserved byte.
    #[error("unknown header flags")]
    BadFlags,
    /// The element count differs from what the caller expects.
    #[error("element count mismatch: expected {expected}, found {found}")]
    LengthMismatch {
        /// Expected element count.
        expected: u64,
        /// Element count in the frame (or given).
        found: u64,
    },
    /// The frame is shorter than its header says.
    #[error("truncated frame")]
    Truncated,
    /// The frame has bytes after its body.
    #[error("trailing bytes after frame body")]
    TrailingBytes,
    /// The body length is inconsistent with scheme, element count and bucket size.
    #[error("body length inconsistent: expected {expected}, found {found}")]
    BodyLength {
        /// Length implied by the header (raw) or the largest allowed (compressed).
        expected: u64,
        /// Length found.
        found: u64,
    },
    /// A bucket scale is negative, NaN or infinite.
    #[error("bad bucket scale")]
    BadScale,
    /// A quantization code outside −L..=L, or non-zero padding bits, in this bucket.
    #[error("bad quantization code in bucket {bucket}")]
    BadCode {
        /// Index of the offending bucket.
        bucket: usize,
    },
    /// The body (or the element count) exceeds what one frame may carry.
    #[error("frame body too large")]
    BodyTooLarge,
    /// zstd compression or decompression failed (including output larger than expected).
    #[error("zstd: {0}")]
    Zstd(String),
    /// The bucket size is not a multiple of 16 in [MIN_BUCKET, MAX_BUCKET] (or non-zero for an fp scheme, or above
    /// MAX_SPARSE_BLOCK for topk2).
    #[error("invalid bucket size")]
    InvalidBucket,
    /// topk2's keep ratio is not a power of two in 2..=32768.
    #[error("invalid keep ratio: a power of two from 2 to 32768")]
    InvalidKeep,
    /// A scheme name that is not one of none|fp16|bf16|q8|q4|q2|topk2.
    #[error("unknown codec scheme {0:?}")]
    UnknownScheme(String),
    /// The requested kernel is not supported by this CPU.
    #[error("kernel {0:?} not available on this CPU")]
    KernelUnavailable(Kernel),
    /// A chunk asked of [`RawFrame::decode_chunk`] does not start and end on bucket boundaries inside the frame.
    #[error("chunk {start}..{end} does not lie on the frame's bucket boundaries")]
    Misaligned {
        /// First value of the chunk.
        start: usize,
        /// End of the chunk.
        end: usize,
    },
}

/// Which implementation of the quantization loops runs; all produce identical bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// Portable scalar code (the reference).
    Scalar,
    /// x86_64 AVX2 code.
    Avx2,
}

impl Kernel {
    /// The fastest kernel this CPU supports.
    pub fn detect() -> Kernel {
        if Kernel::Avx2.available() {
            Kernel::Avx2
        } else {
            Kernel::Scalar
        }
    }

    /// Whether this CPU can run the kernel.
    pub fn available(self) -> bool {
        match self {
            Kernel::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => std::arch::is_x86_feature_detected!("avx2"),
            #[cfg(not(target_arch = "x86_64"))]
            Kernel::Avx2 => false,
        }
    }

    fn checked(self) -> Result<Kernel, CodecError> {
        if self.available() {
            Ok(self)
        } else {
            Err(CodecError::KernelUnavailable(self))
        }
    }
}

/// Upper bound of the size of a frame encoding `len` elements with `cfg` (header plus raw body; zstd is only used
/// when smaller). Saturates at `usize::MAX` for sizes no frame can have.
pub fn max_encoded_len(cfg: &CodecConfig, len: usize) -> usize {
    let bucket = cfg.bucket.max(1);
    match header::raw_body_len(cfg.scheme, len as u64, bucket, cfg.keep_shift()) {
        Ok(raw) => HEADER_LEN + raw,
        Err(_) => usize::MAX,
    }
}

/// Encodes gradient slices into frames; owns its scratch so repeated encodes do not allocate.
pub struct Encoder {
    cfg: CodecConfig,
    kernel: Kernel,
    /// Raw body scratch, used only when zstd is on.
    raw: Vec<u8>,
    /// topk2's selection scratch (one block of positions).
    sel: Vec<u32>,
    compressor: Option<zstd::bulk::Compressor<'static>>,
}

impl fmt::Debug for Encoder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Encoder")
            .field("cfg", &self.cfg)
            .field("kernel", &self.kernel)
            .finish_non_exhaustive()
    }
}

impl Encoder {
    /// Creates an encoder with the fastest kernel this CPU supports.
    pub fn new(cfg: CodecConfig) -> Result<Self, CodecError> {
        Encoder::with_kernel(cfg, Kernel::detect())
    }

    /// Creates an encoder that uses `kernel` (for tests and benchmarks).
    pub fn with_kernel(cfg: CodecConfig, kernel: Kernel) -> Result<Self, CodecError> {
        cfg.validate()?;
        let kernel = kernel.checked()?;
        let compressor = if cfg.zstd {
            Some(
                zstd::bulk::Compressor::new(ZSTD_LEVEL)
                    .map_err(|e| CodecError::Zstd(e.to_string()))?,
            )
        } else {
            None
        };
        Ok(Encoder {
            cfg,
            kernel,
            raw: Vec::new(),
            sel: Vec::new(),
            compressor,
        })
    }

    /// The encoder's configuration.
    pub fn config(&self) -> &CodecConfig {
        &self.cfg
    }

    /// The kernel in use.
    pub fn kernel(&self) -> Kernel {
        self.kernel
    }

    /// Clears `out` and writes one frame for `input`, with stochastic rounding driven by `seed` (see [`seed_for`]).
    /// Rejects NaN/±Inf input with [`CodecError::NonFinite`], leaving `out` empty.
    pub fn encode(
        &mut self,
        input: &[f32],
        seed: u64,
        out: &mut Vec<u8>,
    ) -> Result<(), CodecError> {
        let r = self.encode_inner(input, seed, out);
        if r.is_err() {
            out.clear();
        }
        r
    }

    /// Decodes `frame`, which this encoder's last successful `encode` produced, from the uncompressed body it
    /// kept: error feedback needs the decoded values and should not pay a zstd round trip for them.
    pub fn decode_last(&self, frame: &[u8], out: &mut [f32]) -> Result<(), CodecError> {
        let h = FrameHeader::parse(frame)?;
        if h.len != out.len() as u64 {
            return Err(CodecError::LengthMismatch {
                expected: out.len() as u64,
                found: h.len,
            });
        }
        let raw_len = h.raw_body_len();
        let body: &[u8] = if h.zstd {
            self.raw.get(..raw_len).ok_or(CodecError::Truncated)?
        } else {
            &frame[HEADER_LEN..]
        };
        decode_body(&h, body, self.kernel, out)
    }

    fn encode_inner(
        &mut self,
        input: &[f32],
        seed: u64,
        out: &mut Vec<u8>,
    ) -> Result<(), CodecError> {
        let cfg = self.cfg;
        let shift = cfg.keep_shift();
        let raw_len = header::raw_body_len(cfg.scheme, input.len() as u64, cfg.bucket, shift)?;
        let mut header = FrameHeader {
            version: VERSION,
            scheme: cfg.scheme,
            zstd: false,
            deterministic: cfg.rounding == Rounding::Deterministic,
            bucket: if cfg.scheme.is_bucketed() {
                cfg.bucket as u32
            } else {
                0
            },
            keep_shift: shift,
            len: input.len() as u64,
            body_len: raw_len as u32,
        };
        // Every byte of the frame is overwritten below, so only growth is zero-filled.
        out.resize(HEADER_LEN + raw_len, 0);
        match self.compressor.as_mut() {
            None => encode_body(
                cfg,
                self.kernel,
                input,
                seed,
                &mut self.sel,
                &mut out[HEADER_LEN..],
            )?,
            Some(zc) => {
                self.raw.resize(raw_len, 0);
                encode_body(cfg, self.kernel, input, seed, &mut self.sel, &mut self.raw)?;
                // Compress into a destination one byte shorter than raw: success means strictly smaller.
                let dst = &mut out[HEADER_LEN..HEADER_LEN + raw_len.saturating_sub(1)];
                match zc.compress_to_buffer(&self.raw[..], dst) {
                    Ok(n) if n > 0 && n < raw_len => {
                        header.zstd = true;
                        header.body_len = n as u32;
                        out.truncate(HEADER_LEN + n);
                    }
                    // Did not shrink (or zstd refused): ship the raw body.
                    _ => out[HEADER_LEN..].copy_from_slice(&self.raw),
                }
            }
        }
        header.write(out);
        Ok(())
    }
}

fn encode_body(
    cfg: CodecConfig,
    kernel: Kernel,
    input: &[f32],
    seed: u64,
    sel: &mut Vec<u32>,
    body: &mut [u8],
) -> Result<(), CodecError> {
    if cfg.scheme.is_sparse() {
        sparse::encode(
            input,
            cfg.bucket,
            cfg.keep_shift(),
            cfg.rounding,
            seed,
            sel,
            body,
        )
    } else if cfg.scheme.is_quantized() {
        quant::encode_quant(
            input,
            cfg.scheme.bits(),
            cfg.bucket,
            cfg.rounding,
            seed,
            kernel,
            body,
        )
    } else {
        float::encode_float(cfg.scheme, input, kernel, body)
    }
}

/// Strictly decodes untrusted frames; owns a zstd scratch bounded by `max_len` elements.
pub struct Decoder {
    max_len: usize,
    kernel: Kernel,
    scratch: Vec<u8>,
    decompressor: Option<zstd::bulk::Decompressor<'static>>,
}

impl fmt::Debug for Decoder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Decoder")
            .field("max_len", &self.max_len)
            .field("kernel", &self.kernel)
            .finish_non_exhaustive()
    }
}

impl Default for Decoder {
    /// A decoder of empty frames (a placeholder until a sized one replaces it).
    fn default() -> Self {
        Decoder::new(0)
    }
}

impl Decoder {
    /// Creates a decoder that accepts frames of at most `max_len` elements, with the fastest kernel available.
    pub fn new(max_len: usize) -> Self {
        Decoder {
            max_len,
            kernel: Kernel::detect(),
            scratch: Vec::new(),
            decompressor: None,
        }
    }

    /// Creates a decoder that uses `kernel` (for tests and benchmarks).
    pub fn with_kernel(max_len: usize, kernel: Kernel) -> Result<Self, CodecError> {
        Ok(Decoder {
            max_len,
            kernel: kernel.checked()?,
            scratch: Vec::new(),
            decompressor: None,
        })
    }

    /// Largest element count this decoder accepts.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// Parses and validates a frame's header (magic, version, scheme, flags, bucket, body length vs frame length).
    pub fn peek_header(frame: &[u8]) -> Result<FrameHeader, CodecError> {
        FrameHeader::parse(frame)
    }

    /// Strictly decodes `frame` into `out`, whose length is the expected element count. Never panics.
    ///
    /// Header, lengths, bucket size and all scales are validated before `out` is touched. Out-of-range codes and
    /// (for none/fp16/bf16) non-finite values are detected while writing, so on such an error `out` may be partially
    /// written: callers that must not observe partial data decode into a scratch slice first.
    pub fn decode(&mut self, frame: &[u8], out: &mut [f32]) -> Result<FrameHeader, CodecError> {
        let raw = self.open(frame, out.len())?;
        raw.decode_chunk(0, out)?;
        Ok(raw.header)
    }

    /// Validates `frame` for `len` values and makes its raw body available (decompressed into this decoder's
    /// scratch when the body is zstd), for [`RawFrame::decode_chunk`] to decode chunk by chunk, each chunk on its own
    /// (on as many threads as the caller likes). Header, lengths, bucket size, all scales and the padding of sparse
    /// codes are checked here, before any value is decoded; what is left to find while decoding is what
    /// [`Decoder::decode`] finds while writing. Never panics.
    pub fn open<'a>(&'a mut self, frame: &'a [u8], len: usize) -> Result<RawFrame<'a>, CodecError> {
        let h = FrameHeader::parse(frame)?;
        if h.len != len as u64 {
            return Err(CodecError::LengthMismatch {
                expected: len as u64,
                found: h.len,
            });
        }
        if len > self.max_len {
            return Err(CodecError::BodyTooLarge);
        }
        let raw_len = h.raw_body_len();
        let wire = &frame[HEADER_LEN..];
        let body: &[u8] = if h.zstd {
            let dz = match self.decompressor.as_mut() {
                Some(d) => d,
                None => self.decompressor.insert(
                    zstd::bulk::Decompressor::new().map_err(|e| CodecError::Zstd(e.to_string()))?,
                ),
            };
            // Bounded: raw_len derives from len ≤ max_len, never from a size the frame declares.
            if self.scratch.len() < raw_len {
                self.scratch.resize(raw_len, 0);
            }
            let dst = &mut self.scratch[..raw_len];
            let n = dz
                .decompress_to_buffer(wire, dst)
                .map_err(|e| CodecError::Zstd(e.to_string()))?;
            if n != raw_len {
                return Err(CodecError::BodyLength {
                    expected: raw_len as u64,
                    found: n as u64,
                });
            }
            &self.scratch[..raw_len]
        } else {
            wire
        };
        check_body(&h, body, len)?;
        Ok(RawFrame {
            header: h,
            body,
            kernel: self.kernel,
        })
    }
}

/// A validated frame with its raw body at hand ([`Decoder::open`]): decodes any chunk of whole buckets on its own,
/// so the chunks of one frame may be decoded in parallel. A chunk's values are bit for bit what
/// [`Decoder::decode`] writes there.
#[derive(Debug, Clone, Copy)]
pub struct RawFrame<'a> {
    header: FrameHeader,
    body: &'a [u8],
    kernel: Kernel,
}

impl RawFrame<'_> {
    /// The frame's header.
    pub fn header(&self) -> &FrameHeader {
        &self.header
    }

    /// The number of values the frame carries.
    pub fn len(&self) -> usize {
        self.header.len as usize
    }

    /// Whether the frame carries no value.
    pub fn is_empty(&self) -> bool {
        self.header.len == 0
    }

    /// Values per chunk that decode on their own: the largest whole number of buckets (blocks for topk2) up to
    /// `target`, at least one bucket; `target` itself for the unbucketed schemes. A function of the frame and
    /// `target` alone.
    pub fn chunk_len(&self, target: usize) -> usize {
        match self.header.bucket as usize {
            0 => target.max(1),
            b => b * (target / b).max(1),
        }
    }

    /// Decodes values `start..start + out.len()` into `out`. `start` must be a whole number of buckets and the
    /// chunk must end on one or at the frame's end ([`CodecError::Misaligned`] otherwise). A bad code, position or
    /// (for none/fp16/bf16) non-finite value is found while writing, and its error names its place in the whole
    /// frame, so the first failing chunk in frame order reports what [`Decoder::decode`] reports.
    pub fn decode_chunk(&self, start: usize, out: &mut [f32]) -> Result<(), CodecError> {
        let len = self.len();
        let end = start.saturating_add(out.len());
        let unit = (self.header.bucket as usize).max(1);
        if end > len || !start.is_multiple_of(unit) || (end != len && !end.is_multiple_of(unit)) {
            return Err(CodecError::Misaligned { start, end });
        }
        let h = &self.header;
        if h.scheme.is_sparse() {
            sparse::decode_at(self.body, unit, h.keep_shift, len, start, out)
        } else if h.scheme.is_quantized() {
            quant::decode_quant_at(
                self.body,
                h.scheme.bits(),
                unit,
                len,
                self.kernel,
                start,
                out,
            )
        } else {
            float::decode_float_at(h.scheme, self.body, self.kernel, start, out)
        }
    }
}

/// Checks what a raw body of `len` values holds as a whole (scales, the sparse codes' padding) before any value is
/// decoded.
fn check_body(h: &FrameHeader, body: &[u8], len: usize) -> Result<(), CodecError> {
    if h.scheme.is_sparse() {
        sparse::check(body, h.bucket as usize, h.keep_shift, len)
    } else if h.scheme.is_quantized() {
        quant::check_quant(body, h.scheme.bits(), h.bucket as usize, len)
    } else if body.len() != h.raw_body_len() {
        Err(CodecError::BodyLength {
            expected: h.raw_body_len() as u64,
            found: body.len() as u64,
        })
    } else {
        Ok(())
    }
}

/// Decodes a raw (uncompressed) body described by the validated header `h` into `out`.
fn decode_body(
    h: &FrameHeader,
    body: &[u8],
    kernel: Kernel,
    out: &mut [f32],
) -> Result<(), CodecError> {
    if h.scheme.is_sparse() {
        sparse::decode(body, h.bucket as usize, h.keep_shift, out)
    } else if h.scheme.is_quantized() {
        quant::decode_quant(body, h.scheme.bits(), h.bucket as usize, kernel, out)
    } else {
        float::decode_float(h.scheme, body, kernel, out)
    }
}

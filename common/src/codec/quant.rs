//! Bucketed stochastic quantization (q8, q4, q2): the portable scalar kernels and the dispatch to SIMD ones.
//!
//! Per bucket: `scale = max|x|`, `q = clamp(floor(x · (L/scale) + u), −L, L)` with `u` uniform in [0, 1) drawn from
//! the bucket's RNG lanes (stochastic, unbiased) or `u = 0.5` (deterministic, round to nearest), and `x̂ = q ·
//! (scale/L)`. The scalar kernels here are the reference: the AVX2 kernels perform exactly the same IEEE operations in
//! the same order on the same lanes, so both produce identical bytes and identical decoded floats. No allocation.

use super::header::code_bytes;
use super::rng::{self, LANES};
use super::{CodecError, Kernel, Rounding};

/// Elements per kernel step; every full bucket is a whole number of groups.
pub(crate) const GROUP: usize = 16;

/// Largest level `L` of a scheme with `bits` bits per code.
#[inline(always)]
pub(crate) const fn level(bits: u32) -> i32 {
    match bits {
        8 => 127,
        4 => 7,
        _ => 1,
    }
}

/// Branch-free `clamp(floor(t), −l, l)` for finite `t` with `|t| ≤ l + 2` (trunc, then correct negatives).
#[inline(always)]
fn floor_clamp(t: f32, l: i32) -> i32 {
    debug_assert!(t.is_finite() && t.abs() <= (l + 2) as f32);
    // SAFETY: callers pass t = x·(L/scale) + u with |x| ≤ scale (bucket max) and u ∈ [0, 1), so t is finite and
    // |t| ≤ L·(1 + ε) + 1, far inside i32; this is what lets the loop vectorize without saturation fix-ups.
    let i: i32 = unsafe { t.to_int_unchecked() };
    let f = i - ((i as f32 > t) as i32);
    f.clamp(-l, l)
}

/// Quantizes one group of 16 pre-scaled-by-`inv` values into codes, advancing the lanes when stochastic.
#[inline(always)]
fn group_codes<const BITS: u32, const STOCH: bool>(
    x: &[f32; GROUP],
    inv: f32,
    lanes: &mut [u32; LANES],
    codes: &mut [i8; GROUP],
) {
    let l = level(BITS);
    for j in 0..GROUP {
        let u = if STOCH {
            lanes[j] = rng::xorshift32(lanes[j]);
            rng::uniform(lanes[j])
        } else {
            0.5
        };
        let t = x[j] * inv + u;
        codes[j] = floor_clamp(t, l) as i8;
    }
}

/// Packs 16 codes into `16·BITS/8` bytes (two's complement levels, low bits first).
#[inline(always)]
fn pack_group<const BITS: u32>(c: &[i8; GROUP], out: &mut [u8]) {
    match BITS {
        8 => {
            for (o, &q) in out[..16].iter_mut().zip(c) {
                *o = q as u8;
            }
        }
        4 => {
            for (k, o) in out[..8].iter_mut().enumerate() {
                *o = (c[2 * k] as u8 & 0xF) | ((c[2 * k + 1] as u8) << 4);
            }
        }
        _ => {
            for (k, o) in out[..4].iter_mut().enumerate() {
                *o = (c[4 * k] as u8 & 3)
                    | ((c[4 * k + 1] as u8 & 3) << 2)
                    | ((c[4 * k + 2] as u8 & 3) << 4)
                    | ((c[4 * k + 3] as u8) << 6);
            }
        }
    }
}

/// Quantizes the final partial group (fewer than 16 values): zero-padded, so padding codes and bits are zero.
#[inline]
pub(crate) fn quant_tail<const BITS: u32, const STOCH: bool>(
    rem: &[f32],
    inv: f32,
    lanes: &mut [u32; LANES],
    out: &mut [u8],
) {
    let mut pad = [0f32; GROUP];
    pad[..rem.len()].copy_from_slice(rem);
    let mut codes = [0i8; GROUP];
    group_codes::<BITS, STOCH>(&pad, inv, lanes, &mut codes);
    let mut bytes = [0u8; GROUP];
    pack_group::<BITS>(&codes, &mut bytes);
    let n = code_bytes(rem.len(), BITS);
    out[..n].copy_from_slice(&bytes[..n]);
}

/// Scalar reference kernel for one bucket; `out` holds exactly the bucket's code bytes.
pub(crate) fn quant_bucket_scalar<const BITS: u32, const STOCH: bool>(
    x: &[f32],
    inv: f32,
    lanes: &mut [u32; LANES],
    out: &mut [u8],
) {
    let gbytes = GROUP * BITS as usize / 8;
    let full = x.len() / GROUP;
    let mut codes = [0i8; GROUP];
    for (g, o) in x.chunks_exact(GROUP).zip(out.chunks_exact_mut(gbytes)) {
        let g: &[f32; GROUP] = g.try_into().expect("chunks_exact yields GROUP elements");
        group_codes::<BITS, STOCH>(g, inv, lanes, &mut codes);
        pack_group::<BITS>(&codes, o);
    }
    let rem = &x[full * GROUP..];
    if !rem.is_empty() {
        quant_tail::<BITS, STOCH>(rem, inv, lanes, &mut out[full * gbytes..]);
    }
}

/// Kernel for buckets whose scale is so small that `L/scale` overflows f32: scales in f64 first, then rounds with
/// the same lanes. Shared by every kernel choice, so output stays identical.
fn quant_bucket_tiny<const BITS: u32, const STOCH: bool>(
    x: &[f32],
    scale: f32,
    lanes: &mut [u32; LANES],
    out: &mut [u8],
) {
    let gbytes = GROUP * BITS as usize / 8;
    let k = f64::from(level(BITS)) / f64::from(scale);
    let mut codes = [0i8; GROUP];
    let mut y = [0f32; GROUP];
    let mut chunks = x.chunks(GROUP);
    for (g, o) in (&mut chunks).zip(out.chunks_mut(gbytes)) {
        for (yv, &xv) in y.iter_mut().zip(g) {
            *yv = (f64::from(xv) * k) as f32;
        }
        if g.len() == GROUP {
            group_codes::<BITS, STOCH>(&y, 1.0, lanes, &mut codes);
            pack_group::<BITS>(&codes, o);
        } else {
            quant_tail::<BITS, STOCH>(&y[..g.len()], 1.0, lanes, o);
        }
    }
}

/// Largest `|x|` as f32 bits (order-preserving for non-negative floats); ≥ 0x7F80_0000 means NaN or ±Inf present.
#[inline]
pub(crate) fn absmax_bits_scalar(x: &[f32]) -> u32 {
    let mut m = [0u32; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for (mj, &v) in m.iter_mut().zip(c) {
            *mj = (*mj).max(v.to_bits() & 0x7FFF_FFFF);
        }
    }
    let mut r = m.into_iter().max().unwrap_or(0);
    for &v in chunks.remainder() {
        r = r.max(v.to_bits() & 0x7FFF_FFFF);
    }
    r
}

/// Largest `|x|` as f32 bits using `kernel`; ≥ 0x7F80_0000 means NaN or ±Inf present.
pub(crate) fn absmax_bits(x: &[f32], kernel: Kernel) -> u32 {
    match kernel {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a Kernel::Avx2 value is only constructed after runtime detection of AVX2 (Kernel::available).
        Kernel::Avx2 => unsafe { super::avx2::absmax_bits(x) },
        _ => absmax_bits_scalar(x),
    }
}

/// Encodes `input` into the raw quantized body `body` (exactly `raw_body_len` bytes).
pub(crate) fn encode_quant(
    input: &[f32],
    bits: u32,
    bucket: usize,
    rounding: Rounding,
    seed: u64,
    kernel: Kernel,
    body: &mut [u8],
) -> Result<(), CodecError> {
    let stoch = rounding == Rounding::Stochastic;
    match (bits, stoch) {
        (8, true) => encode_impl::<8, true>(input, bucket, seed, kernel, body),
        (8, false) => encode_impl::<8, false>(input, bucket, seed, kernel, body),
        (4, true) => encode_impl::<4, true>(input, bucket, seed, kernel, body),
        (4, false) => encode_impl::<4, false>(input, bucket, seed, kernel, body),
        (_, true) => encode_impl::<2, true>(input, bucket, seed, kernel, body),
        (_, false) => encode_impl::<2, false>(input, bucket, seed, kernel, body),
    }
}

fn encode_impl<const BITS: u32, const STOCH: bool>(
    input: &[f32],
    bucket: usize,
    seed: u64,
    kernel: Kernel,
    body: &mut [u8],
) -> Result<(), CodecError> {
    let nb = input.len().div_ceil(bucket);
    let (scales, codes) = body.split_at_mut(4 * nb);
    let bbytes = code_bytes(bucket, BITS);
    let l = level(BITS);
    for (b, (x, sc)) in input
        .chunks(bucket)
        .zip(scales.chunks_exact_mut(4))
        .enumerate()
    {
        let mbits = absmax_bits(x, kernel);
        if mbits >= 0x7F80_0000 {
            let at = x.iter().position(|v| !v.is_finite()).unwrap_or(0);
            return Err(CodecError::NonFinite {
                index: b * bucket + at,
            });
        }
        let scale = f32::from_bits(mbits);
        sc.copy_from_slice(&scale.to_le_bytes());
        let start = b * bbytes;
        let out = &mut codes[start..start + code_bytes(x.len(), BITS)];
        if mbits == 0 {
            out.fill(0);
            continue;
        }
        let mut lanes = if STOCH {
            rng::bucket_lanes(seed, b as u64)
        } else {
            [0u32; LANES]
        };
        let inv = l as f32 / scale;
        if !inv.is_finite() {
            quant_bucket_tiny::<BITS, STOCH>(x, scale, &mut lanes, out);
            continue;
        }
        match kernel {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: Kernel::Avx2 exists only after runtime AVX2 detection; `out` is exactly the bucket's code bytes.
            Kernel::Avx2 => unsafe {
                super::avx2::quant_bucket::<BITS, STOCH>(x, inv, &mut lanes, out)
            },
            _ => quant_bucket_scalar::<BITS, STOCH>(x, inv, &mut lanes, out),
        }
    }
    Ok(())
}

/// Scalar dequantization of one bucket (or its tail); `codes` is exactly `code_bytes(out.len())` bytes. Returns
/// false if a code is out of range (−L−1) or a padding bit is set.
pub(crate) fn dequant_scalar<const BITS: u32>(codes: &[u8], step: f32, out: &mut [f32]) -> bool {
    let bad_code = -(level(BITS) + 1);
    let mut bad = false;
    match BITS {
        8 => {
            for (o, &c) in out.iter_mut().zip(codes) {
                let q = c as i8;
                bad |= i32::from(q) == bad_code;
                *o = f32::from(q) * step;
            }
        }
        4 => {
            let mut pairs = out.chunks_exact_mut(2);
            for (o, &c) in (&mut pairs).zip(codes) {
                let lo = ((c << 4) as i8) >> 4;
                let hi = (c as i8) >> 4;
                bad |= (i32::from(lo) == bad_code) | (i32::from(hi) == bad_code);
                o[0] = f32::from(lo) * step;
                o[1] = f32::from(hi) * step;
            }
            if let [last] = pairs.into_remainder() {
                let c = codes[codes.len() - 1];
                let lo = ((c << 4) as i8) >> 4;
                bad |= (i32::from(lo) == bad_code) | (c >> 4 != 0);
                *last = f32::from(lo) * step;
            }
        }
        _ => {
            let mut quads = out.chunks_exact_mut(4);
            for (o, &c) in (&mut quads).zip(codes) {
                for (k, ok) in o.iter_mut().enumerate() {
                    let q = ((c << (6 - 2 * k)) as i8) >> 6;
                    bad |= i32::from(q) == bad_code;
                    *ok = f32::from(q) * step;
                }
            }
            let rem = quads.into_remainder();
            if !rem.is_empty() {
                let c = codes[codes.len() - 1];
                for (k, ok) in rem.iter_mut().enumerate() {
                    let q = ((c << (6 - 2 * k)) as i8) >> 6;
                    bad |= i32::from(q) == bad_code;
                    *ok = f32::from(q) * step;
                }
                bad |= (c >> (2 * rem.len())) != 0;
            }
        }
    }
    !bad
}

/// Decodes a raw quantized body into `out` (whose length is the frame's element count, already checked). All scales
/// are validated before anything is written; a bad code is detected after its bucket was written.
pub(crate) fn decode_quant(
    body: &[u8],
    bits: u32,
    bucket: usize,
    kernel: Kernel,
    out: &mut [f32],
) -> Result<(), CodecError> {
    check_quant(body, bits, bucket, out.len())?;
    decode_quant_at(body, bits, bucket, out.len(), kernel, 0, out)
}

/// Checks a raw quantized body of `len` values as a whole: its length, and every bucket's scale (sign bit, NaN, ±∞).
pub(crate) fn check_quant(
    body: &[u8],
    bits: u32,
    bucket: usize,
    len: usize,
) -> Result<(), CodecError> {
    let nb = len.div_ceil(bucket);
    if body.len() < 4 * nb {
        return Err(CodecError::Truncated);
    }
    let (scales, codes) = body.split_at(4 * nb);
    if codes.len() != code_bytes(len, bits) {
        return Err(CodecError::BodyLength {
            expected: code_bytes(len, bits) as u64,
            found: codes.len() as u64,
        });
    }
    for s in scales.chunks_exact(4) {
        let bits = u32::from_le_bytes([s[0], s[1], s[2], s[3]]);
        // Sign bit set (including −0.0), NaN or ±Inf.
        if bits >= 0x7F80_0000 {
            return Err(CodecError::BadScale);
        }
    }
    Ok(())
}

/// Decodes values `start..start + out.len()` of a raw quantized body of `len` values that [`check_quant`] accepted;
/// `start` is a whole number of buckets, and so is `out.len()` unless the slice ends the frame. A bad code is found
/// after its bucket was written (the error names the bucket's index in the frame).
pub(crate) fn decode_quant_at(
    body: &[u8],
    bits: u32,
    bucket: usize,
    len: usize,
    kernel: Kernel,
    start: usize,
    out: &mut [f32],
) -> Result<(), CodecError> {
    match bits {
        8 => decode_impl::<8>(body, bucket, len, kernel, start, out),
        4 => decode_impl::<4>(body, bucket, len, kernel, start, out),
        _ => decode_impl::<2>(body, bucket, len, kernel, start, out),
    }
}

fn decode_impl<const BITS: u32>(
    body: &[u8],
    bucket: usize,
    len: usize,
    kernel: Kernel,
    start: usize,
    out: &mut [f32],
) -> Result<(), CodecError> {
    let nb = len.div_ceil(bucket);
    let (scales, codes) = body.split_at(4 * nb);
    let bbytes = code_bytes(bucket, BITS);
    let l = level(BITS) as f32;
    let first = start / bucket;
    for (b, o) in (first..).zip(out.chunks_mut(bucket)) {
        let s = &scales[4 * b..4 * b + 4];
        let scale = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
        let step = scale / l;
        let at = b * bbytes;
        let c = &codes[at..at + code_bytes(o.len(), BITS)];
        let ok = match kernel {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: Kernel::Avx2 exists only after runtime AVX2 detection; `c` holds exactly `o`'s code bytes.
            Kernel::Avx2 => unsafe { super::avx2::dequant_bucket::<BITS>(c, step, o) },
            _ => dequant_scalar::<BITS>(c, step, o),
        };
        if !ok {
            return Err(CodecError::BadCode { bucket: b });
        }
    }
    Ok(())
}

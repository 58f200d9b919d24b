//! Block top-k with 2-bit values (`topk2`): the sparse scheme for pseudo-gradients and pull deltas over slow links.
//!
//! Per block of B values (the configured bucket, at most [`MAX_SPARSE_BLOCK`]) the encoder keeps the
//! `k = ceil(n / keep)` values of largest magnitude (`n` is the block's length, `keep` a power of two carried in the
//! header) and codes each kept value in 2 bits: a sign bit and a magnitude bit choosing between the block's two
//! scales `lo` (smallest kept magnitude) and `hi` (largest). The magnitude is rounded stochastically between them
//! (unbiased for every kept value) or to the nearest. Everything not kept decodes to zero; the worker's error
//! feedback (or the shard's public copy) carries it into the next frame, so nothing is lost, only delayed.
//!
//! Raw body: all blocks' scales (`lo`, `hi` as f32), then every kept value's position as a u16 gap from the previous
//! kept position of its block (the first from 0), then the 2-bit codes of all kept values in order (bit 0 the
//! magnitude, bit 1 the sign, four per byte, low bits first, zero padding). The gaps are small numbers, which is
//! what zstd then squeezes. Decoding validates scales, positions (strictly increasing, inside the block) and padding,
//! and never allocates. Pure functions of their inputs; the encoder's selection scratch is the caller's.

use super::header::code_bytes;
use super::rng::{self, LANES};
use super::{CodecError, Rounding};

/// Largest block of the sparse scheme: positions inside a block are coded as u16 gaps.
pub const MAX_SPARSE_BLOCK: usize = 1 << 16;

/// Smallest and largest `log2(keep)` a header may carry (keep one value in 2 … 32768).
pub(crate) const SHIFTS: std::ops::RangeInclusive<u8> = 1..=15;

/// Kept values in a block of `n` values when one in `2^shift` is kept (at least one).
#[inline]
pub(crate) fn kept(n: usize, shift: u8) -> usize {
    n.div_ceil(1usize << shift).max(usize::from(n > 0))
}

/// Kept values over a whole range of `len` values in blocks of `block`, with checked arithmetic.
pub(crate) fn kept_total(len: u64, block: u64, shift: u8) -> Option<u64> {
    let block = block.max(1);
    let full = len / block;
    let tail = len % block;
    let per_block = block.div_ceil(1u64 << shift).max(1);
    let tail_kept = if tail == 0 {
        0
    } else {
        tail.div_ceil(1u64 << shift).max(1)
    };
    full.checked_mul(per_block)?.checked_add(tail_kept)
}

/// Raw body bytes of `len` values: 8 bytes of scales per block, 2 per kept position, 2 bits per kept code.
pub(crate) fn raw_len(len: u64, block: u64, shift: u8) -> Option<u64> {
    let blocks = len.div_ceil(block.max(1));
    let k = kept_total(len, block, shift)?;
    blocks
        .checked_mul(8)?
        .checked_add(k.checked_mul(2)?)?
        .checked_add(k.checked_mul(2)?.div_ceil(8))
}

/// Encodes `input` into the raw sparse body `body` (exactly [`raw_len`] bytes); `sel` is selection scratch.
pub(crate) fn encode(
    input: &[f32],
    block: usize,
    shift: u8,
    rounding: Rounding,
    seed: u64,
    sel: &mut Vec<u32>,
    body: &mut [u8],
) -> Result<(), CodecError> {
    if let Some(at) = input.iter().position(|v| !v.is_finite()) {
        return Err(CodecError::NonFinite { index: at });
    }
    let nb = input.len().div_ceil(block);
    let k_total = body_parts(input.len(), block, shift);
    let (scales, rest) = body.split_at_mut(8 * nb);
    let (gaps, codes) = rest.split_at_mut(2 * k_total);
    codes.fill(0);
    let mut at = 0usize; // kept values written so far
    for (b, x) in input.chunks(block).enumerate() {
        let k = kept(x.len(), shift);
        select_top(x, k, sel);
        let (mut lo, mut hi) = (f32::INFINITY, 0.0f32);
        for &i in sel.iter() {
            let m = x[i as usize].abs();
            lo = lo.min(m);
            hi = hi.max(m);
        }
        scales[8 * b..8 * b + 4].copy_from_slice(&lo.to_le_bytes());
        scales[8 * b + 4..8 * b + 8].copy_from_slice(&hi.to_le_bytes());
        let width = hi - lo;
        let mut lanes = match rounding {
            Rounding::Stochastic => rng::bucket_lanes(seed, b as u64),
            Rounding::Deterministic => [0u32; LANES],
        };
        let mut prev = 0u32;
        for (j, &i) in sel.iter().enumerate() {
            let gap = (i - prev) as u16; // i < block ≤ 2^16 and sorted, so the gap fits
            prev = i;
            gaps[2 * at..2 * at + 2].copy_from_slice(&gap.to_le_bytes());
            let v = x[i as usize];
            let u = match rounding {
                Rounding::Stochastic => {
                    let lane = &mut lanes[j % LANES];
                    *lane = rng::xorshift32(*lane);
                    rng::uniform(*lane)
                }
                Rounding::Deterministic => 0.5,
            };
            // P(hi) = (|v| − lo) / (hi − lo): unbiased between the two scales.
            let high = width > 0.0 && (v.abs() - lo) > (1.0 - u) * width;
            let code = u8::from(high) | (u8::from(v.is_sign_negative() && v != 0.0) << 1);
            codes[at / 4] |= code << (2 * (at % 4));
            at += 1;
        }
    }
    debug_assert_eq!(at, k_total);
    Ok(())
}

/// Number of kept values (the body's layout follows from it).
fn body_parts(len: usize, block: usize, shift: u8) -> usize {
    // The caller sized the body with raw_len, which proved this fits.
    kept_total(len as u64, block as u64, shift).unwrap_or(0) as usize
}

/// Leaves in `sel` the positions of the `k` largest magnitudes of `x`, in increasing order (ties: lower position
/// first, so the choice is a pure function of `x`). The magnitudes of finite floats order as their bit patterns, so
/// the k-th largest is found by `select_nth_unstable` over contiguous u32s (no indirection), then one scan keeps
/// everything above it and the first equal ones.
fn select_top(x: &[f32], k: usize, sel: &mut Vec<u32>) {
    sel.clear();
    if k >= x.len() {
        sel.extend(0..x.len() as u32);
        return;
    }
    sel.extend(x.iter().map(|v| v.to_bits() & 0x7FFF_FFFF));
    let (_, &mut t, _) = sel.select_nth_unstable_by(k - 1, |a, b| b.cmp(a));
    let above = sel.iter().filter(|&&m| m > t).count();
    let mut equal_left = k - above;
    sel.clear();
    for (i, v) in x.iter().enumerate() {
        let m = v.to_bits() & 0x7FFF_FFFF;
        if m > t || (m == t && equal_left > 0) {
            if m == t {
                equal_left -= 1;
            }
            sel.push(i as u32);
        }
    }
}

/// A block's `(lo, hi)` from its 8 bytes of scales.
#[inline]
fn block_scales(s: &[u8]) -> (f32, f32) {
    (
        f32::from_le_bytes([s[0], s[1], s[2], s[3]]),
        f32::from_le_bytes([s[4], s[5], s[6], s[7]]),
    )
}

/// Strictly decodes a raw sparse body into `out` (whose length the header was checked against). Scales are checked
/// before `out` is touched; a bad position or padding bit is found while writing (the caller decodes into scratch
/// when it must not observe partial data).
pub(crate) fn decode(
    body: &[u8],
    block: usize,
    shift: u8,
    out: &mut [f32],
) -> Result<(), CodecError> {
    check(body, block, shift, out.len())?;
    decode_at(body, block, shift, out.len(), 0, out)
}

/// Checks a raw sparse body of `len` values as a whole: its length, every block's scales, and the codes' padding.
pub(crate) fn check(body: &[u8], block: usize, shift: u8, len: usize) -> Result<(), CodecError> {
    let nb = len.div_ceil(block);
    let k_total = body_parts(len, block, shift);
    let need = 8 * nb + 2 * k_total + code_bytes(k_total, 2);
    if body.len() != need {
        return Err(CodecError::BodyLength {
            expected: need as u64,
            found: body.len() as u64,
        });
    }
    let (scales, rest) = body.split_at(8 * nb);
    let codes = &rest[2 * k_total..];
    for s in scales.chunks_exact(8) {
        let (lo, hi) = block_scales(s);
        if !(lo.is_finite() && hi.is_finite() && lo >= 0.0 && lo <= hi) {
            return Err(CodecError::BadScale);
        }
    }
    let tail_bits = (2 * k_total) % 8;
    if tail_bits != 0 && codes.last().is_some_and(|&c| c >> tail_bits != 0) {
        return Err(CodecError::BadCode { bucket: nb - 1 });
    }
    Ok(())
}

/// Decodes values `start..start + out.len()` of a raw sparse body of `len` values that [`check`] accepted; `start`
/// is a whole number of blocks, and so is `out.len()` unless the slice ends the frame. Every block before `start` is
/// whole, so its kept values are counted without reading them. A bad position is found while writing (the error
/// names the block's index in the frame).
pub(crate) fn decode_at(
    body: &[u8],
    block: usize,
    shift: u8,
    len: usize,
    start: usize,
    out: &mut [f32],
) -> Result<(), CodecError> {
    let nb = len.div_ceil(block);
    let k_total = body_parts(len, block, shift);
    let (scales, rest) = body.split_at(8 * nb);
    let (gaps, codes) = rest.split_at(2 * k_total);
    out.fill(0.0);
    let first = start / block;
    let mut at = first * kept(block, shift);
    for (b, o) in (first..).zip(out.chunks_mut(block)) {
        let (lo, hi) = block_scales(&scales[8 * b..8 * b + 8]);
        let mut pos = 0usize;
        for j in 0..kept(o.len(), shift) {
            let gap = usize::from(u16::from_le_bytes([gaps[2 * at], gaps[2 * at + 1]]));
            if j > 0 && gap == 0 {
                return Err(CodecError::BadCode { bucket: b });
            }
            pos += gap;
            let code = (codes[at / 4] >> (2 * (at % 4))) & 3;
            let slot = o.get_mut(pos).ok_or(CodecError::BadCode { bucket: b })?;
            let m = if code & 1 == 1 { hi } else { lo };
            *slot = if code & 2 == 2 { -m } else { m };
            at += 1;
        }
    }
    Ok(())
}

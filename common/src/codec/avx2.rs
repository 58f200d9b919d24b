//! AVX2 kernels for bucket max, quantization and dequantization (x86_64 only, selected at runtime).
//!
//! Invariant: every function here computes exactly what its scalar twin in `quant` computes — same RNG lanes (lanes
//! 0–7 in one vector, 8–15 in the other), same IEEE operations in the same order (no FMA contraction), same packing —
//! so frames and decoded values are bit-identical whichever kernel runs. Callers must have detected AVX2.

use std::arch::x86_64::*;

use super::header::code_bytes;
use super::quant::{self, level, GROUP};
use super::rng::{LANES, U24};

/// Largest `|x|` as f32 bits; see `quant::absmax_bits_scalar`.
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn absmax_bits(x: &[f32]) -> u32 {
    let mask = _mm256_set1_epi32(0x7FFF_FFFF);
    let mut m0 = _mm256_setzero_si256();
    let mut m1 = _mm256_setzero_si256();
    let mut chunks = x.chunks_exact(GROUP);
    for c in &mut chunks {
        let p = c.as_ptr().cast::<__m256i>();
        // SAFETY: `c` holds 16 f32 = two unaligned 32-byte loads.
        let (a, b) = unsafe { (_mm256_loadu_si256(p), _mm256_loadu_si256(p.add(1))) };
        m0 = _mm256_max_epu32(m0, _mm256_and_si256(a, mask));
        m1 = _mm256_max_epu32(m1, _mm256_and_si256(b, mask));
    }
    let m = _mm256_max_epu32(m0, m1);
    let mut lanes = [0u32; 8];
    // SAFETY: `lanes` is 32 bytes; unaligned store.
    unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), m) };
    let simd = lanes.into_iter().max().unwrap_or(0);
    simd.max(quant::absmax_bits_scalar(chunks.remainder()))
}

#[inline]
#[target_feature(enable = "avx2")]
fn xorshift(s: __m256i) -> __m256i {
    let s = _mm256_xor_si256(s, _mm256_slli_epi32::<13>(s));
    let s = _mm256_xor_si256(s, _mm256_srli_epi32::<17>(s));
    _mm256_xor_si256(s, _mm256_slli_epi32::<5>(s))
}

/// `clamp(floor(x·inv + u), lo, hi)` per lane, exactly as `quant::floor_clamp`.
#[inline]
#[target_feature(enable = "avx2")]
fn quant8(x: __m256, inv: __m256, u: __m256, lo: __m256i, hi: __m256i) -> __m256i {
    let t = _mm256_add_ps(_mm256_mul_ps(x, inv), u);
    let i = _mm256_cvttps_epi32(t);
    let gt = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GT_OQ>(_mm256_cvtepi32_ps(i), t));
    let f = _mm256_add_epi32(i, gt);
    _mm256_max_epi32(_mm256_min_epi32(f, hi), lo)
}

/// Quantizes one bucket; `out` is exactly the bucket's code bytes. Same contract as `quant::quant_bucket_scalar`.
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn quant_bucket<const BITS: u32, const STOCH: bool>(
    x: &[f32],
    inv: f32,
    lanes: &mut [u32; LANES],
    out: &mut [u8],
) {
    let gbytes = GROUP * BITS as usize / 8;
    let full = x.len() / GROUP;
    assert!(
        out.len() >= code_bytes(x.len(), BITS),
        "code slice too short for bucket"
    );
    let l = level(BITS);
    let vinv = _mm256_set1_ps(inv);
    let u24 = _mm256_set1_ps(U24);
    let half = _mm256_set1_ps(0.5);
    let lo = _mm256_set1_epi32(-l);
    let hi = _mm256_set1_epi32(l);
    // SAFETY: `lanes` is 16 u32 = two unaligned 32-byte loads.
    let (mut s0, mut s1) = unsafe {
        let p = lanes.as_ptr().cast::<__m256i>();
        (_mm256_loadu_si256(p), _mm256_loadu_si256(p.add(1)))
    };
    let xp = x.as_ptr();
    let op = out.as_mut_ptr();
    for g in 0..full {
        // SAFETY: g < full, so elements [16g, 16g+16) are in `x`.
        let (x0, x1) = unsafe {
            (
                _mm256_loadu_ps(xp.add(g * GROUP)),
                _mm256_loadu_ps(xp.add(g * GROUP + 8)),
            )
        };
        let (u0, u1) = if STOCH {
            s0 = xorshift(s0);
            s1 = xorshift(s1);
            (
                _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32::<8>(s0)), u24),
                _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32::<8>(s1)), u24),
            )
        } else {
            (half, half)
        };
        let q0 = quant8(x0, vinv, u0, lo, hi);
        let q1 = quant8(x1, vinv, u1, lo, hi);
        // i32 -> i16 (lane-interleaved), reorder 64-bit blocks, i16 -> i8: 16 codes in element order.
        let p16 = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi32(q0, q1));
        let c = _mm_packs_epi16(
            _mm256_castsi256_si128(p16),
            _mm256_extracti128_si256::<1>(p16),
        );
        // SAFETY: bytes [g·gbytes, (g+1)·gbytes) lie within `out` (asserted above, g < full); unaligned stores.
        unsafe {
            let dst = op.add(g * gbytes);
            match BITS {
                8 => _mm_storeu_si128(dst.cast(), c),
                4 => {
                    let m = _mm_and_si128(c, _mm_set1_epi8(0x0F));
                    let r = _mm_maddubs_epi16(m, _mm_set1_epi16(0x1001));
                    _mm_storel_epi64(dst.cast(), _mm_packus_epi16(r, r));
                }
                _ => {
                    let m = _mm_and_si128(c, _mm_set1_epi8(3));
                    let r = _mm_maddubs_epi16(m, _mm_set1_epi16(0x0401));
                    let r = _mm_madd_epi16(r, _mm_set1_epi32(0x0010_0001));
                    let r = _mm_packus_epi32(r, r);
                    let r = _mm_packus_epi16(r, r);
                    dst.cast::<i32>().write_unaligned(_mm_cvtsi128_si32(r));
                }
            }
        }
    }
    // SAFETY: `lanes` is 16 u32 = two unaligned 32-byte stores.
    unsafe {
        let p = lanes.as_mut_ptr().cast::<__m256i>();
        _mm256_storeu_si256(p, s0);
        _mm256_storeu_si256(p.add(1), s1);
    }
    let rem = &x[full * GROUP..];
    if !rem.is_empty() {
        quant::quant_tail::<BITS, STOCH>(rem, inv, lanes, &mut out[full * gbytes..]);
    }
}

/// Dequantizes one bucket; `codes` is exactly `code_bytes(out.len())` bytes. Same contract as
/// `quant::dequant_scalar`.
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn dequant_bucket<const BITS: u32>(
    codes: &[u8],
    step: f32,
    out: &mut [f32],
) -> bool {
    let gbytes = GROUP * BITS as usize / 8;
    let full = out.len() / GROUP;
    assert!(
        codes.len() >= full * gbytes,
        "code slice too short for bucket"
    );
    let vstep = _mm256_set1_ps(step);
    let badv = _mm256_set1_epi32(-(level(BITS) + 1));
    let mut bad = _mm256_setzero_si256();
    let cp = codes.as_ptr();
    let op = out.as_mut_ptr();
    for g in 0..full {
        // SAFETY: g < full, so code bytes [g·gbytes, (g+1)·gbytes) and outputs [16g, 16g+16) are in bounds.
        unsafe {
            let src = cp.add(g * gbytes);
            let (c0, c1) = match BITS {
                8 => {
                    let v = _mm_loadu_si128(src.cast());
                    (
                        _mm256_cvtepi8_epi32(v),
                        _mm256_cvtepi8_epi32(_mm_srli_si128::<8>(v)),
                    )
                }
                4 => {
                    let w = src.cast::<u64>().read_unaligned().to_le();
                    let sh = _mm256_setr_epi32(28, 24, 20, 16, 12, 8, 4, 0);
                    let a = _mm256_sllv_epi32(_mm256_set1_epi32(w as u32 as i32), sh);
                    let b = _mm256_sllv_epi32(_mm256_set1_epi32((w >> 32) as u32 as i32), sh);
                    (_mm256_srai_epi32::<28>(a), _mm256_srai_epi32::<28>(b))
                }
                _ => {
                    let w = src.cast::<u32>().read_unaligned().to_le();
                    let sh = _mm256_setr_epi32(30, 28, 26, 24, 22, 20, 18, 16);
                    let a = _mm256_sllv_epi32(_mm256_set1_epi32((w & 0xFFFF) as i32), sh);
                    let b = _mm256_sllv_epi32(_mm256_set1_epi32((w >> 16) as i32), sh);
                    (_mm256_srai_epi32::<30>(a), _mm256_srai_epi32::<30>(b))
                }
            };
            bad = _mm256_or_si256(
                bad,
                _mm256_or_si256(_mm256_cmpeq_epi32(c0, badv), _mm256_cmpeq_epi32(c1, badv)),
            );
            let dst = op.add(g * GROUP);
            _mm256_storeu_ps(dst, _mm256_mul_ps(_mm256_cvtepi32_ps(c0), vstep));
            _mm256_storeu_ps(dst.add(8), _mm256_mul_ps(_mm256_cvtepi32_ps(c1), vstep));
        }
    }
    let simd_ok = _mm256_testz_si256(bad, bad) == 1;
    let tail_ok =
        quant::dequant_scalar::<BITS>(&codes[full * gbytes..], step, &mut out[full * GROUP..]);
    simd_ok && tail_ok
}

//! The unquantized schemes: none (f32), fp16 and bf16 bodies, little-endian.
//!
//! Encoding rejects NaN/±Inf input and saturates finite values beyond the format's range to its largest finite value
//! (so a frame never carries an infinity); decoding rejects any non-finite value. fp16 conversion goes through `half`,
//! which uses F16C when the CPU has it; bf16 goes through `half` too (round to nearest even), the workspace's one bf16
//! conversion. No allocation.

use half::{f16, slice::HalfFloatSliceExt};

use super::quant::absmax_bits;
use super::{CodecError, Kernel, Scheme};

/// Values converted per stack-buffered chunk.
const CHUNK: usize = 256;

fn first_non_finite(x: &[f32], base: usize) -> CodecError {
    CodecError::NonFinite {
        index: base + x.iter().position(|v| !v.is_finite()).unwrap_or(0),
    }
}

/// Encodes `input` as a raw none/fp16/bf16 body into `body` (exactly the raw body length).
pub(crate) fn encode_float(
    scheme: Scheme,
    input: &[f32],
    kernel: Kernel,
    body: &mut [u8],
) -> Result<(), CodecError> {
    // One vectorized finiteness pass up front keeps the conversion loops branch- and flag-free.
    if absmax_bits(input, kernel) >= 0x7F80_0000 {
        return Err(first_non_finite(input, 0));
    }
    match scheme {
        Scheme::None => {
            for (o, &v) in body.chunks_exact_mut(4).zip(input) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        Scheme::Fp16 => {
            let max = f16::MAX.to_f32();
            let mut buf = [0f32; CHUNK];
            let mut half = [f16::ZERO; CHUNK];
            for (x, o) in input.chunks(CHUNK).zip(body.chunks_mut(2 * CHUNK)) {
                for (b, &v) in buf.iter_mut().zip(x) {
                    *b = v.clamp(-max, max);
                }
                half[..x.len()].convert_from_f32_slice(&buf[..x.len()]);
                for (ob, h) in o.chunks_exact_mut(2).zip(&half[..x.len()]) {
                    ob.copy_from_slice(&h.to_bits().to_le_bytes());
                }
            }
        }
        Scheme::Bf16 => {
            let max = half::bf16::MAX.to_f32();
            for (o, &v) in body.chunks_exact_mut(2).zip(input) {
                o.copy_from_slice(&half::bf16::from_f32(v.clamp(-max, max)).to_le_bytes());
            }
        }
        _ => unreachable!("encode_float is only called for none/fp16/bf16"),
    }
    Ok(())
}

/// Decodes a raw none/fp16/bf16 body into `out` (lengths already checked); rejects non-finite values.
pub(crate) fn decode_float(
    scheme: Scheme,
    body: &[u8],
    kernel: Kernel,
    out: &mut [f32],
) -> Result<(), CodecError> {
    decode_float_at(scheme, body, kernel, 0, out)
}

/// Decodes values `start..start + out.len()` of a raw none/fp16/bf16 body (lengths already checked); rejects
/// non-finite values, naming the first one's index in the frame.
pub(crate) fn decode_float_at(
    scheme: Scheme,
    body: &[u8],
    kernel: Kernel,
    start: usize,
    out: &mut [f32],
) -> Result<(), CodecError> {
    let width = if scheme == Scheme::None { 4 } else { 2 };
    let body = &body[start * width..(start + out.len()) * width];
    match scheme {
        Scheme::None => {
            for (o, b) in out.iter_mut().zip(body.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        Scheme::Fp16 => {
            let mut half = [f16::ZERO; CHUNK];
            for (o, b) in out.chunks_mut(CHUNK).zip(body.chunks(2 * CHUNK)) {
                for (h, hb) in half.iter_mut().zip(b.chunks_exact(2)) {
                    *h = f16::from_bits(u16::from_le_bytes([hb[0], hb[1]]));
                }
                half[..o.len()].convert_to_f32_slice(o);
            }
        }
        Scheme::Bf16 => {
            for (o, b) in out.iter_mut().zip(body.chunks_exact(2)) {
                *o = half::bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        _ => unreachable!("decode_float is only called for none/fp16/bf16"),
    }
    if absmax_bits(out, kernel) >= 0x7F80_0000 {
        return Err(first_non_finite(out, start));
    }
    Ok(())
}

//! Parameter values on the wire: little-endian f32 or bfloat16 ([`Precision`]), the body of a full pull reply.
//!
//! The only f32 ⇄ bf16 conversion of the workspace is the `half` crate's (round to nearest even); this module and the
//! codec's bf16 scheme both go through it. Encoding sizes the output once and writes fixed-width chunks, so the loops
//! compile to straight copies (f32) or conversions (bf16); decoding never reads past either slice.

use super::Precision;

/// Replaces the contents of `out` with `values` as little-endian values in `precision` (only growth is zero-filled,
/// so a reused buffer is written in one pass).
pub fn encode_values(values: &[f32], precision: Precision, out: &mut Vec<u8>) {
    let len = values.len() * precision.width();
    out.truncate(len);
    out.resize(len, 0);
    match precision {
        Precision::F32 => {
            for (dst, v) in out.chunks_exact_mut(4).zip(values) {
                dst.copy_from_slice(&v.to_le_bytes());
            }
        }
        Precision::Bf16 => {
            for (dst, v) in out.chunks_exact_mut(2).zip(values) {
                dst.copy_from_slice(&half::bf16::from_f32(*v).to_le_bytes());
            }
        }
    }
}

/// Converts little-endian `bytes` in `precision` into `out`, value by value, as far as both reach (callers check
/// the lengths against the shard range first).
pub fn decode_values(bytes: &[u8], precision: Precision, out: &mut [f32]) {
    match precision {
        Precision::F32 => {
            for (d, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        Precision::Bf16 => {
            for (d, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *d = half::bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_round_trip_exactly_in_f32_and_to_nearest_even_in_bf16() {
        let v = [0.0f32, -1.5, 2.718_5, 1.0e-30, 65_504.0, -7.0e20];
        let mut bytes = Vec::new();
        encode_values(&v, Precision::F32, &mut bytes);
        assert_eq!(bytes.len(), 4 * v.len());
        let mut back = [0.0f32; 6];
        decode_values(&bytes, Precision::F32, &mut back);
        assert_eq!(back, v);
        encode_values(&v, Precision::Bf16, &mut bytes);
        assert_eq!(bytes.len(), 2 * v.len());
        decode_values(&bytes, Precision::Bf16, &mut back);
        for (b, x) in back.iter().zip(&v) {
            assert_eq!(*b, half::bf16::from_f32(*x).to_f32());
            assert!((b - x).abs() <= x.abs() / 128.0, "{x} -> {b}");
        }
        // 1 + 2^-8 lies halfway between two bf16 values: it rounds to the even one, 1.0.
        encode_values(&[1.0 + 1.0 / 256.0], Precision::Bf16, &mut bytes);
        assert_eq!(bytes, half::bf16::from_f32(1.0).to_le_bytes());
    }
}

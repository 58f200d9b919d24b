//! Parameter values on the wire: little-endian f32 or bfloat16 ([`Precision`]), the body of a full pull reply.
//!
//! The only f32 ⇄ bf16 conversion of the workspace is the `half` crate's (round to nearest even); this module and the
//! codec's bf16 scheme both go through it. Encoding sizes the output once and writes fixed-width chunks, so the loops
//! compile to straight copies (f32) or conversions (bf16); decoding never reads past either slice. Values from a
//! peer are checked with [`check_finite_values`] before they are decoded into anything that keeps them.

use super::{ErrorCode, Precision, ProtocolError};

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

/// Checks that every little-endian value in `bytes` is finite in `precision` (a NaN or an infinity is refused with
/// [`ErrorCode::NonFinite`], naming the first one's index). Reads the exponent bits only, so it costs one pass.
pub fn check_finite_values(bytes: &[u8], precision: Precision) -> Result<(), ProtocolError> {
    let first = match precision {
        // The exponent field all ones is an infinity or a NaN: bits 23..31 of an f32, bits 7..15 of a bf16.
        Precision::F32 => bytes.chunks_exact(4).position(|b| {
            u32::from_le_bytes([b[0], b[1], b[2], b[3]]) & 0x7f80_0000 == 0x7f80_0000
        }),
        Precision::Bf16 => bytes
            .chunks_exact(2)
            .position(|b| u16::from_le_bytes([b[0], b[1]]) & 0x7f80 == 0x7f80),
    };
    match first {
        None => Ok(()),
        Some(i) => Err(ProtocolError::Rejected {
            code: ErrorCode::NonFinite,
            message: format!("value {i} is not finite ({precision:?})"),
        }),
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

    #[test]
    fn non_finite_values_are_refused_in_either_precision_and_finite_extremes_pass() {
        let finite = [
            0.0f32,
            -0.0,
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
            1.0e-45,
            -3.5,
        ];
        for precision in [Precision::F32, Precision::Bf16] {
            let mut bytes = Vec::new();
            // bf16 rounds f32::MAX up to infinity: keep to values it represents.
            let ok: Vec<f32> = finite
                .iter()
                .map(|v| match precision {
                    Precision::F32 => *v,
                    Precision::Bf16 => half::bf16::from_f32(*v).to_f32().clamp(-3.0e38, 3.0e38),
                })
                .collect();
            encode_values(&ok, precision, &mut bytes);
            assert_eq!(check_finite_values(&bytes, precision), Ok(()));
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -f32::NAN] {
                let mut v = ok.clone();
                v[4] = bad;
                encode_values(&v, precision, &mut bytes);
                let e = check_finite_values(&bytes, precision).unwrap_err();
                assert_eq!(e.code(), ErrorCode::NonFinite, "{bad} in {precision:?}");
                assert!(e.to_string().contains("value 4"), "{e}");
            }
        }
        // A trailing partial value is not a value: callers check lengths first.
        assert_eq!(
            check_finite_values(&[0xff, 0xff, 0xff], Precision::F32),
            Ok(())
        );
    }
}

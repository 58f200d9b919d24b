//! A push's decode and norm, in chunks on the shard's [`ChunkPool`]: a pure function of the frame and the scratch it
//! writes. The chunks are whole codec buckets of about [`CHUNK_VALUES`] values ([`RawFrame::chunk_len`]), a function
//! of the frame alone, never of the thread count; each chunk decodes on its own and sums its squares, and the sums
//! are added in chunk order. So the decoded values and the norm are the same bits at any thread count, and the
//! first failing chunk in frame order names the error that a whole-frame decode names.

use tether_common::chunk_pool::{ChunkPool, CHUNK_VALUES};
use tether_common::codec::{CodecError, RawFrame};
use tether_common::numeric::sum_of_squares;

/// Decodes `raw` into `out` (its length) chunk by chunk on `pool` and returns Σ out² (in f64, chunk sums added in
/// chunk order). On an error `out` may be partly written.
pub fn decode_and_square(
    pool: &ChunkPool,
    raw: &RawFrame<'_>,
    out: &mut [f32],
) -> Result<f64, CodecError> {
    let chunk = raw.chunk_len(CHUNK_VALUES);
    let jobs: Vec<(usize, &mut [f32])> = out
        .chunks_mut(chunk)
        .enumerate()
        .map(|(i, c)| (i * chunk, c))
        .collect();
    let sums = pool.map(jobs, |(start, values)| {
        raw.decode_chunk(start, values)?;
        Ok(sum_of_squares(values))
    });
    let mut sq = 0.0f64;
    for s in sums {
        sq += s?;
    }
    Ok(sq)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tether_common::codec::{CodecConfig, Decoder, Encoder, Scheme};
    use tether_common::testing::noise;

    #[test]
    fn values_and_norm_are_the_same_bits_at_any_thread_count() {
        // Three and a half chunks, so that the last chunk is short and the chunk sums are not one.
        let n = 3 * CHUNK_VALUES + CHUNK_VALUES / 2 + 48;
        for (scheme, bucket, zstd) in [
            (Scheme::Q4, 512, true),
            (Scheme::Q4, 48, false),
            (Scheme::Topk2, 4096, true),
            (Scheme::Fp16, 0, false),
        ] {
            let cfg = CodecConfig {
                scheme,
                bucket: if bucket == 0 { 512 } else { bucket },
                zstd,
                ..CodecConfig::default()
            };
            let mut frame = Vec::new();
            Encoder::new(cfg)
                .unwrap()
                .encode(&noise(n, 5, 1e-2), 9, &mut frame)
                .unwrap();
            let mut whole = vec![0.0f32; n];
            Decoder::new(n).decode(&frame, &mut whole).unwrap();
            let mut seen = None;
            for threads in [1, 2, 3] {
                let pool = ChunkPool::new(threads, "tether-test").unwrap();
                let mut dec = Decoder::new(n);
                let raw = dec.open(&frame, n).unwrap();
                let mut out = vec![f32::NAN; n];
                let sq = decode_and_square(&pool, &raw, &mut out).unwrap();
                assert!(
                    out.iter()
                        .zip(&whole)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{scheme:?} at {threads} threads: values differ from a whole-frame decode"
                );
                let bits = sq.to_bits();
                assert_eq!(
                    *seen.get_or_insert(bits),
                    bits,
                    "{scheme:?} at {threads} threads: the norm's bits changed"
                );
            }
        }
    }

    #[test]
    fn the_first_bad_chunk_in_frame_order_names_the_error() {
        let n = 4 * CHUNK_VALUES;
        let cfg = CodecConfig {
            scheme: Scheme::Q4,
            zstd: false,
            ..CodecConfig::default()
        };
        let mut frame = Vec::new();
        Encoder::new(cfg)
            .unwrap()
            .encode(&noise(n, 5, 1e-2), 9, &mut frame)
            .unwrap();
        // Code −8 (0x8 in a nibble) is out of range: put one in bucket 300 (chunk 2) and one in bucket 500 (chunk 3).
        let codes = tether_common::codec::HEADER_LEN + 4 * (n / 512);
        for b in [500usize, 300] {
            frame[codes + b * 256] = 0x88;
        }
        let mut want = vec![0.0f32; n];
        let whole = Decoder::new(n).decode(&frame, &mut want).unwrap_err();
        for threads in [1, 2, 3] {
            let pool = ChunkPool::new(threads, "tether-test").unwrap();
            let mut dec = Decoder::new(n);
            let raw = dec.open(&frame, n).unwrap();
            let mut out = vec![0.0f32; n];
            assert_eq!(decode_and_square(&pool, &raw, &mut out).unwrap_err(), whole);
        }
        assert_eq!(whole, CodecError::BadCode { bucket: 300 });
    }
}

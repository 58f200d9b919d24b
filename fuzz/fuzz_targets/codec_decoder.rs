//! Feeds damaged and arbitrary frames to the gradient codec's strict decoder: any panic is a finding. Half the
//! inputs are raw bytes; the other half are valid frames (every scheme, bucket size, rounding mode, with and
//! without zstd) encoded from the input and then damaged at positions the input names, so the fuzzer reaches past
//! the header into every body decoder. What decodes must decode to finite values, deterministically (twice, bit
//! for bit), with the header `peek_header` reports.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tether_common::codec::{CodecConfig, Decoder, Encoder, Rounding, Scheme};

const MAX_LEN: usize = 4096;

/// A valid frame of `n` values from `seed_bytes`, then damaged by `[pos u16][xor u8]` triples.
fn damaged_frame(ctl: [u8; 2], n: usize, rest: &[u8]) -> Option<Vec<u8>> {
    let cfg = CodecConfig {
        scheme: Scheme::ALL[usize::from(ctl[0]) % Scheme::ALL.len()],
        bucket: 16 << (ctl[1] % 6),
        rounding: if ctl[1] & 0x40 != 0 {
            Rounding::Deterministic
        } else {
            Rounding::Stochastic
        },
        zstd: ctl[1] & 0x80 != 0,
        keep: 2u32 << ((ctl[0] >> 3) % 15),
    };
    let (values, edits) = rest.split_at(rest.len().min(n));
    let x: Vec<f32> = (0..n)
        .map(|i| f32::from(values.get(i).copied().unwrap_or(0) as i8) * 0.01)
        .collect();
    let mut frame = Vec::new();
    Encoder::new(cfg).ok()?.encode(&x, 7, &mut frame).ok()?;
    for e in edits.chunks_exact(3) {
        if !frame.is_empty() {
            let pos = usize::from(u16::from_le_bytes([e[0], e[1]])) % frame.len();
            frame[pos] ^= e[2];
        }
    }
    Some(frame)
}

fuzz_target!(|data: &[u8]| {
    let Some((head, rest)) = data.split_first_chunk::<4>() else {
        return;
    };
    let n = usize::from(u16::from_le_bytes([head[0], head[1]])) % MAX_LEN + 1;
    let owned;
    let frame: &[u8] = if head[2] & 1 == 0 {
        rest
    } else {
        match damaged_frame([head[2] >> 1, head[3]], n, rest) {
            Some(f) => {
                owned = f;
                &owned
            }
            None => return,
        }
    };
    let mut dec = Decoder::new(MAX_LEN);
    let mut out = vec![0.0f32; n];
    if let Ok(h) = dec.decode(frame, &mut out) {
        assert_eq!(h.len, n as u64, "decoded a frame of another length");
        assert_eq!(
            Decoder::peek_header(frame).expect("decoded, so the header parses"),
            h
        );
        assert!(
            out.iter().all(|v| v.is_finite()),
            "a decoded value is not finite"
        );
        let mut again = vec![0.0f32; n];
        dec.decode(frame, &mut again).expect("decodes twice");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&out), bits(&again), "decoding is not deterministic");
    }
});

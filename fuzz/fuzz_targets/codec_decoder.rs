//! Feeds arbitrary bytes to the gradient codec's strict decoder, for an element count taken from the input: any
//! panic is a finding. What decodes must decode to finite values, deterministically (twice, bit for bit), and the
//! header it reports must agree with `peek_header`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tether_common::codec::Decoder;

const MAX_LEN: usize = 4096;

fuzz_target!(|data: &[u8]| {
    let Some((len, frame)) = data.split_first_chunk::<2>() else {
        return;
    };
    let n = usize::from(u16::from_le_bytes(*len)) % MAX_LEN + 1;
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

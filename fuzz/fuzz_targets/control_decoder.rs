//! Feeds arbitrary bytes to the bincode control-message decoder: any panic is a finding; every failure carries a
//! wire code; what decodes survives its own round trip, and a decoded `Hello` can be checked without panicking.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tether_common::protocol::{decode_control, encode_control, Control};

fuzz_target!(|data: &[u8]| {
    match decode_control(data) {
        Ok(msg) => {
            let again = encode_control(&msg).expect("a decoded message re-encodes");
            assert_eq!(decode_control(&again).expect("re-encoded decodes"), msg);
            if let Control::Hello(hello) = msg {
                let (rank, layout_hash) = (hello.rank, hello.layout_hash);
                let _ = hello.check(layout_hash ^ 1, |r| r == rank, "fuzz");
                let _ = hello.check(layout_hash, |_| true, "fuzz");
            }
        }
        Err(e) => {
            let _ = e.code();
        }
    }
});

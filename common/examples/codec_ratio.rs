//! Prints wire bytes / fp32 bytes for every codec scheme, with and without zstd, on gaussian gradients and on
//! "mostly tiny" gradients (95% near zero, a few large). Run: `cargo run --release -p tether-common --example
//! codec_ratio`.

use tether_common::codec::*;
use tether_common::testing::TestRng;

fn main() -> Result<(), CodecError> {
    let n = 1 << 20;
    let mut rng = TestRng::new(0x2545_F491_4F6C_DD1D);
    let mut gauss = || rng.normal() as f32;
    let dense: Vec<f32> = (0..n).map(|_| gauss() * 1e-2).collect();
    let tiny: Vec<f32> = (0..n)
        .map(|i| {
            let g = gauss();
            // Deterministic 5% of large entries, spread out.
            if i % 20 == 7 {
                g
            } else {
                g * 1e-6
            }
        })
        .collect();
    println!(
        "{:<8} {:>14} {:>14} {:>14} {:>14}",
        "scheme", "gauss", "gauss+zstd", "tiny", "tiny+zstd"
    );
    for scheme in Scheme::ALL {
        let mut row = Vec::new();
        for data in [&dense, &tiny] {
            for zstd in [false, true] {
                let mut enc = Encoder::new(CodecConfig {
                    scheme,
                    zstd,
                    ..CodecConfig::default()
                })?;
                let mut frame = Vec::new();
                enc.encode(data, 1, &mut frame)?;
                row.push(frame.len() as f64 / (4 * n) as f64);
            }
        }
        println!(
            "{:<8} {:>14.4} {:>14.4} {:>14.4} {:>14.4}",
            scheme.name(),
            row[0],
            row[1],
            row[2],
            row[3]
        );
    }
    Ok(())
}

//! Behavioural tests of `tether_common::codec`: statistics of stochastic rounding (unbiasedness, variance vs the
//! analytic and QSGD bounds), error bounds, error feedback, kernel equivalence, determinism, and hostile frames.

use proptest::prelude::*;
use tether_common::codec::*;
use tether_common::testing::TestRng;

/// `n` standard normal draws from `rng`, as f32.
fn gauss_vec(rng: &mut TestRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.normal() as f32).collect()
}

fn cfg(scheme: Scheme, rounding: Rounding, zstd: bool) -> CodecConfig {
    CodecConfig {
        scheme,
        bucket: 512,
        rounding,
        zstd,
        keep: tether_common::codec::DEFAULT_KEEP,
    }
}

fn roundtrip(enc: &mut Encoder, x: &[f32], seed: u64) -> Vec<f32> {
    let mut frame = Vec::new();
    enc.encode(x, seed, &mut frame).unwrap();
    let mut out = vec![0f32; x.len()];
    let h = Decoder::new(x.len()).decode(&frame, &mut out).unwrap();
    assert_eq!(h.len, x.len() as u64);
    out
}

/// Per-bucket step scale/L of the encoder input.
fn steps(x: &[f32], bucket: usize, l: i32) -> Vec<f32> {
    x.chunks(bucket)
        .flat_map(|c| {
            let s = c.iter().fold(0f32, |m, v| m.max(v.abs())) / l as f32;
            std::iter::repeat_n(s, c.len())
        })
        .collect()
}

const QUANT: [Scheme; 3] = [Scheme::Q8, Scheme::Q4, Scheme::Q2];

#[test]
fn names_and_defaults() {
    for s in Scheme::ALL {
        assert_eq!(s.to_string().parse::<Scheme>().unwrap(), s);
        let j = serde_json::to_string(&s).unwrap();
        assert_eq!(j, format!("\"{s}\""));
    }
    assert!("q3".parse::<Scheme>().is_err());
    let d = CodecConfig::default();
    assert_eq!(
        (d.scheme, d.bucket, d.rounding, d.zstd),
        (Scheme::Q4, 512, Rounding::Stochastic, false)
    );
    let c: CodecConfig =
        serde_json::from_str(r#"{"scheme":"q8","rounding":"deterministic"}"#).unwrap();
    assert_eq!(
        (c.scheme, c.bucket, c.rounding),
        (Scheme::Q8, 512, Rounding::Deterministic)
    );
    for bad in [0, 8, 24, MAX_BUCKET + 16] {
        let r = Encoder::new(CodecConfig {
            bucket: bad,
            ..CodecConfig::default()
        });
        assert_eq!(r.err(), Some(CodecError::InvalidBucket), "bucket {bad}");
    }
}

#[test]
fn unbiased_over_seeds() {
    let mut rng = TestRng::new(1);
    let n = 512 + 100;
    let x = gauss_vec(&mut rng, n);
    let seeds = 2000;
    for scheme in QUANT {
        let l = scheme.levels().unwrap();
        let mut enc = Encoder::new(cfg(scheme, Rounding::Stochastic, false)).unwrap();
        let mut sum = vec![0f64; n];
        for s in 0..seeds {
            for (a, v) in sum
                .iter_mut()
                .zip(roundtrip(&mut enc, &x, seed_for(3, s, 1)))
            {
                *a += f64::from(v);
            }
        }
        let st = steps(&x, 512, l);
        let mut worst = 0f64;
        for i in 0..n {
            let mean = sum[i] / seeds as f64;
            let sd = f64::from(st[i]) / 2.0 / (seeds as f64).sqrt();
            let z = (mean - f64::from(x[i])).abs() / sd;
            worst = worst.max(z);
            assert!(
                z < 5.5,
                "{scheme} element {i}: mean {mean} vs {} ({z:.2} sd)",
                x[i]
            );
        }
        // Deterministic rounding of the same vector is visibly biased for comparison: the test can fail.
        println!("{scheme}: worst |mean - x| = {worst:.2} bound-sd over {seeds} seeds");
    }
}

#[test]
fn variance_within_analytic_and_qsgd_bounds() {
    let mut rng = TestRng::new(2);
    let d = 512;
    let seeds = 400;
    for scheme in QUANT {
        let l = scheme.levels().unwrap() as f64;
        let mut enc = Encoder::new(cfg(scheme, Rounding::Stochastic, false)).unwrap();
        let mut worst_ratio = 0f64;
        let mut worst_qsgd = 0f64;
        for trial in 0..8 {
            let v = if trial % 2 == 0 {
                gauss_vec(&mut rng, d)
            } else {
                (0..d).map(|_| rng.next_f64() as f32 - 0.5).collect()
            };
            let scale = f64::from(v.iter().fold(0f32, |m, x| m.max(x.abs())));
            let norm2: f64 = v.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
            let mut err2 = 0f64;
            for s in 0..seeds {
                let q = roundtrip(&mut enc, &v, seed_for(trial, s, 0));
                err2 += q
                    .iter()
                    .zip(&v)
                    .map(|(&a, &b)| (f64::from(a) - f64::from(b)).powi(2))
                    .sum::<f64>();
            }
            let mean = err2 / seeds as f64;
            let bound = d as f64 * (scale / l).powi(2) / 4.0;
            let qsgd = (d as f64 / (l * l)).min((d as f64).sqrt() / l) * norm2;
            assert!(
                mean <= bound * 1.05,
                "{scheme}: E|Q(v)-v|^2 = {mean} > analytic bound {bound}"
            );
            assert!(
                mean <= qsgd,
                "{scheme}: E|Q(v)-v|^2 = {mean} > QSGD bound {qsgd}"
            );
            worst_ratio = worst_ratio.max(mean / bound);
            worst_qsgd = worst_qsgd.max(mean / qsgd);
        }
        println!(
            "variance ratio {scheme}: measured/analytic(d·(scale/L)²/4) = {worst_ratio:.3}, measured/QSGD = \
             {worst_qsgd:.3}"
        );
    }
}

#[test]
fn error_bounds_levels_zeros_and_partial_bucket() {
    let mut rng = TestRng::new(3);
    let n = 512 * 3 + 37;
    let mut x = gauss_vec(&mut rng, n);
    x[512..1024].fill(0.0); // an all-zero bucket
    for scheme in QUANT {
        let l = scheme.levels().unwrap();
        let st = steps(&x, 512, l);
        for (rounding, factor) in [
            (Rounding::Stochastic, 1.0f32),
            (Rounding::Deterministic, 0.5),
        ] {
            let mut enc = Encoder::new(cfg(scheme, rounding, false)).unwrap();
            let y = roundtrip(&mut enc, &x, 9);
            for i in 0..n {
                let err = (y[i] - x[i]).abs();
                assert!(
                    err <= st[i] * factor * (1.0 + 1e-5),
                    "{scheme} {rounding:?} element {i}: err {err}"
                );
            }
            assert!(y[512..1024].iter().all(|&v| v == 0.0));
        }
        // Values exactly on a level (step a power of two) round-trip exactly under both roundings.
        let step = 0.125f32;
        let mut lv: Vec<f32> = (0..600)
            .map(|i| ((i % (2 * l + 1)) - l) as f32 * step)
            .collect();
        lv[512] = l as f32 * step; // every bucket holds the top level, so its scale is L·step

        for rounding in [Rounding::Stochastic, Rounding::Deterministic] {
            let mut enc = Encoder::new(cfg(scheme, rounding, false)).unwrap();
            for seed in 0..20 {
                assert_eq!(roundtrip(&mut enc, &lv, seed), lv, "{scheme} {rounding:?}");
            }
        }
    }
}

#[test]
fn tiny_and_huge_scales_stay_finite_and_bounded() {
    for scheme in QUANT {
        let l = scheme.levels().unwrap();
        for mag in [1e-45f32, 1e-40, 1e-38, 3e38] {
            let x: Vec<f32> = (0..100)
                .map(|i| mag * (((i % 7) as f32 - 3.0) / 3.0))
                .collect();
            let mut enc = Encoder::new(cfg(scheme, Rounding::Stochastic, false)).unwrap();
            let y = roundtrip(&mut enc, &x, 5);
            let st = steps(&x, 512, l);
            // The decoded step scale/L is an f32 and may itself be subnormal: allow L ulps of the subnormal grid.
            let slack = f64::from(l) * 2f64.powi(-149);
            for i in 0..x.len() {
                assert!(y[i].is_finite());
                let err = (f64::from(y[i]) - f64::from(x[i])).abs();
                assert!(
                    err <= f64::from(st[i]) * 1.0001 + slack,
                    "{scheme} mag {mag} elem {i}: {} vs {}",
                    y[i],
                    x[i]
                );
            }
        }
    }
}

#[test]
fn error_feedback_in_place_gives_the_same_frames_and_residuals() {
    // encode_in_place keeps no buffer of its own: the same frames and residual bits as encode, and the gradient
    // buffer left holding what was encoded.
    let mut rng = TestRng::new(9);
    let n = 1537;
    for (scheme, zstd) in [(Scheme::Q4, true), (Scheme::Q2, false), (Scheme::Q8, true)] {
        let mut enc_a = Encoder::new(cfg(scheme, Rounding::Stochastic, zstd)).unwrap();
        let mut enc_b = Encoder::new(cfg(scheme, Rounding::Stochastic, zstd)).unwrap();
        let (mut a, mut b) = (ErrorFeedback::new(n), ErrorFeedback::new(n));
        let (mut fa, mut fb) = (Vec::new(), Vec::new());
        for step in 0..6u64 {
            let g = gauss_vec(&mut rng, n);
            let want_sum: Vec<f32> = g.iter().zip(b.residual()).map(|(x, r)| x + r).collect();
            a.encode(&mut enc_a, &g, step, &mut fa).unwrap();
            let mut scratch = g.clone();
            b.encode_in_place(&mut enc_b, &mut scratch, step, &mut fb)
                .unwrap();
            assert_eq!(fa, fb, "{scheme:?} step {step}: frames");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(a.residual()),
                bits(b.residual()),
                "{scheme:?} step {step}"
            );
            assert_eq!(
                bits(&scratch),
                bits(&want_sum),
                "{scheme:?} step {step}: scratch"
            );
        }
        // A wrong length is refused, residual untouched.
        let before = b.residual().to_vec();
        assert!(b
            .encode_in_place(&mut enc_b, &mut vec![0.0; n - 1], 9, &mut fb)
            .is_err());
        assert_eq!(b.residual(), &before[..]);
        assert!(fb.is_empty());
    }
}

#[test]
fn error_feedback_tracks_the_sum() {
    let mut rng = TestRng::new(4);
    let n = 1000;
    let g = gauss_vec(&mut rng, n);
    for scheme in [Scheme::Q8, Scheme::Q4, Scheme::Q2] {
        let l = scheme.levels().unwrap() as f64;
        let mut enc = Encoder::new(cfg(scheme, Rounding::Stochastic, false)).unwrap();
        let mut ef = ErrorFeedback::new(n);
        let mut dec = Decoder::new(n);
        let mut frame = Vec::new();
        let mut out = vec![0f32; n];
        let mut sum_dec = vec![0f64; n];
        let gmax = g.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
        let mut worst = 0f64;
        let mut first_half = 0f64;
        for step in 0..1000u64 {
            if step == 500 {
                first_half = worst;
            }
            ef.encode(&mut enc, &g, seed_for(0, step, 0), &mut frame)
                .unwrap();
            dec.decode(&frame, &mut out).unwrap();
            for (s, &v) in sum_dec.iter_mut().zip(&out) {
                *s += f64::from(v);
            }
            let drift: f64 = sum_dec
                .iter()
                .zip(&g)
                .map(|(&s, &gi)| (s - (step + 1) as f64 * f64::from(gi)).powi(2))
                .sum::<f64>()
                .sqrt();
            let res: f64 = ef
                .residual()
                .iter()
                .map(|&r| f64::from(r).powi(2))
                .sum::<f64>()
                .sqrt();
            // Σdecoded − Σinput = −residual (up to float accumulation error).
            assert!(
                (drift - res).abs() <= 1e-3 * (1.0 + drift),
                "{scheme} step {step}: drift {drift} vs residual {res}"
            );
            worst = worst.max(res);
        }
        // |r|∞ ≤ max|g + r| / L gives |r|∞ ≤ gmax/(L−1) for L > 1; ternary: bounded by a few gmax in practice.
        let bound = if l > 1.0 {
            (n as f64).sqrt() * gmax / (l - 1.0)
        } else {
            (n as f64).sqrt() * 4.0 * gmax
        };
        assert!(
            worst <= bound,
            "{scheme}: residual norm {worst} exceeds {bound}"
        );
        assert!(
            worst <= 1.25 * first_half,
            "{scheme}: residual keeps growing: {first_half} -> {worst}"
        );
        println!("EF {scheme}: max residual norm {first_half:.3} (pushes 0-499), {worst:.3} (0-999); bound {bound:.3}, |g| {:.3}", {
            g.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>().sqrt()
        });
        ef.reset();
        assert!(ef.residual().iter().all(|&r| r == 0.0));
    }
}

#[test]
fn non_finite_input_rejected() {
    for scheme in Scheme::ALL {
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut x = vec![0.5f32; 1500];
            x[1234] = bad;
            let mut enc = Encoder::new(cfg(scheme, Rounding::Stochastic, false)).unwrap();
            let mut out = vec![1u8; 10];
            assert_eq!(
                enc.encode(&x, 1, &mut out),
                Err(CodecError::NonFinite { index: 1234 }),
                "{scheme}"
            );
            assert!(out.is_empty());
        }
    }
}

#[test]
fn determinism_same_seed_same_bytes() {
    let x = gauss_vec(&mut TestRng::new(5), 3000);
    for scheme in QUANT {
        let mut enc = Encoder::new(cfg(scheme, Rounding::Stochastic, false)).unwrap();
        let (mut a, mut b, mut c) = (Vec::new(), Vec::new(), Vec::new());
        enc.encode(&x, 42, &mut a).unwrap();
        enc.encode(&x, 42, &mut b).unwrap();
        enc.encode(&x, 43, &mut c).unwrap();
        assert_eq!(a, b);
        assert_ne!(a, c);
        let mut det = Encoder::new(cfg(scheme, Rounding::Deterministic, false)).unwrap();
        det.encode(&x, 1, &mut a).unwrap();
        det.encode(&x, 2, &mut b).unwrap();
        assert_eq!(a, b, "deterministic rounding ignores the seed");
    }
}

#[test]
fn scalar_and_simd_kernels_are_bit_identical() {
    if !Kernel::Avx2.available() {
        println!("AVX2 not available: skipped the scalar/SIMD comparison");
        return;
    }
    let mut rng = TestRng::new(6);
    let mut x = gauss_vec(&mut rng, 512 * 5 + 77);
    x[512..1024].fill(0.0);
    x[1024..1536].iter_mut().for_each(|v| *v *= 1e-44);
    x[2000] = 0.0;
    for scheme in QUANT {
        for rounding in [Rounding::Stochastic, Rounding::Deterministic] {
            for bucket in [16, 48, 512] {
                let c = CodecConfig {
                    scheme,
                    bucket,
                    rounding,
                    zstd: false,
                    keep: tether_common::codec::DEFAULT_KEEP,
                };
                let mut s = Encoder::with_kernel(c, Kernel::Scalar).unwrap();
                let mut v = Encoder::with_kernel(c, Kernel::Avx2).unwrap();
                for len in [0, 1, 15, 17, 512, x.len()] {
                    let (mut a, mut b) = (Vec::new(), Vec::new());
                    s.encode(&x[..len], 77, &mut a).unwrap();
                    v.encode(&x[..len], 77, &mut b).unwrap();
                    assert_eq!(a, b, "{scheme} {rounding:?} bucket {bucket} len {len}");
                    let mut ya = vec![0f32; len];
                    let mut yb = vec![0f32; len];
                    Decoder::with_kernel(len, Kernel::Scalar)
                        .unwrap()
                        .decode(&a, &mut ya)
                        .unwrap();
                    Decoder::with_kernel(len, Kernel::Avx2)
                        .unwrap()
                        .decode(&a, &mut yb)
                        .unwrap();
                    assert!(
                        ya.iter().zip(&yb).all(|(p, q)| p.to_bits() == q.to_bits()),
                        "{scheme} decode"
                    );
                }
            }
        }
    }
    println!("AVX2 and scalar kernels produced identical bytes and floats");
}

#[test]
fn zstd_flag_used_only_when_smaller() {
    let mut rng = TestRng::new(7);
    let sparse: Vec<f32> = (0..20000)
        .map(|i| {
            if i % 50 == 0 {
                (rng.normal() as f32) * 10.0
            } else {
                0.0
            }
        })
        .collect();
    let noise: Vec<f32> = (0..20000).map(|_| rng.next_f64() as f32).collect();
    for scheme in Scheme::ALL {
        let mut enc = Encoder::new(cfg(scheme, Rounding::Stochastic, true)).unwrap();
        let mut f = Vec::new();
        enc.encode(&sparse, 1, &mut f).unwrap();
        let h = Decoder::peek_header(&f).unwrap();
        assert!(h.zstd, "{scheme}: sparse input should compress");
        assert!(f.len() < max_encoded_len(enc.config(), sparse.len()));
        let mut out = vec![0f32; sparse.len()];
        Decoder::new(sparse.len()).decode(&f, &mut out).unwrap();
        enc.encode(&noise[..16], 1, &mut f).unwrap();
        assert!(
            !Decoder::peek_header(&f).unwrap().zstd,
            "{scheme}: 16 values cannot shrink"
        );
        assert_eq!(f.len(), max_encoded_len(enc.config(), 16));
    }
}

fn bounded(scheme: Scheme, x: &[f32], y: &[f32], bucket: usize) -> Result<(), TestCaseError> {
    prop_assert_eq!(x.len(), y.len());
    match scheme {
        Scheme::None => prop_assert_eq!(x, y),
        Scheme::Fp16 => {
            for (&a, &b) in x.iter().zip(y) {
                prop_assert!(
                    (a - b).abs() <= a.abs() * (1.0 / 2048.0) + 6e-8,
                    "{} vs {}",
                    a,
                    b
                );
            }
        }
        Scheme::Bf16 => {
            for (&a, &b) in x.iter().zip(y) {
                prop_assert!((a - b).abs() <= a.abs() * (1.0 / 256.0), "{} vs {}", a, b);
            }
        }
        Scheme::Topk2 => {
            // Kept values keep their sign and never exceed the block's largest magnitude; the rest decode to 0.
            for (xb, yb) in x.chunks(bucket).zip(y.chunks(bucket)) {
                let max = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
                let k = yb.iter().filter(|v| **v != 0.0).count();
                prop_assert!(k <= xb.len().div_ceil(DEFAULT_KEEP as usize).max(1));
                for (&a, &b) in xb.iter().zip(yb) {
                    prop_assert!(b == 0.0 || (b.signum() == a.signum() && b.abs() <= max));
                }
            }
        }
        _ => {
            let st = steps(x, bucket, scheme.levels().unwrap());
            for i in 0..x.len() {
                prop_assert!(
                    (x[i] - y[i]).abs() <= st[i] * 1.00001,
                    "elem {}: {} vs {}",
                    i,
                    x[i],
                    y[i]
                );
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn roundtrip_every_scheme(
        x in prop::collection::vec(-1000f32..1000f32, 0..1500),
        scheme in prop::sample::select(Scheme::ALL.to_vec()),
        bucket in prop::sample::select(vec![16usize, 64, 512]),
        zstd in any::<bool>(),
        det in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let rounding = if det { Rounding::Deterministic } else { Rounding::Stochastic };
        let c = CodecConfig { scheme, bucket, rounding, zstd, keep: tether_common::codec::DEFAULT_KEEP };
        let mut enc = Encoder::new(c).unwrap();
        let mut f = Vec::new();
        enc.encode(&x, seed, &mut f).unwrap();
        prop_assert!(f.len() <= max_encoded_len(&c, x.len()));
        let mut y = vec![0f32; x.len()];
        let h = Decoder::new(x.len()).decode(&f, &mut y).unwrap();
        prop_assert_eq!(h.len, x.len() as u64);
        prop_assert_eq!(h.scheme, scheme);
        bounded(scheme, &x, &y, bucket)?;
    }

    #[test]
    fn hostile_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..400), n in 0usize..300) {
        let mut out = vec![0f32; n];
        if let Ok(h) = Decoder::new(1000).decode(&bytes, &mut out) {
            prop_assert_eq!(h.len, n as u64);
        }
        let _ = Decoder::peek_header(&bytes);
    }

    #[test]
    fn mutated_frames_never_panic(
        scheme in prop::sample::select(Scheme::ALL.to_vec()),
        zstd in any::<bool>(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), 0u8..8), 1..6),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
    ) {
        let x: Vec<f32> = (0..700).map(|i| ((i * 37 % 101) as f32 - 50.0) * if i % 3 == 0 { 0.0 } else { 0.1 }).collect();
        let mut enc = Encoder::new(CodecConfig { scheme, bucket: 64, rounding: Rounding::Stochastic, zstd, keep: tether_common::codec::DEFAULT_KEEP }).unwrap();
        let mut f = Vec::new();
        enc.encode(&x, 3, &mut f).unwrap();
        for (at, bit) in &flips {
            let i = at.index(f.len());
            f[i] ^= 1 << bit;
        }
        if truncate {
            f.truncate(cut.index(f.len()));
        }
        let mut out = vec![0f32; x.len()];
        if let Ok(h) = Decoder::new(x.len()).decode(&f, &mut out) {
            prop_assert_eq!(h.len, x.len() as u64);
            if !scheme.is_quantized() {
                prop_assert!(out.iter().all(|v| v.is_finite()));
            }
        }
    }
}

fn header_bytes(scheme: u8, flags: u8, bucket: u32, body_len: u32, len: u64) -> Vec<u8> {
    let mut h = Vec::new();
    h.extend_from_slice(&MAGIC);
    h.extend_from_slice(&[VERSION, scheme, flags, 0]);
    h.extend_from_slice(&bucket.to_le_bytes());
    h.extend_from_slice(&body_len.to_le_bytes());
    h.extend_from_slice(&len.to_le_bytes());
    h
}

#[test]
fn strict_header_checks() {
    let mut x = vec![0.25f32; 100];
    x[3] = -1.0;
    let mut enc = Encoder::new(CodecConfig {
        bucket: 64,
        ..CodecConfig::default()
    })
    .unwrap();
    let mut f = Vec::new();
    enc.encode(&x, 1, &mut f).unwrap();
    let mut out = vec![0f32; 100];
    let mut dec = Decoder::new(100);
    dec.decode(&f, &mut out).unwrap();
    let mut wrong = vec![0f32; 99];
    assert_eq!(
        dec.decode(&f, &mut wrong),
        Err(CodecError::LengthMismatch {
            expected: 99,
            found: 100
        })
    );
    let mut small = Decoder::new(50);
    assert_eq!(small.decode(&f, &mut out), Err(CodecError::BodyTooLarge));

    let mut g = f.clone();
    g[0] ^= 1;
    assert_eq!(dec.decode(&g, &mut out), Err(CodecError::BadMagic));
    let mut g = f.clone();
    g[4] = 9;
    assert_eq!(
        dec.decode(&g, &mut out),
        Err(CodecError::UnsupportedVersion)
    );
    let mut g = f.clone();
    g[5] = 7;
    assert_eq!(dec.decode(&g, &mut out), Err(CodecError::BadScheme));
    let mut g = f.clone();
    g[6] |= 0x80;
    assert_eq!(dec.decode(&g, &mut out), Err(CodecError::BadFlags));
    let mut g = f.clone();
    g[8] = 17; // bucket 17
    assert_eq!(dec.decode(&g, &mut out), Err(CodecError::InvalidBucket));
    assert_eq!(
        dec.decode(&f[..f.len() - 1], &mut out),
        Err(CodecError::Truncated)
    );
    let mut g = f.clone();
    g.push(0);
    assert_eq!(dec.decode(&g, &mut out), Err(CodecError::TrailingBytes));
    // Negative, NaN and infinite scales.
    for s in [-1.0f32, -0.0, f32::NAN, f32::INFINITY] {
        let mut g = f.clone();
        g[HEADER_LEN..HEADER_LEN + 4].copy_from_slice(&s.to_le_bytes());
        assert_eq!(
            dec.decode(&g, &mut out),
            Err(CodecError::BadScale),
            "scale {s}"
        );
    }
    // A q4 code of −8 (nibble 0x8) is outside −7..=7.
    let mut g = f.clone();
    g[HEADER_LEN + 8] = 0x08;
    assert_eq!(
        dec.decode(&g, &mut out),
        Err(CodecError::BadCode { bucket: 0 })
    );
    // Padding bits in the last byte must be zero (100 elements: 50 full bytes, so use 99).
    let mut f99 = Vec::new();
    enc.encode(&x[..99], 1, &mut f99).unwrap();
    let last = f99.len() - 1;
    f99[last] |= 0x10;
    assert_eq!(
        dec.decode(&f99, &mut out[..99]),
        Err(CodecError::BadCode { bucket: 1 })
    );
}

#[test]
fn huge_claims_rejected_without_allocating() {
    // A q4 frame claiming 2^40 elements: the body cannot fit a frame.
    let f = header_bytes(4, 0, 512, 10, 1 << 40);
    let mut framed = f.clone();
    framed.extend_from_slice(&[0; 10]);
    assert_eq!(Decoder::peek_header(&framed), Err(CodecError::BodyTooLarge));
    // A claim that fits u32 but not the tiny body.
    let mut g = header_bytes(4, 0, 512, 10, 100_000_000);
    g.extend_from_slice(&[0; 10]);
    assert!(matches!(
        Decoder::peek_header(&g),
        Err(CodecError::BodyLength { .. })
    ));
    let mut out = vec![0f32; 10];
    assert!(Decoder::new(usize::MAX).decode(&g, &mut out).is_err());
    // zstd body that expands beyond the expected raw size (a decompression bomb) is rejected.
    let bomb = zstd::bulk::compress(&vec![0u8; 1 << 20], 1).unwrap();
    let n = 10_000u64;
    let raw = (n / 512 + 1) * 4 + n / 2;
    assert!((bomb.len() as u64) < raw);
    let mut z = header_bytes(4, 1, 512, bomb.len() as u32, n);
    z.extend_from_slice(&bomb);
    let mut out = vec![0f32; n as usize];
    assert!(matches!(
        Decoder::new(n as usize).decode(&z, &mut out),
        Err(CodecError::Zstd(_))
    ));
    // fp frames carrying non-finite values are rejected.
    let mut nf = header_bytes(0, 0, 0, 8, 2);
    nf.extend_from_slice(&1.0f32.to_le_bytes());
    nf.extend_from_slice(&f32::NAN.to_le_bytes());
    let mut out = vec![0f32; 2];
    assert_eq!(
        Decoder::new(2).decode(&nf, &mut out),
        Err(CodecError::NonFinite { index: 1 })
    );
}

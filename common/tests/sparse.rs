//! Behavioural tests of the sparse scheme `topk2`: which values a block keeps, unbiased 2-bit values on the kept
//! ones (mean and variance against the analytic bound), error feedback that carries every dropped value without
//! drift, the compression it reaches, and hostile frames refused with typed errors.

use tether_common::codec::*;
use tether_common::testing::TestRng;

fn gauss_vec(rng: &mut TestRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.normal() as f32).collect()
}

/// The L2 norm in f64.
fn norm(v: &[f32]) -> f64 {
    v.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt()
}

fn topk(bucket: usize, keep: u32, rounding: Rounding, zstd: bool) -> CodecConfig {
    CodecConfig {
        scheme: Scheme::Topk2,
        bucket,
        rounding,
        zstd,
        keep,
    }
}

fn roundtrip(enc: &mut Encoder, x: &[f32], seed: u64) -> Vec<f32> {
    let mut frame = Vec::new();
    enc.encode(x, seed, &mut frame).unwrap();
    let mut y = vec![0f32; x.len()];
    Decoder::new(x.len()).decode(&frame, &mut y).unwrap();
    y
}

/// The reference selection: per block, the positions of the `ceil(n/keep)` largest magnitudes (ties: lower first).
fn reference_kept(x: &[f32], bucket: usize, keep: usize) -> Vec<bool> {
    let mut kept = vec![false; x.len()];
    for (b, blk) in x.chunks(bucket).enumerate() {
        let k = blk.len().div_ceil(keep).max(1);
        let mut order: Vec<usize> = (0..blk.len()).collect();
        order.sort_by(|&i, &j| blk[j].abs().total_cmp(&blk[i].abs()).then(i.cmp(&j)));
        for &i in &order[..k] {
            kept[b * bucket + i] = true;
        }
    }
    kept
}

#[test]
fn keeps_the_largest_values_of_each_block_with_their_signs() {
    let mut rng = TestRng::new(11);
    for (n, bucket, keep) in [
        (4096 + 700, 512usize, 64u32),
        (1000, 64, 4),
        (33, 16, 2),
        (5, 4096, 64),
    ] {
        let x = gauss_vec(&mut rng, n);
        for rounding in [Rounding::Stochastic, Rounding::Deterministic] {
            let mut enc = Encoder::new(topk(bucket, keep, rounding, true)).unwrap();
            let y = roundtrip(&mut enc, &x, 9);
            let want = reference_kept(&x, bucket, keep as usize);
            for (b, (xb, yb)) in x.chunks(bucket).zip(y.chunks(bucket)).enumerate() {
                let kb = &want[b * bucket..b * bucket + xb.len()];
                let lo = (0..xb.len())
                    .filter(|&i| kb[i])
                    .map(|i| xb[i].abs())
                    .fold(f32::INFINITY, f32::min);
                let hi = (0..xb.len())
                    .filter(|&i| kb[i])
                    .map(|i| xb[i].abs())
                    .fold(0.0, f32::max);
                for i in 0..xb.len() {
                    if kb[i] {
                        assert_eq!(yb[i].signum(), xb[i].signum(), "n {n} block {b} elem {i}");
                        assert!(
                            yb[i].abs() == lo || yb[i].abs() == hi,
                            "n {n} block {b} elem {i}: {} is neither {lo} nor {hi}",
                            yb[i]
                        );
                        if rounding == Rounding::Deterministic {
                            let nearest = if xb[i].abs() - lo > hi - xb[i].abs() {
                                hi
                            } else {
                                lo
                            };
                            assert_eq!(yb[i].abs(), nearest, "n {n} elem {i}: not the nearest");
                        }
                    } else {
                        assert_eq!(yb[i], 0.0, "n {n} block {b} elem {i} was not kept");
                    }
                }
            }
        }
    }
}

#[test]
fn unbiased_on_kept_values_with_variance_within_the_bound() {
    let mut rng = TestRng::new(12);
    let (n, bucket, keep) = (2048 + 300, 512, 16u32);
    let x = gauss_vec(&mut rng, n);
    let kept = reference_kept(&x, bucket, keep as usize);
    let mut enc = Encoder::new(topk(bucket, keep, Rounding::Stochastic, false)).unwrap();
    let seeds = 2000u64;
    let mut sum = vec![0f64; n];
    let mut sq = vec![0f64; n];
    for s in 0..seeds {
        for (i, v) in roundtrip(&mut enc, &x, seed_for(2, s, 0))
            .iter()
            .enumerate()
        {
            let d = f64::from(*v) - f64::from(x[i]);
            sum[i] += f64::from(*v);
            sq[i] += d * d;
        }
    }
    let mut checked = 0;
    for (b, xb) in x.chunks(bucket).enumerate() {
        let idx: Vec<usize> = (b * bucket..b * bucket + xb.len())
            .filter(|&i| kept[i])
            .collect();
        let lo = idx
            .iter()
            .map(|&i| f64::from(x[i].abs()))
            .fold(f64::INFINITY, f64::min);
        let hi = idx
            .iter()
            .map(|&i| f64::from(x[i].abs()))
            .fold(0.0, f64::max);
        for &i in &idx {
            let a = f64::from(x[i].abs());
            // Two-point rounding between lo and hi: variance (hi − |x|)(|x| − lo), at most (hi − lo)²/4.
            let var = (hi - a) * (a - lo);
            let mean = sum[i] / seeds as f64;
            let sd = (var.max(1e-12) / seeds as f64).sqrt();
            assert!(
                (mean - f64::from(x[i])).abs() <= 5.5 * sd + 1e-6,
                "elem {i}: mean {mean} vs {} ({} sd)",
                x[i],
                (mean - f64::from(x[i])).abs() / sd
            );
            let observed = sq[i] / seeds as f64;
            assert!(
                observed <= var * 1.3 + 1e-9,
                "elem {i}: variance {observed} > bound {var}"
            );
            assert!(var <= (hi - lo).powi(2) / 4.0 + 1e-12);
            checked += 1;
        }
    }
    assert_eq!(checked, 4 * (512 / 16) + 300usize.div_ceil(16));
}

#[test]
fn error_feedback_delivers_every_value_without_drift() {
    let mut rng = TestRng::new(13);
    let n = 4096;
    let g = gauss_vec(&mut rng, n);
    let gnorm = norm(&g);
    for keep in [16u32, 64] {
        let mut enc = Encoder::new(topk(512, keep, Rounding::Stochastic, true)).unwrap();
        let mut ef = ErrorFeedback::new(n);
        let mut dec = Decoder::new(n);
        let mut frame = Vec::new();
        let mut out = vec![0f32; n];
        let mut sum_dec = vec![0f64; n];
        let steps = 40 * keep as u64;
        let (mut worst_first, mut worst) = (0f64, 0f64);
        for step in 0..steps {
            ef.encode(&mut enc, &g, seed_for(1, step, 0), &mut frame)
                .unwrap();
            dec.decode(&frame, &mut out).unwrap();
            for (s, &v) in sum_dec.iter_mut().zip(&out) {
                *s += f64::from(v);
            }
            let res = norm(ef.residual());
            if step < steps / 2 {
                worst_first = worst_first.max(res);
            }
            worst = worst.max(res);
        }
        // Σdecoded = T·g − r: nothing is lost, only the residual is in flight.
        let drift = sum_dec
            .iter()
            .zip(&g)
            .map(|(&s, &gi)| (s - steps as f64 * f64::from(gi)).powi(2))
            .sum::<f64>()
            .sqrt();
        let res = norm(ef.residual());
        assert!(
            (drift - res).abs() <= 1e-3 * (1.0 + drift),
            "keep {keep}: drift {drift} vs residual {res}"
        );
        // The residual stops growing (it holds about `keep` pushes' worth of the small values) ...
        assert!(
            worst <= 1.25 * worst_first,
            "keep {keep}: residual grows: {worst_first} -> {worst}"
        );
        // ... so the relative error of the delivered sum falls like 1/T.
        let rel = drift / (steps as f64 * gnorm);
        assert!(
            rel < 0.05,
            "keep {keep}: relative error {rel} after {steps} pushes"
        );
        println!("topk2 keep {keep}: residual norm ≤ {worst:.2} (|g| {gnorm:.2}), relative error {rel:.4} after {steps} pushes");
    }
}

#[test]
fn in_place_error_feedback_matches_the_copying_one() {
    let mut rng = TestRng::new(14);
    let n = 3000;
    let mut a = ErrorFeedback::new(n);
    let mut b = ErrorFeedback::new(n);
    let mut ea = Encoder::new(topk(512, 32, Rounding::Stochastic, true)).unwrap();
    let mut eb = Encoder::new(topk(512, 32, Rounding::Stochastic, true)).unwrap();
    let (mut fa, mut fb) = (Vec::new(), Vec::new());
    for step in 0..20 {
        let g = gauss_vec(&mut rng, n);
        a.encode(&mut ea, &g, step, &mut fa).unwrap();
        let mut gi = g.clone();
        b.encode_in_place(&mut eb, &mut gi, step, &mut fb).unwrap();
        assert_eq!(fa, fb, "step {step}");
        assert_eq!(a.residual(), b.residual(), "step {step}");
    }
}

#[test]
fn frame_sizes_follow_the_layout_and_compress() {
    let mut rng = TestRng::new(15);
    let n = 1 << 16;
    let x = gauss_vec(&mut rng, n);
    let c = topk(4096, 64, Rounding::Stochastic, false);
    let mut f = Vec::new();
    Encoder::new(c).unwrap().encode(&x, 1, &mut f).unwrap();
    // 16 blocks × (8 bytes of scales + 64 × 2 bytes of gaps + 64 × 2 bits of codes).
    let raw = 16 * (8 + 128 + 16);
    assert_eq!(f.len(), HEADER_LEN + raw);
    assert_eq!(max_encoded_len(&c, n), HEADER_LEN + raw);
    let mut z = Vec::new();
    Encoder::new(topk(4096, 64, Rounding::Stochastic, true))
        .unwrap()
        .encode(&x, 1, &mut z)
        .unwrap();
    assert!(
        z.len() < f.len(),
        "zstd did not shrink the gaps: {} vs {}",
        z.len(),
        f.len()
    );
    let ratio = (4 * n) as f64 / z.len() as f64;
    // 2 bits + a 16-bit gap per kept value, 1 in 64: about 0.3 bits per value before zstd, ~107× under fp32.
    assert!(ratio > 100.0, "only {ratio:.1}× smaller than fp32");
    println!(
        "topk2 bucket 4096 keep 64: {} bytes for {n} values, {ratio:.0}× under fp32",
        z.len()
    );
}

#[test]
fn configuration_is_checked() {
    for keep in [0u32, 1, 3, 96, 1 << 16] {
        assert_eq!(
            Encoder::new(topk(512, keep, Rounding::Stochastic, false)).err(),
            Some(CodecError::InvalidKeep),
            "keep {keep}"
        );
    }
    assert_eq!(
        Encoder::new(topk(MAX_SPARSE_BLOCK * 2, 64, Rounding::Stochastic, false)).err(),
        Some(CodecError::InvalidBucket)
    );
    assert!(Encoder::new(topk(MAX_SPARSE_BLOCK, 2, Rounding::Stochastic, false)).is_ok());
    // keep is ignored by the dense schemes.
    assert!(Encoder::new(CodecConfig {
        keep: 3,
        ..CodecConfig::default()
    })
    .is_ok());
    let mut nf = vec![1.0f32; 40];
    nf[17] = f32::NAN;
    let mut f = vec![1u8];
    assert_eq!(
        Encoder::new(topk(16, 4, Rounding::Stochastic, false))
            .unwrap()
            .encode(&nf, 0, &mut f),
        Err(CodecError::NonFinite { index: 17 })
    );
    assert!(f.is_empty());
}

#[test]
fn hostile_frames_get_typed_errors() {
    // 40 values, blocks of 16, keep 4: blocks of 16, 16, 8 keep 4, 4, 2 values.
    let x: Vec<f32> = (0..40).map(|i| (i as f32 - 19.5) * 0.1).collect();
    let mut f = Vec::new();
    Encoder::new(topk(16, 4, Rounding::Deterministic, false))
        .unwrap()
        .encode(&x, 0, &mut f)
        .unwrap();
    let (scales, gaps, codes) = (HEADER_LEN, HEADER_LEN + 3 * 8, HEADER_LEN + 3 * 8 + 2 * 10);
    assert_eq!(f.len(), codes + 3); // 10 codes of 2 bits
    let mut out = vec![0f32; 40];
    let mut dec = Decoder::new(40);
    dec.decode(&f, &mut out).unwrap();
    let damaged = |edit: &dyn Fn(&mut Vec<u8>)| {
        let mut g = f.clone();
        edit(&mut g);
        Decoder::new(40).decode(&g, &mut [0f32; 40]).err()
    };
    // keep shift out of 1..=15; a keep byte on a dense scheme.
    assert_eq!(damaged(&|g| g[7] = 0), Some(CodecError::InvalidKeep));
    assert_eq!(damaged(&|g| g[7] = 16), Some(CodecError::InvalidKeep));
    // A different shift implies a different body length.
    assert!(matches!(
        damaged(&|g| g[7] = 3),
        Some(CodecError::BodyLength { .. })
    ));
    let mut q = Vec::new();
    Encoder::new(CodecConfig {
        bucket: 16,
        ..CodecConfig::default()
    })
    .unwrap()
    .encode(&x, 0, &mut q)
    .unwrap();
    q[7] = 2;
    assert_eq!(
        Decoder::new(40).decode(&q, &mut out),
        Err(CodecError::BadFlags)
    );
    // A block larger than u16 positions allow.
    assert_eq!(
        damaged(&|g| g[8..12].copy_from_slice(&(1u32 << 17).to_le_bytes())),
        Some(CodecError::InvalidBucket)
    );
    // Scales: negative, NaN, infinite, lo > hi.
    for (at, v) in [(0, -1.0f32), (4, f32::NAN), (4, f32::INFINITY), (0, 1e9)] {
        assert_eq!(
            damaged(&|g| g[scales + at..scales + at + 4].copy_from_slice(&v.to_le_bytes())),
            Some(CodecError::BadScale),
            "scale {v} at {at}"
        );
    }
    // A repeated position (gap 0 after the first), and a position past the block's end.
    assert_eq!(
        damaged(&|g| g[gaps + 2..gaps + 4].copy_from_slice(&0u16.to_le_bytes())),
        Some(CodecError::BadCode { bucket: 0 })
    );
    assert_eq!(
        damaged(&|g| g[gaps + 2 * 9..gaps + 2 * 10].copy_from_slice(&9u16.to_le_bytes())),
        Some(CodecError::BadCode { bucket: 2 })
    );
    // Padding bits after the last code.
    assert_eq!(
        damaged(&|g| *g.last_mut().unwrap() |= 0x40),
        Some(CodecError::BadCode { bucket: 2 })
    );
    // Length mismatches against the caller's range.
    assert!(matches!(
        Decoder::new(40).decode(&f, &mut [0f32; 39]),
        Err(CodecError::LengthMismatch { .. })
    ));
    assert_eq!(
        Decoder::new(39).decode(&f, &mut out),
        Err(CodecError::BodyTooLarge)
    );
    // Truncated and trailing bytes.
    assert_eq!(
        Decoder::new(40).decode(&f[..f.len() - 1], &mut out),
        Err(CodecError::Truncated)
    );
}

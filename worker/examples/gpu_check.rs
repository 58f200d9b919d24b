//! GPU acceptance check (feature `cuda`), with the CPU backend as the oracle: gradient agreement, byte-identical
//! frames and their statistics through the CPU decoder, q4 encode bandwidth against a device-to-device copy of the
//! same buffer, and MLP training throughput GPU vs CPU. Prints one line per figure and exits non-zero if a
//! correctness check fails (the bandwidth goal is reported, not enforced).
//!
//! `gpu_check [--device cuda:N] [--elems N] [--seconds S]`; `gpu_check --emit-ptx DIR` (needs NVRTC, no GPU) to
//! write `<unit>.ptx` for machines without NVRTC (`TETHER_CUDA_PTX_DIR`); `gpu_check --cpu-only [--seconds S]` for
//! the CPU side of the training figure on a machine without a GPU.

use std::process::ExitCode;
use std::time::Instant;

use tether_common::codec::{seed_for, CodecConfig, Decoder, Encoder, ErrorFeedback};
use tether_worker::backend::cuda::{self, CudaEncoder, CudaMlp, CudaRuntime};
use tether_worker::backend::{kernels, Device};
use tether_worker::model::{Mlp, Model};

fn values(n: usize, seed: u64, a: f32) -> Vec<f32> {
    tether_common::testing::noise(n, seed, a)
}

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

/// Batches the training figure is measured at: the quickstart's and one that fills a large device better.
const TRAIN_BATCHES: [usize; 2] = [256, 4096];

/// Samples per second of `step` (one batch of `rows`) over `seconds`, after one warm-up step; prints one line.
fn samples_per_s(label: &str, rows: usize, seconds: f64, step: &mut dyn FnMut()) -> f64 {
    step();
    let t0 = Instant::now();
    let mut steps = 0usize;
    while t0.elapsed().as_secs_f64() < seconds {
        step();
        steps += 1;
    }
    let sps = (steps * rows) as f64 / t0.elapsed().as_secs_f64();
    println!("training: {label}: {sps:.0} samples/s (batch {rows}, MLP 784-256-128-10)");
    sps
}

/// The CPU backend's samples per second of loss and gradient on one batch.
fn cpu_samples_per_s(
    cpu: &mut Mlp,
    params: &[f32],
    x: &[f32],
    y: &[u32],
    rows: usize,
    seconds: f64,
) -> f64 {
    let mut g = vec![0.0; params.len()];
    samples_per_s("CPU Mlp::loss_and_grad", rows, seconds, &mut || {
        cpu.loss_and_grad(params, x, y, &mut g);
    })
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    if let Some(dir) = arg(&args, "--emit-ptx") {
        std::fs::create_dir_all(&dir).expect("cannot create the PTX directory");
        for unit in kernels::SOURCES {
            match cuda::compile_ptx(unit) {
                Ok(ptx) => {
                    let path = format!("{dir}/{}.ptx", unit.name);
                    std::fs::write(&path, ptx).expect("cannot write PTX");
                    println!("wrote {path}");
                }
                Err(e) => {
                    eprintln!("gpu_check: {e}");
                    return ExitCode::FAILURE;
                }
            }
        }
        return ExitCode::SUCCESS;
    }
    if args.iter().any(|a| a == "--cpu-only") {
        // The CPU side of the training figure alone, for a machine without a GPU (the goal compares the GPU with
        // the developers' 2-core machine, not with the GPU machine's own cores).
        let seconds: f64 = arg(&args, "--seconds").map_or(2.0, |v| v.parse().expect("--seconds S"));
        let (f, hidden, c) = (784, [256, 128], 10);
        let mut cpu = Mlp::new(f, &hidden, c);
        let params = cpu.layout().init_all(42);
        for rows in TRAIN_BATCHES {
            let x = values(rows * f, 1, 1.0);
            let y: Vec<u32> = (0..rows as u32).map(|i| (i * 7 + 3) % 10).collect();
            cpu_samples_per_s(&mut cpu, &params, &x, &y, rows, seconds);
        }
        return ExitCode::SUCCESS;
    }
    let device = arg(&args, "--device").unwrap_or_else(|| "cuda:0".into());
    let elems: usize = arg(&args, "--elems").map_or(1 << 26, |v| v.parse().expect("--elems N"));
    let seconds: f64 = arg(&args, "--seconds").map_or(2.0, |v| v.parse().expect("--seconds S"));
    let ordinal = match device.parse::<Device>() {
        Ok(Device::Cuda(n)) => n,
        _ => {
            eprintln!("gpu_check: --device must be cuda:N");
            return ExitCode::FAILURE;
        }
    };
    let rt = match CudaRuntime::new(ordinal) {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("gpu_check: {device}: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!("device: {}", rt.info());
    let mut ok = true;

    // 1. Gradients: GPU vs CPU on one batch of the quickstart MLP.
    let (f, hidden, c, rows) = (784, [256, 128], 10, 256);
    let mut cpu = Mlp::new(f, &hidden, c);
    let mut gpu = CudaMlp::new(rt.clone(), f, &hidden, c).expect("CudaMlp");
    let params = cpu.layout().init_all(42);
    let x = values(rows * f, 1, 1.0);
    let y: Vec<u32> = (0..rows as u32).map(|i| (i * 7 + 3) % 10).collect();
    let (mut gc, mut gg) = (vec![0.0; params.len()], vec![0.0; params.len()]);
    let lc = cpu.loss_and_grad(&params, &x, &y, &mut gc);
    let lg = gpu.loss_and_grad(&params, &x, &y, &mut gg);
    let scale = gc.iter().fold(0f32, |m, v| m.max(v.abs()));
    let err = gc
        .iter()
        .zip(&gg)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    let rel = err / scale;
    let pass = rel < 1e-3 && (lc - lg).abs() < 1e-3;
    ok &= pass;
    println!(
        "gradients: loss cpu {lc:.6} gpu {lg:.6}; max |Δg| / max |g| = {rel:.2e} ({})",
        if pass { "ok" } else { "FAIL" }
    );

    // 2. Frames: byte-identical to the CPU codec with error feedback, then unbiasedness and the error bound.
    let n = 100_003;
    let cfg = CodecConfig::default();
    let mut enc = Encoder::new(cfg).expect("encoder");
    let mut fb = ErrorFeedback::new(n);
    let mut genc = CudaEncoder::new(rt.clone(), cfg, n, true).expect("CudaEncoder");
    let (mut a, mut b) = (Vec::new(), Vec::new());
    let mut same = 0;
    for step in 0..8u64 {
        let g = values(n, 100 + step, 0.05);
        fb.encode(&mut enc, &g, seed_for(0, step, 0), &mut a)
            .expect("cpu encode");
        genc.encode(&g, seed_for(0, step, 0), &mut b)
            .expect("gpu encode");
        same += usize::from(a == b && fb.residual() == &genc.residual().expect("residual")[..]);
    }
    ok &= same == 8;
    println!("frames: {same}/8 q4+EF frames byte-identical to the CPU codec, residuals equal");
    let m = 4096;
    let xs = values(m, 77, 1.0);
    let mut plain = CudaEncoder::new(rt.clone(), cfg, m, false).expect("CudaEncoder");
    let mut dec = Decoder::new(m);
    let mut out = vec![0.0; m];
    let mut mean = vec![0.0f64; m];
    let trials = 2000;
    let mut worst_bound = 0f32;
    for t in 0..trials {
        plain
            .encode(&xs, seed_for(9, t, 0), &mut b)
            .expect("gpu encode");
        dec.decode(&b, &mut out)
            .expect("CPU decoder rejects a GPU frame");
        for (bi, (chunk, o)) in xs
            .chunks(cfg.bucket)
            .zip(out.chunks(cfg.bucket))
            .enumerate()
        {
            let s = chunk.iter().fold(0f32, |mm, v| mm.max(v.abs()));
            let step = s / 7.0;
            for (j, (xv, ov)) in chunk.iter().zip(o).enumerate() {
                worst_bound = worst_bound.max((ov - xv).abs() / step);
                mean[bi * cfg.bucket + j] += f64::from(*ov);
            }
        }
    }
    // Per element the estimate's standard deviation is ≤ step/2/sqrt(trials); allow 6 sigma.
    let mut worst_bias = 0f64;
    for (bi, chunk) in xs.chunks(cfg.bucket).enumerate() {
        let s = chunk.iter().fold(0f32, |mm, v| mm.max(v.abs()));
        let step = f64::from(s / 7.0);
        for (j, xv) in chunk.iter().enumerate() {
            let bias = (mean[bi * cfg.bucket + j] / trials as f64 - f64::from(*xv)).abs();
            worst_bias = worst_bias.max(bias / (step / 2.0 / (trials as f64).sqrt()));
        }
    }
    let pass = worst_bound <= 1.0 + 1e-5 && worst_bias < 6.0;
    ok &= pass;
    println!(
        "codec: {trials} GPU frames decoded by the CPU; max |x̂−x| = {worst_bound:.4} steps (≤ 1), max |mean−x| = \
         {worst_bias:.2} σ (< 6) ({})",
        if pass { "ok" } else { "FAIL" }
    );

    // 3. Bandwidth: q4 encode (with and without EF) vs a device-to-device copy of the same buffer.
    let g = values(elems, 5, 0.1);
    let src = rt.upload(&g).expect("upload");
    let mut dst = rt.zeros::<f32>(elems).expect("alloc");
    let bench = |label: &str, f: &mut dyn FnMut()| -> f64 {
        f();
        rt.synchronize().expect("sync");
        let iters = 20;
        let t0 = Instant::now();
        for _ in 0..iters {
            f();
        }
        rt.synchronize().expect("sync");
        let gbs = (4 * elems * iters) as f64 / t0.elapsed().as_secs_f64() / 1e9;
        println!("bandwidth: {label}: {gbs:.1} GB/s of fp32 input ({elems} elements)");
        gbs
    };
    let copy = bench("device-to-device copy", &mut || {
        rt.copy(&src, &mut dst).expect("copy")
    });
    let mut e1 = CudaEncoder::new(rt.clone(), cfg, elems, false).expect("CudaEncoder");
    let q4 = bench("q4 encode", &mut || {
        e1.launch(&src.slice(..), 1).expect("launch")
    });
    let mut e2 = CudaEncoder::new(rt.clone(), cfg, elems, true).expect("CudaEncoder");
    let q4ef = bench("q4 encode + EF", &mut || {
        e2.launch(&src.slice(..), 1).expect("launch")
    });
    println!(
        "bandwidth: q4 / copy = {:.2}x, q4+EF / copy = {:.2}x (goal ≥ 0.5x: {})",
        q4 / copy,
        q4ef / copy,
        if q4 / copy >= 0.5 { "met" } else { "missed" }
    );
    let mut cenc = Encoder::new(cfg).expect("encoder");
    let cpu_n = elems.min(1 << 24);
    let t0 = Instant::now();
    cenc.encode(&g[..cpu_n], 1, &mut a).expect("cpu encode");
    println!(
        "bandwidth: CPU q4 encode (one thread) {:.1} GB/s",
        (4 * cpu_n) as f64 / t0.elapsed().as_secs_f64() / 1e9
    );

    // 4. Training throughput: samples/s of loss+gradient, CPU vs GPU (host API incl. transfers) vs GPU-resident step,
    // at the quickstart's batch and at a batch that fills the device better.
    let p = params.len();
    let mut senc = CudaEncoder::new(rt.clone(), cfg, p, true).expect("CudaEncoder");
    for rows in TRAIN_BATCHES {
        let x = values(rows * f, 1, 1.0);
        let y: Vec<u32> = (0..rows as u32).map(|i| (i * 7 + 3) % 10).collect();
        let s_cpu = cpu_samples_per_s(&mut cpu, &params, &x, &y, rows, seconds);
        let s_gpu = samples_per_s(
            "GPU CudaMlp::loss_and_grad (upload params+batch, download grad)",
            rows,
            seconds,
            &mut || {
                gpu.loss_and_grad(&params, &x, &y, &mut gg);
            },
        );
        let s_dev = samples_per_s(
            "GPU step on device (grad, clip, q4+EF encode, frame download)",
            rows,
            seconds,
            &mut || {
                gpu.loss_and_grad_device(&params, &x, &y).expect("step");
                gpu.clip_grad(1.0).expect("clip");
                senc.encode_device(&gpu.grad_device().slice(..), 3, &mut b)
                    .expect("encode");
            },
        );
        println!(
            "training: batch {rows}: GPU/CPU = {:.1}x (host API), {:.1}x (device step)",
            s_gpu / s_cpu,
            s_dev / s_cpu
        );
    }
    if ok {
        println!("gpu_check: all correctness checks passed");
        ExitCode::SUCCESS
    } else {
        println!("gpu_check: a correctness check FAILED");
        ExitCode::FAILURE
    }
}

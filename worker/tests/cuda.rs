//! The CUDA backend against its contract, on any machine: without the `cuda` feature every entry point (and
//! `tether-worker --device cuda:0`) gives the typed "not compiled with CUDA" error; with it, `probe` reports missing
//! libraries or devices without panicking, NVRTC compiles every kernel unit when its library loads, and on a GPU the
//! CPU backend is the oracle: gradients, clipping, predictions and frames (byte for byte, residual included) must match.
//! Tests whose requirement is absent print why and return.

use std::process::Command;

use tether_worker::backend::{self, BackendError, Device};

#[test]
fn devices_parse_and_cpu_is_not_probed() {
    assert_eq!("cuda:1".parse::<Device>().unwrap(), Device::Cuda(1));
    assert!(matches!(
        backend::probe("cpu"),
        Err(BackendError::UnknownDevice(_))
    ));
    assert!(matches!(
        backend::probe("gpu0"),
        Err(BackendError::UnknownDevice(_))
    ));
}

#[test]
fn worker_binary_rejects_unusable_cuda_device_with_one_line() {
    // The device is checked before the config is read, so a missing config file is never reached.
    // TETHER_WORKER_BIN: the carried binary when this test runs on a machine without the build tree (gpu-check.sh).
    let bin = std::env::var("TETHER_WORKER_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_tether-worker").to_string());
    let out = Command::new(bin)
        .args(["--config", "/nonexistent/cluster.toml", "--rank", "0"])
        .args(["--device", "cuda:0"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    if cfg!(feature = "cuda") && backend::probe("cuda:0").is_ok() {
        // A usable GPU: the device passes and the missing config is what fails.
        assert!(!out.status.success());
        assert!(err.contains("cluster.toml"), "{err}");
        return;
    }
    assert!(!out.status.success(), "must fail without a usable GPU");
    let line = err
        .lines()
        .find(|l| l.starts_with("tether-worker:"))
        .unwrap_or_else(|| panic!("no cause line in {err:?}"));
    assert!(line.contains("device cuda:0"), "{line}");
    if cfg!(feature = "cuda") {
        assert!(
            line.contains("cannot load") || line.contains("no CUDA device"),
            "{line}"
        );
    } else {
        assert!(line.contains("--features cuda"), "{line}");
    }
    assert!(!err.contains("panicked"), "{err}");
}

#[cfg(not(feature = "cuda"))]
#[test]
fn without_the_feature_everything_is_not_compiled_with_cuda() {
    assert!(matches!(
        backend::probe("cuda:0"),
        Err(BackendError::NotCompiledWithCuda)
    ));
    let cfg = tether_common::config::ModelConfig {
        kind: tether_common::config::ModelKind::Mlp,
        hidden: vec![8],
        seed: 1,
        features: None,
        classes: None,
        ..Default::default()
    };
    assert!(matches!(
        backend::cuda::model_factory(0, &cfg, 4, 3),
        Err(BackendError::NotCompiledWithCuda)
    ));
    assert!(matches!(
        backend::cuda::compile_ptx(&backend::kernels::SOURCES[0]),
        Err(BackendError::NotCompiledWithCuda)
    ));
    assert!(!backend::cuda::nvrtc_available());
}

#[cfg(feature = "cuda")]
mod with_cuda {
    use std::sync::Arc;

    use tether_common::codec::{
        seed_for, CodecConfig, Decoder, Encoder, ErrorFeedback, Rounding, Scheme,
    };
    use tether_worker::backend::cuda::{self, CudaEncoder, CudaMlp, CudaRuntime};
    use tether_worker::backend::{kernels, BackendError};
    use tether_worker::model::{Mlp, Model};

    /// The runtime on GPU 0, or None after printing why these tests cannot run here.
    fn gpu(test: &str) -> Option<Arc<CudaRuntime>> {
        match CudaRuntime::new(0) {
            Ok(rt) => Some(rt),
            Err(e) => {
                println!("SKIPPED {test}: no usable GPU ({e})");
                None
            }
        }
    }

    /// Deterministic pseudo-random values in (-a, a).
    fn values(n: usize, seed: u64, a: f32) -> Vec<f32> {
        tether_common::testing::noise(n, seed, a)
    }

    #[test]
    fn probe_reports_absence_without_panicking() {
        let libs = cuda::libraries();
        match tether_worker::backend::probe("cuda:0") {
            Ok(info) => println!("GPU present: {info}"),
            Err(e) => {
                println!("probe: {e}");
                if !libs.driver {
                    assert!(
                        matches!(e, BackendError::LibraryMissing { .. }),
                        "driver absent must read as a missing library, got {e}"
                    );
                }
            }
        }
        // A huge ordinal is never a panic either.
        assert!(tether_worker::backend::probe("cuda:4096").is_err());
    }

    #[test]
    fn nvrtc_compiles_every_kernel_unit() {
        if !cuda::nvrtc_available() {
            println!(
                "SKIPPED nvrtc_compiles_every_kernel_unit: libnvrtc not loadable (see .ci/run)"
            );
            return;
        }
        for unit in kernels::SOURCES {
            let ptx = cuda::compile_ptx(unit).unwrap_or_else(|e| panic!("{e}"));
            for f in unit.functions {
                assert!(
                    ptx.contains(&format!(".entry {f}(")),
                    "{}: no entry {f}",
                    unit.name
                );
            }
            println!("nvrtc: {} -> {} bytes of PTX", unit.name, ptx.len());
        }
    }

    #[test]
    fn gpu_gradients_match_the_cpu_oracle() {
        let Some(rt) = gpu("gpu_gradients_match_the_cpu_oracle") else {
            return;
        };
        let (f, hidden, c, rows) = (37, [64, 24], 10, 53);
        let mut cpu = Mlp::new(f, &hidden, c);
        let mut dev = CudaMlp::new(rt, f, &hidden, c).unwrap();
        assert_eq!(cpu.layout(), dev.layout());
        let params = cpu.layout().init_all(7);
        let x = values(rows * f, 3, 1.0);
        let y: Vec<u32> = (0..rows as u32).map(|i| (i * 7) % c as u32).collect();
        let mut g_cpu = vec![0.0; params.len()];
        let mut g_gpu = vec![0.0; params.len()];
        let l_cpu = cpu.loss_and_grad(&params, &x, &y, &mut g_cpu);
        let l_gpu = dev.loss_and_grad(&params, &x, &y, &mut g_gpu);
        assert!(
            (l_cpu - l_gpu).abs() <= 1e-4 * l_cpu.abs().max(1.0),
            "{l_cpu} vs {l_gpu}"
        );
        let scale = g_cpu.iter().fold(0f32, |m, v| m.max(v.abs()));
        let err = g_cpu
            .iter()
            .zip(&g_gpu)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(err <= 1e-4 * scale, "max |Δg| {err} vs scale {scale}");
        assert!((cpu.loss(&params, &x, &y) - dev.loss(&params, &x, &y)).abs() < 1e-4);
        let (mut p_cpu, mut p_gpu) = (vec![0; rows], vec![0; rows]);
        cpu.predict(&params, &x, &mut p_cpu);
        dev.predict(&params, &x, &mut p_gpu);
        let agree = p_cpu.iter().zip(&p_gpu).filter(|(a, b)| a == b).count();
        assert!(agree >= rows - 1, "{agree}/{rows} predictions agree");
        // Clip on the device: the norm matches the host norm and the clipped vector has the clip norm.
        let norm_host = g_gpu
            .iter()
            .map(|v| f64::from(*v).powi(2))
            .sum::<f64>()
            .sqrt() as f32;
        let norm = dev.clip_grad(norm_host / 2.0).unwrap();
        assert!((norm - norm_host).abs() <= 1e-5 * norm_host);
        dev.download_grad(&mut g_gpu).unwrap();
        let after = g_gpu
            .iter()
            .map(|v| f64::from(*v).powi(2))
            .sum::<f64>()
            .sqrt() as f32;
        assert!((after - norm_host / 2.0).abs() <= 1e-4 * norm_host);
    }

    #[test]
    fn gpu_frames_are_byte_identical_to_the_cpu_codec() {
        let Some(rt) = gpu("gpu_frames_are_byte_identical_to_the_cpu_codec") else {
            return;
        };
        // 512 is the default bucket (the kernel's unrolled, register-cached path); 64 and 4096 take the general one.
        for bucket in [512, 64, 4096] {
            for scheme in [Scheme::Q4, Scheme::Q8, Scheme::Q2] {
                for rounding in [Rounding::Stochastic, Rounding::Deterministic] {
                    frames_match(&rt, bucket, scheme, rounding);
                }
            }
        }
        // Frames decode with the strict CPU decoder.
        let cfg = CodecConfig::default();
        let mut gpu_enc = CudaEncoder::new(rt, cfg, 1000, false).unwrap();
        let mut frame = Vec::new();
        gpu_enc
            .encode(&values(1000, 9, 1.0), 3, &mut frame)
            .unwrap();
        let mut out = vec![0.0; 1000];
        Decoder::new(1000).decode(&frame, &mut out).unwrap();
    }
    /// GPU and CPU frames (and residuals) of one codec configuration over 4 steps with error feedback: a partial
    /// last bucket, an odd length, a zero bucket and a tiny-scale bucket; then a NaN is refused with state untouched.
    fn frames_match(rt: &Arc<CudaRuntime>, bucket: usize, scheme: Scheme, rounding: Rounding) {
        let n = 3 * bucket + 77;
        let cfg = CodecConfig {
            scheme,
            bucket,
            rounding,
            zstd: false,
            keep: tether_common::codec::DEFAULT_KEEP,
        };
        let mut enc = Encoder::new(cfg).unwrap();
        let mut fb = ErrorFeedback::new(n);
        let mut gpu_enc = CudaEncoder::new(rt.clone(), cfg, n, true).unwrap();
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for step in 0..4u64 {
            let mut g = values(n, 11 + step, 0.3);
            g[bucket..2 * bucket].fill(0.0);
            g[2 * bucket..3 * bucket]
                .iter_mut()
                .for_each(|v| *v *= 1e-39);
            let seed = seed_for(2, step, 1);
            fb.encode(&mut enc, &g, seed, &mut a).unwrap();
            gpu_enc.encode(&g, seed, &mut b).unwrap();
            assert_eq!(a, b, "{scheme} {rounding:?} bucket {bucket} step {step}");
            assert_eq!(
                fb.residual(),
                &gpu_enc.residual().unwrap()[..],
                "bucket {bucket}"
            );
        }
        let mut bad = values(n, 5, 1.0);
        bad[bucket + 188] = f32::NAN;
        let before = gpu_enc.residual().unwrap();
        let e = gpu_enc.encode(&bad, 1, &mut b).unwrap_err();
        assert!(e.to_string().contains(&(bucket + 188).to_string()), "{e}");
        assert!(b.is_empty());
        assert_eq!(before, gpu_enc.residual().unwrap());
    }
}

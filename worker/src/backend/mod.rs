//! Compute backends: where a worker's gradients are computed and encoded. The CPU backend is the [`crate::model`]
//! code itself and is the oracle; the CUDA backend ([`cuda`]) mirrors it on a GPU: [`cuda::CudaMlp`] implements
//! [`crate::model::Model`] (so `StepEngine` and the trainer use it unchanged) and [`cuda::CudaEncoder`] writes the
//! same frames as `tether_common::codec` with the error-feedback residual kept on the device.
//!
//! Invariants: the [`cuda`] module has the same public surface with and without the `cuda` feature; without it every
//! entry point returns [`BackendError::NotCompiledWithCuda`], so callers never need `cfg`. [`probe`] checks that the
//! CUDA libraries can be loaded before any CUDA call is made (cudarc panics on a missing library otherwise).

use std::fmt;
use std::str::FromStr;

use tether_common::codec::CodecError;

pub mod kernels;

#[cfg(feature = "cuda")]
#[path = "cuda.rs"]
pub mod cuda;

#[cfg(not(feature = "cuda"))]
#[path = "nocuda.rs"]
pub mod cuda;

/// Environment variable naming a directory of `<unit>.ptx` files (see [`kernels::SOURCES`]), used when the NVRTC
/// library is not installed on the GPU machine.
pub const PTX_DIR_ENV: &str = "TETHER_CUDA_PTX_DIR";

/// A compute device named on the command line: `cpu`, `cuda` (= `cuda:0`) or `cuda:N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// The CPU backend (ndarray + the CPU codec).
    Cpu,
    /// The CUDA GPU with this ordinal.
    Cuda(usize),
}

impl FromStr for Device {
    type Err = BackendError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| BackendError::UnknownDevice(s.to_owned())),
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// What [`probe`] found about a GPU and the libraries the backend will use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaInfo {
    /// Device ordinal.
    pub ordinal: usize,
    /// Device name as the driver reports it.
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// Device memory in bytes.
    pub total_mem: usize,
    /// Number of CUDA devices visible.
    pub device_count: usize,
    /// Whether cuBLAS can be loaded (otherwise a tiled sgemm kernel does the products).
    pub cublas: bool,
    /// How kernels are obtained: `nvrtc` (compiled at start-up) or `ptx:<dir>` (precompiled).
    pub kernels: String,
}

impl fmt::Display for CudaInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "cuda:{} {} (sm_{}{}, {:.1} GiB, {} device(s)); gemm {}; kernels {}",
            self.ordinal,
            self.name,
            self.compute_capability.0,
            self.compute_capability.1,
            self.total_mem as f64 / (1u64 << 30) as f64,
            self.device_count,
            if self.cublas {
                "cublas"
            } else {
                "tiled kernel"
            },
            self.kernels
        )
    }
}

/// Failures of a compute backend.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// This binary was built without the `cuda` feature.
    #[error("this build has no CUDA backend (rebuild with `--features cuda`); use --device cpu")]
    NotCompiledWithCuda,
    /// A device name that is not `cpu`, `cuda` or `cuda:N`.
    #[error("unknown device {0:?} (cpu | cuda:N)")]
    UnknownDevice(String),
    /// A shared library the backend needs cannot be loaded.
    #[error("cannot load {library}: {hint}")]
    LibraryMissing {
        /// The library (and what provides it).
        library: &'static str,
        /// What to install or set.
        hint: &'static str,
    },
    /// The requested ordinal does not exist.
    #[error("no CUDA device {ordinal} ({count} visible)")]
    NoDevice {
        /// Requested ordinal.
        ordinal: usize,
        /// Devices visible to the driver.
        count: usize,
    },
    /// A CUDA driver call failed.
    #[error("CUDA driver: {0}")]
    Driver(String),
    /// A cuBLAS call failed.
    #[error("cuBLAS: {0}")]
    Cublas(String),
    /// NVRTC could not compile a kernel unit (or its PTX could not be read).
    #[error("kernel unit {unit}: {message}")]
    Kernel {
        /// The unit ([`kernels::KernelSource::name`]).
        unit: &'static str,
        /// Compiler log or I/O error.
        message: String,
    },
    /// The configuration asks for something this backend does not do.
    #[error("unsupported on the CUDA backend: {0}")]
    Unsupported(String),
    /// A codec-level failure (non-finite input, frame too large).
    #[error(transparent)]
    Codec(#[from] CodecError),
}

/// Checks that `device` (`cuda` or `cuda:N`) is usable: the driver, NVRTC (or a PTX directory) and the GPU itself.
///
/// Library presence is checked before any CUDA call. Without the `cuda` feature this is always
/// [`BackendError::NotCompiledWithCuda`]; for `cpu` it is [`BackendError::UnknownDevice`] (nothing to probe).
pub fn probe(device: &str) -> Result<CudaInfo, BackendError> {
    match device.parse::<Device>()? {
        Device::Cuda(ordinal) => cuda::probe_ordinal(ordinal),
        Device::Cpu => Err(BackendError::UnknownDevice(format!(
            "{device} (probe expects cuda:N)"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_parse() {
        assert_eq!("cpu".parse::<Device>().unwrap(), Device::Cpu);
        assert_eq!("cuda".parse::<Device>().unwrap(), Device::Cuda(0));
        assert_eq!("cuda:3".parse::<Device>().unwrap(), Device::Cuda(3));
        assert!(matches!(
            "cuda:x".parse::<Device>(),
            Err(BackendError::UnknownDevice(_))
        ));
        assert!(matches!(
            "tpu".parse::<Device>(),
            Err(BackendError::UnknownDevice(_))
        ));
        assert_eq!(Device::Cuda(2).to_string(), "cuda:2");
    }

    #[test]
    fn every_kernel_unit_names_its_functions() {
        for unit in kernels::SOURCES {
            for f in unit.functions {
                assert!(
                    unit.source.contains(&format!("void {f}(")),
                    "{} lacks {f}",
                    unit.name
                );
            }
        }
    }
}

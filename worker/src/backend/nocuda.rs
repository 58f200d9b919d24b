//! The CUDA backend's stand-in for builds without the `cuda` feature: the same entry points as the real module, each
//! returning [`BackendError::NotCompiledWithCuda`], so callers (the `tether-worker` binary, tests) need no `cfg`.

use tether_common::config::ModelConfig;

use super::{BackendError, CudaInfo};
use crate::model::ModelFactory;

/// Always [`BackendError::NotCompiledWithCuda`] in this build.
pub fn probe_ordinal(_ordinal: usize) -> Result<CudaInfo, BackendError> {
    Err(BackendError::NotCompiledWithCuda)
}

/// Always [`BackendError::NotCompiledWithCuda`] in this build.
pub fn model_factory(
    _ordinal: usize,
    _cfg: &ModelConfig,
    _features: usize,
    _classes: usize,
) -> Result<(CudaInfo, ModelFactory), BackendError> {
    Err(BackendError::NotCompiledWithCuda)
}

/// Always [`BackendError::NotCompiledWithCuda`] in this build.
pub fn compile_ptx(_unit: &super::kernels::KernelSource) -> Result<String, BackendError> {
    Err(BackendError::NotCompiledWithCuda)
}

/// Always false in this build: there is no NVRTC binding to load.
pub fn nvrtc_available() -> bool {
    false
}

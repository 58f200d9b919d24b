//! The CUDA backend (feature `cuda`): cudarc 0.19 with the driver, cuBLAS and NVRTC loaded at run time, so the build
//! needs no CUDA toolkit. [`CudaRuntime`] owns one device's context, stream, cuBLAS handle and the kernels of
//! [`super::kernels`]; [`CudaMlp`] is the GPU twin of [`crate::model::Mlp`] (same layout, same math, parameters and
//! gradients in one flat device buffer); [`CudaEncoder`] writes `tether_common::codec` frames (q8/q4/q2) from a
//! device gradient with the error-feedback residual kept on the device.
//!
//! Invariants: no CUDA entry point is called before [`probe_ordinal`] has checked that the driver library loads
//! (cudarc panics on a missing library). Products use cuBLAS when it loads and a tiled NVRTC kernel otherwise; kernels
//! come from NVRTC when it loads and from `$TETHER_CUDA_PTX_DIR/<unit>.ptx` otherwise. Scratch buffers grow to the
//! largest batch seen and are then reused. A CUDA failure inside a [`Model`] method (which cannot return an error)
//! panics with the driver's message: the device is unusable and the worker exits with that one-line cause.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, LaunchConfig,
    PushKernelArg,
};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};

use tether_common::codec::{CodecConfig, CodecError, Rounding, Scheme, HEADER_LEN, MAGIC, VERSION};
use tether_common::config::{ModelConfig, ModelKind};
use tether_common::layout::Layout;

use super::kernels::{KernelSource, SOURCES};
use super::{BackendError, CudaInfo, PTX_DIR_ENV};
use crate::model::{Mlp, Model, ModelFactory};

/// Threads per block of the element-wise and reduction kernels.
const THREADS: u32 = 256;
/// Blocks of the global-norm reduction (and the most any grid-stride kernel launches).
const MAX_BLOCKS: u32 = 4096;
/// Blocks of the first norm pass (its partials are summed in one fixed order).
const NORM_BLOCKS: u32 = 256;

fn drv(e: cudarc::driver::DriverError) -> BackendError {
    BackendError::Driver(e.to_string())
}

fn blas(e: cudarc::cublas::result::CublasError) -> BackendError {
    BackendError::Cublas(e.to_string())
}

/// Converts a size to a kernel `int`, or reports that it is too large for this backend.
fn int(v: usize, what: &str) -> Result<i32, BackendError> {
    i32::try_from(v).map_err(|_| BackendError::Unsupported(format!("{what} = {v} exceeds i32")))
}

/// Which CUDA libraries can be loaded (nothing else is called).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Libraries {
    /// libcuda (the driver).
    pub driver: bool,
    /// libnvrtc.
    pub nvrtc: bool,
    /// libcublas.
    pub cublas: bool,
}

/// Checks which libraries load, without calling into any of them.
pub fn libraries() -> Libraries {
    // SAFETY: each is_culib_present only attempts dlopen of the candidate names and drops the handle.
    unsafe {
        Libraries {
            driver: cudarc::driver::sys::is_culib_present(),
            nvrtc: cudarc::nvrtc::sys::is_culib_present(),
            cublas: cudarc::cublas::sys::is_culib_present(),
        }
    }
}

/// Whether the NVRTC library can be loaded (so kernels can be compiled here).
pub fn nvrtc_available() -> bool {
    libraries().nvrtc
}

/// Compiles one kernel unit to PTX text with NVRTC (checks the library first).
pub fn compile_ptx(unit: &KernelSource) -> Result<String, BackendError> {
    if !nvrtc_available() {
        return Err(BackendError::LibraryMissing {
            library: "libnvrtc.so (CUDA NVRTC)",
            hint: "pip download nvidia-cuda-nvrtc, unzip, put nvidia/cu13/lib on LD_LIBRARY_PATH",
        });
    }
    let opts = CompileOptions {
        name: Some(format!("{}.cu", unit.name)),
        ..Default::default()
    };
    compile_ptx_with_opts(unit.source, opts)
        .map(|p| p.to_src())
        .map_err(|e| BackendError::Kernel {
            unit: unit.name,
            message: e.to_string(),
        })
}

fn kernel_origin() -> Result<String, BackendError> {
    if nvrtc_available() {
        return Ok("nvrtc".into());
    }
    match std::env::var(PTX_DIR_ENV) {
        Ok(dir) if !dir.is_empty() => Ok(format!("ptx:{dir}")),
        _ => Err(BackendError::LibraryMissing {
            library: "libnvrtc.so (CUDA NVRTC)",
            hint: "install CUDA NVRTC (on LD_LIBRARY_PATH) or set TETHER_CUDA_PTX_DIR to precompiled PTX",
        }),
    }
}

fn load_ptx(unit: &KernelSource) -> Result<Ptx, BackendError> {
    if nvrtc_available() {
        return compile_ptx(unit).map(Ptx::from_src);
    }
    let dir = std::env::var(PTX_DIR_ENV).unwrap_or_default();
    let path = std::path::Path::new(&dir).join(format!("{}.ptx", unit.name));
    std::fs::read_to_string(&path)
        .map(Ptx::from_src)
        .map_err(|e| BackendError::Kernel {
            unit: unit.name,
            message: format!("{}: {e}", path.display()),
        })
}

/// Checks libraries, then the device: driver library, kernel source (NVRTC or PTX dir), device count, the device.
pub fn probe_ordinal(ordinal: usize) -> Result<CudaInfo, BackendError> {
    let libs = libraries();
    if !libs.driver {
        return Err(BackendError::LibraryMissing {
            library: "libcuda.so (the NVIDIA driver)",
            hint: "no NVIDIA driver on this machine; use --device cpu",
        });
    }
    let kernels = kernel_origin()?;
    let count = match CudaContext::device_count() {
        Ok(c) => c.max(0) as usize,
        Err(e) if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_NO_DEVICE => 0,
        Err(e) => return Err(drv(e)),
    };
    if ordinal >= count {
        return Err(BackendError::NoDevice { ordinal, count });
    }
    let ctx = CudaContext::new(ordinal).map_err(drv)?;
    Ok(CudaInfo {
        ordinal,
        name: ctx.name().map_err(drv)?,
        compute_capability: ctx.compute_capability().map_err(drv)?,
        total_mem: ctx.total_mem().map_err(drv)?,
        device_count: count,
        cublas: libs.cublas,
        kernels,
    })
}

/// The loaded kernels, by role.
#[derive(Debug)]
struct Kernels {
    bias_act: CudaFunction,
    relu_mask: CudaFunction,
    softmax_xent: CudaFunction,
    col_sums: CudaFunction,
    argmax_rows: CudaFunction,
    sumsq_partial: CudaFunction,
    norm_clip: CudaFunction,
    quant_encode: CudaFunction,
    sgemm_tiled: CudaFunction,
}

/// One GPU: context, stream, cuBLAS handle (when installed) and every kernel, shared by models and encoders.
pub struct CudaRuntime {
    info: CudaInfo,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: Option<CudaBlas>,
    k: Kernels,
}

impl std::fmt::Debug for CudaRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaRuntime")
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

fn grid(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(THREADS as usize).clamp(1, MAX_BLOCKS as usize) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl CudaRuntime {
    /// Probes device `ordinal`, creates its context and stream, loads cuBLAS (if present) and every kernel.
    pub fn new(ordinal: usize) -> Result<Arc<Self>, BackendError> {
        let info = probe_ordinal(ordinal)?;
        let ctx = CudaContext::new(ordinal).map_err(drv)?;
        let stream = ctx.default_stream();
        let blas = if info.cublas {
            Some(CudaBlas::new(stream.clone()).map_err(blas)?)
        } else {
            None
        };
        let mut funcs: HashMap<&'static str, CudaFunction> = HashMap::new();
        for unit in SOURCES {
            let module = ctx.load_module(load_ptx(unit)?).map_err(drv)?;
            for f in unit.functions {
                funcs.insert(f, module.load_function(f).map_err(drv)?);
            }
        }
        let mut take = |name: &'static str| {
            funcs.remove(name).ok_or(BackendError::Kernel {
                unit: "all",
                message: format!("kernel {name} not loaded"),
            })
        };
        let k = Kernels {
            bias_act: take("bias_act")?,
            relu_mask: take("relu_mask")?,
            softmax_xent: take("softmax_xent")?,
            col_sums: take("col_sums")?,
            argmax_rows: take("argmax_rows")?,
            sumsq_partial: take("sumsq_partial")?,
            norm_clip: take("norm_clip")?,
            quant_encode: take("quant_encode")?,
            sgemm_tiled: take("sgemm_tiled")?,
        };
        Ok(Arc::new(Self {
            info,
            ctx,
            stream,
            blas,
            k,
        }))
    }

    /// What the probe found.
    pub fn info(&self) -> &CudaInfo {
        &self.info
    }

    /// The stream every operation of this runtime is queued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The device context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Waits until every queued operation has finished (benchmarks call this before reading the clock).
    pub fn synchronize(&self) -> Result<(), BackendError> {
        self.stream.synchronize().map_err(drv)
    }

    /// Copies `src` to a new device buffer.
    pub fn upload<T: cudarc::driver::DeviceRepr>(
        &self,
        src: &[T],
    ) -> Result<CudaSlice<T>, BackendError> {
        self.stream.clone_htod(src).map_err(drv)
    }

    /// Copies a device buffer back to the host (waits for it).
    pub fn download<T: cudarc::driver::DeviceRepr>(
        &self,
        src: &CudaView<'_, T>,
    ) -> Result<Vec<T>, BackendError> {
        self.stream.clone_dtoh(src).map_err(drv)
    }

    /// A zeroed device buffer of `len` values.
    pub fn zeros<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> Result<CudaSlice<T>, BackendError> {
        self.stream.alloc_zeros(len.max(1)).map_err(drv)
    }

    /// Device-to-device copy of `src` into `dst` (the bandwidth reference of the codec benchmark).
    pub fn copy(&self, src: &CudaSlice<f32>, dst: &mut CudaSlice<f32>) -> Result<(), BackendError> {
        self.stream.memcpy_dtod(src, dst).map_err(drv)
    }

    /// Row-major `C[m,n] = op(A)·op(B)` (`A` is `[m,k]`, or `[k,m]` when `ta`; `B` is `[k,n]`, or `[n,k]` when `tb`).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        &self,
        m: usize,
        n: usize,
        k: usize,
        a: &CudaView<'_, f32>,
        ta: bool,
        b: &CudaView<'_, f32>,
        tb: bool,
        c: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), BackendError> {
        assert!(a.len() >= m * k && b.len() >= k * n && c.len() >= m * n);
        let (mi, ni, ki) = (int(m, "m")?, int(n, "n")?, int(k, "k")?);
        if m == 0 || n == 0 {
            return Ok(());
        }
        match &self.blas {
            Some(h) => {
                // Column-major view of row-major data: C^T[n,m] = op(B)^T · op(A)^T, so B goes first.
                let op = |t: bool| {
                    if t {
                        cublasOperation_t::CUBLAS_OP_T
                    } else {
                        cublasOperation_t::CUBLAS_OP_N
                    }
                };
                let cfg = GemmConfig {
                    transa: op(tb),
                    transb: op(ta),
                    m: ni,
                    n: mi,
                    k: ki,
                    alpha: 1.0f32,
                    lda: if tb { ki } else { ni },
                    ldb: if ta { mi } else { ki },
                    beta: 0.0f32,
                    ldc: ni,
                };
                // SAFETY: the assert above proves each buffer holds the matrix its leading dimension describes.
                unsafe { h.gemm(cfg, b, a, c) }.map_err(blas)
            }
            None => {
                let cfg = LaunchConfig {
                    grid_dim: (n.div_ceil(16) as u32, m.div_ceil(16) as u32, 1),
                    block_dim: (16, 16, 1),
                    shared_mem_bytes: 0,
                };
                let (ta, tb) = (i32::from(ta), i32::from(tb));
                let mut l = self.stream.launch_builder(&self.k.sgemm_tiled);
                l.arg(&mi)
                    .arg(&ni)
                    .arg(&ki)
                    .arg(a)
                    .arg(&ta)
                    .arg(b)
                    .arg(&tb)
                    .arg(c);
                // SAFETY: argument list matches sgemm_tiled; bounds were asserted above and the kernel guards edges.
                unsafe { l.launch(cfg) }.map(drop).map_err(drv)
            }
        }
    }

    fn bias_act(
        &self,
        z: &mut CudaSlice<f32>,
        b: &CudaView<'_, f32>,
        rows: usize,
        cols: usize,
        relu: bool,
    ) -> Result<(), BackendError> {
        assert!(z.len() >= rows * cols && b.len() >= cols);
        let (r, c, relu) = (int(rows, "rows")?, int(cols, "cols")?, i32::from(relu));
        let mut l = self.stream.launch_builder(&self.k.bias_act);
        l.arg(z).arg(b).arg(&r).arg(&c).arg(&relu);
        // SAFETY: matches bias_act(float*, const float*, int, int, int); sizes asserted above.
        unsafe { l.launch(grid(rows * cols)) }
            .map(drop)
            .map_err(drv)
    }

    fn relu_mask(
        &self,
        d: &mut CudaSlice<f32>,
        a: &CudaSlice<f32>,
        n: usize,
    ) -> Result<(), BackendError> {
        assert!(d.len() >= n && a.len() >= n);
        let nn = n as i64;
        let mut l = self.stream.launch_builder(&self.k.relu_mask);
        l.arg(d).arg(a).arg(&nn);
        // SAFETY: matches relu_mask(float*, const float*, long long); sizes asserted above.
        unsafe { l.launch(grid(n)) }.map(drop).map_err(drv)
    }

    #[allow(clippy::too_many_arguments)]
    fn softmax_xent(
        &self,
        logits: &CudaSlice<f32>,
        y: &CudaSlice<u32>,
        rows: usize,
        classes: usize,
        dlogits: Option<&mut CudaSlice<f32>>,
        row_loss: &mut CudaSlice<f32>,
    ) -> Result<(), BackendError> {
        assert!(logits.len() >= rows * classes && y.len() >= rows && row_loss.len() >= rows);
        let (r, c) = (int(rows, "rows")?, int(classes, "classes")?);
        let cfg = LaunchConfig {
            grid_dim: (rows.div_ceil(THREADS as usize).max(1) as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut l = self.stream.launch_builder(&self.k.softmax_xent);
        let want = i32::from(dlogits.is_some());
        // Without a gradient the kernel never touches dlogits; the row-loss buffer stands in for the pointer.
        let null: u64 = 0;
        l.arg(logits).arg(y).arg(&r).arg(&c).arg(&want);
        match dlogits {
            Some(d) => {
                assert!(d.len() >= rows * classes);
                l.arg(d);
            }
            None => {
                l.arg(&null);
            }
        }
        l.arg(row_loss);
        // SAFETY: matches softmax_xent(const float*, const unsigned*, int, int, int, float*, float*); a null dlogits
        // is only passed with want_grad = 0, where the kernel does not read it; labels were checked < classes.
        unsafe { l.launch(cfg) }.map(drop).map_err(drv)
    }

    fn col_sums(
        &self,
        d: &CudaView<'_, f32>,
        rows: usize,
        cols: usize,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), BackendError> {
        assert!(d.len() >= rows * cols && out.len() >= cols);
        let (r, c) = (int(rows, "rows")?, int(cols, "cols")?);
        let cfg = LaunchConfig {
            grid_dim: (cols.div_ceil(THREADS as usize).max(1) as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut l = self.stream.launch_builder(&self.k.col_sums);
        l.arg(d).arg(&r).arg(&c).arg(out);
        // SAFETY: matches col_sums(const float*, int, int, float*); sizes asserted above.
        unsafe { l.launch(cfg) }.map(drop).map_err(drv)
    }

    fn argmax_rows(
        &self,
        z: &CudaSlice<f32>,
        rows: usize,
        cols: usize,
        out: &mut CudaSlice<u32>,
    ) -> Result<(), BackendError> {
        assert!(z.len() >= rows * cols && out.len() >= rows);
        let (r, c) = (int(rows, "rows")?, int(cols, "cols")?);
        let cfg = LaunchConfig {
            grid_dim: (rows.div_ceil(THREADS as usize).max(1) as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut l = self.stream.launch_builder(&self.k.argmax_rows);
        l.arg(z).arg(&r).arg(&c).arg(out);
        // SAFETY: matches argmax_rows(const float*, int, int, unsigned*); sizes asserted above.
        unsafe { l.launch(cfg) }.map(drop).map_err(drv)
    }
}

/// Device scratch of the global-norm reduction.
#[derive(Debug)]
pub struct GradNorm {
    partials: CudaSlice<f64>,
    norm: CudaSlice<f32>,
}

impl GradNorm {
    /// Scratch on `rt`'s device.
    pub fn new(rt: &CudaRuntime) -> Result<Self, BackendError> {
        Ok(Self {
            partials: rt.zeros(NORM_BLOCKS as usize)?,
            norm: rt.zeros(1)?,
        })
    }

    /// The L2 norm of `x`; when `clip > 0` and the norm is finite and above it, scales `x` by `clip / norm`.
    pub fn clip(
        &mut self,
        rt: &CudaRuntime,
        x: &mut CudaSlice<f32>,
        clip: f32,
    ) -> Result<f32, BackendError> {
        let n = x.len() as i64;
        let cfg = LaunchConfig {
            grid_dim: (NORM_BLOCKS, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut l = rt.stream.launch_builder(&rt.k.sumsq_partial);
        l.arg(&*x).arg(&n).arg(&mut self.partials);
        // SAFETY: matches sumsq_partial(const float*, long long, double*); partials has NORM_BLOCKS slots and the
        // kernel's shared array is sized for THREADS threads.
        unsafe { l.launch(cfg) }.map_err(drv)?;
        let parts = NORM_BLOCKS as i32;
        let mut l = rt.stream.launch_builder(&rt.k.norm_clip);
        l.arg(&mut *x)
            .arg(&n)
            .arg(&self.partials)
            .arg(&parts)
            .arg(&clip)
            .arg(&mut self.norm);
        // SAFETY: matches norm_clip(float*, long long, const double*, int, float, float*).
        unsafe { l.launch(grid(n as usize)) }.map_err(drv)?;
        let v = rt.download(&self.norm.slice(..))?;
        Ok(v[0])
    }
}

/// The GPU twin of [`Mlp`]: same layout and math, products on cuBLAS, parameters and gradient on the device.
pub struct CudaMlp {
    rt: Arc<CudaRuntime>,
    layout: Layout,
    dims: Vec<usize>,
    weight: Vec<Range<usize>>,
    bias: Vec<Range<usize>>,
    params: CudaSlice<f32>,
    grad: CudaSlice<f32>,
    x: CudaSlice<f32>,
    y: CudaSlice<u32>,
    acts: Vec<CudaSlice<f32>>,
    deltas: Vec<CudaSlice<f32>>,
    row_loss: CudaSlice<f32>,
    pred: CudaSlice<u32>,
    host_loss: Vec<f32>,
    norm: GradNorm,
    rows_cap: usize,
}

impl std::fmt::Debug for CudaMlp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaMlp")
            .field("dims", &self.dims)
            .field("device", &self.rt.info.ordinal)
            .finish_non_exhaustive()
    }
}

fn fatal<T>(r: Result<T, BackendError>) -> T {
    // Model methods cannot return errors; a failed CUDA call means the device is unusable (see the module doc).
    r.unwrap_or_else(|e| panic!("CUDA backend failed: {e}"))
}

impl CudaMlp {
    /// An MLP `features → hidden… → classes` on `rt`'s device, with the same layout as [`Mlp::new`].
    pub fn new(
        rt: Arc<CudaRuntime>,
        features: usize,
        hidden: &[usize],
        classes: usize,
    ) -> Result<Self, BackendError> {
        let cpu = Mlp::new(features, hidden, classes);
        let layout = cpu.layout().clone();
        let dims = cpu.dims().to_vec();
        for d in &dims {
            int(*d, "layer width")?;
        }
        let layers = dims.len() - 1;
        let weight = (0..layers).map(|k| layout.tensor_range(2 * k)).collect();
        let bias = (0..layers)
            .map(|k| layout.tensor_range(2 * k + 1))
            .collect();
        let p = layout.len();
        Ok(Self {
            params: rt.zeros(p)?,
            grad: rt.zeros(p)?,
            x: rt.zeros(0)?,
            y: rt.zeros(0)?,
            acts: (0..layers).map(|_| rt.zeros(0)).collect::<Result<_, _>>()?,
            deltas: (0..layers).map(|_| rt.zeros(0)).collect::<Result<_, _>>()?,
            row_loss: rt.zeros(0)?,
            pred: rt.zeros(0)?,
            host_loss: Vec::new(),
            norm: GradNorm::new(&rt)?,
            rows_cap: 0,
            rt,
            layout,
            dims,
            weight,
            bias,
        })
    }

    /// The runtime this model runs on.
    pub fn runtime(&self) -> &Arc<CudaRuntime> {
        &self.rt
    }

    /// The gradient of the last [`CudaMlp::loss_and_grad_device`] (clipped if [`CudaMlp::clip_grad`] ran), on device.
    pub fn grad_device(&self) -> &CudaSlice<f32> {
        &self.grad
    }

    /// Grows the batch buffers to hold `rows` rows; never shrinks.
    fn reserve(&mut self, rows: usize) -> Result<(), BackendError> {
        if rows <= self.rows_cap {
            return Ok(());
        }
        int(
            rows * self.dims.iter().max().copied().unwrap_or(1),
            "rows × width",
        )?;
        let rt = &self.rt;
        self.x = rt.zeros(rows * self.dims[0])?;
        self.y = rt.zeros(rows)?;
        for k in 0..self.dims.len() - 1 {
            self.acts[k] = rt.zeros(rows * self.dims[k + 1])?;
            self.deltas[k] = rt.zeros(rows * self.dims[k + 1])?;
        }
        self.row_loss = rt.zeros(rows)?;
        self.pred = rt.zeros(rows)?;
        self.rows_cap = rows;
        Ok(())
    }

    fn check_batch(&self, params: &[f32], x: &[f32]) -> usize {
        assert_eq!(
            params.len(),
            self.layout.len(),
            "CudaMlp: params must hold layout().len() values"
        );
        let f = self.dims[0];
        assert_eq!(
            x.len() % f,
            0,
            "CudaMlp: x must hold whole rows of {f} features"
        );
        x.len() / f
    }

    /// Uploads parameters, inputs and (optionally) labels for a batch of `rows` rows.
    fn upload(
        &mut self,
        params: &[f32],
        x: &[f32],
        y: Option<&[u32]>,
        rows: usize,
    ) -> Result<(), BackendError> {
        self.reserve(rows)?;
        let s = &self.rt.stream;
        s.memcpy_htod(params, &mut self.params).map_err(drv)?;
        s.memcpy_htod(x, &mut self.x.slice_mut(..x.len()))
            .map_err(drv)?;
        if let Some(y) = y {
            let classes = self.classes() as u32;
            assert!(
                y.iter().all(|l| *l < classes),
                "CudaMlp: label out of range for {classes} classes"
            );
            s.memcpy_htod(y, &mut self.y.slice_mut(..y.len()))
                .map_err(drv)?;
        }
        Ok(())
    }

    fn forward(&mut self, rows: usize) -> Result<(), BackendError> {
        let layers = self.dims.len() - 1;
        for k in 0..layers {
            let (din, dout) = (self.dims[k], self.dims[k + 1]);
            let (before, from_k) = self.acts.split_at_mut(k);
            let out = &mut from_k[0];
            {
                let w = self.params.slice(self.weight[k].clone());
                let xin = if k == 0 {
                    self.x.slice(..rows * din)
                } else {
                    before[k - 1].slice(..rows * din)
                };
                let mut z = out.slice_mut(..rows * dout);
                self.rt
                    .gemm(rows, dout, din, &xin, false, &w, false, &mut z)?;
            }
            let b = self.params.slice(self.bias[k].clone());
            self.rt.bias_act(out, &b, rows, dout, k + 1 < layers)?;
        }
        Ok(())
    }

    fn backward(&mut self, rows: usize) -> Result<(), BackendError> {
        let layers = self.dims.len() - 1;
        for k in (0..layers).rev() {
            let (din, dout) = (self.dims[k], self.dims[k + 1]);
            let (below, from_k) = self.deltas.split_at_mut(k);
            let delta = from_k[0].slice(..rows * dout);
            {
                let input = if k == 0 {
                    self.x.slice(..rows * din)
                } else {
                    self.acts[k - 1].slice(..rows * din)
                };
                let mut gw = self.grad.slice_mut(self.weight[k].clone());
                self.rt
                    .gemm(din, dout, rows, &input, true, &delta, false, &mut gw)?;
            }
            {
                let mut gb = self.grad.slice_mut(self.bias[k].clone());
                self.rt.col_sums(&delta, rows, dout, &mut gb)?;
            }
            if k > 0 {
                let prev = &mut below[k - 1];
                {
                    let w = self.params.slice(self.weight[k].clone());
                    let mut dp = prev.slice_mut(..rows * din);
                    self.rt
                        .gemm(rows, din, dout, &delta, false, &w, true, &mut dp)?;
                }
                self.rt.relu_mask(prev, &self.acts[k - 1], rows * din)?;
            }
        }
        Ok(())
    }

    /// Mean loss of the batch whose row losses are on the device (waits for the stream).
    fn mean_loss(&mut self, rows: usize) -> Result<f32, BackendError> {
        self.host_loss.resize(rows, 0.0);
        self.rt
            .stream
            .memcpy_dtoh(&self.row_loss.slice(..rows), &mut self.host_loss[..])
            .map_err(drv)?;
        self.rt.synchronize()?;
        let total: f64 = self.host_loss.iter().map(|v| f64::from(*v)).sum();
        Ok((total / rows as f64) as f32)
    }

    /// Loss and gradient with the gradient left on the device ([`CudaMlp::grad_device`]).
    pub fn loss_and_grad_device(
        &mut self,
        params: &[f32],
        x: &[f32],
        y: &[u32],
    ) -> Result<f32, BackendError> {
        let rows = self.check_batch(params, x);
        assert_eq!(y.len(), rows, "CudaMlp::loss_and_grad: one label per row");
        if rows == 0 {
            self.rt.stream.memset_zeros(&mut self.grad).map_err(drv)?;
            return Ok(0.0);
        }
        self.upload(params, x, Some(y), rows)?;
        self.forward(rows)?;
        let last = self.dims.len() - 2;
        let classes = self.classes();
        self.rt.softmax_xent(
            &self.acts[last],
            &self.y,
            rows,
            classes,
            Some(&mut self.deltas[last]),
            &mut self.row_loss,
        )?;
        self.backward(rows)?;
        self.mean_loss(rows)
    }

    /// Global L2 norm of the device gradient, clipping it in place to `clip` when `clip > 0` and the norm exceeds it.
    pub fn clip_grad(&mut self, clip: f32) -> Result<f32, BackendError> {
        self.norm.clip(&self.rt, &mut self.grad, clip)
    }

    /// Copies the device gradient into `grad` (waits for the stream).
    pub fn download_grad(&self, grad: &mut [f32]) -> Result<(), BackendError> {
        self.rt.stream.memcpy_dtoh(&self.grad, grad).map_err(drv)?;
        self.rt.synchronize()
    }
}

impl Model for CudaMlp {
    fn layout(&self) -> &Layout {
        &self.layout
    }

    fn classes(&self) -> usize {
        self.dims[self.dims.len() - 1]
    }

    fn features(&self) -> usize {
        self.dims[0]
    }

    fn loss_and_grad(&mut self, params: &[f32], x: &[f32], y: &[u32], grad: &mut [f32]) -> f32 {
        assert_eq!(
            grad.len(),
            self.layout.len(),
            "CudaMlp::loss_and_grad: grad must hold layout().len() values"
        );
        let loss = fatal(self.loss_and_grad_device(params, x, y));
        fatal(self.download_grad(grad));
        loss
    }

    fn predict(&mut self, params: &[f32], x: &[f32], out: &mut [u32]) {
        let rows = self.check_batch(params, x);
        assert_eq!(out.len(), rows, "CudaMlp::predict: one class per row");
        if rows == 0 {
            return;
        }
        fatal(self.upload(params, x, None, rows));
        fatal(self.forward(rows));
        let last = self.dims.len() - 2;
        let classes = self.classes();
        fatal(
            self.rt
                .argmax_rows(&self.acts[last], rows, classes, &mut self.pred),
        );
        fatal(
            self.rt
                .stream
                .memcpy_dtoh(&self.pred.slice(..rows), out)
                .map_err(drv),
        );
        fatal(self.rt.synchronize());
    }

    fn loss(&mut self, params: &[f32], x: &[f32], y: &[u32]) -> f32 {
        let rows = self.check_batch(params, x);
        assert_eq!(y.len(), rows, "CudaMlp::loss: one label per row");
        if rows == 0 {
            return 0.0;
        }
        fatal(self.upload(params, x, Some(y), rows));
        fatal(self.forward(rows));
        let last = self.dims.len() - 2;
        let classes = self.classes();
        fatal(self.rt.softmax_xent(
            &self.acts[last],
            &self.y,
            rows,
            classes,
            None,
            &mut self.row_loss,
        ));
        fatal(self.mean_loss(rows))
    }
}

/// Encodes device gradients into codec frames (q8/q4/q2, no zstd) with the error-feedback residual on the device.
///
/// The frame equals what `tether_common::codec::ErrorFeedback::encode` (or `Encoder::encode` without feedback)
/// produces for the same input, configuration and seed. On an error the residual is unchanged and `out` is empty.
pub struct CudaEncoder {
    rt: Arc<CudaRuntime>,
    cfg: CodecConfig,
    len: usize,
    buckets: usize,
    raw_len: usize,
    body: CudaSlice<u8>,
    /// Upload buffer of [`CudaEncoder::encode`]; `None` only while it is being encoded from.
    input: Option<CudaSlice<f32>>,
    /// Double-buffered residual: `residual[cur]` is current; a kernel writes the other one, swapped on success.
    residual: Option<[CudaSlice<f32>; 2]>,
    cur: usize,
    first_bad: CudaSlice<u64>,
}

impl std::fmt::Debug for CudaEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaEncoder")
            .field("cfg", &self.cfg)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl CudaEncoder {
    /// An encoder for ranges of `len` elements; `error_feedback` keeps a residual (zero at start) on the device.
    pub fn new(
        rt: Arc<CudaRuntime>,
        cfg: CodecConfig,
        len: usize,
        error_feedback: bool,
    ) -> Result<Self, BackendError> {
        cfg.validate()?;
        if !cfg.scheme.is_quantized() || cfg.zstd {
            return Err(BackendError::Unsupported(format!(
                "codec {} with zstd={} (the GPU encoder does q8/q4/q2 without zstd)",
                cfg.scheme, cfg.zstd
            )));
        }
        let buckets = len.div_ceil(cfg.bucket);
        let bits = cfg.scheme.bits() as usize;
        let raw = (4 * buckets) as u64 + ((len * bits).div_ceil(8)) as u64;
        if raw > u64::from(u32::MAX) {
            return Err(CodecError::BodyTooLarge.into());
        }
        let residual = if error_feedback {
            Some([rt.zeros(len)?, rt.zeros(len)?])
        } else {
            None
        };
        Ok(Self {
            body: rt.zeros(raw as usize)?,
            input: Some(rt.zeros(len)?),
            first_bad: rt.zeros(1)?,
            rt,
            cfg,
            len,
            buckets,
            raw_len: raw as usize,
            residual,
            cur: 0,
        })
    }

    /// Encodes a host gradient (uploaded first) into `out`.
    pub fn encode(
        &mut self,
        grad: &[f32],
        seed: u64,
        out: &mut Vec<u8>,
    ) -> Result<(), BackendError> {
        if grad.len() != self.len {
            out.clear();
            return Err(CodecError::LengthMismatch {
                expected: self.len as u64,
                found: grad.len() as u64,
            }
            .into());
        }
        // Taken out (not cloned) so that encode_device may borrow self mutably; always put back below.
        let Some(mut input) = self.input.take() else {
            return Err(BackendError::Unsupported("re-entrant encode".into()));
        };
        let r = match self.rt.stream.memcpy_htod(grad, &mut input).map_err(drv) {
            Ok(()) => self.encode_device(&input.slice(..self.len), seed, out),
            Err(e) => Err(e),
        };
        self.input = Some(input);
        if r.is_err() {
            out.clear();
        }
        r
    }

    /// Encodes a device gradient (e.g. a shard's range of [`CudaMlp::grad_device`]) into `out`.
    pub fn encode_device(
        &mut self,
        grad: &CudaView<'_, f32>,
        seed: u64,
        out: &mut Vec<u8>,
    ) -> Result<(), BackendError> {
        let r = self.launch(grad, seed).and_then(|()| self.finish(out));
        if r.is_err() {
            out.clear();
        }
        r
    }

    /// Queues the encode kernel only (benchmarks: call [`CudaRuntime::synchronize`] before reading the clock). The
    /// residual is not advanced until [`CudaEncoder::finish`].
    pub fn launch(&mut self, grad: &CudaView<'_, f32>, seed: u64) -> Result<(), BackendError> {
        if grad.len() != self.len {
            return Err(CodecError::LengthMismatch {
                expected: self.len as u64,
                found: grad.len() as u64,
            }
            .into());
        }
        let s = &self.rt.stream;
        s.memcpy_htod(&[u64::MAX], &mut self.first_bad)
            .map_err(drv)?;
        let n = self.len as u64;
        let bucket = self.cfg.bucket as u32;
        let nb = self.buckets as u64;
        let bits = self.cfg.scheme.bits() as i32;
        let stochastic = i32::from(self.cfg.rounding == Rounding::Stochastic);
        let per_block = (THREADS / 16) as usize;
        let cfg = LaunchConfig {
            grid_dim: (self.buckets.div_ceil(per_block).max(1) as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // Without feedback the kernel gets null residual pointers (it tests them before any access).
        let null: u64 = 0;
        let mut l = s.launch_builder(&self.rt.k.quant_encode);
        l.arg(grad);
        let (cur, next);
        match self.residual.as_mut() {
            Some(pair) => {
                let (a, b) = pair.split_at_mut(1);
                (cur, next) = if self.cur == 0 {
                    (&a[0], &mut b[0])
                } else {
                    (&b[0], &mut a[0])
                };
                l.arg(cur).arg(next);
            }
            None => {
                l.arg(&null).arg(&null);
            }
        }
        l.arg(&mut self.body)
            .arg(&mut self.first_bad)
            .arg(&n)
            .arg(&bucket)
            .arg(&nb)
            .arg(&bits)
            .arg(&stochastic)
            .arg(&seed);
        // SAFETY: matches quant_encode's signature; grad and both residuals hold len values, body holds raw_len
        // bytes = 4·nb + code bytes, which is exactly what the kernel writes; the grid covers nb buckets.
        unsafe { l.launch(cfg) }.map(drop).map_err(drv)
    }

    /// Downloads the body queued by [`CudaEncoder::launch`], checks finiteness, writes the frame into `out` and advances
    /// the residual.
    pub fn finish(&mut self, out: &mut Vec<u8>) -> Result<(), BackendError> {
        let bad = self.rt.download(&self.first_bad.slice(..))?[0];
        if bad != u64::MAX {
            return Err(CodecError::NonFinite {
                index: bad as usize,
            }
            .into());
        }
        out.resize(HEADER_LEN + self.raw_len, 0);
        self.rt
            .stream
            .memcpy_dtoh(&self.body.slice(..self.raw_len), &mut out[HEADER_LEN..])
            .map_err(drv)?;
        self.rt.synchronize()?;
        write_header(&self.cfg, self.len, self.raw_len, &mut out[..HEADER_LEN]);
        if self.residual.is_some() {
            self.cur ^= 1;
        }
        Ok(())
    }

    /// The current residual (downloaded; zero-length without error feedback).
    pub fn residual(&self) -> Result<Vec<f32>, BackendError> {
        match &self.residual {
            Some(pair) => self.rt.download(&pair[self.cur].slice(..self.len)),
            None => Ok(Vec::new()),
        }
    }

    /// Raw body size of one frame (fp32 input bytes are `4 × len`).
    pub fn raw_len(&self) -> usize {
        self.raw_len
    }
}

/// Writes the codec frame header (see `tether_common::codec::FrameHeader`) for an uncompressed quantized body.
fn write_header(cfg: &CodecConfig, len: usize, raw_len: usize, out: &mut [u8]) {
    let tag = Scheme::ALL
        .iter()
        .position(|s| *s == cfg.scheme)
        .unwrap_or(0) as u8;
    out[0..4].copy_from_slice(&MAGIC);
    out[4] = VERSION;
    out[5] = tag;
    out[6] = if cfg.rounding == Rounding::Deterministic {
        2
    } else {
        0
    };
    out[7] = 0;
    out[8..12].copy_from_slice(&(cfg.bucket as u32).to_le_bytes());
    out[12..16].copy_from_slice(&(raw_len as u32).to_le_bytes());
    out[16..24].copy_from_slice(&(len as u64).to_le_bytes());
}

/// A model factory for the `tether-worker` binary: probes device `ordinal`, loads the kernels and builds the first
/// model eagerly so that every failure surfaces here, as an error, before training starts.
pub fn model_factory(
    ordinal: usize,
    cfg: &ModelConfig,
    features: usize,
    classes: usize,
) -> Result<(CudaInfo, ModelFactory), BackendError> {
    let hidden = match cfg.kind {
        ModelKind::Mlp => cfg.hidden.clone(),
        ModelKind::Logreg => Vec::new(),
        // The GPT is a candle model; candle's CUDA backend needs nvcc at build time (docs/transformer.md).
        ModelKind::File => {
            return Err(BackendError::Unsupported(
                "a model file's model is computed by its owner (the Python package), not tether-worker".into(),
            ))
        }
        ModelKind::Gpt => {
            return Err(BackendError::Unsupported(
                "the GPT runs on the CPU backend (--device cpu); the CUDA backend trains the MLP and logreg".into(),
            ))
        }
    };
    let rt = CudaRuntime::new(ordinal)?;
    let first = CudaMlp::new(rt.clone(), features, &hidden, classes)?;
    let info = rt.info().clone();
    let slot = Mutex::new(Some(first));
    let factory: ModelFactory = Arc::new(move || {
        if let Some(m) = slot.lock().ok().and_then(|mut s| s.take()) {
            return Box::new(m) as Box<dyn Model>;
        }
        // A further model of a shape already built on a runtime that loaded every kernel fails only when the device
        // is out of memory or lost; a factory cannot return an error, so that ends the worker with the cause.
        Box::new(fatal(CudaMlp::new(rt.clone(), features, &hidden, classes)))
    });
    Ok((info, factory))
}

//! The native half of the Python package `tether` (`tether._tether`): [`Worker`] wraps the Rust
//! [`RemoteWorker`] — QUIC driver and protocol state machine on a Rust runtime thread, clipping, error feedback
//! and encoding in Rust — with the GIL released whenever Rust waits or works; model files; the configured data
//! set and its partition as NumPy arrays; and the typed exceptions every failure becomes. Nothing here installs
//! process-wide state: logging is opt-in through [`enable_logging`].

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use numpy::{
    PyArray1, PyArrayMethods, PyReadonlyArray1, PyReadonlyArrayDyn, PyUntypedArrayMethods,
};
use pyo3::create_exception;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use tether_common::config::{Config, ConfigError, Staleness};
use tether_common::layout::{self as tlayout, model_layout};
use tether_common::net::NetError;
use tether_common::protocol::ErrorCode;
use tether_worker::data::{load_configured, Partition as RustPartition};
use tether_worker::{RemoteOptions, RemoteReport, RemoteWorker, UpdateKind, WorkerError};

create_exception!(
    _tether,
    TetherError,
    PyRuntimeError,
    "Every error Tether raises."
);
create_exception!(
    _tether,
    ConfigError_,
    TetherError,
    "cluster.toml or the model file is invalid."
);
create_exception!(
    _tether,
    RefusedError,
    TetherError,
    "A shard refused this worker (attributes: code, shard)."
);
create_exception!(
    _tether,
    UnauthorizedError,
    RefusedError,
    "Wrong rank, certificate or unknown rank."
);
create_exception!(
    _tether,
    LayoutMismatchError,
    RefusedError,
    "The model's layout differs from the shards'."
);
create_exception!(
    _tether,
    ClockFromFutureError,
    RefusedError,
    "A clock beyond what the bound allows."
);
create_exception!(
    _tether,
    ConfigMismatchError,
    RefusedError,
    "The shards run under another setting."
);
create_exception!(
    _tether,
    SupersededError,
    RefusedError,
    "A newer session of this rank replaced this one."
);
create_exception!(
    _tether,
    ShardUnreachableError,
    TetherError,
    "A shard stayed unreachable past the deadline."
);
create_exception!(
    _tether,
    ProtocolStateError,
    TetherError,
    "A call out of order (e.g. after close)."
);

/// The Python exception for a worker error: refusals by their wire code (with `code` and `shard` attributes),
/// unreachable shards, configuration, protocol misuse; the rest as `TetherError`. The message is the whole chain.
fn to_py(py: Python<'_>, e: WorkerError) -> PyErr {
    let message = chain(&e);
    if let Some((shard, code, reason)) = e.refusal() {
        let msg = format!("shard {shard} refused ({code:?}): {reason}");
        let err = match code {
            ErrorCode::Unauthorized => UnauthorizedError::new_err(msg),
            ErrorCode::BadLayoutHash => LayoutMismatchError::new_err(msg),
            ErrorCode::ClockFromFuture => ClockFromFutureError::new_err(msg),
            ErrorCode::ConfigMismatch => ConfigMismatchError::new_err(msg),
            ErrorCode::Superseded => SupersededError::new_err(msg),
            _ => RefusedError::new_err(msg),
        };
        let value = err.value(py);
        // Setting attributes on a fresh exception instance cannot fail short of memory exhaustion.
        let _ = value.setattr("code", format!("{code:?}"));
        let _ = value.setattr("shard", shard);
        return err;
    }
    match &e {
        WorkerError::Net {
            source: NetError::Unreachable { .. },
            ..
        } => ShardUnreachableError::new_err(message),
        WorkerError::Refused { .. } => UnauthorizedError::new_err(message),
        WorkerError::Config(_) => ConfigError_::new_err(message),
        WorkerError::ProtocolState(_) | WorkerError::Closed | WorkerError::UpdateLength { .. } => {
            ProtocolStateError::new_err(message)
        }
        _ => TetherError::new_err(message),
    }
}

/// A variable the launcher sets, for an argument left out; a `ConfigError` naming both when it is not set.
fn from_env(var: &str, arg: &str) -> PyResult<String> {
    std::env::var(var).map_err(|_| {
        ConfigError_::new_err(format!(
            "no {arg} given and ${var} is not set: pass {arg}= or start the script with `python -m tether.launch`"
        ))
    })
}

fn config_err(e: ConfigError) -> PyErr {
    ConfigError_::new_err(e.to_string())
}

/// An error and its sources, joined by ": ".
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        let s_text = s.to_string();
        if !out.contains(&s_text) {
            out.push_str(": ");
            out.push_str(&s_text);
        }
        cur = s.source();
    }
    out
}

fn report_dict<'py>(py: Python<'py>, r: &RemoteReport) -> PyResult<Bound<'py, PyAny>> {
    // RemoteReport holds numbers only: serialising it cannot fail.
    let json = serde_json::to_string(r).unwrap_or_else(|_| "{}".into());
    py.import("json")?.call_method1("loads", (json,))
}

/// A Tether worker for a model computed in Python: joins the shards with its own TLS bundle, pulls parameters into
/// a NumPy array over Rust memory and pushes updates that Rust clips, encodes and sends.
#[pyclass(module = "tether._tether")]
struct Worker {
    inner: RemoteWorker,
    config: Config,
    params: Py<PyArray1<f32>>,
    rolled_back: AtomicBool,
}

#[pymethods]
impl Worker {
    /// `config` and `rank` default to `$TETHER_CONFIG` and `$TETHER_RANK`, and `tls_dir` to `$TETHER_TLS_DIR` (then
    /// `cluster.tls_dir`): what `python -m tether.launch` sets for every rank it starts.
    #[new]
    #[pyo3(signature = (config=None, rank=None, *, tls_dir=None, servers=None, reconnect_deadline_s=60.0))]
    fn new(
        py: Python<'_>,
        config: Option<PathBuf>,
        rank: Option<u32>,
        tls_dir: Option<PathBuf>,
        servers: Option<Vec<String>>,
        reconnect_deadline_s: f64,
    ) -> PyResult<Self> {
        let config = match config {
            Some(c) => c,
            None => PathBuf::from(from_env("TETHER_CONFIG", "config")?),
        };
        let rank = match rank {
            Some(r) => r,
            None => {
                let text = from_env("TETHER_RANK", "rank")?;
                text.trim().parse::<u32>().map_err(|_| {
                    ConfigError_::new_err(format!(
                        "TETHER_RANK is {text:?}, not a rank (a whole number from 0)"
                    ))
                })?
            }
        };
        let tls_dir = tls_dir.or_else(|| std::env::var_os("TETHER_TLS_DIR").map(PathBuf::from));
        let mut cfg = Config::load(&config).map_err(config_err)?;
        if let Some(s) = servers {
            cfg.cluster.servers = s;
        }
        if rank >= cfg.cluster.workers {
            return Err(UnauthorizedError::new_err(format!(
                "rank {rank} but cluster.workers is {}: the shards refuse ranks beyond the configured count",
                cfg.cluster.workers
            )));
        }
        if !(reconnect_deadline_s.is_finite() && reconnect_deadline_s > 0.0) {
            return Err(ConfigError_::new_err(
                "reconnect_deadline_s must be a positive number of seconds",
            ));
        }
        let layout = py.detach(|| model_layout(&cfg)).map_err(config_err)?;
        let tls_dir = tls_dir.unwrap_or_else(|| cfg.cluster.tls_dir.clone());
        let n = layout.len();
        let opts = RemoteOptions::new(
            cfg.clone(),
            layout,
            rank,
            &tls_dir,
            Duration::from_secs_f64(reconnect_deadline_s),
        )
        .map_err(|e| to_py(py, e))?;
        let inner = RemoteWorker::start(opts).map_err(|e| to_py(py, e))?;
        let params = PyArray1::from_vec(py, vec![0.0f32; n]).unbind();
        Ok(Self {
            inner,
            config: cfg,
            params,
            rolled_back: AtomicBool::new(false),
        })
    }

    /// Rank.
    #[getter]
    fn rank(&self) -> u32 {
        self.inner.rank()
    }

    /// Number of shards.
    #[getter]
    fn shards(&self) -> usize {
        self.config.cluster.servers.len()
    }

    /// Number of parameters (the layout's length).
    #[getter]
    fn num_params(&self) -> usize {
        self.inner.layout().len()
    }

    /// Rounds pushed or skipped so far.
    #[getter]
    fn clock(&self, py: Python<'_>) -> u64 {
        // The session may be busy in another thread's pull: wait for it without holding the GIL.
        let inner = &self.inner;
        py.detach(|| inner.report().clock)
    }

    /// `train.local_steps` (H of local-step rounds; 0 = per-step updates).
    #[getter]
    fn local_steps(&self) -> u32 {
        self.config.train.local_steps
    }

    /// The SSP bound `cluster.staleness` (None = unbounded).
    #[getter]
    fn staleness(&self) -> Option<u32> {
        match self.config.cluster.staleness {
            Staleness::Bounded(s) => Some(s),
            Staleness::Unbounded => None,
        }
    }

    /// `train.batch`.
    #[getter]
    fn batch(&self) -> usize {
        self.config.train.batch
    }

    /// The whole configuration as a dict (the sections of cluster.toml).
    #[getter]
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let json =
            serde_json::to_string(&self.config).map_err(|e| TetherError::new_err(e.to_string()))?;
        py.import("json")?.call_method1("loads", (json,))
    }

    /// The layout: (name, shape, flat offset) per tensor, in layout order.
    #[getter]
    fn layout(&self) -> Vec<(String, Vec<usize>, usize)> {
        let l = self.inner.layout();
        l.tensors()
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), t.shape.clone(), l.tensor_range(i).start))
            .collect()
    }

    /// The parameters as a float32 NumPy array over Rust memory, written in place by `pull()`.
    #[getter]
    fn params<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<f32>> {
        self.params.bind(py).clone()
    }

    /// Whether the last pull reported a shard rollback.
    #[getter]
    fn rolled_back(&self) -> bool {
        self.rolled_back.load(Ordering::Relaxed)
    }

    /// Pulls the parameters for the current clock (SSP-gated) into `out` (or `params`) and returns that array.
    #[pyo3(signature = (out=None))]
    fn pull<'py>(
        &self,
        py: Python<'py>,
        out: Option<Bound<'py, PyArray1<f32>>>,
    ) -> PyResult<Bound<'py, PyArray1<f32>>> {
        let arr = out.unwrap_or_else(|| self.params.bind(py).clone());
        let pulled = {
            let mut rw = arr.try_readwrite().map_err(|e| {
                ProtocolStateError::new_err(format!("pull: the output array is not writable: {e}"))
            })?;
            let slice = rw.as_slice_mut().map_err(|e| {
                ProtocolStateError::new_err(format!(
                    "pull: the output array is not contiguous: {e}"
                ))
            })?;
            let inner = &self.inner;
            py.detach(|| inner.pull(slice))
        }
        .map_err(|e| to_py(py, e))?;
        self.rolled_back
            .store(pulled.rolled_back, Ordering::Relaxed);
        Ok(arr)
    }

    /// Pushes one round's update: kind "gradient" (clipped) or "delta" (a local-step round's θ_start − θ_end);
    /// `steps`: training steps the update covers (H of a round), for the per-step fp32 reference of the report.
    /// Returns False when the update was not finite (a skip marker was sent instead).
    #[pyo3(signature = (update, loss=None, kind="gradient", steps=1))]
    fn push(
        &self,
        py: Python<'_>,
        update: PyReadonlyArray1<'_, f32>,
        loss: Option<f32>,
        kind: &str,
        steps: u64,
    ) -> PyResult<bool> {
        let kind = match kind {
            "gradient" => UpdateKind::Gradient,
            "delta" => UpdateKind::Delta,
            other => {
                return Err(ProtocolStateError::new_err(format!(
                    "push: kind must be \"gradient\" or \"delta\", not {other:?}"
                )))
            }
        };
        let values = update.as_slice().map_err(|e| {
            ProtocolStateError::new_err(format!("push: the update is not contiguous: {e}"))
        })?;
        let inner = &self.inner;
        py.detach(|| inner.push(values, loss, kind, steps))
            .map_err(|e| to_py(py, e))
    }

    /// Ends this round without an update (a skip marker).
    #[pyo3(signature = (loss=None))]
    fn skip(&self, py: Python<'_>, loss: Option<f32>) -> PyResult<()> {
        let inner = &self.inner;
        py.detach(|| inner.skip(loss)).map_err(|e| to_py(py, e))
    }

    /// Waits until every push has its outcome (at most `timeout_s`); returns whether they all have.
    #[pyo3(signature = (timeout_s=60.0))]
    fn settle(&self, py: Python<'_>, timeout_s: f64) -> PyResult<bool> {
        let limit = Duration::from_secs_f64(timeout_s.clamp(0.0, 1e6));
        let inner = &self.inner;
        py.detach(|| inner.settle(limit)).map_err(|e| to_py(py, e))
    }

    /// The session's counters.
    fn report<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let inner = &self.inner;
        let r = py.detach(|| inner.report());
        report_dict(py, &r)
    }

    /// Settles, says goodbye to every shard, stops the runtime; returns the final report. Idempotent.
    #[pyo3(signature = (timeout_s=60.0))]
    fn close<'py>(&mut self, py: Python<'py>, timeout_s: f64) -> PyResult<Bound<'py, PyAny>> {
        let limit = Duration::from_secs_f64(timeout_s.clamp(0.0, 1e6));
        let inner = &mut self.inner;
        let r = py.detach(|| inner.close(limit)).map_err(|e| to_py(py, e))?;
        // Under `python -m tether.launch`: the report tells the launcher that this rank finished and said goodbye.
        if let Some(path) = std::env::var_os("TETHER_REPORT") {
            let json =
                serde_json::to_vec_pretty(&r).map_err(|e| TetherError::new_err(e.to_string()))?;
            std::fs::write(&path, json).map_err(|e| {
                TetherError::new_err(format!(
                    "writing the report to {}: {e}",
                    PathBuf::from(&path).display()
                ))
            })?;
        }
        report_dict(py, &r)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(
        &mut self,
        py: Python<'_>,
        _args: &Bound<'_, pyo3::types::PyTuple>,
    ) -> PyResult<bool> {
        self.close(py, 60.0)?;
        Ok(false)
    }
}

/// Writes a model file (safetensors of float32 tensors, order kept): the layout and initial weights the shards
/// read with `[model] kind = "file"`.
#[pyfunction]
fn write_model_file(
    py: Python<'_>,
    path: PathBuf,
    tensors: Vec<(String, PyReadonlyArrayDyn<'_, f32>)>,
) -> PyResult<()> {
    let mut owned = Vec::with_capacity(tensors.len());
    for (name, arr) in &tensors {
        let values = arr
            .as_slice()
            .map_err(|e| ConfigError_::new_err(format!("tensor {name} is not contiguous: {e}")))?;
        owned.push((name.as_str(), arr.shape().to_vec(), values));
    }
    let views: Vec<(&str, &[usize], &[f32])> = owned
        .iter()
        .map(|(n, s, v)| (*n, s.as_slice(), *v))
        .collect();
    py.detach(|| tlayout::write_model_file(&path, &views))
        .map_err(config_err)
}

/// Names and shapes of a model file's tensors, in layout order.
#[pyfunction]
fn read_model_file(py: Python<'_>, path: PathBuf) -> PyResult<Vec<(String, Vec<usize>)>> {
    let layout = py
        .detach(|| tlayout::read_model_file(&path))
        .map_err(config_err)?;
    Ok(layout
        .tensors()
        .iter()
        .map(|t| (t.name.clone(), t.shape.clone()))
        .collect())
}

/// A cluster.toml parsed and validated as the shards and workers read it, as a dict of its sections (every default
/// filled in); `ConfigError` names the key at fault.
#[pyfunction]
fn read_config<'py>(py: Python<'py>, path: PathBuf) -> PyResult<Bound<'py, PyAny>> {
    let cfg = Config::load(&path).map_err(config_err)?;
    let json = serde_json::to_string(&cfg).map_err(|e| TetherError::new_err(e.to_string()))?;
    py.import("json")?.call_method1("loads", (json,))
}

/// The configured data set as the Rust worker loads it: x_train, y_train, x_test, y_test (NumPy), features,
/// classes and note (why a fallback was used, or None).
#[pyfunction]
fn load_data<'py>(py: Python<'py>, config: PathBuf) -> PyResult<Bound<'py, PyDict>> {
    let mut cfg = Config::load(&config).map_err(config_err)?;
    let (train, test, note) = py
        .detach(|| load_configured(&mut cfg))
        .map_err(|e| TetherError::new_err(format!("data: {}", chain(&e))))?;
    let d = PyDict::new(py);
    for (key, ds) in [("train", train), ("test", test)] {
        let (n, f) = (ds.len(), ds.features);
        let x = PyArray1::from_vec(py, ds.x).reshape([n, f])?;
        let y = PyArray1::from_vec(py, ds.y.iter().map(|&v| i64::from(v)).collect::<Vec<_>>());
        d.set_item(format!("x_{key}"), x)?;
        d.set_item(format!("y_{key}"), y)?;
        d.set_item("features", f)?;
        d.set_item("classes", ds.classes)?;
    }
    d.set_item("note", note)?;
    Ok(d)
}

/// One worker's share of a data set, the same disjoint share and per-epoch shuffle the Rust worker uses.
#[pyclass(module = "tether._tether")]
struct Partition {
    inner: RustPartition,
}

#[pymethods]
impl Partition {
    #[new]
    fn new(n: usize, rank: u32, workers: u32, seed: u64) -> PyResult<Self> {
        RustPartition::new(n, rank, workers, seed)
            .map(|inner| Self { inner })
            .map_err(|e| ConfigError_::new_err(e.to_string()))
    }

    /// The sample indices of this share.
    fn indices<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        PyArray1::from_vec(py, self.inner.indices().iter().map(|&i| i as i64).collect())
    }

    /// The share's indices in epoch `epoch`'s order.
    fn epoch_order<'py>(&self, py: Python<'py>, epoch: u64) -> Bound<'py, PyArray1<i64>> {
        PyArray1::from_vec(
            py,
            self.inner
                .epoch_order(epoch)
                .iter()
                .map(|&i| i as i64)
                .collect(),
        )
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }
}

/// Sends Tether's logs (tracing) to stderr at `level` (e.g. "info", "tether=debug"). Opt-in: the package never
/// installs a subscriber by itself. Returns False if a subscriber was already installed.
#[pyfunction]
#[pyo3(signature = (level="info"))]
fn enable_logging(level: &str) -> bool {
    let filter = tracing_subscriber::EnvFilter::try_new(level)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init()
        .is_ok()
}

#[pymodule]
fn _tether(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<Worker>()?;
    m.add_class::<Partition>()?;
    m.add_function(wrap_pyfunction!(write_model_file, m)?)?;
    m.add_function(wrap_pyfunction!(read_model_file, m)?)?;
    m.add_function(wrap_pyfunction!(load_data, m)?)?;
    m.add_function(wrap_pyfunction!(read_config, m)?)?;
    m.add_function(wrap_pyfunction!(enable_logging, m)?)?;
    m.add("TetherError", py.get_type::<TetherError>())?;
    m.add("ConfigError", py.get_type::<ConfigError_>())?;
    m.add("RefusedError", py.get_type::<RefusedError>())?;
    m.add("UnauthorizedError", py.get_type::<UnauthorizedError>())?;
    m.add("LayoutMismatchError", py.get_type::<LayoutMismatchError>())?;
    m.add(
        "ClockFromFutureError",
        py.get_type::<ClockFromFutureError>(),
    )?;
    m.add("ConfigMismatchError", py.get_type::<ConfigMismatchError>())?;
    m.add("SupersededError", py.get_type::<SupersededError>())?;
    m.add(
        "ShardUnreachableError",
        py.get_type::<ShardUnreachableError>(),
    )?;
    m.add("ProtocolStateError", py.get_type::<ProtocolStateError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}

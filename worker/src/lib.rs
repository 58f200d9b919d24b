//! Tether workers: models, data loading, compute backends and the worker itself.
//!
//! Layers, bottom up (no module imports from one above it): [`model`] and [`data`]; [`backend`] (models on a
//! device) and [`step`] (gradient → frames); the crate's [`WorkerError`]; [`protocol`] (the pure protocol state
//! machine) and the private transport driver around it; and the run layer on top — [`prepare_worker`],
//! [`PreparedWorker`], [`WorkerOptions`], [`WorkerReport`] — re-exported here.

pub mod backend;
pub mod data;
mod driver;
mod error;
pub mod fragments;
pub mod local_steps;
pub mod model;
pub mod protocol;
pub mod remote;
mod run;
pub mod step;
pub mod threads;

pub use driver::WorkerHistoryLine;
pub use error::WorkerError;
pub use model::{Model, ModelFactory};
pub use remote::{Pulled, RemoteOptions, RemoteReport, RemoteWorker, UpdateKind};
pub use run::{prepare_worker, PreparedWorker, Progress, Straggle, WorkerOptions, WorkerReport};

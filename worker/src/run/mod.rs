//! The worker's run layer, on top of everything else in the crate: what a worker is asked to do ([`options`]), the
//! compute actor ([`actor`]), the training loop that drives it and the shards ([`training`]), and what it reports
//! ([`report`]). Nothing below this layer (model, data, backend, step, protocol, driver) imports from it.

mod actor;
mod options;
mod report;
mod training;

pub use options::{Straggle, WorkerOptions};
pub use report::{Progress, WorkerReport};
pub use training::{prepare_worker, PreparedWorker};

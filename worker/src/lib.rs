//! Tether workers: models, data loading, compute backends and the worker actor.

pub mod backend;
pub mod data;
pub mod driver;
pub mod model;
pub mod session;
pub mod step;
pub mod trainer;

//! Tether parameter-server shards: the pure cores (optimizers, the update rule of the training mode, the SSP clock
//! table, checkpoints, `ShardCore`) and the shells around them (the `ShardActor`, per-connection sessions, the shard
//! server and its binary).

pub mod actor;
pub mod checkpoint;
pub mod clock;
pub mod error;
pub mod median;
pub mod node;
pub use tether_common::optim;
pub mod protocol;
pub mod public;
pub mod remote;
pub mod rollback;
pub mod session;
pub mod shard;
pub mod spike;
pub mod update_rule;

pub use error::Error;

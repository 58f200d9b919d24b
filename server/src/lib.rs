//! Tether parameter-server shards: optimizers, the SSP clock table, checkpoints and the shard actors.

pub mod actor;
pub mod checkpoint;
pub mod clock;
pub mod error;
pub mod node;
pub mod optim;
pub mod session;
pub mod shard;

pub use error::Error;

//! Tether parameter-server shards: the pure cores (optimizers, the update rule of the training mode, the SSP clock
//! table, checkpoints, `ShardCore`, the sans-IO [`protocol::ShardProtocol`]) and the shells around them (the
//! `ShardActor`, one connection task per QUIC connection, the shard server and its binary).
//!
//! Public modules are what the binary, the `tether` facade, tests, benches and the fuzz targets use; the connection
//! shell and the loss medians behind the rollback detector are private, and the crate's error is re-exported.

pub mod actor;
mod address;
pub mod admission;
pub mod checkpoint;
pub mod clock;
mod connection;
pub mod decode;
mod error;
pub mod fence_link;
mod median;
pub mod node;
pub mod norm_guard;
pub use tether_common::chunk_pool;
pub use tether_common::optim;
pub mod protocol;
pub mod public;
pub mod quorum;
pub mod remote;
pub mod replication;
pub mod rollback;
mod serde_adapters;
pub mod shard;
mod spike;
pub mod update_rule;
pub mod witness;

pub use error::Error;

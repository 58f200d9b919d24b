//! Tether: an actor-based parameter server for distributed training. This facade re-exports the common, server and
//! worker crates, the [`Model`] trait users implement to plug in their own gradient computation, and
//! [`LocalCluster`], which runs a whole cluster (M shards, N workers, loopback QUIC with mutual TLS) in one process.

pub mod cluster;

pub use cluster::{
    block_on_system, build_report, loopback_servers, ClusterError, LocalCluster, ShardPublic,
};
pub use tether_common as common;
pub use tether_server as server;
pub use tether_worker as worker;
pub use tether_worker::model::Model;

//! Tether: an actor-based parameter server for distributed training. This facade re-exports the common, server and
//! worker crates so an application can embed a whole cluster through one dependency.

pub use tether_common as common;
pub use tether_server as server;
pub use tether_worker as worker;

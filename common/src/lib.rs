//! Tether shared core: the gradient codec, the wire protocol and transport, the parameter layout, the cluster
//! configuration and the run report. Pure logic lives here; the server and worker crates are shells around it.

pub mod chunk_pool;
pub mod codec;
pub mod config;
pub mod cpu;
pub mod error_chain;
pub mod fence;
pub mod layout;
pub mod logging;
pub mod metrics;
pub mod net;
pub mod numeric;
pub mod optim;
pub mod pki;
pub mod protocol;
pub mod report;
pub mod splitmix;
pub mod testing;

//! `[shard]`: how a shard process runs its kernels: the threads that decode and apply pushes and cut the public copy
//! in chunks. Local to each node (it never changes a result: the kernels give the same bits at any thread count), so
//! a standby and its primary may differ in it.

use serde::{Deserialize, Serialize};

/// `[shard]`: the shard's own settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ShardConfig {
    /// Threads each shard applies pushes and cuts pull deltas on, in chunks (default 0: every core this process may
    /// use; at most 1024). `tether-server --threads` overrides it.
    pub threads: u32,
}

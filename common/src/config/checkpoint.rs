//! `[checkpoint]`: where and how often shards checkpoint, how many they keep, and the optional object store.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// `[checkpoint]`: where and how often shards checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointConfig {
    /// Root directory; shard K writes under `dir/shard-K` (default "ckpt").
    pub dir: PathBuf,
    /// Checkpoint every this many applied updates (default 500; 0 = only on shutdown).
    pub every_updates: u64,
    /// Checkpoints kept per shard (default 3), locally and in the object store.
    pub keep: usize,
    /// Object storage for checkpoints, `s3://bucket/prefix` (default none). Endpoint, region and credentials come
    /// from the `AWS_*` environment variables. Uploads run in the background after each local write.
    pub url: Option<String>,
    /// Keep the local copy of checkpoints when `url` is set (default true: restoring from it is fast).
    pub local: bool,
    /// The shard's checkpoint key (HMAC-SHA256, 64 hex digits), overriding the default: `checkpoint.key` in the
    /// shard's TLS bundle, beside its `server.key` (default none: that file). Relative paths resolve against the
    /// config file's folder.
    pub key_file: Option<PathBuf>,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        Self {
            dir: PathBuf::from("ckpt"),
            every_updates: 500,
            keep: 3,
            url: None,
            local: true,
            key_file: None,
        }
    }
}

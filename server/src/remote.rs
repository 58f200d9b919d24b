//! `RemoteStore`: a shard's checkpoints in object storage (`checkpoint.url = "s3://bucket/prefix"`, through the
//! `object_store` crate; endpoint, region and credentials from the usual `AWS_*` environment variables).
//!
//! # Layout and invariants
//! `<prefix>/shard-K/v<version:020>/` holds the same files as a local checkpoint directory. An upload puts the data
//! files first and `manifest.json` last, so a version is *complete*, and listed, only once its manifest exists: an
//! upload cut short (a kill -9) leaves a version without a manifest, which nobody reads and a later prune removes.
//! Keep-K is applied remotely after each upload. Resuming downloads the newest complete version into the local root
//! (bounded: no object larger than the checkpoint of this range can be), verifies it exactly as a local checkpoint
//! (the manifest's MAC under the shard's checkpoint key, SHA-256 and zstd checksums of every file, value checks,
//! layout, shard, range) and falls back to older versions when one fails. Whoever can write to the bucket can delete
//! or withhold checkpoints, but cannot make a shard load one it did not write. The bytes come from the network, so
//! every defect is a typed error, never a panic.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures::TryStreamExt;
use object_store::aws::AmazonS3Builder;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, PutPayload};

use crate::checkpoint::{
    is_checkpoint_file, max_stored_bytes, parse_version_dir, version_dir_name, CheckpointError,
    CheckpointStore, MANIFEST_FILE,
};

/// Why a remote checkpoint operation failed.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// `checkpoint.url` is not `s3://bucket[/prefix]`.
    #[error("checkpoint.url {0:?} is not s3://bucket[/prefix]")]
    BadUrl(String),
    /// The object store refused or failed a request.
    #[error("object store: {0}")]
    Store(#[from] object_store::Error),
    /// A local file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// An object is larger than any checkpoint file of this range can be.
    #[error("object {path} is {size} bytes, more than the {limit} a checkpoint file of this range can be")]
    TooLarge {
        /// The object.
        path: String,
        /// Its size.
        size: u64,
        /// The bound.
        limit: u64,
    },
    /// Complete remote checkpoints exist but none verifies.
    #[error("none of {count} remote checkpoints verifies (newest: {newest})")]
    NoneUsable {
        /// How many were tried.
        count: usize,
        /// Why the newest was skipped.
        newest: String,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> RemoteError + '_ {
    move |source| RemoteError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Checkpoints of one shard in an object store.
pub struct RemoteStore {
    store: Arc<dyn ObjectStore>,
    root: ObjPath,
    keep: usize,
}

impl std::fmt::Debug for RemoteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteStore")
            .field("root", &self.root.to_string())
            .field("keep", &self.keep)
            .finish_non_exhaustive()
    }
}

/// Splits `s3://bucket/prefix` into the bucket and the prefix.
pub fn parse_s3_url(url: &str) -> Result<(String, String), RemoteError> {
    let rest = url
        .strip_prefix("s3://")
        .ok_or_else(|| RemoteError::BadUrl(url.to_string()))?;
    let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    if bucket.is_empty() {
        return Err(RemoteError::BadUrl(url.to_string()));
    }
    Ok((bucket.to_string(), prefix.trim_matches('/').to_string()))
}

impl RemoteStore {
    /// Shard `shard`'s store under `url` (S3; `AWS_ENDPOINT`, `AWS_REGION`, `AWS_ACCESS_KEY_ID`,
    /// `AWS_SECRET_ACCESS_KEY`, `AWS_ALLOW_HTTP` and the other `AWS_*` variables configure the client), keeping the
    /// newest `keep` checkpoints.
    pub fn from_url(url: &str, shard: u32, keep: usize) -> Result<RemoteStore, RemoteError> {
        let (bucket, prefix) = parse_s3_url(url)?;
        let store = AmazonS3Builder::from_env()
            .with_bucket_name(bucket)
            .build()?;
        Ok(RemoteStore::new(Arc::new(store), &prefix, shard, keep))
    }

    /// Shard `shard`'s store under `prefix` of `store`.
    pub fn new(store: Arc<dyn ObjectStore>, prefix: &str, shard: u32, keep: usize) -> RemoteStore {
        let shard_dir = format!("shard-{shard}");
        let root = if prefix.is_empty() {
            ObjPath::from(shard_dir)
        } else {
            ObjPath::from(format!("{prefix}/{shard_dir}"))
        };
        RemoteStore {
            store,
            root,
            keep: keep.max(1),
        }
    }

    fn version_root(&self, version: u64) -> ObjPath {
        self.root.child(version_dir_name(version))
    }

    /// Uploads the local checkpoint directory `dir` of `version`: data files first, the manifest last; then applies
    /// keep-K remotely.
    pub async fn upload(&self, dir: &Path, version: u64) -> Result<(), RemoteError> {
        let mut names: Vec<String> = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(io(dir))? {
            let entry = entry.map_err(io(dir))?;
            if let Some(name) = entry.file_name().to_str() {
                if name != MANIFEST_FILE {
                    names.push(name.to_string());
                }
            }
        }
        names.sort();
        names.push(MANIFEST_FILE.to_string());
        let root = self.version_root(version);
        for name in &names {
            let path = dir.join(name);
            let bytes = std::fs::read(&path).map_err(io(&path))?;
            self.store
                .put(&root.child(name.as_str()), PutPayload::from(bytes))
                .await?;
        }
        self.prune().await?;
        Ok(())
    }

    /// Every version with objects under this shard's prefix, and whether it is complete (has its manifest).
    async fn scan(&self) -> Result<Vec<(u64, bool)>, RemoteError> {
        let objects: Vec<object_store::ObjectMeta> =
            self.store.list(Some(&self.root)).try_collect().await?;
        let mut versions: std::collections::BTreeMap<u64, bool> = Default::default();
        for o in objects {
            let mut parts = o.location.parts();
            // <root parts...>/v<version>/<file>: take the two parts after the root.
            let depth = self.root.parts().count();
            let rest: Vec<String> = (&mut parts)
                .skip(depth)
                .map(|p| p.as_ref().to_string())
                .collect();
            if let [dir, file] = rest.as_slice() {
                if let Some(v) = parse_version_dir(dir) {
                    let complete = versions.entry(v).or_insert(false);
                    *complete |= file == MANIFEST_FILE;
                }
            }
        }
        Ok(versions.into_iter().rev().collect())
    }

    /// Complete remote versions, newest first.
    pub async fn versions(&self) -> Result<Vec<u64>, RemoteError> {
        Ok(self
            .scan()
            .await?
            .into_iter()
            .filter(|(_, complete)| *complete)
            .map(|(v, _)| v)
            .collect())
    }

    /// Keeps the newest `keep` complete versions; deletes older ones, and incomplete ones older than the oldest kept
    /// (newer incomplete ones may be uploads in progress). Returns how many versions were deleted.
    pub async fn prune(&self) -> Result<usize, RemoteError> {
        let scan = self.scan().await?;
        let kept: Vec<u64> = scan
            .iter()
            .filter(|(_, c)| *c)
            .map(|(v, _)| *v)
            .take(self.keep)
            .collect();
        let Some(&oldest_kept) = kept.last() else {
            return Ok(0);
        };
        let mut deleted = 0;
        for (v, _) in scan.iter().filter(|(v, _)| *v < oldest_kept) {
            let objects: Vec<object_store::ObjectMeta> = self
                .store
                .list(Some(&self.version_root(*v)))
                .try_collect()
                .await?;
            for o in objects {
                self.store.delete(&o.location).await?;
            }
            deleted += 1;
        }
        Ok(deleted)
    }

    /// Downloads complete version `version` into `<local_root>/v<version>` (through a temporary directory, so a
    /// cut-short download leaves nothing that looks like a checkpoint). Objects larger than a checkpoint file of
    /// `range` can be are refused before they are read. Does not verify: [`RemoteStore::restore_into`] does, before
    /// anything replaces a local checkpoint.
    pub async fn fetch(
        &self,
        version: u64,
        local_root: &Path,
        range: (u64, u64),
    ) -> Result<PathBuf, RemoteError> {
        let tmp = self.download(version, local_root, range).await?;
        install(&tmp, local_root, version)
    }

    /// Downloads version `version` into a temporary directory under `local_root` and returns it. Only the file
    /// names a checkpoint can hold are fetched, each bounded by what a checkpoint of `range` can need.
    async fn download(
        &self,
        version: u64,
        local_root: &Path,
        range: (u64, u64),
    ) -> Result<PathBuf, RemoteError> {
        let root = self.version_root(version);
        let objects: Vec<object_store::ObjectMeta> =
            self.store.list(Some(&root)).try_collect().await?;
        let limit = max_stored_bytes(range.1.saturating_sub(range.0));
        let tmp = local_root.join(format!(".tmp-fetch-{}", version_dir_name(version)));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).map_err(io(&tmp))?;
        for o in objects {
            let Some(name) = o
                .location
                .filename()
                .filter(|n| is_checkpoint_file(n))
                .map(str::to_string)
            else {
                continue;
            };
            if o.size > limit {
                return Err(RemoteError::TooLarge {
                    path: o.location.to_string(),
                    size: o.size,
                    limit,
                });
            }
            let bytes = self.store.get(&o.location).await?.bytes().await?;
            if bytes.len() as u64 > limit {
                return Err(RemoteError::TooLarge {
                    path: o.location.to_string(),
                    size: bytes.len() as u64,
                    limit,
                });
            }
            let path = tmp.join(&name);
            std::fs::write(&path, &bytes).map_err(io(&path))?;
        }
        Ok(tmp)
    }

    /// Restores the newest remote checkpoint that verifies with `local`'s key into `local`'s root (falling back to
    /// older ones, whose failed downloads are removed again). Returns its version and the versions skipped with why;
    /// `Ok(None)` when the store holds no complete checkpoint.
    #[allow(clippy::type_complexity)]
    pub async fn restore_into(
        &self,
        local: &CheckpointStore,
        layout_hash: u64,
        shard: u32,
        range: (u64, u64),
    ) -> Result<Option<(u64, Vec<(u64, String)>)>, RemoteError> {
        let local_root = local.dir();
        std::fs::create_dir_all(local_root).map_err(io(local_root))?;
        let versions = self.versions().await?;
        if versions.is_empty() {
            return Ok(None);
        }
        let mut skipped = Vec::new();
        for &v in &versions {
            let tmp = match self.download(v, local_root, range).await {
                Ok(dir) => dir,
                Err(e) => {
                    tracing::warn!(shard, version = v, error = %e, "skipping remote checkpoint");
                    skipped.push((v, e.to_string()));
                    continue;
                }
            };
            // Verified where it was downloaded: a forged object never replaces a good local checkpoint.
            match local.verify(&tmp, v, layout_hash, shard, range) {
                Ok(_) => {
                    install(&tmp, local_root, v)?;
                    return Ok(Some((v, skipped)));
                }
                Err(e) => {
                    tracing::warn!(shard, version = v, error = %e, "skipping remote checkpoint that does not verify");
                    let _ = std::fs::remove_dir_all(&tmp);
                    skipped.push((v, e.to_string()));
                }
            }
        }
        Err(RemoteError::NoneUsable {
            count: versions.len(),
            newest: skipped.first().map(|s| s.1.clone()).unwrap_or_default(),
        })
    }
}

/// Moves the downloaded directory `tmp` to `<local_root>/v<version>`, replacing what is there.
fn install(tmp: &Path, local_root: &Path, version: u64) -> Result<PathBuf, RemoteError> {
    let target = local_root.join(version_dir_name(version));
    let _ = std::fs::remove_dir_all(&target);
    std::fs::rename(tmp, &target).map_err(io(&target))?;
    Ok(target)
}

impl From<RemoteError> for CheckpointError {
    fn from(e: RemoteError) -> Self {
        CheckpointError::Format {
            reason: format!("remote checkpoint: {e}"),
        }
    }
}

//! The on-disk checkpoint format of one shard and the store that writes, verifies, lists and prunes it.
//!
//! # Layout
//! `<root>/v<version:020>/` holds `weights.f32.zst`, `slot<i>.f32.zst` for each optimizer slot, and `manifest.json`.
//! Data files are the raw little-endian f32 values, one zstd frame (level 1, with zstd's content checksum). The
//! manifest is `{"body": {...}, "hmac_sha256": "<hex>"}`, the MAC being HMAC-SHA256 under the shard's
//! [`CheckpointKey`] of [`MAC_CONTEXT`] followed by the compact JSON of `body` as a `serde_json::Value`; the body
//! carries the format name and version, the layout hash, shard index and range, the version (applied updates), the
//! optimizer step count, the worker clocks (of live workers and of evicted ones), and per file its name, element
//! count, stored byte length and SHA-256 of the stored (compressed) bytes. So every byte a load uses is
//! authenticated: the manifest by its MAC, each data file by its digest inside the manifest (plus zstd's frame
//! checksum over the decompressed values).
//!
//! # Trust
//! A checkpoint is untrusted until it authenticates: one whose MAC fails (forged, damaged, or written with another
//! key), whose format is older than [`FORMAT_VERSION`] (format 1 carried CRC-32s only, which anyone can recompute),
//! or whose values fail [`check_values`] (non-finite weights or optimizer state, clocks past [`MAX_CLOCK`], a step
//! count past the version) is skipped like a corrupt one, and the next older one is tried. The writer refuses a
//! snapshot that the loader would refuse, so a bad state never prunes a good checkpoint. The MAC does not stop
//! whoever can delete files from rolling a shard back to an older authentic checkpoint of its own.
//!
//! # Invariants
//! - A version directory appears only complete: files and directory are written under `.tmp-v<version>-<nonce>`,
//!   fsynced, renamed, and the parent fsynced. Leftover `.tmp-*` directories are ignored by loads and removed by the
//!   next write.
//! - Checkpoint files are untrusted bytes: every size is bounded by what the caller's expected range implies (the
//!   manifest by [`MAX_MANIFEST_BYTES`], a data file by zstd's compress bound of the range, its decompressed output by
//!   exactly the range), no allocation is sized by a field read from disk, and every defect is a typed
//!   [`CheckpointError`], never a panic.
//! - One store writes at a time (an internal lock); several stores must not share a root.

use std::fs::{self, File};
use std::io::{self, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use ring::{digest, hmac};
use serde::{Deserialize, Serialize};
use tether_common::pki::CheckpointKey;

use crate::clock::MAX_CLOCK;

/// Format name written into every manifest.
pub const FORMAT_NAME: &str = "tether-shard-checkpoint";
/// Current format version (2: HMAC-authenticated manifest, SHA-256 per data file).
pub const FORMAT_VERSION: u32 = 2;
/// What the manifest MAC covers before the body's JSON: binds the MAC to this use of the key.
pub const MAC_CONTEXT: &[u8] = b"tether-shard-checkpoint manifest v2\0";
/// Largest version (applied updates) a checkpoint may carry: far beyond any run, it keeps later `+ 1`s inside u64.
pub const MAX_VERSION: u64 = 1 << 62;
/// Manifest file name inside a version directory.
pub const MANIFEST_FILE: &str = "manifest.json";
/// Weights file name inside a version directory.
pub const WEIGHTS_FILE: &str = "weights.f32.zst";
/// Largest manifest accepted (bounds the clock list, too).
pub const MAX_MANIFEST_BYTES: u64 = 4 << 20;
/// Most optimizer slots a checkpoint may hold (Adam needs two).
pub const MAX_SLOTS: usize = 4;
/// Most open rounds' sums a checkpoint may hold (a shard stepping at round close holds at most
/// `max(staleness + 2, fragments)`; the configuration keeps that within this).
pub const MAX_PENDING_ROUNDS: usize = tether_common::config::MAX_OPEN_ROUNDS as usize;

/// zstd level for data files: level 1 is the fastest that still shrinks f32 weights.
const ZSTD_LEVEL: i32 = 1;
/// Values converted to bytes per write call while streaming into the encoder.
const WRITE_CHUNK: usize = 16 * 1024;
/// Prefix of in-progress (or abandoned) checkpoint directories.
const TMP_PREFIX: &str = ".tmp-";

/// Distinguishes concurrent temporary directories of this process.
static NONCE: AtomicU64 = AtomicU64::new(0);

/// Errors writing or loading checkpoints.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A filesystem operation failed.
    #[error("{path}: {source}")]
    Io {
        /// The path operated on.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The manifest is unreadable, malformed or inconsistent with its directory.
    #[error("manifest {path}: {reason}")]
    Manifest {
        /// The manifest path.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A file's stored bytes do not match the SHA-256 the (authenticated) manifest gives for it.
    #[error("checksum mismatch in {file}")]
    ChecksumMismatch {
        /// File name within the checkpoint.
        file: String,
    },
    /// A file is shorter than the manifest says, or decompresses to fewer values than the range holds.
    #[error("{file} is truncated: {found} bytes, expected {expected}")]
    Truncated {
        /// File name within the checkpoint.
        file: String,
        /// Bytes expected.
        expected: u64,
        /// Bytes found.
        found: u64,
    },
    /// A file named by the manifest is missing.
    #[error("{file} is missing")]
    MissingFile {
        /// File name within the checkpoint.
        file: String,
    },
    /// The manifest's MAC does not verify under this shard's key: forged, damaged, or written with another key.
    #[error(
        "manifest MAC does not verify: forged, damaged, or written with another checkpoint key"
    )]
    Forged,
    /// The manifest carries no MAC (format 1, written before checkpoints were authenticated): not trusted.
    #[error(
        "format v{format_version} checkpoint is not authenticated (no MAC); it is not trusted: resume it with the \
         release that wrote it, or move it aside to start fresh"
    )]
    Unauthenticated {
        /// The format version the manifest claims.
        format_version: u32,
    },
    /// A value is out of bounds: non-finite weights or optimizer state, a clock past [`MAX_CLOCK`], a step count
    /// past the version, a worker listed twice.
    #[error("value check: {reason}")]
    BadValue {
        /// What is wrong.
        reason: String,
    },
    /// The checkpoint belongs to a different parameter layout.
    #[error("layout hash {found:#018x}, expected {expected:#018x}")]
    LayoutMismatch {
        /// The layout hash of the running model.
        expected: u64,
        /// The hash in the checkpoint.
        found: u64,
    },
    /// The checkpoint belongs to another shard index.
    #[error("checkpoint of shard {found}, expected shard {expected}")]
    ShardMismatch {
        /// This shard's index.
        expected: u32,
        /// The index in the checkpoint.
        found: u32,
    },
    /// The checkpoint covers another parameter range.
    #[error("checkpoint range {found:?}, expected {expected:?}")]
    RangeMismatch {
        /// This shard's range.
        expected: (u64, u64),
        /// The range in the checkpoint.
        found: (u64, u64),
    },
    /// The content violates the format (unknown version, bad file list, sizes out of bounds, corrupt zstd, or a
    /// snapshot that is inconsistent with its own range when writing).
    #[error("format: {reason}")]
    Format {
        /// What is wrong.
        reason: String,
    },
    /// Checkpoints exist but none verifies and matches; each was skipped for the given reason.
    #[error("none of {} checkpoints is usable (newest skipped: {})", skipped.len(), first_reason(skipped))]
    NoneUsable {
        /// Every checkpoint tried, newest first, with why it was skipped.
        skipped: Vec<(PathBuf, CheckpointError)>,
    },
}

fn first_reason(skipped: &[(PathBuf, CheckpointError)]) -> String {
    skipped
        .first()
        .map_or_else(String::new, |(p, e)| format!("{}: {e}", p.display()))
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn format_err(reason: impl Into<String>) -> CheckpointError {
    CheckpointError::Format {
        reason: reason.into(),
    }
}

/// Everything a shard needs to resume: its weights, optimizer state and the clocks it had seen.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardSnapshot {
    /// Hash of the parameter layout the weights belong to.
    pub layout_hash: u64,
    /// Shard index.
    pub shard: u32,
    /// Global parameter range `[start, end)` of the shard.
    pub range: (u64, u64),
    /// Applied updates at the time of the snapshot.
    pub version: u64,
    /// Optimizer step count.
    pub opt_steps: u64,
    /// Worker clocks as (rank, clock).
    pub clocks: Vec<(u32, u64)>,
    /// Clocks of workers evicted for silence, as (rank, clock): restored evicted, so a rejoin never moves one back.
    pub evicted: Vec<(u32, u64)>,
    /// The shard's weights, `range.1 − range.0` values.
    pub weights: Vec<f32>,
    /// Optimizer state slots, each as long as `weights`.
    pub slots: Vec<Vec<f32>>,
    /// The sums of the rounds not stepped yet (`optimizer.outer.at_close`), as (round, sum), rounds ascending, each
    /// sum as long as `weights` (zero outside its round's part).
    pub pending: Vec<(u64, Vec<f32>)>,
}

/// Why open rounds' sums cannot belong to a shard of `n` values, if they cannot: more than
/// [`MAX_PENDING_ROUNDS`], rounds not strictly ascending or beyond [`MAX_CLOCK`], or a sum not `n` long.
pub fn pending_problem(pending: &[(u64, Vec<f32>)], n: usize) -> Option<String> {
    if pending.len() > MAX_PENDING_ROUNDS {
        return Some(format!("{} open rounds' sums", pending.len()));
    }
    if let Some((round, _)) = pending.iter().find(|(r, _)| *r > MAX_CLOCK) {
        return Some(format!("round {round} is past the maximum clock"));
    }
    if pending.windows(2).any(|w| w[0].0 >= w[1].0) {
        return Some("rounds not strictly ascending".into());
    }
    if let Some((round, sum)) = pending.iter().find(|(_, s)| s.len() != n) {
        return Some(format!(
            "the sum of round {round} has {} values for a range of {n}",
            sum.len()
        ));
    }
    None
}

/// The manifest envelope: the body plus the MAC of its canonical JSON (format 1 had a CRC-32 instead).
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Envelope {
    body: serde_json::Value,
    /// HMAC-SHA256 of [`MAC_CONTEXT`] and the body's canonical JSON, lowercase hex.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    hmac_sha256: Option<String>,
    /// Format 1's unauthenticated CRC-32: only recognised, to refuse it with a clear reason.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    crc32: Option<u32>,
}

/// What the manifest says about a checkpoint.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ManifestBody {
    format: String,
    format_version: u32,
    layout_hash: u64,
    shard: u32,
    range: (u64, u64),
    version: u64,
    opt_steps: u64,
    clocks: Vec<(u32, u64)>,
    /// Clocks of evicted workers.
    evicted: Vec<(u32, u64)>,
    /// Digest algorithm of `files[].digest`.
    digest: String,
    files: Vec<FileEntry>,
    /// The rounds whose sums are the last data files (`pend{i}`), ascending; absent when none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pending_rounds: Vec<u64>,
}

/// One data file of a checkpoint.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileEntry {
    name: String,
    elements: u64,
    bytes: u64,
    /// SHA-256 of the stored bytes, lowercase hex.
    digest: String,
}

/// Name of the digest algorithm recorded in manifests.
const DIGEST_ALGO: &str = "sha256";

/// Lowercase hex of `bytes`.
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The bytes of exactly `N` bytes' worth of hex digits, or `None`.
fn unhex<const N: usize>(text: &str) -> Option<[u8; N]> {
    if text.len() != 2 * N || !text.is_ascii() {
        return None;
    }
    let mut out = [0u8; N];
    for (b, pair) in out.iter_mut().zip(text.as_bytes().chunks_exact(2)) {
        *b = u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok()?;
    }
    Some(out)
}

/// The HMAC-SHA256 key of `key`.
fn mac_key(key: &CheckpointKey) -> hmac::Key {
    hmac::Key::new(hmac::HMAC_SHA256, key.as_bytes())
}

/// The MAC of a manifest body's canonical JSON.
fn manifest_mac(key: &hmac::Key, canonical_body: &[u8]) -> hmac::Tag {
    let mut ctx = hmac::Context::with_key(key);
    ctx.update(MAC_CONTEXT);
    ctx.update(canonical_body);
    ctx.sign()
}

/// The data file names of a checkpoint with `slots` optimizer slots and `pending` open rounds' sums, in manifest
/// order.
fn data_file_names(slots: usize, pending: usize) -> Vec<String> {
    std::iter::once(WEIGHTS_FILE.to_owned())
        .chain((0..slots).map(|i| format!("slot{i}.f32.zst")))
        .chain((0..pending).map(|i| format!("pend{i}.f32.zst")))
        .collect()
}

/// Whether `name` is a file a checkpoint directory can hold (the manifest or a data file).
pub fn is_checkpoint_file(name: &str) -> bool {
    name == MANIFEST_FILE
        || data_file_names(MAX_SLOTS, MAX_PENDING_ROUNDS)
            .iter()
            .any(|n| n == name)
}

/// The directory name of checkpoint `version` (`v` and 20 digits).
pub fn version_dir_name(version: u64) -> String {
    format!("v{version:020}")
}

/// The version a checkpoint directory name denotes, if it is one.
pub fn parse_version_dir(name: &str) -> Option<u64> {
    let digits = name.strip_prefix('v')?;
    if digits.len() != 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Largest stored size a data file of `elements` values may have: zstd's worst case plus frame overhead.
fn stored_bound(elements: u64) -> u64 {
    let raw = elements.saturating_mul(4);
    // zstd's ZSTD_COMPRESSBOUND: src + src/256 + margin for small inputs, plus header and checksum.
    raw.saturating_add(raw / 256).saturating_add(1024)
}

/// Fsyncs a directory so a rename or creation inside it is durable.
fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err(dir))
}

/// A writer that counts and digests what passes through it.
struct DigestWriter<W> {
    inner: W,
    hasher: digest::Context,
    bytes: u64,
}

impl<W: Write> Write for DigestWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Writes `values` as one zstd frame of little-endian f32 to `path`, fsynced; returns (stored bytes, SHA-256 hex).
fn write_data_file(path: &Path, values: &[f32]) -> Result<(u64, String), CheckpointError> {
    let run = || -> io::Result<(u64, String)> {
        let file = File::create(path)?;
        let sink = DigestWriter {
            inner: BufWriter::with_capacity(1 << 20, file),
            hasher: digest::Context::new(&digest::SHA256),
            bytes: 0,
        };
        let mut enc = zstd::stream::Encoder::new(sink, ZSTD_LEVEL)?;
        enc.include_checksum(true)?;
        enc.set_pledged_src_size(Some(values.len() as u64 * 4))?;
        let mut buf = Vec::with_capacity(WRITE_CHUNK * 4);
        for chunk in values.chunks(WRITE_CHUNK) {
            buf.clear();
            buf.extend(chunk.iter().flat_map(|v| v.to_le_bytes()));
            enc.write_all(&buf)?;
        }
        let mut sink = enc.finish()?;
        sink.flush()?;
        let (bytes, sum) = (sink.bytes, hex(sink.hasher.finish().as_ref()));
        let file = sink.inner.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        Ok((bytes, sum))
    };
    run().map_err(io_err(path))
}

/// Reads at most `limit` bytes of `path` into `buf` (cleared first); a longer file reads as `limit + 1` bytes.
fn read_bounded(path: &Path, limit: u64, buf: &mut Vec<u8>) -> io::Result<()> {
    buf.clear();
    let file = File::open(path)?;
    // The file's length is only a hint, capped by `limit`; reserving it avoids doubling growth while reading.
    let hint = file.metadata()?.len().min(limit);
    buf.reserve_exact(usize::try_from(hint).unwrap_or(0).saturating_add(1));
    file.take(limit.saturating_add(1)).read_to_end(buf)?;
    Ok(())
}

/// Writes, lists, verifies and prunes the checkpoints of one shard under one root directory.
#[derive(Debug)]
pub struct CheckpointStore {
    dir: PathBuf,
    keep: usize,
    key: CheckpointKey,
    write_lock: Mutex<()>,
}

impl CheckpointStore {
    /// A store rooted at `dir` (this shard's checkpoint root) keeping the newest `keep` checkpoints (at least 1),
    /// authenticating what it writes and loads with `key`.
    pub fn new(dir: PathBuf, keep: usize, key: CheckpointKey) -> Self {
        Self {
            dir,
            keep: keep.max(1),
            key,
            write_lock: Mutex::new(()),
        }
    }

    /// The root directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Verifies checkpoint directory `dir` of `version` with this store's key: see [`verify_dir`].
    pub fn verify(
        &self,
        dir: &Path,
        version: u64,
        layout_hash: u64,
        shard: u32,
        range: (u64, u64),
    ) -> Result<ShardSnapshot, CheckpointError> {
        verify_dir(dir, version, &self.key, layout_hash, shard, range)
    }

    /// Writes `snap` to `<dir>/.tmp-v<version>-<nonce>/`, fsyncs files and the dir, renames it to
    /// `<dir>/v<version:020>` (replacing an existing checkpoint of that version), fsyncs the parent, then prunes to
    /// the newest `keep`. Stale `.tmp-*` directories are removed first. Returns the final path. A snapshot that
    /// [`check_values`] refuses is not written (a checkpoint no load would accept must not prune good ones).
    pub fn write(&self, snap: &ShardSnapshot) -> Result<PathBuf, CheckpointError> {
        let started = Instant::now();
        let n = snapshot_len(snap)?;
        check_values(snap)?;
        // A poisoned lock only means another write panicked; the directory protocol stays valid.
        let _guard = self.write_lock.lock().unwrap_or_else(|p| p.into_inner());
        fs::create_dir_all(&self.dir).map_err(io_err(&self.dir))?;
        self.remove_stale_tmp()?;

        let nonce = NONCE.fetch_add(1, Ordering::Relaxed);
        let tmp = self.dir.join(format!(
            "{TMP_PREFIX}v{}-{}-{nonce}",
            snap.version,
            std::process::id()
        ));
        fs::create_dir(&tmp).map_err(io_err(&tmp))?;

        let names = data_file_names(snap.slots.len(), snap.pending.len());
        let mut files = Vec::with_capacity(names.len());
        for (name, values) in names.into_iter().zip(
            std::iter::once(&snap.weights)
                .chain(&snap.slots)
                .chain(snap.pending.iter().map(|(_, sum)| sum)),
        ) {
            let (bytes, digest) = write_data_file(&tmp.join(&name), values)?;
            files.push(FileEntry {
                name,
                elements: n,
                bytes,
                digest,
            });
        }
        let body = ManifestBody {
            format: FORMAT_NAME.to_owned(),
            format_version: FORMAT_VERSION,
            layout_hash: snap.layout_hash,
            shard: snap.shard,
            range: snap.range,
            version: snap.version,
            opt_steps: snap.opt_steps,
            clocks: snap.clocks.clone(),
            evicted: snap.evicted.clone(),
            digest: DIGEST_ALGO.to_owned(),
            files,
            pending_rounds: snap.pending.iter().map(|(round, _)| *round).collect(),
        };
        let manifest_path = tmp.join(MANIFEST_FILE);
        let manifest =
            encode_manifest(&body, &mac_key(&self.key)).map_err(|e| CheckpointError::Manifest {
                path: manifest_path.clone(),
                reason: e.to_string(),
            })?;
        let write_manifest = || -> io::Result<()> {
            let mut f = File::create(&manifest_path)?;
            f.write_all(&manifest)?;
            f.sync_all()
        };
        write_manifest().map_err(io_err(&manifest_path))?;
        sync_dir(&tmp)?;

        let target = self.dir.join(version_dir_name(snap.version));
        let displaced = if target.exists() {
            let old = self
                .dir
                .join(format!("{TMP_PREFIX}old-v{}-{nonce}", snap.version));
            fs::rename(&target, &old).map_err(io_err(&target))?;
            Some(old)
        } else {
            None
        };
        fs::rename(&tmp, &target).map_err(io_err(&tmp))?;
        sync_dir(&self.dir)?;
        if let Some(old) = displaced {
            fs::remove_dir_all(&old).map_err(io_err(&old))?;
        }
        self.prune()?;
        tracing::debug!(
            path = %target.display(),
            version = snap.version,
            seconds = started.elapsed().as_secs_f64(),
            "checkpoint written"
        );
        Ok(target)
    }

    /// The newest checkpoint that authenticates, passes [`check_values`] and whose layout hash, shard and range match;
    /// older ones are tried when a newer one fails. Returns the snapshot and the (path, reason) of each skipped
    /// newer checkpoint. `Ok(None)` when there is no checkpoint at all; [`CheckpointError::NoneUsable`] when there
    /// are some but none can be used (resuming must not silently start from scratch).
    #[allow(clippy::type_complexity)]
    pub fn load_latest(
        &self,
        layout_hash: u64,
        shard: u32,
        range: (u64, u64),
    ) -> Result<Option<(ShardSnapshot, Vec<(PathBuf, CheckpointError)>)>, CheckpointError> {
        let versions = self.list()?;
        if versions.is_empty() {
            return Ok(None);
        }
        let mut skipped = Vec::new();
        for (version, path) in versions {
            match self.verify(&path, version, layout_hash, shard, range) {
                Ok(snap) => return Ok(Some((snap, skipped))),
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "skipping checkpoint");
                    skipped.push((path, e));
                }
            }
        }
        Err(CheckpointError::NoneUsable { skipped })
    }

    /// Checkpoint versions on disk with their directories, newest first (temporary directories excluded).
    pub fn list(&self) -> Result<Vec<(u64, PathBuf)>, CheckpointError> {
        let entries = match fs::read_dir(&self.dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io_err(&self.dir)(e)),
        };
        let mut out = Vec::new();
        for entry in entries {
            let entry = entry.map_err(io_err(&self.dir))?;
            let Some(version) = entry.file_name().to_str().and_then(parse_version_dir) else {
                continue;
            };
            let is_dir = entry.file_type().map_err(io_err(&entry.path()))?.is_dir();
            if is_dir {
                out.push((version, entry.path()));
            }
        }
        out.sort_unstable_by_key(|&(v, _)| std::cmp::Reverse(v));
        Ok(out)
    }

    /// Removes every checkpoint but the newest `keep`.
    fn prune(&self) -> Result<(), CheckpointError> {
        for (_, path) in self.list()?.into_iter().skip(self.keep) {
            fs::remove_dir_all(&path).map_err(io_err(&path))?;
        }
        Ok(())
    }

    /// Removes `.tmp-*` directories left by interrupted writes.
    fn remove_stale_tmp(&self) -> Result<(), CheckpointError> {
        for entry in fs::read_dir(&self.dir).map_err(io_err(&self.dir))? {
            let entry = entry.map_err(io_err(&self.dir))?;
            if entry.file_name().to_string_lossy().starts_with(TMP_PREFIX) {
                let path = entry.path();
                tracing::info!(path = %path.display(), "removing stale temporary checkpoint");
                let removed = if entry.file_type().map_err(io_err(&path))?.is_dir() {
                    fs::remove_dir_all(&path)
                } else {
                    fs::remove_file(&path)
                };
                removed.map_err(io_err(&path))?;
            }
        }
        Ok(())
    }
}

/// Checks a snapshot is consistent with its own range and returns the element count.
fn snapshot_len(snap: &ShardSnapshot) -> Result<u64, CheckpointError> {
    let (start, end) = snap.range;
    let n = end
        .checked_sub(start)
        .ok_or_else(|| format_err(format!("range {:?} is reversed", snap.range)))?;
    if snap.weights.len() as u64 != n {
        return Err(format_err(format!(
            "{} weights for a range of {n}",
            snap.weights.len()
        )));
    }
    if snap.slots.len() > MAX_SLOTS {
        return Err(format_err(format!("{} optimizer slots", snap.slots.len())));
    }
    if let Some(s) = snap.slots.iter().find(|s| s.len() as u64 != n) {
        return Err(format_err(format!(
            "optimizer slot of {} values for a range of {n}",
            s.len()
        )));
    }
    let len = usize::try_from(n).map_err(|_| format_err("range too large"))?;
    if let Some(why) = pending_problem(&snap.pending, len) {
        return Err(format_err(why));
    }
    Ok(n)
}

/// The manifest bytes: the envelope with the MAC of the body's canonical JSON.
fn encode_manifest(body: &ManifestBody, key: &hmac::Key) -> serde_json::Result<Vec<u8>> {
    let body = serde_json::to_value(body)?;
    let mac = manifest_mac(key, &serde_json::to_vec(&body)?);
    serde_json::to_vec_pretty(&Envelope {
        body,
        hmac_sha256: Some(hex(mac.as_ref())),
        crc32: None,
    })
}

/// Checks the values a shard would resume from: version at most [`MAX_VERSION`], optimizer steps at most the
/// version (each applied update is one step; a rollback only lowers it), every clock (live and evicted) at most
/// [`MAX_CLOCK`], no worker listed twice, and every weight and optimizer slot value finite.
pub fn check_values(snap: &ShardSnapshot) -> Result<(), CheckpointError> {
    check_counters(snap.version, snap.opt_steps, &snap.clocks, &snap.evicted)?;
    check_finite("weights", &snap.weights)?;
    for (i, slot) in snap.slots.iter().enumerate() {
        check_finite(&format!("optimizer slot {i}"), slot)?;
    }
    for (round, sum) in &snap.pending {
        check_finite(&format!("the sum of open round {round}"), sum)?;
    }
    Ok(())
}

fn bad_value(reason: String) -> CheckpointError {
    CheckpointError::BadValue { reason }
}

/// The counter part of [`check_values`]: cheap, so a load runs it before reading any data file.
fn check_counters(
    version: u64,
    opt_steps: u64,
    clocks: &[(u32, u64)],
    evicted: &[(u32, u64)],
) -> Result<(), CheckpointError> {
    if version > MAX_VERSION {
        return Err(bad_value(format!(
            "version {version} is past the maximum {MAX_VERSION}"
        )));
    }
    if opt_steps > version {
        return Err(bad_value(format!(
            "{opt_steps} optimizer steps for {version} applied updates"
        )));
    }
    let mut seen = std::collections::HashSet::with_capacity(clocks.len() + evicted.len());
    for &(rank, clock) in clocks.iter().chain(evicted) {
        if clock > MAX_CLOCK {
            return Err(bad_value(format!(
                "worker {rank}'s clock {clock} is past the maximum {MAX_CLOCK}"
            )));
        }
        if !seen.insert(rank) {
            return Err(bad_value(format!("worker {rank} is listed twice")));
        }
    }
    Ok(())
}

/// Refuses the first non-finite value of `values`, naming where it is.
fn check_finite(what: &str, values: &[f32]) -> Result<(), CheckpointError> {
    match values.iter().position(|v| !v.is_finite()) {
        Some(i) => Err(bad_value(format!("{what}[{i}] is {}", values[i]))),
        None => Ok(()),
    }
}

/// Largest stored file a checkpoint of a range of `elements` values can hold (a data file's zstd bound, or the
/// manifest limit): the bound on any object fetched for it.
pub fn max_stored_bytes(elements: u64) -> u64 {
    stored_bound(elements).max(MAX_MANIFEST_BYTES)
}

/// Verifies checkpoint directory `dir` of `dir_version` exactly as [`CheckpointStore::load_latest`] does (the
/// manifest's MAC under `key`, each data file's SHA-256 and zstd checksum, [`check_values`], layout hash, shard and
/// range) and returns its snapshot.
pub fn verify_dir(
    dir: &Path,
    dir_version: u64,
    key: &CheckpointKey,
    layout_hash: u64,
    shard: u32,
    range: (u64, u64),
) -> Result<ShardSnapshot, CheckpointError> {
    let manifest_path = dir.join(MANIFEST_FILE);
    let bad_manifest = |reason: String| CheckpointError::Manifest {
        path: manifest_path.clone(),
        reason,
    };
    let mut buf = Vec::new();
    read_bounded(&manifest_path, MAX_MANIFEST_BYTES, &mut buf).map_err(|e| {
        if e.kind() == io::ErrorKind::NotFound {
            CheckpointError::MissingFile {
                file: MANIFEST_FILE.to_owned(),
            }
        } else {
            io_err(&manifest_path)(e)
        }
    })?;
    if buf.len() as u64 > MAX_MANIFEST_BYTES {
        return Err(bad_manifest(format!(
            "larger than {MAX_MANIFEST_BYTES} bytes"
        )));
    }
    let envelope: Envelope =
        serde_json::from_slice(&buf).map_err(|e| bad_manifest(e.to_string()))?;
    let Some(mac) = envelope.hmac_sha256 else {
        // Nothing in an unauthenticated manifest is believed, but the format it claims makes the refusal clear.
        let format_version = envelope.body["format_version"]
            .as_u64()
            .and_then(|v| u32::try_from(v).ok())
            .unwrap_or(0);
        return Err(CheckpointError::Unauthenticated { format_version });
    };
    let canonical = serde_json::to_vec(&envelope.body).map_err(|e| bad_manifest(e.to_string()))?;
    let tag = unhex::<32>(&mac).ok_or(CheckpointError::Forged)?;
    let mut msg = Vec::with_capacity(MAC_CONTEXT.len() + canonical.len());
    msg.extend_from_slice(MAC_CONTEXT);
    msg.extend_from_slice(&canonical);
    hmac::verify(&mac_key(key), &msg, &tag).map_err(|_| CheckpointError::Forged)?;
    // Authentic from here on: what follows catches our own bugs and values a sick shard wrote, not forgeries.
    let body: ManifestBody =
        serde_json::from_value(envelope.body).map_err(|e| bad_manifest(e.to_string()))?;
    if body.format != FORMAT_NAME || body.format_version != FORMAT_VERSION {
        return Err(format_err(format!(
            "format {} v{}, expected {FORMAT_NAME} v{FORMAT_VERSION}",
            body.format, body.format_version
        )));
    }
    if body.digest != DIGEST_ALGO {
        return Err(format_err(format!("digest algorithm {}", body.digest)));
    }
    if body.version != dir_version {
        return Err(bad_manifest(format!(
            "version {} in directory of version {dir_version}",
            body.version
        )));
    }
    if body.layout_hash != layout_hash {
        return Err(CheckpointError::LayoutMismatch {
            expected: layout_hash,
            found: body.layout_hash,
        });
    }
    if body.shard != shard {
        return Err(CheckpointError::ShardMismatch {
            expected: shard,
            found: body.shard,
        });
    }
    if body.range != range {
        return Err(CheckpointError::RangeMismatch {
            expected: range,
            found: body.range,
        });
    }
    check_counters(body.version, body.opt_steps, &body.clocks, &body.evicted)?;
    // From here on sizes derive from the caller's range, never from the manifest.
    let n = range
        .1
        .checked_sub(range.0)
        .ok_or_else(|| format_err(format!("range {range:?} is reversed")))?;
    let raw_bytes = n
        .checked_mul(4)
        .filter(|&b| usize::try_from(b).is_ok_and(|b| b <= isize::MAX as usize))
        .ok_or_else(|| format_err(format!("range of {n} values does not fit in memory")))?;
    let pending = body.pending_rounds.len();
    if pending > MAX_PENDING_ROUNDS {
        return Err(format_err(format!("{pending} open rounds' sums")));
    }
    let slot_count = body
        .files
        .len()
        .checked_sub(1 + pending)
        .filter(|&s| s <= MAX_SLOTS)
        .ok_or_else(|| format_err(format!("{} data files", body.files.len())))?;
    let names = data_file_names(slot_count, pending);
    if let Some((entry, want)) = body.files.iter().zip(&names).find(|(e, w)| e.name != **w) {
        return Err(format_err(format!(
            "file {:?} where {want:?} was expected",
            entry.name
        )));
    }

    let mut stored = Vec::new();
    let mut raw = Vec::new();
    let mut columns = Vec::with_capacity(body.files.len());
    for entry in &body.files {
        columns.push(read_data_file(
            dir,
            entry,
            n,
            raw_bytes,
            &mut stored,
            &mut raw,
        )?);
    }
    let mut columns = columns.into_iter();
    let weights = columns
        .next()
        .ok_or_else(|| format_err("no weights file"))?;
    let snap = ShardSnapshot {
        layout_hash: body.layout_hash,
        shard: body.shard,
        range: body.range,
        version: body.version,
        opt_steps: body.opt_steps,
        clocks: body.clocks,
        evicted: body.evicted,
        weights,
        slots: columns.by_ref().take(slot_count).collect(),
        pending: body.pending_rounds.into_iter().zip(columns).collect(),
    };
    if let Some(why) = pending_problem(&snap.pending, snap.weights.len()) {
        return Err(format_err(why));
    }
    check_values(&snap)?;
    Ok(snap)
}

/// Reads, verifies and decodes one data file of `n` values (`raw_bytes` = 4n), reusing the two scratch buffers.
fn read_data_file(
    dir: &Path,
    entry: &FileEntry,
    n: u64,
    raw_bytes: u64,
    stored: &mut Vec<u8>,
    raw: &mut Vec<u8>,
) -> Result<Vec<f32>, CheckpointError> {
    let file = entry.name.clone();
    if entry.elements != n {
        return Err(format_err(format!(
            "{file} declares {} values, range holds {n}",
            entry.elements
        )));
    }
    let bound = stored_bound(n);
    if entry.bytes > bound {
        return Err(format_err(format!(
            "{file} declares {} stored bytes, more than the bound {bound} for {n} values",
            entry.bytes
        )));
    }
    let path = dir.join(&entry.name);
    read_bounded(&path, entry.bytes, stored).map_err(|e| {
        if e.kind() == io::ErrorKind::NotFound {
            CheckpointError::MissingFile { file: file.clone() }
        } else {
            io_err(&path)(e)
        }
    })?;
    let found = stored.len() as u64;
    if found < entry.bytes {
        return Err(CheckpointError::Truncated {
            file,
            expected: entry.bytes,
            found,
        });
    }
    if found > entry.bytes {
        return Err(format_err(format!(
            "{file} is longer than the {} bytes declared",
            entry.bytes
        )));
    }
    let want = unhex::<32>(&entry.digest).ok_or_else(|| {
        format_err(format!(
            "{file}: digest {:?} is not SHA-256 hex",
            entry.digest
        ))
    })?;
    if digest::digest(&digest::SHA256, stored).as_ref() != want {
        return Err(CheckpointError::ChecksumMismatch { file });
    }
    raw.clear();
    // raw_bytes was checked to fit in usize by the caller.
    let cap = usize::try_from(raw_bytes).map_err(|_| format_err("range too large"))?;
    raw.reserve_exact(cap);
    let mut dec = zstd::bulk::Decompressor::new().map_err(io_err(&path))?;
    let got = dec
        .decompress_to_buffer(stored.as_slice(), raw)
        .map_err(|e| format_err(format!("{file}: zstd: {e}")))?;
    if got as u64 > raw_bytes {
        return Err(format_err(format!(
            "{file} decompresses to more than {raw_bytes} bytes"
        )));
    }
    if (got as u64) < raw_bytes {
        return Err(CheckpointError::Truncated {
            file,
            expected: raw_bytes,
            found: got as u64,
        });
    }
    Ok(raw[..got]
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect())
}

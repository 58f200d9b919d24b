//! One worker's share of an MNIST-style (IDX) training set, read without holding the rest: the labels file gives
//! the sample count, [`Partition::elastic`] picks the share's rows, and the images file is streamed (gzip decoded on
//! the fly) row by row, keeping only those rows. The share is stored in partition order, and the returned
//! [`Partition`] is [`Partition::local`]: over the share it visits the same samples in the same order, batch for
//! batch, as the whole set with the global partition does, so a worker's steps are bit for bit the same whichever
//! way it loaded its data.
//!
//! Bounded as the whole-file reader is: the header's dims are checked (absurd sizes, rows against labels) before
//! anything is sized by them, exactly `n × features` bytes must follow the header (a truncated or overlong file is a
//! [`DataError::Format`]), and memory is the share plus one row.

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

use flate2::read::GzDecoder;

use super::idx::{parse_idx_labels, read_bounded, IdxFiles, MAX_IDX_BYTES};
use super::{DataError, Dataset, Partition, Pixels};

/// Most features per sample accepted from an IDX header (as the whole-file reader).
const MAX_FEATURES: usize = 1 << 20;

/// A worker's share of a training set: the rows, and the partition that walks them.
#[derive(Debug, Clone, PartialEq)]
pub struct Share {
    /// The share's samples, in partition order.
    pub train: Dataset,
    /// The partition over `train` ([`Partition::local`] of the worker's global partition).
    pub partition: Partition,
    /// Samples in the whole training set.
    pub total: usize,
}

/// Reads worker `rank`'s share (of `workers`, seeded by `seed`, as [`Partition::elastic`]) of an IDX training pair.
/// `classes` of the result is the largest label of the whole training set + 1 (all labels are read: one byte each).
pub fn load_idx_share(
    images: &Path,
    labels: &Path,
    rank: u32,
    workers: u32,
    seed: u64,
) -> Result<Share, DataError> {
    let label_bytes = read_bounded(labels)?;
    let all_labels = parse_idx_labels(&label_bytes, labels)?;
    drop(label_bytes);
    let n = all_labels.len();
    let global = Partition::elastic(n, rank, workers, seed)?;
    let mut stream = open_stream(images)?;
    let bad = |reason: String| DataError::Format {
        path: images.to_path_buf(),
        reason,
    };
    let io = |source| DataError::Io {
        path: images.to_path_buf(),
        source,
    };
    let dims = read_header(&mut stream, images)?;
    if dims.len() != 2 && dims.len() != 3 {
        return Err(bad(format!(
            "images need 2 or 3 dimensions (magic 0x00000803), got {} (is this a labels file?)",
            dims.len()
        )));
    }
    let features: usize = dims[1..].iter().product();
    if dims[0] == 0 || features == 0 || features > MAX_FEATURES {
        return Err(bad(format!("absurd dimensions {dims:?}")));
    }
    if dims[0] != n {
        return Err(DataError::Format {
            path: labels.to_path_buf(),
            reason: format!("{n} labels for {} images in {}", dims[0], images.display()),
        });
    }
    // Position in the share of each global row, u32::MAX for rows of other workers.
    let mut place = vec![u32::MAX; n];
    for (k, &i) in global.indices().iter().enumerate() {
        // k < n ≤ MAX_IDX_BYTES < u32::MAX (the dims product was bounded by read_header).
        place[i] = k as u32;
    }
    let len = global.len();
    let mut x = vec![0f32; len * features];
    let mut y = vec![0u32; len];
    let mut row = vec![0u8; features];
    for (i, &slot) in place.iter().enumerate() {
        stream.read_exact(&mut row).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                bad(format!(
                    "dimensions {dims:?} need {} data bytes but the file ends in row {i} (truncated)",
                    n * features
                ))
            } else {
                io(e)
            }
        })?;
        if slot != u32::MAX {
            let k = slot as usize;
            for (v, &b) in x[k * features..(k + 1) * features].iter_mut().zip(&row) {
                *v = f32::from(b) / 255.0;
            }
            y[k] = all_labels[i];
        }
    }
    let mut extra = [0u8; 1];
    if stream.read(&mut extra).map_err(io)? != 0 {
        return Err(bad(format!(
            "dimensions {dims:?} need {} data bytes but the file has more (trailing bytes)",
            n * features
        )));
    }
    let classes = all_labels
        .iter()
        .map(|&l| l as usize + 1)
        .max()
        .unwrap_or(0);
    Ok(Share {
        train: Dataset {
            features,
            classes,
            x,
            y,
        },
        partition: global.local(),
        total: n,
    })
}

/// Reads an IDX images file and its labels as [`Pixels`] (the bytes, not scaled: a test set a worker evaluates on,
/// [`super::TestSet::Pixels`]); `classes` = largest label + 1. The same checks as [`load_idx_share`].
pub fn load_idx_pixels(images: &Path, labels: &Path) -> Result<Pixels, DataError> {
    let label_bytes = read_bounded(labels)?;
    let y = parse_idx_labels(&label_bytes, labels)?;
    drop(label_bytes);
    let bad = |reason: String| DataError::Format {
        path: images.to_path_buf(),
        reason,
    };
    let mut stream = open_stream(images)?;
    let dims = read_header(&mut stream, images)?;
    if dims.len() != 2 && dims.len() != 3 {
        return Err(bad(format!(
            "images need 2 or 3 dimensions (magic 0x00000803), got {} (is this a labels file?)",
            dims.len()
        )));
    }
    let n = dims[0];
    let features: usize = dims[1..].iter().product();
    if n == 0 || features == 0 || features > MAX_FEATURES {
        return Err(bad(format!("absurd dimensions {dims:?}")));
    }
    if n != y.len() {
        return Err(DataError::Format {
            path: labels.to_path_buf(),
            reason: format!("{} labels for {n} images in {}", y.len(), images.display()),
        });
    }
    // n × features ≤ MAX_IDX_BYTES (read_header), and n is the labels file's length: the labels bound it too.
    let mut bytes = vec![0u8; n * features];
    stream.read_exact(&mut bytes).map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            bad(format!(
                "dimensions {dims:?} need {} data bytes (truncated)",
                n * features
            ))
        } else {
            DataError::Io {
                path: images.to_path_buf(),
                source: e,
            }
        }
    })?;
    let mut extra = [0u8; 1];
    let more = stream.read(&mut extra).map_err(|source| DataError::Io {
        path: images.to_path_buf(),
        source,
    })?;
    if more != 0 {
        return Err(bad(format!(
            "dimensions {dims:?} need {} data bytes but the file has more (trailing bytes)",
            n * features
        )));
    }
    let classes = y.iter().map(|&l| l as usize + 1).max().unwrap_or(0);
    Ok(Pixels {
        features,
        classes,
        bytes,
        y,
    })
}

/// [`load_idx_share`] over the training pair of an MNIST-style directory.
pub fn load_idx_dir_share(
    dir: &Path,
    rank: u32,
    workers: u32,
    seed: u64,
) -> Result<Share, DataError> {
    let files = IdxFiles::find(dir)?;
    load_idx_share(
        &files.train_images,
        &files.train_labels,
        rank,
        workers,
        seed,
    )
}

/// The file's bytes, gunzipped on the fly when it starts with the gzip magic, capped at [`MAX_IDX_BYTES`].
fn open_stream(path: &Path) -> Result<Box<dyn Read>, DataError> {
    let io = |source| DataError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut file = BufReader::new(File::open(path).map_err(io)?);
    let mut magic = [0u8; 2];
    let mut got = 0;
    while got < 2 {
        match file.read(&mut magic[got..]).map_err(io)? {
            0 => break,
            k => got += k,
        }
    }
    let head = std::io::Cursor::new(magic[..got].to_vec());
    Ok(if magic[..got] == [0x1f, 0x8b] {
        Box::new(GzDecoder::new(head.chain(file)).take(MAX_IDX_BYTES + 1))
    } else {
        Box::new(head.chain(file).take(MAX_IDX_BYTES + 1))
    })
}

/// Reads and checks an IDX header (unsigned bytes, 1 to 4 dims whose product is at most [`MAX_IDX_BYTES`]).
fn read_header(r: &mut impl Read, path: &Path) -> Result<Vec<usize>, DataError> {
    let bad = |reason: String| DataError::Format {
        path: path.to_path_buf(),
        reason,
    };
    let short = |e: std::io::Error| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            bad("too short for an IDX header".into())
        } else {
            DataError::Io {
                path: path.to_path_buf(),
                source: e,
            }
        }
    };
    let mut magic = [0u8; 4];
    r.read_exact(&mut magic).map_err(short)?;
    if magic[0] != 0 || magic[1] != 0 {
        return Err(bad(format!(
            "bad magic {:02x}{:02x}{:02x}{:02x} (not an IDX file)",
            magic[0], magic[1], magic[2], magic[3]
        )));
    }
    if magic[2] != 0x08 {
        return Err(bad(format!(
            "element type 0x{:02x} unsupported (only unsigned bytes, 0x08)",
            magic[2]
        )));
    }
    let ndims = usize::from(magic[3]);
    if !(1..=4).contains(&ndims) {
        return Err(bad(format!("{ndims} dimensions (expected 1 to 4)")));
    }
    let mut dims = Vec::with_capacity(ndims);
    for _ in 0..ndims {
        let mut d = [0u8; 4];
        r.read_exact(&mut d).map_err(short)?;
        dims.push(u32::from_be_bytes(d) as usize);
    }
    dims.iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64))
        .filter(|&t| t <= MAX_IDX_BYTES)
        .ok_or_else(|| bad(format!("absurd dimensions {dims:?}")))?;
    Ok(dims)
}

//! The IDX format of MNIST and Fashion-MNIST (raw or gzip, detected by magic bytes): `0x00 0x00 0x08 ndims`, then
//! `ndims` big-endian u32 dims, then unsigned bytes. Labels are `0x00000801` (n), images `0x00000803` (n × rows ×
//! cols; `0x00000802`, n × features, is accepted too). Pixels are scaled to [0, 1] by /255.
//!
//! Bounded: files are read with a size cap (gzip output included), dims are rejected when absurd and must account
//! for the file length exactly before anything is allocated from them.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use flate2::read::GzDecoder;

use super::{DataError, Dataset};

/// Largest (decompressed) IDX file accepted.
pub const MAX_IDX_BYTES: u64 = 1 << 30;

/// Most features per sample accepted from an IDX header.
const MAX_FEATURES: usize = 1 << 20;

/// The four files of an MNIST-style directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdxFiles {
    /// Training images.
    pub train_images: PathBuf,
    /// Training labels.
    pub train_labels: PathBuf,
    /// Test images.
    pub test_images: PathBuf,
    /// Test labels.
    pub test_labels: PathBuf,
}

impl IdxFiles {
    /// Finds `train-images-idx3-ubyte`, `train-labels-idx1-ubyte`, `t10k-images-idx3-ubyte` and
    /// `t10k-labels-idx1-ubyte` in `dir`, each raw or with `.gz` (raw preferred).
    pub fn find(dir: &Path) -> Result<IdxFiles, DataError> {
        if !dir.is_dir() {
            return Err(DataError::NotFound {
                path: dir.to_path_buf(),
                what: "no such directory".into(),
            });
        }
        let pick = |base: &str| -> Result<PathBuf, DataError> {
            [base.to_string(), format!("{base}.gz")]
                .iter()
                .map(|name| dir.join(name))
                .find(|p| p.is_file())
                .ok_or_else(|| DataError::NotFound {
                    path: dir.join(base),
                    what: format!("missing {base} (or {base}.gz)"),
                })
        };
        Ok(IdxFiles {
            train_images: pick("train-images-idx3-ubyte")?,
            train_labels: pick("train-labels-idx1-ubyte")?,
            test_images: pick("t10k-images-idx3-ubyte")?,
            test_labels: pick("t10k-labels-idx1-ubyte")?,
        })
    }
}

/// Loads `(train, test)` from an MNIST-style directory; both get `classes` = largest label seen + 1.
pub fn load_idx_dir(dir: &Path) -> Result<(Dataset, Dataset), DataError> {
    let files = IdxFiles::find(dir)?;
    let mut train = load_idx_pair(&files.train_images, &files.train_labels)?;
    let mut test = load_idx_pair(&files.test_images, &files.test_labels)?;
    if train.features != test.features {
        return Err(DataError::Format {
            path: files.test_images,
            reason: format!(
                "{} features per image but the training set has {}",
                test.features, train.features
            ),
        });
    }
    let classes = train.classes.max(test.classes);
    train.classes = classes;
    test.classes = classes;
    Ok((train, test))
}

/// Loads one images file and its labels file into a dataset (`classes` = largest label + 1).
pub fn load_idx_pair(images: &Path, labels: &Path) -> Result<Dataset, DataError> {
    let image_bytes = read_bounded(images)?;
    let (n, features, x) = parse_idx_images(&image_bytes, images)?;
    drop(image_bytes);
    let label_bytes = read_bounded(labels)?;
    let y = parse_idx_labels(&label_bytes, labels)?;
    if y.len() != n {
        return Err(DataError::Format {
            path: labels.to_path_buf(),
            reason: format!("{} labels for {n} images in {}", y.len(), images.display()),
        });
    }
    let classes = y.iter().map(|&l| l as usize + 1).max().unwrap_or(0);
    Ok(Dataset {
        features,
        classes,
        x,
        y,
    })
}

/// Reads a whole file, gunzipping when it starts with the gzip magic, refusing more than [`MAX_IDX_BYTES`].
pub(crate) fn read_bounded(path: &Path) -> Result<Vec<u8>, DataError> {
    let io = |source| DataError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut file = File::open(path).map_err(io)?;
    let mut magic = [0u8; 2];
    let got = read_up_to(&mut file, &mut magic).map_err(io)?;
    let prefix = &magic[..got];
    let mut out = Vec::new();
    if prefix == [0x1f, 0x8b] {
        let reader = std::io::Cursor::new(magic).chain(file);
        GzDecoder::new(reader)
            .take(MAX_IDX_BYTES + 1)
            .read_to_end(&mut out)
            .map_err(io)?;
    } else {
        out.extend_from_slice(prefix);
        file.take(MAX_IDX_BYTES + 1 - got as u64)
            .read_to_end(&mut out)
            .map_err(io)?;
    }
    if out.len() as u64 > MAX_IDX_BYTES {
        return Err(DataError::Format {
            path: path.to_path_buf(),
            reason: format!("larger than {MAX_IDX_BYTES} bytes"),
        });
    }
    Ok(out)
}

fn read_up_to(r: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// Parses the header, checks the dims against the length, returns (dims, payload).
fn parse_header<'a>(bytes: &'a [u8], path: &Path) -> Result<(Vec<usize>, &'a [u8]), DataError> {
    let bad = |reason: String| DataError::Format {
        path: path.to_path_buf(),
        reason,
    };
    if bytes.len() < 4 {
        return Err(bad(format!(
            "{} bytes: too short for an IDX header",
            bytes.len()
        )));
    }
    if bytes[0] != 0 || bytes[1] != 0 {
        return Err(bad(format!(
            "bad magic {:02x}{:02x}{:02x}{:02x} (not an IDX file)",
            bytes[0], bytes[1], bytes[2], bytes[3]
        )));
    }
    if bytes[2] != 0x08 {
        return Err(bad(format!(
            "element type 0x{:02x} unsupported (only unsigned bytes, 0x08)",
            bytes[2]
        )));
    }
    let ndims = usize::from(bytes[3]);
    if !(1..=4).contains(&ndims) {
        return Err(bad(format!("{ndims} dimensions (expected 1 to 4)")));
    }
    let header = 4 + 4 * ndims;
    if bytes.len() < header {
        return Err(bad(format!(
            "truncated header: {} bytes for {ndims} dimensions",
            bytes.len()
        )));
    }
    let dims: Vec<usize> = bytes[4..header]
        .chunks_exact(4)
        .map(|d| u32::from_be_bytes([d[0], d[1], d[2], d[3]]) as usize)
        .collect();
    let total = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64))
        .filter(|&t| t <= MAX_IDX_BYTES)
        .ok_or_else(|| bad(format!("absurd dimensions {dims:?}")))?;
    let payload = &bytes[header..];
    if payload.len() as u64 != total {
        return Err(bad(format!(
            "dimensions {dims:?} need {total} data bytes but the file has {} ({})",
            payload.len(),
            if (payload.len() as u64) < total {
                "truncated"
            } else {
                "trailing bytes"
            }
        )));
    }
    Ok((dims, payload))
}

/// Parses an IDX images file (3 dims n×rows×cols, or 2 dims n×features): `(n, features, pixels / 255)`.
pub fn parse_idx_images(bytes: &[u8], path: &Path) -> Result<(usize, usize, Vec<f32>), DataError> {
    let (dims, payload) = parse_header(bytes, path)?;
    if dims.len() != 2 && dims.len() != 3 {
        return Err(DataError::Format {
            path: path.to_path_buf(),
            reason: format!(
                "images need 2 or 3 dimensions (magic 0x00000803), got {} (is this a labels file?)",
                dims.len()
            ),
        });
    }
    let n = dims[0];
    let features: usize = dims[1..].iter().product();
    if n == 0 || features == 0 || features > MAX_FEATURES {
        return Err(DataError::Format {
            path: path.to_path_buf(),
            reason: format!("absurd dimensions {dims:?}"),
        });
    }
    // The payload length equals n × features (checked in parse_header), so this allocation is bounded by the file.
    let x = payload.iter().map(|&b| f32::from(b) / 255.0).collect();
    Ok((n, features, x))
}

/// Parses an IDX labels file (1 dim, magic 0x00000801).
pub fn parse_idx_labels(bytes: &[u8], path: &Path) -> Result<Vec<u32>, DataError> {
    let (dims, payload) = parse_header(bytes, path)?;
    if dims.len() != 1 {
        return Err(DataError::Format {
            path: path.to_path_buf(),
            reason: format!(
                "labels need 1 dimension (magic 0x00000801), got {} (is this an images file?)",
                dims.len()
            ),
        });
    }
    Ok(payload.iter().map(|&b| u32::from(b)).collect())
}

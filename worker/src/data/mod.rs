//! Training data: the in-memory [`Dataset`], the readers (IDX for MNIST-style sets, CSV, libsvm, the embedded
//! digits fallback), [`load`] dispatching on `[data]` of cluster.toml, [`load_configured`] with the fallbacks a
//! fresh machine needs, and the per-worker [`Partition`] with its allocation-free [`Batcher`].
//!
//! Invariants: a `Dataset` always holds `len() * features` features and `len()` labels, every label is
//! `< classes`; readers never panic on bad input and never allocate by an unchecked length field (IDX dims are
//! checked against the file length, gz input is read with a size cap, dense libsvm matrices are bounded before
//! allocation). Every error names the file and, for text formats, the line. Splits and shuffles are deterministic
//! functions of their seeds.

mod configured;
mod csv;
mod digits;
mod idx;
mod libsvm;
mod partition;
mod share;
mod test_set;
mod text;

use std::fmt;
use std::path::{Path, PathBuf};

use tether_common::config::{DataConfig, DatasetKind};

pub use self::configured::{load_configured, load_configured_share, WorkerData};
pub use self::csv::{load_csv, parse_csv};
pub use self::digits::{digits, digits_all, DIGITS_SAMPLES, DIGITS_TEST};
pub use self::idx::{load_idx_dir, load_idx_pair, parse_idx_images, parse_idx_labels, IdxFiles};
pub use self::libsvm::{load_libsvm, parse_libsvm};
pub use self::partition::{Batcher, Partition};
pub use self::share::{load_idx_dir_share, load_idx_pixels, load_idx_share, Share};
pub use self::test_set::{Pixels, TestSet};
pub use self::text::{
    kjv_excerpt, kjv_installed, read_text, split_windows, strip_verse_refs, windows, BIBLE_DATA,
    BIBLE_PROGRAM, MAX_VAL_WINDOWS,
};

/// Seed of the held-out split used when csv/libsvm data comes without a test file.
pub const SPLIT_SEED: u64 = 0x7e7e_5eed;

/// Most classes a dataset may have (labels are checked against it before anything is sized by them).
pub const MAX_CLASSES: usize = 1 << 16;

/// Errors loading or partitioning data; each names the file concerned.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// The dataset directory or one of its files does not exist.
    #[error("dataset not found: {path}: {what}")]
    NotFound {
        /// The missing path.
        path: PathBuf,
        /// What was looked for.
        what: String,
    },
    /// Reading (or decompressing) the file failed.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A binary file is malformed: bad magic, absurd or inconsistent dimensions, wrong length, bad label.
    #[error("malformed {path}: {reason}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A line of a text file (CSV, libsvm) is malformed.
    #[error("{path}:{line}: {reason}")]
    Line {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        reason: String,
    },
    /// A partition or batch request is inconsistent (e.g. rank ≥ workers).
    #[error("invalid partition: {reason}")]
    Partition {
        /// What is wrong.
        reason: String,
    },
}

/// A labelled dataset held in memory, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Dataset {
    /// Features per sample.
    pub features: usize,
    /// Number of classes; every label is below it.
    pub classes: usize,
    /// `len() × features` values, row-major, scaled to [0, 1] (images) or standardised (csv/libsvm via [`load`]).
    pub x: Vec<f32>,
    /// One label per sample.
    pub y: Vec<u32>,
}

impl Dataset {
    /// Number of samples.
    pub fn len(&self) -> usize {
        self.y.len()
    }

    /// Whether there are no samples.
    pub fn is_empty(&self) -> bool {
        self.y.is_empty()
    }

    /// The features of sample `i` (panics when `i ≥ len()`, like slice indexing).
    pub fn row(&self, i: usize) -> &[f32] {
        &self.x[i * self.features..(i + 1) * self.features]
    }

    /// A new dataset holding the samples at `indices`, in that order (panics on an index ≥ `len()`).
    pub fn subset(&self, indices: &[usize]) -> Dataset {
        let mut x = Vec::with_capacity(indices.len() * self.features);
        let mut y = Vec::with_capacity(indices.len());
        for &i in indices {
            x.extend_from_slice(self.row(i));
            y.push(self.y[i]);
        }
        Dataset {
            features: self.features,
            classes: self.classes,
            x,
            y,
        }
    }

    /// Samples per class (length `classes`).
    pub fn class_counts(&self) -> Vec<usize> {
        let mut counts = vec![0; self.classes];
        for &label in &self.y {
            if let Some(c) = counts.get_mut(label as usize) {
                *c += 1;
            }
        }
        counts
    }

    /// Splits off a seeded random `test_fraction` of the samples: `(train, test)`, each in ascending index order.
    /// The test part has at least one sample when `len() ≥ 2`.
    pub fn split(&self, test_fraction: f64, seed: u64) -> (Dataset, Dataset) {
        let n = self.len();
        let mut order: Vec<usize> = (0..n).collect();
        partition::shuffle(&mut order, seed);
        let mut n_test = ((n as f64) * test_fraction.clamp(0.0, 1.0)).round() as usize;
        if n >= 2 {
            n_test = n_test.clamp(1, n - 1);
        }
        let (test, train) = order.split_at_mut(n_test.min(n));
        test.sort_unstable();
        train.sort_unstable();
        (self.subset(train), self.subset(test))
    }
}

/// Per-feature standardisation `(x − mean) / std`, fitted on a training set and applied to any set.
#[derive(Debug, Clone, PartialEq)]
pub struct Standardizer {
    /// Mean of each feature.
    pub mean: Vec<f32>,
    /// 1 / standard deviation of each feature (1 for constant features).
    pub inv_std: Vec<f32>,
}

impl Standardizer {
    /// Fits the mean and standard deviation of every feature of `data`.
    pub fn fit(data: &Dataset) -> Self {
        let f = data.features;
        let n = data.len().max(1) as f64;
        let mut mean = vec![0f64; f];
        let mut sq = vec![0f64; f];
        for i in 0..data.len() {
            for (j, &v) in data.row(i).iter().enumerate() {
                mean[j] += f64::from(v);
            }
        }
        mean.iter_mut().for_each(|m| *m /= n);
        for i in 0..data.len() {
            for (j, &v) in data.row(i).iter().enumerate() {
                let d = f64::from(v) - mean[j];
                sq[j] += d * d;
            }
        }
        let inv_std = sq
            .iter()
            .map(|s| {
                let sd = (s / n).sqrt();
                if sd > 1e-12 {
                    (1.0 / sd) as f32
                } else {
                    1.0
                }
            })
            .collect();
        Standardizer {
            mean: mean.into_iter().map(|m| m as f32).collect(),
            inv_std,
        }
    }

    /// Standardises `data` in place (its feature count must match the fitted one).
    pub fn apply(&self, data: &mut Dataset) {
        let f = self.mean.len();
        if f == 0 || data.features != f {
            return;
        }
        for row in data.x.chunks_exact_mut(f) {
            for ((v, m), s) in row.iter_mut().zip(&self.mean).zip(&self.inv_std) {
                *v = (*v - m) * s;
            }
        }
    }
}

/// Where the loaded data came from (for logs and the run report).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DataSource {
    /// Fashion-MNIST from this directory.
    FashionMnist(PathBuf),
    /// The embedded scikit-learn digits set.
    Digits,
    /// An MNIST-style IDX directory.
    Idx(PathBuf),
    /// A CSV training file and optional test file (else a seeded 90/10 split).
    Csv {
        /// Training file.
        train: PathBuf,
        /// Test file, if given.
        test: Option<PathBuf>,
    },
    /// A libsvm training file and optional test file (else a seeded 90/10 split).
    Libsvm {
        /// Training file.
        train: PathBuf,
        /// Test file, if given.
        test: Option<PathBuf>,
    },
    /// The whole King James Bible from Debian's bible-kjv-text.
    Kjv,
    /// The embedded KJV excerpt (Genesis–Deuteronomy).
    KjvExcerpt,
    /// A text file.
    Text(PathBuf),
}

impl DataSource {
    /// The dataset name as written in cluster.toml and the run report.
    pub fn name(&self) -> &'static str {
        match self {
            DataSource::FashionMnist(_) => "fashion-mnist",
            DataSource::Digits => "digits",
            DataSource::Idx(_) => "idx",
            DataSource::Csv { .. } => "csv",
            DataSource::Libsvm { .. } => "libsvm",
            DataSource::Kjv => "kjv",
            DataSource::KjvExcerpt => "kjv-excerpt",
            DataSource::Text(_) => "text",
        }
    }
}

impl fmt::Display for DataSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DataSource::Kjv => {
                f.write_str("kjv (the King James Bible, Debian bible-kjv-text, 4.1 MB)")
            }
            DataSource::KjvExcerpt => {
                f.write_str("kjv-excerpt (embedded: Genesis–Deuteronomy of the KJV, 0.8 MB)")
            }
            DataSource::Text(p) | DataSource::FashionMnist(p) | DataSource::Idx(p) => {
                write!(f, "{} ({})", self.name(), p.display())
            }
            DataSource::Digits => {
                f.write_str("digits (embedded scikit-learn copy of UCI optical digits)")
            }
            DataSource::Csv { train, test } | DataSource::Libsvm { train, test } => {
                write!(f, "{} ({}", self.name(), train.display())?;
                match test {
                    Some(t) => write!(f, ", test {})", t.display()),
                    None => f.write_str(", 10% held out)"),
                }
            }
        }
    }
}

/// Loads the training and test sets named by `cfg`. Fashion-MNIST with a missing directory is
/// [`DataError::NotFound`] (the caller decides whether to fall back to [`digits`] and says so); csv/libsvm without
/// `test_path` hold out a seeded 10% and are standardised with the training set's statistics.
pub fn load(cfg: &DataConfig) -> Result<(Dataset, Dataset, DataSource), DataError> {
    match cfg.dataset {
        DatasetKind::FashionMnist => {
            let (mut train, mut test) = load_idx_dir(&cfg.path)?;
            for (set, name) in [(&train, "training"), (&test, "test")] {
                if set.features != 784 || set.classes > 10 {
                    return Err(DataError::Format {
                        path: cfg.path.clone(),
                        reason: format!(
                            "not Fashion-MNIST: {name} set has {} features and {} classes (want 784, 10)",
                            set.features, set.classes
                        ),
                    });
                }
            }
            train.classes = 10;
            test.classes = 10;
            Ok((train, test, DataSource::FashionMnist(cfg.path.clone())))
        }
        DatasetKind::Digits => {
            let (train, test) = digits()?;
            Ok((train, test, DataSource::Digits))
        }
        DatasetKind::Idx => {
            let (train, test) = load_idx_dir(&cfg.path)?;
            Ok((train, test, DataSource::Idx(cfg.path.clone())))
        }
        DatasetKind::Csv => {
            let train = load_csv(&cfg.path)?;
            let test = cfg.test_path.as_deref().map(load_csv).transpose()?;
            let (train, test) = finish_text(train, test, &cfg.path)?;
            let source = DataSource::Csv {
                train: cfg.path.clone(),
                test: cfg.test_path.clone(),
            };
            Ok((train, test, source))
        }
        DatasetKind::Libsvm => {
            let (train, test) = match cfg.test_path.as_deref() {
                None => (load_libsvm(&cfg.path, None)?, None),
                Some(test_path) => {
                    let (train, test) = libsvm::load_libsvm_pair(&cfg.path, test_path)?;
                    (train, Some(test))
                }
            };
            let (train, test) = finish_text(train, test, &cfg.path)?;
            let source = DataSource::Libsvm {
                train: cfg.path.clone(),
                test: cfg.test_path.clone(),
            };
            Ok((train, test, source))
        }
        DatasetKind::Kjv | DatasetKind::KjvExcerpt | DatasetKind::Text => {
            Err(DataError::Partition {
                reason: format!(
                    "{} is a text corpus: load it with load_text and a context length",
                    cfg.dataset
                ),
            })
        }
    }
}

/// `(train, validation, source)` windows of the configured text corpus for a language model with `context` tokens
/// (see [`split_windows`]); `kjv` falls back to the embedded excerpt only through [`load_configured`].
pub fn load_text(
    cfg: &DataConfig,
    context: usize,
) -> Result<(Dataset, Dataset, DataSource), DataError> {
    let (bytes, source, path) = match cfg.dataset {
        DatasetKind::Kjv => (kjv_installed()?, DataSource::Kjv, PathBuf::from(BIBLE_DATA)),
        DatasetKind::KjvExcerpt => (
            kjv_excerpt()?,
            DataSource::KjvExcerpt,
            PathBuf::from("<embedded kjv>"),
        ),
        DatasetKind::Text => (
            read_text(&cfg.path)?,
            DataSource::Text(cfg.path.clone()),
            cfg.path.clone(),
        ),
        other => {
            return Err(DataError::Partition {
                reason: format!("{other} is not a text corpus"),
            })
        }
    };
    let (train, val) = split_windows(&bytes, context, &path)?;
    Ok((train, val, source))
}

/// Splits (when no test set), reconciles class counts and standardises user-supplied text data.
fn finish_text(
    train: Dataset,
    test: Option<Dataset>,
    path: &Path,
) -> Result<(Dataset, Dataset), DataError> {
    let (mut train, mut test) = match test {
        Some(test) => (train, test),
        None => {
            if train.len() < 2 {
                return Err(DataError::Format {
                    path: path.to_path_buf(),
                    reason: format!(
                        "{} sample(s): need at least 2 to hold out a test set",
                        train.len()
                    ),
                });
            }
            train.split(0.1, SPLIT_SEED)
        }
    };
    if train.features != test.features {
        return Err(DataError::Format {
            path: path.to_path_buf(),
            reason: format!(
                "training set has {} features but the test set has {}",
                train.features, test.features
            ),
        });
    }
    let classes = train.classes.max(test.classes);
    train.classes = classes;
    test.classes = classes;
    let scaler = Standardizer::fit(&train);
    scaler.apply(&mut train);
    scaler.apply(&mut test);
    Ok((train, test))
}

/// Maps raw integer labels to `0..classes`: non-negative labels are kept; a set within {−1, +1} (binary libsvm)
/// becomes {0, 1}. `line_of(i)` names the line of sample `i` for errors.
pub(crate) fn normalize_labels(
    raw: &[i64],
    path: &Path,
    line_of: impl Fn(usize) -> usize,
) -> Result<(Vec<u32>, usize), DataError> {
    let binary_pm1 = raw.iter().any(|&l| l < 0) && raw.iter().all(|&l| l == -1 || l == 1);
    let mut labels = Vec::with_capacity(raw.len());
    let mut classes = 0usize;
    for (i, &l) in raw.iter().enumerate() {
        let mapped = if binary_pm1 { i64::from(l == 1) } else { l };
        if mapped < 0 || mapped >= MAX_CLASSES as i64 {
            return Err(DataError::Line {
                path: path.to_path_buf(),
                line: line_of(i),
                reason: format!(
                    "label {l} out of range (labels are 0..{MAX_CLASSES}, or -1/+1 for binary data)"
                ),
            });
        }
        // In range 0..MAX_CLASSES, checked just above.
        labels.push(mapped as u32);
        classes = classes.max(mapped as usize + 1);
    }
    Ok((labels, classes))
}

/// Parses a label token: an integer, optionally written as `+1` or `3.0`.
pub(crate) fn parse_label(tok: &str) -> Option<i64> {
    let tok = tok.trim();
    let tok = tok.strip_prefix('+').unwrap_or(tok);
    if let Ok(v) = tok.parse::<i64>() {
        return Some(v);
    }
    let v = tok.parse::<f64>().ok()?;
    (v.is_finite() && v.fract() == 0.0 && v.abs() < 1e15).then_some(v as i64)
}

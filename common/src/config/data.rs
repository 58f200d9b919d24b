//! `[data]`: where the training and test sets come from (dataset kind and paths). The default data directory can be
//! overridden by the environment ([`DATA_DIR_ENV`]) so tests run the same on machines without Fashion-MNIST.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Supported dataset sources.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum DatasetKind {
    /// Fashion-MNIST in IDX format (gz or raw), e.g. Debian's `dataset-fashion-mnist`.
    #[default]
    #[serde(rename = "fashion-mnist")]
    FashionMnist,
    /// The scikit-learn copy of UCI optical digits, embedded in the binary.
    #[serde(rename = "digits")]
    Digits,
    /// Any MNIST-style IDX directory.
    #[serde(rename = "idx")]
    Idx,
    /// CSV with the label in the first column.
    #[serde(rename = "csv")]
    Csv,
    /// libsvm / svmlight sparse text.
    #[serde(rename = "libsvm")]
    Libsvm,
    /// The King James Bible (public domain) from Debian's `bible-kjv-text`, decoded by its `bible` program; the
    /// embedded excerpt when the package is not installed. Byte-level language modelling (GPT).
    #[serde(rename = "kjv")]
    Kjv,
    /// Always the embedded KJV excerpt (the Pentateuch, ~0.9 MB), identical on every machine (tests).
    #[serde(rename = "kjv-excerpt")]
    KjvExcerpt,
    /// Any text file at `data.path`, byte-level (GPT).
    #[serde(rename = "text")]
    Text,
}

impl DatasetKind {
    /// Whether this is a byte-level text corpus (for language models) rather than labelled rows.
    pub fn is_text(self) -> bool {
        matches!(self, Self::Kjv | Self::KjvExcerpt | Self::Text)
    }
}

impl FromStr for DatasetKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "fashion-mnist" => Ok(Self::FashionMnist),
            "digits" => Ok(Self::Digits),
            "idx" => Ok(Self::Idx),
            "csv" => Ok(Self::Csv),
            "libsvm" => Ok(Self::Libsvm),
            "kjv" => Ok(Self::Kjv),
            "kjv-excerpt" => Ok(Self::KjvExcerpt),
            "text" => Ok(Self::Text),
            o => Err(format!(
                "unknown dataset {o:?} (fashion-mnist|digits|idx|csv|libsvm|kjv|kjv-excerpt|text)"
            )),
        }
    }
}

impl fmt::Display for DatasetKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::FashionMnist => "fashion-mnist",
            Self::Digits => "digits",
            Self::Idx => "idx",
            Self::Csv => "csv",
            Self::Libsvm => "libsvm",
            Self::Kjv => "kjv",
            Self::KjvExcerpt => "kjv-excerpt",
            Self::Text => "text",
        })
    }
}

/// `[data]`: where the training and test sets come from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataConfig {
    /// Dataset kind (default fashion-mnist).
    pub dataset: DatasetKind,
    /// Directory (IDX) or training file (csv/libsvm) (default [`default_data_dir`]:
    /// /usr/share/datasets/fashion-mnist unless `TETHER_DATA_DIR` is set).
    pub path: PathBuf,
    /// Test file for csv/libsvm (default: none; a held-out split of `path` is used).
    pub test_path: Option<PathBuf>,
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            dataset: DatasetKind::FashionMnist,
            path: default_data_dir(),
            test_path: None,
        }
    }
}

/// Environment variable that overrides the default data directory (CI points it at an empty folder to run the tests
/// as on a machine without Fashion-MNIST).
pub const DATA_DIR_ENV: &str = "TETHER_DATA_DIR";

/// The default `data.path`: `$TETHER_DATA_DIR` when set, else Debian's `/usr/share/datasets/fashion-mnist`.
pub fn default_data_dir() -> PathBuf {
    std::env::var_os(DATA_DIR_ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/share/datasets/fashion-mnist"))
}

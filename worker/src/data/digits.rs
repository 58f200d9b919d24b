//! The embedded fallback dataset: scikit-learn's copy of the UCI optical digits (1,797 8×8 images, pixel values
//! 0..16 scaled by /16, label 0..9 in the last column; BSD-3, see `worker/data/LICENSE-digits.txt`). It is compiled
//! into the binary so a cluster can train with no dataset installed. The train/test split (1,437 / 360) is a fixed
//! seeded shuffle, identical on every machine.

use std::io::Read;
use std::path::Path;

use flate2::read::GzDecoder;

use super::{DataError, Dataset};

/// The gzip'd CSV, exactly as shipped by scikit-learn.
static DIGITS_CSV_GZ: &[u8] = include_bytes!("../../data/digits.csv.gz");

/// Samples in the embedded set.
pub const DIGITS_SAMPLES: usize = 1797;

/// Samples held out as the test set.
pub const DIGITS_TEST: usize = 360;

/// Seed of the fixed train/test split.
const DIGITS_SPLIT_SEED: u64 = 0xd161_7500;

/// Largest decompressed size accepted (the real file is ~270 KB).
const MAX_CSV_BYTES: u64 = 4 << 20;

/// `(train, test)` of the embedded digits set: 1,437 / 360 samples, 64 features in [0, 1], 10 classes.
pub fn digits() -> Result<(Dataset, Dataset), DataError> {
    let all = digits_all()?;
    let (train, test) = all.split(DIGITS_TEST as f64 / all.len() as f64, DIGITS_SPLIT_SEED);
    Ok((train, test))
}

/// All 1,797 samples of the embedded digits set, in file order.
pub fn digits_all() -> Result<Dataset, DataError> {
    let path = Path::new("<embedded digits.csv.gz>");
    let mut text = String::new();
    GzDecoder::new(DIGITS_CSV_GZ)
        .take(MAX_CSV_BYTES)
        .read_to_string(&mut text)
        .map_err(|source| DataError::Io {
            path: path.to_path_buf(),
            source,
        })?;
    let bad = |line: usize, reason: String| DataError::Line {
        path: path.to_path_buf(),
        line,
        reason,
    };
    let mut x = Vec::with_capacity(DIGITS_SAMPLES * 64);
    let mut y = Vec::with_capacity(DIGITS_SAMPLES);
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let fields: Vec<&str> = line.trim().split(',').collect();
        if fields.len() != 65 {
            return Err(bad(i + 1, format!("{} columns, expected 65", fields.len())));
        }
        for f in &fields[..64] {
            let v: f32 = f
                .parse()
                .ok()
                .filter(|v: &f32| (0.0..=16.0).contains(v))
                .ok_or_else(|| bad(i + 1, format!("pixel {f:?} not in 0..16")))?;
            x.push(v / 16.0);
        }
        let label = fields[64]
            .parse::<u32>()
            .ok()
            .filter(|&l| l < 10)
            .ok_or_else(|| bad(i + 1, format!("label {:?} not in 0..10", fields[64])))?;
        y.push(label);
    }
    Ok(Dataset {
        features: 64,
        classes: 10,
        x,
        y,
    })
}

//! libsvm / svmlight text for users' own data: `label idx:val idx:val ... [# comment]`, 1-based feature indices,
//! `qid:` tokens ignored, labels non-negative integers (or −1/+1, mapped to 0/1). The feature count is the largest
//! index seen unless given. Rows are parsed sparse and densified only after `rows × features` is checked against a
//! bound. Values are returned as written; [`super::load`] standardises them.

use std::path::Path;

use super::{normalize_labels, parse_label, DataError, Dataset};

/// Largest feature index accepted.
const MAX_FEATURES: usize = 1 << 24;

/// Largest dense matrix (values) a libsvm file may expand to.
const MAX_DENSE: usize = 1 << 28;

/// A parsed file before densification.
struct Sparse {
    labels: Vec<i64>,
    lines: Vec<usize>,
    /// `row_start[i]..row_start[i + 1]` indexes `entries` for row i.
    row_start: Vec<usize>,
    /// (0-based feature index, value).
    entries: Vec<(u32, f32)>,
    max_index: usize,
}

/// Reads a libsvm file; `features` fixes the feature count (indices above it are an error), else the largest index.
pub fn load_libsvm(path: &Path, features: Option<usize>) -> Result<Dataset, DataError> {
    let text = read(path)?;
    parse_libsvm(&text, path, features)
}

/// Parses libsvm text; `path` names the source in errors.
pub fn parse_libsvm(
    text: &str,
    path: &Path,
    features: Option<usize>,
) -> Result<Dataset, DataError> {
    let sparse = parse_sparse(text, path, features)?;
    let f = features.unwrap_or(sparse.max_index);
    densify(&sparse, f, path)
}

/// Reads a training and a test file sharing one feature count (the larger of the two largest indices).
pub(crate) fn load_libsvm_pair(train: &Path, test: &Path) -> Result<(Dataset, Dataset), DataError> {
    let a = parse_sparse(&read(train)?, train, None)?;
    let b = parse_sparse(&read(test)?, test, None)?;
    let f = a.max_index.max(b.max_index);
    Ok((densify(&a, f, train)?, densify(&b, f, test)?))
}

fn read(path: &Path) -> Result<String, DataError> {
    std::fs::read_to_string(path).map_err(|source| DataError::Io {
        path: path.to_path_buf(),
        source,
    })
}

fn parse_sparse(text: &str, path: &Path, features: Option<usize>) -> Result<Sparse, DataError> {
    let err = |line: usize, reason: String| DataError::Line {
        path: path.to_path_buf(),
        line,
        reason,
    };
    let limit = features.unwrap_or(MAX_FEATURES).min(MAX_FEATURES);
    let mut s = Sparse {
        labels: Vec::new(),
        lines: Vec::new(),
        row_start: vec![0],
        entries: Vec::new(),
        max_index: 0,
    };
    for (i, line) in text.lines().enumerate() {
        let lineno = i + 1;
        let content = line.split('#').next().unwrap_or("").trim();
        if content.is_empty() {
            continue;
        }
        let mut tokens = content.split_whitespace();
        // `content` is non-empty after trimming, so it has a first token.
        let label_tok = tokens.next().unwrap_or("");
        let label = parse_label(label_tok)
            .ok_or_else(|| err(lineno, format!("label {label_tok:?} is not an integer")))?;
        for tok in tokens {
            let Some((idx, val)) = tok.split_once(':') else {
                return Err(err(lineno, format!("{tok:?} is not index:value")));
            };
            if idx == "qid" {
                continue;
            }
            let idx: usize = idx.parse().map_err(|_| {
                err(
                    lineno,
                    format!("feature index {idx:?} is not a positive integer"),
                )
            })?;
            if idx == 0 {
                return Err(err(lineno, "feature index 0 (indices are 1-based)".into()));
            }
            if idx > limit {
                return Err(err(
                    lineno,
                    format!("feature index {idx} exceeds the feature count {limit}"),
                ));
            }
            let val: f32 = match val.parse() {
                Ok(v) if f32::is_finite(v) => v,
                _ => {
                    return Err(err(
                        lineno,
                        format!("value {val:?} of feature {idx} is not a finite number"),
                    ))
                }
            };
            s.max_index = s.max_index.max(idx);
            // idx ≤ MAX_FEATURES < u32::MAX.
            s.entries.push(((idx - 1) as u32, val));
        }
        s.labels.push(label);
        s.lines.push(lineno);
        s.row_start.push(s.entries.len());
    }
    if s.labels.is_empty() {
        return Err(DataError::Format {
            path: path.to_path_buf(),
            reason: "no data rows".into(),
        });
    }
    Ok(s)
}

fn densify(s: &Sparse, features: usize, path: &Path) -> Result<Dataset, DataError> {
    let n = s.labels.len();
    let bad = |reason: String| DataError::Format {
        path: path.to_path_buf(),
        reason,
    };
    if features == 0 {
        return Err(bad("no features (every row is empty)".into()));
    }
    if features < s.max_index {
        return Err(bad(format!(
            "feature count {features} below the largest index {}",
            s.max_index
        )));
    }
    let total = n
        .checked_mul(features)
        .filter(|&t| t <= MAX_DENSE)
        .ok_or_else(|| {
            bad(format!(
                "{n} rows × {features} features exceeds {MAX_DENSE} dense values"
            ))
        })?;
    let (y, classes) = normalize_labels(&s.labels, path, |i| s.lines[i])?;
    let mut x = vec![0f32; total];
    for (row, span) in x.chunks_exact_mut(features).zip(s.row_start.windows(2)) {
        for &(j, v) in &s.entries[span[0]..span[1]] {
            row[j as usize] = v;
        }
    }
    Ok(Dataset {
        features,
        classes,
        x,
        y,
    })
}

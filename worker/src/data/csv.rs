//! CSV for users' own data: one sample per line, the integer label in the first column, numeric features after it,
//! comma-separated. A first line whose label field is not a number is a header and is skipped; blank lines and
//! lines starting with `#` are ignored. Every row must have the same number of columns and finite values. Values
//! are returned as written; [`super::load`] standardises them.

use std::path::Path;

use super::{normalize_labels, parse_label, DataError, Dataset};

/// Reads a CSV file (see the module docs for the format).
pub fn load_csv(path: &Path) -> Result<Dataset, DataError> {
    let text = std::fs::read_to_string(path).map_err(|source| DataError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    parse_csv(&text, path)
}

/// Parses CSV text; `path` names the source in errors.
pub fn parse_csv(text: &str, path: &Path) -> Result<Dataset, DataError> {
    let err = |line: usize, reason: String| DataError::Line {
        path: path.to_path_buf(),
        line,
        reason,
    };
    let mut features: Option<usize> = None;
    let mut x = Vec::new();
    let mut raw_labels = Vec::new();
    let mut lines = Vec::new();
    let mut first_content = true;
    for (i, line) in text.lines().enumerate() {
        let lineno = i + 1;
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut fields = line.split(',').map(str::trim);
        // split always yields at least one field.
        let label_field = fields.next().unwrap_or("");
        let is_first = std::mem::replace(&mut first_content, false);
        let label = match parse_label(label_field) {
            Some(l) => l,
            None if is_first => continue, // header line
            None => {
                return Err(err(
                    lineno,
                    format!("label {label_field:?} is not an integer"),
                ))
            }
        };
        let start = x.len();
        for (col, field) in fields.enumerate() {
            match field.parse::<f32>() {
                Ok(v) if v.is_finite() => x.push(v),
                _ => {
                    return Err(err(
                        lineno,
                        format!("column {}: {field:?} is not a finite number", col + 2),
                    ))
                }
            }
        }
        let got = x.len() - start;
        match features {
            None if got == 0 => {
                return Err(err(lineno, "no feature columns after the label".into()))
            }
            None => features = Some(got),
            Some(f) if f != got => {
                return Err(err(
                    lineno,
                    format!("{got} feature columns, but earlier rows have {f}"),
                ))
            }
            Some(_) => {}
        }
        raw_labels.push(label);
        lines.push(lineno);
    }
    let Some(features) = features else {
        return Err(DataError::Format {
            path: path.to_path_buf(),
            reason: "no data rows".into(),
        });
    };
    let (y, classes) = normalize_labels(&raw_labels, path, |i| lines[i])?;
    Ok(Dataset {
        features,
        classes,
        x,
        y,
    })
}

//! Byte-level text corpora for language models: the King James Bible decoded from Debian's `bible-kjv-text` by its
//! `bible` program, the embedded Pentateuch excerpt of it (public domain, `worker/data/LICENSE-kjv.txt`), or any file;
//! and [`windows`], which cuts a byte stream into a [`Dataset`] of context windows. Each sample is `context` byte
//! tokens (as f32 values 0..=255) and its label is the byte that follows, so a language model's targets are the row
//! shifted by one plus the label. The held-out split is the corpus's last 10 % (contiguous, never shuffled into the
//! training part). Corpora are read with a size cap and never panic on their bytes.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use flate2::read::GzDecoder;

use super::{DataError, Dataset};

/// The embedded excerpt: Genesis to Deuteronomy of the KJV, one verse per line (815,101 bytes, gzip'd).
static KJV_PENTATEUCH_GZ: &[u8] = include_bytes!("../../data/kjv-pentateuch.txt.gz");

/// The `bible` program of Debian's `bible-kjv` and the data file of `bible-kjv-text`.
pub const BIBLE_PROGRAM: &str = "/usr/bin/bible";
/// The data file the `bible` program decodes (`bible-kjv-text`).
pub const BIBLE_DATA: &str = "/usr/lib/bible.data";

/// Largest corpus read (bytes): far above the KJV's 4.1 MB, small enough to bound memory.
pub const MAX_TEXT_BYTES: u64 = 256 << 20;

/// Share of the corpus held out for validation (its tail).
pub const HELD_OUT: f64 = 0.1;

/// Most validation windows kept (the first ones of the held-out tail): 512 × 64 = 32,768 tokens at the default
/// context (a standard error of about 0.01 nats), cheap enough to evaluate often (0.9 s for the default GPT).
pub const MAX_VAL_WINDOWS: usize = 512;

/// The embedded KJV excerpt (Genesis–Deuteronomy).
pub fn kjv_excerpt() -> Result<Vec<u8>, DataError> {
    let mut out = Vec::new();
    GzDecoder::new(KJV_PENTATEUCH_GZ)
        .take(MAX_TEXT_BYTES)
        .read_to_end(&mut out)
        .map_err(|source| DataError::Io {
            path: PathBuf::from("<embedded kjv-pentateuch.txt.gz>"),
            source,
        })?;
    Ok(out)
}

/// The whole KJV from Debian's package, decoded by `bible` (verse references stripped, one verse per line);
/// `NotFound` when the package is not installed.
pub fn kjv_installed() -> Result<Vec<u8>, DataError> {
    for p in [BIBLE_PROGRAM, BIBLE_DATA] {
        if !Path::new(p).exists() {
            return Err(DataError::NotFound {
                path: PathBuf::from(p),
                what: "the KJV (apt-get install bible-kjv bible-kjv-text)".into(),
            });
        }
    }
    let out = Command::new(BIBLE_PROGRAM)
        .args(["-f", "Genesis1:1-Revelation22:21"])
        .env("COLUMNS", "100000")
        .output()
        .map_err(|source| DataError::Io {
            path: PathBuf::from(BIBLE_PROGRAM),
            source,
        })?;
    if !out.status.success()
        || out.stdout.len() < 1 << 20
        || out.stdout.len() as u64 > MAX_TEXT_BYTES
    {
        return Err(DataError::Format {
            path: PathBuf::from(BIBLE_PROGRAM),
            reason: format!(
                "bible exited with {} after {} bytes (want the whole text, over 1 MiB)",
                out.status,
                out.stdout.len()
            ),
        });
    }
    Ok(strip_verse_refs(&out.stdout))
}

/// Removes the leading verse reference (`Ge1:1 `, `1Cor13:4 `) of every line; other lines are kept as they are.
pub fn strip_verse_refs(text: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    for line in text.split_inclusive(|&b| b == b'\n') {
        out.extend_from_slice(verse_body(line));
    }
    out
}

/// The line without its `Book<chapter>:<verse> ` prefix, when it has one.
fn verse_body(line: &[u8]) -> &[u8] {
    let Some(sp) = line.iter().position(|&b| b == b' ') else {
        return line;
    };
    let head = &line[..sp];
    if head.len() < 4 {
        return line;
    }
    // A book abbreviation (an optional leading digit, then letters), then `<chapter>:<verse>`.
    let alpha_end = 1 + head[1..]
        .iter()
        .take_while(|b| b.is_ascii_alphabetic())
        .count();
    let rest = &head[alpha_end..];
    let is_ref = alpha_end >= 2
        && rest.iter().filter(|&&b| b == b':').count() == 1
        && rest.first().is_some_and(u8::is_ascii_digit)
        && rest.last().is_some_and(u8::is_ascii_digit)
        && rest.iter().all(|&b| b.is_ascii_digit() || b == b':');
    if is_ref {
        &line[sp + 1..]
    } else {
        line
    }
}

/// A text file, whole (up to [`MAX_TEXT_BYTES`]).
pub fn read_text(path: &Path) -> Result<Vec<u8>, DataError> {
    let file = std::fs::File::open(path).map_err(|source| match source.kind() {
        std::io::ErrorKind::NotFound => DataError::NotFound {
            path: path.to_path_buf(),
            what: "the text corpus".into(),
        },
        _ => DataError::Io {
            path: path.to_path_buf(),
            source,
        },
    })?;
    let mut out = Vec::new();
    file.take(MAX_TEXT_BYTES + 1)
        .read_to_end(&mut out)
        .map_err(|source| DataError::Io {
            path: path.to_path_buf(),
            source,
        })?;
    if out.len() as u64 > MAX_TEXT_BYTES {
        return Err(DataError::Format {
            path: path.to_path_buf(),
            reason: format!("larger than {MAX_TEXT_BYTES} bytes"),
        });
    }
    Ok(out)
}

/// Non-overlapping windows of `context` bytes (features, as f32) each labelled with the byte that follows:
/// `(len − 1) / context` samples, 256 classes.
pub fn windows(bytes: &[u8], context: usize) -> Dataset {
    let context = context.max(1);
    let n = bytes.len().saturating_sub(1) / context;
    let mut x = Vec::with_capacity(n * context);
    let mut y = Vec::with_capacity(n);
    for i in 0..n {
        let w = &bytes[i * context..(i + 1) * context + 1];
        x.extend(w[..context].iter().map(|&b| f32::from(b)));
        y.push(u32::from(w[context]));
    }
    Dataset {
        features: context,
        classes: 256,
        x,
        y,
    }
}

/// `(train, validation)` windows of a corpus: the first 90 % and (at most [`MAX_VAL_WINDOWS`] windows of) the last
/// 10 %. `path` names the corpus in errors.
pub fn split_windows(
    bytes: &[u8],
    context: usize,
    path: &Path,
) -> Result<(Dataset, Dataset), DataError> {
    let cut = ((bytes.len() as f64) * (1.0 - HELD_OUT)) as usize;
    let need = 2 * (context + 1);
    if cut < need || bytes.len() - cut < need {
        return Err(DataError::Format {
            path: path.to_path_buf(),
            reason: format!(
                "{} bytes: too short for a context of {context} and a 10 % held-out split",
                bytes.len()
            ),
        });
    }
    let train = windows(&bytes[..cut], context);
    let val_end = (cut + MAX_VAL_WINDOWS * context + 1).min(bytes.len());
    let val = windows(&bytes[cut..val_end], context);
    Ok((train, val))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verse_references_are_stripped_and_prose_is_kept() {
        let text = b"Ge1:1 In the beginning God created.\n1Cor13:4 Charity suffereth long.\nAnd so: 3:4 stays\nx\n";
        assert_eq!(
            strip_verse_refs(text),
            b"In the beginning God created.\nCharity suffereth long.\nAnd so: 3:4 stays\nx\n"
                .to_vec()
        );
    }

    #[test]
    fn windows_are_labelled_by_the_next_byte_and_the_split_is_a_contiguous_tail() {
        let bytes: Vec<u8> = (0..=255u8).cycle().take(1000).collect();
        let d = windows(&bytes, 8);
        assert_eq!((d.len(), d.features, d.classes), (124, 8, 256));
        assert_eq!(d.row(1), &[8., 9., 10., 11., 12., 13., 14., 15.]);
        assert_eq!(d.y[1], 16);
        let (train, val) = split_windows(&bytes, 8, Path::new("t")).unwrap();
        assert_eq!(train.len(), 899 / 8);
        // The validation set starts at byte 900 (= 900 mod 256 = 132).
        assert_eq!(val.row(0)[0], 132.0);
        assert!(split_windows(&bytes[..20], 8, Path::new("t")).is_err());
    }

    #[test]
    fn the_installed_kjv_decodes_to_the_whole_text_when_present() {
        match kjv_installed() {
            Ok(t) => {
                assert!(t.len() > 4_000_000, "{} bytes", t.len());
                assert!(t.starts_with(b"In the beginning God created the heaven and the earth.\n"));
                assert!(t.ends_with(b"Amen.\n"));
                // The excerpt is its beginning.
                assert!(t.starts_with(&kjv_excerpt().unwrap()));
            }
            Err(DataError::NotFound { .. }) => {
                eprintln!("bible-kjv-text not installed: nothing to check (CI installs it)")
            }
            Err(e) => panic!("installed but unreadable: {e}"),
        }
    }

    #[test]
    fn the_embedded_excerpt_is_the_pentateuch() {
        let t = kjv_excerpt().unwrap();
        assert_eq!(t.len(), 815_101);
        assert!(t.starts_with(b"In the beginning God created the heaven and the earth.\n"));
        assert!(t.iter().all(|&b| b == b'\n' || (32..127).contains(&b)));
    }
}

//! The held-out set a worker evaluates on, as it holds it: f32 rows ([`TestSet::Dense`]), or an IDX set's pixels
//! kept as bytes ([`TestSet::Pixels`], a quarter of the memory: Fashion-MNIST's test set is 7.8 MB instead of
//! 31 MB) and scaled by 1/255 one chunk at a time into the same f32 values the dense form holds. Evaluation walks
//! either in the same chunks, so its results are the same bits whichever form a worker holds.

use std::sync::Arc;

use super::Dataset;

/// IDX images kept as their bytes, with their labels.
#[derive(Debug, Clone, PartialEq)]
pub struct Pixels {
    /// Features per sample.
    pub features: usize,
    /// Number of classes; every label is below it.
    pub classes: usize,
    /// `len() × features` pixels, row-major; the feature value is `pixel / 255`.
    pub bytes: Vec<u8>,
    /// One label per sample.
    pub y: Vec<u32>,
}

impl Pixels {
    /// The dense form (every pixel scaled by 1/255, as the IDX reader does).
    pub fn to_dataset(&self) -> Dataset {
        Dataset {
            features: self.features,
            classes: self.classes,
            x: self.bytes.iter().map(|&b| f32::from(b) / 255.0).collect(),
            y: self.y.clone(),
        }
    }
}

/// A test set in one of its two forms; cheap to clone (shared).
#[derive(Debug, Clone, PartialEq)]
pub enum TestSet {
    /// f32 rows.
    Dense(Arc<Dataset>),
    /// IDX pixels, scaled a chunk at a time.
    Pixels(Arc<Pixels>),
}

impl From<Dataset> for TestSet {
    fn from(d: Dataset) -> TestSet {
        TestSet::Dense(Arc::new(d))
    }
}

impl TestSet {
    /// Number of samples.
    pub fn len(&self) -> usize {
        match self {
            TestSet::Dense(d) => d.len(),
            TestSet::Pixels(p) => p.y.len(),
        }
    }

    /// Whether there are no samples.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Features per sample.
    pub fn features(&self) -> usize {
        match self {
            TestSet::Dense(d) => d.features,
            TestSet::Pixels(p) => p.features,
        }
    }

    /// Number of classes.
    pub fn classes(&self) -> usize {
        match self {
            TestSet::Dense(d) => d.classes,
            TestSet::Pixels(p) => p.classes,
        }
    }

    /// Calls `f(x, y)` on consecutive chunks of `chunk` rows (at least 1; the last may be shorter), in order.
    pub fn for_each_chunk(&self, chunk: usize, mut f: impl FnMut(&[f32], &[u32])) {
        let chunk = chunk.max(1);
        match self {
            TestSet::Dense(d) => {
                for (xs, ys) in d.x.chunks(chunk * d.features.max(1)).zip(d.y.chunks(chunk)) {
                    f(xs, ys);
                }
            }
            TestSet::Pixels(p) => {
                let mut buf = Vec::with_capacity(chunk * p.features);
                for (bs, ys) in p
                    .bytes
                    .chunks(chunk * p.features.max(1))
                    .zip(p.y.chunks(chunk))
                {
                    buf.clear();
                    buf.extend(bs.iter().map(|&b| f32::from(b) / 255.0));
                    f(&buf, ys);
                }
            }
        }
    }
}

//! The data sets a run's configuration names, with the fallbacks a fresh machine needs: the embedded KJV excerpt
//! when the KJV is not installed, the embedded digits when Fashion-MNIST is missing. A fallback rewrites the
//! configuration to match what was loaded (the dataset, and the input width the model derives from it) and says so
//! in a note; any other error is returned as it is. A worker process loads only its share of an IDX training set
//! ([`load_configured_share`]).

use tether_common::config::{Config, DatasetKind};

use super::idx::{parse_idx_labels, read_bounded};
use super::{
    digits, load, load_idx_pixels, load_idx_share, load_text, DataError, Dataset, IdxFiles,
    Partition, TestSet,
};

/// Loads the configured training and test sets. When the configured Fashion-MNIST directory is missing, falls back
/// to the embedded digits set, switches `cfg.data.dataset` accordingly (the model's input width changes with it)
/// and returns a note saying so.
pub fn load_configured(cfg: &mut Config) -> Result<(Dataset, Dataset, Option<String>), DataError> {
    if cfg.data.dataset.is_text() {
        return match load_text(&cfg.data, cfg.model.context) {
            Ok((train, val, _)) => Ok((train, val, None)),
            Err(DataError::NotFound { path, .. }) if cfg.data.dataset == DatasetKind::Kjv => {
                let note = format!(
                    "the KJV is not installed ({} missing; apt-get install bible-kjv bible-kjv-text); training on \
                     the embedded excerpt (Genesis–Deuteronomy, 0.8 MB) instead",
                    path.display()
                );
                cfg.data.dataset = DatasetKind::KjvExcerpt;
                let (train, val, _) = load_text(&cfg.data, cfg.model.context)?;
                Ok((train, val, Some(note)))
            }
            Err(e) => Err(e),
        };
    }
    match load(&cfg.data) {
        Ok((train, test, _)) => Ok((train, test, None)),
        Err(DataError::NotFound { .. }) if cfg.data.dataset == DatasetKind::FashionMnist => {
            let note = format!(
                "Fashion-MNIST not found at {} (apt-get install dataset-fashion-mnist); training on the embedded \
                 scikit-learn digits set (1,797 samples) instead",
                cfg.data.path.display()
            );
            cfg.data.dataset = DatasetKind::Digits;
            cfg.model.features = None;
            let (train, test) = digits()?;
            Ok((train, test, Some(note)))
        }
        Err(e) => Err(e),
    }
}

/// What one worker process loads: its share of the training set (or the whole set when the format cannot be read by
/// share), the test set when it evaluates, and the fallback note.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerData {
    /// The training samples held: the share (in partition order) when `share` is set, else the whole set.
    pub train: Dataset,
    /// The partition over `train` when it holds only this worker's share; `None`: partition the whole set.
    pub share: Option<Partition>,
    /// The test set, loaded only for a worker that evaluates (an IDX set's as its pixel bytes).
    pub test: Option<TestSet>,
    /// Why the configured data set was replaced by a fallback, if it was.
    pub note: Option<String>,
}

/// As [`load_configured`], for the worker of `rank`: an IDX set (Fashion-MNIST, `idx`) is read by share
/// ([`super::load_idx_share`]: the rows of the partition `(rank, cluster.workers, train.seed)` only, streamed), and
/// the test set only when `evaluate`. Other formats are loaded whole, as before.
pub fn load_configured_share(
    cfg: &mut Config,
    rank: u32,
    evaluate: bool,
) -> Result<WorkerData, DataError> {
    let kind = cfg.data.dataset;
    if !matches!(kind, DatasetKind::FashionMnist | DatasetKind::Idx) {
        let (train, test, note) = load_configured(cfg)?;
        return Ok(WorkerData {
            train,
            share: None,
            test: evaluate.then(|| test.into()),
            note,
        });
    }
    let files = match IdxFiles::find(&cfg.data.path) {
        Ok(files) => files,
        Err(DataError::NotFound { .. }) if kind == DatasetKind::FashionMnist => {
            let (train, test, note) = load_configured(cfg)?;
            return Ok(WorkerData {
                train,
                share: None,
                test: evaluate.then(|| test.into()),
                note,
            });
        }
        Err(e) => return Err(e),
    };
    let share = load_idx_share(
        &files.train_images,
        &files.train_labels,
        rank,
        cfg.cluster.workers,
        cfg.train.seed,
    )?;
    let mut train = share.train;
    let test_labels = parse_idx_labels(&read_bounded(&files.test_labels)?, &files.test_labels)?;
    let test_classes = test_labels
        .iter()
        .map(|&l| l as usize + 1)
        .max()
        .unwrap_or(0);
    let test = if evaluate {
        let test = load_idx_pixels(&files.test_images, &files.test_labels)?;
        if test.features != train.features {
            return Err(DataError::Format {
                path: files.test_images,
                reason: format!(
                    "{} features per image but the training set has {}",
                    test.features, train.features
                ),
            });
        }
        Some(test)
    } else {
        None
    };
    let mut classes = train.classes.max(test_classes);
    if kind == DatasetKind::FashionMnist {
        if train.features != 784 || classes > 10 {
            return Err(DataError::Format {
                path: cfg.data.path.clone(),
                reason: format!(
                    "not Fashion-MNIST: {} features and {classes} classes (want 784, 10)",
                    train.features
                ),
            });
        }
        classes = 10;
    }
    train.classes = classes;
    let test = test.map(|mut t| {
        t.classes = classes;
        TestSet::Pixels(std::sync::Arc::new(t))
    });
    Ok(WorkerData {
        train,
        share: Some(share.partition),
        test,
        note: None,
    })
}

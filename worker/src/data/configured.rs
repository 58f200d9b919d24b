//! The data sets a run's configuration names, with the fallbacks a fresh machine needs: the embedded KJV excerpt
//! when the KJV is not installed, the embedded digits when Fashion-MNIST is missing. A fallback rewrites the
//! configuration to match what was loaded (the dataset, and the input width the model derives from it) and says so
//! in a note; any other error is returned as it is.

use tether_common::config::{Config, DatasetKind};

use super::{digits, load, load_text, DataError, Dataset};

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

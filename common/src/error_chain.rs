//! One-line rendering of an error with its causes, each cause once: what the binaries and examples print when they
//! fail.
//!
//! The rule: an error's `Display` is a complete message a user can act on, and often already ends with its cause
//! (`cannot read config cluster.toml: No such file or directory`); the cause is still its `source()`, so that
//! programs can inspect it. Printing the whole chain (anyhow's `{:#}`, or its `Caused by:` list) then repeats the
//! cause. [`ErrorChain`] walks the chain and appends a cause only when the text so far does not already say it.

use std::error::Error;
use std::fmt;

/// Displays an error and its chain of sources, each message once, joined by `: `.
#[derive(Debug, Clone, Copy)]
pub struct ErrorChain<'a>(pub &'a (dyn Error + 'static));

impl fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut shown = self.0.to_string();
        let mut cause = self.0.source();
        while let Some(e) = cause {
            let text = e.to_string();
            if !text.is_empty() && !shown.contains(&text) {
                shown.push_str(": ");
                shown.push_str(&text);
            }
            cause = e.source();
        }
        f.write_str(&shown)
    }
}

#[cfg(test)]
mod tests {
    use super::ErrorChain;

    #[derive(Debug, thiserror::Error)]
    #[error("outer says {inner}")]
    struct Repeats {
        #[source]
        inner: std::io::Error,
    }

    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Defers {
        #[source]
        inner: std::io::Error,
    }

    #[test]
    fn a_cause_already_in_the_message_is_not_repeated_and_one_that_is_not_is_appended() {
        let repeats = Repeats {
            inner: std::io::Error::other("disk on fire"),
        };
        assert_eq!(ErrorChain(&repeats).to_string(), "outer says disk on fire");
        let defers = Defers {
            inner: std::io::Error::other("disk on fire"),
        };
        assert_eq!(ErrorChain(&defers).to_string(), "outer: disk on fire");
    }

    #[test]
    fn a_missing_config_names_the_file_and_its_cause_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cluster.toml");
        let err = crate::config::Config::load(&path).unwrap_err();
        // As the binaries see it: through anyhow, which also walks the chain.
        let err = anyhow::Error::from(err);
        let text = ErrorChain(err.as_ref()).to_string();
        assert!(text.contains(&path.display().to_string()), "{text}");
        assert_eq!(text.matches("os error 2").count(), 1, "{text}");
        assert!(text.contains("No such file"), "{text}");
        // What anyhow alone prints repeats it: the reason this type exists.
        assert_eq!(format!("{err:#}").matches("os error 2").count(), 2);
    }
}

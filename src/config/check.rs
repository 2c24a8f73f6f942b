//! The config file's error type and the small value checks every section's
//! `validate` shares: one message style ("config key `k`: VALUE is out of
//! range; allowed A..=B") for every bound, so an operator reads the same
//! shape of message whichever key is wrong.

use std::fmt::Display;
use std::ops::RangeInclusive;
use std::path::PathBuf;

/// Errors of reading or checking a config file.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("config key `{key}`: {message}")]
    Invalid { key: String, message: String },
    /// A live reload refused for a reason beyond one key's value (a cut
    /// short file, a change outside `[speculative]`); the settings in force
    /// stay.
    #[error("config file {path} not reloaded: {reason}")]
    Reload { path: PathBuf, reason: String },
}

impl From<crate::router::config::RouterConfigError> for ConfigError {
    /// `[router]` checks itself without knowing this type (the router does
    /// not depend on the server's config); its error is one key's.
    fn from(e: crate::router::config::RouterConfigError) -> Self {
        let crate::router::config::RouterConfigError::Invalid { key, message } = e;
        ConfigError::Invalid { key, message }
    }
}

/// An [`ConfigError::Invalid`] for `key`.
pub(crate) fn invalid(key: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.to_string(),
        message: message.into(),
    }
}

/// `Ok` when `value` lies in `allowed`; otherwise an error naming the key,
/// the value and the range.
pub(crate) fn in_range<T: PartialOrd + Display>(
    key: &str,
    value: T,
    allowed: RangeInclusive<T>,
) -> Result<(), ConfigError> {
    if allowed.contains(&value) {
        return Ok(());
    }
    Err(invalid(
        key,
        format!(
            "{value} is out of range; allowed {}..={}",
            allowed.start(),
            allowed.end()
        ),
    ))
}

/// `Ok` for a non-empty text of at most `max` bytes without control
/// characters (and without whitespace when `spaces` is false).
pub(crate) fn text_ok(key: &str, value: &str, max: usize, spaces: bool) -> Result<(), ConfigError> {
    if value.is_empty() || value.len() > max {
        return Err(invalid(
            key,
            format!(
                "length {} is out of range; allowed 1..={max} bytes",
                value.len()
            ),
        ));
    }
    let bad = |c: char| c.is_control() || (!spaces && c.is_whitespace());
    if value.chars().any(bad) {
        return Err(invalid(
            key,
            if spaces {
                "must not contain control characters"
            } else {
                "must not contain whitespace or control characters"
            },
        ));
    }
    Ok(())
}

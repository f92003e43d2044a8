//! The window crate's error type.

use std::path::Path;

use signalweave_model::ErrorKind;

/// Errors from spec parsing, batch processing and state restore.
#[derive(Debug, thiserror::Error)]
#[error("{kind} error: {message}")]
pub struct WindowError {
    kind: ErrorKind,
    message: String,
}

/// Result with [`WindowError`].
pub type Result<T, E = WindowError> = std::result::Result<T, E>;

impl WindowError {
    /// A new error.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    /// A spec field is wrong: names the field.
    pub fn invalid_spec(field: &str, message: impl Into<String>) -> Self {
        Self::new(
            ErrorKind::Config,
            format!("job spec `{field}`: {}", message.into()),
        )
    }

    /// Adds the file the spec came from.
    pub fn in_file(self, path: &Path) -> Self {
        Self {
            kind: self.kind,
            message: format!("{}: {}", path.display(), self.message),
        }
    }

    /// Whose fault, and whether to retry.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The message.
    pub fn message(&self) -> &str {
        &self.message
    }
}

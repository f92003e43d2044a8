//! Errors of the runner, classified by [`ErrorKind`].

use signalweave_lake::LakeError;
use signalweave_model::ErrorKind;
use signalweave_window::WindowError;

/// A runner error: what failed, classified.
#[derive(Debug, thiserror::Error)]
#[error("{kind}: {message}")]
pub struct RunnerError {
    kind: ErrorKind,
    message: String,
}

/// Result of the runner.
pub type Result<T, E = RunnerError> = std::result::Result<T, E>;

impl RunnerError {
    /// An error of `kind`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    /// Its classification.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// What failed, without the kind.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Whether retrying can succeed.
    pub fn retryable(&self) -> bool {
        self.kind.retryable()
    }

    pub(crate) fn sql(context: &str, e: sqlx::Error) -> Self {
        let kind = match &e {
            sqlx::Error::RowNotFound => ErrorKind::NotFound,
            sqlx::Error::Database(d) if d.is_unique_violation() => ErrorKind::Conflict,
            sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed => {
                ErrorKind::Unavailable
            }
            _ => ErrorKind::Unavailable,
        };
        Self::new(kind, format!("{context}: {e}"))
    }
}

// The kind is said once: a runner error names it before the message.
impl From<LakeError> for RunnerError {
    fn from(e: LakeError) -> Self {
        Self::new(e.kind(), e.message())
    }
}

impl From<WindowError> for RunnerError {
    fn from(e: WindowError) -> Self {
        Self::new(e.kind(), e.message())
    }
}

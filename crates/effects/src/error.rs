//! Errors of the effect boundary, classified by [`ErrorKind`].

use signalweave_lake::LakeError;
use signalweave_model::ErrorKind;

/// An effects error: what failed, classified.
#[derive(Debug, thiserror::Error)]
#[error("{kind}: {message}")]
pub struct EffectError {
    kind: ErrorKind,
    message: String,
}

/// Result of the effect boundary.
pub type Result<T, E = EffectError> = std::result::Result<T, E>;

impl EffectError {
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

    pub(crate) fn sql(context: &str, e: sqlx::Error) -> Self {
        let kind = match &e {
            sqlx::Error::RowNotFound => ErrorKind::NotFound,
            sqlx::Error::Database(d) if d.is_unique_violation() => ErrorKind::Conflict,
            _ => ErrorKind::Unavailable,
        };
        Self::new(kind, format!("{context}: {e}"))
    }
}

impl From<LakeError> for EffectError {
    fn from(e: LakeError) -> Self {
        Self::new(e.kind(), e.to_string())
    }
}

impl From<signalweave_runner::RunnerError> for EffectError {
    fn from(e: signalweave_runner::RunnerError) -> Self {
        Self::new(e.kind(), e.to_string())
    }
}

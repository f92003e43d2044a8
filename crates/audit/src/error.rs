//! Errors of the audit, classified by [`ErrorKind`].

use signalweave_lake::LakeError;
use signalweave_model::ErrorKind;

/// An audit error: what failed, classified.
#[derive(Debug, thiserror::Error)]
#[error("{kind}: {message}")]
pub struct AuditError {
    kind: ErrorKind,
    message: String,
}

/// Result of the audit.
pub type Result<T, E = AuditError> = std::result::Result<T, E>;

impl AuditError {
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

    pub(crate) fn datafusion(context: &str, e: datafusion::error::DataFusionError) -> Self {
        Self::new(ErrorKind::Internal, format!("{context}: {e}"))
    }
}

impl From<LakeError> for AuditError {
    fn from(e: LakeError) -> Self {
        Self::new(e.kind(), e.to_string())
    }
}

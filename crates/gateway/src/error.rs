//! The gateway's error type: a kind from `signalweave-model` (whose fault, retryable or
//! not) and a message. Request-level refusals are [`crate::Refusal`]s, not errors.

use signalweave_model::ErrorKind;

/// Errors from starting or running the gateway.
#[derive(Debug, thiserror::Error)]
#[error("{kind} error: {message}")]
pub struct GatewayError {
    kind: ErrorKind,
    message: String,
}

/// Result with [`GatewayError`].
pub type Result<T, E = GatewayError> = std::result::Result<T, E>;

impl GatewayError {
    /// A new error of `kind`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    /// A configuration error.
    pub fn config(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Config, message)
    }

    /// Whose fault, and whether to retry.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }
}

impl From<signalweave_lake::LakeError> for GatewayError {
    fn from(e: signalweave_lake::LakeError) -> Self {
        Self::new(e.kind(), e.to_string())
    }
}

//! The lake's error type: one kind (from `signalweave-model`) saying whose fault it is
//! and whether a retry can help, plus a message and the underlying cause.

use signalweave_model::ErrorKind;

/// Errors from the lake.
#[derive(Debug, thiserror::Error)]
#[error("{kind} error: {message}")]
pub struct LakeError {
    kind: ErrorKind,
    message: String,
    #[source]
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

/// Result with [`LakeError`].
pub type Result<T, E = LakeError> = std::result::Result<T, E>;

impl LakeError {
    /// A new error of `kind`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            source: None,
        }
    }

    /// Attaches the underlying cause.
    pub fn with_source(mut self, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.source = Some(Box::new(source));
        self
    }

    /// Whose fault, and whether to retry.
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

    /// Wraps an iceberg error with context, classifying it.
    pub fn iceberg(context: impl Into<String>, e: iceberg::Error) -> Self {
        use iceberg::ErrorKind as K;
        let kind = match e.kind() {
            K::CatalogCommitConflicts => ErrorKind::Conflict,
            K::DataInvalid | K::PreconditionFailed => ErrorKind::InvalidInput,
            K::TableNotFound | K::NamespaceNotFound => ErrorKind::NotFound,
            K::TableAlreadyExists | K::NamespaceAlreadyExists => ErrorKind::Conflict,
            K::FeatureUnsupported => ErrorKind::Config,
            _ if e.retryable() => ErrorKind::Unavailable,
            // Storage and catalog IO failures surface as `Unexpected`: treat as unavailable.
            K::Unexpected => ErrorKind::Unavailable,
            _ => ErrorKind::Internal,
        };
        let context = context.into();
        Self::new(kind, format!("{context}: {e}")).with_source(e)
    }

    /// Wraps a DataFusion error with context.
    pub fn datafusion(context: impl Into<String>, e: datafusion::error::DataFusionError) -> Self {
        use datafusion::error::DataFusionError as D;
        // The kind of the innermost error: a plan error arrives wrapped in context.
        let kind = match e.find_root() {
            D::SQL(..) | D::Plan(_) | D::SchemaError(..) | D::NotImplemented(_) => {
                ErrorKind::InvalidInput
            }
            D::ObjectStore(_) | D::IoError(_) | D::External(_) => ErrorKind::Unavailable,
            _ => ErrorKind::Internal,
        };
        let context = context.into();
        Self::new(kind, format!("{context}: {e}")).with_source(e)
    }

    /// Wraps a catalog-database error with context.
    pub fn sql(context: impl Into<String>, e: sqlx::Error) -> Self {
        let kind = match &e {
            sqlx::Error::Configuration(_) => ErrorKind::Config,
            sqlx::Error::RowNotFound => ErrorKind::NotFound,
            _ => ErrorKind::Unavailable,
        };
        let context = context.into();
        Self::new(kind, format!("{context}: {e}")).with_source(e)
    }

    /// Wraps an Arrow error with context.
    pub fn arrow(context: impl Into<String>, e: arrow_schema::ArrowError) -> Self {
        let context = context.into();
        Self::new(ErrorKind::Internal, format!("{context}: {e}")).with_source(e)
    }
}

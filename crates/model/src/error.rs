//! Classified errors and rejection reasons.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Whose fault an error is, and whether a retry can help.
///
/// The gateway maps kinds to HTTP statuses; runners decide retries from
/// [`ErrorKind::retryable`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The caller sent something malformed or inconsistent. Never retryable.
    InvalidInput,
    /// A named thing (table, file, snapshot, schema) does not exist.
    NotFound,
    /// A declaration or configuration is wrong (for example incompatible schema versions).
    Config,
    /// An optimistic commit lost a race; retrying on the new base can succeed.
    Conflict,
    /// A dependency (object store, catalog database) is unavailable; retry later.
    Unavailable,
    /// A bug or an unexpected state. Not retryable.
    Internal,
}

impl ErrorKind {
    /// Whether retrying the same operation can succeed.
    pub fn retryable(self) -> bool {
        matches!(self, ErrorKind::Conflict | ErrorKind::Unavailable)
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            ErrorKind::InvalidInput => "invalid input",
            ErrorKind::NotFound => "not found",
            ErrorKind::Config => "configuration",
            ErrorKind::Conflict => "conflict",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::Internal => "internal",
        };
        f.write_str(s)
    }
}

/// The model crate's error.
#[derive(Debug, thiserror::Error)]
#[error("{kind} error: {message}")]
pub struct Error {
    kind: ErrorKind,
    message: String,
}

impl Error {
    /// A new error of `kind`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    /// Whose fault, and whether to retry.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The human-readable message.
    pub fn message(&self) -> &str {
        &self.message
    }
}

/// Result with the model [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Why a record or request was rejected. Stable, snake_case codes: they are stored in
/// `signalweave.rejections.reason_code` and returned by the gateway.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum ReasonCode {
    /// The record is not valid JSON (or not a JSON object).
    MalformedJson,
    /// The record is not valid UTF-8.
    InvalidUtf8,
    /// The record is larger than the per-event limit.
    EventTooLarge,
    /// `event_type` names no declared event type.
    UnknownEventType,
    /// `schema_version` is not a retained version of the type.
    UnknownSchemaVersion,
    /// A required envelope or payload field is absent or null.
    MissingField,
    /// A field has the wrong JSON type, or a number out of range.
    WrongType,
    /// The payload carries a field the schema does not declare.
    UnknownField,
    /// A value violates its unit (for example a fractional minor amount or a non-ISO-4217 currency).
    InvalidUnit,
    /// `event_id` is empty, too long, or has characters outside `[A-Za-z0-9._:-]`.
    InvalidEventId,
    /// `event_time` is not an RFC 3339 timestamp.
    InvalidTimestamp,
    /// `event_time` is further in the future than the allowed clock skew.
    FutureEventTime,
    /// The event's tenant differs from the authenticated tenant.
    TenantMismatch,
    /// The producer is not allowed to speak for the tenant.
    ProducerNotAllowed,
    /// The request carries no bearer token.
    MissingCredentials,
    /// The bearer token is not a known API key.
    InvalidCredentials,
    /// The request's content type is not JSON or NDJSON.
    UnsupportedMediaType,
    /// The request's content encoding is not identity, gzip or zstd.
    UnsupportedEncoding,
    /// The request body (compressed or decoded) is larger than the limit.
    BodyTooLarge,
    /// The request holds more events than the batch limit.
    BatchTooLarge,
    /// The body is not one JSON object, a JSON array of objects, or NDJSON, or does not
    /// decode in its declared content encoding.
    MalformedBody,
    /// The request body did not arrive within the gateway's body timeout.
    BodyTimeout,
    /// The event reuses the identity `(tenant, event_id)` of an event accepted within the
    /// dedup horizon, with other content: a retry must resend the same event.
    IdentityConflict,
}

impl ReasonCode {
    /// The stable code string.
    pub fn as_str(self) -> &'static str {
        match self {
            ReasonCode::MalformedJson => "malformed_json",
            ReasonCode::InvalidUtf8 => "invalid_utf8",
            ReasonCode::EventTooLarge => "event_too_large",
            ReasonCode::UnknownEventType => "unknown_event_type",
            ReasonCode::UnknownSchemaVersion => "unknown_schema_version",
            ReasonCode::MissingField => "missing_field",
            ReasonCode::WrongType => "wrong_type",
            ReasonCode::UnknownField => "unknown_field",
            ReasonCode::InvalidUnit => "invalid_unit",
            ReasonCode::InvalidEventId => "invalid_event_id",
            ReasonCode::InvalidTimestamp => "invalid_timestamp",
            ReasonCode::FutureEventTime => "future_event_time",
            ReasonCode::TenantMismatch => "tenant_mismatch",
            ReasonCode::ProducerNotAllowed => "producer_not_allowed",
            ReasonCode::MissingCredentials => "missing_credentials",
            ReasonCode::InvalidCredentials => "invalid_credentials",
            ReasonCode::UnsupportedMediaType => "unsupported_media_type",
            ReasonCode::UnsupportedEncoding => "unsupported_encoding",
            ReasonCode::BodyTooLarge => "body_too_large",
            ReasonCode::BatchTooLarge => "batch_too_large",
            ReasonCode::MalformedBody => "malformed_body",
            ReasonCode::BodyTimeout => "body_timeout",
            ReasonCode::IdentityConflict => "identity_conflict",
        }
    }
}

impl fmt::Display for ReasonCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A rejected record: the reason code and a detail naming the offending field.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rejection {
    /// The classified reason.
    pub reason: ReasonCode,
    /// What exactly was wrong, naming the field where there is one.
    pub detail: String,
}

impl Rejection {
    /// A rejection with `reason` and `detail`.
    pub fn new(reason: ReasonCode, detail: impl Into<String>) -> Self {
        Self {
            reason,
            detail: detail.into(),
        }
    }
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.reason, self.detail)
    }
}

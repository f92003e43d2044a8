//! # signalweave-model
//!
//! The vocabulary every SignalWeave role shares, and nothing else: the event
//! envelope (as typed Rust and as an Arrow schema), the schema registry of event
//! types declared in `catalog/events/`, newtypes for identities, time helpers, and
//! the classified error and rejection kinds.
//!
//! This crate does no IO apart from [`SchemaRegistry::load_dir`], which reads the
//! declarations it is pointed at; it has no async runtime. The gateway, `load`, the
//! window engine and the reports all validate and convert events through it, so
//! that an event means the same thing wherever it is read.

mod envelope;
mod error;
mod ids;
mod key;
mod registry;
mod time;

pub use envelope::{
    CONTENT_COLUMNS, EVENT_COLUMNS, Event, EventBatchBuilder, EventValidator, ValidationLimits,
    content_digests, events_arrow_schema,
};
pub use error::{Error, ErrorKind, ReasonCode, Rejection, Result};
pub use ids::{EventId, ProducerId, TenantId};
pub use key::{join_key, key_parts, split_key};
pub use registry::{
    Compatibility, EventTypeSchema, FieldDecl, FieldType, SchemaRegistry, SchemaVersion,
    check_compatibility,
};
pub use time::{format_rfc3339_micros, micros_to_datetime, parse_rfc3339_micros};

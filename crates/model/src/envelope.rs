//! The event envelope: typed Rust, its JSON wire form, validation, and its Arrow schema.
//!
//! Wire form (one JSON object per event):
//!
//! ```json
//! {"event_id": "e-1", "event_type": "order_placed", "schema_version": "1.0.0",
//!  "tenant": "acme", "producer_id": "shop-1", "producer_seq": 7,
//!  "event_time": "2026-01-01T00:00:00Z", "partition_key": "m-3",
//!  "order_id": "o-9", "customer_id": "c-4", "market_id": "m-3", "business_version": 1,
//!  "payload": {"amount_minor": 1250, "currency": "EUR"}}
//! ```
//!
//! `partition_key` defaults to `market_id`, then `customer_id`, then `order_id`;
//! `business_version` defaults to 1; `payload` fields are declared per event type in
//! the [`SchemaRegistry`]. `amount_minor` and `currency` land in typed columns; the
//! other payload fields land, canonically ordered, in the `attributes` JSON column.

use std::sync::{Arc, LazyLock};

use arrow_array::builder::{Int64Builder, StringBuilder, TimestampMicrosecondBuilder};
use arrow_array::cast::AsArray;
use arrow_array::types::{Int64Type, TimestampMicrosecondType};
use arrow_array::{Array, ArrayRef, RecordBatch, StringArray};
use arrow_schema::{DataType, Field, Schema, SchemaRef, TimeUnit};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use xxhash_rust::xxh3::Xxh3;

use crate::error::{Error, ErrorKind, ReasonCode, Rejection};
use crate::ids::{EventId, ProducerId, TenantId};
use crate::registry::{FieldType, SchemaRegistry, SchemaVersion, json_matches_type};
use crate::time::{format_rfc3339_micros, parse_rfc3339_micros};

/// An allocation's header and rounding, about, with glibc's allocator.
const ALLOCATION_OVERHEAD_BYTES: usize = 16;

/// One accepted event, as it lands in `signalweave.events`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// Producer-assigned identity; duplicates share `(tenant, event_id)`.
    pub event_id: EventId,
    /// Declared event type.
    pub event_type: String,
    /// Semantic version the producer wrote.
    pub schema_version: SchemaVersion,
    /// Owning tenant.
    pub tenant: TenantId,
    /// Sending producer.
    pub producer_id: ProducerId,
    /// The producer's sequence number for this event.
    pub producer_seq: i64,
    /// Event time, microseconds since the epoch (UTC).
    pub event_time_us: i64,
    /// Durable acceptance time stamped by the gateway or `load`, microseconds (UTC).
    pub ingest_time_us: i64,
    /// Key that routes the event to a source partition.
    pub partition_key: String,
    /// Business key: order.
    pub order_id: Option<String>,
    /// Business key: customer.
    pub customer_id: Option<String>,
    /// Business key: market.
    pub market_id: Option<String>,
    /// Version of the business entity this event describes (corrections bump it).
    pub business_version: i64,
    /// Amount in integer minor units of `currency`.
    pub amount_minor: Option<i64>,
    /// ISO 4217 currency code.
    pub currency: Option<String>,
    /// Other payload fields as canonical JSON, after the current reader's defaults.
    pub attributes: Option<String>,
}

impl Event {
    /// What one event held in memory costs beyond its strings' bytes, for memory budgets:
    /// the struct itself (a slot of a `Vec<Event>`) and, for each of its strings, an
    /// allocation's header and rounding (about 16 bytes with glibc's allocator). An
    /// estimate: a validated event may hold a little its wire form does not (a partition
    /// key copied from a business key, a reader's defaults in `attributes`).
    pub const MEMORY_OVERHEAD_BYTES: usize =
        std::mem::size_of::<Event>() + Self::STRINGS * ALLOCATION_OVERHEAD_BYTES;

    /// How many strings an event holds at most (each its own allocation).
    const STRINGS: usize = 10;

    /// The wire form of this event (what a producer sends).
    pub fn to_wire_json(&self) -> Value {
        let mut payload = match self
            .attributes
            .as_deref()
            .and_then(|a| serde_json::from_str::<Map<String, Value>>(a).ok())
        {
            Some(map) => map,
            None => Map::new(),
        };
        if let Some(a) = self.amount_minor {
            payload.insert("amount_minor".into(), a.into());
        }
        if let Some(c) = &self.currency {
            payload.insert("currency".into(), c.clone().into());
        }
        let mut obj = Map::new();
        obj.insert("event_id".into(), self.event_id.as_str().into());
        obj.insert("event_type".into(), self.event_type.clone().into());
        obj.insert(
            "schema_version".into(),
            self.schema_version.to_string().into(),
        );
        obj.insert("tenant".into(), self.tenant.as_str().into());
        obj.insert("producer_id".into(), self.producer_id.as_str().into());
        obj.insert("producer_seq".into(), self.producer_seq.into());
        obj.insert(
            "event_time".into(),
            format_rfc3339_micros(self.event_time_us).into(),
        );
        obj.insert("partition_key".into(), self.partition_key.clone().into());
        for (k, v) in [
            ("order_id", &self.order_id),
            ("customer_id", &self.customer_id),
            ("market_id", &self.market_id),
        ] {
            if let Some(v) = v {
                obj.insert(k.into(), v.clone().into());
            }
        }
        obj.insert("business_version".into(), self.business_version.into());
        obj.insert("payload".into(), Value::Object(payload));
        Value::Object(obj)
    }
}

/// What an event says, apart from who sent it and when it landed: the fields a retry of
/// the same event repeats. Two events with one identity `(tenant, event_id)` and different
/// content are two events, not a retry.
struct Content<'a> {
    event_type: &'a str,
    schema_version: &'a str,
    event_time_us: i64,
    partition_key: &'a str,
    order_id: Option<&'a str>,
    customer_id: Option<&'a str>,
    market_id: Option<&'a str>,
    business_version: i64,
    amount_minor: Option<i64>,
    currency: Option<&'a str>,
    attributes: Option<&'a str>,
}

impl Content<'_> {
    fn digest(&self) -> u64 {
        let mut h = Xxh3::new();
        let text = |h: &mut Xxh3, v: Option<&str>| match v {
            None => h.update(&[0]),
            Some(v) => {
                h.update(&[1]);
                h.update(&(v.len() as u64).to_le_bytes());
                h.update(v.as_bytes());
            }
        };
        let int = |h: &mut Xxh3, v: Option<i64>| match v {
            None => h.update(&[0]),
            Some(v) => {
                h.update(&[1]);
                h.update(&v.to_le_bytes());
            }
        };
        text(&mut h, Some(self.event_type));
        text(&mut h, Some(self.schema_version));
        int(&mut h, Some(self.event_time_us));
        text(&mut h, Some(self.partition_key));
        text(&mut h, self.order_id);
        text(&mut h, self.customer_id);
        text(&mut h, self.market_id);
        int(&mut h, Some(self.business_version));
        int(&mut h, self.amount_minor);
        text(&mut h, self.currency);
        text(&mut h, self.attributes);
        h.digest()
    }
}

impl Event {
    /// A 64-bit digest of what the event says: every field but its identity, its producer
    /// (`producer_id`, `producer_seq`) and its `ingest_time`. A retry of an event has the
    /// digest of the original; [`content_digests`] gives the same digests for landed rows.
    pub fn content_digest(&self) -> u64 {
        let version = self.schema_version.to_string();
        Content {
            event_type: &self.event_type,
            schema_version: &version,
            event_time_us: self.event_time_us,
            partition_key: &self.partition_key,
            order_id: self.order_id.as_deref(),
            customer_id: self.customer_id.as_deref(),
            market_id: self.market_id.as_deref(),
            business_version: self.business_version,
            amount_minor: self.amount_minor,
            currency: self.currency.as_deref(),
            attributes: self.attributes.as_deref(),
        }
        .digest()
    }
}

/// The columns [`content_digests`] reads.
pub const CONTENT_COLUMNS: [&str; 11] = [
    "event_type",
    "schema_version",
    "event_time",
    "partition_key",
    "order_id",
    "customer_id",
    "market_id",
    "business_version",
    "amount_minor",
    "currency",
    "attributes",
];

/// [`Event::content_digest`] of each row of a batch of `signalweave.events` that holds at
/// least the [`CONTENT_COLUMNS`].
pub fn content_digests(batch: &RecordBatch) -> crate::Result<Vec<u64>> {
    let column = |name: &str| {
        batch.column_by_name(name).ok_or_else(|| {
            Error::new(
                ErrorKind::Internal,
                format!("content digest: the batch lacks `{name}`"),
            )
        })
    };
    let wrong = |name: &str| {
        Error::new(
            ErrorKind::Internal,
            format!("content digest: `{name}` has an unexpected type"),
        )
    };
    let text =
        |name: &str| column(name).and_then(|c| c.as_string_opt::<i32>().ok_or_else(|| wrong(name)));
    let int = |name: &str| {
        column(name).and_then(|c| c.as_primitive_opt::<Int64Type>().ok_or_else(|| wrong(name)))
    };
    let event_time = column("event_time")?
        .as_primitive_opt::<TimestampMicrosecondType>()
        .ok_or_else(|| wrong("event_time"))?;
    let (event_type, schema_version, partition_key) = (
        text("event_type")?,
        text("schema_version")?,
        text("partition_key")?,
    );
    let (order_id, customer_id, market_id, currency, attributes) = (
        text("order_id")?,
        text("customer_id")?,
        text("market_id")?,
        text("currency")?,
        text("attributes")?,
    );
    let (business_version, amount_minor) = (int("business_version")?, int("amount_minor")?);
    fn opt_text(a: &StringArray, row: usize) -> Option<&str> {
        a.is_valid(row).then(|| a.value(row))
    }
    Ok((0..batch.num_rows())
        .map(|row| {
            Content {
                event_type: event_type.value(row),
                schema_version: schema_version.value(row),
                event_time_us: event_time.value(row),
                partition_key: partition_key.value(row),
                order_id: opt_text(order_id, row),
                customer_id: opt_text(customer_id, row),
                market_id: opt_text(market_id, row),
                business_version: business_version.value(row),
                amount_minor: amount_minor.is_valid(row).then(|| amount_minor.value(row)),
                currency: opt_text(currency, row),
                attributes: opt_text(attributes, row),
            }
            .digest()
        })
        .collect())
}

/// Columns of `signalweave.events`, in order, with their Iceberg field ids (1-based position).
pub const EVENT_COLUMNS: [&str; 16] = [
    "event_id",
    "event_type",
    "schema_version",
    "tenant",
    "producer_id",
    "producer_seq",
    "event_time",
    "ingest_time",
    "partition_key",
    "order_id",
    "customer_id",
    "market_id",
    "business_version",
    "amount_minor",
    "currency",
    "attributes",
];

/// Metadata key carrying the Iceberg/Parquet field id of an Arrow field.
pub const FIELD_ID_KEY: &str = "PARQUET:field_id";

fn field(id: usize, name: &str, data_type: DataType, nullable: bool) -> Field {
    Field::new(name, data_type, nullable).with_metadata(
        [(FIELD_ID_KEY.to_string(), id.to_string())]
            .into_iter()
            .collect(),
    )
}

fn ts() -> DataType {
    DataType::Timestamp(TimeUnit::Microsecond, Some("+00:00".into()))
}

static EVENTS_SCHEMA: LazyLock<SchemaRef> = LazyLock::new(|| {
    let nullable = |name: &str| {
        matches!(
            name,
            "order_id" | "customer_id" | "market_id" | "amount_minor" | "currency" | "attributes"
        )
    };
    let fields: Vec<Field> = EVENT_COLUMNS
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let dt = match *name {
                "producer_seq" | "business_version" | "amount_minor" => DataType::Int64,
                "event_time" | "ingest_time" => ts(),
                _ => DataType::Utf8,
            };
            field(i + 1, name, dt, nullable(name))
        })
        .collect();
    Arc::new(Schema::new(fields))
});

/// The Arrow schema of `signalweave.events` (field ids in `PARQUET:field_id` metadata).
pub fn events_arrow_schema() -> SchemaRef {
    Arc::clone(&EVENTS_SCHEMA)
}

/// Appends events column by column and finishes them as one [`RecordBatch`].
#[derive(Debug)]
pub struct EventBatchBuilder {
    event_id: StringBuilder,
    event_type: StringBuilder,
    schema_version: StringBuilder,
    tenant: StringBuilder,
    producer_id: StringBuilder,
    producer_seq: Int64Builder,
    event_time: TimestampMicrosecondBuilder,
    ingest_time: TimestampMicrosecondBuilder,
    partition_key: StringBuilder,
    order_id: StringBuilder,
    customer_id: StringBuilder,
    market_id: StringBuilder,
    business_version: Int64Builder,
    amount_minor: Int64Builder,
    currency: StringBuilder,
    attributes: StringBuilder,
    rows: usize,
}

impl Default for EventBatchBuilder {
    fn default() -> Self {
        Self::with_capacity(1024)
    }
}

impl EventBatchBuilder {
    /// A builder with room for `rows` events.
    pub fn with_capacity(rows: usize) -> Self {
        let s = || StringBuilder::with_capacity(rows, rows * 16);
        let ts = || TimestampMicrosecondBuilder::with_capacity(rows).with_timezone("+00:00");
        Self {
            event_id: s(),
            event_type: s(),
            schema_version: s(),
            tenant: s(),
            producer_id: s(),
            producer_seq: Int64Builder::with_capacity(rows),
            event_time: ts(),
            ingest_time: ts(),
            partition_key: s(),
            order_id: s(),
            customer_id: s(),
            market_id: s(),
            business_version: Int64Builder::with_capacity(rows),
            amount_minor: Int64Builder::with_capacity(rows),
            currency: s(),
            attributes: s(),
            rows: 0,
        }
    }

    /// Appends one event.
    pub fn push(&mut self, e: &Event) {
        self.event_id.append_value(e.event_id.as_str());
        self.event_type.append_value(&e.event_type);
        self.schema_version
            .append_value(e.schema_version.to_string());
        self.tenant.append_value(e.tenant.as_str());
        self.producer_id.append_value(e.producer_id.as_str());
        self.producer_seq.append_value(e.producer_seq);
        self.event_time.append_value(e.event_time_us);
        self.ingest_time.append_value(e.ingest_time_us);
        self.partition_key.append_value(&e.partition_key);
        self.order_id.append_option(e.order_id.as_deref());
        self.customer_id.append_option(e.customer_id.as_deref());
        self.market_id.append_option(e.market_id.as_deref());
        self.business_version.append_value(e.business_version);
        self.amount_minor.append_option(e.amount_minor);
        self.currency.append_option(e.currency.as_deref());
        self.attributes.append_option(e.attributes.as_deref());
        self.rows += 1;
    }

    /// Events appended since the last [`finish`](Self::finish).
    pub fn len(&self) -> usize {
        self.rows
    }

    /// Whether nothing was appended since the last finish.
    pub fn is_empty(&self) -> bool {
        self.rows == 0
    }

    /// The appended events as a batch with [`events_arrow_schema`]; the builder is reset.
    pub fn finish(&mut self) -> crate::Result<RecordBatch> {
        let columns: Vec<ArrayRef> = vec![
            Arc::new(self.event_id.finish()),
            Arc::new(self.event_type.finish()),
            Arc::new(self.schema_version.finish()),
            Arc::new(self.tenant.finish()),
            Arc::new(self.producer_id.finish()),
            Arc::new(self.producer_seq.finish()),
            Arc::new(self.event_time.finish()),
            Arc::new(self.ingest_time.finish()),
            Arc::new(self.partition_key.finish()),
            Arc::new(self.order_id.finish()),
            Arc::new(self.customer_id.finish()),
            Arc::new(self.market_id.finish()),
            Arc::new(self.business_version.finish()),
            Arc::new(self.amount_minor.finish()),
            Arc::new(self.currency.finish()),
            Arc::new(self.attributes.finish()),
        ];
        self.rows = 0;
        RecordBatch::try_new(events_arrow_schema(), columns)
            .map_err(|e| Error::new(ErrorKind::Internal, format!("event batch: {e}")))
    }
}

/// Limits applied by [`EventValidator`]; the defaults are the gateway's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidationLimits {
    /// Largest accepted serialized event, in bytes.
    pub max_event_bytes: usize,
    /// Longest accepted `event_id`, in bytes.
    pub max_event_id_len: usize,
    /// How far `event_time` may be ahead of the validator's clock, in microseconds.
    pub max_future_skew_us: i64,
}

impl ValidationLimits {
    /// Default largest event: 64 KiB.
    pub const DEFAULT_MAX_EVENT_BYTES: usize = 64 * 1024;
    /// Default longest event id: 128 bytes.
    pub const DEFAULT_MAX_EVENT_ID_LEN: usize = 128;
    /// Default future clock skew: 5 minutes.
    pub const DEFAULT_MAX_FUTURE_SKEW_US: i64 = 5 * 60 * 1_000_000;
}

impl Default for ValidationLimits {
    fn default() -> Self {
        Self {
            max_event_bytes: Self::DEFAULT_MAX_EVENT_BYTES,
            max_event_id_len: Self::DEFAULT_MAX_EVENT_ID_LEN,
            max_future_skew_us: Self::DEFAULT_MAX_FUTURE_SKEW_US,
        }
    }
}

/// Validates wire-form events against the registry; the one path used by `load` and the gateway.
#[derive(Debug, Clone)]
pub struct EventValidator {
    registry: Arc<SchemaRegistry>,
    limits: ValidationLimits,
}

fn reject(reason: ReasonCode, detail: impl Into<String>) -> Rejection {
    Rejection::new(reason, detail)
}

fn required_str<'a>(obj: &'a Map<String, Value>, name: &str) -> Result<&'a str, Rejection> {
    match obj.get(name) {
        None | Some(Value::Null) => Err(reject(
            ReasonCode::MissingField,
            format!("`{name}` is required"),
        )),
        Some(Value::String(s)) if s.is_empty() => Err(reject(
            ReasonCode::MissingField,
            format!("`{name}` is empty"),
        )),
        Some(Value::String(s)) => Ok(s),
        Some(other) => Err(reject(
            ReasonCode::WrongType,
            format!("`{name}` must be a string, got {}", json_kind(other)),
        )),
    }
}

fn optional_str(obj: &Map<String, Value>, name: &str) -> Result<Option<String>, Rejection> {
    match obj.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.is_empty() => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(reject(
            ReasonCode::WrongType,
            format!("`{name}` must be a string, got {}", json_kind(other)),
        )),
    }
}

fn optional_i64(obj: &Map<String, Value>, name: &str) -> Result<Option<i64>, Rejection> {
    match obj.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_i64().map(Some).ok_or_else(|| {
            reject(
                ReasonCode::WrongType,
                format!("`{name}` must be an integer in the i64 range, got {v}"),
            )
        }),
    }
}

/// A sequence or version number: never below zero.
fn non_negative(name: &str, v: i64) -> Result<(), Rejection> {
    if v < 0 {
        return Err(reject(
            ReasonCode::WrongType,
            format!("`{name}` must be 0 or more, got {v}"),
        ));
    }
    Ok(())
}

/// Parses JSON as `serde_json` does, except that an object naming a key twice is an
/// error: which of the two values counts is up to each parser, so two readers of one
/// event could disagree on its identity or its amount.
pub fn parse_unique_keys(text: &str) -> serde_json::Result<Value> {
    use serde::de::DeserializeSeed;
    let mut de = serde_json::Deserializer::from_str(text);
    let value = UniqueKeys.deserialize(&mut de)?;
    de.end()?;
    Ok(value)
}

/// See [`parse_unique_keys`].
struct UniqueKeys;

impl<'de> serde::de::DeserializeSeed<'de> for UniqueKeys {
    type Value = Value;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for UniqueKeys {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Value, E> {
        serde_json::Number::from_f64(v)
            .map(Value::Number)
            .ok_or_else(|| E::custom("a number that is not finite"))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::new();
        while let Some(v) = seq.next_element_seed(UniqueKeys)? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if out.contains_key(&key) {
                return Err(serde::de::Error::custom(format!(
                    "the key `{key}` appears twice in one object"
                )));
            }
            let value = map.next_value_seed(UniqueKeys)?;
            out.insert(key, value);
        }
        Ok(Value::Object(out))
    }
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

const ENVELOPE_FIELDS: [&str; 13] = [
    "event_id",
    "event_type",
    "schema_version",
    "tenant",
    "producer_id",
    "producer_seq",
    "event_time",
    "partition_key",
    "order_id",
    "customer_id",
    "market_id",
    "business_version",
    "payload",
];

impl EventValidator {
    /// A validator over `registry` with `limits`.
    pub fn new(registry: Arc<SchemaRegistry>, limits: ValidationLimits) -> Self {
        Self { registry, limits }
    }

    /// The registry events are checked against.
    pub fn registry(&self) -> &SchemaRegistry {
        &self.registry
    }

    /// Parses and validates one serialized event (one NDJSON line).
    ///
    /// `now_us` is the validator's clock, for the future-skew rule; `ingest_time_us` is
    /// stamped into the accepted event.
    pub fn validate_bytes(
        &self,
        bytes: &[u8],
        now_us: i64,
        ingest_time_us: i64,
    ) -> Result<Event, Rejection> {
        if bytes.len() > self.limits.max_event_bytes {
            return Err(reject(
                ReasonCode::EventTooLarge,
                format!(
                    "event is {} bytes; the limit is {}",
                    bytes.len(),
                    self.limits.max_event_bytes
                ),
            ));
        }
        let text = std::str::from_utf8(bytes).map_err(|e| {
            reject(
                ReasonCode::InvalidUtf8,
                format!("invalid UTF-8 at byte {}", e.valid_up_to()),
            )
        })?;
        let value = parse_unique_keys(text)
            .map_err(|e| reject(ReasonCode::MalformedJson, e.to_string()))?;
        self.validate_value(&value, now_us, ingest_time_us)
    }

    /// Validates one parsed event.
    pub fn validate_value(
        &self,
        value: &Value,
        now_us: i64,
        ingest_time_us: i64,
    ) -> Result<Event, Rejection> {
        let Value::Object(obj) = value else {
            return Err(reject(
                ReasonCode::MalformedJson,
                format!("an event must be a JSON object, got {}", json_kind(value)),
            ));
        };
        if let Some(extra) = obj.keys().find(|k| !ENVELOPE_FIELDS.contains(&k.as_str())) {
            return Err(reject(
                ReasonCode::UnknownField,
                format!("envelope field `{extra}` is not declared"),
            ));
        }
        let event_id = required_str(obj, "event_id")?;
        if event_id.len() > self.limits.max_event_id_len
            || !event_id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
        {
            return Err(reject(
                ReasonCode::InvalidEventId,
                format!(
                    "`event_id` must be 1..={} characters of [A-Za-z0-9._:-]",
                    self.limits.max_event_id_len
                ),
            ));
        }
        let event_type = required_str(obj, "event_type")?;
        if self.registry.versions(event_type).next().is_none() {
            return Err(reject(
                ReasonCode::UnknownEventType,
                format!("`{event_type}` is not a declared event type"),
            ));
        }
        let version: SchemaVersion = match obj.get("schema_version") {
            Some(Value::String(s)) => s.parse().map_err(|_| {
                reject(
                    ReasonCode::UnknownSchemaVersion,
                    format!("`schema_version` `{s}` is not a semantic version"),
                )
            })?,
            Some(Value::Number(n)) if n.as_u64().is_some_and(|n| n <= u32::MAX as u64) => {
                SchemaVersion::new(n.as_u64().unwrap_or_default() as u32, 0, 0)
            }
            None | Some(Value::Null) => {
                return Err(reject(
                    ReasonCode::MissingField,
                    "`schema_version` is required",
                ));
            }
            Some(other) => {
                return Err(reject(
                    ReasonCode::WrongType,
                    format!(
                        "`schema_version` must be a string, got {}",
                        json_kind(other)
                    ),
                ));
            }
        };
        let Some(writer) = self.registry.get(event_type, version) else {
            return Err(reject(
                ReasonCode::UnknownSchemaVersion,
                format!("{event_type} v{version} is not a retained version"),
            ));
        };
        let reader = self
            .registry
            .current(event_type, version.major)
            .unwrap_or(writer);
        let tenant = required_str(obj, "tenant")?;
        let producer_id = required_str(obj, "producer_id")?;
        let producer_seq = optional_i64(obj, "producer_seq")?
            .ok_or_else(|| reject(ReasonCode::MissingField, "`producer_seq` is required"))?;
        non_negative("producer_seq", producer_seq)?;
        let event_time_us = parse_rfc3339_micros(required_str(obj, "event_time")?)?;
        if event_time_us > now_us.saturating_add(self.limits.max_future_skew_us) {
            return Err(reject(
                ReasonCode::FutureEventTime,
                format!(
                    "`event_time` {} is more than {} s ahead of the gateway clock",
                    format_rfc3339_micros(event_time_us),
                    self.limits.max_future_skew_us / 1_000_000
                ),
            ));
        }
        let order_id = optional_str(obj, "order_id")?;
        let customer_id = optional_str(obj, "customer_id")?;
        let market_id = optional_str(obj, "market_id")?;
        for key in &writer.required_keys {
            let present = match key.as_str() {
                "order_id" => order_id.is_some(),
                "customer_id" => customer_id.is_some(),
                _ => market_id.is_some(),
            };
            if !present {
                return Err(reject(
                    ReasonCode::MissingField,
                    format!("`{key}` is required by {event_type} v{version}"),
                ));
            }
        }
        let partition_key = match optional_str(obj, "partition_key")? {
            Some(k) => k,
            None => market_id
                .clone()
                .or_else(|| customer_id.clone())
                .or_else(|| order_id.clone())
                .unwrap_or_else(|| event_id.to_owned()),
        };
        let business_version = optional_i64(obj, "business_version")?.unwrap_or(1);
        non_negative("business_version", business_version)?;

        let empty = Map::new();
        let payload = match obj.get("payload") {
            None | Some(Value::Null) => &empty,
            Some(Value::Object(p)) => p,
            Some(other) => {
                return Err(reject(
                    ReasonCode::WrongType,
                    format!("`payload` must be an object, got {}", json_kind(other)),
                ));
            }
        };
        let mut amount_minor = None;
        let mut currency = None;
        let mut attributes = Map::new();
        if let Some(unknown) = payload.keys().find(|k| writer.field(k).is_none()) {
            return Err(reject(
                ReasonCode::UnknownField,
                format!("payload field `{unknown}` is not declared by {event_type} v{version}"),
            ));
        }
        // First the writer's own schema: presence, type and unit of what it declares.
        for decl in &writer.fields {
            match payload.get(&decl.name) {
                None | Some(Value::Null) if decl.required => {
                    return Err(reject(
                        ReasonCode::MissingField,
                        format!("payload field `{}` is required", decl.name),
                    ));
                }
                None | Some(Value::Null) => {}
                Some(value) => {
                    if !json_matches_type(value, decl.field_type) {
                        return Err(reject(
                            ReasonCode::WrongType,
                            format!(
                                "payload field `{}` must be {}, got {value}",
                                decl.name, decl.field_type
                            ),
                        ));
                    }
                    check_unit(&decl.name, decl.unit.as_deref(), decl.field_type, value)?;
                }
            }
        }
        // Then the projection onto the current reader: reader fields, defaults filled in.
        for decl in &reader.fields {
            let value = match payload.get(&decl.name) {
                Some(v) if !v.is_null() => v.clone(),
                _ => match &decl.default {
                    Some(d) if !d.is_null() => d.clone(),
                    _ => continue,
                },
            };
            match decl.name.as_str() {
                "amount_minor" => amount_minor = value.as_i64(),
                "currency" => currency = value.as_str().map(str::to_owned),
                _ => {
                    attributes.insert(decl.name.clone(), value);
                }
            }
        }
        Ok(Event {
            event_id: EventId::new(event_id),
            event_type: event_type.to_owned(),
            schema_version: version,
            tenant: TenantId::new(tenant),
            producer_id: ProducerId::new(producer_id),
            producer_seq,
            event_time_us,
            ingest_time_us,
            partition_key,
            order_id,
            customer_id,
            market_id,
            business_version,
            amount_minor,
            currency,
            attributes: if attributes.is_empty() {
                None
            } else {
                Some(Value::Object(attributes).to_string())
            },
        })
    }
}

fn check_unit(
    name: &str,
    unit: Option<&str>,
    ty: FieldType,
    value: &Value,
) -> Result<(), Rejection> {
    match unit {
        Some("iso4217") => {
            let code = value.as_str().unwrap_or_default();
            if iso_currency::Currency::from_code(code).is_none() {
                return Err(reject(
                    ReasonCode::InvalidUnit,
                    format!("payload field `{name}`: `{code}` is not an ISO 4217 currency code"),
                ));
            }
        }
        Some("minor_units") if ty != FieldType::Int64 || value.as_i64().is_none() => {
            return Err(reject(
                ReasonCode::InvalidUnit,
                format!("payload field `{name}` is in integer minor units, got {value}"),
            ));
        }
        Some("rfc3339") | None if ty == FieldType::Timestamp => {
            parse_rfc3339_micros(value.as_str().unwrap_or_default())?;
        }
        _ => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bytes `e` holds in memory: its struct and its strings' allocations.
    fn memory_bytes(e: &Event) -> usize {
        let strings = [
            Some(e.event_id.as_str()),
            Some(e.event_type.as_str()),
            Some(e.tenant.as_str()),
            Some(e.producer_id.as_str()),
            Some(e.partition_key.as_str()),
            e.order_id.as_deref(),
            e.customer_id.as_deref(),
            e.market_id.as_deref(),
            e.currency.as_deref(),
            e.attributes.as_deref(),
        ];
        std::mem::size_of::<Event>()
            + strings
                .iter()
                .flatten()
                .filter(|s| !s.is_empty())
                .map(|s| s.len() + ALLOCATION_OVERHEAD_BYTES)
                .sum::<usize>()
    }

    /// An event's memory is at most its wire form's bytes plus the overhead memory budgets
    /// count per event: the gateway's estimate of a batch's copies never falls short.
    #[test]
    fn an_events_memory_is_within_its_wire_bytes_and_the_overhead() {
        let full = Event {
            event_id: EventId::new("ev-00000000000000000001"),
            event_type: "order_placed".into(),
            schema_version: SchemaVersion {
                major: 1,
                minor: 2,
                patch: 0,
            },
            tenant: TenantId::new("tenant-1"),
            producer_id: ProducerId::new("producer-1-0"),
            producer_seq: 7,
            event_time_us: 1_767_225_600_000_000,
            ingest_time_us: 1_767_225_600_000_000,
            partition_key: "m-1".into(),
            order_id: Some("o-1".into()),
            customer_id: Some("c-1".into()),
            market_id: Some("m-1".into()),
            business_version: 1,
            amount_minor: Some(1250),
            currency: Some("EUR".into()),
            attributes: Some(r#"{"channel":"web"}"#.into()),
        };
        let bare = Event {
            order_id: None,
            customer_id: None,
            market_id: None,
            currency: None,
            attributes: None,
            ..full.clone()
        };
        for e in [full, bare] {
            let wire = serde_json::to_vec(&e.to_wire_json()).expect("json").len();
            let memory = memory_bytes(&e);
            assert!(
                memory > wire / 2,
                "{memory} bytes counted for {wire} on the wire"
            );
            assert!(
                memory <= wire + Event::MEMORY_OVERHEAD_BYTES,
                "{memory} > {wire} + {}",
                Event::MEMORY_OVERHEAD_BYTES
            );
        }
    }
}

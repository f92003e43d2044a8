//! The shipped declarations in `catalog/events/`: they load, every retained version is
//! readable by its current reader, and validation classifies bad records.

#![allow(clippy::unwrap_used, clippy::type_complexity)]

use std::path::PathBuf;
use std::sync::Arc;

use serde_json::json;
use signalweave_model::{
    EventBatchBuilder, EventValidator, ReasonCode, SchemaRegistry, ValidationLimits,
    check_compatibility, content_digests, events_arrow_schema,
};

fn registry() -> SchemaRegistry {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../catalog/events");
    SchemaRegistry::load_dir(dir).expect("shipped catalog loads")
}

const NOW: i64 = 1_767_225_600_000_000; // 2026-01-01T00:00:00Z

fn base_event(version: &str) -> serde_json::Value {
    json!({
        "event_id": "e-1", "event_type": "order_placed", "schema_version": version,
        "tenant": "acme", "producer_id": "shop-1", "producer_seq": 1,
        "event_time": "2025-12-31T23:59:00Z",
        "order_id": "o-1", "customer_id": "c-1", "market_id": "m-1",
        "payload": {"amount_minor": 1250, "currency": "EUR"}
    })
}

#[test]
fn declares_the_four_event_types() {
    let r = registry();
    let types: Vec<_> = r.event_types().collect();
    assert_eq!(
        types,
        [
            "order_cancelled",
            "order_paid",
            "order_placed",
            "withdrawal_requested"
        ]
    );
}

#[test]
fn current_reader_reads_every_retained_version() {
    let r = registry();
    let validator = EventValidator::new(Arc::new(r.clone()), ValidationLimits::default());
    for event_type in r.event_types() {
        for writer in r.versions(event_type) {
            let reader = r.current(event_type, writer.version.major).unwrap();
            assert!(
                check_compatibility(writer, reader).is_compatible(),
                "{event_type} v{} unreadable by v{}",
                writer.version,
                reader.version
            );
            // A minimal event of the writer version validates and is projected onto the reader.
            let mut payload = serde_json::Map::new();
            for f in writer.fields.iter().filter(|f| f.required) {
                let v = match f.name.as_str() {
                    "currency" => json!("USD"),
                    _ => json!(10),
                };
                payload.insert(f.name.clone(), v);
            }
            let event = json!({
                "event_id": "e", "event_type": event_type,
                "schema_version": writer.version.to_string(),
                "tenant": "t", "producer_id": "p", "producer_seq": 0,
                "event_time": "2025-12-31T00:00:00Z",
                "order_id": "o", "customer_id": "c", "market_id": "m",
                "payload": payload,
            });
            let accepted = validator
                .validate_value(&event, NOW, NOW)
                .unwrap_or_else(|r| panic!("{event_type} v{}: {r}", writer.version));
            for f in reader.fields.iter().filter(|f| {
                writer.field(&f.name).is_none() && f.default.as_ref().is_some_and(|d| !d.is_null())
            }) {
                let attrs: serde_json::Value =
                    serde_json::from_str(accepted.attributes.as_deref().unwrap()).unwrap();
                assert_eq!(
                    attrs[&f.name],
                    f.default.clone().unwrap(),
                    "default of {}",
                    f.name
                );
            }
        }
    }
}

#[test]
fn v1_0_event_gets_the_v1_1_default() {
    let v = EventValidator::new(Arc::new(registry()), ValidationLimits::default());
    let e = v.validate_value(&base_event("1.0.0"), NOW, NOW).unwrap();
    assert_eq!(e.amount_minor, Some(1250));
    assert_eq!(e.currency.as_deref(), Some("EUR"));
    assert_eq!(e.attributes.as_deref(), Some(r#"{"channel":"web"}"#));
    assert_eq!(e.partition_key, "m-1");
    // The wire form of a current-version event round-trips.
    let current = v.validate_value(&base_event("1.1.0"), NOW, NOW).unwrap();
    let again = v.validate_value(&current.to_wire_json(), NOW, NOW).unwrap();
    assert_eq!(again, current);
}

#[test]
fn bad_records_are_classified() {
    let v = EventValidator::new(Arc::new(registry()), ValidationLimits::default());
    let cases: Vec<(Box<dyn Fn(&mut serde_json::Value)>, ReasonCode)> = vec![
        (
            Box::new(|e| e["event_type"] = json!("order_teleported")),
            ReasonCode::UnknownEventType,
        ),
        (
            Box::new(|e| e["schema_version"] = json!("9.0.0")),
            ReasonCode::UnknownSchemaVersion,
        ),
        (
            Box::new(|e| {
                e.as_object_mut().unwrap().remove("tenant");
            }),
            ReasonCode::MissingField,
        ),
        (
            Box::new(|e| e["payload"]["amount_minor"] = json!("12")),
            ReasonCode::WrongType,
        ),
        (
            Box::new(|e| e["payload"]["amount_minor"] = json!(12.5)),
            ReasonCode::WrongType,
        ),
        (
            Box::new(|e| e["payload"]["amount_minor"] = json!(1e300)),
            ReasonCode::WrongType,
        ),
        (
            Box::new(|e| e["payload"]["currency"] = json!("EURO")),
            ReasonCode::InvalidUnit,
        ),
        (
            Box::new(|e| e["payload"]["coupon"] = json!("X")),
            ReasonCode::UnknownField,
        ),
        (
            Box::new(|e| e["payload"]["channel"] = json!("app")),
            ReasonCode::UnknownField,
        ),
        (
            Box::new(|e| e["event_id"] = json!("has space")),
            ReasonCode::InvalidEventId,
        ),
        (
            Box::new(|e| e["event_time"] = json!("2026-13-01")),
            ReasonCode::InvalidTimestamp,
        ),
        (
            Box::new(|e| e["event_time"] = json!("2026-01-01T01:00:00Z")),
            ReasonCode::FutureEventTime,
        ),
        (
            Box::new(|e| {
                e.as_object_mut().unwrap().remove("market_id");
            }),
            ReasonCode::MissingField,
        ),
        (
            Box::new(|e| e["payload"] = json!([1, 2])),
            ReasonCode::WrongType,
        ),
        (
            Box::new(|e| e["surprise"] = json!(1)),
            ReasonCode::UnknownField,
        ),
        (
            Box::new(|e| e["producer_seq"] = json!(-1)),
            ReasonCode::WrongType,
        ),
        (
            Box::new(|e| e["business_version"] = json!(-1)),
            ReasonCode::WrongType,
        ),
    ];
    for (i, (mutate, expected)) in cases.into_iter().enumerate() {
        let mut e = base_event("1.0.0");
        mutate(&mut e);
        let got = v.validate_value(&e, NOW, NOW).unwrap_err();
        assert_eq!(got.reason, expected, "case {i}: {got}");
    }
    for (bytes, expected) in [
        (&b"{not json"[..], ReasonCode::MalformedJson),
        (&b"\xff\xfe"[..], ReasonCode::InvalidUtf8),
        (&b"[1]"[..], ReasonCode::MalformedJson),
    ] {
        assert_eq!(
            v.validate_bytes(bytes, NOW, NOW).unwrap_err().reason,
            expected
        );
    }
    // A key named twice, in the envelope or in the payload, is ambiguous: refused.
    let good = base_event("1.0.0").to_string();
    assert!(v.validate_bytes(good.as_bytes(), NOW, NOW).is_ok());
    let id = base_event("1.0.0")["event_id"].to_string();
    for twice in [
        good.replacen('{', &format!("{{\"event_id\":{id},"), 1),
        good.replacen("\"amount_minor\"", "\"amount_minor\":1,\"amount_minor\"", 1),
    ] {
        let got = v.validate_bytes(twice.as_bytes(), NOW, NOW).unwrap_err();
        assert_eq!(got.reason, ReasonCode::MalformedJson, "{twice}: {got}");
        assert!(got.detail.contains("appears twice"), "{got}");
    }
    let deep = "[".repeat(10_000);
    assert_eq!(
        v.validate_bytes(deep.as_bytes(), NOW, NOW)
            .unwrap_err()
            .reason,
        ReasonCode::MalformedJson
    );
    let big = vec![b' '; ValidationLimits::DEFAULT_MAX_EVENT_BYTES + 1];
    assert_eq!(
        v.validate_bytes(&big, NOW, NOW).unwrap_err().reason,
        ReasonCode::EventTooLarge
    );
}

#[test]
fn batches_carry_field_ids() {
    let v = EventValidator::new(Arc::new(registry()), ValidationLimits::default());
    let e = v.validate_value(&base_event("1.1.0"), NOW, NOW).unwrap();
    let mut b = EventBatchBuilder::with_capacity(2);
    b.push(&e);
    b.push(&e);
    let batch = b.finish().unwrap();
    assert_eq!(batch.num_rows(), 2);
    assert_eq!(batch.schema(), events_arrow_schema());
    for (i, f) in batch.schema().fields().iter().enumerate() {
        assert_eq!(f.metadata()["PARQUET:field_id"], (i + 1).to_string());
    }
    assert!(b.is_empty());
}

#[test]
fn a_retry_has_the_content_digest_of_its_original_and_a_changed_event_does_not() {
    let v = EventValidator::new(Arc::new(registry()), ValidationLimits::default());
    let original = v.validate_value(&base_event("1.1.0"), NOW, NOW).unwrap();
    // A retry: another ingest time, and a producer that numbers it anew.
    let mut retry_wire = base_event("1.1.0");
    retry_wire["producer_seq"] = json!(99);
    let retry = v.validate_value(&retry_wire, NOW, NOW + 5_000_000).unwrap();
    assert_eq!(original.content_digest(), retry.content_digest());

    let changes: [(&str, serde_json::Value); 5] = [
        ("event_time", json!("2025-12-31T23:59:01Z")),
        ("market_id", json!("m-2")),
        ("business_version", json!(2)),
        ("payload", json!({"amount_minor": 1251, "currency": "EUR"})),
        ("payload", json!({"amount_minor": 1250, "currency": "USD"})),
    ];
    let mut changed = Vec::new();
    for (field, value) in changes {
        let mut wire = base_event("1.1.0");
        wire[field] = value;
        let e = v.validate_value(&wire, NOW, NOW).unwrap();
        assert_ne!(e.content_digest(), original.content_digest(), "{field}");
        changed.push(e);
    }
    // An absent optional field differs from an empty one.
    let mut no_order = original.clone();
    no_order.order_id = None;
    let mut empty_order = original.clone();
    empty_order.order_id = Some(String::new());
    assert_ne!(no_order.content_digest(), empty_order.content_digest());

    // Landed rows give the digests their events gave.
    let mut b = EventBatchBuilder::with_capacity(8);
    let all: Vec<_> = [&original, &retry, &no_order, &empty_order]
        .into_iter()
        .chain(&changed)
        .collect();
    for e in &all {
        b.push(e);
    }
    let batch = b.finish().unwrap();
    let expected: Vec<u64> = all.iter().map(|e| e.content_digest()).collect();
    assert_eq!(content_digests(&batch).unwrap(), expected);
    let projected = batch.project(&[0, 3]).unwrap();
    assert!(content_digests(&projected).is_err());
}

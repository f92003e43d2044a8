//! Time conversions: RFC 3339 in JSON, microseconds since the epoch (UTC) in the lake.

use chrono::{DateTime, SecondsFormat, Utc};

use crate::error::{ReasonCode, Rejection};

/// Parses an RFC 3339 timestamp into microseconds since the Unix epoch (UTC).
pub fn parse_rfc3339_micros(value: &str) -> Result<i64, Rejection> {
    let parsed = DateTime::parse_from_rfc3339(value).map_err(|e| {
        Rejection::new(
            ReasonCode::InvalidTimestamp,
            format!("`{value}` is not an RFC 3339 timestamp: {e}"),
        )
    })?;
    Ok(parsed.with_timezone(&Utc).timestamp_micros())
}

/// Microseconds since the epoch as a UTC date-time, or `None` when out of range.
pub fn micros_to_datetime(micros: i64) -> Option<DateTime<Utc>> {
    DateTime::<Utc>::from_timestamp_micros(micros)
}

/// Formats microseconds since the epoch as RFC 3339 with microsecond precision and `Z`.
pub fn format_rfc3339_micros(micros: i64) -> String {
    match micros_to_datetime(micros) {
        Some(t) => t.to_rfc3339_opts(SecondsFormat::Micros, true),
        None => format!("<out of range: {micros} µs>"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_microseconds() {
        let micros = parse_rfc3339_micros("2026-01-02T03:04:05.123456+01:00").unwrap();
        assert_eq!(format_rfc3339_micros(micros), "2026-01-02T02:04:05.123456Z");
    }

    #[test]
    fn rejects_garbage() {
        let err = parse_rfc3339_micros("yesterday").unwrap_err();
        assert_eq!(err.reason, ReasonCode::InvalidTimestamp);
    }
}

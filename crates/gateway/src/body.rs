//! Request bodies: content encodings (identity, gzip, zstd) decoded within a limit, and
//! the three accepted shapes split into one byte slice per event.

use std::io::Read;

use serde_json::value::RawValue;
use signalweave_model::{ReasonCode, Rejection};

/// How the events of a body are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyFormat {
    /// `application/json`: one event object, or an array of them.
    Json,
    /// `application/x-ndjson` (or `application/jsonl`): one event per line.
    Ndjson,
    /// `application/json-seq` (RFC 7464): each event after a record separator (0x1E).
    JsonSeq,
}

/// The body format named by a `Content-Type` header.
pub fn body_format(content_type: Option<&str>) -> Result<BodyFormat, Rejection> {
    let Some(ct) = content_type else {
        return Err(Rejection::new(
            ReasonCode::UnsupportedMediaType,
            "Content-Type is required: application/json, application/x-ndjson or \
             application/json-seq",
        ));
    };
    let essence = ct.split(';').next().unwrap_or_default().trim();
    match essence.to_ascii_lowercase().as_str() {
        "application/json" => Ok(BodyFormat::Json),
        "application/x-ndjson" | "application/ndjson" | "application/jsonl" => {
            Ok(BodyFormat::Ndjson)
        }
        "application/json-seq" => Ok(BodyFormat::JsonSeq),
        other => Err(Rejection::new(
            ReasonCode::UnsupportedMediaType,
            format!(
                "Content-Type `{other}` is not application/json, application/x-ndjson or \
                 application/json-seq"
            ),
        )),
    }
}

fn too_large(limit: usize) -> Rejection {
    Rejection::new(
        ReasonCode::BodyTooLarge,
        format!("the decoded body exceeds {limit} bytes"),
    )
}

/// Why a body was not decoded.
#[derive(Debug, Clone, PartialEq)]
pub enum Undecoded {
    /// The body itself is at fault (malformed, too large, an unknown encoding).
    Rejected(Rejection),
    /// The memory for the decoded bytes was not granted: the gateway holds too many
    /// bodies at once. Nothing is wrong with this one.
    NoRoom,
}

impl From<Rejection> for Undecoded {
    fn from(r: Rejection) -> Self {
        Self::Rejected(r)
    }
}

/// Bytes a decoder reads at a time.
const DECODE_CHUNK: usize = 64 * 1024;

/// The largest zstd window a body may use, log 2: 8 MiB, what the zstd levels up to 19
/// use (the decoder's default limit, 128 MiB, would let each request allocate that much).
pub const ZSTD_WINDOW_LOG_MAX: u32 = 23;

/// The memory a decoder of `body` holds besides the decoded bytes: a zstd decoder's
/// window (the largest any frame of the body declares, [`ZSTD_WINDOW_LOG_MAX`] at most,
/// and that much when a header cannot be read: the decoding then fails anyway), gzip's
/// 32 KiB, nothing for a body sent as is. Taken from the room for bodies while the body
/// decodes.
pub fn decoder_memory(encoding: Option<&str>, body: &[u8]) -> usize {
    let encoding = encoding.map(|e| e.trim().to_ascii_lowercase());
    match encoding.as_deref() {
        Some("gzip") | Some("x-gzip") => 32 * 1024,
        Some("zstd") => zstd_window(body),
        _ => 0,
    }
}

/// The largest window the zstd frames of `body` declare (RFC 8878, 3.1.1.1), at most
/// [`ZSTD_WINDOW_LOG_MAX`]. Skippable frames need none.
fn zstd_window(mut body: &[u8]) -> usize {
    const MAX: usize = 1 << ZSTD_WINDOW_LOG_MAX;
    let mut largest = 0;
    while !body.is_empty() {
        let Some(window) = zstd_frame_window(body) else {
            return MAX;
        };
        largest = largest.max(window.min(MAX as u64) as usize);
        match zstd::zstd_safe::find_frame_compressed_size(body) {
            Ok(n) if n > 0 && n <= body.len() => body = &body[n..],
            _ => return MAX,
        }
    }
    largest
}

/// The window one zstd frame at the start of `frame` declares, from its header; `None`
/// when the header cannot be read.
fn zstd_frame_window(frame: &[u8]) -> Option<u64> {
    let magic = u32::from_le_bytes(frame.get(..4)?.try_into().ok()?);
    if magic & 0xFFFF_FFF0 == 0x184D_2A50 {
        // A skippable frame: no data to decode.
        return Some(0);
    }
    if magic != 0xFD2F_B528 {
        return None;
    }
    let descriptor = *frame.get(4)?;
    let single_segment = descriptor & 0x20 != 0;
    if !single_segment {
        // The window descriptor: 2^(10 + exponent), plus mantissa eighths of that.
        let wd = *frame.get(5)?;
        let base = 1u64 << (10 + u32::from(wd >> 3));
        return Some(base + base / 8 * u64::from(wd & 7));
    }
    // A single segment: the window is the frame's content size, which follows the
    // dictionary id.
    let dict_id_len = [0, 1, 2, 4][usize::from(descriptor & 3)];
    let fcs_len = [1, 2, 4, 8][usize::from(descriptor >> 6)];
    let at = 5 + dict_id_len;
    let field = frame.get(at..at + fcs_len)?;
    let mut size = [0u8; 8];
    size[..fcs_len].copy_from_slice(field);
    let size = u64::from_le_bytes(size);
    Some(if fcs_len == 2 { size + 256 } else { size })
}

fn read_limited(
    mut reader: impl Read,
    limit: usize,
    what: &str,
    grant: &mut dyn FnMut(usize) -> bool,
) -> Result<Vec<u8>, Undecoded> {
    let mut out = Vec::new();
    let mut chunk = vec![0u8; DECODE_CHUNK];
    loop {
        let n = match reader.read(&mut chunk) {
            Ok(0) => return Ok(out),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                return Err(Rejection::new(
                    ReasonCode::MalformedBody,
                    format!("the {what} body does not decode: {e}"),
                )
                .into());
            }
        };
        if out.len() + n > limit {
            return Err(too_large(limit).into());
        }
        // Room is paid for what is allocated, not only what is kept: a growth asks for
        // the whole new capacity first.
        if out.len() + n > out.capacity() {
            let grown = (out.capacity() * 2).max(out.len() + n).min(limit);
            if !grant(grown - out.capacity()) {
                return Err(Undecoded::NoRoom);
            }
            out.reserve_exact(grown - out.len());
        }
        out.extend_from_slice(&chunk[..n]);
    }
}

/// Decodes `body` per its `Content-Encoding`, refusing anything that would decode to more
/// than `max_decoded` bytes (so a small compressed bomb cannot exhaust memory).
pub fn decode(
    encoding: Option<&str>,
    body: bytes::Bytes,
    max_decoded: usize,
) -> Result<bytes::Bytes, Rejection> {
    decode_within(encoding, body, max_decoded, &mut |_| true).map_err(|e| match e {
        Undecoded::Rejected(r) => r,
        // A grant that always says yes is never refused.
        Undecoded::NoRoom => Rejection::new(ReasonCode::MalformedBody, "no room to decode"),
    })
}

/// [`decode`], asking `grant` for the decoded body's memory before it is allocated (a
/// body sent as is takes no more memory, and asks nothing). A grant refused ends the
/// decoding with [`Undecoded::NoRoom`]. A zstd frame may not ask for a window over
/// [`ZSTD_WINDOW_LOG_MAX`] (the decoder's own memory, beyond the grant).
pub fn decode_within(
    encoding: Option<&str>,
    body: bytes::Bytes,
    max_decoded: usize,
    grant: &mut dyn FnMut(usize) -> bool,
) -> Result<bytes::Bytes, Undecoded> {
    let encoding = encoding.map(|e| e.trim().to_ascii_lowercase());
    match encoding.as_deref() {
        None | Some("") | Some("identity") => {
            if body.len() > max_decoded {
                return Err(too_large(max_decoded).into());
            }
            Ok(body)
        }
        Some("gzip") | Some("x-gzip") => {
            // Every member: a gzip file may be several members back to back (RFC 1952 2.2),
            // and a decoder of the first alone would drop the rest without a word.
            let out = read_limited(
                flate2::read::MultiGzDecoder::new(&body[..]),
                max_decoded,
                "gzip",
                grant,
            )?;
            Ok(out.into())
        }
        Some("zstd") => {
            let mut decoder = zstd::stream::read::Decoder::new(&body[..]).map_err(|e| {
                Rejection::new(
                    ReasonCode::MalformedBody,
                    format!("the zstd body does not decode: {e}"),
                )
            })?;
            decoder.window_log_max(ZSTD_WINDOW_LOG_MAX).map_err(|e| {
                Rejection::new(
                    ReasonCode::MalformedBody,
                    format!("the zstd decoder's window: {e}"),
                )
            })?;
            Ok(read_limited(decoder, max_decoded, "zstd", grant)?.into())
        }
        Some(other) => Err(Rejection::new(
            ReasonCode::UnsupportedEncoding,
            format!("Content-Encoding `{other}` is not identity, gzip or zstd"),
        )
        .into()),
    }
}

/// Splits a decoded body into one slice per event. A JSON body that is not an object or
/// an array of values is refused as a whole; an NDJSON body is split by line, so one bad
/// line does not spoil the others. Blank lines are skipped. A JSON text sequence is split
/// at its record separators (a record may span lines), and empty records are skipped.
pub fn split(format: BodyFormat, body: &[u8], max_events: usize) -> Result<Vec<&[u8]>, Rejection> {
    // A UTF-8 byte order mark may lead a body (RFC 8259 lets a parser ignore it).
    let body = body.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(body);
    let events: Vec<&[u8]> = match format {
        BodyFormat::Ndjson => body
            .split(|b| *b == b'\n')
            .map(|line| line.strip_suffix(b"\r").unwrap_or(line))
            .filter(|line| line.iter().any(|b| !b.is_ascii_whitespace()))
            .collect(),
        BodyFormat::JsonSeq => body
            .split(|b| *b == RECORD_SEPARATOR)
            .map(trim)
            .filter(|record| !record.is_empty())
            .collect(),
        BodyFormat::Json => {
            let first = body.iter().find(|b| !b.is_ascii_whitespace());
            match first {
                Some(b'[') => {
                    let items: Vec<&RawValue> = serde_json::from_slice(body).map_err(|e| {
                        Rejection::new(
                            ReasonCode::MalformedBody,
                            format!("the JSON array does not parse: {e}"),
                        )
                    })?;
                    items.into_iter().map(|raw| raw.get().as_bytes()).collect()
                }
                Some(b'{') => vec![trim(body)],
                Some(_) => {
                    return Err(Rejection::new(
                        ReasonCode::MalformedBody,
                        "a JSON body must be one event object or an array of events",
                    ));
                }
                None => Vec::new(),
            }
        }
    };
    if events.is_empty() {
        return Err(Rejection::new(
            ReasonCode::MalformedBody,
            "the body holds no events",
        ));
    }
    if events.len() > max_events {
        return Err(Rejection::new(
            ReasonCode::BatchTooLarge,
            format!(
                "the body holds {} events; the limit is {max_events}",
                events.len()
            ),
        ));
    }
    Ok(events)
}

/// RFC 7464's record separator, which opens each JSON text of a sequence.
const RECORD_SEPARATOR: u8 = 0x1E;

fn trim(bytes: &[u8]) -> &[u8] {
    let start = bytes
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .unwrap_or(bytes.len());
    let end = bytes
        .iter()
        .rposition(|b| !b.is_ascii_whitespace())
        .map_or(start, |p| p + 1);
    &bytes[start..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_zstd_decoder_takes_the_window_its_frames_declare() {
        let small = zstd::bulk::compress(&b"{\"a\": 1}"[..], 3).unwrap();
        // One-shot compression declares the content size: the window is that small.
        assert!(
            decoder_memory(Some("zstd"), &small) < 64,
            "{}",
            decoder_memory(Some("zstd"), &small)
        );
        // A streamed frame declares a window of its own (level 19: 8 MiB).
        let big: Vec<u8> = (0..200_000u32).flat_map(|i| i.to_le_bytes()).collect();
        let mut streamed = Vec::new();
        {
            let mut enc = zstd::stream::write::Encoder::new(&mut streamed, 19).unwrap();
            std::io::Write::write_all(&mut enc, &big).unwrap();
            enc.finish().unwrap();
        }
        let window = decoder_memory(Some("zstd"), &streamed);
        assert!(
            window > 64 * 1024 && window <= 1 << ZSTD_WINDOW_LOG_MAX,
            "{window}"
        );
        // Two frames back to back: the larger window.
        let mut two = small.clone();
        two.extend_from_slice(&streamed);
        assert_eq!(decoder_memory(Some("zstd"), &two), window);
        // A header that cannot be read: the most a frame may ask for.
        assert_eq!(
            decoder_memory(Some("zstd"), b"not zstd"),
            1 << ZSTD_WINDOW_LOG_MAX
        );
        assert_eq!(decoder_memory(Some("gzip"), b""), 32 * 1024);
        assert_eq!(decoder_memory(None, b"{}"), 0);
    }

    #[test]
    fn shapes_split_into_events() {
        let one = br#" {"a":1} "#;
        assert_eq!(
            split(BodyFormat::Json, one, 10).unwrap(),
            vec![&br#"{"a":1}"#[..]]
        );
        let arr = br#"[{"a":1}, {"b":[1,2]}]"#;
        assert_eq!(split(BodyFormat::Json, arr, 10).unwrap().len(), 2);
        let nd = b"{\"a\":1}\r\n\n{oops\n";
        let parts = split(BodyFormat::Ndjson, nd, 10).unwrap();
        assert_eq!(parts, vec![&b"{\"a\":1}"[..], &b"{oops"[..]]);
    }

    #[test]
    fn malformed_and_oversized_bodies_are_classified() {
        let r = split(BodyFormat::Json, b"[{\"a\":1},", 10).unwrap_err();
        assert_eq!(r.reason, ReasonCode::MalformedBody);
        let r = split(BodyFormat::Json, b"42", 10).unwrap_err();
        assert_eq!(r.reason, ReasonCode::MalformedBody);
        let r = split(BodyFormat::Ndjson, b"{}\n{}\n{}", 2).unwrap_err();
        assert_eq!(r.reason, ReasonCode::BatchTooLarge);
        let r = split(BodyFormat::Json, b"   ", 2).unwrap_err();
        assert_eq!(r.reason, ReasonCode::MalformedBody);
    }

    #[test]
    fn compression_bombs_stop_at_the_limit() {
        let big = vec![b' '; 1 << 20];
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        std::io::Write::write_all(&mut enc, &big).unwrap();
        let gz = enc.finish().unwrap();
        let r = decode(Some("gzip"), gz.clone().into(), 1000).unwrap_err();
        assert_eq!(r.reason, ReasonCode::BodyTooLarge);
        assert_eq!(
            decode(Some("gzip"), gz.into(), 1 << 20).unwrap().len(),
            1 << 20
        );
        let z = zstd::encode_all(&big[..], 3).unwrap();
        assert_eq!(
            decode(Some("zstd"), z.into(), 1 << 20).unwrap().len(),
            1 << 20
        );
        let r = decode(Some("br"), big.clone().into(), 1 << 21).unwrap_err();
        assert_eq!(r.reason, ReasonCode::UnsupportedEncoding);
        // A body in a supported encoding that does not decode is malformed, not unsupported.
        let r = decode(Some("gzip"), bytes::Bytes::from_static(b"not gzip"), 10).unwrap_err();
        assert_eq!(r.reason, ReasonCode::MalformedBody);
        let r = decode(Some("zstd"), bytes::Bytes::from_static(b"not zstd"), 10).unwrap_err();
        assert_eq!(r.reason, ReasonCode::MalformedBody);
    }

    #[test]
    fn decoding_takes_room_for_what_it_keeps_and_stops_when_refused() {
        let big = vec![b' '; 1 << 20];
        let z: bytes::Bytes = zstd::encode_all(&big[..], 3).unwrap().into();
        let mut granted = 0;
        let out = decode_within(Some("zstd"), z.clone(), 1 << 20, &mut |n| {
            granted += n;
            true
        })
        .unwrap();
        assert_eq!((out.len(), granted), (1 << 20, 1 << 20));
        // Room for a tenth of it: refused on the way, for want of room, not as a fault of
        // the body.
        let mut left = (1usize << 20) / 10;
        let r = decode_within(Some("zstd"), z, 1 << 20, &mut |n| {
            left.checked_sub(n).map(|l| left = l).is_some()
        });
        assert_eq!(r.unwrap_err(), Undecoded::NoRoom);
        // A body sent as is takes no room beyond its own.
        let plain = bytes::Bytes::from_static(b"{}");
        let out = decode_within(None, plain, 10, &mut |_| false).unwrap();
        assert_eq!(&out[..], b"{}");
    }

    fn gzip(bytes: &[u8]) -> Vec<u8> {
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut enc, bytes).unwrap();
        enc.finish().unwrap()
    }

    #[test]
    fn every_member_of_a_gzip_body_is_decoded() {
        let body = [gzip(b"{\"a\":1}\n"), gzip(b"{\"b\":2}\n")].concat();
        let out = decode(Some("gzip"), body.into(), 1000).unwrap();
        assert_eq!(&out[..], b"{\"a\":1}\n{\"b\":2}\n");
        assert_eq!(split(BodyFormat::Ndjson, &out, 10).unwrap().len(), 2);
        // What follows a member and is not one is not ignored.
        let body = [gzip(b"{\"a\":1}\n"), b"trailing bytes".to_vec()].concat();
        let r = decode(Some("gzip"), body.into(), 1000).unwrap_err();
        assert_eq!(r.reason, ReasonCode::MalformedBody);
    }

    #[test]
    fn a_json_text_sequence_is_split_at_its_record_separators() {
        assert_eq!(
            body_format(Some("application/json-seq")).unwrap(),
            BodyFormat::JsonSeq
        );
        let body = b"\x1e{\"a\":1}\n\x1e{\n  \"b\": 2\n}\n\x1e\n";
        let events = split(BodyFormat::JsonSeq, body, 10).unwrap();
        assert_eq!(events, vec![&b"{\"a\":1}"[..], &b"{\n  \"b\": 2\n}"[..]]);
        for e in events {
            serde_json::from_slice::<serde_json::Value>(e).unwrap();
        }
        let r = split(BodyFormat::JsonSeq, b"\x1e\n\x1e", 10).unwrap_err();
        assert_eq!(r.reason, ReasonCode::MalformedBody);
    }

    #[test]
    fn content_types() {
        assert_eq!(
            body_format(Some("application/json; charset=utf-8")).unwrap(),
            BodyFormat::Json
        );
        assert_eq!(
            body_format(Some("application/x-ndjson")).unwrap(),
            BodyFormat::Ndjson
        );
        assert_eq!(
            body_format(Some("text/plain")).unwrap_err().reason,
            ReasonCode::UnsupportedMediaType
        );
        assert_eq!(
            body_format(None).unwrap_err().reason,
            ReasonCode::UnsupportedMediaType
        );
    }
}

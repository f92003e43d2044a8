//! The schema registry: event types and their semantic versions, declared as JSON
//! files under `catalog/events/` (`<event_type>.v<major>.<minor>.<patch>.json`, or
//! `<event_type>.v<major>.json` for `<major>.0.0`), with reader/writer compatibility rules.
//!
//! # Compatibility
//!
//! A *reader* schema can read data written with a *writer* schema when, for every
//! field of the reader:
//! - a writer field with the same id has the same name (else: a rename), type (else: a
//!   changed type) and unit (else: a changed unit);
//! - no writer field has the same name under another id (else: a reused name);
//! - a field the writer lacks has a `default` or is optional (an added field).
//!
//! and every business key the reader requires was required by the writer. Across the
//! whole history of a type, a field id is bound to one name forever (no reuse after
//! removal). Versions that share a major version must all be readable by the newest
//! of them, the *current reader*; [`SchemaRegistry::from_schemas`] refuses a registry
//! that breaks this, naming the versions and the fields.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::Path;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, ErrorKind, Result};

/// A semantic version `major.minor.patch` of an event type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SchemaVersion {
    /// Incompatible changes bump the major version.
    pub major: u32,
    /// Compatible additions bump the minor version.
    pub minor: u32,
    /// Documentation-only changes bump the patch version.
    pub patch: u32,
}

impl SchemaVersion {
    /// A version from its three parts.
    pub const fn new(major: u32, minor: u32, patch: u32) -> Self {
        Self {
            major,
            minor,
            patch,
        }
    }
}

impl fmt::Display for SchemaVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

impl FromStr for SchemaVersion {
    type Err = Error;

    /// Parses `M`, `M.m` or `M.m.p` (missing parts are 0).
    fn from_str(s: &str) -> Result<Self> {
        let bad = || {
            Error::new(
                ErrorKind::InvalidInput,
                format!("`{s}` is not a semantic version (major.minor.patch)"),
            )
        };
        let mut parts = s.trim().split('.');
        let mut next = |required: bool| -> Result<u32> {
            match parts.next() {
                Some(p) => p.parse::<u32>().map_err(|_| bad()),
                None if required => Err(bad()),
                None => Ok(0),
            }
        };
        let version = SchemaVersion::new(next(true)?, next(false)?, next(false)?);
        if parts.next().is_some() {
            return Err(bad());
        }
        Ok(version)
    }
}

impl Serialize for SchemaVersion {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for SchemaVersion {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// The type of a payload field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FieldType {
    /// A 64-bit signed integer (JSON integer).
    Int64,
    /// A 64-bit float (JSON number).
    Float64,
    /// A UTF-8 string.
    String,
    /// A boolean.
    Bool,
    /// An RFC 3339 timestamp string.
    Timestamp,
}

impl fmt::Display for FieldType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            FieldType::Int64 => "int64",
            FieldType::Float64 => "float64",
            FieldType::String => "string",
            FieldType::Bool => "bool",
            FieldType::Timestamp => "timestamp",
        };
        f.write_str(s)
    }
}

/// One declared payload field of an event type.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FieldDecl {
    /// Stable field id: bound to one name for the whole history of the type.
    pub id: u32,
    /// Field name in the event's `payload` object.
    pub name: String,
    /// Value type.
    #[serde(rename = "type")]
    pub field_type: FieldType,
    /// Unit of the value, for example `minor_units` or `iso4217`. Changing it is incompatible.
    #[serde(default)]
    pub unit: Option<String>,
    /// Whether an event of this version must carry the field.
    #[serde(default)]
    pub required: bool,
    /// Value a reader uses when the writer did not have the field.
    #[serde(default)]
    pub default: Option<serde_json::Value>,
    /// What the field means.
    #[serde(default)]
    pub doc: Option<String>,
}

/// One version of one event type.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventTypeSchema {
    /// Event type name, for example `order_placed`.
    pub event_type: String,
    /// Semantic version of this declaration.
    pub version: SchemaVersion,
    /// What the event means.
    #[serde(default)]
    pub description: Option<String>,
    /// Business keys (`order_id`, `customer_id`, `market_id`) an event must carry.
    #[serde(default)]
    pub required_keys: Vec<String>,
    /// Declared payload fields.
    pub fields: Vec<FieldDecl>,
}

/// Business keys an event type may require.
pub const BUSINESS_KEYS: [&str; 3] = ["order_id", "customer_id", "market_id"];

impl EventTypeSchema {
    /// The declared field with `name`, if any.
    pub fn field(&self, name: &str) -> Option<&FieldDecl> {
        self.fields.iter().find(|f| f.name == name)
    }

    fn field_by_id(&self, id: u32) -> Option<&FieldDecl> {
        self.fields.iter().find(|f| f.id == id)
    }

    /// Checks the declaration on its own: unique ids and names, known keys, defaults typed.
    pub fn validate(&self) -> Result<()> {
        let ctx = format!("{} v{}", self.event_type, self.version);
        let bad = |msg: String| Err(Error::new(ErrorKind::Config, format!("{ctx}: {msg}")));
        if self.event_type.is_empty()
            || !self
                .event_type
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        {
            return bad("event_type must be non-empty snake_case".into());
        }
        for key in &self.required_keys {
            if !BUSINESS_KEYS.contains(&key.as_str()) {
                return bad(format!(
                    "required_keys names `{key}`, not one of {BUSINESS_KEYS:?}"
                ));
            }
        }
        let mut ids = HashMap::new();
        let mut names = HashMap::new();
        for f in &self.fields {
            if let Some(other) = ids.insert(f.id, &f.name) {
                return bad(format!(
                    "field id {} used by `{other}` and `{}`",
                    f.id, f.name
                ));
            }
            if names.insert(&f.name, f.id).is_some() {
                return bad(format!("field `{}` declared twice", f.name));
            }
            if let Some(default) = &f.default
                && !default.is_null()
                && !json_matches_type(default, f.field_type)
            {
                return bad(format!(
                    "default of `{}` is not a {} value",
                    f.name, f.field_type
                ));
            }
        }
        Ok(())
    }
}

pub(crate) fn json_matches_type(value: &serde_json::Value, ty: FieldType) -> bool {
    match ty {
        FieldType::Int64 => value.as_i64().is_some(),
        FieldType::Float64 => value.is_number(),
        FieldType::String | FieldType::Timestamp => value.is_string(),
        FieldType::Bool => value.is_boolean(),
    }
}

/// The outcome of a compatibility check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Compatibility {
    /// The reader can read everything the writer wrote.
    Compatible,
    /// The reader cannot; each entry names a field and the broken rule.
    Incompatible(Vec<String>),
}

impl Compatibility {
    /// Whether the check passed.
    pub fn is_compatible(&self) -> bool {
        matches!(self, Compatibility::Compatible)
    }
}

/// Can `reader` read data written with `writer`? See the module docs for the rules.
pub fn check_compatibility(writer: &EventTypeSchema, reader: &EventTypeSchema) -> Compatibility {
    let mut problems = Vec::new();
    for r in &reader.fields {
        if let Some(w) = writer.field(&r.name)
            && w.id != r.id
        {
            problems.push(format!(
                "field `{}` reused: id {} in v{}, id {} in v{}",
                r.name, w.id, writer.version, r.id, reader.version
            ));
            continue;
        }
        match writer.field_by_id(r.id) {
            Some(w) if w.name != r.name => problems.push(format!(
                "field id {} renamed from `{}` to `{}`",
                r.id, w.name, r.name
            )),
            Some(w) => {
                if w.field_type != r.field_type {
                    problems.push(format!(
                        "field `{}` changed type from {} to {}",
                        r.name, w.field_type, r.field_type
                    ));
                }
                if w.unit != r.unit {
                    problems.push(format!(
                        "field `{}` changed unit from {:?} to {:?}",
                        r.name, w.unit, r.unit
                    ));
                }
                if r.required && !w.required && r.default.is_none() {
                    problems.push(format!(
                        "field `{}` became required without a default",
                        r.name
                    ));
                }
            }
            None => {
                if r.required && r.default.is_none() {
                    problems.push(format!(
                        "field `{}` added as required without a default",
                        r.name
                    ));
                }
            }
        }
    }
    for key in &reader.required_keys {
        if !writer.required_keys.contains(key) {
            problems.push(format!(
                "business key `{key}` is required by v{} but not by v{}",
                reader.version, writer.version
            ));
        }
    }
    if problems.is_empty() {
        Compatibility::Compatible
    } else {
        Compatibility::Incompatible(problems)
    }
}

/// Every retained version of every declared event type.
#[derive(Debug, Clone, Default)]
pub struct SchemaRegistry {
    types: BTreeMap<String, BTreeMap<SchemaVersion, EventTypeSchema>>,
}

impl SchemaRegistry {
    /// Loads every `*.json` declaration in `dir` and checks the rules of the module docs.
    pub fn load_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let entries = std::fs::read_dir(dir).map_err(|e| {
            Error::new(
                ErrorKind::Config,
                format!("cannot read schema directory {}: {e}", dir.display()),
            )
        })?;
        let mut paths: Vec<_> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .collect();
        paths.sort();
        let mut schemas = Vec::with_capacity(paths.len());
        for path in paths {
            let text = std::fs::read_to_string(&path).map_err(|e| {
                Error::new(
                    ErrorKind::Config,
                    format!("cannot read {}: {e}", path.display()),
                )
            })?;
            let schema: EventTypeSchema = serde_json::from_str(&text)
                .map_err(|e| Error::new(ErrorKind::Config, format!("{}: {e}", path.display())))?;
            schemas.push(schema);
        }
        Self::from_schemas(schemas)
    }

    /// Builds a registry from declarations, checking each and the compatibility rules.
    pub fn from_schemas(schemas: impl IntoIterator<Item = EventTypeSchema>) -> Result<Self> {
        let mut types: BTreeMap<String, BTreeMap<SchemaVersion, EventTypeSchema>> = BTreeMap::new();
        for schema in schemas {
            schema.validate()?;
            let versions = types.entry(schema.event_type.clone()).or_default();
            if versions.contains_key(&schema.version) {
                return Err(Error::new(
                    ErrorKind::Config,
                    format!(
                        "{} v{} is declared twice",
                        schema.event_type, schema.version
                    ),
                ));
            }
            versions.insert(schema.version, schema);
        }
        let registry = Self { types };
        registry.check_history()?;
        Ok(registry)
    }

    fn check_history(&self) -> Result<()> {
        for (event_type, versions) in &self.types {
            let mut bound: HashMap<u32, (&str, SchemaVersion)> = HashMap::new();
            for schema in versions.values() {
                for f in &schema.fields {
                    match bound.get(&f.id) {
                        Some((name, v)) if *name != f.name => {
                            return Err(Error::new(
                                ErrorKind::Config,
                                format!(
                                    "{event_type}: field id {} is `{name}` in v{v} but `{}` in v{}; ids are never reused",
                                    f.id, f.name, schema.version
                                ),
                            ));
                        }
                        Some(_) => {}
                        None => {
                            bound.insert(f.id, (&f.name, schema.version));
                        }
                    }
                }
            }
            for writer in versions.values() {
                let Some(reader) = self.current(event_type, writer.version.major) else {
                    continue;
                };
                if let Compatibility::Incompatible(problems) = check_compatibility(writer, reader) {
                    return Err(Error::new(
                        ErrorKind::Config,
                        format!(
                            "{event_type}: v{} cannot read v{} within major {}: {}",
                            reader.version,
                            writer.version,
                            writer.version.major,
                            problems.join("; ")
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// The declared event type names.
    pub fn event_types(&self) -> impl Iterator<Item = &str> {
        self.types.keys().map(String::as_str)
    }

    /// Every retained version of `event_type`, oldest first.
    pub fn versions(&self, event_type: &str) -> impl Iterator<Item = &EventTypeSchema> {
        self.types
            .get(event_type)
            .into_iter()
            .flat_map(|v| v.values())
    }

    /// One exact version.
    pub fn get(&self, event_type: &str, version: SchemaVersion) -> Option<&EventTypeSchema> {
        self.types.get(event_type)?.get(&version)
    }

    /// The current reader for `major`: the newest retained version with that major.
    pub fn current(&self, event_type: &str, major: u32) -> Option<&EventTypeSchema> {
        self.types
            .get(event_type)?
            .range(SchemaVersion::new(major, 0, 0)..=SchemaVersion::new(major, u32::MAX, u32::MAX))
            .next_back()
            .map(|(_, s)| s)
    }

    /// The number of declared versions across all types.
    pub fn len(&self) -> usize {
        self.types.values().map(BTreeMap::len).sum()
    }

    /// Whether no type is declared.
    pub fn is_empty(&self) -> bool {
        self.types.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(id: u32, name: &str, ty: FieldType) -> FieldDecl {
        FieldDecl {
            id,
            name: name.into(),
            field_type: ty,
            unit: None,
            required: true,
            default: None,
            doc: None,
        }
    }

    fn schema(version: &str, fields: Vec<FieldDecl>) -> EventTypeSchema {
        EventTypeSchema {
            event_type: "order_placed".into(),
            version: version.parse().unwrap(),
            description: None,
            required_keys: vec!["order_id".into()],
            fields,
        }
    }

    fn amount() -> FieldDecl {
        FieldDecl {
            unit: Some("minor_units".into()),
            ..field(1, "amount_minor", FieldType::Int64)
        }
    }

    #[test]
    fn added_field_with_default_is_compatible() {
        let v1 = schema("1.0.0", vec![amount()]);
        let mut channel = field(2, "channel", FieldType::String);
        channel.default = Some("web".into());
        let v2 = schema("1.1.0", vec![amount(), channel]);
        assert!(check_compatibility(&v1, &v2).is_compatible());
        assert!(SchemaRegistry::from_schemas([v1, v2]).is_ok());
    }

    #[test]
    fn added_required_field_without_default_is_not() {
        let v1 = schema("1.0.0", vec![amount()]);
        let v2 = schema(
            "1.1.0",
            vec![amount(), field(2, "channel", FieldType::String)],
        );
        let Compatibility::Incompatible(p) = check_compatibility(&v1, &v2) else {
            panic!("expected incompatible");
        };
        assert!(p[0].contains("added as required"), "{p:?}");
        let err = SchemaRegistry::from_schemas([v1, v2]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Config);
    }

    #[test]
    fn changed_type_rename_unit_and_reuse_are_incompatible() {
        let v1 = schema("1.0.0", vec![amount()]);
        let changed_type = schema("1.1.0", vec![field(1, "amount_minor", FieldType::Float64)]);
        let renamed = schema(
            "1.1.0",
            vec![FieldDecl {
                name: "amount".into(),
                ..amount()
            }],
        );
        let unit = schema(
            "1.1.0",
            vec![FieldDecl {
                unit: Some("major_units".into()),
                ..amount()
            }],
        );
        let reused = schema("1.1.0", vec![FieldDecl { id: 7, ..amount() }]);
        for (reader, needle) in [
            (changed_type, "changed type"),
            (renamed, "renamed"),
            (unit, "changed unit"),
            (reused, "reused"),
        ] {
            match check_compatibility(&v1, &reader) {
                Compatibility::Incompatible(p) => {
                    assert!(p.iter().any(|m| m.contains(needle)), "{needle}: {p:?}")
                }
                Compatibility::Compatible => panic!("{needle} was accepted"),
            }
        }
    }

    #[test]
    fn id_reuse_after_removal_is_refused_across_majors() {
        let v1 = schema(
            "1.0.0",
            vec![amount(), field(2, "coupon", FieldType::String)],
        );
        let v2 = schema("2.0.0", vec![amount()]);
        let v3 = schema(
            "3.0.0",
            vec![amount(), field(2, "channel", FieldType::String)],
        );
        let err = SchemaRegistry::from_schemas([v1, v2, v3]).unwrap_err();
        assert!(err.message().contains("never reused"), "{err}");
    }

    #[test]
    fn major_bump_may_break() {
        let v1 = schema("1.0.0", vec![amount()]);
        let v2 = schema("2.0.0", vec![field(3, "total_minor", FieldType::Int64)]);
        let registry = SchemaRegistry::from_schemas([v1, v2]).unwrap();
        assert_eq!(
            registry.current("order_placed", 1).unwrap().version,
            SchemaVersion::new(1, 0, 0)
        );
        assert_eq!(
            registry.current("order_placed", 2).unwrap().version,
            SchemaVersion::new(2, 0, 0)
        );
    }

    #[test]
    fn versions_parse_and_order() {
        let a: SchemaVersion = "1".parse().unwrap();
        let b: SchemaVersion = "1.10.0".parse().unwrap();
        assert!(a < b);
        assert!("1.x".parse::<SchemaVersion>().is_err());
        assert!("1.2.3.4".parse::<SchemaVersion>().is_err());
    }
}

//! Catalog profiles: where the catalog database and the warehouse live.
//!
//! The binary reads a profile file (TOML) or builds the embedded default and passes
//! the typed [`LakeConfig`] down; this crate never reads files or the environment for
//! configuration.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Default catalog name, as PyIceberg, Spark and Trino must name it to see the tables.
pub const DEFAULT_CATALOG_NAME: &str = "signalweave";

/// A complete lake profile.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LakeConfig {
    /// Catalog name in the JDBC-catalog tables (`catalog_name` column).
    #[serde(default = "default_catalog_name")]
    pub catalog_name: String,
    /// Catalog database URL: `sqlite:///abs/path/catalog.db` or `postgres://user:pw@host/db`.
    pub catalog_url: String,
    /// Where table data and metadata live.
    pub warehouse: Warehouse,
}

fn default_catalog_name() -> String {
    DEFAULT_CATALOG_NAME.to_string()
}

/// The warehouse: a local directory or an S3 bucket and prefix.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Warehouse {
    /// A directory on the local filesystem (absolute path).
    Local {
        /// Absolute directory of the warehouse.
        path: PathBuf,
    },
    /// An S3-compatible object store.
    S3(S3Config),
}

/// An S3-compatible endpoint (AWS, Garage, MinIO).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct S3Config {
    /// Endpoint URL, for example `http://127.0.0.1:3900`. Empty for AWS's default.
    #[serde(default)]
    pub endpoint: Option<String>,
    /// Region name (Garage's default is `garage`).
    pub region: String,
    /// Bucket holding the warehouse.
    pub bucket: String,
    /// Key prefix of the warehouse inside the bucket.
    #[serde(default = "default_prefix")]
    pub prefix: String,
    /// Access key id.
    pub access_key_id: String,
    /// Secret access key.
    pub secret_access_key: String,
    /// Path-style addressing (`http://host/bucket/key`); required by Garage and MinIO.
    #[serde(default = "default_true")]
    pub path_style: bool,
}

fn default_prefix() -> String {
    "warehouse".to_string()
}

fn default_true() -> bool {
    true
}

impl LakeConfig {
    /// The embedded default: a SQLite catalog and a local warehouse under `dir`
    /// (`dir/catalog.db`, `dir/warehouse/`). Nothing needs to exist yet.
    pub fn embedded(dir: impl AsRef<Path>) -> Self {
        let dir = absolute(dir.as_ref());
        Self {
            catalog_name: default_catalog_name(),
            catalog_url: format!("sqlite://{}", dir.join("catalog.db").display()),
            warehouse: Warehouse::Local {
                path: dir.join("warehouse"),
            },
        }
    }

    /// Whether the catalog database is SQLite.
    pub fn is_sqlite(&self) -> bool {
        self.catalog_url.starts_with("sqlite:")
    }

    /// The SQLite file behind the catalog, when it is SQLite.
    pub fn sqlite_path(&self) -> Option<PathBuf> {
        let rest = self.catalog_url.strip_prefix("sqlite:")?;
        let rest = rest.strip_prefix("//").unwrap_or(rest);
        let path = rest.split('?').next().unwrap_or(rest);
        (!path.is_empty() && path != ":memory:").then(|| PathBuf::from(path))
    }

    /// The warehouse root as an Iceberg location.
    pub fn warehouse_location(&self) -> String {
        match &self.warehouse {
            Warehouse::Local { path } => absolute(path).display().to_string(),
            Warehouse::S3(s3) => {
                let prefix = s3.prefix.trim_matches('/');
                if prefix.is_empty() {
                    format!("s3://{}", s3.bucket)
                } else {
                    format!("s3://{}/{prefix}", s3.bucket)
                }
            }
        }
    }

    /// FileIO properties (`s3.*`) for the warehouse.
    pub fn storage_props(&self) -> HashMap<String, String> {
        let mut props = HashMap::new();
        if let Warehouse::S3(s3) = &self.warehouse {
            if let Some(endpoint) = &s3.endpoint {
                props.insert(iceberg::io::S3_ENDPOINT.into(), endpoint.clone());
            }
            props.insert(iceberg::io::S3_REGION.into(), s3.region.clone());
            props.insert(
                iceberg::io::S3_ACCESS_KEY_ID.into(),
                s3.access_key_id.clone(),
            );
            props.insert(
                iceberg::io::S3_SECRET_ACCESS_KEY.into(),
                s3.secret_access_key.clone(),
            );
            props.insert(
                iceberg::io::S3_PATH_STYLE_ACCESS.into(),
                s3.path_style.to_string(),
            );
            props.insert(iceberg::io::S3_DISABLE_CONFIG_LOAD.into(), "true".into());
            props.insert(iceberg::io::S3_DISABLE_EC2_METADATA.into(), "true".into());
        }
        props
    }

    /// The catalog URL with credentials masked, for logs and `status`.
    pub fn redacted_catalog_url(&self) -> String {
        match (self.catalog_url.find("://"), self.catalog_url.rfind('@')) {
            (Some(scheme), Some(at)) if at > scheme => {
                format!(
                    "{}://***{}",
                    &self.catalog_url[..scheme],
                    &self.catalog_url[at..]
                )
            }
            _ => self.catalog_url.clone(),
        }
    }
}

fn absolute(path: &Path) -> PathBuf {
    if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()
            .map(|cwd| cwd.join(path))
            .unwrap_or_else(|_| path.to_path_buf())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_paths() {
        let c = LakeConfig::embedded("/tmp/x");
        assert_eq!(c.catalog_url, "sqlite:///tmp/x/catalog.db");
        assert_eq!(c.sqlite_path().unwrap(), PathBuf::from("/tmp/x/catalog.db"));
        assert_eq!(c.warehouse_location(), "/tmp/x/warehouse");
    }

    #[test]
    fn s3_profile_parses() {
        let c: LakeConfig = toml::from_str(
            r#"
            catalog_url = "postgres://sw:secret@127.0.0.1:5432/sw"
            [warehouse]
            kind = "s3"
            endpoint = "http://127.0.0.1:3900"
            region = "garage"
            bucket = "lake"
            access_key_id = "GK1"
            secret_access_key = "s"
            "#,
        )
        .unwrap();
        assert_eq!(c.warehouse_location(), "s3://lake/warehouse");
        assert_eq!(c.redacted_catalog_url(), "postgres://***@127.0.0.1:5432/sw");
        assert!(!c.is_sqlite());
        assert_eq!(c.storage_props()["s3.path-style-access"], "true");
    }
}

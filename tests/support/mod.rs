//! Shared test support: the backends every lake test runs against.
//!
//! - `embedded`: SQLite catalog + local warehouse in a temporary directory (always);
//! - `garage-sqlite`: SQLite catalog + Garage S3 warehouse, when `SW_S3_ENDPOINT` is set
//!   (`eval "$(minio/garage-up.sh)"`);
//! - `garage-postgres`: PostgreSQL catalog + Garage, when `SW_PG_URL` is set as well
//!   (`eval "$(minio/postgres-up.sh)"`).
//!
//! With `SW_REQUIRE_SERVICES=1` (as `.ci/run` sets) a missing service fails the test
//! instead of narrowing the backend list, so CI can never pass by skipping.

#![allow(dead_code)]

pub mod cli;

use std::path::PathBuf;

use signalweave_lake::{LakeConfig, S3Config, Warehouse};

/// One backend under test. Keeps its temporary directory alive.
pub struct Backend {
    pub name: &'static str,
    pub config: LakeConfig,
    pub dir: tempfile::TempDir,
}

fn unique() -> String {
    format!(
        "{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default()
    )
}

pub fn required() -> bool {
    std::env::var("SW_REQUIRE_SERVICES").is_ok_and(|v| v == "1")
}

pub fn env(name: &str) -> Option<String> {
    match std::env::var(name) {
        Ok(v) if !v.is_empty() => Some(v),
        _ => {
            assert!(
                !required(),
                "{name} is not set but SW_REQUIRE_SERVICES=1: start the services with minio/garage-up.sh and minio/postgres-up.sh"
            );
            None
        }
    }
}

pub fn s3_config(prefix: &str) -> Option<S3Config> {
    Some(S3Config {
        endpoint: Some(env("SW_S3_ENDPOINT")?),
        region: std::env::var("SW_S3_REGION").unwrap_or_else(|_| "garage".into()),
        bucket: env("SW_S3_BUCKET")?,
        prefix: prefix.to_string(),
        access_key_id: env("SW_S3_ACCESS_KEY_ID")?,
        secret_access_key: env("SW_S3_SECRET_ACCESS_KEY")?,
        path_style: true,
    })
}

pub fn embedded() -> Backend {
    let dir = tempfile::tempdir().unwrap();
    let config = LakeConfig::embedded(dir.path().join("lake"));
    Backend {
        name: "embedded",
        config,
        dir,
    }
}

/// Every backend available here, each fresh and isolated from other tests.
pub fn backends() -> Vec<Backend> {
    let mut out = vec![embedded()];
    let id = unique();
    if let Some(s3) = s3_config(&format!("tests/{id}/sqlite")) {
        let dir = tempfile::tempdir().unwrap();
        out.push(Backend {
            name: "garage-sqlite",
            config: LakeConfig {
                catalog_name: "signalweave".into(),
                catalog_url: format!("sqlite://{}", dir.path().join("catalog.db").display()),
                warehouse: Warehouse::S3(s3),
            },
            dir,
        });
        if let (Some(pg), Some(s3)) = (env("SW_PG_URL"), s3_config(&format!("tests/{id}/pg"))) {
            out.push(Backend {
                name: "garage-postgres",
                config: LakeConfig {
                    // A catalog name of its own isolates this test's tables in the shared database.
                    catalog_name: format!("t{}", id.replace('-', "_")),
                    catalog_url: pg,
                    warehouse: Warehouse::S3(s3),
                },
                dir: tempfile::tempdir().unwrap(),
            });
        }
    }
    out
}

/// The repository root.
pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A free TCP port on 127.0.0.1 (free when asked; bind it soon).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// True when the `garage` binary is installed; with `SW_REQUIRE_SERVICES=1` its absence
/// fails the test instead.
pub fn garage_installed() -> bool {
    let installed = std::process::Command::new("garage")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        installed || !required(),
        "garage is not installed but SW_REQUIRE_SERVICES=1"
    );
    installed
}

/// A port for a private Garage: it takes the S3 port, the next one (RPC) and the third
/// after (admin). The block is chosen below the kernel's ephemeral range, so no outgoing
/// connection can take one of its ports while Garage is stopped for an outage and
/// restarted (Garage aborts when a port is taken).
pub fn garage_ports() -> u16 {
    let ephemeral_start: u16 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768);
    let low = 20_000u16.min(ephemeral_start.saturating_sub(4_000));
    let span = u64::from(ephemeral_start.saturating_sub(low).saturating_sub(4).max(1));
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or_default();
    for i in 0..200u64 {
        let p = low
            + ((u64::from(seed) + u64::from(std::process::id()) * 7919 + i * 104_729) % span)
                as u16;
        if [p, p + 1, p + 3]
            .iter()
            .all(|q| std::net::TcpListener::bind(("127.0.0.1", *q)).is_ok())
        {
            return p;
        }
    }
    panic!("no free port block for Garage");
}

/// Runs `minio/<script>` (`garage-up.sh`, `garage-down.sh`) for a private Garage in `dir`.
pub fn garage(script: &str, dir: &std::path::Path, port: u16) {
    let out = std::process::Command::new("bash")
        .arg(repo().join("minio").join(script))
        .env("SW_GARAGE_DIR", dir)
        .env("SW_GARAGE_PORT", port.to_string())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A lake profile file (TOML) for an S3 backend's configuration.
pub fn s3_profile(c: &LakeConfig) -> String {
    let Warehouse::S3(s3) = &c.warehouse else {
        unreachable!("only S3 backends need a profile")
    };
    format!(
        "catalog_name = \"{}\"\ncatalog_url = \"{}\"\n[warehouse]\nkind = \"s3\"\nendpoint = \"{}\"\nregion = \"{}\"\nbucket = \"{}\"\nprefix = \"{}\"\naccess_key_id = \"{}\"\nsecret_access_key = \"{}\"\n",
        c.catalog_name,
        c.catalog_url,
        s3.endpoint.clone().unwrap_or_default(),
        s3.region,
        s3.bucket,
        s3.prefix,
        s3.access_key_id,
        s3.secret_access_key
    )
}

/// The S3 backends available here, each with its lake profile written to
/// `<dir>/profile.toml` (the path to pass as `--lake`). Empty, with a note, when Garage is
/// not running (and `SW_REQUIRE_SERVICES` is not set).
pub fn s3_backends() -> Vec<(Backend, PathBuf)> {
    let out: Vec<_> = backends()
        .into_iter()
        .filter(|b| b.name != "embedded")
        .map(|b| {
            let path = b.dir.path().join("profile.toml");
            std::fs::write(&path, s3_profile(&b.config)).unwrap();
            (b, path)
        })
        .collect();
    if out.is_empty() {
        eprintln!("skipped: SW_S3_ENDPOINT not set (minio/garage-up.sh)");
    }
    out
}

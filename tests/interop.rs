//! Interoperability: PyIceberg (from PyPI) reads `signalweave.events` through the same
//! SQL catalog and gets the row count and column sum `signalweave sql` gets, on the
//! embedded lake and, where Garage runs, on S3.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::process::Command;
use std::sync::Arc;

use signalweave_lake::{Lake, LakeConfig, LoadOptions, Warehouse};
use signalweave_model::{EventValidator, SchemaRegistry, ValidationLimits};

fn pyiceberg_available() -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import pyiceberg, pyarrow, sqlalchemy"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok || !support::required(),
        "PyIceberg is not installed but SW_REQUIRE_SERVICES=1: pip install -r tests/interop/requirements.txt"
    );
    ok
}

async fn load_sample(config: &LakeConfig) -> Lake {
    let lake = Lake::open(config.clone()).await.unwrap();
    lake.init().await.unwrap();
    let registry = SchemaRegistry::load_dir(support::repo().join("catalog/events")).unwrap();
    let validator = EventValidator::new(Arc::new(registry), ValidationLimits::default());
    lake.load_file(
        &support::repo().join("fixtures/sample.ndjson"),
        &validator,
        &LoadOptions {
            chunk_records: 700,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    lake
}

async fn sql_figures(lake: &Lake) -> (i64, i64, i64) {
    use arrow::array::AsArray;
    use arrow::datatypes::Int64Type;
    let ctx = lake.session_context().await.unwrap();
    let b = ctx
        .sql("select count(*) as n, sum(amount_minor) as s, (select count(*) from signalweave.rejections) as r from signalweave.events")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    let v = |i: usize| b[0].column(i).as_primitive::<Int64Type>().value(0);
    (v(0), v(1), v(2))
}

fn pyiceberg(config: &LakeConfig) -> serde_json::Value {
    let script = support::repo().join("tests/interop/pyiceberg_read.py");
    let uri = match config.sqlite_path() {
        Some(p) => format!("sqlite:///{}", p.display()),
        None => config
            .catalog_url
            .replace("postgres://", "postgresql+psycopg2://"),
    };
    let mut cmd = Command::new("python3");
    cmd.arg(&script).arg(uri).arg(config.warehouse_location());
    if let Warehouse::S3(s3) = &config.warehouse {
        cmd.arg(format!(
            "s3.endpoint={}",
            s3.endpoint.clone().unwrap_or_default()
        ))
        .arg(format!("s3.region={}", s3.region))
        .arg(format!("s3.access-key-id={}", s3.access_key_id))
        .arg(format!("s3.secret-access-key={}", s3.secret_access_key))
        .arg("s3.force-virtual-addressing=false");
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "pyiceberg failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

async fn check(config: &LakeConfig) {
    let lake = load_sample(config).await;
    let (rows, sum, rejections) = sql_figures(&lake).await;
    let expected: signalweave_fixtures::ExpectedFigures = serde_json::from_str(
        &std::fs::read_to_string(support::repo().join("fixtures/sample.expected.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(rows as u64, expected.events);
    assert_eq!(sum, expected.amount_minor_sum);
    assert_eq!(rejections as u64, expected.invalid);
    let py = pyiceberg(config);
    assert_eq!(
        py["events"], rows,
        "row count: pyiceberg vs signalweave sql"
    );
    assert_eq!(py["distinct_event_ids"], rows);
    assert_eq!(
        py["amount_minor_sum"], sum,
        "amount sum: pyiceberg vs signalweave sql"
    );
    assert_eq!(py["rejections"], rejections);

    // After SignalWeave's own commits (compaction and a manifest merge: replace snapshots
    // written on the spec types) and expiry with file deletion, PyIceberg still reads the
    // same rows.
    let policy = signalweave_lake::MaintenancePolicy {
        min_manifests_to_merge: 2,
        retention: Some(signalweave_lake::Retention {
            keep_last: 1,
            max_age_ms: 0,
        }),
        orphan_safety_age: Some(std::time::Duration::ZERO),
        ..Default::default()
    };
    let c = lake
        .compact(
            signalweave_lake::LakeTable::Events,
            &signalweave_lake::CompactionPolicy {
                min_input_files: 2,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert!(c.files_removed >= 2 && c.files_added >= 1, "{c:?}");
    let r = lake
        .maintain(signalweave_lake::LakeTable::Events, &policy)
        .await
        .unwrap();
    assert!(
        r.merge_snapshot.is_some() && r.snapshots_expired > 0,
        "{r:?}"
    );
    assert_eq!(sql_figures(&lake).await, (rows, sum, rejections));
    let py = pyiceberg(config);
    assert_eq!(py["events"], rows, "after maintenance: pyiceberg row count");
    assert_eq!(py["distinct_event_ids"], rows);
    assert_eq!(py["amount_minor_sum"], sum);

    // And after an erasure (an overwrite snapshot), the same rows as `signalweave sql`.
    let e = lake
        .erase_customer(&signalweave_lake::ErasureRequest {
            customer_id: "c-6".into(),
            tenant: None,
            reason: "interop".into(),
            requested_by: "test".into(),
            outputs: Vec::new(),
        })
        .await
        .unwrap();
    assert!(e.tables[0].rows > 0, "{e:?}");
    let (rows2, sum2, _) = sql_figures(&lake).await;
    assert_eq!(rows2, rows - e.tables[0].rows as i64);
    let py = pyiceberg(config);
    assert_eq!(py["events"], rows2, "after erasure: pyiceberg row count");
    assert_eq!(py["amount_minor_sum"], sum2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pyiceberg_reads_the_embedded_lake() {
    if !pyiceberg_available() {
        eprintln!("pyiceberg not installed: interop not exercised here");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    check(&LakeConfig::embedded(dir.path().join("lake"))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pyiceberg_reads_the_s3_lake() {
    if !pyiceberg_available() {
        return;
    }
    let Some(s3) = support::s3_config(&format!("interop/{}", std::process::id())) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    check(&LakeConfig {
        catalog_name: "signalweave".into(),
        catalog_url: format!("sqlite://{}", dir.path().join("catalog.db").display()),
        warehouse: Warehouse::S3(s3),
    })
    .await;
}

//! Driving the `signalweave` binary from tests: commands, SQL, child processes, HTTP.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

/// `signalweave --lake <lake>` from the repository root, without fault drills.
pub fn sw(lake: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_signalweave"));
    c.current_dir(super::repo())
        .arg("--lake")
        .arg(lake)
        .env_remove("SIGNALWEAVE_FAULT")
        .env_remove("SIGNALWEAVE_BACKFILL_FAULT");
    c
}

pub fn ok(out: Output) -> String {
    assert!(
        out.status.success(),
        "exit {:?}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

pub fn sql(lake: &Path, query: &str) -> Vec<serde_json::Map<String, Value>> {
    let out = ok(sw(lake)
        .args(["sql", query, "--format", "json"])
        .output()
        .unwrap());
    if out.trim().is_empty() {
        return Vec::new();
    }
    serde_json::from_str(&out).unwrap()
}

/// Runs the live `market_aggregates` job (`jobs/market_aggregates.toml`) until it has
/// read every commit.
pub fn run_market_aggregates(lake: &Path) -> String {
    ok(sw(lake)
        .args([
            "run",
            "--job",
            "jobs/market_aggregates.toml",
            "--until-caught-up",
        ])
        .output()
        .unwrap())
}

pub fn count(lake: &Path, query: &str) -> i64 {
    sql(lake, query)[0]
        .values()
        .next()
        .unwrap()
        .as_i64()
        .unwrap()
}

/// A child process whose stderr is collected.
pub struct Proc {
    pub child: Child,
    log: Arc<Mutex<String>>,
}

impl Proc {
    pub fn spawn(mut cmd: Command) -> Self {
        let mut child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let log = Arc::new(Mutex::new(String::new()));
        let sink = Arc::clone(&log);
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let mut l = sink.lock().unwrap();
                l.push_str(&line);
                l.push('\n');
            }
        });
        Self { child, log }
    }

    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    pub fn wait_log(&self, needle: &str, timeout: Duration) {
        let start = Instant::now();
        while !self.log().contains(needle) {
            assert!(
                start.elapsed() < timeout,
                "no `{needle}` in: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Sends `signal` (for example `-TERM`) and waits up to `timeout` for the process to
    /// exit: its exit code (None when a signal ended it).
    #[allow(dead_code)]
    pub fn stop_with(mut self, signal: &str, timeout: Duration) -> Option<i32> {
        let ok = Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(ok.success());
        self.wait_exit(timeout, signal)
    }

    /// Waits up to `timeout` for the process to exit (`what` names what it obeys): its exit
    /// code (None when a signal ended it).
    #[allow(dead_code)]
    pub fn wait_exit(&mut self, timeout: Duration, what: &str) -> Option<i32> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s.code();
            }
            assert!(
                Instant::now() < deadline,
                "{what} was not obeyed: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// kill -9, and wait for the process to be gone.
    #[allow(dead_code)]
    pub fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    pub fn terminate(mut self) -> String {
        let ok = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(ok.success());
        let status = self.child.wait().unwrap();
        assert!(status.success(), "exit {status:?}: {}", self.log());
        self.log()
    }
}

/// GET `url` with a short timeout: the status code and body, or None when nothing answers.
pub fn fetch(url: &str) -> Option<(u16, String)> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(5))
            .build()
            .ok()?;
        let r = client.get(url).send().await.ok()?;
        let status = r.status().as_u16();
        Some((status, r.text().await.ok()?))
    })
}

pub fn get(url: &str) -> Option<String> {
    fetch(url).and_then(|(status, body)| (status == 200).then_some(body))
}

pub fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `lake erase` of the customer whose output key (tenant, customer id) is `key`.
pub fn erase_cmd(lake: &Path, key: &str) -> Command {
    let [tenant, customer] = <[String; 2]>::try_from(signalweave_model::split_key(key)).unwrap();
    let mut c = sw(lake);
    c.args([
        "lake",
        "erase",
        "--customer-id",
        &customer,
        "--tenant",
        &tenant,
    ])
    .args(["--reason", "a ticket"]);
    c
}

//! Helpers shared by the host's integration tests.
#![allow(dead_code)]

use km0::control::client::call;
use km0::generate::{stock_stream, StockStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Repository root. Cargo's run-time `CARGO_MANIFEST_DIR` comes first: a target folder
/// shared by several checkouts may hold a test binary built in another one, with that
/// one's build-time path.
pub fn repo() -> PathBuf {
    let dir = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").to_string());
    Path::new(&dir).parent().expect("host/ has a parent").to_path_buf()
}

/// The `km0` binary under test: cargo's, or another build of the same source that
/// `KM0_BIN` names (the profile-guided one of scripts/build-release.sh).
pub fn km0() -> PathBuf {
    // An empty value counts as unset; a relative one is taken from the repository's root, where
    // `make test` runs (cargo starts each test in its own crate's folder).
    match std::env::var_os("KM0_BIN").filter(|b| !b.is_empty()) {
        Some(bin) => repo().join(bin),
        None => PathBuf::from(env!("CARGO_BIN_EXE_km0")),
    }
}

/// A plugin component built by `scripts/build-plugins.sh` into `plugins/dist/`.
pub fn plugin(name: &str) -> PathBuf {
    let p = repo().join(format!("plugins/dist/{name}.wasm"));
    assert!(p.exists(), "{} is missing: build the plugins first (scripts/build-plugins.sh)", p.display());
    p
}

/// A stock-alert pipeline over `input` (min-stock, threshold 10, 5-minute windows, delay
/// 2 min) writing under `out/` (results, late events, dead letters, savepoints), with
/// `extra` sections (checkpoints, state). Written to `dir/<out>.toml`.
pub fn stock_pipeline(dir: &Path, input: &Path, out: &str, extra: &str) -> PathBuf {
    let text = format!(
        r#"
name = "stock-alert"
key = ["producto", "mercado"]
[source]
kind = "file"
path = {input:?}
[filter]
tipo = "stock.actualizado"
[event_time]
field = "fecha_ms"
watermark_delay = "2m"
[window]
kind = "tumbling"
size = "5m"
[plugin]
path = {plugin:?}
[plugin.config]
threshold = 10
[sink]
kind = "file"
path = "{out}/alertas.jsonl"
[late]
path = "{out}/late.jsonl"
[dead_letter]
path = "{out}/dead.jsonl"
[savepoints]
dir = "{out}/savepoints"
{extra}
"#,
        input = input.display().to_string(),
        plugin = plugin("min-stock").display().to_string(),
    );
    let path = dir.join(format!("{out}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

/// The results, late events and dead letters a [`stock_pipeline`] wrote under `out/`.
pub fn stock_outputs(dir: &Path, out: &str) -> Vec<String> {
    ["alertas.jsonl", "late.jsonl", "dead.jsonl"]
        .iter()
        .map(|f| std::fs::read_to_string(dir.join(out).join(f)).unwrap_or_default())
        .collect()
}

// A job running with its control API, for the tests that drive one.

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// `km0 run --follow JOB` with its control API on `port` and `token`.
pub fn start_following(job: &Path, port: u16, token: &str) -> Child {
    Command::new(km0())
        .args(["run", "--follow", "--http", &format!("127.0.0.1:{port}")])
        .arg(job)
        .env("KM0_TOKEN", token)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

pub fn wait_for(what: &str, mut ok: impl FnMut() -> bool) {
    let t = Instant::now();
    while !ok() {
        assert!(t.elapsed() < Duration::from_secs(30), "{what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A generated stock stream of `events` records, as JSON lines.
pub fn stream(events: u64, seed: u64) -> String {
    let spec = StockStream { events, seed, late_fraction: 0.004, ..Default::default() };
    let mut all = Vec::new();
    stock_stream(&spec, &mut all).unwrap();
    String::from_utf8(all).unwrap()
}

/// Wait until the job at `url` has read `records` records.
pub fn wait_for_read(url: &str, records: u64) {
    wait_for(&format!("the job reads {records} records"), || {
        call(url, "GET", "/api/v1/job", None)
            .is_ok_and(|(c, b)| c == 200 && json(&b)["counters"]["read"] == records)
    });
}

/// One uninterrupted, bounded run of the same pipeline into `ref/` (its `out/` paths
/// moved there).
pub fn reference_run(dir: &Path, job: &Path) {
    let reference = dir.join("ref.toml");
    std::fs::write(&reference, std::fs::read_to_string(job).unwrap().replace("out/", "ref/")).unwrap();
    let r = Command::new(km0()).args(["run", "--http", "off"]).arg(&reference).output().unwrap();
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
}

pub fn json(body: &str) -> serde_json::Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"))
}

/// Append `text` to the followed input `dir/live.jsonl`.
pub fn append(dir: &Path, text: &str) {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new().append(true).open(dir.join("live.jsonl")).unwrap();
    f.write_all(text.as_bytes()).unwrap();
}

/// A job over the followed `dir/live.jsonl` whose plugin panics on product `panic_key`
/// ("boom") and writes to stderr on product `probe`.
pub fn poisoned_pipeline(dir: &Path, panic_key: &str) -> PathBuf {
    let config = format!("panic_key = {panic_key:?}");
    poisoned_pipeline_with(dir, &dir.join("live.jsonl"), "quarantine_after = 3", &config)
}

/// A job over `input` running the hostile plugin's `poisoned` behaviour (`probe_key =
/// "probe"`), with `limits` in `[plugin]` and `config` in `[plugin.config]`; outputs and
/// savepoints under `dir/out/`.
pub fn poisoned_pipeline_with(dir: &Path, input: &Path, limits: &str, config: &str) -> PathBuf {
    let text = format!(
        r#"
name = "poisoned"
key = ["producto"]
[source]
kind = "file"
path = {input:?}
[event_time]
field = "fecha_ms"
watermark_delay = "2m"
[window]
kind = "tumbling"
size = "5m"
[plugin]
path = {plugin:?}
{limits}
[plugin.config]
behaviour = "poisoned"
probe_key = "probe"
{config}
[sink]
kind = "file"
path = "out/out.jsonl"
[late]
path = "out/late.jsonl"
[dead_letter]
path = "out/dead.jsonl"
[savepoints]
dir = "out/savepoints"
"#,
        input = input.display().to_string(),
        plugin = plugin("hostile").display().to_string(),
    );
    let path = dir.join("poisoned.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// Minutes `from..to` of events: one a minute for each of `p1`, `probe` and `poisoned`.
pub fn poisoned_minutes(poisoned: &str, from: i64, to: i64) -> String {
    let t0: i64 = 1_767_225_600_000;
    (from..to)
        .flat_map(|m| {
            ["p1", "probe", poisoned].map(|p| {
                let record = serde_json::json!({ "producto": p, "fecha_ms": t0 + m * 60_000 });
                format!("{record}\n")
            })
        })
        .collect()
}

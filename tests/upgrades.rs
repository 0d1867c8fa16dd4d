//! Plugin upgrades of a running job, end to end: the real `km0` binary following a file,
//! its HTTP control API, the real components of `plugins/dist/`, and real sinks (files, a
//! Kafka upsert topic on a tansu broker, a PostgreSQL table).
//!
//! The matrix: a shadow of min-stock-strict promoted over min-stock (scenario P), and a
//! live deploy of min-stock-trap that the job must roll back by itself (scenario R); each
//! on the memory and the RocksDB state backend; each with a file, a Kafka and a
//! PostgreSQL sink; each followed by a stop with a savepoint and a resume from it, and by
//! a SIGKILL and a restart that recovers from the checkpoints. The output must equal that
//! of the reference procedure: an offline deploy at the promotion's record (P), a run that
//! never deployed anything (R). Files byte for byte, the topic and the table as keyed
//! views (key -> JSON value).
//!
//! And the control API under concurrency: a savepoint, a live deploy, a shadow start and
//! its promotion (and, in the last round, a stop) sent at once, 50 rounds.

use km0::control::client::{call, send};
use km0_e2e::services::{free_port, keyed_view_of, Postgres, Tansu};
use km0_e2e::{keyed_view, km0_bin, plugin};
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const TOKEN: &str = "upgr4des";
const WAIT: Duration = Duration::from_secs(90);

fn json(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

/// `km0 ARGS` run to its end, with the control token in its environment.
fn km0(args: &[&str]) -> Output {
    Command::new(km0_bin()).args(args).env("KM0_TOKEN", TOKEN).output().unwrap()
}

fn ok(out: &Output, what: &str) {
    assert!(out.status.success(), "{what} failed: {}", String::from_utf8_lossy(&out.stderr));
}

/// Windows `from..to` of a hand-made stock stream (as in host/tests/deploy.rs): 20
/// products at one market, 10 updates each per 5-minute window, in time order; the minimum
/// of product `k` in window `w` is `(7k + 13w) % 30`, so min-stock (below 10) and
/// min-stock-strict (below 15) alert on known, different windows. 200 records a window.
fn windows_of_stock(from: i64, to: i64) -> String {
    let t0: i64 = 1_767_225_600_000;
    let mut out = String::new();
    for w in from..to {
        for j in 0..10i64 {
            for k in 0..20i64 {
                let t = t0 + w * 300_000 + j * 30_000 + k * 1_000;
                let stock = (7 * k + 13 * w) % 30 + j;
                out.push_str(&format!(
                    "{{\"tipo\":\"stock.actualizado\",\"producto\":\"p{k:02}\",\"mercado\":\"m\",\"stock_actual\":{stock},\"delta\":-1,\"fecha_ms\":{t}}}\n"
                ));
            }
        }
    }
    out
}

/// A generated stock stream (late events, other event types and malformed records in it)
/// over about 70 minutes of event time, cut into parts of `sizes` records.
fn generated_parts(seed: u64, sizes: &[usize]) -> Vec<String> {
    let total: usize = sizes.iter().sum();
    let spec = km0::generate::StockStream {
        events: total as u64,
        seed,
        products: 10,
        markets: 4,
        gap_ms: 500,
        late_fraction: 0.01,
        bad_fraction: 0.002,
        ..Default::default()
    };
    let mut all = Vec::new();
    km0::generate::stock_stream(&spec, &mut all).unwrap();
    let text = String::from_utf8(all).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), total, "the generator wrote one line per event");
    let mut parts = Vec::new();
    let mut at = 0;
    for &n in sizes {
        parts.push(lines[at..at + n].iter().map(|l| format!("{l}\n")).collect());
        at += n;
    }
    parts
}

fn append(path: &Path, text: &str) {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(path).unwrap();
    f.write_all(text.as_bytes()).unwrap();
}

/// A `km0 run` process with its control API; SIGKILLed if dropped while it runs.
struct Job {
    child: Option<Child>,
    url: String,
    log: PathBuf,
}

impl Job {
    /// `km0 run --follow --http ADDR PIPELINE EXTRA...`, its log in `log`.
    fn follow(pipeline: &Path, extra: &[&str], log: PathBuf) -> Job {
        let port = free_port();
        let child = Command::new(km0_bin())
            .args(["run", "--follow", "--http", &format!("127.0.0.1:{port}")])
            .arg(pipeline)
            .args(extra)
            .env("KM0_TOKEN", TOKEN)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Job { child: Some(child), url: format!("http://127.0.0.1:{port}"), log }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn status(&self) -> Option<serde_json::Value> {
        call(&self.url, "GET", "/api/v1/job", None).ok().filter(|(c, _)| *c == 200).map(|(_, b)| json(&b))
    }

    fn history(&self) -> serde_json::Value {
        let (code, body) = call(&self.url, "GET", "/api/v1/deployments", None).unwrap();
        assert_eq!(code, 200, "{body}");
        json(&body)
    }

    /// Whether the process is still running.
    fn alive(&mut self) -> bool {
        self.child.as_mut().is_some_and(|c| c.try_wait().unwrap().is_none())
    }

    /// Wait until the job has read `n` records.
    fn wait_read(&mut self, n: u64) {
        let t = Instant::now();
        loop {
            let read = self.status().and_then(|s| s["counters"]["read"].as_u64());
            if read == Some(n) {
                return;
            }
            assert!(self.alive(), "the job exited before it read {n} records: {}", tail(&self.log_text()));
            assert!(
                t.elapsed() < WAIT,
                "the job did not read {n} records in {WAIT:?} (read: {read:?}): {}",
                tail(&self.log_text())
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn plugin_version(&self) -> String {
        let s = self.status().expect("the job's status");
        s["aggregations"][0]["plugin_version"].as_str().unwrap_or("?").to_string()
    }

    /// SIGKILL.
    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Wait for the process to end (it must end well); its log.
    fn ended(&mut self) -> String {
        let mut c = self.child.take().expect("a running job");
        let t = Instant::now();
        let status = loop {
            if let Some(s) = c.try_wait().unwrap() {
                break s;
            }
            if t.elapsed() > WAIT {
                let _ = c.kill();
                let _ = c.wait();
                panic!("the job did not end in {WAIT:?} after its stop: {}", tail(&self.log_text()));
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let log = self.log_text();
        assert!(status.success(), "the job ended with {status}: {}", tail(&log));
        log
    }

    /// `POST /api/v1/stop?mode=MODE` (it must be accepted); the reply.
    fn stop(&mut self, mode: &str) -> serde_json::Value {
        let (code, body) =
            call(&self.url, "POST", &format!("/api/v1/stop?mode={mode}"), Some(TOKEN)).unwrap();
        assert_eq!(code, 200, "stop ({mode}): {body}");
        json(&body)
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The last lines of a log.
fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

/// A stock-alert pipeline `name` over the followed `live.jsonl` of `dir` running
/// min-stock (with more `[plugin]` lines, `probation`), writing under `out/` (late events,
/// dead letters, savepoints, checkpoints) and into `sink`, with the `[state]` section
/// `state`; written to `dir/<out>.toml`.
fn write_pipeline(dir: &Path, name: &str, out: &str, sink: &str, state: &str, probation: &str) -> PathBuf {
    let text = format!(
        r#"
name = "{name}"
key = ["producto", "mercado"]
[source]
kind = "file"
path = "live.jsonl"
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
{probation}
[plugin.config]
threshold = 10
[sink]
{sink}
[late]
path = "{out}/late.jsonl"
[dead_letter]
path = "{out}/dead.jsonl"
[savepoints]
dir = "{out}/savepoints"
[checkpoints]
dir = "{out}/chk"
interval = "300ms"
{state}
"#,
        plugin = plugin("min-stock").display().to_string(),
    );
    let path = dir.join(format!("{out}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scenario {
    /// A shadow of min-stock-strict started and promoted over min-stock.
    Promote,
    /// A live deploy of min-stock-trap, rolled back by the job.
    Rollback,
    /// A live deploy of min-stock-flaky (alerts of its own, fails on 60% of the
    /// products): kept by its probation (`rollback_fault_rate = 0.7`), rolled back by its
    /// circuit breaker (`breaker_fault_rate = 0.5`) after it wrote results of its own.
    Breaker,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Backend {
    Memory,
    Rocksdb,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Sink {
    File,
    Kafka,
    Postgres,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Continuation {
    /// `POST /api/v1/stop` with a savepoint, then a new run from it.
    StopResume,
    /// SIGKILL, then the same command again (it recovers from its checkpoints).
    KillRestart,
}

const SINKS: [Sink; 3] = [Sink::File, Sink::Kafka, Sink::Postgres];
const CONTINUATIONS: [Continuation; 2] = [Continuation::StopResume, Continuation::KillRestart];

/// One cell of the matrix: its own folder, pipeline name, topic and table.
struct Cell<'a> {
    scenario: Scenario,
    backend: Backend,
    sink: Sink,
    continuation: Continuation,
    dir: tempfile::TempDir,
    name: String,
    tansu: &'a Tansu,
    pg: &'a Postgres,
}

impl Cell<'_> {
    fn label(&self) -> String {
        format!("{:?}/{:?}/{:?}/{:?}", self.scenario, self.backend, self.sink, self.continuation)
    }

    fn input(&self) -> PathBuf {
        self.dir.path().join("live.jsonl")
    }

    fn table(&self) -> String {
        self.name.replace('-', "_")
    }

    /// The `[sink]` of the job under test.
    fn sink_section(&self) -> String {
        match self.sink {
            Sink::File => "kind = \"file\"\npath = \"out/alertas.jsonl\"".into(),
            Sink::Kafka => {
                format!("kind = \"kafka\"\nbrokers = \"{}\"\ntopic = \"{}\"", self.tansu.brokers, self.name)
            }
            Sink::Postgres => {
                format!("kind = \"postgres\"\nurl = \"{}\"\ntable = \"{}\"", self.pg.url(), self.table())
            }
        }
    }

    /// A stock-alert pipeline over the followed `live.jsonl` running min-stock, writing
    /// under `out/` (late events, dead letters, savepoints, checkpoints, RocksDB's folder)
    /// and into `sink`; written to `dir/<out>.toml`.
    fn pipeline(&self, out: &str, sink: &str) -> PathBuf {
        let state = match self.backend {
            Backend::Memory => "[state]\nbackend = \"memory\"".to_string(),
            Backend::Rocksdb => format!("[state]\nbackend = \"rocksdb\"\ndir = \"{out}/rocksdb\""),
        };
        let probation = match self.scenario {
            Scenario::Breaker => "rollback_fault_rate = 0.7\nbreaker_fault_rate = 0.5",
            _ => "",
        };
        write_pipeline(self.dir.path(), &self.name, out, sink, &state, probation)
    }

    /// The same pipeline writing its results to the file `<out>/alertas.jsonl`: the
    /// reference runs'.
    fn file_pipeline(&self, out: &str) -> PathBuf {
        self.pipeline(out, &format!("kind = \"file\"\npath = \"{out}/alertas.jsonl\""))
    }

    fn log(&self, n: u32) -> PathBuf {
        self.dir.path().join(format!("km0-{n}.log"))
    }

    fn file(&self, out: &str, name: &str) -> String {
        std::fs::read_to_string(self.dir.path().join(out).join(name)).unwrap_or_default()
    }

    /// What the job under test wrote as results, as a keyed view.
    fn results_view(&self) -> BTreeMap<String, serde_json::Value> {
        match self.sink {
            Sink::File => keyed_view(&self.dir.path().join("out/alertas.jsonl")),
            Sink::Kafka => keyed_view_of(&self.tansu.read_all(&self.name)),
            Sink::Postgres => self
                .pg
                .query(&format!("SELECT key, value::text FROM {} ORDER BY key", self.table()))
                .iter()
                .map(|r| (r[0].clone(), json(&r[1])))
                .collect(),
        }
    }

    /// Compare the outputs with the reference's (under `reference/`): results byte for
    /// byte (file sink) or as keyed views, late events and dead letters byte for byte.
    fn compare(&self, reference: &str, failures: &mut Vec<String>) {
        let want = self.file(reference, "alertas.jsonl");
        assert!(!want.is_empty(), "the reference run wrote no result");
        match self.sink {
            Sink::File => {
                let got = self.file("out", "alertas.jsonl");
                if got != want {
                    failures.push(format!(
                        "the results file differs from the reference's ({} lines, {} expected; first \
                         difference at line {:?})",
                        got.lines().count(),
                        want.lines().count(),
                        got.lines().zip(want.lines()).position(|(a, b)| a != b)
                    ));
                }
            }
            Sink::Kafka | Sink::Postgres => {
                let want = keyed_view(&self.dir.path().join(reference).join("alertas.jsonl"));
                let got = self.results_view();
                if got != want {
                    let missing = want.keys().filter(|k| !got.contains_key(*k)).count();
                    let extra = got.keys().filter(|k| !want.contains_key(*k)).count();
                    let changed = want.iter().filter(|(k, v)| got.get(*k).is_some_and(|g| g != *v)).count();
                    failures.push(format!(
                        "the {:?} sink's keyed view differs from the reference's: {} keys, {} expected; \
                         {missing} missing, {extra} extra, {changed} with another value",
                        self.sink,
                        got.len(),
                        want.len()
                    ));
                }
            }
        }
        for f in ["late.jsonl", "dead.jsonl"] {
            let (got, want) = (self.file("out", f), self.file(reference, f));
            if got != want {
                failures.push(format!(
                    "{f} differs from the reference's ({} lines, {} expected)",
                    got.lines().count(),
                    want.lines().count()
                ));
            }
        }
    }
}

/// Run `check` on every cell of `scenario` on `backend` (3 sinks x 2 continuations), with
/// one broker and one PostgreSQL; fail at the end with every failing cell.
fn matrix(scenario: Scenario, backend: Backend) {
    let tansu = Tansu::start();
    let pg = Postgres::start();
    let mut report = Vec::new();
    let mut failed = Vec::new();
    for sink in SINKS {
        for continuation in CONTINUATIONS {
            let tag = |s: &str| s.chars().next().unwrap().to_ascii_lowercase();
            let name = format!(
                "up-{}-{}-{}-{}",
                tag(&format!("{scenario:?}")),
                tag(&format!("{backend:?}")),
                tag(&format!("{sink:?}")),
                tag(&format!("{continuation:?}"))
            );
            let cell = Cell {
                scenario,
                backend,
                sink,
                continuation,
                dir: tempfile::Builder::new().prefix(&format!("km0-{name}-")).tempdir().unwrap(),
                name,
                tansu: &tansu,
                pg: &pg,
            };
            let t = Instant::now();
            let outcome = catch_unwind(AssertUnwindSafe(|| match scenario {
                Scenario::Promote => promote_cell(&cell),
                Scenario::Rollback => rollback_cell(&cell),
                Scenario::Breaker => breaker_cell(&cell),
            }));
            let failures = match outcome {
                Ok(f) => f,
                Err(panic) => vec![format!(
                    "panicked: {}",
                    panic
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default()
                )],
            };
            let line = format!(
                "{:<40} {:>5.1} s  {}",
                cell.label(),
                t.elapsed().as_secs_f64(),
                if failures.is_empty() {
                    "ok".to_string()
                } else {
                    format!("FAILED: {}", failures.join(" | "))
                }
            );
            eprintln!("cell {line}");
            if !failures.is_empty() {
                failed.push(line.clone());
                // Kept for a look: the folder of a failing cell.
                eprintln!("  (its folder is kept: {})", cell.dir.keep().display());
            }
            report.push(line);
        }
    }
    eprintln!("{scenario:?} on {backend:?}:\n{}", report.join("\n"));
    assert!(failed.is_empty(), "{} of {} cells failed:\n{}", failed.len(), report.len(), failed.join("\n"));
}

/// The cell's job under test started on `first` (its Kafka sink's topic created), once
/// it has read its `records`.
fn start(cell: &Cell, first: impl AsRef<[u8]>, records: u64) -> (PathBuf, Job) {
    prepare_sink(cell);
    std::fs::write(cell.input(), first).unwrap();
    let job = cell.pipeline("out", &cell.sink_section());
    let mut live = Job::follow(&job, &[], cell.log(1));
    live.wait_read(records);
    (job, live)
}

/// Wait until the job rolls its deploy back by itself: the reason its history gives.
fn rolled_back(live: &mut Job) -> String {
    let t = Instant::now();
    while live.history()[0]["status"] != "rolled_back" {
        assert!(live.alive(), "the job exited: {}", tail(&live.log_text()));
        assert!(t.elapsed() < WAIT, "the job did not roll the deploy back: {}", live.history());
        std::thread::sleep(Duration::from_millis(50));
    }
    live.history()[0]["reason"].as_str().unwrap_or_default().to_string()
}

/// A failure unless the job runs plugin version `want` after `when`.
fn runs(version: String, want: &str, when: &str, failures: &mut Vec<String>) {
    if version != want {
        failures.push(format!("after {when} the job runs plugin {version}, not {want}"));
    }
}

/// Create the cell's topic (the Kafka sink's).
fn prepare_sink(cell: &Cell) {
    if cell.sink == Sink::Kafka {
        cell.tansu.create_topic(&cell.name, 2);
    }
}

/// After the first run, the continuation: it reads `rest` (appended after the stop or the
/// kill) and ends with a drain. The job of the continuation is returned still running,
/// having read `total` records, for the caller to look at before it drains it.
fn continue_job(cell: &Cell, mut first: Job, job: &Path, read_before: u64, rest: &str, total: u64) -> Job {
    match cell.continuation {
        Continuation::StopResume => {
            let reply = first.stop("savepoint");
            first.ended();
            let savepoint = reply["savepoint"].as_str().unwrap_or_else(|| panic!("no savepoint: {reply}"));
            assert!(Path::new(savepoint).join("savepoint.json").is_file(), "{reply}");
            append(&cell.input(), rest);
            let mut next = Job::follow(job, &["--from-savepoint", savepoint], cell.log(2));
            next.wait_read(total);
            next
        }
        Continuation::KillRestart => {
            first.kill();
            let mut next = Job::follow(job, &[], cell.log(2));
            next.wait_read(read_before);
            append(&cell.input(), rest);
            next.wait_read(total);
            next
        }
    }
}

/// Scenario P in one cell: min-stock runs; after 2 000 records a shadow of
/// min-stock-strict starts; 2 000 more, then it is promoted; 1 000 more; the continuation;
/// 1 000 more, drained. The reference: a bounded run that stops with a savepoint at the
/// promotion's record, then an offline deploy of min-stock-strict from it.
fn promote_cell(cell: &Cell) -> Vec<String> {
    let mut failures = Vec::new();
    let (job, mut live) = start(cell, windows_of_stock(0, 10), 2_000);

    let strict = std::fs::read(plugin("min-stock-strict")).unwrap();
    let (code, body) =
        send(&live.url, "POST", "/api/v1/deployments?shadow=true", Some(TOKEN), &strict).unwrap();
    assert_eq!(code, 200, "the shadow start: {body}");
    let shadow = json(&body);
    assert_eq!(shadow["to"]["version"], "0.1.1", "{shadow}");
    append(&cell.input(), &windows_of_stock(10, 20));
    live.wait_read(4_000);

    let out = km0(&["deploy", "--promote", "--job", &live.url, "--json"]);
    ok(&out, "km0 deploy --promote");
    let promoted = json(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(promoted["status"], "promoted", "{promoted}");
    assert_eq!(promoted["to"]["version"], "0.1.1", "{promoted}");
    let at = promoted["at_record"].as_u64().unwrap_or_else(|| panic!("no at_record: {promoted}"));
    runs(live.plugin_version(), "0.1.1", "the promotion", &mut failures);
    append(&cell.input(), &windows_of_stock(20, 25));
    live.wait_read(5_000);

    let mut next = continue_job(cell, live, &job, 5_000, &windows_of_stock(25, 30), 6_000);
    runs(next.plugin_version(), "0.1.1", &format!("the {:?}", cell.continuation), &mut failures);
    next.stop("drain");
    next.ended();

    // The reference: the offline procedure at the promotion's record, over the whole input.
    let off = cell.file_pipeline("off");
    let off = off.to_string_lossy();
    ok(
        &km0(&["run", "--http", "off", "--stop-with-savepoint-after", &at.to_string(), &off]),
        "the bounded run",
    );
    let savepoint = cell.dir.path().join(format!("off/savepoints/savepoint-{at:012}"));
    ok(
        &km0(&[
            "deploy",
            &plugin("min-stock-strict").to_string_lossy(),
            "--from-savepoint",
            &savepoint.to_string_lossy(),
            "--pipeline",
            &off,
            "--http",
            "off",
        ]),
        "the offline deploy",
    );
    // The promotion changed something: windows fired after it alert below 15 (min-stock
    // alerts below 10 only).
    let strict_only = keyed_view(&cell.dir.path().join("off/alertas.jsonl"))
        .values()
        .filter(|v| v["stock_minimo"].as_i64().is_some_and(|m| m >= 10))
        .count();
    assert!(strict_only > 0, "the offline deploy's results have no alert of min-stock-strict's own");
    eprintln!("  {}: promoted at record {at}; {strict_only} alerts of min-stock-strict's own", cell.label());
    cell.compare("off", &mut failures);
    failures
}

/// Scenario R in one cell: min-stock runs; after 3 000 records min-stock-trap is deployed
/// live; 3 000 more (it fails on them, the job rolls it back and reads them again with
/// min-stock); the continuation; 2 000 more, drained. The reference: a run of the whole
/// input that never deployed anything.
fn rollback_cell(cell: &Cell) -> Vec<String> {
    let mut failures = Vec::new();
    let parts = generated_parts(43, &[3_000, 3_000, 2_000]);
    let (job, mut live) = start(cell, &parts[0], 3_000);

    let out = km0(&["deploy", &plugin("min-stock-trap").to_string_lossy(), "--job", &live.url, "--json"]);
    ok(&out, "km0 deploy min-stock-trap");
    let d = json(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(d["status"], "swapped", "{d}");
    assert!(d["rollback_fault_rate"].as_f64().is_some(), "the deploy is not watched: {d}");
    append(&cell.input(), &parts[1]);
    let reason = rolled_back(&mut live);
    if !reason.contains("rolled back by the job") {
        failures.push(format!("the rolled-back deploy's reason: {reason:?}"));
    }
    eprintln!("  {}: {reason}", cell.label());
    live.wait_read(6_000);
    runs(live.plugin_version(), "0.1.0", "the rollback", &mut failures);

    let mut next = continue_job(cell, live, &job, 6_000, &parts[2], 8_000);
    runs(next.plugin_version(), "0.1.0", &format!("the {:?}", cell.continuation), &mut failures);
    let history = next.history();
    let said = history.as_array().is_some_and(|h| h.iter().any(|d| d["status"] == "rolled_back"));
    if !said {
        failures.push(format!(
            "after the {:?} the deploy history does not say rolled_back: {history}",
            cell.continuation
        ));
    }
    next.stop("drain");
    next.ended();

    // The reference: the same pipeline, never deployed into, over the whole input.
    ok(&km0(&["run", "--http", "off", &cell.file_pipeline("ref").to_string_lossy()]), "the reference run");
    cell.compare("ref", &mut failures);
    failures
}

/// Scenario B in one cell: min-stock runs; after 2 000 records min-stock-flaky is deployed
/// live; 12 000 more: it passes its probation (it fails on 60% of the events and windows,
/// under the 70% allowed) and writes alerts of its own (below 15) for the products it does
/// not fail on, checkpointed; 6 000 more: it trips its breaker (over 50% of its last 5 000
/// events at least) and the job rolls it back, taking every sink back to the deploy's
/// savepoint; the continuation; 2 000 more, drained.
/// The reference: a run of the whole input that never deployed anything, so every alert of
/// min-stock-flaky's own must be gone from the sinks.
fn breaker_cell(cell: &Cell) -> Vec<String> {
    let mut failures = Vec::new();
    let (job, mut live) = start(cell, windows_of_stock(0, 10), 2_000);
    let out = km0(&["deploy", &plugin("min-stock-flaky").to_string_lossy(), "--job", &live.url, "--json"]);
    ok(&out, "km0 deploy min-stock-flaky");
    let d = json(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(
        (d["status"].clone(), d["rollback_fault_rate"].clone()),
        ("swapped".into(), 0.7.into()),
        "{d}"
    );
    // Past its probation (10 000 events and 100 windows) in this part; its results reach
    // the sinks with the checkpoints (every 300 ms) before the next part trips its breaker.
    append(&cell.input(), &windows_of_stock(10, 70));
    live.wait_read(14_000);
    std::thread::sleep(Duration::from_millis(1_500));
    assert_eq!(live.history()[0]["status"], "swapped", "{}", live.history());
    if cell.sink == Sink::Postgres {
        // Committed with the epochs of its checkpoints: the rollback must delete them.
        let own = cell.pg.query(&format!(
            "SELECT count(*)::text FROM {} WHERE (value->>'stock_minimo')::int >= 10",
            cell.table()
        ));
        let own: u64 = own[0][0].parse().unwrap();
        assert!(own > 0, "min-stock-flaky committed no alert of its own before its breaker tripped");
        eprintln!("  {}: {own} alerts of min-stock-flaky's own were committed, then undone", cell.label());
    }
    append(&cell.input(), &windows_of_stock(70, 100));
    let reason = rolled_back(&mut live);
    if !reason.contains("circuit breaker") {
        failures.push(format!("the deploy was not rolled back by its breaker: {reason:?}"));
    }
    eprintln!("  {}: {reason}", cell.label());
    live.wait_read(20_000);
    runs(live.plugin_version(), "0.1.0", "the rollback", &mut failures);
    if cell.sink == Sink::Kafka {
        // The flaky release wrote alerts of its own (below 15) before its breaker tripped:
        // the topic holds them, and their tombstones.
        let written = cell.tansu.read_all(&cell.name);
        let own = written
            .iter()
            .filter(|r| {
                serde_json::from_slice::<serde_json::Value>(&r.value)
                    .is_ok_and(|v| v["stock_minimo"].as_i64().is_some_and(|m| m >= 10))
            })
            .count();
        assert!(own > 0, "min-stock-flaky wrote no alert of its own before its breaker tripped");
        eprintln!("  {}: {own} alerts of min-stock-flaky's own were written, then undone", cell.label());
    }

    let mut next = continue_job(cell, live, &job, 20_000, &windows_of_stock(100, 110), 22_000);
    runs(next.plugin_version(), "0.1.0", &format!("the {:?}", cell.continuation), &mut failures);
    next.stop("drain");
    next.ended();
    ok(&km0(&["run", "--http", "off", &cell.file_pipeline("ref").to_string_lossy()]), "the reference run");
    cell.compare("ref", &mut failures);
    failures
}

#[test]
fn a_deploy_that_trips_its_breaker_is_rolled_back_and_undone_in_every_sink() {
    matrix(Scenario::Breaker, Backend::Rocksdb);
}

#[test]
fn a_promoted_shadow_on_the_memory_backend_gives_the_offline_deploys_output_on_every_sink() {
    matrix(Scenario::Promote, Backend::Memory);
}

#[test]
fn a_promoted_shadow_on_the_rocksdb_backend_gives_the_offline_deploys_output_on_every_sink() {
    matrix(Scenario::Promote, Backend::Rocksdb);
}

#[test]
fn a_rolled_back_deploy_on_the_memory_backend_gives_the_output_of_a_run_that_never_deployed() {
    matrix(Scenario::Rollback, Backend::Memory);
}

#[test]
fn a_rolled_back_deploy_on_the_rocksdb_backend_gives_the_output_of_a_run_that_never_deployed() {
    matrix(Scenario::Rollback, Backend::Rocksdb);
}

// The control API under concurrency.

#[derive(Clone, Copy, Debug)]
enum Op {
    Savepoint,
    /// A live deploy of this plugin.
    Deploy(&'static str),
    /// A shadow of this plugin, then its promotion.
    ShadowPromote(&'static str),
    Stop,
}

/// One call and its answer (an error: not answered).
struct Answer {
    round: usize,
    call: String,
    sent: Instant,
    answered: Instant,
    reply: Result<(u16, String), String>,
}

fn timed(round: usize, what: &str, f: impl FnOnce() -> km0::Result<(u16, String)>) -> Answer {
    let sent = Instant::now();
    let reply = f().map_err(|e| e.to_string());
    Answer { round, call: what.to_string(), sent, answered: Instant::now(), reply }
}

fn carry_out(url: &str, round: usize, op: Op) -> Vec<Answer> {
    let bytes = |name: &str| std::fs::read(plugin(name)).unwrap();
    match op {
        Op::Savepoint => {
            vec![timed(round, "POST /api/v1/savepoints", || {
                call(url, "POST", "/api/v1/savepoints", Some(TOKEN))
            })]
        }
        Op::Deploy(p) => {
            let body = bytes(p);
            vec![timed(round, &format!("deploy {p}"), || {
                send(url, "POST", "/api/v1/deployments", Some(TOKEN), &body)
            })]
        }
        Op::ShadowPromote(p) => {
            let body = bytes(p);
            let started = timed(round, &format!("shadow {p}"), || {
                send(url, "POST", "/api/v1/deployments?shadow=true", Some(TOKEN), &body)
            });
            let promoted =
                timed(round, "promote", || call(url, "POST", "/api/v1/shadow/promote", Some(TOKEN)));
            vec![started, promoted]
        }
        Op::Stop => {
            vec![timed(round, "stop", || call(url, "POST", "/api/v1/stop?mode=savepoint", Some(TOKEN)))]
        }
    }
}

/// Every string under a key named `savepoint` (or `path`, a savepoint's reply) in `v`.
fn savepoints_named(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, x) in m {
                match (k.as_str(), x) {
                    ("savepoint" | "path", serde_json::Value::String(s)) => out.push(s.clone()),
                    _ => savepoints_named(x, out),
                }
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|x| savepoints_named(x, out)),
        _ => {}
    }
}

/// A small deterministic generator for the orders and delays of the rounds.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[test]
fn a_stop_a_savepoint_a_promotion_and_a_deploy_sent_together_are_all_answered_and_leave_one_plugin() {
    const ROUNDS: usize = 50;
    let dir = tempfile::Builder::new().prefix("km0-up-concurrency-").tempdir().unwrap();
    let input = dir.path().join("live.jsonl");
    std::fs::write(&input, windows_of_stock(0, 5)).unwrap();
    let job = write_pipeline(
        dir.path(),
        "up-concurrency",
        "out",
        "kind = \"file\"\npath = \"out/alertas.jsonl\"",
        "[state]\nbackend = \"memory\"",
        "",
    );
    let mut live = Job::follow(&job, &[], dir.path().join("km0.log"));
    live.wait_read(1_000);
    let url = live.url.clone();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut answers: Vec<Answer> = Vec::new();
    let t = Instant::now();
    for round in 0..ROUNDS {
        // The input grows (a window a round): the deploys meet open windows.
        append(&input, &windows_of_stock(5 + round as i64, 6 + round as i64));
        // Each a real change of whatever runs: min-stock and min-stock-strict (the same
        // state schema both ways; min-stock cannot take min-stock-v2's schema 2 back).
        let (deployed, shadowed) = if round % 2 == 0 {
            ("min-stock-strict", "min-stock")
        } else {
            ("min-stock", "min-stock-strict")
        };
        let mut ops = vec![Op::Savepoint, Op::Deploy(deployed), Op::ShadowPromote(shadowed)];
        if round == ROUNDS - 1 {
            ops.push(Op::Stop);
        }
        // A varying order, and a few milliseconds between the sends.
        for i in (1..ops.len()).rev() {
            ops.swap(i, (rng.next() % (i as u64 + 1)) as usize);
        }
        let delays: Vec<u64> = ops.iter().map(|_| rng.next() % 12).collect();
        let barrier = std::sync::Barrier::new(ops.len());
        let got: Vec<Vec<Answer>> = std::thread::scope(|s| {
            let handles: Vec<_> = ops
                .iter()
                .zip(&delays)
                .map(|(&op, &delay)| {
                    let (url, barrier) = (&url, &barrier);
                    s.spawn(move || {
                        barrier.wait();
                        std::thread::sleep(Duration::from_millis(delay));
                        carry_out(url, round, op)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        answers.extend(got.into_iter().flatten());
        // A shadow whose promotion was refused is dropped, or it would hold every later
        // deploy back.
        if round < ROUNDS - 1 && call(&url, "GET", "/api/v1/shadow", None).is_ok_and(|(c, _)| c == 200) {
            answers.push(timed(round, "abandon", || call(&url, "DELETE", "/api/v1/shadow", Some(TOKEN))));
        }
    }
    let rounds_took = t.elapsed();

    let mut failures = Vec::new();
    // The stop of the last round; if it was refused, one more, alone.
    let stopped = answers.iter().find(|a| a.call == "stop").and_then(|a| match &a.reply {
        Ok((200, body)) => Some(json(body)),
        _ => None,
    });
    let stopped = match stopped {
        Some(s) => s,
        None => {
            failures.push("the stop sent with the last round was not carried out".to_string());
            let a = timed(ROUNDS, "stop (again, alone)", || {
                call(&url, "POST", "/api/v1/stop?mode=savepoint", Some(TOKEN))
            });
            let body = match &a.reply {
                Ok((200, body)) => body.clone(),
                other => panic!("a stop alone was not carried out either: {other:?}"),
            };
            answers.push(a);
            json(&body)
        }
    };
    live.ended();

    // Every call answered; a call sent after the stop's reply had come may find the
    // process gone (it was told to stop), the others may not.
    let stop_answered = answers
        .iter()
        .filter(|a| a.call.starts_with("stop") && matches!(a.reply, Ok((200, _))))
        .map(|a| a.answered)
        .min();
    for a in &answers {
        if let Err(e) = &a.reply {
            if stop_answered.is_some_and(|t| a.sent > t) {
                eprintln!("round {}: {} sent after the stop's reply: {e}", a.round, a.call);
            } else {
                failures.push(format!("round {}: {} was not answered: {e}", a.round, a.call));
            }
        }
        let took = a.answered - a.sent;
        if took > Duration::from_secs(30) {
            failures.push(format!("round {}: {} took {took:?}", a.round, a.call));
        }
    }
    // Every savepoint a reply names is there and readable.
    let mut named = Vec::new();
    for a in &answers {
        if let Ok((_, body)) = &a.reply {
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(body) {
                savepoints_named(&v, &mut named);
            }
        }
    }
    for p in &named {
        let meta = Path::new(p).join("savepoint.json");
        match std::fs::read_to_string(&meta) {
            Ok(text) if serde_json::from_str::<serde_json::Value>(&text).is_ok() => {}
            Ok(_) => failures.push(format!("{} is not JSON", meta.display())),
            Err(e) => failures.push(format!("a reply named the savepoint {p}, whose savepoint.json: {e}")),
        }
    }
    // The plugin the job ended on: the last swap's (the deploy history's numbering).
    let swaps: Vec<serde_json::Value> = answers
        .iter()
        .filter(|a| a.call.starts_with("deploy") || a.call == "promote")
        .filter_map(|a| match &a.reply {
            Ok((200, body)) => Some(json(body)),
            _ => None,
        })
        .filter(|d| d["status"] == "swapped" || d["status"] == "promoted")
        .collect();
    let last = swaps.iter().max_by_key(|d| d["id"].as_u64().unwrap_or(0));
    let want = last.map_or("0.1.0".to_string(), |d| d["to"]["version"].as_str().unwrap_or("?").to_string());
    let sp =
        stopped["savepoint"].as_str().unwrap_or_else(|| panic!("the stop named no savepoint: {stopped}"));
    let meta = json(&std::fs::read_to_string(Path::new(sp).join("savepoint.json")).unwrap());
    let versions: Vec<&str> = meta["operators"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["plugin"]["version"].as_str().unwrap())
        .collect();
    if versions != [want.as_str()] {
        failures.push(format!(
            "the job stopped on plugin {versions:?}; the last swap it answered was to {want} ({})",
            last.map(|d| d.to_string()).unwrap_or_default()
        ));
    }
    // A summary: what was carried out, what was refused and why.
    let mut tally: BTreeMap<(String, String), usize> = BTreeMap::new();
    for a in &answers {
        let kind = a.call.split_whitespace().next().unwrap_or("").to_string();
        let outcome = match &a.reply {
            Ok((code, body)) => {
                let why = serde_json::from_str::<serde_json::Value>(body)
                    .ok()
                    .and_then(|v| v["error"].as_str().map(|e| e.chars().take(60).collect::<String>()))
                    .unwrap_or_default();
                format!("{code} {why}")
            }
            Err(_) => "no answer".to_string(),
        };
        *tally.entry((kind, outcome)).or_default() += 1;
    }
    eprintln!(
        "{ROUNDS} rounds in {rounds_took:?}; {} calls; {} swaps; the job stopped on {versions:?}",
        answers.len(),
        swaps.len()
    );
    for ((kind, outcome), n) in &tally {
        eprintln!("  {n:>4} x {kind}: {outcome}");
    }
    let done = |call: &str| {
        answers.iter().filter(|a| a.call.starts_with(call) && matches!(a.reply, Ok((200, _)))).count()
    };
    assert!(done("POST /api/v1/savepoints") > 0 && !swaps.is_empty(), "nothing was carried out: {tally:?}");
    eprintln!("promotions carried out: {}", done("promote"));
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

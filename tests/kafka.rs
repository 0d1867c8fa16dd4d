//! Kafka in and out, against a real broker (tansu, started by the test) and a real
//! PostgreSQL cluster: the stock-alert job from a 3-partition topic gives the same
//! keyed results as the embedded file run of the same records, dead letters carry the
//! original bytes and their origin, and SIGKILLs at several points change nothing in
//! the keyed view of the output topic or in the PostgreSQL table, where every result is
//! written exactly once.

use km0::generate::{stock_stream, StockStream};
use km0::job::{self, RunOptions};
use km0::pipeline::Pipeline;
use km0::plugin::PluginRuntime;
use km0_e2e::services::{keyed_view_of, Postgres, Tansu};
use km0_e2e::*;
use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const INPUT: &str = "pedidos.eventos";
const PARTITIONS: i32 = 3;

/// The test's own partitioner: records keyed by producto, spread by a hash of it;
/// records with no readable producto by their position.
fn partition_of(i: usize, record: &str) -> i32 {
    let producto = serde_json::from_str::<serde_json::Value>(record)
        .ok()
        .and_then(|v| v.get("producto").and_then(|p| p.as_str()).map(String::from));
    match producto {
        Some(p) => {
            (p.bytes().fold(7u32, |h, b| h.wrapping_mul(31).wrapping_add(b as u32)) % PARTITIONS as u32)
                as i32
        }
        None => (i % PARTITIONS as usize) as i32,
    }
}

/// The stock stream, split by partition: what goes to each partition, in order.
struct Stream {
    parts: Vec<Vec<String>>,
    bad: usize,
}

fn stream(events: u64, bad_fraction: f64) -> Stream {
    let spec = StockStream { events, seed: 5, late_fraction: 0.004, bad_fraction, ..Default::default() };
    let mut buf = Vec::new();
    let g = stock_stream(&spec, &mut buf).unwrap();
    let text = String::from_utf8(buf).unwrap();
    let mut parts = vec![Vec::new(); PARTITIONS as usize];
    for (i, line) in text.lines().enumerate() {
        parts[partition_of(i, line) as usize].push(line.to_string());
    }
    Stream { parts, bad: g.bad as usize }
}

impl Stream {
    fn produce(&self, broker: &Tansu) {
        broker.create_topic(INPUT, PARTITIONS);
        let mut records = Vec::new();
        for (p, lines) in self.parts.iter().enumerate() {
            for l in lines {
                let key = serde_json::from_str::<serde_json::Value>(l)
                    .ok()
                    .and_then(|v| v["producto"].as_str().map(String::from));
                records.push((p as i32, key, l.clone().into_bytes()));
            }
        }
        broker.produce(INPUT, &records);
    }

    /// The embedded run: one file per partition, read round-robin, as the reference.
    fn file_run(&self, dir: &Path) -> (BTreeMap<String, serde_json::Value>, job::Counters, usize) {
        let mut paths = Vec::new();
        for (p, lines) in self.parts.iter().enumerate() {
            let path = dir.join(format!("part-{p}.jsonl"));
            std::fs::write(&path, lines.join("\n") + "\n").unwrap();
            paths.push(format!("{:?}", path.display().to_string()));
        }
        let pipeline = write_pipeline(
            dir,
            &format!("kind = \"file\"\npaths = [{}]", paths.join(", ")),
            "kind = \"file\"\npath = \"out/alertas.jsonl\"",
            "path = \"out/dead-letter.jsonl\"",
            "",
        );
        let summary = job::run(&pipeline, &RunOptions::default(), &PluginRuntime::new().unwrap()).unwrap();
        let results = std::fs::read_to_string(dir.join("out/alertas.jsonl")).unwrap().lines().count();
        (keyed_view(&dir.join("out/alertas.jsonl")), summary.counters, results)
    }
}

fn write_pipeline(dir: &Path, source: &str, sink: &str, dead_letter: &str, extra: &str) -> Pipeline {
    let text = format!(
        r#"
name = "stock-alert"
key = ["producto", "mercado"]
[source]
{source}
[filter]
tipo = "stock.actualizado"
[event_time]
field = "fecha_ms"
watermark_delay = "2m"
[window]
kind = "tumbling"
size = "5m"
[plugin]
path = "{plugin}"
[plugin.config]
threshold = 10
[sink]
{sink}
[late]
path = "out/late.jsonl"
[dead_letter]
{dead_letter}
{extra}
"#,
        plugin = plugin("min-stock").display()
    );
    let path = dir.join("pipeline.toml");
    std::fs::write(&path, text).unwrap();
    Pipeline::load(&path).unwrap()
}

fn kafka_source(broker: &Tansu, group: &str) -> String {
    format!(
        "kind = \"kafka\"\nbrokers = \"{}\"\ntopic = \"{INPUT}\"\ngroup = \"{group}\"\nbounded = true\n\
         properties = {{ \"session.timeout.ms\" = \"6000\", \"heartbeat.interval.ms\" = \"1000\" }}",
        broker.brokers
    )
}

#[test]
fn kafka_to_kafka_gives_the_file_runs_keyed_results_and_dead_letters_with_their_origin() {
    let broker = Tansu::start();
    let s = stream(100_000, 0.003);
    assert!(s.bad > 200, "a few hundred malformed records ({})", s.bad);
    s.produce(&broker);
    broker.create_topic("inventario.alertas", 3);
    broker.create_topic("km0.dead-letter", 1);

    let files = tempfile::tempdir().unwrap();
    let (want, want_counters, _) = s.file_run(files.path());
    assert!(want.len() > 100, "the file run raises alerts ({})", want.len());
    assert_eq!(want_counters.dead_lettered as usize, s.bad);

    let dir = tempfile::tempdir().unwrap();
    let pipeline = write_pipeline(
        dir.path(),
        &kafka_source(&broker, "km0-test"),
        "kind = \"kafka\"\ntopic = \"inventario.alertas\"",
        "topic = \"km0.dead-letter\"",
        "[checkpoints]\ndir = \"out/checkpoints\"\ninterval = \"1h\"\nevery_records = 20000",
    );
    let summary = job::run(&pipeline, &RunOptions::default(), &PluginRuntime::new().unwrap()).unwrap();
    assert_eq!(summary.counters, want_counters, "same counts as the file run");
    assert!(summary.checkpoints >= 4, "checkpoints taken: {}", summary.checkpoints);

    // The output topic, read by a plain consumer: same keyed view.
    let out = broker.read_all("inventario.alertas");
    assert_eq!(out.len() as u64, summary.counters.emitted);
    let got = keyed_view_of(&out);
    assert_eq!(got.len(), want.len());
    assert!(got == want, "the keyed view of inventario.alertas differs from the file run's");

    // Dead letters: the original bytes, the reason and where they came from.
    let dead = broker.read_all("km0.dead-letter");
    assert_eq!(dead.len(), s.bad, "every malformed record is dead-lettered once");
    for d in &dead {
        let h: BTreeMap<&str, &str> = d.headers.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        assert!(!h["km0.reason"].is_empty());
        let (topic, partition) = h["km0.source"].rsplit_once('/').unwrap();
        assert_eq!(topic, INPUT);
        let (p, o): (usize, usize) = (partition.parse().unwrap(), h["km0.offset"].parse().unwrap());
        assert_eq!(d.value, s.parts[p][o].as_bytes(), "the dead letter is the original record");
    }

    // Lag: everything read; the group holds the final offsets.
    let ends = broker.high_watermarks(INPUT);
    assert_eq!(summary.lag.len(), PARTITIONS as usize);
    for (l, end) in summary.lag.iter().zip(&ends) {
        assert_eq!((l.lag, l.high_watermark, l.position), (0, *end, *end), "{l:?}");
    }
    let committed = broker.committed("km0-test", INPUT, PARTITIONS);
    assert_eq!(committed, ends, "offsets committed to the group after the run");
}

/// Run `km0 run pipeline.toml` and SIGKILL it once `kills[i]` checkpoints exist, then
/// restart it (it recovers from its latest checkpoint); the last run goes to the end.
fn run_with_kills(dir: &Path, kills: &[usize]) -> usize {
    let chk = dir.join("out/checkpoints");
    // The newest checkpoint's number (older ones are pruned).
    let count = || {
        std::fs::read_dir(&chk)
            .map(|d| {
                d.flatten()
                    .filter_map(|e| {
                        e.file_name().to_string_lossy().strip_prefix("chk-")?.parse::<usize>().ok()
                    })
                    .max()
                    .unwrap_or(0)
            })
            .unwrap_or(0)
    };
    let mut killed = 0;
    for &at in kills {
        let mut child = Command::new(km0_bin())
            .arg("run")
            .arg(dir.join("pipeline.toml"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let t = Instant::now();
        loop {
            if count() >= at {
                child.kill().unwrap(); // SIGKILL
                child.wait().unwrap();
                killed += 1;
                break;
            }
            if let Some(status) = child.try_wait().unwrap() {
                assert!(status.success(), "km0 failed before the kill point");
                break;
            }
            assert!(t.elapsed() < Duration::from_secs(240), "no progress");
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    let out = Command::new(km0_bin()).arg("run").arg(dir.join("pipeline.toml")).output().unwrap();
    assert!(out.status.success(), "final run: {}", String::from_utf8_lossy(&out.stderr));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("km0: lag"), "the run summary reports lag: {err}");
    killed
}

#[test]
fn sigkills_change_nothing_in_the_output_topic_or_the_postgres_table() {
    let broker = Tansu::start();
    let pg = Postgres::start();
    let s = stream(100_000, 0.001);
    s.produce(&broker);
    broker.create_topic("inventario.alertas", 3);
    let files = tempfile::tempdir().unwrap();
    let (want, _, results) = s.file_run(files.path());

    let checkpoints =
        "[checkpoints]\ndir = \"out/checkpoints\"\ninterval = \"1h\"\nevery_records = 4000\nretain = 2";
    // Kafka -> Kafka (keyed upserts).
    let dir = tempfile::tempdir().unwrap();
    write_pipeline(
        dir.path(),
        &kafka_source(&broker, "km0-kill-kafka"),
        "kind = \"kafka\"\ntopic = \"inventario.alertas\"",
        "path = \"out/dead-letter.jsonl\"",
        checkpoints,
    );
    let killed = run_with_kills(dir.path(), &[2, 7, 13, 19]);
    assert!(killed >= 3, "killed {killed} times");
    let got = keyed_view_of(&broker.read_all("inventario.alertas"));
    assert!(got == want, "after {killed} SIGKILLs the topic's keyed view differs from the uninterrupted run");

    // Kafka -> PostgreSQL (results and progress in one transaction).
    let dir = tempfile::tempdir().unwrap();
    write_pipeline(
        dir.path(),
        &kafka_source(&broker, "km0-kill-pg"),
        &format!("kind = \"postgres\"\nurl = \"{}\"\ntable = \"alertas\"", pg.url()),
        "path = \"out/dead-letter.jsonl\"",
        checkpoints,
    );
    let killed = run_with_kills(dir.path(), &[3, 8, 14, 20]);
    assert!(killed >= 3, "killed {killed} times");
    let rows = pg.query("SELECT key, value::text FROM alertas ORDER BY key");
    let table: BTreeMap<String, serde_json::Value> =
        rows.iter().map(|r| (r[0].clone(), serde_json::from_str(&r[1]).unwrap())).collect();
    assert_eq!(table.len(), want.len(), "no key missing or extra");
    assert!(table == want, "after {killed} SIGKILLs the table differs from the uninterrupted run");
    // Every result written once, in exactly one committed epoch.
    let epochs = pg.query("SELECT epoch, records, results FROM km0_sink_epochs ORDER BY epoch");
    let n: Vec<i64> = epochs.iter().map(|r| r[0].parse().unwrap()).collect();
    assert_eq!(n, (1..=n.len() as i64).collect::<Vec<_>>(), "epochs 1..n, none twice");
    let written: usize = epochs.iter().map(|r| r[2].parse::<usize>().unwrap()).sum();
    assert_eq!(written, results, "results written across epochs = results of the uninterrupted run");
    let records: Vec<i64> = epochs.iter().map(|r| r[1].parse().unwrap()).collect();
    assert!(records.windows(2).all(|w| w[0] < w[1]), "progress only moves forward: {records:?}");
}

#[test]
fn a_transactional_sink_on_a_broker_without_transactions_is_refused_at_start() {
    let broker = Tansu::start();
    broker.create_topic(INPUT, 1);
    broker.create_topic("inventario.alertas", 1);
    let dir = tempfile::tempdir().unwrap();
    let pipeline = write_pipeline(
        dir.path(),
        &kafka_source(&broker, "km0-txn"),
        "kind = \"kafka\"\ntopic = \"inventario.alertas\"\nmode = \"transactional\"",
        "path = \"out/dead-letter.jsonl\"",
        "",
    );
    let err =
        job::run(&pipeline, &RunOptions::default(), &PluginRuntime::new().unwrap()).unwrap_err().to_string();
    assert!(err.contains("does not support them (no EndTxn, API key 26)"), "{err}");
    assert!(err.contains("mode = \"upsert\"") && err.contains("kind = \"postgres\""), "{err}");
}

//! Kafka in and out, against a real broker (tansu, started by the test) and a real
//! PostgreSQL cluster: the stock-alert job from a 3-partition topic gives the same
//! keyed results as the embedded file run of the same records, dead letters carry the
//! original bytes and their origin, SIGKILLs at several points change nothing in the
//! keyed view of the output topic or in the PostgreSQL table, where every result is
//! written exactly once, and a stalled sink broker pauses the source with memory flat.

use km0::job::{self, RunOptions};
use km0::plugin::PluginRuntime;
use km0_e2e::services::{keyed_view_of, Postgres, Tansu};
use km0_e2e::stock_topic::*;
use km0_e2e::*;
use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

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

    // Without a checkpoint, `start` decides: the group's offsets (all read) or the log
    // ends give nothing to read; `earliest` reads everything again.
    for (start, want_read) in [("committed", 0), ("latest", 0), ("earliest", want_counters.read)] {
        let dir = tempfile::tempdir().unwrap();
        let source = format!("{}\nstart = \"{start}\"", kafka_source(&broker, "km0-test"));
        let p =
            write_pipeline(dir.path(), &source, "kind = \"stdout\"", "path = \"out/dead-letter.jsonl\"", "");
        let opts = RunOptions { output: Some(dir.path().join("out.jsonl")), ..Default::default() };
        let s = job::run(&p, &opts, &PluginRuntime::new().unwrap()).unwrap();
        assert_eq!(s.counters.read, want_read, "start = {start}");
    }
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
    let epochs = pg.query("SELECT epoch, results_upto, results FROM km0_sink_epochs ORDER BY epoch");
    let n: Vec<i64> = epochs.iter().map(|r| r[0].parse().unwrap()).collect();
    assert_eq!(n, (1..=n.len() as i64).collect::<Vec<_>>(), "epochs 1..n, none twice");
    let written: usize = epochs.iter().map(|r| r[2].parse::<usize>().unwrap()).sum();
    assert_eq!(written, results, "results written across epochs = results of the uninterrupted run");
    let upto: Vec<usize> = epochs.iter().map(|r| r[1].parse().unwrap()).collect();
    let mut sum = 0;
    for (e, u) in epochs.iter().zip(&upto) {
        sum += e[2].parse::<usize>().unwrap();
        assert_eq!(*u, sum, "each epoch holds the results after the previous one's: {upto:?}");
    }
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

/// Resident memory of a process, in MiB.
fn rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0.0);
    kb / 1024.0
}

/// `consumer lag` log lines: (partition, lag, position, high watermark).
fn lag_lines(log: &str) -> Vec<(String, i64, i64, i64)> {
    let field = |l: &str, name: &str| -> String {
        let at = l.find(&format!("{name}=")).map(|i| i + name.len() + 1).unwrap_or(l.len());
        l[at..].split_whitespace().next().unwrap_or_default().to_string()
    };
    log.lines()
        .filter(|l| l.contains("consumer lag"))
        .map(|l| {
            let n = |name| field(l, name).parse::<i64>().unwrap();
            (field(l, "partition"), n("lag"), n("position"), n("high_watermark"))
        })
        .collect()
}

#[test]
fn a_stalled_sink_pauses_the_source_with_bounded_memory_and_lag_matching_the_broker() {
    let (source, sink) = (Tansu::start(), Tansu::start());
    let s = stream(150_000, 0.0);
    s.produce(&source);
    sink.create_topic("inventario.alertas", 1);
    let ends = source.high_watermarks(INPUT);
    let backlog: usize = s.parts.iter().flatten().map(|l| l.len() + 1).sum();

    let dir = tempfile::tempdir().unwrap();
    // Every window alerts (threshold above any stock), so the sink has much to write.
    write_pipeline_with(
        dir.path(),
        1_000_000,
        &format!("{}\nlag_interval = \"200ms\"", kafka_source(&source, "km0-slow")),
        &format!(
            "kind = \"kafka\"\nbrokers = \"{}\"\ntopic = \"inventario.alertas\"\nmax_in_flight = 500",
            sink.brokers
        ),
        "path = \"out/dead-letter.jsonl\"",
        "",
    );
    let log_path = dir.path().join("km0.log");
    let mut child = Command::new(km0_bin())
        .arg("run")
        .arg(dir.path().join("pipeline.toml"))
        .env("KM0_LOG", "km0=info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log_path).unwrap())
        .spawn()
        .unwrap();
    let log = || std::fs::read_to_string(&log_path).unwrap_or_default();

    // Stall the sink's broker once the job is under way.
    let t = Instant::now();
    while lag_lines(&log()).is_empty() {
        assert!(t.elapsed() < Duration::from_secs(60), "the job reports no lag: {}", log());
        std::thread::sleep(Duration::from_millis(20));
    }
    sink.freeze(true);
    let t = Instant::now();
    while !log().contains("source paused") {
        assert!(t.elapsed() < Duration::from_secs(60), "the source never paused: {}", log());
        std::thread::sleep(Duration::from_millis(20));
    }
    // While paused: positions stand still and memory does not grow.
    std::thread::sleep(Duration::from_millis(500));
    let rss_paused = rss_mib(child.id());
    let lines_before = lag_lines(&log()).len();
    let mut rss_max = rss_paused;
    let stall = Instant::now();
    while stall.elapsed() < Duration::from_secs(4) {
        rss_max = rss_max.max(rss_mib(child.id()));
        std::thread::sleep(Duration::from_millis(50));
    }
    let during: Vec<_> = lag_lines(&log())[lines_before..].to_vec();
    sink.freeze(false);
    let status = child.wait().unwrap();
    assert!(status.success(), "{}", log());

    assert!(during.len() >= 2 * PARTITIONS as usize, "lag reported while paused: {during:?}");
    let still: BTreeMap<&str, i64> = during.iter().map(|(p, _, pos, _)| (p.as_str(), *pos)).collect();
    for (p, _, pos, _) in &during {
        assert_eq!(still[p.as_str()], *pos, "{p} advanced while the source was paused");
    }
    let remaining: i64 = during.iter().rev().take(PARTITIONS as usize).map(|(_, lag, _, _)| lag).sum();
    assert!(remaining > 10_000, "a backlog remains in the topic while paused ({remaining} records)");
    assert!(
        rss_max - rss_paused < 16.0,
        "memory grew from {rss_paused:.0} to {rss_max:.0} MiB while paused (backlog {} MiB)",
        backlog >> 20
    );
    // Every lag report agrees with the broker's log ends (nothing is produced meanwhile).
    let all = lag_lines(&log());
    for (p, lag, pos, high) in &all {
        let i: usize = p.rsplit_once('/').unwrap().1.parse().unwrap();
        assert_eq!(*high, ends[i], "{p}: reported log end vs the broker's high watermark");
        assert_eq!(*lag, high - pos, "{p}: lag = log end - position");
    }
    let text = log();
    assert!(text.contains("the source paused"), "the summary counts the pauses: {text}");
    assert!(text.contains(&format!("km0: lag {INPUT}/0: 0 ")), "{text}");
}

#[test]
fn a_checkpoint_on_the_last_record_loses_no_result_in_postgres() {
    let broker = Tansu::start();
    let pg = Postgres::start();
    let s = stream(100_000, 0.0);
    s.produce(&broker);
    // Every window alerts: one epoch holds more results than one upsert statement takes.
    let files = tempfile::tempdir().unwrap();
    let (want, _, results) = s.file_run_with(files.path(), 1_000_000);
    assert!(results > 5_000, "{results} results");
    // The only checkpoint falls on the last record; every window then fires after it.
    let total: usize = s.parts.iter().map(Vec::len).sum();
    let dir = tempfile::tempdir().unwrap();
    let p = write_pipeline_with(
        dir.path(),
        1_000_000,
        &kafka_source(&broker, "km0-last"),
        &format!("kind = \"postgres\"\nurl = \"{}\"\ntable = \"alertas\"", pg.url()),
        "path = \"out/dead-letter.jsonl\"",
        &format!("[checkpoints]\ndir = \"out/checkpoints\"\ninterval = \"1h\"\nevery_records = {total}"),
    );
    let summary = job::run(&p, &RunOptions::default(), &PluginRuntime::new().unwrap()).unwrap();
    assert_eq!(summary.checkpoints, 1);
    let rows = pg.query("SELECT key, value::text FROM alertas ORDER BY key");
    let table: BTreeMap<String, serde_json::Value> =
        rows.iter().map(|r| (r[0].clone(), serde_json::from_str(&r[1]).unwrap())).collect();
    assert!(table == want, "{} rows, {} expected", table.len(), want.len());
    let upto = pg.query("SELECT max(results_upto) FROM km0_sink_epochs");
    assert_eq!(upto[0][0].parse::<usize>().unwrap(), results);
}

#[test]
fn a_result_larger_than_the_producers_limit_is_dead_lettered_and_the_job_goes_on() {
    // The hostile plugin emits 300 kB per window; the sink's producer takes 200 kB.
    let broker = Tansu::start();
    broker.create_topic("grandes", 1);
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        r#"
name = "grandes"
key = ["producto"]
[source]
kind = "file"
path = {trace:?}
[event_time]
field = "fecha_ms"
watermark_delay = "2m"
[window]
kind = "tumbling"
size = "5m"
[plugin]
path = {plugin:?}
[plugin.config]
behaviour = "big"
[sink]
kind = "kafka"
brokers = "{brokers}"
topic = "grandes"
[sink.properties]
"message.max.bytes" = "200000"
[late]
path = "out/late.jsonl"
[dead_letter]
path = "out/dead.jsonl"
"#,
        trace = golden_trace().display().to_string(),
        plugin = plugin("hostile").display().to_string(),
        brokers = broker.brokers,
    );
    let path = dir.path().join("pipeline.toml");
    std::fs::write(&path, text).unwrap();
    let p = km0::pipeline::Pipeline::load(&path).unwrap();
    let s = job::run(&p, &RunOptions::default(), &PluginRuntime::new().unwrap()).expect("the job goes on");
    assert!(s.counters.emitted > 0);
    let dead = read_jsonl(&dir.path().join("out/dead.jsonl"));
    assert_eq!(dead.len() as u64, s.counters.emitted, "every result is dead-lettered");
    assert!(
        dead.iter().all(|d| d["reason"].as_str().unwrap().contains("message.max.bytes (200000)")),
        "{dead:?}"
    );
    assert!(dead.iter().all(|d| d["value"].as_str().unwrap().len() > 300_000));
    assert!(broker.read_all("grandes").is_empty());
}

#[test]
fn messages_with_line_breaks_of_their_own_read_as_their_json_says() {
    // A message is one record whatever its line breaks: JSON's whitespace (pretty-printed,
    // a trailing `\n`, `\r\n` or `\r`) is read as in a compact record; a raw line break
    // inside a string is not JSON. Hand-checked: one 5-minute window from `t0`, alerts
    // below 10.
    let broker = Tansu::start();
    broker.create_topic(INPUT, 1);
    let t0 = 1_757_836_800_000i64; // a multiple of 5 minutes
    let event = |producto: &str, stock: i64, dt: i64| {
        format!(
            r#"{{"tipo": "stock.actualizado", "producto": "{producto}", "mercado": "m", "stock_actual": {stock}, "fecha_ms": {}}}"#,
            t0 + dt
        )
    };
    let messages = [
        event("a", 50, 1_000),
        // Compact, without a line break: taken the way file lines are.
        event("h", 4, 1_500),
        // Pretty-printed: (a, m) holds 50 and 7.
        format!(
            "{{\n  \"tipo\": \"stock.actualizado\",\n  \"producto\": \"a\",\n  \"mercado\": \"m\",\r\n  \
             \"stock_actual\": 7,\n  \"fecha_ms\": {}\n}}",
            t0 + 2_000
        ),
        event("b", 8, 3_000) + "\n",
        event("c", 9, 4_000) + "\r\n",
        event("e", 6, 5_000) + "\r",
        event("e", 30, 5_500) + " \t ",
        // Not JSON: a raw line break in a string; two objects (the first alone would alert).
        event("d\nx", 1, 6_000),
        event("g", 3, 6_500) + "\n{\"tipo\": \"stock.actualizado\"}",
        event("f", 5, 7_000).replace(": 5,", ":\n5,"),
        // Closes the window (the watermark passes its end).
        event("z", 100, 600_000),
    ];
    let records: Vec<(i32, Option<String>, Vec<u8>)> =
        messages.iter().map(|m| (0, None, m.clone().into_bytes())).collect();
    broker.produce(INPUT, &records);
    let dir = tempfile::tempdir().unwrap();
    let p = write_pipeline(
        dir.path(),
        &kafka_source(&broker, "km0-breaks"),
        "kind = \"file\"\npath = \"out/alertas.jsonl\"",
        "path = \"out/dead-letter.jsonl\"",
        "",
    );
    let s = job::run(&p, &RunOptions::default(), &PluginRuntime::new().unwrap()).unwrap();
    assert_eq!(s.counters.read, messages.len() as u64);
    let got: Vec<(String, i64, u64)> = keyed_view(&dir.path().join("out/alertas.jsonl"))
        .values()
        .map(|v| {
            (
                v["producto"].as_str().unwrap().to_string(),
                v["stock_minimo"].as_i64().unwrap(),
                v["actualizaciones"].as_u64().unwrap(),
            )
        })
        .collect();
    let want = [("a", 7, 2), ("b", 8, 1), ("c", 9, 1), ("e", 6, 2), ("f", 5, 1), ("h", 4, 1)];
    assert_eq!(got, want.map(|(p, m, n)| (p.to_string(), m, n)));
    let dead = read_jsonl(&dir.path().join("out/dead-letter.jsonl"));
    let dead: Vec<&str> = dead.iter().map(|d| d["record"].as_str().unwrap()).collect();
    assert_eq!(dead, [&messages[7], &messages[8]], "the original bytes");
}

#[test]
fn a_bounded_run_restarted_stops_where_it_would_have_stopped() {
    // A bounded run ends at the log ends seen when it first started: records produced
    // after that are not read, even by a run that resumes from its savepoint later.
    let broker = Tansu::start();
    let s = stream(20_000, 0.0);
    s.produce(&broker);
    let total: usize = s.parts.iter().map(Vec::len).sum();
    let dir = tempfile::tempdir().unwrap();
    let p = write_pipeline(
        dir.path(),
        &kafka_source(&broker, "km0-bounded"),
        "kind = \"file\"\npath = \"out/alertas.jsonl\"",
        "path = \"out/dead-letter.jsonl\"",
        "",
    );
    let runtime = PluginRuntime::new().unwrap();
    let stopped =
        job::run(&p, &RunOptions { stop_with_savepoint_after: Some(8_000), ..Default::default() }, &runtime)
            .unwrap();
    // More records arrive in every partition after the first start.
    let extra: Vec<(i32, Option<String>, Vec<u8>)> =
        (0..3).map(|p| (p, None, b"{\"tipo\":\"otro\",\"fecha_ms\":1}".to_vec())).collect();
    broker.produce(INPUT, &extra);
    let resumed =
        job::run(&p, &RunOptions { from_savepoint: stopped.savepoint, ..Default::default() }, &runtime)
            .unwrap();
    assert_eq!(resumed.counters.read as usize, total, "the resumed run stops at the first start's log ends");
    assert_eq!(resumed.records_this_run as usize, total - 8_000);
}

#[test]
fn a_live_swap_on_a_kafka_source_gives_the_output_of_an_offline_deploy_at_the_same_record() {
    use km0::control::client::{call, send};
    let broker = Tansu::start();
    let spec =
        km0::generate::StockStream { events: 30_000, seed: 44, late_fraction: 0.004, ..Default::default() };
    let mut all = Vec::new();
    km0::generate::stock_stream(&spec, &mut all).unwrap();
    let lines: Vec<&[u8]> = all.split(|&b| b == b'\n').filter(|l| !l.is_empty()).collect();
    let half = lines.len() / 2;
    let records = |ls: &[&[u8]]| ls.iter().map(|l| (0, None, l.to_vec())).collect::<Vec<_>>();
    broker.create_topic("vivo", 1);
    broker.produce("vivo", &records(&lines[..half]));

    // The live job: Kafka in (unbounded), min-stock 0.1, checkpoints; v2 swapped in after
    // the first half.
    let dir = tempfile::tempdir().unwrap();
    let source =
        format!("kind = \"kafka\"\nbrokers = \"{}\"\ntopic = \"vivo\"\ngroup = \"km0-swap\"", broker.brokers);
    let job = StockJob {
        source,
        extra: "[checkpoints]\ndir = \"out/checkpoints\"\ninterval = \"500ms\"".into(),
        ..StockJob::new("2m", 10)
    }
    .write(dir.path());
    let port = km0_e2e::services::free_port();
    let url = format!("http://127.0.0.1:{port}");
    let child = Command::new(km0_bin())
        .args(["run", "--http", &format!("127.0.0.1:{port}")])
        .arg(&job)
        .env("KM0_TOKEN", "t")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let read = |n: usize| {
        km0_e2e::services::wait_for(&format!("{n} records read"), Duration::from_secs(60), || {
            call(&url, "GET", "/api/v1/job", None).is_ok_and(|(c, b)| {
                c == 200
                    && serde_json::from_str::<serde_json::Value>(&b).unwrap()["counters"]["read"] == n as u64
            })
        })
    };
    read(half);
    let v2 = std::fs::read(plugin("min-stock-v2")).unwrap();
    let (code, body) = send(&url, "POST", "/api/v1/deployments", Some("t"), &v2).unwrap();
    assert_eq!(code, 200, "{body}");
    let d: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!((d["status"].as_str(), d["at_record"].as_u64()), (Some("swapped"), Some(half as u64)), "{d}");
    broker.produce("vivo", &records(&lines[half..]));
    read(lines.len());
    // The consumer lag the job reports (status and /metrics) reaches 0 once it has read
    // the log's end, for the topic's one partition.
    km0_e2e::services::wait_for("the consumer lag is 0 in /metrics", Duration::from_secs(30), || {
        let text = call(&url, "GET", "/metrics", None).map(|(_, t)| t).unwrap_or_default();
        text.lines().any(|l| {
            l.starts_with("km0_consumer_lag_records{")
                && l.contains("partition=\"vivo/0\"")
                && l.ends_with(" 0.0")
        })
    });
    let status: serde_json::Value =
        serde_json::from_str(&call(&url, "GET", "/api/v1/job", None).unwrap().1).unwrap();
    assert_eq!(status["lag"][0]["high_watermark"], lines.len() as u64, "{status}");
    assert_eq!(call(&url, "POST", "/api/v1/stop?mode=drain", Some("t")).unwrap().0, 200);
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    // Offline, on the same records: stop with a savepoint at that record, deploy v2 from it.
    let off = tempfile::tempdir().unwrap();
    std::fs::write(off.path().join("in.jsonl"), &all).unwrap();
    let p = km0::pipeline::Pipeline::load(&StockJob::new("2m", 10).write(off.path())).unwrap();
    let runtime = PluginRuntime::new().unwrap();
    let opts = RunOptions { stop_with_savepoint_after: Some(half as u64), ..Default::default() };
    let stopped = job::run(&p, &opts, &runtime).unwrap();
    let savepoint = stopped.savepoint.unwrap();
    job::deploy(&p, &plugin("min-stock-v2"), &savepoint, &RunOptions::default(), &runtime).unwrap();
    let results = |d: &Path| std::fs::read_to_string(d.join("out/alertas.jsonl")).unwrap();
    let live = results(dir.path());
    assert!(live.lines().count() > 50 && live.contains("suma_delta"));
    assert!(live == results(off.path()), "the live swap on Kafka differs from the offline deploy");
}

#[test]
fn a_four_partition_topic_runs_a_task_per_partition_as_the_files_do_and_misrouted_records_are_dead_lettered()
{
    const TOPIC: &str = "tareas.eventos";
    let broker = Tansu::start();
    broker.create_topic(TOPIC, 4);
    // The stream by a hash of producto over 4 partitions, keyed by producto.
    let spec =
        km0::generate::StockStream { events: 40_000, seed: 21, late_fraction: 0.004, ..Default::default() };
    let mut buf = Vec::new();
    km0::generate::stock_stream(&spec, &mut buf).unwrap();
    let mut parts: Vec<Vec<String>> = vec![Vec::new(); 4];
    let mut records = Vec::new();
    for line in String::from_utf8(buf).unwrap().lines() {
        let producto =
            serde_json::from_str::<serde_json::Value>(line).unwrap()["producto"].as_str().map(String::from);
        let p =
            producto.as_deref().map_or(0, |k| k.bytes().fold(0u32, |h, b| h.wrapping_mul(31) + b as u32) % 4);
        parts[p as usize].push(line.to_string());
        records.push((p as i32, producto, line.as_bytes().to_vec()));
    }
    // Two records whose message key is not their producto, and one with none: each task
    // owns the keys of its partition, so these are dead letters (not in the file run).
    let stray = r#"{"tipo":"stock.actualizado","producto":"arroz-bomba","mercado":"lleida","stock_actual":1,"delta":-1,"fecha_ms":1757836900000}"#;
    records.push((1, Some("otro".into()), stray.as_bytes().to_vec()));
    records.push((2, Some("arroz".into()), stray.as_bytes().to_vec()));
    records.push((3, None, stray.as_bytes().to_vec()));
    broker.produce(TOPIC, &records);

    let source = |group: &str| {
        format!(
            "kind = \"kafka\"\nbrokers = \"{}\"\ntopic = \"{TOPIC}\"\ngroup = \"{group}\"\nbounded = true\n\
             partitioned_by = [\"producto\"]",
            broker.brokers
        )
    };
    let tasks = |dir: &Path, source: &str| {
        let job = StockJob {
            source: source.into(),
            event_time: "watermark = \"per-partition\"".into(),
            ..StockJob::new("2m", 10)
        };
        km0::pipeline::Pipeline::load(&job.write(dir)).unwrap()
    };
    let outputs = |dir: &Path, f: &str| -> Vec<String> {
        (0..4)
            .map(|t| std::fs::read_to_string(dir.join(format!("out/{f}-task-{t}.jsonl"))).unwrap_or_default())
            .collect()
    };
    let runtime = PluginRuntime::new().unwrap();

    // The same partitions as files: a task per file.
    let files = tempfile::tempdir().unwrap();
    let mut paths = Vec::new();
    for (p, lines) in parts.iter().enumerate() {
        let path = files.path().join(format!("part-{p}.jsonl"));
        std::fs::write(&path, lines.join("\n") + "\n").unwrap();
        paths.push(format!("{:?}", path.display().to_string()));
    }
    let file_source =
        format!("kind = \"file\"\npaths = [{}]\npartitioned_by = [\"producto\"]", paths.join(", "));
    job::run(&tasks(files.path(), &file_source), &RunOptions::default(), &runtime).unwrap();
    let want = outputs(files.path(), "alertas");
    assert!(
        want.iter().all(|w| w.lines().count() > 20),
        "alerts per task: {:?}",
        want.iter().map(|w| w.lines().count()).collect::<Vec<_>>()
    );

    for (n, group) in [(2, "km0-tasks-2"), (1, "km0-tasks-1")] {
        let dir = tempfile::tempdir().unwrap();
        let opts = RunOptions { parallelism: Some(n), ..Default::default() };
        let s = job::run(&tasks(dir.path(), &source(group)), &opts, &runtime).unwrap();
        assert_eq!(s.counters.read, records.len() as u64);
        assert_eq!(s.counters.dead_lettered, 3, "parallelism {n}");
        let got = outputs(dir.path(), "alertas");
        for t in 0..4 {
            assert!(got[t] == want[t], "parallelism {n}: task {t} differs from the file task");
        }
        let dead: Vec<serde_json::Value> =
            outputs(dir.path(), "dead-letter").iter().flat_map(|t| t.lines().map(json)).collect();
        let reasons: Vec<&str> = dead.iter().map(|d| d["reason"].as_str().unwrap()).collect();
        assert_eq!(reasons.len(), 3, "{reasons:?}");
        assert!(
            reasons
                .iter()
                .any(|r| r.contains("message key \"otro\" is not its `source.partitioned_by` fields")),
            "{reasons:?}"
        );
        assert!(reasons.iter().any(|r| r.contains("no message key")), "{reasons:?}");
    }
}

fn json(line: &str) -> serde_json::Value {
    serde_json::from_str(line).unwrap()
}

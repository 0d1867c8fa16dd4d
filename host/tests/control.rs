//! The control API of a running job, with the real binary over real HTTP: status, a
//! savepoint on demand, stop with a savepoint and stop draining the windows, the token,
//! and the refusal to listen beyond loopback without one. Resuming from the savepoints
//! gives the output of an uninterrupted run.

mod common;
use common::*;

use km0::control::client::call;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A stock-alert pipeline over the followed file `dir/live.jsonl`, outputs under `out`.
fn pipeline(dir: &Path, out: &str) -> PathBuf {
    stock_pipeline(dir, &dir.join("live.jsonl"), out, "")
}

#[test]
fn a_running_job_reports_its_status_writes_savepoints_and_stops_on_request() {
    let dir = tempfile::tempdir().unwrap();
    let text = stream(60_000, 31);
    let first: String = text.lines().take(30_000).map(|l| format!("{l}\n")).collect();
    std::fs::write(dir.path().join("live.jsonl"), &first).unwrap();
    let job = pipeline(dir.path(), "out");
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let child = start_following(&job, port, "s3cret");
    wait_for_read(&url, 30_000);
    let (code, _) = call(&url, "GET", "/healthz", None).unwrap();
    assert_eq!(code, 200);
    assert_eq!(call(&url, "GET", "/readyz", None).unwrap().0, 200);
    let status = json(&call(&url, "GET", "/api/v1/job", None).unwrap().1);
    assert_eq!(status["state"], "running");
    assert_eq!(status["pipeline"], "stock-alert");
    assert_eq!(status["aggregations"][0]["plugin"], "min-stock");
    assert!(status["aggregations"][0]["open_windows"].as_u64().unwrap() > 0);
    assert_eq!(status["partitions"].as_array().unwrap().len(), 1);

    // Changing anything needs the token: without it, or with another, 401 and nothing done.
    for token in [None, Some("wrong")] {
        let (code, body) = call(&url, "POST", "/api/v1/savepoints", token).unwrap();
        assert_eq!(code, 401, "{body}");
        let (code, _) = call(&url, "POST", "/api/v1/stop", token).unwrap();
        assert_eq!(code, 401);
    }
    assert!(!dir.path().join("out/savepoints").exists(), "no savepoint was written");
    assert_eq!(call(&url, "POST", "/api/v1/stop?mode=later", Some("s3cret")).unwrap().0, 400);

    // A savepoint on demand; the job goes on.
    let (code, body) = call(&url, "POST", "/api/v1/savepoints", Some("s3cret")).unwrap();
    assert_eq!(code, 200, "{body}");
    let on_demand = PathBuf::from(json(&body)["path"].as_str().unwrap());
    assert!(on_demand.join("savepoint.json").exists());
    assert_eq!(json(&call(&url, "GET", "/api/v1/job", None).unwrap().1)["state"], "running");

    // The rest of the input arrives; stop with a savepoint (the CLI client).
    std::fs::write(dir.path().join("live.jsonl"), &text).unwrap();
    wait_for_read(&url, 60_000);
    let out = Command::new(km0()).args(["stop", "--job", &url]).env("KM0_TOKEN", "s3cret").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let at_stop = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let run = child.wait_with_output().unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    assert!(Path::new(&at_stop).join("savepoint.json").exists(), "{at_stop}");

    // The uninterrupted run.
    reference_run(dir.path(), &job);
    // Resuming from the savepoint taken at the stop ends like the uninterrupted run.
    let r = Command::new(km0())
        .args(["run", "--http", "off"])
        .arg(&job)
        .args(["--from-savepoint", &at_stop])
        .output()
        .unwrap();
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    assert!(stock_outputs(dir.path(), "out") == stock_outputs(dir.path(), "ref"), "resumed output differs");
    // So does resuming from the one taken on demand (its outputs are rewritten after it).
    let r = Command::new(km0())
        .args(["run", "--http", "off"])
        .arg(&job)
        .args(["--from-savepoint", &on_demand.display().to_string()])
        .output()
        .unwrap();
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    assert!(stock_outputs(dir.path(), "out") == stock_outputs(dir.path(), "ref"), "resumed output differs");
}

#[test]
fn stop_with_drain_fires_every_window_like_the_end_of_the_input() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("live.jsonl"), stream(20_000, 32)).unwrap();
    let job = pipeline(dir.path(), "out");
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let child = start_following(&job, port, "t");
    wait_for_read(&url, 20_000);
    let (code, body) = call(&url, "POST", "/api/v1/stop?mode=drain", Some("t")).unwrap();
    assert_eq!(code, 200, "{body}");
    assert!(json(&body)["savepoint"].is_null());
    assert!(child.wait_with_output().unwrap().status.success());
    reference_run(dir.path(), &job);
    assert!(
        stock_outputs(dir.path(), "out") == stock_outputs(dir.path(), "ref"),
        "a drained stop ends like the input's end"
    );
}

#[test]
fn listening_beyond_loopback_needs_an_explicit_token() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("live.jsonl"), "").unwrap();
    let job = pipeline(dir.path(), "out");
    let out = Command::new(km0())
        .args(["run", "--http", "0.0.0.0:0"])
        .arg(&job)
        .env_remove("KM0_TOKEN")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("set KM0_TOKEN"), "{err}");
}

#[test]
fn the_checkpoint_history_shows_each_checkpoint_of_the_run() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("live.jsonl"), stream(30_000, 33)).unwrap();
    let job = stock_pipeline(
        dir.path(),
        &dir.path().join("live.jsonl"),
        "out",
        "[checkpoints]\ndir = \"chk\"\ninterval = \"1h\"\nevery_records = 10000",
    );
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let child = start_following(&job, port, "t");
    // Checkpoints after 10k, 20k and 30k records.
    wait_for("three checkpoints complete", || {
        call(&url, "GET", "/api/v1/checkpoints", None).is_ok_and(|(c, b)| {
            c == 200
                && json(&b)
                    .as_array()
                    .is_some_and(|a| a.len() == 3 && a.iter().all(|c| c["status"] == "complete"))
        })
    });
    let history = json(&call(&url, "GET", "/api/v1/checkpoints", None).unwrap().1);
    let ids: Vec<&str> = history.as_array().unwrap().iter().map(|c| c["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["chk-000001", "chk-000002", "chk-000003"]);
    // The size of a checkpoint is its folder's: every file under it.
    fn bytes(dir: &Path) -> u64 {
        std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .map(
                |e| {
                    if e.file_type().unwrap().is_dir() {
                        bytes(&e.path())
                    } else {
                        e.metadata().unwrap().len()
                    }
                },
            )
            .sum()
    }
    for c in history.as_array().unwrap() {
        let folder = dir.path().join("chk").join(c["id"].as_str().unwrap());
        assert!(folder.exists(), "{c}");
        assert_eq!(c["bytes"].as_u64(), Some(bytes(&folder)), "{c}");
        assert!(c["pause_ms"].as_f64().unwrap() >= 0.0 && c["write_ms"].as_f64().unwrap() >= 0.0, "{c}");
        assert!(c["taken_at_ms"].as_i64().unwrap() > 1_700_000_000_000);
    }
    let status = json(&call(&url, "GET", "/api/v1/job", None).unwrap().1);
    assert_eq!(status["checkpoints"], 3);
    assert_eq!(call(&url, "POST", "/api/v1/stop?mode=drain", Some("t")).unwrap().0, 200);
    assert!(child.wait_with_output().unwrap().status.success());
}

#[test]
fn metrics_parse_as_prometheus_text_and_agree_with_the_status_and_the_input() {
    use km0::generate::{stock_stream, StockStream};
    let dir = tempfile::tempdir().unwrap();
    let spec = StockStream {
        events: 60_000,
        seed: 35,
        late_fraction: 0.01,
        bad_fraction: 0.01,
        ..Default::default()
    };
    let mut input = Vec::new();
    stock_stream(&spec, &mut input).unwrap();
    std::fs::write(dir.path().join("live.jsonl"), &input).unwrap();
    let input = String::from_utf8(input).unwrap();
    let lines = input.lines().count() as u64;
    // The input's clock: the largest event time of a stock update.
    let max_ms = input
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["tipo"] == "stock.actualizado")
        .filter_map(|v| v["fecha_ms"].as_i64())
        .max()
        .unwrap();

    let job = pipeline(dir.path(), "out");
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let child = start_following(&job, port, "t");
    wait_for_read(&url, lines);
    // A savepoint makes the side outputs durable; the status is published right after it.
    assert_eq!(call(&url, "POST", "/api/v1/savepoints", Some("t")).unwrap().0, 200);
    let status = json(&call(&url, "GET", "/api/v1/job", None).unwrap().1);
    let (code, text) = call(&url, "GET", "/metrics", None).unwrap();
    assert_eq!(code, 200);
    let scrape = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string()))).unwrap();
    let value = |name: &str| -> f64 {
        let found: Vec<_> = scrape.samples.iter().filter(|s| s.metric == name).collect();
        assert_eq!(found.len(), 1, "{name}: {found:?}\n{text}");
        assert_eq!(found[0].labels.get("job"), Some("stock-alert"));
        // (The text is OpenMetrics: a counter's family `x` has the sample `x_total`,
        // which this 0.0.4-format parser leaves untyped; the family's type is checked below.)
        match found[0].value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => v,
            ref other => panic!("{name}: {other:?}"),
        }
    };
    let counted =
        |file: &str| std::fs::read_to_string(dir.path().join("out").join(file)).unwrap().lines().count();
    let c = &status["counters"];
    for family in ["km0_records_read", "km0_records_late", "km0_records_dead_lettered"] {
        assert!(text.contains(&format!("# TYPE {family} counter\n")), "{family} is a counter");
    }
    assert!(text.contains("# TYPE km0_watermark_seconds gauge\n"));
    assert!(text.ends_with("# EOF\n"), "a complete OpenMetrics exposition");
    assert_eq!(value("km0_records_read_total") as u64, lines);
    assert_eq!(c["read"], lines);
    let late = value("km0_records_late_total") as u64;
    assert!(late > 0, "the stream has late events");
    assert_eq!((late, c["late"].as_u64().unwrap()), (counted("late.jsonl") as u64, late));
    let dead = value("km0_records_dead_lettered_total") as u64;
    assert!(dead > 0, "the stream has malformed records");
    assert_eq!((dead, c["dead_lettered"].as_u64().unwrap()), (counted("dead.jsonl") as u64, dead));
    assert_eq!(value("km0_records_filtered_total") as u64, c["filtered"].as_u64().unwrap());
    assert_eq!(value("km0_records_accepted_total") as u64, c["accepted"].as_u64().unwrap());
    // The partition's clock is the input's largest event time; the watermark is 2 minutes
    // behind it.
    assert_eq!(value("km0_partition_max_event_time_seconds"), max_ms as f64 / 1e3);
    assert_eq!(value("km0_watermark_seconds"), (max_ms - 120_000) as f64 / 1e3);
    assert_eq!(status["watermark"], max_ms - 120_000);
    assert_eq!(value("km0_open_windows") as u64, status["aggregations"][0]["open_windows"].as_u64().unwrap());
    let state = status["aggregations"][0]["state_bytes"].as_u64().unwrap();
    assert!(state > 0);
    assert_eq!(value("km0_state_bytes") as u64, state);
    assert!(value("km0_event_time_lag_seconds") > 0.0);
    // The latest reasons: the last dead letter's is the dead-letter file's last line's.
    let recent = status["recent_side_outputs"].as_array().unwrap();
    let last_dead = recent.iter().rev().find(|r| r["output"] == "dead_letter").expect("a dead letter");
    let dead_lines = std::fs::read_to_string(dir.path().join("out/dead.jsonl")).unwrap();
    let last_line = json(dead_lines.lines().last().unwrap());
    assert_eq!(last_dead["reason"], last_line["reason"]);
    assert!(recent.iter().any(|r| r["output"] == "late" && r["aggregation"] == "window-aggregate"));
    let counted_in: u64 = recent.iter().map(|r| r["count"].as_u64().unwrap()).sum();
    assert!(counted_in <= late + dead);
    // Plugin calls: a histogram whose count is the status's, every call within +Inf.
    let calls = status["aggregations"][0]["calls"]["count"].as_u64().unwrap();
    assert!(calls > 0);
    let histogram =
        scrape.samples.iter().find(|s| s.metric == "km0_plugin_call_seconds").expect("the histogram");
    let prometheus_parse::Value::Histogram(buckets) = &histogram.value else { panic!("{histogram:?}") };
    assert_eq!(buckets.last().map(|b| (b.less_than, b.count)), Some((f64::INFINITY, calls as f64)));
    assert!(buckets.windows(2).all(|w| w[0].count <= w[1].count), "cumulative buckets");
    let trapped = scrape
        .samples
        .iter()
        .find(|s| s.metric == "km0_plugin_faults_total" && s.labels.get("kind") == Some("trapped"))
        .expect("faults by kind");
    assert!(
        matches!(trapped.value, prometheus_parse::Value::Untyped(v) | prometheus_parse::Value::Counter(v) if v == 0.0)
    );
    assert_eq!(call(&url, "POST", "/api/v1/stop?mode=drain", Some("t")).unwrap().0, 200);
    assert!(child.wait_with_output().unwrap().status.success());
}

#[test]
fn quarantined_keys_are_shown_released_by_the_api_and_kept_in_savepoints() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("live.jsonl"), poisoned_minutes("panics|1", 0, 30)).unwrap();
    let job = poisoned_pipeline(dir.path(), "panics|1");
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let child = start_following(&job, port, "s3cret");
    wait_for("the job answers", || call(&url, "GET", "/api/v1/job", None).is_ok());
    let status = || json(&call(&url, "GET", "/api/v1/job", None).unwrap().1);
    // Windows [0,5) .. [20,25) have fired (watermark 27 min): the third fault of
    // `panics|1` quarantined it; its later events are dead-lettered without a call.
    wait_for("the key is quarantined", || status()["aggregations"][0]["quarantined"] == 1);
    let s = status();
    let a = &s["aggregations"][0];
    let name = a["name"].as_str().unwrap().to_string();
    assert_eq!(a["quarantined_keys"][0]["key"], serde_json::json!(["panics|1"]));
    assert_eq!(a["quarantined_keys"][0]["faults"], 3, "the rows staged since are not called");
    let reason = a["quarantined_keys"][0]["reason"].as_str().unwrap();
    assert!(reason.contains("panicked at") && reason.contains("boom"), "{reason}");
    // What the plugin wrote to stderr is in the status.
    let printed: Vec<&str> = s["recent_side_outputs"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["output"] == "plugin_output")
        .map(|r| r["reason"].as_str().unwrap())
        .collect();
    assert!(printed.iter().any(|p| p.contains("probe of probe: file Err(")), "{s}");
    let metrics = call(&url, "GET", "/metrics", None).unwrap().1;
    assert!(
        metrics.lines().any(|l| l.starts_with("km0_quarantined_keys{") && l.ends_with(" 1.0")
            || l.starts_with("km0_quarantined_keys{") && l.ends_with(" 1")),
        "{metrics}"
    );

    // Releasing needs the token; an unknown aggregation is 404; the key's text escapes `|`.
    let key = format!("/api/v1/quarantine/{name}/panics%5C%7C1");
    assert_eq!(call(&url, "DELETE", &key, None).unwrap().0, 401);
    assert_eq!(call(&url, "DELETE", "/api/v1/quarantine/nope/x", Some("s3cret")).unwrap().0, 404);
    let (code, body) =
        call(&url, "DELETE", &format!("/api/v1/quarantine/{name}/other"), Some("s3cret")).unwrap();
    assert_eq!((code, json(&body)["released"].clone()), (200, serde_json::json!(0)), "{body}");
    let (code, body) = call(&url, "DELETE", &key, Some("s3cret")).unwrap();
    assert_eq!((code, json(&body)["released"].clone()), (200, serde_json::json!(1)), "{body}");
    wait_for("the release shows", || status()["aggregations"][0]["quarantined"] == 0);

    // Released, the key faults again: three more windows quarantine it again.
    append(dir.path(), &poisoned_minutes("panics|1", 30, 50));
    wait_for("the key is quarantined again", || status()["aggregations"][0]["quarantined"] == 1);
    let out = Command::new(km0()).args(["stop", "--job", &url]).env("KM0_TOKEN", "s3cret").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let at_stop = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(child.wait_with_output().unwrap().status.success());

    // Resumed from the savepoint, the key is still quarantined, before any new event.
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let child = Command::new(km0())
        .args(["run", "--follow", "--http", &format!("127.0.0.1:{port}")])
        .arg(&job)
        .args(["--from-savepoint", &at_stop])
        .env("KM0_TOKEN", "s3cret")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let status = || call(&url, "GET", "/api/v1/job", None).ok().map(|(_, b)| json(&b));
    wait_for("the resumed job runs", || status().is_some_and(|s| s["state"] == "running"));
    let s = status().unwrap();
    assert_eq!(s["aggregations"][0]["quarantined"], 1, "{s}");
    assert_eq!(s["aggregations"][0]["quarantined_keys"][0]["key"], serde_json::json!(["panics|1"]));
    let out = Command::new(km0()).args(["stop", "--job", &url]).env("KM0_TOKEN", "s3cret").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(child.wait_with_output().unwrap().status.success());
    // Each poisoned event went to the dead letters once: 50 minutes, none in a result.
    let dead = std::fs::read_to_string(dir.path().join("out/dead.jsonl")).unwrap();
    let events: usize =
        dead.lines().map(json).map(|d| d["event_times"].as_array().map_or(1, |t| t.len())).sum();
    let open = 50 - 45; // minutes 45..50 are in the window that has not fired
    assert!(events >= 50 - open && events <= 50, "{events} dead-lettered events: {dead}");
    assert!(!std::fs::read_to_string(dir.path().join("out/out.jsonl")).unwrap().contains("panics"));
}

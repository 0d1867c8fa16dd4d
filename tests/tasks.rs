//! A job whose partitions are tasks (`[event_time] watermark = "per-partition"`), with the
//! real `km0` binary over four files partitioned by producto: the output is the same at
//! any parallelism, from run to run, and equal to each partition run alone and to the
//! reference model run over each partition; a job savepoint taken at one parallelism
//! resumes at another (memory and RocksDB state) to the uninterrupted output; and SIGKILLs
//! of a followed job at parallelism 2 recover to the uninterrupted output.

use km0::generate::{stock_stream, StockStream};
use km0_e2e::*;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const PARTITIONS: usize = 4;
const THRESHOLD: i64 = 10;

/// A generated stock stream split into `PARTITIONS` files by producto (each producto's
/// records in one file, in stream order), as a producer keyed by producto would; lines
/// with no producto (malformed) go by line number.
fn partitioned(dir: &Path, events: u64, seed: u64) -> Vec<PathBuf> {
    let spec = StockStream { events, seed, late_fraction: 0.004, bad_fraction: 0.002, ..Default::default() };
    let mut all = Vec::new();
    stock_stream(&spec, &mut all).unwrap();
    let mut parts = vec![String::new(); PARTITIONS];
    for (i, line) in String::from_utf8_lossy(&all).lines().enumerate() {
        let producto = serde_json::from_str::<serde_json::Value>(line)
            .ok()
            .and_then(|v| v["producto"].as_str().map(str::to_string));
        let p = match producto {
            // FNV-1a: any fixed hash of the key does.
            Some(k) => {
                k.bytes().fold(0xcbf29ce484222325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100000001b3))
                    as usize
            }
            None => i,
        };
        parts[p % PARTITIONS].push_str(line);
        parts[p % PARTITIONS].push('\n');
    }
    parts
        .iter()
        .enumerate()
        .map(|(i, text)| {
            let path = dir.join(format!("part-{i}.jsonl"));
            std::fs::write(&path, text).unwrap();
            path
        })
        .collect()
}

/// The stock job over `parts`, a task per file, written into `dir` (outputs in `dir/out`).
fn task_job(dir: &Path, parts: &[PathBuf], extra: &str) -> PathBuf {
    task_job_into(dir, parts, extra, None)
}

/// [`task_job`] with another result sink.
fn task_job_into(dir: &Path, parts: &[PathBuf], extra: &str, sink: Option<&str>) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let mut job = StockJob::new("2m", THRESHOLD);
    if let Some(sink) = sink {
        job.sink = sink.into();
    }
    let paths: Vec<String> = parts.iter().map(|p| format!("{:?}", p.display().to_string())).collect();
    job.source = format!("kind = \"file\"\npaths = [{}]\npartitioned_by = [\"producto\"]", paths.join(", "));
    job.event_time = "watermark = \"per-partition\"".into();
    job.extra = extra.into();
    job.write(dir)
}

/// Run `km0` with `args`; its standard error, the run having succeeded.
fn km0(args: &[&str], pipeline: &Path) -> String {
    km0_with(args, pipeline, &[])
}

/// [`km0`] with more environment variables.
fn km0_with(args: &[&str], pipeline: &Path, env: &[(&str, String)]) -> String {
    let out = Command::new(km0_bin())
        .arg("run")
        .arg(pipeline)
        .args(["--http", "off", "--quiet"])
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "km0 run {args:?}: {err}");
    err
}

/// Every task's alerts, late events and dead letters, in task order.
fn task_outputs(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for t in 0..PARTITIONS {
        for f in ["alertas", "late", "dead-letter"] {
            out.push(
                std::fs::read_to_string(dir.join(format!("out/{f}-task-{t}.jsonl"))).unwrap_or_default(),
            );
        }
    }
    out
}

fn assert_same(got: &[String], want: &[String], what: &str) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let first = g.lines().zip(w.lines()).position(|(a, b)| a != b);
        assert!(
            g == w,
            "{what}: task {} output {} differs (first at line {first:?}; {} vs {} lines)",
            i / 3,
            i % 3,
            g.lines().count(),
            w.lines().count()
        );
    }
}

/// The newest job savepoint in `dir/out/savepoints`.
fn newest_savepoint(dir: &Path) -> PathBuf {
    let mut sps: Vec<PathBuf> = std::fs::read_dir(dir.join("out/savepoints"))
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("tasks.json").is_file())
        .collect();
    sps.sort();
    sps.pop().expect("a job savepoint")
}

#[test]
fn four_partitions_give_one_output_at_any_parallelism_equal_to_each_partition_alone() {
    let dir = tempfile::tempdir().unwrap();
    let parts = partitioned(dir.path(), 120_000, 5);
    let runs: Vec<Vec<String>> = [("p1", "1"), ("p2", "2"), ("p2-again", "2"), ("p3", "3")]
        .iter()
        .map(|(name, n)| {
            let d = dir.path().join(name);
            let err = km0(&["--parallelism", n], &task_job(&d, &parts, ""));
            assert!(err.contains("read 120000 records"), "{err}");
            task_outputs(&d)
        })
        .collect();
    for (i, name) in ["p2", "p2 again", "p3"].iter().enumerate() {
        assert_same(&runs[i + 1], &runs[0], &format!("{name} against p1"));
    }
    let mut alerts = 0;
    for (t, part) in parts.iter().enumerate() {
        // Each partition run alone, as a job of one partition (the job's watermark).
        let d = dir.path().join(format!("alone-{t}"));
        std::fs::create_dir_all(&d).unwrap();
        let mut job = StockJob::new("2m", THRESHOLD);
        job.source = format!("kind = \"file\"\npath = {:?}", part.display().to_string());
        km0(&[], &job.write(&d));
        let alone = ["alertas", "late", "dead-letter"]
            .map(|f| std::fs::read_to_string(d.join(format!("out/{f}.jsonl"))).unwrap_or_default());
        assert_same(&alone, &runs[1][t * 3..t * 3 + 3], &format!("partition {t} alone against its task"));

        // The reference model over the partition: its own clock.
        let model = reference_stock(part, 120_000, u64::MAX);
        let want: std::collections::BTreeMap<String, serde_json::Value> =
            model.alerts(THRESHOLD).into_iter().collect();
        let got = keyed_view(&dir.path().join(format!("p2/out/alertas-task-{t}.jsonl")));
        assert_eq!(got.len(), want.len(), "task {t}: alerts");
        assert!(got == want, "task {t}: alerts differ from the reference model");
        assert_eq!(runs[1][t * 3 + 1].lines().count() as u64, model.late, "task {t}: late events");
        alerts += got.len();
    }
    assert!(alerts > 1_000, "alerts: {alerts}");
}

#[test]
fn a_savepoint_at_parallelism_2_resumes_at_1_and_at_3_with_memory_and_rocksdb_state() {
    let dir = tempfile::tempdir().unwrap();
    let parts = partitioned(dir.path(), 80_000, 9);
    for (backend, extra) in [
        ("memory", ""),
        (
            "rocksdb",
            "[checkpoints]\ndir = \"chk\"\ninterval = \"1h\"\n[state]\nbackend = \"rocksdb\"\ndir = \"state\"",
        ),
    ] {
        let whole = dir.path().join(format!("{backend}-whole"));
        km0(&["--parallelism", "2"], &task_job(&whole, &parts, extra));
        let want = task_outputs(&whole);

        // Stopped at parallelism 2, resumed at 1.
        let d = dir.path().join(format!("{backend}-2-1"));
        let job = task_job(&d, &parts, extra);
        let err = km0(&["--parallelism", "2", "--stop-with-savepoint-after", "6000"], &job);
        assert!(err.contains("stopped with savepoint"), "{err}");
        let sp = newest_savepoint(&d);
        let err = km0(&["--parallelism", "1", "--from-savepoint", sp.to_str().unwrap()], &job);
        assert!(err.contains("read 80000 records"), "{err}");
        assert_same(&task_outputs(&d), &want, &format!("{backend}: savepoint at 2, resumed at 1"));

        // Stopped at 2, again at 3, resumed at 1.
        let d = dir.path().join(format!("{backend}-2-3-1"));
        let job = task_job(&d, &parts, extra);
        km0(&["--parallelism", "2", "--stop-with-savepoint-after", "5000"], &job);
        let sp = newest_savepoint(&d);
        km0(&["--parallelism", "3", "--stop-with-savepoint-after", "7000", "--from-savepoint", sp.to_str().unwrap()], &job);
        let sp2 = newest_savepoint(&d);
        assert_ne!(sp, sp2);
        km0(&["--parallelism", "1", "--from-savepoint", sp2.to_str().unwrap()], &job);
        assert_same(&task_outputs(&d), &want, &format!("{backend}: savepoints at 2 and 3, resumed at 1"));
    }
}

#[test]
fn a_savepoint_of_one_task_and_one_of_several_are_not_mixed_up() {
    let dir = tempfile::tempdir().unwrap();
    let parts = partitioned(dir.path(), 20_000, 3);
    let d = dir.path().join("tasks");
    let job = task_job(&d, &parts, "");
    km0(&["--stop-with-savepoint-after", "1000"], &job);
    let tasks_sp = newest_savepoint(&d);

    // The same job with the job's watermark: one task.
    let one = dir.path().join("one");
    std::fs::create_dir_all(&one).unwrap();
    let mut j = StockJob::new("2m", THRESHOLD);
    let paths: Vec<String> = parts.iter().map(|p| format!("{:?}", p.display().to_string())).collect();
    j.source = format!("kind = \"file\"\npaths = [{}]", paths.join(", "));
    let one_job = j.write(&one);
    let run = |job: &Path, args: &[&str]| {
        let out =
            Command::new(km0_bin()).arg("run").arg(job).args(["--http", "off"]).args(args).output().unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (ok, err) = run(&one_job, &["--parallelism", "2"]);
    assert!(!ok && err.contains("needs `[event_time] watermark = \"per-partition\"`"), "{err}");
    let (ok, err) = run(&one_job, &["--from-savepoint", tasks_sp.to_str().unwrap()]);
    assert!(!ok && err.contains("holds the savepoints of several tasks"), "{err}");
    let (ok, _) = run(&one_job, &["--stop-with-savepoint-after", "1000"]);
    assert!(ok);
    let mut sps: Vec<PathBuf> =
        std::fs::read_dir(one.join("out/savepoints")).unwrap().map(|e| e.unwrap().path()).collect();
    sps.sort();
    let (ok, err) = run(&job, &["--from-savepoint", sps[0].to_str().unwrap()]);
    assert!(!ok && err.contains("ran as one task"), "{err}");
}

/// Each partition's first `first` lines in a live file of its own (`dir/live-N.jsonl`):
/// every partition's lines, and the live files.
fn first_lines(dir: &Path, parts: &[PathBuf], first: usize) -> (Vec<Vec<String>>, Vec<PathBuf>) {
    let lines: Vec<Vec<String>> = parts
        .iter()
        .map(|p| std::fs::read_to_string(p).unwrap().lines().map(|l| format!("{l}\n")).collect())
        .collect();
    let live: Vec<PathBuf> = (0..PARTITIONS).map(|i| dir.join(format!("live-{i}.jsonl"))).collect();
    for (l, text) in live.iter().zip(&lines) {
        std::fs::write(l, text[..first].concat()).unwrap();
    }
    (lines, live)
}

/// The rest of each partition's lines, after the first `first`, appended to its live file.
fn rest_of_lines(live: &[PathBuf], lines: &[Vec<String>], first: usize) {
    for (l, text) in live.iter().zip(lines) {
        std::fs::OpenOptions::new()
            .append(true)
            .open(l)
            .unwrap()
            .write_all(text[first..].concat().as_bytes())
            .unwrap();
    }
}

/// Appends each partition's lines to its live file, a chunk at a time.
fn produce(parts: &[PathBuf], live: &[PathBuf]) -> std::thread::JoinHandle<()> {
    let texts: Vec<Vec<String>> = parts
        .iter()
        .map(|p| std::fs::read_to_string(p).unwrap().lines().map(str::to_string).collect())
        .collect();
    let live = live.to_vec();
    std::thread::spawn(move || {
        let mut files: Vec<std::fs::File> =
            live.iter().map(|l| std::fs::OpenOptions::new().append(true).open(l).unwrap()).collect();
        let mut at = vec![0; texts.len()];
        while at.iter().zip(&texts).any(|(a, t)| *a < t.len()) {
            for (p, t) in texts.iter().enumerate() {
                let end = (at[p] + 250).min(t.len());
                let mut buf = String::new();
                for l in &t[at[p]..end] {
                    buf.push_str(l);
                    buf.push('\n');
                }
                files[p].write_all(buf.as_bytes()).unwrap();
                at[p] = end;
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    })
}

/// Run the followed job over files that grow (`parts` appended to `live` files) at
/// parallelism 2, SIGKILLed 8 times, each time at a random point after one of its tasks
/// completed a checkpoint; then once more to the end of the (complete) input. Returns the
/// live files.
fn run_with_sigkills(dir: &Path, parts: &[PathBuf], sink: Option<&str>) -> Vec<PathBuf> {
    run_with_sigkills_into(dir, parts, sink, None, (None, false))
}

/// An object store for the checkpoints: its URL, the environment that reaches it, and
/// the state backend.
type Store<'a> = (&'a str, &'a [(&'a str, String)], &'a str);

/// [`run_with_sigkills`] with the checkpoints in the object store `s3` (its URL and the
/// environment that reaches it); between runs the local state folder (where checkpoints
/// are written first) is deleted, as if each run were on another machine.
fn run_with_sigkills_into(
    dir: &Path,
    parts: &[PathBuf],
    sink: Option<&str>,
    s3: Option<Store>,
    (server, freeze): (Option<&km0_e2e::services::S3>, bool),
) -> Vec<PathBuf> {
    let live: Vec<PathBuf> = (0..PARTITIONS).map(|i| dir.join(format!("live-{i}.jsonl"))).collect();
    for l in &live {
        std::fs::File::create(l).unwrap();
    }
    let producer = produce(parts, &live);
    let d = dir.join("killed");
    let chk = match s3 {
        Some((url, _, backend)) => format!(
            "[checkpoints]\ndir = \"{url}\"\ninterval = \"40ms\"\nretain = 3\n[state]\ndir = \"state\"\nbackend = \"{backend}\""
        ),
        None => "[checkpoints]\ndir = \"chk\"\ninterval = \"40ms\"\nretain = 3".to_string(),
    };
    let env: Vec<(&str, String)> = s3.map(|(_, e, _)| e.to_vec()).unwrap_or_default();
    let job = task_job_into(&d, &live, &chk, sink);
    let local = if s3.is_some() { "state/checkpoints" } else { "chk" };
    let newest = || -> u64 {
        (0..PARTITIONS)
            .filter_map(|t| std::fs::read_dir(d.join(format!("{local}/task-{t}"))).ok())
            .flat_map(|r| {
                r.filter_map(|e| e.ok()?.file_name().to_str()?.strip_prefix("chk-")?.parse::<u64>().ok())
            })
            .sum()
    };
    let started = Instant::now();
    let mut lcg = 20261205u64;
    for kill in 0..8 {
        if s3.is_some() {
            // Another machine: nothing of the last run's local folders.
            let _ = std::fs::remove_dir_all(d.join("state"));
        }
        let before = newest();
        let mut child = Command::new(km0_bin())
            .arg("run")
            .arg(&job)
            .args(["--follow", "--parallelism", "2", "--http", "off", "--quiet"])
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("stderr.txt")).unwrap())
            .spawn()
            .unwrap();
        if let (Some(store), true, 3) = (server, freeze, kill) {
            // The store stops answering for 2 s mid-run: uploads wait, none is torn.
            std::thread::sleep(Duration::from_millis(200));
            store.freeze(true);
            std::thread::sleep(Duration::from_secs(2));
            store.freeze(false);
        }
        while newest() <= before {
            if child.try_wait().unwrap().is_some() || started.elapsed() > Duration::from_secs(120) {
                let err = std::fs::read_to_string(dir.join("stderr.txt")).unwrap_or_default();
                panic!("no checkpoint in run {kill}: {err}");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        // The last run is killed only once the store holds a complete checkpoint (the
        // local one above can be ahead of its upload; under load, every earlier kill may
        // have fallen before an upload completed): the final run recovers from the store.
        if let (Some(store), Some((url, _, _)), 7) = (server, s3, kill) {
            let prefix =
                format!("{}/", url.trim_start_matches("s3://").split_once('/').map_or("", |(_, p)| p));
            while !store.keys(&prefix).iter().any(|k| k.ends_with("/_COMPLETE")) {
                assert!(started.elapsed() < Duration::from_secs(120), "no complete checkpoint in {url}");
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        lcg = lcg.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        std::thread::sleep(Duration::from_millis((lcg >> 33) % 150));
        assert!(child.try_wait().unwrap().is_none(), "a followed run keeps running until killed");
        child.kill().unwrap();
        child.wait().unwrap();
    }
    producer.join().unwrap();
    // The inputs are complete: one last run recovers every task and reads to the end.
    if s3.is_some() {
        let _ = std::fs::remove_dir_all(d.join("state"));
    }
    let err = km0_with(&["--parallelism", "2"], &job, &env);
    assert!(err.contains("recovered from checkpoint chk-"), "{err}");
    live
}

#[test]
fn sigkills_at_parallelism_2_recover_every_task_to_the_uninterrupted_output() {
    let dir = tempfile::tempdir().unwrap();
    let parts = partitioned(dir.path(), 120_000, 13);
    let live = run_with_sigkills(dir.path(), &parts, None);
    let whole = dir.path().join("whole");
    km0(&["--parallelism", "2"], &task_job(&whole, &live, ""));
    let want = task_outputs(&whole);
    assert!(want[0].lines().count() > 100, "alerts of task 0: {}", want[0].lines().count());
    assert_same(&task_outputs(&dir.path().join("killed")), &want, "after 8 SIGKILLs");
}

#[test]
fn sigkills_at_parallelism_2_leave_postgres_with_every_result_once() {
    let pg = km0_e2e::services::Postgres::start();
    let dir = tempfile::tempdir().unwrap();
    let parts = partitioned(dir.path(), 80_000, 17);
    let sink = format!("kind = \"postgres\"\nurl = \"{}\"\ntable = \"alertas\"", pg.url());
    let live = run_with_sigkills(dir.path(), &parts, Some(&sink));
    let whole = dir.path().join("whole");
    km0(&["--parallelism", "2"], &task_job(&whole, &live, ""));
    let mut want = std::collections::BTreeMap::new();
    for t in 0..PARTITIONS {
        want.extend(keyed_view(&whole.join(format!("out/alertas-task-{t}.jsonl"))));
    }
    let got: std::collections::BTreeMap<String, serde_json::Value> = pg
        .query("SELECT key, value::text FROM alertas ORDER BY key")
        .iter()
        .map(|r| (r[0].clone(), serde_json::from_str(&r[1]).unwrap()))
        .collect();
    assert!(want.len() > 500, "alerts: {}", want.len());
    assert_eq!(got.len(), want.len());
    assert!(got == want, "the table differs from the uninterrupted run");
    // Progress is kept per task.
    let jobs = pg.query("SELECT DISTINCT job FROM km0_sink_epochs ORDER BY job");
    let jobs: Vec<&str> = jobs.iter().map(|r| r[0].as_str()).collect();
    assert_eq!(
        jobs,
        ["stock-alert/task-0", "stock-alert/task-1", "stock-alert/task-2", "stock-alert/task-3"]
    );
}

#[test]
fn a_live_swap_at_parallelism_2_gives_the_output_of_an_offline_deploy_at_the_same_task_positions() {
    const FIRST: usize = 6_000;
    const TOKEN: &str = "t4sks";
    let dir = tempfile::tempdir().unwrap();
    let parts = partitioned(dir.path(), 60_000, 23);
    let (lines, live) = first_lines(dir.path(), &parts, FIRST);
    let extra = "[checkpoints]\ndir = \"chk\"\ninterval = \"300ms\"";
    let d = dir.path().join("live");
    let job = task_job(&d, &live, extra);
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let url = format!("http://127.0.0.1:{port}");
    let child = Command::new(km0_bin())
        .arg("run")
        .arg(&job)
        .args(["--follow", "--parallelism", "2", "--http", &format!("127.0.0.1:{port}")])
        .env("KM0_TOKEN", TOKEN)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status = || -> serde_json::Value {
        km0::control::client::call(&url, "GET", "/api/v1/job", None)
            .ok()
            .filter(|(code, _)| *code == 200)
            .and_then(|(_, body)| serde_json::from_str(&body).ok())
            .unwrap_or_default()
    };
    let wait_read = |n: usize| {
        let t = Instant::now();
        while status()["counters"]["read"] != n as u64 {
            assert!(t.elapsed() < Duration::from_secs(60), "the job reads {n} records: {}", status());
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    wait_read(PARTITIONS * FIRST);
    let s = status();
    assert_eq!(s["tasks"].as_array().map(Vec::len), Some(PARTITIONS), "{s}");
    assert_eq!(s["tasks"][1]["read"], FIRST as u64, "{s}");
    assert_eq!(s["tasks"][1]["task"], "task-1", "{s}");
    assert_eq!(s["tasks"][1]["partition"], live[1].display().to_string(), "{s}");
    assert_eq!(s["tasks"][1]["thread"], 1, "{s}");
    assert!(s["tasks"][1]["open_windows"].as_u64().is_some_and(|n| n > 0), "{s}");
    let metrics = km0::control::client::call(&url, "GET", "/metrics", None).unwrap().1;
    for t in 0..PARTITIONS {
        let line = format!("km0_task_records_read{{job=\"stock-alert\",task=\"task-{t}\"}} {FIRST}");
        assert!(metrics.lines().any(|l| l.starts_with(&line)), "{line} in\n{metrics}");
    }
    assert!(metrics.contains("km0_task_watermark_seconds{"), "{metrics}");

    let out = Command::new(km0_bin())
        .args(["deploy", plugin("min-stock-v2").to_str().unwrap(), "--job", &url, "--json"])
        .env("KM0_TOKEN", TOKEN)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let deployed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(deployed["status"], "swapped", "{deployed}");
    assert_eq!(deployed["at_record"], (PARTITIONS * FIRST) as u64, "{deployed}");
    let rollback = PathBuf::from(deployed["savepoint"].as_str().unwrap());
    assert!(rollback.join("tasks.json").is_file() && rollback.join("task-3/savepoint.json").is_file());
    assert_eq!(status()["aggregations"][0]["plugin_version"], "0.2.0");

    rest_of_lines(&live, &lines, FIRST);
    wait_read(lines.iter().map(Vec::len).sum());
    let (code, body) =
        km0::control::client::call(&url, "POST", "/api/v1/stop?mode=drain", Some(TOKEN)).unwrap();
    assert_eq!(code, 200, "{body}");
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    // Offline: stop every task after the same records, deploy from that job savepoint.
    let off = dir.path().join("off");
    let off_job = task_job(&off, &live, extra);
    km0(&["--parallelism", "2", "--stop-with-savepoint-after", &FIRST.to_string()], &off_job);
    let sp = newest_savepoint(&off);
    let out = Command::new(km0_bin())
        .args(["deploy", plugin("min-stock-v2").to_str().unwrap(), "--from-savepoint", sp.to_str().unwrap()])
        .arg("--pipeline")
        .arg(&off_job)
        .args(["--http", "off", "--parallelism", "1"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let got = task_outputs(&d);
    assert!(got[0].lines().next().is_some_and(|l| !l.contains("suma_delta")));
    assert!(got[0].lines().last().is_some_and(|l| l.contains("suma_delta")));
    assert_same(&got, &task_outputs(&off), "live swap against offline deploy");
}

#[test]
fn checkpoints_in_an_s3_store_recover_every_task_on_another_machine_after_sigkills_and_an_outage() {
    let s3 = km0_e2e::services::S3::start("km0");
    let env = s3.env();
    let dir = tempfile::tempdir().unwrap();
    let parts = partitioned(dir.path(), 80_000, 29);
    let live = run_with_sigkills_into(
        dir.path(),
        &parts,
        None,
        Some(("s3://km0/jobs/stock", &env, "memory")),
        (Some(&s3), true),
    );
    let whole = dir.path().join("whole");
    km0(&["--parallelism", "2"], &task_job(&whole, &live, ""));
    let want = task_outputs(&whole);
    assert!(want[0].lines().count() > 50, "alerts of task 0: {}", want[0].lines().count());
    assert_same(&task_outputs(&dir.path().join("killed")), &want, "after 8 SIGKILLs, recovered from S3");
    // Every task wrote checkpoints to the store. (Whether each completed one depends on
    // where the kills fell: a task killed each time between its upload and its marker has
    // none, and recovers from its start, as the output above shows.)
    let keys = s3.keys("jobs/stock/");
    for t in 0..PARTITIONS {
        let uploaded = keys.iter().filter(|k| k.starts_with(&format!("jobs/stock/task-{t}/chk-")));
        assert!(uploaded.count() >= 1, "task {t} has checkpoints in the store: {keys:?}");
    }
    assert!(keys.iter().any(|k| k.ends_with("/_COMPLETE")), "complete checkpoints in the store: {keys:?}");
}

#[test]
fn a_torn_or_corrupt_checkpoint_in_s3_is_skipped_and_a_fenced_writer_stops() {
    let s3 = km0_e2e::services::S3::start("km0");
    let env = s3.env();
    let dir = tempfile::tempdir().unwrap();
    let parts = partitioned(dir.path(), 40_000, 31);
    let whole = dir.path().join("whole");
    km0(&[], &task_job(&whole, &parts, ""));
    let want = task_outputs(&whole);

    // A run that stops with a savepoint after 6 000 records per task, checkpointing every
    // 1 000: chk-1 to chk-5 of each task in the store.
    let d = dir.path().join("d");
    let chk = "[checkpoints]\ndir = \"s3://km0/torn\"\ninterval = \"1h\"\nevery_records = 1000\nretain = 10\n[state]\ndir = \"state\"";
    let job = task_job(&d, &parts, chk);
    km0_with(&["--stop-with-savepoint-after", "6000"], &job, &env);
    let chk_of = |t: usize, n: u64| format!("torn/task-{t}/chk-{n:06}");
    assert!(
        s3.keys(&chk_of(0, 5)).iter().any(|k| k.ends_with("/_COMPLETE")),
        "{:?}",
        s3.keys("torn/task-0/")
    );
    // A torn upload (files, no marker) as task-0's chk-6: never listed. Task-1's newest
    // has a marker that names no writer, task-2's newest a state file replaced: each of
    // those recovers from the one before.
    s3.put(&format!("{}/0123abcd/state.bin", chk_of(0, 6)), b"half an upload");
    s3.put(&format!("{}/_COMPLETE", chk_of(1, 5)), b"?");
    let state = s3.keys(&chk_of(2, 5)).into_iter().find(|k| k.ends_with("/state.bin")).unwrap();
    s3.put(&state, b"not the state");
    let _ = std::fs::remove_dir_all(d.join("state"));
    let err = km0_with(&[], &job, &env);
    assert!(err.contains("recovered from checkpoint chk-000005"), "{err}");
    assert_eq!(err.matches("skipping a checkpoint that does not read back").count(), 2, "{err}");
    assert_same(&task_outputs(&d), &want, "recovered past a torn and a corrupt checkpoint");

    // A writer that another process has taken its task from stops instead of writing.
    let f = dir.path().join("fenced");
    std::fs::create_dir_all(&f).unwrap();
    for (l, p) in parts.iter().enumerate() {
        std::fs::copy(p, f.join(format!("live-{l}.jsonl"))).unwrap();
    }
    let live: Vec<PathBuf> = (0..PARTITIONS).map(|l| f.join(format!("live-{l}.jsonl"))).collect();
    let chk = "[checkpoints]\ndir = \"s3://km0/fenced\"\ninterval = \"50ms\"\n[state]\ndir = \"state\"";
    let job = task_job(&f, &live, chk);
    let child = Command::new(km0_bin())
        .arg("run")
        .arg(&job)
        .args(["--follow", "--parallelism", "2", "--http", "off", "--quiet"])
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while !s3.keys("fenced/task-2/").iter().any(|k| k.ends_with("/_COMPLETE")) {
        assert!(t.elapsed() < Duration::from_secs(30), "no checkpoint of task-2: {:?}", s3.keys("fenced/"));
        std::thread::sleep(Duration::from_millis(20));
    }
    let claimed: Vec<String> = s3.keys("fenced/task-2/generations/");
    let g: u64 = claimed.iter().filter_map(|k| k.rsplit('/').next()?.parse().ok()).max().unwrap();
    s3.put(&format!("fenced/task-2/generations/{:06}", g + 1), b"another process");
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("fenced"), "{err}");
}

#[test]
fn a_task_restored_from_the_s3_store_on_another_machine_runs_the_deployed_plugin() {
    const FIRST: usize = 3_000;
    const TOKEN: &str = "d3ploy";
    let s3 = km0_e2e::services::S3::start("km0");
    let env = s3.env();
    let dir = tempfile::tempdir().unwrap();
    let parts = partitioned(dir.path(), 30_000, 37);
    let (lines, live) = first_lines(dir.path(), &parts, FIRST);
    let d = dir.path().join("job");
    let chk = "[checkpoints]\ndir = \"s3://km0/deployed\"\ninterval = \"2s\"\n[state]\ndir = \"state\"";
    let job = task_job(&d, &live, chk);
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let url = format!("http://127.0.0.1:{port}");
    let mut child = Command::new(km0_bin())
        .arg("run")
        .arg(&job)
        .args(["--follow", "--parallelism", "2", "--http", &format!("127.0.0.1:{port}")])
        .env("KM0_TOKEN", TOKEN)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.path().join("stderr.txt")).unwrap())
        .spawn()
        .unwrap();
    let t = Instant::now();
    loop {
        let read = km0::control::client::call(&url, "GET", "/api/v1/job", None)
            .ok()
            .and_then(|(_, b)| serde_json::from_str::<serde_json::Value>(&b).ok())
            .and_then(|s| s["counters"]["read"].as_u64());
        if read == Some((PARTITIONS * FIRST) as u64) {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "the job reads the first records");
        std::thread::sleep(Duration::from_millis(50));
    }
    // The reply comes once every task's checkpoint after the swap is durable.
    let out = Command::new(km0_bin())
        .args(["deploy", plugin("min-stock-v2").to_str().unwrap(), "--job", &url, "--json"])
        .env("KM0_TOKEN", TOKEN)
        .output()
        .unwrap();
    let log = || std::fs::read_to_string(dir.path().join("stderr.txt")).unwrap_or_default();
    assert!(out.status.success(), "{}\n{}", String::from_utf8_lossy(&out.stderr), log());
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(s3.keys("deployed/task-0/components/").len() == 1, "{:?}", s3.keys("deployed/task-0/"));

    // Another machine: no local state; the rest of the input; a bounded run.
    let _ = std::fs::remove_dir_all(d.join("state"));
    rest_of_lines(&live, &lines, FIRST);
    let err = km0_with(&["--parallelism", "2"], &job, &env);
    assert!(err.contains("resuming with the plugin the job ran"), "{err}");
    for (t, alerts) in task_outputs(&d).iter().step_by(3).enumerate() {
        assert!(alerts.lines().last().is_some_and(|l| l.contains("suma_delta")), "task {t}: {alerts}");
    }
}

#[test]
fn rocksdb_checkpoints_in_s3_share_their_table_files_and_recover_after_sigkills() {
    let s3 = km0_e2e::services::S3::start("km0");
    let env = s3.env();
    let dir = tempfile::tempdir().unwrap();
    let parts = partitioned(dir.path(), 80_000, 41);
    let live = run_with_sigkills_into(
        dir.path(),
        &parts,
        None,
        Some(("s3://km0/rocks", &env, "rocksdb")),
        (Some(&s3), false),
    );
    let whole = dir.path().join("whole");
    km0(&["--parallelism", "2"], &task_job(&whole, &live, ""));
    assert_same(&task_outputs(&dir.path().join("killed")), &task_outputs(&whole), "RocksDB state from S3");
    // Table files are stored once, under shared/, and only those a checkpoint holds.
    let keys = s3.keys("rocks/task-0/");
    assert!(keys.iter().all(|k| !k.ends_with(".sst") || k.starts_with("rocks/task-0/shared/")), "{keys:?}");
    let shared = keys.iter().filter(|k| k.starts_with("rocks/task-0/shared/")).count();
    let lists = keys.iter().filter(|k| k.ends_with(".shared")).count();
    assert!(shared > 0 && lists > 0, "{keys:?}");
}

/// A live deploy into a job of tasks is two-phase: every task first checks that the new
/// plugin takes its state, and none swaps unless all do. `min-stock-broken` (state schema
/// 3) cannot migrate any accumulator: the two tasks whose partitions are empty yet hold
/// none and would take it, the third holds an open window and refuses, so no task swaps,
/// the reply names the refusing task and why, and every task still runs min-stock 0.1.
#[test]
fn a_live_deploy_that_one_task_refuses_swaps_in_no_task() {
    const TOKEN: &str = "tw0ph4se";
    let dir = tempfile::tempdir().unwrap();
    let t0 = 1_757_836_800_000i64;
    let event = |producto: &str, stock: i64, t: i64| {
        format!(
            "{{\"tipo\":\"stock.actualizado\",\"producto\":\"{producto}\",\"mercado\":\"m\",\"stock_actual\":{stock},\"delta\":-1,\"fecha_ms\":{t}}}\n"
        )
    };
    // Partitions 0 and 1: nothing yet; partition 2: an open window.
    let parts: Vec<PathBuf> = (0..3)
        .map(|p| {
            let text: String = match p {
                2 => (0..20).map(|i| event("p2", 5 + i, t0 + i * 1_000)).collect(),
                _ => String::new(),
            };
            let path = dir.path().join(format!("live-{p}.jsonl"));
            std::fs::write(&path, text).unwrap();
            path
        })
        .collect();
    let job = task_job(&dir.path().join("job"), &parts, "");
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let url = format!("http://127.0.0.1:{port}");
    let child = Command::new(km0_bin())
        .arg("run")
        .arg(&job)
        .args(["--follow", "--parallelism", "2", "--http", &format!("127.0.0.1:{port}")])
        .env("KM0_TOKEN", TOKEN)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status = || -> serde_json::Value {
        km0::control::client::call(&url, "GET", "/api/v1/job", None)
            .ok()
            .filter(|(code, _)| *code == 200)
            .and_then(|(_, body)| serde_json::from_str(&body).ok())
            .unwrap_or_default()
    };
    let t = Instant::now();
    while status()["counters"]["read"] != 20 {
        assert!(t.elapsed() < Duration::from_secs(30), "{}", status());
        std::thread::sleep(Duration::from_millis(50));
    }
    let s = status();
    let open: Vec<u64> = (0..3).map(|t| s["tasks"][t]["open_windows"].as_u64().unwrap_or(99)).collect();
    assert_eq!(open, [0, 0, 1], "{s}");

    let bytes = std::fs::read(plugin("min-stock-broken")).unwrap();
    let (code, body) =
        km0::control::client::send(&url, "POST", "/api/v1/deployments", Some(TOKEN), &bytes).unwrap();
    assert_eq!(code, 422, "{body}");
    assert!(body.contains("task task-2") && body.contains("no task swapped it in"), "{body}");
    assert!(!body.contains("task task-0") && !body.contains("task task-1"), "{body}");
    let s = status();
    let plugins: Vec<&str> = (0..3).filter_map(|t| s["tasks"][t]["plugins"][0].as_str()).collect();
    assert!(plugins.len() == 3 && plugins.iter().all(|p| p.starts_with("min-stock 0.1")), "{plugins:?}");
    let on = s["aggregations"][0]["tasks_on"].as_object().cloned().unwrap_or_default();
    assert_eq!(on.len(), 1, "{on:?}");

    // The job goes on: min-stock-v2 (which migrates) is taken by every task.
    let bytes = std::fs::read(plugin("min-stock-v2")).unwrap();
    let (code, body) =
        km0::control::client::send(&url, "POST", "/api/v1/deployments", Some(TOKEN), &bytes).unwrap();
    assert_eq!(code, 200, "{body}");
    let on = status()["aggregations"][0]["tasks_on"].as_object().cloned().unwrap_or_default();
    assert!(on.len() == 1 && on.keys().all(|v| v.starts_with("min-stock 0.2")), "{on:?}");
    let (code, body) = km0::control::client::call(&url, "POST", "/api/v1/stop", Some(TOKEN)).unwrap();
    assert_eq!(code, 200, "{body}");
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

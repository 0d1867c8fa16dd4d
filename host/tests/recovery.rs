//! Crash recovery with the real `km0` binary: a followed input grows while the job is
//! killed with SIGKILL at random points and restarted; checkpoints bring it back, and the
//! final output is byte-identical to one uninterrupted run (no window lost, nothing
//! counted twice: the alerts' counts would differ). And a corrupt newest checkpoint is
//! detected and the previous one used.

mod common;
use common::*;

use common::{stock_outputs as outputs, stock_pipeline as pipeline};
use km0::generate::{stock_stream, StockStream};
use km0::job::{self, RunOptions};
use km0::pipeline::Pipeline;
use km0::plugin::PluginRuntime;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Small deterministic generator for kill delays.
struct Lcg(u64);
impl Lcg {
    fn next(&mut self, lo: u64, hi: u64) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        lo + (self.0 >> 33) % (hi - lo)
    }
}

#[test]
fn sigkill_at_random_points_then_recovery_gives_the_uninterrupted_output() {
    sigkill_and_recover("memory");
}

#[test]
fn sigkill_with_the_rocksdb_backend_recovers_too() {
    sigkill_and_recover("rocksdb");
}

fn sigkill_and_recover(backend: &str) {
    let dir = tempfile::tempdir().unwrap();
    let all = dir.path().join("all.jsonl");
    let spec = StockStream {
        events: 150_000,
        seed: 11,
        late_fraction: 0.004,
        bad_fraction: 0.001,
        ..Default::default()
    };
    stock_stream(&spec, &mut std::fs::File::create(&all).unwrap()).unwrap();
    let lines: Vec<String> =
        std::io::BufReader::new(std::fs::File::open(&all).unwrap()).lines().map(|l| l.unwrap()).collect();

    // The producer appends the stream to the live file over about four seconds.
    let live = dir.path().join("live.jsonl");
    std::fs::File::create(&live).unwrap();
    let producer = {
        let live = live.clone();
        std::thread::spawn(move || {
            let mut f = std::fs::OpenOptions::new().append(true).open(&live).unwrap();
            for chunk in lines.chunks(1_000) {
                let mut buf = String::new();
                for l in chunk {
                    buf.push_str(l);
                    buf.push('\n');
                }
                f.write_all(buf.as_bytes()).unwrap();
                std::thread::sleep(Duration::from_millis(25));
            }
        })
    };

    let checkpoints = format!(
        "[checkpoints]\ndir = \"chk\"\ninterval = \"40ms\"\nretain = 3\n[state]\nbackend = \"{backend}\"\ndir = \"state\""
    );
    let job = pipeline(dir.path(), &live, "out", &checkpoints);
    let mut rng = Lcg(20261129);
    let mut kills = 0;
    let started = Instant::now();
    let chk_numbers = || -> Vec<u64> {
        let Ok(d) = std::fs::read_dir(dir.path().join("chk")) else { return Vec::new() };
        d.filter_map(|e| e.ok()?.file_name().to_str()?.strip_prefix("chk-")?.parse().ok()).collect()
    };
    // Each restart names the pipeline another way: the checkpoint's outputs are the same
    // files whatever the spelling.
    let sub = dir.path().join("sub");
    std::fs::create_dir(&sub).unwrap();
    let spellings: [(PathBuf, &Path); 4] = [
        (job.clone(), Path::new("/")),
        (PathBuf::from("out.toml"), dir.path()),
        (PathBuf::from("./out.toml"), dir.path()),
        (PathBuf::from("../out.toml"), &sub),
    ];
    while kills < 12 {
        let before = chk_numbers().into_iter().max().unwrap_or(0);
        let (spelling, cwd) = &spellings[kills % spellings.len()];
        let mut child = Command::new(km0())
            .args(["run", "--follow"])
            .arg(spelling)
            .current_dir(cwd)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // Kill it while it processes: after it has completed a checkpoint of its own,
        // at a random point up to 150 ms later.
        while chk_numbers().into_iter().max().unwrap_or(0) <= before {
            assert!(started.elapsed() < Duration::from_secs(120), "no checkpoint from run {kills}");
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(rng.next(0, 150)));
        assert!(child.try_wait().unwrap().is_none(), "a followed run keeps running until killed");
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        kills += 1;
    }
    producer.join().unwrap();
    let checkpoints_left = std::fs::read_dir(dir.path().join("chk")).unwrap().count();
    assert!(checkpoints_left >= 1, "the killed runs left checkpoints");

    // The input is complete now: one last run recovers and reads it to the end.
    let out = Command::new(km0()).arg("run").arg(&job).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("recovered from checkpoint chk-"), "{err}");

    // One uninterrupted run over the same (complete) input.
    let reference = pipeline(dir.path(), &live, "ref", "");
    let p = Pipeline::load(&reference).unwrap();
    job::run(&p, &RunOptions::default(), &PluginRuntime::new().unwrap()).unwrap();
    let (got, want) = (outputs(dir.path(), "out"), outputs(dir.path(), "ref"));
    assert!(want[0].lines().count() > 1_000, "alerts: {}", want[0].lines().count());
    for (name, (g, w)) in ["alerts", "late events", "dead letters"].iter().zip(got.iter().zip(&want)) {
        let first = g.lines().zip(w.lines()).position(|(a, b)| a != b);
        assert!(
            g == w,
            "{name} differ from the uninterrupted run (first at line {first:?}; {} vs {} lines)",
            g.lines().count(),
            w.lines().count()
        );
    }
}

#[test]
fn a_corrupt_newest_checkpoint_is_skipped_for_the_previous_one() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    let spec = StockStream { events: 100_000, seed: 5, ..Default::default() };
    stock_stream(&spec, &mut std::fs::File::create(&input).unwrap()).unwrap();
    let runtime = PluginRuntime::new().unwrap();
    let reference = Pipeline::load(&pipeline(dir.path(), &input, "ref", "")).unwrap();
    job::run(&reference, &RunOptions::default(), &runtime).unwrap();

    let checkpoints = "[checkpoints]\ndir = \"chk\"\ninterval = \"1h\"\nevery_records = 20000\nretain = 3";
    let p = Pipeline::load(&pipeline(dir.path(), &input, "out", checkpoints)).unwrap();
    // Checkpoints at 20k, 40k and 60k records; stop at 70k.
    let s =
        job::run(&p, &RunOptions { stop_with_savepoint_after: Some(70_000), ..Default::default() }, &runtime)
            .unwrap();
    assert_eq!(s.checkpoints, 3);
    let chk = dir.path().join("chk");
    let mut names: Vec<String> =
        std::fs::read_dir(&chk).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    names.sort();
    assert_eq!(names, ["chk-000001", "chk-000002", "chk-000003"]);

    // Flip a byte in the newest checkpoint's state, truncate the one before it.
    let state = chk.join("chk-000003/state.bin");
    let mut bytes = std::fs::read(&state).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x10;
    std::fs::write(&state, bytes).unwrap();
    let meta = chk.join("chk-000002/savepoint.json");
    let text = std::fs::read(&meta).unwrap();
    std::fs::write(&meta, &text[..text.len() / 2]).unwrap();

    let s = job::run(&p, &RunOptions::default(), &runtime).unwrap();
    assert_eq!(s.recovered_from.as_deref(), Some("chk-000001"));
    assert_eq!(s.records_this_run, 80_000);
    assert!(
        outputs(dir.path(), "out") == outputs(dir.path(), "ref"),
        "outputs differ from the uninterrupted run"
    );
}

#[test]
fn rocksdb_checkpoints_are_incremental_and_a_broken_one_is_skipped() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    let spec = StockStream { events: 120_000, seed: 9, ..Default::default() };
    stock_stream(&spec, &mut std::fs::File::create(&input).unwrap()).unwrap();
    let runtime = PluginRuntime::new().unwrap();
    let reference = Pipeline::load(&pipeline(dir.path(), &input, "ref", "")).unwrap();
    job::run(&reference, &RunOptions::default(), &runtime).unwrap();

    let checkpoints = "[checkpoints]\ndir = \"chk\"\ninterval = \"1h\"\nevery_records = 20000\nretain = 4\n\
                       [state]\nbackend = \"rocksdb\"\ndir = \"state\"";
    let p = Pipeline::load(&pipeline(dir.path(), &input, "out", checkpoints)).unwrap();
    let s =
        job::run(&p, &RunOptions { stop_with_savepoint_after: Some(90_000), ..Default::default() }, &runtime)
            .unwrap();
    assert_eq!(s.checkpoints, 4);
    let chk = dir.path().join("chk");
    // Incremental: the newest checkpoint shares SST files (hard links) with older ones
    // instead of writing the whole state again.
    let ssts = |n: u32| -> Vec<(u64, u64)> {
        std::fs::read_dir(chk.join(format!("chk-{n:06}/rocksdb")))
            .unwrap()
            .map(|e| e.unwrap())
            .filter(|e| e.file_name().to_string_lossy().ends_with(".sst"))
            .map(|e| (e.metadata().unwrap().ino(), e.metadata().unwrap().len()))
            .collect()
    };
    let (older, newest) = (ssts(3), ssts(4));
    let shared: u64 = newest.iter().filter(|f| older.contains(f)).map(|f| f.1).sum();
    assert!(shared > 0, "checkpoint 4 shares no SST file with checkpoint 3: {older:?} {newest:?}");

    // Break the newest checkpoint (its MANIFEST is its own file, not a shared one).
    let manifest = std::fs::read_dir(chk.join("chk-000004/rocksdb"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.file_name().unwrap().to_string_lossy().starts_with("MANIFEST"))
        .unwrap();
    std::fs::write(&manifest, b"garbage").unwrap();
    let s = job::run(&p, &RunOptions::default(), &runtime).unwrap();
    assert_eq!(s.recovered_from.as_deref(), Some("chk-000003"));
    assert!(
        outputs(dir.path(), "out") == outputs(dir.path(), "ref"),
        "outputs differ from the uninterrupted run"
    );
}

#[test]
fn a_new_plugin_version_deploys_from_a_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    let spec = StockStream { events: 60_000, seed: 3, ..Default::default() };
    stock_stream(&spec, &mut std::fs::File::create(&input).unwrap()).unwrap();
    let runtime = PluginRuntime::new().unwrap();
    let checkpoints = "[checkpoints]\ndir = \"chk\"\ninterval = \"1h\"\nevery_records = 20000\n[state]\nbackend = \"rocksdb\"\ndir = \"state\"";
    let p = Pipeline::load(&pipeline(dir.path(), &input, "out", checkpoints)).unwrap();
    job::run(&p, &RunOptions { stop_with_savepoint_after: Some(50_000), ..Default::default() }, &runtime)
        .unwrap();
    let v2 = repo().join("plugins/dist/min-stock-v2.wasm");
    let chk = dir.path().join("chk/chk-000002");
    let s = job::deploy(&p, &v2, &chk, &RunOptions::default(), &runtime).unwrap();
    assert_eq!(s.migrated, vec![("window-aggregate".to_string(), 1, 2)]);
    assert_eq!(s.records_this_run, 20_000, "resumed at the checkpoint's position (40k)");
    let last = std::fs::read_to_string(dir.path().join("out/alertas.jsonl")).unwrap();
    assert!(
        last.lines().last().unwrap().contains("suma_delta"),
        "the new version writes the results after it"
    );
}

#[test]
fn a_slow_partition_and_a_silent_one_fire_on_time_across_a_sigkill() {
    // Two followed files: `silent` says one thing at the start and nothing more; `slow`
    // gets a position a minute of event time apart every 100 ms for 4 s. With a 500 ms
    // idle timeout, `silent` stops holding the watermark and `slow`'s windows fire as it
    // goes (only 40 records: idleness must be looked at by time, not every N records),
    // also after a SIGKILL and recovery (the restored clocks must go idle again).
    let dir = tempfile::tempdir().unwrap();
    let t0: i64 = 1_757_844_000_000; // a 5-minute boundary
    let line = |p: &str, t: i64| {
        format!(
            "{{\"tipo\":\"stock.actualizado\",\"producto\":\"{p}\",\"mercado\":\"m\",\"fecha_ms\":{t},\"stock_actual\":5,\"delta\":0}}\n"
        )
    };
    let (slow, silent) = (dir.path().join("slow.jsonl"), dir.path().join("silent.jsonl"));
    std::fs::write(&silent, line("s", t0)).unwrap();
    std::fs::File::create(&slow).unwrap();
    let text = format!(
        r#"
name = "slow-and-silent"
key = ["producto", "mercado"]
[source]
kind = "file"
paths = [{slow:?}, {silent:?}]
idle_timeout = "500ms"
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
path = "out/alertas.jsonl"
[late]
path = "out/late.jsonl"
[dead_letter]
path = "out/dead.jsonl"
[checkpoints]
dir = "chk"
interval = "100ms"
"#,
        slow = slow.display().to_string(),
        silent = silent.display().to_string(),
        plugin = plugin("min-stock").display().to_string(),
    );
    let job = dir.path().join("slow.toml");
    std::fs::write(&job, text).unwrap();
    let writer = {
        let slow = slow.clone();
        std::thread::spawn(move || {
            for i in 0..40 {
                let mut f = std::fs::OpenOptions::new().append(true).open(&slow).unwrap();
                f.write_all(line("p", t0 + i * 60_000).as_bytes()).unwrap();
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    let start = || {
        Command::new(km0())
            .args(["run", "--follow"])
            .arg(&job)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    let alerts = || -> Vec<String> {
        let text = std::fs::read_to_string(dir.path().join("out/alertas.jsonl")).unwrap_or_default();
        text.lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["key"].as_str().unwrap().to_string()
            })
            .collect()
    };
    let mut first = start();
    std::thread::sleep(Duration::from_millis(1_800));
    first.kill().unwrap(); // SIGKILL
    first.wait().unwrap();
    let before = alerts();
    assert!(!before.is_empty(), "windows fired before the kill, with 18 records read");
    let mut second = start();
    writer.join().unwrap();
    // Every window that ends 2 minutes before slow's last position (minute 39) fires.
    let mut want: Vec<String> = (0..7).map(|w| format!("{}|p|m", t0 + w * 300_000)).collect();
    want.push(format!("{t0}|s|m"));
    want.sort();
    let waited = Instant::now();
    let mut got = Vec::new();
    while waited.elapsed() < Duration::from_secs(20) {
        got = alerts();
        got.sort();
        got.dedup();
        if got == want {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    second.kill().unwrap();
    second.wait().unwrap();
    assert_eq!(got, want);
}

#[test]
fn sigterm_stops_with_a_savepoint_that_resumes_to_the_uninterrupted_output() {
    let dir = tempfile::tempdir().unwrap();
    let all = dir.path().join("all.jsonl");
    let spec = StockStream { events: 40_000, seed: 17, late_fraction: 0.004, ..Default::default() };
    stock_stream(&spec, &mut std::fs::File::create(&all).unwrap()).unwrap();
    let text = std::fs::read_to_string(&all).unwrap();
    let half = text.lines().take(20_000).map(|l| format!("{l}\n")).collect::<String>();
    let live = dir.path().join("live.jsonl");
    std::fs::write(&live, &half).unwrap();
    let job = pipeline(dir.path(), &live, "out", "");
    let child = Command::new(km0())
        .args(["run", "--follow"])
        .arg(&job)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Let it read what is there, then ask it to stop.
    std::thread::sleep(Duration::from_millis(1_500));
    // SAFETY: kill(2) on our own child.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "SIGTERM ends the run cleanly: {err}");
    assert!(err.contains("stopped with savepoint"), "{err}");
    let savepoint = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(Path::new(&savepoint).join("savepoint.json").exists(), "{savepoint}");
    // The rest of the input arrives; the job resumes from the savepoint to the end.
    std::fs::write(&live, &text).unwrap();
    let out =
        Command::new(km0()).arg("run").arg(&job).args(["--from-savepoint", &savepoint]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let reference = pipeline(dir.path(), &live, "ref", "");
    let p = Pipeline::load(&reference).unwrap();
    job::run(&p, &RunOptions::default(), &PluginRuntime::new().unwrap()).unwrap();
    let (got, want) = (outputs(dir.path(), "out"), outputs(dir.path(), "ref"));
    assert!(want[0].lines().count() > 100);
    assert!(got == want, "outputs differ from the uninterrupted run");
}

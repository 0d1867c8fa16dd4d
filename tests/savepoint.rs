//! Savepoints on a generated 100k-record stream with disorder, late events, other event
//! types and malformed lines: stop-and-resume equals one uninterrupted run, a new
//! plugin version takes over the open windows through `migrate`, and an incompatible
//! plugin is refused without touching the savepoint.

use km0::generate::{stock_stream, StockStream};
use km0::job::{self, RunOptions, Summary};
use km0::pipeline::Pipeline;
use km0::plugin::PluginRuntime;
use km0::Error;
use km0_e2e::*;
use std::path::{Path, PathBuf};

const EVENTS: u64 = 100_000;

struct Fixture {
    dir: tempfile::TempDir,
    pipeline: Pipeline,
    runtime: PluginRuntime,
}

/// The test stream: disorder, 0.4% late events, 0.2% malformed lines, other event types.
fn stream() -> StockStream {
    StockStream { events: EVENTS, seed: 7, late_fraction: 0.004, bad_fraction: 0.002, ..Default::default() }
}

fn fixture(threshold: i64, plugin_name: &str, batch_size: usize) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let mut f = std::fs::File::create(dir.path().join("in.jsonl")).unwrap();
    stock_stream(&stream(), &mut f).unwrap();
    let mut job = StockJob::new("2m", threshold);
    job.plugin = plugin(plugin_name);
    job.batch_size = batch_size;
    let pipeline = Pipeline::load(&job.write(dir.path())).unwrap();
    Fixture { dir, pipeline, runtime: PluginRuntime::new().unwrap() }
}

impl Fixture {
    fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }
    fn run(&self, opts: RunOptions) -> Summary {
        job::run(&self.pipeline, &opts, &self.runtime).unwrap()
    }
    fn outputs(&self) -> [String; 3] {
        ["out/alertas.jsonl", "out/late.jsonl", "out/dead-letter.jsonl"]
            .map(|f| std::fs::read_to_string(self.path(f)).unwrap_or_default())
    }
}

fn stop_after(n: u64) -> RunOptions {
    RunOptions { stop_with_savepoint_after: Some(n), ..Default::default() }
}

fn resume(sp: &Path) -> RunOptions {
    RunOptions { from_savepoint: Some(sp.to_path_buf()), ..Default::default() }
}

#[test]
fn uninterrupted_run_matches_the_reference_model() {
    let fx = fixture(10, "min-stock", 8192);
    let s = fx.run(RunOptions::default());
    let model = reference_stock(&fx.path("in.jsonl"), 120_000, u64::MAX);
    let got = records(&fx.path("out/alertas.jsonl"));
    assert!(got.len() > 1000, "a stream this long raises many alerts: {}", got.len());
    assert_eq!(got, model.alerts(10), "alerts, in emission order");
    assert_eq!(s.counters.late, model.late);
    assert!(model.late > 100, "the stream has late events: {}", model.late);
    assert_eq!(s.counters.dead_lettered, model.dead);
    assert_eq!(s.counters.filtered, model.filtered);
    assert_eq!(s.counters.read, EVENTS);
    assert_eq!(s.counters.windows_fired, model.windows.len() as u64);
    assert_eq!(read_jsonl(&fx.path("out/late.jsonl")).len() as u64, model.late);
}

#[test]
fn batch_size_does_not_change_results() {
    let a = fixture(10, "min-stock", 8192);
    a.run(RunOptions::default());
    let b = fixture(10, "min-stock", 7);
    b.run(RunOptions::default());
    let (oa, ob) = (a.outputs(), b.outputs());
    assert!(oa[0] == ob[0], "alerts differ between batch sizes 8192 and 7");
    // Side outputs name their (different) input files; compare the rest.
    for f in ["out/late.jsonl", "out/dead-letter.jsonl"] {
        let strip = |fx: &Fixture| {
            read_jsonl(&fx.path(f))
                .into_iter()
                .map(|mut v| {
                    v.as_object_mut().unwrap().remove("source");
                    v
                })
                .collect::<Vec<_>>()
        };
        assert!(strip(&a) == strip(&b), "{f} differs between batch sizes");
    }
}

#[test]
fn stop_and_resume_equals_the_uninterrupted_run() {
    let fx = fixture(10, "min-stock", 8192);
    let full = fx.run(RunOptions::default());
    let want = fx.outputs();
    for n in [1, 777, 25_000, 50_001, EVENTS - 1, EVENTS] {
        let stopped = fx.run(stop_after(n));
        let sp = stopped.savepoint.clone().expect("a savepoint");
        assert!(stopped.open_windows > 0, "N={n}: windows are open at the savepoint");
        let resumed = fx.run(resume(&sp));
        assert!(fx.outputs() == want, "N={n}: outputs differ from the uninterrupted run");
        assert_eq!(resumed.counters, full.counters, "N={n}");
        assert_eq!(resumed.records_this_run, EVENTS - n);
        std::fs::remove_dir_all(&sp).unwrap();
    }
    // A chain of savepoints: stop, resume and stop again, resume to the end.
    let a = fx.run(stop_after(30_000)).savepoint.unwrap();
    let b = fx.run(RunOptions { stop_with_savepoint_after: Some(30_000), ..resume(&a) }).savepoint.unwrap();
    assert!(b.ends_with("savepoint-000000060000"), "{}", b.display());
    fx.run(resume(&b));
    assert!(fx.outputs() == want, "chained savepoints: outputs differ");
}

#[test]
fn deploy_v2_migrates_the_open_windows() {
    // Threshold above any stock: every window reports, so every count can be checked.
    let fx = fixture(1000, "min-stock", 8192);
    let split = 50_000;
    let sp = fx.run(stop_after(split)).savepoint.unwrap();
    let s =
        job::deploy(&fx.pipeline, &plugin("min-stock-v2"), &sp, &RunOptions::default(), &fx.runtime).unwrap();
    assert_eq!(s.migrated, vec![("window-aggregate".to_string(), 1, 2)]);
    assert_eq!(s.plugin.version, "0.2.0");

    let model = reference_stock(&fx.path("in.jsonl"), 120_000, split);
    let got = records(&fx.path("out/alertas.jsonl"));
    assert_eq!(got.len(), model.windows.len());
    let mut carried = 0;
    for ((key, value), w) in got.iter().zip(&model.windows) {
        assert_eq!(key, &w.key());
        // Counts continue across the upgrade: nothing lost, nothing counted twice.
        assert_eq!(value["actualizaciones"], w.count, "{key}");
        assert_eq!(value["stock_minimo"], w.min, "{key}");
        if value.get("suma_delta").is_some() {
            // Emitted by v2: deltas are known from the upgrade on.
            assert_eq!(value["suma_delta"], w.delta_after, "{key}");
            assert_eq!(value["actualizaciones_con_delta"], w.count_after, "{key}");
            if w.count_after < w.count && w.count_after > 0 {
                carried += 1; // open at the savepoint and continued after it
            }
        } else {
            assert_eq!(w.count_after, 0, "{key}: emitted by v1 before the savepoint");
        }
    }
    assert!(carried > 100, "many windows were open across the upgrade: {carried}");
}

fn tree_digest(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read(&p).unwrap()))
        .collect();
    files.sort();
    files
}

#[test]
fn incompatible_plugins_are_refused_and_the_savepoint_is_untouched() {
    // A savepoint written by v2 (state schema 2)...
    let fx = fixture(10, "min-stock-v2", 8192);
    let sp = fx.run(stop_after(40_000)).savepoint.unwrap();
    let before = tree_digest(&sp);
    let alerts_before = std::fs::read(fx.path("out/alertas.jsonl")).unwrap();

    // ...cannot go back to v1, whose migrate does not read schema 2.
    let err = job::deploy(&fx.pipeline, &plugin("min-stock"), &sp, &RunOptions::default(), &fx.runtime)
        .expect_err("a downgrade is refused");
    assert!(matches!(err, Error::Deploy(_)), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("state schema 2"), "{msg}");

    // Not a component at all.
    let junk = fx.path("junk.wasm");
    std::fs::write(&junk, b"\0asm\x01\0\0\0 definitely not a km0 plugin").unwrap();
    let err = job::deploy(&fx.pipeline, &junk, &sp, &RunOptions::default(), &fx.runtime).unwrap_err();
    assert!(err.to_string().contains("not a WebAssembly component"), "{err}");

    // A plain resume with a plugin of another state schema points at `km0 deploy`.
    let mut v1 = fx.pipeline.clone();
    v1.aggregations[0].plugin.path = plugin("min-stock");
    let err = job::run(&v1, &resume(&sp), &fx.runtime).unwrap_err();
    assert!(err.to_string().contains("km0 deploy"), "{err}");

    assert_eq!(tree_digest(&sp), before, "the savepoint is unchanged");
    assert_eq!(std::fs::read(fx.path("out/alertas.jsonl")).unwrap(), alerts_before, "outputs untouched");

    // And the state is still good: the right plugin resumes from it.
    fx.run(resume(&sp));
}

#[test]
fn a_corrupt_savepoint_is_detected() {
    let fx = fixture(10, "min-stock", 8192);
    let sp = fx.run(stop_after(10_000)).savepoint.unwrap();
    let state = sp.join("state.bin");
    let mut bytes = std::fs::read(&state).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&state, &bytes).unwrap();
    let err = job::run(&fx.pipeline, &resume(&sp), &fx.runtime).unwrap_err();
    assert!(err.to_string().contains("corrupt"), "{err}");
}

#[test]
fn dead_letters_are_counted_exactly_and_the_job_continues() {
    let fx = fixture(10, "min-stock", 8192);
    let s = fx.run(RunOptions::default());
    let dead = read_jsonl(&fx.path("out/dead-letter.jsonl"));
    // The generator wrote 0.2% malformed lines; its own count is the expectation.
    let g = stock_stream(&stream(), &mut std::io::sink()).unwrap();
    assert!(g.bad > 100);
    assert_eq!(s.counters.dead_lettered, g.bad);
    assert_eq!(dead.len() as u64, g.bad);
    assert_eq!(s.counters.accepted + s.counters.late, g.stock_events);
    let reasons: std::collections::BTreeSet<String> = dead
        .iter()
        .map(|d| d["reason"].as_str().unwrap().split(" at byte").next().unwrap().to_string())
        .collect();
    for want in [
        "not a valid JSON object: expected ',' or '}' after a value (record ends)",
        "field `fecha_ms`: expected integer epoch milliseconds, got a string",
        "missing field `producto`",
        "not a valid JSON object: not a JSON object",
    ] {
        assert!(reasons.contains(want), "no dead letter says {want:?}: {reasons:?}");
    }
    assert!(
        reasons.iter().any(|r| r.contains("is not an integer number of epoch milliseconds")),
        "{reasons:?}"
    );
    assert!(dead.iter().all(|d| d["line"].as_u64().is_some() && d["record"].is_string()));
}

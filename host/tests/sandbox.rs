//! Misbehaving plugins (plugins/hostile) against the sandbox: a runaway loop is stopped at
//! its call timeout, unbounded allocation at the memory limit, a panic and garbage output
//! become errors naming the plugin and the call, and a plugin that reaches for files, the
//! environment or the network gets nothing. Plus the compiled-component cache.

mod common;
use common::*;

use km0::job::{self, RunOptions};
use km0::pipeline::Pipeline;
use km0::plugin::PluginRuntime;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The golden trace through the hostile plugin with `behaviour`.
fn run_hostile(behaviour: &str, limits: &str) -> (tempfile::TempDir, km0::Result<job::Summary>) {
    run_hostile_with(behaviour, limits, "")
}

fn run_hostile_with(
    behaviour: &str,
    limits: &str,
    config: &str,
) -> (tempfile::TempDir, km0::Result<job::Summary>) {
    run_hostile_windows(behaviour, limits, config, "kind = \"tumbling\"\nsize = \"5m\"")
}

fn run_hostile_windows(
    behaviour: &str,
    limits: &str,
    config: &str,
    window: &str,
) -> (tempfile::TempDir, km0::Result<job::Summary>) {
    let dir = tempfile::tempdir().unwrap();
    let trace = repo().join("examples/stock-alert/data/golden-trace.jsonl");
    let text = format!(
        r#"
name = "hostile"
key = ["producto"]
[source]
kind = "file"
path = {trace:?}
[event_time]
field = "fecha_ms"
watermark_delay = "2m"
[window]
{window}
[plugin]
path = {plugin:?}
{limits}
[plugin.config]
behaviour = "{behaviour}"
{config}
[sink]
kind = "file"
path = "out.jsonl"
[late]
path = "late.jsonl"
[dead_letter]
path = "dead.jsonl"
"#,
        trace = trace.display().to_string(),
        plugin = plugin("hostile").display().to_string(),
    );
    let path = dir.path().join("p.toml");
    std::fs::write(&path, text).unwrap();
    let p = Pipeline::load(&path).unwrap();
    let r = job::run(&p, &RunOptions::default(), &PluginRuntime::new().unwrap());
    (dir, r)
}

/// The reasons in the dead-letter file of a run.
fn dead_reasons(dir: &Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("dead.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["reason"].as_str().unwrap().to_string()
        })
        .collect()
}

#[test]
fn an_endless_loop_is_stopped_at_the_call_timeout() {
    let t = Instant::now();
    let (_dir, r) = run_hostile("loop", "call_timeout = \"200ms\"\non_error = \"fail\"");
    let err = r.expect_err("the job fails instead of hanging").to_string();
    assert!(
        err.contains("hostile") && err.contains("add") && err.contains("ran longer than its limit"),
        "{err}"
    );
    assert!(t.elapsed() < Duration::from_secs(10), "stopped after {:?}", t.elapsed());
    // By default the looping groups are stopped one by one and dead-lettered.
    let (dir, r) = run_hostile("loop", "call_timeout = \"100ms\"");
    let s = r.expect("the job goes on");
    assert_eq!(s.counters.dead_lettered, 10);
    assert!(dead_reasons(dir.path()).iter().all(|r| r.contains("ran longer than its limit")));
}

#[test]
fn unbounded_allocation_stops_at_the_memory_limit() {
    let (_dir, r) = run_hostile("alloc", "max_memory_mb = 128\non_error = \"fail\"");
    let err = r.expect_err("the job fails instead of eating the host's memory").to_string();
    assert!(
        err.contains("hostile") && err.contains("ran out of memory") && err.contains("limit of 128 MiB"),
        "{err}"
    );
    let (dir, r) = run_hostile("alloc", "max_memory_mb = 64");
    assert_eq!(r.expect("the job goes on").counters.dead_lettered, 10);
    assert!(dead_reasons(dir.path()).iter().all(|r| r.contains("limit of 64 MiB")));
}

#[test]
fn with_on_error_fail_a_panic_and_garbage_output_stop_the_job() {
    let (_dir, r) = run_hostile("panic", "on_error = \"fail\"");
    let err = r.expect_err("a trap fails the job").to_string();
    assert!(
        err.contains("plugin hostile")
            && err.contains("panicked at")
            && err.contains("hostile plugin panics on purpose")
            && !err.contains("memory"),
        "{err}"
    );
    let (_dir, r) = run_hostile("garbage", "on_error = \"fail\"");
    let err = r.expect_err("garbage output fails the job").to_string();
    assert!(err.contains("finish") && err.contains("not a JSON object"), "{err}");
}

#[test]
fn by_default_a_poison_key_is_dead_lettered_and_the_job_goes_on() {
    // queso-curado's events make the plugin panic: the batch is retried one group at a
    // time on fresh instances; queso-curado's 7 accepted events go to the dead letters
    // with the reason, aceite-arbequina's windows are computed as usual.
    let (dir, r) = run_hostile_with("panic_on", "", "key = \"queso-curado\"");
    let s = r.expect("the job goes on");
    assert_eq!(s.counters.dead_lettered, 7);
    assert_eq!(s.counters.accepted, 3);
    let dead: Vec<serde_json::Value> = std::fs::read_to_string(dir.path().join("dead.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let times: usize = dead.iter().map(|d| d["event_times"].as_array().unwrap().len()).sum();
    assert_eq!(times, 7);
    assert!(dead
        .iter()
        .all(|d| d["key"] == "queso-curado" && d["reason"].as_str().unwrap().contains("panicked at")));
    let out = std::fs::read_to_string(dir.path().join("out.jsonl")).unwrap();
    let aceite: u64 = out
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["value"]["key"] == "aceite-arbequina")
        .map(|v| v["value"]["events"].as_u64().unwrap())
        .sum();
    assert_eq!(aceite, 3);
    // queso-curado's windows took no event: they fire nothing (not an empty result).
    assert!(!out.contains("queso-curado"), "{out}");
    // Garbage results are dead-lettered per window, with the reason.
    let (dir, r) = run_hostile("garbage", "");
    let s = r.expect("the job goes on");
    assert_eq!(s.counters.emitted, 0);
    let dead = std::fs::read_to_string(dir.path().join("dead.jsonl")).unwrap();
    assert_eq!(dead.lines().count() as u64, s.counters.windows_fired);
    assert!(dead.contains("not a JSON object"));
}

#[test]
fn the_sandbox_gives_no_files_environment_or_network() {
    std::env::set_var("KM0_SECRET_FOR_THE_TEST", "do not leak");
    let (dir, r) = run_hostile("probe", "");
    r.unwrap();
    let out = std::fs::read_to_string(dir.path().join("out.jsonl")).unwrap();
    let first: serde_json::Value = serde_json::from_str(out.lines().next().unwrap()).unwrap();
    let v = &first["value"];
    assert!(v["file"].as_str().unwrap().starts_with("Err"), "{v}");
    assert!(v["dir"].as_str().unwrap().starts_with("Err"), "{v}");
    assert!(v["net"].as_str().unwrap().starts_with("Err"), "{v}");
    assert_eq!(v["env"], 0, "{v}");
    assert_eq!(v["args"], 0, "{v}");
    assert!(!out.contains("do not leak"));
    // The clocks stand still: the wall clock reads 2000-01-01 and a sleep takes no time,
    // so every window of every replay reports the same.
    assert_eq!(v["wall_ms"], 946_684_800_000u64, "{v}");
    assert_eq!(v["slept_ns"], 0, "{v}");
    let again = run_hostile("probe", "").0;
    assert_eq!(std::fs::read_to_string(again.path().join("out.jsonl")).unwrap(), out);
}

#[test]
fn a_guest_cannot_wait_past_its_call_timeout() {
    // 5 s of sleep per call against a 100 ms limit: the sleep returns at once (guests
    // have nothing to wait for), so the job takes no time and loses nothing.
    let t = Instant::now();
    let (_dir, r) = run_hostile("sleep", "call_timeout = \"100ms\"\non_error = \"fail\"");
    let s = r.expect("sleeping does not fail the job");
    assert_eq!(s.counters.dead_lettered, 0);
    assert!(t.elapsed() < Duration::from_secs(4), "took {:?}", t.elapsed());
    // Sleeping in a loop is a loop: stopped at the limit, each group dead-lettered.
    let t = Instant::now();
    let (dir, r) = run_hostile("sleep_forever", "call_timeout = \"100ms\"");
    let s = r.expect("the job goes on");
    assert_eq!(s.counters.dead_lettered, 10);
    assert!(dead_reasons(dir.path()).iter().all(|r| r.contains("ran longer than its limit")));
    assert!(t.elapsed() < Duration::from_secs(20), "took {:?}", t.elapsed());
}

#[test]
fn compiled_components_are_cached_and_a_damaged_artifact_is_replaced() {
    let cache = tempfile::tempdir().unwrap();
    let runtime = PluginRuntime::new().unwrap().with_cache(Some(cache.path().to_path_buf()));
    let wasm = plugin("min-stock");
    runtime.load(&wasm, &[]).unwrap();
    let artifacts: Vec<PathBuf> =
        std::fs::read_dir(cache.path()).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(artifacts.len(), 2, "{artifacts:?}"); // .cwasm and .sha256
    let cwasm = artifacts.iter().find(|p| p.extension().unwrap() == "cwasm").unwrap();
    let before = std::fs::read(cwasm).unwrap();
    // A second load uses the artifact; a damaged one is detected and written again.
    runtime.load(&wasm, &[]).unwrap();
    let mut bad = before.clone();
    let mid = bad.len() / 2;
    bad[mid] ^= 0xff;
    std::fs::write(cwasm, &bad).unwrap();
    let p = runtime.load(&wasm, &[("threshold".into(), "10".into())]).unwrap();
    assert_eq!(p.identity().name, "min-stock");
    assert_eq!(std::fs::read(cwasm).unwrap(), before);
}

#[test]
fn a_fault_in_merge_is_dead_lettered_like_one_in_add() {
    // Sliding windows merge their panes when they fire.
    {
        let window = "kind = \"sliding\"\nsize = \"5m\"\nslide = \"1m\"";
        let (dir, r) = run_hostile_windows("merge_panic", "", "", window);
        let s = r.unwrap_or_else(|e| panic!("{window}: the job goes on: {e}"));
        let reasons = dead_reasons(dir.path());
        assert!(!reasons.is_empty(), "{window}: merges failed, something is dead-lettered");
        assert!(
            reasons.iter().all(|r| r.contains("merge") && r.contains("panicked at")),
            "{window}: {reasons:?}"
        );
        assert_eq!(s.counters.dead_lettered, reasons.len() as u64);
        let (_dir, r) = run_hostile_windows("merge_panic", "on_error = \"fail\"", "", window);
        let err = r.expect_err("with on_error = fail the fault stops the job").to_string();
        assert!(err.contains("merge"), "{err}");
    }
}

#[test]
fn an_artifact_copied_under_another_components_key_is_not_run() {
    use std::os::unix::fs::PermissionsExt;
    let cache = tempfile::tempdir().unwrap();
    let dir = cache.path().join("components");
    let runtime = PluginRuntime::new().unwrap().with_cache(Some(dir.clone()));
    runtime.load(&plugin("min-stock"), &[("threshold".into(), "10".into())]).unwrap();
    assert_eq!(std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777, 0o700, "a private folder");
    let files = |ext: &str| -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == ext))
            .collect();
        v.sort();
        v
    };
    let (min_cwasm, min_seal) = (files("cwasm")[0].clone(), files("sha256")[0].clone());
    // Compile hostile too, then put its artifact and seal under min-stock's key.
    runtime.inspect(&plugin("hostile")).unwrap();
    let hostile_cwasm = files("cwasm").into_iter().find(|p| *p != min_cwasm).unwrap();
    let hostile_seal = hostile_cwasm.with_extension("sha256");
    std::fs::copy(&hostile_cwasm, &min_cwasm).unwrap();
    std::fs::copy(&hostile_seal, &min_seal).unwrap();
    let (identity, _) = runtime.inspect(&plugin("min-stock")).unwrap();
    assert_eq!(identity.name, "min-stock", "the copied artifact was refused and min-stock compiled again");
    assert_ne!(std::fs::read(&min_cwasm).unwrap(), std::fs::read(&hostile_cwasm).unwrap());
    // A folder of ours that others can write is made private again before it is used.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    std::fs::copy(&hostile_cwasm, &min_cwasm).unwrap();
    std::fs::copy(&hostile_seal, &min_seal).unwrap();
    let (identity, _) = runtime.inspect(&plugin("min-stock")).unwrap();
    assert_eq!(identity.name, "min-stock");
    assert_eq!(std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777, 0o700);
}

#[test]
fn a_4_gb_allocation_and_an_oversized_result_are_refused() {
    let (dir, r) = run_hostile("alloc_4g", "");
    assert_eq!(r.expect("the job goes on").counters.dead_lettered, 10);
    let reasons = dead_reasons(dir.path());
    // Rust refuses an allocation past the 32-bit address space itself, before asking the
    // host for memory: the guest's own words say so, not the memory limit.
    assert!(reasons.iter().all(|r| r.contains("capacity overflow") && !r.contains("memory")), "{reasons:?}");
    let (dir, r) = run_hostile("huge", "");
    let s = r.expect("the job goes on");
    assert_eq!(s.counters.emitted, 0);
    let reasons = dead_reasons(dir.path());
    assert_eq!(reasons.len() as u64, s.counters.windows_fired);
    assert!(reasons.iter().all(|r| r.contains("the limit is 1048576")), "{reasons:?}");
}

#[test]
fn a_plugin_built_against_another_contract_version_is_refused_naming_both() {
    // min-stock with every `km0:plugin/...@0.5.0` name rewritten to 0.6.0 (same length):
    // a component built against a contract this host does not implement.
    let mut wasm = std::fs::read(plugin("min-stock")).unwrap();
    let (from, to) = (b"km0:plugin/".as_slice(), b"@0.5.0".as_slice());
    let mut i = 0;
    let mut renamed = 0;
    while let Some(at) = wasm[i..].windows(from.len()).position(|w| w == from) {
        let start = i + at;
        let end = wasm[start..].windows(to.len()).position(|w| w == to).map(|p| start + p);
        if let Some(end) = end.filter(|e| e - start < 40) {
            wasm[end + 3] = b'6';
            renamed += 1;
        }
        i = start + from.len();
    }
    assert!(renamed >= 3, "{renamed}");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("min-stock-0.6.wasm");
    std::fs::write(&path, &wasm).unwrap();
    let runtime = PluginRuntime::new().unwrap();
    let err = runtime.inspect(&path).map(|_| ()).unwrap_err().to_string();
    assert!(
        err.contains("built against the km0 contract 0.6.0")
            && err.contains("0.1.0, 0.2.0, 0.3.0, 0.4.0, 0.5.0"),
        "{err}"
    );
    // A plugin of this host's contract reports the version it was built against.
    let (identity, _) = runtime.inspect(&plugin("min-stock")).unwrap();
    assert_eq!((identity.contract.as_str(), identity.key_fields), ("0.5.0", 2));
}

#[test]
fn plugins_built_against_older_contracts_still_run() {
    // min-stock as km0 0.1 built it, against contract 0.1.0 (it says nothing about key
    // fields), as km0 built it before 0.3.0, against 0.2.0 (without `fire`: its windows
    // are folded and finished in two calls), before 0.4.0, against 0.3.0 (`fire`, no
    // `panes`), and before 0.5.0, against 0.4.0 (records as a `list<emitted>`); fixtures.
    // They run, and their alerts are those of today's min-stock, which folds and finishes
    // closing windows in one call and returns their records in one buffer.
    let runtime = PluginRuntime::new().unwrap();
    let fixture = |v: &str| repo().join(format!("host/tests/fixtures/min-stock-contract-{v}.wasm"));
    for (v, key_fields, world) in [
        ("0.1.0", 0, "aggregate-plugin"),
        ("0.2.0", 2, "aggregate-plugin"),
        ("0.3.0", 2, "firing-aggregate-plugin"),
        ("0.4.0", 2, "firing-aggregate-plugin"),
    ] {
        let (identity, _) = runtime.inspect(&fixture(v)).unwrap();
        assert_eq!(
            (identity.name.as_str(), identity.contract.as_str(), identity.key_fields),
            ("min-stock", v, key_fields)
        );
        assert_eq!(runtime.world(&fixture(v)).unwrap(), world);
    }
    assert_eq!(runtime.world(&plugin("min-stock")).unwrap(), "firing-aggregate-plugin");
    let outputs: Vec<String> =
        [fixture("0.1.0"), fixture("0.2.0"), fixture("0.3.0"), fixture("0.4.0"), plugin("min-stock")]
            .iter()
            .map(|wasm| {
                let dir = tempfile::tempdir().unwrap();
                let text = std::fs::read_to_string(repo().join("examples/stock-alert/pipeline.toml"))
                    .unwrap()
                    .replace(
                        "data/stock.jsonl",
                        &repo().join("examples/stock-alert/data/stock.jsonl").display().to_string(),
                    )
                    .replace("../../plugins/dist/min-stock.wasm", &wasm.display().to_string());
                std::fs::write(dir.path().join("p.toml"), text).unwrap();
                let p = Pipeline::load(&dir.path().join("p.toml")).unwrap();
                job::run(&p, &RunOptions::default(), &runtime).unwrap();
                std::fs::read_to_string(dir.path().join("out/alertas.jsonl")).unwrap()
            })
            .collect();
    assert!(outputs[0].lines().count() > 100);
    for (i, output) in outputs.iter().enumerate().skip(1) {
        assert_eq!(&outputs[0], output, "plugin {i}");
    }
}

/// Run `plugin_name` (a hostile plugin) over `times` of keys (`producto`, `fecha_ms`).
fn run_events(
    plugin_name: &str,
    events: &[(&str, i64)],
    delay: &str,
    window: &str,
    extra: &str,
) -> (tempfile::TempDir, job::Summary) {
    let dir = tempfile::tempdir().unwrap();
    let lines: String =
        events.iter().map(|(k, t)| format!("{{\"producto\":\"{k}\",\"fecha_ms\":{t}}}\n")).collect();
    std::fs::write(dir.path().join("in.jsonl"), lines).unwrap();
    let text = format!(
        r#"
name = "hostile-events"
key = ["producto"]
[source]
kind = "file"
path = "in.jsonl"
[event_time]
field = "fecha_ms"
watermark_delay = {delay:?}
min = 0
[window]
{window}
[plugin]
path = {plugin:?}
{extra}
[sink]
kind = "file"
path = "out.jsonl"
[late]
path = "late.jsonl"
[dead_letter]
path = "dead.jsonl"
"#,
        plugin = plugin(plugin_name).display().to_string(),
    );
    std::fs::write(dir.path().join("p.toml"), text).unwrap();
    let p = Pipeline::load(&dir.path().join("p.toml")).unwrap();
    let s = job::run(&p, &RunOptions::default(), &PluginRuntime::new().unwrap()).unwrap();
    (dir, s)
}

/// Last value per key of a result file.
fn keyed(dir: &Path) -> std::collections::BTreeMap<String, serde_json::Value> {
    std::fs::read_to_string(dir.join("out.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .map(|v| (v["key"].as_str().unwrap().to_string(), v["value"].clone()))
        .collect()
}

#[test]
fn a_session_whose_own_events_were_rejected_still_takes_the_session_it_merges_with() {
    // Gap 40 s. r1's session B [200 s, 240 s) is in the plugin's accumulators (x fills the
    // batch of 2); the event at 150 s opens session A, staged, and the plugin fails on it;
    // the event at 180 s bridges A and B. B's event and the bridge must survive the merge
    // into A: one session [150 s, 240 s) with 2 events, and one dead letter.
    let events = [("r1", 200_000), ("x", 1_000), ("r1", 150_000), ("r1", 180_000)];
    let (dir, s) = run_events(
        "hostile",
        &events,
        "10m",
        "kind = \"session\"\ngap = \"40s\"",
        "batch_size = 2\n[plugin.config]\nbehaviour = \"panic_at\"\ntime = 150000",
    );
    let out = keyed(dir.path());
    assert_eq!(out["150000|r1"]["events"], 2, "{out:?}");
    assert_eq!(out["1000|x"]["events"], 1);
    assert_eq!(out.len(), 2, "{out:?}");
    assert_eq!(s.counters.dead_lettered, 1);
    assert!(dead_reasons(dir.path())[0].contains("add: panicked at"));
}

#[test]
fn a_rebuild_the_plugin_fails_on_leaves_an_ordered_window_as_it_was() {
    // Ordered input, tumbling 5 min, lateness 10 min. k's window [0, 5 min) fires with 2
    // events; a late event the plugin fails on is dead-lettered alone (the window keeps its
    // 2 events), and the next late event makes 3.
    let events = [("k", 1_000), ("k", 2_000), ("y", 400_000), ("k", 3_000), ("k", 4_000)];
    let (dir, s) = run_events(
        "hostile-ordered",
        &events,
        "0ms",
        "kind = \"tumbling\"\nsize = \"5m\"\nallowed_lateness = \"10m\"",
        "[plugin.config]\nbehaviour = \"panic_at\"\ntime = 3000",
    );
    let out = keyed(dir.path());
    assert_eq!(out["0|k"]["events"], 3, "{out:?}");
    let dead: Vec<serde_json::Value> = std::fs::read_to_string(dir.path().join("dead.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0]["event_times"], serde_json::json!([3000]));
    assert_eq!(s.counters.accepted, 4, "the 3 events of k that count, and y's");
}

/// The issue's plugin author's case: over 200 000 stock events, a plugin that loops
/// forever on one product, allocates without bound on a second, panics ("boom") on a third
/// and probes files, environment and network on a fourth; 100 events of the first three.
/// Every other window's count equals a model's (events counted per product and 5-minute
/// window, none late); each poisoned event reaches the dead letters once, with a reason
/// that says what happened; the whole run takes under 3 s with `call_timeout = "300ms"`
/// (each poison key costs its faults until it is quarantined, not one a batch).
#[test]
fn poison_keys_are_dead_lettered_once_with_honest_reasons_and_cost_a_bounded_time() {
    std::env::set_var("KM0_SECRET_FOR_THE_TEST", "do not leak");
    let dir = tempfile::tempdir().unwrap();
    let t0: i64 = 1_767_225_600_000; // 2026-01-01T00:00:00Z, a window boundary.
    let poison = ["loops", "allocates", "panics"];
    let mut lines = String::new();
    // (product, window start) -> events, of the products the plugin counts.
    let mut model: std::collections::BTreeMap<(String, i64), u64> = Default::default();
    let mut poisoned: std::collections::BTreeMap<i64, &str> = Default::default();
    let mut t = t0;
    for i in 0..200_000u32 {
        t += 150;
        let product = if i % 97 == 0 { "probe".to_string() } else { format!("p{:02}", i % 50) };
        lines.push_str(&format!("{{\"producto\":\"{product}\",\"stock\":{},\"fecha_ms\":{t}}}\n", i % 40));
        *model.entry((product, t - t.rem_euclid(300_000))).or_default() += 1;
        if i % 2000 == 1000 {
            let p = poison[poisoned.len() % 3];
            lines.push_str(&format!("{{\"producto\":\"{p}\",\"stock\":1,\"fecha_ms\":{t}}}\n"));
            poisoned.insert(t, p);
        }
    }
    assert_eq!(poisoned.len(), 100);
    let input = dir.path().join("events.jsonl");
    std::fs::write(&input, lines).unwrap();
    let path = poisoned_pipeline_with(
        dir.path(),
        &input,
        "call_timeout = \"300ms\"\nmax_memory_mb = 256",
        "loop_key = \"loops\"\nalloc_key = \"allocates\"\npanic_key = \"panics\"",
    );
    let p = Pipeline::load(&path).unwrap();
    let runtime = PluginRuntime::new().unwrap();
    // Compiled (and cached) before the clock starts: the run is what is timed.
    runtime.inspect(&plugin("hostile")).unwrap();
    let started = Instant::now();
    let s = job::run(&p, &RunOptions::default(), &runtime).expect("the job goes on");
    let took = started.elapsed();

    // Every normal result is the model's: one per (product, window), its count.
    let got: std::collections::BTreeMap<(String, i64), u64> = keyed(&dir.path().join("out"))
        .into_iter()
        .map(|(k, v)| {
            let (start, product) = k.split_once('|').unwrap();
            assert_eq!(v["key"], product, "{k}: {v}");
            ((product.to_string(), start.parse().unwrap()), v["events"].as_u64().unwrap())
        })
        .collect();
    assert_eq!(got, model);

    // Each poisoned event is dead-lettered once, with a reason that says what happened.
    let mut seen: std::collections::BTreeMap<i64, String> = Default::default();
    for line in std::fs::read_to_string(dir.path().join("out/dead.jsonl")).unwrap().lines() {
        assert!(!line.contains("do not leak"), "{line}");
        let d: serde_json::Value = serde_json::from_str(line).unwrap();
        let reason = d["reason"].as_str().unwrap().to_string();
        let times: Vec<i64> = match d["record"].as_str() {
            Some(record) => {
                let r: serde_json::Value = serde_json::from_str(record).unwrap();
                assert!(reason.starts_with("quarantined"), "{reason}");
                vec![r["fecha_ms"].as_i64().unwrap()]
            }
            None => d["event_times"].as_array().unwrap().iter().map(|t| t.as_i64().unwrap()).collect(),
        };
        for t in times {
            let Some(product) = poisoned.get(&t) else {
                panic!("dead-lettered event at {t} was not poisoned: {line}")
            };
            assert!(seen.insert(t, reason.clone()).is_none(), "event at {t} dead-lettered twice");
            match *product {
                "loops" => assert!(reason.contains("ran longer than its limit of 300ms"), "{reason}"),
                "allocates" => {
                    assert!(reason.contains("ran out of memory") && reason.contains("256 MiB"), "{reason}")
                }
                _ => assert!(
                    reason.contains("panicked at") && reason.contains("boom") && !reason.contains("memory"),
                    "{reason}"
                ),
            }
        }
    }
    assert_eq!(seen.len(), 100, "every poisoned event is dead-lettered");
    assert_eq!(s.counters.dead_lettered, 100);
    let op = &s.operators[0];
    assert!(op.counters.quarantined > 0, "{:?}", op.counters);
    let reasons: std::collections::BTreeSet<&String> = seen.values().collect();
    eprintln!("the run took {took:?}; reasons: {reasons:#?}");
    assert!(took < Duration::from_secs(3), "the run took {took:?}");
}

//! Regression tests for results lost or corrupted at the edges: recovery through another
//! spelling of the pipeline's path, a watermark raised by an unparseable record, sessions
//! merged within the allowed lateness, extreme timestamps, deploying into one of two
//! aggregations. Each scenario is small and hand-made; the expected output is worked out
//! from the semantics (or is an uninterrupted run's output). And a benchmark that fails
//! leaves no files behind.

use km0::job::{self, RunOptions, Summary};
use km0::pipeline::Pipeline;
use km0::plugin::PluginRuntime;
use km0_e2e::*;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn run(p: &Pipeline, opts: RunOptions) -> Summary {
    job::run(p, &opts, &PluginRuntime::new().unwrap()).unwrap()
}

/// A stock event (`stock.actualizado`).
fn stock(producto: &str, mercado: &str, t: i64, stock: i64) -> String {
    format!(
        r#"{{"tipo":"stock.actualizado","producto":"{producto}","mercado":"{mercado}","fecha_ms":{t},"stock_actual":{stock},"delta":-1}}"#
    )
}

fn write_lines(path: &Path, lines: &[String]) {
    std::fs::write(path, lines.iter().map(|l| format!("{l}\n")).collect::<String>()).unwrap();
}

/// A job over `paths` (one partition each), in `dir`: StockJob's pipeline with `source`.
fn stock_job(dir: &Path, source: &str, extra: &str) -> Pipeline {
    let mut job = StockJob::new("2m", 10);
    job.source = source.to_string();
    job.extra = extra.to_string();
    Pipeline::load(&job.write(dir)).unwrap()
}

#[test]
fn recovery_through_another_spelling_of_the_pipeline_path_keeps_the_outputs() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    let spec =
        km0::generate::StockStream { events: 60_000, seed: 7, bad_fraction: 0.001, ..Default::default() };
    km0::generate::stock_stream(&spec, &mut std::fs::File::create(&input).unwrap()).unwrap();
    let mut job = StockJob::new("2m", 10);
    job.extra = "[checkpoints]\ndir = \"chk\"\ninterval = \"1h\"\nevery_records = 20000".into();
    let path = job.write(dir.path());
    // The reference: one uninterrupted run (no checkpoints) of the same input, into ref/.
    let text = std::fs::read_to_string(&path).unwrap().replace("out/", "ref/");
    let text = text.split("[checkpoints]").next().unwrap().to_string();
    std::fs::write(dir.path().join("ref.toml"), text).unwrap();
    run(&Pipeline::load(&dir.path().join("ref.toml")).unwrap(), RunOptions::default());
    let ref_dir = dir.path();
    // `km0 run pipeline.toml` from its folder stops after 50k records (checkpoints at 20k
    // and 40k), then `km0 run /abs/.../pipeline.toml` recovers from the 40k checkpoint.
    let km0 = km0_bin();
    let out = Command::new(&km0)
        .args(["run", "pipeline.toml", "--stop-with-savepoint-after", "50000"])
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = Command::new(&km0).arg("run").arg(&path).current_dir("/").output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("recovered from checkpoint chk-000002"), "{err}");
    for f in ["alertas.jsonl", "late.jsonl", "dead-letter.jsonl"] {
        let got = std::fs::read_to_string(dir.path().join("out").join(f)).unwrap();
        let want = std::fs::read_to_string(ref_dir.join("ref").join(f)).unwrap();
        assert!(want.lines().count() > 10, "{f}: {} lines", want.lines().count());
        assert!(
            got == want,
            "{f}: {} lines, the uninterrupted run wrote {}",
            got.lines().count(),
            want.lines().count()
        );
    }
    // And once more through `./sub/../pipeline.toml`: nothing left to do, nothing lost.
    std::fs::create_dir(dir.path().join("sub")).unwrap();
    let out =
        Command::new(&km0).args(["run", "./sub/../pipeline.toml"]).current_dir(dir.path()).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let got = std::fs::read_to_string(dir.path().join("out/alertas.jsonl")).unwrap();
    assert_eq!(got, std::fs::read_to_string(ref_dir.join("ref/alertas.jsonl")).unwrap());
}

#[test]
fn a_resumed_run_does_not_overwrite_another_file_that_holds_output() {
    let dir = tempfile::tempdir().unwrap();
    let lines: Vec<String> = (0..20).map(|i| stock("p", "m", i * 60_000, 5)).collect();
    write_lines(&dir.path().join("in.jsonl"), &lines);
    let p = stock_job(dir.path(), "kind = \"file\"\npath = \"in.jsonl\"", "");
    let stopped = run(&p, RunOptions { stop_with_savepoint_after: Some(10), ..Default::default() });
    let other = dir.path().join("other.jsonl");
    std::fs::write(&other, "{\"key\":\"precious\",\"value\":{}}\n").unwrap();
    let opts =
        RunOptions { from_savepoint: stopped.savepoint, output: Some(other.clone()), ..Default::default() };
    let err = job::run(&p, &opts, &PluginRuntime::new().unwrap()).unwrap_err().to_string();
    assert!(err.contains("would be overwritten"), "{err}");
    assert!(std::fs::read_to_string(&other).unwrap().contains("precious"));
}

#[test]
fn a_watermark_raised_by_an_unparseable_record_fires_before_a_savepoint() {
    // Four files read round-robin; a partition goes idle after 2 records of the others.
    // Record 5 (a's second line) is not JSON: it makes b (the only one behind) idle, and
    // the watermark jumps to 10:00 - 2 min = 8:00, past p|m's window [0, 5 min).
    let dir = tempfile::tempdir().unwrap();
    let files = [
        vec![stock("x", "y", 600_000, 100), "{not json".to_string()],
        vec![stock("p", "m", 0, 1)],
        vec![stock("x", "y", 600_000, 100)],
        vec![stock("x", "y", 600_000, 100)],
    ];
    let mut paths = Vec::new();
    for (i, lines) in files.iter().enumerate() {
        let path = dir.path().join(format!("{i}.jsonl"));
        write_lines(&path, lines);
        paths.push(format!("{:?}", path.display().to_string()));
    }
    let source = format!("kind = \"file\"\npaths = [{}]\nidle_after_records = 2", paths.join(", "));
    let p = stock_job(dir.path(), &source, "");
    run(&p, RunOptions::default());
    let want = std::fs::read_to_string(dir.path().join("out/alertas.jsonl")).unwrap();
    assert_eq!(records(&dir.path().join("out/alertas.jsonl")).len(), 1, "{want}");
    assert!(want.contains("\"0|p|m\""), "{want}");
    // Stopped with a savepoint right after the unparseable record, then resumed.
    for n in 1..=5 {
        let stopped = run(&p, RunOptions { stop_with_savepoint_after: Some(n), ..Default::default() });
        run(&p, RunOptions { from_savepoint: stopped.savepoint, ..Default::default() });
        let got = std::fs::read_to_string(dir.path().join("out/alertas.jsonl")).unwrap();
        assert_eq!(got, want, "savepoint after record {n}");
    }
}

#[test]
fn sessions_merged_within_the_allowed_lateness_leave_one_row_per_session() {
    // Gap 10 s, allowed lateness 5 min, watermark delay 0. r1's events at 100 s and 115 s
    // are two sessions; 200 s fires both. 108 s bridges them into [100 s, 125 s) and 95 s
    // extends that to [95 s, 125 s): one session of four positions, written under its
    // start; the rows under 100 s and 115 s are retracted.
    let dir = tempfile::tempdir().unwrap();
    let times = [100_000, 115_000, 200_000, 108_000, 95_000];
    let lines: Vec<String> = times
        .iter()
        .map(|t| format!(r#"{{"repartidor":"r1","lat":41.98,"lon":2.82,"fecha_ms":{t}}}"#))
        .collect();
    write_lines(&dir.path().join("in.jsonl"), &lines);
    let text = format!(
        r#"
name = "sesiones"
key = ["repartidor"]
[source]
kind = "file"
path = "in.jsonl"
[event_time]
field = "fecha_ms"
watermark_delay = 0
[window]
kind = "session"
gap = "10s"
allowed_lateness = "5m"
[plugin]
path = {plugin:?}
[sink]
kind = "file"
path = "out/panel.jsonl"
[late]
path = "out/late.jsonl"
[dead_letter]
path = "out/dead.jsonl"
"#,
        plugin = plugin("session-gap").display().to_string()
    );
    let path = dir.path().join("pipeline.toml");
    std::fs::write(&path, text).unwrap();
    let s = run(&Pipeline::load(&path).unwrap(), RunOptions::default());
    let view = keyed_view(&dir.path().join("out/panel.jsonl"));
    let keys: Vec<&str> = view.keys().map(String::as_str).collect();
    assert_eq!(keys, ["200000|r1", "95000|r1"], "{view:?}");
    assert_eq!(view["95000|r1"]["desde"], 95_000);
    assert_eq!(view["95000|r1"]["hasta"], 115_000);
    assert_eq!(view["95000|r1"]["posiciones"], 4);
    assert_eq!(view["200000|r1"]["posiciones"], 1);
    assert_eq!(s.counters.late, 0);
    assert_eq!(s.counters.retracted, 2, "115000|r1 and then 100000|r1 were superseded");
    // The retractions are in the file, each before the result that supersedes it.
    let raw = records(&dir.path().join("out/panel.jsonl"));
    let pos = |k: &str, null: bool| raw.iter().position(|(key, v)| key == k && v.is_null() == null).unwrap();
    assert!(pos("115000|r1", true) < pos("100000|r1", true));
    assert!(pos("100000|r1", true) < pos("95000|r1", false));
}

/// Run the km0 binary, killing it if it takes longer than `limit` (a hang is a failure).
fn km0_within(args: &[&str], dir: &Path, limit: Duration) -> std::process::Output {
    let mut child = Command::new(km0_bin())
        .args(args)
        .current_dir(dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t.elapsed() > limit {
            child.kill().unwrap();
            panic!("km0 {args:?} still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

#[test]
fn extreme_timestamps_are_dead_lettered_and_the_job_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let t0 = 1_757_844_000_000;
    let mut lines = vec![stock("p", "m", t0, 3)];
    for t in ["9223372036854600000", "-9223372036854775808", "9223372036854775807", "-1", "16725225600000"] {
        lines.push(format!(
            r#"{{"tipo":"stock.actualizado","producto":"p","mercado":"m","fecha_ms":{t},"stock_actual":1,"delta":0}}"#
        ));
    }
    lines.push(stock("p", "m", t0 + 60_000, 4));
    write_lines(&dir.path().join("in.jsonl"), &lines);
    StockJob::new("2m", 10).write(dir.path());
    let out = km0_within(&["run", "pipeline.toml"], dir.path(), Duration::from_secs(30));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let dead = read_jsonl(&dir.path().join("out/dead-letter.jsonl"));
    assert_eq!(dead.len(), 5, "{dead:?}");
    for d in &dead {
        assert!(d["reason"].as_str().unwrap().contains("outside the accepted range"), "{d}");
    }
    let alerts = records(&dir.path().join("out/alertas.jsonl"));
    assert_eq!(alerts.len(), 1);
    assert_eq!(alerts[0].0, format!("{t0}|p|m"));
    assert_eq!(alerts[0].1["stock_minimo"], 3);
    assert_eq!(alerts[0].1["actualizaciones"], 2);
    // The range is configurable: a pipeline may accept years before 1970.
    let text = std::fs::read_to_string(dir.path().join("pipeline.toml"))
        .unwrap()
        .replace("watermark_delay = \"2m\"", "watermark_delay = \"2m\"\nmin = -62135596800000");
    std::fs::write(dir.path().join("pipeline.toml"), text).unwrap();
    let out = km0_within(&["run", "pipeline.toml"], dir.path(), Duration::from_secs(30));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(read_jsonl(&dir.path().join("out/dead-letter.jsonl")).len(), 4, "-1 is accepted now");
}

#[test]
fn deploy_configures_the_new_plugin_like_the_aggregation_it_replaces() {
    // Two aggregations: min-stock (threshold 5) and session-gap (no configuration).
    // Deploying session-gap.wasm must configure it as session-gap, not with threshold.
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    let spec = km0::generate::StockStream { events: 20_000, seed: 2, ..Default::default() };
    km0::generate::stock_stream(&spec, &mut std::fs::File::create(&input).unwrap()).unwrap();
    let text = format!(
        r#"
name = "two"
key = ["producto", "mercado"]
[source]
kind = "file"
path = "in.jsonl"
[filter]
tipo = "stock.actualizado"
[event_time]
field = "fecha_ms"
watermark_delay = "2m"
[[aggregations]]
name = "alerta"
window = {{ kind = "tumbling", size = "5m" }}
plugin = {{ path = {min:?}, config = {{ threshold = 5 }} }}
[[aggregations]]
name = "sesion"
window = {{ kind = "session", gap = "3m" }}
plugin = {{ path = {gap:?} }}
[sink]
kind = "file"
path = "out/r.jsonl"
[late]
path = "out/late.jsonl"
[dead_letter]
path = "out/dead.jsonl"
"#,
        min = plugin("min-stock").display().to_string(),
        gap = plugin("session-gap").display().to_string()
    );
    let path = dir.path().join("pipeline.toml");
    std::fs::write(&path, text).unwrap();
    let p = Pipeline::load(&path).unwrap();
    let runtime = PluginRuntime::new().unwrap();
    let full = run(&p, RunOptions::default());
    let want = std::fs::read_to_string(dir.path().join("out/r.jsonl")).unwrap();
    let stopped = run(&p, RunOptions { stop_with_savepoint_after: Some(10_000), ..Default::default() });
    let sp = stopped.savepoint.unwrap();
    let s = job::deploy(&p, &plugin("session-gap"), &sp, &RunOptions::default(), &runtime).unwrap();
    assert!(s.migrated.is_empty(), "the same state schema: nothing to migrate ({:?})", s.migrated);
    assert_eq!(std::fs::read_to_string(dir.path().join("out/r.jsonl")).unwrap(), want);
    assert_eq!(s.counters, full.counters);
}

#[test]
fn deploying_a_plugin_whose_fields_changed_over_held_rows_is_refused_before_any_output() {
    // distance holds each pane's positions (two fields) until its windows are done;
    // distance-v2 reads three fields and cannot take them.
    let dir = tempfile::tempdir().unwrap();
    let spec = km0::generate::DeliveryStream { riders: 10, minutes: 30, ..Default::default() };
    let n = km0::generate::delivery_stream(
        &spec,
        &mut std::fs::File::create(dir.path().join("in.jsonl")).unwrap(),
    )
    .unwrap();
    let text = format!(
        r#"
name = "panel"
key = ["repartidor"]
[source]
kind = "file"
path = "in.jsonl"
[event_time]
field = "fecha_ms"
watermark_delay = "45s"
[window]
kind = "sliding"
size = "5m"
slide = "1m"
[plugin]
path = {plugin:?}
[sink]
kind = "file"
path = "out/panel.jsonl"
[late]
path = "out/late.jsonl"
[dead_letter]
path = "out/dead.jsonl"
"#,
        plugin = plugin("distance").display().to_string()
    );
    let path = dir.path().join("pipeline.toml");
    std::fs::write(&path, text).unwrap();
    let p = Pipeline::load(&path).unwrap();
    let stopped = run(&p, RunOptions { stop_with_savepoint_after: Some(n / 2), ..Default::default() });
    let before = std::fs::read(dir.path().join("out/panel.jsonl")).unwrap();
    let sp = stopped.savepoint.unwrap();
    let runtime = PluginRuntime::new().unwrap();
    let err = job::deploy(&p, &plugin("distance-v2"), &sp, &RunOptions::default(), &runtime)
        .expect_err("refused")
        .to_string();
    assert!(err.contains("rows") && err.contains("altitud"), "{err}");
    assert_eq!(std::fs::read(dir.path().join("out/panel.jsonl")).unwrap(), before, "no output touched");
    // The job keeps its state: a plain resume still works.
    run(&p, RunOptions { from_savepoint: Some(sp), ..Default::default() });
}

#[test]
fn keys_that_differ_only_by_where_the_separator_falls_do_not_collide() {
    let dir = tempfile::tempdir().unwrap();
    let t0 = 1_757_844_000_000;
    let lines = vec![
        stock("queso|curado", "girona", t0, 3),
        stock("queso", "curado|girona", t0 + 1_000, 4),
        stock("pan", "vic", t0 + 20 * 60_000, 50),
    ];
    write_lines(&dir.path().join("in.jsonl"), &lines);
    let p = Pipeline::load(&StockJob::new("2m", 10).write(dir.path())).unwrap();
    run(&p, RunOptions::default());
    let view = keyed_view(&dir.path().join("out/alertas.jsonl"));
    assert_eq!(view.len(), 2, "{view:?}");
    assert_eq!(view[&format!(r"{t0}|queso\|curado|girona")]["stock_minimo"], 3);
    assert_eq!(view[&format!(r"{t0}|queso|curado\|girona")]["stock_minimo"], 4);
}

#[test]
fn a_record_one_aggregation_cannot_take_still_reaches_the_others() {
    // The delivery panel: distance reads lat/lon, session-gap reads nothing. A position
    // without `lat` is dead-lettered for distancia only; sin_senal counts it.
    let dir = tempfile::tempdir().unwrap();
    let t0 = 1_757_844_000_000i64;
    let lines = vec![
        format!(r#"{{"repartidor":"r1","lat":41.98,"lon":2.82,"fecha_ms":{t0}}}"#),
        format!(r#"{{"repartidor":"r1","lon":2.83,"fecha_ms":{}}}"#, t0 + 60_000),
    ];
    write_lines(&dir.path().join("in.jsonl"), &lines);
    let example = std::fs::read_to_string(repo().join("examples/delivery-panel/pipeline.toml")).unwrap();
    let text = example
        .replace("data/posiciones.jsonl", "in.jsonl")
        .replace("../../plugins/dist/", &format!("{}/", plugin("distance").parent().unwrap().display()));
    std::fs::write(dir.path().join("pipeline.toml"), text).unwrap();
    let s = run(&Pipeline::load(&dir.path().join("pipeline.toml")).unwrap(), RunOptions::default());
    let dead = read_jsonl(&dir.path().join("out/dead-letter.jsonl"));
    assert_eq!(dead.len(), 1, "{dead:?}");
    let reason = dead[0]["reason"].as_str().unwrap();
    assert!(reason.contains("distancia") && reason.contains("lat"), "{reason}");
    let view = keyed_view(&dir.path().join("out/panel.jsonl"));
    assert_eq!(view[&format!("sin_senal|{t0}|r1")]["posiciones"], 2, "{view:?}");
    assert_eq!(s.counters.dead_lettered, 1);
}

#[test]
fn a_job_that_reads_many_fields_filters_and_aggregates_as_one_that_reads_few() {
    // A record's fields go in slots: 8 for most jobs, more for a job that reads more.
    // Seven filter fields make the wide job read 11 (time, 7 filters, 2 key fields, the
    // plugin's); the narrow job reads 5 of the same records, without the records the
    // wide job's filters drop. Both must write the same results and late events.
    let dir = tempfile::tempdir().unwrap();
    let spec = km0::generate::StockStream { events: 20_000, seed: 7, ..Default::default() };
    let mut generated = Vec::new();
    km0::generate::stock_stream(&spec, &mut generated).unwrap();
    let (mut wide, mut narrow) = (Vec::new(), Vec::new());
    for (i, line) in String::from_utf8(generated).unwrap().lines().enumerate() {
        let Some(body) = line.strip_suffix('}') else { continue };
        // Every 10th record fails one of the extra filters (a different one each time).
        let bad = (i % 10 == 3).then_some(1 + i / 10 % 6);
        let extra: String =
            (1..=6).map(|f| format!(", \"x{f}\": \"{}\"", if bad == Some(f) { "b" } else { "a" })).collect();
        wide.push(format!("{body}{extra}}}"));
        if bad.is_none() {
            narrow.push(line.to_string());
        }
    }
    let outputs = |lines: &[String], filters: &str| {
        let sub = tempfile::tempdir_in(dir.path()).unwrap();
        write_lines(&sub.path().join("in.jsonl"), lines);
        let path = StockJob::new("2m", 10).write(sub.path());
        let text = std::fs::read_to_string(&path)
            .unwrap()
            .replace("tipo = \"stock.actualizado\"", &format!("tipo = \"stock.actualizado\"\n{filters}"));
        std::fs::write(&path, text).unwrap();
        let s = run(&Pipeline::load(&path).unwrap(), RunOptions::default());
        let read = |f: &str| std::fs::read_to_string(sub.path().join("out").join(f)).unwrap();
        (read("alertas.jsonl"), read("late.jsonl"), s.counters.filtered)
    };
    let filters: String = (1..=6).map(|f| format!("x{f} = \"a\"\n")).collect();
    let (wide_out, wide_late, wide_filtered) = outputs(&wide, &filters);
    let (narrow_out, narrow_late, narrow_filtered) = outputs(&narrow, "");
    assert!(wide_out.lines().count() > 50, "{} results", wide_out.lines().count());
    assert_eq!(wide_out, narrow_out);
    assert_eq!(wide_late, narrow_late);
    assert_eq!(wide_filtered, narrow_filtered + (wide.len() - narrow.len()) as u64);
}

#[test]
fn records_taken_in_a_row_keep_their_own_line_and_offset_in_the_side_outputs() {
    // Thousands of records of one layout (taken one after another where they lie, many in
    // one call), `\n` and `\r\n` line ends, blank lines, filtered records, and planted
    // late and malformed ones: every late and dead-letter line names the line number and
    // byte offset where its record starts, as counted here from the bytes written.
    let dir = tempfile::tempdir().unwrap();
    let t0 = 1_757_844_000_000i64;
    let (mut input, mut line, mut planted) = (Vec::<u8>::new(), 0u64, Vec::new());
    for i in 0..6000i64 {
        let t = t0 + i * 1000;
        let (record, kind) = match i % 97 {
            // An hour behind the stream (from its second hour on): past every window.
            13 if i > 3600 => (stock("p1", "m1", t - 3_600_000, 5), Some("late")),
            // A stock that is not a number: the same layout, dead-lettered.
            41 => (
                stock("p2", "m1", t, 5).replace(r#""stock_actual":5"#, r#""stock_actual":"cinco""#),
                Some("dead"),
            ),
            50 => (stock("p3", "m2", t, 5).replace("stock.actualizado", "pedido.creado"), None),
            _ => (stock(&format!("p{}", i % 40), "m1", t, 20 + i % 7), None),
        };
        if i % 211 == 0 {
            input.extend_from_slice(b"\n");
            line += 1;
        }
        line += 1;
        if let Some(kind) = kind {
            planted.push((kind, line, input.len() as u64, record.clone()));
        }
        input.extend_from_slice(record.as_bytes());
        input.extend_from_slice(if i % 3 == 0 { b"\r\n" } else { b"\n" });
    }
    std::fs::write(dir.path().join("in.jsonl"), &input).unwrap();
    let p = stock_job(dir.path(), "kind = \"file\"\npath = \"in.jsonl\"", "");
    let s = run(&p, RunOptions::default());
    let mut seen: Vec<(&str, u64, u64, String)> = Vec::new();
    for (kind, file) in [("late", "out/late.jsonl"), ("dead", "out/dead-letter.jsonl")] {
        for l in read_jsonl(&dir.path().join(file)) {
            let at = (l["line"].as_u64().unwrap(), l["offset"].as_u64().unwrap());
            seen.push((kind, at.0, at.1, l["record"].as_str().unwrap().to_string()));
        }
    }
    seen.sort_by_key(|s| s.1);
    let want: Vec<(&str, u64, u64, String)> = planted;
    assert_eq!(seen.len(), want.len());
    for (got, want) in seen.iter().zip(&want) {
        assert_eq!(got, want);
    }
    assert!(want.iter().filter(|w| w.0 == "late").count() > 20);
    assert_eq!(s.counters.late as usize, want.iter().filter(|w| w.0 == "late").count());
}

#[test]
fn a_benchmark_leaves_no_folder_behind_when_it_fails_or_ends() {
    let dir = tempfile::tempdir().unwrap();
    let tmp = dir.path().join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    let mut job = StockJob::new("2m", 10);
    // Its plugin is missing: the job fails after the benchmark wrote its input.
    let plugin = std::mem::replace(&mut job.plugin, dir.path().join("missing.wasm"));
    let bad = dir.path().join("bad.toml");
    std::fs::rename(job.write(dir.path()), &bad).unwrap();
    job.plugin = plugin;
    let good = job.write(dir.path());
    let bench = |pipeline: &Path| {
        Command::new(km0_bin())
            .arg("bench")
            .arg(pipeline)
            .args(["--events", "2000", "--repeat", "1"])
            .env("TMPDIR", &tmp)
            .output()
            .unwrap()
    };
    let out = bench(&bad);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("missing.wasm"), "{err}");
    let left = |tmp: &Path| std::fs::read_dir(tmp).unwrap().map(|e| e.unwrap().path()).collect::<Vec<_>>();
    assert_eq!(left(&tmp), Vec::<std::path::PathBuf>::new());
    let out = bench(&good);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("2000 records"));
    assert_eq!(left(&tmp), Vec::<std::path::PathBuf>::new());
}

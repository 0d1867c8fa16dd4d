//! Window semantics against the independent model of `tests/lib.rs` (`model`): sliding,
//! session and tumbling windows on generated delivery streams in three partitions (by
//! field, with one partition falling silent and rejoining; or one file each), with
//! disorder, tunnels, a 22-minute resend and allowed lateness; plus hand-checked cases.

use km0::generate::{delivery_stream, DeliveryStream};
use km0::job::{self, RunOptions, Summary};
use km0::pipeline::Pipeline;
use km0::plugin::PluginRuntime;
use km0_e2e::model::{self, Ev, Input, Kind, Spec};
use km0_e2e::*;
use std::path::{Path, PathBuf};

/// Haversine as the distance plugin defines it (mean Earth radius), written again here.
fn haversine(a: &Ev, b: &Ev) -> f64 {
    let r = 6_371_008.8_f64;
    let (p1, p2) = (a.lat.to_radians(), b.lat.to_radians());
    let h = ((p2 - p1) / 2.0).sin().powi(2)
        + p1.cos() * p2.cos() * ((b.lon - a.lon).to_radians() / 2.0).sin().powi(2);
    2.0 * r * h.sqrt().asin()
}

struct Case {
    dir: tempfile::TempDir,
    files: Vec<PathBuf>,
    /// One file partitioned by its `particion` field (else: one partition per file).
    by_field: bool,
}

/// A delivery stream in three partitions, with `particion` in every record.
fn delivery(riders: u32, minutes: u32) -> Vec<String> {
    let spec = DeliveryStream { riders, minutes, partitions: 3, ..Default::default() };
    let mut all = Vec::new();
    delivery_stream(&spec, &mut all).unwrap();
    String::from_utf8(all).unwrap().lines().map(str::to_string).collect()
}

fn partition_of(line: &str) -> usize {
    let v: serde_json::Value = serde_json::from_str(line).unwrap();
    v["particion"].as_u64().unwrap() as usize
}

/// One file, partitioned by field; partition 2 says nothing between 30% and 60% of the
/// stream: it goes idle, then rejoins behind the watermark.
fn by_field(riders: u32, minutes: u32) -> Case {
    let dir = tempfile::tempdir().unwrap();
    let lines = delivery(riders, minutes);
    let n = lines.len();
    let kept: String = lines
        .iter()
        .enumerate()
        .filter(|(i, l)| !(partition_of(l) == 2 && i * 10 >= n * 3 && i * 10 < n * 6))
        .map(|(_, l)| format!("{l}\n"))
        .collect();
    let file = dir.path().join("in.jsonl");
    std::fs::write(&file, kept).unwrap();
    Case { dir, files: vec![file], by_field: true }
}

/// Three files, one per partition, read round-robin.
fn three_files(riders: u32, minutes: u32) -> Case {
    let dir = tempfile::tempdir().unwrap();
    let mut parts = vec![String::new(), String::new(), String::new()];
    for l in delivery(riders, minutes) {
        let p = partition_of(&l);
        parts[p].push_str(&l);
        parts[p].push('\n');
    }
    let files: Vec<PathBuf> = (0..3).map(|p| dir.path().join(format!("p{p}.jsonl"))).collect();
    for (f, text) in files.iter().zip(&parts) {
        std::fs::write(f, text).unwrap();
    }
    Case { dir, files, by_field: false }
}

fn ev(v: &serde_json::Value) -> Ev {
    Ev {
        key: v["repartidor"].as_str().unwrap().to_string(),
        t: v["fecha_ms"].as_i64().unwrap(),
        lat: v["lat"].as_f64().unwrap(),
        lon: v["lon"].as_f64().unwrap(),
        arrival: 0,
    }
}

/// Riders whose positions are, one after another, exactly the session gap (3 min) apart,
/// 1 ms less or 1 ms more, or closer; most arrive within 2 s of their time, one in eight
/// up to 21 minutes later (late events, and sessions bridged after they fired). In three
/// files.
fn edge_gaps(riders: u64, positions: u64) -> Case {
    const GAP: i64 = 180_000;
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = move |n: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % n
    };
    let mut events = Vec::new();
    for r in 0..riders {
        let mut t = 1_757_000_000_000i64 + r as i64 * 7_000;
        for _ in 0..positions {
            let arrival = t + if next(8) == 0 { 60_000 + next(1_200_000) } else { next(2_000) } as i64;
            events.push((arrival, t, r));
            t += match next(4) {
                0 => GAP - 1,
                1 => GAP,
                2 => GAP + 1,
                _ => 1_000 + next(60_000) as i64,
            };
        }
    }
    events.sort();
    let dir = tempfile::tempdir().unwrap();
    let mut parts = vec![String::new(), String::new(), String::new()];
    for (arrival, t, r) in events {
        parts[(r % 3) as usize].push_str(&format!(
            "{{\"repartidor\": \"moto-{r}\", \"lat\": 40.4, \"lon\": -3.7, \"fecha_ms\": {t}, \"llegada_ms\": {arrival}}}\n"
        ));
    }
    let files: Vec<PathBuf> = (0..3).map(|p| dir.path().join(format!("p{p}.jsonl"))).collect();
    for (f, text) in files.iter().zip(&parts) {
        std::fs::write(f, text).unwrap();
    }
    Case { dir, files, by_field: false }
}

impl Case {
    fn pipeline(&self, window: &str, plugin_name: &str, delay: &str, idle_after: u64) -> Pipeline {
        self.pipeline_of(window, &plugin(plugin_name), delay, idle_after)
    }

    /// [`Case::pipeline`] with the plugin component at `wasm`.
    fn pipeline_of(&self, window: &str, wasm: &Path, delay: &str, idle_after: u64) -> Pipeline {
        let paths: Vec<String> =
            self.files.iter().map(|f| format!("{:?}", f.display().to_string())).collect();
        let source = if self.by_field {
            format!("path = {}\npartition_field = \"particion\"", paths[0])
        } else {
            format!("paths = [{}]", paths.join(", "))
        };
        let text = format!(
            r#"
name = "delivery"
key = ["repartidor"]
[source]
kind = "file"
{source}
idle_after_records = {idle_after}
[event_time]
field = "fecha_ms"
watermark_delay = "{delay}"
[window]
{window}
[plugin]
path = "{plugin}"
batch_size = 1000
[sink]
kind = "file"
path = "out/panel.jsonl"
[late]
path = "out/late.jsonl"
[dead_letter]
path = "out/dead.jsonl"
[savepoints]
dir = "out/savepoints"
"#,
            plugin = wasm.display()
        );
        let path = self.dir.path().join("pipeline.toml");
        std::fs::write(&path, text).unwrap();
        Pipeline::load(&path).unwrap()
    }

    /// The model's inputs in the job's read order, arrival indices in that order.
    fn inputs(&self) -> Vec<Input> {
        let read = |f: &PathBuf| -> Vec<serde_json::Value> {
            std::fs::read_to_string(f).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
        };
        let mut inputs = if self.by_field {
            let mut names: Vec<u64> = Vec::new();
            read(&self.files[0])
                .iter()
                .map(|v| {
                    let p = v["particion"].as_u64().unwrap();
                    let i = names.iter().position(|&n| n == p).unwrap_or_else(|| {
                        names.push(p);
                        names.len() - 1
                    });
                    Input::Record(i, Some(ev(v)))
                })
                .collect()
        } else {
            let files: Vec<Vec<Option<Ev>>> =
                self.files.iter().map(|f| read(f).iter().map(|v| Some(ev(v))).collect()).collect();
            model::round_robin(&files)
        };
        for (i, input) in inputs.iter_mut().enumerate() {
            if let Input::Record(_, Some(ev)) = input {
                ev.arrival = i;
            }
        }
        inputs
    }

    /// Partitions known before the first record (files); by field they appear later.
    fn known_partitions(&self) -> usize {
        if self.by_field {
            0
        } else {
            self.files.len()
        }
    }

    fn out(&self, f: &str) -> PathBuf {
        self.dir.path().join("out").join(f)
    }
}

fn run(p: &Pipeline, opts: RunOptions) -> Summary {
    job::run(p, &opts, &PluginRuntime::new().unwrap()).unwrap()
}

/// Compare km0's results with the model's, record by record, in order.
fn assert_same(got: &[(String, serde_json::Value)], want: &model::Outcome, plugin_name: &str) {
    if std::env::var("KM0_DEBUG_MODEL").is_ok() {
        for (i, (k, v)) in got.iter().enumerate() {
            eprintln!("got {i} {k} {v}");
        }
        for (i, f) in want.fired.iter().enumerate() {
            eprintln!(
                "want {i} {}|{} {} {:?}",
                f.start,
                f.key,
                f.end,
                f.events.iter().map(|e| e.t).collect::<Vec<_>>()
            );
        }
    }
    assert_eq!(got.len(), want.fired.len(), "number of results");
    for (i, ((key, value), f)) in got.iter().zip(&want.fired).enumerate() {
        assert_eq!(key, &format!("{}|{}", f.start, f.key), "result {i}");
        if f.events.is_empty() {
            assert!(value.is_null(), "result {i} {key}: a retraction");
            continue;
        }
        assert_eq!(value["posiciones"], f.events.len(), "result {i} {key}");
        match plugin_name {
            "distance" => {
                assert_eq!(value["ventana_fin"], f.end, "result {i} {key}");
                let want: f64 = f.events.windows(2).map(|w| haversine(&w[0], &w[1])).sum();
                let got = value["distancia_m"].as_f64().unwrap();
                assert!(
                    (got - want).abs() <= 1e-6 * want.max(1.0),
                    "result {i} {key}: {got} m, model {want} m"
                );
            }
            _ => {
                assert_eq!(value["desde"], f.events.iter().map(|e| e.t).min().unwrap(), "result {i} {key}");
                assert_eq!(value["hasta"], f.events.iter().map(|e| e.t).max().unwrap(), "result {i} {key}");
            }
        }
    }
}

fn check_against_model(case: Case, window: &str, kind: Kind, plugin_name: &str, lateness: i64) {
    check_component_against_model(&case, window, kind, &plugin(plugin_name), plugin_name, lateness);
}

/// [`check_against_model`] of the component at `wasm`, which is plugin `plugin_name`.
fn check_component_against_model(
    case: &Case,
    window: &str,
    kind: Kind,
    wasm: &Path,
    plugin_name: &str,
    lateness: i64,
) {
    let p = case.pipeline_of(window, wasm, "45s", 300);
    let s = run(&p, RunOptions::default());
    let spec = Spec { kind, delay: 45_000, lateness, idle_after: Some(300) };
    let want = model::run(&case.inputs(), case.known_partitions(), spec);
    assert_same(&records(&case.out("panel.jsonl")), &want, plugin_name);
    assert_eq!(s.counters.late, want.late, "late events");
    assert!(want.late > 10, "the stream has late events: {}", want.late);
    assert_eq!(read_jsonl(&case.out("late.jsonl")).len() as u64, want.late);
    assert_eq!(s.open_windows, 0);
}

const SLIDING: &str = "kind = \"sliding\"\nsize = \"5m\"\nslide = \"1m\"";
const SESSION: &str = "kind = \"session\"\ngap = \"3m\"";

#[test]
fn sliding_distance_matches_the_model() {
    check_against_model(by_field(40, 90), SLIDING, Kind::Sliding(300_000, 60_000), "distance", 0);
}

#[test]
fn a_plugin_without_panes_has_its_sliding_windows_merged_pairwise_to_the_same_results() {
    // distance as km0 built it against contract 0.3.0, a fixture: without `panes`, each
    // window's panes are merged with one `merge` call a pane after the first, then
    // finished; today's distance merges and finishes each window in one call. Both match
    // the model, and their results are the same bytes.
    let fixture = repo().join("host/tests/fixtures/distance-contract-0.3.0.wasm");
    let runtime = PluginRuntime::new().unwrap();
    let (old, _) = runtime.inspect(&fixture).unwrap();
    let (new, _) = runtime.inspect(&plugin("distance")).unwrap();
    assert_eq!((old.contract.as_str(), new.contract.as_str()), ("0.3.0", km0::plugin::CONTRACT_VERSION));
    let mut results = Vec::new();
    for wasm in [fixture, plugin("distance")] {
        let case = three_files(40, 90);
        let window = format!("{SLIDING}\nallowed_lateness = \"2m\"");
        check_component_against_model(
            &case,
            &window,
            Kind::Sliding(300_000, 60_000),
            &wasm,
            "distance",
            120_000,
        );
        results.push(std::fs::read_to_string(case.out("panel.jsonl")).unwrap());
    }
    assert!(results[0].lines().count() > 1000, "{} results", results[0].lines().count());
    assert_eq!(results[0], results[1]);
}

#[test]
fn plugins_that_return_records_as_a_list_give_the_results_of_those_that_return_one_buffer() {
    // distance and session-gap as km0 built them against contract 0.4.0, fixtures: their
    // records come back as a `list<emitted>`, a string each; today's come back in one
    // buffer (`packed-records`), from `panes`, `fire` and `finish` (sessions, and windows
    // that late events fire again). Both match the model, and their results are the same
    // bytes.
    let runtime = PluginRuntime::new().unwrap();
    // (plugin, window, its kind, allowed lateness, fewest results: counted in a run)
    let sliding = format!("{SLIDING}\nallowed_lateness = \"2m\"");
    let session = format!("{SESSION}\nallowed_lateness = \"5m\"");
    for (name, window, kind, lateness, least) in [
        ("distance", sliding, Kind::Sliding(300_000, 60_000), 120_000, 1000),
        ("session-gap", session, Kind::Session(180_000), 300_000, 50),
    ] {
        let fixture = repo().join(format!("host/tests/fixtures/{name}-contract-0.4.0.wasm"));
        let (old, _) = runtime.inspect(&fixture).unwrap();
        let (new, _) = runtime.inspect(&plugin(name)).unwrap();
        assert_eq!((old.contract.as_str(), new.contract.as_str()), ("0.4.0", km0::plugin::CONTRACT_VERSION));
        let mut results = Vec::new();
        for wasm in [fixture, plugin(name)] {
            let case = three_files(40, 90);
            check_component_against_model(&case, &window, kind, &wasm, name, lateness);
            results.push(std::fs::read_to_string(case.out("panel.jsonl")).unwrap());
        }
        assert!(results[0].lines().count() > least, "{name}: {} results", results[0].lines().count());
        assert_eq!(results[0], results[1], "{name}");
    }
}

#[test]
fn sliding_with_allowed_lateness_matches_the_model() {
    let window = format!("{SLIDING}\nallowed_lateness = \"2m\"");
    check_against_model(three_files(40, 90), &window, Kind::Sliding(300_000, 60_000), "distance", 120_000);
}

#[test]
fn sessions_match_the_model() {
    check_against_model(by_field(40, 90), SESSION, Kind::Session(180_000), "session-gap", 0);
}

#[test]
fn sessions_split_only_on_a_silence_longer_than_the_gap() {
    // Gaps of exactly 3 min, 1 ms less and 1 ms more, with and without allowed lateness.
    check_against_model(edge_gaps(30, 60), SESSION, Kind::Session(180_000), "session-gap", 0);
    let window = format!("{SESSION}\nallowed_lateness = \"5m\"");
    check_against_model(edge_gaps(30, 60), &window, Kind::Session(180_000), "session-gap", 300_000);
}

#[test]
fn sessions_with_allowed_lateness_match_the_model() {
    let window = format!("{SESSION}\nallowed_lateness = \"5m\"");
    check_against_model(three_files(40, 90), &window, Kind::Session(180_000), "session-gap", 300_000);
}

#[test]
fn tumbling_with_allowed_lateness_matches_the_model() {
    let window = "kind = \"tumbling\"\nsize = \"5m\"\nallowed_lateness = \"3m\"";
    check_against_model(by_field(40, 90), window, Kind::Tumbling(300_000), "session-gap", 180_000);
}

/// Write `lines` as one file partitioned by `particion` and run a session-gap pipeline
/// over it, stopping with a savepoint after the last line (no end-of-input firing).
fn tiny(lines: &[String], window: &str, delay: &str, idle_after: u64) -> (Case, Summary) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("in.jsonl");
    std::fs::write(&file, lines.join("\n")).unwrap();
    let case = Case { dir, files: vec![file], by_field: true };
    let p = case.pipeline(window, "session-gap", delay, idle_after);
    let s = run(&p, RunOptions { stop_with_savepoint_after: Some(lines.len() as u64), ..Default::default() });
    (case, s)
}

const T0: i64 = 1_757_844_000_000; // 10:00

/// A position of `rider` at `minute` after 10:00, in partition `part`.
fn pos(rider: &str, minute: f64, part: u32) -> String {
    let t = T0 + (minute * 60_000.0) as i64;
    format!(r#"{{"repartidor": "{rider}", "lat": 41.98, "lon": 2.82, "fecha_ms": {t}, "particion": {part}}}"#)
}

#[test]
fn an_event_that_bridges_two_sessions_merges_them() {
    // Sessions [0, 1+3) and [5, 5+3) for moto-1 (gap 3 min), then an event at minute 3.5
    // bridges them: one session [0, 5+3) with 4 positions. A delay of 3 minutes keeps the
    // first session open when the bridging event arrives; the last event (minute 20)
    // moves the watermark past the merged session.
    let lines = [
        pos("moto-1", 0.0, 0),
        pos("moto-1", 1.0, 0),
        pos("moto-1", 5.0, 0),
        pos("moto-1", 3.5, 0),
        pos("bici-1", 20.0, 0),
    ];
    let (case, s) = tiny(&lines, SESSION, "3m", 1000);
    let out = records(&case.out("panel.jsonl"));
    assert_eq!(out.len(), 1, "{out:?}");
    assert_eq!(out[0].0, format!("{T0}|moto-1"));
    assert_eq!(out[0].1["desde"], T0);
    assert_eq!(out[0].1["hasta"], T0 + 5 * 60_000);
    assert_eq!(out[0].1["posiciones"], 4);
    assert_eq!(s.counters.late, 0);
    // bici-1's session is still open: it went into the savepoint.
    assert_eq!(s.open_windows, 1);
}

/// A position of `rider` at `minute` whose latitude grows with time, so a path that goes
/// back in time is longer than the path in time order.
fn moving(rider: &str, minute: f64) -> String {
    let t = T0 + (minute * 60_000.0).round() as i64;
    let lat = 41.98 + minute * 0.001;
    format!(r#"{{"repartidor": "{rider}", "lat": {lat}, "lon": 2.82, "fecha_ms": {t}, "particion": 0}}"#)
}

/// Run the distance plugin over sliding 5m/1m windows (delay 45 s, no lateness) on
/// `lines`, optionally stopping with a savepoint after `stop` records and resuming.
fn distance_run(lines: &[String], stop: Option<u64>) -> (tempfile::TempDir, Summary, String) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("in.jsonl");
    std::fs::write(&file, lines.join("\n")).unwrap();
    let case = Case { dir, files: vec![file], by_field: true };
    let p = case.pipeline(SLIDING, "distance", "45s", 1000);
    let s = match stop {
        None => run(&p, RunOptions::default()),
        Some(n) => {
            let stopped = run(&p, RunOptions { stop_with_savepoint_after: Some(n), ..Default::default() });
            run(&p, RunOptions { from_savepoint: stopped.savepoint, ..Default::default() })
        }
    };
    let out = std::fs::read_to_string(case.out("panel.jsonl")).unwrap();
    (case.dir, s, out)
}

#[test]
fn a_position_after_its_pane_was_handed_over_joins_its_open_windows_in_time_order() {
    // furgoneta-10 in pane [8, 9) at minutes 8.2 and 8.8; the pane is handed over when the
    // watermark passes minute 9 (minute 10 arrives: watermark 9.25). Minute 8.53 arrives
    // when the watermark is at 10.15 (after minute 10.9): too late for the windows that
    // fired ([4, 9) and [5, 10)), in time for [6, 11), [7, 12) and [8, 13), whose distance
    // must be the path through their positions in time order (8.2 -> 8.53 -> 8.8).
    let minutes = [6.0, 7.0, 8.2, 8.8, 9.1, 10.0, 10.9, 8.53];
    let lines: Vec<String> = minutes.iter().map(|&m| moving("furgoneta-10", m)).collect();
    let (_dir, s, out) = distance_run(&lines, None);
    // Each window's positions, worked out by hand from the windows' bounds and the
    // watermark at each arrival.
    let windows: [(i64, &[f64]); 9] = [
        (2, &[6.0]),
        (3, &[6.0, 7.0]),
        (4, &[6.0, 7.0, 8.2, 8.8]),
        (5, &[6.0, 7.0, 8.2, 8.8, 9.1]),
        (6, &[6.0, 7.0, 8.2, 8.53, 8.8, 9.1, 10.0, 10.9]),
        (7, &[7.0, 8.2, 8.53, 8.8, 9.1, 10.0, 10.9]),
        (8, &[8.2, 8.53, 8.8, 9.1, 10.0, 10.9]),
        (9, &[9.1, 10.0, 10.9]),
        (10, &[10.0, 10.9]),
    ];
    let got: Vec<serde_json::Value> =
        out.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()).collect();
    assert_eq!(got.len(), windows.len(), "{out}");
    for ((start, positions), r) in windows.iter().zip(&got) {
        let start_ms = T0 + start * 60_000;
        assert_eq!(r["key"], format!("{start_ms}|furgoneta-10"));
        assert_eq!(r["value"]["posiciones"], positions.len(), "window at minute {start}");
        let evs: Vec<Ev> = positions
            .iter()
            .map(|&m| Ev { key: String::new(), t: 0, lat: 41.98 + m * 0.001, lon: 2.82, arrival: 0 })
            .collect();
        let want: f64 = evs.windows(2).map(|w| haversine(&w[0], &w[1])).sum();
        let got = r["value"]["distancia_m"].as_f64().unwrap();
        assert!(
            (got - want).abs() <= 1e-6 * want.max(1.0),
            "window at minute {start}: {got} m, in order {want} m"
        );
    }
    // No window took an event after it fired: nothing is a late update.
    assert_eq!((s.counters.late, s.counters.late_updates), (0, 0));
    // A savepoint after any record (the pane held, handed over, or reopened) resumes to
    // the same bytes.
    for n in 1..lines.len() as u64 {
        let (_d, resumed, again) = distance_run(&lines, Some(n));
        assert_eq!(again, out, "stop after record {n}");
        assert_eq!(resumed.counters, s.counters, "stop after record {n}");
    }
}

#[test]
fn sessions_with_ordered_input_match_the_model() {
    // Sessions grow backwards and merge within the allowed lateness: the distance of a
    // session is the path through all its positions in time order.
    let window = format!("{SESSION}\nallowed_lateness = \"5m\"");
    check_against_model(three_files(40, 90), &window, Kind::Session(180_000), "distance", 300_000);
}

#[test]
fn a_window_fires_only_after_an_idle_partition_times_out() {
    // Partition 1 speaks at minutes 0 and 0.5 and then is silent; partition 0 moves on to
    // minute 33. Partition 1's watermark (-45 s) holds the minimum down until it has been
    // idle for 5 records of the other partition.
    let mut lines = vec![pos("bici-1", 0.0, 1), pos("bici-1", 0.5, 1)];
    lines.extend((0..12).map(|i| pos("moto-1", i as f64 * 3.0, 0)));
    let window = "kind = \"tumbling\"\nsize = \"5m\"";
    // With an idle timeout that does not bite (1000 records), nothing fires.
    let (case, s) = tiny(&lines, window, "45s", 1000);
    assert!(records(&case.out("panel.jsonl")).is_empty());
    assert_eq!(s.watermark, T0 + 30_000 - 45_000);
    // Idle after 5 records: partition 1 stops counting and the windows fire.
    let (case, s) = tiny(&lines, window, "45s", 5);
    let out = records(&case.out("panel.jsonl"));
    assert_eq!(out[0].0, format!("{T0}|bici-1"));
    assert_eq!(out[1].0, format!("{T0}|moto-1"));
    assert_eq!(out[1].1["posiciones"], 2); // minutes 0 and 3
    assert_eq!(s.watermark, T0 + 33 * 60_000 - 45_000);
}

#[test]
fn the_22_minute_resend_goes_to_the_late_output() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("posiciones.jsonl");
    let spec = DeliveryStream { riders: 20, minutes: 60, ..Default::default() };
    delivery_stream(&spec, &mut std::fs::File::create(&input).unwrap()).unwrap();
    let p = Pipeline::load(&repo().join("examples/delivery-panel/pipeline.toml")).unwrap();
    let late_path = dir.path().join("late.jsonl");
    let mut p2 = p.clone();
    p2.late = late_path.clone();
    let opts = RunOptions {
        input: Some(input.clone()),
        output: Some(dir.path().join("panel.jsonl")),
        ..Default::default()
    };
    run(&p2, opts);
    // Every position of furgoneta-3 that arrived 22 minutes after it was taken.
    let resent: Vec<i64> = read_jsonl(&input)
        .iter()
        .filter(|v| {
            v["repartidor"] == "furgoneta-3"
                && v["llegada_ms"].as_i64().unwrap() - v["fecha_ms"].as_i64().unwrap() == 22 * 60_000
        })
        .map(|v| v["fecha_ms"].as_i64().unwrap())
        .collect();
    assert!(resent.len() >= 20, "{}", resent.len());
    let late = read_jsonl(&late_path);
    let late_of = |agg: &str| -> Vec<i64> {
        let mut v: Vec<i64> = late
            .iter()
            .filter(|l| l["aggregation"] == agg && l["record"].as_str().unwrap().contains("furgoneta-3"))
            .map(|l| l["event_time"].as_i64().unwrap())
            .filter(|t| resent.contains(t))
            .collect();
        v.sort();
        v
    };
    // Every resent position is 22 minutes old: all its sliding windows have fired.
    assert_eq!(late_of("distancia"), resent, "distancia: all resent positions are late");
    // A session is different: resent positions within 3 minutes of furgoneta-3's still
    // open session extend it backwards (as Flink merges them); the older ones are late.
    let session_late = late_of("sin_senal");
    let absorbed: Vec<i64> = resent.iter().copied().filter(|t| !session_late.contains(t)).collect();
    assert!(session_late.len() >= resent.len() / 3, "{session_late:?}");
    if let Some(&first) = absorbed.first() {
        let panel = records(&dir.path().join("panel.jsonl"));
        let extended = panel.iter().any(|(k, v)| {
            k.starts_with("sin_senal|") && v["repartidor"] == "furgoneta-3" && v["desde"] == first
        });
        assert!(extended, "a furgoneta-3 session starts at the first absorbed position {first}");
    }
}

#[test]
fn allowed_lateness_re_emits_the_golden_window() {
    // The lesson: delay 2 min and allowed lateness 2 min; the t=4.2 event updates the
    // fired 10:00-10:05 window, emitted again under the same key with min=8, n=5.
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(golden_trace(), dir.path().join("in.jsonl")).unwrap();
    let path = StockJob::new("2m", 10).write(dir.path());
    let text = std::fs::read_to_string(&path)
        .unwrap()
        .replace("size = \"5m\"", "size = \"5m\"\nallowed_lateness = \"2m\"");
    std::fs::write(&path, text).unwrap();
    let s = run(&Pipeline::load(&path).unwrap(), RunOptions::default());
    let out = records(&dir.path().join("out/alertas.jsonl"));
    let key = "1757844000000|queso-curado|girona";
    let versions: Vec<_> = out.iter().filter(|(k, _)| k == key).map(|(_, v)| v.clone()).collect();
    assert_eq!(versions.len(), 2);
    assert_eq!(
        (versions[0]["stock_minimo"].as_i64(), versions[0]["actualizaciones"].as_i64()),
        (Some(8), Some(4))
    );
    assert_eq!(
        (versions[1]["stock_minimo"].as_i64(), versions[1]["actualizaciones"].as_i64()),
        (Some(8), Some(5))
    );
    assert_eq!(s.counters.late, 0);
    assert_eq!(s.counters.late_updates, 1);
    assert_eq!(keyed_view(&dir.path().join("out/alertas.jsonl"))[key]["actualizaciones"], 5);
}

fn outputs(dir: &Path) -> [String; 2] {
    ["out/panel.jsonl", "out/late.jsonl"].map(|f| std::fs::read_to_string(dir.join(f)).unwrap_or_default())
}

#[test]
fn savepoint_resume_equals_the_uninterrupted_run_for_sliding_and_session() {
    let case = three_files(30, 60);
    let example = std::fs::read_to_string(repo().join("examples/delivery-panel/pipeline.toml")).unwrap();
    let paths: Vec<String> = case.files.iter().map(|f| format!("{:?}", f.display().to_string())).collect();
    let text = example
        .replace("path = \"data/posiciones.jsonl\"", &format!("paths = [{}]", paths.join(", ")))
        .replace("../../plugins/dist/", &format!("{}/", repo().join("plugins/dist").display()));
    let path = case.dir.path().join("pipeline.toml");
    std::fs::write(&path, text).unwrap();
    let p = Pipeline::load(&path).unwrap();
    let full = run(&p, RunOptions::default());
    let want = outputs(case.dir.path());
    assert!(want[0].lines().count() > 1000);
    for n in [1, 2_000, 5_555, full.counters.read - 1] {
        let stopped = run(&p, RunOptions { stop_with_savepoint_after: Some(n), ..Default::default() });
        let sp = stopped.savepoint.unwrap();
        let resumed = run(&p, RunOptions { from_savepoint: Some(sp.clone()), ..Default::default() });
        let got = outputs(case.dir.path());
        for (g, w) in got.iter().zip(&want) {
            let first = g.lines().zip(w.lines()).position(|(a, b)| a != b);
            assert!(g == w, "N={n}: outputs differ from the uninterrupted run at line {first:?}");
        }
        assert_eq!(resumed.counters, full.counters, "N={n}");
        std::fs::remove_dir_all(sp).unwrap();
    }
}

#[test]
fn state_stays_flat_over_a_long_stream() {
    // Six hours of 60 repartidores. The open slots and interned keys at five savepoints
    // along the way stay bounded: fired windows and closed sessions leave the state.
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    let spec = DeliveryStream { riders: 60, minutes: 360, ..Default::default() };
    let n = delivery_stream(&spec, &mut std::fs::File::create(&input).unwrap()).unwrap();
    let p = Pipeline::load(&repo().join("examples/delivery-panel/pipeline.toml")).unwrap();
    let base = RunOptions {
        input: Some(input),
        output: Some(dir.path().join("panel.jsonl")),
        savepoint_dir: Some(dir.path().join("sp")),
        ..Default::default()
    };
    let step = n / 6;
    let mut from = None;
    let mut sizes = Vec::new();
    for _ in 0..5 {
        let s = run(
            &p,
            RunOptions {
                stop_with_savepoint_after: Some(step),
                from_savepoint: from.clone(),
                ..base.clone()
            },
        );
        sizes.push((s.open_windows, s.operators.iter().map(|o| o.keys).max().unwrap()));
        from = s.savepoint;
    }
    let slots: Vec<usize> = sizes.iter().map(|s| s.0).collect();
    let (lo, hi) = (*slots.iter().min().unwrap(), *slots.iter().max().unwrap());
    assert!(hi <= lo * 2, "open slots grow: {slots:?}");
    // Distance: about 5-6 panes per rider; sessions: one per rider.
    assert!(hi <= 60 * 8, "{slots:?}");
    assert!(sizes.iter().all(|s| s.1 <= 60), "keys: {sizes:?}");
}

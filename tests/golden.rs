//! The lesson's worked trace (`shared/golden/`), reproduced exactly for tolerated delays
//! of 0, 2 and 5 minutes: which windows fire, on which arrival, with what minimum and
//! count, and which events are late. Expected values are the lesson's, typed in by hand.

use km0::job::{self, RunOptions};
use km0::pipeline::Pipeline;
use km0::plugin::PluginRuntime;
use km0_e2e::*;
use serde_json::json;

const T0: i64 = 1_757_844_000_000; // 2025-09-14 10:00 UTC
const W0: i64 = T0;
const W5: i64 = T0 + 300_000;
const W10: i64 = T0 + 600_000;

fn alert(start: i64, producto: &str, min: i64, n: u64) -> (String, serde_json::Value) {
    (
        format!("{start}|{producto}|girona"),
        json!({"ventana_inicio": start, "ventana_fin": start + 300_000, "producto": producto,
               "mercado": "girona", "stock_minimo": min, "actualizaciones": n}),
    )
}

struct Run {
    records: Vec<(String, serde_json::Value)>,
    late: u64,
    late_lines: Vec<serde_json::Value>,
}

/// Run the golden trace; `stop_after` stops (with a savepoint) after that many records.
fn run(delay: &'static str, threshold: i64, stop_after: Option<u64>) -> Run {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(golden_trace(), dir.path().join("in.jsonl")).unwrap();
    let p = Pipeline::load(&StockJob::new(delay, threshold).write(dir.path())).unwrap();
    let opts = RunOptions { stop_with_savepoint_after: stop_after, ..Default::default() };
    let s = job::run(&p, &opts, &PluginRuntime::new().unwrap()).unwrap();
    Run {
        records: records(&dir.path().join("out/alertas.jsonl")),
        late: s.counters.late,
        late_lines: read_jsonl(&dir.path().join("out/late.jsonl")),
    }
}

/// The arrival (1-based record number) after which `key` has been emitted.
fn fired_on(delay: &'static str, key: &str) -> Option<u64> {
    (1..=11).find(|&n| run(delay, 1000, Some(n)).records.iter().any(|(k, _)| k == key))
}

#[test]
fn delay_2_minutes_the_lessons_choice() {
    let r = run("2m", 10, None);
    assert_eq!(
        r.records,
        vec![
            alert(W0, "queso-curado", 8, 4),
            alert(W5, "queso-curado", 9, 2),
            alert(W10, "aceite-arbequina", 7, 1)
        ]
    );
    // The t=4.2 event arriving at 10:09:30 is late, counted once, in no output.
    assert_eq!(r.late, 1);
    assert_eq!(r.late_lines.len(), 1);
    assert_eq!(r.late_lines[0]["event_time"], json!(T0 + 252_000));
    assert_eq!(r.late_lines[0]["window_start"], json!(W0));
    // The watermark then was 10:06:00 (from the t=8.0 event), not moved by the late one.
    assert_eq!(r.late_lines[0]["watermark"], json!(T0 + 360_000));
    assert_eq!(r.late_lines[0]["line"], json!(9));

    // Every window, alert or not (threshold above any stock).
    let all = run("2m", 1000, None);
    assert_eq!(
        all.records,
        vec![
            alert(W0, "queso-curado", 8, 4),
            alert(W5, "aceite-arbequina", 35, 2),
            alert(W5, "queso-curado", 9, 2),
            alert(W10, "aceite-arbequina", 7, 1),
            alert(W10, "queso-curado", 13, 1),
        ]
    );
}

#[test]
fn delay_2_minutes_fires_on_the_right_arrivals() {
    // 10:00-10:05 fires on the t=7.3 event (7th arrival), with the t=4.9 event inside.
    assert_eq!(fired_on("2m", &format!("{W0}|queso-curado|girona")), Some(7));
    // 10:05-10:10 fires for both products on the t=12.4 event (11th arrival).
    assert_eq!(fired_on("2m", &format!("{W5}|queso-curado|girona")), Some(11));
    assert_eq!(fired_on("2m", &format!("{W5}|aceite-arbequina|girona")), Some(11));
    // 10:10-10:15 is still open after the last event: a savepoint keeps it, no output.
    let stopped = run("2m", 1000, Some(11));
    assert!(!stopped.records.iter().any(|(k, _)| k.starts_with(&W10.to_string())));
}

#[test]
fn delay_0_gives_the_wrong_answer_early() {
    let r = run("0m", 1000, None);
    assert_eq!(r.records[0], alert(W0, "queso-curado", 12, 3));
    assert_eq!(r.late, 2);
    assert_eq!(fired_on("0m", &format!("{W0}|queso-curado|girona")), Some(4)); // t=6.1
                                                                               // With the real threshold there is no alert for 10:00-10:05.
    let alerts = run("0m", 10, None);
    assert!(!alerts.records.iter().any(|(k, _)| k.starts_with(&W0.to_string())));
}

#[test]
fn delay_5_minutes_is_complete_but_late() {
    let r = run("5m", 1000, None);
    assert_eq!(r.records[0], alert(W0, "queso-curado", 8, 5));
    assert_eq!(r.late, 0);
    assert_eq!(fired_on("5m", &format!("{W0}|queso-curado|girona")), Some(10)); // t=10.2
}

#[test]
fn reference_model_agrees_on_the_golden_trace() {
    // The independent model of tests/lib.rs gives the same answer as the lesson, so it
    // can stand in for hand-checked values on long generated streams.
    let want = vec![
        alert(W0, "queso-curado", 8, 4),
        alert(W5, "queso-curado", 9, 2),
        alert(W10, "aceite-arbequina", 7, 1),
    ];
    let model = reference_stock(&golden_trace(), 120_000, u64::MAX);
    assert_eq!(model.alerts(10), want);
    assert_eq!(model.late, 1);
}

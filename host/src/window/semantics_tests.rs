//! Window semantics with a native aggregator, without WebAssembly: which events each
//! window holds and, for ordered logic, in which order. The double [`Times`] keeps the
//! event times it is given in the order it folds them (a merge appends the later slot's);
//! a window's result is that list; it faults on an event at time [`FAULTY`]. It may fold
//! and finish closing windows in one call (`add_and_finish`), as a plugin that exports
//! `fire` does, and merge a sliding window's panes and finish it in one call
//! (`merge_and_finish`), as a plugin that exports `panes` does: [`run`] runs every case
//! with and without it, for the same results. Every
//! expected list is worked out by hand from the window definitions in `window/mod.rs`.

use super::aggregator::Aggregator;
use super::operator::{Verdict, WindowOperator};
use crate::pipeline::{WindowKind, WindowSpec};
use crate::plugin::{Emitted, Events, Groups, Packed, PluginIdentity, PluginInfo};
use crate::{Error, Result};
use std::collections::BTreeMap;

/// An event at this time makes the double's `add` fail (a plugin fault).
const FAULTY: i64 = 13;

/// A pane with an event at this time makes the double's `merge_and_finish` fail (its
/// `add`, `merge` and `finish` take it).
const FAULTY_PANE: i64 = 17;

struct Times {
    info: PluginInfo,
    identity: PluginIdentity,
    /// `add` calls so far (reported as the calls' count, with `fused`).
    adds: u64,
    /// Whether it folds and finishes in one call, and those calls so far.
    fires: bool,
    fused: u64,
    /// Whether it merges a sliding window's panes and finishes it in one call.
    panes: bool,
    /// The name of every call made so far.
    log: CallLog,
}

type CallLog = std::sync::Arc<std::sync::Mutex<Vec<&'static str>>>;

fn times(ordered: bool) -> Box<dyn Aggregator> {
    times_firing(ordered, false).0
}

/// [`Times`], folding and finishing in one call when `fires`; and its log of calls.
fn times_firing(ordered: bool, fires: bool) -> (Box<dyn Aggregator>, CallLog) {
    times_with(ordered, fires, false)
}

/// [`times_firing`], merging a sliding window's panes and finishing it in one call when
/// `panes`.
fn times_with(ordered: bool, fires: bool, panes: bool) -> (Box<dyn Aggregator>, CallLog) {
    let info = PluginInfo {
        name: "times".into(),
        version: "0".into(),
        state_schema: 1,
        fields: Vec::new(),
        ordered_input: ordered,
    };
    let identity = PluginIdentity {
        name: "times".into(),
        version: "0".into(),
        state_schema: 1,
        sha256: String::new(),
        contract: crate::plugin::CONTRACT_VERSION.into(),
        key_fields: 0,
    };
    let log = CallLog::default();
    (Box::new(Times { info, identity, adds: 0, fires, fused: 0, panes, log: log.clone() }), log)
}

fn item(p: &Packed, i: usize) -> &[u8] {
    crate::plugin::packed_item(p, i)
}

fn decode(acc: &[u8]) -> Vec<i64> {
    acc.chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap_or_default())).collect()
}

impl Times {
    /// Log a call; it fails on an event at [`FAULTY`].
    fn called(&self, call: &'static str, events: &Events) -> Result<()> {
        self.log.lock().unwrap().push(call);
        if events.event_time.contains(&FAULTY) {
            return Err(Error::PluginCall { plugin: "times".into(), call, message: "faulty event".into() });
        }
        Ok(())
    }
}

impl Aggregator for Times {
    fn info(&self) -> &PluginInfo {
        &self.info
    }

    fn identity(&self) -> &PluginIdentity {
        &self.identity
    }

    fn add(&mut self, groups: &Groups, events: &Events) -> Result<Packed> {
        self.adds += 1;
        self.called("add", events)?;
        let mut out = crate::plugin::empty_packed();
        let mut start = 0;
        for (g, &end) in events.group_ends.iter().enumerate() {
            let mut acc = item(&groups.accumulators, g).to_vec();
            for t in &events.event_time[start..end as usize] {
                acc.extend_from_slice(&t.to_le_bytes());
            }
            crate::plugin::packed_push(&mut out, &acc);
            start = end as usize;
        }
        Ok(out)
    }

    fn merge(&mut self, left: &Packed, right: &Packed) -> Result<Packed> {
        let mut out = crate::plugin::empty_packed();
        for i in 0..left.ends.len() {
            crate::plugin::packed_push(&mut out, &[item(left, i), item(right, i)].concat());
        }
        Ok(out)
    }

    fn finish(&mut self, groups: &Groups) -> Result<Vec<Emitted>> {
        self.log.lock().unwrap().push("finish");
        Ok((0..groups.window_start.len())
            .map(|g| Emitted {
                group: g as u32,
                value: serde_json::json!({ "times": decode(item(&groups.accumulators, g)) }).to_string(),
            })
            .collect())
    }

    fn fires(&self) -> bool {
        self.fires
    }

    fn add_and_finish(&mut self, groups: &mut Groups, events: &Events) -> Result<Vec<Emitted>> {
        self.fused += 1;
        self.called("add-and-finish", events)?;
        let mut start = 0;
        let mut out = Vec::new();
        for (g, &end) in events.group_ends.iter().enumerate() {
            let mut times = decode(item(&groups.accumulators, g));
            times.extend_from_slice(&events.event_time[start..end as usize]);
            out.push(Emitted { group: g as u32, value: serde_json::json!({ "times": times }).to_string() });
            start = end as usize;
        }
        Ok(out)
    }

    fn merges_panes(&self) -> bool {
        self.panes
    }

    fn merge_and_finish(&mut self, groups: &Groups, panes: &Packed, counts: &[u32]) -> Result<Vec<Emitted>> {
        self.log.lock().unwrap().push("merge-and-finish");
        if decode(&panes.bytes).contains(&FAULTY_PANE) {
            let message = "faulty pane".into();
            return Err(Error::PluginCall { plugin: "times".into(), call: "merge-and-finish", message });
        }
        let mut next = 0;
        let mut out = Vec::new();
        for (g, &n) in counts.iter().enumerate() {
            assert!(item(&groups.accumulators, g).is_empty(), "an empty item per group");
            let times: Vec<i64> = (next..next + n as usize).flat_map(|p| decode(item(panes, p))).collect();
            out.push(Emitted { group: g as u32, value: serde_json::json!({ "times": times }).to_string() });
            next += n as usize;
        }
        Ok(out)
    }

    fn migrate(&mut self, _from: u32, accumulators: &Packed) -> Result<Packed> {
        Ok(accumulators.clone())
    }

    fn reset(&mut self) -> Result<()> {
        Ok(())
    }

    fn calls(&self) -> crate::plugin::CallStats {
        crate::plugin::CallStats { count: self.adds + self.fused, ..Default::default() }
    }
}

/// One key's windows: events `(time, watermark at arrival)`, the watermark advanced to
/// each one's watermark first, then the input ends. Results by key (the last emission
/// of a window wins, as an upsert consumer sees it) and the verdict of every event.
fn run(
    kind: WindowKind,
    lateness: i64,
    ordered: bool,
    events: &[(i64, i64)],
) -> (BTreeMap<String, Vec<i64>>, Vec<Verdict>) {
    let (plugin, log) = times_with(ordered, false, false);
    let pairwise = run_with(kind, lateness, events, plugin);
    assert!(!log.lock().unwrap().contains(&"merge-and-finish"));
    let (plugin, log) = times_with(ordered, false, true);
    let in_one_call = run_with(kind, lateness, events, plugin);
    assert_eq!(in_one_call, pairwise, "merged and finished in one call, or merged pairwise");
    if matches!(kind, WindowKind::Sliding { .. }) && !pairwise.0.is_empty() {
        assert!(log.lock().unwrap().contains(&"merge-and-finish"), "sliding windows merged in one call");
    }
    pairwise
}

fn run_with(
    kind: WindowKind,
    lateness: i64,
    events: &[(i64, i64)],
    plugin: Box<dyn Aggregator>,
) -> (BTreeMap<String, Vec<i64>>, Vec<Verdict>) {
    let spec = WindowSpec { kind, allowed_lateness_ms: lateness };
    let mut op = WindowOperator::new("w", false, &spec, plugin, 1024, 1, Vec::new());
    let mut key = Vec::new();
    crate::state::push_key_field(&mut key, b"k");
    let mut out = Vec::new();
    let mut verdicts = Vec::new();
    for &(t, wm) in events {
        op.advance(wm, &mut out).unwrap();
        verdicts.push(op.on_event(&key, t, wm, &[], &mut out).unwrap());
    }
    op.drain(&mut out).unwrap();
    let results = out
        .into_iter()
        .filter_map(|e| {
            let v: serde_json::Value = serde_json::from_str(e.value.as_deref()?).unwrap();
            Some((e.key, v["times"].as_array().unwrap().iter().map(|t| t.as_i64().unwrap()).collect()))
        })
        .collect();
    (results, verdicts)
}

#[test]
fn after_a_fault_in_merging_and_finishing_in_one_call_the_windows_are_merged_pairwise() {
    // Size 10 every 5, keys a and b, a call per window (batch size 1), all firing at the
    // end of the input. a: 3, 7, 17; b: 4, 12. Panes holding 17 fail the double's
    // merge-and-finish: the windows of that call, and of the rest of the firing, are
    // merged pairwise and finished; none is lost or written twice. Worked out by hand:
    let want = windows(&[
        ("-5|a", &[3]),
        ("0|a", &[3, 7]),
        ("5|a", &[7]),
        ("10|a", &[17]),
        ("15|a", &[17]),
        ("-5|b", &[4]),
        ("0|b", &[4]),
        ("5|b", &[12]),
        ("10|b", &[12]),
    ]);
    for panes in [false, true] {
        let (plugin, log) = times_with(false, false, panes);
        let spec =
            WindowSpec { kind: WindowKind::Sliding { size_ms: 10, slide_ms: 5 }, allowed_lateness_ms: 0 };
        let mut op = WindowOperator::new("w", false, &spec, plugin, 1, 1, Vec::new());
        let mut out = Vec::new();
        for (k, t) in [("a", 3), ("b", 4), ("a", 7), ("b", 12), ("a", 17)] {
            let mut key = Vec::new();
            crate::state::push_key_field(&mut key, k.as_bytes());
            assert_eq!(op.on_event(&key, t, NONE, &[], &mut out).unwrap(), Verdict::Accepted);
        }
        op.drain(&mut out).unwrap();
        let mut got = BTreeMap::new();
        for e in &out {
            let v: serde_json::Value = serde_json::from_str(e.value.as_deref().unwrap()).unwrap();
            let times = v["times"].as_array().unwrap().iter().map(|t| t.as_i64().unwrap()).collect();
            assert!(got.insert(e.key.clone(), times).is_none(), "{} written twice", e.key);
        }
        assert_eq!(got, want, "panes in one call: {panes}");
        let log = log.lock().unwrap();
        let fused = log.iter().filter(|&&c| c == "merge-and-finish").count();
        // One call until the fault (the first window holding 17), then none.
        assert_eq!((fused > 0, log.last()), (panes, Some(&"finish")), "{log:?}");
        if panes {
            let first_fault = out.iter().position(|e| e.key.starts_with("10|a")).unwrap();
            assert_eq!(fused, first_fault + 1, "{log:?}");
        }
    }
}

fn windows(list: &[(&str, &[i64])]) -> BTreeMap<String, Vec<i64>> {
    list.iter().map(|(k, t)| (k.to_string(), t.to_vec())).collect()
}

const NONE: i64 = i64::MIN;

#[test]
fn tumbling_windows_hold_their_events_and_a_late_one_is_refused() {
    // [0,5) gets 1 and 3 and fires at watermark 5; 4 then arrives late; [5,10) gets 6.
    let (got, verdicts) =
        run(WindowKind::Tumbling { size_ms: 5 }, 0, false, &[(1, NONE), (3, NONE), (6, NONE), (4, 5)]);
    assert_eq!(got, windows(&[("0|k", &[1, 3]), ("5|k", &[6])]));
    assert!(matches!(verdicts[3], Verdict::Late { .. }), "{verdicts:?}");
}

#[test]
fn an_ordered_sliding_window_gets_its_panes_events_in_time_order() {
    // Size 10 every 5: panes [0,5) {3}, [5,10) {7}, [10,15) {12}; 7 and 12 arrive first.
    let (got, _) =
        run(WindowKind::Sliding { size_ms: 10, slide_ms: 5 }, 0, true, &[(12, NONE), (7, NONE), (3, NONE)]);
    assert_eq!(got, windows(&[("-5|k", &[3]), ("0|k", &[3, 7]), ("5|k", &[7, 12]), ("10|k", &[12])]));
}

#[test]
fn an_event_that_reaches_a_pane_handed_over_already_is_put_in_its_time_order() {
    // Size 10 every 5. At watermark 6 pane [0,5) {2, 4} is complete: handed over, and
    // [-5,5) fires with it. 1 then arrives: late for [-5,5), but [0,10) is still open, so
    // the pane is rebuilt with 1 first.
    let (got, verdicts) = run(
        WindowKind::Sliding { size_ms: 10, slide_ms: 5 },
        0,
        true,
        &[(2, NONE), (4, NONE), (6, 6), (1, 6)],
    );
    assert_eq!(got, windows(&[("-5|k", &[2, 4]), ("0|k", &[1, 2, 4, 6]), ("5|k", &[6])]));
    assert_eq!(verdicts[3], Verdict::Accepted);
    // Tumbling, lateness 5: [0,5) fires at watermark 7 with {3}; 2 arrives within the
    // lateness and it fires again with {2, 3}.
    let (got, _) = run(WindowKind::Tumbling { size_ms: 5 }, 5, true, &[(3, NONE), (2, 7)]);
    assert_eq!(got, windows(&[("0|k", &[2, 3])]));
}

#[test]
fn a_restored_session_handed_over_before_its_timers_run_is_rebuilt_in_time_order() {
    // Gap 10, no allowed lateness, rows handed over one batch at a time. Restored at
    // watermark 12: session [0,10) with rows 0 and 5 (a savepoint taken with lateness, its
    // timers not run yet). Key j's row hands it over; 3 then joins it ([3,14) overlaps it)
    // before the watermark moves: the session is rebuilt with 0, 3, 5 in order.
    use super::operator::{SavedRow, SavedSlot, Snapshot};
    use crate::time::Window;
    let spec = WindowSpec { kind: WindowKind::Session { gap_ms: 10 }, allowed_lateness_ms: 0 };
    let mut op = WindowOperator::new("w", false, &spec, times(true), 1, 1, Vec::new());
    let key = |k: &[u8]| {
        let mut e = Vec::new();
        crate::state::push_key_field(&mut e, k);
        e
    };
    let row = |time| SavedRow { key: key(b"k"), id: 0, time, values: Vec::new() };
    let snap = Snapshot {
        slots: vec![SavedSlot {
            key: key(b"k"),
            id: 0,
            window: Window { start: 0, end: 10 },
            acc: Vec::new(),
        }],
        rows: vec![row(0), row(5)],
        counters: Default::default(),
    };
    op.restore(&snap, 12, true).unwrap();
    let mut out = Vec::new();
    assert_eq!(op.on_event(&key(b"j"), 20, 12, &[], &mut out).unwrap(), Verdict::Accepted);
    assert_eq!(op.on_event(&key(b"k"), 3, 12, &[], &mut out).unwrap(), Verdict::Accepted);
    op.drain(&mut out).unwrap();
    let got: BTreeMap<String, Vec<i64>> = out
        .into_iter()
        .filter_map(|e| {
            let v: serde_json::Value = serde_json::from_str(e.value.as_deref()?).unwrap();
            Some((e.key, v["times"].as_array().unwrap().iter().map(|t| t.as_i64().unwrap()).collect()))
        })
        .collect();
    assert_eq!(got, windows(&[("0|k", &[0, 3, 5]), ("20|j", &[20])]));
}

#[test]
fn sessions_merge_when_an_event_bridges_them_and_stay_apart_past_the_gap() {
    // Gap 5 (seed 002: only a silence longer than the gap opens a new session). 1 and 3
    // start one session; 20 another; 7 (4 after 3) joins the first; 24 joins 20's; 30
    // (6 after 24) opens a third; 35 (exactly 5 after 30) joins it. Ordered: a merged
    // session's events come in time order.
    let (got, _) = run(
        WindowKind::Session { gap_ms: 5 },
        0,
        true,
        &[(3, NONE), (1, NONE), (20, NONE), (7, NONE), (24, NONE), (30, NONE), (35, NONE)],
    );
    assert_eq!(got, windows(&[("1|k", &[1, 3, 7]), ("20|k", &[20, 24]), ("30|k", &[30, 35])]));
    // 5 bridges 1 and 8 (4 and 3 apart) into one session.
    let (got, _) = run(WindowKind::Session { gap_ms: 5 }, 0, false, &[(1, NONE), (8, NONE), (5, NONE)]);
    assert_eq!(got.len(), 1, "{got:?}");
    let mut all = got["1|k"].clone();
    all.sort();
    assert_eq!(all, [1, 5, 8]);
    // The issue's case, gap 3 min: 0, +180 000 (exactly the gap) and +360 001 (the gap and
    // 1 ms): two sessions, {0, 180 000} and {360 001}.
    let (got, _) = run(
        WindowKind::Session { gap_ms: 180_000 },
        0,
        false,
        &[(0, NONE), (180_000, NONE), (360_001, NONE)],
    );
    assert_eq!(got, windows(&[("0|k", &[0, 180_000]), ("360001|k", &[360_001])]));
    // Exactly the gap after the last event, the session is still open at a watermark of
    // last + gap (5 at 5 joins 0's), and closed (fired) once the watermark is past it: 11
    // at 11 opens another; once the watermark (22) is past 16 + 5, 10 would have joined
    // it but is late.
    let (got, verdicts) =
        run(WindowKind::Session { gap_ms: 5 }, 0, false, &[(0, NONE), (5, 5), (11, 11), (16, 16), (10, 22)]);
    assert_eq!(got, windows(&[("0|k", &[0, 5]), ("11|k", &[11, 16])]));
    assert_eq!(&verdicts[..4], [Verdict::Accepted; 4]);
    assert!(matches!(verdicts[4], Verdict::Late { .. }), "{verdicts:?}");
}

#[test]
fn a_session_that_keeps_growing_costs_no_call_until_it_fires() {
    // Gap 5, an event every 2 ms, the watermark 1 behind: each event moves the session's
    // end past the timer set before it, so timers keep coming due while the session is
    // open. Its rows wait for the batch to fill or the session to fire: one `add` call,
    // at the end of the input, with all 51 events.
    for ordered in [false, true] {
        let spec = WindowSpec { kind: WindowKind::Session { gap_ms: 5 }, allowed_lateness_ms: 0 };
        let mut op = WindowOperator::new("w", false, &spec, times(ordered), 1024, 1, Vec::new());
        let mut key = Vec::new();
        crate::state::push_key_field(&mut key, b"k");
        let mut out = Vec::new();
        for t in (0..=100).step_by(2) {
            op.advance(t - 1, &mut out).unwrap();
            assert_eq!(op.on_event(&key, t, t - 1, &[], &mut out).unwrap(), Verdict::Accepted);
        }
        assert!(out.is_empty(), "{out:?}");
        assert_eq!(op.plugin().calls().count, 0, "ordered: {ordered}");
        op.drain(&mut out).unwrap();
        assert_eq!(op.plugin().calls().count, 1, "ordered: {ordered}");
        assert_eq!(out.len(), 1);
        let v: serde_json::Value = serde_json::from_str(out[0].value.as_deref().unwrap()).unwrap();
        assert_eq!(out[0].key, "0|k");
        assert_eq!(v["times"], serde_json::json!((0..=100).step_by(2).collect::<Vec<i64>>()));
    }
}

#[test]
fn within_the_allowed_lateness_a_window_fires_again_with_the_late_event_and_not_after() {
    // [0,5) fires at watermark 5 with {1}; 2 arrives at watermark 7 (lateness 5: until
    // 10) and the window fires again with {1, 2}; 3 at watermark 10 is late.
    let (got, verdicts) = run(WindowKind::Tumbling { size_ms: 5 }, 5, true, &[(1, NONE), (2, 7), (3, 10)]);
    assert_eq!(got, windows(&[("0|k", &[1, 2])]));
    assert_eq!(verdicts[1], Verdict::Accepted);
    assert!(matches!(verdicts[2], Verdict::Late { .. }), "{verdicts:?}");
}

/// `(key, time)` events into tumbling windows of 5 ms, the watermark at each event's time;
/// the results in the order they were emitted, as `(result key, times)`.
fn keyed_run(events: impl Iterator<Item = (String, i64)>) -> (Vec<(String, Vec<i64>)>, WindowOperator) {
    let spec = WindowSpec { kind: WindowKind::Tumbling { size_ms: 5 }, allowed_lateness_ms: 0 };
    let mut op = WindowOperator::new("w", false, &spec, times(false), 1024, 1, Vec::new());
    let mut out = Vec::new();
    for (k, t) in events {
        let mut key = Vec::new();
        crate::state::push_key_field(&mut key, k.as_bytes());
        op.advance(t, &mut out).unwrap();
        assert_eq!(op.on_event(&key, t, t, &[], &mut out).unwrap(), Verdict::Accepted);
    }
    op.drain(&mut out).unwrap();
    let results = out
        .into_iter()
        .map(|e| {
            let v: serde_json::Value = serde_json::from_str(e.value.as_deref().unwrap()).unwrap();
            (e.key, v["times"].as_array().unwrap().iter().map(|t| t.as_i64().unwrap()).collect())
        })
        .collect();
    (results, op)
}

#[test]
fn windows_that_fire_together_come_out_by_window_then_key_bytes() {
    // Keys first seen in the order b, a, ab; [0,5) and [5,10) fire at the end together.
    let events = [("b", 1), ("a", 2), ("ab", 3), ("b", 6), ("a", 7)].map(|(k, t)| (k.to_string(), t));
    let (got, _) = keyed_run(events.into_iter());
    let keys: Vec<&str> = got.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(keys, ["0|a", "0|ab", "0|b", "5|a", "5|b"]);
    assert_eq!(got[1].1, [3]);
}

#[test]
fn idle_keys_are_forgotten_and_every_window_keeps_its_events() {
    // 20 000 keys, one event each, each in a window of its own that closes at the next
    // event: the key table holds the keys of at most the last two sweeps (4096 keys at
    // first, then twice what survived), not every key seen.
    let n = 20_000i64;
    let (got, op) = keyed_run((0..n).map(|i| (format!("k{i}"), i * 10)));
    assert_eq!(got.len(), n as usize);
    for (i, (key, times)) in got.iter().enumerate() {
        let i = i as i64;
        assert_eq!((key.as_str(), times.as_slice()), (format!("{}|k{i}", i * 10).as_str(), &[i * 10][..]));
    }
    assert!(op.interned_keys() <= 8192, "{} keys interned", op.interned_keys());
    assert_eq!(op.keys(), 0);
}

#[test]
fn a_slot_dropped_for_a_fault_and_opened_again_fires_once_with_its_events() {
    // Batches of one event. 13 faults: [10,15) had nothing else, so it is dropped, but its
    // timer stays; 12 opens it again and sets the same timer. At the end [10,15) fires
    // once, with 12; [0,5) with 1.
    let spec = WindowSpec { kind: WindowKind::Tumbling { size_ms: 5 }, allowed_lateness_ms: 0 };
    let mut op = WindowOperator::new("w", false, &spec, times(false), 1, 1, Vec::new());
    let mut key = Vec::new();
    crate::state::push_key_field(&mut key, b"k");
    let mut out = Vec::new();
    for t in [1, 13, 12] {
        op.on_event(&key, t, NONE, &[], &mut out).unwrap();
    }
    assert_eq!(op.take_rejected().iter().map(|r| r.event_times.clone()).collect::<Vec<_>>(), [vec![13]]);
    op.drain(&mut out).unwrap();
    let got: Vec<(String, String)> = out.into_iter().map(|e| (e.key, e.value.unwrap_or_default())).collect();
    assert_eq!(
        got,
        [
            ("0|k".to_string(), r#"{"times":[1]}"#.to_string()),
            ("10|k".to_string(), r#"{"times":[12]}"#.to_string())
        ]
    );
}

#[test]
fn an_unordered_plugin_gets_the_rows_of_the_windows_that_fire_and_the_others_wait() {
    // Tumbling, size 10. At watermark 10 [0,10) fires with 1 and 3: that call takes its
    // rows only; 12 and 14 wait for [10,20), which then reaches the plugin in one call
    // with 16 too. A checkpoint (`flush_unordered`) hands over every staged row.
    let key = {
        let mut e = Vec::new();
        crate::state::push_key_field(&mut e, b"k");
        e
    };
    let results = |out: Vec<super::operator::Emitted>| -> Vec<(String, String)> {
        out.into_iter().map(|e| (e.key, e.value.unwrap_or_default())).collect()
    };
    for checkpoint in [false, true] {
        let spec = WindowSpec { kind: WindowKind::Tumbling { size_ms: 10 }, allowed_lateness_ms: 0 };
        let mut op = WindowOperator::new("w", false, &spec, times(false), 1024, 1, Vec::new());
        let mut out = Vec::new();
        for t in [1, 12, 3, 14] {
            op.on_event(&key, t, NONE, &[], &mut out).unwrap();
        }
        op.advance(10, &mut out).unwrap();
        assert_eq!(
            results(std::mem::take(&mut out)),
            [("0|k".to_string(), r#"{"times":[1,3]}"#.to_string())]
        );
        assert_eq!((op.staged(), op.plugin().calls().count), (2, 1));
        if checkpoint {
            op.flush_unordered().unwrap();
            assert_eq!((op.staged(), op.plugin().calls().count), (0, 2));
        }
        op.on_event(&key, 16, 10, &[], &mut out).unwrap();
        op.advance(20, &mut out).unwrap();
        assert_eq!(results(out), [("10|k".to_string(), r#"{"times":[12,14,16]}"#.to_string())]);
        assert_eq!((op.staged(), op.plugin().calls().count), (0, if checkpoint { 3 } else { 2 }));
    }
    // Sliding, size 10 every 5: at watermark 10 panes [0,5) and [5,10) are complete and
    // [-5,5) and [0,10) fire; pane [10,15)'s row waits.
    let spec = WindowSpec { kind: WindowKind::Sliding { size_ms: 10, slide_ms: 5 }, allowed_lateness_ms: 0 };
    let mut op = WindowOperator::new("w", false, &spec, times(false), 1024, 1, Vec::new());
    let mut out = Vec::new();
    for t in [2, 11, 7] {
        op.on_event(&key, t, NONE, &[], &mut out).unwrap();
    }
    op.advance(10, &mut out).unwrap();
    assert_eq!(op.staged(), 1);
    op.drain(&mut out).unwrap();
    assert_eq!(
        results(out),
        [
            ("-5|k".to_string(), r#"{"times":[2]}"#.to_string()),
            ("0|k".to_string(), r#"{"times":[2,7]}"#.to_string()),
            ("5|k".to_string(), r#"{"times":[7,11]}"#.to_string()),
            ("10|k".to_string(), r#"{"times":[11]}"#.to_string())
        ]
    );
}

#[test]
fn windows_that_end_as_they_fire_are_folded_and_finished_in_one_call_and_after_a_fault_in_two() {
    // Tumbling, size 10, keys a and b. A checkpoint hands a's 1 over (`add`). At watermark
    // 10, [0,10) fires: a's accumulator [1] with its row 3, and b's row 2, in one call.
    // [10,20) holds a's 12 and b's 13 (faulty): that call fails and changes nothing; the
    // rows go to `add` one group at a time (in one call they would fail again: b's 13 is
    // rejected, b's window has nothing left to fire), and `finish` fires a's; so do the
    // next firings.
    // With allowed lateness the windows stay after they fire: two calls.
    let result = |out: Vec<super::operator::Emitted>| -> Vec<(String, String)> {
        out.into_iter().map(|e| (e.key, e.value.unwrap_or_default())).collect()
    };
    let key = |k: &[u8]| {
        let mut e = Vec::new();
        crate::state::push_key_field(&mut e, k);
        e
    };
    let calls = |log: &CallLog| std::mem::take(&mut *log.lock().unwrap());
    let spec = WindowSpec { kind: WindowKind::Tumbling { size_ms: 10 }, allowed_lateness_ms: 0 };
    let (plugin, log) = times_firing(false, true);
    let mut op = WindowOperator::new("w", false, &spec, plugin, 1024, 1, Vec::new());
    let mut out = Vec::new();
    op.on_event(&key(b"a"), 1, NONE, &[], &mut out).unwrap();
    op.flush_unordered().unwrap();
    for (k, t) in [(b"b", 2), (b"a", 3), (b"a", 12), (b"b", 13)] {
        op.on_event(&key(k), t, NONE, &[], &mut out).unwrap();
    }
    assert_eq!(calls(&log), ["add"]);
    op.advance(10, &mut out).unwrap();
    assert_eq!(
        result(std::mem::take(&mut out)),
        [
            ("0|a".to_string(), r#"{"times":[1,3]}"#.to_string()),
            ("0|b".to_string(), r#"{"times":[2]}"#.to_string())
        ]
    );
    assert_eq!((op.staged(), calls(&log)), (2, vec!["add-and-finish"]));
    op.advance(20, &mut out).unwrap();
    assert_eq!(result(out), [("10|a".to_string(), r#"{"times":[12]}"#.to_string())]);
    let rejected = op.take_rejected();
    assert_eq!(
        rejected.iter().map(|r| (r.key.as_str(), r.event_times.clone())).collect::<Vec<_>>(),
        [("b", vec![13])]
    );
    // The failed call, `add` of a, of b, and `finish`.
    assert_eq!((op.staged(), op.keys()), (0, 0));
    assert_eq!(calls(&log), ["add-and-finish", "add", "add", "finish"]);
    // After a fault, the next firings take the two calls.
    let mut out = Vec::new();
    op.on_event(&key(b"a"), 25, NONE, &[], &mut out).unwrap();
    op.advance(30, &mut out).unwrap();
    assert_eq!(result(out), [("20|a".to_string(), r#"{"times":[25]}"#.to_string())]);
    assert_eq!(calls(&log), ["add", "finish"]);

    let spec = WindowSpec { kind: WindowKind::Tumbling { size_ms: 10 }, allowed_lateness_ms: 5 };
    let (plugin, log) = times_firing(false, true);
    let mut op = WindowOperator::new("w", false, &spec, plugin, 1024, 1, Vec::new());
    let mut out = Vec::new();
    op.on_event(&key(b"a"), 1, NONE, &[], &mut out).unwrap();
    op.advance(10, &mut out).unwrap();
    assert_eq!(result(out), [("0|a".to_string(), r#"{"times":[1]}"#.to_string())]);
    assert_eq!(calls(&log), ["add", "finish"]);

    // Without allowed lateness, but: more windows fire than a call takes (batch size 1,
    // so every row is handed over as it comes); a plugin that has no such call.
    for (batch_size, fires) in [(1, true), (1024, false)] {
        let spec = WindowSpec { kind: WindowKind::Tumbling { size_ms: 10 }, allowed_lateness_ms: 0 };
        let (plugin, log) = times_firing(false, fires);
        let mut op = WindowOperator::new("w", false, &spec, plugin, batch_size, 1, Vec::new());
        let mut out = Vec::new();
        op.on_event(&key(b"a"), 1, NONE, &[], &mut out).unwrap();
        op.on_event(&key(b"b"), 2, NONE, &[], &mut out).unwrap();
        op.advance(10, &mut out).unwrap();
        assert_eq!(
            result(out),
            [
                ("0|a".to_string(), r#"{"times":[1]}"#.to_string()),
                ("0|b".to_string(), r#"{"times":[2]}"#.to_string())
            ]
        );
        let log = calls(&log);
        assert!(log.contains(&"finish") && !log.contains(&"add-and-finish"), "{log:?}");
    }

    // With `on_error = "fail"` a fault in the one call stops the job, as one in `add` does.
    let spec = WindowSpec { kind: WindowKind::Tumbling { size_ms: 10 }, allowed_lateness_ms: 0 };
    let (plugin, log) = times_firing(false, true);
    let mut op = WindowOperator::new("w", false, &spec, plugin, 1024, 1, Vec::new());
    op.set_on_error(crate::plugin::OnError::Fail);
    let mut out = Vec::new();
    op.on_event(&key(b"a"), FAULTY, NONE, &[], &mut out).unwrap();
    let err = op.advance(20, &mut out).unwrap_err().to_string();
    assert!(err.contains("add-and-finish") && err.contains("faulty event"), "{err}");
    assert_eq!(calls(&log), ["add-and-finish"]);
}

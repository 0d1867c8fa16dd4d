//! Shadow deploys: a new plugin version runs beside the current one over the same events,
//! and what it would write is compared with what the current one writes, window by
//! window; nothing of it reaches the sinks.
//!
//! - Started (`km0 deploy NEW.wasm --job URL --shadow`), each aggregation it replaces gets
//!   a second window operator running the new plugin, its state a copy of the current
//!   one's (accumulators converted by the new plugin's `migrate` when the state schema
//!   differs), as a savepoint restored with the new plugin would have it. From then on it
//!   takes every event the current operator takes and fires at the same watermarks.
//! - Each firing compares the two operators' results by result key, on the fields both
//!   results have: equal, different (one wrote a result the other did not, or a shared
//!   field differs), or faulted (the new plugin failed on the window). Differences go to
//!   a side file with both values, and the latest to the status.
//! - Promoted (`--promote`), the shadow operators replace the current ones as they are:
//!   their accumulators are warm, no migration pauses the job. The swap is a live deploy
//!   in every other way (rollback savepoint, checkpoint after it, automatic rollback).
//!   Abandoned (`--abandon`), they are dropped.
//!
//! A shadow is in the job's snapshots as its status (`control.shadow` in `savepoint.json`):
//! a restart starts it again, from a copy of the state restored (not of the shadow's own,
//! which snapshots do not hold) and its counts so far, with the component kept beside the
//! job's checkpoints.

use super::commands::{ShadowDifference, ShadowStatus};
use crate::checkpoint::components::Component;
use crate::window::operator::{Emitted, WindowOperator};
use crate::{Error, Result};
use std::collections::{BTreeMap, VecDeque};
use std::io::Write;
use std::path::Path;
use std::time::Duration;

/// Differences the status keeps.
const RECENT_DIFFERENCES: usize = 5;

/// A new plugin running beside the current one.
pub(super) struct Shadow {
    pub(super) status: ShadowStatus,
    pub(super) component: Component,
    /// (aggregation index, the shadow's operator).
    pub(super) ops: Vec<(usize, WindowOperator)>,
    pub(super) recent: VecDeque<ShadowDifference>,
    file: Option<std::io::BufWriter<std::fs::File>>,
    /// The shadow's results of the call being compared.
    out: Vec<Emitted>,
    /// When the differences file was last flushed.
    flushed: std::time::Instant,
    /// Windows (`start|key`) the shadow failed on an event of, not compared yet, with
    /// their ends.
    tainted: BTreeMap<String, i64>,
    /// The current plugin's call seconds of each of `ops`' aggregations: when the shadow
    /// started, and lately.
    current_calls: Vec<(f64, f64)>,
}

/// How often the differences file is flushed while differences come.
const FLUSH_EVERY: Duration = Duration::from_secs(1);

/// A shadow runs on the job's thread: its calls may take twice the time the current
/// plugin's take over the same events, and this much more; then it stops. Each of its
/// calls may run only as long as what is left (a shadow that hangs holds the job up for
/// this long once, not a call timeout per batch).
pub const SHADOW_ALLOWANCE: Duration = Duration::from_millis(500);
pub const SHADOW_TIME_FACTOR: f64 = 2.0;

impl Shadow {
    /// A shadow of `ops` (with the current plugins' call seconds at its start), writing
    /// its differences to `file`.
    pub(super) fn new(
        status: ShadowStatus,
        component: Component,
        ops: Vec<(usize, WindowOperator)>,
        file: Option<std::io::BufWriter<std::fs::File>>,
        current_calls: Vec<(f64, f64)>,
    ) -> Shadow {
        Shadow {
            status,
            component,
            ops,
            recent: VecDeque::new(),
            file,
            out: Vec::new(),
            flushed: std::time::Instant::now(),
            tainted: BTreeMap::new(),
            current_calls,
        }
    }

    pub(super) fn status(&self) -> ShadowStatus {
        ShadowStatus { recent_differences: self.recent.iter().cloned().collect(), ..self.status.clone() }
    }

    /// The shadow of aggregation `i` takes the event the current operator just took;
    /// `(key, t, wm)`: the event's key, time and the watermark at its arrival; `current`:
    /// what the current operator wrote meanwhile (re-emitted windows), and the seconds its
    /// plugin's calls have taken.
    #[inline]
    pub(super) fn on_event(
        &mut self,
        i: usize,
        event: (&[u8], i64, i64),
        slots: &[Option<crate::source::json::Scalar>],
        names: &[String],
        (current, current_seconds): (&[Emitted], f64),
    ) {
        if self.status.failed.is_none() {
            let done = self
                .within_budget(i, current_seconds)
                .and_then(|()| self.try_on_event(i, event, slots, names, current));
            self.failed(done);
        }
    }

    /// The shadow's calls have taken less than their budget, with the current plugin of
    /// aggregation `i` at `current_seconds` of calls: each of its next calls may take what
    /// is left. An error once they took it all.
    fn within_budget(&mut self, i: usize, current_seconds: f64) -> Result<()> {
        if let Some(k) = self.ops.iter().position(|(j, _)| *j == i) {
            if let Some(c) = self.current_calls.get_mut(k) {
                c.1 = current_seconds;
            }
        }
        let current: f64 = self.current_calls.iter().map(|(from, now)| now - from).sum();
        let spent: f64 = self.ops.iter().map(|(_, op)| op.plugin().call_seconds()).sum();
        self.status.call_seconds = spent;
        self.status.current_call_seconds = current;
        let left = SHADOW_ALLOWANCE.as_secs_f64() + SHADOW_TIME_FACTOR * current - spent;
        if left <= 0.0 {
            return Err(Error::Usage(format!(
                "its calls took {spent:.2} s, the current plugin's {current:.2} s over the same events (a shadow \
                 may take twice the current plugin's time and {} ms more): it stopped so as not to slow the job \
                 down, and cannot be promoted",
                SHADOW_ALLOWANCE.as_millis()
            )));
        }
        for (_, op) in &mut self.ops {
            op.limit_call_time(Duration::from_secs_f64(left));
        }
        Ok(())
    }

    /// The shadow could not go on (`done` is an error): it stops comparing, and says why;
    /// the job is not affected.
    fn failed(&mut self, done: Result<()>) {
        if let Err(e) = done {
            tracing::warn!(deploy = self.status.id, error = %e, "the shadow stopped");
            self.status.failed = Some(e.to_string());
            self.ops.clear();
            self.out.clear();
        }
    }

    fn try_on_event(
        &mut self,
        i: usize,
        (key, t, wm): (&[u8], i64, i64),
        slots: &[Option<crate::source::json::Scalar>],
        names: &[String],
        current: &[Emitted],
    ) -> Result<()> {
        let Some(k) = self.ops.iter().position(|(j, _)| *j == i) else { return Ok(()) };
        let op = &mut self.ops[k].1;
        let fired = op.counters().windows_fired;
        if op.check(slots, names).is_ok() {
            op.on_event(key, t, wm, slots, &mut self.out)?;
        }
        self.compare(k, fired, current, None)
    }

    /// The shadow of aggregation `i` fires what is due at `wm`, or (`wm` none) every
    /// window (the end of the input).
    pub(super) fn advance(
        &mut self,
        i: usize,
        wm: Option<i64>,
        (current, current_seconds): (&[Emitted], f64),
    ) {
        if self.status.failed.is_none() {
            let done = self.within_budget(i, current_seconds).and_then(|()| self.try_advance(i, wm, current));
            self.failed(done);
        }
    }

    fn try_advance(&mut self, i: usize, wm: Option<i64>, current: &[Emitted]) -> Result<()> {
        let Some(k) = self.ops.iter().position(|(j, _)| *j == i) else { return Ok(()) };
        let op = &mut self.ops[k].1;
        let fired = op.counters().windows_fired;
        match wm {
            Some(wm) => op.advance(wm, &mut self.out)?,
            None => op.drain(&mut self.out)?,
        }
        self.compare(k, fired, current, Some(wm.unwrap_or(i64::MAX)))
    }

    /// Compare what the shadow operator `k` wrote (in `out`) with `current`, for the
    /// windows it fired since its count was `fired`; `wm`: the watermark it advanced to
    /// (none: it took an event). Each window is
    /// judged once: faulted (the shadow failed on its result, or on one of its events),
    /// else different or equal; a window neither side wrote a result for is equal.
    fn compare(&mut self, k: usize, fired: u64, current: &[Emitted], wm: Option<i64>) -> Result<()> {
        let op = &mut self.ops[k].1;
        let rejected = op.take_rejected();
        let fired = op.counters().windows_fired - fired;
        let over_at = |end: i64| wm.is_some_and(|wm| end <= wm.saturating_add(1));
        let due = wm.is_some() && self.tainted.values().any(|&end| over_at(end));
        if fired == 0 && self.out.is_empty() && current.is_empty() && rejected.is_empty() && !due {
            return Ok(());
        }
        let aggregation = op.name().to_string();
        let prefix = format!("{aggregation}|");
        // A window by its result key's end (`start|key`), whatever the prefix.
        let window = |key: &str| key.strip_prefix(prefix.as_str()).unwrap_or(key).to_string();
        let mut finish_faulted = std::collections::BTreeSet::new();
        for r in &rejected {
            let id = format!("{}|{}", r.window.start, r.key);
            if r.event_times.is_empty() {
                finish_faulted.insert(id);
            } else {
                self.status.failed_events += r.event_times.len() as u64;
                self.tainted.insert(id, r.window.end);
            }
        }
        let theirs: BTreeMap<String, (&str, Option<&str>)> =
            self.out.iter().map(|e| (window(&e.key), (e.key.as_str(), e.value.as_deref()))).collect();
        let ours: BTreeMap<String, (&str, Option<&str>)> =
            current.iter().map(|e| (window(&e.key), (e.key.as_str(), e.value.as_deref()))).collect();
        let mut windows: std::collections::BTreeSet<&String> = ours.keys().collect();
        windows.extend(theirs.keys());
        windows.extend(finish_faulted.iter());
        // Windows the shadow failed on an event of that are over without a result on
        // either side: faulted all the same.
        let over: Vec<String> = self
            .tainted
            .iter()
            .filter(|(id, &end)| over_at(end) && !windows.contains(id))
            .map(|(id, _)| id.clone())
            .collect();
        // Windows the shadow fired that no result shows (neither side wrote one): those it
        // fired are the ones it wrote or failed a result for, and those only the current
        // plugin wrote a result for that it failed no event of (it had them all).
        let shown = theirs.len()
            + finish_faulted.iter().filter(|id| !theirs.contains_key(*id)).count()
            + ours
                .keys()
                .filter(|id| {
                    !theirs.contains_key(*id)
                        && !finish_faulted.contains(*id)
                        && !self.tainted.contains_key(*id)
                })
                .count();
        let silent = fired.saturating_sub(shown as u64);
        let (mut equal, mut faulted) = (silent, over.len() as u64);
        let mut differences = Vec::new();
        for id in windows {
            if finish_faulted.contains(id) || self.tainted.remove(id).is_some() {
                faulted += 1;
                continue;
            }
            let (a, b) = (ours.get(id), theirs.get(id));
            let key = a.or(b).map_or(id.as_str(), |(key, _)| key);
            let (a, b) = (a.and_then(|(_, v)| *v), b.and_then(|(_, v)| *v));
            match differ(a, b) {
                Some(fields) => differences.push(ShadowDifference {
                    deploy: self.status.id,
                    aggregation: aggregation.clone(),
                    key: key.to_string(),
                    current: a.map(str::to_string),
                    shadow: b.map(str::to_string),
                    fields,
                }),
                None => equal += 1,
            }
        }
        for id in &over {
            self.tainted.remove(id);
        }
        self.out.clear();
        self.record(equal, faulted, differences)
    }

    /// Count a comparison's verdicts, and keep its differences (in the file, and the
    /// latest in memory).
    fn record(&mut self, equal: u64, faulted: u64, differences: Vec<ShadowDifference>) -> Result<()> {
        let different_before = self.status.different;
        let s = &mut self.status;
        s.equal += equal;
        s.faulted += faulted;
        s.different += differences.len() as u64;
        s.windows = s.equal + s.different + s.faulted;
        for d in differences {
            if let Some(f) = self.file.as_mut() {
                let line = serde_json::to_string(&d).map_err(|e| Error::Usage(e.to_string()))?;
                writeln!(f, "{line}").map_err(|e| {
                    Error::io("write", self.status.differences_file.as_deref().unwrap_or(Path::new("")), e)
                })?;
            }
            if self.recent.len() == RECENT_DIFFERENCES {
                self.recent.pop_front();
            }
            self.recent.push_back(d);
        }
        if self.status.different > different_before && self.flushed.elapsed() >= FLUSH_EVERY {
            self.flush();
        }
        Ok(())
    }

    /// Write the differences out (at checkpoints and status).
    pub(super) fn flush(&mut self) {
        self.flushed = std::time::Instant::now();
        if let Some(f) = self.file.as_mut() {
            if let Err(e) = f.flush() {
                tracing::warn!(error = %e, "the shadow's differences file");
            }
        }
    }
}

/// Whether two results differ, on the fields both have: the fields that differ, or none
/// (an empty list when one side has no result).
fn differ(a: Option<&str>, b: Option<&str>) -> Option<Vec<String>> {
    let (a, b) = match (a, b) {
        (None, None) => return None,
        (Some(a), Some(b)) if a == b => return None,
        (Some(a), Some(b)) => (a, b),
        _ => return Some(Vec::new()),
    };
    let parse = |s: &str| serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(s).ok();
    let (Some(a), Some(b)) = (parse(a), parse(b)) else { return Some(Vec::new()) };
    let fields: Vec<String> =
        a.iter().filter(|(k, v)| b.get(*k).is_some_and(|w| w != *v)).map(|(k, _)| k.clone()).collect();
    (!fields.is_empty()).then_some(fields)
}

#[cfg(test)]
mod tests {
    use super::differ;

    #[test]
    fn results_differ_on_the_fields_both_have_or_when_one_is_missing() {
        assert_eq!(differ(None, None), None);
        assert_eq!(differ(Some(r#"{"a":1}"#), Some(r#"{"a":1}"#)), None);
        // A field only one has does not count.
        assert_eq!(differ(Some(r#"{"a":1}"#), Some(r#"{"a":1,"b":2}"#)), None);
        assert_eq!(differ(Some(r#"{"a":1,"c":3}"#), Some(r#"{"c":4,"a":1}"#)), Some(vec!["c".to_string()]));
        assert_eq!(differ(Some(r#"{"a":1}"#), None), Some(vec![]));
        assert_eq!(differ(None, Some(r#"{"a":1}"#)), Some(vec![]));
    }
}

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

use super::commands::Refused;
use super::route::{fields_of, operator, Job};
use super::swap::Deployment;
use super::upgrade::{self, Refusal};
use super::*;
use crate::source::decode::Decoder;
use crate::window::aggregator::Aggregator;
use crate::window::operator::{Emitted, Snapshot, WindowOperator};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, VecDeque};
use std::io::Write;

/// Differences the status keeps.
const RECENT_DIFFERENCES: usize = 5;

/// What a shadow has found so far (the status's `shadow`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ShadowStatus {
    /// The deploy it came with (its number in the deploy history).
    pub id: u64,
    pub aggregations: Vec<String>,
    pub from: Vec<PluginIdentity>,
    pub to: PluginIdentity,
    /// Records read when it started, and when (epoch ms).
    pub since_record: u64,
    pub at_ms: i64,
    /// Windows compared (every window the shadow fired, and every window the current
    /// plugin wrote a result for), and of them: equal, different, faulted (the shadow
    /// failed on the window's result or on one of its events); they add up.
    pub windows: u64,
    pub equal: u64,
    pub different: u64,
    pub faulted: u64,
    /// Events the shadow failed on (dead-lettered by it, for a fault or a quarantine).
    pub failed_events: u64,
    /// Where every difference is written (one JSON line each).
    pub differences_file: Option<PathBuf>,
    /// The latest differences.
    pub recent_differences: Vec<ShadowDifference>,
    /// Why the shadow stopped comparing (it cannot be promoted then).
    pub failed: Option<String>,
    /// Seconds the shadow's calls took, and the current plugin's over the same events
    /// (since this run started it).
    #[serde(default)]
    pub call_seconds: f64,
    #[serde(default)]
    pub current_call_seconds: f64,
}

/// One window whose results differ.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ShadowDifference {
    pub deploy: u64,
    pub aggregation: String,
    /// The result key (`[aggregation|]window start|key fields`).
    pub key: String,
    /// What the current plugin wrote, and what the shadow would have (none: no result).
    pub current: Option<String>,
    pub shadow: Option<String>,
    /// The shared fields that differ (empty: one side wrote no result).
    pub fields: Vec<String>,
}

/// A new plugin running beside the current one.
pub(super) struct Shadow {
    status: ShadowStatus,
    component: Component,
    /// (aggregation index, the shadow's operator).
    ops: Vec<(usize, WindowOperator)>,
    recent: VecDeque<ShadowDifference>,
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

impl Job {
    /// Start running a deployment's plugins as a shadow of the aggregations they replace.
    pub(super) fn start_shadow(
        &mut self,
        pipeline: &Pipeline,
        d: Deployment,
        id: u64,
        at_record: u64,
        file: Option<PathBuf>,
    ) -> std::result::Result<ShadowStatus, Refused> {
        if let Some(s) = &self.shadow {
            return Err(Refused::Closed(format!(
                "deploy {} runs as a shadow already: promote or abandon it first",
                s.status.id
            )));
        }
        for (i, p) in &d.plugins {
            let op = &self.ops[*i];
            upgrade::same_logic(op.name(), op.identity(), p.identity())?;
            upgrade::key_fields(pipeline, op.name(), p)?;
        }
        // One decoder for both: the current plugins' columns, then the shadow's.
        let mut all: Vec<&dyn Aggregator> = self.ops.iter().map(|o| o.plugin()).collect();
        all.extend(d.plugins.iter().map(|(_, p)| p as &dyn Aggregator));
        let (decoder, mut columns) =
            Decoder::new(pipeline, &fields_of(&all)).map_err(|e| Refusal::Fields(Box::new(e)))?;
        let shadow_columns = columns.split_off(self.ops.len());
        let wm = self.watermarks.current();
        let mut ops = Vec::new();
        let mut from = Vec::new();
        let mut aggregations = Vec::new();
        let mut current_calls = Vec::new();
        let fail = |e: Error| Refused::Failed(e.to_string());
        for ((i, plugin), cols) in d.plugins.into_iter().zip(shadow_columns) {
            let (old, new) = (self.ops[i].identity().clone(), plugin.identity().clone());
            let captured = self.ops[i].capture().map_err(fail)?;
            let mut snap = Snapshot {
                slots: captured
                    .slots
                    .iter()
                    .map(|(key, id, window, acc)| crate::state::saved::SavedSlot {
                        key: key.to_vec(),
                        id,
                        window,
                        acc: acc.to_vec(),
                    })
                    .collect(),
                rows: captured.rows,
                counters: captured.counters,
            };
            current_calls.push((self.ops[i].plugin().call_seconds(), self.ops[i].plugin().call_seconds()));
            let mut op = operator(pipeline, i, plugin, cols);
            // A fault of the new plugin never stops the job (whatever `on_error` says).
            op.set_on_error(crate::plugin::OnError::DeadLetter);
            op.keep_quarantined_events();
            if old.state_schema != new.state_schema {
                op.migrate(old.state_schema, &mut snap)
                    .map_err(|e| Refused::from(upgrade::migration_failed(&old, &new, e)))?;
            }
            op.restore(&snap, wm, true).map_err(fail)?;
            aggregations.push(op.name().to_string());
            from.push(old);
            ops.push((i, op));
        }
        let Some(to) = ops.first().map(|(_, op)| op.identity().clone()) else {
            return Err(Refused::Closed("the deploy replaces no aggregation".into()));
        };
        let file = match file {
            Some(path) => {
                let opened = path
                    .parent()
                    .map_or(Ok(()), std::fs::create_dir_all)
                    .and_then(|()| std::fs::OpenOptions::new().create(true).append(true).open(&path));
                match opened {
                    Ok(f) => Some((path, std::io::BufWriter::new(f))),
                    Err(e) => {
                        return Err(Refused::Failed(format!(
                            "the shadow's differences file {}: {e}",
                            path.display()
                        )))
                    }
                }
            }
            None => None,
        };
        for (op, cols) in self.ops.iter_mut().zip(columns) {
            op.set_columns(cols);
        }
        self.decoder = decoder;
        let (differences_file, file) = match file {
            Some((p, f)) => (Some(p), Some(f)),
            None => (None, None),
        };
        let status = ShadowStatus {
            id,
            aggregations,
            from,
            to,
            since_record: at_record,
            at_ms: metrics::now_ms(),
            differences_file,
            ..ShadowStatus::default()
        };
        tracing::info!(deploy = id, to = %format!("{} {}", status.to.name, status.to.version), at_record, "shadow started");
        self.shadow = Some(Box::new(Shadow {
            status: status.clone(),
            component: d.component,
            ops,
            recent: VecDeque::new(),
            file,
            out: Vec::new(),
            flushed: std::time::Instant::now(),
            tainted: BTreeMap::new(),
            current_calls,
        }));
        Ok(status)
    }

    /// A shadow restarted (see the module's text) takes the counts its status had.
    pub(super) fn resumed_shadow(&mut self, saved: &ShadowStatus) {
        if let Some(shadow) = self.shadow.as_mut() {
            let s = &mut shadow.status;
            (s.since_record, s.at_ms) = (saved.since_record, saved.at_ms);
            (s.windows, s.equal, s.different, s.faulted) =
                (saved.windows, saved.equal, saved.different, saved.faulted);
            s.failed_events = saved.failed_events;
            shadow.recent = saved.recent_differences.iter().cloned().collect();
        }
    }

    /// Drop the shadow (abandoned): the decoder reads what the current plugins need again.
    pub(super) fn abandon_shadow(
        &mut self,
        pipeline: &Pipeline,
    ) -> std::result::Result<ShadowStatus, Refused> {
        let shadow = self.take_shadow()?;
        self.rebuild_decoder(pipeline)?;
        tracing::info!(deploy = shadow.status.id, "shadow abandoned");
        Ok(shadow.status())
    }

    /// Swap the shadow's operators in for the current ones (promoted): the caller took
    /// the rollback savepoint.
    pub(super) fn promote_shadow(
        &mut self,
        pipeline: &Pipeline,
    ) -> std::result::Result<ShadowStatus, Refused> {
        if let Some(why) = self.shadow.as_ref().and_then(|s| s.status.failed.clone()) {
            return Err(Refused::Closed(format!("the shadow stopped ({why}): abandon it")));
        }
        // The decoder of the plugins after the swap first: a refusal changes nothing.
        let plugins: Vec<&dyn Aggregator> = (0..self.ops.len())
            .map(|i| match self.shadow.as_ref().and_then(|s| s.ops.iter().find(|(j, _)| *j == i)) {
                Some((_, op)) => op.plugin(),
                None => self.ops[i].plugin(),
            })
            .collect();
        let (decoder, columns) =
            Decoder::new(pipeline, &fields_of(&plugins)).map_err(|e| Refused::Failed(e.to_string()))?;
        let mut shadow = self.take_shadow()?;
        for (i, mut op) in std::mem::take(&mut shadow.ops) {
            op.take_place_of(&mut self.ops[i], pipeline.aggregations[i].plugin.on_error);
            self.ops[i] = op;
            self.components[i] = Some(shadow.component.clone());
        }
        for (op, cols) in self.ops.iter_mut().zip(columns) {
            op.set_columns(cols);
        }
        self.decoder = decoder;
        let plugins: Vec<&dyn Aggregator> = self.ops.iter().map(|o| o.plugin()).collect();
        self.fingerprint = super::route::results_fingerprint(pipeline, &plugins);
        tracing::info!(deploy = shadow.status.id, "shadow promoted");
        Ok(shadow.status())
    }

    /// The shadow, ended here (its differences written out).
    fn take_shadow(&mut self) -> std::result::Result<Box<Shadow>, Refused> {
        let mut shadow = self.shadow.take().ok_or_else(|| Refused::NotFound("no shadow runs".into()))?;
        shadow.flush();
        Ok(shadow)
    }

    /// The decoder and columns of the current plugins alone.
    fn rebuild_decoder(&mut self, pipeline: &Pipeline) -> std::result::Result<(), Refused> {
        let plugins: Vec<&dyn Aggregator> = self.ops.iter().map(|o| o.plugin()).collect();
        let (decoder, columns) =
            Decoder::new(pipeline, &fields_of(&plugins)).map_err(|e| Refused::Failed(e.to_string()))?;
        for (op, cols) in self.ops.iter_mut().zip(columns) {
            op.set_columns(cols);
        }
        self.decoder = decoder;
        Ok(())
    }
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

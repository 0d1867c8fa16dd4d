//! The engine of a running job and what happens to one record: decoded, filtered,
//! dead-lettered, late or accepted by each aggregation; the watermark moved and what it
//! fires written; side outputs. (Its snapshots and restores are in job/snapshot.rs.)

use super::build::{fields_of, idleness, operator, results_fingerprint};
use super::lag::{report_lag, LagReport};
use super::upgrade;
use crate::checkpoint::components::Component;
use crate::pipeline::Pipeline;
use crate::plugin::Plugin;
use crate::sink::line::{
    dead_letter_line, late_line, plugin_dead_letter_line, result_dead_letter_line, LATE,
};
use crate::sink::{DeadLetterSink, JsonlSink, ResultSink};
use crate::source::decode::{Decoder, Reject, MAX_FIELDS};
use crate::source::json::Scalar;
use crate::source::{line_break_at, Position, Source, Took};
use crate::state::saved::Counters;
use crate::time::{Watermarks, Window};
use crate::window::aggregator::Aggregator;
use crate::window::operator::{Emitted, Verdict, WindowOperator};
use crate::{metrics, Result};
use std::time::{Duration, Instant};

/// Fields most jobs read (time, filter, key, plugin fields): a record's slots are this
/// many, or [`MAX_FIELDS`] for a job that reads more.
const FEW_FIELDS: usize = 8;

/// A record's `n` field slots, empty, in the caller's `few` or `all` (declared, not yet
/// set): [`FEW_FIELDS`] of them for most jobs (each is a store a record), all only for
/// a job that reads more fields. A macro: the slots are the caller's locals.
macro_rules! field_slots {
    ($n:expr, $few:ident, $all:ident) => {{
        let n = $n;
        if n <= FEW_FIELDS {
            $few = [None; FEW_FIELDS];
            &mut $few[..n]
        } else {
            $all = [None; MAX_FIELDS];
            &mut $all[..n]
        }
    }};
}

/// With `partition_field`, the partitions (field values) a job keeps at most; a record with
/// another value is dead-lettered.
pub const MAX_FIELD_PARTITIONS: usize = 1024;

/// The longest `partition_field` value, in bytes.
pub const MAX_PARTITION_NAME: usize = 256;

/// The part of a running job that one record touches: its decoder, each aggregation's
/// window operator, the watermarks and the sinks.
pub(super) struct Engine {
    pub(super) decoder: Decoder,
    pub(super) ops: Vec<WindowOperator>,
    pub(super) watermarks: Watermarks,
    /// Partitions by field value instead of by file.
    pub(super) by_field: bool,
    /// Watermark clock of each source partition, when not the same index (Kafka).
    pub(super) clock_of: Vec<usize>,
    /// Results handed to the sink so far (restored with the state): a result's ordinal
    /// identifies it across a replay.
    pub(super) results_out: u64,
    pub(super) read: u64,
    pub(super) filtered: u64,
    pub(super) dead_lettered: u64,
    pub(super) key_buf: Vec<u8>,
    /// The key of the record after the one at hand ([`Engine::on_records_framed`]).
    pub(super) next_key: Vec<u8>,
    pub(super) line_buf: Vec<u8>,
    pub(super) results: Vec<Emitted>,
    /// Input names by partition, for side outputs.
    pub(super) sources: Vec<String>,
    pub(super) output: Option<ResultSink>,
    pub(super) late: Option<JsonlSink>,
    pub(super) dead: Option<DeadLetterSink>,
    /// Id of the last snapshot taken or restored ("" before the first): the parent of
    /// the next barrier.
    pub(super) snapshot_id: String,
    /// [`results_fingerprint`] of this run.
    pub(super) fingerprint: String,
    /// Per aggregation, the deployed component it runs instead of its pipeline file's
    /// (kept with checkpoints and savepoints).
    pub(super) components: Vec<Option<Component>>,
    /// A new plugin version running beside the current one ([`super::shadow`]).
    pub(super) shadow: Option<Box<super::shadow::Shadow>>,
    /// The control port's memory (deploy history, probation), kept in every snapshot
    /// ([`super::ledger::Ledger`]).
    pub(super) ledger: Option<serde_json::Value>,
    /// The latest late events and dead letters, for the status (repeats counted).
    pub(super) recent: std::collections::VecDeque<super::commands::SideRecord>,
    /// Times the source was paused for a sink that was behind, and for how long.
    pub(super) backpressure: (u64, Duration),
    /// A task's check that its records' key fields are their message key (Kafka, with
    /// `source.partitioned_by`): a record whose key was sent to another partition would
    /// split its key's windows between tasks.
    pub(super) confined: Option<Confined>,
}

/// The leading key fields a task's records must carry as their message key.
pub(super) struct Confined {
    pub(super) names: Vec<String>,
    pub(super) key: crate::source::kafka::MessageKey,
}

impl Confined {
    /// Why the record keyed `key_buf` is not in its partition, if it is not.
    fn disagrees(&self, key_buf: &[u8]) -> Option<String> {
        let mut fields: [&[u8]; 8] = [&[]; 8];
        let n = self.names.len().min(fields.len());
        for (slot, f) in fields.iter_mut().zip(crate::state::raw_fields_of(key_buf)).take(n) {
            *slot = f;
        }
        self.key.disagrees(&fields[..n], &self.names)
    }
}

impl Engine {
    pub(super) fn new(pipeline: &Pipeline, plugins: Vec<Plugin>) -> Result<Engine> {
        // A plugin that reads more key fields than the pipeline's key has is refused now,
        // not on every window.
        for (a, p) in pipeline.aggregations.iter().zip(&plugins) {
            upgrade::key_fields(pipeline, &a.name, p)?;
        }
        let refs: Vec<&dyn Aggregator> = plugins.iter().map(|p| p as &dyn Aggregator).collect();
        let fingerprint = results_fingerprint(pipeline, &refs);
        let (decoder, columns) = Decoder::new(pipeline, &fields_of(&refs))?;
        let ops = plugins
            .into_iter()
            .zip(columns)
            .enumerate()
            .map(|(i, (p, cols))| operator(pipeline, i, p, cols))
            .collect();
        let by_field = pipeline.source.partitioning().field.is_some();
        let idleness = idleness(pipeline);
        Ok(Engine {
            decoder,
            ops,
            watermarks: Watermarks::new(pipeline.event_time.watermark_delay_ms, idleness),
            by_field,
            clock_of: Vec::new(),
            results_out: 0,
            read: 0,
            filtered: 0,
            dead_lettered: 0,
            key_buf: Vec::with_capacity(64),
            next_key: Vec::with_capacity(64),
            line_buf: Vec::with_capacity(256),
            results: Vec::new(),
            sources: Vec::new(),
            output: None,
            late: None,
            dead: None,
            snapshot_id: String::new(),
            fingerprint,
            components: vec![None; pipeline.aggregations.len()],
            shadow: None,
            ledger: None,
            recent: Default::default(),
            backpressure: (0, Duration::ZERO),
            confined: None,
        })
    }

    pub(super) fn counters(&self) -> Counters {
        let mut c = Counters {
            read: self.read,
            filtered: self.filtered,
            dead_lettered: self.dead_lettered,
            ..Counters::default()
        };
        for op in &self.ops {
            c.add_events(op.counters());
        }
        c
    }

    /// Process the records at the start of `ahead` (the input from there on), one after
    /// another while their layout was seen before and each ends before a line break (see
    /// [`crate::source::json::Projection::scan_framed`]), up to `most`; `took` counts
    /// them and the bytes they cover with their line breaks, the first at `pos`. The first
    /// record it cannot take is left (found by its line break, it goes through
    /// [`Engine::on_record`]).
    ///
    /// Each record is scanned one ahead of its processing: the key of the next one is
    /// built and its place in each aggregation's key index asked for
    /// ([`WindowOperator::prefetch_key`]) while this one is processed, so that its
    /// lookup, a cache miss nearly every record with many keys, finds it there.
    #[inline]
    pub(super) fn on_records_framed(
        &mut self,
        ahead: &[u8],
        pos: Position,
        most: u64,
        took: &mut Took,
    ) -> Result<()> {
        let n = self.decoder.projection.len();
        let (mut few, mut all, mut next_few, mut next_all);
        let mut slots = field_slots!(n, few, all);
        let mut next = field_slots!(n, next_few, next_all);
        let Some(mut len) = self.decoder.projection.scan_framed(ahead, slots) else { return Ok(()) };
        let mut keyed = self.decoder.key(slots, &mut self.key_buf).is_ok();
        let mut at = 0usize;
        loop {
            let end = at + len;
            // The scan takes a record only before a line break: without one it would not
            // be the line the newline search finds (left to it).
            let Some(line_break) = line_break_at(ahead, end) else {
                debug_assert!(false, "a record taken framed ends before a line break");
                return Ok(());
            };
            let after = end + line_break;
            // From this record's start, as the reader did record by record: the lines
            // behind it are let go, never its own.
            crate::source::prefetch_after(ahead, at);
            let next_len = if took.records + 1 < most {
                self.decoder.projection.peek_framed(&ahead[after..], next)
            } else {
                None
            };
            let next_keyed = next_len.is_some() && self.decoder.key(next, &mut self.next_key).is_ok();
            if next_keyed {
                for op in &self.ops {
                    op.prefetch_key(&self.next_key);
                }
            }
            self.read += 1;
            let record_pos = Position {
                partition: pos.partition,
                line: pos.line + took.records,
                offset: pos.offset + at as u64,
            };
            let done = self.on_scanned(&ahead[at..end], record_pos, slots, keyed);
            took.records += 1;
            took.bytes = after;
            done?;
            let Some(next_len) = next_len else { return Ok(()) };
            std::mem::swap(&mut slots, &mut next);
            std::mem::swap(&mut self.key_buf, &mut self.next_key);
            (len, at, keyed) = (next_len, after, next_keyed);
        }
    }

    /// Whether the next record is to be offered to [`Engine::on_records_framed`] (see
    /// [`crate::source::json::Projection::frames`]).
    #[inline]
    pub(super) fn frames(&mut self) -> bool {
        self.decoder.projection.frames()
    }

    /// Process one record.
    #[inline]
    pub(super) fn on_record(&mut self, record: &[u8], pos: Position) -> Result<()> {
        self.read += 1;
        let (mut few, mut all);
        let slots = field_slots!(self.decoder.projection.len(), few, all);
        if let Err(e) = self.decoder.projection.scan(record, slots) {
            self.dead_letter(&format!("not a valid JSON object: {e}"), record, pos)?;
            if !self.by_field {
                // Any record is activity: it can wake its partition or mark another idle,
                // and what that fires must fire now (a snapshot must not see a watermark
                // that windows below it have not reached).
                let before = self.watermarks.current();
                let wm = self.watermarks.on_record(self.clock(pos.partition));
                if wm > before {
                    self.advance(wm)?;
                    self.write_results()?;
                }
            }
            return Ok(());
        }
        self.on_scanned(record, pos, slots, false)
    }

    /// A record scanned into `slots` (its fields, in projection order); `keyed`: its key
    /// is built in `key_buf` already.
    #[inline(always)]
    fn on_scanned(
        &mut self,
        record: &[u8],
        pos: Position,
        slots: &[Option<Scalar>],
        keyed: bool,
    ) -> Result<()> {
        let partition = if self.by_field {
            match self.field_partition(slots, record, pos)? {
                Some(p) => p,
                None => return Ok(()),
            }
        } else {
            self.clock(pos.partition)
        };
        let before = self.watermarks.current();
        let wm = self.watermarks.on_record(partition);
        if wm > before {
            self.advance(wm)?;
        }
        let checked = self.decoder.event_time(slots).and_then(|t| {
            if keyed {
                Ok(t)
            } else {
                self.decoder.key(slots, &mut self.key_buf).map(|_| t)
            }
        });
        let t = match checked {
            Ok(t) => t,
            Err(Reject::Filtered) => {
                self.filtered += 1;
                return Ok(());
            }
            Err(Reject::Dead(reason)) => return self.dead_letter(&reason, record, pos),
        };
        if let Some(why) = self.confined.as_ref().and_then(|c| c.disagrees(&self.key_buf)) {
            return self.dead_letter(&why, record, pos);
        }
        // Each aggregation checks the fields its plugin reads: a record one of them cannot
        // take is dead-lettered for that one (naming it), and the others take it.
        let mut refused: Vec<(usize, String)> = Vec::new();
        for (i, op) in self.ops.iter().enumerate() {
            if let Err(reason) = op.check(slots, &self.decoder.names) {
                refused.push((i, reason));
            }
        }
        if !refused.is_empty() {
            self.dead_letter_refused(&refused, record, pos)?;
            if refused.len() == self.ops.len() {
                return Ok(());
            }
        }
        for i in 0..self.ops.len() {
            if !refused.is_empty() && refused.iter().any(|(j, _)| *j == i) {
                continue;
            }
            let verdict = match self.shadow.as_mut() {
                None => self.ops[i].on_event(&self.key_buf, t, wm, slots, &mut self.results)?,
                Some(shadow) => {
                    let mark = self.results.len();
                    let verdict = self.ops[i].on_event(&self.key_buf, t, wm, slots, &mut self.results)?;
                    let names = &self.decoder.names;
                    let current = (&self.results[mark..], self.ops[i].plugin().call_seconds());
                    shadow.on_event(i, (&self.key_buf, t, wm), slots, names, current);
                    verdict
                }
            };
            match verdict {
                Verdict::Accepted => {}
                Verdict::Late { window } => self.late_event(i, t, wm, window, record, pos)?,
                // Every operator sees the same key: the first one to meet it decides.
                Verdict::InvalidKey => {
                    return self.dead_letter("a key field is not valid UTF-8", record, pos)
                }
                Verdict::Quarantined => self.quarantined(i, record, pos)?,
            }
        }
        // A late event cannot move the watermark: its time is below it.
        let after = self.watermarks.observe(partition, t);
        if after > wm {
            self.advance(after)?;
        }
        if !self.results.is_empty() || self.ops.iter().any(|op| op.has_rejected()) {
            self.write_results()?;
        }
        Ok(())
    }

    /// The clock of a record partitioned by a field's value (a new value gets one); none
    /// when the record went to the dead letters (the value is too long, or one too many).
    #[inline]
    fn field_partition(
        &mut self,
        slots: &[Option<Scalar>],
        record: &[u8],
        pos: Position,
    ) -> Result<Option<usize>> {
        let name = self.decoder.partition_name(slots);
        if let Some(p) = self.watermarks.find(&name) {
            return Ok(Some(p));
        }
        // Each value is a clock, a status entry and a metrics series: bounded.
        if name.len() > MAX_PARTITION_NAME {
            let why =
                format!("its partition field's value has {} bytes; at most {MAX_PARTITION_NAME}", name.len());
            return self.dead_letter(&why, record, pos).map(|()| None);
        }
        if self.watermarks.partitions().len() >= MAX_FIELD_PARTITIONS {
            let why = format!(
                "its partition field's value would be partition {}; a job keeps at most {MAX_FIELD_PARTITIONS}",
                MAX_FIELD_PARTITIONS + 1
            );
            return self.dead_letter(&why, record, pos).map(|()| None);
        }
        Ok(Some(self.watermarks.partition(&name)))
    }

    /// Dead-letter a record for each aggregation that `refused` it (naming it; a job of
    /// one aggregation writes the reason alone).
    #[cold]
    fn dead_letter_refused(
        &mut self,
        refused: &[(usize, String)],
        record: &[u8],
        pos: Position,
    ) -> Result<()> {
        if refused.len() == self.ops.len() && self.ops.len() == 1 {
            return self.dead_letter(&refused[0].1, record, pos);
        }
        for (i, reason) in refused {
            let name = self.ops[*i].name().to_string();
            let reason = format!("aggregation {name:?}: {reason}");
            self.dead_letter_for(Some(name), &reason, record, pos)?;
        }
        Ok(())
    }

    /// Between barriers (and with no checkpoints at all): a delivery that failed for
    /// everything fails the job now; records refused for themselves go to the dead
    /// letters.
    pub(super) fn check_deliveries(&mut self) -> Result<()> {
        let Some(out) = self.output.as_mut() else { return Ok(()) };
        out.check_deliveries()?;
        let refused = out.take_refused();
        self.dead_letter_results(refused)
    }

    /// Processing time passed with nothing to read: processing-time idleness may move the
    /// watermark.
    pub(super) fn tick(&mut self) -> Result<()> {
        let before = self.watermarks.current();
        let wm = self.watermarks.tick();
        if wm > before {
            self.advance(wm)?;
            self.write_results()?;
        }
        Ok(())
    }

    /// A partition's input ended: it stops holding the watermark back.
    pub(super) fn partition_ended(&mut self, p: u32) -> Result<()> {
        if self.by_field {
            return Ok(());
        }
        let before = self.watermarks.current();
        let wm = self.watermarks.finish(self.clock(p));
        if wm > before {
            self.advance(wm)?;
            self.write_results()?;
        }
        Ok(())
    }

    /// The watermark clock of source partition `p`.
    #[inline]
    pub(super) fn clock(&self, p: u32) -> usize {
        self.clock_of.get(p as usize).copied().unwrap_or(p as usize)
    }

    pub(super) fn advance(&mut self, wm: i64) -> Result<()> {
        if let Some(shadow) = self.shadow.as_mut() {
            for (i, op) in self.ops.iter_mut().enumerate() {
                let mark = self.results.len();
                op.advance(wm, &mut self.results)?;
                shadow.advance(i, Some(wm), (&self.results[mark..], op.plugin().call_seconds()));
            }
            return Ok(());
        }
        for op in &mut self.ops {
            op.advance(wm, &mut self.results)?;
        }
        Ok(())
    }

    /// Dead-letter what the plugins could not take.
    pub(super) fn write_rejected(&mut self) -> Result<()> {
        for i in 0..self.ops.len() {
            for r in self.ops[i].take_rejected() {
                self.dead_lettered += r.event_times.len().max(1) as u64;
                note(&mut self.recent, "dead_letter", &r.reason, Some(self.ops[i].name()));
                let aggregation = self.ops[i].name();
                plugin_dead_letter_line(
                    &mut self.line_buf,
                    &r.reason,
                    aggregation,
                    &r.key,
                    r.window,
                    &r.event_times,
                );
                // Keyed by what was rejected (aggregation, key, window, first event time or
                // the window's result): distinct rejections never compact onto each other,
                // a replay's copy compacts onto the first.
                let what = r.event_times.first().map_or_else(|| "result".to_string(), |t| t.to_string());
                let origin = [
                    ("km0.aggregation", aggregation.to_string()),
                    ("km0.key", r.key.clone()),
                    ("km0.window_start", r.window.start.to_string()),
                    ("km0.event_time", what),
                ];
                if let Some(dead) = self.dead.as_mut() {
                    dead.write(&self.line_buf, &self.line_buf, &origin, &r.reason)?;
                }
            }
        }
        Ok(())
    }

    pub(super) fn write_results(&mut self) -> Result<()> {
        self.write_rejected()?;
        let mut refused = Vec::new();
        if let Some(s) = self.output.as_mut() {
            for e in self.results.drain(..) {
                // Numbered all the same: ordinals stay those of an uninterrupted run.
                self.results_out += 1;
                match s.refuses(&e.key, e.value.as_deref()) {
                    Some(reason) => refused.push((e.key, e.value.unwrap_or_default(), reason)),
                    None => s.write(&e.key, e.value.as_deref(), self.results_out, &mut self.line_buf)?,
                }
            }
        }
        self.results.clear();
        self.dead_letter_results(refused)
    }

    /// Results the sink cannot take go to the dead-letter output with the reason.
    pub(super) fn dead_letter_results(&mut self, refused: Vec<(String, String, String)>) -> Result<()> {
        for (key, value, reason) in refused {
            self.dead_lettered += 1;
            note(&mut self.recent, "dead_letter", &reason, None);
            result_dead_letter_line(&mut self.line_buf, &reason, &key, &value);
            let origin = [("km0.result", key.clone())];
            if let Some(dead) = self.dead.as_mut() {
                dead.write(&self.line_buf, value.as_bytes(), &origin, &reason)?;
            }
        }
        Ok(())
    }

    /// Backpressure: the result sink is far behind; stop fetching and wait until it has
    /// caught up (memory stays bounded whatever the backlog in the source).
    pub(super) fn drain_output(&mut self, source: &mut Source, lag_at: &mut LagReport) -> Result<()> {
        source.pause()?;
        tracing::info!("backpressure: the sink is behind, source paused");
        let t = Instant::now();
        while self.output.as_ref().is_some_and(|o| !o.caught_up()) {
            std::thread::sleep(Duration::from_millis(2));
            report_lag(source, lag_at);
        }
        tracing::info!(
            waited_ms = t.elapsed().as_millis() as u64,
            "backpressure: sink caught up, source resumed"
        );
        self.backpressure.0 += 1;
        self.backpressure.1 += t.elapsed();
        source.resume()
    }

    /// The latest late events, dead letters and plugin output, oldest first.
    pub(super) fn recent_side_outputs(&self) -> Vec<super::commands::SideRecord> {
        let mut recent: Vec<super::commands::SideRecord> = self.recent.iter().cloned().collect();
        for op in &self.ops {
            recent.extend(op.plugin().printed().into_iter().map(|p| super::commands::SideRecord {
                at_ms: p.at_ms,
                output: "plugin_output",
                reason: p.text,
                aggregation: Some(op.name().to_string()),
                count: 1,
            }));
        }
        recent.sort_by_key(|r| r.at_ms);
        let keep = recent.len().saturating_sub(super::commands::RECENT_SIDE_RECORDS);
        recent.drain(..keep);
        recent
    }

    /// Release quarantined keys of `aggregation` (None: every aggregation's): the key with
    /// fields `key`, or all; how many were released.
    pub(super) fn release(
        &mut self,
        aggregation: Option<&str>,
        key: Option<&[String]>,
    ) -> std::result::Result<usize, super::commands::Refused> {
        if let Some(name) = aggregation {
            if !self.ops.iter().any(|o| o.name() == name) {
                let names: Vec<&str> = self.ops.iter().map(|o| o.name()).collect();
                return Err(super::commands::Refused::NotFound(format!(
                    "no aggregation {name:?}: the job has {names:?}"
                )));
            }
        }
        let mut released = 0;
        for op in self.ops.iter_mut().filter(|o| aggregation.is_none_or(|a| o.name() == a)) {
            released += op.release(key);
        }
        tracing::info!(released, aggregation = ?aggregation, key = ?key, "quarantined keys released");
        Ok(released)
    }

    /// An event of a key aggregation `i` quarantined: to the dead letters, with the reason.
    #[inline(never)]
    fn quarantined(&mut self, i: usize, record: &[u8], pos: Position) -> Result<()> {
        let reason = self.ops[i].quarantine_reason(&self.key_buf);
        if self.ops.len() == 1 {
            return self.dead_letter(&reason, record, pos);
        }
        let name = self.ops[i].name().to_string();
        self.dead_letter_for(Some(name), &reason, record, pos)
    }

    pub(super) fn dead_letter(&mut self, reason: &str, record: &[u8], pos: Position) -> Result<()> {
        self.dead_letter_for(None, reason, record, pos)
    }

    /// A dead letter for one aggregation (keyed with its name in Kafka, so the dead letters
    /// of one record for several aggregations do not compact onto each other).
    pub(super) fn dead_letter_for(
        &mut self,
        aggregation: Option<String>,
        reason: &str,
        record: &[u8],
        pos: Position,
    ) -> Result<()> {
        self.dead_lettered += 1;
        note(&mut self.recent, "dead_letter", reason, aggregation.as_deref());
        let source = self.sources.get(pos.partition as usize).map_or("", String::as_str);
        let Some(dead) = self.dead.as_mut() else { return Ok(()) };
        if dead.wants_json() {
            dead_letter_line(&mut self.line_buf, reason, source, pos, record);
        }
        let mut origin = vec![("km0.source", source.to_string()), ("km0.offset", pos.offset.to_string())];
        if let Some(a) = aggregation {
            origin.push(("km0.aggregation", a));
        }
        dead.write(&self.line_buf, record, &origin, reason)
    }

    pub(super) fn late_event(
        &mut self,
        op: usize,
        t: i64,
        wm: i64,
        window: Window,
        record: &[u8],
        pos: Position,
    ) -> Result<()> {
        note(&mut self.recent, "late", LATE, Some(self.ops[op].name()));
        let source = self.sources.get(pos.partition as usize).map_or("", String::as_str);
        late_line(&mut self.line_buf, self.ops[op].name(), (t, wm), window, source, pos, record);
        if let Some(late) = self.late.as_mut() {
            late.write_line(&self.line_buf)?;
        }
        self.ops[op].count_late();
        Ok(())
    }
}

/// Keep a late event's or dead letter's reason among the latest (a repeat of the last one
/// is counted, without allocating).
fn note(
    recent: &mut std::collections::VecDeque<super::commands::SideRecord>,
    output: &'static str,
    reason: &str,
    aggregation: Option<&str>,
) {
    let now = metrics::now_ms();
    if let Some(last) = recent.back_mut() {
        if last.output == output && last.reason == reason && last.aggregation.as_deref() == aggregation {
            last.count += 1;
            last.at_ms = now;
            return;
        }
    }
    if recent.len() == super::commands::RECENT_SIDE_RECORDS {
        recent.pop_front();
    }
    recent.push_back(super::commands::SideRecord {
        at_ms: now,
        output,
        reason: reason.to_string(),
        aggregation: aggregation.map(str::to_string),
        count: 1,
    });
}

//! The job's state and what happens to one record: decoded, filtered, dead-lettered,
//! late or accepted by each aggregation; the watermark moved and what it fires written;
//! side outputs; the state captured for checkpoints and savepoints, and restored.

use super::lag::{report_lag, LagReport};
use super::upgrade::{self, Refusal};
use super::Upgrade;
use crate::checkpoint::components::Component;
use crate::checkpoint::savepoint::{PipelineIdentity, StateFile};
use crate::checkpoint::{savepoint, OperatorMeta, Savepoint, SavepointMeta};
use crate::pipeline::Pipeline;
use crate::plugin::Plugin;
use crate::sink::postgres::Barrier;
use crate::sink::{DeadLetterSink, JsonlSink, ResultSink};
use crate::source::decode::{Decoder, Reject, MAX_FIELDS};
use crate::source::json::Scalar;
use crate::source::{line_break_at, Position, Source, Took};
use crate::state::rocks::Changes;
use crate::state::saved::Counters;
use crate::time::{Idleness, Watermarks, Window};
use crate::window::aggregator::Aggregator;
use crate::window::operator::{Capture, Emitted, Verdict, WindowOperator};
use crate::{metrics, Error, Result};
use sha2::{Digest, Sha256};
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

/// The job's loop state.
/// With `partition_field`, the partitions (field values) a job keeps at most; a record with
/// another value is dead-lettered.
pub const MAX_FIELD_PARTITIONS: usize = 1024;

/// The longest `partition_field` value, in bytes.
pub const MAX_PARTITION_NAME: usize = 256;

pub(super) struct Job {
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
    /// The key of the record after the one at hand ([`Job::on_records_framed`]).
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

/// One side-output line (a dead letter, a late event): a JSON object written field by
/// field, names in the order given, byte for byte what serde_json writes for a struct of
/// those fields. Late events are a hot path: with 1% of the records late, serde_json's
/// escaping of the raw record took 2% of the job.
#[must_use = "a line ends with `.end()`"]
pub(super) struct SideLine<'a> {
    buf: &'a mut Vec<u8>,
}

impl<'a> SideLine<'a> {
    pub(super) fn new(buf: &'a mut Vec<u8>) -> SideLine<'a> {
        buf.clear();
        buf.push(b'{');
        SideLine { buf }
    }

    /// `"name":` (names are plain: nothing in them needs an escape).
    fn name(&mut self, name: &'static str) {
        debug_assert!(!name.bytes().any(|c| c < 0x20 || c == b'"' || c == b'\\'));
        if self.buf.len() > 1 {
            self.buf.push(b',');
        }
        self.buf.push(b'"');
        self.buf.extend_from_slice(name.as_bytes());
        self.buf.extend_from_slice(b"\":");
    }

    pub(super) fn str(mut self, name: &'static str, v: &str) -> Self {
        self.name(name);
        crate::source::json::push_json_str(self.buf, v);
        self
    }

    /// Raw input, as text: invalid UTF-8 replaced (U+FFFD), as `String::from_utf8_lossy`.
    pub(super) fn text(self, name: &'static str, v: &[u8]) -> Self {
        match std::str::from_utf8(v) {
            Ok(s) => self.str(name, s),
            Err(_) => self.str(name, &String::from_utf8_lossy(v)),
        }
    }

    pub(super) fn int(mut self, name: &'static str, v: impl itoa::Integer) -> Self {
        self.name(name);
        self.buf.extend_from_slice(itoa::Buffer::new().format(v).as_bytes());
        self
    }

    pub(super) fn ints(mut self, name: &'static str, v: &[i64]) -> Self {
        self.name(name);
        self.buf.push(b'[');
        let mut digits = itoa::Buffer::new();
        for (i, &x) in v.iter().enumerate() {
            if i > 0 {
                self.buf.push(b',');
            }
            self.buf.extend_from_slice(digits.format(x).as_bytes());
        }
        self.buf.push(b']');
        self
    }

    /// Where a record was read, and the record: `source`, `line`, `offset`, `record`.
    fn read_at(self, source: &str, pos: Position, record: &[u8]) -> Self {
        self.str("source", source).int("line", pos.line).int("offset", pos.offset).text("record", record)
    }

    pub(super) fn end(self) {
        self.buf.push(b'}');
    }
}

/// Why a late event goes to the late output.
const LATE: &str = "late: past its windows' allowed lateness";

/// A late event's line: the event, the watermark it came behind (`(t, wm)`), the last
/// window it missed and where it was read.
fn late_line(
    buf: &mut Vec<u8>,
    aggregation: &str,
    (t, wm): (i64, i64),
    window: Window,
    source: &str,
    pos: Position,
    record: &[u8],
) {
    SideLine::new(buf)
        .str("reason", LATE)
        .str("aggregation", aggregation)
        .int("event_time", t)
        .int("watermark", wm)
        .int("window_start", window.start)
        .int("window_end", window.end)
        .read_at(source, pos, record)
        .end();
}

/// A record that is not an event (or that one aggregation cannot take): why, and where.
fn dead_letter_line(buf: &mut Vec<u8>, reason: &str, source: &str, pos: Position, record: &[u8]) {
    SideLine::new(buf).str("reason", reason).read_at(source, pos, record).end();
}

/// Events (or a window's result, `event_times` empty) that a faulty plugin could not take.
fn plugin_dead_letter_line(
    buf: &mut Vec<u8>,
    reason: &str,
    aggregation: &str,
    key: &str,
    window: Window,
    event_times: &[i64],
) {
    SideLine::new(buf)
        .str("reason", reason)
        .str("aggregation", aggregation)
        .str("key", key)
        .int("window_start", window.start)
        .int("window_end", window.end)
        .ints("event_times", event_times)
        .end();
}

/// A result the sink could not take (its JSON value as text).
fn result_dead_letter_line(buf: &mut Vec<u8>, reason: &str, key: &str, value: &str) {
    SideLine::new(buf).str("reason", reason).str("key", key).str("value", value).end();
}

impl Job {
    pub(super) fn new(pipeline: &Pipeline, plugins: Vec<Plugin>) -> Result<Job> {
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
        Ok(Job {
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
    /// [`Job::on_record`]).
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

    /// Whether the next record is to be offered to [`Job::on_records_framed`] (see
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
            let name = self.decoder.partition_name(slots);
            match self.watermarks.find(&name) {
                Some(p) => p,
                None => {
                    // Each value is a clock, a status entry and a metrics series: bounded.
                    if name.len() > MAX_PARTITION_NAME {
                        let why = format!(
                            "its partition field's value has {} bytes; at most {MAX_PARTITION_NAME}",
                            name.len()
                        );
                        return self.dead_letter(&why, record, pos);
                    }
                    if self.watermarks.partitions().len() >= MAX_FIELD_PARTITIONS {
                        let why = format!(
                            "its partition field's value would be partition {}; a job keeps at most {MAX_FIELD_PARTITIONS}",
                            MAX_FIELD_PARTITIONS + 1
                        );
                        return self.dead_letter(&why, record, pos);
                    }
                    self.watermarks.partition(&name)
                }
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
            if refused.len() == self.ops.len() && self.ops.len() == 1 {
                return self.dead_letter(&refused[0].1, record, pos);
            }
            for (i, reason) in &refused {
                let name = self.ops[*i].name().to_string();
                let reason = format!("aggregation {name:?}: {reason}");
                self.dead_letter_for(Some(name), &reason, record, pos)?;
            }
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

    /// Load a savepoint's state into this (fresh) job. Returns the migrations done.
    pub(super) fn restore(
        &mut self,
        pipeline: &Pipeline,
        sp: &Savepoint,
        upgrade: &Upgrade,
    ) -> Result<Vec<(String, u32, u32)>> {
        let refuse = |r: Refusal| match upgrade {
            Upgrade::Deploy(_) => Error::deploy(r),
            Upgrade::Resume => Error::Unfit { path: sp.path.clone(), refusal: Box::new(r) },
        };
        let meta = &sp.meta;
        if meta.pipeline.fingerprint != pipeline.state_fingerprint() {
            return Err(refuse(Refusal::OtherPipeline {
                saved: meta.pipeline.name.clone(),
                pipeline: pipeline.name.clone(),
            }));
        }
        let mut migrated = Vec::new();
        let mut snapshots = Vec::new();
        for op in &mut self.ops {
            let Some(i) = meta.operators.iter().position(|o| o.id == op.name()) else {
                return Err(refuse(Refusal::NoState(op.name().to_string())));
            };
            // Copied only to be migrated.
            let (saved, mut snap) = (&meta.operators[i], std::borrow::Cow::Borrowed(&sp.snapshots[i]));
            let (old, new) = (&saved.plugin, op.identity().clone());
            upgrade::same_logic(op.name(), old, &new).map_err(refuse)?;
            upgrade::key_arity(pipeline, &snap.slots).map_err(refuse)?;
            // Keys are interned as they are: each is what an event's key is (UTF-8 fields,
            // which results and their keys are built from), checked where the state was
            // decoded (`savepoint::read`: `decode_state` or `rocks::load`).
            debug_assert!(snap
                .slots
                .iter()
                .map(|s| &s.key)
                .chain(snap.rows.iter().map(|r| &r.key))
                .all(|k| crate::state::valid_key(k)));
            let fields = &op.plugin().info().fields;
            let unfit = snap.rows.iter().find(|r| !upgrade::row_fits(&r.values, fields));
            upgrade::rows_fit(op.name(), op.plugin(), unfit.map(|bad| (snap.rows.len(), bad)))
                .map_err(refuse)?;
            if op.has_sessions() && !meta.session_ends_closed {
                // Written when a session was `[first, last + gap)`: it is `[first, last + gap]`.
                for slot in &mut snap.to_mut().slots {
                    slot.window.end = slot.window.end.saturating_add(1);
                }
            }
            let deploying = matches!(upgrade, Upgrade::Deploy(name) if *name == new.name);
            if deploying && old.state_schema != new.state_schema {
                op.migrate(old.state_schema, snap.to_mut())
                    .map_err(|e| Error::deploy(upgrade::migration_failed(old, &new, e)))?;
                migrated.push((op.name().to_string(), old.state_schema, new.state_schema));
            } else if old.state_schema != new.state_schema {
                // (Not deploying: the same logic must read the same layout.)
                return Err(refuse(Refusal::SchemaChanged {
                    from: old.state_schema,
                    to: new.state_schema,
                    plugin: format!("{} {}", new.name, new.version),
                    savepoint: sp.path.display().to_string(),
                }));
            } else if old.sha256 != new.sha256 {
                tracing::warn!(from = %old.version, to = %new.version, "resuming with another build of the plugin (same state schema)");
            }
            snapshots.push(snap);
        }
        // Everything checked: now load.
        self.watermarks =
            Watermarks::restore(pipeline.event_time.watermark_delay_ms, idleness(pipeline), &meta.watermark);
        let wm = self.watermarks.current();
        for (op, snap) in self.ops.iter_mut().zip(&snapshots) {
            op.restore(snap, wm, meta.rows_cover_slots)?;
            // Faults are of the plugin that had them: a deploy starts afresh.
            let saved = meta.operators.iter().find(|o| o.id == op.name());
            if let Some(saved) = saved.filter(|o| o.plugin.sha256 == op.identity().sha256) {
                op.restore_faults(&saved.quarantine);
                if !saved.faults.is_empty() {
                    op.restore_faults(&crate::window::operator::SavedFaults::from_listed(&saved.faults));
                }
                // A deploy on probation goes on being judged (the control port resumes it
                // with its fault rate).
                op.restore_probation(saved.probation);
            }
        }
        self.snapshot_id = meta.snapshot_id.clone();
        self.read = meta.counters.read;
        self.filtered = meta.counters.filtered;
        self.dead_lettered = meta.counters.dead_lettered;
        self.results_out = meta.counters.emitted + meta.counters.retracted;
        Ok(migrated)
    }

    /// A consistent snapshot of the job at this point of the input: every operator's
    /// state, the source position, the watermarks, the counters, and the sinks flushed
    /// and synced to the length they have now.
    pub(super) fn snapshot(
        &mut self,
        pipeline: &Pipeline,
        source: &Source,
    ) -> Result<(SavepointMeta, Vec<Capture>)> {
        let mut snapshots = Vec::new();
        for op in &mut self.ops {
            snapshots.push(op.capture()?);
        }
        let counts = snapshots.iter().map(|s| (s.slots.len(), s.rows.len() as u64)).collect();
        let meta = self.meta(pipeline, source, counts)?;
        Ok((meta, snapshots))
    }

    /// The changes since the last checkpoint, for the incremental (RocksDB) backend, and
    /// the snapshot's metadata.
    pub(super) fn changes(
        &mut self,
        pipeline: &Pipeline,
        source: &Source,
    ) -> Result<(SavepointMeta, Vec<Changes>)> {
        let mut changes = Vec::new();
        let mut counts = Vec::new();
        for op in &mut self.ops {
            op.flush_unordered()?;
            let c = op.take_changes();
            counts.push((op.open_slots() as u64, c.rows.len() as u64));
            changes.push(c);
        }
        let meta = self.meta(pipeline, source, counts)?;
        Ok((meta, changes))
    }

    /// A new barrier in the job's lineage: a fresh snapshot id, after the previous one.
    pub(super) fn barrier(&mut self) -> Barrier {
        let id = new_snapshot_id();
        let parent = std::mem::replace(&mut self.snapshot_id, id.clone());
        Barrier { id, parent, fingerprint: self.fingerprint.clone() }
    }

    /// Metadata of a snapshot taken now; the sinks are flushed to the operating system
    /// (the snapshot's writer syncs them before it completes).
    pub(super) fn meta(
        &mut self,
        pipeline: &Pipeline,
        source: &Source,
        counts: Vec<(u64, u64)>,
    ) -> Result<SavepointMeta> {
        // A position past records that may have read a cut file's zeros is not kept.
        source.check_intact()?;
        self.write_results()?;
        let barrier = self.barrier();
        let mut sinks = Vec::new();
        if let Some(out) = self.output.as_mut() {
            sinks.extend(out.position(self.results_out, &barrier)?);
        }
        let refused = self.output.as_mut().map(ResultSink::take_refused).unwrap_or_default();
        self.dead_letter_results(refused)?;
        if let Some(late) = self.late.as_mut() {
            sinks.extend(late.position()?);
        }
        if let Some(dead) = self.dead.as_mut() {
            sinks.extend(dead.position()?);
        }
        let operators = self
            .ops
            .iter_mut()
            .zip(counts)
            .map(|(op, (slots, rows))| OperatorMeta {
                id: op.name().to_string(),
                plugin: op.identity().clone(),
                slots,
                rows,
                counters: op.counters().clone(),
                quarantine: op.saved_faults(),
                faults: Vec::new(),
                probation: op.probation(),
            })
            .collect();
        Ok(SavepointMeta {
            format: savepoint::FORMAT.into(),
            format_version: savepoint::FORMAT_VERSION,
            km0_version: env!("CARGO_PKG_VERSION").into(),
            created_at_ms: metrics::now_ms(),
            pipeline: PipelineIdentity {
                name: pipeline.name.clone(),
                fingerprint: pipeline.state_fingerprint(),
            },
            operators,
            source: source.position(),
            watermark: self.watermarks.save(),
            counters: self.counters(),
            sinks,
            state: StateFile { file: String::new(), windows: 0, bytes: 0, sha256: String::new() },
            snapshot_id: barrier.id,
            rows_cover_slots: true,
            session_ends_closed: true,
            control: self.control(),
        })
    }

    /// The control port's memory for a snapshot, with the shadow running now.
    fn control(&self) -> Option<serde_json::Value> {
        let mut control = self.ledger.clone();
        if let Some(shadow) = &self.shadow {
            let control = control.get_or_insert_with(|| serde_json::Value::Object(Default::default()));
            if let (serde_json::Value::Object(map), Ok(status)) =
                (control, serde_json::to_value(shadow.status()))
            {
                map.insert("shadow".into(), status);
            }
        }
        control
    }
}

/// Each aggregation's plugin name and fields, for the [`Decoder`].
pub(super) fn fields_of<'a>(plugins: &[&'a dyn Aggregator]) -> Vec<(&'a str, &'a [crate::plugin::Field])> {
    plugins.iter().map(|p| (p.identity().name.as_str(), p.info().fields.as_slice())).collect()
}

/// The window operator of aggregation `i`, running `plugin` over the decoder's `columns`.
pub(super) fn operator(pipeline: &Pipeline, i: usize, plugin: Plugin, columns: Vec<usize>) -> WindowOperator {
    let a = &pipeline.aggregations[i];
    let prefixed = pipeline.aggregations.len() > 1;
    let mut op = WindowOperator::new(
        &a.name,
        prefixed,
        &a.window,
        Box::new(plugin),
        a.plugin.batch_size,
        pipeline.key.len(),
        columns,
    );
    op.set_on_error(a.plugin.on_error);
    op.set_quarantine_after(a.plugin.quarantine_after);
    op.set_quarantine_max_keys(a.plugin.quarantine_max_keys);
    op
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

/// A random-enough id for a snapshot: time, process and a counter, hashed.
pub(super) fn new_snapshot_id() -> String {
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
    let seed = format!("{nanos}/{}/{n}", std::process::id());
    crate::pipeline::hex(&Sha256::digest(seed.as_bytes())[..8])
}

/// What determines a job's results: its source and filter, event time (delay, accepted
/// range), idleness, every aggregation's window (with its lateness), plugin code,
/// configuration, limits and fault policy. A replay with the same fingerprint over the same
/// records gives the same results. (Written with `Debug`: a km0 of another version may
/// compute another one, which only makes it refuse a replay it could have skipped.)
pub(super) fn results_fingerprint(pipeline: &Pipeline, plugins: &[&dyn Aggregator]) -> String {
    let mut text = format!(
        "{}|{:?}|{:?}|{:?}|{:?}",
        pipeline.state_fingerprint(),
        pipeline.source,
        pipeline.filter,
        pipeline.event_time,
        pipeline.key
    );
    for (a, p) in pipeline.aggregations.iter().zip(plugins) {
        text.push_str(&format!(
            "|{}:{:?}:{}:{:?}:{:?}:{:?}",
            a.name,
            a.window,
            p.identity().sha256,
            a.plugin.config,
            a.plugin.limits,
            a.plugin.on_error
        ));
    }
    crate::pipeline::hex(&Sha256::digest(text.as_bytes()))
}

/// The pipeline's idleness rules for partition watermarks.
pub(super) fn idleness(pipeline: &Pipeline) -> Idleness {
    let p = pipeline.source.partitioning();
    Idleness {
        timeout: p.idle_timeout_ms.map(|ms| Duration::from_millis(ms as u64)),
        after_records: p.idle_after_records,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Serialize;
    use std::borrow::Cow;

    // The oracles: the structs serde_json wrote the lines from before (dd07632), verbatim.
    #[derive(Serialize)]
    pub(super) struct DeadLetter<'a> {
        reason: &'a str,
        source: &'a str,
        line: u64,
        offset: u64,
        record: Cow<'a, str>,
    }

    /// A result the sink could not take.
    #[derive(Serialize)]
    pub(super) struct ResultDeadLetter<'a> {
        reason: &'a str,
        key: &'a str,
        /// The result's JSON value, as text.
        value: &'a str,
    }

    /// Events (or a window's result) that a faulty plugin could not take.
    #[derive(Serialize)]
    pub(super) struct PluginDeadLetter<'a> {
        reason: &'a str,
        aggregation: &'a str,
        key: &'a str,
        window_start: i64,
        window_end: i64,
        /// Empty when the window's result was rejected.
        event_times: &'a [i64],
    }

    #[derive(Serialize)]
    pub(super) struct LateEvent<'a> {
        reason: &'a str,
        aggregation: &'a str,
        event_time: i64,
        watermark: i64,
        window_start: i64,
        window_end: i64,
        source: &'a str,
        line: u64,
        offset: u64,
        record: Cow<'a, str>,
    }

    /// `line` (what a line function wrote into a buffer that held something) is what
    /// serde_json writes for `oracle`.
    fn same(write: impl FnOnce(&mut Vec<u8>), oracle: &impl Serialize) {
        let mut buf = b"left over".to_vec();
        write(&mut buf);
        assert_eq!(String::from_utf8(buf).unwrap(), serde_json::to_string(oracle).unwrap());
    }

    #[test]
    fn side_lines_are_what_serde_json_wrote_for_their_records() {
        let records: [&[u8]; 5] = [
            b"{\"tipo\": \"stock.actualizado\", \"producto\": \"pan\", \"fecha_ms\": 1757836800024}",
            b"",
            b"tab\there \\ \"quoted\" \x01\x1f\x7f a\xc3\xb1o \xe2\x82\xac",
            // Not UTF-8: replaced as `String::from_utf8_lossy` replaces it.
            b"bad \xff\xfe utf-8 \xc3",
            b"\"",
        ];
        let texts = ["trap \"here\"\n", "", "a|b\\c", "año €"];
        let (source, aggregation) = ("/tmp/día\\1.jsonl", "min \"stock\"");
        for record in records {
            for (t, wm, line) in
                [(1757836800024i64, 1757836900000i64, 1u64), (i64::MIN, i64::MAX, u64::MAX), (-1, 0, 0)]
            {
                let window = Window { start: t.saturating_sub(300_000), end: t };
                let pos = Position { partition: 0, line, offset: line / 2 };
                let late = LateEvent {
                    reason: LATE,
                    aggregation,
                    event_time: t,
                    watermark: wm,
                    window_start: window.start,
                    window_end: window.end,
                    source,
                    line,
                    offset: line / 2,
                    record: String::from_utf8_lossy(record),
                };
                same(|b| late_line(b, aggregation, (t, wm), window, source, pos, record), &late);
                for reason in texts {
                    let dead = DeadLetter {
                        reason,
                        source,
                        line,
                        offset: line / 2,
                        record: String::from_utf8_lossy(record),
                    };
                    same(|b| dead_letter_line(b, reason, source, pos, record), &dead);
                }
            }
        }
        for (reason, key) in texts.iter().zip(texts.iter().rev()) {
            for times in [&[][..], &[7], &[i64::MIN, 0, i64::MAX]] {
                let window = Window { start: -5, end: i64::MAX };
                let plugin = PluginDeadLetter {
                    reason,
                    aggregation,
                    key,
                    window_start: window.start,
                    window_end: window.end,
                    event_times: times,
                };
                same(|b| plugin_dead_letter_line(b, reason, aggregation, key, window, times), &plugin);
            }
            let value = r#"{"a":"\u00e9\"","b":[1,2]}"#;
            same(
                |b| result_dead_letter_line(b, reason, key, value),
                &ResultDeadLetter { reason, key, value },
            );
        }
    }
}

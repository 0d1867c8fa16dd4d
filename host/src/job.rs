//! A running job: the single-threaded operator loop that takes records from the source,
//! decodes and routes them (filtered, dead letter, late, accepted), stages accepted
//! events into plugin batches, advances the watermark, fires windows through the plugin,
//! and writes results; plus starting from and stopping with savepoints.
//!
//! Batching never changes results: a batch is flushed into the plugin before any window
//! fires, and lateness is decided per event against the watermark at its arrival, so
//! the output equals event-at-a-time processing.

use crate::checkpoint::savepoint::{self, PipelineIdentity, StateFile, WatermarkState};
use crate::checkpoint::{Savepoint, SavepointMeta};
use crate::pipeline::{Pipeline, SinkSpec, SourceSpec};
use crate::plugin::batch::{empty_groups, fill_groups, packed_of, Batch};
use crate::plugin::{packed_item, FieldType, Groups, Plugin, PluginRuntime};
use crate::sink::{JsonlSink, SinkPosition};
use crate::source::file::FileSource;
use crate::source::json::{short_eq, Projection, Scalar};
use crate::source::Position;
use crate::state::{push_key_field, valid_key, Closed, KeyTable, WindowState};
use crate::time::Watermark;
use crate::window::{Assigner, Window};
use crate::{metrics, Error, Result};
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Most distinct fields a job may project (time, filter, key and plugin fields).
pub const MAX_FIELDS: usize = 32;
/// Stable id of the window operator's state in savepoints.
pub const OPERATOR_ID: &str = "window-aggregate";

/// What happened to the records, cumulative across savepoint resumes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    /// Records read from the source.
    pub read: u64,
    /// Records that did not match the pipeline's filter.
    pub filtered: u64,
    /// Records sent to the dead-letter output.
    pub dead_lettered: u64,
    /// Events whose window had already fired.
    pub late: u64,
    /// Events added to a window.
    pub accepted: u64,
    /// Windows that fired (with or without output).
    pub windows_fired: u64,
    /// Result records written.
    pub emitted: u64,
}

/// Command-line overrides of a run.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Replace the file source's path.
    pub input: Option<PathBuf>,
    /// Replace the sink with this file.
    pub output: Option<PathBuf>,
    /// Process this many records, write a savepoint and stop.
    pub stop_with_savepoint_after: Option<u64>,
    /// Where new savepoints go (default: the pipeline's `savepoints.dir`).
    pub savepoint_dir: Option<PathBuf>,
    /// Resume from this savepoint.
    pub from_savepoint: Option<PathBuf>,
}

/// How a run ended.
#[derive(Debug, Clone)]
pub struct Summary {
    pub counters: Counters,
    /// Windows still open (0 after end of input; in the savepoint otherwise).
    pub open_windows: usize,
    pub watermark: i64,
    /// The savepoint written, when the run stopped with one.
    pub savepoint: Option<PathBuf>,
    /// State schema migration done at start (from, to).
    pub migrated: Option<(u32, u32)>,
    pub plugin: crate::plugin::PluginIdentity,
    /// Records read by this run (not counting those before a resume).
    pub records_this_run: u64,
    /// Wall time of the processing loop.
    pub elapsed: Duration,
    /// CPU time of the processing thread during the loop.
    pub cpu: Duration,
}

/// How the job's plugin relates to the state it starts from.
enum Upgrade {
    /// Same logic: state schema must match.
    Resume,
    /// `km0 deploy`: a new version, state migrated through its `migrate`.
    Deploy,
}

/// Run a pipeline (fresh, or resumed from `opts.from_savepoint`).
pub fn run(pipeline: &Pipeline, opts: &RunOptions, runtime: &PluginRuntime) -> Result<Summary> {
    let plugin = runtime.load(&pipeline.plugin.path, &pipeline.plugin.config)?;
    let restore = opts.from_savepoint.as_deref().map(savepoint::read).transpose()?;
    start(pipeline, opts, plugin, restore, Upgrade::Resume)
}

/// Resume from a savepoint with a new plugin version, migrating its state. Refused (the
/// savepoint untouched, nothing written) when the plugin cannot take the state.
pub fn deploy(
    pipeline: &Pipeline,
    plugin_path: &Path,
    from_savepoint: &Path,
    opts: &RunOptions,
    runtime: &PluginRuntime,
) -> Result<Summary> {
    let plugin =
        runtime.load(plugin_path, &pipeline.plugin.config).map_err(|e| Error::Deploy(format!("{e}")))?;
    let restore = savepoint::read(from_savepoint)?;
    start(pipeline, opts, plugin, Some(restore), Upgrade::Deploy)
}

/// Check a pipeline and its plugin without running anything.
pub fn validate(pipeline: &Pipeline, runtime: &PluginRuntime) -> Result<crate::plugin::PluginIdentity> {
    let plugin = runtime.load(&pipeline.plugin.path, &pipeline.plugin.config)?;
    Decoder::new(pipeline, &plugin)?;
    Ok(plugin.identity().clone())
}

fn start(
    pipeline: &Pipeline,
    opts: &RunOptions,
    plugin: Plugin,
    restore: Option<Savepoint>,
    upgrade: Upgrade,
) -> Result<Summary> {
    let mut op = Operator::new(pipeline, plugin)?;
    let mut migrated = None;
    if let Some(sp) = &restore {
        migrated = op.restore(pipeline, sp, upgrade)?;
    }
    let sink_pos =
        |name: &str| restore.as_ref().and_then(|sp| sp.meta.sinks.iter().find(|s| s.name == name).cloned());
    let input = match (&opts.input, &pipeline.source) {
        (Some(p), _) => p.clone(),
        (None, SourceSpec::File { path }) => path.clone(),
    };
    let resume_at =
        restore.as_ref().map(|sp| {
            sp.meta.source.partitions.first().cloned().ok_or_else(|| Error::Savepoint {
                path: sp.path.clone(),
                message: "no source position".into(),
            })
        });
    let resume_at = resume_at.transpose()?;
    let mut source = FileSource::open(&input, resume_at.as_ref())?;

    // Sinks are opened only once everything above has been checked.
    op.output = Some(match (&opts.output, &pipeline.sink) {
        (Some(p), _) => JsonlSink::open("output", p, sink_pos("output").as_ref())?,
        (None, SinkSpec::File { path }) => JsonlSink::open("output", path, sink_pos("output").as_ref())?,
        (None, SinkSpec::Stdout) => JsonlSink::stdout("output"),
    });
    op.late = Some(JsonlSink::open("late", &pipeline.late, sink_pos("late").as_ref())?);
    op.dead = Some(JsonlSink::open("dead_letter", &pipeline.dead_letter, sink_pos("dead_letter").as_ref())?);
    op.source_name = input.display().to_string();

    tracing::info!(
        pipeline = %pipeline.name,
        plugin = %format!("{} {}", op.plugin.identity().name, op.plugin.identity().version),
        input = %input.display(),
        resumed = restore.is_some(),
        "job started"
    );
    let read_before = source.records();
    let stop_after = opts.stop_with_savepoint_after;
    let cpu0 = metrics::thread_cpu_time();
    let t0 = Instant::now();
    let mut stopped = false;
    if stop_after != Some(0) {
        while let Some((record, pos)) = source.next_record()? {
            op.on_record(record, pos)?;
            if stop_after.is_some_and(|n| source.records() - read_before >= n) {
                stopped = true;
                break;
            }
        }
    } else {
        stopped = true;
    }
    op.flush()?;
    let mut savepoint_path = None;
    if stopped {
        let dir = opts.savepoint_dir.clone().unwrap_or_else(|| pipeline.savepoints.clone());
        let path = dir.join(format!("savepoint-{:012}", source.records()));
        op.write_savepoint(pipeline, &path, &source)?;
        savepoint_path = Some(path);
    } else {
        // End of a bounded input: every open window fires.
        let all = op.state.take_all();
        op.emit(all)?;
        op.commit_sinks()?;
    }
    let elapsed = t0.elapsed();
    let cpu = metrics::thread_cpu_time().saturating_sub(cpu0);
    Ok(Summary {
        counters: op.counters.clone(),
        open_windows: op.state.len(),
        watermark: op.watermark.current(),
        savepoint: savepoint_path,
        migrated,
        plugin: op.plugin.identity().clone(),
        records_this_run: source.records() - read_before,
        elapsed,
        cpu,
    })
}

/// A projected value, checked against the type the plugin declared.
#[derive(Clone, Copy)]
enum Role {
    Int,
    Float,
    Text,
    Boolean,
}

/// Turns a record into an event: projection, filter, event time, key, plugin fields.
struct Decoder {
    projection: Projection,
    names: Vec<String>,
    time_slot: usize,
    filters: Vec<(usize, String)>,
    key_slots: Vec<usize>,
    /// (slot, type) of every plugin column, in column order.
    columns: Vec<(usize, Role)>,
}

/// Why a record is not an event.
enum Reject {
    Filtered,
    Dead(String),
}

impl Decoder {
    fn new(pipeline: &Pipeline, plugin: &Plugin) -> Result<Decoder> {
        let mut names: Vec<String> = Vec::new();
        let mut slot = |name: &str| -> usize {
            match names.iter().position(|n| n == name) {
                Some(i) => i,
                None => {
                    names.push(name.to_string());
                    names.len() - 1
                }
            }
        };
        let time_slot = slot(&pipeline.event_time.field);
        let filters = pipeline.filter.iter().map(|(k, v)| (slot(k), v.clone())).collect();
        let key_slots = pipeline.key.iter().map(|k| slot(k)).collect();
        let mut columns = Vec::new();
        for f in &plugin.info().fields {
            if f.name.is_empty() {
                return Err(Error::Plugin {
                    plugin: plugin.identity().name.clone(),
                    message: "declares a field with no name".into(),
                });
            }
            let role = match f.type_ {
                FieldType::Int => Role::Int,
                FieldType::Float => Role::Float,
                FieldType::Text => Role::Text,
                FieldType::Boolean => Role::Boolean,
            };
            columns.push((slot(&f.name), role));
        }
        if names.len() > MAX_FIELDS {
            return Err(Error::Pipeline {
                path: pipeline.file.clone(),
                message: format!("the job reads {} fields; at most {MAX_FIELDS}", names.len()),
            });
        }
        Ok(Decoder { projection: Projection::new(&names), names, time_slot, filters, key_slots, columns })
    }

    fn missing(&self, slot: usize) -> Reject {
        Reject::Dead(format!("missing field `{}`", self.names[slot]))
    }

    fn wrong(&self, slot: usize, want: &str, got: &Scalar) -> Reject {
        Reject::Dead(format!("field `{}`: expected {want}, got {}", self.names[slot], got.kind()))
    }

    /// Check the filter, event time and plugin fields; build the encoded key.
    #[inline]
    fn event_time(&self, slots: &[Option<Scalar>]) -> Result<i64, Reject> {
        for (slot, want) in &self.filters {
            let matches = match &slots[*slot] {
                Some(Scalar::Str { raw, escaped: false }) => short_eq(raw, want.as_bytes()),
                Some(s @ Scalar::Str { escaped: true, .. }) => {
                    matches!(s.as_str(), Some(Ok(v)) if v == want.as_str())
                }
                _ => false,
            };
            if !matches {
                return Err(Reject::Filtered);
            }
        }
        let t = self.time_slot;
        match &slots[t] {
            Some(Scalar::Int(v)) => Ok(*v),
            Some(Scalar::Number(raw)) => Err(Reject::Dead(format!(
                "field `{}`: timestamp {} is not an integer number of epoch milliseconds",
                self.names[t],
                String::from_utf8_lossy(raw)
            ))),
            Some(other) => Err(self.wrong(t, "integer epoch milliseconds", other)),
            None => Err(self.missing(t)),
        }
    }

    #[inline]
    fn key(&self, slots: &[Option<Scalar>], out: &mut Vec<u8>) -> Result<(), Reject> {
        out.clear();
        for &k in &self.key_slots {
            match &slots[k] {
                // UTF-8 is checked when a key is first seen (`valid_key`).
                Some(Scalar::Str { raw, escaped: false }) => push_key_field(out, raw),
                Some(s @ Scalar::Str { escaped: true, .. }) => match s.as_str() {
                    Some(Ok(v)) => push_key_field(out, v.as_bytes()),
                    Some(Err(e)) => {
                        return Err(Reject::Dead(format!("field `{}`: {}", self.names[k], e.message)))
                    }
                    None => unreachable!("a Str scalar is a string"),
                },
                Some(Scalar::Int(i)) => push_key_field(out, i.to_string().as_bytes()),
                Some(other) => return Err(self.wrong(k, "a string", other)),
                None => return Err(self.missing(k)),
            }
        }
        Ok(())
    }

    /// Check every plugin column's value before anything is staged.
    #[inline]
    fn check_columns(&self, slots: &[Option<Scalar>]) -> Result<(), Reject> {
        for &(slot, role) in &self.columns {
            let Some(v) = &slots[slot] else {
                return Err(self.missing(slot));
            };
            match (role, v) {
                (Role::Int, Scalar::Int(_)) => {}
                (Role::Int, _) => return Err(self.wrong(slot, "an integer", v)),
                (Role::Float, Scalar::Int(_)) => {}
                (Role::Float, Scalar::Number(raw)) => {
                    if parse_f64(raw).is_none() {
                        return Err(self.wrong(slot, "a number", v));
                    }
                }
                (Role::Float, _) => return Err(self.wrong(slot, "a number", v)),
                (Role::Boolean, Scalar::Bool(_)) => {}
                (Role::Boolean, _) => return Err(self.wrong(slot, "a boolean", v)),
                (Role::Text, Scalar::Str { .. }) => {
                    if let Some(Err(e)) = v.as_str() {
                        return Err(Reject::Dead(format!("field `{}`: {}", self.names[slot], e.message)));
                    }
                }
                (Role::Text, _) => return Err(self.wrong(slot, "a string", v)),
            }
        }
        Ok(())
    }

    /// Stage the checked plugin columns.
    #[inline]
    fn stage_columns(&self, slots: &[Option<Scalar>], batch: &mut Batch) {
        for (col, &(slot, role)) in self.columns.iter().enumerate() {
            match (role, slots[slot]) {
                (Role::Int, Some(Scalar::Int(v))) => batch.push_int(col, v),
                (Role::Float, Some(Scalar::Int(v))) => batch.push_float(col, v as f64),
                (Role::Float, Some(Scalar::Number(raw))) => {
                    batch.push_float(col, parse_f64(raw).unwrap_or(f64::NAN))
                }
                (Role::Boolean, Some(Scalar::Bool(b))) => batch.push_bool(col, b),
                (Role::Text, Some(s)) => {
                    let text = match s.as_str() {
                        Some(Ok(t)) => t,
                        _ => Cow::Borrowed(""),
                    };
                    batch.push_text(col, &text)
                }
                _ => unreachable!("columns are checked before staging"),
            }
        }
    }
}

fn parse_f64(raw: &[u8]) -> Option<f64> {
    std::str::from_utf8(raw).ok()?.parse().ok()
}

/// Write one record to a side output (late events, dead letters).
fn write_side(sink: &mut Option<JsonlSink>, buf: &mut Vec<u8>, record: &impl Serialize) -> Result<()> {
    buf.clear();
    serde_json::to_writer(&mut *buf, record).map_err(|e| Error::Usage(format!("encode side output: {e}")))?;
    sink.as_mut().map_or(Ok(()), |s| s.write_line(buf))
}

/// The window operator and its outputs.
struct Operator {
    decoder: Decoder,
    assigner: Assigner,
    watermark: Watermark,
    keys: KeyTable,
    state: WindowState,
    batch: Batch,
    batch_size: usize,
    /// Smallest end among open and staged windows: the watermark that fires next.
    next_fire: i64,
    fire_groups: Groups,
    plugin: Plugin,
    counters: Counters,
    key_buf: Vec<u8>,
    line_buf: Vec<u8>,
    source_name: String,
    output: Option<JsonlSink>,
    late: Option<JsonlSink>,
    dead: Option<JsonlSink>,
}

#[derive(Serialize)]
struct DeadLetter<'a> {
    reason: &'a str,
    source: &'a str,
    line: u64,
    offset: u64,
    record: Cow<'a, str>,
}

#[derive(Serialize)]
struct LateEvent<'a> {
    reason: &'a str,
    event_time: i64,
    watermark: i64,
    window_start: i64,
    window_end: i64,
    source: &'a str,
    line: u64,
    offset: u64,
    record: Cow<'a, str>,
}

impl Operator {
    fn new(pipeline: &Pipeline, plugin: Plugin) -> Result<Operator> {
        let decoder = Decoder::new(pipeline, &plugin)?;
        let types: Vec<FieldType> = plugin.info().fields.iter().map(|f| f.type_).collect();
        let key_arity = pipeline.key.len();
        Ok(Operator {
            batch: Batch::new(&types, key_arity, plugin.info().ordered_input),
            decoder,
            assigner: Assigner::new(pipeline.window),
            watermark: Watermark::new(pipeline.event_time.watermark_delay_ms),
            keys: KeyTable::default(),
            state: WindowState::default(),
            batch_size: pipeline.plugin.batch_size,
            next_fire: i64::MAX,
            fire_groups: empty_groups(key_arity as u32),
            plugin,
            counters: Counters::default(),
            key_buf: Vec::with_capacity(64),
            line_buf: Vec::with_capacity(256),
            source_name: String::new(),
            output: None,
            late: None,
            dead: None,
        })
    }

    /// Process one record.
    #[inline]
    fn on_record(&mut self, record: &[u8], pos: Position) -> Result<()> {
        self.counters.read += 1;
        let mut slots = [None; MAX_FIELDS];
        let slots = &mut slots[..self.decoder.projection.len()];
        if let Err(e) = self.decoder.projection.scan(record, slots) {
            return self.dead_letter(&format!("not a valid JSON object: {e}"), record, pos);
        }
        let checked = self
            .decoder
            .event_time(slots)
            .and_then(|t| self.decoder.key(slots, &mut self.key_buf).map(|_| t))
            .and_then(|t| self.decoder.check_columns(slots).map(|_| t));
        let t = match checked {
            Ok(t) => t,
            Err(Reject::Filtered) => {
                self.counters.filtered += 1;
                return Ok(());
            }
            Err(Reject::Dead(reason)) => return self.dead_letter(&reason, record, pos),
        };
        let known = self.keys.get(&self.key_buf);
        if known.is_none() && !valid_key(&self.key_buf) {
            return self.dead_letter("a key field is not valid UTF-8", record, pos);
        }
        let window = self.assigner.assign(t);
        let wm = self.watermark.current();
        if window.end <= wm {
            return self.late_event(t, wm, window, record, pos);
        }
        self.counters.accepted += 1;
        let key = match known {
            Some(id) => id,
            None => self.keys.insert(&self.key_buf),
        };
        self.batch.push_row(key, window, t);
        self.decoder.stage_columns(slots, &mut self.batch);
        self.next_fire = self.next_fire.min(window.end);
        let wm = self.watermark.observe(t);
        if wm >= self.next_fire {
            self.fire(wm)?;
        } else if self.batch.len() >= self.batch_size {
            self.flush()?;
        }
        Ok(())
    }

    fn dead_letter(&mut self, reason: &str, record: &[u8], pos: Position) -> Result<()> {
        self.counters.dead_lettered += 1;
        let d = DeadLetter {
            reason,
            source: &self.source_name,
            line: pos.line,
            offset: pos.offset,
            record: String::from_utf8_lossy(record),
        };
        write_side(&mut self.dead, &mut self.line_buf, &d)
    }

    fn late_event(&mut self, t: i64, wm: i64, window: Window, record: &[u8], pos: Position) -> Result<()> {
        self.counters.late += 1;
        let l = LateEvent {
            reason: "late: its window already fired",
            event_time: t,
            watermark: wm,
            window_start: window.start,
            window_end: window.end,
            source: &self.source_name,
            line: pos.line,
            offset: pos.offset,
            record: String::from_utf8_lossy(record),
        };
        write_side(&mut self.late, &mut self.line_buf, &l)
    }

    /// Hand the staged rows to the plugin.
    fn flush(&mut self) -> Result<()> {
        if self.batch.is_empty() {
            return Ok(());
        }
        let groups = self.batch.assemble(&self.keys, &self.state);
        let accs = self.plugin.add(&self.batch.groups, &self.batch.events)?;
        for (i, (key, window)) in groups.into_iter().enumerate() {
            self.state.put(key, window, packed_item(&accs, i));
        }
        self.next_fire = self.state.next_end().unwrap_or(i64::MAX);
        Ok(())
    }

    /// Fire every window the watermark has passed.
    fn fire(&mut self, watermark: i64) -> Result<()> {
        self.flush()?;
        let closed = self.state.take_until(watermark);
        self.next_fire = self.state.next_end().unwrap_or(i64::MAX);
        self.emit(closed)
    }

    /// Ask the plugin for the results of closed windows and write them, in a
    /// deterministic order: by window end, start, then key fields.
    fn emit(&mut self, mut closed: Vec<Closed>) -> Result<()> {
        if closed.is_empty() {
            return Ok(());
        }
        let keys = &self.keys;
        closed.sort_by(|a, b| {
            (a.window.end, a.window.start)
                .cmp(&(b.window.end, b.window.start))
                .then_with(|| keys.raw_fields(a.key).cmp(keys.raw_fields(b.key)))
        });
        for chunk in closed.chunks(self.batch_size) {
            fill_groups(
                &mut self.fire_groups,
                &self.keys,
                chunk.iter().map(|c| (c.key, c.window, c.acc.as_slice())),
            );
            let emitted = self.plugin.finish(&self.fire_groups)?;
            self.counters.windows_fired += chunk.len() as u64;
            for e in emitted {
                let c = &chunk[e.group as usize];
                self.write_result(c.key, c.window, &e.value)?;
            }
        }
        Ok(())
    }

    fn write_result(&mut self, key: u32, window: Window, value: &str) -> Result<()> {
        let bad = |m: String| Error::PluginCall {
            plugin: self.plugin.identity().name.clone(),
            call: "finish",
            message: m,
        };
        if !value.trim_start().starts_with('{') {
            return Err(bad(format!("emitted a value that is not a JSON object: {value:.200}")));
        }
        let mut k = window.start.to_string();
        for f in self.keys.fields(key) {
            k.push('|');
            k.push_str(f);
        }
        self.line_buf.clear();
        self.line_buf.extend_from_slice(b"{\"key\":");
        serde_json::to_writer(&mut self.line_buf, &k).map_err(|e| bad(e.to_string()))?;
        self.line_buf.extend_from_slice(b",\"value\":");
        if value.contains(['\n', '\r']) {
            // Keep one record per line: re-encode (checks the JSON too).
            let v: serde_json::Value =
                serde_json::from_str(value).map_err(|e| bad(format!("invalid JSON: {e}")))?;
            serde_json::to_writer(&mut self.line_buf, &v).map_err(|e| bad(e.to_string()))?;
        } else {
            serde_json::from_str::<serde::de::IgnoredAny>(value)
                .map_err(|e| bad(format!("invalid JSON: {e}")))?;
            self.line_buf.extend_from_slice(value.as_bytes());
        }
        self.line_buf.push(b'}');
        self.counters.emitted += 1;
        self.output.as_mut().map_or(Ok(()), |s| s.write_line(&self.line_buf))
    }

    fn commit_sinks(&mut self) -> Result<Vec<SinkPosition>> {
        let mut out = Vec::new();
        for s in [&mut self.output, &mut self.late, &mut self.dead].into_iter().flatten() {
            out.extend(s.commit()?);
        }
        Ok(out)
    }

    /// Load a savepoint's state into this (fresh) operator.
    fn restore(
        &mut self,
        pipeline: &Pipeline,
        sp: &Savepoint,
        upgrade: Upgrade,
    ) -> Result<Option<(u32, u32)>> {
        let refuse = |m: String| match upgrade {
            Upgrade::Deploy => Error::Deploy(m),
            Upgrade::Resume => Error::Savepoint { path: sp.path.clone(), message: m },
        };
        let meta = &sp.meta;
        if meta.operator != OPERATOR_ID {
            return Err(refuse(format!("holds operator {:?}, this job runs {OPERATOR_ID:?}", meta.operator)));
        }
        if meta.pipeline.fingerprint != pipeline.state_fingerprint() {
            return Err(refuse(format!(
                "was taken from pipeline {:?} with another key, window, event-time field or filter; \
                 its state does not fit pipeline {:?}",
                meta.pipeline.name, pipeline.name
            )));
        }
        let old = &meta.plugin;
        let new = self.plugin.identity().clone();
        if old.name != new.name {
            return Err(refuse(format!(
                "the savepoint holds state of plugin {:?}; plugin {:?} is different logic and cannot take it",
                old.name, new.name
            )));
        }
        if let Some(bad) = sp.windows.iter().find(|w| w.key.len() != pipeline.key.len()) {
            return Err(refuse(format!(
                "window key {:?} does not have {} fields",
                bad.key,
                pipeline.key.len()
            )));
        }
        let mut accs: Vec<Vec<u8>> = sp.windows.iter().map(|w| w.acc.clone()).collect();
        let mut migrated = None;
        match upgrade {
            Upgrade::Resume if old.state_schema != new.state_schema => {
                return Err(refuse(format!(
                    "the savepoint's accumulators have state schema {} but {} {} uses schema {}: deploy it with \
                     `km0 deploy PLUGIN.wasm --from-savepoint {}` to migrate",
                    old.state_schema,
                    new.name,
                    new.version,
                    new.state_schema,
                    sp.path.display()
                )));
            }
            Upgrade::Resume => {
                if old.sha256 != new.sha256 {
                    tracing::warn!(from = %old.version, to = %new.version, "resuming with a different build of the plugin (same state schema)");
                }
            }
            Upgrade::Deploy => {
                let mut out = Vec::with_capacity(accs.len());
                for chunk in accs.chunks(self.batch_size.max(1)) {
                    let packed = packed_of(chunk.iter().map(Vec::as_slice));
                    let m = self.plugin.migrate(old.state_schema, &packed).map_err(|e| {
                        Error::Deploy(format!(
                            "{} {} (state schema {}) cannot take the savepoint's state (schema {}): {e}",
                            new.name, new.version, new.state_schema, old.state_schema
                        ))
                    })?;
                    out.extend((0..chunk.len()).map(|i| packed_item(&m, i).to_vec()));
                }
                accs = out;
                migrated = Some((old.state_schema, new.state_schema));
            }
        }
        let mut key = Vec::new();
        for (w, acc) in sp.windows.iter().zip(&accs) {
            key.clear();
            for f in &w.key {
                push_key_field(&mut key, f.as_bytes());
            }
            let id = self.keys.intern(&key);
            self.state.put(id, w.window, acc);
        }
        self.next_fire = self.state.next_end().unwrap_or(i64::MAX);
        self.watermark = Watermark::restore(
            pipeline.event_time.watermark_delay_ms,
            meta.watermark.max_event_time,
            meta.watermark.current,
        );
        self.counters = meta.counters.clone();
        Ok(migrated)
    }

    fn write_savepoint(&mut self, pipeline: &Pipeline, path: &Path, source: &FileSource) -> Result<()> {
        let sinks = self.commit_sinks()?;
        let meta = SavepointMeta {
            format: savepoint::FORMAT.into(),
            format_version: savepoint::FORMAT_VERSION,
            km0_version: env!("CARGO_PKG_VERSION").into(),
            created_at_ms: metrics::now_ms(),
            operator: OPERATOR_ID.into(),
            pipeline: PipelineIdentity {
                name: pipeline.name.clone(),
                fingerprint: pipeline.state_fingerprint(),
            },
            plugin: self.plugin.identity().clone(),
            source: source.position(),
            watermark: WatermarkState {
                current: self.watermark.current(),
                max_event_time: self.watermark.max_event_time(),
            },
            counters: self.counters.clone(),
            sinks,
            state: StateFile { file: String::new(), windows: 0, bytes: 0, sha256: String::new() },
        };
        let keys = &self.keys;
        savepoint::write(
            path,
            meta,
            self.state.iter().map(|(k, w, acc)| (keys.fields(k).collect(), w, acc)),
        )?;
        tracing::info!(path = %path.display(), windows = self.state.len(), "savepoint written");
        Ok(())
    }
}

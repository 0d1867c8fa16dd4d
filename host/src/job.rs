//! A running job: the single-threaded loop that takes records from the source, decodes
//! and routes them (filtered, dead letter, late, accepted), feeds each aggregation's
//! [`WindowOperator`], advances the watermarks, and writes results and side outputs;
//! plus starting from and stopping with savepoints.
//!
//! Every aggregation of a pipeline reads the same decoded event: one parse serves all.

use crate::checkpoint::savepoint::{self, PipelineIdentity, StateFile};
use crate::checkpoint::store::{self, LocalStore, SnapshotStore};
use crate::checkpoint::{OperatorMeta, Savepoint, SavepointMeta};
use crate::pipeline::{Backend, CheckpointSpec, DeadLetterSpec, Pipeline, SinkSpec};
use crate::plugin::{Plugin, PluginIdentity, PluginRuntime};
use crate::sink::kafka::KafkaSink;
use crate::sink::postgres::{Barrier, PostgresSink, StartPoint};
use crate::sink::{DeadLetterSink, JsonlSink, ResultSink};
use crate::source::json::{short_eq, Projection, Scalar};
use crate::source::kafka::PartitionLag;
use crate::source::{Position, Source, SourcePosition};
use crate::state::push_key_field;
use crate::state::rocks::{Changes, RocksState};
use crate::time::{Idleness, Watermarks};
use crate::window::operator::{Emitted, OperatorCounters, Snapshot, Verdict, WindowOperator};
use crate::window::Window;
use crate::{metrics, Error, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Most distinct fields a job may project (time, filter, key, partition, plugin fields).
pub const MAX_FIELDS: usize = 32;

/// What happened to the records, cumulative across savepoint resumes. The per-event
/// counts are summed over the pipeline's aggregations.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    /// Records read from the source.
    pub read: u64,
    /// Records that did not match the pipeline's filter.
    pub filtered: u64,
    /// Records sent to the dead-letter output.
    pub dead_lettered: u64,
    /// Events past every window's allowed lateness (late side output).
    pub late: u64,
    /// Accepted events whose window had already fired (re-emitted within lateness).
    pub late_updates: u64,
    /// Events added to a window.
    pub accepted: u64,
    /// Window results computed (with or without output).
    pub windows_fired: u64,
    /// Result records written.
    pub emitted: u64,
    /// Retractions written (a session's result superseded under another key).
    #[serde(default)]
    pub retracted: u64,
}

/// Command-line overrides of a run.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Replace the file source's path (one partition).
    pub input: Option<PathBuf>,
    /// Replace the sink with this file.
    pub output: Option<PathBuf>,
    /// Process this many records, write a savepoint and stop.
    pub stop_with_savepoint_after: Option<u64>,
    /// Where new savepoints go (default: the pipeline's `savepoints.dir`).
    pub savepoint_dir: Option<PathBuf>,
    /// Resume from this savepoint.
    pub from_savepoint: Option<PathBuf>,
    /// Read the input as it grows (overrides `source.follow`).
    pub follow: Option<bool>,
    /// Start fresh even if the pipeline's checkpoint folder holds checkpoints.
    pub no_recover: bool,
}

/// One aggregation at the end of a run.
#[derive(Debug, Clone)]
pub struct OperatorSummary {
    pub name: String,
    pub plugin: PluginIdentity,
    pub counters: OperatorCounters,
    /// Slots still open (0 after end of input; in the savepoint otherwise).
    pub open_slots: usize,
    pub keys: usize,
}

/// How a run ended.
#[derive(Debug, Clone)]
pub struct Summary {
    pub counters: Counters,
    pub operators: Vec<OperatorSummary>,
    /// Slots still open, over all aggregations.
    pub open_windows: usize,
    pub watermark: i64,
    /// The savepoint written, when the run stopped with one.
    pub savepoint: Option<PathBuf>,
    /// State schema migrations done at start: (aggregation, from, to).
    pub migrated: Vec<(String, u32, u32)>,
    /// The first aggregation's plugin.
    pub plugin: PluginIdentity,
    /// Records read by this run (not counting those before a resume).
    pub records_this_run: u64,
    /// Wall time of the processing loop.
    pub elapsed: Duration,
    /// CPU time of the processing thread during the loop.
    pub cpu: Duration,
    /// The checkpoint this run recovered from.
    pub recovered_from: Option<String>,
    /// Time to read and load the savepoint or checkpoint it started from.
    pub restore_time: Duration,
    /// Checkpoints taken by this run, and how long processing stopped for them.
    pub checkpoints: u64,
    pub checkpoint_pause_max: Duration,
    pub checkpoint_pause_total: Duration,
    /// How long processing stopped to write the final savepoint.
    pub savepoint_pause: Duration,
    /// Consumer lag per partition at the end of the run (Kafka sources).
    pub lag: Vec<PartitionLag>,
    /// Times the source was paused because a sink was behind (backpressure).
    pub backpressure_pauses: u64,
}

/// How the job's plugins relate to the state it starts from.
enum Upgrade {
    /// Same logic: state schemas must match.
    Resume,
    /// `km0 deploy`: a new version of the plugin with this name, state migrated.
    Deploy(String),
}

/// Run a pipeline (fresh, or resumed from `opts.from_savepoint`).
pub fn run(pipeline: &Pipeline, opts: &RunOptions, runtime: &PluginRuntime) -> Result<Summary> {
    let plugins = load_plugins(pipeline, runtime, None)?;
    let t0 = Instant::now();
    let restore = match (&opts.from_savepoint, &pipeline.checkpoints) {
        (Some(sp), _) => Some(Restore { savepoint: savepoint::read(sp)?, checkpoint: None }),
        (None, Some(c)) if !opts.no_recover => {
            let store = LocalStore::open(&c.dir)?;
            let transactional = opts.output.is_none()
                && matches!(
                    pipeline.sink,
                    SinkSpec::Kafka { mode: crate::pipeline::KafkaSinkMode::Transactional, .. }
                );
            let found = store::latest_valid(&store, transactional)?;
            if transactional {
                // Checkpoints after the one recovered from never committed: drop them, so
                // that pruning cannot remove the last committed one.
                let newest = found.as_ref().map_or(0, |(n, _)| *n);
                for n in store.list()?.into_iter().filter(|&n| n > newest) {
                    store.remove(n)?;
                }
            }
            found.map(|(n, savepoint)| {
                tracing::info!(checkpoint = n, "recovering from the latest checkpoint");
                Restore { savepoint, checkpoint: Some(n) }
            })
        }
        _ => None,
    };
    start(pipeline, opts, plugins, restore, Upgrade::Resume, t0)
}

/// What a run starts from.
struct Restore {
    savepoint: Savepoint,
    /// The checkpoint number, when recovering from a checkpoint.
    checkpoint: Option<u64>,
}

/// Resume from a savepoint with a new plugin version, migrating its state. Refused (the
/// savepoint untouched, nothing written) when the plugin cannot take the state. The new
/// plugin replaces every aggregation whose plugin has the same name.
pub fn deploy(
    pipeline: &Pipeline,
    plugin_path: &Path,
    from_savepoint: &Path,
    opts: &RunOptions,
    runtime: &PluginRuntime,
) -> Result<Summary> {
    let restore = savepoint::read(from_savepoint)?;
    // Only its name here: each aggregation it replaces configures it with its own
    // `[plugin.config]` and limits (load_plugins).
    let (identity, _) = runtime.inspect(plugin_path).map_err(|e| Error::Deploy(format!("{e}")))?;
    let name = identity.name;
    if !restore.meta.operators.iter().any(|o| o.plugin.name == name) {
        let held: Vec<&str> = restore.meta.operators.iter().map(|o| o.plugin.name.as_str()).collect();
        return Err(Error::Deploy(format!(
            "the savepoint holds state of plugin(s) {held:?}; plugin {name:?} is different logic and cannot take it"
        )));
    }
    let plugins = load_plugins(pipeline, runtime, Some((plugin_path, &name, &restore)))?;
    let restore = Restore { savepoint: restore, checkpoint: None };
    start(pipeline, opts, plugins, Some(restore), Upgrade::Deploy(name), Instant::now())
}

/// The plugin of every aggregation; with `deploy`, the new component replaces the
/// plugins that the savepoint holds under its name.
fn load_plugins(
    pipeline: &Pipeline,
    runtime: &PluginRuntime,
    deploy: Option<(&Path, &str, &Savepoint)>,
) -> Result<Vec<Plugin>> {
    pipeline
        .aggregations
        .iter()
        .map(|a| {
            let replaced = deploy.filter(|(_, name, sp)| {
                sp.meta.operators.iter().any(|o| o.id == a.name && o.plugin.name == *name)
            });
            match replaced {
                Some((path, _, _)) => runtime
                    .load_with(path, &a.plugin.config, a.plugin.limits)
                    .map_err(|e| Error::Deploy(format!("{e}"))),
                None => runtime.load_with(&a.plugin.path, &a.plugin.config, a.plugin.limits),
            }
        })
        .collect()
}

/// Check a pipeline and its plugins without running anything.
pub fn validate(pipeline: &Pipeline, runtime: &PluginRuntime) -> Result<Vec<PluginIdentity>> {
    let plugins = load_plugins(pipeline, runtime, None)?;
    let ids = plugins.iter().map(|p| p.identity().clone()).collect();
    Job::new(pipeline, plugins)?;
    Ok(ids)
}

fn start(
    pipeline: &Pipeline,
    opts: &RunOptions,
    plugins: Vec<Plugin>,
    restore: Option<Restore>,
    upgrade: Upgrade,
    restore_started: Instant,
) -> Result<Summary> {
    let mut job = Job::new(pipeline, plugins)?;
    if let Some(input) = &opts.input {
        // Another input is another run: it never replays an epoch of the pipeline's own.
        let text = format!("{}|input={}", job.fingerprint, input.display());
        job.fingerprint = crate::pipeline::hex(&Sha256::digest(text.as_bytes()));
    }
    let partitioning = pipeline.source.partitioning().clone();
    let follow = Source::unbounded(&pipeline.source, opts.follow);
    let recovered_from = restore.as_ref().and_then(|r| r.checkpoint).map(|n| format!("chk-{n:06}"));
    let restore = restore.map(|r| r.savepoint);
    let mut migrated = Vec::new();
    if let Some(sp) = &restore {
        migrated = job.restore(pipeline, sp, &upgrade)?;
    }
    let restore_time = if restore.is_some() { restore_started.elapsed() } else { Duration::ZERO };
    let mut source = Source::open(
        &pipeline.source,
        opts.input.as_ref(),
        opts.follow,
        restore.as_ref().map(|sp| &sp.meta.source),
    )?;
    let mut checkpoints = match &pipeline.checkpoints {
        Some(spec) => {
            let store = LocalStore::open(&spec.dir)?;
            let next = store.list()?.last().map_or(1, |n| n + 1);
            let rocks = match pipeline.state.backend {
                Backend::Memory => None,
                Backend::Rocksdb => {
                    for op in &mut job.ops {
                        op.track_changes();
                    }
                    Some(std::sync::Arc::new(RocksState::open_fresh(&pipeline.state.dir)?))
                }
            };
            Some(Checkpointer {
                spec: spec.clone(),
                store,
                rocks,
                next,
                last: Instant::now(),
                records_at_last: 0,
                writing: None,
                synchronous: false,
            })
        }
        None => None,
    };
    if partitioning.field.is_none() && restore.is_none() {
        for p in 0..source.partitions() {
            job.watermarks.partition(&source.partition_name(p as u32));
        }
    }
    if matches!(source, Source::Kafka(_)) {
        // Kafka partitions meet their clocks by name: a topic may have gained partitions
        // since the checkpoint (a new one gets a clock of its own).
        job.clock_of = (0..source.partitions())
            .map(|p| job.watermarks.partition(&source.partition_name(p as u32)))
            .collect();
    }

    // Sinks are opened only once everything above has been checked.
    let sink_pos =
        |name: &str| restore.as_ref().and_then(|sp| sp.meta.sinks.iter().find(|s| s.name == name).cloned());
    // A transactional sink's id is stable per job, so a restart fences its predecessor.
    let txn_id = format!("km0-{}", pipeline.name);
    job.output = Some(match (&opts.output, &pipeline.sink) {
        (Some(p), _) => ResultSink::Jsonl(JsonlSink::open("output", p, sink_pos("output").as_ref())?),
        (None, SinkSpec::File { path }) => {
            ResultSink::Jsonl(JsonlSink::open("output", path, sink_pos("output").as_ref())?)
        }
        (None, SinkSpec::Stdout) => ResultSink::Jsonl(JsonlSink::stdout("output")),
        (None, SinkSpec::Kafka { target, mode, max_in_flight }) => {
            let mut sink = KafkaSink::open(target, *mode, &txn_id)?;
            sink.set_max_in_flight(*max_in_flight);
            ResultSink::Kafka(sink)
        }
        (None, SinkSpec::Postgres { url, table }) => {
            let replayable = match &pipeline.source {
                crate::pipeline::SourceSpec::Kafka(k) => k.start == crate::pipeline::StartAt::Earliest,
                _ => true,
            };
            let start = StartPoint {
                snapshot: restore.as_ref().map(|sp| sp.meta.snapshot_id.clone()),
                ordinal: job.results_out,
                fingerprint: job.fingerprint.clone(),
                replayable,
            };
            ResultSink::Postgres(PostgresSink::open(url, table, &pipeline.name, &start)?)
        }
    });
    if let (Some(c), Some(out)) = (checkpoints.as_mut(), job.output.as_ref()) {
        c.synchronous = out.commits_on_completion();
    }
    job.late = Some(JsonlSink::open("late", &pipeline.late, sink_pos("late").as_ref())?);
    job.dead = Some(match &pipeline.dead_letter {
        DeadLetterSpec::File(path) => {
            DeadLetterSink::Jsonl(JsonlSink::open("dead_letter", path, sink_pos("dead_letter").as_ref())?)
        }
        DeadLetterSpec::Kafka(target) => {
            DeadLetterSink::Kafka(KafkaSink::open(target, crate::pipeline::KafkaSinkMode::Upsert, &txn_id)?)
        }
    });
    job.sources = (0..source.partitions()).map(|p| source.partition_name(p as u32)).collect();

    tracing::info!(pipeline = %pipeline.name, partitions = source.partitions(), resumed = restore.is_some(), "job started");
    let read_before = source.records();
    let stop_after = opts.stop_with_savepoint_after;
    let cpu0 = metrics::thread_cpu_time();
    let t0 = Instant::now();
    let mut stopped = stop_after == Some(0);
    let mut stats = CheckpointStats::default();
    let mut idle_loops = 0u32;
    let mut backpressure_pauses = 0u64;
    let mut lag_at = LagReport { every: Duration::from_secs(5), last: Instant::now() };
    if let crate::pipeline::SourceSpec::Kafka(k) = &pipeline.source {
        lag_at.every = Duration::from_millis(k.lag_interval_ms as u64);
    }
    while !stopped {
        match source.next_record()? {
            Some((record, pos)) => {
                job.on_record(record, pos)?;
                for p in source.take_ended() {
                    job.partition_ended(p)?;
                }
                let read = source.records();
                if stop_after.is_some_and(|n| read - read_before >= n) {
                    stopped = true;
                } else if let Some(c) = checkpoints.as_mut().filter(|c| c.due(read)) {
                    stats.add(c.take(&mut job, pipeline, &mut source)?);
                }
                if read % 1024 == 0 {
                    if let Some(c) = checkpoints.as_mut() {
                        c.completed(&mut job, &source, false)?;
                    }
                    if job.output.as_ref().is_some_and(ResultSink::behind) {
                        backpressure_pauses += 1;
                        job.drain_output(&mut source, &mut lag_at)?;
                    }
                    job.check_deliveries()?;
                    report_lag(&source, &mut lag_at);
                }
            }
            None if follow => {
                // Nothing new: checkpoint if due, then wait for input.
                for p in source.take_ended() {
                    job.partition_ended(p)?;
                }
                job.tick()?;
                job.check_deliveries()?;
                report_lag(&source, &mut lag_at);
                if let Some(c) = checkpoints.as_mut() {
                    c.completed(&mut job, &source, false)?;
                    if c.due_by_time() {
                        stats.add(c.take(&mut job, pipeline, &mut source)?);
                    }
                }
                idle_loops = idle_loops.saturating_add(1);
                std::thread::sleep(Duration::from_millis(if idle_loops < 10 { 1 } else { 20 }));
                continue;
            }
            None => break,
        }
        idle_loops = 0;
    }
    if let Some(c) = checkpoints.as_mut() {
        c.completed(&mut job, &source, true)?;
    }
    let mut savepoint_path = None;
    let mut savepoint_pause = Duration::ZERO;
    if stopped {
        let dir = opts.savepoint_dir.clone().unwrap_or_else(|| pipeline.savepoints.clone());
        let path = dir.join(format!("savepoint-{:012}", source.records()));
        let t = Instant::now();
        let (meta, snapshots) = job.snapshot(pipeline, &source)?;
        let captured = t.elapsed();
        meta.sinks.iter().try_for_each(crate::sink::sync)?;
        savepoint::write(&path, meta, &snapshots)?;
        // The savepoint is durable: a transactional sink commits what it covers.
        if let Some(out) = job.output.as_mut() {
            out.checkpoint_complete()?;
        }
        savepoint_pause = t.elapsed();
        tracing::debug!(
            capture_ms = captured.as_millis() as u64,
            total_ms = savepoint_pause.as_millis() as u64,
            "savepoint timing"
        );
        tracing::info!(path = %path.display(), "savepoint written");
        savepoint_path = Some(path);
    } else {
        // End of a bounded input: every open window fires.
        for op in &mut job.ops {
            op.drain(&mut job.results)?;
        }
        job.write_results()?;
        let mut barrier = job.barrier();
        barrier.id.insert_str(0, crate::sink::postgres::END_PREFIX);
        if let Some(out) = job.output.as_mut() {
            out.commit(job.results_out, &barrier)?;
        }
        let refused = job.output.as_mut().map(ResultSink::take_refused).unwrap_or_default();
        job.dead_letter_results(refused)?;
        if let Some(late) = job.late.as_mut() {
            late.commit()?;
        }
        if let Some(dead) = job.dead.as_mut() {
            dead.commit()?;
        }
        // Everything read is in the sinks: show it to the consumer group.
        source.checkpoint_complete(&source.position());
    }
    let elapsed = t0.elapsed();
    let cpu = metrics::thread_cpu_time().saturating_sub(cpu0);
    let operators: Vec<OperatorSummary> = job
        .ops
        .iter()
        .map(|op| OperatorSummary {
            name: op.name().to_string(),
            plugin: op.identity().clone(),
            counters: op.counters().clone(),
            open_slots: op.open_slots(),
            keys: op.keys(),
        })
        .collect();
    Ok(Summary {
        counters: job.counters(),
        open_windows: operators.iter().map(|o| o.open_slots).sum(),
        plugin: operators[0].plugin.clone(),
        operators,
        watermark: job.watermarks.current(),
        savepoint: savepoint_path,
        migrated,
        records_this_run: source.records() - read_before,
        elapsed,
        cpu,
        recovered_from,
        restore_time,
        checkpoints: stats.count,
        checkpoint_pause_max: stats.max,
        checkpoint_pause_total: stats.total,
        savepoint_pause,
        lag: source.lag().unwrap_or_else(|e| {
            tracing::warn!(error = %e, "could not read the consumer lag");
            Vec::new()
        }),
        backpressure_pauses,
    })
}

/// Pauses of the checkpoints of a run.
#[derive(Default)]
struct CheckpointStats {
    count: u64,
    max: Duration,
    total: Duration,
}

impl CheckpointStats {
    fn add(&mut self, pause: Duration) {
        self.count += 1;
        self.max = self.max.max(pause);
        self.total += pause;
    }
}

/// Takes periodic checkpoints into a store. Processing stops only to capture the
/// snapshot; encoding, hashing and writing it happen on a background thread, one
/// checkpoint at a time.
struct Checkpointer {
    spec: CheckpointSpec,
    store: LocalStore,
    /// The RocksDB copy of the state, with the RocksDB backend.
    rocks: Option<std::sync::Arc<RocksState>>,
    next: u64,
    last: Instant,
    records_at_last: u64,
    /// The checkpoint being written: its number and the source position it holds.
    writing: Option<(std::thread::JoinHandle<Result<()>>, u64, SourcePosition)>,
    /// Wait for every checkpoint before going on (the sink commits at completion).
    synchronous: bool,
}

impl Checkpointer {
    /// Checked after every record: by record count exactly, by time every 1024 records.
    #[inline]
    fn due(&self, records: u64) -> bool {
        if self.spec.every_records.is_some_and(|n| records - self.records_at_last >= n) {
            return true;
        }
        records % 1024 == 0 && self.due_by_time()
    }

    fn due_by_time(&self) -> bool {
        self.last.elapsed() >= Duration::from_millis(self.spec.interval_ms as u64)
    }

    /// Take a checkpoint; returns how long processing stopped for it.
    fn take(&mut self, job: &mut Job, pipeline: &Pipeline, source: &mut Source) -> Result<Duration> {
        self.completed(job, source, true)?;
        let t = Instant::now();
        let (store, n, retain) = (self.store.clone(), self.next, self.spec.retain);
        let position = source.position();
        let writer = match &self.rocks {
            None => {
                let (meta, snapshots) = job.snapshot(pipeline, source)?;
                std::thread::spawn(move || {
                    let t = Instant::now();
                    // The sinks' data must be durable before the checkpoint that commits it.
                    meta.sinks.iter().try_for_each(crate::sink::sync)?;
                    let name = store.write(n, meta, &snapshots)?;
                    store::prune(&store, retain)?;
                    tracing::debug!(checkpoint = %name, write_ms = t.elapsed().as_millis() as u64, "checkpoint complete");
                    Ok(())
                })
            }
            Some(rocks) => {
                let (meta, changes) = job.changes(pipeline, source)?;
                let rocks = rocks.clone();
                std::thread::spawn(move || {
                    let t = Instant::now();
                    meta.sinks.iter().try_for_each(crate::sink::sync)?;
                    savepoint::write_external(&store.path(n), meta, "rocksdb", |dir| {
                        rocks.apply_and_checkpoint(&changes, dir)
                    })?;
                    store::prune(&store, retain)?;
                    tracing::debug!(
                        checkpoint = n,
                        write_ms = t.elapsed().as_millis() as u64,
                        "checkpoint complete"
                    );
                    Ok(())
                })
            }
        };
        self.writing = Some((writer, n, position));
        if self.synchronous {
            self.completed(job, source, true)?;
        }
        let pause = t.elapsed();
        self.next += 1;
        self.last = Instant::now();
        self.records_at_last = source.records();
        Ok(pause)
    }

    /// If the checkpoint being written is complete (with `wait`, once it is), tell the
    /// source (Kafka commits the offsets to its group) and the sink (a transactional sink
    /// commits the epoch).
    fn completed(&mut self, job: &mut Job, source: &Source, wait: bool) -> Result<()> {
        let done = self.writing.as_ref().is_some_and(|(h, _, _)| wait || h.is_finished());
        if !done {
            return Ok(());
        }
        let Some((h, n, position)) = self.writing.take() else { return Ok(()) };
        h.join().map_err(|_| Error::Usage("the checkpoint writer panicked".into()))??;
        source.checkpoint_complete(&position);
        if let Some(out) = job.output.as_mut() {
            out.checkpoint_complete()?;
            if out.commits_on_completion() {
                self.store.mark_committed(n)?;
            }
        }
        Ok(())
    }
}

/// Turns a record into an event: projection, filter, partition, event time, key.
struct Decoder {
    projection: Projection,
    names: Vec<String>,
    time_slot: usize,
    /// Accepted event times, `[min, max)`.
    time_range: (i64, i64),
    filters: Vec<(usize, String)>,
    key_slots: Vec<usize>,
    partition_slot: Option<usize>,
}

/// Why a record is not an event.
enum Reject {
    Filtered,
    Dead(String),
}

impl Decoder {
    /// The decoder and, per aggregation, the projection slot of each plugin column.
    fn new(pipeline: &Pipeline, plugins: &[Plugin]) -> Result<(Decoder, Vec<Vec<usize>>)> {
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
        let partition_slot = pipeline.source.partitioning().field.as_deref().map(&mut slot);
        let mut columns = Vec::new();
        for plugin in plugins {
            let mut cols = Vec::new();
            for f in &plugin.info().fields {
                if f.name.is_empty() {
                    return Err(Error::Plugin {
                        plugin: plugin.identity().name.clone(),
                        message: "declares a field with no name".into(),
                    });
                }
                cols.push(slot(&f.name));
            }
            columns.push(cols);
        }
        if names.len() > MAX_FIELDS {
            return Err(Error::Pipeline {
                path: pipeline.file.clone(),
                message: format!("the job reads {} fields; at most {MAX_FIELDS}", names.len()),
            });
        }
        let decoder = Decoder {
            projection: Projection::new(&names),
            names,
            time_slot,
            time_range: (pipeline.event_time.min_ms, pipeline.event_time.max_ms),
            filters,
            key_slots,
            partition_slot,
        };
        Ok((decoder, columns))
    }

    fn missing(&self, slot: usize) -> Reject {
        Reject::Dead(format!("missing field `{}`", self.names[slot]))
    }

    fn wrong(&self, slot: usize, want: &str, got: &Scalar) -> Reject {
        Reject::Dead(format!("field `{}`: expected {want}, got {}", self.names[slot], got.kind()))
    }

    /// Check the filter and the event time.
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
            Some(Scalar::Int(v)) if (self.time_range.0..self.time_range.1).contains(v) => Ok(*v),
            Some(Scalar::Int(v)) => Err(Reject::Dead(format!(
                "field `{}`: event time {v} is outside the accepted range [{}, {}) epoch ms \
                 (set [event_time] min/max to change it)",
                self.names[t], self.time_range.0, self.time_range.1
            ))),
            Some(Scalar::Number(raw)) => Err(Reject::Dead(format!(
                "field `{}`: timestamp {} is not an integer number of epoch milliseconds",
                self.names[t],
                String::from_utf8_lossy(raw)
            ))),
            Some(other) => Err(self.wrong(t, "integer epoch milliseconds", other)),
            None => Err(self.missing(t)),
        }
    }

    /// Build the encoded key (UTF-8 is checked when a key is first seen: `valid_key`).
    #[inline]
    fn key(&self, slots: &[Option<Scalar>], out: &mut Vec<u8>) -> Result<(), Reject> {
        out.clear();
        for &k in &self.key_slots {
            match &slots[k] {
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

    /// The partition named by the partition field (absent: the "" partition).
    fn partition_name<'a>(&self, slots: &[Option<Scalar<'a>>]) -> Cow<'a, str> {
        match self.partition_slot.and_then(|s| slots[s]) {
            Some(s @ Scalar::Str { .. }) => match s.as_str() {
                Some(Ok(v)) => v,
                _ => Cow::Borrowed(""),
            },
            Some(Scalar::Int(i)) => Cow::Owned(i.to_string()),
            _ => Cow::Borrowed(""),
        }
    }
}

/// The job's loop state.
struct Job {
    decoder: Decoder,
    ops: Vec<WindowOperator>,
    watermarks: Watermarks,
    /// Partitions by field value instead of by file.
    by_field: bool,
    /// Watermark clock of each source partition, when not the same index (Kafka).
    clock_of: Vec<usize>,
    /// Results handed to the sink so far (restored with the state): a result's ordinal
    /// identifies it across a replay.
    results_out: u64,
    read: u64,
    filtered: u64,
    dead_lettered: u64,
    key_buf: Vec<u8>,
    line_buf: Vec<u8>,
    results: Vec<Emitted>,
    /// Input names by partition, for side outputs.
    sources: Vec<String>,
    output: Option<ResultSink>,
    late: Option<JsonlSink>,
    dead: Option<DeadLetterSink>,
    /// Id of the last snapshot taken or restored ("" before the first): the parent of
    /// the next barrier.
    snapshot_id: String,
    /// [`results_fingerprint`] of this run.
    fingerprint: String,
}

#[derive(Serialize)]
struct DeadLetter<'a> {
    reason: &'a str,
    source: &'a str,
    line: u64,
    offset: u64,
    record: Cow<'a, str>,
}

/// A result the sink could not take.
#[derive(Serialize)]
struct ResultDeadLetter<'a> {
    reason: &'a str,
    key: &'a str,
    /// The result's JSON value, as text.
    value: &'a str,
}

/// Events (or a window's result) that a faulty plugin could not take.
#[derive(Serialize)]
struct PluginDeadLetter<'a> {
    reason: &'a str,
    aggregation: &'a str,
    key: &'a str,
    window_start: i64,
    window_end: i64,
    /// Empty when the window's result was rejected.
    event_times: &'a [i64],
}

#[derive(Serialize)]
struct LateEvent<'a> {
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

/// Encode one side-output record (late events, dead letters) into `buf`.
fn encode_side(buf: &mut Vec<u8>, record: &impl Serialize) -> Result<()> {
    buf.clear();
    serde_json::to_writer(&mut *buf, record).map_err(|e| Error::Usage(format!("encode side output: {e}")))
}

impl Job {
    fn new(pipeline: &Pipeline, plugins: Vec<Plugin>) -> Result<Job> {
        // A plugin that reads more key fields than the pipeline's key has is refused now,
        // not on every window.
        for (a, p) in pipeline.aggregations.iter().zip(&plugins) {
            let need = p.key_fields() as usize;
            if need > pipeline.key.len() {
                return Err(Error::Plugin {
                    plugin: format!("{} {}", p.identity().name, p.identity().version),
                    message: format!(
                        "aggregation {:?} reads {need} key fields from every group, but the pipeline's key {:?} has {}",
                        a.name,
                        pipeline.key,
                        pipeline.key.len()
                    ),
                });
            }
        }
        let fingerprint = results_fingerprint(pipeline, &plugins);
        let (decoder, columns) = Decoder::new(pipeline, &plugins)?;
        let prefixed = pipeline.aggregations.len() > 1;
        let ops = pipeline
            .aggregations
            .iter()
            .zip(plugins)
            .zip(columns)
            .map(|((a, plugin), cols)| {
                let key_arity = pipeline.key.len();
                let mut op = WindowOperator::new(
                    &a.name,
                    prefixed,
                    &a.window,
                    plugin,
                    a.plugin.batch_size,
                    key_arity,
                    cols,
                );
                op.set_on_error(a.plugin.on_error);
                op
            })
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
            line_buf: Vec::with_capacity(256),
            results: Vec::new(),
            sources: Vec::new(),
            output: None,
            late: None,
            dead: None,
            snapshot_id: String::new(),
            fingerprint,
        })
    }

    fn counters(&self) -> Counters {
        let mut c = Counters {
            read: self.read,
            filtered: self.filtered,
            dead_lettered: self.dead_lettered,
            ..Counters::default()
        };
        for op in &self.ops {
            let o = op.counters();
            c.accepted += o.accepted;
            c.late += o.late;
            c.late_updates += o.late_updates;
            c.windows_fired += o.windows_fired;
            c.emitted += o.emitted;
            c.retracted += o.retracted;
        }
        c
    }

    /// Process one record.
    #[inline]
    fn on_record(&mut self, record: &[u8], pos: Position) -> Result<()> {
        self.read += 1;
        let mut slots = [None; MAX_FIELDS];
        let slots = &mut slots[..self.decoder.projection.len()];
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
        let partition = if self.by_field {
            let name = self.decoder.partition_name(slots);
            self.watermarks.partition(&name)
        } else {
            self.clock(pos.partition)
        };
        let before = self.watermarks.current();
        let wm = self.watermarks.on_record(partition);
        if wm > before {
            self.advance(wm)?;
        }
        let checked = self
            .decoder
            .event_time(slots)
            .and_then(|t| self.decoder.key(slots, &mut self.key_buf).map(|_| t));
        let t = match checked {
            Ok(t) => t,
            Err(Reject::Filtered) => {
                self.filtered += 1;
                return Ok(());
            }
            Err(Reject::Dead(reason)) => return self.dead_letter(&reason, record, pos),
        };
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
            match self.ops[i].on_event(&self.key_buf, t, wm, slots, &mut self.results)? {
                Verdict::Accepted => {}
                Verdict::Late { window } => self.late_event(i, t, wm, window, record, pos)?,
                // Every operator sees the same key: the first one to meet it decides.
                Verdict::InvalidKey => {
                    return self.dead_letter("a key field is not valid UTF-8", record, pos)
                }
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
    fn check_deliveries(&mut self) -> Result<()> {
        let Some(out) = self.output.as_mut() else { return Ok(()) };
        out.check_deliveries()?;
        let refused = out.take_refused();
        self.dead_letter_results(refused)
    }

    /// Processing time passed with nothing to read: processing-time idleness may move the
    /// watermark.
    fn tick(&mut self) -> Result<()> {
        let before = self.watermarks.current();
        let wm = self.watermarks.tick();
        if wm > before {
            self.advance(wm)?;
            self.write_results()?;
        }
        Ok(())
    }

    /// A partition's input ended: it stops holding the watermark back.
    fn partition_ended(&mut self, p: u32) -> Result<()> {
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
    fn clock(&self, p: u32) -> usize {
        self.clock_of.get(p as usize).copied().unwrap_or(p as usize)
    }

    fn advance(&mut self, wm: i64) -> Result<()> {
        for op in &mut self.ops {
            op.advance(wm, &mut self.results)?;
        }
        Ok(())
    }

    /// Dead-letter what the plugins could not take.
    fn write_rejected(&mut self) -> Result<()> {
        for i in 0..self.ops.len() {
            for r in self.ops[i].take_rejected() {
                self.dead_lettered += r.event_times.len().max(1) as u64;
                let d = PluginDeadLetter {
                    reason: &r.reason,
                    aggregation: self.ops[i].name(),
                    key: &r.key,
                    window_start: r.window.start,
                    window_end: r.window.end,
                    event_times: &r.event_times,
                };
                encode_side(&mut self.line_buf, &d)?;
                // Keyed by what was rejected (aggregation, key, window, first event time or
                // the window's result): distinct rejections never compact onto each other,
                // a replay's copy compacts onto the first.
                let what = r.event_times.first().map_or_else(|| "result".to_string(), |t| t.to_string());
                let origin = [
                    ("km0.aggregation", d.aggregation.to_string()),
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

    fn write_results(&mut self) -> Result<()> {
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
    fn dead_letter_results(&mut self, refused: Vec<(String, String, String)>) -> Result<()> {
        for (key, value, reason) in refused {
            self.dead_lettered += 1;
            let d = ResultDeadLetter { reason: &reason, key: &key, value: &value };
            encode_side(&mut self.line_buf, &d)?;
            let origin = [("km0.result", key.clone())];
            if let Some(dead) = self.dead.as_mut() {
                dead.write(&self.line_buf, value.as_bytes(), &origin, &reason)?;
            }
        }
        Ok(())
    }

    /// Backpressure: the result sink is far behind; stop fetching and wait until it has
    /// caught up (memory stays bounded whatever the backlog in the source).
    fn drain_output(&mut self, source: &mut Source, lag_at: &mut LagReport) -> Result<()> {
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
        source.resume()
    }

    fn dead_letter(&mut self, reason: &str, record: &[u8], pos: Position) -> Result<()> {
        self.dead_letter_for(None, reason, record, pos)
    }

    /// A dead letter for one aggregation (keyed with its name in Kafka, so the dead letters
    /// of one record for several aggregations do not compact onto each other).
    fn dead_letter_for(
        &mut self,
        aggregation: Option<String>,
        reason: &str,
        record: &[u8],
        pos: Position,
    ) -> Result<()> {
        self.dead_lettered += 1;
        let source = self.sources.get(pos.partition as usize).map_or("", String::as_str);
        let Some(dead) = self.dead.as_mut() else { return Ok(()) };
        if dead.wants_json() {
            let d = DeadLetter {
                reason,
                source,
                line: pos.line,
                offset: pos.offset,
                record: String::from_utf8_lossy(record),
            };
            encode_side(&mut self.line_buf, &d)?;
        }
        let mut origin = vec![("km0.source", source.to_string()), ("km0.offset", pos.offset.to_string())];
        if let Some(a) = aggregation {
            origin.push(("km0.aggregation", a));
        }
        dead.write(&self.line_buf, record, &origin, reason)
    }

    fn late_event(
        &mut self,
        op: usize,
        t: i64,
        wm: i64,
        window: Window,
        record: &[u8],
        pos: Position,
    ) -> Result<()> {
        let l = LateEvent {
            reason: "late: past its windows' allowed lateness",
            aggregation: self.ops[op].name(),
            event_time: t,
            watermark: wm,
            window_start: window.start,
            window_end: window.end,
            source: self.sources.get(pos.partition as usize).map_or("", String::as_str),
            line: pos.line,
            offset: pos.offset,
            record: String::from_utf8_lossy(record),
        };
        encode_side(&mut self.line_buf, &l)?;
        if let Some(late) = self.late.as_mut() {
            late.write_line(&self.line_buf)?;
        }
        self.ops[op].count_late();
        Ok(())
    }

    /// Load a savepoint's state into this (fresh) job. Returns the migrations done.
    fn restore(
        &mut self,
        pipeline: &Pipeline,
        sp: &Savepoint,
        upgrade: &Upgrade,
    ) -> Result<Vec<(String, u32, u32)>> {
        let refuse = |m: String| match upgrade {
            Upgrade::Deploy(_) => Error::Deploy(m),
            Upgrade::Resume => Error::Savepoint { path: sp.path.clone(), message: m },
        };
        let meta = &sp.meta;
        if meta.pipeline.fingerprint != pipeline.state_fingerprint() {
            return Err(refuse(format!(
                "was taken from pipeline {:?} with other keys, windows, event-time field or filter; \
                 its state does not fit pipeline {:?}",
                meta.pipeline.name, pipeline.name
            )));
        }
        let mut migrated = Vec::new();
        let mut snapshots = Vec::new();
        for op in &mut self.ops {
            let Some(i) = meta.operators.iter().position(|o| o.id == op.name()) else {
                return Err(refuse(format!("holds no state for aggregation {:?}", op.name())));
            };
            let (saved, mut snap) = (&meta.operators[i], sp.snapshots[i].clone());
            let (old, new) = (&saved.plugin, op.identity().clone());
            if old.name != new.name {
                return Err(refuse(format!(
                    "aggregation {:?}: the savepoint holds state of plugin {:?}; plugin {:?} is different logic",
                    op.name(),
                    old.name,
                    new.name
                )));
            }
            if let Some(bad) =
                snap.slots.iter().find(|s| crate::state::arity_of(&s.key) != Some(pipeline.key.len()))
            {
                let fields: Vec<&str> = crate::state::fields_of(&bad.key).collect();
                return Err(refuse(format!("key {fields:?} does not have {} fields", pipeline.key.len())));
            }
            // Rows held for an ordered plugin are restored into this plugin's columns: they
            // must have its fields' number and types (a plugin whose fields changed cannot
            // take them).
            let fields = &op.plugin().info().fields;
            if let Some(bad) = snap.rows.iter().find(|r| !row_fits(&r.values, fields)) {
                let want: Vec<String> =
                    fields.iter().map(|f| format!("{} ({:?})", f.name, f.type_)).collect();
                return Err(refuse(format!(
                    "aggregation {:?}: the savepoint holds {} rows that plugin {} {} must take in order, with \
                     {} values each (the first: {:?}), but its fields are [{}]: a plugin whose fields change \
                     cannot take them; deploy it from a savepoint taken with no rows held (after the input \
                     ends), or keep its fields",
                    op.name(),
                    snap.rows.len(),
                    new.name,
                    new.version,
                    bad.values.len(),
                    bad.values,
                    want.join(", ")
                )));
            }
            let deploying = matches!(upgrade, Upgrade::Deploy(name) if *name == new.name);
            if deploying {
                op.migrate(old.state_schema, &mut snap).map_err(|e| {
                    Error::Deploy(format!(
                        "{} {} (state schema {}) cannot take the savepoint's state (schema {}): {e}",
                        new.name, new.version, new.state_schema, old.state_schema
                    ))
                })?;
                migrated.push((op.name().to_string(), old.state_schema, new.state_schema));
            } else if old.state_schema != new.state_schema {
                return Err(refuse(format!(
                    "the savepoint's accumulators have state schema {} but {} {} uses schema {}: deploy it with \
                     `km0 deploy PLUGIN.wasm --from-savepoint {}` to migrate",
                    old.state_schema,
                    new.name,
                    new.version,
                    new.state_schema,
                    sp.path.display()
                )));
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
    fn snapshot(&mut self, pipeline: &Pipeline, source: &Source) -> Result<(SavepointMeta, Vec<Snapshot>)> {
        let mut snapshots = Vec::new();
        for op in &mut self.ops {
            snapshots.push(op.snapshot()?);
        }
        let counts = snapshots.iter().map(|s| (s.slots.len() as u64, s.rows.len() as u64)).collect();
        let meta = self.meta(pipeline, source, counts)?;
        Ok((meta, snapshots))
    }

    /// The changes since the last checkpoint, for the incremental (RocksDB) backend, and
    /// the snapshot's metadata.
    fn changes(&mut self, pipeline: &Pipeline, source: &Source) -> Result<(SavepointMeta, Vec<Changes>)> {
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
    fn barrier(&mut self) -> Barrier {
        let id = new_snapshot_id();
        let parent = std::mem::replace(&mut self.snapshot_id, id.clone());
        Barrier { id, parent, fingerprint: self.fingerprint.clone() }
    }

    /// Metadata of a snapshot taken now; the sinks are flushed to the operating system
    /// (the snapshot's writer syncs them before it completes).
    fn meta(
        &mut self,
        pipeline: &Pipeline,
        source: &Source,
        counts: Vec<(u64, u64)>,
    ) -> Result<SavepointMeta> {
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
            .iter()
            .zip(counts)
            .map(|(op, (slots, rows))| OperatorMeta {
                id: op.name().to_string(),
                plugin: op.identity().clone(),
                slots,
                rows,
                counters: op.counters().clone(),
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
        })
    }
}

/// Whether a held row's values fit a plugin's fields (number and types).
fn row_fits(values: &[crate::plugin::batch::Value], fields: &[crate::plugin::Field]) -> bool {
    use crate::plugin::{batch::Value, FieldType};
    values.len() == fields.len()
        && values.iter().zip(fields).all(|(v, f)| {
            matches!(
                (v, f.type_),
                (Value::Int(_), FieldType::Int)
                    | (Value::Float(_), FieldType::Float)
                    | (Value::Text(_), FieldType::Text)
                    | (Value::Bool(_), FieldType::Boolean)
            )
        })
}

/// A random-enough id for a snapshot: time, process and a counter, hashed.
fn new_snapshot_id() -> String {
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
fn results_fingerprint(pipeline: &Pipeline, plugins: &[Plugin]) -> String {
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
fn idleness(pipeline: &Pipeline) -> Idleness {
    let p = pipeline.source.partitioning();
    Idleness {
        timeout: p.idle_timeout_ms.map(|ms| Duration::from_millis(ms as u64)),
        after_records: p.idle_after_records,
    }
}

/// When the consumer lag was last logged, and how often it is.
struct LagReport {
    every: Duration,
    last: Instant,
}

/// Log the consumer lag of a Kafka source when due.
fn report_lag(source: &Source, at: &mut LagReport) {
    if !matches!(source, Source::Kafka(_)) || at.last.elapsed() < at.every {
        return;
    }
    at.last = Instant::now();
    for l in source.cached_lag().into_iter().filter(|l| l.high_watermark >= 0) {
        tracing::info!(
            partition = %l.partition,
            lag = l.lag,
            position = l.position,
            high_watermark = l.high_watermark,
            "consumer lag"
        );
    }
}

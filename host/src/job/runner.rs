//! Opening a job (state restored, source positioned, sinks opened last) and its loop:
//! records, partition ends, checkpoints, backpressure, lag reports, idle ticks; then the
//! savepoint or the end of the input, and the run's summary.

pub(super) use super::checkpoints::SavepointFailed;
use super::checkpoints::{CheckpointStats, Checkpointer};
use super::commands::StopMode;
use super::port::LoopControl;
use super::route::Job;
use super::*;
use crate::source::Framed;

pub(super) fn start(
    pipeline: &Pipeline,
    opts: &RunOptions,
    plugins: Vec<(Plugin, Option<Component>)>,
    restore: Option<Restore>,
    upgrade: Upgrade,
    restore_started: Instant,
) -> Result<Summary> {
    let (plugins, components): (Vec<Plugin>, Vec<Option<Component>>) = plugins.into_iter().unzip();
    let mut job = Job::new(pipeline, plugins)?;
    job.components = components;
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
    // The saved slots are the job's now: only what the savepoint says of the source and
    // sinks is kept (its slots, ~100 MB for ~1M windows, were kept for the whole run).
    let restore = restore.map(|sp| sp.meta);
    let mut source = Source::open(
        &pipeline.source,
        opts.input.as_ref(),
        opts.follow,
        restore.as_ref().map(|meta| &meta.source),
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
                failed_savepoints: Vec::new(),
                synchronous: false,
                history: Default::default(),
            })
        }
        None => None,
    };
    // A deployed component is stored before any checkpoint records it.
    if let Some(c) = &checkpoints {
        for component in job.components.iter().flatten() {
            component.put(&c.spec.dir)?;
        }
    }
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
        |name: &str| restore.as_ref().and_then(|meta| meta.sinks.iter().find(|s| s.name == name).cloned());
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
                snapshot: restore.as_ref().map(|meta| meta.snapshot_id.clone()),
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
    let mut lag_at = LagReport { every: Duration::from_secs(5), last: Instant::now() };
    // The control API: commands taken between records, status published now and then.
    let control = opts.control.clone();
    let mut stop_reply: Option<super::port::StopReply> = None;
    let savepoint_dir = opts.savepoint_dir.clone().unwrap_or_else(|| pipeline.savepoints.clone());
    savepoint::remove_abandoned(&savepoint_dir);
    // The savepoint a stop asked for (written in the loop: one that fails fails the stop,
    // and the job goes on).
    let mut savepoint_path = None;
    let mut savepoint_pause = Duration::ZERO;
    let mut port = control.as_ref().map(|h| LoopControl::new(h.clone(), savepoint_dir.clone(), t0));
    if let crate::pipeline::SourceSpec::Kafka(k) = &pipeline.source {
        lag_at.every = Duration::from_millis(k.lag_interval_ms as u64);
    }
    // Commands are taken every 1024 records and whenever the source has nothing.
    let mut take_commands = false;
    while !stopped {
        if std::mem::take(&mut take_commands) {
            if let Some(port) = port.as_mut() {
                let stop = port.serve(pipeline, &mut job, &mut source, checkpoints.as_mut(), &mut stats)?;
                if let Some((mode, reply)) = stop {
                    if mode == StopMode::Savepoint {
                        match write_savepoint(
                            &mut job,
                            pipeline,
                            &source,
                            checkpoints.as_mut(),
                            &savepoint_dir,
                        ) {
                            Ok((path, pause)) => (savepoint_path, savepoint_pause) = (Some(path), pause),
                            Err(SavepointFailed::Savepoint(e)) => {
                                tracing::warn!(error = %e, "the savepoint of a stop failed; the job goes on");
                                let why = format!("the savepoint failed, so the job goes on: {e}");
                                let _ = reply.send(Err(super::commands::Refused::new(500, why)));
                                continue;
                            }
                            Err(SavepointFailed::Job(e)) => return Err(e),
                        }
                    }
                    stop_reply = Some(reply);
                    match mode {
                        StopMode::Savepoint => stopped = true,
                        StopMode::Drain => break,
                    }
                    continue;
                }
            }
        }
        // A record whose layout the scanner knows is scanned where it lies, in the input
        // ahead, which finds its end too; others are found by their line break first.
        // Records in a row up to the next one after which the loop looks at something
        // (below) go in one call.
        let got = if job.frames() {
            let read = source.records();
            let checkpoint_in = checkpoints.as_ref().and_then(|c| c.records_until_due(read));
            let most = run_length(read, read_before, stop_after, checkpoint_in);
            source.next_records_framed(most, |ahead, pos, most, took| {
                job.on_records_framed(ahead, pos, most, took)
            })?
        } else {
            source.next_record()?.map_or(Framed::End, |(record, pos)| Framed::Record(record, pos))
        };
        match got {
            got @ (Framed::Taken | Framed::Record(..)) => {
                if let Framed::Record(record, pos) = got {
                    job.on_record(record, pos)?;
                }
                for p in source.take_ended() {
                    job.partition_ended(p)?;
                }
                // After the last record of a run, which ends where any of these may apply
                // ([`run_length`]); a signal is looked at after a run (of up to 1024).
                let read = source.records();
                if stop_after.is_some_and(|n| read - read_before >= n) || super::signals::stop_requested() {
                    stopped = true;
                } else if let Some(c) = checkpoints.as_mut().filter(|c| c.due(read)) {
                    if !port.as_ref().is_some_and(LoopControl::holds_checkpoints) {
                        stats.add(c.take(&mut job, pipeline, &mut source)?);
                    }
                }
                if read % 1024 == 0 {
                    if let Some(c) = checkpoints.as_mut() {
                        c.completed(&mut job, &source, false)?;
                    }
                    if job.output.as_ref().is_some_and(ResultSink::behind) {
                        job.drain_output(&mut source, &mut lag_at)?;
                    }
                    job.check_deliveries()?;
                    report_lag(&source, &mut lag_at);
                    take_commands = true;
                }
            }
            Framed::End if follow && super::signals::stop_requested() => stopped = true,
            Framed::End if follow => {
                // Nothing new: checkpoint if due, then wait for input.
                for p in source.take_ended() {
                    job.partition_ended(p)?;
                }
                job.tick()?;
                job.check_deliveries()?;
                report_lag(&source, &mut lag_at);
                take_commands = true;
                if let Some(c) = checkpoints.as_mut() {
                    c.completed(&mut job, &source, false)?;
                    if c.due_by_time() && !port.as_ref().is_some_and(LoopControl::holds_checkpoints) {
                        stats.add(c.take(&mut job, pipeline, &mut source)?);
                    }
                }
                idle_loops = idle_loops.saturating_add(1);
                std::thread::sleep(Duration::from_millis(if idle_loops < 10 { 1 } else { 20 }));
                continue;
            }
            Framed::End => break,
        }
        idle_loops = 0;
    }
    if let Some(c) = checkpoints.as_mut() {
        c.completed(&mut job, &source, true)?;
    }
    if let Some(port) = port.as_mut() {
        port.answer_pending(checkpoints.as_ref(), true);
        port.publish(pipeline, &job, &source, checkpoints.as_ref(), &stats, true);
        port.send_answers();
    }
    // A stop that drains ends like the input: every open window fires below.
    if let Some(handle) = &control {
        handle.set_state(super::commands::JobState::Stopping);
        // Commands that came after the stop are answered now.
        handle.refuse_waiting("the job is stopping");
    }
    let ended = if stopped {
        if savepoint_path.is_none() {
            let (path, pause) =
                write_savepoint(&mut job, pipeline, &source, checkpoints.as_mut(), &savepoint_dir)?;
            savepoint_pause = pause;
            savepoint_path = Some(path);
        }
        Ok(())
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
        Ok::<(), crate::Error>(())
    };
    if let Some(reply) = stop_reply {
        let _ = reply.send(match &ended {
            Ok(()) => Ok(savepoint_path.clone()),
            Err(e) => Err(super::commands::Refused::new(500, e.to_string())),
        });
    }
    ended?;
    if let Some(handle) = &control {
        handle.set_state(super::commands::JobState::Stopped);
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
        backpressure_pauses: job.backpressure.0,
    })
}

/// Records the loop may take in a row (at least one) from `read` on: up to the next
/// multiple of 1024 (commands, checkpoints by time, the sink's backlog, lag), the
/// `checkpoint_in` records before one is due by count, and `stop_after` records since
/// `read_before`. After each of those the loop looks, as it would after every record.
fn run_length(read: u64, read_before: u64, stop_after: Option<u64>, checkpoint_in: Option<u64>) -> u64 {
    let mut most = 1024 - read % 1024;
    if let Some(n) = stop_after {
        most = most.min((read_before + n).saturating_sub(read));
    }
    if let Some(due) = checkpoint_in {
        most = most.min(due);
    }
    most.max(1)
}

/// When the consumer lag was last logged, and how often it is.
pub(super) struct LagReport {
    pub(super) every: Duration,
    pub(super) last: Instant,
}

/// Log the consumer lag of a Kafka source when due.
pub(super) fn report_lag(source: &Source, at: &mut LagReport) {
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

/// Write a savepoint of the job now and wait until it is durable. Returns its path and
/// how long processing stopped.
pub(super) fn write_savepoint(
    job: &mut Job,
    pipeline: &Pipeline,
    source: &Source,
    mut checkpoints: Option<&mut Checkpointer>,
    dir: &Path,
) -> std::result::Result<(PathBuf, Duration), SavepointFailed> {
    let t = Instant::now();
    let (path, writer) = begin_savepoint(job, pipeline, source, checkpoints.as_deref_mut(), dir)?;
    if let Some(w) = writer {
        join_writer(w).map_err(SavepointFailed::Savepoint)?;
    }
    if let Some(c) = checkpoints {
        c.completed(job, source, true).map_err(SavepointFailed::Job)?;
        if let Some(e) = c.savepoint_failure(&path) {
            return Err(SavepointFailed::Savepoint(e));
        }
    }
    Ok((path, t.elapsed()))
}

/// The thread writing a savepoint.
pub(super) type SavepointWriter = std::thread::JoinHandle<Result<()>>;

/// Wait for a savepoint writer.
pub(super) fn join_writer(writer: SavepointWriter) -> Result<()> {
    writer.join().map_err(|_| Error::Usage("the savepoint writer panicked".into())).and_then(|r| r)
}

/// Start a savepoint of the job as it is now (the sinks synced first); processing stops
/// only to capture it. With the RocksDB backend it is incremental, written like the
/// checkpoints (durable once the checkpointer has seen it complete). Otherwise the whole
/// state is captured and written by another thread, whose handle is returned; when the
/// sink commits once a snapshot is durable (a Kafka transaction) it is written here and
/// the sink commits what it covers.
pub(super) fn begin_savepoint(
    job: &mut Job,
    pipeline: &Pipeline,
    source: &Source,
    checkpoints: Option<&mut Checkpointer>,
    dir: &Path,
) -> std::result::Result<(PathBuf, Option<SavepointWriter>), SavepointFailed> {
    let path = savepoint_path(dir, source.records());
    if let Some(c) = checkpoints {
        if c.savepoint(job, pipeline, source, &path).map_err(SavepointFailed::Job)? {
            return Ok((path, None));
        }
    }
    // Capturing reads the state and changes nothing: a failure fails this savepoint only.
    let (meta, snapshots) = job.snapshot(pipeline, source).map_err(SavepointFailed::Savepoint)?;
    let components: Vec<Component> = job.components.iter().flatten().cloned().collect();
    if job.output.as_ref().is_some_and(ResultSink::commits_on_completion) {
        write_savepoint_files(&path, meta, &snapshots, &components).map_err(SavepointFailed::Savepoint)?;
        if let Some(out) = job.output.as_mut() {
            out.checkpoint_complete().map_err(SavepointFailed::Job)?;
        }
        return Ok((path, None));
    }
    let to = path.clone();
    let writer = std::thread::Builder::new()
        .name("km0-savepoint".into())
        .spawn(move || write_savepoint_files(&to, meta, &snapshots, &components))
        .map_err(|e| SavepointFailed::Savepoint(Error::io("start the savepoint writer", &path, e)))?;
    Ok((path, Some(writer)))
}

/// A new savepoint's folder in `dir`, named by the records read.
fn savepoint_path(dir: &Path, records: u64) -> PathBuf {
    let mut path = dir.join(format!("savepoint-{records:012}"));
    // Two savepoints at the same record (on demand, then at a stop) get their own folders.
    let mut n = 1;
    while path.exists() {
        n += 1;
        path = dir.join(format!("savepoint-{records:012}-{n}"));
    }
    path
}

/// Make the sinks durable to the snapshot's positions, then write the savepoint (any
/// thread).
fn write_savepoint_files(
    path: &Path,
    meta: SavepointMeta,
    snapshots: &[Capture],
    components: &[Component],
) -> Result<()> {
    meta.sinks.iter().try_for_each(crate::sink::sync)?;
    // Fault injection for the tests: a rollback savepoint that takes this long to write.
    if let Some(ms) = std::env::var("KM0_FAULT_SLOW_SAVEPOINT_MS").ok().and_then(|v| v.parse().ok()) {
        std::thread::sleep(Duration::from_millis(ms));
    }
    savepoint::write_with(path, meta, snapshots, components)?;
    tracing::info!(path = %path.display(), "savepoint written");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::run_length;

    #[test]
    fn a_run_of_records_ends_where_the_loop_must_look() {
        // Counted by hand: the next multiple of 1024, then the other bounds.
        assert_eq!(run_length(0, 0, None, None), 1024);
        assert_eq!(run_length(1000, 0, None, None), 24);
        assert_eq!(run_length(1023, 0, None, None), 1);
        assert_eq!(run_length(2048, 0, None, None), 1024);
        // `--stop-after 10` from record 5 000: 10 records, then the stop.
        assert_eq!(run_length(5000, 5000, Some(10), None), 10);
        assert_eq!(run_length(5007, 5000, Some(10), None), 3);
        // A checkpoint due in 7 records; one due now still lets a record through (the
        // loop looks after it).
        assert_eq!(run_length(100, 0, None, Some(7)), 7);
        assert_eq!(run_length(100, 0, Some(1000), Some(0)), 1);
        // The nearest bound wins.
        assert_eq!(run_length(1020, 1000, Some(30), Some(2)), 2);
        assert_eq!(run_length(1020, 1000, Some(30), Some(9)), 4);
    }
}

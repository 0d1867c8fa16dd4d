//! Periodic checkpoints of a running job: captured between two records on the job's
//! thread, written by a background thread, one at a time.

use super::engine::Engine;
use crate::checkpoint::components::Component;
use crate::checkpoint::store::{Checkpoints, SnapshotStore};
use crate::checkpoint::{savepoint, store, SavepointMeta};
use crate::pipeline::{CheckpointSpec, Pipeline};
use crate::sink::ResultSink;
use crate::source::{Source, SourcePosition};
use crate::state::rocks::RocksState;
use crate::window::operator::Capture;
use crate::{metrics, Error, Result};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Pauses of the checkpoints of a run.
#[derive(Default)]
pub(super) struct CheckpointStats {
    pub(super) count: u64,
    pub(super) max: Duration,
    pub(super) total: Duration,
}

impl CheckpointStats {
    pub(super) fn add(&mut self, pause: Duration) {
        self.count += 1;
        self.max = self.max.max(pause);
        self.total += pause;
    }
}

/// Why a savepoint (or a checkpoint) was not written.
#[derive(Debug)]
pub(super) enum SavepointFailed {
    /// This savepoint could not be written (an unwritable folder, say): nothing of it is
    /// kept, and the job's state is whole, so the job can go on.
    Savepoint(Error),
    /// The job cannot go on (a checkpoint failed, or its state's copy could not be kept).
    Job(Error),
}

impl From<SavepointFailed> for Error {
    fn from(f: SavepointFailed) -> Error {
        match f {
            SavepointFailed::Savepoint(e) | SavepointFailed::Job(e) => e,
        }
    }
}

/// A snapshot's writer thread: the bytes it wrote.
type Writer = std::thread::JoinHandle<std::result::Result<u64, SavepointFailed>>;

/// What a snapshot being written is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Written {
    Checkpoint(u64),
    /// A savepoint (RocksDB backend) written like a checkpoint, at this path.
    Savepoint(PathBuf),
}

/// Takes periodic checkpoints into a store. Processing stops only to capture the
/// snapshot; encoding, hashing and writing it happen on a background thread, one
/// checkpoint at a time.
pub(super) struct Checkpointer {
    pub(super) spec: CheckpointSpec,
    pub(super) store: Checkpoints,
    /// The RocksDB copy of the state, with the RocksDB backend.
    pub(super) rocks: Option<std::sync::Arc<RocksState>>,
    pub(super) next: u64,
    pub(super) last: Instant,
    pub(super) records_at_last: u64,
    /// The snapshot being written: a checkpoint (its number) or a savepoint, and the
    /// source position it holds.
    pub(super) writing: Option<(Writer, Written, SourcePosition)>,
    /// Savepoints written like checkpoints that failed, until their caller asks.
    pub(super) failed_savepoints: Vec<(PathBuf, Error)>,
    /// Wait for every checkpoint before going on (the sink commits at completion).
    pub(super) synchronous: bool,
    /// The newest checkpoints of this run, for the control API.
    pub(super) history: std::collections::VecDeque<(super::commands::CheckpointInfo, Instant)>,
    /// The generation of the task's owners this process claimed in the shared store.
    pub(super) generation: Option<u64>,
}

impl Checkpointer {
    /// Checked after every record: by record count exactly, by time every 1024 records.
    #[inline]
    pub(super) fn due(&self, records: u64) -> bool {
        if self.spec.every_records.is_some_and(|n| records - self.records_at_last >= n) {
            return true;
        }
        records % 1024 == 0 && self.due_by_time()
    }

    /// Records from `records` on until a checkpoint is due by record count (None: none is
    /// counted): the loop takes no more in a row (`running::run_length`).
    pub(super) fn records_until_due(&self, records: u64) -> Option<u64> {
        self.spec.every_records.map(|n| (self.records_at_last + n).saturating_sub(records))
    }

    pub(super) fn due_by_time(&self) -> bool {
        self.last.elapsed() >= Duration::from_millis(self.spec.interval_ms as u64)
    }

    /// Take a checkpoint; returns how long processing stopped for it.
    pub(super) fn take(
        &mut self,
        job: &mut Engine,
        pipeline: &Pipeline,
        source: &mut Source,
    ) -> Result<Duration> {
        self.completed(job, source, true)?;
        let t = Instant::now();
        let (store, n, retain) = (self.store.clone(), self.next, self.spec.retain);
        let position = source.position();
        let writer = match &self.rocks {
            None => {
                let (meta, snapshots) = job.snapshot(pipeline, source)?;
                spawn_writer(move || {
                    let t = Instant::now();
                    // The sinks' data must be durable before the checkpoint that commits it.
                    meta.sinks.iter().try_for_each(crate::sink::sync)?;
                    let name = store.write(n, meta, &snapshots)?;
                    let bytes = folder_bytes(&store.path(n));
                    store::prune(&store, retain)?;
                    tracing::debug!(checkpoint = %name, write_ms = t.elapsed().as_millis() as u64, "checkpoint complete");
                    Ok(bytes)
                })
            }
            Some(rocks) => {
                let (meta, changes) = job.changes(pipeline, source)?;
                let rocks = rocks.clone();
                spawn_writer(move || {
                    let t = Instant::now();
                    meta.sinks.iter().try_for_each(crate::sink::sync)?;
                    savepoint::write_external(&store.path(n), meta, "rocksdb", |dir| {
                        rocks.apply_and_checkpoint(&changes, dir)
                    })?;
                    store.publish(n)?;
                    let bytes = folder_bytes(&store.path(n));
                    store::prune(&store, retain)?;
                    tracing::debug!(
                        checkpoint = n,
                        write_ms = t.elapsed().as_millis() as u64,
                        "checkpoint complete"
                    );
                    Ok(bytes)
                })
            }
        };
        self.writing = Some((writer, Written::Checkpoint(n), position));
        let info = super::commands::CheckpointInfo {
            id: format!("chk-{n:06}"),
            taken_at_ms: metrics::now_ms(),
            pause_ms: t.elapsed().as_secs_f64() * 1e3,
            write_ms: None,
            bytes: None,
            status: super::commands::CheckpointStatus::Writing,
        };
        if self.history.len() == super::commands::CHECKPOINT_HISTORY {
            self.history.pop_front();
        }
        self.history.push_back((info, t));
        if self.synchronous {
            self.completed(job, source, true)?;
        }
        let pause = t.elapsed();
        if let Some((info, _)) = self.history.back_mut() {
            info.pause_ms = pause.as_secs_f64() * 1e3;
        }
        self.next += 1;
        self.last = Instant::now();
        self.records_at_last = source.records();
        Ok(pause)
    }

    /// If the checkpoint being written is complete (with `wait`, once it is), tell the
    /// source (Kafka commits the offsets to its group) and the sink (a transactional sink
    /// commits the epoch).
    pub(super) fn completed(&mut self, job: &mut Engine, source: &Source, wait: bool) -> Result<()> {
        let done = self.writing.as_ref().is_some_and(|(h, _, _)| wait || h.is_finished());
        if !done {
            return Ok(());
        }
        let Some((h, what, position)) = self.writing.take() else { return Ok(()) };
        let written = match h.join() {
            Ok(Err(SavepointFailed::Savepoint(e))) => {
                // Only a savepoint fails alone; its caller is told (`savepoint_failure`).
                if let Written::Savepoint(path) = what {
                    tracing::warn!(path = %path.display(), error = %e, "savepoint failed; the job goes on");
                    self.failed_savepoints.push((path, e));
                    return Ok(());
                }
                Err(e)
            }
            Ok(Err(SavepointFailed::Job(e))) => Err(e),
            Ok(Ok(bytes)) => Ok(bytes),
            Err(_) => Err(Error::Usage("the checkpoint writer panicked".into())),
        };
        if let Written::Checkpoint(n) = what {
            if let Some((info, taken)) =
                self.history.iter_mut().rev().find(|(i, _)| i.id == format!("chk-{n:06}"))
            {
                info.status = if written.is_ok() {
                    super::commands::CheckpointStatus::Complete
                } else {
                    super::commands::CheckpointStatus::Failed
                };
                info.write_ms = Some(taken.elapsed().as_secs_f64() * 1e3);
                info.bytes = written.as_ref().ok().copied();
            }
        }
        written?;
        source.checkpoint_complete(&position);
        if let Some(out) = job.output.as_mut() {
            out.checkpoint_complete()?;
            if let (true, Written::Checkpoint(n)) = (out.commits_on_completion(), what) {
                self.store.mark_committed(n)?;
            }
        }
        Ok(())
    }

    /// Start writing a savepoint at `path` the way this job's checkpoints are written,
    /// when that is incremental (the RocksDB backend): the changes since the last
    /// checkpoint are applied to the RocksDB copy of the state and a RocksDB checkpoint of
    /// it goes into the savepoint, so processing stops only to collect the changes. False
    /// with the memory backend (the caller captures the whole state). The savepoint is
    /// durable once [`Checkpointer::completed`] has seen it.
    pub(super) fn savepoint(
        &mut self,
        job: &mut Engine,
        pipeline: &Pipeline,
        source: &Source,
        path: &Path,
    ) -> Result<bool> {
        let Some(rocks) = self.rocks.clone() else { return Ok(false) };
        self.completed(job, source, true)?;
        let (meta, changes) = job.changes(pipeline, source)?;
        let components: Vec<Component> = job.components.iter().flatten().cloned().collect();
        let to = path.to_path_buf();
        let writer = std::thread::spawn(move || {
            // The changes go into the state's copy first: whatever becomes of the
            // savepoint's folder, the next checkpoint builds on them.
            rocks.apply(&changes).map_err(SavepointFailed::Job)?;
            let written = meta.sinks.iter().try_for_each(crate::sink::sync).and_then(|()| {
                savepoint::write_external_with(&to, meta, "rocksdb", &components, |dir| rocks.checkpoint(dir))
            });
            written.map_err(SavepointFailed::Savepoint)?;
            tracing::info!(path = %to.display(), "savepoint written");
            Ok(folder_bytes(&to))
        });
        self.writing = Some((writer, Written::Savepoint(path.to_path_buf()), source.position()));
        if self.synchronous {
            self.completed(job, source, true)?;
        }
        Ok(true)
    }

    /// Why the savepoint at `path`, written like a checkpoint, failed (once it is
    /// complete, [`Checkpointer::completed`]).
    pub(super) fn savepoint_failure(&mut self, path: &Path) -> Option<Error> {
        let i = self.failed_savepoints.iter().position(|(p, _)| p == path)?;
        Some(self.failed_savepoints.remove(i).1)
    }
}

/// A checkpoint's writer: any failure of a checkpoint fails the job.
fn spawn_writer(write: impl FnOnce() -> Result<u64> + Send + 'static) -> Writer {
    std::thread::spawn(move || write().map_err(SavepointFailed::Job))
}

/// Bytes of the files in a snapshot's folder (its subfolders included; RocksDB's files are
/// hard links shared with other checkpoints).
fn folder_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => folder_bytes(&e.path()),
            _ => e.metadata().map_or(0, |m| m.len()),
        })
        .sum()
}

/// Write a savepoint of the job now and wait until it is durable. Returns its path and
/// how long processing stopped.
pub(super) fn write_savepoint(
    job: &mut Engine,
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
    job: &mut Engine,
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

/// A new savepoint's folder in `dir`: named by the records read, made unique by a
/// number when that name is taken (on disk, or by a savepoint of this process still being
/// written: two savepoints at one record, say a deploy's rollback point and a stop, never
/// share a folder or its temporary one).
pub(super) fn savepoint_path(dir: &Path, records: u64) -> PathBuf {
    static GIVEN: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    // Names given out and written since are on disk: only those being written are kept.
    given.retain(|p| !p.exists());
    let base = dir.join(format!("savepoint-{records:012}"));
    let mut path = base.clone();
    let mut n = 1;
    while path.exists() || given.contains(&path) {
        n += 1;
        path = dir.join(format!("savepoint-{records:012}-{n}"));
    }
    given.push(path.clone());
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

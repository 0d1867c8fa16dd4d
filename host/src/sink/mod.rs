//! Sinks: where results, late events and dead letters go.
//!
//! The embedded default writes JSON lines. A file sink knows how many bytes it has
//! committed (flushed at a savepoint); resuming from that savepoint truncates the file
//! back to that length before appending, so a resumed run never duplicates or loses a
//! line, whatever the stopped run wrote after its savepoint. [`kafka`] writes results
//! and dead letters to Kafka topics, [`postgres`] upserts results into a table.
//!
//! Every sink takes part in checkpoints the same way: at the barrier
//! ([`ResultSink::position`]) it makes what it was given durable or acknowledged and says
//! how far that is; when the checkpoint is durable ([`ResultSink::checkpoint_complete`])
//! a transactional sink commits.

pub mod kafka;
pub(crate) mod line;
pub mod postgres;

use crate::pipeline::{DeadLetterSpec, Pipeline, SinkSpec};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// How much of a file sink is committed, recorded in savepoints.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SinkPosition {
    pub name: String,
    pub path: PathBuf,
    pub committed_bytes: u64,
}

enum Target {
    File { path: PathBuf, w: BufWriter<File> },
    Stdout(BufWriter<std::io::Stdout>),
}

/// A JSON-lines sink.
pub struct JsonlSink {
    name: &'static str,
    target: Target,
    written: u64,
}

impl JsonlSink {
    /// A new, empty file (truncating an old one).
    pub fn create(name: &'static str, path: &Path) -> Result<JsonlSink> {
        ensure_parent(path)?;
        let f = File::create(path).map_err(|e| Error::io("create", path, e))?;
        Ok(JsonlSink {
            name,
            target: Target::File { path: path.into(), w: BufWriter::with_capacity(1 << 20, f) },
            written: 0,
        })
    }

    /// Reopen a file at its committed length, dropping anything written after it.
    pub fn resume(name: &'static str, path: &Path, committed: u64) -> Result<JsonlSink> {
        ensure_parent(path)?;
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(|e| Error::io("open", path, e))?;
        let len = f.metadata().map_err(|e| Error::io("stat", path, e))?.len();
        if len < committed {
            return Err(Error::Usage(format!(
                "{name} file {} has {len} bytes, fewer than the {committed} the savepoint committed: it was changed since",
                path.display()
            )));
        }
        f.set_len(committed).map_err(|e| Error::io("truncate", path, e))?;
        f.seek(SeekFrom::Start(committed)).map_err(|e| Error::io("seek", path, e))?;
        Ok(JsonlSink {
            name,
            target: Target::File { path: path.into(), w: BufWriter::with_capacity(1 << 20, f) },
            written: committed,
        })
    }

    /// Open for a run: resume at the savepoint's position when it names the same file
    /// (however its path is spelled), start a new file otherwise. A resumed job that
    /// writes to another file than its savepoint's says so, and refuses to overwrite a
    /// file that already holds lines.
    pub fn open(name: &'static str, path: &Path, resume_from: Option<&SinkPosition>) -> Result<JsonlSink> {
        match resume_from {
            Some(p) if same_file(&p.path, path) => Self::resume(name, path, p.committed_bytes),
            Some(p) => {
                if std::fs::metadata(path).is_ok_and(|m| m.len() > 0) {
                    return Err(Error::Usage(format!(
                        "the savepoint's {name} file is {}, but this run writes {}, which already holds \
                         output: it would be overwritten. Write to the savepoint's file, or to a new or \
                         empty one",
                        p.path.display(),
                        path.display()
                    )));
                }
                tracing::warn!(
                    sink = name,
                    savepoint_file = %p.path.display(),
                    file = %path.display(),
                    "resuming into another file: what came before the savepoint stays in the savepoint's file"
                );
                Self::create(name, path)
            }
            None => Self::create(name, path),
        }
    }

    /// [`Self::open`] for a task of a job shared with a consumer group, whose checkpoint
    /// may name another process's file: this process's own is then appended to (it holds
    /// what the task wrote while this process owned it before). Across processes, files
    /// hold each result at least once: a task's results between its last checkpoint and a
    /// crash stay in the crashed process's file.
    pub fn open_in_group(
        name: &'static str,
        path: &Path,
        resume_from: Option<&SinkPosition>,
    ) -> Result<JsonlSink> {
        match resume_from {
            Some(p) if !same_file(&p.path, path) => {
                let len = std::fs::metadata(path).map_or(0, |m| m.len());
                Self::resume(name, path, len)
            }
            _ => Self::open(name, path, resume_from),
        }
    }

    pub fn stdout(name: &'static str) -> JsonlSink {
        JsonlSink { name, target: Target::Stdout(BufWriter::new(std::io::stdout())), written: 0 }
    }

    /// Write one line (a newline is added).
    #[inline]
    pub fn write_line(&mut self, line: &[u8]) -> Result<()> {
        let r = match &mut self.target {
            Target::File { w, .. } => w.write_all(line).and_then(|_| w.write_all(b"\n")),
            Target::Stdout(w) => w.write_all(line).and_then(|_| w.write_all(b"\n")),
        };
        r.map_err(|e| self.error("write", e))?;
        self.written += line.len() as u64 + 1;
        Ok(())
    }

    /// Flush everything written so far to the operating system.
    pub fn flush(&mut self) -> Result<()> {
        let r = match &mut self.target {
            Target::File { w, .. } => w.flush(),
            Target::Stdout(w) => w.flush(),
        };
        r.map_err(|e| self.error("flush", e))
    }

    /// Flush and make durable; returns the committed position (None for stdout).
    pub fn commit(&mut self) -> Result<Option<SinkPosition>> {
        let pos = self.position()?;
        if let Some(p) = &pos {
            sync(p)?;
        }
        Ok(pos)
    }

    /// Flush to the operating system and return the position to commit; [`sync`] makes
    /// it durable (a checkpoint does that off the processing thread).
    pub fn position(&mut self) -> Result<Option<SinkPosition>> {
        self.flush()?;
        match &self.target {
            Target::File { path, .. } => Ok(Some(SinkPosition {
                name: self.name.into(),
                path: path.clone(),
                committed_bytes: self.written,
            })),
            Target::Stdout(_) => Ok(None),
        }
    }

    fn error(&self, action: &'static str, e: std::io::Error) -> Error {
        match &self.target {
            Target::File { path, .. } => Error::io(action, path.clone(), e),
            Target::Stdout(_) => Error::io(action, "<stdout>", e),
        }
    }
}

/// Dead letters have nowhere else to go: one the broker refused fails the job (it is
/// retried from the last checkpoint) rather than being lost.
fn dead_letters_delivered(s: &mut kafka::KafkaSink) -> Result<()> {
    match s.take_refused().into_iter().next() {
        None => Ok(()),
        Some((_, _, reason)) => {
            Err(Error::Usage(format!("the dead-letter topic refused a dead letter: {reason}")))
        }
    }
}

/// Whether two paths name the same file: the same canonical path (links, `.` and `..`
/// resolved), or for a file that does not exist yet, the same canonical folder and name.
pub fn same_file(a: &Path, b: &Path) -> bool {
    fn canonical(p: &Path) -> Option<PathBuf> {
        if let Ok(c) = std::fs::canonicalize(p) {
            return Some(c);
        }
        let parent = p.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        Some(std::fs::canonicalize(parent).ok()?.join(p.file_name()?))
    }
    a == b || matches!((canonical(a), canonical(b)), (Some(x), Some(y)) if x == y)
}

/// Where a result sink stood at a snapshot, to take it back there ([`rewind`]): a live
/// deploy's rollback point.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RewindPoint {
    /// The snapshot's id (the barrier a PostgreSQL sink committed an epoch at).
    pub snapshot: String,
    /// A Kafka topic's end offsets then, per partition.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kafka_ends: Vec<(i32, i64)>,
}

/// Take the result sink `spec` of job `job` back to `point` (the run that goes on from the
/// snapshot there writes what came after it again): a PostgreSQL table drops the epochs
/// after the snapshot's and the rows they wrote, a Kafka topic tombstones the keys
/// written after its end offsets then. A file is truncated when the run opens it from
/// the snapshot's position, as on any resume.
pub fn rewind(spec: &crate::pipeline::SinkSpec, job: &str, point: &RewindPoint) -> Result<()> {
    use crate::pipeline::{KafkaSinkMode, SinkSpec};
    match spec {
        SinkSpec::Postgres { url, table } => postgres::rewind(url, table, job, &point.snapshot).map(drop),
        SinkSpec::Kafka { target, mode: KafkaSinkMode::Upsert, .. } => {
            kafka::rewind(target, &point.kafka_ends).map(drop)
        }
        // A transaction per epoch: what the rolled-back run committed stays committed (a
        // reader of the topic sees it); the run that goes on writes its own results after.
        SinkSpec::Kafka { .. } | SinkSpec::File { .. } | SinkSpec::Stdout => Ok(()),
    }
}

/// Fence the result sink `spec` of job `job` for the owner of checkpoint generation
/// `generation` (a task of a job shared with a consumer group, taken over): a PostgreSQL
/// table refuses the commits of older owners from now on. Other sinks fence when they
/// open (Kafka's producer ids) or need no fence (files are the process's own).
pub fn fence(spec: &SinkSpec, job: &str, generation: u64) -> Result<()> {
    match spec {
        SinkSpec::Postgres { url, table } => postgres::fence(url, table, job, generation),
        SinkSpec::Kafka { .. } | SinkSpec::File { .. } | SinkSpec::Stdout => Ok(()),
    }
}

/// Where results go. (One per job; boxing the larger variants would add a load to every
/// result written.)
#[allow(clippy::large_enum_variant)]
pub enum ResultSink {
    Jsonl(JsonlSink),
    Kafka(kafka::KafkaSink),
    Postgres(postgres::PostgresSink),
}

impl ResultSink {
    /// Write one result: its key (`window_start|key fields`) and its JSON value.
    /// `ordinal` numbers the job's results from 1 (the same result has the same ordinal
    /// in a replay).
    #[inline]
    /// A `None` value retracts the key: a `null` value in JSON lines, a tombstone in
    /// Kafka, a deleted row in PostgreSQL.
    pub fn write(&mut self, key: &str, value: Option<&str>, ordinal: u64, line: &mut Vec<u8>) -> Result<()> {
        match self {
            ResultSink::Jsonl(s) => {
                line.clear();
                line.extend_from_slice(b"{\"key\":");
                line::push_json_str(line, key);
                line.extend_from_slice(b",\"value\":");
                line.extend_from_slice(value.unwrap_or("null").as_bytes());
                line.push(b'}');
                s.write_line(line)
            }
            ResultSink::Kafka(s) => s.send(Some(key.as_bytes()), value.map(str::as_bytes), None),
            ResultSink::Postgres(s) => s.write(key, value, ordinal),
        }
    }

    /// Why this sink cannot take a result, if it cannot (the job dead-letters it with the
    /// reason instead of failing on it, now and at every replay).
    pub fn refuses(&self, key: &str, value: Option<&str>) -> Option<String> {
        match self {
            ResultSink::Jsonl(_) => None,
            ResultSink::Kafka(s) => s.refuses(key.as_bytes(), value.unwrap_or_default().as_bytes()),
            ResultSink::Postgres(_) => postgres::refuses(key, value),
        }
    }

    /// Fail if a delivery failed for a reason that affects everything (Kafka), without
    /// waiting for anything in flight.
    pub fn check_deliveries(&self) -> Result<()> {
        match self {
            ResultSink::Kafka(s) => s.check_failures(),
            _ => Ok(()),
        }
    }

    /// Results the target refused after taking them (Kafka, record by record): key,
    /// value and reason, for the dead-letter output.
    pub fn take_refused(&mut self) -> Vec<(String, String, String)> {
        match self {
            ResultSink::Kafka(s) => s
                .take_refused()
                .into_iter()
                .map(|(k, v, r)| {
                    (String::from_utf8_lossy(&k).into_owned(), String::from_utf8_lossy(&v).into_owned(), r)
                })
                .collect(),
            _ => Vec::new(),
        }
    }

    /// The checkpoint barrier: everything written so far (up to result `ordinal`) is
    /// flushed (file), acknowledged (Kafka) or committed with the job's progress
    /// (PostgreSQL).
    pub fn position(&mut self, ordinal: u64, barrier: &postgres::Barrier) -> Result<Option<SinkPosition>> {
        match self {
            ResultSink::Jsonl(s) => s.position(),
            ResultSink::Kafka(s) => s.barrier().map(|_| None),
            ResultSink::Postgres(s) => s.commit(ordinal, barrier).map(|_| None),
        }
    }

    /// Make what was sent so far acknowledged (a Kafka topic's producer flushed), without
    /// committing anything: before a rollback, so that what the rolled-back run wrote is
    /// all in the topic when the rewind reads it back (a producer dropped with records
    /// queued could deliver some after the rewind).
    pub fn settle(&mut self) -> Result<()> {
        match self {
            ResultSink::Kafka(s) => s.barrier(),
            ResultSink::Jsonl(_) | ResultSink::Postgres(_) => Ok(()),
        }
    }

    /// Where this sink stands now, just after the barrier of snapshot `snapshot`: the
    /// point a rollback takes it back to.
    pub fn rewind_point(&self, snapshot: &str) -> Result<RewindPoint> {
        let kafka_ends = match self {
            ResultSink::Kafka(s) => s.ends()?,
            _ => Vec::new(),
        };
        Ok(RewindPoint { snapshot: snapshot.to_string(), kafka_ends })
    }

    /// True when a checkpoint must be durable before processing goes on, because the
    /// sink commits at its completion (a Kafka transaction per epoch).
    pub fn commits_on_completion(&self) -> bool {
        matches!(self, ResultSink::Kafka(s) if s.transactional())
    }

    /// The checkpoint taken at the last barrier is durable.
    pub fn checkpoint_complete(&mut self) -> Result<()> {
        match self {
            ResultSink::Kafka(s) => s.commit_epoch(),
            _ => Ok(()),
        }
    }

    /// End of a bounded run: make everything durable.
    pub fn commit(&mut self, ordinal: u64, barrier: &postgres::Barrier) -> Result<Option<SinkPosition>> {
        match self {
            ResultSink::Jsonl(s) => s.commit(),
            ResultSink::Kafka(s) => s.barrier().and_then(|_| s.commit_epoch()).map(|_| None),
            ResultSink::Postgres(s) => s.commit(ordinal, barrier).map(|_| None),
        }
    }

    /// The sink is far behind (Kafka: too many unacknowledged records): backpressure.
    /// Records sent and not yet acknowledged (Kafka; none for the other sinks).
    pub fn in_flight(&self) -> Option<usize> {
        match self {
            ResultSink::Kafka(s) => Some(s.in_flight()),
            _ => None,
        }
    }

    pub fn behind(&self) -> bool {
        matches!(self, ResultSink::Kafka(s) if s.behind())
    }

    /// The sink has caught up enough for the source to go on.
    pub fn caught_up(&self) -> bool {
        match self {
            ResultSink::Kafka(s) => s.caught_up(),
            _ => true,
        }
    }
}

/// Where dead letters go: a JSONL file (the reason and the record in one JSON object) or
/// a Kafka topic (the original bytes as the value, the reason and origin in headers).
pub enum DeadLetterSink {
    Jsonl(JsonlSink),
    Kafka(kafka::KafkaSink),
}

impl DeadLetterSink {
    /// A record that could not be processed. `json` is the JSONL form; `original` and
    /// `headers` the Kafka form.
    pub fn write(
        &mut self,
        json: &[u8],
        original: &[u8],
        headers: &[(&str, String)],
        reason: &str,
    ) -> Result<()> {
        match self {
            DeadLetterSink::Jsonl(s) => s.write_line(json),
            DeadLetterSink::Kafka(s) => {
                // Keyed by origin, so a replay's copy of a dead letter compacts onto the first.
                let key: Vec<String> = headers.iter().map(|(_, v)| v.clone()).collect();
                let key = key.join("|");
                // A dead letter too large for the topic keeps its head, and says so.
                let mut headers = headers.to_vec();
                let mut value = original;
                if s.refuses(key.as_bytes(), original).is_some() {
                    let keep = s.max_message_bytes() / 2;
                    headers.push(("km0.truncated_from", original.len().to_string()));
                    value = &original[..keep.min(original.len())];
                }
                s.send(Some(key.as_bytes()), Some(value), Some(kafka::dead_letter_headers(reason, &headers)))
            }
        }
    }

    pub fn position(&mut self) -> Result<Option<SinkPosition>> {
        match self {
            DeadLetterSink::Jsonl(s) => s.position(),
            DeadLetterSink::Kafka(s) => s.barrier().and_then(|_| dead_letters_delivered(s)).map(|_| None),
        }
    }

    pub fn commit(&mut self) -> Result<Option<SinkPosition>> {
        match self {
            DeadLetterSink::Jsonl(s) => s.commit(),
            DeadLetterSink::Kafka(s) => s.barrier().and_then(|_| dead_letters_delivered(s)).map(|_| None),
        }
    }

    /// True when the dead letters of a record go as JSONL (and so need the JSON form).
    pub fn wants_json(&self) -> bool {
        matches!(self, DeadLetterSink::Jsonl(_))
    }
}

/// Make a sink's file durable up to (at least) the position's length.
pub fn sync(pos: &SinkPosition) -> Result<()> {
    let f = File::open(&pos.path).map_err(|e| Error::io("open for sync", pos.path.clone(), e))?;
    f.sync_data().map_err(|e| Error::io("sync", pos.path.clone(), e))
}

fn ensure_parent(path: &Path) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| Error::io("create folder", dir, e))?;
    }
    Ok(())
}

/// Where a job's sinks resume, and who writes them.
pub struct SinksAt<'a> {
    /// The positions the snapshot the job resumes from gave them (none: from the start).
    pub positions: &'a [SinkPosition],
    /// That snapshot's id (PostgreSQL ties its epochs to it).
    pub snapshot: Option<String>,
    /// Results the job had written by then, and its results' fingerprint.
    pub ordinal: u64,
    pub fingerprint: String,
    /// The generation of the task's owners this process holds (a job shared with a group).
    pub owner: Option<u64>,
    /// A job in a consumer group: files are written as a member of it writes them.
    pub in_group: bool,
}

/// A job's result, late and dead-letter sinks.
pub struct Sinks {
    pub output: ResultSink,
    pub late: JsonlSink,
    pub dead: DeadLetterSink,
}

impl Sinks {
    /// The sinks of `pipeline` (`output`: a file instead of its result sink), each from
    /// the position `at` gives it.
    pub fn open(pipeline: &Pipeline, output: Option<&Path>, at: SinksAt<'_>) -> Result<Sinks> {
        let position = |name: &str| at.positions.iter().find(|s| s.name == name).cloned();
        // A transactional sink's id is stable per job, so a restart fences its predecessor.
        // Each task of a job has its own (a task is restored alone, by whoever runs it next).
        let txn_id = format!("km0-{}", pipeline.instance_name());
        let file = |name: &'static str, path: &Path| match at.in_group {
            true => JsonlSink::open_in_group(name, path, position(name).as_ref()),
            false => JsonlSink::open(name, path, position(name).as_ref()),
        };
        let output = match (output, &pipeline.sink) {
            (Some(p), _) => ResultSink::Jsonl(file("output", p)?),
            (None, SinkSpec::File { path }) => ResultSink::Jsonl(file("output", path)?),
            (None, SinkSpec::Stdout) => ResultSink::Jsonl(JsonlSink::stdout("output")),
            (None, SinkSpec::Kafka { target, mode, max_in_flight }) => {
                let mut sink = kafka::KafkaSink::open(target, *mode, &txn_id)?;
                sink.set_max_in_flight(*max_in_flight);
                ResultSink::Kafka(sink)
            }
            (None, SinkSpec::Postgres { url, table }) => {
                // A source that cannot read the same records again (Kafka from its latest
                // offsets) cannot replay an epoch.
                let replayable = match &pipeline.source {
                    crate::pipeline::SourceSpec::Kafka(k) => k.start == crate::pipeline::StartAt::Earliest,
                    _ => true,
                };
                let start = postgres::StartPoint {
                    snapshot: at.snapshot.clone(),
                    ordinal: at.ordinal,
                    fingerprint: at.fingerprint.clone(),
                    replayable,
                };
                let name = pipeline.instance_name();
                ResultSink::Postgres(postgres::PostgresSink::open(url, table, &name, &start, at.owner)?)
            }
        };
        let late = file("late", &pipeline.late)?;
        let dead = match &pipeline.dead_letter {
            DeadLetterSpec::File(path) => DeadLetterSink::Jsonl(file("dead_letter", path)?),
            DeadLetterSpec::Kafka(target) => DeadLetterSink::Kafka(kafka::KafkaSink::open(
                target,
                crate::pipeline::KafkaSinkMode::Upsert,
                &txn_id,
            )?),
        };
        Ok(Sinks { output, late, dead })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resume_truncates_to_the_committed_length() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out/alerts.jsonl");
        let mut s = JsonlSink::create("output", &path).unwrap();
        s.write_line(b"{\"a\":1}").unwrap();
        let pos = s.commit().unwrap().unwrap();
        s.write_line(b"{\"a\":2}").unwrap(); // written after the savepoint
        s.flush().unwrap();
        drop(s);
        let mut s = JsonlSink::open("output", &path, Some(&pos)).unwrap();
        s.write_line(b"{\"a\":3}").unwrap();
        s.flush().unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "{\"a\":1}\n{\"a\":3}\n");
        std::fs::write(&path, "").unwrap();
        assert!(JsonlSink::resume("output", &path, pos.committed_bytes).is_err());
    }

    #[test]
    fn a_task_back_in_a_process_of_its_group_appends_to_that_process_file() {
        let dir = tempfile::tempdir().unwrap();
        let (here, there) = (dir.path().join("a/late.jsonl"), dir.path().join("b/late.jsonl"));
        let mut s = JsonlSink::create("late", &here).unwrap();
        s.write_line(b"{\"n\":1}").unwrap();
        s.commit().unwrap();
        drop(s);
        // The task went to another process, checkpointed there, and came back.
        let mut s = JsonlSink::create("late", &there).unwrap();
        s.write_line(b"{\"n\":2}").unwrap();
        let pos = s.commit().unwrap().unwrap();
        drop(s);
        assert!(JsonlSink::open("late", &here, Some(&pos)).is_err(), "alone, it refuses to overwrite");
        let mut s = JsonlSink::open_in_group("late", &here, Some(&pos)).unwrap();
        s.write_line(b"{\"n\":3}").unwrap();
        s.flush().unwrap();
        assert_eq!(std::fs::read_to_string(&here).unwrap(), "{\"n\":1}\n{\"n\":3}\n");
        // Its own file in its checkpoint: resumed at the committed length, as alone.
        let mut s = JsonlSink::open_in_group("late", &there, Some(&pos)).unwrap();
        s.write_line(b"{\"n\":4}").unwrap();
        s.flush().unwrap();
        assert_eq!(std::fs::read_to_string(&there).unwrap(), "{\"n\":2}\n{\"n\":4}\n");
    }
}

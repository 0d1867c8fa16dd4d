//! A job whose partitions are tasks (`[event_time] watermark = "per-partition"`): each
//! source partition (a file of `[source] paths`, a Kafka partition) is a [`RunningJob`] of
//! its own that owns the windows of the keys arriving in it (`[source] partitioned_by`),
//! its position, its event-time clock, its sinks' progress and its checkpoints: Kafka
//! Streams' task model. `--parallelism N` threads run the tasks, each stepping its share
//! in turn. The parallelism is in no snapshot: a job savepoint is one savepoint per task
//! ([`savepoint::write_tasks`]), so it resumes at any parallelism, and a task's state can
//! be restored alone by whoever runs its partition next.
//!
//! What a task writes is its own: file sinks get a file per task (`alerts-task-0.jsonl`),
//! PostgreSQL progress and Kafka transactional ids are per task
//! ([`Pipeline::instance_name`]), checkpoints and RocksDB's working state go to a
//! subfolder per task.

use super::running::RunningJob;
use super::RunOptions;
use crate::checkpoint::savepoint;
use crate::pipeline::{DeadLetterSpec, Pipeline, SinkSpec, WatermarkScope};
use crate::{Error, Result};
use std::path::{Path, PathBuf};

/// Opens a task: a run resumed or fresh, or a deploy from the task's savepoint.
pub(super) type Open<'o> = dyn for<'a> Fn(&'a Pipeline, &RunOptions) -> Result<RunningJob<'a>> + Sync + 'o;

/// One task: its name (its folder in savepoints and checkpoints), its partition, and the
/// job's pipeline narrowed to it.
pub(super) struct Task {
    pub(super) name: String,
    pub(super) partition: String,
    pub(super) pipeline: Pipeline,
}

/// Whether the job's partitions are tasks.
pub(super) fn per_partition(pipeline: &Pipeline) -> bool {
    pipeline.event_time.watermark == WatermarkScope::PerPartition
}

/// A job with the job's watermark runs as one task: more threads than one are refused,
/// and so is the savepoint of a job of several tasks.
pub(super) fn check_one_task(pipeline: &Pipeline, opts: &RunOptions) -> Result<()> {
    if opts.parallelism.is_some_and(|n| n > 1) {
        return Err(Error::Usage(format!(
            "--parallelism {} needs `[event_time] watermark = \"per-partition\"`: with the job's watermark \
             (the minimum over all partitions, the default) pipeline {:?} runs its partitions as one task",
            opts.parallelism.unwrap_or(1),
            pipeline.name
        )));
    }
    Ok(())
}

/// The tasks of a job whose partitions are tasks: a file each (`--input` is one), or a
/// Kafka partition each.
pub(super) fn plan(pipeline: &Pipeline, opts: &RunOptions) -> Result<Vec<Task>> {
    let splits = crate::source::split(&pipeline.source, opts.input.as_deref())?;
    Ok(splits
        .into_iter()
        .map(|s| {
            let name = format!("task-{}", s.name);
            let mut p = task_pipeline(pipeline, &name);
            p.source = s.spec;
            Task { name, partition: s.partition, pipeline: p }
        })
        .collect())
}

/// The job's pipeline as one task runs it: its own files, checkpoints and state folder.
fn task_pipeline(job: &Pipeline, task: &str) -> Pipeline {
    let mut p = job.clone();
    p.task = Some(task.into());
    if let SinkSpec::File { path } = &mut p.sink {
        *path = task_file(path, task);
    }
    p.late = task_file(&p.late, task);
    if let DeadLetterSpec::File(path) = &mut p.dead_letter {
        *path = task_file(path, task);
    }
    if let Some(c) = &mut p.checkpoints {
        c.dir = c.dir.join(task);
        if let Some(r) = &mut c.remote {
            *r = format!("{r}/{task}");
        }
    }
    p.state.dir = p.state.dir.join(task);
    p
}

/// A task's file beside the job's: `out/alerts.jsonl` of `task-1` is
/// `out/alerts-task-1.jsonl` (standard output stays itself).
pub fn task_file(path: &Path, task: &str) -> PathBuf {
    if path == Path::new("-") {
        return path.to_path_buf();
    }
    let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let name = match path.extension() {
        Some(ext) => format!("{stem}-{task}.{}", ext.to_string_lossy()),
        None => format!("{stem}-{task}"),
    };
    path.with_file_name(name)
}

/// Where each task resumes from in the job savepoint `sp`: its folder, or none for a
/// partition the savepoint does not know (new since); tasks whose input had ended are
/// left out of the run.
pub(super) fn task_savepoints(sp: &Path, tasks: &[Task]) -> Result<(Vec<Option<PathBuf>>, Vec<bool>)> {
    let Some(manifest) = savepoint::read_tasks(sp)? else {
        return Err(Error::Savepoint {
            path: sp.to_path_buf(),
            message:
                "is the savepoint of a job that ran as one task (`[event_time] watermark = \"job\"`): its \
                      windows are not kept by partition, so it resumes only with the job's watermark"
                    .into(),
        });
    };
    let entry = |t: &Task| manifest.tasks.iter().find(|e| e.task == t.name);
    let from = tasks.iter().map(|t| entry(t).filter(|e| !e.ended).map(|e| sp.join(&e.task))).collect();
    let ended = tasks.iter().map(|t| entry(t).is_some_and(|e| e.ended)).collect();
    Ok((from, ended))
}

#[cfg(test)]
mod tests {
    use super::task_file;
    use std::path::Path;

    #[test]
    fn a_task_writes_files_of_its_own_beside_the_jobs() {
        assert_eq!(task_file(Path::new("out/alerts.jsonl"), "task-1"), Path::new("out/alerts-task-1.jsonl"));
        assert_eq!(task_file(Path::new("/x/late"), "task-0"), Path::new("/x/late-task-0"));
        assert_eq!(task_file(Path::new("a.b.jsonl"), "task-2"), Path::new("a.b-task-2.jsonl"));
        assert_eq!(task_file(Path::new("-"), "task-3"), Path::new("-"));
    }
}

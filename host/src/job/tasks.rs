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

use super::checkpoints::savepoint_path;
use super::commands::{
    Command, ControlHandle, Deployed, JobState, JobStatus, Refused, StopMode, TaskStatus, Throughput,
};
use super::membership::{self, Membership, Order};
use super::running::{RunningJob, Step};
use super::{RunOptions, Summary};
use crate::checkpoint::savepoint;
use crate::checkpoint::savepoint::TaskEntry;
use crate::pipeline::{folder_name, DeadLetterSpec, Pipeline, SinkSpec, SourceSpec, WatermarkScope};
use crate::source::group::{GroupMember, TopicPartition};
use crate::{metrics, Error, Result};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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
    let mut tasks = Vec::new();
    match (&opts.input, &pipeline.source) {
        (Some(input), _) => tasks.push(file_task(pipeline, "task-0", input)),
        (None, SourceSpec::File { paths, .. }) => {
            for (i, path) in paths.iter().enumerate() {
                tasks.push(file_task(pipeline, &format!("task-{i}"), path));
            }
        }
        (None, SourceSpec::Kafka(k)) => {
            let several = k.topics.len() > 1;
            for (topic, id) in crate::source::kafka::partitions(k)? {
                let name =
                    if several { format!("task-{}-{id}", folder_name(&topic)) } else { format!("task-{id}") };
                let mut p = task_pipeline(pipeline, &name);
                if let SourceSpec::Kafka(k) = &mut p.source {
                    k.only = Some((topic.clone(), id));
                }
                tasks.push(Task { name, partition: format!("{topic}/{id}"), pipeline: p });
            }
        }
    }
    Ok(tasks)
}

/// The Kafka partition a task of a Kafka job reads.
fn kafka_partition(task: &Pipeline) -> TopicPartition {
    match &task.source {
        SourceSpec::Kafka(k) => k.only.clone().unwrap_or_default(),
        SourceSpec::File { .. } => TopicPartition::default(),
    }
}

fn file_task(pipeline: &Pipeline, name: &str, path: &Path) -> Task {
    let mut p = task_pipeline(pipeline, name);
    if let SourceSpec::File { paths, .. } = &mut p.source {
        *paths = vec![path.to_path_buf()];
    }
    Task { name: name.into(), partition: path.display().to_string(), pipeline: p }
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
fn task_savepoints(sp: &Path, tasks: &[Task]) -> Result<(Vec<Option<PathBuf>>, Vec<bool>)> {
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

/// Run the job's tasks on `--parallelism` threads (default: the cores, at most the
/// tasks), each opened by `open`; their summaries summed, and their savepoints one job
/// savepoint.
pub(super) fn run(pipeline: &Pipeline, opts: &RunOptions, open: &Open) -> Result<Summary> {
    let in_group = membership::shares_group(pipeline, opts);
    if in_group {
        membership::check(pipeline, opts)?;
    }
    let mut tasks = plan(pipeline, opts)?;
    let mut restore = vec![None; tasks.len()];
    if let Some(sp) = &opts.from_savepoint {
        let (from, ended) = task_savepoints(sp, &tasks)?;
        restore = from;
        let mut i = 0;
        tasks.retain(|_| (!ended[i], i += 1).0);
        let mut i = 0;
        restore.retain(|_| (!ended[i], i += 1).0);
    }
    if tasks.is_empty() {
        return Err(Error::Usage(format!("pipeline {:?} has no partition left to run", pipeline.name)));
    }
    if let Some(c) = &pipeline.checkpoints {
        let one_task = std::fs::read_dir(&c.dir)
            .map(|d| d.flatten().any(|e| e.file_name().to_string_lossy().starts_with("chk-")))
            .unwrap_or(false);
        if one_task {
            tracing::warn!(
                dir = %c.dir.display(),
                "this folder holds checkpoints of the job run as one task: its tasks keep theirs in task-N/ and \
                 do not recover from those (resume from a savepoint to carry state over)"
            );
        }
    }
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let threads = opts.parallelism.or(pipeline.parallelism).unwrap_or(cores).clamp(1, tasks.len());
    let sp_dir = opts.savepoint_dir.clone().unwrap_or_else(|| pipeline.savepoints.clone());
    let failed = Arc::new(AtomicBool::new(false));
    // In a consumer group the group decides which tasks run here, and when.
    let (membership, mut inboxes, member) = match (&pipeline.source, in_group) {
        (SourceSpec::Kafka(k), true) => {
            let parts = tasks.iter().map(|t| kafka_partition(&t.pipeline)).collect();
            // Live deploys are recorded in the job's shared store for every process.
            let deploys = match pipeline.checkpoints.as_ref().and_then(|c| c.remote.as_deref()) {
                Some(url) => Some(crate::checkpoint::remote::RemoteStore::open(url)?),
                None => None,
            };
            let (m, inboxes) = Membership::new(&k.group, parts, threads, failed.clone(), deploys);
            let member = GroupMember::join(k, m.clone())?;
            (Some(m), inboxes.into_iter().map(Some).collect(), Some(member))
        }
        _ => (None, (0..threads).map(|_| None).collect::<Vec<_>>(), None),
    };
    let committer = member.as_ref().map(GroupMember::committer);
    let task_opts: Vec<RunOptions> = tasks
        .iter()
        .zip(restore)
        .map(|(t, from)| RunOptions {
            output: opts.output.as_ref().map(|p| task_file(p, &t.name)),
            savepoint_dir: Some(sp_dir.join(".tasks").join(&t.name)),
            from_savepoint: from,
            control: opts.control.as_ref().map(|_| ControlHandle::new()),
            parallelism: None,
            committer: committer.clone(),
            ..opts.clone()
        })
        .collect();
    tracing::info!(pipeline = %pipeline.name, tasks = tasks.len(), threads, in_group, "job started as tasks");
    let leave = AtomicBool::new(false);
    let finished = AtomicBool::new(member.is_none());
    let fan = opts.control.clone().map(|outer| Fan {
        outer,
        tasks: tasks
            .iter()
            .zip(&task_opts)
            .enumerate()
            .filter_map(|(i, (t, o))| {
                Some(TaskPort {
                    name: t.name.clone(),
                    partition: t.partition.clone(),
                    thread: i % threads,
                    handle: o.control.clone()?,
                    checkpoints: t.pipeline.checkpoints.as_ref().map(|c| c.dir.clone()),
                    owned: membership.as_ref().map(|m| m.owned[i].clone()),
                })
            })
            .collect(),
        membership: membership.clone(),
        leave: &leave,
        pipeline: pipeline.name.clone(),
        sp_dir: sp_dir.clone(),
        done: AtomicBool::new(false),
        stop: Mutex::new(None),
    });
    let (tasks_ref, opts_ref, failed_ref, finished_ref) = (&tasks, &task_opts, &*failed, &finished);
    let outcomes: Vec<std::thread::Result<Result<Driven>>> = std::thread::scope(|s| {
        let fan_thread = fan.as_ref().map(|f| s.spawn(move || f.serve()));
        let member_thread = member.zip(membership.clone()).map(|(member, m)| {
            let flags = (&leave, failed_ref, finished_ref);
            let fan = fan.as_ref();
            s.spawn(move || {
                membership::serve(member, &m, flags, &|| {
                    if let Some(f) = fan {
                        f.follow_deploys();
                    }
                })
            })
        });
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                // In a group, the group assigns the tasks (orders come in the inbox).
                let inbox = inboxes[t].take();
                let mine: Vec<usize> = if inbox.is_some() {
                    Vec::new()
                } else {
                    (t..tasks_ref.len()).step_by(threads).collect()
                };
                let thread = Thread { mine, inbox, finished: finished_ref };
                std::thread::Builder::new()
                    .name(format!("km0-task-thread-{t}"))
                    .spawn_scoped(s, move || drive(thread, tasks_ref, opts_ref, open, failed_ref))
            })
            .collect();
        let out = workers
            .into_iter()
            .map(|w| match w {
                Ok(w) => w.join(),
                Err(e) => Ok(Err(Error::io("start a task thread", &pipeline.file, e))),
            })
            .collect();
        if let Some(f) = &fan {
            f.done.store(true, Ordering::SeqCst);
        }
        if let Some(t) = fan_thread {
            let _ = t.join();
        }
        if let Some(t) = member_thread {
            let _ = t.join();
        }
        out
    });
    let mut parts = Vec::new();
    let mut first_error = None;
    let (mut cpu, mut elapsed) = (Duration::ZERO, Duration::ZERO);
    for o in outcomes {
        match o {
            Ok(Ok(d)) => {
                cpu += d.cpu;
                elapsed = elapsed.max(d.elapsed);
                parts.extend(d.summaries);
            }
            Ok(Err(e)) => first_error = first_error.or(Some(e)),
            Err(_) => first_error = first_error.or(Some(Error::Usage("a task thread panicked".into()))),
        }
    }
    let stop_reply = fan.as_ref().and_then(|f| f.stop.lock().ok().and_then(|mut s| s.take()));
    let result = match first_error {
        Some(e) => Err(e),
        None => finish(pipeline, &tasks, parts, &sp_dir, (cpu, elapsed), in_group),
    };
    if let Some((reply, answers)) = stop_reply {
        let refused = answers.iter().find_map(|rx| match rx.recv_timeout(Duration::from_secs(1)) {
            Ok(Err(e)) => Some(e),
            _ => None,
        });
        let _ = reply.send(match (&result, refused) {
            (_, Some(e)) => Err(e),
            (Ok(s), None) => Ok(s.savepoint.clone()),
            (Err(e), None) => Err(Refused::Failed(e.to_string())),
        });
    }
    result
}

/// One thread's share of the tasks: those it runs from the start, or (in a consumer group)
/// the orders that give it tasks and take them away, until the process has left the group.
struct Thread<'a> {
    mine: Vec<usize>,
    inbox: Option<Receiver<Order>>,
    finished: &'a AtomicBool,
}

/// What one thread did: its tasks' summaries, its CPU time and how long it ran.
struct Driven {
    summaries: Vec<(usize, Summary)>,
    cpu: Duration,
    elapsed: Duration,
}

/// A task as the control port sees it.
struct TaskPort {
    name: String,
    partition: String,
    thread: usize,
    handle: ControlHandle,
    /// Where its checkpoints go (a deployed component is stored there).
    checkpoints: Option<PathBuf>,
    /// Whether this process owns it now (a job in a consumer group; else always).
    owned: Option<Arc<AtomicBool>>,
}

impl TaskPort {
    fn owned(&self) -> bool {
        self.owned.as_ref().is_none_or(|o| o.load(Ordering::SeqCst))
    }
}

/// How long a thread waits before it opens again a task that another process took while
/// the group still gives it to this one (a rebalance that overlapped two owners).
const REOPEN_AFTER: Duration = Duration::from_secs(2);

/// Steps a task takes in a row on its thread before the next task's turn (up to ~64 000
/// records, ~15 ms): with four tasks on one thread, turns of 1 024 records cost ~5% more CPU
/// per record than one task, turns of 64 steps about 1% (the tasks' state and plugin
/// memory take turns in the caches). Commands wait at most a turn.
const TURN: usize = 64;

/// One thread's loop: open its tasks, then step each in turn until all have finished
/// (sleeping only when every one of them waits for input). A task that fails stops the
/// job: every thread leaves its tasks where they are (as a crash would; each recovers
/// from its checkpoints).
fn drive(
    thread: Thread,
    tasks: &[Task],
    opts: &[RunOptions],
    open: &Open,
    failed: &AtomicBool,
) -> Result<Driven> {
    let fail = |e: Error, task: &str| {
        failed.store(true, Ordering::SeqCst);
        tracing::error!(task, error = %e, "task failed; the job stops");
        e
    };
    let mut live = Vec::with_capacity(thread.mine.len());
    for &i in &thread.mine {
        if failed.load(Ordering::SeqCst) {
            return Err(Error::Usage("another task failed".into()));
        }
        let job = open(&tasks[i].pipeline, &opts[i]).map_err(|e| fail(e, &tasks[i].name))?;
        let step = job.first_step();
        live.push((i, job, step));
    }
    let (cpu0, t0) = (metrics::thread_cpu_time(), Instant::now());
    let mut summaries = Vec::with_capacity(thread.mine.len());
    // Tasks fenced here, and when to open them again.
    let mut retry: Vec<(usize, Instant)> = Vec::new();
    loop {
        if failed.load(Ordering::SeqCst) {
            return Err(Error::Usage("another task failed".into()));
        }
        if let Some(inbox) = &thread.inbox {
            // A thread with nothing to run waits for the group to give it a task.
            let first = if live.is_empty() {
                if thread.finished.load(Ordering::SeqCst) {
                    break;
                }
                inbox.recv_timeout(Duration::from_millis(20)).ok()
            } else {
                None
            };
            // Tasks fenced here that the group has not taken away since: open again (the
            // other owner was the one the group moved it away from, or will be fenced in
            // turn until the group settles).
            let now = Instant::now();
            let due: Vec<usize> = retry.iter().filter(|(_, at)| *at <= now).map(|(i, _)| *i).collect();
            retry.retain(|(_, at)| *at > now);
            for order in due.into_iter().map(Order::Open).chain(first).chain(inbox.try_iter()) {
                match order {
                    Order::Open(i) => {
                        if let Some(h) = &opts[i].control {
                            h.closed.store(false, Ordering::SeqCst);
                        }
                        let job = match open(&tasks[i].pipeline, &opts[i]) {
                            Ok(job) => job,
                            // A newer owner took it already: the group moves it away soon.
                            Err(e @ Error::Fenced { .. }) => {
                                tracing::warn!(task = %tasks[i].name, error = %e, "task not opened: another process took it; trying again unless the group moves it");
                                retry.push((i, Instant::now() + REOPEN_AFTER));
                                continue;
                            }
                            Err(e) => return Err(fail(e, &tasks[i].name)),
                        };
                        let step = job.first_step();
                        live.push((i, job, step));
                    }
                    Order::Release { task, checkpoint, done } => {
                        retry.retain(|(i, _)| *i != task);
                        if let Some(k) = live.iter().position(|(i, _, _)| *i == task) {
                            let (i, job, _) = live.remove(k);
                            match job.release(checkpoint) {
                                Ok(s) => summaries.push((i, s)),
                                // As if the process had crashed for this task: the next
                                // owner recovers its newest complete checkpoint.
                                Err(e) => {
                                    tracing::warn!(task = %tasks[i].name, error = %e, "the task's hand-over checkpoint failed")
                                }
                            }
                            if let Some(h) = &opts[i].control {
                                membership::close_port(h);
                            }
                            tracing::info!(task = %tasks[i].name, checkpointed = checkpoint, "task handed over");
                        }
                        drop(done);
                    }
                }
            }
            if live.is_empty() {
                continue;
            }
        } else if live.is_empty() {
            break;
        }
        let (mut going, mut wait) = (false, Duration::MAX);
        let mut k = 0;
        while k < live.len() {
            let (i, job, step) = &mut live[k];
            // A turn is up to TURN steps (of up to 1 024 records each): a task's keys and
            // windows stay in the caches for a while before the next task's replace them.
            let mut next = *step;
            let mut fenced = None;
            for _ in 0..TURN {
                if !matches!(next, Step::Going | Step::Idle(_)) {
                    break;
                }
                match job.step() {
                    Ok(s) => next = s,
                    // In a group, another process took the task (the group moved its
                    // partition while this one still ran it): it is dropped here, as a
                    // crash would drop it, and goes on there.
                    Err(e @ Error::Fenced { .. }) if thread.inbox.is_some() => {
                        fenced = Some(e);
                        break;
                    }
                    Err(e) => return Err(fail(e, &tasks[*i].name)),
                }
                if next != Step::Going {
                    break;
                }
            }
            if let Some(e) = fenced {
                let (i, _, _) = live.remove(k);
                tracing::warn!(task = %tasks[i].name, error = %e, "task dropped: another process took it; trying again unless the group moves it");
                retry.push((i, Instant::now() + REOPEN_AFTER));
                if let Some(h) = &opts[i].control {
                    membership::close_port(h);
                }
                continue;
            }
            match next {
                Step::Ended | Step::Stopped(_) => {
                    let (i, job, _) = live.remove(k);
                    summaries.push((i, job.finish(next).map_err(|e| fail(e, &tasks[i].name))?));
                    if let Some(h) = &opts[i].control {
                        h.closed.store(true, Ordering::SeqCst);
                        h.refuse_waiting("the task has stopped");
                    }
                    continue;
                }
                Step::Idle(w) => wait = wait.min(w),
                Step::Going => going = true,
                // Not watched in a job of several tasks (`why_not_watched`).
                Step::RollBack => {
                    return Err(fail(
                        Error::Usage("a task cannot roll a deploy back".into()),
                        &tasks[*i].name,
                    ))
                }
            }
            *step = next;
            k += 1;
        }
        if !going && !live.is_empty() {
            std::thread::sleep(wait.min(Duration::from_millis(20)));
        }
    }
    Ok(Driven { summaries, cpu: metrics::thread_cpu_time().saturating_sub(cpu0), elapsed: t0.elapsed() })
}

/// The job's summary from its tasks': counters summed, the clock the slowest task's, and
/// one job savepoint of the tasks' savepoints.
fn finish(
    pipeline: &Pipeline,
    tasks: &[Task],
    mut parts: Vec<(usize, Summary)>,
    sp_dir: &Path,
    (cpu, elapsed): (Duration, Duration),
    in_group: bool,
) -> Result<Summary> {
    parts.sort_by_key(|(i, _)| *i);
    let saved: Vec<(TaskEntry, Option<PathBuf>)> = parts
        .iter()
        .map(|(i, s)| {
            let t = &tasks[*i];
            let entry = TaskEntry {
                task: t.name.clone(),
                partition: t.partition.clone(),
                ended: s.savepoint.is_none(),
            };
            (entry, s.savepoint.clone())
        })
        .collect();
    let mut iter = parts.into_iter().map(|(_, s)| s);
    let Some(mut sum) = iter.next() else {
        if in_group {
            // The group gave this process no partition while it ran.
            return Ok(Summary { cpu, elapsed, ..Summary::default() });
        }
        return Err(Error::Usage("the job ran no task".into()));
    };
    for s in iter {
        sum.counters.add(&s.counters);
        for (o, p) in sum.operators.iter_mut().zip(&s.operators) {
            o.counters.add(&p.counters);
            o.open_slots += p.open_slots;
            o.keys += p.keys;
        }
        sum.open_windows += s.open_windows;
        sum.watermark = sum.watermark.min(s.watermark);
        sum.migrated.extend(s.migrated);
        sum.records_this_run += s.records_this_run;
        sum.recovered_from = sum.recovered_from.or(s.recovered_from);
        sum.restore_time = sum.restore_time.max(s.restore_time);
        sum.checkpoints += s.checkpoints;
        sum.checkpoint_pause_max = sum.checkpoint_pause_max.max(s.checkpoint_pause_max);
        sum.checkpoint_pause_total += s.checkpoint_pause_total;
        sum.savepoint_pause = sum.savepoint_pause.max(s.savepoint_pause);
        sum.lag.extend(s.lag);
        sum.backpressure_pauses += s.backpressure_pauses;
    }
    sum.cpu = cpu;
    sum.elapsed = elapsed;
    sum.savepoint = None;
    if saved.iter().any(|(_, p)| p.is_some()) {
        let path = savepoint_path(sp_dir, sum.counters.read);
        savepoint::write_tasks(&path, &pipeline.name, &saved)?;
        tracing::info!(path = %path.display(), tasks = saved.len(), "job savepoint written");
        sum.savepoint = Some(path);
    }
    Ok(sum)
}

/// The control port of a job of tasks: commands fanned out to every task's port and
/// their replies joined; the tasks' statuses published as the job's.
struct Fan<'a> {
    outer: ControlHandle,
    tasks: Vec<TaskPort>,
    pipeline: String,
    sp_dir: PathBuf,
    done: AtomicBool,
    /// The job's share in a consumer group, and the flag that makes the process leave it.
    membership: Option<Arc<Membership>>,
    leave: &'a AtomicBool,
    /// A stop's reply, sent when the job has finished, and the tasks' answers.
    #[allow(clippy::type_complexity)]
    stop: Mutex<
        Option<(super::commands::StopReply, Vec<Receiver<std::result::Result<Option<PathBuf>, Refused>>>)>,
    >,
}

impl Fan<'_> {
    fn serve(&self) {
        let t0 = Instant::now();
        let mut throughput = Throughput::default();
        let mut savepoints = Vec::new();
        let mut deployments: Vec<Deployed> = Vec::new();
        while !self.done.load(Ordering::SeqCst) {
            let command = match self.outer.port.commands.lock() {
                Ok(rx) => rx.recv_timeout(Duration::from_millis(50)).ok(),
                Err(_) => None,
            };
            // A reply goes out once the status that shows its command's effect is
            // published (a client that reads the status after its reply finds it there).
            let mut answer: Option<Box<dyn FnOnce()>> = None;
            match command {
                Some(Command::Savepoint { reply }) => {
                    let saved = self.savepoint();
                    if let Ok(path) = &saved {
                        savepoints.push(path.clone());
                    }
                    answer = Some(Box::new(move || drop(reply.send(saved))));
                }
                Some(Command::Stop { mode, reply }) => self.stop(mode, reply),
                Some(Command::Release { aggregation, key, reply }) => {
                    let released = self.release(aggregation, key);
                    answer = Some(Box::new(move || drop(reply.send(released))));
                }
                Some(
                    command @ (Command::Shadow { .. } | Command::Promote { .. } | Command::Abandon { .. }),
                ) => {
                    command.refuse(
                        "shadow deploys run in a job of one task (this one runs a task per partition): deploy \
                         live, or stop with a savepoint and try the new version on a copy",
                    );
                }
                Some(Command::Deploy { deployment, reply }) => {
                    let component = deployment.component.clone();
                    let deployed = self.deploy(deployment, deployments.len() as u64 + 1);
                    if let Ok(d) = &deployed {
                        savepoints.extend(d.savepoint.clone());
                        deployments.push(d.clone());
                        self.record_deploy(d, &component);
                    }
                    answer = Some(Box::new(move || drop(reply.send(deployed))));
                }
                None => {}
            }
            let mut status = self.status(t0);
            throughput.sample(metrics::now_ms(), status.counters.read);
            status.records_per_second = throughput.rate();
            status.throughput = throughput.history();
            status.last_savepoint = savepoints.last().cloned();
            status.savepoints = savepoints.clone();
            status.deployments = deployments.clone();
            self.outer.publish(status);
            if let Some(answer) = answer {
                answer();
            }
        }
    }

    /// Release quarantined keys in every task this process runs; how many were.
    fn release(
        &self,
        aggregation: Option<String>,
        key: Option<Vec<String>>,
    ) -> std::result::Result<usize, Refused> {
        let asked: Vec<_> = self
            .tasks
            .iter()
            .filter(|t| t.owned() && !t.handle.closed.load(Ordering::SeqCst))
            .map(|t| {
                let (tx, rx) = std::sync::mpsc::channel();
                let (aggregation, key) = (aggregation.clone(), key.clone());
                send(&t.handle, Command::Release { aggregation, key, reply: tx });
                (t, rx)
            })
            .collect();
        let mut released = 0;
        for (t, rx) in asked {
            match wait(&t.handle, &rx) {
                Ok(n) => released += n,
                Err(Refused::Closed(_)) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(released)
    }

    /// A savepoint of every task, then one job savepoint of them.
    fn savepoint(&self) -> std::result::Result<PathBuf, Refused> {
        if let Some(m) = &self.membership {
            return Err(Refused::Closed(format!(
                "this process holds only its share of the tasks of consumer group {:?}: their state is in their \
                 checkpoints, which every process restores from; a job savepoint is taken of a job that runs alone \
                 (`bounded = true`, or a job whose watermark is the job's)",
                m.group
            )));
        }
        let mut saved = Vec::new();
        let asked: Vec<_> = self
            .tasks
            .iter()
            .map(|t| {
                let (tx, rx) = std::sync::mpsc::channel();
                send(&t.handle, Command::Savepoint { reply: tx });
                rx
            })
            .collect();
        for (t, rx) in self.tasks.iter().zip(asked) {
            let entry = TaskEntry { task: t.name.clone(), partition: t.partition.clone(), ended: false };
            match wait(&t.handle, &rx) {
                Ok(path) => saved.push((entry, Some(path))),
                // A task whose bounded input ended has nothing left to save.
                Err(Refused::Closed(_)) if t.handle.closed.load(Ordering::SeqCst) => {
                    saved.push((TaskEntry { ended: true, ..entry }, None))
                }
                Err(e) => return Err(e),
            }
        }
        self.job_savepoint(&saved)
    }

    /// One job savepoint of the tasks' savepoints (moved into it).
    fn job_savepoint(&self, saved: &[(TaskEntry, Option<PathBuf>)]) -> std::result::Result<PathBuf, Refused> {
        let read = self.tasks.iter().map(|t| t.handle.status().counters.read).sum();
        let path = savepoint_path(&self.sp_dir, read);
        savepoint::write_tasks(&path, &self.pipeline, saved)
            .map_err(|e| Refused::Failed(format!("the job savepoint failed: {e}")))?;
        Ok(path)
    }

    /// A live deploy into every task: each gets its own instances of the new plugin and
    /// swaps it in at its next record boundary, with its own rollback savepoint; the
    /// reply, once every task's is durable, has the job savepoint of them (the rollback
    /// point) and the longest pause.
    fn deploy(&self, d: super::deployment::Deployment, id: u64) -> std::result::Result<Deployed, Refused> {
        let Some(deployer) = self.outer.deployer.as_ref() else {
            return Err(Refused::Closed("this job takes no live deploys".into()));
        };
        // A task that runs it already (in a group: swapped by an earlier round) is left be.
        let targets: Vec<usize> = d.plugins.iter().map(|(i, _)| *i).collect();
        let runs_it = |t: &TaskPort| {
            let s = t.handle.status();
            !s.aggregations.is_empty()
                && targets
                    .iter()
                    .all(|&i| s.aggregations.get(i).is_some_and(|a| a.plugin_sha256 == d.component.sha256))
        };
        let live: Vec<&TaskPort> = self
            .tasks
            .iter()
            .filter(|t| t.owned() && !t.handle.closed.load(Ordering::SeqCst) && !runs_it(t))
            .collect();
        let mut each = Vec::with_capacity(live.len());
        for t in &live {
            each.push(deployer.again(&d, t.checkpoints.as_deref())?);
        }
        let asked: Vec<_> = live
            .iter()
            .zip(each)
            .map(|(t, deployment)| {
                let (tx, rx) = std::sync::mpsc::channel();
                send(&t.handle, Command::Deploy { deployment, reply: tx });
                rx
            })
            .collect();
        let mut swapped: Vec<(&TaskPort, Deployed)> = Vec::new();
        let mut refused = Vec::new();
        for (t, rx) in live.iter().zip(asked) {
            match wait(&t.handle, &rx) {
                Ok(done) => swapped.push((t, done)),
                Err(e) => refused.push((t.name.clone(), e)),
            }
        }
        if let Some((name, e)) = refused.into_iter().next() {
            let others: Vec<&str> = swapped.iter().map(|(t, _)| t.name.as_str()).collect();
            tracing::error!(task = %name, error = %e, swapped = ?others, "a task refused the deploy");
            return Err(match (e, others.is_empty()) {
                (e, true) => e,
                (e, false) => Refused::Failed(format!(
                    "task {name} refused the new plugin ({e}) after tasks {others:?} swapped it in: stop the job \
                     with a savepoint and deploy offline, or deploy the plugin they run now again"
                )),
            });
        }
        let Some((_, first)) = swapped.first() else {
            return Err(Refused::Closed("every task has stopped".into()));
        };
        let mut job = Deployed { id, prepare_ms: d.prepare.as_secs_f64() * 1e3, ..first.clone() };
        let rollback: Vec<(TaskEntry, Option<PathBuf>)> = swapped
            .iter()
            .map(|(t, s)| {
                let entry = TaskEntry { task: t.name.clone(), partition: t.partition.clone(), ended: false };
                (entry, s.savepoint.clone())
            })
            .collect();
        job.at_record = swapped.iter().map(|(_, s)| s.at_record).sum();
        for (_, s) in &swapped {
            job.pause_ms = job.pause_ms.max(s.pause_ms);
            job.savepoint_ms = job.savepoint_ms.max(s.savepoint_ms);
            job.swap_ms = job.swap_ms.max(s.swap_ms);
            job.prepare_ms += s.prepare_ms;
        }
        job.checkpoint = None;
        job.savepoint = match &self.membership {
            // A process of a group keeps no job savepoint: each task's rollback savepoint
            // is its own (in the reply's tasks' folders).
            Some(_) => swapped.first().and_then(|(_, s)| s.savepoint.clone()),
            None => Some(self.job_savepoint(&rollback)?),
        };
        Ok(job)
    }

    /// In a group: record a deploy made here for the other processes, once this one's
    /// tasks run it.
    fn record_deploy(&self, d: &Deployed, component: &crate::checkpoint::components::Component) {
        let Some((m, store)) = self.membership.as_ref().and_then(|m| Some((m, m.deploys.as_ref()?))) else {
            return;
        };
        // A deploy taken from the group's record is recorded already.
        if store.latest_deploy().ok().flatten().is_some_and(|(_, r)| r.sha256 == component.sha256) {
            return;
        }
        let record = crate::checkpoint::remote::DeployRecord {
            sha256: component.sha256.clone(),
            plugin: d.to.name.clone(),
            version: d.to.version.clone(),
            aggregations: d.aggregations.clone(),
            at_ms: metrics::now_ms(),
        };
        match store.record_deploy(&record, &component.bytes) {
            Ok(n) => {
                m.deploy_seen.fetch_max(n, Ordering::SeqCst);
                tracing::info!(record = n, plugin = %record.plugin, version = %record.version, "deploy recorded for the group");
            }
            Err(e) => tracing::error!(error = %e, "the deploy could not be recorded for the other processes"),
        }
    }

    /// In a group: bring the tasks this process owns to the job's newest deploy (recorded
    /// by another process, or older than a task this one just took).
    fn follow_deploys(&self) {
        let (Some(m), Some(deployer)) = (self.membership.as_ref(), self.outer.deployer.as_ref()) else {
            return;
        };
        let Some(store) = m.deploys.as_ref() else { return };
        let (n, record) = match store.latest_deploy() {
            Ok(Some(latest)) => latest,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(error = %e, "looking for deploys of the group");
                return;
            }
        };
        let status = self.status(Instant::now());
        let behind = status.tasks.iter().any(|t| {
            let s = self.tasks.iter().find(|p| p.name == t.task).map(|p| p.handle.status());
            s.is_some_and(|s| {
                s.aggregations
                    .iter()
                    .any(|a| record.aggregations.contains(&a.name) && a.plugin_sha256 != record.sha256)
            })
        });
        if !behind || m.deploy_seen.load(Ordering::SeqCst) > n {
            return;
        }
        let bytes = match store.component(&record.sha256) {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(error = %e, "fetching the group's deployed component");
                return;
            }
        };
        let running: Vec<String> = status.aggregations.iter().map(|a| a.plugin.clone()).collect();
        let aggregation = (record.aggregations.len() == 1).then(|| record.aggregations[0].as_str());
        let answer = deployer.prepare(bytes, aggregation, &running).map_err(Refused::from).and_then(|d| {
            let (tx, rx) = std::sync::mpsc::channel();
            send(&self.outer, Command::Deploy { deployment: d, reply: tx });
            rx.recv_timeout(Duration::from_secs(300))
                .unwrap_or_else(|_| Err(Refused::Closed("no answer".into())))
        });
        match answer {
            Ok(_) => {
                tracing::info!(record = n, plugin = %record.plugin, version = %record.version, "deploy of the group taken")
            }
            Err(Refused::Upgrade(super::upgrade::Refusal::Starting)) => {}
            Err(e) => {
                // Not tried again: the deploy history and the log say why.
                m.deploy_seen.fetch_max(n + 1, Ordering::SeqCst);
                tracing::error!(record = n, error = %e, "this process refused the group's deploy");
            }
        }
    }

    /// A stop sent to every task; answered with the job savepoint once the job finished.
    fn stop(&self, mode: StopMode, reply: super::commands::StopReply) {
        let mut answers = Vec::new();
        if self.membership.is_some() {
            // The process leaves the group: its tasks hand over (checkpointed) and go on
            // in the other processes; no savepoint.
            self.leave.store(true, Ordering::SeqCst);
            self.outer.set_state(JobState::Stopping);
            if let Ok(mut s) = self.stop.lock() {
                *s = Some((reply, answers));
            }
            return;
        }
        for t in &self.tasks {
            let (tx, rx) = std::sync::mpsc::channel();
            let h = &t.handle;
            if !h.closed.load(Ordering::SeqCst) && h.sender.send(Command::Stop { mode, reply: tx }).is_ok() {
                answers.push(rx);
            }
        }
        self.outer.set_state(JobState::Stopping);
        if let Ok(mut s) = self.stop.lock() {
            *s = Some((reply, answers));
        }
    }

    /// The job's status: the tasks' summed, and a line per task.
    fn status(&self, t0: Instant) -> JobStatus {
        let mut job = JobStatus { pipeline: self.pipeline.clone(), ..JobStatus::default() };
        let mut first = true;
        let mut states = Vec::new();
        for (i, t) in self.tasks.iter().enumerate() {
            if !t.owned() {
                continue;
            }
            let s = t.handle.status();
            states.push(s.state);
            job.tasks.push(TaskStatus {
                task: t.name.clone(),
                partition: t.partition.clone(),
                thread: self.membership.as_ref().and_then(|m| m.thread_of(i)).unwrap_or(t.thread),
                state: s.state,
                watermark: s.watermark,
                read: s.counters.read,
                records_per_second: s.records_per_second,
                open_windows: s.aggregations.iter().map(|a| a.open_windows).sum(),
                lag: (!s.lag.is_empty()).then(|| s.lag.iter().map(|l| l.lag).sum()),
                plugins: s
                    .aggregations
                    .iter()
                    .map(|a| format!("{} {}", a.plugin, a.plugin_version))
                    .collect(),
            });
            if s.state == JobState::Starting {
                continue;
            }
            job.counters.add(&s.counters);
            job.watermark = if first { s.watermark } else { job.watermark.min(s.watermark) };
            first = false;
            job.partitions.extend(s.partitions.iter().cloned());
            job.lag.extend(s.lag.iter().cloned());
            for a in &s.aggregations {
                match job.aggregations.iter_mut().find(|j| j.name == a.name) {
                    Some(j) => {
                        j.open_windows += a.open_windows;
                        j.keys += a.keys;
                        j.state_bytes += a.state_bytes;
                        j.quarantined += a.quarantined;
                        j.faulted_keys += a.faulted_keys;
                        j.faults_untracked += a.faults_untracked;
                        j.quarantined_keys.extend(a.quarantined_keys.iter().cloned());
                        j.quarantined_keys.sort_by_key(|q| std::cmp::Reverse(q.at_ms));
                        j.quarantined_keys.truncate(crate::window::operator::QUARANTINE_LISTED);
                    }
                    None => job.aggregations.push(a.clone()),
                }
            }
            job.checkpoints += s.checkpoints;
            job.checkpoint_history.extend(s.checkpoint_history.iter().cloned());
            job.progress = match (job.progress, s.progress) {
                (Some((a, b)), Some((c, d))) => Some((a + c, b + d)),
                (None, p) if job.tasks.len() == 1 => p,
                _ => None,
            };
            job.recent_side_outputs.extend(s.recent_side_outputs.iter().cloned());
            job.backpressure_pauses += s.backpressure_pauses;
            job.backpressure_seconds += s.backpressure_seconds;
            job.sink_in_flight = match (job.sink_in_flight, s.sink_in_flight) {
                (Some(a), Some(b)) => Some(a + b),
                (a, b) => a.or(b),
            };
        }
        job.checkpoint_history.sort_by_key(|c| c.taken_at_ms);
        let keep = job.checkpoint_history.len().saturating_sub(super::commands::CHECKPOINT_HISTORY);
        job.checkpoint_history.drain(..keep);
        job.recent_side_outputs.sort_by_key(|r| r.at_ms);
        let keep = job.recent_side_outputs.len().saturating_sub(super::commands::RECENT_SIDE_RECORDS);
        job.recent_side_outputs.drain(..keep);
        job.state = if states.is_empty() && self.membership.is_some() {
            // A member the group has given nothing (yet).
            if self.leave.load(Ordering::SeqCst) {
                JobState::Stopping
            } else {
                JobState::Running
            }
        } else if states.iter().all(|s| *s == JobState::Stopped) {
            JobState::Stopped
        } else if self.outer.status().state == JobState::Stopping || states.contains(&JobState::Stopping) {
            JobState::Stopping
        } else if states.contains(&JobState::Running) {
            JobState::Running
        } else {
            JobState::Starting
        };
        job.uptime_ms = t0.elapsed().as_millis() as u64;
        job.group = self
            .membership
            .as_ref()
            .map(|m| m.status(job.tasks.iter().map(|t| t.partition.clone()).collect()));
        job
    }
}

/// Send a task a command (refused at once when the task has stopped).
fn send(h: &ControlHandle, command: Command) {
    if h.closed.load(Ordering::SeqCst) {
        command.refuse("the task has stopped");
    } else if let Err(std::sync::mpsc::SendError(command)) = h.sender.send(command) {
        command.refuse("the task has stopped");
    }
}

/// A task's answer to a command [`send`] sent it (refused once the task has stopped).
fn wait<T>(
    h: &ControlHandle,
    rx: &Receiver<std::result::Result<T, Refused>>,
) -> std::result::Result<T, Refused> {
    loop {
        match rx.recv_timeout(Duration::from_millis(50)) {
            Ok(answer) => return answer,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                if h.closed.load(Ordering::SeqCst) {
                    h.refuse_waiting("the task has stopped");
                }
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                return Err(Refused::Closed("the task has stopped".into()))
            }
        }
    }
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

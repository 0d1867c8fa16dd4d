//! The threads that run a job's tasks: `--parallelism N` threads each step their share of
//! the tasks in turn (in a consumer group, the tasks the group gives this process), and
//! the job's summary and savepoint are made of the tasks' (job/tasks.rs plans them).

use super::checkpoints::savepoint_path;
use super::commands::{ControlHandle, Refused};
use super::fan::{Fan, TaskPort};
use super::membership::{self, Membership, Order};
use super::running::{RunningJob, Step};
use super::tasks::{plan, task_file, task_savepoints, Open, Task};
use super::{RunOptions, Summary};
use crate::checkpoint::savepoint;
use crate::checkpoint::savepoint::TaskEntry;
use crate::pipeline::Pipeline;
use crate::source::group::GroupMember;
use crate::{metrics, Error, Result};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Run the job's tasks on `--parallelism` threads (default: the cores, at most the
/// tasks), each opened by `open`; their summaries summed, and their savepoints one job
/// savepoint.
pub(super) fn run(pipeline: &Pipeline, opts: &RunOptions, open: &Open) -> Result<Summary> {
    let in_group = membership::shares_group(pipeline, opts);
    if in_group {
        membership::check(pipeline, opts)?;
    }
    let (tasks, restore) = tasks_to_run(pipeline, opts)?;
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let threads = opts.parallelism.or(pipeline.parallelism).unwrap_or(cores).clamp(1, tasks.len());
    let sp_dir = opts.savepoint_dir.clone().unwrap_or_else(|| pipeline.savepoints.clone());
    let failed = Arc::new(AtomicBool::new(false));
    // In a consumer group the group decides which tasks run here, and when.
    let (membership, mut inboxes, member) = match pipeline.source.group().filter(|_| in_group) {
        Some(group) => {
            let (m, inboxes, member) = join_group(pipeline, group, &tasks, threads, failed.clone())?;
            (Some(m), inboxes.into_iter().map(Some).collect(), Some(member))
        }
        None => (None, (0..threads).map(|_| None).collect::<Vec<_>>(), None),
    };
    let committer = member.as_ref().map(GroupMember::committer);
    let since_stop = membership.as_ref().and_then(|m| m.savepoints.as_ref()).and_then(|g| {
        g.last_stop().unwrap_or_else(|e| {
            tracing::warn!(error = %e, "looking for the group's last stop");
            None
        })
    });
    let opts = &RunOptions { since_stop: since_stop.map(|r| r.id), ..opts.clone() };
    let task_opts = task_options(opts, &tasks, restore, &sp_dir, committer);
    tracing::info!(pipeline = %pipeline.name, tasks = tasks.len(), threads, in_group, "job started as tasks");
    let leave = AtomicBool::new(false);
    let finished = AtomicBool::new(member.is_none());
    let fan = opts.control.clone().map(|outer| Fan {
        outer,
        tasks: task_ports(&tasks, &task_opts, threads, membership.as_deref()),
        membership: membership.clone(),
        leave: &leave,
        proposing: AtomicBool::new(false),
        pipeline: pipeline.name.clone(),
        sp_dir: sp_dir.clone(),
        done: AtomicBool::new(false),
        stop: Mutex::new(None),
    });
    let (tasks_ref, opts_ref, failed_ref, finished_ref) = (&tasks, &task_opts, &*failed, &finished);
    let membership_ref = membership.as_deref();
    let outcomes: Vec<std::thread::Result<Result<Driven>>> = std::thread::scope(|s| {
        let fan_thread = fan.as_ref().map(|f| s.spawn(move || f.serve()));
        // The group's deploy records and savepoints, followed apart from the group's own
        // thread (a store that does not answer delays no hand-over).
        let deploys_thread = fan.as_ref().filter(|_| member.is_some()).map(|f| {
            s.spawn(move || {
                membership::follow_store(finished_ref, &f.done, membership::DEPLOYS_EVERY, &mut || {
                    f.follow_deploys()
                })
            })
        });
        let savepoints_thread = fan.as_ref().filter(|_| member.is_some()).map(|f| {
            s.spawn(move || {
                let mut followed = super::group_savepoint::Followed::default();
                let mut proposed = super::group_deploy::Proposed::default();
                membership::follow_store(
                    finished_ref,
                    &f.done,
                    super::group_savepoint::REQUESTS_EVERY,
                    &mut || {
                        f.follow_savepoints(&mut followed);
                        f.follow_proposals(&mut proposed);
                    },
                )
            })
        });
        let member_thread = member.zip(membership.clone()).map(|(member, m)| {
            let flags = (&leave, failed_ref, finished_ref);
            s.spawn(move || membership::serve(member, &m, flags))
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
                let thread = Thread { mine, inbox, finished: finished_ref, membership: membership_ref };
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
        for t in [deploys_thread, savepoints_thread].into_iter().flatten() {
            let _ = t.join();
        }
        out
    });
    let result = sum_threads(outcomes)
        .and_then(|(parts, times)| finish(pipeline, &tasks, parts, &sp_dir, times, in_group));
    if let Some(f) = &fan {
        answer_stop(f, &result);
    }
    result
}

/// The tasks this run starts (those a savepoint marks as ended are left out), with the
/// savepoint each resumes from.
fn tasks_to_run(pipeline: &Pipeline, opts: &RunOptions) -> Result<(Vec<Task>, Vec<Option<PathBuf>>)> {
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
    Ok((tasks, restore))
}

/// This process's membership of `group` for `tasks` (task i reads partition i), the order
/// queue of each of its `threads`, and its member of the group, joined.
fn join_group(
    pipeline: &Pipeline,
    group: &str,
    tasks: &[Task],
    threads: usize,
    failed: Arc<AtomicBool>,
) -> Result<(Arc<Membership>, Vec<Receiver<Order>>, GroupMember)> {
    let parts = tasks
        .iter()
        .map(|t| {
            (
                t.pipeline.source.only_partition(),
                t.pipeline.checkpoints.as_ref().and_then(|c| c.remote.clone()),
            )
        })
        .collect();
    // Live deploys are recorded in the job's shared store for every process.
    // Live deploys and savepoints of the group are recorded in the job's shared store.
    let stores = match pipeline.checkpoints.as_ref().and_then(|c| c.remote.as_deref()) {
        Some(url) => (
            Some(crate::checkpoint::remote::RemoteStore::open(url)?),
            Some(crate::checkpoint::group::GroupSavepoints::open(url)?),
        ),
        None => (None, None),
    };
    let (m, inboxes) = Membership::new(group, parts, threads, failed, stores);
    let member = GroupMember::join(&pipeline.source, m.clone())?;
    Ok((m, inboxes, member))
}

/// Each task's run options: its own output file, savepoint folder, savepoint to resume
/// from and control handle.
fn task_options(
    opts: &RunOptions,
    tasks: &[Task],
    restore: Vec<Option<PathBuf>>,
    sp_dir: &Path,
    committer: Option<crate::source::group::Committer>,
) -> Vec<RunOptions> {
    tasks
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
        .collect()
}

/// The control ports of the tasks, as the job's port fans commands out to them.
fn task_ports(
    tasks: &[Task],
    opts: &[RunOptions],
    threads: usize,
    membership: Option<&Membership>,
) -> Vec<TaskPort> {
    tasks
        .iter()
        .zip(opts)
        .enumerate()
        .filter_map(|(i, (t, o))| {
            Some(TaskPort {
                name: t.name.clone(),
                partition: t.partition.clone(),
                thread: i % threads,
                handle: o.control.clone()?,
                checkpoints: t.pipeline.checkpoints.as_ref().map(|c| c.dir.clone()),
                owned: membership.map(|m| m.owned[i].clone()),
            })
        })
        .collect()
}

/// The threads' summaries, and their CPU time and the longest run; or the first error.
#[allow(clippy::type_complexity)]
fn sum_threads(
    outcomes: Vec<std::thread::Result<Result<Driven>>>,
) -> Result<(Vec<(usize, Summary)>, (Duration, Duration))> {
    let mut parts = Vec::new();
    let (mut cpu, mut elapsed) = (Duration::ZERO, Duration::ZERO);
    let mut first_error = None;
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
    match first_error {
        Some(e) => Err(e),
        None => Ok((parts, (cpu, elapsed))),
    }
}

/// Answer the stop command the job's port took, if any, with how the job ended.
fn answer_stop(fan: &Fan, result: &Result<Summary>) {
    let Some((reply, answers)) = fan.stop.lock().ok().and_then(|mut s| s.take()) else { return };
    let refused = answers.iter().find_map(|rx| match rx.recv_timeout(Duration::from_secs(1)) {
        Ok(Err(e)) => Some(e),
        _ => None,
    });
    let _ = reply.send(match (result, refused) {
        (_, Some(e)) => Err(e),
        (Ok(s), None) => Ok(s.savepoint.clone()),
        (Err(e), None) => Err(Refused::Failed(e.to_string())),
    });
}

/// One thread's share of the tasks: those it runs from the start, or (in a consumer group)
/// the orders that give it tasks and take them away, until the process has left the group.
struct Thread<'a> {
    mine: Vec<usize>,
    inbox: Option<Receiver<Order>>,
    finished: &'a AtomicBool,
    membership: Option<&'a Membership>,
}

/// What one thread did: its tasks' summaries, its CPU time and how long it ran.
struct Driven {
    summaries: Vec<(usize, Summary)>,
    cpu: Duration,
    elapsed: Duration,
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
fn drive<'j>(
    thread: Thread<'j>,
    tasks: &'j [Task],
    opts: &'j [RunOptions],
    open: &'j Open,
    failed: &'j AtomicBool,
) -> Result<Driven> {
    let mut d = Driver {
        tasks,
        opts,
        open,
        failed,
        membership: thread.membership,
        live: Vec::with_capacity(thread.mine.len()),
        retry: Vec::new(),
        summaries: Vec::with_capacity(thread.mine.len()),
    };
    for &i in &thread.mine {
        d.check_failed()?;
        d.open_task(i)?;
    }
    let (cpu0, t0) = (metrics::thread_cpu_time(), Instant::now());
    loop {
        d.check_failed()?;
        if let Some(inbox) = &thread.inbox {
            // A thread with nothing to run waits for the group to give it a task.
            let first = if d.live.is_empty() {
                if thread.finished.load(Ordering::SeqCst) {
                    break;
                }
                inbox.recv_timeout(Duration::from_millis(20)).ok()
            } else {
                None
            };
            d.take_orders(first.into_iter().chain(inbox.try_iter()))?;
            if d.live.is_empty() {
                continue;
            }
        } else if d.live.is_empty() {
            break;
        }
        d.turn()?;
    }
    Ok(Driven {
        summaries: d.summaries,
        cpu: metrics::thread_cpu_time().saturating_sub(cpu0),
        elapsed: t0.elapsed(),
    })
}

/// A thread's tasks as it runs them: those open (with the step each is at), those fenced
/// here (and when to open them again), and the summaries of those that ended or left.
struct Driver<'j, 'o> {
    tasks: &'j [Task],
    opts: &'j [RunOptions],
    open: &'j Open<'o>,
    failed: &'j AtomicBool,
    /// The group that gives this thread its tasks (and takes them away).
    membership: Option<&'j Membership>,
    live: Vec<(usize, RunningJob<'j>, Step)>,
    retry: Vec<(usize, Instant)>,
    summaries: Vec<(usize, Summary)>,
}

impl<'j> Driver<'j, '_> {
    /// Task `i` failed with `e`: the job stops.
    fn fail(&self, e: Error, i: usize) -> Error {
        self.failed.store(true, Ordering::SeqCst);
        tracing::error!(task = %self.tasks[i].name, error = %e, "task failed; the job stops");
        e
    }

    fn check_failed(&self) -> Result<()> {
        if self.failed.load(Ordering::SeqCst) {
            return Err(Error::Usage("another task failed".into()));
        }
        Ok(())
    }

    /// Open task `i` (restored from its checkpoints). In a group, one a newer owner took
    /// already is tried again later (the group moves it away soon).
    fn open_task(&mut self, i: usize) -> Result<()> {
        if self.membership.is_some_and(|m| !m.may_open(i, &self.tasks[i].name)) {
            if let Some(h) = &self.opts[i].control {
                membership::close_port(h);
            }
            return Ok(());
        }
        let job = match (self.open)(&self.tasks[i].pipeline, &self.opts[i]) {
            Ok(job) => job,
            Err(e @ Error::Fenced { .. }) if self.membership.is_some() => {
                tracing::warn!(task = %self.tasks[i].name, error = %e, "task not opened: another process took it; trying again unless the group moves it");
                self.retry.push((i, Instant::now() + REOPEN_AFTER));
                return Ok(());
            }
            // The group took the task away while it opened (a hand-over's deadline ends
            // the store's calls): it is not this process's to run.
            Err(e) if self.membership.is_some_and(|m| m.thread_of(i).is_none()) => {
                tracing::warn!(task = %self.tasks[i].name, error = %e, "task not opened: the group took it away meanwhile");
                if let Some(h) = &self.opts[i].control {
                    membership::close_port(h);
                }
                return Ok(());
            }
            Err(e) => return Err(self.fail(e, i)),
        };
        let step = job.first_step();
        self.live.push((i, job, step));
        Ok(())
    }

    /// Carry out the group's `orders`, after opening again the tasks fenced here that the
    /// group has not taken away since (the other owner was the one the group moved it away
    /// from, or will be fenced in turn until the group settles).
    fn take_orders(&mut self, orders: impl Iterator<Item = Order>) -> Result<()> {
        let now = Instant::now();
        let due: Vec<usize> = self.retry.iter().filter(|(_, at)| *at <= now).map(|(i, _)| *i).collect();
        self.retry.retain(|(_, at)| *at > now);
        for order in due.into_iter().map(Order::Open).chain(orders) {
            match order {
                Order::Open(i) => {
                    if let Some(h) = &self.opts[i].control {
                        h.closed.store(false, Ordering::SeqCst);
                    }
                    self.open_task(i)?;
                }
                Order::Release { task, checkpoint, done } => {
                    self.release(task, checkpoint);
                    drop(done);
                }
            }
        }
        Ok(())
    }

    /// Let `task` go (the group moved it), checkpointed first with `checkpoint` (by its
    /// deadline).
    fn release(&mut self, task: usize, checkpoint: Option<Instant>) {
        self.retry.retain(|(i, _)| *i != task);
        let Some(k) = self.live.iter().position(|(i, _, _)| *i == task) else { return };
        let (i, job, _) = self.live.remove(k);
        match job.release(checkpoint) {
            Ok(s) => self.summaries.push((i, s)),
            // As if the process had crashed for this task: the next owner recovers its
            // newest complete checkpoint.
            Err(e) => {
                tracing::warn!(task = %self.tasks[i].name, error = %e, "the task's hand-over checkpoint failed")
            }
        }
        if let Some(h) = &self.opts[i].control {
            membership::close_port(h);
        }
        tracing::info!(task = %self.tasks[i].name, checkpointed = checkpoint.is_some(), "task handed over");
    }

    /// Give every live task its turn; sleep when all of them wait for input.
    fn turn(&mut self) -> Result<()> {
        let (mut going, mut wait) = (false, Duration::MAX);
        let mut k = 0;
        while k < self.live.len() {
            let next = match self.take_turn(k) {
                Ok(next) => next,
                Err(e @ Error::Fenced { .. }) if self.membership.is_some() => {
                    // Another process took the task (the group moved its partition while
                    // this one still ran it): it is dropped here, as a crash would drop
                    // it, and goes on there.
                    let (i, _, _) = self.live.remove(k);
                    tracing::warn!(task = %self.tasks[i].name, error = %e, "task dropped: another process took it; trying again unless the group moves it");
                    self.retry.push((i, Instant::now() + REOPEN_AFTER));
                    if let Some(h) = &self.opts[i].control {
                        membership::close_port(h);
                    }
                    continue;
                }
                // The group took the task away and the hand-over's deadline ended the
                // store's calls of a checkpoint under way: let go as a crash would.
                Err(e) if self.membership.is_some_and(|m| m.thread_of(self.live[k].0).is_none()) => {
                    let (i, _, _) = self.live.remove(k);
                    tracing::warn!(task = %self.tasks[i].name, error = %e, "task let go without its hand-over checkpoint");
                    if let Some(h) = &self.opts[i].control {
                        membership::close_port(h);
                    }
                    continue;
                }
                Err(e) => return Err(self.fail(e, self.live[k].0)),
            };
            match next {
                Step::Ended | Step::Stopped(_) => {
                    let (i, job, _) = self.live.remove(k);
                    let summary = job.finish(next).map_err(|e| self.fail(e, i))?;
                    self.summaries.push((i, summary));
                    if let Some(h) = &self.opts[i].control {
                        h.closed.store(true, Ordering::SeqCst);
                        h.refuse_waiting("the task has stopped");
                    }
                    continue;
                }
                Step::Idle(w) => wait = wait.min(w),
                Step::Going => going = true,
                // Not watched in a job of several tasks (`why_not_watched`).
                Step::RollBack => {
                    return Err(
                        self.fail(Error::Usage("a task cannot roll a deploy back".into()), self.live[k].0)
                    )
                }
            }
            self.live[k].2 = next;
            k += 1;
        }
        if !going && !self.live.is_empty() {
            std::thread::sleep(wait.min(Duration::from_millis(20)));
        }
        Ok(())
    }

    /// Task `k`'s turn: up to [`TURN`] steps (of up to 1 024 records each), so that its
    /// keys and windows stay in the caches a while before the next task's replace them.
    fn take_turn(&mut self, k: usize) -> Result<Step> {
        let (_, job, step) = &mut self.live[k];
        let mut next = *step;
        for _ in 0..TURN {
            if !matches!(next, Step::Going | Step::Idle(_)) {
                break;
            }
            next = job.step()?;
            if next != Step::Going {
                break;
            }
        }
        Ok(next)
    }
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
        sum.add(s);
    }
    sum.cpu = cpu;
    sum.elapsed = elapsed;
    sum.savepoint = None;
    // A process of a group holds only its share: the group's savepoint is in its store.
    if !in_group && saved.iter().any(|(_, p)| p.is_some()) {
        let path = savepoint_path(sp_dir, sum.counters.read);
        savepoint::write_tasks(&path, &pipeline.name, &saved)?;
        tracing::info!(path = %path.display(), tasks = saved.len(), "job savepoint written");
        sum.savepoint = Some(path);
    }
    Ok(sum)
}

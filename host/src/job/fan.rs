//! The control port of a job of tasks: each command fanned out to every task's own port
//! (job/port.rs) and their replies joined, the tasks' statuses published as the job's.

use super::checkpoints::savepoint_path;
use super::commands::{
    Command, ControlHandle, Deployed, JobState, JobStatus, Refused, StopMode, TaskStatus, Throughput,
};
use super::membership::Membership;
use crate::checkpoint::savepoint;
use crate::checkpoint::savepoint::TaskEntry;
use crate::metrics;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A task as the control port sees it.
pub(super) struct TaskPort {
    pub(super) name: String,
    pub(super) partition: String,
    pub(super) thread: usize,
    pub(super) handle: ControlHandle,
    /// Where its checkpoints go (a deployed component is stored there).
    pub(super) checkpoints: Option<PathBuf>,
    /// Whether this process owns it now (a job in a consumer group; else always).
    pub(super) owned: Option<Arc<AtomicBool>>,
}

impl TaskPort {
    pub(super) fn owned(&self) -> bool {
        self.owned.as_ref().is_none_or(|o| o.load(Ordering::SeqCst))
    }
}

/// The control port of a job of tasks: commands fanned out to every task's port and
/// their replies joined; the tasks' statuses published as the job's.
pub(super) struct Fan<'a> {
    pub(super) outer: ControlHandle,
    pub(super) tasks: Vec<TaskPort>,
    pub(super) pipeline: String,
    pub(super) sp_dir: PathBuf,
    pub(super) done: AtomicBool,
    /// The job's share in a consumer group, and the flag that makes the process leave it.
    pub(super) membership: Option<Arc<Membership>>,
    pub(super) leave: &'a AtomicBool,
    /// A deploy asked of this process is being proposed to the group and committed.
    pub(super) proposing: AtomicBool,
    /// A stop's reply, sent when the job has finished, and the tasks' answers.
    #[allow(clippy::type_complexity)]
    pub(super) stop: Mutex<
        Option<(super::commands::StopReply, Vec<Receiver<std::result::Result<Option<PathBuf>, Refused>>>)>,
    >,
}

impl Fan<'_> {
    pub(super) fn serve(&self) {
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
                Some(command @ Command::Prepare { .. }) => {
                    command.refuse("a job's deploys are prepared by its own port");
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
                    let id = deployments.len() as u64 + 1;
                    let deployed = match self.membership.is_some() {
                        true => self.group_deploy(deployment, id),
                        false => self.deploy(deployment, id),
                    };
                    if let Ok(d) = &deployed {
                        savepoints.extend(d.savepoint.clone());
                        deployments.push(d.clone());
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
        if self.membership.is_some() {
            return self.group_savepoint(false);
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
    pub(super) fn deploy(
        &self,
        d: super::deployment::Deployment,
        id: u64,
    ) -> std::result::Result<Deployed, Refused> {
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
        // Two phases: every task checks that it takes the new plugin (its state migrated
        // and thrown away); only when every one does does any swap.
        let each = prepare(&live, each)?;
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
            // Prepared, then refused at the swap: the task's state changed in between (a
            // key whose state the new plugin cannot take arrived meanwhile).
            let others: Vec<&str> = swapped.iter().map(|(t, _)| t.name.as_str()).collect();
            tracing::error!(task = %name, error = %e, swapped = ?others, "a task refused the deploy it had prepared");
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

    /// In a group: bring the tasks this process owns to the job's newest deploy (recorded
    /// by another process, or older than a task this one just took).
    pub(super) fn follow_deploys(&self) {
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
        // (A deploy this process is committing swaps its own tasks itself.)
        if !behind || m.deploy_seen.load(Ordering::SeqCst) > n || self.proposing.load(Ordering::SeqCst) {
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
        // Committed for the group already: swapped here without asking it again.
        let answer = deployer
            .prepare(bytes, aggregation, &running)
            .map_err(Refused::from)
            .and_then(|d| self.deploy(d, 0));
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
            return self.stop_group(mode, reply);
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
            job.add_task(&s, first);
            first = false;
        }
        job.keep_newest();
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

/// The first phase of a deploy into `tasks`: each one's deployment checked against its
/// state, every task asked at once; the deployments back when every task takes it, else
/// every refusing task and why (no task has swapped anything).
fn prepare(
    tasks: &[&TaskPort],
    each: Vec<super::deployment::Deployment>,
) -> std::result::Result<Vec<super::deployment::Deployment>, Refused> {
    let mut ready = Vec::with_capacity(tasks.len());
    let mut refused = Vec::new();
    for (t, r) in tasks.iter().zip(ask_prepare(tasks, each)) {
        match r {
            Ok(d) => ready.push(d),
            Err(e) => refused.push((t.name.as_str(), e)),
        }
    }
    if refused.is_empty() {
        return Ok(ready);
    }
    // One task's refusal is the deploy's (its kind kept: a state it cannot take is a 422).
    if tasks.len() == 1 {
        return Err(refused.remove(0).1);
    }
    let why: Vec<String> = refused.iter().map(|(t, e)| format!("task {t}: {e}")).collect();
    tracing::error!(refused = ?why, "tasks refused the deploy: no task swapped it in");
    Err(match refused.iter().any(|(_, e)| matches!(e, Refused::Upgrade(_))) {
        true => Refused::Upgrade(super::upgrade::Refusal::InTasks { tasks: why }),
        false => Refused::Failed(format!(
            "tasks refused the new plugin, so no task swapped it in: {}",
            why.join("; ")
        )),
    })
}

/// Ask every one of `tasks` at once whether it takes its deployment (`each`, in order):
/// each one's answer, its deployment back when it does.
pub(super) fn ask_prepare(
    tasks: &[&TaskPort],
    each: Vec<super::deployment::Deployment>,
) -> Vec<std::result::Result<super::deployment::Deployment, Refused>> {
    let asked: Vec<_> = tasks
        .iter()
        .zip(each)
        .map(|(t, deployment)| {
            let (tx, rx) = std::sync::mpsc::channel();
            send(&t.handle, Command::Prepare { deployment, reply: tx });
            rx
        })
        .collect();
    tasks.iter().zip(asked).map(|(t, rx)| wait(&t.handle, &rx)).collect()
}

/// Send a task a command (refused at once when the task has stopped).
pub(super) fn send(h: &ControlHandle, command: Command) {
    if h.closed.load(Ordering::SeqCst) {
        command.refuse("the task has stopped");
    } else if let Err(std::sync::mpsc::SendError(command)) = h.sender.send(command) {
        command.refuse("the task has stopped");
    }
}

/// A task's answer to a command [`send`] sent it (refused once the task has stopped).
pub(super) fn wait<T>(
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

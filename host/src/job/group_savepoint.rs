//! Savepoints and stops of a job whose tasks a consumer group shares
//! ([`crate::checkpoint::group`]): the process asked writes the request and waits for the
//! manifest; every process (the one asked too) follows the requests on a thread of its
//! own and saves the tasks it owns, each at its next record boundary, into the shared
//! store. A task the group moves in the middle is saved by whoever owns it next. A stop
//! stops each task as it is saved (no record read past it, its offsets committed), and
//! once the savepoint is complete every process leaves the group.

use super::commands::{Command, JobState, Refused, StopMode, StopReply};
use super::fan::{send, wait, Fan, TaskPort};
use crate::checkpoint::group::{GroupSavepoints, Progress, Request};
use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// How long the tasks of the whole group may take to be saved, unless
/// `KM0_GROUP_SAVEPOINT_TIMEOUT_MS` says otherwise.
fn group_savepoint_timeout() -> Duration {
    std::env::var("KM0_GROUP_SAVEPOINT_TIMEOUT_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(Duration::from_secs(60), Duration::from_millis)
}

/// How often a process looks for savepoints asked of the group.
pub(super) const REQUESTS_EVERY: Duration = Duration::from_millis(200);

/// What the follower of a process keeps between looks.
#[derive(Default)]
pub(super) struct Followed {
    /// Savepoints found complete or abandoned.
    finished: HashSet<String>,
    /// (savepoint, task) pairs this process saved or stopped.
    done: HashSet<(String, String)>,
    /// Stops this process took part in.
    stops: HashSet<String>,
}

impl Fan<'_> {
    fn group_savepoints(&self) -> Option<&GroupSavepoints> {
        self.membership.as_ref()?.savepoints.as_ref()
    }

    /// A savepoint of the whole group (with `stop`, a stop): asked in the store, then
    /// waited for until complete; its URL. Every process leaves the group after a stop.
    pub(super) fn group_savepoint(&self, stop: bool) -> std::result::Result<PathBuf, Refused> {
        let Some(g) = self.group_savepoints() else {
            return Err(Refused::Closed(
                "this job's checkpoints are in a local folder: a savepoint of the group needs a shared store \
                 (`[checkpoints] dir = \"s3://...\"`)"
                    .into(),
            ));
        };
        let by = self.membership.as_ref().map(|m| m.member()).unwrap_or_default();
        let request =
            g.request(stop, group_savepoint_timeout(), &by).map_err(|e| Refused::Failed(e.to_string()))?;
        tracing::info!(savepoint = %g.url_of(&request.id), stop, "savepoint of the group asked");
        if stop {
            self.outer.set_state(JobState::Stopping);
        }
        loop {
            std::thread::sleep(Duration::from_millis(50));
            match g.progress(&request.id) {
                Ok(Progress::Complete(..)) => break,
                Ok(Progress::Abandoned(_, why)) => return Err(Refused::Failed(why)),
                Ok(Progress::Open(_, saved)) if crate::metrics::now_ms() > request.deadline_ms + 2_000 => {
                    let why = self.unsaved(&saved);
                    let _ = g.abandon(&request, &why);
                    return Err(Refused::Failed(why));
                }
                Ok(Progress::Open(..)) => {}
                Err(e) => tracing::warn!(error = %e, "looking at the group's savepoint"),
            }
        }
        if stop {
            self.leave.store(true, Ordering::SeqCst);
        }
        Ok(PathBuf::from(g.url_of(&request.id)))
    }

    /// Why a savepoint of the group is given up: the tasks not in it.
    fn unsaved(&self, saved: &[String]) -> String {
        let missing: Vec<&str> =
            self.tasks.iter().map(|t| t.name.as_str()).filter(|t| !saved.iter().any(|s| s == t)).collect();
        format!(
            "the group savepoint is incomplete after {:.1} s: tasks {missing:?} were not saved (no process owns \
             them, or their owner did not answer); it is abandoned and the job goes on",
            group_savepoint_timeout().as_secs_f64()
        )
    }

    /// A stop sent to a member of a group: the whole job stops with a savepoint.
    pub(super) fn stop_group(&self, mode: StopMode, reply: StopReply) {
        if mode == StopMode::Drain {
            let _ = reply.send(Err(Refused::Closed(
                "a job shared with a consumer group stops with a savepoint (draining would fire windows that \
                 the group's other tasks still fill); send SIGTERM to a process to take it out of the group"
                    .into(),
            )));
            return;
        }
        let _ = reply.send(self.group_savepoint(true).map(Some));
    }

    /// Look at the group's open savepoints: save (or stop) the tasks this process owns
    /// that are not in them yet, complete those that are whole, give up those past their
    /// deadline; leave the group once a stop it took part in is complete.
    pub(super) fn follow_savepoints(&self, followed: &mut Followed) {
        let Some(g) = self.group_savepoints() else { return };
        let open = match g.open_requests(&mut followed.finished) {
            Ok(open) => open,
            Err(e) => {
                tracing::warn!(error = %e, "looking for savepoints of the group");
                return;
            }
        };
        let started = self.membership.as_ref().map_or(0, |m| m.started_ms);
        let stopped = match g.last_stop() {
            Ok(last) => last.filter(|r| r.at_ms >= started),
            Err(e) => {
                tracing::warn!(error = %e, "looking for a stop of the group");
                None
            }
        };
        // A stop this process took part in that is over: complete (the group stopped), or
        // abandoned (the job goes on: the tasks it stopped here open again, from their
        // checkpoints).
        let over: Vec<String> =
            followed.stops.iter().filter(|id| followed.finished.contains(*id)).cloned().collect();
        let mut complete = stopped.map(|r| r.id);
        for id in over {
            followed.stops.remove(&id);
            match g.progress(&id) {
                Ok(Progress::Abandoned(_, why)) => {
                    tracing::warn!(savepoint = %g.url_of(&id), reason = %why, "the group's stop was abandoned: its tasks here run again");
                    if let Some(m) = &self.membership {
                        m.reopen_stopped();
                    }
                }
                _ => complete = complete.or(Some(id)),
            }
        }
        if let Some(id) = complete {
            if !self.leave.swap(true, Ordering::SeqCst) {
                tracing::info!(savepoint = %g.url_of(&id), "the group stopped with a savepoint: leaving it");
            }
            return;
        }
        for request in open {
            if let Err(e) = self.take_part(g, &request, followed) {
                tracing::warn!(savepoint = %request.id, error = %e, "saving this process's tasks into the group's savepoint");
            }
        }
    }

    fn take_part(
        &self,
        g: &GroupSavepoints,
        request: &Request,
        followed: &mut Followed,
    ) -> crate::Result<()> {
        let saved = g.saved(&request.id)?;
        if crate::metrics::now_ms() > request.deadline_ms {
            return g.abandon(request, &self.unsaved(&saved));
        }
        if request.stop {
            followed.stops.insert(request.id.clone());
        }
        // Every task is asked at once (each saves at its next record boundary, on its
        // thread), and each one's copy goes to the store as soon as it is written.
        let mut asked = Vec::new();
        for (i, t) in self.tasks.iter().enumerate() {
            let pair = (request.id.clone(), t.name.clone());
            if !t.owned() || t.handle.closed.load(Ordering::SeqCst) || followed.done.contains(&pair) {
                continue;
            }
            let theirs = saved.contains(&t.name);
            // In a stop, a task another process saved before the group moved it here runs
            // no further either.
            if theirs && !request.stop {
                continue;
            }
            asked.push((i, t, theirs, ask(t, request.stop)));
            followed.done.insert(pair);
        }
        let put: Vec<crate::Result<()>> = std::thread::scope(|s| {
            let uploads: Vec<_> = asked
                .into_iter()
                .map(|(i, t, theirs, reply)| {
                    s.spawn(move || {
                        let path = reply.wait(t)?;
                        if request.stop {
                            if let Some(m) = &self.membership {
                                m.stopped[i].store(true, Ordering::SeqCst);
                            }
                        }
                        if let (false, Some(path)) = (theirs, path) {
                            let put = g.put_task(&request.id, &t.name, &path)?;
                            tracing::info!(task = %t.name, savepoint = %request.id, put, "task saved into the group's savepoint");
                        }
                        Ok(())
                    })
                })
                .collect();
            uploads
                .into_iter()
                .map(|u| {
                    u.join()
                        .unwrap_or_else(|_| Err(crate::Error::Usage("a savepoint upload panicked".into())))
                })
                .collect()
        });
        put.into_iter().collect::<crate::Result<()>>()?;
        let tasks: Vec<(String, String)> =
            self.tasks.iter().map(|t| (t.name.clone(), t.partition.clone())).collect();
        if g.complete(request, &self.pipeline, &tasks)?.is_some() {
            followed.finished.insert(request.id.clone());
            if request.stop {
                self.leave.store(true, Ordering::SeqCst);
            }
        }
        Ok(())
    }
}

/// A task's answer to come: its savepoint, or (a stop) its final savepoint.
enum Reply {
    Saved(std::sync::mpsc::Receiver<std::result::Result<PathBuf, Refused>>),
    Stopped(std::sync::mpsc::Receiver<std::result::Result<Option<PathBuf>, Refused>>),
}

/// Ask a task for its savepoint at its next record boundary (with `stop`, it stops there).
fn ask(t: &TaskPort, stop: bool) -> Reply {
    if stop {
        let (tx, rx) = std::sync::mpsc::channel();
        send(&t.handle, Command::Stop { mode: StopMode::Savepoint, reply: tx });
        return Reply::Stopped(rx);
    }
    let (tx, rx) = std::sync::mpsc::channel();
    send(&t.handle, Command::Savepoint { reply: tx });
    Reply::Saved(rx)
}

impl Reply {
    /// The savepoint's local folder.
    fn wait(self, t: &TaskPort) -> crate::Result<Option<PathBuf>> {
        let refused = |e: Refused| crate::Error::Usage(format!("task {}: {e}", t.name));
        match self {
            Reply::Saved(rx) => wait(&t.handle, &rx).map(Some).map_err(refused),
            Reply::Stopped(rx) => wait(&t.handle, &rx).map_err(refused),
        }
    }
}

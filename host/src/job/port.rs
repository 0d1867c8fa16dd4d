//! The loop's side of the control port: it takes the commands waiting between two
//! records (savepoints, deploys, stops) and publishes the job's status now and then.

use super::checkpoints::{join_writer, SavepointFailed, SavepointWriter};
use super::commands::{
    CheckpointStatus, Command, ControlHandle, DeployStatus, Deployed, JobState, JobStatus, Refused, StopMode,
    StopReply, Throughput, STATUS_EVERY,
};
use super::ledger::{Ledger, Rollback, Watch};
use super::running::{Port, RunningJob};
use super::swap::NotSwapped;
use super::upgrade::Refusal;
use crate::plugin::PluginIdentity;
use crate::{metrics, Result};
use std::path::{Path, PathBuf};
use std::sync::mpsc::Sender;
use std::time::{Duration, Instant};

type DeployReply = Sender<std::result::Result<Deployed, Refused>>;

pub(super) struct LoopControl {
    handle: ControlHandle,
    t0: Instant,
    published: Instant,
    /// Savepoints written, the deploy history and the deploy on probation (kept in the
    /// job's snapshots).
    ledger: Ledger,
    /// Records read, sampled about every second (the throughput history).
    throughput: Throughput,
    /// A swap whose rollback savepoint or checkpoint is being written: answered once
    /// both are durable.
    pending: Option<PendingDeploy>,
    /// Replies to commands, sent once the status that shows their effect is published
    /// (a client that reads the status after its reply finds its command there).
    answers: Vec<Box<dyn FnOnce() + Send>>,
}

struct PendingDeploy {
    writer: Option<SavepointWriter>,
    /// A checkpoint is to follow the swap (taken once no snapshot is being written).
    checkpoint_wanted: bool,
    checkpoint: Option<String>,
    reply: DeployReply,
    record: Deployed,
}

impl LoopControl {
    pub(super) fn new(handle: ControlHandle, t0: Instant) -> LoopControl {
        LoopControl {
            handle,
            t0,
            published: Instant::now() - STATUS_EVERY,
            ledger: Ledger::default(),
            throughput: Throughput::default(),
            pending: None,
            answers: Vec::new(),
        }
    }

    /// The ledger, as the job's next snapshot is to hold it.
    fn keep(&self, running: &mut RunningJob) {
        running.keep_ledger(self.ledger.to_value());
    }

    /// The aggregations (by index) a watched deploy replaced.
    fn watched_ops(&self, running: &RunningJob, w: &Watch) -> Vec<usize> {
        let aggregations = &running.pipeline().aggregations;
        (0..aggregations.len()).filter(|&i| w.aggregations.contains(&aggregations[i].name)).collect()
    }

    /// The watched deploy's plugin has failed too often (on probation, or tripping its
    /// breaker after): its record says so, and the job is to be rolled back to its
    /// savepoint (written and durable by now), or, when a tripped breaker says so,
    /// stopped.
    pub(super) fn judge_deploy(&mut self, running: &mut RunningJob) -> Option<Rollback> {
        let w = self.ledger.watch.as_ref()?;
        if self.holds_checkpoints() {
            return None;
        }
        let ops = self.watched_ops(running, w);
        for &i in &ops {
            running.judge_deploy(i);
        }
        let failed = ops.iter().find_map(|&i| running.deploy_failed(i));
        let Some((t, tripped)) = failed else {
            if !ops.iter().any(|&i| running.deploy_watched(i)) {
                // Kept: watched by its breaker from now on, or no more.
                let on_breaker = ops.iter().any(|&i| running.deploy_on_breaker(i));
                match self.ledger.watch.as_mut() {
                    Some(w) if on_breaker && !w.kept => w.kept = true,
                    Some(_) if on_breaker => return None,
                    _ => self.ledger.watch = None,
                }
                self.keep(running);
            }
            return None;
        };
        let w = self.ledger.watch.take()?;
        for &i in &ops {
            running.unwatch_deploy(i);
        }
        let what = if tripped {
            format!(
                "the new plugin tripped its circuit breaker after its probation: it failed on {} of its last {} \
                 events and {} of the {} windows they fired (more than the `breaker_fault_rate`)",
                t.failed_events, t.events, t.failed_windows, t.windows
            )
        } else {
            format!(
                "the new plugin failed on {} of the first {} events and {} of the first {} windows it was given \
                 (more than the {:.0}% of `rollback_fault_rate`)",
                t.failed_events,
                t.events,
                t.failed_windows,
                t.windows,
                w.rate * 100.0
            )
        };
        if tripped && running.breaker_stops(&w.aggregations) {
            let reason = format!("stopped by the job: {what}; `on_breaker = \"stop\"`");
            tracing::error!(deploy = w.id, %reason, "the job stops");
            if let Some(d) = self.ledger.deployments.iter_mut().find(|d| d.id == w.id) {
                d.reason = Some(reason.clone());
            }
            self.keep(running);
            running.halt(reason);
            return None;
        }
        if !w.savepoint.join("savepoint.json").is_file() {
            tracing::error!(deploy = w.id, savepoint = %w.savepoint.display(), "the deployed plugin fails too often, but its rollback savepoint was not written: it cannot be rolled back");
            return None;
        }
        let mut reason = format!(
            "rolled back by the job: {what}; the job went back to the rollback savepoint {} with the plugin it \
             ran before and read on from there",
            w.savepoint.display()
        );
        if let Some(shadow) = running.shadow() {
            reason.push_str(&format!(
                " (the shadow of deploy {} that ran meanwhile was dropped with it)",
                shadow.id
            ));
        }
        tracing::error!(deploy = w.id, %reason, "live deploy rolled back");
        if let Some(d) = self.ledger.deployments.iter_mut().find(|d| d.id == w.id) {
            d.status = DeployStatus::RolledBack;
            d.reason = Some(reason.clone());
        }
        if let Some(p) = self.pending.take() {
            self.answer(p.reply, Err(Refused::Failed(reason)));
        }
        self.keep(running);
        Some(Rollback { savepoint: w.savepoint, rewind: w.rewind, ledger: self.ledger.clone() })
    }

    /// Reply to a command once the status is published (see [`Self::send_answers`]).
    fn answer<T: Send + 'static>(&mut self, reply: Sender<T>, value: T) {
        self.answers.push(Box::new(move || {
            let _ = reply.send(value);
        }));
    }

    /// The commands waiting, carried out: whether there were any, and the stop asked for.
    fn take_commands(&mut self, running: &mut RunningJob) -> (bool, Result<Option<(StopMode, StopReply)>>) {
        let mut acted = false;
        let mut stop = None;
        let served = loop {
            let command = match self.handle.port.commands.lock() {
                Ok(rx) => rx.try_recv().ok(),
                Err(_) => None,
            };
            let Some(command) = command else { break Ok(()) };
            acted = true;
            // Calls that write a savepoint or change the plugin wait for the deploy before
            // them to be whole (its rollback savepoint and its checkpoint durable, its
            // caller answered): one at a time, in the order they came.
            if !matches!(command, Command::Release { .. }) {
                if let Err(e) = self.finish_pending(running) {
                    command.refuse("the job failed");
                    break Err(e);
                }
            }
            let done = match command {
                Command::Savepoint { reply } => self.savepoint(running, reply),
                Command::Deploy { deployment, reply } => self.deploy(running, deployment, reply),
                Command::Prepare { mut deployment, reply } => {
                    let ready = running.prepare_swap(&mut deployment).map(|()| deployment);
                    let _ = reply.send(ready);
                    Ok(())
                }
                Command::Shadow { deployment, reply } => {
                    self.shadow(running, deployment, reply);
                    Ok(())
                }
                Command::Promote { reply } => self.promote(running, reply),
                Command::Abandon { reply } => {
                    self.abandon(running, reply);
                    Ok(())
                }
                Command::Release { aggregation, key, reply } => {
                    let released = running.release_keys(aggregation.as_deref(), key.as_deref());
                    self.answer(reply, released);
                    Ok(())
                }
                Command::Stop { mode, reply } => {
                    stop = Some((mode, reply));
                    break Ok(());
                }
            };
            if let Err(e) = done {
                break Err(e);
            }
        };
        let served = served.and_then(|()| self.checkpoint_after_swap(running));
        self.answer_pending(running, false);
        (acted, served.map(|()| stop))
    }

    /// A savepoint on demand; a checkpoint or savepoint being written completes first
    /// (sinks commit in order). One that cannot be written fails its request, not the job
    /// (as in Flink): nothing of it is kept, and the job goes on.
    fn savepoint(
        &mut self,
        running: &mut RunningJob,
        reply: Sender<std::result::Result<PathBuf, Refused>>,
    ) -> Result<()> {
        running.complete_snapshot(true)?;
        match running.savepoint() {
            Ok((path, _)) => {
                self.saved(&path);
                self.answer(reply, Ok(path));
                Ok(())
            }
            Err(SavepointFailed::Savepoint(e)) => {
                tracing::warn!(error = %e, "savepoint failed; the job goes on");
                self.answer(reply, Err(Refused::Failed(format!("the savepoint failed: {e}"))));
                Ok(())
            }
            Err(SavepointFailed::Job(e)) => {
                self.answer(reply, Err(Refused::Failed(e.to_string())));
                Err(e)
            }
        }
    }

    /// Swap in a deployment now (see [`super::swap`]); the reply waits for the rollback
    /// savepoint and the checkpoint taken after the swap.
    fn deploy(
        &mut self,
        running: &mut RunningJob,
        deployment: super::deployment::Deployment,
        reply: DeployReply,
    ) -> Result<()> {
        let t = Instant::now();
        if let Some(shadow) = running.shadow() {
            let why = format!("deploy {} runs as a shadow: promote or abandon it first", shadow.id);
            self.answer(reply, Err(Refused::Closed(why)));
            return Ok(());
        }
        // (The API sends one deploy at a time: none is pending.) A sink that commits when a
        // snapshot is durable sees them in order; an incremental rollback savepoint waits
        // for the checkpoint being written by itself.
        if running.commits_on_completion() {
            running.complete_snapshot(true)?;
        }
        let Some(record) = self.record(running, &deployment) else {
            let held = running.plugins().iter().map(|p| p.name.clone()).collect();
            let offered = format!("component {}", deployment.component.sha256);
            self.answer(reply, Err(Refused::Upgrade(Refusal::ReplacesNothing { held, offered })));
            return Ok(());
        };
        let swapped = running.swap(deployment);
        self.settle(running, record, swapped, reply, t)
    }

    /// A shadow of a deployment: it runs beside the current plugin until promoted or
    /// abandoned.
    fn shadow(
        &mut self,
        running: &mut RunningJob,
        deployment: super::deployment::Deployment,
        reply: Sender<std::result::Result<super::commands::ShadowStatus, Refused>>,
    ) {
        let id = self.ledger.deployments.len() as u64 + 1;
        let started = running.start_shadow(deployment, id);
        if let Err(e) = &started {
            tracing::warn!(reason = %e, "shadow deploy refused; the job goes on unchanged");
        }
        self.answer(reply, started);
    }

    /// Swap the shadow in: a live deploy whose new plugin's accumulators are warm.
    fn promote(&mut self, running: &mut RunningJob, reply: DeployReply) -> Result<()> {
        let t = Instant::now();
        let Some(shadow) = running.shadow() else {
            self.answer(
                reply,
                Err(Refused::NotFound(
                    "no shadow runs: start one with `km0 deploy NEW.wasm --shadow`".into(),
                )),
            );
            return Ok(());
        };
        if running.commits_on_completion() {
            running.complete_snapshot(true)?;
        }
        let record = self.new_record(
            DeployStatus::Promoted,
            (shadow.aggregations.clone(), shadow.from.clone(), shadow.to.clone()),
            running.records(),
            0.0,
        );
        let swapped = running.promote();
        self.settle(running, record, swapped, reply, t)
    }

    /// Drop the shadow.
    fn abandon(
        &mut self,
        running: &mut RunningJob,
        reply: Sender<std::result::Result<super::commands::ShadowStatus, Refused>>,
    ) {
        let dropped = running.abandon_shadow();
        self.answer(reply, dropped);
    }

    /// After a swap (a deploy, a promotion) or its refusal: the history, the watch, and
    /// the reply once the rollback savepoint and the checkpoint after it are durable.
    fn settle(
        &mut self,
        running: &mut RunningJob,
        mut record: Deployed,
        swapped: std::result::Result<super::swap::Swapped, NotSwapped>,
        reply: DeployReply,
        t: Instant,
    ) -> Result<()> {
        let wanted = running.has_checkpoints();
        match swapped {
            Ok(swapped) => {
                self.saved(&swapped.savepoint);
                let rate = running.rollback_fault_rate(&record.aggregations);
                match running.why_not_watched() {
                    None => {
                        record.rollback_fault_rate = Some(rate);
                        record.watch = format!(
                            "rolled back by the job if the new plugin fails on more than {:.0}% of the events, or \
                             of the windows, it is given until it has taken {} events and fired {} windows",
                            rate * 100.0,
                            crate::window::operator::WATCHED_FOR,
                            crate::window::operator::WINDOWS_WATCHED_FOR
                        );
                        let watch = Watch {
                            kept: false,
                            id: record.id,
                            aggregations: record.aggregations.clone(),
                            savepoint: swapped.savepoint.clone(),
                            rewind: swapped.rewind.clone(),
                            rate,
                        };
                        let ops = self.watched_ops(running, &watch);
                        // One deploy is watched at a time: the last.
                        for i in 0..running.plugins().len() {
                            running.unwatch_deploy(i);
                        }
                        for &i in &ops {
                            running.watch_deploy(i, rate);
                        }
                        self.ledger.watch = Some(watch);
                    }
                    Some(why) => {
                        record.watch = format!("not watched for an automatic rollback: {why}");
                        for i in 0..running.plugins().len() {
                            running.unwatch_deploy(i);
                        }
                        self.ledger.watch = None;
                    }
                }
                record.savepoint = Some(swapped.savepoint);
                record.migrated = swapped.migrated;
                record.savepoint_ms = swapped.savepoint_time.as_secs_f64() * 1e3;
                record.swap_ms = swapped.swap_time.as_secs_f64() * 1e3;
                record.pause_ms = t.elapsed().as_secs_f64() * 1e3;
                tracing::info!(
                    aggregations = ?record.aggregations,
                    from = %record.from.iter().map(|p| format!("{} {}", p.name, p.version)).collect::<Vec<_>>().join(", "),
                    to = %format!("{} {}", record.to.name, record.to.version),
                    at_record = record.at_record,
                    pause_ms = format!("{:.1}", record.pause_ms),
                    savepoint = %record.savepoint.as_deref().unwrap_or(Path::new("")).display(),
                    "plugin swapped"
                );
                self.ledger.deployments.push(record.clone());
                // The checkpoint after the swap holds the record and the probation.
                self.keep(running);
                self.pending = Some(PendingDeploy {
                    writer: swapped.writer,
                    checkpoint_wanted: wanted,
                    checkpoint: None,
                    reply,
                    record,
                });
                Ok(())
            }
            Err(NotSwapped::Refused(refused, savepoint)) => {
                tracing::warn!(reason = %refused, "live deploy refused; the job goes on unchanged");
                record.status = DeployStatus::Refused;
                record.reason = Some(refused.to_string());
                record.savepoint = savepoint;
                record.pause_ms = t.elapsed().as_secs_f64() * 1e3;
                self.ledger.deployments.push(record);
                self.keep(running);
                self.answer(reply, Err(*refused));
                Ok(())
            }
            Err(NotSwapped::Failed(e)) => {
                self.answer(reply, Err(Refused::Failed(e.to_string())));
                Err(e)
            }
        }
    }

    /// The history record of a deploy about to be swapped in (none: it replaces no
    /// aggregation).
    fn record(&self, running: &RunningJob, deployment: &super::deployment::Deployment) -> Option<Deployed> {
        let to = deployment.plugins.first().map(|(_, p)| p.identity().clone())?;
        let (pipeline, plugins) = (running.pipeline(), running.plugins());
        let aggregations =
            deployment.plugins.iter().map(|(i, _)| pipeline.aggregations[*i].name.clone()).collect();
        let from = deployment.plugins.iter().map(|(i, _)| plugins[*i].clone()).collect();
        let prepare_ms = deployment.prepare.as_secs_f64() * 1e3;
        Some(self.new_record(DeployStatus::Swapped, (aggregations, from, to), running.records(), prepare_ms))
    }

    /// The next record of the deploy history: `(aggregations, from, to)` at record
    /// `at_record`, prepared in `prepare_ms`.
    fn new_record(
        &self,
        status: DeployStatus,
        (aggregations, from, to): (Vec<String>, Vec<PluginIdentity>, PluginIdentity),
        at_record: u64,
        prepare_ms: f64,
    ) -> Deployed {
        Deployed {
            id: self.ledger.deployments.len() as u64 + 1,
            at_ms: metrics::now_ms(),
            status,
            reason: None,
            aggregations,
            from,
            to,
            migrated: Vec::new(),
            at_record,
            savepoint: None,
            checkpoint: None,
            pause_ms: 0.0,
            savepoint_ms: 0.0,
            swap_ms: 0.0,
            prepare_ms,
            rollback_fault_rate: None,
            watch: String::new(),
        }
    }

    fn saved(&mut self, path: &Path) {
        let savepoints = &mut self.ledger.savepoints;
        if savepoints.len() == super::commands::CHECKPOINT_HISTORY {
            savepoints.remove(0);
        }
        savepoints.push(path.to_path_buf());
    }

    /// The checkpoint that follows a swap (from then on a crash recovers with the new
    /// plugin), once the snapshot being written (the rollback savepoint) is done.
    fn checkpoint_after_swap(&mut self, running: &mut RunningJob) -> Result<()> {
        if self.holds_checkpoints() {
            return Ok(());
        }
        if !self.pending.as_ref().is_some_and(|p| p.checkpoint_wanted) || !running.has_checkpoints() {
            return Ok(());
        }
        // A periodic checkpoint being written completes first (with a short interval and a
        // slow store, one is nearly always under way: waiting for a gap could wait forever).
        running.complete_snapshot(true)?;
        let Some(p) = self.pending.as_mut() else { return Ok(()) };
        p.checkpoint = running.checkpoint()?;
        p.checkpoint_wanted = false;
        p.record.checkpoint = p.checkpoint.clone();
        if let Some(d) = self.ledger.deployments.iter_mut().rev().find(|d| d.id == p.record.id) {
            d.checkpoint = p.checkpoint.clone();
        }
        Ok(())
    }

    /// A job's status with what the port keeps: savepoints, deploys, throughput.
    fn completed(&self, status: JobStatus) -> JobStatus {
        JobStatus {
            uptime_ms: self.t0.elapsed().as_millis() as u64,
            last_savepoint: self.ledger.savepoints.last().cloned(),
            savepoints: self.ledger.savepoints.clone(),
            deployments: self.ledger.deployments.clone(),
            records_per_second: self.throughput.rate(),
            throughput: self.throughput.history(),
            ..status
        }
    }
}

impl Port for LoopControl {
    /// The history of the run this one replaces (a rollback).
    fn carry(&mut self, running: &mut RunningJob, r: &Rollback) {
        self.ledger = Ledger { watch: None, ..r.ledger.clone() };
        // The plugin rolled back to is not judged again (the savepoint may have held a
        // deploy of it still on probation).
        for i in 0..running.plugins().len() {
            running.unwatch_deploy(i);
        }
        self.keep(running);
    }

    /// The memory of the run whose snapshot this one restored: its history, and the
    /// deploy on probation, whose aggregations go on judging it from where they were.
    fn resume(&mut self, running: &mut RunningJob, mut ledger: Ledger) {
        running.shadow_to_resume = ledger.shadow.take();
        self.ledger = ledger;
        let watched = self.ledger.watch.as_ref().map(|w| (self.watched_ops(running, w), w.rate, w.kept));
        for i in 0..running.plugins().len() {
            match &watched {
                Some((ops, rate, kept)) if ops.contains(&i) => running.resume_watch(i, *rate, *kept),
                _ => running.unwatch_deploy(i),
            }
        }
        if let Some(w) = &self.ledger.watch {
            tracing::info!(deploy = w.id, "the live deploy on probation is watched again");
        }
        self.keep(running);
    }

    /// Send the replies held for the status to be published.
    fn send_answers(&mut self) {
        for answer in self.answers.drain(..) {
            answer();
        }
    }

    /// Take the commands waiting (a savepoint or a deploy happens at once; a stop is
    /// returned to the loop) and publish the status when due; then reply to the commands.
    fn serve(&mut self, running: &mut RunningJob) -> Result<Option<(StopMode, StopReply)>> {
        // After a command, the status shows its effect at once.
        let (acted, served) = self.take_commands(running);
        if let Err(e) = &served {
            // The job fails (the new plugin's first fault with `on_error = "fail"`, say): the
            // deploy is answered with why.
            if let Some(p) = self.pending.take() {
                self.answer(p.reply, Err(Refused::Failed(format!("the job failed after the swap: {e}"))));
            }
        }
        if let Some(r) = self.judge_deploy(running) {
            running.roll_back_to(r);
        }
        if self.published.elapsed() >= STATUS_EVERY || acted || !self.answers.is_empty() {
            running.flush_shadow();
            let stopping = matches!(served, Ok(Some(_)));
            self.publish(running, stopping);
        }
        self.send_answers();
        served
    }

    /// Publish the job's status now (`stopping`: a stop was asked for).
    fn publish(&mut self, running: &RunningJob, stopping: bool) {
        self.published = Instant::now();
        let status = running.status(if stopping { JobState::Stopping } else { JobState::Running });
        self.throughput.sample(metrics::now_ms(), status.counters.read);
        self.handle.publish(self.completed(status));
    }

    /// A live deploy's rollback savepoint is still being written by its own thread (memory
    /// backend): no checkpoint may be taken before it is durable, or a crash could recover
    /// into the new plugin with no rollback point.
    fn holds_checkpoints(&self) -> bool {
        self.pending.as_ref().and_then(|p| p.writer.as_ref()).is_some_and(|w| !w.is_finished())
    }

    /// The last deploy made whole now: its rollback savepoint written, the checkpoint
    /// after it taken and durable, its caller answered (before a call that writes a
    /// savepoint or changes the plugin, and before the job stops or lets its task go).
    fn finish_pending(&mut self, running: &mut RunningJob) -> Result<()> {
        let Some(p) = &self.pending else { return Ok(()) };
        if let Some(w) = &p.writer {
            while !w.is_finished() {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        self.checkpoint_after_swap(running)?;
        running.complete_snapshot(true)?;
        self.answer_pending(running, true);
        Ok(())
    }

    /// Answer the last deploy once its rollback savepoint and its checkpoint are
    /// durable (with `wait`, now: its checkpoint has been completed by the caller).
    fn answer_pending(&mut self, running: &RunningJob, wait: bool) {
        let Some(p) = &self.pending else { return };
        if p.checkpoint_wanted && !wait {
            return;
        }
        let checkpoint = p.checkpoint.as_ref().map(|id| running.checkpoint_status(id));
        let written = p.writer.as_ref().is_none_or(|w| w.is_finished());
        if !wait && (!written || checkpoint == Some(CheckpointStatus::Writing)) {
            return;
        }
        let Some(p) = self.pending.take() else { return };
        let savepoint = p.writer.map_or(Ok(()), join_writer);
        let answer = match (savepoint, checkpoint) {
            (Err(e), _) => Err(Refused::Failed(format!(
                "the plugin was swapped, but its rollback savepoint failed: {e}"
            ))),
            (Ok(()), None | Some(CheckpointStatus::Complete)) => Ok(p.record),
            (Ok(()), Some(_)) => Err(Refused::Failed(format!(
                "the plugin was swapped, but the checkpoint after the swap ({}) did not complete",
                p.checkpoint.unwrap_or_default()
            ))),
        };
        self.answer(p.reply, answer);
    }
}

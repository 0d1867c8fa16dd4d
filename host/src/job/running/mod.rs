//! A running job as one object, [`RunningJob`]: opened (state restored, source positioned,
//! sinks opened last), stepped (records, partition ends, checkpoints, backpressure, lag
//! reports, the control port's commands, idle ticks), and finished (a savepoint or the end
//! of the input, and the run's summary). The control port, periodic checkpoints and live
//! deploys act on the job through its methods.

mod ending;
mod open;
mod probation;

pub(super) use super::checkpoints::SavepointFailed;
use super::checkpoints::{write_savepoint, CheckpointStats, Checkpointer};
use super::commands::{
    CheckpointInfo, CheckpointStatus, ControlHandle, JobState, JobStatus, Refused, StopMode, StopReply,
};
use super::deployment::Deployment;
use super::engine::Engine;
use super::lag::{report_lag, LagReport};
use super::ledger::{Ledger, Rollback};
use super::swap::{NotSwapped, Swapped};
use super::Summary;
use crate::pipeline::Pipeline;
use crate::plugin::PluginIdentity;
use crate::sink::ResultSink;
use crate::source::{Framed, Source};
use crate::{metrics, Error, Result};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// What one [`RunningJob::step`] came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Step {
    /// Records were taken (or commands served): step again.
    Going,
    /// A followed source has nothing new: step again after this wait.
    Idle(Duration),
    /// The input ended: [`RunningJob::finish`] fires every open window.
    Ended,
    /// A stop (a signal, `--stop-with-savepoint-after`, or a stop command):
    /// [`RunningJob::finish`] writes the savepoint, or fires every open window (`Drain`).
    Stopped(StopMode),
    /// A live deploy failed too often: the job is to restart from its rollback savepoint
    /// ([`RunningJob::into_rollback`]).
    RollBack,
}

/// How [`RunningJob::run`] ended.
pub(super) enum Ran {
    Finished(Box<Summary>),
    /// To go on from the rollback savepoint of a live deploy (ordered by the control port).
    RolledBack(Box<Rollback>),
}

/// The control port's side of the loop (job/port.rs): what the loop asks of it, between
/// records. The loop holds it by this trait, so that it does not depend on the port.
pub(super) trait Port {
    /// The history of the run this one replaces (a rollback).
    fn carry(&mut self, running: &mut RunningJob, r: &Rollback);
    /// The memory of the run whose snapshot this one restored.
    fn resume(&mut self, running: &mut RunningJob, ledger: Ledger);
    /// Take the commands waiting and publish the status when due: a stop asked for.
    fn serve(&mut self, running: &mut RunningJob) -> Result<Option<(StopMode, StopReply)>>;
    /// Publish the job's status now (`stopping`: a stop was asked for).
    fn publish(&mut self, running: &RunningJob, stopping: bool);
    /// Send the replies held for the status to be published.
    fn send_answers(&mut self);
    /// No checkpoint may be taken now (a live deploy's rollback savepoint is being written).
    fn holds_checkpoints(&self) -> bool;
    /// The last deploy made whole now (before the job stops or lets its task go).
    fn finish_pending(&mut self, running: &mut RunningJob) -> Result<()>;
    /// Answer the last deploy once its snapshots are durable (`wait`: now).
    fn answer_pending(&mut self, running: &RunningJob, wait: bool);
}

/// One running job: its source and position, its operators and watermarks ([`Engine`]), its
/// sinks and its checkpointer, and the control port's side of the loop.
pub(super) struct RunningJob<'p> {
    pipeline: &'p Pipeline,
    job: Engine,
    source: Source,
    checkpoints: Option<Checkpointer>,
    stats: CheckpointStats,
    /// Where savepoints go.
    savepoint_dir: PathBuf,
    follow: bool,
    stop_after: Option<u64>,
    /// Records read before this run (a resume's position).
    read_before: u64,
    lag_at: LagReport,
    control: Option<ControlHandle>,
    /// Taken out while it serves commands (it acts on this job through its methods).
    port: Option<Box<dyn Port + Send>>,
    /// Commands are taken every 1024 records and whenever the source has nothing.
    take_commands: bool,
    idle_loops: u32,
    /// A stop command's reply, sent once the job has finished.
    stop_reply: Option<StopReply>,
    /// The savepoint a stop asked for, written in the loop (one that fails fails the
    /// stop, and the job goes on), and how long processing stopped for it.
    savepoint: Option<PathBuf>,
    savepoint_pause: Duration,
    migrated: Vec<(String, u32, u32)>,
    recovered_from: Option<String>,
    restore_time: Duration,
    t0: Instant,
    cpu0: Duration,
    /// A task of a job shared with a consumer group (stops are hand-overs).
    in_group: bool,
    /// A rollback ordered by the control port (a live deploy that failed too often).
    rollback: Option<Rollback>,
    /// Why the job stops with a savepoint and fails (a tripped breaker that says so).
    halted: Option<String>,
    /// The shadow the snapshot restored had running, to start again (see
    /// [`super::shadow`]).
    pub(super) shadow_to_resume: Option<super::commands::ShadowStatus>,
}

impl<'p> RunningJob<'p> {
    /// What the loop starts with: a stop at once for `--stop-with-savepoint-after 0`.
    pub(super) fn first_step(&self) -> Step {
        if self.stop_after == Some(0) {
            Step::Stopped(StopMode::Savepoint)
        } else {
            Step::Going
        }
    }

    /// Step until the job ends or stops, and finish; or until a live deploy is to be
    /// rolled back.
    pub(super) fn run(mut self) -> Result<Ran> {
        let mut step = self.first_step();
        loop {
            match step {
                Step::Going => {}
                Step::Idle(wait) => std::thread::sleep(wait),
                Step::Ended | Step::Stopped(_) => {
                    let halted = self.halted.take();
                    let summary = self.finish(step)?;
                    return match halted {
                        Some(reason) => Err(Error::Halted { reason, savepoint: summary.savepoint }),
                        None => Ok(Ran::Finished(Box::new(summary))),
                    };
                }
                Step::RollBack => return self.into_rollback().map(|r| Ran::RolledBack(Box::new(r))),
            }
            step = self.step()?;
        }
    }

    /// Leave this run for the one that goes on from a rollback savepoint: the snapshot
    /// being written completes, the status says so, and the sinks are dropped as a crash
    /// would drop them (the run restored from the savepoint rewrites what came after it,
    /// as recovery does), a Kafka producer flushed first (the rewind then finds in the
    /// topic all that the rolled-back run sent).
    pub(super) fn into_rollback(mut self) -> Result<Rollback> {
        self.complete_snapshot(true)?;
        if let Some(out) = self.job.output.as_mut() {
            out.settle()?;
        }
        if let Some(mut port) = self.port.take() {
            port.publish(&self, true);
            port.send_answers();
        }
        self.rollback
            .take()
            .ok_or_else(|| Error::Usage("a rollback was asked for without its savepoint".into()))
    }

    /// Go on after a rollback: the history of the run it replaces, and a checkpoint now,
    /// so that a crash from here recovers into the plugin rolled back to.
    pub(super) fn rolled_back(&mut self, r: &Rollback) -> Result<()> {
        if let Some(mut port) = self.port.take() {
            port.carry(self, r);
            self.port = Some(port);
        }
        if self.has_checkpoints() {
            self.checkpoint()?;
            self.complete_snapshot(true)?;
        }
        Ok(())
    }

    /// Take the records up to the next point where the loop looks at something else
    /// (commands, checkpoints, a stop, the sink's backlog), and do what is due there.
    pub(super) fn step(&mut self) -> Result<Step> {
        if std::mem::take(&mut self.take_commands) {
            if let Some(stop) = self.serve_commands()? {
                return Ok(stop);
            }
        }
        let (job, source) = (&mut self.job, &mut self.source);
        // A record whose layout the scanner knows is scanned where it lies, in the input
        // ahead, which finds its end too; others are found by their line break first.
        // Records in a row up to the next one after which the loop looks at something
        // (below) go in one call.
        let got = if job.frames() {
            let read = source.records();
            let checkpoint_in = self.checkpoints.as_ref().and_then(|c| c.records_until_due(read));
            let most = run_length(read, self.read_before, self.stop_after, checkpoint_in);
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
                self.idle_loops = 0;
                self.after_records()
            }
            Framed::End if self.follow && !self.in_group && super::signals::stop_requested() => {
                Ok(Step::Stopped(StopMode::Savepoint))
            }
            Framed::End if self.follow => self.idle(),
            Framed::End => Ok(Step::Ended),
        }
    }

    /// A stop signal came, and it is this job's to act on (a task of a job shared with a
    /// consumer group is handed over by the process's member instead).
    fn stop_signalled(&self) -> bool {
        !self.in_group && super::signals::stop_requested()
    }

    /// The commands waiting, served by the control port; a stop asked for (with its
    /// savepoint written: one that fails fails the stop, and the job goes on).
    fn serve_commands(&mut self) -> Result<Option<Step>> {
        let Some(mut port) = self.port.take() else { return Ok(None) };
        let served = port.serve(self);
        self.port = Some(port);
        if self.rollback.is_some() {
            // A stop asked for at the same time is answered by the run that goes on.
            if let Ok(Some((_, reply))) = served {
                let _ =
                    reply.send(Err(Refused::Closed("the job is rolling a deploy back; ask again".into())));
            }
            return Ok(Some(Step::RollBack));
        }
        let served = served?;
        if self.halted.is_some() {
            if let Some((_, reply)) = served {
                let _ = reply
                    .send(Err(Refused::Closed("the job is stopping: its deploy tripped its breaker".into())));
            }
            return Ok(Some(Step::Stopped(StopMode::Savepoint)));
        }
        let Some((mode, reply)) = served else { return Ok(None) };
        if mode == StopMode::Savepoint {
            match self.savepoint() {
                Ok((path, pause)) => (self.savepoint, self.savepoint_pause) = (Some(path), pause),
                Err(SavepointFailed::Savepoint(e)) => {
                    tracing::warn!(error = %e, "the savepoint of a stop failed; the job goes on");
                    let why = format!("the savepoint failed, so the job goes on: {e}");
                    let _ = reply.send(Err(Refused::Failed(why)));
                    return Ok(None);
                }
                Err(SavepointFailed::Job(e)) => return Err(e),
            }
        }
        self.stop_reply = Some(reply);
        Ok(Some(Step::Stopped(mode)))
    }

    /// After the last record of a run, which ends where any of these may apply
    /// ([`run_length`]): a stop, a checkpoint due, and every 1024 records the snapshot
    /// being written, the sink's backlog, deliveries, lag and commands (a signal is looked
    /// at after a run of up to 1024).
    fn after_records(&mut self) -> Result<Step> {
        let read = self.source.records();
        if self.stop_after.is_some_and(|n| read - self.read_before >= n) || self.stop_signalled() {
            return Ok(Step::Stopped(StopMode::Savepoint));
        }
        if self.checkpoints.as_ref().is_some_and(|c| c.due(read)) {
            self.periodic_checkpoint()?;
        }
        if read % 1024 == 0 {
            self.complete_snapshot(false)?;
            let (job, source) = (&mut self.job, &mut self.source);
            if job.output.as_ref().is_some_and(ResultSink::behind) {
                job.drain_output(source, &mut self.lag_at)?;
            }
            job.check_deliveries()?;
            report_lag(source, &mut self.lag_at);
            self.take_commands = true;
        }
        Ok(Step::Going)
    }

    /// Nothing new in a followed source: partitions that ended, idle ticks, deliveries,
    /// lag, commands and a checkpoint due by time; then a wait for input.
    fn idle(&mut self) -> Result<Step> {
        let (job, source) = (&mut self.job, &mut self.source);
        for p in source.take_ended() {
            job.partition_ended(p)?;
        }
        job.tick()?;
        job.check_deliveries()?;
        report_lag(source, &mut self.lag_at);
        self.take_commands = true;
        self.complete_snapshot(false)?;
        if self.checkpoints.as_ref().is_some_and(Checkpointer::due_by_time) {
            self.periodic_checkpoint()?;
        }
        self.idle_loops = self.idle_loops.saturating_add(1);
        Ok(Step::Idle(Duration::from_millis(if self.idle_loops < 10 { 1 } else { 20 })))
    }

    /// A checkpoint that came due, unless a live deploy's rollback savepoint is still
    /// being written (a crash could otherwise recover into the new plugin with no
    /// rollback point).
    fn periodic_checkpoint(&mut self) -> Result<()> {
        if self.port.as_ref().is_some_and(|p| p.holds_checkpoints()) {
            return Ok(());
        }
        self.checkpoint().map(drop)
    }

    /// Take a checkpoint now (when the job has checkpoints): its id.
    pub(super) fn checkpoint(&mut self) -> Result<Option<String>> {
        let Some(c) = self.checkpoints.as_mut() else { return Ok(None) };
        self.stats.add(c.take(&mut self.job, self.pipeline, &mut self.source)?);
        Ok(c.history.back().map(|(info, _)| info.id.clone()))
    }

    /// Whether the job takes checkpoints.
    pub(super) fn has_checkpoints(&self) -> bool {
        self.checkpoints.is_some()
    }

    /// Tell the source and sinks of the snapshot being written, if it is complete (with
    /// `wait`, once it is).
    pub(super) fn complete_snapshot(&mut self, wait: bool) -> Result<()> {
        match self.checkpoints.as_mut() {
            Some(c) => c.completed(&mut self.job, &self.source, wait),
            None => Ok(()),
        }
    }

    /// The newest checkpoints of this run.
    pub(super) fn checkpoint_history(&self) -> Vec<CheckpointInfo> {
        self.checkpoints
            .as_ref()
            .map_or_else(Vec::new, |c| c.history.iter().map(|(i, _)| i.clone()).collect())
    }

    /// What became of the checkpoint `id` (failed when it is no longer known).
    pub(super) fn checkpoint_status(&self, id: &str) -> CheckpointStatus {
        self.checkpoints
            .as_ref()
            .and_then(|c| c.history.iter().find(|(info, _)| info.id == id))
            .map_or(CheckpointStatus::Failed, |(info, _)| info.status)
    }

    /// Whether the result sink commits once a snapshot is durable (a Kafka transaction).
    pub(super) fn commits_on_completion(&self) -> bool {
        self.job.output.as_ref().is_some_and(ResultSink::commits_on_completion)
    }

    /// Records read from the source (a resume's included).
    pub(super) fn records(&self) -> u64 {
        self.source.records()
    }

    /// The plugin of each aggregation, in pipeline order.
    pub(super) fn plugins(&self) -> Vec<PluginIdentity> {
        self.job.ops.iter().map(|op| op.identity().clone()).collect()
    }

    pub(super) fn pipeline(&self) -> &'p Pipeline {
        self.pipeline
    }

    /// Write a savepoint now and wait until it is durable: its path and how long
    /// processing stopped.
    pub(super) fn savepoint(&mut self) -> std::result::Result<(PathBuf, Duration), SavepointFailed> {
        write_savepoint(
            &mut self.job,
            self.pipeline,
            &self.source,
            self.checkpoints.as_mut(),
            &self.savepoint_dir,
        )
    }

    /// Whether a deployment's plugins would be swapped in here, swapping nothing
    /// ([`super::swap`]).
    pub(super) fn prepare_swap(&mut self, d: &mut Deployment) -> std::result::Result<(), Refused> {
        self.job.prepare_swap(self.pipeline, d)
    }

    /// Swap in a deployment's plugins at this record boundary ([`super::swap`]).
    pub(super) fn swap(&mut self, d: Deployment) -> std::result::Result<Swapped, NotSwapped> {
        self.job.swap(self.pipeline, &self.source, self.checkpoints.as_mut(), d, &self.savepoint_dir)
    }

    /// Swap the shadow in (see [`super::shadow`]).
    pub(super) fn promote(&mut self) -> std::result::Result<Swapped, NotSwapped> {
        self.job.promote(self.pipeline, &self.source, self.checkpoints.as_mut(), &self.savepoint_dir)
    }

    /// Start a shadow of `d` (deploy number `id`).
    pub(super) fn start_shadow(
        &mut self,
        d: Deployment,
        id: u64,
    ) -> std::result::Result<super::commands::ShadowStatus, Refused> {
        if self.pipeline.task.is_some() {
            return Err(Refused::Closed("shadow deploys run in a job of one task".into()));
        }
        let file = self.pipeline.savepoints.join(format!("shadow-{}-differences.jsonl", metrics::now_ms()));
        let at = self.records();
        self.job.start_shadow(self.pipeline, d, id, at, Some(file))
    }

    /// Start again the shadow the snapshot this job restored had running, with the
    /// plugins of `d` (its component): its counts go on from the snapshot's.
    pub(super) fn resume_shadow(&mut self, d: Deployment, saved: &super::commands::ShadowStatus) {
        let file = saved.differences_file.clone();
        match self.job.start_shadow(self.pipeline, d, saved.id, saved.since_record, file) {
            Ok(_) => {
                self.job.resumed_shadow(saved);
                tracing::info!(deploy = saved.id, "the shadow runs again (from the state restored)");
            }
            Err(e) => {
                tracing::warn!(deploy = saved.id, reason = %e, "the shadow cannot run again; the job goes on without it")
            }
        }
    }

    /// Drop the shadow.
    pub(super) fn abandon_shadow(&mut self) -> std::result::Result<super::commands::ShadowStatus, Refused> {
        self.job.abandon_shadow(self.pipeline)
    }

    /// Write out the differences a shadow has found (with each status).
    pub(super) fn flush_shadow(&mut self) {
        if let Some(s) = self.job.shadow.as_mut() {
            s.flush();
        }
    }

    /// The shadow's status, if one runs.
    pub(super) fn shadow(&self) -> Option<super::commands::ShadowStatus> {
        self.job.shadow.as_ref().map(|s| s.status())
    }

    /// The job's status as the control API shows it (the port adds what it keeps itself:
    /// savepoints, deploys, throughput).
    pub(super) fn status(&self, state: JobState) -> JobStatus {
        let job = &self.job;
        JobStatus {
            state,
            pipeline: self.pipeline.name.clone(),
            uptime_ms: self.t0.elapsed().as_millis() as u64,
            counters: job.counters(),
            watermark: job.watermarks.current(),
            partitions: job
                .watermarks
                .partitions()
                .iter()
                .map(|p| super::commands::PartitionStatus {
                    name: p.name.clone(),
                    max_event_time: p.max_event_time,
                    idle: p.idle,
                    finished: p.finished,
                })
                .collect(),
            lag: self.source.cached_lag(),
            aggregations: job
                .ops
                .iter()
                .map(|op| super::commands::AggregationStatus {
                    name: op.name().to_string(),
                    plugin: op.identity().name.clone(),
                    plugin_version: op.identity().version.clone(),
                    plugin_sha256: op.identity().sha256.clone(),
                    contract: op.identity().contract.clone(),
                    open_windows: op.open_slots(),
                    keys: op.keys(),
                    state_bytes: op.state_bytes(),
                    calls: op.plugin().calls(),
                    quarantined: op.quarantined(0).0,
                    quarantined_keys: op.quarantined(crate::window::operator::QUARANTINE_LISTED).1,
                    faulted_keys: op.faults_followed().0,
                    faults_untracked: op.faults_followed().1,
                    tasks_on: [(format!("{} {}", op.identity().name, op.identity().version), 1)].into(),
                })
                .collect(),
            checkpoints: self.stats.count,
            checkpoint_history: self.checkpoint_history(),
            last_savepoint: None,
            savepoints: Vec::new(),
            deployments: Vec::new(),
            records_per_second: 0.0,
            progress: progress(&self.source),
            recent_side_outputs: job.recent_side_outputs(),
            backpressure_pauses: job.backpressure.0,
            backpressure_seconds: job.backpressure.1.as_secs_f64(),
            sink_in_flight: job.output.as_ref().and_then(ResultSink::in_flight).map(|n| n as u64),
            throughput: Vec::new(),
            tasks: Vec::new(),
            group: None,
            shadow: job.shadow.as_ref().map(|s| s.status()),
        }
    }
}

/// Bytes read of a file source and bytes in its files (none for standard input and Kafka).
fn progress(source: &Source) -> Option<(u64, u64)> {
    let pos = source.position();
    if pos.kind != "file" {
        return None;
    }
    let mut total = 0;
    for p in &pos.partitions {
        total += std::fs::metadata(&p.name).ok().filter(|m| m.is_file())?.len();
    }
    Some((pos.partitions.iter().map(|p| p.offset).sum(), total))
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

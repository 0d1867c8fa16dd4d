//! How a [`RunningJob`] ends: with its savepoint (a stop) or every open window fired (the
//! input ended, a draining stop), or let go as a task whose partition moved; and the
//! summary of its run.

use super::{RunningJob, Step};
use crate::job::commands::{JobState, Refused, StopMode};
use crate::job::{OperatorSummary, Summary};
use crate::sink::ResultSink;
use crate::{metrics, Result};

impl RunningJob<'_> {
    /// End the job as `end` says: with its savepoint (a stop), or every open window fired
    /// and committed (the input ended, or a stop that drains); then its summary.
    pub(in crate::job) fn finish(mut self, end: Step) -> Result<Summary> {
        self.complete_snapshot(true)?;
        if let Some(mut port) = self.port.take() {
            // A deploy just swapped in is whole before the job ends: a restart from its
            // checkpoints runs the plugin its caller was told about.
            let finished = port.finish_pending(&mut self);
            if let Err(e) = finished {
                port.send_answers();
                return Err(e);
            }
            port.publish(&self, true);
            port.send_answers();
        }
        if let Some(handle) = &self.control {
            handle.set_state(JobState::Stopping);
            // Commands that came after the stop are answered now.
            handle.refuse_waiting("the job is stopping");
        }
        let ended = match end {
            Step::Stopped(StopMode::Savepoint) => self.final_savepoint(),
            _ => self.drain(),
        };
        if let Some(reply) = self.stop_reply.take() {
            let _ = reply.send(match &ended {
                Ok(()) => Ok(self.savepoint.clone()),
                Err(e) => Err(Refused::Failed(e.to_string())),
            });
        }
        ended?;
        if let Some(handle) = &self.control {
            handle.set_state(JobState::Stopped);
        }
        Ok(self.summary(true))
    }

    /// Let the task go (its partition was revoked): with a `deadline`, what it has read is
    /// checkpointed and committed first, so that the next owner restores from here (the
    /// store's calls give up at the deadline: the task is then let go as a crash would let
    /// it go); without (the partition is already another's), it is dropped as a crash
    /// would drop it. Open windows are not fired: they go on with the next owner.
    pub(in crate::job) fn release(mut self, deadline: Option<std::time::Instant>) -> Result<Summary> {
        let checkpoint = deadline.is_some();
        if let (Some(at), Some(c)) = (deadline, &self.checkpoints) {
            c.store.give_up_at(at);
        }
        if checkpoint {
            self.complete_snapshot(true)?;
            // A task that read nothing since its last checkpoint (now complete) hands that
            // one over: another would hold the same.
            let current = self
                .checkpoints
                .as_ref()
                .is_some_and(|c| !c.history.is_empty() && c.records_at_last == self.source.records());
            if !current {
                self.checkpoint()?;
                self.complete_snapshot(true)?;
            }
        }
        if let Some(mut port) = self.port.take() {
            if checkpoint {
                port.finish_pending(&mut self)?;
            }
            port.answer_pending(&self, true);
            port.send_answers();
        }
        if let Some(handle) = &self.control {
            handle.refuse_waiting("the task moved to another process of the group");
            handle.set_state(JobState::Stopped);
        }
        Ok(self.summary(false))
    }

    /// The savepoint a stop ends with (unless the stop command's was written already).
    fn final_savepoint(&mut self) -> Result<()> {
        if self.savepoint.is_none() {
            let (path, pause) = self.savepoint()?;
            self.savepoint_pause = pause;
            self.savepoint = Some(path);
        }
        Ok(())
    }

    /// Fire every open window and commit the sinks, as at the end of a bounded input.
    fn drain(&mut self) -> Result<()> {
        let job = &mut self.job;
        for (i, op) in job.ops.iter_mut().enumerate() {
            let mark = job.results.len();
            op.drain(&mut job.results)?;
            if let Some(shadow) = job.shadow.as_mut() {
                shadow.advance(i, None, (&job.results[mark..], op.plugin().call_seconds()));
            }
        }
        if let Some(shadow) = job.shadow.as_mut() {
            shadow.flush();
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
        self.source.checkpoint_complete(&self.source.position());
        Ok(())
    }

    /// Release quarantined keys (see [`Engine::release`]).
    pub(in crate::job) fn release_keys(
        &mut self,
        aggregation: Option<&str>,
        key: Option<&[String]>,
    ) -> std::result::Result<usize, Refused> {
        self.job.release(aggregation, key)
    }

    /// What the run did; with `lag`, the consumer lag at its end (asked of the brokers).
    fn summary(self, lag: bool) -> Summary {
        let job = &self.job;
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
        Summary {
            counters: job.counters(),
            open_windows: operators.iter().map(|o| o.open_slots).sum(),
            plugin: operators[0].plugin.clone(),
            operators,
            watermark: job.watermarks.current(),
            savepoint: self.savepoint,
            migrated: self.migrated,
            records_this_run: self.source.records() - self.read_before,
            elapsed: self.t0.elapsed(),
            cpu: metrics::thread_cpu_time().saturating_sub(self.cpu0),
            recovered_from: self.recovered_from,
            restore_time: self.restore_time,
            checkpoints: self.stats.count,
            checkpoint_pause_max: self.stats.max,
            checkpoint_pause_total: self.stats.total,
            savepoint_pause: self.savepoint_pause,
            lag: if lag {
                self.source.lag().unwrap_or_else(|e| {
                    tracing::warn!(error = %e, "could not read the consumer lag");
                    Vec::new()
                })
            } else {
                Vec::new()
            },
            backpressure_pauses: job.backpressure.0,
        }
    }
}

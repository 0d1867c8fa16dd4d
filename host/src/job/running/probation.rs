//! A live deploy on probation, as the control port sees it through the job: each
//! aggregation's new plugin watched, judged and unwatched, its circuit breaker, and the
//! rollback or halt the port orders.

use super::RunningJob;
use crate::job::ledger::Rollback;
use crate::pipeline::BreakerAction;
use crate::window::operator::Tally;

impl RunningJob<'_> {
    /// The control port found the last live deploy failing too often.
    pub(in crate::job) fn roll_back_to(&mut self, r: Rollback) {
        self.rollback = Some(r);
    }

    /// Put aggregation `i`'s new plugin on probation (a live deploy the job may roll back).
    pub(in crate::job) fn watch_deploy(&mut self, i: usize, rate: f64) {
        let breaker = self.breaker(i);
        if let Some(op) = self.job.ops.get_mut(i) {
            op.watch_deploy(rate, breaker);
        }
    }

    /// Aggregation `i` goes on judging the plugin it was judging when its snapshot was
    /// taken (restored), with the deploy's fault rate; `kept`: past its probation.
    pub(in crate::job) fn resume_watch(&mut self, i: usize, rate: f64, kept: bool) {
        let breaker = self.breaker(i);
        if let Some(op) = self.job.ops.get_mut(i) {
            op.resume_watch(rate, breaker, kept);
        }
    }

    /// Aggregation `i`'s circuit breaker (events, fault rate), if it has one.
    fn breaker(&self, i: usize) -> Option<(u64, f64)> {
        let b = self.pipeline.aggregations.get(i)?.plugin.breaker;
        (b.events > 0).then_some((b.events, b.fault_rate))
    }

    /// Whether a tripped breaker of a deploy into `aggregations` stops the job (rather
    /// than rolling the deploy back).
    pub(in crate::job) fn breaker_stops(&self, aggregations: &[String]) -> bool {
        self.pipeline
            .aggregations
            .iter()
            .any(|a| aggregations.contains(&a.name) && a.plugin.breaker.action == BreakerAction::Stop)
    }

    /// Stop the job with a savepoint, failing with `reason` (a tripped breaker).
    pub(in crate::job) fn halt(&mut self, reason: String) {
        self.halted = Some(reason);
    }

    /// What the control port keeps in the job's snapshots (its [`Ledger`]).
    pub(in crate::job) fn keep_ledger(&mut self, ledger: Option<serde_json::Value>) {
        self.job.ledger = ledger;
    }

    /// Whether aggregation `i`'s new plugin is still on probation.
    pub(in crate::job) fn deploy_watched(&self, i: usize) -> bool {
        self.job.ops.get(i).is_some_and(|op| op.deploy_watched())
    }

    /// Whether aggregation `i`'s new plugin is past its probation, watched by its breaker.
    pub(in crate::job) fn deploy_on_breaker(&self, i: usize) -> bool {
        self.job.ops.get(i).is_some_and(|op| op.deploy_on_breaker())
    }

    /// Aggregation `i`'s new plugin failed its probation (or tripped its breaker): what
    /// it failed on and was given, and whether its breaker tripped.
    pub(in crate::job) fn deploy_failed(&self, i: usize) -> Option<(Tally, bool)> {
        self.job.ops.get(i).and_then(|op| op.deploy_failed())
    }

    /// Judge aggregation `i`'s new plugin on what it has done since its deploy.
    pub(in crate::job) fn judge_deploy(&mut self, i: usize) {
        if let Some(op) = self.job.ops.get_mut(i) {
            op.judge_deploy();
        }
    }

    /// Stop watching aggregation `i`'s plugin.
    pub(in crate::job) fn unwatch_deploy(&mut self, i: usize) {
        if let Some(op) = self.job.ops.get_mut(i) {
            op.unwatch_deploy();
        }
    }

    /// The fault rate that rolls back a deploy into `aggregations` (the lowest of theirs).
    pub(in crate::job) fn rollback_fault_rate(&self, aggregations: &[String]) -> f64 {
        self.pipeline
            .aggregations
            .iter()
            .filter(|a| aggregations.contains(&a.name))
            .map(|a| a.plugin.rollback_fault_rate)
            .fold(1.0, f64::min)
    }

    /// Why a live deploy into this job cannot be rolled back by the job (none: it can).
    pub(in crate::job) fn why_not_watched(&self) -> Option<&'static str> {
        if !self.pipeline.source.replays() {
            Some("the source (standard input) cannot be read again from the rollback savepoint")
        } else if self.pipeline.task.is_some() {
            Some("a job of several tasks is not rolled back task by task (deploy the previous version again)")
        } else {
            None
        }
    }
}

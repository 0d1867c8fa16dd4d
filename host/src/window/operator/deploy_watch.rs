//! A live-deployed plugin on probation: the operator counts the events and the windows
//! the new plugin fails on against those it is given, and judges events and windows apart
//! (a plugin that fails in every `finish` loses every result while taking every event).
//!
//! - Events given: those it took (counted when they reach their window, as failures are:
//!   a batch not handed over yet weighs as much as its failures), and those it failed on
//!   (dead-lettered for a fault, or for their key's quarantine).
//! - Windows given: those fired, those dropped because it failed on every event of theirs,
//!   and those of quarantined keys (whose events open no slot); failed: those whose result it failed on, and those it failed on an event of
//!   (a window that lost an event to a fault has a wrong result, whatever `finish` says).
//!
//! Once it has been given [`JUDGED_AFTER`] events or [`WINDOWS_JUDGED_AFTER`] windows and
//! fails on more than the allowed share of them, the deploy has failed (the job rolls it
//! back). It is kept once it has been given [`WATCHED_FOR`] events and
//! [`WINDOWS_WATCHED_FOR`] windows: a firing of many windows does not end probation
//! before the plugin has taken enough events to be judged. The probation is in the
//! job's snapshots: a restart goes on judging from where it was.

use super::*;
use std::collections::VecDeque;

/// Events a deployed plugin is watched for before it is kept.
pub const WATCHED_FOR: u64 = 10_000;
/// Windows a deployed plugin is watched for before it is kept.
pub const WINDOWS_WATCHED_FOR: u64 = 100;
/// Events a deployed plugin is given before its share of failed events is judged.
pub const JUDGED_AFTER: u64 = 100;
/// Windows a deployed plugin fires before its share of failed windows is judged.
pub const WINDOWS_JUDGED_AFTER: u64 = 20;

/// What a plugin failed on and was given: events, then windows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Tally {
    pub failed_events: u64,
    pub events: u64,
    pub failed_windows: u64,
    pub windows: u64,
}

impl Tally {
    fn since(self, base: Tally) -> Tally {
        Tally {
            failed_events: self.failed_events.saturating_sub(base.failed_events),
            events: self.events.saturating_sub(base.events),
            failed_windows: self.failed_windows.saturating_sub(base.failed_windows),
            windows: self.windows.saturating_sub(base.windows),
        }
    }

    fn plus(self, other: Tally) -> Tally {
        Tally {
            failed_events: self.failed_events + other.failed_events,
            events: self.events + other.events,
            failed_windows: self.failed_windows + other.failed_windows,
            windows: self.windows + other.windows,
        }
        .whole()
    }

    /// What was failed on was given: a window failed on an event of counts as given
    /// before it fires (differences of two tallies may have it failed and not fired yet).
    fn whole(self) -> Tally {
        Tally {
            events: self.events.max(self.failed_events),
            windows: self.windows.max(self.failed_windows),
            ..self
        }
    }
}

#[derive(Debug)]
pub(super) struct DeployWatch {
    /// [`WindowOperator::plugin_tally`] when this operator started watching.
    base: Tally,
    /// What the plugin did before that (a probation restored from a snapshot).
    carried: Tally,
    /// The share of failures that fails the deploy.
    rate: f64,
    /// What it failed on and was given, when it failed (on probation, or tripping the
    /// breaker).
    failed: Option<Tally>,
    /// The breaker to watch the plugin with after its probation (none: the watch ends
    /// with the probation).
    breaker: Option<(u64, f64)>,
    /// Kept after its probation: the breaker's marks, cumulative tallies every tenth of
    /// its events, oldest first (the rate is taken since the oldest).
    marks: Option<VecDeque<Tally>>,
}

impl DeployWatch {
    fn new(base: Tally, carried: Tally, rate: f64, breaker: Option<(u64, f64)>) -> DeployWatch {
        DeployWatch { base, carried, rate, failed: None, breaker, marks: None }
    }
}

/// Whether `failed` of `given` (at least `after` given) is more than `rate` of them.
fn too_many(failed: u64, given: u64, after: u64, rate: f64) -> bool {
    given >= after.max(1) && failed as f64 > rate * given as f64
}

/// Windows remembered as failed on an event (to count each once), before the memory is
/// started afresh.
const TAINTED_KEPT: usize = 1 << 16;

impl WindowOperator {
    /// What its plugin failed on and was given since the operator was opened: events
    /// (given: in calls that succeeded, or failed on; failed: dead-lettered for a fault or
    /// for their key's quarantine) and windows (fired; failed: their result dead-lettered).
    pub fn plugin_tally(&self) -> Tally {
        let failed_events = self.faulted_units - self.faulted_windows + self.counters.quarantined;
        let failed_windows = self.faulted_windows + self.tainted_windows;
        Tally {
            failed_events,
            events: self.counters.accepted + failed_events,
            failed_windows,
            windows: (self.counters.windows_fired + self.doomed_windows + self.slotless_windows)
                .max(failed_windows),
        }
    }

    /// The plugin failed on an event of window `window` of key `k`: the window counts as
    /// failed (once); `slotless`: the event opened no slot (its key is quarantined), so
    /// the window counts as given too (it will not fire, nor be dropped).
    pub(super) fn taint(&mut self, k: u32, window: Window, slotless: bool) {
        if self.tainted.len() >= TAINTED_KEPT {
            self.tainted.clear();
        }
        if self.tainted.insert((k, window.start)) {
            self.tainted_windows += 1;
            self.slotless_windows += slotless as u64;
        }
    }

    /// Watch the plugin just swapped in: its deploy fails when it fails on more than
    /// `rate` of the events, or of the windows, it is given first; kept, it is watched by
    /// `breaker` (events, fault rate) if there is one.
    pub fn watch_deploy(&mut self, rate: f64, breaker: Option<(u64, f64)>) {
        self.deploy_watch = Some(DeployWatch::new(self.plugin_tally(), Tally::default(), rate, breaker));
    }

    /// What the plugin on probation has failed on and been given since its deploy (none:
    /// no plugin is on probation), for the job's snapshots.
    pub fn probation(&self) -> Option<Tally> {
        let w = self.deploy_watch.as_ref().filter(|w| w.failed.is_none() && w.marks.is_none())?;
        Some(w.carried.plus(self.plugin_tally().since(w.base)))
    }

    /// The probation a snapshot holds (see [`Self::probation`]): judged again once the
    /// control port gives it its fault rate ([`Self::resume_watch`]).
    pub fn restore_probation(&mut self, saved: Option<Tally>) {
        self.deploy_watch = saved.map(|carried| DeployWatch::new(self.plugin_tally(), carried, 1.0, None));
    }

    /// Go on judging a restored probation, failing it above `rate` (no probation
    /// restored: one starts now); `kept`: it was past its probation, watched by its
    /// breaker (whose marks start again now).
    pub fn resume_watch(&mut self, rate: f64, breaker: Option<(u64, f64)>, kept: bool) {
        match &mut self.deploy_watch {
            Some(w) if !kept => {
                w.rate = rate;
                w.breaker = breaker;
            }
            _ => {
                self.watch_deploy(rate, breaker);
                if kept {
                    let now = self.plugin_tally();
                    if let Some(w) = &mut self.deploy_watch {
                        w.marks = Some(VecDeque::from([now]));
                    }
                }
            }
        }
    }

    /// Stop watching (another deploy is watched now).
    pub fn unwatch_deploy(&mut self) {
        self.deploy_watch = None;
    }

    /// Whether the plugin is on probation (not kept yet, not failed).
    pub fn deploy_watched(&self) -> bool {
        self.deploy_watch.as_ref().is_some_and(|w| w.failed.is_none() && w.marks.is_none())
    }

    /// Whether the plugin is past its probation and watched by its breaker.
    pub fn deploy_on_breaker(&self) -> bool {
        self.deploy_watch.as_ref().is_some_and(|w| w.failed.is_none() && w.marks.is_some())
    }

    /// The watched plugin failed too often: what it failed on and was given, and whether
    /// it was past its probation (its breaker tripped).
    pub fn deploy_failed(&self) -> Option<(Tally, bool)> {
        self.deploy_watch.as_ref().and_then(|w| w.failed.map(|t| (t, w.marks.is_some())))
    }

    /// Judge the watched plugin on what it has done since the swap (after a fault, and
    /// whenever the control port looks).
    pub fn judge_deploy(&mut self) {
        let now = self.plugin_tally();
        let Some(w) = &mut self.deploy_watch else { return };
        if w.failed.is_some() {
            return;
        }
        if let (Some(marks), Some((events, rate))) = (&mut w.marks, w.breaker) {
            let step = (events / 10).max(1);
            if marks.back().is_none_or(|m| now.events.saturating_sub(m.events) >= step) {
                marks.push_back(now);
                while marks.len() > 11 {
                    marks.pop_front();
                }
            }
            let t = marks.front().map_or(Tally::default(), |m| now.since(*m).whole());
            // Judged once the marks span half of its events at least.
            let judged = t.events >= (events / 2).max(JUDGED_AFTER);
            if judged
                && (too_many(t.failed_events, t.events, 0, rate)
                    || too_many(t.failed_windows, t.windows, WINDOWS_JUDGED_AFTER, rate))
            {
                tracing::error!(aggregation = %self.name, ?t, "the deployed plugin tripped its circuit breaker");
                w.failed = Some(t);
            }
            return;
        }
        let t = w.carried.plus(now.since(w.base));
        if too_many(t.failed_events, t.events, JUDGED_AFTER, w.rate)
            || too_many(t.failed_windows, t.windows, WINDOWS_JUDGED_AFTER, w.rate)
        {
            tracing::error!(aggregation = %self.name, ?t, "the deployed plugin fails too often");
            w.failed = Some(t);
        } else if t.events >= WATCHED_FOR && t.windows >= WINDOWS_WATCHED_FOR {
            tracing::info!(aggregation = %self.name, ?t, "the deployed plugin is kept");
            if w.breaker.is_some_and(|(events, _)| events > 0) {
                w.marks = Some(VecDeque::from([now]));
            } else {
                self.deploy_watch = None;
            }
        }
    }
}

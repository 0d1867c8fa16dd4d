//! A live-deployed plugin on probation: the operator counts the events and the windows
//! the new plugin fails on (faults, and events of keys it quarantined) against those it
//! is given, and judges events and windows apart (a plugin that fails in every `finish`
//! loses every result while taking every event). Once it has been given
//! [`JUDGED_AFTER`] events or [`WINDOWS_JUDGED_AFTER`] windows and fails on more than the
//! allowed share of them, the deploy has failed (the job rolls it back); after
//! [`WATCHED_FOR`] events and windows the plugin is kept.

use super::*;

/// Events and windows a deployed plugin is watched for before it is kept.
pub const WATCHED_FOR: u64 = 10_000;
/// Events a deployed plugin is given before its share of failed events is judged.
pub const JUDGED_AFTER: u64 = 100;
/// Windows a deployed plugin fires before its share of failed windows is judged.
pub const WINDOWS_JUDGED_AFTER: u64 = 20;

/// What a plugin failed on and was given: events, then windows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
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
}

#[derive(Debug)]
pub(super) struct DeployWatch {
    /// [`WindowOperator::plugin_tally`] at the swap.
    base: Tally,
    /// The share of failures that fails the deploy.
    rate: f64,
    /// What it failed on and was given, when it failed.
    failed: Option<Tally>,
}

impl WindowOperator {
    /// What its plugin failed on and was given since the operator was opened: events
    /// (given: in calls that succeeded, or failed on; failed: dead-lettered for a fault or
    /// for their key's quarantine) and windows (fired; failed: their result dead-lettered).
    pub fn plugin_tally(&self) -> Tally {
        let failed_events = self.faulted_units - self.faulted_windows + self.counters.quarantined;
        Tally {
            failed_events,
            events: self.handed + failed_events,
            failed_windows: self.faulted_windows,
            windows: self.counters.windows_fired.max(self.faulted_windows),
        }
    }

    /// Watch the plugin just swapped in: its deploy fails when it fails on more than
    /// `rate` of the events, or of the windows, it is given first.
    pub fn watch_deploy(&mut self, rate: f64) {
        self.deploy_watch = Some(DeployWatch { base: self.plugin_tally(), rate, failed: None });
    }

    /// Stop watching (another deploy is watched now).
    pub fn unwatch_deploy(&mut self) {
        self.deploy_watch = None;
    }

    /// Whether the plugin is still watched (not kept yet, not failed).
    pub fn deploy_watched(&self) -> bool {
        self.deploy_watch.as_ref().is_some_and(|w| w.failed.is_none())
    }

    /// The watched plugin failed too often: what it failed on and was given.
    pub fn deploy_failed(&self) -> Option<Tally> {
        self.deploy_watch.as_ref().and_then(|w| w.failed)
    }

    /// Judge the watched plugin on what it has done since the swap (after a fault, and
    /// whenever the control port looks).
    pub fn judge_deploy(&mut self) {
        let now = self.plugin_tally();
        let Some(w) = &mut self.deploy_watch else { return };
        if w.failed.is_some() {
            return;
        }
        let t = now.since(w.base);
        let too_many =
            |failed: u64, given: u64, after: u64| given >= after && failed as f64 > w.rate * given as f64;
        if too_many(t.failed_events, t.events, JUDGED_AFTER)
            || too_many(t.failed_windows, t.windows, WINDOWS_JUDGED_AFTER)
        {
            tracing::error!(aggregation = %self.name, ?t, "the deployed plugin fails too often");
            w.failed = Some(t);
        } else if t.events + t.windows >= WATCHED_FOR {
            tracing::info!(aggregation = %self.name, ?t, "the deployed plugin is kept");
            self.deploy_watch = None;
        }
    }
}

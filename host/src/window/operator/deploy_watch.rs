//! A live-deployed plugin on probation: the operator counts what the new plugin fails on
//! (faults, events of keys it quarantined) against what it takes (events, windows), and
//! once it has been given [`JUDGED_AFTER`] of them and fails on more than the allowed
//! share, it stops calling it (its calls fail at once, as the job is to roll the deploy
//! back and read these records again); after [`WATCHED_FOR`] the plugin is kept.

use super::*;

/// Events and windows a deployed plugin is watched for before it is kept.
pub const WATCHED_FOR: u64 = 10_000;
/// Events and windows a deployed plugin is given before its fault rate is judged.
pub const JUDGED_AFTER: u64 = 100;

#[derive(Debug)]
pub(super) struct DeployWatch {
    /// [`WindowOperator::plugin_tally`] at the swap.
    base: (u64, u64),
    /// The share of faults that fails the deploy.
    rate: f64,
    /// (failed, given) when it failed.
    failed: Option<(u64, u64)>,
}

impl WindowOperator {
    /// Watch the plugin just swapped in: it fails the deploy when it fails on more than
    /// `rate` of the events and windows it is given first.
    pub fn watch_deploy(&mut self, rate: f64) {
        self.deploy_watch = Some(DeployWatch { base: self.plugin_tally(), rate, failed: None });
    }

    /// Whether the plugin is still watched (not kept yet, not failed).
    pub fn deploy_watched(&self) -> bool {
        self.deploy_watch.as_ref().is_some_and(|w| w.failed.is_none())
    }

    /// The watched plugin failed too often: (failed, given).
    pub fn deploy_failed(&self) -> Option<(u64, u64)> {
        self.deploy_watch.as_ref().and_then(|w| w.failed)
    }

    /// After a fault: judge the watched plugin.
    pub(super) fn judge_deploy(&mut self) {
        let (f, t) = self.plugin_tally();
        let Some(w) = &mut self.deploy_watch else { return };
        if w.failed.is_some() {
            return;
        }
        let failed = f.saturating_sub(w.base.0);
        let given = failed + t.saturating_sub(w.base.1);
        if given < JUDGED_AFTER {
            return;
        }
        if failed as f64 > w.rate * given as f64 {
            w.failed = Some((failed, given));
            tracing::error!(aggregation = %self.name, failed, given, "the deployed plugin fails too often: it is not called again");
            self.plugin.halt(format!(
                "not called: it failed on {failed} of the first {given} events and windows it was given, and its deploy is rolled back"
            ));
        } else if given >= WATCHED_FOR {
            tracing::info!(aggregation = %self.name, failed, given, "the deployed plugin is kept");
            self.deploy_watch = None;
        }
    }
}

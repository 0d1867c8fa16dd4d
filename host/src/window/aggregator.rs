//! What a window operator needs from the user's logic, in the contract's terms
//! (`wit/aggregate.wit`): the WebAssembly [`Plugin`] in a job, a native double in the
//! window semantics' unit tests, which then run without WebAssembly.

use crate::plugin::{
    CallStats, Emitted, Events, Groups, Packed, Plugin, PluginIdentity, PluginInfo, Printed,
};
use crate::Result;

/// The user's aggregate logic, called with batches. Faults are [`crate::Error::PluginCall`]
/// errors; after one, [`Aggregator::reset`] gives a fresh instance.
pub trait Aggregator: Send {
    fn info(&self) -> &PluginInfo;
    fn identity(&self) -> &PluginIdentity;
    /// Fold each group's events into its accumulator.
    fn add(&mut self, groups: &Groups, events: &Events) -> Result<Packed>;
    /// Pairwise merge, `left` the earlier slot.
    fn merge(&mut self, left: &Packed, right: &Packed) -> Result<Packed>;
    /// The results of the groups' windows.
    fn finish(&mut self, groups: &Groups) -> Result<Vec<Emitted>>;
    /// Whether the logic folds and finishes closing windows in one call (a plugin that
    /// exports `fire`): then the window operator uses [`Aggregator::add_and_finish`].
    fn fires(&self) -> bool {
        false
    }
    /// Fold each group's events into its accumulator and give the results of the groups'
    /// windows, which close (their accumulators are not kept): what `add`, then `finish`
    /// of its accumulators gives (which is what this does where the logic has no call of
    /// its own; the accumulators replace `groups.accumulators`).
    fn add_and_finish(&mut self, groups: &mut Groups, events: &Events) -> Result<Vec<Emitted>> {
        add_then_finish(self, groups, events)
    }
    /// Whether the logic merges a sliding window's panes and finishes the window in one
    /// call (a plugin that exports `panes`): then the window operator uses
    /// [`Aggregator::merge_and_finish`].
    fn merges_panes(&self) -> bool {
        false
    }
    /// The results of the groups' windows, group `i` the merge of `counts[i]` consecutive
    /// accumulators of `panes`, earliest first (`groups.accumulators` holds an empty item
    /// per group): what `merge` of them, earliest first, then `finish` gives. Only called
    /// when [`Aggregator::merges_panes`]; refused otherwise.
    fn merge_and_finish(
        &mut self,
        _groups: &Groups,
        _panes: &Packed,
        _counts: &[u32],
    ) -> Result<Vec<Emitted>> {
        Err(crate::Error::PluginCall {
            plugin: self.identity().name.clone(),
            call: "merge-and-finish",
            message: "the logic does not merge panes".into(),
        })
    }
    /// Accumulators of state schema `from` in this logic's schema.
    fn migrate(&mut self, from: u32, accumulators: &Packed) -> Result<Packed>;
    /// A fresh instance after a fault (state lives in the host: nothing is lost).
    fn reset(&mut self) -> Result<()>;
    /// How its calls went (none counted: empty).
    fn calls(&self) -> CallStats {
        CallStats::default()
    }
    /// What the logic wrote to stdout and stderr lately (nothing: empty).
    fn printed(&self) -> Vec<Printed> {
        Vec::new()
    }
    /// Seconds its calls have taken.
    fn call_seconds(&self) -> f64 {
        self.calls().seconds
    }
    /// Let each of the next calls run at most `t` (and never past its own call timeout).
    fn limit_call_time(&mut self, _t: std::time::Duration) {}
}

impl Aggregator for Plugin {
    fn info(&self) -> &PluginInfo {
        Plugin::info(self)
    }

    fn identity(&self) -> &PluginIdentity {
        Plugin::identity(self)
    }

    fn add(&mut self, groups: &Groups, events: &Events) -> Result<Packed> {
        Plugin::add(self, groups, events)
    }

    fn merge(&mut self, left: &Packed, right: &Packed) -> Result<Packed> {
        Plugin::merge(self, left, right)
    }

    fn finish(&mut self, groups: &Groups) -> Result<Vec<Emitted>> {
        Plugin::finish(self, groups)
    }

    fn fires(&self) -> bool {
        Plugin::fires(self)
    }

    fn add_and_finish(&mut self, groups: &mut Groups, events: &Events) -> Result<Vec<Emitted>> {
        if Plugin::fires(self) {
            Plugin::add_and_finish(self, groups, events)
        } else {
            add_then_finish(self, groups, events)
        }
    }

    fn merges_panes(&self) -> bool {
        Plugin::merges_panes(self)
    }

    fn merge_and_finish(&mut self, groups: &Groups, panes: &Packed, counts: &[u32]) -> Result<Vec<Emitted>> {
        Plugin::merge_and_finish(self, groups, panes, counts)
    }

    fn migrate(&mut self, from: u32, accumulators: &Packed) -> Result<Packed> {
        Plugin::migrate(self, from, accumulators)
    }

    fn reset(&mut self) -> Result<()> {
        Plugin::reset(self)
    }

    fn calls(&self) -> CallStats {
        Plugin::calls(self).clone()
    }

    fn printed(&self) -> Vec<Printed> {
        Plugin::printed(self)
    }

    fn call_seconds(&self) -> f64 {
        Plugin::calls(self).seconds
    }

    fn limit_call_time(&mut self, t: std::time::Duration) {
        Plugin::limit_call_time(self, t)
    }
}

/// [`Aggregator::add_and_finish`] in two calls.
fn add_then_finish<A: Aggregator + ?Sized>(
    a: &mut A,
    groups: &mut Groups,
    events: &Events,
) -> Result<Vec<Emitted>> {
    groups.accumulators = a.add(groups, events)?;
    a.finish(groups)
}

//! The operator's state out and in: captured for checkpoints and savepoints, changes for
//! the incremental backend, restored, migrated to a new state schema, and a live swap of
//! its plugin.

use super::*;

impl WindowOperator {
    /// Keep track of what changes, for a backend that writes only the changes at each
    /// checkpoint; everything open now counts as changed.
    pub fn track_changes(&mut self) {
        self.state.touch_all();
        self.removed = Some(Vec::new());
    }

    /// Accumulators converted by `plugin`'s `migrate` from state schema `from`, one per
    /// open slot in the state's order, for [`Self::swap_plugin`]; the operator is not
    /// changed (a refusal leaves it as it was).
    pub fn migrated(&self, plugin: &mut dyn Aggregator, from: u32) -> Result<Vec<Packed>> {
        let accs: Vec<&[u8]> = self.state.iter().map(|(_, _, s)| s.acc.as_slice()).collect();
        let mut out = Vec::with_capacity(accs.len() / self.batch_size.max(1) + 1);
        for chunk in accs.chunks(self.batch_size.max(1)) {
            out.push(plugin.migrate(from, &packed_of(chunk.iter().copied()))?);
        }
        Ok(out)
    }

    /// Run `plugin` from now on (a live deploy), as restoring a savepoint of this operator
    /// with it would: accumulators replaced by `migrated` (from [`Self::migrated`], when
    /// the state schema changes), rows held for an ordered plugin handed over again (their
    /// slots start from a fresh accumulator). Unordered plugins must have been flushed;
    /// the caller sets the new plugin's columns ([`Self::set_columns`]). Returns the old
    /// plugin.
    pub fn swap_plugin(
        &mut self,
        plugin: Box<dyn Aggregator>,
        migrated: Option<Vec<Packed>>,
    ) -> Box<dyn Aggregator> {
        if let Some(chunks) = migrated {
            // The state has not changed since: its order is the one migrated.
            let mut accs = chunks.iter().flat_map(|m| (0..m.ends.len()).map(move |i| packed_item(m, i)));
            self.state.replace_accs(|| accs.next().unwrap_or_default());
        }
        // Rows in the order a savepoint holds them: held (by key, then slot), then staged.
        let mut held: Vec<((u32, i64), SlotRows)> = self.held.drain().collect();
        held.sort_by(|a, b| (self.keys.encoded(a.0 .0), a.0 .1).cmp(&(self.keys.encoded(b.0 .0), b.0 .1)));
        let staged = self.batch.rows();
        let types: Vec<FieldType> = plugin.info().fields.iter().map(|f| f.type_).collect();
        self.batch = new_batch(&types, self.key_arity, plugin.info().ordered_input, self.assigner.periodic());
        for ((k, id), rows) in held {
            self.state.set_acc(k, id, &[]);
            rows.iter().for_each(|(time, values)| self.batch.push_values(k, id, time, values));
        }
        staged.iter().for_each(|r| self.batch.push(r));
        self.reopened.clear();
        // A new plugin: no key has failed it yet, and it is on probation only if the job
        // watches it.
        self.quarantine.clear();
        self.deploy_watch = None;
        std::mem::replace(&mut self.plugin, plugin)
    }

    /// Take the place of `old` (a shadow promoted over it), as an operator restored with
    /// this plugin from a savepoint of `old` would stand: `old`'s counters (the job wrote
    /// `old`'s results so far), the pipeline's fault handling `on_error` (a shadow
    /// dead-letters whatever it says), no key quarantined (a shadow's faults were never the
    /// job's). When `old` keeps an incremental backend's copy up to date, this operator
    /// rewrites it whole at the next checkpoint: every slot of `old` deleted from it,
    /// every slot of this one written.
    pub fn take_place_of(&mut self, old: &mut WindowOperator, on_error: OnError) {
        self.counters = old.counters.clone();
        self.on_error = on_error;
        self.quarantine.clear();
        if let Some(mut removed) = old.removed.take() {
            removed.extend(old.state.iter().map(|(k, id, _)| (old.keys.encoded(k).to_vec(), id)));
            self.state.touch_all();
            self.removed = Some(removed);
        }
    }

    /// Where the plugin's columns are in the decoder's projection (the decoder was rebuilt
    /// because another aggregation's plugin was swapped).
    pub fn set_columns(&mut self, column_slots: Vec<usize>) {
        let types = self.plugin.info().fields.iter().map(|f| f.type_);
        self.columns = column_slots.into_iter().zip(types).collect();
    }

    /// The rows held for an ordered plugin, when one of them does not `fit` (a plugin
    /// about to take them): how many there are, and the first that does not. (An
    /// unordered plugin's staged rows are its own: they are flushed to it first.)
    pub fn unfit_row(&self, fits: impl Fn(&[Value]) -> bool) -> Option<(usize, SavedRow)> {
        if !self.batch.ordered() {
            return None;
        }
        let rows = self.saved_rows();
        let n = rows.len();
        rows.into_iter().find(|r| !fits(&r.values)).map(|r| (n, r))
    }

    /// What changed since the last call (unordered plugins must have been flushed).
    pub fn take_changes(&mut self) -> crate::state::rocks::Changes {
        let puts = self.state.capture(&self.keys, true);
        let rows = self.saved_rows();
        let deletes = self.removed.as_mut().map(std::mem::take).unwrap_or_default();
        crate::state::rocks::Changes { puts, deletes, rows }
    }

    /// The operator's state for a snapshot: unordered plugins are flushed first, so only
    /// ordered plugins leave staged rows (of incomplete slots).
    pub fn capture(&mut self) -> Result<Capture> {
        if !self.batch.ordered() {
            self.flush(None)?;
        }
        self.drop_doomed();
        Ok(Capture { slots: self.all_slots(), rows: self.saved_rows(), counters: self.counters.clone() })
    }

    /// Every open slot, in the state's order, with the key table they refer to.
    pub(super) fn all_slots(&mut self) -> CapturedSlots {
        self.state.capture(&self.keys, false)
    }

    /// Rows an ordered plugin holds, for checkpoints: those handed over (held until their
    /// slot is cleaned up), then those staged, in arrival order.
    pub(super) fn saved_rows(&self) -> Vec<SavedRow> {
        let keys = &self.keys;
        let mut rows = self.held_rows();
        rows.extend(self.batch.rows().into_iter().map(|r| SavedRow {
            key: keys.encoded(r.key).to_vec(),
            id: r.id,
            time: r.time,
            values: r.values,
        }));
        rows
    }

    /// Load a savepoint's state (accumulators already migrated) at watermark `wm`.
    /// Saved rows go back into the batch; a slot with saved rows starts from an empty
    /// accumulator and is rebuilt from all of them (its rows were either all handed over
    /// or none were), which gives the accumulator an uninterrupted run holds.
    /// `rows_cover_slots`: the savepoint holds every row of a slot that has rows (km0
    /// since contract 0.2); an older one may hold an accumulator and later rows of the
    /// same slot, and both are kept.
    pub fn restore(&mut self, snap: &Snapshot, wm: i64, rows_cover_slots: bool) -> Result<()> {
        self.state.reserve(snap.slots.len());
        self.keys.reserve(snap.slots.len());
        for s in &snap.slots {
            let k = self.keys.intern(&s.key);
            self.state.open_with(k, s.id, s.window, &s.acc);
            let armed = self.schedule(k, s.id, s.window, wm);
            if matches!(self.assigner, Assigner::Session { .. }) {
                // One that has fired was written; one that fired and grew since (armed
                // again) is not known to have been: its retraction is the rare loss of a
                // restore (see the README's Retractions).
                self.sessions.push(k, SessionRef { id: s.id, armed, written: !armed, at: NO_SLOT });
                self.next_session = self.next_session.max(s.id + 1);
            }
        }
        for r in &snap.rows {
            let k = self.keys.intern(&r.key);
            self.batch.push_values(k, r.id, r.time, &r.values);
            if rows_cover_slots {
                self.state.set_acc(k, r.id, &[]);
            }
        }
        self.counters = snap.counters.clone();
        Ok(())
    }

    /// Run the plugin's `migrate` over every saved accumulator (deploy of a new version).
    pub fn migrate(&mut self, from_schema: u32, snap: &mut Snapshot) -> Result<()> {
        let mut out = Vec::with_capacity(snap.slots.len());
        for chunk in snap.slots.chunks(self.batch_size.max(1)) {
            let m = self.plugin.migrate(from_schema, &packed_of(chunk.iter().map(|s| s.acc.as_slice())))?;
            out.extend((0..chunk.len()).map(|i| packed_item(&m, i).to_vec()));
        }
        for (s, acc) in snap.slots.iter_mut().zip(out) {
            s.acc = acc;
        }
        Ok(())
    }
}

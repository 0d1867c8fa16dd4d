//! Staged events to plugin calls: the columns each event fills, batches flushed before
//! any window fires, rows an ordered plugin gets once their slot is complete (held until
//! it is cleaned up), and one-by-one calls that isolate a fault.

use super::*;

impl WindowOperator {
    /// Check the plugin's columns in a projected record; the reason names the field.
    /// Numbers are checked inline (an integer column's integer, a float column's number:
    /// the reference plugins' columns), others out of line.
    #[inline]
    pub fn check(&self, slots: &[Option<Scalar>], names: &[String]) -> Result<(), String> {
        for &(slot, ty) in &self.columns {
            let fits = matches!(
                (ty, &slots[slot]),
                (FieldType::Int, Some(Scalar::Int(_)))
                    | (FieldType::Float, Some(Scalar::Number(_) | Scalar::Int(_)))
            );
            if !fits {
                check_column(slot, ty, &slots[slot], names)?;
            }
        }
        Ok(())
    }

    /// Stage a checked record's plugin columns: integers inline (the reference plugins'
    /// columns), the other types out of line (the parse of a float, the check of a text,
    /// kept out of the loop around every record).
    #[inline(always)]
    pub(super) fn stage_columns(&mut self, slots: &[Option<Scalar>]) {
        for (col, &(slot, ty)) in self.columns.iter().enumerate() {
            match (ty, slots[slot]) {
                (FieldType::Int, Some(Scalar::Int(v))) => self.batch.push_int(col, v),
                (ty, value) => stage_value(&mut self.batch, col, ty, value),
            }
        }
    }

    /// Hand staged rows to the plugin: all of them, or for ordered plugins those whose
    /// slot is complete at watermark `ready`.
    pub fn flush(&mut self, ready: Option<i64>) -> Result<()> {
        self.hand_over(if self.batch.ordered() { Some(ready.unwrap_or(i64::MAX)) } else { None })
    }

    /// Before the windows due at watermark `wm` fire: the rows of the complete slots reach
    /// the plugin. Tumbling windows and sliding panes of an unordered plugin hand over
    /// just those too, so that a window's rows mostly reach the plugin in one group, at its
    /// end, not in one group per batch that saw them (their windows fire together, once a
    /// period: the rows that stay are not gone over again and again, as they would be
    /// between sessions that end one by one).
    pub(super) fn flush_before_firing(&mut self, wm: i64) -> Result<()> {
        if self.assigner.periodic() && !self.batch.ordered() {
            self.hand_over(Some(wm))
        } else {
            self.flush(Some(wm))
        }
    }

    /// Hand the staged rows of the slots complete at watermark `ready` (None: all) to the
    /// plugin.
    pub(super) fn hand_over(&mut self, ready: Option<i64>) -> Result<()> {
        if self.batch.is_empty() {
            return Ok(());
        }
        let groups = self.batch.assemble(&self.keys, &self.state, ready);
        if groups.is_empty() {
            self.batch.recycle(groups);
            return Ok(());
        }
        if self.quarantine.any() && self.on_error == OnError::DeadLetter {
            let (faulted, rest): (Vec<usize>, Vec<usize>) =
                (0..groups.len()).partition(|&i| self.quarantine.faulted(groups[i].0));
            if !faulted.is_empty() {
                self.add_apart(&groups, &rest, &faulted)?;
                self.batch.recycle(groups);
                return Ok(());
            }
        }
        let called = if std::mem::take(&mut self.isolate_next) {
            Err(Error::PluginCall {
                plugin: self.identity().name.clone(),
                call: "add-and-finish",
                message: "failed on these rows".into(),
            })
        } else {
            self.plugin.add(&self.batch.groups, &self.batch.events)
        };
        let accs = match called {
            Ok(accs) => accs,
            Err(e @ Error::PluginCall { .. }) if self.on_error == OnError::DeadLetter => {
                tracing::warn!(error = %e, "plugin fault: isolating the groups of the batch");
                self.plugin.reset()?;
                let all: Vec<usize> = (0..groups.len()).collect();
                self.add_one_by_one(&groups, &all)?;
                self.batch.recycle(groups);
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        for (i, &(key, id)) in groups.iter().enumerate() {
            self.hold(i, key, id);
            self.state.set_acc_at(self.batch.call_slots[i], key, id, packed_item(&accs, i));
        }
        self.batch.recycle(groups);
        Ok(())
    }

    /// A batch with groups of keys that faulted before (`faulted`): the other groups in
    /// one call (one by one after a fault), then each suspect's in a call of its own, so
    /// that a key that fails again costs one call, not the batch's and its own; the rows
    /// of a quarantined key (staged before it was) go to the dead letters without a call.
    fn add_apart(&mut self, groups: &[(u32, i64)], rest: &[usize], faulted: &[usize]) -> Result<()> {
        if !rest.is_empty() {
            let (g, ev) = self.batch.subset(rest);
            match self.plugin.add(&g, &ev) {
                Ok(accs) => {
                    for (j, &i) in rest.iter().enumerate() {
                        let (key, id) = groups[i];
                        self.hold(i, key, id);
                        self.state.set_acc(key, id, packed_item(&accs, j));
                    }
                }
                Err(e @ Error::PluginCall { .. }) => {
                    tracing::warn!(error = %e, "plugin fault: isolating the groups of the batch");
                    self.plugin.reset()?;
                    self.add_one_by_one(groups, rest)?;
                }
                Err(e) => return Err(e),
            }
        }
        let (held, suspects): (Vec<usize>, Vec<usize>) =
            faulted.iter().partition(|&&i| self.quarantine.holds(groups[i].0));
        for i in held {
            let (g, ev) = self.batch.subset(&[i]);
            let reason = self.quarantine.reason(groups[i].0);
            self.reject_group(groups[i], &g, ev.event_time, Err(reason));
        }
        self.add_one_by_one(groups, &suspects)
    }

    /// Ordered plugins: group `i` of the last call succeeded; keep its rows for a later
    /// rebuild when the call started from the fresh accumulator (then they are all of the
    /// slot's rows; a slot restored from an older savepoint with an accumulator and no rows
    /// just takes later rows in arrival order). Call before its accumulator is replaced.
    pub(super) fn hold(&mut self, i: usize, key: u32, id: i64) {
        // Slots handed over as they end keep nothing. (Another flush may take a complete
        // slot too: one restored with its timers due, before the watermark moves.)
        if !self.batch.ordered() || self.handing_over_to_close {
            return;
        }
        if !self.reopened.is_empty() {
            self.reopened.remove(&(key, id));
        }
        if self.state.acc(key, id).is_empty() {
            self.held.insert((key, id), self.batch.call_rows(i));
        }
    }

    /// Ordered plugins: a row is about to reach slot `(key, id)`; if the slot was handed
    /// over already, its rows go back into the batch and its accumulator starts afresh,
    /// so the next hand-over gives the plugin all of the slot's rows in order.
    pub(super) fn reopen(&mut self, key: u32, id: i64) {
        if self.held.is_empty() {
            return;
        }
        if let Some(rows) = self.held.remove(&(key, id)) {
            for (time, values) in rows.iter() {
                self.batch.push_values(key, id, time, values);
            }
            let acc = self.state.acc(key, id).to_vec();
            self.state.set_acc(key, id, &[]);
            self.reopened.insert((key, id), (acc, rows));
        }
    }

    /// Rows held for ordered plugins, in a deterministic order (by key, then slot).
    pub(super) fn held_rows(&self) -> Vec<SavedRow> {
        let mut slots: Vec<(&[u8], i64, &SlotRows)> =
            self.held.iter().map(|(&(k, id), rows)| (self.keys.encoded(k), id, rows)).collect();
        slots.sort_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)));
        slots
            .into_iter()
            .flat_map(|(key, id, rows)| {
                rows.iter().map(move |(time, values)| SavedRow {
                    key: key.to_vec(),
                    id,
                    time,
                    values: values.to_vec(),
                })
            })
            .collect()
    }

    /// One call per group `which` of the batch (after a fault: with a fresh instance);
    /// the groups that fail are dead-lettered (their accumulators stay as they were).
    pub(super) fn add_one_by_one(&mut self, groups: &[(u32, i64)], which: &[usize]) -> Result<()> {
        for &i in which {
            let (key, id) = groups[i];
            let (g, ev) = self.batch.subset(&[i]);
            match self.plugin.add(&g, &ev) {
                Ok(acc) => {
                    if self.quarantine.any() {
                        self.quarantine.passed(key);
                    }
                    self.hold(i, key, id);
                    self.state.set_acc(key, id, packed_item(&acc, 0));
                }
                Err(e @ Error::PluginCall { .. }) => {
                    self.plugin.reset()?;
                    self.reject_group((key, id), &g, ev.event_time, Ok(e.to_string()));
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Dead-letter the rows `times` of group `(key, id)` (`g`, a call of that group alone)
    /// for a fault (`Ok(reason)`, counted against the key) or a quarantine (`Err(reason)`);
    /// the slot keeps the accumulator it had.
    fn reject_group(
        &mut self,
        (key, id): (u32, i64),
        g: &Groups,
        mut times: Vec<i64>,
        reason: std::result::Result<String, String>,
    ) {
        if let Some((acc, rows)) = self.reopened.remove(&(key, id)) {
            // A rebuild failed: the slot keeps what it had; only the rows that reached it
            // since are rejected.
            for (time, _) in rows.iter() {
                if let Some(at) = times.iter().position(|&t| t == time) {
                    times.remove(at);
                }
            }
            self.state.set_acc(key, id, &acc);
            self.held.insert((key, id), rows);
        } else if self.state.acc(key, id).is_empty() {
            // Every event the slot had is rejected: it has nothing to fire.
            self.doomed.push((key, id));
        }
        self.counters.accepted -= times.len() as u64;
        let window = Window { start: g.window_start[0], end: g.window_end[0] };
        match reason {
            Ok(fault) => self.reject(key, window, times, fault),
            Err(quarantined) => {
                self.counters.quarantined += times.len() as u64;
                self.taint(key, window, false);
                let key = self.key_text(key);
                self.rejected.push(Rejected { key, window, event_times: times, reason: quarantined });
            }
        }
    }

    /// Give all staged rows of an unordered plugin to it (ordered plugins keep theirs).
    pub fn flush_unordered(&mut self) -> Result<()> {
        if !self.batch.ordered() {
            self.flush(None)?;
        }
        self.drop_doomed();
        Ok(())
    }
}

/// The batch of an operator whose slot ids are periods many keys share (`periodic`) or
/// not (sessions).
pub(super) fn new_batch(types: &[FieldType], key_arity: usize, ordered: bool, periodic: bool) -> Batch {
    let batch = Batch::new(types, key_arity, ordered);
    if periodic {
        batch.by_period()
    } else {
        batch
    }
}

/// [`WindowOperator::stage_columns`] for a value that is not an integer column's.
#[inline(never)]
pub(super) fn stage_value(batch: &mut Batch, col: usize, ty: FieldType, value: Option<Scalar>) {
    match (ty, value) {
        (FieldType::Int, Some(Scalar::Int(v))) => batch.push_int(col, v),
        (FieldType::Float, Some(Scalar::Int(v))) => batch.push_float(col, v as f64),
        (FieldType::Float, Some(Scalar::Number(raw))) => {
            batch.push_float(col, crate::source::json::number_f64(raw).unwrap_or(f64::NAN))
        }
        (FieldType::Boolean, Some(Scalar::Bool(b))) => batch.push_bool(col, b),
        (FieldType::Text, Some(s)) => {
            let text = match s.as_str() {
                Some(Ok(t)) => t,
                _ => Cow::Borrowed(""),
            };
            batch.push_text(col, &text)
        }
        _ => unreachable!("columns are checked before staging"),
    }
}

/// [`WindowOperator::check`] of one plugin column: the value in `slot` has type `ty`.
#[inline(never)]
pub(super) fn check_column(
    slot: usize,
    ty: FieldType,
    value: &Option<Scalar>,
    names: &[String],
) -> Result<(), String> {
    let Some(v) = value else { return Err(format!("missing field `{}`", names[slot])) };
    let ok = match (ty, v) {
        (FieldType::Int, Scalar::Int(_)) => true,
        (FieldType::Float, Scalar::Int(_)) => true,
        // The scanner yields only JSON number syntax, which always parses as an
        // f64 (out of range: infinite); it is parsed once, when staged.
        (FieldType::Float, Scalar::Number(_)) => true,
        (FieldType::Boolean, Scalar::Bool(_)) => true,
        (FieldType::Text, s @ Scalar::Str { .. }) => match s.as_str() {
            Some(Ok(_)) => true,
            Some(Err(e)) => return Err(format!("field `{}`: {}", names[slot], e.message)),
            None => false,
        },
        _ => false,
    };
    if !ok {
        let want = match ty {
            FieldType::Int => "an integer",
            FieldType::Float => "a number",
            FieldType::Text => "a string",
            FieldType::Boolean => "a boolean",
        };
        return Err(format!("field `{}`: expected {want}, got {}", names[slot], v.kind()));
    }
    Ok(())
}

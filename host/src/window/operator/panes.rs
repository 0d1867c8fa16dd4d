//! Sliding windows built from panes: which pane arms a window's timer, and a window's
//! result as the in-order merge of its panes (one `merge-and-finish` call, or `merge`
//! then `finish` after a fault).

use super::*;

impl WindowOperator {
    /// Sliding windows: the last end whose timer a pane of `key` before `slot` set, or
    /// i64::MIN. Each of the key's windows that holds an open pane has its timer pending
    /// once the watermark is below its end: every pane, when it opens, sets the timers of
    /// its windows after the watermark except those an earlier open pane of the key is in
    /// (which therefore have theirs), and a timer goes only when the watermark reaches
    /// it. So the nearest earlier open pane's windows (the ends up to its last, which
    /// are also ends of `slot`'s windows that far, both on the slide's grid) have theirs.
    /// A stream in order sets one timer a pane, not one per window of the pane.
    pub(super) fn armed_by_earlier_pane(&self, key: u32, slot: Window) -> i64 {
        let Assigner::Sliding { size, slide } = self.assigner else { return i64::MIN };
        // Panes are `slide` long, one after another.
        let mut start = slot.start;
        loop {
            start = start.saturating_sub(slide);
            // Panes this far back share no window with `slot`.
            if start <= slot.start.saturating_sub(size) {
                return i64::MIN;
            }
            if self.state.handle(key, start).is_some() {
                return self.assigner.last_end(Window { start, end: start.saturating_add(slide) });
            }
        }
    }

    /// Sliding windows of a plugin that exports `panes`: each window's panes merged and
    /// the window finished in one call ([`Aggregator::merge_and_finish`]) per batch of
    /// windows; nothing is written back (the panes stay as they are). After a fault that
    /// `on_error` dead-letters, the windows of that call take `merge` and `finish` calls,
    /// which isolate it, and so do the next [`FIRE_PAUSE`] firings.
    pub(super) fn emit_panes(
        &mut self,
        fires: &[(u32, i64)],
        size: i64,
        slide: i64,
        out: &mut Vec<Emitted>,
    ) -> Result<()> {
        let (mut windows, panes) = self.find_panes(fires, size, slide);
        let mut placed = Vec::new();
        order_windows(&mut self.keys, &mut windows, &mut self.by_rank, &mut placed);
        let mut accs = std::mem::replace(&mut self.pane_accs, crate::plugin::empty_packed());
        let mut counts = Vec::new();
        for chunk in windows.chunks(self.batch_size) {
            if self.panes_paused > 0 {
                // A call of this firing faulted: the rest go the way that isolates faults.
                self.merge_and_finish_apart(chunk, size, slide, out)?;
                continue;
            }
            fill_groups(&mut self.fire_groups, &self.keys, chunk.iter().map(|&(k, w, _)| (k, w, &[][..])));
            packed_clear(&mut accs);
            counts.clear();
            for &(k, _, (from, to)) in chunk {
                for &(p, h) in &panes[from as usize..to as usize] {
                    packed_push(&mut accs, self.state.acc_at(h, k, p));
                }
                counts.push(to - from);
            }
            let arity = self.fire_groups.key_arity as usize;
            match self.plugin.merge_and_finish(&self.fire_groups, &accs, &counts) {
                Ok(emitted) => {
                    let whole_call = self.fire_groups.keys.ends.len() == chunk.len() * arity;
                    self.counters.windows_fired += chunk.len() as u64;
                    self.write_results(emitted, chunk, whole_call.then_some(CallGroups::Finish), out)?;
                }
                Err(e @ Error::PluginCall { .. }) if self.on_error == OnError::DeadLetter => {
                    tracing::warn!(error = %e, "plugin fault in merge-and-finish: merging and finishing apart");
                    self.plugin.reset()?;
                    self.panes_paused = FIRE_PAUSE;
                    self.merge_and_finish_apart(chunk, size, slide, out)?;
                }
                // The job stops: the scratch buffer goes with it.
                Err(e) => return Err(e),
            }
        }
        self.pane_accs = accs;
        Ok(())
    }

    /// Windows (in the order their results are written) merged pairwise, then finished:
    /// calls that isolate a fault to the windows that cause it.
    pub(super) fn merge_and_finish_apart(
        &mut self,
        windows: &[(u32, Window, (u32, u32))],
        size: i64,
        slide: i64,
        out: &mut Vec<Emitted>,
    ) -> Result<()> {
        let fires: Vec<(u32, i64)> = windows.iter().map(|&(k, w, _)| (k, w.end)).collect();
        let merged = self.merge_panes(&fires, size, slide)?;
        self.finish_windows(&merged, out)
    }

    /// The open panes of each sliding window in `fires` (key, end), earliest first: the
    /// windows that have one, each with its range in the panes' (id, handle) list.
    #[allow(clippy::type_complexity)]
    pub(super) fn find_panes(
        &self,
        fires: &[(u32, i64)],
        size: i64,
        slide: i64,
    ) -> (Vec<(u32, Window, (u32, u32))>, Vec<(i64, SlotHandle)>) {
        let mut windows = Vec::with_capacity(fires.len());
        let mut panes: Vec<(i64, SlotHandle)> = Vec::with_capacity(fires.len() * (size / slide) as usize);
        // The panes' periods, looked for once per end: the windows of one end (most of a
        // firing's, one per key) share them, and `at` holds where they are in `periods`
        // for the end `at_end`. Fires come by end, so a pane's period is among the last
        // few found (a call that fires many ends, at the input's end, does not search them
        // all; ends far apart may find a period again, which costs a lookup).
        let n_panes = (size / slide) as usize;
        let mut periods: Vec<(i64, PeriodSlots)> = Vec::new();
        let (mut at, mut at_end) = (Vec::with_capacity(n_panes), None);
        for &(k, end) in fires {
            let start = end - size;
            if at_end != Some(end) {
                at.clear();
                for p in (0..size / slide).map(|i| start + i * slide) {
                    let recent = periods.len().saturating_sub(2 * n_panes);
                    at.push(match periods[recent..].iter().rposition(|(id, _)| *id == p) {
                        Some(at) => recent + at,
                        None => {
                            periods.push((p, self.state.period(p)));
                            periods.len() - 1
                        }
                    });
                }
                at_end = Some(end);
            }
            let first = panes.len();
            for &i in &at {
                let (p, slots) = &periods[i];
                if let Some(h) = slots.handle(k) {
                    panes.push((*p, h));
                }
            }
            if panes.len() > first {
                windows.push((k, Window { start, end }, (first as u32, panes.len() as u32)));
            }
        }
        (windows, panes)
    }

    /// Merge each sliding window's panes, earliest first, in rounds of batched calls.
    pub(super) fn merge_panes(
        &mut self,
        fires: &[(u32, i64)],
        size: i64,
        slide: i64,
    ) -> Result<Vec<(u32, Window, Acc)>> {
        let (found, panes) = self.find_panes(fires, size, slide);
        let mut windows: Vec<(u32, Window, Acc)> = found
            .iter()
            .map(|&(k, w, (from, _))| {
                let (p, h) = panes[from as usize];
                (k, w, Acc::from_slice(self.state.acc_at(h, k, p)))
            })
            .collect();
        let panes = |w: usize| &panes[found[w].2 .0 as usize..found[w].2 .1 as usize];
        let rounds = (0..windows.len()).map(|w| panes(w).len()).max().unwrap_or(0);
        let mut failed: Vec<Option<String>> = vec![None; windows.len()];
        for r in 1..rounds {
            let todo: Vec<usize> =
                (0..windows.len()).filter(|&w| panes(w).len() > r && failed[w].is_none()).collect();
            let left = packed_of(todo.iter().map(|&w| windows[w].2.as_slice()));
            let right = packed_of(todo.iter().map(|&w| {
                let (p, h) = panes(w)[r];
                self.state.acc_at(h, windows[w].0, p)
            }));
            let (merged, faults) = self.merge_pairs(&left, &right)?;
            for (i, &w) in todo.iter().enumerate() {
                match &faults[i] {
                    None => {
                        // Into the accumulator's own buffer: no allocation once it is large enough.
                        let acc = &mut windows[w].2;
                        acc.clear();
                        acc.extend_from_slice(packed_item(&merged, i));
                    }
                    Some(reason) => failed[w] = Some(reason.clone()),
                }
            }
        }
        // Windows whose panes could not be merged are dead-lettered, not emitted.
        let mut kept = Vec::with_capacity(windows.len());
        for (w, reason) in windows.into_iter().zip(failed) {
            match reason {
                None => kept.push(w),
                Some(reason) => self.reject(w.0, w.1, Vec::new(), reason),
            }
        }
        Ok(kept)
    }

    /// Merge pairwise in one call: the merged accumulators, and per pair the fault that
    /// kept it from merging (its merged item is then empty). After a fault (with
    /// `on_error = "dead_letter"`), a fresh instance and one call per pair, so that only the
    /// pairs that fail again fail.
    pub(super) fn merge_pairs(
        &mut self,
        left: &Packed,
        right: &Packed,
    ) -> Result<(Packed, Vec<Option<String>>)> {
        let n = left.ends.len();
        match self.plugin.merge(left, right) {
            Ok(m) => Ok((m, vec![None; n])),
            Err(e @ Error::PluginCall { .. }) if self.on_error == OnError::DeadLetter => {
                tracing::warn!(error = %e, "plugin fault in merge: isolating the pairs");
                self.plugin.reset()?;
                let mut merged = packed_of(std::iter::empty());
                let mut faults = Vec::with_capacity(n);
                for i in 0..n {
                    let (l, r) = (
                        packed_of([packed_item(left, i)].into_iter()),
                        packed_of([packed_item(right, i)].into_iter()),
                    );
                    match self.plugin.merge(&l, &r) {
                        Ok(m) => {
                            packed_push(&mut merged, packed_item(&m, 0));
                            faults.push(None);
                        }
                        Err(e @ Error::PluginCall { .. }) => {
                            self.plugin.reset()?;
                            packed_push(&mut merged, &[]);
                            faults.push(Some(e.to_string()));
                        }
                        Err(e) => return Err(e),
                    }
                }
                Ok((merged, faults))
            }
            Err(e) => Err(e),
        }
    }
}

//! Session windows: a key's open sessions, an event that opens, grows or bridges them
//! (merging their accumulators), and the retraction of a result written under a start
//! that a merge superseded.

use super::*;

/// An open session of a key. Session timers are lazy: when a session grows, its pending
/// `Fire` timer stays where it was and, when it comes due, moves to the session's new
/// end; only a session that has already fired (within its allowed lateness) gets a new
/// timer when it grows.
#[derive(Debug, Clone, Copy)]
pub(super) struct SessionRef {
    pub(super) id: i64,
    /// A `Fire` timer is pending for this session.
    pub(super) armed: bool,
    /// Its result has been written under its window's start: when it merges under
    /// another start, that result is retracted (it may have grown since, and be armed
    /// again).
    pub(super) written: bool,
    /// Where its slot was last found (checked before use: see [`WindowState::slot_at`]).
    pub(super) at: SlotHandle,
}

/// Each key's open sessions, by key id (ids are dense and reused: see [`KeyTable`]), a
/// key's first session inline: found by one load, not a hash probe.
#[derive(Default)]
pub(super) struct SessionLists(Vec<SmallVec<[SessionRef; 1]>>);

impl SessionLists {
    /// The sessions of `key` (none: empty).
    #[inline]
    pub(super) fn of(&self, key: u32) -> &[SessionRef] {
        self.0.get(key as usize).map_or(&[], |l| l.as_slice())
    }

    #[inline]
    pub(super) fn of_mut(&mut self, key: u32) -> Option<&mut SmallVec<[SessionRef; 1]>> {
        self.0.get_mut(key as usize)
    }

    pub(super) fn push(&mut self, key: u32, r: SessionRef) {
        let k = key as usize;
        if self.0.len() <= k {
            self.0.resize_with(k + 1, SmallVec::new);
        }
        self.0[k].push(r);
    }

    /// Keep the sessions of `key` that `keep` says, giving back a list's heap room
    /// when it is left empty.
    pub(super) fn retain(&mut self, key: u32, mut keep: impl FnMut(&SessionRef) -> bool) {
        if let Some(list) = self.0.get_mut(key as usize) {
            list.retain(|r| keep(r));
            if list.is_empty() && list.spilled() {
                *list = SmallVec::new();
            }
        }
    }
}

impl WindowOperator {
    /// Sessions: the event's own window `[t, t + gap]` (half-open: `[t, t + gap + 1)`)
    /// merges with every session of the key it overlaps.
    pub(super) fn on_session_event(
        &mut self,
        key: &[u8],
        t: i64,
        wm: i64,
        slots: &[Option<Scalar>],
        out: &mut Vec<Emitted>,
    ) -> Result<Verdict> {
        let own = self.assigner.slot(t);
        let Some(k) = self.key_id(key) else { return Ok(Verdict::InvalidKey) };
        if self.quarantine.holds(k) {
            return Ok(self.quarantined_event(k, own, t));
        }
        // The merged window, the earliest overlapping session and how many overlap.
        let mut merged = own;
        let mut first: Option<(Window, usize)> = None;
        let mut count = 0;
        // Whether a session it joins has fired already (its end is behind the watermark),
        // and the starts of those that did: their results were written under their start.
        let mut refires = false;
        let mut fired_starts: Vec<i64> = Vec::new();
        let list = self.sessions.of_mut(k).map_or(&mut [][..], |l| l.as_mut_slice());
        for (i, r) in list.iter_mut().enumerate() {
            // Through the handle kept with the session (a lookup only when it went stale).
            let Some(at) = self.state.handle_at(r.at, k, r.id) else { continue };
            r.at = at;
            let w = self.state.slot_by(at).window;
            if w.overlaps(&own) {
                count += 1;
                if w.end <= wm {
                    refires = true;
                }
                if r.written {
                    fired_starts.push(w.start);
                }
                merged = merged.union(&w);
                if first.is_none_or(|(f, _)| w < f) {
                    first = Some((w, i));
                }
            }
        }
        if merged.end.saturating_add(self.lateness) <= wm {
            return Ok(Verdict::Late { window: merged });
        }
        let id = match first {
            None => {
                let id = self.next_session;
                self.next_session += 1;
                let (at, _) = self.state.open_at(k, id, own);
                let armed = self.schedule(k, id, own, wm);
                self.sessions.push(k, SessionRef { id, armed, written: false, at });
                id
            }
            Some((first_window, i)) => {
                let target = list[i];
                self.join_session(k, target, count > 1, &own, first_window, merged, wm)?;
                target.id
            }
        };
        self.batch.push_row(k, id, t);
        self.stage_columns(slots);
        self.counters.accepted += 1;
        // A fired session that now has another start is superseded: retract its key, so an
        // upsert consumer keeps one row per session.
        fired_starts.sort_unstable();
        for start in fired_starts.into_iter().filter(|&s| s != merged.start) {
            let key = self.result_key(start, k);
            self.counters.retracted += 1;
            out.push(Emitted { key, value: None });
        }
        if merged.end <= wm {
            // The session is complete (within the allowed lateness): emit it now, again if
            // it had fired.
            if refires {
                self.counters.late_updates += 1;
            }
            self.flush(Some(wm))?;
            self.emit(&[(k, id)], out, false)?;
            self.set_written(k, id, true);
        } else if self.batch.len() >= self.batch_size {
            self.flush(Some(wm))?;
        }
        Ok(Verdict::Accepted)
    }

    /// The event of window `own` joins session `target` of key `k` (the earliest it
    /// overlaps, whose window was `first_window`), folding the others it overlaps (`more`)
    /// into it: the session grows to `merged`, and fires again if it had fired.
    #[allow(clippy::too_many_arguments)]
    fn join_session(
        &mut self,
        k: u32,
        target: SessionRef,
        more: bool,
        own: &Window,
        first_window: Window,
        merged: Window,
        wm: i64,
    ) -> Result<()> {
        self.reopen(k, target.id);
        if more {
            self.merge_sessions(k, target.id, own)?;
        }
        if merged.start != first_window.start {
            // Not written under its new start (its old one is retracted below).
            self.set_written(k, target.id, false);
        }
        if merged != first_window {
            self.state.set_window_at(target.at, k, target.id, merged);
            if !target.armed && merged.end > wm {
                // It fired already; fire again when the grown session closes.
                self.state.add_timer(Timer {
                    time: merged.end,
                    kind: TimerKind::Fire,
                    key: k,
                    id: target.id,
                });
                self.next_fire = self.next_fire.min(merged.end);
                self.set_armed(k, target.id, true);
            }
        }
        Ok(())
    }

    /// Fold every other session of `key` that overlaps `own` into `target` (the earliest),
    /// merging accumulators earliest first; their stale timers are ignored when due.
    pub(super) fn merge_sessions(&mut self, key: u32, target: i64, own: &Window) -> Result<()> {
        if !self.batch.ordered() {
            // Bring every staged row into the accumulators before merging them.
            self.flush(None)?;
        }
        let mut others: Vec<(Window, i64)> = self
            .sessions
            .of(key)
            .iter()
            .filter(|r| r.id != target)
            .filter_map(|r| self.state.slot(key, r.id).map(|s| (s.window, r.id)))
            .filter(|(w, _)| w.overlaps(own))
            .collect();
        others.sort();
        let mut acc = self.state.acc(key, target).to_vec();
        for (window, other) in others {
            self.reopen(key, other);
            self.batch.relabel(key, other, target);
            let theirs = self.state.acc(key, other).to_vec();
            acc = match (acc.is_empty(), theirs.is_empty()) {
                (_, true) => acc,
                (true, false) => theirs,
                (false, false) => {
                    let left = packed_of([&acc[..]].into_iter());
                    let (merged, mut faults) =
                        self.merge_pairs(&left, &packed_of([&theirs[..]].into_iter()))?;
                    match faults.swap_remove(0) {
                        None => packed_item(&merged, 0).to_vec(),
                        Some(reason) => {
                            // The merged-away session's accumulator cannot be folded in:
                            // its result goes to the dead letters with the reason.
                            self.reject(key, window, Vec::new(), reason);
                            acc
                        }
                    }
                }
            };
            self.remove_slot(key, other);
            self.sessions.retain(key, |r| r.id != other);
        }
        self.state.set_acc(key, target, &acc);
        Ok(())
    }

    pub(super) fn set_written(&mut self, key: u32, id: i64, written: bool) {
        if let Some(r) = self.sessions.of_mut(key).and_then(|l| l.iter_mut().find(|r| r.id == id)) {
            r.written = written;
        }
    }

    /// Whether its windows are sessions.
    pub fn has_sessions(&self) -> bool {
        matches!(self.assigner, Assigner::Session { .. })
    }
}

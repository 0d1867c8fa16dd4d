//! The window operator of one aggregation: it owns the aggregation's keys, slots of
//! state (windows, panes or sessions with their accumulators), timers and plugin, and
//! turns accepted events and watermark advances into plugin calls and results.
//!
//! - Every event goes into exactly one slot; slots are opened when the event is staged,
//!   and each slot schedules its timers then: `Fire` at the end of every window it feeds
//!   (a sliding pane: of every window no earlier pane of its key is in, see
//!   `armed_by_earlier_pane`) and `Cleanup` once the allowed lateness after its last
//!   window is over.
//! - Staged rows reach the plugin in batches ([`Batch`]); a batch is flushed before any
//!   window fires, so batching never changes results.
//! - An event is late (side output) when every window it would feed is past its allowed
//!   lateness; an event for a window that fired but is within its allowed lateness
//!   updates it and the window is emitted again under the same key.

use super::aggregator::Aggregator;
use super::{Assigner, Window};
use crate::pipeline::WindowSpec;
use crate::plugin::batch::{empty_groups, fill_groups, packed_of, Batch, SlotRows, Value};
use crate::plugin::{
    packed_clear, packed_item, packed_push, FieldType, Groups, OnError, Packed, PluginIdentity,
};
use crate::source::json::Scalar;
use crate::state::captured::CapturedSlots;
use crate::state::{
    Acc, KeyTable, PeriodSlots, Slot, SlotHandle, Timer, TimerKind, WindowState, NO_SLOT, PREFETCH_DISTANCE,
};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};

/// Keys interned before the first sweep of idle keys (see
/// [`WindowOperator::forget_idle_keys`]).
const IDLE_KEYS_KEPT: usize = 4096;
use smallvec::SmallVec;
use std::borrow::Cow;
use std::collections::HashMap;

type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// Largest result record a plugin may emit (its JSON text).
pub const MAX_RESULT_BYTES: usize = 1 << 20;

/// Firings that take two calls (`add`, then `finish`) after a fault in one
/// (`add-and-finish`).
const FIRE_PAUSE: u32 = 64;

/// What one aggregation did, cumulative across savepoint resumes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OperatorCounters {
    /// Events added to a slot.
    pub accepted: u64,
    /// Events past every window's allowed lateness (sent to the late side output).
    pub late: u64,
    /// Accepted events whose window had already fired (re-emitted within the lateness).
    pub late_updates: u64,
    /// Window results computed (a re-emission counts again).
    pub windows_fired: u64,
    /// Result records written.
    pub emitted: u64,
    /// Retractions written (results superseded under another key).
    #[serde(default)]
    pub retracted: u64,
}

/// A result record: the key it is written under and its JSON value, or `None` for a
/// retraction: the key no longer holds a result (a session that merged into one with
/// another start; sinks write a tombstone or delete the row).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Emitted {
    pub key: String,
    pub value: Option<String>,
}

/// What became of an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Accepted,
    /// Late for every window it feeds; `window` is the last of them.
    Late {
        window: Window,
    },
    /// The key, seen for the first time, is not valid UTF-8 (nothing was changed).
    InvalidKey,
}

/// Events (or a window's result) a faulty plugin could not take, for the dead-letter
/// output.
#[derive(Debug, Clone)]
pub struct Rejected {
    /// Key fields joined by '|'.
    pub key: String,
    pub window: Window,
    /// Event times of the rejected events (empty: the window's result was rejected).
    pub event_times: Vec<i64>,
    pub reason: String,
}

/// One saved slot. `key` is encoded as in [`crate::state::KeyTable`]: each field a
/// little-endian u32 length and its UTF-8 bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SavedSlot {
    pub key: Vec<u8>,
    pub id: i64,
    pub window: Window,
    pub acc: Vec<u8>,
}

/// A saved staged row (ordered plugins keep rows until their slot is complete).
#[derive(Debug, Clone, PartialEq)]
pub struct SavedRow {
    pub key: Vec<u8>,
    pub id: i64,
    pub time: i64,
    pub values: Vec<Value>,
}

/// An operator's state captured for a snapshot (written by another thread).
#[derive(Debug, Clone, Default)]
pub struct Capture {
    pub slots: CapturedSlots,
    pub rows: Vec<SavedRow>,
    pub counters: OperatorCounters,
}

/// An operator's state as savepoints hold it.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub slots: Vec<SavedSlot>,
    pub rows: Vec<SavedRow>,
    pub counters: OperatorCounters,
}

/// An open session of a key. Session timers are lazy: when a session grows, its pending
/// `Fire` timer stays where it was and, when it comes due, moves to the session's new
/// end; only a session that has already fired (within its allowed lateness) gets a new
/// timer when it grows.
#[derive(Debug, Clone, Copy)]
struct SessionRef {
    id: i64,
    /// A `Fire` timer is pending for this session.
    armed: bool,
    /// Its result has been written under its window's start: when it merges under
    /// another start, that result is retracted (it may have grown since, and be armed
    /// again).
    written: bool,
    /// Where its slot was last found (checked before use: see [`WindowState::slot_at`]).
    at: SlotHandle,
}

/// Each key's open sessions, by key id (ids are dense and reused: see [`KeyTable`]), a
/// key's first session inline: found by one load, not a hash probe.
#[derive(Default)]
struct SessionLists(Vec<SmallVec<[SessionRef; 1]>>);

impl SessionLists {
    /// The sessions of `key` (none: empty).
    #[inline]
    fn of(&self, key: u32) -> &[SessionRef] {
        self.0.get(key as usize).map_or(&[], |l| l.as_slice())
    }

    #[inline]
    fn of_mut(&mut self, key: u32) -> Option<&mut SmallVec<[SessionRef; 1]>> {
        self.0.get_mut(key as usize)
    }

    fn push(&mut self, key: u32, r: SessionRef) {
        let k = key as usize;
        if self.0.len() <= k {
            self.0.resize_with(k + 1, SmallVec::new);
        }
        self.0[k].push(r);
    }

    /// Keep the sessions of `key` that `keep` says, giving back a list's heap room
    /// when it is left empty.
    fn retain(&mut self, key: u32, mut keep: impl FnMut(&SessionRef) -> bool) {
        if let Some(list) = self.0.get_mut(key as usize) {
            list.retain(|r| keep(r));
            if list.is_empty() && list.spilled() {
                *list = SmallVec::new();
            }
        }
    }
}

pub struct WindowOperator {
    name: String,
    /// Result keys start with `<name>|` when a pipeline has several aggregations.
    prefixed: bool,
    assigner: Assigner,
    lateness: i64,
    keys: KeyTable,
    /// Keys an event reached since the last sweep of idle keys, by id.
    touched: Vec<bool>,
    /// Interned keys at which the next sweep happens.
    sweep_at: usize,
    state: WindowState,
    batch: Batch,
    batch_size: usize,
    key_arity: usize,
    plugin: Box<dyn Aggregator>,
    /// (projection slot, type) of each plugin column.
    columns: Vec<(usize, FieldType)>,
    /// Earliest timer: nothing fires before the watermark reaches it.
    next_fire: i64,
    /// Set while timers hand over slots that end in the same call (they fire or are
    /// cleaned up, with no allowed lateness and no later window): no row can reach them
    /// afterwards, so their rows are not kept.
    handing_over_to_close: bool,
    /// The slot of the last event (tumbling windows, sliding panes): the next event
    /// usually falls in it too, and then needs no division.
    last_slot: Window,
    /// Open sessions per key.
    sessions: SessionLists,
    next_session: i64,
    fire_groups: Groups,
    /// Scratch of [`place_by_rank`]: window index by key rank.
    by_rank: Vec<u32>,
    /// Sliding windows: by key id, the end of the last window taken to fire.
    fired_ends: Vec<i64>,
    /// Scratch of [`Self::emit`]: the windows that fire, and [`place_by_rank`]'s.
    fired: Vec<(u32, Window, Acc)>,
    placed: Vec<(u32, Window, Acc)>,
    /// Scratch of [`Self::fire_closing`]: (key, window, (slot id, handle)) of the windows
    /// that fire, and [`place_by_rank`]'s.
    fired_slots: Vec<(u32, Window, (i64, SlotHandle))>,
    placed_slots: Vec<(u32, Window, (i64, SlotHandle))>,
    /// Scratch of [`Self::run_timers`]: the (key, id) of the fire and cleanup timers due
    /// (a period's windows come due together: grown afresh each time, they took a dozen
    /// reallocations and copies of up to the period's windows).
    due_fires: Vec<(u32, i64)>,
    due_cleanups: Vec<(u32, i64)>,
    /// Firings left that take two calls after a fault in one (see [`Self::fire_closing`]).
    fire_paused: u32,
    /// Firings of sliding windows left that take `merge` and `finish` calls after a fault
    /// in `merge-and-finish` (see [`Self::emit_panes`]).
    panes_paused: u32,
    /// Scratch of [`Self::emit_panes`]: the panes' accumulators of a call.
    pane_accs: Packed,
    counters: OperatorCounters,
    /// Slots removed since the last checkpoint (encoded key, slot id), when a backend
    /// keeps an incremental copy.
    removed: Option<Vec<(Vec<u8>, i64)>>,
    on_error: OnError,
    rejected: Vec<Rejected>,
    /// Ordered plugins: rows already handed over, per slot, in event-time order, kept
    /// until the slot is cleaned up. A row that reaches the slot later brings them back
    /// into the batch and the slot is rebuilt from an empty accumulator, so every
    /// accumulator reflects all of its slot's rows in order.
    held: FastMap<(u32, i64), SlotRows>,
    /// Ordered plugins: slots handed back for a rebuild, with the accumulator and rows they
    /// had, so that a rebuild the plugin fails on leaves the slot as it was.
    reopened: FastMap<(u32, i64), (Vec<u8>, SlotRows)>,
    /// Slots whose every event the plugin rejected: removed at the next safe point (not
    /// in the middle of a merge that holds on to them), unless an event reached them since.
    doomed: Vec<(u32, i64)>,
}

impl WindowOperator {
    /// `columns` gives, for each plugin field, its slot in the job's projection.
    pub fn new(
        name: &str,
        prefixed: bool,
        spec: &WindowSpec,
        plugin: Box<dyn Aggregator>,
        batch_size: usize,
        key_arity: usize,
        column_slots: Vec<usize>,
    ) -> WindowOperator {
        let types: Vec<FieldType> = plugin.info().fields.iter().map(|f| f.type_).collect();
        let columns = column_slots.into_iter().zip(types.iter().copied()).collect();
        let assigner = Assigner::new(spec.kind);
        WindowOperator {
            name: name.to_string(),
            prefixed,
            assigner,
            lateness: spec.allowed_lateness_ms,
            keys: KeyTable::default(),
            touched: Vec::new(),
            sweep_at: IDLE_KEYS_KEPT,
            state: if assigner.periodic() { WindowState::by_period() } else { WindowState::default() },
            batch: new_batch(&types, key_arity, plugin.info().ordered_input, assigner.periodic()),
            batch_size,
            key_arity,
            plugin,
            columns,
            next_fire: i64::MAX,
            handing_over_to_close: false,
            last_slot: Window { start: 0, end: 0 },
            sessions: SessionLists::default(),
            next_session: 0,
            fire_groups: empty_groups(key_arity as u32),
            by_rank: Vec::new(),
            fired_ends: Vec::new(),
            fired: Vec::new(),
            placed: Vec::new(),
            fired_slots: Vec::new(),
            placed_slots: Vec::new(),
            due_fires: Vec::new(),
            due_cleanups: Vec::new(),
            fire_paused: 0,
            panes_paused: 0,
            pane_accs: crate::plugin::empty_packed(),
            counters: OperatorCounters::default(),
            removed: None,
            on_error: OnError::default(),
            rejected: Vec::new(),
            held: FastMap::default(),
            reopened: FastMap::default(),
            doomed: Vec::new(),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// What a plugin fault does (default: dead-letter the affected events).
    pub fn set_on_error(&mut self, on_error: OnError) {
        self.on_error = on_error;
    }

    #[inline]
    pub fn has_rejected(&self) -> bool {
        !self.rejected.is_empty()
    }

    /// Events and results the plugin could not take since the last call.
    pub fn take_rejected(&mut self) -> Vec<Rejected> {
        std::mem::take(&mut self.rejected)
    }

    /// Key fields joined by '|', each escaped ([`push_key_part`]).
    fn key_text(&self, key: u32) -> String {
        let mut text = Vec::new();
        for (i, f) in self.keys.raw_fields(key).enumerate() {
            if i > 0 {
                text.push(b'|');
            }
            push_key_part(&mut text, f);
        }
        key_string(text)
    }

    pub fn plugin(&self) -> &dyn Aggregator {
        self.plugin.as_ref()
    }

    pub fn identity(&self) -> &PluginIdentity {
        self.plugin.identity()
    }

    pub fn counters(&self) -> &OperatorCounters {
        &self.counters
    }

    /// The job sent one of this aggregation's events to the late side output.
    pub fn count_late(&mut self) {
        self.counters.late += 1;
    }

    /// Open slots (windows, panes, sessions).
    pub fn open_slots(&self) -> usize {
        self.state.len()
    }

    /// Bytes of the accumulators and keys this operator holds (without the maps' own
    /// overhead).
    pub fn state_bytes(&self) -> usize {
        self.state.acc_bytes() + self.keys.bytes()
    }

    /// Keys interned, idle ones included (see [`Self::forget_idle_keys`]).
    pub fn interned_keys(&self) -> usize {
        self.keys.len()
    }

    /// Keys with open slots (windows, panes, sessions).
    pub fn keys(&self) -> usize {
        self.state.keys_in_use()
    }

    /// Staged rows not yet given to the plugin.
    pub fn staged(&self) -> usize {
        self.batch.len()
    }

    /// Ask for the place of an encoded key in the key index ahead of its lookup (see
    /// [`crate::state::KeyTable::prefetch_key`]).
    #[inline(always)]
    pub fn prefetch_key(&self, key: &[u8]) {
        self.keys.prefetch_key(key);
    }

    /// The id of an encoded key; a key seen for the first time is checked to be UTF-8
    /// (keys are built from raw input bytes) and interned.
    #[inline(always)]
    fn key_id(&mut self, key: &[u8]) -> Option<u32> {
        let id = self.keys.intern_if(key, crate::state::valid_key)?;
        match self.touched.get_mut(id as usize) {
            Some(t) => *t = true,
            None => {
                self.touched.resize(id as usize + 1, false);
                self.touched[id as usize] = true;
            }
        }
        Some(id)
    }

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
    fn stage_columns(&mut self, slots: &[Option<Scalar>]) {
        for (col, &(slot, ty)) in self.columns.iter().enumerate() {
            match (ty, slots[slot]) {
                (FieldType::Int, Some(Scalar::Int(v))) => self.batch.push_int(col, v),
                (ty, value) => stage_value(&mut self.batch, col, ty, value),
            }
        }
    }

    /// Process an event (already checked) of `key` at time `t`, with the watermark at
    /// its arrival. Results of re-emitted windows go to `out`.
    #[inline]
    pub fn on_event(
        &mut self,
        key: &[u8],
        t: i64,
        wm: i64,
        slots: &[Option<Scalar>],
        out: &mut Vec<Emitted>,
    ) -> Result<Verdict> {
        let verdict = match self.assigner {
            Assigner::Session { .. } => self.on_session_event(key, t, wm, slots, out),
            _ => self.on_slot_event(key, t, wm, slots, out),
        };
        if !self.doomed.is_empty() {
            self.drop_doomed();
        }
        verdict
    }

    /// Tumbling windows and sliding panes: the slot is fixed by the event time.
    #[inline]
    fn on_slot_event(
        &mut self,
        key: &[u8],
        t: i64,
        wm: i64,
        slots: &[Option<Scalar>],
        out: &mut Vec<Emitted>,
    ) -> Result<Verdict> {
        let slot = if self.last_slot.start <= t && t < self.last_slot.end {
            self.last_slot
        } else {
            self.last_slot = self.assigner.slot(t);
            self.last_slot
        };
        let last = self.assigner.last_end(slot);
        if last.saturating_add(self.lateness) <= wm {
            // A record is judged bad before it is judged late (a late event's key is not
            // interned, so not checked there).
            if !crate::state::valid_key(key) {
                return Ok(Verdict::InvalidKey);
            }
            return Ok(Verdict::Late { window: self.assigner.window_ending(last) });
        }
        let Some(k) = self.key_id(key) else { return Ok(Verdict::InvalidKey) };
        if slot.end <= wm {
            // The slot may have been handed over already (ordered plugins).
            self.reopen(k, slot.start);
        }
        // A group already staged in this batch has its slot open.
        if self.batch.push_row(k, slot.start, t) {
            let (h, created) = self.state.open_at(k, slot.start, slot);
            self.batch.set_new_group_slot(h);
            if created {
                self.schedule(k, slot.start, slot, wm);
            }
        }
        self.stage_columns(slots);
        self.counters.accepted += 1;
        // Windows of the slot that have fired but are within the allowed lateness take the
        // event and are emitted again (windows that have not fired just take it).
        let refire: Vec<i64> = if slot.end <= wm && self.lateness > 0 {
            self.assigner
                .window_ends(slot)
                .filter(|&e| e <= wm && e.saturating_add(self.lateness) > wm)
                .collect()
        } else {
            Vec::new()
        };
        if !refire.is_empty() {
            self.counters.late_updates += 1;
            self.flush(Some(wm))?;
            // Sliding windows are fired by their end; tumbling windows by their slot.
            let sliding = matches!(self.assigner, Assigner::Sliding { .. });
            let fires: Vec<(u32, i64)> =
                refire.into_iter().map(|e| (k, if sliding { e } else { slot.start })).collect();
            self.emit(&fires, out, false)?;
        } else if self.batch.len() >= self.batch_size {
            self.flush(Some(wm))?;
        }
        Ok(Verdict::Accepted)
    }

    /// Sessions: the event's own window `[t, t + gap]` (half-open: `[t, t + gap + 1)`)
    /// merges with every session of the key it overlaps.
    fn on_session_event(
        &mut self,
        key: &[u8],
        t: i64,
        wm: i64,
        slots: &[Option<Scalar>],
        out: &mut Vec<Emitted>,
    ) -> Result<Verdict> {
        let own = self.assigner.slot(t);
        let Some(k) = self.key_id(key) else { return Ok(Verdict::InvalidKey) };
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
                self.reopen(k, target.id);
                if count > 1 {
                    self.merge_sessions(k, target.id, &own)?;
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

    /// Fold every other session of `key` that overlaps `own` into `target` (the earliest),
    /// merging accumulators earliest first; their stale timers are ignored when due.
    fn merge_sessions(&mut self, key: u32, target: i64, own: &Window) -> Result<()> {
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
                            let key_text = self.key_text(key);
                            self.rejected.push(Rejected {
                                key: key_text,
                                window,
                                event_times: Vec::new(),
                                reason,
                            });
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

    /// Remove the slots whose every event was rejected, unless an event (or a merge)
    /// reached them since.
    fn drop_doomed(&mut self) {
        for (key, id) in std::mem::take(&mut self.doomed) {
            if self.state.acc(key, id).is_empty() && !self.batch.stages_group(key, id) {
                self.drop_slot(key, id);
            }
        }
    }

    /// Remove a slot and what refers to it (its session entry). A timer still pending for
    /// it finds nothing, or (a key forgotten and another interned under the same id) a
    /// slot that would have set the same timer.
    fn drop_slot(&mut self, key: u32, id: i64) -> Option<Slot> {
        let (slot, _) = self.remove_slot(key, id)?;
        self.sessions.retain(key, |r| r.id != id);
        Some(slot)
    }

    /// A key stays interned between its windows, so that its next event finds it. Once
    /// the table has doubled since the last sweep, the keys no event has reached since
    /// then and that have no open slot or staged row are forgotten: the table holds about
    /// twice the keys active between two sweeps, and the sweeps cost O(1) per new key.
    fn forget_idle_keys(&mut self) {
        if self.keys.len() < self.sweep_at {
            return;
        }
        let mut keep = std::mem::take(&mut self.touched);
        keep.resize(self.keys.capacity(), false);
        for k in self.batch.staged_keys() {
            keep[k as usize] = true;
        }
        let idle: Vec<u32> =
            self.keys.ids().filter(|&k| !keep[k as usize] && !self.state.in_use(k)).collect();
        for k in idle {
            self.keys.remove(k);
        }
        keep.clear();
        self.touched = keep;
        self.sweep_at = (2 * self.keys.len()).max(IDLE_KEYS_KEPT);
    }

    /// Remove a slot, noting it for the incremental backend; returns it and whether it
    /// was the key's last.
    fn remove_slot(&mut self, key: u32, id: i64) -> Option<(Slot, bool)> {
        let (slot, last) = self.state.remove(key, id)?;
        if !self.held.is_empty() {
            self.held.remove(&(key, id));
        }
        if let Some(r) = &mut self.removed {
            r.push((self.keys.encoded(key).to_vec(), id));
        }
        Some((slot, last))
    }

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
        std::mem::replace(&mut self.plugin, plugin)
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

    fn set_armed(&mut self, key: u32, id: i64, armed: bool) {
        if let Some(r) = self.sessions.of_mut(key).and_then(|l| l.iter_mut().find(|r| r.id == id)) {
            r.armed = armed;
        }
    }

    fn set_written(&mut self, key: u32, id: i64, written: bool) {
        if let Some(r) = self.sessions.of_mut(key).and_then(|l| l.iter_mut().find(|r| r.id == id)) {
            r.written = written;
        }
    }

    /// Timers of a new (or grown) slot: fire at the end of every window it feeds that
    /// has not fired yet (a sliding pane: and that no earlier open pane of its key is
    /// in), clean up after the last one's allowed lateness.
    /// Returns whether a `Fire` timer was set.
    fn schedule(&mut self, key: u32, id: i64, slot: Window, wm: i64) -> bool {
        let sliding = matches!(self.assigner, Assigner::Sliding { .. });
        let mut armed = false;
        // A sliding window's timer is set once for a key, by the first of its panes the
        // key opens; a pane sets those of its windows that no earlier pane of the key set.
        let armed_before = if sliding { self.armed_by_earlier_pane(key, slot) } else { i64::MIN };
        for end in self.assigner.window_ends(slot).filter(|&e| e > wm && e > armed_before) {
            // Sliding windows are identified by their end; the others by their slot.
            let fire_id = if sliding { end } else { id };
            self.state.add_timer(Timer { time: end, kind: TimerKind::Fire, key, id: fire_id });
            self.next_fire = self.next_fire.min(end);
            armed = true;
        }
        // Without allowed lateness a tumbling window or a session is dropped when it fires:
        // one timer does both.
        if sliding || self.lateness > 0 || !armed {
            let cleanup = self.assigner.last_end(slot).saturating_add(self.lateness);
            self.state.add_timer(Timer { time: cleanup, kind: TimerKind::Cleanup, key, id });
            self.next_fire = self.next_fire.min(cleanup);
        }
        armed
    }

    /// Sliding windows: the last end whose timer a pane of `key` before `slot` set, or
    /// i64::MIN. Each of the key's windows that holds an open pane has its timer pending
    /// once the watermark is below its end: every pane, when it opens, sets the timers of
    /// its windows after the watermark except those an earlier open pane of the key is in
    /// (which therefore have theirs), and a timer goes only when the watermark reaches
    /// it. So the nearest earlier open pane's windows (the ends up to its last, which
    /// are also ends of `slot`'s windows that far, both on the slide's grid) have theirs.
    /// A stream in order sets one timer a pane, not one per window of the pane.
    fn armed_by_earlier_pane(&self, key: u32, slot: Window) -> i64 {
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

    /// Whether a `Fire` timer also ends its slot (no separate cleanup timer).
    fn fire_cleans_up(&self) -> bool {
        self.lateness == 0 && !matches!(self.assigner, Assigner::Sliding { .. })
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
    fn flush_before_firing(&mut self, wm: i64) -> Result<()> {
        if self.assigner.periodic() && !self.batch.ordered() {
            self.hand_over(Some(wm))
        } else {
            self.flush(Some(wm))
        }
    }

    /// Hand the staged rows of the slots complete at watermark `ready` (None: all) to the
    /// plugin.
    fn hand_over(&mut self, ready: Option<i64>) -> Result<()> {
        if self.batch.is_empty() {
            return Ok(());
        }
        let groups = self.batch.assemble(&self.keys, &self.state, ready);
        if groups.is_empty() {
            self.batch.recycle(groups);
            return Ok(());
        }
        let accs = match self.plugin.add(&self.batch.groups, &self.batch.events) {
            Ok(accs) => accs,
            Err(e @ Error::PluginCall { .. }) if self.on_error == OnError::DeadLetter => {
                tracing::warn!(error = %e, "plugin fault: isolating the groups of the batch");
                return self.add_one_by_one(&groups);
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

    /// Ordered plugins: group `i` of the last call succeeded; keep its rows for a later
    /// rebuild when the call started from the fresh accumulator (then they are all of the
    /// slot's rows; a slot restored from an older savepoint with an accumulator and no rows
    /// just takes later rows in arrival order). Call before its accumulator is replaced.
    fn hold(&mut self, i: usize, key: u32, id: i64) {
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
    fn reopen(&mut self, key: u32, id: i64) {
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
    fn held_rows(&self) -> Vec<SavedRow> {
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

    /// After a fault: a fresh instance, then one call per group; the groups that fail
    /// again are dead-lettered (their accumulators stay as they were).
    fn add_one_by_one(&mut self, groups: &[(u32, i64)]) -> Result<()> {
        self.plugin.reset()?;
        for (i, &(key, id)) in groups.iter().enumerate() {
            let (g, ev) = self.batch.single(i);
            match self.plugin.add(&g, &ev) {
                Ok(acc) => {
                    self.hold(i, key, id);
                    self.state.set_acc(key, id, packed_item(&acc, 0));
                }
                Err(e @ Error::PluginCall { .. }) => {
                    self.plugin.reset()?;
                    let mut rejected_times = ev.event_time;
                    if let Some((acc, rows)) = self.reopened.remove(&(key, id)) {
                        // A rebuild failed: the slot keeps what it had; only the rows that
                        // reached it since are rejected.
                        for (time, _) in rows.iter() {
                            if let Some(at) = rejected_times.iter().position(|&t| t == time) {
                                rejected_times.remove(at);
                            }
                        }
                        self.state.set_acc(key, id, &acc);
                        self.held.insert((key, id), rows);
                    } else if self.state.acc(key, id).is_empty() {
                        // Every event the slot had is rejected: it has nothing to fire.
                        self.doomed.push((key, id));
                    }
                    self.counters.accepted -= rejected_times.len() as u64;
                    let window = Window { start: g.window_start[0], end: g.window_end[0] };
                    let key_text = self.key_text(key);
                    self.rejected.push(Rejected {
                        key: key_text,
                        window,
                        event_times: rejected_times,
                        reason: e.to_string(),
                    });
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// The watermark moved to `wm`: fire and clean up whatever is due.
    #[inline]
    pub fn advance(&mut self, wm: i64, out: &mut Vec<Emitted>) -> Result<()> {
        if wm < self.next_fire {
            return Ok(());
        }
        self.run_timers(wm, out)
    }

    /// End of a bounded input: every window fires.
    pub fn drain(&mut self, out: &mut Vec<Emitted>) -> Result<()> {
        self.run_timers(i64::MAX, out)
    }

    fn run_timers(&mut self, wm: i64, out: &mut Vec<Emitted>) -> Result<()> {
        if self.state.next_timer().is_none_or(|t| t > wm) {
            // Only stale timers were due (sessions that grew): nothing to do.
            self.next_fire = self.state.next_timer().unwrap_or(i64::MAX);
            return Ok(());
        }
        let sessions = matches!(self.assigner, Assigner::Session { .. });
        let sliding = matches!(self.assigner, Assigner::Sliding { .. });
        let (mut fires, mut cleanups) =
            (std::mem::take(&mut self.due_fires), std::mem::take(&mut self.due_cleanups));
        fires.clear();
        cleanups.clear();
        while let Some(t) = self.state.pop_due(wm) {
            if sessions {
                // A timer of a merged-away session, or of a session that has grown since.
                let Some(slot) = self.state.slot(t.key, t.id) else { continue };
                let due = match t.kind {
                    TimerKind::Fire => slot.window.end,
                    TimerKind::Cleanup => slot.window.end.saturating_add(self.lateness),
                };
                if due > t.time {
                    self.state.add_timer(Timer { time: due, ..t });
                    continue;
                }
                if t.kind == TimerKind::Fire {
                    self.set_armed(t.key, t.id, false);
                    self.set_written(t.key, t.id, true);
                }
            }
            match t.kind {
                TimerKind::Fire if sliding => {
                    // A pane that opens before an earlier one of its key sets the
                    // timers of windows that one set too (its end, also its id): a window
                    // fires once. A key's timers of one end come due together, ends in
                    // order, so a key's last end taken tells a repeat.
                    let k = t.key as usize;
                    if k >= self.fired_ends.len() {
                        self.fired_ends.resize(k + 1, i64::MIN);
                    }
                    if self.fired_ends[k] != t.id {
                        self.fired_ends[k] = t.id;
                        fires.push((t.key, t.id));
                    }
                }
                TimerKind::Fire => fires.push((t.key, t.id)),
                TimerKind::Cleanup => cleanups.push((t.key, t.id)),
            }
        }
        if fires.is_empty() && cleanups.is_empty() {
            // Only stale timers were due (sessions that grew since): no call.
            self.next_fire = self.state.next_timer().unwrap_or(i64::MAX);
            (self.due_fires, self.due_cleanups) = (fires, cleanups);
            return Ok(());
        }
        // Tumbling windows of an unordered plugin that folds and finishes in one call, that
        // end as they fire, when no slot ends without firing: every complete slot is among
        // the fires, and its rows and its firing go in one call (`fire_closing`).
        let in_one_call = self.fire_cleans_up()
            && self.assigner.periodic()
            && !self.batch.ordered()
            && cleanups.is_empty()
            && self.plugin.fires();
        if !(in_one_call && self.fire_closing(&fires, out)?) {
            // Staged rows of the complete slots reach the accumulators before they fire or
            // end (see `flush_before_firing`). Popping timers reads only windows, which a
            // flush keeps. Every slot it takes has a timer due now (or had one popped
            // already), so when slots end as they fire, all it takes are dropped below.
            self.handing_over_to_close = self.fire_cleans_up();
            let flushed = self.flush_before_firing(wm);
            self.handing_over_to_close = false;
            flushed?;
            // Fires that close their slots removed them.
            self.emit(&fires, out, self.fire_cleans_up())?;
        }
        for &(key, id) in &cleanups {
            self.drop_slot(key, id);
        }
        (self.due_fires, self.due_cleanups) = (fires, cleanups);
        self.forget_idle_keys();
        self.next_fire = self.state.next_timer().unwrap_or(i64::MAX);
        Ok(())
    }

    /// Compute and write the results of windows: `(key, id)` is a slot for tumbling and
    /// session windows, `(key, end)` for sliding windows (merged from their panes).
    /// `closing`: the windows' slots end with them: removed, their accumulators taken.
    fn emit(&mut self, fires: &[(u32, i64)], out: &mut Vec<Emitted>, closing: bool) -> Result<()> {
        if !self.doomed.is_empty() {
            self.drop_doomed();
        }
        if fires.is_empty() {
            return Ok(());
        }
        if let Assigner::Sliding { size, slide } = self.assigner {
            if self.panes_paused > 0 {
                self.panes_paused -= 1;
            } else if self.plugin.merges_panes() {
                return self.emit_panes(fires, size, slide, out);
            }
        }
        // (key, window, accumulator) of every window.
        // Into the buffers of the last call: no allocation, no page touched for the first
        // time, as windows fire.
        let mut windows = std::mem::take(&mut self.fired);
        windows.clear();
        windows.reserve(fires.len());
        match self.assigner {
            Assigner::Sliding { size, slide } => windows.extend(self.merge_panes(fires, size, slide)?),
            _ if closing => windows.extend(
                fires.iter().filter_map(|&(k, id)| self.drop_slot(k, id).map(|s| (k, s.window, s.acc))),
            ),
            _ => windows.extend(
                fires
                    .iter()
                    .filter_map(|&(k, id)| self.state.slot(k, id).map(|s| (k, s.window, s.acc.clone()))),
            ),
        }
        let mut placed = std::mem::take(&mut self.placed);
        order_windows(&mut self.keys, &mut windows, &mut self.by_rank, &mut placed);
        self.placed = placed;
        let done = self.finish_windows(&windows, out);
        windows.clear();
        self.fired = windows;
        done
    }

    /// `finish` of windows in the order their results are written, in calls of up to the
    /// batch size (after a fault that `on_error` dead-letters, one call per window).
    fn finish_windows(&mut self, windows: &[(u32, Window, Acc)], out: &mut Vec<Emitted>) -> Result<()> {
        for chunk in windows.chunks(self.batch_size) {
            let keys = &self.keys;
            fill_groups(
                &mut self.fire_groups,
                keys,
                chunk.iter().enumerate().map(|(i, (k, w, a))| {
                    if let Some(ahead) = chunk.get(i + PREFETCH_DISTANCE) {
                        keys.prefetch(ahead.0);
                    }
                    (*k, *w, a.as_slice())
                }),
            );
            // Whether `fire_groups` still holds the call's groups (not the last window's of
            // a call per window), each key with the pipeline's number of fields.
            let arity = self.fire_groups.key_arity as usize;
            let (emitted, whole_call) = match self.plugin.finish(&self.fire_groups) {
                Ok(e) => (e, self.fire_groups.keys.ends.len() == chunk.len() * arity),
                Err(e @ Error::PluginCall { .. }) if self.on_error == OnError::DeadLetter => {
                    (self.finish_one_by_one(chunk, &e)?, false)
                }
                Err(e) => return Err(e),
            };
            self.counters.windows_fired += chunk.len() as u64;
            self.write_results(emitted, chunk, whole_call.then_some(CallGroups::Finish), out)?;
        }
        Ok(())
    }

    /// Sliding windows of a plugin that exports `panes`: each window's panes merged and
    /// the window finished in one call ([`Aggregator::merge_and_finish`]) per batch of
    /// windows; nothing is written back (the panes stay as they are). After a fault that
    /// `on_error` dead-letters, the windows of that call take `merge` and `finish` calls,
    /// which isolate it, and so do the next [`FIRE_PAUSE`] firings.
    fn emit_panes(
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
    fn merge_and_finish_apart(
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

    /// Tumbling windows of an unordered plugin that end as they fire: each window's staged
    /// rows, its accumulator and its firing in one call ([`Aggregator::add_and_finish`]),
    /// laid out once, in the order of the results; nothing is written back (the slots
    /// end). False, with the slots and staged rows as they were, when the windows are
    /// more than a call takes, or after a fault that `on_error` dead-letters (the plugin is
    /// fresh again): then the rows are handed over and the windows finished in two calls,
    /// which isolate a fault to its groups or windows; so do the next [`FIRE_PAUSE`]
    /// firings (a fault that comes back, or a call too long for the time limit, is not
    /// paid for twice every time).
    fn fire_closing(&mut self, fires: &[(u32, i64)], out: &mut Vec<Emitted>) -> Result<bool> {
        if self.fire_paused > 0 {
            self.fire_paused -= 1;
            return Ok(false);
        }
        if fires.len() > self.batch_size {
            return Ok(false);
        }
        if !self.doomed.is_empty() {
            self.drop_doomed();
        }
        // (key, window, (slot id, handle)) of every window; the period found once for the
        // keys that share it (all of them, mostly).
        let mut windows = std::mem::take(&mut self.fired_slots);
        windows.clear();
        let mut period: Option<(i64, PeriodSlots<'_>)> = None;
        for &(k, id) in fires {
            if period.as_ref().is_none_or(|p| p.0 != id) {
                period = Some((id, self.state.period(id)));
            }
            let Some(h) = period.as_ref().and_then(|p| p.1.handle(k)) else { continue };
            if let Some(slot) = self.state.slot_at(h, k, id) {
                windows.push((k, slot.window, (id, h)));
            }
        }
        if windows.is_empty() {
            // Timers of slots gone already: nothing fires.
            self.fired_slots = windows;
            return Ok(true);
        }
        let mut placed = std::mem::take(&mut self.placed_slots);
        order_windows(&mut self.keys, &mut windows, &mut self.by_rank, &mut placed);
        self.placed_slots = placed;
        self.batch.assemble_slots(windows.iter().map(|&(k, _, (id, h))| (k, id, h)), &self.keys, &self.state);
        let emitted = match self.plugin.add_and_finish(&mut self.batch.groups, &self.batch.events) {
            Ok(e) => e,
            Err(e @ Error::PluginCall { .. }) if self.on_error == OnError::DeadLetter => {
                tracing::warn!(error = %e, "plugin fault in add-and-finish: handing over and finishing apart");
                self.plugin.reset()?;
                self.fire_paused = FIRE_PAUSE;
                self.fired_slots = windows;
                return Ok(false);
            }
            Err(e) => return Err(e),
        };
        self.batch.take_laid_out();
        for (i, &(k, _, (id, _))) in windows.iter().enumerate() {
            if let Some(&(k, _, (id, h))) = windows.get(i + PREFETCH_DISTANCE) {
                self.state.prefetch_removal(k, id, h);
            }
            self.drop_slot(k, id);
        }
        self.counters.windows_fired += windows.len() as u64;
        let groups = &self.batch.groups;
        let keyed = groups.keys.ends.len() == windows.len() * groups.key_arity as usize;
        self.write_results(emitted, &windows, keyed.then_some(CallGroups::Batch), out)?;
        windows.clear();
        self.fired_slots = windows;
        Ok(true)
    }

    /// Write the records a call gave for `windows` (its groups, in order); `key_source`:
    /// where the call's groups still are, each key with the pipeline's number of fields, to
    /// read a window's key fields from (None: from the key table). A value that is not one
    /// JSON object is dead-lettered or fails the job.
    fn write_results<T>(
        &mut self,
        emitted: Vec<crate::plugin::Emitted>,
        windows: &[(u32, Window, T)],
        key_source: Option<CallGroups>,
        out: &mut Vec<Emitted>,
    ) -> Result<()> {
        for e in emitted {
            let (k, w, _) = &windows[e.group as usize];
            let value = match self.check_value(e.value) {
                Ok(v) => v,
                Err(err) if self.on_error == OnError::DeadLetter => {
                    self.reject_window(*k, *w, &err);
                    continue;
                }
                Err(err) => return Err(err),
            };
            // The key's fields as the call had them (read in call order, recently
            // written) rather than from the key table (a cache miss per result).
            let key = match key_source {
                Some(from) => {
                    let groups = match from {
                        CallGroups::Finish => &self.fire_groups,
                        CallGroups::Batch => &self.batch.groups,
                    };
                    let arity = groups.key_arity as usize;
                    let at = e.group as usize * arity;
                    let fields = (at..at + arity).map(|i| packed_item(&groups.keys, i));
                    self.result_key_of(w.start, fields)
                }
                None => self.result_key(w.start, *k),
            };
            self.counters.emitted += 1;
            out.push(Emitted { key, value: Some(value) });
        }
        Ok(())
    }

    /// Dead-letter a window's result (no event of it): `reason` says why.
    fn reject_window(&mut self, k: u32, window: Window, reason: &Error) {
        let key = self.key_text(k);
        self.rejected.push(Rejected { key, window, event_times: Vec::new(), reason: reason.to_string() });
    }

    /// The key a window's results are written under: `[<aggregation>|]<start>|<key fields>`.
    fn result_key(&self, start: i64, k: u32) -> String {
        self.result_key_of(start, self.keys.raw_fields(k))
    }

    /// [`Self::result_key`] of a key given by its fields (interned: UTF-8), built as bytes
    /// and checked once.
    fn result_key_of<'a>(&self, start: i64, fields: impl Iterator<Item = &'a [u8]>) -> String {
        let mut key = Vec::with_capacity(self.name.len() + 64);
        if self.prefixed {
            key.extend_from_slice(self.name.as_bytes());
            key.push(b'|');
        }
        push_i64(&mut key, start);
        for f in fields {
            key.push(b'|');
            push_key_part(&mut key, f);
        }
        key_string(key)
    }

    /// After a fault in `finish`: a fresh instance and one call per window; the windows
    /// that fail again are dead-lettered.
    fn finish_one_by_one(
        &mut self,
        chunk: &[(u32, Window, Acc)],
        first: &Error,
    ) -> Result<Vec<crate::plugin::Emitted>> {
        tracing::warn!(error = %first, "plugin fault in finish: isolating the windows");
        self.plugin.reset()?;
        let mut out = Vec::new();
        for (i, (k, w, acc)) in chunk.iter().enumerate() {
            fill_groups(&mut self.fire_groups, &self.keys, std::iter::once((*k, *w, acc.as_slice())));
            match self.plugin.finish(&self.fire_groups) {
                Ok(records) => out.extend(records.into_iter().map(|mut r| {
                    r.group = i as u32;
                    r
                })),
                Err(e @ Error::PluginCall { .. }) => {
                    self.plugin.reset()?;
                    self.reject_window(*k, *w, &e);
                }
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }

    /// The open panes of each sliding window in `fires` (key, end), earliest first: the
    /// windows that have one, each with its range in the panes' (id, handle) list.
    #[allow(clippy::type_complexity)]
    fn find_panes(
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
    fn merge_panes(
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
                Some(reason) => {
                    let key = self.key_text(w.0);
                    self.rejected.push(Rejected { key, window: w.1, event_times: Vec::new(), reason });
                }
            }
        }
        Ok(kept)
    }

    /// Merge pairwise in one call: the merged accumulators, and per pair the fault that
    /// kept it from merging (its merged item is then empty). After a fault (with
    /// `on_error = "dead_letter"`), a fresh instance and one call per pair, so that only the
    /// pairs that fail again fail.
    fn merge_pairs(&mut self, left: &Packed, right: &Packed) -> Result<(Packed, Vec<Option<String>>)> {
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

    /// A result value must be one JSON object on one line, of at most [`MAX_RESULT_BYTES`].
    fn check_value(&self, value: String) -> Result<String> {
        let bad = |m: String| Error::PluginCall {
            plugin: self.identity().name.clone(),
            call: "finish",
            message: m,
        };
        if value.len() > MAX_RESULT_BYTES {
            return Err(bad(format!(
                "emitted a result of {} bytes; the limit is {MAX_RESULT_BYTES}",
                value.len()
            )));
        }
        // Most values are one compact object: checked by the input's scanner (what it
        // accepts, serde_json accepts); anything else takes serde_json's path below.
        if crate::source::json::is_compact_object(value.as_bytes()) {
            return Ok(value);
        }
        if !value.trim_start().starts_with('{') {
            return Err(bad(format!("emitted a value that is not a JSON object: {value:.200}")));
        }
        if value.contains(['\n', '\r']) {
            let v: serde_json::Value =
                serde_json::from_str(&value).map_err(|e| bad(format!("invalid JSON: {e}")))?;
            return serde_json::to_string(&v).map_err(|e| bad(e.to_string()));
        }
        serde_json::from_str::<serde::de::IgnoredAny>(&value)
            .map_err(|e| bad(format!("invalid JSON: {e}")))?;
        Ok(value)
    }

    /// Give all staged rows of an unordered plugin to it (ordered plugins keep theirs).
    pub fn flush_unordered(&mut self) -> Result<()> {
        if !self.batch.ordered() {
            self.flush(None)?;
        }
        self.drop_doomed();
        Ok(())
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
    fn all_slots(&mut self) -> CapturedSlots {
        self.state.capture(&self.keys, false)
    }

    /// Rows an ordered plugin holds, for checkpoints: those handed over (held until their
    /// slot is cleaned up), then those staged, in arrival order.
    fn saved_rows(&self) -> Vec<SavedRow> {
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

    /// Whether its windows are sessions.
    pub fn has_sessions(&self) -> bool {
        matches!(self.assigner, Assigner::Session { .. })
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

/// Append a key field to a result key: `\` and `|` are escaped with `\`, so different
/// keys never collide (`queso|curado` + `girona` vs `queso` + `curado|girona`); a field
/// without either is written as it is.
/// Works on bytes: `|` and `\` are ASCII, so a UTF-8 field stays UTF-8.
pub fn push_key_part(out: &mut Vec<u8>, field: &[u8]) {
    // A loop, not memchr2: fields are short, and its dispatch cost more than the search.
    if !field.iter().any(|&c| c == b'|' || c == b'\\') {
        out.extend_from_slice(field);
        return;
    }
    for &c in field {
        if c == b'|' || c == b'\\' {
            out.push(b'\\');
        }
        out.push(c);
    }
}

/// A result key built by [`push_key_part`] from key fields, which were checked to be UTF-8
/// when interned (a field that is not would be shown with replacement characters).
fn key_string(bytes: Vec<u8>) -> String {
    String::from_utf8(bytes).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

/// The batch of an operator whose slot ids are periods many keys share (`periodic`) or
/// not (sessions).
fn new_batch(types: &[FieldType], key_arity: usize, ordered: bool, periodic: bool) -> Batch {
    let batch = Batch::new(types, key_arity, ordered);
    if periodic {
        batch.by_period()
    } else {
        batch
    }
}

/// The windows that fire, `(key, window, what goes with it)`, in the order their results
/// are written: by window (end, then start), then key; a window once. A timer may have
/// been set twice (a slot dropped and opened again before its timer came due): the window
/// fires once. A closing slot is removed by its first fire (the second finds nothing); a
/// slot that stays gives both the same accumulator. Windows that sort equal are then the
/// same, so an unstable sort gives the same order.
fn order_windows<T: Default>(
    keys: &mut KeyTable,
    windows: &mut Vec<(u32, Window, T)>,
    by_rank: &mut Vec<u32>,
    placed: &mut Vec<(u32, Window, T)>,
) {
    match keys.ranks(windows.len()) {
        Some(rank) if !place_by_rank(windows, rank, by_rank, placed) => {
            // Sort small (end, start, rank, index) tuples, then move the windows once.
            let mut order: Vec<(i64, i64, u32, u32)> = windows
                .iter()
                .enumerate()
                .map(|(i, w)| (w.1.end, w.1.start, rank[w.0 as usize], i as u32))
                .collect();
            order.sort_unstable();
            *windows = order
                .iter()
                .map(|o| {
                    let (k, w, v) = &mut windows[o.3 as usize];
                    (*k, *w, std::mem::take(v))
                })
                .collect();
        }
        Some(_) => {}
        None => {
            windows.sort_unstable_by(|a, b| {
                (a.1.end, a.1.start)
                    .cmp(&(b.1.end, b.1.start))
                    .then_with(|| keys.raw_fields(a.0).cmp(keys.raw_fields(b.0)))
            });
        }
    }
    windows.dedup_by(|a, b| a.0 == b.0 && a.1 == b.1);
}

/// Where a call's groups are: the last `finish` call's, or the batch's (a call that
/// folded and finished).
#[derive(Clone, Copy)]
enum CallGroups {
    Finish,
    Batch,
}

/// Windows that fire together mostly share one window (a tumbling window's end reached
/// by every key): then they go in key order by placing each at its key's rank, in time
/// linear in the keys, when there are not many more keys than windows. False (nothing
/// moved) when that does not apply: several windows, a key twice, too many keys.
fn place_by_rank<T: Default>(
    windows: &mut Vec<(u32, Window, T)>,
    rank: &[u32],
    by_rank: &mut Vec<u32>,
    placed: &mut Vec<(u32, Window, T)>,
) -> bool {
    let Some(&(_, first, _)) = windows.first() else { return true };
    if rank.len() > 8 * windows.len() + 4096 || windows.iter().any(|w| w.1 != first) {
        return false;
    }
    by_rank.clear();
    by_rank.resize(rank.len(), u32::MAX);
    for (i, w) in windows.iter().enumerate() {
        match rank.get(w.0 as usize).and_then(|&r| by_rank.get_mut(r as usize)) {
            Some(at) if *at == u32::MAX => *at = i as u32,
            _ => return false,
        }
    }
    placed.clear();
    placed.extend(by_rank.iter().filter(|&&i| i != u32::MAX).map(|&i| {
        let (k, w, v) = &mut windows[i as usize];
        (*k, *w, std::mem::take(v))
    }));
    std::mem::swap(windows, placed);
    true
}

/// Append `v` in decimal (what `to_string` gives), without a temporary string.
fn push_i64(out: &mut Vec<u8>, v: i64) {
    out.extend_from_slice(itoa::Buffer::new().format(v).as_bytes());
}

/// [`WindowOperator::stage_columns`] for a value that is not an integer column's.
#[inline(never)]
fn stage_value(batch: &mut Batch, col: usize, ty: FieldType, value: Option<Scalar>) {
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
fn check_column(slot: usize, ty: FieldType, value: &Option<Scalar>, names: &[String]) -> Result<(), String> {
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

#[cfg(test)]
mod tests {
    use super::{push_i64, push_key_part};

    #[test]
    fn windows_placed_by_rank_come_out_in_rank_order_or_are_left_alone() {
        use super::{place_by_rank, Acc, Window};
        let w = Window { start: 0, end: 10 };
        // Key id -> rank (ids 1 and 3 are not live: u32::MAX).
        let rank = [2, u32::MAX, 0, u32::MAX, 1];
        let mut scratch = Vec::new();
        let mut windows: Vec<(u32, Window, Acc)> =
            [0u32, 4, 2].iter().map(|&k| (k, w, Acc::from_slice(&[k as u8]))).collect();
        assert!(place_by_rank(&mut windows, &rank, &mut scratch, &mut Vec::new()));
        let order: Vec<(u32, u8)> = windows.iter().map(|x| (x.0, x.2[0])).collect();
        assert_eq!(order, vec![(2, 2), (4, 4), (0, 0)]);
        // A key twice, two different windows, a key without a rank: nothing moves.
        for keys in [vec![(0u32, w), (0, w)], vec![(0, w), (2, Window { start: 10, end: 20 })], vec![(1, w)]]
        {
            let mut windows: Vec<(u32, Window, Acc)> =
                keys.iter().map(|&(k, w)| (k, w, Acc::new())).collect();
            let before: Vec<(u32, Window)> = windows.iter().map(|x| (x.0, x.1)).collect();
            assert!(!place_by_rank(&mut windows, &rank, &mut scratch, &mut Vec::new()));
            assert_eq!(windows.iter().map(|x| (x.0, x.1)).collect::<Vec<_>>(), before);
        }
    }

    #[test]
    fn window_starts_are_written_as_to_string_writes_them() {
        let mut values = vec![
            0,
            7,
            -7,
            10,
            99,
            100,
            -100,
            1757844000000,
            -1757844000000,
            i64::MAX,
            i64::MIN,
            i64::MIN + 1,
        ];
        values.extend((0..19).flat_map(|e| [10i64.pow(e) - 1, 10i64.pow(e), -(10i64.pow(e) + 1)]));
        for v in values {
            let mut s = b"x".to_vec();
            push_i64(&mut s, v);
            assert_eq!(s, format!("x{v}").into_bytes());
        }
    }

    fn key(fields: &[&str]) -> String {
        let mut k = b"1757844000000".to_vec();
        for f in fields {
            k.push(b'|');
            push_key_part(&mut k, f.as_bytes());
        }
        String::from_utf8(k).unwrap()
    }

    #[test]
    fn result_keys_escape_the_separator_and_keep_plain_keys_as_they_are() {
        assert_eq!(key(&["queso-curado", "girona"]), "1757844000000|queso-curado|girona");
        let (a, b) = (key(&["queso|curado", "girona"]), key(&["queso", "curado|girona"]));
        assert_eq!(a, r"1757844000000|queso\|curado|girona");
        assert_eq!(b, r"1757844000000|queso|curado\|girona");
        assert_ne!(key(&[r"a\", "b"]), key(&[r"a\|b"]));
        assert_eq!(key(&[r"a\", "b"]), r"1757844000000|a\\|b");
    }
}

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

mod calls;
mod deploy_watch;
mod panes;
mod quarantine;
mod results;
mod session;
mod snapshot;

use calls::new_batch;
pub use deploy_watch::{Tally, JUDGED_AFTER, WATCHED_FOR, WINDOWS_JUDGED_AFTER, WINDOWS_WATCHED_FOR};
use quarantine::Quarantine;
pub use quarantine::{
    KeyFaults, SavedFaults, DEFAULT_QUARANTINE_AFTER, DEFAULT_QUARANTINE_MAX_KEYS, QUARANTINE_LISTED,
    REASONS_KEPT, REASON_BYTES,
};
pub use results::push_key_part;
use results::{key_string, order_windows, CallGroups};
use session::{SessionLists, SessionRef};

use super::aggregator::Aggregator;
use super::batch::{empty_groups, fill_groups, packed_of, Batch, SlotRows, Value};
use super::{Assigner, Window};
use crate::pipeline::WindowSpec;
use crate::plugin::{
    packed_clear, packed_item, packed_push, FieldType, Groups, OnError, Packed, PluginIdentity,
};
use crate::source::json::Scalar;
use crate::state::captured::CapturedSlots;
pub use crate::state::saved::{OperatorCounters, SavedRow, SavedSlot, Snapshot};
use crate::state::{
    Acc, KeyTable, PeriodSlots, Slot, SlotHandle, Timer, TimerKind, WindowState, NO_SLOT, PREFETCH_DISTANCE,
};
use crate::{Error, Result};

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
    /// The key is quarantined: the event goes to the dead letters, the plugin is not
    /// called (see [`WindowOperator::quarantine_reason`]).
    Quarantined,
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

/// An operator's state captured for a snapshot (written by another thread).
#[derive(Debug, Clone, Default)]
pub struct Capture {
    pub slots: CapturedSlots,
    pub rows: Vec<SavedRow>,
    pub counters: OperatorCounters,
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
    /// A quarantined key's events are kept with the rejected ones (a shadow's operator,
    /// whose events no route dead-letters): see [`Self::reject_quarantined`].
    rejects_quarantined: bool,
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
    /// Faults by key, and the keys quarantined.
    quarantine: Quarantine,
    /// The next hand-over calls one group at a time: its rows just failed together.
    isolate_next: bool,
    /// Events and window results the plugin failed on (dead-lettered for a fault), and of
    /// them the windows.
    faulted_units: u64,
    faulted_windows: u64,
    /// Windows (key, start) the plugin failed on an event of, and how many there were;
    /// windows dropped because it failed on every event of theirs.
    tainted: std::collections::HashSet<(u32, i64), foldhash::fast::RandomState>,
    tainted_windows: u64,
    doomed_windows: u64,
    /// Windows of quarantined keys' events (no slot opened) first tainted.
    slotless_windows: u64,
    /// A plugin swapped in live, on probation.
    deploy_watch: Option<deploy_watch::DeployWatch>,
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
            rejects_quarantined: false,
            removed: None,
            on_error: OnError::default(),
            rejected: Vec::new(),
            held: FastMap::default(),
            reopened: FastMap::default(),
            doomed: Vec::new(),
            quarantine: Quarantine::new(DEFAULT_QUARANTINE_AFTER),
            isolate_next: false,
            faulted_units: 0,
            faulted_windows: 0,
            tainted: Default::default(),
            tainted_windows: 0,
            doomed_windows: 0,
            slotless_windows: 0,
            deploy_watch: None,
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// What a plugin fault does (default: dead-letter the affected events).
    pub fn set_on_error(&mut self, on_error: OnError) {
        self.on_error = on_error;
    }

    /// Keep the events of quarantined keys with the rejected ones ([`Self::take_rejected`]):
    /// a shadow's operator, which counts what its plugin failed on, window by window.
    pub fn keep_quarantined_events(&mut self) {
        self.rejects_quarantined = true;
    }

    /// An event of quarantined key `k` at time `t` for slot `slot`: counted (its window
    /// failed), and kept with the rejected ones when this operator keeps them. Out of the
    /// per-event path's way.
    #[cold]
    #[inline(never)]
    pub(super) fn quarantined_event(&mut self, k: u32, slot: Window, t: i64) -> Verdict {
        self.counters.quarantined += 1;
        self.taint(k, slot, true);
        if self.rejects_quarantined {
            let key = self.key_text(k);
            let reason = self.quarantine.reason(k);
            self.rejected.push(Rejected { key, window: slot, event_times: vec![t], reason });
        }
        Verdict::Quarantined
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

    /// Let each of the plugin's next calls run at most `t` (never past its call timeout).
    pub fn limit_call_time(&mut self, t: std::time::Duration) {
        self.plugin.limit_call_time(t);
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
        if self.quarantine.holds(k) {
            return Ok(self.quarantined_event(k, slot, t));
        }
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

    /// Remove the slots whose every event was rejected, unless an event (or a merge)
    /// reached them since.
    fn drop_doomed(&mut self) {
        for (key, id) in std::mem::take(&mut self.doomed) {
            if self.state.acc(key, id).is_empty() && !self.batch.stages_group(key, id) {
                self.drop_slot(key, id);
                self.doomed_windows += 1;
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
        for k in self.batch.staged_keys().chain(self.quarantine.key_ids()) {
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

    fn set_armed(&mut self, key: u32, id: i64, armed: bool) {
        if let Some(r) = self.sessions.of_mut(key).and_then(|l| l.iter_mut().find(|r| r.id == id)) {
            r.armed = armed;
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

    /// Whether a `Fire` timer also ends its slot (no separate cleanup timer).
    fn fire_cleans_up(&self) -> bool {
        self.lateness == 0 && !matches!(self.assigner, Assigner::Sliding { .. })
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
            // (Set by a failed `fire_closing` for the rows it had: handed over now.)
            self.isolate_next = false;
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
}

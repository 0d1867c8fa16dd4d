//! Assembling plugin calls: events staged in arrival order become one `add` call whose
//! rows are grouped by (key, slot) and laid out in columns, so the guest pays a handful
//! of allocations per call instead of several per event.
//!
//! For plugins that declared `ordered-input`, rows stay staged until their slot is
//! complete (the watermark has passed its end) and are then handed over sorted by event
//! time, so each slot's events reach the plugin in one call, in order. The window
//! operator keeps the rows it handed over until the slot is cleaned up: a row that reaches
//! a complete slot later brings them back, and the slot is rebuilt from an empty
//! accumulator with all its rows in order.
//!
//! Ordered rows of many keys wait a whole window: a call must cost what it takes, not what
//! stays. Each group's rows are chained, the groups wait in a heap by slot end, and the
//! rows taken leave holes that are closed once they outnumber the rows staged.

use crate::plugin::{empty_packed, packed_clear, packed_push, Column, Events, FieldType, Groups, Packed};
pub use crate::state::saved::Value;
use crate::state::{KeyTable, PeriodMap, SlotHandle, WindowState, NO_SLOT, PREFETCH_DISTANCE};
use crate::time::Window;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// The group of every (key, slot id) staged.
enum GroupIndex {
    Hashed(FastMap<(u32, i64), u32>),
    /// Slot ids that many keys share (see [`PeriodMap`]): one load a row, not a probe.
    ByPeriod(PeriodMap),
}

impl GroupIndex {
    #[inline]
    fn get(&self, key: u32, id: i64) -> Option<u32> {
        match self {
            GroupIndex::Hashed(m) => m.get(&(key, id)).copied(),
            GroupIndex::ByPeriod(m) => m.get(key, id),
        }
    }

    /// The group of `(key, id)`; `new` when it has none. (Inlined always, as
    /// [`Batch::push_row`].)
    #[inline(always)]
    fn get_or_insert(&mut self, key: u32, id: i64, new: u32) -> u32 {
        match self {
            GroupIndex::Hashed(m) => *m.entry((key, id)).or_insert(new),
            GroupIndex::ByPeriod(m) => match m.get(key, id) {
                Some(g) => g,
                None => {
                    m.insert(key, id, new);
                    new
                }
            },
        }
    }

    /// Set the group of `(key, id)`, which has none.
    fn insert(&mut self, key: u32, id: i64, g: u32) {
        match self {
            GroupIndex::Hashed(m) => {
                m.insert((key, id), g);
            }
            GroupIndex::ByPeriod(m) => m.insert(key, id, g),
        }
    }

    fn remove(&mut self, key: u32, id: i64) -> Option<u32> {
        match self {
            GroupIndex::Hashed(m) => m.remove(&(key, id)),
            GroupIndex::ByPeriod(m) => m.remove(key, id),
        }
    }

    fn clear(&mut self) {
        match self {
            GroupIndex::Hashed(m) => m.clear(),
            GroupIndex::ByPeriod(m) => m.clear(),
        }
    }
}

/// Staged values of one column.
enum Staged {
    Int(Vec<i64>),
    Float(Vec<f64>),
    Text { bytes: Vec<u8>, ends: Vec<u32> },
    Bool(Vec<u8>),
}

impl Staged {
    fn new(t: FieldType) -> Staged {
        match t {
            FieldType::Int => Staged::Int(Vec::new()),
            FieldType::Float => Staged::Float(Vec::new()),
            FieldType::Text => Staged::Text { bytes: Vec::new(), ends: Vec::new() },
            FieldType::Boolean => Staged::Bool(Vec::new()),
        }
    }

    fn value(&self, r: usize) -> Value {
        match self {
            Staged::Int(v) => Value::Int(v[r]),
            Staged::Float(v) => Value::Float(v[r]),
            Staged::Bool(v) => Value::Bool(v[r] != 0),
            Staged::Text { bytes, ends } => {
                let s = if r == 0 { 0 } else { ends[r - 1] as usize };
                Value::Text(String::from_utf8_lossy(&bytes[s..ends[r] as usize]).into_owned())
            }
        }
    }
}

/// A staged row taken out of a batch (savepoints keep the rows of incomplete slots of
/// ordered plugins).
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub key: u32,
    pub id: i64,
    pub time: i64,
    pub values: Vec<Value>,
}

/// The rows of one slot handed over to an ordered plugin, kept until the slot ends: their
/// event times, and their values row after row (two allocations, not one per row).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SlotRows {
    times: Vec<i64>,
    values: Vec<Value>,
}

impl SlotRows {
    /// Every row's event time and values, in order.
    pub fn iter(&self) -> impl Iterator<Item = (i64, &[Value])> {
        let width = if self.times.is_empty() { 0 } else { self.values.len() / self.times.len() };
        self.times.iter().enumerate().map(move |(r, &t)| (t, &self.values[r * width..(r + 1) * width]))
    }
}

/// Rows waiting for the next `add` call, and the reusable buffers of that call.
pub struct Batch {
    ordered: bool,
    index: GroupIndex,
    /// (key, slot id) of every group, in first-seen order.
    group_list: Vec<(u32, i64)>,
    /// The state's handle of every group's slot, when known.
    group_slot: Vec<SlotHandle>,
    /// A group relabelled into another (merged sessions) points at it.
    alias: Vec<u32>,
    /// Group of every staged row ([`TAKEN`] once an ordered call took it).
    row_group: Vec<u32>,
    row_time: Vec<i64>,
    staged: Vec<Staged>,
    /// Ordered plugins: rows taken by earlier calls and not yet compacted away.
    taken_rows: usize,
    pending: Pending,
    // Reused between calls.
    scratch: Scratch,
    /// Returned by the last [`Batch::assemble`] and handed back ([`Batch::recycle`]).
    spare_calls: Vec<(u32, i64)>,
    counts: Vec<u32>,
    order: Vec<u32>,
    /// Slot handles of the last assembled call's groups, in call order.
    pub(crate) call_slots: Vec<SlotHandle>,
    pub(crate) groups: Groups,
    pub(crate) events: Events,
}

const NO_ALIAS: u32 = u32::MAX;
/// The group of a row an ordered call took; the end of a chain.
const TAKEN: u32 = u32::MAX;
const NO_ROW: u32 = u32::MAX;

/// Ordered plugins: the rows of every group and which groups may be complete, so that a
/// call takes its groups without looking at the others.
#[derive(Default)]
struct Pending {
    /// Next row of the same group: chains in arrival order, joined when groups merge.
    next: Vec<u32>,
    /// Per group: first and last row of its chain, whether a call took it, and a lower
    /// bound of its slot's end (slots do not shrink: a session only grows or merges).
    head: Vec<u32>,
    tail: Vec<u32>,
    taken: Vec<bool>,
    end_at_least: Vec<i64>,
    /// (bound, group) of the groups not taken, earliest first; an entry whose bound is
    /// not the group's current one is stale.
    by_end: BinaryHeap<Reverse<(i64, u32)>>,
    /// Groups started since the last call (their slot's end not yet looked up).
    fresh: Vec<u32>,
}

impl Pending {
    fn clear(&mut self) {
        self.next.clear();
        self.head.clear();
        self.tail.clear();
        self.taken.clear();
        self.end_at_least.clear();
        self.by_end.clear();
        self.fresh.clear();
    }
}

/// The working vectors of [`Batch::assemble`], kept between calls for their capacity.
#[derive(Default)]
struct Scratch {
    /// Per staged group: its canonical group; its index in the call (or `u32::MAX`).
    canon: Vec<u32>,
    call_index: Vec<u32>,
    /// Per staged group: the index in the call of its canonical group ([`Batch::gather`]).
    call_of: Vec<u32>,
    /// Staged rows that stay for a later call; new numbers of the groups that stay.
    kept: Vec<usize>,
    renumber: Vec<u32>,
    /// The group list and slots before a restage.
    old_groups: Vec<(u32, i64)>,
    old_slots: Vec<SlotHandle>,
    /// Ordered plugins: the groups a call takes.
    complete: Vec<u32>,
}

impl Batch {
    pub fn new(fields: &[FieldType], key_arity: usize, ordered: bool) -> Batch {
        let columns = fields
            .iter()
            .map(|t| match t {
                FieldType::Int => Column::Int(Vec::new()),
                FieldType::Float => Column::Float(Vec::new()),
                FieldType::Text => Column::Text(empty_packed()),
                FieldType::Boolean => Column::Boolean(Vec::new()),
            })
            .collect();
        Batch {
            ordered,
            index: GroupIndex::Hashed(FastMap::default()),
            group_list: Vec::new(),
            group_slot: Vec::new(),
            alias: Vec::new(),
            row_group: Vec::new(),
            row_time: Vec::new(),
            staged: fields.iter().map(|&t| Staged::new(t)).collect(),
            taken_rows: 0,
            pending: Pending::default(),
            scratch: Scratch::default(),
            spare_calls: Vec::new(),
            counts: Vec::new(),
            order: Vec::new(),
            call_slots: Vec::new(),
            groups: empty_groups(key_arity as u32),
            events: Events { group_ends: Vec::new(), event_time: Vec::new(), columns },
        }
    }

    /// Groups indexed by period (see [`PeriodMap`]): for slot ids that many keys share.
    pub fn by_period(mut self) -> Batch {
        self.index = GroupIndex::ByPeriod(PeriodMap::default());
        self
    }

    /// Rows staged.
    #[inline]
    pub fn len(&self) -> usize {
        self.row_time.len() - self.taken_rows
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether rows of a plugin with ordered input wait for their slot to complete.
    pub fn ordered(&self) -> bool {
        self.ordered
    }

    /// Whether any row is staged for this slot.
    pub fn stages_group(&self, key: u32, id: i64) -> bool {
        self.index.get(key, id).is_some()
    }

    /// The keys rows are staged for (a key may come more than once).
    pub fn staged_keys(&self) -> impl Iterator<Item = u32> + '_ {
        let taken = |g: usize| self.ordered && self.pending.taken[self.canonical(g as u32) as usize];
        self.group_list.iter().enumerate().filter(move |&(g, _)| !taken(g)).map(|(_, &(key, _))| key)
    }

    /// Stage a row's group and time; then push one value per column, in column order.
    /// Returns true when the row starts a new group in this batch. (Inlined always, as
    /// [`crate::state::KeyTable::get`].)
    #[inline(always)]
    pub fn push_row(&mut self, key: u32, id: i64, time: i64) -> bool {
        let next = self.group_list.len() as u32;
        let g = self.index.get_or_insert(key, id, next);
        let new = g == next;
        if new {
            self.group_list.push((key, id));
            self.group_slot.push(NO_SLOT);
            self.alias.push(NO_ALIAS);
        }
        if self.ordered {
            self.chain(g, new);
        }
        self.row_group.push(g);
        self.row_time.push(time);
        new
    }

    /// Ordered plugins: the row about to be staged joins group `g`'s chain.
    fn chain(&mut self, g: u32, new: bool) {
        let (p, r) = (&mut self.pending, self.row_time.len() as u32);
        p.next.push(NO_ROW);
        if new {
            p.head.push(r);
            p.tail.push(r);
            p.taken.push(false);
            p.end_at_least.push(i64::MIN);
            p.fresh.push(g);
        } else {
            p.next[p.tail[g as usize] as usize] = r;
            p.tail[g as usize] = r;
        }
    }

    /// The state's handle of the slot of the group [`Self::push_row`] just started.
    #[inline]
    pub fn set_new_group_slot(&mut self, h: SlotHandle) {
        if let Some(last) = self.group_slot.last_mut() {
            *last = h;
        }
    }

    #[inline]
    pub fn push_int(&mut self, col: usize, v: i64) {
        if let Staged::Int(c) = &mut self.staged[col] {
            c.push(v)
        }
    }

    #[inline]
    pub fn push_float(&mut self, col: usize, v: f64) {
        if let Staged::Float(c) = &mut self.staged[col] {
            c.push(v)
        }
    }

    #[inline]
    pub fn push_bool(&mut self, col: usize, v: bool) {
        if let Staged::Bool(c) = &mut self.staged[col] {
            c.push(v as u8)
        }
    }

    #[inline]
    pub fn push_text(&mut self, col: usize, v: &str) {
        if let Staged::Text { bytes, ends } = &mut self.staged[col] {
            crate::state::append(bytes, v.as_bytes());
            ends.push(bytes.len() as u32);
        }
    }

    /// Stage a row taken out of a batch earlier.
    pub fn push(&mut self, row: &Row) {
        self.push_values(row.key, row.id, row.time, &row.values);
    }

    /// Stage a row of slot `(key, id)` from its values.
    pub fn push_values(&mut self, key: u32, id: i64, time: i64, values: &[Value]) {
        self.push_row(key, id, time);
        for (c, v) in values.iter().enumerate() {
            match v {
                Value::Int(x) => self.push_int(c, *x),
                Value::Float(x) => self.push_float(c, *x),
                Value::Bool(x) => self.push_bool(c, *x),
                Value::Text(x) => self.push_text(c, x),
            }
        }
    }

    /// Move the rows staged for `(key, from)` to `(key, to)` (sessions merged).
    pub fn relabel(&mut self, key: u32, from: i64, to: i64) {
        let Some(g_from) = self.index.remove(key, from) else { return };
        match self.index.get(key, to) {
            Some(g_to) => {
                self.alias[g_from as usize] = g_to;
                if self.ordered {
                    // The merged group's chain goes on with the other's rows.
                    let (p, f, t) = (&mut self.pending, g_from as usize, g_to as usize);
                    p.next[p.tail[t] as usize] = p.head[f];
                    p.tail[t] = p.tail[f];
                }
            }
            None => {
                self.index.insert(key, to, g_from);
                self.group_list[g_from as usize] = (key, to);
                self.group_slot[g_from as usize] = NO_SLOT;
            }
        }
    }

    fn canonical(&self, mut g: u32) -> u32 {
        while self.alias[g as usize] != NO_ALIAS {
            g = self.alias[g as usize];
        }
        g
    }

    /// The staged rows, in arrival order.
    pub fn rows(&self) -> Vec<Row> {
        (0..self.row_time.len())
            .filter(|&r| self.row_group[r] != TAKEN)
            .map(|r| {
                let (key, id) = self.group_list[self.canonical(self.row_group[r]) as usize];
                Row {
                    key,
                    id,
                    time: self.row_time[r],
                    values: self.staged.iter().map(|s| s.value(r)).collect(),
                }
            })
            .collect()
    }

    /// Lay staged rows out as one `add` call: rows grouped by (key, slot), current
    /// accumulators and windows from `state`: the groups whose slot ends at or before
    /// `ready` (None: every group); the other rows stay staged. Unordered plugins: rows in
    /// arrival order within a group. Ordered plugins: each group's rows sorted by event
    /// time (ties in arrival order). Returns the (key, slot id) of the call's groups, in
    /// call order (the order the groups were first staged in); empty when nothing is
    /// ready.
    pub fn assemble(&mut self, keys: &KeyTable, state: &WindowState, ready: Option<i64>) -> Vec<(u32, i64)> {
        let mut scratch = std::mem::take(&mut self.scratch);
        let calls = if self.ordered {
            self.assemble_complete(&mut scratch, keys, state, ready.unwrap_or(i64::MAX))
        } else {
            self.assemble_all(&mut scratch, keys, state, ready)
        };
        self.scratch = scratch;
        calls
    }

    /// The staged rows of the slots that end at or before `ready` (None: all), grouped by
    /// (key, slot) in arrival order; the others stay, in arrival order.
    fn assemble_all(
        &mut self,
        s: &mut Scratch,
        keys: &KeyTable,
        state: &WindowState,
        ready: Option<i64>,
    ) -> Vec<(u32, i64)> {
        let mut call_groups = self.start_call(s);
        let (canon, call_index) = (&s.canon, &mut s.call_index);
        for g in 0..self.group_list.len() {
            let (key, id) = self.group_list[g];
            // A slot not open (yet) is not complete, as for ordered plugins; every group is
            // taken without a look at its slot when all are.
            let complete = || {
                ready.is_none_or(|ready| {
                    state.slot_at(self.group_slot[g], key, id).is_some_and(|slot| slot.window.end <= ready)
                })
            };
            if canon[g] as usize == g && complete() {
                call_index[g] = call_groups.len() as u32;
                call_groups.push((key, id));
                self.call_slots.push(self.group_slot[g]);
            }
        }
        if call_groups.is_empty() {
            return call_groups;
        }
        self.gather(s, call_groups.len());
        self.lay_out(&call_groups, keys, state);
        self.restage(s);
        call_groups
    }

    /// Lay out one call for the slots `windows` ((key, slot id, slot handle), in call
    /// order), each with all its staged rows (in arrival order; a slot may have none).
    /// Unordered plugins. The rows stay staged until [`Batch::take_laid_out`]: a call that
    /// fails leaves the batch as it was.
    pub fn assemble_slots(
        &mut self,
        windows: impl ExactSizeIterator<Item = (u32, i64, SlotHandle)>,
        keys: &KeyTable,
        state: &WindowState,
    ) {
        let mut s = std::mem::take(&mut self.scratch);
        let mut call_groups = self.start_call(&mut s);
        let n_call = windows.len();
        for (i, (key, id, h)) in windows.enumerate() {
            if let Some(g) = self.index.get(key, id) {
                s.call_index[s.canon[g as usize] as usize] = i as u32;
            }
            call_groups.push((key, id));
            self.call_slots.push(h);
        }
        self.gather(&mut s, n_call);
        self.lay_out(&call_groups, keys, state);
        self.spare_calls = call_groups;
        self.scratch = s;
    }

    /// A call with no group yet: every staged group's canonical group (merged sessions:
    /// the one merged into) in `s.canon`, none in the call (`s.call_index`); the call's
    /// groups, empty.
    fn start_call(&mut self, s: &mut Scratch) -> Vec<(u32, i64)> {
        let n_groups = self.group_list.len();
        s.canon.clear();
        s.canon.extend((0..n_groups as u32).map(|g| self.canonical(g)));
        s.call_index.clear();
        s.call_index.resize(n_groups, u32::MAX);
        self.call_slots.clear();
        let mut call_groups = std::mem::take(&mut self.spare_calls);
        call_groups.clear();
        call_groups
    }

    /// Take the rows of the call [`Batch::assemble_slots`] laid out out of the batch.
    pub fn take_laid_out(&mut self) {
        let mut s = std::mem::take(&mut self.scratch);
        self.restage(&mut s);
        self.scratch = s;
    }

    /// Counting sort of the staged rows by call group (`s.call_index` of their canonical
    /// group, `u32::MAX`: not in the call) into `order` and `events.group_ends`; stable
    /// (arrival order). The rows of the other groups, which stay, into `s.kept`.
    fn gather(&mut self, s: &mut Scratch, n_call: usize) {
        // Each staged group's index in the call, looked up once a group (there are several
        // rows a group), so that a row takes one load, not two.
        s.call_of.clear();
        s.call_of.extend(s.canon.iter().map(|&c| s.call_index[c as usize]));
        let call_of_group = &s.call_of;
        self.counts.clear();
        self.counts.resize(n_call + 1, 0);
        let call_of = |g: u32| call_of_group[g as usize];
        for &g in &self.row_group {
            if call_of(g) != u32::MAX {
                self.counts[call_of(g) as usize + 1] += 1;
            }
        }
        for i in 0..n_call {
            self.counts[i + 1] += self.counts[i];
        }
        self.events.group_ends.clear();
        self.events.group_ends.extend_from_slice(&self.counts[1..]);
        self.order.clear();
        self.order.resize(self.counts[n_call] as usize, 0);
        s.kept.clear();
        for (row, &g) in self.row_group.iter().enumerate() {
            match call_of(g) {
                u32::MAX => s.kept.push(row),
                c => {
                    let slot = &mut self.counts[c as usize];
                    self.order[*slot as usize] = row as u32;
                    *slot += 1;
                }
            }
        }
    }

    /// Ordered plugins: the groups whose slot ends at or before `ready`, found through the
    /// heap of slot ends (the groups that stay are not looked at), their rows through their
    /// chains. The rows taken leave holes, closed once they outnumber the rows staged.
    fn assemble_complete(
        &mut self,
        s: &mut Scratch,
        keys: &KeyTable,
        state: &WindowState,
        ready: i64,
    ) -> Vec<(u32, i64)> {
        // A group without a slot (none yet, or no more) waits among the fresh ones, looked
        // at again by every call, and goes only into a call that takes everything.
        let end_of = |g: u32| -> Option<i64> {
            let (k, id) = self.group_list[g as usize];
            match state.slot_at(self.group_slot[g as usize], k, id) {
                Some(s) => Some(s.window.end),
                None => (ready == i64::MAX).then_some(i64::MAX),
            }
        };
        let p = &mut self.pending;
        for g in std::mem::take(&mut p.fresh) {
            if self.alias[g as usize] != NO_ALIAS || p.taken[g as usize] {
                continue;
            }
            match end_of(g) {
                Some(end) => {
                    p.end_at_least[g as usize] = end;
                    p.by_end.push(Reverse((end, g)));
                }
                None => p.fresh.push(g),
            }
        }
        let taken = &mut s.complete;
        taken.clear();
        while let Some(&Reverse((bound, g))) = p.by_end.peek() {
            if bound > ready {
                break;
            }
            p.by_end.pop();
            let gi = g as usize;
            if p.taken[gi] || self.alias[gi] != NO_ALIAS || p.end_at_least[gi] != bound {
                continue;
            }
            match end_of(g) {
                Some(end) if end <= ready => {
                    p.taken[gi] = true;
                    taken.push(g);
                }
                // The slot grew since (a session): it waits for its new end.
                Some(end) => {
                    p.end_at_least[gi] = end;
                    p.by_end.push(Reverse((end, g)));
                }
                None => {
                    p.end_at_least[gi] = i64::MIN;
                    p.fresh.push(g);
                }
            }
        }
        let mut call_groups = std::mem::take(&mut self.spare_calls);
        call_groups.clear();
        self.call_slots.clear();
        if taken.is_empty() {
            return call_groups;
        }
        taken.sort_unstable();
        self.events.group_ends.clear();
        self.order.clear();
        for &g in taken.iter() {
            let start = self.order.len();
            let mut r = p.head[g as usize];
            while r != NO_ROW {
                self.order.push(r);
                r = p.next[r as usize];
            }
            let times = &self.row_time;
            // Merged chains are not in arrival order: the row number breaks ties.
            self.order[start..].sort_unstable_by_key(|&r| (times[r as usize], r));
            self.events.group_ends.push(self.order.len() as u32);
            let group = self.group_list[g as usize];
            self.index.remove(group.0, group.1);
            call_groups.push(group);
            self.call_slots.push(self.group_slot[g as usize]);
        }
        self.lay_out(&call_groups, keys, state);
        for &r in &self.order {
            self.row_group[r as usize] = TAKEN;
        }
        self.taken_rows += self.order.len();
        if self.taken_rows > self.len() {
            self.compact_taken(s);
        }
        call_groups
    }

    /// Ordered plugins: drop the rows taken, renumber the groups left (in the order of
    /// their first row) and chain their rows again.
    fn compact_taken(&mut self, s: &mut Scratch) {
        let n_groups = self.group_list.len();
        s.canon.clear();
        s.canon.extend((0..n_groups as u32).map(|g| self.canonical(g)));
        s.kept.clear();
        s.kept.extend((0..self.row_group.len()).filter(|&r| self.row_group[r] != TAKEN));
        let bounds = std::mem::take(&mut self.pending.end_at_least);
        let fresh = std::mem::take(&mut self.pending.fresh);
        self.restage(s);
        self.taken_rows = 0;
        let p = &mut self.pending;
        p.clear();
        let n = self.group_list.len();
        p.head.resize(n, NO_ROW);
        p.tail.resize(n, NO_ROW);
        p.taken.resize(n, false);
        p.end_at_least.resize(n, i64::MIN);
        p.next.resize(self.row_group.len(), NO_ROW);
        for (r, &g) in self.row_group.iter().enumerate() {
            let (g, r) = (g as usize, r as u32);
            match p.tail[g] {
                NO_ROW => p.head[g] = r,
                t => p.next[t as usize] = r,
            }
            p.tail[g] = r;
        }
        for (old, &new) in s.renumber.iter().enumerate() {
            if new != u32::MAX && bounds[old] != i64::MIN {
                p.end_at_least[new as usize] = bounds[old];
                p.by_end.push(Reverse((bounds[old], new)));
            }
        }
        // Groups still without a slot end stay fresh (a taken group is never fresh).
        p.fresh.extend(
            fresh.iter().map(|&g| s.renumber[s.canon[g as usize] as usize]).filter(|&g| g != u32::MAX),
        );
    }

    /// The call's columns and groups, from the rows in `self.order` (cut by
    /// `events.group_ends`) and the groups `call_groups` (their slots in `call_slots`).
    fn lay_out(&mut self, call_groups: &[(u32, i64)], keys: &KeyTable, state: &WindowState) {
        let order = &self.order;
        self.events.event_time.clear();
        self.events.event_time.extend(order.iter().map(|&r| self.row_time[r as usize]));
        for (staged, column) in self.staged.iter().zip(self.events.columns.iter_mut()) {
            match (staged, column) {
                (Staged::Int(src), Column::Int(dst)) => {
                    dst.clear();
                    dst.extend(order.iter().map(|&r| src[r as usize]));
                }
                (Staged::Float(src), Column::Float(dst)) => {
                    dst.clear();
                    dst.extend(order.iter().map(|&r| src[r as usize]));
                }
                (Staged::Bool(src), Column::Boolean(dst)) => {
                    dst.clear();
                    dst.extend(order.iter().map(|&r| src[r as usize]));
                }
                (Staged::Text { bytes, ends }, Column::Text(dst)) => {
                    packed_clear(dst);
                    for &r in order {
                        let r = r as usize;
                        let s = if r == 0 { 0 } else { ends[r - 1] as usize };
                        packed_push(dst, &bytes[s..ends[r] as usize]);
                    }
                }
                _ => unreachable!("staged and call columns are built from the same field types"),
            }
        }
        let slots = &self.call_slots;
        fill_groups(
            &mut self.groups,
            keys,
            call_groups.iter().zip(slots).enumerate().map(|(i, (&(k, id), &h))| {
                if let Some(&(further, _)) = call_groups.get(i + 2 * PREFETCH_DISTANCE) {
                    keys.prefetch_span(further);
                }
                if let (Some(&(ahead, _)), Some(&at)) =
                    (call_groups.get(i + PREFETCH_DISTANCE), slots.get(i + PREFETCH_DISTANCE))
                {
                    keys.prefetch(ahead);
                    state.prefetch(at);
                }
                let slot = state.slot_at(h, k, id);
                (
                    k,
                    slot.map_or(Window { start: id, end: id }, |s| s.window),
                    slot.map_or(&[][..], |s| &s.acc),
                )
            }),
        );
    }

    /// Hand back what [`Batch::assemble`] returned, for its capacity.
    pub fn recycle(&mut self, call_groups: Vec<(u32, i64)>) {
        self.spare_calls = call_groups;
    }

    /// Keep only the rows `kept` (in arrival order), renumbering their groups; the
    /// columns are compacted in place.
    fn restage(&mut self, s: &mut Scratch) {
        let (kept, canon) = (&s.kept, &s.canon);
        // New group numbers, in first-seen order of the kept rows.
        std::mem::swap(&mut self.group_list, &mut s.old_groups);
        std::mem::swap(&mut self.group_slot, &mut s.old_slots);
        let (old_groups, old_slots) = (&s.old_groups, &s.old_slots);
        self.group_list.clear();
        self.group_slot.clear();
        self.index.clear();
        self.alias.clear();
        let renumber = &mut s.renumber;
        renumber.clear();
        renumber.resize(old_groups.len(), u32::MAX);
        for (dst, &r) in kept.iter().enumerate() {
            let g = canon[self.row_group[r] as usize] as usize;
            if renumber[g] == u32::MAX {
                renumber[g] = self.group_list.len() as u32;
                let (key, id) = old_groups[g];
                self.index.insert(key, id, renumber[g]);
                self.group_list.push((key, id));
                self.group_slot.push(old_slots[g]);
                self.alias.push(NO_ALIAS);
            }
            self.row_group[dst] = renumber[g];
            self.row_time[dst] = self.row_time[r];
        }
        self.row_group.truncate(kept.len());
        self.row_time.truncate(kept.len());
        for s in &mut self.staged {
            match s {
                Staged::Int(v) => compact(v, kept),
                Staged::Float(v) => compact(v, kept),
                Staged::Bool(v) => compact(v, kept),
                Staged::Text { bytes, ends } if kept.is_empty() => {
                    bytes.clear();
                    ends.clear();
                }
                Staged::Text { bytes, ends } => {
                    // In place: kept rows only move towards the front. `ends[r - 1]` is
                    // read after `ends[..dst]` were rewritten only when `r == dst`, when
                    // rows `..dst` were all kept and their ends did not change.
                    let mut fill = 0usize;
                    for (dst, &r) in kept.iter().enumerate() {
                        let s = if r == 0 { 0 } else { ends[r - 1] as usize };
                        let e = ends[r] as usize;
                        bytes.copy_within(s..e, fill);
                        fill += e - s;
                        ends[dst] = fill as u32;
                    }
                    bytes.truncate(fill);
                    ends.truncate(kept.len());
                }
            }
        }
    }
}

/// Keep `v[kept[0]], v[kept[1]], ...` (ascending indices) at the front of `v`.
fn compact<T: Copy>(v: &mut Vec<T>, kept: &[usize]) {
    for (dst, &r) in kept.iter().enumerate() {
        v[dst] = v[r];
    }
    v.truncate(kept.len());
}

impl Batch {
    /// The rows of the last assembled call's group `i` (in call order: event-time order
    /// for ordered plugins).
    pub fn call_rows(&self, i: usize) -> SlotRows {
        let s = if i == 0 { 0 } else { self.events.group_ends[i - 1] as usize };
        let e = self.events.group_ends[i] as usize;
        let columns = &self.events.columns;
        let mut rows = SlotRows {
            times: self.events.event_time[s..e].to_vec(),
            values: Vec::with_capacity((e - s) * columns.len()),
        };
        for r in s..e {
            rows.values.extend(columns.iter().map(|c| match c {
                Column::Int(v) => Value::Int(v[r]),
                Column::Float(v) => Value::Float(v[r]),
                Column::Boolean(v) => Value::Bool(v[r] != 0),
                Column::Text(p) => {
                    Value::Text(String::from_utf8_lossy(crate::plugin::packed_item(p, r)).into_owned())
                }
            }));
        }
        rows
    }

    /// Groups `which` of the last assembled call (in that order), as a call of their own.
    pub fn subset(&self, which: &[usize]) -> (Groups, Events) {
        let arity = self.groups.key_arity as usize;
        let mut g = empty_groups(arity as u32);
        let mut rows: Vec<usize> = Vec::new();
        let mut group_ends = Vec::with_capacity(which.len());
        for &i in which {
            for j in 0..arity {
                packed_push(&mut g.keys, crate::plugin::packed_item(&self.groups.keys, i * arity + j));
            }
            g.window_start.push(self.groups.window_start[i]);
            g.window_end.push(self.groups.window_end[i]);
            packed_push(&mut g.accumulators, crate::plugin::packed_item(&self.groups.accumulators, i));
            let s = if i == 0 { 0 } else { self.events.group_ends[i - 1] as usize };
            rows.extend(s..self.events.group_ends[i] as usize);
            group_ends.push(rows.len() as u32);
        }
        let columns = self
            .events
            .columns
            .iter()
            .map(|c| match c {
                Column::Int(v) => Column::Int(rows.iter().map(|&r| v[r]).collect()),
                Column::Float(v) => Column::Float(rows.iter().map(|&r| v[r]).collect()),
                Column::Boolean(v) => Column::Boolean(rows.iter().map(|&r| v[r]).collect()),
                Column::Text(p) => {
                    Column::Text(packed_of(rows.iter().map(|&r| crate::plugin::packed_item(p, r))))
                }
            })
            .collect();
        let events = Events {
            group_ends,
            event_time: rows.iter().map(|&r| self.events.event_time[r]).collect(),
            columns,
        };
        (g, events)
    }
}

pub fn empty_groups(key_arity: u32) -> Groups {
    Groups {
        keys: empty_packed(),
        key_arity,
        window_start: Vec::new(),
        window_end: Vec::new(),
        accumulators: empty_packed(),
    }
}

/// Fill a call's `groups` from (key, window, accumulator) triples.
pub fn fill_groups<'a>(
    groups: &mut Groups,
    keys: &KeyTable,
    items: impl Iterator<Item = (u32, Window, &'a [u8])>,
) {
    packed_clear(&mut groups.keys);
    packed_clear(&mut groups.accumulators);
    groups.window_start.clear();
    groups.window_end.clear();
    for (key, window, acc) in items {
        for field in keys.raw_fields(key) {
            packed_push(&mut groups.keys, field);
        }
        groups.window_start.push(window.start);
        groups.window_end.push(window.end);
        packed_push(&mut groups.accumulators, acc);
    }
}

/// A packed buffer of the given items.
pub fn packed_of<'a>(items: impl Iterator<Item = &'a [u8]>) -> Packed {
    let mut p = empty_packed();
    for i in items {
        packed_push(&mut p, i);
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::push_key_field;

    fn two_keys() -> (KeyTable, u32, u32) {
        let mut keys = KeyTable::default();
        let mut k = Vec::new();
        push_key_field(&mut k, b"a");
        let a = keys.intern(&k);
        k.clear();
        push_key_field(&mut k, b"b");
        let b = keys.intern(&k);
        (keys, a, b)
    }

    #[test]
    fn rows_are_grouped_stably_and_sorted_when_ordered() {
        let (keys, a, b) = two_keys();
        let mut state = WindowState::default();
        state.open(a, 0, Window { start: 0, end: 10 });
        state.open(b, 0, Window { start: 0, end: 10 });
        for (ordered, by_period) in [(false, false), (true, false), (false, true), (true, true)] {
            let mut batch = Batch::new(&[FieldType::Int, FieldType::Text], 1, ordered);
            if by_period {
                batch = batch.by_period();
            }
            for (key, t, v, s) in [(a, 5, 1, "x"), (b, 3, 2, "y"), (a, 2, 3, "zz"), (b, 1, 4, "")] {
                batch.push_row(key, 0, t);
                batch.push_int(0, v);
                batch.push_text(1, s);
            }
            let groups = batch.assemble(&keys, &state, None);
            assert_eq!(groups, vec![(a, 0), (b, 0)]);
            assert_eq!(batch.events.group_ends, vec![2, 4]);
            let Column::Int(ints) = &batch.events.columns[0] else { panic!() };
            let Column::Text(texts) = &batch.events.columns[1] else { panic!() };
            if ordered {
                assert_eq!(batch.events.event_time, vec![2, 5, 1, 3]);
                assert_eq!(ints, &vec![3, 1, 4, 2]);
                assert_eq!(texts.bytes, b"zzxy");
                assert_eq!(texts.ends, vec![2, 3, 3, 4]);
            } else {
                assert_eq!(batch.events.event_time, vec![5, 2, 3, 1]);
                assert_eq!(ints, &vec![1, 3, 2, 4]);
                assert_eq!(texts.bytes, b"xzzy");
            }
            assert_eq!(batch.groups.keys.bytes, b"ab");
            assert_eq!(batch.groups.window_end, vec![10, 10]);
            assert_eq!(batch.groups.accumulators.ends, vec![0, 0]);
            assert!(batch.is_empty());
        }
    }

    #[test]
    fn only_complete_slots_are_taken_and_relabelled_rows_follow() {
        let (keys, a, b) = two_keys();
        let mut state = WindowState::default();
        state.open(a, 0, Window { start: 0, end: 10 });
        state.open(a, 10, Window { start: 10, end: 20 });
        state.open(b, 7, Window { start: 7, end: 9 });
        let mut batch = Batch::new(&[FieldType::Int, FieldType::Text], 1, true);
        for (key, id, t, v, s) in [
            (a, 10, 12, 1, "p"),
            (a, 0, 3, 2, "qq"),
            (b, 8, 8, 3, ""),
            (a, 10, 11, 4, "rrr"),
            (a, 0, 1, 5, "s"),
        ] {
            batch.push_row(key, id, t);
            batch.push_int(0, v);
            batch.push_text(1, s);
        }
        batch.relabel(b, 8, 7); // session 8 merged into session 7
        let groups = batch.assemble(&keys, &state, Some(10));
        assert_eq!(groups, vec![(a, 0), (b, 7)]);
        let Column::Int(ints) = &batch.events.columns[0] else { panic!() };
        assert_eq!(ints, &vec![5, 2, 3]);
        let left = batch.rows();
        assert_eq!(
            left.iter().map(|r| (r.key, r.id, r.time)).collect::<Vec<_>>(),
            vec![(a, 10, 12), (a, 10, 11)]
        );
        let groups = batch.assemble(&keys, &state, Some(20));
        assert_eq!(groups, vec![(a, 10)]);
        assert_eq!(batch.events.event_time, vec![11, 12]);
        // The kept rows' text moved to the front of the staged column.
        let Column::Text(texts) = &batch.events.columns[1] else { panic!() };
        assert_eq!((&texts.bytes[..], &texts.ends[..]), (&b"rrrp"[..], &[3, 4][..]));
        assert!(batch.is_empty());
    }

    /// What a call must hold, from the rule alone: the slots whose end is at or before the
    /// watermark, each with every row staged for it (merged sessions: theirs too), sorted
    /// by event time for an ordered plugin, ties (and an unordered plugin's rows) in
    /// arrival order; the rest stays staged in arrival order. Checked over random
    /// stagings, merges, grown slots and watermarks.
    #[test]
    fn calls_take_exactly_the_complete_slots_and_their_rows_in_order() {
        use crate::generate::Rng;
        /// A staged row of the model: arrival number, key, slot, time, values.
        #[derive(Clone)]
        struct Model {
            seq: usize,
            key: u32,
            id: i64,
            time: i64,
            int: i64,
            text: String,
        }
        let mut keys = KeyTable::default();
        let ids: Vec<u32> = (0..6)
            .map(|k| {
                let mut e = Vec::new();
                push_key_field(&mut e, format!("k{k}").as_bytes());
                keys.intern(&e)
            })
            .collect();
        for seed in 0..160 {
            let mut rng = Rng::new(seed);
            // Both indexes of slots and groups: hashed, and by period (slot ids as periods);
            // ordered plugins, and unordered ones (handed the complete slots before firing).
            let ordered = seed % 4 >= 2;
            let batch = Batch::new(&[FieldType::Int, FieldType::Text], 1, ordered);
            let (mut state, mut batch) = match seed % 2 {
                0 => (WindowState::default(), batch),
                _ => (WindowState::by_period(), batch.by_period()),
            };
            let mut staged: Vec<Model> = Vec::new();
            let (mut seq, mut wm) = (0usize, 0i64);
            for step in 0..400 {
                let key = ids[rng.below(ids.len() as u64) as usize];
                let id = rng.below(8) as i64 * 10;
                match rng.below(20) {
                    0 => {
                        // A slot grows (a session): its end only moves later.
                        if let Some(w) = state.slot(key, id).map(|s| s.window) {
                            let grown = Window { start: w.start, end: w.end + rng.below(30) as i64 };
                            state.set_window(key, id, grown);
                        }
                    }
                    1 => {
                        // Session `id` merges into `to`: its rows and window go there.
                        let to = rng.below(8) as i64 * 10;
                        let (Some(a), Some(b)) = (state.slot(key, id), state.slot(key, to)) else { continue };
                        if id == to {
                            continue;
                        }
                        let w = a.window.union(&b.window);
                        state.remove(key, id);
                        state.set_window(key, to, w);
                        batch.relabel(key, id, to);
                        staged.iter_mut().filter(|r| r.key == key && r.id == id).for_each(|r| r.id = to);
                    }
                    2..=4 => {
                        wm += rng.below(25) as i64;
                        let ready = if step == 399 { None } else { Some(wm) };
                        let calls = batch.assemble(&keys, &state, ready);
                        let end = |k: u32, id: i64| state.slot(k, id).map_or(i64::MAX, |s| s.window.end);
                        let done = |r: &Model| ready.is_none_or(|wm| end(r.key, r.id) <= wm);
                        let mut want: Vec<(u32, i64)> =
                            staged.iter().filter(|r| done(r)).map(|r| (r.key, r.id)).collect();
                        want.sort_unstable();
                        want.dedup();
                        let mut got = calls.clone();
                        got.sort_unstable();
                        assert_eq!(got, want, "seed {seed} step {step}: the complete slots");
                        let Column::Int(ints) = &batch.events.columns[0] else { panic!() };
                        let Column::Text(texts) = &batch.events.columns[1] else { panic!() };
                        for (i, &(k, id)) in calls.iter().enumerate() {
                            let mut rows: Vec<&Model> =
                                staged.iter().filter(|r| (r.key, r.id) == (k, id)).collect();
                            if ordered {
                                rows.sort_by_key(|r| (r.time, r.seq));
                            }
                            let from = if i == 0 { 0 } else { batch.events.group_ends[i - 1] as usize };
                            let to = batch.events.group_ends[i] as usize;
                            let got: Vec<(i64, i64, &[u8])> = (from..to)
                                .map(|j| {
                                    (
                                        batch.events.event_time[j],
                                        ints[j],
                                        crate::plugin::packed_item(texts, j),
                                    )
                                })
                                .collect();
                            let want: Vec<(i64, i64, &[u8])> =
                                rows.iter().map(|r| (r.time, r.int, r.text.as_bytes())).collect();
                            assert_eq!(got, want, "seed {seed} step {step}: the rows of {k}/{id}");
                            let w = state.slot(k, id).map(|s| s.window);
                            assert_eq!(batch.groups.window_end[i], w.map_or(id, |w| w.end));
                        }
                        staged.retain(|r| !done(r));
                        batch.recycle(calls);
                    }
                    _ => {
                        if rng.below(4) > 0 {
                            state.open(key, id, Window { start: id, end: id + 10 + rng.below(20) as i64 });
                        }
                        let (time, int) = (id + rng.below(10) as i64, rng.below(100) as i64);
                        let text = "x".repeat(rng.below(4) as usize);
                        batch.push_row(key, id, time);
                        batch.push_int(0, int);
                        batch.push_text(1, &text);
                        staged.push(Model { seq, key, id, time, int, text });
                        seq += 1;
                    }
                }
                let left: Vec<(u32, i64, i64, Vec<Value>)> =
                    batch.rows().into_iter().map(|r| (r.key, r.id, r.time, r.values)).collect();
                let want: Vec<(u32, i64, i64, Vec<Value>)> = staged
                    .iter()
                    .map(|r| (r.key, r.id, r.time, vec![Value::Int(r.int), Value::Text(r.text.clone())]))
                    .collect();
                assert_eq!(left, want, "seed {seed} step {step}: the rows that stay, in arrival order");
                assert_eq!(batch.len(), staged.len());
                let mut staged_keys: Vec<u32> = batch.staged_keys().collect();
                staged_keys.sort_unstable();
                staged_keys.dedup();
                let mut want_keys: Vec<u32> = staged.iter().map(|r| r.key).collect();
                want_keys.sort_unstable();
                want_keys.dedup();
                assert_eq!(staged_keys, want_keys, "seed {seed} step {step}: the keys with staged rows");
            }
        }
    }
}

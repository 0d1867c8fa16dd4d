//! Slots of state: one accumulator per open (key, window), found by a hash index or, for
//! periods many keys share, by period; and the timers that say which windows the
//! watermark closes.

use super::slab::Slab;
use super::*;

/// What a timer does when the watermark reaches its time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum TimerKind {
    /// Emit the window's result.
    Fire,
    /// Drop the slot: its allowed lateness is over.
    Cleanup,
}

/// A timer: at watermark `time`, do `kind` for slot or window `(key, id)`. Timers come
/// due by time, then fire before cleanup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timer {
    pub time: i64,
    pub kind: TimerKind,
    pub key: u32,
    pub id: i64,
}

/// An accumulator's bytes: up to 16 of them (a typical aggregate's) held in place, so
/// that most windows cost no allocation of their own and are read without a pointer
/// chase; longer ones go to the heap.
pub type Acc = smallvec::SmallVec<[u8; 16]>;

/// One slot of state: a window, a sliding-window pane or a session, with its accumulator.
#[derive(Debug, Clone)]
pub struct Slot {
    pub window: Window,
    pub acc: Acc,
}

/// The (key, id) of the timers due at one time, by kind.
#[derive(Default)]
struct Due {
    fire: Vec<(u32, i64)>,
    cleanup: Vec<(u32, i64)>,
}

/// A slot's place in the state, for repeated access without a lookup (see
/// [`WindowState::slot_at`]); [`NO_SLOT`] when unknown.
pub type SlotHandle = u32;
pub const NO_SLOT: SlotHandle = u32::MAX;

/// A slot with its (key, id); removed ones stay, vacant, until the slab is compacted.
#[derive(Debug, Clone)]
pub(super) struct Entry {
    pub(super) key: u32,
    pub(super) live: bool,
    /// The [`WindowState`] generation of its last write (see [`WindowState::capture`]).
    pub(super) written: u16,
    pub(super) id: i64,
    pub(super) slot: Slot,
}

impl Entry {
    #[inline]
    fn holds(&self, key: u32, id: i64) -> bool {
        self.live && self.key == key && self.id == id
    }
}

/// The index's hash of the slot at `h`.
#[inline]
fn hash_at(hasher: &foldhash::fast::RandomState, slab: &Slab<Entry>, h: u32) -> u64 {
    let e = &slab[h as usize];
    hasher.hash_one((e.key, e.id))
}

/// Where the open slots lie in the slab, by (key id, slot id).
pub(super) enum SlotIndex {
    /// Hashed by (key, id): slot ids that are not shared by many keys (session numbers).
    Hashed { table: hashbrown::HashTable<u32>, hasher: foldhash::fast::RandomState },
    /// By slot id first, then by key id: slot ids that many keys share (a tumbling
    /// window's or a sliding pane's start), so that a slot is found by one load from a
    /// small array instead of a probe of a table of every slot.
    ByPeriod(PeriodMap),
}

/// A map from (key id, period) to a u32 (a slot's handle, a batch's group) for periods
/// that many keys share (a tumbling window's or a sliding pane's start): the open
/// periods, each with its entries by key id, so that an entry is found by one load from
/// a small array instead of a probe of a table of every entry.
#[derive(Default)]
pub(crate) struct PeriodMap {
    /// Ascending by id.
    list: Vec<Period>,
    /// Entries in all periods.
    len: usize,
    /// Arrays of periods that ended, for the next ones.
    spare: Vec<Vec<u32>>,
}

struct Period {
    id: i64,
    slots: PeriodEntries,
    /// Entries in this period.
    open: u32,
    /// The largest key id that reached it.
    max_key: u32,
}

/// The slots of one slot id ([`WindowState::period`]).
pub enum PeriodSlots<'a> {
    /// Of a period (none open: None).
    Period(Option<&'a PeriodEntries>),
    /// Of a state hashed by (key, id).
    Hashed(&'a WindowState, i64),
}

impl PeriodSlots<'_> {
    /// The handle of the key's slot.
    #[inline]
    pub fn handle(&self, key: u32) -> Option<SlotHandle> {
        match self {
            PeriodSlots::Period(entries) => entries.and_then(|e| e.get(key)),
            PeriodSlots::Hashed(state, id) => state.handle(key, *id),
        }
    }
}

/// A period's entries by key id. Dense while that costs at most [`DENSE_SPREAD`] entries
/// per open slot (plus [`DENSE_BASE`]); hashed otherwise: while a period has few slots,
/// and when few of many keys reach it (a late one, with a long allowed lateness).
pub enum PeriodEntries {
    /// [`NO_SLOT`]: none.
    Dense(Vec<u32>),
    Sparse(hashbrown::HashMap<u32, u32, foldhash::fast::RandomState>),
}

impl PeriodEntries {
    /// The entry of a key id.
    #[inline]
    fn get(&self, key: u32) -> Option<u32> {
        match self {
            PeriodEntries::Dense(v) => v.get(key as usize).copied().filter(|&h| h != NO_SLOT),
            PeriodEntries::Sparse(m) => m.get(&key).copied(),
        }
    }

    /// The entry of a key id, to replace it.
    fn get_mut(&mut self, key: u32) -> Option<&mut u32> {
        match self {
            PeriodEntries::Dense(v) => v.get_mut(key as usize).filter(|h| **h != NO_SLOT),
            PeriodEntries::Sparse(m) => m.get_mut(&key),
        }
    }
}

/// Arrays kept for later periods.
const SPARE_PERIODS: usize = 4;

const DENSE_SPREAD: usize = 16;
const DENSE_BASE: usize = 4096;

impl PeriodMap {
    #[inline]
    fn period(&self, id: i64) -> Option<&Period> {
        // Few periods are open; an event usually reaches the last one or the one before
        // (as does a look at a sliding window's pane before the event's).
        match self.list.as_slice() {
            [.., p] if p.id == id => Some(p),
            [.., p, _] if p.id == id => Some(p),
            _ => self.list.binary_search_by_key(&id, |p| p.id).ok().map(|i| &self.list[i]),
        }
    }

    /// The entry of `(key, id)`.
    #[inline]
    pub(crate) fn get(&self, key: u32, id: i64) -> Option<u32> {
        self.period(id)?.slots.get(key)
    }

    /// Ask for the entry of `(key, id)` ahead of its reading (a dense period's).
    #[inline]
    fn prefetch(&self, key: u32, id: i64) {
        if let Some(PeriodEntries::Dense(v)) = self.period(id).map(|p| &p.slots) {
            if let Some(e) = v.get(key as usize) {
                prefetch(e);
            }
        }
    }

    /// Add the entry of `(key, id)`, known to be absent (`h` is not [`NO_SLOT`]).
    pub(crate) fn insert(&mut self, key: u32, id: i64, h: u32) {
        let at = match self.list.binary_search_by_key(&id, |p| p.id) {
            Ok(at) => at,
            Err(at) => {
                let slots = PeriodEntries::Sparse(Default::default());
                self.list.insert(at, Period { id, slots, open: 0, max_key: 0 });
                at
            }
        };
        let p = &mut self.list[at];
        p.open += 1;
        p.max_key = p.max_key.max(key);
        // Dense while that costs at most DENSE_SPREAD entries an open slot: a period
        // starts hashed (its first keys may have any ids) and turns dense as it fills.
        let dense_len = DENSE_SPREAD * p.open as usize + DENSE_BASE;
        match &mut p.slots {
            PeriodEntries::Sparse(m) if (p.max_key as usize) < dense_len => {
                let mut v = self.spare.pop().unwrap_or_default();
                v.resize(p.max_key as usize + 1, NO_SLOT);
                m.iter().for_each(|(&k, &h)| v[k as usize] = h);
                p.slots = PeriodEntries::Dense(v);
            }
            PeriodEntries::Dense(v) if key as usize >= v.len() && key as usize >= dense_len => {
                let open = v.iter().enumerate().filter(|(_, &h)| h != NO_SLOT);
                p.slots = PeriodEntries::Sparse(open.map(|(k, &h)| (k as u32, h)).collect());
            }
            _ => {}
        }
        match &mut p.slots {
            PeriodEntries::Dense(v) => {
                let k = key as usize;
                if k >= v.len() {
                    v.resize((k + 1).max(2 * v.len()).min(dense_len), NO_SLOT);
                }
                v[k] = h;
            }
            PeriodEntries::Sparse(m) => {
                m.insert(key, h);
            }
        }
        self.len += 1;
    }

    /// Replace the entry of `(key, id)`, if present.
    pub(crate) fn set(&mut self, key: u32, id: i64, h: u32) {
        let Ok(at) = self.list.binary_search_by_key(&id, |p| p.id) else { return };
        if let Some(x) = self.list[at].slots.get_mut(key) {
            *x = h;
        }
    }

    /// Remove the entry of `(key, id)`.
    pub(crate) fn remove(&mut self, key: u32, id: i64) -> Option<u32> {
        let at = self.list.binary_search_by_key(&id, |p| p.id).ok()?;
        let p = &mut self.list[at];
        let h = match &mut p.slots {
            PeriodEntries::Dense(v) => {
                let h = std::mem::replace(v.get_mut(key as usize)?, NO_SLOT);
                (h != NO_SLOT).then_some(h)?
            }
            PeriodEntries::Sparse(m) => m.remove(&key)?,
        };
        p.open -= 1;
        self.len -= 1;
        if p.open == 0 {
            let ended = self.list.remove(at);
            self.keep(ended);
        }
        Some(h)
    }

    /// Remove every entry.
    pub(crate) fn clear(&mut self) {
        for ended in std::mem::take(&mut self.list) {
            self.keep(ended);
        }
        self.len = 0;
    }

    /// Keep an ended period's array (emptied) for a later one.
    fn keep(&mut self, ended: Period) {
        if let PeriodEntries::Dense(mut v) = ended.slots {
            if self.spare.len() < SPARE_PERIODS {
                v.clear();
                self.spare.push(v);
            }
        }
    }

    /// Entries held.
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl SlotIndex {
    #[inline]
    fn find(&self, slab: &Slab<Entry>, key: u32, id: i64) -> Option<SlotHandle> {
        match self {
            SlotIndex::Hashed { table, hasher } => {
                let hash = hasher.hash_one((key, id));
                table.find(hash, |&h| slab[h as usize].holds(key, id)).copied()
            }
            SlotIndex::ByPeriod(p) => p.get(key, id),
        }
    }

    /// Add slot `h` (of `(key, id)`, known to be absent, already in the slab).
    #[inline]
    fn insert(&mut self, slab: &Slab<Entry>, key: u32, id: i64, h: SlotHandle) {
        match self {
            SlotIndex::Hashed { table, hasher } => {
                let hash = hasher.hash_one((key, id));
                table.insert_unique(hash, h, |&i| hash_at(hasher, slab, i));
            }
            SlotIndex::ByPeriod(p) => p.insert(key, id, h),
        }
    }

    fn remove(&mut self, slab: &Slab<Entry>, key: u32, id: i64) -> Option<SlotHandle> {
        match self {
            SlotIndex::Hashed { table, hasher } => {
                let hash = hasher.hash_one((key, id));
                let found = table.find_entry(hash, |&h| slab[h as usize].holds(key, id)).ok()?;
                Some(found.remove().0)
            }
            SlotIndex::ByPeriod(p) => p.remove(key, id),
        }
    }

    /// Point every slot at its place in `slab` (which holds just the open slots).
    fn rebuild(&mut self, slab: &Slab<Entry>) {
        match self {
            SlotIndex::Hashed { table, hasher } => {
                table.clear();
                for (h, e) in slab.iter().enumerate() {
                    table.insert_unique(hasher.hash_one((e.key, e.id)), h as u32, |&i| {
                        hash_at(hasher, slab, i)
                    });
                }
            }
            SlotIndex::ByPeriod(p) => {
                for (h, e) in slab.iter().enumerate() {
                    p.set(e.key, e.id, h as u32);
                }
            }
        }
    }

    fn reserve(&mut self, slab: &Slab<Entry>, n: usize) {
        if let SlotIndex::Hashed { table, hasher } = self {
            table.reserve(n, |&i| hash_at(hasher, slab, i));
        }
    }

    fn len(&self) -> usize {
        match self {
            SlotIndex::Hashed { table, .. } => table.len(),
            SlotIndex::ByPeriod(p) => p.len(),
        }
    }
}

impl Default for SlotIndex {
    fn default() -> Self {
        SlotIndex::Hashed { table: Default::default(), hasher: Default::default() }
    }
}

/// Vacant slab entries that make the slab compacted, when they are also more than a
/// `COMPACT_SHARE`th of the open ones: the slab holds at most a quarter more entries than
/// open slots (and 4 096), and an open slot is moved about 4 times in its life (a copy of
/// 56 bytes, the price of never writing into a long-cold vacant entry).
pub(super) const COMPACT_AT: usize = 4096;
const COMPACT_SHARE: usize = 4;

/// Accumulators by (key id, slot id), and the timers that fire and clean them up. The
/// slot id is the window start (tumbling), the pane start (sliding) or a session number.
///
/// Slots lie in a slab; the index holds only their positions (see [`SlotIndex`]). A
/// window's slot is found once when it opens, and then reached by its handle when its
/// events are handed to the plugin and its accumulator is stored.
#[derive(Default)]
pub struct WindowState {
    pub(super) index: SlotIndex,
    pub(super) slab: Slab<Entry>,
    /// Vacant entries in the slab.
    vacant: usize,
    /// Pending timers by time: many windows end at the same time, so a timer costs a
    /// push (no ordered set of every timer). The same timer may be pending twice.
    timers: BTreeMap<i64, Due>,
    /// The lists of the last time whose timers all went, for the next new time: a time
    /// mostly has about as many timers as the one before (a period's windows), and they
    /// are then pushed without growing a list from nothing (copying it each time).
    spare_due: Option<Due>,
    /// Open slots per key id (dense ids), to tell keys in use from idle ones.
    per_key: Vec<u32>,
    /// Keys with at least one open slot.
    keys_in_use: usize,
    /// The generation writes are stamped with: the number of incremental captures so far
    /// (wrapping), see [`Self::capture`].
    generation: u16,
    /// Bytes of the accumulators held.
    acc_bytes: usize,
}

impl WindowState {
    /// State whose slot ids are periods that many keys share: tumbling windows and
    /// sliding panes (by their start). Sessions (numbered one by one) take the default.
    pub fn by_period() -> WindowState {
        WindowState { index: SlotIndex::ByPeriod(PeriodMap::default()), ..Default::default() }
    }

    /// The handle of an open slot.
    #[inline]
    pub fn handle(&self, key: u32, id: i64) -> Option<SlotHandle> {
        self.index.find(&self.slab, key, id)
    }

    /// The slots of slot id `id`, for the lookups of many keys in a row (the period is
    /// found once).
    pub fn period(&self, id: i64) -> PeriodSlots<'_> {
        match &self.index {
            SlotIndex::ByPeriod(p) => PeriodSlots::Period(p.period(id).map(|q| &q.slots)),
            SlotIndex::Hashed { .. } => PeriodSlots::Hashed(self, id),
        }
    }

    #[inline]
    pub fn slot(&self, key: u32, id: i64) -> Option<&Slot> {
        self.handle(key, id).map(|h| &self.slab[h as usize].slot)
    }

    /// The handle of slot `(key, id)`: `h` while it still holds that slot, else looked up
    /// (a handle goes stale when its slot is removed and its place reused).
    #[inline]
    fn checked(&self, h: SlotHandle, key: u32, id: i64) -> Option<SlotHandle> {
        match self.slab.get(h as usize) {
            Some(e) if e.holds(key, id) => Some(h),
            _ => self.handle(key, id),
        }
    }

    /// The handle of slot `(key, id)`: `h` while it still holds that slot, else looked up
    /// (None: the slot is not open).
    #[inline]
    pub fn handle_at(&self, h: SlotHandle, key: u32, id: i64) -> Option<SlotHandle> {
        self.checked(h, key, id)
    }

    /// The slot at a handle [`Self::handle_at`] gave, with no other write since.
    #[inline]
    pub fn slot_by(&self, h: SlotHandle) -> &Slot {
        &self.slab[h as usize].slot
    }

    /// Ask for a slot ahead of reading it through its handle (see [`prefetch`]).
    #[inline(always)]
    pub(crate) fn prefetch(&self, h: SlotHandle) {
        if let Some(e) = self.slab.get(h as usize) {
            prefetch(e);
        }
    }

    /// Ask for what [`Self::remove`] of `(key, id)`, whose slot is `h`, reads: the slot,
    /// its index entry and the key's count of slots (a loop that removes the slots of many
    /// keys asks for those some items ahead).
    #[inline(always)]
    pub(crate) fn prefetch_removal(&self, key: u32, id: i64, h: SlotHandle) {
        self.prefetch(h);
        if let SlotIndex::ByPeriod(p) = &self.index {
            p.prefetch(key, id);
        }
        if let Some(n) = self.per_key.get(key as usize) {
            prefetch(n);
        }
    }

    /// Slot `(key, id)` through its handle `h` (see [`Self::checked`]).
    #[inline]
    pub fn slot_at(&self, h: SlotHandle, key: u32, id: i64) -> Option<&Slot> {
        self.checked(h, key, id).map(|h| &self.slab[h as usize].slot)
    }

    /// The accumulator of a slot (empty = fresh or absent).
    #[inline]
    pub fn acc(&self, key: u32, id: i64) -> &[u8] {
        self.slot(key, id).map_or(&[], |s| s.acc.as_slice())
    }

    /// [`Self::acc`] through the slot's handle (see [`Self::checked`]).
    #[inline]
    pub fn acc_at(&self, h: SlotHandle, key: u32, id: i64) -> &[u8] {
        self.slot_at(h, key, id).map_or(&[], |s| s.acc.as_slice())
    }

    /// Open a slot if absent; true when it was created.
    #[inline]
    pub fn open(&mut self, key: u32, id: i64, window: Window) -> bool {
        self.open_at(key, id, window).1
    }

    /// Open a slot if absent: its handle, and whether it was created.
    #[inline]
    pub fn open_at(&mut self, key: u32, id: i64, window: Window) -> (SlotHandle, bool) {
        if let Some(h) = self.handle(key, id) {
            return (h, false);
        }
        let h = self.insert(key, id, Slot { window, acc: Acc::new() });
        (h, true)
    }

    /// Add a slot known to be absent.
    fn insert(&mut self, key: u32, id: i64, slot: Slot) -> SlotHandle {
        let entry = Entry { key, live: true, written: self.generation, id, slot };
        // New slots go to the slab's end, never into a vacant entry: the slots opened
        // together (a period's, with many keys) lie together, in the order their groups
        // are handed to the plugin and their windows fire, and no long-cold line is
        // written over. Vacant entries go when the slab is compacted.
        if self.vacant >= COMPACT_AT && COMPACT_SHARE * self.vacant > self.slab.len() - self.vacant {
            self.compact();
        }
        let h = self.slab.push(entry) as u32;
        self.index.insert(&self.slab, key, id, h);
        self.count_slot(key);
        h
    }

    /// Drop the vacant entries: the open slots move to the slab's front, in their order,
    /// and the index follows. (Handles held elsewhere go stale; see [`Self::checked`].)
    fn compact(&mut self) {
        self.slab.retain(|e| e.live);
        self.vacant = 0;
        self.index.rebuild(&self.slab);
    }

    /// One more open slot for `key`.
    #[inline]
    fn count_slot(&mut self, key: u32) {
        let k = key as usize;
        if k >= self.per_key.len() {
            self.per_key.resize(k + 1, 0);
        }
        if self.per_key[k] == 0 {
            self.keys_in_use += 1;
        }
        self.per_key[k] += 1;
    }

    /// Room for `n` more slots.
    pub fn reserve(&mut self, n: usize) {
        self.index.reserve(&self.slab, n);
        self.slab.reserve(n);
    }

    /// Open a slot with its accumulator (a restore): [`Self::open`], then
    /// [`Self::set_acc`], in one lookup.
    pub fn open_with(&mut self, key: u32, id: i64, window: Window, acc: &[u8]) {
        match self.handle(key, id) {
            Some(h) => self.write_acc(h, acc),
            None => {
                self.insert(key, id, Slot { window, acc: Acc::from_slice(acc) });
                self.acc_bytes += acc.len();
            }
        }
    }

    /// Replace an open slot's accumulator.
    #[inline]
    pub fn set_acc(&mut self, key: u32, id: i64, acc: &[u8]) {
        if let Some(h) = self.handle(key, id) {
            self.write_acc(h, acc);
        }
    }

    /// [`Self::set_acc`] through the slot's handle (see [`Self::checked`]).
    #[inline]
    pub fn set_acc_at(&mut self, h: SlotHandle, key: u32, id: i64, acc: &[u8]) {
        if let Some(h) = self.checked(h, key, id) {
            self.write_acc(h, acc);
        }
    }

    #[inline]
    fn write_acc(&mut self, h: SlotHandle, acc: &[u8]) {
        let e = &mut self.slab[h as usize];
        self.acc_bytes = self.acc_bytes + acc.len() - e.slot.acc.len();
        e.slot.acc.clear();
        e.slot.acc.extend_from_slice(acc);
        e.written = self.generation;
    }

    /// Replace every accumulator, in [`WindowState::iter`]'s order, by the next of `next`
    /// (the state unchanged since that iteration).
    pub fn replace_accs<'a>(&mut self, mut next: impl FnMut() -> &'a [u8]) {
        let (mut bytes, generation) = (0, self.generation);
        self.slab.for_each_mut(|e| {
            if e.live {
                e.slot.acc.clear();
                e.slot.acc.extend_from_slice(next());
                bytes += e.slot.acc.len();
                e.written = generation;
            }
        });
        self.acc_bytes = bytes;
    }

    /// Bytes of the accumulators held.
    pub fn acc_bytes(&self) -> usize {
        self.acc_bytes
    }

    /// Change an open slot's window (a session that grew).
    pub fn set_window(&mut self, key: u32, id: i64, window: Window) {
        self.set_window_at(NO_SLOT, key, id, window);
    }

    /// [`Self::set_window`] through the slot's handle (see [`Self::checked`]).
    pub fn set_window_at(&mut self, h: SlotHandle, key: u32, id: i64, window: Window) {
        if let Some(h) = self.checked(h, key, id) {
            let e = &mut self.slab[h as usize];
            e.slot.window = window;
            e.written = self.generation;
        }
    }

    /// Remove a slot; returns it and whether its key has no slots left.
    pub fn remove(&mut self, key: u32, id: i64) -> Option<(Slot, bool)> {
        let h = self.index.remove(&self.slab, key, id)?;
        let e = &mut self.slab[h as usize];
        e.live = false;
        let empty = Slot { window: e.slot.window, acc: Acc::new() };
        let slot = std::mem::replace(&mut e.slot, empty);
        self.vacant += 1;
        self.acc_bytes -= slot.acc.len();
        let n = &mut self.per_key[key as usize];
        *n -= 1;
        let last = *n == 0;
        if last {
            self.keys_in_use -= 1;
        }
        Some((slot, last))
    }

    /// Whether a key has open slots.
    #[inline]
    pub fn in_use(&self, key: u32) -> bool {
        self.per_key.get(key as usize).is_some_and(|&n| n > 0)
    }

    /// Set a timer (a timer set twice comes due twice).
    #[inline]
    pub fn add_timer(&mut self, t: Timer) {
        let spare = &mut self.spare_due;
        let due = self.timers.entry(t.time).or_insert_with(|| spare.take().unwrap_or_default());
        match t.kind {
            TimerKind::Fire => due.fire.push((t.key, t.id)),
            TimerKind::Cleanup => due.cleanup.push((t.key, t.id)),
        }
    }

    /// Time of the earliest timer.
    #[inline]
    pub fn next_timer(&self) -> Option<i64> {
        self.timers.first_key_value().map(|(&t, _)| t)
    }

    /// Take the earliest timer if it is due at `watermark`.
    pub fn pop_due(&mut self, watermark: i64) -> Option<Timer> {
        let mut first = self.timers.first_entry()?;
        let time = *first.key();
        if time > watermark {
            return None;
        }
        let due = first.get_mut();
        let t = match due.fire.pop() {
            Some((key, id)) => Timer { time, kind: TimerKind::Fire, key, id },
            None => {
                let (key, id) = due.cleanup.pop()?;
                Timer { time, kind: TimerKind::Cleanup, key, id }
            }
        };
        if due.fire.is_empty() && due.cleanup.is_empty() {
            self.spare_due = Some(first.remove());
        }
        Some(t)
    }

    /// Open slots.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.len() == 0
    }

    /// Keys with at least one open slot.
    pub fn keys_in_use(&self) -> usize {
        self.keys_in_use
    }

    /// Every slot, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (u32, i64, &Slot)> {
        self.slab.iter().filter(|e| e.live).map(|e| (e.key, e.id, &e.slot))
    }

    /// Count every slot open now as written since the last incremental capture.
    pub fn touch_all(&mut self) {
        let generation = self.generation;
        self.slab.for_each_mut(|e| e.written = generation);
    }

    /// The open slots as they are now, for a snapshot, with the keys they refer to: all
    /// of them, or (`written_only`: an incremental capture) those written since the last
    /// incremental capture (or [`Self::touch_all`]). O(chunks of the slab): the capture
    /// shares the slab's chunks and the key table's, copying no slot and no key; the slots
    /// are picked out later, by the thread that writes the snapshot (an incremental
    /// capture reads every slot there to find the written ones), and the state copies each
    /// chunk it writes to while that thread holds it.
    ///
    /// Writes are stamped with the generation, which an incremental capture moves on; a
    /// slot last written 65 536 incremental captures ago is taken again (its stamp wraps
    /// round), which rewrites what the copy holds already. A whole capture leaves the
    /// generation alone, so incremental ones miss nothing written before it.
    pub fn capture(&mut self, keys: &KeyTable, written_only: bool) -> captured::CapturedSlots {
        let only = written_only.then_some(self.generation);
        if written_only {
            self.generation = self.generation.wrapping_add(1);
        }
        captured::CapturedSlots::new(keys.snapshot(), self.slab.snapshot(), self.len() as u64, only)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_handle_reaches_its_slot_only_while_the_slot_holds_its_place() {
        for mut s in [WindowState::default(), WindowState::by_period()] {
            let w = Window { start: 0, end: 5 };
            let (a, created) = s.open_at(1, 0, w);
            assert!(created);
            s.set_acc_at(a, 1, 0, b"a");
            // Enough slots removed that the next one opened compacts the slab: the place
            // goes to another slot, and the old handle no longer reaches (1, 0).
            let others = 10..10 + COMPACT_AT as u32;
            others.clone().for_each(|k| assert!(s.open(k, 0, w)));
            s.remove(1, 0);
            others.for_each(|k| assert!(s.remove(k, 0).is_some()));
            let (b, _) = s.open_at(2, 0, w);
            assert_eq!(a, b);
            assert!(s.slot_at(a, 1, 0).is_none());
            s.set_acc_at(a, 1, 0, b"stale");
            assert_eq!(s.acc(2, 0), b"");
            // A wrong handle still finds a slot by its (key, id).
            s.set_acc_at(NO_SLOT, 2, 0, b"b");
            assert_eq!(s.slot_at(NO_SLOT, 2, 0).map(|x| x.acc.as_slice()), Some(&b"b"[..]));
            assert_eq!((s.len(), s.acc_bytes()), (1, 1));
        }
    }

    /// Random opens, writes and removals against a map of (key, id) to accumulator: both
    /// indexes (hashed, and by period: dense and hashed periods, keys with ids far apart,
    /// periods that end, compactions while dense periods hold slots) hold what the map
    /// holds, and handles reach their slots while open.
    #[test]
    fn slots_are_what_a_map_of_key_and_id_says_through_every_index() {
        for by_period in [false, true] {
            let mut s = if by_period { WindowState::by_period() } else { WindowState::default() };
            let mut model: BTreeMap<(u32, i64), Vec<u8>> = BTreeMap::new();
            let mut handles: Vec<(SlotHandle, u32, i64)> = Vec::new();
            // What the by-period index went through: (dense, sparse) periods holding slots
            // seen, compactions with a dense period holding slots, periods ended.
            let (mut seen_dense, mut seen_sparse, mut compacted_dense, mut ended) = (false, false, 0, 0);
            let mut x = 0x9e37_79b9_7f4a_7c15u64;
            let mut next = |n: u64| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x % n
            };
            for step in 0..300_000u64 {
                // Mostly keys below 3 000; in every other stretch, now and then one far
                // above (a period that few of many keys reach goes sparse).
                let key = match next(400) {
                    0 if step % 100_000 >= 50_000 => 3_000 + next(200_000),
                    0..=7 => 3_000 + next(2_000),
                    _ => next(3_000),
                } as u32;
                // Periods come and go: the ids drift upwards, and the periods left behind
                // end (all their slots removed, as when their windows fire).
                let id = 300 * (step / 20_000 + next(4)) as i64;
                if step % 20_000 == 0 {
                    let old: Vec<(u32, i64)> = model.keys().filter(|&&(_, i)| i < id).copied().collect();
                    for (k, i) in old {
                        let removed = s.remove(k, i).map(|(slot, _)| slot.acc.to_vec());
                        assert_eq!(removed, model.remove(&(k, i)));
                    }
                    ended += 1;
                }
                let vacant = s.vacant;
                match next(10) {
                    0..=4 => {
                        let w = Window { start: id, end: id + 300 };
                        let (h, created) = s.open_at(key, id, w);
                        assert_eq!(created, !model.contains_key(&(key, id)));
                        model.entry((key, id)).or_default();
                        handles.push((h, key, id));
                    }
                    5 | 6 => {
                        let acc = step.to_le_bytes()[..1 + next(8) as usize].to_vec();
                        s.set_acc(key, id, &acc);
                        if let Some(m) = model.get_mut(&(key, id)) {
                            *m = acc;
                        }
                    }
                    _ => {
                        // Remove an open slot most of the time (a handle taken earlier).
                        let (k, i) = match handles.len() {
                            0 => (key, id),
                            n => {
                                let (_, k, i) = handles.swap_remove(next(n as u64) as usize);
                                (k, i)
                            }
                        };
                        let removed = s.remove(k, i).map(|(slot, _)| slot.acc.to_vec());
                        assert_eq!(removed, model.remove(&(k, i)));
                    }
                }
                if let SlotIndex::ByPeriod(p) = &s.index {
                    let live = |dense: bool| {
                        p.list
                            .iter()
                            .any(|q| q.open > 0 && matches!(q.slots, PeriodEntries::Dense(_)) == dense)
                    };
                    if s.vacant < vacant && live(true) {
                        compacted_dense += 1;
                    }
                    if step % 1_000 == 0 {
                        seen_dense |= live(true);
                        seen_sparse |= live(false);
                    }
                }
                if step % 1_000 == 0 {
                    for &(h, k, i) in handles.iter().rev().take(50) {
                        let at = s.slot_at(h, k, i).map(|slot| slot.acc.to_vec());
                        assert_eq!(at, model.get(&(k, i)).cloned(), "step {step}: ({k}, {i})");
                    }
                }
            }
            assert!(!model.is_empty());
            if by_period {
                assert!(seen_dense && seen_sparse && compacted_dense > 0 && ended > 10);
            }
            let held: BTreeMap<(u32, i64), Vec<u8>> =
                s.iter().map(|(k, i, slot)| ((k, i), slot.acc.to_vec())).collect();
            assert_eq!(held, model);
            assert_eq!(s.len(), model.len());
            for (&(k, i), acc) in &model {
                assert_eq!(s.acc(k, i), acc.as_slice());
            }
            let keys: std::collections::HashSet<u32> = model.keys().map(|&(k, _)| k).collect();
            assert_eq!(s.keys_in_use(), keys.len());
            assert_eq!(s.acc_bytes(), model.values().map(Vec::len).sum::<usize>());
        }
    }
}

//! Host-owned state: interned keys and one accumulator (opaque plugin bytes) per open
//! (key, window), plus the timer index that says which windows the watermark closes.
//!
//! Keeping accumulators as bytes in the host is what lets savepoints and plugin upgrades
//! work without ever reading a guest's memory.

pub mod captured;
mod key_hash;
mod key_index;
pub mod lock;
pub mod rocks;
mod slab;

use crate::window::Window;
use key_hash::KeyHasher;
use key_index::KeyIndex;
use slab::{Slab, SlabSnapshot};
use std::collections::BTreeMap;
use std::hash::BuildHasher;
use std::sync::Arc;

/// Bytes of one chunk of the key table (a longer key gets a chunk of its own).
const KEY_CHUNK: usize = 1 << 18;
/// Ids per chunk of spans.
const SPAN_CHUNK: usize = 1 << 12;

/// Where a key lies: its chunk, and its start and length in it.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Span {
    chunk: u32,
    start: u32,
    len: u32,
}

/// A key's bytes.
#[inline]
fn bytes_of(chunks: &[Arc<[u8]>], s: Span) -> &[u8] {
    &chunks[s.chunk as usize][s.start as usize..s.start as usize + s.len as usize]
}

/// The span of id `id`.
#[inline]
fn span_of(spans: &[Arc<[Span]>], id: u32) -> Span {
    spans[id as usize / SPAN_CHUNK][id as usize % SPAN_CHUNK]
}

/// Dense ids for key tuples. A key is stored encoded: each field as a little-endian u32
/// length followed by its UTF-8 bytes. Keys lie one after another in fixed-size chunks,
/// so a key costs no allocation of its own; the index holds ids, hashed by their key (and
/// short keys themselves, see [`key_index`]).
///
/// Chunks (of bytes and of spans) are shared copy-on-write: a snapshot
/// ([`KeyTable::snapshot`]) takes the table in O(chunks), without copying a key, and the
/// table copies a chunk only when it writes to one a snapshot still holds (the chunk new
/// keys go to, a span that changes).
#[derive(Default)]
pub struct KeyTable {
    index: KeyIndex,
    hasher: KeyHasher,
    /// The keys' bytes; new keys are appended to the last chunk, up to `fill`. Removed
    /// keys leave holes until the next compaction.
    chunks: Vec<Arc<[u8]>>,
    fill: usize,
    /// Where every id's key lies (a removed id's: nowhere).
    spans: Vec<Arc<[Span]>>,
    /// Ids given out: one past the largest.
    ids: usize,
    /// Ids of removed keys, reused first.
    free: Vec<u32>,
    /// Bytes of the encoded keys held, and of the holes removed keys left.
    bytes: usize,
    holes: usize,
    /// Rank of every id in key order (fields compared in turn, bytewise), while
    /// `ranked`: no key was interned since it was computed.
    rank: Vec<u32>,
    ranked: bool,
    /// The live ids in key order when `rank` was computed, and the ids interned since (in
    /// any order; at most as many as the keys held plus [`FRESH_SLACK`], else none and
    /// `rank_whole`): the next ranking places those among these (see
    /// [`KeyTable::ranks`]).
    sorted: Vec<u32>,
    fresh: Vec<u32>,
    rank_whole: bool,
}

/// Ids interned since the last ranking that are kept beyond the keys held, before the
/// next ranking sorts every key again instead.
const FRESH_SLACK: usize = 1024;

/// The key table as it was when [`KeyTable::snapshot`] was called, keys by id.
#[derive(Debug, Clone, Default)]
pub struct KeySnapshot {
    chunks: Vec<Arc<[u8]>>,
    spans: Vec<Arc<[Span]>>,
}

impl KeySnapshot {
    /// The encoded key of `id` (an id interned when the snapshot was taken).
    #[inline]
    pub fn key(&self, id: u32) -> &[u8] {
        bytes_of(&self.chunks, span_of(&self.spans, id))
    }
}

impl KeyTable {
    /// The id of an encoded key, interning it on first sight.
    #[inline]
    pub fn intern(&mut self, encoded: &[u8]) -> u32 {
        let hash = self.hasher.hash(encoded);
        match self.find(hash, encoded) {
            Some(id) => id,
            None => self.insert_hashed(hash, encoded),
        }
    }

    /// [`Self::intern`], for a key that `accept` must pass before it is interned (a key
    /// built from raw input: see [`valid_key`]); None when it does not. The key is hashed
    /// once. Inlined always, as [`Self::get`]; a new key's way is out of line.
    #[inline(always)]
    pub fn intern_if(&mut self, encoded: &[u8], accept: fn(&[u8]) -> bool) -> Option<u32> {
        let hash = self.hasher.hash(encoded);
        match self.find(hash, encoded) {
            Some(id) => Some(id),
            None => self.insert_if(hash, encoded, accept),
        }
    }

    #[inline(never)]
    fn insert_if(&mut self, hash: u64, encoded: &[u8], accept: fn(&[u8]) -> bool) -> Option<u32> {
        accept(encoded).then(|| self.insert_hashed(hash, encoded))
    }

    /// The id of a known key (inlined always: once a record, and LLVM's inlining of it
    /// into the record loop came and went with unrelated changes, ~0.5% of instructions).
    #[inline(always)]
    pub fn get(&self, encoded: &[u8]) -> Option<u32> {
        self.find(self.hasher.hash(encoded), encoded)
    }

    #[inline(always)]
    fn find(&self, hash: u64, encoded: &[u8]) -> Option<u32> {
        self.index.find(hash, encoded, &self.chunks)
    }

    /// Intern a key not seen before, whose hash is `hash`.
    fn insert_hashed(&mut self, hash: u64, encoded: &[u8]) -> u32 {
        self.bytes += encoded.len();
        self.ranked = false;
        let span = self.append(encoded);
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                self.ids += 1;
                self.ids as u32 - 1
            }
        };
        self.set_span(id, span);
        if self.fresh.len() < self.index.len() + FRESH_SLACK {
            self.fresh.push(id);
        } else {
            self.rank_whole = true;
        }
        self.index.insert(id, hash, span, encoded);
        id
    }

    /// Append a key's bytes to the last chunk (a new one when it is full).
    fn append(&mut self, key: &[u8]) -> Span {
        let room = self.chunks.last().map_or(0, |c| c.len() - self.fill);
        if self.chunks.is_empty() || key.len() > room {
            self.chunks.push(Arc::from(vec![0u8; KEY_CHUNK.max(key.len())]));
            self.fill = 0;
        }
        let c = self.chunks.len() - 1;
        // Copies the chunk when a snapshot shares it.
        let chunk = Arc::make_mut(&mut self.chunks[c]);
        chunk[self.fill..self.fill + key.len()].copy_from_slice(key);
        let span = Span { chunk: c as u32, start: self.fill as u32, len: key.len() as u32 };
        self.fill += key.len();
        span
    }

    fn set_span(&mut self, id: u32, span: Span) {
        let (c, i) = (id as usize / SPAN_CHUNK, id as usize % SPAN_CHUNK);
        if c == self.spans.len() {
            self.spans.push(Arc::from(vec![Span::default(); SPAN_CHUNK]));
        }
        // Copies the chunk when a snapshot shares it.
        Arc::make_mut(&mut self.spans[c])[i] = span;
    }

    /// Room for `n` more keys.
    pub fn reserve(&mut self, n: usize) {
        self.index.reserve(n);
    }

    /// Forget a key; its id may be given to another key.
    pub fn remove(&mut self, id: u32) {
        let span = span_of(&self.spans, id);
        let hash = self.hasher.hash(bytes_of(&self.chunks, span));
        if !self.index.remove(id, hash) {
            return;
        }
        let len = span.len as usize;
        self.bytes -= len;
        self.holes += len;
        self.set_span(id, Span::default());
        self.free.push(id);
        if self.holes > self.bytes.max(1 << 16) {
            self.compact();
        }
    }

    /// Close the holes of removed keys (at most as many bytes as the keys held: O(1) per
    /// removed byte). The keys move to new chunks; a snapshot keeps the old ones.
    fn compact(&mut self) {
        let (old_chunks, old_spans) = (std::mem::take(&mut self.chunks), std::mem::take(&mut self.spans));
        self.fill = 0;
        for id in 0..self.ids as u32 {
            let span = span_of(&old_spans, id);
            let moved =
                if span.len == 0 { Span::default() } else { self.append(bytes_of(&old_chunks, span)) };
            self.set_span(id, moved);
        }
        for e in self.index.iter_mut().filter(|e| !e.is_inline()) {
            e.set_span(span_of(&self.spans, e.id()));
        }
        self.holes = 0;
    }

    /// Every live key id.
    pub fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.index.iter().map(|e| e.id())
    }

    #[inline]
    pub fn encoded(&self, id: u32) -> &[u8] {
        bytes_of(&self.chunks, span_of(&self.spans, id))
    }

    /// The table as it is now, for a snapshot: shares its chunks, copies no key.
    pub fn snapshot(&self) -> KeySnapshot {
        KeySnapshot { chunks: self.chunks.clone(), spans: self.spans.clone() }
    }

    /// Ask for the index entry a lookup of `encoded` reads first ahead of the lookup: with
    /// many keys it is a cache miss, which a caller that knows the next key some hundred
    /// nanoseconds early (the next record's) overlaps with other work.
    #[inline(always)]
    pub fn prefetch_key(&self, encoded: &[u8]) {
        self.index.prefetch(self.hasher.hash(encoded));
    }

    /// Ask for where a key lies ahead of [`Self::prefetch`]: a loop over many keys asks
    /// for this twice as far ahead, so that the prefetch of the key's bytes does not wait
    /// for it.
    #[inline(always)]
    pub(crate) fn prefetch_span(&self, id: u32) {
        if let Some(span) =
            self.spans.get(id as usize / SPAN_CHUNK).and_then(|c| c.get(id as usize % SPAN_CHUNK))
        {
            prefetch(span);
        }
    }

    /// Ask for a key's bytes ahead of reading them (see [`prefetch`]).
    #[inline(always)]
    pub(crate) fn prefetch(&self, id: u32) {
        if let Some(span) = self.spans.get(id as usize / SPAN_CHUNK).map(|c| c[id as usize % SPAN_CHUNK]) {
            if let Some(b) = self.chunks.get(span.chunk as usize).and_then(|c| c.get(span.start as usize)) {
                prefetch(b);
            }
        }
    }

    /// The key's fields, in key order.
    pub fn fields(&self, id: u32) -> KeyFields<'_> {
        KeyFields { rest: self.encoded(id) }
    }

    /// The key's fields as UTF-8 bytes (byte order is string order), without re-checking.
    pub fn raw_fields(&self, id: u32) -> RawKeyFields<'_> {
        RawKeyFields { rest: self.encoded(id) }
    }

    /// The rank of every id in key order, to sort `n` items by key: computed again only
    /// when keys were interned since and there are not many more keys than items; None
    /// when that is not worth it.
    ///
    /// Computed again, the keys interned since the last ranking are sorted and placed
    /// among the others, which keep their order: O(keys) moves and O(new keys x log keys)
    /// comparisons, not a sort of every key (windows that fire every slide of a sliding
    /// window, while keys come and go, ranked all of them each time: 5% of that job).
    pub fn ranks(&mut self, n: usize) -> Option<&[u32]> {
        if !self.ranked {
            if self.index.len() > 4 * n + 1024 {
                return None;
            }
            self.rank_again();
            self.ranked = true;
        }
        Some(&self.rank)
    }

    fn rank_again(&mut self) {
        // What each id is now: gone, ranked before and still held, or interned since.
        const GONE: u32 = 0;
        const KEPT: u32 = 1;
        const FRESH: u32 = 2;
        let (mut sorted, mut fresh) = (std::mem::take(&mut self.sorted), std::mem::take(&mut self.fresh));
        if std::mem::take(&mut self.rank_whole) {
            sorted.clear();
            fresh.clear();
            fresh.extend(self.ids());
        }
        // `rank` serves as the ids' marks, then gets their ranks.
        let mut mark = std::mem::take(&mut self.rank);
        mark.clear();
        mark.resize(self.ids, GONE);
        for id in self.ids() {
            mark[id as usize] = KEPT;
        }
        fresh.retain(|&id| mark[id as usize] != GONE);
        let table = &*self;
        let order = |a: u32, b: u32| table.raw_fields(a).cmp(table.raw_fields(b));
        fresh.sort_unstable_by(|&a, &b| order(a, b));
        // An id removed and interned again since comes twice (the same key: side by side).
        fresh.dedup();
        for &id in &fresh {
            mark[id as usize] = FRESH;
        }
        sorted.retain(|&id| mark.get(id as usize) == Some(&KEPT));
        let mut merged = Vec::with_capacity(sorted.len() + fresh.len());
        let mut from = 0;
        for &id in &fresh {
            let at = from + sorted[from..].partition_point(|&o| order(o, id).is_lt());
            merged.extend_from_slice(&sorted[from..at]);
            merged.push(id);
            from = at;
        }
        merged.extend_from_slice(&sorted[from..]);
        debug_assert_eq!(merged.len(), self.index.len());
        mark.fill(u32::MAX);
        for (r, &id) in merged.iter().enumerate() {
            mark[id as usize] = r as u32;
        }
        self.rank = mark;
        self.sorted = merged;
        fresh.clear();
        self.fresh = fresh;
    }

    /// Bytes of the encoded keys held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Interned keys.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// One past the largest id given out (ids are dense).
    pub fn capacity(&self) -> usize {
        self.ids
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }
}

/// Ask for the cache line of `x` ahead of its reading: loops over many keys' slots or
/// keys (a call's groups, the windows that fire) ask for the ones a few items on, so that
/// their cache misses overlap instead of coming one after another.
#[inline(always)]
pub(crate) fn prefetch<T>(x: &T) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: a prefetch is a hint: it reads nothing the program sees, never faults.
        unsafe { _mm_prefetch((x as *const T).cast::<i8>(), _MM_HINT_T0) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = x;
}

/// Items ahead that a loop asks for (see [`prefetch`]).
pub(crate) const PREFETCH_DISTANCE: usize = 8;

/// Append one key field to an encoded key: its length and its bytes after one
/// reservation (this is done for every field of every record).
#[inline]
pub fn push_key_field(encoded: &mut Vec<u8>, field: &[u8]) {
    let n = field.len();
    if n > 32 {
        encoded.extend_from_slice(&(n as u32).to_le_bytes());
        encoded.extend_from_slice(field);
        return;
    }
    encoded.reserve(4 + n);
    let len = encoded.len();
    // SAFETY: `reserve` made room for `4 + n` bytes after `len`: the length's 4, then the
    // field's `n` (up to 32, from another buffer: `encoded` is borrowed mutably), which
    // are then initialized.
    unsafe {
        let dst = encoded.as_mut_ptr().add(len);
        dst.cast::<[u8; 4]>().write_unaligned((n as u32).to_le_bytes());
        copy_short(field.as_ptr(), dst.add(4), n);
        encoded.set_len(len + 4 + n);
    }
}

/// `v.extend_from_slice(b)`, with slices of up to 32 bytes (the key fields and
/// accumulators of the per-record and per-window loops) copied by a few word moves in
/// place of a call to `memcpy` (whose call and size dispatch cost more than the copy).
#[inline(always)]
pub(crate) fn append(v: &mut Vec<u8>, b: &[u8]) {
    let n = b.len();
    if n > 32 {
        v.extend_from_slice(b);
        return;
    }
    v.reserve(n);
    let len = v.len();
    // SAFETY: `reserve` made room for `n` (up to 32) bytes after `len`, and `v` and `b`
    // cannot overlap (`v` is borrowed mutably); the `n` bytes are then initialized.
    unsafe {
        copy_short(b.as_ptr(), v.as_mut_ptr().add(len), n);
        v.set_len(len + n);
    }
}

/// Copy `n` (up to 32) bytes from `src` to `dst` by a few word moves: the two words of
/// each case are the first and the last ones of their size, overlapping when `n` is not
/// twice their size; unaligned reads and writes throughout.
///
/// # Safety
/// `src` is readable and `dst` writable for `n <= 32` bytes, and they do not overlap.
#[inline(always)]
unsafe fn copy_short(src: *const u8, dst: *mut u8, n: usize) {
    debug_assert!(n <= 32);
    // SAFETY: the caller's; every read lies in `src[..n]`, every write in `dst[..n]`.
    unsafe {
        if n >= 16 {
            let (lo, hi) =
                (src.cast::<u128>().read_unaligned(), src.add(n - 16).cast::<u128>().read_unaligned());
            dst.cast::<u128>().write_unaligned(lo);
            dst.add(n - 16).cast::<u128>().write_unaligned(hi);
        } else if n >= 8 {
            let (lo, hi) =
                (src.cast::<u64>().read_unaligned(), src.add(n - 8).cast::<u64>().read_unaligned());
            dst.cast::<u64>().write_unaligned(lo);
            dst.add(n - 8).cast::<u64>().write_unaligned(hi);
        } else if n >= 4 {
            let (lo, hi) =
                (src.cast::<u32>().read_unaligned(), src.add(n - 4).cast::<u32>().read_unaligned());
            dst.cast::<u32>().write_unaligned(lo);
            dst.add(n - 4).cast::<u32>().write_unaligned(hi);
        } else {
            for i in 0..n {
                *dst.add(i) = *src.add(i);
            }
        }
    }
}

/// Whether every field of an encoded key is UTF-8. Keys are built from raw input bytes
/// and checked only once, when first seen, before they are interned; saved keys where
/// their state is decoded.
pub fn valid_key(encoded: &[u8]) -> bool {
    let mut rest = encoded;
    while !rest.is_empty() {
        let Some(len) = rest.get(..4).and_then(|b| b.try_into().ok()).map(u32::from_le_bytes) else {
            return false;
        };
        let Some(field) = rest.get(4..4 + len as usize) else { return false };
        if !utf8_field(field) {
            return false;
        }
        rest = &rest[4 + len as usize..];
    }
    true
}

/// Whether a key field is UTF-8: most are ASCII, which is checked a word at a time
/// (`from_utf8` goes byte by byte over short fields).
#[inline]
pub fn utf8_field(field: &[u8]) -> bool {
    field.is_ascii() || std::str::from_utf8(field).is_ok()
}

/// The fields of an encoded key.
pub fn fields_of(encoded: &[u8]) -> KeyFields<'_> {
    KeyFields { rest: encoded }
}

/// How many fields an encoded key has (None if it is malformed).
pub fn arity_of(encoded: &[u8]) -> Option<usize> {
    let mut rest = encoded;
    let mut n = 0;
    while !rest.is_empty() {
        let len = u32::from_le_bytes(rest.get(..4)?.try_into().ok()?) as usize;
        rest = rest.get(4 + len..)?;
        n += 1;
    }
    Some(n)
}

/// Iterator over the fields of an encoded key, as bytes.
pub struct RawKeyFields<'a> {
    rest: &'a [u8],
}

impl<'a> Iterator for RawKeyFields<'a> {
    type Item = &'a [u8];
    #[inline]
    fn next(&mut self) -> Option<&'a [u8]> {
        let len_bytes: [u8; 4] = self.rest.get(..4)?.try_into().ok()?;
        let len = u32::from_le_bytes(len_bytes) as usize;
        let field = self.rest.get(4..4 + len)?;
        self.rest = &self.rest[4 + len..];
        Some(field)
    }
}

/// Iterator over the fields of an encoded key.
pub struct KeyFields<'a> {
    rest: &'a [u8],
}

impl<'a> Iterator for KeyFields<'a> {
    type Item = &'a str;
    fn next(&mut self) -> Option<&'a str> {
        let len_bytes: [u8; 4] = self.rest.get(..4)?.try_into().ok()?;
        let len = u32::from_le_bytes(len_bytes) as usize;
        let field = self.rest.get(4..4 + len)?;
        self.rest = &self.rest[4 + len..];
        // Interned keys passed `valid_key`.
        std::str::from_utf8(field).ok()
    }
}

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
struct Entry {
    key: u32,
    live: bool,
    /// The [`WindowState`] generation of its last write (see [`WindowState::capture`]).
    written: u16,
    id: i64,
    slot: Slot,
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
enum SlotIndex {
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
const COMPACT_AT: usize = 4096;
const COMPACT_SHARE: usize = 4;

/// Accumulators by (key id, slot id), and the timers that fire and clean them up. The
/// slot id is the window start (tumbling), the pane start (sliding) or a session number.
///
/// Slots lie in a slab; the index holds only their positions (see [`SlotIndex`]). A
/// window's slot is found once when it opens, and then reached by its handle when its
/// events are handed to the plugin and its accumulator is stored.
#[derive(Default)]
pub struct WindowState {
    index: SlotIndex,
    slab: Slab<Entry>,
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
    #[test]
    fn held_bytes_follow_the_accumulators_and_keys_written_and_removed() {
        let (mut keys, mut state) = (super::KeyTable::default(), super::WindowState::default());
        let w = crate::window::Window { start: 0, end: 5 };
        let k = keys.intern(b"\x01\x00\x00\x00a");
        state.open(k, 0, w);
        state.open(k, 5, w);
        state.set_acc(k, 0, b"12345");
        state.set_acc(k, 5, b"123");
        state.set_acc(k, 0, b"12");
        assert_eq!((state.acc_bytes(), keys.bytes()), (2 + 3, 5));
        state.remove(k, 5);
        assert_eq!(state.acc_bytes(), 2);
        state.replace_accs(|| &b"1234"[..]);
        assert_eq!(state.acc_bytes(), 4);
        keys.remove(k);
        assert_eq!(keys.bytes(), 0);
    }

    use super::*;

    #[test]
    fn append_and_push_key_field_add_exactly_the_bytes_given_at_every_length() {
        let source: Vec<u8> = (1..=40).collect();
        for n in 0..=40 {
            for start in 0..3 {
                let b = &source[..n];
                let mut v: Vec<u8> = vec![0xee; start];
                v.shrink_to_fit();
                append(&mut v, b);
                let mut want = vec![0xee; start];
                want.extend_from_slice(b);
                assert_eq!(v, want, "{n} bytes after {start}");
                // A key field: its length (4 bytes, little-endian), then its bytes.
                let mut k: Vec<u8> = vec![0xee; start];
                k.shrink_to_fit();
                push_key_field(&mut k, b);
                let mut want = vec![0xee; start];
                want.extend_from_slice(&[n as u8, 0, 0, 0]);
                want.extend_from_slice(b);
                assert_eq!(k, want, "a key field of {n} bytes after {start}");
            }
        }
    }

    /// What a capture holds, by (key, slot id): (window start, accumulator).
    fn held(c: &captured::CapturedSlots) -> BTreeMap<(Vec<u8>, i64), (i64, Vec<u8>)> {
        let all: Vec<_> =
            c.iter().map(|(k, id, w, acc)| ((k.to_vec(), id), (w.start, acc.to_vec()))).collect();
        assert_eq!(all.len() as u64, c.len());
        let map: BTreeMap<_, _> = all.into_iter().collect();
        assert_eq!(map.len() as u64, c.len(), "a slot taken twice");
        map
    }

    /// A whole capture holds every open slot, an incremental one the slots opened or
    /// written since the previous incremental capture (whole ones in between or not),
    /// each as it was when taken, through the writes, removals and compactions of the
    /// slab after it: checked against a map of the slots and a set of those written.
    #[test]
    fn captures_hold_the_slots_open_or_written_when_taken() {
        for mut state in [WindowState::default(), WindowState::by_period()] {
            let mut keys = KeyTable::default();
            let key_of = |k: u64| {
                let mut e = Vec::new();
                push_key_field(&mut e, format!("k{k}").as_bytes());
                e
            };
            let mut open: BTreeMap<(Vec<u8>, i64), (i64, Vec<u8>)> = BTreeMap::new();
            let mut written: std::collections::BTreeSet<(Vec<u8>, i64)> = Default::default();
            let mut taken = Vec::new();
            let mut x = 0x2545_F491_4F6C_DD1Du64;
            let mut compactions = 0;
            for step in 0..30_000u64 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let (k, id) = (key_of(x >> 40 & 511), (x >> 20 & 7) as i64 * 300);
                let kid = keys.intern(&k);
                let acc = step.to_le_bytes()[..(x >> 8) as usize % 9].to_vec();
                match x % 100 {
                    0..=39 => {
                        let w = Window { start: id, end: id + 300 + (x & 1) as i64 };
                        let before = state.slab.len();
                        if state.open(kid, id, w) {
                            compactions += usize::from(state.slab.len() <= before);
                            open.insert((k.clone(), id), (id, Vec::new()));
                            written.insert((k, id));
                        }
                    }
                    40..=64 if state.handle(kid, id).is_some() => {
                        state.set_acc(kid, id, &acc);
                        open.get_mut(&(k.clone(), id)).unwrap().1 = acc;
                        written.insert((k, id));
                    }
                    65..=66 if state.handle(kid, id).is_some() => {
                        let start = id - 1 - (x >> 50) as i64 % 5;
                        state.set_window(kid, id, Window { start, end: id + 300 });
                        open.get_mut(&(k.clone(), id)).unwrap().0 = start;
                        written.insert((k, id));
                    }
                    97 if x >> 30 & 15 == 0 => {
                        // Every slot counts as written; every accumulator replaced (in the
                        // state's order: one value for all, so the order does not matter).
                        if x >> 34 & 1 == 0 {
                            state.touch_all();
                        } else {
                            state.replace_accs(|| &b"r"[..]);
                            open.values_mut().for_each(|(_, acc)| *acc = b"r".to_vec());
                        }
                        written.extend(open.keys().cloned());
                    }
                    67..=97 => {
                        assert_eq!(state.remove(kid, id).is_some(), open.remove(&(k.clone(), id)).is_some());
                        written.remove(&(k, id));
                    }
                    98 => taken.push((state.capture(&keys, false), open.clone())),
                    99 => {
                        let want = open
                            .iter()
                            .filter(|(s, _)| written.contains(*s))
                            .map(|(s, v)| (s.clone(), v.clone()));
                        taken.push((state.capture(&keys, true), want.collect()));
                        written.clear();
                    }
                    _ => {}
                }
            }
            assert!(
                taken.len() > 500 && compactions > 0,
                "{} captures, {compactions} compactions",
                taken.len()
            );
            for (i, (capture, want)) in taken.iter().enumerate() {
                assert_eq!(&held(capture), want, "capture {i}");
            }
        }
    }

    #[test]
    fn keys_round_trip() {
        let mut t = KeyTable::default();
        let mut k = Vec::new();
        push_key_field(&mut k, b"queso-curado");
        push_key_field(&mut k, b"girona");
        assert!(valid_key(&k));
        assert!(!valid_key(&[1, 0, 0, 0, 0xff]));
        let id = t.intern(&k);
        assert_eq!(t.intern(&k), id);
        assert_eq!(t.fields(id).collect::<Vec<_>>(), ["queso-curado", "girona"]);
    }

    #[test]
    fn ranks_put_the_live_keys_in_field_order_as_keys_come_and_go() {
        // The model: the live keys' fields, sorted as lists of byte strings.
        let mut rng = crate::generate::Rng::new(5);
        let mut t = KeyTable::default();
        let mut live: BTreeMap<Vec<Vec<u8>>, u32> = BTreeMap::new();
        let words: [&[u8]; 6] = [b"", b"a", b"ab", b"b", b"queso", b"\xc3\xb1"];
        let mut rankings = 0;
        for step in 0..4_000 {
            let fields: Vec<Vec<u8>> = (0..2)
                .map(|_| words[rng.below(words.len() as u64) as usize].repeat(1 + rng.below(3) as usize))
                .collect();
            if rng.below(3) == 0 {
                if let Some(id) = live.remove(&fields) {
                    t.remove(id);
                }
            } else {
                let mut k = Vec::new();
                fields.iter().for_each(|f| push_key_field(&mut k, f));
                live.insert(fields, t.intern(&k));
            }
            // Rank now and then, after a few changes or many; now and then every key
            // again (as past a full list of new ids, which the end of the test reaches).
            if step % (1 + rng.below(40) as usize) == 0 {
                if rng.below(10) == 0 {
                    t.rank_whole = true;
                }
                let rank = t.ranks(live.len()).expect("few keys: ranked").to_vec();
                let got: Vec<u32> = {
                    let mut ids: Vec<u32> = live.values().copied().collect();
                    ids.sort_by_key(|&id| rank[id as usize]);
                    ids
                };
                let want: Vec<u32> = live.values().copied().collect();
                assert_eq!(got, want, "step {step}");
                let mut ranks: Vec<u32> = want.iter().map(|&id| rank[id as usize]).collect();
                ranks.dedup();
                assert_eq!(ranks.len(), want.len(), "one rank a key");
                rankings += 1;
            }
        }
        assert!(rankings > 100 && live.len() > 20, "{rankings} rankings, {} keys", live.len());
        // Keys that come and go by the thousand between two rankings: more than the list
        // of new ids keeps, so every key is ranked again (and still in order).
        for i in 0..3 * FRESH_SLACK {
            let mut k = Vec::new();
            push_key_field(&mut k, format!("gone-{i}").as_bytes());
            let id = t.intern(&k);
            t.remove(id);
        }
        assert!(t.rank_whole, "the list of new ids overflowed");
        // Keys that stay, interned once the list is full, each in place of one that goes
        // (the list does not grow with the keys held).
        for w in [&b"aa"[..], b"zz", b"m", b""] {
            if let Some((_, id)) = live.pop_first() {
                t.remove(id);
            }
            let fields = vec![w.to_vec(), b"after".to_vec()];
            let mut k = Vec::new();
            fields.iter().for_each(|f| push_key_field(&mut k, f));
            live.insert(fields, t.intern(&k));
        }
        let rank = t.ranks(live.len()).expect("ranked").to_vec();
        let mut got: Vec<u32> = live.values().copied().collect();
        got.sort_by_key(|&id| rank[id as usize]);
        assert_eq!(got, live.values().copied().collect::<Vec<_>>());
    }

    #[test]
    fn slots_timers_and_key_counts() {
        let mut s = WindowState::default();
        let w = Window { start: 0, end: 5 };
        assert!(s.open(2, 0, w));
        assert!(!s.open(2, 0, w));
        assert!(s.open(2, 5, Window { start: 5, end: 10 }));
        s.set_acc(2, 0, b"a");
        assert_eq!(s.acc(2, 0), b"a");
        s.add_timer(Timer { time: 10, kind: TimerKind::Fire, key: 2, id: 5 });
        s.add_timer(Timer { time: 5, kind: TimerKind::Cleanup, key: 2, id: 0 });
        s.add_timer(Timer { time: 5, kind: TimerKind::Fire, key: 2, id: 0 });
        assert_eq!(s.next_timer(), Some(5));
        assert_eq!(s.pop_due(4), None);
        assert_eq!(s.pop_due(5).map(|t| t.kind), Some(TimerKind::Fire));
        assert_eq!(s.pop_due(5).map(|t| t.kind), Some(TimerKind::Cleanup));
        assert_eq!(s.pop_due(5), None);
        assert_eq!(s.remove(2, 0).map(|(_, last)| last), Some(false));
        assert_eq!(s.remove(2, 5).map(|(_, last)| last), Some(true));
        assert!(s.is_empty());
        assert_eq!(s.keys_in_use(), 0);
    }

    #[test]
    fn a_snapshot_keeps_the_keys_it_saw_while_the_table_changes() {
        let key = |i: usize| {
            let mut k = Vec::new();
            push_key_field(&mut k, format!("producto-{i}").as_bytes());
            push_key_field(&mut k, b"reus");
            k
        };
        let mut t = KeyTable::default();
        let ids: Vec<u32> = (0..10_000).map(|i| t.intern(&key(i))).collect();
        let snap = t.snapshot();
        // Removed ids are given to new keys (their spans change), new keys go to the
        // chunk the snapshot shares, and the removals compact the table (keys move).
        for i in (0..10_000).filter(|i| i % 3 != 0) {
            t.remove(ids[i]);
        }
        let new: Vec<u32> = (10_000..20_000).map(|i| t.intern(&key(i))).collect();
        assert!(new.iter().any(|id| ids.contains(id)), "ids are reused");
        for (i, &id) in ids.iter().enumerate() {
            assert_eq!(snap.key(id), key(i).as_slice());
        }
        for (i, &id) in (10_000..).zip(&new) {
            assert_eq!(t.get(&key(i)), Some(id));
            assert_eq!(t.encoded(id), key(i).as_slice());
        }
        for i in (0..10_000).step_by(3) {
            assert_eq!(t.encoded(ids[i]), key(i).as_slice());
        }
        assert_eq!(t.len(), 10_000 / 3 + 1 + 10_000);
    }

    #[test]
    fn a_key_longer_than_a_chunk_gets_one_of_its_own() {
        let mut t = KeyTable::default();
        let short = t.intern(b"\x01\0\0\0a");
        let mut long = Vec::new();
        push_key_field(&mut long, &vec![b'x'; KEY_CHUNK + 10]);
        let l = t.intern(&long);
        let after = t.intern(b"\x01\0\0\0b");
        assert_eq!(t.encoded(l), long.as_slice());
        assert_eq!(
            (t.get(&long), t.get(b"\x01\0\0\0a"), t.get(b"\x01\0\0\0b")),
            (Some(l), Some(short), Some(after))
        );
        assert_eq!(t.fields(after).collect::<Vec<_>>(), ["b"]);
    }

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

    #[test]
    fn removed_keys_free_their_ids() {
        let mut t = KeyTable::default();
        let a = t.intern(b"\x01\0\0\0a");
        let b = t.intern(b"\x01\0\0\0b");
        t.remove(a);
        assert_eq!(t.get(b"\x01\0\0\0a"), None);
        let c = t.intern(b"\x01\0\0\0c");
        assert_eq!(c, a);
        assert_eq!(t.fields(b).collect::<Vec<_>>(), ["b"]);
        assert_eq!(t.len(), 2);
    }

    #[test]
    fn keys_survive_the_compaction_of_removed_ones_and_an_empty_key_is_a_key() {
        let mut t = KeyTable::default();
        // Short keys, held in their index entry too, and long ones, found through their
        // span (which the compaction moves).
        let key = |i: u32| {
            let mut k = Vec::new();
            push_key_field(&mut k, format!("producto-{i}").as_bytes());
            push_key_field(
                &mut k,
                if i % 3 == 0 { &b"mercat-central-de-la-boqueria"[..] } else { b"girona" },
            );
            k
        };
        assert!(key(1).len() <= key_index::INLINE && key(3).len() > key_index::INLINE);
        let ids: Vec<u32> = (0..20_000).map(|i| t.intern(&key(i))).collect();
        // Removing all but every tenth key leaves more holes than keys: the buffer is
        // compacted (more than once) on the way.
        for i in (0..20_000u32).filter(|i| i % 10 != 0) {
            t.remove(ids[i as usize]);
        }
        assert_eq!(t.len(), 2_000);
        let held: usize = t.chunks.iter().map(|c| c.len()).sum();
        assert!(held < 2 * t.bytes() + 2 * KEY_CHUNK, "{held} bytes for {}", t.bytes());
        for i in (0..20_000u32).step_by(10) {
            assert_eq!(t.get(&key(i)), Some(ids[i as usize]));
            assert_eq!(t.encoded(ids[i as usize]), key(i).as_slice());
        }
        assert_eq!(t.get(&key(1)), None);
        // A pipeline without key fields has one key, the empty one.
        let empty = t.intern(b"");
        assert_eq!(t.get(b""), Some(empty));
        assert_eq!(t.fields(empty).count(), 0);
        t.remove(empty);
        assert_eq!(t.get(b""), None);
        assert_eq!(t.len(), 2_000);
    }
}

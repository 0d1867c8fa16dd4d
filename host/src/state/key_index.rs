//! The key table's index: key ids by key, in an open-addressed table whose entries hold
//! short keys themselves.
//!
//! A lookup starts at the entry its hash names, so the cache lines it will read can be
//! asked for ahead ([`KeyIndex::prefetch`]): with many keys that entry is a cache miss
//! for nearly every record, and the record loop asks for the next record's entry while
//! it processes this one. (hashbrown's table, used before, does not say where a hash
//! leads.)
//!
//! Linear probing in Robin Hood order (an entry placed further from its home than the
//! one it meets takes that place, which moves on), up to [`LOAD_NUM`]/[`LOAD_DEN`] full
//! as hashbrown's table is (the same memory a key): entries lie in the order of their
//! homes, so a lookup of an absent key stops at the first entry closer to its home than
//! the probe is to the key's, not at the far end of a long run. Removal by backward
//! shift: no tombstones.
use super::key_hash::short_eq;
use super::{bytes_of, Span};
use std::sync::Arc;

/// Keys of up to this many bytes (encoded) are held in their index entry too.
pub(super) const INLINE: usize = 36;

/// An entry's `id` when it is vacant (ids are below it: dense from 0).
const VACANT: u32 = u32::MAX;

/// Most entries taken, as a share of the capacity. A hit reads (1 + 1/(1 - load))/2
/// entries on average: 1.8 at 0.6 (10 000 keys in 16 384 entries), 4.5 when full.
const LOAD_NUM: usize = 7;
const LOAD_DEN: usize = 8;

/// An index entry: the id, the low half of the key's hash (the entry it belongs at, and
/// a first comparison) and the key, so that a lookup compares the key without a detour
/// through the spans or the chunks: the key's bytes when it is short (up to [`INLINE`]),
/// else where it lies. Each detour was a cache miss per record with many keys (the
/// entry, then the key's bytes). 48 bytes.
#[derive(Clone, Copy)]
pub(super) struct Interned {
    id: u32,
    /// The key's length.
    len: u32,
    hash: u32,
    /// The key when `len <= INLINE`; else its span, in the first 12 bytes.
    key: [u8; INLINE],
}

const EMPTY: Interned = Interned { id: VACANT, len: 0, hash: 0, key: [0; INLINE] };

impl Interned {
    fn new(id: u32, hash: u64, span: Span, encoded: &[u8]) -> Interned {
        let mut e = Interned { id, len: encoded.len() as u32, hash: hash as u32, key: [0; INLINE] };
        match e.key.get_mut(..encoded.len()) {
            Some(inline) => inline.copy_from_slice(encoded),
            None => e.set_span(span),
        }
        e
    }

    #[inline]
    pub(super) fn id(&self) -> u32 {
        self.id
    }

    #[inline]
    pub(super) fn is_inline(&self) -> bool {
        self.len as usize <= INLINE
    }

    /// The key's bytes.
    #[inline(always)]
    fn key<'a>(&'a self, chunks: &'a [Arc<[u8]>]) -> &'a [u8] {
        match self.key.get(..self.len as usize) {
            Some(inline) => inline,
            None => bytes_of(chunks, self.span()),
        }
    }

    fn span(&self) -> Span {
        let word =
            |i: usize| u32::from_le_bytes([self.key[i], self.key[i + 1], self.key[i + 2], self.key[i + 3]]);
        Span { chunk: word(0), start: word(4), len: word(8) }
    }

    pub(super) fn set_span(&mut self, span: Span) {
        self.key[0..4].copy_from_slice(&span.chunk.to_le_bytes());
        self.key[4..8].copy_from_slice(&span.start.to_le_bytes());
        self.key[8..12].copy_from_slice(&span.len.to_le_bytes());
    }
}

/// Key ids by key (see the module's text).
#[derive(Default)]
pub(super) struct KeyIndex {
    /// A power of two entries (none before the first key).
    entries: Box<[Interned]>,
    len: usize,
}

impl KeyIndex {
    /// The entry a hash starts at (`entries` is not empty).
    #[inline(always)]
    fn home(&self, hash: u32) -> usize {
        hash as usize & (self.entries.len() - 1)
    }

    #[inline(always)]
    fn next(&self, i: usize) -> usize {
        (i + 1) & (self.entries.len() - 1)
    }

    /// How far the entry at `i`, whose hash is `hash`, lies from its home.
    #[inline(always)]
    fn distance(&self, i: usize, hash: u32) -> usize {
        i.wrapping_sub(self.home(hash)) & (self.entries.len() - 1)
    }

    /// The id of `encoded`, whose hash is `hash`; `chunks` hold the keys too long to be
    /// inline.
    #[inline(always)]
    pub(super) fn find(&self, hash: u64, encoded: &[u8], chunks: &[Arc<[u8]>]) -> Option<u32> {
        if self.entries.is_empty() {
            return None;
        }
        let (h, n) = (hash as u32, encoded.len() as u32);
        let mut i = self.home(h);
        let mut probe = 0;
        loop {
            let e = &self.entries[i];
            if e.hash == h && e.len == n && e.id != VACANT && short_eq(e.key(chunks), encoded) {
                return Some(e.id);
            }
            // A vacant entry, or one closer to its home: the key would lie before it.
            if e.id == VACANT || self.distance(i, e.hash) < probe {
                return None;
            }
            i = self.next(i);
            probe += 1;
        }
    }

    /// Ask for the cache lines a lookup of `hash` reads first (its entry, which may
    /// straddle two lines).
    #[inline(always)]
    pub(super) fn prefetch(&self, hash: u64) {
        if self.entries.is_empty() {
            return;
        }
        let e = &self.entries[self.home(hash as u32)];
        super::prefetch(e);
        super::prefetch(&e.key[INLINE - 1]);
    }

    /// Add `encoded` (absent) with id `id` and hash `hash`.
    pub(super) fn insert(&mut self, id: u32, hash: u64, span: Span, encoded: &[u8]) {
        debug_assert!(id != VACANT);
        self.reserve(1);
        self.place(Interned::new(id, hash, span, encoded));
        self.len += 1;
    }

    /// Put an entry in its place from its home, in Robin Hood order (there is room): past
    /// the entries at least as far from their homes, taking the place of the first that
    /// is closer to its own, which goes on the same way.
    fn place(&mut self, mut e: Interned) {
        let mask = self.entries.len() - 1;
        let mut i = self.home(e.hash);
        let mut probe = 0;
        loop {
            let here = &mut self.entries[i];
            if here.id == VACANT {
                *here = e;
                return;
            }
            // How far it lies from its home (`distance`, with `here` borrowed).
            let theirs = i.wrapping_sub(here.hash as usize & mask) & mask;
            if theirs < probe {
                std::mem::swap(here, &mut e);
                probe = theirs;
            }
            i = self.next(i);
            probe += 1;
        }
    }

    /// Room for `n` more keys without growing.
    pub(super) fn reserve(&mut self, n: usize) {
        let want = self.len.saturating_add(n);
        if want.saturating_mul(LOAD_DEN) <= self.entries.len().saturating_mul(LOAD_NUM) {
            return;
        }
        // The least power of two (16 at least) it fits in; one past any size (an
        // allocation that fails, as hashbrown's would) rather than a doubling that wraps.
        let cap = want
            .saturating_mul(LOAD_DEN)
            .div_ceil(LOAD_NUM)
            .max(16)
            .max(self.entries.len())
            .checked_next_power_of_two()
            .unwrap_or(usize::MAX);
        let old = std::mem::replace(&mut self.entries, vec![EMPTY; cap].into_boxed_slice());
        for e in old.iter().filter(|e| e.id != VACANT) {
            self.place(*e);
        }
    }

    /// Remove id `id`, whose key's hash is `hash`; false when it is not held.
    pub(super) fn remove(&mut self, id: u32, hash: u64) -> bool {
        if self.entries.is_empty() {
            return false;
        }
        let mut hole = self.home(hash as u32);
        let mut probe = 0;
        loop {
            let e = &self.entries[hole];
            if e.id == id && e.id != VACANT {
                break;
            }
            if e.id == VACANT || self.distance(hole, e.hash) < probe {
                return false;
            }
            hole = self.next(hole);
            probe += 1;
        }
        // Backward shift: the entries after the hole move back one place while they lie
        // away from their homes (up to a vacant entry or one at its home). In Robin Hood
        // order each lies past its home, so a lookup from there still meets it before a
        // vacant entry or one closer to its home.
        loop {
            let j = self.next(hole);
            let e = self.entries[j];
            if e.id == VACANT || self.distance(j, e.hash) == 0 {
                break;
            }
            self.entries[hole] = e;
            hole = j;
        }
        self.entries[hole] = EMPTY;
        self.len -= 1;
        true
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = &Interned> + '_ {
        self.entries.iter().filter(|e| e.id != VACANT)
    }

    pub(super) fn iter_mut(&mut self) -> impl Iterator<Item = &mut Interned> + '_ {
        self.entries.iter_mut().filter(|e| e.id != VACANT)
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn is_empty(&self) -> bool {
        self.len == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn span() -> Span {
        Span::default()
    }

    /// Against a map, with hashes chosen to collide (few distinct homes, wrapping past
    /// the table's end): every key is found with its id after any mix of inserts and
    /// removes, and none that was removed.
    #[test]
    fn finds_what_a_map_holds_after_inserts_and_removes_that_collide() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut rand = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for homes in [1u64, 3, 64] {
            let (mut index, mut model) = (KeyIndex::default(), HashMap::<Vec<u8>, (u32, u64)>::new());
            let mut next_id = 0u32;
            for step in 0..20_000 {
                let k = rand() % 300;
                let key = format!("k{k}").into_bytes();
                // High bits place a key; few distinct low bits (homes) collide; some keys
                // start at the last entries and wrap.
                let hash = (k % homes).wrapping_sub(2) as u32 as u64 | (k << 40);
                if rand() % 3 == 0 {
                    if let Some((id, h)) = model.remove(&key) {
                        assert!(index.remove(id, h));
                    }
                } else if let std::collections::hash_map::Entry::Vacant(e) = model.entry(key) {
                    index.insert(next_id, hash, span(), e.key());
                    e.insert((next_id, hash));
                    next_id += 1;
                }
                if step % 97 == 0 {
                    assert_eq!(index.len(), model.len());
                    assert!(index.len() * LOAD_DEN <= index.entries.len() * LOAD_NUM);
                    robin_hood_order(&index);
                    for k in 0..300u64 {
                        let key = format!("k{k}").into_bytes();
                        let hash = (k % homes).wrapping_sub(2) as u32 as u64 | (k << 40);
                        assert_eq!(index.find(hash, &key, &[]), model.get(&key).map(|&(id, _)| id), "{k}");
                    }
                    let mut ids: Vec<u32> = index.iter().map(|e| e.id()).collect();
                    let mut want: Vec<u32> = model.values().map(|&(id, _)| id).collect();
                    ids.sort_unstable();
                    want.sort_unstable();
                    assert_eq!(ids, want);
                }
            }
        }
    }

    /// Along the table, from a vacant entry on, each taken entry lies at most one place
    /// further from its home than the entry before it (the order lookups and removals
    /// rely on), and no entry lies before its home past a vacant one.
    fn robin_hood_order(index: &KeyIndex) {
        let n = index.entries.len();
        let Some(start) = (0..n).find(|&i| index.entries[i].id == VACANT) else { return };
        let mut before: Option<usize> = None;
        for k in 1..=n {
            let i = (start + k) % n;
            let e = &index.entries[i];
            if e.id == VACANT {
                before = None;
                continue;
            }
            let d = index.distance(i, e.hash);
            match before {
                None => assert_eq!(d, 0, "an entry right after a vacant one lies at its home"),
                Some(b) => assert!(d <= b + 1, "entry {i}: {d} after {b}"),
            }
            before = Some(d);
        }
    }

    /// Keys to just under the most the capacity holds, then every other one removed and
    /// put back: all are found, the absent ones are not, and the table did not grow.
    #[test]
    fn a_table_filled_to_its_most_finds_every_key() {
        let mut index = KeyIndex::default();
        index.reserve(7 * 1024 / 8);
        let cap = index.entries.len();
        let n = cap * LOAD_NUM / LOAD_DEN;
        let hash = |k: usize| (k as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 7;
        let key = |k: usize| format!("clave-{k}").into_bytes();
        for k in 0..n {
            index.insert(k as u32, hash(k), span(), &key(k));
        }
        for k in (0..n).step_by(2) {
            assert!(index.remove(k as u32, hash(k)));
        }
        robin_hood_order(&index);
        for k in (0..n).step_by(2) {
            index.insert(k as u32, hash(k), span(), &key(k));
        }
        assert_eq!(index.entries.len(), cap);
        robin_hood_order(&index);
        for k in 0..n {
            assert_eq!(index.find(hash(k), &key(k), &[]), Some(k as u32));
        }
        for k in n..n + 500 {
            assert_eq!(index.find(hash(k), &key(k), &[]), None);
        }
    }

    #[test]
    fn an_empty_index_finds_nothing_and_removes_nothing() {
        let mut index = KeyIndex::default();
        assert_eq!(index.find(7, b"a", &[]), None);
        assert!(!index.remove(0, 7));
        index.prefetch(7);
        assert!(index.is_empty());
    }

    #[test]
    fn keys_too_long_to_be_inline_are_compared_in_their_chunk() {
        let long = vec![b'x'; INLINE + 5];
        let chunks: Vec<Arc<[u8]>> = vec![Arc::from(long.clone())];
        let mut index = KeyIndex::default();
        let s = Span { chunk: 0, start: 0, len: long.len() as u32 };
        index.insert(4, 99, s, &long);
        assert_eq!(index.find(99, &long, &chunks), Some(4));
        let mut other = long.clone();
        other[INLINE + 2] = b'y';
        assert_eq!(index.find(99, &other, &chunks), None);
    }
}

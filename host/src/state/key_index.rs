//! The key table's index: key ids by key, in an open-addressed table whose entries hold
//! short keys themselves.
//!
//! A lookup starts at the entry its hash names, so the cache lines it will read can be
//! asked for ahead ([`KeyIndex::prefetch`]): with many keys that entry is a cache miss
//! for nearly every record, and the record loop asks for the next record's entry while
//! it processes this one. (hashbrown's table, used before, does not say where a hash
//! leads.) Linear probing, at most [`LOAD_NUM`]/[`LOAD_DEN`] full, and removal by
//! backward shift: no tombstones, so a lookup stops at the first vacant entry.

use super::{bytes_of, Span};
use crate::source::json::short_eq;
use std::sync::Arc;

/// Keys of up to this many bytes (encoded) are held in their index entry too.
pub(super) const INLINE: usize = 36;

/// An entry's `id` when it is vacant (ids are below it: dense from 0).
const VACANT: u32 = u32::MAX;

/// Most entries taken, as a share of the capacity: a hit reads 1.8 entries on average at
/// this load, a miss 3.8.
const LOAD_NUM: usize = 5;
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

    /// The id of `encoded`, whose hash is `hash`; `chunks` hold the keys too long to be
    /// inline.
    #[inline(always)]
    pub(super) fn find(&self, hash: u64, encoded: &[u8], chunks: &[Arc<[u8]>]) -> Option<u32> {
        if self.entries.is_empty() {
            return None;
        }
        let (h, n) = (hash as u32, encoded.len() as u32);
        let mut i = self.home(h);
        loop {
            let e = &self.entries[i];
            if e.id == VACANT {
                return None;
            }
            if e.hash == h && e.len == n && short_eq(e.key(chunks), encoded) {
                return Some(e.id);
            }
            i = self.next(i);
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

    /// Put an entry in the first vacant place from its home (there is room).
    fn place(&mut self, e: Interned) {
        let mut i = self.home(e.hash);
        while self.entries[i].id != VACANT {
            i = self.next(i);
        }
        self.entries[i] = e;
    }

    /// Room for `n` more keys without growing.
    pub(super) fn reserve(&mut self, n: usize) {
        let want = self.len.saturating_add(n);
        if want.saturating_mul(LOAD_DEN) <= self.entries.len().saturating_mul(LOAD_NUM) {
            return;
        }
        let mut cap = self.entries.len().max(16);
        while want.saturating_mul(LOAD_DEN) > cap.saturating_mul(LOAD_NUM) {
            cap *= 2;
        }
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
        loop {
            match self.entries[hole].id {
                VACANT => return false,
                x if x == id => break,
                _ => hole = self.next(hole),
            }
        }
        // Backward shift: each entry after the hole, up to the next vacant one, moves into
        // the hole when its home does not lie between the hole and where it is (cyclically):
        // a lookup that starts at its home then still meets no vacant entry before it.
        let mut j = self.next(hole);
        loop {
            let e = self.entries[j];
            if e.id == VACANT {
                break;
            }
            let home = self.home(e.hash);
            let stays = if hole <= j { hole < home && home <= j } else { hole < home || home <= j };
            if !stays {
                self.entries[hole] = e;
                hole = j;
            }
            j = self.next(j);
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
                } else if !model.contains_key(&key) {
                    index.insert(next_id, hash, span(), &key);
                    model.insert(key, (next_id, hash));
                    next_id += 1;
                }
                if step % 97 == 0 {
                    assert_eq!(index.len(), model.len());
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

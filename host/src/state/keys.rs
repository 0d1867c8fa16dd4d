//! Interned keys: the key table (ids, spans in chunks, ranks) and the encoding of a key's
//! fields (each a little-endian u32 length and its UTF-8 bytes).

use super::key_hash::KeyHasher;
use super::key_index::KeyIndex;
use super::*;

/// Bytes of one chunk of the key table (a longer key gets a chunk of its own).
pub(super) const KEY_CHUNK: usize = 1 << 18;
/// Ids per chunk of spans.
const SPAN_CHUNK: usize = 1 << 12;

/// Where a key lies: its chunk, and its start and length in it.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Span {
    pub(super) chunk: u32,
    pub(super) start: u32,
    pub(super) len: u32,
}

/// A key's bytes.
#[inline]
pub(super) fn bytes_of(chunks: &[Arc<[u8]>], s: Span) -> &[u8] {
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
pub(super) const FRESH_SLACK: usize = 1024;

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

/// The fields of an encoded key, as bytes.
pub fn raw_fields_of(encoded: &[u8]) -> RawKeyFields<'_> {
    RawKeyFields { rest: encoded }
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

#[cfg(test)]
mod tests {
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

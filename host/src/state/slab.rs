//! The slab the open slots lie in, in chunks shared copy-on-write with snapshots.
//!
//! A snapshot ([`Slab::snapshot`]) takes the slab in O(chunks), copying no entry, so a
//! checkpoint stops processing for the same short time whatever the size of the state
//! (copying every slot took ~25 ms for 856k). The slab copies a chunk the first time
//! it writes to one a snapshot may still hold, and never after: at most the whole slab
//! once per checkpoint, spread over the processing that follows, in steps of one chunk.
//! This is the scheme of Flink's copy-on-write heap state, with chunks for its map's
//! entries.

use std::ops::{Index, IndexMut};
use std::sync::Arc;

/// Entries per chunk: with the 56-byte slots, a copy on write is 56 KiB (a few µs), and
/// a snapshot of a million slots takes ~1 000 chunks.
const CHUNK_BITS: u32 = 10;
const CHUNK: usize = 1 << CHUNK_BITS;
const MASK: usize = CHUNK - 1;

/// Entries by position, pushed at the end; see the module's documentation.
pub(crate) struct Slab<T> {
    /// Every chunk but the last holds [`CHUNK`] entries; each has room for as many.
    chunks: Vec<Arc<Vec<T>>>,
    /// Per chunk: whether a snapshot may hold it. A chunk not marked is held by no other
    /// [`Arc`] (none is cloned but by [`Slab::snapshot`], which marks them all).
    shared: Vec<bool>,
    len: usize,
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Slab { chunks: Vec::new(), shared: Vec::new(), len: 0 }
    }
}

impl<T: Clone> Slab<T> {
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    #[inline]
    pub(crate) fn get(&self, i: usize) -> Option<&T> {
        self.chunks.get(i >> CHUNK_BITS)?.get(i & MASK)
    }

    /// Chunk `c`, to write to: copied first when a snapshot still holds it.
    #[inline]
    fn owned(&mut self, c: usize) -> &mut Vec<T> {
        if self.shared[c] {
            self.unshare(c);
        }
        let chunk = &self.chunks[c];
        debug_assert_eq!(Arc::strong_count(chunk), 1);
        // SAFETY: the chunk is not marked shared, so this is its only `Arc` (no `Weak` is
        // ever made), and `&mut self` makes the access exclusive: what `Arc::get_mut`
        // checks with an atomic operation on every write, which this spares. (`as_ptr`
        // gives the `Arc`'s own pointer to its value, which `Arc::get_mut` and the
        // unstable `get_mut_unchecked` also write through.)
        unsafe { &mut *Arc::as_ptr(chunk).cast_mut() }
    }

    /// Make chunk `c` this slab's alone: a copy when a snapshot still holds it.
    #[cold]
    fn unshare(&mut self, c: usize) {
        let chunk = &mut self.chunks[c];
        if Arc::get_mut(chunk).is_none() {
            let mut copy = Vec::with_capacity(CHUNK);
            copy.extend_from_slice(chunk);
            *chunk = Arc::new(copy);
        }
        self.shared[c] = false;
    }

    /// Add an entry at the end; its position.
    #[inline]
    pub(crate) fn push(&mut self, entry: T) -> usize {
        if self.len & MASK == 0 {
            self.chunks.push(Arc::new(Vec::with_capacity(CHUNK)));
            self.shared.push(false);
        }
        let last = self.chunks.len() - 1;
        self.owned(last).push(entry);
        self.len += 1;
        self.len - 1
    }

    /// Add `chunk` (full, unless it is the last one) at the end.
    fn push_chunk(&mut self, chunk: Vec<T>) {
        debug_assert!(self.len & MASK == 0 && chunk.len() <= CHUNK);
        self.len += chunk.len();
        self.chunks.push(Arc::new(chunk));
        self.shared.push(false);
    }

    /// Room for `n` more entries (for the list of chunks; a chunk is made when reached).
    pub(crate) fn reserve(&mut self, n: usize) {
        let chunks = (self.len + n).div_ceil(CHUNK).saturating_sub(self.chunks.len());
        self.chunks.reserve(chunks);
        self.shared.reserve(chunks);
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = &T> + '_ {
        self.chunks.iter().flat_map(|c| c.iter())
    }

    /// Every entry, to write to (every chunk a snapshot holds is copied).
    pub(crate) fn for_each_mut(&mut self, mut f: impl FnMut(&mut T)) {
        for c in 0..self.chunks.len() {
            self.owned(c).iter_mut().for_each(&mut f);
        }
    }

    /// Keep the entries `keep` says, in their order, at the front (positions change).
    /// Moves them into new chunks (clones those of chunks a snapshot holds).
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(&T) -> bool) {
        let old = std::mem::take(self);
        let mut into = Vec::with_capacity(CHUNK);
        for chunk in old.chunks {
            let mut put = |e: T| {
                into.push(e);
                if into.len() == CHUNK {
                    self.push_chunk(std::mem::replace(&mut into, Vec::with_capacity(CHUNK)));
                }
            };
            match Arc::try_unwrap(chunk) {
                Ok(entries) => entries.into_iter().filter(|e| keep(e)).for_each(&mut put),
                Err(held) => held.iter().filter(|e| keep(e)).cloned().for_each(&mut put),
            }
        }
        if !into.is_empty() {
            self.push_chunk(into);
        }
    }

    /// The slab as it is now, sharing its chunks: O(chunks).
    pub(crate) fn snapshot(&mut self) -> SlabSnapshot<T> {
        self.shared.fill(true);
        SlabSnapshot { chunks: self.chunks.clone() }
    }
}

impl<T: Clone> Index<usize> for Slab<T> {
    type Output = T;

    #[inline]
    fn index(&self, i: usize) -> &T {
        &self.chunks[i >> CHUNK_BITS][i & MASK]
    }
}

impl<T: Clone> IndexMut<usize> for Slab<T> {
    #[inline]
    fn index_mut(&mut self, i: usize) -> &mut T {
        &mut self.owned(i >> CHUNK_BITS)[i & MASK]
    }
}

/// A slab's entries when [`Slab::snapshot`] took them, unchanged since.
pub(crate) struct SlabSnapshot<T> {
    chunks: Vec<Arc<Vec<T>>>,
}

impl<T> Default for SlabSnapshot<T> {
    fn default() -> Self {
        SlabSnapshot { chunks: Vec::new() }
    }
}

impl<T> Clone for SlabSnapshot<T> {
    fn clone(&self) -> Self {
        SlabSnapshot { chunks: self.chunks.clone() }
    }
}

impl<T> SlabSnapshot<T> {
    pub(crate) fn iter(&self) -> impl Iterator<Item = &T> + '_ {
        self.chunks.iter().flat_map(|c| c.iter())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Entries are what a Vec given the same operations holds, and a snapshot keeps what
    /// the slab held when it was taken, through writes, pushes and compactions after it.
    #[test]
    fn a_snapshot_keeps_what_the_slab_held_while_the_slab_is_what_a_vec_is() {
        let mut slab = Slab::default();
        let mut model: Vec<u64> = Vec::new();
        let mut snaps: Vec<(SlabSnapshot<u64>, Vec<u64>)> = Vec::new();
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for step in 0..20_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            match x % 100 {
                0..=59 => {
                    assert_eq!(slab.push(step), model.len());
                    model.push(step);
                }
                60..=89 if !model.is_empty() => {
                    let i = (x >> 32) as usize % model.len();
                    slab[i] = step;
                    model[i] = step;
                    assert_eq!(slab.get(i), Some(&step));
                }
                90..=93 => {
                    let m = x >> 40 | 1;
                    slab.retain(|e| e % m != 0 || e % 3 != 0);
                    model.retain(|e| e % m != 0 || e % 3 != 0);
                }
                94..=95 => snaps.push((slab.snapshot(), model.clone())),
                96..=97 if !snaps.is_empty() => drop(snaps.swap_remove((x >> 32) as usize % snaps.len())),
                _ => {
                    slab.for_each_mut(|e| *e += 1);
                    model.iter_mut().for_each(|e| *e += 1);
                }
            }
            assert_eq!(slab.len(), model.len());
        }
        assert_eq!(slab.iter().copied().collect::<Vec<_>>(), model);
        assert_eq!((0..model.len()).map(|i| slab[i]).collect::<Vec<_>>(), model);
        assert!(slab.get(model.len()).is_none());
        assert!(snaps.len() > 10);
        for (snap, held) in &snaps {
            assert_eq!(&snap.iter().copied().collect::<Vec<_>>(), held);
        }
    }

    /// A chunk is copied once after a snapshot, not on every write; one no snapshot
    /// holds any more is not copied at all.
    #[test]
    fn a_chunk_is_copied_at_most_once_per_snapshot() {
        let mut slab = Slab::default();
        (0..3 * CHUNK as u32).for_each(|i| {
            slab.push(i);
        });
        let at = |s: &Slab<u32>, i: usize| Arc::as_ptr(&s.chunks[i >> CHUNK_BITS]);
        let before = at(&slab, 0);
        let snap = slab.snapshot();
        slab[1] = 7;
        let copied = at(&slab, 0);
        assert_ne!(copied, before);
        slab[2] = 8;
        assert_eq!(at(&slab, 0), copied);
        drop(snap);
        let _ = slab.snapshot();
        // The snapshot is gone: chunk 1 is written where it lies.
        let other = at(&slab, CHUNK);
        slab[CHUNK] = 9;
        assert_eq!(at(&slab, CHUNK), other);
    }
}

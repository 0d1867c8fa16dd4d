//! An operator's state captured for a snapshot. Processing stops only for a copy of each
//! open slot's fixed-size record and accumulator bytes, read in the slot table's own
//! order (no pointer is chased per slot); the key table is shared, not copied
//! ([`KeyTable::snapshot`]).
//! The bytes `state.bin` holds for them ([`crate::checkpoint::savepoint`]) are laid out
//! later, by the thread that writes the snapshot ([`CapturedSlots::encode_into`]).

use super::{KeySnapshot, KeyTable};
use crate::window::Window;

/// A key in `state.bin`: its field count, then the encoded fields.
pub fn put_key(out: &mut Vec<u8>, key: &[u8]) {
    let arity = super::arity_of(key).unwrap_or(0);
    out.extend_from_slice(&(arity as u32).to_le_bytes());
    out.extend_from_slice(key);
}

/// One captured slot; its accumulator is the next `acc_len` bytes of the captured ones.
#[derive(Debug, Clone, Copy)]
struct CapturedSlot {
    id: i64,
    window: Window,
    key: u32,
    acc_len: u32,
}

/// Captured slots: `count` of them, with the keys they refer to. A capture holds slots of
/// one kind: pushed by key id ([`Self::new`], [`Self::push`]) or with their keys
/// ([`Self::few`], [`Self::push_keyed`]).
#[derive(Debug, Clone, Default)]
pub struct CapturedSlots {
    pub count: u64,
    /// The key table when the capture started, for slots pushed by key id.
    table: KeySnapshot,
    /// Keys copied with their slots, and every one's (start, length).
    key_bytes: Vec<u8>,
    key_spans: Vec<(usize, u32)>,
    slots: Vec<CapturedSlot>,
    accs: Vec<u8>,
}

impl CapturedSlots {
    /// Start a capture of slots of `keys`, with room for `slots` slots and `acc_bytes`
    /// accumulator bytes.
    pub fn new(keys: &KeyTable, slots: usize, acc_bytes: usize) -> CapturedSlots {
        CapturedSlots {
            table: keys.snapshot(),
            slots: Vec::with_capacity(slots),
            accs: Vec::with_capacity(acc_bytes),
            ..Default::default()
        }
    }

    /// Start a capture of a few slots, whose keys come with them ([`Self::push_keyed`]).
    pub fn few(slots: usize) -> CapturedSlots {
        CapturedSlots { slots: Vec::with_capacity(slots), ..Default::default() }
    }

    /// Capture a slot whose key is (by id) in the key table taken at the start.
    #[inline]
    pub fn push(&mut self, key: u32, id: i64, window: Window, acc: &[u8]) {
        self.slots.push(CapturedSlot { id, window, key, acc_len: acc.len() as u32 });
        self.accs.extend_from_slice(acc);
        self.count += 1;
    }

    /// Capture a slot with its key's bytes.
    pub fn push_keyed(&mut self, key: &[u8], id: i64, window: Window, acc: &[u8]) {
        self.key_spans.push((self.key_bytes.len(), key.len() as u32));
        self.key_bytes.extend_from_slice(key);
        self.push(self.key_spans.len() as u32 - 1, id, window, acc);
    }

    /// Every slot: (encoded key, slot id, window, accumulator).
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], i64, Window, &[u8])> + '_ {
        let mut acc_at = 0;
        self.slots.iter().map(move |s| {
            let end = acc_at + s.acc_len as usize;
            let acc = &self.accs[acc_at..end];
            acc_at = end;
            (self.key(s.key), s.id, s.window, acc)
        })
    }

    fn key(&self, id: u32) -> &[u8] {
        match self.key_spans.get(id as usize) {
            Some(&(start, len)) => &self.key_bytes[start..start + len as usize],
            None => self.table.key(id),
        }
    }

    /// Bytes [`Self::encode_into`] writes.
    pub fn encoded_len(&self) -> usize {
        let keys: usize = self.slots.iter().map(|s| self.key(s.key).len()).sum();
        keys + self.accs.len() + self.slots.len() * (4 + 8 * 3 + 4)
    }

    /// The slots as `state.bin` holds them: each as key | i64 slot id | i64 start | i64
    /// end | u32 length, accumulator bytes.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        for (key, id, window, acc) in self.iter() {
            put_key(out, key);
            out.extend_from_slice(&id.to_le_bytes());
            out.extend_from_slice(&window.start.to_le_bytes());
            out.extend_from_slice(&window.end.to_le_bytes());
            out.extend_from_slice(&(acc.len() as u32).to_le_bytes());
            out.extend_from_slice(acc);
        }
    }
}

//! Host-owned state: interned keys and one accumulator (opaque plugin bytes) per open
//! (key, window), plus the timer index that says which windows the watermark closes.
//!
//! Keeping accumulators as bytes in the host is what lets savepoints and plugin upgrades
//! work without ever reading a guest's memory.

use crate::window::Window;
use std::collections::{BTreeSet, HashMap};

type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// Dense ids for key tuples. A key is stored encoded: each field as a little-endian u32
/// length followed by its UTF-8 bytes.
#[derive(Default)]
pub struct KeyTable {
    ids: FastMap<Box<[u8]>, u32>,
    keys: Vec<Box<[u8]>>,
}

impl KeyTable {
    /// The id of an encoded key, interning it on first sight.
    #[inline]
    pub fn intern(&mut self, encoded: &[u8]) -> u32 {
        match self.ids.get(encoded) {
            Some(&id) => id,
            None => self.insert(encoded),
        }
    }

    /// The id of a known key.
    #[inline]
    pub fn get(&self, encoded: &[u8]) -> Option<u32> {
        self.ids.get(encoded).copied()
    }

    /// Intern a key not seen before (see [`valid_key`] for keys built from raw input).
    pub fn insert(&mut self, encoded: &[u8]) -> u32 {
        let id = self.keys.len() as u32;
        self.keys.push(encoded.into());
        self.ids.insert(encoded.into(), id);
        id
    }

    pub fn encoded(&self, id: u32) -> &[u8] {
        &self.keys[id as usize]
    }

    /// The key's fields, in key order.
    pub fn fields(&self, id: u32) -> KeyFields<'_> {
        KeyFields { rest: self.encoded(id) }
    }

    /// The key's fields as UTF-8 bytes (byte order is string order), without re-checking.
    pub fn raw_fields(&self, id: u32) -> RawKeyFields<'_> {
        RawKeyFields { rest: self.encoded(id) }
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

/// Append one key field to an encoded key.
#[inline]
pub fn push_key_field(encoded: &mut Vec<u8>, field: &[u8]) {
    encoded.extend_from_slice(&(field.len() as u32).to_le_bytes());
    encoded.extend_from_slice(field);
}

/// Whether every field of an encoded key is UTF-8. Keys are built from raw input bytes
/// and checked only once, when first seen, before they are interned.
pub fn valid_key(encoded: &[u8]) -> bool {
    let mut rest = encoded;
    while !rest.is_empty() {
        let Some(len) = rest.get(..4).and_then(|b| b.try_into().ok()).map(u32::from_le_bytes) else {
            return false;
        };
        let Some(field) = rest.get(4..4 + len as usize) else { return false };
        if std::str::from_utf8(field).is_err() {
            return false;
        }
        rest = &rest[4 + len as usize..];
    }
    true
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

/// Accumulators of the open windows, by (key id, window start).
#[derive(Default)]
pub struct WindowState {
    accs: FastMap<(u32, i64), Slot>,
    /// (end, key, start) of every open window: the firing order.
    timers: BTreeSet<(i64, u32, i64)>,
}

struct Slot {
    end: i64,
    acc: Vec<u8>,
}

/// A window leaving the state (fired, or drained at end of input).
pub struct Closed {
    pub key: u32,
    pub window: Window,
    pub acc: Vec<u8>,
}

impl WindowState {
    /// The accumulator of an open window (empty = fresh).
    #[inline]
    pub fn get(&self, key: u32, start: i64) -> &[u8] {
        self.accs.get(&(key, start)).map_or(&[], |s| s.acc.as_slice())
    }

    /// Store a window's accumulator, opening the window if new.
    #[inline]
    pub fn put(&mut self, key: u32, window: Window, acc: &[u8]) {
        match self.accs.get_mut(&(key, window.start)) {
            Some(slot) => {
                slot.acc.clear();
                slot.acc.extend_from_slice(acc);
            }
            None => {
                self.accs.insert((key, window.start), Slot { end: window.end, acc: acc.to_vec() });
                self.timers.insert((window.end, key, window.start));
            }
        }
    }

    /// Smallest end among open windows.
    #[inline]
    pub fn next_end(&self) -> Option<i64> {
        self.timers.first().map(|t| t.0)
    }

    /// Remove and return every window with `end <= watermark`, in end order.
    pub fn take_until(&mut self, watermark: i64) -> Vec<Closed> {
        let mut out = Vec::new();
        while let Some(&(end, key, start)) = self.timers.first() {
            if end > watermark {
                break;
            }
            self.timers.pop_first();
            if let Some(slot) = self.accs.remove(&(key, start)) {
                out.push(Closed { key, window: Window { start, end: slot.end }, acc: slot.acc });
            }
        }
        out
    }

    /// Remove and return every open window, in end order.
    pub fn take_all(&mut self) -> Vec<Closed> {
        self.take_until(i64::MAX)
    }

    /// Open windows.
    pub fn len(&self) -> usize {
        self.accs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.accs.is_empty()
    }

    /// Every open window, in end order, for savepoints.
    pub fn iter(&self) -> impl Iterator<Item = (u32, Window, &[u8])> {
        self.timers.iter().filter_map(|&(end, key, start)| {
            self.accs.get(&(key, start)).map(|s| (key, Window { start, end }, s.acc.as_slice()))
        })
    }

    /// Replace every accumulator (after a migration), keeping windows and order.
    pub fn replace_accumulators(&mut self, mut next: impl FnMut(u32, Window) -> Vec<u8>) {
        for ((key, start), slot) in self.accs.iter_mut() {
            slot.acc = next(*key, Window { start: *start, end: slot.end });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn windows_fire_in_end_order_and_leave_the_state() {
        let mut s = WindowState::default();
        s.put(1, Window { start: 5, end: 10 }, b"b");
        s.put(2, Window { start: 0, end: 5 }, b"a");
        s.put(2, Window { start: 0, end: 5 }, b"a2");
        assert_eq!(s.next_end(), Some(5));
        assert!(s.take_until(4).is_empty());
        let fired = s.take_until(5);
        assert_eq!(fired.len(), 1);
        assert_eq!((fired[0].key, fired[0].acc.as_slice()), (2, &b"a2"[..]));
        assert_eq!(s.len(), 1);
        assert_eq!(s.get(2, 0), b"");
        assert_eq!(s.take_all().len(), 1);
        assert!(s.is_empty());
    }
}

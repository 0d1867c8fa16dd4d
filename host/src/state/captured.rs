//! An operator's state captured for a snapshot. Processing stops only to share the slot
//! slab's chunks and the key table's ([`super::WindowState::capture`]), not to copy a
//! slot or a key: the pause does not grow with the state.
//! The bytes `state.bin` holds for them ([`crate::checkpoint::savepoint`]) are laid out
//! later, by the thread that writes the snapshot ([`CapturedSlots::encode_into`]).

use super::{Entry, KeySnapshot, SlabSnapshot};
use crate::time::Window;

/// A key in `state.bin`: its field count, then the encoded fields.
pub fn put_key(out: &mut Vec<u8>, key: &[u8]) {
    let arity = super::arity_of(key).unwrap_or(0);
    out.extend_from_slice(&(arity as u32).to_le_bytes());
    out.extend_from_slice(key);
}

/// Slots captured for a snapshot ([`super::WindowState::capture`]): the state's slab and
/// key table as they were then (shared, not copied), and which of its slots the capture
/// takes: every open one, or those written in one generation (an incremental capture).
#[derive(Clone, Default)]
pub struct CapturedSlots {
    table: KeySnapshot,
    slab: SlabSnapshot<Entry>,
    /// Open slots when captured.
    open: u64,
    /// Only the slots written in this generation.
    written_in: Option<u16>,
}

impl std::fmt::Debug for CapturedSlots {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CapturedSlots")
            .field("open", &self.open)
            .field("written_in", &self.written_in)
            .finish()
    }
}

impl CapturedSlots {
    pub(super) fn new(
        table: KeySnapshot,
        slab: SlabSnapshot<Entry>,
        open: u64,
        written_in: Option<u16>,
    ) -> CapturedSlots {
        CapturedSlots { table, slab, open, written_in }
    }

    /// Slots the capture takes (an incremental capture counts them).
    pub fn len(&self) -> u64 {
        match self.written_in {
            None => self.open,
            Some(_) => self.iter().count() as u64,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every slot taken, in the state's order: (encoded key, slot id, window, accumulator).
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], i64, Window, &[u8])> + '_ {
        let written_in = self.written_in;
        self.slab
            .iter()
            .filter(move |e| e.live && written_in.is_none_or(|g| e.written == g))
            .map(|e| (self.table.key(e.key), e.id, e.slot.window, e.slot.acc.as_slice()))
    }

    /// Bytes [`Self::encode_into`] writes.
    pub fn encoded_len(&self) -> usize {
        self.iter().map(|(key, _, _, acc)| key.len() + acc.len() + 4 + 8 * 3 + 4).sum()
    }

    /// The slots as `state.bin` holds them: each as key | i64 slot id | i64 start | i64
    /// end | u32 length, accumulator bytes.
    /// Returns how many it wrote ([`Self::len`]).
    pub fn encode_into(&self, out: &mut Vec<u8>) -> u64 {
        let mut n = 0;
        for (key, id, window, acc) in self.iter() {
            n += 1;
            put_key(out, key);
            out.extend_from_slice(&id.to_le_bytes());
            out.extend_from_slice(&window.start.to_le_bytes());
            out.extend_from_slice(&window.end.to_le_bytes());
            out.extend_from_slice(&(acc.len() as u32).to_le_bytes());
            out.extend_from_slice(acc);
        }
        n
    }
}

//! An operator's state captured for a snapshot: its open slots encoded straight into
//! the bytes `state.bin` holds for them ([`crate::checkpoint::savepoint`]), one buffer
//! for all of them, so that processing stops for a copy, not for millions of small
//! allocations.

use crate::window::Window;

/// A key in `state.bin`: its field count, then the encoded fields.
pub fn put_key(out: &mut Vec<u8>, key: &[u8]) {
    let arity = super::arity_of(key).unwrap_or(0);
    out.extend_from_slice(&(arity as u32).to_le_bytes());
    out.extend_from_slice(key);
}

/// Encoded slots: `count` of them, each as key | i64 slot id | i64 start | i64 end | u32
/// length, accumulator bytes.
#[derive(Debug, Clone, Default)]
pub struct CapturedSlots {
    pub count: u64,
    pub bytes: Vec<u8>,
}

impl CapturedSlots {
    pub fn with_capacity(slots: usize, bytes: usize) -> CapturedSlots {
        CapturedSlots { count: 0, bytes: Vec::with_capacity(bytes.max(slots * 48)) }
    }

    #[inline]
    pub fn push(&mut self, key: &[u8], id: i64, window: Window, acc: &[u8]) {
        let out = &mut self.bytes;
        put_key(out, key);
        out.extend_from_slice(&id.to_le_bytes());
        out.extend_from_slice(&window.start.to_le_bytes());
        out.extend_from_slice(&window.end.to_le_bytes());
        out.extend_from_slice(&(acc.len() as u32).to_le_bytes());
        out.extend_from_slice(acc);
        self.count += 1;
    }
}

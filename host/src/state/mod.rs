//! Host-owned state: interned keys and one accumulator (opaque plugin bytes) per open
//! (key, window), plus the timer index that says which windows the watermark closes.
//!
//! Keeping accumulators as bytes in the host is what lets savepoints and plugin upgrades
//! work without ever reading a guest's memory.

pub mod captured;
mod key_hash;
mod key_index;
mod keys;
pub mod lock;
pub mod rocks;
pub mod saved;
mod slab;
mod slots;

pub use key_hash::short_eq;
use keys::bytes_of;
pub(crate) use keys::{append, Span};
pub use keys::{
    arity_of, fields_of, push_key_field, raw_fields_of, utf8_field, valid_key, KeyFields, KeySnapshot,
    KeyTable, RawKeyFields,
};
use slab::SlabSnapshot;
use slots::Entry;
pub(crate) use slots::PeriodMap;
pub use slots::{Acc, PeriodEntries, PeriodSlots, Slot, SlotHandle, Timer, TimerKind, WindowState, NO_SLOT};

use crate::time::Window;
use std::collections::BTreeMap;
use std::hash::BuildHasher;
use std::sync::Arc;

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

#[cfg(test)]
mod tests;

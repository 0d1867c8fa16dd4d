//! Windows: which slot of state an event belongs to, and which windows a slot feeds.
//!
//! A window is `[start, end)` in event-time milliseconds. Tumbling windows and sliding
//! windows are aligned to the epoch (`start = floor(t / step) * step`), as in Flink with
//! no offset, so every key's windows share boundaries and fire together. A sliding
//! window of `size` every `slide` is built from panes of `slide`: each event is added to
//! exactly one pane, and a window's result is the in-order merge of its `size / slide`
//! panes. A session holds a key's events while none is more than `gap` after the one
//! before it (seed 002: "gap > timeout → nueva sesión"): it covers `[first, last + gap]`,
//! which as a half-open window is `[first, last + gap + 1)`, so it fires once the watermark
//! has passed `last + gap` (an event at exactly `last + gap` still joins it), and two
//! sessions whose events are `gap` apart merge.
//!
//! [`operator`] runs the windows of one aggregation over host-owned state.

pub mod aggregator;
pub mod batch;
pub mod operator;
#[cfg(test)]
mod semantics_tests;

use crate::pipeline::WindowKind;
pub use crate::time::Window;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Assigner {
    Tumbling { size: i64 },
    Sliding { size: i64, slide: i64 },
    Session { gap: i64 },
}

impl Assigner {
    pub fn new(kind: WindowKind) -> Self {
        match kind {
            WindowKind::Tumbling { size_ms } => Assigner::Tumbling { size: size_ms },
            WindowKind::Sliding { size_ms, slide_ms } => Assigner::Sliding { size: size_ms, slide: slide_ms },
            WindowKind::Session { gap_ms } => Assigner::Session { gap: gap_ms },
        }
    }

    /// Whether slot ids are periods that every key shares (window or pane starts), not
    /// numbers of one key's sessions.
    pub fn periodic(&self) -> bool {
        !matches!(self, Assigner::Session { .. })
    }

    /// The slot an event at `t` starts from: its tumbling window, its sliding pane, or its
    /// own session `[t, t + gap]`, half-open `[t, t + gap + 1)`, before merging.
    #[inline]
    pub fn slot(&self, t: i64) -> Window {
        // Saturating: event times are checked against a range far from i64's limits,
        // and this stays total (no overflow, no endless window list) even if not.
        let aligned = |step: i64| {
            let start = t.div_euclid(step).saturating_mul(step);
            Window { start, end: start.saturating_add(step) }
        };
        match *self {
            Assigner::Tumbling { size } => aligned(size),
            Assigner::Sliding { slide, .. } => aligned(slide),
            Assigner::Session { gap } => Window { start: t, end: t.saturating_add(gap).saturating_add(1) },
        }
    }

    /// End of the last window a slot feeds: after the watermark passes it (and the
    /// allowed lateness), the slot is no longer needed.
    #[inline]
    pub fn last_end(&self, slot: Window) -> i64 {
        match *self {
            Assigner::Sliding { size, .. } => slot.start.saturating_add(size),
            _ => slot.end,
        }
    }

    /// Ends of the windows a slot feeds, earliest first.
    pub fn window_ends(&self, slot: Window) -> impl Iterator<Item = i64> {
        let (first, last, step) = match *self {
            Assigner::Sliding { size, slide } => (slot.end, slot.start.saturating_add(size), slide),
            _ => (slot.end, slot.end, 1),
        };
        std::iter::successors(Some(first), move |&e| e.checked_add(step)).take_while(move |&e| e <= last)
    }

    /// The window that ends at `end` (sliding windows are identified by their end).
    pub fn window_ending(&self, end: i64) -> Window {
        match *self {
            Assigner::Sliding { size, .. } | Assigner::Tumbling { size } => {
                Window { start: end.saturating_sub(size), end }
            }
            Assigner::Session { .. } => Window { start: end, end },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tumbling_is_epoch_aligned_including_negative_times() {
        let a = Assigner::Tumbling { size: 300_000 };
        assert_eq!(a.slot(1757844030000), Window { start: 1757844000000, end: 1757844300000 });
        assert_eq!(a.slot(1757844300000).start, 1757844300000);
        assert_eq!(a.slot(-1), Window { start: -300_000, end: 0 });
        assert_eq!(a.window_ends(a.slot(10)).collect::<Vec<_>>(), vec![300_000]);
    }

    #[test]
    fn sliding_panes_feed_size_over_slide_windows() {
        let a = Assigner::Sliding { size: 300, slide: 60 };
        let pane = a.slot(130);
        assert_eq!(pane, Window { start: 120, end: 180 });
        // Windows [-120,180), [-60,240), [0,300), [60,360), [120,420) contain t=130.
        assert_eq!(a.window_ends(pane).collect::<Vec<_>>(), vec![180, 240, 300, 360, 420]);
        assert_eq!(a.last_end(pane), 420);
        assert_eq!(a.window_ending(420), Window { start: 120, end: 420 });
    }

    #[test]
    fn extreme_times_give_finite_windows() {
        for a in [
            Assigner::Tumbling { size: 300_000 },
            Assigner::Sliding { size: 300_000, slide: 60_000 },
            Assigner::Session { gap: 180_000 },
        ] {
            for t in [i64::MIN, i64::MIN + 1, 9_223_372_036_854_600_000, i64::MAX] {
                let slot = a.slot(t);
                assert!(slot.start <= slot.end, "{a:?} {t}");
                assert!(a.window_ends(slot).count() <= 5, "{a:?} {t}");
            }
        }
    }

    #[test]
    fn sessions_overlap_and_union() {
        // Gap 180: an event 180 after another is in its session, 181 after is not.
        let a = Assigner::Session { gap: 180 };
        let s = a.slot(1000);
        assert_eq!(s, Window { start: 1000, end: 1181 });
        assert!(s.overlaps(&a.slot(1179)));
        assert!(s.overlaps(&a.slot(1180)));
        assert!(!s.overlaps(&a.slot(1181)));
        assert!(a.slot(820).overlaps(&s) && !a.slot(819).overlaps(&s));
        assert_eq!(s.union(&a.slot(1100)), Window { start: 1000, end: 1281 });
    }
}

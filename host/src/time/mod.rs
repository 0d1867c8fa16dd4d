//! Event time: the windows of event time that state is kept for, and watermarks derived
//! from the event times each partition has seen.

pub mod watermark;

pub use watermark::{Idleness, WatermarkState, Watermarks};

use serde::{Deserialize, Serialize};

/// A window of event time, `[start, end)` in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Window {
    pub start: i64,
    pub end: i64,
}

impl Window {
    /// Whether two windows overlap (sessions merge when they do).
    pub fn overlaps(&self, other: &Window) -> bool {
        self.start < other.end && other.start < self.end
    }

    pub fn union(&self, other: &Window) -> Window {
        Window { start: self.start.min(other.start), end: self.end.max(other.end) }
    }
}

//! Window assignment: which window an event time belongs to, and when a window is over.
//!
//! A window is `[start, end)` in event-time milliseconds. Tumbling windows are aligned to
//! the epoch (`start = floor(t / size) * size`), as in Flink with no offset, so every
//! key's windows share boundaries and fire together.

use crate::pipeline::WindowSpec;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Window {
    pub start: i64,
    pub end: i64,
}

#[derive(Debug, Clone, Copy)]
pub enum Assigner {
    Tumbling { size: i64 },
}

impl Assigner {
    pub fn new(spec: WindowSpec) -> Self {
        match spec {
            WindowSpec::Tumbling { size_ms } => Assigner::Tumbling { size: size_ms },
        }
    }

    /// The window of an event at time `t`.
    #[inline]
    pub fn assign(&self, t: i64) -> Window {
        match *self {
            Assigner::Tumbling { size } => {
                let start = t.div_euclid(size) * size;
                Window { start, end: start.saturating_add(size) }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tumbling_is_epoch_aligned_including_negative_times() {
        let a = Assigner::Tumbling { size: 300_000 };
        assert_eq!(a.assign(1757844030000), Window { start: 1757844000000, end: 1757844300000 });
        assert_eq!(a.assign(1757844300000).start, 1757844300000);
        assert_eq!(a.assign(-1), Window { start: -300_000, end: 0 });
    }
}

//! Bounded-out-of-orderness watermarks.
//!
//! The watermark is the claim "no more events with event time < W are expected":
//! `W = max event time seen - delay`. It only moves forward, and a late event (older
//! than W) does not move it. A window `[start, end)` fires when `W >= end`.

use serde::{Deserialize, Serialize};

/// No event seen yet: nothing can be late and nothing fires.
pub const MIN: i64 = i64::MIN;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Watermark {
    delay_ms: i64,
    /// Largest event time seen, if any.
    max_event_time: Option<i64>,
}

impl Watermark {
    pub fn new(delay_ms: i64) -> Self {
        Watermark { delay_ms, max_event_time: None }
    }

    /// Resume from a savepoint's state, possibly with a new delay: the watermark never
    /// goes back, so a larger delay keeps the old watermark until events pass it.
    pub fn restore(delay_ms: i64, max_event_time: Option<i64>, previous: i64) -> Self {
        let mut w = Watermark { delay_ms, max_event_time };
        if w.current() < previous {
            // Keep monotonicity: pretend we saw the event that produced `previous`.
            w.max_event_time = Some(previous.saturating_add(delay_ms));
        }
        w
    }

    /// The current watermark ([`MIN`] before the first event).
    #[inline]
    pub fn current(&self) -> i64 {
        match self.max_event_time {
            Some(t) => t.saturating_sub(self.delay_ms),
            None => MIN,
        }
    }

    pub fn max_event_time(&self) -> Option<i64> {
        self.max_event_time
    }

    /// Observe an accepted event's time; returns the (possibly advanced) watermark.
    #[inline]
    pub fn observe(&mut self, event_time: i64) -> i64 {
        if self.max_event_time.is_none_or(|m| event_time > m) {
            self.max_event_time = Some(event_time);
        }
        self.current()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advances_with_max_minus_delay_and_never_back() {
        let mut w = Watermark::new(120_000);
        assert_eq!(w.current(), MIN);
        assert_eq!(w.observe(600_000), 480_000);
        assert_eq!(w.observe(300_000), 480_000); // an older event does not move it
        assert_eq!(w.observe(700_000), 580_000);
    }

    #[test]
    fn restore_with_a_larger_delay_keeps_the_watermark() {
        let w = Watermark::restore(300_000, Some(700_000), 580_000);
        assert_eq!(w.current(), 580_000);
        let w = Watermark::restore(60_000, Some(700_000), 580_000);
        assert_eq!(w.current(), 640_000);
    }
}

//! Watermarks: per partition, bounded out-of-orderness; for the operator, the minimum
//! over the partitions that are not idle.
//!
//! A partition's watermark is `max event time seen - delay`: the claim that no more of
//! its events older than that are expected. The operator's watermark is the minimum over
//! active partitions, so a partition that lags holds every window back; a partition with
//! no records for the idle timeout (processing time, or a number of records of the other
//! partitions, which keeps bounded replays deterministic) stops counting until it
//! produces again, and a partition whose input has ended stops counting for good. The
//! operator's watermark never goes back: a partition that rejoins behind it cannot pull
//! it down, and a late event moves nothing. A window `[start, end)` fires when the
//! watermark reaches `end`.

use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant};

/// No event seen yet: nothing can be late and nothing fires.
pub const MIN: i64 = i64::MIN;

/// Processing-time idleness is re-evaluated at most this often while records flow (and
/// by [`Watermarks::tick`] while the source has nothing), so a partition goes idle within
/// its timeout plus this much.
const IDLE_CHECK_MAX: Duration = Duration::from_millis(100);

/// One partition's clock.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionClock {
    pub name: String,
    pub max_event_time: Option<i64>,
    pub idle: bool,
    pub finished: bool,
    /// Source record count at this partition's last record.
    #[serde(default)]
    pub last_record: u64,
    #[serde(skip)]
    last_seen: Option<Instant>,
}

impl PartitionClock {
    fn watermark(&self, delay: i64) -> i64 {
        self.max_event_time.map_or(MIN, |t| t.saturating_sub(delay))
    }
}

/// Saved form of [`Watermarks`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WatermarkState {
    pub current: i64,
    pub partitions: Vec<PartitionClock>,
}

/// Idleness rules.
#[derive(Debug, Clone, Copy, Default)]
pub struct Idleness {
    pub timeout: Option<Duration>,
    pub after_records: Option<u64>,
}

#[derive(Debug, Clone)]
pub struct Watermarks {
    delay: i64,
    idleness: Idleness,
    partitions: Vec<PartitionClock>,
    current: i64,
    records: u64,
    /// When processing-time idleness is next looked at.
    next_idle_check: Option<Instant>,
}

impl Watermarks {
    pub fn new(delay_ms: i64, idleness: Idleness) -> Self {
        Watermarks {
            delay: delay_ms,
            idleness,
            partitions: Vec::new(),
            current: MIN,
            records: 0,
            next_idle_check: None,
        }
    }

    /// Resume from saved clocks, possibly with another delay; never below the saved value.
    /// Processing-time idleness counts from the restore: a partition that stays silent
    /// goes idle one timeout after it (as after a fresh start).
    pub fn restore(delay_ms: i64, idleness: Idleness, saved: &WatermarkState) -> Self {
        let mut w = Watermarks::new(delay_ms, idleness);
        w.partitions = saved.partitions.clone();
        let now = Instant::now();
        for p in &mut w.partitions {
            p.last_seen = Some(now);
        }
        w.records = saved.partitions.iter().map(|p| p.last_record).max().unwrap_or(0);
        w.current = saved.current;
        w
    }

    pub fn save(&self) -> WatermarkState {
        WatermarkState { current: self.current, partitions: self.partitions.clone() }
    }

    /// The operator's watermark ([`MIN`] before the first event).
    #[inline]
    pub fn current(&self) -> i64 {
        self.current
    }

    /// Index of a partition, if it is known.
    #[inline]
    pub fn find(&self, name: &str) -> Option<usize> {
        self.partitions.iter().position(|p| p.name == name)
    }

    /// Index of a partition, registering it on first sight.
    pub fn partition(&mut self, name: &str) -> usize {
        if let Some(i) = self.find(name) {
            return i;
        }
        self.partitions.push(PartitionClock {
            name: name.to_string(),
            max_event_time: None,
            idle: false,
            finished: false,
            last_record: self.records,
            last_seen: Some(Instant::now()),
        });
        self.partitions.len() - 1
    }

    pub fn partitions(&self) -> &[PartitionClock] {
        &self.partitions
    }

    /// A record of partition `p` arrived (any record, even one that is not an event):
    /// the partition is active again. Returns the watermark.
    #[inline]
    pub fn on_record(&mut self, p: usize) -> i64 {
        self.records += 1;
        let part = &mut self.partitions[p];
        part.last_record = self.records;
        if part.idle {
            part.idle = false;
            self.recompute();
        }
        // Without idleness rules that can apply (most jobs), nothing more a record.
        if self.idleness.timeout.is_some()
            || (self.idleness.after_records.is_some() && self.partitions.len() > 1)
        {
            self.watch_idleness(p);
        }
        self.current
    }

    /// The idleness rules after a record of partition `p`: record-count idleness is exact
    /// (deterministic replays); processing-time idleness is looked at every
    /// [`IDLE_CHECK_MAX`] at most.
    fn watch_idleness(&mut self, p: usize) {
        let now = self.idleness.timeout.map(|_| Instant::now());
        if now.is_some() {
            self.partitions[p].last_seen = now;
        }
        let by_records = self.idleness.after_records.is_some() && self.partitions.len() > 1;
        let by_time = matches!((now, self.next_idle_check), (Some(n), Some(next)) if n >= next)
            || (now.is_some() && self.next_idle_check.is_none());
        if by_records || by_time {
            self.check_idle();
        }
    }

    /// Processing time passes with no record (the source has nothing): look at
    /// processing-time idleness. Returns the watermark.
    pub fn tick(&mut self) -> i64 {
        if self.idleness.timeout.is_some() {
            self.check_idle();
        }
        self.current
    }

    /// An accepted event of partition `p` at `t`. Returns the watermark.
    #[inline]
    pub fn observe(&mut self, p: usize, t: i64) -> i64 {
        let part = &mut self.partitions[p];
        if part.max_event_time.is_none_or(|m| t > m) {
            let was = part.watermark(self.delay);
            part.max_event_time = Some(t);
            // Only a partition at the minimum can move the minimum.
            if was <= self.current || self.partitions.len() == 1 {
                self.recompute();
            }
        }
        self.current
    }

    /// Partition `p`'s input ended: it no longer holds the watermark back.
    pub fn finish(&mut self, p: usize) -> i64 {
        self.partitions[p].finished = true;
        self.recompute();
        self.current
    }

    /// Mark partitions idle by the configured rules. Returns the watermark.
    pub fn check_idle(&mut self) -> i64 {
        let now = self.idleness.timeout.map(|_| Instant::now());
        if let (Some(n), Some(t)) = (now, self.idleness.timeout) {
            self.next_idle_check = Some(n + (t / 4).min(IDLE_CHECK_MAX));
        }
        let mut changed = false;
        for part in self.partitions.iter_mut().filter(|p| !p.idle && !p.finished) {
            let by_records = self.idleness.after_records.is_some_and(|n| self.records - part.last_record > n);
            let by_time = match (self.idleness.timeout, now, part.last_seen) {
                (Some(t), Some(now), Some(seen)) => now.duration_since(seen) > t,
                _ => false,
            };
            if by_records || by_time {
                part.idle = true;
                changed = true;
            }
        }
        if changed {
            self.recompute();
        }
        self.current
    }

    fn recompute(&mut self) {
        let min =
            self.partitions.iter().filter(|p| !p.idle && !p.finished).map(|p| p.watermark(self.delay)).min();
        // With every partition idle or finished, the watermark waits (as in Flink).
        if let Some(m) = min {
            self.current = self.current.max(m);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one() -> (Watermarks, usize) {
        let mut w = Watermarks::new(120_000, Idleness::default());
        let p = w.partition("0");
        (w, p)
    }

    #[test]
    fn advances_with_max_minus_delay_and_never_back() {
        let (mut w, p) = one();
        assert_eq!(w.current(), MIN);
        assert_eq!(w.observe(p, 600_000), 480_000);
        assert_eq!(w.observe(p, 300_000), 480_000); // an older event does not move it
        assert_eq!(w.observe(p, 700_000), 580_000);
    }

    #[test]
    fn minimum_over_partitions_and_idle_timeout_in_records() {
        let mut w = Watermarks::new(0, Idleness { timeout: None, after_records: Some(100) });
        let a = w.partition("a");
        let b = w.partition("b");
        w.on_record(a);
        w.observe(a, 1_000);
        assert_eq!(w.current(), MIN, "b has produced nothing: it holds the watermark");
        w.on_record(b);
        w.observe(b, 500);
        assert_eq!(w.current(), 500);
        for i in 0..200 {
            w.on_record(a);
            w.observe(a, 2_000 + i);
        }
        assert_eq!(w.current(), 2_199, "b went idle after 100 records of a");
        // b rejoins behind: it is active again but cannot pull the watermark back.
        w.on_record(b);
        w.observe(b, 600);
        assert_eq!(w.current(), 2_199);
        w.on_record(b);
        w.observe(b, 3_000);
        w.on_record(a);
        w.observe(a, 2_500);
        assert_eq!(w.current(), 2_500);
        w.finish(a);
        assert_eq!(w.current(), 3_000);
    }

    #[test]
    fn a_silent_partition_goes_idle_on_time_with_few_records_and_after_a_restore() {
        let idle = Idleness { timeout: Some(Duration::from_millis(200)), after_records: None };
        let mut w = Watermarks::new(0, idle);
        let a = w.partition("a");
        let b = w.partition("b");
        w.on_record(b);
        w.observe(b, 100);
        // a speaks rarely: 3 records over ~0.45 s; b is silent after its first record.
        for i in 0..3 {
            w.on_record(a);
            w.observe(a, 1_000 + i);
            std::thread::sleep(Duration::from_millis(150));
        }
        w.on_record(a);
        assert_eq!(w.observe(a, 2_000), 2_000, "b has been silent for over 200 ms: it is idle");
        // With no record at all, a tick finds b idle while a is not (yet).
        let idle3 = Idleness { timeout: Some(Duration::from_millis(300)), after_records: None };
        let mut r = Watermarks::new(0, idle3);
        let a = r.partition("a");
        let b = r.partition("b");
        r.on_record(b);
        r.observe(b, 100);
        std::thread::sleep(Duration::from_millis(200));
        r.on_record(a);
        r.observe(a, 3_000);
        assert_eq!(r.current(), 100);
        std::thread::sleep(Duration::from_millis(150));
        assert_eq!(r.tick(), 3_000, "b silent 350 ms, a 150 ms");
        let mut saved = w.save();
        saved.partitions[1].idle = false;
        let mut r = Watermarks::restore(0, idle, &saved);
        std::thread::sleep(Duration::from_millis(250));
        r.tick();
        assert!(r.partitions()[1].idle, "restored clocks have a last-seen time");
    }

    #[test]
    fn restore_keeps_the_watermark() {
        let (mut w, p) = one();
        w.observe(p, 700_000);
        let saved = w.save();
        let r = Watermarks::restore(300_000, Idleness::default(), &saved);
        assert_eq!(r.current(), 580_000);
    }
}

//! Poison keys: the plugin's faults counted by key. A key whose events or windows the
//! plugin failed on `after` times in a row (a call of its own that succeeds forgets its
//! faults) is quarantined: its later events go straight to the
//! dead letters, without a call, until a deploy or an operator releases it. Until then a
//! key that faulted (a suspect) is called apart from the rest of its batch, so that it
//! does not make the batch fail (and pay the fault twice) again.
//!
//! Faults are counted by the key's id in the operator's key table: a key with faults stays
//! interned. Checkpoints and savepoints keep the faults of the plugin they were taken
//! with; a restore with another plugin (a deploy) starts with none.

use super::*;
use serde::{Deserialize, Serialize};

pub use crate::pipeline::DEFAULT_QUARANTINE_AFTER;

/// Quarantined keys the status lists per aggregation (all are counted).
pub const QUARANTINE_LISTED: usize = 100;

/// A key's faults, as checkpoints and the status hold them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyFaults {
    /// The key's fields.
    pub key: Vec<String>,
    pub faults: u32,
    /// Its events go to the dead letters without a call.
    pub quarantined: bool,
    /// The last fault's reason.
    pub reason: String,
    /// When it was quarantined (epoch ms), or faulted last.
    pub at_ms: i64,
}

#[derive(Debug, Clone)]
struct Faults {
    faults: u32,
    quarantined: bool,
    reason: String,
    at_ms: i64,
}

/// The faults of an operator's keys.
#[derive(Debug, Default)]
pub(super) struct Quarantine {
    /// Faults that quarantine a key (0: never).
    after: u32,
    keys: FastMap<u32, Faults>,
    /// How many of `keys` are quarantined.
    held: usize,
    /// When a quarantine was last logged, and how many were not since (a plugin that
    /// fails on every key would write a line per key).
    logged: Option<(std::time::Instant, u64)>,
}

/// How often a quarantine is logged (the ones in between are counted).
const LOG_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

impl Quarantine {
    pub(super) fn new(after: u32) -> Quarantine {
        Quarantine { after, ..Quarantine::default() }
    }

    /// Whether any key faulted (then batches look for suspects).
    #[inline(always)]
    pub(super) fn any(&self) -> bool {
        !self.keys.is_empty()
    }

    /// Whether key `k` is quarantined (checked for every event: one load when none is).
    #[inline(always)]
    pub(super) fn holds(&self, k: u32) -> bool {
        self.held > 0 && self.keys.get(&k).is_some_and(|f| f.quarantined)
    }

    /// Whether key `k` faulted before (quarantined or not).
    pub(super) fn faulted(&self, k: u32) -> bool {
        self.keys.contains_key(&k)
    }

    /// The plugin failed on key `k`; true when that quarantines it.
    pub(super) fn fault(&mut self, k: u32, reason: &str) -> bool {
        let f = self.keys.entry(k).or_insert(Faults {
            faults: 0,
            quarantined: false,
            reason: String::new(),
            at_ms: 0,
        });
        f.faults = f.faults.saturating_add(1);
        f.reason = reason.to_string();
        f.at_ms = crate::metrics::now_ms();
        if !f.quarantined && self.after > 0 && f.faults >= self.after {
            f.quarantined = true;
            self.held += 1;
            return true;
        }
        false
    }

    /// The reason a quarantined key's events are dead-lettered.
    pub(super) fn reason(&self, k: u32) -> String {
        match self.keys.get(&k) {
            Some(f) => {
                format!("quarantined: the plugin failed on this key {} times (last: {})", f.faults, f.reason)
            }
            None => "quarantined".into(),
        }
    }

    /// Keys with faults (they stay interned).
    pub(super) fn key_ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.keys.keys().copied()
    }

    pub(super) fn quarantined(&self) -> usize {
        self.held
    }

    /// Forget every key's faults (a new plugin); returns how many keys were quarantined.
    pub(super) fn clear(&mut self) -> usize {
        self.keys.clear();
        std::mem::take(&mut self.held)
    }

    /// A call of key `k`'s alone succeeded: a suspect's faults are forgotten (faults count
    /// in a row).
    pub(super) fn passed(&mut self, k: u32) {
        if self.keys.get(&k).is_some_and(|f| !f.quarantined) {
            self.keys.remove(&k);
        }
    }

    /// Forget key `k`'s faults; whether it was quarantined.
    pub(super) fn release(&mut self, k: u32) -> bool {
        match self.keys.remove(&k) {
            Some(f) if f.quarantined => {
                self.held -= 1;
                true
            }
            _ => false,
        }
    }

    fn entry(&self, keys: &KeyTable, k: u32, f: &Faults) -> KeyFaults {
        KeyFaults {
            key: keys.raw_fields(k).map(|b| String::from_utf8_lossy(b).into_owned()).collect(),
            faults: f.faults,
            quarantined: f.quarantined,
            reason: f.reason.clone(),
            at_ms: f.at_ms,
        }
    }

    /// Every key's faults, in key order (checkpoints).
    pub(super) fn saved(&self, keys: &KeyTable) -> Vec<KeyFaults> {
        let mut out: Vec<KeyFaults> = self.keys.iter().map(|(&k, f)| self.entry(keys, k, f)).collect();
        out.sort_by(|a, b| a.key.cmp(&b.key));
        out
    }

    /// Up to `n` quarantined keys, the latest first (the status).
    pub(super) fn listed(&self, keys: &KeyTable, n: usize) -> Vec<KeyFaults> {
        if self.held == 0 || n == 0 {
            return Vec::new();
        }
        let mut out: Vec<KeyFaults> =
            self.keys.iter().filter(|(_, f)| f.quarantined).map(|(&k, f)| self.entry(keys, k, f)).collect();
        out.sort_by(|a, b| b.at_ms.cmp(&a.at_ms).then_with(|| a.key.cmp(&b.key)));
        out.truncate(n);
        out
    }

    /// Take a saved key's faults (interned as `k`).
    pub(super) fn restore(&mut self, k: u32, saved: &KeyFaults) {
        let quarantined = saved.quarantined;
        let old = self.keys.insert(
            k,
            Faults { faults: saved.faults, quarantined, reason: saved.reason.clone(), at_ms: saved.at_ms },
        );
        if old.is_some_and(|o| o.quarantined) {
            self.held -= 1;
        }
        if quarantined {
            self.held += 1;
        }
    }
}

impl WindowOperator {
    /// Quarantine a key after `after` faults (0: never).
    pub fn set_quarantine_after(&mut self, after: u32) {
        self.quarantine.after = after;
    }

    /// Dead-letter events of key `k` (or its window's result, `event_times` empty) that
    /// the plugin failed on, and count the fault against the key.
    pub(super) fn reject(&mut self, k: u32, window: Window, event_times: Vec<i64>, reason: String) {
        let key = self.key_text(k);
        self.faulted_units += event_times.len().max(1) as u64;
        self.faulted_windows += event_times.is_empty() as u64;
        if !event_times.is_empty() {
            self.taint(k, window, false);
        }
        if self.quarantine.fault(k, &reason) {
            let now = std::time::Instant::now();
            match &mut self.quarantine.logged {
                Some((at, skipped)) if now.duration_since(*at) < LOG_EVERY => *skipped += 1,
                logged => {
                    let not_logged = logged.map_or(0, |(_, n)| n);
                    tracing::warn!(
                        aggregation = %self.name,
                        key = %key.escape_debug(),
                        reason = %reason.escape_debug(),
                        quarantined = self.quarantine.held,
                        not_logged,
                        "key quarantined"
                    );
                    *logged = Some((now, 0));
                }
            }
        }
        self.rejected.push(Rejected { key, window, event_times, reason });
        if self.deploy_watch.is_some() {
            self.judge_deploy();
        }
    }

    /// Why the events of encoded key `key` go to the dead letters (it is quarantined).
    pub fn quarantine_reason(&self, key: &[u8]) -> String {
        match self.keys.get(key) {
            Some(k) => self.quarantine.reason(k),
            None => "quarantined".into(),
        }
    }

    /// Quarantined keys: how many, and up to `n` of them, the latest first.
    pub fn quarantined(&self, n: usize) -> (usize, Vec<KeyFaults>) {
        (self.quarantine.quarantined(), self.quarantine.listed(&self.keys, n))
    }

    /// Every key's faults, for checkpoints.
    pub fn saved_faults(&self) -> Vec<KeyFaults> {
        self.quarantine.saved(&self.keys)
    }

    /// Take the faults a checkpoint of the same plugin saved.
    pub fn restore_faults(&mut self, saved: &[KeyFaults]) {
        for f in saved {
            let mut encoded = Vec::new();
            for field in &f.key {
                crate::state::push_key_field(&mut encoded, field.as_bytes());
            }
            if !crate::state::valid_key(&encoded) {
                continue;
            }
            let k = self.keys.intern(&encoded);
            self.quarantine.restore(k, f);
        }
    }

    /// Release quarantined keys: the one whose fields are `key`, or all (None). Returns
    /// how many were released; their faults are forgotten.
    pub fn release(&mut self, key: Option<&[String]>) -> usize {
        match key {
            None => self.quarantine.clear(),
            Some(fields) => {
                let mut encoded = Vec::new();
                for field in fields {
                    crate::state::push_key_field(&mut encoded, field.as_bytes());
                }
                match self.keys.get(&encoded) {
                    Some(k) => self.quarantine.release(k) as usize,
                    None => 0,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_is_quarantined_at_its_nth_fault_and_released_by_hand() {
        let mut q = Quarantine::new(3);
        assert!(!q.any() && !q.holds(7));
        assert!(!q.fault(7, "a"));
        assert!(q.faulted(7) && !q.holds(7));
        assert!(!q.fault(7, "b"));
        assert!(q.fault(7, "c"), "the third fault quarantines");
        assert!(q.holds(7) && q.faulted(7));
        assert!(!q.fault(7, "d"), "quarantined once");
        assert_eq!(q.quarantined(), 1);
        assert!(q.reason(7).contains("4 times (last: d)"), "{}", q.reason(7));
        assert!(q.release(7));
        assert!(!q.holds(7) && !q.any() && q.quarantined() == 0);
        // Faults count in a row: a call of its own that succeeds forgets them.
        assert!(!q.fault(8, "a") && !q.fault(8, "b"));
        q.passed(8);
        assert!(!q.faulted(8));
        assert!(!q.fault(8, "c") && !q.fault(8, "d") && q.fault(8, "e"));
        q.passed(8);
        assert!(q.holds(8), "a quarantined key stays quarantined");
        let mut never = Quarantine::new(0);
        for _ in 0..10 {
            assert!(!never.fault(1, "x"));
        }
        assert!(never.faulted(1) && !never.holds(1));
    }
}

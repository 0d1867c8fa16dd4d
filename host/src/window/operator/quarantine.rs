//! Poison keys: the plugin's faults counted by key. A key whose events or windows the
//! plugin failed on `after` times in a row (a call of its own that succeeds forgets its
//! faults) is quarantined: its later events go straight to the
//! dead letters, without a call, until a deploy or an operator releases it. Until then a
//! key that faulted (a suspect) is called apart from the rest of its batch, so that it
//! does not make the batch fail (and pay the fault twice) again.
//!
//! Faults are counted by the key's id in the operator's key table: a key with faults stays
//! interned. The set is bounded: at most `max_keys` keys are followed (a fault of another
//! key once it is full is dead-lettered as always, and counted as untracked), and each
//! key's reason is one of at most [`REASONS_KEPT`] texts of at most [`REASON_BYTES`].
//! Checkpoints and savepoints keep the set of the plugin they were taken with (a restore
//! with another plugin, a deploy, starts with none), captured as it is and encoded on the
//! writer's thread; a set that has not changed since the last snapshot is not captured
//! or encoded again.

use super::*;
use serde::{Deserialize, Serialize};
use std::sync::{Arc, OnceLock};

pub use crate::pipeline::{DEFAULT_QUARANTINE_AFTER, DEFAULT_QUARANTINE_MAX_KEYS};

/// Quarantined keys the status lists per aggregation (all are counted).
pub const QUARANTINE_LISTED: usize = 100;

/// Distinct fault reasons kept per aggregation (a key whose reason is new once they are
/// all taken keeps a note that says so; each event's own reason is in its dead letter).
pub const REASONS_KEPT: usize = 1024;

/// Bytes of a fault reason kept for a key (cut at a character boundary).
pub const REASON_BYTES: usize = 256;

/// A key's faults, as the status lists them.
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

/// A key's faults as the set holds them (the reason: an index into its texts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Faults {
    faults: u32,
    reason: u32,
    at_ms: i64,
    quarantined: bool,
}

/// The reason of a key whose own did not fit in the texts kept.
const REASON_NOT_KEPT: u32 = u32::MAX;
const NOT_KEPT_TEXT: &str =
    "(not kept: the plugin failed with more distinct reasons than are kept per aggregation; \
                             each event's reason is in its dead letter)";

/// The distinct fault reasons of an operator's keys (a plugin that fails on many keys
/// mostly fails for a few reasons).
#[derive(Debug, Default, Clone)]
struct Reasons {
    texts: Vec<Arc<str>>,
    index: HashMap<Arc<str>, u32>,
}

impl Reasons {
    fn id(&mut self, reason: &str) -> u32 {
        let reason = cut(reason, REASON_BYTES);
        if let Some(&id) = self.index.get(reason) {
            return id;
        }
        if self.texts.len() >= REASONS_KEPT {
            return REASON_NOT_KEPT;
        }
        let text: Arc<str> = Arc::from(reason);
        let id = self.texts.len() as u32;
        self.texts.push(text.clone());
        self.index.insert(text, id);
        id
    }

    fn text(&self, id: u32) -> &str {
        self.texts.get(id as usize).map_or(NOT_KEPT_TEXT, |t| t)
    }
}

/// `text` cut to at most `max` bytes, at a character boundary.
fn cut(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// The faults of an operator's keys.
#[derive(Debug)]
pub(super) struct Quarantine {
    /// Faults that quarantine a key (0: never).
    after: u32,
    /// Keys followed at most.
    max_keys: usize,
    keys: FastMap<u32, Faults>,
    reasons: Reasons,
    /// How many of `keys` are quarantined.
    held: usize,
    /// Faults of keys not followed: the set was full.
    untracked: u64,
    /// Changes made (a snapshot of an unchanged set is the last one's).
    changes: u64,
    saved: Option<(u64, SavedFaults)>,
    /// When a quarantine was last logged, and how many were not since (a plugin that
    /// fails on every key would write a line per key).
    logged: Option<(std::time::Instant, u64)>,
    /// When a fault the full set could not follow was last logged.
    full_logged: Option<std::time::Instant>,
}

impl Default for Quarantine {
    fn default() -> Quarantine {
        Quarantine::new(DEFAULT_QUARANTINE_AFTER)
    }
}

/// How often a quarantine is logged (the ones in between are counted).
const LOG_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

impl Quarantine {
    pub(super) fn new(after: u32) -> Quarantine {
        Quarantine {
            after,
            max_keys: DEFAULT_QUARANTINE_MAX_KEYS,
            keys: FastMap::default(),
            reasons: Reasons::default(),
            held: 0,
            untracked: 0,
            changes: 0,
            saved: None,
            logged: None,
            full_logged: None,
        }
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

    /// The plugin failed on key `k`; true when that quarantines it. A key not followed
    /// yet, once the set holds `max_keys`, is counted as untracked.
    pub(super) fn fault(&mut self, k: u32, reason: &str) -> bool {
        self.changes += 1;
        if !self.keys.contains_key(&k) && self.keys.len() >= self.max_keys {
            self.untracked += 1;
            return false;
        }
        let reason = self.reasons.id(reason);
        let f = self.keys.entry(k).or_insert(Faults { faults: 0, reason, at_ms: 0, quarantined: false });
        f.faults = f.faults.saturating_add(1);
        f.reason = reason;
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
            Some(f) => format!(
                "quarantined: the plugin failed on this key {} times (last: {})",
                f.faults,
                self.reasons.text(f.reason)
            ),
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

    /// Keys followed (quarantined or suspect), and the faults of keys the full set could
    /// not follow.
    pub(super) fn followed(&self) -> (usize, u64) {
        (self.keys.len(), self.untracked)
    }

    /// Forget every key's faults (a new plugin); returns how many keys were quarantined.
    pub(super) fn clear(&mut self) -> usize {
        self.changes += 1;
        self.keys.clear();
        self.reasons = Reasons::default();
        self.untracked = 0;
        std::mem::take(&mut self.held)
    }

    /// A call of key `k`'s alone succeeded: a suspect's faults are forgotten (faults count
    /// in a row).
    pub(super) fn passed(&mut self, k: u32) {
        if self.keys.get(&k).is_some_and(|f| !f.quarantined) {
            self.changes += 1;
            self.keys.remove(&k);
        }
    }

    /// Forget key `k`'s faults; whether it was quarantined.
    pub(super) fn release(&mut self, k: u32) -> bool {
        self.changes += 1;
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
            reason: self.reasons.text(f.reason).to_string(),
            at_ms: f.at_ms,
        }
    }

    /// The set as a snapshot holds it: the last one's when nothing changed since.
    pub(super) fn saved(&mut self, keys: &KeyTable) -> SavedFaults {
        if let Some((at, saved)) = &self.saved {
            if *at == self.changes {
                return saved.clone();
            }
        }
        let mut bytes = Vec::with_capacity(self.keys.len() * 24);
        let mut entries = Vec::with_capacity(self.keys.len());
        for (&k, f) in &self.keys {
            bytes.extend_from_slice(keys.encoded(k));
            entries.push((bytes.len() as u32, *f));
        }
        let saved = SavedFaults(Arc::new(SavedSet {
            untracked: self.untracked,
            reasons: self.reasons.texts.clone(),
            keys: bytes,
            entries,
            json: OnceLock::new(),
        }));
        self.saved = Some((self.changes, saved.clone()));
        saved
    }

    /// Up to `n` quarantined keys, the latest first (the status).
    pub(super) fn listed(&self, keys: &KeyTable, n: usize) -> Vec<KeyFaults> {
        if self.held == 0 || n == 0 {
            return Vec::new();
        }
        // The latest n chosen by time and id before any text is made.
        let mut latest: Vec<(std::cmp::Reverse<i64>, u32)> = self
            .keys
            .iter()
            .filter(|(_, f)| f.quarantined)
            .map(|(&k, f)| (std::cmp::Reverse(f.at_ms), k))
            .collect();
        if latest.len() > n {
            latest.select_nth_unstable(n - 1);
            latest.truncate(n);
        }
        let mut out: Vec<KeyFaults> =
            latest.iter().filter_map(|&(_, k)| Some(self.entry(keys, k, self.keys.get(&k)?))).collect();
        out.sort_by(|a, b| b.at_ms.cmp(&a.at_ms).then_with(|| a.key.cmp(&b.key)));
        out
    }

    /// Take a saved key's faults (interned as `k`); false when the set is full.
    fn restore(&mut self, k: u32, faults: u32, quarantined: bool, reason: &str, at_ms: i64) -> bool {
        if !self.keys.contains_key(&k) && self.keys.len() >= self.max_keys {
            return false;
        }
        self.changes += 1;
        let reason = self.reasons.id(reason);
        let old = self.keys.insert(k, Faults { faults, reason, at_ms, quarantined });
        if old.is_some_and(|o| o.quarantined) {
            self.held -= 1;
        }
        if quarantined {
            self.held += 1;
        }
        true
    }
}

/// The faults of an operator's keys as a checkpoint or savepoint holds them (shared with
/// the set while it does not change; encoded once, on the writer's thread).
#[derive(Debug, Clone, Default)]
pub struct SavedFaults(Arc<SavedSet>);

#[derive(Debug, Default)]
struct SavedSet {
    untracked: u64,
    reasons: Vec<Arc<str>>,
    /// The keys, encoded, one after another.
    keys: Vec<u8>,
    /// Each key's end in `keys`, and its faults.
    entries: Vec<(u32, Faults)>,
    json: OnceLock<Box<serde_json::value::RawValue>>,
}

/// A saved key: its fields, faults, whether it is quarantined, its reason (an index into
/// `reasons`, none: not kept) and when it faulted last (epoch ms).
type SavedKey = (Vec<String>, u32, bool, Option<u32>, i64);

/// The form in savepoint.json.
#[derive(Serialize, Deserialize)]
struct SavedForm {
    #[serde(default)]
    untracked: u64,
    reasons: Vec<String>,
    keys: Vec<SavedKey>,
}

impl SavedFaults {
    pub fn is_empty(&self) -> bool {
        self.0.entries.is_empty() && self.0.untracked == 0
    }

    /// Keys followed.
    pub fn len(&self) -> usize {
        self.0.entries.len()
    }

    /// Each key: encoded, and its faults.
    fn each(&self) -> impl Iterator<Item = (&[u8], &Faults)> + '_ {
        let mut start = 0usize;
        self.0.entries.iter().map(move |(end, f)| {
            let key = self.0.keys.get(start..*end as usize).unwrap_or_default();
            start = *end as usize;
            (key, f)
        })
    }

    fn reason(&self, id: u32) -> &str {
        self.0.reasons.get(id as usize).map_or(NOT_KEPT_TEXT, |t| t)
    }

    fn form(&self) -> SavedForm {
        SavedForm {
            untracked: self.0.untracked,
            reasons: self.0.reasons.iter().map(|r| r.to_string()).collect(),
            keys: self
                .each()
                .map(|(key, f)| {
                    let fields = crate::state::raw_fields_of(key)
                        .map(|b| String::from_utf8_lossy(b).into_owned())
                        .collect();
                    let reason = (f.reason != REASON_NOT_KEPT).then_some(f.reason);
                    (fields, f.faults, f.quarantined, reason, f.at_ms)
                })
                .collect(),
        }
    }

    /// The set of the faults of km0 before this form: a list of keys with their reasons.
    pub fn from_listed(listed: &[KeyFaults]) -> SavedFaults {
        let mut reasons = Reasons::default();
        let mut set = SavedSet::default();
        for f in listed {
            let reason = reasons.id(&f.reason);
            push_key(
                &mut set,
                &f.key,
                Faults { faults: f.faults, reason, at_ms: f.at_ms, quarantined: f.quarantined },
            );
        }
        set.reasons = reasons.texts;
        SavedFaults(Arc::new(set))
    }
}

fn push_key(set: &mut SavedSet, fields: &[String], f: Faults) {
    let start = set.keys.len();
    for field in fields {
        crate::state::push_key_field(&mut set.keys, field.as_bytes());
    }
    if crate::state::valid_key(&set.keys[start..]) {
        set.entries.push((set.keys.len() as u32, f));
    } else {
        set.keys.truncate(start);
    }
}

impl PartialEq for SavedFaults {
    fn eq(&self, other: &Self) -> bool {
        let (a, b) = (&*self.0, &*other.0);
        a.untracked == b.untracked && a.reasons == b.reasons && a.keys == b.keys && a.entries == b.entries
    }
}

impl Eq for SavedFaults {}

impl Serialize for SavedFaults {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        // Compact (one line however the file around it is laid out), and encoded once
        // however many snapshots hold it.
        if let Some(json) = self.0.json.get() {
            return json.serialize(s);
        }
        let json = serde_json::to_string(&self.form())
            .and_then(serde_json::value::RawValue::from_string)
            .map_err(serde::ser::Error::custom)?;
        self.0.json.get_or_init(|| json).serialize(s)
    }
}

impl<'de> Deserialize<'de> for SavedFaults {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let form = SavedForm::deserialize(d)?;
        let mut set = SavedSet {
            untracked: form.untracked,
            reasons: form.reasons.iter().map(|r| Arc::from(cut(r, REASON_BYTES))).collect(),
            ..SavedSet::default()
        };
        for (fields, faults, quarantined, reason, at_ms) in &form.keys {
            let reason = reason.filter(|&r| (r as usize) < set.reasons.len()).unwrap_or(REASON_NOT_KEPT);
            push_key(
                &mut set,
                fields,
                Faults { faults: *faults, reason, at_ms: *at_ms, quarantined: *quarantined },
            );
        }
        Ok(SavedFaults(Arc::new(set)))
    }
}

impl WindowOperator {
    /// Quarantine a key after `after` faults (0: never).
    pub fn set_quarantine_after(&mut self, after: u32) {
        self.quarantine.after = after;
    }

    /// Follow the faults of at most `n` keys.
    pub fn set_quarantine_max_keys(&mut self, n: usize) {
        self.quarantine.max_keys = n;
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
        let untracked = self.quarantine.untracked;
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
        } else if self.quarantine.untracked > untracked {
            let now = std::time::Instant::now();
            if self.quarantine.full_logged.is_none_or(|at| now.duration_since(at) >= LOG_EVERY) {
                self.quarantine.full_logged = Some(now);
                tracing::warn!(
                    aggregation = %self.name,
                    followed = self.quarantine.max_keys,
                    untracked = self.quarantine.untracked,
                    "the plugin fails on more keys than the job follows (`[plugin] quarantine_max_keys`): \
                     faults of other keys go to the dead letters, are counted, and are not quarantined"
                );
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

    /// Keys whose faults are followed (quarantined or suspect), and the faults of keys
    /// not followed (the set was full).
    pub fn faults_followed(&self) -> (usize, u64) {
        self.quarantine.followed()
    }

    /// The faults of the keys, for a snapshot.
    pub fn saved_faults(&mut self) -> SavedFaults {
        self.quarantine.saved(&self.keys)
    }

    /// Take the faults a checkpoint of the same plugin saved.
    pub fn restore_faults(&mut self, saved: &SavedFaults) {
        let mut dropped = 0usize;
        for (encoded, f) in saved.each() {
            let k = self.keys.intern(encoded);
            if !self.quarantine.restore(k, f.faults, f.quarantined, saved.reason(f.reason), f.at_ms) {
                dropped += 1;
            }
        }
        self.quarantine.untracked += saved.0.untracked;
        if dropped > 0 {
            tracing::warn!(
                aggregation = %self.name,
                dropped,
                followed = self.quarantine.max_keys,
                "the snapshot follows the faults of more keys than `[plugin] quarantine_max_keys`: the others' are forgotten"
            );
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

    #[test]
    fn the_set_follows_at_most_max_keys_and_counts_the_faults_of_others() {
        let mut q = Quarantine::new(1);
        q.max_keys = 2;
        assert!(q.fault(1, "a") && q.fault(2, "a"));
        assert!(!q.fault(3, "a"), "a third key is not followed");
        assert!(!q.fault(3, "a") && !q.holds(3) && !q.faulted(3));
        assert_eq!(q.followed(), (2, 2));
        assert!(q.release(1));
        assert!(q.fault(3, "a"), "room again once a key is released");
        assert_eq!(q.followed(), (2, 2));
    }

    #[test]
    fn reasons_are_kept_once_cut_and_bounded() {
        let mut q = Quarantine::new(3);
        let long = "é".repeat(REASON_BYTES);
        q.fault(1, &long);
        let kept = q.reasons.text(q.keys[&1].reason);
        assert!(kept.len() <= REASON_BYTES && long.starts_with(kept) && kept.len() >= REASON_BYTES - 1);
        for k in 0..REASONS_KEPT as u32 + 10 {
            q.fault(100 + k, &format!("reason {k}"));
        }
        assert_eq!(q.reasons.texts.len(), REASONS_KEPT);
        q.fault(5, "reason 3");
        assert_eq!(q.reasons.text(q.keys[&5].reason), "reason 3", "a kept reason is shared");
        let last = 100 + REASONS_KEPT as u32 + 5;
        assert!(q.reason(last).contains("not kept"), "{}", q.reason(last));
    }

    #[test]
    fn a_saved_set_reads_back_and_is_not_captured_again_while_unchanged() {
        let mut keys = KeyTable::default();
        let mut q = Quarantine::new(2);
        for (name, n) in [("queso", 1), ("jamón|ibérico", 2), ("pan\n", 3)] {
            let mut encoded = Vec::new();
            crate::state::push_key_field(&mut encoded, name.as_bytes());
            crate::state::push_key_field(&mut encoded, b"girona");
            let k = keys.intern(&encoded);
            for _ in 0..n {
                q.fault(k, &format!("fails on {name}"));
            }
        }
        q.untracked = 7;
        let saved = q.saved(&keys);
        assert!(Arc::ptr_eq(&saved.0, &q.saved(&keys).0), "unchanged: the same capture");
        let json = serde_json::to_string(&saved).unwrap();
        assert!(!json.contains('\n'), "compact: {json}");
        let back: SavedFaults = serde_json::from_str(&json).unwrap();
        assert_eq!(back, saved);
        assert_eq!(back.len(), 3);
        let mut listed: Vec<(Vec<String>, u32, bool, String)> = back
            .each()
            .map(|(key, f)| {
                let fields = crate::state::raw_fields_of(key)
                    .map(|b| String::from_utf8(b.to_vec()).unwrap())
                    .collect();
                (fields, f.faults, f.quarantined, back.reason(f.reason).to_string())
            })
            .collect();
        listed.sort();
        assert_eq!(
            listed,
            [
                (vec!["jamón|ibérico".into(), "girona".into()], 2, true, "fails on jamón|ibérico".into()),
                (vec!["pan\n".into(), "girona".into()], 3, true, "fails on pan\n".into()),
                (vec!["queso".into(), "girona".into()], 1, false, "fails on queso".into()),
            ]
        );
        q.fault(1_000, "x");
        assert!(!Arc::ptr_eq(&saved.0, &q.saved(&keys).0), "changed: captured again");
        // The list km0 kept before this form reads into the same set.
        let legacy = [KeyFaults {
            key: vec!["queso".into(), "girona".into()],
            faults: 1,
            quarantined: false,
            reason: "fails on queso".into(),
            at_ms: 5,
        }];
        let old = SavedFaults::from_listed(&legacy);
        assert_eq!(old.len(), 1);
        assert_eq!(old.each().next().map(|(_, f)| (f.faults, f.quarantined, f.at_ms)), Some((1, false, 5)));
        // A reason index out of range reads as not kept.
        let odd: SavedFaults = serde_json::from_str(r#"{"reasons":[],"keys":[[["a"],1,true,9,0]]}"#).unwrap();
        assert_eq!(odd.each().next().map(|(_, f)| odd.reason(f.reason)), Some(NOT_KEPT_TEXT));
    }
}

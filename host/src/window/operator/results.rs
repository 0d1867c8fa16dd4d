//! Firing: the windows that close, in the order their results are written; their results
//! from the plugin (one `fire` call, or `add` then `finish` after a fault), checked, keyed
//! and handed out; faulty windows isolated for the dead letters.

use super::*;

impl WindowOperator {
    /// Compute and write the results of windows: `(key, id)` is a slot for tumbling and
    /// session windows, `(key, end)` for sliding windows (merged from their panes).
    /// `closing`: the windows' slots end with them: removed, their accumulators taken.
    pub(super) fn emit(&mut self, fires: &[(u32, i64)], out: &mut Vec<Emitted>, closing: bool) -> Result<()> {
        if !self.doomed.is_empty() {
            self.drop_doomed();
        }
        if fires.is_empty() {
            return Ok(());
        }
        if let Assigner::Sliding { size, slide } = self.assigner {
            if self.panes_paused > 0 {
                self.panes_paused -= 1;
            } else if self.plugin.merges_panes() {
                return self.emit_panes(fires, size, slide, out);
            }
        }
        // (key, window, accumulator) of every window.
        // Into the buffers of the last call: no allocation, no page touched for the first
        // time, as windows fire.
        let mut windows = std::mem::take(&mut self.fired);
        windows.clear();
        windows.reserve(fires.len());
        match self.assigner {
            Assigner::Sliding { size, slide } => windows.extend(self.merge_panes(fires, size, slide)?),
            _ if closing => windows.extend(
                fires.iter().filter_map(|&(k, id)| self.drop_slot(k, id).map(|s| (k, s.window, s.acc))),
            ),
            _ => windows.extend(
                fires
                    .iter()
                    .filter_map(|&(k, id)| self.state.slot(k, id).map(|s| (k, s.window, s.acc.clone()))),
            ),
        }
        let mut placed = std::mem::take(&mut self.placed);
        order_windows(&mut self.keys, &mut windows, &mut self.by_rank, &mut placed);
        self.placed = placed;
        let done = self.finish_windows(&windows, out);
        windows.clear();
        self.fired = windows;
        done
    }

    /// `finish` of windows in the order their results are written, in calls of up to the
    /// batch size (after a fault that `on_error` dead-letters, one call per window).
    pub(super) fn finish_windows(
        &mut self,
        windows: &[(u32, Window, Acc)],
        out: &mut Vec<Emitted>,
    ) -> Result<()> {
        for chunk in windows.chunks(self.batch_size) {
            let keys = &self.keys;
            fill_groups(
                &mut self.fire_groups,
                keys,
                chunk.iter().enumerate().map(|(i, (k, w, a))| {
                    if let Some(ahead) = chunk.get(i + PREFETCH_DISTANCE) {
                        keys.prefetch(ahead.0);
                    }
                    (*k, *w, a.as_slice())
                }),
            );
            // Whether `fire_groups` still holds the call's groups (not the last window's of
            // a call per window), each key with the pipeline's number of fields.
            let arity = self.fire_groups.key_arity as usize;
            let (emitted, whole_call) = match self.plugin.finish(&self.fire_groups) {
                Ok(e) => (e, self.fire_groups.keys.ends.len() == chunk.len() * arity),
                Err(e @ Error::PluginCall { .. }) if self.on_error == OnError::DeadLetter => {
                    (self.finish_one_by_one(chunk, &e)?, false)
                }
                Err(e) => return Err(e),
            };
            self.counters.windows_fired += chunk.len() as u64;
            self.write_results(emitted, chunk, whole_call.then_some(CallGroups::Finish), out)?;
        }
        Ok(())
    }

    /// Tumbling windows of an unordered plugin that end as they fire: each window's staged
    /// rows, its accumulator and its firing in one call ([`Aggregator::add_and_finish`]),
    /// laid out once, in the order of the results; nothing is written back (the slots
    /// end). False, with the slots and staged rows as they were, when the windows are
    /// more than a call takes, or after a fault that `on_error` dead-letters (the plugin is
    /// fresh again): then the rows are handed over and the windows finished in two calls,
    /// which isolate a fault to its groups or windows; so do the next [`FIRE_PAUSE`]
    /// firings (a fault that comes back, or a call too long for the time limit, is not
    /// paid for twice every time).
    pub(super) fn fire_closing(&mut self, fires: &[(u32, i64)], out: &mut Vec<Emitted>) -> Result<bool> {
        if self.fire_paused > 0 {
            self.fire_paused -= 1;
            return Ok(false);
        }
        if fires.len() > self.batch_size {
            return Ok(false);
        }
        if self.quarantine.any() && fires.iter().any(|&(k, _)| self.quarantine.faulted(k)) {
            // A key that faulted before: its rows are handed over apart (or, quarantined,
            // dead-lettered).
            return Ok(false);
        }
        if !self.doomed.is_empty() {
            self.drop_doomed();
        }
        // (key, window, (slot id, handle)) of every window; the period found once for the
        // keys that share it (all of them, mostly).
        let mut windows = std::mem::take(&mut self.fired_slots);
        windows.clear();
        let mut period: Option<(i64, PeriodSlots<'_>)> = None;
        for &(k, id) in fires {
            if period.as_ref().is_none_or(|p| p.0 != id) {
                period = Some((id, self.state.period(id)));
            }
            let Some(h) = period.as_ref().and_then(|p| p.1.handle(k)) else { continue };
            if let Some(slot) = self.state.slot_at(h, k, id) {
                windows.push((k, slot.window, (id, h)));
            }
        }
        if windows.is_empty() {
            // Timers of slots gone already: nothing fires.
            self.fired_slots = windows;
            return Ok(true);
        }
        let mut placed = std::mem::take(&mut self.placed_slots);
        order_windows(&mut self.keys, &mut windows, &mut self.by_rank, &mut placed);
        self.placed_slots = placed;
        self.batch.assemble_slots(windows.iter().map(|&(k, _, (id, h))| (k, id, h)), &self.keys, &self.state);
        let emitted = match self.plugin.add_and_finish(&mut self.batch.groups, &self.batch.events) {
            Ok(e) => e,
            Err(e @ Error::PluginCall { .. }) if self.on_error == OnError::DeadLetter => {
                tracing::warn!(error = %e, "plugin fault in add-and-finish: handing over and finishing apart");
                self.plugin.reset()?;
                self.fire_paused = FIRE_PAUSE;
                // The same rows would fail the same way in one `add`: one call per group.
                self.isolate_next = true;
                self.fired_slots = windows;
                return Ok(false);
            }
            Err(e) => return Err(e),
        };
        self.batch.take_laid_out();
        for (i, &(k, _, (id, _))) in windows.iter().enumerate() {
            if let Some(&(k, _, (id, h))) = windows.get(i + PREFETCH_DISTANCE) {
                self.state.prefetch_removal(k, id, h);
            }
            self.drop_slot(k, id);
        }
        self.counters.windows_fired += windows.len() as u64;
        let groups = &self.batch.groups;
        let keyed = groups.keys.ends.len() == windows.len() * groups.key_arity as usize;
        self.write_results(emitted, &windows, keyed.then_some(CallGroups::Batch), out)?;
        windows.clear();
        self.fired_slots = windows;
        Ok(true)
    }

    /// Write the records a call gave for `windows` (its groups, in order); `key_source`:
    /// where the call's groups still are, each key with the pipeline's number of fields, to
    /// read a window's key fields from (None: from the key table). A value that is not one
    /// JSON object is dead-lettered or fails the job.
    pub(super) fn write_results<T>(
        &mut self,
        emitted: Vec<crate::plugin::Emitted>,
        windows: &[(u32, Window, T)],
        key_source: Option<CallGroups>,
        out: &mut Vec<Emitted>,
    ) -> Result<()> {
        for e in emitted {
            let (k, w, _) = &windows[e.group as usize];
            let value = match self.check_value(e.value) {
                Ok(v) => v,
                Err(err) if self.on_error == OnError::DeadLetter => {
                    self.reject_window(*k, *w, &err);
                    continue;
                }
                Err(err) => return Err(err),
            };
            // The key's fields as the call had them (read in call order, recently
            // written) rather than from the key table (a cache miss per result).
            let key = match key_source {
                Some(from) => {
                    let groups = match from {
                        CallGroups::Finish => &self.fire_groups,
                        CallGroups::Batch => &self.batch.groups,
                    };
                    let arity = groups.key_arity as usize;
                    let at = e.group as usize * arity;
                    let fields = (at..at + arity).map(|i| packed_item(&groups.keys, i));
                    self.result_key_of(w.start, fields)
                }
                None => self.result_key(w.start, *k),
            };
            self.counters.emitted += 1;
            out.push(Emitted { key, value: Some(value) });
        }
        Ok(())
    }

    /// Dead-letter a window's result (no event of it): `reason` says why.
    pub(super) fn reject_window(&mut self, k: u32, window: Window, reason: &Error) {
        self.reject(k, window, Vec::new(), reason.to_string());
    }

    /// The key a window's results are written under: `[<aggregation>|]<start>|<key fields>`.
    pub(super) fn result_key(&self, start: i64, k: u32) -> String {
        self.result_key_of(start, self.keys.raw_fields(k))
    }

    /// [`Self::result_key`] of a key given by its fields (interned: UTF-8), built as bytes
    /// and checked once.
    pub(super) fn result_key_of<'a>(&self, start: i64, fields: impl Iterator<Item = &'a [u8]>) -> String {
        let mut key = Vec::with_capacity(self.name.len() + 64);
        if self.prefixed {
            key.extend_from_slice(self.name.as_bytes());
            key.push(b'|');
        }
        push_i64(&mut key, start);
        for f in fields {
            key.push(b'|');
            push_key_part(&mut key, f);
        }
        key_string(key)
    }

    /// After a fault in `finish`: a fresh instance and one call per window; the windows
    /// that fail again are dead-lettered.
    pub(super) fn finish_one_by_one(
        &mut self,
        chunk: &[(u32, Window, Acc)],
        first: &Error,
    ) -> Result<Vec<crate::plugin::Emitted>> {
        tracing::warn!(error = %first, "plugin fault in finish: isolating the windows");
        self.plugin.reset()?;
        let mut out = Vec::new();
        for (i, (k, w, acc)) in chunk.iter().enumerate() {
            fill_groups(&mut self.fire_groups, &self.keys, std::iter::once((*k, *w, acc.as_slice())));
            match self.plugin.finish(&self.fire_groups) {
                Ok(records) => out.extend(records.into_iter().map(|mut r| {
                    r.group = i as u32;
                    r
                })),
                Err(e @ Error::PluginCall { .. }) => {
                    self.plugin.reset()?;
                    self.reject_window(*k, *w, &e);
                }
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }

    /// A result value must be one JSON object on one line, of at most [`MAX_RESULT_BYTES`].
    pub(super) fn check_value(&self, value: String) -> Result<String> {
        let bad = |m: String| Error::PluginCall {
            plugin: self.identity().name.clone(),
            call: "finish",
            message: m,
        };
        if value.len() > MAX_RESULT_BYTES {
            return Err(bad(format!(
                "emitted a result of {} bytes; the limit is {MAX_RESULT_BYTES}",
                value.len()
            )));
        }
        // Most values are one compact object: checked by the input's scanner (what it
        // accepts, serde_json accepts); anything else takes serde_json's path below.
        if crate::source::json::is_compact_object(value.as_bytes()) {
            return Ok(value);
        }
        if !value.trim_start().starts_with('{') {
            return Err(bad(format!("emitted a value that is not a JSON object: {value:.200}")));
        }
        if value.contains(['\n', '\r']) {
            let v: serde_json::Value =
                serde_json::from_str(&value).map_err(|e| bad(format!("invalid JSON: {e}")))?;
            return serde_json::to_string(&v).map_err(|e| bad(e.to_string()));
        }
        serde_json::from_str::<serde::de::IgnoredAny>(&value)
            .map_err(|e| bad(format!("invalid JSON: {e}")))?;
        Ok(value)
    }
}

/// Append a key field to a result key: `\` and `|` are escaped with `\`, so different
/// keys never collide (`queso|curado` + `girona` vs `queso` + `curado|girona`); a field
/// without either is written as it is.
/// Works on bytes: `|` and `\` are ASCII, so a UTF-8 field stays UTF-8.
pub fn push_key_part(out: &mut Vec<u8>, field: &[u8]) {
    // A loop, not memchr2: fields are short, and its dispatch cost more than the search.
    if !field.iter().any(|&c| c == b'|' || c == b'\\') {
        out.extend_from_slice(field);
        return;
    }
    for &c in field {
        if c == b'|' || c == b'\\' {
            out.push(b'\\');
        }
        out.push(c);
    }
}

/// A result key built by [`push_key_part`] from key fields, which were checked to be UTF-8
/// when interned (a field that is not would be shown with replacement characters).
pub(super) fn key_string(bytes: Vec<u8>) -> String {
    String::from_utf8(bytes).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

/// The windows that fire, `(key, window, what goes with it)`, in the order their results
/// are written: by window (end, then start), then key; a window once. A timer may have
/// been set twice (a slot dropped and opened again before its timer came due): the window
/// fires once. A closing slot is removed by its first fire (the second finds nothing); a
/// slot that stays gives both the same accumulator. Windows that sort equal are then the
/// same, so an unstable sort gives the same order.
pub(super) fn order_windows<T: Default>(
    keys: &mut KeyTable,
    windows: &mut Vec<(u32, Window, T)>,
    by_rank: &mut Vec<u32>,
    placed: &mut Vec<(u32, Window, T)>,
) {
    match keys.ranks(windows.len()) {
        Some(rank) if !place_by_rank(windows, rank, by_rank, placed) => {
            // Sort small (end, start, rank, index) tuples, then move the windows once.
            let mut order: Vec<(i64, i64, u32, u32)> = windows
                .iter()
                .enumerate()
                .map(|(i, w)| (w.1.end, w.1.start, rank[w.0 as usize], i as u32))
                .collect();
            order.sort_unstable();
            *windows = order
                .iter()
                .map(|o| {
                    let (k, w, v) = &mut windows[o.3 as usize];
                    (*k, *w, std::mem::take(v))
                })
                .collect();
        }
        Some(_) => {}
        None => {
            windows.sort_unstable_by(|a, b| {
                (a.1.end, a.1.start)
                    .cmp(&(b.1.end, b.1.start))
                    .then_with(|| keys.raw_fields(a.0).cmp(keys.raw_fields(b.0)))
            });
        }
    }
    windows.dedup_by(|a, b| a.0 == b.0 && a.1 == b.1);
}

/// Where a call's groups are: the last `finish` call's, or the batch's (a call that
/// folded and finished).
#[derive(Clone, Copy)]
pub(super) enum CallGroups {
    Finish,
    Batch,
}

/// Windows that fire together mostly share one window (a tumbling window's end reached
/// by every key): then they go in key order by placing each at its key's rank, in time
/// linear in the keys, when there are not many more keys than windows. False (nothing
/// moved) when that does not apply: several windows, a key twice, too many keys.
pub(super) fn place_by_rank<T: Default>(
    windows: &mut Vec<(u32, Window, T)>,
    rank: &[u32],
    by_rank: &mut Vec<u32>,
    placed: &mut Vec<(u32, Window, T)>,
) -> bool {
    let Some(&(_, first, _)) = windows.first() else { return true };
    if rank.len() > 8 * windows.len() + 4096 || windows.iter().any(|w| w.1 != first) {
        return false;
    }
    by_rank.clear();
    by_rank.resize(rank.len(), u32::MAX);
    for (i, w) in windows.iter().enumerate() {
        match rank.get(w.0 as usize).and_then(|&r| by_rank.get_mut(r as usize)) {
            Some(at) if *at == u32::MAX => *at = i as u32,
            _ => return false,
        }
    }
    placed.clear();
    placed.extend(by_rank.iter().filter(|&&i| i != u32::MAX).map(|&i| {
        let (k, w, v) = &mut windows[i as usize];
        (*k, *w, std::mem::take(v))
    }));
    std::mem::swap(windows, placed);
    true
}

/// Append `v` in decimal (what `to_string` gives), without a temporary string.
pub(super) fn push_i64(out: &mut Vec<u8>, v: i64) {
    out.extend_from_slice(itoa::Buffer::new().format(v).as_bytes());
}

#[cfg(test)]
mod tests {
    use super::{push_i64, push_key_part};

    #[test]
    fn windows_placed_by_rank_come_out_in_rank_order_or_are_left_alone() {
        use super::{place_by_rank, Acc, Window};
        let w = Window { start: 0, end: 10 };
        // Key id -> rank (ids 1 and 3 are not live: u32::MAX).
        let rank = [2, u32::MAX, 0, u32::MAX, 1];
        let mut scratch = Vec::new();
        let mut windows: Vec<(u32, Window, Acc)> =
            [0u32, 4, 2].iter().map(|&k| (k, w, Acc::from_slice(&[k as u8]))).collect();
        assert!(place_by_rank(&mut windows, &rank, &mut scratch, &mut Vec::new()));
        let order: Vec<(u32, u8)> = windows.iter().map(|x| (x.0, x.2[0])).collect();
        assert_eq!(order, vec![(2, 2), (4, 4), (0, 0)]);
        // A key twice, two different windows, a key without a rank: nothing moves.
        for keys in [vec![(0u32, w), (0, w)], vec![(0, w), (2, Window { start: 10, end: 20 })], vec![(1, w)]]
        {
            let mut windows: Vec<(u32, Window, Acc)> =
                keys.iter().map(|&(k, w)| (k, w, Acc::new())).collect();
            let before: Vec<(u32, Window)> = windows.iter().map(|x| (x.0, x.1)).collect();
            assert!(!place_by_rank(&mut windows, &rank, &mut scratch, &mut Vec::new()));
            assert_eq!(windows.iter().map(|x| (x.0, x.1)).collect::<Vec<_>>(), before);
        }
    }

    #[test]
    fn window_starts_are_written_as_to_string_writes_them() {
        let mut values = vec![
            0,
            7,
            -7,
            10,
            99,
            100,
            -100,
            1757844000000,
            -1757844000000,
            i64::MAX,
            i64::MIN,
            i64::MIN + 1,
        ];
        values.extend((0..19).flat_map(|e| [10i64.pow(e) - 1, 10i64.pow(e), -(10i64.pow(e) + 1)]));
        for v in values {
            let mut s = b"x".to_vec();
            push_i64(&mut s, v);
            assert_eq!(s, format!("x{v}").into_bytes());
        }
    }

    fn key(fields: &[&str]) -> String {
        let mut k = b"1757844000000".to_vec();
        for f in fields {
            k.push(b'|');
            push_key_part(&mut k, f.as_bytes());
        }
        String::from_utf8(k).unwrap()
    }

    #[test]
    fn result_keys_escape_the_separator_and_keep_plain_keys_as_they_are() {
        assert_eq!(key(&["queso-curado", "girona"]), "1757844000000|queso-curado|girona");
        let (a, b) = (key(&["queso|curado", "girona"]), key(&["queso", "curado|girona"]));
        assert_eq!(a, r"1757844000000|queso\|curado|girona");
        assert_eq!(b, r"1757844000000|queso|curado\|girona");
        assert_ne!(key(&[r"a\", "b"]), key(&[r"a\|b"]));
        assert_eq!(key(&[r"a\", "b"]), r"1757844000000|a\\|b");
    }
}

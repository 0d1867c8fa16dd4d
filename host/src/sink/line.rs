//! The side outputs' JSON lines (late events, dead letters), written straight into a
//! buffer: the same bytes `serde_json` writes for the record types of the test below,
//! without building them.

use crate::source::Position;
use crate::time::Window;

/// One side-output line (a dead letter, a late event): a JSON object written field by
/// field, names in the order given, byte for byte what serde_json writes for a struct of
/// those fields. Late events are a hot path: with 1% of the records late, serde_json's
/// escaping of the raw record took 2% of the job.
#[must_use = "a line ends with `.end()`"]
pub(crate) struct SideLine<'a> {
    buf: &'a mut Vec<u8>,
}

impl<'a> SideLine<'a> {
    pub(crate) fn new(buf: &'a mut Vec<u8>) -> SideLine<'a> {
        buf.clear();
        buf.push(b'{');
        SideLine { buf }
    }

    /// `"name":` (names are plain: nothing in them needs an escape).
    fn name(&mut self, name: &'static str) {
        debug_assert!(!name.bytes().any(|c| c < 0x20 || c == b'"' || c == b'\\'));
        if self.buf.len() > 1 {
            self.buf.push(b',');
        }
        self.buf.push(b'"');
        self.buf.extend_from_slice(name.as_bytes());
        self.buf.extend_from_slice(b"\":");
    }

    pub(crate) fn str(mut self, name: &'static str, v: &str) -> Self {
        self.name(name);
        crate::source::json::push_json_str(self.buf, v);
        self
    }

    /// Raw input, as text: invalid UTF-8 replaced (U+FFFD), as `String::from_utf8_lossy`.
    pub(crate) fn text(self, name: &'static str, v: &[u8]) -> Self {
        match std::str::from_utf8(v) {
            Ok(s) => self.str(name, s),
            Err(_) => self.str(name, &String::from_utf8_lossy(v)),
        }
    }

    pub(crate) fn int(mut self, name: &'static str, v: impl itoa::Integer) -> Self {
        self.name(name);
        self.buf.extend_from_slice(itoa::Buffer::new().format(v).as_bytes());
        self
    }

    pub(crate) fn ints(mut self, name: &'static str, v: &[i64]) -> Self {
        self.name(name);
        self.buf.push(b'[');
        let mut digits = itoa::Buffer::new();
        for (i, &x) in v.iter().enumerate() {
            if i > 0 {
                self.buf.push(b',');
            }
            self.buf.extend_from_slice(digits.format(x).as_bytes());
        }
        self.buf.push(b']');
        self
    }

    /// Where a record was read, and the record: `source`, `line`, `offset`, `record`.
    pub(crate) fn read_at(self, source: &str, pos: Position, record: &[u8]) -> Self {
        self.str("source", source).int("line", pos.line).int("offset", pos.offset).text("record", record)
    }

    pub(crate) fn end(self) {
        self.buf.push(b'}');
    }
}

/// Why a late event goes to the late output.
pub(crate) const LATE: &str = "late: past its windows' allowed lateness";

/// A late event's line: the event, the watermark it came behind (`(t, wm)`), the last
/// window it missed and where it was read.
pub(crate) fn late_line(
    buf: &mut Vec<u8>,
    aggregation: &str,
    (t, wm): (i64, i64),
    window: Window,
    source: &str,
    pos: Position,
    record: &[u8],
) {
    SideLine::new(buf)
        .str("reason", LATE)
        .str("aggregation", aggregation)
        .int("event_time", t)
        .int("watermark", wm)
        .int("window_start", window.start)
        .int("window_end", window.end)
        .read_at(source, pos, record)
        .end();
}

/// A record that is not an event (or that one aggregation cannot take): why, and where.
pub(crate) fn dead_letter_line(buf: &mut Vec<u8>, reason: &str, source: &str, pos: Position, record: &[u8]) {
    SideLine::new(buf).str("reason", reason).read_at(source, pos, record).end();
}

/// Events (or a window's result, `event_times` empty) that a faulty plugin could not take.
pub(crate) fn plugin_dead_letter_line(
    buf: &mut Vec<u8>,
    reason: &str,
    aggregation: &str,
    key: &str,
    window: Window,
    event_times: &[i64],
) {
    SideLine::new(buf)
        .str("reason", reason)
        .str("aggregation", aggregation)
        .str("key", key)
        .int("window_start", window.start)
        .int("window_end", window.end)
        .ints("event_times", event_times)
        .end();
}

/// A result the sink could not take (its JSON value as text).
pub(crate) fn result_dead_letter_line(buf: &mut Vec<u8>, reason: &str, key: &str, value: &str) {
    SideLine::new(buf).str("reason", reason).str("key", key).str("value", value).end();
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Serialize;
    use std::borrow::Cow;

    // The oracles: the structs serde_json wrote the lines from before (dd07632), verbatim.
    #[derive(Serialize)]
    struct DeadLetter<'a> {
        reason: &'a str,
        source: &'a str,
        line: u64,
        offset: u64,
        record: Cow<'a, str>,
    }

    /// A result the sink could not take.
    #[derive(Serialize)]
    struct ResultDeadLetter<'a> {
        reason: &'a str,
        key: &'a str,
        /// The result's JSON value, as text.
        value: &'a str,
    }

    /// Events (or a window's result) that a faulty plugin could not take.
    #[derive(Serialize)]
    struct PluginDeadLetter<'a> {
        reason: &'a str,
        aggregation: &'a str,
        key: &'a str,
        window_start: i64,
        window_end: i64,
        /// Empty when the window's result was rejected.
        event_times: &'a [i64],
    }

    #[derive(Serialize)]
    struct LateEvent<'a> {
        reason: &'a str,
        aggregation: &'a str,
        event_time: i64,
        watermark: i64,
        window_start: i64,
        window_end: i64,
        source: &'a str,
        line: u64,
        offset: u64,
        record: Cow<'a, str>,
    }

    /// `line` (what a line function wrote into a buffer that held something) is what
    /// serde_json writes for `oracle`.
    fn same(write: impl FnOnce(&mut Vec<u8>), oracle: &impl Serialize) {
        let mut buf = b"left over".to_vec();
        write(&mut buf);
        assert_eq!(String::from_utf8(buf).unwrap(), serde_json::to_string(oracle).unwrap());
    }

    #[test]
    fn side_lines_are_what_serde_json_wrote_for_their_records() {
        let records: [&[u8]; 5] = [
            b"{\"tipo\": \"stock.actualizado\", \"producto\": \"pan\", \"fecha_ms\": 1757836800024}",
            b"",
            b"tab\there \\ \"quoted\" \x01\x1f\x7f a\xc3\xb1o \xe2\x82\xac",
            // Not UTF-8: replaced as `String::from_utf8_lossy` replaces it.
            b"bad \xff\xfe utf-8 \xc3",
            b"\"",
        ];
        let texts = ["trap \"here\"\n", "", "a|b\\c", "año €"];
        let (source, aggregation) = ("/tmp/día\\1.jsonl", "min \"stock\"");
        for record in records {
            for (t, wm, line) in
                [(1757836800024i64, 1757836900000i64, 1u64), (i64::MIN, i64::MAX, u64::MAX), (-1, 0, 0)]
            {
                let window = Window { start: t.saturating_sub(300_000), end: t };
                let pos = Position { partition: 0, line, offset: line / 2 };
                let late = LateEvent {
                    reason: LATE,
                    aggregation,
                    event_time: t,
                    watermark: wm,
                    window_start: window.start,
                    window_end: window.end,
                    source,
                    line,
                    offset: line / 2,
                    record: String::from_utf8_lossy(record),
                };
                same(|b| late_line(b, aggregation, (t, wm), window, source, pos, record), &late);
                for reason in texts {
                    let dead = DeadLetter {
                        reason,
                        source,
                        line,
                        offset: line / 2,
                        record: String::from_utf8_lossy(record),
                    };
                    same(|b| dead_letter_line(b, reason, source, pos, record), &dead);
                }
            }
        }
        for (reason, key) in texts.iter().zip(texts.iter().rev()) {
            for times in [&[][..], &[7], &[i64::MIN, 0, i64::MAX]] {
                let window = Window { start: -5, end: i64::MAX };
                let plugin = PluginDeadLetter {
                    reason,
                    aggregation,
                    key,
                    window_start: window.start,
                    window_end: window.end,
                    event_times: times,
                };
                same(|b| plugin_dead_letter_line(b, reason, aggregation, key, window, times), &plugin);
            }
            let value = r#"{"a":"\u00e9\"","b":[1,2]}"#;
            same(
                |b| result_dead_letter_line(b, reason, key, value),
                &ResultDeadLetter { reason, key, value },
            );
        }
    }
}

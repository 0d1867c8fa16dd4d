//! The side outputs' JSON lines (late events, dead letters), written straight into a
//! buffer: the same bytes `serde_json` writes for the record types of the test below,
//! without building them.

use crate::source::json::simd::stops_16;
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
        push_json_str(self.buf, v);
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

/// Append `s` as a JSON string, byte for byte what serde_json writes: between quotes, with
/// `"`, `\\` and the control characters escaped (`\b \f \n \r \t`, the others as
/// `\u00xx`), everything else as it is. serde_json looks at every byte through a table,
/// which made a late event's line (the raw record, quoted) cost ~8 000 instructions; then a
/// run between escapes at a time ([`find_stop`], two copies a run) ~2 300 for a record
/// of 190 bytes, 36 of them quotes. Here sixteen bytes at a time are looked at and
/// copied with one store, whatever stops in them: the bytes after the first stop are
/// written again from there. One reservation covers the worst case.
pub fn push_json_str(out: &mut Vec<u8>, s: &str) {
    let b = s.as_bytes();
    // Every byte escaped (`\u00xx`, six bytes), the quotes, and room for a 16-byte store
    // at the last place written.
    // (Saturating: a length that overflows it is refused by `reserve`, not written past.)
    out.reserve(b.len().saturating_mul(6).saturating_add(2 + 16));
    let mut w = out.len();
    let dst = out.as_mut_ptr();
    // SAFETY: `reserve` made room for 6 * b.len() + 18 bytes from `out.len()`. Each byte of
    // `b` writes at most 6 bytes, so `w` stays within `out.len() + 1 + 6 * i` before byte
    // `i`, and a 16-byte store there ends within the room; the closing quote too. The
    // bytes up to `w` are written before `set_len`. `b` is read within its length.
    unsafe {
        *dst.add(w) = b'"';
        w += 1;
        let mut i = 0;
        while i < b.len() {
            #[cfg(target_arch = "x86_64")]
            if i + 16 <= b.len() {
                use std::arch::x86_64::{_mm_loadu_si128, _mm_storeu_si128};
                let from = b.as_ptr().add(i);
                let m = stops_16(from);
                _mm_storeu_si128(dst.add(w).cast(), _mm_loadu_si128(from.cast()));
                if m == 0 {
                    i += 16;
                    w += 16;
                    continue;
                }
                let k = m.trailing_zeros() as usize;
                i += k;
                w += k;
                w += write_escape(dst.add(w), *b.get_unchecked(i));
                i += 1;
                continue;
            }
            let c = *b.get_unchecked(i);
            if c < 0x20 || c == b'"' || c == b'\\' {
                w += write_escape(dst.add(w), c);
            } else {
                *dst.add(w) = c;
                w += 1;
            }
            i += 1;
        }
        *dst.add(w) = b'"';
        out.set_len(w + 1);
    }
}

/// Write the escape of `c` (a `"`, a `\\` or a control character) at `dst`, as serde_json
/// writes it; its length (2 or 6).
///
/// # Safety
/// `dst` is writable for 6 bytes.
#[inline(always)]
unsafe fn write_escape(dst: *mut u8, c: u8) -> usize {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let short = match c {
        b'"' => b'"',
        b'\\' => b'\\',
        0x08 => b'b',
        0x0c => b'f',
        b'\n' => b'n',
        b'\r' => b'r',
        b'\t' => b't',
        _ => 0,
    };
    // SAFETY: the caller's: 6 writable bytes at `dst`.
    unsafe {
        *dst = b'\\';
        if short != 0 {
            *dst.add(1) = short;
            return 2;
        }
        let u = [b'u', b'0', b'0', HEX[(c >> 4) as usize], HEX[(c & 15) as usize]];
        std::ptr::copy_nonoverlapping(u.as_ptr(), dst.add(1), 5);
    }
    6
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

    #[test]
    fn strings_are_escaped_as_serde_json_escapes_them() {
        // serde_json is the oracle: every character below 0x80 on its own, then strings
        // of every length to 70 (the 16-byte, 8-byte and 1-byte paths of the stop search,
        // and stops at every place in them) mixing plain ASCII, escapes and multi-byte
        // characters, from a fixed-seed generator.
        let mut out = Vec::new();
        let mut check = |s: &str| {
            out.clear();
            push_json_str(&mut out, s);
            assert_eq!(std::str::from_utf8(&out).unwrap(), serde_json::to_string(s).unwrap(), "{s:?}");
            // Appended after what the buffer holds, which stays as it was.
            out.clear();
            out.extend_from_slice(b"{\"a\":");
            push_json_str(&mut out, s);
            assert_eq!(&out[..5], b"{\"a\":");
            assert_eq!(std::str::from_utf8(&out[5..]).unwrap(), serde_json::to_string(s).unwrap(), "{s:?}");
        };
        for c in 0u8..0x80 {
            check(&(c as char).to_string());
        }
        check("");
        let alphabet =
            ['a', 'Z', ' ', '"', '\\', '\n', '\t', '\u{1}', '\u{1f}', '\u{7f}', 'é', '€', '😀', '/'];
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for len in 0..70 {
            for _ in 0..40 {
                let s: String = (0..len)
                    .map(|_| {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        // Mostly plain letters, so that long runs without a stop occur.
                        if x % 4 == 0 {
                            alphabet[(x >> 8) as usize % alphabet.len()]
                        } else {
                            'k'
                        }
                    })
                    .collect();
                check(&s);
            }
        }
    }
}

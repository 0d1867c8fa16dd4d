//! Text from outside (record fields that name partitions and keys, file names, what a
//! plugin says) made safe to show on a terminal or in a log: control characters (escape
//! sequences, bells, NULs), bidirectional overrides and isolates (which reorder what
//! follows them) and line and paragraph separators each become U+FFFD.

use std::borrow::Cow;

/// A character that must not reach a terminal or a log line as it is.
fn unsafe_char(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{200E}' | '\u{200F}' | '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}' | '\u{2028}' | '\u{2029}')
}

/// `s` with every unsafe character replaced (borrowed when there is none).
pub fn printable(s: &str) -> Cow<'_, str> {
    if s.chars().any(unsafe_char) {
        Cow::Owned(s.chars().map(|c| if unsafe_char(c) { '\u{fffd}' } else { c }).collect())
    } else {
        Cow::Borrowed(s)
    }
}

/// Every string in `v` (keys of objects too) made [`printable`].
pub fn printable_json(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::String(s) => {
            if let Cow::Owned(p) = printable(s) {
                *s = p;
            }
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(printable_json),
        serde_json::Value::Object(map) => {
            let entries: Vec<(String, serde_json::Value)> = std::mem::take(map).into_iter().collect();
            for (k, mut value) in entries {
                printable_json(&mut value);
                map.insert(printable(&k).into_owned(), value);
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_bidi_overrides_and_separators_are_replaced_and_the_rest_kept() {
        assert!(matches!(printable("p-01 señal ✓"), Cow::Borrowed(_)));
        assert_eq!(printable("a\u{1b}]0;pwned\u{7}b\0c"), "a\u{fffd}]0;pwned\u{fffd}b\u{fffd}c");
        assert_eq!(printable("x\u{202e}gpj.exe\u{2028}y\u{2066}z"), "x\u{fffd}gpj.exe\u{fffd}y\u{fffd}z");
        let mut v = serde_json::json!({"name\u{1b}": ["ok", "bad\u{7}"], "n": 1});
        printable_json(&mut v);
        assert_eq!(v, serde_json::json!({"name\u{fffd}": ["ok", "bad\u{fffd}"], "n": 1}));
    }
}

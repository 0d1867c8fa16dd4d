//! What a job skips is still validated (compact objects, nested values), and what it
//! reads is unescaped.

use super::number::number_span;
use super::simd::find_stop;
use super::{fail, scalar, string, ws, DecodeError, MAX_DEPTH};

/// True when `b` is one JSON object, then nothing but spaces, with no byte below 0x20
/// (no raw control character in a string, no tab or line break) and at most
/// [`MAX_DEPTH`] / 2 + 1 levels of nesting: a subset of what serde_json accepts, checked
/// at this scanner's speed.
pub fn is_compact_object(b: &[u8]) -> bool {
    is_flat_object(b) || is_compact_nested(b)
}

/// [`is_compact_object`] for any object: whitespace, nesting, escapes, literals.
pub(super) fn is_compact_nested(b: &[u8]) -> bool {
    // In blocks without an early exit, which the compiler turns into vector compares.
    let control = |block: &[u8]| block.iter().fold(false, |found, &c| found | (c < 0x20));
    if b.first() != Some(&b'{') || b.chunks(64).any(control) {
        return false;
    }
    match skip_value(b, 0, MAX_DEPTH / 2) {
        Ok(end) => b[end..].iter().all(|&c| c == b' '),
        Err(_) => false,
    }
}

/// True when `b` is a flat compact object, `{"name":value,...}` or `{}`, whose names and
/// values are strings without escapes or numbers, with nothing around it: most plugin
/// results, checked without the general path's nesting, whitespace and escape handling
/// (~4x fewer instructions). False says nothing: [`is_compact_object`] then decides.
/// What it accepts, the general path accepts: a string ends at its first quote with no
/// control character or backslash before it ([`find_stop`]), a number is
/// [`number_span`]'s, and the structure is fixed, with no byte below 0x20 in it.
#[inline]
pub(super) fn is_flat_object(b: &[u8]) -> bool {
    // The string whose opening quote is at `i`: the index after its closing quote.
    let plain_string = |i: usize| -> Option<usize> {
        if b.get(i) != Some(&b'"') {
            return None;
        }
        let end = find_stop(b, i + 1);
        (b.get(end) == Some(&b'"')).then_some(end + 1)
    };
    if b.first() != Some(&b'{') {
        return false;
    }
    if b.get(1) == Some(&b'}') {
        return b.len() == 2;
    }
    let mut i = 1;
    loop {
        let Some(after_name) = plain_string(i) else { return false };
        if b.get(after_name) != Some(&b':') {
            return false;
        }
        i = after_name + 1;
        i = match b.get(i) {
            Some(b'"') => match plain_string(i) {
                Some(next) => next,
                None => return false,
            },
            Some(b'-' | b'0'..=b'9') => match number_span(b, i) {
                Ok(span) => span.end,
                Err(_) => return false,
            },
            _ => return false,
        };
        match b.get(i) {
            Some(b',') => i += 1,
            Some(b'}') => return i + 1 == b.len(),
            _ => return false,
        }
    }
}

/// Validate and skip the value at `i`; returns the index after it.
pub(super) fn skip_value(b: &[u8], mut i: usize, depth: usize) -> Result<usize, DecodeError> {
    if depth > MAX_DEPTH {
        return Err(fail(b, i, "nesting too deep"));
    }
    match b.get(i) {
        Some(b'"') => string::<false>(b, i + 1).map(|(_, _, next)| next),
        Some(b'-' | b'0'..=b'9') => number_span(b, i).map(|span| span.end),
        Some(b'{') => {
            i = ws(b, i + 1);
            if b.get(i) == Some(&b'}') {
                return Ok(i + 1);
            }
            loop {
                if b.get(i) != Some(&b'"') {
                    return Err(fail(b, i, "expected a field name"));
                }
                i = ws(b, string::<false>(b, i + 1)?.2);
                if b.get(i) != Some(&b':') {
                    return Err(fail(b, i, "expected ':' after a field name"));
                }
                i = ws(b, i + 1);
                i = ws(b, skip_value(b, i, depth + 1)?);
                match b.get(i) {
                    Some(b',') => i = ws(b, i + 1),
                    Some(b'}') => return Ok(i + 1),
                    _ => return Err(fail(b, i, "expected ',' or '}' in object")),
                }
            }
        }
        Some(b'[') => {
            i = ws(b, i + 1);
            if b.get(i) == Some(&b']') {
                return Ok(i + 1);
            }
            loop {
                i = ws(b, skip_value(b, i, depth + 1)?);
                match b.get(i) {
                    Some(b',') => i = ws(b, i + 1),
                    Some(b']') => return Ok(i + 1),
                    _ => return Err(fail(b, i, "expected ',' or ']' in array")),
                }
            }
        }
        _ => scalar::<false>(b, i).map(|(_, next)| next),
    }
}

/// Decode the escapes of a JSON string's raw contents.
pub fn unescape(raw: &[u8]) -> Result<String, DecodeError> {
    let bad = |at: usize, message: &'static str| DecodeError { message, at, ended: false };
    let mut out: Vec<u8> = Vec::with_capacity(raw.len());
    let mut i = 0;
    let hex4 = |i: usize| -> Result<u32, DecodeError> {
        let h = raw.get(i..i + 4).ok_or_else(|| bad(i, "invalid \\u escape"))?;
        let s = std::str::from_utf8(h).map_err(|_| bad(i, "invalid \\u escape"))?;
        u32::from_str_radix(s, 16).map_err(|_| bad(i, "invalid \\u escape"))
    };
    while i < raw.len() {
        let b = raw[i];
        if b != b'\\' {
            out.push(b);
            i += 1;
            continue;
        }
        let e = *raw.get(i + 1).ok_or_else(|| bad(i, "invalid escape in string"))?;
        i += 2;
        let c = match e {
            b'"' => '"',
            b'\\' => '\\',
            b'/' => '/',
            b'b' => '\u{8}',
            b'f' => '\u{c}',
            b'n' => '\n',
            b'r' => '\r',
            b't' => '\t',
            b'u' => {
                let hi = hex4(i)?;
                i += 4;
                let code = if (0xD800..0xDC00).contains(&hi) {
                    if raw.get(i..i + 2) != Some(b"\\u") {
                        return Err(bad(i, "unpaired surrogate in \\u escape"));
                    }
                    let lo = hex4(i + 2)?;
                    if !(0xDC00..0xE000).contains(&lo) {
                        return Err(bad(i, "unpaired surrogate in \\u escape"));
                    }
                    i += 6;
                    0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00)
                } else {
                    hi
                };
                char::from_u32(code).ok_or_else(|| bad(i, "unpaired surrogate in \\u escape"))?
            }
            _ => return Err(bad(i - 1, "invalid escape in string")),
        };
        let mut tmp = [0u8; 4];
        out.extend_from_slice(c.encode_utf8(&mut tmp).as_bytes());
    }
    String::from_utf8(out).map_err(|_| bad(0, "string is not valid UTF-8"))
}

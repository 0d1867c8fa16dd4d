//! Projection decoding of JSON records: pull the few top-level fields a job needs out of
//! a JSON object without building a document.
//!
//! JSON decoding is most of a job's cost (a generic DOM parser is ~4x slower than this
//! on the stock events), so the scanner compares top-level keys against the projected
//! names and validates-and-skips everything else. It still rejects what is not one JSON
//! object (bad syntax, trailing bytes, nesting deeper than [`MAX_DEPTH`]); such records
//! become dead letters with the scanner's reason and byte position.

use std::borrow::Cow;

/// Nesting allowed inside skipped values.
pub const MAX_DEPTH: usize = 128;

/// A projected value, borrowed from the record.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Scalar<'a> {
    /// String contents between the quotes, still escaped when `escaped`.
    Str {
        raw: &'a [u8],
        escaped: bool,
    },
    Int(i64),
    /// A number that is not an integer in i64 range (fraction, exponent, or too large).
    Number(&'a [u8]),
    Bool(bool),
    Null,
    /// An object or array.
    Composite,
}

impl<'a> Scalar<'a> {
    /// What kind of JSON value this is, for error messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Scalar::Str { .. } => "a string",
            Scalar::Int(_) => "an integer",
            Scalar::Number(_) => "a non-integer number",
            Scalar::Bool(_) => "a boolean",
            Scalar::Null => "null",
            Scalar::Composite => "an object or array",
        }
    }

    /// The string's value, unescaped and checked to be UTF-8.
    pub fn as_str(&self) -> Option<Result<Cow<'a, str>, DecodeError>> {
        match *self {
            Scalar::Str { raw, escaped: false } => Some(
                std::str::from_utf8(raw)
                    .map(Cow::Borrowed)
                    .map_err(|_| DecodeError { message: "string is not valid UTF-8".into(), at: 0 }),
            ),
            Scalar::Str { raw, escaped: true } => Some(unescape(raw).map(Cow::Owned)),
            _ => None,
        }
    }
}

/// Why a record is not usable JSON, and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError {
    pub message: String,
    /// Byte offset in the record.
    pub at: usize,
}

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} at byte {}", self.message, self.at)
    }
}

/// Extracts a fixed list of top-level fields from JSON objects.
pub struct Projection {
    names: Vec<Box<[u8]>>,
}

impl Projection {
    pub fn new<S: AsRef<str>>(names: &[S]) -> Projection {
        Projection { names: names.iter().map(|n| n.as_ref().as_bytes().into()).collect() }
    }

    pub fn len(&self) -> usize {
        self.names.len()
    }

    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// Scan `record`; `out[i]` receives field `i` or `None` when absent (the last
    /// occurrence wins when a key repeats).
    pub fn scan<'a>(&self, record: &'a [u8], out: &mut [Option<Scalar<'a>>]) -> Result<(), DecodeError> {
        debug_assert_eq!(out.len(), self.names.len());
        out.iter_mut().for_each(|s| *s = None);
        let mut p = Parser { b: record, i: 0 };
        p.ws();
        if p.peek() != Some(b'{') {
            return Err(p.err("not a JSON object"));
        }
        p.i += 1;
        p.ws();
        if p.peek() == Some(b'}') {
            p.i += 1;
        } else {
            loop {
                if p.peek() != Some(b'"') {
                    return Err(p.err("expected a field name"));
                }
                let (key, escaped) = p.string()?;
                p.ws();
                if p.peek() != Some(b':') {
                    return Err(p.err("expected ':' after a field name"));
                }
                p.i += 1;
                p.ws();
                match self.slot_of(key, escaped)? {
                    Some(slot) => out[slot] = Some(p.scalar()?),
                    None => p.skip_value(0)?,
                }
                p.ws();
                match p.peek() {
                    Some(b',') => {
                        p.i += 1;
                        p.ws();
                    }
                    Some(b'}') => {
                        p.i += 1;
                        break;
                    }
                    _ => return Err(p.err("expected ',' or '}' after a value")),
                }
            }
        }
        p.ws();
        if p.i != record.len() {
            return Err(p.err("unexpected bytes after the JSON object"));
        }
        Ok(())
    }

    #[inline]
    fn slot_of(&self, key: &[u8], escaped: bool) -> Result<Option<usize>, DecodeError> {
        if escaped {
            let k = unescape(key)?;
            return Ok(self.names.iter().position(|n| **n == *k.as_bytes()));
        }
        Ok(self.names.iter().position(|n| short_eq(n, key)))
    }
}

/// Equality for short byte strings: length first, then bytes, without a library call.
#[inline]
pub fn short_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x == y)
}

struct Parser<'a> {
    b: &'a [u8],
    i: usize,
}

impl<'a> Parser<'a> {
    #[inline]
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn err(&self, message: &str) -> DecodeError {
        let message =
            if self.i >= self.b.len() { format!("{message} (record ends)") } else { message.to_string() };
        DecodeError { message, at: self.i }
    }

    #[inline]
    fn ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.i += 1;
        }
    }

    /// At an opening quote: the raw contents and whether they hold escapes.
    ///
    /// A plain byte loop: the strings of event records are short, and a SIMD search
    /// costs more to set up than it saves on them.
    #[inline]
    fn string(&mut self) -> Result<(&'a [u8], bool), DecodeError> {
        self.i += 1;
        let start = self.i;
        let mut escaped = false;
        let b = self.b;
        let mut i = self.i;
        loop {
            while i < b.len() && b[i] != b'"' && b[i] != b'\\' {
                i += 1;
            }
            if i >= b.len() {
                self.i = b.len();
                return Err(self.err("unterminated string"));
            }
            if b[i] == b'"' {
                self.i = i + 1;
                return Ok((&b[start..i], escaped));
            }
            escaped = true;
            self.i = i + 1;
            match self.peek() {
                Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => self.i += 1,
                Some(b'u') => {
                    let hex = self.b.get(self.i + 1..self.i + 5);
                    if !hex.is_some_and(|h| h.iter().all(u8::is_ascii_hexdigit)) {
                        return Err(self.err("invalid \\u escape"));
                    }
                    self.i += 5;
                }
                _ => return Err(self.err("invalid escape in string")),
            }
            i = self.i;
        }
    }

    fn literal(&mut self, word: &[u8]) -> Result<(), DecodeError> {
        if self.b[self.i..].starts_with(word) {
            self.i += word.len();
            Ok(())
        } else {
            Err(self.err("invalid literal"))
        }
    }

    /// A number: an `Int` when it is a plain integer that fits i64.
    #[inline]
    fn number(&mut self) -> Result<Scalar<'a>, DecodeError> {
        let start = self.i;
        let neg = self.peek() == Some(b'-');
        if neg {
            self.i += 1;
        }
        let digits = self.i;
        let mut v: i64 = 0;
        let mut fits = true;
        while let Some(d @ b'0'..=b'9') = self.peek() {
            let d = (d - b'0') as i64;
            match v.checked_mul(10).and_then(|v| if neg { v.checked_sub(d) } else { v.checked_add(d) }) {
                Some(n) => v = n,
                None => fits = false,
            }
            self.i += 1;
        }
        let n_digits = self.i - digits;
        if n_digits == 0 {
            return Err(self.err("invalid number"));
        }
        if n_digits > 1 && self.b[digits] == b'0' {
            return Err(self.err("leading zero in number"));
        }
        let mut integer = true;
        if self.peek() == Some(b'.') {
            integer = false;
            self.i += 1;
            self.digits()?;
        }
        if let Some(b'e' | b'E') = self.peek() {
            integer = false;
            self.i += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.i += 1;
            }
            self.digits()?;
        }
        if integer && fits {
            Ok(Scalar::Int(v))
        } else {
            Ok(Scalar::Number(&self.b[start..self.i]))
        }
    }

    fn digits(&mut self) -> Result<(), DecodeError> {
        let s = self.i;
        while let Some(b'0'..=b'9') = self.peek() {
            self.i += 1;
        }
        if self.i == s {
            return Err(self.err("invalid number"));
        }
        Ok(())
    }

    #[inline]
    fn scalar(&mut self) -> Result<Scalar<'a>, DecodeError> {
        match self.peek() {
            Some(b'"') => {
                let (raw, escaped) = self.string()?;
                Ok(Scalar::Str { raw, escaped })
            }
            Some(b'-' | b'0'..=b'9') => self.number(),
            Some(b't') => self.literal(b"true").map(|_| Scalar::Bool(true)),
            Some(b'f') => self.literal(b"false").map(|_| Scalar::Bool(false)),
            Some(b'n') => self.literal(b"null").map(|_| Scalar::Null),
            Some(b'{' | b'[') => self.skip_value(0).map(|_| Scalar::Composite),
            _ => Err(self.err("expected a value")),
        }
    }

    fn skip_value(&mut self, depth: usize) -> Result<(), DecodeError> {
        if depth > MAX_DEPTH {
            return Err(self.err("nesting too deep"));
        }
        match self.peek() {
            Some(b'{') => {
                self.i += 1;
                self.ws();
                if self.peek() == Some(b'}') {
                    self.i += 1;
                    return Ok(());
                }
                loop {
                    if self.peek() != Some(b'"') {
                        return Err(self.err("expected a field name"));
                    }
                    self.string()?;
                    self.ws();
                    if self.peek() != Some(b':') {
                        return Err(self.err("expected ':' after a field name"));
                    }
                    self.i += 1;
                    self.ws();
                    self.skip_value(depth + 1)?;
                    self.ws();
                    match self.peek() {
                        Some(b',') => {
                            self.i += 1;
                            self.ws();
                        }
                        Some(b'}') => {
                            self.i += 1;
                            return Ok(());
                        }
                        _ => return Err(self.err("expected ',' or '}' in object")),
                    }
                }
            }
            Some(b'[') => {
                self.i += 1;
                self.ws();
                if self.peek() == Some(b']') {
                    self.i += 1;
                    return Ok(());
                }
                loop {
                    self.skip_value(depth + 1)?;
                    self.ws();
                    match self.peek() {
                        Some(b',') => {
                            self.i += 1;
                            self.ws();
                        }
                        Some(b']') => {
                            self.i += 1;
                            return Ok(());
                        }
                        _ => return Err(self.err("expected ',' or ']' in array")),
                    }
                }
            }
            _ => self.scalar().map(|_| ()),
        }
    }
}

/// Decode the escapes of a JSON string's raw contents.
pub fn unescape(raw: &[u8]) -> Result<String, DecodeError> {
    let bad = |at: usize, m: &str| DecodeError { message: m.to_string(), at };
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

#[cfg(test)]
mod tests {
    use super::*;

    fn scan<'a>(p: &Projection, s: &'a str) -> Result<Vec<Option<Scalar<'a>>>, DecodeError> {
        let mut out = vec![None; p.len()];
        p.scan(s.as_bytes(), &mut out).map(|_| out)
    }

    #[test]
    fn projects_fields_and_skips_the_rest() {
        let p = Projection::new(&["fecha_ms", "producto", "stock_actual", "x"]);
        let rec = r#"{"tipo": "stock.actualizado", "nested": {"a": [1, 2.5e3, {"b": null}], "s": "q\"}"}, "producto": "queso-curado", "stock_actual": -15, "fecha_ms": 1757844030000, "ok": true}"#;
        let v = scan(&p, rec).unwrap();
        assert_eq!(v[0], Some(Scalar::Int(1757844030000)));
        assert_eq!(v[1].unwrap().as_str().unwrap().unwrap(), "queso-curado");
        assert_eq!(v[2], Some(Scalar::Int(-15)));
        assert_eq!(v[3], None);
    }

    #[test]
    fn numbers_that_are_not_integers() {
        let p = Projection::new(&["t"]);
        for (rec, want) in [
            (r#"{"t": 1.5}"#, Scalar::Number(b"1.5")),
            (r#"{"t": 1e3}"#, Scalar::Number(b"1e3")),
            (r#"{"t": 99999999999999999999}"#, Scalar::Number(b"99999999999999999999")),
            (r#"{"t": -9223372036854775808}"#, Scalar::Int(i64::MIN)),
            (r#"{"t": "12"}"#, Scalar::Str { raw: b"12", escaped: false }),
        ] {
            assert_eq!(scan(&p, rec).unwrap()[0], Some(want), "{rec}");
        }
    }

    #[test]
    fn escapes_in_values_and_names() {
        let p = Projection::new(&["producto", "año"]);
        let v =
            scan(&p, r#"{"producto": "queso \"curado\" \u00e9 \ud83d\ude00", "a\u00f1o": 2025}"#).unwrap();
        assert_eq!(v[0].unwrap().as_str().unwrap().unwrap(), "queso \"curado\" é 😀");
        assert_eq!(v[1], Some(Scalar::Int(2025)));
    }

    #[test]
    fn rejects_what_is_not_one_json_object() {
        let p = Projection::new(&["a"]);
        for bad in [
            "not json",
            "[1,2]",
            "{\"a\": 1",
            "{\"a\": 1} trailing",
            "{\"a\" 1}",
            "{\"a\": tru}",
            "{\"a\": 01}",
            "{\"a\": \"open}",
            "{\"a\": 1,}",
            "{\"b\": [1 2]}",
            "{\"a\": \"\\x\"}",
            "{\"a\": -}",
        ] {
            assert!(scan(&p, bad).is_err(), "accepted {bad}");
        }
        let deep = format!("{{\"b\": {}{}}}", "[".repeat(MAX_DEPTH + 5), "]".repeat(MAX_DEPTH + 5));
        assert!(scan(&p, &deep).unwrap_err().message.contains("deep"));
    }

    #[test]
    fn agrees_with_serde_json_on_generated_records() {
        // Independent reference: serde_json's full parser.
        let p = Projection::new(&["k", "n", "f"]);
        let mut seed = 7u64;
        for _ in 0..2000 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let n = (seed % 2_000_000) as i64 - 1_000_000;
            let k = format!("k{}\\n\\u0041", seed % 97);
            let rec = format!(r#"{{"z": [{{}}, []], "k": "{k}", "n": {n}, "f": {n}.25, "w": false}}"#);
            let v = scan(&p, &rec).unwrap();
            let full: serde_json::Value = serde_json::from_str(&rec).unwrap();
            assert_eq!(v[0].unwrap().as_str().unwrap().unwrap(), full["k"].as_str().unwrap());
            assert_eq!(v[1], Some(Scalar::Int(full["n"].as_i64().unwrap())));
            match v[2] {
                Some(Scalar::Number(t)) => {
                    let f: f64 = std::str::from_utf8(t).unwrap().parse().unwrap();
                    assert_eq!(f, full["f"].as_f64().unwrap());
                }
                other => panic!("{other:?}"),
            }
        }
    }
}

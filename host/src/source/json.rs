//! Projection decoding of JSON records: pull the few top-level fields a job needs out of
//! a JSON object without building a document.
//!
//! JSON decoding is most of a job's cost, so the scanner compares top-level keys against
//! the projected names and validates-and-skips everything else. On the benchmark's
//! generated streams (a few record layouts, the best case for its layout cache, `Shape`)
//! the fastest library tried, simd-json into a struct, took 2.2-3.0x its time, serde_json
//! 2.6-3.5x and sonic-rs's lazy access 3.7-4.9x (a baseline x86-64 build; sonic-rs chooses
//! its SIMD code when compiled: with `target-cpu=native`, 3.6-4.5x). `cargo bench --bench
//! json` (tests/bench_json.rs) measures them, and checks that they all read the same values.
//! The scanner rejects what is not one JSON object (bad syntax, trailing bytes, nesting
//! deeper than [`MAX_DEPTH`]; UTF-8 is checked in the strings a job reads, not in those it
//! skips); such records become dead letters with the scanner's reason and byte position.

use crate::state::short_eq;
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
            Scalar::Str { raw, escaped: false } => {
                Some(std::str::from_utf8(raw).map(Cow::Borrowed).map_err(|_| DecodeError {
                    message: "string is not valid UTF-8",
                    at: 0,
                    ended: false,
                }))
            }
            Scalar::Str { raw, escaped: true } => Some(unescape(raw).map(Cow::Owned)),
            _ => None,
        }
    }
}

/// Why a record is not usable JSON, and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError {
    pub message: &'static str,
    /// Byte offset in the record.
    pub at: usize,
    /// The record ended before the value did.
    pub ended: bool,
}

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ended = if self.ended { " (record ends)" } else { "" };
        write!(f, "{}{ended} at byte {}", self.message, self.at)
    }
}

#[cold]
fn fail(b: &[u8], at: usize, message: &'static str) -> DecodeError {
    DecodeError { message, at, ended: at >= b.len() }
}

/// Extracts a fixed list of top-level fields from JSON objects.
pub struct Projection {
    names: Vec<Box<[u8]>>,
    /// The first eight bytes of every name ([`head`]), compared first.
    heads: Vec<u64>,
    /// The layouts of the last records scanned in full (at most [`SHAPES`]), to check the
    /// next one against: the last one matched first.
    shapes: Vec<Shape>,
    last: usize,
    /// The next layout to replace when all are taken.
    victim: usize,
    /// Where a full scan writes the layout of its record.
    learning: Shape,
    /// [`Projection::scan_framed`]: records in a row it could not take, and how many
    /// more it lets go by untried.
    framed_misses: u32,
    framed_pause: u32,
}

/// Layouts kept: several producers of one stream (or the partitions of one topic) may
/// each write their fields in their own order.
const SHAPES: usize = 4;

/// [`Projection::scan_framed`]: after this many records in a row that it could not take,
/// it lets this many go by untried.
const FRAMED_MISSES: u32 = 32;
const FRAMED_PAUSE: u32 = 4096;

/// A record layout: the exact bytes before each top-level value (`{"tipo": `, then
/// `, "producto": `, ...) with the projection slot of that field, and the bytes after the
/// last value (`}`). Records of one stream mostly share it: a record whose bytes between
/// values are these is scanned by comparing them, and only its values are parsed. Where
/// the bytes are the same, the full scan would see the same names, in the same order, so
/// it would fill the same slots with the same values and fail on the same value errors.
#[derive(Default)]
struct Shape {
    /// Separators, back to back.
    bytes: Vec<u8>,
    /// Per field: the end of its separator in `bytes`, and its slot.
    fields: Vec<(u32, Option<u32>)>,
    /// Never matched in the input ahead ([`Projection::scan_framed`]): `bytes` hold a line
    /// break (a record that is not one line), or end with a `\r` (learnt from a line that
    /// ended `\r\r\n`: a `\r\n` line would match with its `\r` kept, which the line
    /// search drops).
    unframed: bool,
    /// The separators of `fields` ready for [`scan_separated`], when each has at most
    /// [`SEP_BYTES`] bytes (else empty).
    seps: Vec<Sep>,
    /// Whether the layout has a value for every slot (the scan then writes all of them,
    /// and they need no clearing first).
    fills: bool,
}

/// Bytes of a separator [`scan_separated`] compares at once.
const SEP_BYTES: usize = 32;

/// A separator of a [`Shape`], compared in one go: its bytes (zeros past its length), a
/// mask of its length, and the slot of the value after it ([`NO_SLOT`]: none).
#[derive(Clone, Copy)]
struct Sep {
    bytes: [u8; SEP_BYTES],
    len: u32,
    care: u32,
    slot: u32,
}

const NO_SLOT: u32 = u32::MAX;

impl Shape {
    /// Fill `seps` from `bytes` and `fields`, and `fills` for a projection of `slots`.
    fn compile(&mut self, slots: usize) {
        self.fills = (0..slots as u32).all(|s| self.fields.iter().any(|&(_, slot)| slot == Some(s)));
        self.seps.clear();
        let mut from = 0usize;
        for &(to, slot) in &self.fields {
            let sep = &self.bytes[from..to as usize];
            if sep.len() > SEP_BYTES {
                self.seps.clear();
                return;
            }
            let mut bytes = [0u8; SEP_BYTES];
            bytes[..sep.len()].copy_from_slice(sep);
            let care = if sep.len() == SEP_BYTES { u32::MAX } else { (1u32 << sep.len()) - 1 };
            self.seps.push(Sep { bytes, len: sep.len() as u32, care, slot: slot.unwrap_or(NO_SLOT) });
            from = to as usize;
        }
    }
}

/// What [`scan_separated`] makes of a record.
enum Separated {
    /// The record, this long, has the layout; `out` is filled.
    Taken(usize),
    /// Not a record the layout takes framed (what [`scan_shaped`] returns None for).
    Refused,
    /// Not decided here (a record too near the end of the input read, an escape in a
    /// string): [`scan_shaped`] decides.
    Undecided,
}

/// [`scan_shaped`]`::<true>` with the separators compared 32 bytes at a time and the kind
/// of each value told by its first byte: the same outcome, in fewer instructions, for
/// records whose every separator starts [`ROOM`] bytes or more before the input's end and
/// whose strings have no escape.
///
/// With that room, the separator, the value's first byte, the 16 bytes a number's digits
/// are looked for in and a string's first 16 bytes lie in the input: they are read without
/// a bounds check each (a third of the scan's instructions were such checks).
#[inline]
fn scan_separated<'a>(shape: &Shape, b: &'a [u8], out: &mut [Option<Scalar<'a>>]) -> Separated {
    if shape.unframed {
        return Separated::Refused;
    }
    if shape.seps.len() != shape.fields.len() {
        return Separated::Undecided;
    }
    let mut i = 0usize;
    for sep in &shape.seps {
        if b.len() < i + ROOM {
            return Separated::Undecided;
        }
        // SAFETY: `i + ROOM <= b.len()` and a separator is compared in its first
        // SEP_BYTES (< ROOM) bytes.
        if !sep_matches(unsafe { b.get_unchecked(i..i + SEP_BYTES) }, sep) {
            return Separated::Refused;
        }
        i += sep.len as usize;
        // SAFETY: `sep.len <= SEP_BYTES < ROOM`: `i` is still in the room.
        let first = unsafe { *b.get_unchecked(i) };
        // Each kind of value is put in its slot where it is read (a value carried out of
        // the match took a store of every variant's words).
        let put = |out: &mut [Option<Scalar<'a>>], v: Scalar<'a>| {
            if let Some(slot) = out.get_mut(sep.slot as usize) {
                *slot = Some(v);
            }
        };
        match first {
            b'"' => {
                let (end, stop) = stop_after_quote(b, i);
                match stop {
                    Some(b'"') => {
                        // SAFETY: `i < end < b.len()`.
                        put(out, Scalar::Str { raw: unsafe { b.get_unchecked(i + 1..end) }, escaped: false });
                        i = end + 1;
                    }
                    Some(b'\\') => return Separated::Undecided,
                    // A line break in the string, or the input's end: as `scan_shaped`.
                    _ => return Separated::Refused,
                }
            }
            b'-' | b'0'..=b'9' => match short_integer(b, i, first) {
                Short::Int { digits, n, end } => {
                    // A number no slot takes is checked, its value not computed.
                    if sep.slot != NO_SLOT {
                        // SAFETY: `short_integer` saw the `n` (< 16) digits at `digits`,
                        // in the room, which holds 16 bytes from there.
                        let v = unsafe { short_digits_value(b, digits, n) } as i64;
                        put(out, Scalar::Int(if digits > i { -v } else { v }));
                    }
                    i = end;
                }
                Short::Invalid => return Separated::Refused,
                Short::Fraction { digits, int_end } => match number_tail(b, digits, int_end) {
                    Ok(span) => {
                        let end = span.end;
                        if sep.slot != NO_SLOT {
                            put(out, number_of(b, i, span).0);
                        }
                        i = end;
                    }
                    Err(_) => return Separated::Refused,
                },
                Short::Other if sep.slot == NO_SLOT => match number_span(b, i) {
                    Ok(span) => i = span.end,
                    Err(_) => return Separated::Refused,
                },
                Short::Other => match number(b, i) {
                    Ok((v, next)) => {
                        put(out, v);
                        i = next;
                    }
                    Err(_) => return Separated::Refused,
                },
            },
            // More whitespace than the layout had, a nested value: another way.
            b' ' | b'\t' | b'\n' | b'\r' | b'{' | b'[' => return Separated::Refused,
            _ => match scalar::<true>(b, i) {
                Ok((v, next)) => {
                    put(out, v);
                    i = next;
                }
                Err(_) => return Separated::Refused,
            },
        }
    }
    let from = shape.fields.last().map_or(0, |&(to, _)| to as usize);
    match framed_end(b, i, &shape.bytes[from..]) {
        Some(end) => Separated::Taken(end),
        None => Separated::Refused,
    }
}

/// [`find_stop`] from the byte after the quote at `i`, with [`ROOM`] bytes in `b` from up
/// to [`SEP_BYTES`] bytes before `i`, and the byte it stops at (None at the input's end):
/// the first 16 bytes, which hold most strings of a record, are compared without a bounds
/// check, and what stopped the string is told by the same compare rather than by reading
/// the byte there, a load that would wait for the compare (the scan is a chain of such
/// waits). (32 bytes, for the longer strings too, measured the same.)
#[inline(always)]
fn stop_after_quote(b: &[u8], i: usize) -> (usize, Option<u8>) {
    #[cfg(target_arch = "x86_64")]
    {
        debug_assert!(i + 17 <= b.len());
        // SAFETY: SSE2 is part of x86-64; the 16 bytes from `i + 1` lie in the room
        // (`i + 17 <= ` its end).
        let (m, quotes) = unsafe { stops_and_quotes_16(b.as_ptr().add(i + 1)) };
        if m != 0 {
            let at = m.trailing_zeros();
            // A quote, else a backslash or a control character (the caller tells those
            // apart only by whether it is a backslash: read it then, off the common way).
            let stop = if quotes >> at & 1 == 1 { b'"' } else { b[i + 1 + at as usize] };
            return (i + 1 + at as usize, Some(stop));
        }
        let end = find_stop(b, i + 17);
        (end, b.get(end).copied())
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let end = find_stop(b, i + 1);
        (end, b.get(end).copied())
    }
}

/// Bytes [`scan_separated`] needs from where a field's separator starts: the separator's
/// compare ([`SEP_BYTES`]), then a quote or a sign and 16 bytes (49 at most; 64 leaves
/// slack).
const ROOM: usize = 64;

/// Bytes after a record's line break that let [`Projection::scan_framed`] take a record
/// near the end of what it is given the fast way (a source that hands out one record at
/// a time, with a line break after it, pads it with these).
pub const FRAMED_PADDING: usize = ROOM;

/// What [`short_integer`] makes of a number.
enum Short {
    /// An integer of `n` (1 to 15) digits at `digits` (after a minus sign, when there is
    /// one), ending at `end`.
    Int { digits: usize, n: usize, end: usize },
    /// Not JSON number syntax ([`number_span`] fails on it).
    Invalid,
    /// Checked integer digits `digits..int_end` followed by a fraction or an exponent:
    /// [`number_tail`] goes on from there.
    Fraction { digits: usize, int_end: usize },
    /// 16 digits or more (any number on targets without the 16-byte compare):
    /// [`number`] and [`number_span`] decide.
    Other,
}

/// The number whose first byte, `first` (`-` or a digit), is at `i`, with [`ROOM`] bytes
/// in `b` from up to [`SEP_BYTES`] bytes before `i`: told apart with one 16-byte compare.
#[inline(always)]
fn short_integer(b: &[u8], i: usize, first: u8) -> Short {
    let digits = i + usize::from(first == b'-');
    // SAFETY: `digits + 16 <= i + 17`, within the room ([`ROOM`] bytes from at most
    // `SEP_BYTES` before `i`).
    let run = unsafe { b.get_unchecked(digits..digits + 16) };
    let Some((n, fraction)) = short_digit_run_to(run) else { return Short::Other };
    // SAFETY: `digits` is in the room.
    let lead = unsafe { *b.get_unchecked(digits) };
    if n == 0 || (n > 1 && lead == b'0') {
        return Short::Invalid;
    }
    if fraction {
        return Short::Fraction { digits, int_end: digits + n };
    }
    Short::Int { digits, n, end: digits + n }
}

/// The value of the `n` (1 to 15) ASCII digits at `at`, by one or two SWAR conversions.
///
/// # Safety
/// `b` holds 16 bytes from `at`.
#[inline(always)]
unsafe fn short_digits_value(b: &[u8], at: usize, n: usize) -> u64 {
    debug_assert!((1..16).contains(&n) && at + 16 <= b.len());
    // SAFETY: the caller's: 16 bytes from `at`; unaligned reads of two words in them.
    let word = |i: usize| u64::from_le(unsafe { b.as_ptr().add(i).cast::<u64>().read_unaligned() });
    if n <= 8 {
        digits_value(word(at), n)
    } else {
        digits_value(word(at), 8) * POW10[n - 8] + digits_value(word(at + 8), n - 8)
    }
}

/// The end of a record whose last value ends at `i`, when `tail` follows it and then a
/// line break (`\n` or `\r\n`).
#[inline(always)]
fn framed_end(b: &[u8], i: usize, tail: &[u8]) -> Option<usize> {
    let end = i + tail.len();
    let line_break = match b.get(end) {
        Some(b'\n') => true,
        Some(b'\r') => b.get(end + 1) == Some(&b'\n'),
        _ => false,
    };
    (line_break && b.get(i..end).is_some_and(|at| short_eq(at, tail))).then_some(end)
}

/// Whether `at` (32 bytes) starts with separator `sep`.
#[inline(always)]
fn sep_matches(at: &[u8], sep: &Sep) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_cmpeq_epi8, _mm_loadu_si128, _mm_movemask_epi8};
        if at.len() < SEP_BYTES {
            return false;
        }
        let (a, s) = (at.as_ptr().cast::<__m128i>(), sep.bytes.as_ptr().cast::<__m128i>());
        // SAFETY: SSE2 is part of x86-64; the loads read the first 16 of the 32 bytes of
        // `at` (checked above) and of `sep.bytes`.
        let lo = unsafe { _mm_movemask_epi8(_mm_cmpeq_epi8(_mm_loadu_si128(a), _mm_loadu_si128(s))) as u32 };
        // Most separators (`, "name": `) fit the first 16 bytes.
        if sep.len <= 16 {
            return lo & sep.care == sep.care;
        }
        // SAFETY: as above, their second 16 bytes.
        let hi = unsafe {
            _mm_movemask_epi8(_mm_cmpeq_epi8(_mm_loadu_si128(a.add(1)), _mm_loadu_si128(s.add(1)))) as u32
        };
        (lo | hi << 16) & sep.care == sep.care
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        short_eq(&at[..sep.len as usize], &sep.bytes[..sep.len as usize])
    }
}

/// Most fields and separator bytes a [`Shape`] keeps (larger records are scanned in full).
const SHAPE_FIELDS: usize = 64;
const SHAPE_BYTES: usize = 4096;

/// Scan `b` as a record of layout `shape`: Some(the outcome) when every separator
/// matches (a value error is then the full scan's error), None when the layout differs
/// (nothing is known about `b` then).
///
/// `FRAMED`: `b` runs on past the record, to the end of the input read so far; the record
/// is what the layout covers, up to its last bytes, and must be followed by a line break,
/// `\n` or `\r\n` (Some(Ok(its length))). It then holds no line break (a string that has one, a nested
/// value, whose whitespace may, and a layout learnt with one are refused: None), so it is
/// the line the newline search would have found.
#[inline]
fn scan_shaped<'a, const FRAMED: bool>(
    shape: &Shape,
    b: &'a [u8],
    out: &mut [Option<Scalar<'a>>],
) -> Option<Result<usize, DecodeError>> {
    if FRAMED && shape.unframed {
        return None;
    }
    let (mut i, mut from) = (0usize, 0usize);
    for &(to, slot) in &shape.fields {
        let sep = &shape.bytes[from..to as usize];
        if !b.get(i..i + sep.len()).is_some_and(|at| short_eq(at, sep)) {
            return None;
        }
        i += sep.len();
        from = to as usize;
        // More whitespace before the value than the layout had: another layout.
        if matches!(b.get(i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            return None;
        }
        if FRAMED && matches!(b.get(i), Some(b'{' | b'[')) {
            return None;
        }
        let next = match slot {
            Some(slot) => scalar::<FRAMED>(b, i).map(|(v, next)| {
                out[slot as usize] = Some(v);
                next
            }),
            // What skip_value(b, i, 0) does, with strings and numbers inline.
            None => scalar::<FRAMED>(b, i).map(|(_, next)| next),
        };
        match next {
            Ok(next) => i = next,
            Err(_) if FRAMED => return None,
            Err(e) => return Some(Err(e)),
        }
    }
    let tail = &shape.bytes[from..];
    if FRAMED {
        return framed_end(b, i, tail).map(Ok);
    }
    (b.len() - i == tail.len() && short_eq(&b[i..], tail)).then_some(Ok(b.len()))
}

/// The eight bytes at `i` as a little-endian word (one load), when `b` has them.
#[inline(always)]
fn word_at(b: &[u8], i: usize) -> Option<u64> {
    let bytes: [u8; 8] = b.get(i..i.checked_add(8)?)?.try_into().ok()?;
    Some(u64::from_le_bytes(bytes))
}

/// The first (up to) eight bytes of `b[start..start + len]` as a little-endian word,
/// zero above them: one load when the record has eight bytes there.
#[inline(always)]
fn head(b: &[u8], start: usize, len: usize) -> u64 {
    let n = len.min(8);
    match word_at(b, start) {
        Some(x) if n == 8 => x,
        Some(x) => x & ((1u64 << (8 * n)) - 1),
        None => b[start..start + n].iter().rev().fold(0, |acc, &c| (acc << 8) | c as u64),
    }
}

impl Projection {
    pub fn new<S: AsRef<str>>(names: &[S]) -> Projection {
        let names: Vec<Box<[u8]>> = names.iter().map(|n| n.as_ref().as_bytes().into()).collect();
        let heads = names.iter().map(|n| head(n, 0, n.len())).collect();
        Projection {
            names,
            heads,
            shapes: Vec::new(),
            last: 0,
            victim: 0,
            learning: Shape::default(),
            framed_misses: 0,
            framed_pause: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.names.len()
    }

    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// Scan the record at the start of `ahead` (the input from there on, several records)
    /// when it has a layout seen before and ends right before a line break: its length
    /// (`ahead[len..]` starts with `\n` or `\r\n`), `out` filled as [`Self::scan`] fills
    /// it. None when another way is needed (the line is found by its line break and
    /// scanned): the record has a new layout, a value that does not scan, a nested value,
    /// a string with a line break, or ends otherwise (the input's end).
    ///
    /// The newline search that otherwise finds the line reads every byte before this scan
    /// reads it again; this reads them once. A stream whose records keep needing the other
    /// way (nested values in every record) should not be tried for a while: a caller asks
    /// [`Self::frames`] first.
    pub fn scan_framed<'a>(&mut self, ahead: &'a [u8], out: &mut [Option<Scalar<'a>>]) -> Option<usize> {
        let taken = self.peek_framed(ahead, out);
        if taken.is_some() {
            self.framed_misses = 0;
            return taken;
        }
        self.framed_misses += 1;
        if self.framed_misses == FRAMED_MISSES {
            self.framed_misses = 0;
            self.framed_pause = FRAMED_PAUSE;
        }
        None
    }

    /// [`Self::scan_framed`] without counting a record it cannot take towards a pause: a
    /// look at the record after the one at hand, which is offered to
    /// [`Self::scan_framed`] again when this gives None.
    #[inline]
    pub fn peek_framed<'a>(&mut self, ahead: &'a [u8], out: &mut [Option<Scalar<'a>>]) -> Option<usize> {
        debug_assert_eq!(out.len(), self.names.len());
        // The layouts in `shape_order`, counted round (an iterator over two ranges cost
        // 30 instructions a record).
        let n = self.shapes.len();
        let mut s = if self.last < n { self.last } else { 0 };
        for _ in 0..n {
            let shape = &self.shapes[s];
            if !shape.fills {
                out.iter_mut().for_each(|s| *s = None);
            }
            let taken = match scan_separated(shape, ahead, out) {
                Separated::Taken(len) => Some(len),
                Separated::Refused => None,
                Separated::Undecided => {
                    out.iter_mut().for_each(|s| *s = None);
                    scan_shaped::<true>(shape, ahead, out).and_then(Result::ok)
                }
            };
            if let Some(len) = taken {
                self.last = s;
                return Some(len);
            }
            s = if s + 1 == n { 0 } else { s + 1 };
        }
        None
    }

    /// The kept layouts in the order a record is tried against them: the last one
    /// matched first, then the others (without a division: this is once a record).
    #[inline]
    fn shape_order(&self) -> impl Iterator<Item = usize> {
        let (last, n) = (self.last, self.shapes.len());
        (last..n).chain(0..last.min(n))
    }

    /// Whether [`Self::scan_framed`] tries the next record (false for a while after many
    /// it could not take; each call counts one record of that while).
    #[inline]
    pub fn frames(&mut self) -> bool {
        if self.framed_pause == 0 {
            return true;
        }
        self.framed_pause -= 1;
        false
    }

    /// Scan `record`; `out[i]` receives field `i` or `None` when absent (the last
    /// occurrence wins when a key repeats).
    ///
    /// Written as free functions over `(bytes, index)` so the cursor stays in a register.
    pub fn scan<'a>(&mut self, b: &'a [u8], out: &mut [Option<Scalar<'a>>]) -> Result<(), DecodeError> {
        debug_assert_eq!(out.len(), self.names.len());
        out.iter_mut().for_each(|s| *s = None);
        for s in self.shape_order() {
            match scan_shaped::<false>(&self.shapes[s], b, out) {
                Some(done) => {
                    self.last = s;
                    return done.map(|_| ());
                }
                None => out.iter_mut().for_each(|s| *s = None),
            }
        }
        self.learning.bytes.clear();
        self.learning.fields.clear();
        let mut learn = true;
        // End of the last value (where the next separator starts).
        let mut after_value = 0usize;
        let mut i = ws(b, 0);
        if b.get(i) != Some(&b'{') {
            return Err(fail(b, i, "not a JSON object"));
        }
        i = ws(b, i + 1);
        if b.get(i) == Some(&b'}') {
            i += 1;
        } else {
            loop {
                if b.get(i) != Some(&b'"') {
                    return Err(fail(b, i, "expected a field name"));
                }
                let (key, escaped, next) = string::<false>(b, i + 1)?;
                let key_head = head(b, i + 1, key.len());
                i = ws(b, next);
                if b.get(i) != Some(&b':') {
                    return Err(fail(b, i, "expected ':' after a field name"));
                }
                i = ws(b, i + 1);
                let slot = self.slot_of(key, key_head, escaped)?;
                let layout = &mut self.learning;
                learn = learn
                    && layout.fields.len() < SHAPE_FIELDS
                    && layout.bytes.len() + (i - after_value) <= SHAPE_BYTES;
                if learn {
                    layout.bytes.extend_from_slice(&b[after_value..i]);
                    layout.fields.push((layout.bytes.len() as u32, slot.map(|s| s as u32)));
                }
                match slot {
                    Some(slot) => {
                        let (v, next) = scalar::<false>(b, i)?;
                        out[slot] = Some(v);
                        i = next;
                    }
                    None => i = skip_value(b, i, 0)?,
                }
                after_value = i;
                i = ws(b, i);
                match b.get(i) {
                    Some(b',') => i = ws(b, i + 1),
                    Some(b'}') => {
                        i += 1;
                        break;
                    }
                    _ => return Err(fail(b, i, "expected ',' or '}' after a value")),
                }
            }
        }
        i = ws(b, i);
        if i != b.len() {
            return Err(fail(b, i, "unexpected bytes after the JSON object"));
        }
        if learn && self.learning.bytes.len() + (b.len() - after_value) <= SHAPE_BYTES {
            // The tail: from the end of the last value (the start, for `{}`) to the end.
            self.learning.bytes.extend_from_slice(&b[after_value..]);
            self.keep_layout();
        }
        Ok(())
    }

    /// Keep the layout just learnt, in a free place or instead of the oldest kept.
    fn keep_layout(&mut self) {
        let bytes = &self.learning.bytes;
        self.learning.unframed = bytes.contains(&b'\n') || bytes.last() == Some(&b'\r');
        self.learning.compile(self.names.len());
        if self.shapes.len() < SHAPES {
            self.shapes.push(std::mem::take(&mut self.learning));
            self.last = self.shapes.len() - 1;
        } else {
            std::mem::swap(&mut self.shapes[self.victim], &mut self.learning);
            self.last = self.victim;
            self.victim = (self.victim + 1) % SHAPES;
        }
    }

    /// The slot of field name `key` (its [`head`] is `key_head`), if projected.
    #[inline]
    fn slot_of(&self, key: &[u8], key_head: u64, escaped: bool) -> Result<Option<usize>, DecodeError> {
        if escaped {
            let k = unescape(key)?;
            return Ok(self.names.iter().position(|n| **n == *k.as_bytes()));
        }
        // Length and first eight bytes, then the rest (names of more than eight bytes).
        Ok(self.names.iter().zip(&self.heads).position(|(n, &h)| {
            n.len() == key.len() && h == key_head && (n.len() <= 8 || short_eq(&n[8..], &key[8..]))
        }))
    }
}

#[inline(always)]
fn ws(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && matches!(b[i], b' ' | b'\t' | b'\n' | b'\r') {
        i += 1;
    }
    i
}

/// After an opening quote at `start - 1`: the raw contents, whether they hold escapes,
/// and the index after the closing quote (the search: [`find_stop`]).
/// `LINE_BREAK`: a line break ends the search too, and is an error (the input runs on past
/// the record: see [`scan_shaped`]).
#[inline(always)]
fn string<const LINE_BREAK: bool>(b: &[u8], start: usize) -> Result<(&[u8], bool, usize), DecodeError> {
    let mut i = start;
    let mut escaped = false;
    loop {
        i = find_stop(b, i);
        match b.get(i) {
            None => return Err(fail(b, i, "unterminated string")),
            Some(b'"') => return Ok((&b[start..i], escaped, i + 1)),
            Some(b'\\') => {
                escaped = true;
                i = escape(b, i + 1)?;
            }
            Some(b'\n') if LINE_BREAK => return Err(fail(b, i, "line break in a string")),
            Some(_) => return Err(fail(b, i, "control character in a string (JSON needs it escaped)")),
        }
    }
}

/// Index of the first `"`, `\\` or control character (below 0x20, which JSON allows in a
/// string only escaped; a line break is one) at or after `i`, or `b.len()`: sixteen bytes
/// at a time (SSE2, which every x86-64 has: most strings of a record end within one load),
/// then eight (SWAR), then one.
#[inline(always)]
fn find_stop(b: &[u8], mut i: usize) -> usize {
    #[cfg(target_arch = "x86_64")]
    while let Some(chunk) = b.get(i..i + 16) {
        // SAFETY: SSE2 is part of x86-64; the load reads the 16 bytes of `chunk`.
        let m = unsafe { stops_16(chunk.as_ptr()) };
        if m != 0 {
            return i + m.trailing_zeros() as usize;
        }
        i += 16;
    }
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    while let Some(x) = word_at(b, i) {
        let q = x ^ (ONES * b'"' as u64);
        let s = x ^ (ONES * b'\\' as u64);
        // A zero byte in q or s, or a byte below 0x20 in x, marks a match; only bytes above
        // the first match can be false positives, so the lowest set bit is exact.
        let m =
            (q.wrapping_sub(ONES) & !q | s.wrapping_sub(ONES) & !s | x.wrapping_sub(ONES * 0x20) & !x) & HIGH;
        if m != 0 {
            return i + (m.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    while i < b.len() && b[i] != b'"' && b[i] != b'\\' && b[i] >= 0x20 {
        i += 1;
    }
    i
}

/// [`stops_16`], and the bits of the quotes alone.
///
/// # Safety
/// 16 bytes at `p` must be readable.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn stops_and_quotes_16(p: *const u8) -> (u32, u32) {
    use std::arch::x86_64::{
        _mm_cmpeq_epi8, _mm_loadu_si128, _mm_min_epu8, _mm_movemask_epi8, _mm_or_si128, _mm_set1_epi8,
    };
    let x = _mm_loadu_si128(p.cast());
    let q = _mm_cmpeq_epi8(x, _mm_set1_epi8(b'"' as i8));
    let s = _mm_cmpeq_epi8(x, _mm_set1_epi8(b'\\' as i8));
    // Below 0x20: the unsigned minimum with 0x1f is the byte itself.
    let c = _mm_cmpeq_epi8(_mm_min_epu8(x, _mm_set1_epi8(0x1f)), x);
    (_mm_movemask_epi8(_mm_or_si128(_mm_or_si128(q, s), c)) as u32, _mm_movemask_epi8(q) as u32)
}

/// Bit `k` set where byte `k` of the 16 at `p` is a `"`, a `\\` or a control character.
///
/// # Safety
/// 16 bytes at `p` must be readable.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn stops_16(p: *const u8) -> u32 {
    // SAFETY: the caller's; the quotes' mask, unused, is compiled away.
    unsafe { stops_and_quotes_16(p) }.0
}

/// After a backslash at `i - 1`: the index after the escape.
#[cold]
fn escape(b: &[u8], i: usize) -> Result<usize, DecodeError> {
    match b.get(i) {
        Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => Ok(i + 1),
        Some(b'u') => match b.get(i + 1..i + 5) {
            Some(h) if h.iter().all(u8::is_ascii_hexdigit) => Ok(i + 5),
            _ => Err(fail(b, i, "invalid \\u escape")),
        },
        _ => Err(fail(b, i, "invalid escape in string")),
    }
}

/// A number at `i`: an `Int` when it is a plain integer that fits i64.
#[inline(always)]
fn number(b: &[u8], start: usize) -> Result<(Scalar<'_>, usize), DecodeError> {
    Ok(number_of(b, start, number_span(b, start)?))
}

/// The value of the number at `start` that `span` covers.
#[inline(always)]
fn number_of(b: &[u8], start: usize, span: NumberSpan) -> (Scalar<'_>, usize) {
    let (n_digits, end) = (span.int_end - span.digits, span.end);
    let integer = span.int_end == end;
    // Up to 18 digits cannot overflow; longer integers take the exact path.
    if integer && n_digits <= 18 {
        let v = int_value(b, span.digits, n_digits) as i64;
        return (Scalar::Int(if span.digits > start { -v } else { v }), end);
    }
    if integer {
        if let Ok(v) = std::str::from_utf8(&b[start..end]).unwrap_or("x").parse::<i64>() {
            return (Scalar::Int(v), end);
        }
    }
    (Scalar::Number(&b[start..end]), end)
}

/// Where the parts of a number lie: its integer digits (`digits..int_end`, after a
/// minus sign) and its end.
struct NumberSpan {
    digits: usize,
    int_end: usize,
    end: usize,
}

/// The number at `start`, checked as JSON number syntax, without its value (what a field
/// not projected needs).
#[inline(always)]
fn number_span(b: &[u8], start: usize) -> Result<NumberSpan, DecodeError> {
    let mut i = start;
    if b.get(i) == Some(&b'-') {
        i += 1;
    }
    let digits = i;
    i = match short_digit_run(b, i) {
        Some(len) => i + len,
        None => {
            while i < b.len() && b[i].is_ascii_digit() {
                i += 1;
            }
            i
        }
    };
    let int_end = i;
    let n_digits = int_end - digits;
    if n_digits == 0 {
        return Err(fail(b, i, "invalid number"));
    }
    if n_digits > 1 && b[digits] == b'0' {
        return Err(fail(b, digits, "leading zero in number"));
    }
    number_tail(b, digits, int_end)
}

/// The span of a number whose integer digits, `digits..int_end`, are checked: with its
/// fraction and exponent, when it has them.
#[inline(always)]
fn number_tail(b: &[u8], digits: usize, int_end: usize) -> Result<NumberSpan, DecodeError> {
    let mut i = int_end;
    if b.get(i) == Some(&b'.') {
        i = digits_after(b, i + 1)?;
    }
    if let Some(b'e' | b'E') = b.get(i) {
        i += 1;
        if let Some(b'+' | b'-') = b.get(i) {
            i += 1;
        }
        i = digits_after(b, i)?;
    }
    Ok(NumberSpan { digits, int_end, end: i })
}

/// The value of the `n` (1 to 18) digits at `at`: by at most two SWAR conversions when
/// there are 16 bytes there and the digits are fewer, else eight and then one at a time.
#[inline(always)]
fn int_value(b: &[u8], at: usize, n: usize) -> u64 {
    let word = |i: usize| word_at(b, i).unwrap_or(0x3030_3030_3030_3030);
    match n {
        1..=8 if b.len() >= at + 16 => digits_value(word(at), n),
        9..=15 if b.len() >= at + 16 => {
            digits_value(word(at), 8) * POW10[n - 8] + digits_value(word(at + 8), n - 8)
        }
        _ => {
            let (mut v, mut i) = (0u64, at);
            while let Some(eight) = word_at(b, i).filter(|_| i + 8 <= at + n).and_then(eight_digits) {
                v = v.wrapping_mul(100_000_000).wrapping_add(eight);
                i += 8;
            }
            for &c in &b[i..at + n] {
                v = v.wrapping_mul(10).wrapping_add((c - b'0') as u64);
            }
            v
        }
    }
}

/// How many digits are at `i` when fewer than 16 are followed by another byte within the
/// 16 bytes at `i` (0: none): one 16-byte compare, without a branch per digit. None when
/// `b` has not 16 bytes there or they are all digits.
#[inline(always)]
fn short_digit_run(b: &[u8], i: usize) -> Option<usize> {
    // (What follows the digits, unused here, is compiled away.)
    short_digit_run_to(b.get(i..i.checked_add(16)?)?).map(|(n, _)| n)
}

/// [`short_digit_run`] at the start of `b` (16 bytes or more), and whether the byte after
/// the digits is a `.`, an `e` or an `E` (a fraction or an exponent follows), told by the
/// same compare rather than by reading that byte (a load that would wait for the count).
#[inline(always)]
fn short_digit_run_to(b: &[u8]) -> Option<(usize, bool)> {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{
            _mm_add_epi8, _mm_cmpeq_epi8, _mm_cmpgt_epi8, _mm_loadu_si128, _mm_movemask_epi8, _mm_or_si128,
            _mm_set1_epi8,
        };
        let chunk = b.get(..16)?;
        // SAFETY: SSE2 is part of x86-64; the load reads the 16 bytes of `chunk`. Adding
        // 0x46 takes '0'..='9' to 118..=127 (as signed bytes) and every other byte below
        // 118 (wrapping): the bytes below 118 are the ones that are not digits. `e` and
        // `E` differ by the bit 0x20 only.
        let (others, tails) = unsafe {
            let x = _mm_loadu_si128(chunk.as_ptr().cast());
            let shifted = _mm_add_epi8(x, _mm_set1_epi8(0x46));
            let others = _mm_movemask_epi8(_mm_cmpgt_epi8(_mm_set1_epi8(118), shifted)) as u32;
            let e = _mm_cmpeq_epi8(_mm_or_si128(x, _mm_set1_epi8(0x20)), _mm_set1_epi8(b'e' as i8));
            let dot = _mm_cmpeq_epi8(x, _mm_set1_epi8(b'.' as i8));
            (others, _mm_movemask_epi8(_mm_or_si128(e, dot)) as u32)
        };
        let len = others.trailing_zeros() as usize;
        (len < 16).then_some((len, tails >> len & 1 == 1))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = b;
        None
    }
}

/// 10^n for n < 8.
const POW10: [u64; 8] = [1, 10, 100, 1_000, 10_000, 100_000, 1_000_000, 10_000_000];

/// The value of the first `n` bytes (1 to 8) of `x` (a little-endian word), known to be
/// ASCII digits, the first the most significant (SWAR).
#[inline(always)]
fn digits_value(x: u64, n: usize) -> u64 {
    debug_assert!((1..=8).contains(&n));
    let mask = if n == 8 { u64::MAX } else { (1u64 << (8 * n)) - 1 };
    // The digits' values, moved up so that the bytes below them are leading zeros.
    let d = ((x & mask) - (0x3030_3030_3030_3030 & mask)) << (8 * (8 - n));
    let d = (d.wrapping_mul(10) + (d >> 8)) & 0x00FF_00FF_00FF_00FF;
    let d = (d.wrapping_mul(100) + (d >> 16)) & 0x0000_FFFF_0000_FFFF;
    (d.wrapping_mul(10_000) + (d >> 32)) & 0xFFFF_FFFF
}

/// The value of eight ASCII digits (a little-endian word, SWAR), or None when one of the
/// bytes is not a digit.
#[inline(always)]
fn eight_digits(x: u64) -> Option<u64> {
    const HIGH: u64 = 0xF0F0_F0F0_F0F0_F0F0;
    const ZEROS: u64 = 0x3030_3030_3030_3030;
    // Every byte is 0x30..=0x39: its high nibble is 3, and adding 6 does not carry out of it.
    if x & HIGH != ZEROS || x.wrapping_add(0x0606_0606_0606_0606) & HIGH != ZEROS {
        return None;
    }
    Some(digits_value(x, 8))
}

/// The value of JSON number text `raw` (as the scanner checked it: other text may give a
/// value where `str::parse` gives none) as the nearest f64, what `str::parse` gives.
/// Most numbers take the exact fast path: at most 19 digits whose integer value `m` is at
/// most 2^53 and a decimal exponent `e` within ±22, where `m` and `10^|e|` are exact f64s
/// and one correctly rounded multiplication or division gives the correctly rounded value
/// (Clinger). Anything else goes to `str::parse`.
#[inline]
pub fn number_f64(raw: &[u8]) -> Option<f64> {
    const POW10: [f64; 23] = [
        1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14, 1e15, 1e16, 1e17,
        1e18, 1e19, 1e20, 1e21, 1e22,
    ];
    let neg = raw.first() == Some(&b'-');
    let mut i = neg as usize;
    let (mut m, mut digits, mut exp) = (0u64, 0usize, 0i64);
    while let Some(&c) = raw.get(i).filter(|c| c.is_ascii_digit()) {
        m = m.wrapping_mul(10).wrapping_add((c - b'0') as u64);
        digits += 1;
        i += 1;
    }
    if raw.get(i) == Some(&b'.') {
        i += 1;
        while let Some(&c) = raw.get(i).filter(|c| c.is_ascii_digit()) {
            m = m.wrapping_mul(10).wrapping_add((c - b'0') as u64);
            digits += 1;
            exp -= 1;
            i += 1;
        }
    }
    if let Some(b'e' | b'E') = raw.get(i) {
        i += 1;
        let eneg = raw.get(i) == Some(&b'-');
        if matches!(raw.get(i), Some(b'+' | b'-')) {
            i += 1;
        }
        let mut e = 0i64;
        while let Some(&c) = raw.get(i).filter(|c| c.is_ascii_digit()) {
            e = (e * 10 + (c - b'0') as i64).min(100_000);
            i += 1;
        }
        exp += if eneg { -e } else { e };
    }
    if i == raw.len() && digits <= 19 && m <= 1 << 53 && (-22..=22).contains(&exp) {
        let v = m as f64;
        let v = if exp < 0 { v / POW10[(-exp) as usize] } else { v * POW10[exp as usize] };
        return Some(if neg { -v } else { v });
    }
    std::str::from_utf8(raw).ok()?.parse().ok()
}

fn digits_after(b: &[u8], start: usize) -> Result<usize, DecodeError> {
    let mut i = start;
    while i < b.len() && b[i].is_ascii_digit() {
        i += 1;
    }
    if i == start {
        return Err(fail(b, i, "invalid number"));
    }
    Ok(i)
}

fn literal<'a>(
    b: &'a [u8],
    i: usize,
    word: &[u8],
    v: Scalar<'a>,
) -> Result<(Scalar<'a>, usize), DecodeError> {
    match b.get(i..i + word.len()) {
        Some(w) if w == word => Ok((v, i + word.len())),
        _ => Err(fail(b, i, "invalid literal")),
    }
}

/// `LINE_BREAK`: see [`string`].
// Inlined into the scan: returned through memory, its result cost a store-forwarding
// stall per field (a quarter of the scan's time).
#[inline(always)]
fn scalar<const LINE_BREAK: bool>(b: &[u8], i: usize) -> Result<(Scalar<'_>, usize), DecodeError> {
    match b.get(i) {
        Some(b'"') => {
            let (raw, escaped, next) = string::<LINE_BREAK>(b, i + 1)?;
            Ok((Scalar::Str { raw, escaped }, next))
        }
        Some(b'-' | b'0'..=b'9') => number(b, i),
        Some(b't') => literal(b, i, b"true", Scalar::Bool(true)),
        Some(b'f') => literal(b, i, b"false", Scalar::Bool(false)),
        Some(b'n') => literal(b, i, b"null", Scalar::Null),
        Some(b'{' | b'[') => skip_value(b, i, 0).map(|next| (Scalar::Composite, next)),
        _ => Err(fail(b, i, "expected a value")),
    }
}

/// True when `b` is one JSON object, then nothing but spaces, with no byte below 0x20
/// (no raw control character in a string, no tab or line break) and at most
/// [`MAX_DEPTH`] / 2 + 1 levels of nesting: a subset of what serde_json accepts, checked
/// at this scanner's speed.
pub fn is_compact_object(b: &[u8]) -> bool {
    is_flat_object(b) || is_compact_nested(b)
}

/// [`is_compact_object`] for any object: whitespace, nesting, escapes, literals.
fn is_compact_nested(b: &[u8]) -> bool {
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
fn is_flat_object(b: &[u8]) -> bool {
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
fn skip_value(b: &[u8], mut i: usize, depth: usize) -> Result<usize, DecodeError> {
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

    fn scan<'a>(p: &mut Projection, s: &'a str) -> Result<Vec<Option<Scalar<'a>>>, DecodeError> {
        let mut out = vec![None; p.len()];
        p.scan(s.as_bytes(), &mut out).map(|_| out)
    }

    #[test]
    fn projects_fields_and_skips_the_rest() {
        let mut p = Projection::new(&["fecha_ms", "producto", "stock_actual", "x"]);
        let rec = r#"{"tipo": "stock.actualizado", "nested": {"a": [1, 2.5e3, {"b": null}], "s": "q\"}"}, "producto": "queso-curado", "stock_actual": -15, "fecha_ms": 1757844030000, "ok": true}"#;
        let v = scan(&mut p, rec).unwrap();
        assert_eq!(v[0], Some(Scalar::Int(1757844030000)));
        assert_eq!(v[1].unwrap().as_str().unwrap().unwrap(), "queso-curado");
        assert_eq!(v[2], Some(Scalar::Int(-15)));
        assert_eq!(v[3], None);
    }

    #[test]
    fn short_strings_compare_equal_exactly_when_their_bytes_are_equal() {
        for n in 0..40usize {
            let a: Vec<u8> = (0..n as u8).map(|i| i.wrapping_mul(37)).collect();
            assert!(short_eq(&a, &a.clone()));
            for at in 0..n {
                let mut b = a.clone();
                b[at] ^= 0x40;
                assert!(!short_eq(&a, &b), "length {n}, byte {at} differs");
            }
            assert!(!short_eq(&a, &a[..n.saturating_sub(1)]) || n == 0);
        }
    }

    #[test]
    fn finds_quotes_at_every_offset() {
        for len in 0..40 {
            for at in 0..=len {
                let mut v = vec![b'a'; len];
                if at < len {
                    v[at] = [b'"', b'\\', b'\n', 0x1f, 0][at % 5];
                }
                for start in 0..=at.min(len) {
                    assert_eq!(find_stop(&v, start), at, "len {len} at {at} from {start}");
                }
            }
        }
        // A match byte just below a non-match byte that would borrow; bytes from 0x20 up
        // (a space, a high byte) are no stop.
        assert_eq!(find_stop(b"\x01\"zzzzzzzzz", 0), 0);
        assert_eq!(find_stop(b"\x21\"zzzzzzzzz", 0), 1);
        assert_eq!(find_stop(b"abc\xa2 \x22xxxxxx", 0), 5);
        assert_eq!(find_stop(b"abcdefghij \x7f\xff\x1f", 0), 13);
    }

    #[test]
    fn integers_of_every_length_read_as_the_standard_parser_reads_them() {
        let mut p = Projection::new(&["n"]);
        let mut digits = String::new();
        for (i, d) in "1234567890987654321".chars().chain("0".chars()).enumerate() {
            digits.push(d);
            for sign in ["", "-"] {
                let text = format!("{sign}{digits}");
                let rec = format!("{{\"n\": {text}, \"x\": 1}}");
                let got = scan(&mut p, &rec).unwrap();
                match text.parse::<i64>() {
                    Ok(v) => assert_eq!(got[0], Some(Scalar::Int(v)), "{text} ({} digits)", i + 1),
                    Err(_) => assert_eq!(got[0], Some(Scalar::Number(text.as_bytes())), "{text}"),
                }
            }
        }
        // A digit run broken by another byte inside an eight-byte word.
        for bad in ["{\"n\": 1234:678}", "{\"n\": 12345678a}", "{\"n\": 0123456789}"] {
            assert!(scan(&mut p, bad).is_err(), "{bad}");
        }
        let got = scan(&mut p, "{\"n\": 1234567.5}").unwrap();
        assert_eq!(got[0], Some(Scalar::Number(b"1234567.5")));
    }

    #[test]
    fn integers_of_every_length_and_what_follows_them_read_as_the_standard_parser_reads_them() {
        let mut p = Projection::new(&["n"]);
        let mut rng = crate::generate::Rng::new(9);
        for len in 1..=21 {
            // Short tails, and long ones that put 16 bytes after every number's start.
            for after in [
                ", \"x\": 1}",
                "}",
                " }",
                ".5}",
                "e3}",
                "E+1}",
                "x}",
                ":1}",
                "1",
                ", \"padding\": \"0123456789abcdef\"}",
                ".25e-3, \"padding\": \"0123456789abcdef\"}",
                "\u{e9}\u{7f}/0123456789abcdef\"}",
            ] {
                for sign in ["", "-"] {
                    let mut digits: String =
                        (0..len).map(|_| char::from(b'0' + rng.below(10) as u8)).collect();
                    if len > 1 && digits.starts_with('0') {
                        digits.replace_range(..1, "7");
                    }
                    let rec = format!("{{\"n\": {sign}{digits}{after}");
                    match (scan(&mut p, &rec), serde_json::from_str::<serde_json::Value>(&rec)) {
                        (Ok(got), Ok(v)) => match v["n"].as_i64() {
                            Some(want) => assert_eq!(got[0], Some(Scalar::Int(want)), "{rec}"),
                            None => assert!(matches!(got[0], Some(Scalar::Number(_))), "{rec}"),
                        },
                        (Err(_), Err(_)) => {}
                        (got, want) => panic!("{rec}: scanned {got:?}, serde_json {want:?}"),
                    }
                }
            }
        }
    }

    #[test]
    fn every_number_the_scan_yields_parses_as_a_float() {
        // The window operator relies on it: a float field is not parsed to be checked.
        let mut p = Projection::new(&["n"]);
        for text in
            ["-0", "0.5", "-12.25e-3", "1E+2", "1e999", "-1e-999", "123456789012345678901234567890", "0e0"]
        {
            let rec = format!("{{\"n\": {text}}}");
            let got = scan(&mut p, &rec).unwrap();
            let raw = match got[0] {
                Some(Scalar::Number(raw)) => raw,
                Some(Scalar::Int(_)) => continue,
                other => panic!("{text}: {other:?}"),
            };
            assert!(std::str::from_utf8(raw).unwrap().parse::<f64>().is_ok(), "{text}");
        }
    }

    #[test]
    fn numbers_that_are_not_integers() {
        let mut p = Projection::new(&["t"]);
        for (rec, want) in [
            (r#"{"t": 1.5}"#, Scalar::Number(b"1.5")),
            (r#"{"t": 1e3}"#, Scalar::Number(b"1e3")),
            (r#"{"t": 99999999999999999999}"#, Scalar::Number(b"99999999999999999999")),
            (r#"{"t": -9223372036854775808}"#, Scalar::Int(i64::MIN)),
            (r#"{"t": "12"}"#, Scalar::Str { raw: b"12", escaped: false }),
        ] {
            assert_eq!(scan(&mut p, rec).unwrap()[0], Some(want), "{rec}");
        }
    }

    #[test]
    fn escapes_in_values_and_names() {
        let mut p = Projection::new(&["producto", "año"]);
        let v = scan(&mut p, r#"{"producto": "queso \"curado\" \u00e9 \ud83d\ude00", "a\u00f1o": 2025}"#)
            .unwrap();
        assert_eq!(v[0].unwrap().as_str().unwrap().unwrap(), "queso \"curado\" é 😀");
        assert_eq!(v[1], Some(Scalar::Int(2025)));
    }

    #[test]
    fn rejects_what_is_not_one_json_object() {
        let mut p = Projection::new(&["a"]);
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
            assert!(scan(&mut p, bad).is_err(), "accepted {bad}");
        }
        let deep = format!("{{\"b\": {}{}}}", "[".repeat(MAX_DEPTH + 5), "]".repeat(MAX_DEPTH + 5));
        assert!(scan(&mut p, &deep).unwrap_err().message.contains("deep"));
    }

    #[test]
    fn a_record_checked_against_the_last_layout_scans_as_in_full() {
        // Reference: a projection that has seen nothing (its scan is the full one), and
        // serde_json for whether the record is JSON at all. Every variant is scanned by a
        // projection that learnt the layout of `base` first.
        let names = ["producto", "stock_actual", "fecha_ms", "lat", "nested"];
        let base = r#"{"tipo": "stock", "producto": "queso", "stock_actual": 7, "fecha_ms": 1757836800060, "lat": 40.25, "nested": {"a": [1]}, "x": null}"#;
        let mut variants: Vec<Vec<u8>> = vec![
            base.replace("queso", "vino-priorat-17").into(),
            base.replace("\"stock_actual\": 7", "\"stock_actual\": \"7\"").into(),
            base.replace(", \"x\": null", "").into(),
            base.replace("null}", "null, \"producto\": \"again\"}").into(),
            base.replace("\"producto\"", "\"pro\\u0064ucto\"").into(),
            base.replace(": ", ":").into(),
            format!("{base}  ").into(),
            format!("{base}x").into(),
            base.replace("1757836800060", "-0").into(),
            base.replace("40.25", "4e").into(),
            b"{}".to_vec(),
        ];
        // Strings of every length up to past the 32 bytes compared at once, ending there or
        // going on with an escape, a line break or a control character.
        for n in 0..48 {
            let s = "abcdefghij".repeat(5)[..n].to_string();
            for tail in ["", "\\\"q", "\nq", "\tq", "\x1fq", "\\u00e9"] {
                variants.push(base.replace("queso", &format!("{s}{tail}")).into());
            }
        }
        let mut seed = 3u64;
        let alphabet = b"{}[]\":, 0123456789.-eE\\tfnulqx";
        for _ in 0..20_000 {
            let mut v = base.as_bytes().to_vec();
            for _ in 0..1 + seed % 3 {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                let at = (seed >> 8) as usize % (v.len() + 1);
                let c = alphabet[(seed >> 40) as usize % alphabet.len()];
                match seed % 3 {
                    0 if at < v.len() => v[at] = c,
                    1 if at < v.len() => drop(v.remove(at)),
                    _ => v.insert(at, c),
                }
            }
            variants.push(v);
        }
        let mut accepted = 0;
        for v in &variants {
            let mut warm = Projection::new(&names);
            let mut out = vec![None; names.len()];
            warm.scan(base.as_bytes(), &mut out).unwrap();
            let got = warm.scan(v, &mut out).map(|_| out.clone());
            let mut cold = Projection::new(&names);
            let mut want = vec![None; names.len()];
            let want = cold.scan(v, &mut want).map(|_| want);
            assert_eq!(got, want, "{}", String::from_utf8_lossy(v));
            if let Ok(text) = std::str::from_utf8(v) {
                assert_eq!(
                    got.is_ok(),
                    text.trim_start().starts_with('{')
                        && serde_json::from_str::<serde::de::IgnoredAny>(text).is_ok(),
                    "{text}"
                );
            }
            accepted += got.is_ok() as usize;
            // And the layout learnt from the variant, when it scanned, takes the base again.
            let mut again = vec![None; names.len()];
            let base_again = warm.scan(base.as_bytes(), &mut again).map(|_| again);
            assert_eq!(
                base_again,
                cold.scan(base.as_bytes(), &mut vec![None; names.len()]).map(|_| base_again.clone().unwrap())
            );
        }
        assert!(accepted > 1000, "the variants should not all be broken: {accepted}");
        // One projection through all of them, in turn with the base and with a layout of
        // other field order: it keeps several layouts and replaces them as they come.
        let reordered = r#"{"x": null, "nested": {"a": [1]}, "lat": 40.25, "fecha_ms": 1757836800060, "stock_actual": 7, "producto": "queso", "tipo": "stock"}"#;
        let mut long = Projection::new(&names);
        for (i, v) in variants.iter().enumerate() {
            let v: &[u8] = match i % 3 {
                0 => base.as_bytes(),
                1 => reordered.as_bytes(),
                _ => v,
            };
            let mut out = vec![None; names.len()];
            let got = long.scan(v, &mut out).map(|_| out.clone());
            let mut want = vec![None; names.len()];
            let want = Projection::new(&names).scan(v, &mut want).map(|_| want);
            assert_eq!(got, want, "{}", String::from_utf8_lossy(v));
        }
    }

    #[test]
    fn a_compact_object_is_one_serde_json_accepts() {
        // Independent reference: serde_json. What is_compact_object accepts, serde_json
        // must accept; these plain results must be accepted.
        let yes = [
            r#"{"ventana_inicio":1757844000000,"producto":"queso","stock_minimo":-3,"x":1.5e-3}"#,
            r#"{}"#,
            r#"{"a":{"b":[1,[],{}]},"s":"q\"\\\u00e9 é"}  "#,
            r#"{"t":true,"f":false,"n":null}"#,
        ];
        for v in yes {
            assert!(is_compact_object(v.as_bytes()), "refused {v}");
            assert!(serde_json::from_str::<serde::de::IgnoredAny>(v).is_ok(), "{v}");
        }
        let deep = |n: usize| format!("{{\"a\":{}{}}}", "[".repeat(n), "]".repeat(n));
        let no = [
            " {}".to_string(),
            "{}\n".to_string(),
            "{\"a\":\"tab\there\"}".to_string(),
            "{\"a\":1}x".to_string(),
            "{\"a\":01}".to_string(),
            "{\"a\":\"\\x\"}".to_string(),
            "[1]".to_string(),
            "{\"a\":1,}".to_string(),
            deep(MAX_DEPTH / 2 + 1),
        ];
        for v in &no {
            assert!(!is_compact_object(v.as_bytes()), "accepted {v:?}");
        }
        // Raw control characters inside strings: serde_json refuses them, so must this,
        // wherever they are in a long value.
        for c in 0u8..0x20 {
            for pad in [0, 61, 62, 63, 64, 65, 200] {
                let v = format!("{{\"a\":\"{}x{}y\"}}", "p".repeat(pad), c as char);
                assert!(!is_compact_object(v.as_bytes()), "{v:?}");
                assert!(serde_json::from_str::<serde::de::IgnoredAny>(&v).is_err());
            }
        }
        assert!(is_compact_object(deep(MAX_DEPTH / 2 - 1).as_bytes()));
    }

    #[test]
    fn the_flat_object_check_accepts_only_what_the_general_one_accepts() {
        // Objects built from pieces that are valid, almost valid or foreign (whitespace,
        // escapes, nesting, literals, control characters, bad numbers), then cut or with a
        // byte changed: whatever the flat check accepts, the general check and serde_json
        // accept; and the flat check accepts the plain results it is for.
        let names = ["\"a\"", "\"ventana_inicio\"", "\"\"", "\"é\"", "\"q\\\"\"", "a", "\"x\u{1}\""];
        let values = [
            "1",
            "-0",
            "1757844000000",
            "1.5e-3",
            "-",
            "01",
            "1.",
            "\"queso\"",
            "\"\"",
            "\"a\\nb\"",
            "\"tab\there\"",
            "true",
            "null",
            "{}",
            "[1]",
            "\"€\"",
            " 2",
            "1e",
        ];
        let (mut flat, mut x) = (0, 0x2545_F491_4F6C_DD1Du64);
        let mut next = |n: usize| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 11) as usize % n
        };
        for _ in 0..60_000 {
            let fields = next(4);
            let mut v = String::from("{");
            for f in 0..fields {
                if f > 0 {
                    v.push_str([",", ",", ",", ", ", ";"][next(5)]);
                }
                v.push_str(names[next(names.len()) % if next(3) == 0 { names.len() } else { 2 }]);
                v.push_str([":", ":", ":", " :"][next(4)]);
                v.push_str(values[next(values.len()) % if next(2) == 0 { values.len() } else { 10 }]);
            }
            v.push_str(["}", "}", "}", "} ", "", "}}"][next(6)]);
            let mut b = v.into_bytes();
            match next(8) {
                0 if !b.is_empty() => {
                    let at = next(b.len());
                    b[at] = [b'"', b'\\', b'}', b'{', b',', b':', b'\n', b'0', 0xc3][next(9)];
                }
                1 if !b.is_empty() => b.truncate(next(b.len())),
                _ => {}
            }
            if is_flat_object(&b) {
                flat += 1;
                assert!(is_compact_nested(&b), "{}", String::from_utf8_lossy(&b));
                assert!(
                    serde_json::from_slice::<serde::de::IgnoredAny>(&b).is_ok(),
                    "{}",
                    String::from_utf8_lossy(&b)
                );
            }
            assert_eq!(is_compact_object(&b), is_compact_nested(&b));
        }
        // The cases it is for: taken by the flat check.
        assert!(flat > 5_000, "{flat}");
        for v in [
            r#"{"ventana_inicio":1757844000000,"ventana_fin":1757844300000,"producto":"pan-1","mercado":"reus","stock_minimo":-3,"actualizaciones":4}"#,
            r#"{}"#,
            r#"{"d":1.5e-3,"s":"año"}"#,
        ] {
            assert!(is_flat_object(v.as_bytes()), "{v}");
        }
    }

    #[test]
    fn numbers_parse_to_what_the_standard_parser_gives() {
        // Independent reference: str::parse (correctly rounded), on hand-picked and
        // generated number texts, bit for bit.
        let mut texts: Vec<String> = [
            "0",
            "-0",
            "-0.0",
            "0.1",
            "40.4168",
            "-3.70379",
            "1e22",
            "1e23",
            "9007199254740993",
            "9007199254740992.5",
            "123456789012345678901234",
            "1.7976931348623157e308",
            "2e308",
            "4.9e-324",
            "1e-400",
            "0.000001234",
            "12345678901234567890",
            "-1.5E+3",
            "2.5e-22",
            "2.5e-23",
            "3.0e00",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let mut seed = 11u64;
        for _ in 0..20_000 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let int = seed % 1_000_000;
            let frac = (seed >> 20) % 10_000_000_000;
            let places = 1 + (seed >> 54) % 12;
            let sign = if seed & 1 == 1 { "-" } else { "" };
            texts.push(format!("{sign}{int}.{frac:0width$}", width = places as usize));
            texts.push(format!("{sign}{}e{}", seed % 100_000, (seed >> 40) % 50));
            texts.push(format!("{}.{}e-{}", seed % 10, (seed >> 8) % 1000, (seed >> 30) % 30));
        }
        for t in &texts {
            let want: f64 = t.parse().unwrap();
            let got = number_f64(t.as_bytes()).unwrap();
            assert_eq!(got.to_bits(), want.to_bits(), "{t}");
        }
    }

    #[test]
    fn agrees_with_serde_json_on_generated_records() {
        // Independent reference: serde_json's full parser.
        let mut p = Projection::new(&["k", "n", "f"]);
        let mut seed = 7u64;
        for _ in 0..2000 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let n = (seed % 2_000_000) as i64 - 1_000_000;
            let k = format!("k{}\\n\\u0041", seed % 97);
            let rec = format!(r#"{{"z": [{{}}, []], "k": "{k}", "n": {n}, "f": {n}.25, "w": false}}"#);
            let v = scan(&mut p, &rec).unwrap();
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

    #[test]
    fn records_scanned_where_they_lie_are_the_lines_a_newline_split_gives() {
        // Independent reference: the input split at every line break (a `\r` before it
        // dropped), each line scanned on its own by a fresh projection (the full scan, no
        // layout learnt). The walk under test scans in the input ahead where it can and
        // falls back to the line otherwise, as the file source and the job do.
        let names = ["tipo", "producto", "stock_actual", "fecha_ms"];
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let mut input = String::new();
        for i in 0..3000i64 {
            let producto = ["queso", "miel \"cruda\"", "pan\\payés", "vino"][next(4) as usize];
            let (stock, t) = (next(90) as i64 - 5, 1_757_836_800_000 + i * 20);
            let record = match next(48) {
                // A string with a raw line break: two broken lines, never one record.
                0 => format!("{{\"tipo\": \"stock\", \"producto\": \"a\nb\", \"stock_actual\": {stock}, \"fecha_ms\": {t}}}\n"),
                1 => format!("{{\"tipo\": \"stock\", \"producto\": \"{producto}\", \"stock_actual\": {stock}, \"fecha_ms\": {t}}}\r\n"),
                2 => format!("{{\"tipo\": \"stock\", \"extra\": {{\"a\": [1, {{}}]}}, \"producto\": \"x\", \"stock_actual\": {stock}, \"fecha_ms\": {t}}}\n"),
                3 => format!("{{\"fecha_ms\": {t}, \"stock_actual\": {stock}, \"producto\": \"{producto}\"}}\n"),
                4 => format!("{{\"tipo\": \"stock\", \"producto\": \"{producto}\", \"stock_actual\": 0{stock}, \"fecha_ms\": {t}}}\n"),
                5 => format!("{{\"tipo\":  \"stock\", \"producto\": \"{producto}\", \"stock_actual\": {stock}, \"fecha_ms\": {t}}}\n"),
                6 => "\n".to_string(),
                // A tail of `}\r` learnt: a later `\r\n` line must not keep its `\r`.
                20 => format!("{{\"tipo\": \"stock\", \"producto\": \"{producto}\", \"stock_actual\": {stock}, \"fecha_ms\": {t}}}\r\r\n"),
                // A backslash before a raw line break, and one in a field not projected.
                21 => format!("{{\"tipo\": \"st\\\nock\", \"producto\": \"{producto}\", \"stock_actual\": {stock}, \"fecha_ms\": {t}}}\n"),
                22 => format!("{{\"tipo\": \"stock\", \"producto\": \"{producto}\", \"stock_actual\": {stock}, \"fecha_ms\": {t}, \"nota\": \"a\nb\"}}\n"),
                7 => format!("{{\"tipo\": \"stock\", \"producto\": \"{producto}\", \"stock_actual\": {stock}, \"fecha_ms\": {t}}} \n"),
                // Literals, and a separator longer than the 32 bytes compared at once.
                8 => format!("{{\"tipo\": \"stock\", \"activo\": true, \"producto\": \"{producto}\", \"nota\": null, \"stock_actual\": {stock}, \"fecha_ms\": {t}, \"b\": false}}\n"),
                9 => format!("{{\"tipo\": \"stock\", \"un_nombre_de_campo_muy_largo_que_no_cabe\": 1, \"producto\": \"{producto}\", \"stock_actual\": {stock}, \"fecha_ms\": {t}}}\n"),
                10 => format!("{{\"tipo\": \"stock\", \"producto\": \"{producto}\", \"stock_actual\": {stock}, \"fecha_ms\": {t}, \"x\": tru}}\n"),
                // An invalid escape, where stopping at the backslash would read on.
                11 => format!("{{\"tipo\": \"stock\", \"producto\": \"a\\, \"stock_actual\": {stock}, \"fecha_ms\": {t}}}\n"),
                // Numbers no slot takes: two that are not JSON numbers, one with a fraction and
                // an exponent.
                13 => format!("{{\"tipo\": \"stock\", \"delta\": 0{stock}, \"producto\": \"{producto}\", \"stock_actual\": {stock}, \"fecha_ms\": {t}}}\n"),
                14 => format!("{{\"tipo\": \"stock\", \"delta\": {stock}.e1, \"producto\": \"{producto}\", \"stock_actual\": {stock}, \"fecha_ms\": {t}}}\n"),
                15 => format!("{{\"tipo\": \"stock\", \"delta\": -{t}.5e-3, \"producto\": \"{producto}\", \"stock_actual\": {stock}, \"fecha_ms\": {t}}}\n"),
                // Projected numbers that are not short integers: a fraction, an exponent,
                // 19 and 20 digits, minus zero, a lone minus; a projected string longer
                // than 16 and than 32 bytes.
                16 => format!("{{\"tipo\": \"stock\", \"producto\": \"{producto}\", \"stock_actual\": {stock}.5, \"fecha_ms\": {t}}}\n"),
                17 => format!("{{\"tipo\": \"stock\", \"producto\": \"{producto}\", \"stock_actual\": {stock}E2, \"fecha_ms\": {t}}}\n"),
                18 => format!("{{\"tipo\": \"stock\", \"producto\": \"{producto}\", \"stock_actual\": {stock}, \"fecha_ms\": {t}123456}}\n"),
                19 => format!("{{\"tipo\": \"stock\", \"producto\": \"{producto}\", \"stock_actual\": -{t}0000000, \"fecha_ms\": {t}}}\n"),
                23 => format!("{{\"tipo\": \"stock\", \"producto\": \"{producto}\", \"stock_actual\": -0, \"fecha_ms\": {t}}}\n"),
                24 => format!("{{\"tipo\": \"stock\", \"producto\": \"{producto}\", \"stock_actual\": -, \"fecha_ms\": {t}}}\n"),
                25 => format!("{{\"tipo\": \"stock\", \"producto\": \"queso-curado-{producto}\", \"stock_actual\": {stock}, \"fecha_ms\": {t}}}\n"),
                26 => format!("{{\"tipo\": \"stock\", \"producto\": \"queso-curado-de-oveja-manchega-{producto}\", \"stock_actual\": {stock}, \"fecha_ms\": {t}}}\n"),
                // A separator that differs from the usual one past its 16th byte.
                12 => format!("{{\"tipo\": \"stock\", \"producto\": \"{producto}\", \"stock_actual\":{stock}, \"fecha_ms\": {t}}}\n"),
                _ => format!("{{\"tipo\": \"stock\", \"producto\": \"{producto}\", \"stock_actual\": {stock}, \"fecha_ms\": {t}}}\n"),
            };
            input.push_str(&record);
        }
        input.push_str("{\"tipo\": \"stock\", \"producto\": \"vino\", \"stock_actual\": 3, \"fecha_ms\": 1}");
        let b = input.as_bytes();

        type Seen<'a> = (usize, &'a [u8], Option<Vec<Option<Scalar<'a>>>>);
        let mut expected: Vec<Seen> = Vec::new();
        let mut at = 0;
        for line in input.split('\n') {
            let record = line.strip_suffix('\r').unwrap_or(line).as_bytes();
            expected.push((
                at,
                record,
                scan(&mut Projection::new(&names), line.strip_suffix('\r').unwrap_or(line)).ok(),
            ));
            at += line.len() + 1;
        }

        let mut p = Projection::new(&names);
        let (mut seen, mut at, mut framed): (Vec<Seen>, usize, usize) = (Vec::new(), 0, 0);
        while at <= b.len() {
            let mut out = vec![None; names.len()];
            if let Some(len) = p.scan_framed(&b[at..], &mut out) {
                let line_break = if b[at + len] == b'\r' { 2 } else { 1 };
                assert_eq!(b[at + len + line_break - 1], b'\n');
                seen.push((at, &b[at..at + len], Some(out)));
                framed += 1;
                at += len + line_break;
                continue;
            }
            let end = b[at..].iter().position(|&c| c == b'\n').map_or(b.len(), |i| at + i);
            let record = b[at..end].strip_suffix(b"\r").unwrap_or(&b[at..end]);
            let scanned = p.scan(record, &mut out).ok().map(|_| out);
            seen.push((at, record, scanned));
            at = end + 1;
        }
        assert_eq!(seen.len(), expected.len());
        for (got, want) in seen.iter().zip(&expected) {
            assert_eq!(got, want, "at byte {}: {:?}", want.0, String::from_utf8_lossy(want.1));
        }
        // Many records went the framed way (the odd ones, of 17 layouts in all, evict the
        // common layout from the four kept now and then); the broken ones never did, or a
        // record would differ.
        assert!(framed > 800, "{framed} framed");
    }

    #[test]
    fn a_stream_the_framed_scan_keeps_refusing_is_not_offered_for_a_while() {
        // Nested values in every record: each is refused where it lies. After
        // FRAMED_MISSES refusals in a row, `frames` says no for FRAMED_PAUSE records, then
        // yes again; one record taken resets the count.
        let names = ["a"];
        let nested = b"{\"m\": {\"x\": 1}, \"a\": 1}\n{\"m\": {\"x\": 1}, \"a\": 1}\n";
        let plain = b"{\"a\": 1}\n{\"a\": 1}\n";
        let mut p = Projection::new(&names);
        let mut out = [None];
        p.scan(&nested[..nested.len() / 2 - 1], &mut out).unwrap();
        for i in 0..FRAMED_MISSES {
            assert!(p.frames(), "refusal {i}");
            assert_eq!(p.scan_framed(nested, &mut out), None);
        }
        for _ in 0..FRAMED_PAUSE {
            assert!(!p.frames());
        }
        assert!(p.frames());
        // Refusals that a record taken interrupts do not add up.
        p.scan(&plain[..plain.len() / 2 - 1], &mut out).unwrap();
        for _ in 0..3 {
            for _ in 0..FRAMED_MISSES - 1 {
                assert_eq!(p.scan_framed(nested, &mut out), None);
            }
            assert_eq!(p.scan_framed(plain, &mut out), Some(plain.len() / 2 - 1));
            assert_eq!(out[0], Some(Scalar::Int(1)));
        }
        assert!(p.frames());
        // A look ahead that cannot take a record counts for nothing (the record is offered
        // to `scan_framed` again), and one that takes a record resets nothing.
        for _ in 0..3 * FRAMED_MISSES {
            assert_eq!(p.peek_framed(nested, &mut out), None);
        }
        assert!(p.frames());
        for _ in 0..FRAMED_MISSES - 1 {
            assert_eq!(p.scan_framed(nested, &mut out), None);
        }
        assert_eq!(p.peek_framed(plain, &mut out), Some(plain.len() / 2 - 1));
        assert_eq!(p.scan_framed(nested, &mut out), None);
        assert!(!p.frames());
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

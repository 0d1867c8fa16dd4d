//! Learned record layouts: a record whose bytes between values are those of a layout
//! seen before is scanned by comparing them, only its values parsed; and the framed scans
//! that take a record and its line break in one pass.

use super::number::{digits_value, number, number_of, number_span, number_tail, short_digit_run_to, POW10};
use super::simd::{find_stop, stops_and_quotes_16, word_at};
use super::{scalar, DecodeError, Scalar};
use crate::state::short_eq;

/// A record layout: the exact bytes before each top-level value (`{"tipo": `, then
/// `, "producto": `, ...) with the projection slot of that field, and the bytes after the
/// last value (`}`). Records of one stream mostly share it: a record whose bytes between
/// values are these is scanned by comparing them, and only its values are parsed. Where
/// the bytes are the same, the full scan would see the same names, in the same order, so
/// it would fill the same slots with the same values and fail on the same value errors.
#[derive(Default)]
pub(super) struct Shape {
    /// Separators, back to back.
    pub(super) bytes: Vec<u8>,
    /// Per field: the end of its separator in `bytes`, and its slot.
    pub(super) fields: Vec<(u32, Option<u32>)>,
    /// Never matched in the input ahead ([`Projection::scan_framed`]): `bytes` hold a line
    /// break (a record that is not one line), or end with a `\r` (learnt from a line that
    /// ended `\r\r\n`: a `\r\n` line would match with its `\r` kept, which the line
    /// search drops).
    pub(super) unframed: bool,
    /// The separators of `fields` ready for [`scan_separated`], when each has at most
    /// [`SEP_BYTES`] bytes (else empty).
    pub(super) seps: Vec<Sep>,
    /// Whether the layout has a value for every slot (the scan then writes all of them,
    /// and they need no clearing first).
    pub(super) fills: bool,
}

/// Bytes of a separator [`scan_separated`] compares at once.
pub(super) const SEP_BYTES: usize = 32;

/// A separator of a [`Shape`], compared in one go: its bytes (zeros past its length), a
/// mask of its length, and the slot of the value after it ([`NO_SLOT`]: none).
#[derive(Clone, Copy)]
pub(super) struct Sep {
    pub(super) bytes: [u8; SEP_BYTES],
    pub(super) len: u32,
    pub(super) care: u32,
    pub(super) slot: u32,
}

pub(super) const NO_SLOT: u32 = u32::MAX;

impl Shape {
    /// Fill `seps` from `bytes` and `fields`, and `fills` for a projection of `slots`.
    pub(super) fn compile(&mut self, slots: usize) {
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
pub(super) enum Separated {
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
pub(super) fn scan_separated<'a>(shape: &Shape, b: &'a [u8], out: &mut [Option<Scalar<'a>>]) -> Separated {
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
pub(super) fn stop_after_quote(b: &[u8], i: usize) -> (usize, Option<u8>) {
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
pub(super) const ROOM: usize = 64;

/// Bytes after a record's line break that let [`Projection::scan_framed`] take a record
/// near the end of what it is given the fast way (a source that hands out one record at
/// a time, with a line break after it, pads it with these).
pub const FRAMED_PADDING: usize = ROOM;

/// What [`short_integer`] makes of a number.
pub(super) enum Short {
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
pub(super) fn short_integer(b: &[u8], i: usize, first: u8) -> Short {
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
pub(super) unsafe fn short_digits_value(b: &[u8], at: usize, n: usize) -> u64 {
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
pub(super) fn framed_end(b: &[u8], i: usize, tail: &[u8]) -> Option<usize> {
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
pub(super) fn sep_matches(at: &[u8], sep: &Sep) -> bool {
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
pub(super) const SHAPE_FIELDS: usize = 64;
pub(super) const SHAPE_BYTES: usize = 4096;

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
pub(super) fn scan_shaped<'a, const FRAMED: bool>(
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

/// The first (up to) eight bytes of `b[start..start + len]` as a little-endian word,
/// zero above them: one load when the record has eight bytes there.
#[inline(always)]
pub(super) fn head(b: &[u8], start: usize, len: usize) -> u64 {
    let n = len.min(8);
    match word_at(b, start) {
        Some(x) if n == 8 => x,
        Some(x) => x & ((1u64 << (8 * n)) - 1),
        None => b[start..start + n].iter().rev().fold(0, |acc, &c| (acc << 8) | c as u64),
    }
}

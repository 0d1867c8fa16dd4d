//! JSON numbers: their spans, integer values read 8 digits at a time, and floats.

use super::simd::word_at;
use super::{fail, DecodeError, Scalar};

/// A number at `i`: an `Int` when it is a plain integer that fits i64.
#[inline(always)]
pub(super) fn number(b: &[u8], start: usize) -> Result<(Scalar<'_>, usize), DecodeError> {
    Ok(number_of(b, start, number_span(b, start)?))
}

/// The value of the number at `start` that `span` covers.
#[inline(always)]
pub(super) fn number_of(b: &[u8], start: usize, span: NumberSpan) -> (Scalar<'_>, usize) {
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
pub(super) struct NumberSpan {
    pub(super) digits: usize,
    pub(super) int_end: usize,
    pub(super) end: usize,
}

/// The number at `start`, checked as JSON number syntax, without its value (what a field
/// not projected needs).
#[inline(always)]
pub(super) fn number_span(b: &[u8], start: usize) -> Result<NumberSpan, DecodeError> {
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
pub(super) fn number_tail(b: &[u8], digits: usize, int_end: usize) -> Result<NumberSpan, DecodeError> {
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
pub(super) fn int_value(b: &[u8], at: usize, n: usize) -> u64 {
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
pub(super) fn short_digit_run(b: &[u8], i: usize) -> Option<usize> {
    // (What follows the digits, unused here, is compiled away.)
    short_digit_run_to(b.get(i..i.checked_add(16)?)?).map(|(n, _)| n)
}

/// [`short_digit_run`] at the start of `b` (16 bytes or more), and whether the byte after
/// the digits is a `.`, an `e` or an `E` (a fraction or an exponent follows), told by the
/// same compare rather than by reading that byte (a load that would wait for the count).
#[inline(always)]
pub(super) fn short_digit_run_to(b: &[u8]) -> Option<(usize, bool)> {
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
pub(super) const POW10: [u64; 8] = [1, 10, 100, 1_000, 10_000, 100_000, 1_000_000, 10_000_000];

/// The value of the first `n` bytes (1 to 8) of `x` (a little-endian word), known to be
/// ASCII digits, the first the most significant (SWAR).
#[inline(always)]
pub(super) fn digits_value(x: u64, n: usize) -> u64 {
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
pub(super) fn eight_digits(x: u64) -> Option<u64> {
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

pub(super) fn digits_after(b: &[u8], start: usize) -> Result<usize, DecodeError> {
    let mut i = start;
    while i < b.len() && b[i].is_ascii_digit() {
        i += 1;
    }
    if i == start {
        return Err(fail(b, i, "invalid number"));
    }
    Ok(i)
}

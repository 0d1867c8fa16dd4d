//! The search for the end of a JSON string's plain run (a quote, a backslash or a control
//! byte), 16 bytes at a time with SSE2, shared by the scanner and the sinks' writer.

/// Index of the first `"`, `\\` or control character (below 0x20, which JSON allows in a
/// string only escaped; a line break is one) at or after `i`, or `b.len()`: sixteen bytes
/// at a time (SSE2, which every x86-64 has: most strings of a record end within one load),
/// then eight (SWAR), then one.
#[inline(always)]
pub(super) fn find_stop(b: &[u8], mut i: usize) -> usize {
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
pub(super) unsafe fn stops_and_quotes_16(p: *const u8) -> (u32, u32) {
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
pub unsafe fn stops_16(p: *const u8) -> u32 {
    // SAFETY: the caller's; the quotes' mask, unused, is compiled away.
    unsafe { stops_and_quotes_16(p) }.0
}

/// The eight bytes at `i` as a little-endian word (one load), when `b` has them.
#[inline(always)]
pub(super) fn word_at(b: &[u8], i: usize) -> Option<u64> {
    let bytes: [u8; 8] = b.get(i..i.checked_add(8)?)?.try_into().ok()?;
    Some(u64::from_le_bytes(bytes))
}

//! Compact JSON text of a `Serialize` value, byte for byte what `serde_json::to_string`
//! writes, for what records are made of: structs, maps with string keys, sequences,
//! strings, integers, booleans, options (floats are written by serde_json itself).
//!
//! Inside WebAssembly, serializing a record was a plugin's costliest work: the low-stock
//! alert on 10 000 keys ran 9.6% slower with each alert serialized twice. Here strings
//! (field names too) are looked at for escapes a word of 8 bytes at a time; a string
//! without escapes is written with its quotes, and a field's name with its comma and
//! colon, in one reservation and one run of moves; short copies are a few word moves
//! instead of a `memory.copy`. The plugin's share of that job's time went from ~11.5% to
//! ~8.7%; one reservation a string took an alert from ~3 000 to ~2 500 instructions
//! inside WebAssembly (1 665 to 1 530 natively).
//!
//! [`write`] gives up (false) on the little it does not write itself (floats as map
//! keys, serde_json's own `RawValue` and arbitrary-precision numbers, a failing
//! `Serialize`): the caller then asks serde_json, which writes those or says why not (the
//! value is then serialized twice).

use serde::ser::{self, Serialize};
use std::fmt;

/// Append the JSON text of `value` to `out`: true, or false with `out` as it was when
/// serde_json must write it. The writer writes ASCII and whole `str`s only (a string is
/// copied between the escapes it needs, which cut it at ASCII bytes): what it appends is
/// UTF-8.
pub fn write<T: Serialize + ?Sized>(out: &mut Vec<u8>, value: &T) -> bool {
    let start = out.len();
    let mut w = Writer { out: std::mem::take(out) };
    let written = value.serialize(&mut w).is_ok();
    *out = w.out;
    if !written {
        out.truncate(start);
    }
    written
}

struct Writer {
    out: Vec<u8>,
}

/// Why [`Writer`] stopped: a value it leaves to serde_json (or one that failed).
#[derive(Debug)]
pub struct GiveUp;

impl fmt::Display for GiveUp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("left to serde_json")
    }
}

impl std::error::Error for GiveUp {}

impl ser::Error for GiveUp {
    fn custom<T: fmt::Display>(_: T) -> Self {
        GiveUp
    }
}

/// Whether byte `c` is written escaped (serde_json escapes the ASCII control characters,
/// `"` and `\`, nothing else).
#[inline(always)]
fn escaped_byte(c: u8) -> bool {
    c < 0x20 || c == b'"' || c == b'\\'
}

/// Whether a byte of the word `w` is one [`escaped_byte`] says. Each test sets the high
/// bit of the lowest byte below a value (or equal to one), and none when there is no
/// such byte: the word's answer is exact (a borrow may mark a byte above a real match
/// too, which changes nothing here).
#[inline(always)]
fn word_escapes(w: u64) -> bool {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let below = |n: u8| w.wrapping_sub(ONES * u64::from(n)) & !w & HIGH;
    let equal = |c: u8| {
        let x = w ^ (ONES * u64::from(c));
        x.wrapping_sub(ONES) & !x & HIGH
    };
    below(0x20) | equal(b'"') | equal(b'\\') != 0
}

/// Whether any byte of `b` is written escaped. Inlined always, as [`string`].
#[inline(always)]
pub(crate) fn needs_escape(b: &[u8]) -> bool {
    any_word(b, word_escapes, escaped_byte)
}

/// Whether every byte of `b` is ASCII (below 0x80): [`any_word`]'s words, where the
/// standard `is_ascii` goes 4 bytes at a time in wasm32 (a key of 15 bytes took ~150
/// instructions inside WebAssembly).
#[inline(always)]
pub(crate) fn is_ascii(b: &[u8]) -> bool {
    const HIGH: u64 = 0x8080_8080_8080_8080;
    !any_word(b, |w| w & HIGH != 0, |c| c >= 0x80)
}

/// Whether `word` marks a word of 8 bytes of `b` (little-endian): a word at a time, the
/// last one overlapping the one before; 4 to 7 bytes as two overlapping halves (`word`
/// must mark a byte wherever it lies in the word); fewer than 4 a byte at a time, through
/// `byte` (field names and most string values are one or two words).
#[inline(always)]
fn any_word(b: &[u8], word: impl Fn(u64) -> bool, byte: impl Fn(u8) -> bool) -> bool {
    let n = b.len();
    if n < 4 {
        return b.iter().any(|&c| byte(c));
    }
    let half = |i: usize| u64::from(u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]));
    if n < 8 {
        return word(half(0) | half(n - 4) << 32);
    }
    let mut rest = b;
    while let Some((w, after)) = rest.split_first_chunk::<8>() {
        if word(u64::from_le_bytes(*w)) {
            return true;
        }
        rest = after;
    }
    match b.last_chunk::<8>() {
        Some(w) if !rest.is_empty() => word(u64::from_le_bytes(*w)),
        _ => false,
    }
}

/// Copy the `n` bytes at `src` to `dst`: up to 16 bytes by two (overlapping) word moves,
/// longer ones by `copy_nonoverlapping` (in WebAssembly a copy of unknown length is a
/// `memory.copy`, a call out of the guest).
///
/// # Safety
/// `src` is readable and `dst` writable for `n` bytes, and they do not overlap.
#[inline(always)]
unsafe fn copy_to(src: *const u8, dst: *mut u8, n: usize) {
    // SAFETY: the caller's; the two words of a case are the first and last ones of the
    // `n` bytes, overlapping when `n` is not twice their size.
    unsafe {
        if n > 16 {
            std::ptr::copy_nonoverlapping(src, dst, n);
        } else if n >= 8 {
            let (lo, hi) =
                (src.cast::<u64>().read_unaligned(), src.add(n - 8).cast::<u64>().read_unaligned());
            dst.cast::<u64>().write_unaligned(lo);
            dst.add(n - 8).cast::<u64>().write_unaligned(hi);
        } else if n >= 4 {
            let (lo, hi) =
                (src.cast::<u32>().read_unaligned(), src.add(n - 4).cast::<u32>().read_unaligned());
            dst.cast::<u32>().write_unaligned(lo);
            dst.add(n - 4).cast::<u32>().write_unaligned(hi);
        } else {
            for i in 0..n {
                *dst.add(i) = *src.add(i);
            }
        }
    }
}

/// Append `b` to `out` ([`copy_to`]'s word moves for up to 16 bytes).
#[inline(always)]
pub(crate) fn put(out: &mut Vec<u8>, b: &[u8]) {
    let n = b.len();
    out.reserve(n);
    let len = out.len();
    // SAFETY: `reserve` made room for `n` bytes after `len`, which `b` (another buffer)
    // fills; then they are initialized.
    unsafe {
        copy_to(b.as_ptr(), out.as_mut_ptr().add(len), n);
        out.set_len(len + n);
    }
}

/// Write `lead` (a comma before a field, or nothing), `s` as a JSON string, then `after`
/// (`:` after a name, nothing after a value; `lead` and `after` of at most 2 bytes).
/// A string without escapes, most of them, takes one reservation and no capacity check of
/// its own: a name with its comma and colon, or a value, is one run of moves. Inlined
/// always: a call cost about as much as the moves.
#[inline(always)]
fn string(out: &mut Vec<u8>, lead: &[u8], s: &str, after: &[u8]) {
    debug_assert!(lead.len() <= 2 && after.len() <= 2);
    let b = s.as_bytes();
    if needs_escape(b) {
        put(out, lead);
        return escaped(out, b, after);
    }
    let (n, l, a) = (b.len(), lead.len(), after.len());
    let total = l + n + 2 + a;
    out.reserve(total);
    let len = out.len();
    // SAFETY: `reserve` made room for `total` bytes after `len`, written in turn: `lead`,
    // a quote, `b`, a quote, `after` (other buffers than `out`); then they are
    // initialized.
    unsafe {
        let dst = out.as_mut_ptr().add(len);
        for (i, &c) in lead.iter().enumerate() {
            *dst.add(i) = c;
        }
        *dst.add(l) = b'"';
        copy_to(b.as_ptr(), dst.add(l + 1), n);
        *dst.add(l + 1 + n) = b'"';
        for (i, &c) in after.iter().enumerate() {
            *dst.add(l + n + 2 + i) = c;
        }
        out.set_len(len + total);
    }
}

/// [`string`] of bytes that need escapes (out of line: rare).
#[inline(never)]
fn escaped(out: &mut Vec<u8>, b: &[u8], after: &[u8]) {
    out.push(b'"');
    let mut from = 0;
    for (i, &c) in b.iter().enumerate() {
        if !escaped_byte(c) {
            continue;
        }
        out.extend_from_slice(&b[from..i]);
        match c {
            b'"' => out.extend_from_slice(b"\\\""),
            b'\\' => out.extend_from_slice(b"\\\\"),
            0x08 => out.extend_from_slice(b"\\b"),
            0x0C => out.extend_from_slice(b"\\f"),
            b'\n' => out.extend_from_slice(b"\\n"),
            b'\r' => out.extend_from_slice(b"\\r"),
            b'\t' => out.extend_from_slice(b"\\t"),
            _ => {
                const HEX: &[u8; 16] = b"0123456789abcdef";
                out.extend_from_slice(&[
                    b'\\',
                    b'u',
                    b'0',
                    b'0',
                    HEX[(c >> 4) as usize],
                    HEX[(c & 0xF) as usize],
                ]);
            }
        }
        from = i + 1;
    }
    out.extend_from_slice(&b[from..]);
    out.push(b'"');
    out.extend_from_slice(after);
}

impl Writer {
    #[inline]
    fn integer(&mut self, v: impl itoa::Integer) -> Result<(), GiveUp> {
        put(&mut self.out, itoa::Buffer::new().format(v).as_bytes());
        Ok(())
    }

    /// A float as serde_json writes it (`null` when not finite).
    fn float<T: Serialize>(&mut self, v: T) -> Result<(), GiveUp> {
        serde_json::to_writer(&mut self.out, &v).map_err(|_| GiveUp)
    }
}

/// A sequence, map or struct being written: whether its first item is still to come.
struct Compound<'a> {
    w: &'a mut Writer,
    first: bool,
}

impl Compound<'_> {
    #[inline]
    fn comma(&mut self) {
        if !std::mem::take(&mut self.first) {
            self.w.out.push(b',');
        }
    }
}

/// Inlined always, as `serialize_str`: a struct's fields are written in line (a call a
/// value cost ~45 instructions of entry and exit inside WebAssembly).
macro_rules! integers {
    ($($f:ident: $t:ty),*) => {
        $(#[inline(always)]
        fn $f(self, v: $t) -> Result<(), GiveUp> {
            self.integer(v)
        })*
    };
}

impl<'a> ser::Serializer for &'a mut Writer {
    type Ok = ();
    type Error = GiveUp;
    type SerializeSeq = Compound<'a>;
    type SerializeTuple = Compound<'a>;
    type SerializeTupleStruct = Compound<'a>;
    type SerializeTupleVariant = Variant<'a>;
    type SerializeMap = Compound<'a>;
    type SerializeStruct = Compound<'a>;
    type SerializeStructVariant = Variant<'a>;

    integers!(serialize_i8: i8, serialize_i16: i16, serialize_i32: i32, serialize_i64: i64, serialize_i128: i128,
        serialize_u8: u8, serialize_u16: u16, serialize_u32: u32, serialize_u64: u64, serialize_u128: u128);

    fn serialize_bool(self, v: bool) -> Result<(), GiveUp> {
        put(&mut self.out, if v { b"true" } else { b"false" });
        Ok(())
    }
    fn serialize_f32(self, v: f32) -> Result<(), GiveUp> {
        self.float(v)
    }
    fn serialize_f64(self, v: f64) -> Result<(), GiveUp> {
        self.float(v)
    }
    fn serialize_char(self, v: char) -> Result<(), GiveUp> {
        string(&mut self.out, b"", v.encode_utf8(&mut [0; 4]), b"");
        Ok(())
    }
    #[inline(always)]
    fn serialize_str(self, v: &str) -> Result<(), GiveUp> {
        string(&mut self.out, b"", v, b"");
        Ok(())
    }
    fn serialize_bytes(self, v: &[u8]) -> Result<(), GiveUp> {
        // As serde_json: an array of numbers.
        let mut seq = self.serialize_seq(Some(v.len()))?;
        v.iter().try_for_each(|b| ser::SerializeSeq::serialize_element(&mut seq, b))?;
        ser::SerializeSeq::end(seq)
    }
    fn serialize_none(self) -> Result<(), GiveUp> {
        self.serialize_unit()
    }
    fn serialize_some<T: Serialize + ?Sized>(self, v: &T) -> Result<(), GiveUp> {
        v.serialize(self)
    }
    fn serialize_unit(self) -> Result<(), GiveUp> {
        put(&mut self.out, b"null");
        Ok(())
    }
    fn serialize_unit_struct(self, _: &'static str) -> Result<(), GiveUp> {
        self.serialize_unit()
    }
    fn serialize_unit_variant(self, _: &'static str, _: u32, variant: &'static str) -> Result<(), GiveUp> {
        string(&mut self.out, b"", variant, b"");
        Ok(())
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(self, _: &'static str, v: &T) -> Result<(), GiveUp> {
        v.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        v: &T,
    ) -> Result<(), GiveUp> {
        // As serde_json: `{"variant":value}`.
        self.out.push(b'{');
        string(&mut self.out, b"", variant, b":");
        v.serialize(&mut *self)?;
        self.out.push(b'}');
        Ok(())
    }
    fn serialize_seq(self, _: Option<usize>) -> Result<Compound<'a>, GiveUp> {
        self.out.push(b'[');
        Ok(Compound { w: self, first: true })
    }
    fn serialize_tuple(self, len: usize) -> Result<Compound<'a>, GiveUp> {
        self.serialize_seq(Some(len))
    }
    fn serialize_tuple_struct(self, _: &'static str, len: usize) -> Result<Compound<'a>, GiveUp> {
        self.serialize_seq(Some(len))
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        _: usize,
    ) -> Result<Variant<'a>, GiveUp> {
        // As serde_json: `{"variant":[...]}`.
        self.out.push(b'{');
        string(&mut self.out, b"", variant, b":[");
        Ok(Variant(Compound { w: self, first: true }))
    }
    fn serialize_map(self, _: Option<usize>) -> Result<Compound<'a>, GiveUp> {
        self.out.push(b'{');
        Ok(Compound { w: self, first: true })
    }
    fn serialize_struct(self, name: &'static str, len: usize) -> Result<Compound<'a>, GiveUp> {
        // serde_json's own types (`RawValue`, an arbitrary-precision `Number`) are structs
        // of names it knows, and written otherwise.
        if name.starts_with("$serde_json::") {
            return Err(GiveUp);
        }
        self.serialize_map(Some(len))
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        _: usize,
    ) -> Result<Variant<'a>, GiveUp> {
        // As serde_json: `{"variant":{...}}`.
        self.out.push(b'{');
        string(&mut self.out, b"", variant, b":{");
        Ok(Variant(Compound { w: self, first: true }))
    }
}

/// A tuple or struct variant being written: its items, then two closing brackets.
struct Variant<'a>(Compound<'a>);

impl ser::SerializeTupleVariant for Variant<'_> {
    type Ok = ();
    type Error = GiveUp;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, v: &T) -> Result<(), GiveUp> {
        ser::SerializeSeq::serialize_element(&mut self.0, v)
    }
    fn end(self) -> Result<(), GiveUp> {
        put(&mut self.0.w.out, b"]}");
        Ok(())
    }
}

impl ser::SerializeStructVariant for Variant<'_> {
    type Ok = ();
    type Error = GiveUp;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, key: &'static str, v: &T) -> Result<(), GiveUp> {
        ser::SerializeStruct::serialize_field(&mut self.0, key, v)
    }
    fn end(self) -> Result<(), GiveUp> {
        put(&mut self.0.w.out, b"}}");
        Ok(())
    }
}

impl ser::SerializeSeq for Compound<'_> {
    type Ok = ();
    type Error = GiveUp;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, v: &T) -> Result<(), GiveUp> {
        self.comma();
        v.serialize(&mut *self.w)
    }
    fn end(self) -> Result<(), GiveUp> {
        self.w.out.push(b']');
        Ok(())
    }
}

impl ser::SerializeTuple for Compound<'_> {
    type Ok = ();
    type Error = GiveUp;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, v: &T) -> Result<(), GiveUp> {
        ser::SerializeSeq::serialize_element(self, v)
    }
    fn end(self) -> Result<(), GiveUp> {
        ser::SerializeSeq::end(self)
    }
}

impl ser::SerializeTupleStruct for Compound<'_> {
    type Ok = ();
    type Error = GiveUp;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, v: &T) -> Result<(), GiveUp> {
        ser::SerializeSeq::serialize_element(self, v)
    }
    fn end(self) -> Result<(), GiveUp> {
        ser::SerializeSeq::end(self)
    }
}

impl ser::SerializeMap for Compound<'_> {
    type Ok = ();
    type Error = GiveUp;
    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result<(), GiveUp> {
        self.comma();
        key.serialize(KeyWriter(&mut *self.w))
    }
    fn serialize_value<T: Serialize + ?Sized>(&mut self, v: &T) -> Result<(), GiveUp> {
        v.serialize(&mut *self.w)
    }
    fn end(self) -> Result<(), GiveUp> {
        self.w.out.push(b'}');
        Ok(())
    }
}

impl ser::SerializeStruct for Compound<'_> {
    type Ok = ();
    type Error = GiveUp;
    /// Inlined always: a struct's fields are written in line in its `serialize` (a call
    /// a field cost ~45 instructions of entry and exit inside WebAssembly).
    #[inline(always)]
    fn serialize_field<T: Serialize + ?Sized>(&mut self, key: &'static str, v: &T) -> Result<(), GiveUp> {
        let lead: &[u8] = if std::mem::take(&mut self.first) { b"" } else { b"," };
        string(&mut self.w.out, lead, key, b":");
        v.serialize(&mut *self.w)
    }
    fn end(self) -> Result<(), GiveUp> {
        self.w.out.push(b'}');
        Ok(())
    }
}

/// A map key, written with its colon: a string, or an integer, a boolean, a character or
/// a unit variant in quotes, as serde_json writes them (a float is left to it).
struct KeyWriter<'a>(&'a mut Writer);

impl KeyWriter<'_> {
    fn quoted(self, text: &[u8]) -> Result<(), GiveUp> {
        let out = &mut self.0.out;
        out.push(b'"');
        put(out, text);
        put(out, b"\":");
        Ok(())
    }
}

macro_rules! quoted_integers {
    ($($f:ident: $t:ty),*) => {
        $(fn $f(self, v: $t) -> Result<(), GiveUp> {
            self.quoted(itoa::Buffer::new().format(v).as_bytes())
        })*
    };
}

macro_rules! refused {
    ($($f:ident: $t:ty),*) => {
        $(fn $f(self, _: $t) -> Result<(), GiveUp> {
            Err(GiveUp)
        })*
    };
}

impl ser::Serializer for KeyWriter<'_> {
    type Ok = ();
    type Error = GiveUp;
    type SerializeSeq = ser::Impossible<(), GiveUp>;
    type SerializeTuple = ser::Impossible<(), GiveUp>;
    type SerializeTupleStruct = ser::Impossible<(), GiveUp>;
    type SerializeTupleVariant = ser::Impossible<(), GiveUp>;
    type SerializeMap = ser::Impossible<(), GiveUp>;
    type SerializeStruct = ser::Impossible<(), GiveUp>;
    type SerializeStructVariant = ser::Impossible<(), GiveUp>;

    quoted_integers!(serialize_i8: i8, serialize_i16: i16, serialize_i32: i32, serialize_i64: i64,
        serialize_i128: i128, serialize_u8: u8, serialize_u16: u16, serialize_u32: u32, serialize_u64: u64,
        serialize_u128: u128);
    refused!(serialize_f32: f32, serialize_f64: f64, serialize_bytes: &[u8], serialize_unit_struct: &'static str);

    fn serialize_bool(self, v: bool) -> Result<(), GiveUp> {
        self.quoted(if v { b"true" } else { b"false" })
    }
    fn serialize_char(self, v: char) -> Result<(), GiveUp> {
        string(&mut self.0.out, b"", v.encode_utf8(&mut [0; 4]), b":");
        Ok(())
    }

    fn serialize_str(self, v: &str) -> Result<(), GiveUp> {
        string(&mut self.0.out, b"", v, b":");
        Ok(())
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(self, _: &'static str, v: &T) -> Result<(), GiveUp> {
        v.serialize(self)
    }
    fn serialize_none(self) -> Result<(), GiveUp> {
        Err(GiveUp)
    }
    fn serialize_some<T: Serialize + ?Sized>(self, _: &T) -> Result<(), GiveUp> {
        Err(GiveUp)
    }
    fn serialize_unit(self) -> Result<(), GiveUp> {
        Err(GiveUp)
    }
    fn serialize_unit_variant(self, _: &'static str, _: u32, variant: &'static str) -> Result<(), GiveUp> {
        string(&mut self.0.out, b"", variant, b":");
        Ok(())
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: &T,
    ) -> Result<(), GiveUp> {
        Err(GiveUp)
    }
    fn serialize_seq(self, _: Option<usize>) -> Result<Self::SerializeSeq, GiveUp> {
        Err(GiveUp)
    }
    fn serialize_tuple(self, _: usize) -> Result<Self::SerializeTuple, GiveUp> {
        Err(GiveUp)
    }
    fn serialize_tuple_struct(self, _: &'static str, _: usize) -> Result<Self::SerializeTupleStruct, GiveUp> {
        Err(GiveUp)
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeTupleVariant, GiveUp> {
        Err(GiveUp)
    }
    fn serialize_map(self, _: Option<usize>) -> Result<Self::SerializeMap, GiveUp> {
        Err(GiveUp)
    }
    fn serialize_struct(self, _: &'static str, _: usize) -> Result<Self::SerializeStruct, GiveUp> {
        Err(GiveUp)
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeStructVariant, GiveUp> {
        Err(GiveUp)
    }
}

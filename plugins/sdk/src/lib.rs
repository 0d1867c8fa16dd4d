//! Guest SDK for km0 aggregate plugins.
//!
//! A plugin author implements [`Aggregate`] (typed accumulator, per-group `add`, `merge`,
//! `finish`, optional `migrate`) and calls [`export_plugin!`]. Everything else is this
//! crate's business: the WIT bindings of `wit/aggregate.wit`, the packed/columnar batch
//! format, the accumulator encoding (postcard over serde, the fresh accumulator being
//! `Default`), and the JSON text of emitted records (serde_json's text, written by a
//! writer of its own for the common shapes: see `json.rs`).
//!
//! ```ignore
//! use km0_plugin::{Aggregate, Config, Events, Field, Group, Output};
//! #[derive(Default, serde::Serialize, serde::Deserialize)]
//! struct Acc { n: u64 }
//! struct Count;
//! impl Aggregate for Count {
//!     const NAME: &'static str = "count";
//!     const STATE_SCHEMA: u32 = 1;
//!     const FIELDS: &'static [Field] = &[];
//!     type Acc = Acc;
//!     fn configure(_: &Config) -> Result<Self, String> { Ok(Count) }
//!     fn add(&self, acc: &mut Acc, _: &Group, ev: &Events) { acc.n += ev.len() as u64 }
//!     fn merge(&self, acc: &mut Acc, other: Acc) { acc.n += other.n }
//!     fn finish(&self, acc: &Acc, g: &Group, out: &mut Output) { out.emit(&acc.n) }
//! }
//! km0_plugin::export_plugin!(Count);
//! ```

#[doc(hidden)]
pub mod bindings {
    wit_bindgen::generate!({
        path: "../../wit",
        world: "km0:plugin/firing-aggregate-plugin",
        pub_export_macro: true,
        export_macro_name: "__export_aggregate",
        default_bindings_module: "km0_plugin::bindings",
    });
}

#[doc(hidden)]
pub mod __rt {
    pub use crate::runtime::*;
}
mod json;
mod runtime;

use bindings::km0::plugin::types as wit;
use serde::{de::DeserializeOwned, Serialize};

/// Version of the WIT contract this SDK implements.
pub const CONTRACT_VERSION: &str = "0.5.0";

/// Type of a field the plugin reads from every event.
#[derive(Clone, Copy, Debug)]
pub enum FieldType {
    Int,
    Float,
    Text,
    Boolean,
}

/// A field the plugin reads from every event; its position in [`Aggregate::FIELDS`] is its
/// column index in [`Events`].
#[derive(Clone, Copy, Debug)]
pub struct Field {
    pub name: &'static str,
    pub ty: FieldType,
}

impl Field {
    pub const fn int(name: &'static str) -> Self {
        Field { name, ty: FieldType::Int }
    }
    pub const fn float(name: &'static str) -> Self {
        Field { name, ty: FieldType::Float }
    }
    pub const fn text(name: &'static str) -> Self {
        Field { name, ty: FieldType::Text }
    }
    pub const fn boolean(name: &'static str) -> Self {
        Field { name, ty: FieldType::Boolean }
    }
}

/// The user's logic: an incremental aggregate over the events of one (key, window).
pub trait Aggregate: Sized + 'static {
    /// Stable name of the logic; savepoints are deployed only onto the same name.
    const NAME: &'static str;
    /// Version of `Acc`'s layout. Bump it when `Acc` changes and read the old layout in
    /// [`Aggregate::migrate`].
    const STATE_SCHEMA: u32;
    /// Fields read from each event, in column order.
    const FIELDS: &'static [Field];
    /// True if `add` needs each group's events in event-time order.
    const ORDERED_INPUT: bool = false;
    /// How many key fields the plugin reads ([`Group::key`]`(0..KEY_FIELDS)`): km0 refuses
    /// a pipeline whose `key` is shorter. 0: any.
    const KEY_FIELDS: u32 = 0;

    /// The accumulator. `Default` is the fresh accumulator of a new window. It must read
    /// back (postcard over serde) as it was written: a window that closes as it fires is
    /// folded and finished in one call, without the accumulator being written in between
    /// (the contract's `fire`), and a sliding window's merged panes are finished without
    /// the merged accumulator being written (the contract's `panes`).
    type Acc: Default + Serialize + DeserializeOwned;

    /// Build the plugin from the pipeline's `[plugin.config]`.
    fn configure(config: &Config) -> Result<Self, String>;
    /// Fold a group's events into its accumulator.
    fn add(&self, acc: &mut Self::Acc, group: &Group<'_>, events: &Events<'_>);
    /// Fold `other` (later events, for ordered plugins) into `acc`.
    fn merge(&self, acc: &mut Self::Acc, other: Self::Acc);
    /// The window fired: emit zero or more records.
    fn finish(&self, acc: &Self::Acc, group: &Group<'_>, out: &mut Output);
    /// Read an accumulator written with an older `STATE_SCHEMA`. The default refuses.
    fn migrate(&self, from_schema: u32, bytes: &[u8]) -> Result<Self::Acc, String> {
        let _ = bytes;
        Err(format!(
            "{} (state schema {}) cannot read accumulators of state schema {from_schema}",
            Self::NAME,
            Self::STATE_SCHEMA
        ))
    }
}

/// Decode an accumulator of any layout written by this SDK (for `migrate`). Inlined: the
/// empty item, the fresh accumulator (every window's in a tumbling job's firing), is
/// taken without a call (~50 instructions of entry and exit inside WebAssembly).
#[inline]
pub fn decode<T: Default + DeserializeOwned>(bytes: &[u8]) -> Result<T, String> {
    if bytes.is_empty() {
        return Ok(T::default());
    }
    decode_written(bytes)
}

/// [`decode`] of a non-empty accumulator.
#[inline(never)]
fn decode_written<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, String> {
    let (acc, rest) =
        postcard::take_from_bytes(bytes).map_err(|e| format!("undecodable accumulator: {e}"))?;
    if !rest.is_empty() {
        return Err(format!("undecodable accumulator: {} bytes left over", rest.len()));
    }
    Ok(acc)
}

/// The pipeline's `[plugin.config]`, values as JSON.
pub struct Config {
    entries: Vec<(String, serde_json::Value)>,
}

impl Config {
    /// The raw JSON value of `name`, if present.
    pub fn get(&self, name: &str) -> Option<&serde_json::Value> {
        self.entries.iter().find(|(k, _)| k == name).map(|(_, v)| v)
    }
    /// An integer setting, `default` when absent; an error naming the setting when mistyped.
    pub fn int_or(&self, name: &str, default: i64) -> Result<i64, String> {
        match self.get(name) {
            None => Ok(default),
            Some(v) => v.as_i64().ok_or_else(|| format!("config `{name}` must be an integer, got {v}")),
        }
    }
    /// A float setting, `default` when absent.
    pub fn float_or(&self, name: &str, default: f64) -> Result<f64, String> {
        match self.get(name) {
            None => Ok(default),
            Some(v) => v.as_f64().ok_or_else(|| format!("config `{name}` must be a number, got {v}")),
        }
    }
    /// Names present in the config, to reject unknown settings.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().map(|(k, _)| k.as_str())
    }
    /// Refuse settings not in `known`.
    pub fn only(&self, known: &[&str]) -> Result<(), String> {
        match self.names().find(|n| !known.contains(n)) {
            Some(n) => Err(format!("unknown config `{n}` (known: {})", known.join(", "))),
            None => Ok(()),
        }
    }
}

/// The (key, window) a call is about.
pub struct Group<'a> {
    keys: &'a wit::Packed,
    first_key: usize,
    arity: usize,
    /// Window start, epoch ms (inclusive).
    pub window_start: i64,
    /// Window end, epoch ms (exclusive).
    pub window_end: i64,
}

impl<'a> Group<'a> {
    /// Key field `j` (in the pipeline's `key` order). Inlined always: a call cost ~100
    /// instructions of entry and exit inside WebAssembly, more than the work.
    #[inline(always)]
    pub fn key(&self, j: usize) -> &'a str {
        assert!(j < self.arity, "key field {j} out of range (arity {})", self.arity);
        packed_str(self.keys, self.first_key + j)
    }
    /// Number of key fields.
    pub fn key_arity(&self) -> usize {
        self.arity
    }
}

/// The events of one group, in columns.
pub struct Events<'a> {
    times: &'a [i64],
    columns: &'a [wit::Column],
    start: usize,
}

impl<'a> Events<'a> {
    pub fn len(&self) -> usize {
        self.times.len()
    }
    pub fn is_empty(&self) -> bool {
        self.times.is_empty()
    }
    /// Event times, epoch ms.
    pub fn times(&self) -> &'a [i64] {
        self.times
    }
    fn range(&self) -> std::ops::Range<usize> {
        self.start..self.start + self.times.len()
    }
    /// Column `c`, declared `Field::int`.
    pub fn ints(&self, c: usize) -> &'a [i64] {
        match &self.columns[c] {
            wit::Column::Int(v) => &v[self.range()],
            _ => panic!("column {c} is not an int column"),
        }
    }
    /// Column `c`, declared `Field::float`.
    pub fn floats(&self, c: usize) -> &'a [f64] {
        match &self.columns[c] {
            wit::Column::Float(v) => &v[self.range()],
            _ => panic!("column {c} is not a float column"),
        }
    }
    /// Column `c`, declared `Field::boolean`: 0 or 1 per row.
    pub fn bools(&self, c: usize) -> &'a [u8] {
        match &self.columns[c] {
            wit::Column::Boolean(v) => &v[self.range()],
            _ => panic!("column {c} is not a boolean column"),
        }
    }
    /// Row `i` of column `c`, declared `Field::text`.
    pub fn text(&self, c: usize, i: usize) -> &'a str {
        match &self.columns[c] {
            wit::Column::Text(p) => packed_str(p, self.start + i),
            _ => panic!("column {c} is not a text column"),
        }
    }
}

/// Where `finish` writes its records: their texts back to back in one buffer, each
/// record's group beside it (the contract's `packed-records`; one allocation a call, not
/// one a record).
pub struct Output {
    group: u32,
    /// Group of every record.
    groups: Vec<u32>,
    /// The records' texts, and where each ends.
    values: wit::Packed,
}

impl Output {
    fn new() -> Output {
        Output { group: 0, groups: Vec::new(), values: wit::Packed { bytes: Vec::new(), ends: Vec::new() } }
    }

    /// Emit one record; its value must serialize to a JSON object (the text serde_json
    /// writes for it).
    pub fn emit<T: Serialize + ?Sized>(&mut self, value: &T) {
        if !json::write(&mut self.values.bytes, value) {
            serde_json::to_writer(&mut self.values.bytes, value).expect("record serializes to JSON");
        }
        self.end_record();
    }

    /// Emit a value given as JSON text, as is (the host checks it).
    pub fn emit_raw(&mut self, json: &str) {
        self.values.bytes.extend_from_slice(json.as_bytes());
        self.end_record();
    }

    fn end_record(&mut self) {
        self.values.ends.push(self.values.bytes.len() as u32);
        self.groups.push(self.group);
    }
}

fn packed_item(p: &wit::Packed, i: usize) -> &[u8] {
    let start = if i == 0 { 0 } else { p.ends[i - 1] as usize };
    &p.bytes[start..p.ends[i] as usize]
}

#[inline(always)]
fn packed_str(p: &wit::Packed, i: usize) -> &str {
    let b = packed_item(p, i);
    if json::is_ascii(b) {
        // SAFETY: ASCII is UTF-8 (most keys are: checked without `from_utf8`'s setup).
        return unsafe { std::str::from_utf8_unchecked(b) };
    }
    std::str::from_utf8(b).expect("host sends UTF-8 text")
}

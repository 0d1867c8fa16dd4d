//! State as snapshots hold it: saved slots and staged rows, an operator's and the job's
//! counters, and the codec of rows and keys that `state.bin`
//! ([`crate::checkpoint::savepoint`]) and the RocksDB backend ([`super::rocks`]) share.

use super::captured::put_key;
use crate::time::Window;
use serde::{Deserialize, Serialize};

/// What happened to the records, cumulative across savepoint resumes. The per-event
/// counts are summed over the pipeline's aggregations.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    /// Records read from the source.
    pub read: u64,
    /// Records that did not match the pipeline's filter.
    pub filtered: u64,
    /// Records sent to the dead-letter output.
    pub dead_lettered: u64,
    /// Events past every window's allowed lateness (late side output).
    pub late: u64,
    /// Accepted events whose window had already fired (re-emitted within lateness).
    pub late_updates: u64,
    /// Events added to a window.
    pub accepted: u64,
    /// Window results computed (with or without output).
    pub windows_fired: u64,
    /// Result records written.
    pub emitted: u64,
    /// Retractions written (a session's result superseded under another key).
    #[serde(default)]
    pub retracted: u64,
}

impl Counters {
    /// Add another task's counters (a job of several tasks).
    pub fn add(&mut self, o: &Counters) {
        self.read += o.read;
        self.filtered += o.filtered;
        self.dead_lettered += o.dead_lettered;
        self.add_events(&OperatorCounters {
            accepted: o.accepted,
            late: o.late,
            late_updates: o.late_updates,
            windows_fired: o.windows_fired,
            emitted: o.emitted,
            retracted: o.retracted,
            ..OperatorCounters::default()
        });
    }

    /// Add what an aggregation did with its events.
    pub fn add_events(&mut self, o: &OperatorCounters) {
        self.accepted += o.accepted;
        self.late += o.late;
        self.late_updates += o.late_updates;
        self.windows_fired += o.windows_fired;
        self.emitted += o.emitted;
        self.retracted += o.retracted;
    }
}

impl OperatorCounters {
    /// Add another task's counters of the same aggregation.
    pub fn add(&mut self, o: &OperatorCounters) {
        self.accepted += o.accepted;
        self.late += o.late;
        self.late_updates += o.late_updates;
        self.windows_fired += o.windows_fired;
        self.emitted += o.emitted;
        self.retracted += o.retracted;
        self.quarantined += o.quarantined;
    }
}

/// What one aggregation did, cumulative across savepoint resumes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OperatorCounters {
    /// Events added to a slot.
    pub accepted: u64,
    /// Events past every window's allowed lateness (sent to the late side output).
    pub late: u64,
    /// Accepted events whose window had already fired (re-emitted within the lateness).
    pub late_updates: u64,
    /// Window results computed (a re-emission counts again).
    pub windows_fired: u64,
    /// Result records written.
    pub emitted: u64,
    /// Retractions written (results superseded under another key).
    #[serde(default)]
    pub retracted: u64,
    /// Events of quarantined keys, dead-lettered without a call.
    #[serde(default)]
    pub quarantined: u64,
}

/// One staged value, for savepoints.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Int(i64),
    Float(f64),
    Text(String),
    Bool(bool),
}

/// One saved slot. `key` is encoded as in [`crate::state::KeyTable`]: each field a
/// little-endian u32 length and its UTF-8 bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SavedSlot {
    pub key: Vec<u8>,
    pub id: i64,
    pub window: Window,
    pub acc: Vec<u8>,
}

/// A saved staged row (ordered plugins keep rows until their slot is complete).
#[derive(Debug, Clone, PartialEq)]
pub struct SavedRow {
    pub key: Vec<u8>,
    pub id: i64,
    pub time: i64,
    pub values: Vec<Value>,
}

/// An operator's state as savepoints hold it.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub slots: Vec<SavedSlot>,
    pub rows: Vec<SavedRow>,
    pub counters: OperatorCounters,
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u32).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// Staged rows: u64 count, then each row as in `state.bin`.
pub fn encode_rows(rows: &[SavedRow]) -> Vec<u8> {
    let mut out = Vec::new();
    encode_rows_into(&mut out, rows);
    out
}

pub(crate) fn encode_rows_into(out: &mut Vec<u8>, rows: &[SavedRow]) {
    out.extend_from_slice(&(rows.len() as u64).to_le_bytes());
    for r in rows {
        put_key(out, &r.key);
        out.extend_from_slice(&r.id.to_le_bytes());
        out.extend_from_slice(&r.time.to_le_bytes());
        out.extend_from_slice(&(r.values.len() as u32).to_le_bytes());
        for v in &r.values {
            match v {
                Value::Int(x) => {
                    out.push(0);
                    out.extend_from_slice(&x.to_le_bytes());
                }
                Value::Float(x) => {
                    out.push(1);
                    out.extend_from_slice(&x.to_bits().to_le_bytes());
                }
                Value::Text(x) => {
                    out.push(2);
                    put_str(out, x);
                }
                Value::Bool(x) => {
                    out.push(3);
                    out.push(*x as u8);
                }
            }
        }
    }
}

/// Inverse of [`encode_rows`].
pub fn decode_rows(bytes: &[u8]) -> Result<Vec<SavedRow>, String> {
    let mut r = Reader(bytes);
    let rows = r.rows()?;
    if !r.0.is_empty() {
        return Err("bytes after the rows".into());
    }
    Ok(rows)
}

/// Little-endian reader over a state file.
pub(crate) struct Reader<'a>(pub(crate) &'a [u8]);

impl<'a> Reader<'a> {
    pub(crate) fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.0.len() < n {
            return Err("truncated".into());
        }
        let (a, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(a)
    }
    pub(crate) fn arr<const N: usize>(&mut self) -> Result<[u8; N], String> {
        self.take(N)?.try_into().map_err(|_| "truncated".to_string())
    }
    pub(crate) fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.arr()?))
    }
    pub(crate) fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.arr()?))
    }
    pub(crate) fn i64(&mut self) -> Result<i64, String> {
        Ok(i64::from_le_bytes(self.arr()?))
    }
    pub(crate) fn string(&mut self) -> Result<String, String> {
        let len = self.u32()? as usize;
        Ok(std::str::from_utf8(self.take(len)?).map_err(|_| "string is not UTF-8")?.to_string())
    }
    /// A key: u32 field count, then each field as a u32 length and its UTF-8 bytes. After
    /// the count that is the encoded key itself (see [`crate::state::push_key_field`]):
    /// its fields are checked, then it is copied whole.
    pub(crate) fn key(&mut self) -> Result<Vec<u8>, String> {
        let arity = self.u32()?;
        let encoded = self.0;
        for _ in 0..arity {
            let len = self.u32()? as usize;
            if !crate::state::utf8_field(self.take(len)?) {
                return Err("key field is not UTF-8".into());
            }
        }
        Ok(encoded[..encoded.len() - self.0.len()].to_vec())
    }
    pub(crate) fn count(&mut self) -> Result<usize, String> {
        let n = self.u64()?;
        // Every item takes at least 8 bytes: a larger count is corruption.
        if n > self.0.len() as u64 / 8 {
            return Err("count larger than the file".into());
        }
        Ok(n as usize)
    }
    pub(crate) fn rows(&mut self) -> Result<Vec<SavedRow>, String> {
        let mut rows = Vec::new();
        for _ in 0..self.count()? {
            let key = self.key()?;
            let id = self.i64()?;
            let time = self.i64()?;
            let n = self.u32()?;
            let mut values = Vec::new();
            for _ in 0..n {
                values.push(match self.take(1)?[0] {
                    0 => Value::Int(self.i64()?),
                    1 => Value::Float(f64::from_bits(self.u64()?)),
                    2 => Value::Text(self.string()?),
                    3 => Value::Bool(self.take(1)?[0] != 0),
                    t => return Err(format!("unknown value tag {t}")),
                });
            }
            rows.push(SavedRow { key, id, time, values });
        }
        Ok(rows)
    }
}

//! Decoding: a record's projected fields, the pipeline's filter, its event time (within
//! the accepted range), its key and its partition; and, per aggregation, the projection
//! slot of each plugin column.

use crate::pipeline::Pipeline;
use crate::plugin::Field;
use crate::source::json::{Projection, Scalar};
use crate::state::push_key_field;
use crate::state::short_eq;
use crate::{Error, Result};
use std::borrow::Cow;

/// Most distinct fields a job may project (time, filter, key, partition, plugin fields).
pub const MAX_FIELDS: usize = 32;

/// Turns a record into an event: projection, filter, partition, event time, key.
pub struct Decoder {
    pub projection: Projection,
    pub names: Vec<String>,
    pub time_slot: usize,
    /// Accepted event times, `[min, max)`.
    pub time_range: (i64, i64),
    pub filters: Vec<(usize, String)>,
    pub key_slots: Vec<usize>,
    pub partition_slot: Option<usize>,
}

/// Why a record is not an event.
pub enum Reject {
    Filtered,
    Dead(String),
}

impl Decoder {
    /// The decoder and, per aggregation, the projection slot of each of its plugin's
    /// fields (`plugins`: each aggregation's plugin name and fields).
    pub fn new(pipeline: &Pipeline, plugins: &[(&str, &[Field])]) -> Result<(Decoder, Vec<Vec<usize>>)> {
        let mut names: Vec<String> = Vec::new();
        let mut slot = |name: &str| -> usize {
            match names.iter().position(|n| n == name) {
                Some(i) => i,
                None => {
                    names.push(name.to_string());
                    names.len() - 1
                }
            }
        };
        let time_slot = slot(&pipeline.event_time.field);
        let filters = pipeline.filter.iter().map(|(k, v)| (slot(k), v.clone())).collect();
        let key_slots = pipeline.key.iter().map(|k| slot(k)).collect();
        let partition_slot = pipeline.source.partitioning().field.as_deref().map(&mut slot);
        let mut columns = Vec::new();
        for &(plugin, fields) in plugins {
            let mut cols = Vec::new();
            for f in fields {
                if f.name.is_empty() {
                    return Err(Error::Plugin {
                        plugin: plugin.to_string(),
                        message: "declares a field with no name".into(),
                    });
                }
                cols.push(slot(&f.name));
            }
            columns.push(cols);
        }
        if names.len() > MAX_FIELDS {
            return Err(Error::Pipeline {
                path: pipeline.file.clone(),
                message: format!("the job reads {} fields; at most {MAX_FIELDS}", names.len()),
            });
        }
        let decoder = Decoder {
            projection: Projection::new(&names),
            names,
            time_slot,
            time_range: (pipeline.event_time.min_ms, pipeline.event_time.max_ms),
            filters,
            key_slots,
            partition_slot,
        };
        Ok((decoder, columns))
    }

    pub fn missing(&self, slot: usize) -> Reject {
        Reject::Dead(format!("missing field `{}`", self.names[slot]))
    }

    pub fn wrong(&self, slot: usize, want: &str, got: &Scalar) -> Reject {
        Reject::Dead(format!("field `{}`: expected {want}, got {}", self.names[slot], got.kind()))
    }

    /// Check the filter and the event time.
    #[inline]
    pub fn event_time(&self, slots: &[Option<Scalar>]) -> Result<i64, Reject> {
        for (slot, want) in &self.filters {
            let matches = match &slots[*slot] {
                Some(Scalar::Str { raw, escaped: false }) => short_eq(raw, want.as_bytes()),
                Some(s @ Scalar::Str { escaped: true, .. }) => {
                    matches!(s.as_str(), Some(Ok(v)) if v == want.as_str())
                }
                _ => false,
            };
            if !matches {
                return Err(Reject::Filtered);
            }
        }
        let t = self.time_slot;
        match &slots[t] {
            Some(Scalar::Int(v)) if (self.time_range.0..self.time_range.1).contains(v) => Ok(*v),
            Some(Scalar::Int(v)) => Err(Reject::Dead(format!(
                "field `{}`: event time {v} is outside the accepted range [{}, {}) epoch ms \
                 (set [event_time] min/max to change it)",
                self.names[t], self.time_range.0, self.time_range.1
            ))),
            Some(Scalar::Number(raw)) => Err(Reject::Dead(format!(
                "field `{}`: timestamp {} is not an integer number of epoch milliseconds",
                self.names[t],
                String::from_utf8_lossy(raw)
            ))),
            Some(other) => Err(self.wrong(t, "integer epoch milliseconds", other)),
            None => Err(self.missing(t)),
        }
    }

    /// Build the encoded key (UTF-8 is checked when a key is first seen: `valid_key`).
    #[inline]
    pub fn key(&self, slots: &[Option<Scalar>], out: &mut Vec<u8>) -> Result<(), Reject> {
        out.clear();
        for &k in &self.key_slots {
            match &slots[k] {
                Some(Scalar::Str { raw, escaped: false }) => push_key_field(out, raw),
                Some(s @ Scalar::Str { escaped: true, .. }) => match s.as_str() {
                    Some(Ok(v)) => push_key_field(out, v.as_bytes()),
                    Some(Err(e)) => {
                        return Err(Reject::Dead(format!("field `{}`: {}", self.names[k], e.message)))
                    }
                    None => unreachable!("a Str scalar is a string"),
                },
                Some(Scalar::Int(i)) => push_key_field(out, i.to_string().as_bytes()),
                Some(other) => return Err(self.wrong(k, "a string", other)),
                None => return Err(self.missing(k)),
            }
        }
        Ok(())
    }

    /// The partition named by the partition field (absent: the "" partition).
    pub fn partition_name<'a>(&self, slots: &[Option<Scalar<'a>>]) -> Cow<'a, str> {
        match self.partition_slot.and_then(|s| slots[s]) {
            Some(s @ Scalar::Str { .. }) => match s.as_str() {
                Some(Ok(v)) => v,
                _ => Cow::Borrowed(""),
            },
            Some(Scalar::Int(i)) => Cow::Owned(i.to_string()),
            _ => Cow::Borrowed(""),
        }
    }
}

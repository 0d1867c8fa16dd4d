//! The glue between the WIT exports and an [`Aggregate`]: decodes the packed batches,
//! keeps the configured plugin for the instance's lifetime, encodes accumulators.
//! Not part of the author-facing API (`export_plugin!` calls it).

use crate::bindings::exports::km0::plugin::aggregate as exports;
use crate::bindings::exports::km0::plugin::packed_records;
use crate::bindings::km0::plugin::types as wit;
use crate::{packed_item, Aggregate, Config, Events, FieldType, Group, Output};
use std::any::Any;
use std::cell::RefCell;

thread_local! {
    static PLUGIN: RefCell<Option<Box<dyn Any>>> = const { RefCell::new(None) };
}

fn with_plugin<T: Aggregate, R>(f: impl FnOnce(&T) -> Result<R, String>) -> Result<R, String> {
    PLUGIN.with(|p| {
        let p = p.borrow();
        let plugin = p
            .as_ref()
            .and_then(|b| b.downcast_ref::<T>())
            .ok_or_else(|| format!("{} was called before configure", T::NAME))?;
        f(plugin)
    })
}

pub fn info<T: Aggregate>(version: &str) -> exports::PluginInfo {
    wit::PluginInfo {
        name: T::NAME.to_string(),
        version: version.to_string(),
        state_schema: T::STATE_SCHEMA,
        fields: T::FIELDS
            .iter()
            .map(|f| wit::Field {
                name: f.name.to_string(),
                type_: match f.ty {
                    FieldType::Int => wit::FieldType::Int,
                    FieldType::Float => wit::FieldType::Float,
                    FieldType::Text => wit::FieldType::Text,
                    FieldType::Boolean => wit::FieldType::Boolean,
                },
            })
            .collect(),
        ordered_input: T::ORDERED_INPUT,
    }
}

pub fn configure<T: Aggregate>(config: Vec<(String, String)>) -> Result<(), String> {
    let mut entries = Vec::with_capacity(config.len());
    for (k, v) in config {
        let value = serde_json::from_str(&v).map_err(|e| format!("config `{k}`: {e}"))?;
        entries.push((k, value));
    }
    let plugin = T::configure(&Config { entries })?;
    PLUGIN.with(|p| *p.borrow_mut() = Some(Box::new(plugin)));
    Ok(())
}

pub fn create<T: Aggregate>() -> Vec<u8> {
    encode_one(&T::Acc::default())
}

fn encode_one<A: serde::Serialize>(acc: &A) -> Vec<u8> {
    postcard::to_allocvec(acc).expect("accumulator serializes")
}

/// Appends to a byte vector: one `extend_from_slice` per field, where postcard's `to_extend`
/// goes through `Extend` a byte at a time.
struct Append<'a>(&'a mut Vec<u8>);

impl postcard::ser_flavors::Flavor for Append<'_> {
    type Output = ();
    #[inline]
    fn try_push(&mut self, byte: u8) -> postcard::Result<()> {
        self.0.push(byte);
        Ok(())
    }
    #[inline]
    fn try_extend(&mut self, bytes: &[u8]) -> postcard::Result<()> {
        // A varint's few bytes: word moves, not a `memory.copy`.
        crate::json::put(self.0, bytes);
        Ok(())
    }
    fn finalize(self) -> postcard::Result<()> {
        Ok(())
    }
}

fn encode_into<A: serde::Serialize>(acc: &A, out: &mut wit::Packed) -> Result<(), String> {
    postcard::serialize_with_flavor(acc, Append(&mut out.bytes))
        .map_err(|e| format!("encode accumulator: {e}"))?;
    out.ends.push(out.bytes.len() as u32);
    Ok(())
}

fn packed_with_capacity(n: usize) -> wit::Packed {
    wit::Packed { bytes: Vec::with_capacity(n * 16), ends: Vec::with_capacity(n) }
}

fn check_groups(g: &wit::Groups) -> Result<usize, String> {
    let n = g.window_start.len();
    let arity = g.key_arity as usize;
    if g.window_end.len() != n || g.accumulators.ends.len() != n || g.keys.ends.len() != n * arity {
        return Err(format!(
            "malformed groups: {n} windows, {} ends, {} accumulators, {} keys of arity {arity}",
            g.window_end.len(),
            g.accumulators.ends.len(),
            g.keys.ends.len()
        ));
    }
    Ok(n)
}

fn group_view(g: &wit::Groups, i: usize) -> Group<'_> {
    let arity = g.key_arity as usize;
    Group {
        keys: &g.keys,
        first_key: i * arity,
        arity,
        window_start: g.window_start[i],
        window_end: g.window_end[i],
    }
}

pub fn add<T: Aggregate>(groups: wit::Groups, events: wit::Events) -> Result<wit::Packed, String> {
    with_plugin::<T, _>(|plugin| {
        let mut out = packed_with_capacity(groups.window_start.len());
        fold(plugin, &groups, &events, |_, acc, _| encode_into(acc, &mut out))?;
        Ok(out)
    })
}

/// `add`, then `finish` of each group (its accumulator is not encoded again).
pub fn add_and_finish<T: Aggregate>(groups: wit::Groups, events: wit::Events) -> Result<Output, String> {
    with_plugin::<T, _>(|plugin| {
        let mut out = Output::new();
        fold(plugin, &groups, &events, |i, acc, group| {
            out.group = i as u32;
            plugin.finish(acc, group, &mut out);
            Ok(())
        })?;
        Ok(out)
    })
}

/// Fold every group's events into its accumulator and hand each to `then`, in group order.
fn fold<T: Aggregate>(
    plugin: &T,
    groups: &wit::Groups,
    events: &wit::Events,
    mut then: impl FnMut(usize, &T::Acc, &Group<'_>) -> Result<(), String>,
) -> Result<(), String> {
    let n = check_groups(groups)?;
    if events.group_ends.len() != n {
        return Err(format!("{} group ends for {n} groups", events.group_ends.len()));
    }
    let mut row = 0usize;
    for i in 0..n {
        let end = events.group_ends[i] as usize;
        if end < row || end > events.event_time.len() {
            return Err(format!("group {i} ends at row {end}, outside {row}..{}", events.event_time.len()));
        }
        let mut acc: T::Acc = crate::decode(packed_item(&groups.accumulators, i))?;
        let ev = Events { times: &events.event_time[row..end], columns: &events.columns, start: row };
        let group = group_view(groups, i);
        plugin.add(&mut acc, &group, &ev);
        then(i, &acc, &group)?;
        row = end;
    }
    Ok(())
}

/// Each group's accumulators (`counts[i]` consecutive items of `panes`) merged, earliest
/// first, then `finish` of the result (no accumulator is encoded).
pub fn merge_and_finish<T: Aggregate>(
    groups: wit::Groups,
    panes: wit::Packed,
    counts: Vec<u32>,
) -> Result<Output, String> {
    with_plugin::<T, _>(|plugin| {
        let n = check_groups(&groups)?;
        if counts.len() != n {
            return Err(format!("{} pane counts for {n} groups", counts.len()));
        }
        let total: u64 = counts.iter().map(|&c| u64::from(c)).sum();
        if total != panes.ends.len() as u64 {
            return Err(format!("{} panes for groups that count {total}", panes.ends.len()));
        }
        let mut out = Output::new();
        let mut next = 0usize;
        for (i, &count) in counts.iter().enumerate() {
            let end = next + count as usize;
            let mut acc: T::Acc = match count {
                0 => T::Acc::default(),
                _ => crate::decode(packed_item(&panes, next))?,
            };
            for p in next + 1..end {
                plugin.merge(&mut acc, crate::decode(packed_item(&panes, p))?);
            }
            next = end;
            out.group = i as u32;
            plugin.finish(&acc, &group_view(&groups, i), &mut out);
        }
        Ok(out)
    })
}

pub fn merge<T: Aggregate>(left: wit::Packed, right: wit::Packed) -> Result<wit::Packed, String> {
    with_plugin::<T, _>(|plugin| {
        let n = left.ends.len();
        if right.ends.len() != n {
            return Err(format!("merge of {n} with {} accumulators", right.ends.len()));
        }
        let mut out = packed_with_capacity(n);
        for i in 0..n {
            let mut acc: T::Acc = crate::decode(packed_item(&left, i))?;
            plugin.merge(&mut acc, crate::decode(packed_item(&right, i))?);
            encode_into(&acc, &mut out)?;
        }
        Ok(out)
    })
}

pub fn finish<T: Aggregate>(groups: wit::Groups) -> Result<Output, String> {
    with_plugin::<T, _>(|plugin| {
        let n = check_groups(&groups)?;
        let mut out = Output::new();
        for i in 0..n {
            let acc: T::Acc = crate::decode(packed_item(&groups.accumulators, i))?;
            out.group = i as u32;
            plugin.finish(&acc, &group_view(&groups, i), &mut out);
        }
        Ok(out)
    })
}

/// A call's records as a `list<emitted>` (what `aggregate.finish`, `fire` and `panes`
/// return): a string each.
pub fn listed(out: Result<Output, String>) -> Result<Vec<wit::Emitted>, String> {
    let out = out?;
    let mut start = 0usize;
    let mut records = Vec::with_capacity(out.groups.len());
    for (&group, &end) in out.groups.iter().zip(&out.values.ends) {
        let text = &out.values.bytes[start..end as usize];
        records.push(wit::Emitted { group, value: String::from_utf8_lossy(text).into_owned() });
        start = end as usize;
    }
    Ok(records)
}

/// A call's records in one buffer (what `packed-records` returns).
pub fn packed(out: Result<Output, String>) -> Result<packed_records::Records, String> {
    out.map(|out| packed_records::Records { groups: out.groups, values: out.values })
}

pub fn migrate<T: Aggregate>(from_schema: u32, accs: wit::Packed) -> Result<wit::Packed, String> {
    with_plugin::<T, _>(|plugin| {
        let n = accs.ends.len();
        let mut out = packed_with_capacity(n);
        for i in 0..n {
            let bytes = packed_item(&accs, i);
            let acc = if from_schema == T::STATE_SCHEMA {
                crate::decode::<T::Acc>(bytes)?
            } else {
                plugin.migrate(from_schema, bytes)?
            };
            encode_into(&acc, &mut out)?;
        }
        Ok(out)
    })
}

/// Export an [`Aggregate`] as the km0 `firing-aggregate-plugin` world (`aggregate`,
/// `fire` for windows that close as they fire, `panes` for sliding windows, and
/// `packed-records`, each call's records in one buffer).
#[macro_export]
macro_rules! export_plugin {
    ($plugin:ty) => {
        struct __Km0Export;
        impl $crate::bindings::exports::km0::plugin::aggregate::Guest for __Km0Export {
            fn info() -> $crate::bindings::km0::plugin::types::PluginInfo {
                $crate::__rt::info::<$plugin>(env!("CARGO_PKG_VERSION"))
            }
            fn key_fields() -> u32 {
                <$plugin as $crate::Aggregate>::KEY_FIELDS
            }
            fn configure(config: Vec<(String, String)>) -> Result<(), String> {
                $crate::__rt::configure::<$plugin>(config)
            }
            fn create() -> Vec<u8> {
                $crate::__rt::create::<$plugin>()
            }
            fn add(
                groups: $crate::bindings::km0::plugin::types::Groups,
                events: $crate::bindings::km0::plugin::types::Events,
            ) -> Result<$crate::bindings::km0::plugin::types::Packed, String> {
                $crate::__rt::add::<$plugin>(groups, events)
            }
            fn merge(
                left: $crate::bindings::km0::plugin::types::Packed,
                right: $crate::bindings::km0::plugin::types::Packed,
            ) -> Result<$crate::bindings::km0::plugin::types::Packed, String> {
                $crate::__rt::merge::<$plugin>(left, right)
            }
            fn finish(
                groups: $crate::bindings::km0::plugin::types::Groups,
            ) -> Result<Vec<$crate::bindings::km0::plugin::types::Emitted>, String> {
                $crate::__rt::listed($crate::__rt::finish::<$plugin>(groups))
            }
            fn migrate(
                from_schema: u32,
                accumulators: $crate::bindings::km0::plugin::types::Packed,
            ) -> Result<$crate::bindings::km0::plugin::types::Packed, String> {
                $crate::__rt::migrate::<$plugin>(from_schema, accumulators)
            }
        }
        impl $crate::bindings::exports::km0::plugin::fire::Guest for __Km0Export {
            fn add_and_finish(
                groups: $crate::bindings::km0::plugin::types::Groups,
                events: $crate::bindings::km0::plugin::types::Events,
            ) -> Result<Vec<$crate::bindings::km0::plugin::types::Emitted>, String> {
                $crate::__rt::listed($crate::__rt::add_and_finish::<$plugin>(groups, events))
            }
        }
        impl $crate::bindings::exports::km0::plugin::panes::Guest for __Km0Export {
            fn merge_and_finish(
                groups: $crate::bindings::km0::plugin::types::Groups,
                panes: $crate::bindings::km0::plugin::types::Packed,
                counts: Vec<u32>,
            ) -> Result<Vec<$crate::bindings::km0::plugin::types::Emitted>, String> {
                $crate::__rt::listed($crate::__rt::merge_and_finish::<$plugin>(groups, panes, counts))
            }
        }
        impl $crate::bindings::exports::km0::plugin::packed_records::Guest for __Km0Export {
            fn finish(
                groups: $crate::bindings::km0::plugin::types::Groups,
            ) -> Result<$crate::bindings::exports::km0::plugin::packed_records::Records, String> {
                $crate::__rt::packed($crate::__rt::finish::<$plugin>(groups))
            }
            fn add_and_finish(
                groups: $crate::bindings::km0::plugin::types::Groups,
                events: $crate::bindings::km0::plugin::types::Events,
            ) -> Result<$crate::bindings::exports::km0::plugin::packed_records::Records, String> {
                $crate::__rt::packed($crate::__rt::add_and_finish::<$plugin>(groups, events))
            }
            fn merge_and_finish(
                groups: $crate::bindings::km0::plugin::types::Groups,
                panes: $crate::bindings::km0::plugin::types::Packed,
                counts: Vec<u32>,
            ) -> Result<$crate::bindings::exports::km0::plugin::packed_records::Records, String> {
                $crate::__rt::packed($crate::__rt::merge_and_finish::<$plugin>(groups, panes, counts))
            }
        }
        $crate::bindings::__export_aggregate!(__Km0Export with_types_in $crate::bindings);
    };
}

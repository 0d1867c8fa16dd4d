//! Assembling plugin calls: events staged in arrival order become one `add` call whose
//! rows are grouped by (key, window) and laid out in columns, so the guest pays a handful
//! of allocations per call instead of several per event.

use super::{empty_packed, packed_clear, packed_push, Column, Events, FieldType, Groups, Packed};
use crate::state::{KeyTable, WindowState};
use crate::window::Window;
use std::collections::HashMap;

type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// One projected value of a staged row.
enum Staged {
    Int(Vec<i64>),
    Float(Vec<f64>),
    Text { bytes: Vec<u8>, ends: Vec<u32> },
    Bool(Vec<u8>),
}

/// Rows waiting for the next `add` call, and the reusable buffers of that call.
pub struct Batch {
    ordered: bool,
    index: FastMap<(u32, i64), u32>,
    /// Groups of this batch in first-seen order.
    group_list: Vec<(u32, Window)>,
    row_group: Vec<u32>,
    row_time: Vec<i64>,
    staged: Vec<Staged>,
    // Reused between calls.
    counts: Vec<u32>,
    order: Vec<u32>,
    pub(crate) groups: Groups,
    pub(crate) events: Events,
}

impl Batch {
    pub fn new(fields: &[FieldType], key_arity: usize, ordered: bool) -> Batch {
        let staged = fields
            .iter()
            .map(|t| match t {
                FieldType::Int => Staged::Int(Vec::new()),
                FieldType::Float => Staged::Float(Vec::new()),
                FieldType::Text => Staged::Text { bytes: Vec::new(), ends: Vec::new() },
                FieldType::Boolean => Staged::Bool(Vec::new()),
            })
            .collect();
        let columns = fields
            .iter()
            .map(|t| match t {
                FieldType::Int => Column::Int(Vec::new()),
                FieldType::Float => Column::Float(Vec::new()),
                FieldType::Text => Column::Text(empty_packed()),
                FieldType::Boolean => Column::Boolean(Vec::new()),
            })
            .collect();
        Batch {
            ordered,
            index: FastMap::default(),
            group_list: Vec::new(),
            row_group: Vec::new(),
            row_time: Vec::new(),
            staged,
            counts: Vec::new(),
            order: Vec::new(),
            groups: empty_groups(key_arity as u32),
            events: Events { group_ends: Vec::new(), event_time: Vec::new(), columns },
        }
    }

    /// Rows staged.
    #[inline]
    pub fn len(&self) -> usize {
        self.row_time.len()
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.row_time.is_empty()
    }

    /// Stage a row's group and time; then push one value per column, in column order.
    #[inline]
    pub fn push_row(&mut self, key: u32, window: Window, time: i64) {
        let next = self.group_list.len() as u32;
        let g = *self.index.entry((key, window.start)).or_insert(next);
        if g == next {
            self.group_list.push((key, window));
        }
        self.row_group.push(g);
        self.row_time.push(time);
    }

    #[inline]
    pub fn push_int(&mut self, col: usize, v: i64) {
        if let Staged::Int(c) = &mut self.staged[col] {
            c.push(v)
        }
    }

    #[inline]
    pub fn push_float(&mut self, col: usize, v: f64) {
        if let Staged::Float(c) = &mut self.staged[col] {
            c.push(v)
        }
    }

    #[inline]
    pub fn push_bool(&mut self, col: usize, v: bool) {
        if let Staged::Bool(c) = &mut self.staged[col] {
            c.push(v as u8)
        }
    }

    #[inline]
    pub fn push_text(&mut self, col: usize, v: &str) {
        if let Staged::Text { bytes, ends } = &mut self.staged[col] {
            bytes.extend_from_slice(v.as_bytes());
            ends.push(bytes.len() as u32);
        }
    }

    /// Lay the staged rows out as one `add` call: rows grouped by (key, window) (and
    /// sorted by event time within a group for ordered plugins), current accumulators
    /// from `state`. Returns the groups in call order; the staging is emptied.
    pub fn assemble(&mut self, keys: &KeyTable, state: &WindowState) -> Vec<(u32, Window)> {
        let n_groups = self.group_list.len();
        let n_rows = self.row_time.len();

        // Counting sort of rows by group (stable: arrival order within a group).
        self.counts.clear();
        self.counts.resize(n_groups + 1, 0);
        for &g in &self.row_group {
            self.counts[g as usize + 1] += 1;
        }
        for i in 0..n_groups {
            self.counts[i + 1] += self.counts[i];
        }
        self.events.group_ends.clear();
        self.events.group_ends.extend_from_slice(&self.counts[1..]);
        self.order.clear();
        self.order.resize(n_rows, 0);
        for (row, &g) in self.row_group.iter().enumerate() {
            let slot = &mut self.counts[g as usize];
            self.order[*slot as usize] = row as u32;
            *slot += 1;
        }
        if self.ordered {
            let mut start = 0usize;
            for &end in &self.events.group_ends {
                let times = &self.row_time;
                self.order[start..end as usize].sort_by_key(|&r| times[r as usize]);
                start = end as usize;
            }
        }

        // Gather every column in call order.
        let order = &self.order;
        self.events.event_time.clear();
        self.events.event_time.extend(order.iter().map(|&r| self.row_time[r as usize]));
        for (staged, column) in self.staged.iter_mut().zip(self.events.columns.iter_mut()) {
            match (staged, column) {
                (Staged::Int(src), Column::Int(dst)) => {
                    dst.clear();
                    dst.extend(order.iter().map(|&r| src[r as usize]));
                    src.clear();
                }
                (Staged::Float(src), Column::Float(dst)) => {
                    dst.clear();
                    dst.extend(order.iter().map(|&r| src[r as usize]));
                    src.clear();
                }
                (Staged::Bool(src), Column::Boolean(dst)) => {
                    dst.clear();
                    dst.extend(order.iter().map(|&r| src[r as usize]));
                    src.clear();
                }
                (Staged::Text { bytes, ends }, Column::Text(dst)) => {
                    packed_clear(dst);
                    for &r in order {
                        let r = r as usize;
                        let s = if r == 0 { 0 } else { ends[r - 1] as usize };
                        packed_push(dst, &bytes[s..ends[r] as usize]);
                    }
                    bytes.clear();
                    ends.clear();
                }
                _ => unreachable!("staged and call columns are built from the same field types"),
            }
        }

        let groups = std::mem::take(&mut self.group_list);
        fill_groups(&mut self.groups, keys, groups.iter().map(|&(k, w)| (k, w, state.get(k, w.start))));
        self.index.clear();
        self.row_group.clear();
        self.row_time.clear();
        groups
    }
}

pub fn empty_groups(key_arity: u32) -> Groups {
    Groups {
        keys: empty_packed(),
        key_arity,
        window_start: Vec::new(),
        window_end: Vec::new(),
        accumulators: empty_packed(),
    }
}

/// Fill a call's `groups` from (key, window, accumulator) triples.
pub fn fill_groups<'a>(
    groups: &mut Groups,
    keys: &KeyTable,
    items: impl Iterator<Item = (u32, Window, &'a [u8])>,
) {
    packed_clear(&mut groups.keys);
    packed_clear(&mut groups.accumulators);
    groups.window_start.clear();
    groups.window_end.clear();
    for (key, window, acc) in items {
        for field in keys.raw_fields(key) {
            packed_push(&mut groups.keys, field);
        }
        groups.window_start.push(window.start);
        groups.window_end.push(window.end);
        packed_push(&mut groups.accumulators, acc);
    }
}

/// A packed buffer of the given items.
pub fn packed_of<'a>(items: impl Iterator<Item = &'a [u8]>) -> Packed {
    let mut p = empty_packed();
    for i in items {
        packed_push(&mut p, i);
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::push_key_field;

    #[test]
    fn rows_are_grouped_stably_and_sorted_when_ordered() {
        let mut keys = KeyTable::default();
        let mut k = Vec::new();
        push_key_field(&mut k, b"a");
        let a = keys.intern(&k);
        k.clear();
        push_key_field(&mut k, b"b");
        let b = keys.intern(&k);
        let w = Window { start: 0, end: 10 };
        let state = WindowState::default();
        for ordered in [false, true] {
            let mut batch = Batch::new(&[FieldType::Int, FieldType::Text], 1, ordered);
            for (key, t, v, s) in [(a, 5, 1, "x"), (b, 3, 2, "y"), (a, 2, 3, "zz"), (b, 1, 4, "")] {
                batch.push_row(key, w, t);
                batch.push_int(0, v);
                batch.push_text(1, s);
            }
            let groups = batch.assemble(&keys, &state);
            assert_eq!(groups, vec![(a, w), (b, w)]);
            assert_eq!(batch.events.group_ends, vec![2, 4]);
            let Column::Int(ints) = &batch.events.columns[0] else { panic!() };
            let Column::Text(texts) = &batch.events.columns[1] else { panic!() };
            if ordered {
                assert_eq!(batch.events.event_time, vec![2, 5, 1, 3]);
                assert_eq!(ints, &vec![3, 1, 4, 2]);
                assert_eq!(texts.bytes, b"zzxy");
                assert_eq!(texts.ends, vec![2, 3, 3, 4]);
            } else {
                assert_eq!(batch.events.event_time, vec![5, 2, 3, 1]);
                assert_eq!(ints, &vec![1, 3, 2, 4]);
                assert_eq!(texts.bytes, b"xzzy");
            }
            assert_eq!(batch.groups.keys.bytes, b"ab");
            assert_eq!(batch.groups.accumulators.ends, vec![0, 0]);
            assert!(batch.is_empty());
        }
    }
}

//! The RocksDB state backend: a RocksDB copy of every operator's slots, kept up to date
//! at each checkpoint with only what changed since the previous one, and checkpointed
//! with RocksDB's own checkpoints (hard links to immutable SST files). Each checkpoint
//! thus writes only its changes (incremental), and unchanged SST files are shared between
//! the retained checkpoints. The operators keep working on their in-memory slots (the hot
//! layer); the copy is consistent because it is updated from the snapshot captured at the
//! checkpoint, on the checkpoint writer thread.
//!
//! Layout, one key per slot: `[operator u8][0u8][u32 LE key length][encoded key]
//! [slot id i64 BE]` -> `[start i64 LE][end i64 LE][accumulator]`; an operator's held
//! rows (ordered plugins) under `[operator u8][1u8]`, encoded as in savepoints.

use super::captured::CapturedSlots;
use super::saved::{decode_rows, encode_rows, SavedRow, SavedSlot, Snapshot};
use crate::time::Window;
use crate::{Error, Result};
use rocksdb::{checkpoint::Checkpoint, IteratorMode, Options, ReadOptions, WriteBatch, DB};
use std::path::{Path, PathBuf};

/// What changed in one operator since the previous checkpoint.
#[derive(Debug, Default)]
pub struct Changes {
    /// Slots written or updated.
    pub puts: CapturedSlots,
    /// Slots removed: (encoded key, slot id).
    pub deletes: Vec<(Vec<u8>, i64)>,
    /// All held rows (small; rewritten whole).
    pub rows: Vec<SavedRow>,
}

fn rocks_error(what: &str, path: &Path, e: rocksdb::Error) -> Error {
    Error::Rocks { what: what.to_string(), path: path.to_path_buf(), source: e }
}

fn slot_key(op: u8, key: &[u8], id: i64) -> Vec<u8> {
    let mut k = Vec::with_capacity(2 + 4 + key.len() + 8);
    k.push(op);
    k.push(0);
    k.extend_from_slice(&(key.len() as u32).to_le_bytes());
    k.extend_from_slice(key);
    k.extend_from_slice(&id.to_be_bytes());
    k
}

/// The job's working RocksDB instance.
pub struct RocksState {
    db: DB,
    dir: PathBuf,
}

impl RocksState {
    /// A new, empty instance in `dir` (anything there before is discarded: the state to
    /// start from comes from a checkpoint, not from a working folder).
    pub fn open_fresh(dir: &Path) -> Result<RocksState> {
        if dir.exists() {
            std::fs::remove_dir_all(dir).map_err(|e| Error::io("clear RocksDB folder", dir, e))?;
        }
        std::fs::create_dir_all(dir).map_err(|e| Error::io("create RocksDB folder", dir, e))?;
        let mut opts = Options::default();
        opts.create_if_missing(true);
        opts.set_compression_type(rocksdb::DBCompressionType::Lz4);
        let db = DB::open(&opts, dir).map_err(|e| rocks_error("open", dir, e))?;
        Ok(RocksState { db, dir: dir.to_path_buf() })
    }

    /// Apply the operators' changes in one write batch, then write a RocksDB checkpoint
    /// of the result into `into` (which must not exist).
    pub fn apply_and_checkpoint(&self, changes: &[Changes], into: &Path) -> Result<()> {
        self.apply(changes)?;
        self.checkpoint(into)
    }

    /// Apply the operators' changes in one write batch.
    pub fn apply(&self, changes: &[Changes]) -> Result<()> {
        let mut batch = WriteBatch::default();
        for (op, c) in changes.iter().enumerate() {
            let op = op as u8;
            for (key, id) in &c.deletes {
                batch.delete(slot_key(op, key, *id));
            }
            for (key, id, window, acc) in c.puts.iter() {
                let mut v = Vec::with_capacity(16 + acc.len());
                v.extend_from_slice(&window.start.to_le_bytes());
                v.extend_from_slice(&window.end.to_le_bytes());
                v.extend_from_slice(acc);
                batch.put(slot_key(op, key, id), v);
            }
            batch.put([op, 1], encode_rows(&c.rows));
        }
        self.db.write(batch).map_err(|e| rocks_error("write", &self.dir, e))
    }

    /// Write a RocksDB checkpoint of the state as it is into `into` (which must not exist).
    pub fn checkpoint(&self, into: &Path) -> Result<()> {
        let cp = Checkpoint::new(&self.db).map_err(|e| rocks_error("checkpoint", &self.dir, e))?;
        cp.create_checkpoint(into).map_err(|e| rocks_error("checkpoint into", into, e))
    }
}

/// Read every operator's slots and rows from a RocksDB checkpoint (read-only).
pub fn load(dir: &Path, operators: usize) -> Result<Vec<Snapshot>> {
    let mut opts = Options::default();
    opts.set_paranoid_checks(true);
    let db = DB::open_for_read_only(&opts, dir, false).map_err(|e| rocks_error("open", dir, e))?;
    let mut out: Vec<Snapshot> = (0..operators).map(|_| Snapshot::default()).collect();
    // Room for the slots, by RocksDB's estimate of its keys, for the one operator of most
    // jobs: grown slot by slot, the copies and their fresh pages cost ~7% of a restore.
    // An estimate (deleted and overwritten keys count too), so capped, and only tried:
    // without the room, the slots grow as they are read.
    let estimate = db.property_int_value("rocksdb.estimate-num-keys").ok().flatten().unwrap_or(0);
    if let [only] = out.as_mut_slice() {
        let _ = only.slots.try_reserve(estimate.min(1 << 22) as usize);
    }
    let bad =
        |m: &str| Error::Savepoint { path: dir.to_path_buf(), message: format!("RocksDB checkpoint: {m}") };
    // Read once, in order: its blocks are not kept in the block cache (filling it cost
    // ~7% of a restore), and read ahead.
    let mut read = ReadOptions::default();
    read.fill_cache(false);
    read.set_readahead_size(4 << 20);
    for item in db.iterator_opt(IteratorMode::Start, read) {
        let (k, v) = item.map_err(|e| rocks_error("read", dir, e))?;
        let (&op, rest) = k.split_first().ok_or_else(|| bad("empty key"))?;
        let snap = out.get_mut(op as usize).ok_or_else(|| bad("operator out of range"))?;
        match rest.split_first() {
            Some((0, rest)) => {
                let len = u32::from_le_bytes(
                    rest.get(..4).and_then(|b| b.try_into().ok()).ok_or_else(|| bad("key"))?,
                );
                let key = rest.get(4..4 + len as usize).ok_or_else(|| bad("key"))?;
                if !crate::state::valid_key(key) {
                    return Err(bad("a key is not UTF-8 fields of known lengths"));
                }
                let key = key.to_vec();
                let id_bytes = rest
                    .get(4 + len as usize..)
                    .and_then(|b| b.try_into().ok())
                    .ok_or_else(|| bad("slot id"))?;
                let id = i64::from_be_bytes(id_bytes);
                let int = |r: std::ops::Range<usize>| -> Result<i64> {
                    Ok(i64::from_le_bytes(
                        v.get(r).and_then(|b| b.try_into().ok()).ok_or_else(|| bad("value"))?,
                    ))
                };
                let window = Window { start: int(0..8)?, end: int(8..16)? };
                snap.slots.push(SavedSlot { key, id, window, acc: v[16..].to_vec() });
            }
            Some((1, [])) => snap.rows = decode_rows(&v).map_err(|e| bad(&e))?,
            _ => return Err(bad("unknown key kind")),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{KeyTable, WindowState};

    #[test]
    fn changes_accumulate_into_checkpoints_that_load_back() {
        let dir = tempfile::tempdir().unwrap();
        let rocks = RocksState::open_fresh(&dir.path().join("work")).unwrap();
        let slot = |k: &[u8], id, acc: &[u8]| SavedSlot {
            key: k.to_vec(),
            id,
            window: Window { start: id, end: id + 5 },
            acc: acc.to_vec(),
        };
        // The operator's state, captured incrementally as a job's checkpoints capture it.
        let (mut keys, mut state) = (KeyTable::default(), WindowState::by_period());
        let (a, b) = (keys.intern(b"\x01\0\0\0a"), keys.intern(b"\x01\0\0\0b"));
        state.open_with(a, 0, Window { start: 0, end: 5 }, b"x");
        state.open_with(b, 5, Window { start: 5, end: 10 }, b"y");
        let c = keys.intern(b"\x01\0\0\0c");
        state.open_with(c, 0, Window { start: 0, end: 5 }, b"z");
        let first = Changes { puts: state.capture(&keys, true), ..Default::default() };
        assert_eq!(first.puts.len(), 3);
        rocks.apply_and_checkpoint(&[first], &dir.path().join("c1")).unwrap();
        state.set_acc(a, 0, b"x2");
        state.remove(b, 5);
        let second = Changes {
            // Only `a` was written since: `c` is not put again.
            puts: state.capture(&keys, true),
            deletes: vec![(b"\x01\0\0\0b".to_vec(), 5)],
            rows: vec![SavedRow { key: b"\x01\0\0\0a".to_vec(), id: 0, time: 3, values: vec![] }],
        };
        assert_eq!(
            second.puts.iter().map(|(k, ..)| k.to_vec()).collect::<Vec<_>>(),
            [b"\x01\0\0\0a".to_vec()]
        );
        rocks.apply_and_checkpoint(&[second], &dir.path().join("c2")).unwrap();
        let c1 = load(&dir.path().join("c1"), 1).unwrap();
        assert_eq!(c1[0].slots.len(), 3);
        let c2 = load(&dir.path().join("c2"), 1).unwrap();
        assert_eq!(c2[0].slots, vec![slot(b"\x01\0\0\0a", 0, b"x2"), slot(b"\x01\0\0\0c", 0, b"z")]);
        assert_eq!(c2[0].rows.len(), 1);
    }

    #[test]
    fn a_checkpoint_whose_key_is_not_utf8_fields_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let rocks = RocksState::open_fresh(&dir.path().join("work")).unwrap();
        let (mut keys, mut state) = (KeyTable::default(), WindowState::by_period());
        // Interned unchecked (live keys are checked before they are interned).
        let k = keys.intern(b"\x04\0\0\0gir\xff");
        state.open_with(k, 0, Window { start: 0, end: 5 }, b"x");
        let puts = state.capture(&keys, true);
        rocks
            .apply_and_checkpoint(&[Changes { puts, ..Default::default() }], &dir.path().join("c1"))
            .unwrap();
        let Err(e) = load(&dir.path().join("c1"), 1) else { panic!("a key that is not UTF-8 was loaded") };
        assert!(e.to_string().contains("not UTF-8"), "{e}");
    }
}

//! The savepoint format (version 1): a folder with
//!
//! - `savepoint.json`: what the snapshot is ([`SavepointMeta`]): pipeline identity, each
//!   operator's id, plugin identity and counters, source position per partition,
//!   watermark clocks per partition, job counters, committed sink positions, and the size
//!   and SHA-256 of the state file;
//! - `state.bin`: every operator's open slots (key, slot id, bounds, accumulator) and the
//!   rows an ordered plugin still holds back (layout below);
//! - `CHECKSUM`: SHA-256 of the two files, written last.
//!
//! `state.bin` layout, all integers little-endian, strings as u32 length + UTF-8:
//!
//! ```text
//! magic "KM0STATE" | u32 format version (1) | u32 operator count
//! per operator, in savepoint.json order:
//!   u64 slot count | per slot: u32 key field count, fields | i64 slot id | i64 start
//!                    | i64 end | u32 length, accumulator bytes
//!   u64 row count  | per row:  u32 key field count, fields | i64 slot id | i64 event time
//!                    | u32 value count | per value: u8 tag (0 int, 1 float, 2 text,
//!                    3 bool) and i64 / f64 bits / string / u8
//! ```
//!
//! A savepoint is written to a temporary folder and renamed into place, so it is either
//! complete or absent; it is never modified afterwards. Reading verifies the checksums.
//!
//! The savepoint of a job of several tasks (`[event_time] watermark = "per-partition"`) is
//! a folder of such savepoints, one per task (`task-0/`, ...), and `tasks.json` that lists
//! them with their partitions ([`TasksManifest`]); it is assembled in a temporary folder
//! and renamed into place too.

use crate::pipeline::hex;
use crate::plugin::PluginIdentity;
use crate::sink::SinkPosition;
use crate::source::SourcePosition;
use crate::state::saved::{encode_rows_into, OperatorCounters, Reader, SavedSlot, Snapshot};
use crate::time::WatermarkState;
use crate::time::Window;
use crate::window::operator::Capture;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::io::Write;
use std::path::{Path, PathBuf};

pub const FORMAT: &str = "km0-savepoint";
pub const FORMAT_VERSION: u32 = 1;
const MAGIC: &[u8; 8] = b"KM0STATE";
const META: &str = "savepoint.json";
const STATE: &str = "state.bin";
const CHECKSUM: &str = "CHECKSUM";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PipelineIdentity {
    pub name: String,
    /// [`crate::pipeline::Pipeline::state_fingerprint`].
    pub fingerprint: String,
}

/// One operator in a savepoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OperatorMeta {
    /// Stable operator id (the aggregation's name).
    pub id: String,
    pub plugin: PluginIdentity,
    pub slots: u64,
    pub rows: u64,
    pub counters: OperatorCounters,
    /// Keys the plugin failed on, quarantined or not.
    #[serde(default, skip_serializing_if = "crate::window::operator::SavedFaults::is_empty")]
    pub quarantine: crate::window::operator::SavedFaults,
    /// The same, as km0 kept them before `quarantine` (read, never written).
    #[serde(default, skip_serializing)]
    pub faults: Vec<crate::window::operator::KeyFaults>,
    /// A plugin deployed live and still on probation: what it failed on and was given
    /// since its deploy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probation: Option<crate::window::operator::Tally>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateFile {
    pub file: String,
    pub windows: u64,
    pub bytes: u64,
    pub sha256: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SavepointMeta {
    pub format: String,
    pub format_version: u32,
    pub km0_version: String,
    pub created_at_ms: i64,
    pub pipeline: PipelineIdentity,
    pub operators: Vec<OperatorMeta>,
    pub source: SourcePosition,
    pub watermark: WatermarkState,
    pub counters: crate::state::saved::Counters,
    pub sinks: Vec<SinkPosition>,
    pub state: StateFile,
    /// This snapshot's id (random): committing sinks record it with the epoch committed
    /// at its barrier, which ties their progress to the job's lineage.
    #[serde(default)]
    pub snapshot_id: String,
    /// Every operator's rows for a slot are all of that slot's rows (its accumulator is
    /// rebuilt from them on restore); false in savepoints of km0 before contract 0.2.
    #[serde(default)]
    pub rows_cover_slots: bool,
    /// A session's window ends one past `last + gap` (it covers `[first, last + gap]`);
    /// false in savepoints of km0 before that, whose sessions ended at `last + gap`.
    #[serde(default)]
    pub session_ends_closed: bool,
    /// What the job's control port keeps across a restart (the deploy history, the deploy
    /// on probation), in the control port's own form.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control: Option<serde_json::Value>,
}

/// A savepoint read from disk and verified.
#[derive(Debug)]
pub struct Savepoint {
    pub path: PathBuf,
    pub meta: SavepointMeta,
    /// One per operator, in `meta.operators` order.
    pub snapshots: Vec<Snapshot>,
}

fn corrupt(path: &Path, message: impl Into<String>) -> Error {
    Error::Savepoint { path: path.to_path_buf(), message: message.into() }
}

fn encode_state(captures: &[Capture]) -> Vec<u8> {
    let len = captures.iter().map(|c| c.slots.encoded_len() + 16).sum::<usize>() + 16;
    let mut out = Vec::with_capacity(len);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(captures.len() as u32).to_le_bytes());
    for c in captures {
        let n = c.slots.len();
        out.extend_from_slice(&n.to_le_bytes());
        let written = c.slots.encode_into(&mut out);
        assert_eq!(written, n, "the slot count state.bin gives is the slots it holds");
        encode_rows_into(&mut out, &c.rows);
    }
    out
}

/// Write a snapshot whose state a backend writes itself (RocksDB): `write_state` fills
/// the folder it is given; the metadata and `CHECKSUM` (of the metadata; the backend's
/// files carry their own checksums) are written around it, atomically.
pub fn write_external(
    dir: &Path,
    meta: SavepointMeta,
    state_dir: &str,
    write_state: impl FnOnce(&Path) -> Result<()>,
) -> Result<SavepointMeta> {
    write_external_with(dir, meta, state_dir, &[], write_state)
}

/// [`write_external`], with the deployed plugin components the job runs.
pub fn write_external_with(
    dir: &Path,
    mut meta: SavepointMeta,
    state_dir: &str,
    components: &[super::components::Component],
    write_state: impl FnOnce(&Path) -> Result<()>,
) -> Result<SavepointMeta> {
    let windows = meta.operators.iter().map(|o| o.slots).sum();
    meta.state = StateFile { file: state_dir.into(), windows, bytes: 0, sha256: String::new() };
    let meta_json =
        serde_json::to_vec_pretty(&meta).map_err(|e| corrupt(dir, format!("encode metadata: {e}")))?;
    let meta_sha = hex(&Sha256::digest(&meta_json));
    into_folder(dir, components, |tmp| {
        write_state(&tmp.join(state_dir))?;
        write_synced(&tmp.join(META), &meta_json)?;
        write_synced(&tmp.join(CHECKSUM), format!("{meta_sha}  {META}\n").as_bytes())
    })?;
    Ok(meta)
}

/// Write a snapshot's folder `dir`: its components and what `fill` writes go into a
/// temporary folder beside it, renamed into place once complete (and removed if anything
/// fails: a failed snapshot leaves nothing behind).
fn into_folder(
    dir: &Path,
    components: &[super::components::Component],
    fill: impl FnOnce(&Path) -> Result<()>,
) -> Result<()> {
    let tmp = temp_folder(dir)?;
    let filled = components
        .iter()
        .try_for_each(|c| c.put(&tmp).map(drop))
        .and_then(|()| fill(&tmp))
        .and_then(|()| std::fs::rename(&tmp, dir).map_err(|e| Error::io("rename snapshot into", dir, e)));
    if let Err(e) = filled {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    sync_parent(dir)
}

/// Remove the temporary folders of snapshots that a process which no longer runs left in
/// `dir` (killed while it wrote them).
pub fn remove_abandoned(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name.strip_prefix('.').and_then(|n| n.rsplit_once(".tmp-")).map(|(_, pid)| pid)
        else {
            continue;
        };
        let alive = pid.parse::<u32>().is_ok_and(|pid| Path::new(&format!("/proc/{pid}")).exists());
        if !alive {
            tracing::info!(folder = %e.path().display(), "removing an abandoned temporary snapshot folder");
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// A new, empty temporary folder beside `dir`, to be renamed into it.
fn temp_folder(dir: &Path) -> Result<PathBuf> {
    if dir.exists() {
        return Err(corrupt(dir, "already exists; savepoints are never overwritten"));
    }
    let parent = dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|e| Error::io("create folder", parent, e))?;
    let name =
        dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "savepoint".into());
    let tmp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| Error::io("create folder", &tmp, e))?;
    Ok(tmp)
}

/// Write a savepoint into the new folder `dir`. `meta.state` is filled in here.
pub fn write(dir: &Path, meta: SavepointMeta, snapshots: &[Capture]) -> Result<SavepointMeta> {
    write_with(dir, meta, snapshots, &[])
}

/// [`write`], with the deployed plugin components the job runs (kept in
/// `components/<sha256>.wasm`, see [`super::components`]).
pub fn write_with(
    dir: &Path,
    mut meta: SavepointMeta,
    snapshots: &[Capture],
    components: &[super::components::Component],
) -> Result<SavepointMeta> {
    let state = encode_state(snapshots);
    let state_sha = hex(&Sha256::digest(&state));
    let windows = snapshots.iter().map(|s| s.slots.len()).sum();
    meta.state =
        StateFile { file: STATE.into(), windows, bytes: state.len() as u64, sha256: state_sha.clone() };
    let meta_json =
        serde_json::to_vec_pretty(&meta).map_err(|e| corrupt(dir, format!("encode metadata: {e}")))?;
    let meta_sha = hex(&Sha256::digest(&meta_json));
    into_folder(dir, components, |tmp| {
        write_synced(&tmp.join(STATE), &state)?;
        write_synced(&tmp.join(META), &meta_json)?;
        write_synced(&tmp.join(CHECKSUM), format!("{meta_sha}  {META}\n{state_sha}  {STATE}\n").as_bytes())
    })?;
    Ok(meta)
}

/// Make a rename into `dir`'s folder durable: sync the folder that holds the new entry.
fn sync_parent(dir: &Path) -> Result<()> {
    let parent = dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::File::open(parent).and_then(|f| f.sync_all()).map_err(|e| Error::io("sync folder", parent, e))
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = std::fs::File::create(path).map_err(|e| Error::io("create", path, e))?;
    f.write_all(bytes).map_err(|e| Error::io("write", path, e))?;
    f.sync_all().map_err(|e| Error::io("sync", path, e))
}

/// A savepoint file of this format and version, or the reason it is not.
fn check_format(dir: &Path, file: &str, format: &str, version: u32) -> Result<()> {
    if format != FORMAT || version != FORMAT_VERSION {
        return Err(corrupt(
            dir,
            format!("{file}: format {format} v{version} is not {FORMAT} v{FORMAT_VERSION}"),
        ));
    }
    Ok(())
}

/// The file that makes a folder the savepoint of a job of several tasks.
pub const TASKS: &str = "tasks.json";

/// `tasks.json`: the tasks whose savepoints a job savepoint holds.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TasksManifest {
    pub format: String,
    pub format_version: u32,
    pub pipeline: String,
    pub tasks: Vec<TaskEntry>,
}

/// One task of a job savepoint: its folder and the partition it reads.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TaskEntry {
    pub task: String,
    pub partition: String,
    /// The task's bounded input had ended: it has no folder, and a resume leaves it out.
    #[serde(default)]
    pub ended: bool,
}

/// The manifest of a job savepoint of several tasks; none for a savepoint of one task.
pub fn read_tasks(dir: &Path) -> Result<Option<TasksManifest>> {
    let path = dir.join(TASKS);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io("read savepoint file", path, e)),
    };
    let m: TasksManifest =
        serde_json::from_slice(&bytes).map_err(|e| corrupt(dir, format!("{TASKS}: {e}")))?;
    check_format(dir, TASKS, &m.format, m.format_version)?;
    for t in &m.tasks {
        let plain =
            !t.task.is_empty() && t.task.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if !plain || (!t.ended && !dir.join(&t.task).is_dir()) {
            return Err(corrupt(dir, format!("{TASKS}: task {:?} has no folder here", t.task)));
        }
    }
    Ok(Some(m))
}

/// Assemble the job savepoint `dir` from each task's savepoint (moved into it, in the
/// same file system).
pub fn write_tasks(dir: &Path, pipeline: &str, tasks: &[(TaskEntry, Option<PathBuf>)]) -> Result<()> {
    let manifest = TasksManifest {
        format: FORMAT.into(),
        format_version: FORMAT_VERSION,
        pipeline: pipeline.into(),
        tasks: tasks.iter().map(|(t, _)| t.clone()).collect(),
    };
    let json =
        serde_json::to_vec_pretty(&manifest).map_err(|e| corrupt(dir, format!("encode {TASKS}: {e}")))?;
    let tmp = temp_folder(dir)?;
    for (t, from) in tasks.iter().filter_map(|(t, from)| from.as_ref().map(|f| (t, f))) {
        let to = tmp.join(&t.task);
        std::fs::rename(from, &to).map_err(|e| Error::io("move a task's savepoint", from, e))?;
    }
    write_synced(&tmp.join(TASKS), &json)?;
    std::fs::rename(&tmp, dir).map_err(|e| Error::io("rename savepoint folder", dir, e))?;
    sync_parent(dir)
}

/// Read and verify a savepoint folder.
pub fn read(dir: &Path) -> Result<Savepoint> {
    if dir.join(TASKS).exists() {
        return Err(corrupt(
            dir,
            "holds the savepoints of several tasks (a job with `[event_time] watermark = \"per-partition\"`): \
             resume it with that setting",
        ));
    }
    let read = |name: &str| {
        std::fs::read(dir.join(name)).map_err(|e| Error::io("read savepoint file", dir.join(name), e))
    };
    let checksum = String::from_utf8(read(CHECKSUM)?).map_err(|_| corrupt(dir, "CHECKSUM is not text"))?;
    let meta_bytes = read(META)?;
    let external = !checksum.contains(STATE);
    let state = if external { Vec::new() } else { read(STATE)? };
    let mut expected = std::collections::HashMap::new();
    for line in checksum.lines() {
        if let Some((sum, file)) = line.split_once("  ") {
            expected.insert(file.to_string(), sum.to_string());
        }
    }
    let files: &[(&str, &Vec<u8>)] =
        if external { &[(META, &meta_bytes)] } else { &[(META, &meta_bytes), (STATE, &state)] };
    for &(file, bytes) in files {
        let got = hex(&Sha256::digest(bytes));
        match expected.get(file) {
            Some(want) if *want == got => {}
            Some(_) => {
                return Err(corrupt(
                    dir,
                    format!("{file} does not match its checksum: the savepoint is corrupt"),
                ))
            }
            None => return Err(corrupt(dir, format!("CHECKSUM does not list {file}"))),
        }
    }
    let meta: SavepointMeta =
        serde_json::from_slice(&meta_bytes).map_err(|e| corrupt(dir, format!("{META}: {e}")))?;
    check_format(dir, META, &meta.format, meta.format_version)?;
    let mut snapshots = if external {
        let at = dir.join(&meta.state.file);
        crate::state::rocks::load(&at, meta.operators.len())
            .map_err(|e| corrupt(dir, format!("{}: {e}", meta.state.file)))?
    } else {
        decode_state(&state).map_err(|m| corrupt(dir, format!("{STATE}: {m}")))?
    };
    if snapshots.len() != meta.operators.len() {
        return Err(corrupt(dir, "operator count differs from the metadata"));
    }
    for (snap, op) in snapshots.iter_mut().zip(&meta.operators) {
        if snap.slots.len() as u64 != op.slots || snap.rows.len() as u64 != op.rows {
            return Err(corrupt(
                dir,
                format!("operator {}: slot or row count differs from the metadata", op.id),
            ));
        }
        snap.counters = op.counters.clone();
    }
    Ok(Savepoint { path: dir.to_path_buf(), meta, snapshots })
}

fn decode_state(b: &[u8]) -> Result<Vec<Snapshot>, String> {
    let mut r = Reader(b);
    if r.take(8)? != MAGIC {
        return Err("not a km0 state file".into());
    }
    let version = r.u32()?;
    if version != FORMAT_VERSION {
        return Err(format!("state format {version} is not {FORMAT_VERSION}"));
    }
    let operators = r.u32()?;
    let mut out = Vec::new();
    for _ in 0..operators {
        let mut snap = Snapshot::default();
        let slots = r.count()?;
        // A slot takes at least 32 bytes (field count, id, window, accumulator length).
        snap.slots.reserve(slots.min(r.0.len() / 32));
        for _ in 0..slots {
            let key = r.key()?;
            let id = r.i64()?;
            let window = Window { start: r.i64()?, end: r.i64()? };
            let len = r.u32()? as usize;
            let acc = r.take(len)?.to_vec();
            snap.slots.push(SavedSlot { key, id, window, acc });
        }
        snap.rows = r.rows()?;
        out.push(snap);
    }
    if !r.0.is_empty() {
        return Err("bytes after the last operator".into());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `state.bin` written by hand: one operator, one slot of the key `fields`
    /// (id 7, window [0, 300000), accumulator `acc`), no rows.
    fn state_bin(fields: &[&[u8]], acc: &[u8]) -> Vec<u8> {
        let mut b = MAGIC.to_vec();
        b.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        b.extend_from_slice(&1u32.to_le_bytes());
        b.extend_from_slice(&1u64.to_le_bytes());
        b.extend_from_slice(&(fields.len() as u32).to_le_bytes());
        for f in fields {
            b.extend_from_slice(&(f.len() as u32).to_le_bytes());
            b.extend_from_slice(f);
        }
        b.extend_from_slice(&7i64.to_le_bytes());
        b.extend_from_slice(&0i64.to_le_bytes());
        b.extend_from_slice(&300_000i64.to_le_bytes());
        b.extend_from_slice(&(acc.len() as u32).to_le_bytes());
        b.extend_from_slice(acc);
        b.extend_from_slice(&0u64.to_le_bytes());
        b
    }

    #[test]
    fn a_saved_slot_is_read_back_with_its_key_encoded_field_by_field() {
        let snaps = decode_state(&state_bin(&[b"queso", "jam\u{f3}n".as_bytes()], b"acc")).unwrap();
        let slot = &snaps[0].slots[0];
        // Each field: its length (u32, little-endian), then its bytes.
        assert_eq!(slot.key, b"\x05\0\0\0queso\x06\0\0\0jam\xc3\xb3n".to_vec());
        assert_eq!(
            (slot.id, slot.window, slot.acc.as_slice()),
            (7, Window { start: 0, end: 300_000 }, &b"acc"[..])
        );
        assert!(snaps[0].rows.is_empty());
    }

    #[test]
    fn a_key_field_that_is_not_utf8_or_runs_past_the_file_is_refused() {
        let bad = decode_state(&state_bin(&[b"queso", b"gir\xffona"], b"acc")).unwrap_err();
        assert!(bad.contains("not UTF-8"), "{bad}");
        // A field cut short: its length says more bytes than the file has.
        let mut cut = state_bin(&[b"queso"], b"");
        cut.truncate(MAGIC.len() + 4 + 4 + 8 + 4 + 4 + 3);
        assert_eq!(decode_state(&cut).unwrap_err(), "truncated");
    }
}

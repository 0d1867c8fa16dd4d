//! The savepoint format (version 1): a folder with
//!
//! - `savepoint.json`: what the snapshot is ([`SavepointMeta`]): pipeline identity,
//!   plugin identity, source position per partition, watermark, counters, committed sink
//!   positions, and the size and SHA-256 of the state file;
//! - `state.bin`: every open window's key, bounds and accumulator (layout below);
//! - `CHECKSUM`: SHA-256 of the two files, written last.
//!
//! `state.bin` layout, all integers little-endian:
//!
//! ```text
//! magic "KM0STATE" | u32 format version (1) | u64 window count
//! per window: u32 key field count | per field: u32 length, UTF-8 bytes
//!             | i64 window start | i64 window end | u32 length, accumulator bytes
//! ```
//!
//! A savepoint is written to a temporary folder and renamed into place, so it is either
//! complete or absent; it is never modified afterwards. Reading verifies the checksums.

use crate::pipeline::hex;
use crate::plugin::PluginIdentity;
use crate::sink::SinkPosition;
use crate::source::SourcePosition;
use crate::window::Window;
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

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WatermarkState {
    pub current: i64,
    pub max_event_time: Option<i64>,
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
    /// Stable id of the operator whose state this is.
    pub operator: String,
    pub pipeline: PipelineIdentity,
    pub plugin: PluginIdentity,
    pub source: SourcePosition,
    pub watermark: WatermarkState,
    pub counters: crate::job::Counters,
    pub sinks: Vec<SinkPosition>,
    pub state: StateFile,
}

/// One open window in a savepoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WindowEntry {
    pub key: Vec<String>,
    pub window: Window,
    pub acc: Vec<u8>,
}

/// A savepoint read from disk and verified.
#[derive(Debug)]
pub struct Savepoint {
    pub path: PathBuf,
    pub meta: SavepointMeta,
    pub windows: Vec<WindowEntry>,
}

fn corrupt(path: &Path, message: impl Into<String>) -> Error {
    Error::Savepoint { path: path.to_path_buf(), message: message.into() }
}

/// Write a savepoint into the new folder `dir`. `meta.state` is filled in here.
pub fn write<'a>(
    dir: &Path,
    mut meta: SavepointMeta,
    windows: impl Iterator<Item = (Vec<&'a str>, Window, &'a [u8])>,
) -> Result<SavepointMeta> {
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

    let mut state = Vec::new();
    state.extend_from_slice(MAGIC);
    state.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    state.extend_from_slice(&0u64.to_le_bytes()); // count, patched below
    let mut count = 0u64;
    for (key, window, acc) in windows {
        state.extend_from_slice(&(key.len() as u32).to_le_bytes());
        for field in key {
            state.extend_from_slice(&(field.len() as u32).to_le_bytes());
            state.extend_from_slice(field.as_bytes());
        }
        state.extend_from_slice(&window.start.to_le_bytes());
        state.extend_from_slice(&window.end.to_le_bytes());
        state.extend_from_slice(&(acc.len() as u32).to_le_bytes());
        state.extend_from_slice(acc);
        count += 1;
    }
    state[12..20].copy_from_slice(&count.to_le_bytes());
    let state_sha = hex(&Sha256::digest(&state));
    meta.state = StateFile {
        file: STATE.into(),
        windows: count,
        bytes: state.len() as u64,
        sha256: state_sha.clone(),
    };
    let meta_json =
        serde_json::to_vec_pretty(&meta).map_err(|e| corrupt(dir, format!("encode metadata: {e}")))?;
    let meta_sha = hex(&Sha256::digest(&meta_json));

    write_synced(&tmp.join(STATE), &state)?;
    write_synced(&tmp.join(META), &meta_json)?;
    write_synced(&tmp.join(CHECKSUM), format!("{meta_sha}  {META}\n{state_sha}  {STATE}\n").as_bytes())?;
    std::fs::rename(&tmp, dir).map_err(|e| Error::io("rename savepoint into", dir, e))?;
    Ok(meta)
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = std::fs::File::create(path).map_err(|e| Error::io("create", path, e))?;
    f.write_all(bytes).map_err(|e| Error::io("write", path, e))?;
    f.sync_all().map_err(|e| Error::io("sync", path, e))
}

/// Read and verify a savepoint folder.
pub fn read(dir: &Path) -> Result<Savepoint> {
    let read = |name: &str| {
        std::fs::read(dir.join(name)).map_err(|e| Error::io("read savepoint file", dir.join(name), e))
    };
    let checksum = String::from_utf8(read(CHECKSUM)?).map_err(|_| corrupt(dir, "CHECKSUM is not text"))?;
    let meta_bytes = read(META)?;
    let state = read(STATE)?;
    let mut expected = std::collections::HashMap::new();
    for line in checksum.lines() {
        if let Some((sum, file)) = line.split_once("  ") {
            expected.insert(file.to_string(), sum.to_string());
        }
    }
    for (file, bytes) in [(META, &meta_bytes), (STATE, &state)] {
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
    if meta.format != FORMAT || meta.format_version != FORMAT_VERSION {
        return Err(corrupt(
            dir,
            format!("format {} v{} is not {FORMAT} v{FORMAT_VERSION}", meta.format, meta.format_version),
        ));
    }
    let windows = decode_state(&state).map_err(|m| corrupt(dir, format!("{STATE}: {m}")))?;
    if windows.len() as u64 != meta.state.windows {
        return Err(corrupt(dir, "window count differs from the metadata"));
    }
    Ok(Savepoint { path: dir.to_path_buf(), meta, windows })
}

fn decode_state(b: &[u8]) -> Result<Vec<WindowEntry>, String> {
    struct R<'a>(&'a [u8]);
    impl<'a> R<'a> {
        fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
            if self.0.len() < n {
                return Err("truncated".into());
            }
            let (a, rest) = self.0.split_at(n);
            self.0 = rest;
            Ok(a)
        }
        fn u32(&mut self) -> Result<u32, String> {
            Ok(u32::from_le_bytes(self.take(4)?.try_into().map_err(|_| "truncated")?))
        }
        fn u64(&mut self) -> Result<u64, String> {
            Ok(u64::from_le_bytes(self.take(8)?.try_into().map_err(|_| "truncated")?))
        }
        fn i64(&mut self) -> Result<i64, String> {
            Ok(i64::from_le_bytes(self.take(8)?.try_into().map_err(|_| "truncated")?))
        }
    }
    let mut r = R(b);
    if r.take(8)? != MAGIC {
        return Err("not a km0 state file".into());
    }
    let version = r.u32()?;
    if version != FORMAT_VERSION {
        return Err(format!("state format {version} is not {FORMAT_VERSION}"));
    }
    let count = r.u64()?;
    let mut out = Vec::with_capacity(count.min(1 << 24) as usize);
    for _ in 0..count {
        let arity = r.u32()?;
        let mut key = Vec::with_capacity(arity.min(64) as usize);
        for _ in 0..arity {
            let len = r.u32()? as usize;
            let f = std::str::from_utf8(r.take(len)?).map_err(|_| "key is not UTF-8")?;
            key.push(f.to_string());
        }
        let start = r.i64()?;
        let end = r.i64()?;
        let len = r.u32()? as usize;
        let acc = r.take(len)?.to_vec();
        out.push(WindowEntry { key, window: Window { start, end }, acc });
    }
    if !r.0.is_empty() {
        return Err("bytes after the last window".into());
    }
    Ok(out)
}

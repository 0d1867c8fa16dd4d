//! Plugin components kept with a job's snapshots, named by their content hash, so that a
//! job whose plugin was deployed (live, or from a savepoint) resumes with the plugin it
//! ran, whatever its pipeline file still names:
//!
//! - `CHECKPOINTS/components/<sha256>.wasm`: written when the component starts running,
//!   before any checkpoint that records it;
//! - `SAVEPOINT/components/<sha256>.wasm`: inside each savepoint taken while it runs, so
//!   that a savepoint is whole wherever it is copied.
//!
//! A snapshot records each aggregation's component by its SHA-256
//! ([`crate::plugin::PluginIdentity::sha256`]); a stored file is used only if its bytes
//! have that hash.

use crate::pipeline::hex;
use crate::{Error, Result};
use sha2::{Digest, Sha256};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The folder of components inside a checkpoint store or a savepoint.
pub const FOLDER: &str = "components";

/// A component's bytes and their SHA-256.
#[derive(Clone, Debug)]
pub struct Component {
    pub sha256: String,
    pub bytes: Arc<Vec<u8>>,
}

impl Component {
    pub fn new(bytes: Vec<u8>) -> Component {
        Component { sha256: hex(&Sha256::digest(&bytes)), bytes: Arc::new(bytes) }
    }

    fn file(dir: &Path, sha256: &str) -> PathBuf {
        dir.join(FOLDER).join(format!("{sha256}.wasm"))
    }

    /// Store it under `dir/components/` (durably; nothing to do if it is there already).
    pub fn put(&self, dir: &Path) -> Result<PathBuf> {
        let path = Self::file(dir, &self.sha256);
        if Self::read(&path, &self.sha256).is_some() {
            return Ok(path);
        }
        let folder = dir.join(FOLDER);
        std::fs::create_dir_all(&folder).map_err(|e| Error::io("create", &folder, e))?;
        let tmp = folder.join(format!(".{}.tmp-{}", self.sha256, std::process::id()));
        let written = std::fs::File::create(&tmp)
            .and_then(|mut f| f.write_all(&self.bytes).and_then(|_| f.sync_all()))
            .and_then(|_| std::fs::rename(&tmp, &path))
            .and_then(|_| std::fs::File::open(&folder).and_then(|f| f.sync_all()));
        written.map_err(|e| Error::io("store component", &path, e))?;
        Ok(path)
    }

    /// The component with this hash, from the first of `dirs` that holds it intact.
    pub fn find(dirs: &[&Path], sha256: &str) -> Option<(Component, PathBuf)> {
        dirs.iter().find_map(|d| {
            let path = Self::file(d, sha256);
            Self::read(&path, sha256).map(|c| (c, path))
        })
    }

    fn read(path: &Path, sha256: &str) -> Option<Component> {
        let bytes = std::fs::read(path).ok()?;
        let c = Component::new(bytes);
        (c.sha256 == sha256).then_some(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stored_component_is_found_by_its_hash_and_a_damaged_one_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let c = Component::new(b"\0asm-ish bytes".to_vec());
        let path = c.put(dir.path()).unwrap();
        let (found, at) = Component::find(&[Path::new("/nonexistent"), dir.path()], &c.sha256).unwrap();
        assert_eq!((found.bytes.as_slice(), at), (&b"\0asm-ish bytes"[..], path.clone()));
        std::fs::write(&path, b"other bytes").unwrap();
        assert!(Component::find(&[dir.path()], &c.sha256).is_none());
        // Putting it again repairs it.
        c.put(dir.path()).unwrap();
        assert!(Component::find(&[dir.path()], &c.sha256).is_some());
    }
}

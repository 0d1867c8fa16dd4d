//! Where checkpoints live: numbered snapshots (`chk-000001`, ...) in the savepoint
//! format, behind a small interface so that an object store (S3-compatible) can take the
//! local folder's place without touching the operators. A snapshot is complete or absent
//! (written aside and renamed), verified when read; the newest valid one is what a
//! restart recovers from, and a corrupt one is skipped with a warning.

use super::remote::RemoteStore;
use super::savepoint::{self, Savepoint, SavepointMeta};
use crate::window::operator::Capture;
use crate::{Error, Result};
use std::path::{Path, PathBuf};

/// Storage of numbered snapshots.
pub trait SnapshotStore {
    /// Write snapshot `n` atomically.
    fn write(&self, n: u64, meta: SavepointMeta, snapshots: &[Capture]) -> Result<String>;
    /// Numbers of the snapshots present, ascending (complete or not: `read` verifies).
    fn list(&self) -> Result<Vec<u64>>;
    /// Read and verify snapshot `n`.
    fn read(&self, n: u64) -> Result<Savepoint>;
    fn remove(&self, n: u64) -> Result<()>;
    /// Record that the sink transaction of snapshot `n`'s epoch committed.
    fn mark_committed(&self, n: u64) -> Result<()>;
    /// True once [`SnapshotStore::mark_committed`] was called for `n`.
    fn is_committed(&self, n: u64) -> bool;
}

/// Snapshots as folders in a local directory.
#[derive(Debug, Clone)]
pub struct LocalStore {
    dir: PathBuf,
}

impl LocalStore {
    /// Open (and create) the folder; leftovers of interrupted writes are removed.
    pub fn open(dir: &Path) -> Result<LocalStore> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io("create checkpoint folder", dir, e))?;
        let entries = std::fs::read_dir(dir).map_err(|e| Error::io("list", dir, e))?;
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with(".chk-") && name.contains(".tmp-") {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
        Ok(LocalStore { dir: dir.to_path_buf() })
    }

    /// The folder of snapshot `n`.
    pub fn path(&self, n: u64) -> PathBuf {
        self.dir.join(format!("chk-{n:06}"))
    }
}

impl SnapshotStore for LocalStore {
    fn write(&self, n: u64, meta: SavepointMeta, snapshots: &[Capture]) -> Result<String> {
        let path = self.path(n);
        savepoint::write(&path, meta, snapshots)?;
        Ok(path.display().to_string())
    }

    fn list(&self) -> Result<Vec<u64>> {
        let entries = std::fs::read_dir(&self.dir).map_err(|e| Error::io("list", &self.dir, e))?;
        let mut out: Vec<u64> = entries
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.strip_prefix("chk-")?.parse().ok())
            .collect();
        out.sort_unstable();
        Ok(out)
    }

    fn read(&self, n: u64) -> Result<Savepoint> {
        savepoint::read(&self.path(n))
    }

    fn remove(&self, n: u64) -> Result<()> {
        let p = self.path(n);
        std::fs::remove_dir_all(&p).map_err(|e| Error::io("remove checkpoint", p, e))
    }

    fn mark_committed(&self, n: u64) -> Result<()> {
        let p = self.path(n).join(COMMITTED);
        let f = std::fs::File::create(&p).map_err(|e| Error::io("mark committed", &p, e))?;
        f.sync_all().map_err(|e| Error::io("sync", &p, e))?;
        let dir = self.path(n);
        std::fs::File::open(&dir).and_then(|d| d.sync_all()).map_err(|e| Error::io("sync", dir, e))
    }

    fn is_committed(&self, n: u64) -> bool {
        self.path(n).join(COMMITTED).is_file()
    }
}

/// A job's checkpoints: the local folder they are written to, and the shared object store
/// each complete one is copied to, when `[checkpoints] dir` names one. With a shared store
/// it is the store that says which checkpoints exist: a process on another machine (or a
/// new owner of a task) recovers from there.
#[derive(Debug, Clone)]
pub struct Checkpoints {
    pub local: LocalStore,
    pub remote: Option<RemoteStore>,
}

impl Checkpoints {
    /// The local folder `dir`, and the store `remote` (a URL) if given.
    pub fn open(dir: &Path, remote: Option<&str>) -> Result<Checkpoints> {
        let local = LocalStore::open(dir)?;
        let remote = remote.map(RemoteStore::open).transpose()?;
        Ok(Checkpoints { local, remote })
    }

    /// The local folder of checkpoint `n`.
    pub fn path(&self, n: u64) -> PathBuf {
        self.local.path(n)
    }

    /// Checkpoint `n` is complete in the local folder: copy it to the shared store.
    pub fn publish(&self, n: u64) -> Result<()> {
        match &self.remote {
            Some(r) => r.upload(n, &self.local.path(n)),
            None => Ok(()),
        }
    }

    /// Calls to the shared store give up at `at` (a hand-over's deadline).
    pub fn give_up_at(&self, at: std::time::Instant) {
        if let Some(r) = &self.remote {
            r.give_up_at(at);
        }
    }

    /// Take the task's checkpoints in the shared store (fencing a previous owner).
    pub fn claim(&self) -> Result<Option<u64>> {
        match &self.remote {
            Some(r) => r.claim().map(Some),
            None => Ok(None),
        }
    }

    /// Whether a task of a job that a consumer group shares restores the savepoint whose
    /// snapshot is `snapshot_id` (the job was started from it), rather than its newest
    /// checkpoint: the first owner of the task records the restore in the store (with the
    /// newest checkpoint then); a later owner restores the savepoint again only if no
    /// checkpoint was completed since, so a task's savepoint is restored once for the life
    /// of the job whichever process takes it, and however often.
    pub fn first_restore(&self, snapshot_id: &str) -> Result<bool> {
        let newest = self.list()?.last().copied().unwrap_or(0);
        let name = format!("restored/{snapshot_id}");
        let recorded = match &self.remote {
            Some(r) => {
                if r.create_object(&name, newest.to_string().into_bytes())? {
                    return Ok(true);
                }
                r.get_object(&name)?.unwrap_or_default()
            }
            None => {
                let path = self.local.dir.join(format!("restored-{snapshot_id}"));
                let created = std::fs::OpenOptions::new().write(true).create_new(true).open(&path);
                match created {
                    Ok(mut f) => {
                        std::io::Write::write_all(&mut f, newest.to_string().as_bytes())
                            .map_err(|e| crate::Error::io("write", &path, e))?;
                        return Ok(true);
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                        std::fs::read(&path).map_err(|e| crate::Error::io("read", &path, e))?
                    }
                    Err(e) => return Err(crate::Error::io("create", &path, e)),
                }
            }
        };
        let then: u64 = String::from_utf8_lossy(&recorded).trim().parse().unwrap_or(0);
        Ok(newest <= then)
    }

    /// The number the next checkpoint takes: after every one here or in the store.
    pub fn next(&self) -> Result<u64> {
        let mut newest = self.local.list()?.last().copied().unwrap_or(0);
        if let Some(r) = &self.remote {
            newest = newest.max(r.list()?.last().copied().unwrap_or(0));
        }
        Ok(newest + 1)
    }
}

impl SnapshotStore for Checkpoints {
    fn write(&self, n: u64, meta: SavepointMeta, snapshots: &[Capture]) -> Result<String> {
        let name = self.local.write(n, meta, snapshots)?;
        self.publish(n)?;
        Ok(match &self.remote {
            Some(r) => format!("{}/chk-{n:06}", r.url()),
            None => name,
        })
    }

    fn list(&self) -> Result<Vec<u64>> {
        match &self.remote {
            Some(r) => r.list(),
            None => self.local.list(),
        }
    }

    fn read(&self, n: u64) -> Result<Savepoint> {
        match &self.remote {
            Some(r) => {
                let sp = savepoint::read(&r.fetch(n, &self.local.dir.join(".fetched"))?)?;
                r.fetch_components(&self.local.dir)?;
                Ok(sp)
            }
            None => self.local.read(n),
        }
    }

    fn remove(&self, n: u64) -> Result<()> {
        if let Some(r) = &self.remote {
            r.remove(n)?;
            if !self.local.path(n).exists() {
                return Ok(());
            }
        }
        self.local.remove(n)
    }

    fn mark_committed(&self, n: u64) -> Result<()> {
        if let Some(r) = &self.remote {
            r.mark_committed(n)?;
        }
        self.local.mark_committed(n)
    }

    fn is_committed(&self, n: u64) -> bool {
        match &self.remote {
            Some(r) => r.is_committed(n),
            None => self.local.is_committed(n),
        }
    }
}

/// Marker of a checkpoint whose epoch's sink transaction committed.
const COMMITTED: &str = "COMMITTED";

/// The newest snapshot that reads back intact; corrupt ones are skipped with a warning.
/// With `committed_only` (a transactional sink), only snapshots whose epoch's transaction
/// committed count: a crash between a durable checkpoint and its commit left that
/// transaction open, the restarted producer aborts it, and the job replays the epoch
/// from the checkpoint before.
pub fn latest_valid(store: &dyn SnapshotStore, committed_only: bool) -> Result<Option<(u64, Savepoint)>> {
    for n in store.list()?.into_iter().rev() {
        if committed_only && !store.is_committed(n) {
            tracing::info!(checkpoint = n, "skipping a checkpoint whose transaction did not commit");
            continue;
        }
        match store.read(n) {
            Ok(sp) => return Ok(Some((n, sp))),
            Err(e) => {
                tracing::warn!(checkpoint = n, error = %e, "skipping a checkpoint that does not read back")
            }
        }
    }
    Ok(None)
}

/// Delete all but the newest `retain` snapshots.
pub fn prune(store: &dyn SnapshotStore, retain: usize) -> Result<()> {
    let all = store.list()?;
    for &n in all.iter().take(all.len().saturating_sub(retain)) {
        store.remove(n)?;
    }
    Ok(())
}

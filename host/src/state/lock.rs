//! One process at a time per state folder: a job holds an exclusive lock on
//! `<state folder>.lock` while it runs, so that a second job that would clear the same
//! folder (the same pipeline started twice, or two whose `[state] dir` is the same) is
//! refused at start instead of breaking the first.

use crate::{Error, Result};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

/// The lock; released when dropped (or when the process ends, however it ends).
#[derive(Debug)]
pub struct StateLock {
    _file: std::fs::File,
    pub path: PathBuf,
}

impl StateLock {
    /// Lock the state folder `dir` (its parent is created), or say who holds it.
    pub fn acquire(dir: &Path) -> Result<StateLock> {
        let path = dir.with_extension("lock");
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| Error::io("create folder", parent, e))?;
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| Error::io("open the state lock", &path, e))?;
        // SAFETY: flock on a descriptor this function owns.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                return Err(Error::Usage(format!(
                    "another km0 process runs a job with the state folder {} (locked in {}): stop it, or give \
                     this job another name or `[state] dir`",
                    dir.display(),
                    path.display()
                )));
            }
            return Err(Error::io("lock", &path, e));
        }
        Ok(StateLock { _file: file, path })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_on_one_folder_is_refused_until_the_first_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state/job");
        let first = StateLock::acquire(&state).unwrap();
        let e = StateLock::acquire(&state).unwrap_err().to_string();
        assert!(e.contains("another km0 process"), "{e}");
        let other = StateLock::acquire(&dir.path().join("state/other")).unwrap();
        drop(first);
        let again = StateLock::acquire(&state).unwrap();
        drop((again, other));
    }
}

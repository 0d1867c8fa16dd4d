//! The savepoints of a job whose tasks a consumer group shares, in the job's shared
//! store (`[checkpoints] dir = "s3://bucket/prefix"`), with no coordinator: any process
//! asks for one, every process saves the tasks it owns, and whoever sees the last task in
//! writes the manifest that makes it complete.
//!
//! ```text
//! <prefix>/savepoints/<id>/request.json        what was asked (a savepoint, or a stop), by whom, until when
//! <prefix>/savepoints/<id>/<task>/<writer>/... the task's savepoint, as its owner uploaded it
//! <prefix>/savepoints/<id>/<task>.done         created only if absent, naming that writer
//! <prefix>/savepoints/<id>/tasks.json          written last: the savepoint is complete
//! <prefix>/savepoints/<id>/ABANDONED           the request timed out (the reason inside)
//! <prefix>/savepoints/STOPPING                 the id of a stop under way (one at a time)
//! <prefix>/savepoints/LAST_STOP                the request of the last stop that completed
//! ```
//!
//! A process opens no task of a stop that completed after the process started, nor, while
//! a stop is under way, a task already saved in it ([`GroupSavepoints::may_open`]): no
//! record is read past a stop's savepoint.
//!
//! Fetched ([`GroupSavepoints::fetch`]), a complete one is a job savepoint of tasks as one
//! process writes it (`tasks.json` and a folder per task): it starts a group, or a single
//! process at any parallelism.

use super::remote::RemoteStore;
use super::savepoint::{self, TaskEntry, TasksManifest};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Duration;

const FOLDER: &str = "savepoints";
const REQUEST: &str = "request.json";
const ABANDONED: &str = "ABANDONED";
const STOPPING: &str = "STOPPING";
const LAST_STOP: &str = "LAST_STOP";

/// What a process asked of the group.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Request {
    pub id: String,
    /// Every task stops once saved, and the processes leave the group.
    pub stop: bool,
    /// When it was asked, and until when the tasks may take to be saved (epoch ms).
    pub at_ms: i64,
    pub deadline_ms: i64,
    /// The member that asked.
    pub by: String,
}

/// Where a savepoint of the group stands.
#[derive(Debug, Clone)]
pub enum Progress {
    /// Asked; the tasks saved so far.
    Open(Request, Vec<String>),
    Complete(Request, TasksManifest),
    Abandoned(Request, String),
}

/// The group savepoints of one job's store.
#[derive(Clone, Debug)]
pub struct GroupSavepoints {
    store: RemoteStore,
}

impl GroupSavepoints {
    /// The savepoints of the job whose store is `url` (`s3://bucket/prefix`).
    pub fn open(url: &str) -> Result<GroupSavepoints> {
        Ok(GroupSavepoints { store: RemoteStore::open(url)? })
    }

    /// Calls to the store under way and to come give up at `at`.
    pub fn give_up_at(&self, at: std::time::Instant) {
        self.store.give_up_at(at);
    }

    /// A savepoint's URL (what `km0 run --from-savepoint` takes).
    pub fn url_of(&self, id: &str) -> String {
        format!("{}/{FOLDER}/{id}", self.store.url().trim_end_matches('/'))
    }

    /// Ask every process for a savepoint of its tasks (and with `stop`, to stop them):
    /// refused while another stop is under way.
    pub fn request(&self, stop: bool, timeout: Duration, by: &str) -> Result<Request> {
        let at_ms = crate::metrics::now_ms();
        let id = format!("gsp-{at_ms}-{}", self.store.writer().chars().take(6).collect::<String>());
        let request = Request {
            id: id.clone(),
            stop,
            at_ms,
            deadline_ms: at_ms + timeout.as_millis() as i64,
            by: by.into(),
        };
        if let Some(other) = self.stopping()? {
            return Err(Error::Usage(format!("the group is stopping already (savepoint {other})")));
        }
        if stop && !self.store.create_object(&format!("{FOLDER}/{STOPPING}"), id.clone().into_bytes())? {
            return Err(Error::Usage("another process is stopping the group".into()));
        }
        let body = serde_json::to_vec_pretty(&request)
            .map_err(|e| Error::Usage(format!("encode a request: {e}")))?;
        self.store.put_object(&format!("{FOLDER}/{id}/{REQUEST}"), body)?;
        Ok(request)
    }

    /// The stop under way, if any (its savepoint's id).
    pub fn stopping(&self) -> Result<Option<String>> {
        Ok(self
            .store
            .get_object(&format!("{FOLDER}/{STOPPING}"))?
            .map(|b| String::from_utf8_lossy(&b).trim().to_string()))
    }

    /// The requests not complete nor abandoned yet, oldest first; `known` holds the ids
    /// found finished before (not looked at again), and gets those found finished now.
    pub fn open_requests(&self, known: &mut std::collections::HashSet<String>) -> Result<Vec<Request>> {
        let (mut ids, _) = self.store.children(FOLDER)?;
        ids.sort();
        let mut open = Vec::new();
        ids.retain(|id| !known.contains(id));
        for id in ids {
            let (_, files) = self.store.children(&format!("{FOLDER}/{id}"))?;
            if files.iter().any(|f| f == savepoint::TASKS || f == ABANDONED) {
                known.insert(id);
                continue;
            }
            if let Some(r) = self.request_of(&id)? {
                open.push(r);
            }
        }
        Ok(open)
    }

    fn request_of(&self, id: &str) -> Result<Option<Request>> {
        let Some(bytes) = self.store.get_object(&format!("{FOLDER}/{id}/{REQUEST}"))? else {
            return Ok(None);
        };
        match serde_json::from_slice(&bytes) {
            Ok(r) => Ok(Some(r)),
            Err(e) => {
                tracing::warn!(savepoint = id, error = %e, "a group savepoint request that does not read is skipped");
                Ok(None)
            }
        }
    }

    /// The tasks of savepoint `id` saved so far.
    pub fn saved(&self, id: &str) -> Result<Vec<String>> {
        let (_, files) = self.store.children(&format!("{FOLDER}/{id}"))?;
        Ok(files.iter().filter_map(|f| f.strip_suffix(".done")).map(str::to_string).collect())
    }

    /// Put `task`'s savepoint (the local folder `local`) into savepoint `id`: false when
    /// another process put it first (its copy counts).
    pub fn put_task(&self, id: &str, task: &str, local: &Path) -> Result<bool> {
        let writer = self.store.writer().to_string();
        self.store.upload_folder(local, &format!("{FOLDER}/{id}/{task}/{writer}"))?;
        self.store.create_object(&format!("{FOLDER}/{id}/{task}.done"), writer.into_bytes())
    }

    /// Make savepoint `id` complete if every one of `tasks` (name, partition) is in it:
    /// its manifest, written once; a stop is then over. The manifest, if complete.
    pub fn complete(
        &self,
        request: &Request,
        pipeline: &str,
        tasks: &[(String, String)],
    ) -> Result<Option<TasksManifest>> {
        let saved = self.saved(&request.id)?;
        if tasks.iter().any(|(t, _)| !saved.contains(t)) {
            return Ok(None);
        }
        let manifest = TasksManifest {
            format: savepoint::FORMAT.into(),
            format_version: savepoint::FORMAT_VERSION,
            pipeline: pipeline.into(),
            tasks: tasks
                .iter()
                .map(|(task, partition)| TaskEntry {
                    task: task.clone(),
                    partition: partition.clone(),
                    ended: false,
                })
                .collect(),
        };
        let body = serde_json::to_vec_pretty(&manifest)
            .map_err(|e| Error::Usage(format!("encode a manifest: {e}")))?;
        self.store.create_object(&format!("{FOLDER}/{}/{}", request.id, savepoint::TASKS), body)?;
        if request.stop {
            let body =
                serde_json::to_vec(request).map_err(|e| Error::Usage(format!("encode a request: {e}")))?;
            self.store.put_object(&format!("{FOLDER}/{LAST_STOP}"), body)?;
            self.end_stop(&request.id)?;
        }
        tracing::info!(savepoint = %self.url_of(&request.id), tasks = tasks.len(), stop = request.stop, "group savepoint complete");
        Ok(Some(manifest))
    }

    /// The stop of savepoint `id` is over (complete or abandoned).
    fn end_stop(&self, id: &str) -> Result<()> {
        if self.stopping()?.as_deref() == Some(id) {
            self.store.delete_object(&format!("{FOLDER}/{STOPPING}"))?;
        }
        Ok(())
    }

    /// The last stop of the group that completed, if any.
    pub fn last_stop(&self) -> Result<Option<Request>> {
        let Some(bytes) = self.store.get_object(&format!("{FOLDER}/{LAST_STOP}"))? else { return Ok(None) };
        Ok(serde_json::from_slice(&bytes).ok())
    }

    /// Whether a process that started at `started_ms` may open `task`: not after a stop
    /// that completed since, nor while a stop is under way that has saved the task.
    pub fn may_open(&self, task: &str, started_ms: i64) -> Result<bool> {
        if self.last_stop()?.is_some_and(|r| r.at_ms >= started_ms) {
            return Ok(false);
        }
        match self.stopping()? {
            Some(id) => Ok(!self.saved(&id)?.iter().any(|t| t == task)),
            None => Ok(true),
        }
    }

    /// Give savepoint `id` up, with `reason` (unless it completed meanwhile).
    pub fn abandon(&self, request: &Request, reason: &str) -> Result<()> {
        let (_, files) = self.store.children(&format!("{FOLDER}/{}", request.id))?;
        if !files.iter().any(|f| f == savepoint::TASKS) {
            self.store
                .create_object(&format!("{FOLDER}/{}/{ABANDONED}", request.id), reason.as_bytes().to_vec())?;
        }
        if request.stop {
            self.end_stop(&request.id)?;
        }
        Ok(())
    }

    /// Where savepoint `id` stands.
    pub fn progress(&self, id: &str) -> Result<Progress> {
        let Some(request) = self.request_of(id)? else {
            return Err(Error::Usage(format!("{} is no savepoint of the group", self.url_of(id))));
        };
        if let Some(m) = self.store.get_object(&format!("{FOLDER}/{id}/{}", savepoint::TASKS))? {
            let m: TasksManifest = serde_json::from_slice(&m)
                .map_err(|e| Error::Usage(format!("{}: {}: {e}", self.url_of(id), savepoint::TASKS)))?;
            return Ok(Progress::Complete(request, m));
        }
        if let Some(why) = self.store.get_object(&format!("{FOLDER}/{id}/{ABANDONED}"))? {
            return Ok(Progress::Abandoned(request, String::from_utf8_lossy(&why).into_owned()));
        }
        Ok(Progress::Open(request.clone(), self.saved(id)?))
    }

    /// Every savepoint of the group, oldest first.
    pub fn list(&self) -> Result<Vec<Progress>> {
        let (mut ids, _) = self.store.children(FOLDER)?;
        ids.sort();
        ids.iter()
            .filter(|id| self.request_of(id).ok().flatten().is_some())
            .map(|id| self.progress(id))
            .collect()
    }

    /// Fetch the complete savepoint `id` into `cache` as a job savepoint of tasks: its
    /// folder (fetched once).
    pub fn fetch(&self, id: &str, cache: &Path) -> Result<PathBuf> {
        if id.is_empty() || !id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
            return Err(Error::Usage(format!("{id:?} is not a savepoint id")));
        }
        let to = cache.join(id);
        if to.join(savepoint::TASKS).is_file() {
            return Ok(to);
        }
        let manifest = match self.progress(id)? {
            Progress::Complete(_, m) => m,
            Progress::Open(..) => {
                return Err(Error::Usage(format!("{} is not complete (yet)", self.url_of(id))))
            }
            Progress::Abandoned(_, why) => {
                return Err(Error::Usage(format!("{} was abandoned: {why}", self.url_of(id))))
            }
        };
        // Names from the store become local paths: plain names only.
        if let Some(t) = manifest.tasks.iter().find(|t| {
            t.task.is_empty() || !t.task.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        }) {
            return Err(Error::Usage(format!("{}: {:?} is not a task's name", self.url_of(id), t.task)));
        }
        let tmp = cache.join(format!(".{id}.tmp-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        for t in manifest.tasks.iter().filter(|t| !t.ended) {
            let writer = self
                .store
                .get_object(&format!("{FOLDER}/{id}/{}.done", t.task))?
                .map(|w| String::from_utf8_lossy(&w).trim().to_string())
                .filter(|w| !w.is_empty() && w.bytes().all(|b| b.is_ascii_hexdigit()))
                .ok_or_else(|| Error::Usage(format!("{}: task {} has no copy", self.url_of(id), t.task)))?;
            self.store.download_folder(&format!("{FOLDER}/{id}/{}/{writer}", t.task), &tmp.join(&t.task))?;
        }
        let body = serde_json::to_vec_pretty(&manifest)
            .map_err(|e| Error::Usage(format!("encode a manifest: {e}")))?;
        std::fs::create_dir_all(&tmp).map_err(|e| Error::io("create folder", &tmp, e))?;
        std::fs::write(tmp.join(savepoint::TASKS), body)
            .map_err(|e| Error::io("write", tmp.join(savepoint::TASKS), e))?;
        // It reads as a job savepoint, or it is not kept.
        savepoint::read_tasks(&tmp)?;
        std::fs::rename(&tmp, &to).map_err(|e| Error::io("rename fetched savepoint", &to, e))?;
        Ok(to)
    }

    /// Put the job savepoint of tasks at `local` into the store as a complete savepoint
    /// of the group (an offline deploy's result): its URL.
    pub fn put(&self, local: &Path, by: &str) -> Result<String> {
        let Some(manifest) = savepoint::read_tasks(local)? else {
            return Err(Error::Savepoint {
                path: local.to_path_buf(),
                message: "is not the savepoint of a job of tasks".into(),
            });
        };
        let request = self.request(false, Duration::ZERO, by)?;
        let writer = self.store.writer().to_string();
        for t in manifest.tasks.iter().filter(|t| !t.ended) {
            self.put_task(&request.id, &t.task, &local.join(&t.task))?;
        }
        let body = serde_json::to_vec_pretty(&manifest)
            .map_err(|e| Error::Usage(format!("encode a manifest: {e}")))?;
        self.store.create_object(&format!("{FOLDER}/{}/{}", request.id, savepoint::TASKS), body)?;
        tracing::info!(savepoint = %self.url_of(&request.id), writer, "job savepoint put into the store");
        Ok(self.url_of(&request.id))
    }
}

/// Whether `path` names a savepoint in a store (`s3://.../savepoints/<id>`).
pub fn in_store(path: &Path) -> bool {
    path.to_str().is_some_and(|p| p.starts_with("s3://"))
}

/// Fetch the group savepoint at `url` (`s3://bucket/prefix/savepoints/<id>`) into
/// `cache`: the local job savepoint.
pub fn fetch_url(url: &str, cache: &Path) -> Result<PathBuf> {
    let url = url.trim_end_matches('/');
    let Some((job, id)) = url.rsplit_once(&format!("/{FOLDER}/")) else {
        return Err(Error::Usage(format!(
            "{url} is not a savepoint of a group (s3://bucket/prefix/{FOLDER}/<id>)"
        )));
    };
    std::fs::create_dir_all(cache).map_err(|e| Error::io("create folder", cache, e))?;
    GroupSavepoints::open(job)?.fetch(id, cache)
}

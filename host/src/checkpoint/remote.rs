//! Checkpoints in a shared object store (S3 or an S3-compatible server, through the
//! `object_store` crate): `[checkpoints] dir = "s3://bucket/prefix"`, credentials and
//! endpoint from the usual AWS environment variables (`AWS_ENDPOINT`,
//! `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_DEFAULT_REGION`, `AWS_ALLOW_HTTP`).
//!
//! A checkpoint is written to the local folder first (as without a shared store), then
//! copied: every file under `<prefix>/chk-N/<writer>/`, and last `<prefix>/chk-N/_COMPLETE`,
//! created only if absent, naming the writer. Only a checkpoint with `_COMPLETE` is
//! listed, and only its writer's files are read: a torn upload is never restored, and a
//! process that lost its task (fenced: another wrote `_COMPLETE` of that number first)
//! fails its checkpoint instead of overwriting the new owner's. A checkpoint read from the
//! store is fetched into `<local>/.fetched/` and verified as any savepoint is.
//!
//! RocksDB's table files (`*.sst`) never change once written, and a checkpoint shares most
//! of them with the one before: each goes once to `<prefix>/shared/<writer>/`, and a
//! checkpoint lists the ones it holds in `<prefix>/chk-N/<writer>.shared`. Removing a
//! checkpoint removes the shared files no complete checkpoint lists any more.

use crate::{Error, Result};
use object_store::path::Path as StorePath;
use object_store::{ObjectStore, PutMode, PutOptions, PutPayload};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The marker that makes a checkpoint in the store complete (its writer's id inside).
const COMPLETE: &str = "_COMPLETE";

/// Checkpoints in an object store.
#[derive(Clone)]
pub struct RemoteStore {
    inner: Arc<Inner>,
}

struct Inner {
    url: String,
    store: Arc<dyn ObjectStore>,
    prefix: StorePath,
    rt: tokio::runtime::Runtime,
    /// This process's id in the paths it writes (random per run).
    writer: String,
    /// The generation this writer claimed when it took the task ([`RemoteStore::claim`]).
    generation: std::sync::OnceLock<u64>,
    /// Deployed components known to be in the store.
    components: std::sync::Mutex<std::collections::HashSet<String>>,
    /// Shared table files this writer has put in the store.
    shared: std::sync::Mutex<std::collections::HashSet<String>>,
}

/// The calls of this process to the store at `url` wait for it again (the group gave
/// the task back to this process).
pub fn wait_again(url: &str) {
    if let Ok(mut g) = GIVE_UP.lock() {
        g.retain(|(u, _)| u != url);
    }
}

/// When the calls of this process to a store (by URL) give up ([`give_up`]).
static GIVE_UP: std::sync::Mutex<Vec<(String, std::time::Instant)>> = std::sync::Mutex::new(Vec::new());

/// The calls of this process to the store at `url`, under way (on any thread) and to
/// come, give up at `at`: a task handed over to another process waits for the store only
/// so long, and so does a process that leaves its group ([`wait_again`] when the task is
/// given back).
pub fn give_up(url: &str, at: std::time::Instant) {
    if let Ok(mut g) = GIVE_UP.lock() {
        g.retain(|(u, _)| u != url);
        g.push((url.to_string(), at));
    }
}

impl std::fmt::Debug for RemoteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RemoteStore({})", self.inner.url)
    }
}

/// A live deploy as the job's processes learn of it from the shared store: every
/// process swaps it into the tasks it owns, and into each task it takes later.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DeployRecord {
    /// The component's SHA-256 (`components/<sha256>.wasm`).
    pub sha256: String,
    pub plugin: String,
    pub version: String,
    /// The aggregations it replaces.
    pub aggregations: Vec<String>,
    /// When it was deployed, epoch ms.
    pub at_ms: i64,
}

fn err(url: &str, what: impl std::fmt::Display) -> Error {
    Error::Usage(format!("checkpoint store {url}: {what}"))
}

impl RemoteStore {
    /// Connect to `url` (`s3://bucket/prefix`).
    pub fn open(url: &str) -> Result<RemoteStore> {
        let rest = url.strip_prefix("s3://").ok_or_else(|| err(url, "only s3:// URLs are supported"))?;
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() {
            return Err(err(url, "names no bucket"));
        }
        use object_store::aws::AmazonS3ConfigKey as Key;
        use object_store::ClientConfigKey as Client;
        // A request that hangs is given up after 10 s and retried (object_store's retries,
        // up to 3 minutes), rather than after the default 30 s; `AWS_TIMEOUT` and
        // `AWS_CONNECT_TIMEOUT` say otherwise.
        let mut builder = object_store::aws::AmazonS3Builder::from_env();
        for (var, key, value) in
            [("AWS_TIMEOUT", Client::Timeout, "10s"), ("AWS_CONNECT_TIMEOUT", Client::ConnectTimeout, "3s")]
        {
            if std::env::var_os(var).is_none() {
                builder = builder.with_config(Key::Client(key), value);
            }
        }
        let store = builder.with_bucket_name(bucket).build().map_err(|e| err(url, e))?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| err(url, format!("start the client runtime: {e}")))?;
        let mut id = [0u8; 8];
        let seed = format!("{:?}{}", std::time::SystemTime::now(), std::process::id());
        id.copy_from_slice(
            &sha2::Digest::finalize(<sha2::Sha256 as sha2::Digest>::new_with_prefix(seed))[..8],
        );
        Ok(RemoteStore {
            inner: Arc::new(Inner {
                url: url.to_string(),
                store: Arc::new(store),
                prefix: StorePath::from(prefix.trim_matches('/')),
                rt,
                writer: crate::pipeline::hex(&id),
                generation: std::sync::OnceLock::new(),
                components: Default::default(),
                shared: Default::default(),
            }),
        })
    }

    /// The store's URL.
    pub fn url(&self) -> &str {
        &self.inner.url
    }

    fn shared_dir(&self) -> StorePath {
        self.inner.prefix.child("shared")
    }

    /// The shared table files checkpoint `n` (written by `writer`) holds: (path in the
    /// checkpoint, key in the store).
    fn shared_of(&self, n: u64, writer: &str) -> Result<Vec<(String, StorePath)>> {
        let url = &self.inner.url;
        let list = self.chk(n).child(format!("{writer}.shared"));
        let text = match self.block(async { self.inner.store.get(&list).await?.bytes().await }) {
            Ok(b) => String::from_utf8_lossy(&b).into_owned(),
            Err(object_store::Error::NotFound { .. }) => return Ok(Vec::new()),
            Err(e) => return Err(err(url, format!("read {list}: {e}"))),
        };
        let shared = self.shared_dir();
        let mut out = Vec::new();
        for line in text.lines() {
            let Some((rel, key)) = line.split_once('\t') else {
                return Err(err(url, format!("{list}: a line is not `path<TAB>key`")));
            };
            let key = StorePath::from(key);
            let plain = rel.split('/').all(|p| !p.is_empty() && p != "." && p != "..");
            if !plain || key.prefix_match(&shared).is_none() {
                return Err(err(url, format!("{list}: {rel:?} or {key} is outside the checkpoint")));
            }
            out.push((rel.to_string(), key));
        }
        Ok(out)
    }

    /// The writer that completed checkpoint `n`.
    fn writer_of(&self, n: u64) -> Result<String> {
        let url = &self.inner.url;
        let marker = self.chk(n).child(COMPLETE);
        let writer = self
            .block(async { self.inner.store.get(&marker).await?.bytes().await })
            .map_err(|e| err(url, format!("read {marker}: {e}")))?;
        let writer = String::from_utf8_lossy(&writer).trim().to_string();
        if writer.is_empty() || !writer.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(err(url, format!("{marker} does not name a writer")));
        }
        Ok(writer)
    }

    /// Delete the shared table files no complete checkpoint holds.
    fn remove_unshared(&self) -> Result<()> {
        let mut held = std::collections::HashSet::new();
        for n in self.list()? {
            // A checkpoint whose list does not read now (the store slow or down for a
            // moment, or the checkpoint corrupt until retention removes it) keeps every
            // file: they go at a later prune. A checkpoint's files are never removed
            // while it may be restored.
            match self.writer_of(n).and_then(|w| self.shared_of(n, &w)) {
                Ok(files) => held.extend(files.into_iter().map(|(_, k)| k.to_string())),
                Err(e) => {
                    tracing::warn!(checkpoint = n, error = %e, "shared table files kept: a checkpoint's list does not read");
                    return Ok(());
                }
            }
        }
        for o in
            self.objects_under(self.shared_dir())?.into_iter().filter(|o| !held.contains(o.location.as_ref()))
        {
            self.delete(&o.location)?;
            if let Ok(mut s) = self.inner.shared.lock() {
                s.remove(o.location.as_ref());
            }
        }
        Ok(())
    }

    fn chk(&self, n: u64) -> StorePath {
        self.inner.prefix.child(format!("chk-{n:06}"))
    }

    /// Run a call to the store to its end, or until the give-up time passes.
    fn block<T>(
        &self,
        f: impl std::future::Future<Output = object_store::Result<T>>,
    ) -> object_store::Result<T> {
        let url = &self.inner.url;
        let passed = || {
            let now = std::time::Instant::now();
            GIVE_UP.lock().is_ok_and(|g| g.iter().any(|(u, at)| u == url && now >= *at))
        };
        self.inner.rt.block_on(async {
            tokio::pin!(f);
            loop {
                tokio::select! {
                    r = &mut f => return r,
                    () = tokio::time::sleep(std::time::Duration::from_millis(50)) => if passed() {
                        return Err(object_store::Error::Generic {
                            store: "S3",
                            source: "the store did not answer before the hand-over's deadline".into(),
                        });
                    }
                }
            }
        })
    }

    /// Calls to the store under way and to come give up at `at` ([`give_up`]).
    pub fn give_up_at(&self, at: std::time::Instant) {
        give_up(&self.inner.url, at);
    }

    /// Take the task: claim the next generation (`<prefix>/generations/G`, created only
    /// if absent). A writer whose generation is no longer the newest has lost the task:
    /// its checkpoints are refused ([`RemoteStore::upload`]).
    pub fn claim(&self) -> Result<u64> {
        let url = &self.inner.url;
        let dir = self.inner.prefix.child("generations");
        let listed = self
            .block(self.inner.store.list_with_delimiter(Some(&dir)))
            .map_err(|e| err(url, format!("list {dir}: {e}")))?;
        let mut g = listed
            .objects
            .iter()
            .filter_map(|o| o.location.filename()?.parse::<u64>().ok())
            .max()
            .unwrap_or(0);
        loop {
            g += 1;
            let create = PutOptions { mode: PutMode::Create, ..Default::default() };
            let path = dir.child(format!("{g:06}"));
            match self.block(self.inner.store.put_opts(
                &path,
                PutPayload::from(self.inner.writer.clone()),
                create,
            )) {
                Ok(_) => break,
                Err(object_store::Error::AlreadyExists { .. }) => continue,
                Err(e) => return Err(err(url, format!("claim {path}: {e}"))),
            }
        }
        let _ = self.inner.generation.set(g);
        tracing::info!(store = %url, generation = g, "took the task's checkpoints");
        Ok(g)
    }

    /// Whether this writer claimed the task's newest generation (a writer that claimed
    /// none, of a store no group shares, is not the newest).
    fn newest_generation(&self) -> Result<bool> {
        let Some(g) = self.inner.generation.get() else { return Ok(false) };
        let next = self.inner.prefix.child("generations").child(format!("{:06}", g + 1));
        match self.block(self.inner.store.head(&next)) {
            Err(object_store::Error::NotFound { .. }) => Ok(true),
            Ok(_) => Ok(false),
            Err(e) => Err(err(&self.inner.url, format!("look at {next}: {e}"))),
        }
    }

    /// Copy the local checkpoint folder `local` as checkpoint `n`: its files, then the
    /// marker (refused when another writer's checkpoint `n` is there, or another process
    /// claimed the task since: fenced).
    pub fn upload(&self, n: u64, local: &Path) -> Result<()> {
        let url = &self.inner.url;
        if let Some(g) = self.inner.generation.get() {
            let next = self.inner.prefix.child("generations").child(format!("{:06}", g + 1));
            match self.block(self.inner.store.head(&next)) {
                Err(object_store::Error::NotFound { .. }) => {}
                Ok(_) => {
                    return Err(Error::Fenced {
                        store: url.clone(),
                        message: format!(
                            "another process took the task (generation {} after this one's {g}): this one no \
                             longer owns it (fenced)",
                            g + 1
                        ),
                    })
                }
                Err(e) => return Err(err(url, format!("look at {next}: {e}"))),
            }
        }
        let base = self.chk(n).child(self.inner.writer.as_str());
        let mut files = Vec::new();
        walk(local, Path::new(""), &mut files).map_err(|e| Error::io("list checkpoint", local, e))?;
        let mut shared = String::new();
        for rel in files {
            let read =
                || std::fs::read(local.join(&rel)).map_err(|e| Error::io("read checkpoint file", &rel, e));
            let name = rel.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
            if name.ends_with(".sst") {
                let key = self.shared_dir().child(self.inner.writer.as_str()).child(name.as_str());
                let known = self.inner.shared.lock().is_ok_and(|s| s.contains(key.as_ref()));
                if !known {
                    self.block(self.inner.store.put(&key, PutPayload::from(read()?)))
                        .map_err(|e| err(url, format!("upload {key}: {e}")))?;
                    if let Ok(mut s) = self.inner.shared.lock() {
                        s.insert(key.to_string());
                    }
                }
                let rel: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
                shared.push_str(&format!("{}\t{key}\n", rel.join("/")));
                continue;
            }
            let mut to = base.clone();
            for part in rel.iter() {
                to = to.child(part.to_string_lossy().as_ref());
            }
            self.block(self.inner.store.put(&to, PutPayload::from(read()?)))
                .map_err(|e| err(url, format!("upload {to}: {e}")))?;
        }
        if !shared.is_empty() {
            let list = self.chk(n).child(format!("{}.shared", self.inner.writer));
            self.block(self.inner.store.put(&list, PutPayload::from(shared)))
                .map_err(|e| err(url, format!("upload {list}: {e}")))?;
        }
        // The deployed components it may run, before the checkpoint that needs them.
        if let Some(dir) = local.parent() {
            self.put_components(dir)?;
        }
        let marker = self.chk(n).child(COMPLETE);
        let create = PutOptions { mode: PutMode::Create, ..Default::default() };
        match self.block(self.inner.store.put_opts(&marker, PutPayload::from(self.inner.writer.clone()), create)) {
            Ok(_) => Ok(()),
            // The task's owner of the newest generation completes its checkpoint over one
            // an older owner completed meanwhile (the group moved the task while that one
            // still ran it; it is fenced from now on).
            Err(object_store::Error::AlreadyExists { .. }) if self.newest_generation()? => {
                tracing::warn!(store = %url, checkpoint = n, "completing a checkpoint an older owner of the task completed meanwhile");
                self.block(self.inner.store.put(&marker, PutPayload::from(self.inner.writer.clone())))
                    .map(drop)
                    .map_err(|e| err(url, format!("complete {marker}: {e}")))
            }
            Err(object_store::Error::AlreadyExists { .. }) => Err(Error::Fenced {
                store: url.clone(),
                message: format!(
                    "checkpoint chk-{n:06} was completed by another process: this one no longer owns the task \
                     (fenced)"
                ),
            }),
            Err(e) => Err(err(url, format!("complete {marker}: {e}"))),
        }
    }

    /// Copy the deployed components kept in `dir` (`components/<sha256>.wasm`) that the
    /// store does not have yet to `<prefix>/components/`: a task restored elsewhere runs
    /// the plugin it ran.
    fn put_components(&self, dir: &Path) -> Result<()> {
        let url = &self.inner.url;
        let Ok(entries) = std::fs::read_dir(dir.join(super::components::FOLDER)) else { return Ok(()) };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if !name.ends_with(".wasm") || name.starts_with('.') {
                continue;
            }
            if self.inner.components.lock().is_ok_and(|known| known.contains(&name)) {
                continue;
            }
            let to = self.inner.prefix.child(super::components::FOLDER).child(name.as_str());
            match self.block(self.inner.store.head(&to)) {
                Ok(_) => {}
                Err(object_store::Error::NotFound { .. }) => {
                    let bytes =
                        std::fs::read(e.path()).map_err(|err| Error::io("read component", e.path(), err))?;
                    self.block(self.inner.store.put(&to, PutPayload::from(bytes)))
                        .map_err(|e| err(url, format!("upload {to}: {e}")))?;
                }
                Err(e) => return Err(err(url, format!("look at {to}: {e}"))),
            }
            if let Ok(mut known) = self.inner.components.lock() {
                known.insert(name);
            }
        }
        Ok(())
    }

    /// Fetch the store's deployed components that `dir` does not have (each kept under
    /// its content's hash: a damaged one is never taken for another).
    pub fn fetch_components(&self, dir: &Path) -> Result<()> {
        let url = &self.inner.url;
        let from = self.inner.prefix.child(super::components::FOLDER);
        let listed = self
            .block(self.inner.store.list_with_delimiter(Some(&from)))
            .map_err(|e| err(url, format!("list {from}: {e}")))?;
        for o in listed.objects {
            let Some(sha) = o.location.filename().and_then(|f| f.strip_suffix(".wasm")).map(str::to_string)
            else {
                continue;
            };
            if super::components::Component::find(&[dir], &sha).is_some() {
                continue;
            }
            let bytes = self
                .block(async { self.inner.store.get(&o.location).await?.bytes().await })
                .map_err(|e| err(url, format!("download {}: {e}", o.location)))?;
            super::components::Component::new(bytes.to_vec()).put(dir)?;
        }
        Ok(())
    }

    /// Record a live deploy for every process of the job (this store is the job's, not a
    /// task's): its component under `components/`, then the record `deploys/N.json`
    /// (created only if absent: two deploys at once get numbers of their own). Its number.
    pub fn record_deploy(&self, record: &DeployRecord, component: &[u8]) -> Result<u64> {
        let url = &self.inner.url;
        self.put_component(&record.sha256, component)?;
        let body =
            serde_json::to_vec(record).map_err(|e| err(url, format!("encode a deploy record: {e}")))?;
        loop {
            let n = self.latest_deploy()?.map_or(1, |(n, _)| n + 1);
            let path = self.inner.prefix.child("deploys").child(format!("{n:06}.json"));
            let create = PutOptions { mode: PutMode::Create, ..Default::default() };
            match self.block(self.inner.store.put_opts(&path, PutPayload::from(body.clone()), create)) {
                Ok(_) => return Ok(n),
                Err(object_store::Error::AlreadyExists { .. }) => continue,
                Err(e) => return Err(err(url, format!("record {path}: {e}"))),
            }
        }
    }

    /// Put a deployed component into `components/` unless it is there.
    pub fn put_component(&self, sha256: &str, component: &[u8]) -> Result<()> {
        let to = self.inner.prefix.child(super::components::FOLDER).child(format!("{sha256}.wasm"));
        if let Err(object_store::Error::NotFound { .. }) = self.block(self.inner.store.head(&to)) {
            self.block(self.inner.store.put(&to, PutPayload::from(component.to_vec())))
                .map_err(|e| err(&self.inner.url, format!("upload {to}: {e}")))?;
        }
        Ok(())
    }

    /// The job's newest deploy record, if any (one that does not read is skipped).
    pub fn latest_deploy(&self) -> Result<Option<(u64, DeployRecord)>> {
        let url = &self.inner.url;
        let dir = self.inner.prefix.child("deploys");
        let listed = self
            .block(self.inner.store.list_with_delimiter(Some(&dir)))
            .map_err(|e| err(url, format!("list {dir}: {e}")))?;
        let mut found: Vec<(u64, StorePath)> = listed
            .objects
            .into_iter()
            .filter_map(|o| Some((o.location.filename()?.strip_suffix(".json")?.parse().ok()?, o.location)))
            .collect();
        found.sort_by_key(|(n, _)| *n);
        while let Some((n, path)) = found.pop() {
            let bytes = self
                .block(async { self.inner.store.get(&path).await?.bytes().await })
                .map_err(|e| err(url, format!("read {path}: {e}")))?;
            match serde_json::from_slice(&bytes) {
                Ok(record) => return Ok(Some((n, record))),
                Err(e) => {
                    tracing::warn!(record = %path, error = %e, "a deploy record that does not read is skipped")
                }
            }
        }
        Ok(None)
    }

    /// A deployed component's bytes, checked against its hash.
    pub fn component(&self, sha256: &str) -> Result<Vec<u8>> {
        let url = &self.inner.url;
        let path = self.inner.prefix.child(super::components::FOLDER).child(format!("{sha256}.wasm"));
        let bytes = self
            .block(async { self.inner.store.get(&path).await?.bytes().await })
            .map_err(|e| err(url, format!("download {path}: {e}")))?;
        let bytes = bytes.to_vec();
        if super::components::Component::new(bytes.clone()).sha256 != sha256 {
            return Err(err(url, format!("{path} does not hash to its name")));
        }
        Ok(bytes)
    }

    /// The complete checkpoints, ascending.
    pub fn list(&self) -> Result<Vec<u64>> {
        let url = &self.inner.url;
        let listed = self
            .block(self.inner.store.list_with_delimiter(Some(&self.inner.prefix)))
            .map_err(|e| err(url, format!("list: {e}")))?;
        let mut out = Vec::new();
        for p in listed.common_prefixes {
            let Some(n) =
                p.filename().and_then(|f| f.strip_prefix("chk-")).and_then(|n| n.parse::<u64>().ok())
            else {
                continue;
            };
            match self.block(self.inner.store.head(&self.chk(n).child(COMPLETE))) {
                Ok(_) => out.push(n),
                Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(err(url, format!("look at chk-{n:06}: {e}"))),
            }
        }
        out.sort_unstable();
        Ok(out)
    }

    /// Fetch checkpoint `n` (its writer's files) into a folder under `cache`: its path.
    pub fn fetch(&self, n: u64, cache: &Path) -> Result<PathBuf> {
        let writer = self.writer_of(n)?;
        let to = cache.join(format!("chk-{n:06}-{writer}"));
        if to.is_dir() {
            return Ok(to);
        }
        let tmp = cache.join(format!(".chk-{n:06}-{writer}.tmp-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        let base = self.chk(n).child(writer.as_str());
        for o in self.objects_under(base.clone())? {
            let rel: Vec<String> = o
                .location
                .prefix_match(&base)
                .map(|parts| parts.map(|p| p.as_ref().to_string()).collect())
                .unwrap_or_default();
            if rel.is_empty() || rel.iter().any(|p| p == ".." || p.is_empty()) {
                continue;
            }
            self.download(&o.location, &rel.iter().fold(tmp.clone(), |p, part| p.join(part)))?;
        }
        for (rel, key) in self.shared_of(n, &writer)? {
            self.download(&key, &rel.split('/').fold(tmp.clone(), |p, part| p.join(part)))?;
        }
        std::fs::rename(&tmp, &to).map_err(|e| Error::io("rename fetched checkpoint", &to, e))?;
        Ok(to)
    }

    /// Delete `path` (gone already is as good).
    fn delete(&self, path: &StorePath) -> Result<()> {
        match self.block(self.inner.store.delete(path)) {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(err(&self.inner.url, format!("delete {path}: {e}"))),
        }
    }

    /// Every object under `dir`, at any depth.
    fn objects_under(&self, dir: StorePath) -> Result<Vec<object_store::ObjectMeta>> {
        let mut out = Vec::new();
        let mut pending = vec![dir];
        while let Some(dir) = pending.pop() {
            let listed = self
                .block(self.inner.store.list_with_delimiter(Some(&dir)))
                .map_err(|e| err(&self.inner.url, format!("list {dir}: {e}")))?;
            pending.extend(listed.common_prefixes);
            out.extend(listed.objects);
        }
        Ok(out)
    }

    /// Write the object `key` to the file `path` (its folders made).
    fn download(&self, key: &StorePath, path: &Path) -> Result<()> {
        let bytes = self
            .block(async { self.inner.store.get(key).await?.bytes().await })
            .map_err(|e| err(&self.inner.url, format!("download {key}: {e}")))?;
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| Error::io("create folder", parent, e))?;
        }
        std::fs::write(path, &bytes).map_err(|e| Error::io("write", path, e))
    }

    /// Delete checkpoint `n` (the marker first: a half-deleted one is not listed).
    pub fn remove(&self, n: u64) -> Result<()> {
        let chk = self.chk(n);
        self.delete(&chk.child(COMPLETE))?;
        for o in self.objects_under(chk)? {
            self.delete(&o.location)?;
        }
        // Only a writer of table files (RocksDB) has shared files to let go: it has put
        // some by now, and what a writer before it put is let go here too.
        if self.inner.shared.lock().is_ok_and(|s| !s.is_empty()) {
            self.remove_unshared()?;
        }
        Ok(())
    }

    /// The object `rel` (a path under the store's prefix, parts split by `/`).
    fn key(&self, rel: &str) -> StorePath {
        rel.split('/').filter(|p| !p.is_empty()).fold(self.inner.prefix.clone(), |k, p| k.child(p))
    }

    /// The bytes of the object `rel`, if it exists.
    pub(super) fn get_object(&self, rel: &str) -> Result<Option<Vec<u8>>> {
        let key = self.key(rel);
        match self.block(async { self.inner.store.get(&key).await?.bytes().await }) {
            Ok(b) => Ok(Some(b.to_vec())),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(err(&self.inner.url, format!("read {key}: {e}"))),
        }
    }

    /// Write the object `rel` (replacing it).
    pub(super) fn put_object(&self, rel: &str, bytes: Vec<u8>) -> Result<()> {
        let key = self.key(rel);
        self.block(self.inner.store.put(&key, PutPayload::from(bytes)))
            .map(drop)
            .map_err(|e| err(&self.inner.url, format!("write {key}: {e}")))
    }

    /// Create the object `rel` only if it is absent: whether this call created it.
    pub(super) fn create_object(&self, rel: &str, bytes: Vec<u8>) -> Result<bool> {
        let key = self.key(rel);
        let create = PutOptions { mode: PutMode::Create, ..Default::default() };
        match self.block(self.inner.store.put_opts(&key, PutPayload::from(bytes), create)) {
            Ok(_) => Ok(true),
            Err(object_store::Error::AlreadyExists { .. }) => Ok(false),
            Err(e) => Err(err(&self.inner.url, format!("create {key}: {e}"))),
        }
    }

    /// Delete the object `rel` (gone already is as good).
    pub(super) fn delete_object(&self, rel: &str) -> Result<()> {
        self.delete(&self.key(rel))
    }

    /// The folders and the objects right under `rel`: their names.
    pub(super) fn children(&self, rel: &str) -> Result<(Vec<String>, Vec<String>)> {
        let dir = self.key(rel);
        let listed = self
            .block(self.inner.store.list_with_delimiter(Some(&dir)))
            .map_err(|e| err(&self.inner.url, format!("list {dir}: {e}")))?;
        let name = |p: &StorePath| p.filename().map(str::to_string);
        Ok((
            listed.common_prefixes.iter().filter_map(name).collect(),
            listed.objects.iter().filter_map(|o| name(&o.location)).collect(),
        ))
    }

    /// Copy every file under the local folder `local` to `rel/`.
    pub(super) fn upload_folder(&self, local: &Path, rel: &str) -> Result<()> {
        let mut files = Vec::new();
        walk(local, Path::new(""), &mut files).map_err(|e| Error::io("list folder", local, e))?;
        for file in files {
            let bytes =
                std::fs::read(local.join(&file)).map_err(|e| Error::io("read", local.join(&file), e))?;
            let parts: Vec<String> = file.iter().map(|p| p.to_string_lossy().into_owned()).collect();
            self.put_object(&format!("{rel}/{}", parts.join("/")), bytes)?;
        }
        Ok(())
    }

    /// Copy every object under `rel/` into the local folder `local`.
    pub(super) fn download_folder(&self, rel: &str, local: &Path) -> Result<()> {
        let base = self.key(rel);
        for o in self.objects_under(base.clone())? {
            let parts: Vec<String> = o
                .location
                .prefix_match(&base)
                .map(|parts| parts.map(|p| p.as_ref().to_string()).collect())
                .unwrap_or_default();
            if parts.is_empty() || parts.iter().any(|p| p == ".." || p == "." || p.is_empty()) {
                continue;
            }
            self.download(&o.location, &parts.iter().fold(local.to_path_buf(), |p, part| p.join(part)))?;
        }
        Ok(())
    }

    /// This process's id in what it writes.
    pub(super) fn writer(&self) -> &str {
        &self.inner.writer
    }

    /// Record that checkpoint `n`'s epoch committed (transactional sinks).
    pub fn mark_committed(&self, n: u64) -> Result<()> {
        let path = self.chk(n).child("COMMITTED");
        self.block(self.inner.store.put(&path, PutPayload::from_static(b"")))
            .map(drop)
            .map_err(|e| err(&self.inner.url, format!("mark {path}: {e}")))
    }

    pub fn is_committed(&self, n: u64) -> bool {
        self.block(self.inner.store.head(&self.chk(n).child("COMMITTED"))).is_ok()
    }
}

/// The files under `dir` (relative to it), recursively.
fn walk(dir: &Path, rel: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for e in std::fs::read_dir(dir.join(rel))? {
        let e = e?;
        let r = rel.join(e.file_name());
        if e.file_type()?.is_dir() {
            walk(dir, &r, out)?;
        } else {
            out.push(r);
        }
    }
    Ok(())
}

//! Compiled components cached on disk, so that starting a job (or restarting it after a
//! crash) does not recompile its plugins: compiling takes tens to thousands of
//! milliseconds (an 18 MB Python component takes seconds), loading a cached artifact a
//! fraction of one.
//!
//! An artifact is keyed by the component's SHA-256 and by the engine's compatibility hash
//! (wasmtime version and every setting that changes generated code), and stored with a
//! seal: the SHA-256 of the component's hash, the engine key and the artifact's bytes
//! together. It is used only if the seal checks out for *this* component, so another
//! component's artifact copied under its key is refused; anything else (missing, stale,
//! damaged, unreadable) means compiling again and replacing it. Artifacts are native
//! code: the folder is private to its owner (0700), and a folder that others can write
//! is not used at all.
//!
//! The folder is bounded: before an artifact is written, the least recently used ones go
//! (a hit marks an artifact used) until it fits in [`max_bytes`]
//! (`$KM0_CACHE_MAX_MB`, 2 GiB by default; an 18 MB Python component compiles to ~37 MB,
//! and every rebuilt plugin is a new component).

use crate::pipeline::hex;
use sha2::{Digest, Sha256};
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use wasmtime::component::Component;
use wasmtime::Engine;

/// The cache folder: `$KM0_CACHE_DIR`, else `$XDG_CACHE_HOME/km0/components`, else
/// `~/.cache/km0/components`; none when no home is known.
pub fn default_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("KM0_CACHE_DIR") {
        return Some(PathBuf::from(d));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("km0").join("components"))
}

/// The engine's compatibility hash, stable for one build of km0.
fn engine_key(engine: &Engine) -> String {
    // SipHash with fixed keys: the same engine settings give the same key on every run.
    #[allow(deprecated)]
    let mut h = std::hash::SipHasher::new();
    engine.precompile_compatibility_hash().hash(&mut h);
    format!("{:016x}", h.finish())
}

/// Load `wasm` as a component, from the cache in `dir` when possible.
pub fn load(engine: &Engine, dir: Option<&Path>, wasm: &[u8]) -> wasmtime::Result<Component> {
    let Some(dir) = dir.filter(|d| private_dir(d)) else { return Component::new(engine, wasm) };
    let (component_sha, engine_key) = (hex(&Sha256::digest(wasm)), engine_key(engine));
    let key = format!("{component_sha}-{engine_key}");
    let seal = |bytes: &[u8]| {
        let mut h = Sha256::new();
        h.update(b"km0-component-cache-2\0");
        h.update(component_sha.as_bytes());
        h.update(b"\0");
        h.update(engine_key.as_bytes());
        h.update(b"\0");
        h.update(bytes);
        hex(&h.finalize())
    };
    let (artifact, digest) = (dir.join(format!("{key}.cwasm")), dir.join(format!("{key}.sha256")));
    if let (Ok(bytes), Ok(want)) = (std::fs::read(&artifact), std::fs::read_to_string(&digest)) {
        if seal(&bytes) == want.trim() {
            // SAFETY: these bytes are an artifact that `Engine::precompile_component` of an
            // engine with this very compatibility hash wrote for this very component (the
            // seal, computed over the component's hash, the engine key and the bytes, says
            // so), unchanged since, in a folder only its owner can write. Wasmtime checks
            // the header's version and settings again on top of that.
            match unsafe { Component::deserialize(engine, &bytes) } {
                Ok(c) => {
                    mark_used(&artifact);
                    return Ok(c);
                }
                Err(e) => {
                    tracing::warn!(artifact = %artifact.display(), error = %e, "cached component rejected")
                }
            }
        }
    }
    let bytes = engine.precompile_component(wasm)?;
    // SAFETY: the bytes were produced just now by this engine.
    let component = unsafe { Component::deserialize(engine, &bytes)? };
    // Room first (a full disk is the folder's to free), then the artifact.
    evict(dir, max_bytes().saturating_sub(bytes.len() as u64), &key);
    if let Err(e) = store(dir, &key, &bytes, &seal(&bytes)) {
        tracing::warn!(dir = %dir.display(), error = %e, "could not cache the compiled component");
    }
    Ok(component)
}

/// The most bytes of artifacts the folder keeps: `$KM0_CACHE_MAX_MB` MiB, 2 GiB by default.
fn max_bytes() -> u64 {
    let mib = std::env::var("KM0_CACHE_MAX_MB").ok().and_then(|v| v.trim().parse::<u64>().ok());
    mib.unwrap_or(2048).saturating_mul(1 << 20)
}

/// Note that an artifact was used (its modification time), for [`evict`].
fn mark_used(artifact: &Path) {
    if let Ok(f) = std::fs::File::options().append(true).open(artifact) {
        let _ = f.set_modified(std::time::SystemTime::now());
    }
}

/// Remove the least recently used artifacts (and their seals), never `keep`, until those
/// left take at most `max` bytes; and the temporary files of writes that did not finish an
/// hour ago (a process killed while writing). What cannot be read or removed is left alone;
/// what another process removed first counts as removed.
fn evict(dir: &Path, max: u64, keep: &str) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let stale = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
    let mut artifacts: Vec<(std::time::SystemTime, u64, String)> = entries
        .filter_map(|e| {
            let e = e.ok()?;
            let name = e.file_name().to_str()?.to_string();
            let meta = e.metadata().ok()?;
            if name.starts_with('.') && (name.ends_with(".tmp") || name.ends_with(".sha")) {
                if meta.modified().is_ok_and(|t| t < stale) {
                    let _ = std::fs::remove_file(e.path());
                }
                return None;
            }
            let key = name.strip_suffix(".cwasm")?.to_string();
            Some((meta.modified().ok()?, meta.len(), key))
        })
        .collect();
    let mut total: u64 = artifacts.iter().map(|a| a.1).sum();
    artifacts.sort();
    for (_, len, key) in artifacts {
        if total <= max {
            break;
        }
        if key == keep {
            continue;
        }
        let removed = match std::fs::remove_file(dir.join(format!("{key}.cwasm"))) {
            Ok(()) => true,
            Err(e) => e.kind() == std::io::ErrorKind::NotFound,
        };
        if removed {
            let _ = std::fs::remove_file(dir.join(format!("{key}.sha256")));
            total -= len;
        }
    }
}

fn store(dir: &Path, key: &str, bytes: &[u8], seal: &str) -> std::io::Result<()> {
    let put = |tmp: PathBuf, data: &[u8], to: PathBuf| {
        let written = std::fs::write(&tmp, data).and_then(|()| std::fs::rename(&tmp, to));
        if written.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        written
    };
    put(dir.join(format!(".{key}.{}.tmp", std::process::id())), bytes, dir.join(format!("{key}.cwasm")))?;
    put(
        dir.join(format!(".{key}.{}.sha", std::process::id())),
        seal.as_bytes(),
        dir.join(format!("{key}.sha256")),
    )
}

/// Create the cache folder private (0700) if missing; true when it exists, is owned by
/// this user and nobody else can write it (else the cache is not used).
fn private_dir(dir: &Path) -> bool {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    if !dir.exists() {
        if let Some(parent) = dir.parent() {
            let _ = std::fs::create_dir_all(parent);
        }
        let _ = std::fs::DirBuilder::new().mode(0o700).create(dir);
    }
    let Ok(meta) = std::fs::metadata(dir) else { return false };
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if meta.is_dir() && meta.uid() == me && meta.permissions().mode() & 0o077 != 0 {
        // Ours, but open to others (an older km0, a umask): make it private again. Its
        // artifacts are checked against their seals all the same.
        let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700));
    }
    let Ok(meta) = std::fs::metadata(dir) else { return false };
    let private = meta.is_dir() && meta.uid() == me && meta.permissions().mode() & 0o022 == 0;
    if !private {
        tracing::warn!(
            dir = %dir.display(),
            "the component cache folder is not private to this user: compiling without it"
        );
    }
    private
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, SystemTime};

    #[test]
    fn the_least_recently_used_artifacts_go_until_the_rest_fit() {
        let dir = tempfile::tempdir().unwrap();
        let t0 = SystemTime::now() - Duration::from_secs(3600);
        // Artifacts a..e of 100 bytes, used in that order; d again last; e just written.
        for (i, key) in ["a", "b", "c", "d", "e"].iter().enumerate() {
            let path = dir.path().join(format!("{key}.cwasm"));
            std::fs::write(&path, [0u8; 100]).unwrap();
            std::fs::write(dir.path().join(format!("{key}.sha256")), "seal").unwrap();
            let f = std::fs::File::options().append(true).open(&path).unwrap();
            f.set_modified(t0 + Duration::from_secs(60 * i as u64)).unwrap();
        }
        mark_used(&dir.path().join("d.cwasm"));
        std::fs::write(dir.path().join("notes.txt"), [0u8; 1000]).unwrap();
        // A write a killed process left two hours ago goes; one under way stays.
        for (name, age) in [(".x.1.tmp", 7200), (".y.2.tmp", 0)] {
            let path = dir.path().join(name);
            std::fs::write(&path, [0u8; 10]).unwrap();
            let f = std::fs::File::options().append(true).open(&path).unwrap();
            f.set_modified(SystemTime::now() - Duration::from_secs(age)).unwrap();
        }
        let left = || {
            let mut names: Vec<String> = std::fs::read_dir(dir.path())
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect();
            names.sort();
            names
        };
        // 250 bytes may stay: a, b and c go, the least recently used (d's new use keeps
        // it); other files do not count and stay.
        evict(dir.path(), 250, "e");
        assert_eq!(left(), [".y.2.tmp", "d.cwasm", "d.sha256", "e.cwasm", "e.sha256", "notes.txt"]);
        // Under the bound: nothing goes.
        evict(dir.path(), 1000, "e");
        assert_eq!(left().len(), 6);
        // The artifact just written stays, even when it is older than another.
        evict(dir.path(), 150, "e");
        assert_eq!(left(), [".y.2.tmp", "e.cwasm", "e.sha256", "notes.txt"]);
    }
}

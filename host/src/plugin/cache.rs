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
                Ok(c) => return Ok(c),
                Err(e) => {
                    tracing::warn!(artifact = %artifact.display(), error = %e, "cached component rejected")
                }
            }
        }
    }
    let bytes = engine.precompile_component(wasm)?;
    // SAFETY: the bytes were produced just now by this engine.
    let component = unsafe { Component::deserialize(engine, &bytes)? };
    if let Err(e) = store(dir, &key, &bytes, &seal(&bytes)) {
        tracing::warn!(dir = %dir.display(), error = %e, "could not cache the compiled component");
    }
    Ok(component)
}

fn store(dir: &Path, key: &str, bytes: &[u8], seal: &str) -> std::io::Result<()> {
    let tmp = dir.join(format!(".{key}.{}.tmp", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, dir.join(format!("{key}.cwasm")))?;
    let tmp = dir.join(format!(".{key}.{}.sha", std::process::id()));
    std::fs::write(&tmp, seal)?;
    std::fs::rename(&tmp, dir.join(format!("{key}.sha256")))
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

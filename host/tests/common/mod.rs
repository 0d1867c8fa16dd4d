//! Helpers shared by the host's integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// Repository root. Cargo's run-time `CARGO_MANIFEST_DIR` comes first: a target folder
/// shared by several checkouts may hold a test binary built in another one, with that
/// one's build-time path.
pub fn repo() -> PathBuf {
    let dir = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").to_string());
    Path::new(&dir).parent().expect("host/ has a parent").to_path_buf()
}

/// A plugin component built by `scripts/build-plugins.sh` into `plugins/dist/`.
pub fn plugin(name: &str) -> PathBuf {
    let p = repo().join(format!("plugins/dist/{name}.wasm"));
    assert!(p.exists(), "{} is missing: build the plugins first (scripts/build-plugins.sh)", p.display());
    p
}

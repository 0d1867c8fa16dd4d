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

/// A stock-alert pipeline over `input` (min-stock, threshold 10, 5-minute windows, delay
/// 2 min) writing under `out/` (results, late events, dead letters, savepoints), with
/// `extra` sections (checkpoints, state). Written to `dir/<out>.toml`.
pub fn stock_pipeline(dir: &Path, input: &Path, out: &str, extra: &str) -> PathBuf {
    let text = format!(
        r#"
name = "stock-alert"
key = ["producto", "mercado"]
[source]
kind = "file"
path = {input:?}
[filter]
tipo = "stock.actualizado"
[event_time]
field = "fecha_ms"
watermark_delay = "2m"
[window]
kind = "tumbling"
size = "5m"
[plugin]
path = {plugin:?}
[plugin.config]
threshold = 10
[sink]
kind = "file"
path = "{out}/alertas.jsonl"
[late]
path = "{out}/late.jsonl"
[dead_letter]
path = "{out}/dead.jsonl"
[savepoints]
dir = "{out}/savepoints"
{extra}
"#,
        input = input.display().to_string(),
        plugin = plugin("min-stock").display().to_string(),
    );
    let path = dir.join(format!("{out}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

/// The results, late events and dead letters a [`stock_pipeline`] wrote under `out/`.
pub fn stock_outputs(dir: &Path, out: &str) -> Vec<String> {
    ["alertas.jsonl", "late.jsonl", "dead.jsonl"]
        .iter()
        .map(|f| std::fs::read_to_string(dir.join(out).join(f)).unwrap_or_default())
        .collect()
}

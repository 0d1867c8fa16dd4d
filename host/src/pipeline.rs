//! The pipeline file: one TOML document that describes a job (source, filter, event
//! time, key, window, plugin, sinks, savepoints). Parsing is strict: an unknown or
//! mistyped field is an error that names it. Relative paths are resolved against the
//! pipeline file's folder, so a pipeline runs the same from any working directory.

use crate::{Error, Result};
use serde::{Deserialize, Deserializer, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A parsed, validated pipeline with absolute paths.
#[derive(Debug, Clone)]
pub struct Pipeline {
    pub file: PathBuf,
    pub name: String,
    pub key: Vec<String>,
    pub source: SourceSpec,
    pub filter: BTreeMap<String, String>,
    pub event_time: EventTimeSpec,
    pub window: WindowSpec,
    pub plugin: PluginSpec,
    pub sink: SinkSpec,
    pub late: PathBuf,
    pub dead_letter: PathBuf,
    pub savepoints: PathBuf,
}

#[derive(Debug, Clone)]
pub enum SourceSpec {
    /// JSON lines from a file (`-` is standard input).
    File { path: PathBuf },
}

#[derive(Debug, Clone, Serialize)]
pub struct EventTimeSpec {
    /// Field holding event time as integer epoch milliseconds.
    pub field: String,
    /// Tolerated out-of-orderness: watermark = max event time seen - delay.
    pub watermark_delay_ms: i64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum WindowSpec {
    Tumbling { size_ms: i64 },
}

#[derive(Debug, Clone)]
pub struct PluginSpec {
    pub path: PathBuf,
    /// `[plugin.config]`, each value as JSON text.
    pub config: Vec<(String, String)>,
    /// Maximum events per call into the plugin.
    pub batch_size: usize,
}

#[derive(Debug, Clone)]
pub enum SinkSpec {
    File { path: PathBuf },
    Stdout,
}

// ---- the file's shape ------------------------------------------------------------

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPipeline {
    name: String,
    key: Vec<String>,
    source: RawSource,
    #[serde(default)]
    filter: BTreeMap<String, String>,
    event_time: RawEventTime,
    window: RawWindow,
    plugin: RawPlugin,
    sink: RawSink,
    late: RawPath,
    dead_letter: RawPath,
    #[serde(default)]
    savepoints: Option<RawDir>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, tag = "kind", rename_all = "lowercase")]
enum RawSource {
    File { path: String },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEventTime {
    field: String,
    #[serde(deserialize_with = "duration_ms")]
    watermark_delay: i64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, tag = "kind", rename_all = "lowercase")]
enum RawWindow {
    Tumbling {
        #[serde(deserialize_with = "duration_ms")]
        size: i64,
    },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPlugin {
    path: String,
    #[serde(default)]
    config: toml::Table,
    #[serde(default)]
    batch_size: Option<usize>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, tag = "kind", rename_all = "lowercase")]
enum RawSink {
    File { path: String },
    Stdout,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPath {
    path: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDir {
    dir: String,
}

/// A duration as integer milliseconds or a string with a unit: `"250ms"`, `"30s"`,
/// `"2m"`, `"1h"`.
fn duration_ms<'de, D: Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Ms(i64),
        Text(String),
    }
    match Raw::deserialize(d)? {
        Raw::Ms(ms) if ms >= 0 => Ok(ms),
        Raw::Ms(ms) => Err(serde::de::Error::custom(format!("duration {ms} is negative"))),
        Raw::Text(s) => parse_duration_ms(&s).map_err(serde::de::Error::custom),
    }
}

pub fn parse_duration_ms(s: &str) -> Result<i64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: i64 = num
        .parse()
        .map_err(|_| format!("duration {s:?}: expected a whole number and a unit (ms, s, m, h)"))?;
    let factor = match unit.trim() {
        "ms" => 1,
        "s" => 1_000,
        "m" | "min" => 60_000,
        "h" => 3_600_000,
        other => return Err(format!("duration {s:?}: unknown unit {other:?} (ms, s, m, h)")),
    };
    n.checked_mul(factor).ok_or_else(|| format!("duration {s:?} is too large"))
}

impl Pipeline {
    /// Read and validate a pipeline file.
    pub fn load(path: &Path) -> Result<Pipeline> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io("read pipeline", path, e))?;
        Self::parse(&text, path)
    }

    /// Parse pipeline text; `path` locates relative paths and names the file in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Pipeline> {
        let err = |message: String| Error::Pipeline { path: path.to_path_buf(), message };
        let raw: RawPipeline = toml::from_str(text).map_err(|e| err(e.to_string()))?;
        let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
        let resolve = |p: &str| -> PathBuf {
            if p == "-" {
                PathBuf::from("-")
            } else {
                base.join(p)
            }
        };

        if raw.name.trim().is_empty() {
            return Err(err("`name` is empty".into()));
        }
        if raw.key.is_empty() {
            return Err(err("`key` needs at least one field".into()));
        }
        if let Some(dup) = raw.key.iter().enumerate().find(|(i, k)| raw.key[..*i].contains(k)) {
            return Err(err(format!("`key` names field {:?} twice", dup.1)));
        }
        if raw.event_time.field.is_empty() {
            return Err(err("`event_time.field` is empty".into()));
        }
        let window = match raw.window {
            RawWindow::Tumbling { size } if size > 0 => WindowSpec::Tumbling { size_ms: size },
            RawWindow::Tumbling { .. } => return Err(err("`window.size` must be positive".into())),
        };
        let batch_size = raw.plugin.batch_size.unwrap_or(8192);
        if batch_size == 0 {
            return Err(err("`plugin.batch_size` must be positive".into()));
        }
        let mut config = Vec::new();
        for (k, v) in raw.plugin.config {
            let json = serde_json::to_string(&v).map_err(|e| err(format!("`plugin.config.{k}`: {e}")))?;
            config.push((k, json));
        }
        let source = match raw.source {
            RawSource::File { path } => SourceSpec::File { path: resolve(&path) },
        };
        let sink = match raw.sink {
            RawSink::File { path } => SinkSpec::File { path: resolve(&path) },
            RawSink::Stdout => SinkSpec::Stdout,
        };
        let savepoints = raw.savepoints.map(|d| resolve(&d.dir)).unwrap_or_else(|| base.join("savepoints"));

        Ok(Pipeline {
            file: path.to_path_buf(),
            name: raw.name,
            key: raw.key,
            source,
            filter: raw.filter,
            event_time: EventTimeSpec {
                field: raw.event_time.field,
                watermark_delay_ms: raw.event_time.watermark_delay,
            },
            window,
            plugin: PluginSpec { path: resolve(&raw.plugin.path), config, batch_size },
            sink,
            late: resolve(&raw.late.path),
            dead_letter: resolve(&raw.dead_letter.path),
            savepoints,
        })
    }

    /// Identity of what shapes the job's state (key, window, event-time field, filter).
    /// A savepoint restores only into a pipeline with the same fingerprint; changing the
    /// watermark delay, plugin config, sinks or paths keeps it.
    pub fn state_fingerprint(&self) -> String {
        let shape = serde_json::json!({
            "key": self.key,
            "window": self.window,
            "event_time_field": self.event_time.field,
            "filter": self.filter,
        });
        hex(&Sha256::digest(shape.to_string().as_bytes()))
    }
}

/// Lower-case hex of a digest.
pub fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes.iter().fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
name = "stock-alert"
key = ["producto", "mercado"]
[source]
kind = "file"
path = "data/events.jsonl"
[filter]
tipo = "stock.actualizado"
[event_time]
field = "fecha_ms"
watermark_delay = "2m"
[window]
kind = "tumbling"
size = "5m"
[plugin]
path = "min-stock.wasm"
[plugin.config]
threshold = 10
[sink]
kind = "file"
path = "out/alerts.jsonl"
[late]
path = "out/late.jsonl"
[dead_letter]
path = "out/dead.jsonl"
"#;

    #[test]
    fn parses_the_stock_alert_pipeline() {
        let p = Pipeline::parse(GOOD, Path::new("/jobs/stock/pipeline.toml")).unwrap();
        assert_eq!(p.event_time.watermark_delay_ms, 120_000);
        assert_eq!(p.window, WindowSpec::Tumbling { size_ms: 300_000 });
        assert_eq!(p.plugin.path, PathBuf::from("/jobs/stock/min-stock.wasm"));
        assert_eq!(p.plugin.config, vec![("threshold".to_string(), "10".to_string())]);
        assert_eq!(p.savepoints, PathBuf::from("/jobs/stock/savepoints"));
    }

    #[test]
    fn unknown_and_mistyped_fields_are_named() {
        let bad = GOOD.replace("[window]", "[window]\nsizee = 3");
        let e = Pipeline::parse(&bad, Path::new("p.toml")).unwrap_err().to_string();
        assert!(e.contains("sizee"), "{e}");
        let bad = GOOD.replace("watermark_delay = \"2m\"", "watermark_delay = \"2 fortnights\"");
        let e = Pipeline::parse(&bad, Path::new("p.toml")).unwrap_err().to_string();
        assert!(e.contains("fortnights"), "{e}");
        let bad = GOOD.replace("key = [\"producto\", \"mercado\"]", "key = \"producto\"");
        let e = Pipeline::parse(&bad, Path::new("p.toml")).unwrap_err().to_string();
        assert!(e.contains("key"), "{e}");
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration_ms("250ms"), Ok(250));
        assert_eq!(parse_duration_ms("30s"), Ok(30_000));
        assert_eq!(parse_duration_ms("5m"), Ok(300_000));
        assert_eq!(parse_duration_ms("1h"), Ok(3_600_000));
        assert!(parse_duration_ms("5").is_err());
        assert!(parse_duration_ms("m").is_err());
    }

    #[test]
    fn fingerprint_ignores_delay_but_not_key() {
        let a = Pipeline::parse(GOOD, Path::new("p.toml")).unwrap();
        let b = Pipeline::parse(&GOOD.replace("\"2m\"", "\"5m\""), Path::new("p.toml")).unwrap();
        let c = Pipeline::parse(&GOOD.replace(", \"mercado\"", ""), Path::new("p.toml")).unwrap();
        assert_eq!(a.state_fingerprint(), b.state_fingerprint());
        assert_ne!(a.state_fingerprint(), c.state_fingerprint());
    }
}

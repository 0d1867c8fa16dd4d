//! Helpers for km0's end-to-end tests: real plugins built from `plugins/`, pipelines
//! written into temporary folders, and small reference models to compare against.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Repository root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ has a parent").to_path_buf()
}

/// A plugin component built by `scripts/build-plugins.sh` (into `plugins/dist/`).
pub fn plugin(name: &str) -> PathBuf {
    let dir =
        std::env::var_os("KM0_PLUGIN_DIR").map(PathBuf::from).unwrap_or_else(|| repo().join("plugins/dist"));
    let path = dir.join(format!("{name}.wasm"));
    assert!(
        path.exists(),
        "{} is missing: build the plugins first (scripts/build-plugins.sh, or `make test`)",
        path.display()
    );
    path
}

/// The golden trace of the lesson.
pub fn golden_trace() -> PathBuf {
    let p = repo().join("../shared/golden/stock-trace.jsonl");
    if p.exists() {
        return p;
    }
    // CI lays shared/ beside the clone; a copy ships with the example too.
    repo().join("examples/stock-alert/data/golden-trace.jsonl")
}

/// Settings of a stock-alert pipeline written for a test.
pub struct StockJob {
    pub plugin: PathBuf,
    pub delay: &'static str,
    pub threshold: i64,
    pub batch_size: usize,
}

impl StockJob {
    pub fn new(delay: &'static str, threshold: i64) -> Self {
        StockJob { plugin: plugin("min-stock"), delay, threshold, batch_size: 8192 }
    }

    /// Write `pipeline.toml` into `dir` (input `in.jsonl`, outputs under `out/`).
    pub fn write(&self, dir: &Path) -> PathBuf {
        let text = format!(
            r#"
name = "stock-alert"
key = ["producto", "mercado"]
[source]
kind = "file"
path = "in.jsonl"
[filter]
tipo = "stock.actualizado"
[event_time]
field = "fecha_ms"
watermark_delay = "{delay}"
[window]
kind = "tumbling"
size = "5m"
[plugin]
path = "{plugin}"
batch_size = {batch}
[plugin.config]
threshold = {threshold}
[sink]
kind = "file"
path = "out/alertas.jsonl"
[late]
path = "out/late.jsonl"
[dead_letter]
path = "out/dead-letter.jsonl"
[savepoints]
dir = "out/savepoints"
"#,
            delay = self.delay,
            plugin = self.plugin.display(),
            batch = self.batch_size,
            threshold = self.threshold
        );
        let path = dir.join("pipeline.toml");
        std::fs::write(&path, text).expect("write pipeline");
        path
    }
}

/// Read a JSON-lines file.
pub fn read_jsonl(path: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{}: {e}: {l}", path.display())))
        .collect()
}

/// The keyed view of a result file: last value per key (an upsert consumer's view).
pub fn keyed_view(path: &Path) -> BTreeMap<String, serde_json::Value> {
    read_jsonl(path)
        .into_iter()
        .map(|r| (r["key"].as_str().expect("key").to_string(), r["value"].clone()))
        .collect()
}

/// One window as the reference model closes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefWindow {
    pub start: i64,
    pub end: i64,
    pub producto: String,
    pub mercado: String,
    pub min: i64,
    pub count: u64,
    /// Sum of `delta` and count of the window's events read after record `split`.
    pub delta_after: i64,
    pub count_after: u64,
}

impl RefWindow {
    pub fn key(&self) -> String {
        format!("{}|{}|{}", self.start, self.producto, self.mercado)
    }

    /// The min-stock plugin's alert for this window.
    pub fn alert(&self) -> serde_json::Value {
        serde_json::json!({"ventana_inicio": self.start, "ventana_fin": self.end, "producto": self.producto,
            "mercado": self.mercado, "stock_minimo": self.min, "actualizaciones": self.count})
    }
}

/// What the reference model saw.
pub struct Reference {
    /// Closed windows in firing order (end, start, producto, mercado).
    pub windows: Vec<RefWindow>,
    pub late: u64,
    pub dead: u64,
    pub filtered: u64,
}

impl Reference {
    /// Alerts (key, value) in emission order for a threshold.
    pub fn alerts(&self, threshold: i64) -> Vec<(String, serde_json::Value)> {
        self.windows.iter().filter(|w| w.min < threshold).map(|w| (w.key(), w.alert())).collect()
    }
}

/// Reference model of the stock-alert job, written for the tests independently of the
/// host: serde_json parsing, event at a time, a BTreeMap of open windows; watermark =
/// max event time - delay; a window fires when the watermark reaches its end; an event
/// whose window end is at or below the watermark is late; what is left fires at the end.
pub fn reference_stock(input: &Path, delay_ms: i64, split: u64) -> Reference {
    const SIZE: i64 = 300_000;
    let text = std::fs::read_to_string(input).expect("input");
    type Open = BTreeMap<(i64, i64, String, String), RefWindow>;
    let mut open: Open = BTreeMap::new();
    let mut max_t: Option<i64> = None;
    let mut r = Reference { windows: Vec::new(), late: 0, dead: 0, filtered: 0 };
    let fire = |open: &mut Open, upto: i64, out: &mut Vec<RefWindow>| {
        while let Some(entry) = open.first_entry() {
            if entry.key().0 > upto {
                break;
            }
            out.push(entry.remove());
        }
    };
    for (i, line) in text.lines().filter(|l| !l.trim().is_empty()).enumerate() {
        let index = i as u64 + 1;
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            r.dead += 1;
            continue;
        };
        if v["tipo"] != "stock.actualizado" {
            r.filtered += 1;
            continue;
        }
        let fields = (
            v["fecha_ms"].as_i64(),
            v["producto"].as_str(),
            v["mercado"].as_str(),
            v["stock_actual"].as_i64(),
        );
        let (Some(t), Some(p), Some(m), Some(s)) = fields else {
            r.dead += 1;
            continue;
        };
        let wm = max_t.map_or(i64::MIN, |m| m - delay_ms);
        let start = t.div_euclid(SIZE) * SIZE;
        if start + SIZE <= wm {
            r.late += 1;
            continue;
        }
        let w =
            open.entry((start + SIZE, start, p.to_string(), m.to_string())).or_insert_with(|| RefWindow {
                start,
                end: start + SIZE,
                producto: p.to_string(),
                mercado: m.to_string(),
                min: i64::MAX,
                count: 0,
                delta_after: 0,
                count_after: 0,
            });
        w.min = w.min.min(s);
        w.count += 1;
        if index > split {
            w.delta_after += v["delta"].as_i64().unwrap_or(0);
            w.count_after += 1;
        }
        max_t = Some(max_t.map_or(t, |m| m.max(t)));
        fire(&mut open, max_t.unwrap_or(i64::MIN) - delay_ms, &mut r.windows);
    }
    fire(&mut open, i64::MAX, &mut r.windows);
    r
}

/// (key, value) records of a result file, in file order.
pub fn records(path: &Path) -> Vec<(String, serde_json::Value)> {
    read_jsonl(path)
        .into_iter()
        .map(|r| (r["key"].as_str().expect("key").to_string(), r["value"].clone()))
        .collect()
}

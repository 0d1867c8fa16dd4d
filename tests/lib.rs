//! Helpers for km0's end-to-end tests: real plugins built from `plugins/`, pipelines
//! written into temporary folders, and small reference models to compare against.

pub mod services;
pub mod stock_topic;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Repository root.
pub fn repo() -> PathBuf {
    Path::new(&manifest_dir()).parent().expect("tests/ has a parent").to_path_buf()
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
    /// The body of `[source]`, `[sink]` and `[dead_letter]`, and sections to append.
    pub source: String,
    pub sink: String,
    pub dead_letter: String,
    /// More lines of `[event_time]` (`watermark = "per-partition"`).
    pub event_time: String,
    pub extra: String,
}

impl StockJob {
    pub fn new(delay: &'static str, threshold: i64) -> Self {
        StockJob {
            plugin: plugin("min-stock"),
            delay,
            threshold,
            batch_size: 8192,
            source: "kind = \"file\"\npath = \"in.jsonl\"".into(),
            sink: "kind = \"file\"\npath = \"out/alertas.jsonl\"".into(),
            dead_letter: "path = \"out/dead-letter.jsonl\"".into(),
            event_time: String::new(),
            extra: String::new(),
        }
    }

    /// Write `pipeline.toml` into `dir` (input `in.jsonl`, outputs under `out/`).
    pub fn write(&self, dir: &Path) -> PathBuf {
        let text = format!(
            r#"
name = "stock-alert"
key = ["producto", "mercado"]
[source]
{source}
[filter]
tipo = "stock.actualizado"
[event_time]
field = "fecha_ms"
watermark_delay = "{delay}"
{event_time}
[window]
kind = "tumbling"
size = "5m"
[plugin]
path = "{plugin}"
batch_size = {batch}
[plugin.config]
threshold = {threshold}
[sink]
{sink}
[late]
path = "out/late.jsonl"
[dead_letter]
{dead_letter}
[savepoints]
dir = "out/savepoints"
{extra}
"#,
            delay = self.delay,
            plugin = self.plugin.display(),
            batch = self.batch_size,
            threshold = self.threshold,
            source = self.source,
            sink = self.sink,
            dead_letter = self.dead_letter,
            event_time = self.event_time,
            extra = self.extra,
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

/// The keyed view of a result file: last value per key (an upsert consumer's view); a
/// `null` value (a retraction) deletes its key.
pub fn keyed_view(path: &Path) -> BTreeMap<String, serde_json::Value> {
    let mut view = BTreeMap::new();
    for r in read_jsonl(path) {
        let key = r["key"].as_str().expect("key").to_string();
        match &r["value"] {
            serde_json::Value::Null => view.remove(&key),
            v => view.insert(key, v.clone()),
        };
    }
    view
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

/// An independent, event-at-a-time model of km0's window semantics (tumbling, sliding,
/// session; allowed lateness; per-partition watermarks with record-count idleness),
/// written plainly for the tests: lists and maps of events, no batching, no panes'
/// accumulators. It records, for every window result, all the events the window accepted,
/// in event-time order (ties: arrival order), however and whenever they arrived.
pub mod model {
    use std::collections::{BTreeMap, BTreeSet};

    #[derive(Debug, Clone, PartialEq)]
    pub struct Ev {
        pub key: String,
        pub t: i64,
        pub lat: f64,
        pub lon: f64,
        /// Arrival index (ties keep arrival order).
        pub arrival: usize,
    }

    /// What the job reads, in its order: a record of a partition (an event, or `None`
    /// for a record that is not one), or the end of a partition's input.
    #[derive(Debug, Clone)]
    pub enum Input {
        Record(usize, Option<Ev>),
        End(usize),
    }

    #[derive(Debug, Clone, Copy)]
    pub enum Kind {
        Tumbling(i64),
        Sliding(i64, i64),
        Session(i64),
    }

    #[derive(Debug, Clone, Copy)]
    pub struct Spec {
        pub kind: Kind,
        pub delay: i64,
        pub lateness: i64,
        pub idle_after: Option<u64>,
    }

    /// A window result.
    #[derive(Debug, Clone)]
    pub struct Fired {
        pub key: String,
        pub start: i64,
        pub end: i64,
        /// The window's accepted events in event-time order (ties: arrival order). Empty:
        /// a retraction of the result written under this start (a session that fired
        /// and then merged under another start).
        pub events: Vec<Ev>,
    }

    #[derive(Default)]
    pub struct Outcome {
        pub fired: Vec<Fired>,
        pub late: u64,
    }

    /// The inputs of files read round-robin, one record each in turn, as km0 reads them:
    /// a file's end takes effect after the record read in the pass that found it.
    pub fn round_robin(files: &[Vec<Option<Ev>>]) -> Vec<Input> {
        let n = files.len();
        let mut idx = vec![0; n];
        let mut done = vec![false; n];
        let mut next = 0;
        let mut out = Vec::new();
        loop {
            let mut ended = Vec::new();
            let mut got = None;
            for _ in 0..n {
                let p = next;
                next = (next + 1) % n;
                if done[p] {
                    continue;
                }
                if idx[p] < files[p].len() {
                    got = Some((p, files[p][idx[p]].clone()));
                    idx[p] += 1;
                    break;
                }
                done[p] = true;
                ended.push(p);
            }
            match got {
                Some((p, ev)) => {
                    out.push(Input::Record(p, ev));
                    out.extend(ended.into_iter().map(Input::End));
                }
                None => return out,
            }
        }
    }

    struct Part {
        max: Option<i64>,
        idle: bool,
        finished: bool,
        last_record: u64,
    }

    /// A key's session (seed 002: a silence longer than the gap opens a new one): its
    /// first and last event times; it takes an event within `gap` of either side, and it is
    /// complete once the watermark has passed `last + gap` (no event it could take can
    /// come: an event is late once the watermark is past it).
    struct Session {
        first: i64,
        last: i64,
        events: Vec<Ev>,
        /// Waiting to fire (false once it has, until it changes again).
        armed: bool,
        /// Its result has been written under its `first` (README: a session that fired and
        /// then merges under another start has that result retracted).
        written: bool,
    }

    /// Run the model; `partitions` are known from the start (files), more appear as
    /// records name them (a partition field).
    pub fn run(inputs: &[Input], partitions: usize, spec: Spec) -> Outcome {
        let mut m = Model {
            spec,
            parts: (0..partitions)
                .map(|_| Part { max: None, idle: false, finished: false, last_record: 0 })
                .collect(),
            records: 0,
            wm: i64::MIN,
            out: Outcome::default(),
            windows: BTreeMap::new(),
            fired: BTreeSet::new(),
            panes: BTreeMap::new(),
            pending: BTreeSet::new(),
            sessions: BTreeMap::new(),
        };
        for input in inputs {
            match input {
                Input::Record(p, ev) => {
                    // Partitions named by a field appear when first seen.
                    while m.parts.len() <= *p {
                        m.parts.push(Part {
                            max: None,
                            idle: false,
                            finished: false,
                            last_record: m.records,
                        });
                    }
                    m.records += 1;
                    let part = &mut m.parts[*p];
                    part.last_record = m.records;
                    part.idle = false;
                    if let Some(n) = spec.idle_after.filter(|_| m.parts.len() > 1) {
                        for q in m.parts.iter_mut().filter(|q| !q.finished) {
                            if m.records - q.last_record > n {
                                q.idle = true;
                            }
                        }
                    }
                    m.recompute();
                    if let Some(ev) = ev {
                        m.event(ev.clone());
                        let part = &mut m.parts[*p];
                        part.max = Some(part.max.map_or(ev.t, |x| x.max(ev.t)));
                        m.recompute();
                    }
                }
                Input::End(p) => {
                    m.parts[*p].finished = true;
                    m.recompute();
                }
            }
        }
        m.wm = i64::MAX;
        m.advance();
        m.out
    }

    struct Model {
        spec: Spec,
        parts: Vec<Part>,
        records: u64,
        wm: i64,
        out: Outcome,
        // tumbling: (start, key) -> events
        windows: BTreeMap<(i64, String), Vec<Ev>>,
        fired: BTreeSet<(i64, String)>,
        // sliding: (key, pane start) -> pane; pending window fires (end, key)
        panes: BTreeMap<(String, i64), Vec<Ev>>,
        pending: BTreeSet<(i64, String)>,
        // session: key -> sessions
        sessions: BTreeMap<String, Vec<Session>>,
    }

    impl Model {
        fn recompute(&mut self) {
            let d = self.spec.delay;
            let min = self
                .parts
                .iter()
                .filter(|p| !p.idle && !p.finished)
                .map(|p| p.max.map_or(i64::MIN, |m| m - d))
                .min();
            if let Some(min) = min {
                if min > self.wm {
                    self.wm = min;
                    self.advance();
                }
            }
        }

        fn emit(&mut self, mut due: Vec<Fired>) {
            for f in &mut due {
                f.events.sort_by_key(|e| (e.t, e.arrival));
            }
            due.sort_by(|a, b| (a.end, a.start, &a.key).cmp(&(b.end, b.start, &b.key)));
            self.out.fired.extend(due);
        }

        fn window_events(&self, key: &str, start: i64, end: i64, slide: i64) -> Vec<Ev> {
            let mut evs = Vec::new();
            let mut p = start;
            while p < end {
                if let Some(pane) = self.panes.get(&(key.to_string(), p)) {
                    evs.extend(pane.iter().cloned());
                }
                p += slide;
            }
            evs
        }

        fn advance(&mut self) {
            let (wm, lateness) = (self.wm, self.spec.lateness);
            match self.spec.kind {
                Kind::Tumbling(size) => {
                    let due: Vec<Fired> = self
                        .windows
                        .iter()
                        .filter(|((s, k), _)| s + size <= wm && !self.fired.contains(&(*s, k.clone())))
                        .map(|((s, k), evs)| Fired {
                            key: k.clone(),
                            start: *s,
                            end: s + size,
                            events: evs.clone(),
                        })
                        .collect();
                    for f in &due {
                        self.fired.insert((f.start, f.key.clone()));
                    }
                    self.emit(due);
                    self.windows.retain(|(s, _), _| (s + size).saturating_add(lateness) > wm);
                }
                Kind::Sliding(size, slide) => {
                    let due: Vec<(i64, String)> =
                        self.pending.iter().filter(|(e, _)| *e <= wm).cloned().collect();
                    let fired = due
                        .iter()
                        .map(|(e, k)| Fired {
                            key: k.clone(),
                            start: e - size,
                            end: *e,
                            events: self.window_events(k, e - size, *e, slide),
                        })
                        .collect();
                    for d in &due {
                        self.pending.remove(d);
                    }
                    self.emit(fired);
                    self.panes.retain(|(_, p), _| (p + size).saturating_add(lateness) > wm);
                }
                Kind::Session(gap) => {
                    // Complete once the watermark is past `last + gap`: the half-open window
                    // `[first, last + gap + 1)`, whose end is what results are ordered by.
                    let mut due = Vec::new();
                    for (k, list) in self.sessions.iter_mut() {
                        for s in list.iter_mut() {
                            if s.armed && s.last + gap < wm {
                                s.armed = false;
                                s.written = true;
                                due.push(Fired {
                                    key: k.clone(),
                                    start: s.first,
                                    end: s.last + gap + 1,
                                    events: s.events.clone(),
                                });
                            }
                        }
                    }
                    self.emit(due);
                    // Kept while an event could still join it within the allowed lateness.
                    for list in self.sessions.values_mut() {
                        list.retain(|s| (s.last + gap).saturating_add(lateness) >= wm);
                    }
                    self.sessions.retain(|_, l| !l.is_empty());
                }
            }
        }

        fn event(&mut self, ev: Ev) {
            let (wm, lateness) = (self.wm, self.spec.lateness);
            match self.spec.kind {
                Kind::Tumbling(size) => {
                    let start = ev.t.div_euclid(size) * size;
                    if start + size + lateness <= wm {
                        self.out.late += 1;
                        return;
                    }
                    let k = (start, ev.key.clone());
                    let evs = self.windows.entry(k.clone()).or_default();
                    evs.push(ev);
                    if start + size <= wm {
                        let f = Fired { key: k.1.clone(), start, end: start + size, events: evs.clone() };
                        self.fired.insert(k);
                        self.emit(vec![f]);
                    }
                }
                Kind::Sliding(size, slide) => {
                    let p = ev.t.div_euclid(slide) * slide;
                    if p + size + lateness <= wm {
                        self.out.late += 1;
                        return;
                    }
                    let key = ev.key.clone();
                    let new = !self.panes.contains_key(&(key.clone(), p));
                    self.panes.entry((key.clone(), p)).or_default().push(ev);
                    let mut e = p + slide;
                    let mut refire = Vec::new();
                    while e <= p + size {
                        if new && e > wm {
                            self.pending.insert((e, key.clone()));
                        }
                        if e <= wm && e + lateness > wm {
                            refire.push(Fired {
                                key: key.clone(),
                                start: e - size,
                                end: e,
                                events: self.window_events(&key, e - size, e, slide),
                            });
                        }
                        e += slide;
                    }
                    self.emit(refire);
                }
                Kind::Session(gap) => {
                    // The sessions the event joins: those it is within `gap` of.
                    let list = self.sessions.entry(ev.key.clone()).or_default();
                    let joins = |x: &Session| x.first - gap <= ev.t && ev.t <= x.last + gap;
                    let (mut first, mut last) = (ev.t, ev.t);
                    for x in list.iter().filter(|x| joins(x)) {
                        first = first.min(x.first);
                        last = last.max(x.last);
                    }
                    // Late: the session it would be in was complete before the allowed
                    // lateness ran out.
                    if (last + gap).saturating_add(lateness) < wm {
                        self.out.late += 1;
                        if list.is_empty() {
                            self.sessions.remove(&ev.key);
                        }
                        return;
                    }
                    let mut events = Vec::new();
                    let mut earliest: Option<(i64, i64, bool)> = None;
                    let mut kept = Vec::new();
                    let mut retracted = Vec::new();
                    let mut written = false;
                    for x in list.drain(..) {
                        if joins(&x) {
                            if earliest.is_none_or(|(f, _, _)| x.first < f) {
                                earliest = Some((x.first, x.last, x.armed));
                            }
                            if x.written && x.first != first {
                                retracted.push(x.first);
                            }
                            written |= x.written && x.first == first;
                            events.extend(x.events);
                        } else {
                            kept.push(x);
                        }
                    }
                    *list = kept;
                    events.push(ev.clone());
                    let complete = last + gap < wm;
                    // A session that fired fires again when it changes; one that did not
                    // waits for the watermark.
                    let armed = match earliest {
                        Some((f, l, armed)) if f == first && l == last => armed,
                        _ => !complete,
                    };
                    list.push(Session {
                        first,
                        last,
                        events: events.clone(),
                        armed,
                        written: written || complete,
                    });
                    retracted.sort_unstable();
                    for start in retracted {
                        self.out.fired.push(Fired {
                            key: ev.key.clone(),
                            start,
                            end: start,
                            events: Vec::new(),
                        });
                    }
                    if complete {
                        self.emit(vec![Fired {
                            key: ev.key.clone(),
                            start: first,
                            end: last + gap + 1,
                            events,
                        }]);
                    }
                }
            }
        }
    }
}

/// The crate's folder: cargo's run-time value first (a target folder shared by several
/// checkouts may hold a binary built in another one), the build-time one otherwise.
fn manifest_dir() -> String {
    std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").to_string())
}

/// The `km0` binary that `cargo test --workspace` built beside this test executable, or the
/// one `KM0_BIN` names.
pub fn km0_bin() -> PathBuf {
    // Another build of the same source, e.g. the profile-guided one (scripts/build-release.sh).
    // An empty value counts as unset; a relative one is taken from the repository's root, where
    // `make test` runs (cargo starts each test in its own crate's folder).
    if let Some(bin) = std::env::var_os("KM0_BIN").filter(|b| !b.is_empty()) {
        return repo().join(bin);
    }
    let exe = std::env::current_exe().expect("test executable");
    let dir = exe.parent().and_then(Path::parent).expect("target/<profile>/deps");
    let bin = dir.join("km0");
    assert!(bin.is_file(), "{} not built: run the tests with `cargo test --workspace`", bin.display());
    bin
}

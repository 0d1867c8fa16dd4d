//! The pipeline file: one TOML document that describes a job (source, filter, event
//! time, key, window, plugin, sinks, savepoints). Parsing is strict: an unknown or
//! mistyped field is an error that names it. Relative paths are resolved against the
//! pipeline file's folder, so a pipeline runs the same from any working directory.

use crate::{Error, Result};
use serde::{Deserialize, Deserializer, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A parsed, validated pipeline with absolute paths.
#[derive(Debug, Clone)]
pub struct Pipeline {
    pub file: PathBuf,
    pub name: String,
    pub key: Vec<String>,
    pub source: SourceSpec,
    pub filter: BTreeMap<String, String>,
    pub event_time: EventTimeSpec,
    /// The windowed aggregations over the source (one, or several sharing one read).
    pub aggregations: Vec<Aggregation>,
    pub sink: SinkSpec,
    pub late: PathBuf,
    pub dead_letter: DeadLetterSpec,
    pub savepoints: PathBuf,
    /// Periodic checkpoints, when configured.
    pub checkpoints: Option<CheckpointSpec>,
    /// Where checkpoints take their state from.
    pub state: StateSpec,
    /// `[control]`: the control API of a running job.
    pub control: ControlSpec,
    /// `[source] partitioned_by`: the leading key fields the input is partitioned by (all
    /// of a key's records arrive in one partition), so that a partition can be a task.
    pub partitioned_by: Vec<String>,
    /// `[job] parallelism`: threads that run the tasks (`--parallelism` overrides it).
    pub parallelism: Option<usize>,
    /// The task this pipeline is, when the job runs as several (`task-0`, ...): it names
    /// the task's Kafka transactional id and its PostgreSQL progress row.
    pub task: Option<String>,
}

/// `[event_time] watermark`: which partitions' clocks fire a window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WatermarkScope {
    /// The minimum over every partition that is not idle (the lesson's rule): the job's
    /// partitions run as one task.
    #[default]
    Job,
    /// Each partition is a task that fires its windows on its own clock.
    PerPartition,
}

/// `[control]`: where a running job serves its control API (`--http` overrides it).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ControlSpec {
    /// `HOST:PORT`, or `off`; none: the default address.
    pub http: Option<String>,
    /// The largest plugin component a live deploy takes, bytes.
    pub max_upload_bytes: Option<usize>,
    /// Host names the API answers besides IP addresses and `localhost` (a request naming
    /// another host is refused: DNS rebinding).
    pub allowed_hosts: Vec<String>,
}

/// A file name for a job's name, one name to one file name: ASCII letters, digits and `-`
/// stay, every other byte is written `_` and two hex digits (`shop.a` is `shop_2ea`,
/// `shop_a` is `shop_5fa`).
pub fn folder_name(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || b == b'-' {
            out.push(b as char);
        } else {
            out.push_str(&format!("_{b:02x}"));
        }
    }
    out
}

/// `[state]`: the state backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateSpec {
    /// The backend the file names, else the default of its source (see [`Self::backend_for`]).
    pub backend: Backend,
    /// Whether the file names the backend.
    pub named: bool,
    /// The backend's working folder (RocksDB).
    pub dir: PathBuf,
}

impl StateSpec {
    /// The backend of a run that reads its source unbounded (`follows`, whatever the file
    /// says, e.g. `km0 run --follow`) or not: the one the file names, else RocksDB for an
    /// unbounded source and memory for a bounded one.
    pub fn backend_for(&self, follows: bool) -> Backend {
        match (self.named, follows) {
            (true, _) => self.backend,
            (false, true) => Backend::Rocksdb,
            (false, false) => Backend::Memory,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// Checkpoints write the whole state (savepoint format).
    Memory,
    /// A RocksDB copy of the state takes each checkpoint's changes; checkpoints are
    /// RocksDB checkpoints (incremental).
    Rocksdb,
}

/// `[checkpoints]`: consistent snapshots taken while the job runs, for recovery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointSpec {
    /// Where checkpoints are written (with `remote`, first: the state folder's
    /// `checkpoints/`).
    pub dir: PathBuf,
    /// The shared object store (`s3://bucket/prefix`) every complete checkpoint is copied
    /// to, and recovered from.
    pub remote: Option<String>,
    /// Processing time between two checkpoints.
    pub interval_ms: i64,
    /// ... or this many records, whichever comes first.
    pub every_records: Option<u64>,
    /// Completed checkpoints kept (older ones are deleted).
    pub retain: usize,
}

#[derive(Debug, Clone)]
pub enum SourceSpec {
    /// JSON lines from files (`-` is standard input); each file is a partition.
    File { paths: Vec<PathBuf>, partitioning: Partitioning, follow: bool },
    /// JSON records from Kafka topics; each topic partition is a partition.
    Kafka(KafkaSourceSpec),
}

impl SourceSpec {
    /// The same source read as a batch over what it holds when the run starts (a run that
    /// shares nothing with a consumer group).
    pub fn bounded(mut self) -> SourceSpec {
        match &mut self {
            SourceSpec::File { follow, .. } => *follow = false,
            SourceSpec::Kafka(k) => k.bounded = true,
        }
        self
    }

    /// True if the input never ends (followed files, an unbounded Kafka source).
    pub fn unbounded(&self) -> bool {
        match self {
            SourceSpec::File { follow, .. } => *follow,
            SourceSpec::Kafka(k) => !k.bounded,
        }
    }

    /// Whether its records can be read again from a savepoint's position (standard input
    /// cannot).
    pub fn replays(&self) -> bool {
        match self {
            SourceSpec::File { paths, .. } => !paths.iter().any(|p| p.as_os_str() == "-"),
            SourceSpec::Kafka(_) => true,
        }
    }

    pub fn partitioning(&self) -> &Partitioning {
        match self {
            SourceSpec::File { partitioning, .. } => partitioning,
            SourceSpec::Kafka(k) => &k.partitioning,
        }
    }

    /// The consumer group whose members share its partitions (a Kafka source's).
    pub fn group(&self) -> Option<&str> {
        match self {
            SourceSpec::File { .. } => None,
            SourceSpec::Kafka(k) => Some(&k.group),
        }
    }

    /// How often its consumer lag is logged (a Kafka source's `lag_interval`).
    pub fn lag_interval(&self) -> Option<Duration> {
        match self {
            SourceSpec::File { .. } => None,
            SourceSpec::Kafka(k) => Some(Duration::from_millis(k.lag_interval_ms as u64)),
        }
    }

    /// The one partition a task of a Kafka job reads (none for files).
    pub fn only_partition(&self) -> (String, i32) {
        match self {
            SourceSpec::Kafka(k) => k.only.clone().unwrap_or_default(),
            SourceSpec::File { .. } => Default::default(),
        }
    }
}

/// Where a Kafka source starts when no checkpoint or savepoint says where it was.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StartAt {
    /// The oldest retained record (the default: `latest` silently skips data).
    Earliest,
    /// Only records produced from now on.
    Latest,
    /// The consumer group's committed offsets, `earliest` where it has none.
    Committed,
}

/// `[source] kind = "kafka"`.
#[derive(Debug, Clone)]
pub struct KafkaSourceSpec {
    pub brokers: String,
    pub topics: Vec<String>,
    /// Consumer group: km0 commits its checkpointed offsets there, so lag shows in
    /// Kafka's tools. Partitions are assigned by km0 (all partitions of the topics).
    pub group: String,
    pub start: StartAt,
    /// Stop at the end offsets seen at start (a bounded run, like a file).
    pub bounded: bool,
    pub partitioning: Partitioning,
    /// How often the consumer lag is logged.
    pub lag_interval_ms: i64,
    /// Extra librdkafka consumer settings.
    pub properties: Vec<(String, String)>,
    /// The one partition (topic, id) a task reads; none: every partition of the topics.
    pub only: Option<(String, i32)>,
}

/// A Kafka producer's target.
#[derive(Debug, Clone)]
pub struct KafkaTarget {
    pub brokers: String,
    pub topic: String,
    /// Extra librdkafka producer settings.
    pub properties: Vec<(String, String)>,
}

/// How the Kafka result sink makes results exactly-once in effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KafkaSinkMode {
    /// Keyed records from an idempotent producer (acks=all), flushed at every
    /// checkpoint; a replay after a failure rewrites the same keys with the same values.
    Upsert,
    /// One Kafka transaction per checkpoint epoch, committed when the checkpoint is
    /// durable (needs a broker with transactions).
    Transactional,
}

/// `[dead_letter]`: a JSONL file, or a Kafka topic (original bytes, reason and origin in
/// headers).
#[derive(Debug, Clone)]
pub enum DeadLetterSpec {
    File(PathBuf),
    Kafka(KafkaTarget),
}

/// How records map to partitions, each with its own watermark.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Partitioning {
    /// Partition by this field's value instead of by file.
    pub field: Option<String>,
    /// A partition with no records for this long (processing time) stops holding the
    /// watermark back.
    pub idle_timeout_ms: Option<i64>,
    /// ... or after this many records of other partitions (deterministic, for replays).
    pub idle_after_records: Option<u64>,
}

/// One windowed aggregation: a window and the plugin that aggregates it.
#[derive(Debug, Clone)]
pub struct Aggregation {
    /// Stable operator id (savepoints) and, with several aggregations, the result key's
    /// first part.
    pub name: String,
    pub window: WindowSpec,
    pub plugin: PluginSpec,
}

#[derive(Debug, Clone, Serialize)]
pub struct EventTimeSpec {
    /// Field holding event time as integer epoch milliseconds.
    pub field: String,
    /// Tolerated out-of-orderness: watermark = max event time seen - delay.
    pub watermark_delay_ms: i64,
    /// Accepted event times, `[min, max)` epoch milliseconds; an event outside goes to
    /// the dead-letter output (window arithmetic stays far from i64's limits).
    pub min_ms: i64,
    pub max_ms: i64,
    pub watermark: WatermarkScope,
}

/// Default accepted event times: 1970-01-01 to 2500-01-01 (UTC).
pub const EVENT_TIME_MIN_MS: i64 = 0;
pub const EVENT_TIME_MAX_MS: i64 = 16_725_225_600_000;
/// The widest range `[event_time] min`/`max` may set: about ±290 000 years, so window
/// ends, lateness and delays (at most a few years each) never overflow.
const EVENT_TIME_LIMIT_MS: i64 = 1 << 53;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct WindowSpec {
    pub kind: WindowKind,
    /// How long after firing a window still takes late events (re-emitting it).
    pub allowed_lateness_ms: i64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum WindowKind {
    Tumbling {
        size_ms: i64,
    },
    /// `size_ms` is a multiple of `slide_ms`; each event goes into one pane of `slide_ms`.
    Sliding {
        size_ms: i64,
        slide_ms: i64,
    },
    Session {
        gap_ms: i64,
    },
}

#[derive(Debug, Clone)]
pub struct PluginSpec {
    pub path: PathBuf,
    /// `[plugin.config]`, each value as JSON text.
    pub config: Vec<(String, String)>,
    /// Maximum events per call into the plugin.
    pub batch_size: usize,
    /// CPU time per call and memory of the instance.
    pub limits: Limits,
    /// What a plugin fault does to the job.
    pub on_error: OnError,
    /// Faults of one key after which its events go to the dead letters without a call
    /// (0: never).
    pub quarantine_after: u32,
    /// Keys whose faults are followed at most, per aggregation and task (faults of
    /// others, once as many are, are dead-lettered and counted, not quarantined).
    pub quarantine_max_keys: usize,
    /// A live deploy whose plugin fails on more than this share of the events and windows
    /// it is given first is rolled back by the job itself (1: never).
    pub rollback_fault_rate: f64,
    /// After its probation, a live-deployed plugin's circuit breaker.
    pub breaker: BreakerSpec,
}

/// A live-deployed plugin's circuit breaker, after its probation: when it fails on more
/// than `fault_rate` of its last `events` events (or of the windows they fired), the job
/// rolls the deploy back or stops, as `action` says.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BreakerSpec {
    /// The events the fault rate is taken over (0: no breaker).
    pub events: u64,
    pub fault_rate: f64,
    pub action: BreakerAction,
}

/// What a tripped circuit breaker does.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BreakerAction {
    /// Roll the deploy back, as a failed probation does.
    #[default]
    Rollback,
    /// Stop the job with a savepoint (and an error that says why).
    Stop,
}

#[derive(Debug, Clone)]
pub enum SinkSpec {
    File {
        path: PathBuf,
    },
    Stdout,
    Kafka {
        target: KafkaTarget,
        mode: KafkaSinkMode,
        /// Unacknowledged records above which the source pauses (backpressure).
        max_in_flight: usize,
    },
    /// Upserts into a PostgreSQL table, committed with the job's progress in one
    /// database transaction at every checkpoint.
    Postgres {
        url: String,
        table: String,
    },
}

impl SinkSpec {
    /// Whether it commits with Kafka transactions (its checkpoints after the last commit
    /// never committed).
    pub fn transactional(&self) -> bool {
        matches!(self, SinkSpec::Kafka { mode: KafkaSinkMode::Transactional, .. })
    }
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
    #[serde(default)]
    window: Option<RawWindow>,
    #[serde(default)]
    plugin: Option<RawPlugin>,
    #[serde(default)]
    aggregations: Vec<RawAggregation>,
    sink: RawSink,
    late: RawPath,
    dead_letter: RawDeadLetter,
    #[serde(default)]
    savepoints: Option<RawDir>,
    #[serde(default)]
    checkpoints: Option<RawCheckpoints>,
    #[serde(default)]
    state: Option<RawState>,
    #[serde(default)]
    control: Option<RawControl>,
    #[serde(default)]
    job: Option<RawJob>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawJob {
    #[serde(default)]
    parallelism: Option<usize>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawControl {
    #[serde(default)]
    http: Option<String>,
    #[serde(default)]
    max_upload_mb: Option<usize>,
    #[serde(default)]
    allowed_hosts: Vec<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawState {
    #[serde(default)]
    backend: Option<Backend>,
    #[serde(default)]
    dir: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCheckpoints {
    dir: String,
    #[serde(deserialize_with = "duration_ms")]
    interval: i64,
    #[serde(default)]
    every_records: Option<u64>,
    #[serde(default)]
    retain: Option<usize>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, tag = "kind", rename_all = "lowercase")]
enum RawSource {
    File {
        #[serde(default)]
        path: Option<String>,
        #[serde(default)]
        paths: Vec<String>,
        #[serde(default)]
        partition_field: Option<String>,
        #[serde(default, deserialize_with = "opt_duration_ms")]
        idle_timeout: Option<i64>,
        #[serde(default)]
        idle_after_records: Option<u64>,
        /// Keep reading as the files grow (an unbounded source), like `tail -f`.
        #[serde(default)]
        follow: bool,
        #[serde(default)]
        partitioned_by: Vec<String>,
    },
    Kafka {
        brokers: String,
        #[serde(default)]
        topic: Option<String>,
        #[serde(default)]
        topics: Vec<String>,
        #[serde(default)]
        group: Option<String>,
        #[serde(default)]
        start: Option<StartAt>,
        #[serde(default)]
        bounded: bool,
        #[serde(default, deserialize_with = "opt_duration_ms")]
        idle_timeout: Option<i64>,
        #[serde(default)]
        idle_after_records: Option<u64>,
        #[serde(default, deserialize_with = "opt_duration_ms")]
        lag_interval: Option<i64>,
        #[serde(default)]
        properties: BTreeMap<String, String>,
        #[serde(default)]
        partitioned_by: Vec<String>,
    },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAggregation {
    name: String,
    window: RawWindow,
    plugin: RawPlugin,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEventTime {
    field: String,
    #[serde(deserialize_with = "duration_ms")]
    watermark_delay: i64,
    /// Accepted event times (epoch ms), default 1970-01-01 to 2500-01-01.
    min: Option<i64>,
    max: Option<i64>,
    #[serde(default)]
    watermark: WatermarkScope,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawWindow {
    kind: RawWindowKind,
    #[serde(default, deserialize_with = "opt_duration_ms")]
    size: Option<i64>,
    #[serde(default, deserialize_with = "opt_duration_ms")]
    slide: Option<i64>,
    #[serde(default, deserialize_with = "opt_duration_ms")]
    gap: Option<i64>,
    #[serde(default, deserialize_with = "opt_duration_ms")]
    allowed_lateness: Option<i64>,
}

#[derive(Deserialize, Clone, Copy)]
#[serde(rename_all = "lowercase")]
enum RawWindowKind {
    Tumbling,
    Sliding,
    Session,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPlugin {
    path: String,
    #[serde(default)]
    config: toml::Table,
    #[serde(default)]
    batch_size: Option<usize>,
    #[serde(default, deserialize_with = "opt_duration_ms")]
    call_timeout: Option<i64>,
    #[serde(default)]
    max_memory_mb: Option<usize>,
    #[serde(default)]
    on_error: OnError,
    #[serde(default)]
    quarantine_after: Option<u32>,
    #[serde(default)]
    quarantine_max_keys: Option<usize>,
    #[serde(default)]
    rollback_fault_rate: Option<f64>,
    #[serde(default)]
    breaker_events: Option<u64>,
    #[serde(default)]
    breaker_fault_rate: Option<f64>,
    #[serde(default)]
    on_breaker: BreakerAction,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, tag = "kind", rename_all = "lowercase")]
enum RawSink {
    File {
        path: String,
    },
    Stdout,
    Kafka {
        #[serde(default)]
        brokers: Option<String>,
        topic: String,
        #[serde(default)]
        mode: Option<KafkaSinkMode>,
        #[serde(default)]
        max_in_flight: Option<usize>,
        #[serde(default)]
        properties: BTreeMap<String, String>,
    },
    Postgres {
        url: String,
        table: String,
    },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDeadLetter {
    #[serde(default)]
    path: Option<String>,
    #[serde(default)]
    topic: Option<String>,
    #[serde(default)]
    brokers: Option<String>,
    #[serde(default)]
    properties: BTreeMap<String, String>,
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

fn opt_duration_ms<'de, D: Deserializer<'de>>(d: D) -> Result<Option<i64>, D::Error> {
    duration_ms(d).map(Some)
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

fn window_spec(w: RawWindow, at: &str) -> Result<WindowSpec, String> {
    let need = |v: Option<i64>, name: &str| -> Result<i64, String> {
        match v {
            Some(v) if v > 0 => Ok(v),
            Some(_) => Err(format!("`{at}.{name}` must be positive")),
            None => Err(format!("`{at}.{name}` is required for this window kind")),
        }
    };
    let refuse = |v: Option<i64>, name: &str| match v {
        Some(_) => Err(format!("`{at}.{name}` does not apply to this window kind")),
        None => Ok(()),
    };
    let kind = match w.kind {
        RawWindowKind::Tumbling => {
            refuse(w.slide, "slide")?;
            refuse(w.gap, "gap")?;
            WindowKind::Tumbling { size_ms: need(w.size, "size")? }
        }
        RawWindowKind::Sliding => {
            refuse(w.gap, "gap")?;
            let (size_ms, slide_ms) = (need(w.size, "size")?, need(w.slide, "slide")?);
            if size_ms % slide_ms != 0 {
                return Err(format!("`{at}.size` must be a multiple of `{at}.slide`"));
            }
            WindowKind::Sliding { size_ms, slide_ms }
        }
        RawWindowKind::Session => {
            refuse(w.size, "size")?;
            refuse(w.slide, "slide")?;
            WindowKind::Session { gap_ms: need(w.gap, "gap")? }
        }
    };
    Ok(WindowSpec { kind, allowed_lateness_ms: w.allowed_lateness.unwrap_or(0) })
}

/// Events per plugin call when `[plugin].batch_size` is not set. A group's (key and
/// slot's) rows go to the plugin together, and every group costs a round trip of its
/// accumulator (read, encoded into the call, decoded and encoded by the guest, written
/// back): with 10 000 keys and ~4 events per key and window, 65 536 events a call (about
/// 8 minutes of that stream) gather a window's events into one group and ran 9-13% faster
/// than 8 192, 1.5% with 1 000 keys. The price, with 856 298 open windows: a checkpoint,
/// which hands the staged events to the plugin first, paused 24-30 ms instead of 18-19
/// (RocksDB: 33-35 instead of 25), and the peak RSS rose by 18 MiB.
pub const DEFAULT_BATCH_SIZE: usize = 65_536;

fn plugin_spec(p: RawPlugin, at: &str, resolve: &dyn Fn(&str) -> PathBuf) -> Result<PluginSpec, String> {
    let batch_size = p.batch_size.unwrap_or(DEFAULT_BATCH_SIZE);
    if batch_size == 0 {
        return Err(format!("`{at}.batch_size` must be positive"));
    }
    let mut config = Vec::new();
    for (k, v) in p.config {
        let json = serde_json::to_string(&v).map_err(|e| format!("`{at}.config.{k}`: {e}"))?;
        config.push((k, json));
    }
    let mut limits = Limits::default();
    if let Some(ms) = p.call_timeout {
        if ms < 10 {
            return Err(format!("`{at}.call_timeout` must be at least 10ms"));
        }
        limits.call_timeout = Duration::from_millis(ms as u64);
    }
    if let Some(mb) = p.max_memory_mb {
        if mb == 0 {
            return Err(format!("`{at}.max_memory_mb` must be positive"));
        }
        limits.memory_bytes = mb.saturating_mul(1 << 20);
    }
    let rollback_fault_rate = p.rollback_fault_rate.unwrap_or(DEFAULT_ROLLBACK_FAULT_RATE);
    if !(rollback_fault_rate > 0.0 && rollback_fault_rate <= 1.0) {
        return Err(format!("`{at}.rollback_fault_rate` must be above 0 and at most 1 (1: never roll back)"));
    }
    let breaker_fault_rate = p.breaker_fault_rate.unwrap_or(rollback_fault_rate);
    if !(breaker_fault_rate > 0.0 && breaker_fault_rate <= 1.0) {
        return Err(format!("`{at}.breaker_fault_rate` must be above 0 and at most 1 (1: never trips)"));
    }
    let quarantine_max_keys = p.quarantine_max_keys.unwrap_or(DEFAULT_QUARANTINE_MAX_KEYS);
    if quarantine_max_keys == 0 {
        return Err(format!("`{at}.quarantine_max_keys` must be at least 1"));
    }
    let breaker = BreakerSpec {
        events: p.breaker_events.unwrap_or(DEFAULT_BREAKER_EVENTS),
        fault_rate: breaker_fault_rate,
        action: p.on_breaker,
    };
    Ok(PluginSpec {
        rollback_fault_rate,
        breaker,
        path: resolve(&p.path),
        config,
        batch_size,
        limits,
        on_error: p.on_error,
        quarantine_after: p.quarantine_after.unwrap_or(DEFAULT_QUARANTINE_AFTER),
        quarantine_max_keys,
    })
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
        Self::from_raw(raw, path).map_err(err)
    }

    /// The pipeline `raw` describes, checked; `path` locates relative paths.
    fn from_raw(raw: RawPipeline, path: &Path) -> std::result::Result<Pipeline, String> {
        // Relative paths are resolved against the pipeline's folder, made canonical, so
        // every spelling of the pipeline's path (`p.toml`, `./p.toml`, `/abs/p.toml`)
        // names the same files (checkpoints compare them).
        let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
        let base = std::fs::canonicalize(if base.as_os_str().is_empty() { Path::new(".") } else { &base })
            .or_else(|_| std::path::absolute(&base))
            .unwrap_or(base);
        let resolve = |p: &str| -> PathBuf {
            if p == "-" {
                PathBuf::from("-")
            } else {
                base.join(p)
            }
        };
        let (min_ms, max_ms) = check_names_and_times(&raw)?;
        let aggregations = aggregations_spec(raw.window, raw.plugin, raw.aggregations, &resolve)?;
        let (source, partitioned_by) = source_spec(raw.source, &raw.name, &resolve)?;
        // Kafka sinks default to the source's brokers.
        let source_brokers = match &source {
            SourceSpec::Kafka(k) => Some(k.brokers.clone()),
            SourceSpec::File { .. } => None,
        };
        let brokers_for = |given: Option<String>, at: &str| {
            given.or_else(|| source_brokers.clone()).ok_or_else(|| {
                format!("`{at}.brokers` is needed (the source is not Kafka, so there are none to reuse)")
            })
        };
        let sink = sink_spec(raw.sink, &brokers_for, &resolve)?;
        let dead_letter = dead_letter_spec(raw.dead_letter, &brokers_for, &resolve)?;
        let savepoints = raw.savepoints.map(|d| resolve(&d.dir)).unwrap_or_else(|| base.join("savepoints"));
        let state = state_spec(raw.state, source.unbounded(), &raw.name, &base, &resolve);
        let checkpoints = checkpoint_spec(raw.checkpoints, &state, &resolve)?;
        check_commits(&sink, &source, checkpoints.as_ref())?;
        let watermark = raw.event_time.watermark;
        let parallelism = raw.job.and_then(|j| j.parallelism);
        tasks_spec(&raw.key, &partitioned_by, watermark, &source, parallelism)?;
        Ok(Pipeline {
            file: path.to_path_buf(),
            name: raw.name,
            key: raw.key,
            source,
            filter: raw.filter,
            event_time: EventTimeSpec {
                field: raw.event_time.field,
                watermark_delay_ms: raw.event_time.watermark_delay,
                min_ms,
                max_ms,
                watermark,
            },
            aggregations,
            sink,
            late: resolve(&raw.late.path),
            dead_letter,
            savepoints,
            checkpoints,
            state,
            control: raw
                .control
                .map(|c| ControlSpec {
                    http: c.http,
                    max_upload_bytes: c.max_upload_mb.map(|mb| mb << 20),
                    allowed_hosts: c.allowed_hosts.into_iter().map(|h| h.to_ascii_lowercase()).collect(),
                })
                .unwrap_or_default(),
            partitioned_by,
            parallelism,
            task: None,
        })
    }

    /// The job's name, and its task's when it is one task of several (`stock/task-0`):
    /// what a sink that keeps progress (PostgreSQL) or fences (Kafka transactions) knows it by.
    pub fn instance_name(&self) -> String {
        match &self.task {
            Some(t) => format!("{}/{t}", self.name),
            None => self.name.clone(),
        }
    }

    /// Identity of what shapes the job's state (key, windows, event-time field, filter).
    /// A savepoint restores only into a pipeline with the same fingerprint; changing the
    /// watermark delay, allowed lateness, plugin config, sinks or paths keeps it.
    pub fn state_fingerprint(&self) -> String {
        let windows: Vec<_> = self.aggregations.iter().map(|a| (&a.name, a.window.kind)).collect();
        let shape = serde_json::json!({
            "key": self.key,
            "windows": windows,
            "event_time_field": self.event_time.field,
            "filter": self.filter,
        });
        hex(&Sha256::digest(shape.to_string().as_bytes()))
    }
}

/// Check what the job's tasks need: with `watermark = "per-partition"` each partition is a
/// task that owns the keys arriving in it, so the input must say it is partitioned by the
/// key's leading fields; with `"job"` the partitions run as one task.
/// The job's name, key and event-time field present, its accepted event times in order:
/// those times (`[min, max)`, epoch ms).
fn check_names_and_times(raw: &RawPipeline) -> std::result::Result<(i64, i64), String> {
    let time_min = raw.event_time.min.unwrap_or(EVENT_TIME_MIN_MS);
    let time_max = raw.event_time.max.unwrap_or(EVENT_TIME_MAX_MS);
    if !(-EVENT_TIME_LIMIT_MS <= time_min && time_min < time_max && time_max <= EVENT_TIME_LIMIT_MS) {
        return Err(format!(
            "[event_time] min = {time_min} and max = {time_max} must satisfy \
                 -{EVENT_TIME_LIMIT_MS} <= min < max <= {EVENT_TIME_LIMIT_MS} (epoch milliseconds)"
        ));
    }
    if raw.name.trim().is_empty() {
        return Err("`name` is empty".into());
    }
    if raw.key.is_empty() {
        return Err("`key` needs at least one field".into());
    }
    if let Some(dup) = raw.key.iter().enumerate().find(|(i, k)| raw.key[..*i].contains(k)) {
        return Err(format!("`key` names field {:?} twice", dup.1));
    }
    if raw.event_time.field.is_empty() {
        return Err("`event_time.field` is empty".into());
    }
    Ok((time_min, time_max))
}

/// One aggregation (`[window]` and `[plugin]`) or several (`[[aggregations]]`).
fn aggregations_spec(
    window: Option<RawWindow>,
    plugin: Option<RawPlugin>,
    aggregations: Vec<RawAggregation>,
    resolve: &dyn Fn(&str) -> PathBuf,
) -> std::result::Result<Vec<Aggregation>, String> {
    Ok(match (window, plugin, aggregations.is_empty()) {
        (Some(w), Some(p), true) => vec![Aggregation {
            name: "window-aggregate".into(),
            window: window_spec(w, "window")?,
            plugin: plugin_spec(p, "plugin", resolve)?,
        }],
        (None, None, false) => {
            let mut out: Vec<Aggregation> = Vec::new();
            for (i, a) in aggregations.into_iter().enumerate() {
                let at = format!("aggregations[{i}]");
                if a.name.is_empty() || a.name.contains('|') {
                    return Err(format!("`{at}.name` must be non-empty and without '|'"));
                }
                if out.iter().any(|o| o.name == a.name) {
                    return Err(format!("`{at}.name` {:?} is used twice", a.name));
                }
                out.push(Aggregation {
                    name: a.name,
                    window: window_spec(a.window, &format!("{at}.window"))?,
                    plugin: plugin_spec(a.plugin, &format!("{at}.plugin"), resolve)?,
                });
            }
            out
        }
        _ => {
            return Err(
                "give either `[window]` and `[plugin]` (one aggregation) or `[[aggregations]]` (several)"
                    .into(),
            )
        }
    })
}

/// The source of job `name`, and the key fields its records are partitioned by.
fn source_spec(
    raw: RawSource,
    name: &str,
    resolve: &dyn Fn(&str) -> PathBuf,
) -> std::result::Result<(SourceSpec, Vec<String>), String> {
    Ok(match raw {
        RawSource::File {
            path,
            paths,
            partition_field,
            idle_timeout,
            idle_after_records,
            follow,
            partitioned_by,
        } => {
            let mut all: Vec<PathBuf> = path.iter().map(|p| resolve(p)).collect();
            all.extend(paths.iter().map(|p| resolve(p)));
            if all.is_empty() {
                return Err("`source` needs `path` or `paths`".into());
            }
            if partition_field.is_some() && all.len() > 1 {
                return Err("`source.partition_field` partitions one file; give one `path`".into());
            }
            let partitioning =
                Partitioning { field: partition_field, idle_timeout_ms: idle_timeout, idle_after_records };
            (SourceSpec::File { paths: all, partitioning, follow }, partitioned_by)
        }
        RawSource::Kafka {
            brokers,
            topic,
            topics,
            group,
            start,
            bounded,
            idle_timeout,
            idle_after_records,
            lag_interval,
            properties,
            partitioned_by,
        } => {
            let mut all: Vec<String> = topic.into_iter().collect();
            all.extend(topics);
            if all.is_empty() || all.iter().any(|t| t.is_empty()) {
                return Err("`source` (kafka) needs `topic` or `topics`".into());
            }
            if brokers.trim().is_empty() {
                return Err("`source.brokers` is empty".into());
            }
            let spec = SourceSpec::Kafka(KafkaSourceSpec {
                brokers,
                topics: all,
                group: group.unwrap_or_else(|| format!("km0-{name}")),
                start: start.unwrap_or(StartAt::Earliest),
                bounded,
                partitioning: Partitioning { field: None, idle_timeout_ms: idle_timeout, idle_after_records },
                properties: properties.into_iter().collect(),
                lag_interval_ms: lag_interval.unwrap_or(5_000).max(100),
                only: None,
            });
            (spec, partitioned_by)
        }
    })
}

/// The brokers a Kafka sink (at a section) writes to: those given, else the source's.
type BrokersFor<'a> = dyn Fn(Option<String>, &str) -> std::result::Result<String, String> + 'a;

/// The result sink (Kafka's brokers default to the source's, `brokers_for`).
fn sink_spec(
    raw: RawSink,
    brokers_for: &BrokersFor,
    resolve: &dyn Fn(&str) -> PathBuf,
) -> std::result::Result<SinkSpec, String> {
    Ok(match raw {
        RawSink::File { path } => SinkSpec::File { path: resolve(&path) },
        RawSink::Stdout => SinkSpec::Stdout,
        RawSink::Kafka { brokers, topic, mode, max_in_flight, properties } => SinkSpec::Kafka {
            target: KafkaTarget {
                brokers: brokers_for(brokers, "sink")?,
                topic,
                properties: properties.into_iter().collect(),
            },
            mode: mode.unwrap_or(KafkaSinkMode::Upsert),
            max_in_flight: match max_in_flight {
                Some(0) => return Err("`sink.max_in_flight` must be at least 1".into()),
                Some(n) => n,
                None => 50_000,
            },
        },
        RawSink::Postgres { url, table } => {
            let valid = table.split('.').all(|part| {
                !part.is_empty()
                    && part.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
                    && part.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            });
            if !valid {
                return Err(format!(
                    "`sink.table` {table:?}: use letters, digits and '_' (optionally schema.table)"
                ));
            }
            SinkSpec::Postgres { url, table }
        }
    })
}

/// The dead letters: a JSONL file or a Kafka topic.
fn dead_letter_spec(
    d: RawDeadLetter,
    brokers_for: &BrokersFor,
    resolve: &dyn Fn(&str) -> PathBuf,
) -> std::result::Result<DeadLetterSpec, String> {
    Ok(match (d.path, d.topic) {
            (Some(path), None) if d.brokers.is_none() && d.properties.is_empty() => {
                DeadLetterSpec::File(resolve(&path))
            }
            (None, Some(topic)) => DeadLetterSpec::Kafka(KafkaTarget {
                brokers: brokers_for(d.brokers, "dead_letter")?,
                topic,
                properties: d.properties.into_iter().collect(),
            }),
            _ => {
                return Err(
                    "`[dead_letter]` takes `path` (a JSONL file) or `topic` (Kafka, with optional `brokers` and `properties`)"
                        .into(),
                )
            }
        })
}

/// The state backend of job `name` (RocksDB by default when the source `follows`) and
/// its working folder.
fn state_spec(
    raw: Option<RawState>,
    follows: bool,
    name: &str,
    base: &Path,
    resolve: &dyn Fn(&str) -> PathBuf,
) -> StateSpec {
    let raw_state = raw.unwrap_or(RawState { backend: None, dir: None });
    StateSpec {
        // RocksDB by default for unbounded sources, as the issue of large state is theirs.
        backend: raw_state.backend.unwrap_or(if follows { Backend::Rocksdb } else { Backend::Memory }),
        named: raw_state.backend.is_some(),
        // The working copy is rebuilt from the checkpoints at every start: one folder
        // per job name (two names never share one), so jobs in one folder never clear
        // each other's.
        dir: raw_state.dir.map(|d| resolve(&d)).unwrap_or_else(|| base.join("state").join(folder_name(name))),
    }
}

/// Periodic checkpoints, if any: a folder, or an object store with a local copy beside
/// the `state`.
fn checkpoint_spec(
    raw: Option<RawCheckpoints>,
    state: &StateSpec,
    resolve: &dyn Fn(&str) -> PathBuf,
) -> std::result::Result<Option<CheckpointSpec>, String> {
    Ok(match raw {
        None => None,
        Some(c) if c.interval <= 0 => return Err("`checkpoints.interval` must be positive".into()),
        Some(c) if c.retain == Some(0) => return Err("`checkpoints.retain` must be at least 1".into()),
        Some(c) => Some(CheckpointSpec {
            dir: if is_object_store(&c.dir) { state.dir.join("checkpoints") } else { resolve(&c.dir) },
            remote: is_object_store(&c.dir).then(|| c.dir.trim_end_matches('/').to_string()),
            interval_ms: c.interval,
            every_records: c.every_records.filter(|&n| n > 0),
            retain: c.retain.unwrap_or(3),
        }),
    })
}

/// A sink that commits at checkpoints has them when its source never ends, and a
/// transactional one keeps two.
fn check_commits(
    sink: &SinkSpec,
    source: &SourceSpec,
    checkpoints: Option<&CheckpointSpec>,
) -> std::result::Result<(), String> {
    let transactional = matches!(sink, SinkSpec::Kafka { mode: KafkaSinkMode::Transactional, .. });
    if (transactional || matches!(sink, SinkSpec::Postgres { .. }))
        && source.unbounded()
        && checkpoints.is_none()
    {
        return Err(
                "this sink commits at checkpoints: an unbounded source needs `[checkpoints]`, or nothing is ever \
                 committed"
                    .into(),
            );
    }
    if transactional && checkpoints.is_some_and(|c| c.retain < 2) {
        return Err(
            "`checkpoints.retain` must be at least 2 with a transactional sink (recovery may need the \
                 checkpoint before the newest)"
                .into(),
        );
    }
    Ok(())
}

fn tasks_spec(
    key: &[String],
    partitioned_by: &[String],
    watermark: WatermarkScope,
    source: &SourceSpec,
    parallelism: Option<usize>,
) -> Result<(), String> {
    if !partitioned_by.is_empty() && !key.starts_with(partitioned_by) {
        return Err(format!(
            "`source.partitioned_by` {partitioned_by:?} must be the first fields of `key` {key:?}: a task owns \
             whole keys"
        ));
    }
    if partitioned_by.len() > 8 {
        return Err("`source.partitioned_by` takes at most 8 fields".into());
    }
    if parallelism == Some(0) {
        return Err("`job.parallelism` must be at least 1".into());
    }
    match watermark {
        WatermarkScope::Job if parallelism.is_some_and(|n| n > 1) => {
            Err("`job.parallelism` above 1 needs `event_time.watermark = \"per-partition\"`: with the job's \
             watermark (the minimum over all partitions) the partitions run as one task"
                .into())
        }
        WatermarkScope::Job => Ok(()),
        WatermarkScope::PerPartition if partitioned_by.is_empty() => Err(
            "`event_time.watermark = \"per-partition\"` runs each partition as a task that owns the keys \
             arriving in it: declare the key fields the input is partitioned by (`source.partitioned_by`, \
             e.g. the Kafka message key's fields)"
                .into(),
        ),
        WatermarkScope::PerPartition if source.partitioning().field.is_some() => {
            Err("`event_time.watermark = \"per-partition\"` needs a file or a Kafka partition per task; \
             `source.partition_field` splits one file by value"
                .into())
        }
        WatermarkScope::PerPartition => match source {
            SourceSpec::File { paths, .. } if paths.iter().enumerate().any(|(i, p)| paths[..i].contains(p)) => {
                Err("`source.paths` names a file twice: with `watermark = \"per-partition\"` each file is a task".into())
            }
            _ => Ok(()),
        },
    }
}

/// Whether `[checkpoints] dir` names an object store (`s3://bucket/prefix`).
pub fn is_object_store(dir: &str) -> bool {
    dir.starts_with("s3://")
}

/// Lower-case hex of a digest.
pub fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes.iter().fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// Faults of one key after which its events go to the dead letters without a plugin call,
/// unless `[plugin] quarantine_after` says otherwise: a deterministic plugin that failed on a
/// key three times will fail on it again, and each fault may cost a whole `call_timeout`.
pub const DEFAULT_QUARANTINE_AFTER: u32 = 3;

/// Keys whose faults an aggregation's task follows at most, unless `[plugin]
/// quarantine_max_keys` says otherwise: about 4 MB of memory and of each checkpoint.
pub const DEFAULT_QUARANTINE_MAX_KEYS: usize = 100_000;

/// The share of the events and windows a live-deployed plugin may fail on, over the first
/// ones it is given, before the job rolls the deploy back by itself.
pub const DEFAULT_ROLLBACK_FAULT_RATE: f64 = 0.5;

/// The events a live-deployed plugin's circuit breaker takes its fault rate over, after
/// its probation.
pub const DEFAULT_BREAKER_EVENTS: u64 = 10_000;

/// What one plugin instance may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Time one call may take (wall-clock time while its guest runs, counted in epochs
    /// of [`crate::plugin::EPOCH`]); a call that runs longer is stopped.
    pub call_timeout: Duration,
    /// Linear memory of the instance: all its memories and tables together.
    pub memory_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { call_timeout: Duration::from_secs(10), memory_bytes: 512 << 20 }
    }
}

/// What happens when a plugin traps, runs out of time or memory, or returns garbage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnError {
    /// Stop the job with the error (it restarts from its last checkpoint or savepoint).
    Fail,
    /// Recreate the instance, find the groups that fail by calling again one group at a
    /// time, send their events to the dead-letter output with the reason, and go on.
    #[default]
    DeadLetter,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_job_names_never_share_a_state_folder() {
        // Hand-written: the names that used to meet in `shop_a`.
        assert_eq!(folder_name("shop.a"), "shop_2ea");
        assert_eq!(folder_name("shop_a"), "shop_5fa");
        assert_eq!(folder_name("stock-alert"), "stock-alert");
        assert_eq!(folder_name("a/../b"), "a_2f_2e_2e_2fb");
        assert_eq!(folder_name("ñ"), "_c3_b1");
        let names = ["shop.a", "shop_a", "shop a", "shop_2ea", "shop__2ea", "", "_", "__5f", "-"];
        let folders: std::collections::HashSet<String> = names.iter().map(|n| folder_name(n)).collect();
        assert_eq!(folders.len(), names.len());
    }

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
        let a = &p.aggregations[0];
        assert_eq!(a.window.kind, WindowKind::Tumbling { size_ms: 300_000 });
        assert_eq!(a.window.allowed_lateness_ms, 0);
        assert_eq!(a.plugin.path, PathBuf::from("/jobs/stock/min-stock.wasm"));
        assert_eq!(a.plugin.config, vec![("threshold".to_string(), "10".to_string())]);
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
    fn sliding_session_and_several_aggregations() {
        let sliding = GOOD.replace(
            "kind = \"tumbling\"\nsize = \"5m\"",
            "kind = \"sliding\"\nsize = \"5m\"\nslide = \"1m\"\nallowed_lateness = \"30s\"",
        );
        let p = Pipeline::parse(&sliding, Path::new("p.toml")).unwrap();
        assert_eq!(p.aggregations[0].window.kind, WindowKind::Sliding { size_ms: 300_000, slide_ms: 60_000 });
        assert_eq!(p.aggregations[0].window.allowed_lateness_ms, 30_000);
        let bad = GOOD.replace(
            "kind = \"tumbling\"\nsize = \"5m\"",
            "kind = \"sliding\"\nsize = \"5m\"\nslide = \"2m\"",
        );
        let e = Pipeline::parse(&bad, Path::new("p.toml")).unwrap_err().to_string();
        assert!(e.contains("multiple of"), "{e}");
        let bad = GOOD.replace("kind = \"tumbling\"\nsize = \"5m\"", "kind = \"session\"\nsize = \"5m\"");
        let e = Pipeline::parse(&bad, Path::new("p.toml")).unwrap_err().to_string();
        assert!(e.contains("window.size` does not apply"), "{e}");

        let several = r#"
name = "panel"
key = ["repartidor"]
[source]
kind = "file"
paths = ["a.jsonl", "b.jsonl"]
idle_timeout = "30s"
[event_time]
field = "fecha_ms"
watermark_delay = "45s"
[[aggregations]]
name = "distancia"
window = { kind = "sliding", size = "5m", slide = "1m" }
plugin = { path = "distance.wasm" }
[[aggregations]]
name = "sin_senal"
window = { kind = "session", gap = "3m" }
plugin = { path = "session-gap.wasm" }
[sink]
kind = "stdout"
[late]
path = "late.jsonl"
[dead_letter]
path = "dead.jsonl"
"#;
        let p = Pipeline::parse(several, Path::new("/j/p.toml")).unwrap();
        assert_eq!(p.aggregations.len(), 2);
        assert_eq!(p.aggregations[1].window.kind, WindowKind::Session { gap_ms: 180_000 });
        let SourceSpec::File { paths, partitioning, .. } = &p.source else { panic!("a file source") };
        assert_eq!(paths.len(), 2);
        assert_eq!(partitioning.idle_timeout_ms, Some(30_000));
        let twice = several.replace("name = \"sin_senal\"", "name = \"distancia\"");
        assert!(Pipeline::parse(&twice, Path::new("p.toml")).unwrap_err().to_string().contains("used twice"));
    }

    #[test]
    fn kafka_source_sinks_and_dead_letters() {
        let text = r#"
name = "stock-alert"
key = ["producto", "mercado"]
[source]
kind = "kafka"
brokers = "127.0.0.1:9092"
topic = "pedidos.eventos"
[source.properties]
"session.timeout.ms" = "6000"
[event_time]
field = "fecha_ms"
watermark_delay = "2m"
[window]
kind = "tumbling"
size = "5m"
[plugin]
path = "p.wasm"
[sink]
kind = "kafka"
topic = "inventario.alertas"
[late]
path = "late.jsonl"
[dead_letter]
topic = "km0.dead-letter"
"#;
        let p = Pipeline::parse(text, Path::new("/j/p.toml")).unwrap();
        let SourceSpec::Kafka(k) = &p.source else { panic!("a kafka source") };
        assert_eq!(k.topics, ["pedidos.eventos"]);
        assert_eq!((k.group.as_str(), k.start, k.bounded), ("km0-stock-alert", StartAt::Earliest, false));
        assert_eq!(k.properties, [("session.timeout.ms".to_string(), "6000".to_string())]);
        let SinkSpec::Kafka { target, mode, max_in_flight } = &p.sink else { panic!("a kafka sink") };
        assert_eq!(*max_in_flight, 50_000);
        assert_eq!((target.brokers.as_str(), *mode), ("127.0.0.1:9092", KafkaSinkMode::Upsert));
        assert!(matches!(&p.dead_letter, DeadLetterSpec::Kafka(t) if t.topic == "km0.dead-letter"));
        // Unbounded Kafka keeps large state in RocksDB by default.
        assert_eq!(p.state.backend, Backend::Rocksdb);

        let bad = |from: &str, to: &str| {
            Pipeline::parse(&text.replace(from, to), Path::new("p.toml")).unwrap_err().to_string()
        };
        assert!(bad("topic = \"pedidos.eventos\"", "").contains("needs `topic` or `topics`"));
        assert!(bad("topic = \"km0.dead-letter\"", "path = \"d\"\ntopic = \"x\"").contains("takes `path`"));
        assert!(bad(
            "[sink]\nkind = \"kafka\"\ntopic = \"inventario.alertas\"",
            "[sink]\nkind = \"postgres\"\nurl = \"u\"\ntable = \"a; drop\""
        )
        .contains("`sink.table`"));
        let file_source = text.replace(
            "kind = \"kafka\"\nbrokers = \"127.0.0.1:9092\"\ntopic = \"pedidos.eventos\"\n[source.properties]\n\"session.timeout.ms\" = \"6000\"",
            "kind = \"file\"\npath = \"in.jsonl\"",
        );
        let e = Pipeline::parse(&file_source, Path::new("p.toml")).unwrap_err().to_string();
        assert!(e.contains("`sink.brokers` is needed"), "{e}");
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

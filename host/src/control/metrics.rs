//! `GET /metrics`: the job's status in the OpenMetrics text format (which Prometheus
//! scrapes), written with `prometheus-client`. Nothing is counted for it: every value comes
//! from the status the job's loop publishes a few times a second, so metrics cost the loop
//! nothing more than the status does.
//!
//! Names follow Prometheus' conventions: `km0_` prefix, `_total` counters, seconds and
//! bytes; labels `job`, `aggregation`, `partition`, `sink`.

use crate::job::commands::{CheckpointStatus, DeployStatus, JobStatus};
use crate::plugin::{CallStats, CALL_BUCKETS};
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};
use std::sync::atomic::AtomicU64;

type Labels = Vec<(String, String)>;
type FloatGauge = Gauge<f64, AtomicU64>;

/// The content type of [`render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Seconds since the epoch of an event time in ms (none before the first event).
fn seconds(ms: i64) -> Option<f64> {
    (ms != i64::MIN && ms != i64::MAX).then_some(ms as f64 / 1e3)
}

/// Plugin call latency per aggregation, from the counts the job keeps.
#[derive(Debug)]
struct CallHistograms(Vec<(Labels, CallStats)>);

impl EncodeMetric for CallHistograms {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        for (labels, c) in &self.0 {
            // Per-bucket counts (the encoder sums them up); the last bucket is +Inf
            // (f64::MAX, as the encoder knows it).
            let bounds = CALL_BUCKETS.iter().copied().chain(std::iter::once(f64::MAX));
            let buckets: Vec<(f64, u64)> = bounds.zip(c.buckets).collect();
            encoder
                .encode_family(labels)?
                .encode_histogram::<NoLabelSet>(c.seconds, c.count, &buckets, None)?;
        }
        Ok(())
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

struct Metrics<'a> {
    registry: Registry,
    job: &'a str,
}

/// The longest label value written, in bytes; a longer one is cut (at a character's
/// boundary) and ends in `~` and 8 hex digits of the whole value's SHA-256, then `…`: two
/// values alike in their first bytes stay two series.
pub const MAX_LABEL_BYTES: usize = 128;

/// A label value as the exposition formats write it: `\`, `"` and a line feed escaped
/// (`prometheus-client` writes values as it gets them), other control characters dropped,
/// at most [`MAX_LABEL_BYTES`]. Job, aggregation and plugin names and partition names
/// (a record's field, with `partition_field`) all come from outside.
pub fn label_value(v: &str) -> String {
    let mut cut = v;
    let mut tail = String::new();
    if v.len() > MAX_LABEL_BYTES {
        use sha2::{Digest, Sha256};
        let hash = Sha256::digest(v.as_bytes());
        tail = format!("~{:02x}{:02x}{:02x}{:02x}…", hash[0], hash[1], hash[2], hash[3]);
        // The escapes below may lengthen what is kept: cut with room for them.
        let mut end = MAX_LABEL_BYTES - tail.len();
        while !v.is_char_boundary(end) {
            end -= 1;
        }
        cut = &v[..end];
        while cut.len() + cut.matches(['\\', '"', '\n']).count() + tail.len() > MAX_LABEL_BYTES {
            let mut end = cut.len() - 1;
            while !cut.is_char_boundary(end) {
                end -= 1;
            }
            cut = &cut[..end];
        }
    }
    let mut out = String::with_capacity(cut.len() + 4);
    for c in cut.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c if c.is_control() => {}
            c => out.push(c),
        }
    }
    out.push_str(&tail);
    out
}

impl Metrics<'_> {
    fn labels(&self, more: &[(&str, &str)]) -> Labels {
        let mut l = vec![("job".to_string(), label_value(self.job))];
        l.extend(more.iter().map(|(k, v)| (k.to_string(), label_value(v))));
        l
    }

    fn counter(&mut self, name: &str, help: &str, value: u64) {
        let family = Family::<Labels, Counter>::default();
        family.get_or_create(&self.labels(&[])).inc_by(value);
        self.registry.register(name, help, family);
    }

    /// A gauge with one series per `(labels, value)`.
    fn gauges(&mut self, name: &str, help: &str, unit: Option<Unit>, series: &[(Vec<(&str, &str)>, f64)]) {
        let family = Family::<Labels, FloatGauge>::default();
        for (labels, v) in series {
            family.get_or_create(&self.labels(labels)).set(*v);
        }
        match unit {
            Some(u) => self.registry.register_with_unit(name, help, u, family),
            None => self.registry.register(name, help, family),
        }
    }

    fn gauge(&mut self, name: &str, help: &str, unit: Option<Unit>, value: Option<f64>) {
        let series: Vec<_> = value.into_iter().map(|v| (vec![], v)).collect();
        self.gauges(name, help, unit, &series);
    }
}

/// The metrics of a job, from its last published status; `now_ms` is the wall clock.
pub fn render(status: &JobStatus, now_ms: i64) -> String {
    let mut m = Metrics { registry: Registry::with_prefix("km0"), job: &status.pipeline };
    records(&mut m, status);
    clocks(&mut m, status, now_ms);
    tasks(&mut m, status);
    aggregations(&mut m, status);
    plugin_calls(&mut m, status);
    checkpoints(&mut m, status);
    deploys_and_sink(&mut m, status);
    let mut text = String::new();
    // Writing into a String cannot fail.
    let _ = encode(&mut text, &m.registry);
    text
}

/// The records through the job, and the results per sink.
fn records(m: &mut Metrics<'_>, status: &JobStatus) {
    let c = &status.counters;
    m.counter("records_read", "Records read from the source", c.read);
    m.counter("records_filtered", "Records that did not match the pipeline's filter", c.filtered);
    m.counter("records_accepted", "Events added to a window (summed over aggregations)", c.accepted);
    m.counter("records_late", "Events past every window's allowed lateness (late output)", c.late);
    m.counter("late_updates", "Accepted events whose window had fired already (re-emitted)", c.late_updates);
    m.counter("records_dead_lettered", "Records and results sent to the dead-letter output", c.dead_lettered);
    m.counter("windows_fired", "Window results computed", c.windows_fired);
    m.counter("retractions", "Results retracted (a session's result superseded)", c.retracted);
    let results = Family::<Labels, Counter>::default();
    results.get_or_create(&m.labels(&[("sink", "output")])).inc_by(c.emitted);
    results.get_or_create(&m.labels(&[("sink", "late")])).inc_by(c.late);
    results.get_or_create(&m.labels(&[("sink", "dead_letter")])).inc_by(c.dead_lettered);
    m.registry.register("results_written", "Records written per sink", results);
}

/// The watermark, the event-time lag and each partition's clock and consumer lag.
fn clocks(m: &mut Metrics<'_>, status: &JobStatus, now_ms: i64) {
    let watermark = seconds(status.watermark);
    m.gauge(
        "watermark",
        "The job's watermark (event time), seconds since the epoch",
        Some(Unit::Seconds),
        watermark,
    );
    m.gauge(
        "event_time_lag",
        "Wall clock minus the job's watermark",
        Some(Unit::Seconds),
        watermark.map(|w| now_ms as f64 / 1e3 - w),
    );
    let partitions: Vec<_> = status
        .partitions
        .iter()
        .filter_map(|p| Some((vec![("partition", p.name.as_str())], seconds(p.max_event_time?)?)))
        .collect();
    m.gauges(
        "partition_max_event_time",
        "The largest event time seen per partition (its clock)",
        Some(Unit::Seconds),
        &partitions,
    );
    let idle: Vec<_> = status
        .partitions
        .iter()
        .map(|p| (vec![("partition", p.name.as_str())], if p.idle { 1.0 } else { 0.0 }))
        .collect();
    m.gauges("partition_idle", "1 when the partition is idle (not holding the watermark)", None, &idle);
    let lag: Vec<_> =
        status.lag.iter().map(|l| (vec![("partition", l.partition.as_str())], l.lag as f64)).collect();
    m.gauges("consumer_lag_records", "Records in the log not yet read, per Kafka partition", None, &lag);
}

/// A job whose partitions are tasks: each task's clock, records and windows; in a consumer
/// group, what this process owns and how often that changed.
fn tasks(m: &mut Metrics<'_>, status: &JobStatus) {
    // A job whose partitions are tasks: each task's clock, records and windows.
    let per_task =
        |f: fn(&crate::job::commands::TaskStatus) -> Option<f64>| -> Vec<(Vec<(&str, &str)>, f64)> {
            status.tasks.iter().filter_map(|t| Some((vec![("task", t.task.as_str())], f(t)?))).collect()
        };
    m.gauges(
        "task_watermark",
        "Each task's watermark (its partition's clock), seconds since the epoch",
        Some(Unit::Seconds),
        &per_task(|t| seconds(t.watermark)),
    );
    m.gauges("task_records_read", "Records each task has read", None, &per_task(|t| Some(t.read as f64)));
    m.gauges(
        "task_open_windows",
        "Open window slots per task",
        None,
        &per_task(|t| Some(t.open_windows as f64)),
    );
    m.gauges(
        "task_consumer_lag_records",
        "Records in its Kafka partition each task has not read yet",
        None,
        &per_task(|t| t.lag.map(|l| l as f64)),
    );
    m.gauges("task_thread", "The thread that runs each task", None, &per_task(|t| Some(t.thread as f64)));

    // A job in a consumer group: what this process owns, and how often that changed.
    if let Some(g) = &status.group {
        let owned: Vec<_> = g
            .partitions
            .iter()
            .map(|p| {
                (
                    vec![
                        ("group", g.group.as_str()),
                        ("member", g.member_id.as_str()),
                        ("partition", p.as_str()),
                    ],
                    1.0,
                )
            })
            .collect();
        m.gauges(
            "group_partition_owned",
            "1 for each partition this process owns in the job's consumer group",
            None,
            &owned,
        );
        let changes = Family::<Labels, Counter>::default();
        for (kind, n) in [("assigned", g.assigned), ("revoked", g.revoked)] {
            changes.get_or_create(&m.labels(&[("group", g.group.as_str()), ("change", kind)])).inc_by(n);
        }
        m.registry.register(
            "group_partition_changes",
            "Partitions assigned to and revoked from this process",
            changes,
        );
    }
}

/// Each aggregation's windows, keys, quarantine and state, and the plugin it runs.
fn aggregations(m: &mut Metrics<'_>, status: &JobStatus) {
    let per_aggregation =
        |f: fn(&crate::job::commands::AggregationStatus) -> f64| -> Vec<(Vec<(&str, &str)>, f64)> {
            status.aggregations.iter().map(|a| (vec![("aggregation", a.name.as_str())], f(a))).collect()
        };
    m.gauges(
        "open_windows",
        "Open window slots per aggregation",
        None,
        &per_aggregation(|a| a.open_windows as f64),
    );
    m.gauges("keys", "Keys with open windows per aggregation", None, &per_aggregation(|a| a.keys as f64));
    m.gauges(
        "quarantined_keys",
        "Keys quarantined per aggregation: their events go to the dead letters without a plugin call",
        None,
        &per_aggregation(|a| a.quarantined as f64),
    );
    m.gauges(
        "faulted_keys",
        "Keys whose plugin faults are followed per aggregation (quarantined or not yet; at most `quarantine_max_keys`)",
        None,
        &per_aggregation(|a| a.faulted_keys as f64),
    );
    m.gauges(
        "state",
        "Bytes of accumulators and keys held per aggregation (without the maps' overhead)",
        Some(Unit::Bytes),
        &per_aggregation(|a| a.state_bytes as f64),
    );
    let plugins: Vec<_> = status
        .aggregations
        .iter()
        .map(|a| {
            (
                vec![
                    ("aggregation", a.name.as_str()),
                    ("plugin", a.plugin.as_str()),
                    ("version", a.plugin_version.as_str()),
                ],
                1.0,
            )
        })
        .collect();
    m.gauges("plugin_info", "The plugin each aggregation runs (value 1)", None, &plugins);
    let versions: Vec<_> = status
        .aggregations
        .iter()
        .flat_map(|a| {
            a.tasks_on.iter().map(move |(v, n)| {
                (vec![("aggregation", a.name.as_str()), ("plugin", v.as_str())], *n as f64)
            })
        })
        .collect();
    m.gauges(
        "plugin_tasks",
        "Tasks of this process that run each plugin version (`name version`): one series per aggregation when the job is on one version",
        None,
        &versions,
    );
}

/// Each aggregation's plugin calls: how long they take, which failed; a shadow's verdicts.
fn plugin_calls(m: &mut Metrics<'_>, status: &JobStatus) {
    let calls = CallHistograms(
        status
            .aggregations
            .iter()
            .map(|a| (m.labels(&[("aggregation", a.name.as_str())]), a.calls.clone()))
            .collect(),
    );
    m.registry.register_with_unit(
        "plugin_call",
        "How long plugin calls take (add, merge, finish, migrate: each a whole batch)",
        Unit::Seconds,
        calls,
    );
    let faults = Family::<Labels, Counter>::default();
    for a in &status.aggregations {
        let c = &a.calls;
        for (kind, n) in [
            ("refused", c.refused),
            ("trapped", c.trapped),
            ("timed_out", c.timed_out),
            ("malformed", c.malformed),
        ] {
            faults.get_or_create(&m.labels(&[("aggregation", a.name.as_str()), ("kind", kind)])).inc_by(n);
        }
    }
    m.registry.register("plugin_faults", "Plugin calls that failed, by kind", faults);
    let untracked = Family::<Labels, Counter>::default();
    for a in &status.aggregations {
        untracked.get_or_create(&m.labels(&[("aggregation", a.name.as_str())])).inc_by(a.faults_untracked);
    }
    m.registry.register(
        "faults_untracked",
        "Plugin faults of keys not followed for quarantine (the aggregation followed `quarantine_max_keys` keys)",
        untracked,
    );
    if let Some(s) = &status.shadow {
        let shadow = Family::<Labels, Counter>::default();
        for (result, n) in [("equal", s.equal), ("different", s.different), ("faulted", s.faulted)] {
            shadow.get_or_create(&m.labels(&[("result", result)])).inc_by(n);
        }
        m.registry.register("shadow_windows", "Windows a shadow deploy compared, by result", shadow);
    }
}

/// This run's checkpoints, the newest complete one.
fn checkpoints(m: &mut Metrics<'_>, status: &JobStatus) {
    let history = &status.checkpoint_history;
    let failed = history.iter().filter(|c| c.status == CheckpointStatus::Failed).count() as u64;
    m.counter("checkpoints", "Checkpoints taken by this run", status.checkpoints);
    m.counter("checkpoints_failed", "Checkpoints of this run that failed (of the newest 50)", failed);
    let last = history.iter().rev().find(|c| c.status == CheckpointStatus::Complete);
    m.gauge(
        "last_checkpoint_pause",
        "How long processing stopped for the newest complete checkpoint",
        Some(Unit::Seconds),
        last.map(|c| c.pause_ms / 1e3),
    );
    m.gauge(
        "last_checkpoint_write",
        "From capture to durable, for the newest complete checkpoint",
        Some(Unit::Seconds),
        last.and_then(|c| c.write_ms).map(|ms| ms / 1e3),
    );
    m.gauge(
        "last_checkpoint_size",
        "Bytes of the newest complete checkpoint's folder",
        Some(Unit::Bytes),
        last.and_then(|c| c.bytes).map(|b| b as f64),
    );
    m.gauge(
        "last_checkpoint_id",
        "Number of the newest complete checkpoint (chk-N)",
        None,
        last.and_then(|c| c.id.strip_prefix("chk-")?.parse::<f64>().ok()),
    );
}

/// Live deploys, backpressure, the sink's backlog and the uptime.
fn deploys_and_sink(m: &mut Metrics<'_>, status: &JobStatus) {
    let mut swaps = status.deployments.iter().filter(|d| d.status == DeployStatus::Swapped);
    m.counter("plugin_swaps", "Live plugin deploys swapped in", swaps.clone().count() as u64);
    m.counter(
        "plugin_deploys_refused",
        "Live plugin deploys refused",
        status.deployments.iter().filter(|d| d.status == DeployStatus::Refused).count() as u64,
    );
    m.gauge(
        "last_swap_pause",
        "How long processing stopped for the last live swap",
        Some(Unit::Seconds),
        swaps.next_back().map(|d| d.pause_ms / 1e3),
    );
    m.counter(
        "backpressure_pauses",
        "Times the source was paused because the sink was behind",
        status.backpressure_pauses,
    );
    let paused = Family::<Labels, Counter<f64, AtomicU64>>::default();
    paused.get_or_create(&m.labels(&[])).inc_by(status.backpressure_seconds);
    m.registry.register_with_unit(
        "backpressure",
        "Time the source spent paused for the sink",
        Unit::Seconds,
        paused,
    );
    m.gauge(
        "sink_in_flight_records",
        "Records the sink has sent and not yet seen acknowledged (Kafka)",
        None,
        status.sink_in_flight.map(|n| n as f64),
    );
    m.gauge("uptime", "Time since the job started", Some(Unit::Seconds), Some(status.uptime_ms as f64 / 1e3));
}

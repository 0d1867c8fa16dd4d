//! What reaches a running job from outside (the control API): commands, which the loop
//! takes between two records, and the status it publishes a few times a second.

use super::Counters;
use crate::plugin::PluginIdentity;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How a stop ends the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopMode {
    /// Write a savepoint with the open windows (resume from it later).
    Savepoint,
    /// Fire every open window, as at the end of a bounded input.
    Drain,
}

/// A command to a running job; the reply says what became of it.
pub enum Command {
    /// Write a savepoint now and go on.
    Savepoint { reply: Sender<Result<PathBuf, Refused>> },
    /// Stop; with a savepoint, its path.
    Stop { mode: StopMode, reply: Sender<Result<Option<PathBuf>, Refused>> },
    /// Swap in a new plugin (prepared off the job's thread by [`super::deployment::Deployer`]).
    Deploy { deployment: super::deployment::Deployment, reply: Sender<Result<Deployed, Refused>> },
    /// The first phase of a deploy into a job of tasks: check at the next record boundary
    /// that the new plugin takes this task's state (key fields, held rows, every
    /// accumulator migrated and thrown away), swapping nothing; the deployment comes back
    /// when it does, for the second phase's [`Command::Deploy`].
    Prepare {
        deployment: super::deployment::Deployment,
        reply: Sender<Result<super::deployment::Deployment, Refused>>,
    },
    /// Run a new plugin as a shadow of the current one (job/shadow.rs).
    Shadow { deployment: super::deployment::Deployment, reply: Sender<Result<ShadowStatus, Refused>> },
    /// Swap the shadow in (a live deploy with warm accumulators).
    Promote { reply: Sender<Result<Deployed, Refused>> },
    /// Drop the shadow.
    Abandon { reply: Sender<Result<ShadowStatus, Refused>> },
    /// Release quarantined keys: of one aggregation or all, one key (its fields) or all;
    /// the reply says how many were released.
    Release { aggregation: Option<String>, key: Option<Vec<String>>, reply: Sender<Result<usize, Refused>> },
}

impl Command {
    /// Answer without carrying it out (the job has stopped, or is stopping).
    pub fn refuse(self, why: &str) {
        let refused = Refused::Closed(why.to_string());
        match self {
            Command::Savepoint { reply } => drop(reply.send(Err(refused))),
            Command::Stop { reply, .. } => drop(reply.send(Err(refused))),
            Command::Deploy { reply, .. } => drop(reply.send(Err(refused))),
            Command::Prepare { reply, .. } => drop(reply.send(Err(refused))),
            Command::Release { reply, .. } => drop(reply.send(Err(refused))),
            Command::Shadow { reply, .. } => drop(reply.send(Err(refused))),
            Command::Promote { reply } => drop(reply.send(Err(refused))),
            Command::Abandon { reply } => drop(reply.send(Err(refused))),
        }
    }
}

/// A command that was refused or failed, and why (the control API says it with an HTTP
/// status of its choosing).
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    /// A plugin or component that cannot take the job's state: the job goes on unchanged.
    #[error(transparent)]
    Upgrade(#[from] super::upgrade::Refusal),
    /// The job is stopping or has stopped.
    #[error("{0}")]
    Closed(String),
    /// The command was carried out and failed (a savepoint that could not be written).
    #[error("{0}")]
    Failed(String),
    /// What the command names is not there (an aggregation).
    #[error("{0}")]
    NotFound(String),
}

/// What a running job is doing (`starting` until its first status is published).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum JobState {
    #[default]
    Starting,
    Running,
    Stopping,
    Stopped,
}

impl std::fmt::Display for JobState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            JobState::Starting => "starting",
            JobState::Running => "running",
            JobState::Stopping => "stopping",
            JobState::Stopped => "stopped",
        })
    }
}

/// What became of a live deploy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeployStatus {
    Swapped,
    Refused,
    /// A shadow swapped in (`--promote`).
    Promoted,
    /// Swapped, then rolled back by the job (its plugin failed too often): `reason` says
    /// how often.
    #[serde(rename = "rolled_back")]
    RolledBack,
}

/// Where a checkpoint is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CheckpointStatus {
    Writing,
    Complete,
    Failed,
}

/// One entry of a job's deploy history.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Deployed {
    /// 1, 2, ... in this run.
    pub id: u64,
    /// When the swap (or the refusal) happened, epoch ms.
    pub at_ms: i64,
    pub status: DeployStatus,
    /// Why it was refused.
    pub reason: Option<String>,
    /// The aggregations whose plugin was replaced.
    pub aggregations: Vec<String>,
    /// What ran before, per aggregation, and what runs now.
    pub from: Vec<crate::plugin::PluginIdentity>,
    pub to: crate::plugin::PluginIdentity,
    /// State schema migrations done: (aggregation, from, to).
    pub migrated: Vec<(String, u32, u32)>,
    /// Records read when the swap happened: the new plugin sees every record after it.
    pub at_record: u64,
    /// The rollback point: a savepoint of the job just before the swap (old plugin).
    pub savepoint: Option<PathBuf>,
    /// The checkpoint taken just after the swap (new plugin); the reply comes once it is
    /// durable, so a crash from then on recovers with the new plugin.
    pub checkpoint: Option<String>,
    /// The longest gap between two records around the swap: processing stopped this long.
    pub pause_ms: f64,
    /// Of which: the rollback savepoint, and migrating and loading the state.
    pub savepoint_ms: f64,
    pub swap_ms: f64,
    /// Reading, compiling, instantiating and configuring the new plugin (off the job's
    /// thread, while it ran).
    pub prepare_ms: f64,
    /// Watched for an automatic rollback: the share of faults that rolls it back (none:
    /// not watched, `watch` says why).
    pub rollback_fault_rate: Option<f64>,
    /// Whether the job watches the new plugin's first events, or why not.
    pub watch: String,
}

/// One partition's event-time clock.
#[derive(Debug, Clone, Serialize)]
pub struct PartitionStatus {
    pub name: String,
    pub max_event_time: Option<i64>,
    pub idle: bool,
    pub finished: bool,
}

/// One aggregation.
#[derive(Debug, Clone, Serialize)]
pub struct AggregationStatus {
    pub name: String,
    pub plugin: String,
    pub plugin_version: String,
    /// SHA-256 of the component it runs.
    pub plugin_sha256: String,
    pub contract: String,
    pub open_windows: usize,
    pub keys: usize,
    /// Bytes of accumulators and keys held (without the maps' overhead).
    pub state_bytes: usize,
    /// Its plugin's calls since it was loaded (or swapped in).
    pub calls: crate::plugin::CallStats,
    /// Keys quarantined: their events go to the dead letters without a call.
    pub quarantined: usize,
    /// Up to [`crate::window::operator::QUARANTINE_LISTED`] of them, the latest first.
    pub quarantined_keys: Vec<crate::window::operator::KeyFaults>,
    /// Keys whose faults are followed (quarantined or not yet), at most `[plugin]
    /// quarantine_max_keys`.
    pub faulted_keys: usize,
    /// Faults of keys not followed because as many were: dead-lettered, never
    /// quarantined.
    pub faults_untracked: u64,
    /// How many of the job's tasks run each plugin version (`name version`): one entry
    /// when every task is on the same one, which is the job's version.
    pub tasks_on: std::collections::BTreeMap<String, usize>,
}

/// One checkpoint of this run.
#[derive(Debug, Clone, Serialize)]
pub struct CheckpointInfo {
    /// Its folder in the checkpoint store (`chk-000001`).
    pub id: String,
    /// When it was taken, epoch ms.
    pub taken_at_ms: i64,
    /// How long processing stopped to capture it.
    pub pause_ms: f64,
    /// From capture to durable (when complete).
    pub write_ms: Option<f64>,
    /// Bytes of its folder (when complete; RocksDB's files are shared with other
    /// checkpoints).
    pub bytes: Option<u64>,
    pub status: CheckpointStatus,
}

/// What a running job looks like, published by its loop.
#[derive(Debug, Clone, Default, Serialize)]
pub struct JobStatus {
    pub state: JobState,
    pub pipeline: String,
    pub uptime_ms: u64,
    /// The run summary's counters (`read`, `filtered`, `accepted`, `late`, ...).
    pub counters: Counters,
    pub watermark: i64,
    pub partitions: Vec<PartitionStatus>,
    /// Consumer lag per partition (Kafka sources), as last fetched.
    pub lag: Vec<crate::source::kafka::PartitionLag>,
    pub aggregations: Vec<AggregationStatus>,
    pub checkpoints: u64,
    /// The newest checkpoints of this run (at most [`CHECKPOINT_HISTORY`]), oldest first.
    pub checkpoint_history: Vec<CheckpointInfo>,
    pub last_savepoint: Option<PathBuf>,
    /// The savepoints of this run (the newest [`CHECKPOINT_HISTORY`]), oldest first.
    pub savepoints: Vec<PathBuf>,
    /// Live deploys of this run (swapped or refused), oldest first.
    pub deployments: Vec<Deployed>,
    /// Records read per second over the last seconds.
    pub records_per_second: f64,
    /// How far a bounded file input has been read: bytes read and bytes in its files.
    pub progress: Option<(u64, u64)>,
    /// The latest late events' and dead letters' reasons, oldest first.
    pub recent_side_outputs: Vec<SideRecord>,
    /// Times the source was paused because the sink was behind, and for how long.
    pub backpressure_pauses: u64,
    pub backpressure_seconds: f64,
    /// Records the sink has sent and not yet seen acknowledged (Kafka).
    pub sink_in_flight: Option<u64>,
    /// `[epoch ms, records read]` about every second over the last 5 minutes, oldest
    /// first (the UI's throughput chart).
    pub throughput: Vec<(i64, u64)>,
    /// The job's tasks, when its partitions are tasks (`watermark = "per-partition"`):
    /// in a consumer group, those this process owns.
    pub tasks: Vec<TaskStatus>,
    /// This process in the job's consumer group, when it shares its partitions with one.
    pub group: Option<GroupStatus>,
    /// A new plugin version running as a shadow, and what it found.
    pub shadow: Option<ShadowStatus>,
}

/// A process's membership of its job's consumer group.
#[derive(Debug, Clone, Default, Serialize)]
pub struct GroupStatus {
    pub group: String,
    /// The id the group coordinator gave this process (empty until it joined).
    pub member_id: String,
    /// The partitions this process owns (`topic/partition`).
    pub partitions: Vec<String>,
    /// Partitions assigned to it and revoked from it since it started.
    pub assigned: u64,
    pub revoked: u64,
}

/// One task of a job whose partitions are tasks.
#[derive(Debug, Clone, Serialize)]
pub struct TaskStatus {
    pub task: String,
    /// The partition it reads (a file, `topic/partition`).
    pub partition: String,
    /// The thread that runs it (0 to parallelism - 1).
    pub thread: usize,
    pub state: JobState,
    /// Its own event-time clock.
    pub watermark: i64,
    pub read: u64,
    pub records_per_second: f64,
    pub open_windows: usize,
    /// Consumer lag of its partition (Kafka), as last fetched.
    pub lag: Option<i64>,
    /// The plugin each aggregation runs, `name version` (a deploy reaches tasks one by
    /// one).
    pub plugins: Vec<String>,
}

/// A late event's or dead letter's reason, among the latest.
#[derive(Debug, Clone, Serialize)]
pub struct SideRecord {
    /// When the last one with this reason came, epoch ms.
    pub at_ms: i64,
    /// `late`, `dead_letter`, or `plugin_output` (what a plugin wrote to stdout or
    /// stderr).
    pub output: &'static str,
    pub reason: String,
    pub aggregation: Option<String>,
    /// How many in a row had this reason.
    pub count: u64,
}

impl JobStatus {
    /// Add a task's status to the job's (`first`: the first task added; its line in
    /// `tasks` is there already): counters and gauges summed, the watermark the
    /// slowest task's, partitions, lag and histories joined.
    pub fn add_task(&mut self, s: &JobStatus, first: bool) {
        self.counters.add(&s.counters);
        self.watermark = if first { s.watermark } else { self.watermark.min(s.watermark) };
        self.partitions.extend(s.partitions.iter().cloned());
        self.lag.extend(s.lag.iter().cloned());
        for a in &s.aggregations {
            match self.aggregations.iter_mut().find(|j| j.name == a.name) {
                Some(j) => j.add(a),
                None => self.aggregations.push(a.clone()),
            }
        }
        self.checkpoints += s.checkpoints;
        self.checkpoint_history.extend(s.checkpoint_history.iter().cloned());
        self.progress = match (self.progress, s.progress) {
            (Some((a, b)), Some((c, d))) => Some((a + c, b + d)),
            (None, p) if self.tasks.len() == 1 => p,
            _ => None,
        };
        self.recent_side_outputs.extend(s.recent_side_outputs.iter().cloned());
        self.backpressure_pauses += s.backpressure_pauses;
        self.backpressure_seconds += s.backpressure_seconds;
        self.sink_in_flight = match (self.sink_in_flight, s.sink_in_flight) {
            (Some(a), Some(b)) => Some(a + b),
            (a, b) => a.or(b),
        };
    }

    /// Once every task is added: the newest checkpoints and side records, as many as a
    /// job of one task keeps.
    pub fn keep_newest(&mut self) {
        self.checkpoint_history.sort_by_key(|c| c.taken_at_ms);
        let keep = self.checkpoint_history.len().saturating_sub(CHECKPOINT_HISTORY);
        self.checkpoint_history.drain(..keep);
        self.recent_side_outputs.sort_by_key(|r| r.at_ms);
        let keep = self.recent_side_outputs.len().saturating_sub(RECENT_SIDE_RECORDS);
        self.recent_side_outputs.drain(..keep);
    }
}

impl AggregationStatus {
    /// Add another task's state of the same aggregation (the latest quarantined keys of
    /// both listed).
    pub fn add(&mut self, a: &AggregationStatus) {
        for (version, n) in &a.tasks_on {
            *self.tasks_on.entry(version.clone()).or_default() += n;
        }
        self.open_windows += a.open_windows;
        self.keys += a.keys;
        self.state_bytes += a.state_bytes;
        self.quarantined += a.quarantined;
        self.faulted_keys += a.faulted_keys;
        self.faults_untracked += a.faults_untracked;
        self.quarantined_keys.extend(a.quarantined_keys.iter().cloned());
        self.quarantined_keys.sort_by_key(|q| std::cmp::Reverse(q.at_ms));
        self.quarantined_keys.truncate(crate::window::operator::QUARANTINE_LISTED);
    }
}

/// Late events and dead letters kept in the status.
pub const RECENT_SIDE_RECORDS: usize = 10;

/// How long the throughput history goes back.
pub const THROUGHPUT_WINDOW_MS: i64 = 300_000;

/// Records read, sampled about every second for the last [`THROUGHPUT_WINDOW_MS`]: the
/// status's throughput history and rate, the same for a job of one task or of many.
#[derive(Debug, Default)]
pub struct Throughput {
    samples: std::collections::VecDeque<(i64, u64)>,
}

impl Throughput {
    /// `read` records at `now_ms` (kept when a second has passed since the last sample).
    pub fn sample(&mut self, now_ms: i64, read: u64) {
        if self.samples.back().is_some_and(|&(t, _)| now_ms - t < 1000) {
            return;
        }
        self.samples.push_back((now_ms, read));
        while self.samples.front().is_some_and(|&(t, _)| now_ms - t > THROUGHPUT_WINDOW_MS) {
            self.samples.pop_front();
        }
    }

    /// Records per second over the last (up to) five intervals (0 when records went back,
    /// as after a rollback).
    pub fn rate(&self) -> f64 {
        let n = self.samples.len();
        match (self.samples.get(n.saturating_sub(6)), self.samples.back()) {
            (Some(&(t0, r0)), Some(&(t1, r1))) if t1 > t0 => {
                r1.saturating_sub(r0) as f64 * 1e3 / (t1 - t0) as f64
            }
            _ => 0.0,
        }
    }

    /// The samples, oldest first.
    pub fn history(&self) -> Vec<(i64, u64)> {
        self.samples.iter().copied().collect()
    }
}

/// Checkpoints kept in a job's published history.
pub const CHECKPOINT_HISTORY: usize = 50;

/// The job's end of the control port: its commands and its published status (replaced
/// whole at each publish, so that a reader holds the lock only to clone an `Arc`).
pub struct ControlPort {
    pub commands: Mutex<Receiver<Command>>,
    pub status: Mutex<Arc<JobStatus>>,
}

/// Shared by the job (which takes commands) and the API (which sends them).
#[derive(Clone)]
pub struct ControlHandle {
    pub port: Arc<ControlPort>,
    pub sender: Sender<Command>,
    /// Calls waiting for a reply or still answering: the process waits for them before
    /// it exits, so that the caller of a stop gets its answer.
    pub answering: Arc<std::sync::atomic::AtomicUsize>,
    /// Prepares live deploys (none: the API refuses them).
    pub deployer: Option<Arc<super::deployment::Deployer>>,
    /// A live deploy is being prepared or swapped: a second one is refused.
    pub deploying: Arc<std::sync::atomic::AtomicBool>,
    /// The job has stopped taking commands: calls are answered at once.
    pub closed: Arc<std::sync::atomic::AtomicBool>,
}

impl std::fmt::Debug for ControlHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ControlHandle")
    }
}

impl ControlHandle {
    pub fn new() -> ControlHandle {
        let (sender, receiver) = std::sync::mpsc::channel();
        let port = ControlPort {
            commands: Mutex::new(receiver),
            status: Mutex::new(Arc::new(JobStatus::default())),
        };
        ControlHandle {
            port: Arc::new(port),
            sender,
            answering: Arc::default(),
            deployer: None,
            deploying: Arc::default(),
            closed: Arc::default(),
        }
    }

    /// The job takes no more commands: every call under way or still arriving is answered
    /// (a command waiting, or sent meanwhile, is refused: the job has stopped). Waits until
    /// none is left, up to [`CLOSE_WAIT`] (a deploy still being compiled finishes first).
    pub fn close(&self) {
        use std::sync::atomic::Ordering;
        self.closed.store(true, Ordering::SeqCst);
        let t = std::time::Instant::now();
        loop {
            self.refuse_waiting("the job has stopped");
            if self.answering.load(Ordering::SeqCst) == 0 || t.elapsed() >= CLOSE_WAIT {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        // The last answer's bytes leave the socket right after its handler returns.
        std::thread::sleep(Duration::from_millis(50));
    }

    /// Refuse the commands waiting to be taken.
    pub fn refuse_waiting(&self, why: &str) {
        let Ok(rx) = self.port.commands.lock() else { return };
        while let Ok(command) = rx.try_recv() {
            command.refuse(why);
        }
    }

    /// The last published status.
    pub fn status(&self) -> Arc<JobStatus> {
        self.port.status.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Publish a new status.
    pub fn publish(&self, status: JobStatus) {
        if let Ok(mut s) = self.port.status.lock() {
            *s = Arc::new(status);
        }
    }

    /// Change the published status's state (`stopping`, `stopped`).
    pub fn set_state(&self, state: JobState) {
        if let Ok(mut s) = self.port.status.lock() {
            Arc::make_mut(&mut s).state = state;
        }
    }
}

/// How long a stopping process waits for the calls under way to be answered.
pub const CLOSE_WAIT: Duration = Duration::from_secs(30);

impl Default for ControlHandle {
    fn default() -> Self {
        Self::new()
    }
}

/// How often the loop publishes its status.
pub const STATUS_EVERY: Duration = Duration::from_millis(250);

/// What a shadow has found so far (the status's `shadow`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ShadowStatus {
    /// The deploy it came with (its number in the deploy history).
    pub id: u64,
    pub aggregations: Vec<String>,
    pub from: Vec<PluginIdentity>,
    pub to: PluginIdentity,
    /// Records read when it started, and when (epoch ms).
    pub since_record: u64,
    pub at_ms: i64,
    /// Windows compared (every window the shadow fired, and every window the current
    /// plugin wrote a result for), and of them: equal, different, faulted (the shadow
    /// failed on the window's result or on one of its events); they add up.
    pub windows: u64,
    pub equal: u64,
    pub different: u64,
    pub faulted: u64,
    /// Events the shadow failed on (dead-lettered by it, for a fault or a quarantine).
    pub failed_events: u64,
    /// Where every difference is written (one JSON line each).
    pub differences_file: Option<PathBuf>,
    /// The latest differences.
    pub recent_differences: Vec<ShadowDifference>,
    /// Why the shadow stopped comparing (it cannot be promoted then).
    pub failed: Option<String>,
    /// Seconds the shadow's calls took, and the current plugin's over the same events
    /// (since this run started it).
    #[serde(default)]
    pub call_seconds: f64,
    #[serde(default)]
    pub current_call_seconds: f64,
}

/// One window whose results differ.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ShadowDifference {
    pub deploy: u64,
    pub aggregation: String,
    /// The result key (`[aggregation|]window start|key fields`).
    pub key: String,
    /// What the current plugin wrote, and what the shadow would have (none: no result).
    pub current: Option<String>,
    pub shadow: Option<String>,
    /// The shared fields that differ (empty: one side wrote no result).
    pub fields: Vec<String>,
}

/// The reply to a stop: the savepoint it wrote, if any.
pub type StopReply = Sender<Result<Option<PathBuf>, Refused>>;

#[cfg(test)]
mod tests {
    use super::Throughput;

    #[test]
    fn a_job_of_tasks_sums_its_tasks_and_keeps_the_slowest_watermark() {
        let task = |read: u64, watermark: i64, windows: usize| {
            let mut s = super::JobStatus { watermark, ..Default::default() };
            s.counters.read = read;
            s.checkpoints = 1;
            s.aggregations.push(super::AggregationStatus {
                name: "a".into(),
                plugin: "min-stock".into(),
                plugin_version: "0.1.0".into(),
                plugin_sha256: String::new(),
                contract: String::new(),
                open_windows: windows,
                keys: windows,
                state_bytes: 10,
                calls: Default::default(),
                quarantined: 1,
                quarantined_keys: Vec::new(),
                faulted_keys: 2,
                faults_untracked: 3,
                tasks_on: [("min-stock 0.1.0".to_string(), 1)].into(),
            });
            s
        };
        let mut job = super::JobStatus::default();
        job.add_task(&task(100, 5_000, 3), true);
        job.add_task(&task(50, 4_000, 4), false);
        job.add_task(&task(10, 9_000, 0), false);
        job.keep_newest();
        assert_eq!(job.counters.read, 160);
        assert_eq!(job.watermark, 4_000);
        assert_eq!(job.checkpoints, 3);
        let a = &job.aggregations[0];
        assert_eq!(job.aggregations.len(), 1);
        assert_eq!((a.open_windows, a.keys, a.state_bytes), (7, 7, 30));
        assert_eq!((a.quarantined, a.faulted_keys, a.faults_untracked), (3, 6, 9));
    }

    #[test]
    fn throughput_is_the_rate_over_the_last_five_seconds_and_never_negative() {
        let mut t = Throughput::default();
        assert_eq!(t.rate(), 0.0);
        // 100 records a second for 3 s, then 400 a second for 5 s (hand-counted).
        for s in 0..=3i64 {
            t.sample(s * 1000, s as u64 * 100);
        }
        t.sample(3500, 999_999); // within a second of the last sample: not kept
        for s in 4..=8i64 {
            t.sample(s * 1000, 300 + (s as u64 - 3) * 400);
        }
        assert_eq!(t.history().len(), 9);
        // From 3 s (300) to 8 s (2 300): 2 000 records in 5 s.
        assert_eq!(t.rate(), 400.0);
        // A rollback: fewer records read than before.
        t.sample(9000, 50);
        assert_eq!(t.history().last(), Some(&(9000, 50)));
        assert!(t.rate() >= 0.0);
        // Samples older than five minutes go.
        t.sample(9000 + super::THROUGHPUT_WINDOW_MS, 60);
        assert_eq!(t.history().first(), Some(&(9000, 50)));
    }
}

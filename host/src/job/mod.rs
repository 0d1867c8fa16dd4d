//! A running job: the single-threaded loop that takes records from the source, decodes
//! and routes them (filtered, dead letter, late, accepted), feeds each aggregation's
//! [`WindowOperator`], advances the watermarks, and writes results and side outputs;
//! plus starting from and stopping with savepoints.
//!
//! Every aggregation of a pipeline reads the same decoded event: one parse serves all.
//!
//! - this module: the API (`run`, `deploy`, `validate`) and what a run reports.
//!
//! Its files, from the bottom up (each uses only files above it in this list; CI checks
//! it with `scripts/module-cycles.py --files`):
//! - [`upgrade`], [`signals`], [`lag`]: the rules a plugin must pass to take over a job's
//!   state; signals; the consumer lag's log line;
//! - [`deployment`]: a live deploy's new plugin, prepared off the job's thread;
//! - [`commands`]: the control port's protocol and the status it publishes;
//! - [`ledger`]: what the control port keeps across restarts (history, probation);
//! - [`build`]: a job's parts built from its pipeline (window operators, the results'
//!   fingerprint, idleness);
//! - [`shadow`]: a new plugin running beside the current one;
//! - [`engine`]: the part of a running job one record touches ([`engine::Engine`]: decoder,
//!   operators, watermarks, sinks) and what happens to that record (routing, side outputs);
//! - [`snapshot`]: the engine's state captured for checkpoints and savepoints, and restored;
//! - [`checkpoints`]: periodic checkpoints and savepoints, taken between records;
//! - [`swap`]: live deploys and shadows started, promoted and abandoned;
//! - [`running`]: a running job as one object ([`RunningJob`]: open, step, savepoint,
//!   swap, finish), with the control port as a [`running::Port`];
//! - [`port`]: the loop's side of the control API (commands, status);
//! - [`membership`], [`tasks`]: a consumer group's share, and the tasks of a job of one
//!   task per partition;
//! - [`fan`]: the control port of a job of tasks (each command fanned out to the tasks);
//! - [`threads`]: the threads that run the tasks, and the job's summary of theirs.
//!
//! [`WindowOperator`]: crate::window::operator::WindowOperator

mod build;
mod checkpoints;
pub mod commands;
pub mod deployment;
mod engine;
mod fan;
mod group_deploy;
mod group_savepoint;
mod lag;
mod ledger;
mod membership;
mod port;
mod running;
pub mod shadow;
pub mod signals;
mod snapshot;
pub mod swap;
mod tasks;
mod threads;
pub mod upgrade;

use engine::Engine;
use running::RunningJob;
use upgrade::Refusal;

use crate::checkpoint::components::Component;
use crate::checkpoint::savepoint;
use crate::checkpoint::store::{self, Checkpoints, SnapshotStore};
use crate::checkpoint::Savepoint;
use crate::pipeline::Pipeline;
use crate::plugin::{Plugin, PluginIdentity, PluginRuntime};
use crate::source::kafka::PartitionLag;
use crate::source::Source;
pub use crate::state::saved::Counters;
use crate::window::operator::OperatorCounters;
use crate::{Error, Result};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub use crate::source::decode::MAX_FIELDS;
pub use engine::{MAX_FIELD_PARTITIONS, MAX_PARTITION_NAME};

/// Command-line overrides of a run.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Replace the file source's path (one partition).
    pub input: Option<PathBuf>,
    /// Replace the sink with this file.
    pub output: Option<PathBuf>,
    /// Process this many records, write a savepoint and stop.
    pub stop_with_savepoint_after: Option<u64>,
    /// Where new savepoints go (default: the pipeline's `savepoints.dir`).
    pub savepoint_dir: Option<PathBuf>,
    /// Resume from this savepoint.
    pub from_savepoint: Option<PathBuf>,
    /// Read the input as it grows (overrides `source.follow`).
    pub follow: Option<bool>,
    /// Start fresh even if the pipeline's checkpoint folder holds checkpoints.
    pub no_recover: bool,
    /// The control API's port into the job (commands, status).
    pub control: Option<commands::ControlHandle>,
    /// Threads that run the job's tasks (`--parallelism`; overrides `[job] parallelism`).
    pub parallelism: Option<usize>,
    /// A task of a job that shares its partitions with a consumer group: its offsets are
    /// committed through the process's member, and a stop signal is the member's to act
    /// on (it hands the tasks over), not the task's.
    pub committer: Option<crate::source::group::Committer>,
    /// In a group: the group's last completed stop when this process started (its
    /// savepoint id). A savepoint the group starts from is restored once per task after
    /// it: a group stopped and started again from the same savepoint restores it again,
    /// a process that joins or restarts meanwhile does not.
    pub since_stop: Option<String>,
}

/// One aggregation at the end of a run.
#[derive(Debug, Clone)]
pub struct OperatorSummary {
    pub name: String,
    pub plugin: PluginIdentity,
    pub counters: OperatorCounters,
    /// Slots still open (0 after end of input; in the savepoint otherwise).
    pub open_slots: usize,
    pub keys: usize,
}

/// How a run ended.
#[derive(Debug, Clone, Default)]
pub struct Summary {
    pub counters: Counters,
    pub operators: Vec<OperatorSummary>,
    /// Slots still open, over all aggregations.
    pub open_windows: usize,
    pub watermark: i64,
    /// The savepoint written, when the run stopped with one.
    pub savepoint: Option<PathBuf>,
    /// State schema migrations done at start: (aggregation, from, to).
    pub migrated: Vec<(String, u32, u32)>,
    /// The first aggregation's plugin.
    pub plugin: PluginIdentity,
    /// Records read by this run (not counting those before a resume).
    pub records_this_run: u64,
    /// Wall time of the processing loop.
    pub elapsed: Duration,
    /// CPU time of the processing thread during the loop.
    pub cpu: Duration,
    /// The checkpoint this run recovered from.
    pub recovered_from: Option<String>,
    /// Time to read and load the savepoint or checkpoint it started from.
    pub restore_time: Duration,
    /// Checkpoints taken by this run, and how long processing stopped for them.
    pub checkpoints: u64,
    pub checkpoint_pause_max: Duration,
    pub checkpoint_pause_total: Duration,
    /// How long processing stopped to write the final savepoint.
    pub savepoint_pause: Duration,
    /// Consumer lag per partition at the end of the run (Kafka sources).
    pub lag: Vec<PartitionLag>,
    /// Times the source was paused because a sink was behind (backpressure).
    pub backpressure_pauses: u64,
}

impl Summary {
    /// Add another task's summary: counters summed, the slowest watermark, the longest
    /// pauses and restore (the caller sets the job's CPU time, clock and savepoint).
    pub fn add(&mut self, s: Summary) {
        self.counters.add(&s.counters);
        for (o, p) in self.operators.iter_mut().zip(&s.operators) {
            o.counters.add(&p.counters);
            o.open_slots += p.open_slots;
            o.keys += p.keys;
        }
        self.open_windows += s.open_windows;
        self.watermark = self.watermark.min(s.watermark);
        self.migrated.extend(s.migrated);
        self.records_this_run += s.records_this_run;
        self.recovered_from = self.recovered_from.take().or(s.recovered_from);
        self.restore_time = self.restore_time.max(s.restore_time);
        self.checkpoints += s.checkpoints;
        self.checkpoint_pause_max = self.checkpoint_pause_max.max(s.checkpoint_pause_max);
        self.checkpoint_pause_total += s.checkpoint_pause_total;
        self.savepoint_pause = self.savepoint_pause.max(s.savepoint_pause);
        self.lag.extend(s.lag);
        self.backpressure_pauses += s.backpressure_pauses;
    }
}

/// How the job's plugins relate to the state it starts from.
enum Upgrade {
    /// Same logic: state schemas must match.
    Resume,
    /// `km0 deploy`: a new version of the plugin with this name, state migrated.
    Deploy(String),
}

/// Run a pipeline (fresh, or resumed from `opts.from_savepoint`): one task, or a task per
/// partition ([`tasks`]).
pub fn run(pipeline: &Pipeline, opts: &RunOptions, runtime: &PluginRuntime) -> Result<Summary> {
    let fetched = local_savepoint(pipeline, opts.from_savepoint.as_deref())?;
    let opts = &RunOptions { from_savepoint: fetched, ..opts.clone() };
    if tasks::per_partition(pipeline) {
        return threads::run(pipeline, opts, &|p, o| open(p, o, runtime));
    }
    tasks::check_one_task(pipeline, opts)?;
    // A rollback the last run left under way is carried out before anything else.
    let job = match ledger::Rollback::marked(pipeline, opts.from_savepoint.is_some(), opts.no_recover)? {
        Some(r) => roll_back(pipeline, opts, runtime, &r)?,
        None => open(pipeline, opts, runtime)?,
    };
    run_rolling_back(job, pipeline, opts, runtime)
}

/// Run a job to its end; a live deploy it rolls back makes it go on from the deploy's
/// rollback savepoint, with the plugin it ran before (recorded in that savepoint).
fn run_rolling_back<'p>(
    job: RunningJob<'p>,
    pipeline: &'p Pipeline,
    opts: &RunOptions,
    runtime: &PluginRuntime,
) -> Result<Summary> {
    let mut job = job;
    loop {
        match job.run()? {
            running::Ran::Finished(summary) => return Ok(*summary),
            running::Ran::RolledBack(r) => job = roll_back(pipeline, opts, runtime, &r)?,
        }
    }
}

/// Roll a live deploy back: marked as under way first (a crash from here carries it out
/// again), the result sink taken back to the rollback savepoint, then the job opened from
/// that savepoint with the plugin it ran before, and checkpointed at once (a crash from
/// then on recovers into that plugin); then the mark is removed.
fn roll_back<'p>(
    pipeline: &'p Pipeline,
    opts: &RunOptions,
    runtime: &PluginRuntime,
    r: &ledger::Rollback,
) -> Result<RunningJob<'p>> {
    r.mark(pipeline)?;
    if opts.output.is_none() {
        crate::sink::rewind(&pipeline.sink, &pipeline.instance_name(), &r.rewind)?;
    }
    let opts = RunOptions { from_savepoint: Some(r.savepoint.clone()), ..opts.clone() };
    let mut job = open(pipeline, &opts, runtime)?;
    job.rolled_back(r)?;
    ledger::Rollback::unmark(pipeline);
    tracing::info!(savepoint = %r.savepoint.display(), "rolled back: the job goes on from the rollback savepoint");
    Ok(job)
}

/// Open a job (or one task of it): from the savepoint given, else from its newest
/// checkpoint, else fresh.
fn open<'p>(pipeline: &'p Pipeline, opts: &RunOptions, runtime: &PluginRuntime) -> Result<RunningJob<'p>> {
    let t0 = Instant::now();
    let restore = match (&opts.from_savepoint, &pipeline.checkpoints) {
        (Some(sp), Some(c)) if opts.committer.is_some() => restore_in_group(pipeline, opts, sp, c)?,
        (Some(sp), _) => Some(Restore { savepoint: savepoint::read(sp)?, checkpoint: None }),
        (None, Some(c)) if !opts.no_recover => {
            let store = Checkpoints::open(&c.dir, c.remote.as_deref())?;
            if opts.committer.is_some() {
                take_task(pipeline, &store)?;
            }
            recover(pipeline, opts, &store)?
        }
        _ => None,
    };
    let plugins = load_plugins(pipeline, runtime, restore.as_ref().map(|r| &r.savepoint), None)?;
    let savepoint_dir = restore.as_ref().map(|r| r.savepoint.path.clone());
    let mut job = RunningJob::open(pipeline, opts, plugins, restore, Upgrade::Resume, t0, port_of(opts))?;
    if let Some(saved) = job.shadow_to_resume.take() {
        match shadow_deployment(pipeline, runtime, &saved, savepoint_dir.as_deref()) {
            Ok(d) => job.resume_shadow(d, &saved),
            Err(e) => {
                tracing::warn!(deploy = saved.id, error = %e, "the shadow cannot run again; the job goes on without it")
            }
        }
    }
    Ok(job)
}

/// The plugins of a shadow a snapshot had running, from its component kept beside the
/// job's checkpoints (or in the savepoint's folder), configured for the aggregations it
/// shadowed.
fn shadow_deployment(
    pipeline: &Pipeline,
    runtime: &PluginRuntime,
    saved: &commands::ShadowStatus,
    savepoint: Option<&Path>,
) -> Result<deployment::Deployment> {
    let t = Instant::now();
    let mut dirs: Vec<&Path> = savepoint.into_iter().collect();
    dirs.extend(pipeline.checkpoints.as_ref().map(|c| c.dir.as_path()));
    let (component, path) = Component::find(&dirs, &saved.to.sha256).ok_or_else(|| {
        Error::Usage(format!(
            "the shadow's component {} is not kept with the job's checkpoints",
            saved.to.sha256
        ))
    })?;
    let label = path.display().to_string();
    let mut plugins = Vec::new();
    for (i, a) in
        pipeline.aggregations.iter().enumerate().filter(|(_, a)| saved.aggregations.contains(&a.name))
    {
        plugins.push((i, runtime.load_bytes(&label, &component.bytes, &a.plugin.config, a.plugin.limits)?));
    }
    Ok(deployment::Deployment { plugins, component, prepare: t.elapsed() })
}

/// A task of a job shared with a group takes the task before it looks for its newest
/// checkpoint: a process that still runs it stops checkpointing and committing now
/// (fenced), so what it restores is not overtaken.
fn take_task(pipeline: &Pipeline, store: &Checkpoints) -> Result<()> {
    if let Some(g) = store.claim()? {
        crate::sink::fence(&pipeline.sink, &pipeline.instance_name(), g)?;
    }
    Ok(())
}

/// The newest checkpoint that reads back (with a transactional sink, whose epoch
/// committed; the ones after it are dropped).
fn recover(pipeline: &Pipeline, opts: &RunOptions, store: &Checkpoints) -> Result<Option<Restore>> {
    let transactional = opts.output.is_none() && pipeline.sink.transactional();
    let found = store::latest_valid(store, transactional)?;
    if transactional {
        // Checkpoints after the one recovered from never committed: drop them, so
        // that pruning cannot remove the last committed one.
        let newest = found.as_ref().map_or(0, |(n, _)| *n);
        for n in store.list()?.into_iter().filter(|&n| n > newest) {
            store.remove(n)?;
        }
    }
    Ok(found.map(|(n, savepoint)| {
        tracing::info!(checkpoint = n, "recovering from the latest checkpoint");
        Restore { savepoint, checkpoint: Some(n) }
    }))
}

/// A task of a group started from a savepoint: the savepoint's state the first time the
/// job's life takes the task, its newest checkpoint afterwards
/// ([`Checkpoints::first_restore`]).
fn restore_in_group(
    pipeline: &Pipeline,
    opts: &RunOptions,
    sp: &Path,
    c: &crate::pipeline::CheckpointSpec,
) -> Result<Option<Restore>> {
    let store = Checkpoints::open(&c.dir, c.remote.as_deref())?;
    take_task(pipeline, &store)?;
    let saved = savepoint::read(sp)?;
    let life = match &opts.since_stop {
        Some(stop) => format!("{}-after-{stop}", saved.meta.snapshot_id),
        None => saved.meta.snapshot_id.clone(),
    };
    if store.first_restore(&life)? {
        tracing::info!(savepoint = %sp.display(), "the task starts from the savepoint");
        return Ok(Some(Restore { savepoint: saved, checkpoint: None }));
    }
    recover(pipeline, opts, &store)
}

/// What a run starts from.
struct Restore {
    savepoint: Savepoint,
    /// The checkpoint number, when recovering from a checkpoint.
    checkpoint: Option<u64>,
}

/// Resume from a savepoint with a new plugin version, migrating its state. Refused (the
/// savepoint untouched, nothing written) when the plugin cannot take the state. The new
/// plugin replaces every aggregation whose plugin has the same name.
pub fn deploy(
    pipeline: &Pipeline,
    plugin_path: &Path,
    from_savepoint: &Path,
    opts: &RunOptions,
    runtime: &PluginRuntime,
) -> Result<Summary> {
    let fetched = local_savepoint(pipeline, Some(from_savepoint))?;
    let from_savepoint = fetched.as_deref().unwrap_or(from_savepoint);
    if membership::shares_group(pipeline, opts) {
        return deploy_into_savepoint(pipeline, plugin_path, from_savepoint, opts, runtime);
    }
    if tasks::per_partition(pipeline) {
        let opts = RunOptions { from_savepoint: Some(from_savepoint.to_path_buf()), ..opts.clone() };
        return threads::run(pipeline, &opts, &|p, o| {
            open_task_deploy(p, o, plugin_path, from_savepoint, runtime)
        });
    }
    tasks::check_one_task(pipeline, opts)?;
    run_rolling_back(
        open_deploy(pipeline, plugin_path, from_savepoint, opts, runtime)?,
        pipeline,
        opts,
        runtime,
    )
}

/// The savepoint `sp` as a local folder: one in a shared store (a savepoint of a group,
/// `s3://.../savepoints/<id>`) is fetched into the pipeline's savepoint folder first.
fn local_savepoint(pipeline: &Pipeline, sp: Option<&Path>) -> Result<Option<PathBuf>> {
    match sp {
        Some(sp) if crate::checkpoint::group::in_store(sp) => {
            let url = sp.to_string_lossy();
            let local = crate::checkpoint::group::fetch_url(&url, &pipeline.savepoints.join(".fetched"))?;
            tracing::info!(savepoint = %url, local = %local.display(), "savepoint of the group fetched");
            Ok(Some(local))
        }
        other => Ok(other.map(Path::to_path_buf)),
    }
}

/// An offline deploy into the savepoint of a job that a consumer group shares: every
/// task opened from the savepoint with the new plugin (its state migrated) and stopped
/// at once with a savepoint, before reading a record; the job savepoint of them, also
/// put into the group's store when it has one, is what the group's processes start from
/// (`km0 run --from-savepoint`).
fn deploy_into_savepoint(
    pipeline: &Pipeline,
    plugin_path: &Path,
    from_savepoint: &Path,
    opts: &RunOptions,
    runtime: &PluginRuntime,
) -> Result<Summary> {
    let mut alone = pipeline.clone();
    alone.checkpoints = None;
    alone.source = alone.source.bounded();
    let opts = RunOptions {
        from_savepoint: Some(from_savepoint.to_path_buf()),
        stop_with_savepoint_after: Some(0),
        ..opts.clone()
    };
    let mut summary =
        threads::run(&alone, &opts, &|p, o| open_task_deploy(p, o, plugin_path, from_savepoint, runtime))?;
    let store = pipeline.checkpoints.as_ref().and_then(|c| c.remote.as_deref());
    if let (Some(url), Some(local)) = (store, summary.savepoint.clone()) {
        let put = crate::checkpoint::group::GroupSavepoints::open(url)?.put(&local, "km0 deploy")?;
        tracing::info!(local = %local.display(), savepoint = %put, "the deployed savepoint is in the group's store");
        summary.savepoint = Some(PathBuf::from(put));
    }
    Ok(summary)
}

/// Open a task of a job savepoint (`from_savepoint`) with a new plugin version: from its
/// own savepoint in it.
fn open_task_deploy<'p>(
    p: &'p Pipeline,
    o: &RunOptions,
    plugin_path: &Path,
    from_savepoint: &Path,
    runtime: &PluginRuntime,
) -> Result<RunningJob<'p>> {
    match &o.from_savepoint {
        Some(sp) => open_deploy(p, plugin_path, sp, o, runtime),
        None => Err(Error::Usage(format!(
            "the savepoint {} holds no state of task {} to deploy into",
            from_savepoint.display(),
            p.task.as_deref().unwrap_or("?")
        ))),
    }
}

/// Open a job (or one task of it) from a savepoint with a new plugin version.
fn open_deploy<'p>(
    pipeline: &'p Pipeline,
    plugin_path: &Path,
    from_savepoint: &Path,
    opts: &RunOptions,
    runtime: &PluginRuntime,
) -> Result<RunningJob<'p>> {
    let restore = savepoint::read(from_savepoint)?;
    let bytes = std::fs::read(plugin_path).map_err(|e| Error::io("read plugin", plugin_path, e))?;
    let component = Component::new(bytes);
    // Only its name here: each aggregation it replaces configures it with its own
    // `[plugin.config]` and limits (load_plugins).
    let label = plugin_path.display().to_string();
    let (identity, _) = runtime
        .inspect_bytes(&label, &component.bytes)
        .map_err(|e| Error::deploy(Refusal::NotAPlugin(Box::new(e))))?;
    let name = identity.name;
    if !restore.meta.operators.iter().any(|o| o.plugin.name == name) {
        let held = restore.meta.operators.iter().map(|o| o.plugin.name.clone()).collect();
        return Err(Error::deploy(Refusal::ReplacesNothing { held, offered: name }));
    }
    let plugins = load_plugins(pipeline, runtime, Some(&restore), Some((&label, &component, &name)))?;
    let restore = Restore { savepoint: restore, checkpoint: None };
    let port = port_of(opts);
    RunningJob::open(pipeline, opts, plugins, Some(restore), Upgrade::Deploy(name), Instant::now(), port)
}

/// The control port's side of the loop, for a job with a control API.
fn port_of(opts: &RunOptions) -> Option<Box<dyn running::Port + Send>> {
    let handle = opts.control.clone()?;
    Some(Box::new(port::LoopControl::new(handle, Instant::now())))
}

/// The plugin of every aggregation, and the deployed component it runs when that is not
/// its pipeline file's. Resuming from a snapshot whose aggregation ran another component
/// than the pipeline's file (a deploy), that component is used when the snapshot's
/// savepoint folder or the checkpoint store holds it. With `deploy`, the new component
/// replaces the plugins that the snapshot holds under its name.
fn load_plugins(
    pipeline: &Pipeline,
    runtime: &PluginRuntime,
    restore: Option<&Savepoint>,
    deploy: Option<(&str, &Component, &str)>,
) -> Result<Vec<(Plugin, Option<Component>)>> {
    let chk_dir = pipeline.checkpoints.as_ref().map(|c| c.dir.as_path());
    pipeline
        .aggregations
        .iter()
        .map(|a| {
            let saved = restore.and_then(|sp| sp.meta.operators.iter().find(|o| o.id == a.name));
            let load = |label: &str, c: &Component| {
                runtime.load_bytes(label, &c.bytes, &a.plugin.config, a.plugin.limits)
            };
            if let Some((label, c, _)) =
                deploy.filter(|(_, _, name)| saved.is_some_and(|o| o.plugin.name == *name))
            {
                let p = load(label, c).map_err(|e| {
                    Error::deploy(Refusal::Configure { aggregation: a.name.clone(), source: Box::new(e) })
                })?;
                return Ok((p, Some(c.clone())));
            }
            let bytes =
                std::fs::read(&a.plugin.path).map_err(|e| Error::io("read plugin", &a.plugin.path, e))?;
            let own = Component::new(bytes);
            if let (Some(sp), Some(o)) = (restore, saved) {
                if o.plugin.sha256 != own.sha256 {
                    let mut dirs = vec![sp.path.as_path()];
                    dirs.extend(chk_dir);
                    if let Some((c, path)) = Component::find(&dirs, &o.plugin.sha256) {
                        tracing::warn!(
                            aggregation = %a.name,
                            runs = %format!("{} {} ({})", o.plugin.name, o.plugin.version, path.display()),
                            pipeline_names = %a.plugin.path.display(),
                            "resuming with the plugin the job ran (deployed), not the pipeline file's"
                        );
                        let p = load(&path.display().to_string(), &c)?;
                        return Ok((p, Some(c)));
                    }
                }
            }
            Ok((load(&a.plugin.path.display().to_string(), &own)?, None))
        })
        .collect()
}

/// Whether a run of `pipeline` with `opts` reads an unbounded source (it runs until
/// stopped).
pub fn unbounded(pipeline: &Pipeline, opts: &RunOptions) -> bool {
    Source::unbounded(&pipeline.source, opts.follow)
}

/// Check a pipeline and its plugins without running anything.
pub fn validate(pipeline: &Pipeline, runtime: &PluginRuntime) -> Result<Vec<PluginIdentity>> {
    let plugins: Vec<Plugin> =
        load_plugins(pipeline, runtime, None, None)?.into_iter().map(|(p, _)| p).collect();
    let ids = plugins.iter().map(|p| p.identity().clone()).collect();
    Engine::new(pipeline, plugins)?;
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::Summary;
    use std::time::Duration;

    #[test]
    fn a_job_of_tasks_sums_their_summaries() {
        let task = |read: u64, watermark: i64, pause_ms: u64, recovered: Option<&str>| {
            let mut s = Summary {
                watermark,
                open_windows: 2,
                records_this_run: read,
                checkpoints: 1,
                checkpoint_pause_max: Duration::from_millis(pause_ms),
                checkpoint_pause_total: Duration::from_millis(pause_ms),
                recovered_from: recovered.map(str::to_string),
                ..Summary::default()
            };
            s.counters.read = read;
            s
        };
        let mut sum = task(100, 7_000, 5, None);
        sum.add(task(40, 3_000, 9, Some("chk-000004")));
        sum.add(task(1, 8_000, 2, Some("chk-000009")));
        assert_eq!((sum.counters.read, sum.records_this_run, sum.open_windows), (141, 141, 6));
        assert_eq!((sum.watermark, sum.checkpoints), (3_000, 3));
        assert_eq!(sum.checkpoint_pause_max, Duration::from_millis(9));
        assert_eq!(sum.checkpoint_pause_total, Duration::from_millis(16));
        assert_eq!(sum.recovered_from.as_deref(), Some("chk-000004"), "the first task that recovered");
    }
}

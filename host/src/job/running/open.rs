//! Opening a [`RunningJob`]: its engine with the plugins, the state of a snapshot restored,
//! the source positioned, checkpoints, then the sinks (last: everything else is checked
//! before anything is written).

use super::{Port, RunningJob};
use crate::checkpoint::components::Component;
use crate::checkpoint::savepoint::{self, Savepoint, SavepointMeta};
use crate::checkpoint::store::Checkpoints;
use crate::job::checkpoints::{CheckpointStats, Checkpointer};
use crate::job::engine::{Confined, Engine};
use crate::job::lag::LagReport;
use crate::job::ledger::Ledger;
use crate::job::upgrade::Migrations;
use crate::job::{Restore, RunOptions, Upgrade};
use crate::pipeline::{Backend, Pipeline};
use crate::plugin::Plugin;
use crate::sink::{Sinks, SinksAt};
use crate::source::Source;
use crate::state::rocks::RocksState;
use crate::{metrics, Result};
use sha2::{Digest, Sha256};
use std::time::{Duration, Instant};

impl<'p> RunningJob<'p> {
    /// Open a job: its operators with `plugins`, the state of `restore` loaded (checked
    /// against `upgrade`'s rules), the source positioned, checkpoints, then the sinks.
    pub(in crate::job) fn open(
        pipeline: &'p Pipeline,
        opts: &RunOptions,
        plugins: Vec<(Plugin, Option<Component>)>,
        restore: Option<Restore>,
        upgrade: Upgrade,
        restore_started: Instant,
        port: Option<Box<dyn Port + Send>>,
    ) -> Result<RunningJob<'p>> {
        let recovered_from = restore.as_ref().and_then(|r| r.checkpoint).map(|n| format!("chk-{n:06}"));
        let restore = restore.map(|r| r.savepoint);
        let (mut job, migrated) = open_engine(pipeline, opts, plugins, restore.as_ref(), &upgrade)?;
        let restore_time = if restore.is_some() { restore_started.elapsed() } else { Duration::ZERO };
        // The saved slots are the job's now: only what the savepoint says of the source and
        // sinks is kept (its slots, ~100 MB for ~1M windows, were kept for the whole run).
        let restore = restore.map(|sp| sp.meta);
        let ledger = restore.as_ref().and_then(|meta| Ledger::of(meta.control.as_ref()));
        let source = open_source(pipeline, opts, &mut job, restore.as_ref())?;
        let follow = Source::unbounded(&pipeline.source, opts.follow);
        let mut checkpoints = open_checkpoints(pipeline, &mut job, follow)?;
        place_partitions(pipeline, &mut job, &source, restore.is_some());
        open_sinks(pipeline, opts, &mut job, &source, checkpoints.as_mut(), restore.as_ref())?;
        let savepoint_dir = opts.savepoint_dir.clone().unwrap_or_else(|| pipeline.savepoints.clone());
        savepoint::remove_abandoned(&savepoint_dir);
        let mut running = RunningJob {
            pipeline,
            job,
            read_before: source.records(),
            source,
            checkpoints,
            stats: CheckpointStats::default(),
            savepoint_dir,
            follow,
            stop_after: opts.stop_with_savepoint_after,
            lag_at: LagReport::new(pipeline),
            control: opts.control.clone(),
            port,
            take_commands: false,
            idle_loops: 0,
            stop_reply: None,
            savepoint: None,
            savepoint_pause: Duration::ZERO,
            migrated,
            recovered_from,
            restore_time,
            t0: Instant::now(),
            cpu0: metrics::thread_cpu_time(),
            in_group: opts.committer.is_some(),
            rollback: None,
            halted: None,
            shadow_to_resume: None,
        };
        if let Some(ledger) = ledger {
            if let Some(mut port) = running.port.take() {
                port.resume(&mut running, ledger);
                running.port = Some(port);
            }
        }
        Ok(running)
    }
}

/// The engine with `plugins`, the state of `restore` loaded into it (checked against
/// `upgrade`'s rules): with the migrations that took the state to the new plugins.
fn open_engine(
    pipeline: &Pipeline,
    opts: &RunOptions,
    plugins: Vec<(Plugin, Option<Component>)>,
    restore: Option<&Savepoint>,
    upgrade: &Upgrade,
) -> Result<(Engine, Migrations)> {
    let (plugins, components): (Vec<Plugin>, Vec<Option<Component>>) = plugins.into_iter().unzip();
    let mut job = Engine::new(pipeline, plugins)?;
    job.components = components;
    if let Some(input) = &opts.input {
        // Another input is another run: it never replays an epoch of the pipeline's own.
        let text = format!("{}|input={}", job.fingerprint, input.display());
        job.fingerprint = crate::pipeline::hex(&Sha256::digest(text.as_bytes()));
    }
    let migrated = match restore {
        Some(sp) => job.restore(pipeline, sp, upgrade)?,
        None => Vec::new(),
    };
    Ok((job, migrated))
}

/// The source, at the position `restore` saved: a task of a job partitioned by key checks
/// that its records are keyed as it owns them, and a member of a consumer group commits
/// its offsets through the group.
fn open_source(
    pipeline: &Pipeline,
    opts: &RunOptions,
    job: &mut Engine,
    restore: Option<&SavepointMeta>,
) -> Result<Source> {
    let mut source =
        Source::open(&pipeline.source, opts.input.as_ref(), opts.follow, restore.map(|meta| &meta.source))?;
    if pipeline.task.is_some() && !pipeline.partitioned_by.is_empty() {
        if let Some(key) = source.keep_message_keys() {
            job.confined = Some(Confined { names: pipeline.partitioned_by.clone(), key });
        }
    }
    if let Some(member) = &opts.committer {
        source.commit_through(member.clone());
    }
    Ok(source)
}

/// The sinks, opened only once everything else has been checked, where `restore` left
/// them. A task of a job shared with a group writes its sinks as the owner of its
/// checkpoints' generation.
fn open_sinks(
    pipeline: &Pipeline,
    opts: &RunOptions,
    job: &mut Engine,
    source: &Source,
    checkpoints: Option<&mut Checkpointer>,
    restore: Option<&SavepointMeta>,
) -> Result<()> {
    let owner = checkpoints.as_ref().and_then(|c| c.generation).filter(|_| opts.committer.is_some());
    let sinks = Sinks::open(
        pipeline,
        opts.output.as_deref(),
        SinksAt {
            positions: restore.map_or(&[], |meta| &meta.sinks[..]),
            snapshot: restore.map(|meta| meta.snapshot_id.clone()),
            ordinal: job.results_out,
            fingerprint: job.fingerprint.clone(),
            owner,
            in_group: opts.committer.is_some(),
        },
    )?;
    if let Some(c) = checkpoints {
        c.synchronous = sinks.output.commits_on_completion();
    }
    (job.output, job.late, job.dead) = (Some(sinks.output), Some(sinks.late), Some(sinks.dead));
    job.sources = (0..source.partitions()).map(|p| source.partition_name(p as u32)).collect();
    tracing::info!(pipeline = %pipeline.name, partitions = source.partitions(), resumed = restore.is_some(), "job started");
    Ok(())
}

/// The checkpointer of a job whose pipeline has checkpoints (operators track their
/// changes with the RocksDB backend); a deployed component it runs is stored first.
fn open_checkpoints(pipeline: &Pipeline, job: &mut Engine, follows: bool) -> Result<Option<Checkpointer>> {
    let Some(spec) = &pipeline.checkpoints else { return Ok(None) };
    let store = Checkpoints::open(&spec.dir, spec.remote.as_deref())?;
    let generation = store.claim()?;
    let next = store.next()?;
    let rocks = match pipeline.state.backend_for(follows) {
        Backend::Memory => None,
        Backend::Rocksdb => {
            for op in &mut job.ops {
                op.track_changes();
            }
            Some(std::sync::Arc::new(RocksState::open_fresh(&pipeline.state.dir)?))
        }
    };
    // A deployed component is stored before any checkpoint records it.
    for component in job.components.iter().flatten() {
        component.put(&spec.dir)?;
    }
    Ok(Some(Checkpointer {
        spec: spec.clone(),
        store,
        rocks,
        next,
        last: Instant::now(),
        records_at_last: 0,
        writing: None,
        failed_savepoints: Vec::new(),
        synchronous: false,
        history: Default::default(),
        generation,
    }))
}

/// The watermark clock of each source partition: a fresh job's file partitions get one
/// each, in order; Kafka partitions meet their clocks by name (a topic may have gained
/// partitions since the checkpoint: a new one gets a clock of its own).
fn place_partitions(pipeline: &Pipeline, job: &mut Engine, source: &Source, restored: bool) {
    if pipeline.source.partitioning().field.is_none() && !restored {
        for p in 0..source.partitions() {
            job.watermarks.partition(&source.partition_name(p as u32));
        }
    }
    if source.partitions_by_name() {
        job.clock_of = (0..source.partitions())
            .map(|p| job.watermarks.partition(&source.partition_name(p as u32)))
            .collect();
    }
}

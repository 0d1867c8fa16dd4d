//! Live plugin deploys into a running job.
//!
//! 1. Off the job's thread ([`Deployer::prepare`]): the new component is read, compiled
//!    (or taken from the cache), instantiated, asked who it is, and configured for every
//!    aggregation it replaces (those whose plugin has its name, or the one named).
//! 2. On the job's thread, between two records ([`Job::swap`]): the checks of an offline
//!    deploy that need the job (key fields, held rows, decoder); a savepoint of the job
//!    as it is, the swap's rollback point; every accumulator migrated by the new plugin
//!    when its state schema differs; then the plugins are swapped in place, with the
//!    effect `km0 deploy --from-savepoint` has on that savepoint's state (held rows of
//!    ordered plugins handed over again) but without rebuilding keys, slots and timers.
//!    Anything refused or failing before the swap leaves the job as it was.
//! 3. Once the rollback savepoint is written, the loop takes a checkpoint, so that a crash
//!    from then on recovers with the new plugin (the deploy is answered when both are
//!    durable) (its component is stored with the checkpoints and in every later savepoint,
//!    [`crate::checkpoint::components`]).
//!
//! So the output of a live swap is that of stopping with a savepoint at the same record
//! and deploying offline from it.

use super::checkpoints::Checkpointer;
use super::commands::Refused;
use super::route::{fields_of, results_fingerprint, Job};
use super::running::{begin_savepoint, join_writer, SavepointFailed, SavepointWriter};
use super::upgrade::{self, Refusal};
use super::*;
use crate::sink::RewindPoint;
use crate::source::decode::Decoder;
use crate::window::aggregator::Aggregator;
use std::sync::Arc;

/// The largest component a live deploy takes by default (the Python SDK's are ~20 MB).
pub const MAX_COMPONENT_BYTES: usize = 64 << 20;

/// A new plugin, ready to be swapped in.
pub struct Deployment {
    /// Configured for each aggregation it replaces (by index in the pipeline).
    pub plugins: Vec<(usize, Plugin)>,
    pub component: Component,
    /// How long preparing it took.
    pub prepare: Duration,
}

/// Prepares live deploys for one job (in the control API's threads).
pub struct Deployer {
    runtime: Arc<PluginRuntime>,
    pipeline: Pipeline,
    /// The largest component taken.
    pub max_bytes: usize,
}

impl Deployer {
    pub fn new(runtime: Arc<PluginRuntime>, pipeline: Pipeline) -> Deployer {
        Deployer { runtime, pipeline, max_bytes: MAX_COMPONENT_BYTES }
    }

    /// Read, compile, instantiate and configure `bytes` for the aggregations it replaces:
    /// `aggregation`, or every one whose plugin (`running`: each aggregation's plugin name,
    /// in pipeline order) has the new plugin's name.
    pub fn prepare(
        &self,
        bytes: Vec<u8>,
        aggregation: Option<&str>,
        running: &[String],
    ) -> std::result::Result<Deployment, Refused> {
        let t = Instant::now();
        if bytes.len() > self.max_bytes {
            return Err(Refusal::TooLarge { bytes: bytes.len(), max: self.max_bytes }.into());
        }
        let component = Component::new(bytes);
        let label = format!("uploaded component {}", &component.sha256[..12]);
        let (identity, _) = self
            .runtime
            .inspect_bytes(&label, &component.bytes)
            .map_err(|e| Refusal::NotAPlugin(Box::new(e)))?;
        let aggregations = &self.pipeline.aggregations;
        if running.len() != aggregations.len() {
            return Err(Refusal::Starting.into());
        }
        let targets: Vec<usize> = match aggregation {
            Some(name) => {
                let Some(i) = aggregations.iter().position(|a| a.name == name) else {
                    let known = aggregations.iter().map(|a| a.name.clone()).collect();
                    return Err(Refusal::NoAggregation { name: name.to_string(), known }.into());
                };
                if running[i] != identity.name {
                    return Err(Refusal::OtherLogic {
                        aggregation: aggregations[i].name.clone(),
                        held: running[i].clone(),
                        offered: identity.name,
                    }
                    .into());
                }
                vec![i]
            }
            None => {
                let found: Vec<usize> = (0..running.len()).filter(|&i| running[i] == identity.name).collect();
                if found.is_empty() {
                    return Err(
                        Refusal::ReplacesNothing { held: running.to_vec(), offered: identity.name }.into()
                    );
                }
                found
            }
        };
        let mut plugins = Vec::new();
        for i in targets {
            let a = &aggregations[i];
            let p = self
                .runtime
                .load_bytes(&label, &component.bytes, &a.plugin.config, a.plugin.limits)
                .map_err(|e| Refusal::Configure { aggregation: a.name.clone(), source: Box::new(e) })?;
            plugins.push((i, p));
        }
        // Kept with the checkpoints before any checkpoint records it.
        if let Some(c) = &self.pipeline.checkpoints {
            component.put(&c.dir).map_err(|e| Refused::Failed(e.to_string()))?;
        }
        Ok(Deployment { plugins, component, prepare: t.elapsed() })
    }

    /// The same deployment for another task of the job: its own plugin instances, the
    /// component stored with its checkpoints (`checkpoints`).
    pub fn again(
        &self,
        d: &Deployment,
        checkpoints: Option<&Path>,
    ) -> std::result::Result<Deployment, Refused> {
        let t = Instant::now();
        let label = format!("uploaded component {}", &d.component.sha256[..12]);
        let mut plugins = Vec::with_capacity(d.plugins.len());
        for (i, _) in &d.plugins {
            let a = &self.pipeline.aggregations[*i];
            let p = self
                .runtime
                .load_bytes(&label, &d.component.bytes, &a.plugin.config, a.plugin.limits)
                .map_err(|e| Refusal::Configure { aggregation: a.name.clone(), source: Box::new(e) })?;
            plugins.push((*i, p));
        }
        if let Some(dir) = checkpoints {
            d.component.put(dir).map_err(|e| Refused::Failed(e.to_string()))?;
        }
        Ok(Deployment { plugins, component: d.component.clone(), prepare: t.elapsed() })
    }
}

/// A swap done.
pub(super) struct Swapped {
    /// Writing the rollback savepoint (none: written already).
    pub(super) writer: Option<SavepointWriter>,
    pub(super) migrated: Vec<(String, u32, u32)>,
    pub(super) savepoint: PathBuf,
    /// Where the result sink stood at the rollback savepoint.
    pub(super) rewind: RewindPoint,
    pub(super) savepoint_time: Duration,
    pub(super) swap_time: Duration,
}

/// Why a swap did not happen.
pub(super) enum NotSwapped {
    /// Refused: the job goes on with its plugins and state as they were. The rollback
    /// savepoint, when it was written already.
    Refused(Box<Refused>, Option<PathBuf>),
    /// The job cannot go on (the savepoint could not be written, say).
    Failed(Error),
}

impl Job {
    /// The checks of a swap that touch nothing (the same logic, key fields, held rows,
    /// fields the records decode to): the decoder, the operators' columns and the results'
    /// fingerprint the job runs with once the deployment is swapped in.
    fn check_swap(
        &self,
        pipeline: &Pipeline,
        d: &Deployment,
    ) -> std::result::Result<(Decoder, Vec<Vec<usize>>, String), Refusal> {
        for (i, p) in &d.plugins {
            let op = &self.ops[*i];
            upgrade::same_logic(op.name(), op.identity(), p.identity())?;
            upgrade::key_fields(pipeline, op.name(), p)?;
            let fields = &p.info().fields;
            let unfit = op.unfit_row(|v| upgrade::row_fits(v, fields));
            upgrade::rows_fit(op.name(), p, unfit.as_ref().map(|(n, bad)| (*n, bad)))?;
        }
        let plugins: Vec<&dyn Aggregator> = (0..self.ops.len())
            .map(|i| match d.plugins.iter().find(|(j, _)| *j == i) {
                Some((_, p)) => p as &dyn Aggregator,
                None => self.ops[i].plugin(),
            })
            .collect();
        let (decoder, columns) =
            Decoder::new(pipeline, &fields_of(&plugins)).map_err(|e| Refusal::Fields(Box::new(e)))?;
        Ok((decoder, columns, results_fingerprint(pipeline, &plugins)))
    }

    /// A swap's rollback point: written like the job's checkpoints when they are
    /// incremental (RocksDB); otherwise captured now and written by another thread (before
    /// going on when the sink commits once a snapshot is durable). One that cannot be
    /// written refuses the swap: nothing was swapped, the job goes on as it was.
    fn rollback_point(
        &mut self,
        pipeline: &Pipeline,
        source: &Source,
        checkpoints: Option<&mut Checkpointer>,
        savepoint_dir: &Path,
    ) -> std::result::Result<(PathBuf, Option<SavepointWriter>, RewindPoint), NotSwapped> {
        let (path, writer) =
            begin_savepoint(self, pipeline, source, checkpoints, savepoint_dir).map_err(|f| match f {
                SavepointFailed::Savepoint(e) => NotSwapped::Refused(
                    Box::new(Refused::Failed(format!(
                        "the rollback savepoint could not be written, so nothing was swapped: {e}"
                    ))),
                    None,
                ),
                SavepointFailed::Job(e) => NotSwapped::Failed(e),
            })?;
        // The savepoint's barrier has passed: the sinks hold its results and no more.
        let rewind = match self.output.as_ref().map(|o| o.rewind_point(&self.snapshot_id)) {
            Some(Ok(point)) => point,
            Some(Err(e)) => {
                let kept = writer.map_or(Ok(()), join_writer).ok().map(|()| path.clone());
                return Err(NotSwapped::Refused(
                    Box::new(Refused::Failed(format!(
                        "the rollback point of the result sink could not be read, so nothing was swapped: {e}"
                    ))),
                    kept,
                ));
            }
            None => RewindPoint { snapshot: self.snapshot_id.clone(), kafka_ends: Vec::new() },
        };
        Ok((path, writer, rewind))
    }

    /// Swap the shadow's operators in ([`super::shadow`]) at this record boundary, after a
    /// rollback savepoint of the job as it is.
    pub(super) fn promote(
        &mut self,
        pipeline: &Pipeline,
        source: &Source,
        checkpoints: Option<&mut Checkpointer>,
        savepoint_dir: &Path,
    ) -> std::result::Result<Swapped, NotSwapped> {
        if self.shadow.is_none() {
            return Err(NotSwapped::Refused(Box::new(Refused::NotFound("no shadow runs".into())), None));
        }
        let t = Instant::now();
        let (savepoint, writer, rewind) =
            self.rollback_point(pipeline, source, checkpoints, savepoint_dir)?;
        let savepoint_time = t.elapsed();
        let t = Instant::now();
        if let Err(r) = self.promote_shadow(pipeline) {
            let kept = writer.map_or(Ok(()), join_writer).ok().map(|()| savepoint.clone());
            return Err(NotSwapped::Refused(Box::new(r), kept));
        }
        Ok(Swapped {
            writer,
            migrated: Vec::new(),
            savepoint,
            rewind,
            savepoint_time,
            swap_time: t.elapsed(),
        })
    }

    /// Swap in a deployment's plugins at this record boundary (see the module's text).
    pub(super) fn swap(
        &mut self,
        pipeline: &Pipeline,
        source: &Source,
        checkpoints: Option<&mut Checkpointer>,
        d: Deployment,
        savepoint_dir: &Path,
    ) -> std::result::Result<Swapped, NotSwapped> {
        let (decoder, columns, fingerprint) =
            self.check_swap(pipeline, &d).map_err(|r| NotSwapped::Refused(Box::new(r.into()), None))?;

        let t = Instant::now();
        let (savepoint, writer, rewind) =
            self.rollback_point(pipeline, source, checkpoints, savepoint_dir)?;
        let savepoint_time = t.elapsed();
        // A refused swap waits for its rollback savepoint (named in the refusal).
        let refused = |r: Refused, writer: Option<SavepointWriter>| {
            match writer.map_or(Ok(()), join_writer) {
                Ok(()) => NotSwapped::Refused(Box::new(r), Some(savepoint.clone())),
                // Refused all the same: the job is unchanged.
                Err(_) => NotSwapped::Refused(Box::new(r), None),
            }
        };

        // Migrations first: one that fails changes nothing.
        let t = Instant::now();
        let mut d = d;
        let mut migrated = Vec::new();
        let mut accs = Vec::new();
        for (i, plugin) in &mut d.plugins {
            let (old, new) = (self.ops[*i].identity().clone(), plugin.identity().clone());
            if old.state_schema == new.state_schema {
                accs.push(None);
                continue;
            }
            let converted = match self.ops[*i].migrated(plugin, old.state_schema) {
                Ok(accs) => accs,
                Err(e) => return Err(refused(upgrade::migration_failed(&old, &new, e).into(), writer)),
            };
            accs.push(Some(converted));
            migrated.push((self.ops[*i].name().to_string(), old.state_schema, new.state_schema));
        }

        // Nothing can fail from here on.
        for ((i, plugin), accs) in d.plugins.into_iter().zip(accs) {
            self.ops[i].swap_plugin(Box::new(plugin), accs);
            self.components[i] = Some(d.component.clone());
        }
        for (op, cols) in self.ops.iter_mut().zip(columns) {
            op.set_columns(cols);
        }
        self.decoder = decoder;
        self.fingerprint = fingerprint;
        Ok(Swapped { writer, migrated, savepoint, rewind, savepoint_time, swap_time: t.elapsed() })
    }
}

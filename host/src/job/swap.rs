//! Live plugin deploys into a running job.
//!
//! 1. Off the job's thread ([`super::deployment::Deployer::prepare`]): the new component is read, compiled
//!    (or taken from the cache), instantiated, asked who it is, and configured for every
//!    aggregation it replaces (those whose plugin has its name, or the one named).
//! 2. On the job's thread, between two records ([`Engine::swap`]): the checks of an offline
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

use super::build::{fields_of, operator, results_fingerprint};
use super::checkpoints::{begin_savepoint, join_writer, Checkpointer, SavepointFailed, SavepointWriter};
use super::commands::{Refused, ShadowStatus};
use super::deployment::Deployment;
use super::engine::Engine;
use super::shadow::Shadow;
use super::upgrade::{self, Refusal};
use crate::pipeline::Pipeline;
use crate::plugin::Plugin;
use crate::sink::RewindPoint;
use crate::source::decode::Decoder;
use crate::source::Source;
use crate::window::aggregator::Aggregator;
use crate::window::operator::{Snapshot, WindowOperator};
use crate::{metrics, Error};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

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

impl Engine {
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

    /// The checks of a swap and its migrations, every converted accumulator thrown away:
    /// what a task of a two-phase deploy says before any task swaps (see
    /// [`super::commands::Command::Prepare`]).
    pub(super) fn prepare_swap(
        &mut self,
        pipeline: &Pipeline,
        d: &mut Deployment,
    ) -> std::result::Result<(), Refused> {
        self.check_swap(pipeline, d)?;
        for (i, plugin) in &mut d.plugins {
            let (old, new) = (self.ops[*i].identity().clone(), plugin.identity().clone());
            if old.state_schema != new.state_schema {
                self.ops[*i]
                    .migrated(plugin, old.state_schema)
                    .map_err(|e| Refused::from(upgrade::migration_failed(&old, &new, e)))?;
            }
        }
        Ok(())
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

impl Engine {
    /// Start running a deployment's plugins as a shadow of the aggregations they replace.
    pub(super) fn start_shadow(
        &mut self,
        pipeline: &Pipeline,
        d: Deployment,
        id: u64,
        at_record: u64,
        file: Option<PathBuf>,
    ) -> std::result::Result<ShadowStatus, Refused> {
        if let Some(s) = &self.shadow {
            return Err(Refused::Closed(format!(
                "deploy {} runs as a shadow already: promote or abandon it first",
                s.status.id
            )));
        }
        for (i, p) in &d.plugins {
            let op = &self.ops[*i];
            upgrade::same_logic(op.name(), op.identity(), p.identity())?;
            upgrade::key_fields(pipeline, op.name(), p)?;
        }
        // One decoder for both: the current plugins' columns, then the shadow's.
        let mut all: Vec<&dyn Aggregator> = self.ops.iter().map(|o| o.plugin()).collect();
        all.extend(d.plugins.iter().map(|(_, p)| p as &dyn Aggregator));
        let (decoder, mut columns) =
            Decoder::new(pipeline, &fields_of(&all)).map_err(|e| Refusal::Fields(Box::new(e)))?;
        let shadow_columns = columns.split_off(self.ops.len());
        let wm = self.watermarks.current();
        let mut ops = Vec::new();
        let mut from = Vec::new();
        let mut aggregations = Vec::new();
        let mut current_calls = Vec::new();
        for ((i, plugin), cols) in d.plugins.into_iter().zip(shadow_columns) {
            let old = self.ops[i].identity().clone();
            current_calls.push((self.ops[i].plugin().call_seconds(), self.ops[i].plugin().call_seconds()));
            let op = self.shadow_operator(pipeline, i, plugin, cols, wm)?;
            aggregations.push(op.name().to_string());
            from.push(old);
            ops.push((i, op));
        }
        let Some(to) = ops.first().map(|(_, op)| op.identity().clone()) else {
            return Err(Refused::Closed("the deploy replaces no aggregation".into()));
        };
        let file = differences_file(file)?;
        for (op, cols) in self.ops.iter_mut().zip(columns) {
            op.set_columns(cols);
        }
        self.decoder = decoder;
        let (differences_file, file) = match file {
            Some((p, f)) => (Some(p), Some(f)),
            None => (None, None),
        };
        let status = ShadowStatus {
            id,
            aggregations,
            from,
            to,
            since_record: at_record,
            at_ms: metrics::now_ms(),
            differences_file,
            ..ShadowStatus::default()
        };
        tracing::info!(deploy = id, to = %format!("{} {}", status.to.name, status.to.version), at_record, "shadow started");
        self.shadow = Some(Box::new(Shadow::new(status.clone(), d.component, ops, file, current_calls)));
        Ok(status)
    }

    /// The shadow's operator for aggregation `i`: `plugin` over a copy of the current
    /// state (migrated when the state schema differs), at watermark `wm`.
    fn shadow_operator(
        &mut self,
        pipeline: &Pipeline,
        i: usize,
        plugin: Plugin,
        cols: Vec<usize>,
        wm: i64,
    ) -> std::result::Result<WindowOperator, Refused> {
        let fail = |e: Error| Refused::Failed(e.to_string());
        let (old, new) = (self.ops[i].identity().clone(), plugin.identity().clone());
        let captured = self.ops[i].capture().map_err(fail)?;
        let mut snap = Snapshot {
            slots: captured
                .slots
                .iter()
                .map(|(key, id, window, acc)| crate::state::saved::SavedSlot {
                    key: key.to_vec(),
                    id,
                    window,
                    acc: acc.to_vec(),
                })
                .collect(),
            rows: captured.rows,
            counters: captured.counters,
        };
        let mut op = operator(pipeline, i, plugin, cols);
        // A fault of the new plugin never stops the job (whatever `on_error` says).
        op.set_on_error(crate::plugin::OnError::DeadLetter);
        op.keep_quarantined_events();
        if old.state_schema != new.state_schema {
            op.migrate(old.state_schema, &mut snap)
                .map_err(|e| Refused::from(upgrade::migration_failed(&old, &new, e)))?;
        }
        op.restore(&snap, wm, true).map_err(fail)?;
        Ok(op)
    }

    /// A shadow restarted (see the module's text) takes the counts its status had.
    pub(super) fn resumed_shadow(&mut self, saved: &ShadowStatus) {
        if let Some(shadow) = self.shadow.as_mut() {
            let s = &mut shadow.status;
            (s.since_record, s.at_ms) = (saved.since_record, saved.at_ms);
            (s.windows, s.equal, s.different, s.faulted) =
                (saved.windows, saved.equal, saved.different, saved.faulted);
            s.failed_events = saved.failed_events;
            shadow.recent = saved.recent_differences.iter().cloned().collect();
        }
    }

    /// Drop the shadow (abandoned): the decoder reads what the current plugins need again.
    pub(super) fn abandon_shadow(
        &mut self,
        pipeline: &Pipeline,
    ) -> std::result::Result<ShadowStatus, Refused> {
        let shadow = self.take_shadow()?;
        self.rebuild_decoder(pipeline)?;
        tracing::info!(deploy = shadow.status.id, "shadow abandoned");
        Ok(shadow.status())
    }

    /// Swap the shadow's operators in for the current ones (promoted): the caller took
    /// the rollback savepoint.
    pub(super) fn promote_shadow(
        &mut self,
        pipeline: &Pipeline,
    ) -> std::result::Result<ShadowStatus, Refused> {
        if let Some(why) = self.shadow.as_ref().and_then(|s| s.status.failed.clone()) {
            return Err(Refused::Closed(format!("the shadow stopped ({why}): abandon it")));
        }
        // The decoder of the plugins after the swap first: a refusal changes nothing.
        let plugins: Vec<&dyn Aggregator> = (0..self.ops.len())
            .map(|i| match self.shadow.as_ref().and_then(|s| s.ops.iter().find(|(j, _)| *j == i)) {
                Some((_, op)) => op.plugin(),
                None => self.ops[i].plugin(),
            })
            .collect();
        let (decoder, columns) =
            Decoder::new(pipeline, &fields_of(&plugins)).map_err(|e| Refused::Failed(e.to_string()))?;
        let mut shadow = self.take_shadow()?;
        for (i, mut op) in std::mem::take(&mut shadow.ops) {
            op.take_place_of(&mut self.ops[i], pipeline.aggregations[i].plugin.on_error);
            self.ops[i] = op;
            self.components[i] = Some(shadow.component.clone());
        }
        for (op, cols) in self.ops.iter_mut().zip(columns) {
            op.set_columns(cols);
        }
        self.decoder = decoder;
        let plugins: Vec<&dyn Aggregator> = self.ops.iter().map(|o| o.plugin()).collect();
        self.fingerprint = results_fingerprint(pipeline, &plugins);
        tracing::info!(deploy = shadow.status.id, "shadow promoted");
        Ok(shadow.status())
    }

    /// The shadow, ended here (its differences written out).
    fn take_shadow(&mut self) -> std::result::Result<Box<Shadow>, Refused> {
        let mut shadow = self.shadow.take().ok_or_else(|| Refused::NotFound("no shadow runs".into()))?;
        shadow.flush();
        Ok(shadow)
    }

    /// The decoder and columns of the current plugins alone.
    fn rebuild_decoder(&mut self, pipeline: &Pipeline) -> std::result::Result<(), Refused> {
        let plugins: Vec<&dyn Aggregator> = self.ops.iter().map(|o| o.plugin()).collect();
        let (decoder, columns) =
            Decoder::new(pipeline, &fields_of(&plugins)).map_err(|e| Refused::Failed(e.to_string()))?;
        for (op, cols) in self.ops.iter_mut().zip(columns) {
            op.set_columns(cols);
        }
        self.decoder = decoder;
        Ok(())
    }
}

/// The shadow's differences file, opened to append (its folder made).
#[allow(clippy::type_complexity)]
fn differences_file(
    file: Option<PathBuf>,
) -> std::result::Result<Option<(PathBuf, std::io::BufWriter<std::fs::File>)>, Refused> {
    Ok(match file {
        Some(path) => {
            let opened = path
                .parent()
                .map_or(Ok(()), std::fs::create_dir_all)
                .and_then(|()| std::fs::OpenOptions::new().create(true).append(true).open(&path));
            match opened {
                Ok(f) => Some((path, std::io::BufWriter::new(f))),
                Err(e) => {
                    return Err(Refused::Failed(format!(
                        "the shadow's differences file {}: {e}",
                        path.display()
                    )))
                }
            }
        }
        None => None,
    })
}

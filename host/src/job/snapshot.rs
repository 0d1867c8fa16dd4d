//! The job's state in and out of snapshots: restored from a savepoint or checkpoint
//! (every rule of job/upgrade.rs checked before anything is loaded), captured whole for
//! the memory backend or as changes for RocksDB, with the metadata and the sinks'
//! positions at the snapshot's barrier.

use super::build::idleness;
use super::engine::Engine;
use super::upgrade::{self, Migrations, Refusal};
use super::Upgrade;
use crate::checkpoint::savepoint::{PipelineIdentity, StateFile};
use crate::checkpoint::{savepoint, OperatorMeta, Savepoint, SavepointMeta};
use crate::pipeline::Pipeline;
use crate::sink::postgres::Barrier;
use crate::sink::ResultSink;
use crate::source::Source;
use crate::state::rocks::Changes;
use crate::time::Watermarks;
use crate::window::operator::Capture;
use crate::{metrics, Error, Result};
use sha2::{Digest, Sha256};

impl Engine {
    /// Load a savepoint's state into this (fresh) job. Returns the migrations done.
    pub(super) fn restore(
        &mut self,
        pipeline: &Pipeline,
        sp: &Savepoint,
        upgrade: &Upgrade,
    ) -> Result<Migrations> {
        let refuse = |r: Refusal| match upgrade {
            Upgrade::Deploy(_) => Error::deploy(r),
            Upgrade::Resume => Error::Unfit { path: sp.path.clone(), refusal: Box::new(r) },
        };
        let meta = &sp.meta;
        if meta.pipeline.fingerprint != pipeline.state_fingerprint() {
            return Err(refuse(Refusal::OtherPipeline {
                saved: meta.pipeline.name.clone(),
                pipeline: pipeline.name.clone(),
            }));
        }
        let mut migrated = Vec::new();
        let mut snapshots = Vec::new();
        for op in &mut self.ops {
            let Some(i) = meta.operators.iter().position(|o| o.id == op.name()) else {
                return Err(refuse(Refusal::NoState(op.name().to_string())));
            };
            // Copied only to be migrated.
            let (saved, mut snap) = (&meta.operators[i], std::borrow::Cow::Borrowed(&sp.snapshots[i]));
            let (old, new) = (&saved.plugin, op.identity().clone());
            upgrade::same_logic(op.name(), old, &new).map_err(refuse)?;
            upgrade::key_arity(pipeline, &snap.slots).map_err(refuse)?;
            // Keys are interned as they are: each is what an event's key is (UTF-8 fields,
            // which results and their keys are built from), checked where the state was
            // decoded (`savepoint::read`: `decode_state` or `rocks::load`).
            debug_assert!(snap
                .slots
                .iter()
                .map(|s| &s.key)
                .chain(snap.rows.iter().map(|r| &r.key))
                .all(|k| crate::state::valid_key(k)));
            let fields = &op.plugin().info().fields;
            let unfit = snap.rows.iter().find(|r| !upgrade::row_fits(&r.values, fields));
            upgrade::rows_fit(op.name(), op.plugin(), unfit.map(|bad| (snap.rows.len(), bad)))
                .map_err(refuse)?;
            if op.has_sessions() && !meta.session_ends_closed {
                // Written when a session was `[first, last + gap)`: it is `[first, last + gap]`.
                for slot in &mut snap.to_mut().slots {
                    slot.window.end = slot.window.end.saturating_add(1);
                }
            }
            let deploying = matches!(upgrade, Upgrade::Deploy(name) if *name == new.name);
            if deploying && old.state_schema != new.state_schema {
                op.migrate(old.state_schema, snap.to_mut())
                    .map_err(|e| Error::deploy(upgrade::migration_failed(old, &new, e)))?;
                migrated.push((op.name().to_string(), old.state_schema, new.state_schema));
            } else if old.state_schema != new.state_schema {
                // (Not deploying: the same logic must read the same layout.)
                return Err(refuse(Refusal::SchemaChanged {
                    from: old.state_schema,
                    to: new.state_schema,
                    plugin: format!("{} {}", new.name, new.version),
                    savepoint: sp.path.display().to_string(),
                }));
            } else if old.sha256 != new.sha256 {
                tracing::warn!(from = %old.version, to = %new.version, "resuming with another build of the plugin (same state schema)");
            }
            snapshots.push(snap);
        }
        // Everything checked: now load.
        self.watermarks =
            Watermarks::restore(pipeline.event_time.watermark_delay_ms, idleness(pipeline), &meta.watermark);
        let wm = self.watermarks.current();
        for (op, snap) in self.ops.iter_mut().zip(&snapshots) {
            op.restore(snap, wm, meta.rows_cover_slots)?;
            // Faults are of the plugin that had them: a deploy starts afresh.
            let saved = meta.operators.iter().find(|o| o.id == op.name());
            if let Some(saved) = saved.filter(|o| o.plugin.sha256 == op.identity().sha256) {
                op.restore_faults(&saved.quarantine);
                if !saved.faults.is_empty() {
                    op.restore_faults(&crate::window::operator::SavedFaults::from_listed(&saved.faults));
                }
                // A deploy on probation goes on being judged (the control port resumes it
                // with its fault rate).
                op.restore_probation(saved.probation);
            }
        }
        self.snapshot_id = meta.snapshot_id.clone();
        self.read = meta.counters.read;
        self.filtered = meta.counters.filtered;
        self.dead_lettered = meta.counters.dead_lettered;
        self.results_out = meta.counters.emitted + meta.counters.retracted;
        Ok(migrated)
    }

    /// A consistent snapshot of the job at this point of the input: every operator's
    /// state, the source position, the watermarks, the counters, and the sinks flushed
    /// and synced to the length they have now.
    pub(super) fn snapshot(
        &mut self,
        pipeline: &Pipeline,
        source: &Source,
    ) -> Result<(SavepointMeta, Vec<Capture>)> {
        let mut snapshots = Vec::new();
        for op in &mut self.ops {
            snapshots.push(op.capture()?);
        }
        let counts = snapshots.iter().map(|s| (s.slots.len(), s.rows.len() as u64)).collect();
        let meta = self.meta(pipeline, source, counts)?;
        Ok((meta, snapshots))
    }

    /// The changes since the last checkpoint, for the incremental (RocksDB) backend, and
    /// the snapshot's metadata.
    pub(super) fn changes(
        &mut self,
        pipeline: &Pipeline,
        source: &Source,
    ) -> Result<(SavepointMeta, Vec<Changes>)> {
        let mut changes = Vec::new();
        let mut counts = Vec::new();
        for op in &mut self.ops {
            op.flush_unordered()?;
            let c = op.take_changes();
            counts.push((op.open_slots() as u64, c.rows.len() as u64));
            changes.push(c);
        }
        let meta = self.meta(pipeline, source, counts)?;
        Ok((meta, changes))
    }

    /// A new barrier in the job's lineage: a fresh snapshot id, after the previous one.
    pub(super) fn barrier(&mut self) -> Barrier {
        let id = new_snapshot_id();
        let parent = std::mem::replace(&mut self.snapshot_id, id.clone());
        Barrier { id, parent, fingerprint: self.fingerprint.clone() }
    }

    /// Metadata of a snapshot taken now; the sinks are flushed to the operating system
    /// (the snapshot's writer syncs them before it completes).
    pub(super) fn meta(
        &mut self,
        pipeline: &Pipeline,
        source: &Source,
        counts: Vec<(u64, u64)>,
    ) -> Result<SavepointMeta> {
        // A position past records that may have read a cut file's zeros is not kept.
        source.check_intact()?;
        self.write_results()?;
        let barrier = self.barrier();
        let mut sinks = Vec::new();
        if let Some(out) = self.output.as_mut() {
            sinks.extend(out.position(self.results_out, &barrier)?);
        }
        let refused = self.output.as_mut().map(ResultSink::take_refused).unwrap_or_default();
        self.dead_letter_results(refused)?;
        if let Some(late) = self.late.as_mut() {
            sinks.extend(late.position()?);
        }
        if let Some(dead) = self.dead.as_mut() {
            sinks.extend(dead.position()?);
        }
        let operators = self
            .ops
            .iter_mut()
            .zip(counts)
            .map(|(op, (slots, rows))| OperatorMeta {
                id: op.name().to_string(),
                plugin: op.identity().clone(),
                slots,
                rows,
                counters: op.counters().clone(),
                quarantine: op.saved_faults(),
                faults: Vec::new(),
                probation: op.probation(),
            })
            .collect();
        Ok(SavepointMeta {
            format: savepoint::FORMAT.into(),
            format_version: savepoint::FORMAT_VERSION,
            km0_version: env!("CARGO_PKG_VERSION").into(),
            created_at_ms: metrics::now_ms(),
            pipeline: PipelineIdentity {
                name: pipeline.name.clone(),
                fingerprint: pipeline.state_fingerprint(),
            },
            operators,
            source: source.position(),
            watermark: self.watermarks.save(),
            counters: self.counters(),
            sinks,
            state: StateFile { file: String::new(), windows: 0, bytes: 0, sha256: String::new() },
            snapshot_id: barrier.id,
            rows_cover_slots: true,
            session_ends_closed: true,
            control: self.control(),
        })
    }

    /// The control port's memory for a snapshot, with the shadow running now.
    fn control(&self) -> Option<serde_json::Value> {
        let mut control = self.ledger.clone();
        if let Some(shadow) = &self.shadow {
            let control = control.get_or_insert_with(|| serde_json::Value::Object(Default::default()));
            if let (serde_json::Value::Object(map), Ok(status)) =
                (control, serde_json::to_value(shadow.status()))
            {
                map.insert("shadow".into(), status);
            }
        }
        control
    }
}

/// A random-enough id for a snapshot: time, process and a counter, hashed.
pub(super) fn new_snapshot_id() -> String {
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
    let seed = format!("{nanos}/{}/{n}", std::process::id());
    crate::pipeline::hex(&Sha256::digest(seed.as_bytes())[..8])
}

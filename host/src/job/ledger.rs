//! What a job remembers of its live deploys across restarts and rollbacks: the deploy
//! history, the savepoints it wrote, and the deploy on probation ([`Ledger`]), kept in
//! every checkpoint and savepoint (`savepoint.json`'s `control`); and a rollback under
//! way ([`Rollback`]), marked in the checkpoint folder until the run that goes on from its
//! savepoint has a checkpoint of its own, so that a crash in the middle finishes it
//! instead of leaving the rolled-back plugin running.

use super::commands::Deployed;
use crate::pipeline::Pipeline;
use crate::sink::RewindPoint;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// The file in the checkpoint folder that marks a rollback under way.
const MARKER: &str = "rollback.json";

/// The control port's memory of a job (see the module's text).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(super) struct Ledger {
    /// Savepoints written on demand and as rollback points, oldest first.
    #[serde(default)]
    pub(super) savepoints: Vec<PathBuf>,
    #[serde(default)]
    pub(super) deployments: Vec<Deployed>,
    /// The last live deploy, while the job may still roll it back.
    #[serde(default)]
    pub(super) watch: Option<Watch>,
    /// The shadow that ran when the snapshot was taken (written by the snapshot, read
    /// when a restart starts it again).
    #[serde(default, skip_serializing)]
    pub(super) shadow: Option<super::commands::ShadowStatus>,
}

impl Ledger {
    /// The ledger a snapshot holds (none: a snapshot of km0 before ledgers, or of a job
    /// without a control port).
    pub(super) fn of(control: Option<&serde_json::Value>) -> Option<Ledger> {
        let value = control?;
        match serde_json::from_value(value.clone()) {
            Ok(ledger) => Some(ledger),
            Err(e) => {
                tracing::warn!(error = %e, "the snapshot's deploy history cannot be read; the job goes on without it");
                None
            }
        }
    }

    /// As a snapshot holds it.
    pub(super) fn to_value(&self) -> Option<serde_json::Value> {
        serde_json::to_value(self).ok()
    }
}

/// A live deploy on probation: its aggregations judge their new plugin
/// ([`crate::window::operator::WindowOperator::watch_deploy`]); one that fails it makes the
/// job roll back to `savepoint`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct Watch {
    /// Its deploy record.
    pub(super) id: u64,
    /// The aggregations it replaced.
    pub(super) aggregations: Vec<String>,
    pub(super) savepoint: PathBuf,
    /// Where the result sink stood at the savepoint.
    #[serde(default)]
    pub(super) rewind: RewindPoint,
    pub(super) rate: f64,
    /// Past its probation: watched by its circuit breaker.
    #[serde(default)]
    pub(super) kept: bool,
}

/// What a rolled-back run hands to the run that replaces it: the savepoint to restore,
/// the point to take the result sink back to, and the control port's memory.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct Rollback {
    pub(super) savepoint: PathBuf,
    #[serde(default)]
    pub(super) rewind: RewindPoint,
    #[serde(default)]
    pub(super) ledger: Ledger,
}

impl Rollback {
    fn marker(pipeline: &Pipeline) -> Option<PathBuf> {
        pipeline.checkpoints.as_ref().map(|c| c.dir.join(MARKER))
    }

    /// Mark this rollback as under way (durably) in the job's checkpoint folder: until
    /// [`Self::unmark`], a restart carries it out again rather than recovering from the
    /// checkpoints of the plugin rolled back.
    pub(super) fn mark(&self, pipeline: &Pipeline) -> Result<()> {
        let Some(path) = Self::marker(pipeline) else { return Ok(()) };
        let json =
            serde_json::to_vec_pretty(self).map_err(|e| Error::Usage(format!("rollback marker: {e}")))?;
        let tmp = path.with_extension("json.tmp");
        let written = std::fs::create_dir_all(path.parent().unwrap_or(Path::new(".")))
            .and_then(|()| {
                let mut f = std::fs::File::create(&tmp)?;
                std::io::Write::write_all(&mut f, &json)?;
                f.sync_all()
            })
            .and_then(|()| std::fs::rename(&tmp, &path))
            .and_then(|()| std::fs::File::open(path.parent().unwrap_or(Path::new(".")))?.sync_all());
        written.map_err(|e| Error::io("write the rollback marker", &path, e))
    }

    /// The rollback a crashed run left under way, when this run recovers from the job's
    /// checkpoints (not from a savepoint it was given, nor afresh).
    pub(super) fn marked(
        pipeline: &Pipeline,
        from_savepoint: bool,
        no_recover: bool,
    ) -> Result<Option<Rollback>> {
        let Some(path) = Self::marker(pipeline).filter(|_| !from_savepoint && !no_recover) else {
            return Ok(None);
        };
        let text = match std::fs::read(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io("read the rollback marker", &path, e)),
        };
        let r: Rollback = serde_json::from_slice(&text).map_err(|e| Error::Savepoint {
            path: path.clone(),
            message: format!(
                "the rollback marker cannot be read ({e}); remove it to recover from the checkpoints"
            ),
        })?;
        tracing::warn!(savepoint = %r.savepoint.display(), "a rollback was under way when the job stopped: carrying it out");
        Ok(Some(r))
    }

    /// The run that goes on from the savepoint has a checkpoint of its own: the rollback
    /// is done.
    pub(super) fn unmark(pipeline: &Pipeline) {
        if let Some(path) = Self::marker(pipeline) {
            let _ = std::fs::remove_file(path);
        }
    }
}

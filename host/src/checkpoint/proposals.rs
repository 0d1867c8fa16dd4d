//! Live deploys proposed to the processes of a consumer group, in the job's shared store:
//! the first phase of a two-phase deploy. The process asked proposes the new component;
//! every process checks it against the state of each task it owns and answers for the
//! task; the process asked commits the deploy ([`RemoteStore::record_deploy`], which
//! every process then follows) only when every task of the job is ready, and otherwise
//! aborts it with every refusing task's reason. A proposal left open past its deadline
//! (its process died) is aborted by whoever sees it.
//!
//! ```text
//! <prefix>/proposals/<id>/proposal.json    what is proposed (the component is in components/)
//! <prefix>/proposals/<id>/<task>.ready     a task that takes it
//! <prefix>/proposals/<id>/<task>.refused   a task that does not (the reason inside)
//! <prefix>/proposals/<id>/DECIDED          committed or aborted (written once)
//! ```

use super::remote::{DeployRecord, RemoteStore};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::time::Duration;

const FOLDER: &str = "proposals";
const PROPOSAL: &str = "proposal.json";
const DECIDED: &str = "DECIDED";

/// A deploy proposed to the group.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Proposal {
    pub id: String,
    pub record: DeployRecord,
    pub deadline_ms: i64,
}

/// The tasks' answers to a proposal so far.
#[derive(Debug, Default)]
pub struct Answers {
    pub ready: Vec<String>,
    /// (task, why).
    pub refused: Vec<(String, String)>,
}

impl Answers {
    /// Whether `task` has answered.
    pub fn has(&self, task: &str) -> bool {
        self.ready.iter().any(|t| t == task) || self.refused.iter().any(|(t, _)| t == task)
    }
}

/// The deploy proposals of one job's store.
#[derive(Clone, Debug)]
pub struct Proposals {
    store: RemoteStore,
}

impl Proposals {
    pub fn new(store: RemoteStore) -> Proposals {
        Proposals { store }
    }

    /// Propose `record` (its component's bytes `component`) to every process, answers due
    /// within `timeout`.
    pub fn propose(&self, record: DeployRecord, component: &[u8], timeout: Duration) -> Result<Proposal> {
        self.store.put_component(&record.sha256, component)?;
        let at = crate::metrics::now_ms();
        let id = format!("dep-{at}-{}", self.store.writer().chars().take(6).collect::<String>());
        let proposal = Proposal { id: id.clone(), record, deadline_ms: at + timeout.as_millis() as i64 };
        let body = serde_json::to_vec_pretty(&proposal)
            .map_err(|e| Error::Usage(format!("encode a proposal: {e}")))?;
        self.store.put_object(&format!("{FOLDER}/{id}/{PROPOSAL}"), body)?;
        Ok(proposal)
    }

    /// Answer proposal `id` for `task`: ready, or why not.
    pub fn answer(&self, id: &str, task: &str, answer: std::result::Result<(), String>) -> Result<()> {
        match answer {
            Ok(()) => self.store.put_object(&format!("{FOLDER}/{id}/{task}.ready"), Vec::new()),
            Err(why) => self.store.put_object(&format!("{FOLDER}/{id}/{task}.refused"), why.into_bytes()),
        }
    }

    /// The answers to proposal `id` so far.
    pub fn answers(&self, id: &str) -> Result<Answers> {
        let (_, files) = self.store.children(&format!("{FOLDER}/{id}"))?;
        let mut answers = Answers::default();
        for f in files {
            if let Some(task) = f.strip_suffix(".ready") {
                answers.ready.push(task.to_string());
            } else if let Some(task) = f.strip_suffix(".refused") {
                let why = self.store.get_object(&format!("{FOLDER}/{id}/{f}"))?.unwrap_or_default();
                answers.refused.push((task.to_string(), String::from_utf8_lossy(&why).into_owned()));
            }
        }
        Ok(answers)
    }

    /// Decide proposal `id` (once: false when it was decided already).
    pub fn decide(&self, id: &str, how: &str) -> Result<bool> {
        self.store.create_object(&format!("{FOLDER}/{id}/{DECIDED}"), how.as_bytes().to_vec())
    }

    /// The proposals not decided yet; `known` holds those found decided before (not
    /// looked at again), and gets those found decided now.
    pub fn open(&self, known: &mut std::collections::HashSet<String>) -> Result<Vec<Proposal>> {
        let (mut ids, _) = self.store.children(FOLDER)?;
        ids.retain(|id| !known.contains(id));
        ids.sort();
        let mut open = Vec::new();
        for id in ids {
            let (_, files) = self.store.children(&format!("{FOLDER}/{id}"))?;
            if files.iter().any(|f| f == DECIDED) {
                known.insert(id);
                continue;
            }
            let Some(body) = self.store.get_object(&format!("{FOLDER}/{id}/{PROPOSAL}"))? else { continue };
            match serde_json::from_slice(&body) {
                Ok(p) => open.push(p),
                Err(e) => {
                    tracing::warn!(proposal = %id, error = %e, "a deploy proposal that does not read is skipped")
                }
            }
        }
        Ok(open)
    }

    /// The job's store.
    pub fn store(&self) -> &RemoteStore {
        &self.store
    }
}

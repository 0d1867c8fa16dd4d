//! Live deploys into a job whose tasks a consumer group shares, in two phases across its
//! processes ([`crate::checkpoint::proposals`]): the process asked proposes the new
//! plugin in the shared store; every process (the one asked too, on the thread that
//! follows the store) prepares it for each task it owns, as a deploy into a job of tasks
//! does (job/fan.rs), and answers ready or why not; when every task of the job is ready,
//! the process asked records the deploy (the commit, which every process follows, and any
//! task taken later runs), then swaps it into its own tasks. One refusal aborts it
//! everywhere, with every refusing task's reason, before any task has swapped. Since the
//! record comes before any swap, a process that dies after its tasks swapped cannot leave
//! the others behind.

use super::commands::{Deployed, Refused};
use super::deployment::Deployment;
use super::fan::{ask_prepare, Fan, TaskPort};
use crate::checkpoint::proposals::{Proposal, Proposals};
use crate::checkpoint::remote::DeployRecord;
use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// How long the tasks of the whole group may take to answer a proposed deploy.
pub(super) const PROPOSAL_TIMEOUT: Duration = Duration::from_secs(30);

/// What the follower of a process keeps between looks at the proposals.
#[derive(Default)]
pub(super) struct Proposed {
    /// Proposals found decided.
    decided: HashSet<String>,
    /// (proposal, task) pairs this process answered.
    answered: HashSet<(String, String)>,
}

impl Fan<'_> {
    fn proposals(&self) -> Option<Proposals> {
        Some(Proposals::new(self.membership.as_ref()?.deploys.clone()?))
    }

    /// A live deploy asked of this process of a group (see the module's text): the
    /// reply of its own tasks' swap once the deploy is committed.
    pub(super) fn group_deploy(&self, d: Deployment, id: u64) -> std::result::Result<Deployed, Refused> {
        let Some(p) = self.proposals() else { return self.deploy(d, id) };
        let failed =
            |e: crate::Error| Refused::Failed(format!("the deploy could not be proposed to the group: {e}"));
        let record = self.record_of(&d);
        let proposal = p.propose(record.clone(), &d.component.bytes, PROPOSAL_TIMEOUT).map_err(failed)?;
        tracing::info!(proposal = %proposal.id, plugin = %record.plugin, version = %record.version, "deploy proposed to the group");
        self.proposing.store(true, Ordering::SeqCst);
        let decided = self.decide(&p, &proposal);
        let committed = decided.and_then(|()| {
            let n = p.store().record_deploy(&record, &d.component.bytes).map_err(failed)?;
            if let Some(m) = &self.membership {
                m.deploy_seen.fetch_max(n, Ordering::SeqCst);
            }
            tracing::info!(record = n, plugin = %record.plugin, version = %record.version, "deploy committed for the group");
            Ok(())
        });
        let swapped = committed.and_then(|()| match self.tasks.iter().any(|t| t.owned()) {
            true => self.deploy(d, id),
            // Committed: the other processes swap it in; none of the tasks is here.
            false => Err(Refused::Closed("deploy committed for the group; this process owns no task".into())),
        });
        self.proposing.store(false, Ordering::SeqCst);
        swapped
    }

    /// The record of a deployment as the group's processes follow it.
    fn record_of(&self, d: &Deployment) -> DeployRecord {
        let identity = d.plugins.first().map(|(_, p)| p.identity().clone()).unwrap_or_default();
        let names = self.tasks.iter().find_map(|t| {
            let s = t.handle.status();
            (!s.aggregations.is_empty())
                .then(|| s.aggregations.iter().map(|a| a.name.clone()).collect::<Vec<_>>())
        });
        let aggregations =
            d.plugins.iter().filter_map(|(i, _)| names.as_ref().and_then(|n| n.get(*i).cloned())).collect();
        DeployRecord {
            sha256: d.component.sha256.clone(),
            plugin: identity.name,
            version: identity.version,
            aggregations,
            at_ms: crate::metrics::now_ms(),
        }
    }

    /// Wait for every task's answer to `proposal`: committed (decided here) when all are
    /// ready, else aborted with every refusing task's reason.
    fn decide(&self, p: &Proposals, proposal: &Proposal) -> std::result::Result<(), Refused> {
        loop {
            std::thread::sleep(Duration::from_millis(50));
            let answers = match p.answers(&proposal.id) {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "reading the answers to a deploy proposal");
                    continue;
                }
            };
            let missing: Vec<&str> =
                self.tasks.iter().map(|t| t.name.as_str()).filter(|t| !answers.has(t)).collect();
            let late = crate::metrics::now_ms() > proposal.deadline_ms;
            if !answers.refused.is_empty() && (missing.is_empty() || late) || (late && !missing.is_empty()) {
                let mut why: Vec<String> = answers
                    .refused
                    .iter()
                    .map(|(t, e)| format!("task {t}: {}", crate::text::printable(e)))
                    .collect();
                if late {
                    why.extend(
                        missing
                            .iter()
                            .map(|t| format!("task {t}: no answer within {} s", PROPOSAL_TIMEOUT.as_secs())),
                    );
                }
                let _ = p.decide(&proposal.id, &format!("aborted: {}", why.join("; ")));
                tracing::error!(proposal = %proposal.id, refused = ?why, "deploy aborted: no task swapped it in");
                return Err(Refused::Upgrade(super::upgrade::Refusal::InTasks { tasks: why }));
            }
            if missing.is_empty() {
                return match p.decide(&proposal.id, "committed") {
                    Ok(true) => Ok(()),
                    Ok(false) => Err(Refused::Failed(
                        "the proposal was aborted meanwhile (its deadline passed)".into(),
                    )),
                    Err(e) => Err(Refused::Failed(format!("the deploy could not be committed: {e}"))),
                };
            }
        }
    }

    /// Answer the group's open proposals for the tasks this process owns (each prepared
    /// against its state); abort those past their deadline.
    pub(super) fn follow_proposals(&self, proposed: &mut Proposed) {
        let (Some(p), Some(deployer)) = (self.proposals(), self.outer.deployer.as_ref()) else { return };
        let open = match p.open(&mut proposed.decided) {
            Ok(open) => open,
            Err(e) => {
                tracing::warn!(error = %e, "looking for deploys proposed to the group");
                return;
            }
        };
        for proposal in open {
            if crate::metrics::now_ms() > proposal.deadline_ms + 2_000 {
                let _ = p.decide(&proposal.id, "aborted: its deadline passed");
                continue;
            }
            let answers = match p.answers(&proposal.id) {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "reading the answers to a deploy proposal");
                    continue;
                }
            };
            let mine: Vec<&TaskPort> = self
                .tasks
                .iter()
                .filter(|t| t.owned() && !t.handle.closed.load(Ordering::SeqCst) && !answers.has(&t.name))
                .filter(|t| !proposed.answered.contains(&(proposal.id.clone(), t.name.clone())))
                .collect();
            let Some(running) = mine.iter().find_map(|t| {
                let s = t.handle.status();
                (!s.aggregations.is_empty())
                    .then(|| s.aggregations.iter().map(|a| a.plugin.clone()).collect::<Vec<_>>())
            }) else {
                continue;
            };
            let record = &proposal.record;
            let prepared = p.store().component(&record.sha256).and_then(|bytes| {
                let aggregation = (record.aggregations.len() == 1).then(|| record.aggregations[0].as_str());
                deployer.prepare(bytes, aggregation, &running).map_err(crate::Error::from)
            });
            let results: Vec<std::result::Result<(), String>> = match prepared {
                Err(e) => mine.iter().map(|_| Err(e.to_string())).collect(),
                Ok(d) => {
                    let each: Vec<_> =
                        mine.iter().map(|t| deployer.again(&d, t.checkpoints.as_deref())).collect();
                    let (ok, bad): (Vec<_>, Vec<_>) = mine.iter().zip(each).partition(|(_, e)| e.is_ok());
                    let ok_tasks: Vec<&TaskPort> = ok.iter().map(|(t, _)| **t).collect();
                    let asked = ask_prepare(&ok_tasks, ok.into_iter().filter_map(|(_, e)| e.ok()).collect());
                    let mut by_task: Vec<(&str, std::result::Result<(), String>)> = ok_tasks
                        .iter()
                        .zip(asked)
                        .map(|(t, r)| (t.name.as_str(), r.map(drop).map_err(|e| e.to_string())))
                        .collect();
                    by_task.extend(
                        bad.into_iter()
                            .map(|(t, e)| (t.name.as_str(), e.map(drop).map_err(|e| e.to_string()))),
                    );
                    mine.iter()
                        .map(|t| {
                            by_task.iter().find(|(n, _)| *n == t.name).map_or(Ok(()), |(_, r)| r.clone())
                        })
                        .collect()
                }
            };
            for (t, r) in mine.iter().zip(results) {
                let ready = r.is_ok();
                match p.answer(&proposal.id, &t.name, r) {
                    Ok(()) => {
                        proposed.answered.insert((proposal.id.clone(), t.name.clone()));
                        tracing::info!(proposal = %proposal.id, task = %t.name, ready, "answered a deploy proposed to the group");
                    }
                    Err(e) => tracing::warn!(error = %e, "answering a deploy proposal"),
                }
            }
        }
    }
}

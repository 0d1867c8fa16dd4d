//! The tasks of a job whose partitions are shared by several processes through the Kafka
//! consumer group ([`crate::source::group`]): an unbounded Kafka source with
//! `watermark = "per-partition"`. The group decides which partitions this process owns;
//! [`Membership`] opens a task on the least loaded thread for each partition assigned,
//! and for each one revoked has its thread checkpoint the task and let it go before the
//! partition is released. A task restores from its newest complete checkpoint, which is
//! why such a job needs `[checkpoints]` (in a store every process reaches:
//! `dir = "s3://..."`, or a folder they share on one machine).

use super::commands::{ControlHandle, GroupStatus};
use super::{unbounded, RunOptions};
use crate::pipeline::Pipeline;
use crate::source::group::{GroupMember, Owner, TopicPartition};
use crate::{Error, Result};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a hand-over waits for the checkpoint store: past it, the tasks are let go
/// without their checkpoint (the next owner replays from the last one, and the
/// exactly-once sinks absorb the replay), so a store that does not answer delays no
/// rebalance for longer.
pub(super) const HAND_OVER_DEADLINE: Duration = Duration::from_secs(5);

/// What a thread is asked to do with one of the job's tasks.
pub(super) enum Order {
    /// Open the task (restored from its checkpoints) and run it.
    Open(usize),
    /// Let the task go, checkpointed first (waiting for the store until the deadline
    /// given) unless the partition is already another's; `done` is dropped once it is.
    Release { task: usize, checkpoint: Option<Instant>, done: Sender<()> },
}

/// Whether the job's tasks are shared with a consumer group: an unbounded Kafka source
/// (a bounded run reads every partition itself, as a batch over what the topic holds).
pub(super) fn shares_group(pipeline: &Pipeline, opts: &RunOptions) -> bool {
    pipeline.source.group().is_some() && opts.input.is_none() && unbounded(pipeline, opts)
}

/// A job shared with a group restores its tasks from checkpoints: it needs them (a
/// savepoint it starts from is restored once per task, by the task's first owner:
/// [`crate::checkpoint::store::Checkpoints::first_restore`]).
pub(super) fn check(pipeline: &Pipeline, opts: &RunOptions) -> Result<()> {
    if pipeline.checkpoints.is_none() {
        return Err(Error::Usage(format!(
            "pipeline {:?} reads topic partitions with `watermark = \"per-partition\"`: they are shared \
             with the other processes of its consumer group and a task that moves is restored from its checkpoints; \
             add `[checkpoints]` (dir = \"s3://bucket/prefix\" for processes on several machines), or set \
             `bounded = true` for a run over what the topic holds now",
            pipeline.name
        )));
    }
    let _ = opts;
    Ok(())
}

/// The process's share of a job in a consumer group: which task runs on which thread.
pub(super) struct Membership {
    /// Each partition's task.
    tasks: HashMap<TopicPartition, usize>,
    /// Each task's checkpoint store (a URL), if shared.
    stores: Vec<Option<String>>,
    /// Each thread's orders.
    threads: Vec<Mutex<Sender<Order>>>,
    /// Each task's thread, while this process owns it.
    placed: Mutex<HashMap<usize, usize>>,
    /// Whether this process owns each task (the control port reports only those).
    pub(super) owned: Vec<Arc<AtomicBool>>,
    /// A thread failed: the job stops, nobody answers orders any more.
    failed: Arc<AtomicBool>,
    /// The group, this process's member id in it, and what it was given and gave up.
    pub(super) group: String,
    member_id: Mutex<String>,
    assigned: AtomicU64,
    revoked: AtomicU64,
    /// The job's shared store, where live deploys are recorded for every process.
    pub(super) deploys: Option<crate::checkpoint::remote::RemoteStore>,
    /// The newest deploy record this process took, or refused (not tried again).
    pub(super) deploy_seen: AtomicU64,
    /// The group's savepoints, in the same store.
    pub(super) savepoints: Option<crate::checkpoint::group::GroupSavepoints>,
    /// The tasks a stop of the group has stopped here: not opened again.
    pub(super) stopped: Vec<AtomicBool>,
    /// When this process started (epoch ms): a stop of the group that completed since
    /// ends its part.
    pub(super) started_ms: i64,
}

impl Membership {
    /// The membership of `partitions`' tasks (task i reads partition i) on `threads`
    /// threads, with their order queues.
    pub(super) fn new(
        group: &str,
        partitions: Vec<(TopicPartition, Option<String>)>,
        threads: usize,
        failed: Arc<AtomicBool>,
        stores: (
            Option<crate::checkpoint::remote::RemoteStore>,
            Option<crate::checkpoint::group::GroupSavepoints>,
        ),
    ) -> (Arc<Membership>, Vec<Receiver<Order>>) {
        let (deploys, savepoints) = stores;
        let (senders, receivers): (Vec<_>, Vec<_>) = (0..threads).map(|_| channel()).unzip();
        let owned = partitions.iter().map(|_| Arc::new(AtomicBool::new(false))).collect();
        let stopped = partitions.iter().map(|_| AtomicBool::new(false)).collect();
        let m = Membership {
            stores: partitions.iter().map(|(_, s)| s.clone()).collect(),
            tasks: partitions.into_iter().enumerate().map(|(i, (p, _))| (p, i)).collect(),
            threads: senders.into_iter().map(Mutex::new).collect(),
            placed: Mutex::default(),
            owned,
            failed,
            group: group.into(),
            member_id: Mutex::default(),
            assigned: AtomicU64::new(0),
            revoked: AtomicU64::new(0),
            deploys,
            deploy_seen: AtomicU64::new(0),
            savepoints,
            stopped,
            started_ms: crate::metrics::now_ms(),
        };
        (Arc::new(m), receivers)
    }

    fn order(&self, thread: usize, order: Order) {
        if let Some(Ok(tx)) = self.threads.get(thread).map(Mutex::lock) {
            let _ = tx.send(order);
        }
    }

    /// Whether task `i` (`name`) may be opened here: not once a stop of the group has
    /// saved it (a store that does not answer lets it open: opening waits on the store).
    pub(super) fn may_open(&self, i: usize, name: &str) -> bool {
        if self.stopped[i].load(Ordering::SeqCst) {
            return false;
        }
        let Some(g) = &self.savepoints else { return true };
        match g.may_open(name, self.started_ms) {
            Ok(true) => true,
            Ok(false) => {
                self.stopped[i].store(true, Ordering::SeqCst);
                tracing::info!(
                    task = name,
                    "task not opened: the group is stopping with a savepoint that holds it"
                );
                false
            }
            Err(e) => {
                tracing::warn!(task = name, error = %e, "looking for a stop of the group before opening a task");
                true
            }
        }
    }

    /// Open again the tasks a stop of the group stopped here, where this process still
    /// owns them (the stop was abandoned).
    pub(super) fn reopen_stopped(&self) {
        let Ok(placed) = self.placed.lock() else { return };
        for (i, stopped) in self.stopped.iter().enumerate() {
            if stopped.swap(false, Ordering::SeqCst) {
                if let Some(&thread) = placed.get(&i) {
                    self.order(thread, Order::Open(i));
                }
            }
        }
    }

    /// This process's member id in the group.
    pub(super) fn member(&self) -> String {
        self.member_id.lock().map(|m| m.clone()).unwrap_or_default()
    }

    /// The thread that runs task `i` now, if any.
    pub(super) fn thread_of(&self, i: usize) -> Option<usize> {
        self.placed.lock().ok()?.get(&i).copied()
    }

    /// This process in the group, with the partitions it owns.
    pub(super) fn status(&self, partitions: Vec<String>) -> GroupStatus {
        GroupStatus {
            group: self.group.clone(),
            member_id: self.member_id.lock().map(|m| m.clone()).unwrap_or_default(),
            partitions,
            assigned: self.assigned.load(Ordering::Relaxed),
            revoked: self.revoked.load(Ordering::Relaxed),
        }
    }
}

impl Owner for Membership {
    fn assigned(&self, partitions: &[TopicPartition]) {
        let Ok(mut placed) = self.placed.lock() else { return };
        for p in partitions {
            let Some(&i) = self.tasks.get(p) else {
                tracing::warn!(
                    partition = %format!("{}/{}", p.0, p.1),
                    "a partition added since the job started: restart the job's processes to run it"
                );
                continue;
            };
            if placed.contains_key(&i) || self.stopped[i].load(Ordering::SeqCst) {
                continue;
            }
            let mut load = vec![0usize; self.threads.len()];
            for &t in placed.values() {
                load[t] += 1;
            }
            let thread = (0..load.len()).min_by_key(|&t| (load[t], t)).unwrap_or(0);
            placed.insert(i, thread);
            if let Some(url) = self.stores.get(i).and_then(Option::as_deref) {
                crate::checkpoint::remote::wait_again(url);
            }
            self.assigned.fetch_add(1, Ordering::Relaxed);
            self.owned[i].store(true, Ordering::SeqCst);
            self.order(thread, Order::Open(i));
        }
    }

    fn revoked(&self, partitions: &[TopicPartition], lost: bool) {
        let mut waiting = Vec::new();
        let deadline = Instant::now() + HAND_OVER_DEADLINE;
        if let Ok(mut placed) = self.placed.lock() {
            for p in partitions {
                let Some(i) = self.tasks.get(p).copied() else { continue };
                if let Some(thread) = placed.remove(&i) {
                    self.revoked.fetch_add(1, Ordering::Relaxed);
                    let (done, released) = channel();
                    let checkpoint = (!lost).then_some(deadline);
                    // Its thread may be inside a checkpoint's upload already.
                    if let Some(url) = self.stores.get(i).and_then(Option::as_deref) {
                        crate::checkpoint::remote::give_up(url, deadline);
                    }
                    self.order(thread, Order::Release { task: i, checkpoint, done });
                    waiting.push((i, released));
                }
            }
        }
        // The partitions are released once their tasks have let them go (or their thread
        // has stopped: the job failed).
        for (i, released) in waiting {
            while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                released.recv_timeout(Duration::from_millis(50))
            {
                // A thread still in the store's calls past the deadline gives up in a moment.
                if self.failed.load(Ordering::SeqCst) || Instant::now() > deadline + Duration::from_secs(2) {
                    tracing::warn!(
                        task = i,
                        "the task's hand-over did not finish by its deadline: released anyway"
                    );
                    break;
                }
            }
            self.owned[i].store(false, Ordering::SeqCst);
        }
    }
}

/// How often a process looks for a deploy recorded by another.
pub(super) const DEPLOYS_EVERY: Duration = Duration::from_secs(2);

/// Serve the group until the process leaves (a stop signal, a stop command setting
/// `leave`, or a failed task), then leave it: every task hands over first. Nothing here
/// waits on the checkpoint store: deploy records are followed on a thread of their own
/// ([`follow_deploys`]), so a store that does not answer delays no hand-over.
pub(super) fn serve(
    member: GroupMember,
    membership: &Membership,
    (leave, failed, finished): (&AtomicBool, &AtomicBool, &AtomicBool),
) {
    while !leave.load(Ordering::SeqCst) && !failed.load(Ordering::SeqCst) && !super::signals::stop_requested()
    {
        member.poll(Duration::from_millis(100));
        if let Ok(mut id) = membership.member_id.lock() {
            *id = member.member_id();
        }
    }
    if !failed.load(Ordering::SeqCst) {
        member.leave();
    }
    // The deploys and savepoints followers stop waiting for a store that does not answer.
    let now = Instant::now();
    if let Some(d) = &membership.deploys {
        d.give_up_at(now);
    }
    if let Some(g) = &membership.savepoints {
        g.give_up_at(now);
    }
    finished.store(true, Ordering::SeqCst);
}

/// Every `every`, `follow` looks at the job's shared store (deploys, savepoints of the
/// group), until the process has left its group (`finished`) or the job is `done`.
pub(super) fn follow_store(
    finished: &AtomicBool,
    done: &AtomicBool,
    every: Duration,
    follow: &mut dyn FnMut(),
) {
    let over = || finished.load(Ordering::SeqCst) || done.load(Ordering::SeqCst);
    while !over() {
        let looked = std::time::Instant::now();
        while looked.elapsed() < every {
            if over() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50).min(every));
        }
        follow();
    }
}

/// A released task's control port: closed until the task runs here again.
pub(super) fn close_port(h: &ControlHandle) {
    h.closed.store(true, Ordering::SeqCst);
    h.refuse_waiting("the task has moved to another process of the group");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(n: i32) -> Vec<TopicPartition> {
        (0..n).map(|p| ("t".to_string(), p)).collect()
    }

    #[test]
    fn assigned_partitions_open_on_the_least_loaded_thread_and_revoked_ones_are_released_first() {
        let failed = Arc::new(AtomicBool::new(false));
        let (m, inboxes) =
            Membership::new("g", parts(5).into_iter().map(|p| (p, None)).collect(), 2, failed, (None, None));
        m.assigned(&parts(3));
        let opened = |rx: &Receiver<Order>| -> Vec<usize> {
            rx.try_iter()
                .filter_map(|o| match o {
                    Order::Open(i) => Some(i),
                    Order::Release { .. } => None,
                })
                .collect()
        };
        assert_eq!(opened(&inboxes[0]), [0, 2]);
        assert_eq!(opened(&inboxes[1]), [1]);
        // Assigned again (an eager rebalance) or unknown: nothing new.
        m.assigned(&[("t".into(), 1), ("other".into(), 0)]);
        assert!(opened(&inboxes[0]).is_empty() && opened(&inboxes[1]).is_empty());
        assert!(m.owned[0].load(Ordering::SeqCst) && !m.owned[3].load(Ordering::SeqCst));

        // A revocation returns once the thread has let the task go.
        let worker = {
            let rx = inboxes.into_iter().next().unwrap();
            std::thread::spawn(move || match rx.recv_timeout(Duration::from_secs(5)) {
                Ok(Order::Release { task, checkpoint, done }) => {
                    drop(done);
                    (task, checkpoint.is_some())
                }
                _ => (usize::MAX, false),
            })
        };
        m.revoked(&[("t".into(), 2)], false);
        assert_eq!(worker.join().unwrap(), (2, true));
        assert!(!m.owned[2].load(Ordering::SeqCst) && m.owned[0].load(Ordering::SeqCst));
        assert_eq!(m.thread_of(2), None);
        let s = m.status(vec!["t/0".into()]);
        assert_eq!((s.assigned, s.revoked), (3, 1));
    }
}

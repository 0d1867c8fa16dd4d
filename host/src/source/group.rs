//! A process's membership of its job's Kafka consumer group: who owns which partition is
//! Kafka's group protocol's decision (cooperative-sticky assignment; static membership
//! when `group.instance.id` is set), as in Kafka Streams. km0 has no coordinator of its
//! own.
//!
//! The member consumer reads no records: the partitions it is given are paused at once,
//! and each is read by the task that owns it (a `KafkaSource` of its own,
//! positioned from the task's checkpoint). The member tells its [`Owner`] what it was
//! given and what it must give up: a revocation is answered only once the owner has let
//! the partitions go (their tasks checkpointed), so the next owner restores from where
//! this one stopped. Offsets are committed through the member (it holds the group's
//! generation; a commit from outside the group would be refused).

use crate::pipeline::StartAt;
use crate::pipeline::{KafkaSourceSpec, SourceSpec};
use crate::{Error, Result};
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::topic_partition_list::TopicPartitionList;
use rdkafka::{ClientConfig, ClientContext};
use std::sync::Arc;
use std::time::Duration;

/// A topic and a partition of it.
pub type TopicPartition = (String, i32);

/// What a member's partitions are for: it opens the tasks of partitions assigned to the
/// process and closes those revoked.
pub trait Owner: Send + Sync {
    /// The group gave this process `partitions` (besides those it owns).
    fn assigned(&self, partitions: &[TopicPartition]);
    /// The process must give up `partitions`; they are released once this returns.
    /// `lost`: the group already gave them to another member (this one missed its
    /// session): nothing of theirs may be written any more.
    fn revoked(&self, partitions: &[TopicPartition], lost: bool);
}

/// The rdkafka context that hands the rebalances to the owner.
pub struct MemberContext {
    owner: Arc<dyn Owner>,
}

impl ClientContext for MemberContext {}

impl ConsumerContext for MemberContext {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(tpl) = rebalance {
            let lost = consumer.assignment_lost();
            let parts = partitions_of(tpl);
            tracing::info!(partitions = ?names(&parts), lost, "partitions revoked");
            self.owner.revoked(&parts, lost);
        }
    }

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(tpl) => {
                // The member only holds the partitions: their tasks read them.
                if let Err(e) = consumer.pause(tpl) {
                    tracing::warn!(error = %e, "pausing the member's partitions");
                }
                let parts = partitions_of(tpl);
                tracing::info!(partitions = ?names(&parts), "partitions assigned");
                self.owner.assigned(&parts);
            }
            Rebalance::Error(e) => tracing::warn!(error = %e, "consumer group rebalance"),
            Rebalance::Revoke(_) => {}
        }
    }
}

fn partitions_of(tpl: &TopicPartitionList) -> Vec<TopicPartition> {
    tpl.elements().iter().map(|e| (e.topic().to_string(), e.partition())).collect()
}

fn names(parts: &[TopicPartition]) -> Vec<String> {
    parts.iter().map(|(t, p)| format!("{t}/{p}")).collect()
}

/// The member's consumer. Dropped, it closes with a deadline: rdkafka's own drop waits
/// for the close without end, and a process whose broker is gone must still exit. The
/// handle itself is left to the process's exit (a member lives as long as its job).
struct Handle(std::mem::ManuallyDrop<BaseConsumer<MemberContext>>);

/// How long a member's close may take when it is dropped.
const CLOSE_WAIT: Duration = Duration::from_secs(10);

impl std::ops::Deref for Handle {
    type Target = BaseConsumer<MemberContext>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        if self.0.closed() || self.0.close_queue().is_err() {
            return;
        }
        let t = std::time::Instant::now();
        while !self.0.closed() && t.elapsed() < CLOSE_WAIT {
            self.0.poll(Duration::from_millis(100));
        }
    }
}

/// Commits a task's checkpointed offsets through the member (cheap to clone).
#[derive(Clone)]
pub struct Committer(Arc<Handle>);

impl std::fmt::Debug for Committer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Committer")
    }
}

impl Committer {
    /// Commit `offsets` asynchronously (for Kafka's tools: km0 resumes from checkpoints).
    pub fn commit(&self, offsets: &TopicPartitionList) {
        if let Err(e) = self.0.commit(offsets, CommitMode::Async) {
            tracing::warn!(error = %e, "committing offsets to the consumer group");
        }
    }
}

/// How long leaving waits for the tasks to hand over.
const LEAVE_WAIT: Duration = Duration::from_secs(120);

/// This process in its job's consumer group.
pub struct GroupMember {
    consumer: Arc<Handle>,
    group: String,
}

/// Settings a member has unless the source's `properties` say otherwise: cooperative
/// rebalances (a member keeps the partitions that do not move), heartbeats often enough
/// that a leaving member's partitions move within a second, and a session timeout after
/// which a killed member's partitions move.
const MEMBER_DEFAULTS: [(&str, &str); 3] = [
    ("partition.assignment.strategy", "cooperative-sticky"),
    ("heartbeat.interval.ms", "500"),
    ("session.timeout.ms", "10000"),
];

impl GroupMember {
    /// Join the consumer group of source `source` (a Kafka source's `group`), subscribed
    /// to its topics; rebalances go to `owner` (from [`Self::poll`]'s thread). A file
    /// source has no group.
    pub fn join(source: &SourceSpec, owner: Arc<dyn Owner>) -> Result<GroupMember> {
        let SourceSpec::Kafka(spec) = source else {
            return Err(Error::Usage("a file source has no consumer group to join".into()));
        };
        let mut config = group_config(spec, "km0-member");
        // It fetches nothing worth keeping (its partitions are paused at once).
        config.set("queued.max.messages.kbytes", "64");
        for (k, v) in MEMBER_DEFAULTS {
            config.set(k, v);
        }
        for (k, v) in &spec.properties {
            config.set(k, v);
        }
        let kafka = |what: &str, e: rdkafka::error::KafkaError| Error::Kafka {
            brokers: spec.brokers.clone(),
            message: format!("{what} of group {:?}: {e}", spec.group),
        };
        let consumer: BaseConsumer<MemberContext> =
            config.create_with_context(MemberContext { owner }).map_err(|e| kafka("create the member", e))?;
        let topics: Vec<&str> = spec.topics.iter().map(String::as_str).collect();
        consumer.subscribe(&topics).map_err(|e| kafka("subscribe", e))?;
        tracing::info!(group = %spec.group, topics = ?spec.topics, "joining the consumer group");
        Ok(GroupMember {
            consumer: Arc::new(Handle(std::mem::ManuallyDrop::new(consumer))),
            group: spec.group.clone(),
        })
    }

    /// Serve the group protocol (heartbeats, rebalances: the owner is called from here)
    /// for up to `wait`. Records fetched before their partition was paused are dropped.
    pub fn poll(&self, wait: Duration) {
        if let Some(Err(e)) = self.consumer.poll(wait) {
            tracing::warn!(error = %e, group = %self.group, "consumer group member");
        }
    }

    pub fn committer(&self) -> Committer {
        Committer(self.consumer.clone())
    }

    pub fn group(&self) -> &str {
        &self.group
    }

    /// The member id the group coordinator gave this process (empty before it joined).
    pub fn member_id(&self) -> String {
        // SAFETY: the client pointer is valid while the consumer lives; librdkafka returns
        // a NUL-terminated copy (or null) that is freed here once.
        unsafe {
            let rk = self.consumer.client().native_ptr();
            let id = rdkafka::bindings::rd_kafka_memberid(rk);
            if id.is_null() {
                return String::new();
            }
            let s = std::ffi::CStr::from_ptr(id).to_string_lossy().into_owned();
            rdkafka::bindings::rd_kafka_mem_free(rk, id.cast());
            s
        }
    }

    /// Leave the group: every partition is revoked through the owner (its tasks hand
    /// over), and the member leaves, so the others rebalance at once (a static member,
    /// with `group.instance.id`, keeps its place until its session times out).
    pub fn leave(self) {
        tracing::info!(group = %self.group, "leaving the consumer group");
        self.consumer.unsubscribe();
        let t = std::time::Instant::now();
        while self.consumer.assignment().is_ok_and(|a| a.count() > 0) && t.elapsed() < LEAVE_WAIT {
            self.poll(Duration::from_millis(50));
        }
        // Close now (the member's LeaveGroup): the others rebalance at once, not when this
        // process's handles are dropped.
        if self.consumer.close_queue().is_ok() {
            let t = std::time::Instant::now();
            while !self.consumer.closed() && t.elapsed() < CLOSE_WAIT {
                self.poll(Duration::from_millis(20));
            }
        }
    }
}

/// What every consumer of the source's group has: its brokers and group, offsets never
/// committed by the client on its own (km0 commits checkpointed ones), and where a
/// partition with no offset starts.
pub(super) fn group_config(spec: &KafkaSourceSpec, client_id: &str) -> ClientConfig {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", &spec.brokers)
        .set("group.id", &spec.group)
        .set("client.id", client_id)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", if spec.start == StartAt::Latest { "latest" } else { "earliest" });
    config
}

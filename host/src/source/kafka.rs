//! The Kafka source: JSON records from the partitions of one or more topics.
//!
//! Like Flink's Kafka source, km0 assigns itself every partition of its topics (found in
//! the cluster's metadata) and keeps offsets in its own checkpoints, never auto-committed;
//! the consumer group only receives the checkpointed offsets once a checkpoint is
//! complete, so that lag shows in Kafka's tools. Each partition is a watermark partition.
//!
//! Partitions are read round-robin, one record from each in turn, exactly as the file
//! source reads files: while a partition is behind its end the source waits for its next
//! record instead of skipping it. The interleaving, and so which events are late and
//! what every window holds, is therefore the same in every run over the same records:
//! a replay after a failure, or the same records read from files, gives the same results.
//! Only a partition that has reached the end of its log (live, nothing new yet) is skipped.
//!
//! Memory is bounded by librdkafka's prefetch limit (`queued.max.messages.kbytes`, 8 MiB
//! per partition by default here) and the batch taken out of each partition's queue
//! ([`FETCH_BATCH`] records): the job pulls records only as fast as it processes
//! them, and [`KafkaSource::pause`] stops fetching while a sink drains.

use super::json::FRAMED_PADDING;
use super::{Framed, PartitionPosition, Position, SourcePosition, Took};
use crate::pipeline::{KafkaSourceSpec, StartAt};
use crate::{Error, Result};
use rdkafka::bindings as rdsys;
use rdkafka::bindings::rd_kafka_resp_err_t as RdKafkaRespErr;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, DefaultConsumerContext};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::Message;
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use std::ffi::CString;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a metadata or offsets request may take before the source gives up.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);
/// How long one wait for a partition's next record lasts before the consumer's own
/// events are served again.
const WAIT: Duration = Duration::from_millis(100);
/// How often the consumer's main queue (errors, commit results) is served.
const SERVICE_EVERY: Duration = Duration::from_millis(200);
/// Records between two looks at the clock for [`SERVICE_EVERY`].
const SERVICE_LOOK: u32 = 256;

type PartitionQueue = rdkafka::consumer::base_consumer::PartitionQueue<DefaultConsumerContext>;

/// Records taken from a partition's queue in one call at most.
const FETCH_BATCH: usize = 1024;

/// Records taken from one partition's queue a batch at a time and handed out one by one:
/// the queue is served (locked, its clock read) once per batch, not once per record as
/// rdkafka's per-message poll does.
struct Fetched {
    /// A reference of its own to the partition's queue (the `Part`'s split queue keeps
    /// the queue from being forwarded to the consumer's).
    queue: NonNull<rdsys::rd_kafka_queue_t>,
    msgs: Vec<*mut rdsys::rd_kafka_message_t>,
    next: usize,
}

// SAFETY: librdkafka's queues and messages may be used from any thread; a `Fetched` is
// owned by one source, used by one thread at a time.
unsafe impl Send for Fetched {}

impl Fetched {
    fn new(consumer: &BaseConsumer, topic: &str, partition: i32) -> Option<Fetched> {
        let topic = CString::new(topic).ok()?;
        // SAFETY: the client pointer is valid while the consumer lives, and the `Part`
        // holding this drops it before its split queue, which holds the consumer.
        let queue = unsafe {
            rdsys::rd_kafka_queue_get_partition(consumer.client().native_ptr(), topic.as_ptr(), partition)
        };
        NonNull::new(queue).map(|queue| Fetched { queue, msgs: Vec::with_capacity(FETCH_BATCH), next: 0 })
    }

    /// The next record: its error code and offset, its payload (none for an error) in
    /// `buf`. When none is left, takes what the queue holds, else waits up to `wait` for
    /// one record; None when nothing came.
    fn take(
        &mut self,
        wait: Duration,
        buf: &mut Vec<u8>,
        key: Option<&MessageKey>,
    ) -> Option<(rdsys::rd_kafka_resp_err_t, i64)> {
        if self.next == self.msgs.len() {
            self.next = 0;
            if self.fill(0, FETCH_BATCH) == 0
                && (wait.is_zero() || self.fill(wait.as_millis() as i32, 1) == 0)
            {
                return None;
            }
        }
        let m = self.msgs[self.next];
        self.next += 1;
        // SAFETY: `m` is a message librdkafka handed out and nobody destroyed yet; it is
        // read, then destroyed, exactly once.
        unsafe {
            let msg = &*m;
            let taken = (msg.err, msg.offset);
            buf.clear();
            if msg.err == rdsys::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR && !msg.payload.is_null() {
                buf.extend_from_slice(std::slice::from_raw_parts(msg.payload as *const u8, msg.len));
            }
            if let Some(k) = key {
                let bytes = (!msg.key.is_null())
                    .then(|| std::slice::from_raw_parts(msg.key as *const u8, msg.key_len));
                k.set(bytes);
            }
            rdsys::rd_kafka_message_destroy(m);
            Some(taken)
        }
    }

    /// Take up to `max` messages, waiting up to `timeout_ms` for them (0: not at all).
    fn fill(&mut self, timeout_ms: i32, max: usize) -> usize {
        self.msgs.clear();
        // SAFETY: the queue handle is valid and `msgs` has room for `max` pointers, of
        // which librdkafka writes the first `n` (-1 on an error: none).
        unsafe {
            let n = rdsys::rd_kafka_consume_batch_queue(
                self.queue.as_ptr(),
                timeout_ms,
                self.msgs.as_mut_ptr(),
                max,
            );
            self.msgs.set_len(n.clamp(0, max as isize) as usize);
        }
        self.msgs.len()
    }
}

impl Drop for Fetched {
    fn drop(&mut self) {
        // SAFETY: the messages not handed out yet are destroyed once, then the queue
        // reference this holds.
        unsafe {
            for &m in &self.msgs[self.next..] {
                rdsys::rd_kafka_message_destroy(m);
            }
            rdsys::rd_kafka_queue_destroy(self.queue.as_ptr());
        }
    }
}

struct Part {
    topic: String,
    id: i32,
    name: String,
    /// Dropped before `_split` (fields drop in order).
    fetched: Fetched,
    /// The partition's queue split from the consumer's: kept for that.
    _split: PartitionQueue,
    /// Offset of the next record to hand out.
    next_offset: i64,
    records: u64,
    /// Bounded runs stop at this offset (the end when the run started).
    stop: Option<i64>,
    /// The fetcher reached the end of the log and nothing arrived since.
    at_end: bool,
    done: bool,
}

/// Lag of one partition: records in the log not yet handed to the job.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PartitionLag {
    pub partition: String,
    /// The log's end (high watermark) when asked.
    pub high_watermark: i64,
    /// The next offset the job reads.
    pub position: i64,
    pub lag: i64,
}

/// Every partition of the configured topics, read round-robin.
pub struct KafkaSource {
    consumer: Arc<BaseConsumer>,
    parts: Vec<Part>,
    next: usize,
    ended: Vec<u32>,
    /// Partitions that ended when a run of records found every partition at its end:
    /// reported with the next call's `End` ([`Self::next_records_framed`]).
    ended_after_run: Vec<u32>,
    buf: Vec<u8>,
    brokers: String,
    last_service: Instant,
    /// Calls of [`Self::next_record`] since the clock was last looked at for
    /// [`SERVICE_EVERY`].
    unserviced: u32,
    paused: bool,
    /// Where each record's message key goes, for a job that checks it.
    message_key: Option<MessageKey>,
    /// Offsets are committed through the process's group member (a task of a job that
    /// shares its partitions with a consumer group).
    committer: Option<super::group::Committer>,
}

/// The message key of the record the source handed out last (Kafka), for a job whose
/// tasks own the keys of their partition: it checks that the record's key fields are its
/// message key.
#[derive(Clone, Default)]
pub struct MessageKey(Arc<std::sync::Mutex<Option<Vec<u8>>>>);

impl MessageKey {
    fn set(&self, key: Option<&[u8]>) {
        if let Ok(mut k) = self.0.lock() {
            match (key, k.as_mut()) {
                (Some(new), Some(old)) => {
                    old.clear();
                    old.extend_from_slice(new);
                }
                (new, _) => *k = new.map(<[u8]>::to_vec),
            }
        }
    }

    /// Why the record's key fields (`fields`, the leading ones of the job's key) are not
    /// its message key (fields joined by `|`), if they are not.
    pub fn disagrees(&self, fields: &[&[u8]], names: &[String]) -> Option<String> {
        let k = self.0.lock().ok()?;
        let Some(key) = k.as_deref() else {
            return Some(format!(
                "it has no message key: the job's tasks own keys by partition, and `source.partitioned_by` {names:?} \
                 needs the records keyed by those fields"
            ));
        };
        let joined = fields.join(&b'|');
        // Quoted at most 200 bytes each: a reason is a line of a log and of the status.
        let quote = |b: &[u8]| {
            let text = String::from_utf8_lossy(&b[..b.len().min(200)]).into_owned();
            if b.len() > 200 {
                format!("{text}...")
            } else {
                text
            }
        };
        (joined != key).then(|| {
            format!(
                "its message key {:?} is not its `source.partitioned_by` fields {names:?} ({:?}): it may be in \
                 another partition than the rest of its key's records",
                quote(key),
                quote(&joined)
            )
        })
    }
}

fn kafka_error(brokers: &str, what: impl std::fmt::Display, e: KafkaError) -> Error {
    Error::Kafka { brokers: brokers.to_string(), message: format!("{what}: {e}") }
}

/// Every partition of the source's topics, in (topic, partition) order: a job whose
/// partitions are tasks has one task each.
pub fn partitions(spec: &KafkaSourceSpec) -> Result<Vec<(String, i32)>> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &spec.brokers)
        .set("client.id", "km0")
        .create()
        .map_err(|e| kafka_error(&spec.brokers, "create the consumer", e))?;
    topic_partitions(&consumer, spec)
}

fn topic_partitions(consumer: &BaseConsumer, spec: &KafkaSourceSpec) -> Result<Vec<(String, i32)>> {
    let brokers = &spec.brokers;
    let mut found = Vec::new();
    for topic in &spec.topics {
        let md = consumer
            .fetch_metadata(Some(topic), REQUEST_TIMEOUT)
            .map_err(|e| kafka_error(brokers, format!("read the metadata of topic {topic:?}"), e))?;
        let t = md.topics().iter().find(|t| t.name() == topic);
        let mut ids: Vec<i32> =
            t.map(|t| t.partitions().iter().map(|p| p.id()).collect()).unwrap_or_default();
        if ids.is_empty() || t.and_then(|t| t.error()).is_some() {
            return Err(Error::Kafka {
                brokers: brokers.clone(),
                message: format!("topic {topic:?} does not exist (create it before starting the job)"),
            });
        }
        ids.sort_unstable();
        found.extend(ids.into_iter().map(|id| (topic.clone(), id)));
    }
    Ok(found)
}

/// The source's consumer, configured (a task's takes no `group.instance.id`: only the
/// job's group member joins the group, as that one instance).
fn consumer(spec: &KafkaSourceSpec) -> Result<Arc<BaseConsumer>> {
    let mut config = super::group::group_config(spec, "km0");
    config
        .set("enable.partition.eof", "true")
        .set("queued.max.messages.kbytes", "8192")
        // Fetch again soon after the job drained a partition's queue.
        .set("fetch.queue.backoff.ms", "20")
        .set("fetch.wait.max.ms", "100");
    // A task's consumer is assigned its partition: only the job's group member (if
    // any) joins the group, as that one instance.
    for (k, v) in spec.properties.iter().filter(|(k, _)| !(spec.only.is_some() && *k == "group.instance.id"))
    {
        config.set(k, v);
    }
    let consumer: BaseConsumer =
        config.create().map_err(|e| kafka_error(&spec.brokers, "create the consumer", e))?;
    Ok(Arc::new(consumer))
}

/// The group's committed offsets of `found`, when the source starts from them.
fn committed_offsets(
    consumer: &BaseConsumer,
    spec: &KafkaSourceSpec,
    found: &[(String, i32)],
) -> Result<Option<TopicPartitionList>> {
    Ok(if spec.start == StartAt::Committed {
        let mut tpl = TopicPartitionList::new();
        for (t, id) in found {
            tpl.add_partition(t, *id);
        }
        Some(
            consumer.committed_offsets(tpl, REQUEST_TIMEOUT).map_err(|e| {
                kafka_error(&spec.brokers, format!("read group {:?}'s offsets", spec.group), e)
            })?,
        )
    } else {
        None
    })
}

/// Where partition `(topic, id)` starts: its name, its first offset, where a bounded run
/// stops, and the records read of it before.
fn start_at(
    consumer: &BaseConsumer,
    spec: &KafkaSourceSpec,
    resume: Option<&SourcePosition>,
    committed: Option<&TopicPartitionList>,
    (topic, id): (&str, i32),
) -> Result<(String, i64, i64, u64)> {
    let brokers = &spec.brokers;
    let name = format!("{topic}/{id}");
    let (low, high) = consumer
        .fetch_watermarks(topic, id, REQUEST_TIMEOUT)
        .map_err(|e| kafka_error(brokers, format!("read the offsets of {name}"), e))?;
    let saved = resume.and_then(|r| r.partitions.iter().find(|p| p.name == name));
    let from_group = committed.and_then(|c| c.find_partition(topic, id)).and_then(|e| match e.offset() {
        Offset::Offset(o) => Some(o),
        _ => None,
    });
    let start = match (saved, spec.start) {
        (Some(p), _) => i64::try_from(p.offset).unwrap_or(i64::MAX),
        // A partition added since the checkpoint is read from its start.
        (None, _) if resume.is_some() => low,
        (None, StartAt::Latest) => high,
        (None, StartAt::Committed) => from_group.unwrap_or(low),
        (None, StartAt::Earliest) => low,
    };
    if start > high {
        return Err(Error::Kafka {
            brokers: brokers.clone(),
            message: format!(
                "{name}: the checkpoint resumes at offset {start} but the log ends at {high}: was the topic \
                         recreated? Start without the checkpoint (`--no-recover`) to read it anew"
            ),
        });
    }
    if start < low {
        tracing::warn!(partition = %name, start, low, "records before the log's start were deleted by retention");
    }
    // A bounded run stops where it would have stopped without the restart.
    let stop = saved.and_then(|p| p.stop).map_or(high, |s| i64::try_from(s).unwrap_or(high));
    Ok((name, start.max(low), stop, saved.map_or(0, |p| p.records)))
}

/// A queue of its own for each partition, read from `starts`.
fn parts(
    consumer: &Arc<BaseConsumer>,
    spec: &KafkaSourceSpec,
    found: Vec<(String, i32)>,
    starts: Vec<(String, i64, i64, u64)>,
) -> Result<Vec<Part>> {
    let brokers = &spec.brokers;
    let mut parts = Vec::with_capacity(found.len());
    for ((topic, id), (name, start, end, records)) in found.into_iter().zip(starts) {
        let queue = consumer.split_partition_queue(&topic, id).ok_or_else(|| Error::Kafka {
            brokers: brokers.clone(),
            message: format!("no queue for {name}"),
        })?;
        let fetched = Fetched::new(consumer, &topic, id).ok_or_else(|| Error::Kafka {
            brokers: brokers.clone(),
            message: format!("no queue for {name}"),
        })?;
        parts.push(Part {
            topic,
            id,
            name,
            fetched,
            _split: queue,
            next_offset: start,
            records,
            stop: spec.bounded.then_some(end),
            at_end: false,
            done: false,
        });
    }
    Ok(parts)
}

impl KafkaSource {
    /// Connect, find the topics' partitions and position each one: at its offset in
    /// `resume` (matched by topic/partition), else where `spec.start` says.
    pub fn open(spec: &KafkaSourceSpec, resume: Option<&SourcePosition>) -> Result<KafkaSource> {
        let brokers = spec.brokers.clone();
        let consumer = consumer(spec)?;
        if let Some(r) = resume {
            if r.kind != "kafka" {
                return Err(Error::Usage(format!(
                    "the checkpoint or savepoint was taken reading a {} source; this pipeline reads Kafka",
                    r.kind
                )));
            }
        }
        // Every partition of every topic, in (topic, partition) order (one, for a task).
        let mut found = topic_partitions(&consumer, spec)?;
        if let Some(only) = &spec.only {
            found.retain(|p| p == only);
        }
        // Starting offsets: the checkpoint's, else the configured start.
        let committed = committed_offsets(&consumer, spec, &found)?;
        let mut assignment = TopicPartitionList::new();
        let mut starts = Vec::new();
        for (topic, id) in &found {
            let start = start_at(&consumer, spec, resume, committed.as_ref(), (topic, *id))?;
            assignment
                .add_partition_offset(topic, *id, Offset::Offset(start.1))
                .map_err(|e| kafka_error(&brokers, format!("position {}", start.0), e))?;
            starts.push(start);
        }
        consumer.assign(&assignment).map_err(|e| kafka_error(&brokers, "assign the partitions", e))?;
        let parts = parts(&consumer, spec, found, starts)?;
        let next = resume.map_or(0, |r| r.next as usize % parts.len().max(1));
        tracing::info!(partitions = parts.len(), group = %spec.group, bounded = spec.bounded, "kafka source assigned");
        Ok(KafkaSource {
            consumer,
            parts,
            next,
            ended: Vec::new(),
            ended_after_run: Vec::new(),
            buf: Vec::with_capacity(1024),
            brokers,
            last_service: Instant::now(),
            unserviced: 0,
            paused: false,
            message_key: None,
            committer: None,
        })
    }

    /// Records handed out so far, over all partitions (including before a resume).
    pub fn records(&self) -> u64 {
        self.parts.iter().map(|p| p.records).sum()
    }

    pub fn partitions(&self) -> usize {
        self.parts.len()
    }

    /// `topic/partition`.
    pub fn partition_name(&self, p: u32) -> String {
        self.parts[p as usize].name.clone()
    }

    /// Keep each record's message key in `key` (see [`MessageKey`]).
    pub fn keep_message_keys(&mut self, key: MessageKey) {
        self.message_key = Some(key);
    }

    /// Commit checkpointed offsets through the group member (see [`super::group`]).
    pub fn commit_through(&mut self, committer: super::group::Committer) {
        self.committer = Some(committer);
    }

    /// Partitions that reached their stop offset since the last call (bounded runs).
    pub fn take_ended(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.ended)
    }

    /// Serve the consumer's own events (errors, commit results); a fatal error ends the run.
    fn service(&mut self) -> Result<()> {
        // While records flow, the clock is read once every SERVICE_LOOK records, not once a
        // record; a call that finds none looks at it (`next_record`).
        self.unserviced += 1;
        if self.unserviced < SERVICE_LOOK {
            return Ok(());
        }
        self.unserviced = 0;
        if self.last_service.elapsed() < SERVICE_EVERY {
            return Ok(());
        }
        self.serve_events()
    }

    /// Serve the consumer's own events now.
    fn serve_events(&mut self) -> Result<()> {
        self.last_service = Instant::now();
        while let Some(event) = self.consumer.poll(Duration::ZERO) {
            match event {
                Ok(m) => tracing::warn!(
                    topic = m.topic(),
                    partition = m.partition(),
                    "record on the main queue ignored"
                ),
                Err(e @ KafkaError::MessageConsumptionFatal(_)) => {
                    return Err(kafka_error(&self.brokers, "consume", e))
                }
                Err(e) => tracing::warn!(error = %e, "kafka consumer"),
            }
        }
        Ok(())
    }

    /// [`Self::next_record`]s, offered first to `take` as a file's lines are (see
    /// [`super::file::FileSource::next_records_framed`]): the message followed by a line
    /// break and [`FRAMED_PADDING`] bytes, so that the layout scan reads it the way it
    /// reads a file, without a bounds check a field. A message with a line break of its
    /// own (`\n` or `\r`, which the scan would take for the record's end) goes the other
    /// way, whole.
    ///
    /// Up to `most` records (at least one) in a call, as a file's (the partitions still
    /// in turn, a record from each; one message an offer, `take` may take one): the first
    /// one `take` declines ends the run and is returned ([`Framed::Record`]); the end of a
    /// partition ends it too. [`Framed::Taken`]: `take` took every record read.
    pub fn next_records_framed(
        &mut self,
        most: u64,
        mut take: impl FnMut(&[u8], Position, u64, &mut Took) -> Result<()>,
    ) -> Result<Framed<'_>> {
        // The partitions that ended with the input read at the end of the last run: this
        // call is the `End` they came with, as when records came one a call.
        if !self.ended_after_run.is_empty() {
            self.ended.append(&mut self.ended_after_run);
            return Ok(Framed::End);
        }
        let mut taken = 0;
        while taken < most.max(1) {
            let ended_before = self.ended.len();
            let Some((_, pos)) = self.next_record()? else {
                if taken > 0 {
                    // Every partition is at its end for now: the records taken come first,
                    // and the partitions that ended just now are the next call's.
                    self.ended_after_run.extend(self.ended.drain(ended_before..));
                }
                break;
            };
            let len = self.buf.len();
            if memchr::memchr2(b'\n', b'\r', &self.buf).is_some() {
                return Ok(Framed::Record(&self.buf, pos));
            }
            self.buf.push(b'\n');
            self.buf.resize(len + 1 + FRAMED_PADDING, 0);
            let mut took = Took::default();
            let result = take(&self.buf, pos, 1, &mut took);
            self.buf.truncate(len);
            result?;
            if took.records == 0 {
                return Ok(Framed::Record(&self.buf, pos));
            }
            // The scan takes a record up to a line break, and the message has none.
            debug_assert_eq!(took, Took { records: 1, bytes: len + 1 });
            taken += 1;
            // A partition that ended is reported after the record it ended before (it no
            // longer holds the watermark back from the next one on), as one at a time.
            if !self.ended.is_empty() {
                break;
            }
        }
        Ok(if taken > 0 { Framed::Taken } else { Framed::End })
    }

    /// The next record of the next partition that has one; `None` when every partition
    /// is at its end (for now, or for good in a bounded run).
    pub fn next_record(&mut self) -> Result<Option<(&[u8], Position)>> {
        self.service()?;
        let n = self.parts.len();
        for _ in 0..n {
            let p = self.next;
            self.next = (self.next + 1) % n;
            if self.parts[p].done {
                continue;
            }
            if self.parts[p].stop.is_some_and(|s| self.parts[p].next_offset >= s) {
                self.parts[p].done = true;
                self.ended.push(p as u32);
                continue;
            }
            // Wait for this partition's next record unless it is at the log's end.
            loop {
                let part = &mut self.parts[p];
                let wait = if part.at_end || self.paused { Duration::ZERO } else { WAIT };
                let got = match part.fetched.take(wait, &mut self.buf, self.message_key.as_ref()) {
                    Some((RdKafkaRespErr::RD_KAFKA_RESP_ERR_NO_ERROR, offset)) => Ok(offset),
                    Some((RdKafkaRespErr::RD_KAFKA_RESP_ERR__PARTITION_EOF, _)) => {
                        Err(KafkaError::PartitionEOF(part.id))
                    }
                    Some((RdKafkaRespErr::RD_KAFKA_RESP_ERR__FATAL, _)) => {
                        Err(KafkaError::MessageConsumptionFatal(RDKafkaErrorCode::Fatal))
                    }
                    Some((code, _)) => Err(KafkaError::MessageConsumption(code.into())),
                    None => {
                        if part.at_end || self.paused {
                            break;
                        }
                        self.serve_events()?;
                        continue;
                    }
                };
                match got {
                    Ok(offset) => {
                        part.at_end = false;
                        part.next_offset = offset + 1;
                        part.records += 1;
                        let pos = Position { partition: p as u32, line: 0, offset: offset as u64 };
                        return Ok(Some((&self.buf, pos)));
                    }
                    Err(KafkaError::PartitionEOF(_)) => {
                        part.at_end = true;
                        // A bounded partition whose log ends before its stop offset
                        // (compaction, transaction markers) is done.
                        if part.stop.is_some() {
                            part.done = true;
                            self.ended.push(p as u32);
                        }
                        break;
                    }
                    Err(e @ KafkaError::MessageConsumptionFatal(_)) => {
                        return Err(kafka_error(&self.brokers, format!("consume {}", part.name), e))
                    }
                    Err(e) => {
                        // Retry the same partition: skipping it would change the order.
                        tracing::warn!(partition = %part.name, error = %e, "kafka partition");
                        std::thread::sleep(WAIT);
                        self.serve_events()?;
                    }
                }
            }
        }
        // Nothing to hand out (every partition at its end, or paused): serve the events
        // when due, as while records flow.
        if self.last_service.elapsed() >= SERVICE_EVERY {
            self.serve_events()?;
        }
        Ok(None)
    }

    pub fn position(&self) -> SourcePosition {
        SourcePosition {
            kind: "kafka".into(),
            partitions: self
                .parts
                .iter()
                .enumerate()
                .map(|(i, p)| PartitionPosition {
                    partition: i as u32,
                    name: p.name.clone(),
                    offset: p.next_offset.max(0) as u64,
                    lines: 0,
                    records: p.records,
                    stop: p.stop.map(|s| s.max(0) as u64),
                })
                .collect(),
            next: self.next as u32,
        }
    }

    /// A checkpoint holding `pos` is complete: commit its offsets to the consumer group
    /// (asynchronously; only for monitoring, km0 resumes from its checkpoints).
    pub fn checkpoint_complete(&self, pos: &SourcePosition) {
        let mut tpl = TopicPartitionList::new();
        for (pp, part) in pos.partitions.iter().zip(&self.parts) {
            if tpl.add_partition_offset(&part.topic, part.id, Offset::Offset(pp.offset as i64)).is_err() {
                return;
            }
        }
        match &self.committer {
            Some(member) => member.commit(&tpl),
            None => {
                if let Err(e) = self.consumer.commit(&tpl, CommitMode::Async) {
                    tracing::warn!(error = %e, "committing offsets to the consumer group");
                }
            }
        }
    }

    /// Stop fetching (a sink is draining); records already fetched stay queued.
    pub fn pause(&mut self) -> Result<()> {
        if !self.paused {
            self.consumer
                .pause(&self.assignment())
                .map_err(|e| kafka_error(&self.brokers, "pause the partitions", e))?;
            self.paused = true;
        }
        Ok(())
    }

    pub fn resume(&mut self) -> Result<()> {
        if self.paused {
            self.consumer
                .resume(&self.assignment())
                .map_err(|e| kafka_error(&self.brokers, "resume the partitions", e))?;
            self.paused = false;
        }
        Ok(())
    }

    fn assignment(&self) -> TopicPartitionList {
        let mut tpl = TopicPartitionList::new();
        for p in &self.parts {
            tpl.add_partition(&p.topic, p.id);
        }
        tpl
    }

    /// Lag per partition from the log ends the consumer learnt with its last fetch
    /// responses (no request: cheap enough for the processing loop). A partition not
    /// fetched from yet reports a log end of -1.
    pub fn cached_lag(&self) -> Vec<PartitionLag> {
        self.parts
            .iter()
            .map(|p| {
                let (mut low, mut high) = (-1i64, -1i64);
                if let Ok(topic) = std::ffi::CString::new(p.topic.as_str()) {
                    // SAFETY: the client pointer is valid while `self.consumer` lives, the
                    // topic is a NUL-terminated string and the outputs are plain i64s;
                    // librdkafka only reads its own cache here.
                    unsafe {
                        rdkafka::bindings::rd_kafka_get_watermark_offsets(
                            self.consumer.client().native_ptr(),
                            topic.as_ptr(),
                            p.id,
                            &mut low,
                            &mut high,
                        );
                    }
                }
                PartitionLag {
                    partition: p.name.clone(),
                    high_watermark: high,
                    position: p.next_offset,
                    lag: if high < 0 { 0 } else { (high - p.next_offset).max(0) },
                }
            })
            .collect()
    }

    /// Lag per partition, asking the brokers for the logs' ends.
    pub fn lag(&self) -> Result<Vec<PartitionLag>> {
        self.parts
            .iter()
            .map(|p| {
                let (_, high) = self
                    .consumer
                    .fetch_watermarks(&p.topic, p.id, Duration::from_secs(3))
                    .map_err(|e| kafka_error(&self.brokers, format!("read the offsets of {}", p.name), e))?;
                Ok(PartitionLag {
                    partition: p.name.clone(),
                    high_watermark: high,
                    position: p.next_offset,
                    lag: (high - p.next_offset).max(0),
                })
            })
            .collect()
    }
}

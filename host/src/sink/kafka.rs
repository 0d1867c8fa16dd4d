//! Kafka sinks: keyed results (upsert or transactional) and the dead-letter topic.
//!
//! Every producer is idempotent with `acks=all`, so a retried send never duplicates a
//! record. A **barrier** (at every checkpoint) waits until everything sent is
//! acknowledged: a checkpoint then never covers results that are not in Kafka.
//!
//! - **Upsert** (the default for results): records keyed `window_start|key`; after a
//!   failure the job replays from its last checkpoint and writes the same keys with the
//!   same values (km0's replays are deterministic), so the keyed view of the topic (a
//!   compacted topic, a table built from it) is exactly-once in effect.
//! - **Transactional**: the results of one checkpoint epoch form one Kafka transaction,
//!   committed after the checkpoint is durable; `read_committed` readers see each epoch
//!   whole or not at all. A restarted job's `init_transactions` fences and aborts the
//!   transaction its predecessor left open. The broker must support transactions
//!   (EndTxn, API key 26): km0 asks the broker at start-up and refuses with a clear error
//!   naming the alternatives when it does not.

use crate::pipeline::{KafkaSinkMode, KafkaTarget};
use crate::{Error, Result};
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{BaseProducer, BaseRecord, DeliveryResult, Producer, ProducerContext};
use rdkafka::ClientContext;
use std::io::{Read, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// librdkafka's default `message.max.bytes`.
const DEFAULT_MESSAGE_MAX_BYTES: usize = 1_000_000;
/// What a record costs beyond its key and value in librdkafka's size check (record
/// and batch headers), rounded up.
const RECORD_OVERHEAD: usize = 512;

/// How long a barrier waits for the brokers to acknowledge what was sent.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(60);
const TXN_TIMEOUT: Duration = Duration::from_secs(30);

/// A record the broker (or the producer) refused for what it is, not for a failure that
/// affects everything: its key, value and the reason, for the dead-letter output.
pub type Refused = (Vec<u8>, Vec<u8>, String);

/// Failed deliveries: records refused for themselves (dead-lettered by the job), and a
/// count of the others with the first failure (reported at the next barrier).
#[derive(Default)]
pub struct Deliveries {
    /// In a transaction every failed record aborts it: nothing is refused alone.
    transactional: bool,
    failed: AtomicU64,
    first_error: Mutex<Option<String>>,
    refused: Mutex<Vec<Refused>>,
}

impl ClientContext for Deliveries {}

impl ProducerContext for Deliveries {
    type DeliveryOpaque = ();
    fn delivery(&self, result: &DeliveryResult<'_>, _: ()) {
        use rdkafka::Message;
        let Err((e, msg)) = result else { return };
        if !self.transactional && refuses_the_record(e) {
            let r = (
                msg.key().unwrap_or_default().to_vec(),
                msg.payload().unwrap_or_default().to_vec(),
                format!("Kafka refused the record: {e}"),
            );
            if let Ok(mut refused) = self.refused.lock() {
                refused.push(r);
                return;
            }
        }
        self.failed.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut first) = self.first_error.lock() {
            first.get_or_insert_with(|| e.to_string());
        }
    }
}

/// Errors about one record (too large, invalid): that record is dead-lettered and the
/// job goes on. Every other error (brokers unreachable, authorisation, timeouts) fails.
fn refuses_the_record(e: &KafkaError) -> bool {
    matches!(
        e.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::MessageSizeTooLarge
                | RDKafkaErrorCode::InvalidMessage
                | RDKafkaErrorCode::InvalidMessageSize
                | RDKafkaErrorCode::InvalidRecord
                | RDKafkaErrorCode::MessageBatchTooLarge
        )
    )
}

/// Delivery reports served per [`KafkaSink::serve`] call at most (each report may cover
/// many records).
const SERVE_MAX_EVENTS: usize = 1024;

/// A producer to one topic. Its delivery reports are served on the job's thread (before
/// the sink's state is read, and while a full queue is waited for): rdkafka's polling
/// thread wakes every 100 ms and spins on the clock through the last millisecond of each
/// wait, about 1 % of a core for nothing.
pub struct KafkaSink {
    producer: BaseProducer<Deliveries>,
    target: KafkaTarget,
    transactional: bool,
    /// Unacknowledged records above which the job pauses its source.
    max_in_flight: usize,
    /// The producer's `message.max.bytes`: a larger record is refused before it is sent.
    max_message_bytes: usize,
}

impl KafkaSink {
    /// Connect; `purpose` names the sink in errors. A transactional sink checks that the
    /// broker has transactions, fences its predecessor and opens the first transaction.
    pub fn open(target: &KafkaTarget, mode: KafkaSinkMode, transactional_id: &str) -> Result<KafkaSink> {
        let transactional = mode == KafkaSinkMode::Transactional;
        let err = |message: String| Error::Kafka { brokers: target.brokers.clone(), message };
        let plaintext = target
            .properties
            .iter()
            .find(|(k, _)| k == "security.protocol")
            .is_none_or(|(_, v)| v.eq_ignore_ascii_case("plaintext"));
        // The probe speaks plain TCP; with TLS or SASL, init_transactions says it instead.
        if transactional && plaintext {
            let apis = broker_apis(&target.brokers)
                .map_err(|e| err(format!("ask the broker its API versions: {e}")))?;
            if !apis.contains(&END_TXN) {
                return Err(err(format!(
                    "`[sink] mode = \"transactional\"` needs Kafka transactions, and this broker does not support them \
                     (no EndTxn, API key {END_TXN}): use `mode = \"upsert\"` (idempotent keyed results, exactly-once \
                     in effect) or `kind = \"postgres\"` (results and progress committed in one database transaction)"
                )));
            }
        }
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", &target.brokers)
            .set("client.id", "km0")
            .set("enable.idempotence", "true")
            .set("acks", "all")
            // Results come in bursts when windows fire; a longer linger batches them.
            // librdkafka's broker thread spins (100% of a core) while a batch is due and
            // the partition already has its 5 idempotent requests in flight, so every
            // request the linger saves is time the broker may take to acknowledge without
            // a spin. km0's CPU on the Kafka benchmark (1M records, tansu): 2.3 s at
            // 5 ms, 0.63 to 0.97 s at 200 ms (spins of ~0.3 s while tansu stalled),
            // 0.62 to 0.65 s at 1 s. Results reach the topic within a second of their
            // window firing; barriers flush at once; `[sink.properties]` may set another.
            .set("linger.ms", "1000")
            .set("queue.buffering.max.kbytes", "32768")
            .set("queue.buffering.max.messages", "100000");
        if transactional {
            // Longer than any sane checkpoint interval: a transaction spans one epoch.
            config.set("transactional.id", transactional_id).set("transaction.timeout.ms", "900000");
        }
        for (k, v) in &target.properties {
            config.set(k, v);
        }
        let producer: BaseProducer<Deliveries> = config
            .create_with_context(Deliveries { transactional, ..Deliveries::default() })
            .map_err(|e| err(format!("create the producer for topic {:?}: {e}", target.topic)))?;
        // The topic must exist: a typo should fail now, not at the first result.
        let md = producer
            .client()
            .fetch_metadata(Some(&target.topic), Duration::from_secs(15))
            .map_err(|e| err(format!("read the metadata of topic {:?}: {e}", target.topic)))?;
        let exists = md
            .topics()
            .iter()
            .any(|t| t.name() == target.topic && t.error().is_none() && !t.partitions().is_empty());
        if !exists {
            return Err(err(format!(
                "topic {:?} does not exist (create it before starting the job)",
                target.topic
            )));
        }
        if transactional {
            producer.init_transactions(TXN_TIMEOUT).map_err(|e| err(format!("init transactions: {e}")))?;
            producer.begin_transaction().map_err(|e| err(format!("begin a transaction: {e}")))?;
        }
        let max_message_bytes = target
            .properties
            .iter()
            .find(|(k, _)| k == "message.max.bytes")
            .and_then(|(_, v)| v.parse().ok())
            .unwrap_or(DEFAULT_MESSAGE_MAX_BYTES);
        Ok(KafkaSink {
            producer,
            target: target.clone(),
            transactional,
            max_in_flight: 50_000,
            max_message_bytes,
        })
    }

    pub fn transactional(&self) -> bool {
        self.transactional
    }

    /// Why this record cannot be sent, if it cannot: larger than `message.max.bytes`.
    pub fn refuses(&self, key: &[u8], value: &[u8]) -> Option<String> {
        let size = key.len() + value.len() + RECORD_OVERHEAD;
        (size > self.max_message_bytes).then(|| {
            format!(
                "a record of {} bytes (key and value) does not fit the Kafka sink's message.max.bytes ({}) for topic {:?}",
                key.len() + value.len(),
                self.max_message_bytes,
                self.target.topic
            )
        })
    }

    /// The producer's `message.max.bytes`.
    pub fn max_message_bytes(&self) -> usize {
        self.max_message_bytes
    }

    /// Records the broker or the producer refused for themselves since the last call.
    pub fn take_refused(&mut self) -> Vec<Refused> {
        self.serve();
        self.producer.context().refused.lock().map(|mut r| std::mem::take(&mut *r)).unwrap_or_default()
    }

    /// Send one record (no value: a tombstone), waiting while the producer's queue is
    /// full (backpressure). A record refused for itself is kept for [`Self::take_refused`].
    pub fn send(
        &mut self,
        key: Option<&[u8]>,
        value: Option<&[u8]>,
        headers: Option<OwnedHeaders>,
    ) -> Result<()> {
        let mut record = BaseRecord::<[u8], [u8]>::to(&self.target.topic);
        if let Some(v) = value {
            record = record.payload(v);
        }
        if let Some(k) = key {
            record = record.key(k);
        }
        if let Some(h) = headers {
            record = record.headers(h);
        }
        loop {
            match self.producer.send(record) {
                Ok(()) => break,
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                    record = r;
                    // Records leave the queue once their delivery is reported.
                    self.producer.poll(Duration::from_millis(5));
                    self.serve();
                }
                Err((e, r)) if !self.transactional && refuses_the_record(&e) => {
                    if let Ok(mut refused) = self.producer.context().refused.lock() {
                        let (k, v) =
                            (r.key.unwrap_or_default().to_vec(), r.payload.unwrap_or_default().to_vec());
                        refused.push((k, v, format!("Kafka refused the record: {e}")));
                    }
                    break;
                }
                Err((e, _)) => {
                    return Err(Error::Kafka {
                        brokers: self.target.brokers.clone(),
                        message: format!("send to {:?}: {e}", self.target.topic),
                    })
                }
            }
        }
        Ok(())
    }

    /// Records sent and not yet acknowledged.
    pub fn in_flight(&self) -> usize {
        self.serve();
        self.producer.in_flight_count().max(0) as usize
    }

    /// Serve the delivery reports that have arrived, without waiting. A poll serves one
    /// event; the records waiting for their report count as in flight, so a served event
    /// lowers the count and an unchanged count means nothing was left (or an event that is
    /// not a report, served at the next call).
    fn serve(&self) {
        for _ in 0..SERVE_MAX_EVENTS {
            let before = self.producer.in_flight_count();
            self.producer.poll(Duration::ZERO);
            if self.producer.in_flight_count() == before {
                break;
            }
        }
    }

    pub fn set_max_in_flight(&mut self, n: usize) {
        self.max_in_flight = n.max(1);
    }

    /// Too much unacknowledged: the source should pause.
    pub fn behind(&self) -> bool {
        self.in_flight() > self.max_in_flight
    }

    /// Down to a fifth of the limit: the source may go on.
    pub fn caught_up(&self) -> bool {
        self.in_flight() <= self.max_in_flight / 5
    }

    /// Wait until everything sent is acknowledged; fail if anything was not delivered
    /// (records refused for themselves are kept for [`Self::take_refused`]).
    pub fn barrier(&mut self) -> Result<()> {
        let err = |message: String| Error::Kafka { brokers: self.target.brokers.clone(), message };
        self.producer
            .flush(FLUSH_TIMEOUT)
            .map_err(|e| err(format!("flush topic {:?}: {e}", self.target.topic)))?;
        self.check_failures()
    }

    /// Fail if a delivery has failed for a reason that affects everything.
    pub fn check_failures(&self) -> Result<()> {
        self.serve();
        let err = |message: String| Error::Kafka { brokers: self.target.brokers.clone(), message };
        let ctx = self.producer.context();
        if ctx.failed.load(Ordering::Relaxed) > 0 {
            let first = ctx.first_error.lock().ok().and_then(|f| f.clone()).unwrap_or_default();
            return Err(err(format!(
                "{} records to {:?} were not delivered (first: {first})",
                ctx.failed.load(Ordering::Relaxed),
                self.target.topic
            )));
        }
        Ok(())
    }

    /// The end offset of each partition of the topic now (after a [`Self::barrier`]: every
    /// result sent so far is below it), where a rollback to this point starts undoing.
    pub fn ends(&self) -> Result<Vec<(i32, i64)>> {
        ends_of(self.producer.client(), &self.target)
    }

    /// The checkpoint that covers this epoch is durable: commit its transaction and
    /// open the next one. (Upsert sinks have nothing to do.)
    pub fn commit_epoch(&mut self) -> Result<()> {
        if !self.transactional {
            return Ok(());
        }
        let err = |message: String| Error::Kafka { brokers: self.target.brokers.clone(), message };
        self.producer
            .commit_transaction(TXN_TIMEOUT)
            .map_err(|e| err(format!("commit the epoch's transaction: {e}")))?;
        self.producer.begin_transaction().map_err(|e| err(format!("begin a transaction: {e}")))
    }
}

/// The end offset of each partition of `target`'s topic.
fn ends_of<C: ClientContext>(
    client: &rdkafka::client::Client<C>,
    target: &KafkaTarget,
) -> Result<Vec<(i32, i64)>> {
    let err = |message: String| Error::Kafka { brokers: target.brokers.clone(), message };
    let md = client
        .fetch_metadata(Some(&target.topic), Duration::from_secs(15))
        .map_err(|e| err(format!("read the metadata of topic {:?}: {e}", target.topic)))?;
    let partitions: Vec<i32> = md
        .topics()
        .iter()
        .filter(|t| t.name() == target.topic)
        .flat_map(|t| t.partitions().iter().map(|p| p.id()))
        .collect();
    partitions
        .into_iter()
        .map(|p| {
            client
                .fetch_watermarks(&target.topic, p, Duration::from_secs(15))
                .map(|(_, high)| (p, high))
                .map_err(|e| err(format!("read the end of partition {p} of topic {:?}: {e}", target.topic)))
        })
        .collect()
}

/// Undo what was written to `target`'s topic after `ends` (a rollback of a live deploy:
/// the job goes on from the snapshot taken there): every key written since is
/// tombstoned, in its partition, and the run that goes on from the snapshot writes again
/// the keys its plugin writes, so the topic's keyed view is the one of a job that never
/// deployed. Returns the keys tombstoned.
pub fn rewind(target: &KafkaTarget, ends: &[(i32, i64)]) -> Result<usize> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::message::Message;
    use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
    let err = |message: String| Error::Kafka { brokers: target.brokers.clone(), message };
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", &target.brokers)
        .set("client.id", "km0-rewind")
        .set("group.id", "km0-rewind")
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false");
    // Only the connection's settings of the producer's apply to a consumer.
    for (k, v) in target
        .properties
        .iter()
        .filter(|(k, _)| k.starts_with("security.") || k.starts_with("sasl.") || k.starts_with("ssl."))
    {
        config.set(k, v);
    }
    let consumer: BaseConsumer =
        config.create().map_err(|e| err(format!("create a consumer of topic {:?}: {e}", target.topic)))?;
    let now = ends_of(consumer.client(), target)?;
    let mut tpl = TopicPartitionList::new();
    let mut left = std::collections::BTreeMap::new();
    for &(p, high) in &now {
        // A partition added since the snapshot is undone from its start.
        let from = ends.iter().find(|(q, _)| *q == p).map_or(0, |(_, e)| *e);
        if high > from {
            tpl.add_partition_offset(&target.topic, p, Offset::Offset(from))
                .map_err(|e| err(format!("position partition {p}: {e}")))?;
            left.insert(p, high);
        }
    }
    let mut keys: std::collections::BTreeSet<(i32, Vec<u8>)> = std::collections::BTreeSet::new();
    if !left.is_empty() {
        consumer.assign(&tpl).map_err(|e| err(format!("assign topic {:?}: {e}", target.topic)))?;
        // However long the tail, it is read while it comes: the wait is for a silence.
        let mut deadline = std::time::Instant::now() + FLUSH_TIMEOUT;
        while !left.is_empty() {
            if std::time::Instant::now() > deadline {
                return Err(err(format!(
                    "read back topic {:?} to undo a rolled-back deploy's results: partitions {:?} gave nothing for {} s before their end",
                    target.topic,
                    left.keys().collect::<Vec<_>>(),
                    FLUSH_TIMEOUT.as_secs()
                )));
            }
            let Some(m) = consumer.poll(Duration::from_millis(200)) else { continue };
            let m = m.map_err(|e| err(format!("read back topic {:?}: {e}", target.topic)))?;
            deadline = std::time::Instant::now() + FLUSH_TIMEOUT;
            if let Some(k) = m.key() {
                keys.insert((m.partition(), k.to_vec()));
            }
            if left.get(&m.partition()).is_some_and(|&high| m.offset() + 1 >= high) {
                left.remove(&m.partition());
            }
        }
    }
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", &target.brokers)
        .set("client.id", "km0-rewind")
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .create()
        .map_err(|e| err(format!("create the producer for topic {:?}: {e}", target.topic)))?;
    for (p, k) in &keys {
        let mut record = BaseRecord::<[u8], [u8]>::to(&target.topic).key(k.as_slice()).partition(*p);
        loop {
            match producer.send(record) {
                Ok(()) => break,
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                    producer.poll(Duration::from_millis(50));
                    record = r;
                }
                Err((e, _)) => return Err(err(format!("tombstone a key in topic {:?}: {e}", target.topic))),
            }
        }
    }
    producer.flush(FLUSH_TIMEOUT).map_err(|e| err(format!("flush topic {:?}: {e}", target.topic)))?;
    tracing::info!(topic = %target.topic, keys = keys.len(), "kafka: tombstoned the keys written after the rollback point");
    Ok(keys.len())
}

/// Headers of a dead letter: why, and where the record came from.
pub fn dead_letter_headers(reason: &str, origin: &[(&str, String)]) -> OwnedHeaders {
    let mut h = OwnedHeaders::new().insert(Header { key: "km0.reason", value: Some(reason) });
    for (k, v) in origin {
        h = h.insert(Header { key: k, value: Some(v.as_str()) });
    }
    h
}

/// Kafka's API key of EndTxn (commit or abort a transaction).
const END_TXN: i16 = 26;

/// The API keys the first reachable broker of `brokers` supports (an ApiVersions v0
/// request, the one every Kafka-compatible broker answers).
pub fn broker_apis(brokers: &str) -> std::io::Result<Vec<i16>> {
    let mut last = std::io::Error::other("no broker address given");
    use std::net::ToSocketAddrs;
    for addr in brokers.split(',').map(str::trim).filter(|a| !a.is_empty()) {
        // librdkafka accepts `proto://host:port` and a host without a port (9092).
        let addr = addr.rsplit_once("://").map_or(addr, |(_, a)| a);
        let addr = if addr.rsplit_once(':').is_some_and(|(_, p)| p.parse::<u16>().is_ok()) {
            addr.to_string()
        } else {
            format!("{addr}:9092")
        };
        let socks = match addr.to_socket_addrs() {
            Ok(s) => s,
            Err(e) => {
                last = e;
                continue;
            }
        };
        for sock in socks {
            match ask_api_versions(&addr, sock) {
                Ok(keys) => return Ok(keys),
                Err(e) => last = e,
            }
        }
    }
    Err(last)
}

fn ask_api_versions(addr: &str, sock: std::net::SocketAddr) -> std::io::Result<Vec<i16>> {
    let bad = |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{addr}: {m}"));
    let mut s = std::net::TcpStream::connect_timeout(&sock, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    let client = b"km0";
    let mut req = Vec::new();
    req.extend_from_slice(&18i16.to_be_bytes()); // ApiVersions
    req.extend_from_slice(&0i16.to_be_bytes()); // version 0
    req.extend_from_slice(&1i32.to_be_bytes()); // correlation id
    req.extend_from_slice(&(client.len() as i16).to_be_bytes());
    req.extend_from_slice(client);
    s.write_all(&(req.len() as i32).to_be_bytes())?;
    s.write_all(&req)?;
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let len = i32::from_be_bytes(len);
    if !(10..=1 << 20).contains(&len) {
        return Err(bad("implausible ApiVersions response size"));
    }
    let mut body = vec![0u8; len as usize];
    s.read_exact(&mut body)?;
    let i16_at = |i: usize| body.get(i..i + 2).map(|b| i16::from_be_bytes([b[0], b[1]]));
    let error = i16_at(4).ok_or_else(|| bad("short response"))?;
    if error != 0 {
        return Err(bad(&format!("ApiVersions error code {error}")));
    }
    let n = body
        .get(6..10)
        .map(|b| i32::from_be_bytes([b[0], b[1], b[2], b[3]]))
        .ok_or_else(|| bad("short response"))?;
    (0..n.max(0) as usize).map(|k| i16_at(10 + 6 * k).ok_or_else(|| bad("truncated API list"))).collect()
}

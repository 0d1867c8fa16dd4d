//! Real services for the end-to-end tests, started by the tests themselves on loopback
//! and stopped when dropped: a tansu broker (Apache-Kafka-compatible, SQLite storage)
//! and a throwaway PostgreSQL cluster. `scripts/test.sh` installs both (tansu built once
//! into a cache folder, PostgreSQL from Debian's packages); a test that cannot find them
//! fails and says which script to run.

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::producer::{BaseRecord, DefaultProducerContext, Producer, ThreadedProducer};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A port nobody listens on now, and not given to another test of this process: the
/// system may hand out a port again once it is let go, and two brokers started on one
/// port by tests that run at the same time made both tests talk to the one that bound
/// it ("topic already exists").
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        if GIVEN.lock().unwrap_or_else(|e| e.into_inner()).insert(port) {
            return port;
        }
    }
}

pub fn wait_for(what: &str, timeout: Duration, mut ready: impl FnMut() -> bool) {
    let t = Instant::now();
    while !ready() {
        assert!(t.elapsed() < timeout, "{what} not ready after {timeout:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A tansu broker on 127.0.0.1 with SQLite storage in a temporary folder.
pub struct Tansu {
    child: Child,
    _dir: tempfile::TempDir,
    pub brokers: String,
    bin: PathBuf,
}

impl Tansu {
    pub fn bin() -> PathBuf {
        let bin = std::env::var_os("KM0_TANSU").map(PathBuf::from).unwrap_or_else(|| {
            PathBuf::from(std::env::var("HOME").unwrap_or_default())
                .join(".cache/km0-tools/tansu-0.6.0/bin/tansu")
        });
        assert!(
            bin.is_file(),
            "the tansu broker is not installed at {}: run scripts/install-tansu.sh (or scripts/test.sh)",
            bin.display()
        );
        bin
    }

    pub fn start() -> Tansu {
        let bin = Self::bin();
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let url = format!("tcp://127.0.0.1:{port}");
        let log = std::fs::File::create(dir.path().join("tansu.log")).unwrap();
        let child = Command::new(&bin)
            .args([
                "broker",
                "--cluster-id",
                "km0",
                "--listener-url",
                &url,
                "--advertised-listener-url",
                &url,
            ])
            .arg("--storage-engine")
            // Relative to the broker's working folder.
            .arg("sqlite://tansu.db")
            .current_dir(dir.path())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start tansu");
        let mut t = Tansu { child, _dir: dir, brokers: format!("127.0.0.1:{port}"), bin };
        wait_for("tansu's port", Duration::from_secs(30), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        wait_for("tansu", Duration::from_secs(30), || {
            Command::new(&t.bin)
                .args(["topic", "list", "--broker", &url])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        });
        // The port answered: it must be this broker that did (another program may have
        // taken the port between `free_port` and the broker's start).
        if let Ok(Some(status)) = t.child.try_wait() {
            let log = std::fs::read_to_string(t._dir.path().join("tansu.log")).unwrap_or_default();
            panic!("tansu exited ({status}) while another process answered on port {port}: {log}");
        }
        t
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Freeze the broker (SIGSTOP) or let it go on (SIGCONT): a stalled downstream.
    pub fn freeze(&self, frozen: bool) {
        let sig = if frozen { libc::SIGSTOP } else { libc::SIGCONT };
        // SAFETY: kill(2) on our own child's pid.
        let rc = unsafe { libc::kill(self.child.id() as i32, sig) };
        assert_eq!(rc, 0, "signal the broker");
    }

    fn config(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.brokers);
        c
    }

    pub fn create_topic(&self, name: &str, partitions: i32) {
        let admin: AdminClient<DefaultClientContext> = self.config().create().unwrap();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let topic = NewTopic::new(name, partitions, TopicReplication::Fixed(1));
        let res = rt.block_on(admin.create_topics([&topic], &AdminOptions::new())).unwrap();
        for r in res {
            r.unwrap_or_else(|(t, e)| panic!("create topic {t}: {e}"));
        }
        wait_for("topic metadata", Duration::from_secs(10), || {
            let c: BaseConsumer = self.config().create().unwrap();
            c.fetch_metadata(Some(name), Duration::from_secs(5)).is_ok_and(|md| {
                md.topics().iter().any(|t| t.name() == name && t.partitions().len() == partitions as usize)
            })
        });
    }

    /// Produce `records` keyed by `key(record)`, each to `partition(record)` (explicit,
    /// so the test knows which partition holds what); waits until all are acknowledged.
    pub fn produce(&self, topic: &str, records: &[(i32, Option<String>, Vec<u8>)]) {
        produce(&self.brokers, topic, records)
    }

    /// Every record of `topic`, per partition in offset order: (partition, offset, key,
    /// value, headers), read by a plain consumer (not km0's code).
    pub fn read_all(&self, topic: &str) -> Vec<ConsumedRecord> {
        let c: BaseConsumer = self
            .config()
            .set("group.id", format!("reader-{}", free_port()))
            .set("enable.auto.commit", "false")
            .set("enable.partition.eof", "true")
            .create()
            .unwrap();
        let md = c.fetch_metadata(Some(topic), Duration::from_secs(10)).unwrap();
        let parts: Vec<i32> = md.topics()[0].partitions().iter().map(|p| p.id()).collect();
        let mut tpl = TopicPartitionList::new();
        let mut ends = BTreeMap::new();
        for &p in &parts {
            tpl.add_partition_offset(topic, p, Offset::Beginning).unwrap();
            let (_, high) = c.fetch_watermarks(topic, p, Duration::from_secs(10)).unwrap();
            ends.insert(p, high);
        }
        c.assign(&tpl).unwrap();
        let mut out = Vec::new();
        let mut done: BTreeMap<i32, bool> = parts.iter().map(|&p| (p, ends[&p] == 0)).collect();
        let t = Instant::now();
        while done.values().any(|d| !d) {
            assert!(t.elapsed() < Duration::from_secs(120), "reading {topic} took too long");
            match c.poll(Duration::from_millis(200)) {
                Some(Ok(m)) => {
                    let headers = m
                        .headers()
                        .map(|h| {
                            h.iter()
                                .map(|x| {
                                    (
                                        x.key.to_string(),
                                        String::from_utf8_lossy(x.value.unwrap_or_default()).into(),
                                    )
                                })
                                .collect()
                        })
                        .unwrap_or_default();
                    out.push(ConsumedRecord {
                        partition: m.partition(),
                        offset: m.offset(),
                        key: m.key().map(|k| String::from_utf8_lossy(k).into_owned()),
                        value: m.payload().unwrap_or_default().to_vec(),
                        headers,
                    });
                    if m.offset() + 1 >= ends[&m.partition()] {
                        done.insert(m.partition(), true);
                    }
                }
                Some(Err(rdkafka::error::KafkaError::PartitionEOF(p))) => {
                    done.insert(p, true);
                }
                Some(Err(e)) => panic!("reading {topic}: {e}"),
                None => {}
            }
        }
        out
    }

    /// The high watermark (log end) of each partition of `topic`.
    pub fn high_watermarks(&self, topic: &str) -> Vec<i64> {
        let c: BaseConsumer = self.config().create().unwrap();
        let md = c.fetch_metadata(Some(topic), Duration::from_secs(10)).unwrap();
        md.topics()[0]
            .partitions()
            .iter()
            .map(|p| c.fetch_watermarks(topic, p.id(), Duration::from_secs(10)).unwrap().1)
            .collect()
    }

    /// The consumer group's committed offset for each partition of `topic`.
    pub fn committed(&self, group: &str, topic: &str, partitions: i32) -> Vec<i64> {
        let c: BaseConsumer = self.config().set("group.id", group).create().unwrap();
        let mut tpl = TopicPartitionList::new();
        for p in 0..partitions {
            tpl.add_partition(topic, p);
        }
        let got = c.committed_offsets(tpl, Duration::from_secs(10)).unwrap();
        (0..partitions)
            .map(|p| match got.find_partition(topic, p).map(|e| e.offset()) {
                Some(Offset::Offset(o)) => o,
                _ => -1,
            })
            .collect()
    }
}

/// [`Tansu::produce`] to the broker at `brokers` (from another thread).
pub fn produce(brokers: &str, topic: &str, records: &[(i32, Option<String>, Vec<u8>)]) {
    let producer: ThreadedProducer<DefaultProducerContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "20")
        .set("queue.buffering.max.messages", "1000000")
        .create()
        .unwrap();
    for (p, key, value) in records {
        let mut r = BaseRecord::<String, Vec<u8>>::to(topic).partition(*p).payload(value);
        if let Some(k) = key {
            r = r.key(k);
        }
        loop {
            match producer.send(r) {
                Ok(()) => break,
                Err((_, back)) => {
                    r = back;
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        }
    }
    producer.flush(Duration::from_secs(120)).unwrap();
}

impl Drop for Tansu {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[derive(Debug, Clone)]
pub struct ConsumedRecord {
    pub partition: i32,
    pub offset: i64,
    pub key: Option<String>,
    pub value: Vec<u8>,
    pub headers: Vec<(String, String)>,
}

/// The keyed view of a topic of km0 results: the last value of every key.
pub fn keyed_view_of(records: &[ConsumedRecord]) -> BTreeMap<String, serde_json::Value> {
    let mut by_partition: Vec<&ConsumedRecord> = records.iter().collect();
    by_partition.sort_by_key(|r| (r.partition, r.offset));
    let mut view = BTreeMap::new();
    for r in by_partition {
        let key = r.key.clone().expect("a keyed result");
        if r.value.is_empty() {
            view.remove(&key); // a tombstone
        } else {
            view.insert(key, serde_json::from_slice(&r.value).expect("a JSON value"));
        }
    }
    view
}

/// A throwaway PostgreSQL cluster on 127.0.0.1 (and a socket in its folder), owned by
/// the `postgres` user when the tests run as root (PostgreSQL refuses root).
pub struct Postgres {
    dir: tempfile::TempDir,
    bin: PathBuf,
    pub port: u16,
}

impl Postgres {
    fn bin_dir() -> PathBuf {
        if let Ok(o) = Command::new("pg_config").arg("--bindir").output() {
            let p = PathBuf::from(String::from_utf8_lossy(&o.stdout).trim());
            if p.join("initdb").is_file() {
                return p;
            }
        }
        let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
            .map(|d| {
                d.flatten().map(|e| e.path().join("bin")).filter(|p| p.join("initdb").is_file()).collect()
            })
            .unwrap_or_default();
        found.sort();
        found
            .pop()
            .expect("PostgreSQL is not installed: run scripts/install-postgres.sh (or scripts/test.sh)")
    }

    fn as_owner(&self, program: &str) -> Command {
        let exe = self.bin.join(program);
        if is_root() {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(exe);
            c
        } else {
            Command::new(exe)
        }
    }

    pub fn start() -> Postgres {
        let bin = Self::bin_dir();
        let dir = tempfile::Builder::new().prefix("km0-pg").tempdir().unwrap();
        let port = free_port();
        let pg = Postgres { dir, bin, port };
        if is_root() {
            let ok =
                Command::new("chown").args(["-R", "postgres:postgres"]).arg(pg.dir.path()).status().unwrap();
            assert!(ok.success(), "chown the PostgreSQL folder to postgres");
        }
        let data = pg.dir.path().join("data");
        let out = pg
            .as_owner("initdb")
            .args(["-D", data.to_str().unwrap(), "-U", "postgres", "--auth=trust", "-E", "UTF8"])
            .output()
            .unwrap();
        assert!(out.status.success(), "initdb: {}", String::from_utf8_lossy(&out.stderr));
        let opts = format!(
            "-c listen_addresses=127.0.0.1 -p {port} -k {} -c fsync=on -c max_connections=20",
            pg.dir.path().display()
        );
        let log = pg.dir.path().join("pg.log");
        let out = pg
            .as_owner("pg_ctl")
            .args(["-D", data.to_str().unwrap(), "-o", &opts, "-l", log.to_str().unwrap(), "-w", "start"])
            .output()
            .unwrap();
        assert!(out.status.success(), "pg_ctl start: {}", String::from_utf8_lossy(&out.stderr));
        pg
    }

    pub fn url(&self) -> String {
        format!("host=127.0.0.1 port={} user=postgres dbname=postgres", self.port)
    }

    /// Run SQL with psql (an independent client); rows as lines, fields split by tabs.
    pub fn query(&self, sql: &str) -> Vec<Vec<String>> {
        let out = Command::new(self.bin.join("psql"))
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-U",
                "postgres",
                "-At",
                "-F",
                "\t",
                "-c",
                sql,
            ])
            .output()
            .unwrap();
        assert!(out.status.success(), "psql {sql}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| l.split('\t').map(String::from).collect())
            .collect()
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        let data = self.dir.path().join("data");
        let _ = self
            .as_owner("pg_ctl")
            .args(["-D", data.to_str().unwrap_or_default(), "-m", "immediate", "stop"])
            .output();
    }
}

fn is_root() -> bool {
    Command::new("id").arg("-u").output().is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// An S3-compatible server on 127.0.0.1: moto's server mode (PyPI `moto[server]`,
/// installed by `scripts/test.sh`), in memory, with one bucket. Its `env` is what a km0
/// process needs to reach it (endpoint, plain HTTP, test credentials); the test's own
/// reads and writes go through a client of its own.
pub struct S3 {
    child: Child,
    pub port: u16,
    pub bucket: String,
    client: object_store::aws::AmazonS3,
    rt: tokio::runtime::Runtime,
}

impl S3 {
    pub fn start(bucket: &str) -> S3 {
        use object_store::ObjectStore;
        let port = free_port();
        let child = Command::new("python3")
            .args(["-m", "moto.server", "-H", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("python3 -m moto.server (scripts/test.sh installs moto[server])");
        wait_for("the S3 server", Duration::from_secs(30), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        let endpoint = format!("http://127.0.0.1:{port}");
        let client = object_store::aws::AmazonS3Builder::new()
            .with_endpoint(&endpoint)
            .with_allow_http(true)
            .with_access_key_id("km0-test")
            .with_secret_access_key("km0-test")
            .with_region("us-east-1")
            .with_bucket_name(bucket)
            .build()
            .unwrap();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let s3 = S3 { child, port, bucket: bucket.to_string(), client, rt };
        // moto creates a bucket on an (unsigned) PUT of its name.
        let (code, body) = s3.request("PUT", &format!("/{bucket}"));
        assert_eq!(code, 200, "create bucket {bucket}: {body}");
        let _ = s3.rt.block_on(s3.client.list_with_delimiter(None)).unwrap();
        s3
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The environment that points km0's object store client here.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ENDPOINT", self.endpoint()),
            ("AWS_ALLOW_HTTP", "true".into()),
            ("AWS_ACCESS_KEY_ID", "km0-test".into()),
            ("AWS_SECRET_ACCESS_KEY", "km0-test".into()),
            ("AWS_DEFAULT_REGION", "us-east-1".into()),
            // moto's server (Werkzeug) leaves a kept-alive connection unread now and then
            // under load: a connection a request.
            ("AWS_POOL_MAX_IDLE_PER_HOST", "0".into()),
        ]
    }

    /// The keys under `prefix`, sorted.
    pub fn keys(&self, prefix: &str) -> Vec<String> {
        use object_store::ObjectStore;
        let mut out = Vec::new();
        let mut pending = vec![object_store::path::Path::from(prefix.trim_end_matches('/'))];
        while let Some(dir) = pending.pop() {
            let listed = self.rt.block_on(self.client.list_with_delimiter(Some(&dir))).unwrap();
            pending.extend(listed.common_prefixes);
            out.extend(listed.objects.into_iter().map(|o| o.location.to_string()));
        }
        out.sort();
        out
    }

    /// Store `body` at `key`.
    pub fn put(&self, key: &str, body: &[u8]) {
        use object_store::ObjectStore;
        let payload = object_store::PutPayload::from(body.to_vec());
        self.rt.block_on(self.client.put(&object_store::path::Path::from(key), payload)).unwrap();
    }

    /// Delete `key`.
    pub fn delete(&self, key: &str) {
        use object_store::ObjectStore;
        self.rt.block_on(self.client.delete(&object_store::path::Path::from(key))).unwrap();
    }

    /// A plain, unsigned HTTP/1.1 request: status and body.
    fn request(&self, method: &str, path: &str) -> (u16, String) {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        write!(s, "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n", self.port)
            .unwrap();
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).unwrap();
        let text = String::from_utf8_lossy(&raw);
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        let code = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
        (code, body.to_string())
    }

    /// Stop answering (SIGSTOP) or answer again (SIGCONT).
    pub fn freeze(&self, frozen: bool) {
        let sig = if frozen { libc::SIGSTOP } else { libc::SIGCONT };
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, sig) };
    }
}

impl Drop for S3 {
    fn drop(&mut self) {
        self.freeze(false);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

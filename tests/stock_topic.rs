//! The stock stream as a Kafka topic, for the Kafka tests and the Kafka benchmark: the
//! generated records split over the partitions of `pedidos.eventos` by a hash of
//! producto (the test's own partitioner), produced with a plain client, and the same
//! records as one file per partition for the embedded reference run.

use crate::services::Tansu;
use crate::{keyed_view, StockJob};
use km0::generate::{stock_stream, StockStream};
use km0::job::{self, RunOptions};
use km0::pipeline::Pipeline;
use km0::plugin::PluginRuntime;
use std::collections::BTreeMap;
use std::path::Path;

pub const INPUT: &str = "pedidos.eventos";
pub const PARTITIONS: i32 = 3;

/// The test's own partitioner: records keyed by producto, spread by a hash of it;
/// records with no readable producto by their position.
pub fn partition_of(i: usize, record: &str) -> i32 {
    let producto = serde_json::from_str::<serde_json::Value>(record)
        .ok()
        .and_then(|v| v.get("producto").and_then(|p| p.as_str()).map(String::from));
    match producto {
        Some(p) => {
            (p.bytes().fold(7u32, |h, b| h.wrapping_mul(31).wrapping_add(b as u32)) % PARTITIONS as u32)
                as i32
        }
        None => (i % PARTITIONS as usize) as i32,
    }
}

/// The stock stream, split by partition: what goes to each partition, in order.
pub struct Stream {
    pub parts: Vec<Vec<String>>,
    pub bad: usize,
}

pub fn stream(events: u64, bad_fraction: f64) -> Stream {
    let spec = StockStream { events, seed: 5, late_fraction: 0.004, bad_fraction, ..Default::default() };
    let mut buf = Vec::new();
    let g = stock_stream(&spec, &mut buf).unwrap();
    let text = String::from_utf8(buf).unwrap();
    let mut parts = vec![Vec::new(); PARTITIONS as usize];
    for (i, line) in text.lines().enumerate() {
        parts[partition_of(i, line) as usize].push(line.to_string());
    }
    Stream { parts, bad: g.bad as usize }
}

impl Stream {
    pub fn produce(&self, broker: &Tansu) {
        broker.create_topic(INPUT, PARTITIONS);
        let mut records = Vec::new();
        for (p, lines) in self.parts.iter().enumerate() {
            for l in lines {
                let key = serde_json::from_str::<serde_json::Value>(l)
                    .ok()
                    .and_then(|v| v["producto"].as_str().map(String::from));
                records.push((p as i32, key, l.clone().into_bytes()));
            }
        }
        broker.produce(INPUT, &records);
    }

    /// The embedded run: one file per partition, read round-robin, as the reference.
    pub fn file_run(&self, dir: &Path) -> (BTreeMap<String, serde_json::Value>, job::Counters, usize) {
        self.file_run_with(dir, 10)
    }

    /// The partitions written to files in `dir`, one each: the body of a `[source]` that
    /// reads them round-robin.
    pub fn file_source(&self, dir: &Path) -> String {
        let mut paths = Vec::new();
        for (p, lines) in self.parts.iter().enumerate() {
            let path = dir.join(format!("part-{p}.jsonl"));
            std::fs::write(&path, lines.join("\n") + "\n").unwrap();
            paths.push(format!("{:?}", path.display().to_string()));
        }
        format!("kind = \"file\"\npaths = [{}]", paths.join(", "))
    }

    /// As [`Stream::file_run`], alerting below `threshold`.
    pub fn file_run_with(
        &self,
        dir: &Path,
        threshold: i64,
    ) -> (BTreeMap<String, serde_json::Value>, job::Counters, usize) {
        let pipeline = write_pipeline_with(
            dir,
            threshold,
            &self.file_source(dir),
            "kind = \"file\"\npath = \"out/alertas.jsonl\"",
            "path = \"out/dead-letter.jsonl\"",
            "",
        );
        let summary = job::run(&pipeline, &RunOptions::default(), &PluginRuntime::new().unwrap()).unwrap();
        let results = std::fs::read_to_string(dir.join("out/alertas.jsonl")).unwrap().lines().count();
        (keyed_view(&dir.join("out/alertas.jsonl")), summary.counters, results)
    }
}

/// The stock-alert pipeline (2-minute watermark, threshold 10) with these sections.
pub fn write_pipeline(dir: &Path, source: &str, sink: &str, dead_letter: &str, extra: &str) -> Pipeline {
    write_pipeline_with(dir, 10, source, sink, dead_letter, extra)
}

/// As [`write_pipeline`], alerting below `threshold`.
pub fn write_pipeline_with(
    dir: &Path,
    threshold: i64,
    source: &str,
    sink: &str,
    dead_letter: &str,
    extra: &str,
) -> Pipeline {
    let job = StockJob {
        source: source.into(),
        sink: sink.into(),
        dead_letter: dead_letter.into(),
        extra: extra.into(),
        ..StockJob::new("2m", threshold)
    };
    Pipeline::load(&job.write(dir)).unwrap()
}

pub fn kafka_source(broker: &Tansu, group: &str) -> String {
    format!(
        "kind = \"kafka\"\nbrokers = \"{}\"\ntopic = \"{INPUT}\"\ngroup = \"{group}\"\nbounded = true\n\
         properties = {{ \"session.timeout.ms\" = \"6000\", \"heartbeat.interval.ms\" = \"1000\" }}",
        broker.brokers
    )
}

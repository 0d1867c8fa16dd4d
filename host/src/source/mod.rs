//! Sources: where records come from and how far the job has read.
//!
//! A source yields raw records (one JSON document each) with their [`Position`], and can
//! report and restore its [`SourcePosition`] (per partition) for savepoints. Decoding a
//! record into event fields is [`json`]'s job, shared by every source. Both sources read
//! their partitions round-robin, so a replay meets the records in the same order.

pub mod decode;
pub mod file;
pub mod group;
pub mod json;
pub mod kafka;
mod mapped;
pub use mapped::prefetch_after;

use crate::pipeline::SourceSpec;
use crate::Result;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// The job's source (an enum, not a trait object: `next_record` is the hot path).
pub enum Source {
    File(file::FileSource),
    Kafka(kafka::KafkaSource),
}

/// One partition of a source, read alone: its name among the others (`0`, `1`, ... or
/// `topic-0` when several topics are read), what it reads (a file's path, `topic/0`), and
/// the source narrowed to it.
pub struct Split {
    pub name: String,
    pub partition: String,
    pub spec: SourceSpec,
}

/// The partitions of source `spec` (or of the one file `input`, which replaces its
/// files), each alone: a file each, or a Kafka partition each (the brokers are asked).
pub fn split(spec: &SourceSpec, input: Option<&Path>) -> Result<Vec<Split>> {
    let narrowed = |path: &Path| {
        let mut spec = spec.clone();
        if let SourceSpec::File { paths, .. } = &mut spec {
            *paths = vec![path.to_path_buf()];
        }
        spec
    };
    let file = |i: usize, path: &Path| Split {
        name: i.to_string(),
        partition: path.display().to_string(),
        spec: narrowed(path),
    };
    Ok(match (input, spec) {
        (Some(input), _) => vec![file(0, input)],
        (None, SourceSpec::File { paths, .. }) => paths.iter().enumerate().map(|(i, p)| file(i, p)).collect(),
        (None, SourceSpec::Kafka(k)) => {
            let several = k.topics.len() > 1;
            kafka::partitions(k)?
                .into_iter()
                .map(|(topic, id)| {
                    let mut one = k.clone();
                    one.only = Some((topic.clone(), id));
                    Split {
                        name: if several {
                            format!("{}-{id}", crate::pipeline::folder_name(&topic))
                        } else {
                            id.to_string()
                        },
                        partition: format!("{topic}/{id}"),
                        spec: SourceSpec::Kafka(one),
                    }
                })
                .collect()
        }
    })
}

/// What a framed `take` ([`Source::next_records_framed`]) took of the input ahead it was
/// offered: records one after another from its start, each followed by its line break,
/// and the bytes they cover with their line breaks.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Took {
    pub records: u64,
    pub bytes: usize,
}

/// The length of the line break at `at` (`\n` or `\r\n`), if there is one.
#[inline(always)]
pub fn line_break_at(b: &[u8], at: usize) -> Option<usize> {
    match b.get(at..) {
        Some([b'\n', ..]) => Some(1),
        Some([b'\r', b'\n', ..]) => Some(2),
        _ => None,
    }
}

/// What [`Source::next_records_framed`] did.
pub enum Framed<'a> {
    /// `take` took the next records.
    Taken,
    /// The next record, found by its line break (or a Kafka message), after those `take`
    /// took, if any.
    Record(&'a [u8], Position),
    /// No record now.
    End,
}

impl Source {
    /// Open the pipeline's source; `input` replaces a file source's paths (one partition),
    /// `follow` overrides its follow setting.
    pub fn open(
        spec: &SourceSpec,
        input: Option<&PathBuf>,
        follow: Option<bool>,
        resume: Option<&SourcePosition>,
    ) -> Result<Source> {
        match spec {
            SourceSpec::File { paths, follow: f, .. } => {
                let paths = input.map_or_else(|| paths.clone(), |p| vec![p.clone()]);
                Ok(Source::File(file::FileSource::open_with(&paths, follow.unwrap_or(*f), resume)?))
            }
            SourceSpec::Kafka(k) => Ok(Source::Kafka(kafka::KafkaSource::open(k, resume)?)),
        }
    }

    /// True if the input never ends: `None` from [`Source::next_record`] means "nothing yet".
    pub fn unbounded(spec: &SourceSpec, follow: Option<bool>) -> bool {
        match spec {
            SourceSpec::File { .. } => follow.unwrap_or_else(|| spec.unbounded()),
            SourceSpec::Kafka(_) => spec.unbounded(),
        }
    }

    #[inline]
    pub fn next_record(&mut self) -> Result<Option<(&[u8], Position)>> {
        match self {
            Source::File(s) => s.next_record(),
            Source::Kafka(s) => s.next_record(),
        }
    }

    /// The next records, up to `most` (at least one), offered first to `take` in the input
    /// ahead (see [`file::FileSource::next_records_framed`] and
    /// [`kafka::KafkaSource::next_records_framed`]).
    #[inline]
    pub fn next_records_framed(
        &mut self,
        most: u64,
        take: impl FnMut(&[u8], Position, u64, &mut Took) -> Result<()>,
    ) -> Result<Framed<'_>> {
        match self {
            Source::File(s) => s.next_records_framed(most, take),
            Source::Kafka(s) => s.next_records_framed(most, take),
        }
    }

    /// Err when the input changed under the source in a way that makes the records read
    /// since the last check doubtful (a mapped file that shrank): call before keeping a
    /// position.
    pub fn check_intact(&self) -> Result<()> {
        match self {
            Source::File(s) => s.check_intact(),
            Source::Kafka(_) => Ok(()),
        }
    }

    pub fn records(&self) -> u64 {
        match self {
            Source::File(s) => s.records(),
            Source::Kafka(s) => s.records(),
        }
    }

    pub fn partitions(&self) -> usize {
        match self {
            Source::File(s) => s.partitions(),
            Source::Kafka(s) => s.partitions(),
        }
    }

    pub fn partition_name(&self, p: u32) -> String {
        match self {
            Source::File(s) => s.partition_name(p),
            Source::Kafka(s) => s.partition_name(p),
        }
    }

    pub fn take_ended(&mut self) -> Vec<u32> {
        match self {
            Source::File(s) => s.take_ended(),
            Source::Kafka(s) => s.take_ended(),
        }
    }

    pub fn position(&self) -> SourcePosition {
        match self {
            Source::File(s) => s.position(),
            Source::Kafka(s) => s.position(),
        }
    }

    /// Keep each record's message key (Kafka), for a task to check that its records are
    /// keyed as it owns them: the key, read after each record; `None` for files.
    pub fn keep_message_keys(&mut self) -> Option<kafka::MessageKey> {
        match self {
            Source::File(_) => None,
            Source::Kafka(s) => {
                let key = kafka::MessageKey::default();
                s.keep_message_keys(key.clone());
                Some(key)
            }
        }
    }

    /// Commit checkpointed offsets through a consumer group's member (Kafka; files have
    /// no group).
    pub fn commit_through(&mut self, committer: group::Committer) {
        if let Source::Kafka(s) = self {
            s.commit_through(committer)
        }
    }

    /// Whether its partitions are found by name after a restore (a topic may have gained
    /// partitions since the checkpoint); a file source's are the files, in order.
    pub fn partitions_by_name(&self) -> bool {
        matches!(self, Source::Kafka(_))
    }

    /// A checkpoint holding `pos` is durable (Kafka: commit the offsets to the group).
    pub fn checkpoint_complete(&self, pos: &SourcePosition) {
        if let Source::Kafka(s) = self {
            s.checkpoint_complete(pos)
        }
    }

    /// Stop fetching while a sink drains (backpressure); files need nothing.
    pub fn pause(&mut self) -> Result<()> {
        match self {
            Source::File(_) => Ok(()),
            Source::Kafka(s) => s.pause(),
        }
    }

    pub fn resume(&mut self) -> Result<()> {
        match self {
            Source::File(_) => Ok(()),
            Source::Kafka(s) => s.resume(),
        }
    }

    /// Consumer lag per partition (Kafka), asking the brokers; empty for files.
    pub fn lag(&self) -> Result<Vec<kafka::PartitionLag>> {
        match self {
            Source::File(_) => Ok(Vec::new()),
            Source::Kafka(s) => s.lag(),
        }
    }

    /// Consumer lag per partition from the consumer's cache (no request); empty for files.
    pub fn cached_lag(&self) -> Vec<kafka::PartitionLag> {
        match self {
            Source::File(_) => Vec::new(),
            Source::Kafka(s) => s.cached_lag(),
        }
    }
}

/// Where a record came from, for dead letters and late side output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Position {
    pub partition: u32,
    /// 1-based line number in the partition's input.
    pub line: u64,
    /// Byte offset of the record's first byte.
    pub offset: u64,
}

/// How far one partition has been read: resuming starts at `offset`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionPosition {
    pub partition: u32,
    /// What the partition reads (a file path, later a topic-partition).
    pub name: String,
    /// Bytes consumed (file) or next offset (log).
    pub offset: u64,
    /// Lines consumed, so positions of later records keep their numbering.
    pub lines: u64,
    /// Records (non-blank lines) consumed.
    pub records: u64,
    /// A bounded run's end (Kafka: the log end when the job first started), kept so that
    /// a restarted run stops where the uninterrupted one would have.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<u64>,
}

/// A source's resumable position: one entry per partition.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourcePosition {
    pub kind: String,
    pub partitions: Vec<PartitionPosition>,
    /// The partition a round-robin reader takes its next record from.
    #[serde(default)]
    pub next: u32,
}

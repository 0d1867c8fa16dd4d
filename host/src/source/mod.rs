//! Sources: where records come from and how far the job has read.
//!
//! A source yields raw records (one JSON document each) with their [`Position`], and can
//! report and restore its [`SourcePosition`] (per partition) for savepoints. Decoding a
//! record into event fields is [`json`]'s job, shared by every source.

pub mod file;
pub mod json;

use serde::{Deserialize, Serialize};

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

//! Snapshots of a job: today savepoints (taken on request, stable format); periodic
//! checkpoints reuse the same snapshot.

pub mod savepoint;

pub use savepoint::{OperatorMeta, Savepoint, SavepointMeta};

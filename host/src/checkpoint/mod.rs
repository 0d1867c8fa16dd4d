//! Snapshots of a job: savepoints (taken on request, stable format) and periodic
//! checkpoints (the same snapshot, numbered, in a [`store::SnapshotStore`]).

pub mod components;
pub mod group;
pub mod proposals;
pub mod remote;
pub mod savepoint;
pub mod store;

pub use savepoint::{OperatorMeta, Savepoint, SavepointMeta};

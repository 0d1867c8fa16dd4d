//! km0: an event-time stream processor whose aggregate logic runs as WebAssembly
//! components.
//!
//! The modules follow the data path of a job:
//!
//! ```text
//! source ──► time ──► window ──► plugin ──► state ──► checkpoint ──► sink
//! (records,   (event    (assign,   (WASM       (keys,     (savepoints)   (keyed JSONL,
//!  positions,  time,     fire)      batches)    accumul.)                 late, dead
//!  decoding)   watermark)                                                 letters)
//! ```
//!
//! [`job`] wires them into the single-threaded operator loop; [`pipeline`] is the job's
//! declarative description (one TOML file); the `km0` binary is the CLI edge.

pub mod checkpoint;
pub mod control;
pub mod error;
pub mod generate;
pub mod job;
pub mod metrics;
pub mod pipeline;
pub mod plugin;
pub mod sink;
pub mod source;
pub mod state;
pub mod time;
pub mod window;

pub use error::{Error, Result};

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

// Host code handles outside data with errors, never a panic (tests may unwrap).
#![warn(clippy::unwrap_used, clippy::expect_used)]
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

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
pub mod text;
pub mod time;
pub mod window;

pub use error::{Error, Result};

/// The version and how this crate was compiled (`km0 --version`): "profile-guided" when
/// built by `make release` (scripts/build-release.sh), "instrumented" for its training
/// build. KM0_PGO_MODE (set by that script for its stages alone) is read here so that cargo
/// rebuilds the crate when it changes: the rustc flag it stands for (scripts/lib/rustc-pgo.sh)
/// is not part of cargo's fingerprint.
pub const BUILD: &str = match option_env!("KM0_PGO_MODE") {
    Some(mode) => match mode.as_bytes() {
        b"use" => concat!(env!("CARGO_PKG_VERSION"), " (profile-guided)"),
        b"generate" => concat!(env!("CARGO_PKG_VERSION"), " (instrumented for profile-guided optimisation)"),
        _ => env!("CARGO_PKG_VERSION"),
    },
    None => env!("CARGO_PKG_VERSION"),
};

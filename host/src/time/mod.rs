//! Event time: watermarks derived from the event times each partition has seen.

pub mod watermark;

pub use watermark::{Idleness, WatermarkState, Watermarks};

//! Event time: watermarks derived from the event times a source has seen.

pub mod watermark;

pub use watermark::Watermark;

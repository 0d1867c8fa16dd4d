//! The consumer lag of a Kafka source, logged every `lag_interval`.

use crate::pipeline::Pipeline;
use crate::source::Source;
use std::time::{Duration, Instant};

/// When the consumer lag was last logged, and how often it is.
pub(super) struct LagReport {
    /// `None`: the source has no lag to log.
    pub(super) every: Option<Duration>,
    pub(super) last: Instant,
}

impl LagReport {
    /// Every `lag_interval` of a Kafka source (never for files).
    pub(super) fn new(pipeline: &Pipeline) -> LagReport {
        LagReport { every: pipeline.source.lag_interval(), last: Instant::now() }
    }
}

/// Log the consumer lag of a Kafka source when due.
pub(super) fn report_lag(source: &Source, at: &mut LagReport) {
    if at.every.is_none_or(|every| at.last.elapsed() < every) {
        return;
    }
    at.last = Instant::now();
    for l in source.cached_lag().into_iter().filter(|l| l.high_watermark >= 0) {
        tracing::info!(
            partition = %l.partition,
            lag = l.lag,
            position = l.position,
            high_watermark = l.high_watermark,
            "consumer lag"
        );
    }
}

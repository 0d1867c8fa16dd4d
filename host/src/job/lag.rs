//! The consumer lag of a Kafka source, logged every `lag_interval`.

use crate::pipeline::Pipeline;
use crate::source::Source;
use std::time::{Duration, Instant};

/// When the consumer lag was last logged, and how often it is.
pub(super) struct LagReport {
    pub(super) every: Duration,
    pub(super) last: Instant,
}

impl LagReport {
    /// Every `lag_interval` of a Kafka source (5 s otherwise: never logged).
    pub(super) fn new(pipeline: &Pipeline) -> LagReport {
        let every = match &pipeline.source {
            crate::pipeline::SourceSpec::Kafka(k) => Duration::from_millis(k.lag_interval_ms as u64),
            _ => Duration::from_secs(5),
        };
        LagReport { every, last: Instant::now() }
    }
}

/// Log the consumer lag of a Kafka source when due.
pub(super) fn report_lag(source: &Source, at: &mut LagReport) {
    if !matches!(source, Source::Kafka(_)) || at.last.elapsed() < at.every {
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

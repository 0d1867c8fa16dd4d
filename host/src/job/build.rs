//! How a job's parts are built from its pipeline: each aggregation's window operator and
//! the fields its plugin reads, the results' fingerprint, the partitions' idleness.

use crate::pipeline::Pipeline;
use crate::plugin::Plugin;
use crate::time::Idleness;
use crate::window::aggregator::Aggregator;
use crate::window::operator::WindowOperator;
use sha2::{Digest, Sha256};
use std::time::Duration;

/// Each aggregation's plugin name and fields, for the [`crate::source::decode::Decoder`].
pub(super) fn fields_of<'a>(plugins: &[&'a dyn Aggregator]) -> Vec<(&'a str, &'a [crate::plugin::Field])> {
    plugins.iter().map(|p| (p.identity().name.as_str(), p.info().fields.as_slice())).collect()
}

/// The window operator of aggregation `i`, running `plugin` over the decoder's `columns`.
pub(super) fn operator(pipeline: &Pipeline, i: usize, plugin: Plugin, columns: Vec<usize>) -> WindowOperator {
    let a = &pipeline.aggregations[i];
    let prefixed = pipeline.aggregations.len() > 1;
    let mut op = WindowOperator::new(
        &a.name,
        prefixed,
        &a.window,
        Box::new(plugin),
        a.plugin.batch_size,
        pipeline.key.len(),
        columns,
    );
    op.set_on_error(a.plugin.on_error);
    op.set_quarantine_after(a.plugin.quarantine_after);
    op.set_quarantine_max_keys(a.plugin.quarantine_max_keys);
    op
}

/// What determines a job's results: its source and filter, event time (delay, accepted
/// range), idleness, every aggregation's window (with its lateness), plugin code,
/// configuration, limits and fault policy. A replay with the same fingerprint over the same
/// records gives the same results. (Written with `Debug`: a km0 of another version may
/// compute another one, which only makes it refuse a replay it could have skipped.)
pub(super) fn results_fingerprint(pipeline: &Pipeline, plugins: &[&dyn Aggregator]) -> String {
    let mut text = format!(
        "{}|{:?}|{:?}|{:?}|{:?}",
        pipeline.state_fingerprint(),
        pipeline.source,
        pipeline.filter,
        pipeline.event_time,
        pipeline.key
    );
    for (a, p) in pipeline.aggregations.iter().zip(plugins) {
        text.push_str(&format!(
            "|{}:{:?}:{}:{:?}:{:?}:{:?}",
            a.name,
            a.window,
            p.identity().sha256,
            a.plugin.config,
            a.plugin.limits,
            a.plugin.on_error
        ));
    }
    crate::pipeline::hex(&Sha256::digest(text.as_bytes()))
}

/// The pipeline's idleness rules for partition watermarks.
pub(super) fn idleness(pipeline: &Pipeline) -> Idleness {
    let p = pipeline.source.partitioning();
    Idleness {
        timeout: p.idle_timeout_ms.map(|ms| Duration::from_millis(ms as u64)),
        after_records: p.idle_after_records,
    }
}

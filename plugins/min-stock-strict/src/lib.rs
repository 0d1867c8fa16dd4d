//! A stricter release of the low-stock alert, for the host's shadow deploy tests: the same
//! name, fields and state as `min-stock`, but it alerts when the minimum is below
//! `threshold + 5`.

const MARGIN: i64 = 5;
include!("../../min-stock/src/logic.rs");
km0_plugin::export_plugin!(MinStock);

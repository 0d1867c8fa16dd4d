//! Low-stock alert (Kilómetro Cero, case (a)): minimum `stock_actual` and number of
//! updates per (producto, mercado) window; alert when the minimum is below `threshold`.

const MARGIN: i64 = 0;
include!("logic.rs");
km0_plugin::export_plugin!(MinStock);

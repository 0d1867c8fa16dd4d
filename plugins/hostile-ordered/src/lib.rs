//! The hostile plugin (plugins/hostile) with ordered input, for the host's tests of
//! ordered slots handed over again (a rebuild the plugin fails on).

const PLUGIN_NAME: &str = "hostile-ordered";
const ORDERED: bool = true;
include!("../../hostile/src/plugin.rs");
km0_plugin::export_plugin!(Hostile);

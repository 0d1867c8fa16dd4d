//! A plugin that misbehaves on purpose, for the host's sandbox tests. `behaviour` in its
//! config picks what it does when events arrive:
//! - `loop`: never returns; `alloc`: allocates until it cannot; `panic`: panics;
//! - `panic_on`: panics only on the events of the key given as `key`;
//! - `panic_at`: panics on any call with the event at `time`;
//! - `alloc_4g`: asks for one allocation of almost 4 GB;
//! - `garbage`: emits a value that is not JSON; `huge`: emits a 2 MB record; `big`: a
//!   300 kB one;
//! - `sleep`: sleeps 5 s in every `add`; `sleep_forever`: sleeps in a loop;
//! - `merge_panic`: panics in `merge` (sliding panes, sessions);
//! - `probe`: tries the filesystem, the environment, the clocks and the network, and
//!   reports what it got (a sandboxed plugin gets nothing, and clocks that stand still);
//! - `poisoned`: counts events per window (`{"key", "events"}`), except for four keys:
//!   it loops forever on `loop_key`, allocates without bound on `alloc_key`, panics
//!   ("boom") on `panic_key`, and on `probe_key` probes the filesystem, environment and
//!   network and writes what it got to stderr (then counts as usual).

//!
//! `hostile-ordered` is the same logic with ordered input.

const PLUGIN_NAME: &str = "hostile";
const ORDERED: bool = false;
include!("plugin.rs");
km0_plugin::export_plugin!(Hostile);

//! The contract versions this host runs plugins of: the current `wit/aggregate.wit` and
//! every older minor version kept in `wit/<version>/`. Each has its own bindings; they
//! share the data types (the `types` interface has not changed since 0.1.0), so a call
//! costs the same whatever version the plugin was built against. A 0.3.0 plugin may also
//! export `fire` (world `firing-aggregate-plugin`).

use super::sandbox::GuestState;
use super::{Emitted, Events, Groups, Packed, PluginInfo};
use wasmtime::component::InstancePre;
use wasmtime::Store;

/// Contract 0.3.0 (current): adds the optional interface `fire`.
pub mod v0_3 {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "km0:plugin/aggregate-plugin",
    });

    /// A 0.3.0 plugin that exports `fire` too.
    pub mod firing {
        wasmtime::component::bindgen!({
            path: "../wit",
            world: "km0:plugin/firing-aggregate-plugin",
            with: {
                "km0:plugin/types": super::km0::plugin::types,
                "km0:plugin/aggregate": super::exports::km0::plugin::aggregate,
            },
        });
    }
}

/// Contract 0.2.0: adds `key-fields`.
pub mod v0_2 {
    wasmtime::component::bindgen!({
        path: "../wit/0.2.0",
        world: "km0:plugin/aggregate-plugin",
        with: { "km0:plugin/types@0.2.0": super::v0_3::km0::plugin::types },
    });
}

/// Contract 0.1.0.
pub mod v0_1 {
    wasmtime::component::bindgen!({
        path: "../wit/0.1.0",
        world: "km0:plugin/aggregate-plugin",
        with: { "km0:plugin/types@0.1.0": super::v0_3::km0::plugin::types },
    });
}

/// The contract version of `wit/aggregate.wit`.
pub const CURRENT: &str = "0.3.0";

/// Every contract version this host runs plugins of, oldest first.
pub const SUPPORTED: &[&str] = &["0.1.0", "0.2.0", "0.3.0"];

/// A component linked against the version it was built for, ready to instantiate.
pub enum Pre {
    Firing(v0_3::firing::FiringAggregatePluginPre<GuestState>),
    V0_3(v0_3::AggregatePluginPre<GuestState>),
    V0_2(v0_2::AggregatePluginPre<GuestState>),
    V0_1(v0_1::AggregatePluginPre<GuestState>),
}

impl Pre {
    /// Bind `pre` to contract `version` (one of [`SUPPORTED`]); a 0.3.0 plugin that exports
    /// `fire` (`fires`) to the world that has it, so that a `fire` of the wrong shape is
    /// refused rather than left unused.
    pub fn new(version: &str, pre: InstancePre<GuestState>, fires: bool) -> wasmtime::Result<Pre> {
        match version {
            "0.1.0" => Ok(Pre::V0_1(v0_1::AggregatePluginPre::new(pre)?)),
            "0.2.0" => Ok(Pre::V0_2(v0_2::AggregatePluginPre::new(pre)?)),
            _ if fires => Ok(Pre::Firing(v0_3::firing::FiringAggregatePluginPre::new(pre)?)),
            _ => Ok(Pre::V0_3(v0_3::AggregatePluginPre::new(pre)?)),
        }
    }

    pub fn instantiate(&self, store: &mut Store<GuestState>) -> wasmtime::Result<Instance> {
        match self {
            Pre::Firing(p) => p.instantiate(store).map(Instance::Firing),
            Pre::V0_3(p) => p.instantiate(store).map(Instance::V0_3),
            Pre::V0_2(p) => p.instantiate(store).map(Instance::V0_2),
            Pre::V0_1(p) => p.instantiate(store).map(Instance::V0_1),
        }
    }
}

/// An instance of a plugin, of whichever contract version.
pub enum Instance {
    Firing(v0_3::firing::FiringAggregatePlugin),
    V0_3(v0_3::AggregatePlugin),
    V0_2(v0_2::AggregatePlugin),
    V0_1(v0_1::AggregatePlugin),
}

/// Call export `$call` with the same arguments whatever the version.
macro_rules! each_version {
    ($self:expr, $store:expr, $call:ident ( $($arg:expr),* )) => {
        match $self {
            Instance::Firing(i) => i.km0_plugin_aggregate().$call($store $(, $arg)*),
            Instance::V0_3(i) => i.km0_plugin_aggregate().$call($store $(, $arg)*),
            Instance::V0_2(i) => i.km0_plugin_aggregate().$call($store $(, $arg)*),
            Instance::V0_1(i) => i.km0_plugin_aggregate().$call($store $(, $arg)*),
        }
    };
}

type Call<T> = wasmtime::Result<Result<T, String>>;

impl Instance {
    pub fn info(&self, store: &mut Store<GuestState>) -> wasmtime::Result<PluginInfo> {
        each_version!(self, store, call_info())
    }

    /// Key fields the plugin reads; a 0.1.0 plugin does not say (0: any).
    pub fn key_fields(&self, store: &mut Store<GuestState>) -> wasmtime::Result<u32> {
        match self {
            Instance::Firing(i) => i.km0_plugin_aggregate().call_key_fields(store),
            Instance::V0_3(i) => i.km0_plugin_aggregate().call_key_fields(store),
            Instance::V0_2(i) => i.km0_plugin_aggregate().call_key_fields(store),
            Instance::V0_1(_) => Ok(0),
        }
    }

    pub fn configure(&self, store: &mut Store<GuestState>, config: &[(String, String)]) -> Call<()> {
        each_version!(self, store, call_configure(config))
    }

    pub fn add(&self, store: &mut Store<GuestState>, groups: &Groups, events: &Events) -> Call<Packed> {
        each_version!(self, store, call_add(groups, events))
    }

    pub fn merge(&self, store: &mut Store<GuestState>, left: &Packed, right: &Packed) -> Call<Packed> {
        each_version!(self, store, call_merge(left, right))
    }

    pub fn finish(&self, store: &mut Store<GuestState>, groups: &Groups) -> Call<Vec<Emitted>> {
        each_version!(self, store, call_finish(groups))
    }

    /// Whether the plugin folds and finishes closing windows in one call (`fire`).
    pub fn fires(&self) -> bool {
        matches!(self, Instance::Firing(_))
    }

    /// `fire.add-and-finish`; None when the plugin does not export it.
    pub fn add_and_finish(
        &self,
        store: &mut Store<GuestState>,
        groups: &Groups,
        events: &Events,
    ) -> Option<Call<Vec<Emitted>>> {
        match self {
            Instance::Firing(i) => Some(i.km0_plugin_fire().call_add_and_finish(store, groups, events)),
            _ => None,
        }
    }

    pub fn migrate(&self, store: &mut Store<GuestState>, from: u32, accumulators: &Packed) -> Call<Packed> {
        each_version!(self, store, call_migrate(from, accumulators))
    }
}

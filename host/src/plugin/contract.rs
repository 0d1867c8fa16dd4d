//! The contract versions this host runs plugins of: the current `wit/aggregate.wit` and
//! every older minor version kept in `wit/<version>/`. Each has its own bindings; they
//! share the data types (the `types` interface has not changed since 0.1.0), so a call
//! costs the same whatever version the plugin was built against. A 0.3.0 plugin may also
//! export `fire` (world `firing-aggregate-plugin`); a 0.4.0 plugin `fire` and `panes`; a
//! 0.5.0 plugin these and `packed-records`, each bound on its own.

use super::sandbox::GuestState;
use super::{Events, Groups, Packed, PluginInfo, Records};
use wasmtime::component::InstancePre;
use wasmtime::Store;

/// Contract 0.5.0 (current): adds the optional interface `packed-records`.
pub mod v0_5 {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "km0:plugin/aggregate-plugin",
    });

    /// The optional interfaces `fire`, `panes` and `packed-records` (their world exports
    /// all three; the host binds each on its own, through its `GuestIndices`).
    pub mod optional {
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

/// Contract 0.4.0: adds the optional interface `panes`.
pub mod v0_4 {
    wasmtime::component::bindgen!({
        path: "../wit/0.4.0",
        world: "km0:plugin/aggregate-plugin",
        with: { "km0:plugin/types@0.4.0": super::v0_5::km0::plugin::types },
    });

    /// The optional interfaces `fire` and `panes`, bound each on its own.
    pub mod optional {
        wasmtime::component::bindgen!({
            path: "../wit/0.4.0",
            world: "km0:plugin/firing-aggregate-plugin",
            with: {
                "km0:plugin/types@0.4.0": super::super::v0_5::km0::plugin::types,
                "km0:plugin/aggregate@0.4.0": super::exports::km0::plugin::aggregate,
            },
        });
    }
}

/// Contract 0.3.0: adds the optional interface `fire`.
pub mod v0_3 {
    wasmtime::component::bindgen!({
        path: "../wit/0.3.0",
        world: "km0:plugin/aggregate-plugin",
        with: { "km0:plugin/types@0.3.0": super::v0_5::km0::plugin::types },
    });

    /// A 0.3.0 plugin that exports `fire` too.
    pub mod firing {
        wasmtime::component::bindgen!({
            path: "../wit/0.3.0",
            world: "km0:plugin/firing-aggregate-plugin",
            with: {
                "km0:plugin/types@0.3.0": super::super::v0_5::km0::plugin::types,
                "km0:plugin/aggregate@0.3.0": super::exports::km0::plugin::aggregate,
            },
        });
    }
}

/// Contract 0.2.0: adds `key-fields`.
pub mod v0_2 {
    wasmtime::component::bindgen!({
        path: "../wit/0.2.0",
        world: "km0:plugin/aggregate-plugin",
        with: { "km0:plugin/types@0.2.0": super::v0_5::km0::plugin::types },
    });
}

/// Contract 0.1.0.
pub mod v0_1 {
    wasmtime::component::bindgen!({
        path: "../wit/0.1.0",
        world: "km0:plugin/aggregate-plugin",
        with: { "km0:plugin/types@0.1.0": super::v0_5::km0::plugin::types },
    });
}

/// The contract version of `wit/aggregate.wit`.
pub const CURRENT: &str = "0.5.0";

/// Every contract version this host runs plugins of, oldest first.
pub const SUPPORTED: &[&str] = &["0.1.0", "0.2.0", "0.3.0", "0.4.0", "0.5.0"];

use v0_5::optional::exports::km0::plugin::{fire, packed_records, panes};

/// The optional interfaces of a 0.4.0 plugin.
mod v0_4_optional {
    pub use super::v0_4::optional::exports::km0::plugin::{fire, panes};
}

/// Which optional interfaces a component exports (by their names, whatever the version).
#[derive(Debug, Clone, Copy, Default)]
pub struct Optional {
    /// `fire`.
    pub fires: bool,
    /// `panes`.
    pub merges: bool,
    /// `packed-records`.
    pub packs: bool,
}

/// A component linked against the version it was built for, ready to instantiate.
pub enum Pre {
    /// 0.5.0, with the optional interfaces it exports.
    V0_5 {
        base: v0_5::AggregatePluginPre<GuestState>,
        fire: Option<fire::GuestIndices>,
        panes: Option<panes::GuestIndices>,
        packed: Option<packed_records::GuestIndices>,
    },
    /// 0.4.0, with the optional interfaces it exports.
    V0_4 {
        base: v0_4::AggregatePluginPre<GuestState>,
        fire: Option<v0_4_optional::fire::GuestIndices>,
        panes: Option<v0_4_optional::panes::GuestIndices>,
    },
    Firing(v0_3::firing::FiringAggregatePluginPre<GuestState>),
    V0_3(v0_3::AggregatePluginPre<GuestState>),
    V0_2(v0_2::AggregatePluginPre<GuestState>),
    V0_1(v0_1::AggregatePluginPre<GuestState>),
}

impl Pre {
    /// Bind `pre` to contract `version` (one of [`SUPPORTED`]), with the optional
    /// interfaces the plugin exports (`optional`), so that an optional interface of the
    /// wrong shape is refused rather than left unused.
    pub fn new(version: &str, pre: InstancePre<GuestState>, optional: Optional) -> wasmtime::Result<Pre> {
        let Optional { fires, merges, packs } = optional;
        match version {
            "0.1.0" => Ok(Pre::V0_1(v0_1::AggregatePluginPre::new(pre)?)),
            "0.2.0" => Ok(Pre::V0_2(v0_2::AggregatePluginPre::new(pre)?)),
            "0.3.0" if fires => Ok(Pre::Firing(v0_3::firing::FiringAggregatePluginPre::new(pre)?)),
            "0.3.0" => Ok(Pre::V0_3(v0_3::AggregatePluginPre::new(pre)?)),
            "0.4.0" => Ok(Pre::V0_4 {
                fire: fires.then(|| v0_4_optional::fire::GuestIndices::new(&pre)).transpose()?,
                panes: merges.then(|| v0_4_optional::panes::GuestIndices::new(&pre)).transpose()?,
                base: v0_4::AggregatePluginPre::new(pre)?,
            }),
            "0.5.0" => Ok(Pre::V0_5 {
                fire: fires.then(|| fire::GuestIndices::new(&pre)).transpose()?,
                panes: merges.then(|| panes::GuestIndices::new(&pre)).transpose()?,
                packed: packs.then(|| packed_records::GuestIndices::new(&pre)).transpose()?,
                base: v0_5::AggregatePluginPre::new(pre)?,
            }),
            other => Err(wasmtime::format_err!("no bindings for contract {other}")),
        }
    }

    pub fn instantiate(&self, store: &mut Store<GuestState>) -> wasmtime::Result<Instance> {
        match self {
            Pre::V0_5 { base, fire, panes, packed } => {
                let instance = base.instance_pre().instantiate(&mut *store)?;
                Ok(Instance::V0_5 {
                    fire: fire.as_ref().map(|f| f.load(&mut *store, &instance)).transpose()?,
                    panes: panes.as_ref().map(|p| p.load(&mut *store, &instance)).transpose()?,
                    packed: packed.as_ref().map(|p| p.load(&mut *store, &instance)).transpose()?,
                    base: v0_5::AggregatePlugin::new(&mut *store, &instance)?,
                })
            }
            Pre::V0_4 { base, fire, panes } => {
                let instance = base.instance_pre().instantiate(&mut *store)?;
                Ok(Instance::V0_4 {
                    fire: fire.as_ref().map(|f| f.load(&mut *store, &instance)).transpose()?,
                    panes: panes.as_ref().map(|p| p.load(&mut *store, &instance)).transpose()?,
                    base: v0_4::AggregatePlugin::new(&mut *store, &instance)?,
                })
            }
            Pre::Firing(p) => p.instantiate(store).map(Instance::Firing),
            Pre::V0_3(p) => p.instantiate(store).map(Instance::V0_3),
            Pre::V0_2(p) => p.instantiate(store).map(Instance::V0_2),
            Pre::V0_1(p) => p.instantiate(store).map(Instance::V0_1),
        }
    }
}

/// An instance of a plugin, of whichever contract version.
pub enum Instance {
    V0_5 {
        base: v0_5::AggregatePlugin,
        fire: Option<fire::Guest>,
        panes: Option<panes::Guest>,
        packed: Option<packed_records::Guest>,
    },
    V0_4 {
        base: v0_4::AggregatePlugin,
        fire: Option<v0_4_optional::fire::Guest>,
        panes: Option<v0_4_optional::panes::Guest>,
    },
    Firing(v0_3::firing::FiringAggregatePlugin),
    V0_3(v0_3::AggregatePlugin),
    V0_2(v0_2::AggregatePlugin),
    V0_1(v0_1::AggregatePlugin),
}

/// Call export `$call` with the same arguments whatever the version.
macro_rules! each_version {
    ($self:expr, $store:expr, $call:ident ( $($arg:expr),* )) => {
        match $self {
            Instance::V0_5 { base, .. } => base.km0_plugin_aggregate().$call($store $(, $arg)*),
            Instance::V0_4 { base, .. } => base.km0_plugin_aggregate().$call($store $(, $arg)*),
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
            Instance::V0_5 { base, .. } => base.km0_plugin_aggregate().call_key_fields(store),
            Instance::V0_4 { base, .. } => base.km0_plugin_aggregate().call_key_fields(store),
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

    /// `finish` (`packed-records.finish` when the plugin exports it and `packs`).
    pub fn finish(&self, store: &mut Store<GuestState>, groups: &Groups, packs: bool) -> Call<Records> {
        if let (Instance::V0_5 { packed: Some(p), .. }, true) = (self, packs) {
            return packed(p.call_finish(store, groups));
        }
        listed(each_version!(self, store, call_finish(groups)))
    }

    /// Whether the plugin folds and finishes closing windows in one call (`fire`).
    pub fn fires(&self) -> bool {
        matches!(
            self,
            Instance::Firing(_) | Instance::V0_4 { fire: Some(_), .. } | Instance::V0_5 { fire: Some(_), .. }
        )
    }

    /// Whether the plugin merges sliding windows' panes and finishes them in one call
    /// (`panes`).
    pub fn merges_panes(&self) -> bool {
        matches!(self, Instance::V0_4 { panes: Some(_), .. } | Instance::V0_5 { panes: Some(_), .. })
    }

    /// Whether the plugin returns the records of a call in one buffer (`packed-records`).
    pub fn packs_records(&self) -> bool {
        matches!(self, Instance::V0_5 { packed: Some(_), .. })
    }

    /// `fire.add-and-finish` (`packed-records.add-and-finish` when the plugin exports it
    /// and `packs`); None when the plugin does not export `fire`.
    pub fn add_and_finish(
        &self,
        store: &mut Store<GuestState>,
        groups: &Groups,
        events: &Events,
        packs: bool,
    ) -> Option<Call<Records>> {
        match self {
            Instance::Firing(i) => {
                Some(listed(i.km0_plugin_fire().call_add_and_finish(store, groups, events)))
            }
            Instance::V0_4 { fire: Some(f), .. } => {
                Some(listed(f.call_add_and_finish(store, groups, events)))
            }
            Instance::V0_5 { fire: Some(_), packed: Some(p), .. } if packs => {
                Some(packed(p.call_add_and_finish(store, groups, events)))
            }
            Instance::V0_5 { fire: Some(f), .. } => {
                Some(listed(f.call_add_and_finish(store, groups, events)))
            }
            _ => None,
        }
    }

    /// `panes.merge-and-finish` (`packed-records.merge-and-finish` when the plugin exports
    /// it and `packs`); None when the plugin does not export `panes`.
    pub fn merge_and_finish(
        &self,
        store: &mut Store<GuestState>,
        groups: &Groups,
        panes: &Packed,
        counts: &[u32],
        packs: bool,
    ) -> Option<Call<Records>> {
        match self {
            Instance::V0_4 { panes: Some(p), .. } => {
                Some(listed(p.call_merge_and_finish(store, groups, panes, counts)))
            }
            Instance::V0_5 { panes: Some(_), packed: Some(p), .. } if packs => {
                Some(packed(p.call_merge_and_finish(store, groups, panes, counts)))
            }
            Instance::V0_5 { panes: Some(p), .. } => {
                Some(listed(p.call_merge_and_finish(store, groups, panes, counts)))
            }
            _ => None,
        }
    }

    pub fn migrate(&self, store: &mut Store<GuestState>, from: u32, accumulators: &Packed) -> Call<Packed> {
        each_version!(self, store, call_migrate(from, accumulators))
    }
}

/// A call's records as a `list<emitted>`.
fn listed(call: Call<Vec<super::Emitted>>) -> Call<Records> {
    call.map(|r| r.map(Records::Listed))
}

/// A call's records in one buffer (`packed-records`).
fn packed(call: Call<packed_records::Records>) -> Call<Records> {
    call.map(|r| r.map(|r| Records::Packed { groups: r.groups, values: r.values }))
}

//! The plugin boundary: loading a WebAssembly component that implements
//! `wit/aggregate.wit`, sandboxing it, and calling it with batches.
//!
//! One [`PluginRuntime`] (engine + linker) serves the process; each [`Plugin`] is one
//! configured instance with its own store. Guests get WASI with nothing in it, no way to
//! wait, fixed clocks and randomness, and one memory budget ([`sandbox`]), so a plugin is
//! a pure function of its configuration, accumulators and events, and a replay gives the
//! same output.

pub mod cache;
pub mod contract;
pub mod sandbox;

use crate::pipeline::hex;
pub use crate::pipeline::{Limits, OnError};
use crate::{Error, Result};
use sandbox::{guest_state, GuestOutput, GuestState};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use wasmtime::component::Linker;
use wasmtime::{Config, Engine, Store, Trap};

pub use contract::v0_5::km0::plugin::types::{
    Column, Emitted, Events, Field, FieldType, Groups, Packed, PluginInfo,
};
use contract::{Instance, Optional, Pre};

/// The records a call returned: as a `list<emitted>`, or in one buffer (a plugin that
/// exports `packed-records`).
pub enum Records {
    Listed(Vec<Emitted>),
    /// Record `i` is item `i` of `values`, for group `groups[i]` (checked by the host).
    Packed {
        groups: Vec<u32>,
        values: Packed,
    },
}

/// The contract version of `wit/aggregate.wit`; [`contract::SUPPORTED`] lists every
/// version this host runs plugins of.
pub const CONTRACT_VERSION: &str = contract::CURRENT;

/// Who a plugin is: recorded in savepoints and compared on deploy.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PluginIdentity {
    pub name: String,
    pub version: String,
    pub state_schema: u32,
    /// SHA-256 of the component file.
    pub sha256: String,
    /// The contract version the component was built against.
    pub contract: String,
    /// Key fields the plugin reads from every group (0: any, or a 0.1.0 plugin).
    #[serde(default)]
    pub key_fields: u32,
}

/// Upper bounds (seconds) of the plugin call latency histogram's buckets.
pub const CALL_BUCKETS: [f64; 12] = [1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1.0, 5.0];

/// A plugin instance's calls: how long they took and how they failed. Counted on the
/// job's thread (two clock reads per call, and calls take whole batches), published with
/// the job's status.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct CallStats {
    /// Calls per bucket of [`CALL_BUCKETS`] (not cumulative), the last past every bound.
    pub buckets: [u64; CALL_BUCKETS.len() + 1],
    pub count: u64,
    pub seconds: f64,
    /// Faults by kind: the plugin refused (returned an error), trapped, ran out of time,
    /// or returned something malformed.
    pub refused: u64,
    pub trapped: u64,
    pub timed_out: u64,
    pub malformed: u64,
}

impl CallStats {
    fn observe(&mut self, took: Duration) {
        let s = took.as_secs_f64();
        let b = CALL_BUCKETS.iter().position(|&le| s <= le).unwrap_or(CALL_BUCKETS.len());
        self.buckets[b] += 1;
        self.count += 1;
        self.seconds += s;
    }
}

/// Calls after a fault in a call that returned its records in one buffer
/// (`packed-records`) that return them as a `list<emitted>` instead: the retries that
/// isolate the fault (one window a call), and what follows, do not depend on that
/// buffer being well formed.
const PACKED_PAUSE: u32 = 1 << 16;

/// How often the engine's epoch advances while a plugin runs: the granularity of the
/// call timeout.
pub const EPOCH: Duration = Duration::from_millis(10);

/// How often an idle ticker looks whether its engine is gone.
const IDLE_LOOK: Duration = Duration::from_secs(1);

/// The thread that advances an engine's epoch every [`EPOCH`], so that a call past its
/// deadline is stopped; only while a plugin runs (a guest is entered), asleep otherwise.
/// It ticked always before: an idle job (a slow source, a quiet topic) woke 100 times a
/// second for nothing, ~18 µs of CPU a tick here (1.8 ms a second). A deadline counts the
/// ticks of the guest's own time, as before.
struct Ticker {
    /// Guests being run (calls in progress, of every instance of the engine).
    running: Arc<AtomicUsize>,
    /// Epochs ticked so far (what the tests look at).
    #[cfg_attr(not(test), allow(dead_code))]
    ticks: Arc<AtomicU64>,
    thread: std::thread::Thread,
}

impl Ticker {
    /// The ticker of `engine`: it lives as long as the engine does.
    fn start(engine: &Engine) -> Result<Arc<Ticker>> {
        let weak = engine.weak();
        let (running, ticks) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicU64::new(0)));
        let (guests, ticked) = (running.clone(), ticks.clone());
        let handle = std::thread::Builder::new()
            .name("km0-epoch".into())
            .spawn(move || {
                loop {
                    if guests.load(Ordering::SeqCst) == 0 {
                        // Woken by the first guest to run (or to look at the engine).
                        std::thread::park_timeout(IDLE_LOOK);
                        if weak.upgrade().is_none() {
                            break;
                        }
                        continue;
                    }
                    std::thread::sleep(EPOCH);
                    match weak.upgrade() {
                        Some(engine) => engine.increment_epoch(),
                        None => break,
                    }
                    ticked.fetch_add(1, Ordering::Relaxed);
                }
            })
            .map_err(|e| runtime_error(format!("epoch ticker: {e}")))?;
        Ok(Arc::new(Ticker { running, ticks, thread: handle.thread().clone() }))
    }

    /// A guest is about to run: ticks until the guard is dropped. The first wakes the
    /// ticker, which ticks [`EPOCH`] later (a parked ticker that misses the wake-up token
    /// cannot happen: `unpark` before `park` makes `park` return at once).
    fn running(&self) -> Running<'_> {
        if self.running.fetch_add(1, Ordering::SeqCst) == 0 {
            self.thread.unpark();
        }
        Running(self)
    }
}

/// See [`Ticker::running`].
struct Running<'a>(&'a Ticker);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Engine and linker shared by every plugin instance.
pub struct PluginRuntime {
    engine: Engine,
    linker: Linker<GuestState>,
    /// Where compiled components are cached (none: always compile).
    cache: Option<std::path::PathBuf>,
    ticker: Arc<Ticker>,
}

impl PluginRuntime {
    pub fn new() -> Result<PluginRuntime> {
        let mut config = Config::new();
        config.wasm_component_model(true);
        // Concurrency support makes every call ~3.5x dearer; plugins are synchronous.
        config.concurrency_support(false);
        // Runaway plugins are stopped at an epoch deadline (cheaper than fuel).
        config.epoch_interruption(true);
        // `KM0_PERF_MAP=1`: name the plugins' compiled functions for `perf` (/tmp/perf-<pid>.map).
        if std::env::var_os("KM0_PERF_MAP").is_some_and(|v| v == "1") {
            config.profiler(wasmtime::ProfilingStrategy::PerfMap);
        }
        let engine = Engine::new(&config).map_err(|e| runtime_error(format!("wasmtime engine: {e:#}")))?;
        let mut linker = Linker::new(&engine);
        sandbox::link(&mut linker).map_err(|e| runtime_error(format!("linking WASI: {e:#}")))?;
        let ticker = Ticker::start(&engine)?;
        Ok(PluginRuntime { engine, linker, cache: cache::default_dir(), ticker })
    }

    /// Cache compiled components in `dir` (or nowhere).
    pub fn with_cache(mut self, dir: Option<std::path::PathBuf>) -> Self {
        self.cache = dir;
        self
    }

    /// Load, check and configure the component at `path`, with the default limits.
    pub fn load(&self, path: &Path, config: &[(String, String)]) -> Result<Plugin> {
        self.load_with(path, config, Limits::default())
    }

    /// Load, check and configure the component at `path`.
    pub fn load_with(&self, path: &Path, config: &[(String, String)], limits: Limits) -> Result<Plugin> {
        let bytes = std::fs::read(path).map_err(|e| Error::io("read plugin", path, e))?;
        self.load_bytes(&path.display().to_string(), &bytes, config, limits)
    }

    /// Identity and self-description of a component, without configuring it.
    pub fn inspect(&self, path: &Path) -> Result<(PluginIdentity, PluginInfo)> {
        let bytes = std::fs::read(path).map_err(|e| Error::io("read plugin", path, e))?;
        self.inspect_bytes(&path.display().to_string(), &bytes)
    }

    /// The world a component implements: `firing-aggregate-plugin` when it exports its
    /// contract's optional interfaces (0.3.0: `fire`; 0.4.0: `fire` and `panes`; 0.5.0:
    /// those and `packed-records`), else `aggregate-plugin`, with the optional interfaces
    /// it exports named after it.
    pub fn world(&self, path: &Path) -> Result<String> {
        let bytes = std::fs::read(path).map_err(|e| Error::io("read plugin", path, e))?;
        let p = self.instantiate(&path.display().to_string(), &bytes, Limits::default())?;
        let exported = [
            (p.fires(), "fire"),
            (p.merges_panes(), "panes"),
            (p.instance.packs_records(), "packed-records"),
        ];
        let optional: &[&str] = match p.identity.contract.as_str() {
            "0.1.0" | "0.2.0" => &[],
            "0.3.0" => &["fire"],
            "0.4.0" => &["fire", "panes"],
            _ => &["fire", "panes", "packed-records"],
        };
        let has = |name: &str| exported.iter().any(|&(on, n)| on && n == name);
        if !optional.is_empty() && optional.iter().all(|n| has(n)) {
            return Ok("firing-aggregate-plugin".into());
        }
        let named: Vec<&str> = exported.iter().filter(|(on, _)| *on).map(|&(_, n)| n).collect();
        Ok(std::iter::once("aggregate-plugin").chain(named).collect::<Vec<_>>().join(" + "))
    }

    /// [`PluginRuntime::inspect`] of a component's bytes.
    pub fn inspect_bytes(&self, label: &str, bytes: &[u8]) -> Result<(PluginIdentity, PluginInfo)> {
        let p = self.instantiate(label, bytes, Limits::default())?;
        Ok((p.identity, p.info))
    }

    pub fn load_bytes(
        &self,
        label: &str,
        bytes: &[u8],
        config: &[(String, String)],
        limits: Limits,
    ) -> Result<Plugin> {
        let mut p = self.instantiate(label, bytes, limits)?;
        p.config = config.to_vec();
        p.configure().map_err(|message| Error::Plugin { plugin: label.to_string(), message })?;
        Ok(p)
    }

    /// Compile (or load from the cache), sandbox, instantiate and ask for `info`.
    fn instantiate(&self, label: &str, bytes: &[u8], limits: Limits) -> Result<Plugin> {
        let fail = |message: String| Error::Plugin { plugin: label.to_string(), message };
        let component = cache::load(&self.engine, self.cache.as_deref(), bytes)
            .map_err(|e| fail(format!("not a WebAssembly component: {e:#}")))?;
        let output = GuestOutput::default();
        let mut store = Store::new(&self.engine, guest_state(limits.memory_bytes, &output));
        store.limiter(|s| &mut s.limiter);
        let deadline = (limits.call_timeout.as_millis() / EPOCH.as_millis()).max(1) as u64;
        store.set_epoch_deadline(deadline);
        // The contract version the component was built against, from its export's name.
        let built_for = contract_of(&self.engine, &component);
        let supported = contract::SUPPORTED.join(", ");
        let version = match &built_for {
            Some(v) if contract::SUPPORTED.contains(&v.as_str()) => v.clone(),
            Some(v) => {
                return Err(fail(format!(
                "was built against the km0 contract {v} (km0:plugin/aggregate@{v}); this km0 runs plugins \
                     built against {supported}: rebuild it against km0's wit/ (or run it on a km0 that \
                     implements {v})"
            )))
            }
            None => CONTRACT_VERSION.to_string(),
        };
        let contract = |e: wasmtime::Error| {
            fail(format!(
                "does not implement the km0 contract (world km0:plugin/aggregate-plugin@{version}; this km0 \
                 runs {supported}): {e:#}"
            ))
        };
        let pre = transient_retried(|| self.linker.instantiate_pre(&component)).map_err(contract)?;
        let exported = exports(&self.engine, &component);
        let exports_one = |name: &str| exported.iter().any(|n| n.starts_with(name));
        let optional = Optional {
            fires: exports_one("km0:plugin/fire@"),
            merges: exports_one("km0:plugin/panes@"),
            packs: exports_one("km0:plugin/packed-records@"),
        };
        let pre = Pre::new(&version, pre, optional).map_err(contract)?;
        let running = self.ticker.running();
        let instance = pre.instantiate(&mut store).map_err(contract)?;
        let info = instance.info(&mut store).map_err(|e| fail(format!("info trapped: {e:#}")))?;
        let key_fields =
            instance.key_fields(&mut store).map_err(|e| fail(format!("key-fields trapped: {e:#}")))?;
        drop(running);
        let identity = PluginIdentity {
            name: info.name.clone(),
            version: info.version.clone(),
            state_schema: info.state_schema,
            sha256: hex(&Sha256::digest(bytes)),
            contract: version,
            key_fields,
        };
        Ok(Plugin {
            store,
            instance,
            info,
            identity,
            deadline,
            limits,
            pre,
            config: Vec::new(),
            calls: CallStats::default(),
            ticker: self.ticker.clone(),
            packed_paused: 0,
            output,
            printed: std::collections::VecDeque::new(),
            logged: None,
        })
    }
}

/// The version of `km0:plugin/aggregate` a component exports, if it exports one.
fn contract_of(engine: &Engine, component: &wasmtime::component::Component) -> Option<String> {
    exports(engine, component)
        .iter()
        .find_map(|n| n.strip_prefix("km0:plugin/aggregate@").map(str::to_string))
}

/// The names a component exports.
fn exports(engine: &Engine, component: &wasmtime::component::Component) -> Vec<String> {
    component.component_type().exports(engine).map(|(name, _)| name.to_string()).collect()
}

fn runtime_error(message: String) -> Error {
    Error::Plugin { plugin: "runtime".into(), message }
}

/// A configured plugin instance.
pub struct Plugin {
    store: Store<GuestState>,
    instance: Instance,
    info: PluginInfo,
    identity: PluginIdentity,
    /// Epochs one call may run.
    deadline: u64,
    limits: Limits,
    /// To make a fresh instance after a trap.
    pre: Pre,
    config: Vec<(String, String)>,
    calls: CallStats,
    ticker: Arc<Ticker>,
    /// Calls left that return their records as a list ([`PACKED_PAUSE`]).
    packed_paused: u32,
    /// What the guest writes to stdout and stderr.
    output: GuestOutput,
    /// The last things it wrote, one entry a call.
    printed: std::collections::VecDeque<Printed>,
    /// When its output last went to km0's log, and how many calls' output did not since.
    logged: Option<(std::time::Instant, u64)>,
}

/// What a guest wrote to stdout or stderr during one call (its last lines).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Printed {
    pub at_ms: i64,
    pub text: String,
}

/// Calls' output a plugin keeps for the status.
pub const PRINTED_KEPT: usize = 10;

/// How often a plugin's output goes to km0's log (the calls in between are counted).
const OUTPUT_LOG_EVERY: Duration = Duration::from_secs(1);

/// Lines of a guest's output a fault's reason quotes.
const REASON_LINES: usize = 5;

impl Plugin {
    /// Its calls so far.
    pub fn calls(&self) -> &CallStats {
        &self.calls
    }

    /// Let each of the next calls run at most `t`, never past its call timeout (a shadow's
    /// calls spend what is left of its budget).
    pub fn limit_call_time(&mut self, t: Duration) {
        let t = t.min(self.limits.call_timeout);
        self.deadline = (t.as_millis() / EPOCH.as_millis()).max(1) as u64;
    }

    /// What it wrote to stdout and stderr lately, oldest first.
    pub fn printed(&self) -> Vec<Printed> {
        self.printed.iter().cloned().collect()
    }

    /// A call wrote `text`: kept for the status, and logged at most once every
    /// [`OUTPUT_LOG_EVERY`].
    fn note_output(&mut self, text: &str) {
        if self.printed.len() == PRINTED_KEPT {
            self.printed.pop_front();
        }
        self.printed.push_back(Printed { at_ms: crate::metrics::now_ms(), text: text.to_string() });
        let now = std::time::Instant::now();
        match &mut self.logged {
            Some((at, skipped)) if now.duration_since(*at) < OUTPUT_LOG_EVERY => *skipped += 1,
            logged => {
                let skipped = logged.map_or(0, |(_, n)| n);
                tracing::info!(
                    plugin = %format!("{} {}", self.identity.name, self.identity.version),
                    calls_not_logged = skipped,
                    "plugin output: {}",
                    last_lines(text, REASON_LINES).escape_debug()
                );
                *logged = Some((now, 0));
            }
        }
    }

    pub fn info(&self) -> &PluginInfo {
        &self.info
    }

    pub fn identity(&self) -> &PluginIdentity {
        &self.identity
    }

    /// How many key fields the plugin reads from every group (0: any).
    pub fn key_fields(&self) -> u32 {
        self.identity.key_fields
    }

    fn configure(&mut self) -> std::result::Result<(), String> {
        self.store.set_epoch_deadline(self.deadline);
        let _running = self.ticker.running();
        self.instance
            .configure(&mut self.store, &self.config)
            .map_err(|e| format!("configure trapped: {e:#}"))?
            .map_err(|reason| format!("refused its configuration: {reason}"))
    }

    /// Replace the instance with a fresh, configured one (after a trap an instance cannot
    /// be entered again). State lives in the host, so nothing is lost.
    pub fn reset(&mut self) -> Result<()> {
        let engine = self.store.engine().clone();
        let mut store = Store::new(&engine, guest_state(self.limits.memory_bytes, &self.output));
        store.limiter(|s| &mut s.limiter);
        store.set_epoch_deadline(self.deadline);
        let running = self.ticker.running();
        let instance = self.pre.instantiate(&mut store);
        drop(running);
        let instance = instance.map_err(|e| self.call_error("reset", format!("{e:#}")))?;
        self.store = store;
        self.instance = instance;
        self.configure().map_err(|m| self.call_error("configure", m))
    }

    fn call_error(&self, call: &'static str, message: String) -> Error {
        Error::PluginCall {
            plugin: format!("{} {}", self.identity.name, self.identity.version),
            call,
            message,
        }
    }

    /// Call an export; a trap and a refusal both become errors naming the call.
    fn call<T>(
        &mut self,
        call: &'static str,
        f: impl FnOnce(&Instance, &mut Store<GuestState>) -> wasmtime::Result<Result<T, String>>,
    ) -> Result<T> {
        self.store.set_epoch_deadline(self.deadline);
        let running = self.ticker.running();
        let t = std::time::Instant::now();
        let result = f(&self.instance, &mut self.store);
        self.calls.observe(t.elapsed());
        drop(running);
        let printed = self.output.take();
        if let Some(text) = &printed {
            self.note_output(text);
        }
        let out_of_memory = self.store.data_mut().limiter.take_refused();
        match result {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(reason)) => {
                self.calls.refused += 1;
                Err(self.call_error(call, reason))
            }
            Err(trap) => {
                let kind = trap.downcast_ref::<Trap>().copied();
                if kind == Some(Trap::Interrupt) {
                    self.calls.timed_out += 1;
                } else {
                    self.calls.trapped += 1;
                }
                tracing::debug!(call, "plugin trap: {trap:#}");
                let reason = fault_reason(kind, &trap, out_of_memory, &self.limits, printed.as_deref());
                Err(self.call_error(call, reason))
            }
        }
    }

    /// Fold a batch into its groups' accumulators.
    pub fn add(&mut self, groups: &Groups, events: &Events) -> Result<Packed> {
        let out = self.call("add", |i, store| i.add(store, groups, events))?;
        self.check_packed("add", &out, groups.window_start.len())?;
        Ok(out)
    }

    /// Pairwise merge of accumulators.
    pub fn merge(&mut self, left: &Packed, right: &Packed) -> Result<Packed> {
        let out = self.call("merge", |i, store| i.merge(store, left, right))?;
        self.check_packed("merge", &out, left.ends.len())?;
        Ok(out)
    }

    /// Results of firing windows.
    pub fn finish(&mut self, groups: &Groups) -> Result<Vec<Emitted>> {
        let packs = self.packs();
        let out = self.call("finish", |i, store| i.finish(store, groups, packs));
        let out = out.and_then(|out| self.check_emitted("finish", out, groups));
        self.after_records(packs, out.is_err());
        out
    }

    /// Whether the next call that returns records may return them in one buffer (a
    /// plugin that exports `packed-records`, not within [`PACKED_PAUSE`] calls of a fault
    /// in such a call); counts a call of the pause.
    fn packs(&mut self) -> bool {
        if self.packed_paused == 0 {
            return true;
        }
        self.packed_paused -= 1;
        false
    }

    /// After a call that returned records: a fault in one that returned them in one
    /// buffer starts a pause.
    fn after_records(&mut self, packs: bool, failed: bool) {
        if packs && failed && self.instance.packs_records() {
            self.packed_paused = PACKED_PAUSE;
        }
    }

    /// Whether the plugin folds and finishes closing windows in one call (it exports
    /// `fire`).
    pub fn fires(&self) -> bool {
        self.instance.fires()
    }

    /// Fold the groups' events and finish their windows, which close, in one call
    /// (`fire.add-and-finish`); refused when the plugin does not export `fire`.
    pub fn add_and_finish(&mut self, groups: &Groups, events: &Events) -> Result<Vec<Emitted>> {
        let packs = self.packs();
        let out = self.call("add-and-finish", |i, store| {
            i.add_and_finish(store, groups, events, packs)
                .unwrap_or_else(|| Ok(Err("the plugin does not export fire".into())))
        });
        let out = out.and_then(|out| self.check_emitted("add-and-finish", out, groups));
        self.after_records(packs, out.is_err());
        out
    }

    /// Whether the plugin merges a sliding window's panes and finishes it in one call (it
    /// exports `panes`).
    pub fn merges_panes(&self) -> bool {
        self.instance.merges_panes()
    }

    /// Merge each group's panes (`counts[i]` items of `panes`, earliest first) and finish
    /// its window in one call (`panes.merge-and-finish`); refused when the plugin does not
    /// export `panes`.
    pub fn merge_and_finish(
        &mut self,
        groups: &Groups,
        panes: &Packed,
        counts: &[u32],
    ) -> Result<Vec<Emitted>> {
        let packs = self.packs();
        let out = self.call("merge-and-finish", |i, store| {
            i.merge_and_finish(store, groups, panes, counts, packs)
                .unwrap_or_else(|| Ok(Err("the plugin does not export panes".into())))
        });
        let out = out.and_then(|out| self.check_emitted("merge-and-finish", out, groups));
        self.after_records(packs, out.is_err());
        out
    }

    /// Records that name a group of the call (in one buffer: its items, each UTF-8, one
    /// a group).
    fn check_emitted(&mut self, call: &'static str, out: Records, groups: &Groups) -> Result<Vec<Emitted>> {
        let out = match out {
            Records::Listed(out) => out,
            Records::Packed { groups, values } => match unpack_records(&groups, &values) {
                Ok(out) => out,
                Err(message) => {
                    self.calls.malformed += 1;
                    return Err(self.call_error(call, message));
                }
            },
        };
        let n = groups.window_start.len();
        if let Some(bad) = out.iter().find(|e| e.group as usize >= n) {
            self.calls.malformed += 1;
            return Err(self.call_error(call, format!("emitted for group {} of {n}", bad.group)));
        }
        Ok(out)
    }

    /// Convert accumulators of state schema `from` to this plugin's schema.
    pub fn migrate(&mut self, from: u32, accumulators: &Packed) -> Result<Packed> {
        let out = self.call("migrate", |i, store| i.migrate(store, from, accumulators))?;
        self.check_packed("migrate", &out, accumulators.ends.len())?;
        Ok(out)
    }

    fn check_packed(&mut self, call: &'static str, p: &Packed, n: usize) -> Result<()> {
        if p.ends.len() != n {
            self.calls.malformed += 1;
            return Err(
                self.call_error(call, format!("returned {} accumulators for {n} groups", p.ends.len()))
            );
        }
        let mut prev = 0u32;
        for &e in &p.ends {
            if e < prev || e as usize > p.bytes.len() {
                self.calls.malformed += 1;
                return Err(self.call_error(call, "returned malformed packed accumulators".into()));
            }
            prev = e;
        }
        Ok(())
    }
}

/// Why a call trapped, in the words of what happened: out of time (with the limit), out
/// of memory (only when the instance asked for more than its budget), a panic (with the
/// guest's message and where it was), or the trap's kind; then the last lines the guest
/// wrote that are not part of its panic message.
fn fault_reason(
    kind: Option<Trap>,
    trap: &wasmtime::Error,
    out_of_memory: bool,
    limits: &Limits,
    printed: Option<&str>,
) -> String {
    let panic = printed.and_then(panic_message);
    let mut reason = match (kind, &panic) {
        (Some(Trap::Interrupt), _) => {
            format!("ran longer than its limit of {:?} for one call and was stopped", limits.call_timeout)
        }
        (_, _) if out_of_memory => format!(
            "ran out of memory: it asked for more than its limit of {} MiB",
            limits.memory_bytes >> 20
        ),
        (_, Some((message, _))) => message.clone(),
        (Some(Trap::StackOverflow), _) => "overflowed its stack".into(),
        (Some(kind), _) => format!("trapped: {kind}"),
        // Not a trap of the guest's code: the host's error (first line; the rest is a
        // backtrace).
        (None, _) => format!("failed: {}", format!("{trap:#}").lines().next().unwrap_or("")),
    };
    let rest = match (&panic, printed) {
        (Some((_, rest)), _) => rest.trim().to_string(),
        (None, Some(text)) => text.trim().to_string(),
        (None, None) => String::new(),
    };
    if !rest.is_empty() {
        reason.push_str("; it wrote: ");
        reason.push_str(&last_lines(&rest, REASON_LINES));
    }
    // The guest's words go to logs, terminals and pages.
    crate::text::printable(&reason).into_owned()
}

/// `f`'s result, asked again a few times while it fails for a moment in the kernel, not in
/// the plugin: wasmtime keeps a component's initial memory in a sealed memfd, and Linux
/// refuses to seal one (EBUSY, "cannot add seals to the memfd") while it has its pages
/// pinned for a moment (migration, reclaim under memory pressure).
fn transient_retried<T>(mut f: impl FnMut() -> wasmtime::Result<T>) -> wasmtime::Result<T> {
    let mut attempt = 0;
    loop {
        match f() {
            Err(e) if attempt < 5 && format!("{e:#}").contains("memfd") => {
                attempt += 1;
                tracing::debug!(error = %format!("{e:#}"), attempt, "the kernel refused a memory image for a moment; asking again");
                std::thread::sleep(Duration::from_millis(20 * attempt));
            }
            done => return done,
        }
    }
}

/// A Rust guest's panic report in what it wrote (`thread '..' panicked at FILE:LINE:COL:`
/// then the message, up to the `note:` line): "panicked at FILE:LINE:COL: MESSAGE", and
/// the lines before the report.
fn panic_message(printed: &str) -> Option<(String, String)> {
    let at = printed.rfind(" panicked at ")?;
    let line_start = printed[..at].rfind('\n').map_or(0, |i| i + 1);
    let report = &printed[at + " panicked at ".len()..];
    let mut lines = report.lines();
    let place = lines.next()?.trim_end_matches(':').trim();
    let message: Vec<&str> = lines.take_while(|l| !l.starts_with("note: ")).collect();
    let message = message.join(" / ");
    let message = message.trim();
    let text = if message.is_empty() {
        format!("panicked at {place}")
    } else {
        format!("panicked at {place}: {message}")
    };
    Some((text, printed[..line_start].to_string()))
}

/// The last `n` lines of `text`, joined by " / ", at most 1 000 characters (without Rust's
/// hint about backtraces, which a guest cannot take).
fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim_end)
        .filter(|l| !l.is_empty() && !l.starts_with("note: run with `RUST_BACKTRACE=1`"))
        .collect();
    let joined = lines[lines.len().saturating_sub(n)..].join(" / ");
    match joined.char_indices().rev().nth(999) {
        Some((i, _)) => format!("...{}", &joined[i..]),
        None => joined,
    }
}

/// The records of `packed-records` as those of a `list<emitted>`: record `i` is item `i` of
/// `values`, for group `groups[i]`; an error says what is malformed.
fn unpack_records(groups: &[u32], values: &Packed) -> std::result::Result<Vec<Emitted>, String> {
    if groups.len() != values.ends.len() {
        return Err(format!("returned {} records with {} groups", values.ends.len(), groups.len()));
    }
    let mut out = Vec::with_capacity(groups.len());
    let mut start = 0usize;
    for (&group, &end) in groups.iter().zip(&values.ends) {
        let Some(bytes) = values.bytes.get(start..end as usize) else {
            return Err("returned malformed packed records".into());
        };
        let value = std::str::from_utf8(bytes)
            .map_err(|_| format!("returned record {} that is not UTF-8", out.len()))?;
        out.push(Emitted { group, value: value.to_string() });
        start = end as usize;
    }
    if start != values.bytes.len() {
        return Err(format!("returned {} bytes after its last record", values.bytes.len() - start));
    }
    Ok(out)
}

/// Item `i` of a packed buffer (the caller checked the ends).
#[inline]
pub fn packed_item(p: &Packed, i: usize) -> &[u8] {
    let start = if i == 0 { 0 } else { p.ends[i - 1] as usize };
    &p.bytes[start..p.ends[i] as usize]
}

/// Append an item to a packed buffer.
#[inline]
pub fn packed_push(p: &mut Packed, item: &[u8]) {
    crate::state::append(&mut p.bytes, item);
    p.ends.push(p.bytes.len() as u32);
}

pub fn packed_clear(p: &mut Packed) {
    p.bytes.clear();
    p.ends.clear();
}

pub fn empty_packed() -> Packed {
    Packed { bytes: Vec::new(), ends: Vec::new() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_in_one_buffer_are_those_of_a_list_and_malformed_ones_are_named() {
        let packed = |bytes: &[u8], ends: &[u32]| Packed { bytes: bytes.to_vec(), ends: ends.to_vec() };
        // Counted by hand: "{}" for group 2, "" for group 0, {"a":"ñ"} for group 2.
        let values = packed("{}{\"a\":\"ñ\"}".as_bytes(), &[2, 2, 12]);
        let got = unpack_records(&[2, 0, 2], &values).unwrap();
        let got: Vec<(u32, &str)> = got.iter().map(|e| (e.group, e.value.as_str())).collect();
        assert_eq!(got, [(2, "{}"), (0, ""), (2, "{\"a\":\"ñ\"}")]);
        assert!(unpack_records(&[], &packed(b"", &[])).unwrap().is_empty());
        let err = |groups: &[u32], values: &Packed| unpack_records(groups, values).unwrap_err();
        assert_eq!(err(&[0], &values), "returned 3 records with 1 groups");
        assert_eq!(err(&[0, 0], &packed(b"{}", &[2, 1])), "returned malformed packed records");
        assert_eq!(err(&[0], &packed(b"{}", &[3])), "returned malformed packed records");
        assert_eq!(err(&[0], &packed(b"{}{", &[2])), "returned 1 bytes after its last record");
        assert_eq!(err(&[], &packed(b"{}", &[])), "returned 2 bytes after its last record");
        // The ñ cut in two: the first record ends inside it.
        let cut = packed("{\"a\":\"ñ\"}".as_bytes(), &[7, 10]);
        assert_eq!(err(&[0, 0], &cut), "returned record 0 that is not UTF-8");
    }

    #[test]
    fn a_fault_reason_says_what_happened_in_the_guests_words() {
        let limits = Limits { call_timeout: Duration::from_millis(300), memory_bytes: 256 << 20 };
        let trap = wasmtime::Error::new(Trap::UnreachableCodeReached);
        // Written by hand as Rust's default panic hook writes a panic.
        let panic = "starting\nthread '<unnamed>' panicked at src/plugin.rs:57:21:\nboom\nnote: run with `RUST_BACKTRACE=1` environment variable to display a backtrace\n";
        let reason = |kind, oom, printed| fault_reason(kind, &trap, oom, &limits, printed);
        assert_eq!(
            reason(Some(Trap::UnreachableCodeReached), false, Some(panic)),
            "panicked at src/plugin.rs:57:21: boom; it wrote: starting"
        );
        assert_eq!(
            reason(Some(Trap::Interrupt), false, None),
            "ran longer than its limit of 300ms for one call and was stopped"
        );
        assert_eq!(
            reason(Some(Trap::UnreachableCodeReached), true, Some("memory allocation of 64 bytes failed\n")),
            "ran out of memory: it asked for more than its limit of 256 MiB; it wrote: memory allocation of 64 \
             bytes failed"
        );
        // No panic, no memory asked for: the trap's kind, and no word of memory.
        let plain = reason(Some(Trap::UnreachableCodeReached), false, None);
        assert_eq!(plain, format!("trapped: {}", Trap::UnreachableCodeReached));
        assert!(!plain.contains("memory"));
        assert_eq!(reason(Some(Trap::StackOverflow), false, None), "overflowed its stack");
        // A Python traceback's last lines.
        let py = "Traceback (most recent call last):\n  File \"app.py\", line 3\nValueError: boom\n";
        assert!(reason(Some(Trap::UnreachableCodeReached), false, Some(py))
            .ends_with("line 3 / ValueError: boom"));
        assert_eq!(last_lines(&"x".repeat(3000), 5).chars().count(), 1003);
    }

    #[test]
    fn the_epoch_ticks_while_a_guest_runs_and_not_otherwise() {
        let mut config = Config::new();
        config.epoch_interruption(true);
        let engine = Engine::new(&config).unwrap();
        let ticker = Ticker::start(&engine).unwrap();
        let ticks = || ticker.ticks.load(Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(ticks(), 0, "ticked with nothing running");
        let t = std::time::Instant::now();
        let running = ticker.running();
        // Two guests at once (another instance's call) keep it ticking until both end.
        let other = ticker.running();
        std::thread::sleep(Duration::from_millis(150));
        drop(other);
        std::thread::sleep(Duration::from_millis(150));
        drop(running);
        // A tick every 10 ms of the time the guests ran (at least 300 ms; longer when this
        // thread was kept waiting), none sooner; a loaded machine may tick later.
        let (during, ran) = (ticks(), t.elapsed());
        let most = (ran.as_millis() / EPOCH.as_millis()) as u64 + 1;
        assert!((5..=most).contains(&during), "{during} ticks in {ran:?}");
        std::thread::sleep(Duration::from_millis(300));
        assert!(ticks() <= during + 1, "{} ticks after the guests ended, {during} before", ticks());
        // The thread ends with its engine, within a look of it.
        drop(engine);
        let deadline = std::time::Instant::now() + IDLE_LOOK * 5;
        while Arc::strong_count(&ticker.running) > 1 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(Arc::strong_count(&ticker.running), 1, "the ticker thread still holds its counter");
    }
}

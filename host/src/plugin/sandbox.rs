//! What a guest may use: WASI with nothing in it, no way to wait, fixed clocks, and a
//! budget for the whole instance.
//!
//! - **Nothing to reach**: no preopened directories, no network, no environment, no
//!   arguments, stdin closed; stdout and stderr go to a bounded buffer in memory
//!   ([`GuestOutput`]: its last lines tell why a call failed, and what a guest prints
//!   reaches the log and the status).
//! - **No way to wait**: `wasi:io/poll`'s `poll` and `pollable.block` return at once, as
//!   if everything were ready (a guest has nothing real to wait for), so a guest cannot
//!   sleep in a host call where epoch interruption does not reach it: the call timeout is
//!   a limit on wall time too. A guest that spins is stopped at its epoch deadline.
//! - **Deterministic**: the wall clock always reads [`GUEST_WALL_CLOCK`], the monotonic
//!   clock never moves, and randomness is a fixed sequence; a plugin is a pure function
//!   of its configuration, accumulators and events, so a replay gives the same output.
//! - **One budget**: the instance's linear memories *together* (and its tables, counted
//!   at [`TABLE_ELEMENT_BYTES`] an element) may not exceed the memory limit, and the
//!   number of memories, tables and instances is bounded.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use wasmtime::component::{HasData, Linker, Resource, ResourceTable};
use wasmtime::ResourceLimiter;
use wasmtime_wasi::p2::bindings::sync::io::poll;
use wasmtime_wasi::p2::{DynPollable, OutputStream, Pollable, StreamResult};
use wasmtime_wasi::{HostMonotonicClock, HostWallClock, WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

/// What the guests' wall clock reads: 2000-01-01T00:00:00Z, always.
pub const GUEST_WALL_CLOCK: Duration = Duration::from_secs(946_684_800);

/// What one table element counts against the memory budget.
pub const TABLE_ELEMENT_BYTES: usize = 16;

/// Linear memories, tables and instances one plugin instance may create.
const MAX_MEMORIES: usize = 32;
const MAX_TABLES: usize = 64;
const MAX_INSTANCES: usize = 64;

/// A guest's store data.
pub struct GuestState {
    wasi: WasiCtx,
    table: ResourceTable,
    pub(crate) limiter: GuestLimiter,
}

/// Bytes of a guest's output kept: the last ones written.
pub const OUTPUT_TAIL: usize = 4096;

/// What a guest writes to stdout and stderr (one stream, as on a terminal): the last
/// [`OUTPUT_TAIL`] bytes are kept, older ones dropped; writing never fails and never
/// blocks, whatever the guest writes.
#[derive(Clone, Default)]
pub struct GuestOutput(Arc<Mutex<Tail>>);

#[derive(Default)]
struct Tail {
    bytes: Vec<u8>,
    /// Bytes written since the last take.
    written: usize,
}

impl GuestOutput {
    fn append(&self, b: &[u8]) {
        let mut t = self.0.lock().unwrap_or_else(|e| e.into_inner());
        t.written = t.written.saturating_add(b.len());
        let b = &b[b.len().saturating_sub(OUTPUT_TAIL)..];
        t.bytes.extend_from_slice(b);
        if t.bytes.len() > 2 * OUTPUT_TAIL {
            let cut = t.bytes.len() - OUTPUT_TAIL;
            t.bytes.drain(..cut);
        }
    }

    /// What was written since the last take (its last [`OUTPUT_TAIL`] bytes, as text),
    /// if anything was.
    pub fn take(&self) -> Option<String> {
        let mut t = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if t.written == 0 {
            return None;
        }
        let start = t.bytes.len().saturating_sub(OUTPUT_TAIL);
        let text = String::from_utf8_lossy(&t.bytes[start..]).into_owned();
        let cut = t.written > OUTPUT_TAIL;
        t.bytes.clear();
        t.written = 0;
        Some(if cut { format!("...{text}") } else { text })
    }
}

impl wasmtime_wasi::cli::IsTerminal for GuestOutput {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl wasmtime_wasi::cli::StdoutStream for GuestOutput {
    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.clone())
    }
    fn async_stream(&self) -> Box<dyn tokio::io::AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
}

#[async_trait::async_trait]
impl Pollable for GuestOutput {
    async fn ready(&mut self) {}
}

impl OutputStream for GuestOutput {
    fn write(&mut self, bytes: bytes::Bytes) -> StreamResult<()> {
        self.append(&bytes);
        Ok(())
    }
    fn flush(&mut self) -> StreamResult<()> {
        Ok(())
    }
    fn check_write(&mut self) -> StreamResult<usize> {
        Ok(64 << 10)
    }
}

impl tokio::io::AsyncWrite for GuestOutput {
    fn poll_write(self: Pin<&mut Self>, _: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        self.append(buf);
        Poll::Ready(Ok(buf.len()))
    }
    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

impl WasiView for GuestState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView { ctx: &mut self.wasi, table: &mut self.table }
    }
}

/// A WASI context with nothing in it but `output` for stdout and stderr, and a budget of
/// `memory_bytes`.
pub fn guest_state(memory_bytes: usize, output: &GuestOutput) -> GuestState {
    let mut b = WasiCtxBuilder::new();
    b.stdout(output.clone());
    b.stderr(output.clone());
    // Fixed randomness: guests' hash maps and the like behave the same on every replay.
    b.secure_random(wasmtime_wasi::random::Deterministic::new(vec![0x6b, 0x6d, 0x30, 0x21]));
    b.insecure_random(wasmtime_wasi::random::Deterministic::new(vec![0x30, 0x6d, 0x6b, 0x21]));
    b.insecure_random_seed(0x6b6d30);
    b.wall_clock(FixedWallClock);
    b.monotonic_clock(StoppedClock);
    GuestState {
        wasi: b.build(),
        table: ResourceTable::new(),
        limiter: GuestLimiter { budget: memory_bytes, used: 0, refused: false },
    }
}

/// Link WASI for guests, with the waiting calls replaced by ones that never wait.
pub fn link(linker: &mut Linker<GuestState>) -> wasmtime::Result<()> {
    wasmtime_wasi::p2::add_to_linker_sync(linker)?;
    linker.allow_shadowing(true);
    poll::add_to_linker::<GuestState, NoWait>(linker, |s| NoWaitPoll(&mut s.table))?;
    linker.allow_shadowing(false);
    Ok(())
}

struct FixedWallClock;

impl HostWallClock for FixedWallClock {
    fn resolution(&self) -> Duration {
        Duration::from_millis(1)
    }
    fn now(&self) -> Duration {
        GUEST_WALL_CLOCK
    }
}

struct StoppedClock;

impl HostMonotonicClock for StoppedClock {
    fn resolution(&self) -> u64 {
        1_000_000
    }
    fn now(&self) -> u64 {
        0
    }
}

/// `wasi:io/poll` that never waits.
struct NoWait;

impl HasData for NoWait {
    type Data<'a> = NoWaitPoll<'a>;
}

struct NoWaitPoll<'a>(&'a mut ResourceTable);

impl poll::Host for NoWaitPoll<'_> {
    fn poll(&mut self, pollables: Vec<Resource<DynPollable>>) -> wasmtime::Result<Vec<u32>> {
        if pollables.is_empty() {
            wasmtime::bail!("poll with an empty list");
        }
        Ok((0..pollables.len() as u32).collect())
    }
}

impl poll::HostPollable for NoWaitPoll<'_> {
    fn ready(&mut self, _: Resource<DynPollable>) -> wasmtime::Result<bool> {
        Ok(true)
    }
    fn block(&mut self, _: Resource<DynPollable>) -> wasmtime::Result<()> {
        Ok(())
    }
    fn drop(&mut self, pollable: Resource<DynPollable>) -> wasmtime::Result<()> {
        wasmtime_wasi_io::bindings::wasi::io::poll::HostPollable::drop(self.0, pollable)
    }
}

/// The instance's budget: every memory and table it creates or grows draws on it.
pub struct GuestLimiter {
    budget: usize,
    used: usize,
    /// A growth was refused for the budget since the last [`GuestLimiter::take_refused`].
    refused: bool,
}

impl GuestLimiter {
    fn grow(&mut self, more: usize) -> bool {
        match self.used.checked_add(more) {
            Some(total) if total <= self.budget => {
                self.used = total;
                true
            }
            _ => {
                self.refused = true;
                false
            }
        }
    }

    /// Whether the instance asked for more than its budget since the last take.
    pub fn take_refused(&mut self) -> bool {
        std::mem::take(&mut self.refused)
    }
}

impl ResourceLimiter for GuestLimiter {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        max: Option<usize>,
    ) -> wasmtime::Result<bool> {
        // A growth beyond the memory's own maximum fails anyway: it is not counted.
        if max.is_some_and(|m| desired > m) {
            return Ok(false);
        }
        Ok(self.grow(desired.saturating_sub(current)))
    }

    fn table_growing(
        &mut self,
        current: usize,
        desired: usize,
        max: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if max.is_some_and(|m| desired > m) {
            return Ok(false);
        }
        Ok(self.grow(desired.saturating_sub(current).saturating_mul(TABLE_ELEMENT_BYTES)))
    }

    fn instances(&self) -> usize {
        MAX_INSTANCES
    }
    fn tables(&self) -> usize {
        MAX_TABLES
    }
    fn memories(&self) -> usize {
        MAX_MEMORIES
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use wasmtime::{Engine, Instance, Module, Store};

    /// A core module with nine linear memories of 60 MiB each (multi-memory).
    fn nine_memories() -> Vec<u8> {
        let mut m = b"\0asm\x01\0\0\0".to_vec();
        m.extend([5, 1 + 9 * 3, 9]);
        for _ in 0..9 {
            m.extend([0x00, 0xc0, 0x07]); // min 960 pages = 60 MiB
        }
        m
    }

    /// A core module with one table of 60 million funcref elements.
    fn big_table() -> Vec<u8> {
        let mut m = b"\0asm\x01\0\0\0".to_vec();
        m.extend([4, 7, 1, 0x70, 0x00, 0x80, 0x8e, 0xce, 0x1c]);
        m
    }

    fn instantiate(wasm: &[u8], budget: usize) -> wasmtime::Result<()> {
        let engine = Engine::default();
        let module = Module::new(&engine, wasm)?;
        let mut store = Store::new(&engine, GuestLimiter { budget, used: 0, refused: false });
        store.limiter(|l| l);
        Instance::new(&mut store, &module, &[]).map(|_| ())
    }

    #[test]
    fn the_budget_holds_for_all_memories_and_tables_together() {
        // 9 x 60 MiB: each memory is below 64 MiB, together they are not.
        assert!(instantiate(&nine_memories(), 64 << 20).is_err());
        assert!(instantiate(&nine_memories(), 1 << 30).is_ok(), "the module itself is fine");
        // 60M table elements count as 960 MB.
        assert!(instantiate(&big_table(), 512 << 20).is_err());
    }
}

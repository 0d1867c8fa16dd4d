//! The `km0` command line (its commands are in cli/): the allocator, the process's limits
//! and logging, then the command.

// Host code handles outside data with errors, never a panic (tests may unwrap).
#![warn(clippy::unwrap_used, clippy::expect_used)]
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

mod cli;

use clap::Parser;

/// mimalloc (built without transparent huge pages: faulting those in made checkpoint
/// pauses erratic, 11 to 137 ms instead of a steady 18 to 26). Against glibc's malloc:
/// delivery panel +7%; the stock alert within 2% either way, depending on the measure.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's `mi_option_purge_delay` (its number in `mi_option_e` of the pinned v3
/// sources; the Rust bindings do not name it): milliseconds before freed memory goes back
/// to the system, 1000 by default (`src/options.c`).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// 100 ms instead of 1 s: a checkpoint's short-lived buffers raise the peak RSS less
/// (856k open windows: 315 MiB with 1 s, 280 with 100 ms, 274 with 3 ms). Not shorter:
/// the memory of the results of a firing and of the vectors that grow meanwhile, freed
/// and asked for again a few milliseconds later, went back to the system and faulted in
/// again each time. With 10 000 keys, 3 ms cost 12 000 page faults a run of 2M records
/// (3 000 with 100 ms) and 4-5% of the CPU (0.487 s against 0.466 s, interleaved runs);
/// with 1 000 keys and on the delivery panel they measured the same.
const PURGE_DELAY_MS: std::ffi::c_long = 100;

fn main() {
    // SAFETY: sets an option mimalloc reads when it purges; any value is valid.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, PURGE_DELAY_MS) };
    raise_open_files_limit();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KM0_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    if let Err(e) = cli::run(cli::Cli::parse()) {
        eprintln!("km0: error: {}", km0::error::chain_text(e.chain()));
        std::process::exit(1);
    }
}

/// Open files: the soft limit raised to the hard one (at most 65 536), as servers do, so
/// that RocksDB's files, the sinks and the control API's connections have room.
fn raise_open_files_limit() {
    let mut l = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit and setrlimit with a valid pointer to a local.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) == 0 && l.rlim_cur < l.rlim_max.min(65_536) {
            l.rlim_cur = l.rlim_max.min(65_536);
            libc::setrlimit(libc::RLIMIT_NOFILE, &l);
        }
    }
}

#[cfg(test)]
mod tests {
    /// Option 15 is the purge delay: its default in the pinned sources is 1000 ms (a
    /// renumbering in another mimalloc version would show here), and it takes the value set.
    #[test]
    fn the_purge_delay_option_is_the_one_set() {
        // SAFETY: reads and sets a mimalloc option.
        unsafe {
            if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
                assert_eq!(libmimalloc_sys::mi_option_get(super::MI_OPTION_PURGE_DELAY), 1000);
            }
            libmimalloc_sys::mi_option_set(super::MI_OPTION_PURGE_DELAY, super::PURGE_DELAY_MS);
            assert_eq!(libmimalloc_sys::mi_option_get(super::MI_OPTION_PURGE_DELAY), 100);
        }
    }
}

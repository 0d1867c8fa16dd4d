//! Stopping on SIGTERM or SIGINT, as an operator expects: the first signal asks the job to
//! stop with a savepoint at the next record boundary (then `km0` prints its path and exits
//! 0); a second one ends the process at once (checkpoints already protect the data).

use std::sync::atomic::{AtomicBool, Ordering};

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    if STOP.swap(true, Ordering::SeqCst) {
        // SAFETY: _exit is async-signal-safe.
        unsafe { libc::_exit(130) }
    }
}

/// Route SIGTERM and SIGINT to a stop with a savepoint (for `km0 run` and `km0 deploy`).
pub fn stop_with_savepoint_on_signals() {
    let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: the handler only touches an atomic and calls _exit, both async-signal-safe.
    unsafe {
        libc::signal(libc::SIGTERM, handler);
        libc::signal(libc::SIGINT, handler);
    }
}

/// Whether a stop was asked for.
#[inline]
pub(crate) fn stop_requested() -> bool {
    STOP.load(Ordering::Relaxed)
}

//! Process measurements: CPU time (for events per CPU-second) and wall-clock stamps.

use std::time::Duration;

/// CPU time consumed by the calling thread.
pub fn thread_cpu_time() -> Duration {
    clock(libc::CLOCK_THREAD_CPUTIME_ID)
}

/// CPU time consumed by the whole process (all threads).
pub fn process_cpu_time() -> Duration {
    clock(libc::CLOCK_PROCESS_CPUTIME_ID)
}

fn clock(id: libc::clockid_t) -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec; clock_gettime only writes into it.
    let rc = unsafe { libc::clock_gettime(id, &mut ts) };
    if rc != 0 {
        return Duration::ZERO;
    }
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

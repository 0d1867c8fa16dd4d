//! Benchmark: the stock-alert job Kafka -> km0 -> Kafka on this machine, against a real
//! tansu broker started here. Prints events per second, km0's CPU time (this process,
//! all its threads: the operator loop and librdkafka's) and the broker's, and the same
//! job from files for comparison. Run: `cargo bench -p km0-e2e --bench kafka`
//! (`KM0_BENCH_EVENTS` sets the stream's size, 1 000 000 by default).

use km0::job::{self, RunOptions};
use km0::plugin::PluginRuntime;
use km0_e2e::services::Tansu;
use km0_e2e::stock_topic::*;
use std::time::{Duration, Instant};

/// CPU time (user + system) of this process so far.
fn own_cpu() -> Duration {
    let mut u = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage fills the struct it is given.
    let u = unsafe {
        libc::getrusage(libc::RUSAGE_SELF, u.as_mut_ptr());
        u.assume_init()
    };
    let tv =
        |t: libc::timeval| Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64);
    tv(u.ru_utime) + tv(u.ru_stime)
}

/// CPU time of another process, from /proc (clock ticks of 1/100 s).
fn cpu_of(pid: u32) -> Duration {
    cpu_in(&format!("/proc/{pid}/stat"))
}

/// User + system time in a /proc `stat` file (of a process or a thread).
fn cpu_in(stat: &str) -> Duration {
    let stat = std::fs::read_to_string(stat).unwrap_or_default();
    let fields: Vec<&str> =
        stat.rsplit_once(')').map(|(_, r)| r.split_whitespace().collect()).unwrap_or_default();
    let ticks: u64 = fields.get(11).and_then(|u| u.parse().ok()).unwrap_or(0)
        + fields.get(12).and_then(|s| s.parse().ok()).unwrap_or(0);
    Duration::from_millis(ticks * 10)
}

/// The name of the thread [`cpu_by_thread`] reads /proc with.
const WATCHER: &str = "cpu-watch";

/// This process's CPU time while `f` runs, by thread name (digits folded: `rdk:broker#`),
/// most first, the watching thread's own ([`WATCHER`]) included: /proc/self/task is read
/// every 100 ms, so a thread that ends before `f` does counts with its last reading (up
/// to 100 ms short).
fn cpu_by_thread<R>(f: impl FnOnce() -> R) -> (R, Vec<(String, Duration)>) {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicBool, Ordering};
    let read = || -> HashMap<String, (String, Duration)> {
        let tasks = std::fs::read_dir("/proc/self/task").into_iter().flatten().flatten();
        tasks
            .map(|t| {
                let path = t.path();
                let comm = std::fs::read_to_string(path.join("comm")).unwrap_or_default();
                // A run of digits is a number: `rdk:broker1` and `rdk:broker12` are one name.
                let mut name = String::new();
                for c in comm.trim().chars() {
                    match c.is_ascii_digit() {
                        true if name.ends_with('#') => {}
                        true => name.push('#'),
                        false => name.push(c),
                    }
                }
                let tid = t.file_name().to_string_lossy().into_owned();
                (tid, (name, cpu_in(&path.join("stat").to_string_lossy())))
            })
            .collect()
    };
    let before = read();
    let done = AtomicBool::new(false);
    let (result, last) = std::thread::scope(|scope| {
        let watch = std::thread::Builder::new()
            .name(WATCHER.into())
            .spawn_scoped(scope, || {
                let mut last = HashMap::new();
                loop {
                    let stop = done.load(Ordering::Acquire);
                    last.extend(read());
                    if stop {
                        return last;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            })
            .expect("start the watching thread");
        let result = f();
        done.store(true, Ordering::Release);
        (result, watch.join().expect("the watching thread"))
    });
    let mut by_name: HashMap<String, Duration> = HashMap::new();
    for (tid, (name, cpu)) in last {
        let was = before.get(&tid).map_or(Duration::ZERO, |b| b.1);
        *by_name.entry(name).or_default() += cpu.saturating_sub(was);
    }
    let mut by_name: Vec<_> = by_name.into_iter().filter(|(_, d)| !d.is_zero()).collect();
    by_name.sort_by_key(|(_, cpu)| std::cmp::Reverse(*cpu));
    (result, by_name)
}

fn main() {
    // `cargo bench` passes `--bench`; a filter argument would select nothing here.
    let events: u64 =
        std::env::var("KM0_BENCH_EVENTS").ok().and_then(|v| v.parse().ok()).unwrap_or(1_000_000);
    let broker = Tansu::start();
    let s = stream(events, 0.0);
    let records: usize = s.parts.iter().map(Vec::len).sum();
    let t = Instant::now();
    s.produce(&broker);
    let produce = t.elapsed();
    broker.create_topic("inventario.alertas", 3);
    eprintln!(
        "produced {records} records into {INPUT} ({PARTITIONS} partitions) in {:.1} s ({:.0} records/s)",
        produce.as_secs_f64(),
        records as f64 / produce.as_secs_f64()
    );

    let dir = tempfile::tempdir().unwrap();
    let pipeline = write_pipeline(
        dir.path(),
        &kafka_source(&broker, "km0-bench"),
        "kind = \"kafka\"\ntopic = \"inventario.alertas\"",
        "path = \"out/dead-letter.jsonl\"",
        "[checkpoints]\ndir = \"out/checkpoints\"\ninterval = \"10s\"",
    );
    let runtime = PluginRuntime::new().unwrap();
    let (km0_0, broker_0, t) = (own_cpu(), cpu_of(broker.pid()), Instant::now());
    let (summary, threads) = cpu_by_thread(|| job::run(&pipeline, &RunOptions::default(), &runtime).unwrap());
    // Not km0's: the thread that read the others' CPU time.
    let watcher = threads.iter().find(|(name, _)| name == WATCHER).map_or(Duration::ZERO, |t| t.1);
    let (wall, km0_cpu, broker_cpu) =
        (t.elapsed(), (own_cpu() - km0_0).saturating_sub(watcher), cpu_of(broker.pid()) - broker_0);
    let n = summary.counters.read as f64;
    println!(
        "kafka -> km0 -> kafka: {n:.0} records, {} alerts in {:.2} s: {:.0} records/s; km0 CPU {:.2} s \
         ({:.0} records per km0 CPU-second), broker CPU {:.2} s; km0's share of the CPU used {:.0}%",
        summary.counters.emitted,
        wall.as_secs_f64(),
        n / wall.as_secs_f64(),
        km0_cpu.as_secs_f64(),
        n / km0_cpu.as_secs_f64(),
        broker_cpu.as_secs_f64(),
        100.0 * km0_cpu.as_secs_f64() / (km0_cpu + broker_cpu).as_secs_f64()
    );
    let threads: Vec<String> =
        threads.iter().map(|(name, cpu)| format!("{name} {:.2} s", cpu.as_secs_f64())).collect();
    println!("km0 CPU by thread (from /proc, 10 ms ticks): {}", threads.join(", "));

    let files = tempfile::tempdir().unwrap();
    let (c0, t) = (own_cpu(), Instant::now());
    let (_, counters, _) = s.file_run(files.path());
    let (wall, cpu) = (t.elapsed(), own_cpu() - c0);
    println!(
        "files -> km0 -> file (same records): {} records in {:.2} s: {:.0} records/s, {:.0} records per CPU-second",
        counters.read,
        wall.as_secs_f64(),
        counters.read as f64 / wall.as_secs_f64(),
        counters.read as f64 / cpu.as_secs_f64()
    );
}

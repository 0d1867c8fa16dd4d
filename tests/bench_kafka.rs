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
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> =
        stat.rsplit_once(')').map(|(_, r)| r.split_whitespace().collect()).unwrap_or_default();
    let ticks: u64 = fields.get(11).and_then(|u| u.parse().ok()).unwrap_or(0)
        + fields.get(12).and_then(|s| s.parse().ok()).unwrap_or(0);
    Duration::from_millis(ticks * 10)
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
    let summary = job::run(&pipeline, &RunOptions::default(), &runtime).unwrap();
    let (wall, km0_cpu, broker_cpu) = (t.elapsed(), own_cpu() - km0_0, cpu_of(broker.pid()) - broker_0);
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

#!/usr/bin/env python3
"""km0's benchmark table (`make bench`): every case of issue 16 on this machine, one table.

Each case runs the release binary in its own process, so that its CPU time and peak RSS
are its own:
  - throughput (`km0 bench`, best of 3, records per CPU-second of the whole process):
    the stock alert on the default stream (1 000 keys, 15 events per key and window) and
    on 10 000 keys (500 products x 20 markets: ~4 events per key and window and 1% late,
    the regime issue 16 sets, and a sparser 1.5; and over sliding windows, 5 minutes every
    minute), and the delivery panel (140 and 5 000 riders); on the 10 000-key input, a
    plain native loop too (`km0 bench --reference`: serde_json and a hash map of windows),
    the machine's yardstick, and km0's rate over it;
  - ~1M open keyed windows (1000 products x 1000 markets, every event in one 5-minute
    window), memory and RocksDB backends: the processing pause of one checkpoint, the
    recovery from it, and the process's peak RSS;
  - memory per open window: the resident set of a job that follows its input, measured
    once it has read everything (nothing fired yet), with ~1M and ~250k open windows:
    the difference over the difference in windows;
  - JSON: km0's projection scanner against sonic-rs (lazy access and serde), simd-json
    and serde_json, on the stock alert's 1 000- and 10 000-key streams and the panel's
    positions (tests/bench_json.rs), each reading the same fields: ns per record of km0 and
    of each library's fastest way that checks the whole record (and sonic-rs's fastest
    lazy way, which checks part); every way, and what each refuses of a corpus of
    malformed records, on stderr;
  - Kafka -> km0 -> Kafka against a local tansu broker (tests/bench_kafka.rs): the CPU
    per record of the release km0 process (start-up, every thread), best and median of
    three runs over the same produced topic. Skipped, and said
    so, without tansu (KM0_TANSU, else the folder scripts/install-tansu.sh installs
    into, else `tansu` on PATH).

  scripts/bench.py [--quick] [--only throughput,windows,json,kafka]
  (--quick: smaller streams, for a smoke run; --only: some groups of cases)
  scripts/bench.py --train   (the profile-guided build's training set: no table)

It times the binary KM0_BIN names (`make bench`: the one scripts/build-release.sh builds
first, profile-guided unless KM0_PGO=0; the table's first row says which), else cargo's
release build. The JSON rows time km0's scanner as `cargo bench` compiles it: plain.
"""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.environ.get("CARGO_TARGET_DIR", os.path.expanduser("~/.cache/km0-target"))
# The binary timed: KM0_BIN (make bench: the profile-guided one scripts/build-release.sh
# prints), else cargo's release build.
KM0 = os.path.abspath(os.environ.get("KM0_BIN") or os.path.join(TARGET, "release", "km0"))
QUICK = "--quick" in sys.argv
SCALE = 10 if QUICK else 1
ONLY = sys.argv[sys.argv.index("--only") + 1].split(",") if "--only" in sys.argv else None
ROWS = []


def row(case, value, unit, goal, how):
    ROWS.append((case, value, unit, goal, how))
    print(f"  {case}: {value} {unit}", file=sys.stderr, flush=True)


def run(args, **kw):
    """Run a command; returns (stdout + stderr, peak RSS in MiB)."""
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)
    out = p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        sys.exit(f"bench: {' '.join(args)} failed:\n{out}")
    return out, usage.ru_maxrss / 1024


def grab(pattern, text, what):
    m = re.search(pattern, text)
    if not m:
        sys.exit(f"bench: no {what} in:\n{text}")
    return float(m.group(1))


def pipeline(work, name, source, extra=""):
    """The stock-alert pipeline reading `source`, its outputs under `work/name`."""
    text = open(os.path.join(ROOT, "examples/stock-alert/pipeline.toml")).read()
    text = text.replace('path = "data/stock.jsonl"', f'path = "{source}"')
    text = text.replace("../../plugins/dist/", os.path.join(ROOT, "plugins/dist/"))
    text = text.replace('"out/', f'"{work}/{name}/')
    path = os.path.join(work, f"{name}.toml")
    with open(path, "w") as f:
        f.write(text + extra)
    return path


def sliding_pipeline(work):
    """The stock alert over sliding windows: 5 minutes every minute (each event in 5
    windows, each window merged from 5 panes)."""
    sliding = pipeline(work, "sliding", os.devnull)
    with open(sliding) as f:
        text = f.read()
    text = text.replace('kind = "tumbling"\nsize = "5m"', 'kind = "sliding"\nsize = "5m"\nslide = "1m"')
    if 'kind = "sliding"' not in text:
        sys.exit("bench: the stock example's window section changed: update the sliding case")
    with open(sliding, "w") as f:
        f.write(text)
    return sliding


def throughput(work):
    print("throughput (km0 bench, best of 3):", file=sys.stderr)
    stock = os.path.join(ROOT, "examples/stock-alert/pipeline.toml")
    panel = os.path.join(ROOT, "examples/delivery-panel/pipeline.toml")
    sliding = sliding_pipeline(work)
    cases = [
        ("stock alert, 1 000 keys", [stock, "--events", str(1_000_000 // SCALE)], ">= 5"),
        # The regime: ~4 events per key and window (an event every 8 ms of event
        # time over 10 000 keys: 3.6 per key and 5-minute window), 1% late.
        (
            "stock alert, 10 000 keys",
            [stock, "--events", str(2_000_000 // SCALE), "--products", "500", "--markets", "20",
             "--gap-ms", "8", "--late-fraction", "0.01", "--reference"],
            ">= 4",
        ),
        # Sparser: an event every 20 ms (1.5 per key and window), 0.2% late.
        (
            "stock alert, 10 000 keys, sparse",
            [stock, "--events", str(2_000_000 // SCALE), "--products", "500", "--markets", "20"],
            "none set",
        ),
        (
            "stock alert, 10 000 keys, sliding 5 min every 1 min",
            [sliding, "--events", str(2_000_000 // SCALE), "--products", "500", "--markets", "20",
             "--gap-ms", "8", "--late-fraction", "0.01"],
            "none set",
        ),
        ("delivery panel, 140 riders", [panel, "--stream", "delivery", "--events", str(1_000_000 // SCALE)], ">= 1.5"),
        # Many keys with an ordered plugin (distance): rows of every rider wait a window.
        (
            "delivery panel, 5 000 riders",
            [panel, "--stream", "delivery", "--events", str(1_000_000 // SCALE), "--riders", "5000"],
            "none set",
        ),
    ]
    for case, args, goal in cases:
        out, _ = run([KM0, "bench", *args])
        rate = grab(r"best ([0-9.]+) M records per CPU-second", out, "rate")
        row(case, f"{rate:.2f}", "M records/CPU-s", goal, "km0 bench " + " ".join(args[1:]))
        if "--reference" in args:
            # The machine's yardstick, timed over the same input in the same minutes: km0's
            # rate over it compares readings taken on other machines or in other spells.
            ref = grab(r"reference loop .*best ([0-9.]+) M records per CPU-second", out, "reference")
            ratio = grab(r"km0 over it, median of [0-9]+ runs each followed by the loop: ([0-9.]+)x", out, "ratio")
            row(f"{case}: reference loop (native serde_json)", f"{ref:.2f}", "M records/CPU-s", "none set",
                "km0 bench --reference: the same input parsed by serde_json into a hash map of windows")
            row(f"{case}: km0 over the reference loop", f"{ratio:.2f}", "x", "none set",
                "km0 bench --reference: median of the runs' ratios, each run followed by the loop")
    # The 10 000-key stream in 4 partitions (by producto), a task each
    # (`watermark = "per-partition"`): wall-clock records per second on 1 and 2 threads.
    tasks = [stock, "--events", str(2_000_000 // SCALE), "--products", "500", "--markets", "20",
             "--gap-ms", "8", "--late-fraction", "0.01", "--partitions", "4"]
    walls = {}
    for threads in (1, 2):
        args = tasks + ["--parallelism", str(threads)]
        out, _ = run([KM0, "bench", *args])
        walls[threads] = grab(r"best ([0-9.]+) M records per second \(wall clock", out, "wall-clock rate")
        cpu = grab(r"best ([0-9.]+) M records per CPU-second", out, "rate")
        row(f"stock alert, 10 000 keys, 4 partitions, parallelism {threads}", f"{walls[threads]:.2f}",
            "M records/s (wall)", ">= 1.8x parallelism 1" if threads == 2 else "none set",
            "km0 bench " + " ".join(args[1:]))
        row(f"stock alert, 10 000 keys, 4 partitions, parallelism {threads}: per CPU", f"{cpu:.2f}",
            "M records/CPU-s", "within 5% of one task", "the same runs: records over the task threads' CPU time")
    row("stock alert, 10 000 keys, 4 partitions: parallelism 2 over 1", f"{walls[2] / walls[1]:.2f}", "x",
        ">= 1.8", "the two rows above")


def windows(work, products=1000 // (3 if QUICK else 1), events=2_000_000 // SCALE):
    keys = os.path.join(work, "keys.jsonl")
    run([KM0, "generate", "stock", "--events", str(events), "--products", str(products), "--markets", str(products),
         "--gap-ms", "0", "--late-fraction", "0", "--out", keys])
    print(f"{events} events over {products}x{products} keys in one window:", file=sys.stderr)
    for backend in ("memory", "rocksdb"):
        extra = (
            f'\n[checkpoints]\ndir = "{work}/chk-{backend}"\ninterval = "1h"\nevery_records = {events - 10_000}\n'
            f'retain = 2\n[state]\nbackend = "{backend}"\ndir = "{work}/state-{backend}"\n'
        )
        p = pipeline(work, backend, keys, extra)
        out, rss = run([KM0, "run", p, "--http", "off", "--quiet", "--stop-with-savepoint-after", str(events - 1)])
        pause = grab(r"processing paused ([0-9.]+) ms at most", out, "checkpoint pause")
        open_windows = int(grab(r"\(([0-9]+) open windows", out, "open windows"))
        row(f"checkpoint pause, {open_windows} open windows, {backend}", f"{pause:.0f}", "ms", "< 50",
            "scripts/bench.py (one checkpoint near the end of the input)")
        row(f"peak RSS of that run, {backend}", f"{rss:.0f}", "MiB", "", "getrusage of the km0 process")
        out, _ = run([KM0, "run", p, "--http", "off", "--quiet"])
        recovery = grab(r"recovered from checkpoint \S+ in ([0-9.]+) ms", out, "recovery time")
        row(f"recovery of {open_windows} windows, {backend}", f"{recovery:.0f}", "ms", "< 1000",
            "the same pipeline run again: restored from its checkpoint")
    return keys, products, events


def resident(work, name, source, events):
    """(VmRSS in bytes, open windows) of a job following `source` once it has read it all."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = pipeline(work, name, source)
    job = subprocess.Popen([KM0, "run", p, "--follow", "--quiet", "--http", f"127.0.0.1:{port}"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 600
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/job", timeout=5) as r:
                    status = json.load(r)
                if status["counters"]["read"] >= events:
                    break
            except OSError:
                pass
            if time.time() > deadline or job.poll() is not None:
                sys.exit("bench: the following job did not read its input")
            time.sleep(0.5)
        time.sleep(1)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/job", timeout=5) as r:
            status = json.load(r)
        rss = next(int(l.split()[1]) * 1024 for l in open(f"/proc/{job.pid}/status") if l.startswith("VmRSS:"))
        return rss, sum(a["open_windows"] for a in status["aggregations"])
    finally:
        job.kill()
        job.wait()


def memory_per_window(work, keys, products, events):
    small = os.path.join(work, "small.jsonl")
    run([KM0, "generate", "stock", "--events", str(events // 4), "--products", str(products // 2), "--markets",
         str(products // 2), "--gap-ms", "0", "--late-fraction", "0", "--out", small])
    big_rss, big_windows = resident(work, "follow-big", keys, events)
    small_rss, small_windows = resident(work, "follow-small", small, events // 4)
    per = (big_rss - small_rss) / max(1, big_windows - small_windows)
    row("memory per open window (memory backend)", f"{per:.0f}", "bytes", "",
        f"resident set with {big_windows} and {small_windows} open windows")


def tansu():
    """The broker: KM0_TANSU, else where scripts/install-tansu.sh puts it, else on PATH."""
    if os.environ.get("KM0_TANSU"):
        found = os.environ["KM0_TANSU"]
    else:
        tools = os.environ.get("KM0_TOOLS") or os.path.expanduser("~/.cache/km0-tools")
        installed = os.path.join(tools, "tansu-0.6.0", "bin", "tansu")
        found = installed if os.access(installed, os.X_OK) else shutil.which("tansu")
    # Absolute: the bench runs in another folder.
    return os.path.abspath(found) if found else None


def kafka(events=1_000_000 // SCALE, runs=3):
    broker = tansu()
    if not broker:
        row("Kafka -> km0 -> Kafka, km0 CPU per record", "skipped", "(no tansu)", "<= 0.8", "")
        return
    env = dict(os.environ, KM0_BENCH_EVENTS=str(events), KM0_BENCH_RUNS=str(runs), CARGO_TARGET_DIR=TARGET,
               KM0_TANSU=broker, KM0_BIN=KM0)
    # --workspace, as scripts/test.sh builds it: the dependencies then resolve with the
    # workspace's dev-dependency features and the test build's wasmtime and km0 are reused.
    out, _ = run(["cargo", "bench", "--locked", "-q", "--workspace", "--bench", "kafka"], cwd=ROOT, env=env)
    best = grab(r"best of [0-9]+: km0 CPU [0-9.]+ s \(([0-9]+) records per km0 CPU-second\)", out, "Kafka rate")
    median = grab(r"median [0-9.]+ s \(([0-9]+) records per km0 CPU-second\)", out, "Kafka median")
    row("Kafka -> km0 -> Kafka, km0 CPU per record", f"{1e6 / best:.2f}", f"µs (median {1e6 / median:.2f})",
        "<= 0.8", f"cargo bench --workspace --bench kafka (best of {runs} runs)")


def json_parsers():
    """Per stream: km0's scanner as the job runs it (framed), and each library's fastest way
    that checks the whole record, and its fastest that checks part of it where it has one
    (sonic-rs's lazy access). The bench's full output, every way and what each refuses of
    a corpus of malformed records, goes to stderr."""
    env = dict(os.environ, KM0_BENCH_RECORDS=str(1_000_000 // SCALE), CARGO_TARGET_DIR=TARGET)
    out, _ = run(["cargo", "bench", "--locked", "-q", "--workspace", "--bench", "json"], cwd=ROOT, env=env)
    print("\n".join(l for l in out.splitlines() if l.startswith("bench json:")), file=sys.stderr)
    streams = {}
    stream = None
    for line in out.splitlines():
        m = re.match(r"bench json: (.+?): [0-9.]+ records of", line)
        if m:
            stream = m.group(1)
            streams[stream] = {}
            continue
        m = re.match(r"bench json:   (.+?) \[checks (all|part|nothing)\]: ([0-9]+) ns per record, .*, ([0-9.]+)x km0's time",
                     line)
        if not m or not stream or m.group(2) == "nothing":
            continue
        way, checks, ns, ratio = m.group(1), m.group(2), int(m.group(3)), m.group(4)
        # The baseline is the bench's own: km0 as the job reads, never its other way.
        library = way if way.startswith("km0 projection, as the job reads") else way.split()[0]
        if library == "km0":
            continue
        best = streams[stream].get((library, checks))
        if best is None or ns < best[1]:
            streams[stream][(library, checks)] = (way, ns, ratio, checks)
    if not streams or any(not ways for ways in streams.values()):
        sys.exit(f"bench: no JSON rows in:\n{out}")
    for stream, ways in streams.items():
        for way, ns, ratio, checks in ways.values():
            row(f"JSON, {stream}: {way} (checks {checks})", str(ns), f"ns/record ({ratio}x km0)", "",
                "cargo bench --workspace --bench json")


def train(work):
    """The training set of the profile-guided build (scripts/build-release.sh runs it with
    the instrumented binary): the kinds of job the throughput cases time (the stock alert
    over tumbling and sliding windows, the panel's ordered panes and sessions), on other
    streams than theirs (other key counts, sizes, event-time
    gaps and late shares), so that the profile says which paths of the code are hot, not
    what the measured inputs hold; a checkpoint and a recovery with each state backend;
    the Kafka path when tansu is installed. Not run, so compiled as rarely run: followed
    inputs and the control API (the memory-per-window case), PostgreSQL sinks, the
    Python and JavaScript plugins' host side."""
    stock = os.path.join(ROOT, "examples/stock-alert/pipeline.toml")
    panel = os.path.join(ROOT, "examples/delivery-panel/pipeline.toml")
    sliding = sliding_pipeline(work)
    for args in [
        [stock, "--events", "300000", "--products", "30", "--markets", "20"],
        [stock, "--events", "400000", "--products", "150", "--markets", "20", "--gap-ms", "8", "--late-fraction", "0.02"],
        [stock, "--events", "300000", "--products", "300", "--markets", "10", "--gap-ms", "30"],
        [sliding, "--events", "300000", "--products", "150", "--markets", "20", "--gap-ms", "8"],
        [panel, "--stream", "delivery", "--events", "300000", "--riders", "100"],
        [panel, "--stream", "delivery", "--events", "300000", "--riders", "2000"],
    ]:
        print(f"train: km0 bench {' '.join(args[1:])}", file=sys.stderr, flush=True)
        run([KM0, "bench", *args, "--repeat", "1"])
    windows(work, products=300, events=300_000)
    kafka(events=200_000, runs=1)


def build_of(binary):
    """What `binary --version` says of its build: "profile-guided", "instrumented" (the
    training's build, never timed) or "plain"."""
    out, _ = run([binary, "--version"])
    if "instrumented" in out:
        sys.exit(f"bench: {binary} is the profile-guided build's instrumented binary: build it again")
    return "profile-guided" if "profile-guided" in out else "plain"


def main():
    if not os.access(KM0, os.X_OK):
        sys.exit(f"bench: build km0 first ({KM0}): scripts/build-release.sh, or cargo build --release -p km0")
    work = tempfile.mkdtemp(prefix="km0-bench.")
    try:
        if "--train" in sys.argv:
            train(work)
            return
        row("km0 binary's build", build_of(KM0), "", "",
            "km0 --version: make bench times the profile-guided one (scripts/build-release.sh; KM0_PGO=0: plain)")
        if not ONLY or "throughput" in ONLY:
            throughput(work)
        if not ONLY or "windows" in ONLY:
            keys, products, events = windows(work)
            memory_per_window(work, keys, products, events)
        if not ONLY or "json" in ONLY:
            json_parsers()
        if not ONLY or "kafka" in ONLY:
            kafka()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    width = [max(len(str(r[i])) for r in ROWS + [("case", "value", "unit", "goal", "how")]) for i in range(4)]
    print(f"| {'case':<{width[0]}} | {'value':>{width[1]}} | {'unit':<{width[2]}} | {'goal':<{width[3]}} |")
    print(f"|{'-' * (width[0] + 2)}|{'-' * (width[1] + 1)}:|{'-' * (width[2] + 2)}|{'-' * (width[3] + 2)}|")
    for case, value, unit, goal, _ in ROWS:
        print(f"| {case:<{width[0]}} | {value:>{width[1]}} | {unit:<{width[2]}} | {goal:<{width[3]}} |")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""A soak of the control API on loopback, bounded in count and time.

A stock-alert job follows a file that grows to 2 M records (200 000 a step), twice:
undisturbed, and while at once 2 000 idle connections, 20 pollers of `/api/v1/job`, 12
uploads of 60 MiB without a token and a deploy (the same plugin: the output stays that of
the undisturbed run) hit its control API. Prints the job's output equality, its peak RSS,
its loop's CPU per record, and the server thread's CPU per answered request.

    KM0_BIN=target/release/km0 python3 scripts/soak-control.py [--records N]
"""
import argparse
import http.client
import os
import pathlib
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOKEN = "soak"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(port, path, token=None, timeout=10):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    c.request("GET", path, headers=headers)
    r = c.getresponse()
    body = r.read()
    c.close()
    return r.status, body


def post(port, path, body=b"", token=TOKEN, timeout=180):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("POST", path, body=body, headers={"Authorization": f"Bearer {token}"})
    r = c.getresponse()
    out = r.read()
    c.close()
    return r.status, out


def read_count(port):
    import json
    try:
        status, body = get(port, "/api/v1/job", TOKEN)
        return json.loads(body)["counters"]["read"] if status == 200 else -1
    except OSError:
        return -1


def thread_cpu(pid, name):
    """CPU seconds of the process's threads called `name`."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        try:
            if (task / "comm").read_text().strip() != name:
                continue
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except OSError:
            pass
    return total


def rss_kib(pid):
    try:
        m = re.search(r"VmRSS:\s+(\d+)", pathlib.Path(f"/proc/{pid}/status").read_text())
        return int(m.group(1)) if m else 0
    except OSError:
        return 0


def run(km0, work, records, attack):
    out = work / ("attacked" if attack else "quiet")
    out.mkdir()
    live = out / "live.jsonl"
    live.write_bytes(b"")
    src = (work / "input.jsonl").read_bytes().splitlines(keepends=True)
    pipeline = out / "job.toml"
    pipeline.write_text(f"""
name = "soak-{'attacked' if attack else 'quiet'}"
key = ["producto", "mercado"]
[source]
kind = "file"
path = "{live}"
[filter]
tipo = "stock.actualizado"
[event_time]
field = "fecha_ms"
watermark_delay = "2m"
[window]
kind = "tumbling"
size = "5m"
[plugin]
path = "{ROOT / 'plugins/dist/min-stock.wasm'}"
[plugin.config]
threshold = 10
[sink]
kind = "file"
path = "{out}/alertas.jsonl"
[late]
path = "{out}/late.jsonl"
[dead_letter]
path = "{out}/dead.jsonl"
[savepoints]
dir = "{out}/savepoints"
[state]
backend = "memory"
""")
    port = free_port()
    job = subprocess.Popen(
        [km0, "run", "--follow", "--quiet", "--http", f"127.0.0.1:{port}", str(pipeline)],
        env={**os.environ, "KM0_TOKEN": TOKEN},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.time() + 30
    while read_count(port) < 0:
        assert time.time() < deadline, "the job did not start"
        time.sleep(0.05)
    stop = threading.Event()
    threads, idle, answered, peak = [], [], [0], [0]
    if attack:
        for _ in range(2000):
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                s.sendall(b"GET /api/v1/job HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                idle.append(s)
            except OSError:
                pass

        def poller():
            while not stop.is_set():
                try:
                    status, _ = get(port, "/api/v1/job")
                    answered[0] += 1
                    if status == 429:
                        time.sleep(0.01)
                except OSError:
                    time.sleep(0.01)

        def upload():
            body = b"x" * (60 << 20)
            try:
                post(port, "/api/v1/deployments", body, token=None, timeout=60)
            except OSError:
                pass

        def deploy():
            time.sleep(1.0)
            status, body = post(port, "/api/v1/deployments", (ROOT / "plugins/dist/min-stock.wasm").read_bytes())
            print(f"  deploy: {status} {body[:160]!r}")

        threads = [threading.Thread(target=poller) for _ in range(20)]
        threads += [threading.Thread(target=upload) for _ in range(12)]
        threads.append(threading.Thread(target=deploy))
        for t in threads:
            t.start()
    t0 = time.time()
    step = 200_000
    for i in range(0, records, step):
        with open(live, "ab") as f:
            f.writelines(src[i : i + step])
        while read_count(port) < min(i + step, records):
            peak[0] = max(peak[0], rss_kib(job.pid))
            assert time.time() - t0 < 300, "the job is stuck"
            time.sleep(0.05)
        peak[0] = max(peak[0], rss_kib(job.pid))
    server_cpu = thread_cpu(job.pid, "km0-control")
    polled = answered[0]
    stop.set()
    for t in threads:
        t.join(timeout=120)
    for s in idle:
        s.close()
    status, _ = post(port, "/api/v1/stop?mode=drain")
    assert status == 200, status
    _, err = job.communicate(timeout=120)
    assert job.returncode == 0, err.decode()
    m = re.search(rb"this run: (\d+) records in ([\d.]+) s wall, ([\d.]+) s CPU", err)
    records_run, cpu = int(m.group(1)), float(m.group(3))
    # The side outputs name their source file: the same name for both runs.
    outputs = [
        (out / f).read_bytes().replace(str(out).encode(), b"JOB")
        for f in ("alertas.jsonl", "late.jsonl", "dead.jsonl")
    ]
    return {
        "outputs": outputs,
        "peak_rss_mib": peak[0] / 1024,
        "loop_ns_per_record": cpu / records_run * 1e9,
        "server_cpu_s": server_cpu,
        "requests": polled,
        "wall_s": time.time() - t0,
    }


def polled(km0, work, pollers):
    """A bounded run over the whole input with `pollers` clients polling the status flat
    out: the job loop's CPU per record, the server thread's CPU and the polls answered."""
    out = work / f"polled-{pollers}-{time.monotonic_ns()}"
    out.mkdir()
    pipeline = out / "job.toml"
    text = (work / "attacked" / "job.toml").read_text()
    text = text.replace(str(work / "attacked" / "live.jsonl"), str(work / "input.jsonl"))
    text = text.replace(str(work / "attacked"), str(out)).replace("soak-attacked", out.name)
    pipeline.write_text(text)
    port = free_port()
    stop = threading.Event()
    answered = [0]

    def poller():
        while not stop.is_set():
            try:
                get(port, "/api/v1/job")
                answered[0] += 1
            except OSError:
                time.sleep(0.001)

    threads = [threading.Thread(target=poller) for _ in range(pollers)]
    for t in threads:
        t.start()
    job = subprocess.Popen(
        [km0, "run", "--quiet", "--http", f"127.0.0.1:{port}", str(pipeline)],
        env={**os.environ, "KM0_TOKEN": TOKEN},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    server_cpu = 0.0
    while job.poll() is None:
        server_cpu = max(server_cpu, thread_cpu(job.pid, "km0-control"))
        time.sleep(0.02)
    _, err = job.communicate()
    stop.set()
    for t in threads:
        t.join()
    m = re.search(rb"this run: (\d+) records in ([\d.]+) s wall, ([\d.]+) s CPU", err)
    assert m, err.decode()
    return float(m.group(3)) / int(m.group(1)) * 1e9, server_cpu, answered[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=2_000_000)
    args = ap.parse_args()
    km0 = os.environ.get("KM0_BIN") or str(
        pathlib.Path(os.environ.get("CARGO_TARGET_DIR", pathlib.Path.home() / ".cache/km0-target")) / "release/km0"
    )
    with tempfile.TemporaryDirectory() as d:
        work = pathlib.Path(d)
        subprocess.run(
            [km0, "generate", "stock", "--events", str(args.records), "--products", "500", "--markets", "20",
             "--late-fraction", "0.01", "--out", str(work / "input.jsonl")],
            check=True,
        )
        quiet = run(km0, work, args.records, attack=False)
        attacked = run(km0, work, args.records, attack=True)
        # Pollers alone, against bounded runs (no idle loop), five rounds interleaved.
        rounds = {0: [], 20: []}
        for _ in range(5):
            for n in (0, 20):
                rounds[n].append(polled(km0, work, n))
    same = quiet["outputs"] == attacked["outputs"]
    print(f"output of the attacked run equals the undisturbed run's: {same}")
    if not same:
        keep = pathlib.Path(tempfile.mkdtemp(prefix="km0-soak-"))
        for name, r in (("quiet", quiet), ("attacked", attacked)):
            for f, data in zip(("alertas.jsonl", "late.jsonl", "dead.jsonl"), r["outputs"]):
                (keep / f"{name}-{f}").write_bytes(data)
        print(f"outputs kept in {keep}")
    for name, r in (("undisturbed", quiet), ("attacked", attacked)):
        print(
            f"{name:12} peak RSS {r['peak_rss_mib']:.0f} MiB, job loop {r['loop_ns_per_record']:.0f} ns CPU/record, "
            f"server thread {r['server_cpu_s']:.2f} s CPU, {r['wall_s']:.1f} s"
        )
    per_request = attacked["server_cpu_s"] / max(attacked["requests"], 1) * 1e6
    print(f"server: {attacked['requests']} polls answered (200 or 429), {per_request:.0f} µs CPU each (all work of the thread counted)")
    print(f"RSS ratio {attacked['peak_rss_mib'] / quiet['peak_rss_mib']:.2f}x, loop CPU ratio "
          f"{attacked['loop_ns_per_record'] / quiet['loop_ns_per_record']:.3f}x")
    best = {n: min(r[0] for r in rs) for n, rs in rounds.items()}
    median = {n: sorted(r[0] for r in rs)[2] for n, rs in rounds.items()}
    polls = sum(r[2] for r in rounds[20])
    server = sum(r[1] for r in rounds[20])
    print(
        f"bounded runs, job loop CPU per record: unpolled best {best[0]:.0f} ns (median {median[0]:.0f}), "
        f"20 pollers best {best[20]:.0f} ns (median {median[20]:.0f}): {best[20] / best[0]:.3f}x best, "
        f"{median[20] / median[0]:.3f}x median"
    )
    print(f"20 pollers: {polls} polls answered in 5 runs, server thread {server / max(polls, 1) * 1e6:.0f} µs CPU per poll")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()

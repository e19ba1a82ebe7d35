#!/usr/bin/env python3
"""Which FUSE requests a workload makes through a stratad sandbox, and how long each kind takes: the
kernel's own `fuse:fuse_request_send` / `fuse:fuse_request_end` tracepoints (Linux 6.15+), matched by
request id, while the workload runs once in bubblewrap on a fresh sandbox (page cache dropped first).

usage: sudo benches/fuseops.py [--mode fuse|file|loop|fanotify] [--image fat:v1] [--warm] [--json]

  --warm   runs the workload once before the traced run (the cached case); otherwise the first run is
           traced (cold: an empty chunk cache, or the image's plan warming beside it if it has one)

Prints per opcode: requests, total and mean time from send to answer (queueing in the kernel included),
and bytes asked for; the sum over all is what the workload waited on FUSE (the requests overlap when the
workload or the kernel's readahead runs them in parallel). Environment: as benches/coldstart.py (BENCH_DATA,
CARGO_TARGET_DIR or STRATAD, WORKLOAD).
"""
import argparse, collections, json, os, re, subprocess, sys, time

import stratad
from stratad import BIN

D = os.environ.get("BENCH_DATA", "/var/tmp/strata-bench")
STORE = f"file://{D}/cs/store"
TRACE = "/sys/kernel/tracing"
WORKLOAD = os.environ.get("WORKLOAD", "python3 -c 'import numpy, pandas'")
LINE = re.compile(r"\s(\d+\.\d+): fuse_request_(send|end): connection \d+ req (\d+)(?: opcode \d+ \((\w+)\) len (\d+))?")


def tracing(on):
    if not os.path.exists(f"{TRACE}/events"):
        subprocess.run(["mount", "-t", "tracefs", "nodev", TRACE], check=True)
    if not os.path.exists(f"{TRACE}/events/fuse/fuse_request_send"):
        sys.exit("this kernel has no fuse tracepoints (Linux 6.15+)")
    for ev in ("fuse_request_send", "fuse_request_end"):
        with open(f"{TRACE}/events/fuse/{ev}/enable", "w") as f:
            f.write("1" if on else "0")
    if on:
        with open(f"{TRACE}/buffer_size_kb", "w") as f:
            f.write("65536")
        open(f"{TRACE}/trace", "w").close()


def breakdown(text):
    sent, ops = {}, collections.defaultdict(lambda: [0, 0.0, 0])
    for m in LINE.finditer(text):
        ts, kind, req = float(m[1]), m[2], m[3]
        if kind == "send":
            sent[req] = (ts, m[4], int(m[5]))
        elif req in sent:
            t0, op, n = sent.pop(req)
            o = ops[op]
            o[0] += 1
            o[1] += ts - t0
            o[2] += n
    return ops


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="fuse")
    ap.add_argument("--image", default="fat:v1")
    ap.add_argument("--warm", action="store_true")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    cmd = ["sh", "-c", WORKLOAD]
    d = stratad.Daemon(STORE, args=("--mount-mode", a.mode))
    try:
        sb = d.mount(a.image, "s")
        root = sb["rootfs"]
        run = ["bwrap", "--bind", root, "/", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", *cmd]
        if a.warm:
            subprocess.run(run, check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["sync"])
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        tracing(True)
        t = time.perf_counter()
        subprocess.run(run, check=True, stdout=subprocess.DEVNULL)
        took = time.perf_counter() - t
        tracing(False)
        ops = breakdown(open(f"{TRACE}/trace").read())
    finally:
        d.stop()
    rows = sorted(ops.items(), key=lambda kv: -kv[1][1])
    if a.json:
        print(json.dumps({"mode": a.mode, "warm": a.warm, "seconds": took,
                          "ops": {k: {"n": n, "seconds": s, "bytes": b} for k, (n, s, b) in rows}}))
        return
    print(f"{a.mode} {'warm' if a.warm else 'cold'}: workload {took:.3f} s")
    print(f"{'opcode':<18}{'requests':>10}{'total ms':>11}{'mean us':>10}")
    for op, (n, s, _) in rows:
        print(f"{op:<18}{n:>10}{s * 1e3:>11.1f}{s / n * 1e6:>10.1f}")
    n, s = sum(o[0] for o in ops.values()), sum(o[1] for o in ops.values())
    print(f"{'all':<18}{n:>10}{s * 1e3:>11.1f}")


if __name__ == "__main__":
    main()

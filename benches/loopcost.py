#!/usr/bin/env python3
"""What stratad's `fanotify` event loop spends on each event of a cold start, and what the importer waits
for a CPU (issue 20), for one or more stratad builds measured in turn.

usage: sudo benches/loopcost.py [--rounds N] [STRATAD ...]

Each round, for each build (in reverse order on odd rounds, so that no build always goes first): a
fresh stratad on the bench store (`coldstart.py prepare`; no plan), the fat image mounted, the page
cache dropped, then the cold `import numpy, pandas` in the sandbox. Per import it reports:

  loop      CPU time of the event loop thread (`fan-events`, its `schedstat`) over the import
  events    events the import caused (`fanotify.hits` + `fanotify.fills`), so loop/event is what the
            loop spends a read; with the loop on the reader's CPU, the reader waits for all of it
  runqueue  the importer's main thread's time runnable but not running (its own `schedstat`)
  import    the import's wall time (noisy on this VM; the two above are not)

With no STRATAD the release build is measured. Medians per build at the end; every import also goes
to benches/results/loopcost-<stamp>.jsonl.
"""
import argparse, json, os, statistics, subprocess, sys, time

import coldstart
from eventcost import threads
from stratad import Daemon, call

SCHEDSTAT = "; print(open('/proc/self/schedstat').read())"


def loop_cpu_ns(server):
    total = 0
    for t in threads(server, "fan-events"):
        try:
            total += int(open(f"/proc/{server}/task/{t}/schedstat").read().split()[0])
        except OSError:
            pass
    return total


def one(binary):
    d = Daemon(coldstart.STORE, binary=binary, quiet=True)
    try:
        server = subprocess.run(["pgrep", "-P", str(d.p.pid)], capture_output=True, text=True).stdout.split()
        server = server[0] if server else str(d.p.pid)
        root = d.mount("fat:v1", "s")["rootfs"]
        coldstart.drop_caches()
        before, fan0 = loop_cpu_ns(server), call(d.sock, "GET", "/v1/status")["fanotify"]
        cmd = coldstart.bwrap(root, ["python3", "-c", "import numpy, pandas" + SCHEDSTAT])
        t = time.perf_counter()
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        wall = time.perf_counter() - t
        fan = call(d.sock, "GET", "/v1/status")["fanotify"]
        events = sum(fan[k] - fan0[k] for k in ("hits", "fills"))
        return {"import": wall, "loop_ms": (loop_cpu_ns(server) - before) / 1e6, "events": events,
                "runqueue_ms": int(out.split()[1]) / 1e6}
    finally:
        d.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("stratad", nargs="*", default=[coldstart.STRATAD])
    a = ap.parse_args()
    got = {b: [] for b in a.stratad}
    results = f"{coldstart.HERE}/results/loopcost-{coldstart.STAMP}.jsonl"
    print(f"results: {results}", flush=True)
    for r in range(a.rounds):
        for b in (a.stratad if r % 2 == 0 else a.stratad[::-1]):
            m = one(b)
            m["loop_us_per_event"] = 1000 * m["loop_ms"] / max(m["events"], 1)
            got[b].append(m)
            with open(results, "a") as f:
                f.write(json.dumps({"round": r, "stratad": b, **m}) + "\n")
            print(f"{b}: import {m['import'] * 1000:.1f} ms, loop {m['loop_ms']:.1f} ms for "
                  f"{m['events']} events ({m['loop_us_per_event']:.1f} µs an event), "
                  f"runqueue {m['runqueue_ms']:.1f} ms", flush=True)
    for b, ms in got.items():
        med = {k: statistics.median(m[k] for m in ms) for k in ms[0]}
        print(f"median {b}: import {med['import'] * 1000:.1f} ms, {med['loop_us_per_event']:.1f} µs an "
              f"event, {med['events']:.0f} events, runqueue {med['runqueue_ms']:.1f} ms")


if __name__ == "__main__":
    if os.geteuid() != 0:
        sys.exit("run as root (mounts, drop_caches)")
    main()

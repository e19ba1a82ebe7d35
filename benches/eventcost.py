#!/usr/bin/env python3
"""What a `fanotify` event allowed at once costs a reader (issue 20): the wake-ups between the reader
and stratad's event loop, measured against the same wake-ups on one CPU.

usage: sudo benches/eventcost.py [--rounds N]

Most events of a cold start are reads of ranges already filled (the fat image's cold numpy + pandas
import: ~1,100 allowed at once against ~70 fills), each a round trip: the read's event wakes the event
loop, the loop's answer wakes the reader. Two measurements, one run:

  pipe      `perf bench sched pipe` (two threads waking each other through pipes) with the threads
            free to run on any CPU, then both on CPU 0: what a wake-up on another CPU costs here
  imports   one fresh stratad on the bench store (`coldstart.py prepare`), with
            `--fanotify-follow-readers false` (the loop placed where the arms say, not following its
            reader: `coldstart.py` measures following against this), the fat image mounted and
            imported once (filling what the import reads); then ROUNDS rounds of: page cache dropped,
            the import run on CPU 0 (`taskset`) with the event loop thread (`fan-events`) free, then
            the same with the event loop pinned to CPU 0 as well, then the import not pinned and
            the loop on CPU 0. Every read of those imports is an event allowed at once; the
            difference between the first two arms is what the events' cross-CPU wake-ups cost.

Prints each round and the medians, and the events per import (`fanotify.hits` in `GET /v1/status`).
"""
import argparse, os, statistics, subprocess, sys, time

import coldstart
from stratad import Daemon, call


def pipe():
    def run(pre):
        out = subprocess.run([*pre, "perf", "bench", "sched", "pipe", "-l", "20000"],
                             check=True, capture_output=True, text=True).stdout
        return float(next(l for l in out.splitlines() if "usecs/op" in l).split()[0])
    return {"free_us": run([]), "one_cpu_us": run(["taskset", "-c", "0"])}


def threads(pid, name):
    out = []
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            if open(f"/proc/{pid}/task/{t}/comm").read().strip() == name:
                out.append(t)
        except OSError:
            pass
    return out


def imports(rounds):
    d = Daemon(coldstart.STORE, env={"STRATA_LOG": "warn"}, args=("--fanotify-follow-readers", "false"))
    try:
        server = subprocess.run(["pgrep", "-P", str(d.p.pid)], capture_output=True, text=True).stdout.split()
        loop = threads(server[0] if server else d.p.pid, "fan-events")
        if not loop:
            raise SystemExit("no fan-events thread: is stratad in fanotify mode?")
        sb = d.mount("fat:v1", "s")
        root = sb["rootfs"]

        def hits():
            return call(d.sock, "GET", "/v1/status")["fanotify"]["hits"]

        def arm(pin_import, pin_loop):
            for t in loop:
                subprocess.run(["taskset", "-p", "-c", "0" if pin_loop else "0-1023", t],
                               check=True, stdout=subprocess.DEVNULL)
            coldstart.drop_caches()
            h = hits()
            pre = ["taskset", "-c", "0"] if pin_import else []
            t = coldstart.timed([*pre, *coldstart.bwrap(root, coldstart.IMPORT)])
            return t, hits() - h

        coldstart.drop_caches()
        coldstart.timed(coldstart.bwrap(root, coldstart.IMPORT))
        arms = {"import on CPU 0, loop free": (True, False), "both on CPU 0": (True, True),
                "import free, loop on CPU 0": (False, True)}
        got = {k: [] for k in arms}
        events = []
        for r in range(rounds):
            for name, (pi, pl) in arms.items():
                t, n = arm(pi, pl)
                got[name].append(t)
                events.append(n)
            print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in got.items()), flush=True)
        return {k: statistics.median(v) for k, v in got.items()}, statistics.median(events)
    finally:
        d.stop()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    a = ap.parse_args()
    p = pipe()
    print(f"pipe round trip: {p['free_us']:.1f} us free, {p['one_cpu_us']:.1f} us on one CPU", flush=True)
    med, events = imports(a.rounds)
    base = med["import on CPU 0, loop free"]
    for k, v in med.items():
        print(f"median {k}: {v:.3f} s ({v / base:.3f})")
    print(f"events per import: {events:.0f}; both on CPU 0 saves {(base - med['both on CPU 0']) / events * 1e6:.0f} us an event")


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""A long cold read in a `fanotify` sandbox: the 1 GiB file of `benches/loopmode.py` (run its `prepare`
first) read in 4 MiB pieces with a pause after each (PAUSE seconds, default 0.02), so that its fills
go on for several seconds and the page dropper's passes write back and drop pages meanwhile. Prints,
for each stratad build given (alternated, reversed every other round), the time spent inside the
reads, the longest read and the disk writes during the read (`pgpgout`), with their medians.

usage: sudo benches/pacedread.py ROUNDS STRATAD [STRATAD...]
"""
import os, sys, time, statistics
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loopmode import STORE, disk_written, drop_caches
from stratad import Daemon
BINS = sys.argv[2:]
ROUNDS = int(sys.argv[1])
PAUSE = float(os.environ.get("PAUSE", "0.02"))

res = {b: [] for b in BINS}
for r in range(ROUNDS):
    for b in (BINS if r % 2 == 0 else BINS[::-1]):
        d = Daemon(STORE, args=("--mount-mode", "fanotify"), binary=b)
        try:
            f = f"{d.mount('big:v1', 's')['rootfs']}/data/big"
            drop_caches()
            w0 = disk_written()
            inside, longest, t0 = 0.0, 0.0, time.perf_counter()
            with open(f, "rb", buffering=0) as fh:
                while True:
                    t = time.perf_counter()
                    n = len(fh.read(4 << 20))
                    dt = time.perf_counter() - t
                    inside += dt; longest = max(longest, dt)
                    if n == 0:
                        break
                    time.sleep(PAUSE)
            wall = time.perf_counter() - t0
            mib = (disk_written() - w0) / 2**20
            res[b].append((inside, longest, mib, wall))
            print(f"{os.path.basename(b)}: inside {inside:.3f} s longest {longest*1e3:.1f} ms written {mib:.0f} MiB wall {wall:.2f} s", flush=True)
        finally:
            d.stop()
for b in BINS:
    v = res[b]
    print(os.path.basename(b), "median inside %.3f s, longest %.1f ms, written %.0f MiB" % (
        statistics.median(x[0] for x in v), statistics.median(x[1] for x in v) * 1e3, statistics.median(x[2] for x in v)))

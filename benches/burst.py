#!/usr/bin/env python3
"""A burst of cold starts on one node: N sandboxes of a never-seen image created at once, each running
the cold import (issue 20; ANCHORS.md, "how they benchmark": N sandboxes created at once, completion
time against a fully cached baseline).

Each run, for each of IMAGES (as in coldstart.py: `fat:v1`, flags after the name go to stratad,
`stratad=PATH` for another binary), in turn:

  cold     a fresh stratad (nothing cached), page cache dropped; N threads each create a sandbox through
           the control socket and run `python3 -c 'import numpy, pandas'` in it with bubblewrap, all
           started together. `strata` is the burst's makespan (start to the last import's end),
           `strata_p50` the median sandbox's own time (its create and import).
  cached   the same daemon after the sandboxes are removed (chunks now on local disk), page cache
           dropped, a second burst of N: `strata_cached`. What a node's next burst of that image costs.

and the peer, kernel EROFS on the local materialized copy: page cache dropped, one mount, then N
threads each mount an overlay (its own upper directory) over it and run the same import; `reference`
is the makespan with the mount, `reference_p50` the median thread's overlay mount and import.

usage: sudo benches/burst.py [--n 8] [--runs 3] [noplan]   (`noplan` drops the fat image's plan first)

Rows go to benches/results/coldstart-<time>.jsonl with coldstart.py's (bench `burst`); a summary per
image at the end. Needs what coldstart.py needs (`coldstart.py prepare` run once).
"""
import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import coldstart as cs  # noqa: E402


def together(n, work):
    """Runs `work(i)` for i in 0..n on n threads released at once: the makespan from the release to
    the last end, and each thread's own seconds. An exception in any thread is raised here."""
    start = threading.Barrier(n + 1)
    own, errors = [0.0] * n, []

    def one(i):
        start.wait()
        t = time.perf_counter()
        try:
            work(i)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
        own[i] = time.perf_counter() - t

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0, own


def strata_burst(d, image, n, prefix):
    """N sandboxes of `image` created and importing at once on daemon `d`: (makespan, own times)."""
    def one(i):
        sb = d.mount(image, f"{prefix}{i}")
        cs.timed(cs.bwrap(sb["rootfs"], cs.IMPORT))
    return together(n, one)


def remove_all(d):
    d.call("POST", "/v1/sandboxes/delete", {"all": True, "purge": True, "force": True})


def kernel_burst(meta, devs, mnt, top, n):
    """The peer: one kernel EROFS mount, then N threads each with its own overlay over it."""
    for i in range(n):
        cs.overlay_dirs(f"{top}/{i}")
    cs.drop_caches()
    t = time.perf_counter()
    cs.mount_erofs(meta, devs, mnt)
    mounted = time.perf_counter() - t
    try:
        def one(i):
            with cs.overlay(mnt, f"{top}/{i}") as root:
                cs.timed(cs.bwrap(root, cs.IMPORT))
        span, own = together(n, one)
        return mounted + span, own
    finally:
        cs.umount(mnt)
        for i in range(n):
            shutil.rmtree(f"{top}/{i}", ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", nargs="*", help="noplan: drop the fat image's plan first")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    if set(a.what) - {"noplan"}:
        ap.error(f"unknown: {' '.join(sorted(set(a.what) - {'noplan'}))}")
    if "noplan" in a.what:
        cs.drop_plan()
    cs.log(f"results: {cs.RESULTS}; {a.n} sandboxes a burst")
    meta, devs = cs.materialized("fat")
    mnt = tempfile.mkdtemp(prefix="strata-burst-erofs-", dir="/var/tmp")
    top = tempfile.mkdtemp(prefix="strata-burst-ov-", dir="/var/tmp")
    rows = []
    try:
        for run in range(a.runs):
            got = []
            for image in cs.IMAGES:
                d = cs.Daemon(cs.STORE, **cs.daemon_opts(image))
                try:
                    busy = cs.wait_quiet()
                    cs.drop_caches()
                    cold, own = strata_burst(d, image.split()[0], a.n, "c")
                    fetched = sum(d.sandbox(f"c{i}")["fetched_bytes"] for i in range(a.n))
                    w = d.waits()
                    remove_all(d)
                    cs.drop_caches()
                    cached, own_cached = strata_burst(d, image.split()[0], a.n, "w")
                    remove_all(d)
                finally:
                    d.stop()
                got.append((image, cold, own, cached, own_cached, fetched, w, busy))
            busy2 = cs.wait_quiet()
            ref, ref_own = kernel_burst(meta, devs, mnt, top, a.n)
            for image, cold, own, cached, own_cached, fetched, w, busy in got:
                rows.append(cs.record("burst", run, image=image, n=a.n, strata=cold,
                                      strata_p50=statistics.median(own), strata_cached=cached,
                                      strata_cached_p50=statistics.median(own_cached), reference=ref,
                                      reference_p50=statistics.median(ref_own), fetched=fetched,
                                      waited=w["led_s"] + w["joined_s"], misses=w["led"], joined=w["joined"],
                                      busy=max(busy, busy2)))
    finally:
        os.rmdir(mnt)
        shutil.rmtree(top, ignore_errors=True)
    cs.summaries("burst", rows, extra=("strata_p50", "strata_cached", "strata_cached_p50", "reference_p50",
                                       "fetched", "waited", "misses", "joined"))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Compaction benchmark: ten successive upgrades of the fat base (benches/make-fat.sh) built with --parent
and tagged base:latest, then `strata gc --compact --grace 0s`: store size before and after against the
live image's unique data (the final tree built alone into an empty store), and the time of the compaction;
then `--min-live 0.8` on the same store (MIN_LIVE="0.5 0.8": the bounds, in order).

An upgrade k rewrites about 8 % of the regular files of at least 16 KiB under usr/ (a byte changed every
64 KiB, so every chunk of the file changes, as a new package version does), deletes about 1 % of them, and
replaces the previous upgrade's downloaded package (var/cache/apt/archives/upgrade-<k>.deb, 20 MB of
random bytes) with its own, as `apt-get upgrade` without `apt-get clean` would. The choice of files is a
function of (path, k): every run makes the same trees.

Run (root, after benches/make-fat.sh):  benches/compact.py
Environment: BENCH_DATA (default /var/tmp/strata-bench), STRATA (default
$CARGO_TARGET_DIR/release/strata). Prints a markdown table and writes it to benches/results/.
"""

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import time

D = os.environ.get("BENCH_DATA", "/var/tmp/strata-bench")
STRATA = os.environ.get(
    "STRATA",
    os.path.join(os.environ.get("CARGO_TARGET_DIR", "/var/tmp/strata-target"), "release/strata"),
)
W = os.path.join(D, "compact")
TREE = os.path.join(W, "tree")
STORE = os.path.join(W, "store")
UPGRADES = int(os.environ.get("UPGRADES", "10"))
MIN_LIVE = os.environ.get("MIN_LIVE", "0.5 0.8").split()


def strata(store, *args):
    env = dict(os.environ, STRATA_INDEX_CACHE=os.path.join(W, "cache"))
    out = subprocess.run(
        [STRATA, "--store", "file://" + store, *args], env=env, check=True, capture_output=True, text=True
    )
    return out.stdout


def store_bytes(store):
    total = 0
    for prefix in ["blobs", "meta", "layers", "manifests", "index", "tags"]:
        for dirpath, _, files in os.walk(os.path.join(store, prefix)):
            total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files)
    return total


def pick(path, k, per_mille):
    h = hashlib.blake2b(f"{path}:{k}".encode(), digest_size=4).digest()
    return int.from_bytes(h, "little") % 1000 < per_mille


def upgrade(k):
    changed = deleted = 0
    for dirpath, _, files in os.walk(os.path.join(TREE, "usr")):
        for f in files:
            p = os.path.join(dirpath, f)
            if os.path.islink(p) or not os.path.isfile(p):
                continue
            size = os.path.getsize(p)
            if size < 16 << 10:
                continue
            if pick(p, k, 10):
                os.unlink(p)
                deleted += 1
            elif pick(p, k, 80):
                with open(p, "r+b") as fh:
                    for off in range(0, size, 64 << 10):
                        fh.seek(off)
                        b = fh.read(1)
                        fh.seek(off)
                        fh.write(bytes([(b[0] + k) % 256]))
                changed += 1
    archives = os.path.join(TREE, "var/cache/apt/archives")
    os.makedirs(archives, exist_ok=True)
    prev = os.path.join(archives, f"upgrade-{k - 1}.deb")
    if os.path.exists(prev):
        os.unlink(prev)
    with open(os.path.join(archives, f"upgrade-{k}.deb"), "wb") as fh:
        fh.write(random.Random(k).randbytes(20 << 20))
    return changed, deleted


def main():
    if not os.path.exists(os.path.join(D, "fat.done")):
        sys.exit(f"missing {D}/fat: run benches/make-fat.sh first")
    shutil.rmtree(W, ignore_errors=True)
    os.makedirs(W)
    subprocess.run(["cp", "-a", "--reflink=auto", os.path.join(D, "fat"), TREE], check=True)
    t = time.time()
    strata(STORE, "build", TREE, "-t", "base:latest")
    for k in range(1, UPGRADES + 1):
        changed, deleted = upgrade(k)
        strata(STORE, "build", TREE, "--parent", "base:latest", "-t", "base:latest", "--force")
        print(f"upgrade {k}: {changed} files changed, {deleted} deleted", file=sys.stderr)
    builds = time.time() - t
    strata(STORE, "gc", "--grace", "0s")
    fresh = os.path.join(W, "fresh")
    strata(fresh, "build", TREE, "-t", "base:latest")
    live = store_bytes(fresh)
    rows = [
        "| upgrades | `--min-live` | store before | after `gc --compact --grace 0s` | live image alone | before / live | after / live | blobs compacted | compaction + gc time | builds |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    # The default bound, then a higher one on the same store.
    for min_live in MIN_LIVE:
        before = store_bytes(STORE)
        t = time.time()
        out = json.loads(strata(STORE, "gc", "--compact", "--min-live", min_live, "--grace", "0s", "--json"))
        seconds = time.time() - t
        after = store_bytes(STORE)
        c = out["compact"]
        rows.append(
            f"| {UPGRADES} | {min_live} | {before / 1e6:.1f} MB | {after / 1e6:.1f} MB | {live / 1e6:.1f} MB | {before / live:.2f}× "
            f"| {after / live:.2f}× | {c['compacted']} of {c['blobs']} ({c['bytes_before'] / 1e6:.1f} → {c['bytes_after'] / 1e6:.1f} MB) "
            f"| {seconds:.1f} s (compaction {c['seconds']:.1f} s) | {builds:.0f} s |"
        )
    text = "\n".join(rows)
    print(text)
    here = os.path.dirname(os.path.abspath(__file__))
    os.makedirs(os.path.join(here, "results"), exist_ok=True)
    with open(os.path.join(here, "results", time.strftime("compact-%Y-%m-%dT%H%MZ.md", time.gmtime())), "w") as fh:
        fh.write(text + "\n")


if __name__ == "__main__":
    main()

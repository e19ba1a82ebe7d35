#!/usr/bin/env python3
"""Markdown table of benches/build.sh's raw figures: the median of each column over the runs.

usage: build-table.py RAW.tsv BENCH_DATA

RAW lines: data set, tool, run, wall s, CPU s, stored bytes, extra columns (see build.sh).
"""
import collections
import os
import statistics
import sys

raw, data = sys.argv[1:3]
runs = collections.OrderedDict()
for line in open(raw):
    f = line.rstrip("\n").split("\t")
    runs.setdefault((f[0], f[1]), []).append([float(x) for x in f[3:]])
med = {k: [statistics.median(c) for c in zip(*v)] for k, v in runs.items()}

CMDS = {
    "strata": "strata --store file://$BENCH_DATA/store-N build DIR --kind base --json",
    "tar-zstd": "tar -cf - -C DIR . | zstd -q -3 -T0 > out.tar.zst",
    "mkfs.erofs": "mkfs.erofs --quiet --chunksize=1048576 --blobdev=erofs.blob erofs.meta DIR",
    "mksquashfs": "mksquashfs DIR out.sqfs -comp zstd -noappend -processors 2 -quiet -no-progress",
    "mksquashfs-l3": "mksquashfs DIR out.sqfs -comp zstd -Xcompression-level 3 -noappend -processors 2 "
    "-quiet -no-progress",
}


def mib(b):
    return f"{b / 1048576:.1f}"


def tree(ds):
    """(bytes of regular files, entries) of a data set."""
    size = entries = 0
    for d, dirs, files in os.walk(os.path.join(data, ds)):
        entries += len(dirs) + len(files)
        for x in files:
            st = os.lstat(os.path.join(d, x))
            if os.path.stat.S_ISREG(st.st_mode):
                size += st.st_size
    return size, entries


def code(s):
    return "`" + s.replace("|", "\\|") + "`"


out = [
    "| data set | tool | wall s | CPU s (user+sys) | stored MiB | wall ÷ tar-zstd (median of per-run ratios) | stored ÷ tar-zstd | command |",
    "|---|---|---:|---:|---:|---:|---:|---|",
]
sizes = {}
for (ds, tool), m in med.items():
    if tool == "strata-rebuild":
        continue
    if ds not in sizes:
        sizes[ds] = tree(ds)
    # Ratios: the median over runs of each run's ratio to the tar-zstd measurement of the same run (taken
    # right before or after it, so under the same load).
    ref = runs.get((ds, "tar-zstd"))
    rt = rb = "—"
    if ref:
        mine = runs[(ds, tool)]
        k = min(len(ref), len(mine))
        rt = f"{statistics.median(mine[i][0] / ref[i][0] for i in range(k)):.2f}×"
        rb = f"{statistics.median(mine[i][2] / ref[i][2] for i in range(k)):.3f}×"
    name = tool
    if tool == "strata":
        if abs(m[3] - m[2]) > 0.02 * m[2]:
            name += f" (stats.stored_bytes: {mib(m[3])} MiB)"
        name += f"; metadata {mib(m[4])} MiB, {int(m[5])} chunks"
    if tool == "mkfs.erofs":
        name += f"; metadata {mib(m[3])} MiB, data uncompressed"
    size, entries = sizes[ds]
    out.append(
        f"| {ds} ({mib(size)} MiB in files, {entries} entries) | {name} | {m[0]:.2f} | {m[1]:.2f} | "
        f"{mib(m[2])} | {rt} | {rb} | {code(CMDS[tool])} |"
    )

k = ("minbase-up", "strata-rebuild")
if k in med:
    m = med[k]
    pkg = open(os.path.join(data, "minbase-up.pkg")).read().split()
    out += [
        "",
        "| rebuild | wall s | CPU s | stored (stats.stored_bytes) | added to the store (du) | new chunks (bytes) "
        "| bytes that changed | stored ÷ changed | command |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
        f"| minbase-up (minbase + `{pkg[0]}` {pkg[1]} → {pkg[2]}), `--parent` minbase | {m[0]:.2f} | "
        f"{m[1]:.2f} | {int(m[2])} B | {int(m[3])} B | {int(m[4])} ({int(m[5])} B) | {int(m[6])} B | "
        f"{m[2] / m[6]:.2f}× | "
        + code("strata --store file://$BENCH_DATA/store-N build minbase-up --kind base "
               "--parent <minbase layer digest> --json")
        + " |",
    ]
out += ["", f"Medians of {max(len(v) for v in runs.values())} runs, page cache dropped before each; "
        f"raw figures: `{raw}`."]
print("\n".join(out))

#!/usr/bin/env python3
"""Where strata's stored bytes go, against one zstd stream: a model of the builder's data layout.

usage: compress-model.py DIR [LEVEL]     (needs the `zstandard` module: pip install zstandard)

Walks DIR as strata's directory source does (children sorted bytewise, hard links once), and lays file
data out as builder/src/build.rs does: files up to INLINE bytes go into the metadata, files under
GROUP_FILE_MAX are packed with their neighbours into frames of GROUP_TARGET bytes, larger files are cut
into CHUNK-byte chunks, each its own frame; equal chunks and all-zero chunks are stored once / not at all.
Every frame is compressed on its own at LEVEL (default 3). Prints the compressed bytes of each part and
of variants (bigger groups, bigger chunks, one stream of all the data in the same order), so a change of
the layout can be judged before it is coded.
"""
import hashlib
import os
import stat
import sys

import zstandard

root = sys.argv[1]
level = int(sys.argv[2]) if len(sys.argv) > 2 else 3
INLINE, GROUP_FILE_MAX = 2048, 64 << 10


def walk(path):
    seen = set()
    stack = [path]
    while stack:
        d = stack.pop()
        names = sorted(os.listdir(d), key=os.fsencode)
        subdirs = []
        for n in names:
            p = os.path.join(d, n)
            st = os.lstat(p)
            if stat.S_ISDIR(st.st_mode):
                subdirs.append(p)
            elif stat.S_ISREG(st.st_mode):
                if st.st_nlink > 1:
                    if (st.st_dev, st.st_ino) in seen:
                        continue
                    seen.add((st.st_dev, st.st_ino))
                yield p, st.st_size
        # depth first, children in name order (the walk interleaves files and dirs; close enough)
        stack.extend(reversed(subdirs))


files = list(walk(root))


def layout(chunk, group_target, group_max=GROUP_FILE_MAX):
    """Frames (lists of byte strings) and inline bytes."""
    frames, group, gbytes, inline, seen = [], [], 0, [], set()

    def new(b):
        if not b.strip(b"\0"):
            return False
        h = hashlib.blake2b(b, digest_size=16).digest()
        if h in seen:
            return False
        seen.add(h)
        return True

    for p, size in files:
        if size <= INLINE:
            inline.append(open(p, "rb").read())
            continue
        if size < group_max:
            b = open(p, "rb").read()
            if new(b):
                group.append(b)
                gbytes += len(b)
            if gbytes >= group_target:
                frames.append(group)
                group, gbytes = [], 0
            continue
        with open(p, "rb") as f:
            while True:
                b = f.read(chunk)
                if not b:
                    break
                if new(b):
                    frames.append([b])
    if group:
        frames.append(group)
    return frames, inline


cctx = zstandard.ZstdCompressor(level=level)


def compressed(frames):
    return sum(len(cctx.compress(b"".join(f))) for f in frames)


def stream(frames):
    c = zstandard.ZstdCompressor(level=level, threads=-1).compressobj()
    n = 0
    for f in frames:
        for b in f:
            n += len(c.compress(b))
    return n + len(c.flush())


MiB = 1 << 20
rows = []
base, inline = layout(1 * MiB, 128 << 10)
raw = sum(len(b) for f in base for b in f)
rows.append(("strata today: 1 MiB chunks, small files in 128 KiB groups", compressed(base), len(base)))
rows.append(("  the same data as one zstd stream (no frames)", stream(base), 1))
for chunk, group, gmax, name in [
    (1 * MiB, 1 * MiB, GROUP_FILE_MAX, "1 MiB chunks, small files in 1 MiB groups"),
    (1 * MiB, 1 * MiB, 1 * MiB, "1 MiB chunks, files < 1 MiB grouped into 1 MiB frames"),
    (4 * MiB, 128 << 10, GROUP_FILE_MAX, "4 MiB chunks, small files in 128 KiB groups"),
    (4 * MiB, 1 * MiB, GROUP_FILE_MAX, "4 MiB chunks, small files in 1 MiB groups"),
]:
    f, _ = layout(chunk, group, gmax)
    rows.append((name, compressed(f), len(f)))
print(f"{root}: {len(files)} files; {raw} bytes of non-inline, distinct, non-zero data; "
      f"{sum(map(len, inline))} bytes inline in {len(inline)} files (compressed with the metadata: "
      f"{len(cctx.compress(b''.join(inline)))} bytes); zstd level {level}")
print("| layout | compressed bytes | frames | ÷ one stream |")
print("|---|---:|---:|---:|")
ref = rows[1][1]
for name, n, k in rows:
    print(f"| {name} | {n} | {k} | {n / ref:.3f} |")

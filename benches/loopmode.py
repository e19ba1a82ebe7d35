#!/usr/bin/env python3
"""`file` against `loop`, `fuse` and `fanotify` mount modes (and loop devices with and without direct I/O) and kernel EROFS on a
local materialized copy (the peer), same data, same run,
alternating the setups in every round:

  seq    a 1 GiB file (half compressible) in a sandbox: the first read (chunks fetched from the file://
         store), then a warm read (chunks in stratad's cache, page cache dropped) — MB/s of each, and how
         much the page cache (`Cached` in /proc/meminfo) grew over the warm read, right after it and
         1 s later (settled), and how much the warm read read from the disk (`pgpgin`)
  find   `find ROOT | wc -l` on a fresh daemon's sandbox of a tree of 20,000 small files, page cache
         dropped (metadata only: every lookup and readdir from the layer's local metadata)

usage: sudo benches/loopmode.py prepare | run ROUNDS
SETUPS=file,fanotify,kernel measures only those setups (default: all); a setup MODE@PATH runs that mode
from the stratad at PATH (e.g. SETUPS=fanotify@/tmp/stratad-old,fanotify compares two builds).
Data in $BENCH_DATA (default /var/tmp/strata-bench-loop); release binaries from $CARGO_TARGET_DIR (or
$STRATA and $STRATAD).
"""
import os, statistics, subprocess, sys, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stratad  # noqa: E402

stratad.BIN["strata"] = os.environ.get("STRATA", stratad.BIN["strata"])

D = os.environ.get("BENCH_DATA", "/var/tmp/strata-bench-loop")
STORE = f"file://{D}/store"
SETUPS = {
    "file": ["--mount-mode", "file"],
    "loop-dio": ["--mount-mode", "loop"],
    "loop-buffered": ["--mount-mode", "loop", "--loop-direct-io", "false"],
    "fuse": ["--mount-mode", "fuse"],
    "fanotify": ["--mount-mode", "fanotify"],
    # The peer: kernel EROFS on loop devices of a materialized copy (`strata materialize`), all local.
    "kernel": None,
}


class Kernel:
    """Kernel EROFS mounted from a local materialized copy of an image's one layer (no stratad)."""

    def __init__(self):
        self.loops, self.mnts = [], []

    def losetup(self, path):
        dev = subprocess.run(["losetup", "-f", "--show", "-r", path], check=True, capture_output=True,
                             text=True).stdout.strip()
        self.loops.append(dev)
        return dev

    def mount(self, image, sid):
        mat = f"{D}/mat-{image.replace(':', '-')}"
        if not os.path.exists(f"{mat}/meta.erofs"):
            strata("materialize", image, mat)
        devs = sorted(os.listdir(f"{mat}/devices"), key=int)
        opts = ",".join(["ro"] + [f"device={self.losetup(f'{mat}/devices/{n}')}" for n in devs])
        target = f"{D}/kmnt-{sid}"
        os.makedirs(target, exist_ok=True)
        subprocess.run(["mount", "-t", "erofs", "-o", opts, self.losetup(f"{mat}/meta.erofs"), target],
                       check=True)
        self.mnts.append(target)
        return {"rootfs": target}

    def call(self, *_):
        return {"mount_mode": None}

    def stop(self):
        for m in self.mnts:
            subprocess.run(["umount", m], check=False)
        for dev in self.loops:
            subprocess.run(["losetup", "-d", dev], check=False)


def strata(*args):
    subprocess.run([stratad.BIN["strata"], "--store", STORE, *args], check=True, capture_output=True)


def prepare():
    os.makedirs(f"{D}/big/data", exist_ok=True)
    with open(f"{D}/big/data/big", "wb") as f:
        for i in range(1024):
            block = os.urandom(512 << 10)
            f.write(block + block)  # half compressible
    strata("build", f"{D}/big", "-t", "big:v1")
    for i in range(200):
        d = f"{D}/tree/d{i:03}"
        os.makedirs(d, exist_ok=True)
        for j in range(100):
            with open(f"{d}/f{j:03}", "w") as f:
                f.write(f"{i} {j}\n")
    strata("build", f"{D}/tree", "-t", "tree:v1")


def drop_caches():
    subprocess.run(["sync"], check=True)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")


def cached():
    for line in open("/proc/meminfo"):
        if line.startswith("Cached:"):
            return int(line.split()[1]) << 10


def disk_read():
    """Bytes read from block devices so far (`pgpgin` in /proc/vmstat counts KiB)."""
    return paged("pgpgin")


def disk_written():
    """Bytes written to block devices so far (`pgpgout`, KiB)."""
    return paged("pgpgout")


def paged(key):
    for line in open("/proc/vmstat"):
        if line.startswith(key + " "):
            return int(line.split()[1]) << 10
    return 0


def timed(argv, shell=False):
    t = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True, shell=shell)
    return time.perf_counter() - t


def seq(d):
    f = f"{d.mount('big:v1', 's')['rootfs']}/data/big"
    size = os.path.getsize(f)
    drop_caches()
    first = timed(["dd", f"if={f}", "of=/dev/null", "bs=1M"])
    drop_caches()
    before, disk = cached(), disk_read()
    warm = timed(["dd", f"if={f}", "of=/dev/null", "bs=1M"])
    grew, disk = cached() - before, disk_read() - disk
    # `fanotify` mode drops its view files' pages a few hundred ms after the kernel read them.
    time.sleep(1.0)
    settled = cached() - before
    return {"first_mbs": size / first / 1e6, "warm_mbs": size / warm / 1e6, "cached_gib": grew / (1 << 30),
            "settled_gib": settled / (1 << 30), "disk_gib": disk / (1 << 30)}


def find(d):
    root = d.mount("tree:v1", "s")["rootfs"]
    drop_caches()
    return {"find_s": timed(f"find {root} | wc -l", shell=True)}


def main():
    if sys.argv[1:2] == ["prepare"]:
        return prepare()
    if len(sys.argv) != 3 or sys.argv[1] != "run":
        sys.exit(__doc__)
    only = [n for n in os.environ.get("SETUPS", "").split(",") if n]
    binaries = {}
    for n in [n for n in only if "@" in n]:
        # MODE@STRATAD: that mode from another stratad binary (an A/B of two builds in one run).
        mode, binaries[n] = n.split("@", 1)
        SETUPS[n] = ["--mount-mode", mode]
    for n in [n for n in SETUPS if only and n not in only]:
        del SETUPS[n]
    res = {name: {} for name in SETUPS}
    for r in range(int(sys.argv[2])):
        order = list(SETUPS) if r % 2 == 0 else list(SETUPS)[::-1]
        for name in order:
            for bench in (seq, find):
                args = SETUPS[name]
                d = Kernel() if args is None else stratad.Daemon(STORE, args=args, quiet=True,
                                                                 binary=binaries.get(name))
                try:
                    assert args is None or d.call("GET", "/v1/status")["mount_mode"] == args[1]
                    got = bench(d)
                finally:
                    d.stop()
                for k, v in got.items():
                    res[name].setdefault(k, []).append(v)
                print(r, name, {k: round(v, 3) for k, v in got.items()}, flush=True)
    for name, m in res.items():
        print(name, {k: f"median {statistics.median(v):.3f} of {len(v)}" for k, v in m.items()})


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""`strata mount` from a shell loop, one process per sandbox, for two CLI builds in one run (issue 20,
item 6): one stratad, then ROUNDS rounds, each timing a bash `for` loop of N sequential `strata mount`
processes with each build and N creations through the control socket (from this script), in turn, so that the builds see the same daemon, disk
and state (a create's fsync and ext4's inode allocation vary several-fold from round to round here, so
only same-round ratios mean much).

usage: sudo benches/clirate.py OLD_DIR NEW_DIR [--n 200] [--rounds 4] [--on-root] [--pool N]

--pool N starts the daemon with `--sandbox-pool N` (sandboxes made ahead; compare with a run without).

The daemon's state lives on a fresh ext4 file system (a 4 GiB sparse image on a loop device, made for
the run, with ext4's defaults: a journal) unless --on-root, which keeps it in /var/tmp: this machine's
root file system is ext4 without a journal, where inode allocation skips every inode freed in the last
60-360 s, so a create's cost there depends on every deletion of the last minutes, the benchmark's own
and any other program's (2x-5x from run to run).

OLD_DIR and NEW_DIR each hold a lean `strata` and its `strata-full` (a copy or a link). Prints each
round's rates and the medians.
"""
import argparse, os, shutil, statistics, subprocess, sys, tempfile, time

from stratad import Daemon, BIN


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--on-root", action="store_true")
    ap.add_argument("--pool", type=int, default=0)
    a = ap.parse_args()
    top = tempfile.mkdtemp(prefix="strata-clirate-", dir="/var/tmp")
    work = top
    if not a.on_root:
        work = f"{top}/mnt"
        os.makedirs(work)
        subprocess.run(["truncate", "-s", "4G", f"{top}/disk.img"], check=True)
        subprocess.run(["mkfs.ext4", "-q", f"{top}/disk.img"], check=True)
        subprocess.run(["mount", "-o", "loop", f"{top}/disk.img", work], check=True)
    try:
        run(a, work)
    finally:
        if not a.on_root:
            subprocess.run(["umount", work], stderr=subprocess.DEVNULL)  # stop() detached it
        shutil.rmtree(top, ignore_errors=True)


def run(a, work):
    store = f"file://{work}/store"
    root = f"{work}/rootfs"
    os.makedirs(f"{root}/bin")
    shutil.copy("/bin/busybox", f"{root}/bin/busybox")
    subprocess.run([BIN["strata"], "--store", store, "build", root, "-t", "density:v1"], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    d = Daemon(store, work=work, quiet=True, args=("--sandbox-pool", str(a.pool)) if a.pool else ())
    rates = {"old": [], "new": [], "socket": []}
    try:
        phases = [("old", a.old), ("new", a.new), ("socket", None)]
        made = []
        for r in range(a.rounds):
            # Each round starts with another phase, and nothing is deleted until the end: on this
            # machine's root file system (ext4 without a journal) inode allocation skips inodes freed in
            # the last 60-360 s, so creations right after deletions are several times slower, and
            # whichever phase follows the most deletions would lose.
            for name, path in phases[r % 3:] + phases[:r % 3]:
                ids = [f"{name}{r}-{i}" for i in range(a.n)]
                t = time.time()
                if path is None:
                    for sid in ids:
                        d.call("POST", "/v1/sandboxes", {"image": "density:v1", "id": sid})
                else:
                    loop = (f'for i in $(seq 0 {a.n - 1}); do "$0" --socket "$1" mount density:v1 '
                            f'--sandbox {name}{r}-$i >/dev/null || exit 1; done')
                    subprocess.run(["bash", "-c", loop, f"{path}/strata", d.sock], check=True)
                rates[name].append(a.n / (time.time() - t))
                made += ids
            print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.0f}/s" for k, v in rates.items()), flush=True)
        d.call("POST", "/v1/sandboxes/delete", {"ids": made, "purge": True})
    finally:
        d.stop()
    print(" | ".join(f"{k} median {statistics.median(v):.0f}/s" for k, v in rates.items()))


if __name__ == "__main__":
    sys.exit(main())

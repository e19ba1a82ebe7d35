#!/usr/bin/env python3
"""`strata mount` from a shell loop, one process per sandbox, for two CLI builds in one run (issue 20,
item 6): one stratad, then ROUNDS rounds, each timing N sequential `strata mount` processes with each
build in turn and N creations through the control socket, so that the builds see the same daemon, disk
and state (a create's fsync and ext4's inode allocation vary several-fold from round to round here, so
only same-round ratios mean much).

usage: sudo benches/clirate.py OLD_DIR NEW_DIR [--n 200] [--rounds 4]

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
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="strata-clirate-", dir="/var/tmp")
    store = f"file://{work}/store"
    root = f"{work}/rootfs"
    os.makedirs(f"{root}/bin")
    shutil.copy("/bin/busybox", f"{root}/bin/busybox")
    subprocess.run([BIN["strata"], "--store", store, "build", root, "-t", "density:v1"], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    d = Daemon(store, work=work, quiet=True)
    rates = {"old": [], "new": [], "socket": []}
    try:
        d.call("POST", "/v1/sandboxes", {"image": "density:v1", "id": "keep"})
        for r in range(a.rounds):
            for name, path in (("old", a.old), ("new", a.new)):
                cli = [f"{path}/strata", "--socket", d.sock, "mount", "density:v1", "--sandbox"]
                t = time.time()
                for i in range(a.n):
                    subprocess.run(cli + [f"{name}{r}-{i}"], check=True, stdout=subprocess.DEVNULL)
                rates[name].append(a.n / (time.time() - t))
                for i in range(a.n):
                    d.call("DELETE", f"/v1/sandboxes/{name}{r}-{i}?purge=1")
            t = time.time()
            for i in range(a.n):
                d.call("POST", "/v1/sandboxes", {"image": "density:v1", "id": f"s{r}-{i}"})
            rates["socket"].append(a.n / (time.time() - t))
            for i in range(a.n):
                d.call("DELETE", f"/v1/sandboxes/s{r}-{i}?purge=1")
            print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.0f}/s" for k, v in rates.items()), flush=True)
    finally:
        d.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(" | ".join(f"{k} median {statistics.median(v):.0f}/s" for k, v in rates.items()))


if __name__ == "__main__":
    sys.exit(main())

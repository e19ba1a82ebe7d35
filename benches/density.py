#!/usr/bin/env python3
"""Density benchmark: sandboxes created through stratad as fast as they can be asked for — through the
control socket and through the CLI (`strata mount`, a process per sandbox), in the same run — against bare
overlay mounts of the same layer; then N sandboxes held at once (RSS of stratad's server and of its
descriptor holder, and kernel slab memory per sandbox). The CLI's floor, a process started and waited for
(`/bin/true`), is measured alongside.

usage: sudo benches/density.py [--create 1000] [--hold 10000] [--dir /var/tmp] [--mount-mode MODE]...

With --mount-mode (repeatable: file, loop, fuse), only the creation rate through the control socket is
measured, for each mode in turn on a fresh daemon (the first sandbox, which mounts the layer, timed apart).
Needs the release build ($CARGO_TARGET_DIR/release/{strata,stratad}) and busybox-static.
"""
import argparse, os, shutil, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stratad import BIN, Daemon  # noqa: E402


def meminfo(key):
    for line in open("/proc/meminfo"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def rss(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def per_mode(store, work, a):
    """Sandbox creation rate through the control socket in each mount mode, alternating the modes over
    three rounds; the first sandbox of each daemon (which mounts the layer) is timed on its own."""
    rates = {m: [] for m in a.mount_mode}
    first = {m: [] for m in a.mount_mode}
    for _ in range(3):
        for mode in a.mount_mode:
            d = Daemon(store, work=f"{work}/{mode}", quiet=True, args=("--mount-mode", mode))
            try:
                t = time.time()
                d.call("POST", "/v1/sandboxes", {"image": "density:v1", "id": "first"})
                first[mode].append(time.time() - t)
                t = time.time()
                for i in range(a.create):
                    d.call("POST", "/v1/sandboxes", {"image": "density:v1", "id": f"c{i}"})
                rates[mode].append(a.create / (time.time() - t))
            finally:
                d.stop()
    for mode in a.mount_mode:
        print(f"| {mode}: sandboxes created through stratad (median of 3 x {a.create}) | "
              f"{sorted(rates[mode])[1]:.0f}/s (first sandbox, layer mounted: "
              f"{sorted(first[mode])[1] * 1000:.0f} ms) |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--create", type=int, default=1000)
    ap.add_argument("--hold", type=int, default=10000)
    ap.add_argument("--dir", default="/var/tmp", help="where the store, state and sandboxes go (a disk filesystem)")
    ap.add_argument("--mount-mode", action="append", default=[], help="measure creation in these modes only")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="strata-density-", dir=a.dir)
    store = f"file://{work}/store"
    root = f"{work}/rootfs"
    os.makedirs(f"{root}/bin")
    shutil.copy("/bin/busybox", f"{root}/bin/busybox")
    subprocess.run([BIN["strata"], "--store", store, "build", root, "-t", "density:v1"], check=True,
                   stdout=subprocess.DEVNULL)
    if a.mount_mode:
        try:
            return per_mode(store, work, a)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    d = Daemon(store, work=work, quiet=True)
    call = d.call
    try:
        rows = []
        # One sandbox held throughout keeps the layer mounted for the bare-overlay comparison.
        call("POST", "/v1/sandboxes", {"image": "density:v1", "id": "keep"})
        # Through the daemon.
        t = time.time()
        for i in range(a.create):
            call("POST", "/v1/sandboxes", {"image": "density:v1", "id": f"c{i}"})
        dt = time.time() - t
        rows.append(("stratad: create sandbox (overlay + upper dir), sequential", a.create / dt))
        layer = call("GET", "/v1/status")["layers"][0]["path"]
        for i in range(a.create):
            call("DELETE", f"/v1/sandboxes/c{i}")
        # Through the CLI: one `strata mount` process per sandbox, as a node agent shelling out would.
        cli = [BIN["strata"], "--socket", d.sock, "mount", "density:v1", "--sandbox"]
        t = time.time()
        for i in range(a.create):
            subprocess.run(cli + [f"k{i}"], check=True, stdout=subprocess.DEVNULL)
        dt_cli = time.time() - t
        rows.append(("strata mount (a process per sandbox), sequential", a.create / dt_cli))
        for i in range(a.create):
            call("DELETE", f"/v1/sandboxes/k{i}")
        # A burst through the CLI: 100 sandboxes per `strata mount` call.
        t = time.time()
        for b in range(0, a.create, 100):
            ids = [x for i in range(b, min(b + 100, a.create)) for x in ("--sandbox", f"b{i}")]
            subprocess.run(cli[:-1] + ids, check=True, stdout=subprocess.DEVNULL)
        rows.append(("strata mount, 100 sandboxes per call", a.create / (time.time() - t)))
        for i in range(a.create):
            call("DELETE", f"/v1/sandboxes/b{i}")
        t = time.time()
        for i in range(a.create):
            subprocess.run(["/bin/true"], check=True)
        rows.append(("/bin/true (a process started and waited for)", a.create / (time.time() - t)))
        # Bare overlay mounts of the same layer, same run.
        base = f"{work}/bare"
        t = time.time()
        for i in range(a.create):
            for sub in ("u", "w", "m"):
                os.makedirs(f"{base}/{i}/{sub}")
            subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                            f"lowerdir={layer},upperdir={base}/{i}/u,workdir={base}/{i}/w", f"{base}/{i}/m"],
                           check=True)
        dt_bare = time.time() - t
        rows.append(("bare `mount -t overlay` (one process per mount), sequential", a.create / dt_bare))
        for i in range(a.create):
            subprocess.run(["umount", "-l", f"{base}/{i}/m"], check=True)
        # Hold many.
        # stratad is two processes: the server (answers FUSE and the API) and the descriptor holder.
        server = d.server_pid
        slab0, rss0, hrss0 = meminfo("Slab"), rss(server), rss(d.pid)
        t = time.time()
        for i in range(a.hold):
            call("POST", "/v1/sandboxes", {"image": "density:v1", "id": f"h{i}"})
        dt_hold = time.time() - t
        slab1, rss1, hrss1 = meminfo("Slab"), rss(server), rss(d.pid)
        print(f"| sandboxes created through stratad | {rows[0][1]:.0f}/s |")
        print(f"| sandboxes created through the CLI (strata mount) | {rows[1][1]:.0f}/s "
              f"({rows[0][1] / rows[1][1]:.2f}x the socket's time per sandbox) |")
        print(f"| sandboxes created through the CLI, 100 per `strata mount` | {rows[2][1]:.0f}/s "
              f"({rows[0][1] / rows[2][1]:.2f}x) |")
        print(f"| processes started and waited for (/bin/true), the CLI's floor | {rows[3][1]:.0f}/s |")
        print(f"| bare overlay mounts (mount(8) per mount) | {rows[4][1]:.0f}/s |")
        print(f"| {a.hold} sandboxes held: creation | {a.hold / dt_hold:.0f}/s |")
        print(f"| {a.hold} sandboxes held: stratad server RSS | {rss1 / 2**20:.1f} MiB (was {rss0 / 2**20:.1f} MiB) |")
        print(f"| {a.hold} sandboxes held: stratad holder RSS | {hrss1 / 2**20:.1f} MiB (was {hrss0 / 2**20:.1f} MiB) |")
        print(f"| {a.hold} sandboxes held: kernel slab per sandbox | {(slab1 - slab0) / a.hold / 1024:.1f} KiB |")
    finally:
        d.stop()


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Cold start inside Debian 12's stock 6.1 kernel (issue 18, "inside the 6.1 guest"): the fat image's
`python3 -c 'import numpy, pandas'` through stratad's `loop` and `fuse` mount modes against kernel EROFS
on a local materialized copy of the same layer, all in the same guest: Debian 12's own cloud kernel
(`linux-image-cloud-amd64`, the stock-kernel test tier's guest: scripts/vm-guest with
tests/stock-kernel/init, FUSE and loop modules) booted in QEMU's microvm (TCG by default, as here KVM does
not boot guests), 3 GiB of memory, 2 vCPUs.

usage: sudo benches/stock-guest.py [--rounds N] [--deadline S] [--accel tcg|kvm] [--keep]

The host prepares $BENCH_DATA/stock-guest/: the guest kernel and initramfs (guest/, kept; packages cached
in /var/tmp/strata-tests/vm-guest-cache), a data tree (data/: stratad, strata and bubblewrap with debug
info stripped, the shared libraries they load, hard links — `cp -al`, never copies — of the fat image's
file:// store $BENCH_DATA/cs/store and of its materialized copy $BENCH_DATA/cs/fat-mat, as
benches/coldstart.py prepares them, and benches/stock-guest.sh as run.sh), then a sparse ext4 image of it
(data.img: used space × 1.5 + 2 GiB for the state directories and chunk caches). The guest runs
benches/stock-guest.sh: for N rounds (default 2), every arm once per round in a rotated order —
  loop    a fresh stratad (empty state directory on the ext4 drive, --no-prefetch: no plan warmed) in
          `loop` mode on the file:// store on the drive, `strata mount fat:v1`, page cache dropped, the
          import in the sandbox rootfs with bubblewrap (chroot when bubblewrap cannot run the image's
          python in the guest: the `runner` line says which)
  fuse    the same with `--mount-mode fuse`
  kernel  the materialized copy on read-only loop devices, `mount -t erofs -o device=...` (6.1 has no
          file-backed EROFS mounts), page cache dropped, the same import (read-only bind)
and prints one console line per run (`strata-61: bench arm=loop round=1 mount_s=.. import_s=..`, times
from the guest's /proc/uptime in centiseconds; the host also times each import from the arrival of its
`start` and `end` console lines: host_import_s). The fat image has no prefetch plan in that store, so
there is no "with plan" arm. The drive's backing file goes through the host's page cache (cache=unsafe),
alike for every arm.

Prints a table of medians (import, mount, mount + import per arm; "cache MB": the size of stratad's
chunk cache after the import, what it fetched from the store, metadata included) and the ratios
loop/kernel, fuse/kernel and fuse/loop (of the medians, and per round), and appends JSON lines (one per
run, one summary) to benches/results/stock-guest-<stamp>.jsonl; the console goes to
$BENCH_DATA/stock-guest/console.log. The ext4 image and data tree are removed at the end (unless
--keep); QEMU is killed (by its PID) when the guest has not finished within the deadline (default 900 s
+ 600 s per round). Environment: BENCH_DATA (/var/tmp/strata-bench), BIN_DIR (the release strata and
stratad; default $CARGO_TARGET_DIR/release, CARGO_TARGET_DIR default /var/tmp/strata-target), BWRAP
(/usr/bin/bwrap), IMAGE (fat:v1), STRATA_VM_ACCEL (--accel's default, tcg).
"""
import argparse, json, os, queue, re, shutil, statistics, subprocess, sys, threading, time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
D = os.environ.get("BENCH_DATA", "/var/tmp/strata-bench")
WORK = f"{D}/stock-guest"
CS = f"{D}/cs"
TARGET = os.environ.get("CARGO_TARGET_DIR", "/var/tmp/strata-target")
BIN_DIR = os.environ.get("BIN_DIR", f"{TARGET}/release")
BWRAP = os.environ.get("BWRAP", "/usr/bin/bwrap")
IMAGE = os.environ.get("IMAGE", "fat:v1")
ARMS = ["loop", "fuse", "kernel"]
STAMP = time.strftime("%Y-%m-%dT%H%MZ", time.gmtime())
RESULTS = f"{HERE}/results/stock-guest-{STAMP}.jsonl"
GUEST_CACHE = "/var/tmp/strata-tests/vm-guest-cache"


def log(*a):
    print("[stock-guest]", *a, file=sys.stderr, flush=True)


def run(argv, **kw):
    return subprocess.run(argv, check=True, capture_output=True, text=True, **kw).stdout


# ---------------------------------------------------------------- preparation

def guest():
    """The stock kernel and the stock-kernel tier's initramfs (built once, kept)."""
    out = f"{WORK}/guest"
    run([f"{REPO}/scripts/vm-guest", "--out", out, "--cache", GUEST_CACHE, "--init",
         f"{REPO}/tests/stock-kernel/init", "--module", "fs/fuse/fuse", "--module", "drivers/block/loop"])
    return f"{out}/vmlinuz", f"{out}/initrd.img", open(f"{out}/kernel-version").read().strip()


def install_binary(src, bindir, name, libdir):
    """`src` without its debug info as bindir/name; the shared libraries it loads (its loader too) in
    libdir (tests/tests/stock_kernel.rs's install_binary)."""
    run(["objcopy", "--strip-debug", src, f"{bindir}/{name}"])
    for line in run(["ldd", src]).splitlines():
        right = line.split("=>", 1)[1] if "=>" in line else line
        words = right.split()
        if words and words[0].startswith("/"):
            shutil.copy(words[0], f"{libdir}/{os.path.basename(words[0])}")


def data_tree(data, rounds):
    shutil.rmtree(data, ignore_errors=True)
    os.makedirs(f"{data}/bin")
    os.makedirs(f"{data}/lib")
    for name in ("stratad", "strata"):
        install_binary(f"{BIN_DIR}/{name}", f"{data}/bin", name, f"{data}/lib")
    install_binary(BWRAP, f"{data}/bin", "bwrap", f"{data}/lib")
    if not os.path.exists(f"{CS}/fat-mat/meta.erofs") or not os.path.isdir(f"{CS}/store"):
        sys.exit(f"stock-guest: no {CS}/store or {CS}/fat-mat: run benches/coldstart.py prepare first")
    # Hard links: the store is 820 MB and the materialized copy 1.1 GB, and the disk is small.
    run(["cp", "-al", f"{CS}/store", f"{data}/store"])
    run(["cp", "-al", f"{CS}/fat-mat", f"{data}/fat-mat"])
    shutil.copy(f"{HERE}/stock-guest.sh", f"{data}/run.sh")
    with open(f"{data}/bench.conf", "w") as f:
        f.write(f"ROUNDS={rounds}\nIMAGE={IMAGE}\nARMS='{' '.join(ARMS)}'\n")


def used_bytes(root):
    seen, total = set(), 0
    for dirpath, dirs, files in os.walk(root):
        for n in dirs + files:
            st = os.lstat(os.path.join(dirpath, n))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def ext4_image(data, img):
    used = used_bytes(data)
    size = int(used * 1.5) + (2 << 30)
    free = shutil.disk_usage(os.path.dirname(img)).free
    log(f"data tree {used / 2**30:.2f} GiB; ext4 image {size / 2**30:.2f} GiB (sparse); "
        f"{free / 2**30:.1f} GiB free on {os.path.dirname(img)}")
    if free < used + (3 << 30):
        sys.exit(f"stock-guest: only {free / 2**30:.1f} GiB free for a {used / 2**30:.1f} GiB image")
    if os.path.exists(img):
        os.unlink(img)
    with open(img, "wb") as f:
        f.truncate(size)
    run(["mkfs.ext4", "-q", "-F", "-E", "root_owner=0:0", "-d", data, img])


def host_khz():
    for line in open("/proc/cpuinfo"):
        if line.startswith("cpu MHz"):
            return int(float(line.split(":")[1]) * 1000)
    return 2_000_000


# ---------------------------------------------------------------- the VM

def boot(kernel, initrd, img, accel, deadline, console_log):
    """Runs the guest to its `strata-vm: exit` line (or its end, or the deadline: then QEMU is killed by
    PID); returns [(host monotonic time, line)] and the exit code the guest's init reported (None when
    none)."""
    cmdline = "console=ttyS0 reboot=t panic=-1 quiet"
    if accel == "tcg":
        # No clock to calibrate the TSC against under TCG (microvm has no HPET): the guest hangs in early
        # boot unless told the rate.
        cmdline += f" tsc_early_khz={host_khz()}"
    argv = ["qemu-system-x86_64", "-M", "microvm,x-option-roms=off,isa-serial=on,rtc=on",
            "-accel", accel, "-cpu", "host" if accel == "kvm" else "max",
            "-m", "3072", "-smp", "2", "-nodefaults", "-no-user-config",
            "-display", "none", "-serial", "stdio", "-no-reboot",
            "-kernel", kernel, "-initrd", initrd, "-append", cmdline,
            "-drive", f"id=data,file={img.replace(',', ',,')},format=raw,if=none,cache=unsafe",
            "-device", "virtio-blk-device,drive=data,serial=data"]
    log("boot:", " ".join(argv))
    p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    q = queue.Queue()

    def reader():
        for raw in p.stdout:
            q.put((time.monotonic(), raw.decode(errors="replace").rstrip("\r\n")))
        q.put(None)

    threading.Thread(target=reader, daemon=True).start()
    lines, code, end = [], None, time.monotonic() + deadline
    with open(console_log, "w") as out:
        while True:
            try:
                item = q.get(timeout=max(0.1, end - time.monotonic()))
            except queue.Empty:
                item = "timeout"
            if item is None:
                break
            if item == "timeout" or time.monotonic() > end:
                log(f"deadline of {deadline} s: killing QEMU (pid {p.pid})")
                p.kill()
                break
            t, line = item
            lines.append((t, line))
            out.write(line + "\n")
            out.flush()
            if line.startswith("strata-61:") or line.startswith("strata-vm:"):
                log(line)
            m = re.match(r"strata-vm: exit (\d+)", line)
            if m:
                code = int(m.group(1))
    try:
        p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        log(f"QEMU (pid {p.pid}) still running after the guest's end: killing it")
        p.kill()
        p.wait()
    return lines, code


def fields(line):
    return dict(kv.split("=", 1) for kv in line.split() if "=" in kv)


def parse(lines):
    """Rows (one per measured run or failed arm) from the console."""
    rows, starts, ends, runner = [], {}, {}, None
    for t, line in lines:
        if not line.startswith("strata-61: "):
            continue
        body = line[len("strata-61: "):]
        if body.startswith("runner "):
            runner = body.split()[1]
        elif body.startswith("start "):
            f = fields(body)
            starts[(f["arm"], f["round"])] = t
        elif body.startswith("end "):
            f = fields(body)
            ends[(f["arm"], f["round"])] = t
        elif body.startswith("bench "):
            f = fields(body)
            row = dict(arm=f["arm"], round=int(f["round"]))
            if "error" in f:
                row["error"] = body
            else:
                row.update(mount_s=float(f["mount_s"]), import_s=float(f["import_s"]), rc=int(f["rc"]))
                row["total_s"] = round(row["mount_s"] + row["import_s"], 2)
                for k in ("fetched", "unattributed", "cache_used"):
                    if f.get(k, "?").isdigit():
                        row[k] = int(f[k])
                key = (f["arm"], f["round"])
                if key in starts:
                    row["host_import_s"] = round(ends.get(key, t) - starts[key], 2)
            rows.append(row)
    return rows, runner


def med(rows, arm, key):
    v = [r[key] for r in rows if r["arm"] == arm and r.get("rc") == 0 and key in r]
    return round(statistics.median(v), 3) if v else None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--deadline", type=float, help="seconds the guest may take (default 900 + 600 per round)")
    ap.add_argument("--accel", default=os.environ.get("STRATA_VM_ACCEL", "tcg"), choices=("tcg", "kvm"))
    ap.add_argument("--keep", action="store_true", help="keep the ext4 image and the data tree")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("stock-guest: run as root (mkfs.ext4 -d keeps owners; the store's files are root's)")
    deadline = a.deadline or 900 + 600 * a.rounds
    t_start = time.monotonic()
    load0 = os.getloadavg()
    log(f"load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}; binaries from {BIN_DIR}")
    os.makedirs(WORK, exist_ok=True)
    kernel, initrd, kver = guest()
    data, img = f"{WORK}/data", f"{WORK}/data.img"
    try:
        data_tree(data, a.rounds)
        ext4_image(data, img)
        prepared = time.monotonic() - t_start
        log(f"prepared in {prepared:.0f} s; guest kernel {kver}; accel {a.accel}; deadline {deadline:.0f} s")
        t_vm = time.monotonic()
        lines, code = boot(kernel, initrd, img, a.accel, deadline, f"{WORK}/console.log")
        in_guest = time.monotonic() - t_vm
    finally:
        if not a.keep:
            for p in (img,):
                if os.path.exists(p):
                    os.unlink(p)
            shutil.rmtree(data, ignore_errors=True)
        # Everything happened in the guest: nothing of this run may be mounted or bound on the host.
        left = [l.split()[1] for l in open("/proc/mounts") if l.split()[1].startswith(WORK)]
        loops = run(["losetup", "-a"]).splitlines()
        loops = [l for l in loops if WORK in l]
        for m in reversed(left):
            subprocess.run(["umount", "-l", m])
        for l in loops:
            subprocess.run(["losetup", "-d", l.split(":")[0]])
        if left or loops:
            log(f"removed on the host: mounts {left}, loop devices {loops}")
    load1 = os.getloadavg()
    rows, runner = parse(lines)
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    common = dict(image=IMAGE, accel=a.accel, kernel=kver, runner=runner)
    with open(RESULTS, "a") as f:
        for r in rows:
            f.write(json.dumps(dict(bench="stock-guest", **common, **r)) + "\n")
    meds = {arm: {k: med(rows, arm, k) for k in ("import_s", "mount_s", "total_s", "host_import_s", "cache_used")}
            for arm in ARMS}

    def ratio(x, y, key="import_s"):
        return meds[x][key] / meds[y][key] if meds[x][key] and meds[y][key] else None

    def per_round(x, y):
        out = []
        for rnd in sorted({r["round"] for r in rows}):
            a_ = [r["import_s"] for r in rows if r["arm"] == x and r["round"] == rnd and r.get("rc") == 0]
            b_ = [r["import_s"] for r in rows if r["arm"] == y and r["round"] == rnd and r.get("rc") == 0]
            if a_ and b_:
                out.append(round(a_[0] / b_[0], 3))
        return out

    pairs = [("loop", "kernel"), ("fuse", "kernel"), ("fuse", "loop")]
    summary = dict(bench="stock-guest", summary=True, **common, rounds=a.rounds, guest_exit=code,
                   medians=meds, runs={arm: sum(1 for r in rows if r["arm"] == arm and r.get("rc") == 0)
                                       for arm in ARMS},
                   failures=[r for r in rows if "error" in r or r.get("rc", 0) != 0],
                   ratios={f"{x}/{y}": ratio(x, y) for x, y in pairs},
                   ratios_total={f"{x}/{y}": ratio(x, y, "total_s") for x, y in pairs},
                   ratios_per_round={f"{x}/{y}": per_round(x, y) for x, y in pairs},
                   loadavg_before=load0, loadavg_after=load1, prepare_s=round(prepared),
                   guest_s=round(in_guest), wall_s=round(time.monotonic() - t_start))
    with open(RESULTS, "a") as f:
        f.write(json.dumps(summary) + "\n")

    fmt = lambda v: f"{v:8.2f}" if v is not None else "       -"
    print(f"\nfat image cold start in Debian 12's stock kernel {kver} ({a.accel}, runner {runner}), "
          f"medians of {a.rounds} rounds, seconds")
    print(f"{'arm':8} {'import':>8} {'mount':>8} {'total':>8} {'host-timed import':>18} {'cache MB':>9}  runs")
    for arm in ARMS:
        m = meds[arm]
        cache = f"{m['cache_used'] / 1e6:9.1f}" if m["cache_used"] is not None else "        -"
        print(f"{arm:8} {fmt(m['import_s'])} {fmt(m['mount_s'])} {fmt(m['total_s'])} "
              f"{fmt(m['host_import_s']):>18} {cache}  {summary['runs'][arm]}")
    for x, y in pairs:
        r, rt = summary["ratios"][f"{x}/{y}"], summary["ratios_total"][f"{x}/{y}"]
        print(f"{x}/{y}: import {r:.2f}x (per round {summary['ratios_per_round'][f'{x}/{y}']}), "
              f"mount+import {rt:.2f}x" if r and rt else f"{x}/{y}: -")
    for r in summary["failures"]:
        print("failure:", r)
    print(f"load average {load0[0]:.2f} before, {load1[0]:.2f} after; prepared in {prepared:.0f} s, "
          f"{in_guest:.0f} s in the guest (exit {code}); results in {RESULTS}; console in {WORK}/console.log")
    return 0 if code == 0 and not summary["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""MicroVM start (issue 13): time from `strata vm` to the first line of a command's output in the guest,
through stratad's lazy drives (cold: a fresh stratad, empty chunk cache, page cache dropped; warm: a second
VM right after, chunks cached), against the same VM booted from a local materialized EROFS copy of the
layer (`strata materialize`: meta.erofs + devices/N as drive files) and from a fully copied ext4 disk image
of the image's tree (the eager path: `mkfs.ext4 -d`; the copy's own time is reported apart), all in one
run, alternating. Every variant gets a fresh sparse ext4 scratch drive (mkfs.ext4 counted, as `strata vm`
makes one) and boots the same kernel, initramfs (scripts/vm-guest) and run script.

usage: sudo benches/vm.py [busybox] [fat] [--runs N]

  busybox  the tests' busybox image plus a 32 MiB file under /data (so that "bytes fetched" means
           something): `cat /etc/os-release` (first line: its ID)
  fat      the fat agent base of benches/make-fat.sh (fat:v1 in $BENCH_DATA/cs/store, as coldstart.py
           prepares it): `python3 -c 'import numpy, pandas; print("imported")'`

Accelerator: STRATA_VM_ACCEL (kvm or tcg; default kvm if /dev/kvm opens, as qemu.sh). Prints medians and
appends JSON lines to benches/results/vm-<stamp>.jsonl. Environment: BENCH_DATA (/var/tmp/strata-bench),
CARGO_TARGET_DIR (/var/tmp/strata-target) for the release binaries, VM_GUEST (/var/tmp/strata-vm-guest:
built with scripts/vm-guest --out there if missing).
"""
import argparse, base64, json, os, shutil, statistics, subprocess, sys, tempfile, time

import stratad
from stratad import BIN

HERE = os.path.dirname(os.path.abspath(__file__))
D = os.environ.get("BENCH_DATA", "/var/tmp/strata-bench")
VMD = f"{D}/vm"
GUEST = os.environ.get("VM_GUEST", "/var/tmp/strata-vm-guest")
STAMP = time.strftime("%Y-%m-%dT%H%MZ", time.gmtime())
RESULTS = f"{HERE}/results/vm-{STAMP}.jsonl"
ACCEL = os.environ.get("STRATA_VM_ACCEL") or ("kvm" if os.access("/dev/kvm", os.R_OK | os.W_OK) else "tcg")

IMAGES = {
    "busybox": {"store": f"file://{VMD}/store", "tag": "vmbench:busybox", "marker": "ID=",
                "cmd": ["cat", "/etc/os-release"], "tree": f"{VMD}/busybox-src", "mat": f"{VMD}/busybox-mat"},
    "fat": {"store": f"file://{D}/cs/store", "tag": "fat:v1", "marker": "imported",
            "cmd": ["python3", "-c", "import numpy, pandas; print('imported')"], "tree": f"{D}/fat",
            "mat": f"{D}/cs/fat-mat"},
}


def log(*a):
    print("[vm]", *a, file=sys.stderr, flush=True)


def sh(argv, **kw):
    return subprocess.run(argv, check=True, **kw)


def drop_caches():
    sh(["sync"])
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def strata(store, *args, sock=None):
    argv = [BIN["strata"], "--store", store] + (["--socket", sock] if sock else []) + list(args)
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout.strip()


# ---------------------------------------------------------------- preparation (idempotent)

def prepare_guest():
    if not os.path.exists(f"{GUEST}/initrd.img"):
        sh([f"{HERE}/../scripts/vm-guest", "--out", GUEST])
    return f"{GUEST}/vmlinuz", f"{GUEST}/initrd.img"


def prepare_busybox(img):
    os.makedirs(VMD, exist_ok=True)
    src = img["tree"]
    if not os.path.exists(f"{src}/.done"):
        shutil.rmtree(src, ignore_errors=True)
        for d in ("bin", "etc", "tmp", "proc", "sys", "dev", "root", "data"):
            os.makedirs(f"{src}/{d}")
        shutil.copy("/bin/busybox", f"{src}/bin/busybox")
        for app in ("sh", "ls", "cat", "echo", "md5sum", "head", "wc", "sleep"):
            os.symlink("busybox", f"{src}/bin/{app}")
        open(f"{src}/etc/os-release", "w").write("ID=strata-bench\n")
        open(f"{src}/etc/passwd", "w").write("root:x:0:0:root:/root:/bin/sh\n")
        with open(f"{src}/data/big.bin", "wb") as f:
            f.write(os.urandom(32 << 20))
        open(f"{src}/.done", "w").close()
    try:
        strata(img["store"], "inspect", img["tag"])
    except subprocess.CalledProcessError:
        strata(img["store"], "build", src, "-t", img["tag"])


def prepare_mat(img):
    if not os.path.exists(f"{img['mat']}/meta.erofs"):
        strata(img["store"], "materialize", img["tag"], img["mat"])


def make_ext4(img):
    """The eager path's disk: the whole tree copied into an ext4 image; returns (path, seconds)."""
    path = f"{VMD}/{img['tag'].replace(':', '-')}.ext4"
    size = int(subprocess.run(["du", "-sb", img["tree"]], capture_output=True, text=True,
                              check=True).stdout.split()[0])
    if os.path.exists(path):
        os.unlink(path)
    drop_caches()
    t = time.perf_counter()
    with open(path, "wb") as f:
        f.truncate(int(size * 1.3) + (128 << 20))
    sh(["mkfs.ext4", "-q", "-F", "-m", "0", "-E", "root_owner=0:0", "-d", img["tree"], path])
    sh(["sync", "-f", path])
    return path, time.perf_counter() - t


# ---------------------------------------------------------------- booting

def accel_args(cmdline):
    if ACCEL == "kvm":
        return ["-accel", "kvm", "-cpu", "host"], cmdline
    khz = next((int(float(l.split(":")[1]) * 1000) for l in open("/proc/cpuinfo") if l.startswith("cpu MHz")), 0)
    return ["-accel", "tcg", "-cpu", "max"], f"{cmdline} tsc_early_khz={khz}" if khz else cmdline


def boot(argv, cmdline, marker, t0):
    """Runs QEMU (argv without accelerator; -append replaced); returns seconds from t0 to the first console
    line holding `marker`, and the console."""
    acc, line = accel_args(cmdline)
    argv = list(argv)
    argv[argv.index("-append") + 1] = line
    p = subprocess.Popen([argv[0], *acc, *argv[1:]], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                         text=True)
    first, console = None, []
    for l in p.stdout:
        console.append(l.rstrip())
        if first is None and marker in l:
            first = time.perf_counter() - t0
    p.wait()
    if first is None:
        raise RuntimeError("no output line with %r:\n%s" % (marker, "\n".join(console[-30:])))
    return first, console


def scratch_drive(path):
    with open(path, "wb") as f:
        f.truncate(256 << 20)
    sh(["mkfs.ext4", "-q", "-F", "-m", "0", "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard", path])


def swap_drives(argv, files):
    """QEMU argv with the drive of each serial in `files` pointed at another file (None: dropped)."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a == "-drive":
            opts = dict(kv.split("=", 1) for kv in argv[i + 1].split(",") if "=" in kv)
            serial = opts["id"]
            if serial in files:
                if files[serial] is None:
                    i += 4  # the -drive and its -device
                    continue
                spec = argv[i + 1].replace(f"file={opts['file']}", f"file={files[serial]}")
                out += [a, spec]
                i += 2
                continue
        out.append(a)
        i += 1
    return out


# ---------------------------------------------------------------- variants

def lazy(img, kernel, initrd, d, sid, work):
    """`strata vm` then boot; returns (seconds, fetched bytes, image bytes, the launch description)."""
    t0 = time.perf_counter()
    strata(img["store"], "vm", img["tag"], "--sandbox", sid, f"{work}/{sid}", "--kernel", kernel,
           "--initrd", initrd, "--scratch-size", "256M", "--", *img["cmd"], sock=d.sock)
    desc = json.load(open(f"{work}/{sid}/vm.json"))
    s, _ = boot(desc["qemu"], desc["cmdline"], img["marker"], t0)
    sb = d.sandbox(sid)
    return s, sb["fetched_bytes"], sb["image_bytes"], desc


def local(img, desc, work, kind, ext4=None):
    """The same VM from local drives: the materialized layer (`erofs`) or the ext4 copy (`ext4`)."""
    scratch = f"{work}/ref-scratch.ext4"
    t0 = time.perf_counter()
    scratch_drive(scratch)
    files = {"scratch": scratch}
    cmdline = desc["cmdline"]
    if kind == "erofs":
        devs = sorted(os.listdir(f"{img['mat']}/devices"), key=int)
        spec = desc["layers"][0]
        files[spec[0]] = f"{img['mat']}/meta.erofs"
        for k, serial in enumerate(spec[1:]):
            files[serial] = f"{img['mat']}/devices/{devs[k]}"
        argv = swap_drives(desc["qemu"], files)
    else:
        for dr in desc["drives"]:
            if dr["kind"] != "scratch":
                files[dr["serial"]] = None
        argv = swap_drives(desc["qemu"], files)
        argv[-1:-1] = []
        argv += ["-drive", f"id=r0,file={ext4},format=raw,if=none,readonly=on",
                 "-device", "virtio-blk-device,drive=r0,serial=r0"]
        cmdline = " ".join(w for w in cmdline.split() if not w.startswith(("strata.layers=", "strata.l")))
        cmdline += " strata.rootfs=r0"
    s, _ = boot(argv, cmdline, img["marker"], t0)
    os.unlink(scratch)
    return s


def bench(name, runs, kernel, initrd):
    img = IMAGES[name]
    if name == "busybox":
        prepare_busybox(img)
    elif not os.path.exists(img["tree"]):
        sys.exit(f"no {img['tree']}: run benches/make-fat.sh and benches/coldstart.py prepare first")
    prepare_mat(img)
    ext4, copy_s = make_ext4(img)
    log(f"{name}: ext4 copy of the tree made in {copy_s:.2f} s")
    rows = {k: [] for k in ("lazy_cold", "lazy_warm", "erofs_cold", "erofs_warm", "ext4_cold", "ext4_warm")}
    fetched = []
    for r in range(runs):
        work = tempfile.mkdtemp(prefix="strata-vmbench-", dir="/var/tmp")
        d = stratad.Daemon(img["store"], args=("--no-prefetch",), quiet=True)
        try:
            drop_caches()
            s, f, size, desc = lazy(img, kernel, initrd, d, "cold", work)
            rows["lazy_cold"].append(s)
            fetched.append((f, size))
            s, _, _, _ = lazy(img, kernel, initrd, d, "warm", work)
            rows["lazy_warm"].append(s)
            for kind in ("erofs", "ext4"):
                drop_caches()
                rows[f"{kind}_cold"].append(local(img, desc, work, kind, ext4))
                rows[f"{kind}_warm"].append(local(img, desc, work, kind, ext4))
        finally:
            for sid in ("cold", "warm"):
                try:
                    d.call("DELETE", f"/v1/sandboxes/{sid}?purge=1&force=1")
                except Exception:
                    pass
            d.stop()
            shutil.rmtree(work, ignore_errors=True)
        log(f"{name} run {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in rows.items()))
    med = {k: statistics.median(v) for k, v in rows.items()}
    f, size = fetched[0]
    out = {"bench": "vm", "image": name, "tag": img["tag"], "accel": ACCEL, "runs": runs,
           "median_s": med, "all_s": rows, "ext4_copy_s": copy_s, "fetched_bytes": f,
           "image_bytes": size, "fetched_pct": 100.0 * f / size, "cmd": img["cmd"]}
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "a") as fh:
        fh.write(json.dumps(out) + "\n")
    print(f"{name} ({ACCEL}, {runs} runs, medians): " + ", ".join(f"{k} {v:.2f} s" for k, v in med.items())
          + f"; ext4 copy {copy_s:.2f} s; fetched {f / 2**20:.1f} MiB of {size / 2**20:.1f} MiB"
          + f" ({100.0 * f / size:.1f} %)")
    os.unlink(ext4)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("images", nargs="*", default=["busybox"])
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    kernel, initrd = prepare_guest()
    for name in a.images:
        bench(name, a.runs, kernel, initrd)


if __name__ == "__main__":
    main()

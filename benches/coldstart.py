#!/usr/bin/env python3
"""Node daemon benchmarks (issue 3, point 8): stratad against the practical limit (kernel EROFS reading a
local materialized copy of the same layer) and against the eager path (download the image's tar.zst,
extract, run), on the fat agent base of benches/make-fat.sh.

usage: sudo benches/coldstart.py [prepare|plan|record|noplan|inherit|local|stat|seq|link|all]... [--runs N]

  prepare  builds the images into a local store (file://), materializes them (`strata materialize`), makes
           the eager path's tar.zst (`tar -c | zstd -3 -T2`); idempotent, under $BENCH_DATA/cs/
  plan     records the import's reads as the fat image's prefetch plan (`strata trace`): from then on
           stratad warms the plan when a sandbox of the image is created (rows say "plan": true)
  record   the same plan recorded by stratad itself (`--record-plans`) from a first sandbox running the import
  noplan   removes the plan pointer again, and every layer plan (the default measurements are without a plan)
           before the measurements; given with `plan` (e.g. `plan local noplan`: with a fresh plan), also
           after them, so that the plan made for them does not stay behind
  inherit  also measures `local` and `link` for a new image: the fat layer (traced once, as fat:v1) plus a
           fresh workspace layer never traced, which inherits the fat layer's plan (rows local-inherit,
           link-inherit); e.g. `coldstart.py plan inherit link --runs 5` compares it with the traced image
  local    cold start, local store: mount + `python3 -c 'import numpy, pandas'` in bubblewrap, through a
           fresh stratad (empty chunk cache) on the file:// store, against mounting the materialized copy
           with kernel EROFS and running the same import, bare (`reference`) and, as a sandbox's rootfs
           is, under an overlay with an empty upper directory (`reference_overlay`, both mounts timed
           with it; `ratio_overlay_median`); page cache dropped before each run. Rows also
           carry stratad's own account (`/metrics`): `waited`, the seconds reads waited for chunks not in
           the cache, `misses` (reads that fetched) and `joined` (reads that waited for another fetch) —
           less noisy than the wall time on a busy host, as the workload's own CPU time is not in them
  stat     the first metadata-heavy command on a cold mount: lstat of every entry of the rootfs
           (`find ROOT -printf '%s'`) on a stratad rootfs just mounted (each of IMAGES), against the same on
           the materialized copy mounted with kernel EROFS, bare and under an overlay; page cache dropped
           after mounting
  seq      warm sequential read of the 1 GiB file (`dd bs=1M`): chunks already in stratad's cache, page
           cache dropped, against kernel EROFS reading the materialized copy with page cache dropped
  link     cold start over a slow link: a read-only S3 endpoint on loopback (see ObjectServer: why not moto)
           serving the local store and the tar.zst, behind linkproxy (20 ms round trip, 1 Gbit/s shared by
           all connections, see tests/src/bin/linkproxy.rs); stratad (empty cache) on s3:// through the
           proxy: mount + import; against the eager path through the same proxy: `curl | zstd -d | tar -x`
           of the image's tar.zst, then the same import. Bytes fetched = every byte the proxy carried
           server→client during the lazy run (metadata, tables of contents and chunks), also stratad's own
           fetched_bytes; both against the image's stored bytes.

Each benchmark runs RUNS times (default 5; link 3), alternating strata and the reference in each run, each
measurement after waiting for an idle CPU (< 15 % busy over 1 s, up to QUIET_MAX s) and dropping the page
cache; it prints medians and per-run ratios (strata / reference) and appends JSON lines to
benches/results/coldstart-<stamp>.jsonl. Environment: BENCH_DATA (/var/tmp/strata-bench), CARGO_TARGET_DIR
(/var/tmp/strata-target) for the release strata, stratad and linkproxy binaries, STRATAD (another stratad), QUIET_MAX (120), RTT_MS
(20), MBIT (1000), STRATAD_ARGS (extra flags for stratad, e.g. "--max-fetch-span 1M"), IMAGES (the images
`local`, `link` and `stat` measure, comma-separated, each from a fresh daemon in every run against the same
reference measurement, default fat:v1, in reversed order every other run so that no arm always goes first; an item may add stratad flags after a space: e.g. fat:v1,fatrf:v1
compares two builds of the fat tree in one run, "fat:v1,fat:v1 --max-fetch-span 4M" two daemon settings,
"fat:v1,fat:v1 stratad=/tmp/stratad-old" two stratad binaries;
rows and summaries carry the item as `image`). WORKLOAD (a shell command run instead of the import, e.g.
"gcc --version && python3 -c 'import scipy.optimize'").
"""
import argparse, contextlib, ctypes, email.utils, http.server, urllib.parse, json, os, shutil, socket, statistics, subprocess, sys, tempfile, time

import stratad
from stratad import BIN, call

HERE = os.path.dirname(os.path.abspath(__file__))
STRATA, STRATAD, LINKPROXY = BIN["strata"], BIN["stratad"], BIN["linkproxy"]
D = os.environ.get("BENCH_DATA", "/var/tmp/strata-bench")
CS = f"{D}/cs"
STORE = f"file://{CS}/store"
IMPORT = ["python3", "-c", "import numpy, pandas"]
if os.environ.get("WORKLOAD"):
    IMPORT = ["sh", "-c", os.environ["WORKLOAD"]]
STAMP = time.strftime("%Y-%m-%dT%H%MZ", time.gmtime())
RESULTS = f"{HERE}/results/coldstart-{STAMP}.jsonl"
EXTRA = os.environ.get("STRATAD_ARGS", "").split()
IMAGES = os.environ.get("IMAGES", "fat:v1").split(",")


def daemon_opts(image):
    """The stratad options of an IMAGES item: the flags after the image's name, and `stratad=PATH` for
    another binary (e.g. `fat:v1 stratad=/tmp/stratad-main` against the build under test)."""
    words = image.split()[1:]
    binary = [w.split("=", 1)[1] for w in words if w.startswith("stratad=")]
    return {"args": [w for w in words if not w.startswith("stratad=")], "binary": (binary or [None])[0]}


def log(*a):
    print("[coldstart]", *a, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- machine state

def cpu_busy(interval=1.0):
    def snap():
        v = [int(x) for x in open("/proc/stat").readline().split()[1:9]]
        return v[3] + v[4], sum(v)
    i0, t0 = snap()
    time.sleep(interval)
    i1, t1 = snap()
    return 100.0 * (1 - (i1 - i0) / max(1, t1 - t0))


def wait_quiet():
    """Waits for < 15 % CPU busy; returns the last busy figure seen (what the measurement started in)."""
    start = time.time()
    while True:
        b = cpu_busy()
        if b < 15 or time.time() - start > float(os.environ.get("QUIET_MAX", "120")):
            if b >= 15:
                log(f"machine still {b:.0f}% busy: measuring anyway")
            return b


def drop_caches():
    subprocess.run(["sync"], check=True)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


# ---------------------------------------------------------------- kernel EROFS, new mount API

libc = ctypes.CDLL(None, use_errno=True)
SYS_move_mount, SYS_fsopen, SYS_fsconfig, SYS_fsmount = 429, 430, 431, 432


def _sys(nr, *args):
    r = libc.syscall(nr, *args)
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"syscall {nr}: {os.strerror(e)}")
    return r


def mount_erofs(meta, devices, target):
    """File-backed kernel EROFS mount of `meta` with `devices` (device-table order) at `target`."""
    fd = _sys(SYS_fsopen, b"erofs", 1)
    try:
        _sys(SYS_fsconfig, fd, 1, b"source", os.fsencode(meta), 0)
        for d in devices:
            _sys(SYS_fsconfig, fd, 1, b"device", os.fsencode(d), 0)
        _sys(SYS_fsconfig, fd, 6, None, None, 0)
        mfd = _sys(SYS_fsmount, fd, 1, 1)  # FSMOUNT_CLOEXEC, MOUNT_ATTR_RDONLY
        try:
            _sys(SYS_move_mount, mfd, b"", -100, os.fsencode(target), 4)  # MOVE_MOUNT_F_EMPTY_PATH
        finally:
            os.close(mfd)
    finally:
        os.close(fd)


def materialized(name):
    d = f"{CS}/{name}-mat"
    devs = sorted(os.listdir(f"{d}/devices"), key=int)
    return f"{d}/meta.erofs", [f"{d}/devices/{x}" for x in devs]


def umount(path):
    subprocess.run(["umount", "-l", path], stderr=subprocess.DEVNULL)


# ---------------------------------------------------------------- stratad

def Daemon(store, env=None, state=None, args=(), binary=None):
    """A fresh stratad (own state dir: empty chunk cache) with `$STRATAD_ARGS`; `stop()` when done."""
    return stratad.Daemon(store, env=env, state=state, args=(*EXTRA, *args), binary=binary)


def bwrap(root, cmd, ro=False):
    return ["bwrap", "--ro-bind" if ro else "--bind", root, "/", "--proc", "/proc", "--dev", "/dev",
            "--unshare-pid", "--die-with-parent", "--", *cmd]


def timed(argv, **kw):
    t = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, **kw)
    return time.perf_counter() - t


# ---------------------------------------------------------------- results

def plan_pointer():
    """The store file naming the fat image's prefetch plan (present after `coldstart.py plan`)."""
    tag = open(f"{CS}/store/tags/fat/v1").read().strip()
    return f"{CS}/store/plans/by-manifest/{tag.split(':', 1)[1]}"


def record(bench, run, **fields):
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    fields.setdefault("plan", os.path.exists(plan_pointer()))
    row = dict(bench=bench, run=run, time=time.strftime("%H:%M:%S", time.gmtime()), **fields)
    with open(RESULTS, "a") as f:
        f.write(json.dumps(row) + "\n")
    log(json.dumps(row))
    return row


def summaries(bench, rows, extra=(), images=None):
    """One summary per image measured (see IMAGES)."""
    return [summary(bench, [r for r in rows if r.get("image", im) == im], extra=extra, image=im)
            for im in (images or IMAGES)]


def summary(bench, rows, a="strata", b="reference", extra=(), **fields):
    sa = statistics.median(r[a] for r in rows)
    sb = statistics.median(r[b] for r in rows)
    ratios = [r[a] / r[b] for r in rows]
    out = dict(bench=bench, summary=True, runs=len(rows), strata_median=sa, reference_median=sb,
               ratio_of_medians=sa / sb, ratio_median=statistics.median(ratios), ratios=ratios,
               busy=[round(r["busy"]) for r in rows], loadavg=os.getloadavg()[0], **fields)
    for k in extra:
        out[k + "_median"] = statistics.median(r[k] for r in rows)
    if all("reference_overlay" in r for r in rows):
        # Against the kernel under an overlay, as a sandbox's rootfs always is.
        out["ratio_overlay_median"] = statistics.median(r[a] / r["reference_overlay"] for r in rows)
    with open(RESULTS, "a") as f:
        f.write(json.dumps(out) + "\n")
    print(json.dumps(out), flush=True)
    return out


# ---------------------------------------------------------------- prepare

def sh(cmd):
    subprocess.run(cmd, shell=True, check=True)


def prepare():
    os.makedirs(CS, exist_ok=True)
    for name, src in (("fat", f"{D}/fat"), ("big", f"{D}/bigfile")):
        if not os.path.exists(f"{D}/{'fat' if name == 'fat' else 'bigfile'}.done"):
            sys.exit(f"missing {src}: run benches/make-fat.sh first")
        if not os.path.exists(f"{CS}/{name}.built"):
            log(f"strata build {src} -t {name}:v1 --kind base")
            sh(f"{STRATA} --store {STORE} build {src} -t {name}:v1 --kind base --json > {CS}/{name}.build.json")
            open(f"{CS}/{name}.built", "w").close()
        mat = f"{CS}/{name}-mat"
        if not os.path.exists(f"{mat}.done"):
            log(f"strata materialize {name}:v1 {mat}")
            shutil.rmtree(mat, ignore_errors=True)
            sh(f"{STRATA} --store {STORE} materialize {name}:v1 {mat}")
            open(f"{mat}.done", "w").close()
    if not os.path.exists(f"{CS}/fat.tar.zst.done"):
        log("tar -c fat | zstd -3 -T2 > fat.tar.zst")
        sh(f"tar -C {D}/fat -c . | zstd -q -3 -T2 > {CS}/fat.tar.zst")
        open(f"{CS}/fat.tar.zst.done", "w").close()


# ---------------------------------------------------------------- prefetch plan

def make_plan():
    """Records the import's reads as the fat image's prefetch plan (`strata trace`); stratad then warms it
    when a sandbox of the image is created, in every benchmark that follows, until `noplan`."""
    d = Daemon(STORE)
    try:
        sh(f"{STRATA} --store {STORE} --socket {d.sock} trace fat:v1 --json -- {' '.join(IMPORT[:2])} "
           f"'{IMPORT[2]}' > {CS}/plan.json")
        log(f"plan: {open(f'{CS}/plan.json').read().strip()}")
    finally:
        d.stop()


def record_plan():
    """Has stratad record the fat image's plan itself (`--record-plans`): a node with no plan for the image
    runs the import in its first sandbox and stores the reads of its first seconds as the plan."""
    drop_plan()
    d = Daemon(STORE, args=("--record-plans", "10"))
    try:
        drop_caches()
        sb = d.mount("fat:v1", "rec")
        timed(bwrap(sb["rootfs"], IMPORT))
        for _ in range(600):
            if call(d.sock, "GET", "/v1/status").get("recording_plan") is None:
                break
            time.sleep(0.1)
        log(f"recorded plan: {os.path.exists(plan_pointer())}")
    finally:
        d.stop()


def drop_plan():
    """Drops the fat image's plan, every layer plan (which a new image on the same layers inherits) and
    every blob's pointer to a plan (which a layer without a plan warms from: plans by content)."""
    if os.path.exists(plan_pointer()):
        os.unlink(plan_pointer())
    for by in ("by-layer", "by-blob"):
        shutil.rmtree(f"{CS}/store/plans/{by}", ignore_errors=True)


def make_inherit():
    """A new image on a traced base (issue 12): `fatws:v1` is the fat image's layer plus a fresh workspace
    layer that no run ever traced; it has no plan of its own, so a node warms the plan of the fat layer it
    shares, recorded by the trace of `fat:v1` (`make_plan`, run first if there is none)."""
    if not os.path.exists(plan_pointer()):
        make_plan()
    ws = f"{CS}/ws-src"
    shutil.rmtree(ws, ignore_errors=True)
    os.makedirs(f"{ws}/work/task")
    with open(f"{ws}/work/task/README", "w") as f:
        f.write(f"a task made at {time.time()}\n")
    layer = subprocess.run([STRATA, "--store", STORE, "build", ws, "--kind", "workspace", "--on", "fat:v1"],
                           check=True, capture_output=True, text=True).stdout.strip()
    sh(f"{STRATA} --store {STORE} compose --base fat:v1 --workspace {layer} -t fatws:v1 --force")
    log(f"fatws:v1 = fat:v1 + workspace {layer}")


# ---------------------------------------------------------------- local cold start

def arms(images, run):
    """The arms of run `run` in the order they are measured: as given in even runs, reversed in odd ones
    (an arm measured right after another one's daemon was stopped is not always the same arm)."""
    return list(images) if run % 2 == 0 else list(images)[::-1]


def bench_local(runs, images=None, label="local"):
    meta, devs = materialized("fat")
    mnt = tempfile.mkdtemp(prefix="strata-cs-erofs-", dir="/var/tmp")
    ov = tempfile.mkdtemp(prefix="strata-cs-ov-", dir="/var/tmp")
    rows = []
    try:
        for i in range(runs):
            got = []
            for image in arms(images or IMAGES, i):
                d = Daemon(STORE, **daemon_opts(image))
                try:
                    busy = wait_quiet()
                    drop_caches()
                    t = time.perf_counter()
                    sb = d.mount(image.split()[0], "s")
                    t_mount = time.perf_counter() - t
                    timed(bwrap(sb["rootfs"], IMPORT))
                    strata = time.perf_counter() - t
                    got.append((image, strata, t_mount, d.sandbox("s"), busy, d.waits()))
                finally:
                    d.stop()
            busy2 = wait_quiet()
            drop_caches()
            t = time.perf_counter()
            mount_erofs(meta, devs, mnt)
            r_mount = time.perf_counter() - t
            try:
                timed(bwrap(mnt, IMPORT, ro=True))
                ref = time.perf_counter() - t
            finally:
                umount(mnt)
            busy3 = wait_quiet()
            ref_ov = import_on_overlay(meta, devs, mnt, ov)
            for image, strata, t_mount, sb, busy, w in got:
                rows.append(record(label, i, image=image, strata=strata, strata_mount=t_mount, reference=ref,
                                   reference_mount=r_mount, reference_overlay=ref_ov, fetched=sb["fetched_bytes"],
                                   stored=sb["image_bytes"], busy=max(busy, busy2, busy3),
                                   waited=w["led_s"] + w["joined_s"], misses=w["led"], joined=w["joined"]))
    finally:
        os.rmdir(mnt)
        shutil.rmtree(ov, ignore_errors=True)
    return summaries(label, rows, extra=("strata_mount", "reference_mount", "reference_overlay", "fetched", "waited",
                                         "misses", "joined"), images=images)


def import_on_overlay(meta, devs, mnt, ov):
    """The cold import in a rootfs like a sandbox's: an overlay (empty upper) over the kernel EROFS mount,
    page cache dropped first, both mounts timed with it. A sandbox rootfs is always an overlay, so this
    tells the overlay's share of strata's time from the data path's."""
    overlay_dirs(ov)
    drop_caches()
    t = time.perf_counter()
    mount_erofs(meta, devs, mnt)
    try:
        with overlay(mnt, ov) as root:
            timed(bwrap(root, IMPORT))
            return time.perf_counter() - t
    finally:
        umount(mnt)


def overlay_dirs(d):
    """Empty upper, work and mount-point directories (`d`/u, w, m) for [`overlay`]."""
    for sub in ("u", "w", "m"):
        shutil.rmtree(f"{d}/{sub}", ignore_errors=True)
        os.makedirs(f"{d}/{sub}")


@contextlib.contextmanager
def overlay(lower, d):
    """An overlay of `lower` with the empty upper directory of `d` (see `overlay_dirs`), mounted at
    `d`/m while the block runs: a sandbox's rootfs over the kernel's mount."""
    sh(f"mount -t overlay overlay -o lowerdir={lower},upperdir={d}/u,workdir={d}/w {d}/m")
    try:
        yield f"{d}/m"
    finally:
        umount(f"{d}/m")


# ---------------------------------------------------------------- stat walk

def walk(root):
    t = time.perf_counter()
    out = subprocess.run(["find", root, "-printf", "%s %m\n"], check=True, capture_output=True).stdout
    return time.perf_counter() - t, out.count(b"\n")


def bench_stat(runs):
    """Also measures an overlay (empty upper) over the same kernel EROFS mount: a sandbox rootfs is always
    an overlay, so this tells the overlay's share of strata's time from the rest."""
    meta, devs = materialized("fat")
    mnt = tempfile.mkdtemp(prefix="strata-cs-erofs-", dir="/var/tmp")
    ov = tempfile.mkdtemp(prefix="strata-cs-ov-", dir="/var/tmp")
    rows = []
    try:
        for i in range(runs):
            got = []
            for image in arms(IMAGES, i):
                d = Daemon(STORE, **daemon_opts(image))
                try:
                    busy = wait_quiet()
                    drop_caches()
                    sb = d.mount(image.split()[0], "s")
                    drop_caches()
                    got.append((image, *walk(sb["rootfs"]), busy))
                finally:
                    d.stop()
            busy2 = wait_quiet()
            drop_caches()
            mount_erofs(meta, devs, mnt)
            try:
                drop_caches()
                ref, n2 = walk(mnt)
                overlay_dirs(ov)
                with overlay(mnt, ov) as root:
                    busy3 = wait_quiet()
                    drop_caches()
                    ref_ov, _ = walk(root)
            finally:
                umount(mnt)
            for image, strata, n1, busy in got:
                rows.append(record("stat", i, image=image, strata=strata, reference=ref, reference_overlay=ref_ov,
                                   entries=n1, entries_ref=n2, busy=max(busy, busy2, busy3)))
    finally:
        os.rmdir(mnt)
        shutil.rmtree(ov, ignore_errors=True)
    return summaries("stat", rows, extra=("reference_overlay",))


# ---------------------------------------------------------------- warm sequential read

def dd(path):
    t = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=1M"], check=True, capture_output=True)
    return time.perf_counter() - t


def bench_seq(runs):
    meta, devs = materialized("big")
    mnt = tempfile.mkdtemp(prefix="strata-cs-erofs-", dir="/var/tmp")
    size = os.path.getsize(f"{D}/bigfile/data")
    d = Daemon(STORE)
    rows = []
    try:
        sb = d.mount("big:v1", "s")
        f = f"{sb['rootfs']}/data"
        first = dd(f)  # fills the chunk cache
        log(f"first (cold) read through stratad: {first:.2f}s")
        mount_erofs(meta, devs, mnt)
        try:
            for i in range(runs):
                busy = wait_quiet()
                drop_caches()
                strata = dd(f)
                busy2 = wait_quiet()
                drop_caches()
                ref = dd(f"{mnt}/data")
                rows.append(record("seq", i, strata=strata, reference=ref,
                                   strata_mbs=size / strata / 1e6, reference_mbs=size / ref / 1e6,
                                   busy=max(busy, busy2)))
        finally:
            umount(mnt)
    finally:
        d.stop()
        os.rmdir(mnt)
    # Throughput ratio = reference time / strata time.
    return summary("seq", rows, extra=("strata_mbs", "reference_mbs"))


# ---------------------------------------------------------------- slow link

class ObjectServer(http.server.BaseHTTPRequestHandler):
    """A read-only S3 endpoint (path style, GET and HEAD with Range, no auth) serving the files under the
    server's root directory: `/<bucket>/<key>` is `<root>/<bucket>/<key>`. The benchmark uses it instead
    of moto because moto answers a range GET of a large object by reading the whole object (measured here:
    0.18 s per range request on a 300 MB object), and s3s-fs hashes the whole file on every GET of an
    object it did not write and streams 4 KiB reads (62 MB/s): either would charge the lazy path or the
    eager path for the server's cost, not the link's. Bodies go out with sendfile(2)."""

    protocol_version = "HTTP/1.1"
    root = "."

    def log_message(self, *a):
        pass

    def setup(self):
        super().setup()
        # Headers and body go out in separate writes: without this, Nagle's algorithm holds the body
        # until the client's delayed ACK (40 ms a request).
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _error(self, code, s3code):
        body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{s3code}</Code>'
                f"<Message>{s3code}</Message></Error>").encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self):
        self.do_GET()

    def do_GET(self):
        path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
        full = os.path.realpath(os.path.join(self.root, path.lstrip("/")))
        if ".." in path.split("/") or not os.path.isfile(full):
            return self._error(404, "NoSuchKey")
        st = os.stat(full)
        start, end = 0, st.st_size
        rng = self.headers.get("Range")
        if rng:
            try:
                a, _, b = rng.split("=", 1)[1].partition("-")
                start, end = int(a), min(st.st_size, int(b) + 1 if b else st.st_size)
            except ValueError:
                return self._error(400, "InvalidRange")
            if start >= end:
                return self._error(416, "InvalidRange")
        self.send_response(206 if rng else 200)
        self.send_header("Content-Length", str(end - start))
        if rng:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{st.st_size}")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}"')
        self.send_header("Last-Modified", email.utils.formatdate(st.st_mtime, usegmt=True))
        self.send_header("Content-Type", "application/octet-stream")
        self.end_headers()
        if self.command == "HEAD":
            return
        self.wfile.flush()
        with open(full, "rb") as f:
            off, left = start, end - start
            while left > 0:
                n = os.sendfile(self.connection.fileno(), f.fileno(), off, min(left, 8 << 20))
                if n <= 0:
                    break
                off += n
                left -= n


def serve(root, port_file):
    ObjectServer.root = root
    # The default listen backlog (5) drops connections when the client opens 16 at once; each dropped
    # SYN costs a 1 s retransmission.
    http.server.ThreadingHTTPServer.request_queue_size = 128
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ObjectServer)
    srv.daemon_threads = True
    with open(port_file + ".tmp", "w") as f:
        f.write(str(srv.server_address[1]))
    os.rename(port_file + ".tmp", port_file)
    srv.serve_forever()


class S3:
    """The object server on loopback (bucket `bench`: the local store under `strata/`, the image's
    tar.zst as `fat.tar.zst`), and linkproxy in front of it."""

    def __init__(self, rtt_ms, mbit):
        self.dir = tempfile.mkdtemp(prefix="strata-cs-s3-", dir="/var/tmp")
        os.makedirs(f"{self.dir}/root/bench")
        os.symlink(f"{CS}/store", f"{self.dir}/root/bench/strata")
        os.symlink(f"{CS}/fat.tar.zst", f"{self.dir}/root/bench/fat.tar.zst")
        pf = f"{self.dir}/port"
        self.server = subprocess.Popen([sys.executable, os.path.abspath(__file__), "serve", f"{self.dir}/root", pf])
        for _ in range(300):
            if os.path.exists(pf):
                break
            time.sleep(0.05)
        self.port = int(open(pf).read())
        self.stats = f"{self.dir}/link-stats"
        self.proxy = subprocess.Popen([LINKPROXY, "--target", f"127.0.0.1:{self.port}", "--rtt-ms", str(rtt_ms),
                                       "--mbit", str(mbit), "--stats", self.stats],
                                      stdout=subprocess.PIPE, text=True)
        self.pport = int(self.proxy.stdout.readline().split()[1])

    def env(self):
        return {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.pport}",
                "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1",
                "AWS_ALLOW_HTTP": "true"}

    def down_bytes(self):
        time.sleep(0.12)
        return int(open(self.stats).read().split()[1])

    def stop(self):
        for p in (self.proxy, self.server):
            p.terminate()
            p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def kernel_erofs_time(meta, devs, mnt):
    """The workload on kernel EROFS over the local materialized copy, page cache dropped: the limit."""
    drop_caches()
    t = time.perf_counter()
    mount_erofs(meta, devs, mnt)
    try:
        timed(bwrap(mnt, IMPORT, ro=True))
        return time.perf_counter() - t
    finally:
        umount(mnt)


def bench_link(runs, rtt_ms, mbit, images=None, label="link"):
    """Beside eager, the *link floor*: kernel EROFS locally plus one round trip plus the time the link
    needs for the bytes strata fetched for the workload; and the eager tar.zst's download alone."""
    s3 = S3(rtt_ms, mbit)
    work = tempfile.mkdtemp(prefix="strata-cs-eager-", dir="/var/tmp")
    meta, devs = materialized("fat")
    mnt = tempfile.mkdtemp(prefix="strata-cs-erofs-", dir="/var/tmp")
    bps = float(mbit) * 1e6 / 8
    rows = []
    try:
        store = "s3://bench/strata"
        url = f"http://127.0.0.1:{s3.pport}/bench/fat.tar.zst"
        tarsize = os.path.getsize(f"{CS}/fat.tar.zst")
        for i in range(runs):
            got = []
            for image in arms(images or IMAGES, i):
                d = Daemon(store, env=s3.env(), **daemon_opts(image))
                try:
                    busy = wait_quiet()
                    drop_caches()
                    b0 = s3.down_bytes()
                    t = time.perf_counter()
                    sb = d.mount(image.split()[0], "s")
                    t_mount = time.perf_counter() - t
                    timed(bwrap(sb["rootfs"], IMPORT))
                    strata = time.perf_counter() - t
                    link_bytes = s3.down_bytes() - b0
                    got.append((image, strata, t_mount, link_bytes, d.sandbox("s"), busy))
                finally:
                    d.stop()
            root = f"{work}/root"
            shutil.rmtree(root, ignore_errors=True)
            os.makedirs(root)
            busy2 = wait_quiet()
            drop_caches()
            t = time.perf_counter()
            sh(f"curl -sf {url} | zstd -q -d | tar -x -C {root}")
            t_pull = time.perf_counter() - t
            timed(bwrap(root, IMPORT))
            ref = time.perf_counter() - t
            shutil.rmtree(root, ignore_errors=True)
            kernel = kernel_erofs_time(meta, devs, mnt)
            for image, strata, t_mount, link_bytes, sb, busy in got:
                floor = kernel + float(rtt_ms) / 1000 + sb["fetched_bytes"] / bps
                rows.append(record(label, i, image=image, strata=strata, strata_mount=t_mount, reference=ref,
                                   reference_pull=t_pull, link_bytes=link_bytes, fetched=sb["fetched_bytes"],
                                   stored=sb["image_bytes"], tar_zst=tarsize,
                                   link_fraction=link_bytes / sb["image_bytes"], kernel=kernel, link_floor=floor,
                                   eager_download=tarsize / bps, to_floor=strata / floor, busy=max(busy, busy2)))
    finally:
        s3.stop()
        shutil.rmtree(work, ignore_errors=True)
        os.rmdir(mnt)
    return summaries(label, rows, extra=("strata_mount", "reference_pull", "link_bytes", "fetched", "link_fraction",
                                        "kernel", "link_floor", "eager_download", "to_floor"), images=images)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", nargs="*", default=["all"])
    ap.add_argument("--runs", type=int)
    a = ap.parse_args()
    if a.what[:1] == ["serve"]:
        return serve(*a.what[1:3])
    what = set(a.what)
    if "all" in what:
        what = {"prepare", "local", "stat", "seq", "link"}
    for tool in (STRATA, STRATAD):
        if not os.access(tool, os.X_OK):
            sys.exit(f"no {tool}: cargo build --release -p strata-tools")
    log(f"results: {RESULTS}; stratad args: {EXTRA}; loadavg {os.getloadavg()}")
    prepare()
    # With `plan` too, also after the measurements made with the new plan (below).
    if "noplan" in what:
        drop_plan()
    if "plan" in what:
        make_plan()
    if "record" in what:
        record_plan()
    if "inherit" in what:
        make_inherit()
    if "local" in what:
        bench_local(a.runs or 5)
        if "inherit" in what:
            bench_local(a.runs or 5, ["fatws:v1"], "local-inherit")
    if "stat" in what:
        bench_stat(a.runs or 5)
    if "seq" in what:
        bench_seq(a.runs or 5)
    if "link" in what:
        if not os.access(LINKPROXY, os.X_OK):
            sys.exit(f"no {LINKPROXY}: cargo build --release -p strata-tests --bin linkproxy")
        rtt, mbit = os.environ.get("RTT_MS", "20"), os.environ.get("MBIT", "1000")
        bench_link(a.runs or 3, rtt, mbit)
        if "inherit" in what:
            bench_link(a.runs or 3, rtt, mbit, ["fatws:v1"], "link-inherit")
    if "noplan" in what and "plan" in what:
        drop_plan()


if __name__ == "__main__":
    sys.exit(main())

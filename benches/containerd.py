#!/usr/bin/env python3
"""containerd: time from a never-pulled image to its first line of output (issue 19's benchmark), strata's
lazy path against containerd's own overlayfs snapshotter, on the fat agent base of benches/make-fat.sh.

usage: sudo benches/containerd.py [prepare|local|link]... [--runs N]

  prepare  exports fat:v1 from the cold-start store ($BENCH_DATA/cs/store, made by `coldstart.py prepare`)
           with `strata export` (gzip layers carrying strata's annotations) and pushes it with skopeo into
           a docker-registry data directory under $BENCH_DATA/ctr/ (idempotent)
  local    the registry (and, for strata, its file:// store) on this machine
  plain    the same image exported without strata's annotations (`--no-strata-annotations`), which
           strata-snapshotter unpacks the normal way into its own overlay snapshots: the cost of one
           snapshotter for every image, against containerd's overlayfs snapshotter, locally
  link     the registry behind linkproxy (20 ms round trip, 1 Gbit/s) and stratad's store on s3:// through
           the object server of coldstart.py behind a linkproxy of its own (same figures)

Every run starts from nothing: a fresh containerd (new root: empty content store, no snapshots), a fresh
stratad (empty chunk cache) and strata-snapshotter, page cache dropped, then

  strata     `strata-snapshotter pull IMAGE` (the CRI plugin's pull: strata layers are mounted, never
             downloaded) and `ctr -n k8s.io run --rm --snapshotter strata IMAGE … python3 -c 'import numpy,
             pandas; print("ready")'`
  overlayfs  `ctr image pull --plain-http IMAGE` (content store, then unpacked into overlayfs snapshots)
             and `ctr run --rm IMAGE … (the same command)`

each timed from the pull's start to the first line the container prints. Bytes moved: what the registry's
proxy carried to the node, plus (strata) stratad's fetched bytes (`strata_fetched_bytes_total`). Results
as JSON lines in benches/results/containerd-<stamp>.jsonl (one per run, then a summary). Environment as in
coldstart.py (BENCH_DATA, CARGO_TARGET_DIR, QUIET_MAX, RTT_MS, MBIT); strata-snapshotter from
$CARGO_TARGET_DIR/release.
"""
import argparse, json, os, shutil, socket, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import coldstart  # noqa: E402
from coldstart import CS, D, LINKPROXY, STRATA, log, wait_quiet, drop_caches  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
CTR = f"{D}/ctr"
SNAPSHOTTER = f"{os.path.dirname(STRATA)}/strata-snapshotter"
STAMP = time.strftime("%Y-%m-%dT%H%MZ", time.gmtime())
coldstart.RESULTS = f"{HERE}/results/containerd-{STAMP}.jsonl"
REPO = "fat:v1"
PLAIN = "fat-plain:v1"
CMD = ["python3", "-c", "import numpy, pandas; print('ready', flush=True)"]


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_port(port, proc, what):
    for _ in range(600):
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen")


class Registry:
    """docker-registry on loopback over the prepared data, behind linkproxy (rtt_ms 0 and a very
    fast link locally, which only counts the bytes)."""

    def __init__(self, rtt_ms=0, mbit=100000):
        self.dir = tempfile.mkdtemp(prefix="strata-ctr-reg-", dir="/var/tmp")
        port = free_port()
        cfg = f"{self.dir}/config.yml"
        with open(cfg, "w") as f:
            f.write(f"version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\nstorage:\n"
                    f"  filesystem:\n    rootdirectory: {CTR}/registry\nhttp:\n  addr: 127.0.0.1:{port}\n")
        self.reg = subprocess.Popen(["docker-registry", "serve", cfg], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
        wait_port(port, self.reg, "docker-registry")
        self.stats = f"{self.dir}/stats"
        self.proxy = subprocess.Popen([LINKPROXY, "--target", f"127.0.0.1:{port}", "--rtt-ms", str(rtt_ms),
                                       "--mbit", str(mbit), "--stats", self.stats], stdout=subprocess.PIPE,
                                      text=True)
        self.host = f"127.0.0.1:{int(self.proxy.stdout.readline().split()[1])}"

    def down_bytes(self):
        time.sleep(0.12)
        try:
            return int(open(self.stats).read().split()[1])
        except (OSError, IndexError, ValueError):
            return 0

    def stop(self):
        for p in (self.proxy, self.reg):
            p.terminate()
            p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class Containerd:
    """containerd on its own root, with strata-snapshotter as the `strata` proxy plugin and the CRI
    plugin's snapshotter; `registry` reached over plain HTTP."""

    def __init__(self, snap_sock, registry):
        self.dir = tempfile.mkdtemp(prefix="strata-ctr-", dir="/var/tmp")
        self.sock = f"{self.dir}/containerd.sock"
        cfg = f"""version = 2
root = "{self.dir}/root"
state = "{self.dir}/state"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.internal.v1.opt", "io.containerd.tracing.processor.v1.otlp"]
[grpc]
  address = "{self.sock}"
[ttrpc]
  address = "{self.sock}.ttrpc"
[proxy_plugins]
  [proxy_plugins.strata]
    type = "snapshot"
    address = "{snap_sock}"
[plugins."io.containerd.grpc.v1.cri"]
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "strata"
    disable_snapshot_annotations = false
  [plugins."io.containerd.grpc.v1.cri".registry.mirrors."{registry}"]
    endpoint = ["http://{registry}"]
"""
        with open(f"{self.dir}/config.toml", "w") as f:
            f.write(cfg)
        self.log = open(f"{self.dir}/containerd.log", "w")
        self.p = subprocess.Popen(["containerd", "--config", f"{self.dir}/config.toml"],
                                  stdout=subprocess.DEVNULL, stderr=self.log)
        for _ in range(600):
            if os.path.exists(self.sock) and self.ctr("default", "version").returncode == 0:
                return
            time.sleep(0.05)
        raise RuntimeError("containerd did not start")

    def ctr(self, ns, *args, check=False):
        return subprocess.run(["ctr", "--address", self.sock, "-n", ns, *args], capture_output=True,
                              text=True, check=check)

    def first_line(self, ns, *args):
        """Runs `ctr … run …` and returns when the container printed its first line."""
        p = subprocess.Popen(["ctr", "--address", self.sock, "-n", ns, "run", "--rm", *args],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = p.stdout.readline()
        p.wait(timeout=600)
        if not line.strip():
            raise RuntimeError(f"container printed nothing: {p.stderr.read()}")
        return line.strip()

    def stop(self):
        for ns in ("default", "k8s.io"):
            for c in self.ctr(ns, "container", "ls", "-q").stdout.split():
                self.ctr(ns, "task", "kill", "-s", "SIGKILL", c)
                self.ctr(ns, "task", "rm", "-f", c)
                self.ctr(ns, "container", "rm", c)
            for s in self.ctr(ns, "snapshot", "--snapshotter", "strata", "ls").stdout.split("\n")[1:]:
                if s.split():
                    self.ctr(ns, "snapshot", "--snapshotter", "strata", "rm", s.split()[0])
        self.p.terminate()
        self.p.wait()
        self.log.close()
        subprocess.run(f"grep ' {self.dir}/' /proc/mounts | cut -d' ' -f2 | sort -r | xargs -r umount -l",
                       shell=True)
        shutil.rmtree(self.dir, ignore_errors=True)


class Snapshotter:
    def __init__(self, strata_sock):
        self.dir = tempfile.mkdtemp(prefix="strata-ctr-snap-", dir="/var/tmp")
        self.sock = f"{self.dir}/snapshotter.sock"
        self.p = subprocess.Popen([SNAPSHOTTER, "--address", self.sock, "--root", f"{self.dir}/root"],
                                  env={**os.environ, "STRATA_SOCKET": strata_sock, "RUST_LOG": "warn"},
                                  stdout=subprocess.DEVNULL)
        for _ in range(600):
            if os.path.exists(self.sock):
                return
            time.sleep(0.02)
        raise RuntimeError("strata-snapshotter did not start")

    def stop(self):
        self.p.terminate()
        self.p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def fetched_bytes(daemon):
    """stratad's `strata_fetched_bytes_total`, summed over blobs (its control socket's /metrics)."""
    s = socket.socket(socket.AF_UNIX)
    s.connect(daemon.sock)
    s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    text = b""
    while chunk := s.recv(65536):
        text += chunk
    s.close()
    return sum(float(line.split()[-1]) for line in text.decode().splitlines()
               if line.startswith("strata_fetched_bytes_total"))


def prepare():
    coldstart.prepare()
    if os.path.exists(f"{CTR}/pushed"):
        return
    os.makedirs(CTR, exist_ok=True)
    layout = f"{CTR}/oci"
    reg = Registry()
    try:
        for repo, flags in ((REPO, []), (PLAIN, ["--no-strata-annotations"])):
            shutil.rmtree(layout, ignore_errors=True)
            log(f"strata export {REPO} oci:{layout}:v1 {' '.join(flags)}")
            subprocess.run([STRATA, "--store", coldstart.STORE, "export", REPO, f"oci:{layout}:v1", *flags],
                           check=True, stdout=subprocess.DEVNULL)
            log(f"skopeo copy oci:{layout}:v1 docker://{reg.host}/{repo}")
            subprocess.run(["skopeo", "copy", "-q", "--dest-tls-verify=false", f"oci:{layout}:v1",
                            f"docker://{reg.host}/{repo}"], check=True)
    finally:
        reg.stop()
    shutil.rmtree(layout, ignore_errors=True)
    open(f"{CTR}/pushed", "w").close()


def run_strata(reg, store, env, repo=REPO):
    d = coldstart.Daemon(store, env=env)
    snap = Snapshotter(d.sock)
    ctd = Containerd(snap.sock, reg.host)
    try:
        image = f"{reg.host}/{repo}"
        busy = wait_quiet()
        drop_caches()
        b0 = reg.down_bytes()
        t = time.perf_counter()
        subprocess.run([SNAPSHOTTER, "pull", image, "--containerd", ctd.sock], check=True,
                       stdout=subprocess.DEVNULL)
        t_pull = time.perf_counter() - t
        ctd.first_line("k8s.io", "--snapshotter", "strata", image, "bench-strata", *CMD)
        total = time.perf_counter() - t
        content = ctd.ctr("k8s.io", "content", "ls", "-q").stdout.split()
        return dict(strata=total, strata_pull=t_pull, strata_registry_bytes=reg.down_bytes() - b0,
                    strata_store_bytes=fetched_bytes(d), strata_content_blobs=len(content), busy=busy)
    finally:
        ctd.stop()
        snap.stop()
        d.stop()


def run_overlayfs(reg, repo=REPO):
    # The snapshotter socket is named in the config but never used on this path.
    ctd = Containerd("/nonexistent/strata.sock", reg.host)
    try:
        image = f"{reg.host}/{repo}"
        busy = wait_quiet()
        drop_caches()
        b0 = reg.down_bytes()
        t = time.perf_counter()
        ctd.ctr("default", "image", "pull", "--plain-http", image, check=True)
        t_pull = time.perf_counter() - t
        ctd.first_line("default", image, "bench-overlay", *CMD)
        total = time.perf_counter() - t
        return dict(reference=total, reference_pull=t_pull, reference_bytes=reg.down_bytes() - b0,
                    busy2=busy)
    finally:
        ctd.stop()


def bench(label, runs, rtt_ms, mbit):
    rows = []
    s3 = coldstart.S3(rtt_ms, mbit) if label == "link" else None
    try:
        for i in range(runs):
            reg = Registry(rtt_ms, mbit) if label == "link" else Registry()
            repo = PLAIN if label == "plain" else REPO
            try:
                if s3:
                    a = run_strata(reg, "s3://bench/strata", s3.env())
                else:
                    a = run_strata(reg, coldstart.STORE, None, repo)
                b = run_overlayfs(reg, repo)
            finally:
                reg.stop()
            busy2 = b.pop("busy2")
            row = {**a, **b, "busy": max(a["busy"], busy2)}
            rows.append(coldstart.record(label, i, image=repo, **row))
    finally:
        if s3:
            s3.stop()
    return coldstart.summary(label, rows, extra=("strata_pull", "reference_pull", "strata_registry_bytes",
                                                 "strata_store_bytes", "reference_bytes"), image=PLAIN if label == "plain" else REPO)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", nargs="*", default=["prepare", "local"])
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    for tool in (STRATA, SNAPSHOTTER, LINKPROXY):
        if not os.access(tool, os.X_OK):
            sys.exit(f"no {tool}: cargo build --release -p strata-tools -p strata-snapshotter "
                     "-p strata-tests --bin linkproxy")
    log(f"results: {coldstart.RESULTS}")
    prepare()
    rtt, mbit = os.environ.get("RTT_MS", "20"), os.environ.get("MBIT", "1000")
    for label in ("local", "plain", "link"):
        if label in a.what:
            bench(label, a.runs, rtt, mbit)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Cold `import numpy, pandas` on the fat image through each store backend (issue 23's benchmark): a local
directory, MooseFS (scripts/cluster/moosefs: master and two chunk servers in a netns behind a bridge) and
Ceph's radosgw (scripts/cluster/ceph-s3), each from a fresh stratad (empty cache) on a node in its own
network namespace, against kernel EROFS on a local materialized copy; page cache dropped before each.

usage: sudo benches/backends.py RUNS [--host-ns]   (after: coldstart.py prepare)

The node: for every measurement a network namespace `strata-bk-node` (address NET.20/24 on a veth whose
host end is a port of the MooseFS cluster's bridge, like the simulated machines of tests/src/machines.rs),
in which stratad runs (`nsenter --net=...`: only the network namespace is the node's, so its mounts and
control socket are the host's and the import runs on the host, in bubblewrap, on the sandbox rootfs; what
crosses the namespace is the node's store traffic). Its store:
  local directory  file://$BENCH_DATA/cs/store, the same path;
  MooseFS          file://MOUNT/store, MOUNT the node's own `mfsmount`, started in the node's namespace for
                   this measurement (a fresh client: no client cache from the run before) and ended after;
  radosgw          s3://bench/strata at http://NET.1:RGW_PORT (radosgw also listens on the bridge address,
                   STRATA_CEPH_RGW_ALSO), not the host's loopback, which the namespace cannot reach.
`--host-ns` measures as before this: stratad in the host's namespace, MooseFS through the cluster's host
mount (a client that stays up, and warm, across runs), radosgw on loopback.

The clusters: read from /var/tmp/bk/mfs.env (the env lines of `scripts/cluster/moosefs start` with
STRATA_MFS_BRIDGE; /var/tmp/bk/mfs.mounts: its mount points) and /var/tmp/bk/ceph.env (those of
`scripts/cluster/ceph-s3 start`, plus STRATA_CEPH_RGW_ALSO=NET.1 for the node's namespace). A cluster whose
file is missing is started here, under /var/tmp/bk/{mfs,ceph} (MooseFS first: radosgw listens on its
bridge), with names, addresses and ports apart from the test tiers' (netns strata-bk-mfs, bridge
strata-bk-br, 10.23.9.0/24, Ceph ports 41889/41880), filled (S3 bucket `bench`; `strata copy fat:v1` into
file://MOUNT/store and s3://bench/strata) and stopped again at the end, its file removed. A cluster
started elsewhere must hold those already. Everything this starts is undone on exit, failure and SIGINT,
SIGTERM, SIGHUP included: the node's stratad, unmount, mfsmount (by PID), veth, namespace, clusters (by
the PIDs their scripts recorded). The node is also recorded in MFS_DIR/machines/strata-bk-node, so
`scripts/cluster/moosefs stop MFS_DIR` undoes it after a run killed outright.

Environment: STRATA, STRATAD (the release binaries: strata for `copy`, stratad for the node), BENCH_DATA.
Output: `RUN BACKEND SECONDS fetched BYTES` per measurement, `RUN kernel SECONDS`, then a table of medians;
lines starting with `#` say the setup, the load average before and after, and the bytes the node's veth
carried in each measurement (in: to the node; the node's mfsmount's own start included).
"""
import hashlib, hmac, os, shutil, signal, statistics, subprocess, sys, tempfile, time, urllib.error, urllib.parse, urllib.request
sys.path.insert(0, "/work/main/benches")
import stratad, coldstart
stratad.BIN["strata"] = os.environ.get("STRATA", stratad.BIN["strata"])
STRATAD = os.environ.get("STRATAD", stratad.BIN["stratad"])
HERE = os.path.dirname(os.path.abspath(__file__))
BK = "/var/tmp/bk"
NET, BRIDGE, MFS_NS = "10.23.9", "strata-bk-br", "strata-bk-mfs"
MON_PORT, RGW_PORT = "41889", "41880"
NODE_NS, NODE_HIF, NODE_NIF = "strata-bk-node", "strata-bk-nh", "strata-bk-nn"
BUCKET = "bench"

undo = []  # what to undo on exit, in reverse order


def log(*a):
    print("#", *a, flush=True)


def sh(argv, env=None, **kw):
    return subprocess.run(argv, check=True, env={**os.environ, **(env or {})}, **kw)


def envfile(path):
    return dict(l.strip().split("=", 1) for l in open(path) if "=" in l)


def ismount(p):
    return os.path.ismount(p)


def put_bucket(endpoint, bucket, access, secret, region="us-east-1"):
    """Creates `bucket` (an AWS SigV4-signed PUT; already there is fine): no boto3 or aws under sudo."""
    u = urllib.parse.urlsplit(endpoint)
    amzdate = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    payload = hashlib.sha256(b"").hexdigest()
    h = {"host": u.netloc, "x-amz-content-sha256": payload, "x-amz-date": amzdate}
    signed = ";".join(sorted(h))
    canon = "\n".join(["PUT", f"/{bucket}", "", *(f"{k}:{h[k]}" for k in sorted(h)), "", signed, payload])
    scope = f"{amzdate[:8]}/{region}/s3/aws4_request"
    k = ("AWS4" + secret).encode()
    for part in (amzdate[:8], region, "s3", "aws4_request"):
        k = hmac.new(k, part.encode(), hashlib.sha256).digest()
    sts = "\n".join(["AWS4-HMAC-SHA256", amzdate, scope, hashlib.sha256(canon.encode()).hexdigest()])
    sig = hmac.new(k, sts.encode(), hashlib.sha256).hexdigest()
    h["authorization"] = f"AWS4-HMAC-SHA256 Credential={access}/{scope}, SignedHeaders={signed}, Signature={sig}"
    req = urllib.request.Request(f"{endpoint}/{bucket}", method="PUT", headers=h)
    try:
        urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=30)
    except urllib.error.HTTPError as e:
        if e.code != 409:
            raise


def copy_fat(to, env=None):
    log("strata copy fat:v1 to", to)
    sh([stratad.BIN["strata"], "--store", coldstart.STORE, "--progress", "none", "copy", "fat:v1", "--to", to],
       env=env, stdout=subprocess.DEVNULL)


def start_moosefs():
    """A MooseFS cluster on bridge BRIDGE under BK/mfs (one host client, for the copy); its env lines."""
    d, script = f"{BK}/mfs", f"{HERE}/../scripts/cluster/moosefs"
    e = {"STRATA_MFS_BRIDGE": BRIDGE, "STRATA_MFS_NETNS": MFS_NS, "STRATA_MFS_NET": NET}
    undo.append(lambda: subprocess.run([script, "stop", d], env={**os.environ, **e}))
    out = sh([script, "start", d, "1"], env=e, stdout=subprocess.PIPE, text=True).stdout
    lines = dict(l.split("=", 1) for l in out.splitlines() if "=" in l)
    mounts = lines["STRATA_MFS_MOUNTS"].strip("'")
    copy_fat(f"file://{mounts.split()[0]}/store")
    open(f"{BK}/mfs.env", "w").write(out)
    open(f"{BK}/mfs.mounts", "w").write(mounts + "\n")
    undo.append(lambda: [os.unlink(f) for f in (f"{BK}/mfs.env", f"{BK}/mfs.mounts") if os.path.exists(f)])


def start_ceph():
    """A Ceph cluster with radosgw on loopback and on the bridge address under BK/ceph; its env lines."""
    d, script = f"{BK}/ceph", f"{HERE}/../scripts/cluster/ceph-s3"
    e = {"STRATA_CEPH_MON_PORT": MON_PORT, "STRATA_CEPH_RGW_PORT": RGW_PORT, "STRATA_CEPH_RGW_ALSO": f"{NET}.1"}
    undo.append(lambda: subprocess.run([script, "stop", d], env={**os.environ, **e}))
    out = sh([script, "start", d], env=e, stdout=subprocess.PIPE, text=True).stdout
    env = dict(l.split("=", 1) for l in out.splitlines() if "=" in l)
    put_bucket(env["STRATA_S3_ENDPOINT"], BUCKET, env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"])
    copy_fat(f"s3://{BUCKET}/strata", s3env(env, env["STRATA_S3_ENDPOINT"]))
    open(f"{BK}/ceph.env", "w").write(out + f"STRATA_CEPH_RGW_ALSO={NET}.1\n")
    undo.append(lambda: os.path.exists(f"{BK}/ceph.env") and os.unlink(f"{BK}/ceph.env"))


def s3env(env, endpoint):
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": env["AWS_ACCESS_KEY_ID"],
            "AWS_SECRET_ACCESS_KEY": env["AWS_SECRET_ACCESS_KEY"], "AWS_REGION": "us-east-1",
            "AWS_ALLOW_HTTP": "true"}


class Node:
    """The node's network namespace, address NET.20 on a veth into `bridge` (see the docstring); its own
    mfsmount of the volume at `master` if given (`mount`)."""

    def __init__(self, bridge, net, record, master=None):
        if os.path.exists(f"/run/netns/{NODE_NS}"):
            raise RuntimeError(f"network namespace {NODE_NS} exists already (another run? left over: "
                               f"`ip link del {NODE_HIF}; ip netns del {NODE_NS}`)")
        self.work = tempfile.mkdtemp(prefix="strata-bk-node-", dir="/var/tmp")
        self.record, self.mfsmount, self.mount = record, None, None
        if record:
            os.makedirs(record, exist_ok=True)
            self.note("netns", NODE_NS)
            self.note("hostif", NODE_HIF)
        try:
            sh(["ip", "netns", "add", NODE_NS])
            sh(["ip", "link", "add", NODE_HIF, "type", "veth", "peer", "name", NODE_NIF])
            sh(["ip", "link", "set", NODE_NIF, "netns", NODE_NS])
            sh(["ip", "link", "set", NODE_HIF, "master", bridge, "up"])
            sh(["ip", "-n", NODE_NS, "addr", "add", f"{net}.20/24", "dev", NODE_NIF])
            sh(["ip", "-n", NODE_NS, "link", "set", NODE_NIF, "up"])
            sh(["ip", "-n", NODE_NS, "link", "set", "lo", "up"])
            if master:
                self.mount = f"{self.work}/mfs"
                os.mkdir(self.mount)
                lf = open(f"{self.work}/mfsmount.log", "w")
                self.mfsmount = subprocess.Popen([*self.prefix, "mfsmount", "-f", self.mount, "-H", master, "-P",
                                                  "9421"], stdin=subprocess.DEVNULL, stdout=lf, stderr=lf)
                self.note("pid", str(self.mfsmount.pid))
                self.note("mount", self.mount)
                t = time.monotonic()
                while not ismount(self.mount):
                    if self.mfsmount.poll() is not None or time.monotonic() - t > 30:
                        raise RuntimeError(f"node mfsmount not up: {open(f'{self.work}/mfsmount.log').read()}")
                    time.sleep(0.05)
        except BaseException:
            self.close()
            raise

    prefix = ("nsenter", f"--net=/run/netns/{NODE_NS}", "--")

    def note(self, what, value, append=False):
        if self.record:
            with open(f"{self.record}/{what}", "a" if append else "w") as f:
                f.write(value + ("\n" if append else ""))

    def traffic(self):
        """Bytes the bridge sent the node and the node sent the bridge so far (its veth's host end)."""
        st = f"/sys/class/net/{NODE_HIF}/statistics"
        return int(open(f"{st}/tx_bytes").read()), int(open(f"{st}/rx_bytes").read())

    def close(self):
        if self.mount and ismount(self.mount):
            if subprocess.run(["umount", self.mount], stderr=subprocess.DEVNULL).returncode:
                subprocess.run(["umount", "-l", self.mount], stderr=subprocess.DEVNULL)
        if self.mfsmount:
            self.mfsmount.terminate()
            try:
                self.mfsmount.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.mfsmount.kill()
                self.mfsmount.wait()
        subprocess.run(["ip", "link", "del", NODE_HIF], stderr=subprocess.DEVNULL)
        subprocess.run(["ip", "netns", "del", NODE_NS], stderr=subprocess.DEVNULL)
        shutil.rmtree(self.work, ignore_errors=True)
        if self.record:
            shutil.rmtree(self.record, ignore_errors=True)


def loadavg():
    return open("/proc/loadavg").read().split()[:3]


def measure(runs, netns):
    os.makedirs(BK, exist_ok=True)
    if not os.path.exists(f"{BK}/mfs.mounts"):
        start_moosefs()
    if not os.path.exists(f"{BK}/ceph.env"):
        start_ceph()
    ceph = envfile(f"{BK}/ceph.env")
    mfs_host = open(f"{BK}/mfs.mounts").read().split()[0]
    if netns:
        if not os.path.exists(f"{BK}/mfs.env") or "STRATA_CEPH_RGW_ALSO" not in ceph:
            sys.exit(f"a node in its own namespace needs MooseFS on a bridge ({BK}/mfs.env: STRATA_MFS_BRIDGE, "
                     f"...) and radosgw on its address ({BK}/ceph.env: STRATA_CEPH_RGW_ALSO); or --host-ns")
        mfs = envfile(f"{BK}/mfs.env")
        bridge, net, master = mfs["STRATA_MFS_BRIDGE"], mfs["STRATA_MFS_NET"], mfs["STRATA_MFS_MASTER"]
        record = f"{mfs['STRATA_MFS_DIR']}/machines/{NODE_NS}"
        port = urllib.parse.urlsplit(ceph["STRATA_S3_ENDPOINT"]).port
        s3 = s3env(ceph, f"http://{ceph['STRATA_CEPH_RGW_ALSO']}:{port}")
        log(f"node: netns {NODE_NS}, {net}.20 on bridge {bridge}; MooseFS master {master}; radosgw "
            f"{s3['AWS_ENDPOINT_URL']}; stratad {STRATAD}")
        backends = [("local directory", lambda mnt: f"file://{coldstart.CS}/store", {}, False),
                    ("MooseFS (FUSE client in the node's netns, 2 chunk servers in another)",
                     lambda mnt: f"file://{mnt}/store", {}, True),
                    ("Ceph radosgw (S3, over the node's veth)", lambda mnt: f"s3://{BUCKET}/strata", s3, False)]
    else:
        log(f"node: the host's namespace; MooseFS host mount {mfs_host}; radosgw {ceph['STRATA_S3_ENDPOINT']}")
        backends = [("local directory", lambda mnt: f"file://{coldstart.CS}/store", {}, False),
                    ("MooseFS (FUSE client, 2 chunk servers in a netns)", lambda mnt: f"file://{mfs_host}/store", {},
                     False),
                    ("Ceph radosgw (S3)", lambda mnt: f"s3://{BUCKET}/strata", s3env(ceph, ceph["STRATA_S3_ENDPOINT"]),
                     False)]
    meta, devs = coldstart.materialized("fat")
    mnt = tempfile.mkdtemp(prefix="strata-bk-erofs-", dir="/var/tmp")
    undo.append(lambda: os.rmdir(mnt))
    log("load average before:", *loadavg())
    res = {}
    for r in range(runs):
        for name, store, e, own_mount in backends:
            node = Node(bridge, net, record, master if own_mount else None) if netns else None
            try:
                d = stratad.Daemon(store(node and node.mount), env=e, quiet=True, binary=STRATAD,
                                   prefix=node.prefix if node else ())
                if node:
                    node.note("stratad", str(d.pid), append=True)
                try:
                    coldstart.drop_caches()
                    t = time.perf_counter()
                    sb = d.mount("fat:v1", "s")
                    coldstart.timed(coldstart.bwrap(sb["rootfs"], coldstart.IMPORT))
                    el = time.perf_counter() - t
                    fetched = d.sandbox("s")["fetched_bytes"]
                finally:
                    d.stop()
                traffic = node and node.traffic()
            finally:
                if node:
                    node.close()
            res.setdefault(name, []).append(el)
            print(r, name, round(el, 3), "fetched", fetched, flush=True)
            if traffic:
                log(f"node veth: {traffic[0]} bytes in, {traffic[1]} out (whole measurement, daemon start to stop)")
        k = coldstart.kernel_erofs_time(meta, devs, mnt)
        res.setdefault("kernel EROFS, local copy", []).append(k)
        print(r, "kernel", round(k, 3), flush=True)
    log("load average after:", *loadavg())
    for k, v in res.items():
        print(f"| {k} | {statistics.median(v):.2f} s | {[round(x, 2) for x in v]} |")


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    flags = {a for a in sys.argv[1:] if a.startswith("--")}
    if len(args) != 1 or not args[0].isdigit() or flags - {"--host-ns"}:
        sys.exit(__doc__)

    def fatal(sig, _):
        raise SystemExit(128 + sig)
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, fatal)
    try:
        measure(int(args[0]), "--host-ns" not in flags)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while undo:
            try:
                undo.pop()()
            except Exception as e:
                print("# cleanup:", e, file=sys.stderr)


if __name__ == "__main__":
    main()

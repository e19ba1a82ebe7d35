#!/usr/bin/env python3
"""Cold `import numpy, pandas` on the fat image through each store backend (issue 23's benchmark): a local
directory, MooseFS (scripts/cluster/moosefs: master and chunk servers in a netns, a FUSE client on the
host) and Ceph's radosgw (scripts/cluster/ceph-s3), each from a fresh stratad (empty cache), against kernel
EROFS on a local materialized copy; page cache dropped before each.

usage: sudo benches/backends.py RUNS   (after: coldstart.py prepare; both clusters started, their env
lines in /var/tmp/bk/ceph.env and the MooseFS mount points in /var/tmp/bk/mfs.mounts; an S3 bucket
`bench`; `strata copy fat:v1` into s3://bench/strata and file://<mount>/store)
"""
import os, sys, time, statistics, tempfile, json
sys.path.insert(0, "/work/main/benches")
import stratad, coldstart
stratad.BIN["strata"] = os.environ.get("STRATA", stratad.BIN["strata"])
STRATAD = os.environ.get("STRATAD", stratad.BIN["stratad"])
env = dict(l.strip().split("=", 1) for l in open("/var/tmp/bk/ceph.env") if "=" in l)
s3env = {"AWS_ENDPOINT_URL": env["STRATA_S3_ENDPOINT"], "AWS_ACCESS_KEY_ID": env["AWS_ACCESS_KEY_ID"],
         "AWS_SECRET_ACCESS_KEY": env["AWS_SECRET_ACCESS_KEY"], "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}
mfs = open("/var/tmp/bk/mfs.mounts").read().split()[0]
backends = [("local directory", f"file://{coldstart.CS}/store", {}),
            ("MooseFS (FUSE client, 2 chunk servers in a netns)", f"file://{mfs}/store", {}),
            ("Ceph radosgw (S3)", "s3://bench/strata", s3env)]
meta, devs = coldstart.materialized("fat")
mnt = tempfile.mkdtemp(prefix="strata-bk-erofs-", dir="/var/tmp")
res = {}
for r in range(int(sys.argv[1])):
    for name, store, e in backends:
        d = stratad.Daemon(store, env=e, quiet=True, binary=STRATAD)
        try:
            coldstart.drop_caches()
            t = time.perf_counter()
            sb = d.mount("fat:v1", "s")
            coldstart.timed(coldstart.bwrap(sb["rootfs"], coldstart.IMPORT))
            el = time.perf_counter() - t
            fetched = d.sandbox("s")["fetched_bytes"]
        finally:
            d.stop()
        res.setdefault(name, []).append(el)
        print(r, name, round(el, 3), "fetched", fetched, flush=True)
    k = coldstart.kernel_erofs_time(meta, devs, mnt)
    res.setdefault("kernel EROFS, local copy", []).append(k)
    print(r, "kernel", round(k, 3), flush=True)
os.rmdir(mnt)
for k, v in res.items():
    print(f"| {k} | {statistics.median(v):.2f} s | {[round(x, 2) for x in v]} |")

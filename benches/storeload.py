#!/usr/bin/env python3
"""What cold starts cost the store (issue 23, point 5): N nodes — each a fresh stratad with an empty cache
and its own state — start a sandbox of the same never-seen image at once and run the workload in it
(`import numpy, pandas` on the fat image, as benches/coldstart.py); the store is an S3 endpoint on
loopback (coldstart.py's ObjectServer over the local store, counting every request by key class and
the bytes it sent). For N = 1, 2, 4, 8 it prints per-node time, and store requests and bytes in all and
per node, split into metadata objects (tags, manifests, layer descriptors, layer metadata, tables of
contents) and chunk range reads — the figures the scale model in BENCHMARKS.md is built from.

usage: sudo benches/storeload.py [--nodes 1,2,4,8] [--runs 1]
Needs `coldstart.py prepare` first (BENCH_DATA, default /var/tmp/strata-bench); release binaries from
$CARGO_TARGET_DIR, or $STRATA / $STRATAD. Appends JSON lines to benches/results/storeload-<stamp>.jsonl.
"""
import argparse, collections, http.server, json, os, shutil, socketserver, sys, tempfile, threading, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import coldstart  # noqa: E402
import stratad  # noqa: E402

stratad.BIN["strata"] = os.environ.get("STRATA", stratad.BIN["strata"])
STRATAD = os.environ.get("STRATAD", stratad.BIN["stratad"])


class Counts:
    """Requests and bytes sent, by key class, behind a lock (the server answers on many threads)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.reset()

    def reset(self):
        with self.lock:
            self.req = collections.Counter()
            self.bytes = collections.Counter()

    def add(self, cls, n):
        with self.lock:
            self.req[cls] += 1
            self.bytes[cls] += n

    def take(self):
        with self.lock:
            return dict(self.req), dict(self.bytes)


COUNTS = Counts()


def key_class(handler):
    """`tags`, `manifests`, `layers`, `meta` (the key's first segment under the store), and for blobs
    `toc` (a range read reaching the object's end: the table of contents and footer are its tail) or
    `chunks` (any other range read of a blob)."""
    path = handler.path.split("?")[0]
    parts = path.lstrip("/").split("/")
    k = parts[2] if len(parts) > 2 else "other"
    if k != "blobs":
        return k
    rng = handler.headers.get("Range")
    full = os.path.join(handler.root, path.lstrip("/"))
    try:
        size = os.path.getsize(full)
        end = rng.split("=", 1)[1].partition("-")[2] if rng else ""
        return "toc" if not end or int(end) + 1 >= size else "chunks"
    except (OSError, ValueError, IndexError):
        return "chunks"


class CountingServer(coldstart.ObjectServer):
    """coldstart.py's object server, counting what it sends."""

    def do_GET(self):
        self.sent_len = 0
        super().do_GET()
        COUNTS.add(key_class(self), self.sent_len)

    def send_header(self, k, v):
        if k == "Content-Length" and self.command == "GET":
            self.sent_len = int(v)
        super().send_header(k, v)


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True


def start_server(root):
    CountingServer.root = root
    s = Server(("127.0.0.1", 0), CountingServer)
    threading.Thread(target=s.serve_forever, daemon=True).start()
    return s


def one_round(n, env, store):
    ds = [stratad.Daemon(store, env=env, quiet=True, binary=STRATAD) for _ in range(n)]
    try:
        coldstart.drop_caches()
        COUNTS.reset()
        times = [None] * n

        def node(i):
            t = time.perf_counter()
            sb = ds[i].mount("fat:v1", "s")
            coldstart.timed(coldstart.bwrap(sb["rootfs"], coldstart.IMPORT))
            times[i] = time.perf_counter() - t

        ths = [threading.Thread(target=node, args=(i,)) for i in range(n)]
        t0 = time.perf_counter()
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        wall = time.perf_counter() - t0
        req, byts = COUNTS.take()
        fetched = [d.sandbox("s")["fetched_bytes"] for d in ds]
    finally:
        for d in ds:
            d.stop()
    return {"nodes": n, "wall": wall, "node_median": sorted(times)[n // 2], "node_max": max(times),
            "requests": req, "bytes": byts, "requests_total": sum(req.values()),
            "bytes_total": sum(byts.values()), "fetched_per_node": fetched}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="1,2,4,8")
    ap.add_argument("--runs", type=int, default=1)
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="strata-storeload-", dir="/var/tmp")
    os.makedirs(f"{work}/root/bench")
    os.symlink(f"{coldstart.CS}/store", f"{work}/root/bench/strata")
    srv = start_server(f"{work}/root")
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{srv.server_address[1]}", "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}
    os.makedirs(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"), exist_ok=True)
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                       f"storeload-{time.strftime('%Y-%m-%dT%H%M%S')}.jsonl")
    try:
        for r in range(a.runs):
            for n in [int(x) for x in a.nodes.split(",")]:
                row = one_round(n, env, "s3://bench/strata")
                row["run"] = r
                with open(out, "a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"N={n}: wall {row['wall']:.2f} s, per node median {row['node_median']:.2f} s "
                      f"(max {row['node_max']:.2f}); store: {row['requests_total']} requests "
                      f"({row['requests_total'] / n:.0f}/node), {row['bytes_total'] / 1e6:.1f} MB "
                      f"({row['bytes_total'] / n / 1e6:.1f} MB/node); by class {row['requests']} "
                      f"{ {k: round(v / 1e6, 2) for k, v in row['bytes'].items()} } MB", flush=True)
    finally:
        srv.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    print(f"results: {out}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Teardown against creation: N sandboxes of one image created through the control socket and through
the CLI, then removed through the API's batch delete (`POST /v1/sandboxes/delete`) and through the CLI in
one call (`strata rm ID…`) — and, for comparison, one request or one `strata rm` per sandbox.

usage: sudo benches/teardown.py [--n 200] [--dir /var/tmp]
Binaries: $CARGO_TARGET_DIR/release/{strata,stratad} (or STRATA_BIN_DIR); needs busybox-static.
A daemon without the batch endpoint (older) gets its batch rows skipped.
"""
import argparse, os, shutil, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stratad  # noqa: E402

if os.environ.get("STRATA_BIN_DIR"):
    for b in ("strata", "stratad"):
        stratad.BIN[b] = os.path.join(os.environ["STRATA_BIN_DIR"], b)
BIN, Daemon = stratad.BIN, stratad.Daemon


def timed(f):
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--dir", default="/var/tmp")
    a = ap.parse_args()
    n = a.n
    work = tempfile.mkdtemp(prefix="strata-teardown-", dir=a.dir)
    store = f"file://{work}/store"
    root = f"{work}/rootfs"
    os.makedirs(f"{root}/bin")
    shutil.copy("/bin/busybox", f"{root}/bin/busybox")
    subprocess.run([BIN["strata"], "--store", store, "build", root, "-t", "teardown:v1"], check=True,
                   stdout=subprocess.DEVNULL)
    d = Daemon(store, work=work, quiet=True)
    cli = [BIN["strata"], "--socket", d.sock]
    ids = lambda p: [f"{p}{i}" for i in range(n)]  # noqa: E731
    rows = []

    def api_create(p):
        for i in ids(p):
            d.call("POST", "/v1/sandboxes", {"image": "teardown:v1", "id": i})

    def cli_create(p):
        subprocess.run(cli + ["mount", "teardown:v1"] + [x for i in ids(p) for x in ("--sandbox", i)],
                       check=True, stdout=subprocess.DEVNULL)

    try:
        d.call("POST", "/v1/sandboxes", {"image": "teardown:v1", "id": "keep"})  # layer stays mounted
        rows.append(("create, API, one request each", timed(lambda: api_create("a"))))
        try:
            t = timed(lambda: d.call("POST", "/v1/sandboxes/delete", {"ids": ids("a"), "purge": True}))
            rows.append(("rm, API batch (POST /v1/sandboxes/delete)", t))
        except RuntimeError as e:
            print(f"no batch endpoint: {e}", file=sys.stderr)
            rows.append(("rm, API, one DELETE ?purge=1 each",
                         timed(lambda: [d.call("DELETE", f"/v1/sandboxes/{i}?purge=1") for i in ids("a")])))
        rows.append(("create, CLI, one `strata mount` call", timed(lambda: cli_create("b"))))
        rows.append(("rm, CLI, one `strata rm ID…` call",
                     timed(lambda: subprocess.run(cli + ["rm"] + ids("b"), check=True,
                                                  stdout=subprocess.DEVNULL))))
        api_create("c")
        rows.append(("rm, CLI, one `strata rm ID` per sandbox",
                     timed(lambda: [subprocess.run(cli + ["rm", i], check=True, stdout=subprocess.DEVNULL)
                                    for i in ids("c")])))
        api_create("e")
        rows.append(("umount, API, one DELETE each (stop, upper kept)",
                     timed(lambda: [d.call("DELETE", f"/v1/sandboxes/{i}") for i in ids("e")])))
        subprocess.run(cli + ["rm", "--stopped"], check=True, stdout=subprocess.DEVNULL)
    finally:
        d.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"{n} sandboxes; {BIN['stratad']}")
    for what, t in rows:
        print(f"{what:<52} {t:7.3f} s  {t / n * 1e3:7.2f} ms/sandbox")


if __name__ == "__main__":
    main()

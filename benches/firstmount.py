#!/usr/bin/env python3
"""A layer's first mount, A/B: arms NAME=STRATAD@STORE[#IMAGE] (a stratad binary, a store URL, an image:
default $IMAGE or fat:v1), alternated in every round; each measurement is a fresh stratad (empty state),
the page cache dropped, then one sandbox of the image created. Prints per measurement and as medians: the metadata step (stratad's own
timer, its debug line "layer metadata fetched": the object read, decompressed, checked and written; the
longest one for an image of several layers) and the sandbox request's wall time.

usage: sudo benches/firstmount.py ROUNDS NAME=STRATAD@STORE[#IMAGE]...
e.g.   sudo benches/firstmount.py 8 main=/tmp/stratad-main@file:///var/tmp/strata-bench/cs/store \\
            new=/var/tmp/strata-target/release/stratad@file:///var/tmp/strata-bench/cs/store
Needs the data of benches/coldstart.py (`coldstart.py prepare`).
"""
import os, re, statistics, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import coldstart  # noqa: E402
import stratad  # noqa: E402

IMAGE = os.environ.get("IMAGE", "fat:v1")


def once(binary, store, image):
    """One first mount: (metadata step ms, request wall ms)."""
    with tempfile.NamedTemporaryFile(prefix="strata-firstmount-", dir="/var/tmp") as log:
        env = {"STRATA_LOG": "warn,strata_fs::control=debug", "NO_COLOR": "1"}
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)  # stratad's log, to read its timer
        try:
            d = stratad.Daemon(store, env=env, binary=binary)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        try:
            coldstart.wait_quiet()
            coldstart.drop_caches()
            t = time.perf_counter()
            d.mount(image, "s")
            wall = (time.perf_counter() - t) * 1e3
        finally:
            d.stop()
        text = re.sub(r"\x1b\[[0-9;]*m", "", open(log.name).read())
    steps = [float(m) for m in re.findall(r"layer metadata fetched.*?ms=([0-9.]+)", text)]
    if not steps:
        raise RuntimeError(f"no metadata timer in stratad's log:\n{text[-2000:]}")
    return max(steps), wall


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    rounds = int(sys.argv[1])
    arms = [a.split("=", 1) for a in sys.argv[2:]]
    got = {name: [] for name, _ in arms}
    for r in range(rounds):
        for name, spec in arms:
            binary, store = spec.split("@", 1)
            store, _, image = store.partition("#")
            meta, wall = once(binary, store, image or IMAGE)
            got[name].append((meta, wall))
            print(f"round {r} {name}: metadata {meta:.1f} ms, mount {wall:.1f} ms", flush=True)
    for name, v in got.items():
        print(f"{name}: metadata median {statistics.median(x[0] for x in v):.1f} ms, "
              f"mount median {statistics.median(x[1] for x in v):.1f} ms (n={len(v)})")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""A/B of stratad binaries on the same data and machine, alternating A and B in every round (so that a
machine that gets busier or quieter during the run moves both alike): the warm sequential read and the cold
import of benches/coldstart.py, each from a fresh daemon.

  seq     mount big:v1, `dd bs=1M` of its 1 GiB file (cold: chunks fetched from the file:// store), then
          twice more after dropping the page cache (warm: chunks read from stratad's chunk cache)
  import  mount fat:v1 on a fresh daemon (empty chunk cache), page cache dropped, and run
          `python3 -c 'import numpy, pandas'` in it with bubblewrap: the time of both

usage: sudo benches/abtest.py seq|import ROUNDS NAME=STRATAD[@MODE] NAME=STRATAD[@MODE]...
An arm is a stratad binary, optionally with the `--mount-mode` it runs in (`new=/tmp/stratad@fanotify`;
default: the binary's own default): two binaries, two modes, or both. Needs the data of
benches/coldstart.py (`coldstart.py prepare`). Prints every measurement (and the `fanotify` counters of
`GET /v1/status` in that mode), then medians.
"""
import os, statistics, subprocess, sys, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stratad  # noqa: E402

D = os.environ.get("BENCH_DATA", "/var/tmp/strata-bench")
STORE = f"file://{D}/cs/store"
IMPORT = ["python3", "-c", "import numpy, pandas"]


def drop_caches():
    subprocess.run(["sync"], check=True)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")


def timed(argv):
    t = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True)
    return time.perf_counter() - t


def seq(d):
    f = f"{d.mount('big:v1', 's')['rootfs']}/data"
    drop_caches()
    out = {"cold": timed(["dd", f"if={f}", "of=/dev/null", "bs=1M"])}
    for i in range(2):
        drop_caches()
        out[f"warm{i}"] = timed(["dd", f"if={f}", "of=/dev/null", "bs=1M"])
    return out


def cold_import(d):
    drop_caches()
    t = time.perf_counter()
    root = d.mount("fat:v1", "s")["rootfs"]
    subprocess.run(["bwrap", "--bind", root, "/", "--proc", "/proc", "--dev", "/dev", "--unshare-pid",
                    "--die-with-parent", "--", *IMPORT], check=True, capture_output=True)
    return {"import": time.perf_counter() - t}


def main():
    if len(sys.argv) < 5 or sys.argv[1] not in ("seq", "import"):
        sys.exit(__doc__)
    bench = seq if sys.argv[1] == "seq" else cold_import
    rounds = int(sys.argv[2])
    arms = {}
    for a in sys.argv[3:]:
        name, spec = a.split("=", 1)
        binary, _, mode = spec.partition("@")
        arms[name] = (binary, ["--mount-mode", mode] if mode else [])
    res = {name: {} for name in arms}
    for r in range(rounds):
        order = list(arms) if r % 2 == 0 else list(arms)[::-1]
        for name in order:
            binary, args = arms[name]
            d = stratad.Daemon(STORE, args=args, quiet=True, binary=binary)
            try:
                got = bench(d)
                fan = (d.call("GET", "/v1/status") or {}).get("fanotify")
            finally:
                d.stop()
            for k, v in got.items():
                res[name].setdefault(k.rstrip("01"), []).append(v)
            print(r, name, {k: round(v, 3) for k, v in got.items()}, fan or "", flush=True)
    for name, m in res.items():
        print(name, {k: f"median {statistics.median(v):.3f}s of {len(v)}" for k, v in m.items()})


if __name__ == "__main__":
    main()

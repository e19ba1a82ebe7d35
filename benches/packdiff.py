#!/usr/bin/env python3
"""pack_diff benchmark: a sandbox's delta packed as a layer, against `tar -cf - UPPER | zstd -3 -T0` of the
same upper directory in the same run; then restore-as-new-sandbox latency.

Images: `venv` (benches/make-data.sh: a python venv with numpy and pandas, ~168 MiB, 7.4k entries) and
`venv10`, ten copies of it whose every regular file is prefixed with the copy's number (so no chunk is
shared: ten times the entries, bytes, chunks and metadata). Deltas, written through the sandbox's merged
rootfs: 60 % new files of 64 KiB to 4 MiB (half random, half text), 20 % image files rewritten with a
line appended (copy-up), 20 % small files of 4 to 16 KiB (a pip install's shape), and 50 image files
deleted. pack_diff runs with a warm page cache (the agent just wrote the files), as does tar.

usage: sudo benches/packdiff.py [--runs 3] [--deltas 10,200] [--data /var/tmp/strata-bench]
Needs the release build ($CARGO_TARGET_DIR/release/{strata,stratad,pack_diff}).
"""
import argparse, json, os, random, shutil, statistics, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stratad import BIN, Daemon  # noqa: E402

MiB = 1 << 20


def make_big(src, dst, copies):
    """`copies` copies of `src`, each regular file prefixed with the copy number."""
    if os.path.exists(f"{dst}/.done"):
        return
    shutil.rmtree(dst, ignore_errors=True)
    for i in range(copies):
        base = f"{dst}/c{i}"
        for d, dirs, files in os.walk(src):
            rel = os.path.relpath(d, src)
            os.makedirs(os.path.join(base, rel), exist_ok=True)
            for f in files + [x for x in dirs if os.path.islink(os.path.join(d, x))]:
                s, t = os.path.join(d, f), os.path.join(base, rel, f)
                if os.path.islink(s):
                    os.symlink(os.readlink(s), t)
                elif os.path.isfile(s):
                    with open(s, "rb") as a, open(t, "wb") as b:
                        b.write(str(i).encode())
                        shutil.copyfileobj(a, b, 1 << 20)
                    shutil.copymode(s, t)
    open(f"{dst}/.done", "w").close()


def write_delta(root, size, seed, image_files):
    rng = random.Random(seed)
    written = 0
    os.makedirs(f"{root}/work/new", exist_ok=True)
    n = 0
    while written < size * 0.6:
        k = rng.randint(64 << 10, 4 * MiB)
        data = rng.randbytes(k) if n % 2 else (b"line of text %d\n" % n) * (k // 16)
        with open(f"{root}/work/new/f{n}", "wb") as f:
            f.write(data)
        written += len(data)
        n += 1
    mod = 0
    files = list(image_files)
    rng.shuffle(files)
    for p in files:
        if mod >= size * 0.2:
            break
        full = f"{root}/{p}"
        with open(full, "ab") as f:
            f.write(b"\n# changed by the agent\n")
        mod += os.path.getsize(full)
    small = 0
    os.makedirs(f"{root}/work/site-packages/pkg", exist_ok=True)
    while small < size * 0.2:
        k = rng.randint(4 << 10, 16 << 10)
        with open(f"{root}/work/site-packages/pkg/m{small}.py", "wb") as f:
            f.write((b"def f%d(): return %d\n" % (k, k)) * (k // 24))
        small += k
    for p in files[-50:]:
        os.unlink(f"{root}/{p}")


def du(path):
    return int(subprocess.run(["du", "-sb", path], capture_output=True, text=True).stdout.split()[0])


def image_files(tree, limit=4000):
    out = []
    for d, _, files in os.walk(tree):
        for f in files:
            p = os.path.join(d, f)
            if os.path.isfile(p) and not os.path.islink(p) and os.path.getsize(p) < 2 * MiB:
                out.append(os.path.relpath(p, tree))
    out.sort()
    return out[:limit]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--deltas", default="10,200")
    ap.add_argument("--data", default=os.environ.get("BENCH_DATA", "/var/tmp/strata-bench"))
    a = ap.parse_args()
    venv = f"{a.data}/venv"
    if not os.path.isdir(venv):
        sys.exit(f"{venv} missing: run benches/make-data.sh first")
    make_big(venv, f"{a.data}/venv10", 10)
    work = tempfile.mkdtemp(prefix="strata-packdiff-", dir="/var/tmp")
    store = f"file://{work}/store"
    env = dict(os.environ, STRATA_STORE=store)
    for tag, tree in (("venv:v1", venv), ("venv10:v1", f"{a.data}/venv10")):
        subprocess.run([BIN["strata"], "build", tree, "-t", tag], env=env, check=True,
                       stdout=subprocess.DEVNULL)
    d = Daemon(store, work=work, quiet=True)
    env["STRATA_SOCKET"] = d.sock
    call = d.call
    rows = []
    try:
        files = {"venv:v1": image_files(venv), "venv10:v1": ["c0/" + p for p in image_files(venv)]}
        cases = [("venv:v1", int(x)) for x in a.deltas.split(",")] + [("venv10:v1", 10)]
        for image, mib in cases:
            pd, tz, restore_cold, restore_warm, stored, upper_b, tar_b = [], [], [], [], [], [], []
            for r in range(a.runs):
                sb = f"{image.split(':')[0]}-{mib}-{r}"
                rootfs = call("POST", "/v1/sandboxes", {"image": image, "id": sb})["rootfs"]
                write_delta(rootfs, mib * MiB, r, files[image])
                upper = call("GET", f"/v1/sandboxes/{sb}")["upper"]
                subprocess.run(["sync"])
                upper_b.append(du(upper))
                t = time.time()
                out = subprocess.run([BIN["pack_diff"], "--sandbox", sb, "-t", f"snap:{sb}", "--json"],
                                     env=env, check=True, capture_output=True, text=True).stdout
                pd.append(time.time() - t)
                stored.append(json.loads(out)["stats"]["stored_bytes"])
                tarf = f"{work}/upper.tar.zst"
                t = time.time()
                subprocess.run(f"tar -cf - -C {upper} . | zstd -q -3 -T0 > {tarf}", shell=True, check=True)
                tz.append(time.time() - t)
                tar_b.append(os.path.getsize(tarf))
                os.unlink(tarf)
                for i in range(4):
                    t = time.time()
                    call("POST", "/v1/sandboxes", {"image": f"snap:{sb}", "id": f"{sb}-r{i}"})
                    (restore_cold if i == 0 else restore_warm).append(time.time() - t)
                for i in range(4):
                    call("DELETE", f"/v1/sandboxes/{sb}-r{i}")
                call("DELETE", f"/v1/sandboxes/{sb}")
            med = statistics.median
            rows.append({
                "image": image, "delta_mib": mib, "upper_bytes": med(upper_b),
                "pack_diff_s": med(pd), "tar_zstd_s": med(tz), "ratio": med([p / z for p, z in zip(pd, tz)]),
                "s_per_100mib": med(pd) / (med(upper_b) / (100 * MiB)),
                "stored_bytes": med(stored), "tar_zstd_bytes": med(tar_b),
                "restore_first_ms": med(restore_cold) * 1000, "restore_next_ms": med(restore_warm) * 1000,
                "runs": {"pack_diff": pd, "tar_zstd": tz},
            })
            print(json.dumps(rows[-1]), flush=True)
        lines = ["| image | delta (upper dir) | pack_diff s | tar\\|zstd s | ratio | s per 100 MiB | stored / tar.zst | "
                 "restore: first / next sandbox |", "|---|---|---:|---:|---:|---:|---|---|"]
        for x in rows:
            lines.append(f"| {x['image']} | {x['delta_mib']} MiB ({x['upper_bytes'] / MiB:.1f} MiB) | "
                  f"{x['pack_diff_s']:.2f} | {x['tar_zstd_s']:.2f} | {x['ratio']:.2f}x | "
                  f"{x['s_per_100mib']:.2f} | {x['stored_bytes'] / MiB:.1f} / {x['tar_zstd_bytes'] / MiB:.1f} MiB | "
                  f"{x['restore_first_ms']:.0f} / {x['restore_next_ms']:.0f} ms |")
        print("\n".join(lines))
        stamp = time.strftime("%Y-%m-%dT%H%MZ", time.gmtime())
        out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"packdiff-{stamp}.md")
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n\n" + "\n".join(json.dumps(x) for x in rows) + "\n")
    finally:
        d.stop()


if __name__ == "__main__":
    sys.exit(main())

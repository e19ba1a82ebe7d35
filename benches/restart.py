#!/usr/bin/env python3
"""Node daemon survival benchmark (issue 10): the longest read stall and the failed reads that sandboxes
see when stratad's server dies (`kill -9`: the descriptor holder starts a successor on the same FUSE
connection) and when it is upgraded (`strata daemon upgrade`, the same binary installed again at stratad's
path by copy and rename just before).

usage: sudo benches/restart.py [--runs N] [--sandboxes 1000] [--readers 20] [--kills 5] [--upgrades 3]
                              [--pause 0.02] [--gap 8] [--warmup 15] [--drop-every 3] [--quiet-max 60]
       sudo benches/restart.py --startup N [--sandboxes 1000]   (the successor's start alone, see startup())

Each run: a fresh stratad (own state and runtime directories under /var/tmp/strata-bench-restart-*:
empty chunk cache) on the fat image's local store (benches/make-fat.sh, built into the store the way
`coldstart.py prepare` does, shared with it); SANDBOXES sandboxes of `fat:v1` created through the control
socket and held; READERS of them read by one process each. A reader reads its fixed list of files of the
image through the sandbox's rootfs in a loop (40 files: 32 under 64 KiB, 6 up to 1 MiB, 2 up to 16 MiB),
each file opened, read whole and checksummed (SHA-256, against the same file of the source tree), plus
per round a few files it has never read (its own slice of the image: their chunks are fetched from the
store, not the chunk cache), with PAUSE seconds between files. The page cache is dropped every DROP_EVERY
seconds and 0.2 s before each event, so reads in flight at the event reach the daemon (chunk cache or
store) and not only the page cache. After WARMUP seconds, KILLS `kill -9`s of the server and UPGRADES
upgrades, interleaved, GAP to 1.5 GAP seconds apart (random moments), each after a second in which no
process outside the benchmark used more than 10 % of a core (waiting up to QUIET_MAX s; what was busy is
recorded with the event: the machine is shared).

Per event: `ready_s`, from the kill (or the start of `strata daemon upgrade`) to the new server answering
`GET /v1/status` with a new pid (polled every 5 ms by this script); the longest single file read (open +
read + close) among the reads that overlap the window [event, ready + 2 s] (`stall_s`: nothing
subtracted), the reads that failed and the wrong checksums in it, the reads in flight at the event, the
requests the kernel resent to the new server (`fuse.resent` of its status). Outside every event's window
[event - 0.5 s, ready + 2 s], after the warm-up: the median, p99 and longest read. Also, before each event
and at the end: RSS, open descriptors and threads of the holder and the server (leaks show as growth), the
processes under the holder, mounts under the run's directory before and after teardown (SIGTERM to the
holder).

JSON lines (one per event, one per run, one summary) go to benches/results/restart-<stamp>.jsonl, the
daemon's log (STRATA_LOG=info; colour codes removed and the per-sandbox lines counted, not kept) to
benches/results/restart-<stamp>.log; a table is printed. The strata and stratad binaries are copied once
at the start (a build in the shared target directory during the run changes nothing). Environment:
BENCH_DATA (/var/tmp/strata-bench), CARGO_TARGET_DIR (/var/tmp/strata-target) for the release strata and
stratad, QUIET_MAX.
"""
import argparse, hashlib, json, multiprocessing, os, random, shutil, signal, statistics, stat, subprocess, sys
import tempfile, threading, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stratad  # noqa: E402
from stratad import BIN, call  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
D = os.environ.get("BENCH_DATA", "/var/tmp/strata-bench")
CS = f"{D}/cs"  # shared with coldstart.py: the fat image is built once into this store
STORE = f"file://{CS}/store"
SRC = f"{D}/fat"
STAMP = time.strftime("%Y-%m-%dT%H%MZ", time.gmtime())
RESULTS = f"{HERE}/results/restart-{STAMP}.jsonl"
LOG = f"{HERE}/results/restart-{STAMP}.log"
POST = 2.0  # seconds after the new server answers that still belong to the event
PRE = 0.5   # seconds before the event excluded from "outside events"


def log(*a):
    print("[restart]", *a, file=sys.stderr, flush=True)


def emit(row):
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "a") as f:
        f.write(json.dumps(row) + "\n")
    return row


# ---------------------------------------------------------------- machine state

def rustc_running():
    """Command lines of rustc processes now (builds share the 2 cores)."""
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if open(f"/proc/{p}/comm").read().strip() == "rustc":
                    out.append(int(p))
            except OSError:
                pass
    return out


def cpu_times():
    v = [int(x) for x in open("/proc/stat").readline().split()[1:9]]
    return v[3] + v[4], sum(v)


def proc_info(pid):
    """RSS (bytes), open descriptors and threads of a process; None if it is gone."""
    try:
        rss = threads = 0
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
        return dict(rss=rss, fds=len(os.listdir(f"/proc/{pid}/fd")), threads=threads)
    except OSError:
        return None


def children(pid):
    """(pid, comm, state) of the processes whose parent is `pid`."""
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            s = open(f"/proc/{p}/stat").read()
        except OSError:
            continue
        comm = s[s.index("(") + 1:s.rindex(")")]
        f = s[s.rindex(")") + 2:].split()
        if int(f[1]) == pid:
            out.append((int(p), comm, f[0]))
    return out


def cpu_ticks():
    """{pid: (comm, parent, utime + stime ticks)} of every process now."""
    out = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            st = open(f"/proc/{p}/stat").read()
        except OSError:
            continue
        f = st[st.rindex(")") + 2:].split()
        out[int(p)] = (st[st.index("(") + 1:st.rindex(")")], int(f[1]), int(f[11]) + int(f[12]))
    return out


def foreign_busy(t0, t1, seconds):
    """Processes outside this benchmark's own tree (this process, its readers, stratad, the CLI) that used
    more than 10 % of a core between two `cpu_ticks` snapshots: [(comm, pid, % of a core)]. Kernel threads
    are left out."""
    me = os.getpid()

    def mine(pid):
        seen = 0
        while pid > 1 and seen < 64:
            if pid == me:
                return True
            pid = t1.get(pid, t0.get(pid, ("", 0, 0)))[1]
            seen += 1
        return False
    hz = os.sysconf("SC_CLK_TCK")
    out = []
    for pid, (comm, parent, ticks) in t1.items():
        if pid == 2 or parent == 2:
            continue  # kernel threads: flushing, reclaim — work this benchmark causes as much as anyone
        pct = 100.0 * (ticks - t0.get(pid, (comm, 0, 0))[2]) / hz / max(seconds, 1e-3)
        if pct > 10 and not mine(pid):
            out.append((comm, pid, round(pct)))
    return sorted(out, key=lambda x: -x[2])


def wait_foreign_quiet(limit):
    """Waits, up to `limit` seconds, for a second in which no process outside this benchmark used more
    than 10 % of a core (builds and tests of others share the machine); returns what was busy in the last
    second looked at (empty: quiet) and the seconds waited."""
    start = time.monotonic()
    while True:
        t0, m0 = cpu_ticks(), time.monotonic()
        time.sleep(1.0)
        busy = foreign_busy(t0, cpu_ticks(), time.monotonic() - m0)
        if not busy or time.monotonic() - start > limit:
            return busy, round(time.monotonic() - start, 1)


def mounts_under(prefix):
    return sum(1 for line in open("/proc/self/mountinfo") if line.split()[4].startswith(prefix))


def drop_caches():
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


# ---------------------------------------------------------------- the image

def prepare():
    """The fat image in the local store, made as `coldstart.py prepare` makes it (same marker, same
    store), so that the two benchmarks share one build."""
    if not os.path.exists(f"{D}/fat.done"):
        sys.exit(f"missing {SRC}: run benches/make-fat.sh first")
    os.makedirs(CS, exist_ok=True)
    if not os.path.exists(f"{CS}/fat.built"):
        log(f"strata build {SRC} -t fat:v1 --kind base")
        subprocess.run(f"{BIN['strata']} --store {STORE} build {SRC} -t fat:v1 --kind base --json "
                       f"> {CS}/fat.build.json", shell=True, check=True)
        open(f"{CS}/fat.built", "w").close()


def plan_present():
    tag = open(f"{CS}/store/tags/fat/v1").read().strip()
    return os.path.exists(f"{CS}/store/plans/by-manifest/{tag.split(':', 1)[1]}")


def regular_files():
    """(relative path, size) of every regular file of the source tree, sorted."""
    out = []
    for dirpath, _, names in os.walk(SRC):
        for n in names:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode) and st.st_size > 0:
                out.append((os.path.relpath(p, SRC), st.st_size))
    out.sort()
    return out


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while True:
            b = f.read(1 << 20)
            if not b:
                return h.hexdigest()
            h.update(b)


def plan_files(readers, seed):
    """Per reader: a fixed list (40 files) and a pool of files no one else reads (fresh reads)."""
    rng = random.Random(seed)
    files = regular_files()
    small = [f for f in files if f[1] < 64 << 10]
    medium = [f for f in files if 64 << 10 <= f[1] < 1 << 20]
    large = [f for f in files if 1 << 20 <= f[1] <= 16 << 20]
    for b in (small, medium, large):
        rng.shuffle(b)
    fixed, pools = [], []
    for _ in range(readers):
        fixed.append([small.pop() for _ in range(32)] + [medium.pop() for _ in range(6)]
                     + [large.pop() for _ in range(2)])
    # What is left is split among the readers: the fresh reads of one never touch another's files.
    per = [len(small) // readers, len(medium) // readers, len(large) // readers]
    for r in range(readers):
        pools.append(dict(small=small[r * per[0]:(r + 1) * per[0]], medium=medium[r * per[1]:(r + 1) * per[1]],
                          large=large[r * per[2]:(r + 1) * per[2]]))
    return fixed, pools


# ---------------------------------------------------------------- readers

KIND = {"fixed": 0, "fresh": 1, "again": 2}


def reader(k, rootfs, fixed, pool, sums, out, pause, stop):
    """Reads `fixed` in a loop plus, per round, 2 small, 1 medium and (every 5th round) 1 large file of
    `pool` in order (the pool's files are read once, then `again`). One line a read:
    `start end kind status size path` (monotonic seconds; status 0 ok, 1 wrong checksum, errno+100)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    f = open(out, "w", buffering=1 << 16)
    rng = random.Random(k)
    cursor = dict(small=0, medium=0, large=0)
    rnd = 0
    while not stop.is_set():
        todo = [(p, "fixed") for p, _ in fixed]
        want = dict(small=2, medium=1, large=1 if rnd % 5 == 0 else 0)
        for size, n in want.items():
            for _ in range(n):
                lst = pool[size]
                if not lst:
                    continue
                i = cursor[size]
                todo.append((lst[i % len(lst)][0], "fresh" if i < len(lst) else "again"))
                cursor[size] = i + 1
        rng.shuffle(todo)
        for rel, kind in todo:
            if stop.is_set():
                break
            t0 = time.monotonic()
            n = 0
            try:
                h = hashlib.sha256()
                with open(os.path.join(rootfs, rel), "rb", buffering=0) as fh:
                    while True:
                        b = fh.read(1 << 20)
                        if not b:
                            break
                        n += len(b)
                        h.update(b)
                st = 0 if h.hexdigest() == sums[rel] else 1
            except OSError as e:
                st = 100 + (e.errno or 0)
            t1 = time.monotonic()
            f.write(f"{t0:.6f} {t1:.6f} {KIND[kind]} {st} {n} {rel}\n")
            if st:
                f.flush()
            if pause:
                time.sleep(pause)
        rnd += 1
    f.close()


def load_reads(paths):
    """All reads: (start, end, kind, status, size, reader, path)."""
    out = []
    for k, p in enumerate(paths):
        for line in open(p):
            t0, t1, kind, st, n, rel = line.rstrip("\n").split(" ", 5)
            out.append((float(t0), float(t1), int(kind), int(st), int(n), k, rel))
    return out


# ---------------------------------------------------------------- events

def wait_new_server(sock, old, timeout=120):
    """Polls `GET /v1/status` until a server other than `old` answers; (monotonic time, status)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            st = call(sock, "GET", "/v1/status")
            if st["pid"] != old:
                return time.monotonic(), st
        except (OSError, RuntimeError, ValueError):
            pass
        time.sleep(0.005)
    raise RuntimeError(f"no new server {timeout} s after the event (old pid {old})")


def kill_event(d):
    old = d.server_pid
    t0 = time.monotonic()
    os.kill(old, signal.SIGKILL)
    t_ready, st = wait_new_server(d.sock, old)
    return dict(old_pid=old, t0=t0, t_ready=t_ready, status=st)


def upgrade_event(d, exe):
    old = d.server_pid
    # The same binary installed again at stratad's path, as a package manager would: copy, then rename.
    shutil.copy(BIN["release_stratad"], exe + ".new")
    os.rename(exe + ".new", exe)
    # Ready: the new server answers this process's own polling (the CLI polls every 50 ms).
    t0 = time.monotonic()
    p = subprocess.Popen([BIN["strata"], "--socket", d.sock, "daemon", "upgrade", "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t_ready, st = wait_new_server(d.sock, old)
    out, err = p.communicate(timeout=120)
    t_cli = time.monotonic()
    if p.returncode != 0:
        raise RuntimeError(f"strata daemon upgrade: exit {p.returncode}: {err.strip()}")
    return dict(old_pid=old, t0=t0, t_ready=t_ready, cli=json.loads(out), cli_s=round(t_cli - t0, 4),
                status=st)


# ---------------------------------------------------------------- one run

def one_run(run, a, fixed, pools, sums):
    work = tempfile.mkdtemp(prefix="strata-bench-restart-", dir="/var/tmp")
    os.makedirs(f"{work}/bin")
    exe = f"{work}/bin/stratad"
    shutil.copy(BIN["release_stratad"], exe)
    stratad.BIN["stratad"] = exe
    # The daemon's log (holder and every server: they share its standard error) goes to LOG.
    saved = os.dup(2)
    lf = os.open(LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(lf, f"==== run {run} {time.strftime('%H:%M:%S', time.gmtime())} {work}\n".encode())
    os.dup2(lf, 2)
    try:
        d = stratad.Daemon(STORE, work=work, env={"STRATA_LOG": "info"})
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(lf)
    rows, procs, stop = [], [], multiprocessing.Event()
    drops, busy_samples, rustc_samples, foreign = [], [], [], []
    try:
        t = time.monotonic()
        rootfs = []
        for i in range(a.sandboxes):
            sb = d.mount("fat:v1", f"s{i:04d}")
            rootfs.append(sb.get("rootfs") or f"{d.run}/sandboxes/s{i:04d}/rootfs")
        create_s = time.monotonic() - t
        log(f"run {run}: {a.sandboxes} sandboxes in {create_s:.1f} s")
        holder = d.pid
        mounts_held = mounts_under(work)
        step = max(1, a.sandboxes // a.readers)
        outs = [f"{work}/reads-{k}.txt" for k in range(a.readers)]
        ctx = multiprocessing.get_context("fork")
        t_start = time.monotonic()
        for k in range(a.readers):
            p = ctx.Process(target=reader, args=(k, rootfs[k * step], fixed[k], pools[k], sums, outs[k],
                                                 a.pause, stop))
            p.start()
            procs.append(p)

        # Page cache dropped every DROP_EVERY s (and before each event, below); CPU and rustc sampled.
        quit_drops = threading.Event()
        drop_lock = threading.Lock()

        def dropper():
            last, ticks, tt = cpu_times(), cpu_ticks(), time.monotonic()
            while not quit_drops.wait(a.drop_every):
                with drop_lock:
                    t0 = time.monotonic()
                    drop_caches()
                    drops.append((t0, time.monotonic()))
                now, ticks1, tt1 = cpu_times(), cpu_ticks(), time.monotonic()
                busy_samples.append(100.0 * (1 - (now[0] - last[0]) / max(1, now[1] - last[1])))
                foreign.append(foreign_busy(ticks, ticks1, tt1 - tt))
                last, ticks, tt = now, ticks1, tt1
                rustc_samples.append(len(rustc_running()))
        th = threading.Thread(target=dropper, daemon=True)
        th.start()

        time.sleep(a.warmup)
        before = dict(holder=proc_info(holder), server=proc_info(d.server_pid), children=children(holder))
        kinds = ["kill"] * a.kills + ["upgrade"] * a.upgrades
        # Interleaved: kill, upgrade, kill, upgrade, ... then the remaining kind.
        order = []
        ks, us = kinds.count("kill"), kinds.count("upgrade")
        while ks or us:
            if ks:
                order.append("kill"); ks -= 1
            if us:
                order.append("upgrade"); us -= 1
        rng = random.Random(1000 + run)
        events = []
        for n, kind in enumerate(order):
            time.sleep(max(0.0, a.gap * (1 + 0.5 * rng.random()) - 1.2))
            others, waited = wait_foreign_quiet(a.quiet_max)
            # The serving process as the previous event left it (leaks show as growth event after event).
            procs_before = dict(holder=proc_info(holder), server=proc_info(d.server_pid))
            with drop_lock:
                drop_caches()
                drops.append((time.monotonic(), time.monotonic()))
            time.sleep(0.2)
            rustc = len(rustc_running())
            ev = kill_event(d) if kind == "kill" else upgrade_event(d, exe)
            ev.update(kind=kind, n=n, rustc=rustc, others=others, waited=waited, procs_before=procs_before,
                      wall=time.strftime("%H:%M:%S", time.gmtime()) + f"{time.time() % 1:.3f}"[1:])
            events.append(ev)
            log(f"run {run} event {n}: {kind} of {ev['old_pid']}: new server {ev['status']['pid']} answers after "
                f"{ev['t_ready'] - ev['t0']:.3f} s")
        time.sleep(POST + 1)
        after = dict(holder=proc_info(holder), server=proc_info(d.server_pid), children=children(holder))
        final = d.call("GET", "/v1/status")
        stop.set()
        for p in procs:
            p.join(timeout=120)
            if p.exitcode is None:
                log(f"reader {p.pid} did not stop: killing it")
                p.kill()
                p.join()
        exitcodes = [p.exitcode for p in procs]
        procs = []
        quit_drops.set()
        th.join()

        reads = load_reads(outs)
        # Failed reads and wrong checksums, anywhere in the run.
        bad = [r for r in reads if r[3] != 0]
        windows = [(e["t0"], e["t_ready"] + POST) for e in events]
        for e, (w0, w1) in zip(events, windows):
            inw = [r for r in reads if r[1] > w0 and r[0] < w1]
            lat = sorted(r[1] - r[0] for r in inw)
            inflight = [r for r in reads if r[0] < e["t0"] < r[1]]
            longest = max(inw, key=lambda r: r[1] - r[0]) if inw else None
            st = e["status"]
            row = dict(bench="restart", kind=e["kind"], run=run, event=e["n"], sandboxes=a.sandboxes,
                       readers=a.readers, old_pid=e["old_pid"], new_pid=st["pid"],
                       ready_s=round(e["t_ready"] - e["t0"], 4),
                       stall_s=round(lat[-1], 4) if lat else None,
                       stall_read=dict(kind=[k for k, v in KIND.items() if v == longest[2]][0],
                                       size=longest[4], path=longest[6],
                                       started_before_event_s=round(e["t0"] - longest[0], 4))
                       if longest else None,
                       window_reads=len(inw), window_p50_s=round(lat[len(lat) // 2], 4) if lat else None,
                       inflight_at_event=len(inflight),
                       inflight_fresh=sum(1 for r in inflight if r[2] == KIND["fresh"]),
                       failed=sum(1 for r in inw if r[3] >= 100),
                       wrong=sum(1 for r in inw if r[3] == 1),
                       adopted=st.get("adopted"), running=st.get("running"),
                       resent=(st.get("fuse") or {}).get("resent"),
                       version=st.get("version"), rustc_at_event=e["rustc"], wall_after=e["wall"],
                       other_busy_before=e["others"], waited_for_quiet_s=e["waited"],
                       procs_before=e["procs_before"])
            if e["kind"] == "upgrade":
                row["cli"] = e["cli"]
                row["cli_s"] = e["cli_s"]
            rows.append(emit(row))
            log(json.dumps(row))
        ex = [(w0 - PRE, w1) for w0, w1 in windows]
        out_lat = sorted(r[1] - r[0] for r in reads
                         if r[3] == 0 and not any(r[1] > x0 and r[0] < x1 for x0, x1 in ex)
                         and r[0] > t_start + a.warmup)  # the warm-up fills the chunk cache
        t_stop = time.monotonic()
        os.kill(holder, signal.SIGTERM)
        d.p.wait(timeout=600)
        teardown_s = time.monotonic() - t_stop
        left = mounts_under(work)
        summary = dict(
            bench="restart", run_summary=True, run=run, time=time.strftime("%H:%M:%S", time.gmtime()),
            sandboxes=a.sandboxes, readers=a.readers, create_s=round(create_s, 2), mounts_held=mounts_held,
            reads=len(reads), reads_fresh=sum(1 for r in reads if r[2] == KIND["fresh"]),
            failed=sum(1 for r in bad if r[3] >= 100), wrong=sum(1 for r in bad if r[3] == 1),
            bad_reads=[dict(start=r[0], end=r[1], status=r[3], reader=r[5], path=r[6]) for r in bad[:50]],
            reader_exitcodes=exitcodes,
            # A reader that did not stop within 120 s (killed) had a read that never returned.
            readers_hung=sum(1 for c in exitcodes if c != 0),
            outside_reads=len(out_lat),
            outside_p50_s=round(out_lat[len(out_lat) // 2], 5) if out_lat else None,
            outside_p99_s=round(out_lat[int(len(out_lat) * 0.99)], 4) if out_lat else None,
            outside_max_s=round(out_lat[-1], 4) if out_lat else None,
            before=before, after=after,
            final_status=dict(pid=final["pid"], running=final["running"], sandboxes=final["sandboxes"],
                              cache=final["cache"], fuse=final.get("fuse")),
            teardown_s=round(teardown_s, 2), mounts_left_after_teardown=left,
            drops=len(drops), drop_s_max=round(max((b - a_ for a_, b in drops), default=0), 3),
            cpu_busy_median=round(statistics.median(busy_samples), 1) if busy_samples else None,
            rustc_samples=sum(1 for x in rustc_samples if x), samples=len(rustc_samples),
            other_busy_samples=sum(1 for x in foreign if x),
            other_busy=sorted({c for x in foreign for c, _, _ in x}),
            nproc=os.cpu_count(), loadavg=os.getloadavg(), plan=plan_present(), pause=a.pause,
            drop_every=a.drop_every,
            events_other_busy=sum(1 for e in events if e["others"]),
            events=[dict(kind=e["kind"], others=e["others"], procs_before=e["procs_before"]) for e in events])
        emit(summary)
        log(json.dumps({k: v for k, v in summary.items() if k != "bad_reads"}))
        return rows, summary
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=60)
            if p.exitcode is None:
                p.kill()
        d.stop()
        stratad.BIN["stratad"] = BIN["release_stratad"]


def startup(a):
    """`--startup N`: how long a successor takes to answer after `kill -9` of the server, without readers
    (SANDBOXES held, their records synced to disk), N kills per condition, 2.5 s apart (the holder waits
    before restarting a server that died within 2 s of its start): the binary the holder runs, page cache
    kept or dropped 0.2 s before the kill; then the same binary installed again at the path (copy, rename,
    as an upgrade does: a file no process maps) and synced, page cache kept or dropped. (Dirty pages
    survive a drop: without the sync, records written in the last ~30 s would stay cached.)"""
    work = tempfile.mkdtemp(prefix="strata-bench-restart-", dir="/var/tmp")
    os.makedirs(f"{work}/bin")
    exe = f"{work}/bin/stratad"
    shutil.copy(BIN["release_stratad"], exe)
    stratad.BIN["stratad"] = exe
    d = stratad.Daemon(STORE, work=work, quiet=True)
    rows = []
    try:
        for i in range(a.sandboxes):
            d.mount("fat:v1", f"s{i:04d}")
        subprocess.run(["sync"], check=True)

        def kills(binary, drop):
            ms = []
            for _ in range(a.startup):
                time.sleep(2.5)
                if drop:
                    drop_caches()
                    time.sleep(0.2)
                old = d.server_pid
                t0 = time.monotonic()
                os.kill(old, signal.SIGKILL)
                t, _ = wait_new_server(d.sock, old)
                ms.append(round((t - t0) * 1000, 1))
            row = emit(dict(bench="restart-startup", sandboxes=a.sandboxes, binary=binary,
                            page_cache="dropped (after sync)" if drop else "kept", ready_ms=ms,
                            median_ms=statistics.median(ms), rustc=len(rustc_running()),
                            loadavg=os.getloadavg()))
            rows.append(row)
            log(json.dumps(row))
        kills("the holder's (mapped by the holder)", False)
        kills("the holder's (mapped by the holder)", True)
        shutil.copy(BIN["release_stratad"], exe + ".new")
        os.rename(exe + ".new", exe)
        subprocess.run(["sync"], check=True)
        kills("installed again at the path (mapped by no process), synced", False)
        kills("installed again at the path (mapped by no process), synced", True)
    finally:
        d.stop()
        stratad.BIN["stratad"] = BIN["release_stratad"]
    print(f"\nsuccessor start after kill -9, {a.sandboxes} sandboxes held, no readers; results in {RESULTS}\n")
    print("| server binary | page cache | kill -9 → new server answers, ms (each kill) | median |")
    print("|---|---|---|---:|")
    for r in rows:
        print(f"| {r['binary']} | {r['page_cache']} | {', '.join(str(x) for x in r['ready_ms'])} | "
              f"{r['median_ms']:.1f} ms |")


def compact_log():
    """The daemon's log without colour codes, each run of per-sandbox lines ("sandbox created", "sandbox
    stopped") replaced by one line that counts them."""
    import re
    try:
        lines = open(LOG, errors="replace").read().splitlines()
    except OSError:
        return
    ansi = re.compile(r"\x1b\[[0-9;]*m")
    out, run = [], None  # run: [message, count, first line's time, last line's time]
    for line in map(lambda l: ansi.sub("", l), lines):
        m = re.search(r"(sandbox created|sandbox stopped) sandbox=", line)
        if m and run and run[0] == m.group(1):
            run[1] += 1
            run[3] = line.split()[0]
            continue
        if run:
            out.append(f"{run[2]} [restart.py: {run[1]} lines \"{run[0]}\" up to {run[3]}]")
            run = None
        if m:
            run = [m.group(1), 1, line.split()[0], line.split()[0]]
            continue
        out.append(line)
    if run:
        out.append(f"{run[2]} [restart.py: {run[1]} lines \"{run[0]}\" up to {run[3]}]")
    with open(LOG, "w") as f:
        f.write("\n".join(out) + "\n")


def fmt(x, unit="s"):
    return "—" if x is None else f"{x:.3f} {unit}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--sandboxes", type=int, default=1000)
    ap.add_argument("--readers", type=int, default=20)
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--upgrades", type=int, default=3)
    ap.add_argument("--gap", type=float, default=8.0, help="seconds between events (up to 1.5x, random)")
    ap.add_argument("--warmup", type=float, default=15.0, help="seconds of reading before the first event")
    ap.add_argument("--drop-every", type=float, default=3.0, help="seconds between page cache drops")
    ap.add_argument("--pause", type=float, default=0.02, help="seconds each reader sleeps between files")
    ap.add_argument("--startup", type=int, default=0, metavar="N",
                    help="instead: N kills per condition without readers (binary mapped or not, page cache "
                         "kept or dropped): the successor's start alone")
    ap.add_argument("--quiet-max", type=float, default=float(os.environ.get("QUIET_MAX", "60")),
                    help="seconds to wait before an event for a second without other busy processes")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (mounts, drop_caches)")
    # The binaries are copied once: a build in the shared target directory during the run changes nothing.
    bindir = tempfile.mkdtemp(prefix="strata-restart-bin-", dir="/var/tmp")
    built = {b: time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime(os.stat(BIN[b]).st_mtime)) for b in ("strata", "stratad")}
    for b in ("strata", "stratad"):
        shutil.copy(BIN[b], f"{bindir}/{b}")
        BIN[b] = f"{bindir}/{b}"
    BIN["release_stratad"] = BIN["stratad"]
    try:
        run_all(a, built)
    finally:
        shutil.rmtree(bindir, ignore_errors=True)
        compact_log()


def run_all(a, built):
    prepare()
    if a.startup:
        emit(dict(bench="restart-startup", start=True, stamp=STAMP, nproc=os.cpu_count(),
                  loadavg=os.getloadavg(), rustc=rustc_running(), args=vars(a), built=built,
                  commit=subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"],
                                        capture_output=True, text=True).stdout.strip(),
                  stratad_sha256=sha256(BIN["stratad"])[:16]))
        return startup(a)
    fixed, pools = plan_files(a.readers, seed=10)
    names = {f for lst in fixed for f, _ in lst} | {f for p in pools for b in p.values() for f, _ in b}
    log(f"checksumming {len(names)} files of {SRC}")
    sums = {f: sha256(os.path.join(SRC, f)) for f in sorted(names)}
    head = dict(bench="restart", start=True, stamp=STAMP, nproc=os.cpu_count(), loadavg=os.getloadavg(),
                rustc=rustc_running(), args=vars(a), commit=subprocess.run(
                    ["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True,
                    text=True).stdout.strip(), built=built,
                dirty=subprocess.run(["git", "-C", HERE, "status", "--porcelain", "--untracked-files=no", "--",
                                      ":(top,exclude)benches"], capture_output=True, text=True).stdout.split("\n")[:-1], stratad_sha256=sha256(BIN["stratad"])[:16],
                kernel=os.uname().release)
    emit(head)
    allrows, sums_ = [], []
    for run in range(a.runs):
        rows, s = one_run(run, a, fixed, pools, sums)
        allrows += rows
        sums_.append(s)
    print(f"\nrestart: {a.runs} run(s), {a.sandboxes} sandboxes of fat:v1 held, {a.readers} reading; "
          f"nproc {os.cpu_count()}, load {os.getloadavg()[0]:.2f}; results in {RESULTS}\n")
    print("| event | n | new server answers (median / max) | longest read stall (median / max of events) "
          "| failed reads | wrong checksums | reads in windows |")
    print("|---|---:|---|---|---:|---:|---:|")
    out = dict(bench="restart", summary=True, runs=a.runs)
    for kind in ("kill", "upgrade"):
        rs = [r for r in allrows if r["kind"] == kind]
        if not rs:
            continue
        ready = [r["ready_s"] for r in rs]
        stall = [r["stall_s"] for r in rs if r["stall_s"] is not None]
        failed, wrong = sum(r["failed"] for r in rs), sum(r["wrong"] for r in rs)
        print(f"| {'kill -9 of the server' if kind == 'kill' else 'strata daemon upgrade'} | {len(rs)} | "
              f"{fmt(statistics.median(ready))} / {fmt(max(ready))} | "
              f"{fmt(statistics.median(stall))} / {fmt(max(stall))} | {failed} | {wrong} | "
              f"{sum(r['window_reads'] for r in rs)} |")
        out[kind] = dict(events=len(rs), ready_median_s=statistics.median(ready), ready_max_s=max(ready),
                         stall_median_s=statistics.median(stall), stall_max_s=max(stall), failed=failed,
                         wrong=wrong)
    p50 = [s["outside_p50_s"] for s in sums_ if s["outside_p50_s"] is not None]
    mx = [s["outside_max_s"] for s in sums_ if s["outside_max_s"] is not None]
    p99 = [s["outside_p99_s"] for s in sums_ if s["outside_p99_s"] is not None]
    print(f"| outside events | {sum(s['outside_reads'] for s in sums_)} reads | — | median {fmt(statistics.median(p50))}, "
          f"p99 {fmt(max(p99))}, max {fmt(max(mx))} | {sum(s['failed'] for s in sums_)} in the whole run | "
          f"{sum(s['wrong'] for s in sums_)} in the whole run | — |")
    out.update(outside_p50_s=p50, outside_p99_s=p99, outside_max_s=mx,
               failed_total=sum(s["failed"] for s in sums_), wrong_total=sum(s["wrong"] for s in sums_),
               loadavg=os.getloadavg(), rustc=rustc_running())
    emit(out)
    for s in sums_:
        print(f"\nrun {s['run']}: {s['reads']} reads ({s['reads_fresh']} first reads of a file), "
              f"readers hung: {s['readers_hung']}, created "
              f"{s['sandboxes']} sandboxes in {s['create_s']} s, CPU busy median {s['cpu_busy_median']} %, "
              f"rustc seen in {s['rustc_samples']}/{s['samples']} samples; holder RSS "
              f"{s['before']['holder']['rss'] / 2**20:.1f} -> {s['after']['holder']['rss'] / 2**20:.1f} MiB, "
              f"fds {s['before']['holder']['fds']} -> {s['after']['holder']['fds']}; server RSS "
              f"{s['before']['server']['rss'] / 2**20:.1f} -> {s['after']['server']['rss'] / 2**20:.1f} MiB; "
              f"teardown {s['teardown_s']} s, mounts left {s['mounts_left_after_teardown']}; events with other "
              f"processes busy in the second before: {s['events_other_busy']}/{len(s['events'])}; server "
              f"descriptors per event: {[e['procs_before']['server']['fds'] for e in s['events']]}")


if __name__ == "__main__":
    sys.exit(main())

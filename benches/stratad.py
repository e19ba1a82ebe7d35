"""What the benchmarks share about stratad: the release binaries, a control-socket client, and a daemon
started for one measurement in its own state and runtime directories and stopped with SIGTERM (then any
mount left under its directory is detached and the directory removed)."""
import json, os, shutil, signal, socket, subprocess, tempfile, time

TARGET = os.environ.get("CARGO_TARGET_DIR", "/var/tmp/strata-target")
BIN = {b: f"{TARGET}/release/{b}" for b in ("strata", "stratad", "pack_diff", "linkproxy")}
BIN["stratad"] = os.environ.get("STRATAD", BIN["stratad"])
BIN["strata"] = os.environ.get("STRATA_CLI", BIN["strata"])


def call(sock, method, path, body=None, raw=False):
    """One request to stratad's control socket; the JSON reply, or with `raw` the body as text
    (RuntimeError on an error status)."""
    s = socket.socket(socket.AF_UNIX)
    s.connect(sock)
    data = json.dumps(body) if body is not None else ""
    s.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n\r\n{data}".encode())
    resp = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        resp += chunk
    s.close()
    head, _, body = resp.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    if status >= 300:
        raise RuntimeError(body.decode())
    if raw:
        return body.decode()
    return json.loads(body) if body else None


def read_waits(text):
    """From /metrics text: seconds reads waited for chunks not in the cache, and how many, by outcome
    (`led`: the reader fetched, `joined`: it waited for another fetch) — zeros from a stratad without
    `strata_read_wait_seconds` (before d03a735)."""
    out = {"led_s": 0.0, "joined_s": 0.0, "led": 0, "joined": 0}
    for line in text.splitlines():
        for how in ("led", "joined"):
            if line.startswith(f'strata_read_wait_seconds_sum{{outcome="{how}"}}'):
                out[f"{how}_s"] = float(line.rsplit(" ", 1)[1])
            elif line.startswith(f'strata_read_wait_seconds_count{{outcome="{how}"}}'):
                out[how] = int(line.rsplit(" ", 1)[1])
    return out


class Daemon:
    """A fresh stratad on `store`: state and runtime directories under `work` (a new directory under
    /var/tmp unless given; removed by `stop`), extra `args`, environment `env` over this one's, another
    `binary` than BIN["stratad"] if given, the command after a `prefix` if given (e.g. `nsenter
    --net=/run/netns/NS --`: stratad in another network namespace but the host's mount namespace, so its
    mounts and control socket are the host's; the program must exec stratad, whose PID `pid` then is)."""

    def __init__(self, store, work=None, env=None, state=None, args=(), quiet=False, binary=None, prefix=()):
        self.work = work or tempfile.mkdtemp(prefix="strata-bench-", dir="/var/tmp")
        self.state = state or f"{self.work}/state"
        self.run = f"{self.work}/run"
        self.sock = f"{self.run}/stratad.sock"
        e = {**os.environ, "STRATA_LOG": os.environ.get("STRATA_LOG", "warn"), **(env or {})}
        self.p = subprocess.Popen([*prefix, binary or BIN["stratad"], "--config", "/dev/null", "--store", store, "--state-dir",
                                   self.state, "--runtime-dir", self.run, *args], env=e,
                                  stderr=subprocess.DEVNULL if quiet else None)
        try:
            for _ in range(600):
                if os.path.exists(self.sock):
                    return
                if self.p.poll() is not None:
                    raise RuntimeError("stratad exited")
                time.sleep(0.02)
            raise RuntimeError("stratad did not start")
        except BaseException:
            # Also on a signal while it starts: nothing left running or behind under `work`.
            self.stop()
            raise

    @property
    def pid(self):
        """The process this helper started: the descriptor holder (stratad's default mode), which keeps
        the FUSE connection and control socket and runs the server."""
        return self.p.pid

    @property
    def server_pid(self):
        """The process serving the FUSE connection now (`pid` of `GET /v1/status`): the holder's child,
        replaced by a successor after a kill or an upgrade."""
        return self.call("GET", "/v1/status")["pid"]

    def call(self, method, path, body=None):
        return call(self.sock, method, path, body)

    def waits(self):
        """How long reads waited for chunks so far ([`read_waits`])."""
        return read_waits(call(self.sock, "GET", "/metrics", raw=True))

    def mount(self, image, sid):
        return self.call("POST", "/v1/sandboxes", {"image": image, "id": sid})

    def sandbox(self, sid):
        return self.call("GET", f"/v1/sandboxes/{sid}")

    def stop(self):
        self.p.send_signal(signal.SIGTERM)
        try:
            self.p.wait(timeout=600)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        for line in reversed(open("/proc/self/mountinfo").read().splitlines()):
            mp = line.split()[4]
            if mp.startswith(self.work):
                subprocess.run(["umount", "-l", mp], stderr=subprocess.DEVNULL)
        shutil.rmtree(self.work, ignore_errors=True)

//! A real OCI registry on loopback for the `docker://` tests: Debian's `docker-registry` (the CNCF
//! distribution server) on a free port with its storage in a scratch directory, optionally behind
//! htpasswd Basic auth ([`Registry::start`]) or behind a bearer-token front ([`TokenFront`]): a small
//! Python server that plays the distribution token flow — `401` with a `Bearer realm=…,service=…,
//! scope=…` challenge, a token endpoint that checks Basic credentials, and requests with a good token
//! forwarded to the registry (pushes too: bodies forwarded, upload `Location`s pointed back at the front). Images are pushed with `skopeo copy`.

use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::oci::run;
use crate::{have, scratch, Need};

/// A running registry; stopped (by its pid) on drop.
pub struct Registry {
    pub port: u16,
    child: Child,
    pub dir: tempfile::TempDir,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

fn wait_for(port: u16, what: &str, child: &mut Child) {
    let start = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        if let Ok(Some(st)) = child.try_wait() {
            panic!("{what} exited at start: {st}");
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{what} did not start"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

impl Registry {
    /// Starts a registry; with `user` = `(name, password)`, behind htpasswd Basic auth. `None` (after
    /// the skip is logged) when docker-registry, skopeo or htpasswd is missing.
    pub fn start(user: Option<(&str, &str)>) -> Option<Registry> {
        if !have(&[Need::Registry]) {
            return None;
        }
        let dir = scratch("registry");
        let port = free_port();
        let auth = match user {
            Some((name, password)) => {
                let line = run("htpasswd", &["-Bbn", name, password]);
                let file = dir.path().join("htpasswd");
                std::fs::write(&file, line.trim()).expect("write htpasswd");
                format!(
                    "auth:\n  htpasswd:\n    realm: strata-test\n    path: {}\n",
                    file.display()
                )
            }
            None => String::new(),
        };
        let config = format!(
            "version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\nstorage:\n  \
             filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\nhttp:\n  addr: \
             127.0.0.1:{port}\n{auth}",
            dir.path().join("data").display()
        );
        let cfg = dir.path().join("config.yml");
        std::fs::write(&cfg, config).expect("write registry config");
        let mut child = Command::new("docker-registry")
            .arg("serve")
            .arg(&cfg)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start docker-registry");
        wait_for(port, "docker-registry", &mut child);
        Some(Registry { port, child, dir })
    }

    /// `127.0.0.1:PORT`.
    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Pushes `src` (a skopeo source: `oci:DIR:REF`) as `repo:tag`; `all` copies every platform of an
    /// index; `creds` is `user:password`.
    pub fn push(&self, src: &str, repo_tag: &str, creds: Option<&str>, all: bool) {
        let dest = format!("docker://{}/{repo_tag}", self.host());
        let mut args = vec!["copy", "-q", "--dest-tls-verify=false"];
        if all {
            args.push("--all");
        }
        if let Some(c) = creds {
            args.extend(["--dest-creds", c]);
        }
        args.extend([src, &dest]);
        run("skopeo", &args);
    }

    /// The path of a blob in the registry's storage (to corrupt it).
    pub fn blob_path(&self, digest: &str) -> std::path::PathBuf {
        let hex = digest.trim_start_matches("sha256:");
        self.dir
            .path()
            .join("data/docker/registry/v2/blobs/sha256")
            .join(&hex[..2])
            .join(hex)
            .join("data")
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The token front's program: `python3 -c FRONT PORT UPSTREAM USER PASSWORD LOG`.
const FRONT: &str = r#"
import base64, http.server, json, secrets, shutil, sys, urllib.request, urllib.error
port, upstream, user, password, log = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
tokens = set()
want = 'Basic ' + base64.b64encode(f'{user}:{password}'.encode()).decode()
def note(s):
    with open(log, 'a') as f: f.write(s + '\n')
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = 'HTTP/1.1'
    def log_message(self, *a): pass
    def send(self, code, body=b'', headers=()):
        self.send_response(code)
        for k, v in headers: self.send_header(k, v)
        self.send_header('Content-Length', str(len(body))); self.end_headers()
        if self.command != 'HEAD': self.wfile.write(body)
    def do_HEAD(self): self.do_GET()
    def do_POST(self): self.do_GET()
    def do_PUT(self): self.do_GET()
    def do_PATCH(self): self.do_GET()
    def do_GET(self):
        auth = self.headers.get('Authorization', '')
        n = int(self.headers.get('Content-Length') or 0)
        body = self.rfile.read(n) if n else None
        if self.path.startswith('/token'):
            note('token ' + self.path)
            if auth != want:
                return self.send(401, b'{"details":"bad credentials"}')
            t = secrets.token_hex(16); tokens.add(t)
            return self.send(200, json.dumps({'token': t}).encode(), [('Content-Type', 'application/json')])
        if not (auth.startswith('Bearer ') and auth[7:] in tokens):
            repo = self.path.split('/')[2] if self.path.count('/') > 2 else ''
            ch = f'Bearer realm="http://127.0.0.1:{port}/token",service="strata-test"'
            return self.send(401, b'{"errors":[{"code":"UNAUTHORIZED","message":"token needed"}]}',
                             [('WWW-Authenticate', ch), ('Content-Type', 'application/json')])
        note('ok ' + self.command + ' ' + self.path)
        req = urllib.request.Request(upstream + self.path, data=body, method=self.command)
        for k in ['Accept', 'Content-Type', 'Content-Range']:
            if k in self.headers: req.add_header(k, self.headers[k])
        try:
            r = urllib.request.urlopen(req)
        except urllib.error.HTTPError as e:
            r = e
        self.send_response(r.status)
        for k in ['Content-Type', 'Content-Length', 'Docker-Content-Digest', 'Range']:
            if r.headers.get(k): self.send_header(k, r.headers[k])
        # Uploads continue through the front, not at the registry behind it.
        if r.headers.get('Location'):
            self.send_header('Location', r.headers['Location'].replace(upstream, f'http://127.0.0.1:{port}'))
        self.end_headers()
        if self.command != 'HEAD': shutil.copyfileobj(r, self.wfile)
http.server.ThreadingHTTPServer(('127.0.0.1', port), H).serve_forever()
"#;

/// A bearer-token front of a registry (see the module documentation); stopped on drop.
pub struct TokenFront {
    pub port: u16,
    child: Child,
    log: std::path::PathBuf,
}

impl TokenFront {
    /// Fronts `registry` (which must have no auth of its own); tokens go to `user:password` only.
    pub fn start(registry: &Registry, user: &str, password: &str, dir: &Path) -> TokenFront {
        let port = free_port();
        let log = dir.join("token-front.log");
        let mut child = Command::new("python3")
            .args(["-c", FRONT, &port.to_string()])
            .arg(format!("http://{}", registry.host()))
            .args([user, password])
            .arg(&log)
            .stdout(Stdio::null())
            .spawn()
            .expect("start the token front");
        wait_for(port, "the token front", &mut child);
        TokenFront { port, child, log }
    }

    /// What it served: `token /token?…` and `ok METHOD /v2/…` lines.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for TokenFront {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

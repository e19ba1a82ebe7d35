//! A hostile OCI registry on loopback: it serves one small, honest image (`hostile/img:v1`, one gzip
//! layer made by Python's `tarfile`) through the distribution API's `GET` routes, but misbehaves on the
//! layer blob as asked ([`Blob`]): a body without `Content-Length` that never ends, a trickle of a byte
//! now and then, or a manifest and `Content-Length` that claim a size the disk cannot hold. One thread
//! per connection, every answer `Connection: close`; stopped when dropped.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::oci::run;

/// How the layer blob is served.
#[derive(Clone, Copy, Debug)]
pub enum Blob {
    /// As it is, with its `Content-Length`.
    Honest,
    /// The blob, then zeros without end, without `Content-Length` (the connection's end would end it).
    Endless,
    /// With its `Content-Length`, one byte every `Duration`.
    Trickle(Duration),
    /// The manifest and `Content-Length` claim this many bytes; the body is the blob, then zeros.
    Claims(u64),
}

/// A running hostile registry.
pub struct HostileRegistry {
    pub port: u16,
    stop: Arc<AtomicBool>,
    /// Bytes of the layer blob sent so far, over all requests.
    pub sent: Arc<AtomicU64>,
    _dir: tempfile::TempDir,
}

/// Writes the image's files into `dir`: `layer` (gzip tar), `config`, `manifest` (the layer's size
/// given as `declared`, or its real size) and `digests` (layer, then config: `sha256:<hex>` lines).
const MAKE: &str = r#"
import gzip, hashlib, io, json, os, sys, tarfile
d, declared = sys.argv[1], sys.argv[2]
raw = io.BytesIO()
with tarfile.open(fileobj=raw, mode='w', format=tarfile.PAX_FORMAT) as t:
    for name, data in [('etc/hello', b'hello\n'), ('data/blob', os.urandom(300000))]:
        i = tarfile.TarInfo(name); i.size = len(data); i.mtime = 1700000000
        t.addfile(i, io.BytesIO(data))
tar = raw.getvalue()
layer = gzip.compress(tar, mtime=0)
sha = lambda b: 'sha256:' + hashlib.sha256(b).hexdigest()
config = json.dumps({'architecture': 'amd64', 'os': 'linux', 'config': {},
    'rootfs': {'type': 'layers', 'diff_ids': [sha(tar)]}}).encode()
size = len(layer) if declared == '-' else int(declared)
manifest = json.dumps({'schemaVersion': 2, 'mediaType': 'application/vnd.oci.image.manifest.v1+json',
    'config': {'mediaType': 'application/vnd.oci.image.config.v1+json', 'digest': sha(config), 'size': len(config)},
    'layers': [{'mediaType': 'application/vnd.oci.image.layer.v1.tar+gzip', 'digest': sha(layer), 'size': size}]}).encode()
for n, b in [('layer', layer), ('config', config), ('manifest', manifest)]:
    open(os.path.join(d, n), 'wb').write(b)
open(os.path.join(d, 'digests'), 'w').write(sha(layer) + '\n' + sha(config) + '\n')
"#;

struct Image {
    layer: Vec<u8>,
    layer_digest: String,
    config: Vec<u8>,
    config_digest: String,
    manifest: Vec<u8>,
}

fn load(dir: &Path) -> Image {
    let read = |n: &str| std::fs::read(dir.join(n)).expect("read image file");
    let digests = String::from_utf8(read("digests")).expect("utf8");
    let mut lines = digests.lines();
    let (l, c) = (lines.next(), lines.next());
    Image {
        layer: read("layer"),
        layer_digest: l.expect("layer digest").to_string(),
        config: read("config"),
        config_digest: c.expect("config digest").to_string(),
        manifest: read("manifest"),
    }
}

impl HostileRegistry {
    /// Starts a registry serving `hostile/img:v1` with its layer blob served as `blob`.
    pub fn start(blob: Blob) -> HostileRegistry {
        let dir = crate::scratch("hostile-registry");
        let declared = match blob {
            Blob::Claims(n) => n.to_string(),
            _ => "-".to_string(),
        };
        run(
            "python3",
            &["-c", MAKE, dir.path().to_str().expect("utf8"), &declared],
        );
        let image = Arc::new(load(dir.path()));
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicU64::new(0));
        let (st, se) = (stop.clone(), sent.clone());
        std::thread::spawn(move || {
            for c in listener.incoming() {
                if st.load(Ordering::Relaxed) {
                    break;
                }
                let Ok(c) = c else { continue };
                let (image, st, se) = (image.clone(), st.clone(), se.clone());
                std::thread::spawn(move || {
                    let _ = serve(c, &image, blob, &st, &se);
                });
            }
        });
        HostileRegistry {
            port,
            stop,
            sent,
            _dir: dir,
        }
    }

    /// `docker://127.0.0.1:PORT/hostile/img:v1`.
    pub fn reference(&self) -> String {
        format!("docker://127.0.0.1:{}/hostile/img:v1", self.port)
    }
}

impl Drop for HostileRegistry {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

fn head(c: &mut TcpStream, status: &str, ctype: &str, len: Option<u64>) -> std::io::Result<()> {
    let len = len.map_or(String::new(), |n| format!("Content-Length: {n}\r\n"));
    write!(
        c,
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\n{len}Connection: close\r\n\r\n"
    )
}

fn serve(
    mut c: TcpStream,
    image: &Image,
    blob: Blob,
    stop: &AtomicBool,
    sent: &AtomicU64,
) -> std::io::Result<()> {
    let mut line = String::new();
    let mut r = BufReader::new(c.try_clone()?);
    r.read_line(&mut line)?;
    loop {
        let mut h = String::new();
        if r.read_line(&mut h)? == 0 || h == "\r\n" {
            break;
        }
    }
    let path = line
        .split_whitespace()
        .nth(1)
        .unwrap_or_default()
        .to_string();
    let json = "application/json";
    if path == "/v2/" {
        head(&mut c, "200 OK", json, Some(2))?;
        return c.write_all(b"{}");
    }
    if path.starts_with("/v2/hostile/img/manifests/") {
        let mt = "application/vnd.oci.image.manifest.v1+json";
        head(&mut c, "200 OK", mt, Some(image.manifest.len() as u64))?;
        return c.write_all(&image.manifest);
    }
    if path.ends_with(&image.config_digest) {
        head(&mut c, "200 OK", json, Some(image.config.len() as u64))?;
        return c.write_all(&image.config);
    }
    if !path.ends_with(&image.layer_digest) {
        head(&mut c, "404 Not Found", json, Some(2))?;
        return c.write_all(b"{}");
    }
    let octets = "application/octet-stream";
    let zeros = vec![0u8; 1 << 20];
    let endless = |c: &mut TcpStream| -> std::io::Result<()> {
        c.write_all(&image.layer)?;
        while !stop.load(Ordering::Relaxed) {
            c.write_all(&zeros)?;
            sent.fetch_add(zeros.len() as u64, Ordering::Relaxed);
        }
        Ok(())
    };
    match blob {
        Blob::Honest => {
            head(&mut c, "200 OK", octets, Some(image.layer.len() as u64))?;
            c.write_all(&image.layer)
        }
        Blob::Endless => {
            head(&mut c, "200 OK", octets, None)?;
            endless(&mut c)
        }
        Blob::Claims(n) => {
            head(&mut c, "200 OK", octets, Some(n))?;
            endless(&mut c)
        }
        Blob::Trickle(every) => {
            head(&mut c, "200 OK", octets, Some(image.layer.len() as u64))?;
            for b in &image.layer {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                c.write_all(&[*b])?;
                c.flush()?;
                sent.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(every);
            }
            Ok(())
        }
    }
}

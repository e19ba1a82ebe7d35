//! The S3 server of the tests: moto on a free loopback port (quick, started per test), or a real one —
//! Ceph's radosgw — when `STRATA_TEST_S3=radosgw`.
//!
//! moto imitates S3 in Python; it is what most runs use. A real server is started once for a whole run,
//! outside the tests, by `scripts/cluster/ceph-s3 start` (a one-monitor, one-OSD Ceph cluster with
//! radosgw on loopback); its endpoint and keys come in `STRATA_S3_ENDPOINT`, `AWS_ACCESS_KEY_ID` and
//! `AWS_SECRET_ACCESS_KEY`. On it each test's bucket is created if missing and emptied, since buckets
//! outlive the test. With `STRATA_TEST_S3=radosgw` and no endpoint a test skips — or fails when
//! `CI=true` ([`crate::require`]).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::{have, require, scratch, Need, StoreEnv};

/// moto's credentials (it takes any).
const MOTO_KEYS: (&str, &str) = ("test", "test");

/// An S3 server with one bucket ready; moto is stopped when dropped, radosgw is left running.
pub struct S3Server {
    /// moto's process; `None` for radosgw (started by `scripts/cluster/ceph-s3`).
    child: Option<Child>,
    pub port: u16,
    access_key: String,
    secret_key: String,
    /// The store-wide index caches of this server's stores.
    index_cache: tempfile::TempDir,
}

/// True when the tests use radosgw (`STRATA_TEST_S3=radosgw`).
pub fn real_s3() -> bool {
    std::env::var("STRATA_TEST_S3").is_ok_and(|v| v == "radosgw")
}

/// The loopback port of an `http://127.0.0.1:PORT` endpoint.
fn endpoint_port(endpoint: &str) -> Option<u16> {
    endpoint
        .strip_prefix("http://127.0.0.1:")?
        .trim_end_matches('/')
        .parse()
        .ok()
}

impl S3Server {
    /// The server, with `bucket` created (and, on radosgw, emptied). Returns `None` when the server is
    /// missing and the test may skip ([`have`]); `scripts/setup` installs moto and Ceph.
    pub fn start(bucket: &str) -> Option<S3Server> {
        if real_s3() {
            return S3Server::radosgw(bucket);
        }
        S3Server::moto(bucket)
    }

    /// moto, whatever `STRATA_TEST_S3` says, with `bucket` created (`None`: moto is missing and the
    /// test may skip).
    pub fn moto(bucket: &str) -> Option<S3Server> {
        if !have(&[Need::Moto]) {
            return None;
        }
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("free port");
        let child = Command::new("python3")
            .args(["-m", "moto.server", "-H", "127.0.0.1", "-p"])
            .arg(port.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start moto");
        let server = S3Server {
            child: Some(child),
            port,
            access_key: MOTO_KEYS.0.into(),
            secret_key: MOTO_KEYS.1.into(),
            index_cache: scratch("s3-index-cache"),
        };
        let start = Instant::now();
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "moto did not start"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        server.http("PUT", &format!("/{bucket}"));
        Some(server)
    }

    /// The running radosgw named by the environment, with `bucket` created and emptied.
    fn radosgw(bucket: &str) -> Option<S3Server> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let (endpoint, access, secret) = (
            var("STRATA_S3_ENDPOINT"),
            var("AWS_ACCESS_KEY_ID"),
            var("AWS_SECRET_ACCESS_KEY"),
        );
        let port = endpoint.as_deref().and_then(endpoint_port);
        let what = "a running radosgw (eval \"$(scripts/cluster/ceph-s3 start)\": \
                    STRATA_S3_ENDPOINT=http://127.0.0.1:PORT and AWS keys)";
        let (Some(port), Some(access_key), Some(secret_key)) = (port, access, secret) else {
            require(what, false);
            return None;
        };
        let server = S3Server {
            child: None,
            port,
            access_key,
            secret_key,
            index_cache: scratch("s3-index-cache"),
        };
        server.boto3(&format!(
            "b=s3.Bucket({bucket:?})\n\
             try:\n    b.create()\n\
             except c.exceptions.BucketAlreadyOwnedByYou:\n    pass\n\
             b.objects.all().delete()\n"
        ));
        Some(server)
    }

    /// An unsigned request (moto takes those).
    fn http(&self, method: &str, path: &str) -> String {
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).expect("connect moto");
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            self.port
        )
        .expect("request");
        let mut resp = String::new();
        let _ = s.read_to_string(&mut resp);
        resp
    }

    /// Runs `body` in Python with `c` a boto3 client of this server and `s3` its resource.
    fn boto3(&self, body: &str) {
        let script = format!(
            "import boto3\n\
             kw=dict(endpoint_url='http://127.0.0.1:{}',aws_access_key_id={:?},\
             aws_secret_access_key={:?},region_name='us-east-1')\n\
             c=boto3.client('s3',**kw)\ns3=boto3.resource('s3',**kw)\n{body}",
            self.port, self.access_key, self.secret_key
        );
        let out = Command::new("python3")
            .args(["-c", &script])
            .output()
            .expect("python3");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// The endpoint, `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Sets the `AWS_*` credentials of this server in this process's environment (for in-process
    /// clients; the endpoint is given to each explicitly). moto takes any keys, so for moto only unset
    /// variables are set: tests run as threads of one process, and a moto test must not replace the
    /// radosgw keys another test's clients read meanwhile.
    pub fn set_credentials(&self) {
        let moto = self.child.is_some();
        for (k, v) in [
            ("AWS_ACCESS_KEY_ID", self.access_key.as_str()),
            ("AWS_SECRET_ACCESS_KEY", self.secret_key.as_str()),
            ("AWS_REGION", "us-east-1"),
        ] {
            if !moto || std::env::var_os(k).is_none() {
                std::env::set_var(k, v);
            }
        }
    }

    /// A store in `bucket` under `prefix`.
    pub fn store(&self, bucket: &str, prefix: &str) -> StoreEnv {
        StoreEnv {
            url: format!("s3://{bucket}/{prefix}"),
            env: vec![
                ("AWS_ENDPOINT_URL".into(), self.endpoint()),
                ("AWS_ACCESS_KEY_ID".into(), self.access_key.clone()),
                ("AWS_SECRET_ACCESS_KEY".into(), self.secret_key.clone()),
                ("AWS_REGION".into(), "us-east-1".into()),
                ("AWS_ALLOW_HTTP".into(), "true".into()),
                (
                    "STRATA_INDEX_CACHE".into(),
                    self.index_cache.path().display().to_string(),
                ),
            ],
        }
    }

    /// A store in `bucket` under `prefix`, reached through a proxy on `proxy_port` (see
    /// [`crate::proxy`]).
    pub fn store_via(&self, bucket: &str, prefix: &str, proxy_port: u16) -> StoreEnv {
        let mut store = self.store(bucket, prefix);
        for (k, v) in store.env.iter_mut() {
            if k == "AWS_ENDPOINT_URL" {
                *v = format!("http://127.0.0.1:{proxy_port}");
            }
        }
        store
    }

    /// Overwrites an object (for corruption tests), through boto3.
    pub fn put_object(&self, bucket: &str, key: &str, data: &[u8]) {
        let tmp = scratch("s3put");
        let f = tmp.path().join("data");
        std::fs::write(&f, data).expect("write");
        self.boto3(&format!(
            "c.upload_file({:?},{bucket:?},{key:?})\n",
            f.display().to_string()
        ));
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

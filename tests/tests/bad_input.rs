//! Bad input gets a clear error naming what was wrong, a documented exit code, and leaves nothing
//! referenced: no tag, no layer descriptor.

use std::path::Path;
use std::process::Output;
use std::time::{Duration, Instant};

use strata_tests::*;

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn layers_in(store: &Path) -> usize {
    std::fs::read_dir(store.join("layers"))
        .map(|r| r.count())
        .unwrap_or(0)
}

fn make_tar(dir: &Path, name: &str, body: &str) -> std::path::PathBuf {
    let t = dir.join(name);
    let py = format!(
        "import tarfile, io\nwith tarfile.open({:?}, 'w') as tf:\n{}",
        t.display().to_string(),
        body
    );
    let o = std::process::Command::new("python3")
        .args(["-c", &py])
        .output()
        .expect("python3");
    assert!(o.status.success(), "{}", stderr(&o));
    t
}

const ADD: &str = "    def add(name, data=b'', type=tarfile.REGTYPE, linkname=''):\n        ti = tarfile.TarInfo(name); ti.type = type; ti.linkname = linkname\n        ti.size = len(data) if type == tarfile.REGTYPE else 0\n        tf.addfile(ti, io.BytesIO(data) if type == tarfile.REGTYPE else None)\n";

#[test]
fn hostile_and_broken_sources_are_refused() {
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    let work = scratch("bad");
    let w = work.path();

    // Missing source.
    let o = store.run(&["build", "/nonexistent/src", "-t", "bad:x"]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(stderr(&o).contains("/nonexistent/src"), "{}", stderr(&o));

    // Unreadable source: a socket cannot be opened as a tar file.
    let sock = w.join("sock");
    let _l = std::os::unix::net::UnixListener::bind(&sock).expect("socket");
    let o = store.run(&[
        "build",
        "--tar",
        sock.to_str().expect("utf8"),
        "-t",
        "bad:x",
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("sock"), "{}", stderr(&o));

    let cases = [
        ("dotdot.tar", format!("{ADD}    add('ok', b'fine')\n    add('a/../../etc/passwd', b'x')\n"), "..".to_string()),
        ("abs.tar", format!("{ADD}    add('/etc/shadow', b'x')\n"), "/etc/shadow".to_string()),
        ("hardlink.tar", format!("{ADD}    add('x', b'x')\n    add('evil', type=tarfile.LNKTYPE, linkname='../../etc/passwd')\n"), "evil".to_string()),
        ("via-symlink.tar", format!("{ADD}    add('d', type=tarfile.SYMTYPE, linkname='/etc')\n    add('d/passwd', b'x')\n"), "d/passwd".to_string()),
    ];
    for (name, body, needle) in &cases {
        let t = make_tar(w, name, body);
        let o = store.run(&["build", "--tar", t.to_str().expect("utf8"), "-t", "bad:x"]);
        assert!(!o.status.success(), "{name} was accepted");
        // Unsafe entries are bad data (exit 5, docs/CLI.md), a symlink escape too.
        assert_eq!(o.status.code(), Some(5), "{name}: {}", stderr(&o));
        assert!(
            stderr(&o).contains(needle.as_str()),
            "{name}: {}",
            stderr(&o)
        );
    }

    // Truncated tar (mid-file) and corrupt gzip.
    let good = make_tar(
        w,
        "good.tar",
        &format!("{ADD}    add('big', b'y' * 200000)\n    add('after', b'z')\n"),
    );
    let bytes = std::fs::read(&good).expect("read");
    let cut = w.join("cut.tar");
    std::fs::write(&cut, &bytes[..100_000]).expect("write");
    let o = store.run(&["build", "--tar", cut.to_str().expect("utf8"), "-t", "bad:x"]);
    assert_eq!(o.status.code(), Some(5), "truncated: {}", stderr(&o));
    let gz = w.join("bad.tar.gz");
    let st = std::process::Command::new("gzip")
        .args(["-k", good.to_str().expect("utf8")])
        .status()
        .expect("gzip");
    assert!(st.success());
    let mut z = std::fs::read(w.join("good.tar.gz")).expect("gz");
    let mid = z.len() / 2;
    for b in &mut z[mid..mid + 64] {
        *b ^= 0xff;
    }
    std::fs::write(&gz, &z).expect("write");
    let o = store.run(&["build", "--tar", gz.to_str().expect("utf8"), "-t", "bad:x"]);
    assert!(!o.status.success(), "corrupt gzip accepted");

    // Nothing was referenced.
    assert_eq!(
        layers_in(sdir.path()),
        0,
        "a failed build left a layer descriptor"
    );
    let o = store.run(&["inspect", "bad:x"]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    // A good build still works afterwards.
    store.ok(&[
        "build",
        "--tar",
        good.to_str().expect("utf8"),
        "-t",
        "good:x",
    ]);
}

#[test]
fn unreachable_store_fails_fast_with_its_url() {
    let store = StoreEnv {
        url: "s3://nobucket/x".into(),
        env: vec![
            ("AWS_ENDPOINT_URL".into(), "http://127.0.0.1:9".into()),
            ("AWS_ACCESS_KEY_ID".into(), "a".into()),
            ("AWS_SECRET_ACCESS_KEY".into(), "b".into()),
            ("AWS_ALLOW_HTTP".into(), "true".into()),
        ],
    };
    let start = Instant::now();
    let o = store.run(&["images"]);
    assert_eq!(o.status.code(), Some(6), "{}", stderr(&o));
    assert!(stderr(&o).contains("s3://nobucket"), "{}", stderr(&o));
    assert!(
        start.elapsed() < Duration::from_secs(60),
        "took {:?}",
        start.elapsed()
    );
}

fn corrupt_file(p: &Path, at: usize) {
    let mut b = std::fs::read(p).expect("read");
    let at = at.min(b.len() - 1);
    b[at] ^= 0x55;
    std::fs::write(p, b).expect("write");
}

#[test]
fn corrupted_objects_are_detected_when_read() {
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    let work = scratch("src");
    let data: Vec<u8> = (0..3_000_000u32)
        .map(|i| (i.wrapping_mul(40503) >> 7) as u8)
        .collect();
    std::fs::write(work.path().join("data.bin"), &data).expect("write");
    let layer = store.ok(&["build", work.path().to_str().expect("utf8"), "-t", "c:v1"]);
    assert_eq!(store.run(&["cat", "c:v1", "/data.bin"]).stdout, data);

    // Flip a byte inside the first frame of the blob.
    let blobs: Vec<_> = std::fs::read_dir(sdir.path().join("blobs"))
        .expect("blobs")
        .map(|e| e.expect("e").path())
        .collect();
    assert_eq!(blobs.len(), 1);
    corrupt_file(&blobs[0], 100);
    let o = store.run(&["cat", "c:v1", "/data.bin"]);
    assert_eq!(o.status.code(), Some(5), "{}", stderr(&o));
    assert!(o.stdout.is_empty(), "wrong bytes reached the output");
    let m = scratch("mat");
    let o = store.run(&["materialize", &layer, m.path().to_str().expect("utf8")]);
    assert_eq!(o.status.code(), Some(5), "{}", stderr(&o));

    // Corrupt the metadata object.
    let metas: Vec<_> = std::fs::read_dir(sdir.path().join("meta"))
        .expect("meta")
        .map(|e| e.expect("e").path())
        .collect();
    corrupt_file(&metas[0], 20);
    let o = store.run(&["ls", "c:v1"]);
    assert_eq!(o.status.code(), Some(5), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("corrupt") || stderr(&o).contains("zstd"),
        "{}",
        stderr(&o)
    );
}

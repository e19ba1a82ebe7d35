//! OCI images written by umoci for the import tests, and a helper that edits OCI layouts.
//!
//! [`umoci_image`] builds a five-layer image with umoci: every kind of entry ([`generate_tree`]), then
//! deletions and replacements (`umoci repack`), an opaque directory (`umoci insert --opaque`), a whiteout
//! (`umoci insert --whiteout`), whiteouts that hide nothing (`umoci raw add-layer`), and a config.
//! [`umoci_unpack`] extracts it as umoci does, for comparison. [`helper`] runs a small Python program
//! ([`HELPER`]) that rewrites blobs and the digests that name them, as a hostile or unusual writer would.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{diff, generate_tree, scratch, snapshot, Daemon, StoreEnv};

fn s(p: &Path) -> &str {
    p.to_str().expect("utf8 path")
}

/// The paths whose hard-link groups differ between an extracted image and overlay layers: the fifth
/// layer links to files of the layers below (extracted, one inode; under overlay, a copy).
pub const CROSS_LAYER_LINKS: [&str; 9] = [
    "ghostdir/biglink",
    "usr/lib/big.bin",
    "usr/big.hard",
    "ghostdir/hostlink",
    "ghostdir/hostlink2",
    "etc/hostname",
    "etc/hostname.hard",
    "ghostdir/symlink-hard",
    "usr/bin/link-rel",
];

/// True when umoci is installed (otherwise the caller skips, or fails in CI: see [`crate::have`]).
pub fn have_umoci() -> bool {
    crate::have(&[crate::Need::Umoci])
}

/// Runs a command, panics unless it succeeds, returns its standard output.
pub fn run(cmd: &str, args: &[&str]) -> String {
    let o = Command::new(cmd).args(args).output().expect(cmd);
    assert!(
        o.status.success(),
        "{cmd} {args:?}: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Layout surgery: `python3 -c HELPER CMD LAYOUT REF ARGS...`.
pub const HELPER: &str = r#"
import gzip, hashlib, io, json, os, shutil, subprocess, sys, tarfile
cmd, L, ref = sys.argv[1], sys.argv[2], sys.argv[3]
args = sys.argv[4:]
def path(d): return os.path.join(L, 'blobs', 'sha256', d.split(':', 1)[1])
def read(d): return open(path(d), 'rb').read()
def put(data):
    d = 'sha256:' + hashlib.sha256(data).hexdigest()
    open(path(d), 'wb').write(data)
    return d, len(data)
idx = json.load(open(os.path.join(L, 'index.json')))
i = [n for n, m in enumerate(idx['manifests'])
     if m.get('annotations', {}).get('org.opencontainers.image.ref.name') == ref][0]
man = json.loads(read(idx['manifests'][i]['digest']))
cfg = json.loads(read(man['config']['digest']))
def save(desc_list=None):
    man['config']['digest'], man['config']['size'] = put(json.dumps(cfg).encode())
    idx['manifests'][i]['digest'], idx['manifests'][i]['size'] = put(json.dumps(man).encode())
    json.dump(idx, open(os.path.join(L, 'index.json'), 'w'))
def uncompressed(n):
    data = read(man['layers'][n]['digest'])
    return gzip.decompress(data) if data[:2] == b'\x1f\x8b' else data
if cmd == 'media-type':
    man['layers'][int(args[0])]['mediaType'] = args[1]; save()
elif cmd == 'diff-id':
    cfg['rootfs']['diff_ids'][int(args[0])] = 'sha256:' + '0' * 64; save()
elif cmd == 'add-tar':
    data = open(args[0], 'rb').read()
    d, n = put(gzip.compress(data))
    man['layers'].append({'mediaType': 'application/vnd.oci.image.layer.v1.tar+gzip', 'digest': d, 'size': n})
    cfg['rootfs']['diff_ids'].append('sha256:' + hashlib.sha256(data).hexdigest()); save()
elif cmd == 'drop-layer':
    n = int(args[0]); man['layers'].pop(n); cfg['rootfs']['diff_ids'].pop(n); save()
elif cmd == 'zstd':
    for n, l in enumerate(man['layers']):
        z = subprocess.run(['zstd', '-q', '-c'], input=uncompressed(n), capture_output=True, check=True).stdout
        l['digest'], l['size'] = put(z)
        l['mediaType'] = 'application/vnd.oci.image.layer.v1.tar+zstd'
    save()
elif cmd == 'platforms':
    # A nested index: the image as linux/arm64 and as linux/amd64 (their configs differ only there).
    descs = []
    for arch in ['arm64', 'amd64']:
        cfg['architecture'] = arch
        m = dict(man); m['config'] = dict(man['config'])
        m['config']['digest'], m['config']['size'] = put(json.dumps(cfg).encode())
        d, n = put(json.dumps(m).encode())
        descs.append({'mediaType': 'application/vnd.oci.image.manifest.v1+json', 'digest': d, 'size': n,
                      'platform': {'os': 'linux', 'architecture': arch}})
    d, n = put(json.dumps({'schemaVersion': 2, 'mediaType': 'application/vnd.oci.image.index.v1+json',
                           'manifests': descs}).encode())
    idx['manifests'][i] = {'mediaType': 'application/vnd.oci.image.index.v1+json', 'digest': d, 'size': n,
                           'annotations': {'org.opencontainers.image.ref.name': ref}}
    json.dump(idx, open(os.path.join(L, 'index.json'), 'w'))
elif cmd == 'docker-archive':
    # style 'classic': <id>/layer.tar and <hex>.json; 'oci' (Docker 25+): blobs/sha256/<hex> for both.
    out, tag, style = args
    with tarfile.open(out, 'w') as t:
        def add(name, data):
            ti = tarfile.TarInfo(name); ti.size = len(data); t.addfile(ti, io.BytesIO(data))
        cfg_bytes = read(man['config']['digest'])
        hexname = lambda data: 'blobs/sha256/' + hashlib.sha256(data).hexdigest()
        cfg_name = man['config']['digest'].split(':')[1] + '.json' if style == 'classic' else hexname(cfg_bytes)
        layers = []
        for n in range(len(man['layers'])):
            data = uncompressed(n)
            layers.append('%d/layer.tar' % n if style == 'classic' else hexname(data)); add(layers[-1], data)
        add(cfg_name, cfg_bytes)
        add('manifest.json', json.dumps([{'Config': cfg_name, 'RepoTags': [tag], 'Layers': layers}]).encode())
else:
    sys.exit('unknown command ' + cmd)
"#;

/// Runs [`HELPER`]: `CMD LAYOUT REF ARGS...` (`args[0]` is the command).
pub fn helper(layout: &Path, reference: &str, args: &[&str]) {
    let mut full = vec!["-c", HELPER, args[0], s(layout), reference];
    full.extend_from_slice(&args[1..]);
    run("python3", &full);
}

/// The first layer's rootfs: every kind of entry and metadata ([`generate_tree`]; a tar holds no
/// sockets), and what the later layers delete or replace.
pub fn first_layer(r: &Path) {
    generate_tree(r);
    std::fs::remove_file(r.join("var/sock")).expect("rm socket");
    for (rel, data) in [
        ("data/gone/a", &b"to be deleted"[..]),
        ("data/gone/sub/b", b"to be deleted too"),
        ("data/keep", b"kept"),
        ("opq/old", b"hidden by an opaque directory"),
        ("opq/sub/old2", b"hidden too"),
        ("repl/child", b"a directory that becomes a file"),
        ("f2d", b"a file that becomes a directory"),
        (
            "etc/passwd",
            b"root:x:0:0:root:/root:/bin/sh\napp:x:4242:4343::/home/app:/bin/sh\n",
        ),
        ("etc/group", b"root:x:0:\napp:x:4343:\n"),
    ] {
        let p = r.join(rel);
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        std::fs::write(&p, data).expect("write");
    }
}

/// The second layer: deletions, replacements, rewrites, metadata changes, new hard links.
pub fn second_layer(r: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::remove_dir_all(r.join("data/gone")).expect("rm");
    std::fs::remove_file(r.join("etc/link-abs")).expect("rm");
    std::fs::remove_dir_all(r.join("repl")).expect("rm");
    std::fs::write(r.join("repl"), b"now a file").expect("write");
    std::fs::remove_file(r.join("f2d")).expect("rm");
    std::fs::create_dir_all(r.join("f2d")).expect("mkdir");
    std::fs::write(r.join("f2d/inside"), b"now a directory").expect("write");
    let mut big = std::fs::read(r.join("usr/lib/big.bin")).expect("read");
    big[1_500_000..1_500_100].fill(0x5a);
    std::fs::write(r.join("usr/lib/big.bin"), &big).expect("write");
    std::fs::set_permissions(
        r.join("etc/small.conf"),
        std::fs::Permissions::from_mode(0o600),
    )
    .expect("chmod");
    std::fs::create_dir_all(r.join("new")).expect("mkdir");
    std::fs::write(r.join("new/a"), vec![b'n'; 5000]).expect("write");
    std::fs::hard_link(r.join("new/a"), r.join("new/b")).expect("link");
    xattr::set(r.join("usr/share"), "user.changed", b"yes").expect("xattr");
}

/// Builds the umoci image `L:t` in `work/L`; returns the layout path. The fifth layer (added verbatim)
/// holds whiteouts that hide nothing, whiteouts and entries at the same path in both orders (a whiteout
/// never hides its own layer's entry; after a directory's content it makes it opaque), and hard links to
/// files of the layers below ([`CROSS_LAYER_LINKS`]).
pub fn umoci_image(work: &Path) -> PathBuf {
    let layout = work.join("L");
    let bundle = work.join("B");
    let image = format!("{}:t", s(&layout));
    run("umoci", &["init", "--layout", s(&layout)]);
    run("umoci", &["new", "--image", &image]);
    run("umoci", &["unpack", "--image", &image, s(&bundle)]);
    let rootfs = bundle.join("rootfs");
    first_layer(&rootfs);
    run(
        "umoci",
        &["repack", "--refresh-bundle", "--image", &image, s(&bundle)],
    );
    second_layer(&rootfs);
    run(
        "umoci",
        &["repack", "--refresh-bundle", "--image", &image, s(&bundle)],
    );
    let opq = work.join("opq-src");
    std::fs::create_dir_all(opq.join("fresh-dir")).expect("mkdir");
    std::fs::write(opq.join("fresh"), b"only this is left").expect("write");
    run(
        "umoci",
        &["insert", "--image", &image, "--opaque", s(&opq), "/opq"],
    );
    run(
        "umoci",
        &["insert", "--image", &image, "--whiteout", "/usr/share/doc"],
    );
    // A fifth layer, added verbatim: whiteouts that hide nothing (in a directory only this layer has,
    // and of a name no layer has); overlay would list them as broken entries if they were kept.
    let ghost = work.join("ghost.tar");
    run(
        "python3",
        &[
            "-c",
            "import tarfile, io, sys\nLINKS = [('ghostdir/biglink', 'usr/lib/big.bin'), ('ghostdir/hostlink', 'etc/hostname'), ('ghostdir/hostlink2', 'etc/hostname'), ('ghostdir/symlink-hard', 'usr/bin/link-rel')]\nwith tarfile.open(sys.argv[1], 'w') as t:\n    d = tarfile.TarInfo('ghostdir'); d.type = tarfile.DIRTYPE; d.mode = 0o755; t.addfile(d)\n    for n in ['ghostdir/.wh.nothing', 'data/.wh.nonexistent', 'ghostdir/kept', 'ghostdir/same', 'ghostdir/.wh.same', 'data/.wh.keep', 'data/keep', 'f2d/new', 'f2d/.wh.inside', '.wh.f2d']:\n        t.addfile(tarfile.TarInfo(n), io.BytesIO(b''))\n    for n, target in LINKS:\n        l = tarfile.TarInfo(n); l.type = tarfile.LNKTYPE; l.linkname = target; t.addfile(l)\n",
            s(&ghost),
        ],
    );
    run("umoci", &["raw", "add-layer", "--image", &image, s(&ghost)]);
    run(
        "umoci",
        &[
            "config",
            "--image",
            &image,
            "--config.env",
            "FOO=bar",
            "--config.env",
            "PATH=/usr/bin:/bin",
            "--config.entrypoint",
            "/bin/sh",
            "--config.cmd",
            "-c",
            "--config.cmd",
            "echo hi",
            "--config.workingdir",
            "/data",
            "--config.user",
            "app",
            "--config.label",
            "org.example.kind=test",
        ],
    );
    layout
}

/// The rootfs and runtime config `umoci unpack` makes of `layout:reference`.
pub fn umoci_unpack(work: &Path, layout: &Path, reference: &str) -> PathBuf {
    let out = work.join(format!("unpacked-{reference}"));
    run(
        "umoci",
        &[
            "unpack",
            "--image",
            &format!("{}:{reference}", s(layout)),
            s(&out),
        ],
    );
    out
}

/// Mounts `image` through a daemon on `store` and compares it with `expected` entry by entry.
pub fn compare_mounted(
    store: &StoreEnv,
    image: &str,
    expected: &Path,
    bundle_config: Option<&Path>,
) {
    let d = Daemon::start(store, &["--cache-size", "1G"]);
    let rootfs = d.ok(&["mount", image, "--sandbox", "cmp"]);
    // Overlay shows the root directory's times from the sandbox's upper directory (made at mount), and
    // a hard link to a lower layer's file as a copy (see `CROSS_LAYER_LINKS`).
    assert_same_tree(
        snapshot(expected),
        snapshot(Path::new(&rootfs)),
        &CROSS_LAYER_LINKS,
        &format!("{image} differs from umoci's rootfs"),
    );
    if let Some(umoci_config) = bundle_config {
        let dir = scratch("bundle");
        d.ok(&["bundle", image, "--sandbox", "bundle", s(dir.path())]);
        let ours =
            crate::json(&std::fs::read_to_string(dir.path().join("config.json")).expect("read"));
        let theirs = crate::json(&std::fs::read_to_string(umoci_config).expect("read"));
        for field in ["args", "cwd"] {
            assert_eq!(
                ours["process"][field], theirs["process"][field],
                "process.{field}"
            );
        }
        // A user name, resolved in the image's /etc/passwd by both.
        assert_eq!(ours["process"]["user"]["uid"], 4242);
        for id in ["uid", "gid"] {
            assert_eq!(
                ours["process"]["user"][id], theirs["process"]["user"][id],
                "process.user.{id}"
            );
        }
        let env = |v: &serde_json::Value| {
            let mut e: Vec<String> = v["process"]["env"]
                .as_array()
                .expect("env")
                .iter()
                .filter_map(|x| x.as_str().map(str::to_string))
                .filter(|x| !x.starts_with("TERM=") && !x.starts_with("HOME="))
                .collect();
            e.sort();
            e
        };
        assert_eq!(env(&ours), env(&theirs), "process.env");
    }
}

/// A tree snapshot ([`snapshot`]).
pub type Snapshot = std::collections::BTreeMap<Vec<u8>, crate::EntryInfo>;

/// Asserts two snapshots are equal, after making the root directory's time and the hard-link groups
/// of `relinked` (links across layers, which layers hold as copies) comparable.
pub fn assert_same_tree(mut want: Snapshot, mut got: Snapshot, relinked: &[&str], what: &str) {
    for snap in [&mut want, &mut got] {
        if let Some(root) = snap.get_mut(&b""[..]) {
            root.mtime = (0, 0);
        }
        for p in relinked {
            if let Some(e) = snap.get_mut(p.as_bytes()) {
                e.link_group = None;
            }
        }
    }
    let diffs = diff(&want, &got);
    assert!(diffs.is_empty(), "{what}:\n{}", diffs.join("\n"));
}

/// This machine's platform as OCI names it (the default of `--platform`).
pub fn host_platform() -> &'static str {
    if cfg!(target_arch = "aarch64") {
        "linux/arm64"
    } else {
        "linux/amd64"
    }
}

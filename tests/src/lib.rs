//! Support for strata's integration tests: an S3 server on loopback (moto, or Ceph's radosgw: [`S3Server`]), the CLI under test, a
//! generator of trees holding every kind of entry and metadata, and an entry-by-entry snapshot of a tree
//! for comparing a source with what the kernel (or `strata ls`/`cat`) shows.

pub mod containerd;
mod daemon;
pub mod hostile;
pub mod machines;
pub mod oci;
pub mod proxy;
pub mod readers;
pub mod registry;
mod s3;
pub mod smallfs;
pub mod soak;
pub mod tagrace;
pub mod vm;

pub use daemon::{effective_mount_mode, held, stratad_check, test_mount_mode, Daemon};
pub use s3::{real_s3, S3Server};

/// Stores manifest `n` of a family of distinct, empty manifests (no layers; told apart by an
/// annotation), for tests of tags, which need manifests that exist and nothing more.
pub fn numbered_manifest(
    store: &strata_registry::store::Store,
    n: usize,
) -> strata_registry::digest::Digest {
    let m = strata_registry::model::Manifest {
        schema: strata_registry::model::SCHEMA,
        layers: vec![],
        config: Default::default(),
        annotations: [("n".to_string(), n.to_string())].into(),
    };
    store.put_manifest(&m).expect("manifest")
}

use std::collections::BTreeMap;
use std::ffi::{CString, OsStr};
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// A binary of this package, next to the running test executable's `deps/` directory (cargo builds
/// a package's binaries before running its integration tests).
pub(crate) fn sibling_bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe
        .parent()
        .and_then(|d| {
            if d.ends_with("deps") {
                d.parent()
            } else {
                Some(d)
            }
        })
        .expect("target dir");
    dir.join(name)
}

/// Path of the `strata` CLI built for these tests.
pub fn strata_bin() -> PathBuf {
    sibling_bin("strata-under-test")
}

/// Path of the full CLI the lean `strata` under test hands store commands to.
pub fn strata_full_bin() -> PathBuf {
    sibling_bin("strata-under-test-full")
}

/// Path of the `pack_diff` program built for these tests.
pub fn pack_diff_bin() -> PathBuf {
    sibling_bin("pack_diff-under-test")
}

/// A scratch directory on a disk filesystem (the kernel refuses EROFS metadata on tmpfs or overlayfs).
pub fn scratch(label: &str) -> tempfile::TempDir {
    let base = Path::new("/var/tmp/strata-tests");
    let _ = std::fs::create_dir_all(base);
    tempfile::Builder::new()
        .prefix(&format!("{label}-"))
        .tempdir_in(base)
        .expect("scratch dir under /var/tmp")
}

/// True when running as root.
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

pub use strata_registry::testing::{require, strict};

/// Something a test needs that a machine may lack. [`have`] checks it through [`require`]: missing, the
/// test skips (logged, and counted by `scripts/test`), or fails when `CI=true` or `STRATA_REQUIRE_ALL=1`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// Root, kernel EROFS and /dev/fuse: real mounts through the node daemon.
    Mount,
    /// Root and kernel EROFS: kernel mounts of images we write.
    KernelErofs,
    /// Root and /dev/fuse (no kernel EROFS): the tree server's mounts, overlays on them.
    Fuse,
    /// moto's S3 server (`scripts/setup` installs it).
    Moto,
    Bwrap,
    Runc,
    Umoci,
    /// erofs-utils: `mkfs.erofs`, `fsck.erofs`.
    ErofsUtils,
    /// `qemu-system-x86_64` and `mkfs.ext4`, for microVMs.
    Qemu,
    /// A registry on loopback: `docker-registry`, `skopeo` and `htpasswd`.
    Registry,
    /// containerd 1.6+, `ctr` and the runc shim (`apt-get install containerd`).
    Containerd,
    /// What [`Need::Mount`] needs and fanotify pre-content events (Linux 6.14+): `fanotify` mode.
    PreContent,
}

/// True when `program --version` (or `--help`) runs.
fn runs(program: &str) -> bool {
    ["--version", "--help"].iter().any(|arg| {
        Command::new(program)
            .arg(arg)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    })
}

impl Need {
    fn what(self) -> &'static str {
        match self {
            Need::Mount => "root, kernel EROFS and /dev/fuse",
            Need::KernelErofs => "root and kernel EROFS",
            Need::Fuse => "root and /dev/fuse",
            Need::Moto => "moto[server] (scripts/setup installs it)",
            Need::Bwrap => "bwrap (apt-get install bubblewrap)",
            Need::Runc => "runc (apt-get install runc)",
            Need::Umoci => "umoci (scripts/setup installs it)",
            Need::ErofsUtils => "mkfs.erofs and fsck.erofs (apt-get install erofs-utils)",
            Need::Qemu => {
                "qemu-system-x86_64 and mkfs.ext4 (apt-get install qemu-system-x86 e2fsprogs)"
            }
            Need::Registry => "docker-registry, skopeo and htpasswd (scripts/setup installs them)",
            Need::Containerd => {
                "containerd, ctr and containerd-shim-runc-v2 (scripts/setup installs them)"
            }
            Need::PreContent => {
                "root, kernel EROFS, /dev/fuse and Linux 6.14+ (pre-content events)"
            }
        }
    }

    fn present(self) -> bool {
        match self {
            Need::Mount => is_root() && kernel_has_erofs() && Path::new("/dev/fuse").exists(),
            Need::KernelErofs => is_root() && kernel_has_erofs(),
            Need::Fuse => is_root() && Path::new("/dev/fuse").exists(),
            Need::Moto => Command::new("python3")
                .args(["-c", "import moto.server, flask"])
                .output()
                .is_ok_and(|o| o.status.success()),
            Need::Bwrap => runs("bwrap"),
            Need::Runc => runs("runc"),
            Need::Umoci => runs("umoci"),
            Need::ErofsUtils => runs("mkfs.erofs") && runs("fsck.erofs"),
            Need::Qemu => {
                runs("qemu-system-x86_64")
                    && Command::new("mkfs.ext4")
                        .arg("-V")
                        .output()
                        .is_ok_and(|o| o.status.success())
            }
            Need::Registry => {
                runs("docker-registry") && runs("skopeo") && Path::new("/usr/bin/htpasswd").exists()
            }
            Need::Containerd => {
                runs("containerd") && runs("ctr") && runs("containerd-shim-runc-v2") && runs("runc")
            }
            Need::PreContent => Need::Mount.present() && pre_content_events(),
        }
    }
}

/// Whether this kernel takes fanotify pre-content marks, probed as stratad probes it
/// (`strata_fs::modes::probe`), not read from its version: a 6.14+ kernel built without
/// `CONFIG_FANOTIFY_ACCESS_PERMISSIONS` has none. Probed once per test process.
fn pre_content_events() -> bool {
    static HAVE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAVE.get_or_init(|| {
        let dir = scratch("pre-content-probe");
        strata_fs::modes::probe(dir.path()).pre_content.is_none()
    })
}

/// Whether the running kernel is at least `major.minor`.
pub fn kernel_at_least(major: u32, minor: u32) -> bool {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut parts = release
        .trim()
        .split(['.', '-'])
        .map(|p| p.parse::<u32>().unwrap_or(0));
    let have = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    have >= (major, minor)
}

/// True when every one of `needs` is here; otherwise the test skips (or, in CI, fails) — see [`Need`].
pub fn have(needs: &[Need]) -> bool {
    needs.iter().all(|n| require(n.what(), n.present()))
}

/// True when this test can mount (root, kernel EROFS, /dev/fuse); see [`have`].
pub fn can_mount() -> bool {
    have(&[Need::Mount])
}

/// Parses JSON output, naming it on failure.
pub fn json(s: &str) -> serde_json::Value {
    serde_json::from_str(s).unwrap_or_else(|e| panic!("bad JSON {s:?}: {e}"))
}

/// `n` incompressible bytes (xorshift), the same for the same seed.
pub fn random_bytes(n: usize, seed: u32) -> Vec<u8> {
    let mut x = seed.wrapping_mul(2654435761) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

/// Reads `path` through a sandbox after its store came back, retrying for up to `within`: a chunk whose
/// read just timed out fails at once for a second, and fetches the outage held wait out the store's own
/// deadline (docs/DAEMON.md, "Reads that cannot be served").
pub fn read_when_back(path: &Path, within: Duration) -> Vec<u8> {
    let start = Instant::now();
    loop {
        match std::fs::read(path) {
            Ok(b) => return b,
            Err(e) => assert!(
                start.elapsed() < within,
                "{} still failing {:?} after the store came back: {e}",
                path.display(),
                start.elapsed()
            ),
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// True when the kernel has EROFS.
pub fn kernel_has_erofs() -> bool {
    std::fs::read_to_string("/proc/filesystems")
        .map(|s| s.lines().any(|l| l.trim_end().ends_with("erofs")))
        .unwrap_or(false)
}

/// A store the CLI can be pointed at: its URL and the environment it needs.
#[derive(Clone, Debug)]
pub struct StoreEnv {
    pub url: String,
    pub env: Vec<(String, String)>,
}

impl StoreEnv {
    /// A local store in `dir`.
    pub fn local(dir: &Path) -> StoreEnv {
        StoreEnv {
            url: format!("file://{}", dir.display()),
            // The store-wide index cache of this test, inside the store (which lists no such prefix).
            env: vec![(
                "STRATA_INDEX_CACHE".into(),
                dir.join(".index-cache").display().to_string(),
            )],
        }
    }

    /// Runs `strata ARGS` against this store.
    pub fn run(&self, args: &[&str]) -> Output {
        self.run_with_stdin(args, None)
    }

    /// The command `strata --store URL ARGS` with this store's environment, not started.
    pub fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(strata_bin());
        c.arg("--store").arg(&self.url).args(args);
        for (k, v) in &self.env {
            c.env(k, v);
        }
        c
    }

    /// Runs `strata ARGS` with bytes on standard input.
    pub fn run_with_stdin(&self, args: &[&str], stdin: Option<&[u8]>) -> Output {
        let mut c = self.command(args);
        c.stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        });
        c.stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = c.spawn().expect("spawn strata");
        if let Some(data) = stdin {
            let mut si = child.stdin.take().expect("stdin");
            let data = data.to_vec();
            std::thread::spawn(move || {
                let _ = si.write_all(&data);
            });
        }
        child.wait_with_output().expect("wait for strata")
    }

    /// Runs `strata ARGS`, panics unless it succeeds, returns trimmed standard output.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(
            out.status.success(),
            "strata {args:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// Builds directory `src` as a workspace layer on image `base` and tags `base` with it on top as
    /// `tag`; returns the layer's digest.
    pub fn workspace_image(&self, src: &Path, base: &str, tag: &str) -> String {
        let src = src.to_str().expect("utf8");
        let layer = self.ok(&["build", src, "--kind", "workspace", "--on", base]);
        self.ok(&["compose", "--base", base, "--workspace", &layer, "-t", tag]);
        layer
    }

    /// Opens the store in-process (for library-level checks).
    pub fn open(&self) -> strata_registry::store::Store {
        for (k, v) in &self.env {
            std::env::set_var(k, v);
        }
        strata_registry::store::Store::open(&self.url).expect("open store")
    }
}

fn cpath(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).expect("no NUL in path")
}

/// Sets a file's mtime (seconds, nanoseconds) without following symlinks.
pub fn set_mtime(p: &Path, sec: i64, nsec: i64) {
    let ts = [
        libc::timespec {
            tv_sec: sec,
            tv_nsec: nsec,
        },
        libc::timespec {
            tv_sec: sec,
            tv_nsec: nsec,
        },
    ];
    let c = cpath(p);
    // SAFETY: valid NUL-terminated path and a two-element timespec array.
    let r = unsafe {
        libc::utimensat(
            libc::AT_FDCWD,
            c.as_ptr(),
            ts.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    assert_eq!(r, 0, "utimensat {}", p.display());
}

/// lchown.
pub fn lchown(p: &Path, uid: u32, gid: u32) {
    let c = cpath(p);
    // SAFETY: valid NUL-terminated path.
    let r = unsafe { libc::lchown(c.as_ptr(), uid, gid) };
    assert_eq!(r, 0, "lchown {}", p.display());
}

/// mknod.
pub fn mknod(p: &Path, mode: u32, major: u32, minor: u32) {
    let c = cpath(p);
    // SAFETY: valid NUL-terminated path.
    let r = unsafe { libc::mknod(c.as_ptr(), mode, libc::makedev(major, minor)) };
    assert_eq!(
        r,
        0,
        "mknod {}: {}",
        p.display(),
        std::io::Error::last_os_error()
    );
}

/// Fills `root` with every kind of entry and metadata a layer must keep. Needs root for devices,
/// ownership and trusted.* xattrs; without root those parts are left out.
pub fn generate_tree(root: &Path) {
    let root_user = is_root();
    let w = |rel: &str, data: &[u8]| {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        std::fs::write(&p, data).expect("write");
        p
    };
    // Regular files: empty, tiny (inline), small (grouped), multi-chunk with a short tail, dedup copies.
    w("empty", b"");
    w("etc/hostname", b"sandbox\n");
    w("etc/small.conf", &vec![b'x'; 3000]);
    let big: Vec<u8> = (0..(2 * 1048576 + 12345))
        .map(|i: u32| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    w("usr/lib/big.bin", &big);
    w("usr/lib/big-copy.bin", &big);
    for i in 0..40 {
        w(
            &format!("usr/share/doc/file{i:02}.txt"),
            format!("document {i}\n").repeat(50 + i * 37).as_bytes(),
        );
    }
    // Sparse file: 3 MiB hole, 5 bytes, 2 MiB hole.
    let sp = root.join("var/sparse.img");
    std::fs::create_dir_all(sp.parent().expect("parent")).expect("mkdir");
    {
        let f = std::fs::File::create(&sp).expect("sparse");
        use std::os::unix::fs::FileExt;
        f.write_all_at(b"hello", 3 << 20).expect("write");
        f.set_len(5 << 20).expect("set_len");
    }
    // Permission bits.
    let bin = w("usr/bin/tool", b"#!/bin/sh\necho tool\n");
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o4755)).expect("chmod");
    let sg = w("usr/bin/sgid", b"sgid");
    std::fs::set_permissions(&sg, std::fs::Permissions::from_mode(0o2711)).expect("chmod");
    let tmp = root.join("tmp");
    std::fs::create_dir_all(&tmp).expect("mkdir");
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o1777)).expect("chmod");
    // Symlinks, hard links.
    std::os::unix::fs::symlink("../lib/big.bin", root.join("usr/bin/link-rel")).expect("symlink");
    std::os::unix::fs::symlink("/etc/hostname", root.join("etc/link-abs")).expect("symlink");
    std::fs::hard_link(root.join("etc/hostname"), root.join("etc/hostname.hard")).expect("link");
    std::fs::hard_link(root.join("usr/lib/big.bin"), root.join("usr/big.hard")).expect("link");
    // Fifo, socket.
    let fifo = cpath(&root.join("var/fifo"));
    // SAFETY: valid path.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o640) }, 0);
    let sock = root.join("var/sock");
    drop(std::os::unix::net::UnixListener::bind(&sock).expect("socket"));
    // Odd names: 255 bytes, non-UTF-8.
    let long = "n".repeat(255);
    w(&format!("names/{long}"), b"long name");
    let odd = root
        .join("names")
        .join(OsStr::from_bytes(b"bin\xff\xfe name"));
    std::fs::write(&odd, b"odd").expect("odd name");
    // Deep tree.
    let mut deep = root.join("deep");
    for i in 0..60 {
        deep = deep.join(format!("d{i}"));
    }
    std::fs::create_dir_all(&deep).expect("deep");
    std::fs::write(deep.join("leaf"), b"leaf").expect("leaf");
    // A large directory.
    let many = root.join("many");
    std::fs::create_dir_all(&many).expect("mkdir");
    for i in 0..3000 {
        std::fs::write(many.join(format!("entry-{i:05}")), b"").expect("many");
    }
    // xattrs.
    xattr::set(root.join("etc/hostname"), "user.origin", b"generated").expect("user xattr");
    xattr::set(root.join("etc"), "user.dir", b"d").expect("dir xattr");
    if root_user {
        xattr::set(root.join("usr/bin/tool"), "trusted.note", b"t").expect("trusted xattr");
        // cap_net_bind_service=+ep, VFS_CAP_REVISION_2.
        let cap: [u8; 20] = [0, 0, 0, 2, 0, 4, 0, 0, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        xattr::set(root.join("usr/bin/sgid"), "security.capability", &cap).expect("capability");
        mknod(&root.join("dev-null"), libc::S_IFCHR | 0o666, 1, 3);
        mknod(&root.join("dev-blk"), libc::S_IFBLK | 0o660, 259, 70000);
        lchown(&root.join("etc/hostname"), 1000, 1000);
        lchown(&root.join("usr/lib/big.bin"), 100000, 70000);
        lchown(&root.join("etc/link-abs"), 5, 6);
    }
    // Times with nanoseconds, set last, children before parents.
    let mut all: Vec<PathBuf> = walkdir::WalkDir::new(root)
        .into_iter()
        .filter_map(|e| e.ok())
        .map(|e| e.into_path())
        .collect();
    all.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for (i, p) in all.iter().enumerate() {
        set_mtime(
            p,
            1_600_000_000 + i as i64,
            (i as i64 * 7919) % 1_000_000_000,
        );
    }
}

/// What a comparison looks at, for one entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EntryInfo {
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub mtime: (i64, i64),
    pub size: u64,
    pub content: Option<String>,
    pub target: Option<Vec<u8>>,
    pub rdev: u64,
    pub xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    /// First path (in sorted order) sharing this inode, for hard-link groups.
    pub link_group: Option<Vec<u8>>,
}

/// An entry-by-entry snapshot of a tree, keyed by relative path ("" is the root).
pub fn snapshot(root: &Path) -> BTreeMap<Vec<u8>, EntryInfo> {
    let mut out = BTreeMap::new();
    let mut inodes: BTreeMap<u64, Vec<u8>> = BTreeMap::new();
    let mut entries: Vec<walkdir::DirEntry> = walkdir::WalkDir::new(root)
        .sort_by_file_name()
        .into_iter()
        .map(|e| e.expect("walk"))
        .collect();
    entries.sort_by(|a, b| a.path().cmp(b.path()));
    for e in entries {
        let p = e.path();
        let rel = p
            .strip_prefix(root)
            .expect("prefix")
            .as_os_str()
            .as_bytes()
            .to_vec();
        let m = std::fs::symlink_metadata(p).expect("lstat");
        let ft = m.file_type();
        let content = ft.is_file().then(|| {
            let data = std::fs::read(p).expect("read");
            blake3::hash(&data).to_hex().to_string()
        });
        let target = ft.is_symlink().then(|| {
            std::fs::read_link(p)
                .expect("readlink")
                .as_os_str()
                .as_bytes()
                .to_vec()
        });
        let mut xattrs: Vec<(Vec<u8>, Vec<u8>)> = xattr::list(p)
            .map(|names| {
                names
                    .filter_map(|n| {
                        let v = xattr::get(p, &n).ok().flatten()?;
                        Some((n.as_bytes().to_vec(), v))
                    })
                    .collect()
            })
            .unwrap_or_default();
        xattrs.sort();
        let link_group = (!ft.is_dir() && m.nlink() > 1)
            .then(|| inodes.entry(m.ino()).or_insert_with(|| rel.clone()).clone());
        out.insert(
            rel,
            EntryInfo {
                mode: m.mode(),
                uid: m.uid(),
                gid: m.gid(),
                mtime: (m.mtime(), m.mtime_nsec()),
                size: if ft.is_dir() { 0 } else { m.size() },
                content,
                target,
                rdev: if ft.is_char_device() || ft.is_block_device() {
                    m.rdev()
                } else {
                    0
                },
                xattrs,
                link_group,
            },
        );
    }
    out
}

use std::os::unix::fs::FileTypeExt;

/// Compares two snapshots; returns a readable list of differences (empty when equal).
pub fn diff(a: &BTreeMap<Vec<u8>, EntryInfo>, b: &BTreeMap<Vec<u8>, EntryInfo>) -> Vec<String> {
    let mut out = Vec::new();
    for (k, va) in a {
        let name = String::from_utf8_lossy(k);
        match b.get(k) {
            None => out.push(format!("missing: {name}")),
            Some(vb) if va != vb => {
                out.push(format!("differs: {name}\n  source {va:?}\n  result {vb:?}"))
            }
            _ => {}
        }
    }
    for k in b.keys() {
        if !a.contains_key(k) {
            out.push(format!("extra: {}", String::from_utf8_lossy(k)));
        }
    }
    out
}

/// Runs `fsck.erofs` on a materialized layer (`DIR/meta.erofs`, `DIR/devices/N`).
pub fn fsck_erofs(dir: &Path) -> Output {
    let mut c = Command::new("fsck.erofs");
    for d in &materialized_devices(dir) {
        c.arg(format!("--device={}", d.display()));
    }
    c.arg(dir.join("meta.erofs"));
    c.output()
        .expect("run fsck.erofs (apt-get install erofs-utils)")
}

/// A materialized layer mounted by the kernel (file-backed EROFS, one device per blob); unmounted on drop.
pub struct KernelMount {
    pub target: PathBuf,
}

impl KernelMount {
    /// Mounts the layer materialized in `dir` (`strata materialize`) at `target`.
    pub fn new(dir: &Path, target: &Path) -> KernelMount {
        std::fs::create_dir_all(target).expect("mountpoint");
        strata_fs::mount::mount_erofs(&dir.join("meta.erofs"), &materialized_devices(dir), target)
            .expect("kernel EROFS mount");
        KernelMount {
            target: target.to_path_buf(),
        }
    }
}

impl Drop for KernelMount {
    fn drop(&mut self) {
        let _ = strata_fs::mount::unmount(&self.target, true);
    }
}

/// `strata materialize LAYER` into a scratch directory, checked by `fsck.erofs`; `None` (skipped) without
/// erofs-utils.
pub fn materialize_checked(store: &StoreEnv, layer: &str) -> Option<tempfile::TempDir> {
    if !have(&[Need::ErofsUtils]) {
        return None;
    }
    let m = scratch("materialized");
    store.ok(&["materialize", layer, m.path().to_str().expect("utf8")]);
    let o = fsck_erofs(m.path());
    assert!(
        o.status.success(),
        "fsck.erofs of {layer}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    Some(m)
}

/// The device files of a materialized layer, in device order.
pub fn materialized_devices(dir: &Path) -> Vec<PathBuf> {
    let mut devs: Vec<PathBuf> = std::fs::read_dir(dir.join("devices"))
        .map(|r| r.filter_map(|e| e.ok()).map(|e| e.path()).collect())
        .unwrap_or_default();
    devs.sort_by_key(|p| {
        p.file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.parse::<u32>().ok())
            .unwrap_or(0)
    });
    devs
}

/// Path of the `stratad` daemon built for these tests.
pub fn stratad_bin() -> PathBuf {
    sibling_bin("stratad-under-test")
}

/// Path of a "stratad" that passes a version probe and exits at once when started (`broken-stratad`).
pub fn broken_stratad_bin() -> PathBuf {
    sibling_bin("broken-stratad")
}

/// A busybox root filesystem (from Debian's busybox-static) in `root`.
pub fn busybox_rootfs(root: &Path) {
    for d in ["bin", "etc", "tmp", "proc", "sys", "dev", "root", "data"] {
        std::fs::create_dir_all(root.join(d)).expect("mkdir");
    }
    std::fs::copy("/bin/busybox", root.join("bin/busybox"))
        .expect("busybox-static (apt-get install busybox-static)");
    for app in [
        "sh", "ls", "cat", "echo", "md5sum", "dd", "head", "wc", "rm", "mkdir", "sleep", "stat",
        "find", "true",
    ] {
        std::os::unix::fs::symlink("busybox", root.join("bin").join(app)).expect("symlink");
    }
    std::fs::write(root.join("etc/os-release"), "ID=strata-test\n").expect("write");
    std::fs::write(root.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n").expect("write");
}

/// Builds image `tag` in `store`: a busybox rootfs with `files` in `/data`.
pub fn build_image(store: &StoreEnv, tag: &str, files: &[(&str, Vec<u8>)]) {
    let src = scratch("img");
    busybox_rootfs(src.path());
    for (name, data) in files {
        std::fs::write(src.path().join("data").join(name), data).expect("write");
    }
    store.ok(&["build", src.path().to_str().expect("utf8"), "-t", tag]);
}

/// Runs `cmd` as uid and gid 65534 (nobody, nogroup); true if it succeeded.
pub fn as_nobody(cmd: &[&str]) -> bool {
    std::process::Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .args(cmd)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .expect("setpriv (util-linux)")
        .success()
}

/// Runs a command inside `rootfs` with bubblewrap; returns its output.
pub fn bwrap(rootfs: &Path, cmd: &[&str]) -> Output {
    Command::new("bwrap")
        .arg("--bind")
        .arg(rootfs)
        .arg("/")
        .args([
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--unshare-pid",
            "--die-with-parent",
            "--",
        ])
        .args(cmd)
        .output()
        .expect("bwrap (apt-get install bubblewrap)")
}

//! Tests of the directory source.

use super::*;
use std::os::unix::fs::{symlink, FileExt, PermissionsExt};

/// A file's data as the sink got it: a path (and the sparse flag), or streamed bytes.
#[derive(Debug, PartialEq)]
enum Data {
    Path(PathBuf, bool),
    Bytes(Vec<u8>),
}

/// Records entries; with `keep_last_only`, checks each path extends the previous one by one name and
/// keeps only the last entry (a 10,000-deep tree has 100 MB of paths).
#[derive(Default)]
struct Rec {
    entries: Vec<(Entry, Option<Data>)>,
    keep_last_only: bool,
    count: usize,
}

impl EntrySink for Rec {
    fn add(&mut self, entry: Entry, data: Option<FileSource<'_>>) -> Result<(), BuildError> {
        assert_eq!(data.is_some(), matches!(entry.kind, EntryKind::File { .. }));
        let data = match data {
            None => None,
            Some(FileSource::Path { path, sparse }) => Some(Data::Path(path, sparse)),
            Some(FileSource::Stream(r)) => {
                let mut v = Vec::new();
                r.read_to_end(&mut v)
                    .map_err(|e| BuildError::io("stream", e))?;
                Some(Data::Bytes(v))
            }
        };
        if self.keep_last_only {
            if let Some((prev, _)) = self.entries.pop() {
                assert!(entry.path.starts_with(&prev.path));
                let name = &entry.path[prev.path.len()..];
                assert!(!name[1..].contains(&b'/') && (prev.path.is_empty() || name[0] == b'/'));
            }
        }
        self.count += 1;
        self.entries.push((entry, data));
        Ok(())
    }
}

impl Rec {
    fn get(&self, path: &[u8]) -> &(Entry, Option<Data>) {
        let found = self.entries.iter().find(|(e, _)| e.path == path);
        found.unwrap_or_else(|| panic!("no entry {}", String::from_utf8_lossy(path)))
    }
}

fn tmp() -> (tempfile::TempDir, PathBuf) {
    let t = tempfile::Builder::new()
        .prefix("strata-dir-")
        .tempdir_in("/var/tmp")
        .unwrap();
    let root = t.path().join("root");
    std::fs::create_dir(&root).unwrap();
    (t, root)
}

fn c(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap()
}

fn check(rc: libc::c_int, what: &str) {
    assert!(rc == 0, "{what}: {}", io::Error::last_os_error());
}

fn setxattr(p: &Path, name: &CStr, value: &[u8]) {
    let (v, n) = (value.as_ptr().cast(), value.len());
    check(
        unsafe { libc::lsetxattr(c(p).as_ptr(), name.as_ptr(), v, n, 0) },
        "lsetxattr",
    );
}

fn walk(root: &Path) -> Rec {
    let mut rec = Rec::default();
    walk_dir(root, &mut rec).unwrap();
    rec
}

/// Makes one entry of every kind under `root`, with metadata to check: returns the paths of the
/// regular file `a.txt` and of the sparse file.
fn every_kind_of_entry(root: &Path) -> (PathBuf, PathBuf) {
    setxattr(root, c"user.root", b"r");
    let a = root.join("a.txt");
    std::fs::write(&a, b"hello").unwrap();
    check(
        unsafe { libc::lchown(c(&a).as_ptr(), 100_000, 100_001) },
        "lchown",
    );
    std::fs::set_permissions(&a, std::fs::Permissions::from_mode(0o4755)).unwrap();
    setxattr(&a, c"user.b", b"2");
    setxattr(&a, c"user.a", b"1\n\0binary");
    setxattr(&a, c"trusted.t", b"x");
    let ts = libc::timespec {
        tv_sec: 1_600_000_000,
        tv_nsec: 123_456_789,
    };
    let rc = unsafe { libc::utimensat(libc::AT_FDCWD, c(&a).as_ptr(), [ts, ts].as_ptr(), 0) };
    check(rc, "utimensat");
    let sparse = root.join("sparse");
    let f = File::create(&sparse).unwrap();
    f.set_len(10 << 20).unwrap();
    f.write_at(b"x", 5 << 20).unwrap();
    let dir = root.join("dir");
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o1777)).unwrap();
    std::fs::write(dir.join("inner"), b"").unwrap();
    std::fs::write(root.join("hl1"), b"linked").unwrap();
    std::fs::hard_link(root.join("hl1"), dir.join("hl2")).unwrap();
    let target: &[u8] = b"../\xff\xfe/target";
    symlink(OsStr::from_bytes(target), root.join("link")).unwrap();
    setxattr(&root.join("link"), c"trusted.on-link", b"s");
    check(
        unsafe { libc::mkfifo(c(&root.join("fifo")).as_ptr(), 0o640) },
        "mkfifo",
    );
    for (name, kind, dev) in [
        ("null", libc::S_IFCHR, (1, 3)),
        ("blk", libc::S_IFBLK, (7, 0)),
    ] {
        let dev = libc::makedev(dev.0, dev.1);
        check(
            unsafe { libc::mknod(c(&root.join(name)).as_ptr(), kind | 0o600, dev) },
            "mknod",
        );
    }
    let sock = std::os::unix::net::UnixListener::bind(root.join("sock")).unwrap();
    std::fs::write(root.join(OsStr::from_bytes(b"name-\xff\xfe")), b"odd").unwrap();
    // A socket's entry outlives its listener.
    drop(sock);
    (a, sparse)
}

#[test]
fn every_kind_of_entry_with_its_metadata() {
    let (_t, root) = tmp();
    let (a, sparse) = every_kind_of_entry(&root);
    let target: &[u8] = b"../\xff\xfe/target";
    let rec = walk(&root);
    let got: Vec<(&[u8], EntryKind)> = rec
        .entries
        .iter()
        .map(|(e, _)| (&e.path[..], e.kind.clone()))
        .collect();
    let file = |size| EntryKind::File { size };
    let expected: Vec<(&[u8], EntryKind)> = vec![
        (b"", EntryKind::Dir),
        (b"a.txt", file(5)),
        (
            b"blk",
            EntryKind::BlockDev {
                rdev: libc::makedev(7, 0),
            },
        ),
        (b"dir", EntryKind::Dir),
        (b"dir/hl2", file(6)),
        (b"dir/inner", file(0)),
        (b"fifo", EntryKind::Fifo),
        (b"hl1", EntryKind::HardLink(b"dir/hl2".to_vec())),
        (b"link", EntryKind::Symlink(target.to_vec())),
        (b"name-\xff\xfe", file(3)),
        (
            b"null",
            EntryKind::CharDev {
                rdev: libc::makedev(1, 3),
            },
        ),
        (b"sock", EntryKind::Socket),
        (b"sparse", file(10 << 20)),
    ];
    assert_eq!(got, expected);
    let xattr = |k: &[u8], v: &[u8]| (k.to_vec(), v.to_vec());
    assert_eq!(rec.get(b"").0.meta.xattrs, [xattr(b"user.root", b"r")]);
    let (e, d) = rec.get(b"a.txt");
    assert_eq!(d, &Some(Data::Path(a, false)));
    assert_eq!(
        (e.meta.perm, e.meta.uid, e.meta.gid),
        (0o4755, 100_000, 100_001)
    );
    assert_eq!(
        (e.meta.mtime, e.meta.mtime_nsec),
        (1_600_000_000, 123_456_789)
    );
    let want = [
        xattr(b"trusted.t", b"x"),
        xattr(b"user.a", b"1\n\0binary"),
        xattr(b"user.b", b"2"),
    ];
    assert_eq!(e.meta.xattrs, want);
    assert_eq!(rec.get(b"sparse").1, Some(Data::Path(sparse, true)));
    assert_eq!(rec.get(b"dir").0.meta.perm, 0o1777);
    assert_eq!(rec.get(b"fifo").0.meta.perm, 0o640);
    assert_eq!(
        rec.get(b"link").0.meta.xattrs,
        [xattr(b"trusted.on-link", b"s")]
    );
}

/// Makes (or, with `remove`, removes) `depth` nested directories `name` with a file `bottom`, never
/// using a long path (and quickly: `rm -rf` takes minutes on 10,000 levels).
fn deep(base: &Path, depth: usize, name: &CStr, remove: bool) {
    let dir = libc::O_RDONLY | libc::O_DIRECTORY;
    let mut fd = open_at(libc::AT_FDCWD, &c(base), dir).unwrap();
    for _ in 0..depth {
        if !remove {
            check(
                unsafe { libc::mkdirat(fd.as_raw_fd(), name.as_ptr(), 0o755) },
                "mkdirat",
            );
        }
        fd = open_at(fd.as_raw_fd(), name, dir).unwrap();
    }
    if !remove {
        let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_CLOEXEC;
        let mut f = File::from(open_at(fd.as_raw_fd(), c"bottom", flags).unwrap());
        io::Write::write_all(&mut f, b"deep data").unwrap();
        let rc = unsafe {
            libc::fsetxattr(
                f.as_raw_fd(),
                c"user.deep".as_ptr(),
                b"y".as_ptr().cast(),
                1,
                0,
            )
        };
        return check(rc, "fsetxattr");
    }
    check(
        unsafe { libc::unlinkat(fd.as_raw_fd(), c"bottom".as_ptr(), 0) },
        "unlink",
    );
    for _ in 0..depth {
        fd = open_at(fd.as_raw_fd(), c"..", dir).unwrap();
        check(
            unsafe { libc::unlinkat(fd.as_raw_fd(), name.as_ptr(), libc::AT_REMOVEDIR) },
            "rmdir",
        );
    }
}

#[test]
fn deep_trees_do_not_recurse_or_use_long_paths() {
    // 2,000 levels of "dd/" make a path longer than PATH_MAX; 10,000 levels run on a small stack.
    for (depth, name) in [(2000, c"dd"), (10_000, c"d")] {
        let (_t, root) = tmp();
        deep(&root, depth, name, false);
        let walk_root = root.clone();
        let walked = std::thread::Builder::new()
            .stack_size(256 << 10)
            .spawn(move || {
                let mut rec = Rec {
                    keep_last_only: true,
                    ..Rec::default()
                };
                walk_dir(&walk_root, &mut rec).map(|()| rec)
            })
            .unwrap()
            .join()
            .unwrap();
        deep(&root, depth, name, true);
        let rec = walked.unwrap();
        assert_eq!(rec.count, depth + 2);
        let (e, d) = &rec.entries[0];
        assert_eq!(
            e.path.len(),
            depth * (name.count_bytes() + 1) + "bottom".len()
        );
        assert_eq!(e.kind, EntryKind::File { size: 9 });
        assert_eq!(e.meta.xattrs, [(b"user.deep".to_vec(), b"y".to_vec())]);
        // Too long to be opened by path: the walker hands the bytes over itself.
        assert_eq!(d, &Some(Data::Bytes(b"deep data".to_vec())));
    }
}

#[test]
fn missing_and_non_directory_roots() {
    let (t, _) = tmp();
    let missing = t.path().join("nope");
    let mut rec = Rec::default();
    assert!(
        matches!(walk_dir(&missing, &mut rec), Err(BuildError::MissingSource { path }) if path == missing)
    );
    let file = t.path().join("file");
    std::fs::write(&file, b"").unwrap();
    match walk_dir(&file, &mut rec) {
        Err(BuildError::Io { path, source }) => {
            assert_eq!((path, source.kind()), (file, io::ErrorKind::NotADirectory));
        }
        other => panic!("{other:?}"),
    }
    assert!(rec.entries.is_empty());
    // A root given as a symlink to a directory is followed; nothing below it is.
    std::fs::write(t.path().join("root/f"), b"1").unwrap();
    symlink("root", t.path().join("alias")).unwrap();
    let paths: Vec<Vec<u8>> = walk(&t.path().join("alias"))
        .entries
        .into_iter()
        .map(|(e, _)| e.path)
        .collect();
    assert_eq!(paths, [b"".to_vec(), b"f".to_vec()]);
}

#[test]
fn without_proc_the_same_entries() {
    let (_t, root) = tmp();
    std::fs::create_dir(root.join("d")).unwrap();
    std::fs::write(root.join("d/f"), b"f").unwrap();
    setxattr(&root.join("d/f"), c"user.x", b"1");
    setxattr(&root, c"user.r", b"2");
    symlink("d/f", root.join("l")).unwrap();
    let mut rec = Rec::default();
    walk_impl(&root, &mut rec, false).unwrap();
    assert_eq!(
        format!("{:?}", rec.entries),
        format!("{:?}", walk(&root).entries)
    );
    assert_eq!(
        rec.get(b"d/f").0.meta.xattrs,
        [(b"user.x".to_vec(), b"1".to_vec())]
    );
    assert_eq!(
        rec.get(b"").0.meta.xattrs,
        [(b"user.r".to_vec(), b"2".to_vec())]
    );
}

struct Unmount(Vec<CString>);

impl Drop for Unmount {
    fn drop(&mut self) {
        for p in self.0.iter().rev() {
            unsafe { libc::umount2(p.as_ptr(), libc::MNT_DETACH) };
        }
    }
}

#[test]
fn mount_points_are_not_crossed() {
    let (t, root) = tmp();
    let (mnt, bound, outside) = (
        root.join("mnt"),
        root.join("bound"),
        t.path().join("outside"),
    );
    std::fs::create_dir(&mnt).unwrap();
    std::fs::write(&bound, b"mount point").unwrap();
    std::fs::write(&outside, b"outside").unwrap();
    std::fs::write(root.join("z"), b"after").unwrap();
    let mut guard = Unmount(Vec::new());
    let (tmpfs, opts) = (c"tmpfs".as_ptr(), c"mode=0750".as_ptr().cast());
    let mounted = unsafe { libc::mount(tmpfs, c(&mnt).as_ptr(), tmpfs, 0, opts) } == 0;
    if !strata_registry::testing::require("root (to mount a tmpfs)", mounted) {
        return;
    }
    guard.0.push(c(&mnt));
    std::fs::write(mnt.join("inside"), b"not in the image").unwrap();
    let rc = unsafe {
        let null = std::ptr::null();
        libc::mount(
            c(&outside).as_ptr(),
            c(&bound).as_ptr(),
            null,
            libc::MS_BIND,
            null.cast(),
        )
    };
    check(rc, "bind mount");
    guard.0.push(c(&bound));
    let rec = walk(&root);
    let got: Vec<(&[u8], EntryKind)> = rec
        .entries
        .iter()
        .map(|(e, _)| (&e.path[..], e.kind.clone()))
        .collect();
    let expected: Vec<(&[u8], EntryKind)> = vec![
        (b"", EntryKind::Dir),
        (b"mnt", EntryKind::Dir),
        (b"z", EntryKind::File { size: 5 }),
    ];
    assert_eq!(got, expected);
    assert_eq!(rec.get(b"mnt").0.meta.perm, 0o750);
}

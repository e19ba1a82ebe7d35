//! Tests of the tar source.

use super::*;
use std::io::Write;

/// Records entries, with the bytes of regular files.
#[derive(Default)]
struct Rec(Vec<(Entry, Option<Vec<u8>>)>);

impl EntrySink for Rec {
    fn add(&mut self, entry: Entry, data: Option<FileSource<'_>>) -> Result<(), BuildError> {
        let bytes = match data {
            Some(FileSource::Stream(r)) => {
                let mut v = Vec::new();
                r.read_to_end(&mut v)
                    .map_err(|e| BuildError::io("stream", e))?;
                Some(v)
            }
            Some(FileSource::Path { .. }) => panic!("a tar source gives streams"),
            None => None,
        };
        let size = match entry.kind {
            EntryKind::File { size } => Some(size),
            _ => None,
        };
        assert_eq!(size, bytes.as_ref().map(|b| b.len() as u64));
        self.0.push((entry, bytes));
        Ok(())
    }
}

impl Rec {
    fn get(&self, path: impl AsRef<[u8]>) -> &(Entry, Option<Vec<u8>>) {
        let found = self.0.iter().find(|(e, _)| e.path == path.as_ref());
        found.unwrap_or_else(|| panic!("no entry {}", show(path.as_ref())))
    }

    fn kinds(&self) -> Vec<(String, EntryKind)> {
        self.0
            .iter()
            .map(|(e, _)| (show(&e.path), e.kind.clone()))
            .collect()
    }
}

fn read(bytes: &[u8]) -> Result<Rec, BuildError> {
    let mut rec = Rec::default();
    read_tar(bytes, &mut rec).map(|()| rec)
}

fn read_compressed(bytes: Vec<u8>) -> Result<Rec, BuildError> {
    let mut rec = Rec::default();
    read_tar(open_stream(Box::new(io::Cursor::new(bytes)))?, &mut rec).map(|()| rec)
}

fn header(kind: EntryType, mode: u32, size: u64) -> Header {
    let mut h = Header::new_gnu();
    h.set_entry_type(kind);
    h.set_mode(mode);
    h.set_size(size);
    h.set_mtime(1_000);
    h.set_uid(0);
    h.set_gid(0);
    h
}

/// Appends one member with raw name and link bytes (as hostile archives have them).
fn raw(out: &mut Vec<u8>, name: &[u8], kind: EntryType, link: &[u8], data: &[u8]) {
    let mut h = header(kind, 0o644, data.len() as u64);
    h.as_old_mut().name[..name.len()].copy_from_slice(name);
    h.as_old_mut().linkname[..link.len()].copy_from_slice(link);
    if kind == EntryType::Regular && name.ends_with(b"/") {
        h.as_old_mut().linkflag = [0]; // an old-style directory
    }
    h.set_cksum();
    out.extend_from_slice(h.as_bytes());
    out.extend_from_slice(data);
    out.resize(out.len().next_multiple_of(512), 0);
}

/// Appends a PAX extended header holding `records`.
fn raw_pax(out: &mut Vec<u8>, records: &[(&str, &[u8])]) {
    let mut body = Vec::new();
    for (k, v) in records {
        let rest = k.len() + v.len() + 3;
        let len = (rest + 1..)
            .find(|l| l.to_string().len() + rest == *l)
            .unwrap();
        body.extend_from_slice(format!("{len} {k}=").as_bytes());
        body.extend_from_slice(v);
        body.push(b'\n');
    }
    raw(out, b"PaxHeaders/x", EntryType::XHeader, b"", &body);
}

fn end(mut out: Vec<u8>) -> Vec<u8> {
    out.extend_from_slice(&[0; 1024]);
    out
}

fn sample() -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    let mut add =
        |path: &str, mut h: Header, data: &[u8]| b.append_data(&mut h, path, data).unwrap();
    add("./", header(EntryType::Directory, 0o755, 0), b"");
    add("./etc/", header(EntryType::Directory, 0o1755, 0), b"");
    let mut su = header(EntryType::Regular, 0o4711, 6);
    su.set_uid(1000);
    su.set_gid(1001);
    add("./etc//passwd", su, b"root:x");
    let dev = |kind, major, minor| {
        let mut h = header(kind, 0o600, 0);
        h.set_device_major(major).unwrap();
        h.set_device_minor(minor).unwrap();
        h
    };
    let (null, sda) = (dev(EntryType::Char, 1, 3), dev(EntryType::Block, 8, 1));
    add("dev/null", null, b"");
    add("dev/sda1", sda, b"");
    add("run/fifo", header(EntryType::Fifo, 0o644, 0), b"");
    let big: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect();
    add(
        &format!("long/{}", "n".repeat(200)),
        header(EntryType::Continuous, 0o644, 100_000),
        &big,
    );
    let mut link = |path: &str, kind, target: &str| {
        b.append_link(&mut header(kind, 0o777, 0), path, target)
            .unwrap();
    };
    link("bin", EntryType::Symlink, "../usr/bin");
    link("etc/passwd2", EntryType::Link, "./etc/passwd");
    link("longlink", EntryType::Symlink, &"t".repeat(300));
    b.into_inner().unwrap()
}

#[test]
fn every_member_type_plain_gzip_and_zstd() {
    let plain = sample();
    let rec = read(&plain).unwrap();
    let file = |size| EntryKind::File { size };
    let sym = |t: &[u8]| EntryKind::Symlink(t.to_vec());
    let expected = vec![
        ("".into(), EntryKind::Dir),
        ("etc".into(), EntryKind::Dir),
        ("etc/passwd".into(), file(6)),
        (
            "dev/null".into(),
            EntryKind::CharDev {
                rdev: libc::makedev(1, 3),
            },
        ),
        (
            "dev/sda1".into(),
            EntryKind::BlockDev {
                rdev: libc::makedev(8, 1),
            },
        ),
        ("run/fifo".into(), EntryKind::Fifo),
        (format!("long/{}", "n".repeat(200)), file(100_000)),
        ("bin".into(), sym(b"../usr/bin")),
        (
            "etc/passwd2".into(),
            EntryKind::HardLink(b"etc/passwd".to_vec()),
        ),
        ("longlink".into(), sym("t".repeat(300).as_bytes())),
    ];
    assert_eq!(rec.kinds(), expected);
    assert_eq!(
        (rec.get("").0.meta.perm, rec.get("etc").0.meta.perm),
        (0o755, 0o1755)
    );
    let (e, data) = rec.get("etc/passwd");
    assert_eq!(data.as_deref(), Some(&b"root:x"[..]));
    assert_eq!(
        (
            e.meta.perm,
            e.meta.uid,
            e.meta.gid,
            e.meta.mtime,
            e.meta.mtime_nsec
        ),
        (0o4711, 1000, 1001, 1000, 0)
    );
    let data = rec
        .get(format!("long/{}", "n".repeat(200)))
        .1
        .clone()
        .unwrap();
    assert!(data
        .iter()
        .enumerate()
        .all(|(i, &b)| b == (i as u32 * 7 % 251) as u8));

    compressed_forms_read_alike(&plain, &expected);
}

/// The sample tar `plain` as gzip (one member, or two split mid-header) and zstd reads as `expected`;
/// corrupt or cut compressed streams are errors, never short layers.
fn compressed_forms_read_alike(plain: &[u8], expected: &[(String, EntryKind)]) {
    let gzip = |parts: &[&[u8]]| -> Vec<u8> {
        let mut out = Vec::new();
        for part in parts {
            let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            enc.write_all(part).unwrap();
            out.extend(enc.finish().unwrap());
        }
        out
    };
    let mut zstd = zstd::Encoder::new(Vec::new(), 3).unwrap();
    zstd.include_checksum(true).unwrap();
    zstd.write_all(plain).unwrap();
    let zst = zstd.finish().unwrap();
    let gz = gzip(&[plain]);
    // Two gzip members, split mid-header, make one stream.
    for input in [
        plain.to_vec(),
        gz.clone(),
        gzip(&[&plain[..700], &plain[700..]]),
        zst.clone(),
    ] {
        let rec = read_compressed(input).unwrap();
        assert_eq!(rec.kinds(), expected);
        assert_eq!(rec.get("etc/passwd").1.as_deref(), Some(&b"root:x"[..]));
    }

    // Corrupt or cut compressed streams are errors, never short layers.
    let flip = |mut v: Vec<u8>| {
        let mid = v.len() / 2;
        v[mid] ^= 0x55;
        v
    };
    let cases = [
        flip(gz.clone()),
        gz[..gz.len() - 4].to_vec(),
        flip(zst.clone()),
        zst[..zst.len() - 3].to_vec(),
    ];
    for (i, input) in cases.into_iter().enumerate() {
        assert!(
            matches!(read_compressed(input), Err(BuildError::Tar(_))),
            "case {i}"
        );
    }
}

#[test]
fn pax_metadata() {
    let mut out = Vec::new();
    let cap: &[u8] =
        b"\x01\x00\x00\x02\x0a\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00";
    let tricky: &[u8] = b"x\n22 linkpath=/etc/evil\n";
    raw_pax(
        &mut out,
        &[
            ("uid", b"3000000"),
            ("gid", b"4000000"),
            ("mtime", b"1700000000.123456789"),
            ("SCHILY.xattr.user.z", b"last"),
            ("SCHILY.xattr.security.capability", cap),
            // A value holding something that looks like a record stays a value.
            ("SCHILY.xattr.user.tricky", tricky),
            ("LIBARCHIVE.xattr.user.%41b", b"aGkA"),
            ("atime", b"1.5"),
        ],
    );
    raw(&mut out, b"f", EntryType::Regular, b"", b"data");
    raw_pax(
        &mut out,
        &[("mtime", b"-1.25"), ("path", b"a/long/\xffpath")],
    );
    raw(&mut out, b"ignored", EntryType::Directory, b"", b"");
    raw_pax(&mut out, &[("SCHILY.xattr.user.t", tricky)]);
    raw(&mut out, b"sym", EntryType::Symlink, b"harmless", b"");
    // A uid too big for octal, in the header's base-256 form.
    let mut h = header(EntryType::Regular, 0o600, 0);
    h.set_uid(5_000_000);
    h.as_old_mut().name[..7].copy_from_slice(b"big-uid");
    h.set_cksum();
    out.extend_from_slice(h.as_bytes());

    let rec = read(&end(out)).unwrap();
    let (e, data) = rec.get("f");
    assert_eq!(data.as_deref(), Some(&b"data"[..]));
    assert_eq!(
        (e.meta.uid, e.meta.gid, e.meta.mtime, e.meta.mtime_nsec),
        (3_000_000, 4_000_000, 1_700_000_000, 123_456_789)
    );
    let x: Vec<(&[u8], &[u8])> = e
        .meta
        .xattrs
        .iter()
        .map(|(k, v)| (&k[..], &v[..]))
        .collect();
    let want: Vec<(&[u8], &[u8])> = vec![
        (b"security.capability", cap),
        (b"user.Ab", b"hi\0"),
        (b"user.tricky", tricky),
        (b"user.z", b"last"),
    ];
    assert_eq!(x, want);
    let e = &rec.get(b"a/long/\xffpath").0;
    assert_eq!(
        (e.kind.clone(), e.meta.mtime, e.meta.mtime_nsec),
        (EntryKind::Dir, -2, 750_000_000)
    );
    assert_eq!(
        rec.get("sym").0.kind,
        EntryKind::Symlink(b"harmless".to_vec())
    );
    assert_eq!(rec.get("big-uid").0.meta.uid, 5_000_000);
}

#[test]
fn whiteouts_and_opaque_directories() {
    let mut out = Vec::new();
    for p in [
        ".wh.gone",
        "dir/.wh.x",
        "dir/.wh..wh..opq",
        ".wh..wh.plnk/123",
        "./.wh..wh..opq",
        "d/.wh..wh.aufs",
    ] {
        raw(&mut out, p.as_bytes(), EntryType::Regular, b"", b"");
    }
    let expected = vec![
        ("gone".into(), EntryKind::Whiteout),
        ("dir/x".into(), EntryKind::Whiteout),
        ("dir".into(), EntryKind::Opaque),
        // Below aufs metadata, but not aufs metadata itself: a plain file by the OCI rules.
        (".wh..wh.plnk/123".into(), EntryKind::File { size: 0 }),
        ("".into(), EntryKind::Opaque),
    ];
    assert_eq!(read(&end(out)).unwrap().kinds(), expected);
}

fn expect_err(tar: Vec<u8>, check: impl Fn(&BuildError) -> bool) {
    match read(&end(tar)) {
        Err(e) if check(&e) => {}
        other => panic!("{:?}", other.map(|r| r.kinds())),
    }
}

#[test]
fn hostile_members_are_refused() {
    let unsafe_entry = |part: &'static str| move |e: &BuildError| matches!(e, BuildError::UnsafeEntry { why, .. } if why.contains(part));
    for name in [
        &b"/etc/passwd"[..],
        b"../x",
        b"a/../../x",
        b"a/..",
        b"./../x",
    ] {
        let mut out = Vec::new();
        raw(&mut out, name, EntryType::Regular, b"", b"x");
        expect_err(
            out,
            unsafe_entry(if name[0] == b'/' { "absolute" } else { ".." }),
        );
    }
    for (target, why) in [
        (&b"../x"[..], "'..'"),
        (b"/etc/shadow", "absolute"),
        (b"a/../../etc", "'..'"),
    ] {
        let mut out = Vec::new();
        raw(&mut out, b"ok", EntryType::Regular, b"", b"x");
        raw(&mut out, b"link", EntryType::Link, target, b"");
        expect_err(out, unsafe_entry(why));
    }
    let mut out = Vec::new();
    raw_pax(&mut out, &[("path", b"a\0b")]);
    raw(&mut out, b"name", EntryType::Regular, b"", b"");
    expect_err(out, unsafe_entry("NUL"));
    let mut out = Vec::new();
    raw(&mut out, b"d/.wh...", EntryType::Regular, b"", b"");
    expect_err(out, unsafe_entry("whiteout"));
    // A hard link to nothing seen before.
    let mut out = Vec::new();
    raw(&mut out, b"link", EntryType::Link, b"later", b"");
    raw(&mut out, b"later", EntryType::Regular, b"", b"");
    expect_err(
        out,
        |e| matches!(e, BuildError::Tar(m) if m.to_string().contains("not an earlier")),
    );
    // A PAX size the tar crate misses (it gives up at a value holding a newline) must not shift the
    // framing: here the header says 0 bytes, as writers do for files too big for the header.
    let mut out = Vec::new();
    raw_pax(
        &mut out,
        &[("SCHILY.xattr.user.t", b"v\nw"), ("size", b"4")],
    );
    raw(&mut out, b"f", EntryType::Regular, b"", b"");
    raw(&mut out, b"1234", EntryType::Regular, b"", b"");
    expect_err(
        out,
        |e| matches!(e, BuildError::Tar(m) if m.to_string().contains("PAX size")),
    );
}

#[test]
fn unsupported_and_skipped_types() {
    let mut out = Vec::new();
    raw(
        &mut out,
        b"pax_global_header",
        EntryType::XGlobalHeader,
        b"",
        b"9 a=bcd\n",
    );
    raw(&mut out, b"kept", EntryType::Regular, b"", b"k");
    raw(&mut out, b"old-dir/", EntryType::Regular, b"", b"");
    let expected = vec![
        ("kept".into(), EntryKind::File { size: 1 }),
        ("old-dir".into(), EntryKind::Dir),
    ];
    assert_eq!(read(&end(out)).unwrap().kinds(), expected);
    let mut out = Vec::new();
    raw(&mut out, b"vol", EntryType::new(b'M'), b"", b"");
    expect_err(out, |e| matches!(e, BuildError::Unsupported { .. }));
    let mut out = Vec::new();
    raw_pax(
        &mut out,
        &[("GNU.sparse.major", b"1"), ("GNU.sparse.minor", b"0")],
    );
    raw(&mut out, b"GNUSparseFile.0/f", EntryType::Regular, b"", b"");
    expect_err(out, |e| matches!(e, BuildError::Unsupported { .. }));
}

#[test]
fn gnu_sparse_members_are_materialized() {
    let dir = tempfile::Builder::new()
        .prefix("strata-tar-")
        .tempdir_in("/var/tmp")
        .unwrap();
    let path = dir.path().join("sparse");
    let f = std::fs::File::create(&path).unwrap();
    f.set_len(8 << 20).unwrap();
    std::os::unix::fs::FileExt::write_at(&f, b"middle", 4 << 20).unwrap();
    std::os::unix::fs::FileExt::write_at(&f, b"end", (8 << 20) - 3).unwrap();
    let mut b = tar::Builder::new(Vec::new());
    b.append_path_with_name(&path, "sparse").unwrap();
    let tar = b.into_inner().unwrap();
    assert_eq!(
        (tar[156], tar.len() < 1 << 20),
        (b'S', true),
        "a GNU sparse member"
    );
    let rec = read(&tar).unwrap();
    let (e, data) = rec.get("sparse");
    assert_eq!(e.kind, EntryKind::File { size: 8 << 20 });
    let data = data.as_ref().unwrap();
    assert_eq!(
        (&data[4 << 20..(4 << 20) + 6], &data[(8 << 20) - 3..]),
        (&b"middle"[..], &b"end"[..])
    );
    assert!(data[..4 << 20].iter().all(|&b| b == 0));
}

#[test]
fn truncated_and_corrupt_streams() {
    let mut out = Vec::new();
    raw(&mut out, b"one", EntryType::Regular, b"", &[1; 1000]);
    raw(&mut out, b"two", EntryType::Regular, b"", &[2; 600]);
    let full = end(out);
    let names = |r: Rec| r.kinds().into_iter().map(|(p, _)| p).collect::<Vec<_>>();
    assert_eq!(names(read(&full).unwrap()), ["one", "two"]);
    // One zero block is enough for an end.
    assert_eq!(
        names(read(&full[..full.len() - 512]).unwrap()),
        ["one", "two"]
    );
    let cases: [(usize, &str); 6] = [
        (0, "end-of-archive"),
        (100, "before the first entry"),
        (512 + 500, "entry \"one\""),
        (512 + 1000 + 10, "\"one\""),
        (512 + 1024, "end-of-archive"),
        (512 + 1024 + 512 + 1024, "end-of-archive"),
    ];
    for (at, part) in cases {
        match read(&full[..at]) {
            Err(BuildError::Tar(e)) => {
                let m = e.to_string();
                assert!(m.contains(part), "cut at {at}: {m}")
            }
            other => panic!("cut at {at}: {:?}", other.map(names)),
        }
    }
    let mut bad = full.clone();
    bad[512 + 1024 + 3] ^= 1; // a byte of the second header's name
    match read(&bad) {
        // The tar crate's own words stay the source, typed; the message says them too.
        Err(BuildError::Tar(e)) if matches!(*e, TarError::Stream { .. }) => {
            let m = e.to_string();
            assert!(m.contains("checksum") && m.contains("\"one\""), "{m}");
            assert!(std::error::Error::source(&e).is_some());
        }
        other => panic!("{:?}", other.map(names)),
    }
}

#[test]
fn pax_records_times_and_decoders() {
    assert_eq!(parse_time(b"12").unwrap(), (12, 0));
    assert_eq!(parse_time(b"1.5").unwrap(), (1, 500_000_000));
    assert_eq!(parse_time(b"-1.5").unwrap(), (-2, 500_000_000));
    assert_eq!(parse_time(b"-3").unwrap(), (-3, 0));
    assert_eq!(parse_time(b"1.1234567899").unwrap(), (1, 123_456_789));
    for bad in [&b""[..], b"x", b"1.2.3", b".5", b"- 1", b"+1"] {
        assert!(parse_time(bad).is_err(), "{}", show(bad));
    }
    assert_eq!(base64_decode(b"aGkA").unwrap(), b"hi\0");
    assert_eq!(base64_decode(b"aGk=").unwrap(), b"hi");
    assert_eq!(base64_decode(b"aGk").unwrap(), b"hi");
    assert!(base64_decode(b"a*").is_none());
    assert_eq!(percent_decode(b"user.%2Fx%25").unwrap(), b"user./x%");
    assert!(percent_decode(b"%4").is_none());
    for bad in [
        &b"11 path=a\n"[..],
        b"9 path=ab\n",
        b"1x path=a\n",
        b"9 patha\n",
    ] {
        assert!(Pax::parse(Some(bad)).is_err(), "{}", show(bad));
    }
    let pax = Pax::parse(Some(b"10 path=a\n16 uid=12345678\n7 uid=\n\0\0")).unwrap();
    assert_eq!((pax.path.as_deref(), pax.uid), (Some(&b"a"[..]), None));
}

/// The tar fuzzing entry (`crate::fuzzing::tar`, also `fuzz/`'s `tar` target) over mutations of real
/// tars — plain, with pax records, gzip'd: errors, never a panic. Mutations fall mostly in the first
/// headers, where a tar's structure is.
#[test]
fn the_fuzzing_entry_survives_mutated_tars() {
    let mut pax = Vec::new();
    raw_pax(&mut pax, &[("path", b"p/x"), ("SCHILY.xattr.user.a", b"v")]);
    raw(&mut pax, b"ignored", EntryType::Regular, b"", b"data");
    let pax = end(pax);
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(&sample()).unwrap();
    let gz = gz.finish().unwrap();
    for seed in [sample(), pax, gz] {
        crate::fuzzing::tar(&seed);
        let headers = strata_registry::testing::mutations(&seed, 0x2545_f491_4f6c_dd1d, 1500, 2048);
        headers.for_each(|m| crate::fuzzing::tar(&m));
    }
}

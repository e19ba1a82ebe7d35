//! Builds of small trees: the data layout (run-first, libraries after their loaders).

use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;

use super::*;

/// Where a test layer comes from: a directory, or a tar stream of the files.
enum Src<'a> {
    Dir(&'a Path),
    Tar,
}

/// Builds `files` (path, content) — the tree of a directory holding them, or a tar of them in
/// order — with `layout` and `chunk_size` into a new store; the layer digest and the digests of the
/// blob's chunks in blob order.
fn build_chunks(
    src: Src<'_>,
    files: &[(&str, Vec<u8>)],
    layout: Layout,
    chunk_size: u64,
) -> (Digest, Vec<Digest>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let url = format!("file://{}", dir.path().join("store").display());
    let store = Store::open(&url).expect("store");
    let mut opts = BuildOptions::new(LayerKind::Base);
    opts.layout = layout;
    opts.chunk_size = chunk_size;
    let layer = match src {
        Src::Dir(d) => build_dir(&store, d, opts),
        Src::Tar => {
            let mut b = tar::Builder::new(Vec::new());
            for (p, content) in files {
                let mut h = tar::Header::new_gnu();
                h.set_size(content.len() as u64);
                h.set_mode(0o644);
                h.set_uid(0);
                h.set_gid(0);
                h.set_mtime(0);
                h.set_entry_type(tar::EntryType::Regular);
                b.append_data(&mut h, p, &content[..]).expect("tar entry");
            }
            let bytes = b.into_inner().expect("tar");
            build_tar(&store, Box::new(std::io::Cursor::new(bytes)), opts)
        }
    }
    .expect("build");
    let toc = store
        .get_toc(&layer.descriptor.blobs[0])
        .expect("table of contents");
    (layer.digest, toc.chunks.iter().map(|c| c.digest).collect())
}

/// [`build_chunks`] with the default chunk size: the layer digest and each (single-chunk) file's chunk
/// index in the blob.
fn built(
    src: Src<'_>,
    files: &[(&str, Vec<u8>)],
    layout: Layout,
) -> (Digest, HashMap<String, usize>) {
    let (digest, chunks) = build_chunks(src, files, layout, DEFAULT_CHUNK_SIZE);
    let at = files
        .iter()
        .map(|(p, content)| {
            let d = Digest::of(content);
            let i = chunks.iter().position(|c| *c == d);
            (p.to_string(), i.expect("chunk in blob"))
        })
        .collect();
    (digest, at)
}

#[test]
fn an_elf_file_stores_its_loader_chunks_after_its_first_from_a_directory_or_a_stream() {
    let libc = std::fs::read("/lib/x86_64-linux-gnu/libc.so.6").expect("libc");
    let cs = 64 << 10;
    let files = [("usr/lib/x86_64-linux-gnu/libc.so.6", libc.clone())];
    let dir = tempfile::tempdir().expect("tempdir");
    let p = dir.path().join(files[0].0);
    std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
    std::fs::write(&p, &libc).expect("write");
    // Each piece's place in the blob.
    let places = |chunks: &[Digest]| -> Vec<usize> {
        libc.chunks(cs as usize)
            .map(|piece| {
                let d = Digest::of(piece);
                chunks.iter().position(|c| *c == d).expect("piece in blob")
            })
            .collect()
    };
    let want = elfdeps::chunk_order(&libc, cs, libc.len().div_ceil(cs as usize) as u64);
    assert_ne!(
        want[1], 1,
        "libc's loader chunks are not its second: {want:?}"
    );
    for src in [Src::Dir(dir.path()), Src::Tar] {
        let at = places(&build_chunks(src, &files, Layout::RunFirst, cs).1);
        let mut by_place: Vec<u64> = (0..at.len() as u64).collect();
        by_place.sort_by_key(|&k| at[k as usize]);
        assert_eq!(by_place, want);
    }
    // The source layout keeps the file's order.
    let at = places(&build_chunks(Src::Tar, &files, Layout::Source, cs).1);
    assert!(at.windows(2).all(|w| w[0] < w[1]), "{at:?}");
}

#[test]
fn run_first_layout_puts_what_programs_skip_last() {
    // Distinct, larger than inline; a big file is cut into chunks, the others grouped.
    let body = |tag: &str, n: usize| tag.repeat(n / tag.len() + 1).into_bytes();
    let files = [
        ("pkg/__init__.py", body("init source ", 4000)),
        (
            "pkg/__pycache__/__init__.cpython-311.pyc",
            body("init pyc ", 4000),
        ),
        ("pkg/_core.so", body("shared object ", 200_000)),
        ("pkg/plain.py", body("no bytecode ", 4000)),
        ("pkg/stubs.pyi", body("stub ", 4000)),
        ("pkg/tests/test_core.py", body("a test ", 4000)),
        ("pkg/zlast.pyc", body("last pyc ", 4000)),
        ("usr/share/doc/pkg/README", body("readme ", 4000)),
    ];
    let dir = tempfile::tempdir().expect("tempdir");
    for (p, content) in &files {
        let p = dir.path().join(p);
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        std::fs::write(&p, content).expect("write");
    }
    let (digest, at) = built(Src::Dir(dir.path()), &files, Layout::RunFirst);
    // A tar stream gets the same order (its small files held back in memory).
    let (_, tar_at) = built(Src::Tar, &files, Layout::RunFirst);
    assert_eq!(tar_at, at);
    let i = |p: &str| at[p];
    // Run-time files (small ones grouped, so not strictly in order with large ones), then
    // unshadowed sources, then the cold ones in source order.
    let run = [
        "pkg/__pycache__/__init__.cpython-311.pyc",
        "pkg/_core.so",
        "pkg/zlast.pyc",
    ];
    assert!(run.iter().all(|p| i(p) < i("pkg/plain.py")), "{at:?}");
    assert!(i("pkg/plain.py") < i("pkg/__init__.py"));
    assert!(i("pkg/__init__.py") < i("pkg/stubs.pyi"));
    assert!(i("pkg/stubs.pyi") < i("pkg/tests/test_core.py"));
    assert!(i("pkg/tests/test_core.py") < i("usr/share/doc/pkg/README"));
    // Deterministic; the source layout keeps the walk's order (another blob: placement, so the same
    // layer digest).
    let again = built(Src::Dir(dir.path()), &files, Layout::RunFirst).0;
    assert_eq!(again, digest);
    let (source, at) = built(Src::Dir(dir.path()), &files, Layout::Source);
    assert_eq!(source, digest);
    assert!(at["pkg/__init__.py"] < at["pkg/__pycache__/__init__.cpython-311.pyc"]);
}

#[test]
fn libraries_follow_the_first_program_that_loads_them() {
    let body = |tag: &str| tag.repeat(100_000 / tag.len() + 1).into_bytes();
    let ls = std::fs::read("/bin/ls").expect("/bin/ls");
    let files = [
        ("aaa/first", body("first ")),
        ("usr/bin/ls", ls),
        (
            "usr/lib/x86_64-linux-gnu/libaaa.so",
            body("unrelated library "),
        ),
        ("usr/lib/x86_64-linux-gnu/libc.so.6", body("the C library ")),
        ("zzz/last", body("last ")),
    ];
    let dir = tempfile::tempdir().expect("tempdir");
    for (p, content) in &files {
        let p = dir.path().join(p);
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        std::fs::write(&p, content).expect("write");
    }
    let exe = std::fs::Permissions::from_mode(0o755);
    std::fs::set_permissions(dir.path().join("usr/bin/ls"), exe).expect("chmod");
    let (digest, at) = built(Src::Dir(dir.path()), &files, Layout::RunFirst);
    let i = |p: &str| at[p];
    // `ls` needs libc.so.6: it comes right after `ls`, before the library that sorts first.
    assert_eq!(
        i("usr/lib/x86_64-linux-gnu/libc.so.6"),
        i("usr/bin/ls") + 1,
        "{at:?}"
    );
    assert!(i("usr/lib/x86_64-linux-gnu/libc.so.6") < i("usr/lib/x86_64-linux-gnu/libaaa.so"));
    assert!(i("usr/lib/x86_64-linux-gnu/libaaa.so") < i("zzz/last"));
    assert_eq!(
        built(Src::Dir(dir.path()), &files, Layout::RunFirst).0,
        digest
    );
    // The source layout keeps the walk's order.
    let (_, at) = built(Src::Dir(dir.path()), &files, Layout::Source);
    assert!(at["usr/lib/x86_64-linux-gnu/libaaa.so"] < at["usr/lib/x86_64-linux-gnu/libc.so.6"]);
}

#[test]
fn zstd_fast_levels_build_and_read_back_and_other_levels_are_refused() {
    for level in [0, -8, 23] {
        let mut opts = BuildOptions::new(LayerKind::Base);
        opts.level = level;
        let e = opts.check().expect_err("level refused");
        assert!(
            matches!(&e, BuildError::Option(m) if m.contains(&format!("zstd level {level} "))),
            "{e}"
        );
    }
    let src = tempfile::tempdir().expect("tempdir");
    let text: Vec<u8> = (0..300_000u32)
        .flat_map(|i| (i % 97).to_le_bytes())
        .collect();
    std::fs::write(src.path().join("data"), &text).expect("write");
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(&format!("file://{}", dir.path().display())).expect("store");
    let mut opts = BuildOptions::new(LayerKind::Base);
    opts.level = -3;
    let layer = build_dir(&store, src.path(), opts).expect("build at level -3");
    let blob = &layer.descriptor.blobs[0];
    let toc = store.get_toc(blob).expect("table of contents");
    let mut back = Vec::new();
    for c in &toc.chunks {
        let f = &toc.frames[c.frame as usize];
        let z = store
            .get_range(
                &strata_registry::store::key::blob(&blob.digest),
                f.offset..f.offset + f.compressed as u64,
            )
            .expect("frame");
        let frame = strata_registry::toc::decompress(&z, f.uncompressed as usize).expect("zstd");
        let chunk = strata_registry::toc::verified_chunk(c, &frame).expect("chunk digest");
        back.extend_from_slice(chunk);
    }
    assert_eq!(back, text, "the file reads back from its fast-level frames");
}

/// Small files a program reads at run time are stored inside the metadata; small files rarely read
/// (tests, documentation, headers, stubs) go to the blob, grouped; empty files are always inside. The
/// rule follows the path alone: the layer's identity does not depend on `--layout`.
#[test]
fn small_files_rarely_read_are_not_inlined() {
    let small = |tag: &str| tag.repeat(40).into_bytes();
    let files = [
        ("pkg/__pycache__/mod.cpython-311.pyc", small("bytecode ")),
        ("etc/app.conf", small("setting ")),
        ("pkg/tests/test_mod.py", small("a test ")),
        ("usr/share/doc/pkg/copyright", small("copyright ")),
        ("usr/include/pkg.h", small("header ")),
        ("pkg/mod.pyi", small("stub ")),
        ("pkg/tests/empty", Vec::new()),
    ];
    let dir = tempfile::tempdir().expect("tempdir");
    for (p, content) in &files {
        let p = dir.path().join(p);
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        std::fs::write(&p, content).expect("write");
    }
    let src = |tar: bool| match tar {
        false => Src::Dir(dir.path()),
        true => Src::Tar,
    };
    for tar in [false, true] {
        let (digest, chunks) = build_chunks(src(tar), &files, Layout::RunFirst, DEFAULT_CHUNK_SIZE);
        let in_blob = |p: &str| {
            let content = &files.iter().find(|f| f.0 == p).expect("file").1;
            chunks.contains(&Digest::of(content))
        };
        for p in ["pkg/__pycache__/mod.cpython-311.pyc", "etc/app.conf"] {
            assert!(!in_blob(p), "{p} is read at run time: inline");
        }
        for p in [
            "pkg/tests/test_mod.py",
            "usr/share/doc/pkg/copyright",
            "usr/include/pkg.h",
            "pkg/mod.pyi",
        ] {
            assert!(in_blob(p), "{p} is rarely read: in the blob");
        }
        assert_eq!(chunks.len(), 4, "the empty file has no chunk");
        let (source, _) = build_chunks(src(tar), &files, Layout::Source, DEFAULT_CHUNK_SIZE);
        assert_eq!(source, digest, "the layout changes placement only");
    }
    assert!(inlined(b"pkg/tests/empty", 0, DEFAULT_INLINE_MAX));
    assert!(!inlined(b"etc/big.conf", 4096, DEFAULT_INLINE_MAX));
}

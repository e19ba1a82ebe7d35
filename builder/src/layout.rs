//! Data layout: the order regular files' data takes in a layer's blob.
//!
//! A node that has never seen an image fetches it lazily: a read that misses fetches its chunk and the
//! chunks that follow it in the blob (one range request, up to the daemon's fetch span), so what lies
//! next to a file in the blob decides whether the next file a program reads is already there. Sources
//! give files in path order (a directory's children sorted, depth first), which puts next to a package's
//! modules much that programs never read at run time: Python sources whose compiled bytecode sits in
//! `__pycache__` (the interpreter reads the `.pyc` and only stats the `.py`), test suites, type stubs
//! and headers, documentation. With [`Layout::RunFirst`] (the default) those files' data moves behind
//! everything else, so that the files a program does read are packed together in path order and a
//! fetch span carries more of them:
//!
//! 1. *run-time* files: everything not below, in source order — except that each shared library follows
//!    the first program or library that loads it ([`crate::elfdeps`]; files read from disk, which wait
//!    until the source is done: a stream's run-time files are sent to the chunk pool as they come); and
//!    an ELF file larger than a chunk stores right after its first chunk the chunks its loader touches
//!    next (dynamic section, RELRO, writable segments: [`crate::elfdeps::chunk_order`]; a stream's too,
//!    up to 64 MiB a file, which is held in memory to reorder);
//! 2. Python sources (`X.py`) that nothing compiled shadows, in source order;
//! 3. *cold* files, in source order: files below a directory named `tests` or `test`, under
//!    `usr/share/{doc,man,info,locale}` (translations are read only in that language), type stubs,
//!    headers, static libraries and objects (`.pyi`, `.pxd`, `.pyx`, `.h`, `.hpp`, `.a`, `.o`: read by
//!    type checkers, compilers and linkers, not by the programs they build), and Python sources
//!    shadowed by bytecode (`D/__pycache__/X.*.pyc` or `D/X.pyc` in the same layer).
//!
//! Only where a file's data lies changes, never what a path holds; the order depends on the paths alone,
//! so the same input still gives the same digests. Data is deferred only when that costs no memory
//! (files read from disk by path) or little: stream-fed files below the small-file size, up to
//! [`STREAM_DEFER_MAX`] bytes in all; the rest of a stream stays in source order.

use std::collections::HashSet;

/// How a build orders file data in the blob.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Layout {
    /// Source order (a directory walk's sorted depth-first order, or a tar's order).
    Source,
    /// Files read at run time first, then unshadowed Python sources, then cold files (module doc).
    #[default]
    RunFirst,
}

/// A layout name that is neither `source` nor `run-first`.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown layout {0:?} (expected source or run-first)")]
pub struct UnknownLayout(pub String);

impl std::str::FromStr for Layout {
    type Err = UnknownLayout;

    fn from_str(s: &str) -> Result<Layout, UnknownLayout> {
        match s {
            "source" => Ok(Layout::Source),
            "run-first" => Ok(Layout::RunFirst),
            other => Err(UnknownLayout(other.into())),
        }
    }
}

/// Bytes of stream-fed file data a build may hold back for later placement.
pub const STREAM_DEFER_MAX: usize = 64 << 20;

/// Where a file's data goes, judged from its path alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Class {
    /// Read at run time: placed as it comes.
    Run,
    /// A Python source: cold if bytecode shadows it (known only once every path is seen).
    Source,
    /// Rarely read at run time.
    Cold,
}

/// Extensions of files programs do not read at run time: type stubs, Cython declarations and sources,
/// C headers (compilers read them), static libraries and objects (linkers read them).
const COLD_EXTENSIONS: [&[u8]; 7] = [b"pyi", b"pxd", b"pyx", b"h", b"hpp", b"a", b"o"];

fn components(path: &[u8]) -> impl Iterator<Item = &[u8]> {
    path.split(|&b| b == b'/')
        .filter(|c| !c.is_empty() && *c != b".")
}

/// The class of the file at `path`.
pub fn classify(path: &[u8]) -> Class {
    let comps: Vec<&[u8]> = components(path).collect();
    let Some((name, dirs)) = comps.split_last() else {
        return Class::Run;
    };
    if dirs.iter().any(|d| *d == b"tests" || *d == b"test") {
        return Class::Cold;
    }
    if let [b"usr", b"share", d, ..] = dirs {
        if [&b"doc"[..], b"man", b"info", b"locale"].contains(d) {
            return Class::Cold;
        }
    }
    // The extension after the last dot, if the name has something before it (".h" has none).
    let ext = match name.iter().rposition(|&b| b == b'.') {
        Some(p) if p > 0 => &name[p + 1..],
        _ => b"",
    };
    if COLD_EXTENSIONS.contains(&ext) {
        return Class::Cold;
    }
    match name.ends_with(b".py") && name.len() > 3 {
        true => Class::Source,
        false => Class::Run,
    }
}

/// The module a compiled file holds bytecode of, as `DIR/STEM` (components joined by `/`):
/// `D/__pycache__/X.TAG.pyc` and `D/X.pyc` both give `D/X`.
fn compiled_module(path: &[u8]) -> Option<Vec<u8>> {
    let comps: Vec<&[u8]> = components(path).collect();
    let (name, dirs) = comps.split_last()?;
    let stem = name.strip_suffix(b".pyc")?;
    let (dirs, stem) = match dirs.split_last() {
        Some((last, up)) if *last == b"__pycache__" => {
            (up, stem.split(|&b| b == b'.').next().unwrap_or(stem))
        }
        _ => (dirs, stem),
    };
    if stem.is_empty() {
        return None;
    }
    Some(joined(dirs, stem))
}

/// The module a Python source defines, as `DIR/STEM`.
fn source_module(path: &[u8]) -> Option<Vec<u8>> {
    let comps: Vec<&[u8]> = components(path).collect();
    let (name, dirs) = comps.split_last()?;
    Some(joined(dirs, name.strip_suffix(b".py")?))
}

fn joined(dirs: &[&[u8]], stem: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    for d in dirs {
        out.extend_from_slice(d);
        out.push(b'/');
    }
    out.extend_from_slice(stem);
    out
}

/// The compiled modules a layer holds, to tell shadowed Python sources from read ones.
#[derive(Default)]
pub struct Compiled(HashSet<Vec<u8>>);

impl Compiled {
    /// Notes a file of the layer (any file: only `.pyc` ones count).
    pub fn note(&mut self, path: &[u8]) {
        if let Some(m) = compiled_module(path) {
            self.0.insert(m);
        }
    }

    /// True if the Python source at `path` has bytecode in the layer.
    pub fn shadows(&self, path: &[u8]) -> bool {
        source_module(path).is_some_and(|m| self.0.contains(&m))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_by_path() {
        let run = [
            &b"usr/lib/python3/dist-packages/numpy/__pycache__/__init__.cpython-311.pyc"[..],
            b"usr/lib/python3/dist-packages/numpy/core/_multiarray_umath.so",
            b"usr/lib/python3/dist-packages/numpy/testing/utils.pyc",
            b"usr/bin/python3.11",
            b"usr/share/zoneinfo/UTC",
            b"./etc/passwd",
            b"tests",
            b"usr/lib/.h",
        ];
        for p in run {
            assert_eq!(classify(p), Class::Run, "{}", String::from_utf8_lossy(p));
        }
        let cold = [
            &b"usr/lib/python3/dist-packages/numpy/core/tests/test_api.py"[..],
            b"/usr/lib/python3.11/test/support/__init__.py",
            b"usr/share/doc/git/README",
            b"usr/share/man/man1/git.1.gz",
            b"usr/lib/python3/dist-packages/numpy/__init__.pyi",
            b"usr/include/stdio.h",
            b"usr/lib/x86_64-linux-gnu/libc.a",
            b"usr/share/locale/de/LC_MESSAGES/git.mo",
        ];
        for p in cold {
            assert_eq!(classify(p), Class::Cold, "{}", String::from_utf8_lossy(p));
        }
        assert_eq!(classify(b"usr/lib/python3.11/os.py"), Class::Source);
        assert_eq!(classify(b"usr/lib/x/.py"), Class::Run);
        assert_eq!(classify(b"usr/share/docs/x"), Class::Run);
    }

    #[test]
    fn bytecode_shadows_its_source_only() {
        let mut c = Compiled::default();
        c.note(b"usr/lib/python3.11/__pycache__/os.cpython-311.pyc");
        c.note(b"./opt/app/main.pyc");
        c.note(b"usr/lib/python3.11/json/__pycache__/__init__.cpython-311.opt-1.pyc");
        c.note(b"usr/lib/python3.11/json/decoder.py");
        assert!(c.shadows(b"usr/lib/python3.11/os.py"));
        assert!(c.shadows(b"/opt/app/main.py"));
        assert!(c.shadows(b"usr/lib/python3.11/json/__init__.py"));
        assert!(!c.shadows(b"usr/lib/python3.11/json/decoder.py"));
        assert!(!c.shadows(b"usr/lib/python3.11/__pycache__/os.py"));
        assert!(!c.shadows(b"usr/lib/python3.11/sys.py"));
        assert!(!c.shadows(b"usr/lib/python3.11/os.pyc"));
    }

    #[test]
    fn layout_names() {
        assert_eq!("source".parse::<Layout>(), Ok(Layout::Source));
        assert_eq!("run-first".parse::<Layout>(), Ok(Layout::RunFirst));
        assert!("fast".parse::<Layout>().is_err());
        assert_eq!(Layout::default(), Layout::RunFirst);
    }
}

//! Library order: shared libraries placed right after the first program in the layer that loads them.
//!
//! A program's start reads its shared libraries: the dynamic loader opens each library its `DT_NEEDED`
//! entries name (breadth first: the program's, then theirs), reads the headers and maps the segments,
//! then relocation and start-up code touch pages of each. Lazily, each library is a miss of its own
//! unless it lies next to what was read before it. In source order the libraries lie where their
//! directory puts them — `usr/lib/x86_64-linux-gnu/` sorted by name, hundreds of them, most never loaded
//! together — far from the program or extension module that needs them. Of the 50 misses of the fat
//! image's cold `import numpy, pandas` over the 20 ms link with the run-first layout, 18 were the first
//! read of a shared library (`libm`, `libz`, `libexpat` for the interpreter; the OpenBLAS, LAPACK,
//! gfortran and quadmath libraries for numpy's `_multiarray_umath`; `libcrypto`, `libbz2`, `liblzma`,
//! `libuuid`, `libstdc++` for standard and pandas extension modules): `BENCHMARKS.md`.
//!
//! So the builder reads each executable file's dynamic section ([`needed`]), resolves the names the way
//! the loader would within the layer ([`Libraries::resolve`]: `RUNPATH`/`RPATH` with `$ORIGIN`, then the
//! standard and multiarch directories, following the layer's symlinks such as Debian's alternatives),
//! and places each library not placed yet right after the file that first needs it, in the loader's
//! breadth-first order — except the libraries many files load ([`common_libraries`]: the C library, the
//! maths and C++ run-times, …), which go together, most loaded first, after the first file that loads any
//! of them, so that every program's start finds them in one place. And within a file larger than a chunk, [`chunk_order`] stores right after the
//! first chunk the ones the loader touches next (dynamic section, RELRO, writable segments, near the
//! end of the file), so that they come with the first chunk's fetch. Deterministic: source order and
//! file contents decide. A library a program in
//! another layer needs, or one loaded with `dlopen` by a name no file's dynamic section holds, keeps its
//! place.

use std::collections::{HashMap, VecDeque};
use std::ops::Range;

use object::elf;
use object::read::elf::{Dyn, FileHeader, ProgramHeader};
use object::Endianness;

/// Bytes of a file read for its dynamic section: the headers, `.dynamic` and `.dynstr` lie in its
/// first pages.
pub const HEAD_BYTES: usize = 1 << 20;

/// What a file's dynamic section says: the libraries it needs and where it asks the loader to look.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Dynamic {
    pub needed: Vec<Vec<u8>>,
    /// `RUNPATH` or `RPATH` directories, `:`-separated in the file, `$ORIGIN` not yet expanded.
    pub search: Vec<Vec<u8>>,
}

/// The dynamic section of the ELF file whose first bytes are `head` (`None`: not a dynamically linked
/// ELF file, or its dynamic section is not within `head`).
pub fn needed(head: &[u8]) -> Option<Dynamic> {
    match head.get(4) {
        Some(&elf::ELFCLASS64) => parse::<elf::FileHeader64<Endianness>>(head),
        Some(&elf::ELFCLASS32) => parse::<elf::FileHeader32<Endianness>>(head),
        _ => None,
    }
}

fn parse<H: FileHeader<Endian = Endianness>>(head: &[u8]) -> Option<Dynamic> {
    let header = H::parse(head).ok()?;
    let endian = header.endian().ok()?;
    let segments = header.program_headers(endian, head).ok()?;
    let dynamic = segments
        .iter()
        .find_map(|p| p.dynamic(endian, head).ok().flatten())?;
    let value = |tag: u32| {
        dynamic
            .iter()
            .find(|d| d.tag32(endian) == Some(tag))
            .map(|d| d.d_val(endian).into())
    };
    // `DT_STRTAB` is an address: the load segment holding it gives its place in the file.
    let (addr, size): (u64, u64) = (value(elf::DT_STRTAB)?, value(elf::DT_STRSZ)?);
    let offset = segments.iter().find_map(|p| {
        let (va, fsz) = (p.p_vaddr(endian).into(), p.p_filesz(endian).into());
        (p.p_type(endian) == elf::PT_LOAD && va <= addr && addr < va + fsz)
            .then(|| addr - va + p.p_offset(endian).into())
    })?;
    let start = usize::try_from(offset).ok()?;
    let strings = head.get(start..start.checked_add(usize::try_from(size).ok()?)?)?;
    let string = |at: u64| {
        let s = strings.get(usize::try_from(at).ok()?..)?;
        let end = s.iter().position(|&b| b == 0)?;
        Some(s[..end].to_vec())
    };
    let mut out = Dynamic::default();
    for d in dynamic {
        let at: u64 = d.d_val(endian).into();
        match d.tag32(endian) {
            Some(elf::DT_NEEDED) => out.needed.extend(string(at)),
            Some(elf::DT_RUNPATH) | Some(elf::DT_RPATH) => {
                for dir in string(at).unwrap_or_default().split(|&b| b == b':') {
                    if !dir.is_empty() {
                        out.search.push(dir.to_vec());
                    }
                }
            }
            _ => {}
        }
    }
    Some(out)
}

/// Most chunks of a file moved up behind its first by [`chunk_order`].
pub const HOT_CHUNKS_MAX: usize = 4;

/// The order in which the `n` chunks (of `chunk` bytes) of the file whose first bytes are `head` are
/// stored. For an ELF file: chunk 0 (the headers the loader reads first), then the chunks holding what
/// the loader touches right after mapping the file — the dynamic section, the RELRO part and the
/// writable segments it relocates, which lie near the end of the file — up to [`HOT_CHUNKS_MAX`],
/// then the rest in order. A lazy fetch of the first chunk then brings them along (they follow it in
/// the blob) instead of each being a miss of its own. Anything else: `0..n`.
pub fn chunk_order(head: &[u8], chunk: u64, n: u64) -> Vec<u64> {
    let hot = match head.get(4) {
        Some(&elf::ELFCLASS64) => loader_ranges::<elf::FileHeader64<Endianness>>(head),
        Some(&elf::ELFCLASS32) => loader_ranges::<elf::FileHeader32<Endianness>>(head),
        _ => None,
    };
    let mut first: Vec<u64> = vec![0];
    for r in hot.unwrap_or_default() {
        if chunk == 0 || r.start >= r.end {
            continue;
        }
        for c in r.start / chunk..=(r.end - 1) / chunk {
            if c < n && !first.contains(&c) && first.len() <= HOT_CHUNKS_MAX {
                first.push(c);
            }
        }
    }
    first[1..].sort_unstable();
    let rest = (0..n).filter(|c| !first.contains(c));
    first
        .iter()
        .copied()
        .filter(|&c| c < n)
        .chain(rest)
        .collect()
}

/// The file ranges of an ELF file's dynamic section, RELRO part and writable loaded segments.
fn loader_ranges<H: FileHeader<Endian = Endianness>>(head: &[u8]) -> Option<Vec<Range<u64>>> {
    let header = H::parse(head).ok()?;
    let endian = header.endian().ok()?;
    let segments = header.program_headers(endian, head).ok()?;
    let ranges = segments
        .iter()
        .filter(|p| {
            let t = p.p_type(endian);
            t == elf::PT_DYNAMIC
                || t == elf::PT_GNU_RELRO
                || (t == elf::PT_LOAD && p.p_flags(endian) & elf::PF_W != 0)
        })
        .map(|p| {
            let start: u64 = p.p_offset(endian).into();
            start..start.saturating_add(p.p_filesz(endian).into())
        })
        .collect();
    Some(ranges)
}

/// Where the loader looks after `RUNPATH`: the standard directories, multiarch ones first.
const STANDARD_DIRS: [&[u8]; 10] = [
    b"lib/x86_64-linux-gnu",
    b"usr/lib/x86_64-linux-gnu",
    b"lib/aarch64-linux-gnu",
    b"usr/lib/aarch64-linux-gnu",
    b"lib64",
    b"usr/lib64",
    b"lib",
    b"usr/lib",
    b"usr/local/lib",
    b"usr/local/lib64",
];

/// How a layer's paths resolve: `follow(path)` gives what a path names after every symlink in it is
/// followed within the layer (`None`: nothing there).
pub struct Libraries<F: Fn(&[u8]) -> Option<Vec<u8>>> {
    pub follow: F,
}

impl<F: Fn(&[u8]) -> Option<Vec<u8>>> Libraries<F> {
    /// The layer path the loader would open for `name`, needed by the file at `from`.
    pub fn resolve(&self, name: &[u8], from: &[u8], dynamic: &Dynamic) -> Option<Vec<u8>> {
        if name.contains(&b'/') {
            return (self.follow)(name);
        }
        let origin = match from.iter().rposition(|&b| b == b'/') {
            Some(p) => &from[..p],
            None => b"",
        };
        let runpath = dynamic.search.iter().map(|d| {
            let d = match d
                .strip_prefix(b"$ORIGIN")
                .or_else(|| d.strip_prefix(b"${ORIGIN}"))
            {
                Some(rest) => [origin, rest].concat(),
                None => d.clone(),
            };
            normalize(&d)
        });
        runpath
            .chain(STANDARD_DIRS.iter().map(|d| d.to_vec()))
            .find_map(|dir| (self.follow)(&[&dir[..], b"/", name].concat()))
    }
}

/// `path` without `.`, `..` (within the layer) and empty components, relative to the layer's root.
pub fn normalize(path: &[u8]) -> Vec<u8> {
    let mut parts: Vec<&[u8]> = Vec::new();
    for c in path.split(|&b| b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => {
                parts.pop();
            }
            c => parts.push(c),
        }
    }
    parts.join(&b'/')
}

/// The order in which files `0..n` (in source order) are placed: each file, then — if `needs(i)` gives
/// the files it loads — those not placed yet, breadth first like the loader, before the next file.
pub fn order(n: usize, mut needs: impl FnMut(usize) -> Vec<usize>) -> Vec<usize> {
    let mut placed = vec![false; n];
    let mut out = Vec::with_capacity(n);
    for start in 0..n {
        if placed[start] {
            continue;
        }
        placed[start] = true;
        let mut queue = VecDeque::from([start]);
        while let Some(i) = queue.pop_front() {
            out.push(i);
            for d in needs(i) {
                if d < n && !placed[d] {
                    placed[d] = true;
                    queue.push_back(d);
                }
            }
        }
    }
    out
}

/// What a path of the layer is, for [`follow`].
pub enum Kind {
    Dir,
    Link(Vec<u8>),
    /// A regular file or anything else that is not followed.
    Other,
}

/// The path `path` names once every symlink in it is followed within the layer (absolute targets from
/// the layer's root), or `None` if it names nothing, a directory, or a loop.
pub fn follow(path: &[u8], kind: impl Fn(&[u8]) -> Option<Kind>) -> Option<Vec<u8>> {
    let comps = |p: &[u8]| -> Vec<Vec<u8>> {
        p.split(|&b| b == b'/')
            .filter(|c| !c.is_empty() && *c != b".")
            .map(<[u8]>::to_vec)
            .collect()
    };
    let mut todo: VecDeque<Vec<u8>> = comps(path).into();
    let mut done: Vec<Vec<u8>> = Vec::new();
    let mut hops = 0;
    while let Some(c) = todo.pop_front() {
        if c == b".." {
            done.pop();
            continue;
        }
        let here = [done.join(&b'/'), c.clone()]
            .iter()
            .filter(|p| !p.is_empty())
            .cloned()
            .collect::<Vec<_>>()
            .join(&b'/');
        match kind(&here)? {
            Kind::Dir => done.push(c),
            Kind::Link(target) => {
                hops += 1;
                if hops > 40 {
                    return None;
                }
                if target.starts_with(b"/") {
                    done.clear();
                }
                for t in comps(&target).into_iter().rev() {
                    todo.push_front(t);
                }
            }
            Kind::Other => return todo.is_empty().then_some(here),
        }
    }
    None
}

/// A file placed at run time, for [`library_order`]: its layer path, mode bits and where its bytes are
/// on disk (`None`: not readable here, e.g. fed by a stream).
pub struct RunFile<'a> {
    pub path: &'a [u8],
    pub perm: u32,
    pub disk: Option<&'a std::path::Path>,
}

/// True if the file may be a program or library: executable, or named like a shared object.
fn may_load(f: &RunFile<'_>) -> bool {
    let name = f.path.rsplit(|&b| b == b'/').next().unwrap_or(f.path);
    f.disk.is_some() && (f.perm & 0o111 != 0 || name.windows(3).any(|w| w == b".so"))
}

/// The first [`HEAD_BYTES`] of an ELF file on disk; `None` for anything else, after reading only its
/// first bytes (the builder asks about every executable and every file of more than one chunk).
pub fn head(disk: &std::path::Path) -> Option<Vec<u8>> {
    use std::io::Read;
    let mut f = std::fs::File::open(disk).ok()?;
    let mut buf = vec![0u8; 4];
    f.read_exact(&mut buf).ok()?;
    if buf != elf::ELFMAG {
        return None;
    }
    f.take(HEAD_BYTES as u64 - 4).read_to_end(&mut buf).ok()?;
    Some(buf)
}

/// The order of `files` (in source order): each one followed by the libraries it loads that are
/// among `files` and not placed yet (module documentation). `kind` says what a path of the layer is.
pub fn library_order(files: &[RunFile<'_>], kind: impl Fn(&[u8]) -> Option<Kind>) -> Vec<usize> {
    let index: HashMap<Vec<u8>, usize> = files
        .iter()
        .enumerate()
        .map(|(i, f)| (normalize(f.path), i))
        .collect();
    let libs = Libraries {
        follow: |p: &[u8]| follow(p, &kind),
    };
    let needs: Vec<Vec<usize>> = files
        .iter()
        .map(|f| {
            let Some(dynamic) = f
                .disk
                .filter(|_| may_load(f))
                .and_then(head)
                .and_then(|h| needed(&h))
            else {
                return Vec::new();
            };
            let from = normalize(f.path);
            dynamic
                .needed
                .iter()
                .filter_map(|n| libs.resolve(n, &from, &dynamic))
                .filter_map(|p| index.get(&p).copied())
                .collect()
        })
        .collect();
    let common = common_libraries(&needs);
    order(files.len(), |i| {
        let mut deps = needs[i].clone();
        if deps.iter().any(|d| common.contains(d)) {
            deps.extend(common.iter().copied());
        }
        deps
    })
}

/// Libraries at least this many files load are placed together (see [`common_libraries`]).
pub const COMMON_MIN: usize = 8;

/// The libraries that [`COMMON_MIN`] or more files load (the C library, the maths and C++ run-times,
/// zlib, …), most loaded first. They go together, after the first file that loads any of them: placed
/// after their first loader each, they would each follow whichever early program (`[`, `awk`) happened
/// to load them, and every other program's start would find them scattered.
pub fn common_libraries(needs: &[Vec<usize>]) -> Vec<usize> {
    let mut count: HashMap<usize, usize> = HashMap::new();
    for deps in needs {
        for &d in deps {
            *count.entry(d).or_default() += 1;
        }
    }
    let mut common: Vec<(usize, usize)> = count
        .into_iter()
        .filter(|&(_, c)| c >= COMMON_MIN)
        .collect();
    common.sort_unstable_by_key(|&(i, c)| (std::cmp::Reverse(c), i));
    common.into_iter().map(|(i, _)| i).collect()
}

#[cfg(test)]
#[path = "elfdeps_tests.rs"]
mod tests;

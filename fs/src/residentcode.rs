//! The server's own code mapped before it is first needed: [`populate`].
//!
//! stratad sits on the read path of every sandbox. A code path it has not run since it started — a
//! node's first mount, a successor's first takeover, its first miss — is read from disk on its first
//! execution, page fault by page fault, while a sandbox waits: on a cold node (and after `drop_caches`,
//! as `benches/coldstart.py` does before every run) a fresh server's first mount took 3–7 major faults
//! of its own code, ~6 ms of a 22 ms first mount (BENCHMARKS.md, "Twenty-fourth session").
//!
//! So a server, once started, has a background thread ask the kernel to map every page of the program's
//! own file mappings (`MADV_POPULATE_READ`, Linux 5.14+): one pass of readahead over its text and
//! read-only data instead of faults on the path of a request. Mapped pages are not dropped by
//! `drop_caches`, and reclaim treats them as any mapped file page: nothing is pinned, memory pressure can
//! still take them. The cost is in the server's RSS — the program's file pages (~14 MiB for a release
//! `stratad`), shared with every process running the same file, reclaimable. A kernel without the advice
//! refuses it (`EINVAL`): the server runs as before, the refusal logged at debug level.

use std::io;

/// A mapping of the program's file, from `/proc/self/maps`: its start and length.
#[derive(Debug, PartialEq, Eq)]
struct Mapping {
    start: usize,
    len: usize,
}

/// The readable mappings in `maps` (the text of `/proc/self/maps`) of the file with inode `ino` at
/// `path` (an executable replaced on disk shows as `path (deleted)`).
fn program_mappings(maps: &str, path: &str, ino: u64) -> Vec<Mapping> {
    let path = path.trim_end_matches(" (deleted)");
    maps.lines()
        .filter_map(|line| {
            let mut f = line.split_ascii_whitespace();
            let (range, perms, _off, _dev, inode) =
                (f.next()?, f.next()?, f.next()?, f.next()?, f.next()?);
            let name = f.collect::<Vec<_>>().join(" ");
            let (a, b) = range.split_once('-')?;
            let (start, end) = (
                usize::from_str_radix(a, 16).ok()?,
                usize::from_str_radix(b, 16).ok()?,
            );
            let ours = inode.parse::<u64>().ok()? == ino
                && name.trim_end_matches(" (deleted)") == path
                && perms.starts_with('r');
            (ours && end > start).then_some(Mapping {
                start,
                len: end - start,
            })
        })
        .collect()
}

/// Maps every page of this program's readable file mappings; returns the bytes advised.
pub fn populate() -> io::Result<u64> {
    use std::os::unix::fs::MetadataExt;
    let exe = std::fs::read_link("/proc/self/exe")?;
    let ino = std::fs::metadata("/proc/self/exe")?.ino();
    let maps = std::fs::read_to_string("/proc/self/maps")?;
    let mut bytes = 0u64;
    for m in program_mappings(&maps, &exe.to_string_lossy(), ino) {
        // SAFETY: the range is one of this process's own file mappings, page-aligned as the kernel
        // reports it, mapped for the life of the program; MADV_POPULATE_READ only faults its pages in,
        // as reading them would, and changes no memory's contents.
        unsafe {
            rustix::mm::madvise(
                m.start as *mut std::ffi::c_void,
                m.len,
                rustix::mm::Advice::LinuxPopulateRead,
            )?;
        }
        bytes += m.len as u64;
    }
    Ok(bytes)
}

/// [`populate`] on a thread of its own, its outcome logged. The thread takes the caller's signal mask:
/// a server calls this after blocking the signals it waits for, or one could land on this thread
/// (SIGTERM's default action would then end the server instead of handing it over).
pub fn populate_in_background() {
    let spawned = std::thread::Builder::new()
        .name("strata-code".into())
        .spawn(|| {
            let t = std::time::Instant::now();
            match populate() {
                Ok(bytes) => tracing::debug!(
                    bytes,
                    ms = t.elapsed().as_millis() as u64,
                    "the program's code is mapped"
                ),
                Err(e) => tracing::debug!(error = %e,
                    "the program's code not mapped ahead (MADV_POPULATE_READ needs Linux 5.14)"),
            }
        });
    if let Err(e) = spawned {
        tracing::debug!(error = %e, "no thread to map the program's code ahead");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_programs_readable_mappings_are_found_by_inode_and_name() {
        let maps = "\
5600a000-5600b000 r--p 00000000 fd:01 1234 /usr/bin/stratad (deleted)
5600b000-5600f000 r-xp 00001000 fd:01 1234 /usr/bin/stratad (deleted)
5600f000-56010000 ---p 00005000 fd:01 1234 /usr/bin/stratad (deleted)
56010000-56011000 rw-p 00006000 fd:01 1234 /usr/bin/stratad (deleted)
56020000-56021000 r--p 00000000 fd:01 999 /usr/bin/stratad
7f000000-7f001000 r-xp 00000000 fd:01 77 /usr/lib/libc.so.6
7f002000-7f003000 rw-p 00000000 00:00 0
7ffd000-7ffe000 rw-p 00000000 00:00 0 [stack]
";
        let got = program_mappings(maps, "/usr/bin/stratad (deleted)", 1234);
        assert_eq!(
            got,
            vec![
                Mapping {
                    start: 0x5600a000,
                    len: 0x1000
                },
                Mapping {
                    start: 0x5600b000,
                    len: 0x4000
                },
                Mapping {
                    start: 0x56010000,
                    len: 0x1000
                },
            ],
            "readable mappings of the deleted binary only: not the guard, the other inode or libc"
        );
        assert!(program_mappings("garbage\n\n1-2 r", "/x", 1).is_empty());
    }

    /// On this kernel (5.14+): after `populate`, every page of the test program's text is resident in
    /// this process (`/proc/self/smaps`).
    #[test]
    fn populate_maps_every_page_of_the_program() {
        let bytes = populate().expect("MADV_POPULATE_READ (Linux 5.14+)");
        assert!(bytes > 1 << 20, "{bytes} bytes: the test program is larger");
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("smaps");
        let exe = std::fs::read_link("/proc/self/exe").expect("exe");
        let exe = exe.to_string_lossy();
        let (mut size, mut rss, mut ours) = (0u64, 0u64, false);
        for line in smaps.lines() {
            if line.contains('-') && line.split_ascii_whitespace().count() >= 5 {
                ours = line.ends_with(&*exe)
                    && line
                        .split_ascii_whitespace()
                        .nth(1)
                        .is_some_and(|p| p.starts_with('r'));
            } else if ours {
                let kb = |l: &str| {
                    l.split_ascii_whitespace()
                        .nth(1)
                        .and_then(|v| v.parse::<u64>().ok())
                };
                if line.starts_with("Size:") {
                    size += kb(line).unwrap_or(0);
                } else if line.starts_with("Rss:") {
                    rss += kb(line).unwrap_or(0);
                }
            }
        }
        assert!(size > 0, "the program's mappings are in smaps");
        assert_eq!(
            rss, size,
            "every page of the program's readable mappings is resident"
        );
    }
}

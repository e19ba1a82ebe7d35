//! The overlay upper directory source: what a sandbox changed, as a layer (`pack_diff`).
//!
//! An upper directory is walked like any directory ([`super::dir::walk_dir`]: no symlink followed, every
//! xattr, hard links found by inode) and its entries are translated from overlayfs's on-disk form to the
//! layer's, which is the same overlay form:
//!
//! - a 0:0 character device is a whiteout. Overlay often makes every whiteout a hard link of one shared
//!   inode; a hard link to a whiteout is a whiteout. A regular file with `trusted.overlay.whiteout` (the
//!   xattr form of newer kernels) is one too;
//! - `trusted.overlay.opaque=y` (or `user.overlay.opaque=y` for a `userxattr` mount) marks an opaque
//!   directory and is kept as `trusted.overlay.opaque=y`;
//! - overlay's other private xattrs (`origin`, `impure`, `uuid`, `nlink`, `upper`, `xwhiteouts`,
//!   `protattr`, in the `trusted.overlay.` and `user.overlay.` namespaces) describe the upper directory's
//!   relation to its lowers and are dropped;
//! - `redirect` and `metacopy` mean the upper holds renamed directories or metadata-only copies whose data
//!   lies in a lower layer: such an upper is refused, named (strata's sandboxes mount with neither).
//!
//! **Excludes.** Entries matching an [`Excludes`] pattern are left out with everything below them, so the
//! image's own version of an excluded path (if any) shows through in a sandbox started from the new
//! layer: excluding a file the agent modified reverts it, excluding a deletion undoes it. Below a
//! directory the agent removed and recreated (opaque), the image's entries stay hidden. When an excluded
//! file has a hard link outside the excluded paths, that link becomes the file.
//!
//! **Checks.** The caller sees every whiteout path before it is placed (`on_whiteout`): overlay writes a
//! whiteout only over an entry of the lower layers, so one that hides nothing means the upper directory
//! was made over another image.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use super::exclude::Excludes;
use super::{Entry, EntryKind, EntrySink, Existing, FileSource};
use crate::error::BuildError;
use crate::tree::{Meta, OPAQUE_XATTR};

/// What a walk of an upper directory saw, besides the entries.
#[derive(Debug, Default, Clone)]
pub struct UpperSummary {
    /// Entries left out by the exclude patterns (a directory counts once).
    pub excluded: u64,
    pub whiteouts: u64,
    pub opaque_dirs: u64,
}

/// Walks the upper directory `root` into `sink` (see the module documentation).
pub fn walk_upper(
    root: &Path,
    excludes: &Excludes,
    on_whiteout: &mut dyn FnMut(&[u8]) -> Result<(), BuildError>,
    sink: &mut dyn EntrySink,
) -> Result<UpperSummary, BuildError> {
    let mut s = UpperSink {
        inner: sink,
        excludes,
        on_whiteout,
        excluded_dirs: Vec::new(),
        whiteouts: HashSet::new(),
        held: HashMap::new(),
        relinked: HashMap::new(),
        summary: UpperSummary::default(),
    };
    super::dir::walk_dir(root, &mut s)?;
    Ok(s.summary)
}

/// An excluded non-directory kept in case a hard link outside the excluded paths needs it.
struct Held {
    meta: Meta,
    kind: EntryKind,
    /// For a regular file: its path on disk and whether it is sparse.
    file: Option<(PathBuf, bool)>,
}

struct UpperSink<'a> {
    inner: &'a mut dyn EntrySink,
    excludes: &'a Excludes,
    on_whiteout: &'a mut dyn FnMut(&[u8]) -> Result<(), BuildError>,
    /// Excluded directories (relative paths): everything below them is excluded too.
    excluded_dirs: Vec<Vec<u8>>,
    whiteouts: HashSet<Vec<u8>>,
    held: HashMap<Vec<u8>, Held>,
    /// Excluded hard-link target → the first kept link that took its place.
    relinked: HashMap<Vec<u8>, Vec<u8>>,
    summary: UpperSummary,
}

fn shown(p: &[u8]) -> String {
    String::from_utf8_lossy(p).into_owned()
}

/// Translates overlay's private xattrs; returns (is an opaque dir marker, is an xattr whiteout).
fn clean_xattrs(path: &[u8], meta: &mut Meta) -> Result<(bool, bool), BuildError> {
    let mut opaque = false;
    let mut whiteout = false;
    let mut refused = None;
    meta.xattrs.retain(|(k, v)| {
        let rest = k
            .strip_prefix(b"trusted.overlay.")
            .or_else(|| k.strip_prefix(b"user.overlay."));
        let Some(rest) = rest else {
            return true;
        };
        match rest {
            b"opaque" => opaque |= v == b"y",
            b"whiteout" => whiteout = true,
            b"redirect" | b"metacopy" => refused = Some(shown(rest)),
            _ => {}
        }
        false
    });
    if let Some(what) = refused {
        return Err(BuildError::Unsupported {
            path: shown(path),
            why: format!(
                "overlay `{what}` xattr: the upper directory comes from a mount with redirect_dir or \
                 metacopy on, whose entries depend on the lower layers; pack it from a mount with \
                 redirect_dir=off,metacopy=off"
            ),
        });
    }
    if opaque {
        meta.xattrs.push((OPAQUE_XATTR.to_vec(), b"y".to_vec()));
        meta.xattrs.sort();
    }
    Ok((opaque, whiteout))
}

impl UpperSink<'_> {
    fn under_excluded_dir(&self, path: &[u8]) -> bool {
        let under =
            |d: &Vec<u8>| path.len() > d.len() && path.starts_with(d) && path[d.len()] == b'/';
        self.excluded_dirs.iter().any(under)
    }

    fn whiteout(&mut self, path: Vec<u8>, meta: Meta) -> Result<(), BuildError> {
        (self.on_whiteout)(&path)?;
        self.summary.whiteouts += 1;
        self.whiteouts.insert(path.clone());
        let kind = EntryKind::Whiteout;
        self.inner.add(Entry { path, meta, kind }, None)
    }

    /// A hard link whose first path was excluded: the first kept link becomes the entry itself.
    fn relink(&mut self, path: Vec<u8>, target: Vec<u8>) -> Result<(), BuildError> {
        if let Some(first) = self.relinked.get(&target) {
            let kind = EntryKind::HardLink(first.clone());
            return self.inner.add(
                Entry {
                    path,
                    meta: meta_none(),
                    kind,
                },
                None,
            );
        }
        let Some(h) = self.held.get(&target) else {
            return Err(BuildError::Unsupported {
                path: shown(&path),
                why: format!(
                    "hard link to excluded {}, which cannot be re-read",
                    shown(&target)
                ),
            });
        };
        let (meta, kind) = (h.meta.clone(), h.kind.clone());
        let file = h.file.clone();
        self.relinked.insert(target, path.clone());
        match file {
            Some((p, sparse)) => {
                let data = FileSource::Path { path: p, sparse };
                self.inner.add(Entry { path, meta, kind }, Some(data))
            }
            None => self.inner.add(Entry { path, meta, kind }, None),
        }
    }
}

/// Metadata for a hard link entry (a link carries none of its own).
fn meta_none() -> Meta {
    Meta::implied_dir()
}

impl EntrySink for UpperSink<'_> {
    fn add(&mut self, entry: Entry, data: Option<FileSource<'_>>) -> Result<(), BuildError> {
        let Entry {
            path,
            mut meta,
            kind,
        } = entry;
        let under = self.under_excluded_dir(&path);
        let is_dir = matches!(kind, EntryKind::Dir);
        if under || (!path.is_empty() && self.excludes.matches(&path, is_dir)) {
            self.summary.excluded += u64::from(!under);
            match (&kind, data) {
                (EntryKind::Dir, _) => self.excluded_dirs.push(path),
                (EntryKind::HardLink(_), _) => {}
                (EntryKind::File { .. }, Some(FileSource::Path { path: p, sparse })) => {
                    let file = Some((p, sparse));
                    self.held.insert(path, Held { meta, kind, file });
                }
                (EntryKind::File { .. }, _) => {}
                _ => {
                    self.held.insert(
                        path,
                        Held {
                            meta,
                            kind,
                            file: None,
                        },
                    );
                }
            }
            return Ok(());
        }
        let (opaque, xattr_whiteout) = clean_xattrs(&path, &mut meta)?;
        match kind {
            EntryKind::CharDev { rdev: 0 } => self.whiteout(path, meta),
            EntryKind::File { .. } if xattr_whiteout => self.whiteout(path, meta),
            EntryKind::HardLink(t) if self.whiteouts.contains(&t) => self.whiteout(path, meta),
            EntryKind::HardLink(t) if self.held.contains_key(&t) => self.relink(path, t),
            EntryKind::Dir => {
                self.summary.opaque_dirs += u64::from(opaque && !path.is_empty());
                let kind = EntryKind::Dir;
                self.inner.add(Entry { path, meta, kind }, data)
            }
            kind => self.inner.add(Entry { path, meta, kind }, data),
        }
    }

    fn existing(&self, path: &[u8]) -> Existing {
        self.inner.existing(path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;

    /// Records entries as (path, kind, xattr names, has data).
    #[derive(Default)]
    struct Rec(Vec<(String, EntryKind, Vec<String>, bool)>);

    impl EntrySink for Rec {
        fn add(&mut self, e: Entry, data: Option<FileSource<'_>>) -> Result<(), BuildError> {
            let names = e.meta.xattrs.iter().map(|(k, _)| shown(k)).collect();
            self.0.push((shown(&e.path), e.kind, names, data.is_some()));
            Ok(())
        }
    }

    fn mknod_whiteout(p: &Path) -> bool {
        let c = CString::new(p.as_os_str().as_bytes()).unwrap();
        // SAFETY: valid path.
        unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o600, 0) == 0 }
    }

    #[test]
    fn overlay_markers_translated_private_xattrs_dropped_excludes_applied() {
        let dir = tempfile::tempdir().unwrap();
        let r = dir.path();
        if !strata_registry::testing::require(
            "root (to make a 0:0 character device)",
            mknod_whiteout(&r.join("gone")),
        ) {
            return;
        }
        // Overlay's shared whiteout inode: a hard link of a whiteout is a whiteout.
        std::fs::hard_link(r.join("gone"), r.join("gone2")).unwrap();
        std::fs::create_dir(r.join("opq")).unwrap();
        xattr::set(r.join("opq"), "trusted.overlay.opaque", b"y").unwrap();
        xattr::set(r.join("opq"), "trusted.overlay.impure", b"y").unwrap();
        std::fs::write(r.join("copied"), b"c").unwrap();
        xattr::set(r.join("copied"), "trusted.overlay.origin", b"\0\xfb").unwrap();
        xattr::set(r.join("copied"), "user.keep", b"k").unwrap();
        // An excluded file with a hard link outside the excluded paths; an excluded directory.
        std::fs::write(r.join("a-secret"), b"s").unwrap();
        std::fs::hard_link(r.join("a-secret"), r.join("b-link")).unwrap();
        std::fs::create_dir_all(r.join("cache/x")).unwrap();
        std::fs::write(r.join("cache/x/f"), b"f").unwrap();
        let ex = Excludes::new(&["a-secret", "/cache"]).unwrap();
        let mut seen = Vec::new();
        let mut rec = Rec::default();
        let mut check = |p: &[u8]| {
            seen.push(shown(p));
            Ok(())
        };
        let sum = walk_upper(r, &ex, &mut check, &mut rec).unwrap();
        assert_eq!(seen, ["gone", "gone2"]);
        assert_eq!((sum.whiteouts, sum.opaque_dirs, sum.excluded), (2, 1, 2));
        let by = |p: &str| rec.0.iter().find(|e| e.0 == p).cloned();
        assert_eq!(by("gone2").unwrap().1, EntryKind::Whiteout);
        assert_eq!(by("opq").unwrap().2, ["trusted.overlay.opaque"]);
        assert_eq!(by("copied").unwrap().2, ["user.keep"]);
        let link = by("b-link").unwrap();
        assert_eq!((link.1, link.3), (EntryKind::File { size: 1 }, true));
        assert!(by("a-secret").is_none() && by("cache").is_none() && by("cache/x/f").is_none());
    }

    #[test]
    fn metacopy_and_redirect_uppers_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("d")).unwrap();
        let set = xattr::set(dir.path().join("d"), "trusted.overlay.redirect", b"/x");
        if !strata_registry::testing::require("root (for trusted.* xattrs)", set.is_ok()) {
            return;
        }
        let mut ok = |_: &[u8]| Ok(());
        let err = walk_upper(
            dir.path(),
            &Excludes::default(),
            &mut ok,
            &mut Rec::default(),
        );
        let msg = err.unwrap_err().to_string();
        assert!(msg.contains("redirect") && msg.contains("d"), "{msg}");
    }
}

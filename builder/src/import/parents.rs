//! Directories an OCI layer implies keep the metadata the layers below give them.
//!
//! A layer tar need not hold an entry for every parent directory of its members: `umoci`, for one,
//! writes `etc/.wh.foo` without an `etc/` entry when only `etc/foo` was deleted. Applied the OCI way
//! (extracting over the lower layers) such a parent keeps its existing mode, owner, times and xattrs.
//! Under overlay, though, a directory's attributes come from the topmost layer that has it: if the strata
//! layer held it with the builder's implied metadata (0755, root, epoch 0), that would replace the real
//! metadata in the merged view. So [`FillParents`] sits between the tar source and the builder of a
//! non-bottom layer and, before the first entry under a directory the source has not described, emits
//! that directory with the metadata the merged lower layers show ([`LowerView::dir_meta`]; the root
//! included). A later entry for the same directory in the tar still wins, as it replaces the metadata.
//!
//! The same adapter drops whiteouts and opaque markers below a path this layer holds as a non-directory:
//! `umoci repack` writes `repl` (now a file) and then `repl/.wh.child` (its old content). Extracted, the
//! whiteout fails harmlessly (`ENOTDIR`); the new file already hides everything below it. Kept, it would
//! turn `repl` back into a directory.
//!
//! Whiteouts and entries at the same path in one layer follow the OCI rule that a whiteout hides only
//! what the layers below hold: a whiteout after the layer's own file at its path is dropped; one before
//! or after the layer's own directory at its path makes that directory opaque (the lower one is gone, the
//! new one stays).
//!
//! A hard link to a path that is not a file of this layer is handed to [`LinksBelow`] (a file of the
//! layers below).
//!
//! [`LowerView::shows`] also tells the builder which whiteouts hide something: one that hides nothing
//! below — nothing is there, or the layer makes a parent directory opaque — is pruned, as overlay would
//! list it as a broken entry in a directory only this layer has.

use std::collections::HashSet;

use strata_registry::store::Store;

use super::links::LinksBelow;
use crate::error::BuildError;
use crate::lower::LowerView;
use crate::source::{Entry, EntryKind, EntrySink, Existing, FileSource};
use crate::tree::Meta;

/// The sink adapter (see the module documentation).
pub(super) struct FillParents<'a> {
    pub inner: &'a mut dyn EntrySink,
    pub lower: &'a LowerView,
    /// Hard links to files of the layers below.
    links: LinksBelow<'a>,
    /// Directories described by the source or already filled in.
    known: HashSet<Vec<u8>>,
    /// Paths the source gave as non-directories.
    nondirs: HashSet<Vec<u8>>,
    /// Whiteouts passed on, not (yet) replaced by an entry of this layer.
    whiteouts: HashSet<Vec<u8>>,
    /// Directories this layer gives content: described by the source, or holding an entry of it.
    present: HashSet<Vec<u8>>,
}

impl<'a> FillParents<'a> {
    pub(super) fn new(
        inner: &'a mut dyn EntrySink,
        lower: &'a LowerView,
        store: &'a Store,
    ) -> FillParents<'a> {
        FillParents {
            inner,
            lower,
            links: LinksBelow::new(store),
            known: HashSet::new(),
            nondirs: HashSet::new(),
            whiteouts: HashSet::new(),
            present: HashSet::new(),
        }
    }

    fn fill(&mut self, dir: &[u8]) -> Result<(), BuildError> {
        if !self.known.insert(dir.to_vec()) {
            return Ok(());
        }
        if self.whiteouts.remove(dir) {
            // Deleted, then given entries in this same layer: a new, opaque directory.
            let entry = Entry {
                path: dir.to_vec(),
                meta: Meta::implied_dir(),
                kind: EntryKind::Dir,
            };
            self.inner.add(entry, None)?;
            return self.opaque(dir);
        }
        if let Some(meta) = self.lower.dir_meta(dir)? {
            let entry = Entry {
                path: dir.to_vec(),
                meta,
                kind: EntryKind::Dir,
            };
            self.inner.add(entry, None)?;
        }
        Ok(())
    }
}

impl FillParents<'_> {
    fn opaque(&mut self, dir: &[u8]) -> Result<(), BuildError> {
        self.lower.hide_below(dir);
        let entry = Entry {
            path: dir.to_vec(),
            meta: Meta::implied_dir(),
            kind: EntryKind::Opaque,
        };
        self.inner.add(entry, None)
    }
}

impl EntrySink for FillParents<'_> {
    fn existing(&self, path: &[u8]) -> Existing {
        self.inner.existing(path)
    }

    fn add(&mut self, entry: Entry, data: Option<FileSource<'_>>) -> Result<(), BuildError> {
        let path = entry.path.clone();
        // Every proper ancestor, the root first; an opaque marker also implies its directory.
        let ends = path.iter().enumerate().filter(|(_, &b)| b == b'/');
        let mut ancestors: Vec<&[u8]> = Vec::new();
        if !path.is_empty() {
            ancestors.push(&path[..0]);
        }
        ancestors.extend(ends.map(|(i, _)| &path[..i]));
        let marker = matches!(entry.kind, EntryKind::Whiteout | EntryKind::Opaque);
        if entry.kind == EntryKind::Opaque && !path.is_empty() {
            ancestors.push(&path[..]);
        }
        let moot = |a: &&[u8]| self.nondirs.contains(*a) || self.whiteouts.contains(*a);
        if marker && ancestors.iter().any(moot) {
            tracing::debug!(path = %String::from_utf8_lossy(&path), "whiteout below a non-directory or a deleted directory: dropped");
            return Ok(());
        }
        for dir in &ancestors {
            self.fill(dir)?;
            if !marker {
                self.present.insert(dir.to_vec());
            }
        }
        // A whiteout applies to the layers below only, never to an entry of its own layer (OCI image
        // spec): after this layer's file it is dropped, after this layer's directory it makes the
        // directory opaque; a directory after a whiteout of its path is opaque too.
        match entry.kind {
            EntryKind::Whiteout if self.nondirs.contains(&path) => return Ok(()),
            EntryKind::Whiteout if self.present.contains(&path) => return self.opaque(&path),
            EntryKind::Whiteout => {
                self.whiteouts.insert(path);
            }
            EntryKind::Dir => {
                let deleted = self.whiteouts.remove(&path);
                self.nondirs.remove(&path);
                self.known.insert(path.clone());
                self.present.insert(path.clone());
                self.inner.add(entry, data)?;
                return if deleted { self.opaque(&path) } else { Ok(()) };
            }
            EntryKind::Opaque => self.lower.hide_below(&path),
            EntryKind::HardLink(ref target) if !self.nondirs.contains(target) => {
                // Not a file of this layer: one of the layers below.
                let (copy, bytes) = self.links.entry(self.lower, &path, target)?;
                self.whiteouts.remove(&path);
                self.nondirs.insert(path);
                return match bytes {
                    Some(b) => {
                        let mut r = std::io::Cursor::new(b);
                        self.inner.add(copy, Some(FileSource::Stream(&mut r)))
                    }
                    None => self.inner.add(copy, None),
                };
            }
            _ => {
                self.whiteouts.remove(&path);
                self.nondirs.insert(path);
            }
        }
        self.inner.add(entry, data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records what reaches the builder.
    #[derive(Default)]
    struct Record(Vec<(String, EntryKind)>);

    impl EntrySink for Record {
        fn add(&mut self, entry: Entry, _: Option<FileSource<'_>>) -> Result<(), BuildError> {
            let path = String::from_utf8_lossy(&entry.path).into_owned();
            self.0.push((path, entry.kind));
            Ok(())
        }
    }

    fn feed(entries: &[(&str, EntryKind)]) -> Vec<(String, EntryKind)> {
        let mut rec = Record::default();
        let lower = LowerView::new(Vec::new());
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&format!("file://{}", dir.path().display())).unwrap();
        let mut fill = FillParents::new(&mut rec, &lower, &store);
        for (p, k) in entries {
            let e = Entry {
                path: p.as_bytes().to_vec(),
                meta: Meta::implied_dir(),
                kind: k.clone(),
            };
            fill.add(e, None).unwrap();
        }
        rec.0
    }

    fn owned(v: &[(&str, EntryKind)]) -> Vec<(String, EntryKind)> {
        v.iter().map(|(p, k)| (p.to_string(), k.clone())).collect()
    }

    #[test]
    fn whiteouts_never_hide_their_own_layer() {
        use EntryKind::{Dir, Fifo, Opaque, Whiteout};
        // Below a path this layer made a non-directory (umoci repack does this): dropped.
        let got = feed(&[("repl", Fifo), ("repl/child", Whiteout)]);
        assert_eq!(got, owned(&[("repl", Fifo)]));
        // After this layer's file: dropped.
        let got = feed(&[("f", Fifo), ("f", Whiteout)]);
        assert_eq!(got, owned(&[("f", Fifo)]));
        // Before or after this layer's directory: the directory is opaque.
        let got = feed(&[("d", Whiteout), ("d", Dir)]);
        assert_eq!(got, owned(&[("d", Whiteout), ("d", Dir), ("d", Opaque)]));
        let got = feed(&[("d/x", Fifo), ("d", Whiteout)]);
        assert_eq!(got, owned(&[("d/x", Fifo), ("d", Opaque)]));
        // Deleted, then given a child without a directory entry: a new opaque directory.
        let got = feed(&[("e", Whiteout), ("e/y", Fifo)]);
        assert_eq!(
            got,
            owned(&[("e", Whiteout), ("e", Dir), ("e", Opaque), ("e/y", Fifo)])
        );
        // A plain whiteout passes; one below a deleted directory is moot.
        assert_eq!(feed(&[("g", Whiteout)]), owned(&[("g", Whiteout)]));
        let got = feed(&[("h", Whiteout), ("h/z", Whiteout), ("h", Opaque)]);
        assert_eq!(got, owned(&[("h", Whiteout)]));
        // Whiteouts inside a directory, then of the directory: it is deleted, not emptied.
        let got = feed(&[("k/z", Whiteout), ("k", Whiteout)]);
        assert_eq!(got, owned(&[("k/z", Whiteout), ("k", Whiteout)]));
    }
}

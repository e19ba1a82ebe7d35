//! The in-memory file tree a layer is built from.
//!
//! Sources (a directory, a tar stream, an overlay upper directory) emit [`Entry`]s in any order; the
//! [`Tree`] assembles them into one rooted tree with overlay semantics: a later entry at a path replaces an
//! earlier one, missing parent directories are created with default metadata, hard links share one
//! [`NodeId`], whiteouts are 0:0 character devices and opaque directories carry
//! `trusted.overlay.opaque=y`. The EROFS writer then lays the tree out; it never sees a source.
//!
//! Regular file data is not kept here: a file holds either its inline bytes (tiny files, stored in the
//! metadata) or the digests of its chunks (`None` for a hole), which the writer resolves to device blocks.

use std::collections::BTreeMap;

use strata_registry::digest::Digest;

/// Index of a node in [`Tree::nodes`]; the root is 0.
pub type NodeId = usize;

/// File type bits of `st_mode`.
pub const S_IFMT: u32 = 0o170000;
pub const S_IFSOCK: u32 = 0o140000;
pub const S_IFLNK: u32 = 0o120000;
pub const S_IFREG: u32 = 0o100000;
pub const S_IFBLK: u32 = 0o060000;
pub const S_IFDIR: u32 = 0o040000;
pub const S_IFCHR: u32 = 0o020000;
pub const S_IFIFO: u32 = 0o010000;

/// The xattr that marks an overlay opaque directory.
pub use strata_erofs::format::OPAQUE_XATTR;

/// Metadata every entry has.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Meta {
    /// Permission bits (`0o7777`: including setuid, setgid, sticky). The type lives in [`NodeKind`].
    pub perm: u32,
    pub uid: u32,
    pub gid: u32,
    /// Seconds since the epoch (may be negative).
    pub mtime: i64,
    pub mtime_nsec: u32,
    /// Extended attributes, full names (`user.foo`, `security.capability`, ...), sorted by name.
    pub xattrs: Vec<(Vec<u8>, Vec<u8>)>,
}

impl Meta {
    /// Metadata for a directory a source implied but never described: 0755 root:root, epoch 0.
    pub fn implied_dir() -> Meta {
        Meta {
            perm: 0o755,
            uid: 0,
            gid: 0,
            mtime: 0,
            mtime_nsec: 0,
            xattrs: Vec::new(),
        }
    }
}

/// How a regular file's bytes are stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FileData {
    /// Stored inside the metadata image (tiny files; empty files have no bytes).
    Inline(Vec<u8>),
    /// Fixed-size chunks, in order; `None` is a hole (reads as zeros, stores nothing).
    Chunks(Vec<Option<Digest>>),
}

/// What a node is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodeKind {
    /// Children by name (a name is any byte string without `/` or NUL, 1..=255 bytes, not `.` or `..`).
    Dir(BTreeMap<Vec<u8>, NodeId>),
    File {
        size: u64,
        data: FileData,
    },
    Symlink(Vec<u8>),
    CharDev {
        rdev: u64,
    },
    BlockDev {
        rdev: u64,
    },
    Fifo,
    Socket,
}

impl NodeKind {
    /// The `S_IF*` type bits of this kind.
    pub fn type_bits(&self) -> u32 {
        match self {
            NodeKind::Dir(_) => S_IFDIR,
            NodeKind::File { .. } => S_IFREG,
            NodeKind::Symlink(_) => S_IFLNK,
            NodeKind::CharDev { .. } => S_IFCHR,
            NodeKind::BlockDev { .. } => S_IFBLK,
            NodeKind::Fifo => S_IFIFO,
            NodeKind::Socket => S_IFSOCK,
        }
    }

    /// True for an overlay whiteout (a 0:0 character device).
    pub fn is_whiteout(&self) -> bool {
        matches!(self, NodeKind::CharDev { rdev: 0 })
    }
}

/// One inode of the tree.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Node {
    pub meta: Meta,
    pub kind: NodeKind,
    /// Directory entries naming this node (hard links); directories always have exactly one.
    pub links: u32,
}

impl Node {
    /// `st_mode`: type and permission bits.
    pub fn mode(&self) -> u32 {
        self.kind.type_bits() | (self.meta.perm & 0o7777)
    }

    /// `st_nlink` as a filesystem reports it: links for files, 2 + subdirectories for directories.
    pub fn nlink(&self, tree: &Tree) -> u32 {
        match &self.kind {
            NodeKind::Dir(children) => {
                2 + children
                    .values()
                    .filter(|&&c| matches!(tree.nodes[c].kind, NodeKind::Dir(_)))
                    .count() as u32
            }
            _ => self.links,
        }
    }
}

/// A rooted tree of nodes. Node 0 is the root directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tree {
    pub nodes: Vec<Node>,
}

impl Default for Tree {
    fn default() -> Self {
        Tree::new()
    }
}

impl Tree {
    /// A tree holding only an implied root directory.
    pub fn new() -> Tree {
        Tree {
            nodes: vec![Node {
                meta: Meta::implied_dir(),
                kind: NodeKind::Dir(BTreeMap::new()),
                links: 1,
            }],
        }
    }

    /// The children of a directory node (empty for anything else).
    pub fn children(&self, id: NodeId) -> impl Iterator<Item = (&[u8], NodeId)> {
        let map = match &self.nodes[id].kind {
            NodeKind::Dir(c) => Some(c),
            _ => None,
        };
        map.into_iter()
            .flat_map(|m| m.iter().map(|(k, v)| (k.as_slice(), *v)))
    }

    /// Looks a relative path (components split on `/`) up from the root, without following symlinks.
    pub fn lookup(&self, path: &[u8]) -> Option<NodeId> {
        let mut cur = 0;
        for comp in path.split(|&b| b == b'/').filter(|c| !c.is_empty()) {
            match &self.nodes[cur].kind {
                NodeKind::Dir(children) => cur = *children.get(comp)?,
                _ => return None,
            }
        }
        Some(cur)
    }

    /// Number of directory entries reachable from the root (every name, hard links counted each time)
    /// plus the root; orphans left by replaced directories do not count.
    pub fn entry_count(&self) -> u64 {
        let mut count = 1;
        let mut stack = vec![0usize];
        while let Some(id) = stack.pop() {
            for (_, child) in self.children(id) {
                count += 1;
                if matches!(self.nodes[child].kind, NodeKind::Dir(_)) {
                    stack.push(child);
                }
            }
        }
        count
    }
}

/// Why an entry could not be placed in the tree.
#[derive(Debug, thiserror::Error)]
pub enum TreeError {
    #[error("{path}: a parent of this path is not a directory")]
    NotADirectory { path: String },
    #[error("{path}: hard link to {target}, which does not exist or is a directory")]
    BadHardLink { path: String, target: String },
    #[error("{path}: invalid name (empty, '.', '..', longer than 255 bytes, or holding NUL)")]
    BadName { path: String },
}

fn show(path: &[u8]) -> String {
    String::from_utf8_lossy(path).into_owned()
}

/// Splits a relative path into its components, checking each name.
pub fn components(path: &[u8]) -> Result<Vec<&[u8]>, TreeError> {
    let mut out = Vec::new();
    for comp in path.split(|&b| b == b'/') {
        if comp.is_empty() {
            continue;
        }
        if comp == b"." || comp == b".." || comp.len() > 255 || comp.contains(&0) {
            return Err(TreeError::BadName { path: show(path) });
        }
        out.push(comp);
    }
    Ok(out)
}

impl Tree {
    /// Finds or creates the directory holding `path`'s last component; returns it and that name.
    /// Missing parents are created as implied directories; a non-directory parent is an error.
    fn parent_of<'p>(&mut self, path: &'p [u8]) -> Result<Option<(NodeId, &'p [u8])>, TreeError> {
        let comps = components(path)?;
        let Some((name, dirs)) = comps.split_last() else {
            return Ok(None);
        };
        let mut cur = 0;
        for comp in dirs {
            let next = match &self.nodes[cur].kind {
                NodeKind::Dir(children) => children.get(*comp).copied(),
                _ => return Err(TreeError::NotADirectory { path: show(path) }),
            };
            cur = match next {
                Some(id) if matches!(self.nodes[id].kind, NodeKind::Dir(_)) => id,
                Some(_) => return Err(TreeError::NotADirectory { path: show(path) }),
                None => {
                    let id = self.push(Node {
                        meta: Meta::implied_dir(),
                        kind: NodeKind::Dir(BTreeMap::new()),
                        links: 1,
                    });
                    self.attach(cur, comp, id);
                    id
                }
            };
        }
        Ok(Some((cur, name)))
    }

    fn push(&mut self, node: Node) -> NodeId {
        self.nodes.push(node);
        self.nodes.len() - 1
    }

    /// Points `dir/name` at `id`, dropping a link from whatever was there.
    fn attach(&mut self, dir: NodeId, name: &[u8], id: NodeId) {
        let old = match &mut self.nodes[dir].kind {
            NodeKind::Dir(children) => children.insert(name.to_vec(), id),
            _ => None,
        };
        if let Some(old) = old {
            if old != id {
                self.nodes[old].links = self.nodes[old].links.saturating_sub(1);
            }
        }
    }

    /// Places an entry at `path` (relative; empty means the root). A directory over an existing directory
    /// takes its metadata and keeps its children; anything else replaces what was there.
    pub fn insert(&mut self, path: &[u8], meta: Meta, kind: NodeKind) -> Result<NodeId, TreeError> {
        let Some((dir, name)) = self.parent_of(path)? else {
            // The root: only a directory may stand there; keep its children.
            if matches!(kind, NodeKind::Dir(_)) {
                self.nodes[0].meta = meta;
                return Ok(0);
            }
            return Err(TreeError::BadName { path: show(path) });
        };
        let existing = match &self.nodes[dir].kind {
            NodeKind::Dir(children) => children.get(name).copied(),
            _ => None,
        };
        if let (Some(id), NodeKind::Dir(_)) = (existing, &kind) {
            if matches!(self.nodes[id].kind, NodeKind::Dir(_)) {
                // An opaque marker seen before the directory's own entry (OCI layers may put
                // `.wh..wh..opq` first) marks the layer's directory, not the metadata it replaces.
                let old = std::mem::replace(&mut self.nodes[id].meta, meta);
                if let Some((_, v)) = old.xattrs.iter().find(|(k, _)| k == OPAQUE_XATTR) {
                    let v = v.clone();
                    set_xattr(&mut self.nodes[id].meta.xattrs, OPAQUE_XATTR, &v);
                }
                return Ok(id);
            }
        }
        let id = self.push(Node {
            meta,
            kind,
            links: 1,
        });
        self.attach(dir, name, id);
        Ok(id)
    }

    /// Makes `path` a hard link to the node at `target` (which must exist and not be a directory).
    pub fn link(&mut self, path: &[u8], target: &[u8]) -> Result<NodeId, TreeError> {
        let bad = || TreeError::BadHardLink {
            path: show(path),
            target: show(target),
        };
        let id = self.lookup(target).ok_or_else(bad)?;
        if matches!(self.nodes[id].kind, NodeKind::Dir(_)) {
            return Err(bad());
        }
        let (dir, name) = self.parent_of(path)?.ok_or_else(bad)?;
        let same = match &self.nodes[dir].kind {
            NodeKind::Dir(children) => children.get(name) == Some(&id),
            _ => false,
        };
        if !same {
            self.nodes[id].links += 1;
            self.attach(dir, name, id);
        }
        Ok(id)
    }

    /// Marks the directory at `path` opaque (creating it if missing): lower layers' entries are hidden.
    pub fn set_opaque(&mut self, path: &[u8]) -> Result<NodeId, TreeError> {
        let id = match self.lookup(path) {
            Some(id) if matches!(self.nodes[id].kind, NodeKind::Dir(_)) => id,
            _ => self.insert(path, Meta::implied_dir(), NodeKind::Dir(BTreeMap::new()))?,
        };
        set_xattr(&mut self.nodes[id].meta.xattrs, OPAQUE_XATTR, b"y");
        Ok(id)
    }

    /// Removes the whiteouts for which `keep(path)` is false (they would hide nothing; overlay shows a
    /// whiteout as a broken entry when its directory exists in one layer only). Returns how many.
    pub fn prune_whiteouts(&mut self, keep: &dyn Fn(&[u8]) -> bool) -> usize {
        let mut pruned = 0;
        let mut stack: Vec<(NodeId, Vec<u8>)> = vec![(0, Vec::new())];
        while let Some((dir, path)) = stack.pop() {
            let mut drop = Vec::new();
            for (name, child) in self.children(dir) {
                let p = crate::source::join(&path, name);
                match &self.nodes[child].kind {
                    NodeKind::Dir(_) => stack.push((child, p)),
                    k if k.is_whiteout() && !keep(&p) => drop.push(name.to_vec()),
                    _ => {}
                }
            }
            if let NodeKind::Dir(children) = &mut self.nodes[dir].kind {
                for name in drop {
                    children.remove(&name);
                    pruned += 1;
                }
            }
        }
        pruned
    }

    /// Removes every whiteout and opaque marker (for the bottom layer of an image, where overlay would
    /// show them as stray entries). Returns how many whiteouts were dropped.
    pub fn drop_whiteouts(&mut self) -> usize {
        let mut dropped = 0;
        for i in 0..self.nodes.len() {
            self.nodes[i].meta.xattrs.retain(|(k, _)| k != OPAQUE_XATTR);
            let whiteouts: Vec<Vec<u8>> = self
                .children(i)
                .filter(|(_, c)| self.nodes[*c].kind.is_whiteout())
                .map(|(n, _)| n.to_vec())
                .collect();
            if let NodeKind::Dir(children) = &mut self.nodes[i].kind {
                for name in whiteouts {
                    children.remove(&name);
                    dropped += 1;
                }
            }
        }
        dropped
    }
}

/// Sets `name` to `value` in a sorted xattr list.
pub fn set_xattr(xattrs: &mut Vec<(Vec<u8>, Vec<u8>)>, name: &[u8], value: &[u8]) {
    match xattrs.binary_search_by(|(k, _)| k.as_slice().cmp(name)) {
        Ok(i) => xattrs[i].1 = value.to_vec(),
        Err(i) => xattrs.insert(i, (name.to_vec(), value.to_vec())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file() -> NodeKind {
        NodeKind::File {
            size: 0,
            data: FileData::Inline(Vec::new()),
        }
    }

    #[test]
    fn implied_parents_and_replacement() {
        let mut t = Tree::new();
        t.insert(b"a/b/c", Meta::implied_dir(), file()).unwrap();
        assert!(matches!(
            t.nodes[t.lookup(b"a/b").unwrap()].kind,
            NodeKind::Dir(_)
        ));
        t.insert(b"a/b", Meta::implied_dir(), NodeKind::Fifo)
            .unwrap();
        assert_eq!(t.nodes[t.lookup(b"a/b").unwrap()].kind, NodeKind::Fifo);
        assert!(t.lookup(b"a/b/c").is_none());
        assert!(t.insert(b"a/b/d", Meta::implied_dir(), file()).is_err());
        // Replacing a directory drops its subtree from the count.
        t.insert(b"a", Meta::implied_dir(), file()).unwrap();
        assert_eq!(t.entry_count(), 2);
    }

    #[test]
    fn hard_links_share_a_node() {
        let mut t = Tree::new();
        let id = t.insert(b"x", Meta::implied_dir(), file()).unwrap();
        assert_eq!(t.link(b"d/y", b"x").unwrap(), id);
        assert_eq!(t.nodes[id].links, 2);
        t.insert(b"d/y", Meta::implied_dir(), NodeKind::Fifo)
            .unwrap();
        assert_eq!(t.nodes[id].links, 1);
        assert!(t.link(b"z", b"nope").is_err());
        assert!(t.link(b"z", b"d").is_err());
    }

    #[test]
    fn whiteouts_drop() {
        let mut t = Tree::new();
        t.insert(
            b"d/gone",
            Meta::implied_dir(),
            NodeKind::CharDev { rdev: 0 },
        )
        .unwrap();
        t.set_opaque(b"d").unwrap();
        assert_eq!(t.drop_whiteouts(), 1);
        let d = t.lookup(b"d").unwrap();
        assert!(t.nodes[d].meta.xattrs.is_empty());
        assert!(t.lookup(b"d/gone").is_none());
    }

    #[test]
    fn opaque_marker_survives_the_directory_entry() {
        let mut t = Tree::new();
        let d = t.set_opaque(b"d").unwrap();
        let mut meta = Meta::implied_dir();
        meta.perm = 0o700;
        assert_eq!(
            t.insert(b"d", meta, NodeKind::Dir(BTreeMap::new()))
                .unwrap(),
            d
        );
        assert_eq!(t.nodes[d].meta.perm, 0o700);
        assert_eq!(
            t.nodes[d].meta.xattrs,
            vec![(OPAQUE_XATTR.to_vec(), b"y".to_vec())]
        );
    }

    #[test]
    fn rejects_dot_names() {
        let mut t = Tree::new();
        assert!(t.insert(b"a/../b", Meta::implied_dir(), file()).is_err());
    }
}

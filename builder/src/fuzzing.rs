//! The builder's fuzzing entry for hostile tars: what `fuzz/`'s `tar` target (cargo-fuzz) and the
//! tar source's stable smoke test run on arbitrary bytes.
//!
//! A layer is built from tars a user or a registry hands over (`strata build -`, `strata import`), so
//! the contract is: whatever the bytes — plain, gzip or zstd; pax and GNU extensions; names, links and
//! whiteouts meant to escape or confuse — the build answers with a layer or a [`BuildError`], never a
//! panic. The entry runs the source into the same tree a build makes (files inline, no chunks
//! stored), writes that tree as an EROFS image and reads the image back whole.

use std::io::Read;

use crate::error::BuildError;
use crate::source::{Entry, EntryKind, EntrySink, FileSource};
use crate::tree::{FileData, NodeKind, Tree};

/// Bytes of file data kept per input, across files (a compressed tar may expand without bound).
const MAX_DATA: u64 = 16 << 20;

/// The tree a build would make of the tar's entries; file bytes inline.
struct TreeSink {
    tree: Tree,
    data: u64,
}

impl EntrySink for TreeSink {
    fn add(&mut self, entry: Entry, data: Option<FileSource<'_>>) -> Result<(), BuildError> {
        let Entry { path, meta, kind } = entry;
        let node = match kind.plain_node() {
            Ok(node) => node,
            Err(EntryKind::File { .. }) => {
                let mut bytes = Vec::new();
                if let Some(FileSource::Stream(r)) = data {
                    let room = MAX_DATA.saturating_sub(self.data);
                    r.take(room)
                        .read_to_end(&mut bytes)
                        .map_err(|e| BuildError::io("tar member", e))?;
                    // The source checks that a member is as long as it says: drain the rest.
                    std::io::copy(r, &mut std::io::sink())
                        .map_err(|e| BuildError::io("tar member", e))?;
                }
                self.data += bytes.len() as u64;
                NodeKind::File {
                    size: bytes.len() as u64,
                    data: FileData::Inline(bytes),
                }
            }
            Err(EntryKind::HardLink(target)) => {
                self.tree.link(&path, &target)?;
                return Ok(());
            }
            Err(EntryKind::Opaque) => {
                self.tree.set_opaque(&path)?;
                return Ok(());
            }
            Err(_) => return Ok(()), // stored files come from parents, never from a tar
        };
        self.tree.insert(&path, meta, node)?;
        Ok(())
    }
}

/// Builds a tree of the tar `data` and writes and reads it back as an image (see the module
/// documentation); panics only on a bug.
pub fn tar(data: &[u8]) {
    let reader: Box<dyn Read + Send> = Box::new(std::io::Cursor::new(data.to_vec()));
    let Ok(stream) = crate::source::tar::open_stream(reader) else {
        return;
    };
    let mut sink = TreeSink {
        tree: Tree::new(),
        data: 0,
    };
    if crate::source::tar::read_tar(stream, &mut sink).is_err() {
        return;
    }
    let image = crate::erofs::write_image(&sink.tree, &[], 12, &|_| None);
    if let Ok(image) = image {
        strata_erofs::fuzzing::walk(&image);
        let img = crate::erofs::ErofsImage::parse(image).expect("a written image parses");
        img.any_xattrs().expect("a written image walks");
    }
}

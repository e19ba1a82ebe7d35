//! Layer metadata files served on the blob server's mount, for microVMs: `<mount>/meta/<layer hex>`.
//!
//! A microVM's VMM opens its drives as files: each layer's EROFS metadata is one of them, beside the
//! layer's blob files. The metadata lives in the state directory, root's only; serving it through the
//! daemon's FUSE mount gives the VMM the same access rules as the blob files (root, or the configured
//! group) without copying it or opening the state directory. A file is served from the local copy the
//! daemon fetched and verified (kept open, so trimming the metadata directory cannot pull it from under
//! a running VM), read on the FUSE worker: it is on local disk. Its size is rounded up to the next 4 KiB
//! (zeros): VMMs take drives in whole sectors, and EROFS addresses 4 KiB blocks.
//!
//! Node ids are derived from the layer digest like blob files' ([`crate::blobfs::blob_ino`]), with the
//! top bit clear and the next set, so they never meet a blob's, the root's or a directory's.

use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::{Arc, RwLock};

use strata_registry::digest::Digest;
use strata_registry::toc::BLOCK_SIZE;

/// The node id of layer `d`'s metadata file.
pub fn meta_ino(d: &Digest) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&d.0[..8]);
    (u64::from_le_bytes(b) & !(1 << 63)) | (1 << 62)
}

/// One layer's metadata, open.
pub struct MetaFile {
    pub layer: Digest,
    file: std::fs::File,
    len: u64,
}

impl MetaFile {
    /// The size the file is served with: its length rounded up to a 4 KiB block.
    pub fn size(&self) -> u64 {
        self.len.div_ceil(BLOCK_SIZE) * BLOCK_SIZE
    }

    /// Fills `buf` from `offset` (zeros past the end of the local file).
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = (buf.len() as u64).min(self.size().saturating_sub(offset)) as usize;
        let mut done = 0;
        while done < n && offset + (done as u64) < self.len {
            match self.file.read_at(&mut buf[done..n], offset + done as u64)? {
                0 => break,
                k => done += k,
            }
        }
        buf[done..n].fill(0);
        Ok(n)
    }
}

/// The metadata files served, by node id.
#[derive(Default)]
pub struct MetaTable {
    inner: RwLock<HashMap<u64, Arc<MetaFile>>>,
}

impl MetaTable {
    /// Serves layer `d`'s metadata from `path` (the local copy, already verified); idempotent.
    pub fn add(&self, d: &Digest, path: &Path) -> std::io::Result<()> {
        let mut t = self.inner.write().unwrap_or_else(|p| p.into_inner());
        if t.get(&meta_ino(d)).is_some_and(|m| m.layer == *d) {
            return Ok(());
        }
        let file = std::fs::File::open(path)?;
        let len = file.metadata()?.len();
        t.insert(
            meta_ino(d),
            Arc::new(MetaFile {
                layer: *d,
                file,
                len,
            }),
        );
        Ok(())
    }

    /// Stops serving layer `d`'s metadata.
    pub fn remove(&self, d: &Digest) {
        let mut t = self.inner.write().unwrap_or_else(|p| p.into_inner());
        if t.get(&meta_ino(d)).is_some_and(|m| m.layer == *d) {
            t.remove(&meta_ino(d));
        }
    }

    /// The file with node id `ino`.
    pub fn get(&self, ino: u64) -> Option<Arc<MetaFile>> {
        self.inner
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&ino)
            .cloned()
    }

    /// Layer `d`'s file.
    pub fn by_digest(&self, d: &Digest) -> Option<Arc<MetaFile>> {
        self.get(meta_ino(d)).filter(|m| m.layer == *d)
    }

    /// The file named `name` (a layer digest's hex).
    pub fn by_name(&self, name: &[u8]) -> Option<Arc<MetaFile>> {
        let d = Digest::from_hex(std::str::from_utf8(name).ok()?).ok()?;
        self.by_digest(&d)
    }

    /// Every file served, by layer digest.
    pub fn all(&self) -> Vec<Arc<MetaFile>> {
        let t = self.inner.read().unwrap_or_else(|p| p.into_inner());
        let mut v: Vec<_> = t.values().cloned().collect();
        v.sort_by_key(|m| m.layer);
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn served_in_whole_blocks_with_zeros_past_the_end() {
        let t = tempfile::tempdir().expect("tempdir");
        let p = t.path().join("m.erofs");
        let data: Vec<u8> = (0..5000u32).map(|i| (i % 251) as u8 + 1).collect();
        std::fs::write(&p, &data).expect("write");
        let d = Digest::of(b"layer");
        let table = MetaTable::default();
        table.add(&d, &p).expect("add");
        let m = table.by_name(d.hex().as_bytes()).expect("served");
        assert_eq!(m.size(), 8192);
        let mut buf = vec![9u8; 8192];
        assert_eq!(m.read_at(0, &mut buf).expect("read"), 8192);
        assert_eq!(&buf[..5000], &data[..]);
        assert!(buf[5000..].iter().all(|&b| b == 0));
        let mut tail = vec![9u8; 100];
        assert_eq!(m.read_at(8150, &mut tail).expect("read"), 42);
        assert_eq!(m.read_at(8192, &mut tail).expect("read"), 0);
        assert!(meta_ino(&d) >= 1 << 62 && meta_ino(&d) < 1 << 63);
        table.remove(&d);
        assert!(table.get(meta_ino(&d)).is_none());
    }
}

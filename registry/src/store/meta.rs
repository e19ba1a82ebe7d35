//! Layer metadata in the store (`meta/<hex>`): the EROFS image zstd-compressed as a stream of frames,
//! or — for a rebuild whose parent's metadata is stored whole — a zstd patch against the parent's
//! image (`--patch-from`): a rebuild's metadata differs from its parent's in a few inodes, so the
//! patch is a few percent of the image. A patch's base is never itself a patch, so reading metadata
//! needs at most one other object, and every image read is checked against its digest (its name).
//! Frames are decompressed, hashed and written on every core straight into the node's file while the
//! object is still being read ([`Store::get_meta_into`], the first mount's metadata step).

use super::unpack::{self, UnpackError, Unpacked};
use super::{frames, key, Digest, Store, StoreError};

impl Store {
    /// Stores the EROFS metadata of a layer, zstd-compressed; returns the digest of the uncompressed
    /// image (its name) and the number of bytes stored. With `base` (the parent layer's metadata digest and
    /// image), the image is stored as a zstd patch against it — a rebuild's metadata differs from its
    /// parent's in a few inodes, so the patch is a few percent of the image. A base that is itself a patch
    /// is not used, so reading metadata never needs more than one other object.
    pub fn put_meta(
        &self,
        meta: &[u8],
        base: Option<(&Digest, &[u8])>,
    ) -> Result<(Digest, u64), StoreError> {
        let d = Digest::of(meta);
        let key = key::meta(&d);
        let patch = match base {
            Some((bd, bimg)) if !self.meta_is_patch(bd)? && self.reusable(&key::meta(bd))? => {
                Some((bd, bimg))
            }
            _ => None,
        };
        let z = match patch {
            None => frames::compress(meta, 3),
            Some((bd, bimg)) => {
                let payload = patch_compress(meta, bimg).map_err(|e| StoreError::Malformed {
                    key: key.clone(),
                    why: format!("zstd patch: {e}"),
                })?;
                let mut out = Vec::with_capacity(48 + payload.len());
                out.extend_from_slice(META_PATCH_MAGIC);
                out.extend_from_slice(&bd.0);
                out.extend_from_slice(&(meta.len() as u64).to_le_bytes());
                out.extend_from_slice(&payload);
                out
            }
        };
        let stored = z.len() as u64;
        self.put_bytes(&key, z)?;
        Ok((d, stored))
    }

    /// The metadata object `d` is stored as a patch against: `Some(base)` for a patch.
    pub fn meta_base(&self, d: &Digest) -> Result<Option<Digest>, StoreError> {
        let key = key::meta(d);
        match self.size(&key)? {
            Some(n) if n >= 48 => {
                let b = self.get_range(&key, 0..40)?;
                if &b[..8] != META_PATCH_MAGIC {
                    return Ok(None);
                }
                let mut bd = [0u8; 32];
                bd.copy_from_slice(&b[8..40]);
                Ok(Some(Digest(bd)))
            }
            _ => Ok(None),
        }
    }

    /// True if the stored metadata object `d` is a patch against another.
    pub(super) fn meta_is_patch(&self, d: &Digest) -> Result<bool, StoreError> {
        let key = key::meta(d);
        match self.size(&key)? {
            Some(n) if n >= 8 => Ok(&self.get_range(&key, 0..8)?[..] == META_PATCH_MAGIC),
            _ => Ok(false),
        }
    }

    /// Reads layer metadata: decompresses it (applying its base if it is a patch) and checks the image
    /// against its digest.
    pub fn get_meta(&self, d: &Digest) -> Result<Vec<u8>, StoreError> {
        self.get_meta_at(d, 0)
    }

    /// Reads layer metadata into `out` (a new, empty file at `path`) and checks it against its digest,
    /// as [`Self::get_meta`] does. A stream of sized frames is decompressed, checked and written frame
    /// by frame on every core while it is still being read ([`unpack`]). Returns the image's length.
    /// On an error the file holds anything: the caller keeps it out of use.
    pub fn get_meta_into(
        &self,
        d: &Digest,
        out: &std::fs::File,
        path: &std::path::Path,
    ) -> Result<u64, StoreError> {
        let key = key::meta(d);
        let read = |sink: &mut dyn FnMut(&[u8])| self.backend.get_streamed(&key, sink);
        let z = match unpack::unpack_into(META_MAX, out, read) {
            Ok(Unpacked::Written { len, digest }) if digest == *d => return Ok(len),
            Ok(Unpacked::Written { digest, .. }) => {
                return Err(StoreError::Corrupt {
                    key,
                    expected: *d,
                    actual: digest,
                })
            }
            Ok(Unpacked::Whole(z)) => z,
            Err(UnpackError::Read(e)) => return Err(e),
            Err(UnpackError::Stream(e)) => {
                return Err(StoreError::Malformed {
                    key,
                    why: format!("not a zstd stream: {e}"),
                })
            }
            Err(UnpackError::Write(source)) => {
                return Err(StoreError::Io {
                    path: path.to_path_buf(),
                    source,
                })
            }
        };
        let image = self.meta_of(d, key, &z, 0)?;
        use std::os::unix::fs::FileExt;
        out.write_all_at(&image, 0)
            .map_err(|source| StoreError::Io {
                path: path.to_path_buf(),
                source,
            })?;
        Ok(image.len() as u64)
    }

    fn get_meta_at(&self, d: &Digest, depth: u32) -> Result<Vec<u8>, StoreError> {
        let key = key::meta(d);
        let z = self.backend.get(&key)?.0;
        self.meta_of(d, key, &z, depth)
    }

    /// Layer metadata `d` out of its stored bytes `z` (under `key`), checked.
    fn meta_of(
        &self,
        d: &Digest,
        key: String,
        z: &[u8],
        depth: u32,
    ) -> Result<Vec<u8>, StoreError> {
        let bad = |why: String| StoreError::Malformed {
            key: key.clone(),
            why,
        };
        let image = if z.starts_with(META_PATCH_MAGIC) && z.len() >= 48 {
            if depth > 0 {
                return Err(bad("patch against a patch".into()));
            }
            let mut bd = [0u8; 32];
            bd.copy_from_slice(&z[8..40]);
            let mut len = [0u8; 8];
            len.copy_from_slice(&z[40..48]);
            let len = u64::from_le_bytes(len);
            if len > META_MAX {
                return Err(bad(format!("patch claims {len} bytes")));
            }
            let base = self.get_meta_at(&Digest(bd), depth + 1)?;
            patch_decompress(&z[48..], &base, len as usize)
                .map_err(|e| bad(format!("zstd patch: {e}")))?
        } else {
            frames::decompress(z, META_MAX).map_err(|e| bad(format!("not a zstd stream: {e}")))?
        };
        let actual = Digest::of(&image);
        if actual != *d {
            return Err(StoreError::Corrupt {
                key,
                expected: *d,
                actual,
            });
        }
        Ok(image)
    }
}

/// Largest metadata image a store object may decompress to.
const META_MAX: u64 = 1 << 34;

/// Marks a metadata object stored as a patch: magic, base digest (32 bytes), image length (u64), payload.
const META_PATCH_MAGIC: &[u8; 8] = b"STRMETP1";

/// zstd window large enough to reach back through `base` (up to 128 MiB).
fn patch_window(total: usize) -> u32 {
    (usize::BITS - total.max(1).leading_zeros()).clamp(21, 27)
}

fn patch_compress(data: &[u8], base: &[u8]) -> std::io::Result<Vec<u8>> {
    use zstd::zstd_safe::CParameter;
    let window = patch_window(data.len() + base.len());
    let mut c = zstd::bulk::Compressor::with_dictionary(3, base)?;
    // As `zstd --patch-from`: a window over base and data, and match tables sized to index the base.
    c.set_parameter(CParameter::WindowLog(window))?;
    c.set_parameter(CParameter::HashLog(window.min(25)))?;
    c.set_parameter(CParameter::ChainLog(window.min(25)))?;
    // Long-distance matching finds the unchanged runs anywhere in the base, as `zstd --patch-from` does.
    c.set_parameter(zstd::zstd_safe::CParameter::EnableLongDistanceMatching(
        true,
    ))?;
    c.compress(data)
}

fn patch_decompress(payload: &[u8], base: &[u8], len: usize) -> std::io::Result<Vec<u8>> {
    let mut d = zstd::bulk::Decompressor::with_dictionary(base)?;
    d.set_parameter(zstd::zstd_safe::DParameter::WindowLogMax(27))?;
    let out = d.decompress(payload, len)?;
    if out.len() != len {
        return Err(std::io::Error::other(
            "patch decompressed to the wrong length",
        ));
    }
    Ok(out)
}

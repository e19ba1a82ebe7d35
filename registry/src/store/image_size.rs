//! What an image costs in a store: the one definition `strata images` and stratad's `ps` share.
//!
//! Stored bytes are the sizes of the distinct objects the image's layers need — each layer's metadata
//! object (and the metadata a patch is based on, once) and each blob, once however many layers share
//! it (a diff layer reusing its base's blobs adds nothing) — as the store holds them (compressed).
//! File bytes are the layers' file contents, summed (what unpacking every layer would write).

use std::collections::BTreeMap;

use super::{key, Store, StoreError};
use crate::model::Manifest;

impl Store {
    /// `(stored bytes, file bytes)` of the image of manifest `m` (see the module documentation).
    pub fn image_size(&self, m: &Manifest) -> Result<(u64, u64), StoreError> {
        let mut objects = BTreeMap::new();
        let mut logical = 0;
        for l in &m.layers {
            let d = self.get_layer(&l.digest)?;
            logical += d.stats.file_bytes;
            let mut metas = vec![d.meta.digest];
            metas.extend(self.meta_base(&d.meta.digest)?);
            for md in metas {
                let k = key::meta(&md);
                if let std::collections::btree_map::Entry::Vacant(e) = objects.entry(k) {
                    let n = self
                        .size(e.key())?
                        .ok_or_else(|| StoreError::NotFound(e.key().clone()))?;
                    e.insert(n);
                }
            }
            for b in &d.blobs {
                objects.insert(key::blob(&b.digest), b.size);
            }
        }
        Ok((objects.values().sum(), logical))
    }
}

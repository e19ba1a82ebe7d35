//! [`MemoryStore`]: a [`StoreBackend`] that keeps objects in memory, for unit tests that need a store
//! without a disk, a network or root.
//!
//! It keeps the whole contract of [`super::object`]: every write gives the object a new version (an
//! `ETag`-like counter shared by all keys, so a deleted and rewritten object never gets its old version
//! back), conditional puts compare under the one lock that guards the map, listing is by directory
//! prefix and sorted. Reads never wait, so a range read always meets its deadline; wrap the store in a
//! [`super::fault::FaultyStore`] to make it slow, hang or fail.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;

use super::object::{below, check_range, ObjectMeta, PutMode, StoreBackend, Version};
use super::StoreError;

struct Object {
    data: Bytes,
    version: u64,
    modified: i64,
}

#[derive(Default)]
struct Objects {
    map: BTreeMap<String, Object>,
    /// The last version given out.
    last: u64,
}

/// Objects in memory. `MemoryStore::new()`; share it with `Arc`.
pub struct MemoryStore {
    url: String,
    objects: Mutex<Objects>,
    /// A fixed "now" for modification times (Unix seconds), for tests of time-dependent logic.
    clock: Mutex<Option<i64>>,
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore::new()
    }
}

fn version(n: u64) -> Version {
    Version {
        e_tag: Some(format!("\"{n}\"")),
        version: None,
    }
}

fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

impl MemoryStore {
    /// An empty store (its URL, shown in errors, is `memory://`).
    pub fn new() -> MemoryStore {
        MemoryStore::named("memory://")
    }

    /// An empty store that names itself `url` in errors.
    pub fn named(url: &str) -> MemoryStore {
        MemoryStore {
            url: url.to_string(),
            objects: Mutex::new(Objects::default()),
            clock: Mutex::new(None),
        }
    }

    /// Stamps later writes with `secs` (Unix seconds) instead of the real time; `None` restores it.
    pub fn set_clock(&self, secs: Option<i64>) {
        *self.clock.lock().unwrap_or_else(|e| e.into_inner()) = secs;
    }

    fn now(&self) -> i64 {
        self.clock
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .unwrap_or_else(now)
    }

    fn lock(&self) -> MutexGuard<'_, Objects> {
        // The map is consistent after every statement: a panic elsewhere leaves nothing half done.
        self.objects.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Replaces an object's bytes behind the store's back, keeping its version (a disk that rots, for
    /// corruption tests). Returns false when there is no such object.
    pub fn tamper(&self, key: &str, f: impl FnOnce(&mut Vec<u8>)) -> bool {
        let mut objects = self.lock();
        let Some(o) = objects.map.get_mut(key) else {
            return false;
        };
        let mut data = o.data.to_vec();
        f(&mut data);
        o.data = Bytes::from(data);
        true
    }

    fn meta(key: &str, o: &Object) -> ObjectMeta {
        ObjectMeta {
            key: key.to_string(),
            size: o.data.len() as u64,
            modified: o.modified,
            version: version(o.version),
        }
    }
}

impl StoreBackend for MemoryStore {
    fn url(&self) -> &str {
        &self.url
    }

    fn get(&self, key: &str) -> Result<(Bytes, Version), StoreError> {
        let objects = self.lock();
        let o = objects
            .map
            .get(key)
            .ok_or_else(|| StoreError::NotFound(key.to_string()))?;
        Ok((o.data.clone(), version(o.version)))
    }

    fn get_range(
        &self,
        key: &str,
        range: Range<u64>,
        _deadline: Duration,
    ) -> Result<Bytes, StoreError> {
        let data = self.get(key)?.0;
        check_range(key, &range, data.len() as u64)?;
        Ok(data.slice(range.start as usize..range.end as usize))
    }

    fn head(&self, key: &str) -> Result<Option<ObjectMeta>, StoreError> {
        Ok(self.lock().map.get(key).map(|o| Self::meta(key, o)))
    }

    fn put(&self, key: &str, data: Bytes, mode: PutMode) -> Result<Version, StoreError> {
        let stamp = self.now();
        let mut objects = self.lock();
        let current = objects.map.get(key).map(|o| version(o.version));
        let allowed = match &mode {
            PutMode::Overwrite => true,
            PutMode::Create => current.is_none(),
            PutMode::IfMatch(prev) => current.as_ref() == Some(prev),
        };
        if !allowed {
            return Err(StoreError::Precondition(key.to_string()));
        }
        objects.last += 1;
        let n = objects.last;
        objects.map.insert(
            key.to_string(),
            Object {
                data,
                version: n,
                modified: stamp,
            },
        );
        Ok(version(n))
    }

    fn list_info(&self, prefix: &str) -> Result<Vec<ObjectMeta>, StoreError> {
        Ok(self
            .lock()
            .map
            .iter()
            .filter(|(k, _)| below(prefix, k))
            .map(|(k, o)| Self::meta(k, o))
            .collect())
    }

    fn delete(&self, key: &str) -> Result<(), StoreError> {
        self.lock().map.remove(key);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conforms() {
        super::super::conformance::run(&MemoryStore::new());
    }
}

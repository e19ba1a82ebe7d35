//! Tags: `tags/<name>/<tag>` objects naming a manifest, moved and deleted only by compare-and-swap.
//!
//! A tag's value is the text `blake3:<hex>\n`. Every change states what the writer saw (a [`TagState`], or
//! absent) and fails with [`StoreError::TagConflict`], changing nothing, if the tag moved meanwhile:
//!
//! - **A local store** serializes changes under `flock` on `tags/.lock` ([`super::tagfile`]); a deleted
//!   tag's file is removed.
//! - **S3** has conditional puts (`If-None-Match: *`, `If-Match: <etag>`) but no conditional delete, and an
//!   unconditional delete could remove a value someone else had just written. A deleted tag is therefore
//!   overwritten, if-match, with the *tombstone* `deleted\n`, which every reader takes for "absent"; a
//!   later create replaces the tombstone if-match on its version. Tombstones are a few bytes and are
//!   never removed.
//!
//! - **An S3 server that ignores conditional writes** (found by the backend's probe,
//!   [`super::conditional`]) refuses tag changes with [`StoreError::NoConditionalWrites`] — unless the
//!   store was opened with a tag lock (`STRATA_TAG_LOCK=<file>`): then a change is read, compare and
//!   overwrite under an exclusive `flock` of that file, which is safe exactly when every tag writer
//!   shares it (one machine, or a filesystem with global `flock` such as MooseFS or CephFS).
//!
//! **Broken tags.** [`Store::tags`] lists every tag object, and a value that is not a digest, or a key
//! that is not a tag name, comes back as a [`BrokenTag`] rather than being skipped: garbage collection
//! must stop rather than take an unreadable tag for an absent one, and `strata images` must name it.

use bytes::Bytes;

use super::{key, tagfile, PutMode, Store, StoreError, Version};
use crate::digest::Digest;
use crate::model::TagName;

/// The value of a deleted tag on a store without conditional deletes.
const TOMBSTONE: &str = "deleted";

/// A tag's current value and version, for a later compare-and-swap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TagState {
    pub digest: Digest,
    version: Option<Version>,
}

/// A tag object whose name or value cannot be read as a tag.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct BrokenTag {
    /// The store key (`tags/<name>/<tag>`).
    pub key: String,
    /// `NAME:TAG`, when the key is a valid tag name.
    pub tag: Option<String>,
    pub why: String,
}

/// Every tag of a store: the readable ones, sorted, and the broken ones.
#[derive(Clone, Debug, Default)]
pub struct TagList {
    pub good: Vec<(TagName, Digest)>,
    pub broken: Vec<BrokenTag>,
}

/// What a tag object's bytes say.
enum Value {
    Digest(Digest),
    Tombstone,
    Bad(String),
}

fn parse_value(b: &[u8]) -> Value {
    let Ok(s) = std::str::from_utf8(b) else {
        return Value::Bad("not UTF-8 text".into());
    };
    let s = s.trim();
    if s.is_empty() {
        return Value::Bad("empty".into());
    }
    if s == TOMBSTONE {
        return Value::Tombstone;
    }
    match s.parse::<Digest>() {
        Ok(d) => Value::Digest(d),
        Err(e) => Value::Bad(format!("not a digest: {e}")),
    }
}

fn tag_key(t: &TagName) -> String {
    format!("tags/{}/{}", t.name, t.tag)
}

/// The tag a store key names (`tags/a/b/v1` is `a/b:v1`).
fn tag_of_key(k: &str) -> Option<TagName> {
    let rest = k.strip_prefix("tags/")?;
    let (name, tag) = rest.rsplit_once('/')?;
    TagName::parse(&format!("{name}:{tag}")).ok()
}

impl Store {
    /// The raw value and version of a tag object (`None`: no object).
    fn tag_raw(&self, t: &TagName) -> Result<Option<(Bytes, Option<Version>)>, StoreError> {
        match &self.local {
            Some(root) => Ok(tagfile::get(root, t)?.map(|v| (Bytes::from(v), None))),
            None => match self.backend.get(&tag_key(t)) {
                Ok((b, v)) => Ok(Some((b, Some(v)))),
                Err(e) if e.is_not_found() => Ok(None),
                Err(e) => Err(e),
            },
        }
    }

    /// The current value of a tag (`None`: absent or deleted). A value that is not a digest is
    /// [`StoreError::Malformed`], naming the tag.
    pub fn tag_get(&self, t: &TagName) -> Result<Option<TagState>, StoreError> {
        let Some((b, version)) = self.tag_raw(t)? else {
            return Ok(None);
        };
        match parse_value(&b) {
            Value::Digest(digest) => Ok(Some(TagState { digest, version })),
            Value::Tombstone => Ok(None),
            Value::Bad(why) => Err(StoreError::Malformed {
                key: tag_key(t),
                why: format!("tag {t}: {why}"),
            }),
        }
    }

    fn conflict(t: &TagName, prev: Option<&TagState>, found: Option<Digest>) -> StoreError {
        StoreError::TagConflict {
            tag: t.to_string(),
            expected: prev.map_or("absent".to_string(), |p| p.digest.to_string()),
            found: found.map_or("absent".to_string(), |d| d.to_string()),
        }
    }

    /// What the tag holds now, for a conflict report (a broken value reads as absent here).
    fn found(&self, t: &TagName) -> Result<Option<Digest>, StoreError> {
        Ok(match self.tag_raw(t)? {
            Some((b, _)) => match parse_value(&b) {
                Value::Digest(d) => Some(d),
                _ => None,
            },
            None => None,
        })
    }

    /// Points tag `t` at `new` if it still is as `prev` saw it (`None`: the tag did not exist). A tag
    /// changed by someone else meanwhile is a [`StoreError::TagConflict`] and nothing is written.
    pub fn tag_set(
        &self,
        t: &TagName,
        prev: Option<&TagState>,
        new: &Digest,
    ) -> Result<(), StoreError> {
        let value = format!("{new}\n");
        self.tag_swap(t, prev, Some(value.as_bytes()), Some(new))
    }

    /// Deletes tag `t` if it still names what `prev` saw. Objects it reached stay until `strata gc`.
    pub fn tag_delete(&self, t: &TagName, prev: &TagState) -> Result<(), StoreError> {
        self.tag_swap(t, Some(prev), None, None)
    }

    /// That tag `t` may name image `d`: its manifest exists, nothing it reaches is gone, and what gc
    /// condemned is pardoned ([`Store::revive_image`]). Done as late as the write allows: under the lock
    /// where tags change under one, else just before the conditional put. So a writer that found its
    /// objects long before — a build that outlasted gc's grace period, a lock wait, a stalled machine —
    /// is refused once gc has deleted any of them, rather than naming them. What is left is a deleting
    /// gc run under way during the check and the write (`crate::gc`).
    fn check_image(&self, t: &TagName, d: Option<&Digest>) -> Result<(), StoreError> {
        let Some(d) = d else {
            return Ok(());
        };
        match self.revive_image(d)? {
            Some(key) if key == key::manifest(d) => Err(StoreError::NotFound(key)),
            Some(key) => Err(StoreError::Unreachable {
                tag: t.to_string(),
                key,
            }),
            None => Ok(()),
        }
    }

    /// Compare-and-swap of a tag object: `new` is the value to write, `None` to delete; `names`, the
    /// manifest the new value names ([`Self::check_image`]).
    fn tag_swap(
        &self,
        t: &TagName,
        prev: Option<&TagState>,
        new: Option<&[u8]>,
        names: Option<&Digest>,
    ) -> Result<(), StoreError> {
        if let Some(root) = &self.local {
            let expected = prev.map(|p| format!("{}\n", p.digest));
            return match tagfile::compare_and_swap(
                root,
                t,
                expected.as_deref().map(str::as_bytes),
                new,
                &|| self.check_image(t, names),
            )? {
                Ok(()) => Ok(()),
                Err(found) => Err(Self::conflict(
                    t,
                    prev,
                    found.and_then(|f| match parse_value(&f) {
                        Value::Digest(d) => Some(d),
                        _ => None,
                    }),
                )),
            };
        }
        self.tag_swap_conditional(t, prev, new, names)
    }

    /// Compare-and-swap by the backend's conditional put; on a server without conditional writes, under
    /// the configured tag lock ([`Store::tag_swap_locked`]) or not at all.
    fn tag_swap_conditional(
        &self,
        t: &TagName,
        prev: Option<&TagState>,
        new: Option<&[u8]>,
        names: Option<&Digest>,
    ) -> Result<(), StoreError> {
        let key = tag_key(t);
        let data = Bytes::copy_from_slice(new.unwrap_or(b"deleted\n"));
        let mode = match prev {
            Some(p) => match &p.version {
                Some(v) => PutMode::IfMatch(v.clone()),
                None => return Err(Self::conflict(t, prev, self.found(t)?)),
            },
            // Absent may be a tombstone: replace that exact tombstone, or create.
            None => match self.tag_raw(t)? {
                Some((b, Some(v))) if matches!(parse_value(&b), Value::Tombstone) => {
                    PutMode::IfMatch(v)
                }
                Some(_) => return Err(Self::conflict(t, prev, self.found(t)?)),
                None => PutMode::Create,
            },
        };
        self.check_image(t, names)?;
        match self.backend.put(&key, data.clone(), mode) {
            Ok(_) => Ok(()),
            Err(StoreError::Precondition(_)) => Err(Self::conflict(t, prev, self.found(t)?)),
            Err(StoreError::NoConditionalWrites { .. }) if self.tag_lock.is_some() => {
                self.tag_swap_locked(t, prev, data, names)
            }
            Err(e) => Err(e),
        }
    }

    /// The fallback for servers without conditional writes: read, compare and overwrite while holding
    /// an exclusive `flock` on the tag lock file (`STRATA_TAG_LOCK`). Safe only when every tag writer of
    /// the store uses the same lock file, on a filesystem whose `flock` is global across the machines
    /// that write (docs/STORES.md); writers without it are refused by the probe, never let through.
    fn tag_swap_locked(
        &self,
        t: &TagName,
        prev: Option<&TagState>,
        data: Bytes,
        names: Option<&Digest>,
    ) -> Result<(), StoreError> {
        let Some(path) = &self.tag_lock else {
            return Err(StoreError::NoConditionalWrites {
                url: self.url().to_string(),
                feature: super::conditional::NO_CREATE_ONLY,
            });
        };
        let _lock = tagfile::lock_file(path)?;
        let current = match self.tag_raw(t)? {
            Some((b, _)) => parse_value(&b),
            None => Value::Tombstone,
        };
        let same = match (prev, &current) {
            (Some(p), Value::Digest(d)) => p.digest == *d,
            (None, Value::Tombstone) => true,
            _ => false,
        };
        if !same {
            return Err(Self::conflict(t, prev, self.found(t)?));
        }
        self.check_image(t, names)?;
        self.backend
            .put(&tag_key(t), data, PutMode::Overwrite)
            .map(|_| ())
    }

    /// Every tag object: the tags and the manifests they name (sorted), and those that cannot be read.
    /// Deleted tags are not listed.
    pub fn tags(&self) -> Result<TagList, StoreError> {
        let mut out = TagList::default();
        let mut take = |k: String, value: &[u8]| {
            let tag = tag_of_key(&k);
            let bad = |why: String| BrokenTag {
                key: k.clone(),
                tag: tag.as_ref().map(ToString::to_string),
                why,
            };
            match (parse_value(value), &tag) {
                (Value::Tombstone, _) => {}
                (Value::Bad(why), _) => out.broken.push(bad(why)),
                (Value::Digest(_), None) => out
                    .broken
                    .push(bad("the key is not a valid NAME:TAG".into())),
                (Value::Digest(d), Some(t)) => out.good.push((t.clone(), d)),
            }
        };
        match &self.local {
            Some(root) => {
                for (k, v) in tagfile::list(root)? {
                    take(k, &v);
                }
            }
            None => {
                for k in self.backend.list("tags")? {
                    match self.backend.get(&k) {
                        Ok((b, _)) => take(k, &b),
                        Err(e) if e.is_not_found() => {}
                        Err(e) => return Err(e),
                    }
                }
            }
        }
        out.good.sort();
        out.broken.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::model::{Manifest, SCHEMA};
    use crate::store::MemoryStore;

    fn stores() -> (tempfile::TempDir, Vec<Store>) {
        let dir = tempfile::tempdir().expect("tempdir");
        let local = Store::open(&format!("file://{}", dir.path().display())).expect("open");
        let mem = Store::with_backend(Arc::new(MemoryStore::new()));
        (dir, vec![local, mem])
    }

    fn manifest(store: &Store, n: usize) -> Digest {
        let m = Manifest {
            schema: SCHEMA,
            layers: vec![],
            config: Default::default(),
            annotations: [("n".to_string(), n.to_string())].into(),
        };
        store.put_manifest(&m).expect("manifest")
    }

    #[test]
    fn delete_is_compare_and_swap_and_a_deleted_tag_can_come_back() {
        let (_dir, stores) = stores();
        for s in stores {
            let t = TagName::parse("a/b:v1").expect("tag");
            let (m1, m2) = (manifest(&s, 1), manifest(&s, 2));
            s.tag_set(&t, None, &m1).expect("create");
            let seen = s.tag_get(&t).expect("get").expect("set");
            s.tag_set(&t, Some(&seen), &m2).expect("move");
            // The stale state loses: nothing is deleted.
            let e = s.tag_delete(&t, &seen).expect_err("stale delete");
            assert!(matches!(e, StoreError::TagConflict { .. }), "{e}");
            let now = s.tag_get(&t).expect("get").expect("still there");
            assert_eq!(now.digest, m2);
            s.tag_delete(&t, &now).expect("delete");
            assert_eq!(s.tag_get(&t).expect("get"), None);
            assert!(s.tags().expect("tags").good.is_empty());
            // Deleting again with the old state conflicts; creating from absent works.
            assert!(s.tag_delete(&t, &now).is_err());
            s.tag_set(&t, None, &m1).expect("recreate");
            assert_eq!(s.tag_get(&t).expect("get").map(|x| x.digest), Some(m1));
            assert_eq!(s.tags().expect("tags").good, vec![(t.clone(), m1)]);
            // Creating over a live value is a conflict.
            assert!(s.tag_set(&t, None, &m2).is_err());
        }
    }

    #[test]
    fn broken_tags_are_listed_not_skipped() {
        let (dir, stores) = stores();
        for (i, s) in stores.into_iter().enumerate() {
            let m = manifest(&s, 1);
            let good = TagName::parse("ok:v1").expect("tag");
            s.tag_set(&good, None, &m).expect("set");
            let raw = |k: &str, v: &[u8]| match i {
                0 => {
                    let p = dir.path().join(k);
                    std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
                    std::fs::write(p, v).expect("write");
                }
                _ => {
                    s.backend()
                        .put(k, Bytes::copy_from_slice(v), PutMode::Overwrite)
                        .expect("put");
                }
            };
            raw("tags/empty/v1", b"");
            raw("tags/garbage/v1", b"\x00\xffnot a digest");
            raw("tags/Bad Name/v1", format!("{m}\n").as_bytes());
            let list = s.tags().expect("tags");
            assert_eq!(list.good, vec![(good.clone(), m)]);
            let keys: Vec<_> = list.broken.iter().map(|b| b.key.as_str()).collect();
            assert_eq!(
                keys,
                ["tags/Bad Name/v1", "tags/empty/v1", "tags/garbage/v1"]
            );
            let e = s
                .tag_get(&TagName::parse("garbage:v1").expect("tag"))
                .expect_err("garbage");
            assert!(e.to_string().contains("garbage:v1"), "{e}");
        }
    }

    /// A server that ignores conditional headers, as the S3 backend reports it after its probe.
    struct NoConditions(MemoryStore);

    impl crate::store::StoreBackend for NoConditions {
        fn url(&self) -> &str {
            "s3://no-conditions"
        }
        fn get(&self, key: &str) -> Result<(Bytes, Version), StoreError> {
            self.0.get(key)
        }
        fn get_range(
            &self,
            key: &str,
            range: std::ops::Range<u64>,
            deadline: std::time::Duration,
        ) -> Result<Bytes, StoreError> {
            self.0.get_range(key, range, deadline)
        }
        fn head(&self, key: &str) -> Result<Option<crate::store::ObjectMeta>, StoreError> {
            self.0.head(key)
        }
        fn put(&self, key: &str, data: Bytes, mode: PutMode) -> Result<Version, StoreError> {
            match mode {
                PutMode::Overwrite => self.0.put(key, data, mode),
                _ => Err(StoreError::NoConditionalWrites {
                    url: self.url().into(),
                    feature: crate::store::conditional::NO_IF_MATCH,
                }),
            }
        }
        fn list_info(&self, prefix: &str) -> Result<Vec<crate::store::ObjectMeta>, StoreError> {
            self.0.list_info(prefix)
        }
        fn delete(&self, key: &str) -> Result<(), StoreError> {
            self.0.delete(key)
        }
    }

    #[test]
    fn without_conditional_writes_tags_are_refused_unless_a_lock_serializes_them() {
        let s = Store::with_backend(Arc::new(NoConditions(MemoryStore::new())));
        let t = TagName::parse("a:v1").expect("tag");
        let m1 = manifest(&s, 1);
        let e = s.tag_set(&t, None, &m1).expect_err("no conditional writes");
        assert!(matches!(e, StoreError::NoConditionalWrites { .. }), "{e}");
        assert!(e.to_string().contains("STRATA_TAG_LOCK"), "{e}");
        assert_eq!(s.tag_get(&t).expect("get"), None, "nothing was written");

        let dir = tempfile::tempdir().expect("tempdir");
        let s = Arc::new(s.with_tag_lock(dir.path().join("tags.lock")));
        let m2 = manifest(&s, 2);
        s.tag_set(&t, None, &m1).expect("create under the lock");
        let seen = s.tag_get(&t).expect("get").expect("set");
        s.tag_set(&t, Some(&seen), &m2).expect("move");
        let e = s.tag_set(&t, Some(&seen), &m1).expect_err("stale");
        assert!(matches!(e, StoreError::TagConflict { .. }), "{e}");
        let now = s.tag_get(&t).expect("get").expect("set");
        s.tag_delete(&t, &now).expect("delete");
        assert_eq!(s.tag_get(&t).expect("get"), None);

        // Racing creators of one tag: exactly one wins, the others conflict.
        let race = TagName::parse("a:race").expect("tag");
        let wins: usize = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..8)
                .map(|i| {
                    let (s, race) = (s.clone(), race.clone());
                    let m = if i % 2 == 0 { m1 } else { m2 };
                    scope.spawn(move || s.tag_set(&race, None, &m).is_ok() as usize)
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("join")).sum()
        });
        assert_eq!(wins, 1);
    }

    /// A tag writer checks that its manifest exists under the tags' lock, not before waiting for it:
    /// gc may delete the manifest while the writer waits (here the test holds the lock meanwhile).
    #[test]
    fn a_manifest_deleted_while_the_writer_waits_for_the_lock_is_not_tagged() {
        let dir = tempfile::tempdir().expect("tempdir");
        let s = Store::open(&format!("file://{}", dir.path().display())).expect("open");
        let t = TagName::parse("a/b:v1").expect("tag");
        let m = manifest(&s, 1);
        let held = tagfile::lock(dir.path()).expect("lock");
        std::thread::scope(|scope| {
            let writer = scope.spawn(|| s.tag_set(&t, None, &m));
            std::thread::sleep(std::time::Duration::from_millis(100));
            s.backend().delete(&key::manifest(&m)).expect("delete");
            drop(held);
            let e = writer.join().expect("join").expect_err("manifest gone");
            assert!(matches!(e, StoreError::NotFound(_)), "{e}");
        });
        assert_eq!(s.tag_get(&t).expect("get"), None, "nothing was written");
    }
}

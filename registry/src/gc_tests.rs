//! Garbage collection against a model: random interleavings of builds (several in flight, reusing
//! each other's content), tag moves, tag deletions, collections and the passing of time, on a
//! [`MemoryStore`] whose clock the test drives. The invariant, checked after every step: every object a
//! tag reaches exists — and a broken tag stops a collection before anything is deleted.
//!
//! Builds follow the store's write order (blob → metadata → layer → manifest → tag), one object per step,
//! and finish within the grace period (the documented requirement), so the model interleaves the steps
//! of several builds with collections at any point.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::digest::Digest;
use crate::gc::{collect, GcError, GcOptions};
use crate::model::{
    BlobRef, LayerDescriptor, LayerKind, LayerStats, Manifest, ManifestLayer, ObjectRef, TagName,
    SCHEMA,
};
use crate::store::{key, MemoryStore, Store, StoreBackend};

const GRACE: i64 = 100;

/// A small deterministic generator (xorshift64*), so that a failing seed can be replayed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A build in flight: content `content` for tag `tag`, started at `started`, `step` objects written.
struct Build {
    content: u64,
    tag: TagName,
    started: i64,
    step: u8,
    layer: Option<Digest>,
    manifest: Option<Digest>,
}

struct World {
    mem: Arc<MemoryStore>,
    store: Store,
    now: i64,
    builds: Vec<Build>,
}

fn blob_bytes(content: u64) -> Vec<u8> {
    format!("blob of content {content}").into_bytes()
}

fn meta_bytes(content: u64) -> Vec<u8> {
    format!("metadata of content {content}").into_bytes()
}

pub(crate) fn descriptor(content: u64) -> LayerDescriptor {
    let blob = blob_bytes(content);
    let meta = meta_bytes(content);
    LayerDescriptor {
        schema: SCHEMA,
        kind: LayerKind::Base,
        content: None,
        meta: ObjectRef {
            digest: Digest::of(&meta),
            size: meta.len() as u64,
        },
        blobs: vec![BlobRef {
            digest: Digest::of(&blob),
            size: blob.len() as u64,
            view_size: 4096,
            toc_offset: 0,
            toc_len: 0,
            toc_digest: Digest::of(b""),
            chunks: 1,
        }],
        chunk_size: 4096,
        stats: LayerStats::default(),
        parent: None,
        labels: Default::default(),
        config: Default::default(),
        built_on: None,
    }
}

impl World {
    fn new() -> World {
        let mem = Arc::new(MemoryStore::new());
        let store = Store::with_backend(mem.clone());
        let w = World {
            mem,
            store,
            now: 1_000_000,
            builds: Vec::new(),
        };
        w.mem.set_clock(Some(w.now));
        w
    }

    fn advance(&mut self, secs: i64) {
        self.now += secs;
        self.mem.set_clock(Some(self.now));
    }

    fn gc(&self, grace: i64) -> Result<crate::gc::GcReport, GcError> {
        let mut o = GcOptions::new(Duration::from_secs(grace as u64));
        o.now = UNIX_EPOCH + Duration::from_secs(self.now as u64);
        collect(&self.store, &o)
    }

    /// Writes the next object of build `i`; returns true when the build is over.
    fn step(&mut self, i: usize) -> bool {
        let b = &mut self.builds[i];
        let s = &self.store;
        match b.step {
            0 => {
                let data = blob_bytes(b.content);
                s.put_bytes(&key::blob(&Digest::of(&data)), data)
                    .expect("blob");
            }
            1 => {
                s.put_meta(&meta_bytes(b.content), None).expect("meta");
            }
            2 => b.layer = Some(s.put_layer(&descriptor(b.content)).expect("layer")),
            3 => {
                let m = Manifest {
                    schema: SCHEMA,
                    layers: vec![ManifestLayer {
                        digest: b.layer.expect("layer written"),
                        kind: LayerKind::Base,
                    }],
                    config: Default::default(),
                    annotations: Default::default(),
                };
                b.manifest = Some(s.put_manifest(&m).expect("manifest"));
            }
            _ => {
                let prev = s.tag_get(&b.tag).expect("tag get");
                // A concurrent writer may win the tag: that build just fails.
                let _ = s.tag_set(&b.tag, prev.as_ref(), &b.manifest.expect("manifest"));
                return true;
            }
        }
        b.step += 1;
        false
    }

    /// Every object a tag reaches exists.
    fn check(&self, what: &str) {
        for (t, m) in self.store.tags().expect("tags").good {
            let manifest = self
                .store
                .get_manifest(&m)
                .unwrap_or_else(|e| panic!("after {what}: {t} lost its manifest: {e}"));
            for l in &manifest.layers {
                let d = self
                    .store
                    .get_layer(&l.digest)
                    .unwrap_or_else(|e| panic!("after {what}: {t} lost layer {}: {e}", l.digest));
                self.store
                    .get_meta(&d.meta.digest)
                    .unwrap_or_else(|e| panic!("after {what}: {t} lost its metadata: {e}"));
                for b in &d.blobs {
                    assert!(
                        self.store.exists(&key::blob(&b.digest)).expect("head"),
                        "after {what}: {t} lost blob {}",
                        b.digest
                    );
                }
            }
        }
    }
}

fn tag(n: u64) -> TagName {
    TagName::parse(&format!("model/t{n}:v1")).expect("tag")
}

fn run(seed: u64, ops: usize) {
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut w = World::new();
    for op in 0..ops {
        // Builds near the end of the grace period are finished first: the documented bound.
        while let Some(i) = w
            .builds
            .iter()
            .position(|b| w.now - b.started >= GRACE - 20)
        {
            if w.step(i) {
                w.builds.remove(i);
            }
        }
        let what = match rng.below(10) {
            0 | 1 => {
                w.builds.push(Build {
                    content: rng.below(4),
                    tag: tag(rng.below(3)),
                    started: w.now,
                    step: 0,
                    layer: None,
                    manifest: None,
                });
                "a build starts"
            }
            2..=4 if !w.builds.is_empty() => {
                let i = rng.below(w.builds.len() as u64) as usize;
                if w.step(i) {
                    w.builds.remove(i);
                }
                "a build step"
            }
            5 => {
                let t = tag(rng.below(3));
                if let Some(s) = w.store.tag_get(&t).expect("get") {
                    w.store.tag_delete(&t, &s).expect("rmi");
                }
                "rmi"
            }
            6 | 7 => {
                w.gc(GRACE).expect("gc");
                "gc"
            }
            _ => {
                w.advance(rng.below(60) as i64 + 1);
                "time passes"
            }
        };
        w.check(&format!("op {op} ({what}) of seed {seed}"));
    }
}

#[test]
fn nothing_a_tag_reaches_is_ever_deleted() {
    for seed in 0..400 {
        run(seed, 120);
    }
}

#[test]
fn a_broken_tag_stops_gc_before_anything_is_deleted() {
    let mut w = World::new();
    for c in 0..2 {
        w.builds.push(Build {
            content: c,
            tag: tag(c),
            started: w.now,
            step: 0,
            layer: None,
            manifest: None,
        });
        while !w.step(0) {}
        w.builds.clear();
    }
    w.advance(10 * GRACE);
    let objects = || w.mem.list_info("").expect("list").len();
    let before = objects();
    let put = |k: &str, v: &[u8]| {
        w.store
            .backend()
            .put(
                k,
                bytes::Bytes::copy_from_slice(v),
                crate::store::PutMode::Overwrite,
            )
            .expect("put")
    };
    // A layer descriptor that does not parse.
    let layer = key::layer(&w.store.put_layer(&descriptor(1)).expect("layer"));
    let good = w.store.backend().get(&layer).expect("get").0;
    put(&layer, b"{not json");
    let e = w.gc(0).expect_err("broken layer");
    assert!(e.to_string().contains("model/t1:v1"), "{e}");
    assert!(e.to_string().contains(&layer), "{e}");
    assert_eq!(objects(), before, "gc deleted something: {e}");
    put(&layer, &good);
    // A tag whose value is garbage, then one naming a manifest that does not exist.
    let missing = format!("{}\n", Digest([0; 32]));
    let bad: [&[u8]; 3] = [b"", b"garbage", missing.as_bytes()];
    for value in bad {
        put("tags/model/t0/v1", value);
        let e = w.gc(0).expect_err("broken tag");
        assert!(matches!(e, GcError::Broken { .. }), "{e}");
        assert!(e.to_string().contains("model/t0:v1"), "{e}");
        assert_eq!(objects(), before, "gc deleted something: {e}");
    }
    // Explicitly skipping: t1's image stays, t0's goes.
    let mut o = GcOptions::new(Duration::ZERO);
    o.now = SystemTime::UNIX_EPOCH + Duration::from_secs(w.now as u64);
    o.skip_broken = true;
    let r = collect(&w.store, &o).expect("gc --skip-broken");
    assert_eq!(r.broken.len(), 1, "{r:?}");
    assert!(r.deleted >= 4, "{r:?}");
    w.store
        .backend()
        .delete("tags/model/t0/v1")
        .expect("delete");
    w.check("gc --skip-broken");
}

/// Stores keep times in whole seconds, so a time `t` may be as late as `t + 0.99`: an object written at
/// `t` is kept through `t + grace` and condemned only from `t + grace + 1`, and its mark counts the same
/// way (on MooseFS, whose times are seconds, a 5 s grace was once as short as 4 s).
#[test]
fn times_in_whole_seconds_never_shorten_the_grace() {
    let mut w = World::new();
    w.builds.push(Build {
        content: 7,
        tag: tag(7),
        started: w.now,
        step: 0,
        layer: None,
        manifest: None,
    });
    while !w.step(0) {}
    let prev = w.store.tag_get(&tag(7)).expect("get").expect("tagged");
    w.store.tag_delete(&tag(7), &prev).expect("untag");
    w.advance(GRACE);
    let r = w.gc(GRACE).expect("gc");
    assert_eq!((r.young, r.condemned), (4, 0), "{r:?}");
    w.advance(1);
    let r = w.gc(GRACE).expect("gc");
    assert_eq!(r.condemned, 4, "{r:?}");
    w.advance(GRACE);
    let r = w.gc(GRACE).expect("gc");
    assert_eq!((r.pending, r.deleted), (4, 0), "{r:?}");
    w.advance(1);
    let r = w.gc(GRACE).expect("gc");
    assert_eq!(r.deleted, 4, "{r:?}");
}

/// A tag write's check (`Store::revive_image`, its keys checked on several threads) pardons what gc
/// condemned and names the first object in the image's order that is gone, however many blobs a layer
/// has.
#[test]
fn the_tag_check_pardons_condemned_objects_and_names_the_first_gone() {
    let w = World::new();
    let s = &w.store;
    let mut d = descriptor(1);
    d.blobs = (0..20u64)
        .map(|i| {
            let data = blob_bytes(100 + i);
            let digest = Digest::of(&data);
            s.put_bytes(&key::blob(&digest), data).expect("blob");
            BlobRef {
                digest,
                ..d.blobs[0].clone()
            }
        })
        .collect();
    s.put_meta(&meta_bytes(1), None).expect("meta");
    let layer = s.put_layer(&d).expect("layer");
    let m = s
        .put_manifest(&Manifest {
            schema: SCHEMA,
            layers: vec![ManifestLayer {
                digest: layer,
                kind: LayerKind::Base,
            }],
            config: Default::default(),
            annotations: Default::default(),
        })
        .expect("manifest");
    assert_eq!(s.revive_image(&m).expect("check"), None);
    let blob = |i: usize| key::blob(&d.blobs[i].digest);
    for i in [17, 13] {
        s.put_index(&key::condemned(&blob(i)), b"condemned\n".to_vec())
            .expect("mark");
    }
    assert_eq!(s.revive_image(&m).expect("check"), None);
    for i in [17, 13] {
        assert!(s.reusable(&blob(i)).expect("head"), "blob {i} pardoned");
    }
    for i in [9, 5] {
        s.delete(&blob(i)).expect("delete");
    }
    assert_eq!(s.revive_image(&m).expect("check"), Some(blob(5)));
}

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use super::*;
use crate::stratad::Hold;

/// An in-memory layer service: holds by name; `fail` refuses every hold.
#[derive(Clone, Default)]
struct FakeLayers {
    holds: Arc<Mutex<Vec<Hold>>>,
    fail: bool,
}

impl LayerService for FakeLayers {
    fn hold(&self, d: &Digest, holder: &str, _: Option<&str>) -> Result<PathBuf, LayerError> {
        if self.fail {
            return Err(LayerError::Reply("down".into()));
        }
        let path = PathBuf::from(format!("/layers/{}", d.hex()));
        let mut h = self.holds.lock().unwrap();
        if !h.iter().any(|x| x.holder == holder && x.digest == *d) {
            h.push(Hold {
                digest: *d,
                holder: holder.into(),
                path: path.clone(),
            });
        }
        Ok(path)
    }
    fn release(&self, d: &Digest, holder: &str) -> Result<(), LayerError> {
        let mut h = self.holds.lock().unwrap();
        h.retain(|x| !(x.holder == holder && x.digest == *d));
        Ok(())
    }
    fn holds(&self) -> Result<Vec<Hold>, LayerError> {
        Ok(self.holds.lock().unwrap().clone())
    }
}

fn open(root: &std::path::Path, layers: FakeLayers) -> Snapshots {
    Snapshots::new(Meta::open(root).unwrap(), Box::new(layers))
}

fn strata_labels(target: &str, layer: &Digest) -> BTreeMap<String, String> {
    BTreeMap::from([
        (TARGET_LABEL.to_string(), target.to_string()),
        (LAYER_LABEL.to_string(), layer.to_string()),
    ])
}

#[test]
fn a_plain_layer_is_unpacked_into_a_bind_mount_and_committed() {
    let t = tempfile::tempdir().unwrap();
    let s = open(t.path(), FakeLayers::default());
    let m = s.prepare("extract-1", "", BTreeMap::new(), false).unwrap();
    assert_eq!(m[0].kind, "bind");
    assert!(m[0].options.contains(&"rw".to_string()));
    s.commit("layer1", "extract-1", BTreeMap::new()).unwrap();
    assert_eq!(s.stat("layer1").unwrap().kind, Kind::Committed);
    assert!(matches!(s.stat("extract-1"), Err(SnapError::NotFound(_))));
    let m = s.prepare("ctr", "layer1", BTreeMap::new(), false).unwrap();
    assert_eq!(m[0].kind, "overlay");
    assert!(m[0]
        .options
        .iter()
        .any(|o| o.starts_with("lowerdir=") && o.ends_with("/fs")));
}

#[test]
fn a_strata_layer_is_committed_under_its_target_and_reported_as_existing() {
    let t = tempfile::tempdir().unwrap();
    let layers = FakeLayers::default();
    let s = open(t.path(), layers.clone());
    let (d1, d2) = (Digest::of(b"base"), Digest::of(b"top"));
    let e = s.prepare("extract-a", "", strata_labels("chain1", &d1), false);
    assert!(matches!(e, Err(SnapError::AlreadyExists(t)) if t == "chain1"));
    let e = s.prepare("extract-b", "chain1", strata_labels("chain2", &d2), false);
    assert!(matches!(e, Err(SnapError::AlreadyExists(_))));
    assert!(matches!(s.stat("extract-a"), Err(SnapError::NotFound(_))));
    let m = s.prepare("ctr", "chain2", BTreeMap::new(), false).unwrap();
    let want = format!("lowerdir=/layers/{}:/layers/{}", d2.hex(), d1.hex());
    assert!(m[0].options.contains(&want), "{:?}", m[0].options);
    assert_eq!(layers.holds().unwrap().len(), 2);

    // Children first; removing a strata snapshot drops its hold.
    assert!(matches!(
        s.remove("chain1"),
        Err(SnapError::FailedPrecondition(_))
    ));
    s.remove("ctr").unwrap();
    s.remove("chain2").unwrap();
    s.remove("chain1").unwrap();
    assert!(layers.holds().unwrap().is_empty());
}

#[test]
fn a_layer_stratad_cannot_serve_falls_back_to_unpacking() {
    let t = tempfile::tempdir().unwrap();
    let layers = FakeLayers {
        fail: true,
        ..Default::default()
    };
    let s = open(t.path(), layers);
    let m = s
        .prepare(
            "extract-a",
            "",
            strata_labels("chain1", &Digest::of(b"x")),
            false,
        )
        .unwrap();
    assert_eq!(m[0].kind, "bind");
}

#[test]
fn snapshots_survive_a_restart_and_holds_are_reconciled() {
    let t = tempfile::tempdir().unwrap();
    let layers = FakeLayers::default();
    let d = Digest::of(b"base");
    {
        let s = open(t.path(), layers.clone());
        let _ = s.prepare("extract-a", "", strata_labels("chain1", &d), false);
        s.prepare("ctr", "chain1", BTreeMap::new(), false).unwrap();
    }
    // stratad lost the hold, and holds a stray one of a removal that never finished.
    let stray = Digest::of(b"gone");
    layers.holds.lock().unwrap().clear();
    layers.hold(&stray, &holder("old"), None).unwrap();
    let s = open(t.path(), layers.clone());
    assert_eq!(s.reconcile().unwrap(), (1, 1));
    let h = layers.holds().unwrap();
    assert_eq!(h.len(), 1);
    assert_eq!(
        (h[0].digest, h[0].holder.as_str()),
        (d, "snapshotter:chain1")
    );
    assert_eq!(s.stat("ctr").unwrap().parent, "chain1");
    assert_eq!(s.list().len(), 2);
}

#[test]
fn labels_update_by_field_and_views_are_read_only() {
    let t = tempfile::tempdir().unwrap();
    let s = open(t.path(), FakeLayers::default());
    s.prepare("a", "", BTreeMap::new(), false).unwrap();
    s.commit("c", "a", BTreeMap::from([("x".into(), "1".into())]))
        .unwrap();
    let new = BTreeMap::from([("y".to_string(), "2".to_string())]);
    let i = s.update("c", new, &["labels.y".into()]).unwrap();
    assert_eq!(i.labels.len(), 2);
    let v = s.prepare("v", "c", BTreeMap::new(), true).unwrap();
    assert_eq!(v[0].kind, "bind");
    assert!(v[0].options.contains(&"ro".to_string()));
    assert!(matches!(
        s.mounts("c"),
        Err(SnapError::FailedPrecondition(_))
    ));
    s.remove("v").unwrap();
    s.cleanup();
    assert_eq!(s.usage("c").unwrap().1, 0);
}

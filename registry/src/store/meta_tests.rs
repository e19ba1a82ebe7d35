//! Layer metadata in the store: patches, and reading it into a file frame by frame.

use super::*;

fn image(seed: u8, n: usize) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect()
}

#[test]
fn metadata_patches_against_its_base() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&format!("file://{}", dir.path().display())).unwrap();
    let v1: Vec<u8> = (0..1_000_000u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    let mut v2 = v1.clone();
    v2[500_000..500_100].fill(7);
    let (d1, full) = store.put_meta(&v1, None).unwrap();
    let (d2, patched) = store.put_meta(&v2, Some((&d1, &v1))).unwrap();
    assert!(patched * 20 < full, "patch {patched} vs full {full}");
    assert_eq!(store.get_meta(&d1).unwrap(), v1);
    assert_eq!(store.get_meta(&d2).unwrap(), v2);
    // A patch is never the base of another patch.
    let v3 = image(3, 5000);
    let (d3, _) = store.put_meta(&v3, Some((&d2, &v2))).unwrap();
    assert!(!store.meta_is_patch(&d3).unwrap());
    assert_eq!(store.get_meta(&d3).unwrap(), v3);
    // A damaged patch is an error, never wrong bytes.
    let p = dir.path().join(key::meta(&d2));
    let mut b = std::fs::read(&p).unwrap();
    let last = b.len() - 1;
    b[last] ^= 0xff;
    std::fs::write(&p, b).unwrap();
    assert!(store.get_meta(&d2).is_err());
}

/// A node writes layer metadata to a file as it decompresses it: the file holds the image, and a
/// metadata object that is not the image its name says is refused, whatever its layout.
#[test]
fn metadata_goes_into_a_file_checked() {
    use std::io::Read;
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&format!("file://{}", dir.path().display())).unwrap();
    let into = |d: &Digest| {
        let path = dir.path().join("out");
        let f = std::fs::File::create(&path).unwrap();
        let r = store.get_meta_into(d, &f, &path);
        let mut back = Vec::new();
        std::fs::File::open(&path)
            .unwrap()
            .read_to_end(&mut back)
            .unwrap();
        (r, back)
    };
    // Several frames (decompressed, hashed and written per frame), one frame, a patch.
    let big = image(1, 3 * frames::FRAME + 999);
    let small = image(2, 5000);
    let mut changed = big.clone();
    changed[100..200].fill(9);
    let (db, _) = store.put_meta(&big, None).unwrap();
    let (ds, _) = store.put_meta(&small, None).unwrap();
    let (dc, _) = store.put_meta(&changed, Some((&db, &big))).unwrap();
    assert!(store.meta_is_patch(&dc).unwrap());
    for (d, want) in [(db, &big), (ds, &small), (dc, &changed)] {
        let (r, back) = into(&d);
        assert_eq!(r.unwrap(), want.len() as u64);
        assert!(back == *want);
    }
    // Another image stored under the big one's name: corrupt, named.
    let other = image(3, 2 * frames::FRAME + 1);
    let z = frames::compress(&other, 3);
    std::fs::write(dir.path().join(key::meta(&db)), z).unwrap();
    match into(&db).0 {
        Err(StoreError::Corrupt {
            expected, actual, ..
        }) => {
            assert_eq!((expected, actual), (db, Digest::of(&other)))
        }
        r => panic!("{r:?}"),
    }
}

use super::*;

#[test]
fn blob_node_ids_come_from_digests_and_never_hit_the_fixed_ones() {
    let a = Digest::of(b"a");
    assert_eq!(blob_ino(&a), blob_ino(&Digest::of(b"a")));
    assert_ne!(blob_ino(&a), blob_ino(&Digest::of(b"b")));
    for d in [a, Digest([0; 32])] {
        let ino = blob_ino(&d);
        assert!(ino != ROOT && ino != BLOBS_DIR && ino >> 63 == 1);
    }
}

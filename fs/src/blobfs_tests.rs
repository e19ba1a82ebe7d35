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

/// The read path over a socket pair standing in for `/dev/fuse`: 256 reads of a blob whose store hangs
/// do not delay a read of another, uncached blob, and each is answered `EIO` at the deadline.
#[test]
fn reads_of_a_hung_blob_hold_no_worker_and_fail_at_the_deadline() {
    hung_blob_beside_a_healthy_one(2);
}

/// The same with misses served on the workers that read them, as the daemon does (all workers but two):
/// the hung reads hold those workers, the two others still serve the healthy blob at once, and the
/// deadline still answers every hung read, the ones on workers included.
#[test]
fn misses_on_workers_leave_two_free_and_still_fail_at_the_deadline() {
    hung_blob_beside_a_healthy_one(4);
}

/// With `workers` FUSE workers, of which all but two serve misses themselves.
fn hung_blob_beside_a_healthy_one(workers: usize) {
    let inline = workers - crate::slowread::FREE_WORKERS;
    use std::time::Instant;

    use strata_registry::store::{Fault, Op};

    use crate::fuse::proto::op;
    use crate::fuse::session::{Options, Session};
    use crate::fuse::Channel;
    use crate::testkit::{bytes, pair, read_arg, recv, send, Kit};

    let deadline = Duration::from_millis(600);
    let kit = Kit::new(deadline);
    let chunks: Vec<Vec<u8>> = (0..256).map(|i| bytes(4096, i)).collect();
    let (a, ka) = kit.blob(&chunks);
    let healthy = bytes(4096, 999);
    let (b, _) = kit.blob(std::slice::from_ref(&healthy));
    let (ia, ib) = (blob_ino(&a.blob.digest), blob_ino(&b.blob.digest));
    let table = Arc::new(BlobTable::default());
    table.add(a).expect("add");
    table.add(b).expect("add");
    let fs = BlobFs::new(table, kit.fetcher.clone(), kit.metrics.clone(), None)
        .expect("blobfs")
        .with_workers(workers);
    let fs = Arc::new(fs);
    let (kernel, server) = pair();
    let s = Session::start(
        Arc::new(Channel::from_fd(server)),
        fs.clone(),
        workers,
        Options::default(),
    )
    .expect("session");
    kit.faults
        .inject(Fault::hang().key(&ka).ops(&[Op::GetRange]));
    let t = Instant::now();
    for i in 0..256u64 {
        send(&kernel, op::READ, 100 + i, ia, &read_arg(i * 4096, 4096));
    }
    send(&kernel, op::READ, 1, ib, &read_arg(0, 4096));
    let (h, body) = recv(&kernel);
    assert_eq!(h.unique, 1, "the healthy blob's read is answered first");
    assert_eq!(body, healthy);
    assert!(t.elapsed() < deadline / 2, "{:?}", t.elapsed());
    for _ in 0..256 {
        let (h, _) = recv(&kernel);
        assert_eq!(h.error, -libc::EIO, "read {}", h.unique);
    }
    let took = t.elapsed();
    assert!(took >= deadline && took < deadline * 3, "{took:?}");
    assert_eq!(
        fs.slow.served_inline(),
        inline,
        "reads served on their workers"
    );
    kit.faults.clear();
    drop(kernel);
    s.join();
}

/// A read whose first part is cached and whose rest is not: the worker fills the cached part, the slow
/// read goes on from there, and the reply is the two stitched together.
#[test]
fn a_partly_cached_read_goes_on_where_the_cache_ends() {
    use crate::fuse::proto::op;
    use crate::fuse::session::{Options, Session};
    use crate::fuse::Channel;
    use crate::testkit::{bytes, pair, read_arg, recv, send, Kit};
    use strata_registry::store::Op;

    let kit = Kit::new(Duration::from_secs(5));
    let (c0, c1) = (bytes(8192, 1), bytes(8192, 2));
    let (blob, k) = kit.blob(&[c0.clone(), c1.clone()]);
    let ino = blob_ino(&blob.blob.digest);
    let blob = Arc::new(blob);
    kit.fetcher.chunk(&blob, 0).expect("warm chunk 0");
    // Kept (and the blob let go) on a worker after the fetch answered.
    crate::testkit::wait_until("chunk 0 kept", || Arc::strong_count(&blob) == 1);
    let table = Arc::new(BlobTable::default());
    table
        .add(Arc::try_unwrap(blob).ok().expect("sole owner"))
        .expect("add");
    let fs = BlobFs::new(table, kit.fetcher.clone(), kit.metrics.clone(), None).expect("blobfs");
    let (kernel, server) = pair();
    let s = Session::start(
        Arc::new(Channel::from_fd(server)),
        Arc::new(fs),
        1,
        Options::default(),
    )
    .expect("session");
    kit.faults.reset_counts();
    send(&kernel, op::READ, 7, ino, &read_arg(4096, 8192));
    let (h, body) = recv(&kernel);
    assert_eq!((h.unique, h.error), (7, 0));
    let mut want = c0[4096..].to_vec();
    want.extend_from_slice(&c1[..4096]);
    assert!(body == want, "stitched bytes differ");
    assert_eq!(
        kit.faults.calls(Op::GetRange, &k),
        1,
        "only the uncached chunk fetched"
    );
    drop(kernel);
    s.join();
}

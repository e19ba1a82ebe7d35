//! Pieced chunks for real (`strata build --piece-size`): an image whose large chunks are stored as 64 KiB
//! pieces reads right in every mount mode of this kernel, a read of one page fetches about one piece
//! rather than its 1 MiB chunk, what the node holds passes its scrub, and `strata cat` (the store-side
//! reader) gives the same bytes back.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use strata_tests::*;

fn read_page(root: &Path, at: u64) -> Vec<u8> {
    let f = std::fs::File::open(root.join("data/big.bin")).expect("open");
    let mut buf = vec![0u8; 4096];
    f.read_exact_at(&mut buf, at).expect("pread");
    buf
}

/// Chunk bytes the node fetched: charged to sandboxes, or the node's own (loop mode's kernel workers).
fn fetched(d: &Daemon) -> u64 {
    let ps = json(&d.ok(&["ps", "--json"]));
    let charged: u64 = ps["sandboxes"]
        .as_array()
        .map(|a| a.iter().filter_map(|s| s["fetched_bytes"].as_u64()).sum())
        .unwrap_or(0);
    charged + ps["status"]["fetched_unattributed"].as_u64().unwrap_or(0)
}

#[test]
fn a_pieced_image_reads_in_every_mount_mode_and_a_page_fetches_a_piece() {
    if !can_mount() {
        return;
    }
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    let big = random_bytes(3 << 20, 11);
    let mid = random_bytes(300 << 10, 12);
    let src = scratch("img");
    busybox_rootfs(src.path());
    std::fs::write(src.path().join("data/big.bin"), &big).expect("write");
    std::fs::write(src.path().join("data/mid.bin"), &mid).expect("write");
    let dir = src.path().to_str().expect("utf8");
    store.ok(&["build", dir, "-t", "pc:v1", "--piece-size", "65536"]);

    let cat = store.run(&["cat", "pc:v1", "/data/big.bin"]);
    assert!(
        cat.status.success(),
        "{}",
        String::from_utf8_lossy(&cat.stderr)
    );
    assert!(cat.stdout == big, "strata cat gave other bytes");

    for mode in ["file", "fanotify", "loop", "fuse"] {
        // Only the frame asked for: a page's read fetches its piece (64 KiB of random bytes), and
        // nothing is streamed after it.
        let d = Daemon::start(
            &store,
            &[
                "--mount-mode",
                mode,
                "--max-fetch-span",
                "1",
                "--max-fetch-stream",
                "0",
                "--cache-size",
                "1G",
            ],
        );
        let root = PathBuf::from(d.ok(&["mount", "pc:v1", "--sandbox", "s"]));
        // The first piece of the second chunk: nothing of its chunk lies behind it.
        let at = (1 << 20) + 8192;
        let before = fetched(&d);
        assert_eq!(
            read_page(&root, at),
            big[at as usize..at as usize + 4096],
            "{mode}"
        );
        let got = fetched(&d) - before;
        // Kernel read-ahead may bring a few neighbours; a whole chunk would be over 1 MiB.
        assert!(
            got > 0 && got < 512 << 10,
            "{mode}: {got} bytes for one page"
        );
        assert_eq!(
            std::fs::read(root.join("data/big.bin")).expect("read"),
            big,
            "{mode}"
        );
        assert_eq!(
            std::fs::read(root.join("data/mid.bin")).expect("read"),
            mid,
            "{mode}"
        );
        let scrub = json(&d.ok(&["daemon", "scrub", "--json"]));
        assert_eq!(scrub["bad"].as_u64(), Some(0), "{mode}: {scrub}");
        assert!(
            scrub["chunks"].as_u64().unwrap_or(0) >= 48,
            "{mode}: {scrub}"
        );
        d.ok(&["umount", "--sandbox", "s"]);
    }
}

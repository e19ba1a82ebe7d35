//! `strata copy IMAGE --to STORE`: an image between a local store and S3 (moto on loopback) and back,
//! with a metadata patch (a layer built with `--parent`), a prefetch plan and an import record; a second
//! copy sends nothing; a destination tag naming another image moves only with `--force`; a corrupt
//! source blob is refused with nothing tagged.

use std::path::Path;
use std::process::Output;

use strata_tests::*;

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `store` with the environment `other` needs too (the S3 variables), to copy between them.
fn with_env_of(store: &StoreEnv, other: &StoreEnv) -> StoreEnv {
    let mut s = store.clone();
    s.env.extend(other.env.iter().cloned());
    s
}

fn copy(from: &StoreEnv, image: &str, to: &StoreEnv, extra: &[&str]) -> serde_json::Value {
    let mut args = vec!["copy", image, "--to", &to.url, "--json"];
    args.extend_from_slice(extra);
    json(&with_env_of(from, to).ok(&args))
}

fn n(v: &serde_json::Value, field: &str) -> u64 {
    v[field]
        .as_u64()
        .unwrap_or_else(|| panic!("{field} in {v}"))
}

/// Two images in a local store: `base:v1`, and `base:v2` built on it with `--parent` (its metadata a
/// patch against v1's), which also gets a prefetch plan.
fn source(dir: &Path) -> StoreEnv {
    let store = StoreEnv::local(dir);
    let big = random_bytes(3 << 20, 7);
    build_image(
        &store,
        "base:v1",
        &[("big", big.clone()), ("a", b"one".to_vec())],
    );
    let tree = scratch("v2");
    busybox_rootfs(tree.path());
    std::fs::write(tree.path().join("data/big"), &big).expect("write");
    std::fs::write(tree.path().join("data/a"), b"two").expect("write");
    store.ok(&[
        "build",
        tree.path().to_str().expect("utf8"),
        "--parent",
        "base:v1",
        "-t",
        "base:v2",
    ]);
    // A prefetch plan, as `strata trace` stores it: the object, then the pointer.
    let manifest = json(&store.ok(&["inspect", "base:v2", "--json"]))["digest"]
        .as_str()
        .expect("digest")
        .trim_start_matches("blake3:")
        .to_string();
    let plan = br#"{"schema":1,"chunks":[]}"#;
    let plan_hex = blake3::hash(plan).to_hex().to_string();
    std::fs::create_dir_all(dir.join("plans/by-manifest")).expect("mkdir");
    std::fs::write(dir.join(format!("plans/{plan_hex}.json")), plan).expect("write plan");
    std::fs::write(
        dir.join(format!("plans/by-manifest/{manifest}")),
        format!("blake3:{plan_hex}\n"),
    )
    .expect("write pointer");
    store
}

#[test]
fn copy_to_s3_and_back_sends_only_what_is_missing() {
    let Some(server) = S3Server::start("copy") else {
        return;
    };
    let sdir = scratch("copy-src");
    let local = source(sdir.path());
    let s3 = server.store("copy", "dest");

    let first = copy(&local, "base:v2", &s3, &[]);
    assert!(n(&first, "sent_objects") >= 5, "{first}");
    assert!(n(&first, "sent_bytes") > 3 << 20, "{first}");
    assert_eq!(first["tag_moved"], true);
    assert_eq!(s3.ok(&["cat", "base:v2", "/data/a"]), "two");
    let digest = first["digest"].as_str().expect("digest").to_string();
    let pointer = format!("plans/by-manifest/{}", digest.trim_start_matches("blake3:"));
    assert!(
        s3.open().get_index(&pointer).expect("read").is_some(),
        "plan pointer not copied"
    );

    // Again: nothing sent. v1 shares its blob with v2: only its own objects go.
    let again = copy(&local, "base:v2", &s3, &[]);
    assert_eq!(n(&again, "sent_objects"), 0, "{again}");
    assert_eq!(again["tag_moved"], false);
    assert_eq!(n(&again, "skipped_objects"), n(&first, "sent_objects"));
    let v1 = copy(&local, "base:v1", &s3, &[]);
    assert!(n(&v1, "skipped_objects") >= 1, "{v1}");
    assert!(n(&v1, "sent_bytes") < n(&first, "sent_bytes") / 2, "{v1}");
    assert_eq!(s3.ok(&["cat", "base:v1", "/data/a"]), "one");

    // Back from S3 into a new local store: the same image, readable; then nothing more to send.
    let bdir = scratch("copy-back");
    let back = StoreEnv::local(bdir.path());
    let home = copy(&s3, "base:v2", &back, &["-t", "home/base:v2"]);
    assert_eq!(home["digest"], digest.as_str());
    assert_eq!(n(&home, "sent_objects"), n(&first, "sent_objects"));
    assert_eq!(back.ok(&["cat", "home/base:v2", "/data/a"]), "two");
    let big = back.run(&["cat", "home/base:v2", "/data/big"]);
    assert!(big.status.success(), "{}", stderr(&big));
    assert_eq!(big.stdout, random_bytes(3 << 20, 7));
    let home2 = copy(&s3, &digest, &back, &["-t", "home/base:v2"]);
    assert_eq!(n(&home2, "sent_objects"), 0, "{home2}");

    // A tag naming another image moves only with --force.
    let o = with_env_of(&local, &s3).run(&["copy", "base:v1", "--to", &s3.url, "-t", "base:v2"]);
    assert_eq!(o.status.code(), Some(4), "{}", stderr(&o));
    assert!(stderr(&o).contains("--force"), "{}", stderr(&o));
    assert_eq!(s3.ok(&["cat", "base:v2", "/data/a"]), "two");
    copy(&local, "base:v1", &s3, &["-t", "base:v2", "--force"]);
    assert_eq!(s3.ok(&["cat", "base:v2", "/data/a"]), "one");
}

#[test]
fn corrupt_source_blob_is_refused() {
    let sdir = scratch("copy-bad-src");
    let local = source(sdir.path());
    let ddir = scratch("copy-bad-dst");
    let dest = StoreEnv::local(ddir.path());
    let insp = json(&local.ok(&["inspect", "base:v1", "--json"]));
    let blob = insp["layers"][0]["blobs"][0]["digest"]
        .as_str()
        .expect("blob")
        .trim_start_matches("blake3:")
        .to_string();
    let path = sdir.path().join("blobs").join(&blob);
    let mut bytes = std::fs::read(&path).expect("read blob");
    bytes[100] ^= 0xff;
    std::fs::write(&path, bytes).expect("write blob");
    let o = local.run(&["copy", "base:v1", "--to", &dest.url]);
    assert_eq!(o.status.code(), Some(5), "{}", stderr(&o));
    assert!(stderr(&o).contains(&blob), "{}", stderr(&o));
    assert_eq!(dest.run(&["inspect", "base:v1"]).status.code(), Some(3));
    assert!(!ddir.path().join("blobs").join(&blob).exists());
    let spool: Vec<_> = std::fs::read_dir(ddir.path().join("tmp"))
        .map(|d| d.collect())
        .unwrap_or_default();
    assert!(spool.is_empty(), "spool file left: {spool:?}");
}

#[test]
fn import_records_travel_with_the_image() {
    if !strata_tests::oci::have_umoci() {
        return;
    }
    let work = scratch("copy-oci");
    let layout = strata_tests::oci::umoci_image(work.path());
    let src = format!("oci:{}:t", layout.to_str().expect("utf8"));
    let adir = scratch("copy-oci-a");
    let a = StoreEnv::local(adir.path());
    a.ok(&["import", &src, "-t", "imp:v1"]);
    let bdir = scratch("copy-oci-b");
    let b = StoreEnv::local(bdir.path());
    let sent = copy(&a, "imp:v1", &b, &[]);
    assert!(n(&sent, "sent_objects") > 5 * 3, "{sent}");
    // The destination has the layers' import records: importing the same image there builds nothing.
    let again = json(&b.ok(&["import", &src, "-t", "imp:v2", "--json"]));
    assert_eq!(again["stored_bytes"], 0, "{again}");
    assert_eq!(again["digest"], sent["digest"]);
}

#[test]
fn copy_carries_the_chunk_index_so_the_next_build_deduplicates() {
    let sdir = scratch("idx-src");
    let src = StoreEnv::local(sdir.path());
    let tree = scratch("idx-tree");
    std::fs::write(tree.path().join("big"), random_bytes(8 << 20, 11)).expect("write");
    std::fs::write(tree.path().join("small"), b"small").expect("write");
    let t = tree.path().to_str().expect("utf8");
    src.ok(&["build", t, "-t", "idx:v1"]);
    let ddir = scratch("idx-dst");
    let dst = StoreEnv::local(ddir.path());
    let c = copy(&src, "idx:v1", &dst, &[]);
    assert!(n(&c, "index_segments") >= 1, "{c}");
    // The same tree built into the destination finds every chunk there.
    let built = json(&dst.ok(&["build", t, "--json"]));
    assert_eq!(built["stats"]["new_chunks"], 0, "{built}");
    assert_eq!(built["stats"]["new_bytes"], 0, "{built}");
    // A second copy has nothing to send, segments included.
    let again = copy(&src, "idx:v1", &dst, &[]);
    assert_eq!(n(&again, "sent_objects"), 0, "{again}");
}

#[test]
fn a_missing_bucket_is_a_missing_store_in_every_command() {
    let Some(s3) = S3Server::start("present") else {
        return;
    };
    let gone = s3.store("nobucket", "p");
    let dir = scratch("nobucket-src");
    let local = StoreEnv::local(dir.path());
    build_image(&local, "img:v1", &[("a", b"a".to_vec())]);
    let tree = scratch("nobucket-tree");
    std::fs::write(tree.path().join("f"), b"f").expect("write");
    let t = tree.path().to_str().expect("utf8");
    let runs = [
        gone.run(&["images"]),
        gone.run(&["inspect", "img:v1"]),
        gone.run(&["build", t]),
        gone.run(&["gc"]),
        with_env_of(&local, &gone).run(&["copy", "img:v1", "--to", &gone.url]),
    ];
    for o in runs {
        assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
        assert!(
            stderr(&o).contains("does not exist (no bucket nobucket)"),
            "{}",
            stderr(&o)
        );
    }
}

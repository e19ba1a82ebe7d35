//! `strata import docker://…` against a real registry on loopback (Debian's `docker-registry`, the CNCF
//! distribution server), images pushed with `skopeo copy` from OCI layouts made by umoci.
//!
//! The image pulled from the registry is the same strata image (same manifest digest) as the one
//! imported from the layout it was pushed from, and — where this machine can mount — its merged tree
//! is what `umoci unpack` extracts. Also: a multi-platform index resolved by `--platform`, htpasswd
//! Basic auth, the bearer-token flow (through a token front, `strata_tests::registry::TokenFront`),
//! re-imports that download no layer, and corrupt blobs refused with nothing tagged.

use std::path::Path;
use std::process::Output;

use strata_tests::oci::*;
use strata_tests::registry::{Registry, TokenFront};
use strata_tests::*;

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf8 path")
}

fn import(store: &StoreEnv, src: &str, tag: &str, extra: &[&str]) -> serde_json::Value {
    let mut args = vec!["import", src, "-t", tag, "--json"];
    args.extend_from_slice(extra);
    json(&store.ok(&args))
}

/// A registry (behind htpasswd auth for `user`, if given) holding the umoci image as `repo_tag` (as
/// two platforms of an index with `platforms`), and an empty local store.
struct Pushed {
    reg: Registry,
    work: tempfile::TempDir,
    layout: std::path::PathBuf,
    sdir: tempfile::TempDir,
    store: StoreEnv,
}

/// The fixture, or `None` (after the skip is logged) when umoci or the registry tools are missing.
fn pushed(
    label: &str,
    repo_tag: &str,
    user: Option<(&str, &str)>,
    platforms: bool,
) -> Option<Pushed> {
    if !have_umoci() {
        return None;
    }
    let reg = Registry::start(user)?;
    let work = scratch(label);
    let layout = umoci_image(work.path());
    if platforms {
        helper(&layout, "t", &["platforms"]);
    }
    let creds = user.map(|(u, p)| format!("{u}:{p}"));
    reg.push(
        &format!("oci:{}:t", s(&layout)),
        repo_tag,
        creds.as_deref(),
        platforms,
    );
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    Some(Pushed {
        reg,
        work,
        layout,
        sdir,
        store,
    })
}

#[test]
fn pull_is_the_image_the_layout_imports_as() {
    let Some(Pushed {
        reg,
        work,
        layout,
        sdir: _sdir,
        store,
    }) = pushed("reg-pull", "strata/img:v1", None, false)
    else {
        return;
    };
    let src = format!("docker://{}/strata/img:v1", reg.host());
    let pulled = import(&store, &src, "reg/img:v1", &[]);
    assert_eq!(pulled["layers"].as_array().expect("layers").len(), 5);
    assert!(pulled["stored_bytes"].as_u64().expect("n") > 0);

    // The same image as an import of the layout (into another store): same layers, same manifest.
    let odir = scratch("store-oci");
    let ostore = StoreEnv::local(odir.path());
    let local = import(&ostore, &format!("oci:{}:t", s(&layout)), "oci/img:v1", &[]);
    assert_eq!(pulled["digest"], local["digest"], "{pulled}\n{local}");
    assert_eq!(pulled["oci_manifest"], local["oci_manifest"]);
    let insp = json(&store.ok(&["inspect", "reg/img:v1", "--json"]));
    assert_eq!(insp["manifest"]["config"]["working_dir"], "/data");
    assert_eq!(
        store.ok(&["cat", "reg/img:v1", "/opq/fresh"]),
        "only this is left"
    );
    if can_mount() {
        let unpacked = umoci_unpack(work.path(), &layout, "t");
        compare_mounted(&store, "reg/img:v1", &unpacked.join("rootfs"), None);
    }

    // By digest; and again: every layer reused, nothing downloaded but the manifest and config.
    let manifest = pulled["oci_manifest"].as_str().expect("digest");
    let by_digest = format!("docker://{}/strata/img@{manifest}", reg.host());
    let again = import(&store, &by_digest, "reg/img:v2", &[]);
    assert_eq!(again["digest"], pulled["digest"]);
    assert_eq!(again["stored_bytes"], 0, "{again}");
    assert!(again["layers"]
        .as_array()
        .expect("layers")
        .iter()
        .all(|l| l["reused"] == true));
}

#[test]
fn platform_is_chosen_from_a_registry_index() {
    let Some(Pushed {
        reg,
        work: _work,
        layout: _layout,
        sdir: _sdir,
        store,
    }) = pushed("reg-platform", "multi/img:v1", None, true)
    else {
        return;
    };
    let src = format!("docker://{}/multi/img:v1", reg.host());
    let platform_of = |tag: &str| {
        json(&store.ok(&["inspect", tag, "--json"]))["manifest"]["annotations"]
            ["org.strata.oci.platform"]
            .clone()
    };
    let host = host_platform();
    let default = import(&store, &src, "m:default", &[]);
    assert_eq!(platform_of("m:default"), host);
    let arm = import(&store, &src, "m:arm", &["--platform", "linux/arm64"]);
    assert_eq!(platform_of("m:arm"), "linux/arm64");
    assert_ne!(default["oci_manifest"], arm["oci_manifest"]);
    import(&store, &src, "m:amd", &["--platform", "linux/amd64"]);
    assert_eq!(platform_of("m:amd"), "linux/amd64");
    let o = store.run(&["import", &src, "-t", "m:s390x", "--platform", "linux/s390x"]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(
        e.contains("linux/s390x") && e.contains("linux/arm64") && e.contains("multi/img"),
        "{e}"
    );
}

#[test]
fn basic_auth_from_flags_environment_and_auth_file() {
    let Some(Pushed {
        reg,
        work,
        layout: _layout,
        sdir,
        store,
    }) = pushed(
        "reg-basic",
        "private/img:v1",
        Some(("alice", "s3cret")),
        false,
    )
    else {
        return;
    };
    let src = format!("docker://{}/private/img:v1", reg.host());
    // Refused credentials, or none where the registry wants some: exit 2.
    let o = store.run(&["import", &src, "-t", "p:anon"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(
        e.contains(&reg.host()) && e.contains("401") && e.contains("--creds"),
        "{e}"
    );
    let o = store.run(&["import", &src, "-t", "p:wrong", "--creds", "alice:nope"]);
    assert!(stderr(&o).contains("HTTP 401"), "{}", stderr(&o));
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let flags = import(&store, &src, "p:flags", &["--creds", "alice:s3cret"]);

    // An auth file entry (as `skopeo login` writes it).
    let auth = work.path().join("auth.json");
    std::fs::write(
        &auth,
        format!(
            r#"{{"auths":{{"{}":{{"auth":"YWxpY2U6czNjcmV0"}}}}}}"#,
            reg.host()
        ),
    )
    .expect("write auth file");
    let mut cmd = std::process::Command::new(strata_bin());
    cmd.args(["import", &src, "-t", "p:file", "--json"])
        .env("STRATA_STORE", format!("file://{}", s(sdir.path())))
        .env("REGISTRY_AUTH_FILE", &auth);
    let o = cmd.output().expect("run strata");
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        json(&String::from_utf8_lossy(&o.stdout))["digest"],
        flags["digest"]
    );
    let mut cmd = std::process::Command::new(strata_bin());
    cmd.args(["import", &src, "-t", "p:env"])
        .env("STRATA_STORE", format!("file://{}", s(sdir.path())))
        .env("STRATA_REGISTRY_USER", "alice")
        .env("STRATA_REGISTRY_PASSWORD", "s3cret");
    let o = cmd.output().expect("run strata");
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn bearer_token_flow() {
    let Some(Pushed {
        reg,
        work,
        layout: _layout,
        sdir: _sdir,
        store,
    }) = pushed("reg-token", "tok/img:v1", None, false)
    else {
        return;
    };
    let front = TokenFront::start(&reg, "bob", "pw", work.path());
    let src = format!("docker://127.0.0.1:{}/tok/img:v1", front.port);
    let o = store.run(&["import", &src, "-t", "t:anon"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("token from"), "{}", stderr(&o));
    let out = import(&store, &src, "t:v1", &["--creds", "bob:pw"]);
    assert!(out["stored_bytes"].as_u64().expect("n") > 0);
    let log = front.log();
    assert!(
        log.contains("service=strata-test") && log.contains("scope=repository%3Atok%2Fimg%3Apull"),
        "{log}"
    );
    assert!(log.contains("ok GET /v2/tok/img/blobs/sha256:"), "{log}");
    assert_eq!(
        store.ok(&["cat", "t:v1", "/opq/fresh"]),
        "only this is left"
    );
}

/// An import of a tag the registry does not have exits 3, naming the registry, the image and its answer.
fn an_unknown_tag_is_named_with_the_registrys_answer(store: &StoreEnv, host: &str) {
    let o = store.run(&[
        "import",
        &format!("docker://{host}/bad/img:nope"),
        "-t",
        "b:x",
    ]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(
        e.contains(host)
            && e.contains("bad/img")
            && e.contains("404")
            && e.contains("MANIFEST_UNKNOWN"),
        "{e}"
    );
}

/// The raw manifest of `image` (a `docker://` reference) and its digest, as skopeo reads them.
fn manifest_of(image: &str) -> (serde_json::Value, String) {
    let manifest = json(&run(
        "skopeo",
        &["inspect", "--raw", "--tls-verify=false", image],
    ));
    let digest = json(&run("skopeo", &["inspect", "--tls-verify=false", image]))["Digest"]
        .as_str()
        .expect("digest")
        .to_string();
    (manifest, digest)
}

#[test]
fn corrupt_blobs_and_unknown_images_are_refused() {
    let Some(Pushed {
        reg,
        work: _work,
        layout: _layout,
        sdir,
        store,
    }) = pushed("reg-bad", "bad/img:v1", None, false)
    else {
        return;
    };
    let host = reg.host();
    an_unknown_tag_is_named_with_the_registrys_answer(&store, &host);
    // Flip bytes of the third layer's blob in the registry's storage: same size, other digest.
    let (manifest, manifest_digest) = manifest_of(&format!("docker://{host}/bad/img:v1"));
    // Rewrites a blob in the registry's storage (same length, other bytes).
    let tamper = |digest: &str, f: &dyn Fn(&mut Vec<u8>)| {
        let path = reg.blob_path(digest);
        let mut bytes = std::fs::read(&path).expect("read blob");
        f(&mut bytes);
        std::fs::write(&path, &bytes).expect("write blob");
    };
    // Imports, expecting a refusal (exit 5) that tags nothing; returns the message.
    let src = format!("docker://{host}/bad/img:v1");
    let refused = || {
        let o = store.run(&["import", &src, "-t", "b:v1"]);
        assert_eq!(o.status.code(), Some(5), "{}", stderr(&o));
        let o2 = store.run(&["inspect", "b:v1"]);
        assert_eq!(o2.status.code(), Some(3), "a refused import was tagged");
        let manifests = std::fs::read_dir(sdir.path().join("manifests"))
            .map(|r| r.count())
            .unwrap_or(0);
        assert_eq!(manifests, 0, "a refused import wrote a manifest");
        stderr(&o)
    };

    // The third layer's blob.
    let digest = manifest["layers"][2]["digest"].as_str().expect("digest");
    tamper(digest, &|b| {
        let mid = b.len() / 2;
        b[mid] ^= 0xff;
    });
    let e = refused();
    assert!(
        e.contains("digest mismatch") && e.contains(digest) && e.contains("bad/img"),
        "{e}"
    );

    // The config (it is fetched before any layer).
    let config = manifest["config"]["digest"].as_str().expect("digest");
    tamper(config, &|b| {
        let at = b.len() - 3;
        b[at] = if b[at] == b' ' { b'\t' } else { b' ' };
    });
    let e = refused();
    assert!(e.contains("config") && e.contains(config), "{e}");

    // The manifest: its bytes are not what the registry names it by.
    tamper(&manifest_digest, &|b| {
        let last = b.len() - 1;
        b[last] = b' ';
    });
    let e = refused();
    assert!(
        e.contains("Docker-Content-Digest") && e.contains(&manifest_digest),
        "{e}"
    );
}

/// A registry that is not on loopback is never asked over plain HTTP without `--plain-http` (the name
/// does not resolve: the message names the URL it tried).
#[test]
fn a_registry_off_loopback_is_asked_over_https_unless_plain_http() {
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    let o = store.run(&["import", "docker://registry.invalid/x/y:1", "-t", "b:y"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("https://registry.invalid/v2/"),
        "{}",
        stderr(&o)
    );
    let o = store.run(&[
        "import",
        "docker://registry.invalid/x/y:1",
        "-t",
        "b:y",
        "--plain-http",
    ]);
    assert!(
        stderr(&o).contains("http://registry.invalid/v2/"),
        "{}",
        stderr(&o)
    );
}

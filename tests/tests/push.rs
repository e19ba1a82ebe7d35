//! `strata export IMAGE docker://…` (`strata push`) against a real registry on loopback (Debian's
//! `docker-registry`), and `strata login` / `logout` with the docker config file.
//!
//! A pushed image pulled back (`strata pull`) exports to the same layer tars (same diff IDs) and reads
//! the same; a second push uploads nothing; a blob over the 16 MiB chunk goes up in `PATCH` pieces. Behind
//! htpasswd Basic auth (which `docker-registry` serves over plain HTTP on loopback): `strata login`
//! refuses a wrong password (exit 2, nothing written), stores a good one in `$DOCKER_CONFIG/config.json`
//! (0600, other keys kept), pushes and pulls then find it there, a `credsStore` helper is run, and
//! after `strata logout` a push is refused with the way to log in. Through a bearer-token front
//! (`TokenFront`): the token is asked for with push scope, and a wrong password is exit 2.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Output;

use strata_tests::registry::{Registry, TokenFront};
use strata_tests::*;

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf8 path")
}

/// A store holding `app:v1`: a small tree with a file larger than one upload chunk.
fn image(dir: &Path) -> StoreEnv {
    let store = StoreEnv::local(dir);
    build_image(
        &store,
        "app:v1",
        &[
            ("hello", b"hello from a registry\n".to_vec()),
            ("big.bin", random_bytes(20 << 20, 5)),
        ],
    );
    store
}

/// The diff IDs of an image exported as an OCI layout.
fn diff_ids(store: &StoreEnv, image: &str) -> Vec<serde_json::Value> {
    let layout = scratch("push-layout");
    let dest = format!("oci:{}:x", s(layout.path()));
    let out = json(&store.ok(&["export", image, &dest, "--json"]));
    out["layers"]
        .as_array()
        .expect("layers")
        .iter()
        .map(|l| l["diff_id"].clone())
        .collect()
}

fn n(v: &serde_json::Value, field: &str) -> u64 {
    v[field]
        .as_u64()
        .unwrap_or_else(|| panic!("{field} in {v}"))
}

#[test]
fn push_then_pull_gives_the_same_image_and_a_second_push_skips_every_blob() {
    let Some(reg) = Registry::start(None) else {
        return;
    };
    let dir = scratch("push-src");
    let store = image(dir.path());
    let dest = format!("docker://{}/team/app:v1", reg.host());
    let first = json(&store.ok(&["push", "app:v1", &dest, "--json"]));
    let layers = first["layers"].as_array().expect("layers").len() as u64;
    assert_eq!(n(&first, "uploaded_blobs"), layers + 1, "{first}");
    assert_eq!(n(&first, "skipped_blobs"), 0, "{first}");
    assert!(n(&first, "uploaded_bytes") > 20 << 20, "{first}");
    let second = json(&store.ok(&["export", "app:v1", &dest, "--json"]));
    assert_eq!(n(&second, "uploaded_blobs"), 0, "{second}");
    assert_eq!(n(&second, "skipped_blobs"), layers + 1, "{second}");
    assert_eq!(second["manifest"], first["manifest"]);

    // Pulled back into another store, under the reference's own name.
    let dir2 = scratch("push-dst");
    let other = StoreEnv::local(dir2.path());
    let pulled = json(&other.ok(&["pull", &dest, "--json"]));
    assert_eq!(pulled["tag"], "team/app:v1");
    assert_eq!(pulled["oci_manifest"], first["manifest"]);
    assert_eq!(
        other.ok(&["cat", "team/app:v1", "/data/hello"]),
        "hello from a registry"
    );
    assert_eq!(diff_ids(&other, "team/app:v1"), diff_ids(&store, "app:v1"));

    // A push by digest must name the image's manifest.
    let wrong = format!("docker://{}/team/app@sha256:{}", reg.host(), "0".repeat(64));
    let o = store.run(&["push", "app:v1", &wrong]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
}

/// `store` with `DOCKER_CONFIG` (and more) set.
fn with_env(store: &StoreEnv, env: &[(&str, String)]) -> StoreEnv {
    let mut s = store.clone();
    s.env
        .extend(env.iter().map(|(k, v)| (k.to_string(), v.clone())));
    s
}

#[test]
fn login_stores_credentials_that_push_and_pull_use() {
    let Some(reg) = Registry::start(Some(("alice", "s3cret"))) else {
        return;
    };
    let dir = scratch("login-src");
    let cfg = scratch("login-cfg");
    let config = cfg.path().join("config.json");
    std::fs::write(
        &config,
        r#"{"auths":{"other.example":{"auth":"eDp5"}},"detachKeys":"ctrl-q"}"#,
    )
    .expect("write config");
    let store = with_env(
        &image(dir.path()),
        &[("DOCKER_CONFIG", s(cfg.path()).to_string())],
    );
    let host = reg.host();
    let dest = format!("docker://{host}/private/app:v1");

    // Without credentials: refused, exit 2, the way to log in named.
    let o = store.run(&["push", "app:v1", &dest]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("strata login"), "{}", stderr(&o));
    // A wrong password: refused, nothing written.
    let login = ["login", &host, "-u", "alice", "--password-stdin"];
    let o = store.run_with_stdin(&login, Some(b"wrong\n"));
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("401"), "{}", stderr(&o));
    assert!(!std::fs::read_to_string(&config)
        .expect("config")
        .contains(&host));
    let o = store.run(&["push", "app:v1", &dest, "--creds", "alice:nope"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("refused the credentials from --creds"),
        "{}",
        stderr(&o)
    );

    // A good one: stored 0600, other keys kept; push and pull find it.
    let o = store.run_with_stdin(&login, Some(b"s3cret\n"));
    assert!(o.status.success(), "{}", stderr(&o));
    let mode = std::fs::metadata(&config)
        .expect("config")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    let v = json(&std::fs::read_to_string(&config).expect("config"));
    assert_eq!(v["auths"][&host]["auth"], "YWxpY2U6czNjcmV0");
    assert_eq!(v["auths"]["other.example"]["auth"], "eDp5");
    assert_eq!(v["detachKeys"], "ctrl-q");
    let pushed = json(&store.ok(&["push", "app:v1", &dest, "--json"]));
    let dir2 = scratch("login-dst");
    let other = with_env(
        &StoreEnv::local(dir2.path()),
        &[("DOCKER_CONFIG", s(cfg.path()).to_string())],
    );
    let pulled = json(&other.ok(&["pull", &dest, "-t", "got:v1", "--json"]));
    assert_eq!(pulled["oci_manifest"], pushed["manifest"]);

    // Logged out: the entry is gone (the others stay) and a push is refused again.
    store.ok(&["logout", &host]);
    let v = json(&std::fs::read_to_string(&config).expect("config"));
    assert!(v["auths"].get(&host).is_none(), "{v}");
    assert_eq!(v["auths"]["other.example"]["auth"], "eDp5");
    let o = store.run(&["push", "app:v1", &dest]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));

    // A credential helper the config names is run (docker-credential-NAME get).
    let bin = scratch("login-helper");
    let helper = bin.path().join("docker-credential-strtest");
    std::fs::write(
        &helper,
        "#!/bin/sh\nread server\necho '{\"ServerURL\":\"'$server'\",\"Username\":\"alice\",\"Secret\":\"s3cret\"}'\n",
    )
    .expect("write helper");
    std::fs::set_permissions(&helper, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    std::fs::write(&config, r#"{"credsStore":"strtest"}"#).expect("write config");
    let path = format!(
        "{}:{}",
        s(bin.path()),
        std::env::var("PATH").unwrap_or_default()
    );
    let helped = with_env(&store, &[("PATH", path)]);
    let out = json(&helped.ok(&["push", "app:v1", &dest, "--json"]));
    assert_eq!(out["manifest"], pushed["manifest"]);
    // A helper that is not installed: a clear error.
    std::fs::write(&config, r#"{"credsStore":"strata-absent"}"#).expect("write config");
    let o = store.run(&["push", "app:v1", &dest]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("docker-credential-strata-absent"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn push_through_the_bearer_token_flow_asks_for_push_scope() {
    let Some(reg) = Registry::start(None) else {
        return;
    };
    let work = scratch("push-token");
    let front = TokenFront::start(&reg, "dave", "tok3n", work.path());
    let dir = scratch("push-token-src");
    let store = image(dir.path());
    let dest = format!("docker://127.0.0.1:{}/tok/app:v1", front.port);
    let o = store.run(&["push", "app:v1", &dest, "--creds", "dave:wrong"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("token from"), "{}", stderr(&o));
    let out = json(&store.ok(&["push", "app:v1", &dest, "--creds", "dave:tok3n", "--json"]));
    assert!(n(&out, "uploaded_blobs") >= 2, "{out}");
    let log = front.log();
    assert!(
        log.contains("scope=repository%3Atok%2Fapp%3Apull%2Cpush"),
        "{log}"
    );
    assert!(log.contains("ok PATCH /v2/tok/app/blobs/uploads/"), "{log}");
    assert!(log.contains("ok PUT /v2/tok/app/manifests/v1"), "{log}");
    // What went through the front is in the registry behind it.
    let dir2 = scratch("push-token-dst");
    let other = StoreEnv::local(dir2.path());
    let src = format!("docker://{}/tok/app:v1", reg.host());
    let pulled = json(&other.ok(&["pull", &src, "--json"]));
    assert_eq!(pulled["oci_manifest"], out["manifest"]);
}

//! stratad's layer service (`/v1/layers`): a named hold mounts a layer (one reference however often it
//! is asked for), survives the death of the whole node (server and holder: the layer is mounted again
//! at the same path) and is released by name.

use std::path::PathBuf;

use serde_json::{json, Value};
use strata_api::{Client, ClientError, ErrorKind};
use strata_tests::{build_image, can_mount, json as parse, scratch, Daemon, StoreEnv};

fn client(d: &Daemon) -> Client {
    Client {
        socket: d.socket.clone(),
    }
}

fn layer_refs(d: &Daemon, digest: &str) -> Option<u64> {
    let st = client(d).call("GET", "/v1/status", None).expect("status");
    st["layers"]
        .as_array()?
        .iter()
        .find(|l| l["digest"] == digest)
        .and_then(|l| l["refs"].as_u64())
}

#[test]
fn a_held_layer_is_mounted_once_survives_the_node_and_is_released_by_name() {
    if !can_mount() {
        return;
    }
    let sdir = scratch("holds-store");
    let store = StoreEnv::local(sdir.path());
    build_image(&store, "holds/app:v1", &[("hello.txt", b"held\n".to_vec())]);
    let img = parse(&store.ok(&["inspect", "holds/app:v1", "--json"]));
    let digest = img["manifest"]["layers"][0]["digest"]
        .as_str()
        .expect("layer digest")
        .to_string();
    let mut d = Daemon::start(&store, &[]);
    let body = json!({"digest": digest, "holder": "test:one/two three"});
    let h = client(&d)
        .call("POST", "/v1/layers", Some(&body))
        .expect("hold");
    let path = PathBuf::from(h["path"].as_str().expect("path"));
    assert_eq!(
        std::fs::read(path.join("data/hello.txt")).expect("read"),
        b"held\n"
    );
    let again = client(&d)
        .call("POST", "/v1/layers", Some(&body))
        .expect("hold again");
    assert_eq!(again, h);
    assert_eq!(
        layer_refs(&d, &digest),
        Some(1),
        "one reference per holder name"
    );

    // Server and holder both killed: a fresh node mounts the held layer again, at the same path.
    d.kill_all();
    d.start_again(&[]);
    let listed: Value = client(&d).call("GET", "/v1/layers", None).expect("list");
    assert_eq!(listed.as_array().map(Vec::len), Some(1), "{listed}");
    assert_eq!(listed[0]["holder"], "test:one/two three");
    assert_eq!(
        std::fs::read(path.join("data/hello.txt")).expect("read after restart"),
        b"held\n"
    );

    let q = format!("/v1/layers/{digest}?holder=test%3Aone%2Ftwo%20three");
    client(&d).call("DELETE", &q, None).expect("release");
    assert_eq!(
        layer_refs(&d, &digest),
        None,
        "released layer still mounted"
    );
    assert!(!d.mounts().iter().any(|m| std::path::Path::new(m) == path));
    match client(&d).call("DELETE", &q, None) {
        Err(ClientError::Api { kind, .. }) => assert_eq!(kind, ErrorKind::NotFound),
        other => panic!("second release: {other:?}"),
    }
}

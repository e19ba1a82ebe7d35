//! Image configs and honest composes: config flags at build, declared configs merged by compose (a
//! toolkit adding to PATH), kept by pack_diff and flatten, shown by inspect, run by `strata bundle` +
//! runc; layers that record their base, refused on another one unless `--rebase`; the layer order is
//! the order given.

use std::path::Path;

use serde_json::Value;
use strata_tests::*;

fn p(d: &Path) -> &str {
    d.to_str().expect("utf8")
}

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A directory with `files` (path, content) in it; its root is 0755 (a layer's root directory takes
/// it, and a sandbox's user other than root must be able to enter it).
fn tree(files: &[(&str, &str)]) -> tempfile::TempDir {
    let d = scratch("cfg-src");
    open_root(d.path());
    for (path, data) in files {
        let f = d.path().join(path);
        std::fs::create_dir_all(f.parent().expect("parent")).expect("mkdir");
        std::fs::write(&f, data).expect("write");
    }
    d
}

fn open_root(d: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).expect("chmod");
}

/// Builds `src` with `args`; returns the layer digest.
fn build(store: &StoreEnv, src: &Path, args: &[&str]) -> String {
    let mut full = vec!["build", p(src)];
    full.extend_from_slice(args);
    store.ok(&full)
}

fn inspect(store: &StoreEnv, r: &str) -> Value {
    json(&store.ok(&["inspect", r, "--json"]))
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .into_iter()
        .flatten()
        .map(|s| s.as_str().expect("string").to_string())
        .collect()
}

fn layer_digests(img: &Value) -> Vec<String> {
    img["manifest"]["layers"]
        .as_array()
        .expect("layers")
        .iter()
        .map(|l| l["digest"].as_str().expect("digest").to_string())
        .collect()
}

/// The layers the config tests compose: a base with a config, a toolkit adding to PATH, a workspace.
struct Layers {
    /// The base's source (the bad-flag builds use it again).
    base_src: tempfile::TempDir,
    base_layer: String,
    tk: String,
    ws: String,
}

/// Builds [`Layers`], checking the configs each build declares.
fn three_layers(store: &StoreEnv) -> Layers {
    let base_src = tree(&[("etc/who", "base\n"), ("usr/bin/x", "x")]);
    build(
        store,
        base_src.path(),
        &[
            "-t",
            "cfg/base:v1",
            "--env",
            "PATH=/usr/bin:/bin",
            "--env",
            "LANG=C",
            "--cmd",
            r#"["/bin/sh","-c","echo hi"]"#,
            "--label",
            "org.example.base=1",
        ],
    );
    let base = inspect(store, "cfg/base:v1");
    assert_eq!(
        strings(&base["manifest"]["config"]["env"]),
        ["PATH=/usr/bin:/bin", "LANG=C"]
    );
    assert_eq!(
        strings(&base["manifest"]["config"]["cmd"]),
        ["/bin/sh", "-c", "echo hi"]
    );
    // The toolkit adds to PATH; its layer keeps the reference, unexpanded.
    let tk_src = tree(&[("opt/tk/bin/tool", "t"), ("etc/who", "toolkit\n")]);
    let tk = build(
        store,
        tk_src.path(),
        &[
            "--kind",
            "toolkit",
            "--on",
            "cfg/base:v1",
            "--env",
            "PATH=/opt/tk/bin:$PATH",
            "--env",
            "TK_HOME=/opt/tk",
            "--env",
            "TK_BIN=${TK_HOME}/bin",
            "--workdir",
            "/work",
            "--label",
            "org.example.tk=2",
        ],
    );
    let tkl = inspect(store, &tk);
    assert_eq!(
        strings(&tkl["config"]["env"]),
        [
            "PATH=/opt/tk/bin:${PATH}",
            "TK_HOME=/opt/tk",
            "TK_BIN=/opt/tk/bin"
        ]
    );
    assert_eq!(
        tkl["built_on"]["image"].as_str(),
        base["digest"].as_str(),
        "the toolkit records its base"
    );
    let ws_src = tree(&[("work/README", "ws"), ("etc/who", "workspace\n")]);
    let ws = build(
        store,
        ws_src.path(),
        &[
            "--kind",
            "workspace",
            "--on",
            "cfg/base:v1",
            "--user",
            "1000:1000",
            "--entrypoint",
            "/usr/bin/tini",
        ],
    );
    let base_layer = layer_digests(&base)[0].clone();
    Layers {
        base_src,
        base_layer,
        tk,
        ws,
    }
}

/// Compose stacks the layers bottom to top in the order given and merges their configs; returns the
/// inspected `cfg/a:v1` (base, toolkit, workspace).
fn compose_in_the_order_given(store: &StoreEnv, l: &Layers) -> Value {
    let Layers {
        base_layer, tk, ws, ..
    } = l;
    // Bottom to top in the order given: the toolkit below the workspace ...
    store.ok(&[
        "compose",
        "--base",
        "cfg/base:v1",
        "--toolkit",
        tk,
        "--workspace",
        ws,
        "-t",
        "cfg/a:v1",
    ]);
    let a = inspect(store, "cfg/a:v1");
    assert_eq!(layer_digests(&a), [base_layer.as_str(), tk, ws]);
    assert_eq!(store.ok(&["cat", "cfg/a:v1", "/etc/who"]), "workspace");
    let c = &a["manifest"]["config"];
    assert_eq!(
        strings(&c["env"]),
        [
            "PATH=/opt/tk/bin:/usr/bin:/bin",
            "LANG=C",
            "TK_HOME=/opt/tk",
            "TK_BIN=/opt/tk/bin"
        ]
    );
    assert_eq!(c["working_dir"], "/work");
    assert_eq!(c["user"], "1000:1000");
    assert_eq!(strings(&c["entrypoint"]), ["/usr/bin/tini"]);
    assert!(
        c["cmd"].is_null(),
        "an entrypoint without a cmd clears the base's cmd: {c}"
    );
    assert_eq!(c["labels"]["org.example.base"], "1");
    assert_eq!(c["labels"]["org.example.tk"], "2");
    // ... and the other way round when given the other way round.
    store.ok(&[
        "compose",
        "--base",
        "cfg/base:v1",
        "--workspace",
        ws,
        "--toolkit",
        tk,
        "-t",
        "cfg/b:v1",
    ]);
    let b = inspect(store, "cfg/b:v1");
    assert_eq!(layer_digests(&b), [base_layer.as_str(), ws, tk]);
    assert_eq!(store.ok(&["cat", "cfg/b:v1", "/etc/who"]), "toolkit");
    a
}

fn compose_flags_apply_last(store: &StoreEnv, tk: &str) {
    // Compose's own flags and --config-from apply last.
    store.ok(&[
        "compose",
        "--base",
        "cfg/base:v1",
        "--toolkit",
        tk,
        "--env",
        "LANG=C.UTF-8",
        "--env",
        "PATH=$PATH:/extra",
        "--cmd",
        "[]",
        "-t",
        "cfg/c:v1",
    ]);
    let c = inspect(store, "cfg/c:v1")["manifest"]["config"].clone();
    assert_eq!(
        strings(&c["env"]),
        [
            "PATH=/opt/tk/bin:/usr/bin:/bin:/extra",
            "LANG=C.UTF-8",
            "TK_HOME=/opt/tk",
            "TK_BIN=/opt/tk/bin"
        ]
    );
    assert!(c["cmd"].is_null(), "--cmd [] clears: {c}");
    store.ok(&[
        "compose",
        "--base",
        "cfg/base:v1",
        "--toolkit",
        tk,
        "--config-from",
        "cfg/base:v1",
        "--workdir",
        "/srv",
        "-t",
        "cfg/d:v1",
    ]);
    let d = inspect(store, "cfg/d:v1")["manifest"]["config"].clone();
    assert_eq!(strings(&d["env"]), ["PATH=/usr/bin:/bin", "LANG=C"]);
    assert_eq!(d["working_dir"], "/srv");
}

fn inspect_shows_the_config(store: &StoreEnv) {
    // inspect shows the config, and what a layer declares, to people too.
    let human = store.ok(&["inspect", "cfg/a:v1"]);
    assert!(
        human.contains("config   env        PATH=/opt/tk/bin:/usr/bin:/bin"),
        "{human}"
    );
    assert!(
        human.contains("declares env        PATH=/opt/tk/bin:${PATH}"),
        "{human}"
    );
    assert!(human.contains("built on image"), "{human}");
}

/// pack_diff and flatten of `a` (the inspected `cfg/a:v1`) keep its config.
fn pack_diff_and_flatten_keep_it(store: &StoreEnv, a: &Value, base_layer: &str) {
    // pack_diff keeps the image's config and applies its flags; the diff records its image.
    let upper = tree(&[("work/out.txt", "result")]);
    let out = json(&store.ok(&[
        "pack-diff",
        "--upper",
        p(upper.path()),
        "--image",
        "cfg/a:v1",
        "-t",
        "cfg/a:snap",
        "--env",
        "STEP=2",
        "--json",
    ]));
    let snap = inspect(store, "cfg/a:snap");
    let sc = &snap["manifest"]["config"];
    assert_eq!(
        strings(&sc["env"]).last().map(String::as_str),
        Some("STEP=2")
    );
    assert_eq!(sc["working_dir"], "/work");
    assert_eq!(sc["user"], "1000:1000");
    let diff = inspect(store, out["layer"].as_str().expect("layer"));
    assert_eq!(diff["built_on"]["image"], a["digest"]);
    assert_eq!(strings(&diff["config"]["env"]), ["STEP=2"]);
    // flatten keeps it (or changes it with flags); the flattened bottom declares the whole config.
    let f = json(&store.ok(&["flatten", "cfg/a:snap", "-t", "cfg/a:flat", "--json"]));
    assert_eq!(inspect(store, "cfg/a:flat")["manifest"]["config"], *sc);
    let flat = f["layer"].as_str().expect("layer").to_string();
    store.ok(&["compose", "--base", &flat, "-t", "cfg/a:flat2"]);
    assert_eq!(inspect(store, "cfg/a:flat2")["manifest"]["config"], *sc);
    store.ok(&[
        "flatten",
        "cfg/a:snap",
        "--from",
        "1",
        "-t",
        "cfg/a:flat3",
        "--user",
        "0",
    ]);
    let f3 = inspect(store, "cfg/a:flat3");
    assert_eq!(f3["manifest"]["config"]["user"], "0");
    let top = &f3["layers"][1];
    assert_eq!(
        strings(&top["built_on"]["layers"]),
        [base_layer],
        "a flattened upper range records the layers below it"
    );
    assert_eq!(
        strings(&top["config"]["env"]),
        [
            "PATH=/opt/tk/bin:${PATH}",
            "TK_HOME=/opt/tk",
            "TK_BIN=/opt/tk/bin",
            "STEP=2"
        ],
        "a flattened range declares what its layers declared"
    );
}

fn bad_flags_name_the_flag(store: &StoreEnv, src: &Path) {
    // Bad flags are usage errors naming the flag.
    for (flag, value) in [
        ("--env", "NOEQUALS"),
        ("--cmd", "[1,2]"),
        ("--workdir", "relative"),
        ("--label", "=x"),
    ] {
        let o = store.run(&["build", p(src), flag, value]);
        assert_eq!(o.status.code(), Some(2), "{flag} {value}: {}", stderr(&o));
        assert!(stderr(&o).contains(flag), "{}", stderr(&o));
    }
}

#[test]
fn configs_are_declared_merged_in_order_and_kept() {
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    let layers = three_layers(&store);
    let a = compose_in_the_order_given(&store, &layers);
    compose_flags_apply_last(&store, &layers.tk);
    inspect_shows_the_config(&store);
    pack_diff_and_flatten_keep_it(&store, &a, &layers.base_layer);
    bad_flags_name_the_flag(&store, layers.base_src.path());
}

#[test]
fn compose_refuses_a_layer_built_on_another_base() {
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    let b1 = tree(&[("var/lib/dpkg/status", "Package: git\n\n")]);
    let b2 = tree(&[("var/lib/dpkg/status", "Package: git\n\nPackage: curl\n\n")]);
    build(&store, b1.path(), &["-t", "deb/base:v1"]);
    build(&store, b2.path(), &["-t", "deb/base:v2"]);
    let v1 = inspect(&store, "deb/base:v1")["digest"]
        .as_str()
        .expect("digest")
        .to_string();
    let tk_src = tree(&[
        ("var/lib/dpkg/status", "Package: git\n\nPackage: jq\n\n"),
        ("usr/bin/jq", "jq"),
    ]);
    let tk = build(
        &store,
        tk_src.path(),
        &[
            "--kind",
            "toolkit",
            "--on",
            "deb/base:v1",
            "-t",
            "deb/tk:v1",
        ],
    );

    // On the base it was built on: accepted (by layer digest or by the one-layer image's tag).
    store.ok(&[
        "compose",
        "--base",
        "deb/base:v1",
        "--toolkit",
        &tk,
        "-t",
        "deb/ok:v1",
    ]);
    store.ok(&[
        "compose",
        "--base",
        "deb/base:v1",
        "--toolkit",
        "deb/tk:v1",
        "-t",
        "deb/ok:v2",
    ]);
    // On another: refused, naming the base it was built on and the one given; nothing tagged.
    let o = store.run(&[
        "compose",
        "--base",
        "deb/base:v2",
        "--toolkit",
        &tk,
        "-t",
        "deb/bad:v1",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let e = stderr(&o);
    for want in [
        tk.as_str(),
        v1.as_str(),
        "deb/base:v2",
        "--rebase",
        "dpkg/status",
    ] {
        assert!(e.contains(want), "error lacks {want:?}: {e}");
    }
    assert_eq!(store.run(&["inspect", "deb/bad:v1"]).status.code(), Some(3));
    // With --rebase: composed, with a warning.
    let o = store.run(&[
        "compose",
        "--base",
        "deb/base:v2",
        "--toolkit",
        &tk,
        "--rebase",
        "-t",
        "deb/bad:v1",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("warning"), "{}", stderr(&o));
    // A layer without a recorded base is taken as before.
    let free = build(&store, tk_src.path(), &["--kind", "toolkit"]);
    store.ok(&[
        "compose",
        "--base",
        "deb/base:v2",
        "--toolkit",
        &free,
        "-t",
        "deb/free:v1",
    ]);
    diffs_and_bases_are_held_to_their_base_too(&store, b1.path());
}

/// A pack_diff diff records the image it was made on (refused on another base too); a base layer is a
/// bottom, so `--on` makes no sense for it.
fn diffs_and_bases_are_held_to_their_base_too(store: &StoreEnv, b1: &Path) {
    // A pack_diff diff records the image it was made on: refused on another base too.
    let upper = tree(&[("root/notes", "n")]);
    let out = json(&store.ok(&[
        "pack-diff",
        "--upper",
        p(upper.path()),
        "--image",
        "deb/ok:v1",
        "-t",
        "deb/snap:v1",
        "--json",
    ]));
    let diff = out["layer"].as_str().expect("layer");
    store.ok(&["compose", "--base", "deb/snap:v1", "-t", "deb/snap:v2"]);
    let o = store.run(&[
        "compose",
        "--base",
        "deb/base:v2",
        "--workspace",
        diff,
        "-t",
        "deb/x:v1",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    // A base layer is a bottom: --on makes no sense for it.
    let o = store.run(&["build", p(b1), "--on", "deb/base:v1"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
}

#[test]
fn the_layer_order_rule_is_stated_once() {
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    let help = String::from_utf8_lossy(&store.run(&["--help"]).stdout).into_owned();
    let chelp = String::from_utf8_lossy(&store.run(&["compose", "--help"]).stdout).into_owned();
    let docs = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/CLI.md"))
        .expect("docs/CLI.md");
    let rule = "--workspace and --toolkit layers in the order given, the first lowest";
    let flat = |s: &str| {
        s.replace('`', "")
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    };
    for (what, text) in [
        ("strata --help", &help),
        ("compose --help", &chelp),
        ("docs/CLI.md", &docs),
    ] {
        assert!(
            flat(text).contains(rule),
            "{what} does not state the order rule: {text}"
        );
    }
}

#[test]
fn bundle_runs_the_merged_config_with_runc() {
    if !have(&[Need::Mount, Need::Runc]) {
        return;
    }
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    let base = scratch("rootfs");
    busybox_rootfs(base.path());
    open_root(base.path());
    std::fs::write(
        base.path().join("etc/passwd"),
        "root:x:0:0:root:/root:/bin/sh\nagent:x:1000:1001::/home/agent:/bin/sh\n",
    )
    .expect("passwd");
    std::fs::write(base.path().join("etc/group"), "root:x:0:\nagent:x:1001:\n").expect("group");
    build(
        &store,
        base.path(),
        &["-t", "run/base:v1", "--env", "PATH=/bin"],
    );
    let tk_src = tree(&[("opt/tk/bin/hello", "#!/bin/sh\necho hello from $TK\n")]);
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(
        tk_src.path().join("opt/tk/bin/hello"),
        std::fs::Permissions::from_mode(0o755),
    )
    .expect("chmod");
    let tk = build(
        &store,
        tk_src.path(),
        &[
            "--kind",
            "toolkit",
            "--on",
            "run/base:v1",
            "--env",
            "PATH=/opt/tk/bin:$PATH",
            "--env",
            "TK=toolkit",
        ],
    );
    let ws_src = tree(&[("work/task.txt", "task")]);
    let ws = build(
        &store,
        ws_src.path(),
        &[
            "--kind",
            "workspace",
            "--on",
            "run/base:v1",
            "--workdir",
            "/work",
            "--user",
            "agent",
        ],
    );
    store.ok(&[
        "compose",
        "--base",
        "run/base:v1",
        "--toolkit",
        &tk,
        "--workspace",
        &ws,
        "--cmd",
        r#"["/bin/sh","-c","hello; echo $PATH; pwd; busybox id -u; busybox id -g; cat task.txt"]"#,
        "-t",
        "run/agent:v1",
    ]);
    let mut d = Daemon::start(&store, &["--cache-size", "1G"]);
    // The API gives a client the process to start.
    let sb = json(&d.ok(&["mount", "run/agent:v1", "--sandbox", "api1", "--json"]));
    assert_eq!(sb["process"]["cwd"], "/work", "{sb}");
    assert_eq!(sb["process"]["user"]["uid"], 1000);
    assert_eq!(sb["process"]["user"]["gid"], 1001);
    assert!(strings(&sb["process"]["env"]).contains(&"PATH=/opt/tk/bin:/bin".to_string()));
    assert_eq!(sb["config"]["user"], "agent");
    d.ok(&["umount", "--sandbox", "api1", "--purge"]);

    let bdir = scratch("bundle");
    d.ok(&[
        "bundle",
        "run/agent:v1",
        "--sandbox",
        "run1",
        p(bdir.path()),
    ]);
    let o = std::process::Command::new("runc")
        .args(["run", "--bundle", p(bdir.path()), "strata-test-cfg-run1"])
        .stdin(std::process::Stdio::null())
        .output()
        .expect("runc");
    assert!(o.status.success(), "runc: {}", stderr(&o));
    assert_eq!(
        String::from_utf8_lossy(&o.stdout),
        "hello from toolkit\n/opt/tk/bin:/bin\n/work\n1000\n1001\ntask"
    );
    d.ok(&["umount", "--sandbox", "run1", "--purge"]);
    assert_eq!(d.stop(), Vec::<String>::new(), "mounts left behind");
}

#[test]
fn import_applies_config_flags_to_the_oci_config() {
    if !strata_tests::oci::have_umoci() {
        return;
    }
    let work = scratch("cfg-oci");
    let layout = strata_tests::oci::umoci_image(work.path());
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    let src = format!("oci:{}:t", p(&layout));
    store.ok(&[
        "import",
        &src,
        "-t",
        "imp/a:v1",
        "--env",
        "PATH=/opt/x/bin:$PATH",
        "--workdir",
        "/srv",
        "--label",
        "org.example.added=yes",
    ]);
    let c = inspect(&store, "imp/a:v1")["manifest"]["config"].clone();
    let env = strings(&c["env"]);
    assert!(
        env.contains(&"PATH=/opt/x/bin:/usr/bin:/bin".to_string()),
        "{c}"
    );
    assert_eq!(c["working_dir"], "/srv");
    assert_eq!(c["user"], "app", "what the flags do not change stays");
    assert_eq!(c["labels"]["org.example.kind"], "test");
    assert_eq!(c["labels"]["org.example.added"], "yes");
    // --config-from replaces the OCI config; the flags still apply on top.
    let other = tree(&[("etc/x", "x")]);
    build(&store, other.path(), &["-t", "imp/cfg:v1", "--env", "A=1"]);
    store.ok(&[
        "import",
        &src,
        "-t",
        "imp/b:v1",
        "--config-from",
        "imp/cfg:v1",
        "--user",
        "0",
    ]);
    let c = inspect(&store, "imp/b:v1")["manifest"]["config"].clone();
    assert_eq!(strings(&c["env"]), ["A=1"]);
    assert_eq!(c["user"], "0");
    assert!(c["working_dir"].is_null() && c["labels"].is_null(), "{c}");
}

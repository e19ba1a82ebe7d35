//! `strata run` with real bubblewrap and runc (an image's env, working directory, user and command; exit
//! codes and signals passed through; the sandbox removed afterwards, also after a failure, or kept
//! stopped), `bundle -- CMD` and its cleanup after a failure; batch teardown (`rm ID…`, `--image`,
//! `--all`, `umount` of several, a busy sandbox refused while the others go); and an honest `ps`:
//! bytes fetched charged to the sandbox whose process read, kept across an upgrade and a restart, the
//! image's size as `strata images` counts it, a stopped sandbox's upper directory.

use std::path::Path;

use serde_json::Value;
use strata_tests::*;

fn p(d: &Path) -> &str {
    d.to_str().expect("utf8")
}

/// An image `run/agent:v1`: busybox, a user `agent` (1000:1001) owning `/work`, PATH, an env
/// variable, `/work` as working directory and a cmd that prints them and exits 3.
fn agent_image(store: &StoreEnv) {
    use std::os::unix::fs::PermissionsExt;
    let src = scratch("run-src");
    busybox_rootfs(src.path());
    std::fs::set_permissions(src.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    for app in ["id", "pwd", "kill"] {
        std::os::unix::fs::symlink("busybox", src.path().join("bin").join(app)).expect("symlink");
    }
    std::fs::write(
        src.path().join("etc/passwd"),
        "root:x:0:0:root:/root:/bin/sh\nagent:x:1000:1001::/work:/bin/sh\n",
    )
    .expect("passwd");
    std::fs::write(src.path().join("etc/group"), "root:x:0:\nagent:x:1001:\n").expect("group");
    let work = src.path().join("work");
    std::fs::create_dir(&work).expect("mkdir");
    std::os::unix::fs::chown(&work, Some(1000), Some(1001)).expect("chown");
    store.ok(&[
        "build",
        p(src.path()),
        "-t",
        "run/agent:v1",
        "--env",
        "PATH=/bin",
        "--env",
        "GREETING=hello",
        "--workdir",
        "/work",
        "--user",
        "agent",
        "--cmd",
        r#"["sh","-c","echo $GREETING $PATH; pwd; id -u; id -g; exit 3"]"#,
    ]);
}

fn sandboxes(d: &Daemon) -> Vec<Value> {
    json(&d.ok(&["ps", "--json"]))["sandboxes"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

fn ids(d: &Daemon) -> Vec<String> {
    sandboxes(d)
        .iter()
        .map(|s| s["id"].as_str().expect("id").to_string())
        .collect()
}

#[test]
fn run_starts_the_image_config_passes_exit_codes_and_cleans_up() {
    if !have(&[Need::Mount, Need::Bwrap, Need::Runc]) {
        return;
    }
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    agent_image(&store);
    let mut d = Daemon::start(&store, &["--cache-size", "1G"]);
    for rt in ["bwrap", "runc"] {
        // The image's config: env with PATH, working directory, user; its exit code.
        let o = d.strata(&["run", "run/agent:v1", "--runtime", rt]);
        assert_eq!(o.status.code(), Some(3), "{rt}: {o:?}");
        assert_eq!(
            String::from_utf8_lossy(&o.stdout),
            "hello /bin\n/work\n1000\n1001\n",
            "{rt}"
        );
        // A command after -- replaces the cmd; standard input reaches it.
        let o = d.store.run_with_stdin(
            &[
                "--socket",
                p(&d.socket),
                "run",
                "run/agent:v1",
                "--runtime",
                rt,
                "--",
                "sh",
                "-c",
                "cat; exit 0",
            ],
            Some(b"from stdin\n"),
        );
        assert!(o.status.success(), "{rt}: {o:?}");
        assert_eq!(String::from_utf8_lossy(&o.stdout), "from stdin\n");
        // A command that does not exist fails (the runtime's code), and the sandbox goes anyway.
        let o = d.strata(&["run", "run/agent:v1", "--runtime", rt, "--", "/no/such"]);
        assert!(!o.status.success(), "{rt}: {o:?}");
        assert_eq!(ids(&d), Vec::<String>::new(), "{rt}: sandboxes left");
        // --keep: stopped, its upper directory holds what the process wrote.
        let kept = format!("kept-{rt}");
        d.ok(&[
            "run",
            "run/agent:v1",
            "--runtime",
            rt,
            "--sandbox",
            &kept,
            "--keep",
            "--",
            "sh",
            "-c",
            "echo x > /work/out",
        ]);
        let sb = sandboxes(&d);
        assert_eq!(sb.len(), 1, "{sb:?}");
        assert_eq!(sb[0]["state"], "stopped");
        let upper = Path::new(sb[0]["upper"].as_str().expect("upper"));
        assert_eq!(
            std::fs::read_to_string(upper.join("work/out")).expect("out"),
            "x\n"
        );
        assert!(d
            .ok(&["ps"])
            .contains(&format!("(upper) {}", upper.display())));
        d.ok(&["rm", &kept]);
    }
    // A signal ends the process: 128 + N (under bubblewrap the command is not the namespace's init).
    let o = d.strata(&["run", "run/agent:v1", "--", "sh", "-c", "kill -KILL $$"]);
    assert_eq!(o.status.code(), Some(137), "{o:?}");
    // An id in use is refused, and that sandbox is not removed by the refusal.
    d.ok(&["mount", "run/agent:v1", "--sandbox", "taken"]);
    let o = d.strata(&["run", "run/agent:v1", "--sandbox", "taken"]);
    assert!(!o.status.success());
    assert_eq!(ids(&d), ["taken"]);
    d.ok(&["rm", "taken"]);
    assert_eq!(d.stop(), Vec::<String>::new(), "mounts left behind");
}

#[test]
fn bundle_takes_a_command_and_cleans_up_after_a_failure() {
    if !have(&[Need::Mount, Need::Runc]) {
        return;
    }
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    agent_image(&store);
    let mut d = Daemon::start(&store, &["--cache-size", "1G"]);
    // DIR cannot be made (a file is in the way): the bundle fails and its sandbox is gone.
    let blocker = scratch("blocker");
    let file = blocker.path().join("file");
    std::fs::write(&file, b"x").expect("write");
    let bad = file.join("bundle");
    let o = d.strata(&["bundle", "run/agent:v1", "--sandbox", "b1", p(&bad)]);
    assert!(!o.status.success());
    assert_eq!(ids(&d), Vec::<String>::new());
    // The retry with a good DIR works (no "already exists"), with the command given.
    let dir = scratch("bundle");
    d.ok(&[
        "bundle",
        "run/agent:v1",
        "--sandbox",
        "b1",
        p(dir.path()),
        "--",
        "echo",
        "replaced",
    ]);
    let cfg = json(&std::fs::read_to_string(dir.path().join("config.json")).expect("config"));
    assert_eq!(
        cfg["process"]["args"],
        serde_json::json!(["echo", "replaced"])
    );
    let o = std::process::Command::new("runc")
        .args(["run", "--bundle", p(dir.path()), "strata-test-run-b1"])
        .stdin(std::process::Stdio::null())
        .output()
        .expect("runc");
    assert_eq!(String::from_utf8_lossy(&o.stdout), "replaced\n", "{o:?}");
    d.ok(&["rm", "b1"]);
    assert_eq!(d.stop(), Vec::<String>::new(), "mounts left behind");
}

#[test]
fn batch_teardown_by_ids_image_and_all() {
    if !have(&[Need::Mount]) {
        return;
    }
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    build_image(&store, "tear/a:v1", &[]);
    build_image(&store, "tear/b:v1", &[("f", b"b".to_vec())]);
    let mut d = Daemon::start(&store, &["--cache-size", "1G"]);
    let mount = |img: &str, n: &[&str]| {
        let mut args = vec!["mount", img];
        for id in n {
            args.extend(["--sandbox", id]);
        }
        d.ok(&args);
    };
    mount("tear/a:v1", &["a1", "a2", "a3", "a4"]);
    mount("tear/b:v1", &["b1", "b2"]);
    // Several ids in one call; each printed.
    assert_eq!(d.ok(&["rm", "a1", "a2"]), "a1\na2");
    // umount of several: stopped, upper directories kept.
    d.ok(&["umount", "--sandbox", "a3", "--sandbox", "b1"]);
    let states: Vec<(String, String)> = sandboxes(&d)
        .iter()
        .map(|s| {
            (
                s["id"].as_str().expect("id").into(),
                s["state"].as_str().expect("state").into(),
            )
        })
        .collect();
    assert_eq!(
        states,
        [
            ("a3", "stopped"),
            ("a4", "running"),
            ("b1", "stopped"),
            ("b2", "running")
        ]
        .map(|(a, b)| (a.to_string(), b.to_string()))
    );
    // --image: every sandbox of that image, running or stopped.
    let out = json(&d.ok(&["rm", "--image", "tear/b:v1", "--json"]));
    assert_eq!(out["removed"], serde_json::json!(["b1", "b2"]));
    // An id is usable again at once (its directories went to the trash).
    mount("tear/b:v1", &["b1"]);
    // A busy sandbox is refused (exit 7) while the others are removed.
    let rootfs = json(&d.ok(&["ps", "--json"]))["sandboxes"]
        .as_array()
        .expect("sandboxes")
        .iter()
        .find(|s| s["id"] == "a4")
        .and_then(|s| s["rootfs"].as_str().map(str::to_string))
        .expect("a4 rootfs");
    let mut busy = std::process::Command::new("chroot")
        .args([&rootfs, "/bin/sleep", "60"])
        .spawn()
        .expect("chroot");
    std::thread::sleep(std::time::Duration::from_millis(300));
    let o = d.strata(&["rm", "--all"]);
    assert_eq!(o.status.code(), Some(7), "{o:?}");
    assert!(String::from_utf8_lossy(&o.stderr).contains("a4"));
    assert_eq!(ids(&d), ["a4"]);
    let _ = busy.kill();
    let _ = busy.wait();
    d.ok(&["rm", "--all"]);
    assert_eq!(ids(&d), Vec::<String>::new());
    // The trash empties in the background.
    let trash = d.state.path().join("sandboxes/.trash");
    let start = std::time::Instant::now();
    while std::fs::read_dir(&trash).expect("trash").next().is_some() {
        assert!(start.elapsed().as_secs() < 30, "trash not emptied");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    // Nothing left to select is no error.
    let o = d.strata(&["rm", "--stopped"]);
    assert!(o.status.success(), "{o:?}");
    assert_eq!(d.stop(), Vec::<String>::new(), "mounts left behind");
}

#[test]
fn ps_charges_fetches_to_the_reading_sandbox_and_keeps_them() {
    if !have(&[Need::Mount]) {
        return;
    }
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    // Data that reading must fetch (nothing is cached yet).
    let data: Vec<u8> = (0..3u32 << 20)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    build_image(&store, "ps/img:v1", &[("big", data)]);
    let mut d = Daemon::start(&store, &["--cache-size", "1G"]);
    d.ok(&[
        "mount",
        "ps/img:v1",
        "--sandbox",
        "reader",
        "--sandbox",
        "idle",
    ]);
    let by_id = |d: &Daemon, id: &str| -> Value {
        sandboxes(d)
            .into_iter()
            .find(|s| s["id"] == id)
            .expect("sandbox listed")
    };
    let rootfs = by_id(&d, "reader")["rootfs"]
        .as_str()
        .expect("rootfs")
        .to_string();
    let o = std::process::Command::new("chroot")
        .args([&rootfs, "/bin/md5sum", "/data/big"])
        .output()
        .expect("chroot");
    assert!(o.status.success(), "{o:?}");
    let fetched = by_id(&d, "reader")["fetched_bytes"]
        .as_u64()
        .expect("fetched");
    assert!(fetched > 0, "reader fetched {fetched}");
    assert_eq!(by_id(&d, "idle")["fetched_bytes"], 0);
    // The image's size is what `strata images` says.
    let images = json(&store.ok(&["images", "--json"]));
    let stored = images[0]["stored_bytes"].as_u64().expect("stored");
    assert_eq!(by_id(&d, "reader")["image_bytes"], stored);
    // Kept across an upgrade (the successor reads the records)...
    d.ok(&["daemon", "upgrade", "--timeout", "60"]);
    assert_eq!(by_id(&d, "reader")["fetched_bytes"], fetched);
    // ... when the sandbox stops, and across a restart.
    d.ok(&["umount", "--sandbox", "reader"]);
    d.restart(&["--cache-size", "1G"]);
    let sb = by_id(&d, "reader");
    assert_eq!(sb["fetched_bytes"], fetched);
    assert_eq!(sb["state"], "stopped");
    let ps = d.ok(&["ps"]);
    let upper = sb["upper"].as_str().expect("upper");
    assert!(ps.contains(&format!("(upper) {upper}")), "{ps}");
    d.ok(&["rm", "--all"]);
    assert_eq!(d.stop(), Vec::<String>::new(), "mounts left behind");
}

//! MicroVMs for real: `strata vm` through a real stratad, the guest kernel and initramfs scripts/vm-guest
//! builds from Debian's packages, QEMU's `microvm` machine (KVM when it boots here, TCG otherwise). A
//! busybox image and a Debian minbase (debootstrap) image boot lazily from their drives, runs a command and reads a small part of the image; what
//! the VM wrote is packed by `pack_diff --vm` into an image a container starts from, and the reverse; the
//! store cut while the VM runs gives the guest I/O errors within the daemon's deadline, not a hung VM.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use strata_tests::proxy::Proxy;
use strata_tests::vm::{accel, guest, minbase, Vm};
use strata_tests::*;

/// How long a VM may take to boot and run a short command (TCG on a loaded machine is slow).
const BOOT: Duration = Duration::from_secs(120);

/// Runs `strata vm IMAGE --sandbox ID DIR [-- CMD]` with the test guest; returns DIR.
fn vm(d: &Daemon, image: &str, id: &str, dir: &Path, cmd: &[&str]) -> PathBuf {
    let (kernel, initrd) = guest().expect("guest");
    let mut args = vec![
        "vm",
        image,
        "--sandbox",
        id,
        dir.to_str().expect("utf8"),
        "--kernel",
        kernel.to_str().expect("utf8"),
        "--initrd",
        initrd.to_str().expect("utf8"),
        "--scratch-size",
        "256M",
    ];
    if !cmd.is_empty() {
        args.push("--");
        args.extend_from_slice(cmd);
    }
    d.ok(&args);
    dir.to_path_buf()
}

/// Boots the VM of `dir` and waits for its command to end; returns its exit status and console.
fn run(dir: &Path) -> (i32, String) {
    Vm::start(dir).finish(BOOT)
}

fn pack_diff(d: &Daemon, args: &[&str]) -> Output {
    let mut c = Command::new(pack_diff_bin());
    c.arg("--store")
        .arg(&d.store.url)
        .arg("--socket")
        .arg(&d.socket)
        .args(args)
        .stdin(Stdio::null());
    for (k, v) in &d.store.env {
        c.env(k, v);
    }
    c.output().expect("run pack_diff")
}

fn sandbox(d: &Daemon, id: &str) -> serde_json::Value {
    let ps = json(&d.ok(&["ps", "--json"]));
    ps["sandboxes"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|s| s["id"] == id)
        .cloned()
        .unwrap_or_else(|| panic!("no sandbox {id} in {ps}"))
}

#[test]
fn a_debootstrap_minbase_vm_runs_dpkg_lazily() {
    if guest().is_none() {
        return;
    }
    let Some(root) = minbase() else {
        return;
    };
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    store.ok(&["build", root.to_str().expect("utf8"), "-t", "minbase:v1"]);
    let d = Daemon::start(&store, &["--no-prefetch"]);
    let work = scratch("vm");
    let dir = vm(
        &d,
        "minbase:v1",
        "mb",
        &work.path().join("mb"),
        &[
            "/bin/sh",
            "-c",
            "cat /etc/debian_version; dpkg-query -W -f='${Package} ${Status}\\n' coreutils",
        ],
    );
    let (code, console) = run(&dir);
    assert_eq!(code, 0, "{console}");
    assert!(
        console.contains("coreutils install ok installed"),
        "{console}"
    );
    let sb = sandbox(&d, "mb");
    let (fetched, size) = (
        sb["fetched_bytes"].as_u64().expect("fetched"),
        sb["image_bytes"].as_u64().expect("size"),
    );
    eprintln!("minbase VM ({}) fetched {fetched} of {size} bytes", accel());
    assert!(fetched * 4 < size, "fetched {fetched} of {size}");
}

#[test]
fn a_busybox_vm_boots_lazily_and_its_snapshot_starts_a_container_and_back() {
    if guest().is_none() {
        return;
    }
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    build_image(
        &store,
        "vmbb:v1",
        &[
            ("big.bin", random_bytes(24 << 20, 5)),
            ("small.txt", b"small file\n".to_vec()),
            ("gone.txt", b"deleted in the VM\n".to_vec()),
        ],
    );
    let d = Daemon::start(&store, &["--no-prefetch"]);
    let work = scratch("vm");
    let dir = vm(
        &d,
        "vmbb:v1",
        "v1",
        &work.path().join("v1"),
        &[
            "sh",
            "-c",
            "cat /data/small.txt; echo written > /root/vm.txt; rm /data/gone.txt; mkdir -p /opt/vm; echo x > /opt/vm/f",
        ],
    );
    // Nothing of the image is mounted in the host's tree: only the blob server.
    assert_eq!(
        d.mounts(),
        vec![d.runtime.join("fuse").display().to_string()]
    );
    // The drives are root's only (no group configured).
    let desc = json(&std::fs::read_to_string(dir.join("vm.json")).expect("vm.json"));
    for drive in desc["drives"].as_array().expect("drives") {
        let p = drive["path"].as_str().expect("path");
        let m = std::fs::metadata(p).expect("drive file");
        let want = if drive["read_only"] == true {
            0o400
        } else {
            0o600
        };
        assert_eq!((m.mode() & 0o777, m.uid()), (want, 0), "{p}");
    }
    let (code, console) = run(&dir);
    assert_eq!(code, 0, "{console}");
    assert!(console.contains("small file"), "{console}");
    // Lazily: the 24 MiB file was never read.
    let sb = sandbox(&d, "v1");
    let (fetched, size) = (
        sb["fetched_bytes"].as_u64().expect("fetched"),
        sb["image_bytes"].as_u64().expect("size"),
    );
    eprintln!("VM ({}) fetched {fetched} of {size} bytes", accel());
    assert!(fetched * 4 < size, "fetched {fetched} of {size}");

    // The VM's writes and deletion, packed, seen by a container.
    let o = pack_diff(&d, &["--vm", "v1", "-t", "vmbb:fromvm"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r = PathBuf::from(d.ok(&["mount", "vmbb:fromvm", "--sandbox", "c1"]));
    assert_eq!(
        std::fs::read(r.join("root/vm.txt")).expect("vm.txt"),
        b"written\n"
    );
    assert_eq!(std::fs::read(r.join("opt/vm/f")).expect("f"), b"x\n");
    assert!(!r.join("data/gone.txt").exists(), "deleted in the VM");
    // A container's changes, packed, seen by a VM.
    std::fs::write(r.join("root/container.txt"), b"from the container\n").expect("write");
    std::fs::remove_file(r.join("data/small.txt")).expect("rm");
    let o = pack_diff(&d, &["--sandbox", "c1", "-t", "vmbb:fromcontainer"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let dir2 = vm(
        &d,
        "vmbb:fromcontainer",
        "v2",
        &work.path().join("v2"),
        &["sh", "-c", "cat /root/container.txt /root/vm.txt; ls /data"],
    );
    let (code, console) = run(&dir2);
    assert_eq!(code, 0, "{console}");
    assert!(
        console.contains("from the container") && console.contains("written"),
        "{console}"
    );
    assert!(
        console.contains("big.bin") && !console.contains("small.txt"),
        "{console}"
    );
    assert!(!console.contains("gone.txt"), "{console}");

    // A VM whose scratch image is held open (a VMM still running) is not packed.
    let held = std::fs::File::open(d.state.path().join("vms/v2/scratch.ext4")).expect("open");
    let o = pack_diff(&d, &["--vm", "v2", "-t", "vmbb:held"]);
    assert_eq!(
        o.status.code(),
        Some(7),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    drop(held);
    // Stopped, then removed: the scratch image goes too.
    d.ok(&["umount", "--sandbox", "v2"]);
    assert_eq!(sandbox(&d, "v2")["state"], "stopped");
    d.ok(&["rm", "v1", "v2", "c1"]);
    assert!(!d.state.path().join("vms/v2").exists());
}

/// Runs `cmd` as uid and gid `id`; true if it succeeded.
fn as_user(id: u32, cmd: &[&str]) -> bool {
    Command::new("setpriv")
        .arg(format!("--reuid={id}"))
        .arg(format!("--regid={id}"))
        .args(["--clear-groups", "--"])
        .args(cmd)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("setpriv (util-linux)")
        .success()
}

#[test]
fn a_vmm_of_the_group_only_reads_the_drives_and_they_outlive_the_server() {
    if guest().is_none() {
        return;
    }
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    build_image(&store, "vmg:v1", &[("f.txt", b"group file\n".to_vec())]);
    let nogroup = 65534;
    let mut d = Daemon::start(&store, &["--no-prefetch", "--group", &nogroup.to_string()]);
    // The test's state directory (a private temporary directory) must be traversable, as
    // /var/lib/strata is.
    let open = |p: &Path| {
        std::fs::set_permissions(p, std::os::unix::fs::PermissionsExt::from_mode(0o711))
            .expect("chmod")
    };
    open(d.state.path());
    let work = scratch("vm");
    open(work.path());
    let dir = vm(
        &d,
        "vmg:v1",
        "g1",
        &work.path().join("g1"),
        &["cat", "/data/f.txt"],
    );
    open(&dir);
    let desc = json(&std::fs::read_to_string(dir.join("vm.json")).expect("vm.json"));
    let drives: Vec<String> = desc["drives"]
        .as_array()
        .expect("drives")
        .iter()
        .map(|d| d["path"].as_str().expect("path").to_string())
        .collect();
    for p in &drives {
        assert!(
            as_user(nogroup, &["head", "-c", "1", p]),
            "the group reads {p}"
        );
        assert!(
            !as_user(4242, &["head", "-c", "1", p]),
            "another user cannot read {p}"
        );
    }
    // The server dies; its successor serves the VM's drives (metadata and blobs) as before.
    let old = d.server_pid();
    // SAFETY: killing the server this test's daemon started.
    unsafe { libc::kill(old as i32, libc::SIGKILL) };
    d.wait_new_server(old);
    assert_eq!(sandbox(&d, "g1")["state"], "running");
    // A VMM running as the group's user boots from them.
    let mut c = Command::new("setpriv");
    c.args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(dir.join("qemu.sh"))
        .env("STRATA_VM_ACCEL", accel());
    let (code, console) = Vm::spawn(c).finish(BOOT);
    assert_eq!(code, 0, "{console}");
    assert!(console.contains("group file"), "{console}");
    // After the whole node died the VM's drives are gone with the FUSE connection: stopped.
    d.kill_all();
    d.start_again(&["--no-prefetch", "--group", &nogroup.to_string()]);
    assert_eq!(sandbox(&d, "g1")["state"], "stopped");
    d.ok(&["rm", "g1"]);
}

#[test]
fn an_image_with_more_layers_than_drives_runs_flattened() {
    if guest().is_none() {
        return;
    }
    let sdir = scratch("store");
    let store = StoreEnv::local(sdir.path());
    build_image(&store, "many:base", &[]);
    let mut layers = vec![
        json(&store.ok(&["inspect", "many:base", "--json"]))["layers"][0]["digest"]
            .as_str()
            .expect("digest")
            .to_string(),
    ];
    for i in 0..12 {
        let src = scratch("layer");
        std::fs::create_dir_all(src.path().join("data")).expect("mkdir");
        std::fs::write(
            src.path().join(format!("data/l{i}.bin")),
            random_bytes(16 << 10, 100 + i),
        )
        .expect("write");
        layers.push(store.ok(&[
            "build",
            src.path().to_str().expect("utf8"),
            "--kind",
            "toolkit",
        ]));
    }
    let mut args = vec!["compose", "--base", &layers[0]];
    for l in &layers[1..] {
        args.extend(["--toolkit", l.as_str()]);
    }
    args.extend(["-t", "many:v1"]);
    store.ok(&args);
    let d = Daemon::start(&store, &["--no-prefetch"]);
    let work = scratch("vm");
    let dir = vm(
        &d,
        "many:v1",
        "m1",
        &work.path().join("m1"),
        &["sh", "-c", "ls /data | wc -l; md5sum /data/l11.bin"],
    );
    let desc = json(&std::fs::read_to_string(dir.join("vm.json")).expect("vm.json"));
    assert_eq!(
        desc["layers"].as_array().map(Vec::len),
        Some(1),
        "flattened: {desc}"
    );
    let (code, console) = run(&dir);
    assert_eq!(code, 0, "{console}");
    assert!(console.lines().any(|l| l.trim() == "12"), "{console}");
    d.ok(&["rm", "m1"]);
}

#[test]
fn the_store_cut_while_a_vm_runs_gives_io_errors_within_the_deadline() {
    if guest().is_none() {
        return;
    }
    let Some(s3) = S3Server::start("vmcut") else {
        return;
    };
    let proxy = Proxy::start(s3.port);
    let store = s3.store_via("vmcut", "p", proxy.port);
    build_image(
        &store,
        "cut:v1",
        &[
            ("a.bin", random_bytes(4 << 20, 1)),
            ("b.bin", random_bytes(4 << 20, 2)),
        ],
    );
    let deadline = 3.0;
    let d = Daemon::start(
        &store,
        &[
            "--read-timeout",
            "3",
            "--no-prefetch",
            "--max-fetch-span",
            "1",
        ],
    );
    let work = scratch("vm");
    // a.bin is read (and cached), then, once the store is cut, b.bin (never read) and a.bin again with
    // the guest's caches dropped (served from the chunk cache).
    let script = "md5sum /data/a.bin; echo ready; sleep 3; echo reading; md5sum /data/b.bin; echo b=$?; sync; echo 3 > /proc/sys/vm/drop_caches; \
        md5sum /data/a.bin; echo a=$?";
    let dir = vm(
        &d,
        "cut:v1",
        "cut",
        &work.path().join("cut"),
        &["sh", "-c", script],
    );
    let v = Vm::start(&dir);
    assert!(v.wait_for("ready", BOOT).is_some(), "{}", v.console());
    proxy.set_silent(true);
    let reading = v.wait_for("reading", Duration::from_secs(60));
    assert!(reading.is_some(), "{}", v.console());
    let failed = v.wait_for("b=", Duration::from_secs(120));
    let console = v.console();
    let took = failed.zip(reading).map(|(f, r)| f - r);
    eprintln!("uncached read with the store cut failed after {took:?}:\n{console}");
    let took = took.expect("the guest's read of b.bin ended");
    assert!(console.contains("b=1"), "b.bin read failed: {console}");
    assert!(
        took.as_secs_f64() < 2.0 * deadline + 10.0,
        "the guest's failing read took {took:?} with a read deadline of {deadline} s"
    );
    let (code, console) = v.finish(Duration::from_secs(120));
    assert_eq!(code, 0, "{console}");
    let md5 = |name: &str| {
        console
            .lines()
            .filter(|l| l.ends_with(name))
            .map(|l| l.split_whitespace().next().unwrap_or_default().to_string())
            .collect::<Vec<_>>()
    };
    let a = md5("/data/a.bin");
    assert_eq!(a.len(), 2, "{console}");
    assert_eq!(a[0], a[1], "cached blocks still read right: {console}");
    assert!(console.contains("a=0"), "{console}");
    proxy.set_silent(false);
    d.ok(&["rm", "cut"]);
}

//! Proof on a stock kernel: Debian 12's own cloud kernel (6.1, the `linux-image-cloud-amd64` package
//! scripts/vm-guest fetches) booted in QEMU's microvm (TCG where KVM does not boot guests), with an
//! initramfs of busybox, that kernel's modules (virtio, EROFS, overlayfs, FUSE, loop) and
//! tests/stock-kernel/init, and one ext4 drive holding strata's binaries (debug info stripped) with the
//! shared libraries they need, a file:// store, and tests/stock-kernel/run.sh. Inside, stratad must pick
//! `loop`; an image of a tricky tree (long and non-UTF-8 names, hard links, xattrs, devices, sparse and
//! empty files; an upper layer with whiteouts and an opaque directory) must list and read identical to
//! the tree it stands for (the `treelist` program run on both sides); reads of the whole tree must
//! go on without error or hang while the server is killed with SIGKILL; `fuse` mode forced must do the
//! same (its per-layer connections kept by the holder, requests a killed server left answered from their
//! journals); and `scripts/demo-run` — the body of `scripts/demo` after it set the machine up and built
//! strata, run as it is: a busybox root built into the default store, mounted by a stratad with the
//! default configuration (which must pick `loop`), and its bubblewrap line run in it (the init first
//! moves the guest from its initramfs to a tmpfs root, which pivot_root accepts) — must work.
//! The guest's cold-read figures (loop, fuse, kernel EROFS on a materialized copy) are printed.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use strata_tests::vm::{accel, Vm};
use strata_tests::*;

/// How long the guest may take from boot to its last line (TCG on a busy 2-core host).
const DEADLINE: Duration = Duration::from_secs(360);
/// The mtime of everything the upper layer writes.
const UPPER_MTIME: i64 = 1_700_000_000;

/// The stock kernel and this tier's initramfs, or `None` when the test must skip.
fn stock_guest() -> Option<(PathBuf, PathBuf)> {
    if !have(&[Need::Mount, Need::Qemu, Need::Bwrap]) {
        return None;
    }
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = PathBuf::from("/var/tmp/strata-tests/stock-guest");
    let o = Command::new(here.join("../scripts/vm-guest"))
        .arg("--out")
        .arg(&out)
        .arg("--cache")
        .arg("/var/tmp/strata-tests/vm-guest-cache")
        .arg("--init")
        .arg(here.join("stock-kernel/init"))
        .args(["--module", "fs/fuse/fuse", "--module", "drivers/block/loop"])
        .output()
        .expect("run scripts/vm-guest");
    let built = require(
        "Debian 12's stock kernel (scripts/vm-guest: apt-get download of linux-image-cloud-amd64)",
        o.status.success(),
    );
    if !built {
        eprintln!("scripts/vm-guest: {}", String::from_utf8_lossy(&o.stderr));
        return None;
    }
    Some((out.join("vmlinuz"), out.join("initrd.img")))
}

fn run(c: &mut Command) -> String {
    let o = c.output().expect("run");
    assert!(
        o.status.success(),
        "{c:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The upper layer as a tar (whiteouts of a file and of a directory, an opaque directory, new and
/// replaced files, its directories with the base's owners and modes), applied to `expected` (a copy of
/// the base) as overlayfs will show it.
fn upper_layer(base: &Path, expected: &Path, tar: &Path) {
    let dirs = ["etc", "usr", "usr/share", "usr/share/doc", "deep"];
    let mut adds = String::new();
    for d in dirs {
        let m = std::fs::metadata(base.join(d)).expect("dir");
        adds += &format!(
            "    add('./{d}/', type=tarfile.DIRTYPE, mode={}, uid={}, gid={})\n",
            m.mode() & 0o7777,
            m.uid(),
            m.gid()
        );
    }
    let files: [(&str, Vec<u8>, u32, u32); 4] = [
        ("etc/added", b"added above\n".to_vec(), 0o600, 1234),
        ("etc/small.conf", vec![b'y'; 5000], 0o644, 0),
        ("etc/empty-added", Vec::new(), 0o644, 0),
        (
            "deep/new",
            b"under an opaque directory\n".to_vec(),
            0o640,
            0,
        ),
    ];
    for (name, data, mode, uid) in &files {
        adds += &format!("    add('./{name}', {data:?}, mode={mode}, uid={uid}, gid={uid})\n");
    }
    let py = format!(
        r#"
import tarfile, io
with tarfile.open({tar:?}, "w", format=tarfile.PAX_FORMAT) as tf:
    def add(name, data=b"", **kw):
        ti = tarfile.TarInfo(name)
        ti.mtime = {UPPER_MTIME}
        for k, v in kw.items(): setattr(ti, k, v)
        ti.size = len(data) if ti.type == tarfile.REGTYPE else 0
        tf.addfile(ti, io.BytesIO(bytes(data)) if ti.type == tarfile.REGTYPE else None)
    add('./usr/share/doc/.wh.file00.txt')
    add('./.wh.many')
    add('./deep/.wh..wh..opq')
{adds}"#,
        tar = tar.display().to_string(),
    );
    run(Command::new("python3").args(["-c", &py]));
    // The same changes to the copy.
    run(Command::new("cp").arg("-a").arg(base).arg(expected));
    std::fs::remove_file(expected.join("usr/share/doc/file00.txt")).expect("rm");
    std::fs::remove_dir_all(expected.join("many")).expect("rm many");
    std::fs::remove_dir_all(expected.join("deep/d0")).expect("rm deep");
    xattr::remove(expected.join("etc"), "user.dir").expect("drop etc's xattr");
    for (name, data, mode, uid) in &files {
        let p = expected.join(name);
        let _ = std::fs::remove_file(&p);
        std::fs::write(&p, data).expect("write");
        std::os::unix::fs::chown(&p, Some(*uid), Some(*uid)).expect("chown");
        std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(*mode))
            .expect("chmod");
        set_mtime(&p, UPPER_MTIME, 0);
    }
    for d in dirs {
        set_mtime(&expected.join(d), UPPER_MTIME, 0);
    }
}

/// Copies `bin` without its debug info to `dir/name`, and the shared libraries it loads (its loader
/// too) to `lib`.
fn install_binary(bin: &Path, dir: &Path, name: &str, lib: &Path) {
    run(Command::new("objcopy")
        .arg("--strip-debug")
        .arg(bin)
        .arg(dir.join(name)));
    for line in run(Command::new("ldd").arg(bin)).lines() {
        let path = match line.split_once("=>") {
            Some((_, right)) => right.split_whitespace().next().unwrap_or(""),
            None => line.split_whitespace().next().unwrap_or(""),
        };
        if path.starts_with('/') {
            let file = Path::new(path).file_name().expect("library name");
            std::fs::copy(path, lib.join(file)).expect("copy library");
        }
    }
}

/// The data drive's tree in `data`: binaries, libraries, the store with image `stock:v1`, the expected
/// listing, the materialized base layer, run.sh.
fn data_tree(work: &Path, data: &Path) {
    let (base, expected, tar) = (
        work.join("base"),
        work.join("expected"),
        work.join("upper.tar"),
    );
    generate_tree(&base);
    std::fs::create_dir_all(base.join("bench")).expect("mkdir");
    std::fs::write(base.join("bench/random-16m"), random_bytes(16 << 20, 61)).expect("bench");
    std::fs::write(base.join("bench/random-4m"), random_bytes(4 << 20, 62)).expect("bench");
    upper_layer(&base, &expected, &tar);

    let store = StoreEnv::local(&data.join("store"));
    let lower = store.ok(&["build", base.to_str().expect("utf8")]);
    let upper = json(&store.ok(&[
        "build",
        "--tar",
        tar.to_str().expect("utf8"),
        "--kind",
        "toolkit",
        "--json",
    ]));
    let upper = upper["digest"].as_str().expect("digest");
    store.ok(&[
        "compose",
        "--base",
        &lower,
        "--toolkit",
        upper,
        "-t",
        "stock:v1",
    ]);
    store.ok(&[
        "materialize",
        &lower,
        data.join("materialized").to_str().expect("utf8"),
    ]);
    std::fs::write(data.join("image"), "stock:v1\n").expect("image");

    let (bin, lib) = (data.join("bin"), data.join("lib"));
    std::fs::create_dir_all(&bin).expect("mkdir");
    std::fs::create_dir_all(&lib).expect("mkdir");
    let treelist = Path::new(env!("CARGO_BIN_EXE_treelist"));
    install_binary(&stratad_bin(), &bin, "stratad", &lib);
    install_binary(&strata_bin(), &bin, "strata", &lib);
    install_binary(&strata_full_bin(), &bin, "strata-full", &lib);
    install_binary(treelist, &bin, "treelist", &lib);
    // scripts/demo runs its command with bubblewrap; so does the guest.
    install_binary(Path::new("/usr/bin/bwrap"), &bin, "bwrap", &lib);
    let listing = run(Command::new(treelist).arg(&expected));
    std::fs::write(data.join("expected.txt"), listing).expect("listing");
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    std::fs::copy(here.join("stock-kernel/run.sh"), data.join("run.sh")).expect("run.sh");
    // scripts/demo's body, run as it is (POSIX sh: the guest's shell is busybox's).
    std::fs::copy(here.join("../scripts/demo-run"), data.join("demo-run")).expect("demo-run");
}

/// An ext4 image of `data` with room for the state directories (chunk caches, layer metadata).
fn ext4_image(data: &Path, img: &Path) {
    let used: u64 = walkdir::WalkDir::new(data)
        .into_iter()
        .filter_map(|e| e.ok()?.metadata().ok())
        .map(|m| m.blocks() * 512)
        .sum();
    let size = used * 3 + (512 << 20);
    std::fs::File::create(img)
        .and_then(|f| f.set_len(size))
        .expect("image file");
    run(Command::new("mkfs.ext4")
        .args(["-q", "-F", "-E", "root_owner=0:0", "-d"])
        .arg(data)
        .arg(img));
}

/// The host CPU's clock in kHz (the first `cpu MHz` of /proc/cpuinfo).
fn host_khz() -> u64 {
    let info = std::fs::read_to_string("/proc/cpuinfo").expect("/proc/cpuinfo");
    info.lines()
        .find_map(|l| {
            l.strip_prefix("cpu MHz")?
                .split(':')
                .nth(1)?
                .trim()
                .parse::<f64>()
                .ok()
        })
        .map_or(2_000_000, |mhz| (mhz * 1000.0) as u64)
}

#[test]
fn debian_12_stock_kernel_runs_stratad_in_loop_mode_through_kill_9() {
    let Some((kernel, initrd)) = stock_guest() else {
        return;
    };
    let start = Instant::now();
    let work = scratch("stock-kernel");
    let data = work.path().join("data");
    data_tree(work.path(), &data);
    let img = work.path().join("data.img");
    ext4_image(&data, &img);
    let prepared = start.elapsed();

    let a = accel();
    let mut cmdline = "console=ttyS0 reboot=t panic=-1 quiet".to_string();
    if a == "tcg" {
        // Under TCG the guest has no clock to calibrate its TSC against (microvm has no HPET): it
        // hangs in early boot unless told the rate, as `strata vm`'s qemu.sh does.
        cmdline += &format!(" tsc_early_khz={}", host_khz());
    }
    let mut c = Command::new("qemu-system-x86_64");
    c.args(["-M", "microvm,x-option-roms=off,isa-serial=on,rtc=on"])
        .args(["-accel", a, "-cpu", if a == "kvm" { "host" } else { "max" }])
        .args(["-m", "1024", "-smp", "2", "-nodefaults", "-no-user-config"])
        .args(["-display", "none", "-serial", "stdio", "-no-reboot"])
        .arg("-kernel")
        .arg(&kernel)
        .arg("-initrd")
        .arg(&initrd)
        .args(["-append", &cmdline])
        .arg("-drive")
        .arg(format!(
            "id=data,file={},format=raw,if=none,cache=unsafe",
            img.display().to_string().replace(',', ",,")
        ))
        .args(["-device", "virtio-blk-device,drive=data,serial=data"]);
    let vm = Vm::spawn(c);
    let (code, console) = vm.finish(DEADLINE);
    for line in console.lines().filter(|l| l.starts_with("strata-61:")) {
        eprintln!("{line}");
    }
    eprintln!(
        "stock-kernel tier ({a}): {:.0} s to prepare, {:.0} s in the guest",
        prepared.as_secs_f64(),
        (start.elapsed() - prepared).as_secs_f64()
    );
    let tail: Vec<&str> = console.lines().rev().take(60).collect();
    let tail = tail.into_iter().rev().collect::<Vec<_>>().join("\n");
    let fails: Vec<&str> = console
        .lines()
        .filter(|l| l.starts_with("strata-61: FAIL"))
        .collect();
    assert!(
        code == 0 && console.contains("strata-61: PASS"),
        "the guest ended with {code}:\n{}\n\nconsole tail:\n{tail}",
        fails.join("\n")
    );
}

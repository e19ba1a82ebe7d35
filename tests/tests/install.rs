//! The install recipe (`scripts/install`): binaries, the systemd unit and the example configuration land
//! where the unit expects them, an existing configuration is kept, the installed configuration parses in
//! the installed stratad (`--check` reads it), and the unit passes `systemd-analyze verify` where systemd
//! is installed.

use std::path::Path;
use std::process::Command;

use strata_tests::*;

/// A fake release directory holding the test builds under the release names.
fn release_dir(target: &Path) {
    let rel = target.join("release");
    std::fs::create_dir_all(&rel).expect("mkdir");
    let bins = [
        (stratad_bin(), "stratad"),
        (strata_bin(), "strata"),
        (strata_full_bin(), "strata-full"),
        (pack_diff_bin(), "pack_diff"),
        (
            strata_tests::containerd::snapshotter_bin(),
            "strata-snapshotter",
        ),
    ];
    for (from, name) in bins {
        std::fs::copy(from, rel.join(name)).expect("copy binary");
    }
}

fn install(target: &Path, dest: &Path) -> std::process::Output {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/install");
    Command::new(script)
        .args(["--no-build", "--prefix", "/usr/local", "--destdir"])
        .arg(dest)
        .env("CARGO_TARGET_DIR", target)
        .output()
        .expect("scripts/install")
}

#[test]
fn the_install_recipe_puts_a_startable_service_in_place() {
    let t = scratch("install");
    let (target, dest) = (t.path().join("target"), t.path().join("root"));
    release_dir(&target);
    let out = install(&target, &dest);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for b in [
        "strata",
        "strata-full",
        "stratad",
        "pack_diff",
        "strata-snapshotter",
    ] {
        assert!(dest.join("usr/local/bin").join(b).is_file(), "{b} missing");
    }
    // Installed without their debug information (the line tables made stratad 91 MB), still runnable
    // (below). Section names by binutils' readelf, which the install's `strip` comes with.
    let debug_info = |bin: &Path| {
        let o = Command::new("readelf")
            .args(["-S", "--wide"])
            .arg(bin)
            .output()
            .expect("readelf");
        assert!(o.status.success(), "readelf {}", bin.display());
        String::from_utf8_lossy(&o.stdout).contains(" .debug_info ")
    };
    assert!(debug_info(&target.join("release/stratad")));
    assert!(!debug_info(&dest.join("usr/local/bin/stratad")));
    // Man pages and completions come from the installed strata's own definitions.
    let share = dest.join("usr/local/share");
    for page in [
        "man/man1/strata.1",
        "man/man1/strata-build.1",
        "man/man1/strata-daemon-upgrade.1",
        "man/man1/pack_diff.1",
        "man/man8/stratad.8",
        "bash-completion/completions/strata",
        "zsh/site-functions/_strata",
        "fish/vendor_completions.d/strata.fish",
    ] {
        let text = std::fs::read_to_string(share.join(page)).unwrap_or_default();
        assert!(
            text.contains("strata") || text.contains("pack_diff"),
            "{page} missing or empty"
        );
    }
    let unit =
        std::fs::read_to_string(dest.join("etc/systemd/system/stratad.service")).expect("unit");
    assert!(
        unit.contains("ExecStart=/usr/local/bin/stratad\n"),
        "{unit}"
    );
    let conf = dest.join("etc/strata/stratad.toml");
    // The installed stratad reads the installed configuration.
    let o = Command::new(dest.join("usr/local/bin/stratad"))
        .arg("--config")
        .arg(&conf)
        .args(["--check", "--json", "--state-dir"])
        .arg(t.path().join("state"))
        .output()
        .expect("stratad --check");
    let report = String::from_utf8_lossy(&o.stdout);
    assert!(
        !String::from_utf8_lossy(&o.stderr).contains("config"),
        "the shipped config did not parse: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(report.contains("\"mode\""), "{report}");
    // A second install keeps the operator's configuration.
    std::fs::write(&conf, "cache_size = \"1G\"\n").expect("edit");
    let out = install(&target, &dest);
    assert!(out.status.success());
    assert_eq!(
        std::fs::read_to_string(&conf).expect("conf"),
        "cache_size = \"1G\"\n"
    );
    assert!(conf.with_extension("toml.dist").is_file());
    let have_systemd = Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if have_systemd {
        // Verified as installed, its ExecStart pointed at the staged binary (the real path is not
        // there on this machine). systemd < 254 does not know FileDescriptorStorePreserve (the unit
        // says so): that warning is expected.
        let staged = t.path().join("stratad.service");
        let bin = dest.join("usr/local/bin/stratad");
        std::fs::write(
            &staged,
            unit.replace("/usr/local/bin/stratad", bin.to_str().expect("utf8")),
        )
        .expect("stage");
        let o = Command::new("systemd-analyze")
            .args(["verify", "--man=no"])
            .arg(&staged)
            .output()
            .expect("systemd-analyze");
        let err = String::from_utf8_lossy(&o.stderr);
        let problems: Vec<&str> = err
            .lines()
            .filter(|l| l.contains("stratad.service") && !l.contains("FileDescriptorStorePreserve"))
            .collect();
        assert!(problems.is_empty(), "{err}");
    } else {
        eprintln!("systemd-analyze not installed: the unit is checked by content only");
    }
}

//! stratad as operators run it: a missing `--config` file is an error, `GET /healthz` answers, logs
//! carry no colour codes when standard error is not a terminal.

use strata_tests::*;

#[test]
fn stratad_with_a_missing_config_file_names_it() {
    let o = std::process::Command::new(stratad_bin())
        .args(["--config", "/nonexistent/stratad.toml"])
        .output()
        .expect("stratad");
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("/nonexistent/stratad.toml"), "{err}");
}

#[test]
fn healthz_answers_and_logs_have_no_colour_codes_off_a_terminal() {
    if !can_mount() {
        return;
    }
    let sdir = scratch("store");
    let state = scratch("state");
    let run = state.path().join("run");
    let mut child = std::process::Command::new(stratad_bin())
        .args(["--config", "/dev/null", "--store"])
        .arg(format!("file://{}", sdir.path().display()))
        .arg("--state-dir")
        .arg(state.path())
        .arg("--runtime-dir")
        .arg(&run)
        .env("STRATA_LOG", "info")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("stratad");
    let socket = run.join("stratad.sock");
    let client = strata_api::Client {
        socket: socket.clone(),
    };
    let start = std::time::Instant::now();
    while !socket.exists() && start.elapsed().as_secs() < 30 {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // The socket file appears at bind, just before the daemon listens.
    std::thread::sleep(std::time::Duration::from_millis(100));
    let health = client.call("GET", "/healthz", None);
    // Stopped before any assertion, so that a failure leaves no daemon or mount behind.
    // SAFETY: a signal to our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let mut err = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().expect("stderr"), &mut err).expect("read");
    child.wait().expect("wait");
    let health = health.expect("GET /healthz");
    assert_eq!(health.as_str().map(str::trim), Some("ok"));
    assert!(err.contains("stratad ready"), "{err}");
    assert!(
        !err.contains('\x1b'),
        "colour codes in a log that is not a terminal: {err:?}"
    );
}

//! The control plane: what is mounted where, for whom, and the node's record of it.
//!
//! The [`daemon`] owns the node: its configuration ([`config`]), the store, the chunk cache and fetcher it hands to
//! the data plane, and the node state ([`state`]) — sandboxes and layer mounts on disk, so a successor
//! serving the same FUSE connection, or a daemon restarted after the node died, knows every sandbox.
//! On top of it: [`acquire`] (layers fetched once each and side by side, then mounted), [`sandboxes`]
//! (an overlay of an image's layers per sandbox), [`teardown`] (stopping
//! and removing many at once), [`layers`] (layer mounts alone, under named holds: what a containerd
//! snapshotter uses), [`vm`] (the same layers served to microVMs as drive files), [`perms`] (who may
//! reach the socket and the blob files), [`fetched`] (bytes fetched per sandbox, kept in its record).
//! How a layer is mounted is [`modes`]' choice, probed from the kernel at start: kernel EROFS over the
//! blob files (`file`), over loop devices of them ([`loops`]: `loop`), or the layer's tree served over
//! FUSE ([`trees`]: `fuse`, its connections kept across server restarts), or over local view files the
//! kernel asks the daemon to fill ([`views`]: `fanotify`). [`api`] is the HTTP adapter
//! on the control socket: it parses requests, calls the daemon, and answers with the status of the
//! error's kind (`strata_api::ErrorKind`); each connection is served by the thread that accepted it
//! ([`acceptors`]).
//!
//! The dependency runs one way: these modules call into the data plane (`crate::blobfs`,
//! `crate::treefs`, `crate::fetch`, `crate::cache`, `crate::mount`, ...); the data plane never names
//! anything here. The test below reads the sources to keep it so.

pub mod acceptors;
pub mod acquire;
pub mod api;
pub mod config;
pub mod daemon;
pub mod fetched;
pub(crate) mod flights;
pub mod layers;
pub mod loops;
pub mod modes;
pub mod perms;
pub mod pool;
pub mod sandboxes;
pub mod single;
pub mod state;
pub mod teardown;
pub mod trees;
pub mod views;
pub mod vm;

#[cfg(test)]
mod tests {
    /// Every source file outside `control/` is data plane: none may use the control plane (doc
    /// comments may mention it).
    #[test]
    fn the_data_plane_never_calls_up() {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut stack = vec![src.clone()];
        let mut checked = 0;
        while let Some(dir) = stack.pop() {
            for e in std::fs::read_dir(&dir).expect("read src") {
                let path = e.expect("entry").path();
                if path.is_dir() {
                    if path != src.join("control") {
                        stack.push(path);
                    }
                    continue;
                }
                if path.extension().is_none_or(|x| x != "rs") || path == src.join("lib.rs") {
                    continue;
                }
                let text = std::fs::read_to_string(&path).expect("read source");
                for (n, line) in text.lines().enumerate() {
                    let code = line.split("//").next().unwrap_or("");
                    assert!(
                        !code.contains("crate::control") && !code.contains("super::control"),
                        "{}:{}: the data plane calls the control plane: {line}",
                        path.display(),
                        n + 1
                    );
                }
                checked += 1;
            }
        }
        assert!(checked > 20, "only {checked} data-plane files found");
    }
}

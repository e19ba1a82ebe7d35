//! The node daemon's configuration: `stratad`'s options and its TOML file (`docs/DAEMON.md`), with
//! the defaults a node gets when it says nothing — some chosen per store (the fetch span: a local
//! directory costs no round trip, a network store does).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::control::modes::ModeRequest;

/// How the daemon runs.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Store URL (`file:///…` or `s3://bucket/prefix`).
    pub store: String,
    /// Persistent state: layer metadata, chunk cache, sandbox upper directories.
    pub state_dir: PathBuf,
    /// Mount points and the control socket.
    pub runtime_dir: PathBuf,
    /// Chunk cache bound in bytes.
    #[serde(deserialize_with = "crate::size::deserialize")]
    pub cache_size: u64,
    /// A read that cannot complete within this many seconds fails with EIO.
    pub read_timeout_secs: f64,
    /// Any other store operation (a tag, manifest, layer descriptor or metadata read, a listing, a
    /// write) fails after this many seconds, and the request that needed it with it.
    pub store_timeout_secs: f64,
    /// Largest compressed span a miss fetches (its chunk, then the missing chunks after it, in a
    /// parallel request). `None`: [`default_fetch_span`] for the store.
    #[serde(deserialize_with = "crate::size::deserialize_opt")]
    pub max_fetch_span: Option<u64>,
    /// Compressed bytes before a miss fetched with it in the background (0: none). `None`:
    /// [`default_fetch_behind`] for the store.
    #[serde(deserialize_with = "crate::size::deserialize_opt")]
    pub max_fetch_behind: Option<u64>,
    /// Compressed bytes of a miss's directory group (its directory's small files, see
    /// [`crate::groups`]) fetched with it in the background (0: none, the default).
    #[serde(deserialize_with = "crate::size::deserialize")]
    pub max_fetch_group: u64,
    /// Compressed bytes of a blob walked after a miss by a thread at the lowest priority, fetching
    /// the chunks not cached (0: none; see `strata_fs::fetch`'s streamer). `None`:
    /// [`default_fetch_stream`] for the store.
    #[serde(deserialize_with = "crate::size::deserialize_opt")]
    pub max_fetch_stream: Option<u64>,
    /// FUSE worker threads.
    pub fuse_threads: usize,
    /// A group (gid) allowed to use the control socket and read the blob files, besides root.
    pub group: Option<u32>,
    /// Warm an image's prefetch plan (if it has one) when a sandbox of it is created.
    pub prefetch: bool,
    /// Concurrent prefetch requests (default: 4 from a `file://` store, where they cost CPU; 32 over a
    /// network, where each costs a round trip).
    pub prefetch_threads: Option<usize>,
    /// Prefetch bandwidth cap in bytes per second (0: none).
    #[serde(deserialize_with = "crate::size::deserialize")]
    pub prefetch_rate: u64,
    /// Bound of the metadata kept on disk for layers no longer mounted (least recently used go first).
    #[serde(deserialize_with = "crate::size::deserialize")]
    pub metadata_cache_size: u64,
    /// Record the chunks read in this many seconds after a sandbox of an image without a prefetch plan
    /// is requested, and store them as its plan (0: never). Needs write access to the store.
    pub record_plans_secs: f64,
    /// How layers are mounted: `auto` (probe the kernel, take the fastest mode that works) or one mode
    /// forced (see [`crate::control::modes`]).
    pub mount_mode: ModeRequest,
    /// In `loop` mode, bind loop devices with direct I/O (see [`crate::control::loops::Loops::new`]).
    pub loop_direct_io: bool,
    /// Check the cached data at rest (chunk cache, `fanotify` view files) this often, in seconds
    /// (0: never; see `Daemon::scrub`).
    pub scrub_interval_secs: f64,
    /// `fanotify` mode: how long a view file's chunk marked for eviction waits before it is punched
    /// out (reads allowed before the mark have had this long to read it; see `fanotify::evict`).
    pub view_evict_grace_secs: f64,
    /// `fanotify` mode: the view files' reserve, given up to fills that find their disk full (at most
    /// 1/16 of the disk; 0: none; see `fanotify::room`).
    pub view_reserve_bytes: u64,
    /// `fanotify` mode: the share of the view files' disk, in percent, that eviction keeps free of
    /// them when other data grows (0: bounded by `cache_size` alone).
    pub view_keep_free_percent: f64,
    /// `fanotify` mode: the event loop keeps to the CPU of the readers it answers (see
    /// `fanotify::follow`).
    pub fanotify_follow_readers: bool,
    /// Sandboxes kept made ahead per image with running sandboxes, for creates to take (0: none;
    /// see [`crate::control::pool`]).
    pub sandbox_pool: usize,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            store: strata_registry::store::DEFAULT_STORE.to_string(),
            state_dir: PathBuf::from("/var/lib/strata"),
            runtime_dir: PathBuf::from("/run/strata"),
            cache_size: 10 << 30,
            read_timeout_secs: 30.0,
            store_timeout_secs: 60.0,
            max_fetch_span: None,
            max_fetch_behind: None,
            max_fetch_group: 0,
            max_fetch_stream: None,
            fuse_threads: 8,
            group: None,
            prefetch: true,
            prefetch_threads: None,
            prefetch_rate: 256 << 20,
            metadata_cache_size: 4 << 30,
            record_plans_secs: 0.0,
            mount_mode: ModeRequest::Auto,
            loop_direct_io: true,
            scrub_interval_secs: 86_400.0,
            view_evict_grace_secs: 30.0,
            view_reserve_bytes: crate::fanotify::room::RESERVE,
            view_keep_free_percent: crate::fanotify::room::KEEP_FREE_PERCENT,
            fanotify_follow_readers: true,
            sandbox_pool: 0,
        }
    }
}

/// The fetch span for a store when none is configured. Over a network (`s3://`, `http(s)://`) every
/// miss costs a round trip, and 2 MiB is where the slow-link benchmark's time stops falling (4 MiB: same
/// time, 38 % more bytes). A local directory (`file://`) costs no round trip, so fetching ahead only
/// spends CPU on chunks that may never be read: 256 KiB (local cold import 1.03 s against 1.59 s with
/// 2 MiB). See BENCHMARKS.md, "Node daemon".
pub fn default_fetch_span(store: &str) -> u64 {
    match is_local_store(store) {
        true => 256 << 10,
        false => 2 << 20,
    }
}

/// What a miss fetches behind it when nothing is configured. Over a network, 1 MiB: programs read a
/// package's files and a library's pages in another order than the blob's, and each read behind a miss
/// would be another round trip (the fat image's cold import over the 20 ms / 1 Gbit/s link: 1.706 ->
/// 1.506 s, for 17 % more bytes over the link; 2 MiB: 1.489 s for 34 % more). From a local directory, none:
/// fetching there costs CPU, not round trips. See BENCHMARKS.md, "Eighth session".
pub fn default_fetch_behind(store: &str) -> u64 {
    match is_local_store(store) {
        true => 0,
        false => 1 << 20,
    }
}

/// Compressed bytes walked after a miss when the configuration does not say: 4 MiB from a `file://`
/// store, where fetching costs CPU the streamer takes at the lowest priority (the fat image's cold import
/// 0.705 → 0.605 s, median of 10; BENCHMARKS.md); none over a network, where it would cost bytes and
/// the link's bandwidth that misses need.
pub fn default_fetch_stream(store: &str) -> u64 {
    match is_local_store(store) {
        true => 4 << 20,
        false => 0,
    }
}

/// A `file://` store: no round trip per request, fetching costs CPU only.
pub(crate) fn is_local_store(store: &str) -> bool {
    store.starts_with("file://")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fetch_defaults_follow_the_store() {
        assert_eq!(
            default_fetch_span("file:///var/lib/strata/store"),
            256 << 10
        );
        assert_eq!(default_fetch_span("s3://bucket/prefix"), 2 << 20);
        assert_eq!(default_fetch_behind("file:///mnt/cephfs/store"), 0);
        assert_eq!(default_fetch_behind("s3://bucket/prefix"), 1 << 20);
        assert_eq!(
            default_fetch_stream("file:///var/lib/strata/store"),
            4 << 20
        );
        assert_eq!(default_fetch_stream("s3://bucket/prefix"), 0);
        let c = Config::default();
        assert_eq!((c.max_fetch_span, c.max_fetch_behind), (None, None));
    }
}

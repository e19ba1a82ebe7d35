//! The builder's fuzzing entries: hostile tars ([`tar`]), `docker save` archives ([`docker_archive`])
//! and the small text grammars of image sources and registry answers ([`oci_text`]) — what `fuzz/`'s
//! targets (cargo-fuzz) and the builder's stable smoke tests run on arbitrary bytes.
//!
//! A layer is built from tars a user or a registry hands over (`strata build -`, `strata import`), so
//! the contract is: whatever the bytes — plain, gzip or zstd; pax and GNU extensions; names, links and
//! whiteouts meant to escape or confuse — the build answers with a layer or a [`BuildError`], never a
//! panic. The entry runs the source into the same tree a build makes (files inline, no chunks
//! stored), writes that tree as an EROFS image and reads the image back whole.

use std::io::Read;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::BuildError;
use crate::source::{Entry, EntryKind, EntrySink, FileSource};
use crate::tree::{FileData, NodeKind, Tree};

/// Bytes of file data kept per input, across files (a compressed tar may expand without bound).
const MAX_DATA: u64 = 16 << 20;

/// The tree a build would make of the tar's entries; file bytes inline.
struct TreeSink {
    tree: Tree,
    data: u64,
}

impl EntrySink for TreeSink {
    fn add(&mut self, entry: Entry, data: Option<FileSource<'_>>) -> Result<(), BuildError> {
        let Entry { path, meta, kind } = entry;
        let node = match kind.plain_node() {
            Ok(node) => node,
            Err(EntryKind::File { .. }) => {
                let mut bytes = Vec::new();
                if let Some(FileSource::Stream(r)) = data {
                    let room = MAX_DATA.saturating_sub(self.data);
                    r.take(room)
                        .read_to_end(&mut bytes)
                        .map_err(|e| BuildError::io("tar member", e))?;
                    // The source checks that a member is as long as it says: drain the rest.
                    std::io::copy(r, &mut std::io::sink())
                        .map_err(|e| BuildError::io("tar member", e))?;
                }
                self.data += bytes.len() as u64;
                NodeKind::File {
                    size: bytes.len() as u64,
                    data: FileData::Inline(bytes),
                }
            }
            Err(EntryKind::HardLink(target)) => {
                self.tree.link(&path, &target)?;
                return Ok(());
            }
            Err(EntryKind::Opaque) => {
                self.tree.set_opaque(&path)?;
                return Ok(());
            }
            Err(_) => return Ok(()), // stored files come from parents, never from a tar
        };
        self.tree.insert(&path, meta, node)?;
        Ok(())
    }
}

/// Builds a tree of the tar `data` and writes and reads it back as an image (see the module
/// documentation); panics only on a bug.
pub fn tar(data: &[u8]) {
    let reader: Box<dyn Read + Send> = Box::new(std::io::Cursor::new(data.to_vec()));
    let Ok(stream) = crate::source::tar::open_stream(reader) else {
        return;
    };
    let mut sink = TreeSink {
        tree: Tree::new(),
        data: 0,
    };
    if crate::source::tar::read_tar(stream, &mut sink).is_err() {
        return;
    }
    let image = crate::erofs::write_image(&sink.tree, &[], 12, &|_| None);
    if let Ok(image) = image {
        strata_erofs::fuzzing::walk(&image);
        let img = crate::erofs::ErofsImage::parse(image).expect("a written image parses");
        img.any_xattrs().expect("a written image walks");
    }
}

/// Opens the `docker save` archive `data` as `strata import docker-archive:` does — its members
/// scanned, `manifest.json` and the config parsed and checked — then reads each layer it names (up to
/// the same bound as [`tar`]) and builds it as [`tar`] does. Errors are answers; a panic is a bug.
pub fn docker_archive(data: &[u8]) {
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let file = std::env::temp_dir().join(format!("strata-fuzz-{}-{n}.tar", std::process::id()));
    if std::fs::write(&file, data).is_err() {
        return;
    }
    let source = crate::oci::Source::DockerArchive {
        file: file.clone(),
        reference: None,
    };
    if let Ok(image) = crate::oci::open(&source, &crate::oci::Platform::host()) {
        for layer in &image.layers {
            let mut bytes = Vec::new();
            if let Ok(r) = layer.open() {
                if r.take(MAX_DATA).read_to_end(&mut bytes).is_ok() {
                    tar(&bytes);
                }
            }
        }
    }
    let _ = std::fs::remove_file(&file);
}

/// Parses `data` (as text) with each small grammar an import meets: an image source
/// (`oci:DIR[:REF]`, `docker-archive:`, `docker://HOST/REPO[:TAG|@DIGEST]`), a platform, a registry's
/// `WWW-Authenticate` challenge and `USER:PASSWORD` credentials.
pub fn oci_text(data: &[u8]) {
    use crate::oci::distribution::auth::{Challenge, Credentials};
    let text = String::from_utf8_lossy(data);
    let _ = crate::oci::Source::parse(&text);
    let _ = crate::oci::Platform::parse(&text);
    let _ = crate::oci::distribution::RegistryRef::parse(&text);
    if let Some(Challenge::Bearer { realm, .. }) = Challenge::parse(&text) {
        assert!(
            text.contains(realm.as_str()),
            "a realm comes from the header"
        );
    }
    let _ = Credentials::parse(&text);
}

#[cfg(test)]
mod tests {
    use sha2::{Digest, Sha256};

    fn member(b: &mut tar::Builder<Vec<u8>>, name: &str, data: &[u8]) {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_cksum();
        b.append_data(&mut h, name, data).expect("tar member");
    }

    /// A `docker save` archive of one layer, in the classic layout.
    fn archive() -> Vec<u8> {
        let mut layer = tar::Builder::new(Vec::new());
        member(&mut layer, "etc/hello", b"hello");
        let layer = layer.into_inner().expect("layer");
        let diff_id = format!("sha256:{:x}", Sha256::digest(&layer));
        let config = serde_json::json!({
            "architecture": crate::oci::Platform::host().architecture,
            "os": "linux",
            "config": {"Env": ["PATH=/bin"], "Cmd": ["/bin/sh"]},
            "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        })
        .to_string();
        let config_name = format!("{:x}.json", Sha256::digest(config.as_bytes()));
        let manifest = serde_json::json!([
            {"Config": config_name, "RepoTags": ["a:b"], "Layers": ["l1/layer.tar"]}
        ])
        .to_string();
        let mut b = tar::Builder::new(Vec::new());
        member(&mut b, "manifest.json", manifest.as_bytes());
        member(&mut b, &config_name, config.as_bytes());
        member(&mut b, "l1/layer.tar", &layer);
        b.into_inner().expect("archive")
    }

    /// The docker archive entry (also `fuzz/`'s `docker_archive` target) over mutations of a real
    /// archive, whose own import opens: errors, never a panic. Mutations fall mostly in the first
    /// members, where the manifest and config are.
    #[test]
    fn the_fuzzing_entries_survive_mutated_archives_and_text() {
        let seed = archive();
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("a.tar");
        std::fs::write(&file, &seed).expect("write");
        let source = crate::oci::Source::DockerArchive {
            file,
            reference: None,
        };
        let image =
            crate::oci::open(&source, &crate::oci::Platform::host()).expect("the seed opens");
        assert_eq!(image.layers.len(), 1);
        super::docker_archive(&seed);
        let mutations =
            strata_registry::testing::mutations(&seed, 0x9e37_79b9_7f4a_7c15, 1500, 4096);
        mutations.for_each(|m| super::docker_archive(&m));
        let texts = [
            &b"docker://registry.example:5000/a/b:v1"[..],
            b"docker-archive:/x.tar:repo:tag",
            b"oci:/l:ref",
            b"linux/arm64/v8",
            br#"Bearer realm="https://a/token",service="r",scope="repository:a:pull""#,
            b"user:pass:word",
        ];
        for t in texts {
            super::oci_text(t);
            strata_registry::testing::mutations(t, 7, 500, t.len())
                .for_each(|m| super::oci_text(&m));
        }
    }
}

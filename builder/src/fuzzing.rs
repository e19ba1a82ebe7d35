//! The builder's fuzzing entries: hostile tars ([`tar`]), `docker save` archives ([`docker_archive`]),
//! OCI image layouts ([`oci_layout`]) and the small text grammars of image sources and registry
//! answers ([`oci_text`]) — what `fuzz/`'s targets (cargo-fuzz) and the builder's stable smoke tests run
//! on arbitrary bytes.
//!
//! A layer is built from tars a user or a registry hands over (`strata build -`, `strata import`), so
//! the contract is: whatever the bytes — plain, gzip or zstd; pax and GNU extensions; names, links and
//! whiteouts meant to escape or confuse — the build answers with a layer or a [`BuildError`], never a
//! panic. The entry runs the source into the same tree a build makes (files inline, no chunks
//! stored), writes that tree as an EROFS image and reads the image back whole.

use std::io::Read;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::BuildError;
use crate::source::{DataEntry, Entry, EntrySink, FileSource};
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
        // Stored files come from parents, never from a tar.
        let Some(DataEntry::File { path, meta, .. }) = entry.place(&mut self.tree)? else {
            return Ok(());
        };
        let mut bytes = Vec::new();
        if let Some(FileSource::Stream(r)) = data {
            let room = MAX_DATA.saturating_sub(self.data);
            r.take(room)
                .read_to_end(&mut bytes)
                .map_err(|e| BuildError::io("tar member", e))?;
            // The source checks that a member is as long as it says: drain the rest.
            std::io::copy(r, &mut std::io::sink()).map_err(|e| BuildError::io("tar member", e))?;
        }
        self.data += bytes.len() as u64;
        let node = NodeKind::File {
            size: bytes.len() as u64,
            data: FileData::Inline(bytes),
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
    let file = scratch_path("tar");
    if std::fs::write(&file, data).is_err() {
        return;
    }
    let source = crate::oci::Source::DockerArchive {
        file: file.clone(),
        reference: None,
    };
    if let Ok(image) = crate::oci::open(&source, &crate::oci::Platform::host()) {
        build_layers(&image);
    }
    let _ = std::fs::remove_file(&file);
}

/// The separator of [`oci_layout`]'s parts (a layer's tar holds NULs, so not a single byte).
pub const LAYOUT_SEPARATOR: &[u8] = b"\n=part=\n";

/// An OCI image layout made of `data`, opened as `strata import oci:DIR` opens it (`index.json`, nested
/// indexes chosen by platform, the manifest, the config, each blob verified against its descriptor),
/// then each layer read (up to the bound of [`tar`]) and built as [`tar`] builds one.
///
/// `data` is parts split at [`LAYOUT_SEPARATOR`]: the first is `index.json`, every other is a blob,
/// stored under its own SHA-256. Blobs are found by digest, which a fuzzer cannot compute, so a part may
/// name a *later* part: `@N` becomes part N's hex SHA-256 and `#N` its size (N one digit). Parts are
/// finished last to first, so every reference is to a finished part; the index is finished last.
pub fn oci_layout(data: &[u8]) {
    oci_layout_with(data, &build_layers);
}

/// [`oci_layout`], with what to do with an image that opened.
fn oci_layout_with(data: &[u8], opened: &dyn Fn(&crate::oci::OciImage)) {
    let parts = resolve_references(split_parts(data));
    let dir = scratch_path("oci");
    let blobs = dir.join("blobs").join("sha256");
    let written = std::fs::create_dir_all(&blobs).and_then(|()| {
        std::fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#)?;
        std::fs::write(dir.join("index.json"), &parts[0].0)?;
        for (part, hex) in &parts[1..] {
            std::fs::write(blobs.join(hex), part)?;
        }
        Ok(())
    });
    if written.is_ok() {
        let source = crate::oci::Source::Layout {
            dir: dir.clone(),
            reference: None,
        };
        if let Ok(image) = crate::oci::open(&source, &crate::oci::Platform::host()) {
            opened(&image);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `data` split at [`LAYOUT_SEPARATOR`], into ten parts at most (`@N` names one digit).
fn split_parts(data: &[u8]) -> Vec<Vec<u8>> {
    let mut parts = Vec::new();
    let mut rest = data;
    while parts.len() < 9 {
        let Some(at) = rest
            .windows(LAYOUT_SEPARATOR.len())
            .position(|w| w == LAYOUT_SEPARATOR)
        else {
            break;
        };
        parts.push(rest[..at].to_vec());
        rest = &rest[at + LAYOUT_SEPARATOR.len()..];
    }
    parts.push(rest.to_vec());
    parts
}

/// Each part with its `@N` and `#N` replaced by part N's hex SHA-256 and size (N later than the part;
/// else left as it is), and its own hex SHA-256. Finished last to first.
fn resolve_references(parts: Vec<Vec<u8>>) -> Vec<(Vec<u8>, String)> {
    use sha2::{Digest, Sha256};
    let mut done: Vec<(Vec<u8>, String)> = Vec::with_capacity(parts.len());
    for (i, part) in parts.iter().enumerate().rev() {
        // `done` holds parts i+1.. in reverse: part t is done[parts.len() - 1 - t].
        let later = |c: Option<&u8>| {
            let c = *c.filter(|c| c.is_ascii_digit())?;
            let t = usize::from(c - b'0');
            (t > i && t < parts.len()).then(|| &done[parts.len() - 1 - t])
        };
        let mut out = Vec::with_capacity(part.len());
        let mut k = 0;
        while k < part.len() {
            match (part[k], later(part.get(k + 1))) {
                (b'@', Some((_, hex))) => out.extend(hex.as_bytes()),
                (b'#', Some((bytes, _))) => out.extend(bytes.len().to_string().as_bytes()),
                (b, _) => {
                    out.push(b);
                    k += 1;
                    continue;
                }
            }
            k += 2;
        }
        let hex = format!("{:x}", Sha256::digest(&out));
        done.push((out, hex));
    }
    done.reverse();
    done
}

/// A path of its own in the temporary directory for one input (`ext` names its kind).
fn scratch_path(ext: &str) -> std::path::PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    std::env::temp_dir().join(format!("strata-fuzz-{}-{n}.{ext}", std::process::id()))
}

/// Each of an opened image's layers, read up to [`MAX_DATA`] and built as [`tar`] builds one.
fn build_layers(image: &crate::oci::OciImage) {
    for layer in &image.layers {
        let mut bytes = Vec::new();
        if let Ok(r) = layer.open() {
            if r.take(MAX_DATA).read_to_end(&mut bytes).is_ok() {
                tar(&bytes);
            }
        }
    }
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

    /// An OCI layout of one layer as [`super::oci_layout`] takes it: index, manifest, config, layer.
    pub(crate) fn layout() -> Vec<u8> {
        let mut layer = tar::Builder::new(Vec::new());
        member(&mut layer, "etc/hello", b"hello");
        let layer = layer.into_inner().expect("layer");
        let index = r#"{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:@1","size":#1,"annotations":{"org.opencontainers.image.ref.name":"v1"}}]}"#;
        let manifest = r#"{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:@2","size":#2},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"sha256:@3","size":#3}]}"#;
        let config = serde_json::json!({
            "architecture": crate::oci::Platform::host().architecture,
            "os": "linux",
            "config": {"Env": ["PATH=/bin"], "Cmd": ["/bin/sh"]},
            "rootfs": {"type": "layers", "diff_ids": ["sha256:@3"]},
        })
        .to_string();
        let mut out = Vec::new();
        for part in [
            index.as_bytes(),
            manifest.as_bytes(),
            config.as_bytes(),
            &layer,
        ] {
            if !out.is_empty() {
                out.extend(super::LAYOUT_SEPARATOR);
            }
            out.extend(part);
        }
        out
    }

    /// The layout entry (also `fuzz/`'s `oci_layout` target): its seed opens as an image of one layer,
    /// and mutations of it (mostly in the index and the manifest) are answered, never a panic.
    #[test]
    fn the_layout_entry_opens_its_seed_and_survives_mutations() {
        let seed = layout();
        let seen = std::sync::atomic::AtomicUsize::new(0);
        super::oci_layout_with(&seed, &|image| {
            assert_eq!(image.layers.len(), 1);
            super::build_layers(image);
            seen.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        });
        assert_eq!(
            seen.load(std::sync::atomic::Ordering::Relaxed),
            1,
            "the seed opens"
        );
        // `fuzz/seeds/oci_layout` (cargo-fuzz's starting points) open too: one layer, and a nested
        // index chosen by platform to two layers.
        let seeds =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds/oci_layout");
        for (name, layers) in [("one-layer", 1), ("nested-index", 2)] {
            let bytes = std::fs::read(seeds.join(name)).expect("seed");
            super::oci_layout_with(&bytes, &|image| {
                assert_eq!(image.layers.len(), layers, "{name}");
                super::build_layers(image);
                seen.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            });
        }
        assert_eq!(seen.into_inner(), 3, "every seed opens");
        strata_registry::testing::mutations(&seed, 0x5eed, 1500, 1024)
            .for_each(|m| super::oci_layout(&m));
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

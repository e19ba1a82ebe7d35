//! Fuzzing entries for the registry's parsers of stored bytes: what `fuzz/`'s targets (cargo-fuzz)
//! and this module's stable smoke test run on arbitrary bytes.
//!
//! Everything here reads what a store holds — a blob's table of contents and footer, compressed
//! frames, layer metadata streams, layer descriptors and manifests, names — and a store is not
//! trusted: whatever the bytes, a parser answers with a value or an error, never a panic or an
//! allocation beyond its stated bound. Where a
//! value comes out, it must survive its own round trip (a TOC that decodes re-encodes to itself).

use crate::model::{JsonObject, LayerDescriptor, Manifest, Reference, TagName};
use crate::toc::{Footer, Toc};

/// Largest decompressed size asked of a frame here (a chunk is at most a few MiB).
const MAX_FRAME: usize = 4 << 20;

/// A blob's table of contents: decoded, looked into, and round-tripped when good.
pub fn toc(data: &[u8]) {
    let Ok(t) = Toc::decode(data) else { return };
    assert_eq!(
        Toc::decode(&t.encode()).as_ref().ok(),
        Some(&t),
        "round trip"
    );
    let _ = t.view_size();
    for i in 0..t.chunks.len().min(64) {
        let _ = t.frames_of(i);
        let _ = t.pieces_of(i);
        let _ = t.chunk_at(u64::from(t.chunks[i].block));
    }
    let _ = t.chunk_at(u64::MAX);
}

/// A blob's footer, for a blob of the length the first 8 bytes give.
pub fn footer(data: &[u8]) {
    let Some((len, rest)) = data.split_first_chunk::<8>() else {
        return;
    };
    if let Ok(f) = Footer::decode(rest, u64::from_le_bytes(*len)) {
        assert_eq!(
            Footer::decode(&f.encode(), u64::from_le_bytes(*len)).ok(),
            Some(f)
        );
    }
}

/// Compressed bytes: as one chunk's frame of the length the first 3 bytes give, and as a metadata
/// stream of frames (bounded).
pub fn frames(data: &[u8]) {
    let Some((len, z)) = data.split_first_chunk::<3>() else {
        return;
    };
    let len =
        (usize::from(len[0]) | usize::from(len[1]) << 8 | usize::from(len[2]) << 16) % MAX_FRAME;
    if let Ok(out) = crate::toc::decompress(z, len) {
        assert_eq!(out.len(), len);
    }
    if let Ok(out) = crate::store::frames::decompress(z, MAX_FRAME as u64) {
        assert!(out.len() <= MAX_FRAME);
    }
    unpacked(z, len);
}

/// A metadata stream unpacked into a memory file as it would arrive from a store, in pieces of up to
/// `piece` bytes: what the unpacker says it wrote is what the file holds, within the bound.
fn unpacked(z: &[u8], piece: usize) {
    use crate::store::unpack::{unpack_into, Unpacked};
    let Ok(fd) = rustix::fs::memfd_create("strata-fuzz-unpack", rustix::fs::MemfdFlags::CLOEXEC)
    else {
        return;
    };
    let file = std::fs::File::from(fd);
    let read = |sink: &mut dyn FnMut(&[u8])| {
        z.chunks(piece.max(1)).for_each(sink);
        Ok::<(), ()>(())
    };
    if let Ok(Unpacked::Written { len, digest }) = unpack_into(MAX_FRAME as u64, &file, read) {
        let mut back = Vec::new();
        std::io::Read::read_to_end(&mut &file, &mut back).expect("read the memory file");
        assert!(len <= MAX_FRAME as u64 && back.len() as u64 == len);
        assert_eq!(digest, crate::digest::Digest::of(&back));
    }
}

/// Names as a client or a store gives them: image references and tag names.
pub fn names(data: &[u8]) {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(r) = Reference::parse(s) {
        let _ = format!("{r:?}");
    }
    let _ = TagName::parse(s);
}

/// A layer descriptor and an image manifest (JSON, schema and invariants checked): what parses
/// re-encodes to itself, and a manifest's config yields the process stratad would start.
pub fn documents(data: &[u8]) {
    if let Ok(l) = LayerDescriptor::from_bytes(data) {
        let again = LayerDescriptor::from_bytes(&l.to_bytes()).expect("a descriptor re-parses");
        assert_eq!(again, l, "a descriptor survives its round trip");
    }
    if let Ok(m) = Manifest::from_bytes(data) {
        let again = Manifest::from_bytes(&m.to_bytes()).expect("a manifest re-parses");
        assert_eq!(again, m, "a manifest survives its round trip");
        let _ = (m.config.args(), m.config.process_env(), m.config.cwd());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Mutations of `seed` (see [`crate::testing::mutations`]): anywhere in these short encodings.
    fn mutations(seed: &[u8], n: usize) -> impl Iterator<Item = Vec<u8>> + '_ {
        crate::testing::mutations(seed, 0x9e37_79b9_7f4a_7c15, n, usize::MAX)
    }

    #[test]
    fn parsers_of_stored_bytes_survive_mutations() {
        let (pieced, _) = crate::toc::tests::pieced();
        for seed in [crate::toc::tests::sample().encode(), pieced.encode()] {
            toc(&seed);
            mutations(&seed, 5_000).for_each(|m| toc(&m));
        }
        let f = Footer {
            toc_offset: 100,
            toc_len: 50,
            toc_digest: crate::digest::Digest::of(b"t"),
        };
        let mut seed = 214u64.to_le_bytes().to_vec();
        seed.extend_from_slice(&f.encode());
        mutations(&seed, 2_000).for_each(|m| footer(&m));
        let data: Vec<u8> = (0..300_000u32).map(|i| (i % 7) as u8).collect();
        let mut seed = vec![0xe0, 0x93, 0x04]; // 300,000
        seed.extend(crate::store::frames::compress(&data, 3));
        frames(&seed);
        mutations(&seed, 300).for_each(|m| frames(&m));
        for s in ["base:v1", "blake3:".to_string().as_str(), "a/b:c@d"] {
            mutations(s.as_bytes(), 500).for_each(|m| names(&m));
        }
        let layer = crate::gc::tests::descriptor(7);
        let mut manifest = Manifest {
            schema: crate::model::SCHEMA,
            layers: vec![crate::model::ManifestLayer {
                digest: crate::digest::Digest::of(&layer.to_bytes()),
                kind: layer.kind,
            }],
            config: Default::default(),
            annotations: [("a".to_string(), "b".to_string())].into(),
        };
        manifest.config.entrypoint = vec!["/bin/sh".into()];
        manifest.config.working_dir = Some("/w".into());
        manifest.config.env = vec!["PATH=/bin".into()];
        for seed in [layer.to_bytes(), manifest.to_bytes()] {
            documents(&seed);
            mutations(&seed, 3_000).for_each(|m| documents(&m));
        }
    }
}

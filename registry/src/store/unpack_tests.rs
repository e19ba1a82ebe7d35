//! The unpacker against whole streams, streams in pieces of every size, other layouts and damage.

use super::super::frames::{compress, decompress, FRAME};
use super::*;

fn data(n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| ((i / 7) % 251) as u8 ^ (i % 13) as u8)
        .collect()
}

/// `z` unpacked into a new temporary file, handed over in pieces of `piece` bytes: the result and
/// the file's bytes.
fn to_file(z: &[u8], limit: u64, piece: usize) -> (Result<Unpacked, UnpackError<()>>, Vec<u8>) {
    let f = tempfile::tempfile().unwrap();
    let r = unpack_into(limit, &f, |sink| {
        z.chunks(piece.max(1)).for_each(sink);
        Ok(())
    });
    let mut back = Vec::new();
    use std::io::{Read, Seek};
    let mut f = f;
    f.rewind().unwrap();
    f.read_to_end(&mut back).unwrap();
    (r, back)
}

fn written(d: &[u8]) -> Unpacked {
    Unpacked::Written {
        len: d.len() as u64,
        digest: Digest::of(d),
    }
}

#[test]
fn frames_go_to_a_file_with_the_digest_of_the_whole() {
    for n in [FRAME + 1, 2 * FRAME, 3 * FRAME + 12345, 5 * FRAME - 1] {
        let d = data(n);
        let z = compress(&d, 3);
        for piece in [z.len(), 1 << 20, 65536, 4099, 1] {
            if piece == 1 && n > 2 * FRAME {
                continue; // byte by byte once is enough
            }
            let (r, back) = to_file(&z, 1 << 30, piece);
            assert_eq!(r.unwrap(), written(&d), "{n} bytes in pieces of {piece}");
            assert!(back == d, "{n} bytes written in pieces of {piece}");
        }
    }
}

/// Stores written with 4 MiB frames (before 1 MiB), or any power of two in bounds, are unpacked too.
#[test]
fn other_power_of_two_frame_sizes_are_unpacked() {
    for size in [MIN_FRAME, 4 << 20] {
        let d = data(2 * size + 777);
        let z: Vec<u8> = d
            .chunks(size)
            .flat_map(|c| crate::toc::compress(c, 3))
            .collect();
        let (r, back) = to_file(&z, 1 << 30, 300_000);
        assert_eq!(r.unwrap(), written(&d), "frames of {size}");
        assert!(back == d);
    }
}

#[test]
fn other_layouts_come_back_whole() {
    let whole = |z: &[u8]| match to_file(z, 1 << 30, 5000).0.unwrap() {
        Unpacked::Whole(b) => assert!(b == z, "the stream itself"),
        w => panic!("{w:?}"),
    };
    // One frame; frames of a size not a power of two; frames without sizes; a patch's header.
    whole(&compress(&data(FRAME / 2), 3));
    let d = data(3 * FRAME);
    let odd: Vec<u8> = d
        .chunks(FRAME - 4096)
        .flat_map(|c| crate::toc::compress(c, 3))
        .collect();
    whole(&odd);
    assert_eq!(decompress(&odd, 1 << 30).unwrap(), d);
    whole(&zstd::stream::encode_all(&d[..], 3).unwrap());
    let mut patch = b"STRATAPATCH".to_vec();
    patch.extend_from_slice(&compress(&d, 3));
    whole(&patch);
    // A short frame followed by another.
    let mut short = crate::toc::compress(&d[..FRAME], 3);
    short.extend(crate::toc::compress(&d[..FRAME / 2], 3));
    short.extend(crate::toc::compress(&d[..FRAME], 3));
    whole(&short);
}

#[test]
fn a_bad_frame_a_bomb_or_a_failed_read_is_refused() {
    let d = data(3 * FRAME + 7);
    let z = compress(&d, 3);
    // Cut short: the last frame never completes, so the ordinary path is left to say why.
    assert!(matches!(
        to_file(&z[..z.len() - 3], 1 << 30, 4096).0,
        Ok(Unpacked::Whole(_))
    ));
    assert!(matches!(
        to_file(&z, 2 * FRAME as u64, 4096).0,
        Err(UnpackError::Stream(_))
    ));
    // A frame whose bytes are damaged but still decode: the digest tells.
    let mut bad = z.clone();
    let mid = bad.len() / 2;
    bad[mid] ^= 0xff;
    match to_file(&bad, 1 << 30, 4096).0 {
        Ok(Unpacked::Written { digest, .. }) => assert_ne!(digest, Digest::of(&d)),
        Ok(Unpacked::Whole(_)) | Err(UnpackError::Stream(_)) => {}
        r => panic!("{r:?}"),
    }
    // The read fails half way: its error, after the frames already handed over were done.
    let f = tempfile::tempfile().unwrap();
    let r = unpack_into(1 << 30, &f, |sink| {
        sink(&z[..z.len() / 2]);
        Err("the store went away")
    });
    assert!(matches!(r, Err(UnpackError::Read("the store went away"))));
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
    /// Damaged streams (bytes flipped or cut anywhere), in pieces of any size, never panic, and what
    /// the unpacker says it wrote is what the file holds: its digest is the bytes' own (so a caller
    /// comparing it with the name never keeps wrong bytes).
    #[test]
    fn damaged_streams_never_pass_as_the_image(flips in proptest::collection::vec((0usize..1 << 20, 1u8..), 0..4),
                                               cut in proptest::option::of(0usize..1 << 20),
                                               piece in 1usize..200_000) {
        let d = data(2 * FRAME + 4321);
        let mut z = compress(&d, 1);
        for (at, x) in flips {
            let at = at % z.len();
            z[at] ^= x;
        }
        if let Some(c) = cut {
            z.truncate(c % (z.len() + 1));
        }
        if let (Ok(Unpacked::Written { len, digest }), back) = to_file(&z, 1 << 30, piece) {
            proptest::prop_assert_eq!(len, back.len() as u64);
            proptest::prop_assert_eq!(digest, Digest::of(&back));
        }
    }
}

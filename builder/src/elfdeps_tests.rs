use proptest::prelude::*;

use super::*;

/// This machine's `ls`: a real dynamically linked program.
fn ls() -> Vec<u8> {
    std::fs::read("/bin/ls").expect("/bin/ls")
}

#[test]
fn a_program_names_the_libraries_it_needs() {
    let d = needed(&ls()).expect("ls is dynamically linked");
    assert!(d.needed.iter().any(|n| n == b"libc.so.6"), "{d:?}");
    assert!(needed(b"#!/bin/sh\necho hi\n").is_none());
    assert!(needed(b"").is_none());
    // A head cut before the string table says nothing rather than something wrong.
    assert!(needed(&ls()[..64]).is_none());
}

fn layer<'a>(entries: &'a [(&'a str, Kind)]) -> impl Fn(&[u8]) -> Option<Kind> + 'a {
    move |p: &[u8]| {
        entries
            .iter()
            .find(|(q, _)| q.as_bytes() == p)
            .map(|(_, k)| match k {
                Kind::Dir => Kind::Dir,
                Kind::Link(t) => Kind::Link(t.clone()),
                Kind::Other => Kind::Other,
            })
    }
}

fn link(t: &str) -> Kind {
    Kind::Link(t.as_bytes().to_vec())
}

#[test]
fn symlinks_are_followed_within_the_layer() {
    let entries = [
        ("lib", link("usr/lib")),
        ("usr", Kind::Dir),
        ("usr/lib", Kind::Dir),
        ("usr/lib/x86_64-linux-gnu", Kind::Dir),
        (
            "usr/lib/x86_64-linux-gnu/liblapack.so.3",
            link("/etc/alternatives/liblapack.so.3"),
        ),
        ("etc", Kind::Dir),
        ("etc/alternatives", Kind::Dir),
        (
            "etc/alternatives/liblapack.so.3",
            link("../../usr/lib/x86_64-linux-gnu/openblas/liblapack.so.3"),
        ),
        ("usr/lib/x86_64-linux-gnu/openblas", Kind::Dir),
        (
            "usr/lib/x86_64-linux-gnu/openblas/liblapack.so.3",
            Kind::Other,
        ),
        ("loop", link("loop")),
    ];
    let kind = layer(&entries);
    let got = follow(b"lib/x86_64-linux-gnu/liblapack.so.3", &kind);
    assert_eq!(
        got.as_deref(),
        Some(&b"usr/lib/x86_64-linux-gnu/openblas/liblapack.so.3"[..])
    );
    assert_eq!(follow(b"loop", &kind), None);
    assert_eq!(follow(b"usr/lib", &kind), None, "a directory");
    assert_eq!(follow(b"usr/lib/missing.so", &kind), None);
    assert_eq!(
        follow(b"usr/lib/x86_64-linux-gnu/openblas/liblapack.so.3/x", &kind),
        None
    );
}

#[test]
fn names_resolve_like_the_loader() {
    let entries = [
        ("opt", Kind::Dir),
        ("opt/app", Kind::Dir),
        ("opt/app/bin", Kind::Dir),
        ("opt/app/lib", Kind::Dir),
        ("opt/app/lib/libapp.so", Kind::Other),
        ("usr", Kind::Dir),
        ("usr/lib", Kind::Dir),
        ("usr/lib/libapp.so", Kind::Other),
        ("usr/lib/x86_64-linux-gnu", Kind::Dir),
        ("usr/lib/x86_64-linux-gnu/libm.so.6", Kind::Other),
    ];
    let libs = Libraries {
        follow: |p: &[u8]| follow(p, layer(&entries)),
    };
    let runpath = Dynamic {
        needed: vec![],
        search: vec![b"$ORIGIN/../lib".to_vec()],
    };
    let from = b"opt/app/bin/app";
    let got = libs.resolve(b"libapp.so", from, &runpath);
    assert_eq!(
        got.as_deref(),
        Some(&b"opt/app/lib/libapp.so"[..]),
        "RUNPATH first"
    );
    let got = libs.resolve(b"libapp.so", from, &Dynamic::default());
    assert_eq!(got.as_deref(), Some(&b"usr/lib/libapp.so"[..]));
    let got = libs.resolve(b"libm.so.6", from, &runpath);
    assert_eq!(
        got.as_deref(),
        Some(&b"usr/lib/x86_64-linux-gnu/libm.so.6"[..]),
        "multiarch"
    );
    assert_eq!(libs.resolve(b"libnone.so", from, &runpath), None);
}

#[test]
fn libraries_follow_their_first_loader_breadth_first() {
    // 0 loads 3 and 2; 3 loads 4; 1 loads 4 (already placed); 5 loads nothing.
    let needs = |i: usize| match i {
        0 => vec![3, 2],
        3 => vec![4],
        1 => vec![4, 9],
        _ => vec![],
    };
    assert_eq!(order(6, needs), vec![0, 3, 2, 4, 1, 5]);
}

#[test]
fn libraries_many_files_load_go_together_most_loaded_first() {
    // Files 0..10 all load 20; files 0..8 load 21 too; file 3 alone loads 22.
    let mut needs: Vec<Vec<usize>> = (0..10)
        .map(|i| if i < 8 { vec![21, 20] } else { vec![20] })
        .collect();
    needs[3].push(22);
    needs.extend((10..23).map(|_| Vec::new()));
    assert_eq!(common_libraries(&needs), vec![20, 21]);
    // The first loader brings the whole group; a rare library still follows its own loader.
    let common = common_libraries(&needs);
    let order = order(needs.len(), |i| {
        let mut d = needs[i].clone();
        if d.iter().any(|x| common.contains(x)) {
            d.extend(common.iter().copied());
        }
        d
    });
    assert_eq!(&order[..4], &[0, 21, 20, 1]);
    let at = |x: usize| order.iter().position(|&o| o == x).expect("placed");
    assert_eq!(at(22), at(3) + 1);
}

proptest! {
    /// Any bytes, and a real program with bytes flipped: an answer or `None`, never a panic.
    #[test]
    fn any_bytes_parse(data in proptest::collection::vec(any::<u8>(), 0..2048)) {
        let _ = needed(&data);
    }

    #[test]
    fn a_damaged_program_never_panics(flips in proptest::collection::vec((0usize..4096, any::<u8>()), 1..16)) {
        let mut elf = ls();
        for (at, b) in flips {
            let n = elf.len();
            elf[at % n] ^= b;
        }
        let _ = needed(&elf);
    }

    /// Every file is placed exactly once, whatever the needs.
    #[test]
    fn order_is_a_permutation(n in 0usize..40, edges in proptest::collection::vec((0usize..50, 0usize..50), 0..80)) {
        let got = order(n, |i| edges.iter().filter(|e| e.0 == i).map(|e| e.1).collect());
        let mut sorted = got.clone();
        sorted.sort();
        prop_assert_eq!(sorted, (0..n).collect::<Vec<_>>());
    }
}

#[test]
fn an_elf_file_stores_what_the_loader_touches_after_its_headers() {
    // This machine's libc: its writable segment and dynamic section lie near its end.
    let libc = std::fs::read("/lib/x86_64-linux-gnu/libc.so.6").expect("libc");
    let chunk = 64 << 10;
    let n = (libc.len() as u64).div_ceil(chunk);
    let order = chunk_order(&libc, chunk, n);
    let mut sorted = order.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, (0..n).collect::<Vec<_>>(), "every chunk once");
    assert_eq!(order[0], 0);
    let hot: Vec<u64> = order[1..].iter().copied().take_while(|&c| c > 1).collect();
    assert!(!hot.is_empty() && hot.len() <= HOT_CHUNKS_MAX, "{order:?}");
    assert!(
        hot.iter().all(|&c| c >= n / 2),
        "the loader's part is in the file's second half: {hot:?}"
    );
    // Not ELF, or a single chunk: in order.
    assert_eq!(chunk_order(b"plain data", chunk, 3), vec![0, 1, 2]);
    assert_eq!(chunk_order(&libc, 4 << 20, 1), vec![0]);
}

proptest! {
    /// Any bytes: the chunk order is a permutation that starts with chunk 0.
    #[test]
    fn chunk_order_is_a_permutation(data in proptest::collection::vec(any::<u8>(), 0..1024), n in 1u64..50) {
        let order = chunk_order(&data, 4096, n);
        prop_assert_eq!(order[0], 0);
        let mut sorted = order.clone();
        sorted.sort_unstable();
        prop_assert_eq!(sorted, (0..n).collect::<Vec<_>>());
    }
}

//! Directory groups: which chunks of a blob belong to the small files of one directory, so that a miss
//! in a package or data directory can fetch its neighbours' run-time files with it (issue 20, item 4).
//!
//! Programs read a directory's files together: an interpreter imports a package's modules one after
//! another, a linker loads a directory's libraries, a test reads its data files. Without a plan each of
//! those reads is a miss of its own, and over a link each is a round trip. The blob's layout keeps a
//! directory's files near each other but not always in reading order, and subdirectories and large files
//! come between; the fetcher's followers (the frames after a miss) and its optional read-behind cover
//! only what lies next to the miss.
//!
//! So when a layer is mounted, a walk of its metadata (in the background, on the node's pool) records,
//! per blob, each directory's *members* — its regular files of at most [`MEMBER_MAX`] bytes, the
//! modules, libraries and data files a program opens — and the chunks their data lies in. A miss of a
//! member's chunk then names the other members' chunks ([`Groups::companions`]), which the fetcher
//! fetches in the background within its `max_group` budget (`--max-fetch-group`; nearest chunks first).
//! Large files are never pulled in this way: their own reads bring their followers. A chunk shared by
//! files of several directories (store-wide dedup) belongs to the first directory walked.
//!
//! Memory: two `u32`s per member chunk and one vector per directory (the fat image: ~41k entries).

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use strata_erofs::{ErofsError, ErofsImage, Layout};
use strata_registry::digest::Digest;

use crate::fetch::BlobHandle;

/// Files larger than this are no directory's members.
pub const MEMBER_MAX: u64 = 256 << 10;

/// One blob's directory groups.
#[derive(Default)]
struct BlobGroups {
    /// Chunk index → group.
    of_chunk: HashMap<u32, u32>,
    /// Group → its chunk indexes, ascending.
    members: Vec<Vec<u32>>,
}

/// Every mounted layer's directory groups, by blob.
#[derive(Default)]
pub struct Groups {
    blobs: RwLock<HashMap<Digest, BlobGroups>>,
    /// Blobs some walked layer names (whether or not they hold any group): a layer naming only these
    /// needs no walk ([`Groups::all_walked`]).
    walked: RwLock<std::collections::HashSet<Digest>>,
}

impl Groups {
    /// Whether every one of `blobs` was named by a layer walked already: walking another layer would
    /// record nothing new (blobs already recorded are left as they are).
    pub fn all_walked(&self, blobs: &[Digest]) -> bool {
        let w = self.walked.read().unwrap_or_else(|p| p.into_inner());
        blobs.iter().all(|d| w.contains(d))
    }

    /// Records that a layer naming `blobs` was walked.
    pub fn mark_walked(&self, blobs: &[Digest]) {
        let mut w = self.walked.write().unwrap_or_else(|p| p.into_inner());
        w.extend(blobs.iter().copied());
    }

    /// What has been learnt, for `stratad`'s status: blobs named by walked layers, and the directories
    /// and member chunks recorded.
    pub fn status(&self) -> serde_json::Value {
        let walked = self.walked.read().unwrap_or_else(|p| p.into_inner()).len();
        let blobs = self.blobs.read().unwrap_or_else(|p| p.into_inner());
        let directories: usize = blobs.values().map(|b| b.members.len()).sum();
        let chunks: usize = blobs.values().map(|b| b.of_chunk.len()).sum();
        serde_json::json!({"blobs_walked": walked, "directories": directories, "chunks": chunks})
    }

    /// Records the directory groups of a layer's image; `blob_of(device)` is the served blob behind a
    /// 1-based device id. Blobs already recorded (by another layer naming them) are left as they are.
    pub fn add_layer(
        &self,
        image: &ErofsImage,
        blob_of: impl Fn(u16) -> Option<Arc<BlobHandle>>,
    ) -> Result<(), ErofsError> {
        let mut found: HashMap<Digest, BlobGroups> = HashMap::new();
        let mut dirs = vec![image.inode(image.root_nid())?];
        let mut seen = std::collections::HashSet::new();
        while let Some(dir) = dirs.pop() {
            strata_erofs::enter_dir(&mut seen, dir.nid)?;
            // This directory's group in each blob its members lie in.
            let mut group: HashMap<Digest, u32> = HashMap::new();
            for e in image.read_dir(&dir)? {
                let inode = image.inode(e.nid)?;
                if inode.is_dir() {
                    dirs.push(inode);
                    continue;
                }
                if inode.layout != Layout::ChunkBased || inode.size > MEMBER_MAX {
                    continue;
                }
                for loc in image.chunks(&inode)?.into_iter().flatten() {
                    let Some(h) = blob_of(loc.device) else {
                        continue;
                    };
                    let Some(i) = h.toc.chunk_at(u64::from(loc.block)) else {
                        continue;
                    };
                    let bg = found.entry(h.blob.digest).or_default();
                    let g = *group.entry(h.blob.digest).or_insert_with(|| {
                        bg.members.push(Vec::new());
                        (bg.members.len() - 1) as u32
                    });
                    // Every unit of the chunk: all of a pieced chunk's pieces.
                    for u in h.chunk_units(i) {
                        if let std::collections::hash_map::Entry::Vacant(v) =
                            bg.of_chunk.entry(u as u32)
                        {
                            v.insert(g);
                            bg.members[g as usize].push(u as u32);
                        }
                    }
                }
            }
        }
        let mut blobs = self.blobs.write().unwrap_or_else(|p| p.into_inner());
        for (d, mut bg) in found {
            for m in &mut bg.members {
                m.sort_unstable();
            }
            blobs.entry(d).or_insert(bg);
        }
        Ok(())
    }

    /// The other chunks of the group chunk `i` of `blob` belongs to, nearest to `i` first (none when it
    /// is no member's).
    pub fn companions(&self, blob: &Digest, i: usize) -> Vec<usize> {
        let blobs = self.blobs.read().unwrap_or_else(|p| p.into_inner());
        let Some(bg) = blobs.get(blob) else {
            return Vec::new();
        };
        let Some(&g) = bg.of_chunk.get(&(i as u32)) else {
            return Vec::new();
        };
        let mut out: Vec<usize> = bg.members[g as usize]
            .iter()
            .map(|&c| c as usize)
            .filter(|&c| c != i)
            .collect();
        out.sort_by_key(|&c| c.abs_diff(i));
        out
    }

    /// What a miss of chunk `i` of `blob` fetches besides its own frames: its group's other chunks that
    /// are not `taken` (claimed by the miss) nor `cached`, nearest first, until their frames come to
    /// `budget` compressed bytes; returned in blob order (one request per run of neighbours), with the
    /// compressed bytes of their frames.
    pub fn missing(
        &self,
        blob: &BlobHandle,
        i: usize,
        taken: &[usize],
        cached: impl Fn(usize) -> bool,
        budget: u64,
    ) -> (Vec<usize>, u64) {
        let toc = &blob.toc;
        let (mut frames, mut bytes, mut out) = (std::collections::HashSet::new(), 0, Vec::new());
        for j in self.companions(&blob.blob.digest, i) {
            let Some(c) = toc.chunks.get(j) else { continue };
            if taken.contains(&j) || cached(j) {
                continue;
            }
            let f = c.frame as usize;
            if frames.insert(f) {
                let more = toc.frames.get(f).map_or(0, |fr| u64::from(fr.compressed));
                if bytes + more > budget {
                    break;
                }
                bytes += more;
            }
            out.push(j);
        }
        out.sort_unstable();
        (out, bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::{bytes, Kit};
    use std::time::Duration;

    impl Groups {
        /// Records `members` (groups of chunk indexes) for `blob`, as a walk would.
        fn set(&self, blob: Digest, members: Vec<Vec<u32>>) {
            let mut bg = BlobGroups::default();
            for (g, m) in members.iter().enumerate() {
                for &c in m {
                    bg.of_chunk.insert(c, g as u32);
                }
            }
            bg.members = members;
            self.blobs.write().unwrap().insert(blob, bg);
        }
    }

    #[test]
    fn a_miss_names_its_group_nearest_first_within_the_budget() {
        let kit = Kit::new(Duration::from_secs(5));
        // Ten chunks of 16 KiB of poorly compressible bytes, each its own frame.
        let chunks: Vec<Vec<u8>> = (0..10).map(|i| bytes(16 << 10, 70 + i)).collect();
        let (blob, _) = kit.blob(&chunks);
        let g = Groups::default();
        g.set(blob.blob.digest, vec![vec![0, 2, 3, 5, 9], vec![1, 4]]);
        assert_eq!(g.companions(&blob.blob.digest, 3), vec![2, 5, 0, 9]);
        assert_eq!(g.companions(&blob.blob.digest, 4), vec![1]);
        assert!(g.companions(&blob.blob.digest, 6).is_empty(), "no member's");
        let none = |_: usize| false;
        // All of them within a large budget, in blob order; what the miss claimed is left out.
        let frame = u64::from(blob.toc.frames[0].compressed);
        let (all, bytes) = g.missing(&blob, 3, &[3, 5], none, 1 << 20);
        assert_eq!(all, vec![0, 2, 9]);
        assert!(
            bytes >= 3 * frame - 64 && bytes <= 3 * frame + 64,
            "{bytes}"
        );
        // A budget of about two frames: the two nearest.
        assert_eq!(
            g.missing(&blob, 3, &[3], none, 2 * frame + 100).0,
            vec![2, 5]
        );
        // Cached chunks are skipped, not counted.
        let cached = |j: usize| j == 2;
        assert_eq!(
            g.missing(&blob, 3, &[3], cached, 2 * frame + 100).0,
            vec![0, 5]
        );
    }

    #[test]
    fn a_layer_naming_only_walked_blobs_needs_no_walk() {
        let g = Groups::default();
        let (a, b) = (Digest::of(b"a"), Digest::of(b"b"));
        assert!(g.all_walked(&[]), "a layer without blobs");
        assert!(!g.all_walked(&[a]));
        g.mark_walked(&[a]);
        assert!(g.all_walked(&[a]));
        assert!(!g.all_walked(&[a, b]), "a new blob is walked");
        g.mark_walked(&[b]);
        assert!(g.all_walked(&[b, a]));
    }
}

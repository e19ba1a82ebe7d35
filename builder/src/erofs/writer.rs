//! Lays a [`Tree`] out as an EROFS image (see the module documentation of [`crate::erofs`]).

use std::collections::BTreeMap;

use strata_erofs::device::seal_superblock;
use strata_erofs::{ChunkLoc, DeviceSlot};
use strata_registry::digest::Digest;

use super::format::*;
pub use super::write_error::{NodeFault, WriteError};
use crate::error::BuildError;
use crate::tree::{FileData, NodeId, NodeKind, Tree};

/// Where the device table starts, in 128-byte slots: byte 1280, after the 144 bytes that current kernel
/// headers give the superblock (mkfs 1.5 uses 9, right after the 128 bytes it knows; both mount).
pub const DEVT_SLOTOFF: u16 = 10;
/// Size of the extended inodes we write.
const INODE_SIZE: u64 = InodeExtended::SIZE as u64;
const BLK: u64 = BLKSZ as u64;
const UNSEEN: u32 = u32::MAX;

/// Writes `tree` as an EROFS image whose chunked files point into `devices` through `resolve`.
///
/// `chunk_bits` is log2 of the chunk size (12..=24); every `FileData::Chunks` file must hold exactly
/// `ceil(size / chunk size)` entries. The output is deterministic: the same input gives the same bytes.
pub fn write_image(
    tree: &Tree,
    devices: &[DeviceSlot],
    chunk_bits: u8,
    resolve: &dyn Fn(&Digest) -> Option<ChunkLoc>,
) -> Result<Vec<u8>, BuildError> {
    if !(12..=24).contains(&chunk_bits) {
        return Err(WriteError::ChunkBits(chunk_bits).into());
    }
    let extra_devices =
        u16::try_from(devices.len()).map_err(|_| WriteError::Devices(devices.len()))?;
    let walk = Walk::new(tree)?;
    let mut plans = Vec::with_capacity(walk.order.len());
    for i in 0..walk.order.len() {
        plans.push(plan_node(tree, &walk, i, chunk_bits)?);
    }

    // Metadata area: after block 0 (superblock) and the device table.
    let devt_end = u64::from(DEVT_SLOTOFF) * DEVT_SLOT_SIZE as u64
        + DEVT_SLOT_SIZE as u64 * devices.len() as u64;
    let meta_blkaddr = devt_end.div_ceil(BLK);
    let mut packer = Packer::default();
    for p in plans.iter_mut() {
        p.meta_off = packer.place(p.item_len);
    }
    // Data area: full blocks of directories, symlinks and inline-stored files, in inode order.
    let mut next_blk = meta_blkaddr + packer.blocks;
    for p in plans.iter_mut() {
        if p.data_blocks > 0 {
            p.startblk = next_blk;
            next_blk += p.data_blocks;
        }
    }
    let total_blocks = u32::try_from(next_blk).map_err(|_| WriteError::Blocks(next_blk))?;
    let image_len = usize::try_from(next_blk * BLK).map_err(|_| WriteError::Memory)?;
    let mut img = vec![0u8; image_len];

    let ctx = Emit {
        tree,
        walk: &walk,
        plans: &plans,
        devices,
        chunk_bits,
        resolve,
        meta_base: meta_blkaddr * BLK,
    };
    for i in 0..plans.len() {
        ctx.emit(i, &mut img)?;
    }

    // Device table.
    for (k, d) in devices.iter().enumerate() {
        let slot = RawDeviceSlot {
            tag: d.tag,
            blocks_lo: d.blocks,
            uniaddr_lo: 0,
            blocks_hi: 0,
            uniaddr_hi: 0,
            reserved: [0; 50],
        };
        slot.write_to(
            &mut img,
            DEVT_SLOTOFF as usize * DEVT_SLOT_SIZE + k * DEVT_SLOT_SIZE,
        );
    }
    let mut incompat = FEATURE_INCOMPAT_CHUNKED_FILE;
    if !devices.is_empty() {
        incompat |= FEATURE_INCOMPAT_DEVICE_TABLE;
    }
    let mut sb = SuperBlock::zeroed();
    sb.magic = EROFS_MAGIC;
    sb.feature_compat = FEATURE_COMPAT_SB_CHKSUM;
    sb.blkszbits = BLKSZ_BITS;
    sb.root_nid = 0; // the root is placed first, at the start of the metadata area
    sb.inos = plans.len() as u64;
    sb.blocks = total_blocks;
    sb.meta_blkaddr = meta_blkaddr as u32; // < total_blocks
    sb.feature_incompat = incompat;
    sb.extra_devices = extra_devices;
    sb.devt_slotoff = if devices.is_empty() { 0 } else { DEVT_SLOTOFF };
    seal_superblock(&mut img, sb);
    Ok(img)
}

/// The reachable nodes in breadth-first order (the root first), with the first name of each.
struct Walk<'a> {
    /// Order index → node.
    order: Vec<NodeId>,
    /// Node → order index (`UNSEEN` for orphans).
    index: Vec<u32>,
    /// Order index → (parent's order index, name); the root is its own parent.
    parent: Vec<(u32, &'a [u8])>,
}

impl<'a> Walk<'a> {
    fn new(tree: &'a Tree) -> Result<Walk<'a>, BuildError> {
        match tree.nodes.first().map(|n| &n.kind) {
            Some(NodeKind::Dir(_)) => {}
            _ => return Err(WriteError::RootNotDir.into()),
        }
        let mut walk = Walk {
            order: vec![0],
            index: vec![UNSEEN; tree.nodes.len()],
            parent: vec![(0, b"".as_slice())],
        };
        walk.index[0] = 0;
        let mut i = 0;
        while i < walk.order.len() {
            if let NodeKind::Dir(children) = &tree.nodes[walk.order[i]].kind {
                for (name, &child) in children {
                    let name = name.as_slice();
                    if name.is_empty()
                        || name.len() > NAME_LEN
                        || name == b"."
                        || name == b".."
                        || name.iter().any(|&b| b == b'/' || b == 0)
                    {
                        let name = String::from_utf8_lossy(name).into_owned();
                        return Err(NodeFault::Name(name).at(walk.path(i)).into());
                    }
                    let Some(node) = tree.nodes.get(child) else {
                        let path = walk.child_path(i, name);
                        return Err(NodeFault::Dangling(child).at(path).into());
                    };
                    if walk.index[child] == UNSEEN {
                        let at = u32::try_from(walk.order.len()).map_err(|_| WriteError::Inodes)?;
                        walk.index[child] = at;
                        walk.order.push(child);
                        walk.parent.push((i as u32, name));
                    } else if matches!(node.kind, NodeKind::Dir(_)) {
                        let path = walk.child_path(i, name);
                        return Err(NodeFault::DirTwice(child).at(path).into());
                    }
                }
            }
            i += 1;
        }
        Ok(walk)
    }

    /// The path of the node at order index `i`, for messages.
    fn path(&self, mut i: usize) -> String {
        let mut parts = Vec::new();
        while i != 0 {
            let (p, name) = self.parent[i];
            parts.push(String::from_utf8_lossy(name).into_owned());
            i = p as usize;
        }
        parts.reverse();
        format!("/{}", parts.join("/"))
    }

    fn child_path(&self, i: usize, name: &[u8]) -> String {
        let p = self.path(i);
        let sep = if p == "/" { "" } else { "/" };
        format!("{p}{sep}{}", String::from_utf8_lossy(name))
    }
}

/// How one inode is laid out.
struct Plan {
    /// Data layout (`LAYOUT_*`).
    layout: u16,
    /// Encoded inline xattr body and its `i_xattr_icount`.
    xattrs: Vec<u8>,
    icount: u16,
    size: u64,
    /// Bytes stored inline after the inode and xattrs (FLAT_INLINE).
    tail: u64,
    /// Number of chunk indexes (CHUNK_BASED).
    chunks: u64,
    /// Full blocks in the data area.
    data_blocks: u64,
    /// Bytes the inode occupies in the metadata area (32-byte aligned).
    item_len: u64,
    /// Offset in the metadata area (nid = meta_off / 32).
    meta_off: u64,
    /// First block of the data area's blocks.
    startblk: u64,
}

impl Plan {
    fn nid(&self) -> u64 {
        self.meta_off >> ISLOT_BITS
    }
}

fn plan_node(tree: &Tree, walk: &Walk, i: usize, chunk_bits: u8) -> Result<Plan, BuildError> {
    let node = &tree.nodes[walk.order[i]];
    let (xattrs, icount) = encode_xattrs(&node.meta.xattrs).map_err(|e| e.at(walk.path(i)))?;
    if node.meta.mtime_nsec >= 1_000_000_000 {
        return Err(NodeFault::Mtime(node.meta.mtime_nsec)
            .at(walk.path(i))
            .into());
    }
    let header = INODE_SIZE + xattrs.len() as u64;
    let mut plan = Plan {
        layout: LAYOUT_FLAT_PLAIN,
        xattrs,
        icount,
        size: 0,
        tail: 0,
        chunks: 0,
        data_blocks: 0,
        item_len: 0,
        meta_off: 0,
        startblk: 0,
    };
    let flat_len = match &node.kind {
        NodeKind::Dir(children) => Some(dir_size(children)),
        NodeKind::Symlink(target) => Some(target.len() as u64),
        NodeKind::File {
            size,
            data: FileData::Inline(bytes),
        } => {
            if *size != bytes.len() as u64 {
                let (size, inline) = (*size, bytes.len());
                return Err(NodeFault::Inline { size, inline }.at(walk.path(i)).into());
            }
            Some(*size)
        }
        NodeKind::File {
            size,
            data: FileData::Chunks(chunks),
        } => {
            let want = size.div_ceil(1u64 << chunk_bits);
            if chunks.len() as u64 != want {
                let fault = NodeFault::ChunkCount {
                    size: *size,
                    want,
                    bits: chunk_bits,
                    held: chunks.len(),
                };
                return Err(fault.at(walk.path(i)).into());
            }
            plan.layout = LAYOUT_CHUNK_BASED;
            plan.size = *size;
            plan.chunks = want;
            None
        }
        NodeKind::CharDev { rdev } | NodeKind::BlockDev { rdev } => {
            if new_encode_dev(*rdev).is_none() {
                let (major, minor) = (dev_major(*rdev), dev_minor(*rdev));
                let fault = NodeFault::DeviceNumber { major, minor };
                return Err(fault.at(walk.path(i)).into());
            }
            None
        }
        NodeKind::Fifo | NodeKind::Socket => None,
    };
    if let Some(len) = flat_len {
        plan.size = len;
        let tail = len % BLK;
        if tail != 0 && header + tail <= BLK {
            plan.layout = LAYOUT_FLAT_INLINE;
            plan.tail = tail;
            plan.data_blocks = len / BLK;
        } else {
            plan.data_blocks = len.div_ceil(BLK);
        }
    }
    let item = if plan.layout == LAYOUT_CHUNK_BASED {
        align_up(header, 8) + 8 * plan.chunks
    } else {
        header + plan.tail
    };
    plan.item_len = align_up(item, 1 << ISLOT_BITS);
    Ok(plan)
}

/// Encodes inline xattrs (no shared ones): the body and its `i_xattr_icount` (0 when empty).
fn encode_xattrs(xattrs: &[(Vec<u8>, Vec<u8>)]) -> Result<(Vec<u8>, u16), NodeFault> {
    if xattrs.is_empty() {
        return Ok((Vec::new(), 0));
    }
    let mut names: Vec<&[u8]> = xattrs.iter().map(|(n, _)| n.as_slice()).collect();
    names.sort_unstable();
    if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
        return Err(NodeFault::XattrTwice(
            String::from_utf8_lossy(w[0]).into_owned(),
        ));
    }
    let mut body = XattrIbodyHeader::zeroed().encode().to_vec();
    for (name, value) in xattrs {
        let show = || String::from_utf8_lossy(name).into_owned();
        let (index, suffix) =
            split_xattr_name(name).ok_or_else(|| NodeFault::XattrPrefix(show()))?;
        let name_len = u8::try_from(suffix.len()).map_err(|_| NodeFault::XattrName(show()))?;
        let value_size = u16::try_from(value.len()).map_err(|_| NodeFault::XattrValue {
            name: show(),
            len: value.len(),
        })?;
        let entry = XattrEntry {
            e_name_len: name_len,
            e_name_index: index,
            e_value_size: value_size,
        };
        body.extend_from_slice(&entry.encode());
        body.extend_from_slice(suffix);
        body.extend_from_slice(value);
        body.resize(align_up(body.len() as u64, 4) as usize, 0);
    }
    let icount = u16::try_from((body.len() - XattrIbodyHeader::SIZE) / 4 + 1)
        .map_err(|_| NodeFault::Xattrs(body.len()))?;
    Ok((body, icount))
}

/// Splits a full xattr name into its EROFS short prefix index and the stored suffix.
pub fn split_xattr_name(name: &[u8]) -> Option<(u8, &[u8])> {
    for (index, prefix) in [
        (XATTR_INDEX_USER, b"user.".as_slice()),
        (XATTR_INDEX_TRUSTED, b"trusted."),
        (XATTR_INDEX_SECURITY, b"security."),
    ] {
        if let Some(suffix) = name.strip_prefix(prefix) {
            return Some((index, suffix));
        }
    }
    match name {
        b"system.posix_acl_access" => Some((XATTR_INDEX_POSIX_ACL_ACCESS, b"")),
        b"system.posix_acl_default" => Some((XATTR_INDEX_POSIX_ACL_DEFAULT, b"")),
        _ => None,
    }
}

/// What a directory entry points at.
#[derive(Clone, Copy)]
enum Target {
    Dot,
    DotDot,
    Child(NodeId),
}

/// The entries of a directory including `.` and `..`, sorted bytewise (the kernel binary-searches them).
fn sorted_entries(children: &BTreeMap<Vec<u8>, NodeId>) -> Vec<(&[u8], Target)> {
    let mut out = Vec::with_capacity(children.len() + 2);
    let mut dots = [
        (b".".as_slice(), Target::Dot),
        (b"..".as_slice(), Target::DotDot),
    ]
    .into_iter()
    .peekable();
    for (name, &id) in children {
        while let Some(&(d, t)) = dots.peek() {
            if d >= name.as_slice() {
                break;
            }
            out.push((d, t));
            dots.next();
        }
        out.push((name.as_slice(), Target::Child(id)));
    }
    out.extend(dots);
    out
}

/// Packs entries greedily into dirent blocks: `(first, end, bytes used)` per block. An entry never
/// spans two blocks.
fn dir_blocks(entries: &[(&[u8], Target)]) -> Vec<(usize, usize, u64)> {
    let mut blocks = Vec::new();
    let (mut first, mut used) = (0, 0u64);
    for (k, (name, _)) in entries.iter().enumerate() {
        let cost = (Dirent::SIZE + name.len()) as u64;
        if used + cost > BLK {
            blocks.push((first, k, used));
            first = k;
            used = 0;
        }
        used += cost;
    }
    blocks.push((first, entries.len(), used));
    blocks
}

/// Size in bytes of a directory's data: full dirent blocks, then the partial last one.
fn dir_size(children: &BTreeMap<Vec<u8>, NodeId>) -> u64 {
    let blocks = dir_blocks(&sorted_entries(children));
    let last = blocks.last().map_or(0, |b| b.2);
    (blocks.len() as u64 - 1) * BLK + last
}

/// Best-fit placement of inodes in the metadata area: an inode (with its xattrs and inline tail) that fits
/// in a block never crosses a block boundary; larger ones (long chunk index arrays) start a fresh block.
#[derive(Default)]
struct Packer {
    /// Blocks used so far.
    blocks: u64,
    /// `free[n]`: blocks with exactly `n` free 32-byte slots at their end.
    free: Vec<Vec<u64>>,
}

impl Packer {
    const SLOTS: u64 = BLK >> ISLOT_BITS;

    /// Places an item of `len` bytes (32-byte aligned); returns its offset in the metadata area.
    fn place(&mut self, len: u64) -> u64 {
        if self.free.is_empty() {
            self.free = vec![Vec::new(); Self::SLOTS as usize];
        }
        let need = len >> ISLOT_BITS;
        if len <= BLK {
            for n in need as usize..Self::SLOTS as usize {
                if let Some(b) = self.free[n].pop() {
                    let off = b * BLK + BLK - ((n as u64) << ISLOT_BITS);
                    self.release(b, n as u64 - need);
                    return off;
                }
            }
        }
        let b = self.blocks;
        let nb = len.div_ceil(BLK).max(1);
        self.blocks += nb;
        self.release(b + nb - 1, nb * Self::SLOTS - need);
        b * BLK
    }

    fn release(&mut self, block: u64, slots: u64) {
        if slots > 0 && slots < Self::SLOTS {
            self.free[slots as usize].push(block);
        }
    }
}

/// Everything the encoder needs once inodes and data blocks are placed.
struct Emit<'a> {
    tree: &'a Tree,
    walk: &'a Walk<'a>,
    plans: &'a [Plan],
    devices: &'a [DeviceSlot],
    chunk_bits: u8,
    resolve: &'a dyn Fn(&Digest) -> Option<ChunkLoc>,
    /// Byte offset of the metadata area.
    meta_base: u64,
}

impl Emit<'_> {
    fn emit(&self, i: usize, img: &mut [u8]) -> Result<(), BuildError> {
        let p = &self.plans[i];
        let node = &self.tree.nodes[self.walk.order[i]];
        let startblk = p.startblk as u32; // < total blocks, checked to fit u32
        let i_u = match &node.kind {
            NodeKind::CharDev { rdev } | NodeKind::BlockDev { rdev } => {
                new_encode_dev(*rdev).unwrap_or(0) // checked when planning
            }
            NodeKind::Fifo | NodeKind::Socket => 0,
            _ => match p.layout {
                LAYOUT_CHUNK_BASED => {
                    u32::from((self.chunk_bits - BLKSZ_BITS) as u16 | CHUNK_FORMAT_INDEXES)
                }
                LAYOUT_FLAT_INLINE if p.data_blocks == 0 => NULL_ADDR,
                _ if p.data_blocks == 0 => 0,
                _ => startblk,
            },
        };
        let inode = InodeExtended {
            i_format: I_VERSION_EXTENDED | (p.layout << I_DATALAYOUT_BIT),
            i_xattr_icount: p.icount,
            i_mode: node.mode() as u16, // type and 0o7777 bits: fits
            i_nb: 0,
            i_size: p.size,
            i_u,
            i_ino: i as u32 + 1,
            i_uid: node.meta.uid,
            i_gid: node.meta.gid,
            i_mtime: node.meta.mtime as u64,
            i_mtime_nsec: node.meta.mtime_nsec,
            i_nlink: node.nlink(self.tree),
            reserved: [0; 16],
        };
        let base = (self.meta_base + p.meta_off) as usize;
        inode.write_to(img, base);
        let after = base + InodeExtended::SIZE;
        img[after..after + p.xattrs.len()].copy_from_slice(&p.xattrs);
        let after = after + p.xattrs.len();
        match &node.kind {
            NodeKind::Dir(children) => {
                let data = self.dir_data(i, children)?;
                self.put_flat(p, &data, after, img);
            }
            NodeKind::Symlink(target) => self.put_flat(p, target, after, img),
            NodeKind::File {
                data: FileData::Inline(bytes),
                ..
            } => self.put_flat(p, bytes, after, img),
            NodeKind::File {
                data: FileData::Chunks(chunks),
                size,
            } => {
                let at = align_up(after as u64, 8) as usize;
                for (k, chunk) in chunks.iter().enumerate() {
                    let index = self.chunk_index(i, *size, k as u64, chunk.as_ref())?;
                    index.write_to(img, at + k * ChunkIndex::SIZE);
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// Stores a flat inode's bytes: full blocks in the data area, the tail inline when FLAT_INLINE.
    fn put_flat(&self, p: &Plan, data: &[u8], inline_at: usize, img: &mut [u8]) {
        let in_blocks = data.len() - p.tail as usize;
        let blk = (p.startblk * BLK) as usize;
        img[blk..blk + in_blocks].copy_from_slice(&data[..in_blocks]);
        img[inline_at..inline_at + p.tail as usize].copy_from_slice(&data[in_blocks..]);
    }

    fn chunk_index(
        &self,
        i: usize,
        size: u64,
        k: u64,
        chunk: Option<&Digest>,
    ) -> Result<ChunkIndex, BuildError> {
        let Some(digest) = chunk else {
            return Ok(ChunkIndex {
                startblk_hi: 0,
                device_id: 0,
                startblk_lo: NULL_ADDR,
            });
        };
        let path = || self.walk.path(i);
        let loc = (self.resolve)(digest)
            .ok_or_else(|| NodeFault::NoLocation { k, digest: *digest }.at(path()))?;
        let Some(slot) = (loc.device as usize)
            .checked_sub(1)
            .and_then(|d| self.devices.get(d))
        else {
            let (device, devices) = (loc.device, self.devices.len());
            return Err(NodeFault::NoDevice { k, device, devices }.at(path()).into());
        };
        let chunk_size = 1u64 << self.chunk_bits;
        let len = (size - k * chunk_size).min(chunk_size);
        let end = u64::from(loc.block) + len.div_ceil(BLK);
        if loc.block == NULL_ADDR || end > u64::from(slot.blocks) {
            let fault = NodeFault::OutsideDevice {
                k,
                device: loc.device,
                block: loc.block,
                len,
                blocks: slot.blocks,
            };
            return Err(fault.at(path()).into());
        }
        Ok(ChunkIndex {
            startblk_hi: 0,
            device_id: loc.device,
            startblk_lo: loc.block,
        })
    }

    /// A directory's dirent blocks (the last one partial).
    fn dir_data(
        &self,
        i: usize,
        children: &BTreeMap<Vec<u8>, NodeId>,
    ) -> Result<Vec<u8>, BuildError> {
        let entries = sorted_entries(children);
        let blocks = dir_blocks(&entries);
        let mut out = Vec::with_capacity(self.plans[i].size as usize);
        for (b, &(first, end, _)) in blocks.iter().enumerate() {
            let start = out.len();
            let mut nameoff = (end - first) * Dirent::SIZE;
            for &(name, target) in &entries[first..end] {
                let (nid, file_type) = match target {
                    Target::Dot => (self.plans[i].nid(), FT_DIR),
                    Target::DotDot => (self.plans[self.walk.parent[i].0 as usize].nid(), FT_DIR),
                    Target::Child(id) => {
                        let node = &self.tree.nodes[id];
                        let at = self.walk.index[id] as usize;
                        (self.plans[at].nid(), file_type_of_mode(node.mode()))
                    }
                };
                let de = Dirent {
                    nid,
                    nameoff: nameoff as u16, // < block size
                    file_type,
                    reserved: 0,
                };
                out.extend_from_slice(&de.encode());
                nameoff += name.len();
            }
            for &(name, _) in &entries[first..end] {
                out.extend_from_slice(name);
            }
            if b + 1 < blocks.len() {
                out.resize(start + BLKSZ, 0);
            }
        }
        if out.len() as u64 != self.plans[i].size {
            let (got, planned) = (out.len(), self.plans[i].size);
            return Err(NodeFault::DirSize { got, planned }
                .at(self.walk.path(i))
                .into());
        }
        Ok(out)
    }
}

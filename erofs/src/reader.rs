//! A defensive reader of EROFS images: the subset strata's writer (`strata_builder::erofs::write_image`) produces plus compact inodes,
//! shared xattrs and 4-byte chunk block maps.
//!
//! Every offset read from the image is bounds-checked and every size is checked against the image before
//! anything is allocated for it, so malformed input gives an [`ErofsError`] naming what is wrong and where,
//! never a panic, an out-of-bounds slice, a huge allocation or an endless loop.

use crate::device::{ChunkLoc, DeviceSlot};
use crate::format::*;

/// One extended attribute: full name and value.
type Xattr = (Vec<u8>, Vec<u8>);

/// Why an image (or a part of it) cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum ErofsError {
    #[error("image of {len} bytes is too short to hold a superblock")]
    TooShort { len: usize },
    #[error("bad superblock: {0}")]
    Superblock(String),
    #[error("superblock checksum mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    Checksum { stored: u32, computed: u32 },
    #[error("unsupported EROFS feature: {0}")]
    Unsupported(String),
    #[error("{what} at byte {offset} (+{len}) lies outside the {size}-byte image")]
    OutOfBounds {
        what: &'static str,
        offset: u64,
        len: u64,
        size: u64,
    },
    #[error("nid {nid}: {why}")]
    Inode { nid: u64, why: String },
    #[error("nid {nid}: directory block at byte {offset} of its data: {why}")]
    Dir { nid: u64, offset: u64, why: String },
    #[error("re-pointing the metadata: {0}")]
    Repoint(String),
}

fn bad(nid: u64, why: impl Into<String>) -> ErofsError {
    ErofsError::Inode {
        nid,
        why: why.into(),
    }
}

/// An inode's data layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    FlatPlain,
    CompressedFull,
    FlatInline,
    CompressedCompact,
    ChunkBased,
}

impl Layout {
    fn from_raw(v: u16) -> Option<Layout> {
        Some(match v {
            LAYOUT_FLAT_PLAIN => Layout::FlatPlain,
            LAYOUT_COMPRESSED_FULL => Layout::CompressedFull,
            LAYOUT_FLAT_INLINE => Layout::FlatInline,
            LAYOUT_COMPRESSED_COMPACT => Layout::CompressedCompact,
            LAYOUT_CHUNK_BASED => Layout::ChunkBased,
            _ => return None,
        })
    }
}

/// A decoded inode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Inode {
    pub nid: u64,
    /// `i_ino` (32-bit stat compatibility; the kernel reports the nid as `st_ino`).
    pub ino: u32,
    /// Extended (64-byte) rather than compact (32-byte) inode.
    pub extended: bool,
    /// `st_mode`: type and permission bits.
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    pub mtime: i64,
    pub mtime_nsec: u32,
    pub nlink: u32,
    /// Device number of character and block devices (glibc `makedev` encoding), else 0.
    pub rdev: u64,
    /// Extended attributes with full names, inline ones first, then shared ones, in on-disk order.
    pub xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    pub layout: Layout,
    /// log2 of the chunk size of a chunk-based file, else 0.
    pub chunk_bits: u8,
    /// Raw `i_u`: start block (flat layouts), chunk format (chunk-based) or encoded device number.
    pub raw_u: u32,
    /// Byte offset of the inode in the image.
    pub offset: u64,
    /// Byte offset just after the inode and its inline xattrs (inline data, chunk indexes).
    pub tail_offset: u64,
}

impl Inode {
    pub fn is_dir(&self) -> bool {
        self.mode & 0o170000 == 0o040000
    }

    /// An overlay whiteout: a 0:0 character device.
    pub fn is_whiteout(&self) -> bool {
        self.mode & 0o170000 == 0o020000 && self.rdev == 0
    }

    /// An overlay opaque directory (`trusted.overlay.opaque=y`).
    pub fn is_opaque(&self) -> bool {
        self.xattrs
            .iter()
            .any(|(k, v)| k == OPAQUE_XATTR && v == b"y")
    }

    /// The dirent file type (`FT_*`) of this inode's mode.
    pub fn file_type(&self) -> u8 {
        file_type_of_mode(self.mode)
    }
}

/// A directory entry (never `.` or `..` from [`ErofsImage::read_dir`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirEntry {
    pub name: Vec<u8>,
    pub nid: u64,
    /// `FT_*` from [`crate::format`].
    pub file_type: u8,
}

/// Marks directory `nid` as entered by a walk. A valid image reaches each directory once (directories
/// have no hard links), so a second visit is a cycle — an error, where a walk would otherwise go on
/// forever and grow its stack until memory runs out (found by `fuzzing::walk`).
pub fn enter_dir(seen: &mut std::collections::HashSet<u64>, nid: u64) -> Result<(), ErofsError> {
    match seen.insert(nid) {
        true => Ok(()),
        false => Err(bad(nid, "directory reached twice: a cycle")),
    }
}

/// Largest all-hole FLAT_PLAIN file [`ErofsImage::data`] materialises.
const MAX_HOLE_READ: u64 = 1 << 28;

/// A parsed EROFS image held in memory.
#[derive(Clone, Debug)]
pub struct ErofsImage {
    data: Vec<u8>,
    sb: SuperBlock,
    devices: Vec<DeviceSlot>,
    device_id_mask: u16,
}

impl ErofsImage {
    /// Checks the superblock (magic, block size, features, checksum), reads the device table and checks
    /// that the root is a directory.
    pub fn parse(data: Vec<u8>) -> Result<Self, ErofsError> {
        let sb = SuperBlock::read(&data, SUPER_OFFSET)
            .ok_or(ErofsError::TooShort { len: data.len() })?;
        if sb.magic != EROFS_MAGIC {
            return Err(ErofsError::Superblock(format!(
                "magic {:#010x}, expected {EROFS_MAGIC:#010x}",
                sb.magic
            )));
        }
        if !(9..=16).contains(&sb.blkszbits) {
            return Err(ErofsError::Unsupported(format!(
                "block size bits {}",
                sb.blkszbits
            )));
        }
        let unknown = sb.feature_incompat & !FEATURE_INCOMPAT_ALL;
        if unknown != 0 {
            return Err(ErofsError::Unsupported(format!(
                "unknown incompatible features {unknown:#x}"
            )));
        }
        for (bit, name) in [
            (FEATURE_INCOMPAT_48BIT, "48-bit block addresses"),
            (FEATURE_INCOMPAT_METABOX, "metabox"),
        ] {
            if sb.feature_incompat & bit != 0 {
                return Err(ErofsError::Unsupported(name.to_string()));
            }
        }
        if sb.dirblkbits != 0 {
            return Err(ErofsError::Unsupported(format!(
                "directory block bits {}",
                sb.dirblkbits
            )));
        }
        let bsz = 1usize << sb.blkszbits;
        if sb.feature_compat & FEATURE_COMPAT_SB_CHKSUM != 0 {
            let len = sb_checksum_span(bsz);
            let region = data
                .get(SUPER_OFFSET..SUPER_OFFSET + len)
                .ok_or(ErofsError::TooShort { len: data.len() })?;
            let computed = sb_checksum(region);
            if computed != sb.checksum {
                return Err(ErofsError::Checksum {
                    stored: sb.checksum,
                    computed,
                });
            }
        }
        let extra = if sb.feature_incompat & FEATURE_INCOMPAT_DEVICE_TABLE != 0 {
            sb.extra_devices
        } else {
            0
        };
        let mut devices = Vec::with_capacity(extra as usize);
        let table = u64::from(sb.devt_slotoff) * DEVT_SLOT_SIZE as u64;
        for k in 0..u64::from(extra) {
            let at = table + k * DEVT_SLOT_SIZE as u64;
            let slot = usize::try_from(at)
                .ok()
                .and_then(|at| RawDeviceSlot::read(&data, at))
                .ok_or(ErofsError::OutOfBounds {
                    what: "device slot",
                    offset: at,
                    len: DEVT_SLOT_SIZE as u64,
                    size: data.len() as u64,
                })?;
            devices.push(DeviceSlot {
                tag: slot.tag,
                blocks: slot.blocks_lo,
            });
        }
        let device_id_mask = (u32::from(extra) + 1).next_power_of_two() - 1;
        let img = ErofsImage {
            data,
            sb,
            devices,
            device_id_mask: device_id_mask as u16, // extra + 1 <= 65536
        };
        let root = img.inode(img.root_nid())?;
        if !root.is_dir() {
            return Err(ErofsError::Superblock(format!(
                "root nid {} is not a directory (mode {:o})",
                root.nid, root.mode
            )));
        }
        Ok(img)
    }

    pub fn root_nid(&self) -> u64 {
        u64::from(self.sb.root_nid)
    }

    /// The device table (slot *i* is device id *i + 1*).
    pub fn devices(&self) -> &[DeviceSlot] {
        &self.devices
    }

    /// Number of inodes the superblock claims.
    pub fn inode_count(&self) -> u64 {
        self.sb.inos
    }

    pub fn superblock(&self) -> &SuperBlock {
        &self.sb
    }

    pub fn block_size(&self) -> u64 {
        1 << self.sb.blkszbits
    }

    /// The raw image.
    pub fn bytes(&self) -> &[u8] {
        &self.data
    }

    /// `len` bytes at `offset`, or an error naming `what`.
    fn slice(&self, what: &'static str, offset: u64, len: u64) -> Result<&[u8], ErofsError> {
        let oob = || ErofsError::OutOfBounds {
            what,
            offset,
            len,
            size: self.data.len() as u64,
        };
        let start = usize::try_from(offset).map_err(|_| oob())?;
        let end = usize::try_from(len)
            .ok()
            .and_then(|l| start.checked_add(l))
            .ok_or_else(oob)?;
        self.data.get(start..end).ok_or_else(oob)
    }

    /// Decodes the inode `nid`, with its xattrs.
    pub fn inode(&self, nid: u64) -> Result<Inode, ErofsError> {
        let bsz = self.block_size();
        let offset = u64::from(self.sb.meta_blkaddr)
            .checked_mul(bsz)
            .zip(nid.checked_mul(1 << ISLOT_BITS))
            .and_then(|(a, b)| a.checked_add(b))
            .ok_or_else(|| bad(nid, "inode offset overflows"))?;
        let head = self.slice("inode", offset, 2)?;
        let format = u16::from_le_bytes([head[0], head[1]]);
        if format & !I_ALL != 0 {
            return Err(bad(nid, format!("unknown i_format bits {format:#x}")));
        }
        let raw_layout = (format >> I_DATALAYOUT_BIT) & I_DATALAYOUT_MASK;
        let layout = Layout::from_raw(raw_layout)
            .ok_or_else(|| bad(nid, format!("unknown data layout {raw_layout}")))?;
        let extended = format & I_VERSION_MASK == I_VERSION_EXTENDED;
        let mut inode = if extended {
            let b = self.slice("extended inode", offset, InodeExtended::SIZE as u64)?;
            let di = InodeExtended::read(b, 0).ok_or_else(|| bad(nid, "truncated inode"))?;
            Inode {
                nid,
                ino: di.i_ino,
                extended,
                mode: u32::from(di.i_mode),
                uid: di.i_uid,
                gid: di.i_gid,
                size: di.i_size,
                mtime: di.i_mtime as i64,
                mtime_nsec: di.i_mtime_nsec,
                nlink: di.i_nlink,
                rdev: 0,
                xattrs: Vec::new(),
                layout,
                chunk_bits: 0,
                raw_u: di.i_u,
                offset,
                tail_offset: offset + InodeExtended::SIZE as u64,
            }
        } else {
            let b = self.slice("compact inode", offset, InodeCompact::SIZE as u64)?;
            let dic = InodeCompact::read(b, 0).ok_or_else(|| bad(nid, "truncated inode"))?;
            let is_dir = u32::from(dic.i_mode) & 0o170000 == 0o040000;
            let nlink = if format & I_NLINK_1 != 0 && !is_dir {
                1
            } else {
                u32::from(dic.i_nb)
            };
            Inode {
                nid,
                ino: dic.i_ino,
                extended,
                mode: u32::from(dic.i_mode),
                uid: u32::from(dic.i_uid),
                gid: u32::from(dic.i_gid),
                size: u64::from(dic.i_size),
                mtime: (self.sb.epoch as i64).wrapping_add(i64::from(dic.i_mtime)),
                mtime_nsec: self.sb.fixed_nsec,
                nlink,
                rdev: 0,
                xattrs: Vec::new(),
                layout,
                chunk_bits: 0,
                raw_u: dic.i_u,
                offset,
                tail_offset: offset + InodeCompact::SIZE as u64,
            }
        };
        let ft = inode.file_type();
        if ft == FT_CHRDEV || ft == FT_BLKDEV {
            inode.rdev = new_decode_dev(inode.raw_u);
        }
        if layout == Layout::ChunkBased {
            let cf = inode.raw_u as u16; // chunk_info.format is the low half of i_u
            if cf & !CHUNK_FORMAT_ALL != 0 {
                return Err(bad(nid, format!("unknown chunk format bits {cf:#x}")));
            }
            if cf & CHUNK_FORMAT_48BIT != 0 {
                return Err(ErofsError::Unsupported(format!(
                    "nid {nid}: 48-bit chunk indexes"
                )));
            }
            inode.chunk_bits = self.sb.blkszbits + (cf & CHUNK_FORMAT_BLKBITS_MASK) as u8;
        }
        // Inline xattrs.
        let icount = {
            let b = self.slice("inode", offset + 2, 2)?;
            u16::from_le_bytes([b[0], b[1]])
        };
        let xsize = xattr_ibody_size(icount) as u64;
        if xsize > 0 {
            let body = self.slice("inline xattrs", inode.tail_offset, xsize)?;
            inode.xattrs = self.parse_xattrs(nid, body)?;
        }
        inode.tail_offset += xsize;
        Ok(inode)
    }

    fn parse_xattrs(&self, nid: u64, body: &[u8]) -> Result<Vec<Xattr>, ErofsError> {
        let h = XattrIbodyHeader::read(body, 0)
            .ok_or_else(|| bad(nid, "inline xattr body shorter than its header"))?;
        let shared = usize::from(h.h_shared_count);
        let mut pos = XattrIbodyHeader::SIZE + 4 * shared;
        if pos > body.len() {
            return Err(bad(
                nid,
                format!("{shared} shared xattr ids overflow the inline xattr body"),
            ));
        }
        let mut out = Vec::new();
        while pos < body.len() {
            let (entry, next) = decode_xattr(nid, body, pos)?;
            out.push(entry);
            pos = next;
        }
        let shared_base = u64::from(self.sb.xattr_blkaddr) * self.block_size();
        for k in 0..shared {
            let at = XattrIbodyHeader::SIZE + 4 * k;
            let id = u32::from_le_bytes([body[at], body[at + 1], body[at + 2], body[at + 3]]);
            let start = shared_base + u64::from(id) * 4;
            // A shared entry is at most 4 + 255 + 65535 bytes; read what exists of that window.
            let len = (self.data.len() as u64)
                .saturating_sub(start)
                .min(4 + 255 + 65535);
            let window = self.slice("shared xattr", start, len)?;
            let (entry, _) = decode_xattr(nid, window, 0)?;
            out.push(entry);
        }
        Ok(out)
    }

    /// The bytes of a flat (FLAT_PLAIN or FLAT_INLINE) inode: a file's content, a symlink's target or a
    /// directory's dirent blocks.
    pub fn data(&self, inode: &Inode) -> Result<Vec<u8>, ErofsError> {
        let nid = inode.nid;
        let bsz = self.block_size();
        let size = inode.size;
        if size == 0 {
            return Ok(Vec::new());
        }
        match inode.layout {
            Layout::FlatPlain => {
                if inode.raw_u == NULL_ADDR {
                    if size > MAX_HOLE_READ {
                        return Err(bad(
                            nid,
                            format!("all-hole file of {size} bytes is too large"),
                        ));
                    }
                    return Ok(vec![0; size as usize]);
                }
                let start = u64::from(inode.raw_u) * bsz;
                Ok(self.slice("file data", start, size)?.to_vec())
            }
            Layout::FlatInline => {
                // Everything before the last (partial) block is in blocks; the last block is inline.
                let head = (size.div_ceil(bsz) - 1) * bsz;
                let tail = size - head;
                let in_block = inode.tail_offset % bsz;
                if in_block + tail > bsz {
                    return Err(bad(
                        nid,
                        format!(
                            "{tail} bytes of inline data at byte {} cross a block boundary",
                            inode.tail_offset
                        ),
                    ));
                }
                let mut out = Vec::new();
                if head > 0 {
                    if inode.raw_u == NULL_ADDR {
                        return Err(bad(nid, "inline inode with blocks but no start block"));
                    }
                    let start = u64::from(inode.raw_u) * bsz;
                    out.extend_from_slice(self.slice("file data", start, head)?);
                }
                out.extend_from_slice(self.slice("inline data", inode.tail_offset, tail)?);
                Ok(out)
            }
            other => Err(bad(
                nid,
                format!("data of a {other:?} inode cannot be read as flat bytes"),
            )),
        }
    }

    /// The chunk locations of a chunk-based file, in order; `None` is a hole. Device 0 is the image itself.
    pub fn chunks(&self, inode: &Inode) -> Result<Vec<Option<ChunkLoc>>, ErofsError> {
        let count = inode.size.div_ceil(1u64 << inode.chunk_bits.min(63));
        self.chunk_range(inode, 0..count)
    }

    /// The locations of chunks `range` of a chunk-based file (clipped to its chunk count), without
    /// decoding the rest of its index: what a read of a few chunks of a large file needs.
    pub fn chunk_range(
        &self,
        inode: &Inode,
        range: std::ops::Range<u64>,
    ) -> Result<Vec<Option<ChunkLoc>>, ErofsError> {
        let nid = inode.nid;
        if inode.layout != Layout::ChunkBased {
            return Err(bad(
                nid,
                format!("{:?} inode is not chunk-based", inode.layout),
            ));
        }
        let count = inode.size.div_ceil(1u64 << inode.chunk_bits.min(63));
        let (first, end) = (range.start.min(count), range.end.min(count));
        let indexes = (inode.raw_u as u16) & CHUNK_FORMAT_INDEXES != 0;
        let unit: u64 = if indexes { 8 } else { 4 };
        let start = align_up(inode.tail_offset, unit) + first * unit;
        let len = (end.saturating_sub(first))
            .checked_mul(unit)
            .ok_or_else(|| bad(nid, "chunk count overflows"))?;
        let table = self.slice("chunk indexes", start, len)?;
        let mut out = Vec::with_capacity(count as usize);
        for (k, raw) in table.chunks_exact(unit as usize).enumerate() {
            let k = first + k as u64;
            if indexes {
                let ci =
                    ChunkIndex::read(raw, 0).ok_or_else(|| bad(nid, "truncated chunk index"))?;
                if ci.startblk_lo == NULL_ADDR {
                    out.push(None);
                    continue;
                }
                let device = ci.device_id & self.device_id_mask;
                if usize::from(device) > self.devices.len() {
                    return Err(bad(
                        nid,
                        format!(
                            "chunk {k} is on device {device}, but the image has {} extra devices",
                            self.devices.len()
                        ),
                    ));
                }
                out.push(Some(ChunkLoc {
                    device,
                    block: ci.startblk_lo,
                }));
            } else {
                let blk = u32::from_le_bytes([raw[0], raw[1], raw[2], raw[3]]);
                out.push((blk != NULL_ADDR).then_some(ChunkLoc {
                    device: 0,
                    block: blk,
                }));
            }
        }
        Ok(out)
    }

    /// Every entry of a directory, including `.` and `..`, in on-disk order.
    pub fn read_dir_all(&self, dir: &Inode) -> Result<Vec<DirEntry>, ErofsError> {
        let nid = dir.nid;
        if !dir.is_dir() {
            return Err(bad(nid, format!("not a directory (mode {:o})", dir.mode)));
        }
        let data = self.data(dir)?;
        let bsz = self.block_size() as usize;
        let mut out = Vec::new();
        let mut pos = 0usize;
        while pos < data.len() {
            let blk = &data[pos..data.len().min(pos + bsz)];
            let fail = |why: String| ErofsError::Dir {
                nid,
                offset: pos as u64,
                why,
            };
            let de0 = Dirent::read(blk, 0)
                .ok_or_else(|| fail(format!("{} bytes cannot hold a dirent", blk.len())))?;
            let first = usize::from(de0.nameoff);
            if first < Dirent::SIZE
                || first >= bsz
                || first % Dirent::SIZE != 0
                || first > blk.len()
            {
                return Err(fail(format!("bad first name offset {first}")));
            }
            let count = first / Dirent::SIZE;
            for j in 0..count {
                let de = Dirent::read(blk, j * Dirent::SIZE)
                    .ok_or_else(|| fail(format!("dirent {j} truncated")))?;
                let start = usize::from(de.nameoff);
                let end = match Dirent::read(blk, (j + 1) * Dirent::SIZE) {
                    Some(next) if j + 1 < count => usize::from(next.nameoff),
                    _ => blk.len(),
                };
                if start < first || start > end || end > blk.len() {
                    return Err(fail(format!(
                        "dirent {j}: name range {start}..{end} is invalid"
                    )));
                }
                let mut name = &blk[start..end];
                if j + 1 == count {
                    if let Some(nul) = name.iter().position(|&b| b == 0) {
                        name = &name[..nul];
                    }
                }
                if name.is_empty() || name.len() > NAME_LEN || name.contains(&0) {
                    return Err(fail(format!(
                        "dirent {j}: invalid name of {} bytes",
                        name.len()
                    )));
                }
                out.push(DirEntry {
                    name: name.to_vec(),
                    nid: de.nid,
                    file_type: de.file_type,
                });
            }
            pos += bsz;
        }
        Ok(out)
    }

    /// The entries of a directory without `.` and `..`.
    pub fn read_dir(&self, dir: &Inode) -> Result<Vec<DirEntry>, ErofsError> {
        let mut entries = self.read_dir_all(dir)?;
        entries.retain(|e| e.name != b"." && e.name != b"..");
        Ok(entries)
    }

    /// Whether any inode reachable from the root carries an xattr (a walk of every directory; stops
    /// at the first one found). A layer without any may tell its readers it has no xattrs at all.
    pub fn any_xattrs(&self) -> Result<bool, ErofsError> {
        let root = self.inode(self.root_nid())?;
        if !root.xattrs.is_empty() {
            return Ok(true);
        }
        let mut seen = std::collections::HashSet::new();
        let mut dirs = vec![root];
        while let Some(dir) = dirs.pop() {
            enter_dir(&mut seen, dir.nid)?;
            for e in self.read_dir(&dir)? {
                let inode = self.inode(e.nid)?;
                if !inode.xattrs.is_empty() {
                    return Ok(true);
                }
                if inode.is_dir() {
                    dirs.push(inode);
                }
            }
        }
        Ok(false)
    }

    /// Looks a `/`-separated path up from the root without following symlinks (`.` and `..` are resolved
    /// through the directories' own entries). `Ok(None)` if a component is missing or not a directory.
    pub fn lookup(&self, path: &[u8]) -> Result<Option<Inode>, ErofsError> {
        let mut cur = self.inode(self.root_nid())?;
        for comp in path.split(|&b| b == b'/').filter(|c| !c.is_empty()) {
            if !cur.is_dir() {
                return Ok(None);
            }
            let entries = self.read_dir_all(&cur)?;
            match entries.iter().find(|e| e.name == comp) {
                Some(e) => cur = self.inode(e.nid)?,
                None => return Ok(None),
            }
        }
        Ok(Some(cur))
    }
}

/// Decodes the xattr entry at `pos` of `buf`: its full name and value, and where the next entry starts.
fn decode_xattr(nid: u64, buf: &[u8], pos: usize) -> Result<(Xattr, usize), ErofsError> {
    let e = XattrEntry::read(buf, pos)
        .ok_or_else(|| bad(nid, format!("xattr entry at body byte {pos} truncated")))?;
    let name_start = pos + XattrEntry::SIZE;
    let value_start = name_start + usize::from(e.e_name_len);
    let end = value_start + usize::from(e.e_value_size);
    if end > buf.len() {
        return Err(bad(
            nid,
            format!(
                "xattr entry at body byte {pos} overruns its area ({end} > {})",
                buf.len()
            ),
        ));
    }
    let prefix = if e.e_name_index & XATTR_LONG_PREFIX != 0 {
        return Err(ErofsError::Unsupported(format!(
            "nid {nid}: long xattr name prefix {}",
            e.e_name_index & !XATTR_LONG_PREFIX
        )));
    } else {
        xattr_prefix(e.e_name_index)
            .ok_or_else(|| bad(nid, format!("unknown xattr name index {}", e.e_name_index)))?
    };
    let mut name = prefix.to_vec();
    name.extend_from_slice(&buf[name_start..value_start]);
    let value = buf[value_start..end].to_vec();
    Ok(((name, value), align_up(end as u64, 4) as usize))
}

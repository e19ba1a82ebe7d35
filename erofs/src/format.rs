//! EROFS on-disk constants and fixed-layout structures.
//!
//! Every structure is little endian and declared with [`le_struct!`], which generates `encode`/`decode`
//! from the field list in order and asserts at compile time that the fields add up to the declared size,
//! so a mistyped field cannot shift the layout silently. Names follow the kernel's `fs/erofs/erofs_fs.h`.

/// `EROFS_SUPER_MAGIC_V1`.
pub const EROFS_MAGIC: u32 = 0xE0F5_E1E2;
/// Byte offset of the superblock in block 0.
pub const SUPER_OFFSET: usize = 1024;
/// Block size bits we write (4 KiB blocks).
pub const BLKSZ_BITS: u8 = 12;
/// Block size we write.
pub const BLKSZ: usize = 1 << BLKSZ_BITS;
/// Inode slots are 32 bytes: `nid = (offset - meta_blkaddr * blksz) / 32`.
pub const ISLOT_BITS: u32 = 5;
/// Size of one device table slot.
pub const DEVT_SLOT_SIZE: usize = 128;
/// A hole chunk / "no block" address (`EROFS_NULL_ADDR`, truncated to 32 bits).
pub const NULL_ADDR: u32 = 0xFFFF_FFFF;
/// Longest name of a directory entry.
pub const NAME_LEN: usize = 255;

// feature_compat
pub const FEATURE_COMPAT_SB_CHKSUM: u32 = 0x1;
pub const FEATURE_COMPAT_MTIME: u32 = 0x2;
pub const FEATURE_COMPAT_XATTR_FILTER: u32 = 0x4;

// feature_incompat
pub const FEATURE_INCOMPAT_ZERO_PADDING: u32 = 0x1;
pub const FEATURE_INCOMPAT_COMPR_CFGS: u32 = 0x2;
pub const FEATURE_INCOMPAT_CHUNKED_FILE: u32 = 0x4;
pub const FEATURE_INCOMPAT_DEVICE_TABLE: u32 = 0x8;
pub const FEATURE_INCOMPAT_ZTAILPACKING: u32 = 0x10;
pub const FEATURE_INCOMPAT_FRAGMENTS: u32 = 0x20;
pub const FEATURE_INCOMPAT_XATTR_PREFIXES: u32 = 0x40;
pub const FEATURE_INCOMPAT_48BIT: u32 = 0x80;
pub const FEATURE_INCOMPAT_METABOX: u32 = 0x100;
/// Every incompat bit a current kernel knows.
pub const FEATURE_INCOMPAT_ALL: u32 = (FEATURE_INCOMPAT_METABOX << 1) - 1;

// i_format
pub const I_VERSION_MASK: u16 = 0x1;
pub const I_VERSION_COMPACT: u16 = 0;
pub const I_VERSION_EXTENDED: u16 = 1;
pub const I_DATALAYOUT_BIT: u16 = 1;
pub const I_DATALAYOUT_MASK: u16 = 0x7;
/// Compact non-directory inodes: nlink is 1 and `i_nb` holds block-address MSBs.
pub const I_NLINK_1: u16 = 1 << 4;
/// Every `i_format` bit a current kernel knows.
pub const I_ALL: u16 = (1 << 5) - 1;

// data layouts
pub const LAYOUT_FLAT_PLAIN: u16 = 0;
pub const LAYOUT_COMPRESSED_FULL: u16 = 1;
pub const LAYOUT_FLAT_INLINE: u16 = 2;
pub const LAYOUT_COMPRESSED_COMPACT: u16 = 3;
pub const LAYOUT_CHUNK_BASED: u16 = 4;

// chunk_info.format
pub const CHUNK_FORMAT_BLKBITS_MASK: u16 = 0x1F;
pub const CHUNK_FORMAT_INDEXES: u16 = 0x20;
pub const CHUNK_FORMAT_48BIT: u16 = 0x40;
pub const CHUNK_FORMAT_ALL: u16 = (CHUNK_FORMAT_48BIT << 1) - 1;

// dirent file types
pub const FT_UNKNOWN: u8 = 0;
pub const FT_REG_FILE: u8 = 1;
pub const FT_DIR: u8 = 2;
pub const FT_CHRDEV: u8 = 3;
pub const FT_BLKDEV: u8 = 4;
pub const FT_FIFO: u8 = 5;
pub const FT_SOCK: u8 = 6;
pub const FT_SYMLINK: u8 = 7;

// xattr name indexes
pub const XATTR_INDEX_USER: u8 = 1;
pub const XATTR_INDEX_POSIX_ACL_ACCESS: u8 = 2;
pub const XATTR_INDEX_POSIX_ACL_DEFAULT: u8 = 3;
pub const XATTR_INDEX_TRUSTED: u8 = 4;
pub const XATTR_INDEX_LUSTRE: u8 = 5;
pub const XATTR_INDEX_SECURITY: u8 = 6;
/// Bit 7 of `e_name_index`: a long (infix) prefix from the prefix table.
pub const XATTR_LONG_PREFIX: u8 = 0x80;

/// The xattr name prefixes a short index stands for. For the two POSIX ACL indexes the whole name is the
/// prefix and the stored suffix is empty.
pub const XATTR_PREFIXES: &[(u8, &[u8])] = &[
    (XATTR_INDEX_USER, b"user."),
    (XATTR_INDEX_POSIX_ACL_ACCESS, b"system.posix_acl_access"),
    (XATTR_INDEX_POSIX_ACL_DEFAULT, b"system.posix_acl_default"),
    (XATTR_INDEX_TRUSTED, b"trusted."),
    (XATTR_INDEX_LUSTRE, b"lustre."),
    (XATTR_INDEX_SECURITY, b"security."),
];

/// The prefix of a short xattr name index.
pub fn xattr_prefix(index: u8) -> Option<&'static [u8]> {
    XATTR_PREFIXES
        .iter()
        .find(|(i, _)| *i == index)
        .map(|(_, p)| *p)
}

/// A fixed-size little-endian field.
pub trait LeField: Sized {
    const SIZE: usize;
    /// Writes the field into `out` (exactly `SIZE` bytes).
    fn put(&self, out: &mut [u8]);
    /// Reads the field from `b` (exactly `SIZE` bytes).
    fn get(b: &[u8]) -> Self;
}

macro_rules! le_int {
    ($($t:ty),*) => {$(
        impl LeField for $t {
            const SIZE: usize = std::mem::size_of::<$t>();
            fn put(&self, out: &mut [u8]) {
                out.copy_from_slice(&self.to_le_bytes());
            }
            fn get(b: &[u8]) -> Self {
                let mut a = [0u8; std::mem::size_of::<$t>()];
                a.copy_from_slice(b);
                <$t>::from_le_bytes(a)
            }
        }
    )*};
}
le_int!(u8, u16, u32, u64);

impl<const N: usize> LeField for [u8; N] {
    const SIZE: usize = N;
    fn put(&self, out: &mut [u8]) {
        out.copy_from_slice(self);
    }
    fn get(b: &[u8]) -> Self {
        let mut a = [0u8; N];
        a.copy_from_slice(b);
        a
    }
}

/// Declares a packed little-endian structure of a given size with `encode`, `decode` and `read`.
macro_rules! le_struct {
    ($(#[$m:meta])* pub struct $name:ident = $size:literal {
        $($(#[$fm:meta])* pub $f:ident : $t:ty),* $(,)?
    }) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub struct $name { $($(#[$fm])* pub $f: $t,)* }

        // The fields must fill the declared on-disk size exactly.
        const _: () = assert!(0 $(+ <$t as LeField>::SIZE)* == $size);

        impl $name {
            /// On-disk size in bytes.
            pub const SIZE: usize = $size;

            /// All fields zero.
            pub fn zeroed() -> Self {
                Self::decode(&[0u8; $size])
            }

            /// The on-disk bytes.
            pub fn encode(&self) -> [u8; $size] {
                let mut out = [0u8; $size];
                let mut off = 0usize;
                $(
                    LeField::put(&self.$f, &mut out[off..off + <$t as LeField>::SIZE]);
                    off += <$t as LeField>::SIZE;
                )*
                let _ = off;
                out
            }

            /// Decodes the on-disk bytes.
            pub fn decode(b: &[u8; $size]) -> Self {
                let mut off = 0usize;
                $(
                    let $f = <$t as LeField>::get(&b[off..off + <$t as LeField>::SIZE]);
                    off += <$t as LeField>::SIZE;
                )*
                let _ = off;
                Self { $($f,)* }
            }

            /// Decodes the structure at byte `at` of `b`, or `None` if it does not fit.
            pub fn read(b: &[u8], at: usize) -> Option<Self> {
                let end = at.checked_add($size)?;
                let bytes: &[u8; $size] = b.get(at..end)?.try_into().ok()?;
                Some(Self::decode(bytes))
            }

            /// Writes the structure at byte `at` of `out`, which must have room for it.
            pub fn write_to(&self, out: &mut [u8], at: usize) {
                out[at..at + $size].copy_from_slice(&self.encode());
            }
        }
    };
}

le_struct! {
    /// `struct erofs_super_block` (the first 128 bytes; later fields need `sb_extslots`).
    pub struct SuperBlock = 128 {
        pub magic: u32,
        pub checksum: u32,
        pub feature_compat: u32,
        pub blkszbits: u8,
        pub sb_extslots: u8,
        pub root_nid: u16,
        pub inos: u64,
        pub epoch: u64,
        pub fixed_nsec: u32,
        pub blocks: u32,
        pub meta_blkaddr: u32,
        pub xattr_blkaddr: u32,
        pub uuid: [u8; 16],
        pub volume_name: [u8; 16],
        pub feature_incompat: u32,
        pub available_compr_algs: u16,
        pub extra_devices: u16,
        pub devt_slotoff: u16,
        pub dirblkbits: u8,
        pub xattr_prefix_count: u8,
        pub xattr_prefix_start: u32,
        pub packed_nid: u64,
        pub xattr_filter_reserved: u8,
        pub reserved: [u8; 3],
        pub build_time: u32,
        pub rootnid_8b: u64,
        pub reserved2: [u8; 8],
    }
}

le_struct! {
    /// `struct erofs_deviceslot`: slot *i* describes device id *i + 1*.
    pub struct RawDeviceSlot = 128 {
        pub tag: [u8; 64],
        pub blocks_lo: u32,
        pub uniaddr_lo: u32,
        pub blocks_hi: u32,
        pub uniaddr_hi: u16,
        pub reserved: [u8; 50],
    }
}

le_struct! {
    /// `struct erofs_inode_extended` (64 bytes).
    pub struct InodeExtended = 64 {
        pub i_format: u16,
        pub i_xattr_icount: u16,
        pub i_mode: u16,
        pub i_nb: u16,
        pub i_size: u64,
        pub i_u: u32,
        pub i_ino: u32,
        pub i_uid: u32,
        pub i_gid: u32,
        pub i_mtime: u64,
        pub i_mtime_nsec: u32,
        pub i_nlink: u32,
        pub reserved: [u8; 16],
    }
}

le_struct! {
    /// `struct erofs_inode_compact` (32 bytes).
    pub struct InodeCompact = 32 {
        pub i_format: u16,
        pub i_xattr_icount: u16,
        pub i_mode: u16,
        pub i_nb: u16,
        pub i_size: u32,
        pub i_mtime: u32,
        pub i_u: u32,
        pub i_ino: u32,
        pub i_uid: u16,
        pub i_gid: u16,
        pub reserved: u32,
    }
}

le_struct! {
    /// `struct erofs_dirent` (12 bytes).
    pub struct Dirent = 12 {
        pub nid: u64,
        pub nameoff: u16,
        pub file_type: u8,
        pub reserved: u8,
    }
}

le_struct! {
    /// `struct erofs_xattr_ibody_header` (12 bytes), followed by `h_shared_count` u32 ids.
    pub struct XattrIbodyHeader = 12 {
        pub h_name_filter: u32,
        pub h_shared_count: u8,
        pub reserved: [u8; 7],
    }
}

le_struct! {
    /// `struct erofs_xattr_entry` (4 bytes), followed by the name suffix and the value.
    pub struct XattrEntry = 4 {
        pub e_name_len: u8,
        pub e_name_index: u8,
        pub e_value_size: u16,
    }
}

le_struct! {
    /// `struct erofs_inode_chunk_index` (8 bytes).
    pub struct ChunkIndex = 8 {
        pub startblk_hi: u16,
        pub device_id: u16,
        pub startblk_lo: u32,
    }
}

/// Size of the inline xattr body for `i_xattr_icount`.
pub fn xattr_ibody_size(icount: u16) -> usize {
    if icount == 0 {
        0
    } else {
        XattrIbodyHeader::SIZE + 4 * (icount as usize - 1)
    }
}

/// Rounds `v` up to a multiple of `align` (a power of two).
pub const fn align_up(v: u64, align: u64) -> u64 {
    (v + align - 1) & !(align - 1)
}

/// The dirent file type for `st_mode` type bits.
pub fn file_type_of_mode(mode: u32) -> u8 {
    match mode & 0o170000 {
        0o100000 => FT_REG_FILE,
        0o040000 => FT_DIR,
        0o020000 => FT_CHRDEV,
        0o060000 => FT_BLKDEV,
        0o010000 => FT_FIFO,
        0o140000 => FT_SOCK,
        0o120000 => FT_SYMLINK,
        _ => FT_UNKNOWN,
    }
}

/// Major number of a Linux (glibc `makedev`) device number.
pub fn dev_major(rdev: u64) -> u64 {
    ((rdev >> 8) & 0xfff) | ((rdev >> 32) & 0xffff_f000)
}

/// Minor number of a Linux (glibc `makedev`) device number (glibc masks to 32 bits: the bits above come
/// from the major).
pub fn dev_minor(rdev: u64) -> u64 {
    (rdev & 0xff) | ((rdev >> 12) & 0xffff_ff00)
}

/// glibc `makedev`.
pub fn makedev(major: u64, minor: u64) -> u64 {
    let (major, minor) = (major & 0xffff_ffff, minor & 0xffff_ffff);
    (minor & 0xff) | ((major & 0xfff) << 8) | ((minor & !0xff) << 12) | ((major & !0xfff) << 32)
}

/// The kernel's `new_encode_dev` of a `makedev` number, or `None` if it does not fit 12:20 bits.
pub fn new_encode_dev(rdev: u64) -> Option<u32> {
    let (major, minor) = (dev_major(rdev), dev_minor(rdev));
    if major > 0xfff || minor > 0xf_ffff {
        return None;
    }
    Some(((minor & 0xff) | (major << 8) | ((minor & !0xff) << 12)) as u32)
}

/// The kernel's `new_decode_dev`, returned as a `makedev` number.
pub fn new_decode_dev(dev: u32) -> u64 {
    let dev = u64::from(dev);
    let major = (dev & 0xfff00) >> 8;
    let minor = (dev & 0xff) | ((dev >> 12) & 0xfff00);
    makedev(major, minor)
}

/// The xattr that marks an overlay opaque directory (value `y`).
pub const OPAQUE_XATTR: &[u8] = b"trusted.overlay.opaque";

/// Bytes of block 0 the superblock checksum covers, from the superblock on, for blocks of `block_size`
/// bytes (a block smaller than the superblock's offset: a block's worth).
pub fn sb_checksum_span(block_size: usize) -> usize {
    if block_size > SUPER_OFFSET {
        block_size - SUPER_OFFSET
    } else {
        block_size
    }
}

/// The superblock checksum over block 0 from the superblock to the end of the block, with the checksum
/// field taken as zero: the kernel's `crc32c(~0, ...)`, which has no final inversion.
pub fn sb_checksum(block0_from_sb: &[u8]) -> u32 {
    let mut crc = crc32c::crc32c_append(0, block0_from_sb.get(..4).unwrap_or(block0_from_sb));
    if block0_from_sb.len() >= 8 {
        crc = crc32c::crc32c_append(crc, &[0u8; 4]);
        crc = crc32c::crc32c_append(crc, &block0_from_sb[8..]);
    }
    // crc32c_append inverts on entry and exit; the kernel's raw update from ~0 lacks the exit inversion.
    !crc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn struct_sizes_and_offsets() {
        let mut sb = SuperBlock::zeroed();
        sb.extra_devices = 0x1234;
        sb.devt_slotoff = 0x5678;
        sb.rootnid_8b = u64::MAX;
        let b = sb.encode();
        assert_eq!(&b[86..90], &[0x34, 0x12, 0x78, 0x56]);
        assert_eq!(&b[112..120], &[0xff; 8]);
        assert_eq!(SuperBlock::decode(&b), sb);
        let ci = ChunkIndex {
            startblk_hi: 0,
            device_id: 1,
            startblk_lo: 2,
        };
        assert_eq!(ci.encode(), [0, 0, 1, 0, 2, 0, 0, 0]);
        assert!(Dirent::read(&[0u8; 11], 0).is_none());
        assert!(Dirent::read(&[0u8; 12], usize::MAX).is_none());
    }

    #[test]
    fn device_numbers() {
        for (major, minor) in [
            (0, 0),
            (1, 3),
            (8, 1),
            (4095, 0xfffff),
            (259, 65536),
            (13, 300),
        ] {
            let rdev = makedev(major, minor);
            assert_eq!((dev_major(rdev), dev_minor(rdev)), (major, minor));
            let enc = new_encode_dev(rdev).expect("fits");
            assert_eq!(new_decode_dev(enc), rdev);
        }
        assert_eq!(new_encode_dev(makedev(1, 3)), Some(0x103));
        let wide = makedev(0xffff_ffff, 0xffff_ffff);
        assert_eq!(
            (dev_major(wide), dev_minor(wide)),
            (0xffff_ffff, 0xffff_ffff)
        );
        let odd = makedev(5000, 1);
        assert_eq!((dev_major(odd), dev_minor(odd)), (5000, 1));
        assert_eq!(new_encode_dev(makedev(4096, 0)), None);
        assert_eq!(new_encode_dev(makedev(0, 0x100000)), None);
    }

    #[test]
    fn checksum_matches_mkfs() {
        // Block 0 (from the superblock on) of a 4 KiB image made by mkfs.erofs 1.5, as (offset, hex).
        let segments: [(usize, &str); 16] = [
            (0, "e2e1f5e07be3f446030000000c0024000500000000000000cbe70b6b00000000e65f0b0001"),
            (48, "7f32c571149d4f8cbb9df65d186c6648"),
            (128, "05000000ed4100005300000000000000ffffffff"),
            (160, "cbe70b6b0000000096fe552b03"),
            (192, "24000000000000004800020024000000000000004900020029000000000000004b0001002c0000000000\
                   00004c0002002f000000000000004d0001003100000000000000520007002e2e2e6164656d7074796c"),
            (288, "05000000a48100000300000000000000ffffffff01"),
            (320, "cbe70b6b0000000096f5182b01"),
            (352, "68690a"),
            (384, "05000000ed4100001b00000000000000ffffffff02"),
            (416, "cbe70b6b0000000096f5182b02"),
            (448, "2c00000000000000180002002400000000000000190002002e2e2e000000000001000000a481"),
            (500, "03"),
            (512, "cbe70b6b0000000096f5182b01"),
            (544, "05000000ffa100000100000000000000ffffffff04"),
            (576, "cbe70b6b0000000096fe552b01"),
            (608, "61"),
        ];
        let mut block = vec![0u8; BLKSZ - SUPER_OFFSET];
        for (off, text) in segments {
            let text: String = text.split_whitespace().collect();
            let bytes = hex::decode(text).expect("hex");
            block[off..off + bytes.len()].copy_from_slice(&bytes);
        }
        assert_eq!(sb_checksum(&block), 0x46f4_e37b);
    }
}

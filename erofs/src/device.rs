//! The device table's entries, chunk locations, and sealing a superblock (uuid and checksum): what the
//! writer, the reader and [`crate::repoint`] share.

use crate::format::{sb_checksum, SuperBlock, BLKSZ, SUPER_OFFSET};

/// One entry of the device table: a blob the image's chunk indexes point into.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceSlot {
    /// Free-form tag; strata stores the blob digest's 64 hex digits (no NUL terminator needed).
    pub tag: [u8; 64],
    /// Size of the device (the blob's uncompressed view) in 4 KiB blocks.
    pub blocks: u32,
}

impl DeviceSlot {
    /// A slot tagged with (at most 64 bytes of) `tag`, of `blocks` 4 KiB blocks.
    pub fn with_tag(tag: &[u8], blocks: u32) -> DeviceSlot {
        let mut t = [0u8; 64];
        let n = tag.len().min(64);
        t[..n].copy_from_slice(&tag[..n]);
        DeviceSlot { tag: t, blocks }
    }

    /// The tag up to its first NUL.
    pub fn tag_bytes(&self) -> &[u8] {
        let end = self.tag.iter().position(|&b| b == 0).unwrap_or(64);
        &self.tag[..end]
    }

    /// The tag as text when it is 64 lowercase hex digits (how strata names a blob), else `None`.
    pub fn tag_hex(&self) -> Option<&str> {
        let t = self.tag_bytes();
        let hex = t.len() == 64 && t.iter().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
        hex.then(|| std::str::from_utf8(t).ok()).flatten()
    }
}

/// Where a chunk lives: a device of the device table and a 4 KiB block address in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkLoc {
    /// 1-based device id (= device table slot index + 1).
    pub device: u16,
    /// 4 KiB block address inside that device.
    pub block: u32,
}

/// Writes `sb` into `img` with a content-derived uuid (overlayfs wants distinct non-null uuids: hashed
/// over the image with the uuid and checksum zero), then the checksum over both.
pub fn seal_superblock(img: &mut [u8], mut sb: SuperBlock) {
    sb.uuid = [0; 16];
    sb.checksum = 0;
    sb.write_to(img, SUPER_OFFSET);
    let hash = blake3::hash(img);
    let mut uuid = [0u8; 16];
    uuid.copy_from_slice(&hash.as_bytes()[..16]);
    uuid[6] = (uuid[6] & 0x0f) | 0x40;
    uuid[8] = (uuid[8] & 0x3f) | 0x80;
    sb.uuid = uuid;
    sb.write_to(img, SUPER_OFFSET);
    sb.checksum = sb_checksum(&img[SUPER_OFFSET..BLKSZ]);
    sb.write_to(img, SUPER_OFFSET);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags() {
        let hex = "ab".repeat(32);
        let s = DeviceSlot::with_tag(hex.as_bytes(), 7);
        assert_eq!(s.tag_hex(), Some(hex.as_str()));
        assert_eq!(s.blocks, 7);
        let short = DeviceSlot::with_tag(b"blob", 1);
        assert_eq!(short.tag_bytes(), b"blob");
        assert_eq!(short.tag_hex(), None);
        assert_eq!(
            DeviceSlot::with_tag("AB".repeat(32).as_bytes(), 1).tag_hex(),
            None
        );
    }
}

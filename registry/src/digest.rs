//! Content digests.
//!
//! Every object strata stores — chunks, blobs, layer metadata, layer descriptors, manifests — is named by
//! the BLAKE3 hash of its bytes. The textual form is `blake3:<64 lowercase hex digits>`; object keys in a
//! store use the bare hex. A digest is always checked against the bytes it names before they are used.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The algorithm prefix of the textual form.
pub const ALGORITHM: &str = "blake3";

/// A BLAKE3 digest of some bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest(pub [u8; 32]);

/// A string that is not a digest.
#[derive(Debug, thiserror::Error)]
#[error("invalid digest {text:?}: expected blake3:<64 hex digits>")]
pub struct DigestParseError {
    /// The text that was given.
    pub text: String,
}

impl Digest {
    /// The digest of `bytes`.
    pub fn of(bytes: &[u8]) -> Digest {
        Digest(*blake3::hash(bytes).as_bytes())
    }

    /// The bare lowercase hex form (used in object keys and EROFS device slot tags).
    pub fn hex(&self) -> String {
        hex::encode(self.0)
    }

    /// The first 12 hex digits, for humans.
    pub fn short(&self) -> String {
        self.hex()[..12].to_string()
    }

    /// Parses bare hex (64 digits).
    pub fn from_hex(text: &str) -> Result<Digest, DigestParseError> {
        let err = || DigestParseError {
            text: text.to_string(),
        };
        if text.len() != 64 {
            return Err(err());
        }
        let mut out = [0u8; 32];
        hex::decode_to_slice(text, &mut out).map_err(|_| err())?;
        Ok(Digest(out))
    }

    /// Checks `bytes` against this digest.
    pub fn matches(&self, bytes: &[u8]) -> bool {
        Digest::of(bytes) == *self
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{ALGORITHM}:{}", self.hex())
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{ALGORITHM}:{}", self.short())
    }
}

impl FromStr for Digest {
    type Err = DigestParseError;
    fn from_str(text: &str) -> Result<Digest, DigestParseError> {
        match text.strip_prefix("blake3:") {
            Some(hex) => Digest::from_hex(hex).map_err(|_| DigestParseError {
                text: text.to_string(),
            }),
            None => Err(DigestParseError {
                text: text.to_string(),
            }),
        }
    }
}

impl Serialize for Digest {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Digest {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Digest, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// An incremental hasher producing a [`Digest`].
#[derive(Default, Clone)]
pub struct Hasher(blake3::Hasher);

impl Hasher {
    /// A new hasher.
    pub fn new() -> Hasher {
        Hasher(blake3::Hasher::new())
    }
    /// Adds bytes.
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }
    /// The digest of everything added.
    pub fn finish(&self) -> Digest {
        Digest(*self.0.finalize().as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_text() {
        let d = Digest::of(b"hello");
        let text = d.to_string();
        assert!(text.starts_with("blake3:"));
        assert_eq!(text.parse::<Digest>().ok(), Some(d));
        assert!("sha256:00".parse::<Digest>().is_err());
        assert!("blake3:zz".parse::<Digest>().is_err());
    }

    #[test]
    fn incremental_equals_oneshot() {
        let mut h = Hasher::new();
        h.update(b"hel");
        h.update(b"lo");
        assert_eq!(h.finish(), Digest::of(b"hello"));
    }
}

//! SHA-256 digests of the OCI world, and a reader that hashes what passes through it.
//!
//! OCI names blobs by `sha256:<64 hex>`; a layer also has a *diff ID*, the digest of its uncompressed tar.
//! Both are checked while the layer is being read, in one pass: a [`Hashing`] reader sits under the
//! decompressor (the blob digest) and another above it (the diff ID). The reader is a cheap shared handle,
//! so after the tar source has finished — or failed — the importer calls [`Hashing::finish`] on its own
//! copy, which reads whatever the consumer left unread and returns the digest and size of the whole stream.
//! A blob whose tar was corrupt is thus still reported as a digest mismatch, the real cause.

use std::fmt;
use std::io::{self, Read};
use std::str::FromStr;
use std::sync::{Arc, Mutex, PoisonError};

use sha2::{Digest as _, Sha256};

/// A `sha256:<hex>` digest.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Sha256Digest(pub [u8; 32]);

impl Sha256Digest {
    /// The digest of `bytes`.
    pub fn of(bytes: &[u8]) -> Sha256Digest {
        Sha256Digest(Sha256::digest(bytes).into())
    }

    /// The bare hex (a blob's file name in `blobs/sha256/`).
    pub fn hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl fmt::Display for Sha256Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}", self.hex())
    }
}

impl fmt::Debug for Sha256Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// Why a digest string was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DigestTextError {
    /// A well-formed digest of another algorithm (`sha512:…`).
    Algorithm(String),
    /// Not `algorithm:hex` at all, or bad hex.
    Malformed,
}

impl FromStr for Sha256Digest {
    type Err = DigestTextError;
    fn from_str(s: &str) -> Result<Sha256Digest, DigestTextError> {
        let (alg, hex_part) = s.split_once(':').ok_or(DigestTextError::Malformed)?;
        if alg != "sha256" {
            let known = !alg.is_empty()
                && alg
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"+._-".contains(&b));
            return Err(if known {
                DigestTextError::Algorithm(alg.to_string())
            } else {
                DigestTextError::Malformed
            });
        }
        // Lowercase only, as the spec says: the hex is also a file name, so nothing else gets through.
        if hex_part.len() != 64
            || !hex_part
                .bytes()
                .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        {
            return Err(DigestTextError::Malformed);
        }
        let mut out = [0u8; 32];
        hex::decode_to_slice(hex_part, &mut out).map_err(|_| DigestTextError::Malformed)?;
        Ok(Sha256Digest(out))
    }
}

struct State {
    inner: Box<dyn Read + Send>,
    hasher: Sha256,
    count: u64,
}

/// A reader that hashes every byte it passes on; clones share the stream (see the module documentation).
#[derive(Clone)]
pub struct Hashing {
    state: Arc<Mutex<State>>,
}

impl Hashing {
    pub fn new(inner: Box<dyn Read + Send>) -> Hashing {
        Hashing {
            state: Arc::new(Mutex::new(State {
                inner,
                hasher: Sha256::new(),
                count: 0,
            })),
        }
    }

    /// Reads the rest of the stream and returns the digest and size of all of it.
    pub fn finish(&self) -> io::Result<(Sha256Digest, u64)> {
        let mut buf = vec![0u8; 256 << 10];
        let mut me = self.clone();
        loop {
            match me.read(&mut buf) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        let s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        Ok((Sha256Digest(s.hasher.clone().finalize().into()), s.count))
    }
}

impl Read for Hashing {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let n = s.inner.read(buf)?;
        s.hasher.update(&buf[..n]);
        s.count += n as u64;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_parse_strictly() {
        let d = Sha256Digest::of(b"abc");
        assert_eq!(
            d.to_string(),
            "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(d.to_string().parse::<Sha256Digest>().unwrap(), d);
        assert_eq!(
            "sha512:abcd".parse::<Sha256Digest>(),
            Err(DigestTextError::Algorithm("sha512".into()))
        );
        for bad in [
            "sha256:../../etc",
            "sha256:AB",
            "nope",
            &d.to_string().to_uppercase(),
        ] {
            assert!(bad.parse::<Sha256Digest>().is_err(), "{bad}");
        }
    }

    #[test]
    fn finish_reads_what_the_consumer_left() {
        let data = vec![7u8; 1 << 20];
        let mut h = Hashing::new(Box::new(io::Cursor::new(data.clone())));
        let mut head = [0u8; 1000];
        h.read_exact(&mut head).unwrap();
        assert_eq!(h.finish().unwrap(), (Sha256Digest::of(&data), 1 << 20));
    }
}

//! The tar source: reads a tar stream (plain, gzip or zstd; ustar, GNU and PAX) once, front to back, and
//! emits one [`Entry`] per member, with OCI whiteouts converted.
//!
//! # Framing and extension headers
//!
//! The `tar` crate frames the stream: header checksums, GNU long names and links, the PAX `size` record,
//! GNU sparse members (materialized with zeros; [`Entry::size`](tar::Entry::size) is the logical size and
//! is what we use) and skipping data nobody read. Its own parsing of PAX records is not trusted, though:
//! tar 0.4.46 splits a PAX header on newlines before honouring each record's length, so a record whose
//! value holds a newline (a binary `security.capability` often does) is misparsed, and the tail of such a
//! value can be taken as a `path`, `linkpath`, `size`, `uid` or `gid` record of its own (upstream issues
//! composefs/tar-rs#428 and #452). So the stream is tapped: the bytes between the end of one member's data
//! and the next member's header (its extension headers) and that header itself are kept, and parsed here —
//! PAX records by their length prefix, GNU long names, the original header fields. Every name and number
//! of an entry comes from that parse; the crate's framing must agree with it (a PAX `size` that the crate
//! did not honour is an error, never a silently shifted stream).
//!
//! # Entries
//!
//! Paths are normalized (leading `./`, `.` components, repeated and trailing `/` dropped; `.` or `./` is
//! the root, an empty path). An absolute path, a `..` component or a NUL byte is refused with
//! [`BuildError::UnsafeEntry`] naming the member, as is a hard link whose target is absolute or has `..`;
//! a hard link must name an earlier non-directory member of the same stream. Symlink targets are kept
//! verbatim, absolute or with `..`: the builder stores them as data and never follows them, and they are
//! resolved only inside the sandbox that mounts the image. Metadata: mode `& 0o7777`; uid and gid (PAX
//! `uid`/`gid` over the header's, which may be base-256); mtime (PAX `mtime` with its fraction as
//! nanoseconds, negative times included, else the header's seconds); extended attributes from PAX
//! `SCHILY.xattr.NAME` (value raw bytes) and `LIBARCHIVE.xattr.NAME` (name %-encoded, value base64),
//! sorted by name. Member types: regular (`0`, old `\0` — a directory if its name ends in `/` — and
//! contiguous `7`), GNU sparse, directory, symlink, hard link, character and block devices, fifo. PAX
//! global headers are skipped; anything else (GNU multi-volume or dump-dir members, PAX-format GNU sparse
//! files) is [`BuildError::Unsupported`].
//!
//! OCI whiteouts: a member whose base name is `.wh..wh..opq` becomes [`EntryKind::Opaque`] at its
//! directory; `.wh.NAME` becomes [`EntryKind::Whiteout`] at `dir/NAME`; other `.wh..wh.*` names (aufs
//! bookkeeping such as `.wh..wh.plnk`) are skipped.
//!
//! # Data, truncation, corruption
//!
//! A regular file's bytes are handed to the sink as [`FileSource::Stream`], limited to the entry's size;
//! whatever the sink leaves unread is read and discarded before the next member. A stream that ends
//! inside a member's data, inside a header, or at a member boundary without the end-of-archive zero block
//! (the `tar` crate alone would stop there silently: the tap records whether the input hit end-of-file),
//! a bad header checksum, and any decompression error are [`BuildError::Tar`] naming the last good member
//! and the byte offset in the (decompressed) stream — never a silently partial layer. After the
//! end-of-archive block the rest of the input is read to its end, so a compressed stream's trailer
//! (gzip CRC and length, zstd frame end) is verified too; non-zero bytes there are ignored with a warning.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashSet};
use std::io::{self, BufReader, Read};

use tar::{Archive, EntryType, Header};

use super::{join, Entry, EntryKind, EntrySink, FileSource};
use crate::error::BuildError;
use crate::tree::Meta;

const BLOCK: u64 = 512;
const BUF: usize = 256 << 10;
/// Most bytes of extension headers (PAX, GNU long names, GNU sparse maps) one member may have.
const MAX_EXTENSIONS: usize = 64 << 20;

/// Opens a possibly compressed tar stream: gzip (`1f 8b`, also multi-member) and zstd (`28 b5 2f fd`) are
/// recognized by their magic bytes, anything else is read as a plain tar. No byte is lost to the sniffing.
pub fn open_stream(mut reader: Box<dyn Read + Send>) -> Result<Box<dyn Read + Send>, BuildError> {
    let mut magic = [0u8; 4];
    let mut n = 0;
    while n < magic.len() {
        match reader.read(&mut magic[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(BuildError::Tar(format!("reading the stream: {e}"))),
        }
    }
    let head = magic[..n].to_vec();
    let gzip = head.starts_with(&[0x1f, 0x8b]);
    let zstd = head == [0x28, 0xb5, 0x2f, 0xfd];
    let input = BufReader::with_capacity(BUF, io::Cursor::new(head).chain(reader));
    Ok(if gzip {
        Box::new(BufReader::with_capacity(
            BUF,
            flate2::bufread::MultiGzDecoder::new(input),
        ))
    } else if zstd {
        let decoder = zstd::stream::read::Decoder::with_buffer(input)
            .map_err(|e| BuildError::Tar(format!("starting the zstd decoder: {e}")))?;
        Box::new(BufReader::with_capacity(BUF, decoder))
    } else {
        Box::new(input)
    })
}

/// Reads a (decompressed) tar stream and hands every member to `sink` (see the module documentation).
pub fn read_tar(reader: impl Read, sink: &mut dyn EntrySink) -> Result<(), BuildError> {
    let tap = RefCell::new(Tap {
        recording: true,
        ..Tap::default()
    });
    let mut archive = Archive::new(Tapped {
        inner: reader,
        tap: &tap,
    });
    let mut state = State {
        tap: &tap,
        seen: HashSet::new(),
        last: None,
    };
    let entries = archive
        .entries()
        .map_err(|e| state.stream_error(&e.to_string()))?;
    for item in entries {
        let entry = item.map_err(|e| state.stream_error(&e.to_string()))?;
        state.member(entry, sink)?;
    }
    let mut input = archive.into_inner();
    state.finish(&mut input)
}

/// What the tap saw of the input.
#[derive(Default)]
struct Tap {
    /// Bytes read so far.
    pos: u64,
    /// A read returned end-of-file.
    eof: bool,
    /// Whether reads are being copied into `window`.
    recording: bool,
    /// Stream offset of `window[0]`.
    start: u64,
    window: Vec<u8>,
}

/// The input, counted and (between members) recorded.
struct Tapped<'t, R> {
    inner: R,
    tap: &'t RefCell<Tap>,
}

impl<R: Read> Read for Tapped<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        let mut tap = self.tap.borrow_mut();
        if n == 0 && !buf.is_empty() {
            tap.eof = true;
        }
        tap.pos += n as u64;
        if tap.recording {
            if tap.window.len() + n > MAX_EXTENSIONS {
                return Err(io::Error::other(
                    "more than 64 MiB of extension headers for one member",
                ));
            }
            tap.window.extend_from_slice(&buf[..n]);
        }
        Ok(n)
    }
}

struct State<'t> {
    tap: &'t RefCell<Tap>,
    /// Non-directory paths emitted so far: the valid hard link targets.
    seen: HashSet<Vec<u8>>,
    /// The last member handled, for error messages.
    last: Option<String>,
}

fn show(path: &[u8]) -> String {
    String::from_utf8_lossy(path).into_owned()
}

fn entry_error(tap: &RefCell<Tap>, path: &str, why: impl std::fmt::Display) -> BuildError {
    let pos = tap.borrow().pos;
    BuildError::Tar(format!("entry {path:?} (at byte {pos}): {why}"))
}

impl State<'_> {
    fn position(&self) -> String {
        let pos = self.tap.borrow().pos;
        match &self.last {
            Some(last) => format!("after entry {last:?}, at byte {pos}"),
            None => format!("before the first entry, at byte {pos}"),
        }
    }

    fn stream_error(&self, why: &str) -> BuildError {
        BuildError::Tar(format!("{}: {why}", self.position()))
    }

    fn entry_error(&self, path: &str, why: impl std::fmt::Display) -> BuildError {
        entry_error(self.tap, path, why)
    }

    /// Handles one member: converts it, hands it to the sink and consumes whatever data is left.
    fn member<R: Read>(
        &mut self,
        mut entry: tar::Entry<'_, R>,
        sink: &mut dyn EntrySink,
    ) -> Result<(), BuildError> {
        let (window, start) = {
            let mut tap = self.tap.borrow_mut();
            tap.recording = false;
            (std::mem::take(&mut tap.window), tap.start)
        };
        let ext = Extensions::parse(&window, start, entry.raw_header_position())
            .map_err(|why| self.stream_error(&why))?;
        let size = entry.size();
        let mut data = Data {
            inner: &mut entry,
            left: size,
            failure: None,
        };
        let shown = self.convert(&ext, size, &mut data, sink);
        let shown = match shown {
            Ok(shown) => shown,
            Err((path, err)) => {
                return Err(match data.failure.take() {
                    Some(why) => self.entry_error(&path, why),
                    None => err,
                })
            }
        };
        if let Err(e) = io::copy(&mut data, &mut io::sink()) {
            return Err(self.entry_error(&shown, e));
        }
        drop(entry);
        self.last = Some(shown);
        let mut tap = self.tap.borrow_mut();
        tap.recording = true;
        tap.start = tap.pos;
        Ok(())
    }

    /// Converts one member and hands it to the sink; returns its path for messages (also on error).
    fn convert(
        &mut self,
        ext: &Extensions,
        size: u64,
        data: &mut Data<'_>,
        sink: &mut dyn EntrySink,
    ) -> Result<String, (String, BuildError)> {
        let hdr = Header::from_byte_slice(&ext.header);
        let pax = Pax::parse(ext.pax.as_deref());
        let raw_path = match (&ext.long_name, &pax) {
            (Some(name), _) => name.clone(),
            (None, Ok(Pax { path: Some(p), .. })) => p.clone(),
            _ => hdr.path_bytes().into_owned(),
        };
        let shown = show(&raw_path);
        let tap = self.tap;
        let fail = |e: BuildError| (shown.clone(), e);
        let pax = pax.map_err(|why| fail(entry_error(tap, &shown, why)))?;
        let etype = hdr.entry_type();
        if etype == EntryType::XGlobalHeader {
            return Ok(shown);
        }
        let unsafe_entry = |why| {
            fail(BuildError::UnsafeEntry {
                path: shown.clone(),
                why,
            })
        };
        let unsupported = |why: String| {
            fail(BuildError::Unsupported {
                path: shown.clone(),
                why,
            })
        };
        if pax.gnu_sparse {
            return Err(unsupported(
                "PAX-format GNU sparse files are not supported".into(),
            ));
        }
        if let Some(pax_size) = pax.size {
            if etype != EntryType::GNUSparse && pax_size != size {
                return Err(fail(entry_error(
                    tap,
                    &shown,
                    format!("PAX size {pax_size} but the tar reader framed {size} bytes"),
                )));
            }
        }
        let path = match normalize(&raw_path) {
            Ok(p) => p,
            Err(Bad::Absolute) => return Err(unsafe_entry("absolute path")),
            Err(Bad::DotDot) => return Err(unsafe_entry("path has a '..' component")),
            Err(Bad::Nul) => return Err(unsafe_entry("path contains a NUL byte")),
            Err(Bad::TooLong) => {
                return Err(unsupported(
                    "a path component is longer than 255 bytes".into(),
                ))
            }
        };
        let header_err = |e: io::Error| fail(entry_error(tap, &shown, e));
        let mode = hdr.mode().map_err(header_err)?;
        let uid = match pax.uid {
            Some(uid) => uid,
            None => hdr.uid().map_err(header_err)?,
        };
        let gid = match pax.gid {
            Some(gid) => gid,
            None => hdr.gid().map_err(header_err)?,
        };
        let (mtime, mtime_nsec) = match pax.mtime {
            Some(t) => t,
            // A base-256 header field holds a two's complement number: negative times come out right.
            None => (hdr.mtime().map_err(header_err)? as i64, 0),
        };
        let meta = Meta {
            perm: mode & 0o7777,
            uid: u32::try_from(uid)
                .map_err(|_| unsupported(format!("uid {uid} does not fit in 32 bits")))?,
            gid: u32::try_from(gid)
                .map_err(|_| unsupported(format!("gid {gid} does not fit in 32 bits")))?,
            mtime,
            mtime_nsec,
            xattrs: pax.xattrs,
        };

        // OCI whiteouts.
        let (dir, base) = match path.iter().rposition(|&b| b == b'/') {
            Some(i) => (&path[..i], &path[i + 1..]),
            None => (&path[..0], &path[..]),
        };
        if base == b".wh..wh..opq" {
            let entry = Entry {
                path: dir.to_vec(),
                meta,
                kind: EntryKind::Opaque,
            };
            sink.add(entry, None).map_err(fail)?;
            return Ok(shown);
        }
        if base.starts_with(b".wh..wh.") {
            tracing::debug!(path = %shown, "skipping aufs metadata");
            return Ok(shown);
        }
        if let Some(hidden) = base.strip_prefix(b".wh.") {
            if hidden.is_empty() || hidden == b"." || hidden == b".." {
                return Err(unsafe_entry("whiteout of an empty name, '.' or '..'"));
            }
            let path = join(dir, hidden);
            self.seen.remove(&path);
            let entry = Entry {
                path,
                meta,
                kind: EntryKind::Whiteout,
            };
            sink.add(entry, None).map_err(fail)?;
            return Ok(shown);
        }

        let link = || match (&ext.long_link, &pax.linkpath) {
            (Some(l), _) | (None, Some(l)) => Some(l.clone()),
            (None, None) => hdr.link_name_bytes().map(|l| l.into_owned()),
        };
        let device = |major: io::Result<Option<u32>>, minor: io::Result<Option<u32>>| {
            let major = major.map_err(header_err)?.unwrap_or(0);
            let minor = minor.map_err(header_err)?.unwrap_or(0);
            Ok(libc::makedev(major, minor))
        };
        let old_dir = hdr.as_old().linkflag[0] == 0 && raw_path.ends_with(b"/");
        let kind = match etype {
            EntryType::Directory => EntryKind::Dir,
            EntryType::Regular if old_dir => EntryKind::Dir,
            EntryType::Regular | EntryType::Continuous | EntryType::GNUSparse => {
                EntryKind::File { size }
            }
            EntryType::Symlink => match link() {
                None => return Err(unsupported("symlink without a target".into())),
                Some(t) if t.is_empty() => {
                    return Err(unsupported("symlink without a target".into()))
                }
                Some(t) if t.contains(&0) => {
                    return Err(unsafe_entry("symlink target contains a NUL byte"))
                }
                Some(t) => EntryKind::Symlink(t),
            },
            EntryType::Link => {
                let target = match normalize(&link().unwrap_or_default()) {
                    Ok(t) => t,
                    Err(Bad::Absolute) => return Err(unsafe_entry("hard link target is absolute")),
                    Err(Bad::DotDot) => {
                        return Err(unsafe_entry("hard link target has a '..' component"))
                    }
                    Err(Bad::Nul) => {
                        return Err(unsafe_entry("hard link target contains a NUL byte"))
                    }
                    Err(Bad::TooLong) => {
                        return Err(unsupported(
                            "hard link target has a component longer than 255 bytes".into(),
                        ))
                    }
                };
                if !self.seen.contains(&target) {
                    let why = format!(
                        "hard link to {:?}, which is not an earlier non-directory entry",
                        show(&target)
                    );
                    return Err(fail(entry_error(tap, &shown, why)));
                }
                EntryKind::HardLink(target)
            }
            EntryType::Char => EntryKind::CharDev {
                rdev: device(hdr.device_major(), hdr.device_minor())?,
            },
            EntryType::Block => EntryKind::BlockDev {
                rdev: device(hdr.device_major(), hdr.device_minor())?,
            },
            EntryType::Fifo => EntryKind::Fifo,
            other => {
                let byte = other.as_byte();
                return Err(unsupported(format!(
                    "tar member type {other:?} ({:?}) is not supported",
                    char::from(byte)
                )));
            }
        };
        if path.is_empty() && kind != EntryKind::Dir {
            return Err(unsupported("a non-directory at the root".into()));
        }
        if kind == EntryKind::Dir {
            self.seen.remove(&path);
        } else {
            self.seen.insert(path.clone());
        }
        let is_file = matches!(kind, EntryKind::File { .. });
        let entry = Entry { path, meta, kind };
        let source = is_file.then(|| FileSource::Stream(&mut *data));
        sink.add(entry, source).map_err(fail)?;
        Ok(shown)
    }

    /// After the end-of-archive block: checks the stream did not just stop, and reads it to its end.
    fn finish(&self, input: &mut impl Read) -> Result<(), BuildError> {
        let (eof, pos) = {
            let mut tap = self.tap.borrow_mut();
            tap.recording = false;
            tap.window = Vec::new();
            (tap.eof, tap.pos)
        };
        if eof {
            return Err(
                self.stream_error("truncated: the stream ends without the end-of-archive block")
            );
        }
        let mut buf = vec![0u8; 64 << 10];
        let (mut trailing, mut nonzero) = (0u64, false);
        loop {
            match input.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    trailing += n as u64;
                    nonzero |= buf[..n].iter().any(|&b| b != 0);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    return Err(BuildError::Tar(format!(
                        "after the end-of-archive block at byte {pos}: {e}"
                    )))
                }
            }
        }
        if nonzero {
            tracing::warn!(
                bytes = trailing,
                "ignoring data after the tar end-of-archive block"
            );
        }
        Ok(())
    }
}

/// A member's data as the sink sees it: at most `left` bytes; the input ending early is an error.
struct Data<'e> {
    inner: &'e mut dyn Read,
    left: u64,
    /// Why reading failed (truncation, decompression), so the error can name the member.
    failure: Option<String>,
}

impl Read for Data<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.left == 0 || buf.is_empty() {
            return Ok(0);
        }
        let want = buf
            .len()
            .min(usize::try_from(self.left).unwrap_or(usize::MAX));
        match self.inner.read(&mut buf[..want]) {
            Ok(0) => {
                let why = "truncated: the stream ends inside this entry's data";
                self.failure = Some(why.into());
                Err(io::Error::new(io::ErrorKind::UnexpectedEof, why))
            }
            Ok(n) => {
                self.left -= n as u64;
                Ok(n)
            }
            Err(e) => {
                if e.kind() != io::ErrorKind::Interrupted {
                    self.failure = Some(e.to_string());
                }
                Err(e)
            }
        }
    }
}

/// The extension headers in front of a member, and the member's own header, as they were in the stream.
struct Extensions {
    header: [u8; BLOCK as usize],
    pax: Option<Vec<u8>>,
    long_name: Option<Vec<u8>>,
    long_link: Option<Vec<u8>>,
}

fn round_up(n: u64) -> Option<u64> {
    n.checked_add(BLOCK - 1).map(|v| v & !(BLOCK - 1))
}

impl Extensions {
    /// Parses the recorded `window` (stream offset `start`: the end of the previous member's data) up to
    /// the member header the `tar` crate found at `header_pos`.
    fn parse(window: &[u8], start: u64, header_pos: u64) -> Result<Extensions, String> {
        let slice = |at: u64, len: u64| -> Result<&[u8], String> {
            let from = at.checked_sub(start).and_then(|r| usize::try_from(r).ok());
            let to = from.and_then(|f| f.checked_add(usize::try_from(len).ok()?));
            match (from, to) {
                (Some(f), Some(t)) if t <= window.len() => Ok(&window[f..t]),
                _ => Err(format!(
                    "internal error: header at byte {at} was not recorded"
                )),
            }
        };
        let mut ext = Extensions {
            header: [0; BLOCK as usize],
            pax: None,
            long_name: None,
            long_link: None,
        };
        let mut at = round_up(start).ok_or("offset overflow")?;
        while at < header_pos {
            let header = Header::from_byte_slice(slice(at, BLOCK)?);
            let size = header.entry_size().map_err(|e| e.to_string())?;
            let data = slice(at + BLOCK, size)?;
            let trimmed = || {
                let end = data.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
                data[..end].to_vec()
            };
            match header.entry_type() {
                EntryType::XHeader => ext.pax = Some(data.to_vec()),
                EntryType::GNULongName => ext.long_name = Some(trimmed()),
                EntryType::GNULongLink => ext.long_link = Some(trimmed()),
                other => return Err(format!("unexpected {other:?} header at byte {at}")),
            }
            at = round_up(size)
                .and_then(|s| s.checked_add(at + BLOCK))
                .ok_or("offset overflow")?;
        }
        if at != header_pos {
            return Err(format!(
                "extension headers end at byte {at}, not at the member header (byte {header_pos})"
            ));
        }
        ext.header.copy_from_slice(slice(header_pos, BLOCK)?);
        Ok(ext)
    }
}

/// The PAX records this source uses, parsed by their length prefixes.
#[derive(Default, Debug)]
struct Pax {
    path: Option<Vec<u8>>,
    linkpath: Option<Vec<u8>>,
    size: Option<u64>,
    uid: Option<u64>,
    gid: Option<u64>,
    mtime: Option<(i64, u32)>,
    xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    gnu_sparse: bool,
}

impl Pax {
    fn parse(data: Option<&[u8]>) -> Result<Pax, String> {
        let mut pax = Pax::default();
        let mut xattrs = BTreeMap::new();
        let mut rest = data.unwrap_or_default();
        while !rest.is_empty() && !rest.iter().all(|&b| b == 0) {
            let bad = || {
                format!(
                    "malformed PAX record {:?}",
                    show(&rest[..rest.len().min(40)])
                )
            };
            let space = rest.iter().position(|&b| b == b' ').ok_or_else(bad)?;
            let len: usize = std::str::from_utf8(&rest[..space])
                .ok()
                .filter(|s| s.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|s| s.parse().ok())
                .ok_or_else(bad)?;
            if len <= space + 1 || len > rest.len() || rest[len - 1] != b'\n' {
                return Err(bad());
            }
            let record = &rest[space + 1..len - 1];
            let eq = record.iter().position(|&b| b == b'=').ok_or_else(bad)?;
            let (key, value) = (&record[..eq], &record[eq + 1..]);
            let opt = |v: &[u8]| (!v.is_empty()).then(|| v.to_vec());
            let num = |v: &[u8]| -> Result<Option<u64>, String> {
                if v.is_empty() {
                    return Ok(None);
                }
                std::str::from_utf8(v)
                    .ok()
                    .and_then(|s| s.parse().ok())
                    .map(Some)
                    .ok_or_else(|| {
                        format!("bad number {:?} in PAX record {:?}", show(v), show(key))
                    })
            };
            match key {
                b"path" => pax.path = opt(value),
                b"linkpath" => pax.linkpath = opt(value),
                b"size" => pax.size = num(value)?,
                b"uid" => pax.uid = num(value)?,
                b"gid" => pax.gid = num(value)?,
                b"mtime" if value.is_empty() => pax.mtime = None,
                b"mtime" => pax.mtime = Some(parse_time(value)?),
                _ => {
                    if let Some(name) = key.strip_prefix(b"SCHILY.xattr.") {
                        if name.is_empty() {
                            return Err(bad());
                        }
                        xattrs.insert(name.to_vec(), value.to_vec());
                    } else if let Some(name) = key.strip_prefix(b"LIBARCHIVE.xattr.") {
                        let name = percent_decode(name).ok_or_else(bad)?;
                        let value = base64_decode(value).ok_or_else(bad)?;
                        if name.is_empty() || name.contains(&0) {
                            return Err(bad());
                        }
                        xattrs.insert(name, value);
                    } else if key.starts_with(b"GNU.sparse.") {
                        pax.gnu_sparse = true;
                    }
                }
            }
            rest = &rest[len..];
        }
        pax.xattrs = xattrs.into_iter().collect();
        Ok(pax)
    }
}

/// A PAX time: decimal seconds, optionally negative, with an optional fraction (kept to nanoseconds).
fn parse_time(v: &[u8]) -> Result<(i64, u32), String> {
    let bad = || format!("bad PAX time {:?}", show(v));
    let (neg, digits) = match v.strip_prefix(b"-") {
        Some(d) => (true, d),
        None => (false, v),
    };
    let (int, frac) = match digits.iter().position(|&b| b == b'.') {
        Some(i) => (&digits[..i], &digits[i + 1..]),
        None => (digits, &digits[..0]),
    };
    if int.is_empty() || !int.iter().chain(frac).all(u8::is_ascii_digit) {
        return Err(bad());
    }
    let secs: i64 = std::str::from_utf8(int)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(bad)?;
    let nanos = frac
        .iter()
        .chain(std::iter::repeat(&b'0'))
        .take(9)
        .fold(0u32, |n, &d| n * 10 + u32::from(d - b'0'));
    Ok(match (neg, nanos) {
        (false, _) => (secs, nanos),
        (true, 0) => (-secs, 0),
        (true, _) => (-secs - 1, 1_000_000_000 - nanos),
    })
}

/// `%XX` decoding (libarchive's escaping of xattr names).
fn percent_decode(s: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(s.len());
    let mut i = 0;
    while i < s.len() {
        if s[i] == b'%' {
            let hex = std::str::from_utf8(s.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(s[i]);
            i += 1;
        }
    }
    Some(out)
}

/// Standard base64, with or without `=` padding (libarchive writes none).
fn base64_decode(s: &[u8]) -> Option<Vec<u8>> {
    let s = s
        .strip_suffix(b"==")
        .or_else(|| s.strip_suffix(b"="))
        .unwrap_or(s);
    let mut out = Vec::with_capacity(s.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0u32);
    for &c in s {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        };
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    Some(out)
}

enum Bad {
    Absolute,
    DotDot,
    Nul,
    TooLong,
}

/// Normalizes a member path: drops `.` components and empty ones (leading `./`, `//`, trailing `/`).
fn normalize(raw: &[u8]) -> Result<Vec<u8>, Bad> {
    if raw.contains(&0) {
        return Err(Bad::Nul);
    }
    if raw.first() == Some(&b'/') {
        return Err(Bad::Absolute);
    }
    let mut out = Vec::with_capacity(raw.len());
    for comp in raw.split(|&b| b == b'/') {
        match comp {
            b"" | b"." => continue,
            b".." => return Err(Bad::DotDot),
            c if c.len() > 255 => return Err(Bad::TooLong),
            c => {
                if !out.is_empty() {
                    out.push(b'/');
                }
                out.extend_from_slice(c);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// Records every entry, with the bytes of regular files.
    #[derive(Default)]
    struct Rec {
        entries: Vec<(Entry, Option<Vec<u8>>)>,
    }

    impl EntrySink for Rec {
        fn add(&mut self, entry: Entry, data: Option<FileSource<'_>>) -> Result<(), BuildError> {
            assert_eq!(data.is_some(), matches!(entry.kind, EntryKind::File { .. }));
            let bytes = match data {
                None => None,
                Some(FileSource::Stream(r)) => {
                    let mut v = Vec::new();
                    r.read_to_end(&mut v)
                        .map_err(|e| BuildError::io("stream", e))?;
                    Some(v)
                }
                Some(FileSource::Path { .. }) => panic!("a tar source gives streams"),
            };
            if let (EntryKind::File { size }, Some(b)) = (&entry.kind, &bytes) {
                assert_eq!(*size, b.len() as u64);
            }
            self.entries.push((entry, bytes));
            Ok(())
        }
    }

    impl Rec {
        fn get(&self, path: &[u8]) -> &(Entry, Option<Vec<u8>>) {
            self.entries
                .iter()
                .find(|(e, _)| e.path == path)
                .unwrap_or_else(|| panic!("no entry {}", show(path)))
        }

        fn paths(&self) -> Vec<String> {
            self.entries.iter().map(|(e, _)| show(&e.path)).collect()
        }
    }

    fn read(bytes: &[u8]) -> Result<Rec, BuildError> {
        let mut rec = Rec::default();
        read_tar(bytes, &mut rec).map(|()| rec)
    }

    fn read_via_open_stream(bytes: Vec<u8>) -> Result<Rec, BuildError> {
        let mut rec = Rec::default();
        let stream = open_stream(Box::new(io::Cursor::new(bytes)))?;
        read_tar(stream, &mut rec).map(|()| rec)
    }

    fn header(kind: EntryType, mode: u32, size: u64) -> Header {
        let mut h = Header::new_gnu();
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_size(size);
        h.set_mtime(1_000);
        h.set_uid(0);
        h.set_gid(0);
        h
    }

    fn add(b: &mut tar::Builder<Vec<u8>>, path: &str, kind: EntryType, data: &[u8]) {
        let mut h = header(kind, 0o644, data.len() as u64);
        b.append_data(&mut h, path, data).unwrap();
    }

    /// Appends one member with raw name and link name bytes (as hostile archives have them).
    fn raw(out: &mut Vec<u8>, name: &[u8], kind: EntryType, link: &[u8], data: &[u8]) {
        let mut h = header(kind, 0o644, data.len() as u64);
        h.as_old_mut().name[..name.len()].copy_from_slice(name);
        h.as_old_mut().linkname[..link.len()].copy_from_slice(link);
        h.set_cksum();
        out.extend_from_slice(h.as_bytes());
        out.extend_from_slice(data);
        out.resize(out.len().next_multiple_of(512), 0);
    }

    /// Appends a PAX extended header holding `records`.
    fn raw_pax(out: &mut Vec<u8>, records: &[(&str, &[u8])]) {
        let mut body = Vec::new();
        for (k, v) in records {
            let rest = k.len() + v.len() + 3;
            let mut len = rest + 1;
            while len.to_string().len() + rest != len {
                len += 1;
            }
            body.extend_from_slice(format!("{len} {k}=").as_bytes());
            body.extend_from_slice(v);
            body.push(b'\n');
        }
        raw(out, b"PaxHeaders/x", EntryType::XHeader, b"", &body);
    }

    fn end(mut out: Vec<u8>) -> Vec<u8> {
        out.extend_from_slice(&[0; 1024]);
        out
    }

    fn sample() -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        let mut root = header(EntryType::Directory, 0o755, 0);
        root.set_path("./").unwrap();
        root.set_cksum();
        b.append(&root, io::empty()).unwrap();
        let mut etc = header(EntryType::Directory, 0o1755, 0);
        b.append_data(&mut etc, "./etc/", io::empty()).unwrap();
        let mut su = header(EntryType::Regular, 0o4711, 6);
        su.set_uid(1000);
        su.set_gid(1001);
        b.append_data(&mut su, "./etc//passwd", &b"root:x"[..])
            .unwrap();
        let mut link = header(EntryType::Symlink, 0o777, 0);
        b.append_link(&mut link, "bin", "../usr/bin").unwrap();
        let mut hard = header(EntryType::Link, 0o644, 0);
        b.append_link(&mut hard, "etc/passwd2", "./etc/passwd")
            .unwrap();
        let mut null = header(EntryType::Char, 0o666, 0);
        null.set_device_major(1).unwrap();
        null.set_device_minor(3).unwrap();
        b.append_data(&mut null, "dev/null", io::empty()).unwrap();
        let mut sda = header(EntryType::Block, 0o660, 0);
        sda.set_device_major(8).unwrap();
        sda.set_device_minor(1).unwrap();
        b.append_data(&mut sda, "dev/sda1", io::empty()).unwrap();
        add(&mut b, "run/fifo", EntryType::Fifo, b"");
        let long = format!("long/{}", "n".repeat(200));
        let big: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect();
        add(&mut b, &long, EntryType::Continuous, &big);
        let mut ll = header(EntryType::Symlink, 0o777, 0);
        b.append_link(&mut ll, "longlink", "t".repeat(300)).unwrap();
        b.into_inner().unwrap()
    }

    #[test]
    fn every_member_type() {
        let rec = read(&sample()).unwrap();
        let long = format!("long/{}", "n".repeat(200));
        assert_eq!(
            rec.paths(),
            [
                "",
                "etc",
                "etc/passwd",
                "bin",
                "etc/passwd2",
                "dev/null",
                "dev/sda1",
                "run/fifo",
                &long,
                "longlink"
            ]
        );
        let (e, _) = rec.get(b"");
        assert_eq!((e.kind.clone(), e.meta.perm), (EntryKind::Dir, 0o755));
        assert_eq!(rec.get(b"etc").0.meta.perm, 0o1755);
        let (e, data) = rec.get(b"etc/passwd");
        assert_eq!(e.kind, EntryKind::File { size: 6 });
        assert_eq!(data.as_deref(), Some(&b"root:x"[..]));
        assert_eq!((e.meta.perm, e.meta.uid, e.meta.gid), (0o4711, 1000, 1001));
        assert_eq!((e.meta.mtime, e.meta.mtime_nsec), (1000, 0));
        assert_eq!(
            rec.get(b"bin").0.kind,
            EntryKind::Symlink(b"../usr/bin".to_vec())
        );
        assert_eq!(
            rec.get(b"etc/passwd2").0.kind,
            EntryKind::HardLink(b"etc/passwd".to_vec())
        );
        assert_eq!(
            rec.get(b"dev/null").0.kind,
            EntryKind::CharDev {
                rdev: libc::makedev(1, 3)
            }
        );
        assert_eq!(
            rec.get(b"dev/sda1").0.kind,
            EntryKind::BlockDev {
                rdev: libc::makedev(8, 1)
            }
        );
        assert_eq!(rec.get(b"run/fifo").0.kind, EntryKind::Fifo);
        let (e, data) = rec.get(long.as_bytes());
        assert_eq!(e.kind, EntryKind::File { size: 100_000 });
        assert_eq!(
            data.as_ref().map(|d| d[99_999]),
            Some((99_999u32 * 7 % 251) as u8)
        );
        assert_eq!(
            rec.get(b"longlink").0.kind,
            EntryKind::Symlink("t".repeat(300).into_bytes())
        );
    }

    #[test]
    fn compressed_streams() {
        let plain = sample();
        let expected = read(&plain).unwrap().paths();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&plain).unwrap();
        let gz = gz.finish().unwrap();
        // Two gzip members, split mid-header.
        let mut multi = Vec::new();
        for part in [&plain[..700], &plain[700..]] {
            let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            enc.write_all(part).unwrap();
            multi.extend(enc.finish().unwrap());
        }
        let mut enc = zstd::Encoder::new(Vec::new(), 3).unwrap();
        enc.include_checksum(true).unwrap();
        enc.write_all(&plain).unwrap();
        let zst = enc.finish().unwrap();
        for input in [plain.clone(), gz.clone(), multi, zst.clone()] {
            let rec = read_via_open_stream(input).unwrap();
            assert_eq!(rec.paths(), expected);
            assert_eq!(rec.get(b"etc/passwd").1.as_deref(), Some(&b"root:x"[..]));
        }

        // Corrupt or cut compressed streams are errors, not short layers.
        let mut flipped = gz.clone();
        let mid = flipped.len() / 2;
        flipped[mid] ^= 0x55;
        let cut_gz = gz[..gz.len() - 4].to_vec();
        let mut bad_zst = zst.clone();
        let mid = bad_zst.len() / 2;
        bad_zst[mid] ^= 0x55;
        let cut_zst = zst[..zst.len() - 3].to_vec();
        for (what, input) in [
            ("flipped gzip", flipped),
            ("cut gzip", cut_gz),
            ("flipped zstd", bad_zst),
            ("cut zstd", cut_zst),
        ] {
            match read_via_open_stream(input) {
                Err(BuildError::Tar(msg)) => eprintln!("{what}: {msg}"),
                Err(other) => panic!("{what}: {other:?}"),
                Ok(_) => panic!("{what}: accepted"),
            }
        }
    }

    #[test]
    fn pax_metadata() {
        let mut out = Vec::new();
        let cap: &[u8] =
            b"\x01\x00\x00\x02\x0a\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00";
        raw_pax(
            &mut out,
            &[
                ("uid", b"3000000"),
                ("gid", b"4000000"),
                ("mtime", b"1700000000.123456789"),
                ("SCHILY.xattr.user.z", b"last"),
                ("SCHILY.xattr.security.capability", cap),
                // A value holding something that looks like a record must stay a value.
                ("SCHILY.xattr.user.tricky", b"x\n22 linkpath=/etc/evil\n"),
                ("LIBARCHIVE.xattr.user.%41b", b"aGkA"),
                ("atime", b"1.5"),
            ],
        );
        raw(&mut out, b"f", EntryType::Regular, b"", b"data");
        raw_pax(
            &mut out,
            &[("mtime", b"-1.25"), ("path", b"a/very/long/\xffpath")],
        );
        raw(&mut out, b"ignored", EntryType::Directory, b"", b"");
        raw_pax(
            &mut out,
            &[("SCHILY.xattr.user.t", b"v\n22 linkpath=/etc/evil\n")],
        );
        raw(&mut out, b"sym", EntryType::Symlink, b"harmless", b"");
        // A uid too big for octal, in the header's base-256 form.
        let mut b = tar::Builder::new(Vec::new());
        let mut h = header(EntryType::Regular, 0o600, 0);
        h.set_uid(5_000_000);
        b.append_data(&mut h, "big-uid", io::empty()).unwrap();
        out.extend(b.into_inner().unwrap());

        let rec = read(&out).unwrap();
        let (e, data) = rec.get(b"f");
        assert_eq!(data.as_deref(), Some(&b"data"[..]));
        assert_eq!((e.meta.uid, e.meta.gid), (3_000_000, 4_000_000));
        assert_eq!(
            (e.meta.mtime, e.meta.mtime_nsec),
            (1_700_000_000, 123_456_789)
        );
        let x: Vec<(&[u8], &[u8])> = e
            .meta
            .xattrs
            .iter()
            .map(|(k, v)| (k.as_slice(), v.as_slice()))
            .collect();
        assert_eq!(
            x,
            vec![
                (&b"security.capability"[..], cap),
                (b"user.Ab", b"hi\0"),
                (b"user.tricky", b"x\n22 linkpath=/etc/evil\n"),
                (b"user.z", b"last"),
            ]
        );
        let (e, _) = rec.get(b"a/very/long/\xffpath");
        assert_eq!(
            (e.kind.clone(), e.meta.mtime, e.meta.mtime_nsec),
            (EntryKind::Dir, -2, 750_000_000)
        );
        assert_eq!(
            rec.get(b"sym").0.kind,
            EntryKind::Symlink(b"harmless".to_vec())
        );
        assert_eq!(rec.get(b"big-uid").0.meta.uid, 5_000_000);
    }

    #[test]
    fn whiteouts_and_opaque_directories() {
        let mut b = tar::Builder::new(Vec::new());
        for p in [
            ".wh.gone",
            "dir/.wh.x",
            "dir/.wh..wh..opq",
            ".wh..wh.plnk/123",
            "./.wh..wh..opq",
            "dir/.wh..wh.aufs",
        ] {
            add(&mut b, p, EntryType::Regular, b"");
        }
        let rec = read(&b.into_inner().unwrap()).unwrap();
        let got: Vec<(String, EntryKind)> = rec
            .entries
            .iter()
            .map(|(e, _)| (show(&e.path), e.kind.clone()))
            .collect();
        assert_eq!(
            got,
            vec![
                ("gone".into(), EntryKind::Whiteout),
                ("dir/x".into(), EntryKind::Whiteout),
                ("dir".into(), EntryKind::Opaque),
                // `.wh..wh.plnk/123` lies below aufs metadata: a plain file by the OCI rules.
                (".wh..wh.plnk/123".into(), EntryKind::File { size: 0 }),
                ("".into(), EntryKind::Opaque),
            ]
        );
    }

    fn expect_unsafe(tar: &[u8], why_part: &str) {
        match read(tar) {
            Err(BuildError::UnsafeEntry { why, .. }) => assert!(why.contains(why_part), "{why}"),
            other => panic!(
                "expected UnsafeEntry ({why_part}), got {:?}",
                other.map(|r| r.paths())
            ),
        }
    }

    #[test]
    fn hostile_members_are_refused() {
        for name in [
            &b"/etc/passwd"[..],
            b"../x",
            b"a/../../x",
            b"a/..",
            b"./../x",
        ] {
            let mut out = Vec::new();
            raw(&mut out, name, EntryType::Regular, b"", b"x");
            expect_unsafe(&end(out), if name[0] == b'/' { "absolute" } else { ".." });
        }
        for (target, why) in [
            (&b"../x"[..], ".."),
            (b"/etc/shadow", "absolute"),
            (b"a/../../etc", ".."),
        ] {
            let mut out = Vec::new();
            raw(&mut out, b"ok", EntryType::Regular, b"", b"x");
            raw(&mut out, b"link", EntryType::Link, target, b"");
            expect_unsafe(&end(out), why);
        }
        let mut out = Vec::new();
        raw_pax(&mut out, &[("path", b"a\0b")]);
        raw(&mut out, b"name", EntryType::Regular, b"", b"");
        expect_unsafe(&end(out), "NUL");
        let mut out = Vec::new();
        raw(&mut out, b"d/.wh...", EntryType::Regular, b"", b"");
        expect_unsafe(&end(out), "whiteout");

        // A hard link to nothing seen before.
        let mut out = Vec::new();
        raw(&mut out, b"link", EntryType::Link, b"later", b"");
        raw(&mut out, b"later", EntryType::Regular, b"", b"");
        assert!(matches!(read(&end(out)), Err(BuildError::Tar(m)) if m.contains("not an earlier")));

        // A PAX size the tar crate misses (it stops at a value holding a newline) must not shift the framing.
        let mut out = Vec::new();
        raw_pax(
            &mut out,
            &[("SCHILY.xattr.user.t", b"v\nw"), ("size", b"4")],
        );
        raw(&mut out, b"f", EntryType::Regular, b"", b""); // size 0 in the header, as for huge files
        raw(&mut out, b"1234", EntryType::Regular, b"", b""); // the data block, if misframed: a header
        match read(&end(out)) {
            Err(BuildError::Tar(m)) => assert!(m.contains("PAX size"), "{m}"),
            other => panic!("{:?}", other.map(|r| r.paths())),
        }
    }

    #[test]
    fn unsupported_and_skipped_types() {
        let mut out = Vec::new();
        raw(
            &mut out,
            b"pax_global_header",
            EntryType::XGlobalHeader,
            b"",
            b"9 a=bcd\n",
        );
        raw(&mut out, b"kept", EntryType::Regular, b"", b"k");
        let mut h = header(EntryType::Regular, 0o755, 0);
        h.as_old_mut().linkflag = [0];
        h.as_old_mut().name[..8].copy_from_slice(b"old-dir/");
        h.set_cksum();
        out.extend_from_slice(h.as_bytes());
        let rec = read(&end(out)).unwrap();
        assert_eq!(rec.paths(), ["kept", "old-dir"]);
        assert_eq!(rec.get(b"old-dir").0.kind, EntryKind::Dir);

        let mut out = Vec::new();
        raw(&mut out, b"vol", EntryType::new(b'M'), b"", b"");
        assert!(matches!(
            read(&end(out)),
            Err(BuildError::Unsupported { .. })
        ));
        let mut out = Vec::new();
        raw_pax(
            &mut out,
            &[("GNU.sparse.major", b"1"), ("GNU.sparse.minor", b"0")],
        );
        raw(&mut out, b"GNUSparseFile.0/f", EntryType::Regular, b"", b"");
        assert!(matches!(
            read(&end(out)),
            Err(BuildError::Unsupported { .. })
        ));
    }

    #[test]
    fn gnu_sparse_members_are_materialized() {
        let dir = tempfile::Builder::new()
            .prefix("strata-tar-")
            .tempdir_in("/var/tmp")
            .unwrap();
        let path = dir.path().join("sparse");
        let f = std::fs::File::create(&path).unwrap();
        f.set_len(8 << 20).unwrap();
        std::os::unix::fs::FileExt::write_at(&f, b"middle", 4 << 20).unwrap();
        std::os::unix::fs::FileExt::write_at(&f, b"end", (8 << 20) - 3).unwrap();
        drop(f);
        let mut b = tar::Builder::new(Vec::new());
        b.append_path_with_name(&path, "sparse").unwrap();
        let tar = b.into_inner().unwrap();
        assert_eq!(tar[156], b'S', "the builder wrote a GNU sparse member");
        assert!(tar.len() < 1 << 20);
        let rec = read(&tar).unwrap();
        let (e, data) = rec.get(b"sparse");
        assert_eq!(e.kind, EntryKind::File { size: 8 << 20 });
        let data = data.as_ref().unwrap();
        assert_eq!(&data[4 << 20..(4 << 20) + 6], b"middle");
        assert_eq!(&data[(8 << 20) - 3..], b"end");
        assert!(data[..4 << 20].iter().all(|&b| b == 0));
    }

    #[test]
    fn truncated_and_corrupt_streams() {
        let mut out = Vec::new();
        raw(&mut out, b"one", EntryType::Regular, b"", &[1; 1000]);
        raw(&mut out, b"two", EntryType::Regular, b"", &[2; 600]);
        let full = end(out);
        assert_eq!(read(&full).unwrap().paths(), ["one", "two"]);
        // One zero block is enough for an end.
        assert_eq!(
            read(&full[..full.len() - 512]).unwrap().paths(),
            ["one", "two"]
        );

        let cases: [(&str, usize, &str); 6] = [
            ("empty", 0, "end-of-archive"),
            ("mid header", 100, "before the first entry"),
            ("mid data", 512 + 500, "\"one\""),
            ("in padding", 512 + 1000 + 10, "\"one\""),
            ("at a boundary", 512 + 1024, "end-of-archive"),
            (
                "after the last data",
                512 + 1024 + 512 + 1024,
                "end-of-archive",
            ),
        ];
        for (what, at, part) in cases {
            match read(&full[..at]) {
                Err(BuildError::Tar(m)) => assert!(m.contains(part), "{what}: {m}"),
                other => panic!("{what}: {:?}", other.map(|r| r.paths())),
            }
        }

        let mut bad = full.clone();
        bad[512 + 1024 + 3] ^= 1; // a byte of the second header's name
        match read(&bad) {
            Err(BuildError::Tar(m)) => {
                assert!(m.contains("checksum") && m.contains("\"one\""), "{m}")
            }
            other => panic!("{:?}", other.map(|r| r.paths())),
        }
    }

    #[test]
    fn pax_time_and_decoders() {
        assert_eq!(parse_time(b"12").unwrap(), (12, 0));
        assert_eq!(parse_time(b"1.5").unwrap(), (1, 500_000_000));
        assert_eq!(parse_time(b"-1.5").unwrap(), (-2, 500_000_000));
        assert_eq!(parse_time(b"-3").unwrap(), (-3, 0));
        assert_eq!(parse_time(b"1.1234567899").unwrap(), (1, 123_456_789));
        for bad in [&b""[..], b"x", b"1.2.3", b".5", b"- 1"] {
            assert!(parse_time(bad).is_err(), "{}", show(bad));
        }
        assert_eq!(base64_decode(b"aGkA").unwrap(), b"hi\0");
        assert_eq!(base64_decode(b"aGk=").unwrap(), b"hi");
        assert_eq!(base64_decode(b"aGk").unwrap(), b"hi");
        assert!(base64_decode(b"a*").is_none());
        assert_eq!(percent_decode(b"user.%2Fx%25").unwrap(), b"user./x%");
        assert!(percent_decode(b"%4").is_none());
        assert!(Pax::parse(Some(b"11 path=a\n")).is_err());
        assert!(Pax::parse(Some(b"9 path=ab\n")).is_err());
        assert!(Pax::parse(Some(b"1x path=a\n")).is_err());
        let pax = Pax::parse(Some(b"10 path=a\n16 uid=12345678\n\0\0")).unwrap();
        assert_eq!(
            (pax.path.as_deref(), pax.uid),
            (Some(&b"a"[..]), Some(12_345_678))
        );
    }
}

//! The tar source: reads a tar stream (plain, gzip or zstd; ustar, GNU or PAX) once, front to back, and
//! emits one [`Entry`] per member, OCI whiteouts converted.
//!
//! **Framing.** The `tar` crate frames the stream: header checksums, GNU long names and links, the PAX
//! `size` record, GNU sparse members (materialized with zeros; [`tar::Entry::size`] is the logical size,
//! which is what we use), skipping data nobody read. Its parsing of PAX records is not trusted: tar 0.4.46
//! splits a PAX header on newlines before honouring each record's length, so a record whose value holds a
//! newline (a binary `security.capability` often does) is misparsed, and the tail of such a value can pass
//! for a `path` or `linkpath` record of its own (composefs/tar-rs#428, #452). So the input is tapped: the
//! bytes from the end of one member's data to the end of the next member's header (its extension headers
//! and the header) are recorded and parsed here — PAX records by their length prefix, GNU long names, the
//! header as it was in the stream. Every name and number of an entry comes from that parse, and the
//! crate's framing must agree with it: a PAX `size` the crate did not honour is an error, never a shifted
//! stream.
//!
//! **Entries.** Paths are normalized (leading `./`, `.` components, repeated and trailing `/` dropped; `.`
//! is the root, the empty path). An absolute path, a `..` component or a NUL is refused with
//! [`BuildError::UnsafeEntry`] naming the member, as is a hard link target that is absolute or has `..`; a
//! hard link must name an earlier non-directory member. Symlink targets are kept verbatim, absolute or with
//! `..`: the builder stores them as data and never follows them; they are resolved only inside the sandbox
//! that mounts the image. Metadata: mode `& 0o7777`; uid and gid (PAX over the header's, which may be
//! base-256); mtime (PAX, its fraction as nanoseconds, negative times too, else the header's seconds);
//! xattrs from PAX `SCHILY.xattr.NAME` (raw value) and `LIBARCHIVE.xattr.NAME` (%-encoded name, base64
//! value), sorted. Types: regular (`0`; old `\0`, a directory if its name ends in `/`; contiguous `7`),
//! GNU sparse, directory, symlink, hard link, character and block devices, fifo. PAX global headers are
//! skipped; anything else (GNU multi-volume, dump-dir, PAX-format GNU sparse files) is
//! [`BuildError::Unsupported`]. OCI whiteouts: base name `.wh..wh..opq` is [`EntryKind::Opaque`] at its
//! directory, `.wh.NAME` is [`EntryKind::Whiteout`] at `dir/NAME`, other `.wh..wh.*` names (aufs
//! bookkeeping) are skipped.
//!
//! **Data, truncation, corruption.** A regular file's bytes go to the sink as [`FileSource::Stream`],
//! limited to its size; what the sink leaves unread is read and discarded before the next member. A stream
//! ending inside data, inside a header, or at a member boundary without the end-of-archive block (where
//! the crate alone stops silently: the tap records whether the input hit end-of-file), a bad header
//! checksum and any decompression error are [`BuildError::Tar`] naming the last good member and the byte
//! offset in the decompressed stream — never a silently partial layer. After the end-of-archive block the
//! input is read to its end, so a compressed stream's trailer (gzip CRC, zstd frame end and checksum if
//! present) is verified too; non-zero bytes there are ignored with a warning.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashSet};
use std::fmt::Display;
use std::io::{self, BufReader, Read};

use tar::{Archive, EntryType, Header};

use super::{join, Entry, EntryKind, EntrySink, FileSource};
use crate::error::{BuildError, TarError, TarPlace};
use crate::tree::Meta;

const BLOCK: u64 = 512;
const BUF: usize = 256 << 10;
/// Most bytes of extension headers (PAX, GNU long names, GNU sparse maps) one member may have.
const MAX_EXTENSIONS: usize = 64 << 20;

/// Opens a possibly compressed tar stream: gzip (`1f 8b`, multi-member too) and zstd (`28 b5 2f fd`) are
/// recognized by their magic bytes, anything else is read as plain tar. No byte is lost to the sniffing.
pub fn open_stream(mut reader: Box<dyn Read + Send>) -> Result<Box<dyn Read + Send>, BuildError> {
    let (mut magic, mut n) = ([0u8; 4], 0);
    while n < magic.len() {
        match reader.read(&mut magic[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(TarError::Read(e).into()),
        }
    }
    let head = magic[..n].to_vec();
    let (gzip, zstd) = (
        head.starts_with(&[0x1f, 0x8b]),
        head == [0x28, 0xb5, 0x2f, 0xfd],
    );
    let input = BufReader::with_capacity(BUF, io::Cursor::new(head).chain(reader));
    Ok(if gzip {
        Box::new(BufReader::with_capacity(
            BUF,
            flate2::bufread::MultiGzDecoder::new(input),
        ))
    } else if zstd {
        let decoder = zstd::stream::read::Decoder::with_buffer(input);
        let decoder = decoder.map_err(|e| BuildError::from(TarError::Zstd(e)))?;
        Box::new(BufReader::with_capacity(BUF, decoder))
    } else {
        Box::new(input)
    })
}

/// Reads a (decompressed) tar stream and hands every member to `sink` (see the module documentation).
pub fn read_tar(reader: impl Read, sink: &mut dyn EntrySink) -> Result<(), BuildError> {
    read_tar_checked(reader, sink, false)
}

/// [`read_tar`] for an OCI layer, whose completeness the caller checks itself against its digests: a
/// stream that ends at a member boundary without the end-of-archive block is accepted (some writers leave
/// the block out, `umoci insert` does; Go's and GNU tar readers accept it), and a hard link may name a
/// path that is not an earlier member — a file of the layers below, which the sink must resolve.
pub fn read_tar_verified(reader: impl Read, sink: &mut dyn EntrySink) -> Result<(), BuildError> {
    read_tar_checked(reader, sink, true)
}

fn read_tar_checked(
    reader: impl Read,
    sink: &mut dyn EntrySink,
    layer: bool,
) -> Result<(), BuildError> {
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
        links_below: layer,
        last: None,
    };
    let entries = archive.entries().map_err(|e| state.stream_io(e))?;
    for item in entries {
        let entry = item.map_err(|e| state.stream_io(e))?;
        state.member(entry, sink)?;
    }
    state.finish(&mut archive.into_inner(), layer)
}

/// What the tap saw of the input.
#[derive(Default)]
struct Tap {
    /// Bytes read so far.
    pos: u64,
    /// A read returned end-of-file.
    eof: bool,
    /// Reads are being copied into `window`, which starts at stream offset `start`.
    recording: bool,
    start: u64,
    window: Vec<u8>,
}

/// The input, counted and (from the end of one member's data to the next member's header) recorded.
struct Tapped<'t, R> {
    inner: R,
    tap: &'t RefCell<Tap>,
}

impl<R: Read> Read for Tapped<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        let mut tap = self.tap.borrow_mut();
        tap.eof |= n == 0 && !buf.is_empty();
        tap.pos += n as u64;
        if tap.recording {
            if tap.window.len() + n > MAX_EXTENSIONS {
                return Err(io::Error::other(
                    "over 64 MiB of extension headers for one member",
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
    /// Hard links may also name paths of the layers below (the sink resolves them).
    links_below: bool,
    /// The last member handled, for error messages.
    last: Option<String>,
}

fn show(path: &[u8]) -> String {
    String::from_utf8_lossy(path).into_owned()
}

fn entry_place(tap: &RefCell<Tap>, path: &str) -> TarPlace {
    TarPlace::Entry {
        path: path.to_string(),
        at: tap.borrow().pos,
    }
}

/// A member's bytes that are not valid tar.
fn entry_error(tap: &RefCell<Tap>, path: &str, why: impl Display) -> BuildError {
    let place = entry_place(tap, path);
    let why = why.to_string();
    TarError::Malformed { place, why }.into()
}

/// A member's bytes that could not be read.
fn entry_io(tap: &RefCell<Tap>, path: &str, source: io::Error) -> BuildError {
    let place = entry_place(tap, path);
    TarError::Stream { place, source }.into()
}

/// The member being converted, for its errors: each names it and where in the stream it is.
struct At<'t, 's> {
    tap: &'t RefCell<Tap>,
    shown: &'s str,
}

impl At<'_, '_> {
    fn bad(&self, why: &dyn Display) -> BuildError {
        entry_error(self.tap, self.shown, why)
    }

    fn unsafe_entry(&self, why: &'static str) -> BuildError {
        BuildError::UnsafeEntry {
            path: self.shown.to_string(),
            why,
        }
    }

    fn unsupported(&self, why: &str) -> BuildError {
        BuildError::Unsupported {
            path: self.shown.to_string(),
            why: why.into(),
        }
    }
}

/// A member's mode, owner and times (PAX records over the header's fields); its extended attributes are
/// left to the caller, which moves them out of the PAX records.
fn member_meta(m: &Member<'_>, at: &At<'_, '_>) -> Result<Meta, BuildError> {
    let (hdr, pax) = (m.hdr, &m.pax);
    let num = |v: io::Result<u64>| v.map_err(|e| at.bad(&e));
    let id = |v: u64| {
        u32::try_from(v).map_err(|_| at.unsupported(&format!("id {v} does not fit in 32 bits")))
    };
    let uid = id(pax.uid.map_or_else(|| num(hdr.uid()), Ok)?)?;
    let gid = id(pax.gid.map_or_else(|| num(hdr.gid()), Ok)?)?;
    // A base-256 header field is two's complement: negative times come out right.
    let (mtime, mtime_nsec) = pax
        .mtime
        .map_or_else(|| num(hdr.mtime()).map(|t| (t as i64, 0)), Ok)?;
    let perm = hdr.mode().map_err(|e| at.bad(&e))? & 0o7777;
    Ok(Meta {
        perm,
        uid,
        gid,
        mtime,
        mtime_nsec,
        xattrs: Vec::new(),
    })
}

/// One member as parsed from the recorded bytes.
struct Member<'a> {
    hdr: &'a Header,
    ext: &'a Extensions,
    pax: Pax,
    raw_path: Vec<u8>,
    shown: String,
    size: u64,
}

impl State<'_> {
    fn place(&self) -> TarPlace {
        let at = self.tap.borrow().pos;
        match &self.last {
            Some(last) => TarPlace::After {
                last: last.clone(),
                at,
            },
            None => TarPlace::Start { at },
        }
    }

    /// Bytes between members that are not valid tar.
    fn stream_error(&self, why: impl Display) -> BuildError {
        let (place, why) = (self.place(), why.to_string());
        TarError::Malformed { place, why }.into()
    }

    /// Bytes between members that could not be read (the tar crate's header errors included).
    fn stream_io(&self, source: io::Error) -> BuildError {
        let place = self.place();
        TarError::Stream { place, source }.into()
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
        let ext = Extensions::parse(&window, start, entry.raw_header_position());
        let ext = ext.map_err(|why| self.stream_error(why))?;
        let hdr = Header::from_byte_slice(&ext.header);
        let pax = Pax::parse(ext.pax.as_deref());
        let pax_path = pax.as_ref().ok().and_then(|p| p.path.clone());
        let raw_path = ext
            .long_name
            .clone()
            .or(pax_path)
            .unwrap_or_else(|| hdr.path_bytes().into_owned());
        let shown = show(&raw_path);
        let size = entry.size();
        let mut data = Data {
            inner: &mut entry,
            left: size,
            failure: None,
        };
        let result = match pax {
            Err(why) => Err(entry_error(self.tap, &shown, why)),
            Ok(pax) => {
                let m = Member {
                    hdr,
                    ext: &ext,
                    pax,
                    raw_path,
                    shown: shown.clone(),
                    size,
                };
                self.convert(m, &mut data, sink)
            }
        };
        if let Err(e) = result {
            // A sink that failed to read the data reports it in its own words: say what really happened.
            return Err(data
                .failure
                .take()
                .map_or(e, |source| entry_io(self.tap, &shown, source)));
        }
        io::copy(&mut data, &mut io::sink()).map_err(|e| entry_io(self.tap, &shown, e))?;
        self.last = Some(shown);
        let mut tap = self.tap.borrow_mut();
        (tap.recording, tap.start) = (true, tap.pos);
        Ok(())
    }

    /// Converts one member and hands it to the sink.
    fn convert(
        &mut self,
        mut m: Member<'_>,
        data: &mut Data<'_>,
        sink: &mut dyn EntrySink,
    ) -> Result<(), BuildError> {
        if m.hdr.entry_type() == EntryType::XGlobalHeader {
            return Ok(());
        }
        let (linkpath, xattrs) = (m.pax.linkpath.take(), std::mem::take(&mut m.pax.xattrs));
        let at = At {
            tap: self.tap,
            shown: &m.shown,
        };
        if m.pax.gnu_sparse {
            return Err(at.unsupported("PAX-format GNU sparse files are not supported"));
        }
        let size = m.size;
        if m.pax.size.is_some_and(|s| s != size) && m.hdr.entry_type() != EntryType::GNUSparse {
            return Err(at.bad(&format_args!(
                "PAX size {:?}, but the tar reader framed {size} bytes",
                m.pax.size
            )));
        }
        let path = normalize(&m.raw_path).map_err(|b| b.error(at.shown, false))?;
        let meta = Meta {
            xattrs,
            ..member_meta(&m, &at)?
        };
        let (dir, base) = match path.iter().rposition(|&b| b == b'/') {
            Some(i) => (&path[..i], &path[i + 1..]),
            None => (&path[..0], &path[..]),
        };
        let (path, kind) = if base == b".wh..wh..opq" {
            (dir.to_vec(), EntryKind::Opaque)
        } else if base.starts_with(b".wh..wh.") {
            tracing::debug!(path = %at.shown, "skipping aufs metadata");
            return Ok(());
        } else if let Some(hidden) = base.strip_prefix(b".wh.") {
            if matches!(hidden, b"" | b"." | b"..") {
                return Err(at.unsafe_entry("whiteout of an empty name, '.' or '..'"));
            }
            (join(dir, hidden), EntryKind::Whiteout)
        } else {
            let kind = self.member_kind(&m, linkpath, &at)?;
            (path, kind)
        };
        if path.is_empty() && !matches!(kind, EntryKind::Dir | EntryKind::Opaque) {
            return Err(at.unsupported("a non-directory at the root"));
        }
        if matches!(
            kind,
            EntryKind::Dir | EntryKind::Whiteout | EntryKind::Opaque
        ) {
            self.seen.remove(&path);
        } else {
            self.seen.insert(path.clone());
        }
        let file = matches!(kind, EntryKind::File { .. });
        sink.add(
            Entry { path, meta, kind },
            file.then_some(FileSource::Stream(data)),
        )
    }

    /// What a member that is neither a whiteout nor an opaque marker is, from its type and link.
    fn member_kind(
        &self,
        m: &Member<'_>,
        linkpath: Option<Vec<u8>>,
        at: &At<'_, '_>,
    ) -> Result<EntryKind, BuildError> {
        let hdr = m.hdr;
        let link = m.ext.long_link.clone().or(linkpath);
        let link = link
            .or_else(|| hdr.link_name_bytes().map(|l| l.into_owned()))
            .unwrap_or_default();
        let dev = || -> Result<u64, BuildError> {
            let major = hdr.device_major().map_err(|e| at.bad(&e))?.unwrap_or(0);
            let minor = hdr.device_minor().map_err(|e| at.bad(&e))?.unwrap_or(0);
            Ok(libc::makedev(major, minor))
        };
        let old_dir = hdr.as_old().linkflag[0] == 0 && m.raw_path.ends_with(b"/");
        Ok(match hdr.entry_type() {
            EntryType::Directory => EntryKind::Dir,
            EntryType::Regular if old_dir => EntryKind::Dir,
            EntryType::Regular | EntryType::Continuous | EntryType::GNUSparse => {
                EntryKind::File { size: m.size }
            }
            EntryType::Symlink if link.is_empty() => {
                return Err(at.unsupported("symlink without a target"))
            }
            EntryType::Symlink if link.contains(&0) => {
                return Err(at.unsafe_entry("symlink target holds a NUL"))
            }
            EntryType::Symlink => EntryKind::Symlink(link),
            EntryType::Link => {
                let target = normalize(&link).map_err(|b| b.error(at.shown, true))?;
                if !self.seen.contains(&target) && !self.links_below {
                    let t = show(&target);
                    return Err(at.bad(&format_args!(
                        "hard link to {t:?}, not an earlier non-directory entry"
                    )));
                }
                EntryKind::HardLink(target)
            }
            EntryType::Char => EntryKind::CharDev { rdev: dev()? },
            EntryType::Block => EntryKind::BlockDev { rdev: dev()? },
            EntryType::Fifo => EntryKind::Fifo,
            other => {
                let t = char::from(other.as_byte());
                return Err(at.unsupported(&format!("tar member type {t:?} is not supported")));
            }
        })
    }

    /// After the end-of-archive block: checks the input did not just stop, then reads it to its end.
    fn finish(&self, input: &mut impl Read, verified: bool) -> Result<(), BuildError> {
        let (eof, pos) = {
            let mut tap = self.tap.borrow_mut();
            (tap.recording, tap.window) = (false, Vec::new());
            (tap.eof, tap.pos)
        };
        if eof && !verified {
            return Err(
                self.stream_error("truncated: the stream ends without the end-of-archive block")
            );
        }
        let (mut buf, mut trailing, mut nonzero) = (vec![0u8; 64 << 10], 0u64, false);
        loop {
            match input.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    (trailing, nonzero) = (
                        trailing + n as u64,
                        nonzero || buf[..n].iter().any(|&b| b != 0),
                    )
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(source) => return Err(TarError::Trailing { at: pos, source }.into()),
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
    /// Why reading failed (truncation, decompression), so the error can name the member; the sink
    /// gets an error of the same kind.
    failure: Option<io::Error>,
}

impl Read for Data<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let want = buf
            .len()
            .min(usize::try_from(self.left).unwrap_or(usize::MAX));
        if want == 0 {
            return Ok(0);
        }
        let result = match self.inner.read(&mut buf[..want]) {
            Ok(0) => Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "truncated: the stream ends inside the data",
            )),
            other => other,
        };
        match result {
            Ok(n) => {
                self.left -= n as u64;
                Ok(n)
            }
            Err(e) if e.kind() != io::ErrorKind::Interrupted => {
                let kind = e.kind();
                self.failure = Some(e);
                Err(io::Error::new(kind, "the member's data could not be read"))
            }
            Err(e) => Err(e),
        }
    }
}

/// The extension headers in front of a member, and the member's header, as they were in the stream.
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
    /// and including the member header the `tar` crate found at `header_pos`.
    fn parse(window: &[u8], start: u64, header_pos: u64) -> Result<Extensions, String> {
        let slice = |at: u64, len: u64| {
            let from = at.checked_sub(start).and_then(|f| usize::try_from(f).ok());
            let to = from.and_then(|f| f.checked_add(usize::try_from(len).ok()?));
            match (from, to) {
                (Some(f), Some(t)) if t <= window.len() => Ok(&window[f..t]),
                _ => Err(format!("internal error: bytes at {at} were not recorded")),
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
            let trimmed =
                || data[..data.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1)].to_vec();
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
                "extension headers end at byte {at}, the member header is at {header_pos}"
            ));
        }
        ext.header.copy_from_slice(slice(header_pos, BLOCK)?);
        Ok(ext)
    }
}

/// The PAX records this source uses, parsed by their length prefixes (later records win).
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
        let (mut pax, mut xattrs) = (Pax::default(), BTreeMap::new());
        let mut rest = data.unwrap_or_default();
        while rest.iter().any(|&b| b != 0) {
            let bad = || {
                format!(
                    "malformed PAX record {:?}",
                    show(&rest[..rest.len().min(40)])
                )
            };
            let space = rest.iter().position(|&b| b == b' ').ok_or_else(bad)?;
            let digits = &rest[..space];
            let len = parse_num::<usize>(digits).filter(|&l| l > space + 1 && l <= rest.len());
            let len = len.filter(|&l| rest[l - 1] == b'\n').ok_or_else(bad)?;
            let record = &rest[space + 1..len - 1];
            let eq = record.iter().position(|&b| b == b'=').ok_or_else(bad)?;
            let (key, value) = (&record[..eq], &record[eq + 1..]);
            // An empty value removes the keyword (POSIX); an xattr may have an empty value, though.
            let opt = || (!value.is_empty()).then(|| value.to_vec());
            let num = || match value.is_empty() {
                true => Ok(None),
                false => parse_num(value).map(Some).ok_or_else(bad),
            };
            match key {
                b"path" => pax.path = opt(),
                b"linkpath" => pax.linkpath = opt(),
                b"size" => pax.size = num()?,
                b"uid" => pax.uid = num()?,
                b"gid" => pax.gid = num()?,
                b"mtime" if value.is_empty() => pax.mtime = None,
                b"mtime" => pax.mtime = Some(parse_time(value)?),
                _ if key.starts_with(b"GNU.sparse.") => pax.gnu_sparse = true,
                _ => {
                    let schily = key.strip_prefix(b"SCHILY.xattr.");
                    let xattr = match (schily, key.strip_prefix(b"LIBARCHIVE.xattr.")) {
                        (Some(name), _) => Some(Some((name.to_vec(), value.to_vec()))),
                        (_, Some(name)) => Some(percent_decode(name).zip(base64_decode(value))),
                        _ => None,
                    };
                    if let Some(xattr) = xattr {
                        let valid = |(n, _): &(Vec<u8>, Vec<u8>)| !n.is_empty() && !n.contains(&0);
                        let (name, value) = xattr.filter(valid).ok_or_else(bad)?;
                        xattrs.insert(name, value);
                    }
                }
            }
            rest = &rest[len..];
        }
        pax.xattrs = xattrs.into_iter().collect();
        Ok(pax)
    }
}

fn parse_num<T: std::str::FromStr>(digits: &[u8]) -> Option<T> {
    let s = std::str::from_utf8(digits)
        .ok()
        .filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))?;
    s.parse().ok()
}

/// A PAX time: decimal seconds, maybe negative, with an optional fraction (kept to nanoseconds).
fn parse_time(v: &[u8]) -> Result<(i64, u32), String> {
    let (neg, digits) = v.strip_prefix(b"-").map_or((false, v), |d| (true, d));
    let mut parts = digits.splitn(2, |&b| b == b'.');
    let secs: Option<i64> = parts.next().and_then(parse_num);
    let frac = parts.next().unwrap_or_default();
    let secs = secs
        .filter(|_| frac.iter().all(u8::is_ascii_digit))
        .ok_or_else(|| format!("bad PAX time {:?}", show(v)))?;
    let nanos = frac
        .iter()
        .chain([b'0'; 9].iter())
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
    let (mut out, mut i) = (Vec::with_capacity(s.len()), 0);
    while i < s.len() {
        if s[i] == b'%' {
            out.push(u8::from_str_radix(std::str::from_utf8(s.get(i + 1..i + 3)?).ok()?, 16).ok()?);
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
    let (mut out, mut acc, mut bits) = (Vec::with_capacity(s.len() * 3 / 4), 0u32, 0u32);
    for &c in s {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        };
        (acc, bits) = ((acc << 6 | u32::from(v)) & 0xffff, bits + 6);
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    Some(out)
}

/// Why a member path (or hard link target) is refused.
enum Bad {
    Absolute,
    DotDot,
    Nul,
    TooLong,
}

impl Bad {
    fn error(self, path: &str, link: bool) -> BuildError {
        let why = match (self, link) {
            (Bad::Absolute, false) => "absolute path",
            (Bad::Absolute, true) => "hard link target is absolute",
            (Bad::DotDot, false) => "path has a '..' component",
            (Bad::DotDot, true) => "hard link target has a '..' component",
            (Bad::Nul, false) => "path holds a NUL",
            (Bad::Nul, true) => "hard link target holds a NUL",
            (Bad::TooLong, _) => {
                let why = "a path component longer than 255 bytes".into();
                return BuildError::Unsupported {
                    path: path.into(),
                    why,
                };
            }
        };
        BuildError::UnsafeEntry {
            path: path.into(),
            why,
        }
    }
}

/// Normalizes a member path: drops `.` and empty components (leading `./`, `//`, trailing `/`).
fn normalize(raw: &[u8]) -> Result<Vec<u8>, Bad> {
    if raw.contains(&0) {
        return Err(Bad::Nul);
    }
    if raw.first() == Some(&b'/') {
        return Err(Bad::Absolute);
    }
    let mut out = Vec::with_capacity(raw.len());
    for comp in raw
        .split(|&b| b == b'/')
        .filter(|c| !matches!(*c, b"" | b"."))
    {
        match comp {
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
#[path = "tar_tests.rs"]
mod tests;

//! An image's merged view, read straight from the store: `strata ls` and `strata cat`.
//!
//! Layers are searched top first with overlay's rules: a whiteout (0:0 character device) hides the name in
//! every lower layer, an opaque directory (`trusted.overlay.opaque=y`) hides the lower layers' directory of
//! the same path, and a non-directory ends the search. Only the metadata of the layers and the chunks of
//! the file being read are fetched; symlinks are shown, not followed.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;

use anyhow::{bail, Result};
use serde_json::json;
use strata_builder::erofs::{ErofsImage, Inode};
use strata_registry::blobread::BlobReader;
use strata_registry::model::LayerDescriptor;
use strata_registry::store::Store;

use crate::exit::NotFound;
use crate::images::resolve_image;

const S_IFMT: u32 = 0o170000;

struct Layer {
    desc: LayerDescriptor,
    image: ErofsImage,
}

/// An image's layers, top first.
pub(crate) struct View {
    layers: Vec<Layer>,
}

/// What a path resolves to: the top entry, and for directories every layer's directory that merges in.
struct Found {
    top: (usize, Inode),
    dirs: Vec<(usize, Inode)>,
}

impl View {
    pub(crate) fn open(store: &Store, reference: &str) -> Result<View> {
        let (_, m) = resolve_image(store, reference)?;
        let mut layers = Vec::new();
        for l in m.layers.iter().rev() {
            let desc = store.get_layer(&l.digest)?;
            let image = ErofsImage::parse(store.get_meta(&desc.meta.digest)?)?;
            layers.push(Layer { desc, image });
        }
        Ok(View { layers })
    }

    fn root(&self) -> Result<Found> {
        let mut dirs = Vec::new();
        for (i, l) in self.layers.iter().enumerate() {
            let root = l.image.inode(l.image.root_nid())?;
            let opaque = root.is_opaque();
            dirs.push((i, root));
            if opaque {
                break;
            }
        }
        let top = dirs[0].clone();
        Ok(Found { top, dirs })
    }

    /// Whether `path` (relative or absolute, raw bytes) names an entry of the merged view.
    pub(crate) fn exists(&self, path: &[u8]) -> Result<bool> {
        Ok(self.lookup(path)?.is_some())
    }

    /// Resolves a path in the merged view.
    fn lookup(&self, path: &[u8]) -> Result<Option<Found>> {
        let mut cur = self.root()?;
        for comp in path
            .split(|&b| b == b'/')
            .filter(|c| !c.is_empty() && *c != b".")
        {
            if !cur.top.1.is_dir() {
                return Ok(None);
            }
            let mut next: Option<Found> = None;
            for (li, dir) in &cur.dirs {
                let image = &self.layers[*li].image;
                let Some(e) = image.read_dir(dir)?.into_iter().find(|e| e.name == comp) else {
                    continue;
                };
                let inode = image.inode(e.nid)?;
                if inode.is_whiteout() {
                    break;
                }
                match &mut next {
                    None => {
                        let d = inode.is_dir();
                        let opaque = inode.is_opaque();
                        next = Some(Found {
                            top: (*li, inode.clone()),
                            dirs: if d { vec![(*li, inode)] } else { vec![] },
                        });
                        if !d || opaque {
                            break;
                        }
                    }
                    Some(f) => {
                        if !inode.is_dir() {
                            break;
                        }
                        let opaque = inode.is_opaque();
                        f.dirs.push((*li, inode));
                        if opaque {
                            break;
                        }
                    }
                }
            }
            match next {
                Some(n) => cur = n,
                None => return Ok(None),
            }
        }
        Ok(Some(cur))
    }

    /// The merged entries of a directory, sorted by name (whiteouts applied).
    fn list(&self, f: &Found) -> Result<BTreeMap<Vec<u8>, (usize, Inode)>> {
        let mut out = BTreeMap::new();
        let mut hidden = std::collections::HashSet::new();
        for (li, dir) in &f.dirs {
            let image = &self.layers[*li].image;
            for e in image.read_dir(dir)? {
                if out.contains_key(&e.name) || hidden.contains(&e.name) {
                    continue;
                }
                let inode = image.inode(e.nid)?;
                if inode.is_whiteout() {
                    hidden.insert(e.name);
                } else {
                    out.insert(e.name, (*li, inode));
                }
            }
        }
        Ok(out)
    }
}

fn mode_string(mode: u32) -> String {
    let t = match mode & S_IFMT {
        0o040000 => 'd',
        0o120000 => 'l',
        0o020000 => 'c',
        0o060000 => 'b',
        0o010000 => 'p',
        0o140000 => 's',
        _ => '-',
    };
    let mut s = String::from(t);
    let bits = [
        (0o400, 'r'),
        (0o200, 'w'),
        (0o100, 'x'),
        (0o040, 'r'),
        (0o020, 'w'),
        (0o010, 'x'),
        (0o004, 'r'),
        (0o002, 'w'),
        (0o001, 'x'),
    ];
    for (b, c) in bits {
        s.push(if mode & b != 0 { c } else { '-' });
    }
    let mut v: Vec<char> = s.chars().collect();
    if mode & 0o4000 != 0 {
        v[3] = if v[3] == 'x' { 's' } else { 'S' };
    }
    if mode & 0o2000 != 0 {
        v[6] = if v[6] == 'x' { 's' } else { 'S' };
    }
    if mode & 0o1000 != 0 {
        v[9] = if v[9] == 'x' { 't' } else { 'T' };
    }
    v.into_iter().collect()
}

fn entry_json(view: &View, name: &[u8], li: usize, i: &Inode) -> Result<serde_json::Value> {
    let target = if i.mode & S_IFMT == 0o120000 {
        Some(String::from_utf8_lossy(&view.layers[li].image.data(i)?).into_owned())
    } else {
        None
    };
    let mut v = json!({
        "name": String::from_utf8_lossy(name), "mode": i.mode, "uid": i.uid, "gid": i.gid,
        "size": i.size, "mtime": i.mtime, "mtime_nsec": i.mtime_nsec, "nlink": i.nlink,
        "rdev": i.rdev, "target": target, "layer": view.layers.len() - 1 - li,
        "xattrs": i.xattrs.iter().map(|(k, v)| (String::from_utf8_lossy(k).into_owned(), serde_json::Value::String(hex_of(v)))).collect::<serde_json::Map<_, _>>(),
    });
    // Names are bytes: one that is not UTF-8 is also given exactly, in hex.
    if std::str::from_utf8(name).is_err() {
        v["name_hex"] = json!(hex_of(name));
    }
    Ok(v)
}

/// `strata ls`.
pub fn ls(store: &Store, reference: &str, path: &str, json_out: bool) -> Result<()> {
    let view = View::open(store, reference)?;
    let f = view
        .lookup(path.as_bytes())?
        .ok_or_else(|| NotFound(format!("{path}: no such entry in {reference}")))?;
    let entries: Vec<(Vec<u8>, (usize, Inode))> = if f.top.1.is_dir() {
        view.list(&f)?.into_iter().collect()
    } else {
        let name = path.rsplit('/').next().unwrap_or(path).as_bytes().to_vec();
        vec![(name, f.top.clone())]
    };
    if json_out {
        let v: Result<Vec<_>> = entries
            .iter()
            .map(|(n, (li, i))| entry_json(&view, n, *li, i))
            .collect();
        println!("{}", serde_json::to_string_pretty(&v?)?);
        return Ok(());
    }
    let mut out = std::io::stdout().lock();
    for (name, (li, i)) in &entries {
        let mut line = format!(
            "{} {:>3} {:>6} {:>6} {:>12} {}",
            mode_string(i.mode),
            i.nlink,
            i.uid,
            i.gid,
            i.size,
            String::from_utf8_lossy(name)
        );
        if i.mode & S_IFMT == 0o120000 {
            let t = view.layers[*li].image.data(i)?;
            line.push_str(&format!(" -> {}", String::from_utf8_lossy(&t)));
        }
        writeln!(out, "{line}")?;
    }
    Ok(())
}

/// `strata cat`.
pub fn cat(store: &Store, reference: &str, path: &str) -> Result<()> {
    let view = View::open(store, reference)?;
    let f = view
        .lookup(path.as_bytes())?
        .ok_or_else(|| NotFound(format!("{path}: no such entry in {reference}")))?;
    let (li, inode) = &f.top;
    if inode.mode & S_IFMT != 0o100000 {
        bail!(crate::exit::Usage(format!("{path} is not a regular file")));
    }
    let layer = &view.layers[*li];
    let mut out = std::io::stdout().lock();
    let Ok(locs) = layer.image.chunks(inode) else {
        out.write_all(&layer.image.data(inode)?)?;
        return Ok(());
    };
    let chunk = 1u64 << inode.chunk_bits;
    let mut readers: HashMap<u16, BlobReader> = HashMap::new();
    let mut left = inode.size;
    for loc in locs {
        let n = chunk.min(left);
        match loc {
            None => out.write_all(&vec![0u8; n as usize])?,
            Some(loc) => {
                let reader = match readers.entry(loc.device) {
                    std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                    std::collections::hash_map::Entry::Vacant(e) => {
                        let blob = (loc.device as usize)
                            .checked_sub(1)
                            .and_then(|i| layer.desc.blobs.get(i))
                            .ok_or_else(|| {
                                anyhow::anyhow!("{path}: chunk on unknown device {}", loc.device)
                            })?;
                        e.insert(BlobReader::open(store, blob)?)
                    }
                };
                let bytes = reader.chunk_at_block(loc.block as u64)?;
                let take = (n as usize).min(bytes.len());
                out.write_all(&bytes[..take])?;
                if take < n as usize {
                    out.write_all(&vec![0u8; n as usize - take])?;
                }
            }
        }
        left -= n;
    }
    Ok(())
}

fn hex_of(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

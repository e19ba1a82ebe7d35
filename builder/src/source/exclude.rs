//! Exclude patterns: which paths a layer leaves out — a repository's `.git` in `strata build`, residue
//! (answer files, caches, history) in `pack_diff`. One matcher for both.
//!
//! The syntax is gitignore's (as `.dockerignore` files are written), matched by the `ignore` crate's
//! gitignore matcher on raw byte paths relative to the layer root:
//!
//! - a pattern with a `/` in it (a leading one included; a trailing one aside) is anchored at the root:
//!   `/root/.cache`, `home/*/secrets.txt`, `var/log/**/*.gz`;
//! - a pattern without one matches a name at any depth: `*.pyc`, `__pycache__`, `.git`;
//! - `*` matches within a component, `?` one character, `[abc]`, `[a-z]`, `[!x]` a set; `**` as a
//!   whole component any number of components, none included;
//! - a trailing `/` matches directories only;
//! - `!PATTERN` re-includes what an earlier pattern excluded (the last pattern that matches decides);
//!   a path below an excluded directory stays excluded (gitignore's rule: the directory is not entered);
//! - in a file (`--exclude-from`), blank lines and lines starting with `#` are skipped (`\#` for a
//!   literal `#`).
//!
//! A directory that matches is excluded with everything inside it: [`Excluding`] (a sink in front of a
//! build's) and `pack_diff`'s upper-directory walk keep track of excluded directories.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use ignore::gitignore::{Gitignore, GitignoreBuilder};

use super::{Entry, EntryKind, EntrySink, Existing, FileSource};
use crate::error::BuildError;

/// A set of exclude patterns, in order.
#[derive(Clone, Debug)]
pub struct Excludes {
    matcher: Gitignore,
    texts: Vec<String>,
}

impl Default for Excludes {
    fn default() -> Excludes {
        Excludes {
            matcher: Gitignore::empty(),
            texts: Vec::new(),
        }
    }
}

/// Patterns that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum PatternError {
    #[error("exclude pattern {pattern:?}: {why}")]
    Bad { pattern: String, why: String },
    #[error("exclude file {path}: {source}")]
    File {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl Excludes {
    /// Parses patterns given one by one (see the module documentation); an empty one is an error.
    pub fn new<S: AsRef<str>>(patterns: &[S]) -> Result<Excludes, PatternError> {
        Excludes::with_files(&[], patterns)
    }

    /// The patterns of `files` (one a line, `.dockerignore` style), in order, then `patterns`.
    pub fn with_files<S: AsRef<str>>(
        files: &[PathBuf],
        patterns: &[S],
    ) -> Result<Excludes, PatternError> {
        let mut b = GitignoreBuilder::new("");
        let mut texts = Vec::new();
        for f in files {
            let text = std::fs::read_to_string(f).map_err(|source| PatternError::File {
                path: f.clone(),
                source,
            })?;
            for line in text.lines() {
                let t = line.trim();
                if !t.is_empty() && !t.starts_with('#') {
                    add(&mut b, line)?;
                    texts.push(line.to_string());
                }
            }
        }
        for p in patterns {
            let text = p.as_ref();
            let bad = |why: &str| PatternError::Bad {
                pattern: text.to_string(),
                why: why.to_string(),
            };
            if text.trim_start_matches('!').trim_matches('/').is_empty() {
                return Err(bad("matches nothing (empty) or everything (/)"));
            }
            add(&mut b, text)?;
            texts.push(text.to_string());
        }
        let matcher = b.build().map_err(|e| PatternError::Bad {
            pattern: texts.join(" "),
            why: e.to_string(),
        })?;
        Ok(Excludes { matcher, texts })
    }

    /// True when there are no patterns.
    pub fn is_empty(&self) -> bool {
        self.texts.is_empty()
    }

    /// The patterns as given.
    pub fn texts(&self) -> &[String] {
        &self.texts
    }

    /// Whether `path` (relative, `/`-separated; `is_dir` if a directory) itself is excluded: the last
    /// pattern matching it excludes rather than re-includes.
    pub fn matches(&self, path: &[u8], is_dir: bool) -> bool {
        let path = Path::new(OsStr::from_bytes(path));
        !path.as_os_str().is_empty() && self.matcher.matched(path, is_dir).is_ignore()
    }

    /// A sink that passes to `inner` the entries these patterns do not exclude.
    pub fn sink<'a>(&'a self, inner: &'a mut dyn EntrySink) -> Excluding<'a> {
        Excluding {
            inner,
            excludes: self,
            dirs: Vec::new(),
            excluded: 0,
        }
    }
}

/// Adds one pattern line, checking it for `.` and `..` components.
fn add(b: &mut GitignoreBuilder, line: &str) -> Result<(), PatternError> {
    let bad = |why: String| PatternError::Bad {
        pattern: line.to_string(),
        why,
    };
    if line
        .trim()
        .trim_start_matches('!')
        .split('/')
        .any(|c| c == "." || c == "..")
    {
        return Err(bad("`.` and `..` components are not allowed".into()));
    }
    b.add_line(None, line).map_err(|e| bad(e.to_string()))?;
    Ok(())
}

/// A sink in front of another that drops excluded entries and everything below an excluded directory.
pub struct Excluding<'a> {
    inner: &'a mut dyn EntrySink,
    excludes: &'a Excludes,
    /// Excluded directories (sources give a directory before what it holds).
    dirs: Vec<Vec<u8>>,
    /// Entries excluded (those below an excluded directory not counted).
    pub excluded: u64,
}

impl Excluding<'_> {
    fn below_excluded(&self, path: &[u8]) -> bool {
        self.dirs
            .iter()
            .any(|d| path.len() > d.len() && path.starts_with(d) && path[d.len()] == b'/')
    }

    fn excluded(&self, path: &[u8], is_dir: bool) -> bool {
        self.below_excluded(path) || self.excludes.matches(path, is_dir)
    }
}

impl EntrySink for Excluding<'_> {
    fn add(&mut self, entry: Entry, data: Option<FileSource<'_>>) -> Result<(), BuildError> {
        let is_dir = matches!(entry.kind, EntryKind::Dir | EntryKind::Opaque);
        if self.below_excluded(&entry.path) {
            return Ok(());
        }
        if self.excludes.matches(&entry.path, is_dir) {
            self.excluded += 1;
            if matches!(entry.kind, EntryKind::Dir) {
                self.dirs.push(entry.path);
            }
            return Ok(());
        }
        if let EntryKind::HardLink(target) = &entry.kind {
            if self.excluded(target, false) {
                return Err(BuildError::Unsupported {
                    path: String::from_utf8_lossy(&entry.path).into_owned(),
                    why: format!(
                        "a hard link to {}, which is excluded: exclude both or neither",
                        String::from_utf8_lossy(target)
                    ),
                });
            }
        }
        self.inner.add(entry, data)
    }

    fn existing(&self, path: &[u8]) -> Existing {
        self.inner.existing(path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(pats: &[&str], path: &str) -> bool {
        Excludes::new(pats).unwrap().matches(path.as_bytes(), false)
    }

    #[test]
    fn basename_patterns_match_at_any_depth() {
        assert!(m(&["*.pyc"], "usr/lib/x/a.pyc"));
        assert!(m(&["*.pyc"], "a.pyc"));
        assert!(!m(&["*.pyc"], "a.pyc.txt"));
        assert!(m(&["__pycache__"], "a/b/__pycache__"));
        assert!(m(&["answer?.txt"], "root/answer1.txt"));
        assert!(!m(&["answer?.txt"], "root/answer12.txt"));
    }

    #[test]
    fn anchored_patterns_and_double_star() {
        assert!(m(&["/root/.cache"], "root/.cache"));
        assert!(!m(&["/root/.cache"], "home/root/.cache"));
        assert!(m(&["home/*/secret"], "home/u/secret"));
        assert!(!m(&["home/*/secret"], "home/u/v/secret"));
        assert!(m(&["var/log/**/*.gz"], "var/log/a.gz"));
        assert!(m(&["var/log/**/*.gz"], "var/log/x/y/a.gz"));
        assert!(m(&["**/id_rsa"], "home/u/.ssh/id_rsa"));
        let dir_only = Excludes::new(&["/tmp/"]).unwrap();
        assert!(dir_only.matches(b"tmp", true));
        assert!(!dir_only.matches(b"tmp", false));
    }

    #[test]
    fn classes() {
        assert!(m(&["log[0-9]"], "log7"));
        assert!(!m(&["log[0-9]"], "logx"));
        assert!(m(&["log[!0-9]"], "logx"));
    }

    #[test]
    fn negation_re_includes_and_the_last_match_decides() {
        let pats = ["*.log", "!keep.log", "/keep.log/x"];
        assert!(m(&pats, "a/b.log"));
        assert!(!m(&pats, "a/keep.log"));
        assert!(!m(&pats, "README"));
        assert!(m(&["!keep.log", "*.log"], "keep.log"));
    }

    #[test]
    fn files_have_comments_and_blank_lines() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join(".dockerignore");
        std::fs::write(
            &f,
            "# build context\n\n.git\n*.log\n!important.log\n\\#literal\n",
        )
        .unwrap();
        let ex = Excludes::with_files(&[f], &["extra"]).unwrap();
        assert_eq!(
            ex.texts(),
            [".git", "*.log", "!important.log", "\\#literal", "extra"]
        );
        assert!(ex.matches(b".git", true));
        assert!(ex.matches(b"x/y.log", false));
        assert!(!ex.matches(b"important.log", false));
        assert!(ex.matches(b"#literal", false));
        assert!(ex.matches(b"extra", false));
        let missing = Excludes::with_files(&[dir.path().join("none")], &[] as &[&str]);
        assert!(matches!(missing, Err(PatternError::File { .. })));
    }

    #[test]
    fn bad_patterns() {
        for p in ["/", "a/../b", "", "!", "log[z-a]", "./x"] {
            let e = Excludes::new(&[p]).expect_err(p);
            assert!(e.to_string().contains("exclude pattern"), "{e}");
        }
    }
}

//! Exclude patterns: which paths a snapshot leaves out (residue such as answer files, caches, history).
//!
//! The syntax is gitignore's core, on raw byte paths relative to the layer root:
//!
//! - a pattern with a `/` in it (a leading one included) is anchored at the root and matched component
//!   by component: `/root/.cache`, `home/*/secrets.txt`, `var/log/**/*.gz`;
//! - a pattern without one matches the last component of a path at any depth: `*.pyc`, `__pycache__`,
//!   `answer.txt`;
//! - `*` matches any bytes within a component, `?` one byte, `[abc]`, `[a-z]`, `[!x]` one byte of (or not
//!   of) a set; `**` as a whole component matches any number of components, none included;
//! - a trailing `/` is ignored (a directory matched excludes everything below it anyway).
//!
//! A directory that matches is excluded with everything inside it; the caller checks the ancestors.

/// One parsed pattern.
#[derive(Clone, Debug)]
struct Pattern {
    anchored: bool,
    comps: Vec<Vec<u8>>,
}

/// A set of exclude patterns.
#[derive(Clone, Debug, Default)]
pub struct Excludes {
    patterns: Vec<Pattern>,
    texts: Vec<String>,
}

/// A pattern that cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("exclude pattern {pattern:?}: {why}")]
pub struct PatternError {
    pub pattern: String,
    pub why: &'static str,
}

impl Excludes {
    /// Parses patterns (see the module documentation).
    pub fn new<S: AsRef<str>>(patterns: &[S]) -> Result<Excludes, PatternError> {
        let mut out = Excludes::default();
        for p in patterns {
            let text = p.as_ref();
            let fail = |why| PatternError {
                pattern: text.to_string(),
                why,
            };
            let trimmed = text.trim_end_matches('/');
            let anchored = trimmed.contains('/');
            let comps: Vec<Vec<u8>> = trimmed
                .split('/')
                .filter(|c| !c.is_empty())
                .map(|c| c.as_bytes().to_vec())
                .collect();
            if comps.is_empty() {
                return Err(fail("matches nothing (empty) or everything (/)"));
            }
            if comps.iter().any(|c| c == b"." || c == b"..") {
                return Err(fail("`.` and `..` components are not allowed"));
            }
            out.patterns.push(Pattern { anchored, comps });
            out.texts.push(text.to_string());
        }
        Ok(out)
    }

    /// True when there are no patterns.
    pub fn is_empty(&self) -> bool {
        self.patterns.is_empty()
    }

    /// The patterns as given.
    pub fn texts(&self) -> &[String] {
        &self.texts
    }

    /// Whether `path` (relative, `/`-separated) itself matches a pattern.
    pub fn matches(&self, path: &[u8]) -> bool {
        let comps: Vec<&[u8]> = path
            .split(|&b| b == b'/')
            .filter(|c| !c.is_empty())
            .collect();
        let Some(last) = comps.last() else {
            return false;
        };
        self.patterns.iter().any(|p| match p.anchored {
            true => match_comps(&p.comps, &comps),
            false => p.comps.len() == 1 && wildcard(&p.comps[0], last),
        })
    }
}

/// Component-wise match with `**`.
fn match_comps(pat: &[Vec<u8>], path: &[&[u8]]) -> bool {
    match pat.split_first() {
        None => path.is_empty(),
        Some((p, rest)) if p.as_slice() == b"**" => {
            (0..=path.len()).any(|skip| match_comps(rest, &path[skip..]))
        }
        Some((p, rest)) => match path.split_first() {
            Some((c, tail)) => wildcard(p, c) && match_comps(rest, tail),
            None => false,
        },
    }
}

/// Matches one component against one pattern component (`*`, `?`, `[...]`).
fn wildcard(p: &[u8], s: &[u8]) -> bool {
    match p.split_first() {
        None => s.is_empty(),
        Some((b'*', rest)) => (0..=s.len()).any(|i| wildcard(rest, &s[i..])),
        Some((b'?', rest)) => !s.is_empty() && wildcard(rest, &s[1..]),
        Some((b'[', rest)) => match (class(rest), s.split_first()) {
            (Some((set_match, after)), Some((c, tail))) => set_match(*c) && wildcard(after, tail),
            (None, Some((c, tail))) => *c == b'[' && wildcard(rest, tail),
            (_, None) => false,
        },
        Some((c, rest)) => s.first() == Some(c) && wildcard(rest, &s[1..]),
    }
}

/// Parses a `[...]` class body (after the `[`): a predicate and the pattern after the `]`. `None` when
/// there is no closing bracket (the `[` is then literal).
#[allow(clippy::type_complexity)]
fn class(p: &[u8]) -> Option<(Box<dyn Fn(u8) -> bool + '_>, &[u8])> {
    let (negate, body) = match p.first() {
        Some(b'!') | Some(b'^') => (true, &p[1..]),
        _ => (false, p),
    };
    // A `]` right after the opening (or the negation) is a member, not the end.
    let end = body.iter().skip(1).position(|&b| b == b']')? + 1;
    let set = &body[..end];
    let f = move |c: u8| {
        let mut i = 0;
        let mut hit = false;
        while i < set.len() {
            if i + 2 < set.len() && set[i + 1] == b'-' {
                hit |= (set[i]..=set[i + 2]).contains(&c);
                i += 3;
            } else {
                hit |= set[i] == c;
                i += 1;
            }
        }
        hit != negate
    };
    Some((Box::new(f), &body[end + 1..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(pats: &[&str], path: &str) -> bool {
        Excludes::new(pats).unwrap().matches(path.as_bytes())
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
        assert!(m(&["/tmp/"], "tmp"));
    }

    #[test]
    fn classes() {
        assert!(m(&["log[0-9]"], "log7"));
        assert!(!m(&["log[0-9]"], "logx"));
        assert!(m(&["log[!0-9]"], "logx"));
        assert!(m(&["a[]]b"], "a]b"));
        assert!(m(&["a[b"], "a[b"));
    }

    #[test]
    fn bad_patterns() {
        assert!(Excludes::new(&["/"]).is_err());
        assert!(Excludes::new(&["a/../b"]).is_err());
        assert!(Excludes::new(&[""]).is_err());
    }
}

//! What an S3 server really does with conditional writes, found by trying once per backend.
//!
//! Tags move only by compare-and-swap ([`super::tags`]), which on S3 is a conditional `PUT`:
//! `If-None-Match: *` to create, `If-Match: <etag>` to replace. S3-compatible servers differ here, and
//! a server that silently *ignores* the headers would turn every compare-and-swap into a blind overwrite
//! — two builders moving one tag would both "win" and one update would be lost with no error. So before
//! the first conditional write a backend [`probe`]s the server on a key of its own and remembers what it
//! found ([`Conditional`]):
//!
//! 1. create the probe object with `If-None-Match: *` (must succeed: the key is new);
//! 2. create it again (must fail: a server that lets this through ignores `If-None-Match`);
//! 3. replace it `If-Match` a made-up ETag (must fail: otherwise `If-Match` is ignored);
//! 4. replace it `If-Match` its real ETag (must succeed). Ceph's radosgw 16 (Pacific) compares the
//!    header byte for byte with the ETag it stores *without* the double quotes it sends back (and
//!    that RFC 9110 and every client put in the header), so the quoted ETag always fails with 412 —
//!    safe, but no tag could ever move. When the quoted form fails and the bare form succeeds, the
//!    backend sends bare ETags from then on ([`Conditional::BareETags`]); the comparison stays exact.
//! 5. delete the probe object. A probe that fails on the way returns at once, within the backend's
//!    deadline, and may leave its few bytes under `tmp/conditional-probe/`, which `strata gc` removes
//!    once older than its grace period.
//!
//! A server that fails step 2 or 3 gets [`Conditional::Missing`]: every conditional write on it is
//! [`StoreError::NoConditionalWrites`], naming the missing feature, and nothing is written. Tags can
//! still be used there through the documented fallback in [`super::tags`] (`STRATA_TAG_LOCK`: a lock
//! file that every tag writer shares). A probe that fails for another reason (the server is down) is
//! not remembered: the next conditional write probes again.

use bytes::Bytes;

use super::object::{PutMode, Version};
use super::StoreError;

/// What a server does with conditional writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Conditional {
    /// `If-None-Match: *` and `If-Match: "<etag>"` as S3 documents them.
    Standard,
    /// As [`Conditional::Standard`], but `If-Match` takes the ETag without its double quotes
    /// (Ceph radosgw 16).
    BareETags,
    /// The server ignores this header: no compare-and-swap is possible on it.
    Missing(&'static str),
}

/// The feature named when `If-None-Match: *` is ignored.
pub const NO_CREATE_ONLY: &str = "If-None-Match: * on PUT (create-only writes)";
/// The feature named when `If-Match` is ignored.
pub const NO_IF_MATCH: &str = "If-Match on PUT (compare-and-swap writes)";
/// The feature named when `If-Match` refuses the object's own ETag in every form.
pub const NO_MATCHING_ETAG: &str = "If-Match on PUT with the object's current ETag";

/// The ETag `v` without surrounding double quotes (and without a weak validator's `W/`).
pub fn bare(v: &Version) -> Version {
    Version {
        e_tag: v
            .e_tag
            .as_ref()
            .map(|e| e.trim_start_matches("W/").trim_matches('"').to_string()),
        version: v.version.clone(),
    }
}

/// Where probe objects live (and what a failed probe leaves: `Store::clean_spool` removes it).
pub const PROBE_PREFIX: &str = "tmp/conditional-probe/";

/// The probe's key: new for every probe, so a probe never meets another's object.
pub fn probe_key() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{PROBE_PREFIX}{}-{nanos}", std::process::id())
}

fn lost(r: &Result<Version, StoreError>) -> bool {
    matches!(r, Err(StoreError::Precondition(_)))
}

/// Runs the probe with `put` (the backend's own put, conditions passed through as they are) on `key`,
/// then deletes it with `delete`. Errors other than a failed precondition are returned as they are.
pub fn probe(
    key: &str,
    put: &dyn Fn(&str, Bytes, PutMode) -> Result<Version, StoreError>,
    delete: &dyn Fn(&str) -> Result<(), StoreError>,
) -> Result<Conditional, StoreError> {
    let data = || Bytes::from_static(b"strata conditional-write probe\n");
    let found = probe_steps(key, put, data)?;
    delete(key)?;
    Ok(found)
}

fn probe_steps(
    key: &str,
    put: &dyn Fn(&str, Bytes, PutMode) -> Result<Version, StoreError>,
    data: impl Fn() -> Bytes,
) -> Result<Conditional, StoreError> {
    let v1 = put(key, data(), PutMode::Create)?;
    let again = put(key, data(), PutMode::Create);
    if !lost(&again) {
        return again.map(|_| Conditional::Missing(NO_CREATE_ONLY));
    }
    let made_up = Version {
        e_tag: Some("\"00000000000000000000000000000000\"".into()),
        version: None,
    };
    let wrong = put(key, data(), PutMode::IfMatch(made_up));
    if !lost(&wrong) {
        return wrong.map(|_| Conditional::Missing(NO_IF_MATCH));
    }
    let right = put(key, data(), PutMode::IfMatch(v1.clone()));
    if !lost(&right) {
        return right.map(|_| Conditional::Standard);
    }
    let bare_right = put(key, data(), PutMode::IfMatch(bare(&v1)));
    if !lost(&bare_right) {
        return bare_right.map(|_| Conditional::BareETags);
    }
    Ok(Conditional::Missing(NO_MATCHING_ETAG))
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::Mutex;

    use super::*;

    /// A server model: `honours_create`, `honours_match`, `bare` (compares bare ETags only).
    struct Model {
        objects: Mutex<HashMap<String, u64>>,
        honours_create: bool,
        honours_match: bool,
        bare: bool,
    }

    impl Model {
        fn put(&self, key: &str, mode: PutMode) -> Result<Version, StoreError> {
            let mut o = self.objects.lock().expect("lock");
            let cur = o.get(key).copied();
            let etag = |n: u64| format!("\"{n}\"");
            let ok = match mode {
                PutMode::Overwrite => true,
                PutMode::Create => !self.honours_create || cur.is_none(),
                PutMode::IfMatch(v) => {
                    let want = cur.map(|n| match self.bare {
                        true => n.to_string(),
                        false => etag(n),
                    });
                    !self.honours_match || (cur.is_some() && v.e_tag == want)
                }
            };
            if !ok {
                return Err(StoreError::Precondition(key.into()));
            }
            let n = cur.unwrap_or(0) + 1;
            o.insert(key.into(), n);
            Ok(Version {
                e_tag: Some(etag(n)),
                version: None,
            })
        }
    }

    fn run(honours_create: bool, honours_match: bool, bare: bool) -> Conditional {
        let m = Model {
            objects: Mutex::new(HashMap::new()),
            honours_create,
            honours_match,
            bare,
        };
        let put = |k: &str, _d: Bytes, mode: PutMode| m.put(k, mode);
        let delete = |k: &str| {
            m.objects.lock().expect("lock").remove(k);
            Ok(())
        };
        let found = probe("p", &put, &delete).expect("probe");
        assert!(m.objects.lock().expect("lock").is_empty(), "probe left");
        found
    }

    #[test]
    fn the_probe_tells_servers_apart() {
        assert_eq!(run(true, true, false), Conditional::Standard);
        assert_eq!(run(true, true, true), Conditional::BareETags);
        assert_eq!(
            run(false, true, false),
            Conditional::Missing(NO_CREATE_ONLY)
        );
        assert_eq!(run(true, false, false), Conditional::Missing(NO_IF_MATCH));
        assert_eq!(
            run(false, false, false),
            Conditional::Missing(NO_CREATE_ONLY)
        );
    }

    #[test]
    fn bare_drops_quotes_and_weakness() {
        let v = |e: &str| Version {
            e_tag: Some(e.into()),
            version: None,
        };
        assert_eq!(bare(&v("\"abc\"")), v("abc"));
        assert_eq!(bare(&v("W/\"abc\"")), v("abc"));
        assert_eq!(bare(&v("abc")), v("abc"));
    }
}

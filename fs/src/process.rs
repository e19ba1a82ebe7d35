//! The process an image's config starts in a sandbox: arguments, environment, working directory and
//! the user as numbers.
//!
//! A runtime needs numeric ids, and an image's `user` may be a name: it is resolved as container runtimes
//! do, in the image's own `/etc/passwd` and `/etc/group` (never the host's), the group by default the
//! user's primary group (0 when the user has no entry). A name the image does not define is an error: it
//! never silently becomes root. A symlinked `/etc` or `/etc/passwd` (which could lead out of the image)
//! reads as empty.

use std::path::Path;

use strata_registry::model::ImageConfig;

/// Why the image's user could not be resolved.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error("the image's user {0:?} is not in its /etc/passwd")]
    NoUser(String),
    #[error("the image's group {0:?} is not in its /etc/group")]
    NoGroup(String),
}

pub use strata_api::{Process, User};

/// The process of `cfg` in the image whose root is `rootfs`.
pub fn image_process(rootfs: &Path, cfg: &ImageConfig) -> Result<Process, ProcessError> {
    let (uid, gid) = resolve_user(rootfs, cfg.user.as_deref())?;
    Ok(Process {
        args: cfg.args(),
        env: cfg.process_env(),
        cwd: cfg.cwd(),
        user: User { uid, gid },
    })
}

/// Reads `rootfs/etc/NAME` as the image has it: a symlink there or a missing file reads as empty.
fn image_etc(rootfs: &Path, name: &str) -> String {
    let dir = rootfs.join("etc");
    let file = dir.join(name);
    let plain = |p: &Path| std::fs::symlink_metadata(p).is_ok_and(|m| !m.file_type().is_symlink());
    if !plain(&dir) || !plain(&file) {
        return String::new();
    }
    std::fs::read_to_string(file).unwrap_or_default()
}

/// The id of `name` in a passwd or group file (`name:x:id:...`), or the number `name` is.
fn lookup_id(db: &str, name: &str) -> Option<(u32, Vec<String>)> {
    db.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        (f.len() >= 3 && (f[0] == name || f[2] == name))
            .then(|| {
                Some((
                    f[2].parse().ok()?,
                    f.iter().map(|s| s.to_string()).collect(),
                ))
            })
            .flatten()
    })
}

/// The uid and gid of an image's `user` (`""`, `uid`, `uid:gid`, `name`, `name:group`, ...).
pub fn resolve_user(rootfs: &Path, user: Option<&str>) -> Result<(u32, u32), ProcessError> {
    let Some(user) = user.filter(|u| !u.is_empty()) else {
        return Ok((0, 0));
    };
    let (name, group) = match user.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (user, None),
    };
    let passwd = image_etc(rootfs, "passwd");
    let entry = lookup_id(&passwd, name);
    let uid = match (name.parse::<u32>(), &entry) {
        (Ok(n), _) => n,
        (Err(_), Some((n, _))) => *n,
        (Err(_), None) => return Err(ProcessError::NoUser(name.to_string())),
    };
    let gid = match group {
        Some(g) => match g.parse::<u32>() {
            Ok(n) => n,
            Err(_) => lookup_id(&image_etc(rootfs, "group"), g)
                .map(|(n, _)| n)
                .ok_or_else(|| ProcessError::NoGroup(g.to_string()))?,
        },
        None => entry
            .and_then(|(_, f)| f.get(3).and_then(|g| g.parse().ok()))
            .unwrap_or(0),
    };
    Ok((uid, gid))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn users_resolve_in_the_image() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        assert_eq!(resolve_user(root, None).unwrap(), (0, 0));
        assert_eq!(resolve_user(root, Some("1000")).unwrap(), (1000, 0));
        assert_eq!(resolve_user(root, Some("1000:50")).unwrap(), (1000, 50));
        assert!(resolve_user(root, Some("www-data")).is_err());
        std::fs::create_dir(root.join("etc")).unwrap();
        std::fs::write(
            root.join("etc/passwd"),
            "root:x:0:0:root:/root:/bin/sh\nwww-data:x:33:34::/var/www:/bin/false\n",
        )
        .unwrap();
        std::fs::write(root.join("etc/group"), "root:x:0:\nstaff:x:50:\n").unwrap();
        assert_eq!(resolve_user(root, Some("www-data")).unwrap(), (33, 34));
        assert_eq!(resolve_user(root, Some("33")).unwrap(), (33, 34));
        assert_eq!(
            resolve_user(root, Some("www-data:staff")).unwrap(),
            (33, 50)
        );
        assert!(resolve_user(root, Some("www-data:nogroup")).is_err());
        // A symlinked passwd (it could point out of the image) is not read.
        std::fs::remove_file(root.join("etc/passwd")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", root.join("etc/passwd")).unwrap();
        assert!(resolve_user(root, Some("root")).is_err());
        let p = image_process(root, &ImageConfig::default()).unwrap();
        assert_eq!(p.args, vec!["/bin/sh".to_string()]);
        assert_eq!((p.cwd.as_str(), p.user), ("/", User { uid: 0, gid: 0 }));
    }
}

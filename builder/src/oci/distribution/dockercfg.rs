//! Auth files: where `docker login`, `skopeo login` and `strata login` keep registry credentials.
//!
//! An auth file is JSON: `{"auths": {"HOST[:PORT]": {"auth": base64(user:password)}}, "credsStore":
//! NAME, "credHelpers": {"HOST": NAME}}`; keys of `auths` may carry a scheme and a path
//! (`https://index.docker.io/v1/`). [`lookup`] reads an entry: an `auths` entry with an `auth` wins;
//! else the helper `credHelpers` names for the host, else `credsStore`, is run as docker runs it —
//! `docker-credential-NAME get` with the server on standard input, answering `{"Username": …,
//! "Secret": …}` — and a helper that is not installed or fails is an error naming it (a helper that
//! says it has no credentials for the host is not: the lookup goes on).
//!
//! [`login`] and [`logout`] edit the docker config file (`$DOCKER_CONFIG/config.json`, else
//! `~/.docker/config.json`): only the one `auths` entry changes, every other key of the file is kept,
//! and the file is rewritten atomically with mode 0600 (it holds secrets).

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::auth::{Credentials, Found};
use crate::oci::OciError;

/// The auth files looked up, first found wins.
pub fn auth_files() -> Vec<PathBuf> {
    let var = |k: &str| std::env::var_os(k).map(PathBuf::from);
    let mut out = Vec::new();
    out.extend(var("REGISTRY_AUTH_FILE"));
    out.extend(var("XDG_RUNTIME_DIR").map(|d| d.join("containers/auth.json")));
    out.extend(docker_config());
    out
}

/// The docker config file: `$DOCKER_CONFIG/config.json`, else `~/.docker/config.json`.
pub fn docker_config() -> Option<PathBuf> {
    match std::env::var_os("DOCKER_CONFIG") {
        Some(d) => Some(PathBuf::from(d).join("config.json")),
        None => std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".docker/config.json")),
    }
}

/// The host of an `auths` key: `https://host:port/v1/` → `host:port`.
fn key_host(k: &str) -> &str {
    k.trim_start_matches("https://")
        .trim_start_matches("http://")
        .split('/')
        .next()
        .unwrap_or_default()
}

/// The server name a credential helper is asked about (Docker Hub's is its v1 URL, as docker uses).
fn helper_server(registry: &str) -> String {
    match registry {
        "docker.io" | "index.docker.io" | "registry-1.docker.io" => {
            "https://index.docker.io/v1/".into()
        }
        r => r.to_string(),
    }
}

fn auth_error(registry: &str, why: String) -> OciError {
    OciError::Auth {
        registry: registry.to_string(),
        why,
    }
}

/// The credentials `file` holds for `registry`; `None` when the file is missing or unreadable JSON
/// or has nothing for the registry.
pub fn lookup(file: &Path, registry: &str) -> Result<Option<Found>, OciError> {
    let Ok(bytes) = std::fs::read(file) else {
        return Ok(None);
    };
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(&bytes) else {
        return Ok(None);
    };
    let entry = v["auths"].as_object().and_then(|a| {
        a.iter()
            .filter(|(k, _)| key_host(k) == registry)
            .find_map(|(_, e)| e["auth"].as_str().filter(|a| !a.is_empty()))
    });
    if let Some(a) = entry {
        return Ok(Some(Found {
            credentials: Credentials::Encoded(a.to_string()),
            from: format!("the auths entry for {registry} in {}", file.display()),
        }));
    }
    let helper = v["credHelpers"][registry]
        .as_str()
        .or_else(|| v["credsStore"].as_str())
        .filter(|h| !h.is_empty());
    match helper {
        Some(h) => run_helper(h, file, registry),
        None => Ok(None),
    }
}

/// Asks `docker-credential-NAME get` for the registry's credentials.
fn run_helper(name: &str, file: &Path, registry: &str) -> Result<Option<Found>, OciError> {
    let program = format!("docker-credential-{name}");
    let from = format!("{program} (named in {})", file.display());
    let child = Command::new(&program)
        .arg("get")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => {
            return Err(auth_error(
                registry,
                format!(
                "{} keeps registry credentials in the credential helper {program}, which cannot \
                     be run ({e}); install it, or give credentials with `strata login {registry}`, \
                     --creds or STRATA_REGISTRY_USER/STRATA_REGISTRY_PASSWORD",
                file.display()
            ),
            ))
        }
    };
    if let Some(mut stdin) = child.stdin.take() {
        // A helper that exits without reading closes the pipe: its answer says why.
        let _ = stdin.write_all(helper_server(registry).as_bytes());
    }
    let out = child
        .wait_with_output()
        .map_err(|e| auth_error(registry, format!("{from}: {e}")))?;
    let said = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if !out.status.success() {
        // The protocol's answer for a server it has nothing for.
        if said.contains("credentials not found") {
            return Ok(None);
        }
        let err = String::from_utf8_lossy(&out.stderr).trim().to_string();
        return Err(auth_error(
            registry,
            format!("{from} failed ({}): {said} {err}", out.status),
        ));
    }
    #[derive(serde::Deserialize)]
    struct Answer {
        #[serde(rename = "Username", default)]
        user: String,
        #[serde(rename = "Secret", default)]
        secret: String,
    }
    let a: Answer = serde_json::from_str(&said)
        .map_err(|e| auth_error(registry, format!("{from}: unreadable answer: {e}")))?;
    Ok(Some(Found {
        credentials: Credentials::Password {
            user: a.user,
            password: a.secret,
        },
        from,
    }))
}

/// Reads the docker config as JSON (an empty object when there is none yet).
fn read_config(path: &Path) -> Result<serde_json::Value, OciError> {
    match std::fs::read(path) {
        Ok(b) => serde_json::from_slice(&b).map_err(|e| {
            OciError::Malformed(format!("{}: not a docker config file: {e}", path.display()))
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(serde_json::json!({})),
        Err(e) => Err(OciError::io(path.display(), e)),
    }
}

/// Writes the docker config atomically, mode 0600 (its directory created 0700 if missing).
fn write_config(path: &Path, v: &serde_json::Value) -> Result<(), OciError> {
    let io = |e| OciError::io(path.display(), e);
    if let Some(dir) = path.parent() {
        if !dir.exists() {
            std::fs::create_dir_all(dir).map_err(io)?;
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(io)?;
        }
    }
    let mut text = serde_json::to_vec_pretty(v).unwrap_or_default();
    text.push(b'\n');
    let how = strata_registry::fsutil::Atomic {
        mode: 0o600,
        sync: true,
    };
    strata_registry::fsutil::write_atomic(path, &text, how).map_err(io)
}

fn config_path() -> Result<PathBuf, OciError> {
    docker_config()
        .ok_or_else(|| OciError::Usage("no docker config file: set DOCKER_CONFIG or HOME".into()))
}

/// Stores `user`/`password` for `registry` in the docker config file; returns its path.
pub fn login(registry: &str, user: &str, password: &str) -> Result<PathBuf, OciError> {
    use base64::Engine as _;
    let path = config_path()?;
    let mut v = read_config(&path)?;
    if !v.is_object() {
        return Err(OciError::Malformed(format!(
            "{}: not a JSON object",
            path.display()
        )));
    }
    if !v["auths"].is_object() {
        v["auths"] = serde_json::json!({});
    }
    let auth = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
    if let Some(a) = v["auths"].as_object_mut() {
        // An older entry under another spelling of the same host would shadow nothing, but confuse.
        a.retain(|k, _| key_host(k) != registry);
        a.insert(registry.to_string(), serde_json::json!({ "auth": auth }));
    }
    write_config(&path, &v)?;
    Ok(path)
}

/// Removes `registry`'s entries from the docker config file; returns its path and whether there was one.
pub fn logout(registry: &str) -> Result<(PathBuf, bool), OciError> {
    let path = config_path()?;
    let mut v = read_config(&path)?;
    let Some(a) = v["auths"].as_object_mut() else {
        return Ok((path, false));
    };
    let before = a.len();
    a.retain(|k, _| key_host(k) != registry);
    if a.len() == before {
        return Ok((path, false));
    }
    write_config(&path, &v)?;
    Ok((path, true))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_match_the_registry_and_helpers_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("auth.json");
        std::fs::write(
            &f,
            br#"{"auths":{"https://reg.example:5000/v1/":{"auth":"dTpw"},"other":{"auth":"eDp5"}}}"#,
        )
        .unwrap();
        let found = lookup(&f, "reg.example:5000").unwrap().unwrap();
        assert!(matches!(found.credentials, Credentials::Encoded(a) if a == "dTpw"));
        assert!(lookup(&f, "reg.example").unwrap().is_none());
        std::fs::write(&f, b"not json").unwrap();
        assert!(lookup(&f, "other").unwrap().is_none());
        std::fs::write(&f, br#"{"credsStore":"strata-test-absent"}"#).unwrap();
        let e = lookup(&f, "reg.example").unwrap_err().to_string();
        assert!(
            e.contains("docker-credential-strata-test-absent") && e.contains("strata login"),
            "{e}"
        );
    }
}

//! Registry access shared by the commands that reach one — `import`/`pull` and `export`/`push` with a
//! `docker://` reference — and `strata login` / `strata logout`.
//!
//! [`RegistryArgs`] are the flags every registry command takes (scheme, credentials, timeouts), turned
//! into the distribution client's options in one place. Credentials not given on the command line are
//! looked up by the client itself ([`strata_builder::oci::distribution::auth`]): the environment, then
//! auth files, the docker config file among them.
//!
//! `strata login HOST` checks the credentials against the registry (its `/v2/` ping, answering the
//! registry's challenge — Basic, or a token fetched without a repository scope, as `docker login`
//! does) and only then stores them in the docker config file
//! ([`strata_builder::oci::distribution::dockercfg`]); `strata logout HOST` removes the entry.

use std::io::Read;

use anyhow::Result;
use strata_builder::oci::distribution::auth::{Credentials, Found};
use strata_builder::oci::distribution::client::Client;
use strata_builder::oci::distribution::{dockercfg, PullOptions, Reference, RegistryRef};

use crate::exit::Usage;

/// Flags of the commands that reach a registry.
#[derive(clap::Args, Clone, Debug)]
pub struct RegistryArgs {
    /// docker://: plain HTTP for any registry (loopback registries may use it anyway).
    #[arg(long)]
    pub plain_http: bool,
    /// docker://: USER:PASSWORD for the registry (else STRATA_REGISTRY_USER/STRATA_REGISTRY_PASSWORD,
    /// then the registry's entry in an auth file: REGISTRY_AUTH_FILE, containers/auth.json,
    /// $DOCKER_CONFIG/config.json or ~/.docker/config.json — as `strata login` writes it, or the
    /// credential helper it names).
    #[arg(long, env = "STRATA_REGISTRY_CREDS", hide_env_values = true)]
    pub creds: Option<String>,
    /// docker://: seconds one registry request may take, its whole body included (a layer blob).
    #[arg(long, env = "STRATA_REGISTRY_TIMEOUT", value_name = "SECS", default_value = "3600", value_parser = crate::cli::parse_secs)]
    pub registry_timeout: std::time::Duration,
    /// docker://: seconds a registry request may wait for its next bytes.
    #[arg(long, env = "STRATA_REGISTRY_STALL_TIMEOUT", value_name = "SECS", default_value = "60", value_parser = crate::cli::parse_secs)]
    pub registry_stall_timeout: std::time::Duration,
}

impl RegistryArgs {
    /// The distribution client's options.
    pub fn options(&self) -> Result<PullOptions, Usage> {
        let credentials = match &self.creds {
            Some(c) => Some(Found {
                credentials: Credentials::parse(c)
                    .ok_or_else(|| Usage("--creds: expected USER:PASSWORD".into()))?,
                from: "--creds (or STRATA_REGISTRY_CREDS)".into(),
            }),
            None => None,
        };
        Ok(PullOptions {
            plain_http: self.plain_http,
            credentials,
            push: false,
            timeout: self.registry_timeout,
            stall_timeout: self.registry_stall_timeout,
        })
    }
}

/// Arguments of `strata login`.
#[derive(clap::Args)]
pub struct LoginArgs {
    /// The registry: HOST[:PORT].
    pub registry: String,
    /// User name.
    #[arg(short = 'u', long = "username")]
    pub user: String,
    /// The password (visible to other users in the process list: prefer --password-stdin).
    #[arg(short = 'p', long, conflicts_with = "password_stdin")]
    pub password: Option<String>,
    /// Read the password from standard input (one line).
    #[arg(long)]
    pub password_stdin: bool,
    /// Store the credentials without checking them against the registry.
    #[arg(long)]
    pub no_check: bool,
    #[command(flatten)]
    pub registry_args: RegistryArgs,
}

/// `HOST[:PORT]`, from what a user may type (`docker://HOST`, `https://HOST/`).
fn host(s: &str) -> Result<String, Usage> {
    let h = s
        .trim_start_matches("docker://")
        .trim_start_matches("https://")
        .trim_start_matches("http://")
        .trim_end_matches('/');
    // The reference parser checks the host; any repository name will do.
    RegistryRef::parse(&format!("{h}/x"))
        .map(|r| r.registry)
        .map_err(|_| Usage(format!("{s:?}: expected a registry HOST[:PORT]")))
}

/// `strata login`.
pub fn login(a: LoginArgs) -> Result<()> {
    let registry = host(&a.registry)?;
    let password = match (a.password, a.password_stdin) {
        (Some(p), _) => p,
        (None, true) => {
            let mut s = String::new();
            std::io::stdin()
                .read_to_string(&mut s)
                .map_err(|e| Usage(format!("reading the password from standard input: {e}")))?;
            s.trim_end_matches(['\n', '\r']).to_string()
        }
        (None, false) => return Err(Usage(
            "give the password with --password-stdin (echo \"$PASSWORD\" | strata login …) or -p"
                .into(),
        )
        .into()),
    };
    if password.is_empty() {
        return Err(Usage("the password is empty".into()).into());
    }
    if !a.no_check {
        let mut opts = a.registry_args.options()?;
        opts.credentials = Some(Found {
            credentials: Credentials::Password {
                user: a.user.clone(),
                password: password.clone(),
            },
            from: "the user and password given to strata login".into(),
        });
        let r = RegistryRef {
            registry: registry.clone(),
            repository: String::new(),
            reference: Reference::Tag("latest".into()),
        };
        Client::connect(&r, &opts)?;
    }
    let path = dockercfg::login(&registry, &a.user, &password)?;
    eprintln!(
        "Login succeeded: credentials for {registry} stored in {}",
        path.display()
    );
    Ok(())
}

/// `strata logout`.
pub fn logout(registry: &str) -> Result<()> {
    let registry = host(registry)?;
    let (path, removed) = dockercfg::logout(&registry)?;
    match removed {
        true => eprintln!(
            "Removed the credentials for {registry} from {}",
            path.display()
        ),
        false => eprintln!(
            "Not logged in to {registry} (no entry in {})",
            path.display()
        ),
    }
    Ok(())
}

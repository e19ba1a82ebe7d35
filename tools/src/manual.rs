//! `strata completions SHELL` and `strata man [--dir DIR]`: shell completions and man pages made from
//! the same clap definitions the parsers use, so neither can drift from the commands they describe.
//!
//! `strata man` prints `strata(1)` on standard output; `--dir DIR` writes a page per command instead
//! (`strata.1`, `strata-build.1`, …, `strata-daemon-upgrade.1`) plus `stratad.8` and `pack_diff.1`, which
//! `scripts/install` puts under `/usr/local/share/man`.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::CommandFactory;

use crate::cli::{Cli, PackDiffCli};

/// `strata completions`.
#[derive(clap::Args)]
pub struct CompletionsArgs {
    /// The shell: bash, zsh, fish, elvish or powershell.
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

/// `strata man`.
#[derive(clap::Args)]
pub struct ManArgs {
    /// Write every page (strata and each subcommand, stratad, pack_diff) into DIR instead of printing
    /// strata(1).
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
}

/// Prints the completion script for `a.shell` on standard output.
pub fn completions(a: CompletionsArgs) -> Result<()> {
    let mut out = std::io::stdout().lock();
    clap_complete::generate(a.shell, &mut Cli::command(), "strata", &mut out);
    out.flush().context("writing completions")
}

/// Prints strata(1), or writes every page into `a.dir`.
pub fn man(a: ManArgs) -> Result<()> {
    match a.dir {
        None => {
            let mut out = std::io::stdout().lock();
            clap_mangen::Man::new(Cli::command())
                .render(&mut out)
                .context("writing strata(1)")?;
            out.flush().context("writing strata(1)")
        }
        Some(dir) => write_pages(&dir),
    }
}

/// Writes the pages of `strata` (one per subcommand too), `stratad` (section 8) and `pack_diff`.
fn write_pages(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    clap_mangen::generate_to(Cli::command(), dir)
        .with_context(|| format!("writing man pages into {}", dir.display()))?;
    clap_mangen::generate_to(PackDiffCli::command(), dir)
        .with_context(|| format!("writing man pages into {}", dir.display()))?;
    let stratad = crate::daemon::command();
    let path = dir.join("stratad.8");
    let mut page = Vec::new();
    clap_mangen::Man::new(stratad)
        .section("8")
        .render(&mut page)
        .context("rendering stratad(8)")?;
    std::fs::write(&path, page).with_context(|| format!("writing {}", path.display()))?;
    println!("{}", dir.display());
    Ok(())
}

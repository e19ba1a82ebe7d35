//! The docs match the code: every `strata`, `stratad` and `pack_diff` command line in README.md and
//! docs/*.md is checked against the clap definitions the binaries parse with, and every link stays in
//! the repository.
//!
//! - A command in a shell example (a line of a fenced block, or a `$ ` line) is split as the shell
//!   would (`shlex`), cut at `|`, `&&`, `;` and `#`, and must parse: `Cli::try_parse_from`.
//! - A synopsis in a docs table (`| \`strata build SRC [--tar] …\` |`) is not a command line, so its
//!   subcommand path must exist and each `--flag` it names must be one of that subcommand's (or a
//!   global) options.
//! - Every subcommand has a synopsis row in docs/CLI.md.
//! - A relative link resolves to a file inside the repository.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use clap::{CommandFactory, Parser};

use crate::cli::{Cli, PackDiffCli};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

/// README.md and every docs/*.md, with their text.
fn docs() -> Vec<(PathBuf, String)> {
    let root = repo();
    let mut paths = vec![root.join("README.md")];
    let mut more: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("docs/ exists")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    more.sort();
    paths.extend(more);
    paths
        .into_iter()
        .map(|p| {
            let text = std::fs::read_to_string(&p).expect("read doc");
            (p, text)
        })
        .collect()
}

/// The shell-example lines of a markdown text: fenced `sh`/`bash`/untyped blocks' lines and `$ ` lines.
fn shell_lines(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut fence: Option<bool> = None; // Some(true): a shell block.
    for (i, line) in text.lines().enumerate() {
        let t = line.trim_start();
        if let Some(lang) = t.strip_prefix("```") {
            fence = match fence {
                Some(_) => None,
                None => Some(matches!(
                    lang.trim(),
                    "" | "sh" | "bash" | "shell" | "console"
                )),
            };
            continue;
        }
        match fence {
            Some(true) => out.push((i + 1, t.trim_start_matches("$ ").to_string())),
            Some(false) => {}
            None => {
                if let Some(cmd) = t.strip_prefix("$ ") {
                    out.push((i + 1, cmd.to_string()));
                }
            }
        }
    }
    out
}

/// The invocations of `prog` in a shell line: `prog` where a command starts (the line's start, after
/// `|`, `&&`, `||`, `;`, `&`, `sudo` or `VAR=value`) up to the next such operator or comment, as argv.
/// A line the shell could not split (a quote continued on the next line) gives none.
fn invocations(line: &str, prog: &str) -> Vec<Vec<String>> {
    let line = match line.find(" #") {
        Some(i) => &line[..i],
        None => line,
    };
    let Some(words) = shlex::split(line) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let mut cur: Option<Vec<String>> = None;
    let mut at_start = true;
    for w in words {
        if matches!(w.as_str(), "|" | "&&" | "||" | ";" | "&") {
            out.extend(cur.take());
            at_start = true;
            continue;
        }
        match &mut cur {
            Some(v) => v.push(w),
            None if at_start && (w == prog || w.ends_with(&format!("/{prog}"))) => {
                cur = Some(vec![w])
            }
            None if at_start && (w == "sudo" || is_assignment(&w)) => {}
            None => at_start = false,
        }
    }
    out.extend(cur);
    out
}

fn is_assignment(w: &str) -> bool {
    w.split_once('=').is_some_and(|(k, _)| {
        !k.is_empty() && k.chars().all(|c| c.is_ascii_uppercase() || c == '_')
    })
}

/// A synopsis written in a code block (`[--flag X]`, `…`, `A|B`) rather than a command to run.
fn is_synopsis(argv: &[String]) -> bool {
    argv.iter()
        .any(|a| a.starts_with('[') || a.contains('…') || a.ends_with("...") || a.contains('|'))
}

/// Placeholders in examples (`<layer>`) stand for one argument.
fn fill(argv: &[String]) -> Vec<String> {
    argv.iter()
        .map(|a| match a.starts_with('<') && a.ends_with('>') {
            true => "blake3:0".to_string(),
            false => a.clone(),
        })
        .collect()
}

fn parses(prog: &str, argv: &[String]) -> Result<(), clap::Error> {
    let argv = fill(argv);
    let r = match prog {
        "strata" => Cli::try_parse_from(&argv).map(drop),
        "pack_diff" => PackDiffCli::try_parse_from(&argv).map(drop),
        _ => crate::daemon::command()
            .try_get_matches_from(&argv)
            .map(drop),
    };
    match r {
        Err(e)
            if !matches!(
                e.kind(),
                clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion
            ) =>
        {
            Err(e)
        }
        _ => Ok(()),
    }
}

/// The `--flags` of a synopsis that `prog` (at its subcommand) does not take.
fn unknown_flags(prog: &str, argv: &[String]) -> Result<(), String> {
    let cmd = match prog {
        "strata" => Cli::command(),
        "pack_diff" => PackDiffCli::command(),
        _ => crate::daemon::command(),
    };
    let words: Vec<String> = argv[1..]
        .iter()
        .take_while(|w| {
            w.chars().all(|c| c.is_ascii_lowercase() || c == '-') && !w.starts_with('-')
        })
        .cloned()
        .collect();
    let (_, longs) = find(&cmd, &words).ok_or("no such command")?;
    let bad: Vec<String> = flags_in(&argv.join(" "))
        .into_iter()
        .filter(|f| !longs.contains(f))
        .collect();
    match bad.is_empty() {
        true => Ok(()),
        false => Err(format!("no option {}", bad.join(", "))),
    }
}

/// The `--flag` words of a text.
fn flags_in(text: &str) -> Vec<String> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
        .filter(|w| w.starts_with("--") && w.len() > 2)
        .map(str::to_string)
        .collect()
}

#[test]
fn every_example_command_parses() {
    let mut failures = Vec::new();
    let mut checked = 0;
    for (path, text) in docs() {
        for (line_no, line) in shell_lines(&text) {
            for prog in ["strata", "stratad", "pack_diff"] {
                for argv in invocations(&line, prog) {
                    checked += 1;
                    let result = match is_synopsis(&argv) {
                        true => unknown_flags(prog, &argv),
                        false => parses(prog, &argv).map_err(|e| {
                            e.to_string().lines().next().unwrap_or_default().to_string()
                        }),
                    };
                    if let Err(e) = result {
                        failures.push(format!("{}:{line_no}: `{line}`: {e}", path.display()));
                    }
                }
            }
        }
    }
    assert!(checked > 30, "only {checked} example commands found");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// `strata SUB [SUB2] …` synopses in table rows: the command words and the `--flags`.
fn synopses(text: &str) -> Vec<(usize, Vec<String>, Vec<String>)> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let Some(rest) = line.strip_prefix("| `strata ") else {
            continue;
        };
        let Some(end) = rest.find('`') else { continue };
        let syn = &rest[..end];
        let path: Vec<String> = syn
            .split_whitespace()
            .take_while(|w| {
                w.chars().all(|c| c.is_ascii_lowercase() || c == '-') && !w.starts_with('-')
            })
            .map(str::to_string)
            .collect();
        let flags = flags_in(syn);
        out.push((i + 1, path, flags));
    }
    out
}

/// The subcommand at `path` under `cmd`, and the long flags it takes (its own and global ones).
fn find<'a>(
    cmd: &'a clap::Command,
    path: &[String],
) -> Option<(&'a clap::Command, BTreeSet<String>)> {
    let mut longs: BTreeSet<String> = cmd
        .get_arguments()
        .filter_map(|a| a.get_long().map(|l| format!("--{l}")))
        .collect();
    let mut cur = cmd;
    for word in path {
        match cur.find_subcommand(word) {
            Some(sub) => cur = sub,
            None => break,
        }
        longs.extend(
            cur.get_arguments()
                .filter_map(|a| a.get_long().map(|l| format!("--{l}"))),
        );
    }
    Some((cur, longs))
}

#[test]
fn every_synopsis_names_real_flags_and_every_command_has_one() {
    let cli = Cli::command();
    let mut failures = Vec::new();
    let mut documented = BTreeSet::new();
    for (path, text) in docs() {
        for (line_no, words, flags) in synopses(&text) {
            let Some((sub, longs)) = find(&cli, &words) else {
                continue;
            };
            if sub.get_name() == "strata" {
                failures.push(format!(
                    "{}:{line_no}: no command `strata {}`",
                    path.display(),
                    words.join(" ")
                ));
                continue;
            }
            for n in 1..=words.len() {
                documented.insert(words[..n].join(" "));
            }
            for f in flags.iter().filter(|f| !longs.contains(*f)) {
                failures.push(format!(
                    "{}:{line_no}: `strata {}` has no option {f}",
                    path.display(),
                    words.join(" ")
                ));
            }
        }
    }
    for sub in cli.get_subcommands().filter(|s| !s.is_hide_set()) {
        if !documented.contains(sub.get_name()) && sub.get_name() != "help" {
            failures.push(format!(
                "docs/CLI.md: no synopsis row for `strata {}`",
                sub.get_name()
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn every_link_stays_in_the_repository() {
    let root = repo().canonicalize().expect("repo root");
    let mut failures = Vec::new();
    for (path, text) in docs() {
        let dir = path.parent().unwrap_or(&root).to_path_buf();
        for (i, _) in text.match_indices("](") {
            let rest = &text[i + 2..];
            let Some(end) = rest.find(')') else { continue };
            let target = &rest[..end];
            if target.contains("://") || target.starts_with('#') || target.starts_with("mailto:") {
                continue;
            }
            let file = target.split('#').next().unwrap_or_default();
            match dir.join(file).canonicalize() {
                Ok(p) if p.starts_with(&root) => {}
                Ok(p) => failures.push(format!(
                    "{}: link {target} leaves the repository ({})",
                    path.display(),
                    p.display()
                )),
                Err(_) => {
                    failures.push(format!("{}: link {target} does not exist", path.display()))
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn every_stratad_option_says_what_it_does() {
    let cmd = crate::daemon::command();
    let bare: Vec<_> = cmd
        .get_arguments()
        .filter(|a| a.get_long().is_some() && a.get_help().is_none())
        .map(|a| a.get_id().to_string())
        .collect();
    assert!(bare.is_empty(), "stratad options without help: {bare:?}");
}

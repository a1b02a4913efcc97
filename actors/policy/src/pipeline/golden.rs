//! Golden-file runner for the pipeline tests (datadriven style, as in raft-rs).
//!
//! A file is a sequence of blocks: a command line, its input lines, a `----` line, the expected
//! output lines, then a blank line. Lines starting with `#` between blocks are comments. Run with
//! `UPDATE_GOLDEN=1` to rewrite the expected sections from what the code produces now (then read
//! the diff: the expected values must still be the ones reasoned about).

use std::fmt::Write as _;
use std::path::PathBuf;

struct Block {
    comments: Vec<String>,
    command: String,
    input: Vec<String>,
    expected: Vec<String>,
}

fn path_of(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("testdata").join("pipeline").join(name)
}

fn parse(text: &str) -> Vec<Block> {
    let mut blocks = Vec::new();
    let mut lines = text.lines().peekable();
    let mut comments = Vec::new();
    while let Some(line) = lines.next() {
        if line.trim().is_empty() {
            // Keep blank lines inside a comment run so a rewrite preserves the layout.
            if !comments.is_empty() {
                comments.push(String::new());
            }
            continue;
        }
        if line.starts_with('#') {
            comments.push(line.to_owned());
            continue;
        }
        let command = line.to_owned();
        let mut input = Vec::new();
        for l in lines.by_ref() {
            if l == "----" {
                break;
            }
            input.push(l.to_owned());
        }
        let mut expected = Vec::new();
        while let Some(l) = lines.peek() {
            if l.is_empty() {
                break;
            }
            expected.push((*l).to_owned());
            lines.next();
        }
        blocks.push(Block { comments: std::mem::take(&mut comments), command, input, expected });
    }
    blocks
}

/// Runs every block of `testdata/pipeline/<name>` through `run(command, input)` and compares.
pub(crate) fn run_golden(name: &str, mut run: impl FnMut(&str, &[String]) -> String) {
    let path = path_of(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let blocks = parse(&text);
    assert!(!blocks.is_empty(), "{name}: no blocks");
    let update = std::env::var_os("UPDATE_GOLDEN").is_some();
    let mut rewritten = String::new();
    let mut failures = Vec::new();
    for b in &blocks {
        let actual = run(&b.command, &b.input);
        let actual_lines: Vec<String> = actual.lines().map(str::to_owned).collect();
        if actual_lines != b.expected {
            failures.push(format!(
                "{name}: block `{}`\n--- expected\n{}\n--- actual\n{}",
                b.command,
                b.expected.join("\n"),
                actual_lines.join("\n")
            ));
        }
        for c in &b.comments {
            let _ = writeln!(rewritten, "{c}");
        }
        let _ = writeln!(rewritten, "{}", b.command);
        for l in &b.input {
            let _ = writeln!(rewritten, "{l}");
        }
        let _ = writeln!(rewritten, "----");
        for l in &actual_lines {
            let _ = writeln!(rewritten, "{l}");
        }
        let _ = writeln!(rewritten);
    }
    if update {
        std::fs::write(&path, rewritten).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        return;
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// `key=value` arguments of a line, after its first word.
pub(crate) fn args(line: &str) -> Vec<(String, String)> {
    line.split_whitespace()
        .skip(1)
        .filter_map(|kv| kv.split_once('=').map(|(k, v)| (k.to_owned(), v.to_owned())))
        .collect()
}

/// The value of `key` among `args`.
pub(crate) fn arg<'a>(args: &'a [(String, String)], key: &str) -> Option<&'a str> {
    args.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
}

/// Parses `12`, `3K`, `69M`, `2G` (decimal multiples).
pub(crate) fn bytes(s: &str) -> u64 {
    let (num, mult) = match s.as_bytes().last() {
        Some(b'K') => (&s[..s.len() - 1], 1_000),
        Some(b'M') => (&s[..s.len() - 1], 1_000_000),
        Some(b'G') => (&s[..s.len() - 1], 1_000_000_000),
        _ => (s, 1),
    };
    num.parse::<u64>().unwrap_or_else(|_| panic!("bad size {s}")) * mult
}

/// Parses `none` or a comma list of stage indices, `all` as `0..stages`.
pub(crate) fn stage_list(s: &str, stages: usize) -> Vec<usize> {
    match s {
        "none" | "" => Vec::new(),
        "all" => (0..stages).collect(),
        _ => s
            .split(',')
            .map(|x| x.trim_start_matches('s').parse().unwrap_or_else(|_| panic!("bad stage {x}")))
            .collect(),
    }
}

/// Parses `w3`.
pub(crate) fn worker(s: &str) -> super::WorkerId {
    super::WorkerId(s.trim_start_matches('w').parse().unwrap_or_else(|_| panic!("bad worker {s}")))
}

/// Parses `i2/s1`.
pub(crate) fn task(s: &str) -> super::TaskId {
    let (i, k) = s.split_once('/').unwrap_or_else(|| panic!("bad task {s}"));
    super::TaskId::new(
        i.trim_start_matches('i').parse().unwrap_or_else(|_| panic!("bad task {s}")),
        k.trim_start_matches('s').parse().unwrap_or_else(|_| panic!("bad task {s}")),
    )
}

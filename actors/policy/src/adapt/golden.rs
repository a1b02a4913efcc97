//! Datadriven golden files for the adaptation tests (raft-rs `datadriven` style).
//!
//! A file under `testdata/adapt/` is a list of blocks separated by blank lines. A block is
//! optional `#` comment lines, a command line `name key=value ...`, input lines, a `----` line
//! and the expected output. The test parses each block, runs it and compares the output line by
//! line; `UPDATE_GOLDEN=1 cargo test -p troupe-policy` rewrites the expected parts instead.

use std::collections::BTreeMap;
use std::path::PathBuf;

/// One parsed block.
pub(crate) struct Case {
    /// Command name.
    pub cmd: String,
    /// `key=value` arguments of the command line.
    pub args: BTreeMap<String, String>,
    /// Input lines between the command line and `----`.
    pub input: Vec<String>,
}

impl Case {
    /// A parsed argument, or `default` when absent.
    pub fn arg<T: std::str::FromStr>(&self, key: &str, default: T) -> T {
        self.args
            .get(key)
            .map(|v| v.parse().unwrap_or_else(|_| panic!("bad value {v:?} for {key}")))
            .unwrap_or(default)
    }
}

/// Splits `a=b` words into a map; bare words map to "".
pub(crate) fn kv(words: &[&str]) -> BTreeMap<String, String> {
    words
        .iter()
        .map(|w| match w.split_once('=') {
            Some((k, v)) => (k.to_string(), v.to_string()),
            None => (w.to_string(), String::new()),
        })
        .collect()
}

/// Runs every block of `testdata/adapt/<name>` through `run` and checks (or rewrites) outputs.
pub(crate) fn run(name: &str, mut run: impl FnMut(&Case) -> String) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("testdata/adapt").join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let update = std::env::var_os("UPDATE_GOLDEN").is_some();
    let mut rewritten = Vec::new();
    for block in text.split("\n\n").filter(|b| !b.trim().is_empty()) {
        let lines: Vec<&str> = block.lines().collect();
        let sep = lines
            .iter()
            .position(|l| *l == "----")
            .unwrap_or_else(|| panic!("{}: block without ----:\n{block}", path.display()));
        let head: Vec<&str> = lines[..sep].iter().copied().filter(|l| !l.starts_with('#')).collect();
        let words: Vec<&str> = head[0].split_whitespace().collect();
        let case = Case {
            cmd: words[0].to_string(),
            args: kv(&words[1..]),
            input: head[1..].iter().map(|s| s.to_string()).collect(),
        };
        let actual = run(&case);
        if update {
            rewritten.push(format!("{}\n----\n{}", lines[..sep].join("\n"), actual.trim_end()));
            continue;
        }
        let expected = &lines[sep + 1..];
        let got: Vec<&str> = actual.trim_end().lines().collect();
        for (i, (e, a)) in expected.iter().zip(&got).enumerate() {
            assert_eq!(e, a, "{}: block `{}`, output line {}", path.display(), head[0], i + 1);
        }
        assert_eq!(
            expected.len(),
            got.len(),
            "{}: block `{}` output length\n{actual}",
            path.display(),
            head[0]
        );
    }
    if update {
        std::fs::write(&path, rewritten.join("\n\n") + "\n").unwrap();
    }
}

//! Golden-file comparison for the adaptation tests: expected decisions live in
//! `testdata/adapt/*.txt`; `UPDATE_GOLDEN=1 cargo test -p troupe-policy` rewrites them.

use std::path::PathBuf;

/// Compares `actual` with `testdata/adapt/<name>` line by line (or rewrites it on request).
pub(crate) fn check(name: &str, actual: &str) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("testdata/adapt")
        .join(name);
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (run with UPDATE_GOLDEN=1)", path.display()));
    let (exp, act): (Vec<&str>, Vec<&str>) = (expected.lines().collect(), actual.lines().collect());
    for (i, (e, a)) in exp.iter().zip(&act).enumerate() {
        assert_eq!(e, a, "{} line {}", path.display(), i + 1);
    }
    assert_eq!(exp.len(), act.len(), "{} line count", path.display());
}

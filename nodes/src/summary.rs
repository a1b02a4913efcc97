//! The summary table a job prints at its end: what a person wants to know at a glance (counts,
//! throughput, latency percentiles, failures), as an aligned two-column table on stdout.
//!
//! It is printed after a job's result lines (which tests and scripts parse and which stay as
//! they are) and before the job's last line. Every table line starts with `|` or `+`, so no
//! table line can be mistaken for a result or progress line (`coe: ...`, `pipeline: ...`).

use std::fmt::Write as _;

/// A titled table of (figure, value) rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Summary {
    title: String,
    rows: Vec<(String, String)>,
}

impl Summary {
    /// An empty table titled `title` (e.g. `coe job summary`).
    pub fn new(title: impl Into<String>) -> Self {
        Self { title: title.into(), rows: Vec::new() }
    }

    /// Adds a row.
    pub fn row(mut self, figure: impl Into<String>, value: impl Into<String>) -> Self {
        self.rows.push((figure.into(), value.into()));
        self
    }

    /// Adds a row when `value` is given.
    pub fn row_if(self, figure: impl Into<String>, value: Option<String>) -> Self {
        match value {
            Some(v) => self.row(figure, v),
            None => self,
        }
    }

    /// The table as text, one `\n`-ended line each:
    ///
    /// ```text
    /// +-------------------+------------+
    /// | coe job summary                |
    /// +-------------------+------------+
    /// | requests answered | 300 of 300 |
    /// +-------------------+------------+
    /// ```
    pub fn render(&self) -> String {
        let key = self.rows.iter().map(|(k, _)| k.chars().count()).max().unwrap_or(0);
        let value = self.rows.iter().map(|(_, v)| v.chars().count()).max().unwrap_or(0);
        // the title spans both columns (and widens the value column if it must)
        let title = self.title.chars().count();
        let value = value.max(title.saturating_sub(key + 3));
        let rule = format!("+-{}-+-{}-+\n", "-".repeat(key), "-".repeat(value));
        let mut out = rule.clone();
        let _ = writeln!(out, "| {:<width$} |", self.title, width = key + 3 + value);
        out.push_str(&rule);
        for (k, v) in &self.rows {
            let _ = writeln!(out, "| {k:<key$} | {v:<value$} |");
        }
        out.push_str(&rule);
        out
    }

    /// Prints the table on stdout (above any progress bars).
    pub fn print(&self) {
        crate::progress::suspend(|| print!("{}", self.render()));
    }
}

/// `12.3 ms`, or `-` when nothing was measured (NaN).
pub fn ms(v: f64) -> String {
    if v.is_finite() { format!("{v:.1} ms") } else { "-".into() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_aligned_under_a_title_spanning_both_columns() {
        let t = Summary::new("coe job summary").row("requests answered", "300 of 300").row("p99", ms(81.34));
        let text = t.render();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 6, "{text}");
        let width = lines[0].chars().count();
        assert!(lines.iter().all(|l| l.chars().count() == width), "every line as wide:\n{text}");
        assert!(lines.iter().all(|l| l.starts_with('|') || l.starts_with('+')), "{text}");
        assert_eq!(lines[1], "| coe job summary                |");
        assert_eq!(lines[3], "| requests answered | 300 of 300 |");
        assert_eq!(lines[4], "| p99               | 81.3 ms    |");
    }

    #[test]
    fn a_long_title_widens_the_table_and_nan_shows_as_a_dash() {
        let text =
            Summary::new("a rather long summary title").row("n", "1").row("p50", ms(f64::NAN)).render();
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines.iter().all(|l| l.chars().count() == lines[0].chars().count()), "{text}");
        assert!(lines[1].contains("a rather long summary title"), "{text}");
        assert!(text.contains("| p50 | -"), "{text}");
    }
}

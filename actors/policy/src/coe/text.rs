//! Shared helpers for the line-based `key value` text formats (profiles and traces).
//!
//! Both formats are untrusted input: every line is length-capped, every number is range-checked,
//! and every error names the line and the field it is about.

use std::fmt;
use std::str::FromStr;

/// Longest accepted line, in bytes (after which parsing stops with an error).
pub const MAX_LINE_BYTES: usize = 4096;

/// A problem at one place in a text file: which line (1-based), which field, what is wrong.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct ParseError {
    /// 1-based line number (0 when the problem is about the file as a whole).
    pub line: usize,
    /// The field (key or token) the problem is about.
    pub field: String,
    /// What is wrong, in words.
    pub problem: String,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line == 0 {
            write!(f, "field `{}`: {}", self.field, self.problem)
        } else {
            write!(f, "line {}, field `{}`: {}", self.line, self.field, self.problem)
        }
    }
}

impl ParseError {
    /// A new error at `line` about `field`.
    pub fn new(line: usize, field: impl Into<String>, problem: impl Into<String>) -> Self {
        ParseError { line, field: field.into(), problem: problem.into() }
    }
}

/// One meaningful line: its 1-based number and its whitespace-separated tokens.
#[derive(Debug)]
pub(crate) struct Line<'a> {
    pub(crate) number: usize,
    pub(crate) tokens: Vec<&'a str>,
}

impl<'a> Line<'a> {
    /// The first token (the line's key).
    pub(crate) fn key(&self) -> &'a str {
        self.tokens.first().copied().unwrap_or("")
    }

    /// Token `i`, or an error naming `field` when the line is too short.
    pub(crate) fn token(&self, i: usize, field: &str) -> Result<&'a str, ParseError> {
        self.tokens.get(i).copied().ok_or_else(|| ParseError::new(self.number, field, "missing value"))
    }

    /// Error unless the line has exactly `n` tokens.
    pub(crate) fn expect_len(&self, n: usize) -> Result<(), ParseError> {
        if self.tokens.len() == n {
            Ok(())
        } else {
            Err(ParseError::new(
                self.number,
                self.key(),
                format!("expected {} tokens, found {}", n, self.tokens.len()),
            ))
        }
    }

    /// Error unless token `i` equals the literal `word`.
    pub(crate) fn expect_word(&self, i: usize, word: &str) -> Result<(), ParseError> {
        let got = self.token(i, word)?;
        if got == word {
            Ok(())
        } else {
            Err(ParseError::new(self.number, word, format!("expected `{word}`, found `{got}`")))
        }
    }

    /// Parse token `i` as a number within `lo..=hi`.
    pub(crate) fn number<T>(&self, i: usize, field: &str, lo: T, hi: T) -> Result<T, ParseError>
    where
        T: FromStr + PartialOrd + fmt::Display + Copy,
    {
        parse_number(self.token(i, field)?, self.number, field, lo, hi)
    }
}

/// Parse `token` as a number within `lo..=hi`, naming `line` and `field` on failure.
pub(crate) fn parse_number<T>(token: &str, line: usize, field: &str, lo: T, hi: T) -> Result<T, ParseError>
where
    T: FromStr + PartialOrd + fmt::Display + Copy,
{
    let value: T = token
        .parse()
        .map_err(|_| ParseError::new(line, field, format!("`{token}` is not a valid number")))?;
    // `!(lo <= v && v <= hi)` also rejects NaN for floats.
    if !(lo <= value && value <= hi) {
        return Err(ParseError::new(
            line,
            field,
            format!("{value} is outside the allowed range {lo}..={hi}"),
        ));
    }
    Ok(value)
}

/// Split `text` into meaningful lines (blank lines and `#` comments skipped), enforcing the
/// line-length cap and a cap on the number of lines.
pub(crate) fn lines(text: &str, max_lines: usize) -> Result<Vec<Line<'_>>, ParseError> {
    let mut out = Vec::new();
    for (index, raw) in text.lines().enumerate() {
        let number = index + 1;
        if raw.len() > MAX_LINE_BYTES {
            return Err(ParseError::new(
                number,
                "line",
                format!("line is {} bytes, more than the cap of {MAX_LINE_BYTES}", raw.len()),
            ));
        }
        let trimmed = raw.trim();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        if out.len() >= max_lines {
            return Err(ParseError::new(
                number,
                "line",
                format!("more than {max_lines} lines; the file is too large"),
            ));
        }
        out.push(Line { number, tokens: trimmed.split_whitespace().collect() });
    }
    Ok(out)
}

/// Error unless `text` is at most `cap` bytes (checked before anything is parsed).
pub(crate) fn check_size(text: &str, cap: usize) -> Result<(), ParseError> {
    if text.len() > cap {
        Err(ParseError::new(0, "file", format!("{} bytes is more than the cap of {cap} bytes", text.len())))
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_skip_comments_and_cap_length() {
        let text = "# c\n\n a b \nc\n";
        let got = lines(text, 10).unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].number, 3);
        assert_eq!(got[0].tokens, vec!["a", "b"]);
        let long = "x".repeat(MAX_LINE_BYTES + 1);
        let err = lines(&long, 10).unwrap_err();
        assert_eq!(err.line, 1);
        assert!(lines("a\nb\nc\n", 2).is_err());
    }

    #[test]
    fn numbers_are_range_checked() {
        assert_eq!(parse_number::<u64>("5", 1, "f", 1, 9).unwrap(), 5);
        let err = parse_number::<u64>("10", 4, "size", 1, 9).unwrap_err();
        assert_eq!(err.to_string(), "line 4, field `size`: 10 is outside the allowed range 1..=9");
        assert!(parse_number::<f64>("NaN", 1, "p", 0.0, 1.0).is_err());
        assert!(parse_number::<u64>("-1", 1, "n", 0, 9).is_err());
    }
}

//! Progress bars, made the same way everywhere (indicatif): drawn on stderr, and only when
//! stderr is a terminal and `TROUPE_PROGRESS` is not `0` (or `off`, `false`, `no`).
//!
//! Why these rules: what scripts and tests read is on stdout, and logs are files or pipes, so a
//! bar must never land in either. A hidden bar costs nothing and prints nothing, so callers
//! make bars unconditionally; piped, `--json` and `troupe up`'s node processes (whose stderr is
//! a pipe) get none. Lines printed while bars are shown go through [`println()`] (stdout) and the
//! log writer [`log_writer`] (stderr), which lift the bars off the terminal for the line, so
//! bars never garble output. The job progress lines other code parses (`coe: completed K of N`,
//! `pipeline: K of N inputs answered`) are printed as before: a bar is an addition, never a
//! replacement.

use std::io::{IsTerminal, Write};
use std::sync::OnceLock;
use std::time::Duration;

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressFinish, ProgressStyle};

/// The environment variable that turns bars off: `TROUPE_PROGRESS=0`.
pub const ENV: &str = "TROUPE_PROGRESS";

/// Whether bars are drawn, given the value of [`ENV`] and whether stderr is a terminal: never
/// when stderr is not one, and never when the variable says `0`, `off`, `false` or `no`.
pub fn wanted(env: Option<&str>, stderr_is_terminal: bool) -> bool {
    let off =
        env.is_some_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "0" | "off" | "false" | "no"));
    stderr_is_terminal && !off
}

/// Whether this process draws bars (decided once, from [`wanted`]).
pub fn enabled() -> bool {
    static ENABLED: OnceLock<bool> = OnceLock::new();
    *ENABLED.get_or_init(|| {
        let env = std::env::var(ENV).ok();
        wanted(env.as_deref(), std::io::stderr().is_terminal())
    })
}

/// Every bar of the process, drawn together below the output.
fn multi() -> &'static MultiProgress {
    static MULTI: OnceLock<MultiProgress> = OnceLock::new();
    MULTI.get_or_init(|| {
        MultiProgress::with_draw_target(if enabled() {
            ProgressDrawTarget::stderr_with_hz(10)
        } else {
            ProgressDrawTarget::hidden()
        })
    })
}

/// A bar of `total` steps labelled `label` (e.g. `coe requests`), or a hidden one when bars
/// are off. Finish it with `finish_and_clear` (or drop it) once the work is done.
pub fn bar(total: u64, label: &str) -> ProgressBar {
    add(enabled(), ProgressBar::new(total), label, BAR)
}

const BAR: &str = "{prefix:>18} [{bar:32}] {pos}/{len} {msg} ({elapsed}, eta {eta})";
const SPINNER: &str = "{prefix:>18} {spinner} {msg} ({elapsed})";

/// A spinner for work whose size is not known yet ([`set_total`] turns it into a bar).
pub fn spinner(label: &str) -> ProgressBar {
    add(enabled(), ProgressBar::new_spinner(), label, SPINNER)
}

/// Gives a spinner (or a bar) its size: from now on it draws as a [`bar`] of `total` steps.
pub fn set_total(bar: &ProgressBar, total: u64) {
    if bar.length() != Some(total) {
        bar.set_length(total);
        bar.set_style(style(BAR));
    }
}

fn style(template: &str) -> ProgressStyle {
    ProgressStyle::with_template(template)
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ")
}

/// `bar` styled and shown with the others when `on`, else a hidden bar.
fn add(on: bool, bar: ProgressBar, label: &str, template: &str) -> ProgressBar {
    if !on {
        return ProgressBar::hidden();
    }
    // a bar dropped unfinished (an error, ctrl-c) is cleared too: bars never stay on the screen
    let bar =
        bar.with_style(style(template)).with_prefix(label.to_owned()).with_finish(ProgressFinish::AndClear);
    let bar = multi().add(bar);
    bar.enable_steady_tick(Duration::from_millis(250));
    bar
}

/// Runs `f` with the bars lifted off the terminal (for output written while they show).
pub fn suspend<R>(f: impl FnOnce() -> R) -> R {
    if enabled() { multi().suspend(f) } else { f() }
}

/// `println!` on stdout, above the bars when they show.
pub fn println(line: impl AsRef<str>) {
    suspend(|| println!("{}", line.as_ref()));
}

/// Stderr for the log (`tracing_subscriber::fmt().with_writer(progress::log_writer)`): each
/// log line is written with the bars lifted, so log lines and bars do not overwrite each other.
pub fn log_writer() -> LogWriter {
    LogWriter
}

/// See [`log_writer`].
#[derive(Debug, Clone, Copy)]
pub struct LogWriter;

impl Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        suspend(|| std::io::stderr().write(buf))
    }

    fn write_all(&mut self, buf: &[u8]) -> std::io::Result<()> {
        suspend(|| std::io::stderr().write_all(buf))
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bars_need_a_terminal_and_yield_to_the_off_switch() {
        assert!(wanted(None, true));
        assert!(wanted(Some("1"), true));
        assert!(wanted(Some(""), true), "an empty value is not an off switch");
        for off in ["0", "off", "OFF", "false", "no", " 0 "] {
            assert!(!wanted(Some(off), true), "{off:?} turns bars off");
        }
        for any in [None, Some("1"), Some("0")] {
            assert!(!wanted(any, false), "never without a terminal ({any:?})");
        }
    }

    #[test]
    fn bars_that_are_off_are_hidden_but_still_count() {
        let b = add(false, ProgressBar::new(10), "test", BAR);
        assert!(b.is_hidden());
        b.inc(3);
        assert_eq!(b.position(), 3, "a hidden bar still counts, so callers need no branch");
        assert!(add(false, ProgressBar::new_spinner(), "test", SPINNER).is_hidden());
        assert!(ProgressStyle::with_template(BAR).is_ok() && ProgressStyle::with_template(SPINNER).is_ok());
    }
}

//! Resident memory of this process: current RSS from `/proc/self/statm` (resident pages times the
//! page size) and peak RSS from `/proc/self/status` (`VmHWM`). Linux only; `None` elsewhere.

use std::sync::OnceLock;

/// Current resident set size in bytes: statm's second field (resident pages) times the page size.
pub fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * page_size()?)
}

/// Peak resident set size of this process so far (`VmHWM`), in bytes.
pub fn peak_resident_bytes() -> Option<u64> {
    status_kib("VmHWM:").map(|k| k * 1024)
}

/// The page size: `KernelPageSize` of the first mapping in `/proc/self/smaps` (read once),
/// defaulting to 4 KiB.
fn page_size() -> Option<u64> {
    static PAGE: OnceLock<u64> = OnceLock::new();
    Some(*PAGE.get_or_init(|| {
        std::fs::read_to_string("/proc/self/smaps")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("KernelPageSize:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            })
            .map_or(4096, |k| k * 1024)
    }))
}

/// A `kB` field of `/proc/self/status`.
fn status_kib(key: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find_map(|l| l.strip_prefix(key))?;
    line.trim().trim_end_matches("kB").trim().parse().ok()
}

//! CPU clocks for `troupe bench pipeline`: this thread's and this process's CPU time, and each
//! worker process's CPU read from its own cgroup (the starvation check and the runtime's CPU per
//! task).
//!
//! A worker's group: in cgroup v2 its own group's `cpu.stat` (`usage_usec`); in cgroup v1 its
//! `cpuacct` group's `cpuacct.usage` (ns). A worker slowed by a quota has its own `cpu` group,
//! but where `cpuacct` is a hierarchy of its own (as on these machines) or the worker runs at
//! full speed (no group), the bench gives it one: `/sys/fs/cgroup/cpuacct/troupe-bench/NAME-PID`
//! (needs root). Failing all of these, the sum of its threads' `schedstat` (ns; a thread that
//! exits takes its time with it, so this is said with the figures).

use std::path::{Path, PathBuf};

/// Where the cgroup v1 cpuacct controller is mounted.
const CPUACCT_V1: &str = "/sys/fs/cgroup/cpuacct";
/// Where the cgroup v2 unified hierarchy is mounted.
const V2_ROOT: &str = "/sys/fs/cgroup";

/// Seconds of CPU this thread has used (`CLOCK_THREAD_CPUTIME_ID`).
pub fn thread_cpu_s() -> f64 {
    clock_s(libc::CLOCK_THREAD_CPUTIME_ID)
}

/// Seconds of CPU this process (the foreman and the bench around it) has used.
pub fn process_cpu_s() -> f64 {
    clock_s(libc::CLOCK_PROCESS_CPUTIME_ID)
}

fn clock_s(clock: libc::clockid_t) -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid timespec the call writes into.
    if unsafe { libc::clock_gettime(clock, &mut ts) } != 0 {
        return f64::NAN;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

/// Where one worker's CPU time is read.
#[derive(Clone, Debug, PartialEq)]
pub enum CpuSource {
    /// `cpuacct.usage` (ns) of a cgroup v1 group.
    V1(PathBuf),
    /// `cpu.stat` (`usage_usec`) of a cgroup v2 group.
    V2(PathBuf),
    /// The sum of the process's threads' `schedstat` (not a cgroup).
    Threads(u32),
}

impl CpuSource {
    /// The worker's own group, or one made for it, or its threads (module doc).
    pub fn attach(pid: u32, name: &str) -> Self {
        let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
        let own = |path: &str| path.rsplit('/').next().is_some_and(|last| last.ends_with(&format!("-{pid}")));
        for line in cgroup.lines() {
            let mut parts = line.splitn(3, ':');
            let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
                continue;
            };
            let rel = path.trim_start_matches('/');
            if controllers.split(',').any(|c| c == "cpuacct") && own(path) {
                let dir = Path::new(CPUACCT_V1).join(rel);
                if dir.join("cpuacct.usage").exists() {
                    return Self::V1(dir);
                }
            }
            if controllers.is_empty() && own(path) {
                let dir = Path::new(V2_ROOT).join(rel);
                if dir.join("cpu.stat").exists() {
                    return Self::V2(dir);
                }
            }
        }
        let parent = Path::new(CPUACCT_V1).join("troupe-bench");
        // groups of workers that are gone (a bench that was stopped) are removed first
        for e in std::fs::read_dir(&parent).into_iter().flatten().flatten() {
            let gone =
                e.file_name().to_string_lossy().rsplit_once('-').and_then(|(_, p)| p.parse::<u32>().ok());
            if gone.is_some_and(|p| !Path::new(&format!("/proc/{p}")).exists()) {
                let _ = std::fs::remove_dir(e.path());
            }
        }
        let dir = parent.join(format!("{name}-{pid}"));
        if Path::new(CPUACCT_V1).join("cpuacct.usage").exists()
            && std::fs::create_dir_all(&dir).is_ok()
            && std::fs::write(dir.join("cgroup.procs"), pid.to_string()).is_ok()
        {
            return Self::V1(dir);
        }
        Self::Threads(pid)
    }

    /// CPU seconds used so far, if readable.
    pub fn read_s(&self) -> Option<f64> {
        match self {
            Self::V1(dir) => {
                let s = std::fs::read_to_string(dir.join("cpuacct.usage")).ok()?;
                Some(s.trim().parse::<u64>().ok()? as f64 / 1e9)
            }
            Self::V2(dir) => {
                let s = std::fs::read_to_string(dir.join("cpu.stat")).ok()?;
                let v = s.lines().find_map(|l| l.strip_prefix("usage_usec "))?;
                Some(v.trim().parse::<u64>().ok()? as f64 / 1e6)
            }
            Self::Threads(pid) => {
                let mut ns = 0u64;
                for t in std::fs::read_dir(format!("/proc/{pid}/task")).ok()?.flatten() {
                    let s = std::fs::read_to_string(t.path().join("schedstat")).unwrap_or_default();
                    ns += s.split_whitespace().next().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
                }
                Some(ns as f64 / 1e9)
            }
        }
    }

    /// In words, for the bench's output.
    pub fn describe(&self) -> String {
        match self {
            Self::V1(dir) => format!("cgroup v1 cpuacct.usage ({})", dir.display()),
            Self::V2(dir) => format!("cgroup v2 cpu.stat ({})", dir.display()),
            Self::Threads(pid) => format!(
                "threads' schedstat of pid {pid} (no cgroup: not the starvation check the issue asks for)"
            ),
        }
    }

    /// Removes a group the bench made, once its process is gone (best effort).
    pub fn release(&self) {
        if let Self::V1(dir) = self
            && dir.parent().is_some_and(|p| p.ends_with("troupe-bench"))
        {
            let _ = std::fs::remove_dir(dir);
        }
    }

    /// True when read from a cgroup.
    pub fn is_cgroup(&self) -> bool {
        !matches!(self, Self::Threads(_))
    }
}

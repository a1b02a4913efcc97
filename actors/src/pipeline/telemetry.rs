//! A worker's telemetry and its straggler setting.
//!
//! CPU load and RSS are read from the OS (`/proc/self/stat`, `/proc/self/statm`, `VmHWM`). Battery
//! and temperature come from a device model in the worker's config: this is not a phone, so they
//! are simulated (battery drains with CPU time used, temperature rises with load) and said to be.
//!
//! Stragglers are real where the machine allows it: [`apply_cpu_quota`] puts the worker process
//! into its own cgroup with a CFS quota (the kernel throttles every thread of it): in the cgroup v2
//! unified hierarchy (`cpu.max`) when it offers the `cpu` controller, else in a cgroup v1 `cpu`
//! hierarchy (`cpu.cfs_quota_us`). Where neither is writable, the worker falls back to
//! compute-proportional pacing: after each task it sleeps so that the task takes `100 / pct` times
//! as long. That fallback is an emulation and is reported as one, with both reasons.
//! [`apply_memory_limit`] chooses between `memory.max` (v2) and `memory.limit_in_bytes` (v1) the
//! same way. Under v2 the groups are `<root>/troupe/<node>-<pid>`, with the controller enabled in
//! the root's and `troupe`'s `cgroup.subtree_control` (the root is exempt from v2's rule that a
//! group with processes may not hand controllers to its children, so this needs root, as v1 does).

use std::path::{Path, PathBuf};

use troupe_kernels::onnx::{peak_resident_bytes, resident_bytes};

use super::wire::TelemetrySample;
pub use crate::cgroup::{CGROUP_V2_ROOT, CgroupVersion};
use crate::cgroup::{own_group, v2_group, v2_offers, write_in};
use crate::clock::Clock;

/// Where the cgroup v1 cpu controller is mounted on Linux.
pub const CGROUP_V1_CPU: &str = "/sys/fs/cgroup/cpu";
/// Where the cgroup v1 memory controller is mounted on Linux.
pub const CGROUP_V1_MEMORY: &str = "/sys/fs/cgroup/memory";
/// CFS period written with the quota, microseconds: 10 ms. The share of one CPU is the quota
/// over the period, whatever the period; the period sets how long a throttled worker stalls. With
/// the kernel's default 100 ms, a 20 % worker gets 20 ms of CPU and then waits up to 80 ms, so a
/// ~20 ms task that exhausts the quota stalls for most of a period (a bursty phone, not a slow
/// one, and the stall lands wherever the quota ran out, often outside the compute). At 10 ms the
/// same share stalls at most 8 ms at a time (the kernel allows periods down to 1 ms).
pub const CFS_PERIOD_US: u64 = 10_000;

/// The simulated part of a worker's telemetry.
#[derive(Clone, Copy, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct DeviceModel {
    /// Battery at start, percent.
    pub battery_pct: f64,
    /// Battery drained per CPU-second used, percent.
    pub drain_pct_per_cpu_s: f64,
    /// Temperature at rest, Celsius.
    pub ambient_c: f64,
    /// Temperature added at full load (1 CPU), Celsius.
    pub heat_c_at_full_load: f64,
}

impl Default for DeviceModel {
    fn default() -> Self {
        DeviceModel {
            battery_pct: 90.0,
            drain_pct_per_cpu_s: 0.05,
            ambient_c: 30.0,
            heat_c_at_full_load: 12.0,
        }
    }
}

/// How a worker is slowed.
#[derive(Clone, Debug, PartialEq)]
pub enum Straggler {
    /// Full speed.
    None,
    /// A real CFS quota in a cgroup.
    Cgroup {
        /// Which hierarchy.
        version: CgroupVersion,
        /// The group's folder.
        group: PathBuf,
        /// Quota in percent of one CPU.
        pct: u32,
    },
    /// Emulation: sleep after each task so it takes `100 / pct` times as long.
    Pacing {
        /// Speed in percent.
        pct: u32,
        /// Why the cgroup was not used.
        why: String,
    },
}

impl Straggler {
    /// In words, for logs and the join report.
    pub fn describe(&self) -> String {
        match self {
            Straggler::None => "none (full speed)".into(),
            Straggler::Cgroup { version, group, pct } => {
                format!(
                    "{version} cpu quota {pct}% of one CPU, CFS period {} ms ({})",
                    CFS_PERIOD_US / 1000,
                    group.display()
                )
            }
            Straggler::Pacing { pct, why } => {
                format!("pacing to {pct}% speed (emulation: {why})")
            }
        }
    }

    /// Extra time to sleep after a task that computed for `compute` (pacing only).
    pub fn pacing_for(&self, compute: std::time::Duration) -> std::time::Duration {
        match self {
            Straggler::Pacing { pct, .. } if *pct > 0 && *pct < 100 => {
                compute.mul_f64(100.0 / f64::from(*pct) - 1.0)
            }
            _ => std::time::Duration::ZERO,
        }
    }
}

/// Slows this process to `pct` percent of one CPU: a CFS quota in cgroup v2 or, failing that, v1
/// if a controller is there and writable, else pacing. `pct >= 100` leaves it at full speed.
pub fn apply_cpu_quota(node: &str, pct: u32) -> Straggler {
    if pct == 0 || pct >= 100 {
        return Straggler::None;
    }
    let v2 = match cgroup_v2_quota(Path::new(CGROUP_V2_ROOT), node, pct) {
        Ok(group) => return Straggler::Cgroup { version: CgroupVersion::V2, group, pct },
        Err(why) => why,
    };
    match cgroup_v1_quota(Path::new(CGROUP_V1_CPU), node, pct) {
        Ok(group) => Straggler::Cgroup { version: CgroupVersion::V1, group, pct },
        Err(v1) => Straggler::Pacing { pct, why: format!("{v2}; {v1}") },
    }
}

/// Which hierarchy a memory limit would be enforced in here, or why none can be.
pub fn memory_controller() -> Result<CgroupVersion, String> {
    let v2 = match v2_offers(Path::new(CGROUP_V2_ROOT), "memory") {
        Ok(()) => return Ok(CgroupVersion::V2),
        Err(why) => why,
    };
    let v1 = Path::new(CGROUP_V1_MEMORY);
    if v1.join("memory.limit_in_bytes").exists() {
        Ok(CgroupVersion::V1)
    } else {
        Err(format!("{v2}; no cgroup v1 memory controller at {}", v1.display()))
    }
}

/// `cpu.max` of a v2 group: quota and period, microseconds.
fn cgroup_v2_quota(root: &Path, node: &str, pct: u32) -> Result<PathBuf, String> {
    let group = v2_group(root, node, "cpu")?;
    write_in(&group, "cpu.max", format!("{} {CFS_PERIOD_US}", CFS_PERIOD_US * u64::from(pct) / 100))?;
    write_in(&group, "cgroup.procs", std::process::id().to_string())?;
    Ok(group)
}

/// `memory.max` of a v2 group, with swap shut off where the kernel accounts it (else going over
/// the limit would swap instead of killing, and the budget would not bind).
fn cgroup_v2_memory(root: &Path, node: &str, bytes: u64) -> Result<PathBuf, String> {
    let group = v2_group(root, node, "memory")?;
    write_in(&group, "memory.max", bytes.to_string())?;
    if group.join("memory.swap.max").exists() {
        write_in(&group, "memory.swap.max", "0".into())?;
    }
    write_in(&group, "cgroup.procs", std::process::id().to_string())?;
    Ok(group)
}

fn cgroup_v1_quota(root: &Path, node: &str, pct: u32) -> Result<PathBuf, String> {
    if !root.join("cpu.cfs_quota_us").exists() {
        return Err(format!("no cgroup v1 cpu controller at {}", root.display()));
    }
    let group = own_group(root, node)?;
    write_in(&group, "cpu.cfs_period_us", CFS_PERIOD_US.to_string())?;
    write_in(&group, "cpu.cfs_quota_us", (CFS_PERIOD_US * u64::from(pct) / 100).to_string())?;
    // cgroup.procs moves every thread of the process (tasks would move one thread).
    write_in(&group, "cgroup.procs", std::process::id().to_string())?;
    Ok(group)
}

/// How a worker's RAM budget is held.
#[derive(Clone, Debug, PartialEq)]
pub enum MemoryLimit {
    /// The foreman keeps stages that do not fit the budget away; the OS does not enforce it.
    Advisory,
    /// A cgroup memory limit: going over it gets the worker OOM-killed (a real budget).
    Cgroup {
        /// Which hierarchy.
        version: CgroupVersion,
        /// The group's folder.
        group: PathBuf,
        /// The limit, bytes.
        bytes: u64,
    },
    /// Enforcement was asked for but is not possible here.
    Unavailable {
        /// Why.
        why: String,
    },
}

impl MemoryLimit {
    /// In words.
    pub fn describe(&self) -> String {
        match self {
            MemoryLimit::Advisory => "RAM budget advisory (scheduling only)".into(),
            MemoryLimit::Cgroup { version, group, bytes } => {
                format!(
                    "RAM budget enforced: {version} memory limit {} MiB ({})",
                    bytes >> 20,
                    group.display()
                )
            }
            MemoryLimit::Unavailable { why } => format!("RAM budget advisory only: {why}"),
        }
    }
}

/// Enforces `bytes` as this process's memory limit with a cgroup v2 or, failing that, v1 memory
/// group, if asked and possible.
pub fn apply_memory_limit(node: &str, bytes: u64, enforce: bool) -> MemoryLimit {
    if !enforce {
        return MemoryLimit::Advisory;
    }
    let v2 = match cgroup_v2_memory(Path::new(CGROUP_V2_ROOT), node, bytes) {
        Ok(group) => return MemoryLimit::Cgroup { version: CgroupVersion::V2, group, bytes },
        Err(why) => why,
    };
    let root = Path::new(CGROUP_V1_MEMORY);
    let attempt = || -> Result<PathBuf, String> {
        if !root.join("memory.limit_in_bytes").exists() {
            return Err(format!("no cgroup v1 memory controller at {}", root.display()));
        }
        let group = own_group(root, node)?;
        write_in(&group, "memory.limit_in_bytes", bytes.to_string())?;
        write_in(&group, "cgroup.procs", std::process::id().to_string())?;
        Ok(group)
    };
    match attempt() {
        Ok(group) => MemoryLimit::Cgroup { version: CgroupVersion::V1, group, bytes },
        Err(v1) => MemoryLimit::Unavailable { why: format!("{v2}; {v1}") },
    }
}

/// Samples CPU time and RSS of this process and steps the device model.
#[derive(Debug)]
pub struct Sampler {
    model: DeviceModel,
    ram_budget_bytes: u64,
    last_cpu_s: f64,
    last_wall: Clock,
    cpu_used_s: f64,
    /// A simulated worker's sampler: reads nothing from the OS (see [`Sampler::simulated`]).
    simulated: bool,
}

impl Sampler {
    /// A sampler for a worker with this budget and device model.
    pub fn new(model: DeviceModel, ram_budget_bytes: u64) -> Self {
        Sampler {
            model,
            ram_budget_bytes,
            last_cpu_s: process_cpu_seconds().unwrap_or(0.0),
            last_wall: Clock::start(),
            cpu_used_s: 0.0,
            simulated: false,
        }
    }

    /// A sampler of a simulated worker (simulation only): no CPU time or RSS is read from the
    /// OS (the processes of a simulated cluster are one), so every sample is the idle device
    /// model's, the same in every run.
    pub fn simulated(model: DeviceModel, ram_budget_bytes: u64) -> Self {
        Sampler { last_cpu_s: 0.0, simulated: true, ..Sampler::new(model, ram_budget_bytes) }
    }

    /// One sample: CPU load since the last one, RSS now, and the device model's state.
    pub fn sample(&mut self) -> TelemetrySample {
        if self.simulated {
            return TelemetrySample {
                cpu_load: 0.0,
                rss_bytes: 0,
                peak_rss_bytes: 0,
                ram_budget_bytes: self.ram_budget_bytes,
                free_ram_bytes: self.ram_budget_bytes,
                battery_pct: self.model.battery_pct.clamp(0.0, 100.0),
                temperature_c: self.model.ambient_c,
                pid: 0,
            };
        }
        let cpu = process_cpu_seconds().unwrap_or(self.last_cpu_s);
        let wall = self.last_wall.elapsed().as_secs_f64();
        let used = (cpu - self.last_cpu_s).max(0.0);
        let load = if wall > 1e-3 { used / wall } else { 0.0 };
        self.cpu_used_s += used;
        self.last_cpu_s = cpu;
        self.last_wall = Clock::start();
        let rss = resident_bytes().unwrap_or(0);
        TelemetrySample {
            cpu_load: load,
            rss_bytes: rss,
            peak_rss_bytes: peak_resident_bytes().unwrap_or(0),
            ram_budget_bytes: self.ram_budget_bytes,
            free_ram_bytes: self.ram_budget_bytes.saturating_sub(rss),
            battery_pct: (self.model.battery_pct - self.model.drain_pct_per_cpu_s * self.cpu_used_s)
                .clamp(0.0, 100.0),
            temperature_c: self.model.ambient_c + self.model.heat_c_at_full_load * load.min(1.0),
            pid: std::process::id(),
        }
    }
}

/// User plus system CPU time of this process in seconds (`/proc/self/stat` fields 14 and 15).
pub fn process_cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The command name (field 2) may hold spaces; fields after its closing parenthesis are fixed.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    // SAFETY: sysconf only reads a configuration value.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let ticks = if ticks > 0 { ticks as f64 } else { 100.0 };
    Some((utime + stime) / ticks)
}

/// Peak RSS (`VmHWM`) of process `pid`, read from `/proc/<pid>/status`, in bytes.
pub fn peak_rss_of(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find_map(|l| l.strip_prefix("VmHWM:"))?;
    line.trim().trim_end_matches("kB").trim().parse::<u64>().ok().map(|k| k * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_time_grows_with_work_and_peak_rss_is_read() {
        let before = process_cpu_seconds().unwrap();
        let start = Clock::start();
        let mut x = 1u64;
        while start.elapsed().as_millis() < 50 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
        }
        std::hint::black_box(x);
        assert!(process_cpu_seconds().unwrap() > before);
        assert!(peak_rss_of(std::process::id()).unwrap() > 1 << 20);
    }

    #[test]
    fn pacing_scales_compute_and_full_speed_is_untouched() {
        let p = Straggler::Pacing { pct: 25, why: "test".into() };
        assert_eq!(p.pacing_for(std::time::Duration::from_millis(10)), std::time::Duration::from_millis(30));
        assert_eq!(apply_cpu_quota("x", 100), Straggler::None);
        assert!(p.describe().contains("emulation"));
    }

    #[test]
    fn missing_controller_falls_back_to_pacing() {
        let d = std::env::temp_dir().join(format!("troupe-no-cgroup-{}", std::process::id()));
        let err = cgroup_v1_quota(&d, "w", 50).unwrap_err();
        assert!(err.contains("no cgroup v1 cpu controller"), "{err}");
    }

    /// A unified hierarchy laid out in real files: the v2 path enables the controller down to
    /// the worker's group and writes `cpu.max` / `memory.max` there.
    #[test]
    fn cgroup_v2_groups_are_written_where_the_controller_is_offered() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        std::fs::write(r.join("cgroup.controllers"), "cpuset cpu io memory pids\n").unwrap();
        std::fs::write(r.join("cgroup.subtree_control"), "").unwrap();
        let group = cgroup_v2_quota(r, "w", 40).unwrap();
        assert_eq!(group, r.join("troupe").join(format!("w-{}", std::process::id())));
        assert_eq!(std::fs::read_to_string(group.join("cpu.max")).unwrap(), "4000 10000");
        assert_eq!(
            std::fs::read_to_string(group.join("cgroup.procs")).unwrap(),
            std::process::id().to_string()
        );
        assert_eq!(std::fs::read_to_string(r.join("cgroup.subtree_control")).unwrap(), "+cpu");
        assert_eq!(std::fs::read_to_string(r.join("troupe/cgroup.subtree_control")).unwrap(), "+cpu");
        std::fs::write(group.join("memory.swap.max"), "max").unwrap();
        let same = cgroup_v2_memory(r, "w", 64 << 20).unwrap();
        assert_eq!(same, group);
        assert_eq!(std::fs::read_to_string(group.join("memory.max")).unwrap(), (64u64 << 20).to_string());
        assert_eq!(std::fs::read_to_string(group.join("memory.swap.max")).unwrap(), "0");
    }

    #[test]
    fn cgroup_v2_without_the_controller_is_refused_naming_it() {
        let root = tempfile::tempdir().unwrap();
        let err = cgroup_v2_quota(root.path(), "w", 50).unwrap_err();
        assert!(err.contains("no cgroup v2 hierarchy") && err.contains("cgroup.controllers"), "{err}");
        std::fs::write(root.path().join("cgroup.controllers"), "pids\n").unwrap();
        let err = cgroup_v2_memory(root.path(), "w", 1 << 20).unwrap_err();
        assert!(err.contains("offers no memory controller (offered: pids"), "{err}");
        assert!(!root.path().join("troupe").exists(), "a group was made without the controller");
    }

    #[test]
    fn device_model_drains_and_heats() {
        let mut s =
            Sampler::new(DeviceModel { drain_pct_per_cpu_s: 1000.0, ..DeviceModel::default() }, 1 << 30);
        // Spin until the process has used 30 ms more CPU (not 30 ms of wall time: on a busy box
        // this thread may get almost none of that, and /proc counts in 10 ms ticks).
        let before = process_cpu_seconds().unwrap();
        let mut x = 1u64;
        while process_cpu_seconds().unwrap() < before + 0.03 {
            for _ in 0..10_000 {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
            }
        }
        std::hint::black_box(x);
        let t = s.sample();
        assert!(t.battery_pct < 90.0, "{t:?}");
        assert!(t.temperature_c > 30.0, "{t:?}");
        assert_eq!(t.free_ram_bytes, (1u64 << 30) - t.rss_bytes);
    }
}

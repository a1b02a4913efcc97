//! A storage read throttle for the edge's reuse cache (issue 43, item 6): the cache's disk reads
//! run at an edge board's storage bandwidth, enforced by the kernel, as the pipeline's phone
//! workers get their CPU quota ([`crate::pipeline::telemetry`], whose cgroup helpers this reuses).
//!
//! * cgroup v2, where the unified hierarchy offers the `io` controller: this process moves into
//!   `<root>/troupe/<node>-<pid>` with `io.max` = `MAJ:MIN rbps=BPS` (v2 has no per-thread io
//!   membership, so every read of the process on that device is throttled).
//! * cgroup v1 `blkio`: a group `<root>/troupe/<node>-<pid>` with
//!   `blkio.throttle.read_bps_device` = `MAJ:MIN BPS`, which the reuse cache's disk thread alone
//!   joins (v1 places threads one by one; reads are charged to the thread that issues them, and the
//!   cache's reads bypass the page cache, so each one reaches the throttle).
//!
//! The device is the whole disk holding the reuse directory (its `st_dev`, a partition mapped to
//! its disk through `/sys/dev/block`), never a hard-coded one. Where neither hierarchy can be
//! written the error says so with both reasons: a node asked for a throttle never runs without one.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use troupe_policy::adapt::storage::check_read_bps;

use crate::cgroup::{CGROUP_V2_ROOT, CgroupVersion, own_group, v2_group, write_in};

/// Where the cgroup v1 blkio controller is mounted on Linux.
pub const CGROUP_V1_BLKIO: &str = "/sys/fs/cgroup/blkio";

/// Why a storage read throttle could not be had; each names the config field.
#[derive(Debug, thiserror::Error)]
pub enum ThrottleError {
    /// The value itself is refused.
    #[error("storage_read_bps: {0}")]
    Invalid(String),
    /// The kernel's throttle cannot be set here.
    #[error("storage_read_bps: cannot throttle reads of {path}: {why}")]
    Unavailable {
        /// The directory whose reads were to be throttled.
        path: PathBuf,
        /// Why not (both hierarchies' reasons where both were tried).
        why: String,
    },
}

/// A throttle in force.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StorageThrottle {
    /// The hierarchy holding it.
    pub version: CgroupVersion,
    /// Its group.
    pub group: PathBuf,
    /// The throttled disk, `(major, minor)`.
    pub device: (u64, u64),
    /// Bytes per second.
    pub bps: u64,
}

impl StorageThrottle {
    /// The v1 `tasks` file the reading thread joins (`None` under v2: the process is in already).
    pub fn thread_tasks(&self) -> Option<PathBuf> {
        matches!(self.version, CgroupVersion::V1).then(|| self.group.join("tasks"))
    }

    /// In words, for logs and the bench.
    pub fn describe(&self) -> String {
        let who = match self.version {
            CgroupVersion::V1 => "the reuse cache's disk thread",
            CgroupVersion::V2 => "this process",
        };
        format!(
            "{} reads of disk {}:{} at {:.1} MB/s for {who} ({})",
            self.version,
            self.device.0,
            self.device.1,
            self.bps as f64 / 1e6,
            self.group.display()
        )
    }
}

/// Throttles reads of the disk holding `path` to `bps` bytes per second, in the real hierarchies.
pub fn throttle_reads(path: &Path, bps: u64, node: &str) -> Result<StorageThrottle, ThrottleError> {
    throttle_reads_in(Path::new(CGROUP_V2_ROOT), Path::new(CGROUP_V1_BLKIO), path, bps, node)
}

/// [`throttle_reads`] with the hierarchies' mount points given (tests point them elsewhere).
pub fn throttle_reads_in(
    v2_root: &Path,
    v1_root: &Path,
    path: &Path,
    bps: u64,
    node: &str,
) -> Result<StorageThrottle, ThrottleError> {
    check_read_bps(bps).map_err(ThrottleError::Invalid)?;
    if bps == 0 {
        return Err(ThrottleError::Invalid("0 means no throttle; nothing to set".into()));
    }
    let unavailable = |why: String| ThrottleError::Unavailable { path: path.to_path_buf(), why };
    let device = disk_of(path).map_err(unavailable)?;
    let dev = format!("{}:{}", device.0, device.1);
    let v2 = v2_group(v2_root, node, "io").and_then(|group| {
        write_in(&group, "io.max", format!("{dev} rbps={bps}"))?;
        write_in(&group, "cgroup.procs", std::process::id().to_string())?;
        Ok(group)
    });
    let v2_why = match v2 {
        Ok(group) => return Ok(StorageThrottle { version: CgroupVersion::V2, group, device, bps }),
        Err(why) => why,
    };
    let v1 = if v1_root.join("blkio.throttle.read_bps_device").exists() {
        own_group(v1_root, node).and_then(|group| {
            write_in(&group, "blkio.throttle.read_bps_device", format!("{dev} {bps}"))?;
            Ok(group)
        })
    } else {
        Err(format!("no cgroup v1 blkio controller at {}", v1_root.display()))
    };
    match v1 {
        Ok(group) => Ok(StorageThrottle { version: CgroupVersion::V1, group, device, bps }),
        Err(v1_why) => Err(unavailable(format!("{v2_why}; {v1_why}"))),
    }
}

/// `(major, minor)` of a Linux `dev_t` (glibc's encoding).
pub fn dev_numbers(dev: u64) -> (u64, u64) {
    let major = ((dev >> 32) & 0xffff_f000) | ((dev >> 8) & 0xfff);
    let minor = ((dev >> 12) & 0xffff_ff00) | (dev & 0xff);
    (major, minor)
}

/// The whole disk holding `path`: its filesystem's device, a partition mapped to its disk.
fn disk_of(path: &Path) -> Result<(u64, u64), String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("stat {}: {e}", path.display()))?;
    let (major, minor) = dev_numbers(meta.dev());
    let sys = PathBuf::from(format!("/sys/dev/block/{major}:{minor}"));
    if !sys.exists() {
        return Err(format!(
            "its filesystem's device {major}:{minor} is no block device ({} missing: a virtual or \
             overlay filesystem; put the reuse directory on a disk)",
            sys.display()
        ));
    }
    if !sys.join("partition").exists() {
        return Ok((major, minor));
    }
    let parent = sys.canonicalize().ok().and_then(|p| p.parent().map(|d| d.join("dev")));
    let text = parent.as_deref().and_then(|p| std::fs::read_to_string(p).ok()).unwrap_or_default();
    match text.trim().split_once(':').map(|(a, b)| (a.parse(), b.parse())) {
        Some((Ok(a), Ok(b))) => Ok((a, b)),
        _ => Err(format!("cannot find the disk of partition {major}:{minor} under {}", sys.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dev_numbers_split_glibc_encoding() {
        assert_eq!(dev_numbers(0xfe00), (254, 0));
        assert_eq!(dev_numbers(0x0801), (8, 1));
        // makedev(259, 300): a minor above 255 keeps its high bits above the major's low ones.
        assert_eq!(dev_numbers(0x11_032c), (259, 300));
        assert_eq!(dev_numbers(0x1000_0000_0000), (0x1000, 0));
    }

    #[test]
    fn zero_and_absurd_rates_are_refused_naming_the_field() {
        let d = tempfile::tempdir().unwrap();
        for bps in [0, 1, u64::MAX] {
            let e = throttle_reads_in(d.path(), d.path(), d.path(), bps, "t").unwrap_err().to_string();
            assert!(e.starts_with("storage_read_bps: "), "{e}");
        }
    }

    #[test]
    fn without_a_writable_hierarchy_the_error_gives_both_reasons() {
        let d = tempfile::tempdir().unwrap();
        let e = throttle_reads_in(&d.path().join("v2"), &d.path().join("v1"), d.path(), 10_000_000, "t")
            .unwrap_err()
            .to_string();
        assert!(e.contains("storage_read_bps: cannot throttle reads of"), "{e}");
        // Either the directory's filesystem is no block device, or both hierarchies are named.
        assert!(e.contains("no block device") || (e.contains("cgroup v2") && e.contains("blkio")), "{e}");
    }
}

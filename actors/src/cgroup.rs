//! cgroup primitives shared by the shells that confine their own process or threads: the pipeline
//! worker's CPU quota and memory limit, the coadapt edge's storage read throttle. Each group is
//! `<root>/troupe/<node>-<pid>`; errors are strings naming the file and why, for the caller's own
//! error (a node never runs unconfined when a limit was asked for).

use std::path::{Path, PathBuf};

/// Where the cgroup v2 unified hierarchy is mounted on Linux (when it is).
pub const CGROUP_V2_ROOT: &str = "/sys/fs/cgroup";

/// Which cgroup hierarchy holds a group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CgroupVersion {
    /// A per-controller cgroup v1 hierarchy.
    V1,
    /// The cgroup v2 unified hierarchy.
    V2,
}

impl std::fmt::Display for CgroupVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CgroupVersion::V1 => "cgroup v1",
            CgroupVersion::V2 => "cgroup v2",
        })
    }
}

/// Whether the unified hierarchy at `root` offers `controller`, or why not.
pub(crate) fn v2_offers(root: &Path, controller: &str) -> Result<(), String> {
    let file = root.join("cgroup.controllers");
    let Ok(list) = std::fs::read_to_string(&file) else {
        return Err(format!("no cgroup v2 hierarchy at {} ({} missing)", root.display(), file.display()));
    };
    if list.split_whitespace().any(|c| c == controller) {
        Ok(())
    } else {
        let offered = if list.trim().is_empty() { "none" } else { list.trim() };
        Err(format!(
            "cgroup v2 at {} offers no {controller} controller (offered: {offered}; a controller bound \
             to a v1 hierarchy is not available in v2)",
            root.display()
        ))
    }
}

/// `<root>/troupe/<node>-<pid>` with `controller` enabled for it.
pub(crate) fn v2_group(root: &Path, node: &str, controller: &str) -> Result<PathBuf, String> {
    v2_offers(root, controller)?;
    enable_for_children(root, controller)?;
    let parent = root.join("troupe");
    std::fs::create_dir_all(&parent).map_err(|e| format!("creating {}: {e}", parent.display()))?;
    enable_for_children(&parent, controller)?;
    own_group(root, node)
}

/// Adds `controller` to `dir/cgroup.subtree_control` unless it is there already.
pub(crate) fn enable_for_children(dir: &Path, controller: &str) -> Result<(), String> {
    let file = dir.join("cgroup.subtree_control");
    let now = std::fs::read_to_string(&file).unwrap_or_default();
    if now.split_whitespace().any(|c| c == controller) {
        return Ok(());
    }
    write_in(dir, "cgroup.subtree_control", format!("+{controller}"))
}

/// Creates `<root>/troupe/<node>-<pid>`, first removing groups left by dead workers.
pub(crate) fn own_group(root: &Path, node: &str) -> Result<PathBuf, String> {
    let parent = root.join("troupe");
    let _ = std::fs::create_dir_all(&parent);
    // Groups of workers that died (kill -9) stay behind, empty: remove those whose process is
    // gone (never a live sibling's, which may be empty for a moment while it starts).
    if let Ok(entries) = std::fs::read_dir(&parent) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let pid = name.rsplit_once('-').and_then(|(_, p)| p.parse::<u32>().ok());
            if pid.is_some_and(|p| !Path::new(&format!("/proc/{p}")).exists()) {
                let _ = std::fs::remove_dir(e.path());
            }
        }
    }
    let group = parent.join(format!("{node}-{}", std::process::id()));
    std::fs::create_dir_all(&group).map_err(|e| format!("creating {}: {e}", group.display()))?;
    Ok(group)
}

pub(crate) fn write_in(group: &Path, file: &str, value: String) -> Result<(), String> {
    std::fs::write(group.join(file), value)
        .map_err(|e| format!("writing {}: {e}", group.join(file).display()))
}

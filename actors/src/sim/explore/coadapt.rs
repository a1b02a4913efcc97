//! The `coadapt` workload of the fault explorer (simulation only): the real edge (its journal on
//! a real file) and three real cameras on the model-compute stand-ins
//! ([`crate::sim::coadapt`]); the client node only watches. Each camera streams its drifting
//! feed, uploads each drift's frames and installs the answer; the schedule crashes and restarts
//! the edge node (it resumes from its journal) and camera nodes (a camera streams again from
//! its first frame and repeats its uploads), cuts them off and impairs the net.
//!
//! The answers are what the cameras installed, per (camera, adaptation): each must come once
//! (a restarted camera's repeat must get the same answer), equal the fault-free run's, and the
//! latest incarnation of every camera must stream to its end with every upload answered.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use troupe_policy::sim::SimFault;
use troupe_transport::Role;

use super::{Answers, SimWorkload};
use crate::coadapt::sim_compute::SimCameraLog;
use crate::sim::coadapt::{
    NodeHandles, all_ended, answers, camera_args, edge_fault_site, spec, start_camera, start_edge,
};
use crate::sim::{SimNode, SimNodeSpec};

/// The cameras' data seed: the same in every run, so every seed's answers compare with the
/// fault-free run's.
const DATA_SEED: u64 = 42;

/// One run's state: its journal's folder (removed with it) and the cameras' record.
struct RunState {
    dir: PathBuf,
    log: SimCameraLog,
}

impl RunState {
    /// A fresh state for a run of `tag`, its folder under [`sim_disk_root`](super::disk::sim_disk_root).
    fn new(tag: &str) -> std::io::Result<Self> {
        static RUNS: AtomicU64 = AtomicU64::new(0);
        let n = RUNS.fetch_add(1, Ordering::Relaxed);
        let dir = super::disk::sim_disk_root().join(format!("troupe-sim-{tag}-{}-{n}", std::process::id()));
        // a killed process whose pid recurs leaves its folder (and journal) behind: never replay it
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        Ok(Self { dir, log: SimCameraLog::default() })
    }

    fn journal(&self) -> PathBuf {
        self.dir.join("edge.journal")
    }
}

impl Drop for RunState {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The workload: `cameras` cameras uploading to one edge.
pub struct CoadaptWorkload {
    /// How many cameras.
    pub cameras: u64,
    /// Per tag, the run under way (made when the client node starts, which is once a run).
    runs: Mutex<BTreeMap<String, RunState>>,
}

impl Default for CoadaptWorkload {
    fn default() -> Self {
        Self { cameras: 3, runs: Mutex::new(BTreeMap::new()) }
    }
}

/// A node's role in the workload, read off its name (`{tag}-client`, `{tag}-edge`,
/// `{tag}-cam{i}`), and its tag.
enum Part {
    Client,
    Edge,
    Camera(u64),
}

fn part_of(name: &str) -> Option<(&str, Part)> {
    let (tag, what) = name.rsplit_once('-')?;
    let part = match what {
        "client" => Part::Client,
        "edge" => Part::Edge,
        cam => Part::Camera(cam.strip_prefix("cam")?.parse::<u64>().ok()?.checked_sub(1)?),
    };
    Some((tag, part))
}

impl CoadaptWorkload {
    fn cameras(&self, tag: &str) -> Vec<String> {
        (1..=self.cameras).map(|i| format!("{tag}-cam{i}")).collect()
    }

    fn with_run<T>(&self, tag: &str, f: impl FnOnce(&RunState) -> T) -> Option<T> {
        let runs = self.runs.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        runs.get(tag).map(f)
    }
}

impl SimWorkload for CoadaptWorkload {
    fn name(&self) -> &'static str {
        "coadapt"
    }

    /// The edge's node keeps the journal: its crashes tear it.
    fn disks(&self, tag: &str) -> Vec<String> {
        vec![format!("{tag}-edge")]
    }

    /// The edge's node runs its scheduler, behind the run's own fault site.
    fn schedulers(&self, tag: &str) -> Vec<String> {
        vec![format!("{tag}-edge")]
    }

    fn begin(&self, tag: &str) {
        super::arm_scheduler_panic(&edge_fault_site(tag), false);
    }

    fn process_fault(&self, tag: &str, fault: &SimFault) -> Result<usize, String> {
        match fault {
            SimFault::Tear(_, tear) => self
                .with_run(tag, RunState::journal)
                .map_or(Ok(0), |j| super::disk::tear_journal(&j, *tear).map(usize::from)),
            SimFault::Panic(_) => {
                super::arm_scheduler_panic(&edge_fault_site(tag), true);
                Ok(0)
            }
            _ => Ok(0),
        }
    }

    fn nodes(&self, tag: &str) -> Vec<SimNodeSpec> {
        let mut nodes =
            vec![spec(&format!("{tag}-client"), Role::Client), spec(&format!("{tag}-edge"), Role::Edge)];
        nodes.extend(self.cameras(tag).iter().map(|c| spec(c, Role::Camera)));
        nodes
    }

    fn prepare(&self, node: &SimNode) {
        let Some((tag, part)) = part_of(node.name.as_str()) else { return };
        let handles = NodeHandles::from(node);
        match part {
            Part::Client => match RunState::new(tag) {
                Ok(run) => {
                    let mut runs = self.runs.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                    runs.insert(tag.to_string(), run);
                }
                Err(e) => tracing::error!(error = %e, "no folder for the simulated edge's journal"),
            },
            Part::Edge => {
                let Some(journal) = self.with_run(tag, RunState::journal) else { return };
                let tag = tag.to_string();
                tokio::spawn(async move {
                    if let Err(e) = start_edge(&handles, &tag, &journal).await {
                        tracing::warn!(node = %handles.name, error = %e, "the simulated edge did not start");
                    }
                });
            }
            Part::Camera(i) => {
                let Some(log) = self.with_run(tag, |r| r.log.clone()) else { return };
                let args = camera_args(&handles, i, DATA_SEED, &log);
                tokio::spawn(async move {
                    if let Err(e) = start_camera(&handles, args).await {
                        tracing::warn!(node = %handles.name, error = %e, "the simulated camera did not start");
                    }
                });
            }
        }
    }

    fn client(&self, tag: &str, _node: &SimNode) -> impl Future<Output = Answers> + Send + 'static {
        let cameras = self.cameras(tag);
        let log = self.with_run(tag, |r| r.log.clone());
        async move {
            let Some(log) = log else { return Answers::default() };
            while !all_ended(&log, &cameras) {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            answers(&log, &cameras)
        }
    }
}

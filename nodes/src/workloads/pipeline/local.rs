//! A local pipeline cluster: the foreman runs in this process (its own node runtime), each worker
//! is a separate `troupe node` process on loopback, so every worker's RSS is its own and can be
//! read from the OS, and a worker can be killed for real.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use tokio::sync::mpsc;
use troupe_actors::NodeRuntime;
use troupe_actors::pipeline::telemetry::peak_rss_of;
use troupe_actors::pipeline::{
    BlobShelf, JobOutcome, PipelineJob, Progress, ShellSettings, run_pipeline_job,
};
use troupe_kernels::onnx::{NamedTensor, OnnxSession, SessionConfig, peak_resident_bytes};

use crate::config::{ActorConfig, MembershipSection, NodeConfig};
use crate::up::{Cluster, Launch, Topology, TopologyNode, prepare_with};

/// Name of the foreman node.
pub const FOREMAN: &str = "foreman";

/// One worker process to start.
#[derive(Clone, Debug)]
pub struct WorkerSpec {
    /// Node name.
    pub name: String,
    /// CPU speed, percent of one CPU.
    pub cpu_quota_pct: u32,
    /// RAM budget, MiB.
    pub ram_budget_mb: u64,
    /// Disk cache of stage files.
    pub cache_dir: PathBuf,
    /// Simulated battery, percent.
    pub battery_pct: f64,
    /// Enforce the RAM budget with a cgroup (v2 or v1) memory limit.
    pub enforce_ram_budget: bool,
}

impl WorkerSpec {
    /// A worker with a 512 MiB budget and its cache under `workdir/cache/<name>`.
    pub fn new(name: &str, cpu_quota_pct: u32, workdir: &Path) -> Self {
        WorkerSpec {
            name: name.to_owned(),
            cpu_quota_pct,
            ram_budget_mb: 512,
            cache_dir: workdir.join("cache").join(name),
            battery_pct: 90.0,
            enforce_ram_budget: false,
        }
    }
}

/// A running local cluster: the foreman's node runtime here, the workers' processes started,
/// killed and restarted by the launcher `troupe up` uses ([`Cluster`]), each worker's output in
/// `WORKDIR/NAME.log` only.
pub struct LocalCluster {
    runtime: NodeRuntime,
    shelf: BlobShelf,
    workers: std::sync::Mutex<Cluster>,
}

/// Heartbeats every 200 ms, a member down after 2 s of silence (a lost worker is noticed while
/// a short job still runs; a stall that makes every worker look down no longer ends the job:
/// the foreman waits for them to come back).
fn membership() -> MembershipSection {
    MembershipSection { heartbeat_ms: 200, timeout_ms: 2000 }
}

impl LocalCluster {
    /// Starts the foreman node here and one `exe node` process per worker, with keys, ports and
    /// configs from the launcher `troupe up` uses ([`prepare_with`]: a topology of the foreman
    /// and the workers, the foreman holding the scheduler role).
    pub async fn start(exe: &Path, workdir: &Path, workers: &[WorkerSpec]) -> Result<Self> {
        std::fs::create_dir_all(workdir).with_context(|| format!("creating {}", workdir.display()))?;
        let workdir = workdir.canonicalize()?;
        let node = |name: &str, actors: Vec<ActorConfig>| TopologyNode {
            name: name.to_owned(),
            devices: Vec::new(),
            actors,
            job: None,
            faults: Default::default(),
            metrics: Default::default(),
        };
        let mut nodes = vec![node(FOREMAN, Vec::new())];
        for w in workers {
            let mut params = toml::Table::new();
            params.insert("ram_budget_mb".into(), toml::Value::Integer(i64::try_from(w.ram_budget_mb)?));
            params.insert("cpu_quota_pct".into(), toml::Value::Integer(i64::from(w.cpu_quota_pct)));
            params.insert("battery_pct".into(), toml::Value::Float(w.battery_pct));
            params.insert("enforce_ram_budget".into(), toml::Value::Boolean(w.enforce_ram_budget));
            params.insert("cache_dir".into(), toml::Value::String(w.cache_dir.display().to_string()));
            nodes.push(node(
                &w.name,
                vec![ActorConfig { kind: "pipeline-worker".into(), name: None, params }],
            ));
        }
        let topology = Topology {
            name: "pipeline".into(),
            membership: membership(),
            supervision: Default::default(),
            transport: Default::default(),
            links: Default::default(),
            prepare: Vec::new(),
            nodes,
        };
        let configs = prepare_with(&topology, &workdir, |n| {
            (n.name == FOREMAN).then_some(troupe_transport::RoleSet::only(troupe_transport::Role::Scheduler))
        })?;
        let (_, foreman_path) = configs.first().context("the foreman's config")?;
        let kinds = crate::kinds::Kinds::builtin();
        let foreman = NodeConfig::load(foreman_path, &kinds)?;
        let runtime = NodeRuntime::start(crate::node_cmd::spec_from_config(&foreman, &kinds)?)
            .await
            .context("starting the foreman node")?;
        let shelf = BlobShelf::default();
        runtime.link.set_blob_server(Arc::new(shelf.clone()));
        let workers = Cluster::start(&topology, &workdir, configs[1..].to_vec(), Launch::logged(exe))?.0;
        Ok(LocalCluster { runtime, shelf, workers: std::sync::Mutex::new(workers) })
    }

    /// Runs one job over the workers.
    pub async fn run(
        &self,
        job: PipelineJob,
        settings: ShellSettings,
        progress: Option<mpsc::UnboundedSender<Progress>>,
    ) -> Result<JobOutcome> {
        let membership = self.runtime.subscribe_membership();
        Ok(run_pipeline_job(&self.runtime.actors, &self.shelf, membership, job, settings, progress).await?)
    }

    /// The launcher's workers, locked (a poisoned lock still holds them).
    fn workers(&self) -> std::sync::MutexGuard<'_, Cluster> {
        self.workers.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// OS process ids of the workers (their latest processes), by node name.
    pub fn pids(&self) -> Vec<(String, Option<u32>)> {
        self.workers().children.iter().map(|(n, c)| (n.clone(), c.id())).collect()
    }

    /// Peak RSS (`VmHWM` from `/proc/<pid>/status`) of each worker process, bytes.
    pub fn peak_rss(&self) -> Vec<(String, Option<u64>)> {
        self.pids().into_iter().map(|(n, pid)| (n, pid.and_then(peak_rss_of))).collect()
    }

    /// Resets each worker's peak RSS (`VmHWM`) to its current RSS by writing `5` to
    /// `/proc/<pid>/clear_refs` (Linux); returns how many were reset.
    pub fn reset_peak_rss(&self) -> usize {
        self.pids()
            .into_iter()
            .filter_map(|(_, pid)| pid)
            .filter(|pid| std::fs::write(format!("/proc/{pid}/clear_refs"), "5").is_ok())
            .count()
    }

    /// Kills a worker (its latest incarnation, if it was restarted) with SIGKILL, as
    /// `kill -9 PID` does, and returns once the process is gone (its ports are free, so it
    /// may be started again at once).
    pub fn kill9(&self, name: &str) -> Result<()> {
        let pid =
            self.workers().start_kill9(name).with_context(|| format!("no running worker named {name}"))?;
        // dead once it is a zombie (not reaped: its Child is waited for at shutdown) or gone
        let dead = || {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .map_or(true, |s| s.rsplit_once(')').is_some_and(|(_, r)| r.trim_start().starts_with('Z')))
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !dead() {
            if std::time::Instant::now() > deadline {
                bail!("kill -9 {pid} ({name}): still running after 10 s");
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        Ok(())
    }

    /// Starts worker `name` again (after [`LocalCluster::kill9`]) with its config and identity;
    /// its log is appended to.
    pub fn restart(&self, name: &str) -> Result<()> {
        self.workers().restart(name).with_context(|| format!("restarting worker {name}"))
    }

    /// Stops the workers (SIGINT, then SIGKILL after 3 s) and the foreman node.
    pub async fn shutdown(self) {
        let mut workers = self.workers.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner);
        workers.stop_all().await;
        self.runtime.shutdown().await;
    }
}

/// Loads `model` in this process, runs it once on a MiniLM-shaped input, and returns JSON with
/// the process's peak RSS and the session's own RSS growth.
pub fn probe_rss(model: &Path, mapped: bool) -> Result<String> {
    let mut session = if mapped {
        OnnxSession::from_file_mapped(model, &SessionConfig::default())?
    } else {
        OnnxSession::from_file(model, &SessionConfig::default())?
    };
    let sentence = "A man is eating a piece of bread while the sun sets over the quiet harbour.".to_string();
    let mut inputs: Vec<NamedTensor> = super::tokenize(&[sentence])?.into_iter().next().unwrap_or_default();
    let seq = inputs.first().map_or(1, |t| t.shape.get(1).copied().unwrap_or(1));
    for spec in session.inputs().to_vec() {
        if inputs.iter().any(|t| t.name == spec.name) {
            continue;
        }
        let shape: Vec<usize> = spec
            .dims
            .iter()
            .enumerate()
            .map(|(axis, d)| d.map_or(if axis == 0 { 1 } else { seq }, |v| v as usize))
            .collect();
        let n = shape.iter().product();
        inputs.push(NamedTensor::f32(spec.name.clone(), shape, vec![0.1; n]));
    }
    inputs.retain(|t| session.inputs().iter().any(|s| s.name == t.name));
    session.run(&inputs)?;
    let session_rss = session.memory().resident_bytes().unwrap_or(0);
    let peak = peak_resident_bytes().unwrap_or(0);
    Ok(serde_json::json!({ "peak_rss_bytes": peak, "session_rss_bytes": session_rss }).to_string())
}

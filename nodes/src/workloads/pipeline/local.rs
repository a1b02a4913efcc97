//! A local pipeline cluster: the foreman runs in this process (its own node runtime), each worker
//! is a separate `troupe node` process on loopback, so every worker's RSS is its own and can be
//! read from the OS, and a worker can be killed for real.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;
use troupe_actors::NodeRuntime;
use troupe_actors::pipeline::telemetry::peak_rss_of;
use troupe_actors::pipeline::{
    BlobShelf, JobOutcome, PipelineJob, Progress, ShellSettings, run_pipeline_job,
};
use troupe_kernels::onnx::{NamedTensor, OnnxSession, SessionConfig, peak_resident_bytes};

use crate::config::{
    ActorConfig, MembershipSection, NodeConfig, PeerConfig, SupervisionSection, TransportSection,
};
use crate::up::{ensure_keys, free_ports};

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
    /// Enforce the RAM budget with a cgroup v1 memory limit.
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

/// A running local cluster.
pub struct LocalCluster {
    runtime: NodeRuntime,
    shelf: BlobShelf,
    children: Vec<(String, Child)>,
    exe: std::path::PathBuf,
    workdir: std::path::PathBuf,
    /// Workers started again by [`LocalCluster::restart`] (stopped at shutdown too).
    restarted: std::sync::Mutex<Vec<Child>>,
}

fn membership() -> MembershipSection {
    MembershipSection { heartbeat_ms: 200, timeout_ms: 2000 }
}

impl LocalCluster {
    /// Starts the foreman node here and one `exe node` process per worker.
    pub async fn start(exe: &Path, workdir: &Path, workers: &[WorkerSpec]) -> Result<Self> {
        std::fs::create_dir_all(workdir).with_context(|| format!("creating {}", workdir.display()))?;
        let workdir = workdir.canonicalize()?;
        let keys = workdir.join("keys");
        use troupe_transport::{Role, RoleSet};
        let mut names: Vec<(&str, RoleSet)> = vec![(FOREMAN, RoleSet::only(Role::Scheduler))];
        names.extend(workers.iter().map(|w| (w.name.as_str(), RoleSet::only(Role::Worker))));
        ensure_keys(&keys, "pipeline", &names)?;
        let ports = free_ports(workers.len() + 1)?;
        let addr = |i: usize| std::net::SocketAddr::from(([127, 0, 0, 1], ports[i]));
        let base = |name: &str, i: usize| NodeConfig {
            name: name.to_owned(),
            listen: addr(i),
            keys: keys.clone(),
            cookie: None,
            security: Default::default(),
            peers: Vec::new(),
            membership: membership(),
            supervision: SupervisionSection::default(),
            transport: TransportSection::default(),
            devices: Vec::new(),
            actors: Vec::new(),
            job: None,
            faults: Default::default(),
            metrics: Default::default(),
        };
        let foreman = base(FOREMAN, 0);
        let runtime = NodeRuntime::start(crate::node_cmd::spec_from_config(&foreman)?)
            .await
            .context("starting the foreman node")?;
        let shelf = BlobShelf::default();
        runtime.link.set_blob_server(Arc::new(shelf.clone()));
        let mut children = Vec::new();
        for (i, w) in workers.iter().enumerate() {
            let mut cfg = base(&w.name, i + 1);
            cfg.peers = vec![PeerConfig { name: FOREMAN.into(), addr: addr(0) }];
            let mut params = toml::Table::new();
            params.insert("ram_budget_mb".into(), toml::Value::Integer(i64::try_from(w.ram_budget_mb)?));
            params.insert("cpu_quota_pct".into(), toml::Value::Integer(i64::from(w.cpu_quota_pct)));
            params.insert("battery_pct".into(), toml::Value::Float(w.battery_pct));
            params.insert("enforce_ram_budget".into(), toml::Value::Boolean(w.enforce_ram_budget));
            params.insert("cache_dir".into(), toml::Value::String(w.cache_dir.display().to_string()));
            cfg.actors = vec![ActorConfig { kind: "pipeline-worker".into(), name: None, params }];
            cfg.validate().map_err(|(f, p)| anyhow::anyhow!("worker {}: {f}: {p}", w.name))?;
            let path = workdir.join(format!("{}.toml", w.name));
            std::fs::write(&path, toml::to_string_pretty(&cfg)?)?;
            let child = spawn_worker(exe, &path, &workdir.join(format!("{}.log", w.name)), false)
                .with_context(|| format!("starting worker {}", w.name))?;
            children.push((w.name.clone(), child));
        }
        Ok(LocalCluster {
            runtime,
            shelf,
            children,
            exe: exe.to_path_buf(),
            workdir,
            restarted: std::sync::Mutex::new(Vec::new()),
        })
    }

    /// Runs one job over the workers.
    pub async fn run(
        &self,
        job: PipelineJob,
        settings: ShellSettings,
        progress: Option<mpsc::UnboundedSender<Progress>>,
    ) -> Result<JobOutcome> {
        let membership = self.runtime.subscribe_membership();
        Ok(run_pipeline_job(
            &self.runtime.link,
            &self.runtime.services,
            &self.shelf,
            membership,
            job,
            settings,
            progress,
        )
        .await?)
    }

    /// OS process ids of the workers, by node name.
    pub fn pids(&self) -> Vec<(String, Option<u32>)> {
        self.children.iter().map(|(n, c)| (n.clone(), c.id())).collect()
    }

    /// Peak RSS (`VmHWM` from `/proc/<pid>/status`) of each worker process, bytes.
    pub fn peak_rss(&self) -> Vec<(String, Option<u64>)> {
        self.children.iter().map(|(n, c)| (n.clone(), c.id().and_then(peak_rss_of))).collect()
    }

    /// Resets each worker's peak RSS (`VmHWM`) to its current RSS by writing `5` to
    /// `/proc/<pid>/clear_refs` (Linux); returns how many were reset.
    pub fn reset_peak_rss(&self) -> usize {
        self.children
            .iter()
            .filter_map(|(_, c)| c.id())
            .filter(|pid| std::fs::write(format!("/proc/{pid}/clear_refs"), "5").is_ok())
            .count()
    }

    /// Kills a worker with SIGKILL, as `kill -9 PID` does.
    pub fn kill9(&self, name: &str) -> Result<()> {
        let Some(pid) = self.children.iter().find(|(n, _)| n == name).and_then(|(_, c)| c.id()) else {
            bail!("no running worker named {name}");
        };
        let pid = i32::try_from(pid)?;
        // SAFETY: signalling a child process we own; no memory is touched.
        if unsafe { libc::kill(pid, libc::SIGKILL) } != 0 {
            bail!("kill -9 {pid} ({name}): {}", std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Starts worker `name` again (after [`LocalCluster::kill9`]) with its config and identity;
    /// its log is appended to.
    pub fn restart(&self, name: &str) -> Result<()> {
        let path = self.workdir.join(format!("{name}.toml"));
        if !path.is_file() {
            bail!("no worker named {name}");
        }
        let child = spawn_worker(&self.exe, &path, &self.workdir.join(format!("{name}.log")), true)
            .with_context(|| format!("restarting worker {name}"))?;
        if let Ok(mut r) = self.restarted.lock() {
            r.push(child);
        }
        Ok(())
    }

    /// Stops the workers (SIGINT, then SIGKILL after 3 s) and the foreman node.
    pub async fn shutdown(mut self) {
        if let Ok(mut r) = self.restarted.lock() {
            let named = r.drain(..).map(|c| ("restarted".to_string(), c));
            self.children.extend(named);
        }
        for (_, child) in &mut self.children {
            if let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok()) {
                // SAFETY: signalling a child process we own; no memory is touched.
                unsafe {
                    libc::kill(pid, libc::SIGINT);
                }
            }
        }
        for (_, child) in &mut self.children {
            if tokio::time::timeout(Duration::from_secs(3), child.wait()).await.is_err() {
                let _ = child.kill().await;
            }
        }
        self.runtime.shutdown().await;
    }
}

/// Starts `troupe node --config CONFIG` with its output in `log` (appended to when `append`).
fn spawn_worker(exe: &Path, config: &Path, log: &Path, append: bool) -> Result<Child> {
    let log =
        std::fs::OpenOptions::new().create(true).append(append).write(true).truncate(!append).open(log)?;
    Ok(Command::new(exe)
        .arg("node")
        .arg("--config")
        .arg(config)
        .stdin(std::process::Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .kill_on_drop(true)
        .spawn()?)
}

/// Loads `model` in this process, runs it once on a MiniLM-shaped input, and returns JSON with
/// the process's peak RSS and the session's own RSS growth.
pub fn probe_rss(model: &Path) -> Result<String> {
    let mut session = OnnxSession::from_file(model, &SessionConfig::default())?;
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

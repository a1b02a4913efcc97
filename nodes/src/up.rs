//! `troupe up TOPOLOGY`: starts every node of a local topology as a separate OS process on
//! loopback (or, with `--netns`, each in its own network namespace: [`crate::netns`]), with
//! generated keys and configs, prefixes their logs with the node name, and tears
//! all of them down on ctrl-c or when the topology's job ends.
//!
//! Each node's full output (DEBUG included) goes to `WORKDIR/NAME.log`; the console shows what
//! a person reads: everything but DEBUG and TRACE lines (all of it when `RUST_LOG` is set), and,
//! on a terminal, a bar of jobs finished and one per job moved by its progress lines
//! ([`crate::progress`]).
//!
//! Idempotent: the CA and node certificates in the working folder are reused when present.

use std::net::{SocketAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde::Deserialize;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use troupe_actors::HostPort;
use troupe_transport::{ClusterCa, IssueOptions, NodeIdentity, Role, RoleSet};

use crate::config::{
    ActorConfig, DeviceConfig, FaultsSection, JobConfig, LinksSection, MembershipSection, MetricsSection,
    NodeConfig, PeerConfig, SupervisionSection, TransportSection,
};
use crate::kinds::Kinds;

/// Largest topology file read.
const MAX_TOPOLOGY_BYTES: u64 = 1 << 20;

/// A local topology: cluster-wide settings and the nodes.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Topology {
    /// Topology (and cluster) name.
    pub name: String,
    /// Heartbeats and failure detection for every node.
    #[serde(default)]
    pub membership: MembershipSection,
    /// Restart intensity for every node.
    #[serde(default)]
    pub supervision: SupervisionSection,
    /// Transport limits for every node.
    #[serde(default)]
    pub transport: TransportSection,
    /// Delay, jitter and loss on every link between two nodes (off by default; applied in user
    /// space by each node's transport, on loopback or across `--netns` namespaces alike).
    #[serde(default)]
    pub links: LinksSection,
    /// Set-up steps `troupe up` runs before starting nodes (each skipped when what it creates
    /// exists already, so `up` stays idempotent).
    #[serde(default)]
    pub prepare: Vec<PrepareStep>,
    /// The nodes, started in order.
    pub nodes: Vec<TopologyNode>,
}

/// One set-up step: a `troupe` subcommand and the file it creates.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrepareStep {
    /// Arguments to `troupe` (e.g. `["coe", "gen", "--scale", "ci"]`).
    pub run: Vec<String>,
    /// The step is skipped when this path exists.
    pub creates: PathBuf,
}

/// One node of a topology.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TopologyNode {
    /// Node name.
    pub name: String,
    /// Devices.
    #[serde(default)]
    pub devices: Vec<DeviceConfig>,
    /// Actors.
    #[serde(default)]
    pub actors: Vec<ActorConfig>,
    /// The job, if this node runs one; the topology ends when it ends.
    #[serde(default)]
    pub job: Option<JobConfig>,
    /// This node's fault switch (off by default).
    #[serde(default)]
    pub faults: FaultsSection,
    /// This node's metrics endpoint (off by default; loopback only).
    #[serde(default)]
    pub metrics: MetricsSection,
}

impl Topology {
    /// A topology named `name` with default settings and no nodes: for a [`Cluster`] whose
    /// processes are not nodes of a topology file (a benchmark's peer process).
    pub fn empty(name: &str) -> Self {
        Self {
            name: name.to_owned(),
            membership: MembershipSection::default(),
            supervision: SupervisionSection::default(),
            transport: TransportSection::default(),
            links: LinksSection::default(),
            prepare: Vec::new(),
            nodes: Vec::new(),
        }
    }

    /// Reads and parses a topology file, naming the file in every error.
    pub fn load(path: &Path) -> Result<Self> {
        let len = std::fs::metadata(path).with_context(|| format!("{}", path.display()))?.len();
        if len > MAX_TOPOLOGY_BYTES {
            bail!("{}: {len} bytes exceeds the {MAX_TOPOLOGY_BYTES}-byte cap", path.display());
        }
        let text = std::fs::read_to_string(path).with_context(|| format!("{}", path.display()))?;
        let t: Topology = toml::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {}", path.display(), e))?;
        if t.nodes.is_empty() {
            bail!("{}: nodes: a topology needs at least one node", path.display());
        }
        let mut names: Vec<&str> = t.nodes.iter().map(|n| n.name.as_str()).collect();
        names.sort_unstable();
        if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
            bail!("{}: nodes: the name {:?} is used twice", path.display(), w[0]);
        }
        Ok(t)
    }

    /// Full node configs on loopback: ports chosen, node `i` dials nodes `0..i` (each pair once).
    pub fn node_configs(&self, keys: &Path, ports: &[u16]) -> Vec<NodeConfig> {
        let addrs: Vec<SocketAddr> = ports.iter().map(|p| SocketAddr::from(([127, 0, 0, 1], *p))).collect();
        self.node_configs_at(keys, &addrs)
    }

    /// Full node configs with node `i` listening on `addrs[i]` (its namespace's address under
    /// `--netns`), node `i` dialing nodes `0..i` at theirs.
    pub fn node_configs_at(&self, keys: &Path, addrs: &[SocketAddr]) -> Vec<NodeConfig> {
        self.nodes
            .iter()
            .enumerate()
            .map(|(i, n)| NodeConfig {
                name: n.name.clone(),
                listen: addrs[i],
                keys: keys.to_path_buf(),
                cookie: None,
                security: crate::config::SecuritySection {
                    revoked: Some(keys.join(REVOKED_FILE)),
                    peers_only: false,
                },
                peers: self.nodes[..i]
                    .iter()
                    .zip(addrs)
                    .map(|(p, a)| PeerConfig { name: p.name.clone(), addr: (*a).into() })
                    .collect(),
                join: None,
                membership: self.membership,
                supervision: self.supervision,
                transport: self.transport,
                links: LinksSection { seed: self.links.seed.wrapping_add(i as u64), ..self.links },
                devices: n.devices.clone(),
                actors: n.actors.clone(),
                job: n.job.clone(),
                faults: n.faults.clone(),
                metrics: n.metrics,
            })
            .collect()
    }
}

/// The revocation list `troupe up` gives every node, in the keys folder.
pub const REVOKED_FILE: &str = "revoked.txt";
/// A certificate that expires sooner than this is issued again by [`ensure_keys`].
const RENEW_BEFORE: Duration = Duration::from_secs(86_400);

/// Makes the CA, the cookie, an empty revocation list and every node's certificate with its
/// roles (plus `admin` with the admin role), keeping what exists; a certificate whose roles
/// differ from `nodes` or that expires within a day is issued again.
pub fn ensure_keys(dir: &Path, cluster: &str, nodes: &[(&str, RoleSet)]) -> Result<()> {
    if !dir.join("ca.crt").exists() {
        ClusterCa::generate(cluster)?.write(dir)?;
    }
    troupe_transport::cookie::ensure_cookie(dir)?;
    let revoked = dir.join(REVOKED_FILE);
    if !revoked.exists() {
        std::fs::write(&revoked, "# one node name or serial:HEX per line; SIGHUP the nodes after editing\n")
            .with_context(|| format!("writing {}", revoked.display()))?;
    }
    let ca = ClusterCa::load(dir)?;
    let admin = ("admin", RoleSet::only(Role::Admin));
    for &(name, roles) in nodes.iter().chain(std::iter::once(&admin)) {
        let current = NodeIdentity::load(dir, name).ok().and_then(|i| i.info());
        let fresh = current
            .is_some_and(|c| c.roles == roles && c.not_after > std::time::SystemTime::now() + RENEW_BEFORE);
        if !fresh {
            ca.issue(name, &IssueOptions::new(roles)?)?.write(dir)?;
        }
    }
    Ok(())
}

/// Free UDP ports on loopback (bound then released; a rare race with other programs is possible).
pub fn free_ports(n: usize) -> Result<Vec<u16>> {
    let sockets: Vec<UdpSocket> = (0..n).map(|_| UdpSocket::bind("127.0.0.1:0")).collect::<Result<_, _>>()?;
    Ok(sockets.iter().map(|s| s.local_addr().map(|a| a.port())).collect::<Result<_, _>>()?)
}

/// Writes the configs of a topology into `workdir` and returns their paths.
pub fn prepare(topology: &Topology, workdir: &Path) -> Result<Vec<(String, PathBuf)>> {
    prepare_with(topology, workdir, |_| None)
}

/// [`prepare`], with the roles of a node whose work runs in the launching process instead (such
/// as a benchmark's in-process foreman): `roles(node)` overrides what the node's actors and job
/// would give it. Every local cluster (`troupe up`, `pipeline submit`, the benches, the tests)
/// gets its keys, ports and configs from here.
pub fn prepare_with(
    topology: &Topology,
    workdir: &Path,
    roles: impl Fn(&TopologyNode) -> Option<RoleSet>,
) -> Result<Vec<(String, PathBuf)>> {
    prepare_at(topology, workdir, &Kinds::builtin(), roles, None, None)
}

/// [`prepare_with`], with the configs checked and roles issued from `kinds`, the nodes' listen
/// addresses given (`--netns`: one per namespace) instead of free loopback ports; with `seed`,
/// every node but the first lists no peers and joins through the seed (the first node's address
/// by host name) instead.
pub fn prepare_at(
    topology: &Topology,
    workdir: &Path,
    kinds: &Kinds,
    roles: impl Fn(&TopologyNode) -> Option<RoleSet>,
    addrs: Option<Vec<SocketAddr>>,
    seed: Option<HostPort>,
) -> Result<Vec<(String, PathBuf)>> {
    std::fs::create_dir_all(workdir).with_context(|| format!("creating {}", workdir.display()))?;
    let keys = workdir.join("keys");
    let nodes: Vec<(&str, RoleSet)> = topology
        .nodes
        .iter()
        .map(|n| {
            let r = roles(n).unwrap_or_else(|| kinds.roles_for(&n.actors, n.job.as_ref()));
            (n.name.as_str(), r)
        })
        .collect();
    ensure_keys(&keys, &topology.name, &nodes)?;
    let keys = keys.canonicalize()?;
    let configs = match addrs {
        Some(addrs) if addrs.len() == topology.nodes.len() => topology.node_configs_at(&keys, &addrs),
        Some(addrs) => bail!("{} addresses for {} nodes", addrs.len(), topology.nodes.len()),
        None => topology.node_configs(&keys, &free_ports(topology.nodes.len())?),
    };
    let mut out = Vec::new();
    for (i, mut cfg) in configs.into_iter().enumerate() {
        if let Some(seed) = seed.as_ref().filter(|_| i > 0) {
            cfg.peers.clear();
            cfg.join = Some(seed.clone());
        }
        cfg.validate(kinds).map_err(|(f, p)| anyhow::anyhow!("node {}: {f}: {p}", cfg.name))?;
        let path = workdir.join(format!("{}.toml", cfg.name));
        std::fs::write(&path, toml::to_string_pretty(&cfg)?)
            .with_context(|| format!("writing {}", path.display()))?;
        out.push((cfg.name.clone(), path));
    }
    Ok(out)
}

/// A job node reported its job's end: (node, succeeded).
pub type JobEnded = tokio::sync::mpsc::UnboundedSender<(String, bool)>;
/// Every line a node prints but DEBUG and TRACE ones: (node, line).
pub type NodeLines = tokio::sync::mpsc::UnboundedSender<(String, String)>;

/// The log filter `up` gives its nodes when `RUST_LOG` is not set: their files get DEBUG.
const NODE_LOG_FILTER: &str = "debug,ractor_cluster=error,ractor=warn,quinn=warn";

/// Where one node's output goes: its full log file, and the console (filtered or not).
#[derive(Clone)]
struct NodeOutput {
    name: String,
    prefix: String,
    file: Arc<std::sync::Mutex<std::fs::File>>,
    /// Whether DEBUG and TRACE lines are kept off the console.
    quiet_console: bool,
    /// Where the node's non-DEBUG lines are also sent, if anywhere.
    lines: Option<NodeLines>,
    /// A job node's bar, moved by the job's progress lines ([`job_progress`]).
    bar: Option<indicatif::ProgressBar>,
    /// Whether its lines are shown on the console at all (false: its log file and `lines` only).
    console: bool,
}

/// How a [`Cluster`] starts its nodes and where their output goes. `troupe up` and `troupe
/// chaos` take [`Launch::console`]; a program whose own output is the point (a benchmark's JSON,
/// the local pipeline cluster, a whole-cluster test) takes [`Launch::logged`] and sets the fields
/// it needs on top.
#[derive(Clone, Debug)]
pub struct Launch {
    /// The program each node is started with.
    pub binary: NodeBinary,
    /// Whether the nodes' lines are shown on the console, prefixed with their names, with a bar
    /// per job (false: their log files only).
    pub console: bool,
    /// Where each node's non-DEBUG lines are also sent, as they are printed.
    pub lines: Option<NodeLines>,
    /// (node, network namespace) of nodes started inside one (`ip netns exec NS troupe node ...`).
    pub namespaces: Vec<(String, String)>,
    /// Whether job nodes get `--linger`: they keep serving after their job, as under `troupe up`
    /// (false: a job node's process ends with its job).
    pub linger: bool,
    /// Nodes not started with the others: each is started later by [`Cluster::restart`] (a node
    /// that joins late).
    pub held: Vec<String>,
    /// `RUST_LOG` for every node. `None`: on the console, DEBUG into the files
    /// (`NODE_LOG_FILTER`) unless `RUST_LOG` is set; otherwise the launcher's environment.
    pub log_filter: Option<String>,
}

impl Launch {
    /// `troupe up`'s way: lines on the console (and on `lines`), job nodes lingering.
    pub fn console(binary: NodeBinary, lines: Option<NodeLines>) -> Self {
        Self {
            binary,
            console: true,
            lines,
            namespaces: Vec::new(),
            linger: true,
            held: Vec::new(),
            log_filter: None,
        }
    }

    /// `troupe node` of `exe` with each node's output in its log file only, nothing on the
    /// console; the node writes the file itself unless `lines` is set (then its output passes
    /// through this process). Job nodes end with their job.
    pub fn logged(exe: &Path) -> Self {
        Self { console: false, linger: false, ..Self::console(NodeBinary::troupe_at(exe), None) }
    }

    /// Whether node output passes through this process (to the console or to `lines`).
    fn piped(&self) -> bool {
        self.console || self.lines.is_some()
    }
}

/// The node processes of one topology run on loopback (or in network namespaces): started from
/// their configs as [`Launch`] says, each one's full output in `WORKDIR/NAME.log`. Every local
/// cluster runs its nodes through this: `troupe up`, `troupe chaos`, the local pipeline cluster
/// (`pipeline submit`, the pipeline benches and tests) and the whole-cluster tests.
pub struct Cluster {
    launch: Launch,
    workdir: PathBuf,
    width: usize,
    configs: Vec<(String, PathBuf)>,
    /// The running (or exited) node processes, in start order.
    pub children: Vec<(String, Child)>,
    /// Nodes whose config has a job.
    pub job_nodes: Vec<String>,
    jobs: JobEnded,
    /// Each job node's progress bar (kept across restarts).
    bars: Vec<(String, indicatif::ProgressBar)>,
    /// Processes a [`Cluster::restart`] replaced (a node restarted while its old process still
    /// ran keeps it running, as a second `troupe node` started by hand would): stopped with
    /// the rest.
    replaced: Vec<(String, Child)>,
}

impl Cluster {
    /// Starts the nodes of `configs` (from [`prepare`]; a node of `topology` left out of them
    /// runs elsewhere, such as in the launching process) in order, but those `launch` holds
    /// back. A job node's end arrives on the returned receiver when its output is piped
    /// (on the console or to `lines`).
    pub fn start(
        topology: &Topology,
        workdir: &Path,
        configs: Vec<(String, PathBuf)>,
        launch: Launch,
    ) -> Result<(Self, tokio::sync::mpsc::UnboundedReceiver<(String, bool)>)> {
        let (jobs, jobs_rx) = tokio::sync::mpsc::unbounded_channel();
        let console = launch.console;
        let mut cluster = Self {
            workdir: workdir.to_path_buf(),
            width: configs.iter().map(|(n, _)| n.len()).max().unwrap_or(4),
            job_nodes: topology.nodes.iter().filter(|n| n.job.is_some()).map(|n| n.name.clone()).collect(),
            configs,
            children: Vec::new(),
            jobs,
            bars: Vec::new(),
            replaced: Vec::new(),
            launch,
        };
        for node in topology.nodes.iter().filter(|_| console) {
            if let Some(job) = &node.job {
                let bar = crate::progress::spinner(&format!("{} {}", node.name, job.kind));
                cluster.bars.push((node.name.clone(), bar));
            }
        }
        for i in 0..cluster.configs.len() {
            let name = cluster.configs[i].0.clone();
            if cluster.launch.held.contains(&name) {
                continue;
            }
            let child = cluster.spawn(&name, false)?;
            cluster.children.push((name.clone(), child));
            if console {
                crate::progress::println(format!(
                    "[up] {name}: full log in {}",
                    cluster.log_path(&name).display()
                ));
            }
        }
        Ok((cluster, jobs_rx))
    }

    /// The full log of node `name`.
    pub fn log_path(&self, name: &str) -> PathBuf {
        self.workdir.join(format!("{name}.log"))
    }

    /// Starts `troupe node --config CONFIG` for `name` (its log appended to when `append`).
    fn spawn(&self, name: &str, append: bool) -> Result<Child> {
        let config = &self.configs.iter().find(|(n, _)| n == name).context("no such node")?.1;
        let log = self.log_path(name);
        if !append {
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        }
        // appending: a node writing the file itself never overwrites what another process of it
        // (an earlier one still running) wrote
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .with_context(|| format!("opening {}", log.display()))?;
        let launch = &self.launch;
        let mut cmd = match launch.namespaces.iter().find(|(n, _)| n == name) {
            // `ip netns exec` execs the node in place: the child's pid is the node's
            Some((_, ns)) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns.as_str()]).arg(&launch.binary.exe);
                c
            }
            None => Command::new(&launch.binary.exe),
        };
        let quiet_console = std::env::var_os("RUST_LOG").is_none();
        match &launch.log_filter {
            Some(filter) => {
                cmd.env("RUST_LOG", filter);
            }
            // a node logged to its file only keeps its own default filter, as when run by hand
            None if quiet_console && launch.console => {
                cmd.env("RUST_LOG", NODE_LOG_FILTER);
            }
            None => {}
        }
        cmd.args(&launch.binary.node_command).arg("--config").arg(config);
        let job = self.job_nodes.iter().any(|n| n == name);
        if job && launch.linger {
            cmd.arg("--linger");
        }
        // piped: this process copies the lines into the file; otherwise the node writes there
        let (stdout, stderr, file) = if launch.piped() {
            (Stdio::piped(), Stdio::piped(), Some(file))
        } else {
            (
                file.try_clone().with_context(|| format!("opening {}", log.display()))?.into(),
                file.into(),
                None,
            )
        };
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting node {name}"))?;
        let Some(file) = file else {
            return Ok(child);
        };
        let width = self.width;
        let output = NodeOutput {
            name: name.to_owned(),
            prefix: format!("[{name:<width$}]"),
            file: Arc::new(std::sync::Mutex::new(file)),
            quiet_console,
            lines: launch.lines.clone(),
            bar: self.bars.iter().find(|(n, _)| n == name).map(|(_, b)| b.clone()),
            console: launch.console,
        };
        if let Some(out) = child.stdout.take() {
            let jobs = job.then(|| self.jobs.clone());
            tokio::spawn(prefix_lines(BufReader::new(out), output.clone(), false, jobs));
        }
        if let Some(err) = child.stderr.take() {
            tokio::spawn(prefix_lines(BufReader::new(err), output, true, None));
        }
        Ok(child)
    }

    fn child_mut(&mut self, name: &str) -> Result<&mut Child> {
        self.children
            .iter_mut()
            .find(|(n, _)| n == name)
            .map(|(_, c)| c)
            .with_context(|| format!("no node {name}"))
    }

    /// The OS process id of node `name`'s latest process, while it has not been reaped.
    pub fn pid(&self, name: &str) -> Option<u32> {
        self.children.iter().find(|(n, _)| n == name).and_then(|(_, c)| c.id())
    }

    /// Sends node `name` SIGKILL without waiting for it (it is reaped later); returns its pid.
    pub fn start_kill9(&mut self, name: &str) -> Result<u32> {
        let child = self.child_mut(name)?;
        let pid = child.id().with_context(|| format!("node {name} is not running"))?;
        child.start_kill().with_context(|| format!("killing {name}"))?;
        Ok(pid)
    }

    /// Sends node `name` signal `sig` (e.g. `libc::SIGHUP`, `libc::SIGTERM`).
    pub fn signal(&self, name: &str, sig: i32) -> Result<()> {
        let (_, child) =
            self.children.iter().find(|(n, _)| n == name).with_context(|| format!("no node {name}"))?;
        send_signal(child, sig).with_context(|| format!("signalling node {name}"))
    }

    /// Node `name`'s exit status once its latest process has exited (`None` while it runs).
    pub fn exited(&mut self, name: &str) -> Result<Option<std::process::ExitStatus>> {
        Ok(self.child_mut(name)?.try_wait()?)
    }

    /// Kills node `name` with SIGKILL (no chance to say goodbye) and reaps it.
    pub async fn kill9(&mut self, name: &str) -> Result<()> {
        let child = self.child_mut(name)?;
        child.kill().await.with_context(|| format!("killing {name}"))
    }

    /// Starts node `name` again from its config, appending to its log (or for the first time,
    /// when [`Launch::held`] kept it back).
    pub fn restart(&mut self, name: &str) -> Result<()> {
        let child = self.spawn(name, true)?;
        let Some((_, slot)) = self.children.iter_mut().find(|(n, _)| n == name) else {
            self.children.push((name.to_owned(), child));
            return Ok(());
        };
        let old = std::mem::replace(slot, child);
        self.replaced.retain_mut(|(_, c)| c.try_wait().ok().flatten().is_none());
        self.replaced.push((name.to_owned(), old));
        Ok(())
    }

    /// Stops every node: all are asked first (SIGINT), so none spends its last seconds
    /// reporting the others down, then each is killed if it has not stopped within 3 s.
    pub async fn stop_all(&mut self) {
        for (_, child) in self.children.iter().chain(&self.replaced) {
            interrupt(child);
        }
        for (name, child) in self.children.iter_mut().chain(&mut self.replaced) {
            if child.try_wait().ok().flatten().is_none() {
                stop_child(name, child).await;
            }
        }
    }
}

/// True for a `tracing` line at DEBUG or TRACE (`TIMESTAMP LEVEL message`, no colours: the
/// node's stderr is a pipe).
fn is_debug_line(line: &str) -> bool {
    matches!(line.split_whitespace().nth(1), Some("DEBUG" | "TRACE"))
}

async fn prefix_lines<R: tokio::io::AsyncRead + Unpin>(
    reader: BufReader<R>,
    out: NodeOutput,
    stderr: bool,
    jobs: Option<JobEnded>,
) {
    use std::io::Write as _;
    let mut lines = reader.lines();
    while let Ok(Some(line)) = lines.next_line().await {
        if let Ok(mut f) = out.file.lock() {
            // a full disk loses log lines, not the node
            let _ = writeln!(f, "{line}");
        }
        if let Some(tx) = &jobs
            && let Some(rest) = line.strip_prefix(crate::node_cmd::JOB_FINISHED)
        {
            if let Some(bar) = &out.bar {
                bar.finish_and_clear();
            }
            let _ = tx.send((out.name.clone(), rest.contains(" finished: ok")));
        }
        if let (Some(bar), Some((done, total))) = (&out.bar, job_progress(&line)) {
            crate::progress::set_total(bar, total);
            bar.set_position(done);
        }
        let debug = is_debug_line(&line);
        if let Some(tx) = &out.lines
            && !debug
        {
            let _ = tx.send((out.name.clone(), line.clone()));
        }
        if !out.console || (out.quiet_console && debug) {
            continue;
        }
        let prefix = &out.prefix;
        crate::progress::suspend(|| {
            if stderr {
                eprintln!("{prefix} {line}");
            } else {
                println!("{prefix} {line}");
            }
        });
    }
}

/// The (done, total) a job's progress line reports: `coe: serving N requests ...`, `coe:
/// completed K of N`, `pipeline: K of N inputs answered`, `pipeline: resuming ... K of N inputs
/// answered`. The lines are the jobs' own, printed for people and scripts alike.
fn job_progress(line: &str) -> Option<(u64, u64)> {
    let k_of_n = |s: &str| -> Option<(u64, u64)> {
        let (k, rest) = s.split_once(" of ")?;
        let n = rest.split_whitespace().next()?;
        Some((k.rsplit(' ').next()?.parse().ok()?, n.parse().ok()?))
    };
    if let Some(rest) = line.strip_prefix("coe: completed ") {
        return k_of_n(rest);
    }
    if let Some(rest) = line.strip_prefix("coe: serving ") {
        let (n, tail) = rest.split_once(' ')?;
        return tail.starts_with("requests through").then_some((0, n.parse().ok()?));
    }
    let rest = line.strip_prefix("pipeline: ")?;
    let head = rest.strip_suffix(" inputs answered")?;
    k_of_n(head.rsplit_once(": ").map_or(head, |(_, k)| k))
}

/// Sends a running child SIGINT, as ctrl-c does (one that has exited is left alone).
fn interrupt(child: &Child) {
    let _ = send_signal(child, libc::SIGINT);
}

/// Sends a child signal `sig`; an error when it has been reaped or `kill` fails.
fn send_signal(child: &Child, sig: i32) -> std::io::Result<()> {
    let pid = child.id().ok_or_else(|| std::io::Error::other("the process has exited"))?;
    let pid = i32::try_from(pid).map_err(std::io::Error::other)?;
    // SAFETY: sending a signal to a child process we own and have not reaped; no memory is touched.
    if unsafe { libc::kill(pid, sig) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Asks a child to stop (SIGINT, like ctrl-c), then kills it after a grace period.
pub async fn stop_child(name: &str, child: &mut Child) {
    interrupt(child);
    if tokio::time::timeout(Duration::from_secs(3), child.wait()).await.is_err() {
        eprintln!("[up] {name} did not stop within 3 s; killing it");
        let _ = child.kill().await;
    }
}

/// Runs the topology's set-up steps whose output is missing.
pub async fn prepare_steps(exe: &Path, steps: &[PrepareStep]) -> Result<()> {
    for step in steps {
        if step.creates.exists() {
            continue;
        }
        println!("[up] set-up: troupe {}", step.run.join(" "));
        let status = Command::new(exe).args(&step.run).status().await.context("running a set-up step")?;
        if !status.success() {
            bail!("set-up step `troupe {}` failed: {status}", step.run.join(" "));
        }
        if !step.creates.exists() {
            bail!("set-up step `troupe {}` did not create {}", step.run.join(" "), step.creates.display());
        }
    }
    Ok(())
}

/// The program `up` starts each node with, and the kinds its configs are checked against:
/// `troupe node` with the built-in kinds, or a user's own node binary ([`crate::NodeMain`]) with
/// theirs.
#[derive(Clone, Debug)]
pub struct NodeBinary {
    /// The executable.
    pub exe: PathBuf,
    /// What comes before `--config FILE` on its command line (`["node"]` for `troupe`).
    pub node_command: Vec<String>,
    /// The actor and job kinds it runs: configs are checked and roles issued from these.
    pub kinds: Kinds,
}

impl NodeBinary {
    /// This `troupe` binary (`troupe node`, the built-in kinds).
    pub fn troupe() -> Result<Self> {
        Ok(Self::troupe_at(&std::env::current_exe().context("locating the troupe binary")?))
    }

    /// The `troupe` binary at `exe` (`troupe node`, the built-in kinds).
    pub fn troupe_at(exe: &Path) -> Self {
        Self { exe: exe.to_path_buf(), node_command: vec!["node".into()], kinds: Kinds::builtin() }
    }

    /// This process's own binary, a user's node binary that runs a node as `BINARY --config FILE`
    /// and knows `kinds`.
    pub fn this_program(kinds: Kinds) -> Result<Self> {
        Ok(Self {
            exe: std::env::current_exe().context("locating this program's binary")?,
            node_command: Vec::new(),
            kinds,
        })
    }

    /// Whether this is `troupe` itself (which alone has the subcommands set-up steps run).
    fn is_troupe(&self) -> bool {
        self.node_command.first().is_some_and(|c| c == "node")
    }
}

/// Where `troupe up` puts its nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// Every node on loopback.
    Loopback,
    /// Every node in its own network namespace (see [`crate::netns`]).
    Netns,
    /// Only remove the namespaces a killed `--netns` run of the topology left behind.
    NetnsClean,
}

/// Runs `troupe up`.
pub async fn run(path: &Path, workdir: Option<PathBuf>, placement: Placement) -> Result<ExitCode> {
    run_with(path, workdir, placement, &NodeBinary::troupe()?).await
}

/// Runs `up` with the nodes started by `binary` (a user's node binary's `up` subcommand).
pub async fn run_with(
    path: &Path,
    workdir: Option<PathBuf>,
    placement: Placement,
    binary: &NodeBinary,
) -> Result<ExitCode> {
    let topology = Topology::load(path)?;
    let names: Vec<&str> = topology.nodes.iter().map(|n| n.name.as_str()).collect();
    let plan = match placement {
        Placement::Loopback => None,
        Placement::Netns | Placement::NetnsClean => Some(crate::netns::plan(&topology.name, &names)?),
    };
    if let (Placement::NetnsClean, Some(plan)) = (placement, &plan) {
        crate::netns::preflight()?;
        let removed = crate::netns::clean(plan)?;
        if removed.is_empty() {
            println!("[up] nothing of topology {} to remove", topology.name);
        }
        for r in removed {
            println!("[up] removed {r}");
        }
        return Ok(ExitCode::SUCCESS);
    }
    // namespaces first: where they are not permitted, fail before writing anything
    let namespaces = plan.map(crate::netns::Namespaces::create).transpose()?;
    if !topology.prepare.is_empty() && !binary.is_troupe() {
        bail!(
            "{}: prepare: set-up steps run `troupe` subcommands; run this topology with `troupe up`, or run its steps with troupe first and remove them",
            path.display()
        );
    }
    prepare_steps(&binary.exe, &topology.prepare).await?;
    let workdir = workdir.unwrap_or_else(|| PathBuf::from(".cache/up").join(&topology.name));
    let addrs = namespaces.as_ref().map(|n| n.plan.hosts.iter().map(crate::netns::NsHost::listen).collect());
    // namespaced nodes find each other as hosts do: by name, through one seed
    let seed = namespaces
        .as_ref()
        .and_then(|n| n.plan.hosts.first())
        .map(|h| HostPort::Name { host: h.hostname.clone(), port: crate::netns::NODE_PORT });
    let configs = prepare_at(&topology, &workdir, &binary.kinds, |_| None, addrs, seed)?;
    let placed = match &namespaces {
        None => "on loopback".to_string(),
        Some(n) => format!(
            "in network namespaces {}* on bridge {} ({}/24)",
            n.plan.prefix, n.plan.bridge, n.plan.bridge_addr
        ),
    };
    println!(
        "[up] topology {} : {} nodes {placed}, keys and configs in {}",
        topology.name,
        configs.len(),
        workdir.display()
    );
    let mut in_ns = Vec::new();
    if let Some(n) = &namespaces {
        for h in &n.plan.hosts {
            println!("[up] {}: namespace {}, host {}, address {}", h.node, h.ns, h.hostname, h.listen());
            in_ns.push((h.node.clone(), h.ns.clone()));
        }
    }
    let launch = Launch { namespaces: in_ns, ..Launch::console(binary.clone(), None) };
    let (mut cluster, mut jobs_rx) = Cluster::start(&topology, &workdir, configs, launch)?;
    let code = supervise(&mut cluster, &mut jobs_rx).await;
    cluster.stop_all().await;
    println!("[up] all nodes stopped");
    if let Some(n) = namespaces {
        let prefix = n.plan.prefix.clone();
        drop(n);
        println!("[up] removed namespaces {prefix}* and their bridge");
    }
    Ok(code)
}

/// The jobs of a topology run: which have ended, and how.
pub struct JobTracker {
    job_nodes: Vec<String>,
    /// Jobs that ended: (node, succeeded), in the order they ended.
    pub ended: Vec<(String, bool)>,
    /// Jobs ended of all.
    bar: indicatif::ProgressBar,
}

impl JobTracker {
    /// Tracks the jobs of `job_nodes`.
    pub fn new(job_nodes: &[String]) -> Self {
        let bar = crate::progress::bar(job_nodes.len() as u64, "jobs finished");
        Self { job_nodes: job_nodes.to_vec(), ended: Vec::new(), bar }
    }

    /// The job nodes whose job has not ended yet.
    pub fn pending(&self) -> Vec<&str> {
        self.job_nodes
            .iter()
            .filter(|n| !self.ended.iter().any(|(e, _)| e == *n))
            .map(String::as_str)
            .collect()
    }

    /// Records that the job on `name` ended (the first report counts).
    pub fn job_ended(&mut self, name: String, ok: bool) {
        if !self.ended.iter().any(|(n, _)| *n == name) {
            crate::progress::println(format!(
                "[up] job on {name} {}",
                if ok { "succeeded" } else { "failed" }
            ));
            self.ended.push((name, ok));
            self.bar.set_position(self.ended.len() as u64);
        }
    }

    /// Looks at the node processes: a job node that exited before reporting its job's end
    /// counts as a failed job. Returns the run's exit code once every job ended (success only
    /// if every job succeeded) or every node exited.
    pub fn check(&mut self, children: &mut [(String, Child)]) -> Option<ExitCode> {
        self.check_except(children, &[])
    }

    /// [`JobTracker::check`], with the nodes in `restarting` (killed on purpose, to be started
    /// again) not counted as exited.
    pub fn check_except(
        &mut self,
        children: &mut [(String, Child)],
        restarting: &[&str],
    ) -> Option<ExitCode> {
        let mut running = 0;
        for (name, child) in children.iter_mut() {
            if restarting.contains(&name.as_str()) {
                running += 1;
                continue;
            }
            match child.try_wait() {
                Ok(None) => running += 1,
                Ok(Some(status))
                    if self.job_nodes.contains(name) && !self.ended.iter().any(|(n, _)| n == name) =>
                {
                    crate::progress::println(format!(
                        "[up] job node {name} exited before its job ended: {status}"
                    ));
                    self.ended.push((name.clone(), false));
                    self.bar.set_position(self.ended.len() as u64);
                }
                Ok(Some(_)) | Err(_) => {}
            }
        }
        let over = (!self.job_nodes.is_empty() && self.ended.len() == self.job_nodes.len()) || running == 0;
        if over {
            self.bar.finish_and_clear();
        }
        if !self.job_nodes.is_empty() && self.ended.len() == self.job_nodes.len() {
            let failed: Vec<&str> =
                self.ended.iter().filter(|(_, ok)| !ok).map(|(n, _)| n.as_str()).collect();
            if failed.is_empty() {
                println!("[up] every job succeeded ({})", self.job_nodes.join(", "));
                return Some(ExitCode::SUCCESS);
            }
            println!("[up] jobs failed on {}", failed.join(", "));
            return Some(ExitCode::FAILURE);
        }
        if running == 0 {
            println!("[up] every node has exited");
            return Some(ExitCode::FAILURE);
        }
        None
    }
}

/// Exit code of a run interrupted before its jobs ended (128 + SIGINT, as shells report it).
pub const INTERRUPTED: u8 = 130;

/// Waits for ctrl-c, for every job to end (success only if every job succeeded; a job node that
/// exits before reporting its job's end counts as a failed job), or for every node to end.
async fn supervise(
    cluster: &mut Cluster,
    jobs: &mut tokio::sync::mpsc::UnboundedReceiver<(String, bool)>,
) -> ExitCode {
    let mut ticker = tokio::time::interval(Duration::from_millis(100));
    let mut tracker = JobTracker::new(&cluster.job_nodes);
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {
                let pending = tracker.pending();
                if pending.is_empty() {
                    crate::progress::println("[up] ctrl-c: stopping every node");
                    return ExitCode::SUCCESS;
                }
                // interrupted before its jobs ended: not a success (130, as shells report SIGINT)
                crate::progress::println(format!(
                    "[up] ctrl-c before the jobs on {} ended: stopping every node",
                    pending.join(", ")
                ));
                return ExitCode::from(INTERRUPTED);
            }
            Some((name, ok)) = jobs.recv() => tracker.job_ended(name, ok),
            _ = ticker.tick() => {}
        }
        if let Some(code) = tracker.check(&mut cluster.children) {
            return code;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{is_debug_line, job_progress};

    #[test]
    fn job_progress_lines_give_done_and_total() {
        assert_eq!(job_progress("coe: completed 50 of 300"), Some((50, 300)));
        assert_eq!(job_progress("coe: serving 300 requests through gpu0 on a, policy ours"), Some((0, 300)));
        assert_eq!(job_progress("pipeline: 10 of 24 inputs answered"), Some((10, 24)));
        assert_eq!(
            job_progress("pipeline: resuming from journal /j/x.journal: 7 of 24 inputs answered"),
            Some((7, 24))
        );
        assert_eq!(job_progress("coe: serving requests on 127.0.0.1:5 (at most 64 outstanding)"), None);
        assert_eq!(job_progress("pipeline: 24 inputs done in 1.5 s"), None);
        assert_eq!(job_progress("hello: done, 2 answers"), None);
    }

    #[test]
    fn debug_lines_are_told_apart_by_their_level_field() {
        assert!(is_debug_line("2026-01-01T00:00:00.000001Z DEBUG node=a peer=b: peer joined"));
        assert!(is_debug_line("2026-01-01T00:00:00.000001Z TRACE evicted"));
        assert!(!is_debug_line("2026-01-01T00:00:00.000001Z  INFO node up"));
        assert!(!is_debug_line("2026-01-01T00:00:00.000001Z  WARN member down"));
        assert!(!is_debug_line("hello: answer from expert-1 DEBUG"));
        assert!(!is_debug_line(""));
    }
}

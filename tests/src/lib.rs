//! Helpers for troupe's whole-cluster tests: a cluster of real `troupe node` processes on
//! loopback, started from a topology, queried over QUIC, killed and restarted. The processes are
//! started by `troupe up`'s launcher ([`troupe::up::Cluster`]), so they run under a tokio
//! runtime: the tests that use these are `#[tokio::test]`s.

pub mod pipeline;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use troupe::actors::node::query_status;
use troupe::actors::wire::NodeStatus;
use troupe::config::NodeConfig;
use troupe::transport::NodeIdentity;
use troupe::up::{Cluster, Launch, Topology, prepare};

/// The log filter of a [`ProcCluster`]'s nodes: INFO lines in their logs, which tests read.
const PROC_LOG_FILTER: &str = "info,ractor_cluster=error,ractor=warn,quinn=warn";
/// The log filter of a [`LineCluster`]'s nodes: warnings and the jobs' own lines.
const LINE_LOG_FILTER: &str = "warn";

/// One node of a [`ProcCluster`].
pub struct ProcNode {
    /// Node name.
    pub name: String,
    /// Its generated config file (read again on each start).
    pub config: PathBuf,
    /// Its parsed config (listen address, keys).
    pub parsed: NodeConfig,
}

/// A cluster of real node processes, each writing its output to its log file in [`Self::dir`].
pub struct ProcCluster {
    /// First, so its processes are killed (on drop) before their folder is removed.
    cluster: Cluster,
    dir: tempfile::TempDir,
    /// The nodes, in topology order.
    pub nodes: Vec<ProcNode>,
    admin: NodeIdentity,
}

impl ProcCluster {
    /// Writes `topology` (TOML text), generates keys and configs, starts every node.
    pub fn start(exe: &Path, topology: &str) -> Result<Self> {
        Self::start_with(topology, Launch::logged(exe))
    }

    /// Like [`ProcCluster::start`], with job nodes that linger after their job (`--linger`).
    pub fn start_lingering(exe: &Path, topology: &str) -> Result<Self> {
        Self::start_with(topology, Launch { linger: true, ..Launch::logged(exe) })
    }

    /// Like [`ProcCluster::start`], but the nodes named in `held` are not started: start each
    /// later with [`ProcCluster::restart`] (a node that joins late).
    pub fn start_holding(exe: &Path, topology: &str, held: &[&str]) -> Result<Self> {
        let held = held.iter().map(|h| h.to_string()).collect();
        Self::start_with(topology, Launch { held, ..Launch::logged(exe) })
    }

    fn start_with(topology: &str, launch: Launch) -> Result<Self> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("topology.toml");
        std::fs::write(&path, topology)?;
        let t = Topology::load(&path)?;
        let configs = prepare(&t, dir.path())?;
        let admin = NodeIdentity::load(&dir.path().join("keys"), "admin")?;
        let nodes = configs
            .iter()
            .map(|(name, config)| {
                let parsed = NodeConfig::load(config, &troupe::Kinds::builtin())?;
                Ok(ProcNode { name: name.clone(), config: config.clone(), parsed })
            })
            .collect::<Result<_>>()?;
        let launch = Launch { log_filter: Some(PROC_LOG_FILTER.into()), ..launch };
        let (cluster, _) = Cluster::start(&t, dir.path(), configs, launch)?;
        Ok(Self { cluster, dir, nodes, admin })
    }

    /// The working folder (keys, configs, logs).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    fn node(&self, name: &str) -> Result<&ProcNode> {
        self.nodes.iter().find(|n| n.name == name).with_context(|| format!("no node {name}"))
    }

    /// The OS process id of a running node.
    pub fn pid(&self, name: &str) -> Result<u32> {
        self.cluster.pid(name).with_context(|| format!("node {name} is not running"))
    }

    /// Sends SIGKILL to a node (no goodbye, like a power cut) and reaps it.
    pub async fn kill9(&mut self, name: &str) -> Result<()> {
        self.cluster.kill9(name).await
    }

    /// Sends signal `sig` (e.g. `libc::SIGHUP`) to a running node.
    pub fn signal(&self, name: &str, sig: i32) -> Result<()> {
        self.cluster.signal(name, sig)
    }

    /// Waits until the node's log has a line containing every one of `needles`; fails after
    /// `deadline` with the log. Returns the line.
    pub async fn wait_log(&self, name: &str, deadline: Duration, needles: &[&str]) -> Result<String> {
        let start = Instant::now();
        while start.elapsed() < deadline {
            if let Some(line) = self.log(name).lines().find(|l| needles.iter().all(|n| l.contains(n))) {
                return Ok(line.to_string());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        bail!("node {name}: no log line with {needles:?} within {deadline:?}\nlog:\n{}", self.log(name))
    }

    /// Starts a killed (or held back) node again with the same config and identity.
    pub fn restart(&mut self, name: &str) -> Result<()> {
        self.cluster.restart(name)
    }

    /// Whether a node process has exited, with its status.
    pub fn exited(&mut self, name: &str) -> Result<Option<std::process::ExitStatus>> {
        self.cluster.exited(name)
    }

    /// The node's log so far (for failure messages).
    pub fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.cluster.log_path(name)).unwrap_or_default()
    }

    /// Asks a node for its status over QUIC (as the `admin` identity).
    pub async fn status(&self, name: &str) -> Result<NodeStatus> {
        let listen = self.node(name)?.parsed.listen;
        Ok(query_status(&self.admin, listen, Duration::from_secs(3)).await?)
    }

    /// Polls a node's status until `pred` holds; fails after `deadline` with the last status and
    /// the node's log. Returns the status and how long it took.
    pub async fn wait_status(
        &self,
        name: &str,
        deadline: Duration,
        pred: impl Fn(&NodeStatus) -> bool,
    ) -> Result<(NodeStatus, Duration)> {
        let start = Instant::now();
        let mut last = None;
        while start.elapsed() < deadline {
            match self.status(name).await {
                Ok(s) if pred(&s) => return Ok((s, start.elapsed())),
                Ok(s) => last = Some(format!("{s:?}")),
                Err(e) => last = Some(e.to_string()),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        bail!("node {name}: condition not met within {deadline:?}; last: {last:?}\nlog:\n{}", self.log(name))
    }
}

/// True when `status` lists `member` with state `state` ("up", "down" or "left").
pub fn member_is(status: &NodeStatus, member: &str, state: &str) -> bool {
    status.members.iter().any(|m| m.name == member && m.status == state)
}

/// A cluster of real node processes whose output lines arrive as they are printed (`[name]
/// line`), so a test can act on what a node says (kill a node at the 50th completion, restart it
/// once it is reported down).
pub struct LineCluster {
    cluster: Cluster,
    rx: tokio::sync::mpsc::UnboundedReceiver<(String, String)>,
    /// Every line seen so far (for failure messages).
    pub log: Vec<String>,
}

impl LineCluster {
    /// Writes configs for `topology` into `workdir` and starts every node.
    pub fn start(exe: &Path, topology: &Path, workdir: &Path) -> Result<Self> {
        let t = Topology::load(topology)?;
        let configs = prepare(&t, workdir)?;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let launch =
            Launch { lines: Some(tx), log_filter: Some(LINE_LOG_FILTER.into()), ..Launch::logged(exe) };
        let (cluster, _) = Cluster::start(&t, workdir, configs, launch)?;
        Ok(Self { cluster, rx, log: Vec::new() })
    }

    /// Starts node `name` again with its config.
    pub fn restart(&mut self, name: &str) -> Result<()> {
        self.cluster.restart(name)
    }

    /// SIGKILL (no goodbye) and reap.
    pub async fn kill9(&mut self, name: &str) -> Result<()> {
        self.cluster.kill9(name).await?;
        self.log.push(format!("[test] killed {name} with SIGKILL"));
        Ok(())
    }

    /// Waits for the next line for which `pred` holds (recording every line); `None` once
    /// `within` has passed.
    pub async fn wait_line(&mut self, within: Duration, pred: impl Fn(&str) -> bool) -> Option<String> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let (name, line) = tokio::time::timeout_at(deadline, self.rx.recv()).await.ok()??;
            let line = format!("[{name}] {line}");
            self.log.push(line.clone());
            if pred(&line) {
                return Some(line);
            }
        }
    }

    /// Everything seen so far, one line each.
    pub fn text(&self) -> String {
        self.log.join("\n")
    }
}

/// Runs `exe args` to completion and returns its stdout and stderr; an error naming the command
/// and its output when it fails.
pub fn run_ok(exe: &Path, args: &[&str]) -> Result<String> {
    let out = Command::new(exe).args(args).output().with_context(|| format!("running {}", exe.display()))?;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if !out.status.success() {
        bail!("troupe {args:?} failed ({}):\n{text}", out.status);
    }
    Ok(text)
}

/// `exe coe gen --dir DIR ARGS...`, run once per build of `exe` and set of `args`, then copied
/// into `dir`. Generation trains every expert (about 16 CPU-seconds at ci scale on 2 cores) and
/// several tests here use the same app; each still gets its own copy to change. The generated app
/// lives beside the binary (`<target>/<profile>/coe-gen/<key>`), keyed by the binary's size and
/// modification time and by `args`, so a rebuilt binary generates afresh (the apps of its earlier
/// builds are removed then); the first caller generates under a file lock while the others wait.
pub fn coe_gen(exe: &Path, dir: &Path, args: &[&str]) -> Result<()> {
    use std::hash::{Hash, Hasher};
    let meta = std::fs::metadata(exe).with_context(|| format!("reading {}", exe.display()))?;
    let mut h = std::hash::DefaultHasher::new();
    (meta.len(), meta.modified().ok(), args).hash(&mut h);
    let root = exe.parent().context("the binary's folder")?.join("coe-gen");
    std::fs::create_dir_all(&root).with_context(|| format!("creating {}", root.display()))?;
    let key = format!("{:016x}", h.finish());
    let lock = std::fs::File::create(root.join(format!("{key}.lock")))?;
    lock.lock().context("locking the generated-app cache")?;
    let cached = root.join(&key);
    let done = root.join(format!("{key}.done"));
    if !done.exists() {
        // Apps of earlier builds of the binary are stale: they go, so the cache holds one build's.
        let built = meta.modified().ok();
        for entry in std::fs::read_dir(&root)?.flatten() {
            let older =
                entry.metadata().and_then(|m| m.modified()).ok().zip(built).is_some_and(|(m, b)| m < b);
            if older {
                let p = entry.path();
                let _ = if p.is_dir() { std::fs::remove_dir_all(&p) } else { std::fs::remove_file(&p) };
            }
        }
        let _ = std::fs::remove_dir_all(&cached);
        let cached_s = cached.to_str().context("a UTF-8 cache path")?;
        let gen_args: Vec<&str> =
            ["coe", "gen", "--dir", cached_s].into_iter().chain(args.iter().copied()).collect();
        run_ok(exe, &gen_args)?;
        std::fs::write(&done, b"")?;
    }
    copy_tree(&cached, dir)
}

/// Copies the folder `from` to `to` (files and subfolders).
fn copy_tree(from: &Path, to: &Path) -> Result<()> {
    std::fs::create_dir_all(to).with_context(|| format!("creating {}", to.display()))?;
    for entry in std::fs::read_dir(from).with_context(|| format!("reading {}", from.display()))? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_tree(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), &target)
                .with_context(|| format!("copying {} to {}", entry.path().display(), target.display()))?;
        }
    }
    Ok(())
}

/// The value of row `figure` in the summary table titled `title` that a job printed into `log`
/// (`troupe::summary`: `| figure | value |` rows below a `| title |` line; node-name prefixes
/// before the first `|`, as `troupe up` adds them, are skipped). `None` when there is no such
/// table or row.
pub fn summary_value(log: &str, title: &str, figure: &str) -> Option<String> {
    let is_title = |l: &str| l.split('|').nth(1).is_some_and(|cell| cell.trim() == title);
    let mut lines = log.lines().skip_while(|l| !is_title(l));
    lines.find_map(|l| {
        let cells: Vec<&str> = l.split('|').map(str::trim).collect();
        (cells.len() == 4 && cells[1] == figure).then(|| cells[2].to_owned())
    })
}

/// A coe results file (`request <id> digest <hex>` lines) as `(id, digest)` pairs.
pub fn parse_coe_results(text: &str) -> Result<Vec<(u64, String)>> {
    text.lines()
        .map(|l| {
            let t: Vec<&str> = l.split_whitespace().collect();
            match t.as_slice() {
                ["request", id, "digest", d] => {
                    Ok((id.parse().with_context(|| format!("bad id in {l:?}"))?, d.to_string()))
                }
                _ => bail!("bad results line {l:?}"),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::summary_value;

    #[test]
    fn summary_values_are_read_from_their_own_table_only() {
        let table = troupe::summary::Summary::new("coe job summary").row("requests answered", "300").render();
        let log: String = table.lines().map(|l| format!("[gateway] {l}\n")).collect();
        let log = format!("| requests answered | 7 |\n{log}");
        assert_eq!(summary_value(&log, "coe job summary", "requests answered").as_deref(), Some("300"));
        assert_eq!(summary_value(&log, "coe job summary", "p99"), None);
        assert_eq!(summary_value(&log, "pipeline job summary", "requests answered"), None);
    }
}

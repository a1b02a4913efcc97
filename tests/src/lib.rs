//! Helpers for troupe's whole-cluster tests: a cluster of real `troupe node` processes on
//! loopback, started from a topology, queried over QUIC, killed and restarted.

pub mod pipeline;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use troupe::actors::node::query_status;
use troupe::actors::wire::NodeStatus;
use troupe::config::NodeConfig;
use troupe::transport::NodeIdentity;
use troupe::up::{Topology, prepare};

/// One node process of a [`ProcCluster`].
pub struct ProcNode {
    /// Node name.
    pub name: String,
    /// Its generated config file.
    pub config: PathBuf,
    /// Its parsed config (listen address, keys).
    pub parsed: NodeConfig,
    /// The running process, if any.
    pub child: Option<Child>,
    /// Where its stderr goes.
    pub log: PathBuf,
}

/// A cluster of real node processes.
pub struct ProcCluster {
    dir: tempfile::TempDir,
    exe: PathBuf,
    /// The nodes, in topology order.
    pub nodes: Vec<ProcNode>,
    admin: NodeIdentity,
    /// Job nodes get `--linger` (they keep serving after their job, as under `troupe up`).
    linger: bool,
}

impl ProcCluster {
    /// Writes `topology` (TOML text), generates keys and configs, starts every node.
    pub fn start(exe: &Path, topology: &str) -> Result<Self> {
        Self::start_with(exe, topology, false)
    }

    /// Like [`ProcCluster::start`], with job nodes that linger after their job (`--linger`).
    pub fn start_lingering(exe: &Path, topology: &str) -> Result<Self> {
        Self::start_with(exe, topology, true)
    }

    /// Like [`ProcCluster::start`], but the nodes named in `held` are not started: start each
    /// later with [`ProcCluster::restart`] (a node that joins late).
    pub fn start_holding(exe: &Path, topology: &str, held: &[&str]) -> Result<Self> {
        Self::start_filtered(exe, topology, false, held)
    }

    fn start_with(exe: &Path, topology: &str, linger: bool) -> Result<Self> {
        Self::start_filtered(exe, topology, linger, &[])
    }

    fn start_filtered(exe: &Path, topology: &str, linger: bool, held: &[&str]) -> Result<Self> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("topology.toml");
        std::fs::write(&path, topology)?;
        let t = Topology::load(&path)?;
        let configs = prepare(&t, dir.path())?;
        let admin = NodeIdentity::load(&dir.path().join("keys"), "admin")?;
        let mut nodes = Vec::new();
        for (name, config) in configs {
            let parsed = NodeConfig::load(&config, &troupe::Kinds::builtin())?;
            let log = dir.path().join(format!("{name}.log"));
            nodes.push(ProcNode { name, config, parsed, child: None, log });
        }
        let mut c = Self { dir, exe: exe.to_path_buf(), nodes, admin, linger };
        for i in 0..c.nodes.len() {
            if !held.contains(&c.nodes[i].name.as_str()) {
                c.spawn(i)?;
            }
        }
        Ok(c)
    }

    /// The working folder (keys, configs, logs).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    fn index(&self, name: &str) -> Result<usize> {
        self.nodes.iter().position(|n| n.name == name).with_context(|| format!("no node {name}"))
    }

    fn spawn(&mut self, i: usize) -> Result<()> {
        let n = &mut self.nodes[i];
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&n.log)?;
        let mut cmd = Command::new(&self.exe);
        cmd.args(["node", "--config"]).arg(&n.config);
        if self.linger && n.parsed.job.is_some() {
            cmd.arg("--linger");
        }
        let child = cmd
            .env("RUST_LOG", "info,ractor_cluster=error,ractor=warn,quinn=warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting node {}", n.name))?;
        n.child = Some(child);
        Ok(())
    }

    /// Sends SIGKILL to a node (no goodbye, like a power cut) and reaps it.
    pub fn kill9(&mut self, name: &str) -> Result<()> {
        let i = self.index(name)?;
        if let Some(mut c) = self.nodes[i].child.take() {
            c.kill()?;
            c.wait()?;
        }
        Ok(())
    }

    /// Sends signal `sig` (e.g. `libc::SIGHUP`) to a running node.
    pub fn signal(&self, name: &str, sig: i32) -> Result<()> {
        let i = self.index(name)?;
        let child = self.nodes[i].child.as_ref().with_context(|| format!("node {name} is not running"))?;
        let pid = i32::try_from(child.id())?;
        // SAFETY: sends a signal to a child process this cluster started and has not reaped.
        if unsafe { libc::kill(pid, sig) } != 0 {
            bail!("kill({pid}, {sig}): {}", std::io::Error::last_os_error());
        }
        Ok(())
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
        let i = self.index(name)?;
        self.spawn(i)
    }

    /// Whether a node process has exited, with its status.
    pub fn exited(&mut self, name: &str) -> Result<Option<std::process::ExitStatus>> {
        let i = self.index(name)?;
        match self.nodes[i].child.as_mut() {
            Some(c) => Ok(c.try_wait()?),
            None => bail!("node {name} is not running"),
        }
    }

    /// The node's log so far (for failure messages).
    pub fn log(&self, name: &str) -> String {
        self.index(name)
            .ok()
            .and_then(|i| std::fs::read_to_string(&self.nodes[i].log).ok())
            .unwrap_or_default()
    }

    /// Asks a node for its status over QUIC (as the `admin` identity).
    pub async fn status(&self, name: &str) -> Result<NodeStatus> {
        let i = self.index(name)?;
        Ok(query_status(&self.admin, self.nodes[i].parsed.listen, Duration::from_secs(3)).await?)
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

impl Drop for ProcCluster {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            if let Some(mut c) = n.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

/// True when `status` lists `member` with state `state` ("up", "down" or "left").
pub fn member_is(status: &NodeStatus, member: &str, state: &str) -> bool {
    status.members.iter().any(|m| m.name == member && m.status == state)
}

/// A cluster of real node processes whose output lines arrive on a channel as they are printed
/// (`[name] line`), so a test can act on what a node says (kill a node at the 50th completion,
/// restart it once it is reported down).
pub struct LineCluster {
    exe: PathBuf,
    configs: Vec<(String, PathBuf)>,
    children: Vec<(String, Child)>,
    tx: std::sync::mpsc::Sender<String>,
    rx: std::sync::mpsc::Receiver<String>,
    /// Every line seen so far (for failure messages).
    pub log: Vec<String>,
}

impl LineCluster {
    /// Writes configs for `topology` into `workdir` and starts every node.
    pub fn start(exe: &Path, topology: &Path, workdir: &Path) -> Result<Self> {
        let t = Topology::load(topology)?;
        let configs = prepare(&t, workdir)?;
        let (tx, rx) = std::sync::mpsc::channel();
        let mut c = Self { exe: exe.to_path_buf(), configs, children: Vec::new(), tx, rx, log: Vec::new() };
        for name in c.configs.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>() {
            c.spawn(&name)?;
        }
        Ok(c)
    }

    /// Starts node `name` (again) with its config.
    pub fn spawn(&mut self, name: &str) -> Result<()> {
        let (_, cfg) =
            self.configs.iter().find(|(n, _)| n == name).with_context(|| format!("no node {name}"))?;
        let mut child = Command::new(&self.exe)
            .args(["node", "--config"])
            .arg(cfg)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting node {name}"))?;
        let pipes: [Option<Box<dyn std::io::Read + Send>>; 2] = [
            child.stdout.take().map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
            child.stderr.take().map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
        ];
        for pipe in pipes.into_iter().flatten() {
            let (tx, name) = (self.tx.clone(), name.to_string());
            std::thread::spawn(move || {
                use std::io::BufRead;
                for line in std::io::BufReader::new(pipe).lines().map_while(Result::ok) {
                    let _ = tx.send(format!("[{name}] {line}"));
                }
            });
        }
        self.children.retain(|(n, _)| n != name);
        self.children.push((name.to_string(), child));
        Ok(())
    }

    /// SIGKILL (no goodbye) and reap.
    pub fn kill9(&mut self, name: &str) -> Result<()> {
        let i = self
            .children
            .iter()
            .position(|(n, _)| n == name)
            .with_context(|| format!("{name} not running"))?;
        let (_, mut child) = self.children.remove(i);
        child.kill()?;
        child.wait()?;
        self.log.push(format!("[test] killed {name} with SIGKILL"));
        Ok(())
    }

    /// Waits for the next line for which `pred` holds (recording every line); `None` once
    /// `within` has passed or every process has closed its output.
    pub fn wait_line(&mut self, within: Duration, pred: impl Fn(&str) -> bool) -> Option<String> {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.checked_duration_since(Instant::now())?;
            match self.rx.recv_timeout(left) {
                Ok(line) => {
                    self.log.push(line.clone());
                    if pred(&line) {
                        return Some(line);
                    }
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => return None,
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return None,
            }
        }
    }

    /// Everything seen so far, one line each.
    pub fn text(&self) -> String {
        self.log.join("\n")
    }
}

impl Drop for LineCluster {
    fn drop(&mut self) {
        for (_, c) in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
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

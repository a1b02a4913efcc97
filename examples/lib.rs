//! Examples for troupe, each a program a user can copy (`cargo run -p troupe-examples --bin NAME`):
//!
//! - `embed`: one node in-process, a typed actor called through a local handle;
//! - `remote_counter`: a counter on one node process called by name from others, roles checked
//!   per message;
//! - `own_expert`: your own ONNX model served as an actor and called from another node process;
//! - `failover`: a child supervised across nodes, restarted on another worker when its node is
//!   killed, while a client's calls by name carry on;
//! - `my_node`: your own node binary, your actor kind beside troupe's built-in ones, each node
//!   run from a TOML config like `troupe node`.
//!
//! With no arguments each multi-node example runs its whole demo, starting itself as the node
//! processes; `tests/examples.rs` runs every one.

/// The demos' scaffolding (not what a user copies into a service): node processes started from
/// the example's own binary, read line by line, and a temporary folder for the throwaway keys.
pub mod demo {
    use std::future::Future;
    use std::path::PathBuf;
    use std::process::Stdio;
    use std::time::Duration;

    use anyhow::{Context, Result, bail, ensure};
    use tokio::io::{AsyncBufReadExt, BufReader, Lines};
    use tokio::process::{Child, ChildStdout, Command};

    /// How long a demo waits for a node's next line or its exit.
    pub const WAIT: Duration = Duration::from_secs(10);

    /// Runs `job`, unless stdin closes first (so no node outlives the demo that started it).
    pub async fn or_stdin_closed(job: impl Future<Output = Result<()>>) -> Result<()> {
        tokio::select! {
            done = job => done,
            () = stdin_closed() => bail!("stdin closed: stopping"),
        }
    }

    /// Resolves when stdin reaches its end: the demo closes it to stop a node (Ctrl-D by hand).
    pub async fn stdin_closed() {
        let (tx, rx) = tokio::sync::oneshot::channel();
        // a thread of its own: a blocking read must not hold up the runtime's shutdown
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink());
            let _ = tx.send(());
        });
        let _ = rx.await;
    }

    /// A node process of the demo, killed if it still runs when this is dropped.
    pub struct Node {
        name: String,
        /// The process.
        pub child: Child,
        lines: Lines<BufReader<ChildStdout>>,
    }

    impl Node {
        /// Starts this program again with `args` as the node `name`.
        pub fn spawn(name: &str, args: &[&str]) -> Result<Self> {
            let mut child = Command::new(std::env::current_exe()?)
                .args(args)
                .stdin(Stdio::piped()) // the node runs until we close it
                .stdout(Stdio::piped())
                .kill_on_drop(true)
                .spawn()
                .with_context(|| format!("starting node {name}"))?;
            let stdout = child.stdout.take().context("the node's stdout is piped")?;
            Ok(Self { name: name.into(), child, lines: BufReader::new(stdout).lines() })
        }

        /// The node's next line (echoed), if it prints one within [`WAIT`].
        pub async fn line(&mut self) -> Result<Option<String>> {
            let line = tokio::time::timeout(WAIT, self.lines.next_line())
                .await
                .with_context(|| format!("node {} printed nothing for {WAIT:?}", self.name))??;
            if let Some(line) = &line {
                println!("[{}] {line}", self.name);
            }
            Ok(line)
        }

        /// Reads lines until one starts with `prefix`, and returns the rest of it.
        pub async fn expect(&mut self, prefix: &str) -> Result<String> {
            loop {
                match self.line().await? {
                    Some(line) if line.starts_with(prefix) => return Ok(line[prefix.len()..].to_string()),
                    Some(_) => {}
                    None => bail!("node {} exited before printing {prefix:?}", self.name),
                }
            }
        }

        /// Closes the node's stdin, which stops it, then [`Node::wait`]s.
        pub async fn stop(mut self) -> Result<Vec<String>> {
            drop(self.child.stdin.take());
            self.wait().await
        }

        /// Sends the node SIGTERM (what systemd and docker stop a service with), then
        /// [`Node::wait`]s: a node binary leaves its cluster and exits 0.
        pub async fn terminate(self) -> Result<Vec<String>> {
            let pid = self.child.id().with_context(|| format!("node {} already exited", self.name))?;
            let pid = libc::pid_t::try_from(pid).context("a process id fits pid_t")?;
            // SAFETY: kill only sends a signal, to our own child, which has not been reaped yet
            // (it is reaped by `wait` below), so its id cannot belong to another process.
            if unsafe { libc::kill(pid, libc::SIGTERM) } != 0 {
                bail!("signalling node {}: {}", self.name, std::io::Error::last_os_error());
            }
            self.wait().await
        }

        /// Reads the rest of what the node prints until it exits, and checks that it succeeded.
        /// Returns every line read here.
        pub async fn wait(mut self) -> Result<Vec<String>> {
            let mut lines = Vec::new();
            while let Some(line) = self.line().await? {
                lines.push(line);
            }
            let status = tokio::time::timeout(WAIT, self.child.wait())
                .await
                .with_context(|| format!("node {} did not exit within {WAIT:?}", self.name))??;
            ensure!(status.success(), "node {} failed: {status}", self.name);
            Ok(lines)
        }
    }

    /// A directory removed when dropped.
    pub struct TempDir(pub PathBuf);

    impl TempDir {
        /// A fresh folder in the system's temp folder, named by `tag` and this process.
        pub fn new(tag: &str) -> Result<Self> {
            let dir = std::env::temp_dir().join(format!("troupe-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir); // left by an earlier process of the same id
            std::fs::create_dir_all(&dir)?;
            Ok(Self(dir))
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

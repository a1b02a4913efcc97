//! A node binary's `main`: `troupe node` and a user's own node binary (their actor kinds beside
//! troupe's) share it, so both take the same command line, config, keys, supervision, metrics,
//! status, SIGTERM handling and exit codes.
//!
//! ```no_run
//! use troupe::kinds::Kinds;
//! use troupe::node_main::NodeMain;
//!
//! fn main() -> std::process::ExitCode {
//!     NodeMain::new().kinds(Kinds::builtin()).run()
//! }
//! ```

use std::future::Future;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::Parser;
use serde::de::DeserializeOwned;
use troupe_actors::NodeRuntime;
use troupe_actors::supervisor::ChildSpec;
use troupe_transport::RoleSet;

use crate::config::{ActorConfig, JobConfig, NodeConfig};
use crate::kinds::{ActorKind, JobFuture, JobKind, Kinds, NodeContext};

/// Exit code of a node whose config cannot be used (a runtime failure exits 1).
pub const CONFIG_ERROR: u8 = 2;

/// The command line of a node: `troupe node ARGS`, or a user's node binary's own.
#[derive(clap::Args, Debug, Clone)]
pub struct NodeArgs {
    /// The node's config file.
    #[arg(long)]
    pub config: PathBuf,
    /// Once the node's job ends (reported as a `troupe-node: job KIND finished: ...` line),
    /// keep serving its actors until ctrl-c instead of exiting, so that one job's end does
    /// not take away actors another job still uses (`troupe up` passes it to job nodes).
    #[arg(long)]
    pub linger: bool,
    /// A member to join through (`IP:port` or `host:port`; overrides the config's `join`):
    /// the node learns the other members from it.
    #[arg(long)]
    pub join: Option<troupe_actors::HostPort>,
}

/// A user's node binary's command line: [`NodeArgs`] to run one node, or `up TOPOLOGY` to run a
/// local topology whose nodes are this binary.
#[derive(Parser, Debug)]
#[command(
    about = "Runs one troupe node from a TOML config, or a local topology of them (`up`).",
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
struct NodeCli {
    #[command(flatten)]
    node: Option<NodeArgs>,
    #[command(subcommand)]
    command: Option<NodeCommand>,
}

/// What a user's node binary was asked to do.
#[derive(Debug)]
enum Invocation {
    Node(NodeArgs),
    Up { topology: PathBuf, workdir: Option<PathBuf> },
}

impl NodeCli {
    /// Parses a command line: `up TOPOLOGY`, or a node's arguments (`--config` required).
    fn invocation<I: IntoIterator<Item = T>, T: Into<std::ffi::OsString> + Clone>(
        args: I,
    ) -> Result<Invocation, clap::Error> {
        use clap::CommandFactory;
        match Self::try_parse_from(args)? {
            Self { command: Some(NodeCommand::Up { topology, workdir }), .. } => {
                Ok(Invocation::Up { topology, workdir })
            }
            Self { node: Some(node), .. } => Ok(Invocation::Node(node)),
            Self { node: None, command: None } => Err(Self::command().error(
                clap::error::ErrorKind::MissingRequiredArgument,
                "--config FILE is required (or `up TOPOLOGY` to run a local topology)",
            )),
        }
    }
}

/// What a user's node binary does besides running one node.
#[derive(clap::Subcommand, Debug)]
enum NodeCommand {
    /// Runs a local topology (`troupe up`'s format) with every node a process of this binary, so
    /// its configs may name this binary's own actor and job kinds.
    Up {
        /// The topology file.
        topology: PathBuf,
        /// Working folder for keys and generated configs (default .cache/up/NAME).
        #[arg(long)]
        workdir: Option<PathBuf>,
    },
}

/// A node binary: the kinds it knows, and a `main` that runs one node of them from a config.
#[derive(Clone, Debug, Default)]
pub struct NodeMain {
    kinds: Kinds,
}

impl NodeMain {
    /// A node binary that knows no kinds yet (add [`Kinds::builtin`] for troupe's own).
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds every kind of `kinds` (a kind of the same name is replaced).
    pub fn kinds(mut self, kinds: Kinds) -> Self {
        self.kinds = self.kinds.extend(kinds);
        self
    }

    /// Adds the actor kind `name`, run by nodes whose certificates grant `roles`; `build` gets
    /// each `[[actors]]` entry's `params` parsed as `P` and returns its child specs.
    pub fn actor_kind<P: DeserializeOwned + 'static>(
        self,
        name: &str,
        roles: RoleSet,
        build: impl Fn(&NodeContext, &ActorConfig, P) -> Result<Vec<ChildSpec>> + Send + Sync + 'static,
    ) -> Self {
        self.add_actor(ActorKind::new(name, roles, build))
    }

    /// Adds an actor kind (with its checks, see [`ActorKind::check`]).
    pub fn add_actor<P: DeserializeOwned + 'static>(mut self, kind: ActorKind<P>) -> Self {
        self.kinds = self.kinds.add_actor(kind);
        self
    }

    /// Adds the job kind `name`, run by nodes whose certificates grant `roles`; `run` gets the
    /// node, the `[job]` entry and its `params` parsed as `P`, and runs the job to its end.
    pub fn job_kind<P: DeserializeOwned + 'static>(
        self,
        name: &str,
        roles: RoleSet,
        run: impl for<'a> Fn(&'a NodeRuntime, &'a NodeContext, &'a JobConfig, P) -> JobFuture<'a>
        + Send
        + Sync
        + 'static,
    ) -> Self {
        self.add_job(JobKind::new(name, roles, run))
    }

    /// Adds a job kind (with its checks, see [`JobKind::check`]).
    pub fn add_job<P: DeserializeOwned + 'static>(mut self, kind: JobKind<P>) -> Self {
        self.kinds = self.kinds.add_job(kind);
        self
    }

    /// The kinds this binary knows.
    pub fn known_kinds(&self) -> &Kinds {
        &self.kinds
    }

    /// The whole `main`: parses the command line (`--config FILE [--linger]`, or `up TOPOLOGY`),
    /// sets up logging and the async runtime, runs the node; exits 2 on a config error, 1 on a
    /// runtime failure. Make it the whole of `main`: before any thread starts it opts the process
    /// out of ONNX Runtime's telemetry ([`troupe_kernels::onnx::opt_out_of_telemetry`]).
    pub fn run(self) -> ExitCode {
        // SAFETY: `run` is the program's whole `main` (above): no other thread exists yet.
        #[cfg(feature = "onnx")]
        unsafe {
            troupe_kernels::onnx::opt_out_of_telemetry();
        }
        let invocation = NodeCli::invocation(std::env::args_os()).unwrap_or_else(|e| e.exit());
        init_logging();
        troupe_actors::allocator::fix_thresholds();
        match invocation {
            Invocation::Up { topology, workdir } => block_on(async move {
                let binary = crate::up::NodeBinary::this_program(self.kinds)?;
                crate::up::run_with(&topology, workdir, crate::up::Placement::Loopback, &binary).await
            }),
            Invocation::Node(args) => block_on(async move { self.run_args(args).await }),
        }
    }

    /// Runs one node from `args` on the current async runtime (`troupe node` calls this).
    pub async fn run_args(&self, args: NodeArgs) -> Result<ExitCode> {
        let cfg = match NodeConfig::load(&args.config, &self.kinds) {
            Ok(cfg) => NodeConfig { join: args.join.or(cfg.join), ..cfg },
            Err(e) => {
                eprintln!("{}: config error: {e:#}", program_name());
                return Ok(ExitCode::from(CONFIG_ERROR));
            }
        };
        crate::node_cmd::run(cfg, args.linger, &self.kinds).await.map(|_| ExitCode::SUCCESS)
    }
}

/// This program's file name, for error lines (`troupe` when it has none).
fn program_name() -> String {
    std::env::args_os()
        .next()
        .as_deref()
        .map(std::path::Path::new)
        .and_then(|p| p.file_name())
        .map_or_else(|| "troupe".into(), |n| n.to_string_lossy().into_owned())
}

/// Runs `command` on a multi-threaded runtime and turns its outcome into the process's exit code
/// (an error is printed and exits 1).
pub fn block_on(command: impl Future<Output = Result<ExitCode>> + Send + 'static) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("{}: cannot start the async runtime: {e}", program_name());
            return ExitCode::FAILURE;
        }
    };
    // the command runs on a worker, beside the actors it talks to: from `block_on`'s own thread
    // every reply would cost a cross-thread wake-up
    match runtime.block_on(runtime.spawn(command)) {
        Ok(Ok(code)) => code,
        Ok(Err(e)) => {
            eprintln!("{}: error: {e:#}", program_name());
            ExitCode::FAILURE
        }
        // a panic ends the process as it did from `block_on` (its message is already printed)
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(e) => {
            eprintln!("{}: the command's task failed: {e}", program_name());
            ExitCode::FAILURE
        }
    }
}

/// Logs to stderr with `RUST_LOG` (default: info, quiet dependencies), each line written with
/// any progress bars lifted off the terminal (see [`crate::progress`]).
pub fn init_logging() {
    init_logging_or("info,ractor_cluster=error,ractor=warn,quinn=warn");
}

/// [`init_logging`] with `default` as the filter when `RUST_LOG` is not set.
pub fn init_logging_or(default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(crate::progress::log_writer)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        .try_init();
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn the_node_command_line_takes_a_config_and_linger() {
        NodeCli::command().debug_assert();
        let Ok(Invocation::Node(node)) = NodeCli::invocation(["my_node", "--config", "n.toml", "--linger"])
        else {
            panic!("a node's arguments");
        };
        assert_eq!(node.config, PathBuf::from("n.toml"));
        assert!(node.linger);
        assert!(NodeCli::invocation(["my_node"]).is_err(), "--config is required");
        assert!(NodeCli::invocation(["my_node", "--linger"]).is_err(), "--config is required");
    }

    #[test]
    fn up_takes_a_topology_and_needs_no_config() {
        let Ok(Invocation::Up { topology, workdir }) = NodeCli::invocation(["my_node", "up", "t.toml"])
        else {
            panic!("up");
        };
        assert_eq!((topology, workdir), (PathBuf::from("t.toml"), None));
        assert!(NodeCli::invocation(["my_node", "--config", "n.toml", "up", "t.toml"]).is_err());
    }
}

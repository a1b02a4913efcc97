//! Command-line interface: `troupe keys | node | up | chaos | sim | status | dashboard | embed | bench`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use troupe_transport::identity::{DEFAULT_CA_DAYS, DEFAULT_NODE_DAYS};
use troupe_transport::{ClusterCa, IssueOptions, NodeIdentity, Revocations, Role, RoleSet, Validity};

/// troupe: an actor runtime for edge ML.
#[derive(Parser, Debug)]
#[command(name = "troupe", version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Cluster identity: a CA and node certificates.
    Keys {
        /// Keys subcommand.
        #[command(subcommand)]
        command: KeysCommand,
    },
    /// Runs one node from a TOML config.
    Node(troupe::node_main::NodeArgs),
    /// Starts every node of a local topology as its own process, on loopback or (`--netns`) each
    /// in its own network namespace.
    Up {
        /// The topology file (e.g. examples/hello.toml).
        topology: PathBuf,
        /// Working folder for keys and generated configs (default .cache/up/NAME).
        #[arg(long)]
        workdir: Option<PathBuf>,
        /// Gives each node its own network namespace and address (veth pairs on a bridge, made
        /// at start and removed at exit; needs root and iproute2).
        #[arg(long, conflicts_with = "netns_clean")]
        netns: bool,
        /// Only removes the namespaces and bridge a killed `--netns` run of this topology left.
        #[arg(long)]
        netns_clean: bool,
    },
    /// Runs a local topology fault-free, then again while killing (SIGKILL) and restarting any of
    /// its nodes (job nodes resume their jobs from their journals) and panicking its schedulers
    /// on a seeded schedule; reports each fault, how it was recovered, and whether every
    /// workload's outputs equal the fault-free run's.
    Chaos {
        /// The topology file (e.g. examples/campus.toml).
        topology: PathBuf,
        /// Seed of the fault schedule (the same seed gives the same schedule).
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// How many faults to inject.
        #[arg(long, default_value_t = 3)]
        faults: usize,
        /// Working folder for both runs and the report (default .cache/chaos/NAME).
        #[arg(long)]
        workdir: Option<PathBuf>,
    },
    /// The fault explorer (simulation only): runs seeds of a workload on the simulated cluster
    /// under seeded crashes, restarts, partitions and loss/delay bursts, checks every invariant,
    /// and prints seeds run, violations (each with the command that replays its seed), seeds per
    /// minute and events per second.
    Sim {
        /// Which workload: typed, coadapt, coe, pipeline (the last two build with onnx), or all.
        #[arg(long, default_value = "all")]
        workload: String,
        /// How many seeds.
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..))]
        seeds: u64,
        /// The first seed.
        #[arg(long, default_value_t = 0)]
        from: u64,
        /// Also writes the figures (`sim_seeds`, `sim_violations`, ...) as one JSON object here.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Asks a node for its members, actors and device budgets.
    Status {
        /// The node's address (`IP:port` or `host:port`).
        #[arg(long, value_parser = troupe::actors::address::parse_resolved)]
        node: SocketAddr,
        /// Keys folder holding the identity to connect with.
        #[arg(long, default_value = "keys")]
        keys: PathBuf,
        /// Which identity in the keys folder to use.
        #[arg(long = "as", default_value = "admin")]
        as_name: String,
        /// Prints one JSON object (node, members, actors, devices) instead of the text report.
        #[arg(long)]
        json: bool,
    },
    /// Serves a live cluster page (members up or down, actors, device budgets) pushed by
    /// server-sent events; loopback listen addresses only (the page has no authentication).
    Dashboard {
        /// A node to ask (repeat to ask several: their actors and devices are shown too).
        #[arg(long = "node", required = true, value_parser = troupe::actors::address::parse_resolved)]
        nodes: Vec<SocketAddr>,
        /// Keys folder holding the identity to connect with.
        #[arg(long, default_value = "keys")]
        keys: PathBuf,
        /// Which identity in the keys folder to use.
        #[arg(long = "as", default_value = "admin")]
        as_name: String,
        /// Where the page is served (loopback only; port 0 picks one, printed at start).
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: SocketAddr,
        /// Milliseconds between status polls.
        #[arg(long, default_value_t = 1000)]
        interval_ms: u64,
    },
    /// Sentence embeddings with all-MiniLM-L6-v2 on ONNX Runtime.
    Embed {
        /// Texts to embed.
        #[arg(required = true)]
        texts: Vec<String>,
    },
    /// CoE workload: generate the app, profile this machine, serve a trace.
    Coe {
        /// Coe subcommand.
        #[command(subcommand)]
        command: troupe::workloads::coe::CoeCommand,
    },
    /// The pipeline workload: submit a staged job, probe a model's RSS.
    Pipeline {
        /// Pipeline subcommand.
        #[command(subcommand)]
        command: troupe::workloads::pipeline::PipelineCommand,
    },
    /// Benchmarks: ratios measured in one run.
    Bench {
        /// Which benchmark.
        #[command(subcommand)]
        which: troupe_bench::BenchCommand,
    },
    /// The second process of `troupe bench transport` (started by it, not by hand).
    #[command(hide = true)]
    BenchPeer {
        /// Folder holding the CA and the peer's identity (`--config`, as the node launcher
        /// passes it).
        #[arg(long, alias = "config")]
        keys: PathBuf,
        /// Run as a placement host of this name instead (its identity in the keys folder).
        #[arg(long)]
        host: Option<String>,
    },
}

/// `troupe keys ...`.
#[derive(Subcommand, Debug)]
pub enum KeysCommand {
    /// Creates a cluster CA, the cluster cookie (a random secret) and an `admin` identity for
    /// `troupe status`.
    Init {
        /// Folder to write into.
        #[arg(long, default_value = "keys")]
        out: PathBuf,
        /// Cluster name written into the CA certificate.
        #[arg(long, default_value = "troupe")]
        cluster: String,
        /// Days the CA is valid.
        #[arg(long, default_value_t = DEFAULT_CA_DAYS)]
        days: u32,
    },
    /// Issues a node certificate signed by the cluster CA.
    Node {
        /// The node's name.
        name: String,
        /// Folder holding the CA.
        #[arg(long, default_value = "keys")]
        keys: PathBuf,
        /// Roles the certificate grants, comma-separated: built in scheduler, executor, worker,
        /// camera, edge, admin (an admin identity can query status but never join), client (may
        /// submit pipeline jobs and send coe requests, never joins), or your own actor kinds'
        /// roles (1-32 characters of a-z, 0-9 and '-', starting with a letter, e.g. `my-app`).
        #[arg(long, default_value = "")]
        role: String,
        /// Days the certificate is valid.
        #[arg(long, default_value_t = DEFAULT_NODE_DAYS)]
        days: u32,
    },
    /// Appends a node name or `serial:HEX` to a revocation list (then SIGHUP the nodes).
    Revoke {
        /// A node name, or `serial:HEX` for one certificate.
        entry: String,
        /// Folder holding the keys (the list defaults to `revoked.txt` there).
        #[arg(long, default_value = "keys")]
        keys: PathBuf,
        /// The revocation list to append to (default KEYS/revoked.txt).
        #[arg(long)]
        file: Option<PathBuf>,
    },
}

/// Exit code of `troupe node` when its config cannot be used (a runtime failure exits 1).
pub use troupe::node_main::CONFIG_ERROR;
/// Logs to stderr with `RUST_LOG` (shared with every node binary).
pub use troupe::node_main::init_logging;

/// Parses arguments, sets up logging and runs the command.
pub fn main() -> ExitCode {
    // SAFETY: first thing in the program's main, before any thread starts.
    unsafe { troupe_kernels::onnx::opt_out_of_telemetry() };
    let cli = Cli::parse();
    match cli.command {
        // the explorer's runs log every fault they inject; its own lines are the report
        Command::Sim { .. } => troupe::node_main::init_logging_or("error"),
        _ => init_logging(),
    }
    troupe_actors::allocator::fix_thresholds();
    troupe::node_main::block_on(run(cli))
}

async fn run(cli: Cli) -> Result<ExitCode> {
    match cli.command {
        Command::Keys { command } => keys(command).map(|_| ExitCode::SUCCESS),
        // a config that cannot be used exits 2, a node that failed while running 1
        Command::Node(args) => troupe::NodeMain::new().kinds(troupe::Kinds::builtin()).run_args(args).await,
        Command::Up { topology, workdir, netns, netns_clean } => {
            let placement = match (netns, netns_clean) {
                (_, true) => troupe::up::Placement::NetnsClean,
                (true, false) => troupe::up::Placement::Netns,
                (false, false) => troupe::up::Placement::Loopback,
            };
            troupe::up::run(&topology, workdir, placement).await
        }
        Command::Chaos { topology, seed, faults, workdir } => {
            troupe::chaos::run(&topology, seed, faults, workdir).await
        }
        Command::Sim { workload, seeds, from, json } => {
            tokio::task::spawn_blocking(move || troupe::sim::run(&workload, seeds, from, json.as_deref()))
                .await?
        }
        Command::Status { node, keys, as_name, json } => {
            let id = NodeIdentity::load(&keys, &as_name)
                .with_context(|| format!("loading identity {as_name} from {}", keys.display()))?;
            let status = troupe_actors::node::query_status(&id, node, Duration::from_secs(5)).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&troupe::status::json(&status))?);
            } else {
                print!("{}", troupe::status::render(&status));
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Dashboard { nodes, keys, as_name, listen, interval_ms } => {
            troupe::dashboard::check_listen(listen)?;
            let identity = NodeIdentity::load(&keys, &as_name)
                .with_context(|| format!("loading identity {as_name} from {}", keys.display()))?;
            let interval = Duration::from_millis(interval_ms.max(100));
            troupe::dashboard::run(troupe::dashboard::Options { nodes, identity, listen, interval }).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Embed { texts } => {
            let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
            let embeddings = troupe_kernels::onnx::embed(&refs)?;
            for (t, e) in texts.iter().zip(&embeddings) {
                let head: Vec<String> = e.iter().take(8).map(|x| format!("{x:+.4}")).collect();
                println!("{t:?}: dim {} [{} ...]", e.len(), head.join(", "));
            }
            if embeddings.len() > 1 {
                for i in 1..embeddings.len() {
                    let c = troupe_kernels::onnx::cosine(&embeddings[0], &embeddings[i]);
                    println!("cosine(text 1, text {}) = {c:.4}", i + 1);
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Coe { command } => tokio::task::spawn_blocking(move || troupe::workloads::coe::run(command))
            .await?
            .map(|_| ExitCode::SUCCESS),
        Command::Pipeline { command } => {
            troupe::workloads::pipeline::command(command).await.map(|_| ExitCode::SUCCESS)
        }
        Command::Bench { which } => troupe_bench::run(which).await.map(|_| ExitCode::SUCCESS),
        Command::BenchPeer { keys, host } => {
            troupe_bench::peer::run(&keys, host.as_deref()).await.map(|_| ExitCode::SUCCESS)
        }
    }
}

fn keys(cmd: KeysCommand) -> Result<()> {
    match cmd {
        KeysCommand::Init { out, cluster, days } => {
            let ca = ClusterCa::generate_with(&cluster, Validity::days_from_now(days)?)?;
            ca.write(&out)?;
            troupe_transport::cookie::ensure_cookie(&out)?;
            ca.issue("admin", &IssueOptions::new(RoleSet::only(Role::Admin))?)?.write(&out)?;
            println!("cluster CA ({days} days), cookie and the admin identity written to {}", out.display());
            println!("next: troupe keys node NAME --role ROLE --keys {}", out.display());
        }
        KeysCommand::Node { name, keys, role, days } => {
            let roles = RoleSet::parse_list(&role).context("--role")?;
            let ca = ClusterCa::load(&keys)?;
            let options = IssueOptions { roles, validity: Validity::days_from_now(days)? };
            ca.issue(&name, &options)?.write(&keys)?;
            println!(
                "{}/{name}.crt and {name}.key written (roles {roles}, {days} days, signed by the cluster CA)",
                keys.display()
            );
        }
        KeysCommand::Revoke { entry, keys, file } => {
            let file = file.unwrap_or_else(|| keys.join(troupe::up::REVOKED_FILE));
            Revocations::append(&file, &entry)?;
            println!("{entry} appended to {}; send SIGHUP to running nodes to apply it", file.display());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::{Cli, Command};

    #[test]
    fn the_command_line_is_well_formed_and_bench_coe_refuses_a_budget_outside_zero_one() {
        Cli::command().debug_assert();
        let e =
            Cli::try_parse_from(["troupe", "bench", "coe", "--device-budget", "0"]).unwrap_err().to_string();
        assert!(e.contains("(0, 1]"), "{e}");
        let e = Cli::try_parse_from(["troupe", "bench", "coe", "--requests", "0"]).unwrap_err().to_string();
        assert!(e.contains("--requests"), "{e}");
        let cli = Cli::try_parse_from(["troupe", "bench", "coe", "--scale", "paper", "--requests", "5000"])
            .unwrap();
        assert!(matches!(cli.command, Command::Bench { .. }), "{cli:?}");
        let cli = Cli::try_parse_from(["troupe", "bench-peer", "--keys", "k"]).unwrap();
        assert!(matches!(cli.command, Command::BenchPeer { .. }), "{cli:?}");
    }
}

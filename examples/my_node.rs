//! Your own node binary: troupe's built-in actor kinds plus one of yours, run from a TOML config
//! exactly as `troupe node` runs its own (keys, supervision, metrics, status, SIGTERM, exit 2 on
//! a bad config).
//!
//!     cargo run -p troupe-examples --bin my_node                      # the demo
//!     cargo run -p troupe-examples --bin my_node -- --config host.toml
//!     cargo run -p troupe-examples --bin my_node -- up examples/my_node.toml   # a local topology
//!
//! The binary registers an actor kind `my-counter` (a typed counter whose config entry takes
//! `params = { start = 5 }`) and a job kind `count-up` that finds a counter by name from another
//! node and adds to it. Such a config then names them like any built-in kind:
//!
//! ```toml
//! [[actors]]
//! kind = "my-counter"
//! name = "total"
//! params = { start = 5 }
//! ```
//!
//! With no arguments it runs the demo on this machine: it makes a throwaway cluster CA and node
//! certificates in a temporary directory, writes two node configs and starts itself as the two
//! nodes: `host` runs the counter `total` (and a built-in `hello-expert`), `ops` runs the job
//! `count-up`, which calls `total` through a typed handle and exits when done; the demo then
//! stops `host` with SIGTERM, as systemd would.

use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use serde::Deserialize;
use troupe::prelude::*;
use troupe::{Kinds, NodeMain};
use troupe_examples::demo::{Node, TempDir};

// ---- the actor: what a user writes ---------------------------------------------------------

/// Adds to the total and answers the new total. Only schedulers may send it.
#[derive(troupe::rkyv::Archive, troupe::rkyv::Serialize, troupe::rkyv::Deserialize)]
#[rkyv(crate = troupe::rkyv)]
pub struct Add(pub u64);

impl RemoteMessage for Add {
    const NAME: &'static str = "add";
    type Reply = u64;
}

/// Answers the total. Any member may send it.
#[derive(troupe::rkyv::Archive, troupe::rkyv::Serialize, troupe::rkyv::Deserialize)]
#[rkyv(crate = troupe::rkyv)]
pub struct Get;

impl RemoteMessage for Get {
    const NAME: &'static str = "get";
    type Reply = u64;
}

/// A running total.
pub struct Counter {
    total: u64,
}

impl TypedActor for Counter {
    const KIND: &'static str = "counter";
    /// The total it starts from.
    type Args = u64;

    fn protocol(p: &mut Protocol<Self>) {
        p.request::<Add>(Allow::role(Role::Scheduler)).request::<Get>(Allow::AnyMember);
    }

    async fn start(total: u64, cx: &ActorContext) -> Result<Self, ActorFailure> {
        println!("counter {} starts at {total}", cx.name);
        Ok(Counter { total })
    }
}

impl Handles<Add> for Counter {
    async fn handle(&mut self, Add(n): Add, _: &ActorContext) -> Result<u64, ActorFailure> {
        self.total =
            self.total.checked_add(n).ok_or_else(|| ActorFailure::msg("the total would overflow"))?;
        Ok(self.total)
    }
}

impl Handles<Get> for Counter {
    async fn handle(&mut self, _: Get, _: &ActorContext) -> Result<u64, ActorFailure> {
        Ok(self.total)
    }
}

// ---- the kinds: what a config may name -----------------------------------------------------

/// `params` of a `my-counter` entry, checked when the node loads its config (a bad value exits
/// 2, naming e.g. `actors[0].params.start`).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CounterParams {
    /// The total it starts from.
    pub start: u64,
}

/// `params` of the `count-up` job.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CountUp {
    /// The counter's registered name.
    pub counter: String,
    /// What to add to it, one call each.
    pub add: Vec<u64>,
}

/// The node binary: troupe's kinds and ours.
fn node_main() -> NodeMain {
    NodeMain::new()
        .kinds(Kinds::builtin())
        // started under the node's root supervisor, restarted from its params if it crashes
        .actor_kind("my-counter", RoleSet::only(Role::Executor), |ctx, entry, p: CounterParams| {
            Ok(vec![ctx.actors.child_spec::<Counter>(entry.actor_name(), p.start)?])
        })
        // the job node drives the work: it needs the role `add` asks for
        .job_kind("count-up", RoleSet::only(Role::Scheduler), |_, ctx, job, p: CountUp| {
            Box::pin(count_up(ctx.actors.clone(), Duration::from_secs(job.timeout_s), p))
        })
}

/// The `count-up` job: finds the counter by name (wherever it runs), reads it, adds, reads again.
async fn count_up(actors: Actors, wait: Duration, p: CountUp) -> Result<()> {
    let counter = actors.wait_for::<Counter>(&p.counter, wait).await?;
    println!("found {} on {}", p.counter, counter.node().context("a resolved handle names its node")?);
    println!("get -> {}", counter.call(Get, wait).await?);
    for n in p.add {
        println!("add {n} -> {}", counter.call(Add(n), wait).await?);
    }
    println!("get -> {}", counter.call(Get, wait).await?);
    Ok(())
}

fn main() -> ExitCode {
    if std::env::args_os().len() > 1 {
        // `my_node --config FILE [--linger]`: the same command line as `troupe node`; `my_node up
        // TOPOLOGY`: a local topology of my_node processes, like `troupe up`
        return node_main().run();
    }
    match tokio::runtime::Runtime::new().map_err(anyhow::Error::from).and_then(|rt| rt.block_on(demo())) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("my_node: demo failed: {e:#}");
            ExitCode::FAILURE
        }
    }
}

// ---- the demo: a throwaway cluster of processes ------------------------------------------------

async fn demo() -> Result<()> {
    let dir = TempDir::new("my-node")?;
    // in production: `troupe keys init` and `troupe keys node NAME --role ROLE`
    let ca = ClusterCa::generate("my-node-demo")?;
    ca.write(&dir.0)?;
    troupe::transport::cookie::ensure_cookie(&dir.0)?;
    for (name, role) in [("host", Role::Executor), ("ops", Role::Scheduler)] {
        ca.issue(name, &IssueOptions::new(RoleSet::only(role))?)?.write(&dir.0)?;
    }
    let ports = troupe::up::free_ports(2)?;
    let host = write_config(
        &dir.0,
        "host",
        &format!(
            "name = \"host\"\nlisten = \"127.0.0.1:{}\"\nkeys = \".\"\n\n\
             [[actors]]\nkind = \"my-counter\"\nname = \"total\"\nparams = {{ start = 5 }}\n\n\
             [[actors]]\nkind = \"hello-expert\"\n",
            ports[0]
        ),
    )?;
    let ops = write_config(
        &dir.0,
        "ops",
        &format!(
            "name = \"ops\"\nlisten = \"127.0.0.1:{}\"\nkeys = \".\"\n\n\
             [[peers]]\nname = \"host\"\naddr = \"127.0.0.1:{}\"\n\n\
             [job]\nkind = \"count-up\"\ntimeout_s = 20\nparams = {{ counter = \"total\", add = [2, 3] }}\n",
            ports[1], ports[0]
        ),
    )?;

    let host = Node::spawn("host", &["--config", &host])?;
    let ops = Node::spawn("ops", &["--config", &ops])?.wait().await?;
    ensure!(ops.iter().any(|l| l == "add 3 -> 10"), "ops could not add to the counter");
    ensure!(ops.iter().any(|l| l == "troupe-node: job count-up finished: ok"), "the job did not end well");
    let host = host.terminate().await?;
    ensure!(
        host.iter().any(|l| l == "counter total starts at 5"),
        "the counter did not start from its params"
    );
    println!("demo ok");
    Ok(())
}

/// Writes `NAME.toml` into `dir` and returns its path.
fn write_config(dir: &Path, name: &str, text: &str) -> Result<String> {
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    path.to_str().map(str::to_owned).context("the temporary directory's path is not UTF-8")
}

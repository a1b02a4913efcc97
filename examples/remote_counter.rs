//! A counter actor on one node process, called by name from other node processes, with the
//! certificate roles that may send each message checked by the node that hosts it.
//!
//!     cargo run -p troupe-examples --bin remote_counter
//!
//! With no arguments it runs the whole demo on this machine: it makes a throwaway cluster CA and
//! node certificates in a temporary directory, then starts itself as the node processes:
//!
//! - `host` (role executor) runs the counter `total`;
//! - `ops` (role scheduler) looks `total` up by name and adds to it;
//! - `cam` (role camera) may read the total, but its add is refused: only schedulers may add.
//!
//! Each node prints what it does; the demo echoes those lines and exits non-zero if anything went
//! wrong. Each node process stops when its stdin closes, so none outlives the demo. The node
//! commands work on their own too (`remote_counter host DIR`, then
//! `remote_counter call DIR NAME host=ADDR`), with certificates from `troupe keys`.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use troupe::prelude::*;
use troupe::transport::NodeIdentity;
use troupe_examples::demo::{Node, TempDir, WAIT, or_stdin_closed, stdin_closed};

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

    async fn start(total: u64, _: &ActorContext) -> Result<Self, ActorFailure> {
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

// ---- the node processes ----------------------------------------------------------------------

/// The cluster's shared secret (in production: the one `troupe keys init` writes).
const COOKIE: &str = "remote-counter-demo-cookie-00000";

/// `host DIR`: runs the counter until stdin closes.
async fn host(dir: &Path) -> Result<()> {
    let node = start_node(dir, "host", &[]).await?;
    node.actors.spawn::<Counter>("total", 0).await?;
    println!("serving total");
    stdin_closed().await;
    node.shutdown().await;
    Ok(())
}

/// `call DIR NAME host=ADDR`: as node NAME, reads the total, adds to it twice, reads it again.
async fn call(dir: &Path, name: &str, peers: &[&str]) -> Result<()> {
    let node = start_node(dir, name, peers).await?;
    let total = node.actors.wait_for::<Counter>("total", WAIT).await?;
    println!("found total on {}", total.node().context("a resolved handle names its node")?);
    println!("get -> {}", total.call(Get, WAIT).await?);
    for n in [2, 3] {
        match total.call(Add(n), WAIT).await {
            Ok(now) => println!("add {n} -> {now}"),
            // the host refused: this node's certificate lacks the role `add` needs
            Err(ActorError::Forbidden { actor, message, detail }) => {
                println!("forbidden: {message} to {actor}: {detail}");
            }
            Err(e) => return Err(e.into()),
        }
    }
    println!("get -> {}", total.call(Get, WAIT).await?);
    node.shutdown().await;
    Ok(())
}

/// Starts node `name` from its certificate in `dir`, dialing `peers` (`NAME=ADDR` each), and
/// prints the address it listens on.
async fn start_node(dir: &Path, name: &str, peers: &[&str]) -> Result<NodeRuntime> {
    let peers = peers
        .iter()
        .map(|p| {
            let (name, addr) = p.split_once('=').with_context(|| format!("peer {p:?} is not NAME=ADDR"))?;
            Ok(PeerAddr { name: NodeId::new(name), addr: addr.parse()? })
        })
        .collect::<Result<Vec<_>>>()?;
    let spec =
        NodeSpec::new(NodeIdentity::load(dir, name)?, COOKIE).peers(peers).redial(Duration::from_millis(100));
    let node = NodeRuntime::start(spec).await?;
    println!("listening {}", node.link.local_addr()?);
    Ok(node)
}

// ---- the demo: a throwaway cluster of processes ------------------------------------------------

async fn demo() -> Result<()> {
    let dir = TempDir::new("remote-counter")?;
    let ca = ClusterCa::generate("remote-counter-demo")?;
    std::fs::write(dir.0.join("ca.crt"), ca.cert_pem())?;
    for (name, role) in [("host", Role::Executor), ("ops", Role::Scheduler), ("cam", Role::Camera)] {
        ca.issue(name, &IssueOptions::new(RoleSet::only(role))?)?.write(&dir.0)?;
    }
    let dir_arg = dir.0.to_str().context("the temporary directory's path is not UTF-8")?;

    let mut host = Node::spawn("host", &["host", dir_arg])?;
    let peer = format!("host={}", host.expect("listening ").await?);
    host.expect("serving total").await?;

    let ops = Node::spawn("ops", &["call", dir_arg, "ops", &peer])?.wait().await?;
    ensure!(ops.iter().any(|l| l == "add 3 -> 5"), "ops (a scheduler) could not add");
    let cam = Node::spawn("cam", &["call", dir_arg, "cam", &peer])?.wait().await?;
    ensure!(cam.iter().any(|l| l == "get -> 5"), "cam (a camera) could not read the total");
    ensure!(
        cam.iter().filter(|l| l.starts_with("forbidden: add to total")).count() == 2,
        "cam's adds were not refused"
    );
    host.stop().await?;
    println!("demo ok");
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
        [] => demo().await,
        ["host", dir] => host(Path::new(dir)).await,
        ["call", dir, name, peers @ ..] => or_stdin_closed(call(Path::new(dir), name, peers)).await,
        _ => bail!("usage: remote_counter [host DIR | call DIR NAME PEER=ADDR...]"),
    }
}

//! Supervision across nodes: a counter placed on one of two worker nodes by a supervisor on a
//! third; the worker holding it is killed (SIGKILL) and the supervisor starts the counter again
//! on the other worker, while a client calling it by name carries on.
//!
//!     cargo run -p troupe-examples --bin failover
//!
//! With no arguments it runs the whole demo on this machine: it makes a throwaway cluster CA and
//! node certificates in a temporary directory, then starts itself as three node processes:
//!
//! - `w1` and `w2` (role executor) each let schedulers place one counter on them;
//! - `sup` (role scheduler) runs a `RemoteSupervisor` with the counter `counter` as its child,
//!   and calls it by name every 100 ms, printing each answer and the node it came from.
//!
//! After three answers the demo kills the worker holding the counter. The supervisor's node
//! declares that worker down once it has been silent for a second, and the supervisor places
//! the counter on the other worker, where it starts again from its arguments. The client's
//! handle fails exactly once with `ActorError::PeerLost` (the call the kill cut off, or the next
//! one), then its calls reach the new incarnation. The demo exits non-zero if anything went
//! otherwise.
//!
//! Each node process stops when its stdin closes, so none outlives the demo. The node commands
//! work on their own too (`failover worker DIR NAME`, `failover supervisor DIR NAME=ADDR...`),
//! with certificates from `troupe keys`.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use troupe::actors::supervisor::{Intensity, SupervisorEvent};
use troupe::actors::typed::{PLACEMENT, RemoteSupervisorMsg};
use troupe::prelude::*;
use troupe::transport::NodeIdentity;
use troupe_examples::demo::{Node, TempDir, WAIT, or_stdin_closed, stdin_closed};

// ---- the actor -----------------------------------------------------------------------------

/// Adds to the total and answers the new total.
#[derive(troupe::rkyv::Archive, troupe::rkyv::Serialize, troupe::rkyv::Deserialize)]
#[rkyv(crate = troupe::rkyv)]
pub struct Add(pub u64);

impl RemoteMessage for Add {
    const NAME: &'static str = "add";
    type Reply = u64;
}

/// A running total (kept in memory: a restarted counter starts again from its arguments).
pub struct Counter {
    total: u64,
}

impl TypedActor for Counter {
    const KIND: &'static str = "counter";
    /// The total it starts from.
    type Args = u64;

    fn protocol(p: &mut Protocol<Self>) {
        p.request::<Add>(Allow::role(Role::Scheduler));
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

// ---- the node processes ----------------------------------------------------------------------

/// Answers wanted from the counter's second home before the client stops.
const ANSWERS_AFTER_MOVE: usize = 3;

/// The cluster's shared secret (in production: the one `troupe keys init` writes).
const COOKIE: &str = "failover-demo-cookie-00000000000";

/// `worker DIR NAME`: hosts one counter for a scheduler's supervisor until stdin closes.
async fn worker(dir: &Path, name: &str) -> Result<()> {
    let rules = PlacementRules::default().capacity(1).allow(Counter::KIND, Allow::role(Role::Scheduler));
    let node = start_node(dir, name, &[], rules).await?;
    node.actors.register_kind::<Counter>(); // the code a placed counter runs
    println!("ready");
    stdin_closed().await;
    node.shutdown().await;
    Ok(())
}

/// `supervisor DIR NAME=ADDR...`: as node `sup`, supervises the counter on the workers given,
/// and calls it by name until it has answered from a second worker.
async fn supervisor(dir: &Path, workers: &[&str]) -> Result<()> {
    let node = start_node(dir, "sup", workers, PlacementRules::default()).await?;
    // every worker connected and serving placements before the child is placed
    for w in workers.iter().filter_map(|w| w.split_once('=')).map(|(name, _)| name) {
        node.services
            .wait_for(WAIT, |s| s.providers(PLACEMENT).iter().any(|p| p.as_str() == w).then_some(()))
            .await
            .with_context(|| format!("worker {w} did not join"))?;
    }
    let mut events = node.subscribe_supervision();
    let child = RemoteChild::new::<Counter>("counter", &0)?;
    let sup = node.supervise_remote("counters", vec![child], Intensity::default()).await?;
    let placed = troupe::ractor::call!(sup, RemoteSupervisorMsg::Children)?;
    let first = placed.first().and_then(|(_, at)| at.clone()).context("the counter was not placed")?;
    println!("placed counter on {first}");

    let counter = node.actors.wait_for::<Counter>("counter", WAIT).await?;
    let mut errors = BTreeMap::from([("peer-lost", 0), ("timeout", 0), ("unknown-actor", 0)]);
    let mut moved = 0;
    let mut every = tokio::time::interval(Duration::from_millis(100));
    while moved < ANSWERS_AFTER_MOVE {
        every.tick().await;
        match counter.call(Add(1), Duration::from_secs(5)).await {
            Ok(total) => {
                let from = counter.node().context("a handle that answered names its node")?;
                println!("answer {total} from {from}");
                if from != first {
                    moved += 1;
                }
            }
            // the incarnation called is gone (its node was declared down): the handle looks
            // the name up again on the next call, waiting for the supervisor's replacement
            Err(e @ ActorError::PeerLost { .. }) => count(&mut errors, "peer-lost", e),
            // sent just before the node died, and no verdict on it within the call's timeout
            Err(e @ ActorError::Timeout { .. }) => count(&mut errors, "timeout", e),
            // no replacement announced within the call's timeout
            Err(e @ ActorError::UnknownActor { .. }) => count(&mut errors, "unknown-actor", e),
            Err(e) => return Err(e.into()),
        }
    }
    while let Ok(ev) = events.try_recv() {
        if let SupervisorEvent::Restarted { supervisor, child, reason, .. } = ev {
            println!("{supervisor} restarted {child}: {reason}");
        }
    }
    let summary: Vec<String> = errors.iter().map(|(kind, n)| format!("{kind}={n}")).collect();
    println!("errors: {}", summary.join(" "));
    ensure!(errors["peer-lost"] == 1, "the client saw {summary:?}, not exactly one peer-lost");
    sup.stop(None);
    node.shutdown().await;
    Ok(())
}

fn count(errors: &mut BTreeMap<&'static str, u32>, kind: &'static str, e: ActorError) {
    println!("error {kind}: {e}");
    *errors.entry(kind).or_default() += 1;
}

/// Starts node `name` from its certificate in `dir`, dialing `peers` (`NAME=ADDR` each), and
/// prints the address it listens on.
async fn start_node(
    dir: &Path,
    name: &str,
    peers: &[&str],
    placement: PlacementRules,
) -> Result<NodeRuntime> {
    let peers = peers
        .iter()
        .map(|p| {
            let (name, addr) = p.split_once('=').with_context(|| format!("peer {p:?} is not NAME=ADDR"))?;
            Ok(PeerAddr { name: NodeId::new(name), addr: addr.parse()? })
        })
        .collect::<Result<Vec<_>>>()?;
    let spec = NodeSpec::new(NodeIdentity::load(dir, name)?, COOKIE)
        .peers(peers)
        // a member silent for a second is declared down (the default is 1.5 s)
        .membership(MembershipConfig {
            heartbeat: Duration::from_millis(100),
            timeout: Duration::from_millis(1000),
        })
        .redial(Duration::from_millis(100))
        .placement(placement);
    let node = NodeRuntime::start(spec).await?;
    println!("listening {}", node.link.local_addr()?);
    Ok(node)
}

// ---- the demo: a throwaway cluster of processes ------------------------------------------------

async fn demo() -> Result<()> {
    let dir = TempDir::new("failover")?;
    let ca = ClusterCa::generate("failover-demo")?;
    std::fs::write(dir.0.join("ca.crt"), ca.cert_pem())?;
    for (name, role) in [("w1", Role::Executor), ("w2", Role::Executor), ("sup", Role::Scheduler)] {
        ca.issue(name, &IssueOptions::new(RoleSet::only(role))?)?.write(&dir.0)?;
    }
    let dir_arg = dir.0.to_str().context("the temporary directory's path is not UTF-8")?;

    let mut workers = BTreeMap::new();
    let mut peers = Vec::new();
    for name in ["w1", "w2"] {
        let mut w = Node::spawn(name, &["worker", dir_arg, name])?;
        peers.push(format!("{name}={}", w.expect("listening ").await?));
        w.expect("ready").await?;
        workers.insert(name.to_string(), w);
    }
    let mut args = vec!["supervisor", dir_arg];
    args.extend(peers.iter().map(String::as_str));
    let mut sup = Node::spawn("sup", &args)?;
    let first = sup.expect("placed counter on ").await?;
    for _ in 0..3 {
        sup.expect("answer ").await?;
    }
    let mut victim = workers.remove(&first).with_context(|| format!("no worker named {first}"))?;
    victim.child.start_kill()?; // SIGKILL: no goodbye to its peers
    let status = tokio::time::timeout(WAIT, victim.child.wait()).await??;
    println!("killed {first} ({status})");

    let lines = sup.wait().await?;
    let survivor = workers.keys().next().context("one worker is left")?.clone();
    ensure!(
        lines.iter().any(|l| l.starts_with("answer ") && l.ends_with(&format!(" from {survivor}"))),
        "no answer came from {survivor}"
    );
    for (_, w) in workers {
        w.stop().await?;
    }
    println!("demo ok");
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
        [] => demo().await,
        ["worker", dir, name] => worker(Path::new(dir), name).await,
        ["supervisor", dir, workers @ ..] => or_stdin_closed(supervisor(Path::new(dir), workers)).await,
        _ => bail!("usage: failover [worker DIR NAME | supervisor DIR NAME=ADDR...]"),
    }
}

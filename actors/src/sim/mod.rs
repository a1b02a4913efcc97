//! A seeded simulated cluster (simulation only): N nodes of the real node runtime — membership,
//! the role-checked service router, the typed-actor registry and placement, a root supervisor —
//! on [`SimLink`](troupe_transport::SimLink)s of one [`SimHub`], for tests on one thread under paused tokio time.
//!
//! What is simulated: the network (seeded delay, loss, partitions, crashes: the hub) and a
//! node's process (a crash drops its link and stops its actors, with no goodbye). What is real:
//! every actor, policy, codec and the router's role checks. Blob pulls by hash are simulated
//! too (a modelled transfer time on the hub's net). What QUIC alone does (the ractor_cluster
//! control plane, joining through a seed, raw streams) is not here: shells that need it refuse
//! to start on a simulated node ([`crate::typed::QuicOnly`]).
//!
//! The coe workload's scheduler, executors (on the `SimCompute` stand-in) and request service
//! run on it too ([`coe`]), and so do the pipeline's foreman service and workers (on the
//! `SimStage` stand-in: [`pipeline`]) and the coadapt edge and cameras ([`coadapt`]).
//!
//! Run it in a current-thread runtime with paused time (`#[tokio::test(start_paused = true)]`,
//! tokio's `test-util`): the driver (`sim/driver.rs`) moves the hub's virtual time with tokio's,
//! and tokio skips ahead whenever every task waits, so seconds of cluster time cost
//! milliseconds. The hub's event log (every send, drop and delivery, and the notes the test
//! adds) is the run's record: one seed, one log.

pub mod coadapt;
#[cfg(feature = "onnx")]
pub mod coe;
mod driver;
pub mod explore;
mod node;
#[cfg(feature = "onnx")]
pub mod pipeline;

pub use node::{SimNode, SimNodeSpec};

use std::collections::BTreeMap;

use troupe_policy::Micros;
use troupe_transport::{NodeId, SimConfig, SimHub};

use crate::node::RuntimeError;

/// Nodes of a simulated cluster on one hub, and the task moving the hub's clock.
pub struct SimCluster {
    hub: SimHub,
    nodes: BTreeMap<NodeId, SimNode>,
    specs: BTreeMap<NodeId, SimNodeSpec>,
    driver: tokio::task::JoinHandle<()>,
}

impl SimCluster {
    /// Starts `specs` (in order) on a hub with `net`'s seed and behaviour. Call inside a
    /// current-thread runtime with paused time for a reproducible run.
    pub async fn start(net: SimConfig, specs: Vec<SimNodeSpec>) -> Result<Self, RuntimeError> {
        let hub = SimHub::new(net);
        let driver = tokio::spawn(driver::drive(hub.clone(), net.min_delay));
        let (mut nodes, mut kept) = (BTreeMap::new(), BTreeMap::new());
        for spec in specs {
            kept.insert(spec.name.clone(), spec.clone());
            let node = SimNode::start(&hub, spec).await?;
            nodes.insert(node.name.clone(), node);
        }
        Ok(Self { hub, nodes, specs: kept, driver })
    }

    /// The simulated network (faults, the event log).
    pub fn hub(&self) -> &SimHub {
        &self.hub
    }

    /// The running node `name`.
    pub fn node(&self, name: &str) -> Option<&SimNode> {
        self.nodes.get(&NodeId::new(name))
    }

    /// Crashes node `name`: the network drops its traffic from now on and its actors stop, with
    /// no goodbye (the others learn it only from its silence). `false` if it is not running.
    pub async fn crash(&mut self, name: &str) -> bool {
        let Some(node) = self.nodes.remove(&NodeId::new(name)) else { return false };
        self.note(&format!("test crashes {name}"));
        self.hub.crash(&node.name);
        node.stop().await;
        true
    }

    /// Starts a fresh incarnation of the crashed node `name` on its old identity: the network
    /// carries its traffic again, and its membership, router, registry and root supervisor start
    /// empty, as a restarted process's do (what its actors held is lost). Its typed-actor kinds
    /// are registered by the caller on the node returned, before anything else runs. `Ok(None)`
    /// if `name` is running or was never part of the cluster.
    pub async fn restart(&mut self, name: &str) -> Result<Option<&SimNode>, RuntimeError> {
        let id = NodeId::new(name);
        let Some(spec) = self.specs.get(&id).filter(|_| !self.nodes.contains_key(&id)).cloned() else {
            return Ok(None);
        };
        self.note(&format!("test restarts {name}"));
        self.hub.restart(&id);
        // what QUIC's handshake with the new process tells each peer (`PeerEvent::Restarted`)
        for other in self.nodes.values() {
            other.services.peer_restarted(&id);
            let _ = other.membership.cast(crate::membership::MembershipMsg::Restarted(id.clone()));
        }
        let node = SimNode::start(&self.hub, spec).await?;
        Ok(Some(self.nodes.entry(id).or_insert(node)))
    }

    /// Adds a line to the event log at the hub's time (what the test did or saw).
    pub fn note(&self, text: &str) {
        self.hub.with_net(|net, now| net.note(now, text));
    }

    /// The event log so far.
    pub fn log(&self) -> Vec<String> {
        self.hub.log()
    }

    /// The hub's virtual time.
    pub fn now(&self) -> Micros {
        self.hub.now()
    }

    /// Stops every node and the clock.
    pub async fn shutdown(mut self) {
        for (_, node) in std::mem::take(&mut self.nodes) {
            node.stop().await;
        }
        self.driver.abort();
    }
}

//! A node serves its peers while its own actors are still starting (an edge node's first start
//! trains its model zoo for half a minute): its frames are taken from the link from the start,
//! so its inbox cannot fill up and stall the stream readers that mark peers as heard. Real QUIC
//! on loopback; the slow start is an actor held in `pre_start` until the test opens a gate.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use ractor_cluster::RactorMessage;
use tokio::sync::{Semaphore, oneshot};
use troupe_actors::node::query_status;
use troupe_actors::supervisor::ChildSpec;
use troupe_actors::{Children, MembershipConfig, NodeRuntime, NodeSpec};
use troupe_transport::{ClusterCa, IssueOptions, Role, RoleSet};

/// An actor whose start waits for a permit of its gate.
struct SlowStart;

#[derive(RactorMessage)]
enum SlowStartMsg {}

impl Actor for SlowStart {
    type Msg = SlowStartMsg;
    type State = ();
    type Arguments = Arc<Semaphore>;

    async fn pre_start(
        &self,
        _me: ActorRef<SlowStartMsg>,
        gate: Arc<Semaphore>,
    ) -> Result<(), ActorProcessingErr> {
        drop(gate.acquire().await?);
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_answers_its_peers_while_its_actors_are_still_starting() {
    let ca = ClusterCa::generate("start").unwrap();
    let gate = Arc::new(Semaphore::new(0));
    let (addr_tx, addr_rx) = oneshot::channel();
    let held = gate.clone();
    let children: Children = Box::new(move |link, _services, _membership, _actors| {
        let _ = addr_tx.send(link.local_addr().map_err(|e| e.to_string())?);
        Ok(vec![ChildSpec::new("slow-start", move || (SlowStart, held.clone()))])
    });
    let spec = NodeSpec {
        identity: ca.issue("slow", &IssueOptions::new(RoleSet::only(Role::Edge)).unwrap()).unwrap(),
        quic: Default::default(),
        peers: Vec::new(),
        membership: MembershipConfig {
            heartbeat: Duration::from_millis(100),
            timeout: Duration::from_secs(2),
        },
        intensity: Default::default(),
        cookie: "0123456789abcdef0123456789abcdef".into(),
        children,
        redial: Duration::from_millis(100),
        placement: Default::default(),
    };
    let starting = tokio::spawn(NodeRuntime::start(spec));
    let addr = addr_rx.await.expect("the node never built its children");
    let admin = ca.issue("admin", &IssueOptions::new(RoleSet::only(Role::Admin)).unwrap()).unwrap();
    let status = query_status(&admin, addr, Duration::from_secs(10))
        .await
        .expect("the node did not answer while its actors were starting");
    assert_eq!(status.node, "slow");
    assert!(!starting.is_finished(), "the start returned before its actor's gate opened");
    gate.add_permits(1);
    let node = starting.await.unwrap().expect("the start failed once the gate opened");
    node.shutdown().await;
}

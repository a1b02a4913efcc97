//! The service router's bounds over real QUIC on loopback: a node's outstanding calls are capped,
//! a callee past its concurrent-call cap answers Busy by name, and a silent callee times out.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Mutex, mpsc};
use troupe_actors::service::{Allow, CallError, Handler, ServiceConfig, ServiceSpec, Services};
use troupe_transport::service::FaultKind;
use troupe_transport::{ClusterCa, IssueOptions, NodeId, PeerEvent, QuicConfig, QuicNode, RoleSet};

/// A link and its router (which takes the link's service frames itself).
async fn node(ca: &ClusterCa, name: &str, config: ServiceConfig) -> (QuicNode, Services) {
    let id = ca.issue(name, &IssueOptions::new(RoleSet::EMPTY).unwrap()).unwrap();
    let link = QuicNode::bind(&id, QuicConfig::default()).await.unwrap();
    let services = Services::new(link.clone(), config);
    (link, services)
}

async fn joined(events: &mut mpsc::Receiver<PeerEvent>, who: &str) {
    tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(ev) = events.recv().await {
            if matches!(&ev, PeerEvent::Joined { peer, .. } if peer.as_str() == who) {
                return;
            }
        }
    })
    .await
    .expect("peer did not join");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outstanding_and_concurrent_calls_are_bounded_and_named() {
    let ca = ClusterCa::generate("t").unwrap();
    let (server_link, server) =
        node(&ca, "server", ServiceConfig { max_inbound: 1, ..Default::default() }).await;
    let mut events = server_link.events().unwrap();
    // the handler reports that it started, then waits until the test releases it
    let (started_tx, mut started) = mpsc::unbounded_channel::<()>();
    let (release_tx, release) = mpsc::unbounded_channel::<()>();
    let release = Arc::new(Mutex::new(release));
    let handler: Handler = Arc::new(move |_caller, _method, body| {
        let (started, release) = (started_tx.clone(), release.clone());
        Box::pin(async move {
            let _ = started.send(());
            release.lock().await.recv().await;
            Ok(body)
        })
    });
    server.register("slow", ServiceSpec::new().method("wait", Allow::AnyMember), handler);
    let addr = server_link.local_addr().unwrap();
    let server_id = NodeId::new("server");

    let (a_link, a) = node(&ca, "caller-a", ServiceConfig { max_outstanding: 1, ..Default::default() }).await;
    a_link.connect(addr, &server_id).await.unwrap();
    joined(&mut events, "caller-a").await;
    let (b_link, b) = node(&ca, "caller-b", ServiceConfig::default()).await;
    b_link.connect(addr, &server_id).await.unwrap();
    joined(&mut events, "caller-b").await;

    let first = {
        let (a, server_id) = (a.clone(), server_id.clone());
        tokio::spawn(async move {
            a.call(&server_id, "slow", "wait", b"one".to_vec(), Duration::from_secs(30)).await
        })
    };
    started.recv().await.unwrap();
    // caller-a already has its one call outstanding
    let e = a.call(&server_id, "slow", "wait", vec![], Duration::from_secs(30)).await.unwrap_err();
    assert!(matches!(e, CallError::TooManyOutstanding(1)), "{e}");
    // the server already runs its one call
    let e = b.call(&server_id, "slow", "wait", vec![], Duration::from_secs(30)).await.unwrap_err();
    assert_eq!(e.fault(), Some(FaultKind::Busy), "{e}");
    assert!(e.to_string().contains("calls in progress"), "{e}");
    release_tx.send(()).unwrap();
    assert_eq!(first.await.unwrap().unwrap(), b"one".to_vec());

    // a callee that does not answer in time: a timeout naming the call
    let e = b.call(&server_id, "slow", "wait", vec![], Duration::from_millis(200)).await.unwrap_err();
    assert!(matches!(e, CallError::Timeout { .. }), "{e}");
    assert!(e.to_string().contains("slow.wait"), "{e}");
    assert!(e.is_lost());
    release_tx.send(()).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_peer_cannot_take_the_call_slots_of_the_others() {
    let ca = ClusterCa::generate("t").unwrap();
    let config = ServiceConfig { max_inbound: 8, max_inbound_per_peer: 1, ..Default::default() };
    let (server_link, server) = node(&ca, "server", config).await;
    let mut events = server_link.events().unwrap();
    let (started_tx, mut started) = mpsc::unbounded_channel::<Vec<u8>>();
    let (release_tx, release) = mpsc::unbounded_channel::<()>();
    let release = Arc::new(Mutex::new(release));
    let handler: Handler = Arc::new(move |_caller, _method, body| {
        let (started, release) = (started_tx.clone(), release.clone());
        Box::pin(async move {
            let _ = started.send(body.clone());
            release.lock().await.recv().await;
            Ok(body)
        })
    });
    server.register("slow", ServiceSpec::new().method("wait", Allow::AnyMember), handler);
    let addr = server_link.local_addr().unwrap();
    let server_id = NodeId::new("server");
    let (a_link, a) = node(&ca, "greedy", ServiceConfig::default()).await;
    a_link.connect(addr, &server_id).await.unwrap();
    joined(&mut events, "greedy").await;
    let (b_link, b) = node(&ca, "polite", ServiceConfig::default()).await;
    b_link.connect(addr, &server_id).await.unwrap();
    joined(&mut events, "polite").await;

    let call = |s: &Services, body: &'static [u8]| {
        let (s, id) = (s.clone(), server_id.clone());
        tokio::spawn(async move { s.call(&id, "slow", "wait", body.to_vec(), Duration::from_secs(30)).await })
    };
    let greedy_first = call(&a, b"greedy-1");
    assert_eq!(started.recv().await.unwrap(), b"greedy-1".to_vec());
    // the greedy peer's second call is refused by its own share, naming the peer
    let e = a.call(&server_id, "slow", "wait", vec![], Duration::from_secs(30)).await.unwrap_err();
    assert_eq!(e.fault(), Some(FaultKind::Busy), "{e}");
    assert!(e.to_string().contains("calls from greedy"), "{e}");
    // the other peer is still served while the greedy one holds its slot
    let polite = call(&b, b"polite-1");
    assert_eq!(started.recv().await.unwrap(), b"polite-1".to_vec());
    release_tx.send(()).unwrap();
    release_tx.send(()).unwrap();
    assert_eq!(greedy_first.await.unwrap().unwrap(), b"greedy-1".to_vec());
    assert_eq!(polite.await.unwrap().unwrap(), b"polite-1".to_vec());
}

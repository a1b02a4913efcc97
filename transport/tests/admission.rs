//! Who may join, over real QUIC on loopback: expired certificates are refused by TLS itself,
//! admin identities never join as members, revoked certificates are refused at the hello and
//! disconnected when the rules change, and `peers_only` refuses peers not listed.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, SystemTime};

use troupe_transport::{
    Admission, ClusterCa, IssueOptions, NodeId, PeerEvent, QuicConfig, QuicNode, Revocations, Role, RoleSet,
    Validity,
};

fn options(roles: RoleSet) -> IssueOptions {
    IssueOptions::new(roles).unwrap()
}

async fn node_with(ca: &ClusterCa, name: &str, roles: RoleSet, config: QuicConfig) -> QuicNode {
    QuicNode::bind(&ca.issue(name, &options(roles)).unwrap(), config).await.unwrap()
}

async fn node(ca: &ClusterCa, name: &str) -> QuicNode {
    node_with(ca, name, RoleSet::only(Role::Executor), QuicConfig::default()).await
}

/// Waits (bounded) for the first event matching `want`.
async fn wait_event(
    rx: &mut tokio::sync::mpsc::Receiver<PeerEvent>,
    want: impl Fn(&PeerEvent) -> bool,
) -> PeerEvent {
    tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let ev = rx.recv().await.expect("event stream ended");
            if want(&ev) {
                return ev;
            }
        }
    })
    .await
    .expect("event did not arrive within 10 s")
}

async fn refusal(rx: &mut tokio::sync::mpsc::Receiver<PeerEvent>) -> String {
    match wait_event(rx, |e| matches!(e, PeerEvent::Refused { .. })).await {
        PeerEvent::Refused { reason, .. } => reason,
        _ => unreachable!(),
    }
}

fn expired() -> Validity {
    let now = SystemTime::now();
    Validity {
        not_before: now - Duration::from_secs(2 * 86_400),
        not_after: now - Duration::from_secs(86_400),
    }
}

#[tokio::test]
async fn expired_certificates_are_refused_by_tls_on_both_ends() {
    let ca = ClusterCa::generate("t").unwrap();
    let server = node(&ca, "server").await;
    let mut events = server.events().unwrap();
    let old =
        ca.issue("old", &IssueOptions { roles: RoleSet::only(Role::Executor), validity: expired() }).unwrap();
    let old = QuicNode::bind(&old, QuicConfig::default()).await.unwrap();
    let err = old.connect(server.local_addr().unwrap(), &NodeId::new("server")).await.unwrap_err();
    let reason = refusal(&mut events).await;
    assert!(reason.to_lowercase().contains("expired"), "server side: {reason}");
    assert!(server.peers().is_empty());
    assert!(!err.to_string().is_empty());

    // and a client refuses a server whose certificate expired
    let stale = ca
        .issue("stale", &IssueOptions { roles: RoleSet::only(Role::Executor), validity: expired() })
        .unwrap();
    let stale = QuicNode::bind(&stale, QuicConfig::default()).await.unwrap();
    let client = node(&ca, "client").await;
    let err = client.connect(stale.local_addr().unwrap(), &NodeId::new("stale")).await.unwrap_err();
    assert!(err.to_string().to_lowercase().contains("expired"), "client side: {err}");
    assert!(client.peers().is_empty());
}

#[tokio::test]
async fn an_admin_identity_can_query_but_never_join_as_a_member() {
    let ca = ClusterCa::generate("t").unwrap();
    let server = node(&ca, "server").await;
    let mut events = server.events().unwrap();
    let admin = RoleSet::only(Role::Admin);
    let member = node_with(&ca, "admin", admin, QuicConfig::default()).await;
    let err = member.connect(server.local_addr().unwrap(), &NodeId::new("server")).await.unwrap_err();
    assert!(err.to_string().contains("admin identities may query status but never join"), "{err}");
    let reason = refusal(&mut events).await;
    assert!(reason.contains("admin") && reason.contains("never join as a member"), "{reason}");
    assert!(server.peers().is_empty());

    // the same identity as a tool (member = false) is served, and not listed as a member
    let tool = node_with(&ca, "admin", admin, QuicConfig { member: false, ..QuicConfig::default() }).await;
    tool.connect_any(server.local_addr().unwrap()).await.unwrap();
    wait_event(&mut events, |e| matches!(e, PeerEvent::Joined { member: false, .. })).await;
    assert!(server.peers().is_empty());
}

#[tokio::test]
async fn revoked_certificates_are_refused_and_revocation_disconnects_joined_peers() {
    let ca = ClusterCa::generate("t").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let list = dir.path().join("revoked.txt");
    let lost = ca.issue("lost", &options(RoleSet::only(Role::Worker))).unwrap();
    let serial = lost.info().unwrap().serial;
    Revocations::append(&list, &format!("serial:{serial}")).unwrap();
    let config = QuicConfig {
        admission: Admission { revoked: Revocations::load(&list).unwrap(), allow: None },
        ..QuicConfig::default()
    };
    let server = node_with(&ca, "server", RoleSet::only(Role::Scheduler), config).await;
    let mut events = server.events().unwrap();
    let addr = server.local_addr().unwrap();

    let lost = QuicNode::bind(&lost, QuicConfig::default()).await.unwrap();
    let err = lost.connect(addr, &NodeId::new("server")).await.unwrap_err();
    assert!(err.to_string().contains(&format!("serial {serial} is on the revocation list")), "{err}");
    let reason = refusal(&mut events).await;
    assert!(reason.contains("certificate of lost is revoked"), "{reason}");

    // a joined peer, then revoked by name: disconnected with the reason, and refused again
    let worker = node(&ca, "worker-1").await;
    let mut worker_events = worker.events().unwrap();
    worker.connect(addr, &NodeId::new("server")).await.unwrap();
    wait_event(&mut events, |e| matches!(e, PeerEvent::Joined { peer, .. } if peer.as_str() == "worker-1"))
        .await;
    Revocations::append(&list, "worker-1").unwrap();
    let refused = server.set_admission(Admission { revoked: Revocations::load(&list).unwrap(), allow: None });
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert_eq!(refused[0].0.as_str(), "worker-1");
    assert!(server.peers().is_empty());
    let left = wait_event(&mut worker_events, |e| matches!(e, PeerEvent::Left { .. })).await;
    let PeerEvent::Left { reason, .. } = left else { unreachable!() };
    assert!(reason.contains("the name worker-1 is on the revocation list"), "worker saw: {reason}");
    let err = worker.connect(addr, &NodeId::new("server")).await.unwrap_err();
    assert!(err.to_string().contains("revoked"), "{err}");
}

#[tokio::test]
async fn peers_only_refuses_a_node_that_is_not_listed() {
    let ca = ClusterCa::generate("t").unwrap();
    let allow = Some(["friend".to_string()].into_iter().collect());
    let config = QuicConfig {
        admission: Admission { revoked: Revocations::default(), allow },
        ..QuicConfig::default()
    };
    let server = node_with(&ca, "server", RoleSet::only(Role::Scheduler), config).await;
    let mut events = server.events().unwrap();
    let addr = server.local_addr().unwrap();
    let stranger = node(&ca, "stranger").await;
    let err = stranger.connect(addr, &NodeId::new("server")).await.unwrap_err();
    assert!(err.to_string().contains("node stranger is not in this node's peers allow-list"), "{err}");
    let reason = refusal(&mut events).await;
    assert!(reason.contains("stranger") && reason.contains("allow-list"), "{reason}");
    let friend = node(&ca, "friend").await;
    friend.connect(addr, &NodeId::new("server")).await.unwrap();
    wait_event(&mut events, |e| matches!(e, PeerEvent::Joined { peer, .. } if peer.as_str() == "friend"))
        .await;
    assert_eq!(server.peers(), vec![NodeId::new("friend")]);
}

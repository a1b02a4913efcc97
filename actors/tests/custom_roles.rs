//! A role that is not built in, end to end over real QUIC on loopback: a certificate issued with
//! role `my-app` (written to disk and loaded back) carries it, a method allowed only to `my-app`
//! serves that node, member or not, and refuses a node without the role, naming what it needs;
//! a typed actor kind declares its own role by name, and a bad name fails its spawn.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use troupe_actors::service::{Allow, Handler, ServiceClient, ServiceConfig, ServiceSpec, Services};
use troupe_actors::typed::{
    ActorContext, ActorError, ActorFailure, Handles, Protocol, RemoteMessage, TypedActor,
};
use troupe_actors::{MembershipConfig, NodeRuntime, NodeSpec, PeerAddr, fixed_children};
use troupe_transport::service::FaultKind;
use troupe_transport::{
    ClusterCa, IssueOptions, NodeId, NodeIdentity, PeerEvent, QuicConfig, QuicNode, Role, RoleSet,
};

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

/// Issues `name` with `roles`, writes it to `dir` and loads it back (as a node would).
fn identity(ca: &ClusterCa, dir: &std::path::Path, name: &str, roles: &str) -> NodeIdentity {
    let roles = RoleSet::parse_list(roles).unwrap();
    ca.issue(name, &IssueOptions::new(roles).unwrap()).unwrap().write(dir).unwrap();
    NodeIdentity::load(dir, name).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_custom_role_admits_its_holders_only() {
    let my_app = Role::named("my-app").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let ca = ClusterCa::generate("custom").unwrap();
    ca.write(dir.path()).unwrap();

    let server_id = identity(&ca, dir.path(), "server", "executor");
    let server_link = QuicNode::bind(&server_id, QuicConfig::default()).await.unwrap();
    let mut events = server_link.events().unwrap();
    let server = Services::new(server_link.clone(), ServiceConfig::default());
    // answers with the roles the router saw on the caller's certificate
    let handler: Handler =
        Arc::new(|caller, _method, _body| Box::pin(async move { Ok(caller.roles.to_string().into_bytes()) }));
    server.register("app", ServiceSpec::new().method("go", Allow::role(my_app)), handler);
    let addr = server_link.local_addr().unwrap();
    let server_name = NodeId::new("server");
    let timeout = Duration::from_secs(30);

    // the certificate carries the custom role, next to a built-in one
    let holder_id = identity(&ca, dir.path(), "holder", "my-app,camera");
    assert_eq!(holder_id.roles(), RoleSet::only(my_app).with(Role::Camera));
    assert_eq!(holder_id.roles().to_string(), "camera,my-app");

    // a member with the role is served
    let holder_link = QuicNode::bind(&holder_id, QuicConfig::default()).await.unwrap();
    let holder = Services::new(holder_link.clone(), ServiceConfig::default());
    holder_link.connect(addr, &server_name).await.unwrap();
    joined(&mut events, "holder").await;
    assert_eq!(
        server_link.peer_roles(&NodeId::new("holder")),
        Some(RoleSet::only(my_app).with(Role::Camera))
    );
    let answer = holder.call(&server_name, "app", "go", b"hi".to_vec(), timeout).await.unwrap();
    assert_eq!(answer, b"camera,my-app".to_vec());

    // a member without it is refused, naming the role it lacks and the one it needs
    let other_id = identity(&ca, dir.path(), "other", "scheduler");
    let other_link = QuicNode::bind(&other_id, QuicConfig::default()).await.unwrap();
    let other = Services::new(other_link.clone(), ServiceConfig::default());
    other_link.connect(addr, &server_name).await.unwrap();
    joined(&mut events, "other").await;
    let e = other.call(&server_name, "app", "go", b"hi".to_vec(), timeout).await.unwrap_err();
    assert_eq!(e.fault(), Some(FaultKind::Forbidden), "{e}");
    let text = e.to_string();
    assert!(
        text.contains("role scheduler of other may not call app.go") && text.contains("needs role my-app"),
        "{text}"
    );

    // a non-member client (its own endpoint, as `troupe coe request` has) with the role is served
    let client_id = identity(&ca, dir.path(), "app-client", "my-app");
    let client = ServiceClient::connect(&client_id, addr, None).await.unwrap();
    assert_eq!(client.server, server_name);
    let answer = client.services.call(&server_name, "app", "go", b"ok".to_vec(), timeout).await.unwrap();
    assert_eq!(answer, b"my-app".to_vec());

    client.link.shutdown().await;
    for link in [holder_link, other_link, server_link] {
        link.shutdown().await;
    }
}

#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
struct Ping(u64);
impl RemoteMessage for Ping {
    const NAME: &'static str = "ping";
    type Reply = u64;
}

/// A kind that admits its own role, declared by name.
struct AppEcho;
impl TypedActor for AppEcho {
    const KIND: &'static str = "test-app-echo";
    type Args = ();
    fn protocol(p: &mut Protocol<Self>) {
        p.request_from::<Ping>("typed-app");
    }
    async fn start(_: (), _: &ActorContext) -> Result<Self, ActorFailure> {
        Ok(AppEcho)
    }
}
impl Handles<Ping> for AppEcho {
    async fn handle(&mut self, Ping(n): Ping, _: &ActorContext) -> Result<u64, ActorFailure> {
        Ok(n + 1)
    }
}

/// A kind whose protocol names a role that breaks the rule.
struct BadRole;
impl TypedActor for BadRole {
    const KIND: &'static str = "test-bad-role";
    type Args = ();
    fn protocol(p: &mut Protocol<Self>) {
        p.request_from::<Ping>("Typed_App");
    }
    async fn start(_: (), _: &ActorContext) -> Result<Self, ActorFailure> {
        Ok(BadRole)
    }
}
impl Handles<Ping> for BadRole {
    async fn handle(&mut self, Ping(n): Ping, _: &ActorContext) -> Result<u64, ActorFailure> {
        Ok(n)
    }
}

fn node_spec(ca: &ClusterCa, name: &str, roles: &str, peers: Vec<PeerAddr>) -> NodeSpec {
    NodeSpec {
        identity: ca.issue(name, &IssueOptions::new(RoleSet::parse_list(roles).unwrap()).unwrap()).unwrap(),
        quic: Default::default(),
        peers,
        membership: MembershipConfig {
            heartbeat: Duration::from_millis(100),
            timeout: Duration::from_millis(1000),
        },
        intensity: Default::default(),
        cookie: "0123456789abcdef0123456789abcdef".into(),
        children: fixed_children(vec![]),
        redial: Duration::from_millis(100),
        placement: Default::default(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_typed_kind_declares_its_own_role() {
    let ca = ClusterCa::generate("typed-custom").unwrap();
    let host = NodeRuntime::start(node_spec(&ca, "host", "executor", vec![])).await.unwrap();
    let at = PeerAddr { name: host.name.clone(), addr: host.link.local_addr().unwrap().into() };
    let app = NodeRuntime::start(node_spec(&ca, "app", "typed-app", vec![at.clone()])).await.unwrap();
    let other = NodeRuntime::start(node_spec(&ca, "other", "scheduler", vec![at])).await.unwrap();

    match host.actors.spawn::<BadRole>("bad", ()).await {
        Err(e) => assert!(e.to_string().contains("invalid role name \"Typed_App\""), "{e}"),
        Ok(_) => panic!("a kind with a bad role name was spawned"),
    }
    host.actors.spawn::<AppEcho>("echo", ()).await.unwrap();
    let from_app = app.actors.wait_for::<AppEcho>("echo", Duration::from_secs(10)).await.unwrap();
    assert_eq!(from_app.call(Ping(1), Duration::from_secs(10)).await.unwrap(), 2);
    let from_other = other.actors.wait_for::<AppEcho>("echo", Duration::from_secs(10)).await.unwrap();
    match from_other.call(Ping(1), Duration::from_secs(10)).await {
        Err(ActorError::Forbidden { message, detail, .. }) => {
            assert_eq!(message, "ping");
            assert!(detail.contains("scheduler") && detail.contains("needs role typed-app"), "{detail}");
        }
        other => panic!("a scheduler pinging a typed-app kind: {other:?}"),
    }

    for n in [other, app, host] {
        n.shutdown().await;
    }
}

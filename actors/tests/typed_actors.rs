//! Typed remote actors over real QUIC on loopback, nodes in one process: a counter called by
//! name from another node, roles checked per message, every error class a caller can match on,
//! a crashed incarnation replaced, and a child supervised across nodes moving when its node
//! goes away.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use troupe_actors::service::Allow;
use troupe_actors::supervisor::{Intensity, SupervisorEvent};
use troupe_actors::typed::{
    ActorContext, ActorError, ActorFailure, Handles, PlacementRules, Protocol, RemoteChild, RemoteMessage,
    RemoteSupervisorMsg, Reply, TypedActor,
};
use troupe_actors::{MembershipConfig, NodeRuntime, NodeSpec, PeerAddr, fixed_children};
use troupe_transport::{ClusterCa, IssueOptions, NodeId, Role, RoleSet};

const T: Duration = Duration::from_secs(10);

#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
struct Add(u64);
impl RemoteMessage for Add {
    const NAME: &'static str = "add";
    type Reply = u64;
}

#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
struct Get;
impl RemoteMessage for Get {
    const NAME: &'static str = "get";
    type Reply = u64;
}

/// Fails (the handler's own failure) or panics (a crash).
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
struct Break {
    panic: bool,
}
impl RemoteMessage for Break {
    const NAME: &'static str = "break";
    type Reply = ();
}

struct Counter(u64);

impl TypedActor for Counter {
    const KIND: &'static str = "test-counter";
    type Args = u64;
    fn protocol(p: &mut Protocol<Self>) {
        p.request::<Add>(Allow::role(Role::Scheduler))
            .request::<Get>(Allow::AnyMember)
            .request::<Break>(Allow::AnyMember);
    }
    async fn start(start: u64, _: &ActorContext) -> Result<Self, ActorFailure> {
        Ok(Counter(start))
    }
}

impl Handles<Add> for Counter {
    async fn handle(&mut self, Add(n): Add, _: &ActorContext) -> Result<u64, ActorFailure> {
        self.0 = self.0.checked_add(n).ok_or_else(|| ActorFailure::msg("the total would overflow"))?;
        Ok(self.0)
    }
}

impl Handles<Get> for Counter {
    async fn handle(&mut self, _: Get, _: &ActorContext) -> Result<u64, ActorFailure> {
        Ok(self.0)
    }
}

impl Handles<Break> for Counter {
    async fn handle(&mut self, b: Break, _: &ActorContext) -> Result<(), ActorFailure> {
        if b.panic {
            panic!("asked to crash");
        }
        Err(ActorFailure::msg("asked to fail"))
    }
}

/// Another kind, to look a counter up as.
struct Other;
impl TypedActor for Other {
    const KIND: &'static str = "test-other";
    type Args = ();
    fn protocol(p: &mut Protocol<Self>) {
        p.request::<Get>(Allow::AnyMember);
    }
    async fn start(_: (), _: &ActorContext) -> Result<Self, ActorFailure> {
        Ok(Other)
    }
}
impl Handles<Get> for Other {
    async fn handle(&mut self, _: Get, _: &ActorContext) -> Result<u64, ActorFailure> {
        Ok(0)
    }
}

fn spec(ca: &ClusterCa, name: &str, role: Role, peers: Vec<PeerAddr>, placement: PlacementRules) -> NodeSpec {
    NodeSpec {
        identity: ca.issue(name, &IssueOptions::new(RoleSet::only(role)).unwrap()).unwrap(),
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
        placement,
    }
}

fn at(node: &NodeRuntime) -> PeerAddr {
    PeerAddr { name: node.name.clone(), addr: node.link.local_addr().unwrap().into() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_counter_is_called_by_name_from_another_node_with_roles_checked_per_message() {
    let ca = ClusterCa::generate("typed").unwrap();
    let host = NodeRuntime::start(spec(&ca, "host", Role::Executor, vec![], PlacementRules::default()))
        .await
        .unwrap();
    let sched =
        NodeRuntime::start(spec(&ca, "sched", Role::Scheduler, vec![at(&host)], PlacementRules::default()))
            .await
            .unwrap();
    let cam = NodeRuntime::start(spec(&ca, "cam", Role::Camera, vec![at(&host)], PlacementRules::default()))
        .await
        .unwrap();

    let local = host.actors.spawn::<Counter>("total", 10).await.unwrap();
    assert_eq!(local.node(), Some(NodeId::new("host")));
    assert_eq!(local.call(Add(1), T).await.unwrap(), 11, "a local call");

    let remote = sched.actors.wait_for::<Counter>("total", T).await.unwrap();
    assert_eq!(remote.node(), Some(NodeId::new("host")));
    assert_eq!(remote.incarnation(), local.incarnation());
    assert_eq!(remote.call(Add(2), T).await.unwrap(), 13);
    // a tell, then a call from the same handle: the call sees the tell (one ordered road)
    remote.tell(Add(5)).await.unwrap();
    assert_eq!(remote.call(Get, T).await.unwrap(), 18);

    let from_cam = cam.actors.wait_for::<Counter>("total", T).await.unwrap();
    assert_eq!(from_cam.call(Get, T).await.unwrap(), 18, "any member may read");
    match from_cam.call(Add(1), T).await {
        Err(ActorError::Forbidden { actor, message, detail }) => {
            assert_eq!((actor.as_str(), message), ("total", "add"));
            assert!(detail.contains("camera") && detail.contains("scheduler"), "{detail}");
        }
        other => panic!("a camera adding: {other:?}"),
    }
    assert_eq!(remote.call(Get, T).await.unwrap(), 18, "the refused add changed nothing");

    match remote.call(Break { panic: false }, T).await {
        Err(ActorError::Failed { message: "break", detail, .. }) => assert!(detail.contains("asked to fail")),
        other => panic!("a handler failure: {other:?}"),
    }
    match remote.call(Add(u64::MAX), T).await {
        Err(ActorError::Failed { detail, .. }) => assert!(detail.contains("overflow"), "{detail}"),
        other => panic!("an overflow: {other:?}"),
    }
    match sched.actors.lookup::<Counter>("nobody").await {
        Err(ActorError::UnknownActor { name, within: None }) => assert_eq!(name, "nobody"),
        other => panic!("an unknown name: {other:?}"),
    }
    match sched.actors.wait_for::<Counter>("nobody", Duration::from_millis(300)).await {
        Err(ActorError::UnknownActor { within: Some(_), .. }) => {}
        other => panic!("waiting for an unknown name: {other:?}"),
    }
    match sched.actors.lookup::<Other>("total").await {
        Err(ActorError::WrongKind { expected: "test-other", found, .. }) => assert_eq!(found, "test-counter"),
        other => panic!("the wrong kind remotely: {other:?}"),
    }
    assert!(matches!(host.actors.lookup::<Other>("total").await, Err(ActorError::WrongKind { .. })));
    assert!(host.actors.spawn::<Counter>("total", 0).await.is_err(), "a second actor of one name");
    assert!(host.actors.spawn::<Counter>("bad name!", 0).await.is_err(), "an invalid name");

    for n in [cam, sched, host] {
        n.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_incarnation_is_restarted_and_calls_to_the_old_one_fail_as_peer_lost() {
    let ca = ClusterCa::generate("typed-crash").unwrap();
    let host = NodeRuntime::start(spec(&ca, "host2", Role::Executor, vec![], PlacementRules::default()))
        .await
        .unwrap();
    let sched =
        NodeRuntime::start(spec(&ca, "sched2", Role::Scheduler, vec![at(&host)], PlacementRules::default()))
            .await
            .unwrap();
    let mut restarts = host.subscribe_supervision();
    host.actors.spawn::<Counter>("crashy", 1).await.unwrap();
    let h = sched.actors.wait_for::<Counter>("crashy", T).await.unwrap();
    let first = h.incarnation().unwrap();
    assert_eq!(h.call(Add(1), T).await.unwrap(), 2);
    match h.call(Break { panic: true }, T).await {
        Err(ActorError::PeerLost { actor, .. }) => assert_eq!(actor, "crashy"),
        other => panic!("a crash while handling: {other:?}"),
    }
    let ev = tokio::time::timeout(T, restarts.recv()).await.unwrap().unwrap();
    assert!(
        matches!(ev, SupervisorEvent::Restarted { ref child, .. } if child.starts_with("crashy@")),
        "{ev:?}"
    );
    // the handle resolves the name again: the new incarnation starts from its arguments
    assert_eq!(h.call(Get, T).await.unwrap(), 1);
    assert_ne!(h.incarnation(), Some(first));
    sched.shutdown().await;
    host.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_supervised_child_moves_to_another_node_when_its_node_goes_away() {
    let ca = ClusterCa::generate("typed-move").unwrap();
    let rules = || PlacementRules::default().capacity(1).allow(Counter::KIND, Allow::role(Role::Scheduler));
    let sup = NodeRuntime::start(spec(&ca, "sup", Role::Scheduler, vec![], PlacementRules::default()))
        .await
        .unwrap();
    let w1 = NodeRuntime::start(spec(&ca, "w1", Role::Executor, vec![at(&sup)], rules())).await.unwrap();
    let w2 =
        NodeRuntime::start(spec(&ca, "w2", Role::Executor, vec![at(&sup), at(&w1)], rules())).await.unwrap();
    // a node that does not let anyone place counters
    let w3 = NodeRuntime::start(spec(
        &ca,
        "w3",
        Role::Executor,
        vec![at(&sup)],
        PlacementRules::default().capacity(5),
    ))
    .await
    .unwrap();
    for w in [&w1, &w2, &w3] {
        w.actors.register_kind::<Counter>();
    }
    for n in ["w1", "w2", "w3"] {
        sup.services
            .wait_for(T, |s| {
                s.providers(troupe_actors::typed::PLACEMENT).iter().any(|p| p.as_str() == n).then_some(())
            })
            .await
            .unwrap();
    }
    let children = vec![RemoteChild::new::<Counter>("moving", &7).unwrap()];
    let mut events = sup.subscribe_supervision();
    let rs = sup.supervise_remote("movers", children, Intensity::default()).await.unwrap();
    let placed = ractor::call!(rs, RemoteSupervisorMsg::Children).unwrap();
    let first = placed[0].1.clone().expect("placed");
    assert!(
        first.as_str() == "w1" || first.as_str() == "w2",
        "placed on {first}: only w1 and w2 allow counters"
    );

    let h = sup.actors.wait_for::<Counter>("moving", T).await.unwrap();
    assert_eq!(h.call(Add(1), T).await.unwrap(), 8);
    let (gone, stays) = if first.as_str() == "w1" { (w1, w2) } else { (w2, w1) };
    gone.shutdown().await;
    let ev = tokio::time::timeout(T * 2, events.recv()).await.unwrap().unwrap();
    assert!(matches!(ev, SupervisorEvent::Restarted { ref child, .. } if child == "moving"), "{ev:?}");
    let placed = ractor::call!(rs, RemoteSupervisorMsg::Children).unwrap();
    assert_eq!(placed[0].1.as_ref(), Some(&stays.name), "moved to the other eligible node");
    // one typed peer-lost (or none, if the handle learned first), then the replacement answers
    let answer = match h.call(Get, T).await {
        Err(ActorError::PeerLost { .. }) => h.call(Get, T).await,
        other => other,
    };
    assert_eq!(answer.unwrap(), 7, "the replacement starts from the child's arguments");
    assert_eq!(h.node(), Some(stays.name.clone()));
    assert_eq!(stays.actors.placed_children().len(), 1);
    rs.stop(None);
    for n in [w3, stays, sup] {
        n.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn links_run_calls_in_order_and_a_lost_incarnation_ends_its_generation() {
    use troupe_actors::typed::{Links, NotQueued, Outcome};
    let ca = ClusterCa::generate("typed-links").unwrap();
    let host = NodeRuntime::start(spec(&ca, "host3", Role::Executor, vec![], PlacementRules::default()))
        .await
        .unwrap();
    let sched =
        NodeRuntime::start(spec(&ca, "sched3", Role::Scheduler, vec![at(&host)], PlacementRules::default()))
            .await
            .unwrap();
    host.actors.spawn::<Counter>("linked", 0).await.unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let links: Links<usize, troupe_actors::typed::ActorHandle<Counter>, u64> =
        Links::new(std::sync::Arc::new(move |key, generation, outcome| {
            let _ = tx.send((key, generation, outcome));
        }));
    let h = sched.actors.wait_for::<Counter>("linked", T).await.unwrap();
    assert_eq!(links.attach(7, h.clone()), 1);
    for n in 1..=5u64 {
        links.call(&7, Add(n), T, |total| total).unwrap();
    }
    let mut totals = Vec::new();
    for _ in 0..5 {
        match rx.recv().await.unwrap() {
            (7, 1, Outcome::Done(t)) => totals.push(t),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(totals, [1, 3, 6, 10, 15], "one at a time, in the order submitted");
    links.call(&7, Break { panic: true }, T, |()| 0).unwrap();
    match rx.recv().await.unwrap() {
        (7, 1, Outcome::Lost(ActorError::PeerLost { .. })) => {}
        other => panic!("a crash mid-call: {other:?}"),
    }
    assert!(!links.is_live(&7));
    assert_eq!(links.call(&7, Get, T, |t| t), Err(NotQueued::NoLink(1)));
    assert_eq!(links.attach(7, h), 2, "a new link, a new generation");
    assert!(!links.is_current(&7, 1) && links.is_current(&7, 2));
    links.call(&7, Get, T, |t| t).unwrap();
    match rx.recv().await.unwrap() {
        (7, 2, Outcome::Done(0)) => {}
        other => panic!("the restarted incarnation starts from its arguments: {other:?}"),
    }
    // a link replaced while a call is in flight: what was queued behind that call is dropped,
    // and the new link to the same incarnation waits for the call before its first
    let resolved = sched.actors.lookup::<Counter>("linked").await.unwrap();
    assert_eq!(links.attach(7, resolved.clone()), 3);
    let (started_tx, started) = tokio::sync::oneshot::channel::<()>();
    let (release, held) = tokio::sync::oneshot::channel::<()>();
    links
        .submit(&7, move |h| {
            Box::pin(async move {
                let _ = started_tx.send(());
                let _ = held.await;
                h.call(Get, T).await
            })
        })
        .unwrap();
    started.await.unwrap();
    links.call(&7, Add(5), T, |t| t).unwrap();
    links.call(&7, Add(6), T, |t| t).unwrap();
    assert_eq!(links.attach(7, resolved), 4);
    links.call(&7, Get, T, |t| t).unwrap();
    release.send(()).unwrap();
    match rx.recv().await.unwrap() {
        (7, 3, Outcome::Done(0)) => {}
        other => panic!("the call in flight finishes first: {other:?}"),
    }
    match rx.recv().await.unwrap() {
        (7, 4, Outcome::Done(0)) => {}
        other => panic!("the adds queued on the replaced link were never sent: {other:?}"),
    }
    assert!(!links.detach_generation(&7, 3), "an old generation ends nothing");
    assert!(links.detach_generation(&7, 4) && !links.is_live(&7));
    sched.shutdown().await;
    host.shutdown().await;
}

/// Waits for a `Release` (its reply is given later), then answers who sent it.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
struct Hold;
impl RemoteMessage for Hold {
    const NAME: &'static str = "hold";
    type Reply = String;
}

/// Releases the held calls; answers who sent it.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
struct Release;
impl RemoteMessage for Release {
    const NAME: &'static str = "release";
    type Reply = String;
}

/// Holds calls' replies until released: its mailbox goes on meanwhile.
struct Gate(tokio::sync::watch::Sender<bool>);

/// How many holds a gate has turned (taken from its mailbox, reply not given yet).
static HOLDS: std::sync::LazyLock<tokio::sync::watch::Sender<u32>> =
    std::sync::LazyLock::new(|| tokio::sync::watch::channel(0).0);

impl TypedActor for Gate {
    const KIND: &'static str = "test-gate";
    type Args = ();
    fn protocol(p: &mut Protocol<Self>) {
        p.request::<Hold>(Allow::AnyMember).request::<Release>(Allow::AnyMember);
    }
    async fn start(_: (), _: &ActorContext) -> Result<Self, ActorFailure> {
        Ok(Gate(tokio::sync::watch::channel(false).0))
    }
}

fn sender(ctx: &ActorContext) -> String {
    ctx.sender.as_ref().map(|n| n.0.clone()).unwrap_or_default()
}

impl Handles<Hold> for Gate {
    async fn handle(&mut self, msg: Hold, ctx: &ActorContext) -> Result<String, ActorFailure> {
        self.turn(msg, ctx).await?.wait().await
    }
    async fn turn(&mut self, _: Hold, ctx: &ActorContext) -> Result<Reply<String>, ActorFailure> {
        let (mut open, who) = (self.0.subscribe(), sender(ctx));
        HOLDS.send_modify(|n| *n += 1);
        Ok(Reply::Later(Box::pin(async move {
            open.wait_for(|o| *o).await.map_err(|_| ActorFailure::msg("the gate went away"))?;
            Ok(who)
        })))
    }
}

impl Handles<Release> for Gate {
    async fn handle(&mut self, _: Release, ctx: &ActorContext) -> Result<String, ActorFailure> {
        self.0.send_replace(true);
        Ok(sender(ctx))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_given_later_lets_the_mailbox_go_on_and_handlers_see_the_sender() {
    let ca = ClusterCa::generate("typed-later").unwrap();
    let host = NodeRuntime::start(spec(&ca, "host4", Role::Executor, vec![], PlacementRules::default()))
        .await
        .unwrap();
    let other =
        NodeRuntime::start(spec(&ca, "other4", Role::Scheduler, vec![at(&host)], PlacementRules::default()))
            .await
            .unwrap();
    let local = host.actors.spawn::<Gate>("gate", ()).await.unwrap();
    let remote = other.actors.wait_for::<Gate>("gate", T).await.unwrap();
    // two held calls (one local, one remote) are outstanding; the release behind them is handled
    let held_local = tokio::spawn({
        let h = local.clone();
        async move { h.call(Hold, T).await }
    });
    let held_remote = tokio::spawn({
        let h = remote.clone();
        async move { h.call(Hold, T).await }
    });
    // both holds were taken from the mailbox, their replies not given: the release behind them
    // is handled (were the mailbox held by a reply, this would never answer)
    HOLDS.subscribe().wait_for(|n| *n >= 2).await.unwrap();
    assert!(!held_local.is_finished() && !held_remote.is_finished());
    assert_eq!(remote.call(Release, T).await.unwrap(), "other4", "the remote sender");
    assert_eq!(held_local.await.unwrap().unwrap(), "host4", "a local handle's sender is this node");
    assert_eq!(held_remote.await.unwrap().unwrap(), "other4");
    for n in [other, host] {
        n.shutdown().await;
    }
}

/// A counter with a mailbox of eight messages, for tells' flow control.
struct Narrow(u64);
impl TypedActor for Narrow {
    const KIND: &'static str = "test-narrow";
    type Args = ();
    fn protocol(p: &mut Protocol<Self>) {
        p.request::<Add>(Allow::AnyMember).request::<Get>(Allow::AnyMember).mailbox(8);
    }
    async fn start(_: (), _: &ActorContext) -> Result<Self, ActorFailure> {
        Ok(Narrow(0))
    }
}
impl Handles<Add> for Narrow {
    async fn handle(&mut self, Add(n): Add, _: &ActorContext) -> Result<u64, ActorFailure> {
        // slower than the link: without flow control the mailbox would overflow
        tokio::task::yield_now().await;
        self.0 += n;
        Ok(self.0)
    }
}
impl Handles<Get> for Narrow {
    async fn handle(&mut self, _: Get, _: &ActorContext) -> Result<u64, ActorFailure> {
        Ok(self.0)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loop_of_remote_tells_never_overruns_a_small_mailbox() {
    let ca = ClusterCa::generate("typed-flow").unwrap();
    let host = NodeRuntime::start(spec(&ca, "flow-host", Role::Executor, vec![], PlacementRules::default()))
        .await
        .unwrap();
    let teller = NodeRuntime::start(spec(
        &ca,
        "flow-teller",
        Role::Scheduler,
        vec![at(&host)],
        PlacementRules::default(),
    ))
    .await
    .unwrap();
    host.actors.spawn::<Narrow>("narrow", ()).await.unwrap();
    let narrow = teller.actors.wait_for::<Narrow>("narrow", T).await.unwrap();
    let n = 3_000;
    for _ in 0..n {
        narrow.tell(Add(1)).await.unwrap();
    }
    assert_eq!(narrow.call(Get, T).await.unwrap(), n, "every tell was taken, none refused as busy");
    for node in [teller, host] {
        node.shutdown().await;
    }
}

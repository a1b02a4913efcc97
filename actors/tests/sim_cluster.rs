//! The real node runtime (membership, role-checked service router, typed actors, placement) on
//! a seeded simulated network, one thread, paused tokio time: calls by name with roles checked,
//! a crashed node's child restarted elsewhere, and one seed giving one event log byte for byte.
//! Each test costs well under a second of wall time (the cluster's seconds are virtual).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use troupe_actors::service::Allow;
use troupe_actors::sim::{SimCluster, SimNodeSpec};
use troupe_actors::supervisor::{Intensity, SupervisorEvent};
use troupe_actors::typed::{
    ActorContext, ActorError, ActorFailure, Handles, PLACEMENT, PlacementRules, Protocol, RemoteChild,
    RemoteMessage, RemoteSupervisorMsg, TypedActor,
};
use troupe_actors::{MembershipConfig, Services};
use troupe_policy::Micros;
use troupe_transport::{Role, RoleSet, SimConfig};

/// Virtual time a test waits for anything (tokio skips it when nothing else runs).
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

/// A counter: schedulers add, any member reads.
struct Counter(u64);

impl TypedActor for Counter {
    const KIND: &'static str = "sim-counter";
    type Args = u64;
    fn protocol(p: &mut Protocol<Self>) {
        p.request::<Add>(Allow::role(Role::Scheduler)).request::<Get>(Allow::AnyMember);
    }
    async fn start(start: u64, _: &ActorContext) -> Result<Self, ActorFailure> {
        Ok(Counter(start))
    }
}

impl Handles<Add> for Counter {
    async fn handle(&mut self, Add(n): Add, _: &ActorContext) -> Result<u64, ActorFailure> {
        self.0 += n;
        Ok(self.0)
    }
}

impl Handles<Get> for Counter {
    async fn handle(&mut self, _: Get, _: &ActorContext) -> Result<u64, ActorFailure> {
        Ok(self.0)
    }
}

fn net(seed: u64) -> SimConfig {
    SimConfig { seed, min_delay: Micros::from_millis(1), max_delay: Micros::from_millis(20), loss: 0.0 }
}

fn node(name: &str, role: Role) -> SimNodeSpec {
    SimNodeSpec::new(name, RoleSet::only(role)).membership(MembershipConfig {
        heartbeat: Duration::from_millis(100),
        timeout: Duration::from_millis(1000),
    })
}

/// Waits (in virtual time) until `node` serves placements, as seen from `services`.
async fn wait_placement(services: &Services, node: &str) {
    services
        .wait_for(T, |s| s.providers(PLACEMENT).iter().any(|p| p.as_str() == node).then_some(()))
        .await
        .unwrap_or_else(|| panic!("{node} never announced placement"));
}

#[tokio::test(start_paused = true)]
async fn sim_a_typed_actor_is_called_by_name_with_roles_checked() {
    let specs = vec![node("host", Role::Executor), node("sched", Role::Scheduler), node("cam", Role::Camera)];
    let cluster = SimCluster::start(net(7), specs).await.unwrap();
    let (host, sched, cam) =
        (cluster.node("host").unwrap(), cluster.node("sched").unwrap(), cluster.node("cam").unwrap());

    host.actors.spawn::<Counter>("total", 10).await.unwrap();
    let remote = sched.actors.wait_for::<Counter>("total", T).await.unwrap();
    assert_eq!(remote.node().map(|n| n.to_string()).as_deref(), Some("host"));
    assert_eq!(remote.call(Add(2), T).await.unwrap(), 12, "a scheduler adds across the simulated net");

    let from_cam = cam.actors.wait_for::<Counter>("total", T).await.unwrap();
    assert_eq!(from_cam.call(Get, T).await.unwrap(), 12, "any member reads");
    match from_cam.call(Add(1), T).await {
        Err(ActorError::Forbidden { actor, message, detail }) => {
            assert_eq!((actor.as_str(), message), ("total", "add"));
            assert!(detail.contains("camera") && detail.contains("scheduler"), "{detail}");
        }
        other => panic!("a camera adding: {other:?}"),
    }
    assert_eq!(remote.call(Get, T).await.unwrap(), 12, "the refused add changed nothing");
    assert!(cluster.log().iter().any(|l| l.contains("deliver cam->host Data")), "calls went over the net");
    cluster.shutdown().await;
}

/// Placement rules of the workers: schedulers may place one counter.
fn workers_rules() -> PlacementRules {
    PlacementRules::default().capacity(1).allow(Counter::KIND, Allow::role(Role::Scheduler))
}

/// A supervised counter on w1 or w2; the one holding it crashes; membership declares it down and
/// the supervisor restarts the counter on the other; a call answers from there. The run's log.
/// Node names start with `tag`: ractor's registry is process-wide and the test harness runs
/// tests side by side, so two simulations at once must not share actor names.
async fn crash_and_move(tag: &str, seed: u64) -> Vec<String> {
    let (sup_name, w1, w2) = (format!("{tag}-sup"), format!("{tag}-w1"), format!("{tag}-w2"));
    let specs = vec![
        node(&sup_name, Role::Scheduler),
        node(&w1, Role::Executor).placement(workers_rules()),
        node(&w2, Role::Executor).placement(workers_rules()),
    ];
    let mut cluster = SimCluster::start(net(seed), specs).await.unwrap();
    for w in [&w1, &w2] {
        cluster.node(w).unwrap().actors.register_kind::<Counter>();
    }
    let sup = cluster.node(&sup_name).unwrap();
    for w in [&w1, &w2] {
        wait_placement(&sup.services, w).await;
    }
    let mut events = sup.subscribe_supervision();
    let children = vec![RemoteChild::new::<Counter>("moving", &7).unwrap()];
    let rs = sup.supervise_remote("movers", children, Intensity::default()).await.unwrap();
    let first = ractor::call!(rs, RemoteSupervisorMsg::Children).unwrap()[0].1.clone().expect("placed");
    let h = sup.actors.wait_for::<Counter>("moving", T).await.unwrap();
    assert_eq!(h.call(Add(1), T).await.unwrap(), 8);
    cluster.note(&format!("counter placed on {first}"));

    let mut down = cluster.node(&sup_name).unwrap().subscribe_membership();
    assert!(cluster.crash(first.as_str()).await);
    let declared = tokio::time::timeout(T, async {
        loop {
            if let Ok(troupe_policy::MembershipEvent::Down { member, .. }) = down.recv().await
                && member == first
            {
                return;
            }
        }
    })
    .await;
    assert!(declared.is_ok(), "membership never declared {first} down");
    let ev = tokio::time::timeout(T, events.recv()).await.unwrap().unwrap();
    assert!(matches!(ev, SupervisorEvent::Restarted { ref child, .. } if child == "moving"), "{ev:?}");
    let placed = ractor::call!(rs, RemoteSupervisorMsg::Children).unwrap();
    let now_on = placed[0].1.clone().expect("placed again");
    assert_ne!(now_on, first, "moved off the crashed node");
    let answer = match h.call(Get, T).await {
        Err(ActorError::PeerLost { .. }) => h.call(Get, T).await,
        other => other,
    };
    assert_eq!(answer.unwrap(), 7, "the replacement starts from the child's arguments");
    assert_eq!(h.node(), Some(now_on.clone()));
    cluster.note(&format!("counter answers from {now_on}"));
    rs.stop(None);
    let log = cluster.log();
    cluster.shutdown().await;
    log
}

#[tokio::test(start_paused = true)]
async fn sim_a_crashed_nodes_child_is_restarted_elsewhere() {
    let log = crash_and_move("move", 11).await;
    assert!(log.iter().any(|l| l.contains("test crashes")), "the crash is in the log");
    assert!(log.iter().any(|l| l.contains("sender-crashed") || l.contains("receiver-crashed")));
}

/// One run of the crash scenario on a fresh one-thread runtime with paused time.
fn run(seed: u64) -> Vec<String> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build().unwrap();
    rt.block_on(crash_and_move("same", seed))
}

#[test]
fn sim_one_seed_gives_one_event_log_byte_for_byte() {
    let a = run(3).join("\n");
    let b = run(3).join("\n");
    assert!(a.lines().count() > 100, "a run worth comparing: {} lines", a.lines().count());
    if a != b {
        let at = a.lines().zip(b.lines()).position(|(x, y)| x != y);
        panic!("same seed, different logs: first difference at line {at:?}");
    }
    assert_ne!(a, run(4).join("\n"), "another seed draws other delays");
}

#[tokio::test(start_paused = true)]
async fn sim_a_partition_is_declared_down_and_healing_brings_the_same_actor_back() {
    let specs = vec![node("cut-host", Role::Executor), node("cut-sched", Role::Scheduler)];
    let cluster = SimCluster::start(net(5), specs).await.unwrap();
    let (host, sched) = (cluster.node("cut-host").unwrap(), cluster.node("cut-sched").unwrap());
    host.actors.spawn::<Counter>("kept", 1).await.unwrap();
    let h = sched.actors.wait_for::<Counter>("kept", T).await.unwrap();
    assert_eq!(h.call(Add(1), T).await.unwrap(), 2);
    let incarnation = h.incarnation();

    let view = sched.subscribe_membership();
    let wait_for = |up: bool| {
        let mut view = view.resubscribe();
        async move {
            loop {
                match view.recv().await.unwrap() {
                    troupe_policy::MembershipEvent::Up { member, .. }
                        if up && member.as_str() == "cut-host" =>
                    {
                        return;
                    }
                    troupe_policy::MembershipEvent::Down { member, .. }
                        if !up && member.as_str() == "cut-host" =>
                    {
                        return;
                    }
                    _ => {}
                }
            }
        }
    };
    // a member is declared down only once it was up (heard at a membership tick)
    let up = wait_for(true);
    let members = ractor::call!(sched.membership, troupe_actors::MembershipMsg::Members).unwrap();
    if !members.iter().any(|(m, s, _)| m.as_str() == "cut-host" && *s == troupe_policy::MemberStatus::Up) {
        tokio::time::timeout(T, up).await.expect("the host up");
    }
    let (host_id, sched_id) = (host.name.clone(), sched.name.clone());
    let down = wait_for(false);
    cluster.hub().with_net(|net, now| net.partition(now, &host_id, &sched_id));
    tokio::time::timeout(T, down).await.expect("the cut-off host declared down");
    let refused = h.call(Get, T).await;
    assert!(
        matches!(refused, Err(ActorError::PeerLost { .. }) | Err(ActorError::UnknownActor { .. })),
        "{refused:?}"
    );

    let up = wait_for(true);
    cluster.hub().with_net(|net, now| net.heal(now, &host_id, &sched_id));
    tokio::time::timeout(T, up).await.expect("the healed host up again");
    let again = sched.actors.wait_for::<Counter>("kept", T).await.unwrap();
    assert_eq!(again.call(Get, T).await.unwrap(), 2, "the same actor, its state kept");
    assert_eq!(again.incarnation(), incarnation);
    cluster.shutdown().await;
}

/// A node restarted before its silence times out (the fault explorer's `typed` seed 7): the
/// old process's child is gone with it, so its supervisor places it again — here, or on the
/// other worker — and a call answers from the new incarnation's arguments.
#[tokio::test(start_paused = true)]
async fn sim_a_node_restarted_inside_the_failure_timeout_gets_its_child_placed_again() {
    let specs = vec![
        node("quick-sup", Role::Scheduler),
        node("quick-w1", Role::Executor).placement(workers_rules()),
        node("quick-w2", Role::Executor).placement(workers_rules()),
    ];
    let mut cluster = SimCluster::start(net(13), specs).await.unwrap();
    for w in ["quick-w1", "quick-w2"] {
        cluster.node(w).unwrap().actors.register_kind::<Counter>();
    }
    let sup = cluster.node("quick-sup").unwrap();
    for w in ["quick-w1", "quick-w2"] {
        wait_placement(&sup.services, w).await;
    }
    let mut events = sup.subscribe_supervision();
    let children = vec![RemoteChild::new::<Counter>("quick", &7).unwrap()];
    let rs = sup.supervise_remote("quicks", children, Intensity::default()).await.unwrap();
    let first = ractor::call!(rs, RemoteSupervisorMsg::Children).unwrap()[0].1.clone().expect("placed");
    let h = sup.actors.wait_for::<Counter>("quick", T).await.unwrap();
    assert_eq!(h.call(Add(1), T).await.unwrap(), 8);

    assert!(cluster.crash(first.as_str()).await);
    tokio::time::sleep(Duration::from_millis(200)).await; // well inside the 1 s failure timeout
    let again = cluster.restart(first.as_str()).await.unwrap().expect("restarted");
    again.actors.register_kind::<Counter>();
    let ev = tokio::time::timeout(T, events.recv()).await.expect("the child placed again").unwrap();
    assert!(matches!(ev, SupervisorEvent::Restarted { ref child, .. } if child == "quick"), "{ev:?}");
    let answer = match h.call(Get, T).await {
        Err(ActorError::PeerLost { .. } | ActorError::UnknownActor { .. }) => h.call(Get, T).await,
        other => other,
    };
    assert_eq!(answer.unwrap(), 7, "a fresh incarnation, from the child's arguments");
    assert!(cluster.restart(first.as_str()).await.unwrap().is_none(), "a running node is not restarted");
    rs.stop(None);
    cluster.shutdown().await;
}

/// Services registered one after another while earlier announcements are still on the net: one
/// announcement at a time goes to a peer, read when sent, and those registered meanwhile go in the
/// next, so the peer gets fewer announcements than registrations and ends with the newest list.
/// (Two announcers racing, each reading the list then sending, once delivered an older list
/// after a newer one over QUIC, and a `typed_actors` run lost a registered actor; the simulated
/// net keeps each flow in order and one thread never interleaves a read and its send, so what
/// this checks is the one-at-a-time rule that makes the order hold on any runtime.)
#[tokio::test(start_paused = true)]
async fn sim_announcements_go_one_at_a_time_and_the_last_list_stays() {
    let specs = vec![node("ann-host", Role::Executor), node("ann-sched", Role::Scheduler)];
    let cluster = SimCluster::start(net(21), specs).await.unwrap();
    let (host, sched) = (cluster.node("ann-host").unwrap(), cluster.node("ann-sched").unwrap());
    let mut heard = sched.services.subscribe_announcements();
    let handler: troupe_actors::service::Handler =
        std::sync::Arc::new(|_, _, _| Box::pin(async { Ok(Vec::new()) }));
    let names: Vec<String> = (0..20).map(|i| format!("svc-{i:02}")).collect();
    for name in &names {
        host.services.register(name, troupe_actors::service::ServiceSpec::new(), handler.clone());
        // a millisecond between registrations: shorter than a round trip on the 1-20 ms net
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let all_seen = |s: &Services| {
        let announced = s.directory().into_iter().find(|(n, _)| n.as_str() == "ann-host")?.1;
        names.iter().all(|n| announced.contains(n)).then_some(())
    };
    sched.services.wait_for(T, all_seen).await.expect("the last list arrived");
    // every announcement is delivered within the net's 20 ms: a second of virtual time later
    // nothing sent before is still on its way
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        all_seen(&sched.services).is_some(),
        "an older list replaced the newest: {:?}",
        sched.services.directory()
    );
    let mut from_host = 0;
    while let Ok(peer) = heard.try_recv() {
        from_host += usize::from(peer.as_str() == "ann-host");
    }
    assert!(
        (1..names.len()).contains(&from_host),
        "{from_host} announcements for {} registrations: more than one was in flight at a time",
        names.len()
    );
    cluster.shutdown().await;
}

//! The `typed` workload of the fault explorer (simulation only): a client on a scheduler node
//! submits numbered requests to a supervised typed actor placed on one of three workers; when
//! its worker crashes or is cut off, the remote supervisor restarts it on another.
//!
//! The client retries a request only when the runtime says it was not answered (a timeout, the
//! incarnation lost, no actor by that name yet): the actor's answer is a pure function of the
//! request, so a request carried out twice answers the same, and each request keeps its first
//! answer. Requests start staggered so they meet the schedule's faults.

use std::time::Duration;

use tokio::task::JoinSet;
use troupe_transport::{Role, RoleSet};

use super::{Answers, SimWorkload};
use crate::membership::MembershipConfig;
use crate::service::Allow;
use crate::sim::{SimNode, SimNodeSpec};
use crate::supervisor::Intensity;
use crate::typed::{
    ActorContext, ActorFailure, ActorHandle, Handles, PLACEMENT, PlacementRules, Protocol, RemoteChild,
    RemoteMessage, RemoteSupervisor, TypedActor,
};

/// A request: its number.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Work(pub u64);

impl RemoteMessage for Work {
    const NAME: &'static str = "work";
    type Reply = u64;
}

/// The supervised actor: answers request `i` with `i * i + salt` (its start argument).
pub struct SimSquarer {
    salt: u64,
}

impl TypedActor for SimSquarer {
    const KIND: &'static str = "sim-squarer";
    type Args = u64;
    fn protocol(p: &mut Protocol<Self>) {
        p.request::<Work>(Allow::role(Role::Scheduler));
    }
    async fn start(salt: u64, _: &ActorContext) -> Result<Self, ActorFailure> {
        Ok(SimSquarer { salt })
    }
}

impl Handles<Work> for SimSquarer {
    async fn handle(&mut self, Work(i): Work, _: &ActorContext) -> Result<u64, ActorFailure> {
        Ok(i.wrapping_mul(i).wrapping_add(self.salt))
    }
}

/// The workload: `requests` requests, one every `stagger` of virtual time.
#[derive(Clone, Copy, Debug)]
pub struct TypedWorkload {
    /// How many requests.
    pub requests: u64,
    /// Virtual time between two requests' starts.
    pub stagger: Duration,
}

impl Default for TypedWorkload {
    fn default() -> Self {
        Self { requests: 24, stagger: Duration::from_millis(300) }
    }
}

/// The salt the actor starts from.
const SALT: u64 = 7;
/// One call's timeout.
const CALL: Duration = Duration::from_secs(1);
/// The pause after a failed try.
const BACKOFF: Duration = Duration::from_millis(250);
/// Tries per request before the client gives up (40 tries span ~50 s, past any schedule).
const TRIES: u32 = 40;

fn spec(name: &str, role: Role) -> SimNodeSpec {
    SimNodeSpec::new(name, RoleSet::only(role)).membership(MembershipConfig {
        heartbeat: Duration::from_millis(100),
        timeout: Duration::from_millis(1000),
    })
}

impl SimWorkload for TypedWorkload {
    fn name(&self) -> &'static str {
        "typed"
    }

    fn nodes(&self, tag: &str) -> Vec<SimNodeSpec> {
        let rules =
            PlacementRules::default().capacity(1).allow(SimSquarer::KIND, Allow::role(Role::Scheduler));
        let mut nodes = vec![spec(&format!("{tag}-client"), Role::Scheduler)];
        nodes.extend((1..=3).map(|i| spec(&format!("{tag}-w{i}"), Role::Executor).placement(rules.clone())));
        nodes
    }

    fn prepare(&self, node: &SimNode) {
        node.actors.register_kind::<SimSquarer>();
    }

    fn client(&self, tag: &str, node: &SimNode) -> impl Future<Output = Answers> + Send + 'static {
        let name = format!("{tag}-squarer");
        let child = RemoteChild::new::<SimSquarer>(&name, &SALT);
        let args =
            child.map(|c| node.remote_supervisor_args(&format!("{tag}-sup"), vec![c], Intensity::default()));
        let (actors, services, this) = (node.actors.clone(), node.services.clone(), *self);
        async move {
            let all = || Answers { given_up: (0..this.requests).collect(), ..Answers::default() };
            // placement needs a worker's announcement; without one in time the supervisor waits
            let _ = services.wait_for(CALL, |s| (!s.providers(PLACEMENT).is_empty()).then_some(())).await;
            let Ok(args) = args else { return all() };
            let Ok((sup, _)) = ractor::Actor::spawn(None, RemoteSupervisor, args).await else { return all() };
            let handle = ActorHandle::<SimSquarer>::by_name(&actors, &name);
            let mut calls = JoinSet::new();
            for i in 0..this.requests {
                let h = handle.clone();
                calls.spawn(async move {
                    tokio::time::sleep(this.stagger * u32::try_from(i).unwrap_or(u32::MAX)).await;
                    for _ in 0..TRIES {
                        match h.call(Work(i), CALL).await {
                            Ok(out) => return (i, Some(out)),
                            Err(_) => tokio::time::sleep(BACKOFF).await,
                        }
                    }
                    (i, None)
                });
            }
            let mut answers = Answers::default();
            while let Some(done) = calls.join_next().await {
                match done {
                    Ok((i, Some(out))) => answers.answers.entry(i).or_default().push(out),
                    Ok((i, None)) => answers.given_up.push(i),
                    Err(_) => {}
                }
            }
            answers.given_up.sort_unstable();
            sup.stop(None);
            answers
        }
    }
}

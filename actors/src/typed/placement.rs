//! Supervision across nodes.
//!
//! Hosting side: every node serves `troupe-placement`. A supervisor on another node asks it for
//! room (`capacity`: how many children it hosts of how many it declares, and which kinds this
//! caller may place) and places a child (`place`: kind, name, archived arguments, generation).
//! Placing is role-checked per kind by the node's [`PlacementRules`] (from its config), bounded
//! by its declared capacity, and needs the kind registered in the node's code
//! ([`Actors::register_kind`]); each refusal names its reason.
//!
//! Supervising side: a [`RemoteSupervisor`] owns children placed on other nodes (or its own).
//! The choice of node is `troupe_policy::placement::choose`. When a child's node is declared
//! down, it restarts the child on another eligible node within its restart intensity
//! (`troupe_policy::RestartIntensity`), escalating as OTP does past it: the supervisor itself
//! fails, and its own supervisor decides. Each placement has a higher generation, so a name
//! resolves to the newest incarnation even while an old node still answers.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tokio::sync::broadcast;
use tracing::{info, warn};
use troupe_policy::placement::{Candidate, NoPlacement, choose};
use troupe_policy::{MembershipEvent, RestartDecision, RestartIntensity};
use troupe_transport::service::FaultKind;
use troupe_transport::{NodeId, RuntimeLink};

use super::actor::TypedActor;
use super::registry::{Actors, SpawnError};
use super::wire::Wire;
use crate::clock::Clock;
use crate::service::{Allow, Caller, ClassedHandler, ServiceSpec};
use crate::supervisor::{Intensity, SupervisorEvent};

/// The placement service every node runs.
pub const PLACEMENT: &str = "troupe-placement";
const PLACE: &str = "place";
const CAPACITY: &str = "capacity";
/// How long one placement call may take.
const PLACE_TIMEOUT: Duration = Duration::from_secs(10);
const CAPACITY_TIMEOUT: Duration = Duration::from_secs(2);

/// Which kinds others may place on this node, by the caller's certificate roles, and how many
/// placed children it hosts at most. The default accepts none.
#[derive(Clone, Debug, Default)]
pub struct PlacementRules {
    /// Children placed here at most (all kinds together).
    pub capacity: u32,
    /// Per kind, who may place it.
    pub kinds: BTreeMap<String, Allow>,
}

impl PlacementRules {
    /// Lets callers `allow` place `kind` here.
    pub fn allow(mut self, kind: &str, allow: Allow) -> Self {
        self.kinds.insert(kind.to_string(), allow);
        self
    }

    /// Hosts at most `capacity` placed children.
    pub fn capacity(mut self, capacity: u32) -> Self {
        self.capacity = capacity;
        self
    }

    fn permits(&self, kind: &str, caller: &Caller, member: bool) -> bool {
        match self.kinds.get(kind) {
            Some(Allow::AnyMember) => member,
            Some(Allow::Roles(set)) => caller.roles.intersects(*set),
            None => false,
        }
    }
}

/// A child placed on this node by a supervisor elsewhere.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placed {
    /// Its kind.
    pub kind: String,
    /// Its generation.
    pub generation: u64,
    /// The supervising node.
    pub by: NodeId,
}

type SpawnFuture = Pin<Box<dyn Future<Output = Result<(), SpawnError>> + Send>>;
type Spawner = Arc<dyn Fn(Actors, String, Vec<u8>, u64) -> SpawnFuture + Send + Sync>;

/// A node's placement side: its rules, the kinds its code can start, what it hosts.
pub(crate) struct PlacementState {
    pub rules: PlacementRules,
    pub kinds: DashMap<&'static str, Spawner>,
    pub placed: DashMap<String, Placed>,
}

impl PlacementState {
    pub fn new(rules: PlacementRules) -> Self {
        Self { rules, kinds: DashMap::new(), placed: DashMap::new() }
    }
}

/// A placement request.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub struct PlaceRequest {
    /// The kind ([`TypedActor::KIND`]).
    pub kind: String,
    /// The child's name.
    pub name: String,
    /// Its arguments, archived ([`TypedActor::Args`]).
    pub args: Vec<u8>,
    /// The placement's generation (newer wins).
    pub generation: u64,
}

/// What a node answers to `capacity`.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Room {
    /// Placed children it hosts at most.
    pub capacity: u32,
    /// Placed children it hosts now.
    pub hosted: u32,
    /// The kinds this caller may place there (by role, and registered in its code).
    pub kinds: Vec<String>,
}

impl Actors {
    /// Lets this node start `A` when a supervisor places one here (its config's placement
    /// rules still decide who may).
    pub fn register_kind<A: TypedActor>(&self) {
        let spawner: Spawner = Arc::new(|actors: Actors, name: String, args: Vec<u8>, generation: u64| {
            Box::pin(async move {
                let args = A::Args::from_wire("placement arguments", &args)
                    .map_err(|e| SpawnError::Start { name: name.clone(), detail: e.to_string() })?;
                actors.spawn_generation::<A>(&name, args, generation).await
            })
        });
        self.placement_state().kinds.insert(A::KIND, spawner);
    }

    /// What this node hosts for supervisors elsewhere, by name.
    pub fn placed_children(&self) -> Vec<(String, Placed)> {
        let mut v: Vec<_> =
            self.placement_state().placed.iter().map(|e| (e.key().clone(), e.value().clone())).collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    fn room_for(&self, caller: &Caller, member: bool) -> Room {
        let st = self.placement_state();
        let mut kinds: Vec<String> = st
            .kinds
            .iter()
            .map(|e| e.key().to_string())
            .filter(|k| st.rules.permits(k, caller, member))
            .collect();
        kinds.sort();
        Room { capacity: st.rules.capacity, hosted: st.placed.len() as u32, kinds }
    }

    /// Carries out a placement for `caller` (from a peer, or this node's own supervisor).
    async fn place(
        &self,
        caller: &Caller,
        member: bool,
        req: PlaceRequest,
    ) -> Result<(), (FaultKind, String)> {
        let me = self.node().clone();
        let st = self.placement_state();
        if !st.rules.permits(&req.kind, caller, member) {
            return Err((
                FaultKind::Forbidden,
                format!(
                    "role {} of {} may not place a {} on {me} (its placement rules allow {:?})",
                    caller.roles,
                    caller.node,
                    req.kind,
                    st.rules.kinds.keys().collect::<Vec<_>>()
                ),
            ));
        }
        let Some(spawner) = st.kinds.get(req.kind.as_str()).map(|s| s.clone()) else {
            return Err((
                FaultKind::BadRequest,
                format!("node {me} has no code for actor kind {:?}", req.kind),
            ));
        };
        let replacing = match st.placed.get(&req.name).map(|p| p.clone()) {
            Some(old) if old.generation >= req.generation => {
                return Err((
                    FaultKind::BadRequest,
                    format!(
                        "{:?} is already placed here at generation {} (asked: {})",
                        req.name, old.generation, req.generation
                    ),
                ));
            }
            Some(_) => true,
            None => false,
        };
        if !replacing && st.placed.len() as u32 >= st.rules.capacity {
            return Err((
                FaultKind::Busy,
                format!("node {me} hosts {} placed children, its declared capacity", st.rules.capacity),
            ));
        }
        if replacing {
            self.stop(&req.name);
        }
        st.placed.insert(
            req.name.clone(),
            Placed { kind: req.kind.clone(), generation: req.generation, by: caller.node.clone() },
        );
        if let Err(e) = spawner(self.clone(), req.name.clone(), req.args, req.generation).await {
            st.placed.remove(&req.name);
            return Err((FaultKind::Failed, e.to_string()));
        }
        info!(actor = %req.name, kind = %req.kind, by = %caller.node, generation = req.generation, "child placed here");
        Ok(())
    }
}

/// Registers the placement service on `actors`' router.
pub(crate) fn serve(actors: &Actors) {
    let weak = Arc::downgrade(&actors.arc());
    let handler: ClassedHandler = Arc::new(move |caller: Caller, method: String, body: Vec<u8>| {
        let actors = weak.upgrade().map(Actors::from_arc);
        Box::pin(async move {
            let actors = actors.ok_or((FaultKind::Gone, "the node is stopping".to_string()))?;
            let member = actors.link().is_member(&caller.node);
            match method.as_str() {
                CAPACITY => actors.room_for(&caller, member).to_wire().map_err(|e| (FaultKind::Failed, e)),
                PLACE => {
                    let req = PlaceRequest::from_wire("PlaceRequest", &body)
                        .map_err(|e| (FaultKind::BadRequest, e.to_string()))?;
                    actors.place(&caller, member, req).await.map(|()| Vec::new())
                }
                other => Err((FaultKind::UnknownMethod, format!("{PLACEMENT} has no method {other:?}"))),
            }
        })
    });
    // any member may ask; the per-kind role check is the placement rules'
    let spec = ServiceSpec::new().method(CAPACITY, Allow::AnyMember).method(PLACE, Allow::AnyMember);
    actors.services().register_classed(PLACEMENT, spec, handler);
}

// ---- supervising side ------------------------------------------------------------------------

/// A child a [`RemoteSupervisor`] places: its name, kind and archived arguments.
#[derive(Clone, Debug)]
pub struct RemoteChild {
    /// Its name (unique in the cluster).
    pub name: String,
    /// Its kind.
    pub kind: &'static str,
    args: Vec<u8>,
}

impl RemoteChild {
    /// A child of kind `A` named `name` started from `args`.
    pub fn new<A: TypedActor>(name: &str, args: &A::Args) -> Result<Self, SpawnError> {
        super::registry::validate_name(name)?;
        let args = args.to_wire().map_err(|detail| SpawnError::Start { name: name.into(), detail })?;
        Ok(Self { name: name.to_string(), kind: A::KIND, args })
    }
}

/// Start arguments of a [`RemoteSupervisor`].
pub struct RemoteSupervisorArgs {
    /// Name in events and logs.
    pub name: String,
    /// The node's actor registry (it places through it).
    pub actors: Actors,
    /// The children.
    pub children: Vec<RemoteChild>,
    /// Restart intensity over all its children.
    pub intensity: Intensity,
    /// Where its restarts and escalations are published.
    pub events: broadcast::Sender<SupervisorEvent>,
    /// The node's membership events (children move when their node goes down).
    pub membership: broadcast::Sender<MembershipEvent<NodeId>>,
}

/// Messages of a [`RemoteSupervisor`].
pub enum RemoteSupervisorMsg {
    /// A member was declared down.
    Down(NodeId),
    /// A member came (back) up: children waiting for room are placed again.
    Up(NodeId),
    /// Where each child runs now (`None`: waiting for an eligible node).
    Children(RpcReplyPort<Vec<(String, Option<NodeId>)>>),
}

impl ractor::Message for RemoteSupervisorMsg {}

/// The supervisor of children on other nodes (see the module doc).
pub struct RemoteSupervisor;

/// Its state.
pub struct RemoteSupervisorState {
    args: RemoteSupervisorArgs,
    at: Vec<Option<NodeId>>,
    down: Vec<NodeId>,
    intensity: RestartIntensity,
    clock: Clock,
    /// The highest generation it placed a child at.
    last_generation: u64,
    forward: tokio::task::JoinHandle<()>,
}

impl RemoteSupervisorState {
    /// Places child `i` on the best eligible node not down; `Ok(None)` when none has room now.
    async fn place(&mut self, i: usize) -> Result<Option<NodeId>, String> {
        let actors = &self.args.actors;
        let child = &self.args.children[i];
        let generation =
            troupe_policy::placement::next_generation(self.last_generation, crate::clock::wall_micros());
        self.last_generation = generation;
        let me = actors.node().clone();
        let mut candidates = Vec::new();
        for node in
            actors.link().peers().into_iter().filter(|p| actors.link().is_member(p)).chain([me.clone()])
        {
            if self.down.contains(&node) || actors.is_down(&node) {
                continue;
            }
            let room = if node == me {
                Some(actors.room_for(&self_caller(actors), true))
            } else {
                match actors.services().call(&node, PLACEMENT, CAPACITY, Vec::new(), CAPACITY_TIMEOUT).await {
                    Ok(bytes) => Room::from_wire("Room", &bytes).ok(),
                    Err(_) => None,
                }
            };
            if let Some(room) = room {
                candidates.push(Candidate {
                    eligible: room.kinds.iter().any(|k| k == child.kind),
                    capacity: room.capacity,
                    hosted: room.hosted,
                    node,
                });
            }
        }
        let mut refused = self.down.clone();
        loop {
            let node = match choose(&candidates, &refused) {
                Ok(n) => n.clone(),
                Err(why) => {
                    let why = match why {
                        NoPlacement::NoEligibleNode => "no member may host it",
                        NoPlacement::AllFull => "every eligible member is at its capacity",
                    };
                    warn!(supervisor = %self.args.name, child = %child.name, kind = child.kind, why, "child waits for a node");
                    return Ok(None);
                }
            };
            let req = PlaceRequest {
                kind: child.kind.to_string(),
                name: child.name.clone(),
                args: child.args.clone(),
                generation,
            };
            let placed = if node == me {
                actors.place(&self_caller(actors), true, req).await.map_err(|(_, m)| m)
            } else {
                let body = req.to_wire()?;
                actors
                    .services()
                    .call(&node, PLACEMENT, PLACE, body, PLACE_TIMEOUT)
                    .await
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            };
            match placed {
                Ok(()) => {
                    info!(supervisor = %self.args.name, child = %child.name, %node, "child placed");
                    return Ok(Some(node));
                }
                Err(e) => {
                    warn!(supervisor = %self.args.name, child = %child.name, %node, error = %e, "placement refused; trying another node");
                    refused.push(node);
                }
            }
        }
    }

    async fn place_waiting(&mut self) -> Result<(), String> {
        for i in 0..self.at.len() {
            if self.at[i].is_none() {
                self.at[i] = self.place(i).await?;
            }
        }
        Ok(())
    }
}

fn self_caller(actors: &Actors) -> Caller {
    Caller { node: actors.node().clone(), roles: actors.link().local_roles(), one_way: false }
}

impl Actor for RemoteSupervisor {
    type Msg = RemoteSupervisorMsg;
    type State = RemoteSupervisorState;
    type Arguments = RemoteSupervisorArgs;

    async fn pre_start(
        &self,
        me: ActorRef<Self::Msg>,
        args: RemoteSupervisorArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let mut events = args.membership.subscribe();
        let forward = tokio::spawn(async move {
            loop {
                let msg = match events.recv().await {
                    Ok(MembershipEvent::Down { member, .. }) => RemoteSupervisorMsg::Down(member),
                    Ok(MembershipEvent::Up { member, .. }) => RemoteSupervisorMsg::Up(member),
                    Err(broadcast::error::RecvError::Lagged(_)) => continue,
                    Err(broadcast::error::RecvError::Closed) => return,
                };
                if me.cast(msg).is_err() {
                    return;
                }
            }
        });
        let n = args.children.len();
        let intensity = RestartIntensity::new(
            args.intensity.max_restarts,
            troupe_policy::Micros::from_duration(args.intensity.period),
        );
        let mut st = RemoteSupervisorState {
            args,
            at: vec![None; n],
            down: Vec::new(),
            intensity,
            clock: Clock::start(),
            last_generation: 0,
            forward,
        };
        st.place_waiting().await?;
        Ok(st)
    }

    async fn post_stop(
        &self,
        _me: ActorRef<Self::Msg>,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        st.forward.abort();
        Ok(())
    }

    async fn handle(
        &self,
        _me: ActorRef<Self::Msg>,
        msg: Self::Msg,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            RemoteSupervisorMsg::Down(node) => {
                if !st.down.contains(&node) {
                    st.down.push(node.clone());
                }
                for i in 0..st.at.len() {
                    if st.at[i].as_ref() != Some(&node) {
                        continue;
                    }
                    st.at[i] = None;
                    let child = st.args.children[i].name.clone();
                    let reason = format!("its node {node} was declared down");
                    match st.intensity.handle_failure(st.clock.now()) {
                        RestartDecision::Restart => {
                            st.at[i] = st.place(i).await?;
                            let _ = st.args.events.send(SupervisorEvent::Restarted {
                                supervisor: st.args.name.clone(),
                                child,
                                in_window: st.intensity.restarts_in_window(),
                                reason,
                            });
                        }
                        RestartDecision::Escalate => {
                            let _ = st.args.events.send(SupervisorEvent::Escalated {
                                supervisor: st.args.name.clone(),
                                child: child.clone(),
                                reason: reason.clone(),
                            });
                            return Err(format!(
                                "remote supervisor {}: child {child} exceeded its restart intensity: {reason}",
                                st.args.name
                            )
                            .into());
                        }
                    }
                }
            }
            RemoteSupervisorMsg::Up(member) => {
                // only the member heard again: a killed node stays connected (so listed among the
                // link's peers) until its connection times out, and must stay excluded till then
                st.down.retain(|n| *n != member);
                st.place_waiting().await?;
            }
            RemoteSupervisorMsg::Children(reply) => {
                let list =
                    st.args.children.iter().zip(&st.at).map(|(c, at)| (c.name.clone(), at.clone())).collect();
                let _ = reply.send(list);
            }
        }
        Ok(())
    }
}

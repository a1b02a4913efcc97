//! One node of a simulated cluster (simulation only): the real membership actor, service
//! router, typed-actor registry and root supervisor over a [`SimLink`], as
//! [`crate::NodeRuntime`] wires them over QUIC.

use ractor::concurrency::JoinHandle;
use ractor::{Actor, ActorRef};
use tokio::sync::broadcast;
use tracing::{debug, warn};
use troupe_policy::MembershipEvent;
use troupe_transport::{FrameKind, Link, NodeId, NodeLink, RoleSet, SimHub};

use crate::membership::{Membership, MembershipArgs, MembershipConfig, MembershipMsg};
use crate::node::{MembershipEvents, ROOT, RuntimeError};
use crate::service::{ServiceConfig, Services};
use crate::supervisor::{Intensity, Supervisor, SupervisorArgs, SupervisorEvent, SupervisorMsg};
use crate::typed::{
    Actors, PlacementRules, RemoteChild, RemoteSupervisor, RemoteSupervisorArgs, RemoteSupervisorMsg,
};
use crate::wire::Heartbeat;

/// What a simulated node is: its name, its roles (what its certificate would say), which kinds
/// others may place on it, and its membership periods.
#[derive(Clone, Debug)]
pub struct SimNodeSpec {
    /// The node's name.
    pub name: NodeId,
    /// Its roles, checked by the router as a certificate's are.
    pub roles: RoleSet,
    /// Which kinds supervisors elsewhere may place here, and how many.
    pub placement: PlacementRules,
    /// Heartbeat period and failure timeout.
    pub membership: MembershipConfig,
}

impl SimNodeSpec {
    /// A node `name` with `roles`, no placements allowed and the default membership periods.
    pub fn new(name: &str, roles: RoleSet) -> Self {
        Self {
            name: NodeId::new(name),
            roles,
            placement: PlacementRules::default(),
            membership: MembershipConfig::default(),
        }
    }

    /// These placement rules.
    pub fn placement(mut self, placement: PlacementRules) -> Self {
        self.placement = placement;
        self
    }

    /// These membership periods.
    pub fn membership(mut self, membership: MembershipConfig) -> Self {
        self.membership = membership;
        self
    }
}

/// A running simulated node.
pub struct SimNode {
    /// This node's name.
    pub name: NodeId,
    /// Role-checked service calls (serving and calling).
    pub services: Services,
    /// Typed actors: spawn by name here, reach any member's by name.
    pub actors: Actors,
    /// The membership actor.
    pub membership: ActorRef<MembershipMsg>,
    /// The root supervisor.
    pub supervisor: ActorRef<SupervisorMsg>,
    membership_events: MembershipEvents,
    supervisor_events: broadcast::Sender<SupervisorEvent>,
    supervisor_handle: JoinHandle<()>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl SimNode {
    /// Starts the node on `hub`.
    pub async fn start(hub: &SimHub, spec: SimNodeSpec) -> Result<Self, RuntimeError> {
        let spawn_err = |what: &'static str| {
            move |e: ractor::SpawnErr| RuntimeError::Spawn { what, detail: e.to_string() }
        };
        hub.set_roles(&spec.name, spec.roles);
        let link = NodeLink::from(hub.link(spec.name.clone()));
        let (membership_events, _) = broadcast::channel(1024);
        let (membership, _) = Actor::spawn(
            None,
            Membership,
            MembershipArgs { link: link.clone(), config: spec.membership, events: membership_events.clone() },
        )
        .await
        .map_err(spawn_err("membership"))?;
        let services = Services::new(link.clone(), ServiceConfig::default());
        let actors = Actors::new(link.clone(), services.clone(), spec.placement);
        let tasks = vec![
            tokio::spawn(drain(link.clone())),
            tokio::spawn(follow_peers(membership_events.subscribe(), hub.clone(), services.clone())),
            actors.follow_membership(&membership_events),
        ];
        let (supervisor_events, _) = broadcast::channel(1024);
        let args = SupervisorArgs {
            name: ROOT.to_string(),
            children: Vec::new(),
            intensity: Intensity::default(),
            events: supervisor_events.clone(),
        };
        let (supervisor, supervisor_handle) = match Actor::spawn(None, Supervisor, args).await {
            Ok(s) => s,
            Err(e) => {
                tasks.iter().for_each(|t| t.abort());
                return Err(spawn_err("root supervisor")(e));
            }
        };
        actors.set_supervisor(supervisor.clone());
        debug!(node = %spec.name, "simulated node started");
        Ok(Self {
            name: spec.name,
            services,
            actors,
            membership,
            supervisor,
            membership_events,
            supervisor_events,
            supervisor_handle,
            tasks,
        })
    }

    /// Membership events (up, down) from now on.
    pub fn subscribe_membership(&self) -> broadcast::Receiver<MembershipEvent<NodeId>> {
        self.membership_events.subscribe()
    }

    /// The sender of membership events (what a shell that subscribes later is given).
    pub fn membership_events(&self) -> &MembershipEvents {
        &self.membership_events
    }

    /// Supervision events (restarts, escalations) from now on.
    pub fn subscribe_supervision(&self) -> broadcast::Receiver<SupervisorEvent> {
        self.supervisor_events.subscribe()
    }

    /// Starts a supervisor of children placed on members (or here), as
    /// [`crate::NodeRuntime::supervise_remote`] does.
    pub async fn supervise_remote(
        &self,
        name: &str,
        children: Vec<RemoteChild>,
        intensity: Intensity,
    ) -> Result<ActorRef<RemoteSupervisorMsg>, RuntimeError> {
        let args = self.remote_supervisor_args(name, children, intensity);
        let (sup, _) = Actor::spawn(None, RemoteSupervisor, args)
            .await
            .map_err(|e| RuntimeError::Spawn { what: "remote supervisor", detail: e.to_string() })?;
        Ok(sup)
    }

    /// What [`Self::supervise_remote`] starts its supervisor with, for a caller that spawns it
    /// later from a task of its own (the explorer's clients).
    pub fn remote_supervisor_args(
        &self,
        name: &str,
        children: Vec<RemoteChild>,
        intensity: Intensity,
    ) -> RemoteSupervisorArgs {
        RemoteSupervisorArgs {
            name: name.to_string(),
            actors: self.actors.clone(),
            children,
            intensity,
            events: self.supervisor_events.clone(),
            membership: self.membership_events.clone(),
        }
    }

    /// Stops the node's actors and tasks (as a crash does to a process, when the hub has
    /// crashed its link first).
    pub async fn stop(mut self) {
        self.supervisor.stop(None);
        let _ = (&mut self.supervisor_handle).await;
        self.membership.stop(None);
        for t in self.tasks.drain(..) {
            t.abort();
        }
    }
}

/// Takes the frames the router does not: heartbeats count through the hub's heard marks, so
/// they are only checked here; anything else has no handler on a simulated node.
async fn drain(link: NodeLink) {
    while let Ok(d) = link.recv().await {
        match d.frame.kind {
            FrameKind::Heartbeat => {
                if let Err(e) = d.frame.access::<Heartbeat>() {
                    warn!(peer = %d.from, error = %e, "invalid heartbeat");
                }
            }
            kind => debug!(node = %link.local_id(), peer = %d.from, ?kind, "no handler for frame"),
        }
    }
}

/// What QUIC's connection events do for the router, from the membership view: a member that
/// comes up is told what this node serves; a member declared down that has crashed has left, as
/// its QUIC connection would have reset: its announcements are forgotten. A member only cut off
/// stays a peer, as a QUIC connection outlives a partition shorter than its idle timeout (10 s;
/// the explorer's outages last at most 4 s): forgetting it there, when the other side need not
/// have declared this node down and so never announced again, left a camera without the edge
/// for good (coadapt seed 73). (Its pending calls fail through [`Actors::follow_membership`].)
async fn follow_peers(
    mut events: broadcast::Receiver<MembershipEvent<NodeId>>,
    hub: SimHub,
    services: Services,
) {
    loop {
        match events.recv().await {
            Ok(MembershipEvent::Up { member, .. }) => services.peer_joined(&member),
            Ok(MembershipEvent::Down { member, .. }) => {
                if hub.with_net(|net, _| net.is_crashed(&member)) {
                    services.peer_left(&member, "crashed on the simulated net");
                }
            }
            Err(broadcast::error::RecvError::Lagged(_)) => continue,
            Err(broadcast::error::RecvError::Closed) => return,
        }
    }
}

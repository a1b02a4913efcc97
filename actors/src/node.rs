//! The node runtime: one QUIC endpoint, the ractor_cluster control plane over it, membership,
//! and a root supervisor with the node's actors. `troupe node` runs one; services embed one.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use ractor::concurrency::JoinHandle;
use ractor::{Actor, ActorRef};
use ractor_cluster::NodeServerMessage;
use tokio::sync::broadcast;
use tracing::{debug, info, warn};
use troupe_policy::{MemberStatus, MembershipEvent};
use troupe_transport::{
    Channel, Delivery, Frame, FrameKind, Link, NodeId, NodeIdentity, PeerEvent, QuicConfig, QuicError,
    QuicNode,
};

use crate::address::HostPort;
use crate::cluster::{ControlBidi, open_session, start_node_server};
use crate::kinds::device::DeviceMsg;
use crate::membership::{Membership, MembershipArgs, MembershipConfig, MembershipMsg};
use crate::service::{ServiceConfig, Services};
use crate::supervisor::{ChildSpec, Intensity, Supervisor, SupervisorArgs, SupervisorEvent, SupervisorMsg};
use crate::typed::{
    Actors, PlacementRules, RemoteChild, RemoteSupervisor, RemoteSupervisorArgs, RemoteSupervisorMsg,
};
use crate::wire::{ArchivedControlMsg, ControlMsg, DeviceView, Heartbeat, MemberView, NodeStatus};

/// Name of every node's root supervisor in events.
pub const ROOT: &str = "root";

/// A peer this node dials (and dials again whenever the connection is lost).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerAddr {
    /// The peer's node name (checked against its certificate).
    pub name: NodeId,
    /// Where it listens: `IP:port`, or `host:port` resolved again at every dial.
    pub addr: crate::address::HostPort,
}

/// Builds the root supervisor's children from the node's link, service router, membership
/// events (subscribe for up/down of members) and typed-actor registry (typed actors started
/// with the node: [`Actors::child_spec`]).
pub type Children = Box<
    dyn FnOnce(&QuicNode, &Services, &MembershipEvents, &Actors) -> Result<Vec<ChildSpec>, String> + Send,
>;

/// Where a node's membership events are published (subscribe for up, down, rejoined).
pub type MembershipEvents = broadcast::Sender<MembershipEvent<NodeId>>;

/// Children that need nothing from the link.
pub fn fixed_children(children: Vec<ChildSpec>) -> Children {
    Box::new(move |_, _, _, _| Ok(children))
}

/// Everything a node runtime needs to start.
pub struct NodeSpec {
    /// This node's certificate, key and cluster CA.
    pub identity: NodeIdentity,
    /// QUIC settings (bind address, frame cap, timeouts).
    pub quic: QuicConfig,
    /// Peers to dial.
    pub peers: Vec<PeerAddr>,
    /// Heartbeat period and failure timeout.
    pub membership: MembershipConfig,
    /// Root supervisor restart intensity.
    pub intensity: Intensity,
    /// ractor_cluster cookie: the per-cluster secret `troupe keys init` writes (on top of mutual
    /// TLS, which is where identity comes from).
    pub cookie: String,
    /// Makes the actors the root supervisor starts, once the link exists (actors may need it).
    pub children: Children,
    /// Pause between dial attempts to a missing peer.
    pub redial: Duration,
    /// Which kinds supervisors elsewhere may place on this node, and how many.
    pub placement: PlacementRules,
}

impl NodeSpec {
    /// A spec with the defaults (any free port on 127.0.0.1, no peers, default
    /// membership, intensity and placement rules, no children, redial every second), for the
    /// builder methods below: `NodeSpec::new(id, cookie).bind(addr).peer(p).children(c)`.
    pub fn new(identity: NodeIdentity, cookie: impl Into<String>) -> Self {
        Self {
            identity,
            quic: QuicConfig::default(),
            peers: Vec::new(),
            membership: MembershipConfig::default(),
            intensity: Intensity::default(),
            cookie: cookie.into(),
            children: fixed_children(Vec::new()),
            redial: Duration::from_secs(1),
            placement: PlacementRules::default(),
        }
    }

    /// Listens on `addr` (the rest of the QUIC settings unchanged).
    pub fn bind(mut self, addr: SocketAddr) -> Self {
        self.quic.bind = addr;
        self
    }

    /// These QUIC settings.
    pub fn quic(mut self, quic: QuicConfig) -> Self {
        self.quic = quic;
        self
    }

    /// Dials `peer` too (and redials it when lost).
    pub fn peer(mut self, peer: PeerAddr) -> Self {
        self.peers.push(peer);
        self
    }

    /// Dials each of `peers` too.
    pub fn peers(mut self, peers: impl IntoIterator<Item = PeerAddr>) -> Self {
        self.peers.extend(peers);
        self
    }

    /// This heartbeat period and failure timeout.
    pub fn membership(mut self, membership: MembershipConfig) -> Self {
        self.membership = membership;
        self
    }

    /// This root supervisor restart intensity.
    pub fn intensity(mut self, intensity: Intensity) -> Self {
        self.intensity = intensity;
        self
    }

    /// The root supervisor's children, made once the link exists.
    pub fn children(mut self, children: Children) -> Self {
        self.children = children;
        self
    }

    /// This pause between dial attempts to a missing peer.
    pub fn redial(mut self, redial: Duration) -> Self {
        self.redial = redial;
        self
    }

    /// Which kinds supervisors elsewhere may place on this node, and how many.
    pub fn placement(mut self, placement: PlacementRules) -> Self {
        self.placement = placement;
        self
    }
}

/// Why the runtime failed.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// Transport failure.
    #[error(transparent)]
    Quic(#[from] QuicError),
    /// An actor failed to start.
    #[error("starting {what}: {detail}")]
    Spawn {
        /// Which actor.
        what: &'static str,
        /// The error.
        detail: String,
    },
    /// The root supervisor gave up: a child exceeded its restart intensity.
    #[error("root supervisor escalated: {0}")]
    Escalated(String),
    /// A status query failed.
    #[error("status: {0}")]
    Status(String),
}

/// Handler for application frames (everything the runtime does not consume itself).
pub type FrameHandler = Arc<dyn Fn(Delivery) + Send + Sync>;

/// A running node.
pub struct NodeRuntime {
    /// This node's name.
    pub name: NodeId,
    /// The QUIC link (data plane).
    pub link: QuicNode,
    /// The membership actor.
    pub membership: ActorRef<MembershipMsg>,
    /// The root supervisor.
    pub supervisor: ActorRef<SupervisorMsg>,
    /// The ractor_cluster node server (control plane).
    pub cluster: ActorRef<NodeServerMessage>,
    /// Role-checked service calls on the data plane (serving and calling).
    pub services: Services,
    /// Typed actors: spawn by name here, reach any member's by name.
    pub actors: Actors,
    membership_events: broadcast::Sender<MembershipEvent<NodeId>>,
    supervisor_events: broadcast::Sender<SupervisorEvent>,
    root_events: broadcast::Receiver<SupervisorEvent>,
    handler: Arc<std::sync::RwLock<Option<FrameHandler>>>,
    supervisor_handle: JoinHandle<()>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    redial: Duration,
}

impl NodeRuntime {
    /// Binds the endpoint, starts the control plane, membership and the root supervisor, and
    /// begins dialing the configured peers.
    pub async fn start(spec: NodeSpec) -> Result<Self, RuntimeError> {
        let name = NodeId::new(spec.identity.name.clone());
        let link = QuicNode::bind(&spec.identity, spec.quic).await?;
        let spawn_err = |what: &'static str| {
            move |e: ractor::SpawnErr| RuntimeError::Spawn { what, detail: e.to_string() }
        };
        let cluster =
            start_node_server(name.as_str(), &spec.cookie).await.map_err(spawn_err("cluster node server"))?;
        let (membership_events, _) = broadcast::channel(1024);
        let (membership, _) = Actor::spawn(
            None,
            Membership,
            MembershipArgs {
                link: link.clone().into(),
                config: spec.membership,
                events: membership_events.clone(),
            },
        )
        .await
        .map_err(spawn_err("membership"))?;
        let services = Services::new(link.clone(), ServiceConfig::default());
        let actors = Actors::new(link.clone(), services.clone(), spec.placement);
        let handler: Arc<std::sync::RwLock<Option<FrameHandler>>> = Arc::default();
        let mut tasks = Vec::new();
        let events = link.events().ok_or(RuntimeError::Status("link events already taken".into()))?;
        // peers' frames and events are taken from here on, before the node's actors start: an
        // actor with a long first start (training a model zoo) must not leave the inbox full,
        // which would stall the stream readers that mark peers as heard
        tasks.push(tokio::spawn(peer_events(
            events,
            link.clone(),
            cluster.clone(),
            membership.clone(),
            services.clone(),
        )));
        tasks.push(tokio::spawn(dispatch(
            link.clone(),
            membership.clone(),
            handler.clone(),
            services.clone(),
        )));
        tasks.push(actors.follow_membership(&membership_events));
        let abort_tasks = |tasks: &[tokio::task::JoinHandle<()>]| tasks.iter().for_each(|t| t.abort());
        let children = match (spec.children)(&link, &services, &membership_events, &actors) {
            Ok(c) => c,
            Err(detail) => {
                abort_tasks(&tasks);
                return Err(RuntimeError::Spawn { what: "node actors", detail });
            }
        };
        let (supervisor_events, root_events) = broadcast::channel(1024);
        let spawned = Actor::spawn(
            None,
            Supervisor,
            SupervisorArgs {
                name: ROOT.to_string(),
                children,
                intensity: spec.intensity,
                events: supervisor_events.clone(),
            },
        )
        .await;
        let (supervisor, supervisor_handle) = match spawned {
            Ok(s) => s,
            Err(e) => {
                abort_tasks(&tasks);
                return Err(spawn_err("root supervisor")(e));
            }
        };
        actors.set_supervisor(supervisor.clone());
        crate::join::serve_members(&services, &link);
        for peer in spec.peers {
            tasks.push(tokio::spawn(dial_loop(link.clone(), peer, spec.redial)));
        }
        debug!(node = %name, "node runtime started");
        Ok(Self {
            name,
            link,
            membership,
            supervisor,
            cluster,
            services,
            actors,
            membership_events,
            supervisor_events,
            root_events,
            handler,
            supervisor_handle,
            tasks,
            redial: spec.redial,
        })
    }

    /// Joins the cluster through `seed` (`IP:port` or `host:port`): dials it until it answers,
    /// then every member it lists, each kept redialed as configured peers are (see
    /// [`crate::join`]).
    pub fn join(&mut self, seed: HostPort) {
        let redial = self.redial;
        let dialer = self.link.clone();
        let dial =
            move |name: NodeId, addr: HostPort| dial_loop(dialer.clone(), PeerAddr { name, addr }, redial);
        self.tasks.push(tokio::spawn(crate::join::join_loop(
            self.link.clone(),
            self.services.clone(),
            seed,
            redial,
            dial,
        )));
    }

    /// Membership events (up, down, rejoined) from now on.
    pub fn subscribe_membership(&self) -> broadcast::Receiver<MembershipEvent<NodeId>> {
        self.membership_events.subscribe()
    }

    /// Where membership events are published (for actors that subscribe later, per job).
    pub fn membership_events(&self) -> MembershipEvents {
        self.membership_events.clone()
    }

    /// Supervision events (restarts, escalations) from now on.
    pub fn subscribe_supervision(&self) -> broadcast::Receiver<SupervisorEvent> {
        self.supervisor_events.subscribe()
    }

    /// Starts a supervisor named `name` owning `children` placed on members (or here) by role
    /// and declared capacity, restarted on another node when theirs is declared down, within
    /// `intensity`. Its events go where [`NodeRuntime::subscribe_supervision`] listens.
    pub async fn supervise_remote(
        &self,
        name: &str,
        children: Vec<RemoteChild>,
        intensity: Intensity,
    ) -> Result<ActorRef<RemoteSupervisorMsg>, RuntimeError> {
        let args = RemoteSupervisorArgs {
            name: name.to_string(),
            actors: self.actors.clone(),
            children,
            intensity,
            events: self.supervisor_events.clone(),
            membership: self.membership_events.clone(),
        };
        let (sup, _) = Actor::spawn(None, RemoteSupervisor, args)
            .await
            .map_err(|e| RuntimeError::Spawn { what: "remote supervisor", detail: e.to_string() })?;
        Ok(sup)
    }

    /// Installs the handler for application frames.
    pub fn set_frame_handler(&self, handler: FrameHandler) {
        if let Ok(mut g) = self.handler.write() {
            *g = Some(handler);
        }
    }

    /// This node's status: members, registered actors, device budgets, and the workloads' live
    /// figures ([`crate::live`]).
    pub async fn status(&self) -> Result<NodeStatus, RuntimeError> {
        local_status(&self.name, &self.membership, &self.link).await
    }

    /// A cheap handle that reads this node's status later (for a metrics endpoint that outlives
    /// no runtime but must not own it).
    pub fn status_probe(&self) -> StatusProbe {
        StatusProbe { name: self.name.clone(), membership: self.membership.clone(), link: self.link.clone() }
    }

    /// Waits until the root supervisor stops: `Err` when it escalated.
    pub async fn wait(mut self) -> Result<(), RuntimeError> {
        let _ = (&mut self.supervisor_handle).await;
        let outcome = escalation(&mut self.root_events);
        self.stop_tasks().await;
        outcome
    }

    /// Stops the actors and closes the endpoint.
    pub async fn shutdown(mut self) {
        self.supervisor.stop(None);
        let _ = (&mut self.supervisor_handle).await;
        self.stop_tasks().await;
    }

    async fn stop_tasks(&mut self) {
        self.membership.stop(None);
        // waited for: its actor name is process-wide, so a node of the same name started next
        // in this process (the benches start clusters one after another) must find it gone
        let wait = Some(std::time::Duration::from_secs(5));
        if let Err(e) = self.cluster.stop_and_wait(None, wait).await {
            warn!(node = %self.name, error = %e, "the control plane's node server did not stop within 5 s");
        }
        for t in self.tasks.drain(..) {
            t.abort();
        }
        self.link.shutdown().await;
    }
}

fn escalation(rx: &mut broadcast::Receiver<SupervisorEvent>) -> Result<(), RuntimeError> {
    while let Ok(ev) = rx.try_recv() {
        if let SupervisorEvent::Escalated { supervisor, child, reason } = ev
            && supervisor == ROOT
        {
            return Err(RuntimeError::Escalated(format!("child {child}: {reason}")));
        }
    }
    Ok(())
}

/// Reads a node's status (see [`NodeRuntime::status_probe`]). Cheap to clone.
#[derive(Clone)]
pub struct StatusProbe {
    name: NodeId,
    membership: ActorRef<MembershipMsg>,
    link: QuicNode,
}

impl StatusProbe {
    /// The node's status now: members, registered actors, device budgets.
    pub async fn status(&self) -> Result<NodeStatus, RuntimeError> {
        local_status(&self.name, &self.membership, &self.link).await
    }
}

async fn local_status(
    name: &NodeId,
    membership: &ActorRef<MembershipMsg>,
    link: &QuicNode,
) -> Result<NodeStatus, RuntimeError> {
    let err = |e: String| RuntimeError::Status(e);
    let now = ractor::call_t!(membership, MembershipMsg::Now, 2000).map_err(|e| err(e.to_string()))?;
    let members = ractor::call_t!(membership, MembershipMsg::Members, 2000)
        .map_err(|e| err(e.to_string()))?
        .into_iter()
        .map(|(n, s, t)| MemberView {
            rtt_us: link.rtt(&n).map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX)),
            name: n.0,
            status: match s {
                MemberStatus::Up => "up".into(),
                MemberStatus::Down => "down".into(),
                MemberStatus::Left => "left".into(),
            },
            last_heard_ms_ago: now.saturating_sub(t).as_millis(),
        })
        .collect();
    let mut actors: Vec<String> = ractor::registry::registered().into_iter().collect();
    actors.sort();
    let mut devices: Vec<DeviceView> = Vec::new();
    for cell in ractor::pg::get_scoped_local_members(&"troupe".to_string(), &"devices".to_string()) {
        let dev: ActorRef<DeviceMsg> = cell.into();
        if let Ok(v) = ractor::call_t!(dev, DeviceMsg::View, 2000) {
            devices.push(v);
        }
    }
    devices.sort_by(|a, b| a.name.cmp(&b.name));
    let live = crate::live::snapshot();
    Ok(NodeStatus {
        node: name.0.clone(),
        members,
        actors,
        devices,
        residency: live.residency,
        queues: live.queues,
        stages: live.stages,
        pools: live.pools,
        mailboxes: live.mailboxes,
    })
}

async fn peer_events(
    mut events: tokio::sync::mpsc::Receiver<PeerEvent>,
    link: QuicNode,
    cluster: ActorRef<NodeServerMessage>,
    membership: ActorRef<MembershipMsg>,
    services: Services,
) {
    while let Some(ev) = events.recv().await {
        match ev {
            PeerEvent::Joined { member: false, .. } => {}
            PeerEvent::Joined { peer, outbound, .. } => {
                let _ = membership.cast(MembershipMsg::Heard(peer.clone()));
                services.peer_joined(&peer);
                if outbound {
                    // opening may wait (at most 2 s) for the same-host handshake to pick the
                    // road: the other peers' events go on meanwhile
                    let (link, cluster) = (link.clone(), cluster.clone());
                    tokio::spawn(async move {
                        match link.open_control(&peer).await {
                            Ok(stream) => {
                                if let Err(e) =
                                    open_session(&cluster, ControlBidi::new(stream, peer.as_str()), true)
                                {
                                    warn!(%peer, error = %e, "could not open the control-plane session");
                                }
                            }
                            Err(e) => warn!(%peer, error = %e, "could not open the control stream"),
                        }
                    });
                }
            }
            PeerEvent::ControlStream { peer, stream } => {
                if let Err(e) = open_session(&cluster, ControlBidi::new(stream, peer.as_str()), false) {
                    warn!(%peer, error = %e, "could not accept the control-plane session");
                }
            }
            PeerEvent::Restarted { peer } => {
                info!(%peer, "peer restarted; its unanswered calls fail now");
                services.peer_restarted(&peer);
                let _ = membership.cast(MembershipMsg::Restarted(peer.clone()));
            }
            PeerEvent::Left { peer, reason, goodbye } => {
                debug!(%peer, %reason, goodbye, "connection closed");
                if goodbye {
                    let _ = membership.cast(MembershipMsg::Left(peer.clone()));
                }
                services.peer_left(&peer, &reason);
            }
            // logged by the transport, naming the peer (and for OverBudget the cap and the bytes held)
            PeerEvent::Refused { .. } | PeerEvent::BadStream { .. } | PeerEvent::OverBudget { .. } => {}
        }
    }
}

async fn dispatch(
    link: QuicNode,
    membership: ActorRef<MembershipMsg>,
    handler: Arc<std::sync::RwLock<Option<FrameHandler>>>,
    services: Services,
) {
    // liveness is the transport's per-connection `heard` flag, read by membership each tick;
    // service frames reach the router without passing here
    while let Ok(d) = link.recv().await {
        match (d.channel, d.frame.kind) {
            (_, FrameKind::Heartbeat) => {
                if let Err(e) = d.frame.access::<Heartbeat>() {
                    warn!(peer = %d.from, error = %e, "invalid heartbeat");
                }
            }
            (_, FrameKind::Service) => services.handle_frame(d),
            (Channel::Control, FrameKind::Message) => match d.frame.access::<ControlMsg>() {
                Ok(ArchivedControlMsg::StatusRequest) => {
                    let reply = match local_status(link.local_id(), &membership, &link).await {
                        Ok(s) => Frame::encode(FrameKind::Message, &ControlMsg::StatusReply(s)),
                        Err(e) => Ok(Frame::from_bytes(FrameKind::Error, 0, e.to_string().as_bytes())),
                    };
                    if let Ok(frame) = reply {
                        let _ = link.send(&d.from, Channel::Control, frame).await;
                    }
                }
                Ok(ArchivedControlMsg::StatusReply(_)) => debug!(peer = %d.from, "unsolicited status reply"),
                Err(e) => warn!(peer = %d.from, error = %e, "invalid control message"),
            },
            _ => {
                let h = handler.read().ok().and_then(|g| g.clone());
                match h {
                    Some(h) => h(d),
                    None => debug!(peer = %d.from, kind = ?d.frame.kind, "no handler for frame"),
                }
            }
        }
    }
}

async fn dial_loop(link: QuicNode, peer: PeerAddr, redial: Duration) {
    loop {
        if !link.peers().contains(&peer.name) {
            match peer.addr.resolve().await {
                Ok(addr) => match link.connect(addr, &peer.name).await {
                    Ok(_) => debug!(peer = %peer.name, %addr, "connected"),
                    Err(e) => debug!(peer = %peer.name, %addr, error = %e, "dial failed; will retry"),
                },
                Err(e) => debug!(peer = %peer.name, error = %e, "address not resolved; will retry"),
            }
        }
        tokio::time::sleep(redial).await;
    }
}

/// Where a client endpoint that dials `target` binds: loopback for a loopback target, else the
/// unspecified address of the target's family (a socket bound to 127.0.0.1 cannot send to
/// another host's address: `sendmsg` fails with EINVAL).
pub fn client_bind_for(target: SocketAddr) -> SocketAddr {
    match target.ip() {
        ip if ip.is_loopback() => SocketAddr::new(ip, 0),
        std::net::IpAddr::V4(_) => SocketAddr::from(([0, 0, 0, 0], 0)),
        std::net::IpAddr::V6(_) => SocketAddr::from(([0u16; 8], 0)),
    }
}

/// Asks the node at `addr` for its status, connecting with `identity` (any node of the cluster).
pub async fn query_status(
    identity: &NodeIdentity,
    addr: SocketAddr,
    timeout: Duration,
) -> Result<NodeStatus, RuntimeError> {
    let config = QuicConfig { member: false, bind: client_bind_for(addr), ..QuicConfig::default() };
    let link = QuicNode::bind(identity, config).await?;
    let result = tokio::time::timeout(timeout, async {
        let peer = link.connect_any(addr).await?;
        let frame = Frame::encode(FrameKind::Message, &ControlMsg::StatusRequest).map_err(QuicError::from)?;
        link.send(&peer, Channel::Control, frame).await.map_err(QuicError::from)?;
        loop {
            let d = link.recv().await.map_err(QuicError::from)?;
            if d.frame.kind == FrameKind::Error {
                return Err(RuntimeError::Status(String::from_utf8_lossy(&d.frame.body).into_owned()));
            }
            if d.frame.kind != FrameKind::Message {
                continue;
            }
            let msg = d.frame.access::<ControlMsg>().map_err(QuicError::from)?;
            if let ArchivedControlMsg::StatusReply(s) = msg {
                s.check_caps().map_err(|e| RuntimeError::Status(format!("{peer}: {e}")))?;
                let owned: ControlMsg = rkyv::deserialize::<ControlMsg, rkyv::rancor::Error>(msg)
                    .map_err(|e| RuntimeError::Status(e.to_string()))?;
                if let ControlMsg::StatusReply(s) = owned {
                    return Ok(s);
                }
            }
        }
    })
    .await
    .map_err(|_| RuntimeError::Status(format!("no answer from {addr} within {timeout:?}")))?;
    link.shutdown().await;
    result
}

#[cfg(test)]
mod tests {
    use super::client_bind_for;
    use std::net::SocketAddr;

    #[test]
    fn a_status_client_binds_where_it_can_reach_its_target() {
        let addr = |s: &str| s.parse::<SocketAddr>().unwrap_or_else(|e| panic!("{s}: {e}"));
        let at = |s: &str| client_bind_for(addr(s));
        assert_eq!(at("127.0.0.1:7000"), addr("127.0.0.1:0"));
        assert_eq!(at("10.20.0.3:7000"), addr("0.0.0.0:0"));
        assert_eq!(at("[::1]:7000"), addr("[::1]:0"));
        assert_eq!(at("[fd00::3]:7000"), addr("[::]:0"));
    }
}

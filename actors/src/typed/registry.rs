//! A node's typed actors: spawning by name under the node's supervisor, binding each
//! incarnation to the service router (the one wire path), and finding actors by name on this
//! node or any member (`lookup`, and `wait_for`, woken by announcements, never polling).

use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use dashmap::DashMap;
use ractor::{ActorRef, ActorStatus};
use tokio::sync::{broadcast, oneshot};
use troupe_policy::MembershipEvent;
use troupe_transport::service::FaultKind;
use troupe_transport::{Link, NodeId, NodeLink, QuicNode};

use super::actor::{Binding, Host, HostArgs, Protocol, TypedActor, WireReply};
use super::error::ActorError;
use super::handle::ActorHandle;
use super::placement::{PlacementRules, PlacementState};
use super::wire::Wire;
use crate::service::{Allow, ClassedHandler, ServiceSpec, Services};
use crate::supervisor::{ChildSpec, SupervisorMsg};

/// Typed actors are served as `@NAME` on the service router.
pub const SERVICE_PREFIX: char = '@';
/// The method every typed actor answers with its kind and incarnation ([`Described`]).
pub const DESCRIBE: &str = "@describe";
/// Longest actor name (the service name `@NAME` must fit the router's 64 bytes).
pub const MAX_ACTOR_NAME: usize = troupe_transport::service::MAX_NAME - 1;
/// How long a describe call may take while resolving a name.
const DESCRIBE_TIMEOUT: Duration = Duration::from_secs(2);

/// What a typed actor says of itself when asked by name.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Described {
    /// Its kind ([`TypedActor::KIND`]).
    pub kind: String,
    /// Its incarnation now.
    pub incarnation: u64,
    /// Its placement generation (a later placement wins over an earlier one still answering).
    pub generation: u64,
}

/// Why an actor could not be spawned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpawnError {
    /// The name is empty, too long, or has characters other than `A-Za-z0-9._-/`.
    #[error("actor name {0:?} is not valid: 1-{MAX_ACTOR_NAME} bytes of A-Z a-z 0-9 . _ - /")]
    InvalidName(String),
    /// The kind's protocol is malformed (a message name declared twice or reserved, a bad role
    /// name).
    #[error("actor kind {kind}: {problem}")]
    Protocol {
        /// The kind.
        kind: &'static str,
        /// What is wrong.
        problem: String,
    },
    /// An actor of that name already runs on this node.
    #[error("an actor named {0:?} already runs on this node")]
    Duplicate(String),
    /// The node has no supervisor to run it under yet (the runtime did not start).
    #[error("this node's runtime has not started its supervisor")]
    NoSupervisor,
    /// The actor's start failed.
    #[error("starting {name:?}: {detail}")]
    Start {
        /// The name.
        name: String,
        /// Why.
        detail: String,
    },
}

/// Checks an actor name: see [`SpawnError::InvalidName`].
pub fn validate_name(name: &str) -> Result<(), SpawnError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_ACTOR_NAME
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-/".contains(&b));
    if ok { Ok(()) } else { Err(SpawnError::InvalidName(name.to_string())) }
}

/// A shell that needs a QUIC link was started on a simulated node.
#[derive(Debug, thiserror::Error)]
#[error("{0}: this shell needs a QUIC link (blob pulls, raw streams); a simulated node has none")]
pub struct QuicOnly(pub NodeId);

/// A new incarnation number, unique in the process and, with overwhelming odds, in the cluster.
pub(crate) fn fresh_incarnation() -> u64 {
    use std::hash::BuildHasher;
    static COUNTER: AtomicU64 = AtomicU64::new(1);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    // std's hash keys are seeded from the OS once per process and stepped per RandomState
    std::collections::hash_map::RandomState::new().hash_one((std::process::id(), n)).max(1)
}

/// One incarnation bound on this node: the typed binding behind `dyn Any`, with what a
/// describe answers.
#[derive(Clone)]
pub(crate) struct Local {
    pub kind: &'static str,
    pub incarnation: u64,
    pub binding: Arc<dyn Any + Send + Sync>,
}

pub(crate) struct Inner {
    node: NodeId,
    link: NodeLink,
    services: Services,
    local: DashMap<String, Local>,
    /// Wakes lookups waiting for a name: a local binding (its name) or a member back up (empty).
    bound: broadcast::Sender<String>,
    supervisor: OnceLock<ActorRef<SupervisorMsg>>,
    placement: PlacementState,
    /// Members the membership view has down now: names are not resolved to them.
    down: DashMap<NodeId, ()>,
}

/// A node's typed-actor registry (cheap to clone). [`crate::NodeRuntime`] makes one.
#[derive(Clone)]
pub struct Actors {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Actors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Actors").field("node", &self.inner.node).finish_non_exhaustive()
    }
}

impl Actors {
    /// The registry of the node behind `link`, serving through `services`, accepting
    /// placements by `placement`.
    pub fn new(link: impl Into<NodeLink>, services: Services, placement: PlacementRules) -> Self {
        let link = link.into();
        let (bound, _) = broadcast::channel(256);
        let this = Self {
            inner: Arc::new(Inner {
                node: link.local_id().clone(),
                link,
                services,
                local: DashMap::new(),
                bound,
                supervisor: OnceLock::new(),
                placement: PlacementState::new(placement),
                down: DashMap::new(),
            }),
        };
        super::placement::serve(&this);
        this
    }

    pub(crate) fn arc(&self) -> Arc<Inner> {
        self.inner.clone()
    }

    pub(crate) fn from_arc(inner: Arc<Inner>) -> Self {
        Self { inner }
    }

    /// Follows the membership view: a member declared down is not resolved to, and the calls
    /// waiting on it fail now as peer lost (its connection may take far longer to time out).
    pub fn follow_membership(
        &self,
        events: &broadcast::Sender<MembershipEvent<NodeId>>,
    ) -> tokio::task::JoinHandle<()> {
        let mut rx = events.subscribe();
        let weak = Arc::downgrade(&self.inner);
        tokio::spawn(async move {
            loop {
                let ev = match rx.recv().await {
                    Ok(ev) => ev,
                    Err(broadcast::error::RecvError::Lagged(_)) => continue,
                    Err(broadcast::error::RecvError::Closed) => return,
                };
                let Some(inner) = weak.upgrade() else { return };
                match ev {
                    MembershipEvent::Down { member, .. } => {
                        inner.down.insert(member.clone(), ());
                        inner.services.peer_down(&member);
                    }
                    MembershipEvent::Up { member, .. } => {
                        inner.down.remove(&member);
                        // a lookup that skipped this member while it was down tries again now:
                        // its announcement may have come first (the fault explorer's coe seed
                        // 886), and no other will come
                        let _ = inner.bound.send(String::new());
                    }
                }
            }
        })
    }

    /// Sets the supervisor spawned actors run under (the node's root; set once).
    pub fn set_supervisor(&self, supervisor: ActorRef<SupervisorMsg>) {
        let _ = self.inner.supervisor.set(supervisor);
    }

    /// This node's name.
    pub fn node(&self) -> &NodeId {
        &self.inner.node
    }

    /// Whether the membership view has `node` down now.
    pub fn is_down(&self, node: &NodeId) -> bool {
        self.inner.down.contains_key(node)
    }

    /// The node's service router.
    pub fn services(&self) -> &Services {
        &self.inner.services
    }

    pub(crate) fn link(&self) -> &NodeLink {
        &self.inner.link
    }

    /// The node's QUIC endpoint, for shells that need what only QUIC does (blob pulls, raw
    /// streams); refused on a simulated node.
    pub fn quic(&self) -> Result<&QuicNode, QuicOnly> {
        self.inner.link.quic().ok_or_else(|| QuicOnly(self.inner.node.clone()))
    }

    pub(crate) fn placement_state(&self) -> &PlacementState {
        &self.inner.placement
    }

    /// Starts an `A` named `name` on this node under the node's supervisor (restarted there on
    /// a crash, with a new incarnation) and returns a handle to it.
    pub async fn spawn<A: TypedActor>(
        &self,
        name: &str,
        args: A::Args,
    ) -> Result<ActorHandle<A>, SpawnError> {
        self.spawn_generation::<A>(name, args, 0).await?;
        self.lookup::<A>(name)
            .await
            .map_err(|e| SpawnError::Start { name: name.into(), detail: e.to_string() })
    }

    pub(crate) async fn spawn_generation<A: TypedActor>(
        &self,
        name: &str,
        args: A::Args,
        generation: u64,
    ) -> Result<(), SpawnError> {
        if self.inner.local.contains_key(name) {
            return Err(SpawnError::Duplicate(name.to_string()));
        }
        let spec = self.child_spec_generation::<A>(name, args, generation)?;
        let sup = self.inner.supervisor.get().ok_or(SpawnError::NoSupervisor)?.clone();
        let started = ractor::call!(sup, SupervisorMsg::StartChild, spec)
            .map_err(|e| SpawnError::Start { name: name.into(), detail: e.to_string() })?;
        started.map_err(|detail| SpawnError::Start { name: name.into(), detail })?;
        Ok(())
    }

    /// The child spec that runs an `A` named `name` under a supervisor of this node (for the
    /// children a node starts with; [`Actors::spawn`] starts one later).
    pub fn child_spec<A: TypedActor>(&self, name: &str, args: A::Args) -> Result<ChildSpec, SpawnError> {
        self.child_spec_generation::<A>(name, args, 0)
    }

    fn child_spec_generation<A: TypedActor>(
        &self,
        name: &str,
        args: A::Args,
        generation: u64,
    ) -> Result<ChildSpec, SpawnError> {
        validate_name(name)?;
        let protocol = Protocol::<A>::of();
        if let Some(problem) = protocol.problems().first() {
            return Err(SpawnError::Protocol { kind: A::KIND, problem: problem.clone() });
        }
        let (actors, owned) = (self.clone(), name.to_string());
        Ok(ChildSpec::new(self.registry_name(name), move || {
            let args =
                HostArgs::<A> { args: args.clone(), name: owned.clone(), generation, actors: actors.clone() };
            (Host::<A>::default(), args)
        }))
    }

    /// Called by a starting incarnation: serve it as `@NAME` and tell waiters.
    pub(crate) fn bind<A: TypedActor>(&self, binding: Arc<Binding<A>>) {
        let name = binding.name.clone();
        let described = Described {
            kind: A::KIND.to_string(),
            incarnation: binding.incarnation,
            generation: binding.generation,
        };
        let mut spec = ServiceSpec::new().method(DESCRIBE, Allow::AnyMember);
        for (method, allow) in binding.protocol.rules() {
            spec = spec.method(method, allow);
        }
        self.inner.local.insert(
            name.clone(),
            Local { kind: A::KIND, incarnation: binding.incarnation, binding: binding.clone() },
        );
        self.inner.services.register_classed(&service_name(&name), spec, serve_binding(binding, described));
        let _ = self.inner.bound.send(name);
    }

    /// Called by a stopping incarnation: forget it unless a newer one took the name.
    pub(crate) fn unbind(&self, name: &str, incarnation: u64) {
        if self.inner.local.remove_if(name, |_, l| l.incarnation == incarnation).is_some() {
            self.inner.services.unregister(&service_name(name));
        }
    }

    /// Stops the actor `name` on this node (it is not restarted); false when none runs here.
    pub fn stop(&self, name: &str) -> bool {
        if self.inner.local.remove(name).is_none() {
            return false;
        }
        self.inner.services.unregister(&service_name(name));
        self.inner.placement.placed.remove(name);
        // a stop is a termination, not a failure: the supervisor does not restart it
        if let Some(cell) = ractor::registry::where_is(self.registry_name(name)) {
            cell.stop(Some("stopped by name".into()));
        }
        true
    }

    /// The name ractor's process-wide registry knows the actor by (the node's name keeps two
    /// nodes of one process apart).
    fn registry_name(&self, name: &str) -> String {
        format!("{name}@{}", self.inner.node)
    }

    /// Names and kinds of the typed actors on this node.
    pub fn local_actors(&self) -> Vec<(String, &'static str)> {
        let mut v: Vec<_> = self.inner.local.iter().map(|e| (e.key().clone(), e.value().kind)).collect();
        v.sort();
        v
    }

    pub(crate) fn local_binding<A: TypedActor>(
        &self,
        name: &str,
    ) -> Result<Option<Arc<Binding<A>>>, ActorError> {
        let Some(local) = self.inner.local.get(name).map(|l| l.clone()) else { return Ok(None) };
        match local.binding.downcast::<Binding<A>>() {
            Ok(b) => Ok(Some(b)),
            Err(_) => {
                Err(ActorError::WrongKind { name: name.into(), expected: A::KIND, found: local.kind.into() })
            }
        }
    }

    /// A handle to the actor `name`, on this node or on a member that announced it; the most
    /// recent placement when two answer. No waiting: [`ActorError::UnknownActor`] if none.
    pub async fn lookup<A: TypedActor>(&self, name: &str) -> Result<ActorHandle<A>, ActorError> {
        let target = self.resolve::<A>(name).await?;
        Ok(ActorHandle::resolved(name, self.clone(), target))
    }

    /// [`Actors::lookup`], waiting up to `timeout` for the name to appear (woken by this node's
    /// bindings and by members' service announcements, not by polling).
    pub async fn wait_for<A: TypedActor>(
        &self,
        name: &str,
        timeout: Duration,
    ) -> Result<ActorHandle<A>, ActorError> {
        let target = self.resolve_within::<A>(name, timeout).await?;
        Ok(ActorHandle::resolved(name, self.clone(), target))
    }

    pub(crate) async fn resolve_within<A: TypedActor>(
        &self,
        name: &str,
        timeout: Duration,
    ) -> Result<super::handle::Target<A>, ActorError> {
        let deadline = crate::clock::timer_now() + timeout;
        let mut announced = self.inner.services.subscribe_announcements();
        let mut bound = self.inner.bound.subscribe();
        loop {
            match self.resolve::<A>(name).await {
                Err(ActorError::UnknownActor { .. }) => {}
                other => return other,
            }
            let woke = tokio::time::timeout_at(deadline, async {
                tokio::select! {
                    r = announced.recv() => !matches!(r, Err(broadcast::error::RecvError::Closed)),
                    r = bound.recv() => !matches!(r, Err(broadcast::error::RecvError::Closed)),
                }
            })
            .await;
            match woke {
                Ok(true) => {}
                Ok(false) | Err(_) => {
                    return self.resolve::<A>(name).await.map_err(|e| match e {
                        ActorError::UnknownActor { name, .. } => {
                            ActorError::UnknownActor { name, within: Some(timeout) }
                        }
                        e => e,
                    });
                }
            }
        }
    }

    pub(crate) async fn resolve<A: TypedActor>(
        &self,
        name: &str,
    ) -> Result<super::handle::Target<A>, ActorError> {
        if let Some(b) = self.local_binding::<A>(name)? {
            return Ok(super::handle::Target::Local(b));
        }
        let service = service_name(name);
        let mut best: Option<(u64, NodeId, Described)> = None;
        let mut other_kind = None;
        for peer in self.inner.services.providers(&service) {
            if self.inner.down.contains_key(&peer) {
                continue;
            }
            let Ok(bytes) =
                self.inner.services.call(&peer, &service, DESCRIBE, Vec::new(), DESCRIBE_TIMEOUT).await
            else {
                continue;
            };
            let Ok(d) = Described::from_wire("Described", &bytes) else { continue };
            if d.kind != A::KIND {
                other_kind = Some(d.kind);
                continue;
            }
            if best.as_ref().is_none_or(|(g, _, _)| d.generation > *g) {
                best = Some((d.generation, peer, d));
            }
        }
        match (best, other_kind) {
            (Some((_, peer, d)), _) => Ok(super::handle::Target::Remote { peer, incarnation: d.incarnation }),
            (None, Some(found)) => Err(ActorError::WrongKind { name: name.into(), expected: A::KIND, found }),
            (None, None) => Err(ActorError::UnknownActor { name: name.into(), within: None }),
        }
    }
}

/// The service name of the actor `name`.
pub fn service_name(name: &str) -> String {
    format!("{SERVICE_PREFIX}{name}")
}

/// Bytes in front of a remote message: the incarnation it is addressed to (0: any).
pub(crate) const INCARNATION_PREFIX: usize = 8;

/// The router's handler for one incarnation: describe, or check the addressed incarnation,
/// decode through the checked path, queue in order (queued before the first await, so requests
/// from one peer keep their order), and answer.
fn serve_binding<A: TypedActor>(binding: Arc<Binding<A>>, described: Described) -> ClassedHandler {
    let described = described.to_wire();
    Arc::new(move |caller, method, body| {
        if method == DESCRIBE {
            // a stopped incarnation is not described: between a crash and its restart's binding
            // a lookup would resolve to it and the first call fail; refused, the caller waits for
            // the restart's announcement instead
            let stopped = matches!(binding.actor.get_status(), ActorStatus::Stopping | ActorStatus::Stopped);
            let d = if stopped {
                Err((FaultKind::Gone, format!("incarnation {:016x} stopped", binding.incarnation)))
            } else {
                described.clone().map_err(|e| (FaultKind::Failed, e))
            };
            return Box::pin(async move { d });
        }
        let queued = queue(&binding, &method, &body, caller.one_way, caller.node);
        Box::pin(async move {
            match queued? {
                None => Ok(Vec::new()),
                Some(rx) => rx
                    .await
                    .unwrap_or_else(|_| Err((FaultKind::Gone, "the actor stopped before replying".into()))),
            }
        })
    })
}

fn queue<A: TypedActor>(
    binding: &Binding<A>,
    method: &str,
    body: &[u8],
    one_way: bool,
    sender: NodeId,
) -> Result<Option<oneshot::Receiver<WireReply>>, (FaultKind, String)> {
    let (head, rest) = body.split_at_checked(INCARNATION_PREFIX).ok_or_else(|| {
        (FaultKind::BadRequest, format!("a message of {} bytes has no incarnation header", body.len()))
    })?;
    let mut raw = [0u8; INCARNATION_PREFIX];
    raw.copy_from_slice(head);
    let addressed = u64::from_le_bytes(raw);
    if addressed != 0 && addressed != binding.incarnation {
        return Err((
            FaultKind::Gone,
            format!(
                "incarnation {addressed:016x} of {:?} is gone (now {:016x})",
                binding.name, binding.incarnation
            ),
        ));
    }
    let (tx, rx) = if one_way {
        (None, None)
    } else {
        let (t, r) = oneshot::channel();
        (Some(t), Some(r))
    };
    let job = binding.protocol.dispatch(method, rest, tx, sender)?;
    binding.enqueue(job).map_err(|e| match e {
        ActorError::Busy { detail, .. } => (FaultKind::Busy, detail),
        e => (FaultKind::Gone, e.to_string()),
    })?;
    Ok(rx)
}

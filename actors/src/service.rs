//! Role-checked service calls on the data plane: the one wire path for workload RPC.
//!
//! A service (an actor kind, possibly with an instance name: `coe-executor/cpu0`) declares, per
//! method, which certificate roles may call it ([`ServiceSpec`]). A request arrives as a
//! [`FrameKind::Service`] frame on the data channel of an authenticated QUIC connection, so the
//! router knows the sender's node name and, from its certificate, its roles: a call the roles do
//! not allow is answered with [`FaultKind::Forbidden`] naming the role and the method, and logged;
//! an unknown service or method is answered by name too. The envelope codec is
//! `troupe_transport::service`.
//!
//! Caller side: [`Services::call`] with correlation ids, a timeout, and a bound on outstanding
//! calls. Calls pending to a peer whose connection ends fail at once ([`Services::peer_left`]).
//!
//! Shape, stated plainly: each request runs on its own task (a caller that needs order waits for
//! each answer before the next call, as the CoE and pipeline links do); the caller's roles are
//! looked up when the request is routed, from the peer's current connection, so a peer that
//! reconnects with a re-issued certificate in between is judged by the new one; the request
//! frame itself was already bounded by the link's frame cap, the envelope cap bounds what
//! decoding allocates.
//!
//! Discovery: every node announces its services (built-in service [`DIRECTORY`]) to each member
//! when it joins and to every member when a service is registered; [`Services::directory`] and
//! [`Services::subscribe_announcements`] let a scheduler wait for executors without polling.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use dashmap::DashMap;
use rkyv::api::high::{HighSerializer, HighValidator};
use rkyv::bytecheck::CheckBytes;
use rkyv::rancor;
use rkyv::ser::allocator::ArenaHandle;
use rkyv::util::AlignedVec;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, broadcast, oneshot};
use tracing::{debug, warn};
use troupe_transport::service::{
    self, Envelope, Fault, FaultKind, ONE_WAY, Outcome, Request, Response, ServiceLimits, ServiceWireError,
};
use troupe_transport::{
    Channel, Delivery, FrameKind, Link, NodeId, NodeLink, QuicNode, Role, RoleSet, RuntimeLink,
};

/// The built-in service every node runs: service announcements.
pub const DIRECTORY: &str = "troupe-directory";
/// Method of [`DIRECTORY`] carrying the sender's service names.
const ANNOUNCE: &str = "announce";
/// Most service names one announcement may carry.
pub const MAX_ANNOUNCED: usize = 256;
/// Most Busy answers one node sends at once (see `Inner::busy_replies`).
const MAX_BUSY_REPLIES: usize = 64;
/// How long one try of an announcement may take.
const ANNOUNCE_TIMEOUT: Duration = Duration::from_secs(5);
/// Tries of one announcement (a lost one is tried again after [`ANNOUNCE_BACKOFF`], doubled up to
/// [`ANNOUNCE_BACKOFF_MAX`]; about 9 s of pauses in all, past a membership timeout, so a peer
/// cut off for longer is declared down and gets a fresh announcement when it is back up).
const ANNOUNCE_TRIES: u32 = 8;
/// The first pause after a failed announcement.
const ANNOUNCE_BACKOFF: Duration = Duration::from_millis(100);
/// The longest pause between two tries of an announcement.
const ANNOUNCE_BACKOFF_MAX: Duration = Duration::from_secs(2);

/// Who may call a method.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Allow {
    /// Any peer joined as a cluster member, whatever its roles.
    AnyMember,
    /// Peers whose certificate has at least one of these roles.
    Roles(RoleSet),
}

impl Allow {
    /// Only peers with `role`.
    pub const fn role(role: Role) -> Self {
        Allow::Roles(RoleSet::only(role))
    }
}

/// What a service accepts: each method and who may call it. Methods not listed are unknown.
#[derive(Clone, Debug, Default)]
pub struct ServiceSpec {
    methods: BTreeMap<String, Allow>,
}

impl ServiceSpec {
    /// An empty spec (add methods with [`ServiceSpec::method`]).
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `method`, callable by `allow`.
    pub fn method(mut self, method: &str, allow: Allow) -> Self {
        self.methods.insert(method.to_string(), allow);
        self
    }

    /// The rule for `method`.
    pub fn allow(&self, method: &str) -> Option<Allow> {
        self.methods.get(method).copied()
    }
}

/// Who is calling, as the authenticated connection says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    /// The sending node (its certificate's name).
    pub node: NodeId,
    /// The roles in its certificate.
    pub roles: RoleSet,
    /// True for a one-way request: nobody waits for the answer, so a handler may return as
    /// soon as the work is queued.
    pub one_way: bool,
}

/// A handler's future: the answer body, or a message naming what failed.
pub type HandlerFuture = Pin<Box<dyn Future<Output = Result<Vec<u8>, String>> + Send>>;
/// Runs one admitted call: `(caller, method, body)`. Its future is first polled on the reader of
/// the caller's stream (an answer ready at once goes back without a task switch), so work of more
/// than a few microseconds belongs after an `.await` (an actor call, `spawn_blocking`).
pub type Handler = Arc<dyn Fn(Caller, String, Vec<u8>) -> HandlerFuture + Send + Sync>;
/// A handler's future that classes its own failures ([`FaultKind::BadRequest`],
/// [`FaultKind::Busy`], [`FaultKind::Gone`], [`FaultKind::Failed`]), as the typed actor layer does.
pub type FaultFuture = Pin<Box<dyn Future<Output = Result<Vec<u8>, (FaultKind, String)>> + Send>>;
/// A [`Handler`] whose failures carry their class (see [`Services::register_classed`]).
pub type ClassedHandler = Arc<dyn Fn(Caller, String, Vec<u8>) -> FaultFuture + Send + Sync>;

/// Limits of a node's service router.
#[derive(Clone, Copy, Debug)]
pub struct ServiceConfig {
    /// Calls this node may have outstanding at once (further calls fail with
    /// [`CallError::TooManyOutstanding`]).
    pub max_outstanding: usize,
    /// Calls from peers this node runs at once (further ones are answered [`FaultKind::Busy`]).
    pub max_inbound: usize,
    /// Calls from one peer this node runs at once, so one peer cannot take every slot of
    /// `max_inbound` from the others (further ones are answered [`FaultKind::Busy`]).
    pub max_inbound_per_peer: usize,
    /// Cap on each envelope decoded.
    pub limits: ServiceLimits,
}

impl Default for ServiceConfig {
    fn default() -> Self {
        Self {
            max_outstanding: 1024,
            max_inbound: 256,
            max_inbound_per_peer: 64,
            limits: ServiceLimits::default(),
        }
    }
}

/// Why a call produced no answer.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The callee refused or failed the call (forbidden, unknown service or method, busy,
    /// bad request, handler error); the message comes from the callee and names the problem.
    #[error("{peer}: {service}.{method}: {message}")]
    Remote {
        /// The callee.
        peer: NodeId,
        /// The service called.
        service: String,
        /// The method called.
        method: String,
        /// The class of failure.
        kind: FaultKind,
        /// The callee's message.
        message: String,
    },
    /// No answer within the timeout.
    #[error("{peer}: {service}.{method}: no answer within {timeout:?}")]
    Timeout {
        /// The callee.
        peer: NodeId,
        /// The service called.
        service: String,
        /// The method called.
        method: String,
        /// The timeout.
        timeout: Duration,
    },
    /// The callee's connection ended before it answered.
    #[error("{peer}: {service}.{method}: the peer left before answering ({reason})")]
    PeerLeft {
        /// The callee.
        peer: NodeId,
        /// The service called.
        service: String,
        /// The method called.
        method: String,
        /// Why the connection ended.
        reason: String,
    },
    /// The request could not be sent.
    #[error("{peer}: {service}.{method}: sending failed: {detail}")]
    Send {
        /// The callee.
        peer: NodeId,
        /// The service called.
        service: String,
        /// The method called.
        method: String,
        /// What failed.
        detail: String,
    },
    /// Too many calls are outstanding on this node.
    #[error("{0} calls are outstanding, the most this node allows")]
    TooManyOutstanding(usize),
    /// The request could not be encoded.
    #[error(transparent)]
    Encode(#[from] ServiceWireError),
}

impl CallError {
    /// The callee's fault class, for a [`CallError::Remote`].
    pub fn fault(&self) -> Option<FaultKind> {
        match self {
            CallError::Remote { kind, .. } => Some(*kind),
            _ => None,
        }
    }

    /// True when the peer is gone or silent (its work should be redone elsewhere).
    pub fn is_lost(&self) -> bool {
        matches!(self, CallError::Timeout { .. } | CallError::PeerLeft { .. } | CallError::Send { .. })
    }
}

type Reply = Result<Vec<u8>, (FaultKind, String)>;

struct Pending {
    peer: NodeId,
    tx: oneshot::Sender<Result<Reply, String>>,
}

struct Registered {
    spec: ServiceSpec,
    handler: ClassedHandler,
}

/// What a running announcer to one peer is told while it works.
#[derive(Default)]
struct Announcer {
    /// This node's services changed (or the peer joined again) since the announcer read them.
    changed: std::sync::atomic::AtomicBool,
    /// Cuts a pause between tries short when `changed` is set.
    wake: tokio::sync::Notify,
}

struct Inner {
    link: NodeLink,
    config: ServiceConfig,
    services: std::sync::RwLock<HashMap<String, Arc<Registered>>>,
    pending: DashMap<u64, Pending>,
    next_id: AtomicU64,
    outstanding: Arc<Semaphore>,
    inbound: Arc<Semaphore>,
    /// Per peer, its share of `inbound` (dropped when it leaves).
    inbound_per_peer: DashMap<NodeId, Arc<Semaphore>>,
    /// Busy answers being sent at once; past it a refused request is dropped unanswered (its
    /// caller times out), so a peer that floods requests and reads no answers cannot make this
    /// node hold a task per request.
    busy_replies: Arc<Semaphore>,
    directory: DashMap<NodeId, Vec<String>>,
    announcements: broadcast::Sender<NodeId>,
    /// The peers with an announcer running (see [`Services::announce_to`]).
    announcers: std::sync::Mutex<HashMap<NodeId, Arc<Announcer>>>,
}

/// A node's service router (both ends: serving and calling). Cheap to clone.
#[derive(Clone)]
pub struct Services {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Services {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Services").field("node", self.inner.link.local_id()).finish_non_exhaustive()
    }
}

impl Services {
    /// A router sending and receiving over `link`: it takes the link's service frames straight
    /// from where they arrive ([`RuntimeLink::set_service_sink`]), replacing any router there.
    pub fn new(link: impl Into<NodeLink>, config: ServiceConfig) -> Self {
        let link = link.into();
        let (announcements, _) = broadcast::channel(256);
        let this = Self {
            inner: Arc::new(Inner {
                link,
                config,
                services: std::sync::RwLock::new(HashMap::new()),
                pending: DashMap::new(),
                next_id: AtomicU64::new(1),
                outstanding: Arc::new(Semaphore::new(config.max_outstanding)),
                inbound: Arc::new(Semaphore::new(config.max_inbound)),
                inbound_per_peer: DashMap::new(),
                busy_replies: Arc::new(Semaphore::new(MAX_BUSY_REPLIES)),
                directory: DashMap::new(),
                announcements,
                announcers: std::sync::Mutex::new(HashMap::new()),
            }),
        };
        // weak: the link must not keep its own router (and through it, itself) alive
        let router = Arc::downgrade(&this.inner);
        this.inner.link.set_service_sink(Arc::new(move |d| {
            if let Some(inner) = router.upgrade() {
                Services { inner }.handle_frame(d);
            }
        }));
        this
    }

    /// Serves `name` with `handler` under `spec` (replacing a service of that name, e.g. after
    /// its actor restarted) and announces it to every member.
    pub fn register(&self, name: &str, spec: ServiceSpec, handler: Handler) {
        let classed: ClassedHandler = Arc::new(move |caller, method, body| {
            let answer = handler(caller, method, body);
            Box::pin(async move { answer.await.map_err(|e| (FaultKind::Failed, e)) })
        });
        self.register_classed(name, spec, classed);
    }

    /// [`Services::register`] with a handler that classes its own failures.
    pub fn register_classed(&self, name: &str, spec: ServiceSpec, handler: ClassedHandler) {
        if let Ok(mut g) = self.inner.services.write() {
            g.insert(name.to_string(), Arc::new(Registered { spec, handler }));
        }
        for peer in self.inner.link.peers() {
            self.announce_to(peer);
        }
    }

    /// Stops serving `name`.
    pub fn unregister(&self, name: &str) {
        if let Ok(mut g) = self.inner.services.write() {
            g.remove(name);
        }
    }

    /// Names of the services this node serves.
    pub fn local_services(&self) -> Vec<String> {
        let mut v: Vec<String> =
            self.inner.services.read().map(|g| g.keys().cloned().collect()).unwrap_or_default();
        v.sort();
        v
    }

    /// What each peer announced it serves.
    pub fn directory(&self) -> Vec<(NodeId, Vec<String>)> {
        let mut v: Vec<(NodeId, Vec<String>)> =
            self.inner.directory.iter().map(|e| (e.key().clone(), e.value().clone())).collect();
        v.sort();
        v
    }

    /// The peers that announced `service`.
    pub fn providers(&self, service: &str) -> Vec<NodeId> {
        self.directory().into_iter().filter(|(_, s)| s.iter().any(|x| x == service)).map(|(n, _)| n).collect()
    }

    /// Every announced service whose name starts with `prefix`, as (peer, service), sorted by
    /// peer name.
    pub fn services_with_prefix(&self, prefix: &str) -> Vec<(NodeId, String)> {
        self.directory()
            .into_iter()
            .flat_map(|(peer, names)| {
                names.into_iter().filter(|n| n.starts_with(prefix)).map(move |n| (peer.clone(), n))
            })
            .collect()
    }

    /// Waits until `found` returns something, looking again at each service announcement (not
    /// by polling); `None` once `timeout` has passed, after a last look. The one way a
    /// scheduler waits for the actors it needs.
    pub async fn wait_for<T>(
        &self,
        timeout: Duration,
        mut found: impl FnMut(&Services) -> Option<T>,
    ) -> Option<T> {
        let deadline = crate::clock::timer_now() + timeout;
        let mut announcements = self.subscribe_announcements();
        loop {
            if let Some(t) = found(self) {
                return Some(t);
            }
            match tokio::time::timeout_at(deadline, announcements.recv()).await {
                Ok(Ok(_) | Err(broadcast::error::RecvError::Lagged(_))) => {}
                Err(_) | Ok(Err(broadcast::error::RecvError::Closed)) => return found(self),
            }
        }
    }

    /// Names of the peers that announce services, from now on (one event per announcement).
    pub fn subscribe_announcements(&self) -> broadcast::Receiver<NodeId> {
        self.inner.announcements.subscribe()
    }

    /// A member joined: tell it what this node serves.
    pub fn peer_joined(&self, peer: &NodeId) {
        self.announce_to(peer.clone());
    }

    /// A peer's connection ended: its pending calls fail now, its announcements are forgotten.
    pub fn peer_left(&self, peer: &NodeId, reason: &str) {
        self.inner.directory.remove(peer);
        self.inner.inbound_per_peer.remove(peer);
        self.fail_pending(peer, reason);
    }

    /// The membership view declared `peer` down: the calls waiting on it fail now (its
    /// connection may stay open far longer; its announcements stay until it leaves).
    pub fn peer_down(&self, peer: &NodeId) {
        self.fail_pending(peer, "the peer was declared down");
    }

    /// A peer came back as a new process: the calls the old one never answered fail now (the
    /// new one announces its services itself, so the directory is left to it).
    pub fn peer_restarted(&self, peer: &NodeId) {
        self.fail_pending(peer, "the peer restarted before answering");
    }

    fn fail_pending(&self, peer: &NodeId, reason: &str) {
        let mut ids: Vec<u64> =
            self.inner.pending.iter().filter(|e| &e.value().peer == peer).map(|e| *e.key()).collect();
        // in call order, not the map's (seeded per process): a simulated run replays exactly
        ids.sort_unstable();
        for id in ids {
            if let Some((_, p)) = self.inner.pending.remove(&id) {
                let _ = p.tx.send(Err(reason.to_string()));
            }
        }
    }

    /// Tells `peer` what this node serves, in the background, trying again with backoff when the
    /// announcement is lost (a lost one left the peer's directory without this node's services
    /// until the next join: the fault explorer's `typed` seed 109). One announcer per peer sends
    /// one announcement at a time, each read when it is sent, and once more when the services
    /// changed meanwhile: two announcers racing could deliver an older list after a newer one,
    /// and the peer kept the older (a flaky `typed_actors` run found it).
    fn announce_to(&self, peer: NodeId) {
        if self.local_services().is_empty() {
            return;
        }
        let announcer = {
            let Ok(mut running) = self.inner.announcers.lock() else { return };
            if let Some(a) = running.get(&peer) {
                a.changed.store(true, Ordering::SeqCst);
                a.wake.notify_one();
                return;
            }
            let a = Arc::new(Announcer::default());
            running.insert(peer.clone(), a.clone());
            a
        };
        let this = self.clone();
        tokio::spawn(async move {
            loop {
                this.announce_now(&peer, &announcer).await;
                let Ok(mut running) = this.inner.announcers.lock() else { return };
                if !announcer.changed.swap(false, Ordering::SeqCst) {
                    running.remove(&peer);
                    return;
                }
            }
        });
    }

    /// One announcement to `peer`, tried up to [`ANNOUNCE_TRIES`] times, each try carrying the
    /// services served at that moment.
    async fn announce_now(&self, peer: &NodeId, announcer: &Announcer) {
        let mut pause = ANNOUNCE_BACKOFF;
        for attempt in 1..=ANNOUNCE_TRIES {
            announcer.changed.store(false, Ordering::SeqCst);
            let body = match to_body(&self.local_services()) {
                Ok(b) => b,
                Err(e) => return warn!(error = %e, "encoding the service announcement"),
            };
            match self.call(peer, DIRECTORY, ANNOUNCE, body, ANNOUNCE_TIMEOUT).await {
                Ok(_) => return,
                Err(e) => debug!(%peer, attempt, error = %e, "service announcement not delivered"),
            }
            tokio::select! {
                biased;
                () = announcer.wake.notified() => {}
                () = tokio::time::sleep(pause) => {}
            }
            pause = (pause * 2).min(ANNOUNCE_BACKOFF_MAX);
        }
    }

    /// Calls `service.method` on `peer` with `body`; the answer body, or why there is none.
    pub async fn call(
        &self,
        peer: &NodeId,
        service: &str,
        method: &str,
        body: Vec<u8>,
        timeout: Duration,
    ) -> Result<Vec<u8>, CallError> {
        self.start_call(peer, service, method, body).await?.answer(timeout).await
    }

    /// Sends a call to `peer` now and hands back its answer to await later
    /// ([`PendingCall::answer`]): the request keeps its place among what this node sends the
    /// peer after it (a flow-control marker among tells).
    pub async fn start_call(
        &self,
        peer: &NodeId,
        service: &str,
        method: &str,
        body: Vec<u8>,
    ) -> Result<PendingCall, CallError> {
        let permit = self
            .inner
            .outstanding
            .clone()
            .try_acquire_owned()
            .map_err(|_| CallError::TooManyOutstanding(self.inner.config.max_outstanding))?;
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let frame = service::encode(&Envelope::Request(Request {
            id,
            service: service.to_string(),
            method: method.to_string(),
            body,
        }))?;
        let (tx, rx) = oneshot::channel();
        self.inner.pending.insert(id, Pending { peer: peer.clone(), tx });
        let call = PendingCall {
            services: self.clone(),
            id,
            rx,
            peer: peer.clone(),
            service: service.to_string(),
            method: method.to_string(),
            _permit: permit,
        };
        if let Err(e) = self.inner.link.send(peer, Channel::Data, frame).await {
            return Err(CallError::Send {
                peer: call.peer.clone(),
                service: call.service.clone(),
                method: call.method.clone(),
                detail: e.to_string(),
            });
        }
        Ok(call)
    }

    /// Sends `service.method` to `peer` with `body`, wanting no answer (a tell): the callee runs
    /// it under the same role check and admission as a call, and logs what it refuses. `Ok`
    /// means handed to the link, not handled.
    pub async fn send_one_way(
        &self,
        peer: &NodeId,
        service: &str,
        method: &str,
        body: Vec<u8>,
    ) -> Result<(), CallError> {
        let frame = service::encode(&Envelope::Request(Request {
            id: ONE_WAY,
            service: service.to_string(),
            method: method.to_string(),
            body,
        }))?;
        self.inner.link.send(peer, Channel::Data, frame).await.map_err(|e| CallError::Send {
            peer: peer.clone(),
            service: service.to_string(),
            method: method.to_string(),
            detail: e.to_string(),
        })
    }

    /// Takes a [`FrameKind::Service`] frame from the link (called on the stream's reader): a
    /// response completes its call, a request is checked and run on its own task. Never blocks;
    /// bad frames are logged.
    pub fn handle_frame(&self, d: Delivery) {
        debug_assert_eq!(d.frame.kind, FrameKind::Service);
        match service::decode(&d.frame, &self.inner.config.limits) {
            Ok(Envelope::Response(Response { id, outcome })) => {
                let Some((_, p)) = self.inner.pending.remove_if(&id, |_, p| p.peer == d.from) else {
                    debug!(peer = %d.from, id, "response to no outstanding call");
                    return;
                };
                let reply = match outcome {
                    Outcome::Ok(b) => Ok(b),
                    Outcome::Err(Fault { kind, message }) => Err((kind, message)),
                };
                let _ = p.tx.send(Ok(reply));
            }
            Ok(Envelope::Request(req)) => self.serve(d.from, req),
            Err(e) => warn!(peer = %d.from, error = %e, "invalid service message dropped"),
        }
    }

    /// Takes a slot for one call from `from`: its own share first, then the node's; the reason
    /// when either is full.
    fn admit(&self, from: &NodeId) -> Result<(OwnedSemaphorePermit, OwnedSemaphorePermit), String> {
        let cfg = &self.inner.config;
        let share = self
            .inner
            .inbound_per_peer
            .entry(from.clone())
            .or_insert_with(|| Arc::new(Semaphore::new(cfg.max_inbound_per_peer)))
            .clone();
        let mine = share.try_acquire_owned().map_err(|_| {
            format!(
                "{} calls from {from} in progress, the most this node runs for one peer",
                cfg.max_inbound_per_peer
            )
        })?;
        let node =
            self.inner.inbound.clone().try_acquire_owned().map_err(|_| {
                format!("{} calls in progress, the most this node runs at once", cfg.max_inbound)
            })?;
        Ok((mine, node))
    }

    fn serve(&self, from: NodeId, req: Request) {
        let this = self.clone();
        let permit = self.admit(&from);
        let busy_slot = if permit.is_err() {
            match self.inner.busy_replies.clone().try_acquire_owned() {
                Ok(slot) => Some(slot),
                Err(_) => {
                    return debug!(peer = %from, service = %req.service, "busy, and too many busy answers in flight: request dropped");
                }
            }
        } else {
            None
        };
        let mut answer = Box::pin(async move {
            let _busy_slot = busy_slot;
            let Request { id, service, method, body } = req;
            let reply = match permit {
                Err(why) => Err((FaultKind::Busy, why)),
                Ok(_permits) => this.run(&from, &service, &method, body, id == ONE_WAY).await,
            };
            if id == ONE_WAY {
                match reply {
                    Err((kind @ (FaultKind::Busy | FaultKind::Gone), message)) => {
                        debug!(peer = %from, %service, %method, ?kind, reason = %message, "one-way request not carried out")
                    }
                    Err((kind, message)) => {
                        warn!(peer = %from, %service, %method, ?kind, reason = %message, "one-way request refused")
                    }
                    Ok(_) => {}
                }
                return;
            }
            let outcome = match reply {
                Ok(b) => Outcome::Ok(b),
                Err((kind, message)) => {
                    if kind == FaultKind::Forbidden
                        || kind == FaultKind::UnknownService
                        || kind == FaultKind::UnknownMethod
                    {
                        warn!(peer = %from, %service, %method, reason = %message, "service call refused");
                    }
                    Outcome::Err(Fault { kind, message })
                }
            };
            let frame = match service::encode(&Envelope::Response(Response { id, outcome })) {
                Ok(f) => f,
                Err(e) => return warn!(peer = %from, %service, %method, error = %e, "encoding the response"),
            };
            if let Err(e) = this.inner.link.send(&from, Channel::Data, frame).await {
                debug!(peer = %from, %service, %method, error = %e, "response not delivered");
            }
        });
        // a handler that answers without waiting is answered here, on the stream's reader (a
        // task hop fewer each way); one that waits goes on a task of its own, which polls it again
        // with a real waker (a future may be polled with a different waker each time)
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        if answer.as_mut().poll(&mut cx).is_pending() {
            tokio::spawn(answer);
        }
    }

    async fn run(&self, from: &NodeId, service: &str, method: &str, body: Vec<u8>, one_way: bool) -> Reply {
        let me = self.inner.link.local_id().clone();
        let roles = self.inner.link.peer_roles(from).unwrap_or_default();
        let member = self.inner.link.is_member(from);
        if service == DIRECTORY {
            if method != ANNOUNCE {
                return Err((
                    FaultKind::UnknownMethod,
                    format!("service {DIRECTORY} on {me} has no method {method:?}"),
                ));
            }
            if !member {
                return Err((
                    FaultKind::Forbidden,
                    format!("{from} (role {roles}) is not a member and may not call {DIRECTORY}.{ANNOUNCE}"),
                ));
            }
            return self.announced(from, &body);
        }
        let registered = self.inner.services.read().ok().and_then(|g| g.get(service).cloned());
        let Some(registered) = registered else {
            return Err((FaultKind::UnknownService, format!("node {me} serves no service {service:?}")));
        };
        let Some(allow) = registered.spec.allow(method) else {
            let known: Vec<&String> = registered.spec.methods.keys().collect();
            return Err((
                FaultKind::UnknownMethod,
                format!("service {service} on {me} has no method {method:?} (methods: {known:?})"),
            ));
        };
        let permitted = match allow {
            Allow::AnyMember => member,
            Allow::Roles(set) => roles.intersects(set),
        };
        if !permitted {
            let needs = match allow {
                Allow::AnyMember => "a cluster member".to_string(),
                Allow::Roles(set) => format!("role {set}"),
            };
            return Err((
                FaultKind::Forbidden,
                format!("role {roles} of {from} may not call {service}.{method} (it needs {needs})"),
            ));
        }
        let caller = Caller { node: from.clone(), roles, one_way };
        (registered.handler)(caller, method.to_string(), body).await
    }

    fn announced(&self, from: &NodeId, body: &[u8]) -> Reply {
        let names: Vec<String> = with_archived::<Vec<String>, _>(body, |a| {
            if a.len() > MAX_ANNOUNCED {
                return Err(format!("{} services announced, the cap is {MAX_ANNOUNCED}", a.len()));
            }
            if let Some(long) = a.iter().find(|s| s.len() > service::MAX_NAME) {
                return Err(format!("service name of {} bytes exceeds {}", long.len(), service::MAX_NAME));
            }
            Ok(a.iter().map(|s| s.as_str().to_string()).collect())
        })
        .map_err(|e| (FaultKind::BadRequest, e))?;
        debug!(peer = %from, services = ?names, "services announced");
        self.inner.directory.insert(from.clone(), names);
        let _ = self.inner.announcements.send(from.clone());
        Ok(Vec::new())
    }
}

/// A call sent and not yet answered ([`Services::start_call`]); dropping it forgets the call.
pub struct PendingCall {
    services: Services,
    id: u64,
    rx: oneshot::Receiver<Result<Reply, String>>,
    peer: NodeId,
    service: String,
    method: String,
    _permit: OwnedSemaphorePermit,
}

impl PendingCall {
    /// The answer body, or why there is none, waiting at most `timeout`.
    pub async fn answer(mut self, timeout: Duration) -> Result<Vec<u8>, CallError> {
        let outcome = tokio::time::timeout(timeout, &mut self.rx).await;
        let (peer, service, method) = (self.peer.clone(), self.service.clone(), self.method.clone());
        match outcome {
            Err(_) => Err(CallError::Timeout { peer, service, method, timeout }),
            Ok(Err(_)) => Err(CallError::PeerLeft { peer, service, method, reason: "router stopped".into() }),
            Ok(Ok(Err(reason))) => Err(CallError::PeerLeft { peer, service, method, reason }),
            Ok(Ok(Ok(Ok(bytes)))) => Ok(bytes),
            Ok(Ok(Ok(Err((kind, message))))) => {
                Err(CallError::Remote { peer, service, method, kind, message })
            }
        }
    }
}

impl Drop for PendingCall {
    fn drop(&mut self) {
        self.services.inner.pending.remove(&self.id);
    }
}

/// Serializer type for service bodies.
pub type BodySerializer<'a> = HighSerializer<AlignedVec<16>, ArenaHandle<'a>, rancor::Error>;

/// The rkyv archive of `value`, as a service body.
pub fn to_body<T>(value: &T) -> Result<Vec<u8>, String>
where
    T: for<'a> rkyv::Serialize<BodySerializer<'a>>,
{
    rkyv::to_bytes::<rancor::Error>(value)
        .map(|b| b.to_vec())
        .map_err(|e| format!("encoding {}: {e}", std::any::type_name::<T>()))
}

/// Checked access to a body from a peer through the runtime's one decode path
/// ([`crate::decode::access`]: capped at [`crate::decode::MAX_MESSAGE_BYTES`], charged to a fresh
/// per-message budget, copied aligned), handed to `f` to check the archived form and build what
/// it needs. The error names the message type.
pub fn with_archived<T, R>(
    body: &[u8],
    f: impl FnOnce(&T::Archived) -> Result<R, String>,
) -> Result<R, String>
where
    T: rkyv::Archive,
    T::Archived: rkyv::Portable + for<'a> CheckBytes<HighValidator<'a, rancor::Error>>,
{
    crate::decode::access::<T, R>(
        std::any::type_name::<T>(),
        body,
        crate::decode::MAX_MESSAGE_BYTES,
        &mut crate::decode::plain_budget(),
        f,
    )
    .map_err(|e| e.to_string())
}

/// A non-member client's side of a service: its own QUIC endpoint, a router for the answers and
/// the node it dialled. The one way `CoeClient`, `ForemanClient` and the like reach a service.
pub struct ServiceClient {
    /// The client's endpoint (closed with [`QuicNode::shutdown`]).
    pub link: QuicNode,
    /// The router its calls and their answers go through.
    pub services: Services,
    /// The node at the dialled address.
    pub server: NodeId,
}

impl ServiceClient {
    /// Binds an endpoint as `identity` (not a member), serving `blobs` to the peer if given (set
    /// before the dial, so the peer may pull from the first frame on), and dials `addr`.
    pub async fn connect(
        identity: &troupe_transport::NodeIdentity,
        addr: std::net::SocketAddr,
        blobs: Option<Arc<dyn troupe_transport::quic::BlobServer>>,
    ) -> Result<Self, troupe_transport::QuicError> {
        Self::connect_with(identity, addr, blobs, troupe_transport::QuicConfig::default()).await
    }

    /// [`ServiceClient::connect`] with the endpoint's settings from `config` (its `member` and
    /// `bind` are set here: a client is never a member and binds where it can reach `addr`).
    pub async fn connect_with(
        identity: &troupe_transport::NodeIdentity,
        addr: std::net::SocketAddr,
        blobs: Option<Arc<dyn troupe_transport::quic::BlobServer>>,
        config: troupe_transport::QuicConfig,
    ) -> Result<Self, troupe_transport::QuicError> {
        let config = troupe_transport::QuicConfig {
            member: false,
            bind: crate::node::client_bind_for(addr),
            ..config
        };
        let link = QuicNode::bind(identity, config).await?;
        if let Some(blobs) = blobs {
            link.set_blob_server(blobs);
        }
        let services = Services::new(link.clone(), ServiceConfig::default());
        {
            let link = link.clone();
            // service frames go to the router on their own; anything else the server sends is
            // dropped here, so it cannot fill the inbox and hold up the stream behind it
            tokio::spawn(async move {
                while let Ok(d) = link.recv().await {
                    debug!(peer = %d.from, kind = ?d.frame.kind, "frame a service client has no use for dropped");
                }
            });
        }
        let server = link.connect_any(addr).await?;
        Ok(ServiceClient { link, services, server })
    }
}

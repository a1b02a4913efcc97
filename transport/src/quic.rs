//! The QUIC implementation of [`Link`]: one endpoint per node, one connection per peer, one
//! unidirectional stream per (direction, channel), and bidirectional streams for the hello,
//! the control plane (ractor_cluster) and blob pulls.
//!
//! Every stream opens with a one-byte tag saying what it carries. A bad frame on a stream stops
//! that stream with an error naming the problem; the connection and the node keep serving.
//!
//! Memory one peer can make this node hold is bounded per connection: the frames being received
//! on its streams and those received but not yet consumed count against a [`ConnBudget`] of
//! [`QuicConfig::conn_budget`] bytes; past it the connection is closed with
//! [`CODE_OVER_BUDGET`] and a [`PeerEvent::OverBudget`] naming the peer, the cap and the bytes
//! held. QUIC flow control bounds what sits unread in quinn (the connection receive window), and
//! [`QuicConfig::max_uni_streams`] how many streams a peer may have open at once. The event
//! channel is bounded too ([`EVENT_CAPACITY`]).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use dashmap::DashMap;
use quinn::{Connection, Endpoint, RecvStream, SendStream, VarInt};
use tokio::sync::{Mutex, mpsc};
use tracing::{debug, warn};

use crate::traffic::Traffic;

use crate::admission::{Admission, Refusal};
use crate::blob::{self, BlobId, BlobPolicy, BlobStore, Incoming};
use crate::blocking::{OFF_RUNTIME_MIN_BYTES, off_the_runtime};
use crate::budget::{ConnBudget, DEFAULT_CONN_BUDGET};
use crate::control::{ControlStream, TiedStream};
use crate::frame::{
    Frame, FrameError, FrameKind, FrameLimits, PROTOCOL_VERSION, read_frame, read_frame_budgeted,
    read_frame_budgeted_reusing, write_frame,
};
use crate::hello::{ArchivedHello, ArchivedHelloAck, Hello, HelloAck, check_hello};
use crate::identity::{CertInfo, IdentityError, NodeIdentity, peer_certificate};
use crate::link::{Channel, Delivery, Link, LinkError, NodeId};
use crate::local::{self, LocalCounters, LocalStats};
use crate::roles::RoleSet;
use crate::shm::{LocalTarget, ShmConfig, ShmState, ShmStats};

/// Tag of the bidirectional stream carrying the hello exchange.
const TAG_HELLO: u8 = 0x48;
/// Tag of the bidirectional stream carrying the control plane (ractor_cluster).
const TAG_CONTROL: u8 = 0x43;
/// Tag of a bidirectional stream pulling one blob.
const TAG_BLOB: u8 = 0x42;
/// Tag of the bidirectional stream offering the same-host path (see [`crate::shm`]).
const TAG_SHM: u8 = 0x53;
/// Cap on hello frames (a name and a version).
const HELLO_LIMITS: FrameLimits = FrameLimits { max_body: 4096 };
/// Largest UDP payload sent or accepted on an impaired link ([`QuicConfig::impairment`]), whose
/// socket sends one datagram at a time: an emulated link keeps small datagrams, as a real one
/// would. Otherwise the limit is [`crate::datagram::MAX_DATAGRAM`].
const IMPAIRED_MAX_UDP_PAYLOAD: u16 = 6500;
/// Application error code when a stream is stopped for a bad frame.
const CODE_BAD_FRAME: u32 = 0x10;
/// Application error code when the hello is refused.
const CODE_REFUSED: u32 = 0x11;
/// Application error code when a newer connection from the same peer replaces this one.
const CODE_REPLACED: u32 = 0x12;
/// Application error code when a peer's connection goes over its memory budget
/// ([`QuicConfig::conn_budget`]).
pub const CODE_OVER_BUDGET: u32 = 0x13;
/// Default for [`QuicConfig::max_uni_streams`]: a peer needs one stream per channel (three);
/// the rest is room for streams being replaced.
pub const DEFAULT_MAX_UNI_STREAMS: u32 = 16;
/// Capacity of the [`PeerEvent`] channel. Events a peer can cause at will (refusals, bad
/// streams, over-budget closes) are dropped and counted when it is full; the others (joins,
/// leaves, control streams: at most a few per connection) wait for room, which holds back only
/// the connection that caused them.
pub const EVENT_CAPACITY: usize = 1024;
/// Application error code for a connection dropped in order (a test's or operator's disconnect).
const CODE_SHUTDOWN: u32 = 0x00;
/// Application error code of a node shutting down in order: it leaves the cluster.
const CODE_GOODBYE: u32 = 0x14;
/// How long a channel's first frame to a peer waits for the same-host handshake to decide
/// whether the channel goes over a local stream or QUIC (it takes a round trip and two small
/// file operations; a peer that never answers only delays its own traffic this long once).
const LOCAL_DECISION_WAIT: Duration = Duration::from_secs(2);
/// Frames up to this size are written to a local stream in one call (header and body copied
/// together); larger ones in two.
const LOCAL_ONE_WRITE: usize = 16 << 10;
/// Read buffer of a same-host channel stream (frames that queued up are taken in one read).
const LOCAL_READ_BUFFER: usize = 64 << 10;
/// Most bidirectional streams (blob pulls among them) a peer may have open at once over QUIC, and
/// most local blob-pull streams it may have open at once.
const MAX_BIDI_STREAMS: u32 = 256;

/// Settings of a QUIC node.
#[derive(Clone, Debug)]
pub struct QuicConfig {
    /// Address to bind (use port 0 for any).
    pub bind: SocketAddr,
    /// Limits applied to every frame a peer sends.
    pub limits: FrameLimits,
    /// QUIC idle timeout: a silent connection is closed after this.
    pub idle_timeout: Duration,
    /// QUIC keep-alive period (below the idle timeout).
    pub keep_alive: Duration,
    /// UDP socket buffer size (loopback loses packets with the 208 KB default).
    pub socket_buffer: usize,
    /// Frames buffered per channel before readers push back on the peer.
    pub inbox_capacity: usize,
    /// Most bytes one connection may hold buffered: frames being received on all its streams
    /// plus frames received but not yet consumed. Past it the connection is closed
    /// ([`CODE_OVER_BUDGET`]). Default [`DEFAULT_CONN_BUDGET`] (256 MiB).
    pub conn_budget: u64,
    /// Most unidirectional streams a peer may have open at once (QUIC stream credit).
    pub max_uni_streams: u32,
    /// Most incoming connections between the handshake and a completed hello at once; more are
    /// refused. Before its hello a connection holds at most QUIC's receive window.
    pub max_pending_hellos: usize,
    /// A connection that has not completed the hello by then is closed.
    pub hello_timeout: Duration,
    /// Whether this endpoint joins the cluster (false for tools like `troupe status`, which peers
    /// then serve without counting them as members).
    pub member: bool,
    /// Who may join (revocation list, allow-list); replaceable with [`QuicNode::set_admission`].
    pub admission: Admission,
    /// The same-host shared-memory path (used only with peers that prove they share the host).
    pub shm: ShmConfig,
    /// Delay, jitter and loss applied to every datagram this node sends (a topology's
    /// `[links]`; see [`crate::impaired`]). `None`: quinn's socket is used as is. When set, the
    /// same-host path is turned off so that every byte crosses the impaired link.
    pub impairment: Option<troupe_policy::LinkImpairment>,
}

impl Default for QuicConfig {
    fn default() -> Self {
        Self {
            bind: SocketAddr::from(([127, 0, 0, 1], 0)),
            limits: FrameLimits::default(),
            idle_timeout: Duration::from_secs(10),
            keep_alive: Duration::from_millis(500),
            socket_buffer: 4 << 20,
            inbox_capacity: 256,
            conn_budget: DEFAULT_CONN_BUDGET,
            max_uni_streams: DEFAULT_MAX_UNI_STREAMS,
            max_pending_hellos: 16,
            hello_timeout: Duration::from_secs(10),
            member: true,
            admission: Admission::default(),
            shm: ShmConfig::default(),
            impairment: None,
        }
    }
}

/// Why the QUIC node failed.
#[derive(Debug, thiserror::Error)]
pub enum QuicError {
    /// Identity or TLS configuration problem.
    #[error(transparent)]
    Identity(#[from] IdentityError),
    /// Socket or endpoint error (its message carries the OS error once: no source chain
    /// repeats it).
    #[error("endpoint: {0}")]
    Io(std::io::Error),
    /// The UDP socket could not be bound.
    #[error("binding the UDP socket {addr}: {detail}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The OS error.
        detail: std::io::Error,
    },
    /// Dialing failed.
    #[error("connect to {addr}: {detail}")]
    Connect {
        /// Where we dialed.
        addr: SocketAddr,
        /// What went wrong.
        detail: String,
    },
    /// The peer refused our hello, or its ack was invalid.
    #[error("peer at {addr} refused the hello: {reason}")]
    Refused {
        /// The peer's address.
        addr: SocketAddr,
        /// Its reason (or ours, when its answer was invalid).
        reason: String,
    },
    /// A frame error during a protocol exchange.
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// A stream failed.
    #[error("stream: {0}")]
    Stream(String),
    /// The peer is not connected.
    #[error(transparent)]
    Link(#[from] LinkError),
}

impl From<std::io::Error> for QuicError {
    fn from(e: std::io::Error) -> Self {
        QuicError::Io(e)
    }
}

/// Membership-relevant connection events, delivered to whoever took [`QuicNode::events`].
#[derive(Debug)]
pub enum PeerEvent {
    /// A peer completed the hello (in either direction).
    Joined {
        /// The peer.
        peer: NodeId,
        /// Its address.
        addr: SocketAddr,
        /// True when this node dialed.
        outbound: bool,
        /// False for a tool that is not a cluster member.
        member: bool,
    },
    /// A peer came back under its name as a new process (another incarnation) while its old
    /// connection was still open: whatever was asked of the old process is lost.
    Restarted {
        /// The peer.
        peer: NodeId,
    },
    /// A peer's connection ended.
    Left {
        /// The peer.
        peer: NodeId,
        /// Why.
        reason: String,
        /// True when the peer closed it shutting down in order ([`QuicNode::shutdown`]): it
        /// left, rather than failed or was cut off.
        goodbye: bool,
    },
    /// A connection attempt was refused (TLS or hello).
    Refused {
        /// The remote address.
        addr: SocketAddr,
        /// Why it was refused.
        reason: String,
    },
    /// A peer's connection went over its memory budget and was closed.
    OverBudget {
        /// The peer.
        peer: NodeId,
        /// The per-connection cap in bytes.
        cap: u64,
        /// Bytes it held when the growth that passed the cap was refused.
        held: u64,
    },
    /// A peer sent something invalid on a stream; that stream was stopped, the connection kept.
    BadStream {
        /// The peer.
        peer: NodeId,
        /// What was wrong, naming the problem.
        detail: String,
    },
    /// The peer opened the control-plane stream (hand it to ractor_cluster).
    ControlStream {
        /// The peer.
        peer: NodeId,
        /// The stream, on QUIC or (a same-host peer) on a local stream.
        stream: ControlStream,
    },
}

/// Serves blob pulls: returns the bytes of a blob this node holds.
pub trait BlobServer: Send + Sync {
    /// The bytes for content hash `id`, if held here.
    fn blob(&self, id: &[u8; 32]) -> Option<Arc<Vec<u8>>>;
}

/// A node's blob store serves pulls directly.
impl BlobServer for std::sync::Mutex<BlobStore> {
    fn blob(&self, id: &[u8; 32]) -> Option<Arc<Vec<u8>>> {
        let bytes = self.lock().ok()?.get(&BlobId(*id)).ok()??;
        Some(Arc::new(bytes.to_vec()))
    }
}

struct NoBlobs;
impl BlobServer for NoBlobs {
    fn blob(&self, _: &[u8; 32]) -> Option<Arc<Vec<u8>>> {
        None
    }
}

/// Where one channel's frames to a peer go; chosen at the channel's first frame and kept for the
/// connection, so the channel's frames stay in order.
enum ChannelSender {
    /// A unidirectional QUIC stream.
    Quic(SendStream),
    /// A same-host Unix-domain stream ([`crate::local`]).
    Local(tokio::net::UnixStream),
}

/// How a stream of a peer's frames ended.
enum StreamEnd {
    /// It closed, failed or was cut; nothing to answer.
    Done,
    /// It carried an invalid frame (already reported): stop it.
    BadFrame,
}

struct Peer {
    conn: Connection,
    /// Where local streams to this peer go, once the same-host handshake decided (`None`: QUIC).
    local: Arc<tokio::sync::SetOnce<Option<LocalTarget>>>,
    /// What this connection's stream readers share (its budget, whether it was heard from).
    state: Arc<ConnState>,
    generation: u64,
    /// The peer process's incarnation, from its hello.
    incarnation: u64,
    member: bool,
    cert: CertInfo,
    senders: HashMap<Channel, Arc<Mutex<Option<ChannelSender>>>>,
}

/// What the streams of one connection share.
struct ConnState {
    /// Bytes this connection holds buffered.
    budget: ConnBudget,
    /// Whether the peer already opened its control-plane stream.
    control_opened: AtomicBool,
    /// Set by every frame read from the peer, cleared by [`QuicNode::take_heard`] (liveness
    /// without a message per frame).
    heard: AtomicBool,
    /// Local channel streams the peer has open to us (capped like its QUIC unidirectional streams).
    local_streams: AtomicUsize,
    /// Local blob-pull streams the peer has open to us (capped like its QUIC bidirectional ones).
    local_pulls: AtomicUsize,
}

/// What a local stream served by its own reader carries (the control stream is handed to the
/// runtime instead).
#[derive(Clone, Copy, Debug)]
enum LocalServed {
    /// Every frame of one channel.
    Channel(Channel),
    /// One blob pull.
    BlobPull,
}

pub use crate::runtime_link::DeliverySink;

struct Inbox {
    control: mpsc::Receiver<Delivery>,
    data: mpsc::Receiver<Delivery>,
    blob: mpsc::Receiver<Delivery>,
}

struct Inner {
    id: NodeId,
    /// The roles in this node's own certificate.
    roles: RoleSet,
    /// Random per endpoint (so per node process), sent in every hello (see [`PeerEvent::Restarted`]).
    incarnation: u64,
    endpoint: Endpoint,
    client_config: quinn::ClientConfig,
    config: QuicConfig,
    peers: DashMap<NodeId, Arc<Peer>>,
    generation: AtomicU64,
    inbox_tx: HashMap<Channel, mpsc::Sender<Delivery>>,
    inbox_rx: Mutex<Inbox>,
    /// Where service frames go instead of the data inbox, when set.
    service_sink: std::sync::RwLock<Option<DeliverySink>>,
    events_tx: mpsc::Sender<PeerEvent>,
    events_rx: std::sync::Mutex<Option<mpsc::Receiver<PeerEvent>>>,
    events_dropped: AtomicU64,
    blobs: std::sync::RwLock<Arc<dyn BlobServer>>,
    admission: std::sync::RwLock<Admission>,
    shm: ShmState,
    /// Counters of the same-host streams.
    local: LocalCounters,
    /// Stops the local-stream listener ([`QuicNode::shutdown`], or when the node is dropped).
    local_stop: tokio::sync::watch::Sender<bool>,
    traffic: Traffic,
    /// What the link impairment did, when one is on.
    impair_stats: Option<Arc<crate::impaired::ImpairStats>>,
}

/// A node's QUIC endpoint and its peer connections. Cheap to clone.
#[derive(Clone)]
pub struct QuicNode {
    inner: Arc<Inner>,
}

/// A random incarnation number: std's per-process random hash keys (seeded from the OS) over
/// the process id and the time.
fn fresh_incarnation() -> u64 {
    use std::hash::BuildHasher;
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    std::collections::hash_map::RandomState::new().hash_one((std::process::id(), now.as_nanos()))
}

/// Largest UDP payload this node sends or accepts (the upper bound of QUIC's path MTU
/// discovery, which still finds ~1452 on Ethernet).
fn max_udp_payload(cfg: &QuicConfig) -> u16 {
    if cfg.impairment.is_some_and(|i| !i.is_off()) {
        IMPAIRED_MAX_UDP_PAYLOAD
    } else {
        crate::datagram::MAX_DATAGRAM
    }
}

fn transport_config(cfg: &QuicConfig) -> Result<Arc<quinn::TransportConfig>, QuicError> {
    let mut t = quinn::TransportConfig::default();
    t.stream_receive_window(VarInt::from_u32(16 << 20));
    t.receive_window(VarInt::from_u32(64 << 20));
    t.send_window(64 << 20);
    t.max_concurrent_uni_streams(VarInt::from_u32(cfg.max_uni_streams));
    t.max_concurrent_bidi_streams(VarInt::from_u32(MAX_BIDI_STREAMS));
    t.keep_alive_interval(Some(cfg.keep_alive));
    let idle = quinn::IdleTimeout::try_from(cfg.idle_timeout)
        .map_err(|e| QuicError::Stream(format!("idle timeout: {e}")))?;
    t.max_idle_timeout(Some(idle));
    let mut mtu = quinn::MtuDiscoveryConfig::default();
    mtu.upper_bound(max_udp_payload(cfg));
    t.mtu_discovery_config(Some(mtu));
    Ok(Arc::new(t))
}

impl QuicNode {
    /// Binds the endpoint and starts accepting peers that present a certificate of the
    /// cluster CA.
    pub async fn bind(identity: &NodeIdentity, mut config: QuicConfig) -> Result<Self, QuicError> {
        let impairment = config.impairment.filter(|i| !i.is_off());
        if impairment.is_some() {
            config.shm.enabled = false;
        }
        let transport = transport_config(&config)?;
        let server = identity.server_config(transport.clone())?;
        let client_config = identity.client_config(transport)?;
        let socket = std::net::UdpSocket::bind(config.bind)
            .map_err(|detail| QuicError::Bind { addr: config.bind, detail })?;
        let state = quinn::udp::UdpSocketState::new((&socket).into())?;
        // best effort: the kernel may clamp it (net.core.rmem_max)
        let _ = state.set_recv_buffer_size((&socket).into(), config.socket_buffer);
        let _ = state.set_send_buffer_size((&socket).into(), config.socket_buffer);
        let mut endpoint_config = quinn::EndpointConfig::default();
        endpoint_config
            .max_udp_payload_size(max_udp_payload(&config))
            .map_err(|e| QuicError::Stream(format!("max UDP payload: {e}")))?;
        let runtime = Arc::new(quinn::TokioRuntime);
        let mut impair_stats = None;
        use quinn::Runtime as _;
        let plain = runtime.wrap_udp_socket(socket)?;
        // the impaired socket sends one datagram at a time, so only the plain one needs its GSO
        // batches capped
        let socket: Arc<dyn quinn::AsyncUdpSocket> = match impairment {
            None => Arc::new(crate::datagram::CappedBatchSocket::new(plain)),
            Some(imp) => {
                let impaired = Arc::new(crate::impaired::ImpairedSocket::new(plain, imp));
                impair_stats = Some(impaired.stats());
                debug!(?imp, "link impairment on: every datagram sent is delayed or dropped in user space");
                impaired
            }
        };
        let endpoint = Endpoint::new_with_abstract_socket(endpoint_config, Some(server), socket, runtime)?;
        let cap = config.inbox_capacity.max(1);
        let (control_tx, control) = mpsc::channel(cap);
        let (data_tx, data) = mpsc::channel(cap);
        let (blob_tx, blob) = mpsc::channel(cap);
        let inbox_tx = HashMap::from([
            (Channel::Control, control_tx),
            (Channel::Data, data_tx),
            (Channel::Blob, blob_tx),
        ]);
        let inbox_rx = Inbox { control, data, blob };
        let (events_tx, events_rx) = mpsc::channel(EVENT_CAPACITY);
        let admission = std::sync::RwLock::new(config.admission.clone());
        // the same-host streams' listener, offered to peers that pass the same-host handshake
        let listener = if config.shm.enabled && config.shm.streams {
            local::listen()
                .inspect_err(|e| warn!(error = %e, "no local-stream listener; same-host peers use QUIC"))
                .ok()
        } else {
            None
        };
        let (listener, stream_name) = match listener {
            Some((l, name)) => (Some(l), Some(name)),
            None => (None, None),
        };
        let shm = ShmState::new(config.shm.clone(), stream_name);
        let (local_stop, local_stopped) = tokio::sync::watch::channel(false);
        let node = Self {
            inner: Arc::new(Inner {
                id: NodeId::new(identity.name.clone()),
                roles: identity.roles(),
                incarnation: fresh_incarnation(),
                endpoint,
                client_config,
                config,
                peers: DashMap::new(),
                generation: AtomicU64::new(0),
                inbox_tx,
                inbox_rx: Mutex::new(inbox_rx),
                service_sink: std::sync::RwLock::new(None),
                events_tx,
                events_rx: std::sync::Mutex::new(Some(events_rx)),
                events_dropped: AtomicU64::new(0),
                blobs: std::sync::RwLock::new(Arc::new(NoBlobs)),
                admission,
                shm,
                local: LocalCounters::default(),
                local_stop,
                traffic: Traffic::default(),
                impair_stats,
            }),
        };
        let acceptor = node.clone();
        tokio::spawn(async move { acceptor.accept_loop().await });
        if let Some(listener) = listener {
            tokio::spawn(local_accept_loop(Arc::downgrade(&node.inner), listener, local_stopped));
        }
        debug!(node = %node.inner.id, addr = %node.local_addr()?, "quic endpoint up");
        Ok(node)
    }

    /// Frames and bytes sent and received per channel since the node started (see
    /// [`crate::traffic`]), in [`Channel::ALL`] order.
    pub fn traffic(&self) -> Vec<(Channel, crate::ChannelTraffic)> {
        self.inner.traffic.snapshot()
    }

    /// What the link impairment ([`QuicConfig::impairment`]) did so far; `None` when it is off.
    pub fn impairment_stats(&self) -> Option<Arc<crate::impaired::ImpairStats>> {
        self.inner.impair_stats.clone()
    }

    /// The bound address.
    pub fn local_addr(&self) -> Result<SocketAddr, QuicError> {
        Ok(self.inner.endpoint.local_addr()?)
    }

    /// Takes the event stream (once; later calls get `None`). It is bounded
    /// ([`EVENT_CAPACITY`]): read it, or joins eventually wait for room.
    pub fn events(&self) -> Option<mpsc::Receiver<PeerEvent>> {
        self.inner.events_rx.lock().ok().and_then(|mut g| g.take())
    }

    /// Events dropped because the event channel was full (see [`EVENT_CAPACITY`]).
    pub fn events_dropped(&self) -> u64 {
        self.inner.events_dropped.load(Ordering::Relaxed)
    }

    /// Installs what serves blob pulls from peers.
    pub fn set_blob_server(&self, server: Arc<dyn BlobServer>) {
        if let Ok(mut g) = self.inner.blobs.write() {
            *g = server;
        }
    }

    /// Hands every [`FrameKind::Service`] frame to `sink`, called on the reader of the stream it
    /// came on (so in order, one hop fewer than the inbox), instead of queueing it for
    /// [`Link::recv`]. The sink must not block: it holds up that stream while it runs.
    pub fn set_service_sink(&self, sink: DeliverySink) {
        if let Ok(mut g) = self.inner.service_sink.write() {
            *g = Some(sink);
        }
    }

    /// Whether anything was read from `peer` since the last call (false if it is not joined).
    pub fn take_heard(&self, peer: &NodeId) -> bool {
        self.inner.peers.get(peer).is_some_and(|p| p.state.heard.swap(false, Ordering::AcqRel))
    }

    /// Cluster members currently joined (tools like `troupe status` are not listed).
    pub fn peers(&self) -> Vec<NodeId> {
        let mut v: Vec<NodeId> =
            self.inner.peers.iter().filter(|e| e.value().member).map(|e| e.key().clone()).collect();
        v.sort();
        v
    }

    /// The address `peer`'s connection comes from (its listening socket: a node dials from the
    /// socket it listens on); `None` when it is not connected.
    pub fn peer_address(&self, peer: &NodeId) -> Option<SocketAddr> {
        self.inner.peers.get(peer).map(|p| p.conn.remote_address())
    }

    /// Whether `peer` is joined as a cluster member.
    pub fn is_member(&self, peer: &NodeId) -> bool {
        self.inner.peers.get(peer).is_some_and(|p| p.member)
    }

    /// The roles in this node's own certificate.
    pub fn local_roles(&self) -> RoleSet {
        self.inner.roles
    }

    /// The roles in the certificate `peer` presented (`None` if it is not connected).
    pub fn peer_roles(&self, peer: &NodeId) -> Option<RoleSet> {
        self.inner.peers.get(peer).map(|p| p.cert.current_roles())
    }

    /// What the certificate `peer` presented says (`None` if it is not connected).
    pub fn peer_certificate(&self, peer: &NodeId) -> Option<CertInfo> {
        self.inner.peers.get(peer).map(|p| p.cert.clone())
    }

    /// Replaces the admission rules and disconnects every connected peer they now refuse
    /// (closing its connection with the refusal as the reason). Returns who was disconnected.
    /// The rules are replaced before the scan, and a joining peer is checked again after it is
    /// listed, so a hello racing with this call meets the new rules.
    pub fn set_admission(&self, admission: Admission) -> Vec<(NodeId, Refusal)> {
        if let Ok(mut g) = self.inner.admission.write() {
            *g = admission.clone();
        }
        let refused: Vec<(NodeId, Refusal)> = self
            .inner
            .peers
            .iter()
            .filter_map(|e| {
                admission
                    .check(e.key().as_str(), &e.value().cert, e.value().member)
                    .err()
                    .map(|r| (e.key().clone(), r))
            })
            .collect();
        for (peer, why) in &refused {
            if let Some((_, p)) = self.inner.peers.remove(peer) {
                let reason = why.to_string();
                warn!(node = %self.inner.id, %peer, %reason, "disconnecting peer");
                p.conn.close(VarInt::from_u32(CODE_REFUSED), reason.as_bytes());
                self.emit(PeerEvent::Left { peer: peer.clone(), reason, goodbye: false });
            }
        }
        refused
    }

    fn admit(&self, name: &str, cert: &CertInfo, member: bool) -> Result<(), String> {
        match self.inner.admission.read() {
            Ok(a) => a.check(name, cert, member).map_err(|r| r.to_string()),
            Err(_) => Err("admission rules unavailable (lock poisoned)".into()),
        }
    }

    /// Whether frames to `peer` currently take the same-host path.
    pub fn same_host(&self, peer: &NodeId) -> bool {
        self.inner.shm.active_to(peer)
    }

    /// Counters of the same-host path.
    pub fn shm_stats(&self) -> ShmStats {
        self.inner.shm.stats()
    }

    /// Counters of the same-host streams ([`crate::local`]).
    pub fn local_stats(&self) -> LocalStats {
        self.inner.local.snapshot()
    }

    /// The abstract name of this node's local-stream listener (`None` when same-host streams are
    /// off); peers learn it in the same-host handshake. For diagnostics and tests.
    pub fn local_stream_name(&self) -> Option<String> {
        self.inner.shm.stream_name().map(str::to_owned)
    }

    /// QUIC's counters for the connection to `peer` (packets, losses, congestion events, MTU).
    pub fn connection_stats(&self, peer: &NodeId) -> Option<quinn::ConnectionStats> {
        self.inner.peers.get(peer).map(|p| p.conn.stats())
    }

    /// Round-trip time QUIC measures to `peer`.
    pub fn rtt(&self, peer: &NodeId) -> Option<Duration> {
        self.inner.peers.get(peer).map(|p| p.conn.rtt())
    }

    /// Dials `addr`, expecting a node called `expected` there, and completes the hello.
    pub async fn connect(&self, addr: SocketAddr, expected: &NodeId) -> Result<NodeId, QuicError> {
        self.dial(addr, Some(expected)).await
    }

    /// Dials `addr` whatever node is there (any certificate of the cluster CA) and returns its
    /// name from the hello ack (used by `troupe status`).
    pub async fn connect_any(&self, addr: SocketAddr) -> Result<NodeId, QuicError> {
        self.dial(addr, None).await
    }

    async fn dial(&self, addr: SocketAddr, expected: Option<&NodeId>) -> Result<NodeId, QuicError> {
        let server_name = expected.map_or(crate::identity::ANY_NODE, |e| e.as_str());
        let connecting = self
            .inner
            .endpoint
            .connect_with(self.inner.client_config.clone(), addr, server_name)
            .map_err(|e| QuicError::Connect { addr, detail: e.to_string() })?;
        let conn = connecting.await.map_err(|e| QuicError::Connect { addr, detail: e.to_string() })?;
        let refused = |reason: String| QuicError::Refused { addr, reason };
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| refused(e.to_string()))?;
        send.write_all(&[TAG_HELLO]).await.map_err(|e| refused(e.to_string()))?;
        let hello = Hello {
            node: self.inner.id.0.clone(),
            protocol: u32::from(PROTOCOL_VERSION),
            member: self.inner.config.member,
            incarnation: self.inner.incarnation,
        };
        write_frame(&mut send, &Frame::encode(FrameKind::Hello, &hello)?)
            .await
            .map_err(|e| refused(format!("sending hello: {e}")))?;
        let ack = read_frame(&mut recv, &HELLO_LIMITS)
            .await
            .map_err(|e| refused(connection_reason(&conn, e)))?
            .ok_or_else(|| refused(connection_reason(&conn, "stream closed before the hello ack")))?;
        let ack_view: &ArchivedHelloAck = ack.access_as::<HelloAck>(FrameKind::HelloAck)?;
        if !ack_view.accepted {
            return Err(refused(ack_view.reason.to_string()));
        }
        let cert =
            peer_certificate(&conn).ok_or_else(|| refused("the peer presented no certificate".into()))?;
        check_hello(ack_view.node.as_str(), ack_view.protocol.to_native(), &cert.names).map_err(refused)?;
        if let Some(expected) = expected
            && ack_view.node.as_str() != expected.as_str()
        {
            return Err(refused(format!("expected node {expected}, found {}", ack_view.node)));
        }
        // the acceptor is always a member: an admin, revoked or unlisted one is refused here too
        if let Err(reason) = self.admit(ack_view.node.as_str(), &cert, true) {
            warn!(node = %self.inner.id, %addr, %reason, "refused the node we dialed");
            conn.close(VarInt::from_u32(CODE_REFUSED), reason.as_bytes());
            self.emit(PeerEvent::Refused { addr, reason: reason.clone() });
            return Err(refused(reason));
        }
        let _ = send.finish();
        let peer = NodeId::new(ack_view.node.as_str());
        let incarnation = ack_view.incarnation.to_native();
        self.register(peer.clone(), conn, true, true, cert, incarnation).await;
        Ok(peer)
    }

    /// Opens the control-plane stream to a joined peer (the dialing side of ractor_cluster):
    /// a local stream when the same-host handshake gave one (waiting for it to decide, at most
    /// `LOCAL_DECISION_WAIT`), else a QUIC bidirectional stream.
    pub async fn open_control(&self, peer: &NodeId) -> Result<ControlStream, QuicError> {
        let (conn, local) = self
            .inner
            .peers
            .get(peer)
            .map(|p| (p.conn.clone(), p.local.clone()))
            .ok_or_else(|| LinkError::UnknownPeer(peer.clone()))?;
        let target = tokio::time::timeout(LOCAL_DECISION_WAIT, local.wait()).await.ok().cloned().flatten();
        if let Some(target) = target {
            let tied = match local::dial(&target.name, &target.token, local::Purpose::Control).await {
                Ok(stream) => TiedStream::new(stream, conn.clone()).map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            match tied {
                Ok(tied) => {
                    self.inner.local.control.fetch_add(1, Ordering::Relaxed);
                    debug!(node = %self.inner.id, %peer, "local control stream open");
                    return Ok(ControlStream::Local(tied));
                }
                Err(e) => debug!(node = %self.inner.id, %peer, error = %e,
                    "local control stream not opened; the control plane uses QUIC"),
            }
        }
        let (mut send, recv) = conn.open_bi().await.map_err(|e| QuicError::Stream(e.to_string()))?;
        send.write_all(&[TAG_CONTROL]).await.map_err(|e| QuicError::Stream(e.to_string()))?;
        Ok(ControlStream::Quic { send, recv })
    }

    /// Pulls blob `id` from `peer` on its own stream ([`blob::request_frame`] answered by a
    /// [`blob::data_frame`]); verifies the id and the content hash of what arrived. The reply is
    /// received within the peer's connection budget (a pull that does not fit fails, naming it).
    pub async fn fetch_blob(&self, peer: &NodeId, id: [u8; 32], max_len: u32) -> Result<Vec<u8>, QuicError> {
        self.fetch_blob_with(peer, id, max_len, <[u8]>::to_vec).await
    }

    /// [`Self::fetch_blob`] handing the verified bytes to `take` where they arrived, instead of
    /// copying them out: a worker writes a pulled stage file to disk with one copy of it in
    /// memory, not two. For a stage-sized blob the check, the hash and `take` run
    /// [`off_the_runtime`].
    pub async fn fetch_blob_with<T>(
        &self,
        peer: &NodeId,
        id: [u8; 32],
        max_len: u32,
        take: impl FnOnce(&[u8]) -> T,
    ) -> Result<T, QuicError> {
        let stream_err = |e: String| QuicError::Stream(e);
        let (conn, budget, target) = self
            .inner
            .peers
            .get(peer)
            .map(|p| (p.conn.clone(), p.state.budget.clone(), p.local.get().cloned().flatten()))
            .ok_or_else(|| LinkError::UnknownPeer(peer.clone()))?;
        let request = blob::request_frame(BlobId(id)).map_err(|e| stream_err(e.to_string()))?;
        let overhead = u32::try_from(blob::BLOB_DATA_OVERHEAD).unwrap_or(u32::MAX);
        let limits =
            FrameLimits { max_body: max_len.saturating_add(overhead).min(self.inner.config.limits.max_body) };
        // a same-host peer answers on a local stream of its own (no encryption, no QUIC hops)
        let local = match target {
            Some(target) => match local::dial(&target.name, &target.token, local::Purpose::BlobPull).await {
                Ok(stream) => Some(stream),
                Err(e) => {
                    debug!(node = %self.inner.id, %peer, error = %e, "local blob pull not opened; pulling over QUIC");
                    None
                }
            },
            None => None,
        };
        let answer = match local {
            Some(mut stream) => {
                self.inner.local.blob_pulls.fetch_add(1, Ordering::Relaxed);
                write_frame(&mut stream, &request).await?;
                read_frame_budgeted(&mut stream, &limits, &budget).await?
            }
            None => {
                let (mut send, mut recv) = conn.open_bi().await.map_err(|e| stream_err(e.to_string()))?;
                send.write_all(&[TAG_BLOB]).await.map_err(|e| stream_err(e.to_string()))?;
                write_frame(&mut send, &request).await?;
                let _ = send.finish();
                read_frame_budgeted(&mut recv, &limits, &budget).await?
            }
        };
        let (frame, _held) = answer.ok_or_else(|| stream_err(format!("{peer} closed the blob stream")))?;
        if frame.kind == FrameKind::Error {
            return Err(stream_err(format!("{peer}: {}", String::from_utf8_lossy(&frame.body))));
        }
        // checking and hashing a stage-sized blob, and what `take` does with it, off this
        // runtime thread
        let check_and_take = || {
            let data = frame.access_as::<blob::BlobData>(FrameKind::BlobData)?;
            if data.id != id || blake3::hash(data.bytes.as_slice()).as_bytes() != &id {
                return Err(stream_err(format!("blob from {peer} does not match its hash {}", BlobId(id))));
            }
            Ok(take(data.bytes.as_slice()))
        };
        if frame.body.len() >= OFF_RUNTIME_MIN_BYTES {
            off_the_runtime(check_and_take)
        } else {
            check_and_take()
        }
    }

    /// Sends `frame`, by reference when the policy says so: the body goes into `store` (which
    /// must be this node's blob server) and the peer pulls it by hash.
    pub async fn send_with_policy(
        &self,
        to: &NodeId,
        channel: Channel,
        frame: Frame,
        policy: &BlobPolicy,
        store: &std::sync::Mutex<BlobStore>,
    ) -> Result<(), QuicError> {
        let frame = {
            let mut guard = store.lock().map_err(|_| QuicError::Stream("blob store lock poisoned".into()))?;
            blob::prepare_outgoing(frame, policy, &mut guard).map_err(|e| QuicError::Stream(e.to_string()))?
        };
        let body = frame.body.len();
        self.send_frame(to, channel, frame).await?;
        self.inner.traffic.sent(channel, body);
        Ok(())
    }

    /// Turns a received frame back into the original: a by-reference frame is resolved from
    /// `cache` or pulled from the sender, verified and cached.
    pub async fn resolve(
        &self,
        delivery: Delivery,
        policy: &BlobPolicy,
        cache: &std::sync::Mutex<BlobStore>,
    ) -> Result<Frame, QuicError> {
        let blob_err = |e: blob::BlobError| QuicError::Stream(e.to_string());
        match blob::classify_incoming(delivery.frame, policy).map_err(blob_err)? {
            Incoming::Ready(frame) => Ok(frame),
            Incoming::NeedsBlob { kind, flags, reference } => {
                let id = reference.blob_id();
                let cached = cache.lock().ok().and_then(|mut g| g.get(&id).ok().flatten());
                let bytes: Arc<[u8]> = match cached {
                    Some(b) => b,
                    None => {
                        let max = u32::try_from(reference.len).unwrap_or(u32::MAX);
                        let bytes: Arc<[u8]> = self.fetch_blob(&delivery.from, id.0, max).await?.into();
                        if bytes.len() as u64 != reference.len {
                            return Err(QuicError::Stream(format!(
                                "blob {id} has {} bytes, the reference said {}",
                                bytes.len(),
                                reference.len
                            )));
                        }
                        if let Ok(mut g) = cache.lock() {
                            g.put_verified(id, bytes.clone()).map_err(blob_err)?;
                        }
                        bytes
                    }
                };
                Ok(blob::rebuild_frame(kind, flags, &bytes))
            }
        }
    }

    /// Closes every connection and the endpoint, waiting (at most a second) until peers were
    /// told: a connection to a peer that already vanished would otherwise hold on until its
    /// idle timeout.
    pub async fn shutdown(&self) {
        let _ = self.inner.local_stop.send(true);
        self.inner.shm.close_all();
        self.inner.endpoint.close(VarInt::from_u32(CODE_GOODBYE), b"goodbye: shutting down");
        let _ = tokio::time::timeout(Duration::from_secs(1), self.inner.endpoint.wait_idle()).await;
    }

    /// Drops the connection to `peer` (for tests and operator commands).
    pub fn disconnect(&self, peer: &NodeId, reason: &str) {
        if let Some((_, p)) = self.inner.peers.remove(peer) {
            p.conn.close(VarInt::from_u32(CODE_SHUTDOWN), reason.as_bytes());
        }
    }

    fn connection(&self, peer: &NodeId) -> Result<Connection, LinkError> {
        self.inner.peers.get(peer).map(|p| p.conn.clone()).ok_or_else(|| LinkError::UnknownPeer(peer.clone()))
    }

    /// Emits an event a peer can cause at will: dropped (and counted) when the channel is full.
    fn emit(&self, ev: PeerEvent) {
        if let Err(mpsc::error::TrySendError::Full(ev)) = self.inner.events_tx.try_send(ev) {
            let dropped = self.inner.events_dropped.fetch_add(1, Ordering::Relaxed) + 1;
            warn!(node = %self.inner.id, ?ev, dropped, "event channel full; event dropped");
        }
    }

    /// Closes `peer`'s connection for holding more than its memory budget, naming the cap.
    fn close_over_budget(&self, conn: &Connection, peer: NodeId, over: crate::budget::BudgetExceeded) {
        let reason = over.to_string();
        warn!(node = %self.inner.id, %peer, cap = over.cap, held = over.held, %reason,
            "peer over its memory budget; closing the connection");
        conn.close(VarInt::from_u32(CODE_OVER_BUDGET), reason.as_bytes());
        self.emit(PeerEvent::OverBudget { peer, cap: over.cap, held: over.held });
    }

    /// Emits an event that must not be lost, waiting for room (bounded per connection).
    async fn emit_wait(&self, ev: PeerEvent) {
        let _ = self.inner.events_tx.send(ev).await;
    }

    async fn accept_loop(self) {
        // Taken once the TLS handshake has verified the peer's certificate, so a client without
        // one cannot occupy the places of the cluster's nodes.
        let pending = Arc::new(tokio::sync::Semaphore::new(self.inner.config.max_pending_hellos.max(1)));
        while let Some(incoming) = self.inner.endpoint.accept().await {
            let (node, pending) = (self.clone(), pending.clone());
            tokio::spawn(async move {
                let addr = incoming.remote_address();
                match incoming.await {
                    Ok(conn) => match pending.try_acquire_owned() {
                        Ok(_permit) => node.serve_hello(conn).await,
                        Err(_) => {
                            let reason = format!(
                                "{} connections are already waiting for their hello",
                                node.inner.config.max_pending_hellos
                            );
                            warn!(node = %node.inner.id, %addr, %reason, "refused connection");
                            conn.close(VarInt::from_u32(CODE_REFUSED), reason.as_bytes());
                            node.emit(PeerEvent::Refused { addr, reason });
                        }
                    },
                    Err(e) => {
                        let reason = e.to_string();
                        warn!(node = %node.inner.id, %addr, %reason, "refused connection (TLS)");
                        node.emit(PeerEvent::Refused { addr, reason });
                    }
                }
            });
        }
    }

    async fn serve_hello(self, conn: Connection) {
        let addr = conn.remote_address();
        let deadline = self.inner.config.hello_timeout;
        let result = tokio::time::timeout(deadline, async {
            let (mut send, mut recv) = conn.accept_bi().await.map_err(|e| e.to_string())?;
            let mut tag = [0u8; 1];
            recv.read_exact(&mut tag).await.map_err(|e| e.to_string())?;
            if tag[0] != TAG_HELLO {
                return Err(format!("first stream has tag {:#04x}, expected a hello", tag[0]));
            }
            let frame = read_frame(&mut recv, &HELLO_LIMITS)
                .await
                .map_err(|e| e.to_string())?
                .ok_or("stream closed before the hello")?;
            let hello: &ArchivedHello =
                frame.access_as::<Hello>(FrameKind::Hello).map_err(|e| e.to_string())?;
            let cert = peer_certificate(&conn).ok_or("the peer presented no certificate")?;
            let verdict = check_hello(hello.node.as_str(), hello.protocol.to_native(), &cert.names)
                .and_then(|()| self.admit(hello.node.as_str(), &cert, hello.member));
            let ack = HelloAck {
                node: self.inner.id.0.clone(),
                protocol: u32::from(PROTOCOL_VERSION),
                accepted: verdict.is_ok(),
                reason: verdict.as_ref().err().cloned().unwrap_or_default(),
                incarnation: self.inner.incarnation,
            };
            let ack = Frame::encode(FrameKind::HelloAck, &ack).map_err(|e| e.to_string())?;
            write_frame(&mut send, &ack).await.map_err(|e| e.to_string())?;
            let _ = send.finish();
            verdict?;
            Ok((NodeId::new(hello.node.as_str()), hello.member, cert, hello.incarnation.to_native()))
        })
        .await
        .unwrap_or_else(|_| Err(format!("no hello within {deadline:?}")));
        match result {
            Ok((peer, member, cert, incarnation)) => {
                self.register(peer, conn, false, member, cert, incarnation).await
            }
            Err(reason) => {
                let reason = connection_reason(&conn, reason);
                warn!(node = %self.inner.id, %addr, %reason, "refused peer");
                // let the ack reach the peer before closing
                let _ = tokio::time::timeout(Duration::from_secs(1), conn.closed()).await;
                conn.close(VarInt::from_u32(CODE_REFUSED), reason.as_bytes());
                self.emit(PeerEvent::Refused { addr, reason });
            }
        }
    }

    async fn register(
        &self,
        peer: NodeId,
        conn: Connection,
        outbound: bool,
        member: bool,
        cert: CertInfo,
        incarnation: u64,
    ) {
        let generation = self.inner.generation.fetch_add(1, Ordering::Relaxed);
        let senders = Channel::ALL.iter().map(|c| (*c, Arc::new(Mutex::new(None)))).collect();
        let budget = ConnBudget::new(peer.as_str(), self.inner.config.conn_budget);
        let state = Arc::new(ConnState {
            budget,
            control_opened: AtomicBool::new(false),
            heard: AtomicBool::new(false),
            local_streams: AtomicUsize::new(0),
            local_pulls: AtomicUsize::new(0),
        });
        let local = Arc::new(tokio::sync::SetOnce::new());
        let entry = Arc::new(Peer {
            conn: conn.clone(),
            local: local.clone(),
            state: state.clone(),
            generation,
            incarnation,
            member,
            cert,
            senders,
        });
        if let Some(old) = self.inner.peers.insert(peer.clone(), entry.clone()) {
            old.conn.close(VarInt::from_u32(CODE_REPLACED), b"replaced by a newer connection");
            // the old connection's end emits no `Left` (the name is taken again): say that the
            // process behind it is gone when the new one is another incarnation
            if old.incarnation != incarnation {
                debug!(node = %self.inner.id, %peer, "peer restarted (new incarnation)");
                self.emit_wait(PeerEvent::Restarted { peer: peer.clone() }).await;
            }
        }
        // checked again now that it is listed: rules replaced since the hello apply to it too
        if let Err(reason) = self.admit(peer.as_str(), &entry.cert, member) {
            self.inner.peers.remove_if(&peer, |_, p| p.generation == generation);
            warn!(node = %self.inner.id, %peer, %reason, "refused peer (rules changed during its hello)");
            conn.close(VarInt::from_u32(CODE_REFUSED), reason.as_bytes());
            return;
        }
        let addr = conn.remote_address();
        debug!(node = %self.inner.id, %peer, %addr, outbound, "peer joined");
        self.emit_wait(PeerEvent::Joined { peer: peer.clone(), addr, outbound, member }).await;
        if self.inner.shm.offers() {
            let (node, peer, conn) = (self.clone(), peer.clone(), conn.clone());
            tokio::spawn(async move {
                let target = match node.inner.shm.offer(&conn, &peer, generation, TAG_SHM).await {
                    Ok(target) => {
                        debug!(node = %node.inner.id, %peer, streams = target.is_some(), "same-host path open");
                        target
                    }
                    Err(e) => {
                        debug!(node = %node.inner.id, %peer, error = %e, "same-host path not used");
                        None
                    }
                };
                let _ = local.set(target);
            });
        } else {
            let _ = local.set(None);
        }
        let node = self.clone();
        tokio::spawn(async move { node.serve_connection(peer, conn, state, generation).await });
    }

    async fn serve_connection(self, peer: NodeId, conn: Connection, state: Arc<ConnState>, generation: u64) {
        let uni = {
            let (node, peer, conn, state) = (self.clone(), peer.clone(), conn.clone(), state.clone());
            async move {
                while let Ok(recv) = conn.accept_uni().await {
                    let (node, peer, conn, state) = (node.clone(), peer.clone(), conn.clone(), state.clone());
                    tokio::spawn(async move { node.serve_uni(peer, conn, state, recv).await });
                }
            }
        };
        let bi = {
            let (node, peer, conn, state) = (self.clone(), peer.clone(), conn.clone(), state.clone());
            async move {
                while let Ok((send, recv)) = conn.accept_bi().await {
                    let (node, peer, state) = (node.clone(), peer.clone(), state.clone());
                    tokio::spawn(async move { node.serve_bi(peer, state, send, recv).await });
                }
            }
        };
        tokio::join!(uni, bi);
        self.inner.shm.connection_closed(&peer, generation);
        let close = conn.close_reason();
        let goodbye = matches!(&close, Some(quinn::ConnectionError::ApplicationClosed(c))
            if c.error_code == VarInt::from_u32(CODE_GOODBYE));
        let reason = close.map(|r| r.to_string()).unwrap_or_else(|| "closed".into());
        let removed = self.inner.peers.remove_if(&peer, |_, p| p.generation == generation).is_some();
        if removed {
            debug!(node = %self.inner.id, %peer, %reason, "peer left");
            self.emit_wait(PeerEvent::Left { peer, reason, goodbye }).await;
        }
    }

    async fn serve_uni(self, peer: NodeId, conn: Connection, state: Arc<ConnState>, mut recv: RecvStream) {
        let mut tag = [0u8; 1];
        if recv.read_exact(&mut tag).await.is_err() {
            return;
        }
        let Some(channel) = Channel::from_u8(tag[0]) else {
            warn!(node = %self.inner.id, %peer, tag = tag[0], "stream with unknown channel tag; stopping it");
            let _ = recv.stop(VarInt::from_u32(CODE_BAD_FRAME));
            self.emit(PeerEvent::BadStream { peer, detail: format!("unknown channel tag {:#04x}", tag[0]) });
            return;
        };
        if let StreamEnd::BadFrame = self.serve_frames(&peer, &conn, &state, channel, &mut recv, None).await {
            let _ = recv.stop(VarInt::from_u32(CODE_BAD_FRAME));
        }
    }

    /// Reads `peer`'s frames of `channel` from one of its streams (QUIC or local) and delivers
    /// them, each charged to the connection's budget, until the stream ends or fails.
    async fn serve_frames<R>(
        &self,
        peer: &NodeId,
        conn: &Connection,
        state: &ConnState,
        channel: Channel,
        recv: &mut R,
        counted: Option<&AtomicU64>,
    ) -> StreamEnd
    where
        R: tokio::io::AsyncRead + Unpin,
    {
        let Some(tx) = self.inner.inbox_tx.get(&channel) else {
            return StreamEnd::Done;
        };
        loop {
            match read_frame_budgeted_reusing(recv, &self.inner.config.limits, &state.budget).await {
                Ok(Some((frame, held))) => {
                    let (frame, held) = if crate::shm::is_shm(&frame) {
                        // the segment's bytes count against the peer's budget before they are read
                        // (a length past the frame cap is refused by name below, not charged)
                        let declared = crate::shm::declared_len(&frame).unwrap_or(0);
                        let chargeable = if declared > u64::from(self.inner.config.limits.max_body) {
                            0
                        } else {
                            declared
                        };
                        let mut charge = state.budget.frame();
                        if let Err(over) = charge.grow_to(chargeable) {
                            self.close_over_budget(conn, peer.clone(), over);
                            return StreamEnd::Done;
                        }
                        // the mapped body keeps the charge too, for as long as it is held
                        let held = charge.into_held();
                        match self
                            .inner
                            .shm
                            .incoming(peer, frame, &self.inner.config.limits, held.clone())
                            .await
                        {
                            Ok(f) => (f, held),
                            Err(e) => {
                                warn!(node = %self.inner.id, %peer, ?channel, error = %e, "refused a same-host segment");
                                self.emit(PeerEvent::BadStream { peer: peer.clone(), detail: e.to_string() });
                                continue;
                            }
                        }
                    } else {
                        (frame, held)
                    };
                    state.heard.store(true, Ordering::Release);
                    // counted before delivery, so whoever receives the frame sees it counted
                    if let Some(c) = counted {
                        c.fetch_add(1, Ordering::Relaxed);
                    }
                    let body = frame.body.len();
                    let delivery = Delivery { from: peer.clone(), channel, frame, held };
                    let sink = match delivery.frame.kind {
                        FrameKind::Service => self.inner.service_sink.read().ok().and_then(|g| g.clone()),
                        _ => None,
                    };
                    match sink {
                        Some(sink) => sink(delivery),
                        None => {
                            if tx.send(delivery).await.is_err() {
                                return StreamEnd::Done;
                            }
                        }
                    }
                    self.inner.traffic.received(channel, body);
                }
                Err(FrameError::OverBudget(over)) => {
                    self.close_over_budget(conn, peer.clone(), over);
                    return StreamEnd::Done;
                }
                Ok(None) => return StreamEnd::Done,
                Err(FrameError::Io(e)) => {
                    debug!(node = %self.inner.id, %peer, ?channel, error = %e, "stream ended");
                    return StreamEnd::Done;
                }
                Err(e) => {
                    warn!(node = %self.inner.id, %peer, ?channel, error = %e, "bad frame; stopping the stream");
                    self.emit(PeerEvent::BadStream { peer: peer.clone(), detail: e.to_string() });
                    return StreamEnd::BadFrame;
                }
            }
        }
    }

    async fn serve_bi(self, peer: NodeId, state: Arc<ConnState>, mut send: SendStream, mut recv: RecvStream) {
        let mut tag = [0u8; 1];
        if recv.read_exact(&mut tag).await.is_err() {
            return;
        }
        match tag[0] {
            TAG_CONTROL if !self.admit_control(&peer, &state) => {
                let _ = recv.stop(VarInt::from_u32(CODE_BAD_FRAME));
            }
            TAG_CONTROL => {
                self.emit_wait(PeerEvent::ControlStream { peer, stream: ControlStream::Quic { send, recv } })
                    .await
            }
            TAG_SHM => self.inner.shm.answer(&peer, send, recv).await,
            TAG_BLOB => {
                let request = read_frame(&mut recv, &FrameLimits { max_body: 256 }).await;
                let bad = request.is_err();
                let Some((reply, charge)) = self.blob_reply(&peer, &state, request) else {
                    if bad {
                        let _ = recv.stop(VarInt::from_u32(CODE_BAD_FRAME));
                    }
                    return;
                };
                if write_frame(&mut send, &reply).await.is_ok() {
                    let _ = send.finish();
                    let _ = send.stopped().await;
                }
                drop(charge);
            }
            other => {
                warn!(node = %self.inner.id, %peer, tag = other, "bidirectional stream with unknown tag; stopping it");
                let _ = recv.stop(VarInt::from_u32(CODE_BAD_FRAME));
            }
        }
    }

    /// The answer to one blob pull `request` from `peer`, with the charge that holds its bytes
    /// against the peer's connection until it is sent; `None` when there is nothing to answer
    /// (the stream ended, or the request was not a frame: logged here).
    fn blob_reply(
        &self,
        peer: &NodeId,
        state: &ConnState,
        request: Result<Option<Frame>, FrameError>,
    ) -> Option<(Frame, crate::budget::FrameCharge)> {
        // the reply this peer makes us build counts against its connection until sent
        let mut charge = state.budget.frame();
        let error = |text: String| Frame::from_bytes(FrameKind::Error, 0, text.as_bytes());
        let reply = match request {
            Ok(Some(f)) => match blob::parse_request(&f) {
                Ok(id) => {
                    let server = self.inner.blobs.read().map(|g| g.clone()).ok();
                    match server.and_then(|s| s.blob(&id.0)) {
                        Some(bytes) => match charge.grow_to(bytes.len() as u64 + blob::BLOB_DATA_OVERHEAD) {
                            Ok(()) => blob::data_frame(id, &bytes).unwrap_or_else(|e| error(e.to_string())),
                            Err(e) => error(format!("blob {id} not served now: {e}")),
                        },
                        None => error(format!("no blob {id}")),
                    }
                }
                Err(e) => error(format!("malformed blob request: {e}")),
            },
            Ok(None) => return None,
            Err(e) => {
                warn!(node = %self.inner.id, %peer, error = %e, "bad blob request; stopping the stream");
                return None;
            }
        };
        Some((reply, charge))
    }

    /// Writes `frame` on the channel's stream: a local stream to a same-host peer, else QUIC
    /// (the body is handed to quinn without a copy).
    async fn send_frame(&self, to: &NodeId, channel: Channel, frame: Frame) -> Result<(), LinkError> {
        let header = frame.header()?.to_bytes();
        let peer =
            self.inner.peers.get(to).map(|p| p.clone()).ok_or_else(|| LinkError::UnknownPeer(to.clone()))?;
        let slot = peer.senders.get(&channel).cloned().ok_or(LinkError::Closed)?;
        let mut guard = slot.lock().await;
        let down = |e: String| LinkError::PeerDown(to.clone(), e);
        if guard.is_none() {
            *guard = Some(self.open_sender(&peer, to, channel).await.map_err(down)?);
        }
        let written = match guard.as_mut() {
            None => return Err(LinkError::Closed),
            Some(ChannelSender::Quic(stream)) => {
                let mut chunks =
                    [bytes::Bytes::copy_from_slice(&header), bytes::Bytes::from_owner(frame.body)];
                stream.write_all_chunks(&mut chunks).await.map_err(|e| e.to_string())
            }
            Some(ChannelSender::Local(stream)) => write_local(stream, &header, &frame).await,
        };
        if let Err(e) = written {
            *guard = None;
            return Err(down(e));
        }
        Ok(())
    }

    /// Opens the stream a channel's frames to `peer` take: a local stream when the same-host
    /// handshake gave one (waiting for it to decide, at most [`LOCAL_DECISION_WAIT`]), else a
    /// QUIC stream.
    async fn open_sender(&self, peer: &Peer, to: &NodeId, channel: Channel) -> Result<ChannelSender, String> {
        let target =
            tokio::time::timeout(LOCAL_DECISION_WAIT, peer.local.wait()).await.ok().cloned().flatten();
        if let Some(target) = target {
            match local::dial(&target.name, &target.token, local::Purpose::Channel(channel)).await {
                Ok(stream) => {
                    self.inner.local.opened.fetch_add(1, Ordering::Relaxed);
                    debug!(node = %self.inner.id, peer = %to, ?channel, "local stream open");
                    return Ok(ChannelSender::Local(stream));
                }
                // e.g. a peer in another network namespace of this host: its abstract name is
                // out of reach, QUIC is not
                Err(e) => debug!(node = %self.inner.id, peer = %to, ?channel, error = %e,
                    "local stream not opened; the channel uses QUIC"),
            }
        }
        let mut s = peer.conn.open_uni().await.map_err(|e| e.to_string())?;
        // control traffic (heartbeats) goes first when streams compete
        let _ = s.set_priority(if channel == Channel::Control { 10 } else { 0 });
        s.write_all(&[channel as u8]).await.map_err(|e| e.to_string())?;
        Ok(ChannelSender::Quic(s))
    }

    /// Whether `peer` may open a control-plane stream now, on either road: only a member's
    /// connection (a tool such as `troupe status` never joins ractor_cluster's cluster), and only
    /// once per connection (each session buffers control-plane frames of its own). A refusal is
    /// logged and reported as [`PeerEvent::BadStream`], naming why.
    fn admit_control(&self, peer: &NodeId, state: &ConnState) -> bool {
        let member = self.inner.peers.get(peer).is_some_and(|p| p.member);
        let refusal = if !member {
            "control stream from a connection that is not a member"
        } else if state.control_opened.swap(true, Ordering::AcqRel) {
            "second control stream on one connection"
        } else {
            return true;
        };
        warn!(node = %self.inner.id, %peer, reason = refusal, "refused a control stream");
        self.emit(PeerEvent::BadStream { peer: peer.clone(), detail: refusal.into() });
        false
    }

    /// Hands a local control stream `peer` opened to the runtime, tied to the peer's connection
    /// (one control stream per connection, whichever road).
    async fn serve_local_control(&self, peer: NodeId, stream: tokio::net::UnixStream) {
        let Some((conn, state)) = self.inner.peers.get(&peer).map(|p| (p.conn.clone(), p.state.clone()))
        else {
            self.inner.local.refused.fetch_add(1, Ordering::Relaxed);
            return;
        };
        if !self.admit_control(&peer, &state) {
            self.inner.local.refused.fetch_add(1, Ordering::Relaxed);
            return;
        }
        match TiedStream::new(stream, conn) {
            Ok(tied) => {
                self.inner.local.control.fetch_add(1, Ordering::Relaxed);
                self.emit_wait(PeerEvent::ControlStream { peer, stream: ControlStream::Local(tied) }).await;
            }
            Err(e) => {
                warn!(node = %self.inner.id, %peer, error = %e, "could not keep a local control stream")
            }
        }
    }

    /// Serves a local channel or blob-pull stream `peer` opened (its hello passed), until it ends
    /// or the peer's connection does.
    fn serve_local(&self, peer: NodeId, purpose: LocalServed, mut stream: tokio::net::UnixStream) {
        let Some(entry) = self.inner.peers.get(&peer).map(|p| p.clone()) else {
            self.inner.local.refused.fetch_add(1, Ordering::Relaxed);
            return;
        };
        // channel streams and pulls have their own caps, as QUIC's uni and bidi streams do
        let (open, cap) = match purpose {
            LocalServed::Channel(_) => (&entry.state.local_streams, self.inner.config.max_uni_streams),
            LocalServed::BlobPull => (&entry.state.local_pulls, MAX_BIDI_STREAMS),
        };
        let cap = cap as usize;
        if open.fetch_add(1, Ordering::AcqRel) >= cap {
            open.fetch_sub(1, Ordering::AcqRel);
            self.inner.local.refused.fetch_add(1, Ordering::Relaxed);
            warn!(node = %self.inner.id, %peer, cap, "local stream over the peer's stream cap; dropped");
            self.emit(PeerEvent::BadStream { peer, detail: format!("more than {cap} local streams open") });
            return;
        }
        self.inner.local.accepted.fetch_add(1, Ordering::Relaxed);
        let (conn, state) = (entry.conn.clone(), entry.state.clone());
        let node = self.clone();
        let reader = tokio::spawn({
            let (conn, state) = (conn.clone(), state.clone());
            async move {
                match purpose {
                    LocalServed::Channel(channel) => {
                        let counted = Some(&node.inner.local.frames_received);
                        // small frames that arrive together are read with one syscall, not two
                        // each (a large body bypasses the buffer: it is read straight into place)
                        let mut stream = tokio::io::BufReader::with_capacity(LOCAL_READ_BUFFER, stream);
                        node.serve_frames(&peer, &conn, &state, channel, &mut stream, counted).await;
                    }
                    LocalServed::BlobPull => {
                        let limits = FrameLimits { max_body: 256 };
                        let request = read_frame(&mut stream, &limits).await;
                        let Some((reply, charge)) = node.blob_reply(&peer, &state, request) else { return };
                        if write_frame(&mut stream, &reply).await.is_ok() {
                            let _ = tokio::io::AsyncWriteExt::shutdown(&mut stream).await;
                        }
                        drop(charge);
                    }
                }
            }
        });
        // the stream lives no longer than the connection that vouched for it
        let abort = reader.abort_handle();
        tokio::spawn(async move {
            tokio::select! {
                _ = conn.closed() => abort.abort(),
                _ = reader => {}
            }
            let open = match purpose {
                LocalServed::Channel(_) => &state.local_streams,
                LocalServed::BlobPull => &state.local_pulls,
            };
            open.fetch_sub(1, Ordering::AcqRel);
        });
    }

    /// Opens a fresh stream tagged as `channel_tag` and hands it over unfinished (for tests of
    /// the receive path that write frames piece by piece, as an adversarial peer would).
    pub async fn open_raw(&self, to: &NodeId, channel_tag: u8) -> Result<SendStream, QuicError> {
        let conn = self.connection(to)?;
        let mut s = conn.open_uni().await.map_err(|e| QuicError::Stream(e.to_string()))?;
        s.write_all(&[channel_tag]).await.map_err(|e| QuicError::Stream(e.to_string()))?;
        Ok(s)
    }

    /// Opens a bidirectional stream with tag byte `tag` (the hello, control or blob tags) and
    /// hands both halves over (for tests that play a peer's side of a protocol by hand).
    pub async fn open_raw_bi(&self, to: &NodeId, tag: u8) -> Result<(SendStream, RecvStream), QuicError> {
        let conn = self.connection(to)?;
        let (mut send, recv) = conn.open_bi().await.map_err(|e| QuicError::Stream(e.to_string()))?;
        send.write_all(&[tag]).await.map_err(|e| QuicError::Stream(e.to_string()))?;
        Ok((send, recv))
    }

    /// Sends raw bytes on a fresh stream tagged as `channel` (for tests of the receive path).
    pub async fn send_raw(&self, to: &NodeId, channel_tag: u8, bytes: &[u8]) -> Result<(), QuicError> {
        let conn = self.connection(to)?;
        let mut s = conn.open_uni().await.map_err(|e| QuicError::Stream(e.to_string()))?;
        s.write_all(&[channel_tag]).await.map_err(|e| QuicError::Stream(e.to_string()))?;
        s.write_all(bytes).await.map_err(|e| QuicError::Stream(e.to_string()))?;
        let _ = s.finish();
        // `stopped` resolves when the peer stops the stream or has read everything
        let _ = s.stopped().await;
        Ok(())
    }
}

/// Writes one frame (its `header` already encoded) on a local stream: a small frame in one call,
/// a larger one as [`write_frame`] does, header then body.
async fn write_local(
    stream: &mut tokio::net::UnixStream,
    header: &[u8],
    frame: &Frame,
) -> Result<(), String> {
    if frame.body.len() > LOCAL_ONE_WRITE {
        return write_frame(stream, frame).await.map_err(|e| format!("local stream: {e}"));
    }
    let mut buf = Vec::with_capacity(header.len() + frame.body.len());
    buf.extend_from_slice(header);
    buf.extend_from_slice(&frame.body);
    tokio::io::AsyncWriteExt::write_all(stream, &buf).await.map_err(|e| format!("local stream: {e}"))
}

/// Accepts the local streams peers open to this node ([`crate::local`]): each must come from our
/// uid and carry, within the hello timeout, a token this node issued to a connected peer. Ends
/// when the node shuts down or is dropped.
async fn local_accept_loop(
    inner: std::sync::Weak<Inner>,
    listener: tokio::net::UnixListener,
    mut stopped: tokio::sync::watch::Receiver<bool>,
) {
    let Some(limit) = inner.upgrade().map(|i| i.config.max_pending_hellos.max(1)) else { return };
    let pending = Arc::new(tokio::sync::Semaphore::new(limit));
    loop {
        let accepted = tokio::select! {
            _ = stopped.changed() => return,
            a = listener.accept() => a,
        };
        let Some(node) = inner.upgrade().map(|inner| QuicNode { inner }) else { return };
        let mut stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                // out of descriptors or memory: say so and give the node a moment before trying again
                warn!(node = %node.inner.id, error = %e, "accepting a local stream failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = pending.clone().try_acquire_owned() else {
            node.inner.local.refused.fetch_add(1, Ordering::Relaxed);
            warn!(node = %node.inner.id, limit, "too many local streams waiting for their hello; dropped one");
            continue;
        };
        tokio::spawn(async move {
            let wait = node.inner.config.hello_timeout;
            let owner = |t: &[u8; 32]| node.inner.shm.token_owner(t);
            let hello = tokio::time::timeout(wait, local::read_hello(&mut stream, owner)).await;
            drop(permit);
            match hello {
                Ok(Ok((peer, local::Purpose::Control))) => node.serve_local_control(peer, stream).await,
                Ok(Ok((peer, local::Purpose::Channel(channel)))) => {
                    node.serve_local(peer, LocalServed::Channel(channel), stream)
                }
                Ok(Ok((peer, local::Purpose::BlobPull))) => {
                    node.serve_local(peer, LocalServed::BlobPull, stream)
                }
                Ok(Err(e)) => {
                    node.inner.local.refused.fetch_add(1, Ordering::Relaxed);
                    warn!(node = %node.inner.id, error = %e, "refused a local stream");
                }
                Err(_) => {
                    node.inner.local.refused.fetch_add(1, Ordering::Relaxed);
                    warn!(node = %node.inner.id, "refused a local stream: no hello within {wait:?}");
                }
            }
        });
    }
}

/// The connection's close reason if it closed, else `fallback`.
fn connection_reason(conn: &Connection, fallback: impl std::fmt::Display) -> String {
    match conn.close_reason() {
        Some(r) => r.to_string(),
        None => fallback.to_string(),
    }
}

impl Link for QuicNode {
    fn local_id(&self) -> &NodeId {
        &self.inner.id
    }

    async fn send(&self, to: &NodeId, channel: Channel, frame: Frame) -> Result<(), LinkError> {
        let body = frame.body.len();
        let (frame, original) = self
            .inner
            .shm
            .outgoing(to, channel, frame)
            .await
            .map_err(|e| LinkError::PeerDown(to.clone(), e.to_string()))?;
        self.send_frame(to, channel, frame).await?;
        // a body now in a segment is freed only once its reference is on its way
        drop(original);
        self.inner.traffic.sent(channel, body);
        Ok(())
    }

    async fn recv(&self) -> Result<Delivery, LinkError> {
        let mut guard = self.inner.inbox_rx.lock().await;
        let inbox = &mut *guard;
        tokio::select! {
            biased;
            Some(x) = inbox.control.recv() => Ok(x),
            Some(x) = inbox.data.recv() => Ok(x),
            Some(x) = inbox.blob.recv() => Ok(x),
            else => Err(LinkError::Closed),
        }
    }
}

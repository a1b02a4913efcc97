//! The second process of `troupe bench transport` (`troupe bench-peer`, hidden): a node runtime
//! with the actors the benchmark calls, a frame sink that acknowledges every tensor with its
//! length (and answers a data-channel message with the blake3 hash of its body, for tests), a
//! TCP frame sink for the baseline and a UDP echo. It prints one `READY` line and runs until SIGINT or
//! SIGTERM, as `troupe node` does. The benchmark starts it through the node launcher `troupe up`
//! uses ([`PeerProcess`], [`troupe::up::Cluster`]), which kills it if the benchmark drops it.
//!
//! The bench's typed actor kind, [`BenchEcho`], is defined here: the peer runs one named [`ECHO`].
//! It also serves [`VIA_ACTOR`], the hello expert's question through a plain ractor actor's
//! mailbox (an [`Answerer`]), the baseline for what the typed layer adds over any actor call.
//! Started with `--host NAME`, the process is instead a placement host of that
//! name (no other actors, no sinks): it lets schedulers place one [`BenchEcho`] on it, for the
//! cross-node restart figure.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use ractor_cluster::RactorClusterMessage;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use troupe_actors::hello::{ASK, HelloExpert, HelloExpertMsg, MAX_QUESTION, answer};
use troupe_actors::service::{Allow, Handler, ServiceSpec, to_body, with_archived};
use troupe_actors::supervisor::ChildSpec;
use troupe_actors::typed::{
    ActorContext, ActorFailure, Handles, PlacementRules, Protocol, RemoteMessage, TypedActor,
};
use troupe_actors::{Children, Intensity, MembershipConfig, NodeRuntime, NodeSpec};
use troupe_transport::frame::{read_frame_reusing, write_frame};
use troupe_transport::{Channel, Frame, FrameKind, FrameLimits, Link, NodeIdentity, QuicConfig, Role};

/// Name of the peer node (its certificate is issued by the benchmark).
pub const PEER_NAME: &str = "bench-peer";
/// Process group of the [`Sink`].
pub const SINK_GROUP: &str = "bench-sink";
/// Process group of the [`Crashy`] actor (it joins on every start).
pub const CRASHY_GROUP: &str = "bench-crashy";
/// Name of the [`BenchEcho`] the peer runs.
pub const ECHO: &str = "bench-echo";
/// The service (method [`ASK`], schedulers only) whose handler
/// forwards the hello expert's question to the peer's [`Answerer`] and answers with its reply.
pub const VIA_ACTOR: &str = "bench-via-actor";

/// A question to a [`BenchEcho`]; it answers as the hello expert does on the service path
/// ([`answer`]), so a typed call and a service ask do the same work.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Ask(pub String);
impl RemoteMessage for Ask {
    const NAME: &'static str = "ask";
    type Reply = String;
}

/// Adds to a [`BenchEcho`]'s count (sent as a tell).
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Tell(pub u64);
impl RemoteMessage for Tell {
    const NAME: &'static str = "tell";
    type Reply = ();
}

/// What a [`BenchEcho`] has been told so far.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Count;
impl RemoteMessage for Count {
    const NAME: &'static str = "count";
    type Reply = u64;
}

/// The bench's typed actor kind: answers [`Ask`] and counts [`Tell`]s ([`Count`]). Schedulers
/// may send it everything (the hello expert's service method admits schedulers too).
pub struct BenchEcho {
    node: String,
    told: u64,
}

impl TypedActor for BenchEcho {
    const KIND: &'static str = "bench-echo";
    type Args = ();
    fn protocol(p: &mut Protocol<Self>) {
        let scheduler = Allow::role(Role::Scheduler);
        p.request::<Ask>(scheduler).request::<Tell>(scheduler).request::<Count>(scheduler);
    }
    async fn start((): (), ctx: &ActorContext) -> Result<Self, ActorFailure> {
        Ok(Self { node: ctx.actors.node().as_str().to_string(), told: 0 })
    }
}

impl Handles<Ask> for BenchEcho {
    async fn handle(&mut self, Ask(q): Ask, _: &ActorContext) -> Result<String, ActorFailure> {
        if q.len() > MAX_QUESTION {
            return Err(ActorFailure::msg(format!("a question of {} bytes exceeds {MAX_QUESTION}", q.len())));
        }
        Ok(answer(&self.node, &q))
    }
}

impl Handles<Tell> for BenchEcho {
    async fn handle(&mut self, Tell(n): Tell, _: &ActorContext) -> Result<(), ActorFailure> {
        self.told += n;
        Ok(())
    }
}

impl Handles<Count> for BenchEcho {
    async fn handle(&mut self, _: Count, _: &ActorContext) -> Result<u64, ActorFailure> {
        Ok(self.told)
    }
}

/// A plain ractor actor that answers the hello expert's [`HelloExpertMsg::Ask`] as the expert
/// does ([`answer`]), without joining its process group: the actor behind [`VIA_ACTOR`].
pub struct Answerer;

impl Actor for Answerer {
    type Msg = HelloExpertMsg;
    type State = String;
    type Arguments = String;

    async fn pre_start(&self, _: ActorRef<Self::Msg>, node: String) -> Result<String, ActorProcessingErr> {
        Ok(node)
    }

    async fn handle(
        &self,
        _: ActorRef<Self::Msg>,
        msg: Self::Msg,
        node: &mut String,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            HelloExpertMsg::Ask(q, reply) => {
                let _ = reply.send(answer(node, &q));
            }
        }
        Ok(())
    }
}

/// The [`VIA_ACTOR`] handler: reads the question as the expert's handler does, asks `answerer`
/// (a `ractor::call!` through its mailbox) and answers with its reply.
fn via_actor(answerer: ActorRef<HelloExpertMsg>) -> Handler {
    Arc::new(move |_caller, _method, body| {
        let answerer = answerer.clone();
        Box::pin(async move {
            let question = with_archived::<String, _>(&body, |q| {
                if q.len() > MAX_QUESTION {
                    return Err(format!("a question of {} bytes exceeds {MAX_QUESTION}", q.len()));
                }
                Ok(q.as_str().to_owned())
            })?;
            let reply = ractor::call!(answerer, HelloExpertMsg::Ask, question).map_err(|e| e.to_string())?;
            to_body(&reply)
        })
    })
}

/// Messages of the tell sink.
#[derive(RactorClusterMessage)]
pub enum SinkMsg {
    /// Adds to the total (a cast).
    Add(u64),
    /// The total so far.
    #[rpc]
    Total(u64, RpcReplyPort<u64>),
}

/// Counts what it is told.
pub struct Sink;

impl Actor for Sink {
    type Msg = SinkMsg;
    type State = u64;
    type Arguments = ();

    async fn pre_start(&self, me: ActorRef<Self::Msg>, _: ()) -> Result<u64, ActorProcessingErr> {
        ractor::pg::join(SINK_GROUP.to_string(), vec![me.get_cell()]);
        Ok(0)
    }

    async fn handle(
        &self,
        _: ActorRef<Self::Msg>,
        msg: Self::Msg,
        n: &mut u64,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SinkMsg::Add(k) => *n += k,
            SinkMsg::Total(_, reply) => {
                let _ = reply.send(*n);
            }
        }
        Ok(())
    }
}

/// Messages of the crashing actor.
#[derive(RactorClusterMessage)]
pub enum CrashyMsg {
    /// Panics (the supervisor restarts it).
    Crash(u64),
    /// Echoes its argument.
    #[rpc]
    Ping(u64, RpcReplyPort<u64>),
}

/// An actor that panics on request, under the node's root [`Supervisor`](troupe_actors::supervisor::Supervisor).
pub struct Crashy;

impl Actor for Crashy {
    type Msg = CrashyMsg;
    type State = ();
    type Arguments = ();

    async fn pre_start(&self, me: ActorRef<Self::Msg>, _: ()) -> Result<(), ActorProcessingErr> {
        ractor::pg::join(CRASHY_GROUP.to_string(), vec![me.get_cell()]);
        Ok(())
    }

    async fn handle(
        &self,
        _: ActorRef<Self::Msg>,
        msg: Self::Msg,
        _: &mut (),
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            CrashyMsg::Crash(n) => panic!("bench: crash {n} on request"),
            CrashyMsg::Ping(x, reply) => {
                let _ = reply.send(x);
            }
        }
        Ok(())
    }
}

/// The spec of the peer's node and of every placement host: the bench's membership config
/// ([`MembershipConfig::default`]) and cookie.
fn spec(
    identity: NodeIdentity,
    children: Children,
    intensity: Intensity,
    placement: PlacementRules,
) -> NodeSpec {
    NodeSpec {
        identity,
        quic: QuicConfig::default(),
        peers: Vec::new(),
        membership: MembershipConfig::default(),
        intensity,
        cookie: "bench".into(),
        children,
        redial: Duration::from_millis(200),
        placement,
    }
}

/// Waits for SIGINT or SIGTERM (the launcher stopping this process).
async fn until_stopped() -> Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut int = signal(SignalKind::interrupt()).context("listening for SIGINT")?;
    let mut term = signal(SignalKind::terminate()).context("listening for SIGTERM")?;
    tokio::select! {
        _ = int.recv() => {}
        _ = term.recv() => {}
    }
    Ok(())
}

/// A placement host named `name`: schedulers may place one [`BenchEcho`] on it. Prints `READY`
/// and its QUIC address.
async fn host(keys: &Path, name: &str) -> Result<()> {
    let identity = NodeIdentity::load(keys, name).with_context(|| format!("loading {name}"))?;
    let rules = PlacementRules::default().capacity(1).allow(BenchEcho::KIND, Allow::role(Role::Scheduler));
    let children = troupe_actors::fixed_children(Vec::new());
    let node = NodeRuntime::start(spec(identity, children, Intensity::default(), rules)).await?;
    node.actors.register_kind::<BenchEcho>();
    println!("READY {}", node.link.local_addr()?);
    let stopped = until_stopped().await;
    node.shutdown().await;
    stopped
}

/// Runs the peer (or, given `host`, a placement host of that name) until SIGINT or SIGTERM.
pub async fn run(keys: &Path, host_name: Option<&str>) -> Result<()> {
    if let Some(name) = host_name {
        return host(keys, name).await;
    }
    // one line per panic instead of a captured backtrace: the crash is the benchmark's, on purpose
    std::panic::set_hook(Box::new(|info| eprintln!("bench-peer: {info}")));
    let identity = NodeIdentity::load(keys, PEER_NAME).with_context(|| format!("loading {PEER_NAME}"))?;
    // the expert answers both as a ractor_cluster actor and on the role-checked service path
    let children: Children = Box::new(|_, services, _, _| {
        let args =
            troupe_actors::hello::HelloArgs { node: PEER_NAME.to_string(), services: Some(services.clone()) };
        Ok(vec![
            ChildSpec::new("bench-expert", move || (HelloExpert, args.clone())),
            ChildSpec::new("bench-sink", || (Sink, ())),
            ChildSpec::new("bench-crashy", || (Crashy, ())),
        ])
    });
    // the benchmark crashes one child many times in a row
    let intensity = Intensity { max_restarts: 10_000, period: Duration::from_secs(1) };
    let node = NodeRuntime::start(spec(identity, children, intensity, PlacementRules::default())).await?;
    node.actors.spawn::<BenchEcho>(ECHO, ()).await?;
    let (answerer, answerer_done) = Actor::spawn(None, Answerer, PEER_NAME.to_string()).await?;
    let spec = ServiceSpec::new().method(ASK, Allow::role(Role::Scheduler));
    node.services.register(VIA_ACTOR, spec, via_actor(answerer.clone()));
    let link = node.link.clone();
    node.set_frame_handler(Arc::new(move |d| {
        if d.channel == Channel::Data && d.frame.kind == FrameKind::Message {
            // integrity probe (tests): answer with the blake3 hash of the body
            let link = link.clone();
            tokio::spawn(async move {
                let body = d.frame.body;
                if let Ok(hash) = tokio::task::spawn_blocking(move || blake3::hash(&body)).await {
                    let reply = Frame::from_bytes(FrameKind::Message, 0, hash.as_bytes());
                    let _ = link.send(&d.from, Channel::Data, reply).await;
                }
            });
            return;
        }
        if d.channel != Channel::Data || d.frame.kind != FrameKind::Tensor {
            return;
        }
        let ack = Frame::from_bytes(FrameKind::Message, 0, &(d.frame.body.len() as u64).to_le_bytes());
        drop(d.frame);
        let link = link.clone();
        tokio::spawn(async move {
            let _ = link.send(&d.from, Channel::Data, ack).await;
        });
    }));
    let tcp = TcpListener::bind("127.0.0.1:0").await?;
    let tcp_addr = tcp.local_addr()?;
    tokio::spawn(tcp_sink(tcp));
    let udp_addr = udp_echo()?;
    println!("READY {} {tcp_addr} {udp_addr}", node.link.local_addr()?);
    let stopped = until_stopped().await;
    node.services.unregister(VIA_ACTOR);
    answerer.stop(None);
    let _ = answerer_done.await;
    node.shutdown().await;
    stopped
}

/// Acknowledges every frame on every accepted connection with its body length.
async fn tcp_sink(listener: TcpListener) {
    while let Ok((s, _)) = listener.accept().await {
        tokio::spawn(async move {
            let _ = s.set_nodelay(true);
            let (mut r, mut w) = s.into_split();
            let limits = FrameLimits::default();
            // the same receive-buffer reuse as the QUIC link's streams: the baseline differs in
            // transport only
            while let Ok(Some(f)) = read_frame_reusing(&mut r, &limits).await {
                let ack = Frame::from_bytes(FrameKind::Message, 0, &(f.body.len() as u64).to_le_bytes());
                drop(f);
                if write_frame(&mut w, &ack).await.is_err() {
                    return;
                }
                let _ = w.flush().await;
            }
        });
    }
}

/// A UDP echo on its own thread (the raw round-trip baseline).
fn udp_echo() -> Result<SocketAddr> {
    let sock = std::net::UdpSocket::bind("127.0.0.1:0")?;
    let addr = sock.local_addr()?;
    std::thread::spawn(move || {
        let mut buf = [0u8; 2048];
        while let Ok((n, from)) = sock.recv_from(&mut buf) {
            let _ = sock.send_to(&buf[..n], from);
        }
    });
    Ok(addr)
}

/// A `troupe bench-peer` process (`troupe bench transport`'s second process, or a placement host
/// of it) started through the node launcher `troupe up` uses, and the addresses its `READY` line
/// gave: the peer's QUIC, TCP and UDP addresses, or a placement host's QUIC address.
pub struct PeerProcess {
    cluster: troupe::up::Cluster,
    name: String,
    /// Where it listens.
    pub addrs: Vec<SocketAddr>,
    /// Its log (`NAME.log`); removed when this is dropped.
    _workdir: tempfile::TempDir,
}

impl PeerProcess {
    /// Writes the CA and node `name`'s identity into a private temporary folder, starts `exe
    /// bench-peer` on it (a placement host of that name when `host`) and waits for its `READY`
    /// line; the keys are removed once the peer has loaded them. Its output goes to its log
    /// file (and through this process, for the `READY` line), filtered by `RUST_LOG` (default:
    /// warnings).
    pub async fn start(exe: &Path, ca: &troupe_transport::ClusterCa, name: &str, host: bool) -> Result<Self> {
        use troupe::up::{Cluster, Launch, NodeBinary, Topology};
        let workdir =
            tempfile::Builder::new().prefix("troupe-bench-peer-").tempdir().context("a temp folder")?;
        let keys = workdir.path().join("keys");
        ca.write(&keys).and_then(|_| ca.issue_node(name)?.write(&keys)).context("writing the peer's keys")?;
        let mut command = vec!["bench-peer".to_string()];
        if host {
            command.extend(["--host".to_string(), name.to_string()]);
        }
        let binary =
            NodeBinary { exe: exe.to_path_buf(), node_command: command, kinds: troupe::Kinds::builtin() };
        let (tx, mut lines) = tokio::sync::mpsc::unbounded_channel();
        let filter = std::env::var("RUST_LOG").unwrap_or_else(|_| "warn,ractor_cluster=error".into());
        let launch = Launch { binary, lines: Some(tx), log_filter: Some(filter), ..Launch::logged(exe) };
        // the launcher passes each node's config as `--config`: here, the peer's keys folder
        let (cluster, _jobs) = Cluster::start(
            &Topology::empty("bench"),
            workdir.path(),
            vec![(name.to_string(), keys.clone())],
            launch,
        )?;
        let mut peer = Self { cluster, name: name.to_string(), addrs: Vec::new(), _workdir: workdir };
        let ready = tokio::time::timeout(Duration::from_secs(30), async {
            while let Some((_, line)) = lines.recv().await {
                if let Some(addrs) = line.strip_prefix("READY ") {
                    return Some(addrs.to_string());
                }
            }
            None
        })
        .await;
        let _ = std::fs::remove_dir_all(&keys);
        let log = peer.cluster.log_path(name);
        let line = match ready {
            Ok(Some(line)) => line,
            Ok(None) => bail!("the bench peer {name} exited before it was ready; its log: {}", log.display()),
            Err(_) => bail!("the bench peer {name} was not ready within 30 s; its log: {}", log.display()),
        };
        peer.addrs = line
            .split_whitespace()
            .map(str::parse)
            .collect::<Result<_, _>>()
            .with_context(|| format!("bad addresses from the bench peer: {line:?}"))?;
        Ok(peer)
    }

    /// The peer's process id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.cluster.pid(&self.name)
    }

    /// Sends the peer SIGKILL without waiting for it (see [`PeerProcess::reap`]).
    pub fn start_kill(&mut self) -> Result<()> {
        self.cluster.start_kill9(&self.name).map(|_| ())
    }

    /// Waits for the peer's process to end, once killed.
    pub async fn reap(&mut self) {
        if let Some((_, child)) = self.cluster.children.iter_mut().find(|(n, _)| *n == self.name) {
            let _ = child.wait().await;
        }
    }

    /// Stops the peer (SIGINT, then SIGKILL after 3 s) and returns how it exited.
    pub async fn stop(mut self) -> Result<std::process::ExitStatus> {
        self.cluster.stop_all().await;
        self.cluster.exited(&self.name)?.with_context(|| format!("the bench peer {} did not exit", self.name))
    }
}

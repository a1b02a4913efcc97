//! The second process of `troupe bench transport` (`troupe bench-peer`, hidden): a node runtime
//! with the actors the benchmark calls, a frame sink that acknowledges every tensor with its
//! length (and answers a data-channel message with the blake3 hash of its body, for tests), a
//! TCP frame sink for the baseline and a UDP echo. It prints one `READY` line and runs until its stdin
//! closes, so it never outlives the benchmark.
//!
//! The bench's typed actor kind, [`BenchEcho`], is defined here: the peer runs one named [`ECHO`].
//! It also serves [`VIA_ACTOR`], the hello expert's question through a plain ractor actor's
//! mailbox (an [`Answerer`]), the baseline for what the typed layer adds over any actor call.
//! Started with [`HOST_ENV`] set to a node name, the process is instead a placement host of that
//! name (no other actors, no sinks): it lets schedulers place one [`BenchEcho`] on it, for the
//! cross-node restart figure.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use ractor_cluster::RactorClusterMessage;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
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
/// Set to a node name, `troupe bench-peer` runs as a placement host of that name (see the
/// module doc); its identity must be in the keys folder under that name.
pub const HOST_ENV: &str = "TROUPE_BENCH_HOST";
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

/// Waits until stdin closes (the benchmark ended or dropped this process).
async fn until_stdin_closes() {
    let mut stdin = tokio::io::BufReader::new(tokio::io::stdin());
    let mut line = String::new();
    while stdin.read_line(&mut line).await.unwrap_or(0) > 0 {
        line.clear();
    }
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
    until_stdin_closes().await;
    node.shutdown().await;
    Ok(())
}

/// Runs the peer (or, with [`HOST_ENV`] set, a placement host) until stdin closes.
pub async fn run(keys: &Path) -> Result<()> {
    if let Ok(name) = std::env::var(HOST_ENV) {
        return host(keys, &name).await;
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
    until_stdin_closes().await;
    node.services.unregister(VIA_ACTOR);
    answerer.stop(None);
    let _ = answerer_done.await;
    node.shutdown().await;
    Ok(())
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

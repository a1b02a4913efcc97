//! The second process of `troupe bench transport` (`troupe bench-peer`, hidden): a node runtime
//! with the actors the benchmark calls, a frame sink that acknowledges every tensor with its
//! length (and answers a data-channel message with the blake3 hash of its body, for tests), a
//! TCP frame sink for the baseline and a UDP echo. It prints one `READY` line and runs until its stdin
//! closes, so it never outlives the benchmark.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use ractor_cluster::RactorClusterMessage;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use troupe_actors::hello::HelloExpert;
use troupe_actors::supervisor::ChildSpec;
use troupe_actors::{Intensity, MembershipConfig, NodeRuntime, NodeSpec};
use troupe_transport::frame::{read_frame_reusing, write_frame};
use troupe_transport::{Channel, Frame, FrameKind, FrameLimits, Link, NodeIdentity, QuicConfig};

/// Name of the peer node (its certificate is issued by the benchmark).
pub const PEER_NAME: &str = "bench-peer";
/// Process group of the [`Sink`].
pub const SINK_GROUP: &str = "bench-sink";
/// Process group of the [`Crashy`] actor (it joins on every start).
pub const CRASHY_GROUP: &str = "bench-crashy";

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

/// Runs the peer until stdin closes.
pub async fn run(keys: &Path) -> Result<()> {
    // one line per panic instead of a captured backtrace: the crash is the benchmark's, on purpose
    std::panic::set_hook(Box::new(|info| eprintln!("bench-peer: {info}")));
    let identity = NodeIdentity::load(keys, PEER_NAME).with_context(|| format!("loading {PEER_NAME}"))?;
    // the expert answers both as a ractor_cluster actor and on the role-checked service path
    let children: troupe_actors::Children = Box::new(|_, services, _, _| {
        let args =
            troupe_actors::hello::HelloArgs { node: PEER_NAME.to_string(), services: Some(services.clone()) };
        Ok(vec![
            ChildSpec::new("bench-expert", move || (HelloExpert, args.clone())),
            ChildSpec::new("bench-sink", || (Sink, ())),
            ChildSpec::new("bench-crashy", || (Crashy, ())),
        ])
    });
    let node = NodeRuntime::start(NodeSpec {
        identity,
        quic: QuicConfig::default(),
        peers: Vec::new(),
        membership: MembershipConfig::default(),
        // the benchmark crashes one child many times in a row
        intensity: Intensity { max_restarts: 10_000, period: Duration::from_secs(1) },
        cookie: "bench".into(),
        children,
        redial: Duration::from_millis(200),
        placement: Default::default(),
    })
    .await?;
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
    let mut stdin = tokio::io::BufReader::new(tokio::io::stdin());
    let mut line = String::new();
    while stdin.read_line(&mut line).await.unwrap_or(0) > 0 {
        line.clear();
    }
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

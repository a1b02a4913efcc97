//! `troupe bench transport`: every figure is ours over a baseline measured in the same run.
//!
//! - goodput: tensor frames over QUIC (mutual TLS, framed, checked) vs the same frames over
//!   plain TCP on loopback, 1 MiB and 64 MiB payloads;
//! - remote ask: a ractor_cluster RPC between two nodes over QUIC vs a raw UDP 64 B round trip;
//! - local tell: casts to a ractor actor vs sends on a tokio mpsc channel;
//! - serialisation: rkyv serialise + checked access of a 1 MiB tensor message vs memcpy.

use std::collections::BTreeMap;
use std::net::UdpSocket;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use ractor_cluster::RactorMessage;
use tokio::net::{TcpListener, TcpStream};
use troupe_actors::hello::{HelloExpert, HelloExpertMsg, remote_experts};
use troupe_actors::supervisor::ChildSpec;
use troupe_actors::{Intensity, MembershipConfig, NodeRuntime, NodeSpec};
use troupe_transport::frame::{read_frame, write_frame};
use troupe_transport::{
    Channel, ClusterCa, Frame, FrameKind, FrameLimits, Link, NodeId, QuicConfig, QuicNode,
};

use super::stats::{median, quantile};

/// Runs every transport figure.
pub async fn run(quick: bool) -> Result<BTreeMap<String, f64>> {
    let mut f = BTreeMap::new();
    let ca = ClusterCa::generate("bench")?;
    for (label, size, count) in
        [("1mib", 1usize << 20, if quick { 16 } else { 128 }), ("64mib", 64 << 20, if quick { 1 } else { 4 })]
    {
        let payload = payload(size);
        let quic = quic_goodput(&ca, &payload, count).await?;
        let tcp = tcp_goodput(&payload, count).await?;
        f.insert(format!("goodput_quic_mb_s_{label}"), quic);
        f.insert(format!("goodput_tcp_mb_s_{label}"), tcp);
        f.insert(format!("goodput_quic_over_tcp_{label}"), quic / tcp);
    }
    let asks = if quick { 200 } else { 2000 };
    let (p50, p99) = remote_ask(&ca, asks).await?;
    let udp = udp_rtt_p50(asks)?;
    f.insert("ask_p50_us".into(), p50);
    f.insert("ask_p99_us".into(), p99);
    f.insert("udp_rtt_p50_us".into(), udp);
    f.insert("ask_p50_over_udp_rtt".into(), p50 / udp);
    let tells = if quick { 20_000 } else { 200_000 };
    let (tell, mpsc) = tell_vs_mpsc(tells).await?;
    f.insert("tell_msgs_per_s".into(), tell);
    f.insert("mpsc_msgs_per_s".into(), mpsc);
    f.insert("tell_over_mpsc".into(), tell / mpsc);
    let (ser, copy) = serialise_vs_memcpy();
    f.insert("rkyv_serialise_access_us_1mib".into(), ser);
    f.insert("memcpy_us_1mib".into(), copy);
    f.insert("rkyv_over_memcpy".into(), ser / copy);
    Ok(f)
}

/// Incompressible-looking bytes (an LCG), so neither side can cheat with compression.
fn payload(len: usize) -> Vec<u8> {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    (0..len)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (x >> 56) as u8
        })
        .collect()
}

async fn quic_goodput(ca: &ClusterCa, payload: &[u8], count: usize) -> Result<f64> {
    let cfg = QuicConfig::default();
    let a = QuicNode::bind(&ca.issue_node("bench-a")?, cfg.clone()).await?;
    let b = QuicNode::bind(&ca.issue_node("bench-b")?, cfg).await?;
    let peer = a.connect(b.local_addr()?, &NodeId::new("bench-b")).await?;
    let frame = Frame::from_bytes(FrameKind::Tensor, 0, payload);
    // warm-up: one frame
    a.send(&peer, Channel::Data, frame.clone()).await?;
    b.recv().await?;
    let receiver = {
        let b = b.clone();
        tokio::spawn(async move {
            let mut bytes = 0usize;
            for _ in 0..count {
                bytes += b.recv().await?.frame.body.len();
            }
            Ok::<_, anyhow::Error>(bytes)
        })
    };
    let start = Instant::now();
    for _ in 0..count {
        a.send(&peer, Channel::Data, frame.clone()).await?;
    }
    let bytes = receiver.await??;
    let secs = start.elapsed().as_secs_f64();
    a.shutdown().await;
    b.shutdown().await;
    Ok(bytes as f64 / secs / 1e6)
}

async fn tcp_goodput(payload: &[u8], count: usize) -> Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let receiver = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await?;
        s.set_nodelay(true)?;
        let limits = FrameLimits::default();
        let mut bytes = 0usize;
        for _ in 0..=count {
            let f = read_frame(&mut s, &limits).await?.context("tcp stream ended early")?;
            bytes += f.body.len();
        }
        Ok::<_, anyhow::Error>(bytes)
    });
    let mut s = TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    let frame = Frame::from_bytes(FrameKind::Tensor, 0, payload);
    write_frame(&mut s, &frame).await?; // warm-up, like the QUIC side
    let start = Instant::now();
    for _ in 0..count {
        write_frame(&mut s, &frame).await?;
    }
    let bytes = receiver.await?? - payload.len();
    Ok(bytes as f64 / start.elapsed().as_secs_f64() / 1e6)
}

fn bench_spec(ca: &ClusterCa, name: &str, children: Vec<ChildSpec>) -> Result<NodeSpec> {
    Ok(NodeSpec {
        identity: ca.issue_node(name)?,
        quic: QuicConfig::default(),
        peers: Vec::new(),
        membership: MembershipConfig::default(),
        intensity: Intensity::default(),
        cookie: "bench".into(),
        children: troupe_actors::fixed_children(children),
        redial: Duration::from_millis(200),
    })
}

async fn remote_ask(ca: &ClusterCa, asks: usize) -> Result<(f64, f64)> {
    let expert = ChildSpec::new("bench-expert", || (HelloExpert, "bench-server".to_string()));
    let server = NodeRuntime::start(bench_spec(ca, "bench-server", vec![expert])?).await?;
    let mut client_spec = bench_spec(ca, "bench-client", Vec::new())?;
    client_spec.peers =
        vec![troupe_actors::PeerAddr { name: NodeId::new("bench-server"), addr: server.link.local_addr()? }];
    let client = NodeRuntime::start(client_spec).await?;
    let deadline = Instant::now() + Duration::from_secs(20);
    let cell = loop {
        if let Some(c) = remote_experts().into_iter().next() {
            break c;
        }
        if Instant::now() > deadline {
            bail!("the remote expert did not appear within 20 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let expert: ActorRef<HelloExpertMsg> = cell.into();
    let mut samples = Vec::with_capacity(asks);
    for i in 0..asks + 50 {
        let t = Instant::now();
        ractor::call_t!(expert, HelloExpertMsg::Ask, 5000, "ping".to_string())?;
        if i >= 50 {
            samples.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    client.shutdown().await;
    server.shutdown().await;
    Ok((quantile(&mut samples, 0.5), quantile(&mut samples, 0.99)))
}

fn udp_rtt_p50(rounds: usize) -> Result<f64> {
    let a = UdpSocket::bind("127.0.0.1:0")?;
    let b = UdpSocket::bind("127.0.0.1:0")?;
    a.connect(b.local_addr()?)?;
    b.connect(a.local_addr()?)?;
    a.set_read_timeout(Some(Duration::from_secs(2)))?;
    b.set_read_timeout(Some(Duration::from_secs(2)))?;
    let echo = std::thread::spawn(move || {
        let mut buf = [0u8; 64];
        for _ in 0..rounds + 50 {
            if b.recv(&mut buf).is_err() || b.send(&buf).is_err() {
                return;
            }
        }
    });
    let msg = [7u8; 64];
    let mut buf = [0u8; 64];
    let mut samples = Vec::with_capacity(rounds);
    for i in 0..rounds + 50 {
        let t = Instant::now();
        a.send(&msg)?;
        a.recv(&mut buf)?;
        if i >= 50 {
            samples.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    let _ = echo.join();
    Ok(median(&mut samples))
}

/// Counts casts; answers the count.
struct Counter;

#[derive(RactorMessage)]
enum CounterMsg {
    Add(u64),
    Get(RpcReplyPort<u64>),
}

impl Actor for Counter {
    type Msg = CounterMsg;
    type State = u64;
    type Arguments = ();

    async fn pre_start(&self, _me: ActorRef<Self::Msg>, _: ()) -> Result<u64, ActorProcessingErr> {
        Ok(0)
    }

    async fn handle(
        &self,
        _me: ActorRef<Self::Msg>,
        msg: Self::Msg,
        n: &mut u64,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            CounterMsg::Add(k) => *n += k,
            CounterMsg::Get(r) => {
                let _ = r.send(*n);
            }
        }
        Ok(())
    }
}

async fn tell_vs_mpsc(n: u64) -> Result<(f64, f64)> {
    let (counter, handle) = Actor::spawn(None, Counter, ()).await?;
    let start = Instant::now();
    for _ in 0..n {
        counter.cast(CounterMsg::Add(1))?;
    }
    let got = ractor::call_t!(counter, CounterMsg::Get, 60_000)?;
    let tell = n as f64 / start.elapsed().as_secs_f64();
    if got != n {
        bail!("counter saw {got} of {n} casts");
    }
    counter.stop(None);
    let _ = handle.await;

    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<u64>();
    let start = Instant::now();
    let sum = tokio::spawn(async move {
        let mut s = 0u64;
        while let Some(k) = rx.recv().await {
            s += k;
        }
        s
    });
    for _ in 0..n {
        tx.send(1)?;
    }
    drop(tx);
    let got = sum.await?;
    let mpsc = n as f64 / start.elapsed().as_secs_f64();
    if got != n {
        bail!("mpsc receiver saw {got} of {n} messages");
    }
    Ok((tell, mpsc))
}

#[derive(rkyv::Archive, rkyv::Serialize)]
struct TensorMsg {
    id: u64,
    shape: Vec<u64>,
    data: Vec<f32>,
}

/// (rkyv serialise + checked access, memcpy) in microseconds for a 1 MiB tensor, best of 20.
fn serialise_vs_memcpy() -> (f64, f64) {
    let data: Vec<f32> = (0..(1 << 18)).map(|i| (i as f32 * 0.001).sin()).collect();
    let msg = TensorMsg { id: 1, shape: vec![512, 512], data };
    let bytes: &[u8] = bytemuck_f32(&msg.data);
    let mut dst = vec![0u8; bytes.len()];
    let (mut ser, mut copy) = (Vec::new(), Vec::new());
    for _ in 0..20 {
        let t = Instant::now();
        let buf = rkyv::to_bytes::<rkyv::rancor::Error>(&msg);
        let ok = buf
            .as_ref()
            .ok()
            .and_then(|b| rkyv::access::<ArchivedTensorMsg, rkyv::rancor::Error>(b).ok())
            .is_some_and(|a| a.data.len() == msg.data.len());
        ser.push(t.elapsed().as_secs_f64() * 1e6);
        assert!(ok, "rkyv round trip failed");
        let t = Instant::now();
        dst.copy_from_slice(bytes);
        std::hint::black_box(&dst);
        copy.push(t.elapsed().as_secs_f64() * 1e6);
    }
    (quantile(&mut ser, 0.0), quantile(&mut copy, 0.0))
}

fn bytemuck_f32(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and any byte pattern is a valid u8; the length is exact.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

//! `troupe bench transport`: every figure is ours over a baseline measured in the same run, and
//! everything that crosses nodes crosses *processes*: the benchmark starts a second process (the
//! hidden `troupe bench-peer`, found through `current_exe`) and measures across it, as Ray's
//! figures in PERF-ANCHORS.md are.
//!
//! - tensor goodput: frames over QUIC (mutual TLS, framed, checked) vs the same frames over plain
//!   TCP on loopback (read with the same receive-buffer reuse, `frame::read_frame_reusing`, so
//!   the two differ in transport only), and through the same-host shared-memory path, 1 MiB and 64 MiB payloads,
//!   each acknowledged by the receiving node; the median of five rounds that interleave the
//!   three (the ratios are medians of each round's pair, so drift between rounds cancels),
//!   against an in-process memcpy of the same size;
//! - remote ask: a ractor_cluster RPC to an actor of the other process (its session on the
//!   same-host control stream, which the benchmark checks) vs a raw UDP round trip
//!   to that process, and the same question through the role-checked service path
//!   (`ask_service_*`: a `Service` frame on the data channel, answered by the expert's handler),
//!   once on the road the runtime picks between two processes of one host (the same-host
//!   streams of `troupe_transport::local`) and once from a client with those streams off, so
//!   over encrypted QUIC (`ask_service_quic_*`; the ractor ask has no QUIC twin here: a second
//!   ractor_cluster node server in one process numbers its sessions from 0 too, so its remote
//!   actors would share ids with the first one's);
//! - remote tell: casts to an actor of the other process, until it has counted them all;
//! - restart: an actor of the other process under its `Supervisor` panics; time from the crash
//!   order to the first reply from its new incarnation (median of rounds);
//! - local tell: casts to a ractor actor vs sends on a tokio mpsc channel;
//! - serialisation: rkyv serialise + checked access of a 1 MiB tensor message vs memcpy.
//!
//! Typed actors (`typed_*`, `remote_restart_*`): the expert's question as an
//! `ActorHandle::call` to the peer's [`BenchEcho`] (one typed kind, in `peer.rs`), in the same
//! paired rounds, over UDP and over the service ask on the same road (what the typed layer adds:
//! archiving the message and reading the answer, the incarnation check, the actor's mailbox),
//! on the same-host road and from a member node with the same-host streams off (QUIC);
//! `ask_service_via_actor_*` is the same service ask answered through a plain ractor actor's
//! mailbox on the peer (its handler forwards the question with `ractor::call!` to an actor of
//! `peer.rs` and answers with the reply), on the same road in the same rounds, because the
//! service ask is answered inline on the stream reader while any actor call pays a mailbox hop
//! there and back: `typed_call_over_service_ask_via_actor` is what the typed layer adds over
//! that; typed
//! tells until a `Count` from the same handle has them all; and a `RemoteSupervisor` on the
//! client node whose child lives on one of two placement host processes: its host is SIGKILLed,
//! and the time to the first answer of the replacement on the other host is set over the
//! membership timeout the bench's nodes use (`MembershipConfig::default()`), so ~1 means that
//! detecting the loss is nearly all of it.
//!
//! What dominated when profiled (perf, 2026-12-01, busy 2-core VM): the receiving process of
//! 1 MiB QUIC frames spent ~21% in page faults on fresh receive buffers (15% under the
//! zero-fill in `frame::read_frame`), ~12% in memmove, ~8.5% in AES-GCM decryption, ~7% in the
//! recvmmsg copy and ~4% in memcg charging; at the default 1452-byte MTU per-packet work came
//! first (raising the bound to 6500 halved the packet count's cost). The same-host path is
//! bounded by the kernel: a 64 MiB tmpfs write takes ~24 ms (page allocation) and the read into
//! a fresh buffer ~30 ms with huge pages (~47 ms without); a second copy thread on either side
//! did not help (the page allocator and mm locks are shared). Inside this benchmark the same
//! segments took 31-133 ms to write and 46-360 ms to read (`RUST_LOG=troupe_transport::shm=debug`
//! logs each): the machine had < 1 GB free and 22 GB of page cache, so every fresh page came
//! through reclaim and THP compaction stalls (`/proc/vmstat`), and the path allocates twice
//! (tmpfs page, receive buffer) where TCP allocates once. `memcpy_64mib_mb_s` is the copy into
//! a fresh buffer that any receiver of a 64 MiB tensor pays.
//!
//! Since then (2026-12-01, same machine kind, busy): the sender rewrites warm, pre-populated
//! segments from a per-peer pool (12-13 ms per 64 MiB instead of 29-70 ms for a fresh one), and
//! frame bodies are read into uninitialised capacity (no zero-fill pass). A perf profile of the
//! same-host run then shows the receiver's kernel zeroing fresh huge pages under its `pread`
//! (`clear_page_erms` in `folio_zero_user`, ~14% of all samples) as the largest single cost: the
//! delivered `Frame` owns a fresh `AlignedVec`, so the same-host figure is bounded by
//! `memcpy_64mib_mb_s` until the receiving API can lend a reused or mapped buffer.
//!
//! Then (2026-12-02, perf with DWARF call graphs over a whole run, load average ~2): of the
//! receiving process's samples under quinn, 64% were `RecvStream::poll_read_buf` copying into
//! the body buffer and 48% page faults inside that copy (fresh 4 KiB pages of new buffers,
//! zeroed by the kernel, charged to the memcg); AES-GCM decryption did not reach the top 25.
//! The sender spent 25% in AES-GCM encryption, 21% in `sendmsg` (GSO, 6500-byte segments) and
//! 14% copying stream data into packets. Complete frames' buffers now go back to a bounded
//! receive pool (`frame::recv_pool`) and the next frame of about that size is read into one:
//! in the same profile afterwards the receiver's page faults are 3% of its samples, and its
//! work is the kernel's copy out of the socket, quinn's copy into the body and decryption.
//! Measured on a loaded box (load average 15-17 from four other builds), four A/B pairs in turn,
//! medians; "before" is the release binary of 2026-12-01 20:26 (older same-host path, TCP
//! baseline reading into fresh buffers), "after" this one: QUIC 1 MiB 335 -> 183 MB/s, TCP 1 MiB
//! 3066 -> 857 MB/s (ratio 0.14 -> 0.21); QUIC 64 MiB 148 -> 191 MB/s, TCP 64 MiB 226 -> 939 MB/s
//! (ratio 0.70 -> 0.20: the TCP baseline gained most from the reuse); ask p50 118 -> 86 us,
//! service-path ask 90 us; UDP round trip ~8 us in both. At that load every figure moves 2-3x
//! between runs (one more run after: 1 MiB ratio 0.30, 64 MiB 0.33): the ratios against the
//! targets need a quiet box. Three more pairs (load 17-19, after first) gave QUIC 1 MiB 135 vs
//! 118 MB/s before, TCP 1 MiB 1349 vs 1847, TCP 64 MiB 1557 vs 363, QUIC 64 MiB 141 vs 181: QUIC
//! 1 MiB did not drop again, TCP 1 MiB was lower again (inside a 466-2602 spread: not settled),
//! and the TCP 64 MiB gain repeated.
//!
//! Then (2026-12-02, evening, idle 2-core VM, perf over 9 alternated 64 MiB QUIC/TCP pairs):
//! a quarter of all samples were page faults and page clearing, from glibc trimming its heap
//! after every freed 64 KiB datagram buffer (quinn copies each datagram into a fresh one), and
//! the 6500-byte MTU cap made a 64 MiB tensor ~10,000 packets. Every troupe process now fixes
//! glibc's thresholds at start (`troupe_actors::allocator`), MTU discovery goes up to 65,000
//! bytes with GSO batches cut to what one send carries (`troupe_transport::datagram`), and TLS
//! prefers AES-128-GCM. Medians of the 9 pairs, one run each: 64 MiB QUIC 0.85-0.95 -> 1.34-1.49
//! GB/s (ratio to TCP 0.31 -> 0.45-0.48; the thresholds alone ~1.3x, 65,000-byte datagrams ~1.35x
//! on top at first measure, AES-128 ~5%). What is left is copies and crypto: the receiver's
//! kernel copy, quinn's datagram copy, the copy into the frame body and AES-GCM; TCP has the
//! first only. A larger receive window, BBR or NewReno did not move it outside the noise.

use std::collections::BTreeMap;
use std::net::{SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use ractor::pg::GroupChangeMessage;
use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use ractor_cluster::RactorMessage;
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use troupe_actors::hello::{ASK, EXPERTS_GROUP, HelloExpertMsg, find_experts};
use troupe_actors::service::{ServiceClient, Services, to_body};
use troupe_actors::typed::{ActorError, ActorHandle, PLACEMENT, RemoteChild};
use troupe_actors::{Intensity, MembershipConfig, NodeRuntime, NodeSpec, PeerAddr};
use troupe_transport::frame::{read_frame, write_frame};
use troupe_transport::{
    Channel, ClusterCa, Frame, FrameKind, FrameLimits, IssueOptions, Link, NodeId, QuicConfig, QuicNode,
    Role, RoleSet, ShmConfig,
};

use super::peer::{
    Ask, BenchEcho, CRASHY_GROUP, Count, CrashyMsg, ECHO, PEER_NAME, PeerProcess, SINK_GROUP, SinkMsg, Tell,
    VIA_ACTOR,
};
use troupe_policy::stats::{median, quantile};

/// Ray 2.60 on this machine kind (PERF-ANCHORS.md, 2026-12-01): 1 MiB and 64 MiB actor to
/// actor in MB/s, synchronous call p50 in us, fire-and-forget calls/s, crashed actor back in ms.
const RAY_1MIB_MB_S: f64 = 154.0;
const RAY_64MIB_MB_S: f64 = 1271.0;
const RAY_CALL_P50_US: f64 = 806.0;
const RAY_TELLS_PER_S: f64 = 2784.0;
const RAY_RESTART_MS: f64 = 561.0;

/// Runs every transport figure.
pub async fn run(quick: bool) -> Result<BTreeMap<String, f64>> {
    let mut f = BTreeMap::new();
    let ca = ClusterCa::generate("bench")?;
    let peer = PeerProcess::start(&bench_exe()?, &ca, PEER_NAME, false).await?;
    let [peer_quic, peer_tcp, peer_udp] = peer.addrs[..] else {
        bail!("expected three addresses from the bench peer: {:?}", peer.addrs)
    };
    let peer_id = NodeId::new(PEER_NAME);
    let quic_only = QuicConfig {
        member: false,
        shm: ShmConfig { enabled: false, ..ShmConfig::default() },
        ..QuicConfig::default()
    };
    let quic = QuicNode::bind(&ca.issue_node("bench-quic")?, quic_only).await?;
    quic.connect(peer_quic, &peer_id).await?;
    let shm =
        QuicNode::bind(&ca.issue_node("bench-shm")?, QuicConfig { member: false, ..QuicConfig::default() })
            .await?;
    shm.connect(peer_quic, &peer_id).await?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !shm.same_host(&peer_id) {
        if Instant::now() > deadline {
            bail!("the same-host path to the peer process did not open within 10 s");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let rounds = if quick { 1 } else { 5 };
    let bar = troupe::progress::bar(2 * rounds as u64, "bench goodput rounds");
    for (label, size, count) in
        [("1mib", 1usize << 20, if quick { 16 } else { 64 }), ("64mib", 64 << 20, if quick { 1 } else { 4 })]
    {
        let payload = payload(size);
        let (mut q, mut t, mut s) = (Vec::new(), Vec::new(), Vec::new());
        // ratios pair each QUIC and same-host round with the TCP round run beside it, so that
        // the machine's drift between rounds cancels out of them
        let (mut q_over_t, mut s_over_t) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            let (qr, tr, sr) = (
                quic_goodput(&quic, &peer_id, &payload, count).await?,
                tcp_goodput(peer_tcp, &payload, count).await?,
                quic_goodput(&shm, &peer_id, &payload, count).await?,
            );
            q_over_t.push(qr / tr);
            s_over_t.push(sr / tr);
            q.push(qr);
            t.push(tr);
            s.push(sr);
            bar.inc(1);
        }
        let (q, t, s) = (median(&mut q), median(&mut t), median(&mut s));
        let (q_over_t, s_over_t) = (median(&mut q_over_t), median(&mut s_over_t));
        let copy = memcpy_mb_s(&payload);
        f.insert(format!("goodput_quic_mb_s_{label}"), q);
        f.insert(format!("goodput_tcp_mb_s_{label}"), t);
        f.insert(format!("goodput_quic_over_tcp_{label}"), q_over_t);
        f.insert(format!("tensor_{label}_mb_s_quic"), q);
        f.insert(format!("tensor_{label}_mb_s_tcp"), t);
        f.insert(format!("tensor_{label}_mb_s_same_host"), s);
        f.insert(format!("tensor_{label}_quic_over_tcp"), q_over_t);
        f.insert(format!("tensor_{label}_same_host_over_tcp"), s_over_t);
        f.insert(format!("memcpy_{label}_mb_s"), copy);
        f.insert(format!("tensor_{label}_same_host_over_memcpy"), s / copy);
    }
    bar.finish_and_clear();
    if let Some(st) = quic.connection_stats(&peer_id) {
        f.insert("quic_lost_packets".into(), st.path.lost_packets as f64);
        f.insert("quic_sent_packets".into(), st.path.sent_packets as f64);
        f.insert("quic_congestion_events".into(), st.path.congestion_events as f64);
        f.insert("quic_mtu".into(), f64::from(st.path.current_mtu));
        f.insert("quic_cwnd".into(), st.path.cwnd as f64);
    }
    if shm.shm_stats().sent == 0 {
        bail!("the same-host figures did not use the same-host path");
    }
    f.insert("tensor_1mib_quic_over_ray".into(), f["tensor_1mib_mb_s_quic"] / RAY_1MIB_MB_S);
    f.insert("tensor_64mib_same_host_over_ray".into(), f["tensor_64mib_mb_s_same_host"] / RAY_64MIB_MB_S);
    f.insert("tensor_64mib_quic_over_ray".into(), f["tensor_64mib_mb_s_quic"] / RAY_64MIB_MB_S);
    quic.shutdown().await;
    shm.shutdown().await;

    let client =
        NodeRuntime::start(bench_spec(&ca, "bench-client", peer_quic, QuicConfig::default())?).await?;
    let expert: ActorRef<HelloExpertMsg> = remote_member(EXPERTS_GROUP, None).await?.into();
    let experts = find_experts(&client.services, 1, Duration::from_secs(20))
        .await
        .map_err(|found| anyhow::anyhow!("{found} hello expert services announced within 20 s"))?;
    let (expert_peer, expert_service) = &experts[0];
    client
        .services
        .wait_for(Duration::from_secs(20), |s| s.providers(VIA_ACTOR).contains(expert_peer).then_some(()))
        .await
        .with_context(|| format!("{expert_peer} did not announce {VIA_ACTOR} within 20 s"))?;
    let echo = client.actors.wait_for::<BenchEcho>(ECHO, Duration::from_secs(20)).await?;
    // the same service asks over encrypted QUIC: a client with the same-host streams off
    let quic_only =
        QuicConfig { shm: ShmConfig { streams: false, ..ShmConfig::default() }, ..QuicConfig::default() };
    let quic_client = ServiceClient::connect_with(
        &scheduler_identity(&ca, "bench-quic-client")?,
        peer_quic,
        None,
        quic_only.clone(),
    )
    .await?;
    let (asks, rounds) = if quick { (200, 1) } else { (2000, 5) };
    let per_round = asks / rounds;
    let (mut udp, [mut ractor, mut service, mut service_quic, mut via_actor, mut typed]) = paired_rounds(
        peer_udp,
        [
            RoundTrip::Ractor(&expert),
            RoundTrip::Service(&client.services, expert_peer, expert_service),
            RoundTrip::Service(&quic_client.services, expert_peer, expert_service),
            RoundTrip::Service(&client.services, expert_peer, VIA_ACTOR),
            RoundTrip::Typed(&echo),
        ],
        rounds,
        per_round,
    )
    .await?;
    if client.link.local_stats().control == 0 {
        bail!("the ractor_cluster asks did not take the same-host control stream to the peer process");
    }
    if client.link.local_stats().opened == 0 {
        bail!("the service asks did not take the same-host streams to the peer process");
    }
    if quic_client.link.local_stats().opened != 0 {
        bail!("the QUIC-only service asks took a same-host stream");
    }
    quic_client.link.shutdown().await;
    let p50 = ractor.p(0.5);
    f.insert("udp_rtt_p50_us".into(), udp.p(0.5));
    f.insert("ask_p50_us".into(), p50);
    f.insert("ask_p99_us".into(), ractor.p(0.99));
    f.insert("ask_p50_over_udp_rtt".into(), ractor.over(&udp));
    f.insert("ray_call_p50_over_ask_p50".into(), RAY_CALL_P50_US / p50);
    f.insert("ask_service_p50_us".into(), service.p(0.5));
    f.insert("ask_service_p99_us".into(), service.p(0.99));
    f.insert("ask_service_p50_over_udp_rtt".into(), service.over(&udp));
    f.insert("ask_service_quic_p50_us".into(), service_quic.p(0.5));
    f.insert("ask_service_quic_p99_us".into(), service_quic.p(0.99));
    f.insert("ask_service_quic_p50_over_udp_rtt".into(), service_quic.over(&udp));
    f.insert("ask_service_via_actor_p50_us".into(), via_actor.p(0.5));
    f.insert("ask_service_via_actor_p99_us".into(), via_actor.p(0.99));
    f.insert("typed_call_p50_us".into(), typed.p(0.5));
    f.insert("typed_call_p99_us".into(), typed.p(0.99));
    f.insert("typed_call_over_udp_rtt".into(), typed.over(&udp));
    f.insert("typed_call_over_service_ask".into(), typed.over(&service));
    f.insert("typed_call_over_service_ask_via_actor".into(), typed.over(&via_actor));
    let tells = remote_tells(if quick { 20_000 } else { 200_000 }).await?;
    f.insert("tell_cross_process_per_s".into(), tells);
    f.insert("tell_cross_process_over_ray".into(), tells / RAY_TELLS_PER_S);
    let restart = restart_to_service(if quick { 5 } else { 9 }).await?;
    f.insert("restart_to_service_ms".into(), restart);
    f.insert("ray_restart_over_ours".into(), RAY_RESTART_MS / restart);
    f.insert("typed_tell_per_s".into(), typed_tells(&echo, if quick { 20_000 } else { 200_000 }).await?);

    // Typed calls over encrypted QUIC need a member node with the same-host streams off (a
    // non-member client hears no announcements, so it cannot resolve a name). Its ractor_cluster
    // session to the peer would register the peer's process-group members again under the ids
    // the client's session gave them (each node server numbers its sessions from 0), replacing
    // them in the process groups, so it starts only after the ractor figures above; its rounds
    // pair it with UDP round trips of their own.
    let typed_node = NodeRuntime::start(bench_spec(&ca, "bench-typed-quic", peer_quic, quic_only)?).await?;
    let echo_quic = typed_node.actors.wait_for::<BenchEcho>(ECHO, Duration::from_secs(20)).await?;
    let (udp_quic, [mut typed_quic]) =
        paired_rounds(peer_udp, [RoundTrip::Typed(&echo_quic)], rounds, per_round).await?;
    if typed_node.link.local_stats().opened != 0 {
        bail!("the QUIC-only typed calls took a same-host stream");
    }
    typed_node.shutdown().await;
    f.insert("typed_call_quic_p50_us".into(), typed_quic.p(0.5));
    f.insert("typed_call_quic_p99_us".into(), typed_quic.p(0.99));
    f.insert("typed_call_quic_over_udp_rtt".into(), typed_quic.over(&udp_quic));

    let membership = MembershipConfig::default();
    let moved = remote_restart(&ca, &client, if quick { 2 } else { 5 }, membership.heartbeat).await?;
    f.insert("remote_restart_to_service_ms".into(), moved);
    f.insert(
        "remote_restart_over_membership_timeout".into(),
        moved / (membership.timeout.as_secs_f64() * 1e3),
    );
    f.insert("membership_timeout_ms".into(), membership.timeout.as_secs_f64() * 1e3);
    f.insert("membership_heartbeat_ms".into(), membership.heartbeat.as_secs_f64() * 1e3);
    client.shutdown().await;
    let _ = peer.stop().await;

    let local = if quick { 20_000 } else { 200_000 };
    let (tell, mpsc) = tell_vs_mpsc(local).await?;
    f.insert("tell_msgs_per_s".into(), tell);
    f.insert("mpsc_msgs_per_s".into(), mpsc);
    f.insert("tell_over_mpsc".into(), tell / mpsc);
    let (ser, copy) = serialise_vs_memcpy();
    f.insert("rkyv_serialise_access_us_1mib".into(), ser);
    f.insert("memcpy_us_1mib".into(), copy);
    f.insert("rkyv_over_memcpy".into(), ser / copy);
    Ok(f)
}

/// The `troupe` binary running this benchmark (it has the hidden `bench-peer` subcommand).
fn bench_exe() -> Result<std::path::PathBuf> {
    std::env::current_exe().context("finding the troupe binary")
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

/// Best of 5 copies of `src` into a fresh buffer each time (what a receiver pays), in MB/s.
fn memcpy_mb_s(src: &[u8]) -> f64 {
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let t = Instant::now();
        let v = src.to_vec();
        std::hint::black_box(&v);
        best = best.min(t.elapsed().as_secs_f64());
    }
    src.len() as f64 / best / 1e6
}

/// Waits for the peer's acknowledgement of one tensor frame; returns the bytes it counted.
async fn ack(node: &QuicNode) -> Result<u64> {
    loop {
        let d = node.recv().await?;
        if d.channel == Channel::Data && d.frame.kind == FrameKind::Message {
            let b: [u8; 8] = d.frame.body[..].try_into().context("ack of the wrong size")?;
            return Ok(u64::from_le_bytes(b));
        }
    }
}

/// `count` tensor frames to the peer process, timed until the last acknowledgement, in MB/s.
async fn quic_goodput(node: &QuicNode, peer: &NodeId, payload: &[u8], count: usize) -> Result<f64> {
    let frame = Frame::from_bytes(FrameKind::Tensor, 0, payload);
    node.send(peer, Channel::Data, frame.clone()).await?; // warm-up
    ack(node).await?;
    let frames: Vec<Frame> = (0..count).map(|_| frame.clone()).collect();
    drop(frame);
    let receiver = {
        let node = node.clone();
        tokio::spawn(async move {
            let mut bytes = 0u64;
            for _ in 0..count {
                bytes += ack(&node).await?;
            }
            Ok::<_, anyhow::Error>(bytes)
        })
    };
    let start = Instant::now();
    for f in frames {
        node.send(peer, Channel::Data, f).await?;
    }
    let bytes = tokio::time::timeout(Duration::from_secs(120), receiver)
        .await
        .context("acks did not arrive")???;
    Ok(bytes as f64 / start.elapsed().as_secs_f64() / 1e6)
}

/// The same frames over plain TCP to the peer process, acknowledged the same way.
async fn tcp_goodput(addr: SocketAddr, payload: &[u8], count: usize) -> Result<f64> {
    let s = TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    let (mut r, mut w) = s.into_split();
    let limits = FrameLimits::default();
    let frame = Frame::from_bytes(FrameKind::Tensor, 0, payload);
    write_frame(&mut w, &frame).await?; // warm-up, like the QUIC side
    read_frame(&mut r, &limits).await?.context("tcp ack missing")?;
    let receiver = tokio::spawn(async move {
        let mut bytes = 0u64;
        for _ in 0..count {
            let f = read_frame(&mut r, &limits).await?.context("tcp stream ended early")?;
            let b: [u8; 8] = f.body[..].try_into().context("ack of the wrong size")?;
            bytes += u64::from_le_bytes(b);
        }
        Ok::<_, anyhow::Error>(bytes)
    });
    let start = Instant::now();
    for _ in 0..count {
        write_frame(&mut w, &frame).await?;
    }
    let bytes = receiver.await??;
    Ok(bytes as f64 / start.elapsed().as_secs_f64() / 1e6)
}

/// An identity with the scheduler role: the expert's service method admits schedulers only.
fn scheduler_identity(ca: &ClusterCa, name: &str) -> Result<troupe_transport::NodeIdentity> {
    Ok(ca.issue(name, &IssueOptions::new(RoleSet::only(Role::Scheduler))?)?)
}

/// A scheduler node of the bench process that dials the peer, with the bench's membership config
/// ([`MembershipConfig::default`], as the peer and the placement hosts).
fn bench_spec(ca: &ClusterCa, name: &str, peer: SocketAddr, quic: QuicConfig) -> Result<NodeSpec> {
    Ok(NodeSpec {
        identity: scheduler_identity(ca, name)?,
        quic,
        peers: vec![PeerAddr { name: NodeId::new(PEER_NAME), addr: peer.into() }],
        membership: MembershipConfig::default(),
        intensity: Intensity::default(),
        cookie: "bench".into(),
        children: troupe_actors::fixed_children(Vec::new()),
        redial: Duration::from_millis(200),
        placement: Default::default(),
    })
}

/// A remote member of process group `group` (waits up to 20 s for it to appear).
async fn remote_member(group: &str, not: Option<&ActorCell>) -> Result<ActorCell> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let found = ractor::pg::get_members(&group.to_string())
            .into_iter()
            .find(|c| !c.get_id().is_local() && not.is_none_or(|n| n.get_id() != c.get_id()));
        if let Some(c) = found {
            return Ok(c);
        }
        if Instant::now() > deadline {
            bail!("no remote member of {group} appeared within 20 s");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Round trips made before each batch of samples each batch of samples (connections, caches, the scheduler settle).
const WARM_UP: usize = 50;

/// `asks` round trips of a ractor_cluster RPC to the remote expert, in microseconds each.
async fn ractor_ask_samples(expert: &ActorRef<HelloExpertMsg>, asks: usize) -> Result<Vec<f64>> {
    let mut samples = Vec::with_capacity(asks);
    for i in 0..asks + WARM_UP {
        let t = Instant::now();
        ractor::call_t!(expert, HelloExpertMsg::Ask, 5000, "ping".to_string())?;
        if i >= WARM_UP {
            samples.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    Ok(samples)
}

/// The same question as [`ractor_ask_samples`] through the role-checked service path (a
/// [`FrameKind::Service`] request on the data channel, answered by the expert's handler, found
/// by its service announcement); microseconds each.
async fn service_ask_samples(
    services: &Services,
    peer: &NodeId,
    service: &str,
    asks: usize,
) -> Result<Vec<f64>> {
    let body = to_body(&"ping".to_string()).map_err(anyhow::Error::msg)?;
    let mut samples = Vec::with_capacity(asks);
    for i in 0..asks + WARM_UP {
        let t = Instant::now();
        services.call(peer, service, ASK, body.clone(), Duration::from_secs(5)).await?;
        if i >= WARM_UP {
            samples.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    Ok(samples)
}

/// The same question as a typed call ([`ActorHandle::call`]) to the peer's [`BenchEcho`]:
/// the question archived, the answer read back; microseconds each.
async fn typed_call_samples(echo: &ActorHandle<BenchEcho>, calls: usize) -> Result<Vec<f64>> {
    let mut samples = Vec::with_capacity(calls);
    for i in 0..calls + WARM_UP {
        let t = Instant::now();
        echo.call(Ask("ping".to_string()), Duration::from_secs(5)).await?;
        if i >= WARM_UP {
            samples.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    Ok(samples)
}

/// One kind of round trip to the peer process that [`paired_rounds`] times.
enum RoundTrip<'a> {
    /// A ractor_cluster RPC to the expert ([`ractor_ask_samples`]).
    Ractor(&'a ActorRef<HelloExpertMsg>),
    /// The same question on the service path: router, peer, service ([`service_ask_samples`]).
    Service(&'a Services, &'a NodeId, &'a str),
    /// The same question as a typed call ([`typed_call_samples`]).
    Typed(&'a ActorHandle<BenchEcho>),
}

impl RoundTrip<'_> {
    async fn samples(&self, n: usize) -> Result<Vec<f64>> {
        match *self {
            RoundTrip::Ractor(expert) => ractor_ask_samples(expert, n).await,
            RoundTrip::Service(services, peer, service) => {
                service_ask_samples(services, peer, service, n).await
            }
            RoundTrip::Typed(echo) => typed_call_samples(echo, n).await,
        }
    }
}

/// One kind of round trip over all rounds: every sample (us), and each round's median.
#[derive(Default)]
struct Series {
    samples: Vec<f64>,
    round_p50: Vec<f64>,
}

impl Series {
    /// Quantile `q` of every sample.
    fn p(&mut self, q: f64) -> f64 {
        quantile(&mut self.samples, q)
    }

    /// The median over rounds of this round's median over `base`'s in the same round.
    fn over(&self, base: &Series) -> f64 {
        let mut r: Vec<f64> = self.round_p50.iter().zip(&base.round_p50).map(|(a, b)| a / b).collect();
        median(&mut r)
    }
}

/// `rounds` rounds of `per_round` raw UDP round trips to the peer process's echo, then as many
/// of each of `trips`, in that order; the UDP series and one per trip. Every ratio of
/// [`Series::over`] pairs rounds, so a stretch of a busy machine lands on both sides of it.
async fn paired_rounds<const N: usize>(
    udp_echo: SocketAddr,
    trips: [RoundTrip<'_>; N],
    rounds: usize,
    per_round: usize,
) -> Result<(Series, [Series; N])> {
    let mut udp = Series::default();
    let mut series: [Series; N] = std::array::from_fn(|_| Series::default());
    for _ in 0..rounds {
        let mut u = udp_rtt_samples(udp_echo, per_round)?;
        udp.round_p50.push(median(&mut u));
        udp.samples.extend(u);
        for (trip, s) in trips.iter().zip(series.iter_mut()) {
            let mut x = trip.samples(per_round).await?;
            s.round_p50.push(median(&mut x));
            s.samples.extend(x);
        }
    }
    Ok((udp, series))
}

/// `n` typed tells to the peer's [`BenchEcho`], then a [`Count`] call from the same handle (it
/// is answered after the tells before it): tells per second until it has counted them all.
async fn typed_tells(echo: &ActorHandle<BenchEcho>, n: u64) -> Result<f64> {
    let before = echo.call(Count, Duration::from_secs(10)).await?;
    let start = Instant::now();
    for _ in 0..n {
        echo.tell(Tell(1)).await?;
    }
    let total = echo.call(Count, Duration::from_secs(120)).await?;
    let secs = start.elapsed().as_secs_f64();
    if total != before + n {
        bail!("the peer's typed actor counted {} of {n} tells", total - before);
    }
    Ok(n as f64 / secs)
}

/// Name of the child the remote restart figure supervises.
const MOVING: &str = "bench-moving";

/// A placement host process named `bench-host-N`, dialled by `node` and announced to it.
async fn start_host(ca: &ClusterCa, node: &NodeRuntime, n: usize) -> Result<(NodeId, PeerProcess)> {
    let name = format!("bench-host-{n}");
    let host = PeerProcess::start(&bench_exe()?, ca, &name, true).await?;
    let [addr] = host.addrs[..] else { bail!("expected one address from {name}: {:?}", host.addrs) };
    let id = NodeId::new(&name);
    node.link.connect(addr, &id).await?;
    node.services
        .wait_for(Duration::from_secs(20), |s| s.providers(PLACEMENT).contains(&id).then_some(()))
        .await
        .with_context(|| format!("{name} did not announce {PLACEMENT} within 20 s"))?;
    Ok((id, host))
}

/// A [`RemoteSupervisor`](troupe_actors::typed::RemoteSupervisor) on `node` owns one
/// [`BenchEcho`] placed on one of two host processes. Each round SIGKILLs the process hosting it
/// and times from the kill to the first answer of the replacement on the other host (to the
/// same handle, which resolves the name again); a fresh host then joins for the next round.
/// The kills fall at phases spread evenly over one `heartbeat` period (the membership's tick),
/// as a crash would fall anywhere in it. Median ms.
async fn remote_restart(
    ca: &ClusterCa,
    node: &NodeRuntime,
    rounds: usize,
    heartbeat: Duration,
) -> Result<f64> {
    let mut hosts = Vec::new();
    for n in 0..2 {
        hosts.push(start_host(ca, node, n).await?);
    }
    let child = RemoteChild::new::<BenchEcho>(MOVING, &())?;
    // the benchmark takes the child's node away `rounds` times on purpose
    let intensity = Intensity { max_restarts: rounds as u32 + 1, period: Duration::from_secs(3600) };
    let supervisor = node.supervise_remote("bench-movers", vec![child], intensity).await?;
    let moving = node.actors.wait_for::<BenchEcho>(MOVING, Duration::from_secs(20)).await?;
    let question = || Ask("ping".to_string());
    moving.call(question(), Duration::from_secs(5)).await?;
    let mut samples = Vec::with_capacity(rounds);
    for round in 0..rounds {
        let at = moving.node().context("the handle lost the child before the kill")?;
        let i =
            hosts.iter().position(|(id, _)| *id == at).with_context(|| format!("the child runs on {at}"))?;
        let (killed, mut process) = hosts.swap_remove(i);
        // not phase-locked to the ticks: each round would otherwise kill a fixed time after the
        // tick that declared the previous host down, just after the replacement's answer, the
        // last frame heard from the victim (detection then takes timeout + heartbeat - that time)
        tokio::time::sleep(heartbeat.mul_f64(1.0 + (round as f64 + 0.5) / rounds as f64)).await;
        let start = Instant::now();
        process.start_kill().context("killing the child's host")?;
        loop {
            // the call to the killed node fails once, then the handle waits for the replacement
            let waiting = |e: &ActorError| {
                matches!(
                    e,
                    ActorError::PeerLost { .. }
                        | ActorError::UnknownActor { .. }
                        | ActorError::Timeout { .. }
                )
            };
            match moving.call(question(), Duration::from_secs(10)).await {
                Ok(_) if moving.node().is_some_and(|n| n != killed) => break,
                Ok(_) => bail!("{killed} answered after it was killed"),
                Err(e) if waiting(&e) && start.elapsed() < Duration::from_secs(30) => {}
                Err(e) => return Err(e).context(format!("round {round}: the replacement of {MOVING}")),
            }
        }
        samples.push(start.elapsed().as_secs_f64() * 1e3);
        process.reap().await;
        // Workaround: the killed host's QUIC connection stays open until its idle timeout (10 s),
        // and `RemoteSupervisor` forgets that a node is down when any member comes up while the
        // dead one is still connected (it keeps as down only nodes no longer in `link.peers()`);
        // its next placement then asks the dead node for room and waits out the 2 s capacity
        // timeout. Dropping the connection, after the round is timed, keeps the next round clean.
        node.link.disconnect(&killed, "killed by the benchmark");
        hosts.push(start_host(ca, node, round + 2).await?);
    }
    supervisor.stop(None);
    for (_, host) in hosts {
        let _ = host.stop().await;
    }
    Ok(median(&mut samples))
}

/// Casts `n` messages to the peer's sink and waits until it counted them all; casts per second.
async fn remote_tells(n: u64) -> Result<f64> {
    let sink: ActorRef<SinkMsg> = remote_member(SINK_GROUP, None).await?.into();
    let before = ractor::call_t!(sink, SinkMsg::Total, 10_000, 0)?;
    let start = Instant::now();
    for _ in 0..n {
        sink.cast(SinkMsg::Add(1))?;
    }
    let total = ractor::call_t!(sink, SinkMsg::Total, 120_000, 0)?;
    let secs = start.elapsed().as_secs_f64();
    if total != before + n {
        bail!("the remote sink counted {} of {n} casts", total - before);
    }
    Ok(n as f64 / secs)
}

/// Tells a local watcher's channel whenever a process group it monitors gains members.
struct GroupWatch;

#[derive(RactorMessage)]
enum WatchMsg {}

impl Actor for GroupWatch {
    type Msg = WatchMsg;
    type State = mpsc::UnboundedSender<()>;
    type Arguments = (String, mpsc::UnboundedSender<()>);

    async fn pre_start(
        &self,
        me: ActorRef<Self::Msg>,
        (group, tx): Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        ractor::pg::monitor(group, me.get_cell());
        Ok(tx)
    }

    async fn handle_supervisor_evt(
        &self,
        _: ActorRef<Self::Msg>,
        evt: SupervisionEvent,
        tx: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        if let SupervisionEvent::ProcessGroupChanged(GroupChangeMessage::Join(..)) = evt {
            let _ = tx.send(());
        }
        Ok(())
    }
}

/// The peer's crashing actor panics `rounds` times; median ms from the crash order to the first
/// reply from the new incarnation (found through its process group, as any client would).
async fn restart_to_service(rounds: usize) -> Result<f64> {
    let (tx, mut joined) = mpsc::unbounded_channel();
    let (watch, watch_handle) = Actor::spawn(None, GroupWatch, (CRASHY_GROUP.to_string(), tx)).await?;
    let mut samples = Vec::with_capacity(rounds);
    let mut current = remote_member(CRASHY_GROUP, None).await?;
    for i in 0..rounds as u64 {
        let old: ActorRef<CrashyMsg> = current.clone().into();
        ractor::call_t!(old, CrashyMsg::Ping, 5000, i)?; // it serves before the crash
        while joined.try_recv().is_ok() {}
        let start = Instant::now();
        old.cast(CrashyMsg::Crash(i))?;
        let deadline = start + Duration::from_secs(10);
        current = loop {
            if Instant::now() > deadline {
                bail!("the crashed actor was not back in service within 10 s");
            }
            let _ = tokio::time::timeout(Duration::from_millis(2), joined.recv()).await;
            let candidate = ractor::pg::get_members(&CRASHY_GROUP.to_string())
                .into_iter()
                .find(|c| !c.get_id().is_local() && c.get_id() != current.get_id());
            if let Some(c) = candidate {
                let r: ActorRef<CrashyMsg> = c.clone().into();
                if matches!(ractor::call_t!(r, CrashyMsg::Ping, 1000, i), Ok(x) if x == i) {
                    samples.push(start.elapsed().as_secs_f64() * 1e3);
                    break c;
                }
            }
        };
    }
    watch.stop(None);
    let _ = watch_handle.await;
    Ok(median(&mut samples))
}

/// `rounds` raw 64 B UDP round trips to the peer process's echo, in microseconds each.
fn udp_rtt_samples(echo: SocketAddr, rounds: usize) -> Result<Vec<f64>> {
    let a = UdpSocket::bind("127.0.0.1:0")?;
    a.connect(echo)?;
    a.set_read_timeout(Some(Duration::from_secs(2)))?;
    let msg = [7u8; 64];
    let mut buf = [0u8; 64];
    let mut samples = Vec::with_capacity(rounds);
    for i in 0..rounds + WARM_UP {
        let t = Instant::now();
        a.send(&msg)?;
        a.recv(&mut buf)?;
        if i >= WARM_UP {
            samples.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    Ok(samples)
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

//! Real QUIC on loopback: mutual TLS against the cluster CA, the hello, channels, bad input.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use quinn::crypto::rustls::QuicClientConfig;
use troupe_transport::frame::{FrameHeader, HEADER_LEN};
use troupe_transport::identity::{ALPN, crypto_provider};
use troupe_transport::{Channel, ClusterCa, Frame, FrameKind, Link, NodeId, PeerEvent, QuicConfig, QuicNode};

async fn node(ca: &ClusterCa, name: &str) -> QuicNode {
    QuicNode::bind(&ca.issue_node(name).unwrap(), QuicConfig::default()).await.unwrap()
}

/// Waits (bounded) for the first event matching `want`.
async fn wait_event(
    rx: &mut tokio::sync::mpsc::Receiver<PeerEvent>,
    want: impl Fn(&PeerEvent) -> bool,
) -> PeerEvent {
    tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let ev = rx.recv().await.expect("event stream ended");
            if want(&ev) {
                return ev;
            }
        }
    })
    .await
    .expect("event did not arrive within 10 s")
}

#[tokio::test]
async fn mutual_tls_hello_and_channels() {
    let ca = ClusterCa::generate("t").unwrap();
    let a = node(&ca, "node-a").await;
    let b = node(&ca, "node-b").await;
    let mut b_events = b.events().unwrap();
    let peer = a.connect(b.local_addr().unwrap(), &NodeId::new("node-b")).await.unwrap();
    assert_eq!(peer.as_str(), "node-b");
    wait_event(&mut b_events, |e| matches!(e, PeerEvent::Joined { peer, .. } if peer.as_str() == "node-a"))
        .await;
    assert_eq!(b.peers(), vec![NodeId::new("node-a")]);

    for (i, ch) in Channel::ALL.iter().enumerate() {
        a.send(&peer, *ch, Frame::from_bytes(FrameKind::Message, 0, &[i as u8; 100])).await.unwrap();
    }
    let mut seen = Vec::new();
    for _ in 0..3 {
        let d = b.recv().await.unwrap();
        assert_eq!(d.from.as_str(), "node-a");
        assert_eq!(d.frame.body.len(), 100);
        seen.push((d.channel, d.frame.body[0]));
    }
    seen.sort();
    assert_eq!(seen, vec![(Channel::Control, 0), (Channel::Data, 1), (Channel::Blob, 2)]);
    // and back, on the same connection
    b.send(&NodeId::new("node-a"), Channel::Data, Frame::from_bytes(FrameKind::Message, 0, b"pong"))
        .await
        .unwrap();
    assert_eq!(&a.recv().await.unwrap().frame.body[..], b"pong");
}

#[tokio::test]
async fn certificate_from_another_ca_is_refused() {
    let ca = ClusterCa::generate("home").unwrap();
    let other = ClusterCa::generate("elsewhere").unwrap();
    let server = node(&ca, "server").await;
    let mut events = server.events().unwrap();
    let intruder = node(&other, "intruder").await;
    let err = intruder.connect(server.local_addr().unwrap(), &NodeId::new("server")).await.unwrap_err();
    // the client cannot verify the server either (different CA): it fails on its side
    assert!(err.to_string().contains("connect to"), "{err}");
    // a node of another CA that trusts ours still has its certificate refused by the server
    let ev = wait_event(&mut events, |e| matches!(e, PeerEvent::Refused { .. })).await;
    let PeerEvent::Refused { reason, .. } = ev else { unreachable!() };
    assert!(reason.to_lowercase().contains("cert") || reason.contains("alert"), "{reason}");
    assert!(server.peers().is_empty());
}

#[tokio::test]
async fn client_without_certificate_is_refused() {
    let ca = ClusterCa::generate("home").unwrap();
    let server = node(&ca, "server").await;
    let mut events = server.events().unwrap();
    // a client that trusts the CA but presents no certificate
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.issue_node("x").unwrap().ca.clone()).unwrap();
    let mut tls = rustls::ClientConfig::builder_with_provider(crypto_provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let cfg = quinn::ClientConfig::new(Arc::new(QuicClientConfig::try_from(tls).unwrap()));
    let ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    let outcome = async {
        let conn = ep.connect_with(cfg, server.local_addr().unwrap(), "server")?.await?;
        // the handshake may look complete to the client: the refusal shows on first use
        let (mut s, mut r) = conn.open_bi().await?;
        s.write_all(b"H").await?;
        let mut buf = [0u8; 1];
        r.read_exact(&mut buf).await?;
        Ok::<_, Box<dyn std::error::Error>>(())
    }
    .await;
    assert!(outcome.is_err(), "a client without a certificate got through");
    let ev = wait_event(&mut events, |e| matches!(e, PeerEvent::Refused { .. })).await;
    let PeerEvent::Refused { reason, .. } = ev else { unreachable!() };
    assert!(reason.to_lowercase().contains("certificate"), "{reason}");
    assert!(server.peers().is_empty());
}

#[tokio::test]
async fn bad_frames_stop_one_stream_and_the_node_keeps_serving() {
    let ca = ClusterCa::generate("t").unwrap();
    let server = node(&ca, "server").await;
    let bad = node(&ca, "bad").await;
    let good = node(&ca, "good").await;
    let addr = server.local_addr().unwrap();
    let s = NodeId::new("server");
    let mut events = server.events().unwrap();
    bad.connect(addr, &s).await.unwrap();
    good.connect(addr, &s).await.unwrap();

    let valid = Frame::from_bytes(FrameKind::Message, 0, b"ok").to_wire().unwrap();
    let mut wrong_magic = valid.clone();
    wrong_magic[0] = b'Z';
    let mut wrong_version = valid.clone();
    wrong_version[4] = 99;
    let oversized = FrameHeader { kind: FrameKind::Tensor, flags: 0, len: u32::MAX }.to_bytes();
    let garbage: Vec<u8> = (0..500u32).map(|i| (i * 7919 % 251) as u8).collect();
    let truncated = &valid[..HEADER_LEN + 1];
    for bytes in [&wrong_magic[..], &wrong_version[..], &oversized[..], &garbage[..], truncated] {
        bad.send_raw(&s, Channel::Data as u8, bytes).await.unwrap();
    }
    bad.send_raw(&s, 0xEE, &valid).await.unwrap();
    let mut details = Vec::new();
    while details.len() < 6 {
        if let PeerEvent::BadStream { peer, detail } =
            wait_event(&mut events, |e| matches!(e, PeerEvent::BadStream { .. })).await
        {
            assert_eq!(peer.as_str(), "bad");
            details.push(detail);
        }
    }
    let all = details.join(" | ");
    for needle in
        ["bad magic", "protocol version 99", "exceeds the cap", "truncated frame", "unknown channel tag 0xee"]
    {
        assert!(all.contains(needle), "no error naming {needle:?} in {all}");
    }

    // the server still serves both peers, on the same connections
    good.send(&s, Channel::Data, Frame::from_bytes(FrameKind::Message, 0, b"from good")).await.unwrap();
    bad.send(&s, Channel::Data, Frame::from_bytes(FrameKind::Message, 0, b"from bad")).await.unwrap();
    let mut got = Vec::new();
    for _ in 0..2 {
        let d = tokio::time::timeout(Duration::from_secs(10), server.recv()).await.unwrap().unwrap();
        got.push(String::from_utf8(d.frame.body.to_vec()).unwrap());
    }
    got.sort();
    assert_eq!(got, vec!["from bad".to_string(), "from good".to_string()]);
    assert_eq!(server.peers(), vec![NodeId::new("bad"), NodeId::new("good")]);
}

#[tokio::test]
async fn blob_pull_verifies_the_hash() {
    struct One(Vec<u8>);
    impl troupe_transport::quic::BlobServer for One {
        fn blob(&self, id: &[u8; 32]) -> Option<Arc<Vec<u8>>> {
            (blake3::hash(&self.0).as_bytes() == id).then(|| Arc::new(self.0.clone()))
        }
    }
    let ca = ClusterCa::generate("t").unwrap();
    let a = node(&ca, "a").await;
    let b = node(&ca, "b").await;
    let bytes: Vec<u8> = (0..3_000_000u32).map(|i| (i % 253) as u8).collect();
    b.set_blob_server(Arc::new(One(bytes.clone())));
    let peer = a.connect(b.local_addr().unwrap(), &NodeId::new("b")).await.unwrap();
    let id = *blake3::hash(&bytes).as_bytes();
    assert_eq!(a.fetch_blob(&peer, id, 8 << 20).await.unwrap(), bytes);
    let e = a.fetch_blob(&peer, [7u8; 32], 8 << 20).await.unwrap_err();
    assert!(e.to_string().contains("no blob"), "{e}");
    let e = a.fetch_blob(&peer, id, 1 << 20).await.unwrap_err();
    assert!(e.to_string().contains("exceeds the cap"), "{e}");
}

#[tokio::test]
async fn large_tensor_travels_by_reference_and_arrives_intact() {
    use std::sync::Mutex;
    use troupe_transport::codec::{TensorEncodeOptions, TensorEncoder, decode_tensor};
    use troupe_transport::frame::FLAG_BY_REFERENCE;
    use troupe_transport::{BlobPolicy, BlobStore, TensorLimits};

    let ca = ClusterCa::generate("t").unwrap();
    let a = node(&ca, "a").await;
    let b = node(&ca, "b").await;
    let a_store = Arc::new(Mutex::new(BlobStore::in_memory(64 << 20)));
    a.set_blob_server(a_store.clone());
    let peer = a.connect(b.local_addr().unwrap(), &NodeId::new("b")).await.unwrap();
    let data: Vec<f32> = (0..(1 << 20)).map(|i| ((i as f32) * 0.37).sin()).collect(); // 4 MiB
    let (frame, _) =
        TensorEncoder::new(TensorEncodeOptions::default()).encode_frame(&[1024, 1024], &data).unwrap();
    let policy = BlobPolicy::default();
    a.send_with_policy(&peer, Channel::Data, frame, &policy, &a_store).await.unwrap();
    let d = b.recv().await.unwrap();
    assert_ne!(d.frame.flags & FLAG_BY_REFERENCE, 0, "a 4 MiB tensor must travel by reference");
    assert!(d.frame.body.len() < 1024, "the inline part is just the reference");
    let b_cache = Mutex::new(BlobStore::in_memory(64 << 20));
    let resolved = b.resolve(d, &policy, &b_cache).await.unwrap();
    let t = decode_tensor(&resolved, &TensorLimits::default()).unwrap();
    assert_eq!(t.data, data);
    assert_eq!(b_cache.lock().unwrap().len(), 1, "the pulled blob is cached by hash");
    // a small tensor goes inline
    let (small, _) =
        TensorEncoder::new(TensorEncodeOptions::default()).encode_frame(&[4], &[1.0, 2.0, 3.0, 4.0]).unwrap();
    a.send_with_policy(&peer, Channel::Data, small, &policy, &a_store).await.unwrap();
    let d = b.recv().await.unwrap();
    assert_eq!(d.frame.flags & FLAG_BY_REFERENCE, 0);
}

/// The events `rx` gives up to and including the next `Joined` of `name` (bounded wait).
async fn events_until_joined(rx: &mut tokio::sync::mpsc::Receiver<PeerEvent>, name: &str) -> Vec<PeerEvent> {
    tokio::time::timeout(Duration::from_secs(10), async {
        let mut seen = Vec::new();
        loop {
            let ev = rx.recv().await.expect("event stream ended");
            let joined = matches!(&ev, PeerEvent::Joined { peer, .. } if peer.as_str() == name);
            seen.push(ev);
            if joined {
                return seen;
            }
        }
    })
    .await
    .expect("no Joined within 10 s")
}

fn restarted(events: &[PeerEvent], name: &str) -> bool {
    events.iter().any(|e| matches!(e, PeerEvent::Restarted { peer } if peer.as_str() == name))
}

/// A peer that dials again from the same process replaces its connection quietly; one that comes
/// back as a new process under the same name (a new endpoint, so a new incarnation in its hello)
/// is reported as restarted, before it is reported as joined.
#[tokio::test]
async fn a_new_incarnation_under_the_same_name_is_reported_as_restarted() {
    let ca = ClusterCa::generate("t").unwrap();
    let b = node(&ca, "b").await;
    let mut events = b.events().unwrap();
    let a = node(&ca, "a").await;
    a.connect(b.local_addr().unwrap(), &NodeId::new("b")).await.unwrap();
    assert!(!restarted(&events_until_joined(&mut events, "a").await, "a"), "a first join is no restart");
    a.connect(b.local_addr().unwrap(), &NodeId::new("b")).await.unwrap();
    let again = events_until_joined(&mut events, "a").await;
    assert!(!restarted(&again, "a"), "the same process dialing again is no restart: {again:?}");
    let a_again = node(&ca, "a").await;
    a_again.connect(b.local_addr().unwrap(), &NodeId::new("b")).await.unwrap();
    let reborn = events_until_joined(&mut events, "a").await;
    assert!(restarted(&reborn, "a"), "a new process under the name must be reported: {reborn:?}");
    assert_eq!(b.peers(), vec![NodeId::new("a")]);
}

/// Loopback's MTU is 64 KiB: MTU discovery goes past the 6500 bytes that ten GSO datagrams
/// allowed, the oversized batches are cut into sends the kernel accepts (`datagram`), and a
/// frame of many datagrams arrives intact.
#[tokio::test]
async fn loopback_carries_large_datagrams_and_frames_arrive_intact() {
    let ca = ClusterCa::generate("t").unwrap();
    let a = node(&ca, "a").await;
    let b = node(&ca, "b").await;
    let peer = a.connect(b.local_addr().unwrap(), &NodeId::new("b")).await.unwrap();
    let body: Vec<u8> = (0..16u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect();
    for _ in 0..2 {
        a.send(&peer, Channel::Data, Frame::from_bytes(FrameKind::Tensor, 0, &body)).await.unwrap();
        let d = tokio::time::timeout(Duration::from_secs(60), b.recv())
            .await
            .expect("frame within 60 s")
            .unwrap();
        assert!(d.frame.body[..] == body[..], "the 16 MiB frame arrived altered");
    }
    let mtu = a.connection_stats(&peer).expect("connection stats").path.current_mtu;
    assert!(mtu > 6500, "path MTU {mtu} on loopback: discovery stopped at the old cap");
}

#[tokio::test]
async fn a_peer_over_its_memory_budget_is_cut_off_and_other_peers_are_served() {
    use troupe_transport::FrameLimits;

    let ca = ClusterCa::generate("t").unwrap();
    let cap = 8u64 << 20;
    let cfg = QuicConfig {
        conn_budget: cap,
        limits: FrameLimits { max_body: 4 << 20 },
        max_uni_streams: 4,
        ..QuicConfig::default()
    };
    let victim = QuicNode::bind(&ca.issue_node("victim").unwrap(), cfg).await.unwrap();
    let addr = victim.local_addr().unwrap();
    let v = NodeId::new("victim");
    let mut events = victim.events().unwrap();
    let mallory = node(&ca, "mallory").await;
    let mut mallory_events = mallory.events().unwrap();
    let good = node(&ca, "good").await;
    mallory.connect(addr, &v).await.unwrap();
    good.connect(addr, &v).await.unwrap();

    // 1. Frames received but not consumed count: nobody reads the victim's inbox, so two
    // complete 3 MiB frames stay queued (6 MiB) and the third cannot arrive next to them.
    let big = Frame::from_bytes(FrameKind::Message, 0, &vec![0xAB; 3 << 20]);
    for _ in 0..3 {
        // the third may fail once the victim closes the connection
        let _ = mallory.send(&v, Channel::Data, big.clone()).await;
    }
    let ev = wait_event(&mut events, |e| matches!(e, PeerEvent::OverBudget { .. })).await;
    let PeerEvent::OverBudget { peer, cap: got_cap, held } = ev else { unreachable!() };
    assert_eq!((peer.as_str(), got_cap), ("mallory", cap));
    assert!(held >= 6 << 20, "held {held}: the queued frames were not counted");
    let ev = wait_event(&mut mallory_events, |e| matches!(e, PeerEvent::Left { .. })).await;
    let PeerEvent::Left { reason, .. } = ev else { unreachable!() };
    assert!(reason.contains("per-connection cap of 8388608 bytes"), "{reason}");

    // The other peer is still served; the frames accepted before the cut-off are delivered.
    good.send(&v, Channel::Data, Frame::from_bytes(FrameKind::Message, 0, b"still here")).await.unwrap();
    let mut from_mallory = 0;
    loop {
        let d = tokio::time::timeout(Duration::from_secs(10), victim.recv()).await.unwrap().unwrap();
        if d.from.as_str() == "good" {
            assert_eq!(&d.frame.body[..], b"still here");
            break;
        }
        assert_eq!(d.frame.body.len(), 3 << 20);
        from_mallory += 1;
    }
    assert_eq!(from_mallory, 2, "the two frames accepted before the cut-off");

    // 2. Frames being received count: every stream the peer may open announces a maximum-size
    // frame and gets bytes in small pieces, never finishing (4 x 4 MiB could be held).
    mallory.connect(addr, &v).await.unwrap();
    let mut streams = Vec::new();
    for _ in 0..4 {
        let mut s = mallory.open_raw(&v, Channel::Data as u8).await.unwrap();
        s.write_all(&FrameHeader { kind: FrameKind::Tensor, flags: 0, len: 4 << 20 }.to_bytes())
            .await
            .unwrap();
        streams.push(s);
    }
    // Writes complete into QUIC's send buffer: what ends the loop early is the close arriving.
    let piece = vec![0x5Au8; 64 << 10];
    let mut write_error = None;
    'send: for _ in 0..(4 << 20) / piece.len() - 1 {
        // at most one piece short of finishing every frame
        for s in &mut streams {
            if let Err(e) = s.write_all(&piece).await {
                write_error = Some(e);
                break 'send;
            }
        }
    }
    let ev = wait_event(&mut events, |e| matches!(e, PeerEvent::OverBudget { .. })).await;
    assert!(matches!(ev, PeerEvent::OverBudget { cap: c, .. } if c == cap), "{ev:?}");
    let ev = wait_event(&mut mallory_events, |e| matches!(e, PeerEvent::Left { .. })).await;
    let PeerEvent::Left { reason, .. } = ev else { unreachable!() };
    assert!(reason.contains("per-connection cap"), "{reason}");
    println!("trickling peer cut off: {reason} (write error: {write_error:?})");
    good.send(&v, Channel::Data, Frame::from_bytes(FrameKind::Message, 0, b"again")).await.unwrap();
    let d = tokio::time::timeout(Duration::from_secs(10), victim.recv()).await.unwrap().unwrap();
    assert_eq!((d.from.as_str(), &d.frame.body[..]), ("good", &b"again"[..]));
}

#[tokio::test]
async fn connections_without_a_hello_are_capped_and_closed_at_the_deadline() {
    let ca = ClusterCa::generate("t").unwrap();
    let cfg = QuicConfig {
        max_pending_hellos: 1,
        // only has to outlast one handshake on loopback
        hello_timeout: Duration::from_secs(2),
        ..QuicConfig::default()
    };
    let server = QuicNode::bind(&ca.issue_node("server").unwrap(), cfg).await.unwrap();
    let addr = server.local_addr().unwrap();
    let mut events = server.events().unwrap();
    // a client with a valid certificate that completes the handshake and never says hello
    let silent = ca.issue_node("silent").unwrap();
    let client_cfg = silent.client_config(Arc::new(quinn::TransportConfig::default())).unwrap();
    let ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    let first = ep.connect_with(client_cfg.clone(), addr, "server").unwrap().await.unwrap();
    // while it waits, a second one is closed as soon as its certificate is verified
    let second = ep.connect_with(client_cfg, addr, "server").unwrap().await.unwrap();
    let closed = second.closed().await;
    assert!(closed.to_string().contains("already waiting for their hello"), "{closed}");
    // the silent one is closed at the deadline, naming why; the node reported both
    let mut reasons = Vec::new();
    for _ in 0..2 {
        if let PeerEvent::Refused { reason, .. } =
            wait_event(&mut events, |e| matches!(e, PeerEvent::Refused { .. })).await
        {
            reasons.push(reason);
        }
    }
    reasons.sort();
    assert!(reasons[0].contains("already waiting for their hello"), "{reasons:?}");
    assert!(reasons[1].contains("no hello within 2s"), "{reasons:?}");
    let closed = first.closed().await;
    assert!(closed.to_string().contains("no hello"), "{closed}");
    // and a node that does say hello gets in
    let good = node(&ca, "good").await;
    good.connect(addr, &NodeId::new("server")).await.unwrap();
}

#[tokio::test]
async fn blob_replies_a_peer_leaves_unread_count_against_its_budget() {
    use std::sync::Mutex;
    use troupe_transport::blob::request_frame;
    use troupe_transport::frame::{read_frame, write_frame};
    use troupe_transport::{BlobStore, FrameLimits};

    let ca = ClusterCa::generate("t").unwrap();
    let cfg = QuicConfig { conn_budget: 48 << 20, ..QuicConfig::default() };
    let server = QuicNode::bind(&ca.issue_node("server").unwrap(), cfg).await.unwrap();
    let store = Arc::new(Mutex::new(BlobStore::in_memory(64 << 20)));
    // Larger than a stream's receive window (16 MiB in transport_config): a reply the puller
    // does not read cannot be fully delivered, so the server keeps it (and its charge).
    let blob: Vec<u8> = (0..20u32 << 20).map(|i| (i % 251) as u8).collect();
    let id = store.lock().unwrap().put(blob.clone()).unwrap();
    server.set_blob_server(store);
    let puller = node(&ca, "puller").await;
    let s = NodeId::new("server");
    puller.connect(server.local_addr().unwrap(), &s).await.unwrap();
    let limits = FrameLimits::default();
    let ask = async || {
        let (mut send, mut recv) = puller.open_raw_bi(&s, 0x42).await.unwrap();
        write_frame(&mut send, &request_frame(id).unwrap()).await.unwrap();
        send.finish().unwrap();
        // the first bytes of the answer: the server has decided (and charged) by then
        let mut head = [0u8; HEADER_LEN];
        recv.read_exact(&mut head).await.unwrap();
        (head, recv)
    };
    // two 20 MiB replies left unread hold 40 MiB of the peer's 48 MiB
    let (head1, mut r1) = ask().await;
    let (head2, mut r2) = ask().await;
    let (head3, mut r3) = ask().await;
    let kinds: Vec<u8> = [head1, head2, head3].iter().map(|h| h[5]).collect();
    assert_eq!(kinds, vec![FrameKind::BlobData as u8, FrameKind::BlobData as u8, FrameKind::Error as u8]);
    let mut rest = Vec::new();
    r3.read_to_end(1 << 16).await.map(|b| rest = b).unwrap();
    let text = String::from_utf8_lossy(&rest);
    assert!(text.contains("not served now") && text.contains("per-connection cap of 50331648"), "{text}");
    // reading the replies releases the charge: the next pull is served
    for (head, r) in [(head1, &mut r1), (head2, &mut r2)] {
        let mut wire = head.to_vec();
        wire.extend(r.read_to_end(32 << 20).await.unwrap());
        let mut cursor = &wire[..];
        let f = read_frame(&mut cursor, &limits).await.unwrap().unwrap();
        assert!(f.body.len() > blob.len());
    }
    // (the server releases a reply's charge when the puller's acknowledgement of its last bytes
    // arrives, which may come after the next request: a refused pull is retried, boundedly)
    let mut refused = 0;
    let got = loop {
        match puller.fetch_blob(&s, id.0, 32 << 20).await {
            Ok(b) => break b,
            Err(e) if e.to_string().contains("not served now") && refused < 1000 => refused += 1,
            Err(e) => panic!("{e} after {refused} refusals"),
        }
    };
    assert_eq!(got, blob);
    // and the puller's side: a reply bigger than its own budget for the server's connection fails,
    // naming the budget, and the connection stays up
    let small = QuicNode::bind(
        &ca.issue_node("small").unwrap(),
        QuicConfig { conn_budget: 8 << 20, ..QuicConfig::default() },
    )
    .await
    .unwrap();
    small.connect(server.local_addr().unwrap(), &s).await.unwrap();
    let e = small.fetch_blob(&s, id.0, 32 << 20).await.unwrap_err();
    assert!(e.to_string().contains("per-connection cap of 8388608 bytes"), "{e}");
    small.send(&s, Channel::Data, Frame::from_bytes(FrameKind::Message, 0, b"still up")).await.unwrap();
}

#[tokio::test]
async fn a_peer_cannot_grow_the_event_channel() {
    use troupe_transport::quic::EVENT_CAPACITY;

    let ca = ClusterCa::generate("t").unwrap();
    let server = node(&ca, "server").await;
    let addr = server.local_addr().unwrap();
    let s = NodeId::new("server");
    // taken but not read while the peer floods
    let mut events = server.events().unwrap();
    let bad = node(&ca, "bad").await;
    bad.connect(addr, &s).await.unwrap();
    let valid = Frame::from_bytes(FrameKind::Message, 0, b"x").to_wire().unwrap();
    let flood = EVENT_CAPACITY + 100;
    for _ in 0..flood {
        // each returns once the server stopped the stream (and tried to report it)
        bad.send_raw(&s, 0xEE, &valid).await.unwrap();
    }
    let dropped = server.events_dropped();
    assert!(
        dropped >= 100,
        "{dropped} events dropped of {flood} bad streams into a channel of {EVENT_CAPACITY}"
    );
    // what the channel holds is at most its capacity; once read, joins are reported again
    let mut held = 0;
    while events.try_recv().is_ok() {
        held += 1;
    }
    assert!(held <= EVENT_CAPACITY, "{held}");
    let good = node(&ca, "good").await;
    good.connect(addr, &s).await.unwrap();
    wait_event(&mut events, |e| matches!(e, PeerEvent::Joined { peer, .. } if peer.as_str() == "good")).await;
    good.send(&s, Channel::Data, Frame::from_bytes(FrameKind::Message, 0, b"served")).await.unwrap();
    let d = tokio::time::timeout(Duration::from_secs(10), server.recv()).await.unwrap().unwrap();
    assert_eq!((d.from.as_str(), &d.frame.body[..]), ("good", &b"served"[..]));
}

#[tokio::test]
async fn one_control_stream_per_connection() {
    use tokio::io::AsyncWriteExt;
    let ca = ClusterCa::generate("t").unwrap();
    let server = node(&ca, "server").await;
    let mut events = server.events().unwrap();
    // same-host streams off: this is the QUIC road (tests/local_streams.rs has the other)
    let quic_only = QuicConfig {
        shm: troupe_transport::ShmConfig { streams: false, ..Default::default() },
        ..QuicConfig::default()
    };
    let a = QuicNode::bind(&ca.issue_node("a").unwrap(), quic_only).await.unwrap();
    let s = a.connect(server.local_addr().unwrap(), &NodeId::new("server")).await.unwrap();
    let first = a.open_control(&s).await.unwrap();
    assert!(!first.is_local());
    let (_first_recv, mut first) = first.into_split();
    first.write_all(b"session").await.unwrap();
    wait_event(&mut events, |e| matches!(e, PeerEvent::ControlStream { .. })).await;
    // a second session would buffer control-plane frames of its own: refused, connection kept
    let (_second_recv, mut second) = a.open_control(&s).await.unwrap().into_split();
    second.write_all(b"again").await.unwrap();
    let ev = wait_event(&mut events, |e| {
        matches!(e, PeerEvent::BadStream { .. } | PeerEvent::ControlStream { .. })
    })
    .await;
    let PeerEvent::BadStream { peer, detail } = ev else {
        panic!("a second control stream was accepted: {ev:?}")
    };
    assert_eq!(peer.as_str(), "a");
    assert!(detail.contains("second control stream"), "{detail}");
    a.send(&s, Channel::Data, Frame::from_bytes(FrameKind::Message, 0, b"still up")).await.unwrap();
    let d = tokio::time::timeout(Duration::from_secs(10), server.recv()).await.unwrap().unwrap();
    assert_eq!(&d.frame.body[..], b"still up");
}

/// A tool's connection (`member: false`, as `troupe status` dials) is served but never joins
/// the control plane: its control stream is refused by name.
#[tokio::test]
async fn a_connection_that_is_not_a_member_cannot_open_a_control_stream() {
    let ca = ClusterCa::generate("t").unwrap();
    let server = node(&ca, "server").await;
    let mut events = server.events().unwrap();
    let tool = QuicNode::bind(
        &ca.issue_node("tool").unwrap(),
        QuicConfig { member: false, ..QuicConfig::default() },
    )
    .await
    .unwrap();
    let s = tool.connect(server.local_addr().unwrap(), &NodeId::new("server")).await.unwrap();
    let (mut send, _recv) = tool.open_raw_bi(&s, 0x43).await.unwrap();
    let _ = send.write_all(b"session").await; // the refusal may already have stopped it
    let ev = wait_event(&mut events, |e| {
        matches!(e, PeerEvent::BadStream { .. } | PeerEvent::ControlStream { .. })
    })
    .await;
    let PeerEvent::BadStream { peer, detail } = ev else {
        panic!("a control stream from a non-member was accepted: {ev:?}")
    };
    assert_eq!(peer.as_str(), "tool");
    assert!(detail.contains("not a member"), "{detail}");
}

#[tokio::test]
async fn service_frames_reach_the_sink_in_order_and_every_frame_marks_the_peer_heard() {
    let ca = ClusterCa::generate("t").unwrap();
    let a = node(&ca, "node-a").await;
    let b = node(&ca, "node-b").await;
    let (sink_tx, mut sunk) = tokio::sync::mpsc::unbounded_channel();
    b.set_service_sink(Arc::new(move |d| {
        let _ = sink_tx.send(d);
    }));
    let mut b_events = b.events().unwrap();
    let peer = a.connect(b.local_addr().unwrap(), &NodeId::new("node-b")).await.unwrap();
    let from_a = NodeId::new("node-a");
    wait_event(&mut b_events, |e| matches!(e, PeerEvent::Joined { peer, .. } if peer == &from_a)).await;
    let _ = b.take_heard(&from_a); // whatever the hello left set
    assert!(!b.take_heard(&from_a), "taking the flag clears it");
    for i in 0..5u8 {
        a.send(&peer, Channel::Data, Frame::from_bytes(FrameKind::Service, 0, &[i; 10])).await.unwrap();
    }
    a.send(&peer, Channel::Data, Frame::from_bytes(FrameKind::Message, 0, b"plain")).await.unwrap();
    // the plain frame comes through the inbox; the service frames sent before it went to the sink
    let plain = b.recv().await.unwrap();
    assert_eq!(&plain.frame.body[..], b"plain");
    for i in 0..5u8 {
        let d = tokio::time::timeout(Duration::from_secs(10), sunk.recv())
            .await
            .expect("sink not called")
            .unwrap();
        assert_eq!((d.from.as_str(), d.frame.kind, d.frame.body[0]), ("node-a", FrameKind::Service, i));
    }
    assert!(sunk.try_recv().is_err(), "only service frames reach the sink");
    assert!(b.take_heard(&from_a), "frames read from the peer mark it heard");
    assert!(!b.take_heard(&from_a));
    assert!(!b.take_heard(&NodeId::new("nobody")), "a peer not joined was never heard");
}

/// A port in use is named with its address, and the OS error is said once (no source chain
/// repeating it under `{:#}`).
#[tokio::test]
async fn binding_a_port_in_use_names_the_address_once() {
    let ca = ClusterCa::generate("bind").unwrap();
    let taken = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let e = QuicNode::bind(&ca.issue_node("b").unwrap(), QuicConfig { bind: addr, ..QuicConfig::default() })
        .await
        .err()
        .expect("a second bind of a port in use");
    let text = anyhow_like(&e);
    assert!(text.contains(&addr.to_string()), "{text}");
    assert_eq!(text.matches("os error").count(), 1, "{text}");
}

/// `{:#}` as anyhow prints it: the error, then each source.
fn anyhow_like(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text += &format!(": {s}");
        source = s.source();
    }
    text
}

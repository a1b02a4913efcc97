//! Same-host streams between two real QUIC endpoints of this host: every channel's frames go over
//! a Unix-domain stream once the same-host handshake passed, in order and alongside shared-memory
//! segments; a stream without the issued token is refused while the peer keeps being served; a
//! peer over its budget on a local stream is cut off by name; the control-plane stream takes the
//! same road, once per connection, and ends with it; and the path can be turned off.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::os::linux::net::SocketAddrExt;
use std::time::Duration;

use troupe_transport::local::{HELLO_LEN, HELLO_MAGIC};
use troupe_transport::{
    Channel, ClusterCa, Frame, FrameKind, FrameLimits, Link, NodeId, PeerEvent, QuicConfig, QuicNode,
    ShmConfig,
};

async fn node(ca: &ClusterCa, name: &str, config: QuicConfig) -> QuicNode {
    QuicNode::bind(&ca.issue_node(name).unwrap(), config).await.unwrap()
}

async fn pair(ca: &ClusterCa, a_config: QuicConfig, b_config: QuicConfig) -> (QuicNode, QuicNode, NodeId) {
    let a = node(ca, "local-a", a_config).await;
    let b = node(ca, "local-b", b_config).await;
    let peer = a.connect(b.local_addr().unwrap(), &NodeId::new("local-b")).await.unwrap();
    (a, b, peer)
}

async fn recv(node: &QuicNode) -> troupe_transport::Delivery {
    tokio::time::timeout(Duration::from_secs(10), node.recv()).await.expect("no frame within 10 s").unwrap()
}

fn numbered(i: u32) -> Frame {
    Frame::from_bytes(FrameKind::Message, 0, &i.to_le_bytes())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_channel_goes_over_local_streams_in_order_beside_segments() {
    let ca = ClusterCa::generate("t").unwrap();
    let (a, b, peer) = pair(&ca, QuicConfig::default(), QuicConfig::default()).await;
    let big: Vec<u8> = (0..(2u32 << 20)).map(|i| (i % 251) as u8).collect();
    for i in 0..500u32 {
        a.send(&peer, Channel::Data, numbered(i)).await.unwrap();
        if i == 250 {
            // a large body goes through a segment; its reference keeps its place in the stream
            a.send(&peer, Channel::Data, Frame::from_bytes(FrameKind::Tensor, 0, &big)).await.unwrap();
        }
    }
    a.send(&peer, Channel::Control, numbered(7)).await.unwrap();
    let mut next = 0u32;
    let mut saw_big = false;
    let mut saw_control = false;
    while next < 500 || !saw_big || !saw_control {
        let d = recv(&b).await;
        assert_eq!(d.from.as_str(), "local-a");
        match (d.channel, d.frame.kind) {
            (Channel::Control, _) => saw_control = true,
            (Channel::Data, FrameKind::Tensor) => {
                assert_eq!(next, 251, "the segment's frame arrived out of order");
                assert_eq!(blake3::hash(&d.frame.body), blake3::hash(&big));
                saw_big = true;
            }
            (Channel::Data, _) => {
                assert_eq!(u32::from_le_bytes(d.frame.body[..4].try_into().unwrap()), next);
                next += 1;
            }
            other => panic!("unexpected frame {other:?}"),
        }
    }
    let (sent, got) = (a.local_stats(), b.local_stats());
    assert_eq!(sent.opened, 2, "one local stream per channel used: {sent:?}");
    assert_eq!(got.accepted, 2, "{got:?}");
    assert_eq!(got.frames_received, 502, "{got:?}");
    assert_eq!(a.shm_stats().sent, 1, "the large body went through a segment");
    // answers take the local road back too
    b.send(&NodeId::new("local-a"), Channel::Data, numbered(9)).await.unwrap();
    assert_eq!(&recv(&a).await.frame.body[..], &9u32.to_le_bytes());
    assert_eq!(a.local_stats().frames_received, 1);
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_stream_without_the_issued_token_is_refused_and_the_peer_keeps_serving() {
    let ca = ClusterCa::generate("t").unwrap();
    let (a, b, peer) = pair(&ca, QuicConfig::default(), QuicConfig::default()).await;
    a.send(&peer, Channel::Data, numbered(1)).await.unwrap();
    recv(&b).await;
    let name = b.local_stream_name().expect("b listens for local streams");
    // a local process that knows the name but not the token b issued to a
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    let mut forger = std::os::unix::net::UnixStream::connect_addr(&addr).unwrap();
    let mut hello = [0u8; HELLO_LEN];
    hello[..8].copy_from_slice(&HELLO_MAGIC);
    hello[8..40].copy_from_slice(&[0x5a; 32]);
    hello[40] = Channel::Data as u8;
    forger.write_all(&hello).unwrap();
    let frame = numbered(666).to_wire().unwrap();
    // b drops the stream after the hello, so this write may fail; nothing of it may arrive
    let _ = forger.write_all(&frame);
    tokio::time::timeout(Duration::from_secs(10), async {
        while b.local_stats().refused == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the forged stream was not refused within 10 s");
    a.send(&peer, Channel::Data, numbered(2)).await.unwrap();
    let d = recv(&b).await;
    assert_eq!(d.from.as_str(), "local-a");
    assert_eq!(&d.frame.body[..], &2u32.to_le_bytes(), "the forged frame was delivered");
    assert_eq!(b.local_stats().accepted, 1);
    assert_eq!(b.peers(), vec![NodeId::new("local-a")]);
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_over_its_budget_on_a_local_stream_is_cut_off_by_name() {
    let ca = ClusterCa::generate("t").unwrap();
    // bodies stay inline on the local stream (no segments), the budget is below one frame
    let inline = ShmConfig { min_bytes: usize::MAX, ..ShmConfig::default() };
    let b_config = QuicConfig {
        conn_budget: 1 << 20,
        limits: FrameLimits { max_body: 8 << 20 },
        shm: inline.clone(),
        ..QuicConfig::default()
    };
    let (a, b, peer) = pair(&ca, QuicConfig { shm: inline, ..QuicConfig::default() }, b_config).await;
    let mut events = b.events().unwrap();
    a.send(&peer, Channel::Data, numbered(1)).await.unwrap();
    assert_eq!(&recv(&b).await.frame.body[..], &1u32.to_le_bytes());
    assert_eq!(b.local_stats().frames_received, 1, "the frame did not come on a local stream");
    let _ = a.send(&peer, Channel::Data, Frame::from_bytes(FrameKind::Tensor, 0, &vec![3u8; 2 << 20])).await;
    let (cap, held) = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if let Some(PeerEvent::OverBudget { peer, cap, held }) = events.recv().await {
                assert_eq!(peer.as_str(), "local-a");
                break (cap, held);
            }
        }
    })
    .await
    .expect("no over-budget event within 10 s");
    assert_eq!(cap, 1 << 20);
    assert!(held <= cap, "held {held} past the cap");
    a.shutdown().await;
    b.shutdown().await;
}

/// Waits (at most 10 s) for the first event `pick` takes.
async fn event<T>(
    events: &mut tokio::sync::mpsc::Receiver<PeerEvent>,
    mut pick: impl FnMut(PeerEvent) -> Option<T>,
) -> T {
    tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if let Some(t) = pick(events.recv().await.expect("event stream ended")) {
                break t;
            }
        }
    })
    .await
    .expect("no such event within 10 s")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_control_stream_goes_local_once_and_ends_with_its_connection() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let ca = ClusterCa::generate("t").unwrap();
    let (a, b, peer) = pair(&ca, QuicConfig::default(), QuicConfig::default()).await;
    let mut events = b.events().unwrap();
    let opened = a.open_control(&peer).await.unwrap();
    assert!(opened.is_local(), "the control stream to a same-host peer took QUIC");
    let (mut a_read, mut a_write) = opened.into_split();
    a_write.write_all(b"session").await.unwrap();
    let (from, accepted) = event(&mut events, |e| match e {
        PeerEvent::ControlStream { peer, stream } => Some((peer, stream)),
        _ => None,
    })
    .await;
    assert_eq!(from.as_str(), "local-a");
    assert!(accepted.is_local());
    assert_eq!((a.local_stats().control, b.local_stats().control), (1, 1));
    let (mut b_read, mut b_write) = accepted.into_split();
    let mut got = [0u8; 7];
    b_read.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"session");
    b_write.write_all(b"answer").await.unwrap();
    let mut back = [0u8; 6];
    a_read.read_exact(&mut back).await.unwrap();
    assert_eq!(&back, b"answer");
    // one control session per connection, whichever road the second one tries
    let (_second_read, mut second) = a.open_control(&peer).await.unwrap().into_split();
    let _ = second.write_all(b"again").await; // the refusal may already have closed it
    let detail = event(&mut events, |e| match e {
        PeerEvent::BadStream { detail, .. } => Some(detail),
        PeerEvent::ControlStream { .. } => panic!("a second control stream was accepted"),
        _ => None,
    })
    .await;
    assert!(detail.contains("second control stream"), "{detail}");
    // the stream lives no longer than the QUIC connection that vouched for it
    a.disconnect(&peer, "test over");
    let mut rest = Vec::new();
    let end = tokio::time::timeout(Duration::from_secs(10), b_read.read_to_end(&mut rest)).await;
    assert!(end.is_ok(), "the local control stream outlived its connection");
    assert!(rest.is_empty(), "{rest:?}");
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_off_on_either_side_keep_frames_on_quic() {
    let ca = ClusterCa::generate("t").unwrap();
    let off =
        QuicConfig { shm: ShmConfig { streams: false, ..ShmConfig::default() }, ..QuicConfig::default() };
    for (a_config, b_config) in [(off.clone(), QuicConfig::default()), (QuicConfig::default(), off.clone())] {
        let (a, b, peer) = pair(&ca, a_config, b_config).await;
        a.send(&peer, Channel::Data, numbered(5)).await.unwrap();
        assert_eq!(&recv(&b).await.frame.body[..], &5u32.to_le_bytes());
        assert!(!a.open_control(&peer).await.unwrap().is_local(), "the control stream took a local road");
        assert_eq!((a.local_stats().opened, a.local_stats().control), (0, 0));
        assert_eq!(b.local_stats().frames_received, 0);
        a.shutdown().await;
        b.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blob_pulls_between_same_host_peers_take_a_local_stream_within_the_budget() {
    use std::sync::{Arc, Mutex};
    use troupe_transport::BlobStore;
    let ca = ClusterCa::generate("t").unwrap();
    let small = QuicConfig { conn_budget: 8 << 20, ..QuicConfig::default() };
    let (a, b, peer) = pair(&ca, small, QuicConfig::default()).await;
    let store = Arc::new(Mutex::new(BlobStore::in_memory(64 << 20)));
    let blob: Vec<u8> = (0..(3u32 << 20)).map(|i| (i % 253) as u8).collect();
    let big: Vec<u8> = (0..(12u32 << 20)).map(|i| (i % 241) as u8).collect();
    let id = store.lock().unwrap().put(blob.clone()).unwrap();
    let big_id = store.lock().unwrap().put(big).unwrap();
    b.set_blob_server(store);
    // a first frame waits for the same-host handshake, so the pulls below know the local road
    a.send(&peer, Channel::Data, numbered(1)).await.unwrap();
    recv(&b).await;
    assert_eq!(a.fetch_blob(&peer, id.0, 8 << 20).await.unwrap(), blob);
    let e = a.fetch_blob(&peer, [7u8; 32], 8 << 20).await.unwrap_err();
    assert!(e.to_string().contains("no blob"), "{e}");
    let e = a.fetch_blob(&peer, id.0, 1 << 20).await.unwrap_err();
    assert!(e.to_string().contains("exceeds the cap"), "{e}");
    // a reply past the puller's own budget for the server's connection fails, naming the cap
    let e = a.fetch_blob(&peer, big_id.0, 16 << 20).await.unwrap_err();
    assert!(e.to_string().contains("per-connection cap of 8388608"), "{e}");
    assert_eq!(a.local_stats().blob_pulls, 4, "{:?}", a.local_stats());
    // the connection keeps serving
    assert_eq!(a.fetch_blob(&peer, id.0, 8 << 20).await.unwrap(), blob);
    a.shutdown().await;
    b.shutdown().await;
}

//! The same-host path between two real QUIC endpoints: a 64 MiB tensor crosses through a
//! `/dev/shm` segment bit-identically, bad segment frames are refused by name while the
//! connection keeps serving, a warm segment is reused, and no segment is left behind once the
//! connection is gone.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::time::Duration;

use troupe_transport::frame::FLAG_SHM;
use troupe_transport::shm::{SEGMENT_PREFIX, SHM_DIR, ShmRef};
use troupe_transport::{
    Channel, ClusterCa, Frame, FrameKind, FrameLimits, Link, NodeId, PeerEvent, QuicConfig, QuicNode,
    ShmConfig,
};

/// The tests of this file look at this process's segments in /dev/shm: run them one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn node(ca: &ClusterCa, name: &str, config: QuicConfig) -> QuicNode {
    QuicNode::bind(&ca.issue_node(name).unwrap(), config).await.unwrap()
}

/// Connects `a` to `b` and waits (bounded) until `a` sends to `b` through segments.
async fn same_host_pair(ca: &ClusterCa, config: QuicConfig) -> (QuicNode, QuicNode, NodeId) {
    let a = node(ca, "shm-a", config.clone()).await;
    let b = node(ca, "shm-b", config).await;
    let peer = a.connect(b.local_addr().unwrap(), &NodeId::new("shm-b")).await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), async {
        while !a.same_host(&peer) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the same-host path did not open within 10 s");
    (a, b, peer)
}

/// Segment files this process created that still exist.
fn own_segments() -> Vec<String> {
    let prefix = format!("{SEGMENT_PREFIX}{}-", std::process::id());
    std::fs::read_dir(SHM_DIR)
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .filter(|n| n.starts_with(&prefix))
        .collect()
}

fn pseudo_random(len: usize) -> Vec<u8> {
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    (0..len / 8)
        .flat_map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x.to_le_bytes()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tensor_of_64_mib_crosses_shared_memory_bit_identical_and_leaves_nothing() {
    let _serial = SERIAL.lock().await;
    let ca = ClusterCa::generate("t").unwrap();
    let (a, b, peer) = same_host_pair(&ca, QuicConfig::default()).await;
    let body = pseudo_random(64 << 20);
    let digest = blake3::hash(&body);
    a.send(&peer, Channel::Data, Frame::from_bytes(FrameKind::Tensor, 0, &body)).await.unwrap();
    drop(body);
    // a small frame behind it stays on the stream, in order
    a.send(&peer, Channel::Data, Frame::from_bytes(FrameKind::Message, 0, b"after")).await.unwrap();
    let d = tokio::time::timeout(Duration::from_secs(60), b.recv()).await.unwrap().unwrap();
    assert_eq!((d.frame.kind, d.frame.flags), (FrameKind::Tensor, 0));
    assert_eq!(d.frame.body.len(), 64 << 20);
    assert_eq!(blake3::hash(&d.frame.body), digest, "tensor changed on the same-host path");
    assert!(d.frame.body.is_mapped(), "the body was copied rather than mapped");
    // the body is a mapping of a's warm segment: dropping it gives the segment back
    drop(d);
    let d = tokio::time::timeout(Duration::from_secs(10), b.recv()).await.unwrap().unwrap();
    assert_eq!(&d.frame.body[..], b"after");
    assert_eq!(a.shm_stats().sent, 1, "the tensor did not take the same-host path");
    assert_eq!(b.shm_stats().received, 1);
    // what stays is a's warm segment, kept for the next tensor to this peer
    assert_eq!(own_segments().len(), 1, "segments after delivery: {:?}", own_segments());
    // a second tensor reuses it
    let body = pseudo_random(64 << 20);
    a.send(&peer, Channel::Data, Frame::from_bytes(FrameKind::Tensor, 0, &body)).await.unwrap();
    let d = tokio::time::timeout(Duration::from_secs(60), b.recv()).await.unwrap().unwrap();
    assert_eq!(blake3::hash(&d.frame.body), digest, "tensor changed in a reused segment");
    assert_eq!(own_segments().len(), 1, "the warm segment was not reused: {:?}", own_segments());
    assert_eq!(a.shm_stats().sent_reused, 1);
    drop(d);
    a.shutdown().await;
    assert!(own_segments().is_empty(), "segments left after shutdown: {:?}", own_segments());
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_held_by_the_receiver_keeps_its_segment_until_dropped() {
    let _serial = SERIAL.lock().await;
    let ca = ClusterCa::generate("t").unwrap();
    // a pool with room for one warm segment of this size
    let size = 1 << 20;
    let config = QuicConfig {
        shm: ShmConfig { pool_bytes: size as u64, ..ShmConfig::default() },
        ..QuicConfig::default()
    };
    let (a, b, peer) = same_host_pair(&ca, config).await;
    let recv = || async { tokio::time::timeout(Duration::from_secs(10), b.recv()).await.unwrap().unwrap() };
    let (first, second, third) = (pseudo_random(size), vec![0x5a; size], vec![0xc3; size]);
    a.send(&peer, Channel::Data, Frame::from_bytes(FrameKind::Tensor, 0, &first)).await.unwrap();
    let held = recv().await;
    assert!(held.frame.body.is_mapped());
    assert_eq!(b.shm_stats().mapped, 1);
    // the warm segment is held: the next body cannot reuse it and takes a one-shot segment
    a.send(&peer, Channel::Data, Frame::from_bytes(FrameKind::Tensor, 0, &second)).await.unwrap();
    assert_eq!((a.shm_stats().sent_reused, a.shm_stats().sent_one_shot), (0, 1));
    let d = recv().await;
    assert_eq!(&d.frame.body[..], &second[..]);
    assert_eq!(b.shm_stats().mapped, 2);
    drop(d);
    assert_eq!(b.shm_stats().mapped, 1);
    assert_eq!(&held.frame.body[..], &first[..], "a held body changed after later sends");
    // a clone shares the mapping: the segment stays held until the last one goes
    let body = held.frame.body.clone();
    drop(held);
    assert_eq!(b.shm_stats().mapped, 1);
    assert_eq!(&body[..], &first[..]);
    drop(body);
    assert_eq!(b.shm_stats().mapped, 0);
    // freed: the next body reuses the warm segment
    a.send(&peer, Channel::Data, Frame::from_bytes(FrameKind::Tensor, 0, &third)).await.unwrap();
    assert_eq!((a.shm_stats().sent_reused, a.shm_stats().sent_one_shot), (1, 1));
    let d = recv().await;
    assert_eq!(&d.frame.body[..], &third[..]);
    assert_eq!(b.shm_stats().received, 3);
    drop(d);
    a.shutdown().await;
    b.shutdown().await;
    assert!(own_segments().is_empty(), "segments left after shutdown: {:?}", own_segments());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disabled_on_either_side_means_the_stream_carries_everything() {
    let _serial = SERIAL.lock().await;
    let ca = ClusterCa::generate("t").unwrap();
    let off =
        QuicConfig { shm: ShmConfig { enabled: false, ..ShmConfig::default() }, ..QuicConfig::default() };
    let a = node(&ca, "on", QuicConfig::default()).await;
    let b = node(&ca, "off", off).await;
    let peer = a.connect(b.local_addr().unwrap(), &NodeId::new("off")).await.unwrap();
    let body = pseudo_random(1 << 20);
    a.send(&peer, Channel::Data, Frame::from_bytes(FrameKind::Tensor, 0, &body)).await.unwrap();
    let d = tokio::time::timeout(Duration::from_secs(10), b.recv()).await.unwrap().unwrap();
    assert_eq!(blake3::hash(&d.frame.body), blake3::hash(&body));
    assert!(!a.same_host(&peer));
    assert_eq!(a.shm_stats().sent, 0);
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_segment_frames_are_refused_by_name_and_the_connection_keeps_serving() {
    let _serial = SERIAL.lock().await;
    let ca = ClusterCa::generate("t").unwrap();
    let limits = FrameLimits { max_body: 8 << 20 };
    let (a, b, peer) = same_host_pair(&ca, QuicConfig { limits, ..QuicConfig::default() }).await;
    let mut events = b.events().unwrap();
    let hex = "0123456789abcdef0123456789abcdef";
    // a correctly named file of our uid, but without the token b issued to a
    let forged = format!("{SEGMENT_PREFIX}{}-{hex}", std::process::id());
    let forged_path = Path::new(SHM_DIR).join(&forged);
    let mut forged_bytes = vec![0u8; 64 + 16];
    forged_bytes[..8].copy_from_slice(b"TRPESHM1");
    forged_bytes[8] = 1;
    forged_bytes[48..56].copy_from_slice(&16u64.to_le_bytes());
    std::fs::write(&forged_path, &forged_bytes).unwrap();
    let mut perm = std::fs::metadata(&forged_path).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o600);
    std::fs::set_permissions(&forged_path, perm).unwrap();
    let cases = [
        (format!("{SEGMENT_PREFIX}1-../../../../etc/passwd"), 16u64, "path traversal"),
        ("../../etc/passwd".to_string(), 16, "path traversal"),
        (format!("other-prefix-{hex}"), 16, "does not start with troupe-shm-"),
        (format!("{SEGMENT_PREFIX}1-{hex}"), u64::MAX, "exceeds the cap of 8388608"),
        (format!("{SEGMENT_PREFIX}1-{hex}"), 16, "open"),
        (forged.clone(), 16, "token does not match"),
    ];
    for (name, len, _) in &cases {
        let mut f = Frame::encode(FrameKind::Tensor, &ShmRef { name: name.clone(), len: *len }).unwrap();
        f.flags = FLAG_SHM;
        a.send_raw(&NodeId::new("shm-b"), Channel::Data as u8, &f.to_wire().unwrap()).await.unwrap();
    }
    let mut details = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), async {
        while details.len() < cases.len() {
            if let Some(PeerEvent::BadStream { peer, detail }) = events.recv().await {
                assert_eq!(peer.as_str(), "shm-a");
                details.push(detail);
            }
        }
    })
    .await
    .expect("not every bad segment frame was reported");
    let all = details.join(" | ");
    for (_, _, needle) in &cases {
        assert!(all.contains(needle), "no error naming {needle:?} in {all}");
    }
    assert!(forged_path.exists(), "a segment with a wrong token must be left for its rightful reader");
    std::fs::remove_file(&forged_path).unwrap();
    assert_eq!(b.shm_stats().refused, cases.len() as u64);

    // the same connection still serves, through segments and on the stream
    let body = pseudo_random(2 << 20);
    a.send(&peer, Channel::Data, Frame::from_bytes(FrameKind::Tensor, 0, &body)).await.unwrap();
    a.send(&peer, Channel::Data, Frame::from_bytes(FrameKind::Message, 0, b"still here")).await.unwrap();
    let d = tokio::time::timeout(Duration::from_secs(10), b.recv()).await.unwrap().unwrap();
    assert_eq!(blake3::hash(&d.frame.body), blake3::hash(&body));
    let d = tokio::time::timeout(Duration::from_secs(10), b.recv()).await.unwrap().unwrap();
    assert_eq!(&d.frame.body[..], b"still here");
    assert_eq!(b.shm_stats().received, 1);
    assert_eq!(b.peers(), vec![NodeId::new("shm-a")]);
    assert!(own_segments().len() <= 1, "segments left beyond the warm one: {:?}", own_segments());
    a.shutdown().await;
    b.shutdown().await;
    assert!(own_segments().is_empty(), "segments left after shutdown: {:?}", own_segments());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn segments_never_consumed_are_removed_when_the_connection_closes() {
    let _serial = SERIAL.lock().await;
    let ca = ClusterCa::generate("t").unwrap();
    let (a, b, peer) = same_host_pair(&ca, QuicConfig::default()).await;
    // b stops reading: its inbox fills, its stream reader blocks, segments pile up unread
    let body = pseudo_random(256 << 10);
    // (its inbox holds 256 frames; the small reference frames behind them fit in the stream window)
    for _ in 0..400 {
        a.send(&peer, Channel::Data, Frame::from_bytes(FrameKind::Tensor, 0, &body)).await.unwrap();
    }
    assert!(!own_segments().is_empty(), "the test needs unconsumed segments");
    b.shutdown().await;
    tokio::time::timeout(Duration::from_secs(10), async {
        while !own_segments().is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("segments left after the connection closed: {:?}", own_segments()));
    a.shutdown().await;
}

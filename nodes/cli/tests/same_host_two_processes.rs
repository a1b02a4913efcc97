//! Two real processes on one host: this test and `troupe bench-peer` (started as the transport
//! bench starts it). A 64 MiB message takes
//! the same-host shared-memory path, arrives bit-identical (the peer answers with the blake3
//! hash of what it received), and neither process leaves a segment in /dev/shm.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::Duration;

use troupe_bench::peer::{PEER_NAME, PeerProcess};
use troupe_transport::shm::{SEGMENT_PREFIX, SHM_DIR};
use troupe_transport::{Channel, ClusterCa, Frame, FrameKind, Link, NodeId, QuicConfig, QuicNode};

fn segments_of(pid: u32) -> Vec<String> {
    let prefix = format!("{SEGMENT_PREFIX}{pid}-");
    std::fs::read_dir(SHM_DIR)
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .filter(|n| n.starts_with(&prefix))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tensor_of_64_mib_crosses_processes_through_shared_memory() {
    let ca = ClusterCa::generate("t").unwrap();
    // started as the bench starts it: through the node launcher `troupe up` uses
    let peer_process =
        PeerProcess::start(env!("CARGO_BIN_EXE_troupe").as_ref(), &ca, PEER_NAME, false).await.unwrap();
    let child_pid = peer_process.pid().unwrap();
    let addr: SocketAddr = peer_process.addrs[0];

    let node = QuicNode::bind(
        &ca.issue_node("prober").unwrap(),
        QuicConfig { member: false, ..QuicConfig::default() },
    )
    .await
    .unwrap();
    let peer = node.connect(addr, &NodeId::new(PEER_NAME)).await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), async {
        while !node.same_host(&peer) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the same-host path to the other process did not open");

    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let body: Vec<u8> = (0..(64usize << 20) / 8)
        .flat_map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x.to_le_bytes()
        })
        .collect();
    let digest = blake3::hash(&body);
    node.send(&peer, Channel::Data, Frame::from_bytes(FrameKind::Message, 0, &body)).await.unwrap();
    drop(body);
    let reply = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            let d = node.recv().await.unwrap();
            if d.channel == Channel::Data && d.frame.kind == FrameKind::Message && d.frame.body.len() == 32 {
                return d.frame.body.to_vec();
            }
        }
    })
    .await
    .expect("no answer from the peer");
    assert_eq!(&reply[..], digest.as_bytes(), "the 64 MiB message changed between the processes");
    assert_eq!(node.shm_stats().sent, 1, "the message did not take the same-host path");

    node.shutdown().await;
    let status = peer_process.stop().await.unwrap();
    assert!(status.success(), "peer exited with {status}");
    assert!(segments_of(std::process::id()).is_empty(), "segments of this process left");
    assert!(segments_of(child_pid).is_empty(), "segments of the peer left");
}

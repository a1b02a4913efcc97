//! Per-peer memory bounds on a real `troupe node` process: a peer with a valid certificate of the
//! cluster CA opens every stream it may, announces a maximum-size frame on each and trickles
//! bytes without ever finishing one. The victim must cut it off with the named reason, its
//! resident memory must stay under its start plus the per-peer cap (plus a stated slack), and it
//! must keep serving its other peers.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use troupe::transport::frame::FrameHeader;
use troupe::transport::{Channel, ClusterCa, FrameKind, NodeId, PeerEvent, QuicConfig, QuicNode};
use troupe_tests::{ProcCluster, member_is};

const EXE: &str = env!("CARGO_BIN_EXE_troupe-node");

/// The victim's settings: frames up to 32 MiB, 64 MiB per peer connection, 16 streams per peer.
const MAX_FRAME_MB: u64 = 32;
const PEER_BUFFER_MB: u64 = 64;
const PEER_STREAMS: usize = 16;
/// What a peer can make the node hold besides its budget: QUIC's unread bytes (the connection
/// receive window, 64 MiB in `transport_config`) and 32 MiB for the allocator and the runtime.
const SLACK_MB: u64 = 64 + 32;

fn topology() -> String {
    format!(
        r#"name = "budget"
[membership]
heartbeat_ms = 100
timeout_ms = 3000

[transport]
max_frame_mb = {MAX_FRAME_MB}
max_peer_buffer_mb = {PEER_BUFFER_MB}
max_peer_streams = {PEER_STREAMS}

[[nodes]]
name = "victim"

[[nodes]]
name = "friend"
"#
    )
}

/// A `kB` field of /proc/PID/status, in bytes.
fn status_bytes(pid: u32, field: &str) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = text.lines().find(|l| l.starts_with(field)).unwrap_or_else(|| panic!("no {field} in status"));
    let kb: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kb << 10
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickling_peer_is_cut_off_under_the_cap_and_the_others_are_served() {
    let cluster = ProcCluster::start(EXE.as_ref(), &topology()).unwrap();
    for (me, other) in [("victim", "friend"), ("friend", "victim")] {
        cluster.wait_status(me, Duration::from_secs(30), |s| member_is(s, other, "up")).await.unwrap();
    }
    let victim = cluster.nodes.iter().find(|n| n.name == "victim").unwrap();
    let pid = cluster.pid("victim").unwrap();
    let addr = victim.parsed.listen;
    let (rss_before, hwm_before) = (status_bytes(pid, "VmRSS:"), status_bytes(pid, "VmHWM:"));

    // The adversary holds a certificate of the cluster's own CA.
    let ca = ClusterCa::load(&cluster.dir().join("keys")).unwrap();
    let mallory = QuicNode::bind(&ca.issue_node("mallory").unwrap(), QuicConfig::default()).await.unwrap();
    let mut events = mallory.events().unwrap();
    let v = NodeId::new("victim");
    mallory.connect(addr, &v).await.unwrap();

    let frame_len = (MAX_FRAME_MB << 20) as u32;
    let mut streams = Vec::new();
    for _ in 0..PEER_STREAMS {
        let mut s = mallory.open_raw(&v, Channel::Data as u8).await.unwrap();
        s.write_all(&FrameHeader { kind: FrameKind::Tensor, flags: 0, len: frame_len }.to_bytes())
            .await
            .unwrap();
        streams.push(s);
    }
    // Round robin, 64 KiB at a time, one piece short of finishing any frame: 16 x 32 MiB could
    // be held. The writes end when the victim closes the connection (or the count runs out).
    let piece = vec![0xC3u8; 64 << 10];
    let mut sent = 0u64;
    let mut write_error = None;
    'send: for _ in 0..frame_len as usize / piece.len() - 1 {
        for s in &mut streams {
            if let Err(e) = s.write_all(&piece).await {
                write_error = Some(e.to_string());
                break 'send;
            }
            sent += piece.len() as u64;
        }
    }
    let reason = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            match events.recv().await {
                Some(PeerEvent::Left { peer, reason, .. }) if peer == v => return reason,
                Some(_) => {}
                None => panic!("event stream ended"),
            }
        }
    })
    .await
    .expect("the victim never cut the trickling peer off");
    let hwm_after = status_bytes(pid, "VmHWM:");
    let cap = PEER_BUFFER_MB << 20;
    println!(
        "victim RSS before {} MiB (peak {} MiB); peak after the attack {} MiB; cap {PEER_BUFFER_MB} MiB + slack \
         {SLACK_MB} MiB; adversary wrote {} MiB; write error: {write_error:?}; close reason: {reason}",
        rss_before >> 20,
        hwm_before >> 20,
        hwm_after >> 20,
        sent >> 20
    );
    assert!(reason.contains(&format!("per-connection cap of {cap} bytes")), "{reason}");
    assert!(reason.contains("code 19"), "not closed with CODE_OVER_BUDGET: {reason}");
    assert!(
        hwm_after <= hwm_before + cap + (SLACK_MB << 20),
        "victim peaked at {} MiB, start {} MiB + cap {PEER_BUFFER_MB} MiB + slack {SLACK_MB} MiB",
        hwm_after >> 20,
        hwm_before >> 20
    );
    let log = cluster.log("victim");
    let line = log
        .lines()
        .find(|l| l.contains("peer over its memory budget"))
        .unwrap_or_else(|| panic!("no over-budget line in the victim's log:\n{log}"));
    assert!(
        line.contains("mallory") && line.contains(&format!("cap={cap}")) && line.contains("held="),
        "{line}"
    );

    // The victim keeps serving: the admin's status round trip works and the friend is still up
    // on both sides.
    let (s, _) = cluster
        .wait_status("victim", Duration::from_secs(30), |s| member_is(s, "friend", "up"))
        .await
        .unwrap();
    assert_eq!(s.node, "victim");
    let (s, _) = cluster
        .wait_status("friend", Duration::from_secs(30), |s| member_is(s, "victim", "up"))
        .await
        .unwrap();
    assert_eq!(s.node, "friend");
    mallory.shutdown().await;
}

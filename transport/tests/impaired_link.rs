//! The user-space link impairment over real QUIC on loopback: with 40 ms RTT and 1% loss set on
//! both ends, every frame still arrives once and in order (QUIC retransmits), the datagrams
//! lost are about 1%, and quinn's RTT estimate lands in a stated band around the configured RTT.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use troupe_policy::LinkImpairment;
use troupe_transport::{Channel, ClusterCa, Frame, FrameKind, Link, NodeId, QuicConfig, QuicNode};

/// The band the measured RTT must fall in for a configured 40 ms: the delay is added on both
/// ends (20 ms each), and quinn's estimate adds scheduling and ack timing on top.
const BAND_MS: std::ops::RangeInclusive<f64> = 30.0..=80.0;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_cross_an_impaired_link_exactly_once_and_rtt_is_in_band() {
    let ca = ClusterCa::generate("t").unwrap();
    let cfg = |seed| QuicConfig {
        impairment: Some(LinkImpairment::new(40, 0, 1.0, seed).unwrap()),
        ..QuicConfig::default()
    };
    let a = QuicNode::bind(&ca.issue_node("a").unwrap(), cfg(1)).await.unwrap();
    let b = QuicNode::bind(&ca.issue_node("b").unwrap(), cfg(2)).await.unwrap();
    let peer = a.connect(b.local_addr().unwrap(), &NodeId::new("b")).await.unwrap();
    let frames = 1000u32;
    let sender = a.clone();
    let send = tokio::spawn(async move {
        for i in 0..frames {
            let mut body = vec![0u8; 4000];
            body[..4].copy_from_slice(&i.to_le_bytes());
            sender.send(&peer, Channel::Data, Frame::from_bytes(FrameKind::Message, 0, &body)).await.unwrap();
        }
    });
    let got = tokio::time::timeout(Duration::from_secs(60), async {
        let mut got = Vec::new();
        while got.len() < frames as usize {
            let d = b.recv().await.unwrap();
            got.push(u32::from_le_bytes(d.frame.body[..4].try_into().unwrap()));
        }
        got
    })
    .await
    .expect("1000 frames did not cross the impaired link within 60 s");
    send.await.unwrap();
    assert_eq!(got, (0..frames).collect::<Vec<_>>(), "each frame once, in order");
    let rtt = a.rtt(&NodeId::new("b")).expect("a has a connection to b");
    let ms = rtt.as_secs_f64() * 1e3;
    assert!(BAND_MS.contains(&ms), "configured 40 ms RTT, quinn measured {ms:.1} ms (band {BAND_MS:?})");
    let stats = a.impairment_stats().expect("impairment is on");
    eprintln!("measured rtt {ms:.1} ms; {:?}", stats);
    let (sent, lost) = (
        stats.sent.load(std::sync::atomic::Ordering::Relaxed),
        stats.lost.load(std::sync::atomic::Ordering::Relaxed),
    );
    assert!(sent > 500, "{sent} datagrams sent");
    assert!(lost > 0 && lost * 100 < sent * 4, "1% loss configured: {lost} of {sent} datagrams lost");
}

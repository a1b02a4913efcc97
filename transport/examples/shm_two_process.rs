//! 64 MiB frames from one process to another on the same host, through the same-host path
//! (`transport::shm`), acknowledged by the receiver: a focused measurement of that path without
//! the node runtime. `cargo run --release -p troupe-transport --example shm_two_process`.
//!
//! Prints MB/s for: one frame at a time (send, then wait for its ack), four in flight (as
//! `troupe bench transport` sends them), the same with a receiver that reads every byte before
//! acknowledging, and memcpy baselines (into a fresh buffer, into a reused one).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::io::BufRead;
use std::time::{Duration, Instant};

use troupe_transport::{
    Channel, ClusterCa, Frame, FrameKind, Link, NodeId, NodeIdentity, QuicConfig, QuicNode,
};

const SIZE: usize = 64 << 20;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("recv") {
        receiver(&args[2]).await;
    } else {
        sender().await;
    }
}

/// Acknowledges every frame with its length; a `Message` frame's bytes are all read first.
async fn receiver(dir: &str) {
    let id = NodeIdentity::load(std::path::Path::new(dir), "recv").unwrap();
    let node = QuicNode::bind(&id, QuicConfig::default()).await.unwrap();
    println!("READY {}", node.local_addr().unwrap());
    // stop when the parent closes our stdin
    std::thread::spawn(|| {
        let mut line = String::new();
        while std::io::stdin().read_line(&mut line).unwrap_or(0) > 0 {}
        std::process::exit(0);
    });
    while let Ok(d) = node.recv().await {
        let n = d.frame.body.len() as u64;
        if d.frame.kind == FrameKind::Message {
            let sum = d
                .frame
                .body
                .chunks_exact(8)
                .fold(0u64, |a, c| a.wrapping_add(u64::from_le_bytes(c.try_into().unwrap())));
            std::hint::black_box(sum);
        }
        let from = d.from.clone();
        drop(d);
        let ack = Frame::from_bytes(FrameKind::Heartbeat, 0, &n.to_le_bytes());
        if node.send(&from, Channel::Data, ack).await.is_err() {
            return;
        }
    }
}

async fn ack(node: &QuicNode) -> u64 {
    loop {
        let d = node.recv().await.unwrap();
        if d.frame.kind == FrameKind::Heartbeat {
            return u64::from_le_bytes(d.frame.body[..8].try_into().unwrap());
        }
    }
}

/// MB/s of `rounds` batches of `in_flight` frames of `kind`, each batch timed to its last ack;
/// returns the median and the best.
async fn goodput(
    node: &QuicNode,
    peer: &NodeId,
    payload: &[u8],
    kind: FrameKind,
    in_flight: usize,
    rounds: usize,
) -> (f64, f64) {
    let frame = Frame::from_bytes(kind, 0, payload);
    let mut rates = Vec::new();
    for _ in 0..rounds {
        let frames: Vec<Frame> = (0..in_flight).map(|_| frame.clone()).collect();
        let start = Instant::now();
        for f in frames {
            node.send(peer, Channel::Data, f).await.unwrap();
        }
        let mut bytes = 0;
        for _ in 0..in_flight {
            bytes += ack(node).await;
        }
        rates.push(bytes as f64 / start.elapsed().as_secs_f64() / 1e6);
    }
    let median = troupe_policy::stats::median(&mut rates);
    (median, rates[rates.len() - 1])
}

async fn sender() {
    let ca = ClusterCa::generate("shm-example").unwrap();
    let dir = tempfile::tempdir().unwrap();
    ca.write(dir.path()).unwrap();
    ca.issue_node("recv").unwrap().write(dir.path()).unwrap();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["recv", dir.path().to_str().unwrap()])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let addr = line.trim().strip_prefix("READY ").expect("receiver did not start").parse().unwrap();
    let node = QuicNode::bind(&ca.issue_node("send").unwrap(), QuicConfig::default()).await.unwrap();
    let peer = node.connect(addr, &NodeId::new("recv")).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !node.same_host(&peer) {
        assert!(Instant::now() < deadline, "the same-host path did not open");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let payload: Vec<u8> = (0..SIZE)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (x >> 56) as u8
        })
        .collect();
    goodput(&node, &peer, &payload, FrameKind::Tensor, 4, 1).await; // warm the pool
    let (one_med, one_best) = goodput(&node, &peer, &payload, FrameKind::Tensor, 1, 9).await;
    let (four_med, four_best) = goodput(&node, &peer, &payload, FrameKind::Tensor, 4, 5).await;
    let (touch_med, touch_best) = goodput(&node, &peer, &payload, FrameKind::Message, 1, 9).await;
    let stats = node.shm_stats();
    let mut fresh = Vec::new();
    let mut reused = vec![0u8; SIZE];
    for _ in 0..5 {
        let t = Instant::now();
        let v = payload.to_vec();
        std::hint::black_box(&v);
        fresh.push(SIZE as f64 / t.elapsed().as_secs_f64() / 1e6);
        let t = Instant::now();
        reused.copy_from_slice(&payload);
        std::hint::black_box(&reused);
        let r = SIZE as f64 / t.elapsed().as_secs_f64() / 1e6;
        fresh.push(-r); // negative: reused, sorted apart below
    }
    let best_fresh = fresh.iter().copied().filter(|r| *r > 0.0).fold(0.0, f64::max);
    let best_reused = fresh.iter().copied().filter(|r| *r < 0.0).map(|r| -r).fold(0.0, f64::max);
    println!("64 MiB, one in flight:             median {one_med:7.0} MB/s, best {one_best:7.0}");
    println!("64 MiB, four in flight:            median {four_med:7.0} MB/s, best {four_best:7.0}");
    println!("64 MiB, receiver reads every byte: median {touch_med:7.0} MB/s, best {touch_best:7.0}");
    println!(
        "memcpy 64 MiB: fresh buffer best {best_fresh:7.0} MB/s, reused buffer best {best_reused:7.0} MB/s"
    );
    println!("sender stats: {stats:?}");
    drop(child.stdin.take());
    let _ = child.wait();
    node.shutdown().await;
}

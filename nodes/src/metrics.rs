//! A node's Prometheus metrics: one registry, filled from live sources, served as OpenMetrics
//! text at `GET /metrics` when the node config has `[metrics] listen = "127.0.0.1:PORT"`.
//!
//! Access rule: local scrape only. The endpoint has no authentication, so the config refuses a
//! listen address that is not loopback (see [`crate::config::MetricsSection`]); scrape it with
//! an agent on the same machine, or through a tunnel.
//!
//! Families (`troupe_members` and the per-channel frame counters are in every scrape, from 0;
//! a family with no sample yet is left out of the text, as the encoder does: `member_up` until
//! a member is known, peer bytes until a peer joins, devices when none is configured, restarts
//! and escalations until the first one):
//!
//! | family | labels | source |
//! |---|---|---|
//! | `troupe_members` (gauge) | `state` = up, down, left | membership, read at scrape |
//! | `troupe_member_up` (gauge) | `member` | 1 up, 0 down, read at scrape |
//! | `troupe_supervisor_restarts_total` | `supervisor`, `child` | supervision events |
//! | `troupe_supervisor_escalations_total` | `supervisor`, `child` | supervision events |
//! | `troupe_frames_total`, `troupe_frame_bytes_total` | `channel`, `direction` | transport counters |
//! | `troupe_peer_udp_bytes_total` | `peer`, `direction` | QUIC connection stats per peer |
//! | `troupe_device_memory_used_bytes`, `troupe_device_memory_budget_bytes`, `troupe_device_memory_fragmentation` (gauges) | `device` | device actors |
//! | `troupe_peer_rtt_seconds` (gauge) | `peer` | QUIC's round-trip estimate per connected peer |
//! | `troupe_queue_length` (gauge) | `workload`, `queue` | workloads' own queues ([`troupe_actors::live`]) |
//! | `troupe_mailbox_depth`, `troupe_mailbox_depth_max` (gauges) | `actor` | counted messages queued for each of the runtime's actors, and the most at once ([`troupe_actors::mailbox`]) |
//! | `troupe_expert_residency_experts`, `troupe_expert_residency_bytes` (gauges) | `executor`, `tier` = device, host | each local coe executor after its last command |
//! | `troupe_pool_used_bytes`, `troupe_pool_budget_bytes`, `troupe_pool_fragmentation` (gauges) | `pool` | coe executors' device arenas, the coadapt edge's pool |
//! | `troupe_work_total` | `workload`, `outcome` = done, failed | [`troupe_actors::work`] |
//!
//! Queues published: `coe` `outstanding` (accepted, not answered), `waiting-clients`,
//! `admitted` (the request service's admission count); `pipeline` `ready`, `running` (the
//! foreman's tasks ready to assign and in flight); `coadapt` `uploads` (accepted, not
//! answered). A workload's queue appears once it runs on the node.
//!
//! Mailbox depths: ractor exposes no mailbox length, so the runtime counts them itself, for the
//! actors it sends to through its counted send path (the scheduler shell of the coe scheduler,
//! the pipeline foreman and the coadapt edge; the coe executor and pipeline worker actors): a
//! message counts from its send until its handler takes it. An actor appears once it starts.
//!
//! Counters mirrored from a source that counts on its own (transport, QUIC) are advanced by
//! the difference at each scrape, so they only grow; a peer's QUIC counters restart with a new
//! connection, and the mirror then waits until they pass the old value.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::broadcast;
use troupe_actors::SupervisorEvent;
use troupe_actors::node::StatusProbe;
use troupe_actors::wire::NodeStatus;
use troupe_transport::{Channel, QuicNode};

/// Largest request head read from a scraper (or a dashboard client).
pub(crate) const MAX_REQUEST: usize = 8 << 10;
/// A scraper (or dashboard client) that sends no complete request head within this is dropped.
pub(crate) const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// The content type of OpenMetrics text (what `prometheus_client::encoding::text` writes).
const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MemberLabels {
    member: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ChildLabels {
    supervisor: String,
    child: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ChannelLabels {
    channel: String,
    direction: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkLabels {
    workload: String,
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PeerLabels {
    peer: String,
    direction: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeviceLabels {
    device: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RttLabels {
    peer: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QueueLabels {
    workload: String,
    queue: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ActorLabels {
    actor: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TierLabels {
    executor: String,
    tier: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolLabels {
    pool: String,
}

/// A gauge holding a float (seconds, ratios).
type FloatGauge = Gauge<f64, std::sync::atomic::AtomicU64>;

/// One node's metrics: the registry and handles on its families.
pub struct NodeMetrics {
    registry: Registry,
    members: Family<StateLabels, Gauge>,
    member_up: Family<MemberLabels, Gauge>,
    restarts: Family<ChildLabels, Counter>,
    escalations: Family<ChildLabels, Counter>,
    frames: Family<ChannelLabels, Counter>,
    frame_bytes: Family<ChannelLabels, Counter>,
    peer_bytes: Family<PeerLabels, Counter>,
    device_used: Family<DeviceLabels, Gauge>,
    device_budget: Family<DeviceLabels, Gauge>,
    device_fragmentation: Family<DeviceLabels, FloatGauge>,
    work: Family<WorkLabels, Counter>,
    rtt: Family<RttLabels, FloatGauge>,
    queues: Family<QueueLabels, Gauge>,
    mailbox_depth: Family<ActorLabels, Gauge>,
    mailbox_depth_max: Family<ActorLabels, Gauge>,
    resident_experts: Family<TierLabels, Gauge>,
    resident_bytes: Family<TierLabels, Gauge>,
    pool_used: Family<PoolLabels, Gauge>,
    pool_budget: Family<PoolLabels, Gauge>,
    pool_fragmentation: Family<PoolLabels, FloatGauge>,
}

impl Default for NodeMetrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Advances a mirrored counter to `value` (never backwards).
fn mirror(c: &Counter, value: u64) {
    let now = c.get();
    if value > now {
        c.inc_by(value - now);
    }
}

fn gauge_value(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

impl NodeMetrics {
    /// A registry with every family registered and no samples yet.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("troupe");
        let members = Family::<StateLabels, Gauge>::default();
        registry.register("members", "Cluster members this node sees, by state", members.clone());
        let member_up = Family::<MemberLabels, Gauge>::default();
        registry.register("member_up", "1 when the member is up, 0 when it is down", member_up.clone());
        let restarts = Family::<ChildLabels, Counter>::default();
        registry.register("supervisor_restarts", "Children restarted after a failure", restarts.clone());
        let escalations = Family::<ChildLabels, Counter>::default();
        registry.register(
            "supervisor_escalations",
            "Child failures past the restart intensity",
            escalations.clone(),
        );
        let frames = Family::<ChannelLabels, Counter>::default();
        registry.register("frames", "Frames sent and received, by channel", frames.clone());
        let frame_bytes = Family::<ChannelLabels, Counter>::default();
        registry.register(
            "frame_bytes",
            "Frame header and body bytes sent and received, by channel",
            frame_bytes.clone(),
        );
        let peer_bytes = Family::<PeerLabels, Counter>::default();
        registry.register(
            "peer_udp_bytes",
            "UDP bytes of the QUIC connection to each peer",
            peer_bytes.clone(),
        );
        let device_used = Family::<DeviceLabels, Gauge>::default();
        registry.register("device_memory_used_bytes", "Device memory in use", device_used.clone());
        let device_budget = Family::<DeviceLabels, Gauge>::default();
        registry.register("device_memory_budget_bytes", "Device memory budget", device_budget.clone());
        let device_fragmentation = Family::<DeviceLabels, FloatGauge>::default();
        registry.register(
            "device_memory_fragmentation",
            "External fragmentation of the device's free memory (0..1)",
            device_fragmentation.clone(),
        );
        let work = Family::<WorkLabels, Counter>::default();
        registry.register(
            "work",
            "Work finished in this node, per workload: coe requests answered, pipeline inputs \
             answered, adaptations done (outcome done), and failed attempts (outcome failed)",
            work.clone(),
        );
        let rtt = Family::<RttLabels, FloatGauge>::default();
        registry.register("peer_rtt_seconds", "QUIC's round-trip time estimate to each peer", rtt.clone());
        let queues = Family::<QueueLabels, Gauge>::default();
        registry.register(
            "queue_length",
            "Entries in each queue a workload of this node owns",
            queues.clone(),
        );
        let mailbox_depth = Family::<ActorLabels, Gauge>::default();
        registry.register(
            "mailbox_depth",
            "Messages sent to each of the runtime's actors and not yet taken by its handler",
            mailbox_depth.clone(),
        );
        let mailbox_depth_max = Family::<ActorLabels, Gauge>::default();
        registry.register(
            "mailbox_depth_max",
            "The most messages queued at once for each of the runtime's actors since it was first listed",
            mailbox_depth_max.clone(),
        );
        let resident_experts = Family::<TierLabels, Gauge>::default();
        registry.register(
            "expert_residency_experts",
            "Experts each local coe executor holds, per tier",
            resident_experts.clone(),
        );
        let resident_bytes = Family::<TierLabels, Gauge>::default();
        registry.register(
            "expert_residency_bytes",
            "Bytes of experts each local coe executor holds, per tier",
            resident_bytes.clone(),
        );
        let pool_used = Family::<PoolLabels, Gauge>::default();
        registry.register("pool_used_bytes", "Bytes allocated in each memory pool", pool_used.clone());
        let pool_budget = Family::<PoolLabels, Gauge>::default();
        registry.register("pool_budget_bytes", "Bytes each memory pool may hand out", pool_budget.clone());
        let pool_fragmentation = Family::<PoolLabels, FloatGauge>::default();
        registry.register(
            "pool_fragmentation",
            "External fragmentation of each pool's free space (0..1)",
            pool_fragmentation.clone(),
        );
        for (workload, _) in troupe_actors::work::all() {
            for outcome in ["done", "failed"] {
                let _ =
                    work.get_or_create(&WorkLabels { workload: workload.into(), outcome: outcome.into() });
            }
        }
        for state in ["up", "down", "left"] {
            members.get_or_create(&StateLabels { state: state.into() }).set(0);
        }
        for ch in Channel::ALL {
            for direction in ["sent", "received"] {
                let l = ChannelLabels { channel: channel_name(ch).into(), direction: direction.into() };
                let _ = frames.get_or_create(&l);
                let _ = frame_bytes.get_or_create(&l);
            }
        }
        Self {
            registry,
            members,
            member_up,
            restarts,
            escalations,
            frames,
            frame_bytes,
            peer_bytes,
            device_used,
            device_budget,
            device_fragmentation,
            work,
            rtt,
            queues,
            mailbox_depth,
            mailbox_depth_max,
            resident_experts,
            resident_bytes,
            pool_used,
            pool_budget,
            pool_fragmentation,
        }
    }

    /// Counts one supervision event.
    pub fn record_supervision(&self, ev: &SupervisorEvent) {
        match ev {
            SupervisorEvent::Restarted { supervisor, child, .. } => {
                self.restarts
                    .get_or_create(&ChildLabels { supervisor: supervisor.clone(), child: child.clone() })
                    .inc();
            }
            SupervisorEvent::Escalated { supervisor, child, .. } => {
                self.escalations
                    .get_or_create(&ChildLabels { supervisor: supervisor.clone(), child: child.clone() })
                    .inc();
            }
        }
    }

    /// Reads the live sources (status, transport counters, QUIC stats) into the families.
    pub async fn refresh(&self, status: &StatusProbe, link: &QuicNode) {
        match status.status().await {
            Ok(s) => {
                for state in ["up", "down", "left"] {
                    let n = s.members.iter().filter(|m| m.status == state).count();
                    self.members.get_or_create(&StateLabels { state: state.into() }).set(n as i64);
                }
                for m in &s.members {
                    self.member_up
                        .get_or_create(&MemberLabels { member: m.name.clone() })
                        .set(i64::from(m.status == "up"));
                }
                for d in &s.devices {
                    let l = DeviceLabels { device: d.name.clone() };
                    self.device_used.get_or_create(&l).set(gauge_value(d.used_bytes));
                    self.device_budget.get_or_create(&l).set(gauge_value(d.budget_bytes));
                    self.device_fragmentation.get_or_create(&l).set(d.fragmentation);
                }
                self.record_live(&s);
            }
            // the last values stay; the scrape still answers
            Err(e) => tracing::debug!(error = %e, "metrics: status not read"),
        }
        for (ch, t) in link.traffic() {
            let l = |direction: &str| ChannelLabels {
                channel: channel_name(ch).into(),
                direction: direction.into(),
            };
            mirror(&self.frames.get_or_create(&l("sent")), t.frames_sent);
            mirror(&self.frames.get_or_create(&l("received")), t.frames_received);
            mirror(&self.frame_bytes.get_or_create(&l("sent")), t.bytes_sent);
            mirror(&self.frame_bytes.get_or_create(&l("received")), t.bytes_received);
        }
        for (workload, counters) in troupe_actors::work::all() {
            let (done, failed) = counters.get();
            let l = |outcome: &str| WorkLabels { workload: workload.into(), outcome: outcome.into() };
            mirror(&self.work.get_or_create(&l("done")), done);
            mirror(&self.work.get_or_create(&l("failed")), failed);
        }
        for peer in link.peers() {
            if let Some(stats) = link.connection_stats(&peer) {
                let l = |direction: &str| PeerLabels { peer: peer.to_string(), direction: direction.into() };
                mirror(&self.peer_bytes.get_or_create(&l("sent")), stats.udp_tx.bytes);
                mirror(&self.peer_bytes.get_or_create(&l("received")), stats.udp_rx.bytes);
            }
            if let Some(rtt) = link.rtt(&peer) {
                self.rtt.get_or_create(&RttLabels { peer: peer.to_string() }).set(rtt.as_secs_f64());
            }
        }
    }

    /// Sets the live-figure gauges (residency, queues, mailboxes, pools) from a status of this node, the
    /// same figures `troupe status` and the dashboard show.
    fn record_live(&self, s: &NodeStatus) {
        for r in &s.residency {
            let l = |tier: &str| TierLabels { executor: r.executor.clone(), tier: tier.into() };
            self.resident_experts.get_or_create(&l("device")).set(gauge_value(r.device_experts));
            self.resident_experts.get_or_create(&l("host")).set(gauge_value(r.host_experts));
            self.resident_bytes.get_or_create(&l("device")).set(gauge_value(r.device_bytes));
            self.resident_bytes.get_or_create(&l("host")).set(gauge_value(r.host_bytes));
        }
        for q in &s.queues {
            self.queues
                .get_or_create(&QueueLabels { workload: q.workload.clone(), queue: q.queue.clone() })
                .set(gauge_value(q.depth));
        }
        for m in &s.mailboxes {
            let l = ActorLabels { actor: m.actor.clone() };
            self.mailbox_depth.get_or_create(&l).set(gauge_value(m.depth));
            self.mailbox_depth_max.get_or_create(&l).set(gauge_value(m.max_depth));
        }
        for p in &s.pools {
            let l = PoolLabels { pool: p.pool.clone() };
            self.pool_used.get_or_create(&l).set(gauge_value(p.used_bytes));
            self.pool_budget.get_or_create(&l).set(gauge_value(p.budget_bytes));
            self.pool_fragmentation.get_or_create(&l).set(p.fragmentation);
        }
    }

    /// The registry as OpenMetrics text.
    pub fn encode(&self) -> Result<String> {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry).context("encoding metrics")?;
        Ok(out)
    }
}

fn channel_name(ch: Channel) -> &'static str {
    match ch {
        Channel::Control => "control",
        Channel::Data => "data",
        Channel::Blob => "blob",
    }
}

/// A running metrics endpoint; dropping it stops serving.
pub struct MetricsServer {
    /// The bound address (the real port when the config asked for port 0).
    pub addr: SocketAddr,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Binds `addr` (already checked to be loopback) and serves the node's metrics until the
/// returned server is dropped.
pub async fn serve(
    addr: SocketAddr,
    status: StatusProbe,
    link: QuicNode,
    mut supervision: broadcast::Receiver<SupervisorEvent>,
) -> Result<MetricsServer> {
    let listener =
        TcpListener::bind(addr).await.with_context(|| format!("binding the metrics endpoint {addr}"))?;
    let bound = listener.local_addr()?;
    let metrics = Arc::new(NodeMetrics::new());
    let m = metrics.clone();
    let events = tokio::spawn(async move {
        loop {
            match supervision.recv().await {
                Ok(ev) => m.record_supervision(&ev),
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    tracing::warn!(missed = n, "metrics: supervision events lost; restart counts are low")
                }
                Err(broadcast::error::RecvError::Closed) => return,
            }
        }
    });
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_SCRAPES));
    let accept = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { continue };
            // past MAX_SCRAPES connections at once, new ones are closed unanswered
            let Ok(slot) = slots.clone().try_acquire_owned() else { continue };
            let (metrics, status, link) = (metrics.clone(), status.clone(), link.clone());
            tokio::spawn(async move {
                let _slot = slot;
                if let Err(e) = answer(stream, &metrics, &status, &link).await {
                    tracing::debug!(error = %e, "metrics: scrape not answered");
                }
            });
        }
    });
    Ok(MetricsServer { addr: bound, tasks: vec![events, accept] })
}

/// Scrapes answered at once (each also bounded by the request timeout).
const MAX_SCRAPES: usize = 16;

/// Reads one request head and answers it: `GET /metrics` gets the text, anything else 404 or
/// 405. One request per connection.
async fn answer(
    mut stream: TcpStream,
    metrics: &NodeMetrics,
    status: &StatusProbe,
    link: &QuicNode,
) -> Result<()> {
    let head = tokio::time::timeout(REQUEST_TIMEOUT, read_head(&mut stream))
        .await
        .context("no request head in time")??;
    let (code, body, kind) = match request_line(&head) {
        Some(("GET", "/metrics")) => {
            metrics.refresh(status, link).await;
            ("200 OK", metrics.encode()?, CONTENT_TYPE)
        }
        Some(("GET", _)) => ("404 Not Found", "only /metrics is served\n".to_string(), "text/plain"),
        Some(_) => ("405 Method Not Allowed", "only GET is served\n".to_string(), "text/plain"),
        None => ("400 Bad Request", "not an HTTP request\n".to_string(), "text/plain"),
    };
    let reply = format!(
        "HTTP/1.1 {code}\r\ncontent-type: {kind}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(reply.as_bytes()).await?;
    stream.shutdown().await?;
    Ok(())
}

/// Bytes up to the blank line that ends the request head (at most [`MAX_REQUEST`]).
pub(crate) async fn read_head(stream: &mut TcpStream) -> Result<Vec<u8>> {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        if head.len() >= MAX_REQUEST {
            anyhow::bail!("request head over {MAX_REQUEST} bytes");
        }
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            anyhow::bail!("connection closed before the request head ended");
        }
        head.extend_from_slice(&buf[..n]);
    }
    Ok(head)
}

/// Method and path of a request head, if its first line is `METHOD PATH HTTP/1.x`.
pub(crate) fn request_line(head: &[u8]) -> Option<(&str, &str)> {
    let text = std::str::from_utf8(head).ok()?;
    let first = text.lines().next()?;
    let mut parts = first.split(' ');
    let (method, path, version) = (parts.next()?, parts.next()?, parts.next()?);
    if !version.starts_with("HTTP/1.") || parts.next().is_some() {
        return None;
    }
    // a query string does not change what is served
    Some((method, path.split('?').next().unwrap_or(path)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use troupe_actors::wire::MailboxView;

    #[test]
    fn request_lines_are_parsed_strictly() {
        assert_eq!(request_line(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n"), Some(("GET", "/metrics")));
        assert_eq!(request_line(b"GET /metrics?x=1 HTTP/1.0\r\n\r\n"), Some(("GET", "/metrics")));
        assert_eq!(request_line(b"POST /metrics HTTP/1.1\r\n\r\n"), Some(("POST", "/metrics")));
        assert_eq!(request_line(b"GET /metrics\r\n\r\n"), None);
        assert_eq!(request_line(b"\xff\xfe\r\n\r\n"), None);
    }

    #[test]
    fn a_fresh_registry_has_every_family_and_mirrors_only_grow() {
        let m = NodeMetrics::new();
        m.record_supervision(&SupervisorEvent::Restarted {
            supervisor: "root".into(),
            child: "hello-expert".into(),
            in_window: 1,
            reason: "boom".into(),
        });
        let text = m.encode().unwrap();
        for family in ["troupe_members", "troupe_supervisor_restarts", "troupe_frames", "troupe_frame_bytes"]
        {
            assert!(text.contains(&format!("# TYPE {family} ")), "{family} missing:\n{text}");
        }
        assert!(
            text.contains("troupe_supervisor_restarts_total{supervisor=\"root\",child=\"hello-expert\"} 1"),
            "{text}"
        );
        assert!(text.contains("troupe_members{state=\"up\"} 0"), "{text}");
        assert!(text.contains("troupe_frames_total{channel=\"control\",direction=\"sent\"} 0"), "{text}");
        assert!(!text.contains("troupe_supervisor_escalations"), "an empty family is left out:\n{text}");
        let status = NodeStatus {
            mailboxes: vec![MailboxView { actor: "coe-scheduler".into(), depth: 2, max_depth: 9 }],
            ..NodeStatus::default()
        };
        m.record_live(&status);
        let text = m.encode().unwrap();
        assert!(text.contains("troupe_mailbox_depth{actor=\"coe-scheduler\"} 2"), "{text}");
        assert!(text.contains("troupe_mailbox_depth_max{actor=\"coe-scheduler\"} 9"), "{text}");
        let c = Counter::default();
        mirror(&c, 5);
        mirror(&c, 3);
        assert_eq!(c.get(), 5);
    }
}

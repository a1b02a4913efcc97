//! The control plane: ractor_cluster node sessions carried over one control stream per peer
//! (isolated mode): a QUIC bidirectional stream, or a same-host stream between two nodes of one
//! host. Identity comes from mutual TLS; the cluster cookie (a per-cluster secret from
//! `troupe keys init`) is a second check on top.

use ractor::{Actor, ActorRef};
use ractor_cluster::node::NodeConnectionMode;
use ractor_cluster::{BoxRead, BoxWrite, ClusterBidiStream, NodeServer, NodeServerMessage};
use troupe_transport::ControlStream;

/// Largest control-plane frame (remote actor messages); tensors travel on data streams.
pub const MAX_CONTROL_FRAME: u64 = 16 << 20;

/// A control stream (either road) as a ractor_cluster transport.
pub struct ControlBidi {
    stream: ControlStream,
    label: String,
}

impl ControlBidi {
    /// Wraps a control stream to `label` (the peer's name).
    pub fn new(stream: ControlStream, label: impl Into<String>) -> Self {
        Self { stream, label: label.into() }
    }
}

impl ClusterBidiStream for ControlBidi {
    fn split(self: Box<Self>) -> (BoxRead, BoxWrite) {
        self.stream.into_split()
    }

    fn peer_label(&self) -> Option<String> {
        Some(self.label.clone())
    }
}

/// Starts this node's ractor_cluster server. Its own TCP listener binds loopback only and is
/// never used: sessions arrive over QUIC.
pub async fn start_node_server(
    node: &str,
    cookie: &str,
) -> Result<ActorRef<NodeServerMessage>, ractor::SpawnErr> {
    let server = NodeServer::new(
        0,
        cookie.to_string(),
        node.to_string(),
        "localhost".to_string(),
        None,
        Some(NodeConnectionMode::Isolated),
    )
    .with_listen_addr(std::net::IpAddr::from([127, 0, 0, 1]))
    .with_max_inbound_frame_size(MAX_CONTROL_FRAME);
    let (r, _h) = Actor::spawn(Some(format!("cluster-{node}")), server, ()).await?;
    Ok(r)
}

/// Hands a control stream to the node server (`outbound` when this node dialed).
pub fn open_session(
    server: &ActorRef<NodeServerMessage>,
    stream: ControlBidi,
    outbound: bool,
) -> Result<(), ractor::MessagingErr<NodeServerMessage>> {
    server
        .cast(NodeServerMessage::ConnectionOpenedExternal { stream: Box::new(stream), is_server: !outbound })
}

//! The runtime's seam: what the node runtime, the service router, membership and the typed-actor
//! registry need from a node's link, beyond [`Link`]'s frames.
//!
//! [`RuntimeLink`] is the peer view (who is joined, their roles, whether they were heard, where
//! service frames go). [`QuicNode`] implements it over its connections and certificates;
//! [`SimLink`] over a seeded [`crate::SimHub`] (who is linked and reachable, roles from a table
//! given at build time). [`NodeLink`] carries either one: the router and the registry hold a
//! `NodeLink`, so they (and every shell built on them) stay free of type parameters, and each
//! call is one `match` with no allocation or vtable on the QUIC path. What only QUIC can do
//! (dialing addresses, raw streams, admission, connection stats) stays on [`QuicNode`], reached
//! through [`NodeLink::quic`] by the shells that truly need it. Blob pulls by content hash are on
//! both ([`NodeLink::fetch_blob`]): a simulated pull takes a modelled time on tokio's clock.

use std::sync::Arc;

use crate::frame::Frame;
use crate::link::{Channel, Delivery, Link, LinkError, NodeId};
use crate::quic::{BlobServer, QuicError, QuicNode};
use crate::roles::RoleSet;
use crate::sim::SimLink;

/// Takes service frames straight from where they arrive, instead of [`Link::recv`]
/// (see [`RuntimeLink::set_service_sink`]).
pub type DeliverySink = Arc<dyn Fn(Delivery) + Send + Sync>;

/// The peer view a node runtime needs from its link (see the module docs).
pub trait RuntimeLink: Link + Clone + 'static {
    /// Cluster members currently joined, sorted by name.
    fn peers(&self) -> Vec<NodeId>;

    /// Whether `peer` is joined as a cluster member.
    fn is_member(&self, peer: &NodeId) -> bool;

    /// The roles of this node.
    fn local_roles(&self) -> RoleSet;

    /// The roles of `peer` (`None` when it is not reachable).
    fn peer_roles(&self, peer: &NodeId) -> Option<RoleSet>;

    /// Whether anything arrived from `peer` since the last call (false if it is not joined).
    fn take_heard(&self, peer: &NodeId) -> bool;

    /// Sends every later [`crate::FrameKind::Service`] frame to `sink` instead of
    /// [`Link::recv`], replacing any sink there. The sink must not block.
    fn set_service_sink(&self, sink: DeliverySink);
}

/// A node's link, QUIC or simulated (see the module docs). Cheap to clone.
#[derive(Clone)]
pub enum NodeLink {
    /// A real QUIC endpoint.
    Quic(QuicNode),
    /// A link of a seeded simulated network.
    Sim(SimLink),
}

/// `$call` on whichever link `$self` holds.
macro_rules! each {
    ($self:expr, $l:ident => $call:expr) => {
        match $self {
            NodeLink::Quic($l) => $call,
            NodeLink::Sim($l) => $call,
        }
    };
}

impl NodeLink {
    /// The QUIC endpoint, for what only QUIC can do; `None` in a simulation.
    pub fn quic(&self) -> Option<&QuicNode> {
        match self {
            NodeLink::Quic(q) => Some(q),
            NodeLink::Sim(_) => None,
        }
    }

    /// Serves this node's blobs from `server` (replacing any there).
    pub fn set_blob_server(&self, server: Arc<dyn BlobServer>) {
        each!(self, l => l.set_blob_server(server))
    }

    /// Pulls blob `id` (at most `max_len` bytes, checked against its BLAKE3) from `peer`.
    pub async fn fetch_blob(&self, peer: &NodeId, id: [u8; 32], max_len: u32) -> Result<Vec<u8>, QuicError> {
        self.fetch_blob_with(peer, id, max_len, <[u8]>::to_vec).await
    }

    /// [`Self::fetch_blob`] handing the verified bytes to `take` where they arrived.
    pub async fn fetch_blob_with<T>(
        &self,
        peer: &NodeId,
        id: [u8; 32],
        max_len: u32,
        take: impl FnOnce(&[u8]) -> T,
    ) -> Result<T, QuicError> {
        each!(self, l => l.fetch_blob_with(peer, id, max_len, take).await)
    }

    /// Round-trip time to `peer` as QUIC measures it; `None` unknown (always, simulated).
    pub fn rtt(&self, peer: &NodeId) -> Option<std::time::Duration> {
        self.quic().and_then(|q| q.rtt(peer))
    }

    /// Whether `peer` is reached over the same-host path (never, simulated).
    pub fn same_host(&self, peer: &NodeId) -> bool {
        self.quic().is_some_and(|q| q.same_host(peer))
    }
}

impl std::fmt::Debug for NodeLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self {
            NodeLink::Quic(_) => "quic",
            NodeLink::Sim(_) => "sim",
        };
        write!(f, "NodeLink::{kind}({})", self.local_id())
    }
}

impl From<QuicNode> for NodeLink {
    fn from(q: QuicNode) -> Self {
        NodeLink::Quic(q)
    }
}

impl From<SimLink> for NodeLink {
    fn from(s: SimLink) -> Self {
        NodeLink::Sim(s)
    }
}

impl Link for NodeLink {
    fn local_id(&self) -> &NodeId {
        each!(self, l => l.local_id())
    }

    async fn send(&self, to: &NodeId, channel: Channel, frame: Frame) -> Result<(), LinkError> {
        each!(self, l => l.send(to, channel, frame).await)
    }

    async fn recv(&self) -> Result<Delivery, LinkError> {
        each!(self, l => l.recv().await)
    }
}

impl RuntimeLink for NodeLink {
    fn peers(&self) -> Vec<NodeId> {
        each!(self, l => l.peers())
    }

    fn is_member(&self, peer: &NodeId) -> bool {
        each!(self, l => l.is_member(peer))
    }

    fn local_roles(&self) -> RoleSet {
        each!(self, l => l.local_roles())
    }

    fn peer_roles(&self, peer: &NodeId) -> Option<RoleSet> {
        each!(self, l => l.peer_roles(peer))
    }

    fn take_heard(&self, peer: &NodeId) -> bool {
        each!(self, l => l.take_heard(peer))
    }

    fn set_service_sink(&self, sink: DeliverySink) {
        each!(self, l => l.set_service_sink(sink))
    }
}

impl RuntimeLink for QuicNode {
    fn peers(&self) -> Vec<NodeId> {
        QuicNode::peers(self)
    }

    fn is_member(&self, peer: &NodeId) -> bool {
        QuicNode::is_member(self, peer)
    }

    fn local_roles(&self) -> RoleSet {
        QuicNode::local_roles(self)
    }

    fn peer_roles(&self, peer: &NodeId) -> Option<RoleSet> {
        QuicNode::peer_roles(self, peer)
    }

    fn take_heard(&self, peer: &NodeId) -> bool {
        QuicNode::take_heard(self, peer)
    }

    fn set_service_sink(&self, sink: DeliverySink) {
        QuicNode::set_service_sink(self, sink)
    }
}

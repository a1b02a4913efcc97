//! The `Link` seam: frames between named nodes, one logical channel per purpose.
//!
//! The QUIC implementation ([`crate::quic`]) maps each channel to its own stream so a 64 MiB
//! tensor never blocks a heartbeat; the in-memory implementation ([`crate::sim`]) adds seeded
//! delay, loss, partitions and crashes for deterministic whole-cluster tests.

use std::fmt;
use std::future::Future;

use crate::budget::Held;
use crate::frame::{Frame, FrameError};

/// A node's name, as written in its certificate and its hello.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub String);

impl NodeId {
    /// A node id from anything string-like.
    pub fn new(name: impl Into<String>) -> Self {
        Self(name.into())
    }

    /// The name as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Logical channels; each gets its own ordered stream, so they never block each other.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Channel {
    /// Heartbeats and small control messages.
    Control = 1,
    /// Application messages and tensors.
    Data = 2,
    /// Blob pulls (content-addressed bytes).
    Blob = 3,
}

impl Channel {
    /// Every channel, in a fixed order.
    pub const ALL: [Channel; 3] = [Channel::Control, Channel::Data, Channel::Blob];

    /// Parses the channel byte that opens a stream.
    pub fn from_u8(b: u8) -> Option<Self> {
        match b {
            1 => Some(Self::Control),
            2 => Some(Self::Data),
            3 => Some(Self::Blob),
            _ => None,
        }
    }
}

/// A frame that arrived, with where it came from.
#[derive(Clone, Debug)]
pub struct Delivery {
    /// The sending node.
    pub from: NodeId,
    /// The channel it came on.
    pub channel: Channel,
    /// The frame itself (already length-checked; access its body with checked rkyv).
    pub frame: Frame,
    /// What the frame keeps charged against its connection's memory budget, released when the
    /// delivery (and every clone of it) is dropped. `Held::default()` for frames not from QUIC.
    pub held: Held,
}

/// Why a send or receive failed.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// No connection to that node exists.
    #[error("unknown peer {0}")]
    UnknownPeer(NodeId),
    /// The peer is unreachable (crashed, partitioned, or its connection closed).
    #[error("peer {0} is down: {1}")]
    PeerDown(NodeId, String),
    /// This link was shut down.
    #[error("link closed")]
    Closed,
    /// A frame could not be encoded or was refused.
    #[error(transparent)]
    Frame(#[from] FrameError),
}

/// Frames between named nodes. Implementations must deliver frames of one channel between one
/// pair of nodes in order (or not at all), and must never block one channel on another.
pub trait Link: Send + Sync {
    /// This node's id.
    fn local_id(&self) -> &NodeId;

    /// Sends a frame to `to` on `channel`.
    fn send(
        &self,
        to: &NodeId,
        channel: Channel,
        frame: Frame,
    ) -> impl Future<Output = Result<(), LinkError>> + Send;

    /// Waits for the next frame addressed to this node.
    fn recv(&self) -> impl Future<Output = Result<Delivery, LinkError>> + Send;
}

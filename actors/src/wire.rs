//! Runtime messages that travel in frames between nodes (rkyv; always read with checked access).

use rkyv::{Archive, Deserialize, Serialize};

/// Body of a `FrameKind::Heartbeat` frame.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Heartbeat {
    /// Sequence number, increasing per sender.
    pub seq: u64,
}

/// One member as a node sees it.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct MemberView {
    /// Node name.
    pub name: String,
    /// "up" or "down".
    pub status: String,
    /// Milliseconds since it was last heard.
    pub last_heard_ms_ago: u64,
    /// QUIC's smoothed round-trip time to it in microseconds, as this node's connection
    /// measures it (`None` when not connected): what a topology's `[links] rtt_ms` is checked
    /// against.
    pub rtt_us: Option<u64>,
}

/// A device's memory budget as reported by its device actor.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct DeviceView {
    /// Device actor name.
    pub name: String,
    /// "cpu", "cuda:0", ...
    pub kind: String,
    /// Budget in bytes.
    pub budget_bytes: u64,
    /// Bytes in use.
    pub used_bytes: u64,
    /// External fragmentation of the free space (0..1).
    pub fragmentation: f64,
}

/// What `troupe status` shows for one node.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct NodeStatus {
    /// The node's name.
    pub node: String,
    /// Members and their state.
    pub members: Vec<MemberView>,
    /// Registered actor names on the node.
    pub actors: Vec<String>,
    /// Device budgets.
    pub devices: Vec<DeviceView>,
}

/// Control messages carried in `FrameKind::Message` frames on the control channel.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub enum ControlMsg {
    /// Asks the receiving node for its status.
    StatusRequest,
    /// The answer to a status request.
    StatusReply(NodeStatus),
}

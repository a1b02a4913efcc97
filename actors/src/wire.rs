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
    /// "up", "down" (silent past the timeout) or "left" (said goodbye).
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

/// Most executors a status may list residency for (more is refused on decode).
pub const MAX_STATUS_EXECUTORS: usize = 64;
/// Most queues a status may list.
pub const MAX_STATUS_QUEUES: usize = 64;
/// Most pipeline workers a status may list the stage of.
pub const MAX_STATUS_STAGES: usize = 256;
/// Most memory pools a status may list.
pub const MAX_STATUS_POOLS: usize = 32;
/// Most used-bytes samples one pool's history may carry (the node keeps this many).
pub const MAX_POOL_SAMPLES: usize = 120;
/// Most actors a status may list the mailbox depth of (the node counts at most this many).
pub const MAX_STATUS_MAILBOXES: usize = 64;

/// The experts one coe executor of this node holds, per tier, after its last command.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct ResidencyView {
    /// Executor name (as in the profile: `cpu0`, `gpu0-standin-cpu`, ...).
    pub executor: String,
    /// Experts resident on the device tier (sessions loaded).
    pub device_experts: u64,
    /// Bytes of those experts.
    pub device_bytes: u64,
    /// Experts kept in the host tier.
    pub host_experts: u64,
    /// Bytes of the host tier.
    pub host_bytes: u64,
}

/// The length of one queue a workload of this node owns.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct QueueView {
    /// Workload: `coe`, `pipeline`, `coadapt`.
    pub workload: String,
    /// Which queue (e.g. `outstanding`, `admitted`, `ready`, `running`, `uploads`).
    pub queue: String,
    /// Entries in it now.
    pub depth: u64,
}

/// How many counted messages wait in one actor's mailbox ([`crate::mailbox`]).
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct MailboxView {
    /// The actor's registered name (`coe-scheduler`, `coe-executor-cpu0`, ...).
    pub actor: String,
    /// Messages sent to it and not yet taken by its handler.
    pub depth: u64,
    /// The most that ever waited at once since the actor was first listed.
    pub max_depth: u64,
}

/// The stage a pipeline worker of this node holds live (none between stages).
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct StageView {
    /// The worker (its node name).
    pub worker: String,
    /// The live stage's index, if one is loaded.
    pub stage: Option<u32>,
}

/// One memory pool of this node (a coe executor's device arena, the coadapt edge's pool).
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct PoolView {
    /// Pool name (`coe/EXECUTOR/device`, `coadapt/edge`).
    pub pool: String,
    /// Bytes the pool may hand out.
    pub budget_bytes: u64,
    /// Bytes allocated now.
    pub used_bytes: u64,
    /// External fragmentation of its free space (0..1).
    pub fragmentation: f64,
    /// `(unix ms, used bytes)` at each change, oldest first, at most [`MAX_POOL_SAMPLES`].
    pub history: Vec<(u64, u64)>,
}

/// What `troupe status` shows for one node.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
pub struct NodeStatus {
    /// The node's name.
    pub node: String,
    /// Members and their state.
    pub members: Vec<MemberView>,
    /// Registered actor names on the node.
    pub actors: Vec<String>,
    /// Device budgets.
    pub devices: Vec<DeviceView>,
    /// Experts resident per tier on each local coe executor ([`crate::live`]).
    pub residency: Vec<ResidencyView>,
    /// Queue lengths of the local workloads ([`crate::live`]).
    pub queues: Vec<QueueView>,
    /// The stage each local pipeline worker holds ([`crate::live`]).
    pub stages: Vec<StageView>,
    /// Memory pools and their used bytes over time, kept by the node ([`crate::live`]).
    pub pools: Vec<PoolView>,
    /// Mailbox depths of the runtime's own actors ([`crate::mailbox`]).
    pub mailboxes: Vec<MailboxView>,
}

impl ArchivedNodeStatus {
    /// Refuses a status (from a peer) whose lists pass their caps, naming the list; checked on
    /// the archive, before anything is copied out of it.
    pub fn check_caps(&self) -> Result<(), String> {
        let lists = [
            ("residency", self.residency.len(), MAX_STATUS_EXECUTORS),
            ("queues", self.queues.len(), MAX_STATUS_QUEUES),
            ("stages", self.stages.len(), MAX_STATUS_STAGES),
            ("pools", self.pools.len(), MAX_STATUS_POOLS),
            ("mailboxes", self.mailboxes.len(), MAX_STATUS_MAILBOXES),
        ];
        for (what, got, cap) in lists {
            if got > cap {
                return Err(format!("status lists {got} {what}, over the cap of {cap}"));
            }
        }
        for p in self.pools.iter() {
            if p.history.len() > MAX_POOL_SAMPLES {
                return Err(format!(
                    "status pool {}: {} history samples, over the cap of {MAX_POOL_SAMPLES}",
                    p.pool,
                    p.history.len()
                ));
            }
        }
        Ok(())
    }
}

/// Control messages carried in `FrameKind::Message` frames on the control channel.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[allow(
    clippy::large_enum_variant,
    reason = "one is built per status request and encoded at once; boxing would change the archived layout for nothing"
)]
pub enum ControlMsg {
    /// Asks the receiving node for its status.
    StatusRequest,
    /// The answer to a status request.
    StatusReply(NodeStatus),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn archived_check(s: &NodeStatus) -> Result<(), String> {
        let bytes = rkyv::to_bytes::<rkyv::rancor::Error>(s).map_err(|e| e.to_string())?;
        let a = rkyv::access::<ArchivedNodeStatus, rkyv::rancor::Error>(&bytes).map_err(|e| e.to_string())?;
        a.check_caps()
    }

    #[test]
    fn a_status_past_a_list_cap_is_refused_naming_the_list() {
        let queue = |i: usize| QueueView { workload: "coe".into(), queue: format!("q{i}"), depth: 1 };
        let mut s =
            NodeStatus { queues: (0..MAX_STATUS_QUEUES).map(queue).collect(), ..NodeStatus::default() };
        assert_eq!(archived_check(&s), Ok(()));
        s.queues.push(queue(MAX_STATUS_QUEUES));
        let e = archived_check(&s).unwrap_err();
        assert!(e.contains("queues") && e.contains(&MAX_STATUS_QUEUES.to_string()), "{e}");

        let pool = PoolView {
            pool: "coadapt/edge".into(),
            budget_bytes: 1,
            used_bytes: 1,
            fragmentation: 0.0,
            history: vec![(0, 1); MAX_POOL_SAMPLES + 1],
        };
        let s = NodeStatus { pools: vec![pool], ..NodeStatus::default() };
        let e = archived_check(&s).unwrap_err();
        assert!(e.contains("coadapt/edge") && e.contains("history"), "{e}");

        let mailbox = |i: usize| MailboxView { actor: format!("a{i}"), depth: 0, max_depth: 1 };
        let mut s = NodeStatus {
            mailboxes: (0..MAX_STATUS_MAILBOXES).map(mailbox).collect(),
            ..NodeStatus::default()
        };
        assert_eq!(archived_check(&s), Ok(()));
        s.mailboxes.push(mailbox(MAX_STATUS_MAILBOXES));
        let e = archived_check(&s).unwrap_err();
        assert!(e.contains("mailboxes") && e.contains(&MAX_STATUS_MAILBOXES.to_string()), "{e}");
    }
}

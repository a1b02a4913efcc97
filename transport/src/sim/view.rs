//! The simulated peer view: [`RuntimeLink`] for [`SimLink`], read from its [`SimHub`].
//!
//! A node's peers are the other nodes linked on the hub that are not crashed, partitioned from it
//! or not, as a QUIC connection outlives a short partition (what is sent across one fails or is
//! lost); a member is a peer it can reach now: neither of the two crashed, no partition between
//! them. Roles come from the table given at build time
//! ([`SimHub::set_roles`]); the router checks them exactly as it checks a certificate's.

use super::{HubState, SimHub, SimLink};
use crate::link::NodeId;
use crate::roles::RoleSet;
use crate::runtime_link::{DeliverySink, RuntimeLink};

impl HubState {
    /// Whether `a` and `b` are two live nodes (a partition between them or not).
    pub(super) fn linked(&self, a: &NodeId, b: &NodeId) -> bool {
        a != b && !self.net.is_crashed(a) && !self.net.is_crashed(b)
    }

    /// Whether `a` and `b` reach each other now.
    pub(super) fn reachable(&self, a: &NodeId, b: &NodeId) -> bool {
        self.linked(a, b) && !self.net.is_partitioned(a, b)
    }
}

impl SimHub {
    /// Gives `node` these roles (what its certificate would say).
    pub fn set_roles(&self, node: &NodeId, roles: RoleSet) {
        self.lock().roles.insert(node.clone(), roles);
    }
}

impl SimLink {
    /// The sink service frames go to, when one is set.
    pub(super) fn service_sink(&self) -> Option<DeliverySink> {
        self.hub.lock().sinks.get(&self.id).cloned()
    }
}

impl RuntimeLink for SimLink {
    fn peers(&self) -> Vec<NodeId> {
        let s = self.hub.lock();
        // inboxes is a BTreeMap: the peers come sorted, the same in every run
        s.inboxes.keys().filter(|p| s.linked(&self.id, p)).cloned().collect()
    }

    fn is_member(&self, peer: &NodeId) -> bool {
        let s = self.hub.lock();
        s.inboxes.contains_key(peer) && s.reachable(&self.id, peer)
    }

    fn local_roles(&self) -> RoleSet {
        self.hub.lock().roles.get(&self.id).copied().unwrap_or_default()
    }

    fn peer_roles(&self, peer: &NodeId) -> Option<RoleSet> {
        let s = self.hub.lock();
        s.reachable(&self.id, peer).then(|| s.roles.get(peer).copied().unwrap_or_default())
    }

    fn take_heard(&self, peer: &NodeId) -> bool {
        let mut s = self.hub.lock();
        let heard = s.heard.remove(&(self.id.clone(), peer.clone()));
        heard && s.reachable(&self.id, peer)
    }

    fn set_service_sink(&self, sink: DeliverySink) {
        self.hub.lock().sinks.insert(self.id.clone(), sink);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::{Frame, FrameKind};
    use crate::link::{Channel, Link};
    use crate::roles::Role;
    use crate::sim::SimConfig;

    #[tokio::test]
    async fn the_peer_view_follows_crashes_partitions_and_what_arrived() {
        let hub = SimHub::new(SimConfig::default());
        let (a, b, c) = (NodeId::new("a"), NodeId::new("b"), NodeId::new("c"));
        let la = hub.link(a.clone());
        let lb = hub.link(b.clone());
        let _lc = hub.link(c.clone());
        hub.set_roles(&b, RoleSet::only(Role::Executor));
        assert_eq!(la.peers(), vec![b.clone(), c.clone()]);
        assert_eq!(la.peer_roles(&b), Some(RoleSet::only(Role::Executor)));
        assert_eq!(la.peer_roles(&c), Some(RoleSet::default()));
        assert_eq!(lb.local_roles(), RoleSet::only(Role::Executor));

        assert!(!la.take_heard(&b));
        lb.send(&a, Channel::Control, Frame::from_bytes(FrameKind::Heartbeat, 0, b"x")).await.unwrap();
        hub.advance_by(troupe_policy::Micros::from_millis(20));
        assert!(la.take_heard(&b), "a frame from b was released to a");
        assert!(!la.take_heard(&b), "taken once");

        hub.with_net(|net, now| net.partition(now, &a, &c));
        assert_eq!(la.peers(), vec![b.clone(), c.clone()], "a partition keeps the peer");
        assert!(!la.is_member(&c), "but it is no member while cut off");
        hub.crash(&b);
        assert_eq!(la.peers(), vec![c.clone()], "a crashed node is no peer; the cut-off one still is");
        assert_eq!(la.peer_roles(&b), None);
        assert!(lb.peers().is_empty(), "a crashed node reaches nobody");
    }
}

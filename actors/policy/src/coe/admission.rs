//! Admission of client requests to a serving coe scheduler: a bounded number outstanding per
//! node and per peer; past either bound the answer is busy (backpressure), so the queue never
//! grows without bound and one client cannot take every slot from the others.

/// The bounds of a serving scheduler.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdmissionLimits {
    /// Requests accepted and not yet answered, over all clients.
    pub per_node: usize,
    /// Requests accepted and not yet answered, from one client.
    pub per_peer: usize,
}

/// What to do with one arriving request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Accept it (journal it, then schedule it).
    Accept,
    /// Refuse it: the node already holds `per_node` outstanding requests.
    BusyNode,
    /// Refuse it: this peer already holds `per_peer` outstanding requests.
    BusyPeer,
}

/// Decides on a request given what is outstanding now, on the node and from its sender.
pub fn admit(limits: AdmissionLimits, node_outstanding: usize, peer_outstanding: usize) -> Admission {
    if node_outstanding >= limits.per_node {
        Admission::BusyNode
    } else if peer_outstanding >= limits.per_peer {
        Admission::BusyPeer
    } else {
        Admission::Accept
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_below_both_bounds_and_is_busy_at_either() {
        let l = AdmissionLimits { per_node: 3, per_peer: 2 };
        assert_eq!(admit(l, 0, 0), Admission::Accept);
        assert_eq!(admit(l, 2, 1), Admission::Accept);
        assert_eq!(admit(l, 2, 2), Admission::BusyPeer);
        assert_eq!(admit(l, 3, 0), Admission::BusyNode);
        assert_eq!(admit(l, 9, 9), Admission::BusyNode);
        let none = AdmissionLimits { per_node: 0, per_peer: 5 };
        assert_eq!(admit(none, 0, 0), Admission::BusyNode);
    }
}

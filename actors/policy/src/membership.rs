//! Failure detection from heartbeats: a member is down once nothing was heard from it for
//! `timeout`; hearing from it again brings it back up (a rejoin).
//!
//! Silence counts only while the detector was watching. Its shell looks every `period`
//! ([`FailureDetector::with_check_period`]); a look that comes later than that means this node
//! itself was stalled (a loaded box, a paused process), and what its peers sent meanwhile may
//! still sit unread in its sockets. Declaring them down then would blame healthy members for
//! the observer's stall, so the lateness is not counted as their silence (as Cassandra's gossip
//! does not convict after a local pause). A member that is really gone is declared down at most
//! one stall later than its timeout.
//!
//! Calling protocol: feed every heartbeat (or any frame) with [`FailureDetector::handle_heard`];
//! call [`FailureDetector::handle_timeout`] at (or after) [`FailureDetector::poll_timeout`];
//! drain [`FailureDetector::poll_event`] after each call.

use std::collections::{BTreeMap, VecDeque};

use crate::Micros;

/// A member's state as this detector sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemberStatus {
    /// Heard from within the timeout.
    Up,
    /// Silent for longer than the timeout.
    Down,
    /// Said goodbye (an orderly shutdown): gone at once, without waiting for the timeout.
    Left,
}

/// A change of membership, delivered to subscribers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MembershipEvent<K> {
    /// First heard from, or heard again after being down.
    Up {
        /// The member.
        member: K,
        /// When it was heard.
        at: Micros,
        /// True when it had been down before (a rejoin).
        rejoined: bool,
    },
    /// Silent for longer than the timeout, or left on purpose ([`MemberStatus::Left`]): either
    /// way gone, and what it held must be placed elsewhere.
    Down {
        /// The member.
        member: K,
        /// When the detector declared it down.
        at: Micros,
        /// When it was last heard, moved later by any stall of this node since (silence is
        /// counted only while the detector watched).
        last_heard: Micros,
    },
}

#[derive(Clone, Copy, Debug)]
struct Member {
    last_heard: Micros,
    status: MemberStatus,
}

/// Timeout-based failure detector over members keyed by `K`.
#[derive(Clone, Debug)]
pub struct FailureDetector<K> {
    timeout: Micros,
    /// How often the shell looks (`None`: lateness is not tracked).
    check_period: Option<Micros>,
    /// When it last looked.
    last_check: Option<Micros>,
    /// How late the last look was (past the period): not counted as silence.
    last_stall: Micros,
    members: BTreeMap<K, Member>,
    events: VecDeque<MembershipEvent<K>>,
}

impl<K: Ord + Clone> FailureDetector<K> {
    /// A detector declaring members down after `timeout` of silence.
    pub fn new(timeout: Micros) -> Self {
        Self {
            timeout,
            check_period: None,
            last_check: None,
            last_stall: Micros::ZERO,
            members: BTreeMap::new(),
            events: VecDeque::new(),
        }
    }

    /// The same, told that [`Self::handle_timeout`] is called at least every `period`: a call
    /// that comes later finds this node was stalled, and the lateness (the gap past `period`)
    /// is not counted as any member's silence.
    pub fn with_check_period(mut self, period: Micros) -> Self {
        self.check_period = Some(period);
        self
    }

    /// The configured timeout.
    pub fn timeout(&self) -> Micros {
        self.timeout
    }

    /// Records that `member` was heard from at `now`.
    pub fn handle_heard(&mut self, now: Micros, member: K) {
        match self.members.get_mut(&member) {
            Some(m) => {
                m.last_heard = m.last_heard.max(now);
                if m.status != MemberStatus::Up {
                    m.status = MemberStatus::Up;
                    self.events.push_back(MembershipEvent::Up { member, at: now, rejoined: true });
                }
            }
            None => {
                self.members.insert(member.clone(), Member { last_heard: now, status: MemberStatus::Up });
                self.events.push_back(MembershipEvent::Up { member, at: now, rejoined: false });
            }
        }
    }

    /// Declares down every member silent for longer than the timeout at `now`, not counting a
    /// stall of this node since the last call (see [`Self::with_check_period`]).
    pub fn handle_timeout(&mut self, now: Micros) {
        if let (Some(period), Some(last)) = (self.check_period, self.last_check) {
            let late = now.saturating_sub(last).saturating_sub(period);
            self.last_stall = late;
            if late > Micros::ZERO {
                for m in self.members.values_mut().filter(|m| m.status == MemberStatus::Up) {
                    m.last_heard = (m.last_heard + late).min(now);
                }
            }
        }
        self.last_check = Some(self.last_check.map_or(now, |l| l.max(now)));
        for (k, m) in self.members.iter_mut() {
            if m.status == MemberStatus::Up && now.saturating_sub(m.last_heard) > self.timeout {
                m.status = MemberStatus::Down;
                self.events.push_back(MembershipEvent::Down {
                    member: k.clone(),
                    at: now,
                    last_heard: m.last_heard,
                });
            }
        }
    }

    /// Records that `member` left on purpose at `now` (it said goodbye): it is gone at once,
    /// as if it had timed out ([`MembershipEvent::Down`]), and its status is
    /// [`MemberStatus::Left`]. Hearing from it again is a rejoin. An unknown member is ignored.
    pub fn handle_left(&mut self, now: Micros, member: &K) {
        if let Some(m) = self.members.get_mut(member)
            && m.status == MemberStatus::Up
        {
            m.status = MemberStatus::Left;
            self.events.push_back(MembershipEvent::Down {
                member: member.clone(),
                at: now,
                last_heard: m.last_heard,
            });
        }
    }

    /// How late the last [`Self::handle_timeout`] came past the check period: a stall of this
    /// node, not counted as its members' silence (zero when on time or untracked).
    pub fn last_stall(&self) -> Micros {
        self.last_stall
    }

    /// Records that `member` restarted (a new process under its name, seen at `now` by the
    /// transport before its silence could time out): the old incarnation is gone and what it
    /// held with it, so it is declared down at once ([`MembershipEvent::Down`]) and, as the new
    /// one is heard, up again (a rejoin). Without this a restart quicker than the timeout went
    /// unnoticed and what the old process held was never placed again (the fault explorer's
    /// `typed` seed 7). A member never heard yet is declared down all the same (seed 69: its
    /// old process crashed before its first heartbeat, holding a child just placed on it); a
    /// member already down or gone is only heard again.
    pub fn handle_restarted(&mut self, now: Micros, member: K) {
        let m = self
            .members
            .entry(member.clone())
            .or_insert(Member { last_heard: now, status: MemberStatus::Up });
        if m.status == MemberStatus::Up {
            m.status = MemberStatus::Down;
            self.events.push_back(MembershipEvent::Down {
                member: member.clone(),
                at: now,
                last_heard: m.last_heard,
            });
        }
        self.handle_heard(now, member);
    }

    /// The next membership change, if any.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<MembershipEvent<K>> {
        self.events.pop_front()
    }

    /// When the next member may time out: call [`Self::handle_timeout`] then.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Micros> {
        self.members
            .values()
            .filter(|m| m.status == MemberStatus::Up)
            .map(|m| m.last_heard + self.timeout + Micros(1))
            .min()
    }

    /// Status of one member, if known.
    pub fn status(&self, member: &K) -> Option<MemberStatus> {
        self.members.get(member).map(|m| m.status)
    }

    /// Every known member with its status and when it was last heard.
    pub fn members(&self) -> impl Iterator<Item = (&K, MemberStatus, Micros)> {
        self.members.iter().map(|(k, m)| (k, m.status, m.last_heard))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(d: &mut FailureDetector<&'static str>) -> Vec<MembershipEvent<&'static str>> {
        std::iter::from_fn(|| d.poll_event()).collect()
    }

    #[test]
    fn down_after_timeout_and_rejoin() {
        let mut d = FailureDetector::new(Micros::from_millis(100));
        d.handle_heard(Micros(0), "a");
        d.handle_heard(Micros(0), "b");
        assert_eq!(drain(&mut d).len(), 2);
        assert_eq!(d.poll_timeout(), Some(Micros(100_001)));
        d.handle_heard(Micros::from_millis(90), "b");
        d.handle_timeout(Micros::from_millis(100));
        assert!(drain(&mut d).is_empty(), "exactly at the timeout nobody is down yet");
        d.handle_timeout(Micros(100_001));
        assert_eq!(
            drain(&mut d),
            vec![MembershipEvent::Down { member: "a", at: Micros(100_001), last_heard: Micros(0) }]
        );
        assert_eq!(d.poll_timeout(), Some(Micros(190_001)));
        d.handle_heard(Micros::from_millis(150), "a");
        assert_eq!(
            drain(&mut d),
            vec![MembershipEvent::Up { member: "a", at: Micros(150_000), rejoined: true }]
        );
        assert_eq!(d.status(&"a"), Some(MemberStatus::Up));
    }

    #[test]
    fn a_stall_of_the_observer_is_not_counted_as_its_members_silence() {
        let mut d =
            FailureDetector::new(Micros::from_millis(2000)).with_check_period(Micros::from_millis(200));
        d.handle_heard(Micros(0), "a");
        d.handle_heard(Micros(0), "b");
        let _ = drain(&mut d);
        d.handle_timeout(Micros::from_millis(200));
        // this node stalls for 2.3 s: its next look is 2.1 s late, and nothing was read meanwhile
        d.handle_timeout(Micros::from_millis(2700));
        assert!(drain(&mut d).is_empty(), "members silent only while this node was stalled are not down");
        assert_eq!(d.last_stall(), Micros::from_millis(2300));
        assert_eq!(d.status(&"a"), Some(MemberStatus::Up));
        // the frames read after the stall count; a member that stays silent is down a timeout
        // of watched time after it was last heard
        d.handle_heard(Micros::from_millis(2750), "b");
        let mut t = 2700;
        while t < 4500 {
            t += 200;
            d.handle_timeout(Micros::from_millis(t));
        }
        assert_eq!(
            drain(&mut d),
            vec![MembershipEvent::Down {
                member: "a",
                at: Micros::from_millis(4500),
                last_heard: Micros::from_millis(2300)
            }]
        );
        assert_eq!(d.status(&"b"), Some(MemberStatus::Up));
    }

    #[test]
    fn without_a_check_period_silence_is_wall_time() {
        let mut d = FailureDetector::new(Micros::from_millis(2000));
        d.handle_heard(Micros(0), "a");
        let _ = drain(&mut d);
        d.handle_timeout(Micros::from_millis(200));
        d.handle_timeout(Micros::from_millis(2700));
        assert_eq!(d.status(&"a"), Some(MemberStatus::Down));
    }

    #[test]
    fn a_restarted_member_is_down_then_up_at_once() {
        let mut d = FailureDetector::new(Micros(1_000_000));
        d.handle_heard(Micros(0), "a");
        let _ = d.poll_event();
        d.handle_restarted(Micros(40), "a");
        assert_eq!(
            drain(&mut d),
            vec![
                MembershipEvent::Down { member: "a", at: Micros(40), last_heard: Micros(0) },
                MembershipEvent::Up { member: "a", at: Micros(40), rejoined: true },
            ]
        );
        assert_eq!(d.status(&"a"), Some(MemberStatus::Up));
        d.handle_restarted(Micros(50), "b");
        assert_eq!(
            drain(&mut d),
            vec![
                MembershipEvent::Down { member: "b", at: Micros(50), last_heard: Micros(50) },
                MembershipEvent::Up { member: "b", at: Micros(50), rejoined: true },
            ],
            "never heard before: its old process is gone all the same"
        );
        d.handle_timeout(Micros(2_000_000));
        let _ = drain(&mut d);
        d.handle_restarted(Micros(2_000_001), "b");
        assert_eq!(
            drain(&mut d),
            vec![MembershipEvent::Up { member: "b", at: Micros(2_000_001), rejoined: true }],
            "already down: only up again"
        );
    }

    #[test]
    fn late_heartbeat_does_not_move_time_backwards() {
        let mut d = FailureDetector::new(Micros(10));
        d.handle_heard(Micros(50), "a");
        d.handle_heard(Micros(20), "a");
        d.handle_timeout(Micros(60));
        assert_eq!(d.status(&"a"), Some(MemberStatus::Up));
    }

    #[test]
    fn a_member_that_leaves_is_gone_at_once_and_may_rejoin() {
        let mut d = FailureDetector::new(Micros(1_000_000));
        d.handle_heard(Micros(0), "a");
        let _ = d.poll_event();
        d.handle_left(Micros(10), &"a");
        assert_eq!(
            d.poll_event(),
            Some(MembershipEvent::Down { member: "a", at: Micros(10), last_heard: Micros(0) })
        );
        assert_eq!(d.status(&"a"), Some(MemberStatus::Left));
        assert_eq!(d.poll_timeout(), None, "a member that left is not timed out again");
        d.handle_left(Micros(20), &"a");
        d.handle_left(Micros(20), &"stranger");
        assert_eq!(d.poll_event(), None, "leaving twice, or unknown, changes nothing");
        d.handle_heard(Micros(30), "a");
        assert_eq!(d.poll_event(), Some(MembershipEvent::Up { member: "a", at: Micros(30), rejoined: true }));
    }
}

//! Who is in service: the pure roster a scheduler shell keeps of the members it sends work to
//! (the pipeline foreman's workers, the coe scheduler's executors).
//!
//! Each member is known by its index. The roster holds, per member:
//! - its **epoch**: the generation of the link the shell reaches it through. A report carries the
//!   epoch of the link it came on; one from an older epoch (a call to a dead process that ended
//!   after a newer link was installed), or about a lost member, is stale and ignored
//!   ([`Roster::is_current`]);
//! - its **incarnation**: the process id it reported when it joined. A report from the same
//!   member naming another pid means its process was restarted before membership noticed: the
//!   member is lost ([`Roster::check_incarnation`]) and joined again afresh;
//! - its **health**: syncing (its epoch began; reports before its reset's answer are a dead
//!   incarnation's), ready, or lost; a lost member is rejoining, and *joining* while a join call to
//!   it is in flight ([`Roster::rejoin_candidates`]);
//! - what it is **busy** with, when the shell tracks that (`W`; `()` when it does not).
//!
//! When every member is lost the job waits for one to come back until the **all-lost deadline**
//! ([`Roster::all_lost`]): a stall that made members look down must not end a job, but a crowd
//! that never returns must. Time comes from the caller ([`Micros`]), so the same roster runs
//! live and under a seeded simulation.

use crate::time::Micros;

/// A member's health.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Health {
    /// A new epoch began (a reset was sent): only its answer, a loss or a failure count.
    Syncing,
    /// In service.
    Ready,
    /// Lost: rejoining, with a join call in flight when `joining`.
    Lost {
        /// A join call to it is in flight.
        joining: bool,
    },
}

/// One member as the roster sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Member<W> {
    /// The generation of the link it is reached through (0: none yet).
    pub epoch: u64,
    /// The process id it joined with (0: unknown).
    pub pid: u32,
    /// Its health.
    pub health: Health,
    /// What it is busy with, as the shell last set it.
    pub busy: Option<W>,
    /// Times it was put back in service after being lost.
    pub rejoined: usize,
}

impl<W> Member<W> {
    fn lost() -> Self {
        Member { epoch: 0, pid: 0, health: Health::Lost { joining: false }, busy: None, rejoined: 0 }
    }

    /// Whether it is lost.
    pub fn is_lost(&self) -> bool {
        matches!(self.health, Health::Lost { .. })
    }
}

/// What a member's report of its process id says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Incarnation {
    /// The process that joined (or an unknown pid): nothing to do.
    Same,
    /// Another process answered: the member was restarted; the roster has marked it lost.
    Restarted {
        /// The pid that joined.
        old: u32,
        /// The pid that answered.
        new: u32,
    },
}

/// Where the all-lost wait stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AllLost {
    /// Some member is in service (or the roster has no deadline).
    No,
    /// Every member has just been found lost: the wait began and ends at `deadline`.
    Began {
        /// When the job gives up.
        deadline: Micros,
    },
    /// Every member is lost; still waiting until `deadline`.
    Waiting {
        /// When the job gives up.
        deadline: Micros,
    },
    /// Every member is lost and the deadline has come.
    Expired,
}

/// Why a newer epoch was adopted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Adopted {
    /// Not newer than the one in use: nothing changed.
    Stale,
    /// Adopted; the member was in service on the old epoch (its work there is gone: the shell
    /// tells its policy the member was lost before it is restored).
    Replaced,
    /// Adopted; the member was lost.
    Restored,
}

/// The roster: members by index, and the all-lost deadline.
#[derive(Clone, Debug)]
pub struct Roster<W = ()> {
    members: Vec<Member<W>>,
    /// How long every member may be lost before the job gives up (`None`: forever).
    all_lost_wait: Option<Micros>,
    /// When the current all-lost wait ends.
    deadline: Option<Micros>,
}

impl<W: Copy> Roster<W> {
    /// `n` members, all lost until they join; no all-lost deadline.
    pub fn new(n: usize) -> Self {
        Roster { members: vec![Member::lost(); n], all_lost_wait: None, deadline: None }
    }

    /// The same, giving up `wait` after every member was found lost.
    pub fn with_all_lost_wait(mut self, wait: Micros) -> Self {
        self.all_lost_wait = Some(wait);
        self
    }

    /// Number of members.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Whether there are no members.
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Member `m`, if there is one.
    pub fn member(&self, m: usize) -> Option<&Member<W>> {
        self.members.get(m)
    }

    /// Whether member `m` is lost (an unknown member counts as lost).
    pub fn is_lost(&self, m: usize) -> bool {
        self.members.get(m).is_none_or(Member::is_lost)
    }

    /// Whether every member is lost (true with none).
    pub fn every_lost(&self) -> bool {
        self.members.iter().all(Member::is_lost)
    }

    /// Members in service (ready or syncing).
    pub fn in_service(&self) -> usize {
        self.members.iter().filter(|m| !m.is_lost()).count()
    }

    /// Member `m` joined (or rejoined) on link epoch `epoch` as process `pid` (0: unknown): it is
    /// ready. A lost member counts one more rejoin unless this is its first join. The all-lost
    /// wait, if any, is over.
    pub fn joined(&mut self, m: usize, epoch: u64, pid: u32) {
        let Some(member) = self.members.get_mut(m) else { return };
        let rejoin = member.is_lost() && member.epoch != 0;
        *member = Member {
            epoch,
            pid,
            health: Health::Ready,
            busy: None,
            rejoined: member.rejoined + usize::from(rejoin),
        };
        self.deadline = None;
    }

    /// Member `m`'s reports now come on link epoch `epoch`, from its start: it is syncing (reset
    /// sent) until [`Roster::synced`].
    pub fn syncing(&mut self, m: usize, epoch: u64) {
        let Some(member) = self.members.get_mut(m) else { return };
        member.epoch = epoch;
        member.health = Health::Syncing;
        member.busy = None;
        self.deadline = None;
    }

    /// Member `m` answered its reset: ready.
    pub fn synced(&mut self, m: usize) {
        if let Some(member) = self.members.get_mut(m).filter(|x| x.health == Health::Syncing) {
            member.health = Health::Ready;
        }
    }

    /// A newer link epoch for member `m`, installed while the shell runs: adopted when newer
    /// than the one in use (the member then syncs on it, and counts one more return to service),
    /// else stale.
    pub fn adopt(&mut self, m: usize, epoch: u64) -> Adopted {
        let Some(member) = self.members.get(m) else { return Adopted::Stale };
        if epoch <= member.epoch {
            return Adopted::Stale;
        }
        let was_lost = member.is_lost();
        self.syncing(m, epoch);
        if let Some(member) = self.members.get_mut(m) {
            member.rejoined += 1;
        }
        if was_lost { Adopted::Restored } else { Adopted::Replaced }
    }

    /// Whether a report from member `m` on link epoch `epoch` counts: not from an older or newer
    /// epoch than the one in use, and not about a lost member.
    pub fn is_current(&self, m: usize, epoch: u64) -> bool {
        self.members.get(m).is_some_and(|x| !x.is_lost() && x.epoch == epoch)
    }

    /// Marks member `m` lost (it is then rejoining). Returns whether it was in service, so the
    /// shell re-plans its work once only.
    pub fn lose(&mut self, m: usize) -> bool {
        let Some(member) = self.members.get_mut(m) else { return false };
        if member.is_lost() {
            return false;
        }
        member.health = Health::Lost { joining: false };
        member.busy = None;
        true
    }

    /// Member `m` answered with process id `pid` (0: it did not say): another pid than the one
    /// that joined means it was restarted, and it is marked lost here.
    pub fn check_incarnation(&mut self, m: usize, pid: u32) -> Incarnation {
        let Some(member) = self.members.get(m) else { return Incarnation::Same };
        if pid == 0 || member.pid == 0 || pid == member.pid || member.is_lost() {
            return Incarnation::Same;
        }
        let old = member.pid;
        self.lose(m);
        Incarnation::Restarted { old, new: pid }
    }

    /// Lost members no join call is in flight to (the shell tries those whose node is
    /// announced again).
    pub fn rejoin_candidates(&self) -> Vec<usize> {
        let idle = |x: &Member<W>| x.health == Health::Lost { joining: false };
        self.members.iter().enumerate().filter(|(_, x)| idle(x)).map(|(i, _)| i).collect()
    }

    /// A join call to lost member `m` was sent.
    pub fn rejoin_started(&mut self, m: usize) {
        if let Some(member) = self.members.get_mut(m).filter(|x| x.is_lost()) {
            member.health = Health::Lost { joining: true };
        }
    }

    /// The join call to member `m` failed: it may be tried again.
    pub fn rejoin_failed(&mut self, m: usize) {
        if let Some(member) = self.members.get_mut(m).filter(|x| x.is_lost()) {
            member.health = Health::Lost { joining: false };
        }
    }

    /// Sets what member `m` is busy with (`None`: idle).
    pub fn set_busy(&mut self, m: usize, busy: Option<W>) {
        if let Some(member) = self.members.get_mut(m) {
            member.busy = busy;
        }
    }

    /// What member `m` is busy with.
    pub fn busy(&self, m: usize) -> Option<W> {
        self.members.get(m).and_then(|x| x.busy)
    }

    /// Where the all-lost wait stands at `now`: it begins the first time this is asked with
    /// every member lost, and expires exactly at its deadline (`now >= deadline`).
    pub fn all_lost(&mut self, now: Micros) -> AllLost {
        let Some(wait) = self.all_lost_wait else { return AllLost::No };
        if !self.every_lost() {
            self.deadline = None;
            return AllLost::No;
        }
        match self.deadline {
            None => {
                let deadline = now + wait;
                self.deadline = Some(deadline);
                if now >= deadline { AllLost::Expired } else { AllLost::Began { deadline } }
            }
            Some(deadline) if now >= deadline => AllLost::Expired,
            Some(deadline) => AllLost::Waiting { deadline },
        }
    }

    /// When the roster next wants to be asked [`Roster::all_lost`]: the all-lost deadline.
    pub fn poll_timeout(&self) -> Option<Micros> {
        self.deadline
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn three() -> Roster {
        let mut r = Roster::new(3).with_all_lost_wait(Micros::from_secs(30));
        for m in 0..3 {
            r.joined(m, 1, 100 + m as u32);
        }
        r
    }

    #[test]
    fn a_stale_epochs_report_is_ignored() {
        let mut r = three();
        assert!(r.is_current(0, 1));
        assert_eq!(r.adopt(0, 2), Adopted::Replaced);
        assert!(!r.is_current(0, 1), "the old link's report is stale");
        assert!(r.is_current(0, 2));
        assert_eq!(r.adopt(0, 2), Adopted::Stale, "the same epoch is not adopted twice");
        assert_eq!(r.adopt(0, 1), Adopted::Stale, "nor an older one");
        assert!(!r.is_current(0, 3), "nor is a report from an epoch not adopted yet");
    }

    #[test]
    fn a_lost_members_report_is_ignored_until_it_rejoins() {
        let mut r = three();
        assert!(r.lose(1));
        assert!(!r.lose(1), "lost once");
        assert!(!r.is_current(1, 1));
        r.joined(1, 2, 200);
        assert!(r.is_current(1, 2));
        assert!(!r.is_current(1, 1));
        assert_eq!(r.member(1).map(|x| x.rejoined), Some(1));
    }

    #[test]
    fn a_pid_mismatch_marks_the_member_lost() {
        let mut r = three();
        assert_eq!(r.check_incarnation(2, 102), Incarnation::Same);
        assert_eq!(r.check_incarnation(2, 0), Incarnation::Same, "no pid said: nothing known");
        assert_eq!(r.check_incarnation(2, 999), Incarnation::Restarted { old: 102, new: 999 });
        assert!(r.is_lost(2));
        assert_eq!(r.check_incarnation(2, 998), Incarnation::Same, "lost once");
        assert_eq!(r.rejoin_candidates(), vec![2]);
    }

    #[test]
    fn joining_members_are_not_offered_again_until_the_call_fails() {
        let mut r = three();
        r.lose(0);
        r.lose(2);
        assert_eq!(r.rejoin_candidates(), vec![0, 2]);
        r.rejoin_started(0);
        assert_eq!(r.rejoin_candidates(), vec![2]);
        r.rejoin_failed(0);
        assert_eq!(r.rejoin_candidates(), vec![0, 2]);
        r.rejoin_started(1);
        assert_eq!(r.member(1).map(|x| x.health), Some(Health::Ready), "only lost members join again");
    }

    #[test]
    fn the_all_lost_deadline_fires_exactly_at_its_time() {
        let mut r = three();
        assert_eq!(r.all_lost(Micros(10)), AllLost::No);
        for m in 0..3 {
            r.lose(m);
        }
        let deadline = Micros(1_000) + Micros::from_secs(30);
        assert_eq!(r.all_lost(Micros(1_000)), AllLost::Began { deadline });
        assert_eq!(r.poll_timeout(), Some(deadline));
        assert_eq!(r.all_lost(deadline - Micros(1)), AllLost::Waiting { deadline });
        assert_eq!(r.all_lost(deadline), AllLost::Expired);
    }

    #[test]
    fn a_member_back_ends_the_all_lost_wait() {
        let mut r = three();
        for m in 0..3 {
            r.lose(m);
        }
        assert!(matches!(r.all_lost(Micros(0)), AllLost::Began { .. }));
        r.joined(1, 2, 300);
        assert_eq!(r.poll_timeout(), None);
        assert_eq!(r.all_lost(Micros::from_secs(60)), AllLost::No);
        r.lose(1);
        let deadline = Micros::from_secs(61) + Micros::from_secs(30);
        assert_eq!(r.all_lost(Micros::from_secs(61)), AllLost::Began { deadline }, "a fresh wait");
    }

    #[test]
    fn without_a_wait_the_roster_never_gives_up() {
        let mut r: Roster = Roster::new(1);
        assert!(r.every_lost());
        assert_eq!(r.all_lost(Micros(u64::MAX)), AllLost::No);
    }

    #[test]
    fn a_syncing_member_is_ready_once_synced_and_losing_it_clears_its_work() {
        let mut r: Roster<u32> = Roster::new(2);
        r.syncing(0, 1);
        assert_eq!(r.member(0).map(|x| (x.health, x.rejoined)), Some((Health::Syncing, 0)));
        r.synced(0);
        r.set_busy(0, Some(7));
        assert_eq!(r.busy(0), Some(7));
        r.lose(0);
        assert_eq!(r.busy(0), None);
        assert_eq!(r.adopt(0, 2), Adopted::Restored);
        assert_eq!(r.member(0).map(|x| x.rejoined), Some(1), "an adopted epoch is a restoration");
        r.synced(1);
        assert!(r.is_lost(1), "only a syncing member becomes ready by syncing");
    }
}

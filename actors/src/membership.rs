//! Membership actor: sends a heartbeat to every joined peer each period, feeds what it hears
//! into `troupe_policy::FailureDetector`, and broadcasts up/down events to subscribers.

use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use ractor_cluster::RactorMessage;
use tokio::sync::broadcast;
use tracing::{debug, info, warn};
use troupe_policy::{FailureDetector, MemberStatus, MembershipEvent, Micros};
use troupe_transport::{Channel, Frame, FrameKind, Link, NodeId, NodeLink, RuntimeLink};

use crate::clock::Clock;
use crate::wire::Heartbeat;

/// Membership settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MembershipConfig {
    /// Heartbeat period.
    pub heartbeat: Duration,
    /// Silence after which a member is declared down.
    pub timeout: Duration,
}

impl Default for MembershipConfig {
    fn default() -> Self {
        Self { heartbeat: Duration::from_millis(200), timeout: Duration::from_millis(1500) }
    }
}

/// Start arguments of the membership actor.
pub struct MembershipArgs {
    /// The node's link (QUIC, or simulated).
    pub link: NodeLink,
    /// Periods.
    pub config: MembershipConfig,
    /// Where up/down events go.
    pub events: broadcast::Sender<MembershipEvent<NodeId>>,
}

/// Messages of the membership actor.
#[derive(RactorMessage)]
pub enum MembershipMsg {
    /// Heartbeat period elapsed: send heartbeats, check timeouts.
    Tick,
    /// A member's timeout falls before the next tick: check then (what was heard counts first),
    /// so a silent member is declared down at its deadline, not up to a period later.
    Check,
    /// This peer joined (later frames are seen through [`RuntimeLink::take_heard`] at each tick).
    Heard(NodeId),
    /// This peer restarted (its transport saw a new process under its name): what the old one
    /// held is gone, so it is declared down and up again at once.
    Restarted(NodeId),
    /// This peer said goodbye (closed its connections in an orderly shutdown).
    Left(NodeId),
    /// The current view: member, status, when last heard (clock micros).
    Members(RpcReplyPort<Vec<(NodeId, MemberStatus, Micros)>>),
    /// The membership clock's current time (to interpret `Members`).
    Now(RpcReplyPort<Micros>),
}

/// The membership actor (a thin shell around the failure detector).
pub struct Membership;

/// State: the detector and the handles it needs.
pub struct MembershipState {
    link: NodeLink,
    detector: FailureDetector<NodeId>,
    clock: Clock,
    seq: u64,
    events: broadcast::Sender<MembershipEvent<NodeId>>,
    heartbeat: std::time::Duration,
}

impl MembershipState {
    /// What was read from a peer since the last look counts as heard now (at most a period
    /// late, against a timeout of several periods); then members past their timeout are down.
    fn look(&mut self) {
        let now = self.clock.now();
        for peer in self.link.peers() {
            if self.link.take_heard(&peer) {
                self.detector.handle_heard(now, peer);
            }
        }
        self.detector.handle_timeout(now);
        let stall = self.detector.last_stall();
        if stall > Micros::from_duration(self.heartbeat) {
            info!(node = %self.link_id(), stall_ms = stall.as_millis(), "this node stalled; not counted as its members' silence");
        }
    }

    /// Arms a [`MembershipMsg::Check`] at the detector's next deadline when it comes before the
    /// next tick.
    fn arm(&self, me: &ActorRef<MembershipMsg>) {
        let now = self.clock.now();
        if let Some(deadline) = self.detector.poll_timeout() {
            let wait = std::time::Duration::from_micros(deadline.saturating_sub(now).0);
            if wait < self.heartbeat {
                ractor::time::send_after(wait, me.get_cell(), || MembershipMsg::Check);
            }
        }
    }

    fn drain(&mut self) {
        while let Some(ev) = self.detector.poll_event() {
            match &ev {
                MembershipEvent::Up { member, rejoined, .. } => {
                    debug!(node = %self.link_id(), %member, rejoined, "member up")
                }
                MembershipEvent::Down { member, .. }
                    if self.detector.status(member) == Some(troupe_policy::MemberStatus::Left) =>
                {
                    info!(node = %self.link_id(), %member, "member left")
                }
                MembershipEvent::Down { member, last_heard, at } => {
                    warn!(node = %self.link_id(), %member, silent_ms = (*at - *last_heard).as_millis(), "member down")
                }
            }
            let _ = self.events.send(ev);
        }
    }

    fn link_id(&self) -> String {
        self.link.local_id().to_string()
    }
}

impl Actor for Membership {
    type Msg = MembershipMsg;
    type State = MembershipState;
    type Arguments = MembershipArgs;

    async fn pre_start(
        &self,
        me: ActorRef<Self::Msg>,
        args: MembershipArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        ractor::time::send_interval(args.config.heartbeat, me.get_cell(), || MembershipMsg::Tick);
        Ok(MembershipState {
            link: args.link,
            // a tick later than its period means this node stalled: not its members' silence
            detector: FailureDetector::new(Micros::from_duration(args.config.timeout))
                .with_check_period(Micros::from_duration(args.config.heartbeat)),
            clock: Clock::start(),
            seq: 0,
            events: args.events,
            heartbeat: args.config.heartbeat,
        })
    }

    async fn handle(
        &self,
        me: ActorRef<Self::Msg>,
        msg: Self::Msg,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            MembershipMsg::Tick => {
                st.seq += 1;
                let frame = Frame::encode(FrameKind::Heartbeat, &Heartbeat { seq: st.seq })?;
                for peer in st.link.peers() {
                    let (link, frame) = (st.link.clone(), frame.clone());
                    // never block the actor on a slow peer
                    tokio::spawn(async move {
                        let _ = link.send(&peer, Channel::Control, frame).await;
                    });
                }
                st.look();
                st.arm(&me);
            }
            MembershipMsg::Check => st.look(),
            MembershipMsg::Heard(from) => st.detector.handle_heard(st.clock.now(), from),
            MembershipMsg::Restarted(peer) => st.detector.handle_restarted(st.clock.now(), peer),
            MembershipMsg::Left(peer) => st.detector.handle_left(st.clock.now(), &peer),
            MembershipMsg::Members(reply) => {
                let v = st.detector.members().map(|(k, s, t)| (k.clone(), s, t)).collect();
                let _ = reply.send(v);
            }
            MembershipMsg::Now(reply) => {
                let _ = reply.send(st.clock.now());
            }
        }
        st.drain();
        Ok(())
    }
}

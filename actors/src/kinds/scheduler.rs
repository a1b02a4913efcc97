//! SchedulerActor: the shell around a pure policy. Each input becomes a `handle` call; every
//! action the policy emits is carried out by [`Effects`]; one timer is re-armed from
//! `poll_timeout`. All decision state lives in the policy.

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use troupe_policy::Micros;

use crate::clock::Clock;

/// A pure policy as the shell sees it (time always comes in from the shell).
pub trait DrivenPolicy: Send + 'static {
    /// An input event.
    type Input: Send + 'static;
    /// A decision to carry out.
    type Action: Send + 'static;

    /// Feeds one input.
    fn handle(&mut self, now: Micros, input: Self::Input);
    /// Called at (or after) the time `poll_timeout` asked for.
    fn handle_timeout(&mut self, now: Micros);
    /// The next decision, if any.
    fn poll_action(&mut self) -> Option<Self::Action>;
    /// When the policy next wants `handle_timeout`.
    fn poll_timeout(&self) -> Option<Micros>;
}

/// Carries out a policy's actions (load weights, send a frame, run a kernel).
pub trait Effects<A>: Send + 'static {
    /// Performs one action; an error fails the actor, so its supervisor restarts it.
    fn perform(
        &mut self,
        action: A,
    ) -> impl std::future::Future<Output = Result<(), ActorProcessingErr>> + Send;
}

/// Messages of a scheduler actor.
pub enum SchedulerMsg<I> {
    /// An input for the policy.
    Input(I),
    /// A timer fired (stale generations are ignored).
    Timeout(u64),
    /// Replies once every action so far has been performed.
    Flush(RpcReplyPort<()>),
}

impl<I: Send + 'static> ractor::Message for SchedulerMsg<I> {}

/// The scheduler shell over policy `P` and effects `E`.
pub struct SchedulerActor<P, E>(std::marker::PhantomData<fn() -> (P, E)>);

impl<P, E> Default for SchedulerActor<P, E> {
    fn default() -> Self {
        Self(std::marker::PhantomData)
    }
}

/// Shell state: the policy, the effects, the clock and the timer generation.
pub struct SchedulerState<P, E> {
    /// The policy (all decision state).
    pub policy: P,
    /// The effect handler.
    pub effects: E,
    clock: Clock,
    timer_generation: u64,
}

impl<P, E> Actor for SchedulerActor<P, E>
where
    P: DrivenPolicy,
    E: Effects<P::Action> + Sync,
    P: Sync,
{
    type Msg = SchedulerMsg<P::Input>;
    type State = SchedulerState<P, E>;
    type Arguments = (P, E);

    async fn pre_start(
        &self,
        _me: ActorRef<Self::Msg>,
        (policy, effects): (P, E),
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(SchedulerState { policy, effects, clock: Clock::start(), timer_generation: 0 })
    }

    async fn handle(
        &self,
        me: ActorRef<Self::Msg>,
        msg: Self::Msg,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SchedulerMsg::Input(input) => st.policy.handle(st.clock.now(), input),
            SchedulerMsg::Timeout(generation) if generation == st.timer_generation => {
                st.policy.handle_timeout(st.clock.now())
            }
            SchedulerMsg::Timeout(_) => return Ok(()),
            SchedulerMsg::Flush(reply) => {
                let _ = reply.send(());
            }
        }
        while let Some(action) = st.policy.poll_action() {
            st.effects.perform(action).await?;
        }
        if let Some(at) = st.policy.poll_timeout() {
            st.timer_generation += 1;
            let generation = st.timer_generation;
            let delay = std::time::Duration::from_micros(at.saturating_sub(st.clock.now()).0);
            ractor::time::send_after(delay, me.get_cell(), move || {
                SchedulerMsg::<P::Input>::Timeout(generation)
            });
        }
        Ok(())
    }
}

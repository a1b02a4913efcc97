//! SchedulerActor: the one shell every workload's scheduler runs in (the coe scheduler, the
//! pipeline foreman, the coadapt edge scheduler). It owns no decisions: a [`Scheduler`] feeds its
//! pure policy and carries out what the policy decides. The shell brings time in, re-arms one
//! timer from `poll_timeout`, passes each input through the fault switch, and, on every start,
//! asks the workload to [`Scheduler::recover`]: the accepted work lives apart from the actor (a
//! journal-backed store), so a restart after a panic rebuilds the policy from it. Inputs are
//! counted in the shell's mailbox depth ([`crate::mailbox`]); timer ticks are not.

use std::future::Future;

use ractor::{Actor, ActorProcessingErr, ActorRef, MessagingErr, RpcReplyPort};
use troupe_policy::Micros;

use crate::clock::Clock;
use crate::mailbox::{CountedSend, Queued};

/// The workload half of a scheduler actor.
pub trait Scheduler: Send + 'static {
    /// What the scheduler is told (arrivals, executor reports, membership changes).
    type Input: Send + 'static;

    /// Called on every start, first and after each restart: rebuild the policy from the accepted
    /// work and ask executors, workers or cameras for their reports (which arrive as inputs).
    fn recover(
        &mut self,
        me: &ActorRef<SchedulerMsg<Self::Input>>,
        now: Micros,
    ) -> impl Future<Output = Result<(), ActorProcessingErr>> + Send;

    /// Feeds one input to the policy and performs the actions it decided. An error fails the
    /// actor, so its supervisor restarts it.
    fn handle(
        &mut self,
        me: &ActorRef<SchedulerMsg<Self::Input>>,
        now: Micros,
        input: Self::Input,
    ) -> impl Future<Output = Result<(), ActorProcessingErr>> + Send;

    /// Called at (or after) the time [`Scheduler::poll_timeout`] asked for.
    fn handle_timeout(
        &mut self,
        _me: &ActorRef<SchedulerMsg<Self::Input>>,
        _now: Micros,
    ) -> impl Future<Output = Result<(), ActorProcessingErr>> + Send {
        async { Ok(()) }
    }

    /// When the policy next wants [`Scheduler::handle_timeout`] (none: purely reactive).
    fn poll_timeout(&self) -> Option<Micros> {
        None
    }

    /// The clock the shell reads `now` from and arms its timer on. By default a clock starting
    /// at zero with this incarnation; a workload whose state outlives its incarnations (times
    /// it holds across a restart) returns its job's clock, so every incarnation shares one time
    /// base.
    fn clock(&self) -> Clock {
        Clock::start()
    }
}

/// Messages of a scheduler actor.
pub enum SchedulerMsg<I> {
    /// An input for the workload, counted in the actor's mailbox depth: send it with
    /// [`CountedSend::cast_counted`] (`me.cast_counted(|q| SchedulerMsg::Input(input, q))`, or
    /// [`SchedulerMsg::tell`]).
    Input(I, Queued),
    /// A timer fired (stale generations are ignored).
    Timeout(u64),
    /// Replies once every earlier message has been handled.
    Flush(RpcReplyPort<()>),
}

impl<I: Send + 'static> ractor::Message for SchedulerMsg<I> {}

impl<I: Send + 'static> SchedulerMsg<I> {
    /// Sends `input` to scheduler `to` through the counted send path.
    pub fn tell(to: &ActorRef<SchedulerMsg<I>>, input: I) -> Result<(), MessagingErr<SchedulerMsg<I>>> {
        to.cast_counted(|q| SchedulerMsg::Input(input, q))
    }
}

/// Start arguments: the workload (made afresh by its child spec on every restart) and the
/// fault-switch site its inputs pass through.
pub struct SchedulerArgs<S> {
    /// The workload half.
    pub scheduler: S,
    /// Fault site hit once per input (`<workload>.scheduler` by convention).
    pub fault_site: String,
}

/// The scheduler shell over workload `S`.
pub struct SchedulerActor<S>(std::marker::PhantomData<fn() -> S>);

impl<S> Default for SchedulerActor<S> {
    fn default() -> Self {
        Self(std::marker::PhantomData)
    }
}

/// Shell state: the workload, the clock, the timer generation.
pub struct SchedulerState<S> {
    scheduler: S,
    fault_site: String,
    clock: Clock,
    timer_generation: u64,
}

impl<S: Scheduler> SchedulerActor<S> {
    fn rearm(me: &ActorRef<SchedulerMsg<S::Input>>, st: &mut SchedulerState<S>) {
        if let Some(at) = st.scheduler.poll_timeout() {
            st.timer_generation += 1;
            let generation = st.timer_generation;
            let delay = std::time::Duration::from_micros(at.saturating_sub(st.clock.now()).0);
            ractor::time::send_after(delay, me.get_cell(), move || {
                SchedulerMsg::<S::Input>::Timeout(generation)
            });
        }
    }
}

impl<S: Scheduler> Actor for SchedulerActor<S> {
    type Msg = SchedulerMsg<S::Input>;
    type State = SchedulerState<S>;
    type Arguments = SchedulerArgs<S>;

    async fn pre_start(
        &self,
        me: ActorRef<Self::Msg>,
        args: SchedulerArgs<S>,
    ) -> Result<Self::State, ActorProcessingErr> {
        crate::mailbox::track(&me);
        let clock = args.scheduler.clock();
        let mut st = SchedulerState {
            scheduler: args.scheduler,
            fault_site: args.fault_site,
            clock,
            timer_generation: 0,
        };
        st.scheduler.recover(&me, st.clock.now()).await?;
        Self::rearm(&me, &mut st);
        Ok(st)
    }

    async fn handle(
        &self,
        me: ActorRef<Self::Msg>,
        msg: Self::Msg,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SchedulerMsg::Input(input, queued) => {
                queued.taken();
                crate::fault::point(&st.fault_site);
                st.scheduler.handle(&me, st.clock.now(), input).await?;
            }
            SchedulerMsg::Timeout(generation) if generation == st.timer_generation => {
                st.scheduler.handle_timeout(&me, st.clock.now()).await?;
            }
            SchedulerMsg::Timeout(_) => return Ok(()),
            SchedulerMsg::Flush(reply) => {
                let _ = reply.send(());
                return Ok(());
            }
        }
        Self::rearm(&me, st);
        Ok(())
    }
}

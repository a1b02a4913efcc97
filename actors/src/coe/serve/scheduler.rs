//! The coe scheduler incarnation: feeds the policy's [`RequestScheduler`] what the executors
//! report and carries out its decisions over their links, refereeing each (no load or batch on a
//! busy or lost executor, no eviction of what runs). Which executor is in service, on which link
//! generation, and what it is busy with is the policy's [`Roster`]: a report from an older link,
//! or from before an executor's reset was answered, is stale there.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use ractor::ActorProcessingErr;
use troupe_policy::Micros;
use troupe_policy::coe::{Action, ExecutorId, ExpertId, Request, RequestId, RequestScheduler};
use troupe_policy::roster::{Adopted, Health, Roster};

use super::super::app::{output_digest, quantise, select_children};
use super::super::link::ExecLink;
use super::super::runner::{Cmd, Event};
use super::{CoeInput, CoeShared, MAX_SERVED_ORDER, SchedulerRef, lock, push_bounded, request_of, root_of};
use crate::clock::Clock;
use crate::kinds::scheduler::Scheduler;
use crate::typed::queue::CallFuture;

/// What an executor is busy with (the roster's `busy`; none: idle).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Busy {
    Loading(ExpertId),
    Running(ExpertId),
}

/// Decision state of one scheduler incarnation (rebuilt by `recover`).
struct Live {
    policy: RequestScheduler,
    /// Per executor: its link generation, syncing/ready/lost, what it is busy with.
    roster: Roster<Busy>,
    outputs: HashMap<u64, BTreeMap<ExpertId, Vec<i32>>>,
    /// Time inside policy calls not yet added to the meter.
    decide: Duration,
}

/// Runs `f` (a policy call), adding its duration to `clock`.
fn timed<T>(clock: &mut Duration, f: impl FnOnce() -> T) -> T {
    let start = Clock::start();
    let out = f();
    *clock += start.elapsed();
    out
}

/// The coe workload half of the scheduler shell.
pub struct CoeScheduler {
    shared: Arc<CoeShared>,
    live: Option<Live>,
}

impl CoeScheduler {
    /// A scheduler over the shared job state (its decision state is built in `recover`).
    pub fn new(shared: Arc<CoeShared>) -> Self {
        Self { shared, live: None }
    }
}

fn fail(e: impl std::fmt::Display) -> ActorProcessingErr {
    e.to_string().into()
}

impl Live {
    /// Queues `cmd` on `x`'s link, only if that link is the one this incarnation believes in.
    fn send(&mut self, shared: &CoeShared, x: usize, cmd: Cmd) -> bool {
        let call = move |link: ExecLink| -> CallFuture<Option<Event>> { Box::pin(link.run(x, cmd)) };
        shared.links.submit_on(&x, self.epoch(x), call).is_ok()
    }

    /// The generation of the link `x` is reached through in this incarnation's view.
    fn epoch(&self, x: usize) -> u64 {
        self.roster.member(x).map_or(0, |m| m.epoch)
    }

    /// Declares `x` lost (once) and requeues its work.
    fn lose(&mut self, now: Micros, x: usize, why: &str) -> Result<(), ActorProcessingErr> {
        if !self.roster.lose(x) {
            return Ok(());
        }
        self.lost(now, x, why)
    }

    /// Tells the policy `x`'s work will not be answered (the roster has it lost already).
    fn lost(&mut self, now: Micros, x: usize, why: &str) -> Result<(), ActorProcessingErr> {
        tracing::warn!(executor = %x, %why, "executor lost: requeueing its work");
        timed(&mut self.decide, || self.policy.handle_executor_lost(now, ExecutorId(x as u16))).map_err(fail)
    }

    /// Feeds requests accepted since the last look (skipping answered ones).
    fn feed_accepted(&mut self, shared: &CoeShared, now: Micros) -> Result<(), ActorProcessingErr> {
        let fresh: Vec<(u64, Option<ExpertId>)> = {
            let mut st = lock(&shared.store);
            let from = st.fed.min(st.accepted.len());
            let ids = st.accepted[from..]
                .iter()
                .copied()
                .filter(|&i| st.is_open(i))
                .map(|i| (i, root_of(&shared.app, &st.clients, i)))
                .collect();
            st.fed = st.accepted.len();
            ids
        };
        for (i, found) in fresh {
            let root = found.ok_or_else(|| fail(format!("accepted request {i} is unknown")))?;
            timed(&mut self.decide, || self.policy.handle_arrival(now, Request { id: RequestId(i), root }))
                .map_err(fail)?;
        }
        Ok(())
    }

    /// Adopts a newer link for `x`: reset it, then it serves again.
    fn adopt(&mut self, shared: &CoeShared, now: Micros, x: usize) -> Result<(), ActorProcessingErr> {
        let generation = shared.link_generation(x);
        match self.roster.adopt(x, generation) {
            Adopted::Stale => return Ok(()),
            // Its old link's work will never be answered: requeue it first.
            Adopted::Replaced => self.lost(now, x, "replaced by a newer link")?,
            Adopted::Restored => {}
        }
        if !self.send(shared, x, Cmd::Reset) {
            return self.lose(now, x, "link closed before its reset");
        }
        lock(&shared.store).meter.restorations += 1;
        tracing::info!(executor = shared.latency.name(x), generation, "executor back in service");
        timed(&mut self.decide, || self.policy.handle_executor_restored(now, ExecutorId(x as u16)))
            .map_err(fail)
    }

    fn on_event(
        &mut self,
        shared: &CoeShared,
        now: Micros,
        x: usize,
        generation: u64,
        event: Event,
    ) -> Result<(), ActorProcessingErr> {
        if !self.roster.is_current(x, generation) {
            return Ok(()); // an older link's, or a lost executor's late result
        }
        let Some(member) = self.roster.member(x).copied() else { return Ok(()) };
        let restored = member.rejoined > 0;
        if member.health == Health::Syncing
            && !matches!(event, Event::Reset { .. } | Event::Lost { .. } | Event::Failed(_))
        {
            return Ok(()); // a dead incarnation's command finishing before the reset
        }
        let trace = &shared.app.trace;
        match event {
            Event::Reset { evicted, host_budget, host, .. } => {
                tracing::debug!(
                    executor = shared.latency.name(x),
                    evicted,
                    host = host.len(),
                    "executor reset"
                );
                self.roster.synced(x);
                // Loads are planned from the tier an expert is in: take the executor's word for
                // its host tier, unless it cannot be true (then plan as from a fresh one).
                if let Err(e) = self.policy.handle_host_report(ExecutorId(x as u16), host_budget, &host) {
                    tracing::warn!(executor = shared.latency.name(x), "{e}");
                }
            }
            Event::Loaded { expert, seconds, resident, .. } => {
                self.roster.set_busy(x, None);
                {
                    let mut st = lock(&shared.store);
                    let c = &mut st.meter.counters[x];
                    c.peak_bytes = c.peak_bytes.max(resident);
                    c.loads += 1;
                    c.load_seconds += seconds;
                }
                timed(&mut self.decide, || self.policy.handle_load_done(now, ExecutorId(x as u16), expert))
                    .map_err(fail)?;
            }
            Event::Ran { batch, expert, rows, seconds, .. } => {
                self.roster.set_busy(x, None);
                {
                    let mut st = lock(&shared.store);
                    let c = &mut st.meter.counters[x];
                    c.batches += 1;
                    c.tasks += rows.len() as u64;
                    c.run_seconds += seconds;
                    if restored {
                        st.meter.completed_after_restore += rows.len();
                    }
                }
                timed(&mut self.decide, || self.policy.handle_batch_done(now, ExecutorId(x as u16), batch))
                    .map_err(fail)?;
                let children = trace.model.expert(expert).map(|e| e.children.clone()).unwrap_or_default();
                let next_client = lock(&shared.store).next_client;
                for (request, probs) in rows {
                    // a trace request's walk is recorded; a client's is whatever its outputs select
                    let req = trace.requests.get(request.0 as usize);
                    if req.is_none() && request.0 >= next_client {
                        return Err(fail(format!("executor answered unknown {request}")));
                    }
                    self.outputs.entry(request.0).or_default().insert(expert, quantise(&probs));
                    if children.is_empty() {
                        continue;
                    }
                    let chosen = select_children(&shared.app.child_scores(expert, &probs), &children);
                    if let Some(req) = req
                        && req.selection(expert) != Some(chosen.as_slice())
                    {
                        return Err(fail(format!(
                            "{request}: {expert} selected {chosen:?}, the trace recorded {:?} (trace not made for this app?)",
                            req.selection(expert)
                        )));
                    }
                    timed(&mut self.decide, || {
                        self.policy.handle_preliminary_done(now, request, expert, &chosen)
                    })
                    .map_err(fail)?;
                }
            }
            Event::Lost { why, .. } => self.lose(now, x, &why)?,
            Event::Failed(e) => {
                crate::work::COE.failed();
                return Err(fail(e));
            }
        }
        Ok(())
    }

    /// Carries out the policy's decisions, refereeing each (busy executors, evictions of what
    /// runs), and journals answers.
    fn perform(&mut self, shared: &CoeShared, now: Micros) -> Result<(), ActorProcessingErr> {
        while let Some(action) = timed(&mut self.decide, || self.policy.poll_action()) {
            match action {
                Action::Enqueue { .. } => {}
                Action::Evict { executor, expert } => {
                    let x = executor.index();
                    let busy = self.roster.busy(x);
                    if busy == Some(Busy::Loading(expert)) || busy == Some(Busy::Running(expert)) {
                        return Err(fail(format!("evict of {expert} while {executor} uses it")));
                    }
                    if !self.send(shared, x, Cmd::Evict(expert)) {
                        self.lose(now, x, "link closed")?;
                    }
                }
                Action::Load { executor, expert, .. } => {
                    let x = executor.index();
                    if self.roster.busy(x).is_some() || self.roster.is_lost(x) {
                        return Err(fail(format!("load of {expert} on busy or lost {executor}")));
                    }
                    self.roster.set_busy(x, Some(Busy::Loading(expert)));
                    if !self.send(shared, x, Cmd::Load(expert)) {
                        self.lose(now, x, "link closed")?;
                    }
                }
                Action::RunBatch { executor, batch, expert, requests } => {
                    let x = executor.index();
                    if self.roster.busy(x).is_some() || self.roster.is_lost(x) {
                        return Err(fail(format!("batch of {expert} on busy or lost {executor}")));
                    }
                    self.roster.set_busy(x, Some(Busy::Running(expert)));
                    push_bounded(&mut lock(&shared.store).meter.served[x], expert, MAX_SERVED_ORDER);
                    let inputs = {
                        let st = lock(&shared.store);
                        requests
                            .iter()
                            .map(|r| {
                                let (_, pixels) = request_of(&shared.app, &st.clients, r.0)
                                    .ok_or_else(|| fail(format!("unknown {r}")))?;
                                Ok((*r, pixels))
                            })
                            .collect::<Result<Vec<_>, ActorProcessingErr>>()?
                    };
                    if !self.send(shared, x, Cmd::Run { batch, expert, requests: inputs }) {
                        self.lose(now, x, "link closed")?;
                    }
                }
                Action::Complete { request } => self.answer(shared, request)?,
            }
        }
        Ok(())
    }

    fn answer(&mut self, shared: &CoeShared, request: RequestId) -> Result<(), ActorProcessingErr> {
        let outputs = self.outputs.remove(&request.0).unwrap_or_default();
        let digest = output_digest(&outputs);
        shared.settle(request.0, digest, outputs).map_err(fail)?;
        crate::work::COE.done();
        Ok(())
    }
}

impl Scheduler for CoeScheduler {
    type Input = CoeInput;

    async fn recover(&mut self, me: &SchedulerRef, now: Micros) -> Result<(), ActorProcessingErr> {
        let shared = self.shared.clone();
        let policy =
            RequestScheduler::new(shared.app.trace.model.clone(), shared.latency.clone(), shared.config)
                .map_err(fail)?;
        let n_exec = shared.latency.executors();
        let mut live =
            Live { policy, roster: Roster::new(n_exec), outputs: HashMap::new(), decide: Duration::ZERO };
        // From here on, acceptances and link changes reach this incarnation; what happened
        // before is read from the store and the links below.
        {
            let mut st = lock(&shared.store);
            st.scheduler = Some(me.clone());
            st.fed = 0;
        }
        // A new generation per live link: what an earlier incarnation queued is dropped, and its
        // call in flight (a reset too) answers a generation this one never believes in (coe
        // explorer seed 309: a dead incarnation's reset was taken for this one's).
        let generations: Vec<Option<u64>> = (0..n_exec).map(|x| shared.renew_link(x)).collect();
        for (x, g) in generations.into_iter().enumerate() {
            live.roster.syncing(x, g.unwrap_or(0));
            if g.is_none() || !live.send(&shared, x, Cmd::Reset) {
                live.lose(now, x, "no link")?;
            }
        }
        live.feed_accepted(&shared, now)?;
        live.perform(&shared, now)?;
        let pending = {
            let st = lock(&shared.store);
            st.accepted_set.len().saturating_sub(st.answered.len())
        };
        tracing::info!(pending, "coe scheduler started: rebuilt from the accepted requests");
        lock(&shared.store).meter.scheduling += std::mem::take(&mut live.decide);
        self.live = Some(live);
        Ok(())
    }

    async fn handle(
        &mut self,
        _me: &SchedulerRef,
        now: Micros,
        input: CoeInput,
    ) -> Result<(), ActorProcessingErr> {
        let shared = self.shared.clone();
        let live = self.live.as_mut().ok_or_else(|| fail("coe scheduler used before recover"))?;
        match input {
            CoeInput::Accepted => live.feed_accepted(&shared, now)?,
            CoeInput::Exec { exec, generation, event } => {
                live.on_event(&shared, now, exec, generation, event)?
            }
            CoeInput::Down { exec, generation, why } => {
                if live.roster.member(exec).is_some_and(|m| m.epoch == generation) {
                    live.lose(now, exec, &why)?;
                }
            }
            CoeInput::Restored { exec } => {
                if exec < live.roster.len() {
                    live.adopt(&shared, now, exec)?;
                }
            }
        }
        let done = live.perform(&shared, now);
        lock(&shared.store).meter.scheduling += std::mem::take(&mut live.decide);
        done
    }

    /// The job's clock, shared by every incarnation: one time base across restarts.
    fn clock(&self) -> Clock {
        self.shared.clock
    }
}

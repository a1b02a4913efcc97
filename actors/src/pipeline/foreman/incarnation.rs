//! The scheduler half of the foreman, one incarnation ([`ForemanScheduler`]): `recover` joins the
//! workers and submits the unanswered
//! inputs, `handle` feeds events to the [`Shell`], the timer polls telemetry and ends a wait for
//! a lost crowd exactly at the roster's deadline. Nothing slow runs in a handler: calls go out on
//! spawned tasks and their answers come back as inputs.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use ractor::ActorRef;
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, warn};
use troupe_policy::Micros;
use troupe_policy::pipeline::{Foreman, Job, WorkerId, WorkerReport};
use troupe_policy::roster::{AllLost, Roster};
use troupe_transport::{Link, NodeId};

use super::super::wire::{GetStats, GetTelemetry, Joined};
use super::super::worker::PipelineWorker;
use super::calls::{Event, EventKind, ExecCtx, WorkerHandle, join_step, policy_telemetry};
use super::shared::{Enlisted, ForemanInput, ForemanShared};
use super::shell::{Handle, REJOIN_TIMEOUT, Shell};
use super::{JobOutcome, ShellError, WorkerSummary};
use crate::clock::Clock;
use crate::kinds::scheduler::SchedulerMsg;

/// The pipeline workload half of the scheduler shell: one incarnation's [`Shell`], once its
/// workers have been enlisted.
pub(super) struct ForemanScheduler {
    pub(super) shared: Arc<ForemanShared>,
    pub(super) live: Option<Shell>,
    /// While the workers are being joined: what the incarnation was started with.
    pub(super) enlisting: Option<Enlisting>,
    pub(super) next_tick: Micros,
}

impl ForemanScheduler {
    /// A scheduler for one incarnation of the job (it starts in `recover`).
    pub(super) fn new(shared: Arc<ForemanShared>) -> Self {
        ForemanScheduler { shared, live: None, enlisting: None, next_tick: Micros::ZERO }
    }
}

/// An incarnation between `recover` and its workers' join answers.
pub(super) struct Enlisting {
    incarnation: usize,
    /// This incarnation's inputs: the job's unanswered ones.
    map: Vec<usize>,
    ctx: ExecCtx,
    /// Inputs that came before the workers were enlisted, handled once they are.
    held: Vec<ForemanInput>,
}

/// Finds each worker and joins it through a new link (this incarnation's generation) as the
/// link's first step, unloading first when `unload`: a call of a dead incarnation still in flight
/// to the same worker finishes first, and what that incarnation had queued is dropped. Runs off
/// the actor (lookups and joins are remote calls); the answers come back as one input. Once a
/// newer incarnation has started (this one died while enlisting), it attaches nothing more: the
/// links are the newer one's.
async fn enlist(shared: Arc<ForemanShared>, incarnation: usize, unload: bool) -> Vec<Enlisted> {
    let timeout = shared.settings.rpc_timeout;
    let mut joins = Vec::new();
    for (idx, (_, name)) in shared.targets.iter().enumerate() {
        let linked = match shared.actors.lookup::<PipelineWorker>(name).await {
            Ok(_) if shared.incarnations.load(Ordering::SeqCst) != incarnation + 1 => return Vec::new(),
            Ok(handle) => {
                let generation = shared.links.attach(idx, handle.clone());
                let (tx, rx) = oneshot::channel();
                let join = join_step(unload, timeout, shared.clock, tx);
                shared.links.submit(&idx, join).ok().map(|_| (handle, generation, rx))
            }
            Err(e) => {
                warn!(worker = %name, error = %e, "worker not found; skipped");
                None
            }
        };
        joins.push((name.clone(), linked));
    }
    let mut enlisted = Vec::with_capacity(joins.len());
    for (idx, (name, linked)) in joins.into_iter().enumerate() {
        enlisted.push(match linked {
            Some((actor, generation, rx)) => {
                let joined = rx.await.ok().flatten();
                if joined.is_none() {
                    shared.links.detach_generation(&idx, generation);
                }
                Enlisted { actor, generation, joined }
            }
            None => {
                Enlisted { actor: WorkerHandle::by_name(&shared.actors, &name), generation: 0, joined: None }
            }
        });
    }
    enlisted
}

/// A worker whose end-of-job counters are asked for: in service, or lost (declared down by
/// membership, or its calls failing) yet perhaps still running as the process that joined.
struct Reporter {
    index: usize,
    actor: WorkerHandle,
    /// The pid it joined with (its report must come from that process).
    pid: u32,
    /// Lost (asked once, briefly) or in service.
    lost: bool,
}

/// Gathers each worker's own counters into the outcome and reports the job done. The calls go
/// out at once, one per worker; a worker in service is retried a few times (a failed call, e.g.
/// a connection re-forming). A lost worker whose actor is still announced is asked once,
/// briefly ([`REJOIN_TIMEOUT`]): a stall on a loaded box can get a healthy worker declared
/// down near the end of a job, before it is joined again, and its counters are still its own.
/// Counters are kept only from the process that joined (a restarted worker's start from zero).
/// Runs off the actor; the ended incarnation's `shell` is dropped (its links detached) only
/// after the report, as when this ran in the handler.
async fn report_done(
    shared: Arc<ForemanShared>,
    shell: Shell,
    mut outcome: JobOutcome,
    reporters: Vec<Reporter>,
) {
    let mut calls = tokio::task::JoinSet::new();
    for Reporter { index, actor, pid, lost } in reporters {
        let (tries, timeout) = if lost {
            (1, REJOIN_TIMEOUT.min(shared.settings.rpc_timeout))
        } else {
            (3, shared.settings.rpc_timeout)
        };
        calls.spawn(async move {
            for _ in 0..tries {
                match actor.call(GetStats, timeout).await {
                    Ok(st) if st.pid == pid => return Some((index, st)),
                    Ok(st) => {
                        debug!(
                            worker = index,
                            joined = pid,
                            answered = st.pid,
                            "final report from another process ignored"
                        );
                        return None;
                    }
                    Err(e) => debug!(worker = index, lost, error = %e, "final report not received"),
                }
            }
            None
        });
    }
    while let Some(done) = calls.join_next().await {
        if let Ok(Some((index, st))) = done
            && let Some(w) = outcome.workers.get_mut(index)
        {
            w.stats = Some(st);
        }
    }
    shared.finish(Ok(outcome));
    drop(shell);
}

impl ForemanScheduler {
    /// Reports the end of the job once the policy or the roster says so: a failure at once; a
    /// success once the workers' stats are in, gathered off the actor.
    fn finish_if_over(&mut self, now: Micros) {
        let Some(shell) = self.live.as_mut() else { return };
        let over = if let Some(task) = shell.failed {
            let detail = shell.last_error.get(&task).cloned().unwrap_or_default();
            Some(Err(ShellError::Failed { task: task.to_string(), detail }))
        } else {
            match shell.roster.all_lost(now) {
                AllLost::Expired => Some(Err(ShellError::NoWorkers)),
                AllLost::Began { .. } => {
                    let wait = shell.settings.join_timeout;
                    shell.log(format!("every worker is lost; waiting up to {wait:?} for one to come back"));
                    None
                }
                AllLost::Waiting { .. } => None,
                AllLost::No => shell.done.then_some(Ok(())),
            }
        };
        let Some(over) = over else { return };
        let Some(mut shell) = self.live.take() else { return };
        self.shared.ending.store(true, Ordering::SeqCst);
        match over {
            Err(e) => self.shared.finish(Err(e)),
            Ok(()) => {
                shell.outcome.makespan_s = now.as_secs_f64();
                shell.outcome.learned_costs = shell.policy.learned_costs();
                shell.outcome.stage_plan =
                    shell.policy.stage_plan().into_iter().map(|(w, k)| (w.0 as usize, k)).collect();
                shell.log(format!("job done in {:.3} s", shell.outcome.makespan_s));
                let mut outcome = std::mem::take(&mut shell.outcome);
                let answered = self.shared.answers();
                outcome.outputs = answered.into_iter().map(Option::unwrap_or_default).collect();
                outcome.workers = shell.workers.iter().map(|h| h.summary.clone()).collect();
                // every worker that joined, in service or lost with its actor still announced
                let directory = shell.services.directory();
                let reporters: Vec<Reporter> = (0..shell.workers.len())
                    .filter(|&i| shell.workers[i].summary.pid != 0)
                    .filter(|&i| !shell.roster.is_lost(i) || shell.announced(&directory, i))
                    .map(|i| Reporter {
                        index: i,
                        actor: shell.workers[i].actor.clone(),
                        pid: shell.workers[i].summary.pid,
                        lost: shell.roster.is_lost(i),
                    })
                    .collect();
                tokio::spawn(report_done(self.shared.clone(), shell, outcome, reporters));
            }
        }
    }

    /// Builds this incarnation's shell from its workers' join answers, submits its inputs to a
    /// fresh policy, and handles what came meanwhile.
    fn start(&mut self, now: Micros, enlisted: Vec<Enlisted>) -> Result<(), ractor::ActorProcessingErr> {
        let Some(Enlisting { incarnation, map, ctx, held }) = self.enlisting.take() else { return Ok(()) };
        let shared = self.shared.clone();
        let job = shared.job.clone();
        let settings = shared.settings.clone();
        let mut policy = Foreman::new(settings.policy);
        if let Some(c) = settings.prior_costs.clone() {
            policy.remember_costs(c);
        }
        let mut roster = Roster::new(shared.targets.len())
            .with_all_lost_wait(Micros::from_duration(settings.join_timeout));
        let mut workers = Vec::new();
        let mut by_node = BTreeMap::new();
        for (idx, ((peer, name), Enlisted { actor, generation, joined })) in
            shared.targets.iter().zip(enlisted).enumerate()
        {
            let (node, summary) = match joined {
                Some(Joined { node, pid, cached, live, straggler, telemetry }) => {
                    let rtt_ms = shared.link.rtt(&NodeId::new(&node)).map_or(0.0, |d| d.as_secs_f64() * 1e3);
                    let live_none = live.is_none();
                    let report =
                        WorkerReport { telemetry: policy_telemetry(&telemetry, rtt_ms), live, cached };
                    policy
                        .handle_worker_joined(now, WorkerId(idx as u32), report)
                        .map_err(|e| ShellError::Refused(e.to_string()).to_string())?;
                    roster.joined(idx, generation, pid);
                    debug!(worker = idx, %node, pid, %straggler, "pipeline worker joined");
                    let summary = WorkerSummary {
                        idle_rss_bytes: live_none.then_some(telemetry.rss_bytes),
                        node: node.clone(),
                        pid,
                        straggler,
                        telemetry,
                        rtt_ms,
                        ..WorkerSummary::default()
                    };
                    (node, summary)
                }
                None => {
                    let node = peer.as_str().to_owned();
                    (node.clone(), WorkerSummary { node, lost: true, ..WorkerSummary::default() })
                }
            };
            by_node.insert(node.clone(), idx);
            workers.push(Handle {
                node,
                probe: WorkerHandle::by_name(&shared.actors, name),
                actor,
                summary,
                pulled: vec![false; job.stages.len()],
            });
        }
        let joined = roster.in_service();
        if incarnation == 0 && joined < settings.workers {
            let e = ShellError::TooFewWorkers {
                found: joined,
                wanted: settings.workers,
                secs: settings.join_timeout.as_secs(),
            };
            shared.finish(Err(e));
            return Ok(());
        }
        let n = map.len();
        let s = job.stages.len();
        let mut shell = Shell {
            link: shared.link.clone(),
            shelf: shared.shelf.clone(),
            job: job.clone(),
            map,
            shared: shared.clone(),
            settings,
            policy,
            workers,
            by_node,
            clock: shared.clock,
            outputs: vec![vec![None; s]; n],
            outcome: JobOutcome::default(),
            last_error: BTreeMap::new(),
            progress: shared.progress.clone(),
            done: n == 0,
            failed: None,
            services: shared.services.clone(),
            actors: shared.actors.clone(),
            ctx,
            roster,
        };
        if incarnation == 0 && n < job.inputs.len() {
            shell.log(format!(
                "resuming from the journal: {} of {} inputs answered, submitting the other {n}",
                job.inputs.len() - n,
                job.inputs.len()
            ));
        }
        if incarnation > 0 {
            shell.log(format!(
                "foreman restarted (incarnation {incarnation}): resubmitting the {n} unanswered inputs"
            ));
        }
        if n > 0 {
            shell.log(format!("job submitted: {n} inputs x {s} stages, mode {}", job.mode));
            let policy_job = Job { chain: job.chain.clone(), inputs: n, mode: job.mode };
            shell
                .policy
                .submit_job(now, policy_job)
                .map_err(|e| ShellError::Refused(e.to_string()).to_string())?;
            shell.drain(now);
        }
        self.live = Some(shell);
        self.next_tick = now + Micros::from_duration(shared.settings.telemetry_period);
        for input in held {
            self.feed(now, input);
        }
        self.finish_if_over(now);
        Ok(())
    }

    /// Feeds one input to the live shell.
    fn feed(&mut self, now: Micros, input: ForemanInput) {
        let Some(shell) = self.live.as_mut() else { return };
        match input {
            ForemanInput::Event(ev) => shell.on_event(now, ev),
            ForemanInput::Down(node) => {
                if let Some(&w) = shell.by_node.get(&node) {
                    shell.lose(now, w, "membership: member down");
                }
            }
            ForemanInput::Announced => shell.try_rejoin(),
            ForemanInput::Enlisted(_) => {}
        }
    }
}

impl crate::kinds::scheduler::Scheduler for ForemanScheduler {
    type Input = ForemanInput;

    /// Starts an incarnation: its inputs are the job's unanswered ones; its workers are joined
    /// off the actor ([`enlist`]) and it starts when their answers arrive.
    async fn recover(
        &mut self,
        me: &ActorRef<SchedulerMsg<ForemanInput>>,
        _now: Micros,
    ) -> Result<(), ractor::ActorProcessingErr> {
        let shared = self.shared.clone();
        if shared.ending.load(Ordering::SeqCst) {
            return Ok(());
        }
        if let Ok(mut s) = shared.scheduler.lock() {
            *s = Some(me.clone());
        }
        let incarnation = shared.incarnations.fetch_add(1, Ordering::SeqCst);
        let map: Vec<usize> =
            shared.answers().iter().enumerate().filter(|(_, o)| o.is_none()).map(|(i, _)| i).collect();
        let (events_tx, mut events) = mpsc::unbounded_channel::<Event>();
        {
            let me = me.clone();
            tokio::spawn(async move {
                while let Some(ev) = events.recv().await {
                    if SchedulerMsg::tell(&me, ForemanInput::Event(ev)).is_err() {
                        return;
                    }
                }
            });
        }
        let ctx = ExecCtx {
            link: shared.link.clone(),
            shelf: shared.shelf.clone(),
            foreman: shared.link.local_id().as_str().to_owned(),
            lossy_bf16: shared.job.lossy_bf16,
            crowd: Arc::new(shared.targets.iter().map(|(peer, _)| peer.clone()).collect()),
            timeout: shared.settings.rpc_timeout,
            clock: shared.clock,
            events: events_tx,
        };
        self.enlisting = Some(Enlisting { incarnation, map, ctx, held: Vec::new() });
        // a restarted incarnation starts from empty workers, as its fresh policy believes
        let unload = shared.settings.fresh_start || incarnation > 0;
        let me = me.clone();
        tokio::spawn(async move {
            let enlisted = enlist(shared, incarnation, unload).await;
            // a dead incarnation's answers are dropped with its mailbox
            let _ = SchedulerMsg::tell(&me, ForemanInput::Enlisted(enlisted));
        });
        Ok(())
    }

    async fn handle(
        &mut self,
        _me: &ActorRef<SchedulerMsg<ForemanInput>>,
        now: Micros,
        input: ForemanInput,
    ) -> Result<(), ractor::ActorProcessingErr> {
        match input {
            ForemanInput::Enlisted(enlisted) => self.start(now, enlisted)?,
            input => match self.enlisting.as_mut() {
                Some(e) => e.held.push(input),
                None => self.feed(now, input),
            },
        }
        self.finish_if_over(now);
        Ok(())
    }

    async fn handle_timeout(
        &mut self,
        _me: &ActorRef<SchedulerMsg<ForemanInput>>,
        now: Micros,
    ) -> Result<(), ractor::ActorProcessingErr> {
        let Some(shell) = self.live.as_ref() else { return Ok(()) };
        if now >= self.next_tick {
            self.next_tick = now + Micros::from_duration(self.shared.settings.telemetry_period);
            let (clock, timeout) = (shell.clock, shell.settings.rpc_timeout);
            for i in (0..shell.workers.len()).filter(|&i| !shell.roster.is_lost(i)) {
                // a direct typed call, not queued on the link: telemetry must not wait behind a
                // task, and a restarted worker answers it with its new pid
                let generation = shell.roster.member(i).map_or(0, |m| m.epoch);
                let (probe, tx) = (shell.workers[i].probe.clone(), shell.ctx.events.clone());
                tokio::spawn(async move {
                    let start = clock.now().as_secs_f64();
                    if let Ok(t) = probe.call(GetTelemetry, timeout).await {
                        let end = clock.now().as_secs_f64();
                        let kind = EventKind::Telemetry(t);
                        let _ = tx.send(Event { worker: i, generation, start, end, kind });
                    }
                });
            }
        }
        // a job waiting for a lost crowd to come back gives up here, at the roster's deadline
        self.finish_if_over(now);
        Ok(())
    }

    /// The next telemetry poll, or the all-lost deadline when sooner.
    fn poll_timeout(&self) -> Option<Micros> {
        let shell = self.live.as_ref()?;
        Some(shell.roster.poll_timeout().map_or(self.next_tick, |d| d.min(self.next_tick)))
    }

    /// The job's clock, shared by every incarnation: one time base across restarts.
    fn clock(&self) -> Clock {
        self.shared.clock
    }
}

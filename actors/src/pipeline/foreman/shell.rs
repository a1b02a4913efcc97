//! One foreman incarnation's state and how it carries out decisions: the policy's actions
//! become queued calls ([`super::calls`]); the calls' outcomes, telemetry and membership come
//! back as events and go into the policy and the [`Roster`]. Who is in service, which report is
//! stale, when a restarted worker is lost and when a lost crowd is given up on are the roster's
//! decisions; this shell does the I/O they imply.

use std::collections::BTreeMap;
use std::sync::Arc;

use tokio::sync::mpsc;
use tracing::{debug, info, warn};
use troupe_policy::Micros;
use troupe_policy::pipeline::{Action, Foreman, TaskId, WorkerId, WorkerReport};
use troupe_policy::roster::{Incarnation, Roster};
use troupe_transport::{NodeId, NodeLink};

use super::super::job::PipelineJob;
use super::super::wire::{BlobShelf, EncodeTally, Join, Joined, WireNamed, encode_tensors};
use super::super::worker::worker_name;
use super::calls::{Cmd, Event, EventKind, ExecCtx, Held, WorkerHandle, policy_telemetry, step};
use super::shared::ForemanShared;
use super::{JobOutcome, Progress, ShellSettings, Span, SpanKind, TaskTimes, WorkerSummary};
use crate::clock::Clock;
use crate::service::Services;
use crate::typed::{Actors, service_name};

/// Longest a join of a lost worker's node may take before it is tried again.
pub(super) const REJOIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// A worker as this incarnation reaches and reports it (who is in service is the roster's).
pub(super) struct Handle {
    pub(super) node: String,
    /// The handle its link calls through (addresses the incarnation that joined).
    pub(super) actor: WorkerHandle,
    /// Telemetry polls: by name, so a restarted worker answers with its new pid.
    pub(super) probe: WorkerHandle,
    pub(super) summary: WorkerSummary,
    pub(super) pulled: Vec<bool>,
}

pub(super) struct Shell {
    pub(super) link: NodeLink,
    pub(super) shelf: BlobShelf,
    pub(super) job: Arc<PipelineJob>,
    /// This incarnation's job input i is the job's input `map[i]` (a restarted foreman submits
    /// only the inputs not answered yet).
    pub(super) map: Vec<usize>,
    pub(super) shared: Arc<ForemanShared>,
    pub(super) settings: ShellSettings,
    pub(super) policy: Foreman,
    pub(super) workers: Vec<Handle>,
    pub(super) by_node: BTreeMap<String, usize>,
    /// The job's clock (the scheduler shell's): log stamps.
    pub(super) clock: Clock,
    pub(super) outputs: Vec<Vec<Option<Held>>>,
    pub(super) outcome: JobOutcome,
    pub(super) last_error: BTreeMap<TaskId, String>,
    pub(super) progress: Option<mpsc::UnboundedSender<Progress>>,
    pub(super) done: bool,
    pub(super) failed: Option<TaskId>,
    pub(super) services: Services,
    pub(super) actors: Actors,
    pub(super) ctx: ExecCtx,
    /// Who is in service, on which link generation and as which pid; who is rejoining; when
    /// a lost crowd is given up on (the join timeout after every worker was lost: a stall that
    /// made members look down must not end a job).
    pub(super) roster: Roster,
}

/// A dead or finished incarnation's links end (unless a newer incarnation replaced them): the
/// calls still queued on them were decided by a policy that no longer exists.
impl Drop for Shell {
    fn drop(&mut self) {
        for i in 0..self.roster.len() {
            if let Some(m) = self.roster.member(i) {
                self.shared.links.detach_generation(&i, m.epoch);
            }
        }
    }
}

impl Shell {
    /// Records a line a person reads (moves, failures, the job's end): logged at INFO.
    pub(super) fn log(&mut self, line: String) {
        let stamped = format!("[{:8.3} s] {line}", self.clock.now().as_secs_f64());
        info!("{stamped}");
        self.outcome.log.push(stamped);
    }

    /// Records a routine dispatch step (send, load, assign): kept in the outcome's log, logged
    /// at DEBUG only, so a run of thousands of tasks does not flood the console.
    fn trace(&mut self, line: String) {
        let stamped = format!("[{:8.3} s] {line}", self.clock.now().as_secs_f64());
        debug!("{stamped}");
        self.outcome.log.push(stamped);
    }

    fn node_of(&self, w: WorkerId) -> String {
        self.workers.get(w.0 as usize).map_or_else(|| w.to_string(), |h| h.node.clone())
    }

    /// Queues `cmd` on the worker's link (nothing when the worker is lost).
    fn send(&mut self, w: WorkerId, cmd: Cmd) {
        let worker = w.0 as usize;
        if self.roster.is_lost(worker) {
            return;
        }
        let Some(h) = self.workers.get(worker) else { return };
        let _ = self.shared.links.submit(&worker, step(self.ctx.clone(), worker, h.node.clone(), cmd));
    }

    pub(super) fn drain(&mut self, now: Micros) {
        let (ready, running) = self.policy.task_queue();
        crate::live::set_queue("pipeline", "ready", ready as u64);
        crate::live::set_queue("pipeline", "running", running as u64);
        while let Some(action) = self.policy.poll_action() {
            let text = match &action {
                Action::Reassigned { task, from, to } => {
                    format!("reassigned {task} from {} to {}", self.node_of(*from), self.node_of(*to))
                }
                Action::Requeued { task, from } => {
                    format!("requeued {task} from {} (no survivor fits yet)", self.node_of(*from))
                }
                other => format!("{other}"),
            };
            if matches!(action, Action::Reassigned { .. } | Action::Requeued { .. }) {
                self.outcome.moves.push(text.clone());
                self.log(text);
            } else if matches!(action, Action::Stalled { .. }) {
                self.log(text);
            } else {
                self.trace(text);
            }
            self.perform(now, action);
        }
    }

    fn perform(&mut self, now: Micros, action: Action) {
        match action {
            Action::SendStage { worker, stage } => {
                let Some(s) = self.job.stages.get(stage) else { return };
                let cmd = Cmd::Fetch {
                    stage,
                    sha256: s.signature.sha256.clone(),
                    blob: *blake3::hash(&s.bytes).as_bytes(),
                    size: s.signature.size_bytes,
                };
                self.send(worker, cmd);
            }
            Action::Load { worker, stage } => {
                let Some(s) = self.job.stages.get(stage) else { return };
                let sha256 = s.signature.sha256.clone();
                self.send(worker, Cmd::Load { stage, sha256 });
            }
            Action::Unload { worker } => self.send(worker, Cmd::Unload),
            Action::Assign { task, worker, .. } => match self.task_inputs(task) {
                Ok(tensors) => {
                    if let Some(p) = &self.progress {
                        let _ = p.send(Progress::Assigned { task, node: self.node_of(worker) });
                    }
                    let keep_outputs = task.stage + 1 < self.job.stages.len();
                    self.send(worker, Cmd::Run { task, tensors, keep_outputs });
                }
                Err(e) => self.fail_task(now, worker, task, e),
            },
            Action::JobDone => self.done = true,
            Action::JobFailed { task } => self.failed = Some(task),
            Action::Reassigned { .. }
            | Action::Requeued { .. }
            | Action::IgnoredCompletion { .. }
            | Action::Stalled { .. }
            | Action::InputDone { .. } => {}
        }
    }

    fn fail_task(&mut self, now: Micros, worker: WorkerId, task: TaskId, detail: String) {
        self.log(format!("cannot start {task}: {detail}"));
        self.last_error.insert(task, detail);
        self.policy.handle_task_done(now, worker, task, false);
    }

    fn add_tally(&mut self, t: &EncodeTally) {
        let o = &mut self.outcome.tally;
        o.raw += t.raw;
        o.wire += t.wire;
        o.max_abs_error = o.max_abs_error.max(t.max_abs_error);
        o.by_reference += t.by_reference;
    }

    /// A stage's inputs for one job input, as they go in the request: the previous stage's
    /// outputs by name (references to the worker holding them, or encoded here when held here),
    /// else job inputs (encoded here).
    fn task_inputs(&mut self, task: TaskId) -> Result<Vec<WireNamed>, String> {
        let sig = self.job.chain.stage(task.stage).ok_or("no such stage")?;
        let global = *self.map.get(task.input).ok_or("no such input")?;
        let job_inputs = self.job.inputs.get(global).ok_or("no such input")?;
        let prev = match task.stage {
            0 => None,
            k => Some(
                self.outputs[task.input][k - 1]
                    .as_ref()
                    .ok_or_else(|| format!("outputs of {} are missing", TaskId::new(task.input, k - 1)))?,
            ),
        };
        let mut out = Vec::with_capacity(sig.inputs.len());
        let mut tally = EncodeTally::default();
        let mut activation_bytes = 0u64;
        for t in &sig.inputs {
            let here = match prev {
                Some(Held::At { refs, .. }) => {
                    if let Some(r) = refs.iter().find(|o| o.name == t.name) {
                        out.push(r.clone());
                        continue;
                    }
                    None
                }
                Some(Held::Here(p)) => p.iter().find(|o| o.name == t.name).map(|o| (o, true)),
                None => None,
            };
            let (tensor, activation) = here
                .or_else(|| job_inputs.iter().find(|o| o.name == t.name).map(|o| (o, false)))
                .ok_or_else(|| format!("no tensor named {} for {task}", t.name))?;
            let mut one = EncodeTally::default();
            let encoded =
                encode_tensors(std::slice::from_ref(tensor), self.job.lossy_bf16, &self.shelf, &mut one)
                    .map_err(|e| e.to_string())?;
            if activation {
                activation_bytes += one.wire;
            }
            tally.raw += one.raw;
            tally.wire += one.wire;
            tally.max_abs_error = tally.max_abs_error.max(one.max_abs_error);
            tally.by_reference += one.by_reference;
            out.extend(encoded);
        }
        self.add_tally(&tally);
        self.outcome.activations.via_foreman += activation_bytes;
        Ok(out)
    }

    /// Declares `worker` lost (once) and re-plans its work.
    pub(super) fn lose(&mut self, now: Micros, worker: usize, why: &str) {
        if self.roster.lose(worker) {
            self.on_lost(now, worker, why);
        }
    }

    /// What follows a loss the roster decided: its link ends, its tasks and the outputs it kept
    /// are re-planned, and its node is joined again if it is back already.
    fn on_lost(&mut self, now: Micros, worker: usize, why: &str) {
        if let Some(m) = self.roster.member(worker) {
            self.shared.links.detach_generation(&worker, m.epoch);
        }
        let Some(h) = self.workers.get_mut(worker) else { return };
        h.summary.lost = true;
        let node = h.node.clone();
        self.log(format!("worker {node} lost ({why}); re-planning its tasks"));
        if let Some(p) = &self.progress {
            let _ = p.send(Progress::Lost { node });
        }
        self.policy.handle_worker_lost(now, WorkerId(worker as u32));
        self.outputs_lost_with(now, worker);
        self.drain(now);
        // its node may already be back (a fast restart is noticed only when a call fails)
        self.try_rejoin();
    }

    /// Activations kept on lost worker `worker` and not read yet by the next stage are gone: per
    /// input, the earliest stage whose outputs must be made again (walking back over stages
    /// whose outputs were on that worker too) is run again, as the policy is told.
    fn outputs_lost_with(&mut self, now: Micros, worker: usize) {
        let stages = self.job.stages.len();
        let on_lost = |h: &Option<Held>| matches!(h, Some(Held::At { worker: w, .. }) if *w == worker);
        let mut redo = Vec::new();
        for (input, held) in self.outputs.iter_mut().enumerate() {
            let Some(k) =
                (0..stages.saturating_sub(1)).rev().find(|&k| on_lost(&held[k]) && held[k + 1].is_none())
            else {
                continue;
            };
            let mut j = k;
            while j > 0 && on_lost(&held[j - 1]) {
                j -= 1;
            }
            for h in &mut held[j..=k] {
                *h = None;
            }
            redo.push(TaskId::new(input, j));
        }
        for task in redo {
            self.log(format!("outputs of {task} were on a lost worker; running it again"));
            self.policy.handle_outputs_lost(now, task);
        }
    }

    /// Joins again every rejoining worker whose actor is announced (the answer arrives as an
    /// [`EventKind::Rejoined`] event). The join is a direct typed call, not through the links:
    /// the worker has none until it is back, and the call goes to whichever incarnation the
    /// name resolves to now.
    pub(super) fn try_rejoin(&mut self) {
        let directory = self.services.directory();
        let ready: Vec<(usize, String, String)> = self
            .roster
            .rejoin_candidates()
            .into_iter()
            .filter(|&worker| self.announced(&directory, worker))
            .filter_map(|worker| {
                let node = &self.workers.get(worker)?.node;
                Some((worker, node.clone(), worker_name(node)))
            })
            .collect();
        for (worker, node, name) in ready {
            self.roster.rejoin_started(worker);
            // short: the directory may still name the dead incarnation's connection; a failed
            // try is retried at once, and then reaches the new one
            let handle = WorkerHandle::by_name(&self.actors, &name);
            let (events, timeout, clock) =
                (self.ctx.events.clone(), REJOIN_TIMEOUT.min(self.settings.rpc_timeout), self.clock);
            tokio::spawn(async move {
                let start = clock.now().as_secs_f64();
                let kind = match handle.call(Join, timeout).await {
                    Ok(report) => EventKind::Rejoined { handle, report: Box::new(report) },
                    Err(e) => {
                        warn!(%node, error = %e, "rejoining worker did not join (retried when it is announced again)");
                        EventKind::RejoinFailed
                    }
                };
                let end = clock.now().as_secs_f64();
                let _ = events.send(Event { worker, generation: 0, start, end, kind });
            });
        }
    }

    /// Whether `worker`'s actor is announced in `directory` (from [`Services::directory`]): its
    /// node is a member serving it now.
    pub(super) fn announced(&self, directory: &[(NodeId, Vec<String>)], worker: usize) -> bool {
        let Some(node) = self.workers.get(worker).map(|h| &h.node) else { return false };
        let service = service_name(&worker_name(node));
        directory.iter().any(|(p, names)| p.as_str() == node && names.contains(&service))
    }

    /// Puts a lost worker back in service under its old id, on a new link (a new generation).
    fn rejoin(&mut self, now: Micros, worker: usize, handle: WorkerHandle, report: Joined) {
        let Joined { node, pid, cached, live, straggler, telemetry } = report;
        if !self.roster.is_lost(worker) {
            return;
        }
        let Some(h) = self.workers.get_mut(worker) else { return };
        let rtt_ms = self.link.rtt(&NodeId::new(&node)).map_or(0.0, |d| d.as_secs_f64() * 1e3);
        let generation = self.shared.links.attach(worker, handle.clone());
        self.roster.joined(worker, generation, pid);
        h.probe = WorkerHandle::by_name(&self.actors, handle.name());
        h.actor = handle;
        h.summary.lost = false;
        h.summary.rejoined += 1;
        h.summary.tasks_since_rejoin = 0;
        h.summary.pid = pid;
        h.summary.straggler = straggler;
        h.pulled.iter_mut().for_each(|p| *p = false);
        let report = WorkerReport { telemetry: policy_telemetry(&telemetry, rtt_ms), live, cached };
        self.log(format!("worker {node} rejoined (pid {pid}); back in service"));
        if let Some(p) = &self.progress {
            let _ = p.send(Progress::Rejoined { node: node.clone() });
        }
        if let Err(e) = self.policy.handle_worker_joined(now, WorkerId(worker as u32), report) {
            self.log(format!("worker {node} could not rejoin: {e}"));
        }
        self.drain(now);
    }

    /// Feeds one event (a call's outcome, telemetry, a rejoin's answer) at `now`.
    pub(super) fn on_event(&mut self, now: Micros, ev: Event) {
        let w = WorkerId(ev.worker as u32);
        match ev.kind {
            EventKind::Rejoined { handle, report } => {
                self.rejoin(now, ev.worker, handle, *report);
                return;
            }
            EventKind::RejoinFailed => {
                self.roster.rejoin_failed(ev.worker);
                self.try_rejoin();
                return;
            }
            _ => {}
        }
        // about a lost worker, or about a generation of its link since replaced (a call to a
        // restarted worker's dead process that timed out after the new one rejoined): stale
        if !self.roster.is_current(ev.worker, ev.generation) {
            if let EventKind::Ran { task, .. } = ev.kind {
                self.log(format!("late answer for {task} from lost worker {} ignored", self.node_of(w)));
            }
            return;
        }
        match ev.kind {
            EventKind::Fetched { stage, result } => match result {
                Ok(cached) => {
                    if !cached {
                        self.workers[ev.worker].pulled[stage] = true;
                        self.outcome.spans.push(Span {
                            worker: ev.worker,
                            kind: SpanKind::Fetch(stage),
                            start: ev.start,
                            end: ev.end,
                        });
                    }
                }
                Err(e) => self.log(format!("pull of s{stage} on {} failed: {e}", self.node_of(w))),
            },
            EventKind::Loaded { stage, result } => match result {
                Ok(cpu_micros) => {
                    let cold = self.workers[ev.worker].pulled.get(stage).copied().unwrap_or(false);
                    self.outcome.spans.push(Span {
                        worker: ev.worker,
                        kind: SpanKind::Load { stage, cold, cpu_micros },
                        start: ev.start,
                        end: ev.end,
                    });
                    self.policy.handle_stage_loaded(now, w, stage, true);
                }
                Err(e) => {
                    self.log(format!("load of s{stage} on {} failed: {e}", self.node_of(w)));
                    self.policy.handle_stage_loaded(now, w, stage, false);
                }
            },
            EventKind::Unloaded | EventKind::Joined => {}
            EventKind::Lost(why) => {
                self.lose(now, ev.worker, &why);
                return;
            }
            EventKind::Ran { task, result } => match result {
                Ok(ran) => {
                    self.outcome.tally.raw += ran.raw;
                    self.outcome.tally.wire += ran.wire;
                    self.outcome.tally.max_abs_error =
                        self.outcome.tally.max_abs_error.max(ran.max_abs_error);
                    self.outcome.spans.push(Span {
                        worker: ev.worker,
                        kind: SpanKind::Run(task),
                        start: ev.start,
                        end: ev.end,
                    });
                    self.outcome.compute_s.push((task.stage, ev.worker, ran.compute_micros as f64 / 1e6));
                    self.outcome.task_times.push(TaskTimes {
                        task,
                        worker: ev.worker,
                        span_s: ev.end - ev.start,
                        call_s: ran.call_s,
                        compute_s: ran.compute_micros as f64 / 1e6,
                        reported: ran.times,
                    });
                    let a = &mut self.outcome.activations;
                    a.via_foreman += ran.activation_bytes_in;
                    a.outputs_to_foreman += ran.output_bytes_in;
                    if task.stage > 0 {
                        a.worker_to_worker += ran.times.pulled_bytes;
                        a.same_worker += ran.times.local_bytes;
                    }
                    if task.stage + 1 == self.job.stages.len()
                        && let Some(&global) = self.map.get(task.input)
                        && let Held::Here(outputs) = &ran.outputs
                    {
                        self.shared.answer(global, outputs);
                    }
                    self.outputs[task.input][task.stage] = Some(ran.outputs);
                    self.workers[ev.worker].summary.tasks += 1;
                    if self.workers[ev.worker].summary.rejoined > 0 {
                        self.workers[ev.worker].summary.tasks_since_rejoin += 1;
                    }
                    if let Some(p) = &self.progress {
                        let _ = p.send(Progress::Done { task });
                    }
                    self.policy.handle_task_done(now, w, task, true);
                }
                Err(e) => {
                    crate::work::PIPELINE.failed();
                    self.log(format!("{task} failed on {}: {e}", self.node_of(w)));
                    self.last_error.insert(task, e);
                    self.policy.handle_task_done(now, w, task, false);
                }
            },
            EventKind::InputsLost { task, detail } => {
                self.log(format!(
                    "{task} on {} could not read its inputs ({detail}); making them again",
                    self.node_of(w)
                ));
                if let Some(held) = self.outputs.get_mut(task.input)
                    && let Some(h) = task.stage.checked_sub(1).and_then(|k| held.get_mut(k))
                {
                    *h = None;
                }
                self.policy.handle_inputs_lost(now, w, task);
            }
            EventKind::Rejoined { .. } | EventKind::RejoinFailed => {} // handled above
            EventKind::Telemetry(t) => {
                if let Incarnation::Restarted { old, new } = self.roster.check_incarnation(ev.worker, t.pid) {
                    // a new incarnation answered: the node was restarted before membership
                    // declared it down, and the calls out to the old process will never be
                    // answered, so they are given up now (not after the call timeout) and the
                    // new one is joined
                    let why = format!("restarted: pid {new} answered, the worker that joined was pid {old}");
                    self.on_lost(now, ev.worker, &why);
                    return;
                }
                let rtt_ms = self
                    .link
                    .rtt(&NodeId::new(&self.workers[ev.worker].node))
                    .map_or(0.0, |d| d.as_secs_f64() * 1e3);
                let h = &mut self.workers[ev.worker];
                h.summary.telemetry = t;
                h.summary.rtt_ms = rtt_ms;
                self.policy.handle_telemetry(now, w, policy_telemetry(&t, rtt_ms));
            }
        }
        self.drain(now);
    }
}

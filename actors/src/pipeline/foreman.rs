//! The foreman shell: carries out the decisions of `troupe_policy::pipeline::Foreman` over the
//! cluster.
//!
//! It finds the workers (members announcing a typed [`PipelineWorker`] actor named
//! [`worker_name`]`(NODE)`; each message is role-checked, for the `scheduler` role only), asks
//! each to join, submits the job to the policy and then loops: policy actions become calls on
//! the worker's link, one ordered queue per worker ([`crate::typed::Links`]: performed in
//! order, one call at a time, so a `Fetch` lands before the `Load` after it); outcomes come back
//! tagged with the link's generation (an outcome of a generation since replaced or ended is
//! ignored), and with telemetry (polled every `telemetry_period` by a direct typed call, RTT
//! from QUIC) and membership events they go back into the policy. Completed outputs are held
//! here, so a lost worker loses only what it was doing. A worker is declared lost when
//! membership says it is down, when a call to it finds its incarnation gone or gets no answer
//! within the timeout (`ActorError::PeerLost`, `ActorError::Timeout`: its link ends), or when
//! its telemetry answers with another pid than the one that joined (its node was killed and
//! started again before membership noticed: the calls out to the dead process would otherwise
//! wait out the call timeout, as the replaced connection never reports the peer gone); its
//! tasks are re-planned by the policy and each move is logged. A refused message or a worker's
//! own failure (`Forbidden`, `BadMessage`, `Failed`) is a problem with the request, not a lost
//! worker.
//!
//! Shape, stated plainly: the foreman is a [`crate::SchedulerActor`] under a supervisor of its
//! own in the foreman node's process (not the node's root supervisor: a job owns it), and a
//! restart resubmits the inputs not answered yet. Answers live in the job's [`Ledger`]: with a
//! journal (the `pipeline` job's default), the acceptance and every answer are synced to disk
//! before they count, so a foreman node killed with `kill -9` and started again resumes the job
//! with the unanswered inputs only (see [`AcceptedJob::open`]); telemetry is pulled (one RPC per worker per period) rather than
//! pushed. Activations go from the producing worker to the consuming one: a worker running an
//! intermediate stage keeps its outputs on its blob shelf and answers with references
//! ([`TensorBody::At`]); the foreman passes those references on in the next stage's `Run`, and
//! that worker pulls the bytes from the producer over the QUIC blob stream (or reads its own
//! shelf when it made them). The foreman carries control, job inputs and the last stage's
//! answers only; the bytes are counted as they move ([`ActivationBytes`]). Outputs kept on a
//! worker that is lost before the next stage read them are made again (the policy's
//! `handle_outputs_lost`). A lost worker whose node comes back (its worker actor announced again)
//! is joined again under its old id and put back in service, on a new link, within the same job.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::sync::{broadcast, mpsc, oneshot};
use tracing::{debug, info, warn};
use troupe_kernels::onnx::NamedTensor;
use troupe_policy::pipeline::coding::compress_activations;
use troupe_policy::pipeline::costs::CostModel;
use troupe_policy::pipeline::{
    Action, Foreman, ForemanConfig, Job, TaskId, Telemetry, WorkerId, WorkerReport,
};
use troupe_policy::{MembershipEvent, Micros};
use troupe_transport::{Link, NodeId, QuicNode};

use ractor::ActorRef;

use super::job::PipelineJob;
use super::ledger::{Ledger, Resumed};
use super::wire::{
    BlobShelf, EncodeTally, Fetch, GetStats, GetTelemetry, Join, Joined, Load, MAX_MESSAGE_DECODED_BYTES,
    Moved, Ran, Run, RunReply, RunTimes, TelemetrySample, TensorBody, Unload, WireNamed, WorkerStats,
    decode_tensors_from, encode_tensors,
};
use super::worker::{PipelineWorker, WORKER_PREFIX, worker_name};
use crate::kinds::scheduler::{SchedulerActor, SchedulerArgs, SchedulerMsg};
use crate::service::Services;
use crate::supervisor::{ChildSpec, Intensity, Supervisor, SupervisorArgs, SupervisorEvent};
use crate::typed::{ActorError, ActorHandle, Actors, Handles, Links, Outcome, RemoteMessage, service_name};
use troupe_transport::codec::DecodeBudget;

/// Longest a join of a lost worker's node may take before it is tried again.
const REJOIN_TIMEOUT: Duration = Duration::from_secs(2);

/// Foreman settings.
#[derive(Clone, Debug)]
pub struct ShellSettings {
    /// Workers to wait for before submitting.
    pub workers: usize,
    /// How long to wait for them.
    pub join_timeout: Duration,
    /// Telemetry period.
    pub telemetry_period: Duration,
    /// Longest a single request may take (a stage pull, a load or a task).
    pub rpc_timeout: Duration,
    /// Policy settings.
    pub policy: ForemanConfig,
    /// Drop every worker's live session before the job (jobs then start alike, e.g. when
    /// comparing modes); when false the policy is told what each worker holds (Tier 1 reuse):
    /// residency across jobs.
    pub fresh_start: bool,
    /// Task and load times learned by an earlier job ([`JobOutcome::learned_costs`]) for the
    /// policy to start from (used when the stage sizes match and `policy.remember_costs`).
    pub prior_costs: Option<CostModel>,
}

impl Default for ShellSettings {
    fn default() -> Self {
        ShellSettings {
            workers: 1,
            join_timeout: Duration::from_secs(30),
            telemetry_period: Duration::from_millis(500),
            rpc_timeout: Duration::from_secs(60),
            policy: ForemanConfig::default(),
            fresh_start: true,
            prior_costs: None,
        }
    }
}

/// Why a job did not complete.
#[derive(Debug, thiserror::Error)]
pub enum ShellError {
    /// Not enough workers joined.
    #[error("only {found} of {wanted} pipeline workers joined within {secs} s")]
    TooFewWorkers {
        /// Joined.
        found: usize,
        /// Wanted.
        wanted: usize,
        /// Waited.
        secs: u64,
    },
    /// The policy refused the job.
    #[error("foreman refused the job: {0}")]
    Refused(String),
    /// A task failed too often.
    #[error("job failed at task {task}: {detail}")]
    Failed {
        /// The task.
        task: String,
        /// The last error seen.
        detail: String,
    },
    /// Every worker was lost.
    #[error("every worker was lost")]
    NoWorkers,
    /// The job's journal could not be opened, replayed or appended to.
    #[error("{0}")]
    Journal(String),
}

/// A job together with its ledger: what it has accepted and answered (journaled or in memory).
#[derive(Debug)]
pub struct AcceptedJob {
    job: PipelineJob,
    ledger: Ledger,
}

impl AcceptedJob {
    /// Accepts `job` durably: with `journal`, the acceptance is journaled (synced) before this
    /// returns, or an earlier run's acceptance and answers are replayed from it.
    pub fn open(job: PipelineJob, journal: Option<&std::path::Path>) -> Result<(Self, Resumed), ShellError> {
        match journal {
            None => Ok((job.into(), Resumed::default())),
            Some(path) => {
                let (ledger, resumed) =
                    Ledger::open(path, &job).map_err(|e| ShellError::Journal(e.to_string()))?;
                Ok((AcceptedJob { job, ledger }, resumed))
            }
        }
    }
}

/// A job accepted in memory only.
impl From<PipelineJob> for AcceptedJob {
    fn from(job: PipelineJob) -> Self {
        let ledger = Ledger::in_memory(job.inputs.len());
        AcceptedJob { job, ledger }
    }
}

/// What a Gantt bar shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpanKind {
    /// Pulling a stage file.
    Fetch(usize),
    /// Creating a session; `cold` when the file was pulled in this job.
    Load {
        /// Stage.
        stage: usize,
        /// Pulled (true) or from the disk cache (false).
        cold: bool,
    },
    /// Running a task.
    Run(TaskId),
}

/// One bar of the Gantt chart, times in seconds from job start (as the foreman saw them).
#[derive(Clone, Debug, PartialEq)]
pub struct Span {
    /// Worker index.
    pub worker: usize,
    /// What.
    pub kind: SpanKind,
    /// Start, seconds.
    pub start: f64,
    /// End, seconds.
    pub end: f64,
}

/// A worker as the outcome reports it.
#[derive(Clone, Debug, Default)]
pub struct WorkerSummary {
    /// Node name.
    pub node: String,
    /// OS process id it reported.
    pub pid: u32,
    /// How it is slowed, in words.
    pub straggler: String,
    /// Declared lost during the job.
    pub lost: bool,
    /// Tasks it completed.
    pub tasks: usize,
    /// Its own counters at the end (None when lost).
    pub stats: Option<WorkerStats>,
    /// Last telemetry.
    pub telemetry: TelemetrySample,
    /// Its RSS when it joined holding no session (the idle floor: runtime and ONNX Runtime
    /// loaded, no stage), bytes; `None` when it joined with a live session or not at all.
    pub idle_rss_bytes: Option<u64>,
    /// Last RTT QUIC measured to it, ms.
    pub rtt_ms: f64,
    /// Times it was put back in service after being lost.
    pub rejoined: usize,
    /// Tasks it completed since it was last put back in service.
    pub tasks_since_rejoin: usize,
}

/// The result of a completed job.
#[derive(Clone, Debug, Default)]
pub struct JobOutcome {
    /// Per input, the last stage's outputs.
    pub outputs: Vec<Vec<NamedTensor>>,
    /// Submission to the last answer, seconds.
    pub makespan_s: f64,
    /// Every policy action and event, time-stamped.
    pub log: Vec<String>,
    /// The `Reassigned` / `Requeued` lines: which task moved where.
    pub moves: Vec<String>,
    /// Gantt bars.
    pub spans: Vec<Span>,
    /// The workers.
    pub workers: Vec<WorkerSummary>,
    /// f32 activations sent, both directions.
    pub tally: EncodeTally,
    /// Per stage, median ONNX Runtime compute time of its tasks, seconds, per worker.
    pub compute_s: Vec<(usize, usize, f64)>,
    /// The journal that held the job, if it had one: remove it once the outputs are out, so
    /// that the next run of the same job starts afresh.
    pub journal: Option<std::path::PathBuf>,
    /// Per completed task, where its time went.
    pub task_times: Vec<TaskTimes>,
    /// Where the activation bytes went (counted as they moved).
    pub activations: ActivationBytes,
    /// What the policy learned of task and load times (for [`ShellSettings::prior_costs`]).
    pub learned_costs: Option<CostModel>,
    /// Home stage per worker index under the policy's stage plan, as the job ended (empty: none).
    pub stage_plan: Vec<(usize, usize)>,
}

/// One completed task's times, seconds: as the foreman saw it and as the worker reported it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TaskTimes {
    /// The task.
    pub task: TaskId,
    /// Worker index.
    pub worker: usize,
    /// The foreman's Run span (request sent to outputs in hand).
    pub span_s: f64,
    /// The call alone (request serialised and sent, answer received and read).
    pub call_s: f64,
    /// ONNX Runtime time the worker measured.
    pub compute_s: f64,
    /// The worker's own account of the rest.
    pub reported: RunTimes,
}

/// Counters of the bytes of intermediate activations (one stage's f32 outputs for the next
/// stage), read off the messages and pulls as they happen; a job's answers (last-stage outputs,
/// which the foreman must receive) are counted apart.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ActivationBytes {
    /// Activation bytes the foreman received (in answers or pulled) or sent inline in requests.
    pub via_foreman: u64,
    /// Activation bytes workers pulled from other workers.
    pub worker_to_worker: u64,
    /// Activation bytes a worker read from its own shelf (the next stage ran where the last did).
    pub same_worker: u64,
    /// Final outputs the foreman received, bytes.
    pub outputs_to_foreman: u64,
}

impl ActivationBytes {
    /// The foreman's share of the activation bytes that moved between nodes (NaN when none did).
    pub fn foreman_share(&self) -> f64 {
        let all = self.via_foreman + self.worker_to_worker;
        if all == 0 { f64::NAN } else { self.via_foreman as f64 / all as f64 }
    }
}

/// Progress events for observers (tests use them to kill a worker mid-job).
#[derive(Clone, Debug, PartialEq)]
pub enum Progress {
    /// A task was sent to a worker.
    Assigned {
        /// The task.
        task: TaskId,
        /// Node name of the worker.
        node: String,
    },
    /// A task completed.
    Done {
        /// The task.
        task: TaskId,
    },
    /// A worker was declared lost.
    Lost {
        /// Its node.
        node: String,
    },
    /// A lost worker was put back in service.
    Rejoined {
        /// Its node.
        node: String,
    },
}

/// A worker as the foreman reaches it: a typed handle to its actor.
type WorkerHandle = ActorHandle<PipelineWorker>;

/// The foreman's per-worker call queues (key: worker index), shared by every foreman
/// incarnation of the job: one ordered queue per worker, one generation rule.
type WorkerLinks = Links<usize, ActorHandle<PipelineWorker>, Step>;

/// What one queued call produced, and when it ran (seconds from job start).
struct Step {
    start: f64,
    end: f64,
    kind: EventKind,
}

type StepFuture = Pin<Box<dyn Future<Output = Result<Step, ActorError>> + Send>>;

/// A call's error as the foreman reads it: a refusal or failure the worker answered with (a
/// problem with the request, as text), or the worker lost (gone, or silent past the timeout):
/// the error that ends its link.
fn refusal(actor: &str, e: ActorError) -> Result<String, ActorError> {
    match e {
        ActorError::Failed { detail, .. } => Ok(detail),
        e @ (ActorError::Forbidden { .. } | ActorError::BadMessage { .. }) => Ok(e.to_string()),
        e @ ActorError::PeerLost { .. } => Err(e),
        e => Err(ActorError::PeerLost { actor: actor.to_owned(), reason: e.to_string() }),
    }
}

/// Calls the worker: its reply, or its refusal as text; `Err` when the worker is lost.
async fn ask<M>(h: &WorkerHandle, msg: M, timeout: Duration) -> Result<Result<M::Reply, String>, ActorError>
where
    M: RemoteMessage,
    PipelineWorker: Handles<M>,
{
    match h.call(msg, timeout).await {
        Ok(r) => Ok(Ok(r)),
        Err(e) => refusal(h.name(), e).map(Err),
    }
}

enum Cmd {
    Fetch { stage: usize, sha256: String, blob: [u8; 32], size: u64 },
    Load { stage: usize, sha256: String },
    Unload,
    Run { task: TaskId, tensors: Vec<WireNamed>, keep_outputs: bool },
}

/// A task's outputs as the foreman holds them.
#[derive(Clone)]
enum Held {
    /// Here, decoded (a last stage's answer, or outputs a worker sent inline).
    Here(Vec<NamedTensor>),
    /// On worker `worker`'s blob shelf: references ([`TensorBody::At`]) the next stage's worker
    /// pulls from there.
    At { worker: usize, refs: Vec<WireNamed> },
}

struct TaskRan {
    outputs: Held,
    compute_micros: u64,
    raw: u64,
    wire: u64,
    max_abs_error: f32,
    times: RunTimes,
    /// The call (request out, answer back and read), seconds.
    call_s: f64,
    /// f32 payload bytes of activations that came to the foreman in the answer.
    activation_bytes_in: u64,
    /// f32 payload bytes of final outputs that came to the foreman (inline or pulled).
    output_bytes_in: u64,
}

enum EventKind {
    Fetched {
        stage: usize,
        result: Result<bool, String>,
    },
    Loaded {
        stage: usize,
        result: Result<(), String>,
    },
    Unloaded,
    Ran {
        task: TaskId,
        result: Result<TaskRan, String>,
    },
    /// The task could not read its inputs: neither the worker nor the foreman could fetch them
    /// from the worker that made them (it restarted and lost them, or cannot be reached).
    InputsLost {
        task: TaskId,
        detail: String,
    },
    /// A join through the worker's link as an incarnation starts (its answer went to `recover`).
    Joined,
    Telemetry(TelemetrySample),
    /// A lost worker's node came back and its worker answered a join.
    Rejoined {
        handle: WorkerHandle,
        report: Box<Joined>,
    },
    /// Joining a lost worker again failed (retried at once, and at the next announcement).
    RejoinFailed,
    /// The worker's link ended: the worker is gone, or silent past the timeout.
    Lost(String),
}

struct Event {
    worker: usize,
    /// The generation of the worker's link the event is about (for telemetry, the one current
    /// when the poll started): events of a generation since replaced or ended are stale.
    generation: u64,
    start: f64,
    end: f64,
    kind: EventKind,
}

struct Handle {
    node: String,
    /// The handle its link calls through (addresses the incarnation that joined).
    actor: WorkerHandle,
    /// Telemetry polls: by name, so a restarted worker answers with its new pid.
    probe: WorkerHandle,
    /// The generation of its link this incarnation of the foreman attached.
    generation: u64,
    summary: WorkerSummary,
    pulled: Vec<bool>,
}

/// Context a worker's queued calls need.
#[derive(Clone)]
struct ExecCtx {
    link: QuicNode,
    /// The foreman's blob shelf (inputs it relays when workers cannot reach each other).
    shelf: BlobShelf,
    foreman: String,
    lossy_bf16: bool,
    /// The crowd's nodes (whether their links are same-host decides activation compression).
    crowd: Arc<Vec<NodeId>>,
    timeout: Duration,
    t0: Instant,
    /// Telemetry and rejoin answers (calls made outside the links).
    events: mpsc::UnboundedSender<Event>,
}

/// The call `cmd` makes on worker `worker`'s link, timed, as one queued step.
fn step(
    ctx: ExecCtx,
    worker: usize,
    node: String,
    cmd: Cmd,
) -> impl FnOnce(WorkerHandle) -> StepFuture + Send {
    move |h| {
        Box::pin(async move {
            let start = ctx.t0.elapsed().as_secs_f64();
            let timeout = ctx.timeout;
            let kind = match cmd {
                Cmd::Fetch { stage, sha256, blob, size } => {
                    let msg = Fetch { stage: stage as u32, sha256, blob, size, from: ctx.foreman.clone() };
                    EventKind::Fetched { stage, result: ask(&h, msg, timeout).await?.map(|f| f.cached) }
                }
                Cmd::Load { stage, sha256 } => {
                    let msg = Load { stage: stage as u32, sha256 };
                    EventKind::Loaded { stage, result: ask(&h, msg, timeout).await?.map(|_| ()) }
                }
                Cmd::Unload => {
                    // a refused unload changes nothing the foreman tracks
                    let _ = ask(&h, Unload, timeout).await?;
                    EventKind::Unloaded
                }
                Cmd::Run { task, tensors, keep_outputs } => {
                    run_task(&ctx, &h, worker, &node, task, tensors, keep_outputs).await?
                }
            };
            Ok(Step { start, end: ctx.t0.elapsed().as_secs_f64(), kind })
        })
    }
}

/// Unloads (when asked) and joins a worker as the first step of its link; the answer goes to
/// `joined` (`None`: it did not join).
fn join_step(
    unload: bool,
    timeout: Duration,
    t0: Instant,
    joined: oneshot::Sender<Option<Joined>>,
) -> impl FnOnce(WorkerHandle) -> StepFuture + Send {
    move |h| {
        Box::pin(async move {
            let start = t0.elapsed().as_secs_f64();
            let unloaded = if unload {
                h.call(Unload, timeout).await.map_err(|e| {
                    warn!(error = %e, "worker did not unload; skipped");
                    e
                })
            } else {
                Ok(())
            };
            let answer = match unloaded {
                Ok(()) => h.call(Join, timeout).await.map_err(|e| {
                    warn!(error = %e, "worker did not join; skipped");
                    e
                }),
                Err(e) => Err(e),
            };
            let step = |kind| Step { start, end: t0.elapsed().as_secs_f64(), kind };
            match answer {
                Ok(report) => {
                    let _ = joined.send(Some(report));
                    Ok(step(EventKind::Joined))
                }
                Err(e) => {
                    let _ = joined.send(None);
                    refusal(h.name(), e).map(|_| step(EventKind::Joined))
                }
            }
        })
    }
}

/// Runs `task` on the worker (relaying its inputs once if it could not pull them), and reads
/// its outputs; `Err` when the worker is lost.
async fn run_task(
    ctx: &ExecCtx,
    h: &WorkerHandle,
    worker: usize,
    node: &str,
    task: TaskId,
    tensors: Vec<WireNamed>,
    keep_outputs: bool,
) -> Result<EventKind, ActorError> {
    let req = Run {
        input: task.input as u32,
        stage: task.stage as u32,
        tensors,
        from: ctx.foreman.clone(),
        lossy_bf16: ctx.lossy_bf16,
        compress: compress_activations(ctx.crowd.iter().map(|p| ctx.link.same_host(p))),
        keep_outputs,
    };
    let called = Instant::now();
    let mut answer = ask(h, req.clone(), ctx.timeout).await?;
    let mut relayed = 0u64;
    if let Ok(RunReply::PullFailed { node: holder, detail }) = &answer {
        // the worker could not reach the one holding its inputs: relay them here
        // (counted as activation bytes through the foreman) and ask once more
        warn!(worker = %node, %holder, %detail, "pull between workers failed; the foreman relays");
        answer = match relay(ctx, req).await {
            Ok((req, bytes)) => {
                relayed = bytes;
                ask(h, req, ctx.timeout).await?
            }
            // the holder no longer has them (or cannot be reached): they are made again
            Err(detail) => return Ok(EventKind::InputsLost { task, detail }),
        };
    }
    let call_s = called.elapsed().as_secs_f64();
    let result = match answer {
        Ok(RunReply::Ran(Ran {
            tensors,
            compute_micros,
            raw_f32_bytes,
            wire_f32_bytes,
            max_abs_error,
            times,
            ..
        })) => match ran_outputs(ctx, worker, node, tensors, keep_outputs).await {
            Ok((outputs, inline, pulled)) => Ok(TaskRan {
                outputs,
                compute_micros,
                raw: raw_f32_bytes,
                wire: wire_f32_bytes,
                max_abs_error,
                times,
                call_s,
                activation_bytes_in: relayed + if keep_outputs { inline + pulled } else { 0 },
                output_bytes_in: if keep_outputs { 0 } else { inline + pulled },
            }),
            Err(e) => Err(e.to_string()),
        },
        Ok(other) => Err(format!("unexpected answer {other:?}")),
        Err(e) => Err(e),
    };
    Ok(EventKind::Ran { task, result })
}

/// `req` with its [`TensorBody::At`] inputs pulled here from the workers holding them and put on
/// the foreman's shelf (the worker then pulls them from the foreman), and the bytes relayed.
async fn relay(ctx: &ExecCtx, mut req: Run) -> Result<(Run, u64), String> {
    let mut bytes = 0u64;
    for t in &mut req.tensors {
        if let TensorBody::At { node, blob, len } = &t.body {
            let cap = u32::try_from(*len).map_err(|_| format!("tensor {}: {len} bytes", t.name))?;
            let got = ctx
                .link
                .fetch_blob(&NodeId::new(node), *blob, cap)
                .await
                .map_err(|e| format!("relaying tensor {} from {node}: {e}", t.name))?;
            bytes += got.len() as u64;
            let id = ctx.shelf.put_transient(got);
            t.body = TensorBody::ByRef { blob: id, len: *len };
        }
    }
    Ok((req, bytes))
}

/// A task's outputs from its answer: references to the worker's shelf when it kept them (an
/// intermediate stage; nothing is pulled here), else decoded here (pulling what came by
/// reference from the worker). Returns them with the f32 bytes that came inline and pulled.
async fn ran_outputs(
    ctx: &ExecCtx,
    worker: usize,
    node: &str,
    tensors: Vec<WireNamed>,
    keep_outputs: bool,
) -> Result<(Held, u64, u64), super::wire::WireError> {
    if keep_outputs && tensors.iter().all(|t| matches!(t.body, TensorBody::At { .. })) {
        return Ok((Held::At { worker, refs: tensors }, 0, 0));
    }
    let mut moved = Moved::default();
    let outputs = decode_tensors_from(
        tensors,
        &ctx.link,
        node,
        None,
        &mut DecodeBudget::new(MAX_MESSAGE_DECODED_BYTES),
        &mut moved,
    )
    .await?;
    Ok((Held::Here(outputs), moved.inline_f32, moved.pulled))
}

fn micros_since(t0: Instant) -> Micros {
    Micros(u64::try_from(t0.elapsed().as_micros()).unwrap_or(u64::MAX))
}

fn policy_telemetry(t: &TelemetrySample, rtt_ms: f64) -> Telemetry {
    Telemetry {
        cpu_load: t.cpu_load,
        free_ram_bytes: t.free_ram_bytes,
        ram_budget_bytes: t.ram_budget_bytes,
        battery_pct: t.battery_pct,
        temperature_c: t.temperature_c,
        rtt_ms,
    }
}

/// A member's worker: its node and its typed-actor name.
type Target = (NodeId, String);

/// Waits for `settings.workers` remote pipeline workers (members that announced a worker
/// actor; woken by announcements, not polling) and returns them sorted by node name.
async fn discover(services: &Services, settings: &ShellSettings) -> Result<Vec<Target>, ShellError> {
    let prefix = service_name(WORKER_PREFIX);
    let at = service_name("");
    let named = |found: Vec<(NodeId, String)>| -> Vec<Target> {
        found
            .into_iter()
            .filter_map(|(peer, service)| {
                let name = service.strip_prefix(at.as_str())?.to_owned();
                Some((peer, name))
            })
            .collect()
    };
    let wanted = settings.workers;
    match services
        .wait_for(settings.join_timeout, |s| {
            let found = s.services_with_prefix(&prefix);
            (found.len() >= wanted).then_some(found)
        })
        .await
    {
        Some(found) => Ok(named(found)),
        None => Err(ShellError::TooFewWorkers {
            found: services.services_with_prefix(&prefix).len(),
            wanted,
            secs: settings.join_timeout.as_secs(),
        }),
    }
}

struct Shell {
    link: QuicNode,
    shelf: BlobShelf,
    job: Arc<PipelineJob>,
    /// This incarnation's job input i is the job's input `map[i]` (a restarted foreman submits
    /// only the inputs not answered yet).
    map: Vec<usize>,
    shared: Arc<ForemanShared>,
    settings: ShellSettings,
    policy: Foreman,
    workers: Vec<Handle>,
    by_node: BTreeMap<String, usize>,
    t0: Instant,
    outputs: Vec<Vec<Option<Held>>>,
    outcome: JobOutcome,
    last_error: BTreeMap<TaskId, String>,
    progress: Option<mpsc::UnboundedSender<Progress>>,
    done: bool,
    failed: Option<TaskId>,
    services: Services,
    actors: Actors,
    ctx: ExecCtx,
    /// Lost workers, put back in service when their worker service is announced again.
    rejoining: std::collections::BTreeSet<String>,
    /// Rejoins whose join call is in flight.
    joining: std::collections::BTreeSet<String>,
    /// Since when every worker has been lost (the job fails if none is back within the join
    /// timeout: a stall that made members look down must not end a job).
    all_lost_since: Option<Instant>,
}

/// A dead or finished incarnation's links end (unless a newer incarnation replaced them): the
/// calls still queued on them were decided by a policy that no longer exists.
impl Drop for Shell {
    fn drop(&mut self) {
        for (i, h) in self.workers.iter().enumerate() {
            self.shared.links.detach_generation(&i, h.generation);
        }
    }
}

impl Shell {
    /// Records a line a person reads (moves, failures, the job's end): logged at INFO.
    fn log(&mut self, line: String) {
        let stamped = format!("[{:8.3} s] {line}", self.t0.elapsed().as_secs_f64());
        info!("{stamped}");
        self.outcome.log.push(stamped);
    }

    /// Records a routine dispatch step (send, load, assign): kept in the outcome's log, logged
    /// at DEBUG only, so a run of thousands of tasks does not flood the console.
    fn trace(&mut self, line: String) {
        let stamped = format!("[{:8.3} s] {line}", self.t0.elapsed().as_secs_f64());
        debug!("{stamped}");
        self.outcome.log.push(stamped);
    }

    fn node_of(&self, w: WorkerId) -> String {
        self.workers.get(w.0 as usize).map_or_else(|| w.to_string(), |h| h.node.clone())
    }

    /// Queues `cmd` on the worker's link (nothing when the worker is lost).
    fn send(&mut self, w: WorkerId, cmd: Cmd) {
        let worker = w.0 as usize;
        let Some(h) = self.workers.get(worker).filter(|h| !h.summary.lost) else { return };
        let _ = self.shared.links.submit(&worker, step(self.ctx.clone(), worker, h.node.clone(), cmd));
    }

    fn drain(&mut self) {
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
            self.perform(action);
        }
    }

    fn perform(&mut self, action: Action) {
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
                Err(e) => self.fail_task(worker, task, e),
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

    fn fail_task(&mut self, worker: WorkerId, task: TaskId, detail: String) {
        self.log(format!("cannot start {task}: {detail}"));
        self.last_error.insert(task, detail);
        self.policy.handle_task_done(micros_since(self.t0), worker, task, false);
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

    fn lose(&mut self, worker: usize, why: &str) {
        let Some(h) = self.workers.get_mut(worker) else { return };
        if h.summary.lost {
            return;
        }
        h.summary.lost = true;
        self.shared.links.detach_generation(&worker, h.generation);
        let node = h.node.clone();
        self.rejoining.insert(node.clone());
        self.log(format!("worker {node} lost ({why}); re-planning its tasks"));
        if let Some(p) = &self.progress {
            let _ = p.send(Progress::Lost { node });
        }
        self.policy.handle_worker_lost(micros_since(self.t0), WorkerId(worker as u32));
        self.outputs_lost_with(worker);
        self.drain();
        // its node may already be back (a fast restart is noticed only when a call fails)
        self.try_rejoin();
    }

    /// Activations kept on lost worker `worker` and not read yet by the next stage are gone: per
    /// input, the earliest stage whose outputs must be made again (walking back over stages
    /// whose outputs were on that worker too) is run again, as the policy is told.
    fn outputs_lost_with(&mut self, worker: usize) {
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
            self.policy.handle_outputs_lost(micros_since(self.t0), task);
        }
    }

    /// Joins again every rejoining worker whose actor is announced (the answer arrives as an
    /// [`EventKind::Rejoined`] event). The join is a direct typed call, not through the links:
    /// the worker has none until it is back, and the call goes to whichever incarnation the
    /// name resolves to now.
    fn try_rejoin(&mut self) {
        let directory = self.services.directory();
        let ready: Vec<(String, String)> = self
            .rejoining
            .iter()
            .filter(|node| !self.joining.contains(*node))
            .filter_map(|node| {
                let name = worker_name(node);
                let service = service_name(&name);
                let (_, names) = directory.iter().find(|(p, _)| p.as_str() == node)?;
                names.contains(&service).then(|| (node.clone(), name))
            })
            .collect();
        for (node, name) in ready {
            let Some(&worker) = self.by_node.get(&node) else { continue };
            self.joining.insert(node.clone());
            // short: the directory may still name the dead incarnation's connection; a failed
            // try is retried at once, and then reaches the new one
            let handle = WorkerHandle::by_name(&self.actors, &name);
            let (events, timeout, t0) =
                (self.ctx.events.clone(), REJOIN_TIMEOUT.min(self.settings.rpc_timeout), self.t0);
            tokio::spawn(async move {
                let start = t0.elapsed().as_secs_f64();
                let kind = match handle.call(Join, timeout).await {
                    Ok(report) => EventKind::Rejoined { handle, report: Box::new(report) },
                    Err(e) => {
                        warn!(%node, error = %e, "rejoining worker did not join (retried when it is announced again)");
                        EventKind::RejoinFailed
                    }
                };
                let end = t0.elapsed().as_secs_f64();
                let _ = events.send(Event { worker, generation: 0, start, end, kind });
            });
        }
    }

    /// Puts a lost worker back in service under its old id, on a new link (a new generation).
    fn rejoin(&mut self, worker: usize, handle: WorkerHandle, report: Joined) {
        let Joined { node, pid, cached, live, straggler, telemetry } = report;
        let Some(h) = self.workers.get_mut(worker) else { return };
        if !h.summary.lost {
            return;
        }
        let rtt_ms = self.link.rtt(&NodeId::new(&node)).map_or(0.0, |d| d.as_secs_f64() * 1e3);
        h.generation = self.shared.links.attach(worker, handle.clone());
        h.probe = WorkerHandle::by_name(&self.actors, handle.name());
        h.actor = handle;
        h.summary.lost = false;
        h.summary.rejoined += 1;
        self.all_lost_since = None;
        h.summary.tasks_since_rejoin = 0;
        h.summary.pid = pid;
        h.summary.straggler = straggler;
        h.pulled.iter_mut().for_each(|p| *p = false);
        let report = WorkerReport { telemetry: policy_telemetry(&telemetry, rtt_ms), live, cached };
        self.log(format!("worker {node} rejoined (pid {pid}); back in service"));
        if let Some(p) = &self.progress {
            let _ = p.send(Progress::Rejoined { node: node.clone() });
        }
        if let Err(e) =
            self.policy.handle_worker_joined(micros_since(self.t0), WorkerId(worker as u32), report)
        {
            self.log(format!("worker {node} could not rejoin: {e}"));
        }
        self.drain();
    }

    fn on_event(&mut self, ev: Event) {
        let w = WorkerId(ev.worker as u32);
        let now = micros_since(self.t0);
        match ev.kind {
            EventKind::Rejoined { handle, report } => {
                if let Some(h) = self.workers.get(ev.worker) {
                    let node = h.node.clone();
                    self.joining.remove(&node);
                    self.rejoining.remove(&node);
                }
                self.rejoin(ev.worker, handle, *report);
                return;
            }
            EventKind::RejoinFailed => {
                if let Some(h) = self.workers.get(ev.worker) {
                    let node = h.node.clone();
                    self.joining.remove(&node);
                }
                self.try_rejoin();
                return;
            }
            _ => {}
        }
        // about a lost worker, or about a generation of its link since replaced (a call to a
        // restarted worker's dead process that timed out after the new one rejoined): the
        // links' one generation rule
        if self
            .workers
            .get(ev.worker)
            .is_none_or(|h| h.summary.lost || !self.shared.links.is_current(&ev.worker, ev.generation))
        {
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
                Ok(()) => {
                    let cold = self.workers[ev.worker].pulled.get(stage).copied().unwrap_or(false);
                    self.outcome.spans.push(Span {
                        worker: ev.worker,
                        kind: SpanKind::Load { stage, cold },
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
                self.lose(ev.worker, &why);
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
            EventKind::Telemetry(t) if t.pid != 0 && t.pid != self.workers[ev.worker].summary.pid => {
                // a new incarnation answered: the node was restarted before membership declared
                // it down, and the calls out to the old process will never be answered, so they
                // are given up now (not after the call timeout) and the new one is joined
                let old = self.workers[ev.worker].summary.pid;
                self.lose(
                    ev.worker,
                    &format!("restarted: pid {} answered, the worker that joined was pid {old}", t.pid),
                );
                return;
            }
            EventKind::Telemetry(t) => {
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
        self.drain();
    }
}

/// Fault-switch site hit once per foreman input.
pub const FAULT_SITE: &str = "pipeline.scheduler";

/// What the foreman scheduler is told.
enum ForemanInput {
    /// An executor's answer, telemetry or a rejoin.
    Event(Event),
    /// Membership says this node is down.
    Down(String),
    /// A member came up or announced services: lost workers may be back.
    Announced,
}

/// What every foreman incarnation of one job shares: the job, the workers found, the answers
/// given so far (each input's last-stage outputs, answered at most once) and where the result
/// goes. A restarted incarnation submits only the inputs not answered yet.
struct ForemanShared {
    link: QuicNode,
    services: Services,
    actors: Actors,
    /// One ordered call queue per worker, across foreman incarnations.
    links: WorkerLinks,
    shelf: BlobShelf,
    job: Arc<PipelineJob>,
    settings: ShellSettings,
    progress: Option<mpsc::UnboundedSender<Progress>>,
    targets: Vec<Target>,
    t0: Instant,
    ledger: std::sync::Mutex<Ledger>,
    finished: std::sync::Mutex<Option<tokio::sync::oneshot::Sender<Result<JobOutcome, ShellError>>>>,
    scheduler: std::sync::Mutex<Option<ActorRef<SchedulerMsg<ForemanInput>>>>,
    incarnations: std::sync::atomic::AtomicUsize,
}

impl ForemanShared {
    /// Records an answer (journaled first when the job has a journal); a journal that cannot
    /// take it ends the job with the reason, since an answer that is not durable must not count.
    fn answer(&self, input: usize, outputs: &[NamedTensor]) {
        let result =
            self.ledger.lock().unwrap_or_else(std::sync::PoisonError::into_inner).answer(input, outputs);
        match result {
            Ok(true) => crate::work::PIPELINE.done(),
            Ok(false) => warn!(input, "input already answered; the second answer is dropped"),
            Err(e) => self.finish(Err(ShellError::Journal(e.to_string()))),
        }
    }

    /// Each input's answer so far.
    fn answers(&self) -> Vec<Option<Vec<NamedTensor>>> {
        self.ledger.lock().unwrap_or_else(std::sync::PoisonError::into_inner).answers().to_vec()
    }

    fn finish(&self, result: Result<JobOutcome, ShellError>) {
        if let Some(tx) = self.finished.lock().ok().and_then(|mut f| f.take()) {
            let _ = tx.send(result);
        }
    }

    fn tell(&self, input: ForemanInput) {
        let scheduler = self.scheduler.lock().ok().and_then(|s| s.clone());
        if let Some(s) = scheduler {
            let _ = SchedulerMsg::tell(&s, input);
        }
    }
}

/// The pipeline workload half of the scheduler shell: one incarnation's [`Shell`].
struct ForemanScheduler {
    shared: Arc<ForemanShared>,
    live: Option<Shell>,
    next_tick: Micros,
}

impl ForemanScheduler {
    /// Reports the end of the job once the policy says so (stats gathered from each worker).
    async fn finish_if_over(&mut self) {
        let Some(shell) = self.live.as_mut() else { return };
        let over = if let Some(task) = shell.failed {
            let detail = shell.last_error.get(&task).cloned().unwrap_or_default();
            Some(Err(ShellError::Failed { task: task.to_string(), detail }))
        } else if shell.workers.iter().all(|h| h.summary.lost) {
            let wait = shell.settings.join_timeout;
            match shell.all_lost_since {
                None => {
                    shell.all_lost_since = Some(Instant::now());
                    shell.log(format!("every worker is lost; waiting up to {wait:?} for one to come back"));
                    None
                }
                Some(since) if since.elapsed() >= wait => Some(Err(ShellError::NoWorkers)),
                Some(_) => None,
            }
        } else if shell.done {
            Some(Ok(()))
        } else {
            None
        };
        let Some(over) = over else { return };
        let Some(mut shell) = self.live.take() else { return };
        let result = match over {
            Err(e) => Err(e),
            Ok(()) => {
                shell.outcome.makespan_s = shell.t0.elapsed().as_secs_f64();
                shell.outcome.learned_costs = shell.policy.learned_costs();
                shell.outcome.stage_plan =
                    shell.policy.stage_plan().into_iter().map(|(w, k)| (w.0 as usize, k)).collect();
                shell.log(format!("job done in {:.3} s", shell.outcome.makespan_s));
                for i in 0..shell.workers.len() {
                    if shell.workers[i].summary.lost {
                        continue;
                    }
                    // a direct typed call, awaited here (the job is over: nothing else is queued);
                    // a failed call (e.g. a connection re-forming) is retried a few times
                    let actor = shell.workers[i].actor.clone();
                    for _ in 0..3 {
                        if let Ok(st) = actor.call(GetStats, shell.settings.rpc_timeout).await {
                            shell.workers[i].summary.stats = Some(st);
                            break;
                        }
                    }
                }
                let mut outcome = std::mem::take(&mut shell.outcome);
                let answered = self.shared.answers();
                outcome.outputs = answered.into_iter().map(Option::unwrap_or_default).collect();
                outcome.workers = shell.workers.iter().map(|h| h.summary.clone()).collect();
                Ok(outcome)
            }
        };
        self.shared.finish(result);
    }
}

impl crate::kinds::scheduler::Scheduler for ForemanScheduler {
    type Input = ForemanInput;

    async fn recover(
        &mut self,
        me: &ActorRef<SchedulerMsg<ForemanInput>>,
        now: Micros,
    ) -> Result<(), ractor::ActorProcessingErr> {
        let shared = self.shared.clone();
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
        let job = shared.job.clone();
        let settings = shared.settings.clone();
        let ctx = ExecCtx {
            link: shared.link.clone(),
            shelf: shared.shelf.clone(),
            foreman: shared.link.local_id().as_str().to_owned(),
            lossy_bf16: job.lossy_bf16,
            crowd: Arc::new(shared.targets.iter().map(|(peer, _)| peer.clone()).collect()),
            timeout: settings.rpc_timeout,
            t0: shared.t0,
            events: events_tx,
        };
        let mut policy = Foreman::new(settings.policy);
        if let Some(c) = settings.prior_costs.clone() {
            policy.remember_costs(c);
        }
        let mut workers = Vec::new();
        let mut by_node = BTreeMap::new();
        // a restarted incarnation starts from empty workers, as its fresh policy believes
        let unload = settings.fresh_start || incarnation > 0;
        // each worker's link is attached again (this incarnation's generation) and joined as its
        // first step: a call of a dead incarnation still in flight to the same worker finishes
        // first, and what that incarnation had queued is dropped
        let mut joins = Vec::new();
        for (idx, (peer, name)) in shared.targets.iter().enumerate() {
            let linked = match shared.actors.lookup::<PipelineWorker>(name).await {
                Ok(handle) => {
                    let generation = shared.links.attach(idx, handle.clone());
                    let (tx, rx) = oneshot::channel();
                    let join = join_step(unload, settings.rpc_timeout, shared.t0, tx);
                    shared.links.submit(&idx, join).ok().map(|_| (handle, generation, rx))
                }
                Err(e) => {
                    warn!(worker = %name, error = %e, "worker not found; skipped");
                    None
                }
            };
            joins.push((peer.clone(), name.clone(), linked));
        }
        for (idx, (peer, name, linked)) in joins.into_iter().enumerate() {
            let (actor, generation, joined) = match linked {
                Some((handle, generation, rx)) => {
                    let joined = rx.await.ok().flatten();
                    if joined.is_none() {
                        shared.links.detach_generation(&idx, generation);
                    }
                    (handle, generation, joined)
                }
                None => (WorkerHandle::by_name(&shared.actors, &name), 0, None),
            };
            let (node, summary) = match joined {
                Some(Joined { node, pid, cached, live, straggler, telemetry }) => {
                    let rtt_ms = shared.link.rtt(&NodeId::new(&node)).map_or(0.0, |d| d.as_secs_f64() * 1e3);
                    let live_none = live.is_none();
                    let report =
                        WorkerReport { telemetry: policy_telemetry(&telemetry, rtt_ms), live, cached };
                    policy
                        .handle_worker_joined(micros_since(shared.t0), WorkerId(idx as u32), report)
                        .map_err(|e| ShellError::Refused(e.to_string()).to_string())?;
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
                probe: WorkerHandle::by_name(&shared.actors, &name),
                actor,
                generation,
                summary,
                pulled: vec![false; job.stages.len()],
            });
        }
        let joined = workers.iter().filter(|h| !h.summary.lost).count();
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
            t0: shared.t0,
            outputs: vec![vec![None; s]; n],
            outcome: JobOutcome::default(),
            last_error: BTreeMap::new(),
            progress: shared.progress.clone(),
            done: n == 0,
            failed: None,
            services: shared.services.clone(),
            actors: shared.actors.clone(),
            ctx,
            rejoining: std::collections::BTreeSet::new(),
            joining: std::collections::BTreeSet::new(),
            all_lost_since: None,
        };
        for h in shell.workers.iter().filter(|h| h.summary.lost) {
            shell.rejoining.insert(h.node.clone());
        }
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
                .submit_job(micros_since(shared.t0), policy_job)
                .map_err(|e| ShellError::Refused(e.to_string()).to_string())?;
            shell.drain();
        }
        self.live = Some(shell);
        self.next_tick = now + Micros::from_duration(shared.settings.telemetry_period);
        self.finish_if_over().await;
        Ok(())
    }

    async fn handle(
        &mut self,
        _me: &ActorRef<SchedulerMsg<ForemanInput>>,
        _now: Micros,
        input: ForemanInput,
    ) -> Result<(), ractor::ActorProcessingErr> {
        let Some(shell) = self.live.as_mut() else { return Ok(()) };
        match input {
            ForemanInput::Event(ev) => shell.on_event(ev),
            ForemanInput::Down(node) => {
                if let Some(&w) = shell.by_node.get(&node) {
                    shell.lose(w, "membership: member down");
                }
            }
            ForemanInput::Announced => shell.try_rejoin(),
        }
        self.finish_if_over().await;
        Ok(())
    }

    async fn handle_timeout(
        &mut self,
        _me: &ActorRef<SchedulerMsg<ForemanInput>>,
        now: Micros,
    ) -> Result<(), ractor::ActorProcessingErr> {
        self.next_tick = now + Micros::from_duration(self.shared.settings.telemetry_period);
        let Some(shell) = self.live.as_ref() else { return Ok(()) };
        let (t0, timeout) = (shell.t0, shell.settings.rpc_timeout);
        for (i, h) in shell.workers.iter().enumerate().filter(|(_, h)| !h.summary.lost) {
            // a direct typed call, not queued on the link: telemetry must not wait behind a
            // task, and a restarted worker answers it with its new pid
            let (probe, tx, generation) = (h.probe.clone(), shell.ctx.events.clone(), h.generation);
            tokio::spawn(async move {
                let start = t0.elapsed().as_secs_f64();
                if let Ok(t) = probe.call(GetTelemetry, timeout).await {
                    let end = t0.elapsed().as_secs_f64();
                    let kind = EventKind::Telemetry(t);
                    let _ = tx.send(Event { worker: i, generation, start, end, kind });
                }
            });
        }
        // a job waiting for a lost crowd to come back gives up here once the wait is over
        self.finish_if_over().await;
        Ok(())
    }

    fn poll_timeout(&self) -> Option<Micros> {
        self.live.as_ref().map(|_| self.next_tick)
    }
}

/// Distinguishes the registered names of foreman actors of concurrent jobs in one process.
static FOREMAN_JOBS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Runs one job over the workers of the cluster and returns its outputs and metrics.
///
/// The foreman runs as a [`crate::SchedulerActor`] under a supervisor of its own (restart
/// intensity: 3 in 60 s); what it has answered lives outside it, so a panic (for instance
/// through the fault switch, site [`FAULT_SITE`]) restarts it and the new incarnation
/// resubmits only the unanswered inputs. `actors` (the typed-actor registry, through which the
/// workers are reached) and `membership` are the foreman node's; `shelf` must be installed as
/// its blob server.
pub async fn run_pipeline_job(
    actors: &Actors,
    shelf: &BlobShelf,
    mut membership: broadcast::Receiver<MembershipEvent<NodeId>>,
    job: impl Into<AcceptedJob>,
    settings: ShellSettings,
    progress: Option<mpsc::UnboundedSender<Progress>>,
) -> Result<JobOutcome, ShellError> {
    let AcceptedJob { job, ledger } = job.into();
    let (link, services) = (actors.link(), actors.services());
    let targets = discover(services, &settings).await?;
    for s in &job.stages {
        shelf.pin(s.bytes.clone());
    }
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    // the links' outcomes, tagged with worker and generation, go to the live incarnation
    let (steps_tx, mut steps) = mpsc::unbounded_channel::<Event>();
    let links: WorkerLinks = Links::new(Arc::new(move |worker, generation, outcome| {
        let ev = match outcome {
            Outcome::Done(Step { start, end, kind }) => Event { worker, generation, start, end, kind },
            Outcome::Failed(e) | Outcome::Lost(e) => {
                Event { worker, generation, start: 0.0, end: 0.0, kind: EventKind::Lost(e.to_string()) }
            }
        };
        let _ = steps_tx.send(ev);
    }));
    let shared = Arc::new(ForemanShared {
        link: link.clone(),
        services: services.clone(),
        actors: actors.clone(),
        links,
        shelf: shelf.clone(),
        job: Arc::new(job),
        settings,
        progress,
        targets,
        t0: Instant::now(),
        ledger: std::sync::Mutex::new(ledger),
        finished: std::sync::Mutex::new(Some(done_tx)),
        scheduler: std::sync::Mutex::new(None),
        incarnations: std::sync::atomic::AtomicUsize::new(0),
    });
    let name = format!("pipeline-foreman-{}", FOREMAN_JOBS.fetch_add(1, Ordering::Relaxed));
    let spec = {
        let shared = shared.clone();
        ChildSpec::new(name.clone(), move || {
            (
                SchedulerActor::<ForemanScheduler>::default(),
                SchedulerArgs {
                    scheduler: ForemanScheduler { shared: shared.clone(), live: None, next_tick: Micros(0) },
                    fault_site: FAULT_SITE.into(),
                },
            )
        })
    };
    let (sup_events, mut failures) = broadcast::channel(16);
    let args = SupervisorArgs {
        name: format!("{name}-supervisor"),
        children: vec![spec],
        intensity: Intensity { max_restarts: 3, period: Duration::from_secs(60) },
        events: sup_events,
    };
    let (sup, sup_handle) = ractor::Actor::spawn(None, Supervisor, args)
        .await
        .map_err(|e| ShellError::Refused(format!("starting the foreman: {e}")))?;
    let mut announcements = services.subscribe_announcements();
    let forwarder = {
        let shared = shared.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    m = membership.recv() => match m {
                        Ok(MembershipEvent::Down { member, .. }) => shared.tell(ForemanInput::Down(member.as_str().to_owned())),
                        Ok(MembershipEvent::Up { .. }) => shared.tell(ForemanInput::Announced),
                        Err(broadcast::error::RecvError::Lagged(_)) => {}
                        Err(broadcast::error::RecvError::Closed) => return,
                    },
                    a = announcements.recv() => match a {
                        Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => shared.tell(ForemanInput::Announced),
                        Err(broadcast::error::RecvError::Closed) => return,
                    },
                    ev = steps.recv() => match ev {
                        Some(ev) => shared.tell(ForemanInput::Event(ev)),
                        None => return,
                    },
                }
            }
        })
    };
    let mut done_rx = done_rx;
    let result = loop {
        tokio::select! {
            r = &mut done_rx => break r.unwrap_or(Err(ShellError::Refused("the foreman stopped".into()))),
            ev = failures.recv() => match ev {
                Ok(SupervisorEvent::Escalated { reason, .. }) => {
                    break Err(ShellError::Refused(format!("the foreman failed past its restart intensity: {reason}")));
                }
                Ok(SupervisorEvent::Restarted { reason, .. }) => warn!(%reason, "pipeline foreman restarted"),
                Err(broadcast::error::RecvError::Lagged(_)) => {}
                Err(broadcast::error::RecvError::Closed) => {
                    break Err(ShellError::Refused("the foreman's supervisor stopped".into()));
                }
            },
        }
    };
    forwarder.abort();
    sup.stop(None);
    let _ = sup_handle.await;
    // every link ends with the job (its queue task with it)
    for i in 0..shared.targets.len() {
        shared.links.detach(&i);
    }
    let journal = shared.ledger.lock().unwrap_or_else(std::sync::PoisonError::into_inner).finish();
    result.map(|outcome| JobOutcome { journal, ..outcome })
}

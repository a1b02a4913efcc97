//! The calls the foreman makes on its workers, off the actor: each policy action becomes one
//! queued step on the worker's link ([`step`]), timed on the job's clock, whose outcome comes
//! back to the foreman as an [`Event`]. A run relays its inputs through the foreman when the
//! worker cannot pull them from the worker that made them ([`relay`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tracing::warn;
use troupe_kernels::onnx::NamedTensor;
use troupe_policy::pipeline::coding::compress_activations;
use troupe_policy::pipeline::{TaskId, Telemetry};
use troupe_transport::codec::DecodeBudget;
use troupe_transport::{NodeId, NodeLink};

use super::super::wire::{
    BlobShelf, Fetch, Join, Joined, Load, MAX_MESSAGE_DECODED_BYTES, Moved, Ran, Run, RunReply, RunTimes,
    TelemetrySample, TensorBody, Unload, WireNamed, decode_tensors_from,
};
use super::super::worker::PipelineWorker;
use crate::clock::Clock;
use crate::typed::{ActorError, ActorHandle, Handles, Links, RemoteMessage};

/// A worker as the foreman reaches it: a typed handle to its actor.
pub(super) type WorkerHandle = ActorHandle<PipelineWorker>;

/// The foreman's per-worker call queues (key: worker index), shared by every foreman
/// incarnation of the job: one ordered queue per worker, one generation rule.
pub(super) type WorkerLinks = Links<usize, ActorHandle<PipelineWorker>, Step>;

/// What one queued call produced, and when it ran (seconds from job start).
pub(super) struct Step {
    pub(super) start: f64,
    pub(super) end: f64,
    pub(super) kind: EventKind,
}

pub(super) type StepFuture = Pin<Box<dyn Future<Output = Result<Step, ActorError>> + Send>>;

/// A call's error as the foreman reads it: a refusal or failure the worker answered with (a
/// problem with the request, as text), or the worker lost (gone, or silent past the timeout):
/// the error that ends its link.
pub(super) fn refusal(actor: &str, e: ActorError) -> Result<String, ActorError> {
    match e {
        ActorError::Failed { detail, .. } => Ok(detail),
        e @ (ActorError::Forbidden { .. } | ActorError::BadMessage { .. }) => Ok(e.to_string()),
        e @ ActorError::PeerLost { .. } => Err(e),
        e => Err(ActorError::PeerLost { actor: actor.to_owned(), reason: e.to_string() }),
    }
}

/// Calls the worker: its reply, or its refusal as text; `Err` when the worker is lost.
pub(super) async fn ask<M>(
    h: &WorkerHandle,
    msg: M,
    timeout: Duration,
) -> Result<Result<M::Reply, String>, ActorError>
where
    M: RemoteMessage,
    PipelineWorker: Handles<M>,
{
    match h.call(msg, timeout).await {
        Ok(r) => Ok(Ok(r)),
        Err(e) => refusal(h.name(), e).map(Err),
    }
}

pub(super) enum Cmd {
    Fetch { stage: usize, sha256: String, blob: [u8; 32], size: u64 },
    Load { stage: usize, sha256: String },
    Unload,
    Run { task: TaskId, tensors: Vec<WireNamed>, keep_outputs: bool },
}

/// A task's outputs as the foreman holds them.
#[derive(Clone)]
pub(super) enum Held {
    /// Here, decoded (a last stage's answer, or outputs a worker sent inline).
    Here(Vec<NamedTensor>),
    /// On worker `worker`'s blob shelf: references ([`TensorBody::At`]) the next stage's worker
    /// pulls from there.
    At { worker: usize, refs: Vec<WireNamed> },
}

pub(super) struct TaskRan {
    pub(super) outputs: Held,
    pub(super) compute_micros: u64,
    pub(super) raw: u64,
    pub(super) wire: u64,
    pub(super) max_abs_error: f32,
    pub(super) times: RunTimes,
    /// The call (request out, answer back and read), seconds.
    pub(super) call_s: f64,
    /// f32 payload bytes of activations that came to the foreman in the answer.
    pub(super) activation_bytes_in: u64,
    /// f32 payload bytes of final outputs that came to the foreman (inline or pulled).
    pub(super) output_bytes_in: u64,
}

pub(super) enum EventKind {
    Fetched {
        stage: usize,
        result: Result<bool, String>,
    },
    Loaded {
        stage: usize,
        /// The load's CPU on the worker, µs.
        result: Result<u64, String>,
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

pub(super) struct Event {
    pub(super) worker: usize,
    /// The generation of the worker's link the event is about (for telemetry, the one current
    /// when the poll started): events of a generation since replaced or ended are stale.
    pub(super) generation: u64,
    pub(super) start: f64,
    pub(super) end: f64,
    pub(super) kind: EventKind,
}

/// Context a worker's queued calls need.
#[derive(Clone)]
pub(super) struct ExecCtx {
    pub(super) link: NodeLink,
    /// The foreman's blob shelf (inputs it relays when workers cannot reach each other).
    pub(super) shelf: BlobShelf,
    pub(super) foreman: String,
    pub(super) lossy_bf16: bool,
    /// The crowd's nodes (whether their links are same-host decides activation compression).
    pub(super) crowd: Arc<Vec<NodeId>>,
    pub(super) timeout: Duration,
    /// The job's clock (the scheduler shell's too): span times are read from it.
    pub(super) clock: Clock,
    /// Telemetry and rejoin answers (calls made outside the links).
    pub(super) events: mpsc::UnboundedSender<Event>,
}

/// The call `cmd` makes on worker `worker`'s link, timed, as one queued step.
pub(super) fn step(
    ctx: ExecCtx,
    worker: usize,
    node: String,
    cmd: Cmd,
) -> impl FnOnce(WorkerHandle) -> StepFuture + Send {
    move |h| {
        Box::pin(async move {
            let start = ctx.clock.now().as_secs_f64();
            let timeout = ctx.timeout;
            let kind = match cmd {
                Cmd::Fetch { stage, sha256, blob, size } => {
                    let msg = Fetch { stage: stage as u32, sha256, blob, size, from: ctx.foreman.clone() };
                    EventKind::Fetched { stage, result: ask(&h, msg, timeout).await?.map(|f| f.cached) }
                }
                Cmd::Load { stage, sha256 } => {
                    let msg = Load { stage: stage as u32, sha256 };
                    EventKind::Loaded { stage, result: ask(&h, msg, timeout).await?.map(|l| l.cpu_micros) }
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
            Ok(Step { start, end: ctx.clock.now().as_secs_f64(), kind })
        })
    }
}

/// Unloads (when asked) and joins a worker as the first step of its link; the answer goes to
/// `joined` (`None`: it did not join).
pub(super) fn join_step(
    unload: bool,
    timeout: Duration,
    clock: Clock,
    joined: oneshot::Sender<Option<Joined>>,
) -> impl FnOnce(WorkerHandle) -> StepFuture + Send {
    move |h| {
        Box::pin(async move {
            let start = clock.now().as_secs_f64();
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
            let step = |kind| Step { start, end: clock.now().as_secs_f64(), kind };
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
pub(super) async fn run_task(
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
    let called = ctx.clock.now();
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
    let call_s = (ctx.clock.now() - called).as_secs_f64();
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
pub(super) async fn relay(ctx: &ExecCtx, mut req: Run) -> Result<(Run, u64), String> {
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
pub(super) async fn ran_outputs(
    ctx: &ExecCtx,
    worker: usize,
    node: &str,
    tensors: Vec<WireNamed>,
    keep_outputs: bool,
) -> Result<(Held, u64, u64), super::super::wire::WireError> {
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

pub(super) fn policy_telemetry(t: &TelemetrySample, rtt_ms: f64) -> Telemetry {
    Telemetry {
        cpu_load: t.cpu_load,
        free_ram_bytes: t.free_ram_bytes,
        ram_budget_bytes: t.ram_budget_bytes,
        battery_pct: t.battery_pct,
        temperature_c: t.temperature_c,
        rtt_ms,
    }
}

//! The edge actor: receives uploads from cameras (role-checked service calls on the data plane:
//! `adapt` and `report` for the `camera` role only), labels them with the teacher, runs the
//! [`EdgeEngine`] cycle by cycle on a blocking thread (the mailbox keeps taking uploads between
//! cycles, so late arrivals join the co-adaptation), replies to each camera with its adapted
//! parameters, and collects the cameras' final reports for the job.

use std::collections::BTreeMap;
use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use ractor_cluster::RactorMessage;
use rkyv::{Archive, Deserialize, Serialize};
use troupe_kernels::vmoe::train::{Dataset, predict_all};
use troupe_kernels::vmoe::{FragSample, VMoe};
use troupe_policy::adapt::TaskId;
use troupe_transport::Role;

use super::engine::{AdaptJob, EdgeEngine, EngineConfig, Finished};
use super::params::{install_trainable, trainable_params};
use super::wire::{
    AdaptReply, CameraReport, DecodeBudget, EdgeSummary, MAX_DECODED_BYTES, UploadRequest, decode, encode,
};
use super::{EDGE_GROUP, EDGE_SERVICE, digits, student_config, zoo_student, zoo_teacher};
use crate::clock::Clock;
use crate::service::{Allow, Handler, ServiceSpec, Services};

/// Method of [`EDGE_SERVICE`]: an [`UploadRequest`], answered with an [`AdaptOutcome`].
pub const ADAPT: &str = "adapt";
/// Method of [`EDGE_SERVICE`]: a [`CameraReport`], answered with an empty body.
pub const REPORT: &str = "report";

/// Who may call the edge: cameras only.
pub fn spec() -> ServiceSpec {
    ServiceSpec::new().method(ADAPT, Allow::role(Role::Camera)).method(REPORT, Allow::role(Role::Camera))
}

fn handler(actor: ActorRef<EdgeMsg>) -> Handler {
    Arc::new(move |_caller, method, body| {
        let actor = actor.clone();
        Box::pin(async move {
            let gone = |e: String| format!("the edge actor is not running: {e}");
            match method.as_str() {
                ADAPT => ractor::call!(actor, EdgeMsg::Adapt, body).map_err(|e| gone(e.to_string())),
                REPORT => {
                    actor.cast(EdgeMsg::Report(body)).map(|()| Vec::new()).map_err(|e| gone(e.to_string()))
                }
                other => Err(format!("{other:?} is not an edge method")),
            }
        })
    })
}

/// Most camera reports the edge keeps for a job; later ones are refused (logged).
pub const MAX_REPORTS: usize = 1024;
/// Most callers waiting for a summary at once; later ones are refused (their call fails).
pub const MAX_WAITERS: usize = 64;

/// What the edge answers an upload with.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub enum AdaptOutcome {
    /// Adapted.
    Adapted(AdaptReply),
    /// Refused, with the reason.
    Refused(String),
}

/// Messages of the edge actor (local: cameras reach it through its service handler).
#[derive(RactorMessage)]
pub enum EdgeMsg {
    /// An [`UploadRequest`] (rkyv bytes); answered with an [`AdaptOutcome`] when its task completes.
    Adapt(Vec<u8>, RpcReplyPort<Vec<u8>>),
    /// A camera's [`CameraReport`] (rkyv bytes).
    Report(Vec<u8>),
    /// Answers with an [`EdgeSummary`] once this many camera reports arrived.
    WaitSummary(u32, RpcReplyPort<Vec<u8>>),
    /// Runs the next adaptation cycle (sent to itself).
    Cycle,
}

/// Arguments of the edge actor.
#[derive(Clone, Debug)]
pub struct EdgeArgs {
    /// Executor settings (pool budget, scheduler, epochs, target gain).
    pub engine: EngineConfig,
    /// Student sizes the cameras run (their shared parts and step buffers are reserved).
    pub expected: Vec<String>,
    /// The node's service router (the actor serves [`EDGE_SERVICE`] there).
    pub services: Services,
}

struct Pending {
    reply: RpcReplyPort<Vec<u8>>,
    eval_teacher_labels: Vec<u32>,
}

/// The edge actor's state.
pub struct EdgeState {
    engine: Option<EdgeEngine>,
    teacher: Arc<VMoe>,
    train: Arc<Dataset>,
    pending: BTreeMap<TaskId, Pending>,
    reports: Vec<CameraReport>,
    waiters: Vec<(u32, RpcReplyPort<Vec<u8>>)>,
    cycling: bool,
    clock: Clock,
    done: u32,
}

/// The edge actor.
pub struct EdgeActor;

fn labelled(teacher: &VMoe, pixels: &[f32]) -> Result<Dataset, String> {
    let n = pixels.len() / super::wire::PIXELS;
    let mut d = Dataset { images: pixels.to_vec(), labels: vec![0; n] };
    d.labels = predict_all(teacher, &d).map_err(|e| e.to_string())?;
    Ok(d)
}

fn summary(state: &EdgeState) -> EdgeSummary {
    let (budget, peak, frag): (u64, u64, &[FragSample]) = match &state.engine {
        Some(e) => (e.pool().stats().budget, e.pool().peak_used(), e.pool().fragmentation_samples()),
        None => (0, 0, &[]),
    };
    let max_fragmentation = frag.iter().map(|s| s.external_fragmentation).fold(0.0, f64::max);
    let mean_fragmentation = if frag.is_empty() {
        0.0
    } else {
        frag.iter().map(|s| s.external_fragmentation).sum::<f64>() / frag.len() as f64
    };
    let every = (frag.len() / 12).max(1);
    let timeline = frag.iter().step_by(every).map(|s| (s.event, s.used, s.external_fragmentation)).collect();
    EdgeSummary {
        cameras: state.reports.clone(),
        budget,
        peak_used: peak,
        events: frag.len() as u64,
        max_fragmentation,
        mean_fragmentation,
        timeline,
        tasks_done: state.done,
        scheduler: state.engine.as_ref().map_or("", |e| e.scheduler_name()).to_string(),
    }
}

fn answer_waiters(state: &mut EdgeState) {
    let have = state.reports.len() as u32;
    if !state.waiters.iter().any(|(n, _)| *n <= have) {
        return;
    }
    let bytes = encode(&summary(state));
    let (ready, wait): (Vec<_>, Vec<_>) = state.waiters.drain(..).partition(|(n, _)| *n <= have);
    state.waiters = wait;
    for (_, port) in ready {
        let _ = port.send(bytes.clone());
    }
}

fn reply_finished(state: &mut EdgeState, done: Vec<Finished>) {
    for f in done {
        state.done += 1;
        let latency_ms = f.done.saturating_sub(f.arrived).0 / 1000;
        tracing::info!(
            task = f.task.0, camera = %f.name, before = f.before, after = f.after, epochs = f.epochs,
            reached = f.reached, latency_ms, "adaptation task complete"
        );
        let Some(p) = state.pending.remove(&f.task) else { continue };
        let reply = AdaptOutcome::Adapted(AdaptReply {
            task: f.task.0,
            params: trainable_params(&f.model),
            eval_teacher_labels: p.eval_teacher_labels,
            val_before: f.before,
            val_after: f.after,
            epochs: f.epochs,
            reached: f.reached,
            latency_ms,
        });
        let _ = p.reply.send(encode(&reply));
    }
}

impl Actor for EdgeActor {
    type Msg = EdgeMsg;
    type State = EdgeState;
    type Arguments = EdgeArgs;

    async fn pre_start(
        &self,
        me: ActorRef<EdgeMsg>,
        args: EdgeArgs,
    ) -> Result<EdgeState, ActorProcessingErr> {
        let cfg = args.engine;
        let expected: Vec<_> = args.expected.iter().map(|s| student_config(s)).collect::<Result<_, _>>()?;
        let (engine, teacher, train) = tokio::task::spawn_blocking(move || {
            let (train, _) = digits()?;
            let teacher = zoo_teacher(&train)?;
            let engine = EdgeEngine::new(cfg, &expected).map_err(|e| e.to_string())?;
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>((engine, teacher, train))
        })
        .await??;
        ractor::pg::join(EDGE_GROUP.to_string(), vec![me.get_cell()]);
        args.services.register(EDGE_SERVICE, spec(), handler(me.clone()));
        tracing::info!(budget = cfg.budget, scheduler = cfg.scheduler.name(), "coadapt edge ready");
        Ok(EdgeState {
            engine: Some(engine),
            teacher: Arc::new(teacher),
            train: Arc::new(train),
            pending: BTreeMap::new(),
            reports: Vec::new(),
            waiters: Vec::new(),
            cycling: false,
            clock: Clock::start(),
            done: 0,
        })
    }

    async fn handle(
        &self,
        me: ActorRef<EdgeMsg>,
        msg: EdgeMsg,
        state: &mut EdgeState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            EdgeMsg::Adapt(bytes, reply) => {
                let req = match UploadRequest::decode(&bytes, &mut DecodeBudget::new(MAX_DECODED_BYTES)) {
                    Ok(r) => r,
                    Err(e) => {
                        tracing::warn!(error = %e, "refusing an upload");
                        let _ = reply.send(encode(&AdaptOutcome::Refused(e.to_string())));
                        return Ok(());
                    }
                };
                if state.engine.as_ref().is_some_and(EdgeEngine::is_full) {
                    // refused before the teacher labels anything: backpressure to the camera
                    let why = format!(
                        "the edge already holds {} adaptation tasks; try again later",
                        state.pending.len()
                    );
                    tracing::warn!(camera = %req.camera, %why, "refusing an upload");
                    let _ = reply.send(encode(&AdaptOutcome::Refused(why)));
                    return Ok(());
                }
                let Some(mut engine) = state.engine.take() else {
                    let _ = reply.send(encode(&AdaptOutcome::Refused("edge engine is gone".into())));
                    return Ok(());
                };
                let (teacher, train, clock) = (state.teacher.clone(), state.train.clone(), state.clock);
                let (engine, admitted) = tokio::task::spawn_blocking(move || {
                    let r = admit(&mut engine, &teacher, &train, req, clock);
                    (engine, r)
                })
                .await?;
                state.engine = Some(engine);
                match admitted {
                    Ok((task, eval_teacher_labels)) => {
                        state.pending.insert(task, Pending { reply, eval_teacher_labels });
                        if !state.cycling {
                            state.cycling = true;
                            me.cast(EdgeMsg::Cycle)?;
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "refusing an upload");
                        let _ = reply.send(encode(&AdaptOutcome::Refused(e)));
                    }
                }
            }
            EdgeMsg::Cycle => {
                let Some(mut engine) = state.engine.take() else { return Ok(()) };
                let clock = state.clock;
                let (mut engine, result) = tokio::task::spawn_blocking(move || {
                    let r = engine.run_cycle(&|| clock.now());
                    (engine, r)
                })
                .await?;
                let done = engine.take_finished();
                let busy = engine.busy();
                state.engine = Some(engine);
                reply_finished(state, done);
                if let Err(e) = result {
                    // Nothing can make progress (memory refused with nothing to evict): fail the
                    // waiting cameras rather than spin.
                    tracing::error!(error = %e, "adaptation cycle failed");
                    for (_, p) in std::mem::take(&mut state.pending) {
                        let _ = p.reply.send(encode(&AdaptOutcome::Refused(e.to_string())));
                    }
                    state.cycling = false;
                    return Ok(());
                }
                state.cycling = busy;
                if busy {
                    me.cast(EdgeMsg::Cycle)?;
                }
            }
            EdgeMsg::Report(bytes) => match decode::<CameraReport>(
                "camera report",
                &bytes,
                &mut DecodeBudget::new(MAX_DECODED_BYTES),
            ) {
                Ok(r) if state.reports.len() >= MAX_REPORTS => {
                    tracing::warn!(camera = %r.camera, cap = MAX_REPORTS, "refusing a camera report: the edge holds its most");
                }
                Ok(r) => {
                    tracing::info!(camera = %r.camera, before = r.exact_before, after = r.exact_after, "camera report");
                    state.reports.push(r);
                    answer_waiters(state);
                }
                Err(e) => tracing::warn!(error = %e, "ignoring a camera report"),
            },
            EdgeMsg::WaitSummary(n, reply) => {
                if state.waiters.len() >= MAX_WAITERS {
                    // dropping the port fails the caller's call: refused, not queued
                    tracing::warn!(cap = MAX_WAITERS, "refusing a summary request: too many waiting");
                    drop(reply);
                    return Ok(());
                }
                state.waiters.push((n, reply));
                answer_waiters(state);
            }
        }
        Ok(())
    }
}

/// Labels an upload with the teacher, rebuilds the camera's model (the cached student of its size
/// with the camera's trainable parameters) and submits the job. Returns the task and the teacher's
/// labels of the evaluation frames.
fn admit(
    engine: &mut EdgeEngine,
    teacher: &VMoe,
    train: &Dataset,
    req: UploadRequest,
    clock: Clock,
) -> Result<(TaskId, Vec<u32>), String> {
    let mut model = zoo_student(&req.model, train).map_err(|e| e.to_string())?;
    install_trainable(&mut model, &req.params).map_err(|e| format!("camera parameters: {e}"))?;
    let samples = labelled(teacher, &req.train_images)?;
    let eval = labelled(teacher, &req.eval_images)?;
    let task = engine
        .submit(
            clock.now(),
            AdaptJob {
                name: req.camera.clone(),
                model,
                samples,
                target_gain: (req.target_gain > 0.0).then_some(req.target_gain),
            },
        )
        .map_err(|e| e.to_string())?;
    tracing::info!(camera = %req.camera, task = task.0, uploads = req.train_images.len() / 64, "adaptation task admitted");
    Ok((task, eval.labels.iter().map(|&l| l as u32).collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_cameras_may_call_the_edge() {
        let s = spec();
        assert_eq!(s.allow(ADAPT), Some(Allow::role(Role::Camera)));
        assert_eq!(s.allow(REPORT), Some(Allow::role(Role::Camera)));
        assert_eq!(s.allow("summary"), None, "the summary is local to the edge's node");
    }
}

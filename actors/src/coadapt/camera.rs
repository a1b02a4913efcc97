//! The camera actor: streams its drifting camera feed through its V-MoE, notices drift with the
//! [`DriftDetector`], uploads the frames that follow to the edge, installs the experts and
//! projector the edge sends back, and reports exact match (against the teacher's labels, which
//! come back with the update) and accuracy on a held-out evaluation window before and after.
//!
//! The evaluation window is drawn from held-out digits under the same weather at the same frame,
//! so it never overlaps the uploaded images.

use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use troupe_kernels::drift::{CameraStream, DriftSchedule};
use troupe_kernels::vmoe::train::{Dataset, predict_all};
use troupe_kernels::vmoe::{VMoe, exact_match};

use super::detect::{DetectorConfig, DriftDetector, Verdict, mean_top1_confidence};
use super::edge::{ADAPT, AdaptOutcome, REPORT};
use super::params::{install_trainable, trainable_params};
use super::wire::{CameraReport, DecodeBudget, MAX_DECODED_BYTES, UploadRequest, decode, encode};
use super::{EDGE_SERVICE, digits, zoo_student};
use crate::service::Services;
use troupe_transport::NodeId;

/// Frames per inference batch (and per detector observation).
pub const FRAME_BATCH: usize = 64;

/// Arguments of a camera actor.
#[derive(Clone, Debug)]
pub struct CameraArgs {
    /// Camera name (in reports).
    pub name: String,
    /// Student size it runs.
    pub model: String,
    /// Its weather over time.
    pub schedule: DriftSchedule,
    /// Seeds its stream.
    pub seed: u64,
    /// Drift detector settings.
    pub detector: DetectorConfig,
    /// Frames uploaded after drift is noticed.
    pub uploads: usize,
    /// Frames in the held-out evaluation window.
    pub eval: usize,
    /// Frames after which the camera gives up noticing drift.
    pub max_frames: u64,
    /// How long to wait for the edge to appear and to answer.
    pub edge_timeout: Duration,
    /// The objective sent with the upload: exact-match gain to reach (0 = the edge's default).
    pub target_gain: f64,
    /// The node's service router (the edge is called through it).
    pub services: Services,
}

/// Messages of a camera (local only).
pub enum CameraMsg {
    /// Runs the camera's stream (sent to itself on start).
    Run,
}

impl ractor::Message for CameraMsg {}

/// What the stream phase produced.
struct Observed {
    model: VMoe,
    drift_frame: u64,
    uploads: Vec<f32>,
    eval: Dataset,
    before: Vec<usize>,
}

/// The camera actor.
pub struct CameraActor;

/// Streams until drift is noticed; returns the uploads and the evaluation window, or why not.
fn observe(args: &CameraArgs) -> Result<Observed, String> {
    let (train, test) = digits().map_err(|e| e.to_string())?;
    let model = zoo_student(&args.model, &train).map_err(|e| e.to_string())?;
    let cam = (args.seed & 0xffff) as u32;
    let mut stream = CameraStream::new(cam, args.schedule.clone(), &train.images, &train.labels, args.seed)
        .map_err(|e| e.to_string())?;
    let mut detector = DriftDetector::new(args.detector);
    let mut frame = 0u64;
    let drift_frame = loop {
        if frame >= args.max_frames {
            return Err(format!("no drift noticed within {} frames", args.max_frames));
        }
        let frames: Vec<_> = stream.by_ref().take(FRAME_BATCH).collect();
        frame += frames.len() as u64;
        let batch = Dataset::from_frames(&frames);
        let idx: Vec<usize> = (0..batch.len()).collect();
        let (logits, _) =
            model.forward(&batch.batch(&idx).map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
        let conf = mean_top1_confidence(&logits.f32_cow(), model.config.classes);
        match detector.observe(conf) {
            Verdict::Drift { baseline, now } => {
                tracing::info!(camera = %args.name, frame, baseline, now, "drift noticed; uploading samples");
                break frame;
            }
            Verdict::Calibrating | Verdict::Stable => {
                tracing::debug!(camera = %args.name, frame, conf, "stream batch");
            }
        }
    };
    let upload_frames: Vec<_> = stream.by_ref().take(args.uploads).collect();
    let uploads = Dataset::from_frames(&upload_frames).images;
    let mut held =
        CameraStream::new(cam, args.schedule.clone(), &test.images, &test.labels, args.seed ^ 0xe7a1)
            .map_err(|e| e.to_string())?;
    held.seek(drift_frame);
    let eval = Dataset::from_frames(&held.take(args.eval).collect::<Vec<_>>());
    let before = predict_all(&model, &eval).map_err(|e| e.to_string())?;
    Ok(Observed { model, drift_frame, uploads, eval, before })
}

/// Finds a node serving the edge, waiting up to `timeout` (woken by service announcements).
async fn find_edge(services: &Services, timeout: Duration) -> Option<NodeId> {
    services.wait_for(timeout, |s| s.providers(EDGE_SERVICE).into_iter().next()).await
}

fn failed(args: &CameraArgs, drift_frame: u64, error: String) -> CameraReport {
    tracing::error!(camera = %args.name, %error, "camera could not adapt");
    CameraReport {
        camera: args.name.clone(),
        drift_frame,
        exact_before: 0.0,
        exact_after: 0.0,
        accuracy_before: 0.0,
        accuracy_after: 0.0,
        latency_ms: 0,
        error,
    }
}

/// The whole camera run: observe, upload, install, evaluate.
async fn run(args: &CameraArgs) -> CameraReport {
    let a = args.clone();
    let obs = match tokio::task::spawn_blocking(move || observe(&a)).await {
        Ok(Ok(o)) => o,
        Ok(Err(e)) => return failed(args, u64::MAX, e),
        Err(e) => return failed(args, u64::MAX, e.to_string()),
    };
    let Some(edge) = find_edge(&args.services, args.edge_timeout).await else {
        return failed(args, obs.drift_frame, format!("no node announced the {EDGE_SERVICE} service"));
    };
    let req = UploadRequest {
        camera: args.name.clone(),
        model: args.model.clone(),
        params: trainable_params(&obs.model),
        train_images: obs.uploads.clone(),
        eval_images: obs.eval.images.clone(),
        drift_frame: obs.drift_frame,
        target_gain: args.target_gain,
    };
    let bytes = match args.services.call(&edge, EDGE_SERVICE, ADAPT, encode(&req), args.edge_timeout).await {
        Ok(b) => b,
        Err(e) => return failed(args, obs.drift_frame, format!("asking the edge: {e}")),
    };
    let reply = match decode::<AdaptOutcome>("adapt reply", &bytes, &mut DecodeBudget::new(MAX_DECODED_BYTES))
    {
        Ok(AdaptOutcome::Adapted(r)) => r,
        Ok(AdaptOutcome::Refused(why)) => {
            return failed(args, obs.drift_frame, format!("edge refused: {why}"));
        }
        Err(e) => return failed(args, obs.drift_frame, e.to_string()),
    };
    if reply.eval_teacher_labels.len() != obs.eval.len() {
        return failed(
            args,
            obs.drift_frame,
            format!(
                "{} teacher labels for {} evaluation frames",
                reply.eval_teacher_labels.len(),
                obs.eval.len()
            ),
        );
    }
    let teacher: Vec<usize> = reply.eval_teacher_labels.iter().map(|&l| l as usize).collect();
    let mut model = obs.model;
    if let Err(e) = install_trainable(&mut model, &reply.params) {
        return failed(args, obs.drift_frame, format!("installing the update: {e}"));
    }
    let eval = obs.eval;
    let after = match tokio::task::spawn_blocking(move || predict_all(&model, &eval).map(|p| (p, eval))).await
    {
        Ok(Ok(p)) => p,
        Ok(Err(e)) => return failed(args, obs.drift_frame, e.to_string()),
        Err(e) => return failed(args, obs.drift_frame, e.to_string()),
    };
    let (after, eval) = after;
    let r = CameraReport {
        camera: args.name.clone(),
        drift_frame: obs.drift_frame,
        exact_before: exact_match(&obs.before, &teacher),
        exact_after: exact_match(&after, &teacher),
        accuracy_before: exact_match(&obs.before, &eval.labels),
        accuracy_after: exact_match(&after, &eval.labels),
        latency_ms: reply.latency_ms,
        error: String::new(),
    };
    tracing::info!(
        camera = %r.camera, exact_before = r.exact_before, exact_after = r.exact_after,
        accuracy_before = r.accuracy_before, accuracy_after = r.accuracy_after, epochs = reply.epochs,
        "update installed"
    );
    r
}

impl Actor for CameraActor {
    type Msg = CameraMsg;
    type State = CameraArgs;
    type Arguments = CameraArgs;

    async fn pre_start(
        &self,
        me: ActorRef<CameraMsg>,
        args: CameraArgs,
    ) -> Result<CameraArgs, ActorProcessingErr> {
        me.cast(CameraMsg::Run)?;
        Ok(args)
    }

    async fn handle(
        &self,
        _me: ActorRef<CameraMsg>,
        msg: CameraMsg,
        args: &mut CameraArgs,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            CameraMsg::Run => {
                let report = run(args).await;
                match find_edge(&args.services, args.edge_timeout).await {
                    Some(edge) => {
                        let sent = args.services.call(
                            &edge,
                            EDGE_SERVICE,
                            REPORT,
                            encode(&report),
                            args.edge_timeout,
                        );
                        if let Err(e) = sent.await {
                            tracing::error!(camera = %args.name, error = %e, "the report did not reach the edge");
                        }
                    }
                    None => tracing::error!(camera = %args.name, "no edge to report to"),
                }
            }
        }
        Ok(())
    }
}

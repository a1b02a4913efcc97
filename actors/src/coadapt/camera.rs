//! The camera actor: streams its drifting camera feed through its V-MoE for its whole stream
//! (`frames` frames), and for every drift phase the policy's [`OnlineDrift`] notices it uploads
//! the frames that follow to the edge, installs the experts and projector the edge sends back,
//! and records exact match (against the teacher's labels, which come back with the update) and
//! accuracy on a held-out evaluation window before and after. After each update the detector
//! re-arms on the adapted model, so a camera that drifts twice is adapted twice.
//!
//! Accuracy over time: every batch's accuracy (against the feed's true labels) and mean
//! confidence go into a bounded [`SampleLog`]; the camera sends its whole progress (a
//! [`StreamReport`] snapshot) to the edge every `report_every` batches, after each adaptation,
//! and when its stream ends.
//!
//! Frames are the stream's clock: while an adaptation is out the stream waits for it (the
//! edge's latency is reported in milliseconds apart), so runs are reproducible from the seeds.
//! The evaluation window is drawn from held-out digits under the same weather at the drift frame,
//! so it never overlaps the uploaded images.

use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::runtime::Handle;
use troupe_kernels::drift::{CameraStream, DriftSchedule};
use troupe_kernels::vmoe::train::{Dataset, predict_all};
use troupe_kernels::vmoe::{VMoe, exact_match};
use troupe_policy::adapt::online::{
    OnlineConfig, OnlineDrift, OnlineStep, SampleLog, edge_asks_again_after_timeout, edge_retry, input_stats,
};

use super::detect::{DetectorConfig, mean_top1_confidence};
use super::edge::{AdaptOutcome, EdgeActor, Report, Upload};
use super::params::{install_trainable, trainable_params};
use super::sim_compute::{Observed, SimAdaptSpec, SimCamera, SimCameraLog};
use super::wire::{
    AccuracySample, AdaptReply, CameraReport, MAX_SAMPLES, PhaseMark, StreamReport, UploadRequest,
};
use super::{EDGE_ACTOR, digits, zoo_student};
use crate::typed::{ActorError, ActorHandle, Actors, Handles, RemoteMessage};

/// Frames per inference batch (and per detector observation and accuracy sample).
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
    /// Drift detector settings (confidence drop, reference batches, patience).
    pub detector: DetectorConfig,
    /// Input-statistics move that counts as drift (see [`OnlineConfig::shift`]).
    pub shift: f64,
    /// Frames uploaded after drift is noticed.
    pub uploads: usize,
    /// Frames in the held-out evaluation window.
    pub eval: usize,
    /// Frames the stream has in all; the camera reports "ended" after the last.
    pub frames: u64,
    /// Most adaptations this camera asks for.
    pub max_adaptations: u32,
    /// Batches between progress reports to the edge.
    pub report_every: u64,
    /// How long to wait for the edge to appear and to answer.
    pub edge_timeout: Duration,
    /// The objective sent with the upload: exact-match gain to reach (0 = the edge's default).
    pub target_gain: f64,
    /// The node's typed actors (the edge, [`EDGE_ACTOR`], is found and called through them).
    pub actors: Actors,
    /// What the camera computes on: the real student, or the simulation's stand-in.
    pub compute: CameraCompute,
}

/// Messages of a camera (local only).
pub enum CameraMsg {
    /// Runs the camera's stream (sent to itself on start).
    Run,
}

impl ractor::Message for CameraMsg {}

/// The camera actor.
pub struct CameraActor;

/// A handle to the edge, waiting up to `edge_timeout` for it to appear (woken by
/// announcements). When none appeared, a handle that resolves the name on its first call (each
/// call waits up to `edge_timeout` for it), so the camera goes on and says so per call.
async fn find_edge(args: &CameraArgs) -> ActorHandle<EdgeActor> {
    match args.actors.wait_for::<EdgeActor>(EDGE_ACTOR, args.edge_timeout).await {
        Ok(edge) => edge,
        Err(e) => {
            tracing::error!(camera = %args.name, error = %e, "no edge yet");
            ActorHandle::by_name(&args.actors, EDGE_ACTOR)
        }
    }
}

/// Calls the edge with `msg` through the camera's one handle (calls are made one at a time, in
/// order). A call lost with the edge (its node died or restarted before answering, or the
/// handle's incarnation is gone, or no answer, nor the edge's name, came within `edge_timeout`)
/// is made again, as
/// [`troupe_policy::adapt::online::edge_retry`] says, within `edge_timeout` (a call that timed out
/// is asked again at once, as [`edge_asks_again_after_timeout`] says, with that patience whole
/// again: the request or its answer may have been dropped while the edge stayed up): the handle resolves
/// the name again (waiting for a restarted edge), which resumes from its journal and answers the
/// repeat once. The edge's own failure and a refused request are not asked again.
async fn call_edge<M>(args: &CameraArgs, edge: &ActorHandle<EdgeActor>, msg: M) -> Result<M::Reply, String>
where
    M: RemoteMessage + Clone,
    EdgeActor: Handles<M>,
{
    let mut start = crate::clock::Clock::start();
    let (mut attempt, mut timeouts) = (0u32, 0u32);
    loop {
        let lost = match edge.call(msg.clone(), args.edge_timeout).await {
            Ok(reply) => return Ok(reply),
            // a name not heard of within the call timeout is as unanswered as a timed-out call: the
            // edge's announcement may have been lost on the net while it served (coadapt explorer
            // seed 2330: a camera gave its adaptation up with the edge back for seconds)
            Err(e @ (ActorError::Timeout { .. } | ActorError::UnknownActor { within: Some(_), .. })) => {
                if !edge_asks_again_after_timeout(timeouts) {
                    return Err(format!("edge lost: {e}"));
                }
                tracing::warn!(camera = %args.name, message = M::NAME, error = %e, "no answer from the edge in time; asking again");
                timeouts += 1;
                (start, attempt) = (crate::clock::Clock::start(), 0);
                continue;
            }
            Err(e @ ActorError::PeerLost { .. }) => format!("edge lost: {e}"),
            Err(e @ (ActorError::Forbidden { .. } | ActorError::BadMessage { .. })) => {
                return Err(format!("the edge refused the request: {e}"));
            }
            Err(e) => return Err(e.to_string()),
        };
        let Some(wait) = edge_retry(attempt, start.elapsed(), args.edge_timeout) else {
            return Err(lost);
        };
        tracing::warn!(camera = %args.name, message = M::NAME, error = %lost, "the call to the edge was lost; asking again");
        tokio::time::sleep(wait).await;
        attempt = attempt.saturating_add(1);
    }
}

/// Predicted class of each row of `logits` (`rows x classes`).
fn argmax_rows(logits: &[f32], classes: usize) -> Vec<usize> {
    logits
        .chunks_exact(classes.max(1))
        .map(|row| {
            row.iter()
                .enumerate()
                .fold((0, f32::NEG_INFINITY), |b, (i, &v)| if v > b.1 { (i, v) } else { b })
                .0
        })
        .collect()
}

/// What the camera computes on.
#[derive(Clone, Debug, Default)]
pub enum CameraCompute {
    /// The real student (cached model, drifting digits feed, inference on kernels).
    #[default]
    Real,
    /// The deterministic stand-in of a simulated cluster ([`SimCamera`]), recording into `log`.
    Sim {
        /// Modelled costs.
        spec: SimAdaptSpec,
        /// Where the stand-in records uploads, answers and the stream's end.
        log: SimCameraLog,
    },
}

/// The real student and its feed.
struct RealModel<'a> {
    model: VMoe,
    feed: CameraStream<'a>,
    test: &'a Dataset,
}

/// The camera's model: the real student, or the stand-in.
enum Model<'a> {
    Real(Box<RealModel<'a>>),
    Sim(SimCamera),
}

impl Model<'_> {
    /// The next `n` frames through the model.
    fn batch(&mut self, n: usize) -> Result<Observed, String> {
        let m = match self {
            Model::Sim(sim) => return Ok(sim.batch(n)),
            Model::Real(m) => m,
        };
        let frames: Vec<_> = m.feed.by_ref().take(n).collect();
        let batch = Dataset::from_frames(&frames);
        let idx: Vec<usize> = (0..batch.len()).collect();
        let classes = m.model.config.classes;
        let (logits, _) =
            m.model.forward(&batch.batch(&idx).map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
        let logits = logits.f32_cow();
        Ok(Observed {
            confidence: mean_top1_confidence(&logits, classes),
            predicted: argmax_rows(&logits, classes),
            images: batch.images,
            labels: batch.labels,
            cost: Duration::ZERO,
        })
    }

    /// The held-out evaluation window of adaptation `index` noticed at `drift_frame`, the model's
    /// classes for it now, and the time that took when modelled.
    fn window(
        &mut self,
        a: &CameraArgs,
        index: u32,
        drift_frame: u64,
    ) -> Result<(Dataset, Vec<usize>, Duration), String> {
        let m = match self {
            Model::Sim(sim) => return Ok(sim.window(index, drift_frame, a.eval)),
            Model::Real(m) => m,
        };
        let cam = (a.seed & 0xffff) as u32;
        let salt = 0xe7a1 ^ (u64::from(index) << 24);
        let mut held =
            CameraStream::new(cam, a.schedule.clone(), &m.test.images, &m.test.labels, a.seed ^ salt)
                .map_err(|e| e.to_string())?;
        held.seek(drift_frame);
        let eval = Dataset::from_frames(&held.take(a.eval).collect::<Vec<_>>());
        let before = predict_all(&m.model, &eval).map_err(|e| e.to_string())?;
        Ok((eval, before, Duration::ZERO))
    }

    fn params(&self) -> Vec<f32> {
        match self {
            Model::Real(m) => trainable_params(&m.model),
            Model::Sim(sim) => sim.params(),
        }
    }

    /// Installs the edge's answer; the model's classes for `eval` after.
    fn install(
        &mut self,
        c: &Collecting,
        eval: &Dataset,
        reply: &AdaptReply,
    ) -> Result<(Vec<usize>, Duration), String> {
        let m = match self {
            Model::Sim(sim) => return sim.install(c.index, c.drift_frame, eval, reply),
            Model::Real(m) => m,
        };
        let mut model = m.model.clone();
        install_trainable(&mut model, &reply.params).map_err(|e| format!("installing the update: {e}"))?;
        let after = predict_all(&model, eval).map_err(|e| e.to_string())?;
        m.model = model;
        Ok((after, Duration::ZERO))
    }
}

/// Spends a modelled time on tokio's clock (nothing for the real model, which spent its own).
async fn spend(cost: Duration) {
    if !cost.is_zero() {
        tokio::time::sleep(cost).await;
    }
}

/// The camera's whole run: its model, stream position, online policy and what it reports.
struct Run<'a> {
    args: &'a CameraArgs,
    /// The edge, called one call at a time (the stream waits for each).
    edge: ActorHandle<EdgeActor>,
    model: Model<'a>,
    online: OnlineDrift,
    log: SampleLog<(f32, f32)>,
    adaptations: Vec<CameraReport>,
    frame: u64,
}

/// Frames being collected for an upload after drift was noticed.
struct Collecting {
    index: u32,
    drift_frame: u64,
    images: Vec<f32>,
    count: usize,
}

impl<'a> Run<'a> {
    fn new(args: &'a CameraArgs, edge: ActorHandle<EdgeActor>, model: Model<'a>) -> Self {
        let online = OnlineDrift::new(OnlineConfig {
            detector: args.detector,
            shift: args.shift,
            max_adaptations: args.max_adaptations,
        });
        Run { args, edge, model, online, log: SampleLog::new(MAX_SAMPLES), adaptations: Vec::new(), frame: 0 }
    }

    fn report(&self, ended: bool) -> StreamReport {
        StreamReport {
            camera: self.args.name.clone(),
            frame: self.frame,
            frames: self.args.frames,
            ended,
            requested: self.online.requested(),
            phases: self
                .args
                .schedule
                .phases()
                .iter()
                .take(super::wire::MAX_PHASE_MARKS)
                .map(|p| PhaseMark {
                    start_frame: p.start_frame,
                    weather: format!("{} {}", p.corruption.name(), p.severity),
                })
                .collect(),
            samples: self
                .log
                .samples()
                .iter()
                .map(|&(frame, (accuracy, confidence))| AccuracySample { frame, accuracy, confidence })
                .collect(),
            adaptations: self.adaptations.clone(),
            error: String::new(),
        }
    }

    async fn send_report(&self, ended: bool) {
        if let Err(e) = call_edge(self.args, &self.edge, Report(self.report(ended))).await {
            tracing::error!(camera = %self.args.name, error = %e, ended, "the progress report did not reach the edge");
        }
    }

    /// Uploads the collected frames with a fresh held-out window, installs the update; the
    /// adaptation's figures (or why it failed).
    async fn adapt(&mut self, c: Collecting) -> CameraReport {
        let mut r = self.blank_report(&c);
        if let Err(e) = self.try_adapt(c, &mut r).await {
            tracing::error!(camera = %self.args.name, adaptation = r.adaptation, error = %e, "camera could not adapt");
            r.error = e;
        }
        r
    }

    /// The report of adaptation `c` installed now, figures not yet measured.
    fn blank_report(&self, c: &Collecting) -> CameraReport {
        CameraReport {
            camera: self.args.name.clone(),
            adaptation: c.index,
            drift_frame: c.drift_frame,
            installed_frame: self.frame,
            exact_before: 0.0,
            exact_after: 0.0,
            accuracy_before: 0.0,
            accuracy_after: 0.0,
            latency_ms: 0,
            error: String::new(),
        }
    }

    async fn try_adapt(&mut self, mut c: Collecting, r: &mut CameraReport) -> Result<(), String> {
        let a = self.args;
        let (eval, before, cost) = self.model.window(a, c.index, c.drift_frame)?;
        spend(cost).await;
        let req = UploadRequest {
            camera: a.name.clone(),
            model: a.model.clone(),
            params: self.model.params(),
            train_images: std::mem::take(&mut c.images),
            eval_images: eval.images.clone(),
            adaptation: c.index,
            drift_frame: c.drift_frame,
            target_gain: a.target_gain,
        };
        let outcome =
            call_edge(a, &self.edge, Upload(req)).await.map_err(|e| format!("asking the edge: {e}"))?;
        let reply = match outcome {
            AdaptOutcome::Adapted(r) => r,
            AdaptOutcome::Refused(why) => return Err(format!("edge refused: {why}")),
        };
        if reply.eval_teacher_labels.len() != eval.len() {
            return Err(format!(
                "{} teacher labels for {} evaluation frames",
                reply.eval_teacher_labels.len(),
                eval.len()
            ));
        }
        let teacher: Vec<usize> = reply.eval_teacher_labels.iter().map(|&l| l as usize).collect();
        let (after, cost) = self.model.install(&c, &eval, &reply)?;
        spend(cost).await;
        r.exact_before = exact_match(&before, &teacher);
        r.exact_after = exact_match(&after, &teacher);
        r.accuracy_before = exact_match(&before, &eval.labels);
        r.accuracy_after = exact_match(&after, &eval.labels);
        r.latency_ms = reply.latency_ms;
        tracing::info!(
            camera = %r.camera, adaptation = r.adaptation, drift_frame = r.drift_frame, installed_frame = r.installed_frame,
            exact_before = r.exact_before, exact_after = r.exact_after, accuracy_before = r.accuracy_before,
            accuracy_after = r.accuracy_after, teacher_accuracy = exact_match(&teacher, &eval.labels),
            epochs = reply.epochs, "update installed"
        );
        Ok(())
    }

    /// Streams the whole feed: every batch through the model, drift noticed by the online
    /// policy, the frames that follow uploaded, progress reported.
    async fn stream(&mut self) -> Result<(), String> {
        let args = self.args;
        let mut collecting: Option<Collecting> = None;
        let mut batches = 0u64;
        self.send_report(false).await;
        while self.frame < args.frames {
            let n = FRAME_BATCH.min((args.frames - self.frame) as usize);
            let batch = self.model.batch(n)?;
            spend(batch.cost).await;
            self.frame += batch.labels.len() as u64;
            let conf = batch.confidence;
            let accuracy = exact_match(&batch.predicted, &batch.labels);
            self.log.offer(self.frame, (accuracy as f32, conf as f32));
            let stats = input_stats(&batch.images, super::wire::PIXELS);
            tracing::debug!(camera = %args.name, frame = self.frame, conf, accuracy, mean = stats[0], std = stats[1], "stream batch");
            batches += 1;
            if let Some(c) = collecting.as_mut() {
                let want = args.uploads - c.count;
                let take = want.min(batch.labels.len());
                c.images.extend_from_slice(&batch.images[..take * super::wire::PIXELS]);
                c.count += take;
                if c.count >= args.uploads
                    && let Some(done) = collecting.take()
                {
                    let r = self.adapt(done).await;
                    self.adaptations.push(r);
                    self.online.settled();
                    self.send_report(false).await;
                }
            } else {
                match self.online.observe(conf, stats) {
                    OnlineStep::Stream => {}
                    OnlineStep::Adapt { index, signal } => {
                        tracing::info!(camera = %args.name, frame = self.frame, adaptation = index, ?signal, conf, "drift noticed; uploading the frames that follow");
                        collecting =
                            Some(Collecting { index, drift_frame: self.frame, images: Vec::new(), count: 0 });
                    }
                    OnlineStep::Exhausted => {
                        tracing::warn!(camera = %args.name, frame = self.frame, cap = args.max_adaptations, "drift noticed past the adaptation cap; not adapted");
                    }
                }
            }
            if batches.is_multiple_of(args.report_every.max(1)) {
                self.send_report(false).await;
            }
        }
        if let Some(c) = collecting.take() {
            // the stream ended while collecting: upload what there is when it is a whole batch
            let r = if c.count >= FRAME_BATCH {
                self.adapt(c).await
            } else {
                let error =
                    format!("the stream ended {} frames after the drift, before a batch to upload", c.count);
                CameraReport { error, ..self.blank_report(&c) }
            };
            self.adaptations.push(r);
            self.online.settled();
        }
        tracing::info!(camera = %args.name, frames = self.frame, adaptations = self.adaptations.len(), "stream ended");
        if let Model::Sim(sim) = &mut self.model {
            sim.ended();
        }
        self.send_report(true).await;
        Ok(())
    }
}

/// Streams the whole feed on the real student (on a blocking thread; the run's edge calls
/// block on the runtime `rt`).
fn stream(args: &CameraArgs, rt: &Handle) -> Result<(), String> {
    let (train, test) = digits().map_err(|e| e.to_string())?;
    let model = zoo_student(&args.model, &train).map_err(|e| e.to_string())?;
    let cam = (args.seed & 0xffff) as u32;
    let feed = CameraStream::new(cam, args.schedule.clone(), &train.images, &train.labels, args.seed)
        .map_err(|e| e.to_string())?;
    let edge = rt.block_on(find_edge(args));
    let mut run = Run::new(args, edge, Model::Real(Box::new(RealModel { model, feed, test: &test })));
    rt.block_on(run.stream())
}

/// Streams the whole feed on the stand-in, on the actor's own task (simulation only).
async fn stream_sim(args: &CameraArgs, spec: SimAdaptSpec, log: SimCameraLog) -> Result<(), String> {
    let sim = SimCamera::new(&args.name, args.seed, args.schedule.clone(), spec, log);
    let edge = find_edge(args).await;
    Run::new(args, edge, Model::Sim(sim)).stream().await
}

/// Tells the edge the stream stopped early (so the job ends, naming why, rather than waits).
async fn stopped(args: &CameraArgs, error: String) {
    tracing::error!(camera = %args.name, %error, "the camera's stream stopped");
    let report = StreamReport {
        camera: args.name.clone(),
        frame: 0,
        frames: args.frames,
        ended: true,
        requested: 0,
        phases: Vec::new(),
        samples: Vec::new(),
        adaptations: Vec::new(),
        error,
    };
    let edge = find_edge(args).await;
    if let Err(e) = edge.call(Report(report), args.edge_timeout).await {
        tracing::error!(camera = %args.name, error = %e, "the report did not reach the edge");
    }
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
                let done = match args.compute.clone() {
                    CameraCompute::Real => {
                        let a = args.clone();
                        let rt = Handle::current();
                        tokio::task::spawn_blocking(move || stream(&a, &rt)).await
                    }
                    CameraCompute::Sim { spec, log } => Ok(stream_sim(args, spec, log).await),
                };
                match done {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => stopped(args, e).await,
                    Err(e) => stopped(args, format!("the stream panicked: {e}")).await,
                }
            }
        }
        Ok(())
    }
}

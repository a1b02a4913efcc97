//! Deterministic stand-ins for the coadapt workload's model compute (simulation only).
//!
//! The camera actor streams frames through a student and the edge co-adapts students in the
//! V-MoE pool; on a simulated cluster both run these stand-ins instead: no model is loaded or
//! trained, no dataset read. [`SimCamera`] makes a camera's frames, confidences and evaluation
//! windows by hashing (its seed, the frame) and reads its drift schedule: confidence falls in a
//! phase the model was not adapted to, so the real drift policy notices it. [`SimEdge`] answers
//! an upload with parameters hashed from the upload and an accuracy curve drawn from the same
//! hash, while the real co-adaptation scheduler ([`super::engine::adapt_scheduler`]) decides which
//! task runs each epoch and when it completes. Every step costs modelled time ([`SimAdaptSpec`])
//! that the shells spend on tokio's clock (under paused time, virtual time).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use troupe_kernels::drift::DriftSchedule;
use troupe_kernels::vmoe::VMoeConfig;
use troupe_kernels::vmoe::train::Dataset;
use troupe_policy::Micros;
use troupe_policy::adapt::sched::{AdaptScheduler, CycleLimits, SchedAction, TaskSpec};
use troupe_policy::adapt::{ExpertId, ModelId, TaskId};

use super::engine::{
    EXPERT_ID_STRIDE, EngineConfig, adapt_scheduler, reserved_bytes, shared_bytes, task_footprint,
};
use super::student_config;
use super::wire::{AdaptReply, PIXELS, UploadRequest};

/// The modelled costs of the stand-ins.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimAdaptSpec {
    /// A camera's inference, per frame, microseconds.
    pub frame_us: u64,
    /// The teacher's labelling on the edge, per image, microseconds.
    pub label_us: u64,
    /// One optimiser step on the edge, microseconds.
    pub step_us: u64,
    /// Trainable parameters of a stand-in student.
    pub params: usize,
}

impl Default for SimAdaptSpec {
    fn default() -> Self {
        Self { frame_us: 5_000, label_us: 200, step_us: 4_000, params: 256 }
    }
}

/// An xof stream over `parts` (each hashed with its length, so parts cannot run together).
fn stream(parts: &[&[u8]]) -> blake3::OutputReader {
    let mut h = blake3::Hasher::new();
    for p in parts {
        h.update(&(p.len() as u64).to_le_bytes());
        h.update(p);
    }
    h.finalize_xof()
}

fn floats_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect()
}

/// `n` values in `0..1` from `s`.
fn unit(s: &mut blake3::OutputReader, n: usize) -> Vec<f32> {
    let mut raw = vec![0u8; n];
    s.fill(&mut raw);
    raw.into_iter().map(|b| f32::from(b) / 255.0).collect()
}

/// Class of each image of `images` by a model whose parameters hash to `params`: the
/// stand-in's prediction (a hash of the parameters and the image).
fn predict(params: &[f32], images: &[f32]) -> Vec<usize> {
    let key = blake3::hash(&floats_bytes(params));
    images
        .chunks_exact(PIXELS)
        .map(|img| usize::from(stream(&[key.as_bytes(), &floats_bytes(img)]).next_byte()) % 10)
        .collect()
}

/// Bytes read off a hash stream.
trait Take {
    fn take<const N: usize>(&mut self) -> [u8; N];
    fn next_byte(&mut self) -> u8 {
        self.take::<1>()[0]
    }
}

impl Take for blake3::OutputReader {
    fn take<const N: usize>(&mut self) -> [u8; N] {
        let mut b = [0u8; N];
        self.fill(&mut b);
        b
    }
}

/// What the stand-in cameras did, per camera and incarnation: the simulation's record of every
/// upload asked and every answer installed (a test reads it; the shells never do).
#[derive(Clone, Debug, Default)]
pub struct SimCameraLog {
    inner: Arc<Mutex<BTreeMap<String, Vec<SimIncarnation>>>>,
}

/// One camera incarnation's record.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SimIncarnation {
    /// Adaptations uploaded, in order (a repeat of a lost call counts once).
    pub uploaded: Vec<u32>,
    /// (adaptation, digest of the answer installed), in order.
    pub answered: Vec<(u32, u64)>,
    /// Whether its stream ended.
    pub ended: bool,
}

impl SimCameraLog {
    fn with<T>(&self, f: impl FnOnce(&mut BTreeMap<String, Vec<SimIncarnation>>) -> T) -> T {
        f(&mut self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner))
    }

    fn start(&self, camera: &str) -> usize {
        self.with(|m| {
            let v = m.entry(camera.to_string()).or_default();
            v.push(SimIncarnation::default());
            v.len() - 1
        })
    }

    fn update(&self, camera: &str, incarnation: usize, f: impl FnOnce(&mut SimIncarnation)) {
        self.with(|m| {
            if let Some(i) = m.get_mut(camera).and_then(|v| v.get_mut(incarnation)) {
                f(i);
            }
        });
    }

    /// Every camera's incarnations so far.
    pub fn snapshot(&self) -> BTreeMap<String, Vec<SimIncarnation>> {
        self.with(|m| m.clone())
    }

    /// `f` of every camera's incarnations so far, without a copy.
    pub fn read<T>(&self, f: impl FnOnce(&BTreeMap<String, Vec<SimIncarnation>>) -> T) -> T {
        self.with(|m| f(m))
    }
}

/// The digest a camera records for an answer: what the edge computed (parameters, teacher
/// labels, accuracies, epochs), not its task number or latency, which depend on the run.
pub fn answer_digest(reply: &AdaptReply) -> u64 {
    let mut s = stream(&[
        &floats_bytes(&reply.params),
        &reply.eval_teacher_labels.iter().flat_map(|l| l.to_le_bytes()).collect::<Vec<_>>(),
        &reply.val_before.to_le_bytes(),
        &reply.val_after.to_le_bytes(),
        &reply.epochs.to_le_bytes(),
        &[u8::from(reply.reached)],
    ]);
    u64::from_le_bytes(s.take())
}

/// One batch through a camera's model.
#[derive(Clone, Debug)]
pub struct Observed {
    /// The frames' pixels.
    pub images: Vec<f32>,
    /// Their true labels.
    pub labels: Vec<usize>,
    /// The model's class per frame.
    pub predicted: Vec<usize>,
    /// Mean top-1 confidence.
    pub confidence: f64,
    /// Modelled time of the batch (zero for the real model, which spends its own).
    pub cost: Duration,
}

/// A camera's model compute on a stand-in (see the module docs).
#[derive(Debug)]
pub struct SimCamera {
    name: String,
    seed: u64,
    schedule: DriftSchedule,
    spec: SimAdaptSpec,
    params: Vec<f32>,
    /// The phase (index into the schedule) the model was last adapted for.
    adapted: Option<usize>,
    frame: u64,
    log: SimCameraLog,
    incarnation: usize,
}

impl SimCamera {
    /// Camera `name`'s stand-in, streaming from frame 0 (a fresh incarnation in `log`).
    pub fn new(
        name: &str,
        seed: u64,
        schedule: DriftSchedule,
        spec: SimAdaptSpec,
        log: SimCameraLog,
    ) -> Self {
        let params = unit(&mut stream(&[b"student", &seed.to_le_bytes()]), spec.params);
        let incarnation = log.start(name);
        Self {
            name: name.to_string(),
            seed,
            schedule,
            spec,
            params,
            adapted: None,
            frame: 0,
            log,
            incarnation,
        }
    }

    fn phase_index(&self, frame: u64) -> usize {
        self.schedule.phases().partition_point(|p| p.start_frame <= frame).saturating_sub(1)
    }

    /// The next `n` frames.
    pub fn batch(&mut self, n: usize) -> Observed {
        let first = self.frame;
        self.frame += n as u64;
        let mut s = stream(&[b"frames", &self.seed.to_le_bytes(), &first.to_le_bytes()]);
        let images = unit(&mut s, n * PIXELS);
        let labels: Vec<usize> = (0..n).map(|_| usize::from(s.next_byte()) % 10).collect();
        let phase = self.schedule.at(first);
        let fits = phase.severity == 0.0 || self.adapted == Some(self.phase_index(first));
        let noise = f64::from(s.next_byte()) / 255.0 * 0.02 - 0.01;
        let confidence = if fits { 0.9 } else { 0.85 - 0.3 * f64::from(phase.severity) } + noise;
        // right as often as the model is confident
        let predicted = labels
            .iter()
            .map(|&l| if f64::from(s.next_byte()) / 255.0 < confidence { l } else { (l + 1) % 10 })
            .collect();
        Observed { images, labels, predicted, confidence, cost: self.cost(n) }
    }

    fn cost(&self, frames: usize) -> Duration {
        Duration::from_micros(self.spec.frame_us.saturating_mul(frames as u64))
    }

    /// The held-out window of adaptation `index` noticed at `drift_frame` (`eval` frames) and the
    /// model's classes for it now.
    pub fn window(&mut self, index: u32, drift_frame: u64, eval: usize) -> (Dataset, Vec<usize>, Duration) {
        self.log.update(&self.name, self.incarnation, |i| {
            if !i.uploaded.contains(&index) {
                i.uploaded.push(index);
            }
        });
        let mut s =
            stream(&[b"window", &self.seed.to_le_bytes(), &index.to_le_bytes(), &drift_frame.to_le_bytes()]);
        let images = unit(&mut s, eval * PIXELS);
        let labels = (0..eval).map(|_| usize::from(s.next_byte()) % 10).collect();
        let before = predict(&self.params, &images);
        (Dataset { images, labels }, before, self.cost(eval))
    }

    /// The model's trainable parameters.
    pub fn params(&self) -> Vec<f32> {
        self.params.clone()
    }

    /// Installs the edge's answer to adaptation `index` (noticed at `drift_frame`), recording it;
    /// the model's classes for `eval` after. Refused when the parameters do not fit the model.
    pub fn install(
        &mut self,
        index: u32,
        drift_frame: u64,
        eval: &Dataset,
        reply: &AdaptReply,
    ) -> Result<(Vec<usize>, Duration), String> {
        if reply.params.len() != self.params.len() {
            return Err(format!("{} parameters for a model of {}", reply.params.len(), self.params.len()));
        }
        self.params.clone_from(&reply.params);
        self.adapted = Some(self.phase_index(drift_frame));
        let digest = answer_digest(reply);
        self.log.update(&self.name, self.incarnation, |i| i.answered.push((index, digest)));
        Ok((predict(&self.params, &eval.images), self.cost(eval.len())))
    }

    /// Records that the stream ended.
    pub fn ended(&mut self) {
        self.log.update(&self.name, self.incarnation, |i| i.ended = true);
    }
}

/// A task the stand-in edge holds.
#[derive(Debug)]
struct SimTask {
    name: String,
    /// Hash of the upload: the task's outputs and accuracy curve come from it alone.
    key: [u8; 32],
    params: usize,
    before: f64,
    gain: f64,
    rate: f64,
    accuracy: f64,
    epochs: u32,
    arrived: Micros,
}

impl SimTask {
    fn accuracy_after(&self, epochs: u32) -> f64 {
        self.before + self.gain * (1.0 - (-self.rate * f64::from(epochs)).exp())
    }
}

/// A task the stand-in edge finished.
#[derive(Clone, Debug)]
pub struct SimFinished {
    /// Task id.
    pub task: TaskId,
    /// Job name (the camera).
    pub name: String,
    /// The adapted parameters.
    pub params: Vec<f32>,
    /// Validation accuracy at arrival.
    pub before: f64,
    /// The same when it left.
    pub after: f64,
    /// Epochs trained.
    pub epochs: u32,
    /// Whether it reached its target.
    pub reached: bool,
    /// Arrival time.
    pub arrived: Micros,
    /// Completion time.
    pub done: Micros,
}

/// The edge's co-adaptation on a stand-in (see the module docs): the real scheduler policy over
/// tasks whose epochs are modelled.
pub struct SimEdge {
    spec: SimAdaptSpec,
    cfg: EngineConfig,
    sched: Box<dyn AdaptScheduler + Send>,
    tasks: BTreeMap<TaskId, SimTask>,
    queued: Vec<TaskId>,
    finished: Vec<SimFinished>,
    next_id: u32,
}

impl SimEdge {
    /// A stand-in edge under `cfg`'s scheduler and budget, `expected` students' shared parts kept
    /// out of the budget as the engine keeps them.
    pub fn new(spec: SimAdaptSpec, cfg: EngineConfig, expected: &[VMoeConfig]) -> Self {
        let limits = CycleLimits {
            memory_budget: cfg.budget.saturating_sub(reserved_bytes(expected, cfg.batch)),
            max_epochs: cfg.max_epochs,
        };
        Self {
            spec,
            cfg,
            sched: adapt_scheduler(&cfg, limits),
            tasks: BTreeMap::new(),
            queued: Vec::new(),
            finished: Vec::new(),
            next_id: 0,
        }
    }

    /// The scheduler's name.
    pub fn scheduler_name(&self) -> &'static str {
        self.sched.name()
    }

    /// Whether tasks are held or finished tasks not yet taken.
    pub fn busy(&self) -> bool {
        !self.tasks.is_empty() || !self.finished.is_empty()
    }

    /// Admits an upload at `now`: the task, the teacher's labels of its evaluation frames and
    /// the modelled labelling time. Refused as the engine refuses it (unknown student, too few
    /// samples, too many tasks).
    pub fn admit(
        &mut self,
        now: Micros,
        req: &UploadRequest,
    ) -> Result<(TaskId, Vec<u32>, Duration), String> {
        let config = student_config(&req.model).map_err(|e| e.to_string())?;
        if self.tasks.len() >= self.cfg.max_tasks {
            return Err(format!("the edge already holds {} adaptation tasks, its cap", self.tasks.len()));
        }
        let n = req.train_images.len() / PIXELS;
        if n < 2 * self.cfg.batch.min(8) {
            return Err(format!("{}: {n} samples are too few", req.camera));
        }
        let key = stream(&[
            req.camera.as_bytes(),
            &req.adaptation.to_le_bytes(),
            &req.drift_frame.to_le_bytes(),
            &floats_bytes(&req.params),
            &floats_bytes(&req.train_images),
        ])
        .take::<32>();
        let u = unit(&mut stream(&[&key, b"curve"]), 3);
        let before = 0.3 + 0.3 * f64::from(u[0]);
        let target_gain = if req.target_gain > 0.0 { req.target_gain } else { self.cfg.target_gain };
        let id = TaskId(self.next_id);
        self.next_id += 1;
        let per_model = (config.blocks * config.experts) as u32;
        let spec = TaskSpec {
            id,
            model: ModelId(id.0),
            experts: (0..per_model).map(|e| ExpertId(id.0 * EXPERT_ID_STRIDE + e)).collect(),
            accuracy: before,
            target: before + target_gain,
            footprint: task_footprint(&config)
                + if self.cfg.share_backbone { 0 } else { shared_bytes(&config) },
            deadline: None,
        };
        self.tasks.insert(
            id,
            SimTask {
                name: req.camera.clone(),
                key,
                params: req.params.len(),
                before,
                gain: 0.05 + 0.3 * f64::from(u[1]),
                rate: 0.1 + 0.5 * f64::from(u[2]),
                accuracy: before,
                epochs: 0,
                arrived: now,
            },
        );
        self.sched.handle_arrival(now, spec);
        self.drain(now);
        let labels = req
            .eval_images
            .chunks_exact(PIXELS)
            .map(|img| u32::from(stream(&[b"teacher", &floats_bytes(img)]).next_byte()) % 10)
            .collect();
        let images = (req.train_images.len() + req.eval_images.len()) / PIXELS;
        Ok((id, labels, Duration::from_micros(self.spec.label_us.saturating_mul(images as u64))))
    }

    /// Runs one cycle at `now`: an epoch of every task the scheduler runs; its modelled time.
    pub fn run_cycle(&mut self, now: Micros) -> Duration {
        self.drain(now);
        let runs = std::mem::take(&mut self.queued);
        let epoch = self.spec.step_us.saturating_mul(self.cfg.steps_per_epoch as u64);
        for t in &runs {
            let Some(task) = self.tasks.get_mut(t) else { continue };
            task.epochs += 1;
            task.accuracy = task.accuracy_after(task.epochs);
            self.sched.handle_epoch_done(now, *t, task.accuracy);
        }
        if self.sched.poll_timeout().is_some_and(|due| now >= due) {
            self.sched.handle_timeout(now);
        }
        self.drain(now);
        Duration::from_micros(epoch.saturating_mul(runs.len() as u64))
    }

    /// Tasks finished since the last call.
    pub fn take_finished(&mut self) -> Vec<SimFinished> {
        std::mem::take(&mut self.finished)
    }

    fn drain(&mut self, now: Micros) {
        while let Some(a) = self.sched.poll_action() {
            match a {
                SchedAction::RunEpoch { task } => self.queued.push(task),
                SchedAction::Preload { .. } => {}
                SchedAction::Complete { task, reached } => {
                    let Some(t) = self.tasks.remove(&task) else { continue };
                    let mut s = stream(&[&t.key, b"params", &t.epochs.to_le_bytes()]);
                    let params = unit(&mut s, t.params).into_iter().map(|v| (v - 0.5) * 0.1).collect();
                    self.finished.push(SimFinished {
                        task,
                        name: t.name,
                        params,
                        before: t.before,
                        after: t.accuracy,
                        epochs: t.epochs,
                        reached,
                        arrived: t.arrived,
                        done: now,
                    });
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use troupe_kernels::drift::{Corruption, DriftPhase};

    use super::*;

    fn schedule() -> DriftSchedule {
        DriftSchedule::new(vec![
            DriftPhase { start_frame: 0, corruption: Corruption::Clean, severity: 0.0 },
            DriftPhase { start_frame: 256, corruption: Corruption::parse("rain").unwrap(), severity: 0.6 },
        ])
        .unwrap()
    }

    #[test]
    fn a_camera_is_less_confident_in_weather_it_was_not_adapted_to() {
        let log = SimCameraLog::default();
        let mut cam = SimCamera::new("cam", 3, schedule(), SimAdaptSpec::default(), log.clone());
        let clean = cam.batch(256);
        assert!(clean.confidence > 0.88, "{}", clean.confidence);
        assert_eq!(clean.images.len(), 256 * PIXELS);
        let rainy = cam.batch(64);
        assert!(rainy.confidence < 0.7, "{}", rainy.confidence);
        let (eval, _, _) = cam.window(0, 256, 32);
        let reply = AdaptReply {
            task: 0,
            params: vec![0.0; cam.params().len()],
            eval_teacher_labels: vec![0; 32],
            val_before: 0.5,
            val_after: 0.6,
            epochs: 2,
            reached: true,
            latency_ms: 1,
        };
        cam.install(0, 256, &eval, &reply).unwrap();
        assert!(cam.batch(64).confidence > 0.88, "adapted to the rain");
        let short = AdaptReply { params: vec![0.0; 3], ..reply };
        assert!(cam.install(1, 300, &eval, &short).is_err());
        let rec = &log.snapshot()["cam"][0];
        assert_eq!(rec.uploaded, vec![0]);
        assert_eq!(rec.answered.len(), 1);
    }

    #[test]
    fn the_stand_in_edge_answers_from_the_upload_alone_under_the_real_scheduler() {
        let req = |camera: &str| UploadRequest {
            camera: camera.into(),
            model: "tiny".into(),
            params: vec![0.25; 16],
            train_images: vec![0.5; 64 * PIXELS],
            eval_images: vec![0.5; 8 * PIXELS],
            adaptation: 0,
            drift_frame: 64,
            target_gain: 0.1,
        };
        let run = |order: &[&str]| {
            let mut edge = SimEdge::new(SimAdaptSpec::default(), EngineConfig::default(), &[]);
            let mut now = Micros(0);
            for c in order {
                edge.admit(now, &req(c)).unwrap();
                now = now + Micros(1000);
            }
            let mut done = BTreeMap::new();
            for _ in 0..200 {
                now = now + Micros::from_duration(edge.run_cycle(now));
                for f in edge.take_finished() {
                    done.insert(f.name.clone(), (f.params, f.epochs));
                }
                if !edge.busy() {
                    break;
                }
            }
            done
        };
        let a = run(&["a", "b"]);
        assert_eq!(a.len(), 2, "both adapted");
        assert_eq!(a, run(&["b", "a"]), "a task's outputs do not depend on the order of arrival");
        assert_ne!(a["a"], a["b"]);
        let mut edge = SimEdge::new(SimAdaptSpec::default(), EngineConfig::default(), &[]);
        let few = UploadRequest { train_images: vec![0.5; 4 * PIXELS], ..req("a") };
        assert!(edge.admit(Micros(0), &few).unwrap_err().contains("too few"));
        let unknown = UploadRequest { model: "huge".into(), ..req("a") };
        assert!(edge.admit(Micros(0), &unknown).is_err());
    }
}

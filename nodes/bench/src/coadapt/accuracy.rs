//! Measured: is adaptation worth having? One drifted camera per weather of the sweep, its student
//! adapted alone on teacher-labelled uploads in a real [`CoAdaptPool`] (experts and projector
//! train), accuracy against the true labels of a held-out window of the same drift before and
//! after, beside the teacher's accuracy on that window (the ceiling its labels set), and the
//! epochs each camera took to gain the SLO's points.

use std::collections::BTreeMap;

use anyhow::Result;
use rand::SeedableRng;
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use troupe_kernels::drift::{CameraStream, DriftSchedule};
use troupe_kernels::vmoe::train::{Dataset, predict_all};
use troupe_kernels::vmoe::{CoAdaptPool, VMoe, exact_match};

/// What the accuracy experiment runs.
#[derive(Clone, Copy, Debug)]
pub struct AccuracyConfig {
    /// Uploaded (teacher-labelled) frames per camera.
    pub uploads: usize,
    /// Held-out frames per camera (true labels).
    pub eval: usize,
    /// Images per step.
    pub batch: usize,
    /// Steps per epoch.
    pub steps_per_epoch: usize,
    /// Epochs per camera.
    pub epochs: u32,
    /// Learning rate.
    pub lr: f32,
    /// Accuracy gain counted as "worth having" (the SLO's gain).
    pub gain: f64,
}

/// One camera's result.
#[derive(Clone, Debug, PartialEq)]
pub struct CameraAccuracy {
    /// The drift (a [`DriftSchedule`] line).
    pub weather: String,
    /// Student accuracy before adaptation.
    pub before: f64,
    /// Student accuracy after the last epoch.
    pub after: f64,
    /// Teacher accuracy on the same window.
    pub teacher: f64,
    /// First epoch (1-based) whose accuracy was `gain` above `before`, if any.
    pub epochs_to_gain: Option<u32>,
}

/// A camera's drifted frames: `uploads` labelled by the teacher, then `eval` with true labels.
pub fn camera(
    train: &Dataset,
    teacher: &VMoe,
    weather: &str,
    seed: u64,
    cfg: &AccuracyConfig,
) -> Result<(Dataset, Dataset)> {
    let sched = DriftSchedule::parse(weather)?;
    let frames: Vec<_> = CameraStream::new(seed as u32, sched, &train.images, &train.labels, seed)?
        .take(cfg.uploads + cfg.eval)
        .collect();
    let mut up = Dataset::from_frames(&frames[..cfg.uploads]);
    up.labels = predict_all(teacher, &up)?;
    Ok((up, Dataset::from_frames(&frames[cfg.uploads..])))
}

/// Adapts `student` for every weather in turn (each alone in a fresh pool) and returns the
/// per-camera results.
pub fn run(
    student: &VMoe,
    teacher: &VMoe,
    train: &Dataset,
    weathers: &[&str],
    cfg: &AccuracyConfig,
) -> Result<Vec<CameraAccuracy>> {
    let mut out = Vec::new();
    for (i, weather) in weathers.iter().enumerate() {
        let (up, eval) = camera(train, teacher, weather, 500 + i as u64, cfg)?;
        let mut pool = CoAdaptPool::new("accuracy", 1 << 30)?;
        let id = pool.load("camera", student)?;
        let acc =
            |pool: &CoAdaptPool| -> Result<f64> { Ok(exact_match(&pool.predict(id, &eval)?, &eval.labels)) };
        let before = acc(&pool)?;
        let teacher_acc = exact_match(&predict_all(teacher, &eval)?, &eval.labels);
        let mut rng = SmallRng::seed_from_u64(11 + i as u64);
        let mut order: Vec<usize> = (0..up.len()).collect();
        let (mut after, mut epochs_to_gain) = (before, None);
        for epoch in 1..=cfg.epochs {
            order.shuffle(&mut rng);
            for chunk in order.chunks(cfg.batch).take(cfg.steps_per_epoch) {
                let labels: Vec<usize> = chunk.iter().map(|&j| up.labels[j]).collect();
                pool.adapt_step(id, &up.batch(chunk)?, &labels, cfg.lr)?;
            }
            after = acc(&pool)?;
            if epochs_to_gain.is_none() && after - before >= cfg.gain - 1e-12 {
                epochs_to_gain = Some(epoch);
            }
        }
        out.push(CameraAccuracy {
            weather: weather.to_string(),
            before,
            after,
            teacher: teacher_acc,
            epochs_to_gain,
        });
    }
    Ok(out)
}

/// Prints the table and writes `measured_accuracy_*` figures.
pub fn report(name: &str, cfg: &AccuracyConfig, res: &[CameraAccuracy], fig: &mut BTreeMap<String, f64>) {
    println!(
        "\n== measured: accuracy of adaptation ({name}, each camera alone, {} epochs of {} steps of {} teacher-labelled images; held-out window, true labels) ==",
        cfg.epochs, cfg.steps_per_epoch, cfg.batch
    );
    println!(
        "{:<14} {:>7} {:>7} {:>7} {:>8} {:>12}",
        "drift", "before", "after", "gain", "teacher", "epochs+gain"
    );
    for r in res {
        let e = r.epochs_to_gain.map_or("-".to_string(), |e| e.to_string());
        println!(
            "{:<14} {:>7.3} {:>7.3} {:>7.3} {:>8.3} {:>12}",
            r.weather,
            r.before,
            r.after,
            r.after - r.before,
            r.teacher,
            e
        );
    }
    let n = res.len().max(1) as f64;
    let gain_min = res.iter().map(|r| r.after - r.before).fold(f64::INFINITY, f64::min);
    fig.insert("measured_accuracy_gain_min".into(), if res.is_empty() { f64::NAN } else { gain_min });
    fig.insert("measured_accuracy_before_mean".into(), res.iter().map(|r| r.before).sum::<f64>() / n);
    fig.insert("measured_accuracy_after_mean".into(), res.iter().map(|r| r.after).sum::<f64>() / n);
    fig.insert("measured_teacher_accuracy_mean".into(), res.iter().map(|r| r.teacher).sum::<f64>() / n);
    let reached: Vec<f64> = res.iter().filter_map(|r| r.epochs_to_gain.map(f64::from)).collect();
    fig.insert("measured_cameras_reaching_gain".into(), reached.len() as f64);
    fig.insert(
        "measured_epochs_to_gain_mean".into(),
        if reached.is_empty() { f64::NAN } else { reached.iter().sum::<f64>() / reached.len() as f64 },
    );
}

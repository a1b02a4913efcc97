//! Measured: cross-task expert transfer. The cameras of [`super::accuracy`] (same drifts, same
//! uploads, same held-out windows) adapted twice with the same steps each: alone (every camera its
//! own experts) and co-adapted as one group whose experts form one parallel expert set
//! ([`troupe_kernels::vmoe::merge`]), each camera's step updating the experts the policy's rule
//! allows (`troupe_policy::adapt::transfer::writable`). A camera's accuracy is that of what it
//! routes to (alone: its model; in the group: its view of the set). Reported: epochs (steps over
//! steps per epoch, checked after every step) to the SLO's gain and accuracy after.

use std::collections::BTreeMap;

use anyhow::Result;
use rand::SeedableRng;
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use troupe_kernels::vmoe::merge::{group_view, write_back};
use troupe_kernels::vmoe::train::{Dataset, predict_all};
use troupe_kernels::vmoe::{TrainScope, Trainer, VMoe, exact_match};
use troupe_policy::adapt::transfer::{ALIKE_TOLERANCE, DriftSignature, writable};

use super::accuracy::{AccuracyConfig, camera};

/// One arm's per-camera results: (epochs to the gain, if reached; accuracy before; after).
pub type Arm = Vec<(Option<f64>, f64, f64)>;

/// Adapts the cameras' copies of `student` with the given group sizes (`grouped`: one group of
/// all, else each alone) and returns per-camera results.
fn arm(
    student: &VMoe,
    cams: &[(Dataset, Dataset)],
    cfg: &AccuracyConfig,
    grouped: bool,
    tolerance: f64,
) -> Result<Arm> {
    let g = cams.len();
    let mut members: Vec<VMoe> = vec![student.clone(); g];
    let sigs: Vec<DriftSignature> = cams
        .iter()
        .map(|(up, _)| DriftSignature::of(&up.images, troupe_kernels::vmoe::model::IMAGE_PIXELS))
        .collect();
    let view_of = |members: &[VMoe], t: usize| -> Result<VMoe> {
        Ok(if grouped { group_view(&members.iter().collect::<Vec<_>>(), t)? } else { members[t].clone() })
    };
    let acc =
        |m: &VMoe, eval: &Dataset| -> Result<f64> { Ok(exact_match(&predict_all(m, eval)?, &eval.labels)) };
    let mut trainers: Vec<Trainer> = (0..g)
        .map(|t| Ok(Trainer::new(&view_of(&members, t)?, TrainScope::ExpertsAndProjector, cfg.lr, 0.0)))
        .collect::<Result<_>>()?;
    let before: Vec<f64> = (0..g).map(|t| acc(&view_of(&members, t)?, &cams[t].1)).collect::<Result<_>>()?;
    let mut reached: Vec<Option<f64>> = vec![None; g];
    let mut rngs: Vec<SmallRng> = (0..g).map(|t| SmallRng::seed_from_u64(11 + t as u64)).collect();
    let mut orders: Vec<Vec<usize>> = cams.iter().map(|(up, _)| (0..up.len()).collect()).collect();
    let done = vec![false; g];
    for epoch in 0..cfg.epochs {
        for (t, o) in orders.iter_mut().enumerate() {
            o.shuffle(&mut rngs[t]);
        }
        for step in 0..cfg.steps_per_epoch {
            for t in 0..g {
                let (up, eval) = &cams[t];
                let Some(chunk) = orders[t].chunks(cfg.batch).nth(step) else { continue };
                let labels: Vec<usize> = chunk.iter().map(|&j| up.labels[j]).collect();
                let mut view = view_of(&members, t)?;
                trainers[t].step(&mut view, &up.batch(chunk)?, &labels)?;
                let may = if grouped {
                    writable(t, &sigs, &done, tolerance)
                } else {
                    (0..g).map(|k| k == t).collect()
                };
                if grouped {
                    write_back(&view, &mut members, t, &may)?;
                } else {
                    members[t] = view.clone();
                }
                if reached[t].is_none() && acc(&view, eval)? - before[t] >= cfg.gain - 1e-12 {
                    reached[t] = Some(f64::from(epoch) + (step + 1) as f64 / cfg.steps_per_epoch as f64);
                }
            }
        }
    }
    (0..g).map(|t| Ok((reached[t], before[t], acc(&view_of(&members, t)?, &cams[t].1)?))).collect()
}

/// Runs both arms on the cameras of `weathers` and writes `measured_transfer_*` figures.
pub fn run(
    student: &VMoe,
    teacher: &VMoe,
    train: &Dataset,
    weathers: &[&str],
    cfg: &AccuracyConfig,
    fig: &mut BTreeMap<String, f64>,
) -> Result<()> {
    let cams: Vec<(Dataset, Dataset)> = weathers
        .iter()
        .enumerate()
        .map(|(i, w)| camera(train, teacher, w, 500 + i as u64, cfg))
        .collect::<Result<_>>()?;
    let alone = arm(student, &cams, cfg, false, ALIKE_TOLERANCE)?;
    let group = arm(student, &cams, cfg, true, ALIKE_TOLERANCE)?;
    println!(
        "\n== measured: cross-task expert transfer ({} cameras, {} epochs of {} steps; epochs to +{:.0} points, checked every step) ==",
        cams.len(),
        cfg.epochs,
        cfg.steps_per_epoch,
        cfg.gain * 100.0
    );
    println!(
        "{:<14} {:>7} {:>10} {:>9} {:>10} {:>9}",
        "drift", "before", "ep alone", "after", "ep group", "after"
    );
    let ep = |e: Option<f64>| e.map_or("-".to_string(), |e| format!("{e:.2}"));
    for (i, w) in weathers.iter().enumerate() {
        println!(
            "{:<14} {:>7.3} {:>10} {:>9.3} {:>10} {:>9.3}",
            w,
            alone[i].1,
            ep(alone[i].0),
            alone[i].2,
            ep(group[i].0),
            group[i].2
        );
    }
    // Cameras that never reach the gain count the whole run's epochs (a floor on what they need).
    let total = |a: &Arm| a.iter().map(|r| r.0.unwrap_or(f64::from(cfg.epochs))).sum::<f64>();
    let mean_after = |a: &Arm| a.iter().map(|r| r.2).sum::<f64>() / a.len().max(1) as f64;
    let speedup = if total(&group) > 0.0 { total(&alone) / total(&group) } else { f64::NAN };
    println!(
        "epochs to the gain, summed over cameras: alone {:.2}, with transfer {:.2}: {speedup:.2}x fewer (goal >= 1.3x); accuracy after: alone {:.3}, with transfer {:.3}",
        total(&alone),
        total(&group),
        mean_after(&alone),
        mean_after(&group)
    );
    fig.insert("measured_transfer_epoch_speedup".into(), speedup);
    fig.insert("measured_transfer_epochs_alone".into(), total(&alone));
    fig.insert("measured_transfer_epochs_group".into(), total(&group));
    fig.insert("measured_transfer_accuracy_after_alone".into(), mean_after(&alone));
    fig.insert("measured_transfer_accuracy_after_group".into(), mean_after(&group));
    fig.insert(
        "measured_transfer_accuracy_gain_min_group".into(),
        group.iter().map(|r| r.2 - r.1).fold(f64::INFINITY, f64::min),
    );
    Ok(())
}

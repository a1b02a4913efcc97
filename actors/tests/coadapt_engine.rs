//! The edge's executor on the real co-adaptation pool under memory pressure: four cameras' tiny
//! V-MoEs, a pool with room for the shared parts, one step and only two tasks' experts and
//! optimiser state. Every scheduler must finish every task, never exceed the budget (the pool's
//! own samples after every event), and the twin-buffer scheduler's tasks must gain at least the
//! target in exact match against the teacher on their validation split (fixed seeds).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use troupe_actors::coadapt::engine::{
    AdaptJob, EdgeEngine, EngineConfig, Finished, Mechanisms, SchedulerChoice, reserved_bytes, task_footprint,
};
use troupe_actors::coadapt::{digits, zoo_student, zoo_teacher};
use troupe_kernels::drift::{CameraStream, DriftSchedule};
use troupe_kernels::vmoe::VMoe;
use troupe_kernels::vmoe::train::{Dataset, predict_all};
use troupe_policy::Micros;

const TARGET_GAIN: f64 = 0.15;

// One test per scheduler, so the test harness runs them on separate threads (this binary was the
// slowest in CI when the eight runs were one test).
#[test]
fn twin_finishes_within_the_budget_and_gains() {
    finishes_within_the_budget(SchedulerChoice::Twin);
}

#[test]
fn round_robin_finishes_within_the_budget() {
    finishes_within_the_budget(SchedulerChoice::RoundRobin);
}

#[test]
fn accuracy_first_finishes_within_the_budget() {
    finishes_within_the_budget(SchedulerChoice::AccuracyFirst);
}

#[test]
fn fifo_finishes_within_the_budget() {
    finishes_within_the_budget(SchedulerChoice::Fifo);
}

#[test]
fn every_scheduler_has_a_test() {
    // Fails when a scheduler is added without a test above.
    assert_eq!(SchedulerChoice::ALL.len(), 4);
}

/// Runs `choice` with and without grouping: every task finishes, the pool never passes its
/// budget, and the twin-buffer scheduler's tasks gain at least the target.
/// The tiny student and four drifted cameras' samples, labelled by the teacher.
fn cameras() -> (VMoe, Vec<Dataset>) {
    let (train, _) = digits().expect("run scripts/setup");
    let teacher = zoo_teacher(&train).unwrap();
    let student = zoo_student("tiny", &train).unwrap();
    let weather = ["0 fog 0.8", "0 sun 0.6", "0 fog 0.6", "0 sun 0.8"];
    let jobs = weather
        .iter()
        .enumerate()
        .map(|(i, w)| {
            let s = DriftSchedule::parse(w).unwrap();
            let frames: Vec<_> = CameraStream::new(i as u32, s, &train.images, &train.labels, 40 + i as u64)
                .unwrap()
                .take(256)
                .collect();
            let mut d = Dataset::from_frames(&frames);
            d.labels = predict_all(&teacher, &d).unwrap();
            d
        })
        .collect();
    (student, jobs)
}

/// A logical clock: one millisecond per call (no wall time in tests).
fn ticking(tick: &std::cell::Cell<u64>) -> impl Fn() -> Micros + '_ {
    move || {
        tick.set(tick.get() + 1000);
        Micros(tick.get())
    }
}

fn finishes_within_the_budget(choice: SchedulerChoice) {
    let (student, jobs) = cameras();
    let budget = reserved_bytes(&[student.config], 32) + 2 * task_footprint(&student.config);
    let grouped = [Mechanisms::ALL, Mechanisms::ALL.without("grouping").unwrap()];
    for mechanisms in grouped {
        let cfg = EngineConfig {
            budget,
            scheduler: choice,
            seats: 2,
            steps_per_epoch: 1,
            max_epochs: 60,
            target_gain: TARGET_GAIN,
            mechanisms,
            ..EngineConfig::default()
        };
        let mut eng = EdgeEngine::new(cfg, &[student.config]).unwrap();
        for (i, d) in jobs.iter().enumerate() {
            eng.submit(
                Micros(0),
                AdaptJob {
                    name: format!("cam{i}"),
                    model: student.clone(),
                    samples: d.clone(),
                    target_gain: None,
                    slo_within: None,
                },
            )
            .unwrap();
        }
        let mut done = Vec::new();
        let tick = std::cell::Cell::new(0u64);
        let clock = ticking(&tick);
        for _ in 0..10_000 {
            if !eng.busy() {
                break;
            }
            eng.run_cycle(&clock).unwrap();
            done.extend(eng.take_finished());
        }
        assert_eq!(done.len(), 4, "{}: {} tasks finished", choice.name(), done.len());
        let pool = eng.pool();
        assert!(pool.peak_used() <= budget, "{}: peak {} > budget {budget}", choice.name(), pool.peak_used());
        assert!(pool.fragmentation_samples().iter().all(|s| s.used <= budget));
        // Four tasks, room for two whole-model steps: rotating schedulers had to unload models and
        // merge them back in (FIFO runs two to completion, then the other two).
        // Grouping splits a step into more slices than the cycle has tasks instead.
        let most_slices = eng.plan_records().iter().map(|p| p.plan.slices.len()).max().unwrap_or(0);
        if matches!(choice, SchedulerChoice::Twin | SchedulerChoice::RoundRobin) {
            assert!(
                eng.evictions() > 0 || most_slices > cfg.seats,
                "{} (grouping {}): no memory pressure",
                choice.name(),
                mechanisms.grouping
            );
        }
        assert_eq!(mechanisms.grouping, !eng.plan_records().is_empty());
        // Each task's work is its own steps and validations, one tick of the logical clock each
        // (a grouped step's tick split over the cycle's tasks): no load or scheduling in it.
        let per_epoch = 1000 * (cfg.steps_per_epoch as u64 + 1);
        for f in &done {
            let e = u64::from(f.epochs);
            if mechanisms.grouping {
                let least = e * (1000 + 1000 * cfg.steps_per_epoch as u64 / cfg.seats as u64);
                assert!((least..=e * per_epoch).contains(&f.work.0), "{}: work {:?}", f.name, f.work);
            } else {
                assert_eq!(f.work.0, e * per_epoch, "{}", f.name);
            }
        }
        let total: u64 = done.iter().map(|f| f.work.0).sum();
        assert!(total < tick.get(), "work {total} us is more than the clock's {} us", tick.get());
        for f in &done {
            println!(
                "{} (grouping {}) {}: {:.3} -> {:.3} in {} epochs",
                choice.name(),
                mechanisms.grouping,
                f.name,
                f.before,
                f.after,
                f.epochs
            );
            if choice == SchedulerChoice::Twin {
                assert!(
                    f.reached && f.after - f.before >= TARGET_GAIN,
                    "{}: {:.3} -> {:.3}",
                    f.name,
                    f.before,
                    f.after
                );
            }
        }
    }
}

/// The twin-buffer scheduler on the tiny student's pool (room for two tasks' state), one step an
/// epoch, at most `max_tasks` jobs.
fn twin_engine(student: &VMoe, max_tasks: usize) -> (EngineConfig, EdgeEngine) {
    let cfg = EngineConfig {
        budget: reserved_bytes(&[student.config], 32) + 2 * task_footprint(&student.config),
        scheduler: SchedulerChoice::Twin,
        steps_per_epoch: 1,
        max_epochs: 60,
        target_gain: TARGET_GAIN,
        max_tasks,
        ..EngineConfig::default()
    };
    (cfg, EdgeEngine::new(cfg, &[student.config]).unwrap())
}

/// A job `cam{i}` of `model` on `samples`, its gain due within an hour.
fn slo_job(i: usize, model: VMoe, samples: &Dataset) -> AdaptJob {
    AdaptJob {
        name: format!("cam{i}"),
        model,
        samples: samples.clone(),
        target_gain: None,
        slo_within: Some(Micros::from_secs(3600)),
    }
}

/// Runs cycles on the logical clock until the engine is idle; every task that left.
fn run_until_idle(eng: &mut EdgeEngine) -> Vec<Finished> {
    let tick = std::cell::Cell::new(0u64);
    let clock = ticking(&tick);
    let mut done = Vec::new();
    for _ in 0..10_000 {
        if !eng.busy() {
            break;
        }
        eng.run_cycle(&clock).unwrap();
        done.extend(eng.take_finished());
    }
    done
}

/// Jobs with an SLO that arrive together wait to be admitted while one due no later is on time
/// (admitting costs a validation each, which would run ahead of earlier deadlines): the
/// twin-buffer scheduler on one processor admits and finishes them one by one, in arrival order,
/// and a deferred admission counts in its task's work.
#[test]
fn jobs_with_an_slo_wait_to_be_admitted_in_arrival_order() {
    let (student, jobs) = cameras();
    let (cfg, mut eng) = twin_engine(&student, 4);
    for (i, d) in jobs.iter().enumerate() {
        eng.submit(Micros(0), slo_job(i, student.clone(), d)).unwrap();
    }
    // the first is admitted at once; the rest wait behind its deadline (the same as theirs)
    assert_eq!(eng.waiting(), 3);
    // waiting jobs are accepted ones: they count against the task cap
    assert!(eng.is_full());
    let done = run_until_idle(&mut eng);
    assert_eq!(eng.waiting(), 0);
    let order: Vec<&str> = done.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(order, ["cam0", "cam1", "cam2", "cam3"]);
    for f in &done {
        assert!(f.reached, "{}: {:.3} -> {:.3}", f.name, f.before, f.after);
    }
    // cam0 was admitted by `submit` (its caller times that); the others' admissions, one tick
    // each on the engine's clock, are in their work
    let steps_and_checks = |f: &Finished| u64::from(f.epochs) * 1000 * (cfg.steps_per_epoch as u64 + 1);
    assert!(done[0].work.0 <= steps_and_checks(&done[0]), "{:?}", done[0].work);
    for f in &done[1..] {
        assert!(f.work.0 > steps_and_checks(f), "{}: {:?}", f.name, f.work);
    }
}

/// A waiting job whose starting accuracy cannot be measured (its model's classifier head has the
/// wrong shape) was accepted, so it is not dropped: it leaves unadapted while the others adapt.
#[test]
fn a_waiting_job_that_cannot_be_admitted_leaves_unadapted() {
    let (student, jobs) = cameras();
    let (_, mut eng) = twin_engine(&student, EngineConfig::default().max_tasks);
    let mut broken = student.clone();
    broken.params.head_w = troupe_kernels::Tensor::from_f32(&[1, 1], vec![0.0]).unwrap();
    for (i, model) in [student.clone(), broken].into_iter().enumerate() {
        eng.submit(Micros(0), slo_job(i, model, &jobs[i])).unwrap();
    }
    assert_eq!(eng.waiting(), 1);
    let done = run_until_idle(&mut eng);
    let (ok, bad): (Vec<_>, Vec<_>) = done.iter().partition(|f| f.name == "cam0");
    assert!(ok.len() == 1 && ok[0].reached, "{ok:?}");
    assert_eq!(bad.len(), 1, "the broken job must come back");
    assert!(!bad[0].reached && bad[0].epochs == 0 && bad[0].work.0 == 0);
}

#[test]
fn jobs_past_the_task_cap_are_refused_back_to_the_sender() {
    use troupe_actors::coadapt::engine::EngineError;
    let (train, _) = digits().expect("run scripts/setup");
    let teacher = zoo_teacher(&train).unwrap();
    let student = zoo_student("tiny", &train).unwrap();
    let s = DriftSchedule::parse("0 fog 0.8").unwrap();
    let frames: Vec<_> =
        CameraStream::new(0, s, &train.images, &train.labels, 40).unwrap().take(64).collect();
    let mut samples = Dataset::from_frames(&frames);
    samples.labels = predict_all(&teacher, &samples).unwrap();
    let budget = reserved_bytes(&[student.config], 32) + 2 * task_footprint(&student.config);
    let cfg =
        EngineConfig { budget, max_tasks: 2, max_epochs: 1, steps_per_epoch: 1, ..EngineConfig::default() };
    let mut eng = EdgeEngine::new(cfg, &[student.config]).unwrap();
    let job = |i: usize| AdaptJob {
        name: format!("cam{i}"),
        model: student.clone(),
        samples: samples.clone(),
        target_gain: None,
        slo_within: None,
    };
    for i in 0..2 {
        eng.submit(Micros(0), job(i)).unwrap();
    }
    assert!(eng.is_full());
    let e = eng.submit(Micros(0), job(2)).unwrap_err();
    assert!(matches!(e, EngineError::Full { live: 2, cap: 2 }), "{e}");
    assert!(e.to_string().contains("try again later"), "{e}");
    // a task leaving makes room again (bounded: every task ends within its epoch cap)
    let mut finished = 0;
    for _ in 0..10_000 {
        if finished > 0 || !eng.busy() {
            break;
        }
        eng.run_cycle(&|| Micros(0)).unwrap();
        finished += eng.take_finished().len();
    }
    assert!(finished > 0, "no task finished");
    assert!(!eng.is_full());
    eng.submit(Micros(0), job(3)).unwrap();
}

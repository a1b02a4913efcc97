//! Isolated adaptation (`share_backbone: false`) on the real pool: every task holds its own copy of
//! the frozen parts, and the scheduler's footprint says so. On a budget with room for two tasks'
//! state when the frozen parts are merged, run-to-completion without merging fits one task at a
//! time: all four finish within the budget and no model is ever unloaded to let another one step
//! (a footprint without the copy would put two in one cycle that the pool cannot hold together).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use troupe_actors::coadapt::engine::{
    AdaptJob, EdgeEngine, EngineConfig, SchedulerChoice, reserved_bytes, task_footprint,
};
use troupe_actors::coadapt::{digits, zoo_student, zoo_teacher};
use troupe_kernels::drift::{CameraStream, DriftSchedule};
use troupe_kernels::vmoe::train::{Dataset, predict_all};
use troupe_policy::Micros;

#[test]
fn isolated_run_to_completion_counts_each_tasks_own_copy() {
    let (train, _) = digits().expect("run scripts/setup");
    let teacher = zoo_teacher(&train).unwrap();
    let student = zoo_student("tiny", &train).unwrap();
    let jobs: Vec<Dataset> = ["0 fog 0.8", "0 sun 0.6", "0 fog 0.6", "0 sun 0.8"]
        .iter()
        .enumerate()
        .map(|(i, w)| {
            let s = DriftSchedule::parse(w).unwrap();
            let frames: Vec<_> = CameraStream::new(i as u32, s, &train.images, &train.labels, 70 + i as u64)
                .unwrap()
                .take(128)
                .collect();
            let mut d = Dataset::from_frames(&frames);
            d.labels = predict_all(&teacher, &d).unwrap();
            d
        })
        .collect();
    let budget = reserved_bytes(&[student.config], 32) + 2 * task_footprint(&student.config);
    let cfg = EngineConfig {
        budget,
        scheduler: SchedulerChoice::Fifo,
        share_backbone: false,
        steps_per_epoch: 1,
        max_epochs: 3,
        ..EngineConfig::default()
    };
    let mut eng = EdgeEngine::new(cfg, &[student.config]).unwrap();
    for (i, d) in jobs.iter().enumerate() {
        let job = AdaptJob {
            name: format!("cam{i}"),
            model: student.clone(),
            samples: d.clone(),
            target_gain: None,
            slo_within: None,
        };
        eng.submit(Micros(0), job).unwrap();
    }
    let tick = std::cell::Cell::new(0u64);
    let clock = || {
        tick.set(tick.get() + 1000);
        Micros(tick.get())
    };
    let mut done = Vec::new();
    for _ in 0..1000 {
        if !eng.busy() {
            break;
        }
        eng.run_cycle(&clock).unwrap();
        done.extend(eng.take_finished());
    }
    assert_eq!(done.len(), 4);
    assert!(done.iter().all(|f| f.epochs > 0), "every task trained: none was refused as never fitting");
    assert!(eng.pool().peak_used() <= budget);
    assert_eq!(eng.evictions(), 0, "one isolated task per cycle fits; nothing had to be unloaded");
}

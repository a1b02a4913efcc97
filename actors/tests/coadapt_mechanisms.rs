//! AdaSprite's mechanisms in the real executor: with grouping on, the experts that train together
//! in each time slice are exactly the policy's knapsack grouping for that step (recomputed here
//! from the inputs the executor recorded), `M_tmp` comes from the estimator fitted on the pool's
//! measurements, and under every scheduler and random arrivals the pool never exceeds its budget.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use troupe_actors::coadapt::engine::{
    AdaptJob, EdgeEngine, EngineConfig, Mechanisms, SchedulerChoice, expert_of, reserved_bytes,
    task_footprint,
};
use troupe_actors::coadapt::{digits, zoo_student, zoo_teacher};
use troupe_kernels::drift::{CameraStream, DriftSchedule};
use troupe_kernels::vmoe::VMoe;
use troupe_kernels::vmoe::pool::expert_tmp_bytes;
use troupe_kernels::vmoe::train::{Dataset, predict_all};
use troupe_policy::Micros;
use troupe_policy::adapt::grouping::group_experts;

struct Fixture {
    student: VMoe,
    jobs: Vec<Dataset>,
}

fn fixture(n: usize, frames: usize) -> Fixture {
    let (train, _) = digits().expect("run scripts/setup");
    let teacher = zoo_teacher(&train).unwrap();
    let student = zoo_student("tiny", &train).unwrap();
    let weather = ["0 fog 0.8", "0 sun 0.6", "0 fog 0.6", "0 sun 0.8", "0 fog 0.7"];
    let jobs = (0..n)
        .map(|i| {
            let s = DriftSchedule::parse(weather[i % weather.len()]).unwrap();
            let fs: Vec<_> = CameraStream::new(i as u32, s, &train.images, &train.labels, 40 + i as u64)
                .unwrap()
                .take(frames)
                .collect();
            let mut d = Dataset::from_frames(&fs);
            d.labels = predict_all(&teacher, &d).unwrap();
            d
        })
        .collect();
    Fixture { student, jobs }
}

fn job(f: &Fixture, i: usize) -> AdaptJob {
    AdaptJob {
        name: format!("cam{i}"),
        model: f.student.clone(),
        samples: f.jobs[i].clone(),
        target_gain: None,
        slo_within: None,
    }
}

/// A logical clock: one millisecond per call (no wall time in tests).
fn logical_clock() -> impl Fn() -> Micros {
    let tick = std::cell::Cell::new(0u64);
    move || {
        tick.set(tick.get() + 1000);
        Micros(tick.get())
    }
}

#[test]
fn the_experts_of_each_slice_are_the_policys_grouping() {
    let f = fixture(3, 128);
    let c = f.student.config;
    // Room for every model and for two models' experts' temporaries at once plus three more
    // experts, not for all three: each task's experts fit whole (a bundle, never split over
    // slices), two tasks share a slice and the third runs in another.
    let cap = c.capacity(32 * c.tokens_per_image()).min(32 * c.tokens_per_image());
    let per_model = c.blocks * c.experts;
    let budget = reserved_bytes(&[c], 32)
        + 3 * task_footprint(&c)
        + (per_model as u64 + 3) * expert_tmp_bytes(&c, cap).div_ceil(256) * 256;
    let cfg = EngineConfig {
        budget,
        scheduler: SchedulerChoice::Twin,
        seats: 3,
        steps_per_epoch: 2,
        max_epochs: 4,
        ..EngineConfig::default()
    };
    let mut eng = EdgeEngine::new(cfg, &[c]).unwrap();
    for i in 0..f.jobs.len() {
        eng.submit(Micros(0), job(&f, i)).unwrap();
    }
    let clock = logical_clock();
    for _ in 0..1000 {
        if !eng.busy() {
            break;
        }
        eng.run_cycle(&clock).unwrap();
        eng.take_finished();
    }
    assert!(!eng.busy());
    let plans = eng.plan_records();
    assert!(!plans.is_empty());
    let (mut multi_slice, mut cross_task, mut estimated) = (false, false, false);
    for p in plans {
        // The plan is the policy's grouping of the recorded inputs.
        let input = &p.plan.input;
        let again = group_experts(&input.items, &input.config, &mut SmallRng::seed_from_u64(input.seed));
        assert_eq!(again, p.plan.grouping, "cycle {} step {}", p.cycle, p.step);
        let g = again.expect("the pool has room for every expert alone");
        estimated |= p.cycle > 1;
        multi_slice |= g.slices.len() > 1;
        for (k, slice) in g.slices.iter().enumerate() {
            let experts = input.expand(&slice.experts);
            assert_eq!(experts, p.plan.slices[k], "cycle {} step {} slice {k}", p.cycle, p.step);
            let want: BTreeSet<_> = experts.iter().map(|e| expert_of(*e, &c)).collect();
            // A task fits whole here, so its experts are never split over slices.
            let tasks: BTreeSet<_> = want.iter().map(|(t, _, _)| *t).collect();
            for t in &tasks {
                assert_eq!(want.iter().filter(|(x, _, _)| x == t).count(), per_model, "task {t:?} split");
            }
            cross_task |= tasks.len() > 1;
            // What the pool's optimiser updated in the slice(s) that carried it out.
            let got: BTreeSet<_> = eng
                .slice_records()
                .iter()
                .filter(|r| r.cycle == p.cycle && r.step == p.step && r.slice == k)
                .flat_map(|r| r.trained.iter().copied())
                .collect();
            assert_eq!(got, want, "cycle {} step {} slice {k}", p.cycle, p.step);
        }
    }
    assert!(multi_slice, "the budget never made the knapsack split a step");
    assert!(cross_task, "no slice mixed experts of two tasks");
    // After the first cycle M_tmp is the fitted estimator's, from this pool's own samples.
    let m = eng.estimator().expect("the pool's samples determine the estimator");
    assert!(estimated);
    let last = plans.back().unwrap();
    for (item, members) in last.plan.input.items.iter().zip(&last.plan.input.members) {
        let tokens = c.capacity(32 * c.tokens_per_image()).min(32 * c.tokens_per_image()) as u64;
        let want = m.temporary_bytes(troupe_policy::adapt::memory::ExpertShape { tokens, d_k: c.dim as u64 });
        assert_eq!(item.temp_bytes, members.len() as u64 * want.div_ceil(256) * 256);
    }
    assert!(eng.pool().peak_used() <= budget);
}

#[test]
fn the_pool_never_exceeds_its_budget_under_any_scheduler_or_arrivals() {
    let f = fixture(4, 64);
    let c = f.student.config;
    let mut rng = SmallRng::seed_from_u64(0xb0d9e7);
    for case in 0..12 {
        let scheduler = SchedulerChoice::ALL[case % SchedulerChoice::ALL.len()];
        let mechanisms =
            if rng.random_bool(0.5) { Mechanisms::ALL } else { Mechanisms::ALL.without("grouping").unwrap() };
        let rooms = rng.random_range(1..=3u64);
        let budget = reserved_bytes(&[c], 32) + rooms * task_footprint(&c) + rng.random_range(0..4096);
        let n = rng.random_range(2..=4usize);
        // Poisson arrivals, mean gap 3 ms of the logical clock.
        let mut at = 0u64;
        let arrivals: Vec<u64> = (0..n)
            .map(|_| {
                at += (-(1.0 - rng.random::<f64>()).ln() * 3000.0) as u64;
                at
            })
            .collect();
        let cfg = EngineConfig {
            budget,
            scheduler,
            seats: rng.random_range(1..=3),
            steps_per_epoch: 1,
            max_epochs: 3,
            mechanisms,
            seed: case as u64,
            ..EngineConfig::default()
        };
        let mut eng = EdgeEngine::new(cfg, &[c]).unwrap();
        let clock = logical_clock();
        let (mut next, mut done) = (0, 0);
        for _ in 0..10_000 {
            let now = clock();
            while next < n && arrivals[next] <= now.0 {
                eng.submit(now, job(&f, next)).unwrap();
                next += 1;
            }
            if next == n && !eng.busy() {
                break;
            }
            eng.run_cycle(&clock).unwrap();
            done += eng.take_finished().len();
        }
        let what =
            format!("case {case}: {} grouping {} budget {budget}", scheduler.name(), mechanisms.grouping);
        assert_eq!(done, n, "{what}");
        let pool = eng.pool();
        assert!(pool.peak_used() <= budget, "{what}: peak {}", pool.peak_used());
        assert!(pool.fragmentation_samples().iter().all(|s| s.used <= budget), "{what}");
        assert!(pool.fragmentation_samples().iter().any(|s| s.what == "reserve"), "{what}: nothing ran");
    }
}

#[test]
fn preloads_are_prepared_in_the_background_and_every_one_is_accounted_for() {
    // Six tasks on two seats: tasks wait behind every cycle, so the twin buffer's other half has
    // models to prepare (a model loaded once stays resident: a step's freed temporaries dwarf it).
    let f = fixture(6, 64);
    let c = f.student.config;
    let budget = reserved_bytes(&[c], 32) + 3 * task_footprint(&c);
    for preload in [true, false] {
        let mechanisms = if preload { Mechanisms::ALL } else { Mechanisms::ALL.without("preload").unwrap() };
        let cfg = EngineConfig {
            budget,
            scheduler: SchedulerChoice::Twin,
            seats: 2,
            steps_per_epoch: 2,
            max_epochs: 4,
            mechanisms,
            ..EngineConfig::default()
        };
        let mut eng = EdgeEngine::new(cfg, &[c]).unwrap();
        for i in 0..f.jobs.len() {
            eng.submit(Micros(0), job(&f, i)).unwrap();
        }
        let clock = logical_clock();
        let mut done = 0;
        for _ in 0..1000 {
            if !eng.busy() {
                break;
            }
            eng.run_cycle(&clock).unwrap();
            done += eng.take_finished().len();
        }
        assert_eq!(done, f.jobs.len());
        let s = eng.preload_stats();
        if preload {
            assert!(s.started > 0, "the twin-buffer scheduler preloads the next task: {s:?}");
            assert_eq!(s.started, s.committed + s.refused + s.claimed + s.dropped, "{s:?}");
        } else {
            assert_eq!(s, Default::default());
        }
        assert!(eng.pool().peak_used() <= budget);
    }
}

#[test]
fn each_experts_threads_are_fill_clamp_refills() {
    use troupe_policy::adapt::threads::{block_profiles, fill_clamp_refill};
    let f = fixture(2, 128);
    let c = f.student.config;
    let budget = reserved_bytes(&[c], 32) + 2 * task_footprint(&c);
    for threads in [true, false] {
        let mechanisms = if threads { Mechanisms::ALL } else { Mechanisms::ALL.without("threads").unwrap() };
        // Eight threads (more than the cores here: the split is what is checked, not speed).
        let cfg = EngineConfig {
            budget,
            seats: 2,
            steps_per_epoch: 2,
            max_epochs: 2,
            mechanisms,
            threads: 8,
            // Always on threads, whatever the work (the default gate is the next test's).
            thread_min_macs: 0,
            ..EngineConfig::default()
        };
        let mut eng = EdgeEngine::new(cfg, &[c]).unwrap();
        for i in 0..f.jobs.len() {
            eng.submit(Micros(0), job(&f, i)).unwrap();
        }
        let clock = logical_clock();
        for _ in 0..1000 {
            if !eng.busy() {
                break;
            }
            eng.run_cycle(&clock).unwrap();
            eng.take_finished();
        }
        let records = eng.thread_records();
        if !threads {
            assert!(records.is_empty());
            continue;
        }
        // Forward and backward of every block of every model step.
        assert!(records.len() >= 2 * c.blocks, "{} splits", records.len());
        let total = eng.threads_total();
        assert_eq!(total, 8);
        // Some expert got more than one thread (the split is not the trivial one).
        assert!(records.iter().any(|r| r.split.iter().any(|&t| t > 1)));
        for r in records {
            assert_eq!(r.total, total);
            assert_eq!(r.rows.len(), c.experts);
            // Recompute fill-clamp-refill over the experts that had rows.
            let active: Vec<_> = block_profiles(&r.rows, 1.0).into_iter().filter(|p| p.tokens > 0).collect();
            let want = fill_clamp_refill(&active, total.max(active.len() as u32)).unwrap();
            let got: Vec<u32> = r.split.iter().copied().filter(|&t| t > 0).collect();
            assert_eq!(got, want.threads.iter().map(|(_, t)| *t).collect::<Vec<_>>(), "{r:?}");
            assert!(r.rows.iter().zip(&r.split).all(|(&n, &t)| (n == 0) == (t == 0)), "{r:?}");
        }
    }
}

#[test]
fn blocks_too_small_to_pay_for_threads_run_serially() {
    use troupe_policy::adapt::threads::{MIN_MACS_PER_THREAD, threads_pay};
    let f = fixture(1, 128);
    let c = f.student.config;
    let row_macs = 2 * (c.dim * c.hidden) as u64;
    for min_macs in [MIN_MACS_PER_THREAD, 1] {
        let cfg = EngineConfig {
            budget: reserved_bytes(&[c], 32) + 2 * task_footprint(&c),
            seats: 1,
            steps_per_epoch: 2,
            max_epochs: 1,
            threads: 8,
            thread_min_macs: min_macs,
            ..EngineConfig::default()
        };
        let mut eng = EdgeEngine::new(cfg, &[c]).unwrap();
        eng.submit(Micros(0), job(&f, 0)).unwrap();
        let clock = logical_clock();
        while eng.busy() {
            eng.run_cycle(&clock).unwrap();
            eng.take_finished();
        }
        let records = eng.thread_records();
        assert!(records.len() >= 2 * c.blocks, "{min_macs}: {} decisions", records.len());
        for r in records {
            // Serial (empty split) exactly when the policy says threads do not pay.
            assert_eq!(r.split.is_empty(), !threads_pay(&r.rows, row_macs, min_macs), "{min_macs}: {r:?}");
        }
        // The tiny student's blocks are below the default gate, and above a gate of one.
        let serial = records.iter().filter(|r| r.split.is_empty()).count();
        if min_macs == MIN_MACS_PER_THREAD {
            assert_eq!(serial, records.len());
        } else {
            assert_eq!(serial, 0);
        }
    }
}

#[test]
fn an_idle_model_is_unloaded_rather_than_a_task_split_over_slices() {
    // One seat and room for one model besides a whole step, not two: from the second cycle on
    // the previous cycle's model sits idle in the pool. The policy (`evict::make_room`) unloads it
    // before the step is planned, so every task still trains whole in one slice per step.
    let f = fixture(3, 128);
    let c = f.student.config;
    let fp = task_footprint(&c);
    let budget = reserved_bytes(&[c], 32) + fp + fp / 2;
    let cfg = EngineConfig {
        budget,
        scheduler: SchedulerChoice::Twin,
        seats: 1,
        steps_per_epoch: 2,
        max_epochs: 3,
        ..EngineConfig::default()
    };
    let mut eng = EdgeEngine::new(cfg, &[c]).unwrap();
    for i in 0..f.jobs.len() {
        eng.submit(Micros(0), job(&f, i)).unwrap();
    }
    let clock = logical_clock();
    let mut done = 0;
    for _ in 0..1000 {
        if !eng.busy() {
            break;
        }
        eng.run_cycle(&clock).unwrap();
        done += eng.take_finished().len();
    }
    assert_eq!(done, f.jobs.len());
    let plans = eng.plan_records();
    let mut evicted = 0;
    for p in plans {
        let slices_of = |t: u32| p.plan.slices.iter().filter(|s| s.iter().any(|e| e.0 / 1024 == t)).count();
        let tasks: BTreeSet<u32> = p.plan.slices.iter().flatten().map(|e| e.0 / 1024).collect();
        for &t in &tasks {
            assert_eq!(
                slices_of(t),
                1,
                "cycle {} step {}: task {t} split: {:?}",
                p.cycle,
                p.step,
                p.plan.slices
            );
        }
        for v in &p.evicted {
            assert!(!tasks.contains(&v.0), "cycle {} step {}: unloaded a member {v:?}", p.cycle, p.step);
        }
        evicted += p.evicted.len();
        assert!(p.need_bytes > 0);
    }
    assert!(evicted > 0, "no plan had an idle model to unload: the budget never bound");
    assert!(eng.evictions() as usize >= evicted);
    assert!(eng.pool().peak_used() <= budget);
}

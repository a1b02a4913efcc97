//! The reuse cache in the real executor ([`Mechanisms::reuse`]): the same jobs adapted with it on
//! and off give bit-identical models (the cached-stem path is bit-identical, so no tolerance), on
//! it hits from the second epoch, spills to and prefetches from its disk directory, keeps its memory
//! tier within budget and the pool within its own, and its directory is gone when the engine drops.
//! Off, it reports nothing and carves nothing.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use troupe_actors::coadapt::engine::{
    AdaptJob, EdgeEngine, EngineConfig, Finished, Mechanisms, ReuseStats, SchedulerChoice, reserved_bytes,
    reuse_default_bytes, task_footprint,
};
use troupe_actors::coadapt::{digits, zoo_student, zoo_teacher};
use troupe_kernels::drift::{CameraStream, DriftSchedule};
use troupe_kernels::vmoe::VMoe;
use troupe_kernels::vmoe::train::{Dataset, predict_all};
use troupe_policy::Micros;

fn jobs(student: &VMoe, n: usize) -> Vec<AdaptJob> {
    let (train, _) = digits().expect("run scripts/setup");
    let teacher = zoo_teacher(&train).unwrap();
    let weather = ["0 fog 0.8", "0 sun 0.6", "0 fog 0.6"];
    (0..n)
        .map(|i| {
            let s = DriftSchedule::parse(weather[i % weather.len()]).unwrap();
            let fs: Vec<_> = CameraStream::new(i as u32, s, &train.images, &train.labels, 40 + i as u64)
                .unwrap()
                .take(96)
                .collect();
            let mut d = Dataset::from_frames(&fs);
            d.labels = predict_all(&teacher, &d).unwrap();
            AdaptJob {
                name: format!("cam{i}"),
                model: student.clone(),
                samples: d,
                target_gain: None,
                slo_within: None,
            }
        })
        .collect()
}

/// Runs every job to completion; returns the finished tasks (by name), the reuse figures, the
/// pool's peak and whether the reuse directory existed while the engine ran and after it dropped.
fn run(
    cfg: EngineConfig,
    student: &VMoe,
    jobs: &[AdaptJob],
    parent: &std::path::Path,
) -> (Vec<Finished>, ReuseStats, u64, bool) {
    let mut eng = EdgeEngine::with_reuse_dir(cfg, &[student.config], parent).unwrap();
    for j in jobs {
        eng.submit(Micros(0), j.clone()).unwrap();
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
    assert!(!eng.busy());
    let dir = eng.reuse_dir().map(std::path::Path::to_path_buf);
    assert_eq!(dir.is_some(), cfg.mechanisms.reuse);
    let existed = dir.as_ref().is_some_and(|d| d.exists());
    let (stats, peak) = (eng.reuse_stats(), eng.pool().peak_used());
    drop(eng);
    assert!(dir.is_none_or(|d| !d.exists()), "the reuse directory is removed when the engine drops");
    done.sort_by(|a, b| a.name.cmp(&b.name));
    (done, stats, peak, existed)
}

fn weight_bits(m: &VMoe) -> Vec<u32> {
    m.params
        .tensors()
        .iter()
        .flat_map(|(_, t)| t.f32_cow().iter().map(|v| v.to_bits()).collect::<Vec<_>>())
        .collect()
}

#[test]
fn reuse_on_trains_the_same_models_and_hits_from_the_second_epoch() {
    let (train, _) = digits().expect("run scripts/setup");
    let student = zoo_student("tiny", &train).unwrap();
    let c = student.config;
    let jobs = jobs(&student, 3);
    let tmp = tempfile::tempdir().unwrap();
    let budget = reserved_bytes(&[c], 32) + 3 * task_footprint(&c);
    // Whole-model steps (grouping off): the grouping's lifespans are measured wall times, so only
    // this path is deterministic run to run; with it the comparison is exact.
    let base = EngineConfig {
        budget,
        scheduler: SchedulerChoice::Twin,
        seats: 2,
        steps_per_epoch: 2,
        max_epochs: 4,
        mechanisms: Mechanisms::ALL.without("grouping").unwrap(),
        ..EngineConfig::default()
    };
    let off_cfg = EngineConfig { mechanisms: base.mechanisms.without("reuse").unwrap(), ..base };
    let (off, off_stats, off_peak, _) = run(off_cfg, &student, &jobs, tmp.path());
    let (on, s, on_peak, existed) = run(base, &student, &jobs, tmp.path());
    assert_eq!(off_stats, ReuseStats::default(), "reuse off reports nothing");
    assert!(existed);
    assert_eq!(off.len(), jobs.len());
    assert_eq!(on.len(), off.len());
    for (a, b) in off.iter().zip(&on) {
        assert_eq!(
            (a.name.as_str(), a.epochs, a.before, a.after),
            (b.name.as_str(), b.epochs, b.before, b.after)
        );
        assert!(weight_bits(&a.model) == weight_bits(&b.model), "{}: reuse changed the weights", a.name);
    }
    println!("reuse on: {s:?}");
    assert!(on.iter().any(|f| f.epochs > 1), "some task trained a second epoch");
    assert!(s.hits > 0 && s.misses > 0 && s.spilled > 0 && s.prefetched > 0, "{s:?}");
    assert_eq!(s.budget, reuse_default_bytes(&[c], 32));
    assert!(s.memory_bytes <= s.budget && s.disk_bytes <= s.disk_budget, "{s:?}");
    assert!((0.0..=1.0).contains(&s.prefetch_hidden_share));
    assert!(off_peak <= budget && on_peak <= budget);
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
}

#[test]
fn grouped_slices_prefetch_the_next_slice_behind_compute() {
    let (train, _) = digits().expect("run scripts/setup");
    let student = zoo_student("tiny", &train).unwrap();
    let c = student.config;
    let jobs = jobs(&student, 3);
    let tmp = tempfile::tempdir().unwrap();
    let budget = reserved_bytes(&[c], 32) + 3 * task_footprint(&c);
    let cfg = EngineConfig { budget, seats: 3, steps_per_epoch: 2, max_epochs: 3, ..EngineConfig::default() };
    let (done, s, peak, _) = run(cfg, &student, &jobs, tmp.path());
    println!("reuse on, grouping on: {s:?}");
    assert_eq!(done.len(), jobs.len());
    assert!(peak <= budget);
    assert!(s.hits > 0 && s.prefetched > 0, "{s:?}");
    assert!(s.memory_bytes <= s.budget && s.disk_bytes <= s.disk_budget, "{s:?}");
    assert!(s.prefetch_hidden_us <= s.prefetch_us);
}

/// A storage read throttle in the executor is the kernel's: under cgroup v1 the reuse cache's
/// disk thread (alone) is in a blkio group whose `read_bps_device` names the disk holding the
/// reuse directory at the configured rate; under v2 this process's group has that `io.max`. Where
/// no hierarchy can be written the engine refuses, and this test fails saying so.
#[test]
fn a_storage_read_throttle_puts_the_disk_thread_in_a_blkio_group() {
    use std::os::unix::fs::MetadataExt;
    use troupe_actors::cgroup::CgroupVersion;
    use troupe_actors::coadapt::throttle::dev_numbers;

    let dir = tempfile::tempdir().unwrap();
    let cfg = EngineConfig { storage_read_bps: 40_000_000, ..EngineConfig::default() };
    let student = zoo_student("tiny", &digits().expect("run scripts/setup").0).unwrap();
    let eng = match EdgeEngine::with_reuse_dir(cfg, &[student.config], dir.path()) {
        Ok(e) => e,
        Err(e) => panic!(
            "{e}: a storage read throttle cannot be set here (it needs root and a cgroup v1 blkio or v2 io \
             controller; skip it explicitly with `--skip a_storage_read_throttle` on such hosts)"
        ),
    };
    let t = eng.storage_throttle().expect("a throttle was asked for").clone();
    let disk = dev_numbers(std::fs::metadata(dir.path()).unwrap().dev());
    // The directory's filesystem is the disk itself, or one of its partitions (same major).
    assert!(t.device == disk || t.device.0 == disk.0, "{t:?} vs {disk:?}");
    let rule = format!("{}:{}", t.device.0, t.device.1);
    match t.version {
        CgroupVersion::V1 => {
            let set = std::fs::read_to_string(t.group.join("blkio.throttle.read_bps_device")).unwrap();
            assert!(set.lines().any(|l| l == format!("{rule} 40000000")), "{set}");
            let tasks = std::fs::read_to_string(t.group.join("tasks")).unwrap();
            let pid = std::process::id().to_string();
            assert_eq!(tasks.lines().count(), 1, "one thread, the disk thread: {tasks}");
            assert!(tasks.lines().all(|l| l != pid), "the main thread stays out: {tasks}");
        }
        CgroupVersion::V2 => {
            let set = std::fs::read_to_string(t.group.join("io.max")).unwrap();
            assert!(set.contains(&rule) && set.contains("rbps=40000000"), "{set}");
        }
    }
    drop(eng);
}

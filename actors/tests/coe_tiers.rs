//! The executor's memory tiers on real ONNX experts of a generated ci app: demotion to a
//! budgeted host tier, host eviction by usage probability, promotion from the host tier, the
//! device copy in the weight store's `MemoryPool` with compaction, and a real run under a small
//! host tier.
#![cfg(feature = "onnx")]

use std::collections::BTreeSet;
use std::sync::Arc;

use proptest::prelude::*;
use troupe_actors::coe::app::{App, Scale};
use troupe_actors::coe::executor::{DEVICE_ALIGN, ExecutorOptions, ExpertExecutor};
use troupe_actors::coe::profiler::{default_plan, load_profile, profile};
use troupe_actors::coe::runner::{RunOptions, TierOptions, run_local};
use troupe_kernels::Tier as StoreTier;

use troupe_policy::coe::{
    Demotion, ExecutorKind, ExpertId, HostCandidate, HostTier, LatencyModel, SchedulerConfig, Tier,
};

mod common;
use common::{generated_app, no_baseline};

/// A fresh ci app with its profile in a temporary folder.
fn ci_app() -> (tempfile::TempDir, Arc<App>, LatencyModel) {
    let tmp = tempfile::tempdir().expect("temp dir");
    generated_app(tmp.path(), Scale::Ci, 5, &no_baseline());
    let app = App::open(tmp.path(), None).expect("opening the app");
    let p = profile(&app, &default_plan(&app)).expect("profiling");
    std::fs::write(tmp.path().join("profile.txt"), p.to_text()).expect("writing the profile");
    let profile = load_profile(&tmp.path().join("profile.txt")).expect("reading the profile");
    let latency = LatencyModel::from_profile(&profile).expect("latency model");
    (tmp, Arc::new(app), latency)
}

thread_local! {
    /// One app per test thread (generation is the slow part).
    static APP: std::rc::Rc<(tempfile::TempDir, Arc<App>, LatencyModel)> = std::rc::Rc::new(ci_app());
}

/// Expert `e` as the host-tier policy sees it.
fn candidate(app: &App, e: ExpertId) -> HostCandidate {
    let x = app.trace.model.expert(e).expect("expert in the model");
    HostCandidate { id: e, size_bytes: x.size_bytes, usage_prob: x.usage_prob }
}

/// One step of a random executor workload.
#[derive(Clone, Debug)]
enum Op {
    Load(u32),
    Evict(u32),
    Run(u32),
}

/// Operations over all experts, and more often over the first 12 (entry experts and their
/// first children: the most used, so their demotions push colder experts out of the host tier).
fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (0u32..64).prop_map(Op::Load),
        3 => (0u32..12).prop_map(Op::Load),
        2 => (0u32..64).prop_map(Op::Evict),
        3 => (0u32..12).prop_map(Op::Evict),
        1 => (0u32..64).prop_map(Op::Run),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    /// Whatever is asked, after every operation the device and host bytes are within their
    /// budgets and equal to the sums over what the executor holds (its sessions; the experts
    /// its store keeps in the host tier), the pool holds one aligned allocation per session,
    /// and the host tier holds exactly what the scheduler's `HostTier` tracks (demotions placed
    /// by `plan_demotion`, promotions leaving it), so every load comes from the tier the
    /// scheduler planned it from. A load of a host-resident expert counts as a promotion, any
    /// other as a disk load.
    #[test]
    fn demotion_and_promotion_keep_both_tiers_within_budget(
        ops in proptest::collection::vec(op(), 1..80),
        host_kib in 0u64..3072,
    ) {
        let shared = APP.with(std::rc::Rc::clone);
        let app = &shared.1;
        let model = &app.trace.model;
        let n = model.len() as u32;
        let (budget, host_budget) = (3u64 << 20, host_kib << 10);
        let mut exec = ExpertExecutor::open_with(
            "cpu0",
            &app.store_dir(),
            &app.manifest,
            model,
            ExecutorOptions { host_budget: Some(host_budget), ..ExecutorOptions::new(budget) },
        )
        .unwrap();
        // The expected tiers: the host tier as the scheduler tracks it (the policy's HostTier).
        let mut host = HostTier::new(model, host_budget);
        let mut device: BTreeSet<ExpertId> = BTreeSet::new();
        let (mut promotions, mut disk_loads, mut demotions, mut host_evictions) = (0u64, 0u64, 0u64, 0u64);
        let bytes = |set: &BTreeSet<ExpertId>| -> u64 { set.iter().map(|e| model.size_of(*e)).sum() };
        for op in ops {
            match op {
                Op::Load(e) => {
                    let e = ExpertId(e % n);
                    let fits = bytes(&device) + model.size_of(e) <= budget && !device.contains(&e);
                    if !device.contains(&e) {
                        // The scheduler plans the load from the tier the executor will read.
                        let tracked = if host.source_of(e) == Tier::Host { StoreTier::Host } else { StoreTier::Disk };
                        prop_assert_eq!(exec.source_tier(e).unwrap(), tracked, "source of {}", e);
                    }
                    prop_assert_eq!(exec.load(e).is_ok(), fits, "load {}", e);
                    if fits {
                        if host.promote(e) { promotions += 1 } else { disk_loads += 1 }
                        device.insert(e);
                    }
                }
                Op::Evict(e) => {
                    let e = ExpertId(e % n);
                    let held = device.contains(&e);
                    prop_assert_eq!(exec.evict(e).is_ok(), held, "evict {}", e);
                    if held {
                        device.remove(&e);
                        if let Demotion::ToHost { evict } = host.demote(&candidate(app, e)) {
                            host_evictions += evict.len() as u64;
                            demotions += 1;
                        }
                    }
                }
                Op::Run(e) => {
                    let e = ExpertId(e % n);
                    let out = exec.run_batch(e, &[app.input(0)]);
                    prop_assert_eq!(out.is_ok(), device.contains(&e));
                }
            }
            exec.check_accounting().map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(exec.resident_bytes(), bytes(&device));
            prop_assert!(exec.resident_bytes() <= budget);
            prop_assert_eq!(exec.loaded(), device.iter().copied().collect::<Vec<_>>());
            let aligned: u64 = device.iter().map(|e| model.size_of(*e).div_ceil(DEVICE_ALIGN) * DEVICE_ALIGN).sum();
            let pool = exec.device_pool();
            prop_assert_eq!((pool.used, pool.allocations), (aligned, device.len()));
            prop_assert!(pool.used <= pool.budget);
            prop_assert_eq!(exec.host_resident(), host.resident());
            prop_assert_eq!(exec.store_host_bytes(), host.used());
            prop_assert!(exec.store_host_bytes() <= host_budget);
            let c = exec.counters();
            prop_assert_eq!(
                (c.promotions, c.disk_loads, c.demotions, c.host_evictions),
                (promotions, disk_loads, demotions, host_evictions)
            );
        }
    }
}

/// Experts (a, b, c, d) for a fragmentation: a, b, c fill the budget; with a and c evicted, d
/// fits in the free bytes (raw and aligned) but in neither hole.
fn fragmenting(app: &App, slack: u64) -> Option<[ExpertId; 4]> {
    let model = &app.trace.model;
    let al = |e: &ExpertId| model.size_of(*e).div_ceil(DEVICE_ALIGN) * DEVICE_ALIGN;
    let ids: Vec<ExpertId> = model.experts().iter().map(|e| e.id).collect();
    let b = *ids.iter().min_by_key(|e| model.size_of(**e))?;
    for a in &ids {
        for c in &ids {
            for d in &ids {
                let distinct = [a, c, d].iter().all(|x| **x != b) && a != c && a != d && c != d;
                let tail = al(c) + slack;
                if distinct
                    && al(d) > al(a)
                    && al(d) > tail
                    && model.size_of(*d) <= model.size_of(*a) + model.size_of(*c)
                {
                    return Some([*a, b, *c, *d]);
                }
            }
        }
    }
    None
}

/// A load that fits the budget but no free range of the device arena compacts the arena; the
/// moved device copies stay intact (a demotion reads them back and verifies their checksums).
/// Under ONNX Runtime (its own copy of the weights) and the MLP engine reading them in place,
/// where a moved expert must be read at its new offset.
#[test]
fn fragmented_device_arena_is_compacted_and_bytes_survive() {
    for mlp_on_cpu in [false, true] {
        let shared = APP.with(std::rc::Rc::clone);
        let app = &shared.1;
        let model = &app.trace.model;
        // Generous slack bound: the executor's is (experts resident at once + 1) alignment units.
        let slack = (model.len() as u64 + 1) * DEVICE_ALIGN;
        let [a, b, c, d] = fragmenting(app, slack).expect("the ci app has experts that fragment the arena");
        let budget = model.size_of(a) + model.size_of(b) + model.size_of(c);
        let options = ExecutorOptions {
            host_budget: Some(model.total_bytes()),
            mlp_on_cpu,
            ..ExecutorOptions::new(budget)
        };
        let mut exec =
            ExpertExecutor::open_with("cpu0", &app.store_dir(), &app.manifest, model, options).unwrap();
        let expected = exec.run_batch(b, &[app.input(1)]).err().map(|e| e.to_string());
        assert!(expected.is_some_and(|e| e.contains("not loaded")), "running before loading is refused");
        for e in [a, b, c] {
            exec.load(e).unwrap();
        }
        let before = exec.run_batch(b, &[app.input(1)]).unwrap();
        exec.evict(a).unwrap();
        exec.evict(c).unwrap();
        let pool = exec.device_pool();
        assert!(pool.free_blocks >= 2, "{pool:?}");
        assert!(pool.largest_free_block < model.size_of(d), "{pool:?}");
        exec.load(d).unwrap();
        assert_eq!(exec.counters().compactions, 1);
        assert_eq!(exec.device_pool().free_blocks, 1);
        exec.check_accounting().unwrap();
        // b moved: its session still runs the same, and its device copy still checks out.
        assert_eq!(exec.run_batch(b, &[app.input(1)]).unwrap(), before);
        exec.evict(b).unwrap();
        assert_eq!(exec.source_tier(b).unwrap(), StoreTier::Host, "demoted, checksum verified");
        exec.load(b).unwrap();
        assert_eq!(exec.run_batch(b, &[app.input(1)]).unwrap(), before);
        exec.check_accounting().unwrap();
        let c = exec.counters();
        assert_eq!(c.in_arena_loads, if mlp_on_cpu { c.loads } else { 0 }, "{c:?}");
    }
}

/// The CPU executor's sessions get the CPU thread count, the GPU stand-in's its own, and the
/// host budget is the fraction of all expert bytes.
#[test]
fn each_executor_kind_gets_its_own_threads_and_the_host_share() {
    let shared = APP.with(std::rc::Rc::clone);
    let (app, latency) = (&shared.1, &shared.2);
    let model = &app.trace.model;
    let tiers =
        TierOptions { host_budget: Some(0.5), cpu_threads: 3, gpu_threads: 2, ..TierOptions::default() };
    let mut kinds = Vec::new();
    for e in 0..latency.executors() {
        let options = tiers.executor(latency, e, model);
        let exec =
            ExpertExecutor::open_with(latency.name(e), &app.store_dir(), &app.manifest, model, options)
                .unwrap();
        let want = if latency.kind(e) == ExecutorKind::Cpu { 3 } else { 2 };
        assert_eq!(exec.threads(), want, "{}", latency.name(e));
        assert_eq!(exec.host_budget(), model.total_bytes() / 2, "{}", latency.name(e));
        assert_eq!(exec.budget(), latency.expert_budget(e));
        kinds.push(latency.kind(e));
    }
    assert!(kinds.contains(&ExecutorKind::Cpu) && kinds.contains(&ExecutorKind::Gpu), "{kinds:?}");
}

/// A real run with a host tier of 5% of all expert bytes demotes, promotes and evicts from the
/// host tier, stays within both budgets, and answers every request as the default run does.
#[test]
fn small_host_tier_run_matches_the_default_and_keeps_its_budget() {
    let shared = APP.with(std::rc::Rc::clone);
    let (app, latency) = (&shared.1, &shared.2);
    let config = SchedulerConfig::ours();
    let reference = run_local(app, latency, &RunOptions::new(config)).unwrap();
    let share = 0.05;
    let tiers = TierOptions { host_budget: Some(share), cpu_threads: 2, ..TierOptions::default() };
    let small = run_local(app, latency, &RunOptions { tiers, ..RunOptions::new(config) }).unwrap();
    assert_eq!(small.digests, reference.digests, "outputs do not depend on the tiers");
    let host_budget = (share * app.trace.model.total_bytes() as f64) as u64;
    let sum = |f: fn(&troupe_actors::coe::executor::ExecutorCounters) -> u64| -> u64 {
        small.executors.iter().map(|(_, c)| f(c)).sum()
    };
    for (name, c) in &small.executors {
        assert!(
            c.peak_host_bytes <= host_budget,
            "{name}: host peak {} over {host_budget}",
            c.peak_host_bytes
        );
        assert_eq!(c.promotions + c.disk_loads, c.loads, "{name}");
    }
    assert!(sum(|c| c.demotions) > 0 && sum(|c| c.promotions) > 0, "{:?}", small.executors);
    assert!(small.host_promotion_over_disk_load().is_finite());
    assert!(small.scheduling_s > 0.0 && small.scheduling_share() < 1.0);
}

//! Property tests: random operation sequences on the expert manager, and random workloads,
//! devices and budgets through the simulator (which referees every decision) under all four
//! policy combinations.

use proptest::prelude::*;
use proptest::test_runner::RngSeed;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::Micros;
use crate::coe::latency::LatencyModel;
use crate::coe::memory::{EvictionContext, EvictionPolicy, ExpertManager, belady_min_loads, lru_loads};
use crate::coe::model::{CoeModel, ExpertId, ExpertSpec, Tier};
use crate::coe::profile::{ExecutorKind, ExecutorProfile, LatencyPoint, Profile, SizeClass};
use crate::coe::scheduler::SchedulerConfig;
use crate::coe::sim::{ExecutorFault, SimOptions, simulate};
use crate::coe::synth::{ArrivalConfig, ModelConfig, synthetic_model, synthetic_trace};

/// One step of a random manager workout.
#[derive(Clone, Debug)]
enum Op {
    Load(u32),
    Pin(u32),
    Unpin(u32),
    Evict(u32),
    Touch(u32),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u32..8).prop_map(Op::Load),
        2 => (0u32..8).prop_map(Op::Pin),
        2 => (0u32..8).prop_map(Op::Unpin),
        1 => (0u32..8).prop_map(Op::Evict),
        1 => (0u32..8).prop_map(Op::Touch),
    ]
}

/// Eight experts: roots e0, e1; e2..e4 under e0; e5..e7 under e1; sizes 10..=40.
fn small_model(sizes: &[u64; 8]) -> CoeModel {
    let parents = [None, None, Some(0), Some(0), Some(0), Some(1), Some(1), Some(1)];
    let specs = (0..8)
        .map(|i| ExpertSpec {
            size_bytes: sizes[i],
            select_prob: 0.1 + 0.1 * i as f64,
            home: Tier::Ssd,
            parent: parents[i].map(ExpertId),
        })
        .collect();
    CoeModel::new(specs).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    /// Whatever the sequence: the budget holds, pinned experts are never chosen or evicted, no
    /// victim is evicted needlessly, and the byte count matches the resident set.
    #[test]
    fn manager_never_exceeds_budget_nor_evicts_pinned(
        sizes in prop::array::uniform8(10u64..=40),
        budget in 40u64..=120,
        policy in prop::sample::select(EvictionPolicy::ALL.to_vec()),
        ops in prop::collection::vec(op(), 1..80),
    ) {
        let model = small_model(&sizes);
        let mut m = ExpertManager::new(budget, policy);
        let mut pins = [0u32; 8];
        for op in ops {
            match op {
                Op::Load(e) => {
                    let x = ExpertId(e);
                    if m.is_resident(x) { continue; }
                    let plan = {
                        let is_resident = |y: ExpertId| m.is_resident(y);
                        let next_use = |y: ExpertId| y.0.is_multiple_of(3).then_some(u64::from(y.0));
                        let elsewhere = |y: ExpertId| y.0.is_multiple_of(2);
                        let ctx = EvictionContext { model: &model, is_resident: &is_resident, resident_elsewhere: &elsewhere, next_use: &next_use };
                        m.plan_eviction(x, sizes[e as usize], &ctx)
                    };
                    if let Ok(victims) = plan {
                        // Minimal: without any one victim the expert would not fit.
                        let freed: u64 = victims.iter().map(|v| sizes[v.index()]).sum();
                        let room = budget - m.used_bytes() + freed;
                        for v in &victims {
                            prop_assert!(room - sizes[v.index()] < sizes[e as usize], "{} evicted needlessly", v);
                        }
                        for v in victims {
                            prop_assert_eq!(pins[v.0 as usize], 0, "planned to evict pinned {}", v);
                            m.evict(v).unwrap();
                        }
                        m.admit(x, sizes[e as usize]).unwrap();
                    }
                }
                Op::Pin(e) => {
                    if m.pin(ExpertId(e)).is_ok() { pins[e as usize] += 1; }
                }
                Op::Unpin(e) => {
                    if m.unpin(ExpertId(e)).is_ok() { pins[e as usize] -= 1; }
                }
                Op::Evict(e) => {
                    let result = m.evict(ExpertId(e));
                    if pins[e as usize] > 0 {
                        prop_assert!(result.is_err(), "evicted pinned e{}", e);
                    }
                }
                Op::Touch(e) => m.touch(ExpertId(e)),
            }
            prop_assert!(m.used_bytes() <= budget);
            let resident: u64 = m.resident().map(|x| sizes[x.index()]).sum();
            prop_assert_eq!(resident, m.used_bytes());
            for (i, p) in pins.iter().enumerate() {
                if *p > 0 {
                    prop_assert!(m.is_resident(ExpertId(i as u32)));
                }
            }
        }
    }

    /// With equal sizes Belady's MIN is optimal, so it never needs more loads than LRU.
    #[test]
    fn belady_never_worse_than_lru_with_equal_sizes(
        order in prop::collection::vec(0u32..12, 0..200),
        slots in 1u64..8,
    ) {
        let order: Vec<ExpertId> = order.into_iter().map(ExpertId).collect();
        let min = belady_min_loads(&order, |_| 1, slots).unwrap();
        let lru = lru_loads(&order, |_| 1, slots).unwrap();
        prop_assert!(min <= lru, "belady {} > lru {}", min, lru);
    }

}

proptest! {
    // With variable sizes farthest-next-use is a heuristic and no theorem says it never loses to
    // LRU, so this runs on a fixed seed as a regression check (30 000 random cases found no
    // counterexample when it was written).
    #![proptest_config(ProptestConfig {
        cases: 2000,
        failure_persistence: None,
        rng_seed: RngSeed::Fixed(0x00c0_5e4e),
        ..ProptestConfig::default()
    })]

    /// Belady on variable sizes needs no more loads than LRU on these orders.
    #[test]
    fn belady_not_worse_than_lru_with_variable_sizes(
        order in prop::collection::vec(0u32..12, 0..200),
        sizes in prop::array::uniform12(1u64..5),
        budget in 4u64..16,
    ) {
        let order: Vec<ExpertId> = order.into_iter().map(ExpertId).collect();
        let min = belady_min_loads(&order, |x| sizes[x.index()], budget).unwrap();
        let lru = lru_loads(&order, |x| sizes[x.index()], budget).unwrap();
        prop_assert!(min <= lru, "belady {} > lru {}", min, lru);
    }
}

/// A random device: 1-3 executors with random budgets (each at least the largest expert on the
/// first executor), max batch, latency curves and bandwidths.
fn random_profile(rng: &mut SmallRng, largest: u64, total: u64) -> Profile {
    let executors = (0..rng.random_range(1..=3usize))
        .map(|i| {
            let lo = if i == 0 { largest } else { largest / 2 };
            let budget = rng.random_range(lo.max(1)..=total.max(lo.max(1)));
            let l1 = rng.random_range(50u64..2_000);
            ExecutorProfile {
                name: format!("x{i}"),
                kind: if i == 0 { ExecutorKind::Gpu } else { ExecutorKind::Cpu },
                memory_bytes: budget * 2,
                expert_memory_bytes: budget,
                max_batch: rng.random_range(1..=6),
                host_bandwidth: rng.random_range(1_000_000u64..50_000_000),
                ssd_bandwidth: rng.random_range(100_000u64..5_000_000),
                size_classes: vec![SizeClass {
                    max_expert_bytes: largest,
                    points: vec![
                        LatencyPoint { batch: 1, latency: Micros(l1) },
                        LatencyPoint { batch: 4, latency: Micros(l1 * rng.random_range(1..=4)) },
                    ],
                }],
            }
        })
        .collect();
    Profile { hardware_fingerprint: "random".into(), executors }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, failure_persistence: None, ..ProptestConfig::default() })]

    /// Random workloads and devices under every policy combination: the simulator finds no
    /// violation (budget, eviction of a loading or executing expert, dependency order, batch
    /// size, exactly-once completion), and every request's output is the same under all four.
    #[test]
    fn every_policy_is_safe_and_gives_the_same_outputs(
        seed in any::<u64>(),
        requests in 1usize..40,
        window in prop::sample::select(vec![0u64, 1, 3, 16, 1 << 20]),
    ) {
        let mut rng = SmallRng::seed_from_u64(seed);
        let model_config = ModelConfig {
            roots: rng.random_range(1..=4),
            children_per_root: rng.random_range(0..=4),
            branching_share: rng.random(),
            grandchildren: rng.random_range(1..=3),
            min_bytes: 1_000,
            max_bytes: 20_000,
            zipf: 1.0,
            mean_selected: rng.random_range(0.5..2.5),
            host_bytes: rng.random_range(0..40_000),
        };
        let model = synthetic_model(&model_config, &mut rng).unwrap();
        let largest = model.experts().iter().map(|e| e.size_bytes).max().unwrap();
        let total = model.total_bytes();
        let arrivals = ArrivalConfig {
            requests,
            mean_gap: Micros(rng.random_range(1..5_000)),
            burst_prob: 0.3,
            burst_max: 6,
        };
        let trace = synthetic_trace(model, &arrivals, &mut rng);
        let profile = random_profile(&mut rng, largest, total);
        let latency = LatencyModel::from_profile(&profile).unwrap();
        let mut outputs = None;
        for config in SchedulerConfig::all() {
            let config = SchedulerConfig { window_tasks: window, ..config };
            let report = simulate(&trace, &latency, config, &SimOptions::default());
            let report = match report {
                Ok(r) => r,
                Err(e) => return Err(TestCaseError::fail(format!("{}: {e}", config.label()))),
            };
            prop_assert_eq!(report.requests, requests);
            for (e, peak) in report.peak_bytes.iter().enumerate() {
                prop_assert!(*peak <= latency.expert_budget(e));
            }
            match &outputs {
                None => outputs = Some(report.outputs.clone()),
                Some(first) => prop_assert_eq!(first, &report.outputs, "{} differs", config.label()),
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, failure_persistence: None, ..ProptestConfig::default() })]

    /// An executor lost mid-run (and maybe restored later) loses no request: every request
    /// still completes exactly once, with the same output as without the fault, and the
    /// simulator sees no rule broken while the work moves.
    #[test]
    fn losing_an_executor_loses_no_request(
        seed in any::<u64>(),
        requests in 1usize..40,
        at in 0u64..300_000,
        back_after in prop::option::of(0u64..300_000),
    ) {
        let mut rng = SmallRng::seed_from_u64(seed);
        let model = synthetic_model(&ModelConfig::ci_like(), &mut rng).unwrap();
        let largest = model.experts().iter().map(|e| e.size_bytes).max().unwrap();
        let total = model.total_bytes();
        let arrivals = ArrivalConfig { requests, mean_gap: Micros(2_000), burst_prob: 0.3, burst_max: 6 };
        let trace = synthetic_trace(model, &arrivals, &mut rng);
        let mut profile = random_profile(&mut rng, largest, total);
        if profile.executors.len() < 2 {
            let mut second = profile.executors[0].clone();
            second.name = "x1".into();
            profile.executors.push(second);
        }
        let latency = LatencyModel::from_profile(&profile).unwrap();
        let clean = simulate(&trace, &latency, SchedulerConfig::ours(), &SimOptions::default()).unwrap();
        // Executor 0 holds every expert, so losing executor 1 strands nothing.
        let fault = ExecutorFault { executor: 1, at: Micros(at), back_after: back_after.map(Micros) };
        for config in SchedulerConfig::all() {
            let options = SimOptions { fault: Some(fault), ..SimOptions::default() };
            let report = match simulate(&trace, &latency, config, &options) {
                Ok(r) => r,
                Err(e) => return Err(TestCaseError::fail(format!("{}: {e}", config.label()))),
            };
            prop_assert_eq!(&clean.outputs, &report.outputs, "{} differs", config.label());
        }
    }
}

/// Values that have broken parsers before: empty, signs, overflow, NaN, huge exponents.
const NASTY: &[&str] = &[
    "",
    "0",
    "-1",
    "1",
    "18446744073709551616",
    "4294967296",
    "NaN",
    "inf",
    "1e309",
    "x",
    "1:",
    ":1",
    "0:0",
    "65537:1",
    "parent",
    "host",
    "gpu",
    "select",
    "request",
    "expert",
    "#",
];

/// Edit a valid text: replace one token, drop a line, or repeat a line.
fn mutate(text: &str, line: usize, token: usize, nasty: usize, kind: u8) -> String {
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    let i = line % lines.len();
    match kind % 3 {
        0 => {
            let mut tokens: Vec<&str> = lines[i].split_whitespace().collect();
            if !tokens.is_empty() {
                let t = token % tokens.len();
                tokens[t] = NASTY[nasty % NASTY.len()];
            }
            lines[i] = tokens.join(" ");
        }
        1 => {
            lines.remove(i);
        }
        _ => {
            let copy = lines[i].clone();
            lines.insert(i, copy);
        }
    }
    lines.join("\n")
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

    /// Mangled profile and trace files are refused with an error, never a panic; whatever is
    /// accepted is valid.
    #[test]
    fn mangled_files_never_panic(
        edits in prop::collection::vec((any::<usize>(), any::<usize>(), any::<usize>(), any::<u8>()), 1..4),
    ) {
        let profile = crate::coe::synth::synthetic_edge_profile("fp", 1 << 20, 1 << 20).to_text();
        let trace = crate::coe::synth::synthetic_workload(
            &ModelConfig::ci_like(),
            &ArrivalConfig::saturating(5),
            1,
        )
        .unwrap()
        .to_text();
        let (mut p, mut t) = (profile, trace);
        for (line, token, nasty, kind) in edits {
            p = mutate(&p, line, token, nasty, kind);
            t = mutate(&t, line, token, nasty, kind);
        }
        if let Ok(parsed) = Profile::parse(&p) {
            prop_assert!(parsed.validate().is_ok());
            prop_assert!(LatencyModel::from_profile(&parsed).is_ok());
        }
        if let Ok(parsed) = crate::coe::trace::Trace::parse(&t) {
            prop_assert!(parsed.validate().is_ok());
        }
    }
}

//! Ours against FCFS+LRU (and each mechanism alone) on synthetic workloads in the simulator.

use crate::coe::latency::LatencyModel;
use crate::coe::scheduler::SchedulerConfig;
use crate::coe::sim::{SimOptions, SimReport, simulate, summary_line};
use crate::coe::synth::{ArrivalConfig, ModelConfig, synthetic_edge_profile, synthetic_workload};

/// Run the four combinations on one workload; print a table; return the reports (baseline first).
fn compare(
    model: &ModelConfig,
    arrivals: &ArrivalConfig,
    seed: u64,
    budget_share: f64,
    window: u64,
) -> Vec<SimReport> {
    let trace = synthetic_workload(model, arrivals, seed).unwrap();
    let total = trace.model.total_bytes();
    let gpu = (total as f64 * budget_share) as u64;
    let profile = synthetic_edge_profile("synthetic", gpu, gpu);
    let latency = LatencyModel::from_profile(&profile).unwrap();
    let reports: Vec<SimReport> = SchedulerConfig::combinations()
        .iter()
        .map(|c| SchedulerConfig { window_tasks: window, ..*c })
        .chain([
            SchedulerConfig { window_tasks: window, queue_aware_eviction: false, ..SchedulerConfig::ours() },
        ])
        .map(|c| simulate(&trace, &latency, c, &SimOptions::default()).unwrap())
        .collect();
    println!(
        "{} experts, {:.2} GB, budget {:.0}% = {} MB per executor, {} requests",
        trace.model.len(),
        total as f64 / 1e9,
        budget_share * 100.0,
        gpu >> 20,
        trace.requests.len()
    );
    for r in &reports {
        println!("{}", summary_line(r, &reports[0]));
        for (e, x) in r.per_executor.iter().enumerate() {
            println!(
                "    x{e}: loads {} batches {} tasks {} busy {:.1}s switch {:.1}s",
                x.loads,
                x.batches,
                x.tasks,
                x.busy.as_secs_f64(),
                x.switching.as_secs_f64()
            );
        }
    }
    reports
}

#[test]
#[ignore = "exploration; run with --release --ignored --nocapture"]
fn explore_paper_scale() {
    let w = SchedulerConfig::DEFAULT_WINDOW;
    for seed in [2, 3] {
        compare(&ModelConfig::paper_like(), &ArrivalConfig::saturating(20_000), seed, 0.05, w);
    }
    compare(&ModelConfig::paper_like(), &ArrivalConfig::saturating(100_000), 1, 0.075, w);
    compare(&ModelConfig::ci_like(), &ArrivalConfig::saturating(2_000), 1, 0.10, w);
}

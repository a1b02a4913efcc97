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
    with_plain_two_stage: bool,
) -> Vec<SimReport> {
    let trace = synthetic_workload(model, arrivals, seed).unwrap();
    let total = trace.model.total_bytes();
    let gpu = (total as f64 * budget_share) as u64;
    let profile = synthetic_edge_profile("synthetic", gpu, gpu);
    let latency = LatencyModel::from_profile(&profile).unwrap();
    let reports: Vec<SimReport> = SchedulerConfig::combinations()
        .iter()
        .map(|c| SchedulerConfig { window_tasks: window, ..*c })
        .chain(
            with_plain_two_stage
                .then_some(SchedulerConfig { window_tasks: window, ..SchedulerConfig::paper_two_stage() }),
        )
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
    for (i, r) in reports.iter().enumerate() {
        let note = if i == 4 { "  (ours, plain two stages: no queue hints)" } else { "" };
        println!("{}{note}", summary_line(r, &reports[0]));
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

/// Throughput of `report` over the baseline's.
fn ratio(report: &SimReport, baseline: &SimReport) -> f64 {
    report.throughput_rps / baseline.throughput_rps
}

#[test]
fn ours_beats_fcfs_lru_at_ci_scale() {
    let reports = compare(
        &ModelConfig::ci_like(),
        &ArrivalConfig::saturating(600),
        11,
        0.10,
        SchedulerConfig::DEFAULT_WINDOW,
        false,
    );
    let (baseline, ours) = (&reports[0], &reports[3]);
    println!("ci-like: ours / fcfs+lru throughput = {:.2}x", ratio(ours, baseline));
    assert!(ours.throughput_rps > baseline.throughput_rps);
}

#[test]
fn ours_beats_fcfs_lru_at_paper_scale() {
    // ~300 experts of 1-40 MB (about 3.5 GB), 7.5% of it fits per executor.
    let reports = compare(
        &ModelConfig::paper_like(),
        &ArrivalConfig::saturating(3_000),
        5,
        0.075,
        SchedulerConfig::DEFAULT_WINDOW,
        false,
    );
    let (baseline, ours) = (&reports[0], &reports[3]);
    println!("paper-like: ours / fcfs+lru throughput = {:.2}x", ratio(ours, baseline));
    assert!(ours.throughput_rps > baseline.throughput_rps);
}

/// The numbers for the report: `cargo test --release -p troupe-policy coe_scale_report --
/// --ignored --nocapture` (about a minute).
#[test]
#[ignore = "long; run in release with --ignored --nocapture"]
fn coe_scale_report() {
    let w = SchedulerConfig::DEFAULT_WINDOW;
    for window in [1_024, 4_096, w] {
        println!("window {window}");
        compare(&ModelConfig::paper_like(), &ArrivalConfig::saturating(20_000), 1, 0.075, window, true);
    }
    for (seed, share) in [(2, 0.05), (3, 0.10)] {
        compare(&ModelConfig::paper_like(), &ArrivalConfig::saturating(20_000), seed, share, w, true);
    }
    compare(&ModelConfig::paper_like(), &ArrivalConfig::saturating(100_000), 1, 0.075, w, true);
    compare(&ModelConfig::ci_like(), &ArrivalConfig::saturating(2_000), 1, 0.10, w, true);
    // Below saturation: latency matters more than throughput here.
    for gap_ms in [10, 40] {
        println!("paced arrivals, mean gap {gap_ms} ms, no bursts");
        let paced = ArrivalConfig {
            requests: 5_000,
            mean_gap: crate::Micros::from_millis(gap_ms),
            burst_prob: 0.0,
            burst_max: 2,
        };
        compare(&ModelConfig::paper_like(), &paced, 1, 0.075, w, false);
    }
}

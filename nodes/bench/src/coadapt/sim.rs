//! Simulated: the policy crate's seeded discrete-event simulator (paper-scale device and models,
//! `troupe_policy::adapt::sim`) for 1..K concurrent tasks: SLO attainment (gain >= 10 points
//! within 200 s), throughput, latency, fragmentation, utilisation, max concurrency at >= 90 %, and
//! each mechanism turned off in turn. Every figure it writes starts with `sim_`; none stands for a
//! measured one.

use std::collections::BTreeMap;

use troupe_policy::adapt::sim::{SimConfig, SimReport, Strategy, simulate};

use super::{REPORTED_K, SLO_RATIO};

/// Every simulated strategy's report at K = 1..=k_max.
pub type SimReports = BTreeMap<&'static str, Vec<SimReport>>;

/// Simulated sweep, ablations and `sim_` ratios.
pub fn simulated(k_max: usize, fig: &mut BTreeMap<String, f64>) -> SimReports {
    let cfg = SimConfig::default();
    let strategies: Vec<Strategy> = std::iter::once(Strategy::OURS).chain(Strategy::baselines()).collect();
    println!(
        "\n== simulated (sim_*): 1..{k_max} concurrent tasks, SLO = gain >= {:.0} points within {:.0} s (troupe_policy::adapt::sim, paper-scale device) ==",
        cfg.slo_gain * 100.0,
        cfg.slo_latency.as_secs_f64()
    );
    let mut reports: SimReports = BTreeMap::new();
    for s in &strategies {
        reports.insert(s.name, (1..=k_max).map(|k| simulate(s, k, &cfg)).collect());
    }
    let max_conc = |rs: &[SimReport]| rs.iter().take_while(|r| r.slo_attainment >= SLO_RATIO).count();
    println!(
        "{:<3} {:<10} {:>6} {:>9} {:>9} {:>7} {:>6}",
        "K", "strategy", "SLO", "thr/min", "lat s", "frag", "util"
    );
    for k in REPORTED_K.into_iter().filter(|&k| k <= k_max) {
        for s in &strategies {
            let r = &reports[s.name][k - 1];
            println!(
                "{k:<3} {:<10} {:>6.2} {:>9.2} {:>9.1} {:>7.3} {:>6.2}",
                r.strategy,
                r.slo_attainment,
                r.throughput_per_min,
                r.mean_latency_s,
                r.fragmentation,
                r.utilisation
            );
        }
    }
    for s in &strategies {
        for r in reports[s.name].iter().filter(|r| REPORTED_K.contains(&r.tasks)) {
            let p = format!("sim_k{}_{}", r.tasks, s.name);
            fig.insert(format!("{p}_slo_attainment"), r.slo_attainment);
            fig.insert(format!("{p}_throughput_per_min"), r.throughput_per_min);
            fig.insert(format!("{p}_mean_latency_s"), r.mean_latency_s);
            fig.insert(format!("{p}_fragmentation"), r.fragmentation);
            fig.insert(format!("{p}_utilisation"), r.utilisation);
        }
        fig.insert(format!("sim_max_concurrency_{}", s.name), max_conc(&reports[s.name]) as f64);
    }
    let ours = max_conc(&reports[Strategy::OURS.name]);
    let (best_mc, best_name) = Strategy::baselines()
        .iter()
        .map(|s| (max_conc(&reports[s.name]), s.name))
        .max()
        .unwrap_or((0, "none"));
    // Ratios at K = ours' max concurrency (the load ours still serves), against the best baseline there.
    let k_at = ours.max(1);
    let o = &reports[Strategy::OURS.name][k_at - 1];
    let best_at = |f: fn(&SimReport) -> f64, k: usize| {
        Strategy::baselines().iter().map(|s| f(&reports[s.name][k - 1])).fold(0.0, f64::max)
    };
    let slo_ratio = o.slo_attainment / best_at(|r| r.slo_attainment, k_at).max(1e-9);
    let thr_ratio = o.throughput_per_min / best_at(|r| r.throughput_per_min, k_at).max(1e-9);
    fig.insert("sim_max_concurrency_ours".into(), ours as f64);
    fig.insert("sim_max_concurrency_best_baseline".into(), best_mc as f64);
    fig.insert("sim_max_concurrency_ratio".into(), ours as f64 / best_mc.max(1) as f64);
    fig.insert("sim_ratios_at_k".into(), k_at as f64);
    fig.insert("sim_slo_attainment_over_best_baseline".into(), slo_ratio);
    fig.insert("sim_throughput_over_best_baseline".into(), thr_ratio);
    println!(
        "\nsim: max concurrency (>= {:.0}% SLO): ours {ours}, best baseline {best_name} {best_mc} ({:.2}x)",
        SLO_RATIO * 100.0,
        ours as f64 / best_mc.max(1) as f64
    );
    println!(
        "sim: at K = {k_at}: SLO attainment {slo_ratio:.2}x the best baseline, throughput {thr_ratio:.2}x"
    );
    // The same ratios pooled over every K: SLO-meeting tasks and summed throughput.
    let total = |name: &str, f: fn(&SimReport) -> f64| reports[name].iter().map(f).sum::<f64>();
    let met = |r: &SimReport| r.slo_met as f64;
    let thr = |r: &SimReport| r.throughput_per_min;
    let best_met = Strategy::baselines().iter().map(|s| total(s.name, met)).fold(0.0, f64::max);
    let best_thr_all = Strategy::baselines().iter().map(|s| total(s.name, thr)).fold(0.0, f64::max);
    let slo_all = total(Strategy::OURS.name, met) / best_met.max(1e-9);
    let thr_all = total(Strategy::OURS.name, thr) / best_thr_all.max(1e-9);
    fig.insert("sim_slo_attainment_over_best_baseline_all_k".into(), slo_all);
    fig.insert("sim_throughput_over_best_baseline_all_k".into(), thr_all);
    println!("sim: pooled over K = 1..{k_max}: SLO-meeting tasks {slo_all:.2}x, throughput {thr_all:.2}x");
    println!("\n== simulated: ablation at K = {k_at} (each mechanism off in turn) ==");
    for s in Strategy::ablations() {
        let r = simulate(&s, k_at, &cfg);
        let mc = (1..=k_max).take_while(|&k| simulate(&s, k, &cfg).slo_attainment >= SLO_RATIO).count();
        println!(
            "{:<11} SLO {:.2} thr {:>6.2}/min lat {:>7.1}s frag {:.3} util {:.2} max concurrency {mc}",
            s.name, r.slo_attainment, r.throughput_per_min, r.mean_latency_s, r.fragmentation, r.utilisation
        );
        let n = s.name.trim_start_matches('-').replace(['(', ')'], "_");
        fig.insert(format!("sim_ablation_{n}_slo_attainment"), r.slo_attainment);
        fig.insert(format!("sim_ablation_{n}_throughput_per_min"), r.throughput_per_min);
        fig.insert(format!("sim_ablation_{n}_fragmentation"), r.fragmentation);
        fig.insert(format!("sim_ablation_{n}_max_concurrency"), mc as f64);
    }
    reports
}

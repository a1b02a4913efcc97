//! `troupe bench coe`: FCFS+LRU against ours and each mechanism alone, and against our scheduling
//! with the paper's plain two-stage eviction (no queue lookahead), on one trace, on this machine,
//! in one run.
//!
//! At `--scale ci` every combination is served for real (ONNX Runtime sessions, `O_DIRECT`
//! loads, one thread per executor). At `--scale paper` serving 20k requests through ~300 real
//! experts does not fit a 2-core CI box, so the trace is replayed through the policy crate's
//! discrete-event simulator driven by the latency model *profiled on this machine* with real
//! loads and real batch runs; the output says so (`real_execution` = 0). `--real` serves every
//! combination for real at any scale (at paper scale FCFS+LRU alone takes about 15 minutes on
//! two cores). Figures of a simulated run carry the prefix `sim_` (all but `real_execution`).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use troupe_actors::coe::app::{App, Scale};
use troupe_actors::coe::profiler;
use troupe_actors::coe::runner::{RunOptions, run_local};
use troupe_policy::coe::{LatencyModel, SchedulerConfig, SimOptions, simulate};

use crate::workloads::coe as cmd;

/// One policy combination's figures.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// Label (`fcfs+lru`, `sched-only`, `evict-only`, `paper-two-stage`, `ours`).
    pub label: &'static str,
    /// Requests per second.
    pub throughput: f64,
    /// Expert loads.
    pub loads: u64,
    /// Loads over Belady's MIN on the same served order.
    pub loads_over_belady: f64,
    /// Share of busy time spent loading.
    pub switch_share: f64,
    /// Median latency, ms.
    pub p50_ms: f64,
    /// 99th percentile latency, ms.
    pub p99_ms: f64,
    /// Seconds executors spent running batches (busy minus switching), summed.
    pub compute_s: f64,
}

/// Run the benchmark; returns the flat figures. Writes the SVG to `svg`.
pub fn run(
    scale_name: &str,
    dir: Option<PathBuf>,
    svg: &Path,
    force_real: bool,
) -> Result<BTreeMap<String, f64>> {
    let scale = cmd::scale(scale_name)?;
    let dir = cmd::app_dir(scale, dir);
    if !dir.join("app.txt").is_file() {
        cmd::gen_app(&dir, scale, 1)?;
    }
    let profile_path = dir.join("profile.txt");
    if !profile_path.is_file() {
        cmd::profile_app(&dir, &profile_path)?;
    }
    let profile = profiler::load_profile(&profile_path)
        .with_context(|| "re-run `troupe coe profile` on this machine (or delete the file)".to_string())?;
    let latency = LatencyModel::from_profile(&profile)?;
    let app = std::sync::Arc::new(App::open(&dir, None)?);
    let real = force_real || scale == Scale::Ci;
    let mut rows = Vec::new();
    let mut digests: Option<Vec<u64>> = None;
    let mut identical = true;
    for config in compared() {
        let row = if real {
            let options =
                RunOptions { deadline: std::time::Duration::from_secs(3 * 3600), ..RunOptions::new(config) };
            let r = run_local(&app, &latency, &options)?;
            println!("{}", cmd::run_line(&r));
            match &digests {
                None => digests = Some(r.digests.clone()),
                Some(d) => identical &= *d == r.digests,
            }
            Row {
                label: r.label,
                throughput: r.throughput_rps,
                loads: r.loads,
                loads_over_belady: r.loads_over_belady(),
                switch_share: r.switch_share(),
                p50_ms: r.p50_ms,
                p99_ms: r.p99_ms,
                compute_s: r.busy_s - r.switch_s,
            }
        } else {
            let r = simulate(&app.trace, &latency, config, &SimOptions::default())?;
            match &digests {
                None => digests = Some(r.outputs.clone()),
                Some(d) => identical &= *d == r.outputs,
            }
            let row = Row {
                label: r.label,
                throughput: r.throughput_rps,
                loads: r.loads,
                loads_over_belady: r.loads_over_belady(),
                switch_share: r.switch_share,
                p50_ms: r.latency_p50.0 as f64 / 1e3,
                p99_ms: r.latency_p99.0 as f64 / 1e3,
                compute_s: r.busy.0.saturating_sub(r.switching.0) as f64 / 1e6,
            };
            println!(
                "{:<15} {:>7.1} req/s  loads {:>5} ({:.2}x belady)  switching {:>4.1}%  p50 {:>7.1} ms  p99 {:>7.1} ms  [simulated, profiled latencies]",
                row.label,
                row.throughput,
                row.loads,
                row.loads_over_belady,
                100.0 * row.switch_share,
                row.p50_ms,
                row.p99_ms
            );
            row
        };
        rows.push(row);
    }
    if !identical {
        bail!("request outputs differ between policies");
    }
    let mut f = policy_figures(&rows, real);
    f.insert("requests".into(), app.trace.requests.len() as f64);
    f.insert("experts".into(), app.trace.model.len() as f64);
    f.insert("expert_bytes_total".into(), app.trace.model.total_bytes() as f64);
    if let Some(ours) = rows.iter().find(|r| r.label == "ours") {
        // The floor of the switching share on this trace: every expert it uses loaded exactly
        // once (at the first executor's profiled bandwidth), against ours' compute time.
        let mut used = std::collections::BTreeSet::new();
        for r in &app.trace.requests {
            used.extend(r.experts());
        }
        let once: f64 = used
            .iter()
            .filter_map(|e| app.trace.model.expert(*e))
            .map(|e| latency.load_time(0, e.size_bytes, e.home).0 as f64 / 1e6)
            .sum();
        f.insert(
            format!("{}switch_share_floor_one_load_each", prefix(real)),
            once / (once + ours.compute_s).max(1e-9),
        );
    }
    let title = format!(
        "troupe bench coe --scale {} ({}; executors {})",
        scale.name(),
        if real { "real execution" } else { "simulated with latencies profiled on this machine" },
        profile.executors.iter().map(|e| e.name.as_str()).collect::<Vec<_>>().join(", ")
    );
    crate::workloads::coe::app_write(svg, &svg_plot(&title, &rows))?;
    println!("plot written to {}", svg.display());
    Ok(f)
}

/// Key prefix of the policy figures: none for real execution, `sim_` for the simulator's.
fn prefix(real: bool) -> &'static str {
    if real { "" } else { "sim_" }
}

/// The per-combination figures (`{label}_*`, labels with `+` and `-` as `_`), the headline ratios
/// over the first row (FCFS+LRU) and `real_execution`. Ours gives `throughput_over_fcfs_lru` and
/// the unprefixed summary; our scheduling with the paper's plain two stages gives
/// `paper_two_stage_over_fcfs_lru`. Every key but `real_execution` starts with `sim_` when the
/// rows come from the simulator.
pub fn policy_figures(rows: &[Row], real: bool) -> BTreeMap<String, f64> {
    let p = prefix(real);
    let base = rows.first().map_or(1.0, |r| r.throughput.max(1e-9));
    let mut f = BTreeMap::new();
    f.insert("real_execution".into(), if real { 1.0 } else { 0.0 });
    f.insert(format!("{p}outputs_identical"), 1.0);
    for r in rows {
        let k = r.label.replace(['+', '-'], "_");
        f.insert(format!("{p}{k}_throughput_rps"), r.throughput);
        f.insert(format!("{p}{k}_over_fcfs_lru"), r.throughput / base);
        f.insert(format!("{p}{k}_loads"), r.loads as f64);
        f.insert(format!("{p}{k}_loads_over_belady"), r.loads_over_belady);
        f.insert(format!("{p}{k}_switch_share"), r.switch_share);
        f.insert(format!("{p}{k}_p50_latency_ms"), r.p50_ms);
        f.insert(format!("{p}{k}_p99_latency_ms"), r.p99_ms);
    }
    if let Some(paper) = rows.iter().find(|r| r.label == SchedulerConfig::paper_two_stage().label()) {
        f.insert(format!("{p}paper_two_stage_over_fcfs_lru"), paper.throughput / base);
    }
    if let Some(ours) = rows.iter().find(|r| r.label == SchedulerConfig::ours().label()) {
        f.insert(format!("{p}throughput_over_fcfs_lru"), ours.throughput / base);
        f.insert(format!("{p}loads_over_belady"), ours.loads_over_belady);
        f.insert(format!("{p}switch_share"), ours.switch_share);
        f.insert(format!("{p}p50_latency_ms"), ours.p50_ms);
        f.insert(format!("{p}p99_latency_ms"), ours.p99_ms);
    }
    f
}

/// The combinations the benchmark serves, baseline first: the four of the ablation with our
/// scheduling and the paper's plain two stages before ours.
pub fn compared() -> [SchedulerConfig; 5] {
    let [fcfs_lru, sched_only, evict_only, ours] = SchedulerConfig::combinations();
    [fcfs_lru, sched_only, evict_only, SchedulerConfig::paper_two_stage(), ours]
}

/// A hand-made SVG: throughput over FCFS+LRU and loads over Belady per combination.
pub fn svg_plot(title: &str, rows: &[Row]) -> String {
    let base = rows.first().map_or(1.0, |r| r.throughput.max(1e-9));
    let (w, h, left, top, bar_h, gap) =
        (760.0, 60.0 + rows.len() as f64 * 2.0 * 34.0 + 40.0, 130.0, 50.0, 24.0, 10.0);
    let max_ratio = rows.iter().map(|r| r.throughput / base).fold(1.0, f64::max);
    let max_belady = rows.iter().map(|r| r.loads_over_belady).fold(1.0, f64::max);
    let scale = (w - left - 120.0) / max_ratio.max(max_belady);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<text x="10" y="20" font-size="14">{}</text>"#, escape(title));
    let _ = writeln!(
        s,
        r##"<rect x="{left}" y="30" width="12" height="12" fill="#3a7"/><text x="{}" y="41">throughput / FCFS+LRU</text><rect x="{}" y="30" width="12" height="12" fill="#c63"/><text x="{}" y="41">loads / Belady MIN</text>"##,
        left + 16.0,
        left + 200.0,
        left + 216.0
    );
    for (i, r) in rows.iter().enumerate() {
        let y = top + i as f64 * (2.0 * bar_h + gap + 10.0);
        let ratio = r.throughput / base;
        let _ = writeln!(s, r#"<text x="10" y="{}">{}</text>"#, y + bar_h, escape(r.label));
        let _ = writeln!(
            s,
            r##"<rect x="{left}" y="{y}" width="{:.1}" height="{bar_h}" fill="#3a7"/><text x="{:.1}" y="{:.1}">{ratio:.2}x</text>"##,
            ratio * scale,
            left + ratio * scale + 4.0,
            y + 16.0
        );
        let y2 = y + bar_h + 2.0;
        let _ = writeln!(
            s,
            r##"<rect x="{left}" y="{y2}" width="{:.1}" height="{bar_h}" fill="#c63"/><text x="{:.1}" y="{:.1}">{:.2}x ({:.0}% switching)</text>"##,
            r.loads_over_belady * scale,
            left + r.loads_over_belady * scale + 4.0,
            y2 + 16.0,
            r.loads_over_belady,
            100.0 * r.switch_share
        );
    }
    s.push_str("</svg>\n");
    s
}

fn escape(t: &str) -> String {
    t.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(label: &'static str, throughput: f64) -> Row {
        Row {
            label,
            throughput,
            loads: 10,
            loads_over_belady: 1.5,
            switch_share: 0.5,
            p50_ms: 1.0,
            p99_ms: 2.0,
            compute_s: 1.0,
        }
    }

    fn rows() -> Vec<Row> {
        compared().iter().zip([10.0, 20.0, 15.0, 30.0, 40.0]).map(|(c, t)| row(c.label(), t)).collect()
    }

    #[test]
    fn both_two_stage_variants_are_reported_over_fcfs_lru() {
        let labels: Vec<&str> = compared().iter().map(|c| c.label()).collect();
        assert_eq!(labels, ["fcfs+lru", "sched-only", "evict-only", "paper-two-stage", "ours"]);
        let f = policy_figures(&rows(), true);
        assert_eq!(f["paper_two_stage_over_fcfs_lru"], 3.0);
        assert_eq!(f["throughput_over_fcfs_lru"], 4.0);
        assert_eq!(f["ours_over_fcfs_lru"], 4.0);
        assert_eq!(f["fcfs_lru_over_fcfs_lru"], 1.0);
        assert_eq!(f["real_execution"], 1.0);
        assert!(f.keys().all(|k| !k.starts_with("sim_")));
    }

    #[test]
    fn simulated_figures_carry_the_sim_prefix() {
        let f = policy_figures(&rows(), false);
        assert_eq!(f["sim_paper_two_stage_over_fcfs_lru"], 3.0);
        assert_eq!(f["sim_throughput_over_fcfs_lru"], 4.0);
        assert_eq!(f["real_execution"], 0.0);
        assert!(f.keys().all(|k| k == "real_execution" || k.starts_with("sim_")), "{f:?}");
    }
}

//! Workload knobs and the budget x skew sweep (`troupe bench coe --sweep`), pure.
//!
//! The experts of a CoE app are expensive to make (ONNX files, pre-assessed selections); the
//! knobs that matter most to the policies are not in them. Device and host budgets (fractions of
//! all expert bytes), the Zipf skew of the mix over entry experts and the arrival rate only
//! change the trace and the executors' budgets, so [`reshape`] derives a trace at any such point
//! from one app's trace: the roots get Zipf shares by their popularity rank, the host tier is
//! refilled by usage, and requests are redrawn (seeded) from the app's own recorded walks, so
//! every selection is still one the real experts made.

use std::collections::BTreeMap;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::model::{CoeModel, ExpertId, ExpertSpec, ModelError, RequestId, Tier};
use super::profile::Profile;
use super::trace::{Trace, TraceRequest};
use crate::Micros;

/// Budgets of the sweep, as fractions of all expert bytes.
pub const SWEEP_BUDGETS: [f64; 4] = [0.05, 0.10, 0.20, 0.40];
/// Zipf skews of the sweep.
pub const SWEEP_SKEWS: [f64; 3] = [0.6, 1.0, 1.4];

/// Why a knob was refused.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum KnobError {
    /// A budget fraction outside (0, 1].
    #[error("{name} = {value}: a fraction of all expert bytes must be in (0, 1]")]
    Fraction {
        /// The knob.
        name: &'static str,
        /// The value given.
        value: f64,
    },
    /// A knob that must be a finite number above zero (or at least zero).
    #[error("{name} = {value}: {problem}")]
    Range {
        /// The knob.
        name: &'static str,
        /// The value given.
        value: f64,
        /// What it must be.
        problem: &'static str,
    },
    /// The reshaped model is refused.
    #[error("reshaping the model: {0}")]
    Model(#[from] ModelError),
    /// The trace has no requests to redraw from.
    #[error("the trace has no requests to redraw from")]
    EmptyTrace,
}

/// Check a budget fraction: in (0, 1].
pub fn check_fraction(name: &'static str, value: f64) -> Result<f64, KnobError> {
    if value.is_finite() && value > 0.0 && value <= 1.0 {
        Ok(value)
    } else {
        Err(KnobError::Fraction { name, value })
    }
}

/// Check a Zipf skew: finite and >= 0 (0 is a uniform mix).
pub fn check_skew(value: f64) -> Result<f64, KnobError> {
    if value.is_finite() && value >= 0.0 {
        Ok(value)
    } else {
        Err(KnobError::Range { name: "zipf", value, problem: "must be a finite number >= 0" })
    }
}

/// Check an arrival rate: finite and > 0 requests per second.
pub fn check_rate(value: f64) -> Result<f64, KnobError> {
    if value.is_finite() && value > 0.0 {
        Ok(value)
    } else {
        Err(KnobError::Range { name: "rate", value, problem: "must be a finite number of requests/s > 0" })
    }
}

/// Bursty Poisson arrivals at a given mean request rate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Arrivals {
    /// Mean requests per second.
    pub rate_rps: f64,
    /// Probability an arrival event is a burst.
    pub burst_prob: f64,
    /// Largest burst (bursts are uniform in 2..=burst_max).
    pub burst_max: usize,
}

impl Arrivals {
    /// Mean requests per arrival event.
    pub fn mean_burst(&self) -> f64 {
        let max = self.burst_max.max(2) as f64;
        (1.0 - self.burst_prob) + self.burst_prob * (2.0 + max) / 2.0
    }

    /// Mean gap between arrival events that gives `rate_rps`.
    pub fn mean_gap(&self) -> Micros {
        Micros((1e6 * self.mean_burst() / self.rate_rps.max(1e-9)).round().max(1.0) as u64)
    }

    /// The rate that a mean event gap gives.
    pub fn rate_of_gap(mean_gap: Micros, burst_prob: f64, burst_max: usize) -> f64 {
        let a = Arrivals { rate_rps: 1.0, burst_prob, burst_max };
        1e6 * a.mean_burst() / (mean_gap.0.max(1) as f64)
    }
}

/// One point of the knob space a trace is reshaped to.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Point {
    /// Zipf skew of the mix over entry experts.
    pub zipf: f64,
    /// Bytes of the most used experts homed in host memory, as a fraction of all expert bytes.
    pub host_budget: f64,
    /// The arrival process.
    pub arrivals: Arrivals,
    /// Requests to draw.
    pub requests: usize,
    /// Seed of the redraw.
    pub seed: u64,
}

/// Zipf shares 1/(rank+1)^s, normalised, for `n` items.
pub fn zipf_shares(n: usize, s: f64) -> Vec<f64> {
    let w: Vec<f64> = (0..n).map(|i| 1.0 / ((i + 1) as f64).powf(s)).collect();
    let total: f64 = w.iter().sum();
    w.iter().map(|x| x / total).collect()
}

/// The roots of `model` from most to least popular (ties by id).
pub fn roots_by_rank(model: &CoeModel) -> Vec<ExpertId> {
    let mut roots: Vec<(ExpertId, f64)> = model.roots().map(|e| (e.id, e.select_prob)).collect();
    roots.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    roots.into_iter().map(|r| r.0).collect()
}

/// `specs` with the most used experts (by `model`'s usage probabilities) homed in host memory up
/// to `host_bytes`, the rest on SSD.
pub fn assign_homes(model: &CoeModel, host_bytes: u64) -> Vec<ExpertSpec> {
    let mut specs = model.specs();
    let mut by_usage: Vec<usize> = (0..specs.len()).collect();
    by_usage.sort_by(|&a, &b| {
        let (ea, eb) = (&model.experts()[a], &model.experts()[b]);
        eb.usage_prob.total_cmp(&ea.usage_prob).then(a.cmp(&b))
    });
    let mut host = 0u64;
    for i in by_usage {
        if host + specs[i].size_bytes <= host_bytes {
            host += specs[i].size_bytes;
            specs[i].home = Tier::Host;
        } else {
            specs[i].home = Tier::Ssd;
        }
    }
    specs
}

/// `trace` reshaped to `point`: roots' shares Zipf(`point.zipf`) by their current popularity
/// rank, homes refilled by usage under the host budget, and `point.requests` requests drawn at
/// `point.arrivals`, each reusing (input and selections) a uniformly drawn request of `trace`
/// with the drawn root. A root no request of `trace` enters is never drawn.
pub fn reshape(trace: &Trace, point: &Point) -> Result<Trace, KnobError> {
    check_skew(point.zipf)?;
    check_fraction("host_budget", point.host_budget)?;
    check_rate(point.arrivals.rate_rps)?;
    if trace.requests.is_empty() {
        return Err(KnobError::EmptyTrace);
    }
    let ranked = roots_by_rank(&trace.model);
    let shares = zipf_shares(ranked.len(), point.zipf);
    let mut specs = trace.model.specs();
    for (root, share) in ranked.iter().zip(&shares) {
        specs[root.index()].select_prob = *share;
    }
    let skewed = CoeModel::new(specs)?;
    let host_bytes = (point.host_budget * skewed.total_bytes() as f64) as u64;
    let model = CoeModel::new(assign_homes(&skewed, host_bytes))?;
    let mut walks: BTreeMap<ExpertId, Vec<&TraceRequest>> = BTreeMap::new();
    for r in &trace.requests {
        walks.entry(r.root).or_default().push(r);
    }
    let drawable: Vec<(ExpertId, f64)> = ranked
        .iter()
        .zip(&shares)
        .filter(|(root, _)| walks.contains_key(root))
        .map(|(root, share)| (*root, *share))
        .collect();
    let total: f64 = drawable.iter().map(|d| d.1).sum();
    let mut rng = SmallRng::seed_from_u64(point.seed);
    let gap = point.arrivals.mean_gap().0 as f64;
    let mut requests = Vec::with_capacity(point.requests);
    let mut now = 0u64;
    while requests.len() < point.requests {
        let u: f64 = rng.random();
        now += (-(1.0 - u).ln() * gap).round() as u64;
        let burst = if rng.random::<f64>() < point.arrivals.burst_prob {
            rng.random_range(2..=point.arrivals.burst_max.max(2))
        } else {
            1
        };
        for _ in 0..burst {
            if requests.len() >= point.requests {
                break;
            }
            let mut x = rng.random::<f64>() * total;
            let mut root = drawable[drawable.len() - 1].0;
            for (id, p) in &drawable {
                if x < *p {
                    root = *id;
                    break;
                }
                x -= p;
            }
            let pool = &walks[&root];
            let from = pool[rng.random_range(0..pool.len())];
            requests.push(TraceRequest {
                id: RequestId(requests.len() as u64),
                arrival: Micros(now),
                input: from.input,
                root,
                selections: from.selections.clone(),
            });
        }
    }
    Ok(Trace { model, requests })
}

/// Bytes a budget fraction names, but never below the largest expert (an executor must be able
/// to hold any one expert). Returns the bytes and the fraction they really are.
pub fn budget_bytes(model: &CoeModel, fraction: f64) -> (u64, f64) {
    let total = model.total_bytes();
    let largest = model.experts().iter().map(|e| e.size_bytes).max().unwrap_or(0);
    let bytes = ((fraction * total as f64) as u64).max(largest);
    (bytes, bytes as f64 / total.max(1) as f64)
}

/// `profile` with executor 0 (the device) given `device_bytes` of expert memory and every other
/// executor the same bytes times its own share relative to executor 0 in `profile` (so the
/// device : CPU ratio of the profiled plan is kept). Memory beyond expert memory grows with it.
pub fn with_device_budget(profile: &Profile, device_bytes: u64) -> Profile {
    let mut p = profile.clone();
    let base = profile.executors.first().map_or(1, |e| e.expert_memory_bytes.max(1)) as f64;
    for e in &mut p.executors {
        let bytes = (device_bytes as f64 * e.expert_memory_bytes as f64 / base).round() as u64;
        let extra = e.memory_bytes.saturating_sub(e.expert_memory_bytes);
        e.expert_memory_bytes = bytes.max(1);
        e.memory_bytes = e.expert_memory_bytes + extra;
    }
    p
}

/// The key of a sweep point: `b10_s1.0` for 10% and skew 1.0.
pub fn point_key(budget: f64, skew: f64) -> String {
    format!("b{}_s{skew:.1}", (budget * 100.0).round() as u64)
}

/// What one sweep point measured.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PointResult {
    /// Device budget, fraction of all expert bytes (as asked).
    pub budget: f64,
    /// The fraction really given (raised to hold the largest expert).
    pub effective_budget: f64,
    /// Zipf skew.
    pub skew: f64,
    /// Throughput of FCFS+LRU, requests/s.
    pub fcfs_lru_rps: f64,
    /// Ours (two-stage+lookahead) over FCFS+LRU.
    pub ours_over_fcfs_lru: f64,
    /// The paper's two-stage over FCFS+LRU.
    pub paper_over_fcfs_lru: f64,
    /// Ours' loads over Belady's MIN.
    pub ours_loads_over_belady: f64,
    /// The paper's two-stage loads over Belady's MIN.
    pub paper_loads_over_belady: f64,
    /// Whether the point was executed for real (else simulated).
    pub real: bool,
}

/// Flat figures of a sweep: per point `{sim_}sweep_<key>_{ratio_over_fcfs_lru,
/// paper_ratio_over_fcfs_lru, loads_over_belady, paper_loads_over_belady, effective_budget,
/// fcfs_lru_rps}` and the headline `sweep_min_ratio_over_fcfs_lru` (ours, lowest over points)
/// and `sweep_max_loads_over_belady` (ours, highest), prefixed `sim_` unless every point was
/// executed for real.
pub fn sweep_figures(points: &[PointResult]) -> BTreeMap<String, f64> {
    let mut f = BTreeMap::new();
    for p in points {
        let pre = if p.real { "" } else { "sim_" };
        let k = point_key(p.budget, p.skew);
        f.insert(format!("{pre}sweep_{k}_ratio_over_fcfs_lru"), p.ours_over_fcfs_lru);
        f.insert(format!("{pre}sweep_{k}_paper_ratio_over_fcfs_lru"), p.paper_over_fcfs_lru);
        f.insert(format!("{pre}sweep_{k}_loads_over_belady"), p.ours_loads_over_belady);
        f.insert(format!("{pre}sweep_{k}_paper_loads_over_belady"), p.paper_loads_over_belady);
        f.insert(format!("{pre}sweep_{k}_effective_budget"), p.effective_budget);
        f.insert(format!("{pre}sweep_{k}_fcfs_lru_rps"), p.fcfs_lru_rps);
    }
    if !points.is_empty() {
        let pre = if points.iter().all(|p| p.real) { "" } else { "sim_" };
        let min = points.iter().map(|p| p.ours_over_fcfs_lru).fold(f64::INFINITY, f64::min);
        let max = points.iter().map(|p| p.ours_loads_over_belady).fold(0.0, f64::max);
        f.insert(format!("{pre}sweep_min_ratio_over_fcfs_lru"), min);
        f.insert(format!("{pre}sweep_max_loads_over_belady"), max);
        f.insert(format!("{pre}sweep_points"), points.len() as f64);
    }
    f
}

/// A text table of a sweep, one row per point.
pub fn sweep_table(points: &[PointResult]) -> String {
    use std::fmt::Write as _;
    let mut s = String::from(
        "budget (given)  skew  fcfs+lru req/s  ours/fcfs  paper/fcfs  ours loads/MIN  paper loads/MIN  run\n",
    );
    for p in points {
        let _ = writeln!(
            s,
            "{:>4.0}% ({:>4.1}%)  {:>4.1}  {:>14.1}  {:>8.2}x  {:>9.2}x  {:>13.2}x  {:>14.2}x  {}",
            100.0 * p.budget,
            100.0 * p.effective_budget,
            p.skew,
            p.fcfs_lru_rps,
            p.ours_over_fcfs_lru,
            p.paper_over_fcfs_lru,
            p.ours_loads_over_belady,
            p.paper_loads_over_belady,
            if p.real { "real" } else { "simulated" }
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coe::synth::{ArrivalConfig, ModelConfig, synthetic_edge_profile, synthetic_workload};
    use crate::coe::{LatencyModel, SchedulerConfig, SimOptions, simulate};

    fn base() -> Trace {
        synthetic_workload(&ModelConfig::ci_like(), &ArrivalConfig::saturating(400), 11).unwrap()
    }

    fn point(zipf: f64, rate_rps: f64, requests: usize) -> Point {
        Point {
            zipf,
            host_budget: 0.2,
            arrivals: Arrivals { rate_rps, burst_prob: 0.2, burst_max: 16 },
            requests,
            seed: 5,
        }
    }

    #[test]
    fn fractions_outside_zero_one_are_refused() {
        for bad in [0.0, -0.1, 1.01, f64::NAN, f64::INFINITY] {
            assert!(matches!(check_fraction("device_budget", bad), Err(KnobError::Fraction { .. })), "{bad}");
        }
        assert_eq!(check_fraction("device_budget", 1.0), Ok(1.0));
        assert!(check_skew(-1.0).is_err() && check_rate(0.0).is_err());
    }

    #[test]
    fn reshaped_trace_honours_skew_and_rate_within_a_band() {
        // 20k requests on a fixed seed: each root's share within 0.02 of its Zipf share, and
        // the mean rate within 5% of the asked one.
        let t = base();
        for zipf in [0.6, 1.4] {
            let r = reshape(&t, &point(zipf, 2_000.0, 20_000)).unwrap();
            r.validate().unwrap();
            let ranked = roots_by_rank(&t.model);
            let shares = zipf_shares(ranked.len(), zipf);
            for (root, share) in ranked.iter().zip(&shares) {
                let got = r.requests.iter().filter(|q| q.root == *root).count() as f64 / 20_000.0;
                assert!((got - share).abs() < 0.02, "zipf {zipf}: {root} {got} vs {share}");
                assert!((r.model.expert(*root).unwrap().select_prob - share).abs() < 1e-12);
            }
            let span = r.requests.last().unwrap().arrival.0 as f64 / 1e6;
            let rate = 20_000.0 / span;
            assert!((rate / 2_000.0 - 1.0).abs() < 0.05, "rate {rate}");
        }
    }

    #[test]
    fn reshape_is_seeded_and_keeps_recorded_walks() {
        let t = base();
        let a = reshape(&t, &point(1.0, 1_000.0, 300)).unwrap();
        assert_eq!(a, reshape(&t, &point(1.0, 1_000.0, 300)).unwrap());
        for r in &a.requests {
            assert!(
                t.requests
                    .iter()
                    .any(|o| o.root == r.root && o.input == r.input && o.selections == r.selections)
            );
        }
        let host: u64 = a.model.experts().iter().filter(|e| e.home == Tier::Host).map(|e| e.size_bytes).sum();
        assert!(host as f64 <= 0.2 * a.model.total_bytes() as f64);
    }

    /// The tiny grid on the simulator (deterministic): ours never loses to FCFS+LRU.
    #[test]
    fn tiny_sweep_ours_at_least_fcfs_lru_everywhere() {
        let t = base();
        let profile = synthetic_edge_profile("synthetic", 64 << 20, 96 << 20);
        let mut points = Vec::new();
        for budget in [0.1, 0.4] {
            for skew in [0.6, 1.4] {
                let trace = reshape(&t, &point(skew, 20_000.0, 400)).unwrap();
                let (bytes, effective) = budget_bytes(&trace.model, budget);
                let latency = LatencyModel::from_profile(&with_device_budget(&profile, bytes)).unwrap();
                let run = |c: SchedulerConfig| simulate(&trace, &latency, c, &SimOptions::default()).unwrap();
                let (base, paper, ours) = (
                    run(SchedulerConfig::fcfs_lru()),
                    run(SchedulerConfig::paper_two_stage()),
                    run(SchedulerConfig::ours()),
                );
                points.push(PointResult {
                    budget,
                    effective_budget: effective,
                    skew,
                    fcfs_lru_rps: base.throughput_rps,
                    ours_over_fcfs_lru: ours.throughput_rps / base.throughput_rps,
                    paper_over_fcfs_lru: paper.throughput_rps / base.throughput_rps,
                    ours_loads_over_belady: ours.loads_over_belady(),
                    paper_loads_over_belady: paper.loads_over_belady(),
                    real: false,
                });
            }
        }
        let f = sweep_figures(&points);
        for p in &points {
            assert!(p.ours_over_fcfs_lru >= 1.0, "{}", sweep_table(&points));
        }
        assert!(f["sim_sweep_min_ratio_over_fcfs_lru"] >= 1.0);
        assert!(f.contains_key("sim_sweep_b10_s1.4_ratio_over_fcfs_lru"), "{f:?}");
    }
}

//! Seeded synthetic CoE workloads: a model shaped like the paper's circuit-board inspection
//! application (component classifiers selecting per-component defect experts, some of which
//! select further checks), bursty Poisson arrivals with a skewed mix over entry experts, and a
//! profile of a made-up edge box (one GPU, one CPU executor) for tests and benchmarks.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::model::{CoeModel, ExpertId, ExpertSpec, ModelError, RequestId, Tier};
use super::profile::{ExecutorKind, ExecutorProfile, LatencyPoint, Profile, SizeClass};
use super::trace::{Trace, TraceRequest};
use crate::Micros;

/// Shape of a synthetic three-level model.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// Preliminary (entry) experts.
    pub roots: usize,
    /// Subsequent experts under each root.
    pub children_per_root: usize,
    /// Share of those subsequent experts that have a third level under them.
    pub branching_share: f64,
    /// Third-level experts under each branching subsequent expert.
    pub grandchildren: usize,
    /// Smallest expert, bytes (sizes are log-uniform between min and max).
    pub min_bytes: u64,
    /// Largest expert, bytes.
    pub max_bytes: u64,
    /// Zipf exponent of the mix over roots (and over siblings' selection weights).
    pub zipf: f64,
    /// Expected number of children a parent selects.
    pub mean_selected: f64,
    /// Bytes of the most used experts that live in host memory; the rest live on SSD.
    pub host_bytes: u64,
}

impl ModelConfig {
    /// About 300 experts of 1-40 MB (several GB in all), as in the paper's application.
    pub fn paper_like() -> Self {
        ModelConfig {
            roots: 20,
            children_per_root: 9,
            branching_share: 1.0 / 3.0,
            grandchildren: 2,
            min_bytes: 1 << 20,
            max_bytes: 40 << 20,
            zipf: 1.0,
            mean_selected: 1.2,
            host_bytes: 1 << 30,
        }
    }

    /// A small model for quick tests: about 40 experts.
    pub fn ci_like() -> Self {
        ModelConfig {
            roots: 6,
            children_per_root: 4,
            branching_share: 0.25,
            grandchildren: 2,
            min_bytes: 1 << 20,
            max_bytes: 16 << 20,
            zipf: 1.0,
            mean_selected: 1.2,
            host_bytes: 32 << 20,
        }
    }
}

/// Zipf weights 1/(rank+1)^s for `n` items.
fn zipf_weights(n: usize, s: f64) -> Vec<f64> {
    (0..n).map(|i| 1.0 / ((i + 1) as f64).powf(s)).collect()
}

/// Probabilities `mean * w / sum(w)`, each capped at 1.
fn selection_probs(n: usize, zipf: f64, mean: f64) -> Vec<f64> {
    let w = zipf_weights(n, zipf);
    let total: f64 = w.iter().sum();
    w.iter().map(|x| (mean * x / total).min(1.0)).collect()
}

fn shuffle<T>(items: &mut [T], rng: &mut SmallRng) {
    for i in (1..items.len()).rev() {
        let j = rng.random_range(0..=i);
        items.swap(i, j);
    }
}

/// Build a model per `config`, sizes and sibling order drawn from `rng`.
pub fn synthetic_model(config: &ModelConfig, rng: &mut SmallRng) -> Result<CoeModel, ModelError> {
    let log_min = (config.min_bytes.max(1) as f64).ln();
    let log_max = (config.max_bytes.max(config.min_bytes).max(1) as f64).ln();
    let size = |rng: &mut SmallRng| -> u64 {
        let x: f64 = rng.random();
        (log_min + x * (log_max - log_min)).exp().round().max(1.0) as u64
    };
    let mut specs: Vec<ExpertSpec> = Vec::new();
    // Roots: Zipf mix, shuffled so popularity is independent of id.
    let mut root_probs = zipf_weights(config.roots, config.zipf);
    let total: f64 = root_probs.iter().sum();
    root_probs.iter_mut().for_each(|p| *p /= total);
    shuffle(&mut root_probs, rng);
    for p in root_probs {
        specs.push(ExpertSpec { size_bytes: size(rng), select_prob: p, home: Tier::Ssd, parent: None });
    }
    let mut level2 = Vec::new();
    for root in 0..config.roots {
        let mut probs = selection_probs(config.children_per_root, config.zipf, config.mean_selected);
        shuffle(&mut probs, rng);
        for p in probs {
            level2.push(specs.len());
            specs.push(ExpertSpec {
                size_bytes: size(rng),
                select_prob: p,
                home: Tier::Ssd,
                parent: Some(ExpertId(root as u32)),
            });
        }
    }
    for parent in level2 {
        if rng.random::<f64>() >= config.branching_share {
            continue;
        }
        let mut probs = selection_probs(config.grandchildren, config.zipf, config.mean_selected);
        shuffle(&mut probs, rng);
        for p in probs {
            specs.push(ExpertSpec {
                size_bytes: size(rng),
                select_prob: p,
                home: Tier::Ssd,
                parent: Some(ExpertId(parent as u32)),
            });
        }
    }
    // The most used experts live in host memory, up to `host_bytes`.
    let model = CoeModel::new(specs.clone())?;
    let mut by_usage: Vec<usize> = (0..specs.len()).collect();
    by_usage.sort_by(|&a, &b| {
        let (ea, eb) = (&model.experts()[a], &model.experts()[b]);
        eb.usage_prob.total_cmp(&ea.usage_prob).then(a.cmp(&b))
    });
    let mut host = 0u64;
    for i in by_usage {
        if host + specs[i].size_bytes <= config.host_bytes {
            host += specs[i].size_bytes;
            specs[i].home = Tier::Host;
        }
    }
    CoeModel::new(specs)
}

/// Arrival process of a synthetic trace.
#[derive(Clone, Debug, PartialEq)]
pub struct ArrivalConfig {
    /// Number of requests.
    pub requests: usize,
    /// Mean gap between arrival events (exponentially distributed).
    pub mean_gap: Micros,
    /// Probability that an arrival event is a burst (e.g. one board's component images).
    pub burst_prob: f64,
    /// Requests in a burst (uniform in 2..=burst_max).
    pub burst_max: usize,
}

impl ArrivalConfig {
    /// A saturating stream: `requests` requests, mean gap 1 ms, a burst every fifth event.
    pub fn saturating(requests: usize) -> Self {
        ArrivalConfig { requests, mean_gap: Micros(1_000), burst_prob: 0.2, burst_max: 32 }
    }
}

/// Pick an index with probability proportional to `weights`.
fn pick(weights: &[f64], rng: &mut SmallRng) -> usize {
    let total: f64 = weights.iter().sum();
    let mut x = rng.random::<f64>() * total;
    for (i, w) in weights.iter().enumerate() {
        if x < *w {
            return i;
        }
        x -= w;
    }
    weights.len().saturating_sub(1)
}

/// Requests on `model`: bursty Poisson arrivals, entry expert drawn by the roots' shares, and
/// each reached parent selecting each child independently with the child's probability.
pub fn synthetic_trace(model: CoeModel, config: &ArrivalConfig, rng: &mut SmallRng) -> Trace {
    let roots: Vec<ExpertId> = model.roots().map(|e| e.id).collect();
    let weights: Vec<f64> = model.roots().map(|e| e.select_prob).collect();
    let mut requests = Vec::with_capacity(config.requests);
    let mut now = 0u64;
    while requests.len() < config.requests {
        let u: f64 = rng.random();
        now += (-(1.0 - u).ln() * config.mean_gap.0 as f64).round() as u64;
        let burst = if rng.random::<f64>() < config.burst_prob {
            rng.random_range(2..=config.burst_max.max(2))
        } else {
            1
        };
        for _ in 0..burst {
            if requests.len() >= config.requests {
                break;
            }
            let root = roots[pick(&weights, rng)];
            let mut selections = Vec::new();
            let mut frontier = vec![root];
            while let Some(expert) = frontier.pop() {
                let Some(e) = model.expert(expert) else {
                    continue;
                };
                if !e.has_children() {
                    continue;
                }
                let selected: Vec<ExpertId> = e
                    .children
                    .iter()
                    .copied()
                    .filter(|c| model.expert(*c).is_some_and(|x| rng.random::<f64>() < x.select_prob))
                    .collect();
                frontier.extend(selected.iter().copied());
                selections.push((expert, selected));
            }
            // Depth-first: each selection comes after the one that reached its expert.
            requests.push(TraceRequest {
                id: RequestId(requests.len() as u64),
                arrival: Micros(now),
                input: rng.random(),
                root,
                selections,
            });
        }
    }
    Trace { model, requests }
}

/// Generate a model and a trace from one seed.
pub fn synthetic_workload(
    model: &ModelConfig,
    arrivals: &ArrivalConfig,
    seed: u64,
) -> Result<Trace, ModelError> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let m = synthetic_model(model, &mut rng)?;
    Ok(synthetic_trace(m, arrivals, &mut rng))
}

/// A made-up edge box: `gpu0` (fast, small expert memory) and `cpu0` (slow, larger). Loads run
/// at an effective 500 MB/s from SSD (read plus session setup) and 4 GB/s from host memory on the
/// GPU, so a 20 MB expert from SSD takes 40 ms against a few ms of compute, as in the paper.
pub fn synthetic_edge_profile(fingerprint: &str, gpu_expert_bytes: u64, cpu_expert_bytes: u64) -> Profile {
    let class = |max_mb: u64, pts: &[(u32, u64)]| SizeClass {
        max_expert_bytes: max_mb << 20,
        points: pts.iter().map(|&(b, l)| LatencyPoint { batch: b, latency: Micros(l) }).collect(),
    };
    let gpu = ExecutorProfile {
        name: "gpu0".into(),
        kind: ExecutorKind::Gpu,
        memory_bytes: gpu_expert_bytes + (gpu_expert_bytes / 2).max(1),
        expert_memory_bytes: gpu_expert_bytes,
        max_batch: 32,
        host_bandwidth: 4_000_000_000,
        ssd_bandwidth: 500_000_000,
        size_classes: vec![
            class(4, &[(1, 1_500), (8, 2_500), (32, 6_000)]),
            class(16, &[(1, 3_000), (8, 5_000), (32, 12_000)]),
            class(64, &[(1, 6_000), (8, 10_000), (32, 24_000)]),
        ],
    };
    let cpu = ExecutorProfile {
        name: "cpu0".into(),
        kind: ExecutorKind::Cpu,
        memory_bytes: cpu_expert_bytes + (cpu_expert_bytes / 2).max(1),
        expert_memory_bytes: cpu_expert_bytes,
        max_batch: 8,
        host_bandwidth: 2_000_000_000,
        ssd_bandwidth: 500_000_000,
        size_classes: vec![
            class(4, &[(1, 8_000), (8, 48_000)]),
            class(16, &[(1, 20_000), (8, 120_000)]),
            class(64, &[(1, 50_000), (8, 300_000)]),
        ],
    };
    Profile { hardware_fingerprint: fingerprint.to_string(), executors: vec![gpu, cpu] }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paper_like_model_has_the_paper_shape() {
        let mut rng = SmallRng::seed_from_u64(7);
        let m = synthetic_model(&ModelConfig::paper_like(), &mut rng).unwrap();
        assert!((250..=350).contains(&m.len()), "{} experts", m.len());
        assert_eq!(m.depth(), 3);
        let total = m.total_bytes();
        assert!(total > 2 << 30 && total < 6 << 30, "{total} bytes");
        assert!(m.experts().iter().all(|e| (1 << 20..=40 << 20).contains(&e.size_bytes)));
        let mix: f64 = m.roots().map(|e| e.select_prob).sum();
        assert!((mix - 1.0).abs() < 1e-9);
        assert!(m.experts().iter().any(|e| e.home == Tier::Host));
    }

    #[test]
    fn traces_are_valid_and_seeded() {
        let a = synthetic_workload(&ModelConfig::ci_like(), &ArrivalConfig::saturating(300), 3).unwrap();
        let b = synthetic_workload(&ModelConfig::ci_like(), &ArrivalConfig::saturating(300), 3).unwrap();
        let c = synthetic_workload(&ModelConfig::ci_like(), &ArrivalConfig::saturating(300), 4).unwrap();
        a.validate().unwrap();
        assert_eq!(crate::coe::trace::Trace::parse(&a.to_text()).unwrap(), a);
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_eq!(a.requests.len(), 300);
        // Bursts put several requests at one instant.
        assert!(a.requests.windows(2).any(|w| w[0].arrival == w[1].arrival));
    }

    #[test]
    fn synthetic_profile_is_valid() {
        let p = synthetic_edge_profile("synthetic", 256 << 20, 512 << 20);
        p.validate().unwrap();
        assert_eq!(Profile::parse(&p.to_text()).unwrap(), p);
    }
}

//! `troupe coe profile`: measure this machine once and write the profile the scheduler reads.
//!
//! Per executor: batch latency against batch size for one expert per size class (the largest of
//! the class, so the curve is an upper bound for the class), the largest useful batch, effective
//! load bandwidth per tier (an `O_DIRECT` read, checksum and session creation, bytes over
//! seconds), and the split of the executor's memory between resident experts and batch
//! intermediates, searched over the profiled batch sizes by modelled time per request
//! (`troupe_policy::coe::search_split`). The profile carries [`hardware_fingerprint`]; a profile from other hardware is
//! refused by [`load_profile`].
//!
//! Each executor is measured with the engine it will serve with: with CUDA the `gpu` executor is
//! `gpu0` and runs the MLP engine on the GPU; without, it is a second CPU executor under ONNX
//! Runtime named `gpu0-standin-cpu` in the profile and every report.

use std::path::Path;

use troupe_policy::Micros;
use troupe_policy::coe::{
    ExecutorKind, ExecutorProfile, ExpertId, LatencyPoint, Profile, SizeClass, SplitExpert, Tier,
    max_useful_batch, search_split,
};
use troupe_policy::stats::median_of;

use super::CoeError;
use super::app::{App, INPUT_WIDTH, read_capped};
use super::executor::{ExecutorOptions, ExpertExecutor, gpu_name};
use crate::clock::Clock;

/// Batch sizes the profiler measures.
pub const BATCHES: [u32; 7] = [1, 2, 4, 8, 16, 32, 64];
/// Size classes per executor.
pub const CLASSES: usize = 4;
/// Repetitions per point (the median is kept).
const REPS: usize = 3;
/// Largest profile file read.
const MAX_PROFILE_FILE: u64 = 1 << 20;

/// This machine's fingerprint: CPU model, core count, memory (GiB) and whether CUDA is usable.
pub fn hardware_fingerprint() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name").and_then(|r| r.split(':').nth(1)))
        .map_or("unknown-cpu", str::trim)
        .to_string();
    let cores = std::thread::available_parallelism().map_or(0, usize::from);
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|r| r.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let cuda = if troupe_kernels::cuda::cuda_available(0).is_ok() { "cuda" } else { "no-cuda" };
    let clean: String = model.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
    format!("{} x{} {}GiB {}", clean.trim(), cores, mem_kib.div_ceil(1 << 20), cuda)
}

/// Read a profile file, refusing one taken on other hardware (with a message naming both).
pub fn load_profile(path: &Path) -> Result<Profile, CoeError> {
    let text = read_capped(path, MAX_PROFILE_FILE)?;
    Profile::load(&text, &hardware_fingerprint())
        .map_err(|e| CoeError::BadFile { path: path.to_path_buf(), problem: e.to_string() })
}

/// One executor the profiler measures: name, kind and expert budget.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExecutorPlan {
    /// Name in the profile.
    pub name: String,
    /// GPU (stand-in) or CPU.
    pub kind: ExecutorKind,
    /// Bytes for resident experts the executor should keep.
    pub expert_bytes: u64,
}

/// The two executors of the app's scale: the GPU stand-in and the CPU.
pub fn default_plan(app: &App) -> Vec<ExecutorPlan> {
    match &app.manifest.knobs {
        Some(k) => plan(k.gpu_expert_bytes, k.cpu_expert_bytes),
        None => {
            let cfg = app.manifest.scale.config();
            plan(cfg.gpu_expert_bytes, cfg.cpu_expert_bytes)
        }
    }
}

/// The GPU executor (or its stand-in, see [`gpu_name`]) and the CPU executor with these expert bytes.
pub fn plan(gpu_expert_bytes: u64, cpu_expert_bytes: u64) -> Vec<ExecutorPlan> {
    vec![
        ExecutorPlan { name: gpu_name(0), kind: ExecutorKind::Gpu, expert_bytes: gpu_expert_bytes },
        ExecutorPlan { name: "cpu0".into(), kind: ExecutorKind::Cpu, expert_bytes: cpu_expert_bytes },
    ]
}

/// Measure every executor of `plan` on `app` and return the profile.
pub fn profile(app: &App, plan: &[ExecutorPlan]) -> Result<Profile, CoeError> {
    let model = &app.trace.model;
    let mut by_size: Vec<&troupe_policy::coe::Expert> = model.experts().iter().collect();
    by_size.sort_by_key(|e| (e.size_bytes, e.id));
    // Class upper bounds: the largest expert of each size quantile.
    let mut reps: Vec<ExpertId> = Vec::new();
    for c in 1..=CLASSES {
        let i = (by_size.len() * c).div_ceil(CLASSES).saturating_sub(1);
        if let Some(e) = by_size.get(i)
            && !reps.contains(&e.id)
        {
            reps.push(e.id);
        }
    }
    // Bytes of intermediates per request: input plus two hidden activations of the widest expert.
    let widest =
        app.manifest.experts.iter().flat_map(|f| f.widths.iter().copied()).max().unwrap_or(INPUT_WIDTH);
    let bytes_per_request = 4 * (INPUT_WIDTH + 2 * widest) as u64;
    let largest = by_size.last().map_or(0, |e| e.size_bytes);
    let mut executors = Vec::with_capacity(plan.len());
    for p in plan {
        let options = ExecutorOptions { kind: p.kind, ..ExecutorOptions::new(p.expert_bytes.max(largest)) };
        let mut exec = ExpertExecutor::open_with(&p.name, &app.store_dir(), &app.manifest, model, options)?;
        // Warm-up: the first session of a process pays ONNX Runtime's one-time setup.
        if let Some(first) = by_size.first() {
            exec.load(first.id)?;
            exec.evict(first.id)?;
        }
        let (mut bytes_by_tier, mut secs_by_tier) = ([0u64; 2], [0f64; 2]);
        let mut classes = Vec::new();
        for &id in &reps {
            let e = model.expert(id).ok_or_else(|| CoeError::Invalid(format!("{id} missing")))?;
            // Where the load really comes from (a demoted expert sits in the host tier).
            let t = usize::from(exec.source_tier(id)? != troupe_kernels::Tier::Host);
            let took = exec.load(id)?;
            bytes_by_tier[t] += e.size_bytes;
            secs_by_tier[t] += took.as_secs_f64();
            let input = vec![0.5f32; INPUT_WIDTH];
            exec.run_batch(id, std::slice::from_ref(&input))?; // warm-up
            let mut points = Vec::new();
            for &b in &BATCHES {
                let inputs = vec![input.clone(); b as usize];
                let mut samples = Vec::with_capacity(REPS);
                for _ in 0..REPS {
                    let start = Clock::start();
                    exec.run_batch(id, &inputs)?;
                    samples.push(start.elapsed().as_secs_f64());
                }
                let us = (median_of(samples) * 1e6).round().max(1.0) as u64;
                // Keep the curve non-decreasing (the latency model assumes it).
                let us = points.last().map_or(us, |l: &LatencyPoint| us.max(l.latency.0));
                points.push(LatencyPoint { batch: b, latency: Micros(us) });
            }
            exec.evict(id)?;
            classes.push(SizeClass { max_expert_bytes: e.size_bytes, points });
        }
        // A second measurement of the same blobs from disk (reads bypass the page cache).
        let bw = |t: usize| {
            if secs_by_tier[t] > 0.0 { (bytes_by_tier[t] as f64 / secs_by_tier[t]) as u64 } else { 0 }
        };
        let ssd = bw(1).max(1);
        let host = if bw(0) > 0 { bw(0) } else { ssd };
        let useful = classes.last().map_or(1, |c| max_useful_batch(&c.points, 0.05));
        let memory_bytes = p.expert_bytes + bytes_per_request * u64::from(useful);
        // The split is searched over the profiled batch sizes by modelled time per request
        // (the policy's `search_split`), not taken as the largest batch that fits.
        let bw_of = |home: Tier| if home == Tier::Host { host } else { ssd } as f64;
        let experts: Vec<SplitExpert> = model
            .experts()
            .iter()
            .map(|e| SplitExpert {
                size_bytes: e.size_bytes,
                usage_prob: e.usage_prob,
                load_us: e.size_bytes as f64 * 1e6 / bw_of(e.home).max(1.0),
            })
            .collect();
        let points = classes.last().map_or(&[][..], |c| c.points.as_slice());
        let split = search_split(memory_bytes, bytes_per_request, points, &experts).ok_or_else(|| {
            CoeError::Invalid(format!(
                "{}: {memory_bytes} bytes cannot hold the largest expert ({largest})",
                p.name
            ))
        })?;
        executors.push(ExecutorProfile {
            name: p.name.clone(),
            kind: p.kind,
            memory_bytes,
            expert_memory_bytes: split.expert_bytes,
            max_batch: split.max_batch,
            host_bandwidth: host,
            ssd_bandwidth: ssd,
            size_classes: classes,
        });
    }
    let profile = Profile { hardware_fingerprint: hardware_fingerprint(), executors };
    profile.validate().map_err(|e| CoeError::Invalid(e.to_string()))?;
    Ok(profile)
}

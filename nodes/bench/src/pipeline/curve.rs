//! The curve of `troupe bench pipeline`: streaming, barrier and B*(N)
//! (`troupe_policy::pipeline::bound`) at N in {W, 2W, 5W, 10W}, with the starvation check, and
//! the larger model (all-mpnet-base-v2 in 4 stages on 4 workers) as the second case.
//!
//! - Costs for B*: each stage's task and warm load on this thread's CPU clock at full speed
//!   ([`measure_cpu_costs`], in `cpu_costs.rs`); the runtime's own CPU per task (decode,
//!   encode, transport on the worker) from the workers' CPU over one-input jobs at full speed
//!   less their ONNX Runtime time ([`runtime_cpu_per_task`]); capacity `min(sum of quotas, cores - the foreman's CPU)`,
//!   the foreman's CPU read on this process's clock over each streaming run.
//! - The starvation check ([`quota_use`], in `meter.rs`): the CPU each worker's own cgroup counted over a run
//!   (`cpu.rs`) over what its quota allows while it had work (the union of its load and task
//!   spans); below [`MIN_QUOTA_USE`] the run did not get its quotas and the bench says the
//!   measurement is invalid. The same over the whole makespan (the literal form, which
//!   also counts the waits a schedule leaves) is printed beside it.
//! - `real_over_sim_streaming`: the real streaming makespan over the policy simulator's on the
//!   same costs (task CPU plus runtime CPU scaled by each quota, loads as CPU, the rest of the
//!   measured per-task overhead as latency), the largest over N.
//! - The same on the run's own CPU (`..._in_run_...`): ONNX Runtime's CPU per task and each
//!   load's CPU as the streaming run's workers read them on their threads, over the same
//!   measured alone ([`compute_cpu_over_measured`], [`load_cpu_over_measured`]); the crowd's
//!   processes share this host's two cores and caches, which a crowd of phones does not.
//! - The large case is in `large.rs`; the crowd both cases start, in `crowd.rs`.

use std::collections::BTreeMap;

use troupe_actors::pipeline::{JobOutcome, SpanKind};
use troupe_policy::Micros;
use troupe_policy::pipeline::bound::{CpuCosts, capacity, captured_share, lower_bound};
use troupe_policy::pipeline::sim::{SimSetup, StageCost, simulate_on};
use troupe_policy::pipeline::{Chain, Foreman, ForemanConfig, Mode};

pub use super::cpu_costs::{
    ISOLATED_JOBS, MeasuredCosts, RuntimeCpu, compute_cpu_over_measured, load_cpu_over_measured,
    measure_cpu_costs, measure_runtime_cpu, runtime_cpu_per_task,
};
pub use super::large::{LARGE_BATCH, LARGE_QUOTAS, large_case};
pub use super::meter::{Metered, Meters, quota_use, run_metered, take_median_metered};
use super::{crowd, mean};

/// Job sizes of the curve, as multiples of the crowd's size W.
pub const MULTIPLES: [usize; 4] = [1, 2, 5, 10];
/// Below this share of its quotas (while the workers had work) a run was starved.
pub const MIN_QUOTA_USE: f64 = 0.8;

/// The medians of one job size: streaming and barrier.
pub struct Point {
    /// Inputs.
    pub n: usize,
    /// The median streaming run.
    pub streaming: Metered,
    /// The median barrier run.
    pub barrier: Metered,
}

/// All a curve's figures need besides its points.
pub struct CurveSetup<'a> {
    /// Key prefix (`""` or `"large_"`).
    pub prefix: &'a str,
    /// The workers' quotas, percent of one CPU.
    pub quotas: &'a [u32],
    /// Per-stage CPU at full speed.
    pub costs: &'a MeasuredCosts,
    /// The runtime's CPU per task.
    pub runtime: RuntimeCpu,
    /// Mean pull of each stage file in the cold run, seconds (the simulator's download).
    pub pulls_s: Vec<f64>,
    /// The job's chain (for the simulator).
    pub chain: Chain,
    /// Cores of this host.
    pub cores: f64,
    /// Starvation check over every measured run: smallest (busy share, makespan share).
    pub quota_use: (f64, f64),
    /// Whether every worker's CPU was read from a cgroup.
    pub from_cgroups: bool,
}

/// The curve's keys, and the lines that explain them.
pub fn curve_figures(s: &CurveSetup<'_>, points: &[Point]) -> (BTreeMap<String, f64>, Vec<String>) {
    let p = s.prefix;
    let mut f = BTreeMap::new();
    let mut lines = Vec::new();
    let mut put = |k: &str, v: f64| {
        f.insert(format!("{p}{k}"), v);
    };
    let w = s.quotas.len();
    let q: Vec<f64> = s.quotas.iter().map(|&q| f64::from(q) / 100.0).collect();
    let us = |x: f64| Micros((x.max(0.0) * 1e6).round() as u64);
    for (k, (t, l)) in s.costs.task_cpu_s.iter().zip(&s.costs.load_cpu_s).enumerate() {
        put(&format!("stage{k}_task_cpu_ms"), t * 1e3);
        put(&format!("stage{k}_load_cpu_ms"), l * 1e3);
    }
    put("runtime_cpu_per_task_ms", s.runtime.per_task_s * 1e3);
    // a worker at full speed, one task in flight, against the same inputs measured alone
    let (on_worker, alone) = s
        .runtime
        .worker_tasks
        .iter()
        .fold((0.0, 0.0), |(w, a), &(k, i, cpu)| (w + cpu, a + s.costs.task_cpu_s_of(k, i)));
    put("worker_compute_cpu_over_measured", if alone > 0.0 { on_worker / alone } else { f64::NAN });
    put("workers_idle_cpus", s.runtime.idle_cpus);
    put("quota_sum_cpus", q.iter().sum());
    let valid = s.from_cgroups && s.quota_use.0 >= MIN_QUOTA_USE;
    put("quota_use_share", s.quota_use.0);
    put("quota_use_share_of_makespan", s.quota_use.1);
    put("measurement_valid", if valid { 1.0 } else { 0.0 });
    let mut worst_sim: f64 = 0.0;
    lines.push(format!(
        "{p}curve (B* = troupe_policy::pipeline::bound: task CPU {:?} ms + runtime {:.2} ms per task, \
         loads {:?} ms of CPU, quotas {:?}):",
        s.costs.task_cpu_s.iter().map(|t| (t * 1e4).round() / 10.0).collect::<Vec<_>>(),
        s.runtime.per_task_s * 1e3,
        s.costs.load_cpu_s.iter().map(|t| (t * 1e4).round() / 10.0).collect::<Vec<_>>(),
        s.quotas
    ));
    for pt in points {
        let m = pt.n / w.max(1);
        let (ts, tb) = (pt.streaming.outcome.makespan_s, pt.barrier.outcome.makespan_s);
        let foreman = pt.streaming.foreman_cpu_s / ts.max(1e-9);
        let cap = capacity(&q, s.cores, foreman);
        // the job's own inputs' costs (inputs differ in length, so in CPU)
        let task_n = s.costs.task_cpu_s_over(pt.n);
        let cpu = CpuCosts {
            task: task_n.iter().map(|t| us(t + s.runtime.per_task_s)).collect(),
            load: s.costs.load_cpu_s.iter().map(|&l| us(l)).collect(),
        };
        let bound = lower_bound(&cpu, &q, cap, pt.n).map_or(f64::NAN, |b| b.0 as f64 / 1e6);
        let sim = sim_streaming(s, &q, pt.n, 1.0, 1.0);
        let share = captured_share(tb, ts, bound);
        worst_sim = worst_sim.max(ts / sim);
        put(&format!("streaming_s_n{m}w"), ts);
        put(&format!("barrier_s_n{m}w"), tb);
        put(&format!("bound_s_n{m}w"), bound);
        put(&format!("capacity_cpus_n{m}w"), cap);
        put(&format!("foreman_cpus_n{m}w"), foreman);
        put(&format!("streaming_over_bound_n{m}w"), ts / bound);
        put(&format!("barrier_over_bound_n{m}w"), tb / bound);
        put(&format!("captured_share_n{m}w"), share);
        put(&format!("streaming_speedup_over_barrier_n{m}w"), tb / ts);
        put(&format!("sim_streaming_s_n{m}w"), sim);
        put(&format!("real_over_sim_streaming_n{m}w"), ts / sim);
        put(&format!("sim_streaming_over_bound_n{m}w"), sim / bound);
        lines.push(format!(
            "  N = {:>2} W ({:>3} inputs): streaming {ts:.3} s, barrier {tb:.3} s ({:.2}x), B* {bound:.3} s \
             (capacity {cap:.2} CPUs, foreman {foreman:.2}); streaming/B* {:.2} (goal <= 1.2), captured \
             share (Tb - Ts)/(Tb - B*) = ({tb:.3} - {ts:.3})/({tb:.3} - {bound:.3}) = {share:.2} (goal >= 0.5); \
             sim_streaming {sim:.3} s, real/sim {:.2} (goal <= 1.15); sim/B* {:.2}{}",
            m,
            pt.n,
            tb / ts,
            ts / bound,
            ts / sim,
            sim / bound,
            if sim / bound > 1.2 {
                " (this policy's own schedule in the simulator, every worker at its full quota, is above \
                 1.2 B* here: on these costs the policy cannot meet 1.2 B* at this N)"
            } else {
                ""
            }
        ));
        // the same on the CPU the streaming run's workers read on their threads (a run without
        // loads keeps the loads' cost measured alone)
        let alpha = compute_cpu_over_measured(&pt.streaming.outcome, s.costs);
        let beta = Some(load_cpu_over_measured(&pt.streaming.outcome, s.costs))
            .filter(|b| b.is_finite())
            .unwrap_or(1.0);
        let in_run = CpuCosts {
            task: task_n.iter().map(|t| us(t * alpha + s.runtime.per_task_s)).collect(),
            load: s.costs.load_cpu_s.iter().map(|l| us(l * beta)).collect(),
        };
        let bound_in_run = lower_bound(&in_run, &q, cap, pt.n).map_or(f64::NAN, |b| b.0 as f64 / 1e6);
        let sim_in_run = sim_streaming(s, &q, pt.n, alpha, beta);
        put(&format!("streaming_compute_cpu_over_measured_n{m}w"), alpha);
        put(&format!("streaming_load_cpu_over_measured_n{m}w"), beta);
        put(&format!("bound_in_run_s_n{m}w"), bound_in_run);
        put(&format!("streaming_over_bound_in_run_n{m}w"), ts / bound_in_run);
        put(&format!("captured_share_in_run_n{m}w"), captured_share(tb, ts, bound_in_run));
        put(&format!("sim_in_run_streaming_s_n{m}w"), sim_in_run);
        put(&format!("real_over_sim_in_run_n{m}w"), ts / sim_in_run);
        lines.push(format!(
            "    in the run, ONNX Runtime took {alpha:.2}x the CPU per task measured alone and the loads \
             {beta:.2}x (each worker's thread CPU clock around its runs and loads); on that CPU: B* {bound_in_run:.3} s, streaming/B* {:.2}, \
             captured share {:.2}, sim_streaming {sim_in_run:.3} s, real/sim {:.2}",
            ts / bound_in_run,
            captured_share(tb, ts, bound_in_run),
            ts / sim_in_run
        ));
    }
    put("real_over_sim_streaming", worst_sim);
    // (the MiniLM case has this key from its main runs, the same medians)
    if let Some(pt) = points.iter().find(|pt| pt.n == w && !p.is_empty()) {
        put(
            "streaming_speedup_over_barrier_n_eq_w",
            pt.barrier.outcome.makespan_s / pt.streaming.outcome.makespan_s,
        );
    }
    lines.push(format!(
        "  starvation check: CPU read from the workers' cgroups / (quota x time each had work) = {:.2} at the \
         smallest over the runs (>= {MIN_QUOTA_USE} wanted; over the whole makespan, waits included: {:.2}){}",
        s.quota_use.0,
        s.quota_use.1,
        if !s.from_cgroups {
            " -- INVALID: not every worker's CPU came from a cgroup".to_string()
        } else if !valid {
            format!(
                " -- INVALID: the workers got {:.0}% of their quotas while they had work; the host is \
                 loaded by something else (or the quotas add to more than its free cores), so these times \
                 are not this schedule's",
                s.quota_use.0 * 100.0
            )
        } else {
            String::new()
        }
    ));
    (f, lines)
}

/// The policy simulator's streaming makespan on the measured costs, each task's ONNX Runtime CPU
/// times `compute_scale` and each load's CPU times `load_scale` (the third job of a foreman, after a barrier and a streaming one, as the bench
/// runs), seconds.
fn sim_streaming(s: &CurveSetup<'_>, q: &[f64], inputs: usize, compute_scale: f64, load_scale: f64) -> f64 {
    let us = |x: f64| Micros((x.max(0.0) * 1e6).round() as u64);
    let task_n = s.costs.task_cpu_s_over(inputs);
    let costs: Vec<StageCost> = (0..task_n.len())
        .map(|k| StageCost {
            compute: us(task_n[k] * compute_scale + s.runtime.per_task_s),
            download: us(s.pulls_s.get(k).copied().unwrap_or(0.0)),
            warm_load: us(s.costs.load_cpu_s[k] * load_scale),
        })
        .collect();
    let workers = crowd::sim_workers(q, costs.len());
    let setup = SimSetup {
        chain: s.chain.clone(),
        costs,
        workers,
        inputs,
        mode: Mode::Streaming,
        hop: Micros::ZERO,
        // the wall overhead beyond the CPU already in `compute`: latency, not scaled by speed
        task_overhead: us(s.runtime.overhead_wall_s - s.runtime.per_task_s),
        loads_are_cpu: true,
        crashes: Vec::new(),
        deliver_late_completions: false,
        foreman: ForemanConfig::default(),
    };
    // a barrier and a streaming job first teach the foreman every worker's times, as the bench's
    // unmeasured runs do before its measured ones
    let barrier = SimSetup { mode: Mode::Barrier, ..setup.clone() };
    simulate_on(&barrier, Foreman::new(setup.foreman))
        .and_then(|(_, f)| simulate_on(&setup, f))
        .and_then(|(_, f)| simulate_on(&setup, f))
        .ok()
        .and_then(|(r, _)| r.makespan)
        .map_or(f64::NAN, |m| m.0 as f64 / 1e6)
}

/// Mean pull time of each stage file in `o` (a cold run), seconds.
pub fn pulls(o: &JobOutcome, stages: usize) -> Vec<f64> {
    (0..stages)
        .map(|k| {
            mean(
                &o.spans
                    .iter()
                    .filter(|s| s.kind == SpanKind::Fetch(k))
                    .map(|s| s.end - s.start)
                    .collect::<Vec<_>>(),
            )
        })
        .collect()
}

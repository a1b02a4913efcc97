//! B*(N): a lower bound on a pipeline job's makespan that charges everything a worker does as CPU
//! work at its quota, and caps the crowd at the CPU the host really has for it.
//!
//! Inputs, all measured at full speed on a CPU clock: `c_k`, the CPU one task of stage `k` costs
//! (its compute plus the runtime's own per-task CPU on the worker: decode, encode, transport);
//! `l_k`, the CPU a warm load of stage `k` costs (session creation from the file on disk). A
//! worker with quota `q_w` (CPUs) spends `x / q_w` of wall time on `x` of CPU work. The crowd's
//! capacity `C = min(sum_w q_w, cores - other CPU)` (the foreman and anything else on the host
//! take their share of the cores first: [`capacity`]).
//!
//! With `c = sum_k c_k`, `q_max` the largest quota, `S_m` the sum of the `m` largest, `l_min =
//! min_k l_k`, `l_sum = sum_k l_k`:
//!
//! `B* = max((l_0 + c) / min(q_max, C), min_{m=1..W} (N c + max(l_sum, m l_min)) / min(S_m, C),
//! O, H)`, `O` the ordered term (`ordered.rs`: each worker's first load, the order of an input's
//! stages, fill and drain; quotas capped at `C`), `H` the residency term (`residency.rs`: the
//! stages each worker runs, a load for each, and Hall's condition on what the workers can give
//! each set of stages).
//!
//! The first term: some worker loads stage 0 before any input starts, then one input crosses
//! every stage, each at most at the best quota. The second: `m` is the number of workers the
//! schedule uses (unknown, so the minimum over it); all `N` inputs' CPU plus the loads (every
//! stage loaded at least once, every used worker loads at least once) is done by at most the
//! `m` used workers' quotas, never more than the capacity. Transfers' wall time and the
//! foreman's latency are left out (they only make a schedule longer), so it is a lower bound for
//! any schedule on the same costs: a property test checks it against the simulator's schedules
//! (`sim.rs` with [`SimSetup::loads_are_cpu`](super::sim::SimSetup::loads_are_cpu)).

use thiserror::Error;

use crate::Micros;

mod ordered;
mod residency;
pub use ordered::MAX_ASSIGNMENTS;
pub use residency::MAX_STAGE_SETS;

/// Per-stage CPU costs at full speed (one CPU), the bound's input.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuCosts {
    /// CPU of one task of stage `k`: compute plus the runtime's per-task CPU on the worker.
    pub task: Vec<Micros>,
    /// CPU of one warm load of stage `k` (session creation from the file on disk).
    pub load: Vec<Micros>,
}

/// Why the bound cannot be computed.
#[derive(Clone, Debug, PartialEq, Error)]
pub enum BoundError {
    /// Task and load cost lists differ in length, or are empty.
    #[error("{tasks} task costs and {loads} load costs (one of each per stage, at least one stage)")]
    Stages {
        /// Task costs given.
        tasks: usize,
        /// Load costs given.
        loads: usize,
    },
    /// No worker has a positive finite quota.
    #[error("no worker has a positive quota")]
    NoWorkers,
    /// The capacity is not a positive finite number of CPUs.
    #[error("capacity {0} CPUs is not positive and finite")]
    NoCapacity(f64),
}

/// CPUs the crowd can use: `min(sum of quotas, cores - other)`, `other` the CPU the rest of the
/// host takes meanwhile (the foreman, the runtime around it, other programs), in CPUs.
pub fn capacity(quotas: &[f64], cores: f64, other: f64) -> f64 {
    let sum: f64 = quotas.iter().copied().filter(|q| q.is_finite() && *q > 0.0).sum();
    sum.min(cores - other.max(0.0)).max(0.0)
}

/// B*(N), formula in the module doc; `quotas` in CPUs (0.6 = 60 % of one CPU), `capacity` in
/// CPUs (see [`capacity`]). Less one µs per task and per worker-stage pair: the simulator rounds
/// each scaled time to the µs.
pub fn lower_bound(
    costs: &CpuCosts,
    quotas: &[f64],
    capacity: f64,
    inputs: usize,
) -> Result<Micros, BoundError> {
    let stages = costs.task.len();
    if stages == 0 || costs.load.len() != stages {
        return Err(BoundError::Stages { tasks: stages, loads: costs.load.len() });
    }
    if !(capacity.is_finite() && capacity > 0.0) {
        return Err(BoundError::NoCapacity(capacity));
    }
    let mut q: Vec<f64> = quotas.iter().copied().filter(|q| q.is_finite() && *q > 0.0).collect();
    q.sort_by(|a, b| b.total_cmp(a));
    let Some(&q_max) = q.first() else {
        return Err(BoundError::NoWorkers);
    };
    if inputs == 0 {
        return Ok(Micros::ZERO);
    }
    let us = |m: &Micros| m.0 as f64;
    let chain: f64 = costs.task.iter().map(us).sum();
    let l_min = costs.load.iter().map(us).fold(f64::INFINITY, f64::min);
    let l_sum: f64 = costs.load.iter().map(us).sum();
    let path = (us(&costs.load[0]) + chain) / q_max.min(capacity);
    let work = inputs as f64 * chain;
    let mut crowd = f64::INFINITY;
    let mut s_m = 0.0;
    for (i, s) in q.iter().enumerate() {
        s_m += s;
        let loads = l_sum.max((i + 1) as f64 * l_min);
        crowd = crowd.min((work + loads) / s_m.min(capacity));
    }
    let task: Vec<f64> = costs.task.iter().map(us).collect();
    let load: Vec<f64> = costs.load.iter().map(us).collect();
    let capped: Vec<f64> = q.iter().map(|q| q.min(capacity)).collect();
    let job = ordered::Ordered { task: &task, load: &load, quotas: &capped, capacity, inputs: inputs as f64 };
    let held = job.residency(path.max(crowd).max(job.bound()));
    let rounding = (inputs.saturating_add(q.len()) as f64) * stages as f64;
    let v = (held - rounding).max(0.0);
    Ok(Micros(v.round().min(u64::MAX as f64) as u64))
}

/// The share of the gap between a barrier run and the bound that a streaming run captured:
/// `(barrier - streaming) / (barrier - bound)`; NaN when the barrier run is at the bound.
pub fn captured_share(barrier_s: f64, streaming_s: f64, bound_s: f64) -> f64 {
    let gap = barrier_s - bound_s;
    if gap > 0.0 { (barrier_s - streaming_s) / gap } else { f64::NAN }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn costs(task_ms: &[u64], load_ms: &[u64]) -> CpuCosts {
        CpuCosts {
            task: task_ms.iter().map(|&m| Micros::from_millis(m)).collect(),
            load: load_ms.iter().map(|&m| Micros::from_millis(m)).collect(),
        }
    }

    #[test]
    fn capacity_is_the_smaller_of_quotas_and_free_cores() {
        assert!((capacity(&[0.6, 0.4, 0.4, 0.2, 0.2], 2.0, 0.5) - 1.5).abs() < 1e-12);
        assert!((capacity(&[0.39, 0.26, 0.26, 0.13, 0.13], 2.0, 0.5) - 1.17).abs() < 1e-12);
        assert_eq!(capacity(&[1.0], 1.0, 3.0), 0.0);
    }

    /// Many inputs with cheap loads: the work over the capacity, by hand: 1000 inputs x 60 ms =
    /// 60 s of CPU over min(1.8, 1.5) CPUs, or over the quotas' 1.8 uncapped. The loads (1 ms
    /// each, at most 15 of them in any schedule worth having) and the fill and drain add < 0.2 %.
    #[test]
    fn many_inputs_are_limited_by_the_capacity() {
        let c = costs(&[10, 20, 30], &[1, 1, 1]);
        let b = lower_bound(&c, &[0.6, 0.4, 0.4, 0.2, 0.2], 1.5, 1000).unwrap();
        let want = 60_000.0 / 1.5;
        assert!(b.0 as f64 / 1e3 >= want - 5.0 && b.0 as f64 / 1e3 <= want * 1.002, "{b} vs {want} ms");
        let b = lower_bound(&c, &[0.6, 0.4, 0.4, 0.2, 0.2], 4.0, 1000).unwrap();
        let want = 60_000.0 / 1.8;
        assert!(b.0 as f64 / 1e3 >= want - 5.0 && b.0 as f64 / 1e3 <= want * 1.002, "{b} vs {want} ms");
    }

    /// One input: the chain on the best worker after its load of stage 0, or the loads, by hand.
    /// With costly loads the best schedule is: the 0.5 worker loads stage 0 (200 ms), runs it (20
    /// ms), loads stage 2 (600 ms, until 820) while the 0.25 worker loads stage 1 (800 ms) and
    /// runs it (80 ms, until 880); then stage 2 (60 ms): 940 ms. The residency term finds it: the
    /// worker that runs stage 1 alone starts it after its own 800 ms load and leaves stage 2's 60
    /// ms at the best quota; one worker running all three loads 600 ms of stages at 0.5 (1320
    /// ms), and the other ways to share them are slower still.
    #[test]
    fn one_input_is_limited_by_the_chain() {
        let c = costs(&[10, 20, 30], &[100, 200, 300]);
        let b = lower_bound(&c, &[0.5, 0.25], 4.0, 1).unwrap();
        assert!((b.0 as f64 / 1e3 - 940.0).abs() < 1.0, "{b}");
        // cheap loads: path (1 + 60) / 0.5 = 122 ms
        let cheap_loads = costs(&[10, 20, 30], &[1, 1, 1]);
        let b = lower_bound(&cheap_loads, &[0.5, 0.25], 4.0, 1).unwrap();
        assert!((b.0 as f64 / 1e3 - 122.0).abs() < 1.0, "{b}");
    }

    /// As many workers as stages: each holds one, and the slowest stage decides. Two workers at
    /// one CPU, stages of 10 ms and 100 ms loads, 10 inputs, by hand: the static pipeline ends at
    /// 100 (load) + 10 x 10 (stage 0) + 10 (the last input's stage 1) = 210 ms, and no schedule
    /// does better: a worker that runs both stages pays 200 ms of loads. The terms without the
    /// stages each worker runs give (200 + 200) / 2 = 200 ms of crowd; the residency term 210.
    #[test]
    fn one_stage_each_is_limited_by_the_slowest_holder() {
        let c = costs(&[10, 10], &[100, 100]);
        let b = lower_bound(&c, &[1.0, 1.0], 2.0, 10).unwrap();
        assert!((b.0 as f64 / 1e3 - 210.0).abs() < 0.1, "{b}");
    }

    #[test]
    fn less_capacity_or_more_inputs_never_lower_the_bound() {
        let c = costs(&[7, 3], &[50, 80]);
        let q = [0.3, 0.2, 0.2, 0.1, 0.1];
        let mut last = Micros::ZERO;
        for n in [1, 2, 5, 10, 50] {
            let b = lower_bound(&c, &q, 0.9, n).unwrap();
            assert!(b >= last);
            assert!(lower_bound(&c, &q, 0.5, n).unwrap() >= b);
            last = b;
        }
    }

    #[test]
    fn bad_inputs_are_errors() {
        let c = costs(&[1, 2], &[1]);
        assert!(matches!(lower_bound(&c, &[1.0], 1.0, 1), Err(BoundError::Stages { tasks: 2, loads: 1 })));
        let c = costs(&[1], &[1]);
        assert_eq!(lower_bound(&c, &[0.0, f64::NAN], 1.0, 1), Err(BoundError::NoWorkers));
        assert!(matches!(lower_bound(&c, &[1.0], 0.0, 1), Err(BoundError::NoCapacity(_))));
        assert_eq!(lower_bound(&c, &[1.0], 1.0, 0), Ok(Micros::ZERO));
    }

    #[test]
    fn captured_share_by_hand() {
        assert!((captured_share(10.0, 6.0, 2.0) - 0.5).abs() < 1e-12);
        assert!(captured_share(2.0, 2.0, 2.0).is_nan());
    }
}

//! The ordered term of B*(N): what the order of an input's stages and the one-stage residency of
//! a worker cost, on top of the capacity terms of [`super::lower_bound`].
//!
//! A worker holds one stage at a time, and runs a stage's tasks only after it has loaded it. So
//! each worker has a *first load* `f_w` (the schedule decides which): `w` can start a task of
//! stage `k` no earlier than `R_wk = (l_{f_w} + [k != f_w] l_k) / q_w`. The term is the minimum,
//! over every assignment `f` of first loads, of the smallest `T` that passes all of:
//! - **path**: `F_k`, the earliest end of any stage-`k` task, is `min_w (a_wk + c_k / q_w)` with
//!   `a_wk = max(R_wk, F_{k-1})` (an input's stage `k` waits for its stage `k - 1`); `T >= F_last`.
//! - **crowd with first loads**: `sum_w max(0, q_w T - l_{f_w}) >= N c + sum_{k not a first load}
//!   l_k` (a stage no worker loads first is loaded later by someone, on top).
//! - **windows**: for stages `k1..=k2`, every task of those stages runs after its worker's
//!   `min_{k1<=k<=k2} a_wk` and ends by `T - G_k2`, `G_k = sum_{j>k} c_j / q_max` (the input still
//!   crosses the later stages, each at best at the largest quota). In that window worker `w` does
//!   at most `q_w (end - a_wk)` of one stage `k`, or, when it runs two stages there, at most `q_w
//!   (end - min_k a_wk) - min_{k1<=k<=k2} l_k` (it loads the second inside the window); the
//!   window's work `N sum_{k1..=k2} c_k` must fit in the sum over workers, and in the capacity
//!   `C (end - min_w min_k a_wk)`.
//!
//! Every inequality holds for any schedule whose workers' first loads are `f` (a worker that does
//! nothing is given a first load some working worker has: its terms only add room), so the
//! minimum over `f` is a lower bound on every schedule. Each check is monotone in `T`, so `T` is
//! found by bisection. The assignments number `S^W`; past [`MAX_ASSIGNMENTS`] the term drops the
//! assignment (every `R_wk = l_k / q_w`, no first-load crowd check), which is weaker but valid.

/// Most first-load assignments enumerated; beyond it the assignment-free form is used.
pub const MAX_ASSIGNMENTS: usize = 50_000;

/// The job as this term and the residency term (`residency.rs`) see it, all in µs of CPU at full
/// speed and CPUs.
pub(super) struct Ordered<'a> {
    /// CPU of one task per stage.
    pub task: &'a [f64],
    /// CPU of one load per stage.
    pub load: &'a [f64],
    /// Quotas, each at most the capacity, positive.
    pub quotas: &'a [f64],
    /// The crowd's capacity, CPUs.
    pub capacity: f64,
    /// Inputs `N`.
    pub inputs: f64,
}

impl Ordered<'_> {
    /// The term, µs.
    pub fn bound(&self) -> f64 {
        let (s, w) = (self.task.len(), self.quotas.len());
        let count = (0..w).try_fold(1usize, |acc, _| acc.checked_mul(s).filter(|&n| n <= MAX_ASSIGNMENTS));
        let mut best = f64::INFINITY;
        match count {
            Some(count) => {
                let mut f = vec![0usize; w];
                for code in 0..count {
                    let mut c = code;
                    for slot in f.iter_mut() {
                        *slot = c % s;
                        c /= s;
                    }
                    best = best.min(self.smallest_t(Some(&f), best));
                }
            }
            None => best = self.smallest_t(None, best),
        }
        best
    }

    /// Smallest `T` passing every check under first loads `f` (`None`: no assignment), or
    /// `cutoff` when `cutoff` itself fails (the minimum over assignments is below it anyway).
    fn smallest_t(&self, f: Option<&[usize]>, cutoff: f64) -> f64 {
        let checks = Checks::new(self, f);
        let mut hi = if cutoff.is_finite() {
            if !checks.pass(cutoff) {
                return cutoff;
            }
            cutoff
        } else {
            let total = self.inputs * self.task.iter().sum::<f64>() + 2.0 * self.load.iter().sum::<f64>();
            let q_min = self.quotas.iter().copied().fold(f64::INFINITY, f64::min);
            let mut hi = checks.path + total / q_min + checks.tail[0] + 1.0;
            let mut doublings = 0;
            while !checks.pass(hi) && doublings < 64 {
                hi *= 2.0;
                doublings += 1;
            }
            hi
        };
        let mut lo = checks.path;
        if checks.pass(lo) {
            return lo;
        }
        while hi - lo > 0.25 {
            let mid = 0.5 * (lo + hi);
            if checks.pass(mid) {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        hi
    }
}

/// The checks of one assignment, with what does not depend on `T` computed once.
struct Checks<'a> {
    job: &'a Ordered<'a>,
    /// Loads that are first loads, per worker (0 without an assignment).
    first_load: Vec<f64>,
    /// Loads of stages no worker loads first.
    later_loads: f64,
    /// `a_wk`, indexed `[w][k]`.
    ready: Vec<Vec<f64>>,
    /// `F_last`.
    path: f64,
    /// `G_k`.
    tail: Vec<f64>,
}

impl<'a> Checks<'a> {
    fn new(job: &'a Ordered<'a>, f: Option<&[usize]>) -> Self {
        let (s, q) = (job.task.len(), job.quotas);
        let resident = |w: usize, k: usize| -> f64 {
            match f {
                Some(f) if f[w] == k => job.load[k] / q[w],
                Some(f) => (job.load[f[w]] + job.load[k]) / q[w],
                None => job.load[k] / q[w],
            }
        };
        let mut ready = vec![vec![0.0; s]; q.len()];
        let mut done = 0.0_f64;
        for k in 0..s {
            let mut first_end = f64::INFINITY;
            for (w, row) in ready.iter_mut().enumerate() {
                row[k] = resident(w, k).max(done);
                first_end = first_end.min(row[k] + job.task[k] / q[w]);
            }
            done = first_end;
        }
        let q_max = q.iter().copied().fold(0.0, f64::max);
        let tail = (0..s).map(|k| job.task[k + 1..].iter().sum::<f64>() / q_max).collect();
        let (first_load, later_loads) = match f {
            Some(f) => (
                f.iter().map(|&k| job.load[k]).collect(),
                (0..s).filter(|k| !f.contains(k)).map(|k| job.load[k]).sum(),
            ),
            None => (vec![0.0; q.len()], 0.0),
        };
        Checks { job, first_load, later_loads, ready, path: done, tail }
    }

    fn pass(&self, t: f64) -> bool {
        let job = self.job;
        let q = job.quotas;
        if t < self.path {
            return false;
        }
        let work = job.inputs * job.task.iter().sum::<f64>();
        let room: f64 = q.iter().zip(&self.first_load).map(|(q, l)| (q * t - l).max(0.0)).sum();
        if room < work + self.later_loads {
            return false;
        }
        let s = job.task.len();
        for k1 in 0..s {
            for k2 in k1..s {
                let end = t - self.tail[k2];
                let work = job.inputs * job.task[k1..=k2].iter().sum::<f64>();
                let l_min = job.load[k1..=k2].iter().copied().fold(f64::INFINITY, f64::min);
                let (mut room, mut start) = (0.0, f64::INFINITY);
                for (w, row) in self.ready.iter().enumerate() {
                    let a = &row[k1..=k2];
                    let earliest = a.iter().copied().fold(f64::INFINITY, f64::min);
                    let one = a.iter().map(|&x| q[w] * (end - x)).fold(0.0, f64::max);
                    let two = if k2 > k1 { q[w] * (end - earliest) - l_min } else { 0.0 };
                    room += one.max(two).max(0.0);
                    start = start.min(earliest);
                }
                if room < work || job.capacity * (end - start) < work {
                    return false;
                }
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    //! The bound against schedules the policy would never make: random list schedules (a worker
    //! free at `t` runs a ready task of its stage, loads another stage, or waits, at random) and
    //! static pipelines (each worker keeps one stage; every assignment that covers the stages),
    //! on the bound's own model: one live stage per worker, loads and tasks as CPU at its quota.

    use rand::{Rng, SeedableRng, rngs::SmallRng};

    use super::super::{CpuCosts, lower_bound};
    use crate::Micros;

    struct Job {
        task: Vec<f64>,
        load: Vec<f64>,
        quotas: Vec<f64>,
        inputs: usize,
    }

    /// One schedule's makespan, µs. `first`: each worker's first stage; `p_switch`: the chance
    /// a free worker loads another stage instead of running a ready task.
    fn schedule(job: &Job, first: &[usize], p_switch: f64, rng: &mut SmallRng) -> f64 {
        let (s, n, w) = (job.task.len(), job.inputs, job.quotas.len());
        let mut free: Vec<f64> = (0..w).map(|v| job.load[first[v]] / job.quotas[v]).collect();
        let mut live: Vec<usize> = first.to_vec();
        let mut done = vec![vec![None::<f64>; s]; n];
        let mut left = n * s;
        let mut guard = 0;
        while left > 0 {
            guard += 1;
            assert!(guard < 1_000_000, "the random scheduler did not finish");
            let v = (0..w).min_by(|&a, &b| free[a].total_cmp(&free[b])).unwrap_or(0);
            let t = free[v];
            let k = live[v];
            let ready: Vec<usize> = (0..n)
                .filter(|&i| done[i][k].is_none() && (k == 0 || done[i][k - 1].is_some_and(|d| d <= t)))
                .collect();
            let pending: Vec<usize> = (0..s).filter(|&j| (0..n).any(|i| done[i][j].is_none())).collect();
            let alone = pending.iter().all(|&j| j == k);
            if !ready.is_empty() && (alone || !rng.random_bool(p_switch)) {
                let i = ready[rng.random_range(0..ready.len())];
                let end = t + job.task[k] / job.quotas[v];
                done[i][k] = Some(end);
                free[v] = end;
                left -= 1;
                continue;
            }
            let later = free
                .iter()
                .copied()
                .chain(done.iter().flatten().flatten().copied())
                .filter(|&x| x > t)
                .fold(f64::INFINITY, f64::min);
            let others: Vec<usize> = pending.iter().copied().filter(|&j| j != k).collect();
            if (later.is_infinite() || rng.random_bool(0.3)) && !others.is_empty() {
                let j = others[rng.random_range(0..others.len())];
                live[v] = j;
                free[v] = t + job.load[j] / job.quotas[v];
            } else if later.is_finite() {
                free[v] = later;
            } else {
                // only this worker's own stage is pending, and none of it ready: cannot happen,
                // an unfinished task's predecessor is done or running
                unreachable!("stuck at {t} with stage {k}");
            }
        }
        done.iter().flatten().flatten().copied().fold(0.0, f64::max)
    }

    /// Seeded random jobs: the bound is at most every schedule's makespan, and it is not vacuous.
    #[test]
    fn bound_never_exceeds_random_or_static_schedules() {
        let mut rng = SmallRng::seed_from_u64(4401);
        let mut worst_ratio: f64 = 0.0;
        for case in 0..120 {
            let s: usize = rng.random_range(1..5);
            let w: usize = rng.random_range(1..6);
            let job = Job {
                task: (0..s).map(|_| rng.random_range(500.0..60_000.0)).collect(),
                load: (0..s).map(|_| rng.random_range(1_000.0..600_000.0)).collect(),
                quotas: (0..w).map(|_| rng.random_range(0.1..1.0)).collect(),
                inputs: rng.random_range(1..13),
            };
            let cpu = CpuCosts {
                task: job.task.iter().map(|&t| Micros(t as u64)).collect(),
                load: job.load.iter().map(|&l| Micros(l as u64)).collect(),
            };
            let bound = lower_bound(&cpu, &job.quotas, job.quotas.iter().sum(), job.inputs).unwrap().0 as f64;
            let mut best = f64::INFINITY;
            // static pipelines: every first-stage assignment that covers all stages
            let count = s.pow(w as u32);
            for code in 0..count {
                let first: Vec<usize> = (0..w).map(|v| code / s.pow(v as u32) % s).collect();
                let p = if (0..s).all(|k| first.contains(&k)) { 0.0 } else { 0.05 };
                best = best.min(schedule(&job, &first, p, &mut rng));
            }
            for _ in 0..200 {
                let first: Vec<usize> = (0..w).map(|_| rng.random_range(0..s)).collect();
                let p = [0.0, 0.05, 0.3][rng.random_range(0..3)];
                best = best.min(schedule(&job, &first, p, &mut rng));
            }
            assert!(bound <= best + 1.0, "case {case}: bound {bound} µs above a schedule of {best} µs");
            worst_ratio = worst_ratio.max(best / bound.max(1.0));
        }
        // not vacuous: the best schedule found is never far above it
        assert!(worst_ratio < 3.0, "best schedule up to {worst_ratio:.2}x the bound");
    }
}

//! The residency term of B*(N): a worker runs tasks only of stages it has loaded, and pays a load
//! for every stage it runs, so what a worker can give each stage depends on which stages it
//! runs, not only on its quota.
//!
//! For an assignment `A` of a set of stages `A_w` to each worker (the stages it runs at least one
//! task of; a worker may run none), the term is the smallest `T` that passes:
//! - **each worker's room**: `w` pays `L_w = sum_{k in A_w} l_k` of loads, and its tasks lie in
//!   `[s_w, e_w]`: they start after `F_{k_min - 1}` (the earliest end of any task of the stage
//!   before its first, the path of the ordered term without first loads) and after its first load
//!   (at least `min_{k in A_w} l_k / q_w`), and end by `e_w = T - G_{k_max}` (the input still
//!   crosses the later stages, each at best at the largest quota). So its task CPU is at most
//!   `r_w = min(q_w e_w - L_w, q_w (e_w - max(s_w, min_k l_k / q_w)))`, which must not be
//!   negative.
//! - **Hall's condition**: for every set `K` of stages, their work `N sum_{k in K} c_k` fits in
//!   the rooms of the workers that run a stage of `K`.
//! - **the capacity**: `sum_w L_w + N c <= C T`.
//!
//! The schedule's own assignment passes at its makespan, so the least `T` over all assignments
//! is a lower bound on every schedule. It is what the other terms leave out when stages cannot be
//! balanced over the workers without a worker loading two: with as many workers as stages each
//! holds one, and the slowest stage decides. The assignments number `(2^S)^W`; past
//! [`MAX_STAGE_SETS`] the term is not computed (the other terms still hold).

use super::ordered::Ordered;

/// Most assignments of stage sets to workers enumerated; beyond it the term is left out.
pub const MAX_STAGE_SETS: usize = 70_000;

// The job as both terms see it (task and load CPU, quotas capped at the capacity, inputs).
impl Ordered<'_> {
    /// The residency term, µs, or `floor` when some assignment passes at `floor` (the bound is
    /// the larger of this and the other terms, so below `floor` the exact value does not matter);
    /// `floor` too when there are too many assignments.
    pub fn residency(&self, floor: f64) -> f64 {
        let (s, w) = (self.task.len(), self.quotas.len());
        let Some(count) =
            (0..w).try_fold(1usize, |acc, _| acc.checked_mul(1 << s).filter(|&n| n <= MAX_STAGE_SETS))
        else {
            return floor;
        };
        let (path, tail) = self.path_and_tail();
        let all = (1usize << s) - 1;
        let mut sets = vec![0usize; w];
        let mut rooms = vec![0.0_f64; w];
        let mut best = f64::INFINITY;
        for code in 0..count {
            let mut c = code;
            for set in sets.iter_mut() {
                *set = c & all;
                c >>= s;
            }
            if sets.iter().fold(0, |acc, &a| acc | a) != all {
                continue;
            }
            let mut check = |t: f64| self.pass(&sets, &path, &tail, t, &mut rooms);
            if check(floor) {
                return floor;
            }
            let mut hi = if best.is_finite() {
                if !check(best) {
                    continue;
                }
                best
            } else {
                match self.first_passing(&mut check, floor) {
                    Some(hi) => hi,
                    None => continue,
                }
            };
            let mut lo = floor;
            while hi - lo > 0.25 {
                let mid = 0.5 * (lo + hi);
                if check(mid) {
                    hi = mid;
                } else {
                    lo = mid;
                }
            }
            best = best.min(hi);
        }
        best.max(floor)
    }

    /// `F_k`, the earliest end of any stage-`k` task (each worker loads the stage first), and
    /// `G_k`, the chain of the stages after `k` at the largest quota.
    fn path_and_tail(&self) -> (Vec<f64>, Vec<f64>) {
        let q = self.quotas;
        let mut path = Vec::with_capacity(self.task.len());
        let mut done = 0.0_f64;
        for (k, &c) in self.task.iter().enumerate() {
            done = q.iter().map(|&q| (self.load[k] / q).max(done) + c / q).fold(f64::INFINITY, f64::min);
            path.push(done);
        }
        let q_max = q.iter().copied().fold(0.0, f64::max);
        let tail = (0..self.task.len()).map(|k| self.task[k + 1..].iter().sum::<f64>() / q_max).collect();
        (path, tail)
    }

    /// A `T` above `floor` that passes, by doubling; `None` when none does within 64 doublings.
    fn first_passing(&self, check: &mut impl FnMut(f64) -> bool, floor: f64) -> Option<f64> {
        let total = self.inputs * self.task.iter().sum::<f64>() + self.load.iter().sum::<f64>();
        let q_min = self.quotas.iter().copied().fold(f64::INFINITY, f64::min);
        let mut hi = floor.max(0.0) + total / q_min + 1.0;
        for _ in 0..64 {
            if check(hi) {
                return Some(hi);
            }
            hi *= 2.0;
        }
        None
    }

    /// Whether `T = t` passes every check under `sets`; `rooms` is scratch, one per worker.
    fn pass(&self, sets: &[usize], path: &[f64], tail: &[f64], t: f64, rooms: &mut [f64]) -> bool {
        let s = self.task.len();
        let mut loads = 0.0;
        for ((w, &set), r) in sets.iter().enumerate().zip(rooms.iter_mut()) {
            *r = 0.0;
            if set == 0 {
                continue;
            }
            let q = self.quotas[w];
            let (k_min, k_max) =
                (set.trailing_zeros() as usize, usize::BITS as usize - 1 - set.leading_zeros() as usize);
            let (mut load, mut first) = (0.0, f64::INFINITY);
            for k in (0..s).filter(|k| set >> k & 1 == 1) {
                load += self.load[k];
                first = first.min(self.load[k]);
            }
            loads += load;
            let end = t - tail[k_max];
            let start = if k_min > 0 { path[k_min - 1] } else { 0.0 };
            *r = (q * end - load).min(q * (end - start.max(first / q)));
            if *r < 0.0 {
                return false;
            }
        }
        let work: f64 = self.task.iter().sum::<f64>() * self.inputs;
        if loads + work > self.capacity * t {
            return false;
        }
        (1..1usize << s).all(|stages| {
            let need: f64 =
                (0..s).filter(|k| stages >> k & 1 == 1).map(|k| self.task[k]).sum::<f64>() * self.inputs;
            let have: f64 =
                sets.iter().zip(rooms.iter()).filter(|(set, _)| *set & stages != 0).map(|(_, r)| r).sum();
            need <= have
        })
    }
}

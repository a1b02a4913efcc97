//! Stage plan: each worker gets a home stage for a streaming job's steady state (classic
//! pipeline balancing by speed), from the learned task and load times.
//!
//! Input, per worker `w` and stage `k`: `tau_w(k)` its predicted task time (occupancy: transfer,
//! compute, reply, as [`super::costs::CostModel`] learns it), `L_w(k)` its predicted time to make
//! `k` live (0 if `k` is live there already); per stage `U_k` its unclaimed tasks. A plan `h`
//! maps each worker to one stage; with `H_k = {w : h(w) = k}`, `R_k = sum_{w in H_k} 1/tau_w(k)`,
//! its predicted finish is the fluid pipeline estimate
//!
//! - `F_k = max((U_k + sum_{w in H_k} (b_w + L_w(k)) / tau_w(k)) / R_k, A_k + U_k / R_k,
//!   F_{k-1} + min_{w in H_k} tau_w(k))`, with `F_{-1} = 0`,
//! - `A_0 = 0`, `A_k = min_{w in H_{k-1}} (max(A_{k-1}, b_w + L_w(k-1)) + tau_w(k-1))`: stage `k` cannot
//!   start before its first input exists,
//! - `b_w` when `w` starts loading `k`: 0 with eager loads (or nothing to load); with just-in-time
//!   loads (`jit`) `A_k`, since a load waits for a ready task,
//!
//! (the first term: each holder computes from the end of its load, so it gives up
//! `(b + L) / tau` tasks of the stage's capacity; the last: the stage's last task starts after
//! the upstream's last output). The cost of a plan is `F_{S-1}`, and a stage with `U_k > 0` and no home worker costs
//! `+inf`. The chosen plan minimises the cost; ties go to the plan that moves fewer workers off
//! their live stage, then to the lexicographically smallest assignment (by worker order), so the
//! result is deterministic. Exhaustive over `S^W` plans up to [`EXHAUSTIVE_PLANS`]; above that,
//! greedy: workers fastest first (least summed task time), each to the stage that lowers the
//! cost most given those placed before (stages with no home yet first while some are empty).
//!
//! A plan is returned only when its cost is below `(1 - PLAN_MARGIN)` times the stage-by-stage
//! estimate [`stagewise_cost`] (`sum_k (max_w L_w(k) + U_k / sum_w 1/tau_w(k))`: every worker on
//! every stage in turn, what dispatch without a plan tends to): where pinning workers to stages
//! gains little, the tail rules do better on their own.
//!
//! The foreman uses the plan only for streaming jobs with every worker's speed measured (or
//! remembered from an earlier job): a worker takes tasks of its home stage only while that
//! stage has unclaimed tasks; after that it is free for any stage under the ordinary rules
//! (the tail is shared).

/// Required relative gain of a plan over [`stagewise_cost`] (0: any gain; in the bench's regime
/// 0.05 and 0.2 kept plans out where they gained 5-10% in the simulator).
pub const PLAN_MARGIN: f64 = 0.0;

/// `sum_k (max_w L_w(k) + U_k / sum_w 1/tau_w(k))` over the stages with work (module doc).
pub fn stagewise_cost(workers: &[PlanWorker], unclaimed: &[usize]) -> f64 {
    (0..unclaimed.len())
        .filter(|&k| unclaimed[k] > 0)
        .map(|k| {
            let fit: Vec<&PlanWorker> =
                workers.iter().filter(|w| w.fits.get(k).copied().unwrap_or(false)).collect();
            let rate: f64 =
                fit.iter().filter_map(|w| w.task_us.get(k)).filter(|t| good(**t)).map(|t| 1.0 / t).sum();
            let load = fit.iter().filter_map(|w| w.load_us.get(k)).copied().fold(0.0, f64::max);
            if rate > 0.0 { load + unclaimed[k] as f64 / rate } else { f64::INFINITY }
        })
        .sum()
}

/// Most plans searched exhaustively (`S^W`).
pub const EXHAUSTIVE_PLANS: usize = 50_000;

/// One worker as the planner sees it (times in µs).
#[derive(Clone, Debug, PartialEq)]
pub struct PlanWorker {
    /// Per stage: predicted task time.
    pub task_us: Vec<f64>,
    /// Per stage: predicted time to make the stage live (0 when it is live).
    pub load_us: Vec<f64>,
    /// Per stage: the stage fits the worker's RAM budget.
    pub fits: Vec<bool>,
    /// Its live stage, if any.
    pub live: Option<usize>,
}

fn good(t: f64) -> bool {
    t.is_finite() && t > 0.0
}

/// The predicted finish of the last stage under `plan` (module doc); `+inf` if a stage with
/// work has no home worker or a worker is put on a stage that does not fit.
pub fn plan_cost(workers: &[PlanWorker], unclaimed: &[usize], plan: &[usize], jit: bool) -> f64 {
    let mut prev_finish = 0.0f64;
    let mut prev_first = 0.0f64;
    for (k, &uk) in unclaimed.iter().enumerate() {
        let start = if k == 0 { 0.0 } else { prev_first };
        let mut rate = 0.0;
        let mut lost = 0.0;
        let mut fastest = f64::INFINITY;
        let mut first = f64::INFINITY;
        for (w, &h) in workers.iter().zip(plan) {
            if h != k {
                continue;
            }
            let (Some(&t), Some(&l)) = (w.task_us.get(k), w.load_us.get(k)) else {
                return f64::INFINITY;
            };
            if !(good(t) && l.is_finite() && l >= 0.0 && w.fits.get(k).copied().unwrap_or(false)) {
                return f64::INFINITY;
            }
            let b = if jit && l > 0.0 { start } else { 0.0 };
            rate += 1.0 / t;
            lost += (b + l) / t;
            fastest = fastest.min(t);
            first = first.min(start.max(b + l) + t);
        }
        let u = uk as f64;
        if uk == 0 {
            // Nothing left here: the stage neither delays nor feeds anything new.
            prev_first = if rate > 0.0 { first } else { prev_first };
            continue;
        }
        if rate <= 0.0 {
            return f64::INFINITY;
        }
        let finish = ((u + lost) / rate).max(start + u / rate).max(prev_finish + fastest);
        prev_finish = finish;
        prev_first = first;
    }
    prev_finish
}

fn moved(workers: &[PlanWorker], plan: &[usize]) -> usize {
    workers.iter().zip(plan).filter(|(w, h)| w.live.is_some_and(|l| l != **h)).count()
}

/// The home stage of each worker (module doc); `None` when no plan has a finite cost (no stage
/// fits anyone, a cost is missing) or there are no workers or stages.
pub fn plan_stages(workers: &[PlanWorker], unclaimed: &[usize], jit: bool) -> Option<Vec<usize>> {
    let s = unclaimed.len();
    let w = workers.len();
    if s == 0 || w == 0 {
        return None;
    }
    let total = (0..w).try_fold(1usize, |acc, _| acc.checked_mul(s).filter(|&n| n <= EXHAUSTIVE_PLANS));
    let better = |c: f64, p: &[usize], best: &Option<(f64, usize, Vec<usize>)>| -> bool {
        let m = moved(workers, p);
        match best {
            None => c.is_finite(),
            Some((bc, bm, bp)) => {
                c < *bc * (1.0 - 1e-9) || (c <= *bc * (1.0 + 1e-9) && (m, p) < (*bm, bp.as_slice()))
            }
        }
    };
    let mut best: Option<(f64, usize, Vec<usize>)> = None;
    if let Some(total) = total {
        let mut plan = vec![0usize; w];
        for code in 0..total {
            let mut c = code;
            for slot in plan.iter_mut().rev() {
                *slot = c % s;
                c /= s;
            }
            let cost = plan_cost(workers, unclaimed, &plan, jit);
            if better(cost, &plan, &best) {
                best = Some((cost, moved(workers, &plan), plan.clone()));
            }
        }
        let base = stagewise_cost(workers, unclaimed);
        return best.filter(|b| b.0 < (1.0 - PLAN_MARGIN) * base).map(|b| b.2);
    }
    // Greedy: fastest first; each worker to the stage that gives the least cost so far.
    let mut order: Vec<usize> = (0..w).collect();
    let speed = |i: usize| workers[i].task_us.iter().copied().filter(|t| good(*t)).sum::<f64>();
    order.sort_by(|&a, &b| speed(a).total_cmp(&speed(b)).then(a.cmp(&b)));
    let mut plan: Vec<Option<usize>> = vec![None; w];
    for &i in &order {
        let mut pick: Option<(f64, usize)> = None;
        let empty: Vec<usize> = (0..s).filter(|&k| unclaimed[k] > 0 && !plan.contains(&Some(k))).collect();
        for k in 0..s {
            if !workers[i].fits.get(k).copied().unwrap_or(false) || (!empty.is_empty() && !empty.contains(&k))
            {
                continue;
            }
            plan[i] = Some(k);
            let placed: Vec<usize> = (0..w).filter(|&j| plan[j].is_some()).collect();
            let sub: Vec<PlanWorker> = placed.iter().map(|&j| workers[j].clone()).collect();
            let p: Vec<usize> = placed.iter().filter_map(|&j| plan[j]).collect();
            // Stages still without a home are not charged yet.
            let u: Vec<usize> =
                (0..s).map(|q| if p.contains(&q) || q < k { unclaimed[q] } else { 0 }).collect();
            let cost = plan_cost(&sub, &u, &p, jit);
            let cost = if cost.is_finite() { cost } else { f64::MAX };
            if pick.is_none_or(|(c, _)| cost < c) {
                pick = Some((cost, k));
            }
        }
        plan[i] = pick.map(|p| p.1);
    }
    let plan: Vec<usize> = plan.into_iter().collect::<Option<Vec<_>>>()?;
    let cost = plan_cost(workers, unclaimed, &plan, jit);
    (cost.is_finite() && cost < (1.0 - PLAN_MARGIN) * stagewise_cost(workers, unclaimed)).then_some(plan)
}
